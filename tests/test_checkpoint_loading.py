"""bench/checkpoint_loading.py (the H200's measurement of loading users' checkpoints) on the tiny preset (CPU): a
checkpoint of each format written in its published layout, sharded with an index, loaded by the engine as a user's
download and decoded; bad arguments refused in one line before anything is written."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

FORMATS = ["bf16", "bf16-int4", "fp8", "ct-fp8", "gptq", "awq"]


@pytest.fixture(scope="module")
def script():
    path = Path(__file__).parent.parent / "bench" / "checkpoint_loading.py"
    spec = importlib.util.spec_from_file_location("checkpoint_loading", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_format_loads_and_decodes(script, tmp_path, capsys):
    out, ckpts = tmp_path / "results" / "ckpt.json", tmp_path / "ckpts"
    code = script.main(["--preset", "tiny", "--format", ",".join(FORMATS), "--device", "cpu", "--max-tokens", "4",
                        "--shard-gb", "0.0002", "--dir", str(ckpts), "--json-out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows] == FORMATS
    for row in rows:
        assert "error" not in row, row
        assert row["checkpoint_quantization"] == row["expected_quantization"], row
        assert row["shards"] > 1 and row["checkpoint_bytes"] > 0 and row["load_s"] > 0
        assert row["decode_tokens_per_s"] > 0 and row["same_tokens_twice"]
        assert row["page_cache_dropped"] in (True, False)
    assert [r["target_quantization"] for r in rows] == ["none", "int4", "fp8", "fp8", "int4", "int4"]
    assert rows[0]["checkpoint_bytes"] == rows[1]["checkpoint_bytes"]  # one bf16 checkpoint, loaded twice
    assert rows[4]["checkpoint_bytes"] < rows[2]["checkpoint_bytes"] < rows[0]["checkpoint_bytes"]
    assert [line.split()[0] for line in stdout.splitlines()[1:1 + len(FORMATS)]] == FORMATS  # a line per format
    assert list(ckpts.iterdir()) == []  # no --keep: each checkpoint removed once measured


def test_published_layout(script, tmp_path):
    """Hugging Face names, sharded with an index; the projections in each format's tensors (int4: GPTQ's [K/8, N]
    words, AWQ's [K, N/8]), in_proj_a / in_proj_b, the head and the norms dense."""
    config = script.preset("tiny")
    down, a = "model.layers.0.mlp.down_proj", "model.layers.0.linear_attn.in_proj_a"
    n, k = config["hidden_size"], config["intermediate_size"]
    expected = {"fp8": {down + ".weight": ((n, k), torch.float8_e4m3fn),
                        down + ".weight_scale_inv": ((1, 1), torch.float32)},
                "gptq": {down + ".qweight": ((k // 8, n), torch.int32), down + ".qzeros": ((1, n // 8), torch.int32),
                         down + ".scales": ((1, n), torch.float16), down + ".g_idx": ((k,), torch.int32)},
                "awq": {down + ".qweight": ((k, n // 8), torch.int32), down + ".qzeros": ((1, n // 8), torch.int32),
                        down + ".scales": ((1, n), torch.float16)}}
    for fmt, parts in expected.items():
        d = tmp_path / fmt
        size = script.write_checkpoint(d, fmt, config, "cpu", shard_bytes=100_000)
        index = json.loads((d / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and files == sorted(p.name for p in d.glob("*.safetensors"))
        assert index["metadata"]["total_size"] == size
        assert json.loads((d / "config.json").read_text())["quantization_config"]["quant_method"] == fmt
        tensors = {}
        for file in files:
            with safe_open(str(d / file), "pt") as f:
                tensors.update({name: f.get_tensor(name) for name in f.keys()})
        assert set(tensors) == set(index["weight_map"])
        for name, (shape, dtype) in parts.items():
            assert (tuple(tensors[name].shape), tensors[name].dtype) == (shape, dtype), name
        assert down + ".weight" in parts or down + ".weight" not in tensors
        assert tensors[a + ".weight"].dtype == tensors["lm_head.weight"].dtype == torch.bfloat16
        assert tensors["model.layers.0.linear_attn.A_log"].dtype == torch.float32
        assert "mtp.layers.0.mlp.down_proj.weight_scale_inv" in tensors if fmt == "fp8" else \
            "mtp.layers.0.mlp.down_proj.qweight" in tensors


@pytest.mark.parametrize("args, needle", [
    (["--json-out", "{tmp}/file/r.json"], "--json-out {tmp}/file/r.json: {tmp}/file is a file, not a folder"),
    (["--json-out", "{tmp}"], "is a folder"),
    (["--format", "gptq,int3"], "--format 'gptq,int3': choose from"),
    (["--dir", "{tmp}/file"], "--dir {tmp}/file: "),
])
def test_bad_arguments_refused_before_anything_is_written(script, tmp_path, capsys, args, needle):
    (tmp_path / "file").write_text("")
    args = [a.format(tmp=tmp_path) for a in args]
    base = ["--preset", "tiny", "--device", "cpu", "--dir", str(tmp_path / "ckpts")]
    assert script.main(base + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockspec: error: ") and needle.format(tmp=tmp_path) in err and err.count("\n") == 1, err
    assert not (tmp_path / "ckpts").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["file"]
