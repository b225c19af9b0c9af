"""The target model against transformers' Qwen3_5ForCausalLM (float32, CPU)."""

import pytest
import torch
from helpers import LAYER_MIXES, run_pass, save_hf_target
from safetensors.torch import load_file, save_file

from blockspec.models.checkpoint import load_target
from blockspec.engine.state import DecodeState

CASES = [("mixed", False), ("mixed", True), ("attention", False), ("gdn", True), ("alternating", False)]


def engine_logits_stepwise(model, prompt, continuation):
    """Prompt logits, then one decode step per continuation token (1-token passes, committed)."""
    state = DecodeState(model, 256, 16, "cpu", torch.float32)
    out = run_pass(model, state, prompt)
    state.commit(prompt.shape[0])
    steps = []
    for token in continuation:
        step = run_pass(model, state, token.view(1))
        state.commit(1)
        steps.append(step.logits[0])
    return out.logits, torch.stack(steps)


def hf_logits_stepwise(ref, prompt, continuation):
    from transformers import DynamicCache

    n = prompt.shape[0]
    if "full_attention" not in ref.config.layer_types:
        # transformers' cache cannot report its length without an attention layer: use one uncached pass instead
        logits = ref(torch.cat([prompt, continuation])[None], use_cache=False).logits[0]
        return logits[:n], logits[n:]
    cache = DynamicCache(config=ref.config)
    out = ref(prompt[None], position_ids=torch.arange(n)[None], past_key_values=cache, use_cache=True)
    steps = []
    for i, token in enumerate(continuation):
        steps.append(ref(token.view(1, 1), position_ids=torch.tensor([[n + i]]), past_key_values=cache,
                         use_cache=True).logits[0, 0])
    return out.logits[0], torch.stack(steps)


@pytest.mark.parametrize("mix,tie", CASES)
def test_logits_match_transformers(tmp_path, mix, tie):
    ref = save_hf_target(tmp_path, LAYER_MIXES[mix], seed=3, tie=tie)
    model, _ = load_target(tmp_path)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 300, (19,), generator=gen)
    continuation = torch.randint(0, 300, (32,), generator=gen)
    ours_prompt, ours_steps = engine_logits_stepwise(model, prompt, continuation)
    ref_prompt, ref_steps = hf_logits_stepwise(ref, prompt, continuation)
    prompt_diff = (ours_prompt - ref_prompt).abs().max().item()
    step_diff = (ours_steps - ref_steps).abs().max(dim=-1).values
    print(f"{mix} tie={tie}: prompt max diff {prompt_diff:.2e}, decode max diff {step_diff.max().item():.2e}")
    assert ref_prompt.abs().max() > 0.5  # logits are not trivially small
    assert prompt_diff <= 1e-4
    assert (step_diff <= 1e-4).all(), step_diff


@pytest.mark.parametrize("mix", ["mixed", "alternating"])
def test_greedy_tokens_match_transformers(tmp_path, mix):
    from blockspec.engine.engine import Engine

    ref = save_hf_target(tmp_path, LAYER_MIXES[mix], seed=11)
    prompt = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(1))
    expected = ref.generate(prompt[None], max_new_tokens=64, min_new_tokens=64, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, 9:].tolist()
    engine = Engine.load(tmp_path, device="cpu", compute_dtype="float32", context_length=128)
    ours = engine.generate(prompt.tolist(), 64, stop_at_eos=False).tokens
    assert len(set(expected)) > 5  # a non-degenerate trajectory
    assert ours == expected


def test_multimodal_layout_loads(tmp_path):
    """Qwen3_5ForConditionalGeneration layout: language-model prefix, vision tensors present, mtp kept."""
    text_dir, mm_dir = tmp_path / "text", tmp_path / "mm"
    text_dir.mkdir()
    ref = save_hf_target(text_dir, LAYER_MIXES["mixed"], seed=5)
    tensors = load_file(str(text_dir / "model.safetensors"))
    mm = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
          for k, v in tensors.items()}
    mm["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(12, 4)
    mm["model.visual.merger.linear_fc2.weight"] = torch.randn(64, 8)
    mm["mtp.fc.weight"] = torch.randn(64, 128)
    mm_dir.mkdir()
    save_file(mm, str(mm_dir / "model.safetensors"))
    import json
    text_cfg = json.loads((text_dir / "config.json").read_text())
    text_cfg["model_type"] = "qwen3_5_text"
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "text_config": text_cfg, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    (mm_dir / "config.json").write_text(json.dumps(cfg))
    model, mtp = load_target(mm_dir)
    assert set(mtp) == {"mtp.fc.weight"}
    prompt = torch.arange(5)
    state = DecodeState(model, 32, 16, "cpu", torch.float32)
    ours = run_pass(model, state, prompt).logits
    assert (ours - ref(prompt[None]).logits[0]).abs().max() <= 1e-4
