"""Quantization and projection packing wired into the engine (CPU, float32): int4 target (RTN at load, or a
compressed-tensors checkpoint), quantized shared head, int8 DFlash2 drafter, fuse_kvq / fuse_gate, refusals."""

import gc
import json
import re
import shutil
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers import cli, run_pass
from safetensors.torch import load_file, save_file
from torch import nn

from blockspec.models.checkpoint import load_target
from blockspec.cli import main
from blockspec.engine.engine import Engine
from blockspec.engine.weights import prepare, rtn
from blockspec.layers.linear import PackedLinear, pack_projections
from blockspec.quant import Int4Linear, Int8Linear
from blockspec.kernels.quant_matmul import unpack_groups

PROMPT = "hello world, the quick brown fox jumps over"


def load(target, drafter=None, **kw):
    return Engine.load(target, device="cpu", compute_dtype="float32", context_length=512,
                       mode=kw.pop("mode", "dflash2" if drafter else "none"),
                       dflash2_model=str(drafter) if drafter else None, **kw)


def forward(engine, ids, capture=()):
    """One pass of the target over ids from an empty state (left uncommitted)."""
    engine.state.reset()
    out = run_pass(engine.model, engine.state, torch.tensor(ids), capture)
    engine.state.discard()
    return out


def assert_close(got, expected, tol):
    """|got - expected| <= tol relative to the largest |expected| (at least 1): planted logits reach ~100."""
    scale = max(1.0, float(expected.abs().max()))
    assert float((got - expected).abs().max()) <= tol * scale, float((got - expected).abs().max())


def group_scales(module, k):
    """Per-element scale [out, k] of a quantized module (its groups expanded)."""
    return unpack_groups(module.scales, k, module.group_size).float().repeat_interleave(module.group_size, dim=1)[:, :k]


@pytest.fixture(scope="module")
def planted(tiny_checkpoint):
    return tiny_checkpoint(seed=0, planted=True)


@pytest.fixture(scope="module")
def pair(planted, tiny_drafter):
    return planted, tiny_drafter(planted, window=16)


# ----------------------------------------------------------------------------------------------------------
# target_quantization: int4 (RTN, group 128, symmetric)
# ----------------------------------------------------------------------------------------------------------

