"""`blockspec serve`: a real server subprocess on a loopback port, driven by the openai client and raw HTTP.

Checks the answers against Engine.generate, the usage counts, streaming, concurrency, the bounded queue (429),
a client leaving mid-stream, and every refusal (400 naming the field). One in-process test covers what the
planted tiny model never does (EOS -> finish_reason 'stop', multi-byte characters split across tokens).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from blockspec.engine.engine import Engine  # noqa: E402
from blockspec.server.connection import IDLE_BEFORE_CLOSE_S  # noqa: E402
from live_server import Server  # noqa: E402

CONTEXT = 1024
DEFAULT_MAX = 12          # the main server's --max-tokens: the default reply length
LONG = 900                # a generation long enough to still be running when we act on it


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint(seed=0, planted=True)


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    main = Server(tiny, logs / "main.log", "--mode", "mtp", "--max-tokens", DEFAULT_MAX, "--queue-size", 8)
    small = Server(tiny, logs / "small.log", "--mode", "none", "--queue-size", 1)
    try:
        yield main.wait_ready(), small.wait_ready()
    finally:
        main.stop()
        small.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def reference(tiny):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine.load(tiny, device="cpu", compute_dtype="float32", mode="none", context_length=CONTEXT)
    cache = {}

    def generate(ids, max_tokens):
        key = (tuple(ids), max_tokens)
        if key not in cache:
            with torch.no_grad():
                cache[key] = engine.generate(list(ids), max_tokens)
        return cache[key]

    generate.engine = engine
    yield generate
    torch.set_num_threads(threads)


def chat_ids(reference, messages):
    tok = reference.engine.tokenizer
    return tok.encode(tok.chat_prompt(messages))


def model_name(tiny):
    return tiny.name


def user(text):
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------------------------------------------ basics


def test_health_and_models(server, tiny):
    health = server.health()
    assert health["status"] == "ok" and health["mode"] == "mtp" and health["model"] == model_name(tiny)
    assert health["running"] == 0 and health["waiting"] == 0
    models = server.client().models.list()
    assert [m.id for m in models.data] == [model_name(tiny)]
    assert httpx.get(server.url + f"/v1/models/{model_name(tiny)}").status_code == 200
    missing = httpx.get(server.url + "/v1/models/gpt-4o")
    assert missing.status_code == 404 and "not served" in missing.json()["error"]["message"]


def test_chat_non_streamed(server, tiny, reference):
    messages = user("Tell me about lighthouses.")
    reply = server.client().chat.completions.create(model=model_name(tiny), messages=messages, max_tokens=10)
    ids = chat_ids(reference, messages)
    expected = reference(ids, 10)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == \
        (len(ids), len(expected.tokens), len(ids) + len(expected.tokens))
    stats = reply.model_extra["blockspec"]
    assert stats["mode"] == "mtp" and stats["generated"] == 10 and stats["execution"] == "eager"  # the CPU
    assert 0.0 <= stats["acceptance_rate"] <= 1.0 and stats["mean_accepted_length"] >= 1.0


def test_multi_turn_conversation_reuses_its_prefix(server, tiny, reference):
    """A conversation continued turn after turn through the openai client: from the second turn on the server
    reports the prompt tokens it did not prefill again (usage.prompt_tokens_details.cached_tokens, more each turn)
    and answers exactly what a freshly loaded engine answers."""
    client, messages, cached = server.client(), [], []
    for question in ("Tell me about lighthouses.", "And about their keepers?", "Which one is the oldest?"):
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(model=model_name(tiny), messages=messages, max_tokens=8)
        ids = chat_ids(reference, messages)
        assert reply.choices[0].message.content == reference(ids, 8).text
        assert reply.usage.prompt_tokens == len(ids)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert 0 < cached[1] < cached[2] < len(ids), cached


def test_a_kept_prefix_is_reused_only_by_requests_of_its_cache_salt(server, tiny, reference):
    """vLLM's cache_salt: a request reuses the kept conversation only where it carries the same salt (or neither
    carries one), so one tenant cannot learn another's prompt from cached_tokens (or its speed); answers are the
    same whatever is reused."""
    client, question = server.client(), user("Tell me about lighthouses and their keepers.")
    ids = chat_ids(reference, question)

    def cached(salt):
        extra = {"cache_salt": salt} if salt is not None else {}
        reply = client.chat.completions.create(model=model_name(tiny), messages=question, max_tokens=4,
                                               extra_body=extra)
        assert reply.choices[0].message.content == reference(ids, 4).text
        return reply.usage.prompt_tokens_details.cached_tokens
    order = [None, None, "tenant-a", "tenant-a", "tenant-b", "tenant-a", None]
    got = [cached(salt) for salt in order]
    assert got[1] > 0 and got[3] == got[1], got  # the same salt (or none twice): reused
    assert got[2] == got[4] == got[5] == got[6] == 0, got  # another salt's conversation: none of it
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "cache_salt": ""}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_chat_streamed_with_usage(server, tiny, reference):
    messages = [{"role": "system", "content": "Be brief."}, *user("Count for me.")]
    chunks = list(server.client().chat.completions.create(
        model=model_name(tiny), messages=messages, max_completion_tokens=14, stream=True,
        stream_options={"include_usage": True}))
    expected = reference(chat_ids(reference, messages), 14)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(chat_ids(reference, messages))
    assert chunks[-1].usage.completion_tokens == 14
    assert all(c.usage is None for c in chunks[:-1])
    assert any("blockspec" in (c.model_extra or {}) for c in chunks)


def test_chat_streamed_raw_sse(server, tiny, reference):
    body = {"model": model_name(tiny), "messages": user("hi"), "max_tokens": 5, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert "usage" not in chunks[-1]  # no include_usage: no usage chunk
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        reference(chat_ids(reference, user("hi")), 5).text


def test_completions(server, tiny, reference):
    client = server.client()
    prompt = "Once upon a time"
    ids = reference.engine.tokenizer.encode(prompt)
    reply = client.completions.create(model=model_name(tiny), prompt=prompt, max_tokens=9)
    assert reply.object == "text_completion" and reply.choices[0].text == reference(ids, 9).text
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 9)
    by_ids = client.completions.create(model=model_name(tiny), prompt=[5, 6, 7, 8], max_tokens=7)
    assert by_ids.choices[0].text == reference([5, 6, 7, 8], 7).text and by_ids.usage.prompt_tokens == 4
    # no max_tokens: the server's --max-tokens (the context has room)
    default = client.completions.create(model=model_name(tiny), prompt=prompt)
    assert default.usage.completion_tokens == DEFAULT_MAX and default.choices[0].finish_reason == "length"
    assert default.choices[0].text == reference(ids, DEFAULT_MAX).text
    chunks = list(client.completions.create(model=model_name(tiny), prompt=prompt, max_tokens=9, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference(ids, 9).text
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.prompt_tokens == len(ids)


def test_concurrent_clients(server, tiny, reference):
    jobs = [(f"question number {i}", 6 + i, i % 2 == 0) for i in range(5)]
    results, errors = {}, []

    def ask(i, question, max_tokens, stream):
        try:
            client = server.client()
            if stream:
                chunks = client.chat.completions.create(model=model_name(tiny), messages=user(question),
                                                        max_tokens=max_tokens, stream=True)
                results[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                results[i] = client.chat.completions.create(model=model_name(tiny), messages=user(question),
                                                            max_tokens=max_tokens).choices[0].message.content
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=ask, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for i, (question, max_tokens, _) in enumerate(jobs):
        assert results[i] == reference(chat_ids(reference, user(question)), max_tokens).text


# --------------------------------------------------------------------------------- leaving, queue limit


def wait_idle(server, timeout=10.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        load = server.health()
        if load["running"] == 0 and load["waiting"] == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"engine still busy {timeout} s after the client left: {server.health()}")


def first_content(lines, count=1):
    """Read SSE lines until `count` chunks carrying text arrived (the generation is running). Keep `lines` (one
    response.iter_lines()) alive meanwhile: dropping that iterator closes the connection."""
    seen = 0
    for line in lines:
        if line.startswith("data: {") and (json.loads(line[6:])["choices"] or [{}])[0].get("text"):
            seen += 1
        if seen >= count:
            return


def test_client_leaving_mid_stream_frees_engine(server, tiny, reference):
    body = {"model": model_name(tiny), "prompt": "a long story", "max_tokens": LONG, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            first_content(r.iter_lines(), 3)
    # the connection is closed: the generation must stop at its next token, not run on to LONG tokens
    assert wait_idle(server) < 5
    start = time.monotonic()
    reply = server.client().completions.create(model=model_name(tiny), prompt="next", max_tokens=8)
    assert time.monotonic() - start < 10
    assert reply.choices[0].text == reference(reference.engine.tokenizer.encode("next"), 8).text


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_queue_limit_answers_429(servers, tiny, reference):
    small = servers[1]
    body = {"model": model_name(tiny), "prompt": "go", "max_tokens": LONG, "stream": True}

    def wait_turn(http):
        """A streamed request that waits: its answer (headers included) starts when the engine takes it up."""
        with http.stream("POST", small.url + "/v1/completions", json=body) as waiting:
            first_content(waiting.iter_lines())
            return waiting.status_code

    with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b, ThreadPoolExecutor(1) as pool:
        with a.stream("POST", small.url + "/v1/completions", json=body) as running:
            running_lines = running.iter_lines()       # kept: dropping it would close the connection
            first_content(running_lines)                # A holds the engine
            turn = pool.submit(wait_turn, b)
            wait_until(lambda: small.health()["waiting"] == 1)  # B is admitted and waits (queue-size 1)
            start = time.monotonic()
            refused = httpx.post(small.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
            assert refused.status_code == 429 and time.monotonic() - start < 5
            error = refused.json()["error"]
            assert "busy" in error["message"] and "queue-size 1" in error["message"]
            with pytest.raises(openai.RateLimitError):
                small.client().chat.completions.create(model=model_name(tiny), messages=user("x"), max_tokens=2)
        # A left: B gets the engine, and then leaves too
        assert turn.result(timeout=30) == 200
    wait_idle(small)
    ids = reference.engine.tokenizer.encode("after")
    reply = small.client().completions.create(model=model_name(tiny), prompt="after", max_tokens=6)
    assert reply.choices[0].text == reference(ids, 6).text and reply.usage.completion_tokens == 6


# ------------------------------------------------------------------------------------------------ refusals

LONG_TEXT = "x" * (CONTEXT + 10)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}

REFUSALS = [
    ("chat", {**CHAT, "temperature": -0.5}, "temperature", "temperature=-0.5"),
    ("chat", {**CHAT, "top_p": 1.5}, "top_p", "(0, 1]"),
    ("completion", {**COMPLETION, "top_k": -2}, "top_k", "-1 or 0 (no limit), or 1 up to the vocabulary size (259)"),
    ("completion", {**COMPLETION, "top_k": 260}, "top_k", "up to the vocabulary size (259)"),
    ("completion", {**COMPLETION, "top_k": 2 ** 63}, "top_k", "up to the vocabulary size"),
    ("completion", {**COMPLETION, "top_k": 2 ** 64}, "top_k", "up to the vocabulary size"),
    ("completion", {**COMPLETION, "temperature": 1e39}, "temperature", "[0, 100]"),
    ("completion", {**COMPLETION, "temperature": 100.5}, "temperature", "[0, 100]"),
    ("completion", {**COMPLETION, "min_p": 2}, "min_p", "[0, 1]"),
    ("chat", {**CHAT, "seed": "seven"}, "seed", "integer"),
    ("chat", {**CHAT, "seed": -1}, "seed", "0..2^63-1"),
    ("chat", {**CHAT, "seed": 2 ** 63}, "seed", "0..2^63-1"),
    ("chat", {**CHAT, "tools": 0}, "tools", "must be an array"),
    ("chat", {**CHAT, "tool_choice": "auto"}, "tool_choice", "function calling"),
    ("chat", {**CHAT, "parallel_tool_calls": False}, "parallel_tool_calls", "function calling"),
    ("chat", {**CHAT, "stop": ""}, "stop", "empty string"),
    ("chat", {**CHAT, "stop": ["a", 1]}, "stop", "array of strings"),
    ("chat", {**CHAT, "logit_bias": ""}, "logit_bias", "must be an object"),
    ("chat", {**CHAT, "response_format": {"a": 1}}, "response_format", "'type' is"),
    ("chat", {**CHAT, "response_format": {"type": "bogus"}}, "response_format", "'type' is"),
    ("chat", {**CHAT, "logit_bias": {"1": 0, "2": 5}}, "logit_bias", "constraints"),
    ("chat", {**CHAT, "logit_bias": {"1": False}}, "logit_bias", "constraints"),
    ("chat", {**CHAT, "stream": True, "stream_options": {"include_usage": True, "foo": 1}}, "stream_options",
     "'foo' is not supported"),
    ("chat", {**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options",
     "continuous_usage_stats"),
    ("chat", {**CHAT, "tool_choice": "required"}, "tool_choice", "function calling"),
    ("completion", {**COMPLETION, "logprobs": 0}, "logprobs", "logprobs"),
    ("completion", {**COMPLETION, "suffix": 0}, "suffix", "must be a string"),
    ("completion", {**COMPLETION, "stream": True, "stream_options": {"include_usage": 0}}, "stream_options",
     "boolean"),
    ("chat", {**CHAT, "temperature": "hot"}, "temperature", "number"),
    ("chat", {**CHAT, "n": 2}, "n", "n=2"),
    ("chat", {**CHAT, "logprobs": True}, "logprobs", "logprobs"),
    ("chat", {**CHAT, "top_logprobs": 3}, "top_logprobs", "logprobs"),
    ("chat", {**CHAT, "stop": ["x"] * 65}, "stop", "at most 64 strings of at most 1024 characters"),
    ("completion", {**COMPLETION, "stop": "x" * 1025}, "stop", "at most 64 strings"),
    ("completion", {**COMPLETION, "stop_token_ids": [1, -1]}, "stop_token_ids", "integers in 0.."),
    ("completion", {**COMPLETION, "stop_token_ids": 3}, "stop_token_ids", "array of token ids"),
    ("chat", {**CHAT, "stop_token_ids": [True]}, "stop_token_ids", "array of token ids"),
    ("chat", {**CHAT, "stop_token_ids": [2] * 65}, "stop_token_ids", "at most 64 ids"),
    ("chat", {**CHAT, "include_stop_str_in_output": 1}, "include_stop_str_in_output", "boolean"),
    ("completion", {**COMPLETION, "logprobs": 2}, "logprobs", "logprobs"),
    ("completion", {**COMPLETION, "best_of": 3}, "best_of", "best_of"),
    ("chat", {**CHAT, "presence_penalty": 0.5}, "presence_penalty", "penalt"),
    ("chat", {**CHAT, "response_format": {"type": "json_object"}}, "response_format", "constraints"),
    ("chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "function calling"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "messages", "image"),
    ("chat", {**CHAT, "max_tokens": 0}, "max_tokens", "at least 1"),
    ("chat", {**CHAT, "max_tokens": CONTEXT}, "max_tokens", "context_length"),
    ("chat", {**CHAT, "max_completion_tokens": CONTEXT}, "max_completion_tokens", "context_length"),
    ("chat", {**CHAT, "max_tokens": "ten"}, "max_tokens", "integer"),
    ("chat", {"messages": [{"role": "user", "content": LONG_TEXT}]}, "messages", "context_length"),
    ("completion", {"prompt": LONG_TEXT}, "prompt", "context_length"),
    ("completion", {"prompt": LONG_TEXT, "max_tokens": 2}, "prompt", "shorten the prompt"),
    ("chat", {"messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 2}, "messages", "context_length"),
    ("chat", {**CHAT, "max_completion_tokens": 5, "max_tokens": -5}, "max_tokens", "differ"),
    ("chat", {**CHAT, "prompt": "hi"}, "prompt", "a field of /v1/completions"),
    ("completion", {**COMPLETION, "messages": CHAT["messages"]}, "messages", "a field of /v1/chat/completions"),
    ("completion", {**COMPLETION, "add_generation_prompt": True}, "add_generation_prompt", "a field of"),
    ("chat", {**CHAT, "user": 123}, "user", "must be a string"),
    ("chat", {**CHAT, "metadata": [1]}, "metadata", "must be an object"),
    ("chat", {**CHAT, "prediction": {"type": "content", "content": "x"}}, "prediction", "predicted output"),
    ("chat", {**CHAT, "reasoning_effort": "high"}, "reasoning_effort", "reasoning effort"),
    ("completion", {"prompt": [1, 2, 100000]}, "prompt", "vocabulary"),
    ("completion", {"prompt": ["one", "two"]}, "prompt", "one prompt"),
    ("completion", {"prompt": ""}, "prompt", "empty"),
    ("chat", {}, "messages", "required"),
    ("chat", {"messages": []}, "messages", "non-empty"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "role"),
    ("completion", {}, "prompt", "required"),
    ("completion", {**COMPLETION, "stream": "yes"}, "stream", "boolean"),
    ("chat", {**CHAT, "model": "gpt-4o"}, "model", "not served"),
    ("chat", {**CHAT, "temprature": 0.5}, "temprature", "unknown field 'temprature'"),
    ("completion", {**COMPLETION, "x" * 100: 1}, "x" * 60, "unknown field 'xxx"),
    ("completion", {**COMPLETION, "allowed_token_ids": [5]}, "allowed_token_ids", "restricted vocabulary"),
    ("completion", {**COMPLETION, "bad_words": ["a"]}, "bad_words", "banned words"),
    ("chat", {**CHAT, "use_beam_search": True}, "use_beam_search", "beam search"),
    ("chat", {**CHAT, "typical_p": 0.5}, "typical_p", "typical sampling"),
    ("completion", {**COMPLETION, "structured_outputs": {"regex": "a+"}}, "structured_outputs", "constraints"),
    ("chat", {**CHAT, "priority": "high"}, "priority", "must be an integer"),
]


def test_refusals_answer_400_naming_the_field(server, tiny, reference):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for kind, body, param, words in REFUSALS:
            path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            r = http.post(path, json=body)
            expected_status = 404 if param == "model" else 400
            assert r.status_code == expected_status, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and words in error["message"], (body, error)
            assert error["type"] == "invalid_request_error"
        for method, path, status in (("DELETE", "/health", 405), ("GET", "/v1/completions", 405),
                                     ("POST", "/v1/completions/", 404), ("HEAD", "/health", 200),
                                     ("HEAD", "/v1/models", 200)):
            r = http.request(method, path)
            assert r.status_code == status, (method, path, r.status_code, r.text)
            if status == 405:
                assert r.headers["allow"] and r.json()["error"]["type"] == "invalid_request_error", r.headers
            if method == "HEAD":
                assert r.content == b"", r.content
            elif status == 404:
                assert "Not Found" in r.json()["error"]["message"]
        for raw in (b"{not json", b"", b"[1, 2]"):
            r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text
        # explicit greedy settings and empty lists are fine, and the refusals left the engine undisturbed
        r = http.post("/v1/completions", json={**COMPLETION, "temperature": 0, "top_p": 1, "n": 1, "stop": [],
                                                "tools": [], "logit_bias": {}, "response_format": {"type": "text"},
                                                "top_k": 259, "max_tokens": 6})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference(reference.engine.tokenizer.encode("hi"), 6).text
        r = http.post("/v1/chat/completions", json={**CHAT, "tools": [], "tool_choice": "none", "max_tokens": 6,
                                                     "logit_bias": {"1": 0, "2": 0.0}, "stream": True,
                                                     "stream_options": {"include_usage": True,
                                                                        "continuous_usage_stats": False}})
        assert r.status_code == 200 and '"completion_tokens":6' in r.text.replace(" ", ""), r.text[-400:]
    assert server.health()["running"] == 0


# ------------------------------------------------------------------------------- in process: EOS, UTF-8


class FakeEngine:
    """Engine stand-in whose reply is fixed text + EOS: covers finish_reason 'stop' and multi-byte text."""

    check_request = Engine.check_request
    serving_defaults = lambda self: {}  # noqa: E731  (no checkpoint: no generation_config.json)
    mode, model_name, context_length, vocab_size = "none", "fake", 256, 259

    def __init__(self, tokenizer, reply, delay_s: float = 0.0):
        from types import SimpleNamespace

        self.tokenizer, self.reply, self.last_stats, self.delay_s = tokenizer, reply, {}, delay_s
        self.config = SimpleNamespace(model="fake", max_tokens=64)
        self.yielded = 0  # tokens the last stream gave before it was closed

    def stream(self, prompt_ids, max_tokens, stop_at_eos=True, snapshot_at=None, cancelled=None):
        if self.reply is None:
            raise RuntimeError("CUDA error at /secret/path/kernel.cu:12")
        self.last_prompt = prompt_ids
        tokens = self.tokenizer.encode(self.reply) + [min(self.tokenizer.eos_token_ids)]
        if not stop_at_eos:  # on past EOS: the reply again
            tokens = tokens * -(-max_tokens // len(tokens))
        self.yielded = 0
        try:
            for token in tokens[:max_tokens]:
                time.sleep(self.delay_s)
                self.yielded += 1
                yield token
        finally:
            self.last_stats = {"mode": "none", "generated": min(len(tokens), max_tokens), "prefill_s": 0.0,
                               "decode_tokens_per_s": 0.0}


def test_eos_and_multibyte_text_in_process(tiny):
    from starlette.testclient import TestClient

    from blockspec.config import ServerSettings
    from blockspec.models.text import IncrementalText
    from blockspec.server import create_app
    from blockspec.models.tokenizer import Tokenizer

    tok = Tokenizer(tiny, [])
    reply = "héllo wörld ✓ 😀!"
    pieces, stream = [], IncrementalText(tok)
    for token in tok.encode(reply):
        pieces.append(stream.push([token]))
    pieces.append(stream.finish())
    assert "".join(pieces) == reply and not any("\ufffd" in p for p in pieces)
    assert len(tok.encode(reply)) > len(reply)  # some characters really were split across tokens

    app = create_app(FakeEngine(tok, reply), ServerSettings(queue_size=2))
    with TestClient(app, base_url="http://localhost") as http:
        r = http.post("/v1/chat/completions", json={"messages": user("hi")})
        answer = r.json()
        assert answer["choices"][0]["message"]["content"] == reply
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["usage"]["completion_tokens"] == len(tok.encode(reply)) + 1  # EOS counted
        with http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        texts = [c["choices"][0]["text"] for c in chunks]
        assert "".join(texts) == reply and not any("\ufffd" in t for t in texts)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        short = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
        assert short["choices"][0]["finish_reason"] == "length"


def test_stop_strings_and_stop_tokens_end_the_reply(tiny):
    """OpenAI's `stop` and vLLM's `stop_token_ids` / `include_stop_str_in_output`: the reply ends at the first stop,
    which a streamed reply never gives out a character of, as in the whole answer; usage counts the tokens up to
    the one that completed it, finish_reason is "stop" and stop_reason names it; the engine stops soon after."""
    from starlette.testclient import TestClient

    from blockspec.config import ServerSettings
    from blockspec.models.tokenizer import Tokenizer
    from blockspec.server import create_app

    tok = Tokenizer(tiny, [])
    reply = "def ö(x):\n    return x\n\n\ndef g(y):\n    return y * 2\n" * 2
    ids = tok.encode(reply)
    assert len(ids) < 200
    engine = FakeEngine(tok, reply, delay_s=0.01)
    app = create_app(engine, ServerSettings(queue_size=2))

    def tokens_until(text: str) -> int:  # the fewest tokens whose decoding holds `text`
        return next(n for n in range(len(ids) + 1) if text in tok.decode(ids[:n]))

    def ask(http, body, stream):
        if not stream:
            answer = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 200, **body}).json()
            choice = answer["choices"][0]
            return choice["text"], choice["finish_reason"], choice["stop_reason"], answer["usage"]
        with http.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 200, "stream": True, **body,
                                                          "stream_options": {"include_usage": True}}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
        last = next(c["choices"][0] for c in reversed(chunks) if c["choices"])
        return "".join(texts), last["finish_reason"], last["stop_reason"], chunks[-1]["usage"]

    cases = [  # body, the text, the stop reason, the tokens that complete it
        ({"stop": ["\n\n\n"]}, reply[:reply.index("\n\n\n")], "\n\n\n", tokens_until("x\n\n\n")),
        ({"stop": "urn y", "include_stop_str_in_output": True}, reply[:reply.index("urn y") + 5], "urn y",
         tokens_until("urn y")),
        ({"stop": ["zz", "g(", "(x)"]}, "def ö", "(x)", tokens_until("(x)")),  # the earliest in the text
        ({"stop": ["y * 2\n" * 2]}, reply, None, len(ids) + 1),  # never met: EOS ends the reply
        ({"stop_token_ids": [ids[5]]}, tok.decode(ids[:5]), ids[5], 6),  # without the stop token's text, as vLLM
        ({"stop_token_ids": [ids[5]], "include_stop_str_in_output": True}, tok.decode(ids[:6]), ids[5], 6),
        ({"stop_token_ids": [ids[5]], "stop": tok.decode(ids[:6])}, tok.decode(ids[:5]), ids[5], 6),  # ids first
        ({"stop": ["return x\n\n\ndef", "x\n"]}, reply[:reply.index("x\n")], "x\n", tokens_until("x\n")),
        # the first completed ends the reply, not the one that starts first
    ]
    with TestClient(app, base_url="http://localhost") as http:
        for body, text, reason, count in cases:
            for stream in (False, True):
                got = ask(http, body, stream)
                assert got[:3] == (text, "stop", reason), (body, stream, got)
                assert got[3]["completion_tokens"] == count, (body, stream, got)
                if reason is not None:  # the engine was stopped, not run to the end of the reply
                    assert engine.yielded < len(ids) + 1, (body, engine.yielded)
        with http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True, "stop": "\n\n\ndef"}) as r:
            pieces = [json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(pieces) == reply[:reply.index("\n\n\ndef")] and len(pieces) > 3
        answer = http.post("/v1/chat/completions", json={"messages": user("hi"), "stop": ["return"]}).json()
        assert answer["choices"][0]["message"]["content"] == "def ö(x):\n    "
        assert answer["choices"][0]["stop_reason"] == "return"


def test_reply_text_never_gives_out_a_stop_string(tiny):
    """ReplyText over random batches of the tokens: the pieces given out concatenate to the text before the first
    stop (with include_string, through it), and no piece given out before the end holds a stop string's start that
    the stop then took back."""
    import random

    from blockspec.models.tokenizer import Tokenizer
    from blockspec.models.text import ReplyText, Stops

    tok = Tokenizer(tiny, [])
    reply = "héllo wörld, stop ✓ here; and 😀 more text after the stop ✓ mark"
    ids = tok.encode(reply)
    rng = random.Random(0)
    for strings, include in [(("stop ✓",), False), (("✓ here", "wörld,"), True), (("ö", "😀"), False),
                             (("absent",), False), ((), False)]:
        found = [(reply.find(s), s) for s in strings if s in reply]
        end = len(reply) if not found else min(found)[0] + (len(min(found)[1]) if include else 0)
        for _ in range(20):
            text, given, at = ReplyText(tok, Stops(strings, frozenset(), include)), "", 0
            while at < len(ids) and text.stop_reason is None:
                step = rng.randint(1, 5)
                given += text.push(ids[at:at + step])
                at += step
                assert reply.startswith(given) and len(given) <= end, (strings, given)
            given += text.finish()
            assert given == reply[:end], (strings, include, given)
            assert text.stop_reason == (min(found)[1] if found else None)


def test_stop_strings_one_token_completes_end_the_reply_in_the_order_given(tiny):
    """Of the stop strings the same token completes, the first in the request's list ends the reply, as vLLM checks
    them: "lo" and "llo" end at the same character, whatever the tokens."""
    from blockspec.models.tokenizer import Tokenizer
    from blockspec.models.text import ReplyText, Stops

    tok = Tokenizer(tiny, [])
    ids = tok.encode("hello world")
    for strings, include, text in [(("lo", "llo"), False, "hel"), (("llo", "lo"), False, "he"),
                                   (("lo", "llo"), True, "hello"), (("zz", "llo", "lo"), True, "hello")]:
        for step in (1, len(ids)):
            reply = ReplyText(tok, Stops(strings, frozenset(), include))
            given = "".join(reply.push(ids[i:i + step]) for i in range(0, len(ids), step)) + reply.finish()
            assert (given, reply.stop_reason) == (text, [s for s in strings if s in "hello"][0]), (strings, step)


def test_streamed_text_gives_out_all_but_a_possible_partial_character(tiny):
    """IncrementalText's pieces concatenate to the decoding of all the tokens, however they arrive (valid multi-byte
    characters split over tokens, bytes that never form a character, cut characters), and a stream of such bytes is
    given out as it comes: only the trailing U+FFFD a character's remaining bytes could still replace are held."""
    import random

    from blockspec.models.tokenizer import Tokenizer
    from blockspec.models.text import IncrementalText

    tok = Tokenizer(tiny, [])
    lone = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]  # bytes that are no character alone
    cut = tok.encode("a\U0001F600b\u20acc")
    rng = random.Random(0)
    for _ in range(200):
        tokens = []
        for _ in range(rng.randint(1, 30)):
            r = rng.random()
            tokens += ([rng.choice(lone)] if r < 0.3 else cut[:rng.randint(1, len(cut))] if r < 0.5
                       else tok.encode(rng.choice(["x", " h\u00e9", "\U0001F600", "\u20ac", "ok\n"])))
        stream, pieces, i = IncrementalText(tok), [], 0
        while i < len(tokens):
            step = rng.randint(1, 3)
            pieces.append(stream.push(tokens[i:i + step]))
            i += step
        pieces.append(stream.finish())
        assert "".join(pieces) == tok.decode(tokens), (tokens, pieces)
    stream = IncrementalText(tok)
    assert "".join(stream.push([lone[0]]) for _ in range(64)) == "\ufffd" * 61
    assert stream.finish() == "\ufffd" * 3


