"""The FastAPI app (its endpoints) and `serve`, which runs it under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import errno
import functools
import gc
import logging
import signal
import socket
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import ServerSettings
from ..errors import BlockspecError
from ..models.text import ReplyText
from .access import AccessGuard, host_check_warning
from .connection import (MAX_HEAD_BYTES, ClientLeft, TimedH11Protocol, check_unencoded, declared_length, read_body,
                         shutting_down, until_disconnected)
from .requests import ApiError, Prepared, RequestParser, internal_error, shown
from .responses import JobStreamingResponse, sse, stats_extension, usage
from .worker import Closed, Job, QueueFull, Worker, job_events, wait_started

log = logging.getLogger("blockspec.server")


class WithoutUnparsedNotes(logging.Filter):
    """Leaves out uvicorn's own note on a request it could not parse: the server's "refused:" line names the
    request and its answer (connection.py), one line a refusal."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Invalid HTTP request received."


# uvicorn's logging, with the server's own one-line notes (a client leaving, shutdown) beside its access lines
LOG_CONFIG = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
LOG_CONFIG["loggers"]["blockspec"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
LOG_CONFIG.setdefault("filters", {})["without_unparsed_notes"] = {"()": WithoutUnparsedNotes}
LOG_CONFIG["loggers"]["uvicorn.error"]["filters"] = ["without_unparsed_notes"]
# A body above this many bytes, or of unknown length (chunked), is read and parsed in the large bodies' lane
LARGE_BODY = 64 * 1024


class InternalErrors:
    """ASGI middleware: an exception no handler answered (a bug) is logged once, with its traceback, under a request
    id, and the client gets a 500 naming only that id (Starlette's own last handler would let uvicorn log the
    traceback again). A streamed answer already begun just ends."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_noting_start(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception:
            request_id = uuid.uuid4().hex[:16]
            log.exception("request %s (%s %s) failed", request_id, scope["method"], scope["path"])
            if not started:
                await internal_error(request_id).response()(scope, receive, send)


def create_app(engine, settings: ServerSettings = ServerSettings(), bound_address: str | None = None) -> FastAPI:
    """The app; bound_address (the listening socket's address, default settings.host) decides the Host check."""
    worker = Worker(engine, settings.queue_size)
    # JSON parsing, validation and tokenization run on these threads, never on the event loop, in two lanes: large
    # bodies one at a time, the bytes of those being received or parsed at most `large_limit` (queue-size + 1 whole
    # bodies; a body that would pass it is answered 429), so that a flood of them neither holds memory nor delays
    # the small bodies' own lane. Bytes, not bodies, are counted: a client sending slowly holds only what it sent.
    parsing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="blockspec-parse")
    parsing_large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blockspec-parse-large")
    large_limit, large_held = (settings.queue_size + 1) * settings.max_body_bytes, 0
    closing = asyncio.Event()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        worker.stop()
        parsing.shutdown(wait=False)
        parsing_large.shutdown(wait=False)

    # a path with a trailing slash is not redirected (an empty 307) but answered 404 in JSON, as any unknown path
    app = FastAPI(title="blockspec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan,
                  redirect_slashes=False)
    app.add_middleware(AccessGuard, settings=settings, bound_address=bound_address or settings.host)
    app.add_middleware(InternalErrors)
    parser = RequestParser(engine)
    started_at = int(time.time())
    eos = engine.tokenizer.eos_token_ids
    app.state.worker = worker

    def begin_shutdown():
        """Stop taking work: waiting requests are answered 503 now, the running one may go on for the grace period."""
        waiting = worker.load()["waiting"]
        closing.set()
        worker.close(shutting_down())
        grace = settings.shutdown_grace_s
        asyncio.get_running_loop().call_later(grace, worker.interrupt, ApiError(
            503, f"the server is shutting down: this generation was stopped after the {grace:g} s grace period "
            "(--shutdown-grace)", type_="server_error", code="shutting_down"))
        log.info("shutting down: %d waiting request(s) answered 503; a running one may go on for %g s", waiting,
                 grace)

    app.state.begin_shutdown = begin_shutdown

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(ClientLeft)
    async def client_left(request, exc: ClientLeft):
        log.info("client left %s", exc)
        return Response(status_code=499)  # nobody reads it: the connection is closed

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        type_="invalid_request_error" if exc.status_code < 500 else "server_error",
                        headers=exc.headers).response()  # a 405's Allow

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        state = {"status": "shutting_down" if closing.is_set() else "ok", "model": engine.model_name,
                 "mode": engine.mode, "context_length": engine.context_length, **worker.load()}
        return JSONResponse(state, status_code=503 if closing.is_set() else 200)

    def model_card() -> dict:
        return {"id": engine.model_name, "object": "model", "created": started_at, "owned_by": "blockspec",
                "max_model_len": engine.context_length, "blockspec": {"mode": engine.mode}}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        if model_id != engine.model_name:
            raise ApiError(404, f"model {shown(model_id)} is not served here; this server serves '{engine.model_name}'",
                           "model", code="model_not_found")
        return model_card()

    def submit(prepared: Prepared) -> Job:
        job = Job(prepared.prompt_ids, prepared.max_tokens, asyncio.get_running_loop(), prepared.sampling,
                  prepared.snapshot_at, prepared.stop_at_eos, prepared.cache_salt)
        try:
            worker.submit(job)
        except QueueFull as full:
            raise ApiError(429, f"server busy: {full.args[0]} request(s) already waiting for the engine "
                           f"(queue-size {worker.queue_size}); retry later", type_="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        except Closed:
            raise shutting_down() from None
        return job

    def finish_reason(prepared: Prepared, reply: ReplyText) -> str:
        tokens = reply.tokens
        ended = reply.stop_reason is not None or prepared.stop_at_eos and tokens and tokens[-1] in eos
        return "stop" if ended else "length"

    async def reply_events(job: Job, reply: ReplyText):
        """(text piece, final) for each batch of the job's tokens (job_events): the pieces of the reply's text, up
        to its stop (models/text.py ReplyText), after which the job stops at its next token and its final event
        ends the reply."""
        async for batch, final in job_events(job):
            piece = reply.push(batch) if reply.stop_reason is None else ""
            if reply.stop_reason is not None:
                job.cancelled.set()  # the engine stops at its next token: nothing it generates is given out
            if final:  # the tokens generated are given out whole, also before an error
                piece += reply.finish()
            yield piece, final

    def on_disconnect(watcher: asyncio.Future, job: Job):
        """The client closed its connection: its job gives its place up at once and stops at its next token (a
        queued one's handler notes it, answering ClientLeft)."""
        if not watcher.cancelled() and watcher.exception() is None and worker.cancel(job) == "running":
            log.info("client left during its generation: stopped at the next token or prefill chunk")

    def parse_queue_full() -> ApiError:
        return ApiError(429, f"server busy: large request bodies (over {LARGE_BODY // 1024} KiB) being read or "
                        f"parsed already hold {large_held} bytes (at most (queue-size + 1) x --max-body-mb = "
                        f"{large_limit}); retry later", type_="rate_limit_error", code="parse_queue_full",
                        headers={"Retry-After": "1"})

    async def parse(request: Request, kind: str) -> Prepared:
        nonlocal large_held
        check_unencoded(request)
        size = declared_length(request)
        large = size is None or size > LARGE_BODY
        if large and size is not None and large_held + size > large_limit and size <= settings.max_body_bytes:
            raise parse_queue_full()  # refused before its body is read (a larger one gets read_body's 413)
        held = 0

        def hold(chunk: int):
            nonlocal large_held, held
            if large_held + chunk > large_limit:
                raise parse_queue_full()
            large_held, held = large_held + chunk, held + chunk
        try:
            raw = await read_body(request, settings.max_body_bytes, settings.receive_timeout_s, closing,
                                  hold if large else None)
            return await asyncio.get_running_loop().run_in_executor(parsing_large if large else parsing,
                                                                    parser.parse, raw, kind)
        finally:
            large_held -= held

    async def handle(request: Request, kind: str):
        prepared = await parse(request, kind)
        job = submit(prepared)
        watcher = asyncio.ensure_future(until_disconnected(request))
        watcher.add_done_callback(lambda _: on_disconnect(watcher, job))
        streaming = False
        try:
            await wait_started(job)  # headers wait for the engine, so that a request refused meanwhile gets its status
            if prepared.stream:
                streaming = True
                return JobStreamingResponse(stream_events(prepared, job), worker, job, watcher)
            return await complete(prepared, job)
        finally:
            if not streaming:
                watcher.cancel()
                worker.cancel(job)

    async def complete(prepared: Prepared, job: Job):
        reply, pieces, final = ReplyText(engine.tokenizer, prepared.stops), [], None
        async for piece, final in reply_events(job, reply):
            pieces.append(piece)
        if final[0] == "error":
            raise final[1]
        text, created, reason = "".join(pieces), int(time.time()), finish_reason(prepared, reply)
        if prepared.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason, "stop_reason": reply.stop_reason}
            head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion"}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason,
                      "stop_reason": reply.stop_reason}
            head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion"}
        return {**head, "created": created, "model": prepared.model, "choices": [choice],
                "usage": usage(len(prepared.prompt_ids), len(reply.tokens), final[1]),
                "blockspec": stats_extension(final[1], engine)}

    async def stream_events(prepared: Prepared, job: Job):
        chat = prepared.kind == "chat"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                "model": prepared.model}
        extra = {"usage": None} if prepared.include_usage else {}

        def chunk(text: str | None, reason: str | None = None, first: bool = False, stop_reason=None, **more) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            if reason is not None:
                choice["stop_reason"] = stop_reason
            return sse({**head, "choices": [choice], **extra, **more})

        if chat:
            yield chunk(None, first=True)
        reply = ReplyText(engine.tokenizer, prepared.stops)
        async for piece, final in reply_events(job, reply):
            if final and final[0] == "error":
                if piece:
                    yield chunk(piece)
                yield sse(final[1].body())
                break
            if piece:
                yield chunk(piece)
            if final:
                yield chunk(None, finish_reason(prepared, reply), stop_reason=reply.stop_reason,
                            blockspec=stats_extension(final[1], engine))
                if prepared.include_usage:
                    yield sse({**head, "choices": [], "usage": usage(len(prepared.prompt_ids), len(reply.tokens),
                                                                     final[1])})
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    return app


