"""Sampling (engine/sampling.py): the filters against transformers' own, and lossless speculative sampling.

The distribution tests draw the first three tokens of hundreds of requests in every mode on a planted pair whose
target is softened (its head scaled down), and compare their empirical joint distribution with the exact one,
enumerated from the target's logits with transformers' logits processors as the reference, by a chi-square test at
a fixed significance. The same test rejects deliberately biased variants (acceptance by argmax match; the DFlash2
selector reporting a q that is not the one it drew from; a draft tree walked by argmax, or its chain's rejected
proposals redrawn from p instead of the residual), so it can fail.
"""

import shutil
from collections import Counter

import pytest
import torch
from helpers import cli, run_pass
from safetensors.torch import load_file, save_file

from blockspec.engine import sampling
from blockspec.engine import target as engine_target
from blockspec.engine.engine import Engine
from blockspec.engine.sampling import TOP_K_CAP, draw, processed_probs, ranked_probs
from blockspec.engine.state import DecodeState
from blockspec.errors import BlockspecError
from blockspec.fixtures.tiny import build_tiny_checkpoint, build_tiny_drafter
from blockspec.kernels import drafter_selector

SIGNIFICANCE = 1e-3   # a lossless mode must not be rejected at this level
REJECTED = 1e-6       # a biased variant must be rejected at least this clearly
SAMPLES = 400         # requests per mode and setting (the test's level holds at any count)
CONTROL_SAMPLES = 600  # requests per biased variant: each rejected by a wide margin (p <= 3.9e-8)
TOKENS = 3            # the joint distribution of the first three generated tokens
SETTINGS = {
    "T0.7": dict(temperature=0.7),
    "T1.0": dict(temperature=1.0),
    "T1.0-top_p0.9": dict(temperature=1.0, top_p=0.9),
    "T1.0-top_k20": dict(temperature=1.0, top_k=20),
}


# ------------------------------------------------------------------------------------------------ the filters