def test_int4_target_close_to_dense(planted):
    dense, quant = load(planted), load(planted, target_quantization="int4")
    dense_modules = dict(dense.model.named_modules())
    projections = [n for n, m in dense_modules.items() if isinstance(m, nn.Linear) and n.startswith("layers.")]
    swapped = {n: m for n, m in quant.model.named_modules() if isinstance(m, Int4Linear)}
    # 4 layers (3 DeltaNet + 1 attention), each: packed input projection, output projection, packed gate/up, down
    assert sorted(swapped) == sorted(projections) and len(projections) == 4 * 4
    # every weight within half a step of its group's scale: the RTN error bound; eps = worst relative error
    eps = 0.0
    for name, module in swapped.items():
        w = dense_modules[name].weight
        err = (module.dequantize() - w).abs()
        assert module.group_size == 128 and module.symmetric
        assert (err <= group_scales(module, w.shape[1]) / 2 * (1 + 1e-6)).all(), name
        eps = max(eps, float(err.norm() / w.norm()))
    # untouched: head, embeddings, norms, conv1d, decays
    for name, p in dense.model.named_parameters():
        if "proj" not in name:
            torch.testing.assert_close(dict(quant.model.named_parameters())[name], p, rtol=0, atol=0)
    assert type(quant.model.lm_head) is nn.Linear

    # logits: each layer adds its output f_i to the residual stream; quantizing perturbs f_i by about eps per
    # quantized projection (two chained per sublayer), and the final norm at most doubles a relative error, so
    # |dlogits| / |logits| <= 4 * eps * sum_i |f_i| / |x_L| per position (first order, on this residual-dominated
    # model; real models are too, random unplanted ones are chaotic)
    ids = dense.tokenizer.encode(PROMPT)
    layers = dense.model.config.num_hidden_layers
    ref = forward(dense, ids, range(layers))
    got = forward(quant, ids).logits
    xs = [dense.model.embed(torch.tensor(ids))] + list(ref.features.view(len(ids), layers, -1).unbind(1))
    contributions = sum((xs[i + 1] - xs[i]).norm(dim=-1) for i in range(layers)) / xs[-1].norm(dim=-1)
    rel = (got - ref.logits).norm(dim=-1) / ref.logits.norm(dim=-1)
    print(f"int4 target: weight error {eps:.3f}, logits relative error max {rel.max():.4f}, "
          f"bound min {(4 * eps * contributions).min():.4f}")
    assert 0 < rel.max() and (rel <= 4 * eps * contributions).all()

    # generation runs, the MTP head is quantized the same way, and speculation stays exact
    plain = quant.generate(ids, 50, stop_at_eos=False)
    assert plain.stats["target_quantization"] == "int4" and len(plain.tokens) == 50
    mtp = load(planted, mode="mtp", target_quantization="int4")
    head = mtp.proposer.head
    assert isinstance(head.fc, Int4Linear) and isinstance(head.layers[0].mlp.down_proj, Int4Linear)
    assert mtp.generate(ids, 50, stop_at_eos=False).tokens == plain.tokens
    # every dense projection is released and replaced by its packed codes and scales (the tiny model's K = 64 / 128
    # is padded to the 512-input blocks of the q16 layout, so int4 saves less here than the ~3.5x of real shapes)
    replaced = [m for m in head.modules() if isinstance(m, Int4Linear)]
    memory = mtp.memory.mtp
    assert memory["final_bytes"] == memory["loaded_bytes"] - sum(
        4 * m.in_features * m.out_features - m.weight_bytes() for m in replaced) < memory["loaded_bytes"]
    # the layers are loaded quantized: the dense model is never held whole
    assert quant.memory.target["loaded_bytes"] < dense.memory.target["loaded_bytes"]


def in_layers(name):
    return name.startswith("layers.")


def test_int4_quantized_as_read_equals_quantized_after_loading(planted):
    """The loader quantizes each projection as it is read and packing concatenates the codes: RTN is per output
    row, so that is bit for bit what packing the dense model, then quantizing it gave."""
    engine = load(planted, target_quantization="int4")
    reference, mtp = load_target(planted, "cpu", torch.float32)
    prepare(reference, rtn("int4", 128, torch.float32), in_layers)
    assert [type(m) for m in engine.model.modules()] == [type(m) for m in reference.modules()]
    got, expected = engine.model.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    plain = Engine(engine.config, model=reference, mtp_tensors=mtp, tokenizer=engine.tokenizer)
    ids = engine.tokenizer.encode(PROMPT)
    assert engine.generate(ids, 40, stop_at_eos=False).tokens == plain.generate(ids, 40, stop_at_eos=False).tokens


def test_the_loader_holds_one_dense_projection_at_a_time(planted):
    made, live_before = [], []

    def quantize(linear):
        live_before.append(sum(ref() is not None for ref in made))
        made.append(weakref.ref(linear.weight))
        return Int4Linear.from_linear(linear)

    model, _ = load_target(planted, "cpu", torch.float32, quantize=quantize)
    # every projection of the 4 layers, one by one as stored (3 DeltaNet layers of 8, an attention layer of 7)
    assert len(made) == 3 * 8 + 7
    assert live_before == [0] * len(made), live_before  # each dense one released before the next is read
    assert not any(type(m) is nn.Linear for name, m in model.named_modules() if in_layers(name))
    assert type(model.lm_head) is nn.Linear  # the head is quantize_head's (vocabulary_quantization)


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_quantizing_by_row_blocks_equals_quantizing_whole(kind, monkeypatch):
    """rtn quantizes blocks of output rows (multiples of 128) and concatenates them: the same module as one piece."""
    torch.manual_seed(0)
    linear = nn.Linear(300, 700, bias=False)  # a partial last input group; a partial last block of 128 rows
    group = 32 if kind == "int8" else 128
    whole = rtn(kind, group, torch.float32)(linear)
    monkeypatch.setattr("blockspec.engine.weights.QUANTIZE_BLOCK_ELEMENTS", 256 * 300)  # rows 256 + 256 + 188
    blocked = rtn(kind, group, torch.float32)(linear)
    assert type(blocked) is type(whole) and blocked.out_features == 700
    got, expected = blocked.state_dict(), whole.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


