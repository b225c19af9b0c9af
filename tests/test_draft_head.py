"""Proposals over a draft vocabulary (layers/draft_head.py), MTP and DFlash2: output still equals plain greedy,
proposals stay in the set, the head rows are the shared head's (dense, tied or quantized), bad settings are refused
in one line."""

import json

import pytest
import torch

from blockspec.cli import main
from blockspec.engine.engine import Engine
from blockspec.errors import BlockspecError
from blockspec.layers.draft_head import DraftHead, draft_ids, head_rows


@pytest.fixture(scope="module")
def planted(tiny_checkpoint):
    return tiny_checkpoint(seed=0, planted=True)


@pytest.fixture(scope="module")
def drafter(planted, tiny_drafter):
    return tiny_drafter(planted, window=16)


def load(directory, mode="mtp", **kw):
    return Engine.load(directory, device="cpu", compute_dtype="float32", mode=mode, context_length=512, **kw)


def recording(engine):
    """Wrap the proposer's propose to record every draft."""
    drafts, propose = [], engine.proposer.propose

    def wrapped(*args):
        out = propose(*args)
        drafts.extend(out.tolist())
        return out
    engine.proposer.propose = wrapped
    return drafts


@pytest.fixture(scope="module")
def references(planted, drafter):
    """(prompt, plain greedy, {mode: its run over the full head})."""
    prompt = load(planted, "none").tokenizer.encode("hello world")
    return prompt, load(planted, "none").generate(prompt, 200, stop_at_eos=False), \
        {"mtp": load(planted).generate(prompt, 200, stop_at_eos=False),
         "dflash2": load(planted, "dflash2", dflash2_model=str(drafter), dflash2_tree_budget=0).generate(
             prompt, 200, stop_at_eos=False)}


@pytest.mark.parametrize("mode, spec", [("mtp", 80), ("mtp", "file"), ("dflash2", 80)])  # greedy ids: 65..89
def test_proposals_over_draft_vocabulary_equal_plain_greedy(planted, drafter, references, tmp_path, mode, spec):
    prompt, plain, full = references
    full = full[mode]
    if spec == "file":  # every other id of the first 192: a set that is not a prefix
        spec = tmp_path / "ids.json"
        spec.write_text(json.dumps(list(range(0, 192, 2))))
    extra = {"dflash2_model": str(drafter), "dflash2_tree_budget": 0} if mode == "dflash2" else {}  # the chain's drafts
    engine = load(planted, mode, draft_vocabulary=spec if isinstance(spec, int) else str(spec), **extra)
    drafts = recording(engine)
    allowed = set(engine.proposer.draft_head.ids.tolist())
    assert engine.memory.draft_head_bytes == len(allowed) * engine.model.config.hidden_size * 4
    result = engine.generate(prompt, 200, stop_at_eos=False)
    assert result.tokens == plain.tokens  # lossless whatever the drafts
    assert drafts and set(drafts) <= allowed
    assert result.stats["draft_vocabulary"] == len(allowed) < engine.vocab_size
    outside = sum(t not in allowed for t in plain.tokens)
    print(f"acceptance {result.stats['acceptance_rate']:.2f} (full head {full.stats['acceptance_rate']:.2f}), "
          f"{outside} of 200 greedy tokens outside the set")
    assert outside > 0 and result.stats["acceptance_rate"] < full.stats["acceptance_rate"]
    assert result.stats["acceptance_rate"] > 0.02  # drafts inside the set are still accepted


@pytest.mark.parametrize("vocabulary_quantization", ["none", "int8", "int4"])
def test_draft_head_rows_are_the_shared_head(planted, vocabulary_quantization):
    engine = load(planted, "none", vocabulary_quantization=vocabulary_quantization)
    model, vocab = engine.model, engine.vocab_size
    ids = torch.tensor([0, 5, 17, vocab - 1])
    full = model.embed_tokens.weight if model.lm_head is None else (
        model.lm_head.dequantize(torch.float32) if hasattr(model.lm_head, "packed") else model.lm_head.weight)
    assert torch.equal(head_rows(model, ids, torch.float32), full[ids].float())
    # over every id the draft head picks what the full head picks (where the top two logits are not tied)
    head = DraftHead.from_model(model, torch.arange(vocab), torch.float32)
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = model.logits(x)
    top2 = logits.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4
    assert clear.sum() > 20  # (the planted head has tied rows)
    assert torch.equal(head(x)[clear], logits.argmax(-1)[clear])


def test_a_number_in_other_digits_is_a_file_name():
    from blockspec.cli_common import _count_or_path

    assert _count_or_path("512") == 512 and _count_or_path("\u0665") == "\u0665"


