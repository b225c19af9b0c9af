"""Output the CLI cannot write: a reader that left (`| head -c 1`) ends the command quietly with exit code 1 (the
Python docs' note on SIGPIPE); a full device (/dev/full) is one line `blockspec: error: cannot write the output: ...`
with exit code 2, like every other error. Neither shows a traceback, buffered stdout or not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BASE = ("--device", "cpu", "--dtype", "float32")


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint(seed=0)


def environment(unbuffered: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["OMP_NUM_THREADS"] = "1"
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    return env


def commands(tiny):
    return {"help": ["--help"],
            "generate": ["generate", "--model", str(tiny), "--prompt", "Hello", "--max-tokens", "8", *BASE],
            "generate-json": ["generate", "--model", str(tiny), "--prompt", "Hello", "--max-tokens", "8", "--json",
                              *BASE]}


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("name", ["generate", "generate-json"])
def test_full_device_is_one_line(tiny, name, unbuffered):
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "blockspec.cli", *commands(tiny)[name]], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=300, env=environment(unbuffered))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "blockspec: error: cannot write the output: No space left on device\n" or (
        name == "generate" and proc.stderr.endswith("\nblockspec: error: cannot write the output: No space left on "
                                                    "device\n")), proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


def test_help_to_a_full_device():
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "blockspec.cli", "--help"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=300, env=environment(False))
    assert proc.returncode == 2
    assert proc.stderr == "blockspec: error: cannot write the output: No space left on device\n"


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("name", ["help", "generate", "generate-json"])
def test_closed_pipe_is_quiet(tiny, name, unbuffered):
    if name == "help" and unbuffered:
        pytest.skip("argparse itself ignores an OSError writing the help: exit code 0, nothing to test")
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes anything
    try:
        proc = subprocess.run([sys.executable, "-m", "blockspec.cli", *commands(tiny)[name]], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=300, env=environment(unbuffered))
    finally:
        os.close(write)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert "BrokenPipe" not in proc.stderr and "blockspec: error" not in proc.stderr


def test_head_c_1(tiny):
    """The shell's way: `blockspec generate ... | head -c 1` prints one character and no traceback."""
    command = " ".join([sys.executable, "-m", "blockspec.cli", *commands(tiny)["generate"]]) + " | head -c 1"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=300,
                          env=environment(False))
    assert len(proc.stdout) == 1 and "Traceback" not in proc.stderr, proc.stderr