def test_vllm_request_extensions_in_process(tiny):
    """ignore_eos generates max_tokens tokens (finish_reason length), add_generation_prompt false renders the chat
    without the generation prompt, max_completion_tokens also bounds a completion, and the fields served at their
    neutral value only are accepted there."""
    from starlette.testclient import TestClient

    from blockspec.config import ServerSettings
    from blockspec.models.tokenizer import Tokenizer
    from blockspec.server import create_app

    tok = Tokenizer(tiny, [])
    engine = FakeEngine(tok, "ok")
    reply = len(tok.encode("ok")) + 1
    with TestClient(create_app(engine, ServerSettings(queue_size=2)), base_url="http://localhost") as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3 * reply, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 3 * reply and r["choices"][0]["finish_reason"] == "length"
        assert r["choices"][0]["text"] == "ok" * 3
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 9, "ignore_eos": False}).json()
        assert r["usage"]["completion_tokens"] == reply and r["choices"][0]["finish_reason"] == "stop"
        r = http.post("/v1/completions", json={"prompt": "hi", "max_completion_tokens": 1}).json()
        assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["finish_reason"] == "length"
        messages = user("hi")
        for generation_prompt in (False, True):
            r = http.post("/v1/chat/completions", json={"messages": messages,
                                                         "add_generation_prompt": generation_prompt})
            assert r.status_code == 200, r.text
            assert engine.last_prompt == tok.chat_prompt_ids(messages, generation_prompt=generation_prompt)
        neutral = {"min_tokens": 0, "stop_token_ids": [], "skip_special_tokens": True, "echo": False,
                   "continue_final_message": False, "chat_template_kwargs": {"enable_thinking": False},
                   "modalities": ["text"], "prompt_logprobs": None, "stream": True,
                   "stream_options": {"include_usage": True}, "use_beam_search": False, "length_penalty": 1.0,
                   "typical_p": 1, "bad_words": [], "logits_processors": [], "return_tokens_as_token_ids": False,
                   "vllm_xargs": {}, "structured_outputs": None, "priority": 0, "request_id": "r-1",
                   "prompt_cache_key": "k", "safety_identifier": "s"}
        r = http.post("/v1/chat/completions", json={"messages": messages, **neutral})
        assert r.status_code == 200 and '"usage": {' in r.text and r.text.endswith("data: [DONE]\n\n"), r.text


