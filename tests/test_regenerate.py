"""`blockspec regenerate` on a tiny target: greedy replies are the target's own greedy continuations (blockspec's
engine, mode none, from the same prompts), sampled ones repeat with the seed, the file trains a drafter, bad input is
refused in one line before the target loads, and a failure leaves no file."""

import json

import pytest

from blockspec.cli import main
from blockspec.engine.engine import Engine
from blockspec.fixtures.tiny import build_tiny_checkpoint

pytest.importorskip("transformers")

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "DROPPED"}]},
    {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hello there, lazy dog"},
                       {"from": "gpt", "value": "kept"}, {"from": "human", "value": "and seven birds?"}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                  {"role": "user", "content": "sing in the old tree"}, {"role": "assistant", "content": "DROPPED"}]},
]
TEXT = "jumps over a lazy dog while seven small birds sing in the old tree " * 2


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    root = tmp_path_factory.mktemp("regenerate")
    target = build_tiny_checkpoint(root / "target", seed=0, planted=True)
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    (root / "notes.txt").write_text(TEXT)
    return root, target


def regenerate(root, target, out, *flags):
    return main(["regenerate", "--target", str(target), "--prompts", str(root / "chats.jsonl"), str(root / "notes.txt"),
                 "--out", str(out), "--max-new-tokens", "24", "--prompt-tokens", "50", "--batch-size", "3",
                 "--device", "cpu", *flags])


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_greedy_replies_are_the_targets_greedy_continuations(prompts):
    root, target = prompts
    out = root / "greedy.jsonl"
    assert regenerate(root, target, out, "--greedy") == 0
    written = records(out)
    engine = Engine.load(target, device="cpu", compute_dtype="float32")
    tok = engine.tokenizer
    cuts = [tok.encode(TEXT)[i:i + 50] for i in range(0, len(tok.encode(TEXT)), 50)]
    assert len(written) == len(CONVERSATIONS) + len(cuts) and len(cuts) > 1
    prompts_kept = [[{"role": "user", "content": "the quick brown fox"}],
                    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there, lazy dog"},
                     {"role": "assistant", "content": "kept"}, {"role": "user", "content": "and seven birds?"}],
                    CONVERSATIONS[2]["messages"][:3]]
    replies = []
    for record, kept in zip(written, prompts_kept):
        assert record["messages"][:-1] == kept and record["messages"][-1]["role"] == "assistant"
        expected = engine.generate(tok.chat_prompt_ids(kept), 24).tokens
        assert record["messages"][-1]["content"] == tok.decode(expected)
        replies.append(expected)
    for record, cut in zip(written[len(CONVERSATIONS):], cuts):
        assert record == {"prompt": tok.decode(cut), "completion": tok.decode(engine.generate(cut, 24).tokens)}
    lengths = sorted([len(tok.chat_prompt_ids(kept)) for kept in prompts_kept] + list(map(len, cuts)), reverse=True)
    assert all(len(set(lengths[i:i + 3])) > 1 for i in range(0, len(lengths), 3))  # every pass left-pads a prompt
    assert all(replies) and "DROPPED" not in out.read_text()


def test_the_labels_of_greedy_continuations_are_their_next_tokens(prompts):
    """What train-drafter learns from greedily regenerated text: every trained label (the target's argmax over the
    training sequence) is the continuation's next token, because each record starts a sequence of its own and the
    target sees it as it generated it. Laid end to end like texts, the records' labels would be read after the
    previous records (the check on the same data as {"text"} records shows that it changes them)."""
    import torch

    from blockspec.config import TargetConfig
    from blockspec.models.checkpoint import load_target
    from blockspec.models.tokenizer import Tokenizer
    from blockspec.train.data import split_corpus
    from blockspec.train.run import TargetFeatures

    root, target = prompts
    out = root / "labels.jsonl"
    assert main(["regenerate", "--target", str(target), "--prompts", str(root / "notes.txt"), "--out", str(out),
                 "--max-new-tokens", "40", "--prompt-tokens", "30", "--greedy", "--device", "cpu"]) == 0
    (root / "as_texts.jsonl").write_text("".join(json.dumps({"text": r["prompt"] + r["completion"]}) + "\n"
                                                 for r in records(out)))
    eos = TargetConfig.from_file(target / "config.json").eos_token_ids
    tokenizer = Tokenizer(target, eos)
    model, _ = load_target(target)
    features = TargetFeatures(model, [1], 96, "cpu", torch.float32)

    def mismatches(path):
        sequences, _ = split_corpus([str(path)], tokenizer, 96, 0.0, 0, min(eos))
        labels = [(features(torch.tensor(s.ids))[1].tolist(), s) for s in sequences]
        checked = [(label[p], s.ids[p + 1]) for label, s in labels for p in range(95) if s.trained[p]]
        return sum(a != b for a, b in checked), len(checked)

    wrong, checked = mismatches(out)
    assert wrong == 0 and checked >= 5 * 39, (wrong, checked)
    assert mismatches(root / "as_texts.jsonl")[0] > 0


