"""Hostile input to `train-drafter`, `train-target` and `regenerate`: each refused in one line (exit 2) before the
target loads or any training, and nothing written."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from blockspec.cli import main
from blockspec.errors import BlockspecError
from blockspec.fixtures.tiny import build_tiny_checkpoint
from blockspec.train.loop import fingerprint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_cli")
    (root / "data.txt").write_text("the quick brown fox jumps over the lazy dog " * 40)
    return root, build_tiny_checkpoint(root / "target", seed=0)


@pytest.fixture(autouse=True)
def no_loading(monkeypatch):
    import blockspec.train.regenerate as regenerate_module
    import blockspec.train.run as run_module

    monkeypatch.setattr(run_module, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    monkeypatch.setattr(regenerate_module, "load_model", lambda *a, **k: pytest.fail("the target was loaded"))


def refused(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("blockspec: error: ") and message in err, err


def test_a_role_that_is_not_a_string_is_one_line(target, tmp_path, capsys):
    root, checkpoint = target
    (tmp_path / "chats.jsonl").write_text(json.dumps(
        {"messages": [{"role": ["user"], "content": "x"}, {"role": "assistant", "content": "y"}]}) + "\n")
    refused(capsys, ["train-drafter", "--target", str(checkpoint), "--data", str(tmp_path / "chats.jsonl"), "--out",
                     str(tmp_path / "out"), "--device", "cpu"], "chats.jsonl:1: message 0 has an unknown role ['user']")
    refused(capsys, ["regenerate", "--target", str(checkpoint), "--prompts", str(tmp_path / "chats.jsonl"), "--out",
                     str(tmp_path / "out.jsonl"), "--device", "cpu"], "chats.jsonl:1: message 0 has an unknown role")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("flags,message", [
    (["--window", "32"], "--batch-tokens 100000000000000: a step's target features would take"),
    (["--kind", "mtp"], "--batch-tokens 100000000000000: a step's logits would take"),
])
def test_a_step_larger_than_memory_is_refused_before_the_target_loads(target, tmp_path, capsys, flags, message):
    root, checkpoint = target
    refused(capsys, ["train-drafter", "--target", str(checkpoint), "--data", str(root / "data.txt"), "--out",
                     str(tmp_path / "out"), "--device", "cpu", "--batch-tokens", "100000000000000", "--seq-len", "64",
                     *flags], message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags,message", [
    (["--batch-tokens", "100000000000000"], "a step's logits would take"),
    (["--hidden", "65536"], "the model's training state (weights, gradients, optimizer moments) would take"),
    (["--intermediate", "100000000000"], "the model's training state"),
    (["--layers", "400000000"], "the model's training state"),
    (["--vocab", "100000000000"], "the model's training state"),
    (["--steps", "3", "--tokens", "64"], "--steps 3 and --tokens 64: give one of them"),
])
def test_train_target_refuses_a_model_or_step_larger_than_memory(target, tmp_path, capsys, monkeypatch, flags,
                                                                   message):
    import blockspec.train.target as target_module

    root, _ = target
    monkeypatch.setattr(target_module, "train_tokenizer", lambda *a, **k: pytest.fail("the tokenizer was trained"))
    refused(capsys, ["train-target", "--data", str(root / "data.txt"), "--out", str(tmp_path / "t"), "--device", "cpu",
                     "--heads", "2", "--hidden", "64", "--layers", "4", "--intermediate", "64", "--vocab", "300",
                     "--seq-len", "32", "--batch-tokens", "32", *flags], message)
    assert not (tmp_path / "t").exists()


def saved_run(out, settings: dict):
    """A folder as a training run leaves it (its state, its settings), enough for --resume's checks."""
    out.mkdir()
    torch.save(saved_state(1), out / "training_state.pt")
    (out / "training_run.json").write_text(json.dumps(settings))


def test_resume_of_another_command_s_run_is_refused_by_name(target, tmp_path, capsys):
    root, checkpoint = target
    saved_run(tmp_path / "drafter", {"kind": "dflash2", "layers": 1, "heads": None, "steps": 2, "seq_len": 64})
    saved_run(tmp_path / "target", {"vocab": 300, "hidden": 64, "layers": 4, "steps": 2, "seq_len": 32})
    refused(capsys, ["train-target", "--data", str(root / "data.txt"), "--out", str(tmp_path / "drafter"), "--resume",
                     "--device", "cpu"], "holds settings this command does not have (kind): it is another command's")
    refused(capsys, ["train-drafter", "--target", str(checkpoint), "--data", str(root / "data.txt"), "--out",
                     str(tmp_path / "target"), "--resume", "--device", "cpu"],
            "holds settings this command does not have (hidden, vocab): it is another command's run")


def saved_state(step: int) -> dict:
    """A saved run's state as Trainer.checkpoint lays it out (check_resumed reads its structure), at `step`."""
    import random

    return {"step": step, "module": {}, "optimizer": {}, "history": [], "rng": random.Random(0).getstate(),
            "torch_rng": torch.get_rng_state()}


