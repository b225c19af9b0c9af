"""DFlash2 decoding end to end: exact equality with plain greedy, drafter context built from committed features
only, refusals before any model work, CLI stats."""

import json

import pytest
import torch
from helpers import cli, run_pass
from test_verification import plain_greedy, run_forced

from blockspec.cli import main
from blockspec.engine.engine import Engine
from blockspec.engine.state import DecodeState


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, tiny_drafter):
    target = tiny_checkpoint(seed=0, planted=True)
    return target, tiny_drafter(target, window=16)


def load(target, drafter=None, **kw):
    return Engine.load(target, device="cpu", compute_dtype="float32", context_length=512,
                       mode="dflash2" if drafter else "none", dflash2_model=str(drafter) if drafter else None, **kw)


@pytest.mark.parametrize("seed,prompt", [(0, "hello world"), (1, "the quick brown fox"), (2, "zebra")])
def test_dflash2_equals_plain_greedy(tiny_checkpoint, tiny_drafter, seed, prompt):
    target = tiny_checkpoint(seed=seed, planted=True)
    drafter = tiny_drafter(target, seed=seed, window=16)
    plain_engine = load(target)
    ids = plain_engine.tokenizer.encode(prompt)
    plain = plain_engine.generate(ids, 220, stop_at_eos=False)
    spec = load(target, drafter).generate(ids, 220, stop_at_eos=False)
    accepted = spec.stats["accepted_per_cycle"]
    print(f"seed {seed}: acceptance {spec.stats['acceptance_rate']:.2f}, mean accepted length "
          f"{spec.stats['mean_accepted_length']:.2f}, cycles {spec.stats['cycles']}")
    assert spec.tokens == plain.tokens and len(plain.tokens) == 220
    assert len(set(accepted)) >= 3 and max(accepted) >= 5  # acceptance is high and varied
    if seed == 0:
        assert 0 in accepted and 7 in accepted and set(accepted) & set(range(1, 7))  # zero, full and partial
    assert len(ids) + 220 > 16  # the drafter's 16-token window is exceeded


def test_unplanted_drafter_is_still_exact(tiny_drafter, pair):
    """A random drafter (proposals almost always wrong) changes nothing but speed."""
    target, _ = pair
    drafter = tiny_drafter(target, noise=5.0)
    ids = load(target).tokenizer.encode("abc")
    assert load(target, drafter).generate(ids, 80, stop_at_eos=False).tokens == \
        load(target).generate(ids, 80, stop_at_eos=False).tokens


@pytest.mark.parametrize("wrong_from", [None, 0, 3, 6], ids=lambda w: f"wrong_from={w}")
def test_forced_verification_keeps_target_and_drafter_context_exact(pair, wrong_from):
    target, drafter_dir = pair
    engine = load(target, drafter_dir)
    model, proposer = engine.model, engine.proposer
    prompt = engine.tokenizer.encode("hello world")
    plain = plain_greedy(model, prompt, 40)

    def context_check(trajectory, length):
        """The drafter's context holds exactly the committed positions, as appended from a plain run."""
        assert proposer.drafter.context.length == length
        fresh = load(target, drafter_dir).proposer.drafter
        state = DecodeState(model, 256, 16, "cpu", torch.float32)
        features = run_pass(model, state, torch.tensor(trajectory[:length]), proposer.capture_layers).features
        fresh.append_context(features, 0)
        ours, ref = proposer.drafter.context, fresh.context
        order, ref_order = ours.positions.argsort(), ref.positions.argsort()
        assert torch.equal(ours.positions[order], ref.positions[ref_order])
        valid = ours.positions[order] >= 0  # buffers are [layers, slots, kv heads, head_dim]
        for a, b in ((ours.keys, ref.keys), (ours.values, ref.values)):
            assert (a[:, order][:, valid] - b[:, ref_order][:, valid]).abs().max() <= 1e-4

    run_forced(model, prompt, plain, 7, wrong_from, inner=proposer, extra_check=context_check)


def test_chunked_prefill_gives_same_drafter_context(pair):
    target, drafter = pair
    prompt = list(range(3, 40))
    contexts = []
    for chunk in (64, 5):
        engine = load(target, drafter, prefill_chunk_size=chunk)
        list(engine.stream(prompt, 1))
        contexts.append(engine.proposer.drafter.context)
    a, b = contexts
    assert torch.equal(a.positions, b.positions) and a.length == b.length == len(prompt)
    assert (a.keys - b.keys).abs().max() <= 1e-5 and (a.values - b.values).abs().max() <= 1e-5


