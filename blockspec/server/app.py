"""The FastAPI app (its endpoints) and `serve`, which runs it under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import socket
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import BlockspecError
from .requests import ApiError, Prepared, RequestParser, bad
from .responses import JobStreamingResponse, sse, stats_extension, usage
from .text import IncrementalText
from .worker import Job, QueueFull, Worker, job_events


def create_app(engine, queue_size: int = 8) -> FastAPI:
    worker = Worker(engine, queue_size)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        worker.stop()

    app = FastAPI(title="blockspec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    parser = RequestParser(engine)
    started_at = int(time.time())
    eos = engine.tokenizer.eos_token_ids
    app.state.worker = worker

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        type_="invalid_request_error" if exc.status_code < 500 else "server_error").response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.model_name, "mode": engine.mode,
                "context_length": engine.context_length, **worker.load()}

    def model_card() -> dict:
        return {"id": engine.model_name, "object": "model", "created": started_at, "owned_by": "blockspec",
                "max_model_len": engine.context_length, "blockspec": {"mode": engine.mode}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in parser.model_ids:
            raise ApiError(404, f"model '{model_id}' is not served here; this server serves '{engine.model_name}'",
                           "model", code="model_not_found")
        return model_card()

    async def read_body(request: Request):
        raw = await request.body()
        if not raw.strip():
            raise bad("the request body is empty: send a JSON object")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad(f"the request body is not valid JSON: {exc}") from None

    def submit(prepared: Prepared) -> Job:
        job = Job(prepared.prompt_ids, prepared.max_tokens, asyncio.get_running_loop(), prepared.sampling)
        try:
            worker.submit(job)
        except QueueFull as full:
            raise ApiError(429, f"server busy: {full.args[0]} request(s) already waiting for the engine "
                           f"(queue-size {worker.queue_size}); retry later", type_="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        return job

    def finish_reason(tokens: list[int]) -> str:
        return "stop" if tokens and tokens[-1] in eos else "length"

    async def handle(request: Request, kind: str):
        prepared = parser.parse(await read_body(request), kind)
        job = submit(prepared)
        if prepared.stream:
            return JobStreamingResponse(stream_events(prepared, job), worker, job)
        try:
            return await complete(request, prepared, job)
        finally:
            worker.cancel(job)

    async def complete(request: Request, prepared: Prepared, job: Job):
        tokens, final = [], None
        events = job_events(job)
        pending = asyncio.ensure_future(events.__anext__())
        while final is None:
            done, _ = await asyncio.wait({pending}, timeout=0.5)
            if not done:
                if await request.is_disconnected():
                    pending.cancel()
                    worker.cancel(job)
                    return JSONResponse({}, status_code=499)
                continue
            batch, final = pending.result()
            tokens += batch
            if final is None:
                pending = asyncio.ensure_future(events.__anext__())
        if final[0] == "error":
            raise final[1]
        text = engine.tokenizer.decode(tokens)
        created, reason = int(time.time()), finish_reason(tokens)
        if prepared.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion"}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion"}
        return {**head, "created": created, "model": prepared.model, "choices": [choice],
                "usage": usage(len(prepared.prompt_ids), len(tokens)),
                "blockspec": stats_extension(final[1], engine)}

    async def stream_events(prepared: Prepared, job: Job):
        chat = prepared.kind == "chat"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                "model": prepared.model}
        extra = {"usage": None} if prepared.include_usage else {}

        def chunk(text: str | None, reason: str | None = None, first: bool = False, **more) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            return sse({**head, "choices": [choice], **extra, **more})

        if chat:
            yield chunk(None, first=True)
        text = IncrementalText(engine.tokenizer)
        async for batch, final in job_events(job):
            piece = text.push(batch) if batch else ""
            if final and final[0] == "error":
                if piece:
                    yield chunk(piece)
                yield sse(final[1].body())
                break
            if final:
                piece += text.finish()
            if piece:
                yield chunk(piece)
            if final:
                tokens = text.tokens
                yield chunk(None, finish_reason(tokens), blockspec=stats_extension(final[1], engine))
                if prepared.include_usage:
                    yield sse({**head, "choices": [], "usage": usage(len(prepared.prompt_ids), len(tokens))})
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening; uvicorn listens on it), or a one-line BlockspecError naming
    why not: bind it before loading the model so that a busy port is reported at once."""
    if not 0 <= port <= 65535:
        raise BlockspecError(f"--port must be between 0 and 65535 (got {port})")
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


def serve(engine, host: str = "127.0.0.1", port: int = 8000, queue_size: int = 8, log_level: str = "info",
          sock: socket.socket | None = None):
    """Run the server until interrupted (blocking), on `sock` (from bind_socket) or on host:port."""
    if queue_size < 0:
        raise BlockspecError(f"--queue-size must be 0 or more (got {queue_size})")
    sock = sock or bind_socket(host, port)
    port = sock.getsockname()[1]  # the port the OS chose for --port 0
    app = create_app(engine, queue_size)
    print(f"blockspec: serving '{engine.model_name}' (mode {engine.mode}, context {engine.context_length}) at "
          f"http://{host}:{port}/v1 - one request at a time, up to {queue_size} waiting", flush=True)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C ends the server normally (as uvicorn.run does)
        pass
