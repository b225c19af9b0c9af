"""OpenAI-compatible HTTP server over one Engine: `blockspec serve`.

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions (streamed as server-sent
events or not). The engine decodes one request at a time on a single worker thread; requests wait in a bounded
queue and are refused with HTTP 429 when it is full. A request the engine cannot serve exactly (sampling,
n > 1, logprobs, stop sequences, images, ...) is refused with HTTP 400 naming the field, before it touches the
engine. A streaming client that goes away stops its generation at the next token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from .errors import BlockspecError

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as _exc:  # the server is an optional extra
    raise BlockspecError(f"blockspec serve needs the 'serve' extras ({_exc.name} is not installed): "
                         "pip install 'blockspec[serve]'") from None

log = logging.getLogger("blockspec.server")

STATS_KEYS = ("mode", "prefill_s", "decode_s", "decode_tokens_per_s", "generated", "cycles",
              "mean_accepted_length", "acceptance_rate")
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}
IMAGE_PART_TYPES = {"image_url", "input_image", "image"}


# ----------------------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


# ------------------------------------------------------------------------------------------ request parsing


def _json_type(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def get_int(body: dict, name: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer (got {_json_type(value)})", name)
    return value


def get_number(body: dict, name: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be a number (got {_json_type(value)})", name)
    return float(value)


def get_bool(body: dict, name: str, default=False):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean (got {_json_type(value)})", name)
    return value


def get_object(body: dict, name: str):
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise bad(f"'{name}' must be an object (got {_json_type(value)})", name)
    return value


@dataclass
class Prepared:
    """A validated request: what the engine will run and how to answer."""

    kind: str                 # "chat" | "completion"
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    model: str


class RequestParser:
    """Turns an OpenAI request body into token ids + max_tokens, refusing (ApiError 400) what blockspec cannot
    serve exactly. Uses only engine.check_request and the tokenizer: the decode state is never touched."""

    def __init__(self, engine):
        self.engine = engine
        self.model_ids = {engine.model_name, str(engine.config.model)}

    def refuse_unless(self, param: str, hint: str = "", **request):
        """Ask the engine whether it serves this one field (on a trivially valid prompt) and name the field."""
        try:
            self.engine.check_request([0], 1, **request)
        except BlockspecError as exc:
            raise bad(f"{exc}{hint}", param) from None

    def common(self, body: dict, kind: str) -> tuple[bool, bool, str]:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad(f"'model' must be a string (got {_json_type(model)})", "model")
        if model and model not in self.model_ids:
            raise ApiError(404, f"model '{model}' is not served here; this server serves '{self.engine.model_name}' "
                           "(see GET /v1/models)", "model", code="model_not_found")
        # OpenAI's default temperature is 1.0; absent means greedy here, an explicit temperature > 0 is refused
        temperature = get_number(body, "temperature", 0.0)
        self.refuse_unless("temperature", " (omit temperature or set it to 0)", temperature=temperature)
        top_p = get_number(body, "top_p", 1.0)
        if top_p < 1.0:
            raise bad(f"top_p={body['top_p']}: blockspec decodes greedily only (nucleus sampling is not supported); "
                      "omit top_p or set it to 1", "top_p")
        top_k = get_int(body, "top_k", None)  # vLLM-style extension
        if top_k is not None and top_k not in (0, 1, -1):
            self.refuse_unless("top_k", top_k=top_k)
        self.refuse_unless("n", n=get_int(body, "n", 1))
        best_of = get_int(body, "best_of", 1)
        if best_of != 1:
            raise bad(f"best_of={best_of}: blockspec generates one sequence per request", "best_of")
        logprobs = body.get("logprobs")
        if logprobs not in (None, False):
            self.refuse_unless("logprobs", logprobs=True)
        if body.get("top_logprobs") not in (None, 0):
            self.refuse_unless("top_logprobs", logprobs=True)
        stop = body.get("stop")
        if stop is not None and not isinstance(stop, (str, list)):
            raise bad(f"'stop' must be a string or an array of strings (got {_json_type(stop)})", "stop")
        if stop:
            self.refuse_unless("stop", stop=stop)
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = get_number(body, name, neutral)
            if value != neutral:
                raise bad(f"{name}={body[name]}: penalties change the greedy choice; blockspec decodes plain greedy "
                          f"only (omit {name})", name)
        if body.get("logit_bias"):
            self.refuse_unless("logit_bias", constraints=True)
        response_format = get_object(body, "response_format")
        if response_format and response_format.get("type", "text") != "text":
            self.refuse_unless("response_format", constraints=True)
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if body.get(name):
                self.refuse_unless(name, constraints=True)
        if body.get("tools"):
            raise bad("tools: function calling is not supported by blockspec", "tools")
        if body.get("functions"):
            raise bad("functions: function calling is not supported by blockspec", "functions")
        if kind == "completion":
            if get_bool(body, "echo"):
                raise bad("echo: returning the prompt with the completion is not supported by blockspec", "echo")
            if body.get("suffix"):
                raise bad("suffix: insertion (fill-in-the-middle) is not supported by blockspec", "suffix")
        stream = get_bool(body, "stream", False)
        options = get_object(body, "stream_options") or {}
        include_usage = options.get("include_usage") or False
        if not isinstance(include_usage, bool):
            raise bad("'stream_options.include_usage' must be a boolean", "stream_options")
        return stream, include_usage, model or self.engine.model_name

    def chat_messages(self, body: dict) -> list[dict]:
        messages = body.get("messages")
        if messages is None:
            raise bad("'messages' is required: a non-empty array of {role, content} objects", "messages")
        if not isinstance(messages, list) or not messages:
            raise bad("'messages' must be a non-empty array of {role, content} objects", "messages")
        out = []
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, dict):
                raise bad(f"{where} must be an object with 'role' and 'content' (got {_json_type(message)})",
                          "messages")
            role = message.get("role")
            if role not in CHAT_ROLES:
                raise bad(f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))} (got {role!r})", "messages")
            content = message.get("content")
            if content is None:
                content = ""
            elif isinstance(content, list):
                content = self.content_parts(content, where)
            elif not isinstance(content, str):
                raise bad(f"{where}.content must be a string or an array of content parts "
                          f"(got {_json_type(content)})", "messages")
            item = {"role": "system" if role == "developer" else role, "content": content}
            for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
                if message.get(key) is not None:
                    item[key] = message[key]
            out.append(item)
        return out

    def content_parts(self, parts: list, where: str) -> str:
        texts = []
        for j, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise bad(f"{where}.content[{j}].text must be a string", "messages")
                texts.append(text)
            elif kind in IMAGE_PART_TYPES:
                try:
                    self.engine.check_request([0], 1, images=True)
                except BlockspecError as exc:
                    raise bad(f"{where}.content[{j}]: {exc}", "messages") from None
                raise bad(f"{where}.content[{j}]: image inputs are not supported", "messages")
            else:
                raise bad(f"{where}.content[{j}]: content part type {kind!r} is not supported "
                          "(blockspec serves text parts only)", "messages")
        return "".join(texts)

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad("'prompt' is required: a string or an array of token ids", "prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
            raise bad(f"'prompt' holds {len(prompt)} prompts: blockspec serves one prompt per request", "prompt")
        raise bad("'prompt' must be a string or an array of token ids", "prompt")

    def parse(self, body, kind: str) -> Prepared:
        if not isinstance(body, dict):
            raise bad(f"the request body must be a JSON object (got {_json_type(body)})")
        stream, include_usage, model = self.common(body, kind)
        if kind == "chat":
            messages = self.chat_messages(body)
            try:
                prompt_ids = self.engine.tokenizer.encode(self.engine.tokenizer.chat_prompt(messages))
            except BlockspecError as exc:
                raise bad(str(exc), "messages") from None
            prompt_param = "messages"
            explicit = get_int(body, "max_completion_tokens", None)
            max_param = "max_completion_tokens"
            if explicit is None:
                explicit, max_param = get_int(body, "max_tokens", None), "max_tokens"
        else:
            prompt_ids = self.completion_prompt(body)
            prompt_param = "prompt"
            explicit, max_param = get_int(body, "max_tokens", None), "max_tokens"
        if not prompt_ids:
            raise bad("the prompt is empty: give at least one token", prompt_param)
        room = self.engine.context_length - len(prompt_ids)
        if explicit is None and room < 1:
            raise bad(f"the prompt is {len(prompt_ids)} tokens but context_length is {self.engine.context_length}: "
                      "no room left to generate; shorten the prompt", prompt_param)
        max_tokens = explicit if explicit is not None else min(self.engine.config.max_tokens, room)
        try:
            self.engine.check_request(prompt_ids, max_tokens)
        except BlockspecError as exc:
            message = str(exc)
            param = max_param if (message.startswith("max_tokens") or "exceeds context_length" in message) \
                and explicit is not None else prompt_param
            if explicit is not None and param == max_param and max_param != "max_tokens":
                message = message.replace("max_tokens", max_param)
            raise bad(message, param) from None
        return Prepared(kind, prompt_ids, max_tokens, stream, include_usage, model)


# ----------------------------------------------------------------------------------------- text streaming


class IncrementalText:
    """Text pieces for a growing token list. Text ending in U+FFFD (a multi-byte character whose remaining bytes
    have not arrived yet) is held back; the pieces concatenate to the decoding of all the tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.start = 0   # tokens[start:shown] is the latest text already given out (decoded again for context)
        self.shown = 0

    def _piece(self, force: bool) -> str:
        before = self.tokenizer.decode(self.tokens[self.start:self.shown])
        after = self.tokenizer.decode(self.tokens[self.start:])
        if after.endswith("\ufffd") and not force:
            return ""
        self.start, self.shown = self.shown, len(self.tokens)
        return after[len(before):]

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        return self._piece(force=False)

    def finish(self) -> str:
        return self._piece(force=True) if self.shown < len(self.tokens) else ""