@contextlib.contextmanager
def protocol_server(app, receive_timeout_s=0.3, max_connections=8):
    """A uvicorn server of the engine's connection protocol (TimedH11Protocol) around a bare ASGI app, on a free
    port of 127.0.0.1 in a thread; yields the port."""
    import functools

    import uvicorn

    from blockspec.server.connection import TimedH11Protocol

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    protocol = functools.partial(TimedH11Protocol, receive_timeout_s=receive_timeout_s,
                                 max_connections=max_connections)
    server = uvicorn.Server(uvicorn.Config(app, http=protocol, lifespan="off", log_level="error", log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        yield listening.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_pipelined_request_running_past_the_receive_timeout_is_answered():
    """A keep-alive client that sends its next request before the answer to the previous one ends (pipelining): the
    next request runs, past --receive-timeout, and is answered whole; the connection closes only once idle for that
    long after its last answer."""
    import asyncio

    async def app(scope, receive, send):
        assert scope["type"] == "http"
        if scope["path"] == "/slow":
            await asyncio.sleep(1.0)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
        await send({"type": "http.response.body", "body": scope["path"][1:5].encode()})

    with protocol_server(app) as port, socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"slow"):
            chunk = sock.recv(4096)
            assert chunk, data  # closed before the second answer
            data += chunk
        answered = time.perf_counter()
        assert sock.recv(100) == b""  # closed once idle
        assert 0.2 < time.perf_counter() - answered < 2


async def answer_ok(scope, receive, send):
    """Answers 200 "ok" at once, whatever body is still coming (as a 413 refused from its Content-Length is)."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


async def answer_after_the_body(scope, receive, send):
    if scope["type"] == "http":
        while (await receive()).get("more_body"):
            pass
        await answer_ok(scope, receive, send)


def test_past_max_connections_the_longest_idle_connection_closes_and_all_busy_is_503():
    """A flood of idle connections neither holds a new client back nor opens files without end: past
    max_connections the one idle the longest closes; where every other one has a request in progress, the new one
    is answered 503 in JSON."""
    with protocol_server(answer_after_the_body, receive_timeout_s=30, max_connections=3) as port:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
        time.sleep(IDLE_BEFORE_CLOSE_S + 0.1)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_all(sock).startswith(b"HTTP/1.1 200")
        assert idle[0].recv(10) == b""  # the oldest idle one was closed for it
        for sock in idle:
            sock.close()
        time.sleep(0.2)
        # three connections with a request in progress: headers sent, the body not yet
        busy = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
        for sock in busy:
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            head, _, body = read_all(sock).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "too_many_connections"
            assert b"\r\nretry-after: 1\r\n" in head, head
        for sock in busy:
            sock.close()
    with protocol_server(answer_ok, max_connections=3) as port:  # answered before their bodies: lingering
        lingering = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
        for sock in lingering:
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 10\r\n\r\n")
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # one of them makes room
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_all(sock).startswith(b"HTTP/1.1 200")
        for sock in lingering:
            sock.close()


def test_connections_just_opened_are_not_closed_to_make_room():
    """Past max_connections, a connection opened (or answered) less than IDLE_BEFORE_CLOSE_S ago may have its request
    on the way: it is not closed for a newer one (a close would reset it unanswered), which gets the JSON 503
    instead. Two clients that connect and send a request back to back, with the other connections busy: each gets
    an answer, none a reset."""
    with protocol_server(answer_after_the_body, receive_timeout_s=30, max_connections=2) as port:
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as busy:
                busy.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
                time.sleep(0.1)
                first = socket.create_connection(("127.0.0.1", port), timeout=5)
                second = socket.create_connection(("127.0.0.1", port), timeout=5)
                for sock in (first, second):
                    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answers = [read_all(sock) for sock in (first, second)]  # a reset raises ConnectionResetError
                assert answers[0].startswith(b"HTTP/1.1 200"), answers
                head, _, body = answers[1].partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == \
                    "too_many_connections", answers
                first.close()
                second.close()
            time.sleep(0.1)


def test_past_max_connections_a_stalled_client_makes_room_where_none_is_idle():
    """Where no connection is idle, one whose client has held up its request for STALLED_S or more makes room: one
    that does not read its answers (pipelined requests, a small receive buffer) is closed at once, its unsent
    answers dropped; one whose body stopped arriving, or comes a byte at a time, is answered 408 in JSON. Before
    STALLED_S, the newcomer is the one refused (503), as it is where the server itself has stopped reading a body (its
    app not reading yet)."""
    import asyncio

    from blockspec.server.connection import STALLED_S

    def newcomer(port) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return read_all(sock)

    async def app(scope, receive, send):  # 100 KB answers to GET /large, else answer_after_the_body (/later: 3 s on)
        if scope["type"] == "http" and scope["path"] == "/later":
            await asyncio.sleep(STALLED_S + 2)
        if scope["type"] == "http" and scope["path"] == "/large":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"100000")]})
            await send({"type": "http.response.body", "body": b"x" * 100_000})
        else:
            await answer_after_the_body(scope, receive, send)

    with protocol_server(app, receive_timeout_s=30, max_connections=1) as port:
        deaf = socket.socket()
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        deaf.connect(("127.0.0.1", port))
        deaf.settimeout(5)
        deaf.sendall(b"GET /large HTTP/1.1\r\nHost: x\r\n\r\n" * 200)  # 20 MB of answers it does not read
        time.sleep(0.3)
        assert newcomer(port).startswith(b"HTTP/1.1 503")
        time.sleep(STALLED_S)
        assert newcomer(port).startswith(b"HTTP/1.1 200")
        received = 0
        with contextlib.suppress(ConnectionResetError):  # closed: what was still to send is dropped
            while chunk := deaf.recv(65536):
                received += len(chunk)
        assert received < 200 * 100_000, received
        deaf.close()
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
            slow.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
            time.sleep(0.3)
            assert newcomer(port).startswith(b"HTTP/1.1 503")
            time.sleep(STALLED_S)
            assert newcomer(port).startswith(b"HTTP/1.1 200")
            head, _, body = read_all(slow).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "body_timeout"
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as trickle:  # never silent, far too slow
            trickle.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            done = threading.Event()

            def drip():
                with contextlib.suppress(OSError):
                    while not done.wait(0.2):
                        trickle.sendall(b"a")
            dripping = threading.Thread(target=drip, daemon=True)
            dripping.start()
            time.sleep(0.3)
            assert newcomer(port).startswith(b"HTTP/1.1 503")
            time.sleep(STALLED_S)
            assert newcomer(port).startswith(b"HTTP/1.1 200")
            done.set()
            dripping.join(5)
            head, _, body = read_all(trickle).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408") and "slower than" in json.loads(body)["error"]["message"]
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as waiting:  # the server is not reading it
            waiting.sendall(b"POST /later HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 1000000"
                            b"\r\n\r\n")
            sender = threading.Thread(target=lambda: waiting.sendall(b"x" * 1_000_000), daemon=True)
            sender.start()
            time.sleep(STALLED_S + 0.3)
            assert newcomer(port).startswith(b"HTTP/1.1 503")
            assert read_all(waiting).startswith(b"HTTP/1.1 200")
            sender.join(5)


def test_past_max_connections_a_slow_reader_and_a_request_owed_its_100_continue_are_not_stalled():
    """A client that reads its answers slowly but steadily is not taken for one that does not read them, and a
    pipelined request waiting for its '100 Continue' (its headers sent long before its turn) is not taken for a body
    that stopped arriving: the newcomer past max_connections is the one refused (503)."""
    import asyncio

    from blockspec.server.connection import STALLED_S

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/wait":
            await asyncio.sleep(STALLED_S + 0.5)
        if scope["path"] == "/large":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"100000")]})
            await send({"type": "http.response.body", "body": b"x" * 100_000})
            return
        await answer_after_the_body(scope, receive, send)

    def newcomer(port) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return read_all(sock)

    with protocol_server(app, receive_timeout_s=30, max_connections=1) as port:
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect(("127.0.0.1", port))
        reader.sendall(b"GET /large HTTP/1.1\r\nHost: x\r\n\r\n" * 200)
        start, received = time.perf_counter(), 0
        while time.perf_counter() - start < STALLED_S + 1:
            received += len(reader.recv(16384))
            time.sleep(0.02)
        assert newcomer(port).startswith(b"HTTP/1.1 503")
        received += len(reader.recv(16384))
        assert received > 100_000, received
        reader.close()
        time.sleep(IDLE_BEFORE_CLOSE_S)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.1)
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n"
                         b"Expect: 100-continue\r\n\r\n")
            data = b""
            while b"100 Continue" not in data:
                data += sock.recv(4096)
            assert newcomer(port).startswith(b"HTTP/1.1 503")
            sock.sendall(b"hi")
            data += read_all(sock)
            assert data.count(b"HTTP/1.1 200") == 2 and b"408" not in data, data


def test_empty_lines_before_a_request_and_bytes_after_one_that_closes_are_ignored():
    """RFC 9112 2.2: a server ignores an empty line before a request line; bytes after a request that closes the
    connection (Connection: close) cannot be a request, and do not cut its answer short."""
    import asyncio

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await asyncio.sleep(0.3)
            await answer_after_the_body(scope, receive, send)

    # the second request comes ~0.3 s after the first's answer: well within the wait for a next request
    with protocol_server(app, receive_timeout_s=3.0) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.1)
            sock.sendall(b"\r\n")  # while the first is answered
            time.sleep(0.5)
            sock.sendall(b"\r\n\r\nGET /2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")  # between
            assert read_all(sock).count(b"HTTP/1.1 200 OK") == 2
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            time.sleep(0.1)
            sock.sendall(b"\r\n")
            answer = read_all(sock)
            assert answer.startswith(b"HTTP/1.1 200") and b"400" not in answer, answer


def test_a_client_that_leaves_after_a_stray_byte_is_noticed_and_a_later_pipelined_request_answered():
    """Bytes after a whole request while its answer is being made (a stray line end, RFC 9112 2.2, or the next
    pipelined request): the connection still sees the client leave at once, so the app's request ends as one whose
    client left (here after 0.2 s, where its answer would take 5); a client that stays gets its next request
    answered after the first."""
    import asyncio

    left = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/slow":
            start = time.perf_counter()
            try:
                message = await asyncio.wait_for(receive(), 5)  # as until_disconnected: the next is the leaving
                left.append((message["type"], time.perf_counter() - start))
                return
            except asyncio.TimeoutError:
                pass
        if scope["path"] == "/wait":
            await asyncio.sleep(0.5)
        await answer_ok(scope, receive, send)

    with protocol_server(app, receive_timeout_s=30) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
            time.sleep(0.1)
            sock.sendall(b"\r\n")
            time.sleep(0.1)
        deadline = time.perf_counter() + 3
        while not left and time.perf_counter() < deadline:
            time.sleep(0.05)
        assert left and left[0][0] == "http.disconnect" and left[0][1] < 1.5, left
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /wait HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
            time.sleep(0.1)
            sock.sendall(b"GET /next HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_all(sock).count(b"HTTP/1.1 200 OK") == 2


def test_a_body_in_many_tiny_chunks_is_refused_before_it_is_all_parsed():
    """A chunked body in 1-byte chunks costs the HTTP parser microseconds a byte: past MAX_SMALL_PIECES pieces
    averaging under SMALL_PIECE bytes it is refused in JSON, 400, and the rest is dropped unparsed, so a body of 8x
    that many is answered within 3x the time that the limit's pieces take to be read whole (all of it parsed: ~8x).
    As many tiny chunks as the limit, or more chunks of 4 x SMALL_PIECE bytes (a read may split one in two pieces),
    are read whole."""
    from blockspec.server.connection import MAX_SMALL_PIECES, SMALL_PIECE

    def chunked(sizes):
        return b"".join(b"%x\r\n" % n + b"x" * n + b"\r\n" for n in sizes) + b"0\r\n\r\n"

    head = b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
    took = {}
    with protocol_server(answer_after_the_body) as port:
        for name, sizes, status in (("refused", [1] * 8 * MAX_SMALL_PIECES, b"400"),
                                    ("the limit", [1] * MAX_SMALL_PIECES, b"200"),
                                    ("larger chunks", [4 * SMALL_PIECE] * (2 * MAX_SMALL_PIECES), b"200")):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                start = time.perf_counter()
                sock.sendall(head + chunked(sizes))
                answer, took[name] = read_all(sock), time.perf_counter() - start
            assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
            if status == b"400":
                error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
                assert error["code"] == "malformed_http" and f"more than {MAX_SMALL_PIECES} pieces" in error["message"]
    assert took["refused"] < 3 * took["the limit"], took


def test_an_answer_sent_before_the_body_came_in_reaches_a_client_that_asked_to_close():
    """Connection: close and a body still coming (a 413 refused from its Content-Length): the connection reads and
    drops the rest before it closes, so no reset overtakes the answer."""
    body = b"x" * 8_000_000
    with protocol_server(answer_ok) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode())
        time.sleep(0.2)  # answered by now, before the body
        sock.sendall(body)
        assert read_all(sock).startswith(b"HTTP/1.1 200")


def test_a_keep_alive_request_answered_before_its_body_closes_instead_of_reading_it_all():
    """A keep-alive request answered before its body is all in (a 413, a 405, a GET with a body): the rest is not
    read in full for a next request (here 100 GB declared, sent as fast as loopback takes it); the connection
    answers, then closes lingering, within LINGER_S."""
    from blockspec.server.connection import LINGER_S

    with protocol_server(answer_ok) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\n\r\n")
        start, closed = time.perf_counter(), False
        try:
            while time.perf_counter() - start < LINGER_S + 3:
                sock.sendall(b"x" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            closed = True
        assert closed and time.perf_counter() - start < LINGER_S + 3


def test_a_request_refused_in_its_body_ends_for_the_app_without_a_write_after_the_refusal(caplog):
    """A chunked body whose second chunk cannot be parsed: the connection answers 400 and lingers; the app's request
    ends as one whose client left, so its own answer (here after a 0.5 s wait, as a 408) writes nothing."""
    import asyncio
    import logging

    async def answer_after_the_body_or_a_wait(scope, receive, send):
        if scope["type"] != "http":
            return
        try:
            while (message := await asyncio.wait_for(receive(), 0.5))["type"] != "http.disconnect" \
                    and message.get("more_body"):
                pass
        except asyncio.TimeoutError:
            pass
        await answer_ok(scope, receive, send)

    with caplog.at_level(logging.ERROR), protocol_server(answer_after_the_body_or_a_wait) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n")
        time.sleep(0.2)
        sock.sendall(b"zz\r\n")
        head, _, body = read_all(sock).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["code"] == "malformed_http"
        time.sleep(1.0)  # past the app's wait
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_an_upgrade_request_is_answered_as_plain_http_without_warnings():
    import logging

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    level = logger.level
    try:
        with protocol_server(answer_ok) as port, socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            logger.setLevel(logging.WARNING)  # protocol_server's log level is "error"
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, close\r\nUpgrade: websocket\r\n"
                         b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
            assert read_all(sock).startswith(b"HTTP/1.1 200")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert not warnings, [w.getMessage() for w in warnings]


def test_an_http_1_0_client_that_half_closes_gets_its_answer():
    """HTTP/1.0, the request whole, then shutdown(SHUT_WR) (`nc -N`): answered, as HTTP/1.1 clients are."""
    with protocol_server(answer_ok) as port, socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST / HTTP/1.0\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        sock.shutdown(socket.SHUT_WR)
        assert read_all(sock).startswith(b"HTTP/1.1 200")


class Undecodable:
    """A tokenizer whose decode fails: a bug in the app's own code, outside the engine."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def decode(self, ids):
        return 1 / 0


def test_internal_errors_answer_500_with_a_request_id_only(tiny, caplog):
    """An exception in the engine (the worker thread) or in the app's own code answers 500 naming a request id, never
    the exception's text; the log has the traceback once, under that id."""
    from starlette.testclient import TestClient

    from blockspec.config import ServerSettings
    from blockspec.server import create_app
    from blockspec.models.tokenizer import Tokenizer

    tok = Tokenizer(tiny, [])
    failing = FakeEngine(tok, None)
    undecodable = FakeEngine(Undecodable(tok), "fine")
    for engine in (failing, undecodable):
        caplog.clear()
        with TestClient(create_app(engine, ServerSettings()), base_url="http://localhost") as http:
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        error = r.json()["error"]
        assert r.status_code == 500 and error["code"] == "internal_error", r.text
        request_id = error["message"].split("request id ")[1].split(")")[0]
        assert not any(word in r.text for word in ("secret", "RuntimeError", "ZeroDivisionError", "division"))
        failures = [rec for rec in caplog.records if rec.exc_info]
        assert len(failures) == 1 and request_id in failures[0].getMessage(), caplog.text


# --------------------------------------------------------------------------------- arguments checked before loading


def test_busy_port_refused_before_the_model_loads(tmp_path, capsys):
    """Another server holds the port: one line naming it, exit 2, and before the model loads (the model path does
    not even exist, and that is not what is reported)."""
    from blockspec.cli import main

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        code = main(["serve", "--model", str(tmp_path / "no-such-model"), "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in err and "no-such-model" not in err, err


def test_host_check_warning_names_the_risk_and_the_flag():
    from blockspec.config import ServerSettings
    from blockspec.server.access import AccessGuard, host_check_warning

    for host, allowed, warned in (("0.0.0.0", (), True), ("0.0.0.0", ("*",), True), ("192.0.2.1", (), True),
                                  ("127.0.0.1", ("*",), True), ("0.0.0.0", ("box.lan",), False),
                                  ("127.0.0.1", (), False), ("::1", (), False)):
        settings = ServerSettings(host=host, allowed_hosts=allowed)
        warning = host_check_warning(settings, host)
        assert (warning is not None) == warned == (not AccessGuard(None, settings, host).check_host), (host, allowed)
        if warned:
            assert "DNS rebinding" in warning and "--allowed-hosts" in warning and "\n" not in warning
            assert ("allows every name" in warning) == ("*" in allowed), warning
            assert ("not a loopback address" in warning) == ("*" not in allowed), warning


def test_allowed_hosts_match_the_host_header_by_name():
    """A fully qualified name (a trailing dot) is the same name, in the flag or the header; IPv6 addresses are
    written with or without brackets; the port never matters."""
    from blockspec.config import ServerSettings
    from blockspec.server.access import AccessGuard

    settings = ServerSettings(allowed_hosts=("Example.com.", "box.lan", "[fe80::1]", "fe80::2"))
    settings.check()
    guard = AccessGuard(None, settings, settings.host)
    for host in ("example.com", "example.com.:8000", "EXAMPLE.COM:80", "box.lan.", "box.lan:8000", "[fe80::1]:8000",
                 "[fe80::2]", "localhost.:8000", "127.0.0.1:8000"):
        assert guard.host_allowed(host), host
    for host in ("evil.example", "example.com.evil.example", "box.lan.evil:8000", "[fe80::3]:8000"):
        assert not guard.host_allowed(host), host


def test_allowed_origins_match_with_the_default_port_written_or_not():
    from blockspec.config import ServerSettings
    from blockspec.server.access import AccessGuard

    settings = ServerSettings(allowed_origins=("http://app.example:80", "https://Web.example/", "http://x.example:3000",
                                               "null"))
    settings.check()
    guard = AccessGuard(None, settings, settings.host)
    for origin in ("http://app.example", "http://app.example:80", "https://web.example:443", "https://web.example",
                   "http://x.example:3000", "null"):
        assert guard.origin_allowed(origin, "127.0.0.1:8000", "http"), origin
    for origin in ("https://app.example", "http://x.example", "http://x.example:3001", "http://web.example",
                   "http://evil.example", "http://x.example:abc"):
        assert not guard.origin_allowed(origin, "127.0.0.1:8000", "http"), origin
    assert guard.origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000", "http")
    assert guard.origin_allowed("http://localhost", "localhost:80", "http")


@pytest.mark.parametrize("args,message", [
    (["--port", "99999"], "--port must be between 0 and 65535 (got 99999)"),
    (["--port", "-1"], "--port must be between 0 and 65535 (got -1)"),
    (["--queue-size", "-1"], "--queue-size must be 0 or more (got -1)"),
    (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: not a known address"),
    (["--max-body-mb", "0"], "--max-body-mb must be a number above 0 (got 0)"),
    (["--receive-timeout", "nan"], "--receive-timeout must be a number above 0 (got nan)"),
    (["--shutdown-grace", "-1"], "--shutdown-grace must be 0 or more seconds (got -1)"),
    (["--allowed-origins", "example.com"], "--allowed-origins: 'example.com' is not an origin"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--api-key", "sécret"], "--api-key must be printable ASCII without leading or trailing spaces"),
    (["--api-key", "key "], "--api-key must be printable ASCII without leading or trailing spaces"),
    (["--max-connections", "0"], "--max-connections must be at least 1 (got 0)"),
    (["--max-body-mb", "1e308"], "--max-body-mb must be at most 1024 (got 1e+308)"),
    (["--max-connections", str(2 ** 40)], f"--max-connections {2 ** 40}: this process may open"),
    (["--allowed-hosts", "box.lan,localhost:8000"], "--allowed-hosts: 'localhost:8000' has a port, but the Host "
     "header is checked by name only, on any port: write 'localhost'"),
    (["--allowed-hosts", "[fe80::1]:8000"], "--allowed-hosts: '[fe80::1]:8000' has a port, but the Host header is "
     "checked by name only, on any port: write '[fe80::1]'"),
])
def test_serve_arguments_checked_before_the_model_loads(tmp_path, capsys, args, message):
    from blockspec.cli import main

    code = main(["serve", "--model", str(tmp_path / "no-such-model"), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and "no-such-model" not in err, err


# ------------------------------------------------------------------------------------------------ sampling


def test_sampling_fields(server, tiny):
    """temperature, top_p, seed (OpenAI) and top_k, min_p (vLLM's extra fields) reach the engine: a seeded request
    gives what Engine.generate gives with the same settings (the server decodes with MTP), every time."""
    engine = Engine.load(tiny, device="cpu", compute_dtype="float32", mode="mtp", context_length=CONTEXT)
    settings = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.02, "seed": 11}
    prompt = "Once upon a time"
    with torch.no_grad():
        expected = engine.generate(engine.tokenizer.encode(prompt), 12, **settings)
    replies = [httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12, **settings},
                          timeout=60).json() for _ in range(2)]
    assert [r["choices"][0]["text"] for r in replies] == [expected.text] * 2
    assert replies[0]["blockspec"]["sampling"] == settings
    unseeded = [httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12,
                                                                 "temperature": 1.0}, timeout=60).json()
                for _ in range(2)]
    seeds = [r["blockspec"]["sampling"]["seed"] for r in unseeded]
    assert seeds[0] != seeds[1]  # fresh randomness per request, and the seed it used is reported
    greedy = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=60).json()
    assert greedy["blockspec"]["sampling"] == {"temperature": 0.0}  # no generation_config.json: greedy
    for tiny_temperature in (1e-300, 1e-38, 9e-6):  # too small to divide float32 logits by: decoded greedily
        reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 4, "temperature": tiny_temperature, "seed": 3}).json()
        assert reply["choices"][0]["text"] == greedy["choices"][0]["text"], (tiny_temperature, reply)
        assert reply["blockspec"]["sampling"] == {"temperature": 0.0}


