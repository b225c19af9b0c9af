"""`blockspec train-drafter` and `train-target` on tiny targets: a few steps lower the loss, the drafter written
loads in blockspec and in the `dflash` reference with identical proposals, speculative output stays plain greedy's,
resume continues, and bad input is refused in one line before any training."""

import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import proposals_beside_dflash, run_pass

from blockspec.models.checkpoint import load_target
from blockspec.cli import main
from blockspec.config import TargetConfig
from blockspec.engine.engine import Engine
from blockspec.errors import BlockspecError
from blockspec.fixtures.tiny import build_tiny_checkpoint, byte_tokenizer, cycle_ids
from blockspec.train.dflash2 import drafter_config, drafter_hidden, new_drafter, sample_anchors
from blockspec.train.run import DrafterTraining, train

reference = pytest.importorskip("dflash.model")

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old tree".split()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = build_tiny_checkpoint(root / "target", seed=0, planted=True)  # with an MTP head
    (target / "training.json").write_text('{"steps": 7}')  # as train-target leaves it
    (target / "mtp_training.json").write_text('{"steps": 3}')  # an earlier head's run, not the target's
    data = root / "data"
    data.mkdir()
    rng = random.Random(0)
    for i in range(10):
        (data / f"part{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(300)))
    return root, target, data


def run_config(root, target, data, out="out", **kw):
    settings = dict(target=str(target), data=[str(data)], out=str(root / out), layers=1, window=32, seq_len=96,
                    batch_tokens=128, steps=16, lr=3e-3, selector_rank=16, selector_top_k=8, checkpoint_every=8,
                    eval_cuts=4, heldout=0.2, device="cpu")
    return DrafterTraining(**{**settings, **kw})


@pytest.fixture(scope="module")
def trained(setup):
    root, target, data = setup
    summary = train(run_config(root, target, data), log=lambda *_: None)
    return root, target, data, summary


def test_training_lowers_the_loss_and_evaluates(trained):
    _, _, _, summary = trained
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) == 16
    assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4, losses
    evaluation = summary["evaluation"]
    assert evaluation["cuts"] == 4 and 1 <= evaluation["mean_accepted_length"] <= 8
    assert summary["training_tokens_per_s"] > 0


def test_drafter_loads_in_blockspec_and_dflash_with_identical_proposals(trained):
    root, target, _, _ = trained
    tokens = Engine.load(target, device="cpu").tokenizer.encode("the quick brown fox jumps over " * 4)
    compared = proposals_beside_dflash(root / "out", target, tokens, (5, 20, 40, 70))  # within, past the window
    assert [start for start, _, _ in compared] == [5, 20, 40, 70]
    for start, ours, theirs in compared:
        assert torch.equal(ours, theirs), (start, ours, theirs)


def test_trained_drafter_is_lossless(trained):
    root, target, _, _ = trained
    plain = Engine.load(target, device="cpu", compute_dtype="float32")
    spec = Engine.load(target, device="cpu", compute_dtype="float32", mode="dflash2", dflash2_model=str(root / "out"))
    ids = plain.tokenizer.encode("a lazy dog while seven")
    expected = plain.generate(ids, 40, stop_at_eos=False)
    result = spec.generate(ids, 40, stop_at_eos=False)
    assert result.tokens == expected.tokens and result.stats["cycles"] > 0


def test_resume_continues_the_run(setup):
    root, target, data = setup
    first = train(run_config(root, target, data, out="resumed", steps=8), log=lambda *_: None)
    resumed = train(run_config(root, target, data, out="resumed", steps=12, resume=True, eval_cuts=0),
                            log=lambda *_: None)
    assert [h["step"] for h in resumed["history"]] == list(range(1, 13))
    assert resumed["history"][:8] == first["history"]


def test_evaluation_measures_the_chain(setup, monkeypatch):
    """train-drafter's evaluation runs the drafter's chain, not the default draft tree, so that its mean accepted
    length compares with an MTP head's."""
    from blockspec.train import run as training

    root, target, data = setup
    seen, measure = [], training.one_cycle_acceptance

    def spy(engine, *args, **kw):
        seen.append(engine.proposer.tree_budget)
        return measure(engine, *args, **kw)
    monkeypatch.setattr(training, "one_cycle_acceptance", spy)
    summary = train(run_config(root, target, data, out="chain_eval", steps=2, eval_cuts=2), log=lambda *_: None)
    assert seen == [0] and summary["evaluation"]["cuts"] == 2


def test_evaluation_keeps_within_the_targets_positions(trained, tmp_path):
    """Sequences as long as the target's max_position_embeddings are evaluated (in pieces) within those positions:
    the evaluation's context is not the sequence length plus a few blocks past it."""
    import shutil

    from blockspec.train import run as training
    from blockspec.train.data import Sequence

    root, target, data, _ = trained
    short = shutil.copytree(target, tmp_path / "target")
    config = json.loads((short / "config.json").read_text())
    text = config.get("text_config", config)
    text["max_position_embeddings"] = 96
    (short / "config.json").write_text(json.dumps(config))
    run = run_config(root, short, data, seq_len=96, eval_cuts=6)
    ids = Engine.load(target, device="cpu").tokenizer.encode(" ".join(WORDS * 6))[:96]
    heldout = [Sequence(np.array(ids, dtype=np.int32), np.ones(len(ids), dtype=bool))]
    measured = training.evaluate(run, root / "out", heldout, torch.device("cpu"))
    assert measured["cuts"] == 6 and 1 <= measured["mean_accepted_length"] <= 8


@pytest.mark.parametrize("kind", ["dflash2", "mtp"])
def test_evaluation_runs_the_frozen_target_itself(setup, monkeypatch, kind):
    """An evaluation during training runs the frozen target already in memory (no second copy: a 27B would not fit
    twice beside its training) through new modules over the same tensors, measures what an engine loading the
    written files measures, and leaves the frozen target as the training runs it."""
    from blockspec.train import run as training

    root, target, data = setup
    frozen, views, checked = [], [], []
    real_frozen, real_evaluate, real_view = training.frozen_target, training.evaluate, training.modules_over_the_same_tensors

    def frozen_target(*args, **kw):
        model, sharded = real_frozen(*args, **kw)
        frozen.append(model)
        return model, sharded

    def view(model):
        copy = real_view(model)
        originals = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}
        views.append(copy is not model and all(t.data_ptr() in originals
                                                for t in (*copy.parameters(), *copy.buffers())))
        return copy

    def evaluate(run, out, heldout, device, **shared):
        model = frozen[0]
        types = [type(m) for m in model.modules()]
        values = {k: v.clone() for k, v in model.state_dict().items()}
        measured = real_evaluate(run, out, heldout, device, **shared)
        assert shared["target"] is model and views == [True]
        assert [type(m) for m in model.modules()] == types
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in values.items())
        assert measured == real_evaluate(run, out, heldout, device)  # an engine loading the written files
        checked.append(kind)
        return measured
    monkeypatch.setattr(training, "frozen_target", frozen_target)
    monkeypatch.setattr(training, "modules_over_the_same_tensors", view)
    monkeypatch.setattr(training, "evaluate", evaluate)
    kw = {"replace_mtp": True, "batch_tokens": 192} if kind == "mtp" else {}
    train(run_config(root, target, data, out=f"shared_{kind}", kind=kind, steps=2, eval_cuts=4, **kw),
          log=lambda *_: None)
    assert checked == [kind]


