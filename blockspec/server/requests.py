"""Request validation: an OpenAI request body becomes a Prepared job, or an ApiError naming the field."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from ..config import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingSettings
from ..errors import BlockspecError
from ..models.tokenizer import TooManyTokens
from ..models.text import Stops, StopsError

CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}
RANGES = {"temperature": f"must be a finite number in [0, {MAX_TEMPERATURE:g}] (0, or below {MIN_TEMPERATURE:g}: "
                         "greedy)",
          "top_p": "must be in (0, 1]", "top_k": "must be -1 or 0 (no limit), or 1 up to the vocabulary size ({vocab})",
          "min_p": "must be in [0, 1]", "seed": "must be an integer in 0..2^63-1"}
IMAGE_PART_TYPES = {"image_url", "input_image", "image"}
MESSAGE_EXTRAS = {"name": str, "tool_calls": list, "tool_call_id": str, "reasoning_content": str}  # for the template
# Fields of vLLM's and OpenAI's APIs that change the output, served at their neutral value only: name -> (the
# endpoints, "chat" or "completion", the neutral values, what a request sending another value asks for)
AT_NEUTRAL_ONLY = {
    "min_tokens": ({"chat", "completion"}, (0,), "a minimum length (EOS ends generation)"),
    "skip_special_tokens": ({"chat", "completion"}, (True,), "special tokens in the text (they are left out)"),
    "prompt_logprobs": ({"chat", "completion"}, (), "prompt logprobs"),
    "truncate_prompt_tokens": ({"chat", "completion"}, (), "prompt truncation"),
    "echo": ({"chat"}, (False,), "returning the prompt with the reply"),
    "continue_final_message": ({"chat"}, (False,), "continuing the last message"),
    "chat_template": ({"chat"}, (), "a request's own chat template (the checkpoint's is used)"),
    "chat_template_kwargs": ({"chat"}, ({}, {"enable_thinking": False}),
                             "chat template arguments (the template renders with enable_thinking false)"),
    "modalities": ({"chat"}, (["text"],), "outputs other than text"),
    "audio": ({"chat"}, (), "audio output"),
    "prediction": ({"chat"}, (), "a predicted output"),
    "reasoning_effort": ({"chat"}, (), "a reasoning effort (the chat template decides)"),
    "use_beam_search": ({"chat", "completion"}, (False,), "beam search"),
    "length_penalty": ({"chat", "completion"}, (1, 1.0), "a length penalty (it applies to beam search)"),
    "typical_p": ({"chat", "completion"}, (1, 1.0), "typical sampling"),
    "allowed_token_ids": ({"chat", "completion"}, (), "a restricted vocabulary"),
    "bad_words": ({"chat", "completion"}, ([],), "banned words"),
    "logits_processors": ({"chat", "completion"}, ([],), "logits processors"),
    "return_tokens_as_token_ids": ({"chat", "completion"}, (False,), "tokens as token ids"),
    "vllm_xargs": ({"chat", "completion"}, ({},), "vLLM's extra arguments"),
}
# Fields of vLLM and SGLang that constrain decoding (any value but null asks for it)
CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "regex",
               "ebnf")
# stream_options keys: name -> whether true is served (false always is); vLLM's continuous_usage_stats puts usage in
# every chunk
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": False}
# Fields of one endpoint that a request to the other may not carry: the other endpoint would ignore them
ENDPOINT_FIELDS = {"chat": ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                            "chat_template_kwargs", "modalities"),
                   "completion": ("prompt", "suffix")}
ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
# OpenAI's fields about the request, not its output: their types checked, their values not used
ABOUT_THE_REQUEST = {"user": (str, "a string"), "metadata": (dict, "an object"), "store": (bool, "a boolean"),
                     "service_tier": (str, "a string"), "prompt_cache_key": (str, "a string"),
                     "safety_identifier": (str, "a string"), "request_id": (str, "a string"),
                     "priority": (int, "an integer")}
# Every top-level field a request may carry (the checks below name each): any other is refused, as OpenAI refuses
# it, since an unknown field (vLLM ignores them) may ask for an output it would not get
FIELDS = frozenset({
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "cache_salt", "add_generation_prompt", "split_special_tokens", "suffix", "echo", "n", "best_of", "logprobs",
    "top_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "response_format",
    "tools", "functions", "tool_choice", "parallel_tool_calls", "function_call", *CONSTRAINTS, *AT_NEUTRAL_ONLY,
    *ABOUT_THE_REQUEST, *(name for names in ENDPOINT_FIELDS.values() for name in names)})
MAX_DEPTH = 32                               # arrays and objects inside one another in a request body
SCAN_PIECE = 1 << 16                         # bytes json_values scans at a time, the GIL free between pieces
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # what a JSON \ud800 escape without its pair decodes to


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


def internal_error(request_id: str) -> ApiError:
    """The answer to a request that failed inside the server: its id only, which the log's traceback carries too
    (exception text could hold paths, shapes or memory addresses)."""
    return ApiError(500, f"internal error (request id {request_id}); the server's log has the details",
                    type_="server_error", code="internal_error")


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def parse_json(raw: bytes, max_values: int):
    """The request body as JSON, or ApiError 400 naming where it goes wrong: at most max_values values (counted
    before json.loads, which holds the GIL throughout: a body of a million empty arrays would stall the event loop
    for ~0.5 s), UTF-8, standard JSON (NaN and Infinity are not JSON), at most MAX_DEPTH levels deep, every string
    and key made of Unicode scalar values (a lone surrogate escape such as \\ud800 is refused: no tokenizer or
    answer could carry it)."""
    if not raw.strip():
        raise bad("the request body is empty: send a JSON object")
    if json_values(raw, max_values) > max_values:
        raise bad(f"the request body holds more than {max_values} JSON values (array elements, object members and "
                  "containers); a request that fits the context needs far fewer")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise bad(f"the request body nests arrays and objects deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # not JSON, NaN / Infinity, an integer of more than 4300 digits (Python's advice cut)
        raise bad(f"the request body is not valid JSON: {str(exc).split(';')[0]}") from None
    _check_nesting_and_text(body)
    return body


def json_values(raw: bytes, limit: int) -> int:
    """The values of a JSON text, as its ',' '[' and '{' outside strings count them (every element or member past
    a container's first, and every container), exactly while at most `limit`, else some number above it. In C-speed
    passes: first over the whole text, counting inside strings too (an upper bound, enough for almost every body),
    then, past the limit, outside strings only, SCAN_PIECE bytes at a time so that the event loop runs between
    pieces. Escapes are removed first, so every '"' left opens or closes a string (in a text that is not JSON the
    count may be wrong only past its first error, where json.loads stops)."""
    upper = sum(raw.count(c) for c in b",[{")
    if upper <= limit:
        return upper
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    count, inside = 0, False
    for start in range(0, len(text), SCAN_PIECE):
        parts = text[start:start + SCAN_PIECE].split(b'"')
        outside = b"".join(parts[1 if inside else 0::2])
        count += outside.count(b",") + outside.count(b"[") + outside.count(b"{")
        if count > limit:
            break
        inside ^= len(parts) % 2 == 0
    return count


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_nesting_and_text(body):
    # iterative: a deep body must not exhaust the stack; paths are built only for the error message
    stack = [(body, (), 1)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            if found := LONE_SURROGATE.search(value):
                raise bad(f"{_path(where)}: the text holds a lone surrogate (U+{ord(found.group()):04X}) at character "
                          f"{found.start()}: text must be valid Unicode", where[0] if where else None)
            continue
        if depth > MAX_DEPTH:
            raise bad(f"{_path(where)}: the request body nests arrays and objects deeper than {MAX_DEPTH} levels",
                      where[0] if where else None)
        if isinstance(value, dict):
            for key, item in value.items():
                if LONE_SURROGATE.search(key):
                    raise bad(f"{_path(where)}: a key holds a lone surrogate: text must be valid Unicode",
                              where[0] if where else None)
                stack.append((item, (*where, key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, (*where, i), depth + 1) for i, item in enumerate(value)
                         if isinstance(item, (str, list, dict)))


def _path(where: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content' (a long key cut short)."""
    text = "".join(f"[{part}]" if isinstance(part, int) else f".{part[:40]}" for part in where).lstrip(".")
    return text or "the request body"


def shown(text: str, limit: int = 60) -> str:
    """A client's string quoted in a message, cut short."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


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


def get_number(body: dict, name: str, default=None, bounds: tuple[float, float] | None = None):
    """The number `name` (default when absent); with bounds (low, high) it must be finite and within them."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be a number (got {_json_type(value)})", name)
    try:
        value = float(value)
    except OverflowError:  # an integer literal beyond float's range
        value = math.inf if value > 0 else -math.inf
    if bounds is not None and not (math.isfinite(value) and bounds[0] <= value <= bounds[1]):
        raise bad(f"'{name}' must be a finite number within [{bounds[0]:g}, {bounds[1]:g}] (got {value:g})", name)
    return value