def test_resume_with_another_target_of_the_same_shapes_is_refused(target, tmp_path, capsys):
    """A run remembers its target by fingerprint: another checkpoint of the same shapes is refused before it loads;
    a copy of the same one elsewhere has the same fingerprint (its path may change between runs)."""
    root, checkpoint = target
    other = build_tiny_checkpoint(tmp_path / "other", seed=1)
    settings = {"kind": "dflash2", "layers": 1, "steps": 2, "seq_len": 64}
    saved_run(tmp_path / "out", settings)
    state = {**saved_state(1), "inputs": {"target": fingerprint(checkpoint)}}
    torch.save(state, tmp_path / "out" / "training_state.pt")
    refused(capsys, ["train-drafter", "--target", str(other), "--data", str(root / "data.txt"), "--out",
                     str(tmp_path / "out"), "--resume", "--layers", "1", "--seq-len", "64", "--device", "cpu"],
            f"--resume: --target {other} is not the target the run saved in {tmp_path / 'out'} trained with")
    shutil.copytree(checkpoint, tmp_path / "moved")
    assert fingerprint(tmp_path / "moved") == fingerprint(checkpoint) != fingerprint(other)


def test_regenerate_out_under_a_file_names_the_file(target, tmp_path, capsys):
    root, checkpoint = target
    (tmp_path / "file").write_text("kept\n")
    refused(capsys, ["regenerate", "--target", str(checkpoint), "--prompts", str(root / "data.txt"), "--out",
                     str(tmp_path / "file" / "out.jsonl"), "--device", "cpu"],
            f"--out {tmp_path}/file/out.jsonl: {tmp_path}/file is a file, not a folder")
    assert (tmp_path / "file").read_text() == "kept\n"


def test_resume_with_another_target_names_target(target, tmp_path, capsys, monkeypatch):
    root, checkpoint = target
    monkeypatch.undo()  # this one trains
    other = build_tiny_checkpoint(tmp_path / "other", seed=0, intermediate_size=96)
    argv = ["train-drafter", "--data", str(root / "data.txt"), "--out", str(tmp_path / "out"), "--device", "cpu",
            "--layers", "1", "--window", "32", "--seq-len", "48", "--batch-tokens", "64", "--selector-rank", "8",
            "--selector-top-k", "8", "--eval-cuts", "0", "--steps", "1"]
    assert main(argv + ["--target", str(checkpoint)]) == 0
    capsys.readouterr()
    refused(capsys, argv + ["--target", str(other), "--resume", "--steps", "2"],
            f"--resume: --target {other} is not the target the run saved in")
    state_file = tmp_path / "out" / "training_state.pt"  # as saved before runs kept their target's fingerprint
    torch.save({k: v for k, v in torch.load(state_file, weights_only=False).items() if k != "inputs"}, state_file)
    refused(capsys, argv + ["--target", str(other), "--resume", "--steps", "2"],
            "); give the --target and flags it was started with")


def test_records_holding_unicode_line_separators_read_whole(tmp_path):
    """JSON Lines ends a record at "\\n" alone: text that holds U+2028, U+2029, U+0085 or a form feed, which
    `blockspec regenerate` writes unescaped (as json.dumps with ensure_ascii=False does), stays in its record, and a
    file saved with CRLF line ends reads the same; a refused line keeps its number in the file."""
    from blockspec.train.data import read_records

    texts = ["a\u2028b", "c\u2029d", "e\x85f", "g\x0ch", "plain"]
    records = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t}]} for t in texts]
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    unix, crlf = tmp_path / "unix.jsonl", tmp_path / "crlf.jsonl"
    unix.write_bytes("\n".join(lines).encode() + b"\n")
    crlf.write_bytes("\r\n".join(lines).encode() + b"\r\n")
    assert [r.messages for r in read_records(unix)] == [r.messages for r in read_records(crlf)] == [
        r["messages"] for r in records]
    unix.write_bytes("\n".join(lines[:4] + ["{not json"]).encode())
    with pytest.raises(BlockspecError, match=f"{unix}:5: not JSON"):
        read_records(unix)


def test_records_after_a_byte_order_mark_read_as_without_it(tmp_path):
    """A .jsonl that an editor saved with a UTF-8 byte order mark holds the same records."""
    from blockspec.train.data import read_records

    line = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_text(line + "\n", encoding="utf-8")
    marked.write_text("\ufeff" + line + "\n", encoding="utf-8")
    assert [r.messages for r in read_records(marked)] == [r.messages for r in read_records(plain)] == [
        json.loads(line)["messages"]]


def test_an_output_place_that_refuses_files_is_refused_before_the_work(tmp_path):
    """/proc takes no new file, whatever its permission bits tell root: refused by writing one, as the run would."""
    from blockspec.train.loop import check_output, write_refused
    from blockspec.train.regenerate import check_out

    with pytest.raises(BlockspecError, match="^--out /proc/x: cannot write in /proc \\("):
        check_output(Path("/proc/x"), resume=False)
    with pytest.raises(BlockspecError, match="^--out /proc/x.jsonl: cannot write in the folder /proc \\("):
        check_out(Path("/proc/x.jsonl"))
    assert write_refused(tmp_path) is None and list(tmp_path.iterdir()) == []  # a good place: nothing left there
