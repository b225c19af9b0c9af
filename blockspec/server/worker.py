"""The single engine worker: one thread runs the engine, jobs wait in a bounded queue."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from ..errors import BlockspecError
from .connection import ClientLeft
from .requests import ApiError, internal_error

log = logging.getLogger("blockspec.server")


class QueueFull(Exception):
    pass


class Closed(Exception):
    """The worker takes no new jobs: the server is shutting down."""


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    sampling: dict = field(default_factory=dict)  # Engine.stream's sampling arguments (Prepared.sampling)
    snapshot_at: int | None = None  # Engine.stream's (Prepared.snapshot_at)
    stop_at_eos: bool = True        # Engine.stream's (Prepared.stop_at_eos)
    cache_salt: str | None = None   # Prepared.cache_salt
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # queued -> running -> finished; running -> stopping (its client left) -> finished; queued -> abandoned
    state: str = "queued"
    interruption: ApiError | None = None  # the answer of a job stopped before its end (the server shutting down)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None

    def emit(self, kind: str, value=None):
        """Hand an event to the request's event loop (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()


class Worker:
    """The only thread that runs the engine: jobs run one after another, in arrival order. At most queue_size jobs
    wait besides the running one; a job whose client left stops counting at once, before the engine has stopped it."""

    def __init__(self, engine, queue_size: int):
        self.engine = engine
        self.queue_size = queue_size
        self.lock = threading.Lock()
        self.wakeup = threading.Condition(self.lock)
        self.waiting: deque[Job] = deque()
        self.running: Job | None = None
        self.served = 0
        self.cache_salt = None  # the salt of the request whose conversation the engine keeps (Job.cache_salt)
        self.closed = False
        self.stopped = False
        self.thread = threading.Thread(target=self.loop, name="blockspec-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job):
        with self.lock:
            if self.closed:
                raise Closed()
            live = len(self.waiting) + (1 if self.running is not None and self.running.state == "running" else 0)
            if live > self.queue_size:
                raise QueueFull(len(self.waiting))
            self.waiting.append(job)
            self.wakeup.notify()

    def cancel(self, job: Job) -> str | None:
        """Stop a job whose client left: a queued one leaves the queue at once, a running one gives its place up at
        once and stops at its next token or prefill chunk. Returns the state the job was in when it still had work,
        else None."""
        job.cancelled.set()
        with self.lock:
            if job.state == "queued":
                self.waiting.remove(job)
                job.state = "abandoned"
                job.emit("error", ClientLeft("while its request waited for the engine"))
                return "queued"
            if job.state == "running":
                job.state = "stopping"
                return "running"
        return None

    def close(self, answer: ApiError):
        """Take no new jobs and answer every waiting one with `answer`; the running job goes on."""
        with self.lock:
            self.closed = True
            for job in self.waiting:
                job.state = "abandoned"
                job.emit("error", answer)
            self.waiting.clear()

    def interrupt(self, answer: ApiError):
        """Stop the running job at its next token and end it with `answer`."""
        with self.lock:
            job = self.running
            if job is not None and job.state == "running":
                job.interruption = answer
                job.cancelled.set()

    def load(self) -> dict:
        with self.lock:
            return {"running": 1 if self.running else 0, "waiting": len(self.waiting), "queue_size": self.queue_size,
                    "served": self.served}

    def next_job(self) -> Job | None:
        with self.lock:
            while not self.waiting and not self.stopped:
                self.wakeup.wait()
            if self.stopped:
                return None
            job = self.waiting.popleft()
            job.state, self.running = "running", job
            return job

    def loop(self):
        import torch

        while (job := self.next_job()) is not None:
            job.emit("start")
            final = ("error", ApiError(500, "generation did not finish", type_="server_error"))
            try:
                with torch.no_grad():
                    final = self.execute(job)
            finally:
                with self.lock:  # free the engine before answering, so a client's next request is never refused
                    job.state, self.running = "finished", None
                    self.served += 1
                job.emit(*final)

    def execute(self, job: Job) -> tuple[str, object]:
        """Run one job, streaming its tokens; return its final event: ("done", stats) or ("error", ApiError)."""
        job.started = time.perf_counter()
        if job.cache_salt != self.cache_salt:  # the kept conversation is another salt's: none of it is reused
            self.engine.forget_prefix()
            self.cache_salt = job.cache_salt
        tokens = self.engine.stream(job.prompt_ids, job.max_tokens, job.stop_at_eos, **job.sampling,
                                    snapshot_at=job.snapshot_at, cancelled=job.cancelled.is_set)
        try:
            for token in tokens:
                job.emit("token", token)
                if job.cancelled.is_set():
                    break
            tokens.close()  # runs the engine's cleanup now, so last_stats is this request's
            if job.interruption is not None:
                return "error", job.interruption
            stats = dict(self.engine.last_stats)
            stats["queue_s"] = round(job.started - job.submitted, 6)
            return "done", stats
        except BlockspecError as exc:
            return "error", ApiError(400, str(exc))
        except Exception:  # a bug or a device error: the request fails, the server stays up
            request_id = uuid.uuid4().hex[:16]
            log.exception("request %s: generation failed", request_id)
            return "error", internal_error(request_id)
        finally:
            tokens.close()

    def stop(self):
        with self.lock:
            self.stopped = True
            self.wakeup.notify()


async def wait_started(job: Job):
    """Wait until the engine takes the job up; raises its answer (ApiError, ClientLeft) when it never will."""
    kind, value = await job.events.get()
    if kind == "error":
        raise value


async def job_events(job: Job):
    """Async iterator over (tokens, final) batches of a started job: every token already available comes at once;
    `final` is ("done", stats) or ("error", ApiError) on the last batch."""
    while True:
        items = [await job.events.get()]
        while not job.events.empty():
            items.append(job.events.get_nowait())
        tokens, final = [], None
        for kind, value in items:
            if kind == "token":
                tokens.append(value)
            elif kind in ("done", "error"):
                final = (kind, value)
        if tokens or final:
            yield tokens, final
        if final:
            return