FILES_BESIDE_CONNECTIONS = 256  # the process's other open files: the model's, the libraries', the listening socket


def reserve_files(max_connections: int) -> None:
    """The process's open-file limit raised to hold max_connections connections (twice: as many may linger after
    their answer) and its other files, or a one-line
    BlockspecError naming --max-connections where the hard limit is lower: past the limit the listening socket's
    accept fails on every new connection."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * max_connections + FILES_BESIDE_CONNECTIONS  # open ones, and as many lingering (connection.py)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    limit = soft if hard == resource.RLIM_INFINITY else hard
    try:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise ValueError(f"ulimit -Hn is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    except (ValueError, OSError) as exc:
        raise BlockspecError(f"--max-connections {max_connections}: this process may open too few files for twice "
                             f"the connections and {FILES_BESIDE_CONNECTIONS} more ({exc}); give --max-connections "
                             f"{max(1, (limit - FILES_BESIDE_CONNECTIONS) // 2)} or less") from None


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening; uvicorn listens on it), or a one-line BlockspecError naming
    why not: bind it before loading the model so that a busy port is reported at once. The port is checked to be in
    range already (ServerSettings.check)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise BlockspecError(f"--host {host}: not a known address ({getattr(exc, 'strerror', None) or exc})") \
            from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart is not held up
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            why = f"--port {port}: {host}:{port} is already in use (another server?); stop it or choose another --port"
        elif exc.errno == errno.EACCES:
            why = f"--port {port}: permission denied to listen on {host}:{port}; choose a port above 1023"
        elif exc.errno == errno.EADDRNOTAVAIL:
            why = f"--host {host}: not an address of this machine ({exc.strerror})"
        else:
            why = f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})"
        raise BlockspecError(why) from None
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM or Ctrl-C first has the app stop taking work (begin_shutdown), then stops
    accepting connections and waits for the running requests (uvicorn's own shutdown)."""

    def __init__(self, config: uvicorn.Config, begin_shutdown):
        super().__init__(config)
        self.begin_shutdown = begin_shutdown
        self.accept_error_logged = float("-inf")

    async def shutdown(self, sockets=None):
        self.begin_shutdown()
        await super().shutdown(sockets)

    async def startup(self, sockets=None):
        asyncio.get_running_loop().set_exception_handler(self.loop_error)
        await super().startup(sockets)

    def loop_error(self, loop, context):
        """asyncio's errors outside any request: an accept that failed (out of open files, say: asyncio retries it
        after a second) logged in one line at most once a second, not a traceback each time; others as asyncio
        does."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and "accept" in context.get("message", ""):
            if loop.time() - self.accept_error_logged >= 1.0:
                self.accept_error_logged = loop.time()
                log.warning("cannot accept connections: %s", exc.strerror or exc)
            return
        loop.default_exception_handler(context)


def serve(engine, settings: ServerSettings = ServerSettings(), log_level: str = "info",
          sock: socket.socket | None = None):
    """Run the server until SIGTERM or Ctrl-C (blocking), on `sock` (from bind_socket) or on settings' address."""
    settings.check()
    reserve_files(settings.max_connections)
    sock = sock or bind_socket(settings.host, settings.port)
    address, port = sock.getsockname()[:2]  # port: the one the OS chose for --port 0
    app = create_app(engine, settings, bound_address=address)
    print(f"blockspec: serving '{engine.model_name}' (mode {engine.mode}, context {engine.context_length}) at "
          f"http://{settings.host}:{port}/v1 - one request at a time, up to {settings.queue_size} waiting", flush=True)
    if warning := host_check_warning(settings, address):
        print(f"blockspec: warning: {warning}", file=sys.stderr, flush=True)
    # uvicorn waits this long for the requests to end, past the grace period the app gives the running one
    protocol = functools.partial(TimedH11Protocol, receive_timeout_s=settings.receive_timeout_s,
                                 max_connections=settings.max_connections, max_body_bytes=settings.max_body_bytes)
    config = uvicorn.Config(app, host=settings.host, port=port, http=protocol, log_level=log_level,
                            log_config=LOG_CONFIG, timeout_graceful_shutdown=settings.shutdown_grace_s + 5,
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES)
    # uvicorn raises the signal that stopped it again once it is done: SIGTERM's default action would then kill the
    # process (status 143) after a clean shutdown, so a handler that does nothing takes its place meanwhile
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    # what is loaded by now (torch, the model) lives until exit: the garbage collector's full passes skip it, rather
    # than walk it for ~0.3 s holding the GIL (stalling the event loop) when a large request makes many objects
    gc.freeze()
    try:
        DrainingServer(config, app.state.begin_shutdown).run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C ends the server normally (as uvicorn.run does)
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