def same_json(a, b) -> bool:
    """Equal as JSON values: of one type (True is not 1), equal members."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same_json, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    return a == b


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
    sampling: dict            # the request's sampling values, its own or the server's defaults (Engine.stream)
    snapshot_at: int | None = None  # a chat: where its conversation ends, before the generation prompt
    stop_at_eos: bool = True        # False: vLLM's ignore_eos (generate max_tokens tokens)
    cache_salt: str | None = None   # vLLM's: a kept prefix is reused only by requests of the same salt
    stops: Stops = Stops()          # what else ends the reply (models/text.py ReplyText)


def unserved(n: int = 1, logprobs: bool = False, images: bool = False, constraints: bool = False):
    """Why a request asks for what blockspec serves in no mode (one line naming it), or None."""
    refusals = [
        (n != 1, f"n={n}: blockspec generates one sequence per request, in every mode"),
        (logprobs, "logprobs: not supported by blockspec, in any mode"),
        (images, "image inputs: blockspec serves text only, in every mode"),
        (constraints, "decode constraints: not supported by blockspec, in any mode"),
    ]
    return next((why for asked, why in refusals if asked), None)


class RequestParser:
    """Turns an OpenAI request body into token ids + max_tokens, refusing (ApiError 400) what blockspec cannot
    serve exactly. Uses only engine.check_request and the tokenizer: the decode state is never touched."""

    def __init__(self, engine):
        self.engine = engine
        self.sampling_defaults = engine.serving_defaults()
        # a prompt that fits the context has fewer values than ~4 per token (a message or content part per token at
        # worst) plus the other fields: json.loads of this many stays within ~10 ms per 10^5 values
        self.max_values = 4 * engine.context_length + 4096

    def refuse_unless(self, param: str, hint: str = "", **request):
        """Refuse, naming the field, what `unserved` refuses of this one field."""
        why = unserved(**request)
        if why is not None:
            raise bad(f"{why}{hint}", param)

    def sampling(self, body: dict) -> dict:
        """temperature, top_p, seed (OpenAI) and top_k, min_p (as vLLM accepts them): each the request's, else the
        server's default (Engine.serving_defaults), else left to the engine (greedy)."""
        values = {"temperature": get_number(body, "temperature"), "top_p": get_number(body, "top_p"),
                  "top_k": get_int(body, "top_k"), "min_p": get_number(body, "min_p"), "seed": get_int(body, "seed")}
        if values["top_k"] == -1:  # vLLM's "no limit", which its clients send
            values["top_k"] = 0
        for name, value in values.items():
            if value is None:
                continue
            try:
                SamplingSettings.build({name: value})
                valid = name != "top_k" or value <= self.engine.vocab_size
            except BlockspecError:
                valid = False
            if not valid:
                given = str(body[name])
                raise bad(f"{name}={given if len(given) <= 40 else given[:40] + '...'}: "
                          f"{RANGES[name].format(vocab=self.engine.vocab_size)}", name)
        return {**self.sampling_defaults, **{k: v for k, v in values.items() if v is not None}}

    def common(self, body: dict, kind: str) -> tuple[bool, bool, str]:
        other = "completion" if kind == "chat" else "chat"
        for name in ENDPOINT_FIELDS[other]:
            if body.get(name) is not None:
                raise bad(f"'{name}' is a field of {ENDPOINT_PATHS[other]}, not of {ENDPOINT_PATHS[kind]}", name)
        unknown = next((name for name in body if name not in FIELDS), None)
        if unknown is not None:
            raise bad(f"unknown field {shown(unknown)}: blockspec takes OpenAI's and vLLM's fields that it serves "
                      "(README, \"Refusals\"); omit it", unknown[:60])
        for name, (python_type, wanted) in ABOUT_THE_REQUEST.items():
            value = body.get(name)
            if value is not None and not isinstance(value, python_type):
                raise bad(f"'{name}' must be {wanted} (got {_json_type(value)})", name)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad(f"'model' must be a string (got {_json_type(model)})", "model")
        if model and model != self.engine.model_name:
            raise ApiError(404, f"model {shown(model)} is not served here; this server serves "
                           f"'{self.engine.model_name}' (see GET /v1/models)", "model", code="model_not_found")
        self.refuse_unless("n", n=get_int(body, "n", 1))
        best_of = get_int(body, "best_of", 1)
        if best_of != 1:
            raise bad(f"best_of={best_of}: blockspec generates one sequence per request", "best_of")
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, int):
            raise bad(f"'logprobs' must be a boolean (chat) or an integer (got {_json_type(logprobs)})", "logprobs")
        if logprobs is not None and logprobs is not False:  # an integer, 0 included, asks for logprobs
            self.refuse_unless("logprobs", logprobs=True)
        if get_int(body, "top_logprobs", 0) != 0:
            self.refuse_unless("top_logprobs", logprobs=True)
        for name, neutral, bounds in (("frequency_penalty", 0.0, (-2.0, 2.0)), ("presence_penalty", 0.0, (-2.0, 2.0)),
                                      ("repetition_penalty", 1.0, (0.0, math.inf))):
            value = get_number(body, name, neutral, bounds)
            if value != neutral:
                raise bad(f"{name}={body[name]}: penalties are not supported by blockspec, in any mode (omit {name})",
                          name)
        logit_bias = get_object(body, "logit_bias")
        if logit_bias and any(type(v) not in (int, float) or v != 0 for v in logit_bias.values()):  # 0: no bias
            self.refuse_unless("logit_bias", constraints=True)
        response_format = get_object(body, "response_format")
        if response_format is not None:
            if response_format.get("type") not in ("text", "json_object", "json_schema"):
                raise bad("'response_format' must be an object whose 'type' is \"text\", \"json_object\" or "
                          "\"json_schema\" (the last two are refused)", "response_format")
            if response_format["type"] != "text":
                self.refuse_unless("response_format", constraints=True)
        for name in CONSTRAINTS:
            if body.get(name) is not None:
                self.refuse_unless(name, constraints=True)
        for name in ("tools", "functions"):  # an empty array asks for nothing
            value = body.get(name)
            if value is not None and not isinstance(value, list):
                raise bad(f"'{name}' must be an array (got {_json_type(value)})", name)
            if value:
                raise bad(f"{name}: function calling is not supported by blockspec", name)
        for name in ("tool_choice", "parallel_tool_calls", "function_call"):  # as OpenAI: only beside tools
            if body.get(name) is not None and not (name in ("tool_choice", "function_call") and body[name] == "none"):
                raise bad(f"{name}: function calling is not supported by blockspec (omit {name})", name)
        if kind == "completion":
            if get_bool(body, "echo"):
                raise bad("echo: returning the prompt with the completion is not supported by blockspec", "echo")
            suffix = body.get("suffix")
            if suffix is not None and not isinstance(suffix, str):
                raise bad(f"'suffix' must be a string (got {_json_type(suffix)})", "suffix")
            if suffix:
                raise bad("suffix: insertion (fill-in-the-middle) is not supported by blockspec", "suffix")
        for name, (kinds, neutral, what) in AT_NEUTRAL_ONLY.items():
            value = body.get(name)
            if kind in kinds and value is not None and not any(same_json(value, n) for n in neutral):
                given = json.dumps(value)
                raise bad(f"{name}={given if len(given) <= 40 else given[:40] + '...'}: {what} is not supported by "
                          f"blockspec (omit {name})", name)
        stream = get_bool(body, "stream", False)
        options = get_object(body, "stream_options")
        if options is not None and not stream:
            raise bad("'stream_options' is allowed only with \"stream\": true", "stream_options")
        options = options or {}
        for key, value in options.items():
            if key not in STREAM_OPTIONS:
                raise bad(f"stream_options: {shown(key)} is not supported by blockspec (known: "
                          f"{', '.join(STREAM_OPTIONS)})", "stream_options")
            if not isinstance(value, bool):
                raise bad(f"'stream_options.{key}' must be a boolean", "stream_options")
            if value and not STREAM_OPTIONS[key]:
                raise bad(f"'stream_options.{key}' true is not supported by blockspec (usage comes in the last "
                          "chunk alone, with include_usage)", "stream_options")
        include_usage = options.get("include_usage", False)
        return stream, include_usage, model or self.engine.model_name

    def stops(self, body: dict) -> Stops:
        """OpenAI's `stop` (a string or an array of them), vLLM's `stop_token_ids` and `include_stop_str_in_output`."""
        include = get_bool(body, "include_stop_str_in_output", False)
        try:
            return Stops.build(body.get("stop"), body.get("stop_token_ids"), include, self.engine.vocab_size,
                               _json_type)
        except StopsError as e:
            raise bad(str(e), e.field) from None

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
            if not isinstance(role, str) or role not in CHAT_ROLES:
                got = shown(role) if isinstance(role, str) else _json_type(role)
                raise bad(f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))} (got {got})", "messages")
            content = message.get("content")
            if content is None:
                content = ""
            elif isinstance(content, list):
                content = self.content_parts(content, where)
            elif not isinstance(content, str):
                raise bad(f"{where}.content must be a string or an array of content parts "
                          f"(got {_json_type(content)})", "messages")
            item = {"role": "system" if role == "developer" else role, "content": content}
            for key, kind in MESSAGE_EXTRAS.items():
                value = message.get(key)
                if value is None:
                    continue
                if not isinstance(value, kind) or (kind is list and not all(isinstance(v, dict) for v in value)):
                    wanted = "an array of objects" if kind is list else "a string"
                    raise bad(f"{where}.{key} must be {wanted} (got {_json_type(value)})", "messages")
                item[key] = value
            out.append(item)
        return out

    def content_parts(self, parts: list, where: str) -> str:
        texts = []
        for j, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str):
                raise bad(f"{where}.content[{j}] must be an object with a string 'type' (a text part: "
                          "{\"type\": \"text\", \"text\": ...})", "messages")
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise bad(f"{where}.content[{j}].text must be a string", "messages")
                texts.append(text)
            elif kind in IMAGE_PART_TYPES:
                raise bad(f"{where}.content[{j}]: {unserved(images=True)}", "messages")
            else:
                raise bad(f"{where}.content[{j}]: content part type {shown(kind)} is not supported "
                          "(blockspec serves text parts only)", "messages")
        return "".join(texts)

    def completion_prompt(self, body: dict) -> list[int]:
        split_special_tokens = get_bool(body, "split_special_tokens", True)
        prompt = body.get("prompt")
        if prompt is None:
            raise bad("'prompt' is required: a string or an array of token ids", "prompt")
        batch = isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list))
        if batch:
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            try:
                return self.engine.tokenizer.encode(prompt, split_special_tokens, self.most_prompt_tokens)
            except TooManyTokens as exc:
                raise bad(f"{exc} (context_length {self.engine.context_length})", "prompt") from None
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if not batch and isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
            raise bad(f"'prompt' holds {len(prompt)} prompts: blockspec serves one prompt per request", "prompt")
        raise bad("'prompt' must be a string or an array of token ids", "prompt")

    @property
    def most_prompt_tokens(self) -> int:
        return self.engine.context_length - 1  # room for one generated token

    def parse(self, raw: bytes, kind: str) -> Prepared:
        """The request body (bytes) as a Prepared job. CPU-heavy (JSON, tokenization): run off the event loop."""
        body = parse_json(raw, self.max_values)
        if not isinstance(body, dict):
            raise bad(f"the request body must be a JSON object (got {_json_type(body)})")
        stream, include_usage, model = self.common(body, kind)
        stops = self.stops(body)
        sampling = self.sampling(body)
        cache_salt = body.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise bad(f"'cache_salt' must be a non-empty string (got {json.dumps(cache_salt)[:40]})", "cache_salt")
        if kind == "chat":
            if not get_bool(body, "split_special_tokens", True):
                raise bad("split_special_tokens: message text never becomes control tokens; send raw special tokens "
                          "to /v1/completions", "split_special_tokens")
            messages = self.chat_messages(body)
            generation_prompt = get_bool(body, "add_generation_prompt", True)
            try:
                prompt_ids = self.engine.tokenizer.chat_prompt_ids(messages, self.most_prompt_tokens,
                                                                   generation_prompt)
            except TooManyTokens as exc:
                raise bad(f"{exc} (context_length {self.engine.context_length})", "messages") from None
            except BlockspecError as exc:
                raise bad(str(exc), "messages") from None
            snapshot_at = self.engine.tokenizer.conversation_length(messages, prompt_ids)
            prompt_param = "messages"
        else:
            prompt_ids, snapshot_at = self.completion_prompt(body), None
            prompt_param = "prompt"
        # OpenAI's chat field replaced max_tokens, which completions (and older chat clients) send: either, on both
        explicit, max_param = get_int(body, "max_completion_tokens", None), "max_completion_tokens"
        legacy = get_int(body, "max_tokens", None)
        if explicit is None:
            explicit, max_param = legacy, "max_tokens"
        elif legacy is not None and legacy != explicit:
            raise bad(f"max_tokens ({legacy}) and max_completion_tokens ({explicit}) differ: send one of them",
                      "max_tokens")
        if not prompt_ids:
            raise bad("the prompt is empty: give at least one token", prompt_param)
        room = self.engine.context_length - len(prompt_ids)
        if room < 1:
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
        return Prepared(kind, prompt_ids, max_tokens, stream, include_usage, model, sampling, snapshot_at,
                        not get_bool(body, "ignore_eos", False), cache_salt, stops)