# ----------------------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized checkpoints (written here following /work/notes/int4-format.md)
# ----------------------------------------------------------------------------------------------------------

PROJECTION = re.compile(r"(^lm_head|\.(\w*proj\w*|fc))\.weight$")


def rtn_codes(w, symmetric):
    """Signed codes [N, K] in [-8, 7], bf16 scales [N, G] and signed zero points [N, G] (zeros if symmetric)."""
    codes, scales, zeros = [], [], []
    for g0 in range(0, w.shape[1], 128):
        block = w[:, g0:g0 + 128]
        low, high = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
        if symmetric:
            scale = (torch.maximum(-low, high) / 7.5).clamp(min=1e-8).to(torch.bfloat16).float()
            zero = torch.zeros_like(scale)
        else:
            scale = ((high - low) / 15).clamp(min=1e-8).to(torch.bfloat16).float()
            zero = torch.round(-8 - low / scale).clamp(-8, 7)
        codes.append(torch.round(block / scale[:, None] + zero[:, None]).clamp(-8, 7))
        scales.append(scale)
        zeros.append(zero)
    return torch.cat(codes, 1), torch.stack(scales, 1).to(torch.bfloat16), torch.stack(zeros, 1)


def pack_nibbles(u):
    """Unsigned 4-bit values [R, C] -> int32 [R, ceil(C/8)]: value c in bits 4*(c % 8) of word c // 8."""
    r, c = u.shape
    u = F.pad(u.to(torch.int64), (0, -c % 8)).view(r, -1, 8)
    words = (u << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def write_compressed(source, directory, symmetric, ignore):
    """A compressed-tensors copy of checkpoint `source` (every projection not ignored quantized) and a dense
    reference whose weights are the dequantized ones. Returns (compressed dir, reference dir)."""
    tensors = load_file(str(source / "model.safetensors"))
    matches = lambda module: any(re.match(i[3:], module) if i.startswith("re:") else module == i  # noqa: E731
                                 for i in ignore)
    compressed, reference = {}, {}
    for name, t in tensors.items():
        module = name[:-len(".weight")]
        if not PROJECTION.search(name) or matches(module):
            compressed[name] = reference[name] = t
            continue
        q, scale, zero = rtn_codes(t, symmetric)
        compressed[module + ".weight_packed"] = pack_nibbles(q + 8)
        compressed[module + ".weight_scale"] = scale
        compressed[module + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
        if not symmetric:
            compressed[module + ".weight_zero_point"] = pack_nibbles((zero + 8).t()).t().contiguous()
        expand = lambda v: v.float().repeat_interleave(128, 1)[:, :t.shape[1]]  # noqa: E731
        reference[name] = (q - expand(zero)) * expand(scale)
    config = json.loads((source / "config.json").read_text())
    dirs = []
    for kind, weights in (("compressed", compressed), ("reference", reference)):
        d = directory / kind
        shutil.copytree(source, d)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "model.safetensors"))
        dirs.append(d)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": list(ignore),
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric,
                                                  "strategy": "group", "group_size": 128, "dynamic": False,
                                                  "actorder": None}}}}
    (dirs[0] / "config.json").write_text(json.dumps(config))
    return dirs[0], dirs[1]