def test_sampling_settings_bounds():
    from blockspec.config import MAX_SEED, SamplingSettings
    from blockspec.errors import BlockspecError

    for bad in ({"seed": -1}, {"seed": MAX_SEED + 1}, {"temperature": 100.01}, {"temperature": 1e39},
                {"top_k": 2 ** 63}):
        with pytest.raises(BlockspecError, match=next(iter(bad))):
            SamplingSettings.build(bad)
    assert SamplingSettings.build({"temperature": 1e-6, "top_k": 2 ** 63 - 1}).greedy
    assert not SamplingSettings.build({"temperature": 1e-5, "seed": MAX_SEED}).greedy


def test_fields_left_out_take_generation_config_then_flags(tiny, tmp_path):
    import shutil

    from blockspec.server.requests import RequestParser

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny, checkpoint)
    (checkpoint / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05}))
    body = {"prompt": "hi", "max_tokens": 2}

    def raw(fields):  # the parser reads the request's bytes
        return json.dumps(fields).encode()
    parsed = RequestParser(Engine.load(checkpoint, device="cpu", context_length=64)).parse(raw(body), "completion")
    assert parsed.sampling == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    parser = RequestParser(Engine.load(checkpoint, device="cpu", context_length=64, top_p=0.8, seed=4))
    assert parser.parse(raw(body), "completion").sampling == {"temperature": 0.6, "top_k": 20, "top_p": 0.8, "seed": 4}
    assert parser.parse(raw({**body, "temperature": 0, "seed": 9}), "completion").sampling == \
        {"temperature": 0.0, "top_k": 20, "top_p": 0.8, "seed": 9}


