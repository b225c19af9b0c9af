"""Prefix reuse (engine/reuse.py): every request on an engine that keeps the last conversation gives the tokens (and,
speculative, the same accepted lengths: the proposer's restored state drafts the same) of the same request on an
engine that starts every request afresh, in every mode, greedy and seeded sampling; and the test catches a wrong
restore."""

import io
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.chat import ChatSession
from blockspec.drafter.context import DrafterContext
from blockspec.engine.engine import Engine
from blockspec.engine.mtp import MTPProposer
from blockspec.layers.gdn import GDNState

MODES = ("none", "mtp", "dflash2")
SAMPLED = dict(temperature=0.8, top_k=20, seed=7)


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, tiny_drafter):
    target = tiny_checkpoint(seed=0, planted=True)
    return target, tiny_drafter(target, window=16)


def load(pair, mode, context_length=320, **kw):
    target, drafter = pair
    return Engine.load(target, device="cpu", compute_dtype="float32", context_length=context_length, mode=mode,
                       prefill_chunk_size=24, dflash2_model=str(drafter) if mode == "dflash2" else None, **kw)


def chat_ids(engine, turns, system="You write letters."):
    """(prompt ids, the length of its conversation before the generation prompt) of a chat: turns (user, reply)."""
    messages = [{"role": "system", "content": system}]
    for user, reply in turns:
        messages.append({"role": "user", "content": user})
        if reply is not None:
            messages.append({"role": "assistant", "content": reply})
    ids = engine.tokenizer.chat_prompt_ids(messages)
    return ids, engine.tokenizer.conversation_length(messages, ids)


def scenario(engine):
    """The requests of a conversation and its variants, each built from the replies this engine gave: a generator
    sent each request's result, yielding (label, prompt ids, max_tokens, snapshot_at)."""
    turns, replies = [], []
    for user in ("abc", "klm", "xyz"):  # a chat continued turn after turn
        result = yield ("turn " + user, *chat_ids(engine, turns + [(user, None)]), 20)
        turns.append((user, engine.tokenizer.decode(result.tokens)))
        replies.append(result.tokens)
    last_prompt, end = chat_ids(engine, turns[:-1] + [(turns[-1][0], None)])
    yield ("edit the last message", *chat_ids(engine, turns[:-1] + [("pqr", None)]), 16)
    yield "regenerate the last reply", last_prompt, end, 20
    # prefills shorter than the drafter's window: its restored context rows are read
    kept, n = last_prompt + replies[-1], len(last_prompt)
    yield "a strict prefix of the kept tokens", kept[:n + 5], None, 12
    yield "ends inside a speculative block", kept[:n + 3] + [kept[n + 3] ^ 1], None, 12
    yield ("an unrelated prompt", *chat_ids(engine, [("hello", None)], system="Other."), 12)


def kept_state(engine) -> list:
    """The committed state after a request: DeltaNet states, attention and MTP cache rows of the committed
    positions, the drafter's context rows (by ring slot, with the position each holds)."""
    state, proposer = engine.state, engine.proposer
    tensors = [t.clone() for s in state.gdn for t in (s.history, s.recurrent)]
    caches = [s for s in state.layers if s not in state.gdn] + list(getattr(proposer, "caches", []))
    tensors += [t[:state.length].clone() for c in caches for t in (c.k, c.v)]
    if engine.mode == "dflash2":
        context = proposer.drafter.context
        held = context.positions >= 0
        tensors += [context.positions.clone(), context.keys[:, :context.capacity][:, held].clone(),
                    context.values[:, :context.capacity][:, held].clone()]
    return tensors


def run(engine, sampling):
    """(label, tokens, accepted_per_cycle, cached_tokens, kept_state) of each request of the scenario."""
    results, steps = [], scenario(engine)
    sent = None
    while True:
        try:
            label, ids, snapshot_at, max_tokens = steps.send(sent)
        except StopIteration:
            return results
        sent = engine.generate(ids, max_tokens, snapshot_at=snapshot_at, **sampling)
        stats = sent.stats
        results.append((label, sent.tokens, stats.get("accepted_per_cycle"), stats["cached_tokens"],
                        kept_state(engine)))


def same_state(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.allclose(x, y, rtol=1e-4, atol=1e-4)
                                    for x, y in zip(a, b))


def differences(with_reuse, without) -> list[str]:
    """The requests whose tokens, accepted lengths or kept state differ."""
    return [label for (label, *result, _, state), (_, *result0, _, state0) in zip(with_reuse, without)
            if result != result0 or not same_state(state, state0)]


@pytest.mark.parametrize("mode", MODES)
def test_reuse_gives_what_a_fresh_engine_gives(pair, mode):
    kept, fresh = load(pair, mode), load(pair, mode, prefix_reuse=False)
    assert kept.memory.prefix_snapshots["bytes"] > 0 and fresh.memory.prefix_snapshots is None
    buffer = kept.state.gdn[0].saved_recurrent.data_ptr()
    for sampling in ({}, SAMPLED):
        with_reuse, without = run(kept, sampling), run(fresh, sampling)
        assert differences(with_reuse, without) == [], f"{mode} {sampling}"
        assert all(r[3] == 0 for r in without)
        cached = {label: c for label, _, _, c, _ in with_reuse}
        assert cached["turn abc"] == 0
        assert cached["turn klm"] > 0 and cached["turn xyz"] > cached["turn klm"]
        assert cached["regenerate the last reply"] > 0 and cached["edit the last message"] > 0
        assert cached["a strict prefix of the kept tokens"] > 0 and cached["ends inside a speculative block"] > 0
        assert cached["an unrelated prompt"] == 0
    assert kept.state.gdn[0].saved_recurrent.data_ptr() == buffer  # preallocated: no snapshot buffer per request