CT_CASES = {  # symmetric with the MTP head quantized; asymmetric with MTP and the DeltaNet b/a kept dense
    "symmetric": (True, ["lm_head"]),
    "asymmetric": (False, ["lm_head", r"re:mtp\..*", r"re:.*in_proj_[ab]$"]),
}


@pytest.fixture(scope="module", params=list(CT_CASES))
def compressed(request, tmp_path_factory, tiny_checkpoint):
    directory = tmp_path_factory.mktemp(request.param)
    source = tiny_checkpoint(seed=3, planted=True, intermediate_size=320)
    symmetric, ignore = CT_CASES[request.param]
    return (*write_compressed(source, directory, symmetric, ignore), symmetric, ignore)


def test_compressed_tensors_checkpoint_matches_dequantized_reference(compressed):
    ct, ref, symmetric, ignore = compressed
    engine, reference = load(ct), load(ref)
    quantized = {n: m for n, m in engine.model.named_modules() if isinstance(m, Int4Linear)}
    assert quantized and all(m.symmetric == symmetric for m in quantized.values())
    assert type(engine.model.lm_head) is nn.Linear  # ignored: stays dense
    in_proj_parts = engine.model.layers[0].linear_attn.in_proj.parts  # b / a ignored: a dense part of their own
    assert all(isinstance(part, Int4Linear) for part in in_proj_parts) == symmetric  # the ignore list is honoured
    assert engine.model.layers[0].mlp.down_proj.in_features == 320  # a partial last group
    ids = engine.tokenizer.encode(PROMPT)
    assert_close(forward(engine, ids).logits, forward(reference, ids).logits, 1e-4)
    # implies target_quantization int4; no RTN of what the checkpoint keeps dense
    result = engine.generate(ids, 40, stop_at_eos=False)
    assert engine.target_quantization == "int4" and result.stats["target_quantization"] == "int4"
    assert result.tokens == reference.generate(ids, 40, stop_at_eos=False).tokens
    mtp, mtp_reference = load(ct, mode="mtp"), load(ref, mode="mtp")
    assert isinstance(mtp.proposer.head.fc, Int4Linear) == symmetric
    spec = mtp.generate(ids, 40, stop_at_eos=False)
    assert spec.tokens == result.tokens
    # the MTP head's proposals match the reference head's: same acceptance, cycle by cycle
    assert spec.stats["accepted_per_cycle"] == mtp_reference.generate(ids, 40, stop_at_eos=False).stats[
        "accepted_per_cycle"]
    # already quantized projections are packed code for code (asymmetric: dense b/a beside int4 qkv/z, two matmuls)
    in_proj = engine.model.layers[0].linear_attn.in_proj
    assert len(in_proj.parts) == (1 if symmetric else 2)
    assert isinstance(in_proj.parts[0], Int4Linear)


# ----------------------------------------------------------------------------------------------------------
# vocabulary_quantization: the shared head
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,cls", [("int8", Int8Linear), ("int4", Int4Linear)])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_vocabulary_quantization(tiny_checkpoint, kind, cls, tie):
    target = tiny_checkpoint(seed=1, tie_word_embeddings=tie)
    dense, quant = load(target), load(target, vocabulary_quantization=kind)
    head = quant.model.lm_head
    assert isinstance(head, cls) and type(head) is cls and head.group_size == 128
    weight = dense.model.embed_tokens.weight if tie else dense.model.lm_head.weight
    torch.testing.assert_close(quant.model.embed_tokens.weight, dense.model.embed_tokens.weight, rtol=0, atol=0)
    ids = dense.tokenizer.encode(PROMPT)
    ref, got = forward(dense, ids), forward(quant, ids)
    torch.testing.assert_close(got.hidden, ref.hidden, rtol=0, atol=0)  # only the head changed
    # |h . (w - w_q)| <= sum over groups of scale/2 * |h_group|_1 (elementwise RTN bound)
    h = dense.model.norm(ref.hidden)
    bound = h.abs() @ (group_scales(head, weight.shape[1]) / 2).t()
    delta = (got.logits - ref.logits).abs()
    print(f"{kind} head ({'tied' if tie else 'untied'}): max logit change {delta.max():.4f}, "
          f"max bound {bound.max():.4f}")
    assert 0 < delta.max() and (delta <= bound * (1 + 1e-5) + 1e-5).all()
    result = quant.generate(ids, 20)
    assert result.stats["vocabulary_quantization"] == kind
    assert dense.generate(ids, 5).stats["vocabulary_quantization"] == "none"


