"""`blockspec chat` driven through stdin in a subprocess: replies equal Engine.generate on the templated history,
/reset, /exit, EOF, history trimmed to the context, a too-long message refused without ending the session."""

from __future__ import annotations

import os
import subprocess
import sys
from io import StringIO

import pytest
import torch

from blockspec.chat import ChatSession
from blockspec.engine.engine import Engine
from blockspec.models.text import Stops

CONTEXT = 128
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint(seed=0, planted=True)


@pytest.fixture(scope="module")
def engine(tiny):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.load(tiny, device="cpu", compute_dtype="float32", mode="none", context_length=CONTEXT)
    torch.set_num_threads(threads)


def chat(tiny, lines, *args):
    proc = subprocess.run(
        [sys.executable, "-m", "blockspec.cli", "chat", "--model", str(tiny), "--device", "cpu", "--dtype", "float32",
         "--context-length", str(CONTEXT), "--max-tokens", str(MAX_TOKENS), *map(str, args)],
        input="".join(line + "\n" for line in lines), capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc.returncode, proc.stdout, proc.stderr


def expected_replies(engine, messages_in, stop=None):
    """The conversation as the spec says: each turn renders system + kept history + the message; the oldest turns
    go while prompt + max_tokens would overflow; a message too long alone is skipped; /reset forgets all."""
    tok = engine.tokenizer
    encode = lambda messages: tok.encode(tok.chat_prompt(messages))  # noqa: E731
    turns, replies, drops = [], [], 0
    for text in messages_in:
        if text == "/reset":
            turns = []
            continue
        user = {"role": "user", "content": text}
        if len(encode([user])) >= CONTEXT:
            continue
        while turns and len(encode([m for t in turns for m in t] + [user])) + MAX_TOKENS > CONTEXT:
            turns, drops = turns[1:], drops + 1
        ids = encode([m for t in turns for m in t] + [user])
        with torch.no_grad():
            reply = engine.generate(ids, min(MAX_TOKENS, CONTEXT - len(ids)), stop=stop).text
        replies.append(reply)
        turns.append((user, {"role": "assistant", "content": reply}))
    return replies, drops


def test_chat_session(tiny, engine):
    too_long = "y" * (CONTEXT + 5)
    script = ["hello there", "/reset", "what is a lighthouse?", "", "and a harbour?", too_long, "/bogus",
              "tell me more", "and more again", "last one"]
    code, out, err = chat(tiny, script, "--mode", "mtp")
    assert code == 0, err
    replies, drops = expected_replies(engine, [line for line in script if line and line != "/bogus"])
    assert drops >= 1  # the script does overflow the context
    assert out == "".join(reply + "\n" for reply in replies)
    stats = [line for line in err.splitlines() if "tokens/s" in line]
    assert len(stats) == len(replies) and all("acceptance" in line and "context" in line for line in stats)
    assert "conversation reset" in err
    assert "message too long" in err and "not sent" in err
    assert "dropped the" in err and "oldest turn" in err
    assert "unknown command /bogus" in err
    assert "Traceback" not in err


def test_chat_exit_and_eof(tiny, engine):
    code, out, err = chat(tiny, ["hi", "/exit", "never answered"])
    assert code == 0, err
    replies, _ = expected_replies(engine, ["hi"])
    assert out == replies[0] + "\n"
    assert "acceptance" not in err  # plain greedy: no speculative stats
    code, out, err = chat(tiny, [])  # immediate end of input
    assert code == 0 and out == "" and "blockspec chat" in err


def test_chat_stop_strings_end_each_reply_before_them(tiny, engine):
    """chat --stop: each reply is Engine.generate's with the same stops (cut before the first one met), and the
    history the next turn renders holds the reply as printed."""
    script = ["hello there", "what is a lighthouse?", "and a harbour?"]
    replies, _ = expected_replies(engine, script)
    # a stop of 1 or 2 characters met inside the first reply (none that argv cannot carry)
    text = replies[0]
    pieces = [text[i:i + n] for n in (2, 1) for i in range(1, len(text) - 1)
              if not {"\ufffd", "\x00"} & {*text[i:i + n]} and text[i:i + n].strip() == text[i:i + n]]
    stop = pieces[0]
    stopped, _ = expected_replies(engine, script, stop=[stop, "never met here"])
    assert stopped[0] == text[:text.index(stop)] and stopped != replies
    code, out, err = chat(tiny, script, "--stop", stop, "--stop", "never met here")
    assert code == 0, err
    assert out == "".join(reply + "\n" for reply in stopped)
    session = ChatSession(engine, MAX_TOKENS, out=StringIO(), err=StringIO(), stops=Stops((stop,)))
    session.turn(script[0])
    assert session.out.getvalue() == stopped[0] + "\n" and session.turns[0][1]["content"] == stopped[0]


def test_chat_bad_model_is_one_line_error(tmp_path):
    code, out, err = chat(tmp_path / "missing", ["hi"])
    assert code == 2 and err.startswith("blockspec: error:") and "Traceback" not in err


def test_end_of_input_at_the_prompt_ends_its_line(monkeypatch, capsys):
    """Ctrl-D at `you> ` (input() raises EOFError): a newline, so the shell's prompt does not land on that line."""
    from blockspec.chat import read_message

    answers = iter(["first line\\", EOFError])

    def fake_input(prompt):
        print(prompt, end="")
        answer = next(answers)
        if answer is EOFError:
            raise EOFError
        return answer
    monkeypatch.setattr("builtins.input", fake_input)
    assert read_message(None, interactive=True) == "first line"  # continued message, then Ctrl-D
    assert capsys.readouterr().out == "you> ...> \n"
    answers = iter([EOFError])
    assert read_message(None, interactive=True) is None
    assert capsys.readouterr().out == "you> \n"


def test_ctrl_d_in_a_terminal(tiny):
    """The real thing on a pseudo-terminal: Ctrl-D at the prompt leaves the session and ends the prompt's line."""
    import pty
    import select

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "blockspec.cli", "chat", "--model", str(tiny), "--device", "cpu", "--dtype", "float32",
         "--context-length", str(CONTEXT)], stdin=follower, stdout=follower, stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TERM": "dumb"})
    os.close(follower)
    shown = b""
    try:
        while b"you> " not in shown:
            ready, _, _ = select.select([leader], [], [], 120)
            assert ready and proc.poll() is None, shown + proc.stderr.read()
            shown += os.read(leader, 1024)
        os.write(leader, b"\x04")  # Ctrl-D
        assert proc.wait(60) == 0
        while select.select([leader], [], [], 1)[0]:
            try:
                chunk = os.read(leader, 1024)
            except OSError:  # the terminal's other end is closed
                break
            if not chunk:
                break
            shown += chunk
    finally:
        proc.kill()
        os.close(leader)
        proc.stderr.close()
    assert shown.endswith(b"you> \r\n"), shown


