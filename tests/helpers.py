"""Test helpers: tiny random Qwen3.5 checkpoints written by transformers itself (the reference)."""

from __future__ import annotations

import subprocess
import sys

import torch

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=12, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096)

LAYER_MIXES = {
    "mixed": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "attention": ["full_attention", "full_attention"],
    "gdn": ["linear_attention", "linear_attention", "linear_attention"],
    "alternating": ["full_attention", "linear_attention", "full_attention", "linear_attention", "linear_attention"],
}


def hf_config(layer_types, tie=False, **overrides):
    from transformers import Qwen3_5TextConfig

    kw = {**TINY, **overrides}
    return Qwen3_5TextConfig(num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                             tie_word_embeddings=tie,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 1]},
                             **kw)


def randomize(model, seed):
    """Non-trivial random weights (norm weights away from their init, realistic decays)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 4.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-1, 1, generator=gen))
            elif "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                scale = 0.5 if "embed" in name else fan_in ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model


def save_hf_target(directory, layer_types, seed=0, tie=False, **overrides):
    """Build transformers' Qwen3_5ForCausalLM with random weights, save it, return the (float32, eval) model."""
    from transformers import Qwen3_5ForCausalLM

    from blockspec.fixtures.tiny import CHAT_TEMPLATE, byte_tokenizer

    torch.manual_seed(seed)
    model = randomize(Qwen3_5ForCausalLM(hf_config(layer_types, tie, **overrides)), seed).eval()
    model.save_pretrained(directory)
    tok = byte_tokenizer()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        '{"eos_token": "<|im_end|>", "chat_template": %s}' % __import__("json").dumps(CHAT_TEMPLATE))
    return model


def cli(*args):
    """Run the real console entry point in a subprocess: exit code, stdout, stderr."""
    proc = subprocess.run([sys.executable, "-m", "blockspec.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def patch_triton_interpreter():
    """numpy >= 2 refuses int() of a 1-element array, and the interpreter's program ids are such arrays. And the
    interpreter patches triton.language again at every call of a device function (inspecting the modules: about 3 ms a
    call, half the time of a kernel that calls small helpers in its loop), with the same replacements its launch
    made: a call whose language modules the running launch has patched already skips that."""
    import inspect

    import triton.language as tl
    import triton.runtime.interpreter as interp

    if getattr(interp, "_blockspec_patched", False):
        return  # patched in this process already (bench scripts run one after another): a second would wrap the first
    interp._blockspec_patched = True
    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched

    launch, patch_lang = interp.GridExecutor.__call__, interp._patch_lang
    patched_modules = set()  # ids of the language modules the running launch has patched

    def languages(fn):
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def run(self, *args, **kwargs):
        patched_modules.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched_modules.clear()  # the launch restores the modules

    def patch_once(fn):
        wanted = languages(fn)
        if patched_modules and wanted <= patched_modules:
            return interp._LangPatchScope()  # nothing to restore
        scope = patch_lang(fn)
        patched_modules.update(wanted)
        return scope

    interp.GridExecutor.__call__ = run
    interp._patch_lang = patch_once


def run_in_triton_interpreter(test_file, *args) -> list:
    """Runs `python test_file *args` with TRITON_INTERPRET=1 (Triton kernels on CPU tensors, in numpy); the script
    prints one line `RESULTS <json>`, returned parsed."""
    import json
    import os
    from pathlib import Path

    import pytest

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), str(root / "tests")]))
    proc = subprocess.run([sys.executable, str(test_file), *args], cwd=str(root), env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS "):])


def selected_parts(request, parts) -> list:
    """For one interpreter subprocess serving several tests of a module: of `parts` (a test function's name -> the
    name of its part of the subprocess's work), the parts of the tests this session runs (after -k / -m)."""
    names = {item.originalname for item in request.session.items if item.module is request.module}
    return [part for test, part in parts.items() if test in names]


def report_parts(parts, names):
    """In an interpreter subprocess: runs each part named in `names` (parts: name -> a callable returning
    JSON-serializable results) and prints one line `RESULTS <json>` mapping each name to its results, or to
    {"error": traceback} where it raised: one start of Python, torch and Triton serves several tests, and each test
    fails alone on its own part (`interpreter_part`)."""
    import json
    import traceback

    results = {}
    for name in names:
        try:
            results[name] = parts[name]()
        except Exception:  # reported to the test that asserts on this part
            results[name] = {"error": traceback.format_exc()}
    print("RESULTS " + json.dumps(results))


def interpreter_part(results, name):
    """The results of part `name` of a `report_parts` run; fails with the subprocess's traceback where it raised."""
    part = results[name]
    assert not (isinstance(part, dict) and "error" in part), part["error"]
    return part


def run_pass(model, state, ids, capture=()):
    """One pass of ids on top of state's committed tokens, left pending for commit / discard (as the engine runs it)."""
    from blockspec.engine.target import EagerTarget

    return EagerTarget(model, state, capture).forward(ids)


def proposals_beside_dflash(drafter_dir, target_dir, tokens: list[int], starts) -> list:
    """A DFlash2 drafter checkpoint loaded in blockspec (DFlash2Drafter) and in the `dflash` reference
    (DFlash2DraftModel, driven as its dflash_generate does), each proposing from the target's features of
    tokens[:start] with the anchor tokens[start], in float32 on the CPU: [(start, blockspec's proposals, dflash's)]."""
    import torch.nn.functional as F
    from dflash.model import DFlash2DraftModel

    from blockspec.models.checkpoint import load_target
    from blockspec.drafter import DFlash2Drafter
    from blockspec.train.run import TargetFeatures

    model, _ = load_target(target_dir)
    ours = DFlash2Drafter.from_pretrained(drafter_dir, target_hidden_size=model.config.hidden_size,
                                          target_vocab_size=model.config.vocab_size,
                                          target_num_layers=model.config.num_hidden_layers, embed=model.embed,
                                          lm_head=model.logits)
    theirs = DFlash2DraftModel.from_pretrained(drafter_dir).eval()
    tokens = torch.tensor(tokens)
    features, _ = TargetFeatures(model, ours.target_layer_ids, len(tokens), "cpu", torch.float32)(tokens)
    compared = []
    for start in starts:
        anchor = int(tokens[start])
        ours.reset()
        ours.append_context(features[:start], 0)
        proposals = ours.propose(anchor, start)
        block_ids = torch.tensor([[anchor] + [ours.mask_token_id] * (ours.block_size - 1)])
        with torch.no_grad():
            hidden = theirs(target_hidden=features[None, :start], noise_embedding=F.embedding(
                block_ids, model.embed_tokens.weight), position_ids=torch.arange(start + ours.block_size)[None])[0]
            expected = theirs.propose(hidden[None, 1:], block_ids[:, 0], model.logits, 0.0)[0][0]
        compared.append((start, proposals, expected))
    return compared


def sm90_ptx(kernel, constexprs: dict, warps: int, stages: int, pointers: dict, aligned: tuple = ()) -> str:
    """The kernel's PTX for sm_90 (H100 / H200), compiled here on the CPU by Triton's own compiler: arguments named in
    `pointers` are pointers of those types, the other non-constexpr ones int32. `aligned`: the int arguments a launch
    specializes as multiples of 16 (Triton's JIT does so for every such value not marked do_not_specialize), with
    16-byte aligned pointers; the vectorized loads and the pipeline that a launch compiles to depend on them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if aligned and (n in aligned or signature[n].startswith("*"))}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    return compiled.asm["ptx"]