def test_proposal_length_comes_from_the_checkpoint(pair):
    target, drafter = pair
    engine = load(target, drafter, self_speculative_num_tokens=2, dflash2_tree_budget=0)  # the chain's proposals
    assert engine.proposer.max_proposals == 7
    asked, propose = [], engine.proposer.propose

    def recording(anchor, position, k):
        proposals = propose(anchor, position, k)
        asked.append((k, len(proposals)))
        return proposals

    engine.proposer.propose = recording
    passes, run = [], engine.target.run
    engine.target.run = lambda anchor, proposals=None: (passes.append(1 + (0 if proposals is None else len(proposals)))
                                                        or run(anchor, proposals))
    result = engine.generate(engine.tokenizer.encode("hi"), 40, stop_at_eos=False)
    assert len(asked) == result.stats["cycles"] and len(result.tokens) == 40
    # every cycle drafts and verifies a full block, also near max_tokens (one pass length for the CUDA graph);
    # only a cycle with a single token left verifies the anchor alone
    assert all(k == n == 7 for k, n in asked)
    assert all(length == 8 for length in passes[:-1]) and passes[-1] in (1, 8)
    # acceptance counts only proposals that could be emitted: each cycle's count + 1 is what it emitted
    assert sum(result.stats["accepted_per_cycle"]) + result.stats["cycles"] == 40 - 1



def test_a_drafter_runs_shorter_blocks_than_it_was_trained_with(pair):
    """dflash2_block_size: the drafter (trained at 8) run with blocks of 5 rows proposes 4 tokens a cycle, exactly
    (output equal to plain greedy), chain and tree alike; a block longer than its own, or with another mode, is
    refused in one line naming the drafter's config before any model loads."""
    target, drafter = pair
    ids = load(target).tokenizer.encode("hello world")
    plain = load(target).generate(ids, 60, stop_at_eos=False).tokens
    for budget in (0, 6):
        engine = load(target, drafter, dflash2_block_size=5, dflash2_tree_budget=budget)
        assert engine.proposer.max_proposals == 4 and engine.proposer.drafter.block_size == 5
        result = engine.generate(ids, 60, stop_at_eos=False)
        assert result.tokens == plain and max(result.stats["accepted_per_cycle"]) == 4
    code, _, err = cli("generate", "--model", target, "--drafter", drafter, "--dflash2-block-size", 9, "--prompt",
                       "hey", "--device", "cpu")
    assert code == 2 and err.count("\n") == 1
    assert f"dflash2_block_size 9 exceeds the drafter's block size 8 ({drafter}/config.json)" in err
    code, _, err = cli("generate", "--model", target, "--mode", "mtp", "--dflash2-block-size", 4, "--prompt", "hey",
                       "--device", "cpu")
    assert code == 2 and "dflash2_block_size: 4 sets the blocks of a DFlash2 drafter" in err and "'mtp'" in err


def test_cli_dflash2_json_stats(pair):
    target, drafter = pair
    code, out, err = cli("generate", "--model", target, "--drafter", drafter, "--mode", "dflash2", "--prompt", "hey",
                         "--max-tokens", 60, "--json", "--device", "cpu", "--dtype", "float32")
    assert code == 0, err
    stats = json.loads(out)["stats"]
    assert {"cycles", "accepted_per_cycle", "mean_accepted_length", "acceptance_rate"} <= set(stats)
    assert len(stats["accepted_per_cycle"]) == stats["cycles"]
    assert stats["mean_accepted_length"] == pytest.approx((sum(stats["accepted_per_cycle"]) + stats["cycles"])
                                                          / stats["cycles"], abs=1e-3)


REFUSALS = [  # (setting, what the message names)
    ("batch_size: 2\n", "batch_size 2"),
    ("beam_size: 4\n", "beam_size 4"),
    ("top_p: 1.5\n", "'top_p'"),
]


@pytest.mark.parametrize("yaml_text,needle", REFUSALS, ids=[n for _, n in REFUSALS])
def test_unsupported_requests_refused_before_model_work(tmp_path, capsys, yaml_text, needle):
    """The model path does not even exist: the refusal must come first, and be true in every mode."""
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {tmp_path / 'no-such-model'}\ndflash2_model: {tmp_path / 'no-drafter'}\n" + yaml_text)
    code = main(["generate", "--config", str(path), "--prompt", "a"])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1, err
    without_drafter = tmp_path / "plain.yaml"  # the same refusal without a drafter: the message holds there too
    without_drafter.write_text(f"model: {tmp_path / 'no-such-model'}\n" + yaml_text)
    assert main(["generate", "--config", str(without_drafter), "--prompt", "a"]) == 2
    assert needle in capsys.readouterr().err


def test_drafter_that_does_not_fit_is_refused_at_load(tmp_path, pair):
    target, drafter = pair
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["vocab_size"] = 300
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes((drafter / "model.safetensors").read_bytes())
    code, _, err = cli("generate", "--model", target, "--drafter", bad, "--prompt", "a", "--device", "cpu")
    assert code == 2 and "vocab_size 300 does not match the target's 259" in err and err.count("\n") == 1
