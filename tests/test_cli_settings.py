"""Settings checked by the command line before the model loads, and the notes it gives on settings that do
nothing."""

import io
import sys

import pytest

from blockspec.cli import main


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint(seed=0))


BASE = ("--device", "cpu", "--dtype", "float32")


def notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("blockspec: note:")]


def test_generate_notes_a_given_setting_that_does_nothing(tiny, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("prefix_snapshots: 8\ndflash2_tree_scores: marginal\n")
    code = main(["generate", "--model", tiny, "--config", str(path), "--no-prefix-reuse", "--prompt-ids", "1,2,3",
                 "--max-tokens", "2", *BASE])
    err = capsys.readouterr().err
    assert code == 0, err
    assert notes(err) == ["blockspec: note: dflash2_tree_scores: 'marginal' does nothing: mode is 'none'",
                          "blockspec: note: prefix_snapshots: 8 does nothing: prefix_reuse is false"], err


def test_defaults_give_no_note(tiny, capsys):
    code = main(["generate", "--model", tiny, "--no-prefix-reuse", "--prompt-ids", "1,2,3", "--max-tokens", "2",
                 *BASE])
    err = capsys.readouterr().err
    assert code == 0 and notes(err) == [], err


def test_chat_notes_a_given_setting_that_does_nothing(tiny, tmp_path, capsys, monkeypatch):
    path = tmp_path / "run.yaml"
    path.write_text("self_speculative_num_tokens: 5\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("/exit\n"))
    code = main(["chat", "--model", tiny, "--config", str(path), "--max-tokens", "2", *BASE])
    err = capsys.readouterr().err
    assert code == 0, err
    assert notes(err) == ["blockspec: note: self_speculative_num_tokens: 5 does nothing: mode is 'none'"], err


GREEDY_NOTE = "do nothing: temperature is 0 (greedy decoding); set temperature above 0 to sample"


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1,2,3"], ["chat"]])
@pytest.mark.parametrize("flags, yaml_text, expected", [
    (["--top-p", "0.9", "--top-k", "20", "--seed", "5"], "", [f"top_k: 20, top_p: 0.9, seed: 5 {GREEDY_NOTE}"]),
    (["--temperature", "0"], "min_p: 0.1\n", [f"min_p: 0.1 {GREEDY_NOTE.replace('do ', 'does ', 1)}"]),
    (["--temperature", "0", "--top-p", "1.0", "--top-k", "0"], "min_p: 0.0\n", []),  # the defaults, given
    (["--temperature", "0.7", "--top-p", "0.9", "--seed", "5"], "", []),  # sampled: they apply
])
def test_sampling_settings_given_to_greedy_decoding_are_noted_once(tiny, tmp_path, capsys, monkeypatch, command,
                                                                    flags, yaml_text, expected):
    path = tmp_path / "run.yaml"
    path.write_text(yaml_text)
    monkeypatch.setattr(sys, "stdin", io.StringIO("/exit\n"))
    code = main([*command, "--model", tiny, "--config", str(path), "--max-tokens", "2", *flags, *BASE])
    err = capsys.readouterr().err
    assert code == 0, err
    assert notes(err) == [f"blockspec: note: {note}" for note in expected], err


@pytest.fixture
def no_load(monkeypatch):
    import blockspec.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "Engine", lambda config: pytest.fail("the model was loaded"))


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1,2"], ["chat"]])
@pytest.mark.parametrize("flags, yaml_text, numbers, fix", [
    (["--max-tokens", "64", "--context-length", "64"], "", "max_tokens 64 is not below context_length 64",
     "(lower --max-tokens or raise --context-length)"),
    (["--context-length", "64"], "max_tokens: 100\n", "max_tokens 100 is not below context_length 64",
     "(lower --max-tokens or raise --context-length)"),
    # the context is the checkpoint's max_position_embeddings already: raising it would be refused
    ([], "max_tokens: 5000\n", "max_tokens 5000 is not below context_length 4096", "(lower --max-tokens)\n"),
])
def test_max_tokens_that_leave_no_room_for_a_prompt_are_refused_before_the_load(tiny, tmp_path, capsys, no_load,
                                                                                  command, flags, yaml_text, numbers,
                                                                                  fix):
    path = tmp_path / "run.yaml"
    path.write_text(yaml_text)
    code = main([*command, "--model", tiny, "--config", str(path), *flags, *BASE])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and numbers in err and fix in err, err


@pytest.fixture(scope="module")
def short_model(tiny_checkpoint):
    return str(tiny_checkpoint(seed=0, max_position_embeddings=64))


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1,2"], ["chat"]])
@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "64"], "max_tokens 64 is not below context_length 64 (the max_position_embeddings of "),
    (["--max-tokens", "8", "--context-length", "128"],
     "context_length 128 exceeds the model's max_position_embeddings 64"),
])
def test_the_checkpoints_shorter_context_is_applied_before_the_load(short_model, capsys, no_load, command, flags,
                                                                      message):
    """config.json's max_position_embeddings 64 lowers the default context_length 4096 at load: max_tokens is
    checked against it, from config.json, before the load."""
    code = main([*command, "--model", short_model, *flags, *BASE])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert "--context-length" not in err or "exceeds" in err, err


def test_max_tokens_below_the_checkpoints_shorter_context_runs(short_model, capsys):
    code = main(["generate", "--model", short_model, "--prompt-ids", "1", "--max-tokens", "63", *BASE])
    assert code == 0, capsys.readouterr().err


def test_generate_refuses_the_default_max_tokens_past_a_short_context_before_the_load(tiny, capsys, no_load):
    code = main(["generate", "--prompt-ids", "1,2", "--model", tiny, "--context-length", "64", *BASE])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "max_tokens 256 is not below context_length 64" in err, err


def test_chat_limits_each_reply_to_a_short_context_when_max_tokens_is_the_default(tiny, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    code = main(["chat", "--model", tiny, "--context-length", "64", *BASE])
    err = capsys.readouterr().err
    assert code == 0 and "reply limited to" in err, err


def test_max_tokens_just_below_the_context_length_runs(tiny, capsys):
    code = main(["generate", "--model", tiny, "--prompt-ids", "1", "--max-tokens", "15", "--context-length", "16",
                 *BASE])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--allowed-hosts", "--allowed-origins"])
@pytest.mark.parametrize("value, problem", [(",,", "an empty entry"), ("", "an empty entry"),
                                            ("a.example,,b.example", "an empty entry"),
                                            ("a.example,", "an empty entry"), (" , ", "an empty entry"),
                                            ("my host", "'my host' has a space in it"),
                                            ("a.example,b\texample", "'b\\texample' has a space in it")])
def test_serve_refuses_empty_names_or_names_with_spaces(tiny, capsys, no_load, flag, value, problem):
    code = main(["serve", "--model", tiny, "--port", "0", flag, value, *BASE])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"blockspec: error: argument {flag}: {value!r}") and problem in err, err


def test_names_are_taken_without_the_spaces_around_them():
    from blockspec.cli import comma_list

    assert comma_list("a.example, b.example ") == ("a.example", "b.example")
    assert comma_list("*") == ("*",)
