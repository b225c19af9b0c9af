"""DFlash2 drafter vs the MIT `dflash` 0.1.0 reference, plus unit tests of its parts.

The reference is a tiny random DFlash2DraftModel built from dflash's own classes and driven the way
dflash_generate drives it (new committed target features each cycle, cache cropped back to the
committed length), with a fake target (random embedding table + lm_head).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from blockspec.drafter import DFlash2Drafter, DrafterConfig
from blockspec.drafter.context import EMPTY_SLOT, DrafterContext
from blockspec.drafter.model import DynamicCausalConv
from blockspec.kernels.drafter_conv import grouped_dynamic_causal_conv
from blockspec.kernels.attention import apply_rope, rope_inverse_frequencies, rope_tables
from blockspec.drafter.model import CandidateSelector
from blockspec.errors import BlockspecError

transformers = pytest.importorskip("transformers")
reference = pytest.importorskip("dflash.model")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 300, 64, 4, 2, 16
LAYERS, WINDOW, BLOCK, MASK_ID = 3, 16, 8, 299
TARGET_LAYERS, TARGET_LAYER_IDS = 6, [1, 3]
TOLERANCE = 1e-5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The matrices here are tiny; extra threads only cost time (a lot on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class FakeTarget:
    """Just what the drafter borrows from a target: the embedding table and the vocabulary head."""

    def __init__(self, seed: int, vocab: int = VOCAB, hidden: int = HIDDEN, dtype: torch.dtype = torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, hidden, generator=g).to(dtype)
        self.head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(vocab, hidden, generator=g) / hidden**0.5)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.table)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def reference_config(is_causal=None, dflash_extra=None, **overrides):
    dflash_config = dict(
        block_size=BLOCK, mask_token_id=MASK_ID, target_layer_ids=TARGET_LAYER_IDS, conv_kernel_size=2,
        conv_group_size=16, selector_rank=8, selector_top_k=5, **(dflash_extra or {}),
    )
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, use_sliding_window=True,
        sliding_window=WINDOW, layer_types=["sliding_attention"] * LAYERS,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, rms_norm_eps=1e-6,
        dflash_config=dflash_config, architectures=["DFlash2DraftModel"], num_target_layers=TARGET_LAYERS,
    )
    if is_causal is not None:
        kwargs["is_causal"] = is_causal
    kwargs.update(overrides)
    return transformers.Qwen3Config(**kwargs)


@torch.no_grad()
def randomize(model: nn.Module, seed: int) -> None:
    """Non-trivial weights everywhere, scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith("base_kernel"):
            kernel = 0.1 * torch.randn(p.shape, generator=g)
            kernel[:, 0] += 1.0
            p.copy_(kernel)
        elif "codebook" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            scale = {"kernel_projection": 0.2, "o_proj": 0.5, "down_proj": 0.5}.get(name.split(".")[-2], 1.0)
            p.copy_(scale * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def save_reference(directory, seed=0, bare_codebooks=False, **config_kwargs):
    model = reference.DFlash2DraftModel(reference_config(**config_kwargs)).eval()
    randomize(model, seed)
    model.save_pretrained(directory)
    if bare_codebooks:  # the published checkpoint's naming
        path = directory / "model.safetensors"
        tensors = safetensors_torch.load_file(path)
        for kind in ("predecessor", "successor"):
            tensors[f"candidate_selector.{kind}_codebook"] = tensors.pop(f"candidate_selector.{kind}_codebook.weight")
        safetensors_torch.save_file(tensors, path)
    return model


def load(directory, target, **overrides):
    kwargs = dict(
        target_hidden_size=HIDDEN, target_vocab_size=VOCAB, target_num_layers=TARGET_LAYERS,
        embed=target.embed, lm_head=target.lm_head,
    )
    kwargs.update(overrides)
    return DFlash2Drafter.from_pretrained(directory, **kwargs)


@torch.no_grad()
def compare_with_reference(ref, drafter, target, *, prompt_length, cycles, seed, dtype=torch.float32, device="cpu"):
    """Drive both drafters over the same committed trajectory; return the worst differences seen."""
    g = torch.Generator().manual_seed(seed)
    total = prompt_length + cycles * BLOCK + 1
    features = torch.randn(total, len(TARGET_LAYER_IDS) * HIDDEN, generator=g).to(device, dtype)
    scale = float(reference._draft_value(ref.config, "input_embedding_scale", 1.0))
    cache = reference._make_cache(ref.config)
    drafter.reset()
    worst = {"hidden": 0.0, "logits": 0.0}
    same_tokens = []
    committed_from, start = 0, prompt_length  # features of [committed_from, start) are new this cycle
    anchor = int(torch.randint(VOCAB - 1, (1,), generator=g))
    for _ in range(cycles):
        # reference, as in dflash_generate
        block_ids = torch.tensor([[anchor] + [MASK_ID] * (BLOCK - 1)], device=device)
        noise = F.embedding(block_ids, target.table) * scale
        ref_hidden = ref(
            target_hidden=features[None, committed_from:start], noise_embedding=noise,
            position_ids=torch.arange(committed_from, start + BLOCK, device=device)[None], past_key_values=cache,
            use_cache=True,
        )[0]
        reference._crop_to(cache, start)
        ref_logits = ref.compute_logits(ref_hidden[1:], target.head)
        ref_tokens = ref.propose(ref_hidden[None, 1:], block_ids[:, 0], target.head, 0.0)[0][0]

        drafter.append_context(features[committed_from:start], committed_from)
        hidden = drafter.forward_block(anchor, start)
        logits = drafter.draft_logits(hidden[1:])
        tokens = drafter.propose(anchor, start)

        worst["hidden"] = max(worst["hidden"], (hidden - ref_hidden).abs().max().item())
        worst["logits"] = max(worst["logits"], (logits - ref_logits).abs().max().item())
        same_tokens.append(torch.equal(tokens, ref_tokens))

        accepted = int(torch.randint(BLOCK, (1,), generator=g))  # 0 .. block-1 proposals accepted
        committed_from, start = start, start + accepted + 1
        anchor = int(torch.randint(VOCAB - 1, (1,), generator=g))
    return worst, same_tokens, start


CASES = {
    "causal-short-prompt": dict(prompt_length=5),
    "causal-long-prompt": dict(prompt_length=23),  # prefill alone overflows the window
    "noncausal-published-like": dict(prompt_length=9, is_causal=False, bare_codebooks=True),
    "noncausal-extras": dict(
        prompt_length=3, is_causal=False, attention_bias=True,
        dflash_extra={"input_embedding_scale": 1.5, "output_multiplier": 0.7, "final_logit_softcapping": 6.0},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_across_cycles_and_eviction(tmp_path, case):
    options = dict(CASES[case])
    prompt_length = options.pop("prompt_length")
    ref = save_reference(tmp_path, seed=1, **options)
    target = FakeTarget(seed=2)
    drafter = load(tmp_path, target)
    worst, same_tokens, end = compare_with_reference(
        ref, drafter, target, prompt_length=prompt_length, cycles=24, seed=3
    )
    print(f"\n{case}: max |hidden diff| {worst['hidden']:.2e}, max |logit diff| {worst['logits']:.2e}, "
          f"{len(same_tokens)} cycles, last position {end}")
    assert end > 3 * WINDOW  # the ring wrapped several times
    assert worst["hidden"] <= TOLERANCE and worst["logits"] <= TOLERANCE
    assert all(same_tokens)


@pytest.mark.parametrize("case", ["causal-long-prompt", "noncausal-extras"])
def test_matches_reference_in_float64(tmp_path, case):
    """In float64 the remaining float32 differences (attention kernel reduction order over a different
    number of masked keys) vanish: the computations are the same."""
    options = dict(CASES[case])
    prompt_length = options.pop("prompt_length")
    ref = save_reference(tmp_path, seed=1, **options).double()
    target = FakeTarget(seed=2, dtype=torch.float64)
    drafter = load(tmp_path, target, dtype=torch.float64)
    worst, same_tokens, _ = compare_with_reference(
        ref, drafter, target, prompt_length=prompt_length, cycles=24, seed=3, dtype=torch.float64
    )
    print(f"\n{case} float64: max |hidden diff| {worst['hidden']:.2e}, max |logit diff| {worst['logits']:.2e}")
    assert worst["hidden"] <= 1e-12 and worst["logits"] <= 1e-12
    assert all(same_tokens)


def exact_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Attention accumulated in float64, so the number of masked keys cannot change the rounding."""
    assert attn_mask is not None and not is_causal
    repeat = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(repeat, -3).double(), v.repeat_interleave(repeat, -3).double()
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    return (scores.masked_fill(~attn_mask, float("-inf")).softmax(-1) @ v).to(q.dtype)


@pytest.mark.parametrize("case", ["causal-short-prompt", "noncausal-published-like"])
def test_bfloat16_roundings_follow_the_reference(tmp_path, monkeypatch, case):
    """With attention made order-independent, bf16 results are bit-identical: every cast is in the same place."""
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", exact_attention)
    options = dict(CASES[case])
    prompt_length = options.pop("prompt_length")
    ref = save_reference(tmp_path, seed=1, **options)
    inverse_frequencies = ref.rotary_emb.inv_freq.clone()
    ref.to(torch.bfloat16)
    ref.rotary_emb.inv_freq = inverse_frequencies  # a loaded bf16 model keeps it in float32
    target = FakeTarget(seed=2, dtype=torch.bfloat16)
    drafter = load(tmp_path, target, dtype=torch.bfloat16)
    worst, same_tokens, _ = compare_with_reference(
        ref, drafter, target, prompt_length=prompt_length, cycles=24, seed=3, dtype=torch.bfloat16
    )
    assert worst["hidden"] == 0 and worst["logits"] == 0
    assert all(same_tokens)


def test_comparison_can_fail(tmp_path):
    """Perturbing one drafter weight must show up as hidden-state and proposal differences."""
    ref = save_reference(tmp_path, seed=1, is_causal=False)
    target = FakeTarget(seed=2)
    drafter = load(tmp_path, target)
    with torch.no_grad():
        drafter.layers[1].mlp.down_proj.weight.add_(0.5 * torch.randn(drafter.layers[1].mlp.down_proj.weight.shape))
    worst, same_tokens, _ = compare_with_reference(ref, drafter, target, prompt_length=5, cycles=12, seed=3)
    assert worst["hidden"] > 1e-2
    assert not all(same_tokens)


# ------------------------------------------------------------------ rotary embedding


def test_rope_is_split_half_rotation():
    theta, heads, rows = 10000.0, 3, 5
    positions = torch.tensor([0, 1, 7, 100, 4095])
    x = torch.randn(rows, heads, HEAD_DIM)
    inverse = rope_inverse_frequencies(HEAD_DIM, theta)
    cos, sin = rope_tables(positions, HEAD_DIM, theta, torch.float32)
    out = apply_rope(x, cos, sin)
    half = HEAD_DIM // 2
    for t, p in enumerate(positions.tolist()):
        for j in range(half):
            # the angle is rounded to float32 first, as in the reference; the rest is exact here
            angle = (torch.tensor(float(p)) * inverse[j]).item()
            assert math.isclose(angle, p * theta ** (-2 * j / HEAD_DIM), rel_tol=1e-6)
            a, b = x[t, :, j].double(), x[t, :, j + half].double()
            assert torch.allclose(out[t, :, j].double(), a * math.cos(angle) - b * math.sin(angle), atol=1e-5)
            assert torch.allclose(out[t, :, j + half].double(), b * math.cos(angle) + a * math.sin(angle), atol=1e-5)
    # same frequencies as the reference's rotary embedding
    ref_rope = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(reference_config())
    assert torch.equal(ref_rope.inv_freq, inverse)
    # scores depend only on relative position
    q, k = torch.randn(1, 1, HEAD_DIM), torch.randn(1, 1, HEAD_DIM)

    def score(i, j):
        ci, si = rope_tables(torch.tensor([i]), HEAD_DIM, theta, torch.float32)
        cj, sj = rope_tables(torch.tensor([j]), HEAD_DIM, theta, torch.float32)
        return (apply_rope(q, ci, si) * apply_rope(k, cj, sj)).sum()

    assert torch.allclose(score(9, 4), score(509, 504), atol=1e-4)


# ------------------------------------------------------------------ dynamic convolution


def test_conv_formula_and_block_boundary():
    g = torch.Generator().manual_seed(0)
    rows, channels, group, taps = 6, 8, 4, 3
    x = torch.randn(rows, channels, generator=g)
    dynamic = torch.randn(rows, taps, channels // group, generator=g)
    static = torch.randn(taps, channels, generator=g)
    y = grouped_dynamic_causal_conv(x, dynamic, static, group)
    expected = torch.zeros(rows, channels)
    for t in range(rows):
        for c in range(channels):
            for o in range(taps):
                if t - o >= 0:  # taps reaching before the block start read zero
                    expected[t, c] += (static[o, c] + dynamic[t, o, c // group]) * x[t - o, c]
    assert torch.allclose(y, expected, atol=1e-6)
    # causal: row t ignores later rows; row 0 sees only itself
    changed = x.clone()
    changed[3:] += 1.0
    assert torch.equal(grouped_dynamic_causal_conv(changed, dynamic, static, group)[:3], y[:3])
    # nothing crosses the block boundary: a previous block acts exactly like zeros
    before = torch.randn(2, channels, generator=g)
    dyn_before = torch.randn(2, taps, channels // group, generator=g)
    joined = grouped_dynamic_causal_conv(torch.cat([before, x]), torch.cat([dyn_before, dynamic]), static, group)
    zeroed = grouped_dynamic_causal_conv(torch.cat([0 * before, x]), torch.cat([dyn_before, dynamic]), static, group)
    assert torch.allclose(zeroed[2:], y, atol=1e-6)
    assert not torch.allclose(joined[2:4], y[:2])


def test_conv_module_matches_reference_module():
    torch.manual_seed(0)
    theirs = reference.GroupedDynamicCausalConv(32, 2, 8)
    with torch.no_grad():
        theirs.base_kernel.copy_(torch.randn(2, 2, 32))
        theirs.kernel_projection.weight.copy_(torch.randn_like(theirs.kernel_projection.weight))
    ours = DynamicCausalConv(32, 2, 8)
    ours.load_state_dict(theirs.state_dict())
    x, y = torch.randn(BLOCK, 32), torch.randn(BLOCK, 32)
    their_before, their_after = theirs.prepare(x[None])
    our_before, our_after = ours.prepare(x)
    assert torch.allclose(our_before, their_before[0], atol=1e-6)
    assert torch.allclose(ours.finish(y, our_after), theirs.finish(y[None], their_after)[0], atol=1e-6)


# ------------------------------------------------------------------ selector


def test_selector_walk_by_hand():
    vocab, rank, hidden = 7, 3, 4
    selector = CandidateSelector(vocab, hidden, rank, top_k=3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in selector.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    h = torch.randn(4, hidden, generator=g)
    logits = torch.randn(4, vocab, generator=g)
    anchor = torch.tensor([5])
    P, S = selector.predecessor_codebook.weight, selector.successor_codebook.weight
    W = selector.hidden_projection.weight
    previous, expected = 5, []
    for row in range(4):
        candidates = sorted(range(vocab), key=lambda v: -logits[row, v].item())[:3]
        projected = [sum(W[r, i].item() * h[row, i].item() for i in range(hidden)) for r in range(rank)]
        scores = {
            c: logits[row, c].item() + sum(P[previous, r].item() * projected[r] * S[c, r].item() for r in range(rank))
            for c in candidates
        }
        previous = max(scores, key=scores.get)
        expected.append(previous)
    assert selector.walk(h, logits, anchor).tolist() == expected


def test_selector_transition_can_overrule_the_logits():
    """The pair score decides between near-tied candidates, depending on the previous token."""
    selector = CandidateSelector(4, 2, 2, top_k=2)
    with torch.no_grad():
        selector.hidden_projection.weight.copy_(torch.eye(2))
        selector.predecessor_codebook.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
        selector.successor_codebook.weight.copy_(torch.tensor([[0.0, 0.0], [0.0, 0.0], [5.0, 0.0], [0.0, 5.0]]))
    h = torch.tensor([[1.0, 1.0]])
    logits = torch.tensor([[0.0, 0.0, 1.0, 1.5]])  # plain argmax: 3
    scores = selector.transition_scores(*torch.topk(logits[0], 2), torch.tensor([0]), selector.hidden_projection(h)[0])
    assert torch.allclose(scores, torch.tensor([1.5, 6.0]))  # candidates in order [3, 2]
    assert selector.walk(h, logits, torch.tensor([0])).tolist() == [2]  # after 0: 2 (1 + 5 > 1.5)
    assert selector.walk(h, logits, torch.tensor([1])).tolist() == [3]  # after 1: 3 (1.5 + 5 > 1)


# ------------------------------------------------------------------ bounded context


def _rows(layers, n, start):
    """Context rows whose every value encodes its position, for checking where rows land."""
    k = torch.arange(start, start + n, dtype=torch.float32).view(1, n, 1, 1).expand(layers, n, 2, 3).clone()
    return k, -k


def test_context_ring_wraparound():
    context = DrafterContext(2, 2, 3, capacity=4, device="cpu", dtype=torch.float32)
    assert torch.equal(context.positions, torch.full((4,), EMPTY_SLOT))
    context.write(*_rows(2, 3, 0), 0)
    context.write(*_rows(2, 3, 3), 3)  # positions 3, 4, 5 -> slots 3, 0, 1
    assert context.length == 6
    assert context.positions.tolist() == [4, 5, 2, 3]
    assert context.keys[1, :, 0, 0].tolist() == [4.0, 5.0, 2.0, 3.0]
    assert context.values[0, :, 1, 2].tolist() == [-4.0, -5.0, -2.0, -3.0]
    context.write(*_rows(2, 4, 9), 9)  # a skipped stretch (only allowed when fully overwritten)
    assert context.positions.tolist() == [12, 9, 10, 11]
    with pytest.raises(ValueError):
        context.write(*_rows(2, 5, 13), 13)  # more rows than slots
    with pytest.raises(ValueError):
        context.write(*_rows(2, 1, 5), 5)  # rewriting the past


def test_bounded_context_keeps_last_window_positions(tmp_path):
    save_reference(tmp_path, seed=1)
    drafter = load(tmp_path, FakeTarget(seed=2))
    features = torch.randn(WINDOW + 9, len(TARGET_LAYER_IDS) * HIDDEN)
    drafter.append_context(features[:10], 0)
    drafter.append_context(features[10:], 10)
    assert drafter.context.length == WINDOW + 9
    assert sorted(drafter.context.positions.tolist()) == list(range(9, WINDOW + 9))
    # the oldest kept position is outside every query's window: changing it changes nothing
    other = load(tmp_path, FakeTarget(seed=2))
    changed = features.clone()
    changed[9] += 5.0
    other.append_context(changed, 0)
    assert torch.equal(other.forward_block(7, WINDOW + 9), drafter.forward_block(7, WINDOW + 9))
    changed[10] += 5.0  # one step later it is visible
    other.reset()
    other.append_context(changed, 0)
    assert not torch.allclose(other.forward_block(7, WINDOW + 9), drafter.forward_block(7, WINDOW + 9))


@pytest.mark.parametrize("first,total", [(3, 5), (14, 19), (2, 40)])
def test_partial_appends_equal_one_append(tmp_path, first, total):
    save_reference(tmp_path, seed=1)
    target = FakeTarget(seed=2)
    whole, parts = load(tmp_path, target), load(tmp_path, target)
    features = torch.randn(total, len(TARGET_LAYER_IDS) * HIDDEN)
    whole.append_context(features, 0)
    parts.append_context(features[:first], 0)
    parts.append_context(features[first:], first)
    assert torch.equal(whole.context.positions, parts.context.positions)
    # equal up to matrix-multiply rounding, which depends on the number of rows
    print(f"\n{first}+{total - first}: max |K diff| {(whole.context.keys - parts.context.keys).abs().max():.1e}")
    assert torch.allclose(whole.context.keys, parts.context.keys, atol=1e-5, rtol=0)
    assert torch.allclose(whole.context.values, parts.context.values, atol=1e-5, rtol=0)
    assert torch.equal(whole.propose(11, total), parts.propose(11, total))


def test_reset_reuses_buffers(tmp_path):
    save_reference(tmp_path, seed=1)
    drafter = load(tmp_path, FakeTarget(seed=2))
    features = torch.randn(30, len(TARGET_LAYER_IDS) * HIDDEN)
    drafter.append_context(features, 0)
    first = drafter.propose(42, 30)
    buffers = [t.data_ptr() for t in (drafter.context.keys, drafter.context.values, drafter.context.positions)]
    drafter.reset()
    assert [t.data_ptr() for t in (drafter.context.keys, drafter.context.values, drafter.context.positions)] == buffers
    assert drafter.context.length == 0 and (drafter.context.positions == EMPTY_SLOT).all()
    with pytest.raises(ValueError):
        drafter.propose(42, 30)  # the context no longer ends there
    drafter.append_context(features, 0)
    assert torch.equal(drafter.propose(42, 30), first)


def test_append_checks_contiguity_and_width(tmp_path):
    save_reference(tmp_path, seed=1)
    drafter = load(tmp_path, FakeTarget(seed=2))
    drafter.append_context(torch.randn(4, 2 * HIDDEN), 0)
    with pytest.raises(ValueError):
        drafter.append_context(torch.randn(2, 2 * HIDDEN), 5)
    with pytest.raises(ValueError):
        drafter.append_context(torch.randn(2, HIDDEN), 4)


# ------------------------------------------------------------------ load-time refusals


def test_config_matches_published_shape():
    raw = {
        "architectures": ["DFlash2DraftModel"], "is_causal": False, "attention_bias": False, "head_dim": 128,
        "hidden_size": 5120, "intermediate_size": 17408, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 5, "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048,
        "use_sliding_window": True, "vocab_size": 248320, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
        "dflash_config": {"block_size": 8, "mask_token_id": 248070, "target_layer_ids": [5, 19, 33, 47, 61],
                          "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
    }
    config = DrafterConfig.from_dict(raw)
    assert (config.block_size, config.sliding_window, config.causal, config.rope_theta) == (8, 2048, False, 1e7)
    del raw["is_causal"]
    assert DrafterConfig.from_dict(raw).causal  # transformers: sliding layers are causal unless told otherwise


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (dict(target_vocab_size=301), ["vocab_size", "300", "301"]),
        (dict(target_hidden_size=48), ["hidden_size", "64", "48"]),
        (dict(target_num_layers=3), ["target_layer_ids", "3 layers"]),
    ],
)
def test_refuses_drafter_that_does_not_fit_target(tmp_path, overrides, needles):
    save_reference(tmp_path, seed=1)
    with pytest.raises(BlockspecError) as error:
        load(tmp_path, FakeTarget(seed=2), **overrides)
    message = str(error.value)
    assert "\n" not in message and all(n in message for n in needles), message


def _rewrite_weights(directory, change):
    path = directory / "model.safetensors"
    tensors = safetensors_torch.load_file(path)
    change(tensors)
    safetensors_torch.save_file(tensors, path)


def test_refuses_missing_tensor(tmp_path):
    save_reference(tmp_path, seed=1)
    _rewrite_weights(tmp_path, lambda t: t.pop("layers.2.mlp_conv.base_kernel"))
    with pytest.raises(BlockspecError, match=r"missing tensor 'layers\.2\.mlp_conv\.base_kernel' .*\(2, 2, 64\)"):
        load(tmp_path, FakeTarget(seed=2))


def test_refuses_wrong_shape(tmp_path):
    save_reference(tmp_path, seed=1)
    _rewrite_weights(tmp_path, lambda t: t.update({"layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}))
    expected = r"'layers\.0\.self_attn\.k_proj\.weight' has shape \(64, 64\).*\(32, 64\)"
    with pytest.raises(BlockspecError, match=expected):
        load(tmp_path, FakeTarget(seed=2))


def test_refuses_weights_of_more_layers_than_the_config(tmp_path):
    save_reference(tmp_path, seed=1)
    _rewrite_weights(tmp_path, lambda t: t.update({f"layers.{LAYERS}.mlp.up_proj.weight":
                                                   t["layers.0.mlp.up_proj.weight"].clone()}))
    with pytest.raises(BlockspecError, match=f"is of a layer past num_hidden_layers {LAYERS}"):
        load(tmp_path, FakeTarget(seed=2))


def test_refuses_integer_weights(tmp_path):
    save_reference(tmp_path, seed=1)
    _rewrite_weights(tmp_path, lambda t: t.update({"layers.0.self_attn.k_proj.weight":
                                                   t["layers.0.self_attn.k_proj.weight"].long()}))
    with pytest.raises(BlockspecError, match=r"'layers\.0\.self_attn\.k_proj\.weight' is stored as I64"):
        load(tmp_path, FakeTarget(seed=2))


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda c: c["dflash_config"].pop("selector_rank"), "dflash_config.selector_rank"),
        (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "architectures"),
        (lambda c: c.update(layer_types=["sliding_attention", "full_attention", "sliding_attention"]), "layer_types"),
        (lambda c: c["dflash_config"].update(target_layer_ids="1,3"), "dflash_config.target_layer_ids"),
        (lambda c: c.pop("sliding_window"), "sliding_window"),
        (lambda c: c["dflash_config"].update(block_size=100), "'dflash_config.block_size' must be at most 64"),
        (lambda c: c.update(num_target_layers=3), "'dflash_config.target_layer_ids' include 3, but num_target_layers"),
        (lambda c: c.update(num_target_layers=TARGET_LAYERS + 1),
         f"num_target_layers {TARGET_LAYERS + 1} (the target it was trained with) does not match the target's"),
        (lambda c: c.update(architectures="DFlash2DraftModel"), "must be a list of names including"),
        (lambda c: c.update(rms_norm_eps=-1), "'rms_norm_eps' must be above 0"),
        (lambda c: c.update(rms_norm_eps=float("nan")), "'rms_norm_eps' must be a finite number"),
        (lambda c: c.update(rope_parameters={"rope_theta": float("inf"), "rope_type": "default"}),
         "rope_theta' must be a positive number"),
        (lambda c: c["dflash_config"].update(output_multiplier=float("inf")), "output_multiplier' must be a finite"),
        (lambda c: c["dflash_config"].update(final_logit_softcapping=float("nan")), "final_logit_softcapping' must"),
    ],
)
def test_refuses_bad_config(tmp_path, edit, needle):
    save_reference(tmp_path, seed=1)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))
    with pytest.raises(BlockspecError) as error:
        load(tmp_path, FakeTarget(seed=2))
    assert needle in str(error.value) and str(path) in str(error.value)