@pytest.mark.slow  # torch.compile of a forward and backward: ~30 s on 2 cores each
@pytest.mark.parametrize("kind,module", [("dflash2", "DrafterLoss"), ("mtp", "MTPModule")])
def test_compiled_step_trains_as_the_eager_one(setup, monkeypatch, kind, module):
    """--compile: the trained module's forward and backward through torch.compile (the drafter with its loss, the
    MTP head; compiled only with the setting) give the eager run's loss curve to float32 rounding (inductor orders
    some sums otherwise); a resumed run may switch it (not a saved setting)."""
    root, target, data = setup
    compiled_modules, real_compile = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda module, **kw: compiled_modules.append(module) or real_compile(module,
                                                                                                            **kw))
    kw = dict(kind=kind, steps=4, eval_cuts=0, **({"replace_mtp": True, "batch_tokens": 192} if kind == "mtp" else {}))
    eager = train(run_config(root, target, data, out=f"eager_{kind}", **kw), log=lambda *_: None)
    assert compiled_modules == []
    compiled = train(run_config(root, target, data, out=f"compiled_{kind}", compile=True, **kw), log=lambda *_: None)
    assert [type(m).__name__ for m in compiled_modules] == [module]
    for a, b in zip(compiled["history"], eager["history"], strict=True):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) <= 1e-3 * abs(b["loss"]), (a, b)
    resumed = train(run_config(root, target, data, out=f"compiled_{kind}", resume=True, **{**kw, "steps": 5}),
                    log=lambda *_: None)
    assert resumed["history"][:4] == compiled["history"] and len(compiled_modules) == 1