@pytest.mark.parametrize("text, note", [("[0.6, 20]", "holds a JSON list, not an object"),
                                        ("{not json", "generation_config.json: not valid JSON (Expecting property")])
def test_a_generation_config_that_is_not_an_object_is_noted_once(tiny, tmp_path, capsys, text, note):
    import shutil

    from blockspec.server.requests import RequestParser

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny, checkpoint)
    (checkpoint / "generation_config.json").write_text(text)
    engine = Engine.load(checkpoint, device="cpu", context_length=64)
    capsys.readouterr()
    parser = RequestParser(engine)  # serve asks for the defaults twice: for its banner and for the parser
    assert engine.serving_defaults() == {} and parser.sampling_defaults == {}
    err = capsys.readouterr().err
    assert err.count(note) == 1 and err.count("\n") == 1, err


def test_top_k_minus_one_means_no_limit_as_in_vllm(tiny):
    from blockspec.server.requests import RequestParser

    parser = RequestParser(Engine.load(tiny, device="cpu", context_length=64))
    body = json.dumps({"prompt": "hi", "temperature": 0.7, "top_k": -1}).encode()
    assert parser.parse(body, "completion").sampling["top_k"] == 0


def test_fields_served_in_no_mode_are_refused_naming_them():
    """What an OpenAI request may ask that no mode serves: one line naming it (the parser answers 400 with it)."""
    from blockspec.server.requests import unserved

    for kwargs, needle in [({"n": 2}, "n=2"), ({"images": True}, "image"), ({"constraints": True}, "constraints"),
                           ({"logprobs": True}, "logprobs")]:
        why = unserved(**kwargs)
        assert needle in why and ("in every mode" in why or "in any mode" in why), why
    assert unserved() is None and unserved(n=1) is None
