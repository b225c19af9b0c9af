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


# ----------------------------------------------------------------------------------- parser: errors and help


def test_parse_errors_have_one_prefix(capsys):
    for argv, needle in [(["generate", "--mode", "fast"], "argument --mode: invalid choice: 'fast'"),
                         ([], "the following arguments are required: command"),
                         (["serve", "--port", "http"], "argument --port: invalid int value: 'http'")]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"blockspec: error: {needle}"), err
        assert err.count("error") == 1 and err.count("\n") == 1, err  # one prefix, one line


def test_every_option_has_help_and_shows_its_default():
    import argparse

    from blockspec.cli import build_parser
    from blockspec.config import PredictConfig

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"generate", "demo", "bench", "chat", "serve", "draft-vocabulary"} <= set(subparsers)
    from_config = {"device": "device", "dtype": "compute_dtype", "context_length": "context_length",
                   "prefill_chunk_size": "prefill_chunk_size", "max_tokens": "max_tokens"}
    missing, no_default = [], []
    for name, sub in subparsers.items():
        assert sub.format_help()  # every help string formats (no stray %)
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings:
                continue
            option = f"{name} {action.option_strings[-1]}"
            if not (action.help or "").strip():
                missing.append(option)
                continue
            shown = formatter._expand_help(action)
            if action.default not in (None, False, argparse.SUPPRESS) and f"default: {action.default}" not in shown:
                no_default.append(option)
            # engine flags default to None (PredictConfig decides): their help names the config's default
            if action.default is None and action.dest in from_config and name in ("generate", "chat", "serve"):
                if f"default: {PredictConfig.model_fields[from_config[action.dest]].default}" not in shown:
                    no_default.append(option)
    assert missing == [], f"options without help: {missing}"
    assert no_default == [], f"options whose help does not show the default: {no_default}"


# ----------------------------------------------------------------------------------------- demo


@pytest.mark.parametrize("args,message", [(("--max-tokens", 0), "--max-tokens must be at least 1"),
                                          (("--max-tokens", 30, "--context-length", 50),
                                           "--context-length 50: the demo's prompt (62 tokens) + --max-tokens 30")])
def test_demo_refuses_bad_arguments_before_printing(args, message):
    code, out, err = cli("demo", *args)
    assert code == 2 and out == "", out  # no banner, no mode header
    assert err.count("\n") == 1 and message in err, err


def test_demo_context_length_fits_max_tokens(monkeypatch, capsys):
    """A long demo gets a context long enough by default (it used to be fixed at 512), or the one given."""
    import blockspec.engine.engine as engine_module
    from blockspec.tokenizer import Tokenizer

    seen = []

    class Recorder:  # stands in for the engine: records the config, generates nothing
        def __init__(self, config):
            seen.append(config)
            self.tokenizer = Tokenizer(config.model)
            self.last_stats = {"mode": config.mode, "generated": 0, "prefill_s": 0.0, "decode_tokens_per_s": 0.0}

        def stream(self, ids, max_tokens, stop_at_eos=True):
            assert len(ids) + max_tokens <= seen[-1].context_length
            return iter(())

    monkeypatch.setattr(engine_module, "Engine", Recorder)
    assert main(["demo", "--max-tokens", "5000"]) == 0
    assert [c.context_length for c in seen] == [62 + 5000] * 3
    assert main(["demo", "--max-tokens", "10"]) == 0
    assert seen[-1].context_length == 512
    assert main(["demo", "--max-tokens", "10", "--context-length", "100"]) == 0
    assert seen[-1].context_length == 100
    assert "identical to plain greedy: yes" in capsys.readouterr().out


def test_demo_save_writes_a_pair_the_commands_use(tmp_path):
    import shlex

    directory = tmp_path / "pair"
    code, out, err = cli("demo", "--save", directory, "--max-tokens", 8)
    assert code == 0, err
    assert (directory / "target" / "config.json").exists() and (directory / "drafter" / "model.safetensors").exists()
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("blockspec ")]
    assert [c.split()[1] for c in commands] == ["generate", "chat", "serve"]
    for command in commands:
        assert f"--model {directory / 'target'}" in command and f"--drafter {directory / 'drafter'}" in command
        assert "--device cpu --dtype float32" in command
    # the printed generate command runs (as printed, plus --json), and so does the plain form with the pair
    generate = shlex.split(commands[0].split("#")[0])[1:]
    code, out, err = cli(*generate, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["stats"]["mode"] == "dflash2" and result["stats"]["generated"] == 8
    code, out, err = cli("generate", "--model", directory / "target", "--drafter", directory / "drafter", "--prompt",
                         "hi", "--max-tokens", 8, "--json", *BASE)
    assert code == 0 and json.loads(out)["stats"]["generated"] >= 1, err


def test_demo_save_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    code, out, err = cli("demo", "--save", tmp_path)
    assert code == 2 and err.count("\n") == 1 and f"--save {tmp_path}: the folder is not empty" in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("")
    code, out, err = cli("demo", "--save", tmp_path / "file")
    assert code == 2 and "is not a folder" in err
