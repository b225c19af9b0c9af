"""bench/checkpoint_loading.py (the H200's measurement of loading users' checkpoints) on the tiny preset (CPU): a
checkpoint of each format written in its published layout, sharded with an index, loaded by the engine as a user's
download and decoded; bad arguments refused in one line before anything is written."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import cli
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


# ------------------------------------------------------------------ bad checkpoints refused before the weights load

def without_weights(tiny_checkpoint, tmp_path, **config) -> Path:
    """A copy of the tiny checkpoint whose config.json takes `config` and whose weights file is not safetensors: a
    refusal that names a config key, not the weights, came before any weight was read."""
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(), directory)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, **config}))
    (directory / "model.safetensors").write_bytes(b"not safetensors")
    return directory


def refusal(capsys, *argv) -> str:
    from blockspec.cli import main

    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockspec: error: ") and err.count("\n") == 1, err
    return err


GENERATE = ("generate", "--prompt", "a", "--max-tokens", "2", "--device", "cpu", "--dtype", "float32")
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}


@pytest.mark.parametrize("config, needle", [
    ({"num_key_value_heads": 0}, "'num_key_value_heads'"),
    ({"linear_num_key_heads": 0}, "'linear_num_key_heads'"),
    ({"vocab_size": "abc"}, "'vocab_size'"),
    ({"num_hidden_layers": "eight"}, "'num_hidden_layers'"),
    ({"vocab_size": -5}, "'vocab_size'"),
    ({"vocab_size": 259.5}, "'vocab_size'"),
    ({"hidden_size": 0}, "'hidden_size'"),
    ({"rope_parameters": "x"}, "'rope_parameters'"),
    ({"rope_parameters": {**ROPE, "partial_rotary_factor": 3.0}}, "'rope_parameters.partial_rotary_factor'"),
    ({"rope_parameters": {**ROPE, "partial_rotary_factor": 0.01}}, "'rope_parameters.partial_rotary_factor'"),
    ({"rope_parameters": {**ROPE, "rope_theta": float("nan")}}, "'rope_parameters.rope_theta'"),
    ({"rms_norm_eps": -1}, "'rms_norm_eps'"),
    ({"eos_token_id": 99999}, "'eos_token_id'"),
    ({"eos_token_id": "x"}, "'eos_token_id'"),
    ({"tie_word_embeddings": "false"}, "'tie_word_embeddings'"),
    ({"mtp_num_hidden_layers": -1}, "'mtp_num_hidden_layers'"),
    ({"max_position_embeddings": 0}, "'max_position_embeddings'"),
    ({"num_attention_heads": 3}, "num_attention_heads 3 is not a multiple of num_key_value_heads 2"),
    ({"architectures": "Qwen3_5ForCausalLM"}, "'architectures' must be a list"),
    ({"quantization_config": "gptq"}, "'quantization_config' must be an object"),
    ({"num_hidden_layers": 1_000_000, "layer_types": None}, "'num_hidden_layers' must be an integer from 1 to 1024"),
    ({"hidden_size": 10 ** 12}, "'hidden_size' must be an integer from 1 to 1048576"),
    ({"rope_parameters": None, "rope_scaling": {"type": "yarn", "factor": 4.0}},
     "rope_scaling.type 'yarn' is not supported"),
])
def test_bad_target_config_values_refused_naming_the_key(tiny_checkpoint, tmp_path, capsys, config, needle):
    directory = without_weights(tiny_checkpoint, tmp_path, **config)
    err = refusal(capsys, *GENERATE, "--model", directory)
    assert f"{directory / 'config.json'}: " in err and needle in err, err


def test_config_json_not_an_object_or_not_a_file(tiny_checkpoint, tmp_path):
    directory = without_weights(tiny_checkpoint, tmp_path)
    (directory / "config.json").write_text("[1, 2]")
    for command in (GENERATE, ("draft-vocabulary", "--texts", directory / "config.json", "--out", tmp_path / "v")):
        code, out, err = cli(*command, "--model", directory)
        assert code == 2 and err == f"blockspec: error: {directory / 'config.json'}: the top level must be a JSON " \
            "object (got list)\n", err
    (directory / "config.json").unlink()
    (directory / "config.json").mkdir()
    code, out, err = cli(*GENERATE, "--model", directory)
    assert code == 2 and err == f"blockspec: error: {directory / 'config.json'}: cannot be read (Is a directory)\n"


def without_file_access(*argv):
    """`blockspec argv` run without root's permission to read any file (file modes then hold for root too)."""
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: file permissions cannot be simulated")
        caps = "-dac_override,-dac_read_search"
        prefix = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]
    else:
        prefix = []
    proc = subprocess.run([*prefix, sys.executable, "-m", "blockspec.cli", *map(str, argv)], capture_output=True,
                          text=True, timeout=300)
    return proc.returncode, proc.stderr