def test_reuse_matches_a_newly_loaded_engine(pair):
    """The reference above (prefix_reuse off) is a newly loaded engine's output too."""
    engine = load(pair, "dflash2")
    prompt, _ = chat_ids(engine, [("abc", None)])
    first = engine.generate(prompt, 20)
    follow = prompt + first.tokens + prompt[3:]
    reused = engine.generate(follow, 12, **SAMPLED)
    assert reused.stats["cached_tokens"] > 0
    assert reused.tokens == load(pair, "dflash2").generate(follow, 12, **SAMPLED).tokens


@pytest.mark.parametrize("mode", MODES)
def test_chat_dropping_old_turns_matches_a_fresh_engine(pair, mode):
    replies, notes = {}, {}
    for reuse in (True, False):
        engine = load(pair, mode, context_length=200, prefix_reuse=reuse)
        out, err = io.StringIO(), io.StringIO()
        session = ChatSession(engine, 24, system="Letters.", out=out, err=err)
        cached = []
        for text in ("abc", "defg", "hij", "klmno", "pq", "rstu"):
            session.turn(text)
            cached.append(engine.last_stats["cached_tokens"])
        replies[reuse], notes[reuse] = out.getvalue(), err.getvalue()
        if reuse:
            assert max(cached[1:]) > 0
    assert "dropped" in notes[True]
    assert replies[True] == replies[False]


@pytest.fixture(scope="module")
def slow_decay(tiny_checkpoint, tmp_path_factory):
    """Random weights whose DeltaNet layers forget slowly: the planted target's next token hardly depends on what a
    DeltaNet state holds beyond the last few tokens."""
    directory = tmp_path_factory.mktemp("slow-decay")
    source = tiny_checkpoint(seed=0)
    for path in source.iterdir():
        shutil.copy(path, directory)
    weights = load_file(directory / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith("A_log"):
            tensor.fill_(-8.0)
    save_file(weights, str(directory / "model.safetensors"))
    return directory, None


def keep_length_only(context, slot):
    context.positions.copy_(context.saved_positions[slot])
    context.length = context.saved_lengths[slot]


WRONG_RESTORES = {"none": (GDNState, "restore", lambda self, slot: None),
                  "mtp": (MTPProposer, "write_rows", lambda self, *args: None),
                  "dflash2": (DrafterContext, "restore", keep_length_only)}


@pytest.mark.parametrize("mode", MODES)
def test_a_wrong_restore_is_caught(pair, mode, monkeypatch):
    """Negative controls: DeltaNet states left as the last request ended, the MTP row at the restored position not
    recomputed, the drafter's context rows not restored: each is caught."""
    fresh = run(load(pair, mode, prefix_reuse=False), {})
    monkeypatch.setattr(*WRONG_RESTORES[mode])
    assert differences(run(load(pair, mode), {}), fresh) != []


def test_a_wrong_deltanet_restore_changes_the_tokens(slow_decay, monkeypatch):
    fresh = run(load(slow_decay, "none", prefix_reuse=False), {})
    assert differences(run(load(slow_decay, "none"), {}), fresh) == []
    monkeypatch.setattr(GDNState, "restore", lambda self, slot: None)
    wrong = run(load(slow_decay, "none"), {})
    assert [r[1] for r in wrong] != [r[1] for r in fresh]


def test_reset_and_turning_it_off(pair):
    engine = load(pair, "mtp")
    prompt, _ = chat_ids(engine, [("abc", None)])
    first = engine.generate(prompt, 10)
    assert engine.generate(prompt + first.tokens, 5).stats["cached_tokens"] > 0
    engine.forget_prefix()
    assert engine.generate(prompt + first.tokens, 5).stats["cached_tokens"] == 0
    off = load(pair, "mtp", prefix_reuse=False)
    off.generate(prompt, 10)
    assert off.generate(prompt + first.tokens, 5).stats["cached_tokens"] == 0


def test_the_flag_turns_it_off():
    import argparse

    from blockspec.cli_common import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(["--model", "m"])).prefix_reuse is True
    assert engine_config(parser.parse_args(["--model", "m", "--no-prefix-reuse"])).prefix_reuse is False


@pytest.mark.parametrize("mode", ["mtp", "dflash2"])
def test_a_stream_left_open_at_exit_ends_the_process_cleanly(tiny_checkpoint, tiny_drafter, mode):
    """A caller that exits while a stream is suspended: the interpreter's teardown closes it, keeps nothing, and the
    process exits 0 (a DFlash2 stream whose snapshot was written at teardown made torch abort it)."""
    import subprocess
    import sys

    target = tiny_checkpoint(planted=True)
    drafter = f", dflash2_model={str(tiny_drafter(target))!r}" if mode == "dflash2" else ""
    script = (f"from blockspec.engine.engine import Engine\n"
              f"engine = Engine.load({str(target)!r}, mode={mode!r}, device='cpu', compute_dtype='float32'{drafter})\n"
              "stream = engine.stream(engine.tokenizer.encode('hello world ' * 3), 40)\n"
              "print([next(stream) for _ in range(3)])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.startswith("["), done.stdout