def test_max_prompts_draws_with_the_seed_and_temperature_samples(prompts, capsys):
    """--max-prompts answers that many prompts, drawn with the seed and kept in order; --temperature samples where
    generation_config.json has no temperature (greedy otherwise), and repeats with the seed."""
    root, target = prompts
    every = root / "every.jsonl"
    assert regenerate(root, target, every, "--greedy") == 0
    assert regenerate(root, target, root / "two.jsonl", "--greedy", "--max-prompts", "2", "--seed", "1") == 0
    assert regenerate(root, target, root / "two_again.jsonl", "--greedy", "--max-prompts", "2", "--seed", "1") == 0
    two, whole = records(root / "two.jsonl"), records(every)
    assert len(two) == 2 and two == records(root / "two_again.jsonl")
    assert whole.index(two[0]) < whole.index(two[1])  # in the prompts' order
    for name, seed in (("hot_a.jsonl", "5"), ("hot_b.jsonl", "5"), ("hot_c.jsonl", "6")):
        assert regenerate(root, target, root / name, "--temperature", "1.5", "--seed", seed) == 0
    assert "sampled at --temperature and generation_config.json: temperature 1.5" in capsys.readouterr().out
    hot = [(root / name).read_text() for name in ("hot_a.jsonl", "hot_b.jsonl", "hot_c.jsonl")]
    assert hot[0] == hot[1] != hot[2] and hot[0] != every.read_text()


def test_sampled_regeneration_repeats_with_its_seed_and_trains_a_drafter(prompts, capsys):
    root, target = prompts
    (target / "generation_config.json").write_text(json.dumps({"temperature": 1.0, "top_k": 50}))
    try:
        assert regenerate(root, target, root / "a.jsonl", "--seed", "3") == 0
        assert "sampled at generation_config.json: temperature 1, top-k 50" in capsys.readouterr().out
        assert regenerate(root, target, root / "b.jsonl", "--seed", "3") == 0
        assert regenerate(root, target, root / "c.jsonl", "--greedy") == 0
    finally:
        (target / "generation_config.json").unlink()
    assert (root / "a.jsonl").read_text() == (root / "b.jsonl").read_text() != (root / "c.jsonl").read_text()
    assert main(["train-drafter", "--target", str(target), "--data", str(root / "a.jsonl"), "--out",
                 str(root / "drafter"), "--layers", "1", "--window", "32", "--seq-len", "48", "--batch-tokens", "64",
                 "--steps", "3", "--selector-rank", "8", "--selector-top-k", "8", "--heldout", "0", "--device",
                 "cpu"]) == 0
    assert len(json.loads((root / "drafter" / "training.json").read_text())["learning_curve"]) == 3