def reference_probs(logits: torch.Tensor, temperature, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """transformers' processors, in its order, in float64."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    scores = logits.double().reshape(1, -1)
    for warper in warpers:
        scores = warper(None, scores)
    return scores.softmax(-1)[0]


FILTERS = [dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=1.0, top_p=0.6),
           dict(temperature=0.9, min_p=0.2), dict(temperature=0.6, top_k=20, top_p=0.8, min_p=0.05),
           dict(temperature=1.0, top_k=40, top_p=0.95), dict(temperature=2.0, top_k=1)]


@pytest.mark.parametrize("settings", FILTERS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_filters_equal_transformers(settings):
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)) * 3
    filters = [torch.tensor(settings.get(k, d)) for k, d in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0),
                                                              ("min_p", 0.0))]
    ours = processed_probs(logits, *filters)
    expected = torch.stack([reference_probs(row, **settings) for row in logits])
    assert ours.dtype == torch.float32 and torch.allclose(ours.double(), expected, atol=1e-6)
    assert ((ours > 0) == (expected > 0)).all()  # the same tokens kept
    if 0 < settings.get("top_k", 0) <= TOP_K_CAP // 2:  # the ranking a top-k request uses: no sort of all 300
        ids, ranked = ranked_probs(logits, *filters, width=TOP_K_CAP)
        assert ids.shape == (3, TOP_K_CAP) and torch.equal(torch.zeros_like(ours).scatter_(-1, ids, ranked), ours)


def test_filter_order_is_top_k_then_top_p():
    """A case where the order matters: top-p over the renormalised top-2 keeps one token, over the full
    distribution it would keep two."""
    logits = torch.tensor([[2.0, 1.9, 1.8, 1.7, 1.6]]).log()
    ours = processed_probs(logits, torch.tensor(1.0), torch.tensor(2), torch.tensor(0.5), torch.tensor(0.0))
    assert ours[0].nonzero().flatten().tolist() == [0]
    assert torch.allclose(ours[0].double(), reference_probs(logits[0], 1.0, top_k=2, top_p=0.5))


def test_draw_never_takes_a_token_of_probability_zero():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    uniforms = torch.tensor([1.0, 1e-300, 0.5, 0.5 + 1e-12], dtype=torch.float64)
    assert draw(probs, uniforms).tolist() == [3, 1, 1, 3]
    many = draw(torch.tensor([[0.2, 0.0, 0.3, 0.5]]).expand(40000, 4), 1 - torch.rand(40000, dtype=torch.float64,
                                                                                      generator=torch.Generator()
                                                                                      .manual_seed(1)))
    counts = torch.bincount(many, minlength=4) / 40000
    assert counts[1] == 0 and torch.allclose(counts, torch.tensor([0.2, 0.0, 0.3, 0.5]), atol=0.01)


# ------------------------------------------------------------------------------------------------ the planted pair


@pytest.fixture(scope="module")
def soft_pair(tmp_path_factory):
    """A 2-layer planted target whose head is scaled by 0.2, so that at temperature 0.7-1 its next token is spread
    over several tokens (the planted one 0.5-0.8 likely; the MTP head shares the head), and its DFlash2 drafter
    with the selector's successor codes scaled by 0.1, so that the selector's q is spread too (its most likely
    candidate 0.4-0.75 on average)."""
    root = tmp_path_factory.mktemp("soft")
    planted = build_tiny_checkpoint(root / "planted", seed=0, planted=True, num_hidden_layers=2,
                                    layer_types=("linear_attention", "full_attention"))
    target = root / "target"
    shutil.copytree(planted, target)
    drafter = build_tiny_drafter(root / "drafter", target)
    for path, name, scale in ((target, "lm_head.weight", 0.2),
                              (drafter, "candidate_selector.successor_codebook.weight", 0.1)):
        tensors = load_file(str(path / "model.safetensors"))
        tensors[name] *= scale
        save_file(tensors, str(path / "model.safetensors"))
    return target, drafter


@pytest.fixture(scope="module")
def engines(soft_pair):
    target, drafter = soft_pair
    engines = {mode: Engine.load(target, device="cpu", compute_dtype="float32", context_length=256, mode=mode,
                                 **({"dflash2_model": str(drafter), "dflash2_tree_budget": 0} if mode == "dflash2"
                                    else {}))
               for mode in ("none", "mtp", "dflash2")}
    engines["dflash2 tree"] = Engine.load(target, device="cpu", compute_dtype="float32", context_length=256,
                                          dflash2_model=str(drafter), dflash2_tree_budget=12)
    engines["dflash2 tree lookup"] = Engine.load(target, device="cpu", compute_dtype="float32", context_length=256,
                                                 dflash2_model=str(drafter), dflash2_tree_budget=12,
                                                 dflash2_tree_lookup=4)
    return engines


class ExactJoint:
    """The exact distribution of the first generated tokens, from the target's own float32 logits (one plain pass
    per prefix, cached) and the reference processors."""

    def __init__(self, engine, prompt):
        self.model, self.prompt, self.logits = engine.model, prompt, {}

    def next_probs(self, prefix: tuple, settings) -> torch.Tensor:
        if prefix not in self.logits:
            state = DecodeState(self.model, 64, 16, "cpu", torch.float32)
            self.logits[prefix] = run_pass(self.model, state, torch.tensor(self.prompt + list(prefix))).logits[-1]
        return reference_probs(self.logits[prefix], **settings)

    def joint(self, settings, depth: int, floor: float) -> dict:
        """{outcome: probability} of every outcome whose prefixes all have probability >= floor (the rest, whose
        total is 1 - the sum, is pooled by the test)."""
        outcomes = {(): 1.0}
        for _ in range(depth):
            grown = {}
            for prefix, mass in outcomes.items():
                probs = self.next_probs(prefix, settings)
                for token in (probs * mass >= floor).nonzero().flatten().tolist():
                    grown[prefix + (token,)] = mass * float(probs[token])
            outcomes = grown
        return outcomes

    def possible(self, outcome: tuple, settings) -> bool:
        """Whether every token of the outcome is allowed by the filters after its prefix."""
        return all(self.next_probs(outcome[:i], settings)[outcome[i]] > 0 for i in range(len(outcome)))


def chi_square(observed: Counter, exact: dict, n: int) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value): a cell per outcome expected at least 5 times, the rest pooled."""
    cells = [(outcome, n * p) for outcome, p in exact.items() if n * p >= 5]
    counts = [observed[outcome] for outcome, _ in cells]
    expected = [e for _, e in cells]
    rest_expected, rest_count = n - sum(expected), n - sum(counts)
    if rest_expected >= 5:
        counts.append(rest_count)
        expected.append(rest_expected)
    else:  # too rare to stand alone: joins the least likely cell
        smallest = expected.index(min(expected))
        counts[smallest] += rest_count
        expected[smallest] += rest_expected
    o, e = torch.tensor(counts, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    statistic, dof = float(((o - e) ** 2 / e).sum()), len(counts) - 1
    return statistic, dof, float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def sample_first_tokens(engine, prompt, settings, n=SAMPLES, first_seed=0) -> tuple[Counter, list]:
    outcomes, accepted = Counter(), []
    for seed in range(first_seed, first_seed + n):
        result = engine.generate(prompt, TOKENS, stop_at_eos=False, seed=seed, **settings)
        outcomes[tuple(result.tokens)] += 1
        accepted += result.stats.get("accepted_per_cycle", [])
    return outcomes, accepted


def distribution_test(engine, settings, label, n=SAMPLES, prompt=None):
    prompt = prompt or engine.tokenizer.encode("a")
    exact = ExactJoint(engine, prompt)
    observed, accepted = sample_first_tokens(engine, prompt, settings, n)
    impossible = [o for o in observed if not exact.possible(o, settings)]
    statistic, dof, p = chi_square(observed, exact.joint(settings, TOKENS, 0.25 / n), n)
    cycles = f"; accepted per cycle {dict(sorted(Counter(accepted).items()))}" if accepted else ""
    print(f"\n{label}: {n} samples, {len(observed)} distinct outcomes, chi-square {statistic:.1f} on {dof} "
          f"degrees of freedom, p = {p:.3g}{cycles}")
    return impossible, p


# plain sampling at its two ranking paths (a full sort; top-k's narrow ranking): its filters are checked against
# transformers' above, setting by setting; the speculative modes at every setting
@pytest.mark.parametrize("mode,setting", [("none", "T1.0-top_p0.9"), ("none", "T1.0-top_k20")]
                         + [(mode, setting) for mode in ("mtp", "dflash2") for setting in SETTINGS]
                         + [("dflash2 tree", "T1.0-top_k20")])
def test_first_tokens_follow_the_target_distribution(engines, mode, setting):
    impossible, p = distribution_test(engines[mode], SETTINGS[setting], f"{mode} {setting}")
    assert not impossible, impossible
    assert p > SIGNIFICANCE


def repeating_prompt(engines) -> list[int]:
    """"a", its greedy continuation, "a" again: a lookup branch copies the continuation, the target's likeliest
    tokens."""
    start = engines["none"].tokenizer.encode("a")
    return start + engines["none"].generate(start, 8, stop_at_eos=False).tokens + start


def test_lookup_branch_keeps_the_target_distribution(engines):
    """A tree whose last 4 nodes are a branch copied from the context (layers/tree.py ContextLookup), on a prompt
    that repeats itself: first tokens distributed as plain sampling's, and kept paths that go through the branch's
    nodes."""
    engine = engines["dflash2 tree lookup"]
    prompt = repeating_prompt(engines)
    through = []  # per cycle, whether the kept path holds a node of the branch's slots (past the drafter's 8)
    run_tree = engine.target.run_tree

    def recording(tree, depth, *args):
        features, result = run_tree(tree, depth, *args)
        through.append(any(node > 8 for node in result[2:3 + int(result[0])].tolist()))
        return features, result
    engine.target.run_tree = recording
    try:
        impossible, p = distribution_test(engine, SETTINGS["T1.0-top_k20"], "dflash2 tree lookup T1.0-top_k20",
                                          prompt=prompt)
    finally:
        del engine.target.run_tree
    assert not impossible, impossible
    assert p > SIGNIFICANCE
    assert sum(through) > 20, sum(through)


def argmax_match_accept(logits, tokens, draft_ids, draft_probs, uniforms, filters, width=None):
    """Biased: greedy verification (a proposal is kept when it is the target's argmax), then a token sampled from
    the target where the proposals stop."""
    p = processed_probs(logits, *filters)
    matches = (tokens[1:] == p[:-1].argmax(-1)).long().cumprod(0).sum()
    return torch.cat([matches.reshape(1), draw(p[matches].reshape(1, -1), uniforms[-1:])])


def walk_reporting_per_position_q(unary, candidates, projected, anchor, predecessor, successor, temperature,
                                  uniforms):
    """Biased: the proposals are drawn as the selector draws them, but the q reported is each row's distribution
    from the drafter's logits alone (a per-position distribution), not the one the selector drew the proposal from
    given the pick before it."""
    chosen, _ = TRUE_WALK(unary, candidates, projected, anchor, predecessor, successor, temperature, uniforms)
    return chosen, torch.softmax(unary.float() / temperature, -1)


TRUE_WALK = drafter_selector.sampled_walk_reference
TRUE_TREE_WALK = sampling.walk


def tree_walk_descending_on_argmax(logits, draft_tree, max_depth, uniforms=None, draft=None, filters=None,
                                   width=None):
    """Biased: the tree walked by the target's argmax (greedy), then the token after the path drawn from p."""
    result = TRUE_TREE_WALK(logits, draft_tree, max_depth).clone()
    if uniforms is not None:
        ids, probs = ranked_probs(logits, *filters, width=width)
        leaf = result[2 + result[0]]
        result[1] = ids[leaf, draw(probs[leaf].reshape(1, -1), uniforms[:1])[0]]
    return result


TRUE_PROPOSAL_TESTS = sampling.proposal_tests


def chain_tests_redrawing_from_p(ids, p, vocab_size, proposals, draft_ids, draft_probs, uniforms):
    """Biased: a rejected proposal of the tree's chain is redrawn from p instead of the residual max(p - q, 0)."""
    accepted, _ = TRUE_PROPOSAL_TESTS(ids, p, vocab_size, proposals, draft_ids, draft_probs, uniforms)
    return accepted, p


@pytest.mark.parametrize("variant", ["argmax-match acceptance", "per-position q", "tree walked by argmax",
                                     "tree chain redrawn from p", "lookup tree walked by argmax"])
def test_biased_variants_are_rejected(engines, monkeypatch, variant):
    mode, prompt = "dflash2", None
    if variant == "argmax-match acceptance":
        monkeypatch.setattr(sampling, "speculative_accept", argmax_match_accept)
    elif variant == "per-position q":
        monkeypatch.setattr(drafter_selector, "sampled_walk_reference", walk_reporting_per_position_q)
    elif variant.endswith("tree walked by argmax"):
        monkeypatch.setattr(engine_target, "walk", tree_walk_descending_on_argmax)
        mode = "dflash2 tree"
        if variant.startswith("lookup"):  # the prompt whose branch the walk enters (the test above)
            mode, prompt = "dflash2 tree lookup", repeating_prompt(engines)
    else:
        monkeypatch.setattr(sampling, "proposal_tests", chain_tests_redrawing_from_p)
        mode = "dflash2 tree"
    _, p = distribution_test(engines[mode], SETTINGS["T0.7"], f"{mode} T0.7 with {variant}", CONTROL_SAMPLES,
                             prompt)
    assert p < REJECTED


# ------------------------------------------------------------------------------------------------ acceptance, seeds


@pytest.mark.parametrize("mode", ["mtp", "dflash2"])
def test_acceptance_under_sampling_is_partial_and_full(engines, mode):
    engine = engines[mode]
    prompt = engine.tokenizer.encode("a")
    for temperature in (0.7, 1.0):
        stats = engine.generate(prompt, 200, stop_at_eos=False, temperature=temperature, seed=0).stats
        accepted = stats["accepted_per_cycle"]
        print(f"\n{mode} T{temperature}: acceptance {stats['acceptance_rate']:.3f}, mean accepted length "
              f"{stats['mean_accepted_length']:.2f}, accepted per cycle {dict(sorted(Counter(accepted).items()))}")
        full = engine.proposer.max_proposals
        assert 0 in accepted and full in accepted and set(accepted) & set(range(1, full))
    greedy = engine.generate(prompt, 200, stop_at_eos=False).stats
    print(f"{mode} greedy: acceptance {greedy['acceptance_rate']:.3f}, mean accepted length "
          f"{greedy['mean_accepted_length']:.2f}")


@pytest.mark.parametrize("mode", ["none", "mtp", "dflash2"])
def test_seeds(engines, mode):
    engine = engines[mode]
    prompt = engine.tokenizer.encode("a")

    def run(**kw):
        result = engine.generate(prompt, 40, stop_at_eos=False, temperature=1.0, top_p=0.95, **kw)
        return result.tokens, result.stats["sampling"]

    same, stats = run(seed=7)
    assert run(seed=7)[0] == same and run(seed=8)[0] != same
    assert stats == {"temperature": 1.0, "top_k": 0, "top_p": 0.95, "min_p": 0.0, "seed": 7}
    fresh, fresh_stats = run()
    assert run()[0] != fresh  # no seed: fresh randomness for each request
    assert run(seed=fresh_stats["seed"])[0] == fresh  # the seed the stats report repeats the request


@pytest.mark.parametrize("mode", ["none", "mtp", "dflash2"])
def test_temperature_zero_is_greedy_whatever_the_filters(engines, mode):
    engine = engines[mode]
    prompt = engine.tokenizer.encode("abc")
    greedy = engine.generate(prompt, 30, stop_at_eos=False)
    filtered = engine.generate(prompt, 30, stop_at_eos=False, temperature=0, top_k=3, top_p=0.5, min_p=0.3, seed=1)
    assert filtered.tokens == greedy.tokens and greedy.stats["sampling"] == {"temperature": 0.0}


def test_sampling_settings_from_the_config(soft_pair):
    target, _ = soft_pair
    engine = Engine.load(target, device="cpu", compute_dtype="float32", context_length=64, temperature=0.8, seed=5,
                         top_k=20)
    prompt = engine.tokenizer.encode("a")
    configured = engine.generate(prompt, 20, stop_at_eos=False)
    assert configured.stats["sampling"] == {"temperature": 0.8, "top_k": 20, "top_p": 1.0, "min_p": 0.0, "seed": 5}
    assert engine.generate(prompt, 20, stop_at_eos=False, temperature=0.8, seed=5).tokens == configured.tokens
    assert engine.generate(prompt, 20, stop_at_eos=False, temperature=0).stats["sampling"] == {"temperature": 0.0}


BAD_VALUES = [("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -0.5), ("top_p", 0.0),
              ("top_p", 1.5), ("top_k", -1), ("min_p", -0.1), ("min_p", 1.1)]


@pytest.mark.parametrize("field,value", BAD_VALUES, ids=[f"{f}={v}" for f, v in BAD_VALUES])
def test_bad_sampling_values_are_refused_naming_the_field(engines, field, value):
    engine = engines["none"]
    with pytest.raises(BlockspecError, match=f"'{field}'"):
        engine.generate([1, 2], 4, **{"temperature": 0.7, field: value})


def test_cli_sampling_flags(soft_pair, engines, capsys):
    """The flags reach the engine: a seeded run of the command gives Engine.generate's tokens for the same settings
    (another process, the same stream); a bad value is one line naming the key, exit code 2."""
    import json

    from blockspec.cli import main

    target, drafter = soft_pair
    flags = ["--prompt", "a", "--max-tokens", "12", "--device", "cpu", "--dtype", "float32", "--json",
             "--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--min-p", "0.01", "--seed", "3"]
    code, out, err = cli("generate", "--model", target, *flags)
    assert code == 0, err
    settings = {"temperature": 0.9, "top_k": 20, "top_p": 0.95, "min_p": 0.01, "seed": 3}
    engine = engines["none"]
    expected = engine.generate(engine.tokenizer.encode("a"), 12, stop_at_eos=True, **settings)
    assert json.loads(out)["tokens"] == expected.tokens and json.loads(out)["stats"]["sampling"] == settings
    assert main(["generate", "--model", str(target), "--drafter", str(drafter), *flags]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["mode"] == "dflash2" and stats["cycles"] > 0 and stats["sampling"] == settings
    assert main(["generate", "--model", str(target), "--prompt", "a", "--device", "cpu", "--top-p", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "'top_p'" in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("mode", ["mtp", "dflash2"])
def test_sampled_proposals_over_a_draft_vocabulary(soft_pair, mode):
    """Proposals (and their q) over a draft vocabulary: the request runs, repeats with its seed, and every accepted
    proposal lies in the set, while the target still emits tokens outside it."""
    target, drafter = soft_pair
    engine = Engine.load(target, device="cpu", compute_dtype="float32", context_length=256, mode=mode,
                         draft_vocabulary=80, dflash2_model=str(drafter) if mode == "dflash2" else None)
    allowed = set(engine.proposer.draft_head.ids.tolist())
    proposed = []
    propose = engine.proposer.propose

    def recording(*args):
        out = propose(*args)
        proposed.extend(out.tolist())
        return out
    engine.proposer.propose = recording
    prompt = engine.tokenizer.encode("a")
    result = engine.generate(prompt, 120, stop_at_eos=False, temperature=1.0, seed=2)
    assert set(proposed) <= allowed and set(result.tokens) - allowed
    assert result.stats["acceptance_rate"] > 0.05 and result.stats["draft_vocabulary"] == len(allowed)
    assert engine.generate(prompt, 120, stop_at_eos=False, temperature=1.0, seed=2).tokens == result.tokens