# -------------------------------------------------------------------------------------------- the worker


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    max_tokens: int
    loop: asyncio.AbstractEventLoop
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
        tokens = self.engine.stream(job.prompt_ids, job.max_tokens)
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


def stats_extension(stats: dict, engine) -> dict:
    out = {k: stats[k] for k in STATS_KEYS if k in stats}
    out.setdefault("mode", engine.mode)
    if "queue_s" in stats:
        out["queue_s"] = stats["queue_s"]
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class JobStreamingResponse(StreamingResponse):
    """A streamed answer that stops its job however the stream ends (finished, client gone, server stopping)."""

    def __init__(self, content, worker: Worker, job: Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.worker, self.job = worker, job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.worker.cancel(self.job)


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


# -------------------------------------------------------------------------------------------------- app


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
        job = Job(prepared.prompt_ids, prepared.max_tokens, asyncio.get_running_loop())
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


def serve(engine, host: str = "127.0.0.1", port: int = 8000, queue_size: int = 8, log_level: str = "info"):
    """Run the server until interrupted (blocking)."""
    if queue_size < 0:
        raise BlockspecError(f"--queue-size must be 0 or more (got {queue_size})")
    if not 0 <= port <= 65535:
        raise BlockspecError(f"--port must be between 0 and 65535 (got {port})")
    app = create_app(engine, queue_size)
    print(f"blockspec: serving '{engine.model_name}' (mode {engine.mode}, context {engine.context_length}) at "
          f"http://{host}:{port}/v1 - one request at a time, up to {queue_size} waiting", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3)