@pytest.mark.parametrize("block_sparse", [False, True], ids=["dense-mask", "flex-attention"])
def test_shared_context_forward_equals_dflash_block_by_block(setup, block_sparse):
    """Training runs the anchor blocks of several sequences (laid end to end) in one masked pass over features
    projected once; each block's rows must equal dflash's own forward on that anchor's context alone (its
    sequence's features before the anchor, its sliding-window mask, its positions), with the dense mask and with
    flex_attention's block mask (unfused on the CPU; tests/test_cuda.py runs the compiled kernel, forward and
    backward)."""
    root, target, data = setup
    model, _ = load_target(target)
    run = run_config(root, target, data, window=16, heads=2)
    config = drafter_config(TargetConfig.from_file(target / "config.json"), run, mask_token_id=3)
    drafter = new_drafter(config, seed=1, device="cpu", dtype=torch.float32).eval()
    with torch.no_grad():  # a non-identity convolution and selector, so every path carries signal
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    length, block = 40, drafter.block_size
    features = torch.randn(2 * length, drafter.fc.in_features)
    rng = random.Random(2)
    local = [(s, a) for s in range(2) for a in sample_anchors([True] * length, 5, block, rng)]
    assert any(a < 16 for _, a in local) and any(a > 16 for _, a in local)  # inside and past the window
    ids = torch.full((len(local), block), 3)
    ids[:, 0] = torch.randint(0, 200, (len(local),))
    noise = F.embedding(ids, model.embed_tokens.weight)
    anchors = torch.tensor([s * length + a for s, a in local])
    with torch.no_grad():
        shared = drafter_hidden(drafter, features, noise, anchors, seq_len=length, block_sparse=block_sparse)
        for row, (s, a) in enumerate(local):
            alone = drafter(target_hidden=features[None, s * length:s * length + a], position_ids=torch.arange(
                a + block)[None], noise_embedding=noise[row:row + 1])[0]
            torch.testing.assert_close(shared[row], alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("args,message", [
    (["--data", "/no/such/dir"], "--data /no/such/dir: no such file or directory"),
    (["--data", "/dev/null"], "--data /dev/null: not a regular file or a folder"),
    (["--target-layer-ids", "0,9"], "layer 9 is outside the target's 4 layers"),
    (["--block-size", "1"], "--block-size must be 2..16"),
    (["--target", "/no/target"], "--target /no/target: no such folder"),
    (["--eval-data", "/no/such/file.txt"], "--eval-data /no/such/file.txt: no such file or directory"),
    (["--eval-every", "2", "--heldout", "0"], "--eval-every evaluates on held-out data"),
    (["--intermediate-size", "0"], "--intermediate-size must be at least 1 (got 0)"),
    (["--intermediate-size", "-5"], "--intermediate-size must be at least 1 (got -5)"),
    (["--selector-rank", "0"], "--selector-rank must be at least 1 (got 0)"),
    (["--selector-top-k", "-3"], "--selector-top-k must be at least 1 (got -3)"),
    (["--lr", "inf"], "--lr must be positive and finite (got inf)"),
    (["--lr", "nan"], "--lr must be positive and finite (got nan)"),
    (["--loss-decay", "0"], "--loss-decay must be positive and finite (got 0.0)"),
    (["--loss-decay", "nan"], "--loss-decay must be positive and finite (got nan)"),
    (["--window", "100000000000"], "--window 100000000000 is longer than the target's max_position_embeddings"),
    (["--layers", "1000000"], "--layers 1000000: the drafter's training state"),
    (["--target-layer-ids", ""], "--target-layer-ids must be comma-separated integers (got '')"),
    (["--target-layer-ids", "1,1,1"], "--target-layer-ids [1, 1, 1]: a layer is given twice"),
    (["--heldout", "nan"], "--heldout must be in [0, 1) (got nan)"),
    (["--heldout", "-1"], "--heldout must be in [0, 1) (got -1.0)"),
    (["--out", ""], "--out is empty: give a folder"),
    (["--steps", "5", "--tokens", "4096"], "--steps 5 and --tokens 4096: give one of them"),
])
def test_bad_input_is_one_line_before_training(setup, capsys, args, message):
    root, target, data = setup
    base = {"--target": str(target), "--data": str(data), "--out": str(root / "refused")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["train-drafter", "--device", "cpu"] + [x for kv in base.items() for x in kv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("blockspec: error:")
    assert not (root / "refused").exists()  # nothing written


def test_resume_reads_the_saved_settings_and_refuses_other_ones(trained, capsys):
    from blockspec.cli import build_parser, training_fields

    root, target, data, _ = trained
    base = ["train-drafter", "--target", str(target), "--data", str(data), "--out", str(root / "out"), "--resume"]
    fields = training_fields(build_parser().parse_args(base + ["--steps", "20"]), DrafterTraining)
    assert (fields["seq_len"], fields["batch_tokens"], fields["eval_cuts"], fields["steps"]) == (96, 128, 4, 20)
    assert main(base + ["--seq-len", "64", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seq-len 64 differs from the run saved in" in err and "(--seq-len 96)" in err
    with pytest.raises(BlockspecError, match="--window 16 differs"):  # the API checks as the command line does
        train(run_config(root, target, data, window=16, resume=True), log=lambda *_: None)


@pytest.mark.parametrize("damage,message", [
    (lambda state: {**state, "step": "x"}, "('step' is missing or of another type)"),
    (lambda state: {"step": 1}, "('module' is missing or of another type)"),
    (lambda state: [state], "(the top level is missing or of another type)"),
    (lambda state: {**state, "rng": 5}, "('rng' is missing or of another type)"),
    (lambda state: {**state, "rng": (1, 2)}, "does not fit this run's optimizer or random generators"),
    (lambda state: {**state, "optimizer": {"state": {}, "param_groups": []}},
     "does not fit this run's optimizer or random generators"),
])
def test_resume_of_a_state_of_another_structure_is_one_line(trained, tmp_path, capsys, damage, message):
    import shutil

    root, target, data, _ = trained
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    state = torch.load(out / "training_state.pt", weights_only=False)
    torch.save(damage(state), out / "training_state.pt")
    assert main(["train-drafter", "--target", str(target), "--data", str(data), "--out", str(out), "--resume",
                 "--device", "cpu", "--steps", "20"]) == 2
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1] and err.splitlines()[-1].startswith("blockspec: error: --resume"), err


def test_flags_the_run_does_not_read_are_noted(setup, capsys):
    root, target, data = setup
    assert main(["train-drafter", "--kind", "mtp", "--target", str(target), "--data", str(data), "--out",
                 str(root / "noted"), "--device", "cpu", "--selector-rank", "8", "--window", "64", "--heldout", "0.1",
                 "--eval-cuts", "0", "--lr", "1e-3"]) == 2  # refused after the notes: the target has a head
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("blockspec: note: ")]
    assert [n.split()[2] for n in notes] == ["--window", "--selector-rank", "--heldout"], notes
    assert "--kind mtp trains the target's own MTP head" in notes[0] and "every text of --data trains" in notes[2]
    assert main(["train-drafter", "--target", str(target), "--data", str(data), "--out", str(root / "noted"),
                 "--device", "cpu", "--selector-rank", "0", "--window", "64", "--heldout", "0.1"]) == 2
    assert "note" not in capsys.readouterr().err


def test_mtp_refuses_to_replace_a_head_without_replace_mtp(setup, capsys):
    root, target, data = setup
    assert main(["train-drafter", "--kind", "mtp", "--target", str(target), "--data", str(data), "--out",
                 str(root / "no_head"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already has an MTP head" in err and "--replace-mtp" in err
    assert not (root / "no_head").exists()


def test_non_empty_out_needs_resume(trained, capsys):
    root, target, data, _ = trained
    assert main(["train-drafter", "--target", str(target), "--data", str(data), "--out", str(root / "out"),
                 "--device", "cpu"]) == 2
    assert "is not empty" in capsys.readouterr().err


@pytest.fixture(scope="module")
def trained_mtp(setup):
    root, target, data = setup
    summary = train(run_config(root, target, data, out="with_mtp", kind="mtp", batch_tokens=192, lr=2e-3,
                               replace_mtp=True), log=lambda *_: None)
    return root, target, summary


def test_mtp_head_training_lowers_the_loss_and_writes_a_loadable_copy(trained_mtp):
    root, target, summary = trained_mtp
    losses = [h["loss"] for h in summary["history"]]
    assert sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4, losses
    assert summary["evaluation"]["cuts"] == 4
    out = root / "with_mtp"
    assert (out / "mtp.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "training.json").read_text() == (target / "training.json").read_text()  # the target's own
    assert json.loads((out / "mtp_training.json").read_text())["kind"] == "mtp"  # this run's, not the stale one
    plain = Engine.load(target, device="cpu", compute_dtype="float32")
    mtp = Engine.load(out, device="cpu", compute_dtype="float32", mode="mtp")
    ids = plain.tokenizer.encode("the old tree")
    assert mtp.generate(ids, 40, stop_at_eos=False).tokens == plain.generate(ids, 40, stop_at_eos=False).tokens


def test_mtp_training_module_equals_blockspec_mtp_head(trained_mtp):
    """The head as trained (transformers' layer) and as blockspec runs it give the same logits on the same rows."""
    from safetensors.torch import load_file

    from blockspec.train.mtp import MTPModule, text_config

    root, target, _ = trained_mtp
    engine = Engine.load(root / "with_mtp", device="cpu", compute_dtype="float32", mode="mtp")
    module = MTPModule(text_config(root / "with_mtp"))
    module.load_state_dict({k[len("mtp."):]: v for k, v in load_file(root / "with_mtp" / "mtp.safetensors").items()})
    module.eval()
    model = engine.model
    tokens = torch.tensor(engine.tokenizer.encode("seven small birds sing in the old tree"))
    state = engine.state
    state.reset()
    hidden = model.norm(run_pass(model, state, tokens).hidden)
    state.discard()
    next_tokens = tokens[1:]
    ours, _ = engine.proposer.step_at(hidden[:-1], next_tokens, 0)
    with torch.no_grad():
        theirs = module(model.embed(next_tokens)[None], hidden[None, :-1], torch.arange(len(next_tokens))[None])[0]
    assert (model.logits(ours) - model.logits(theirs)).abs().max() <= 1e-4



def test_train_target_writes_a_checkpoint_blockspec_and_transformers_agree_on(tmp_path, capsys):
    from transformers import Qwen3_5ForCausalLM

    data = tmp_path / "src"
    data.mkdir()
    rng = random.Random(1)
    for i in range(6):
        (data / f"m{i}.py").write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(40)))
    (data / "notes.txt").write_text("not python: skipped by --suffixes .py")
    assert main(["train-target", "--data", str(data), "--suffixes", ".py", "--out", str(tmp_path / "t"), "--vocab",
                 "300", "--hidden", "64", "--layers", "4", "--heads", "2", "--intermediate", "128", "--seq-len", "32",
                 "--batch-tokens", "128", "--steps", "8", "--lr", "3e-3", "--heldout", "0.2", "--device", "cpu"]) == 0
    summary = json.loads((tmp_path / "t" / "training.json").read_text())
    assert summary["vocab"] <= 300 and summary["heldout_bits_per_token"] > 0
    engine = Engine.load(tmp_path / "t", device="cpu", compute_dtype="float32")
    reference_model = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "t").eval()
    ids = torch.tensor(engine.tokenizer.encode("the quick brown fox"))
    with torch.no_grad():
        expected = reference_model(input_ids=ids[None]).logits[0]
    engine.state.reset()
    ours = run_pass(engine.model, engine.state, ids).logits
    engine.state.discard()
    assert (ours - expected).abs().max() <= 1e-4 * max(1.0, float(expected.abs().max()))
    assert main(["train-target", "--data", str(data), "--out", str(tmp_path / "t"), "--device", "cpu"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert len({p.stat().st_mode for p in (tmp_path / "t").iterdir()}) == 1  # the weights as readable as the rest
    assert main(["train-target", "--data", str(data), "--out", str(tmp_path / "t"), "--resume", "--hidden", "128",
                 "--device", "cpu"]) == 2
    assert "--hidden 128 differs from the run saved in" in capsys.readouterr().err


def test_a_diverging_run_stops_in_one_line_before_it_saves_its_weights(tmp_path, capsys):
    data = tmp_path / "src"
    data.mkdir()
    rng = random.Random(1)
    (data / "m.py").write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(80)))
    out = tmp_path / "t"
    assert main(["train-target", "--data", str(data), "--out", str(out), "--vocab", "300", "--hidden", "64",
                 "--layers", "4", "--heads", "2", "--intermediate", "128", "--seq-len", "32", "--batch-tokens", "64",
                 "--steps", "6", "--checkpoint-every", "2", "--lr", "1e308", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # after the progress bar's lines
    assert last.startswith("blockspec: error: training diverged: the loss of step") and "is nan" in last, err
    assert not (out / "model.safetensors").exists()  # no weights of a diverged step were written


def test_a_refused_train_target_leaves_no_folder(tmp_path, capsys):
    (tmp_path / "short.txt").write_text("too short for one sequence")
    argv = ["train-target", "--data", str(tmp_path / "short.txt"), "--out", str(tmp_path / "t"), "--vocab", "300",
            "--seq-len", "64", "--batch-tokens", "64", "--device", "cpu"]
    for _ in range(2):  # the retry is refused for the same reason, not for what the first left behind
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "fewer than one sequence (64)" in err, err
        assert not (tmp_path / "t").exists()


def test_default_feature_layers_sit_at_the_published_drafters_depths():
    from blockspec.fixtures.synthetic import DFLASH2_27B
    from blockspec.train.dflash2 import spread_layer_ids

    assert spread_layer_ids(64, 5) == DFLASH2_27B["dflash_config"]["target_layer_ids"]
    assert spread_layer_ids(8, 5)[-1] == 7 and spread_layer_ids(8, 5)[0] == 1  # a shallow target's top layer is read


def conversation_records(count: int, seed: int = 0) -> list[dict]:
    """Conversations whose user and system turns are upper-case letters and whose assistant turns lower-case ones,
    OpenAI and ShareGPT style in turn."""
    rng = random.Random(seed)
    upper = lambda n: "".join(rng.choice("QWXYZ ") for _ in range(n))  # noqa: E731
    lower = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    records = []
    for i in range(count):
        turns = [("system", upper(20)), ("user", upper(30)), ("assistant", lower(12)), ("user", upper(25)),
                 ("assistant", lower(10))]
        if i % 2:
            names = {"system": "system", "user": "human", "assistant": "gpt"}
            records.append({"conversations": [{"from": names[r], "value": c} for r, c in turns]})
        else:
            records.append({"messages": [{"role": r, "content": c} for r, c in turns]})
    return records


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_conversations_train_on_assistant_tokens_and_texts_on_all(setup, tmp_path):
    from blockspec.models.tokenizer import Tokenizer
    from blockspec.train.data import split_corpus

    _, target, _ = setup
    tokenizer = Tokenizer(target, [258])
    records = conversation_records(6) + [{"text": "0123456789 " * 20}]
    write_jsonl(tmp_path / "chats.jsonl", records[:3])
    write_jsonl(tmp_path / "more.jsonl", records[3:])
    train_sequences, _ = split_corpus([str(tmp_path)], tokenizer, 64, 0.0, 0, 257)
    trained_next, untrained_next = set(), set()
    for s in train_sequences:
        for p in range(len(s.ids) - 1):
            (trained_next if s.trained[p] else untrained_next).add(s.ids[p + 1])
    letters = lambda text: {tokenizer.encode(c)[0] for c in text}  # noqa: E731  (one token per byte)
    assert not trained_next & letters("QWXYZ")  # no user or system token is a trained label
    assert letters("".join(WORDS)) <= trained_next and 258 in trained_next  # every assistant letter, and the end
    assert letters("0123456789") <= trained_next and not letters("0123456789") & untrained_next  # text: everywhere
    assert letters("QWXYZ") <= untrained_next


def test_conversations_and_completions_start_sequences_of_their_own(setup, tmp_path):
    """Texts are laid end to end; a conversation or a completion starts a sequence, its last padded (untrained), so
    the target reads it from its start; a completion is trained on its completion only."""
    from blockspec.models.tokenizer import Tokenizer
    from blockspec.train.data import split_corpus

    _, target, _ = setup
    tokenizer = Tokenizer(target, [258])
    completion = {"prompt": "QWXYZ" * 5, "completion": "abcde" * 20}  # 25 + 100 tokens, the separator: 126
    write_jsonl(tmp_path / "records.jsonl", [completion, {"text": "0123456789" * 10}, conversation_records(1)[0]])
    sequences, _ = split_corpus([str(tmp_path)], tokenizer, 64, 0.0, 0, 257)
    assert all(s.ids.dtype == np.int32 and s.trained.dtype == bool for s in sequences)  # 5 bytes a token
    sequences = [s._replace(ids=s.ids.tolist(), trained=s.trained.tolist()) for s in sequences]
    starts = [s for s in sequences if s.ids[:5] == tokenizer.encode("QWXYZ")]
    assert len(starts) == 1
    first, second = starts[0], sequences[sequences.index(starts[0]) + 1]
    assert first.trained == [False] * 24 + [True] * 40 and first.ids[25:30] == tokenizer.encode("abcde")
    assert second.ids[:61] == tokenizer.encode(("abcde" * 20)[39:]) and second.ids[61:] == [257] * 3  # + padding
    assert second.trained == [True] * 60 + [False] * 4  # the last completion token's label is the separator
    conversation = tokenizer.chat_prompt_ids(conversation_records(1)[0]["messages"], generation_prompt=False)
    # cut from its start (its first 64 tokens, system and user turns, train nothing and are left out)
    assert any(s.ids[:64] == conversation[64:128] for s in sequences)
    texts = [s for s in sequences if s.ids[0] in tokenizer.encode("0123456789")]
    assert len(texts) == 1 and all(texts[0].trained[:-1])  # the text's 101 tokens: one sequence, trained


def test_masked_labels_leave_the_block_loss_alone(setup):
    from blockspec.train.dflash2 import block_losses

    root, target, data = setup
    model, _ = load_target(target)
    run = run_config(root, target, data, window=16, heads=2)
    drafter = new_drafter(drafter_config(TargetConfig.from_file(target / "config.json"), run, mask_token_id=3), seed=1,
                          device="cpu", dtype=torch.float32).eval()
    length, block = 48, drafter.block_size
    gen = torch.Generator().manual_seed(0)
    cycle = torch.tensor(cycle_ids(byte_tokenizer()))  # the planted head tells these apart (every other row is 0)
    tokens, labels = (cycle[torch.randint(0, len(cycle), (length,), generator=gen)] for _ in range(2))
    features = torch.randn(length, drafter.fc.in_features, generator=gen)
    trained = [20 <= p < 30 for p in range(length)]
    anchors = sample_anchors(trained, 8, block, random.Random(0))
    assert anchors and all(20 <= a < 30 for a in anchors)

    def losses(labels):
        with torch.no_grad():
            block_ce, selector_ce, _ = block_losses(drafter, model.logits, model.embed, features, tokens, labels,
                                                    torch.tensor(anchors), 4.0, trained=torch.tensor(trained))
        return block_ce.item(), selector_ce.item()

    untrained_changed, trained_changed = labels.clone(), labels.clone()
    untrained_changed[30:] = labels[30:].roll(1)
    trained_changed[anchors[0]] = cycle[(cycle == labels[anchors[0]]).int().argmax() - 1]
    assert losses(untrained_changed) == losses(labels)
    assert losses(trained_changed)[0] != losses(labels)[0]


def test_mtp_loss_counts_trained_rows_only(setup):
    from blockspec.train.data import Sequence
    from blockspec.train.mtp import MTPModule, mtp_step, text_config
    from blockspec.train.run import TargetFeatures

    _, target, _ = setup
    model, _ = load_target(target)
    head = MTPModule(text_config(target), seed=0)
    eager = TargetFeatures(model, (), 64, "cpu", torch.float32, hidden=True)
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 256, (40,), generator=gen).tolist()
    a, b = shared + torch.randint(0, 256, (24,), generator=gen).tolist(), \
        shared + torch.randint(0, 256, (24,), generator=gen).tolist()
    before = [p < 30 for p in range(64)]  # rows after position 30 see the tokens where a and b part

    def loss(ids, trained):
        with torch.no_grad():
            return mtp_step(head, model, eager, [Sequence(ids, trained)], 64)(random.Random(0))[0].item()

    assert loss(a, before) == loss(b, before)
    assert loss(a, [True] * 64) != loss(b, [True] * 64)


GOOD_RECORD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})


@pytest.mark.parametrize("lines,message", [
    ([GOOD_RECORD, '{"messages": [{"role": "user"'], "bad.jsonl:2: not JSON"),
    ([GOOD_RECORD, "", '{"messages": [{"role": "user", "content": "hi"}]}'],
     "bad.jsonl:3: the conversation has no assistant turn"),
    (['{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}'],
     "bad.jsonl:1: message 0 has an unknown role 'robot'"),
    (['{"conversations": [{"from": "human", "value": "x"}, {"from": "bot", "value": "y"}]}'],
     "bad.jsonl:1: message 1 has an unknown from 'bot'"),
    (['{"messages": [{"role": "assistant", "content": 3}]}'], "bad.jsonl:1: message 0 has no string \"content\""),
    (['["a", "list"]'], "bad.jsonl:1: a JSON object expected, got list"),
    ([GOOD_RECORD, '{"prompt": "def f():"}'],
     'bad.jsonl:2: a completion record needs a string "prompt" and a string "completion"'),
    (['{"content": "x"}'], 'bad.jsonl:1: no "messages", "conversations", "prompt" and "completion", or "text" field'),
    ([GOOD_RECORD, '{"text": "a\\ud800b"}'], "bad.jsonl:2: a string holds an unpaired surrogate escape"),
    (["[" * 5000 + "]" * 5000], "bad.jsonl:1: JSON nested too deeply"),
    (['{"text": "t", "messages": [{"role": "assistant", "content": "y"}]}'],
     "bad.jsonl:1: one record holds messages and text: give each its own line"),
])
def test_bad_jsonl_is_one_line_before_the_target_loads(setup, tmp_path, capsys, monkeypatch, lines, message):
    import blockspec.train.run as run_module

    _, target, data = setup
    monkeypatch.setattr(run_module, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["train-drafter", "--target", str(target), "--data", str(data), str(tmp_path / "bad.jsonl"),
                 "--out", str(tmp_path / "out"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("blockspec: error: --data "), err
    assert not (tmp_path / "out").exists()


def test_conversations_need_a_chat_template(setup, tmp_path, capsys, monkeypatch):
    import shutil

    import blockspec.train.run as run_module

    _, target, _ = setup
    bare = tmp_path / "bare"
    shutil.copytree(target, bare)
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    write_jsonl(tmp_path / "chats.jsonl", conversation_records(2))
    monkeypatch.setattr(run_module, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    assert main(["train-drafter", "--target", str(bare), "--data", str(tmp_path / "chats.jsonl"), "--out",
                 str(tmp_path / "out"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "chats.jsonl: conversations are rendered with the target's chat template" in err
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_of_another_model_is_refused_before_the_target_loads(setup, tmp_path, capsys, monkeypatch):
    import shutil

    import blockspec.train.run as run_module

    _, target, data = setup
    other = tmp_path / "other"
    shutil.copytree(target, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 200  # fewer rows than the byte tokenizer's 259 ids
    config["eos_token_id"] = 199  # an id the config itself can hold
    (other / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(run_module, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    assert main(["train-drafter", "--target", str(other), "--data", str(data), "--out", str(tmp_path / "out"),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizer.json has 259 ids, more than the model's vocab_size 200" in err


@pytest.mark.parametrize("block,window,tile,seq_len,sequences,per_sequence", [
    (8, 16, 16, 90, 3, 12), (4, 64, 32, 90, 3, 12), (16, 24, 128, 90, 3, 12), (6, 10, 16, 90, 3, 12),
    (8, 64, 128, 100, 1, 10),  # one query tile whose context and blocks share a key tile
    (8, 64, 128, 100, 1, 36),
])
def test_block_mask_covers_the_dense_mask_and_attends_alike(block, window, tile, seq_len, sequences, per_sequence):
    """The training step's block mask, built from its rows' key ranges, lists every key tile the dense mask needs
    once each, and on the CPU's unfused flex_attention attends as scaled_dot_product_attention does under it."""
    from blockspec.train.block_attention import BlockLayout, attend

    torch.manual_seed(block)
    anchors = torch.cat([s * seq_len + torch.randperm(seq_len - block)[:per_sequence].sort().values + 1
                         for s in range(sequences)])
    layout = BlockLayout(anchors, block, sequences * seq_len, window, seq_len)
    dense, mask = layout.dense_mask(), layout.block_mask(tile)
    q_tiles, kv_tiles = -(-layout.rows // tile), -(-(layout.length + layout.rows) // tile)
    listed = torch.zeros(q_tiles, kv_tiles, dtype=torch.bool)
    counts, indices = mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0]
    for t in range(q_tiles):
        listed[t, indices[t, :counts[t]].long()] = True
    needed = torch.nn.functional.pad(dense, (0, kv_tiles * tile - dense.shape[1], 0, q_tiles * tile - dense.shape[0]))
    needed = needed.view(q_tiles, tile, kv_tiles, tile).any(3).any(1)
    assert (needed <= listed).all() and all(len(set(indices[t, :counts[t]].tolist())) == counts[t] for t in
                                            range(q_tiles))  # each tile once
    q = torch.randn(1, 4, layout.rows, 16)
    k, v = (torch.randn(1, 2, layout.length + layout.rows, 16) for _ in range(2))
    torch.testing.assert_close(attend(q, k, v, mask, 0.25), attend(q, k, v, dense, 0.25), rtol=1e-5, atol=1e-5)


def train_drafter_argv(run: DrafterTraining) -> list[str]:
    """The `train-drafter` flags of a run: those that differ from the defaults."""
    from dataclasses import fields

    argv = ["train-drafter"]
    for field in fields(run):
        value = getattr(run, field.name)
        if value != field.default:
            flag = "--" + field.name.replace("_", "-")
            argv += [flag] if value is True else [flag, *map(str, value if isinstance(value, list) else [value])]
    return argv


def torchrun(run: DrafterTraining, processes: int = 2) -> str:
    """`torchrun --nproc-per-node N -m blockspec train-drafter ...` on the CPU (gloo); its output."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(processes), "-m", "blockspec", *train_drafter_argv(run)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def trained_weights(out) -> dict:
    return torch.load(out / "training_state.pt", weights_only=False)["module"]


def assert_same_run(one: dict, two: dict, out_one, out_two):
    """Two runs of the same global batches: the same figures step by step (the history keeps 4 decimals) and the
    same trained weights (fp32 on the CPU: the ranks' sums differ from one process's in rounding only)."""
    assert [h["step"] for h in two["history"]] == [h["step"] for h in one["history"]]
    for a, b in zip(one["history"], two["history"]):
        assert b == pytest.approx(a, rel=1e-4, abs=2e-4), (a, b)
    weights_one, weights_two = trained_weights(out_one), trained_weights(out_two)
    for name, tensor in weights_one.items():
        torch.testing.assert_close(weights_two[name], tensor, rtol=1e-4, atol=1e-5)


def test_two_processes_train_as_one_and_resume(setup, capfd):
    """torchrun with 2 processes (gloo on the CPU) trains on each step's global batch, shared between the ranks, as
    one process does, with the target's layers sharded between them (FSDP2) or whole on each, and continues a run
    under --resume the same way, in 2 processes (`train-drafter --nproc 2`, which starts torchrun itself) or in 1;
    rank 0 alone logs and writes, evaluations and the best weights included."""
    import shutil

    root, target, data = setup
    settings = dict(batch_tokens=192, checkpoint_every=2, eval_every=2, heldout=0.2)
    single = train(run_config(root, target, data, out="single", steps=4, **settings), log=lambda *_: None)
    single = train(run_config(root, target, data, out="single", steps=6, resume=True, **settings),
                   log=lambda *_: None)
    logged = torchrun(run_config(root, target, data, out="ranks", steps=4, target_sharding="fsdp", **settings))
    assert logged.count("train-drafter:") == 1, logged
    assert "on cpu x 2 processes (the target's layers sharded across them, FSDP2)" in logged, logged
    shutil.copytree(root / "ranks", root / "ranks_then_one")
    resume = train_drafter_argv(run_config(root, target, data, out="ranks", steps=6, resume=True, **settings))
    assert main(resume + ["--nproc", "2"]) == 0
    logged = capfd.readouterr().out
    assert logged.count("train-drafter:") == 1 and "on cpu x 2 processes" in logged, logged
    ranks = json.loads((root / "ranks" / "training.json").read_text())
    ranks["history"] = ranks.pop("learning_curve")
    assert_same_run(single, ranks, root / "single", root / "ranks")
    one = train(run_config(root, target, data, out="ranks_then_one", steps=6, resume=True, **settings),
                log=lambda *_: None)  # the 2-process run resumed in one process
    assert_same_run(single, one, root / "single", root / "ranks_then_one")
    assert [e["step"] for e in ranks["evaluations"]] == [2, 4, 6] == [e["step"] for e in single["evaluations"]]
    assert ranks["best"]["step"] == single["best"]["step"] and (root / "ranks" / "best" / "model.safetensors").is_file()
    assert 1 <= ranks["evaluation"]["mean_accepted_length"] <= 8


def test_mtp_head_trains_in_two_processes_as_in_one(setup):
    """The MTP head as the drafter: the same run in 2 processes as in one; its best weights in a loadable copy of
    the target (OUT/best), the run's own copy untouched by it."""
    root, target, data = setup
    settings = dict(kind="mtp", replace_mtp=True, batch_tokens=192, steps=4, checkpoint_every=4, eval_every=2)
    single = train(run_config(root, target, data, out="mtp_single", **settings), log=lambda *_: None)
    torchrun(run_config(root, target, data, out="mtp_ranks", **settings))
    ranks = json.loads((root / "mtp_ranks" / "mtp_training.json").read_text())
    ranks["history"] = ranks.pop("learning_curve")
    assert_same_run(single, ranks, root / "mtp_single", root / "mtp_ranks")
    best = root / "mtp_ranks" / "best"
    assert ranks["best"]["step"] == single["best"]["step"]
    assert not (best / "training_state.pt").exists() and not (best / "best").exists()
    plain = Engine.load(target, device="cpu", compute_dtype="float32")
    mtp = Engine.load(best, device="cpu", compute_dtype="float32", mode="mtp")
    ids = plain.tokenizer.encode("the old tree")
    assert mtp.generate(ids, 20, stop_at_eos=False).tokens == plain.generate(ids, 20, stop_at_eos=False).tokens


def test_a_world_size_that_does_not_share_the_step_evenly_is_refused(setup, tmp_path, capsys, monkeypatch):
    import blockspec.train.run as run_module

    _, target, data = setup
    monkeypatch.setattr(run_module, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    monkeypatch.setenv("WORLD_SIZE", "3")  # as torchrun --nproc-per-node 3 sets it
    assert main(train_drafter_argv(run_config(tmp_path, target, data, batch_tokens=192))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "3 processes cannot share the 2 sequences of a step evenly" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sharding, world, message", [
    ("fsdp", 1, "--target-sharding fsdp shares the target between processes: start several with torchrun"),
    ("halves", 2, "argument --target-sharding: invalid choice: 'halves'")])
def test_target_sharding_is_checked_before_the_target_loads(setup, tmp_path, capsys, monkeypatch, sharding, world,
                                                            message):
    import blockspec.train.run as run_module

    _, target, data = setup
    monkeypatch.setattr(run_module, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert main(train_drafter_argv(run_config(tmp_path, target, data, target_sharding=sharding))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_automatic_sharding_follows_the_gpu_s_memory(setup, monkeypatch):
    """auto: whole on every GPU while the target (as bf16) and 16 bytes a trained parameter fill at most 3/4 of one."""
    import blockspec.train.run as run_module

    _, target, data = setup
    run = run_config(target.parent, target, data)
    drafter = torch.nn.Linear(100, 100)  # 10100 parameters: 161.6 kB of training state
    stored = sum(f.stat().st_size for f in target.glob("*.safetensors")) // 2  # float32 checkpoint, as bf16
    need = stored + 16 * 10100
    for memory, sharded in [(need * 4 // 3 + 64, False), (need * 4 // 3 - 64, True)]:
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device, memory=memory: type("Properties", (), {"total_memory": memory}))
        assert run_module.shards_target(run, drafter, torch.device("cuda", 0)) is sharded
    assert run_module.shards_target(run, drafter, torch.device("cpu")) is False
    assert run_module.shards_target(run_config(target.parent, target, data, target_sharding="fsdp"), drafter,
                                    torch.device("cpu")) is True


def test_eval_data_is_evaluated_on_and_all_of_data_trains(setup, tmp_path, monkeypatch):
    """--eval-data: the one-cycle measure reads those files' sequences (not a share of --data), and every text of
    --data trains."""
    import blockspec.train.run as run_module
    from blockspec.models.tokenizer import Tokenizer

    root, target, data = setup
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "held.txt").write_text(" ".join(reversed(WORDS)) * 12)
    measured = []

    def one_cycle(engine, sequences, cuts, seed, trained):
        measured.append(sequences)
        return {"cuts": cuts, "mean_accepted_length": 1.5}

    monkeypatch.setattr(run_module, "one_cycle_acceptance", one_cycle)
    lines = []
    summary = train(run_config(root, target, data, out=str(tmp_path / "out"), steps=2, eval_every=1,
                               eval_data=[str(tmp_path / "eval")]), log=lines.append)
    from blockspec.config import TargetConfig

    tokenizer = Tokenizer(str(target), TargetConfig.from_file(target / "config.json").eos_token_ids)
    expected = tokenizer.encode_batch([" ".join(reversed(WORDS)) * 12])[0]
    assert len(measured) == 2 and summary["evaluation"]["mean_accepted_length"] == 1.5
    assert all(seqs[0] == expected[:96] for seqs in measured), measured[0][0][:10]
    counts = [line for line in lines if line.startswith("train-drafter:")][0]
    alone = []
    train(run_config(root, target, data, out=str(tmp_path / "all"), steps=1, heldout=0, eval_cuts=0),
          log=alone.append)
    assert counts.split(" held-out")[0].split(" training / ")[0] == \
        [line for line in alone if line.startswith("train-drafter:")][0].split(" training / ")[0]


def test_eval_every_keeps_the_best_weights_and_resume_remembers_them(tmp_path):
    from blockspec.train.loop import Trainer

    module = torch.nn.Linear(2, 1)
    written = {}  # step -> the weights written then

    def save(directory):
        torch.save(module.state_dict(), directory / "w.pt")
        written[trainer.step] = {k: v.clone() for k, v in module.state_dict().items()}

    def step_loss(rng):
        return module(torch.tensor([rng.random(), 1.0])).square().sum(), {"first_row_accuracy": 0.5}, 1

    def measured(values):
        values = iter(values)
        return lambda: {"mean_accepted_length": next(values)}

    trainer = Trainer(module, tmp_path, 0.1, torch.device("cpu"), save, 100, 0, {})
    trainer.fit(6, step_loss, measured([1.5, 2.0, 1.8]), eval_every=2)
    assert [(e["step"], e["mean_accepted_length"]) for e in trainer.evaluations] == [(2, 1.5), (4, 2.0), (6, 1.8)]
    assert trainer.best == {"step": 4, "mean_accepted_length": 2.0}
    assert all(torch.equal(torch.load(tmp_path / "best" / "w.pt")[k], v) for k, v in written[4].items())
    assert all(not torch.equal(written[4][k], v) for k, v in written[6].items())  # so best/ is not the last
    trainer = Trainer(module, tmp_path, 0.1, torch.device("cpu"), save, 100, 0, {})
    trainer.resume()
    trainer.fit(10, step_loss, measured([1.9, 2.5]), eval_every=4)
    assert [e["step"] for e in trainer.evaluations] == [2, 4, 6, 8, 10]
    assert trainer.best == {"step": 10, "mean_accepted_length": 2.5}
    assert all(torch.equal(torch.load(tmp_path / "best" / "w.pt")[k], v) for k, v in written[10].items())


def test_scaling_bench_names_a_ranks_failure():
    """A failed run's report keeps what the aborting process said, which torchrun's own report buries."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from drafter_scaling import failure_report

    stderr = ("*****\nSetting OMP_NUM_THREADS ...\nterminate called after throwing an instance of 'c10::Error'\n"
              "W1205 21:08:46 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1028]"
              " Sending process 17858 closing signal SIGTERM\nTraceback (most recent call last):\n"
              + "  File x, line 1\n" * 20 + "=====\nRoot Cause (first observed failure):\n  rank      : 1\n"
              "  exitcode  : -6 (pid: 17859)  (SIGABRT)\n=====\n")
    report = failure_report(stderr).splitlines()
    assert "terminate called after throwing an instance of 'c10::Error'" in report
    assert report[-1] == "  exitcode  : -6 (pid: 17859)  (SIGABRT)" and "=====" not in report
    assert report.index("(torchrun:)") > report.index("terminate called after throwing an instance of 'c10::Error'")


@pytest.mark.slow  # two torchrun launches of 1 and 2 processes: ~20 s on 2 cores
def test_scaling_bench_dry_run(setup):
    """bench/drafter_scaling.py (the several-GPU measurement) on the CPU: 1 and 2 gloo processes of one run, the
    same loss curve, an efficiency figure."""
    import subprocess
    import sys
    from pathlib import Path

    root, target, data = setup
    flags = train_drafter_argv(run_config(root, target, data, steps=2, batch_tokens=192, eval_cuts=0))[1:]
    out_flag = flags.index("--out")
    del flags[out_flag:out_flag + 2]
    repo = Path(__file__).resolve().parent.parent
    script = repo / "bench" / "drafter_scaling.py"
    proc = subprocess.run([sys.executable, str(script), "--nproc", "1,2", "--work", str(root / "scaling"),
                           "--json-out", str(root / "scaling.json"), "--", *flags], cwd=repo, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    one, two = json.loads((root / "scaling.json").read_text())["runs"]
    assert (one["processes"], two["processes"]) == (1, 2) and one["block_tokens_per_s"] > 0
    assert two["efficiency"] > 0 and two["loss_max_abs_diff"] <= 2e-4


def test_recipes_bench_dry_run(setup, tmp_path):
    """bench/drafter_recipes.py on the CPU: a drafter and an MTP head side by side, each evaluated on the standard
    library's fixtures as it trains (each evaluation printed as it comes); the table's curves and final figures
    come from their training summaries. Then the data and steps each recipe is given."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    _, target, data = setup
    repo = Path(__file__).resolve().parent.parent
    common = ["--target", str(target), "--data", str(data), "--seq-len", "96", "--batch-tokens", "128", "--steps",
              "2", "--device", "cpu", "--selector-top-k", "8"]
    proc = subprocess.run([sys.executable, str(repo / "bench" / "drafter_recipes.py"), "--recipes", "drafter,mtp",
                           "--work", str(tmp_path / "work"), "--parallel", "2", "--eval-every", "1", "--eval-cuts",
                           "2", "--json-out", str(tmp_path / "recipes.json"), "--", *common], cwd=repo,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = json.loads((tmp_path / "recipes.json").read_text())["runs"]
    assert [r["recipe"] for r in runs] == ["drafter", "mtp"]
    spec = importlib.util.spec_from_file_location("drafter_recipes", repo / "bench" / "drafter_recipes.py")
    recipes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipes)
    flags = ["--data", "a", "b", "--steps", "5"]
    assert recipes.recipe_flags("mtp-regenerated", flags, "r.jsonl")[:5] == ["--data", "r.jsonl", "--steps", "5",
                                                                            "--kind"]
    assert recipes.recipe_flags("drafter-mixed", flags, "r.jsonl")[:4] == ["--data", "a", "b", "r.jsonl"]
    assert recipes.recipe_flags("mtp-4x", flags, None)[5:7] == ["--steps", "20"]
    mixed = recipes.recipe_flags("drafter-3-layers-4x-mixed", flags, "r.jsonl")
    assert mixed[:4] == ["--data", "a", "b", "r.jsonl"] and mixed[6:10] == ["--steps", "20", "--layers", "3"], mixed
    from blockspec.cli import build_parser
    long = recipes.recipe_flags("mtp-4x-seq-4096", ["--target", "T", "--seq-len", "1024", *flags], None)
    parsed = build_parser().parse_args(["train-drafter", *long, "--out", "O"])  # the recipe's --seq-len comes last
    assert (parsed.seq_len, parsed.kind, parsed.steps) == (4096, "mtp", 20)
    for r, summary in zip(runs, ["drafter/training.json", "mtp/mtp_training.json"]):
        written = json.loads((tmp_path / "work" / summary).read_text())
        assert r["curve"] == {str(e["step"]): e["mean_accepted_length"] for e in written["evaluations"]}
        assert list(r["curve"]) == ["1", "2"] and r["cuts"] == 2 and r["mean_accepted_length"] >= 1
        for step, accepted in r["curve"].items():  # relayed from the run's log as it came
            assert f"{r['recipe']}: step {step}: mean accepted length {accepted:.3f} over 2" in proc.stdout


def test_training_bench_dry_run_in_two_processes(tmp_path):
    """bench/drafter_training.py under torchrun (2 gloo processes on the CPU, the tiny preset), the target whole on
    each, then its layers sharded between them: every rank's rows counted, the figures written by rank 0."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(repo / "bench" / "drafter_training.py"), "--preset", "tiny", "--seq-len", "64",
                           "--batch-tokens", "128", "--steps", "1", "--target-sharding", "replicate,fsdp", "--json-out",
                           str(tmp_path / "figures.json")], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    whole, sharded = json.loads((tmp_path / "figures.json").read_text())
    assert (whole["target_sharding"], sharded["target_sharding"]) == ("replicate", "fsdp")
    for figures in (whole, sharded):
        assert figures["processes"] == 2 and figures["block_rows_per_step"] == 128 and figures["block_tokens_per_s"] > 0
    assert proc.stdout.count("warm-up step 0") == 2  # rank 0 alone prints, once a placement
    assert "target whole on each of 2 processes" in proc.stdout and "target's layers sharded" in proc.stdout


def test_train_step_bench_dry_run(setup):
    """bench/train_step.py on the CPU: train-drafter itself on the tiny target, timed and profiled (--syncs: CUDA's
    sync debug mode, one more step, none counted on the CPU)."""
    import subprocess
    import sys
    from pathlib import Path

    root, target, data = setup
    flags = train_drafter_argv(run_config(root, target, data))[1:]
    for flag in ("--out", "--steps", "--checkpoint-every", "--eval-cuts"):
        del flags[flags.index(flag):flags.index(flag) + 2]
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(repo / "bench" / "train_step.py"), "--warmup", "1", "--steps", "2",
                           "--profile", "1", "--rows", "5", "--syncs", "--json-out", str(root / "train_step.json"), "--",
                           *flags],
                          cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figures = json.loads((root / "train_step.json").read_text())
    assert figures["step_s"] > 0 and figures["block_tokens_per_s"] > 0 and figures["profiled_cpu_ms_per_step"] > 0
    assert "cpu_time_total" not in proc.stdout and "Self CPU" in proc.stdout  # the CPU profile table
    assert "syncs_per_step" not in figures and "host waits" not in proc.stdout


def test_nproc_checks_the_run_before_it_starts_torchrun(setup, tmp_path, capfd, monkeypatch):
    """`train-drafter --nproc 3` on a run that 3 processes cannot share is refused here, in one line, before any
    process starts (`--nproc 2` runs: test_two_processes_train_as_one_and_resume)."""
    import subprocess

    root, target, data = setup
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a process was started"))
    argv = train_drafter_argv(run_config(tmp_path, target, data, steps=2, batch_tokens=192, eval_cuts=0, heldout=0))
    assert main(argv + ["--nproc", "3"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "3 processes cannot share the 2 sequences of a step evenly" in err, err
    assert not (tmp_path / "out").exists()


def test_a_file_named_in_data_must_be_utf8_and_one_found_in_a_folder_is_skipped(setup, tmp_path, capsys):
    _, target, data = setup
    (tmp_path / "binary.txt").write_bytes(b"ok \xff\xfe")
    argv = ["train-drafter", "--target", str(target), "--out", str(tmp_path / "out"), "--device", "cpu", "--data"]
    assert main(argv + [str(data), str(tmp_path / "binary.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "binary.txt: not UTF-8 text (invalid start byte at byte 3)" in err, err
    from blockspec.train.data import read_paths

    assert read_paths([str(tmp_path)] + [str(data)]) == read_paths([str(data)])


def test_nothing_is_held_out_without_an_evaluation(setup, tmp_path):
    root, target, data = setup
    lines = []
    train(run_config(root, target, data, out=tmp_path / "out", steps=1, eval_cuts=0, heldout=0.5), log=lines.append)
    assert " / 0 held-out sequences" in lines[0], lines


@pytest.fixture
def saved_run(trained, tmp_path, monkeypatch):
    """A copy of the trained run's folder to damage, and train-drafter --resume on it (the target never loaded)."""
    import shutil

    import blockspec.train.run as run_module

    root, target, data, _ = trained
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    monkeypatch.setattr(run_module, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    return out, ["train-drafter", "--target", str(target), "--data", str(data), "--out", str(out), "--resume",
                 "--device", "cpu"]


@pytest.mark.parametrize("damage,flags,message", [
    (lambda out: (out / "training_state.pt").write_bytes((out / "training_state.pt").read_bytes()[:1000]), [],
     "training_state.pt is truncated or not a saved training state"),
    (lambda out: (out / "training_state.pt").write_bytes(b""), [],
     "training_state.pt is truncated or not a saved training state"),
    (lambda out: (out / "training_run.json").write_text("[1]"), [],
     "training_run.json must hold a JSON object of settings, not list"),
    (lambda out: (out / "training_run.json").write_text(json.dumps(
        {**json.loads((out / "training_run.json").read_text()), "layers": "one"})), [],
     "training_run.json: \"layers\" must be int (got 'one')"),
    (lambda out: None, ["--steps", "3"], "is at step 16, past the 3 steps asked"),
])
def test_a_damaged_or_overtaken_saved_run_is_refused_before_the_target_loads(saved_run, capsys, damage, flags,
                                                                             message):
    out, argv = saved_run
    damage(out)
    assert main(argv + flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("blockspec: error: --resume"), err


def test_an_interrupted_checkpoint_leaves_the_last_one_whole(setup, tmp_path, monkeypatch):
    import transformers.modeling_utils as modeling

    root, target, data = setup
    written = []
    original = modeling.safe_save_file

    def interrupted(tensors, filename, *args, **kwargs):
        written.append(filename)
        if len(written) == 1:
            return original(tensors, filename, *args, **kwargs)
        open(filename, "wb").close()  # a write cut short
        raise KeyboardInterrupt
    monkeypatch.setattr(modeling, "safe_save_file", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        train(run_config(root, target, data, out=out, steps=2, checkpoint_every=1, eval_cuts=0), log=lambda *_: None)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "training_run.json",
                                                     "training_state.pt"]
    from safetensors.torch import load_file

    assert load_file(out / "model.safetensors") and json.loads((out / "config.json").read_text())


def test_a_truncated_target_is_refused_in_one_line(setup, tmp_path, capsys):
    import shutil

    root, target, data = setup
    damaged = tmp_path / "target"
    shutil.copytree(target, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert main(["train-drafter", "--target", str(damaged), "--data", str(data), "--out", str(tmp_path / "out"),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors: corrupt or unreadable safetensors file" in err, err


@pytest.mark.parametrize("flags,message", [
    (["--heads", "0"], "--heads must be at least 1 (got 0)"),
    (["--heads", "-2"], "--heads must be at least 1 (got -2)"),
    (["--hidden", "0"], "--hidden must be at least 1 (got 0)"),
    (["--hidden", "-64"], "--hidden must be at least 1 (got -64)"),
    (["--intermediate", "-5"], "--intermediate must be at least 1 (got -5)"),
    (["--heldout", "nan"], "--heldout must be in [0, 1) (got nan)"),
    (["--heldout", "-1"], "--heldout must be in [0, 1) (got -1.0)"),
    (["--heldout", "1"], "--heldout must be in [0, 1) (got 1.0)"),
    (["--lr", "inf"], "--lr must be positive and finite (got inf)"),
])
def test_train_target_refuses_bad_sizes_in_one_line(setup, tmp_path, capsys, flags, message):
    _, _, data = setup
    assert main(["train-target", "--data", str(data), "--out", str(tmp_path / "t"), "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "t").exists()


def test_draft_vocabulary_refuses_texts_without_tokens(setup, tmp_path, capsys):
    _, target, _ = setup
    (tmp_path / "empty.txt").write_text("")
    assert main(["draft-vocabulary", "--model", str(target), "--texts", str(tmp_path / "empty.txt"), "--size", "10",
                 "--out", str(tmp_path / "new" / "v.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "empty.txt: no tokens to count" in err, err
    assert not (tmp_path / "new").exists()  # nor the folder it would have been written in


@pytest.mark.parametrize("line,message", [
    ('{"text": "a\\ud800b"}', "bad.jsonl:1: a string holds an unpaired surrogate escape"),
    ("[" * 5000 + "]" * 5000, "bad.jsonl:1: JSON nested too deeply"),
])
def test_train_target_refuses_bad_jsonl_before_training(setup, tmp_path, capsys, line, message):
    _, _, data = setup
    (tmp_path / "bad.jsonl").write_text(line + "\n")
    assert main(["train-target", "--data", str(data), str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "t"),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "t").exists()


def test_train_target_says_when_the_text_yields_a_smaller_vocabulary(setup, tmp_path):
    from blockspec.train.target import TargetTraining, train_target

    _, _, data = setup
    lines = []
    train_target(TargetTraining(data=[str(data)], out=str(tmp_path / "t"), vocab=100000, hidden=64, layers=4, heads=2,
                                intermediate=64, seq_len=32, batch_tokens=32, steps=1, heldout=0, device="cpu"),
                 log=lines.append)
    assert "(--vocab 100000: the text yields no more merges)" in lines[0], lines