# ----------------------------------------------------------------------------------------------------------
# dflash2_quantization: int8 drafter projections
# ----------------------------------------------------------------------------------------------------------

def test_int8_drafter_proposals_agree(pair):
    target, drafter = pair
    exact = load(target, drafter, dflash2_tree_budget=0)  # chains: their proposals compared one by one
    int8 = load(target, drafter, dflash2_quantization="int8", dflash2_tree_budget=0)
    d = int8.proposer.drafter
    quantized = sorted(n for n, m in d.named_modules() if isinstance(m, Int8Linear))
    assert quantized == sorted(["fc"] + [f"layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.qkv_proj.parts.0", "self_attn.o_proj", "mlp.gate_up_proj.parts.0", "mlp.down_proj")])
    assert all(d.get_submodule(n).group_size == 32 for n in quantized)
    assert type(d.layers[0].attention_conv.kernel_projection) is nn.Linear  # convolution controls stay native
    assert type(d.candidate_selector.hidden_projection) is nn.Linear  # the selector too
    assert int8.memory.drafter["final_bytes"] < int8.memory.drafter["loaded_bytes"]

    # drive the int8 drafter on exactly the contexts the unquantized one sees
    agree, total = 0, 0
    base_reset, base_observe, base_propose = exact.proposer.reset, exact.proposer.observe, exact.proposer.propose

    def reset():
        base_reset()
        int8.proposer.reset()

    def observe(*args):
        base_observe(*args)
        int8.proposer.observe(*args)

    def propose(anchor, position, k):
        nonlocal agree, total
        proposals = base_propose(anchor, position, k)
        other = int8.proposer.propose(anchor, position, k)
        agree += int((proposals == other).sum())
        total += proposals.shape[0]
        return proposals

    exact.proposer.reset, exact.proposer.observe, exact.proposer.propose = reset, observe, propose
    for prompt in ("hello world", "zebra", PROMPT):
        exact.generate(exact.tokenizer.encode(prompt), 120, stop_at_eos=False)
    print(f"int8 drafter: {agree}/{total} proposals equal to the unquantized drafter's ({agree / total:.3f})")
    assert total > 200 and agree / total >= 0.9


@pytest.mark.parametrize("settings", [
    {}, {"vocabulary_quantization": "int8", "target_quantization": "int4"},
], ids=["dense", "int8-head-int4-target"])
def test_int8_drafter_output_equals_plain_greedy(pair, settings):
    target, drafter = pair
    plain = load(target, **settings)
    ids = plain.tokenizer.encode("hello world")
    expected = plain.generate(ids, 200, stop_at_eos=False)
    spec = load(target, drafter, dflash2_quantization="int8", **settings).generate(ids, 200, stop_at_eos=False)
    print(f"{settings}: acceptance {spec.stats['acceptance_rate']:.2f}")
    assert spec.tokens == expected.tokens and len(spec.tokens) == 200
    assert max(spec.stats["accepted_per_cycle"]) >= 5  # the int8 drafter still gets long runs accepted