def test_unreadable_checkpoint_folder_and_weights(tiny_checkpoint, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(), directory)
    weights = directory / "model.safetensors"
    weights.chmod(0)
    code, err = without_file_access(*GENERATE, "--model", directory)
    assert code == 2 and err == f"blockspec: error: {weights}: cannot be read (Permission denied)\n", err
    weights.chmod(0o600)
    directory.chmod(0)
    try:
        code, err = without_file_access(*GENERATE, "--model", directory)
    finally:
        directory.chmod(0o755)
    assert code == 2 and err == f"blockspec: error: model {directory}: cannot be read (Permission denied)\n", err


def test_context_length_within_max_position_embeddings(tiny_checkpoint, tmp_path, capsys):
    directory = without_weights(tiny_checkpoint, tmp_path, max_position_embeddings=64)
    err = refusal(capsys, *GENERATE, "--model", directory, "--context-length", 65)
    assert "context_length 65 exceeds the model's max_position_embeddings 64" in err
    assert str(directory / "config.json") in err
    (directory / "model.safetensors").unlink()
    shutil.copy(tiny_checkpoint() / "model.safetensors", directory)
    from blockspec.engine.engine import Engine

    engine = Engine.load(directory, device="cpu", compute_dtype="float32")  # the default 4096, lowered to 64
    assert engine.context_length == 64 and engine.state.capacity == 64


def test_a_tokenizer_with_ids_past_the_vocabulary_refused_before_the_weights(tiny_checkpoint, tmp_path, capsys):
    directory = without_weights(tiny_checkpoint, tmp_path, vocab_size=100, eos_token_id=None)
    for command in (GENERATE, ("draft-vocabulary", "--texts", directory / "config.json", "--out", tmp_path / "v",
                               "--size", 50)):
        err = refusal(capsys, *command, "--model", directory)
        assert "tokenizer.json has 259 ids, more than the model's vocab_size 100" in err, err


def test_caches_past_the_host_memory_refused_on_the_cpu(tiny_checkpoint, tmp_path, capsys):
    directory = without_weights(tiny_checkpoint, tmp_path, max_position_embeddings=10 ** 12)
    err = refusal(capsys, *GENERATE, "--model", directory, "--context-length", 10 ** 11)
    assert "estimated memory for the caches and states at context_length 100000000000" in err
    assert "of the host's memory is available: lower context_length" in err


def test_draft_vocabulary_checked_before_the_target_loads(tiny_checkpoint, tmp_path, capsys):
    directory = without_weights(tiny_checkpoint, tmp_path)
    mtp = (*GENERATE, "--model", directory, "--mode", "mtp", "--draft-vocabulary")
    err = refusal(capsys, *mtp, 259)
    assert "draft_vocabulary: 259 is not smaller than the vocabulary (259 ids)" in err
    (tmp_path / "ids.json").write_text("[1, 300]")
    err = refusal(capsys, *mtp, tmp_path / "ids.json")
    assert "holds token id 300, outside the vocabulary [0, 259)" in err
    err = refusal(capsys, *mtp, tmp_path / "missing.json")
    assert f"draft_vocabulary: {tmp_path / 'missing.json'}: file not found" in err
    err = refusal(capsys, *mtp, tmp_path)
    assert f"draft_vocabulary: {tmp_path}: cannot be read (Is a directory)" in err


def test_mode_mtp_refused_without_mtp_layers(tiny_checkpoint, tmp_path, capsys):
    directory = without_weights(tiny_checkpoint, tmp_path, mtp_num_hidden_layers=0)
    err = refusal(capsys, *GENERATE, "--model", directory, "--mode", "mtp")
    assert "mode mtp needs the checkpoint's native MTP head" in err and "mtp_num_hidden_layers 0" in err


def test_tensors_stored_twice_refused(tiny_checkpoint, tmp_path, capsys):
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(), directory)
    shutil.copy(directory / "model.safetensors", directory / "model-copy.safetensors")
    err = refusal(capsys, *GENERATE, "--model", directory)
    assert "is stored twice, in model-copy.safetensors and model.safetensors" in err


@pytest.mark.parametrize("dflash, needle", [
    ({"target_layer_ids": [0, 4]}, "target_layer_ids [0, 4] include 4, but the target has 4 layers"),
    ({"block_size": 17}, "block_size 17 makes chain passes of 17 tokens, but a chain pass holds at most 16"),
])
def test_drafter_checked_against_the_target_before_loading(tiny_checkpoint, tiny_drafter, tmp_path, capsys, dflash,
                                                           needle):
    target = without_weights(tiny_checkpoint, tmp_path)
    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_drafter(tiny_checkpoint()), drafter)
    raw = json.loads((drafter / "config.json").read_text())
    raw["dflash_config"].update(dflash)
    (drafter / "config.json").write_text(json.dumps(raw))
    err = refusal(capsys, *GENERATE, "--model", target, "--drafter", drafter, "--tree-budget", 0)
    assert needle in err, err