@pytest.mark.parametrize("change,message", [
    ({"--out": "{root}/missing/out.jsonl"}, "--out {root}/missing/out.jsonl: the folder {root}/missing does not exist"),
    ({"--out": "{root}/out.txt"}, "--out {root}/out.txt: give a .jsonl file"),
    ({"--out": "{root}/folder.jsonl"}, "--out {root}/folder.jsonl: is a folder"),
    ({"--prompts": "{root}/bad.jsonl"}, "--prompts {root}/bad.jsonl:2: message 0 has an unknown role 'robot'"),
    ({"--max-new-tokens": "0"}, "--max-new-tokens must be at least 1"),
    ({"--max-prompts": "0"}, "--max-prompts must be at least 1"),
    ({"--temperature": "0"}, "--temperature must be in (0, 100] (got 0.0; --greedy for greedy replies)"),
    ({"--temperature": "0.7", "--greedy": None}, "--greedy and --temperature exclude each other"),
    ({"--prompts": "{root}/same.jsonl", "--out": "{root}/same.jsonl"},
     "--out {root}/same.jsonl: is one of the --prompts"),
    ({"--prompts": "{root}/same.jsonl", "--out": "{root}/link.jsonl"},
     "--out {root}/link.jsonl: is one of the --prompts"),
    ({"--prompts": "{root}", "--out": "{root}/same.jsonl"}, "--out {root}/same.jsonl: is one of the --prompts"),
    ({"--prompts": "{root}/empty.jsonl"}, "--prompts {root}/empty.jsonl:2: the prompt is empty"),
    ({"--prompts": "{root}/reply.jsonl"},
     "--prompts {root}/reply.jsonl:1: the conversation is only the assistant turn"),
    ({"--max-new-tokens": "100000000000"},
     "--max-new-tokens 100000000000: with the longest prompt (111 tokens) the replies would run past the target's "
     "4096 positions (config.json: max_position_embeddings): lower --max-new-tokens\n"),
    ({"--prompts": "{root}/notes.txt", "--max-new-tokens": "100000000000", "--prompt-tokens": "1000"},
     "(config.json: max_position_embeddings): lower --max-new-tokens, or --prompt-tokens (1000), the length of the "
     "texts' prompts\n"),
    ({"--prompts": "{root}/surrogate.jsonl"}, "--prompts {root}/surrogate.jsonl:1: a string holds an unpaired"),
])
def test_bad_input_is_one_line_before_the_target_loads(prompts, tmp_path, capsys, monkeypatch, change, message):
    import blockspec.train.regenerate as module

    root, target = prompts
    monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("the target was loaded"))
    (tmp_path / "folder.jsonl").mkdir()
    (tmp_path / "bad.jsonl").write_text(json.dumps(CONVERSATIONS[0]) + "\n" +
                                        '{"messages": [{"role": "robot", "content": "x"}]}\n')
    (tmp_path / "same.jsonl").write_text(json.dumps(CONVERSATIONS[0]) + "\n")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "same.jsonl")
    (tmp_path / "empty.jsonl").write_text('{"prompt": "a", "completion": ""}\n{"prompt": "", "completion": ""}\n')
    (tmp_path / "reply.jsonl").write_text('{"messages": [{"role": "assistant", "content": "x"}]}\n')
    (tmp_path / "surrogate.jsonl").write_text('{"text": "a\\ud800b"}\n')
    (tmp_path / "notes.txt").write_text(TEXT)
    flags = {"--target": str(target), "--prompts": str(root / "chats.jsonl"), "--out": str(tmp_path / "out.jsonl"),
             **{k: v if v is None else v.format(root=tmp_path) for k, v in change.items()}}
    assert main(["regenerate", "--device", "cpu", *[x for kv in flags.items() for x in kv if x is not None]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(root=tmp_path) in err, err
    assert not (tmp_path / "out.jsonl").exists()
    assert (tmp_path / "same.jsonl").read_text() == json.dumps(CONVERSATIONS[0]) + "\n"


@pytest.fixture
def copied_target(prompts, tmp_path):
    import shutil

    root, target = prompts
    shutil.copytree(target, tmp_path / "target")
    return root, tmp_path / "target"


DOWN = "model.layers.0.mlp.down_proj.weight"


def edit_weights(target, edit):
    from safetensors.torch import load_file, save_file

    weights = load_file(target / "model.safetensors")
    edit(weights)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("damage,message", [
    (lambda t: (t / "generation_config.json").write_text("[1]"),
     "generation_config.json: a JSON object expected, got list"),
    (lambda t: ((t / "generation_config.json").unlink(missing_ok=True), (t / "generation_config.json").mkdir()),
     "generation_config.json: cannot be read (Is a directory)"),
    (lambda t: (t / "generation_config.json").write_text("{oops"), "generation_config.json: not valid JSON"),
    (lambda t: (t / "model.safetensors").write_bytes((t / "model.safetensors").read_bytes()[:-100]),
     "model.safetensors: corrupt or unreadable safetensors file"),
    (lambda t: edit_weights(t, lambda w: w.update({DOWN: w[DOWN][:, :-1].contiguous()})),
     f"tensor {DOWN} has shape (64, 127), expected (64, 128)"),
    (lambda t: edit_weights(t, lambda w: w.pop(DOWN)), f"missing tensor {DOWN} (shape (64, 128))"),
    (lambda t: edit_weights(t, lambda w: w.update({DOWN: w[DOWN].long()})), f"tensor {DOWN} is torch.int64"),
    (lambda t: edit_weights(t, lambda w: w.update({"model.layers.0.mlp.extra.weight": w[DOWN].clone()})),
     "unexpected tensor model.layers.0.mlp.extra.weight"),
])
def test_a_damaged_target_is_one_line_before_it_loads(copied_target, tmp_path, capsys, monkeypatch, damage, message):
    import blockspec.train.regenerate as module

    root, target = copied_target
    monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("the target was loaded"))
    damage(target)
    assert regenerate(root, target, tmp_path / "out.jsonl") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_sampling_value_left_out_of_generation_config_stays_out(copied_target, tmp_path, capsys):
    root, target = copied_target
    (target / "generation_config.json").write_text(json.dumps({"top_k": "abc"}))
    assert regenerate(root, target, tmp_path / "out.jsonl", "--max-new-tokens", "4") == 0
    assert "top_k" in capsys.readouterr().err and len(records(tmp_path / "out.jsonl")) > 1


def test_a_failure_leaves_the_previous_file_and_no_partial_one(prompts, tmp_path, monkeypatch):
    import blockspec.train.regenerate as module

    root, target = prompts
    out = tmp_path / "out.jsonl"
    out.write_text("earlier\n")
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return [[65] for _ in args[1]]
    monkeypatch.setattr(module, "generate_batch", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        regenerate(root, target, out, "--greedy")
    assert len(calls) == 2 and out.read_text() == "earlier\n" and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]
