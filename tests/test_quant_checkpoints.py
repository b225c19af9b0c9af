"""GPTQ, AWQ and block-wise FP8 checkpoints, written here from the formats' published descriptions (packing code
independent of blockspec's readers) from a tiny planted model, each beside a dense reference holding the dequantized
weights: logits match the reference to float32 rounding, greedy / MTP / DFlash2 outputs equal plain greedy of the
same quantized target, and unsupported or malformed checkpoints are refused in one line (exit code 2)."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_quant_engine import PROMPT, forward, load, run_cli
from torch import nn

import blockspec.models.checkpoint
from blockspec.layers.linear import DenseLinear, PackedLinear
from blockspec.quant import Int4Linear
from blockspec.quant.fp8 import Fp8Linear, quantize as fp8_quantize

PROJECTION = re.compile(r"\.(\w*proj\w*|fc)\.weight$")
DENSE = ("in_proj_b", "in_proj_a")  # 4 outputs in the tiny model: not a multiple of the 8 codes of an int32 word
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM packing: nibble i of a word holds output AWQ_ORDER[i]


def words(values):
    """Eight unsigned 4-bit values along the last dim -> one int32 word (value i in bits 4i..4i+3)."""
    v = values.to(torch.int64).view(*values.shape[:-1], -1, 8)
    w = (v << (4 * torch.arange(8))).sum(-1)
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def rtn_unsigned(w, group, symmetric):
    """Unsigned codes u [N, K] in [0, 15], fp16 scales and unsigned zero points [N, groups]: w ~ (u - z) * s."""
    us, ss, zs = [], [], []
    for g0 in range(0, w.shape[1], group):
        block = w[:, g0:g0 + group]
        if symmetric:
            scale = (block.abs().amax(1) / 7.5).clamp(min=1e-6).half().float()
            zero = torch.full_like(scale, 8.0)
        else:
            low, high = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            scale = ((high - low) / 15).clamp(min=1e-6).half().float()
            zero = torch.round(-low / scale).clamp(0, 15)
        us.append(torch.round(block / scale[:, None] + zero[:, None]).clamp(0, 15))
        ss.append(scale)
        zs.append(zero)
    return torch.cat(us, 1).long(), torch.stack(ss, 1), torch.stack(zs, 1).long()


def dequantized(u, s, z, group):
    expand = lambda v: v.float().repeat_interleave(group, 1)[:, :u.shape[1]]  # noqa: E731
    return (u - expand(z)) * expand(s)


def gptq(w, group=128, symmetric=True, v1=True, g_idx=None):
    """GPTQ tensors of weight [N, K] and its dequantized weight. g_idx: a permutation of the inputs whose groups
    are quantized together (act-order); None: consecutive groups."""
    order = torch.arange(w.shape[1]) if g_idx is None else g_idx
    u, s, z = rtn_unsigned(w[:, order], group, symmetric)
    reference = torch.empty_like(w)
    reference[:, order] = dequantized(u, s, z, group)
    codes = torch.empty_like(u)
    codes[:, order] = u
    group_of = torch.empty(w.shape[1], dtype=torch.int32)
    group_of[order] = torch.arange(w.shape[1], dtype=torch.int32) // group
    if v1:
        assert int(z.min()) >= 1  # v1 stores z - 1
    rows = codes.t().reshape(w.shape[1] // 8, 8, -1).transpose(1, 2)  # [K / 8, N, 8]: the 8 inputs of a word
    tensors = {"qweight": words(rows.reshape(rows.shape[0], -1)),
               "qzeros": words(z.t() - int(v1)), "scales": s.t().half(), "g_idx": group_of}
    return tensors, reference


def awq(w, group):
    u, s, z = rtn_unsigned(w, group, symmetric=False)
    interleave = lambda v: words(v.view(v.shape[0], -1, 8)[:, :, AWQ_ORDER].reshape(v.shape))  # noqa: E731
    return {"qweight": interleave(u.t()), "qzeros": interleave(z.t()), "scales": s.t().half()}, \
        dequantized(u, s, z, group)


def fp8(w):
    """float8_e4m3fn weight and float32 scales of 128 x 128 blocks: scale = block max / 448, w ~ fp8 * scale."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-n // 128), -(-k // 128))
    reference = torch.empty_like(w)
    for i in range(0, n, 128):
        for j in range(0, k, 128):
            block = w[i:i + 128, j:j + 128]
            s = float(block.abs().max()) / 448
            scale[i // 128, j // 128] = s
            q[i:i + 128, j:j + 128] = (block / s).to(torch.float8_e4m3fn)
            reference[i:i + 128, j:j + 128] = q[i:i + 128, j:j + 128].float() * s
    return {"weight": q, "weight_scale_inv": scale}, reference


def ct_fp8(w, strategy):
    """compressed-tensors float-quantized: float8_e4m3fn weight and `weight_scale` per output channel [N, 1] (bf16,
    as llm-compressor writes it) or per 128 x 128 block (float32)."""
    if strategy == "block":
        parts, reference = fp8(w)
        return {"weight": parts["weight"], "weight_scale": parts["weight_scale_inv"]}, reference
    scale = (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16)
    q = (w / scale.float()).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale.float()


def ct_fp8_config(strategy, **weights):
    """llm-compressor's FP8_DYNAMIC (channel) / FP8_BLOCK (block) quantization_config."""
    args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
            "block_structure": [128, 128] if strategy == "block" else None, **weights}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                   "strategy": "group" if strategy == "block" else "token"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args, "input_activations": activations}},
            "ignore": ["lm_head", "re:.*in_proj_a$", "re:.*in_proj_b$"]}


