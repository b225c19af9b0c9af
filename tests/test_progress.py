"""The loading bar: over a large checkpoint's shards on stderr, never on stdout; quiet when not asked for or without
tqdm."""

import json
import sys

import pytest

from blockspec.models import progress
from blockspec.models.checkpoint import load_target
from blockspec.cli import main


@pytest.fixture()
def every_checkpoint_large(monkeypatch):
    monkeypatch.setattr(progress, "SHOWN_FROM_BYTES", 0)


def test_the_bar_counts_every_byte_of_the_shards(tiny_checkpoint, every_checkpoint_large, capsys):
    directory = tiny_checkpoint(seed=0)
    load_target(directory, progress=True)
    err = capsys.readouterr().err
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    assert "loading weights: 100%" in err and f"{size / 1e6:.2f}M/{size / 1e6:.2f}M" in err and "B/s]" in err  # e.g. 691MB/s


def test_quiet_unless_asked_for_or_without_tqdm(tiny_checkpoint, every_checkpoint_large, monkeypatch, capsys):
    load_target(tiny_checkpoint(seed=0))
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if not installed: the import fails
    load_target(tiny_checkpoint(seed=0), progress=True)
    assert capsys.readouterr().err == ""


def test_generate_shows_the_bar_on_stderr_and_keeps_stdout_json(tiny_checkpoint, every_checkpoint_large, capsys):
    code = main(["generate", "--model", str(tiny_checkpoint(seed=0)), "--prompt-ids", "5,6", "--max-tokens", "2",
                 "--json", "--device", "cpu", "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert code == 0 and "loading weights" in err
    assert json.loads(out)["stats"]["generated"] == 2