# ----------------------------------------------------------------------------------------------------------
# projection packing (always at load; fuse_kvq / fuse_gate accepted, false noted)
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_target_is_packed_at_load(planted, quantization, capsys):
    packed = load(planted, target_quantization=quantization)
    for layer in packed.model.layers:  # mixed layer types: 3 DeltaNet + 1 attention
        mixer = layer.self_attn if layer.is_attention else layer.linear_attn
        packed_name = "qkv_proj" if layer.is_attention else "in_proj"
        assert isinstance(getattr(mixer, packed_name), PackedLinear)
        assert isinstance(layer.mlp.gate_up_proj, PackedLinear)
        for name in list(type(mixer).PACKS[packed_name]) + ["mlp.gate_proj", "mlp.up_proj"]:
            owner = layer if name.startswith("mlp.") else mixer
            assert not hasattr(owner, name.split(".")[-1]), name
    names = [n for n, _ in list(packed.model.named_parameters()) + list(packed.model.named_buffers())]
    assert not any(re.search(r"\.(q_proj|k_proj|v_proj|in_proj_\w+|gate_proj|up_proj)\.", n) for n in names)
    memory = packed.memory.target
    assert memory["packed_bytes"] == memory["loaded_bytes"]  # the originals are released, nothing is duplicated
    ids = packed.tokenizer.encode(PROMPT)
    mtp = load(planted, mode="mtp", target_quantization=quantization)
    assert isinstance(mtp.proposer.head.layers[0].self_attn.qkv_proj, PackedLinear)
    assert mtp.generate(ids, 40, stop_at_eos=False).tokens == packed.generate(ids, 40, stop_at_eos=False).tokens
    capsys.readouterr()
    off = load(planted, target_quantization=quantization, fuse_kvq=False, fuse_gate=False)  # accepted, noted
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 2 and all("always packed" in n and n.startswith("blockspec: note: fuse_") for n in notes)
    assert isinstance(off.model.layers[0].mlp.gate_up_proj, PackedLinear)
    assert torch.equal(forward(off, ids).logits, forward(packed, ids).logits)


def test_packing_releases_the_original_weights(planted):
    from blockspec.config import TargetConfig
    from blockspec.models.qwen3_5 import TargetModel

    model = TargetModel(TargetConfig.from_file(planted / "config.json"))  # as constructed, before the loader packs
    originals = [weakref.ref(getattr(m, n).weight) for m in model.modules()
                 for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "q_proj", "k_proj", "v_proj",
                           "gate_proj", "up_proj") if hasattr(m, n)]
    assert len(originals) == 3 * 4 + 3 + 4 * 2
    alive, packed_parts = [], []
    real_init = PackedLinear.__init__

    def counting_init(self, linears, names):  # each pack's originals go as soon as it is built, not at the end
        gc.collect()
        alive.append(sum(ref() is not None for ref in originals))
        packed_parts.append(len(linears))
        real_init(self, linears, names)
    PackedLinear.__init__ = counting_init
    try:
        packed = pack_projections(model)
    finally:
        PackedLinear.__init__ = real_init
    assert len(packed) == 4 + 4
    assert alive == [len(originals) - sum(packed_parts[:i]) for i in range(len(alive))]
    assert pack_projections(model) == []  # packing twice is a no-op
    gc.collect()
    assert all(ref() is None for ref in originals)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_drafter_is_packed_at_load(pair, quantization):
    target, drafter = pair
    engines = [load(target, drafter, dflash2_quantization=quantization)]
    ids = engines[0].tokenizer.encode(PROMPT)
    d = engines[0].proposer.drafter
    assert isinstance(d.layers[0].self_attn.qkv_proj, PackedLinear) and isinstance(d.layers[0].mlp.gate_up_proj,
                                                                                   PackedLinear)
    assert not any(hasattr(layer.self_attn, "q_proj") or hasattr(layer.mlp, "gate_proj") for layer in d.layers)
    if quantization == "int8":
        assert isinstance(d.layers[0].self_attn.qkv_proj.parts[0], Int8Linear)
    out = engines[0].generate(ids, 60, stop_at_eos=False).tokens
    assert out == load(target).generate(ids, 60, stop_at_eos=False).tokens


