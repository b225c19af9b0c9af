"""The single engine worker: one thread runs the engine, jobs wait in a bounded queue."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..errors import BlockspecError
from .requests import ApiError

log = logging.getLogger("blockspec.server")


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    sampling: dict = field(default_factory=dict)  # Engine.stream's sampling arguments (Prepared.sampling)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"        # queued -> running -> finished, or queued -> abandoned
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None

    def emit(self, kind: str, value=None):
        """Hand an event to the request's event loop (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()


class Worker:
    """The only thread that runs the engine: jobs run one after another, in arrival order."""

    def __init__(self, engine, queue_size: int):
        self.engine = engine
        self.queue_size = queue_size
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.outstanding = 0     # jobs admitted and not finished (the running one included)
        self.running: Job | None = None
        self.served = 0
        self.thread = threading.Thread(target=self.loop, name="blockspec-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job):
        with self.lock:
            if self.outstanding > self.queue_size:
                raise QueueFull(self.outstanding - (1 if self.running else 0))
            self.outstanding += 1
        self.jobs.put(job)

    def cancel(self, job: Job):
        """Stop a job: a queued one gives its place up at once, a running one stops at its next token."""
        job.cancelled.set()
        with self.lock:
            if job.state == "queued":
                job.state = "abandoned"
                self.outstanding -= 1

    def load(self) -> dict:
        with self.lock:
            running = 1 if self.running else 0
            return {"running": running, "waiting": self.outstanding - running, "queue_size": self.queue_size,
                    "served": self.served}

    def loop(self):
        import torch

        while True:
            job = self.jobs.get()
            if job is None:
                return
            with self.lock:
                if job.state != "queued":
                    continue  # its client left while it waited
                job.state, self.running = "running", job
            final = ("error", ApiError(500, "generation did not finish", type_="server_error"))
            try:
                with torch.no_grad():
                    final = self.execute(job)
            finally:
                with self.lock:  # free the engine before answering, so a client's next request is never refused
                    job.state, self.running = "finished", None
                    self.outstanding -= 1
                    self.served += 1
                job.emit(*final)

    def execute(self, job: Job) -> tuple[str, object]:
        """Run one job, streaming its tokens; return its final event: ("done", stats) or ("error", ApiError)."""
        job.started = time.perf_counter()
        tokens = self.engine.stream(job.prompt_ids, job.max_tokens, **job.sampling)
        try:
            for token in tokens:
                job.emit("token", token)
                if job.cancelled.is_set():
                    break
            tokens.close()  # runs the engine's cleanup now, so last_stats is this request's
            stats = dict(self.engine.last_stats)
            stats["queue_s"] = round(job.started - job.submitted, 6)
            return "done", stats
        except BlockspecError as exc:
            return "error", ApiError(400, str(exc))
        except Exception as exc:  # a bug or a device error: the request fails, the server stays up
            log.exception("generation failed")
            return "error", ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", type_="server_error")
        finally:
            tokens.close()

    def stop(self):
        self.jobs.put(None)


async def job_events(job: Job):
    """Async iterator over (tokens, final) batches: every token already available comes at once; `final` is
    ("done", stats) or ("error", ApiError) on the last batch."""
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
