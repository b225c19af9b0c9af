"""CLI: --json schema, demo, and one-line errors with exit code 2 for every kind of bad input."""

import json
import shutil

import pytest
from helpers import cli

from blockspec.cli import main


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint(seed=0)


BASE = ("--device", "cpu", "--dtype", "float32")


def test_generate_json_schema(tiny):
    code, out, err = cli("generate", "--model", tiny, "--prompt", "Hello there", "--max-tokens", 12, "--json", *BASE)
    assert code == 0, err
    result = json.loads(out)  # exactly one JSON object on stdout
    assert set(result) == {"tokens", "text", "stats"}
    assert 1 <= len(result["tokens"]) <= 12 and all(isinstance(t, int) for t in result["tokens"])
    assert {"prefill_s", "decode_tokens_per_s", "generated"} <= set(result["stats"])
    assert result["stats"]["generated"] == len(result["tokens"])


def test_generate_prompt_ids_and_chat_agree_with_api(tiny):
    from blockspec.engine.engine import Engine

    code, out, _ = cli("generate", "--model", tiny, "--prompt-ids", "5,6,7,8", "--max-tokens", 10, "--json", *BASE)
    engine = Engine.load(tiny, device="cpu", compute_dtype="float32")
    assert json.loads(out)["tokens"] == engine.generate([5, 6, 7, 8], 10).tokens
    code, out, _ = cli("generate", "--model", tiny, "--prompt", "Hi", "--chat", "--max-tokens", 6, "--json", *BASE)
    chat_ids = engine.tokenizer.encode(engine.tokenizer.chat_prompt([{"role": "user", "content": "Hi"}]))
    assert "<think>\n\n</think>" in engine.tokenizer.decode(chat_ids) or chat_ids  # thinking disabled
    assert json.loads(out)["tokens"] == engine.generate(chat_ids, 6).tokens


def test_generate_streams_text(tiny):
    code, out, err = cli("generate", "--model", tiny, "--prompt", "abc", "--max-tokens", 8, *BASE)
    assert code == 0 and "tokens/s" in err and out.strip() != ""


def test_demo_runs():
    code, out, err = cli("demo", "--max-tokens", 60)
    assert code == 0, err
    assert "RANDOM weights" in out and "tokens/s" in out
    assert "outputs identical to plain greedy: yes" in out and "acceptance" in out


def corrupt_copy(tiny, tmp_path, edit):
    target = tmp_path / "ckpt"
    shutil.copytree(tiny, target)
    edit(target)
    return target


def drop_tensor(name):
    def edit(directory):
        from safetensors.torch import load_file, save_file
        tensors = load_file(str(directory / "model.safetensors"))
        del tensors[name]
        save_file(tensors, str(directory / "model.safetensors"))
    return edit


def reshape_tensor(name):
    def edit(directory):
        from safetensors.torch import load_file, save_file
        tensors = load_file(str(directory / "model.safetensors"))
        tensors[name] = tensors[name][:-1].contiguous()
        save_file(tensors, str(directory / "model.safetensors"))
    return edit


def set_config(**changes):
    def edit(directory):
        cfg = json.loads((directory / "config.json").read_text())
        cfg.update(changes)
        (directory / "config.json").write_text(json.dumps(cfg))
    return edit


CHECKPOINT_ERRORS = [
    ("no_config", lambda d: (d / "config.json").unlink(), "config.json: file not found"),
    ("bad_json", lambda d: (d / "config.json").write_text("{oops"), "not valid JSON"),
    ("no_weights", lambda d: (d / "model.safetensors").unlink(), "no *.safetensors weights"),
    ("corrupt_weights", lambda d: (d / "model.safetensors").write_bytes(b"\x00garbage" * 10), "corrupt"),
    ("missing_tensor", drop_tensor("model.layers.1.mlp.up_proj.weight"),
     "missing tensor model.layers.1.mlp.up_proj.weight (shape (128, 64))"),
    ("bad_shape", reshape_tensor("model.layers.3.self_attn.k_proj.weight"), "k_proj.weight has shape (63, 64)"),
    ("architecture", set_config(model_type="llama", architectures=["LlamaForCausalLM"]), "unsupported architecture"),
    ("no_tokenizer", lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json: file not found"),
]


@pytest.mark.parametrize("name,edit,message", CHECKPOINT_ERRORS, ids=[c[0] for c in CHECKPOINT_ERRORS])
def test_bad_checkpoint_one_line_error(tiny, tmp_path, name, edit, message):
    directory = corrupt_copy(tiny, tmp_path, edit)
    code, out, err = cli("generate", "--model", directory, "--prompt", "hi", "--max-tokens", 4, *BASE)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err


REQUEST_ERRORS = [
    (("--prompt", "x" * 60, "--max-tokens", 10, "--context-length", 64), "exceeds context_length 64"),
    (("--prompt", "", "--max-tokens", 4), "prompt is empty"),
    (("--prompt-ids", "", "--max-tokens", 4), "prompt is empty"),
    (("--prompt-ids", "1,2,999", "--max-tokens", 4), "token id 999 is outside the vocabulary (0..258)"),
    (("--prompt-ids", "1,x", "--max-tokens", 4), "comma-separated integers"),
    (("--prompt", "a", "--max-tokens", 0), "max_tokens"),
    (("--prompt", "a", "--prompt-ids", "1", "--max-tokens", 3), "exactly one of"),
    (("--prompt", "a", "--max-tokens", 3, "--mode", "dflash2"), "needs a drafter"),
    (("--prompt", "a", "--max-tokens", "many"), "invalid int value"),
]


@pytest.mark.parametrize("args,message", REQUEST_ERRORS, ids=[m for _, m in REQUEST_ERRORS])
def test_bad_request_one_line_error(tiny, args, message):
    code, out, err = cli("generate", "--model", tiny, *args, *BASE)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err


def test_bad_config_file(tiny, tmp_path, capsys):
    cases = [("temperatur: 0.5\n", "unknown config key 'temperatur'"),
             ("context_length: -3\n", "invalid value for 'context_length'"),
             ("compute_dtype: int3\n", "invalid value for 'compute_dtype'"),
             ("gpu_ranks: [0, 1]\n", "exactly one GPU"),
             ("vocabulary_quantization: int2\n", "invalid value for 'vocabulary_quantization'"),
             ("dflash2_quantization: int8\n", "dflash2_quantization: 'int8' quantizes a DFlash2 drafter"),
             ("[1, 2\n", "not valid YAML")]
    for text, message in cases:
        path = tmp_path / "c.yaml"
        path.write_text(text)
        code = main(["generate", "--model", str(tiny), "--prompt", "a", "--config", str(path), "--device", "cpu"])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (text, err)
    code = main(["generate", "--model", str(tiny), "--prompt", "a", "--config", str(tmp_path / "nope.yaml")])
    assert code == 2 and "nope.yaml" in capsys.readouterr().err


def test_config_yaml_values_are_used(tiny, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {tiny}\nmax_tokens: 5\ncompute_dtype: float32\ndevice: cpu\nprefill_chunk_size: 3\n")
    code, out, err = cli("generate", "--config", path, "--prompt", "hello", "--json")
    assert code == 0, err
    assert json.loads(out)["stats"]["generated"] == 5