FORMATS = {  # name -> (quantization_config, make(weight) -> (tensors by suffix, dequantized weight))
    "gptq-sym-v1-g32": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
                        lambda w: gptq(w, 32)),
    "gptq-asym-v2-g128": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False, "desc_act": False,
                           "checkpoint_format": "gptq_v2"}, lambda w: gptq(w, 128, symmetric=False, v1=False)),
    "gptq-asym-v1-static-act-order": (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True, "static_groups": True},
        lambda w: gptq(w, 32, symmetric=False)),
    "awq-g32": ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True,
                 "modules_to_not_convert": list(DENSE)}, lambda w: awq(w, 32)),
    "fp8": ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
             "modules_to_not_convert": ["lm_head"]}, fp8),
    "ct-fp8-channel": (ct_fp8_config("channel"), lambda w: ct_fp8(w, "channel")),
    "ct-fp8-block": (ct_fp8_config("block"), lambda w: ct_fp8(w, "block")),
}


def write_quantized(source, directory, fmt):
    """A checkpoint of format `fmt` from dense `source` (every projection but DENSE quantized, MTP included) and a
    dense reference of its dequantized weights: (quantized dir, reference dir)."""
    qc, make = FORMATS[fmt]
    quantized, reference = {}, {}
    for name, t in load_file(str(source / "model.safetensors")).items():
        module = name[:-len(".weight")]
        if not PROJECTION.search(name) or module.endswith(DENSE):
            quantized[name] = reference[name] = t
            continue
        parts, reference[name] = make(t)
        quantized.update({f"{module}.{suffix}": v for suffix, v in parts.items()})
    dirs = []
    for kind, weights in (("quantized", quantized), ("reference", reference)):
        d = directory / kind
        shutil.copytree(source, d)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "model.safetensors"))
        dirs.append(d)
    config = json.loads((source / "config.json").read_text())
    (dirs[0] / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return dirs[0], dirs[1]


@pytest.fixture(scope="module")
def source(tiny_checkpoint):
    return tiny_checkpoint(seed=3, planted=True, intermediate_size=320)  # down_proj: K = 320, a partial last block


@pytest.fixture(scope="module", params=list(FORMATS))
def checkpoint(request, tmp_path_factory, source):
    return (request.param, *write_quantized(source, tmp_path_factory.mktemp(request.param), request.param))


def test_quantized_checkpoint_matches_dequantized_reference(checkpoint, source, tiny_drafter):
    fmt, quantized, ref = checkpoint
    engine, reference = load(quantized), load(ref)
    kind = Fp8Linear if "fp8" in fmt else Int4Linear
    in_proj = engine.model.layers[0].linear_attn.in_proj
    assert isinstance(in_proj, PackedLinear) and isinstance(in_proj.parts[0], kind)  # qkv and z, packed as stored
    assert [type(p) for p in in_proj.parts[1:]] == [DenseLinear]  # b and a: stored dense, packed beside them
    assert isinstance(engine.model.layers[0].mlp.down_proj, kind) and type(engine.model.lm_head) is nn.Linear
    ids = engine.tokenizer.encode(PROMPT)
    got, expected = forward(engine, ids).logits, forward(reference, ids).logits
    print(f"{fmt}: max |logit difference| vs the dequantized reference {float((got - expected).abs().max()):.2e} "
          f"(logits up to {float(expected.abs().max()):.1f})")
    assert float((got - expected).abs().max()) <= 1e-4 * max(1.0, float(expected.abs().max()))
    plain = engine.generate(ids, 40, stop_at_eos=False)
    assert plain.stats["target_quantization"] == ("fp8" if "fp8" in fmt else "int4")
    assert plain.tokens == reference.generate(ids, 40, stop_at_eos=False).tokens
    mtp = load(quantized, mode="mtp")
    assert isinstance(mtp.proposer.head.fc, kind)  # the MTP head's projections load as stored too
    assert mtp.generate(ids, 40, stop_at_eos=False).tokens == plain.tokens
    dflash2 = load(quantized, tiny_drafter(source)).generate(ids, 40, stop_at_eos=False)
    assert dflash2.tokens == plain.tokens and max(dflash2.stats["accepted_per_cycle"]) >= 3


def test_the_mtp_head_is_read_only_for_mode_mtp(checkpoint, monkeypatch):
    _, quantized, _ = checkpoint
    model, mtp = blockspec.models.checkpoint.load_target(quantized)
    assert any(isinstance(v, nn.Module) for v in mtp.values())  # quantized MTP projections, built when asked for
    read = []
    real = blockspec.models.checkpoint.read_tensors

    def recording(*args, **kwargs):
        for name, tensor in real(*args, **kwargs):
            read.append(name)
            yield name, tensor
    monkeypatch.setattr(blockspec.models.checkpoint, "read_tensors", recording)
    alone, none = blockspec.models.checkpoint.load_target(quantized, mtp_head=False)
    assert none == {} and read and not any(name.startswith("mtp.") for name in read)
    for (name, a), (_, b) in zip(model.state_dict().items(), alone.state_dict().items()):
        assert torch.equal(a, b), name
    read.clear()
    load(quantized)  # mode none
    assert read and not any(name.startswith("mtp.") for name in read)


def test_each_projection_is_built_once_its_last_shard_is_read(checkpoint, tmp_path, monkeypatch):
    fmt, quantized, _ = checkpoint
    sharded = tmp_path / "sharded"
    shutil.copytree(quantized, sharded)
    (sharded / "model.safetensors").unlink()
    tensors = load_file(str(quantized / "model.safetensors"))
    names = sorted(tensors)  # a module's parts adjacent, as in published shards (one may straddle a boundary)
    shards = [names[len(names) * j // 3:len(names) * (j + 1) // 3] for j in range(3)]
    last = {n.rsplit(".", 1)[0]: j for j, chunk in enumerate(shards) for n in chunk}
    weight_map = {}
    for j, chunk in enumerate(shards):
        save_file({n: tensors[n].contiguous() for n in chunk}, str(sharded / f"model-{j + 1}-of-3.safetensors"))
        weight_map.update(dict.fromkeys(chunk, f"model-{j + 1}-of-3.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    events = []
    real_read, real_build = blockspec.models.checkpoint.read_tensors, blockspec.models.checkpoint.quantized_linears

    def reading(files, *args, **kwargs):
        events.append(("read", files[0].name))
        yield from real_read(files, *args, **kwargs)

    def building(parts, *args, **kwargs):
        events.append(("build", sorted(parts)))
        return real_build(parts, *args, **kwargs)
    monkeypatch.setattr(blockspec.models.checkpoint, "read_tensors", reading)
    monkeypatch.setattr(blockspec.models.checkpoint, "quantized_linears", building)
    model, _ = blockspec.models.checkpoint.load_target(sharded)
    reads = [i for i, e in enumerate(events) if e[0] == "read"]
    assert len(reads) == 3
    for j, at in enumerate(reads):  # after shard j: the modules whose last part it holds, all of their parts
        built = events[at + 1][1]
        assert events[at + 1][0] == "build" and built, events[at + 1]
        assert {last[n.rsplit(".", 1)[0]] for n in built} == {j}
    assert [e[0] for e in events] == ["read", "build"] * 3  # nothing left for the end
    reference, _ = blockspec.models.checkpoint.load_target(quantized)
    for (name, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name


def variant(base, directory, name, config=None, tensors=None):
    """A copy of checkpoint `base` whose quantization_config is updated with `config` (None values delete a key) and
    whose tensors pass through `tensors` (a function editing the dict)."""
    d = directory / name
    shutil.copytree(base, d)
    if config:
        raw = json.loads((d / "config.json").read_text())
        qc = raw["quantization_config"]
        qc.update(config)
        raw["quantization_config"] = {k: v for k, v in qc.items() if v is not None}
        (d / "config.json").write_text(json.dumps(raw))
    if tensors:
        weights = load_file(str(d / "model.safetensors"))
        tensors(weights)
        save_file(weights, str(d / "model.safetensors"))
    return d


UP = "model.layers.1.mlp.up_proj"
STATIC_ACTIVATIONS = ct_fp8_config("block")["config_groups"]
STATIC_ACTIVATIONS["group_0"]["input_activations"]["dynamic"] = False
CONFIG_REFUSALS = {  # format -> (config change, the words of the one-line refusal)
    "gptq-sym-v1-g32": [({"bits": 8}, "quantization_config.bits 8"), ({"group_size": 48}, "group_size 48"),
                        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
                        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'")],
    "awq-g32": [({"version": "gemv"}, "version 'gemv'"), ({"zero_point": False}, "zero_point False"),
                ({"bits": 3}, "bits 3")],
    "fp8": [({"fmt": "e5m2"}, "fmt 'e5m2'"), ({"weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
            ({"weight_block_size": None}, "weight_block_size None"),
            ({"activation_scheme": "static"}, "activation_scheme 'static'")],
    "ct-fp8-block": [({"config_groups": ct_fp8_config("block", num_bits=4)["config_groups"]}, "4 bits are not"),
                     ({"config_groups": ct_fp8_config("token")["config_groups"]}, "FP8 strategy 'token'"),
                     ({"config_groups": ct_fp8_config("block", block_structure=[64, 64])["config_groups"]},
                      "block_structure [64, 64]"),
                     ({"config_groups": STATIC_ACTIVATIONS}, "quantizes activations with static scales"),
                     ({"config_groups": {**ct_fp8_config("block")["config_groups"], "group_1": {
                         "targets": ["re:.*mlp.*"], "format": "pack-quantized", "weights": {"num_bits": 4}}}},
                      "format 'float-quantized' of config group group_0 is not supported (need pack-quantized)")],
}


def drop(name):
    return lambda t: t.pop(name)


def replace(name, make):
    def edit(t):
        t[name] = make(t[name])
    return edit


def scatter_groups(t):
    """An act-order g_idx (desc_act without static_groups): the inputs' groups interleaved."""
    k = t[UP + ".g_idx"].shape[0]
    t[UP + ".g_idx"] = (torch.arange(k, dtype=torch.int32) % (k // 32))


TENSOR_REFUSALS = {  # format -> (tensor edit, the words of the one-line refusal)
    "gptq-sym-v1-g32": [(drop(UP + ".scales"), f"missing {UP}.scales"),
                        (replace(UP + ".qzeros", lambda z: z[:, :-1].contiguous()), f"{UP}.qzeros has shape (2, 39)"),
                        (replace(UP + ".scales", lambda s: s.to(torch.int32)), f"{UP}.scales is torch.int32"),
                        (scatter_groups, f"{UP}.g_idx scatters groups")],
    "awq-g32": [(drop(UP + ".qzeros"), f"missing {UP}.qzeros"),
                (replace(UP + ".scales", lambda s: s[:1].contiguous()), f"{UP}.scales has shape (1, 320)")],
    "fp8": [(drop(UP + ".weight_scale_inv"), f"missing {UP}.weight_scale_inv"),
            (replace(UP + ".weight_scale_inv", lambda s: s.t().contiguous()), f"{UP}.weight_scale_inv has shape"),
            (replace(UP + ".weight", lambda w: w.float()), f"{UP}.weight_scale_inv has no quantized {UP}.weight")],
    "ct-fp8-block": [(drop(UP + ".weight_scale"), f"missing {UP}.weight_scale"),
                     (replace(UP + ".weight_scale", lambda s: s.t().contiguous()), f"{UP}.weight_scale is "),
                     (replace(UP + ".weight_scale", lambda s: s.to(torch.int32)), f"{UP}.weight_scale is torch.int32")],
}


@pytest.mark.parametrize("fmt", list(CONFIG_REFUSALS))
def test_unsupported_and_malformed_checkpoints_refused(fmt, source, tmp_path, capsys):
    base, _ = write_quantized(source, tmp_path, fmt)
    for i, (change, words) in enumerate(CONFIG_REFUSALS[fmt]):  # refused from config.json, before any tensor
        d = variant(base, tmp_path, f"config{i}", config=change)
        (d / "model.safetensors").write_bytes(b"not read")
        err = run_cli(capsys, "--model", d)
        assert str(d / "config.json") in err and words in err, err
    for i, (edit, words) in enumerate(TENSOR_REFUSALS[fmt]):
        d = variant(base, tmp_path, f"tensors{i}", tensors=edit)
        err = run_cli(capsys, "--model", d)
        assert str(d / "model.safetensors") in err and words in err, err
    damaged = variant(base, tmp_path, "damaged")
    (damaged / "model.safetensors").write_bytes(b"\x00garbage" * 10)  # its header is read first, before any tensor
    err = run_cli(capsys, "--model", damaged)
    assert f"{damaged / 'model.safetensors'}: corrupt or unreadable safetensors file" in err, err
    if fmt.startswith("ct-"):  # compressed-tensors' own list: `ignore`
        listed = variant(base, tmp_path, "listed", config={"ignore": ["lm_head", UP]})
        assert "listed in the checkpoint's quantization ignore list" in run_cli(capsys, "--model", listed)
    else:
        listed = variant(base, tmp_path, "listed", config={"modules_to_not_convert": ["mlp.up_proj"]})
        assert "modules_to_not_convert lists 'mlp.up_proj'" in run_cli(capsys, "--model", listed)
    other = "int4" if "fp8" in fmt else "fp8"
    err = run_cli(capsys, "--model", base, "--target-quantization", other)
    assert f"target_quantization: '{other}'" in err and "quantized to" in err, err


def test_fp8_quantization_at_load(source):
    dense, quant = load(source), load(source, target_quantization="fp8")
    assert all(isinstance(m, Fp8Linear) for m in (quant.model.layers[0].mlp.down_proj,
                                                  quant.model.layers[0].linear_attn.in_proj.parts[0]))
    ids = dense.tokenizer.encode(PROMPT)
    got, expected = forward(quant, ids).logits, forward(dense, ids).logits
    rel = (got - expected).norm(dim=-1) / expected.norm(dim=-1)  # FP8 weights: ~2.6 % relative error each
    print(f"fp8 at load: logits relative error vs dense, max {float(rel.max()):.3f}")
    assert 0 < float(rel.max()) < 0.1
    plain = quant.generate(ids, 40, stop_at_eos=False)
    assert plain.stats["target_quantization"] == "fp8"
    mtp = load(source, mode="mtp", target_quantization="fp8")
    assert isinstance(mtp.proposer.head.fc, Fp8Linear)
    assert mtp.generate(ids, 40, stop_at_eos=False).tokens == plain.tokens


def test_fp8_at_load_quantizes_each_projection_on_its_own(source, tmp_path):
    """Quantized as it is read, each projection keeps its own 128 x 128 blocks, as an FP8 checkpoint stores them
    (packing then concatenates them): the packed weights dequantize to each projection's, and the outputs are those
    of the dense model of the dequantized weights."""
    engine = load(source, target_quantization="fp8")
    reference = {}
    for name, t in load_file(str(source / "model.safetensors")).items():
        own = name.startswith("model.layers.") and PROJECTION.search(name)
        reference[name] = Fp8Linear.from_blocks(*fp8_quantize(t)).dequantize() if own else t
    checked = 0
    for name, module in engine.model.named_modules():
        if isinstance(module, PackedLinear):
            (part,) = module.parts
            owner = name.rsplit(".", 1)[0]
            expected = torch.cat([reference[f"model.{owner}.{n}.weight"] for n in module.names])
        elif isinstance(module, Fp8Linear) and ".parts." not in name:
            part, expected = module, reference[f"model.{name}.weight"]
        else:
            continue
        assert torch.equal(part.dequantize(), expected), name
        checked += 1
    assert checked == 4 * 4  # 4 layers: packed input projection, output projection, packed gate/up, down
    shutil.copytree(source, tmp_path / "reference")
    save_file(reference, str(tmp_path / "reference" / "model.safetensors"))
    dense = load(tmp_path / "reference")
    ids = engine.tokenizer.encode(PROMPT)
    got, expected = forward(engine, ids).logits, forward(dense, ids).logits
    assert float((got - expected).abs().max()) <= 1e-4 * max(1.0, float(expected.abs().max()))
    assert engine.generate(ids, 40, stop_at_eos=False).tokens == dense.generate(ids, 40, stop_at_eos=False).tokens
