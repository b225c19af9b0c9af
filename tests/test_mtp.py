"""Native MTP self-speculation: head math, exact verification, equality with plain greedy, refusals."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_verification import plain_greedy, run_forced

from blockspec.cli import main
from blockspec.engine.engine import Engine
from blockspec.engine.state import DecodeState
from blockspec.fixtures.tiny import build_tiny_checkpoint
from helpers import run_pass


@pytest.fixture(scope="module")
def planted(tiny_checkpoint):
    return tiny_checkpoint(seed=0, planted=True)


def load(directory, mode="mtp", **kw):
    return Engine.load(directory, device="cpu", compute_dtype="float32", mode=mode, context_length=512, **kw)


def reference_mtp_logits(w, cfg, hidden, next_tokens):
    """MTP rows 0..T-1 written from the raw checkpoint tensors (independent of blockspec's modules)."""
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def norm(x, weight):  # zero-centred RMSNorm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)

    def rope(x, pos):
        rot = int(hd * cfg["rope_parameters"]["partial_rotary_factor"])
        inv = 1.0 / cfg["rope_parameters"]["rope_theta"] ** (torch.arange(0, rot, 2).float() / rot)
        ang = pos[:, None].float() * inv
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2, rest = x[..., :rot // 2], x[..., rot // 2:rot], x[..., rot:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    t = len(next_tokens)
    emb = w["model.embed_tokens.weight"][next_tokens]
    x = torch.cat([norm(emb, w["mtp.pre_fc_norm_embedding.weight"]), norm(hidden, w["mtp.pre_fc_norm_hidden.weight"])],
                  -1) @ w["mtp.fc.weight"].t()
    p = "mtp.layers.0."
    h = norm(x, w[p + "input_layernorm.weight"])
    qg = (h @ w[p + "self_attn.q_proj.weight"].t()).view(t, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = (h @ w[p + "self_attn.k_proj.weight"].t()).view(t, nkv, hd)
    v = (h @ w[p + "self_attn.v_proj.weight"].t()).view(t, nkv, hd)
    pos = torch.arange(t)
    q, k = rope(norm(q, w[p + "self_attn.q_norm.weight"]), pos), rope(norm(k, w[p + "self_attn.k_norm.weight"]), pos)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
    x = x + attn @ w[p + "self_attn.o_proj.weight"].t()
    h = norm(x, w[p + "post_attention_layernorm.weight"])
    mlp = F.silu(h @ w[p + "mlp.gate_proj.weight"].t()) * (h @ w[p + "mlp.up_proj.weight"].t())
    x = x + mlp @ w[p + "mlp.down_proj.weight"].t()
    return norm(x, w["mtp.norm.weight"]) @ w["lm_head.weight"].t()


def test_mtp_head_matches_independent_computation(tiny_checkpoint):
    directory = tiny_checkpoint(seed=3)  # random (not planted) weights
    w, cfg = load_file(str(directory / "model.safetensors")), json.loads((directory / "config.json").read_text())
    engine = load(directory)
    prompt = torch.randint(0, 259, (12,), generator=torch.Generator().manual_seed(0))
    state = DecodeState(engine.model, 64, 16, "cpu", torch.float32)
    out = run_pass(engine.model, state, prompt)
    next_tokens = torch.cat([prompt[1:], torch.tensor([17])])
    proposer = engine.proposer
    normed = engine.model.norm(out.hidden)
    x, draft = proposer.step_at(normed, next_tokens, 0)
    ours = engine.model.logits(x)
    expected = reference_mtp_logits(w, cfg, normed, next_tokens)
    diff = (ours - expected).abs().max().item()
    print(f"MTP head logits max abs diff {diff:.2e}")
    assert diff <= 1e-4 and expected.abs().max() > 0.5
    assert draft == int(expected[-1].argmax())


@pytest.mark.parametrize("wrong_from", [None, 0, 1, 2], ids=lambda w: f"wrong_from={w}")
def test_forced_verification_keeps_target_and_mtp_cache_exact(planted, wrong_from):
    engine = load(planted, self_speculative_num_tokens=3)
    model, proposer = engine.model, engine.proposer
    prompt = engine.tokenizer.encode("hello world")
    plain = plain_greedy(model, prompt, 40)

    def mtp_cache_check(trajectory, length):
        """Committed MTP rows 0..length-1 equal one MTP pass over the plain trajectory."""
        reference = DecodeState(model, 256, 16, "cpu", torch.float32)
        hidden = run_pass(model, reference, torch.tensor(trajectory[:length])).hidden
        fresh = load(planted).proposer
        fresh.step_at(model.norm(hidden), torch.tensor(trajectory[1:length + 1]), 0)
        for ours, ref in zip(proposer.caches, fresh.caches):
            assert (ours.k[:length] - ref.k[:length]).abs().max() <= 1e-4
            assert (ours.v[:length] - ref.v[:length]).abs().max() <= 1e-4

    run_forced(model, prompt, plain, 3, wrong_from, inner=proposer, extra_check=mtp_cache_check)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mtp_equals_plain_greedy(tiny_checkpoint, seed):
    directory = tiny_checkpoint(seed=seed, planted=True)
    prompt = load(directory, "none").tokenizer.encode(["hello world", "the quick brown fox", "zebra"][seed])
    plain = load(directory, "none").generate(prompt, 220, stop_at_eos=False)
    spec = load(directory, "mtp").generate(prompt, 220, stop_at_eos=False)
    assert spec.tokens == plain.tokens and len(plain.tokens) == 220
    accepted = spec.stats["accepted_per_cycle"]
    print(f"seed {seed}: acceptance {spec.stats['acceptance_rate']:.2f}, mean accepted length "
          f"{spec.stats['mean_accepted_length']:.2f}")
    assert 0.15 < spec.stats["acceptance_rate"] < 0.95  # the planted head is often, not always, right
    assert 3 in accepted and len(set(accepted)) >= 3  # full and at least two other acceptance lengths


def test_mtp_refusals(tmp_path, capsys):
    directory = build_tiny_checkpoint(tmp_path / "ck", seed=0)
    tensors = load_file(str(directory / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, str(directory / "model.safetensors"))
    code = main(["generate", "--model", str(directory), "--prompt", "a", "--mode", "mtp", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "no mtp.* tensors" in err and err.count("\n") == 1
    code = main(["generate", "--model", str(directory), "--prompt", "a", "--mode", "mtp", "--drafter", str(tmp_path),
                 "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "dflash2_model is set but mode is 'mtp'" in err