def test_chat_shows_and_uses_its_sampling_settings(tiny, engine, capsys):
    code, out, err = chat(tiny, ["hi"], "--temperature", "0.7", "--top-k", "20", "--seed", "3")
    assert code == 0, err
    assert "sampling: temperature 0.7, top-k 20, seed 3" in err.splitlines()[0]
    tok = engine.tokenizer
    ids = tok.encode(tok.chat_prompt([{"role": "user", "content": "hi"}]))
    with torch.no_grad():
        reply = engine.generate(ids, MAX_TOKENS, temperature=0.7, top_k=20, seed=3).text
    assert out == reply + "\n"
    from blockspec.chat import run_chat

    run_chat(engine, MAX_TOKENS, stdin=StringIO(""))
    assert "sampling: greedy" in capsys.readouterr().err.splitlines()[0]


def test_a_line_that_is_not_utf8_is_skipped(tiny, engine):
    """Piped bytes that are not UTF-8: a one-line note naming the line, and the session goes on to the next."""
    proc = subprocess.run(
        [sys.executable, "-m", "blockspec.cli", "chat", "--model", str(tiny), "--device", "cpu", "--dtype", "float32",
         "--context-length", str(CONTEXT), "--max-tokens", str(MAX_TOKENS)],
        input=b"\xff\xfe\nhi\n", capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    replies, _ = expected_replies(engine, ["hi"])
    assert proc.stdout.decode() == replies[0] + "\n"
    assert "[line 1 is not UTF-8 text; ignored]" in err.splitlines()
    assert "Traceback" not in err


def test_read_message_skips_lines_that_are_not_utf8():
    from io import BytesIO

    from blockspec.chat import Utf8Lines, read_message

    notes = []
    piped = "first\\\n\xe9t\xe9\n".encode("latin-1") + "zwei\\\ndrei \u00fc\n".encode()  # line 2 is Latin-1
    lines = Utf8Lines(BytesIO(piped), notes.append)
    assert read_message(lines, interactive=False) == "first\nzwei\ndrei \u00fc"  # the bad line 2 left out
    assert notes == ["line 2 is not UTF-8 text; ignored"]
    assert read_message(lines, interactive=False) is None


def test_a_line_that_is_not_utf8_in_a_terminal(tiny):
    """At the prompt, input() keeps bytes that are not UTF-8 as lone surrogates (the tokenizer raised TypeError on
    them): that line is skipped with a note, and the next one is answered."""
    import pty
    import select

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "blockspec.cli", "chat", "--model", str(tiny), "--device", "cpu", "--dtype", "float32",
         "--context-length", str(CONTEXT), "--max-tokens", str(MAX_TOKENS)], stdin=follower, stdout=follower,
        stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1", "TERM": "dumb"})
    os.close(follower)
    shown = b""

    def prompts(n):
        nonlocal shown
        while shown.count(b"you> ") < n:
            ready, _, _ = select.select([leader], [], [], 120)
            assert ready and proc.poll() is None, shown + proc.stderr.read()
            shown += os.read(leader, 1024)
    try:
        prompts(1)
        os.write(leader, b"\xff\xfe\n")
        prompts(2)
        os.write(leader, b"hi\n")
        prompts(3)
        os.write(leader, b"\x04")  # Ctrl-D
        assert proc.wait(60) == 0
        err = proc.stderr.read().decode()
    finally:
        proc.kill()
        os.close(leader)
        proc.stderr.close()
    assert "[that line is not UTF-8 text; ignored]" in err.splitlines()
    assert "Traceback" not in err and err.count("tokens/s") == 1  # "hi" was answered
