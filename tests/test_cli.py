"""CLI: --json schema, demo, and one-line errors with exit code 2 for every kind of bad input."""

import io
import json
import re
import shutil

import pytest
from helpers import cli

from blockspec.cli import main
from blockspec.errors import BlockspecError


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


def test_stop_strings_and_stop_tokens_end_a_generation_in_the_api_and_the_cli(tiny):
    """Engine.generate's `stop`, `stop_token_ids`, `include_stop_str_in_output` and generate --stop, printed and
    --json: the text is the unstopped generation's up to the first stop completed (through it when asked), the
    tokens end at the one that completed it, and stats' stop_reason names it."""
    from blockspec.engine.engine import Engine

    engine = Engine.load(tiny, device="cpu", compute_dtype="float32")
    prompt, decode = [5, 6, 7, 8], engine.tokenizer.decode
    full = engine.generate(prompt, 40)
    text = full.text
    assert len(full.tokens) == 40 and text == decode(full.tokens) and full.stats["stop_reason"] is None
    # a random model's text is mostly bytes: a stop of 2 characters (1 where none is), none that argv cannot carry
    pieces = [text[i:i + n] for n in (2, 1) for i in range(1, len(text) - 2)
              if not {"\ufffd", "\x00"} & {*text[i:i + n]}]
    stop = pieces[len(pieces) // 4]
    at = text.index(stop)
    count = next(n for n in range(41) if stop in decode(full.tokens[:n]))

    def run(**stops):
        got = engine.generate(prompt, 40, **stops)
        return got.text, got.tokens, got.stats["stop_reason"], got.stats["generated"]

    assert run(stop=[stop, "\x00never"]) == (text[:at], full.tokens[:count], stop, count)
    assert run(stop=stop, include_stop_str_in_output=True)[:3] == (text[:at + len(stop)], full.tokens[:count], stop)
    token = full.tokens[7]
    kept = full.tokens[:full.tokens.index(token) + 1]
    # a stop token before a stop string it completes, its text left out but with include_stop_str_in_output
    assert run(stop_token_ids=[token], stop=decode(kept)) == (decode(kept[:-1]), kept, token, len(kept))
    assert run(stop_token_ids=[token], include_stop_str_in_output=True)[:3] == (decode(kept), kept, token)
    code, out, err = cli("generate", "--model", tiny, "--prompt-ids", "5,6,7,8", "--max-tokens", 40, "--stop", stop,
                         "--stop", "never met here", *BASE)
    newlines = {ord("\r"): "\n"}  # as the subprocess's text mode reads them
    assert code == 0 and out == text[:at].replace("\r\n", "\n").translate(newlines) + "\n", (out, err)
    assert f"generated {count} tokens" in err
    code, out, err = cli("generate", "--model", tiny, "--prompt-ids", "5,6,7,8", "--max-tokens", 40, "--stop", stop,
                         "--json", *BASE)
    result = json.loads(out)
    assert (result["text"], result["tokens"], result["stats"]["stop_reason"]) == (text[:at], full.tokens[:count], stop)
    for bad, field in (([stop, 3], "'stop' must be a string or a list of strings (got a list holding an int)"),
                       ("", "'stop' must not hold an empty string"), (None, "'stop_token_ids' must be a list")):
        with pytest.raises(BlockspecError, match=re.escape(field)):
            engine.generate(prompt, 4, stop=bad, stop_token_ids=[-1] if bad is None else None)


def test_demo_runs(monkeypatch, capsys):
    """The demo in-process (test_demo_save_writes_a_pair_the_commands_use runs the command in a subprocess), at 24
    tokens and 10 contexts instead of 48 and 30: the same points at a third of the time."""
    import blockspec.demo

    monkeypatch.setattr(blockspec.demo, "MEASURE_CUTS", 10)
    code = main(["demo", "--max-tokens", "24"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "trained on the Python source files of installed packages, never on the standard library" in out
    assert re.search(r"prompt: the first \d+ tokens \(whole lines\) of \S+\.py, from this Python's standard", out)
    assert out.count("generated 24 tokens") == 4 and "tokens/s" in out and "acceptance" in out
    assert "[dflash2, tree of 32 (lookup 7)] generated 24 tokens" in out
    assert "outputs identical to plain greedy: yes" in out
    measured = re.search(r"one speculative cycle from 10 real contexts .*\n  mtp (\S+), dflash2 (\S+), dflash2 tree 32 "
                         r"(\S+) tokens per cycle", out)
    assert measured and min(float(measured[1]), float(measured[2])) > 1.0, out
    assert float(measured[3]) > float(measured[2]), out  # the tree holds the chain: it accepts at least as much
    assert "the pair over 500 contexts" in out


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
    (("--prompt-ids", "1,x", "--max-tokens", 4), "comma-separated token ids"),
    *((("--prompt-ids", ids, "--max-tokens", 4), "comma-separated token ids")
      for ids in ("1 2 3", "1,,2", ",1,2", "+1", "1_000", "\u0663", "-1")),
    (("--prompt", "a", "--max-tokens", 0), "max_tokens"),
    (("--prompt", "a", "--prompt-ids", "1", "--max-tokens", 3), "exactly one of"),
    (("--prompt", "a", "--max-tokens", 3, "--mode", "dflash2"), "needs a drafter"),
    (("--prompt", "a", "--max-tokens", "many"), "invalid int value"),
    (("--prompt", "\udcff\udcfe abc", "--max-tokens", 4), "--prompt: not valid UTF-8 (character 0)"),  # bytes ff fe
]


@pytest.mark.parametrize("args,message", REQUEST_ERRORS, ids=[m for _, m in REQUEST_ERRORS])
def test_bad_request_one_line_error(tiny, args, message):
    code, out, err = cli("generate", "--model", tiny, *args, *BASE)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err


def test_bad_prompt_ids_stops_and_a_closed_stdin_are_refused_before_the_load(tmp_path, capsys, monkeypatch):
    """A model folder that does not exist: the refusal names the bad input, not the model, so it came first."""
    missing = str(tmp_path / "no-model")
    assert main(["generate", "--model", missing, "--prompt-ids", "1,x", *BASE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "comma-separated token ids" in err, err
    assert main(["generate", "--model", missing, "--prompt", "hi", "--stop", "", *BASE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--stop must not be empty" in err, err
    assert main(["chat", "--model", missing, "--stop", "x" * 1025, *BASE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--stop takes at most 1024 characters" in err, err
    monkeypatch.setattr("sys.stdin", None)  # started with standard input closed (`<&-`)
    assert main(["chat", "--model", missing, *BASE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "standard input, which is closed" in err, err


def test_chats_without_a_template_or_room_an_empty_drafter_and_a_reply_past_the_context_refused_before_the_load(
        tiny, tmp_path, capsys, monkeypatch):
    import shutil

    import blockspec.engine.engine

    monkeypatch.setattr(blockspec.engine.engine.Engine, "__init__", lambda *a, **k: pytest.fail("the model loaded"))
    bare = tmp_path / "bare"
    shutil.copytree(tiny, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((bare / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(settings))
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    for argv, message in [
        (["chat", "--model", str(bare)], f"chat renders messages with the checkpoint's chat template, but {bare} has "
         "none"),
        (["generate", "--chat", "--model", str(bare), "--prompt", "hi"], "generate --chat renders messages"),
        (["generate", "--model", str(tiny), "--drafter", "", "--prompt", "hi"], "'dflash2_model': Value error, is "
         "empty"),
        (["serve", "--model", str(tiny), "--port", "0", "--max-tokens", "99999"], "max_tokens 99999 is not below "
         "context_length"),
        (["chat", "--model", str(tiny), "--context-length", "64", "--system", "be brief " * 40], "--system: "),
        (["chat", "--model", str(tiny), "--system", "be brief " * 9000], "tokens with the chat template, but "
         "context_length is 4096: no room is left for a message (shorten it)\n"),
    ]:
        assert main([*argv, "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)


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


@pytest.fixture(scope="module")
def demo_prompt_length(tmp_path_factory):
    """The demo's prompt in tokens (the pair's tokenizer, this Python's standard library)."""
    from blockspec import demo
    from blockspec.models.tokenizer import Tokenizer

    target, _ = demo.extract_pair(tmp_path_factory.mktemp("demo-pair"))
    tokenizer = Tokenizer(target)
    prompt_file, _ = demo.standard_library_modules()
    return len(tokenizer.encode(demo.prompt_text(demo.read_source(prompt_file), tokenizer)))


@pytest.mark.parametrize("args,message", [(("--max-tokens", 0), "--max-tokens must be at least 1"),
                                          (("--context-length", 1), "--context-length must be at least 2"),
                                          (("--max-tokens", 30, "--context-length", 50),
                                           "--context-length 50: the demo's prompt ({} tokens) + --max-tokens 30 "
                                           "need at least {}"),
                                          (("--max-tokens", 100_000_000), "--max-tokens 100000000: the demo's prompt "
                                           "({} tokens) and its continuation need {} positions, but the demo's "
                                           "target holds 4096"),
                                          (("--context-length", 5000), "--context-length 5000: the demo's target "
                                           "holds 4096 positions at most")])
def test_demo_refuses_bad_arguments_before_printing(args, message, demo_prompt_length):
    code, out, err = cli("demo", *args)
    assert code == 2 and out == "", out  # no banner, no mode header
    added = 100_000_000 if "100000000" in message else 30
    message = message.format(demo_prompt_length, demo_prompt_length + added)
    assert err.count("\n") == 1 and message in err, err


def test_demo_context_length_fits_max_tokens(monkeypatch, capsys, demo_prompt_length):
    """A long demo gets a context long enough by default, or the one given; the one-cycle measure's contexts stay
    short whatever the context length."""
    import blockspec.demo as demo
    import blockspec.engine.engine as engine_module
    from blockspec.models.tokenizer import Tokenizer

    seen, measured = [], []

    class Recorder:  # stands in for the engine: records the config, generates nothing
        def __init__(self, config):
            seen.append(config)
            self.tokenizer = Tokenizer(config.model)
            self.last_stats = {"mode": config.mode, "generated": 0, "prefill_s": 0.0, "decode_tokens_per_s": 0.0}

        def stream(self, ids, max_tokens, stop_at_eos=True):
            assert len(ids) + max_tokens <= seen[-1].context_length
            return iter(())

    def one_cycle(engine, sequences, cuts, seed, tree_budgets=None):
        measured.append(max(len(s) for s in sequences))
        result = {"mean_accepted_length": 1.0, "acceptance_rate": 0.0}
        return {b: result for b in tree_budgets} if tree_budgets else result

    monkeypatch.setattr(engine_module, "Engine", Recorder)
    monkeypatch.setattr(demo, "one_cycle_acceptance", one_cycle)
    assert main(["demo", "--max-tokens", "3000"]) == 0
    assert [c.context_length for c in seen] == [demo_prompt_length + 3000] * 4
    assert main(["demo", "--max-tokens", "10"]) == 0
    assert seen[-1].context_length == 512
    assert main(["demo", "--max-tokens", "10", "--context-length", str(demo_prompt_length + 10)]) == 0
    assert seen[-1].context_length == demo_prompt_length + 10
    assert "identical to plain greedy: yes" in capsys.readouterr().out
    assert len(measured) == 6 and max(measured) == demo.MEASURE_TOKENS  # mtp, and the chain with the tree


@pytest.mark.parametrize("damage,message", [("missing", "not found"), ("corrupt", "corrupt zip file"),
                                            ("damaged member", "corrupt zip file"),
                                            ("empty zip", "holds no target/config.json")])
def test_demo_refuses_a_missing_or_corrupt_pair(tmp_path, monkeypatch, capsys, damage, message):
    import zipfile

    import blockspec.demo as demo

    path = tmp_path / "demo_pair.zip"
    if damage == "corrupt":
        path.write_bytes(demo.PAIR_ZIP.read_bytes()[:100_000])
    elif damage == "damaged member":  # readable to the last member, whose bytes no longer match its CRC
        data = bytearray(demo.PAIR_ZIP.read_bytes())
        with zipfile.ZipFile(demo.PAIR_ZIP) as archive:
            last = max(archive.infolist(), key=lambda info: info.header_offset)
        middle = last.header_offset + 100 + last.compress_size // 2
        data[middle:middle + 64] = bytes(64)
        path.write_bytes(bytes(data))
    elif damage == "empty zip":
        zipfile.ZipFile(path, "w").close()
    monkeypatch.setattr(demo, "PAIR_ZIP", path)
    for args in (["demo"], ["demo", "--save", str(tmp_path / "saved")]):
        assert main(args) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and f"{path}: {message}" in err, err
    assert not (tmp_path / "saved").exists()  # a refused save leaves nothing behind


def test_demo_refuses_a_missing_standard_library(monkeypatch, capsys):
    import blockspec.demo as demo

    monkeypatch.setattr(demo, "standard_library_files", lambda: [])
    assert main(["demo"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "the standard library of this Python" in err, err


def test_demo_save_writes_a_pair_the_commands_use(tmp_path):
    import shlex

    directory = tmp_path / "pair"
    code, out, err = cli("demo", "--save", directory, "--max-tokens", 8)
    assert code == 0, err
    assert "random" not in out.lower()
    assert (directory / "target" / "mtp.safetensors").exists()
    assert (directory / "drafter" / "model.safetensors").exists()
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("blockspec ")]
    assert [c.split()[1] for c in commands] == ["generate", "generate", "chat", "serve"]
    for command in commands:
        assert f"--model {directory / 'target'}" in command and "--device cpu --dtype float32" in command
        assert (f"--drafter {directory / 'drafter'}" in command) == ("--mode mtp" not in command)
    # the printed generate commands run as printed (plus --json): with the drafter, and with the model's MTP head
    for command, mode in zip(commands[:2], ("dflash2", "mtp")):
        code, out, err = cli(*shlex.split(command)[1:], "--json")
        assert code == 0, err
        stats = json.loads(out)["stats"]
        assert stats["mode"] == mode and stats["generated"] == 8 and stats["cycles"] > 0


def test_demo_save_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    code, out, err = cli("demo", "--save", tmp_path)
    assert code == 2 and err.count("\n") == 1 and f"--save {tmp_path}: the folder is not empty" in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("")
    code, out, err = cli("demo", "--save", tmp_path / "file")
    assert code == 2 and "is not a folder" in err
    code, out, err = cli("demo", "--save", "")
    assert code == 2 and err == "blockspec: error: --save is empty: give a new or empty folder\n", err


# ------------------------------------------------------------------------ paths, seeds, pre-flight, version


def one_line_refusal(capsys, argv) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockspec: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "{weights}", "--prompt", "a"], "model {weights}: is a file, not a folder"),
    (["generate", "--model", "{missing}", "--prompt", "a"], "model {missing}: no such folder"),
    (["chat", "--model", "{notes}"], "model {notes}: is a file, not a folder"),
    (["bench", "--model", "{notes}"], "--model {notes}: is a file, not a folder"),
    (["draft-vocabulary", "--model", "{notes}", "--texts", "{notes}", "--out", "{tmp}/v.json"],
     "--model {notes}: is a file, not a folder"),
    (["train-drafter", "--target", "{notes}", "--data", "{notes}", "--out", "{tmp}/o"],
     "--target {notes}: is a file, not a folder"),
    (["train-drafter", "--target", "{tiny}", "--data", "{notes}", "--out", "{notes}/o"],
     "--out {notes}/o: {notes} is a file, not a folder"),
    (["train-target", "--data", "{notes}", "--out", "{notes}/o"], "--out {notes}/o: {notes} is a file, not a folder"),
    (["train-target", "--data", "{notes}", "--out", "{notes}"], "--out {notes}: is a file, not a folder"),
    (["draft-vocabulary", "--model", "{tiny}", "--texts", "{notes}", "--size", "100", "--out", "{notes}"],
     "--out {notes}: is the run's input --texts {notes}"),
    (["draft-vocabulary", "--model", "{tiny}", "--texts", "{notes}", "--size", "100", "--out",
      "{tiny}/tokenizer.json"],
     "--out {tiny}/tokenizer.json: is inside the run's input --model {tiny}"),
    (["bench", "--model", "{tiny}", "--max-tokens", "2", "--json-out", "{tiny}/config.json"],
     "--json-out {tiny}/config.json: is inside the run's input --model {tiny}"),
], ids=lambda v: " ".join(v[:3]) if isinstance(v, list) else None)
def test_a_wrong_kind_of_path_is_one_line(tiny, tmp_path, capsys, argv, message):
    notes = tmp_path / "notes.txt"
    notes.write_text("some text")
    names = {"weights": tiny / "model.safetensors", "missing": tmp_path / "nope", "notes": notes, "tmp": tmp_path,
             "tiny": tiny}
    device = [] if argv[0] == "draft-vocabulary" else ["--device", "cpu"]
    err = one_line_refusal(capsys, [a.format(**names) for a in argv] + device)
    assert message.format(**names) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing written


def test_draft_vocabulary_creates_the_out_folder_and_refuses_a_size_past_the_vocabulary(tiny, tmp_path, capsys):
    texts = tmp_path / "t.txt"
    texts.write_text("abc abd abe " * 20)
    err = one_line_refusal(capsys, ["draft-vocabulary", "--model", tiny, "--texts", texts, "--size", 100000,
                                    "--out", tmp_path / "new" / "v.json"])
    assert "--size 100000 is not smaller than the vocabulary (259 ids)" in err
    assert not (tmp_path / "new").exists()
    assert main(["draft-vocabulary", "--model", str(tiny), "--texts", str(texts), "--size", "50",
                 "--out", str(tmp_path / "new" / "v.json")]) == 0
    assert "ids 0..49:" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "new" / "v.json").read_text())) >= 50


@pytest.mark.parametrize("command", [["train-target", "--data", "d", "--out", "o"], ["bench", "--synthetic", "tiny"],
                                     ["generate", "--model", "m", "--prompt", "a"]])
@pytest.mark.parametrize("seed", ["-1", str(2 ** 64), str(2 ** 63)])
def test_seeds_outside_the_generators_range_are_refused(capsys, command, seed):
    err = one_line_refusal(capsys, command + ["--seed", seed])
    assert f"argument --seed: {seed} is outside 0..2^63-1" in err


def test_bench_one_cycle_needs_a_speculative_mode(tiny, capsys):
    err = one_line_refusal(capsys, ["bench", "--model", tiny, "--one-cycle", 5, "--mode", "none", "--device", "cpu"])
    assert "--one-cycle measures the acceptance of proposals: add mtp or dflash2 to --mode" in err


def test_bench_synthetic_on_the_cpu_is_refused_past_the_available_ram(monkeypatch, capsys):
    import blockspec.bench as bench
    import blockspec.fixtures.synthetic as synthetic

    def built(*args, **kwargs):
        raise AssertionError("the weights were built before the memory check")
    monkeypatch.setattr(synthetic, "synthetic_target", built)
    monkeypatch.setattr(bench, "available_ram", lambda: 10 ** 6)
    err = one_line_refusal(capsys, ["bench", "--synthetic", "tiny", "--device", "cpu", "--dtype", "float32"])
    assert re.search(r"estimated memory needed \d+\.\d GB, but only 0\.0 GB of RAM is available", err), err


def test_version_and_the_commands_listed(capsys):
    from blockspec import __version__
    from blockspec.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"blockspec {__version__}\n"
    description = build_parser().description
    for command in ("generate", "chat", "serve", "bench", "demo", "draft-vocabulary", "train-target", "train-drafter",
                    "regenerate"):
        assert command in description


@pytest.mark.parametrize("command", ["train-target", "train-drafter"])
def test_training_help_shows_each_default_once_and_none_on_required_flags(command):
    import argparse

    from blockspec.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    text = " ".join(sub.format_help().split())
    assert "(default: None)" not in text
    assert "(default: 0.02)" in text or "(default: 0.05)" in text  # the dataclass's default of --heldout
    assert not re.search(r"\(default: [^)]*\) \(default:", text), text


def test_streamed_text_is_the_whole_decoding_its_last_bytes_included(tiny):
    """stream_text (generate, chat, demo) prints the decoding of every token, multi-byte characters whole, and a
    generation that ends inside a character ends with its U+FFFD, as the whole decoding does."""
    import io
    from types import SimpleNamespace

    from blockspec.cli_common import stream_text
    from blockspec.models.tokenizer import Tokenizer

    tok = Tokenizer(tiny, [])
    lone = next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")  # a byte that is no character alone
    for ids in (tok.encode("héllo ✓ 😀 wörld"), tok.encode("hi ✓") + [lone]):
        out = io.StringIO()
        assert stream_text(SimpleNamespace(tokenizer=tok), iter(ids), out=out) == (ids, tok.decode(ids))
        assert out.getvalue() == tok.decode(ids), (out.getvalue(), tok.decode(ids))


def test_a_torchrun_process_ends_with_its_output_flushed_and_status_zero():
    """`end_rank_process` (train-drafter's end in a torchrun process) leaves with status 0 and without the
    interpreter's teardown (an atexit handler does not run), and what the process printed to stdout and stderr,
    still in their buffers, comes out."""
    import os
    import subprocess
    import sys

    code = ("import atexit, sys; from blockspec.cli import end_rank_process; atexit.register(print, 'teardown'); "
            "sys.stdout.write('out'); sys.stderr.write('err'); end_rank_process()")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout to a pipe: block-buffered
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert (done.returncode, done.stdout, done.stderr) == (0, "out", "err")