def test_draft_ids(tmp_path):
    assert draft_ids(4, 100, eos_ids=[99, 2]).tolist() == [0, 1, 2, 3, 99]
    assert draft_ids(500, 100).tolist() == list(range(100))
    good = tmp_path / "ids.json"
    good.write_text("[7, 3, 3, 50]")
    assert draft_ids(str(good), 100).tolist() == [3, 7, 50]
    cases = {"missing.json": None, "text.json": "7, 3", "dict.json": '{"ids": [1]}', "empty.json": "[]",
             "bools.json": "[true, 1]", "range.json": "[1, 100]"}
    messages = []
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(BlockspecError) as exc:
            draft_ids(str(path), 100)
        messages.append(str(exc.value))
    assert all(m.startswith("draft_vocabulary: ") and "\n" not in m for m in messages)
    assert "file not found" in messages[0] and "not valid JSON" in messages[1] and "token id 100" in messages[-1]
    (tmp_path / "latin1.json").write_bytes(b"[1, 2]\xff")
    (tmp_path / "deep.json").write_text("[" * 100_000)
    for path, needle in (("/dev/zero", "/dev/zero: not a regular file"), (tmp_path / "latin1.json", r"not UTF-8 text \(byte 6\)"),
                         (tmp_path / "deep.json", "nested too deeply")):
        with pytest.raises(BlockspecError, match=needle):
            draft_ids(str(path), 100)


def test_draft_vocabulary_refusals(planted, capsys):
    base = ["generate", "--model", str(planted), "--prompt", "a", "--device", "cpu", "--max-tokens", "2"]
    assert main(base + ["--mode", "none", "--draft-vocabulary", "64"]) == 2
    err = capsys.readouterr().err
    assert "draft_vocabulary: 64 restricts speculative proposals, but mode is 'none'" in err and err.count("\n") == 1
    assert main(base + ["--mode", "mtp", "--draft-vocabulary", "-3"]) == 2
    err = capsys.readouterr().err
    assert "invalid value for 'draft_vocabulary'" in err and err.count("\n") == 1
    assert main(base + ["--mode", "mtp", "--draft-vocabulary", ""]) == 2  # an empty path is not "all"
    err = capsys.readouterr().err
    assert "invalid value for 'draft_vocabulary'" in err and err.count("\n") == 1
    assert main(base + ["--mode", "mtp", "--draft-vocabulary", "/nonexistent/ids.json"]) == 2
    err = capsys.readouterr().err
    assert "draft_vocabulary: /nonexistent/ids.json: file not found" in err and err.count("\n") == 1


def test_draft_vocabulary_smaller_than_the_selector_is_refused(planted, drafter, capsys):
    top_k = json.loads((drafter / "config.json").read_text())["dflash_config"]["selector_top_k"]
    code = main(["generate", "--model", str(planted), "--drafter", str(drafter), "--prompt", "a", "--device", "cpu",
                 "--max-tokens", "2", "--draft-vocabulary", str(top_k - 2)])
    err = capsys.readouterr().err
    assert code == 2 and f"fewer than the drafter's selector takes per row (selector_top_k {top_k})" in err


def test_draft_vocabulary_command_counts_the_texts(planted, tmp_path, capsys):
    from blockspec.layers.draft_head import coverage, most_frequent_ids

    assert most_frequent_ids([[5, 5, 7, 9], [7, 5, 2]], 2, 10, eos_ids=[9]) == [5, 7, 9]  # 5 x3, 7 x2, then EOS
    assert most_frequent_ids([[3, 1]], 1, 10) == [1]  # a tie goes to the lower id
    assert coverage([5, 7], [[5, 5, 7, 9]]) == 0.75
    texts = tmp_path / "traffic.txt"
    texts.write_text("zebra zebra zebra quiz " * 20)
    out = tmp_path / "ids.json"
    code = main(["draft-vocabulary", "--model", str(planted), "--texts", str(texts), "--size", "12", "--out", str(out)])
    assert code == 0
    ids = json.loads(out.read_text())
    tokenizer = load(planted, "none").tokenizer
    counted = tokenizer.encode(texts.read_text())
    assert set(tokenizer.encode("zebra quiz")) <= set(ids) and len(ids) <= 12 + len(tokenizer.eos_token_ids)
    assert "cover 100.0% of the" in capsys.readouterr().out
    assert coverage(ids, [counted]) == 1.0
    # the file drives proposals as --draft-vocabulary FILE, and bad input is one line with exit code 2
    engine = load(planted, draft_vocabulary=str(out))
    assert engine.proposer.draft_head.ids.tolist() == ids
    assert main(["draft-vocabulary", "--model", str(planted), "--texts", str(tmp_path / "none.txt"), "--size", "12",
                 "--out", str(out)]) == 2
    assert main(["draft-vocabulary", "--model", str(planted), "--texts", str(texts), "--size", "0",
                 "--out", str(out)]) == 2
    assert main(["draft-vocabulary", "--model", str(planted), "--texts", str(texts), "--size", "12",
                 "--out", str(texts / "dir.json")]) == 2
    err = capsys.readouterr().err
    assert "--texts" in err and "--size must be at least 1" in err and "--out" in err and err.count("\n") == 3