# ----------------------------------------------------------------------------------------------------------
# refusals: exit code 2, one line naming the key (or the file and tensor)
# ----------------------------------------------------------------------------------------------------------

def run_cli(capsys, *args):
    code = main(["generate", *map(str, args), "--prompt", "a", "--device", "cpu", "--dtype", "float32"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (code, err)
    return err


@pytest.mark.parametrize("yaml_text,needles", [
    ("dflash2_quantization: int4\n", ["'dflash2_quantization'", "int4"]),
    ("vocabulary_quantization: int2\n", ["'vocabulary_quantization'"]),
    ("target_quantization: int8\n", ["'target_quantization'"]),
    ("dflash2_quantization: int8\n", ["dflash2_quantization", "dflash2_model"]),
    ("fuse_kvq: maybe\n", ["'fuse_kvq'"]),
])
def test_invalid_settings_refused(tmp_path, capsys, yaml_text, needles):
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {tmp_path / 'no-such-model'}\n" + yaml_text)  # refused before any model work
    err = run_cli(capsys, "--config", path)
    assert all(n in err for n in needles), err


def test_compressed_checkpoint_refusals(tmp_path, capsys, planted):
    ct, _ = write_compressed(planted, tmp_path, True, ["lm_head"])
    err = run_cli(capsys, "--model", ct, "--target-quantization", "none")
    assert "target_quantization" in err and "quantized to int4" in err, err

    def variant(name, edit_config=None, drop=None):
        d = tmp_path / name
        shutil.copytree(ct, d)
        if edit_config:
            config = json.loads((d / "config.json").read_text())
            edit_config(config["quantization_config"])
            (d / "config.json").write_text(json.dumps(config))
        if drop:
            tensors = load_file(str(d / "model.safetensors"))
            del tensors[drop]
            save_file(tensors, str(d / "model.safetensors"))
        return d

    d = variant("no-scale", drop="model.layers.1.mlp.up_proj.weight_scale")
    err = run_cli(capsys, "--model", d)
    assert str(d / "model.safetensors") in err and "model.layers.1.mlp.up_proj.weight_scale" in err, err
    d = variant("gptq", lambda qc: qc.update(quant_method="gptq"))
    err = run_cli(capsys, "--model", d)
    assert str(d / "config.json") in err and "gptq" in err, err
    d = variant("group64", lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=64))
    err = run_cli(capsys, "--model", d)
    assert str(d / "config.json") in err and "group size 64" in err, err
    d = variant("int8", lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=8))
    assert "8-bit" in run_cli(capsys, "--model", d)
    d = variant("fp8", lambda qc: qc.update(format="float-quantized"))
    assert "float-quantized" in run_cli(capsys, "--model", d)

    # a checkpoint whose lm_head is stored quantized: used as is, not quantized a second time
    (tmp_path / "head").mkdir()
    quantized_head, _ = write_compressed(planted, tmp_path / "head", True, [])
    assert isinstance(load(quantized_head).model.lm_head, Int4Linear)
    err = run_cli(capsys, "--model", quantized_head, "--vocabulary-quantization", "int8")
    assert "vocabulary_quantization" in err and "already quantized" in err, err



def test_cli_process_exit_code_and_json_stats(pair):
    target, drafter = pair
    code, _, err = cli("generate", "--model", target, "--prompt", "a", "--dflash2-quantization", "int8")
    assert code == 2 and err.count("\n") == 1 and "dflash2_quantization" in err, err
    code, out, err = cli("generate", "--model", target, "--drafter", drafter, "--prompt", "hey", "--max-tokens", 30,
                         "--json", "--device", "cpu", "--dtype", "float32", "--dflash2-quantization", "int8",
                         "--vocabulary-quantization", "int8", "--target-quantization", "int4", "--fuse-kvq",
                         "--fuse-gate")
    assert code == 0, err
    stats = json.loads(out)["stats"]
    assert stats["vocabulary_quantization"] == "int8" and stats["target_quantization"] == "int4"
