"""`blockspec bench` on the tiny synthetic preset (CPU): output schema, fixtures, forced acceptance."""

import contextlib
import importlib.util
import io
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from blockspec.cli import main
from blockspec.config import DEFAULT_TREE_BUDGETS


def bench(tmp_path, *args, subprocess_run=False):
    """`blockspec bench --synthetic tiny` on the CPU: (its JSON, its stdout); in-process, or through the console entry
    point in a subprocess."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--synthetic", "tiny", "--device", "cpu", "--dtype", "float32", "--json-out", str(out),
            *map(str, args)]
    if subprocess_run:
        proc = subprocess.run([sys.executable, "-m", "blockspec.cli", *argv], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr
        return json.loads(out.read_text()), proc.stdout
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(argv)
    assert code == 0
    return json.loads(out.read_text()), stdout.getvalue()


def test_schema_default_fixtures_and_forced_rates(tmp_path):
    rates = [0.553, 0.297, 0.516]
    result, stdout = bench(tmp_path, "--mode", "none,mtp,dflash2", "--max-tokens", 64, "--repeats", 2,
                           "--forced-acceptance", ",".join(map(str, rates)), subprocess_run=True)
    assert "SYNTHETIC" in result["label"] and "FORCED" in result["label"] and "SYNTHETIC" in stdout
    assert {"device", "bytes_per_plain_step", "rows", "max_tokens", "repeats"} <= set(result)
    assert result["bytes_per_plain_step"] > 0
    rows = result["rows"]
    tree = f"dflash2:{DEFAULT_TREE_BUDGETS['cpu']}"  # the CPU's default budget, named in the rows
    assert [(r["mode"], r["fixture"]) for r in rows] == [
        (m, f) for m in ("none", "mtp", tree) for f in ("code", "english", "translation")]
    for row in rows:
        assert len(row["runs_tokens_per_s"]) == 2 and row["decode_tokens_per_s"] > 0
        assert row["generated"] == 64 and row["prefill_s"] > 0 and row["weight_gb_s"] >= 0
        if row["mode"] == "none":
            assert row["acceptance_rate"] is None
        else:  # the forced rate is hit (the trajectory is the plain one, so every forced proposal is right)
            rate = rates[["code", "english", "translation"].index(row["fixture"])]
            assert row["acceptance_rate"] == pytest.approx(rate, abs=0.05), row
            assert row["cycle_vs_plain_step"] > 0


def test_prompt_and_fixture_file(tmp_path):
    fixtures = tmp_path / "fx.json"
    fixtures.write_text(json.dumps([{"name": "one", "prompt": "abc"}, {"name": "two", "prompt": "xyz"}]))
    result, _ = bench(tmp_path, "--fixtures", fixtures, "--max-tokens", 20, "--repeats", 1)
    assert [r["fixture"] for r in result["rows"]] == ["one", "two"]
    result, _ = bench(tmp_path, "--prompt", "hello", "--max-tokens", 20, "--repeats", 1)
    assert [r["fixture"] for r in result["rows"]] == ["prompt"] and "FORCED" not in result["label"]


@pytest.mark.parametrize("args,needle", [
    (["--synthetic", "huge"], "unknown synthetic preset"),
    (["--synthetic", "tiny", "--mode", "fast"], "--mode 'fast'"),
    (["--synthetic", "tiny", "--mode", "mtp", "--forced-acceptance", "1.5"], "--forced-acceptance"),
    (["--synthetic", "tiny", "--mode", "mtp", "--forced-acceptance", "0.1,0.2"], "one per fixture"),
    (["--model", "/nonexistent", "--forced-acceptance", "0.5"], "needs --synthetic"),
    (["--synthetic", "tiny", "--compare-greedy"], "give --temperature above 0"),
    (["--synthetic", "tiny", "--temperature", "1", "--top-p", "0"], "'top_p'"),
    (["--synthetic", "tiny", "--fixtures", "/nonexistent.json"], "fixtures file"),
])
def test_bad_bench_arguments(capsys, args, needle):
    code = main(["bench", "--device", "cpu", "--max-tokens", "4", "--repeats", "1", *args])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1, err


def test_table_label_first_then_header_then_rows(tmp_path):
    result, stdout = bench(tmp_path, "--prompt", "hello", "--mode", "none,mtp", "--max-tokens", 12, "--repeats", 1)
    lines = stdout.splitlines()
    assert lines[0] == result["label"] and lines[0].startswith("SYNTHETIC")
    # synthetic weights, a speculative mode, no forced acceptance: said once why acceptance is ~0
    assert lines[1] == result["note"] and "--forced-acceptance" in lines[1] and stdout.count("note:") == 1
    header = lines[2].split()
    assert header[:3] == ["mode", "fixture", "tok/s"] and "accept" in header
    rows = lines[3:]
    assert [r.split()[:2] for r in rows] == [["none", "prompt"], ["mtp", "prompt"]]
    assert len(rows) == len(result["rows"])
    accept = lines[2].index("accept")  # each value sits under its column
    assert rows[0][accept:accept + 6].strip() == "-" and rows[1][accept:accept + 7].strip().endswith("%")
    forced, stdout = bench(tmp_path, "--prompt", "hello", "--mode", "mtp", "--max-tokens", 12, "--repeats", 1,
                           "--forced-acceptance", 0.5)
    assert "note:" not in stdout and "note" not in forced  # forced acceptance: nothing to explain


@pytest.fixture
def no_model_work(monkeypatch):
    """Fails the test if the benchmark gets as far as building an engine."""
    import blockspec.bench

    def refuse(*args, **kwargs):
        raise AssertionError("the benchmark started although its arguments were bad")
    monkeypatch.setattr(blockspec.bench, "build_engine", refuse)


QUICK = ["bench", "--synthetic", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt", "hi", "--max-tokens",
         "4", "--repeats", "1"]


def test_synthetic_target_is_quantized_as_built(tmp_path):
    """--target-quantization with --synthetic: each layer's projections are quantized as the layer is built, so the
    engine is handed them quantized (its target's loaded bytes are the final ones, below the dense model's)."""
    target = {}
    for quantization in ("none", "int4"):
        out = tmp_path / f"{quantization}.json"
        assert main([*QUICK, "--target-quantization", quantization, "--json-out", str(out)]) == 0
        target[quantization] = json.loads(out.read_text())["memory"]["none"]["target"]
    assert target["int4"]["loaded_bytes"] == target["int4"]["final_bytes"] < target["none"]["loaded_bytes"]


def test_output_paths_checked_before_the_run(tmp_path, capsys, monkeypatch, no_model_work):
    import types

    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))  # installed or not: the paths
    (tmp_path / "file").write_text("")
    fixtures = tmp_path / "fixtures.json"
    fixtures.write_text(json.dumps([{"name": "a", "prompt": "hi"}]))
    assert main([*QUICK[:-6], "--max-tokens", "4", "--repeats", "1", "--fixtures", str(fixtures), "--json-out",
                 str(fixtures)]) == 2
    err = capsys.readouterr().err
    assert f"--json-out {fixtures}: is the run's input --fixtures {fixtures}" in err and err.count("\n") == 1, err
    assert json.loads(fixtures.read_text()) == [{"name": "a", "prompt": "hi"}]
    for flag, path, needle in [("--json-out", tmp_path, "is a folder"),
                               ("--json-out", tmp_path / "file" / "r.json", "is a file, not a folder"),
                               ("--png-out", tmp_path / "file" / "sub" / "r.png", "is a file, not a folder")]:
        assert main([*QUICK, flag, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"blockspec: error: {flag} {path}: ") and needle in err and err.count("\n") == 1, err


def test_a_fixture_past_the_context_is_refused_before_any_is_measured(tmp_path, capsys):
    fixtures = tmp_path / "fixtures.json"
    fixtures.write_text(json.dumps([{"name": "short", "prompt": "hi"}, {"name": "long", "prompt": "word " * 600}]))
    out = tmp_path / "r.json"
    assert main([*QUICK[:-6], "--max-tokens", "4", "--repeats", "1", "--context-length", "256", "--fixtures",
                 str(fixtures), "--json-out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("blockspec: error: fixture 'long': ") and "context_length 256" in captured.err
    assert "short" not in captured.out and not out.exists(), captured.out  # no row measured


def test_json_out_into_missing_folders(tmp_path, capsys):
    out = tmp_path / "new" / "deeper" / "bench.json"
    assert main([*QUICK, "--json-out", str(out)]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["rows"][0]["fixture"] == "prompt"


def test_png_out_without_matplotlib_is_refused_before_the_run(tmp_path, capsys, monkeypatch, no_model_work):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert main([*QUICK, "--png-out", str(tmp_path / "charts" / "b.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--png-out needs matplotlib" in err and "pip install 'blockspec[plot]'" in err
    assert not (tmp_path / "charts").exists()  # refused before anything was made


@pytest.mark.parametrize("json_name, png_name, message", [
    (None, "b.txt", "--png-out .*b.txt: the chart is written as a PNG image; give a file name ending in .png"),
    ("same.png", "same.png", "--json-out and --png-out name the same file"),
])
def test_png_out_that_cannot_be_a_png_is_refused_before_the_run(tmp_path, capsys, monkeypatch, no_model_work,
                                                                json_name, png_name, message):
    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))  # as if it were installed
    (tmp_path / "same.png").write_text("kept")
    flags = ["--png-out", str(tmp_path / png_name)] + (["--json-out", str(tmp_path / json_name)] if json_name else [])
    assert main([*QUICK, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same.png"] and (tmp_path / "same.png").read_text() == "kept"


def test_results_survive_a_write_that_fails_after_the_run(tmp_path):
    """Should --json-out fail after all (the folder went away during the run), the results go to a temporary file
    named in the one-line error."""
    import argparse
    import re

    from blockspec.bench import save_results
    from blockspec.errors import BlockspecError

    (tmp_path / "gone").write_text("")  # a file where the folder was
    results = {"label": "x", "rows": [{"mode": "none"}]}
    args = argparse.Namespace(json_out=str(tmp_path / "gone" / "r.json"), png_out=None)
    with pytest.raises(BlockspecError) as info:
        save_results(results, args)
    message = str(info.value)
    assert message.startswith(f"--json-out {args.json_out}: ") and "\n" not in message
    rescued = re.search(r"saved to (\S+\.json)$", message).group(1)
    assert json.loads(Path(rescued).read_text()) == results
    Path(rescued).unlink()


def test_code_fixtures_and_one_cycle_acceptance(tmp_path, tiny_checkpoint, tiny_drafter):
    """A directory of source files as raw-text fixtures, and the one-cycle measure over cuts of their texts."""
    target = tiny_checkpoint(planted=True)
    code = tmp_path / "code"
    code.mkdir()
    for i in range(3):
        (code / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x + {j}\n" for j in range(40 * (i + 1))))
    out = tmp_path / "bench.json"
    code_ = main(["bench", "--model", str(target), "--drafter", str(tiny_drafter(target)), "--mode", "mtp,dflash2",
                  "--tree-budget", "0", "--fixtures", str(code), "--one-cycle", "6", "--max-tokens", "16", "--repeats",
                  "1", "--device", "cpu", "--dtype", "float32", "--temperature", "0.7", "--seed", "1", "--compare-greedy",
                  "--json-out", str(out)])
    assert code_ == 0
    result = json.loads(out.read_text())
    assert sorted({r["fixture"] for r in result["rows"]}) == ["m0", "m1", "m2"]
    assert sorted(result["one_cycle"]) == ["dflash2", "dflash2 sampled", "mtp", "mtp sampled"]
    for mode in ("mtp", "dflash2", "mtp sampled", "dflash2 sampled"):
        measured = result["one_cycle"][mode]
        assert measured["cuts"] == 6 and sum(measured["histogram"].values()) == 6
        assert 1 <= measured["mean_accepted_length"] <= (4 if mode.startswith("mtp") else 8)
    split = result["rows"][0]["repeats_split"]
    assert split["cycles"] > 0 and 1 <= split["mean_accepted_length"] <= 8


def test_one_cycle_measures_whole_texts_in_pieces_of_the_context(tiny_checkpoint):
    """A text longer than the context is measured whole: its contexts come from pieces of the context's length, each
    position of every piece equally likely, and a piece's trained marks are its own."""
    from blockspec.engine.engine import Engine
    from blockspec.train.evaluate import one_cycle_acceptance

    engine = Engine.load(str(tiny_checkpoint(planted=True)), mode="mtp", device="cpu", compute_dtype="float32",
                         context_length=64)
    longest = 64 - 2 * (engine.proposer.max_proposals + 1)
    text = [(7 * i) % 50 + 1 for i in range(5 * longest + 10)]  # five whole pieces and a short one
    prompts, generate = [], engine.generate
    engine.generate = lambda ids, *a, **k: prompts.append(list(ids)) or generate(ids, *a, **k)
    measured = one_cycle_acceptance(engine, [text], 60, seed=1)
    assert measured["cuts"] == 60 and len(prompts) == 60
    starts = set()
    for prompt in prompts:
        assert 1 <= len(prompt) < longest
        start = next(s for s in range(0, len(text), longest) if text[s:s + len(prompt)] == prompt)
        starts.add(start)
    assert len(starts) >= 5, starts  # the later pieces too, not only the text's first `longest` tokens
    # trained marks: only the last piece's positions 3.. are trained, so every context is cut there
    marks = [False] * 5 * longest + [False, False, False] + [True] * 7
    prompts.clear()
    one_cycle_acceptance(engine, [text], 8, seed=2, trained=[marks])
    assert {len(p) for p in prompts} <= set(range(3, 10)) and all(p == text[5 * longest:5 * longest + len(p)]
                                                                   for p in prompts), prompts


@pytest.mark.parametrize("mode", ["mtp", "dflash2"])
def test_one_cycle_reuses_each_prefix_and_measures_as_fresh_engines(tiny_checkpoint, tiny_drafter, mode):
    """The one-cycle measure runs its cuts by sequence and position, so that each prefill resumes from the cut before
    (engine/reuse.py): the same measure as an engine that prefills every cut from scratch (float32, exact)."""
    from blockspec.engine.engine import Engine
    from blockspec.train.evaluate import one_cycle_acceptance

    target = tiny_checkpoint(planted=True)
    drafter = {"dflash2_model": str(tiny_drafter(target)), "dflash2_tree_budget": 0} if mode == "dflash2" else {}
    sequences = [[(7 * i + 3 * j) % 50 + 1 for i in range(120)] for j in range(2)]

    def measure(prefix_reuse):
        engine = Engine.load(str(target), mode=mode, device="cpu", compute_dtype="float32", prefix_reuse=prefix_reuse,
                             **drafter)
        resumed = []
        if engine.prefix is not None:
            resume = engine.prefix.resume
            engine.prefix.resume = lambda prompt: resumed.append(resume(prompt)) or resumed[-1]
        return one_cycle_acceptance(engine, sequences, 12, seed=3), resumed

    reused, resumed = measure(True)
    fresh, _ = measure(False)
    assert reused == fresh and reused["cuts"] == 12
    assert sum(n > 0 for n in resumed) >= 8  # 12 cuts of 2 sequences: all but each sequence's first (and repeats)


def test_one_cycle_needs_real_weights(capsys):
    code = main(["bench", "--synthetic", "tiny", "--one-cycle", "5", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "--one-cycle" in err and err.count("\n") == 1, err


def test_one_cycle_refuses_texts_too_short_to_cut(tmp_path, capsys, tiny_checkpoint, no_model_work):
    """Fixtures whose texts hold fewer than two tokens leave no context to cut: one line, exit 2, before any engine
    is built (the measure itself raises a ValueError naming the reason, not an IndexError)."""
    from blockspec.train.evaluate import one_cycle_acceptance

    code = tmp_path / "code"
    code.mkdir()
    (code / "a.py").write_text("x")
    assert main(["bench", "--model", str(tiny_checkpoint(planted=True)), "--mode", "mtp", "--fixtures", str(code),
                 "--one-cycle", "5", "--device", "cpu", "--max-tokens", "4", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--one-cycle" in err and "two tokens" in err, err

    class Engine:  # what the measure reads before it cuts
        class proposer:
            max_proposals = 3
            tree_budget = 0

        class config:
            context_length = 64
    with pytest.raises(ValueError, match="no context to cut"):
        one_cycle_acceptance(Engine, [[5]], 3)


def test_repeat_split_counts_cycles_that_start_inside_a_repeat():
    from blockspec.train.evaluate import repeat_split, summarize_generations

    prompt = list(range(10))
    tokens = list(range(10)) * 2  # the generation repeats the prompt twice
    split = repeat_split(prompt, tokens, [0] * 9 + [9, 9])  # 9 single-token cycles, then two long ones
    # from the 8th single-token cycle on, the 8 tokens before a cycle repeat the prompt's
    assert split["elsewhere"] == [1] * 7 and split["in_repeats"] == [1, 1, 10, 10]
    assert split["distinct_8grams"] == 10 and split["8grams"] == 13
    summary = summarize_generations([split])
    assert summary["cycles"] == 11 and summary["mean_accepted_length_in_repeats"] == 5.5


def test_sampled_runs_beside_greedy_ones(tmp_path):
    """--compare-greedy: each mode greedy, then sampled; forced acceptance holds under sampling (the planted
    synthetic target is all but certain of its next token), so the sampled cycle is compared at the same acceptance;
    so does a draft tree's forced chain."""
    result, stdout = bench(tmp_path, "--prompt", "hello", "--mode", "none,dflash2", "--tree-budget", "0,8",
                           "--max-tokens", 24, "--repeats", 1, "--forced-acceptance", 0.5, "--temperature", 1,
                           "--top-k", 20, "--seed", 3, "--compare-greedy")
    assert "sampling temperature 1, top-k 20, seed 3" in result["label"]
    rows = result["rows"]
    assert [(r["mode"], r["sampling"]["temperature"]) for r in rows] == [
        ("none", 0.0), ("none", 1.0), ("dflash2", 0.0), ("dflash2", 1.0), ("dflash2:8", 0.0), ("dflash2:8", 1.0)]
    for row in rows[2:]:
        assert row["acceptance_rate"] == pytest.approx(0.5, abs=0.05), row
    assert "cost_vs_greedy" not in rows[0] and rows[1]["cost_vs_greedy"] > 0 and rows[3]["cost_vs_greedy"] > 0
    assert rows[3]["cycle_vs_plain_step"] > 0  # against the sampled plain step
    assert "x greedy" in stdout.splitlines()[1] and stdout.splitlines()[-1].split()[-2] == "sampled"


def test_multi_turn_bench_runs_on_the_cpu(tmp_path):
    """bench/multi_turn.py (the H200's prefix-reuse measurement) on the tiny preset: every turn after the first
    resumes the last one, with the same replies as without reuse (the script checks them)."""
    spec = importlib.util.spec_from_file_location("multi_turn", Path(__file__).parent.parent / "bench" / "multi_turn.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    summary = script.main(["--synthetic", "tiny", "--mode", "mtp", "--turns", "3", "--turn-tokens", "40",
                           "--reply-tokens", "8", "--device", "cpu", "--dtype", "float32",
                           "--json-out", str(tmp_path / "multi_turn.json")])
    turns = json.loads((tmp_path / "multi_turn.json").read_text())["turns"]
    assert [t["cached_tokens"] for t in turns] == [0, 47, 95] == [t["cached_tokens"] for t in summary["turns"]]
    assert summary["prefix_snapshots"]["bytes"] > 0


def test_fixtures_directory_without_text_files_is_refused_naming_the_flag(tmp_path, capsys):
    code = main(["bench", "--synthetic", "tiny", "--fixtures", str(tmp_path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and f"--fixtures {tmp_path}: no text files found" in err and err.count("\n") == 1, err


def test_tree_acceptance_bench_runs_on_the_cpu(tiny_checkpoint, tiny_drafter, tmp_path):
    """bench/tree_acceptance.py (the draft trees' acceptance on the trained pair) on the planted tiny pair: every
    budget measured on the same cuts, and a tree, which holds the chain, never accepts less than it; the
    generations' tokens/s of plain decoding and of each budget."""
    target = tiny_checkpoint(seed=0, planted=True)
    drafter = tiny_drafter(target, window=16, noise=1.0)
    spec = importlib.util.spec_from_file_location("tree_acceptance",
                                                  Path(__file__).parent.parent / "bench" / "tree_acceptance.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    summary = script.main(["--model", str(target), "--drafter", str(drafter), "--budgets", "0,4,12", "--cuts", "6",
                           "--context-length", "256", "--tokens-per-s", "4", "--rounds", "1",
                           "--json-out", str(tmp_path / "trees.json")])
    written = json.loads((tmp_path / "trees.json").read_text())["budgets"]
    lengths = [written[b]["mean_accepted_length"] for b in ("0", "4", "12")]
    assert [written[b]["cuts"] for b in ("0", "4", "12")] == [6, 6, 6]
    assert lengths == [summary["budgets"][b]["mean_accepted_length"] for b in (0, 4, 12)]
    assert 1.0 <= lengths[0] <= lengths[1] <= lengths[2], lengths
    measured = json.loads((tmp_path / "trees.json").read_text())["generations"]
    rates, per_cycle = measured["tokens_per_s"], measured["tokens_per_cycle"]
    assert sorted(rates) == ["0", "12", "4", "none"] and all(rate > 0 for rate in rates.values()), rates
    assert per_cycle["none"] == 1 and all(1 <= per_cycle[b] <= 4 for b in ("0", "4", "12")), per_cycle
    # the selector's scores / 4 order the tree (the same cuts: they leave room for the largest budget): the chain,
    # their argmax walk, accepts as before, and each tree holds it
    flat = script.main(["--model", str(target), "--drafter", str(drafter), "--budgets", "0,4,12", "--cuts", "6",
                        "--context-length", "256", "--score-temperature", "4"])
    assert flat["score_temperature"] == 4.0 and summary["score_temperature"] == 1.0
    flat_lengths = [flat["budgets"][b]["mean_accepted_length"] for b in (0, 4, 12)]
    assert flat_lengths[0] == lengths[0] and min(flat_lengths) == lengths[0], flat_lengths
    # each budget with and without a lookup branch of 4 (BUDGET+4), the chain once, on the same cuts
    looked = script.main(["--model", str(target), "--drafter", str(drafter), "--budgets", "0,12", "--lookup", "0,4",
                          "--cuts", "6", "--context-length", "256"])["budgets"]
    assert list(looked) == [0, 12, "12+4"] and looked[0]["mean_accepted_length"] == lengths[0], looked
    assert all(m["cuts"] == 6 for m in looked.values())
    from blockspec.kernels import drafter_tree  # the table the engine's tree build calls, tempered in the context
    g = torch.Generator().manual_seed(0)
    rows, k, rank, vocab = 3, 4, 5, 11
    inputs = (torch.randn(rows, k, generator=g), torch.randint(0, vocab, (rows, k), generator=g),
              torch.randn(rows, rank, generator=g), torch.tensor([2]), torch.randn(vocab, rank, generator=g),
              torch.randn(vocab, rank, generator=g))
    plain = drafter_tree.transition_table(*inputs)
    with script.tempered(4.0):
        tempered = drafter_tree.transition_table(*inputs)
    assert torch.allclose(tempered, torch.log_softmax(plain / 4, -1), atol=1e-6)
    assert not torch.allclose(tempered, plain) and torch.equal(drafter_tree.transition_table(*inputs), plain)


def test_profile_cycle_runs_on_a_checkpoint_pair(tiny_checkpoint, tiny_drafter, tmp_path):
    """bench/profile_cycle.py --model / --drafter (where a real pair's cycle goes, as the demo pair's on the H200): the
    pieces of the chain and of a draft tree timed and their kernels tabled, on the CPU; without --drafter, refused."""
    target = tiny_checkpoint(seed=0, planted=True)
    drafter = tiny_drafter(target, window=16, noise=1.0)
    script = Path(__file__).parent.parent / "bench" / "profile_cycle.py"
    env = {**__import__("os").environ, "OUT": str(tmp_path)}
    run = [sys.executable, str(script), "--dry-run", "--modes", "dflash2", "--model", str(target)]
    proc = subprocess.run([*run, "--drafter", str(drafter), "--tree-budget", "5"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = json.loads((tmp_path / "profile_cycle.json").read_text())
    timed = written["results"]["dflash2"]
    assert {"dflash2_propose_graph_ms", "tree_6_propose_graph_ms", "tree_6_pass_walk_commit_1_ms"} <= set(timed)
    assert written["kernels"]["dflash2 tree_6_pass_walk_commit_1_ms"]["kernels_per_call"] > 0
    refused = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "needs --drafter" in refused.stderr


def test_table_columns_fit_long_names_and_fixture_names_stay_whole(tmp_path):
    """The mode and fixture columns widen to the longest name (every value stays under its header), and a
    directory's files keep their whole stems, with the folder where two stems are alike."""
    from blockspec.bench import code_fixtures, format_header, format_row

    row = {"mode": "dflash2:32", "fixture": "a_rather_long_module_name", "decode_tokens_per_s": 12.5,
           "weight_gb_s": 1.0, "roofline_pct": None, "acceptance_rate": 0.5, "cycle_ms": 2.0,
           "cycle_vs_plain_step": 1.1, "generated": 4, "prefill_s": 0.1, "sampling": {"temperature": 0}}
    widths = {"mode": len(row["mode"]), "fixture": len(row["fixture"])}
    header, line = format_header(widths), format_row(row, widths)
    assert line.split()[:3] == ["dflash2:32", "a_rather_long_module_name", "12.50"]
    for column in ("tok/s", "accept", "x plain"):  # right-aligned: a value ends where its header ends
        end = header.index(column) + len(column)
        assert line[end - 1] != " " and line[end] == " ", (column, header, line)
    for folder in ("pkg_a", "pkg_b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("x = 1\n" * 50)
    (tmp_path / "pkg_a" / "a_rather_long_module_name.py").write_text("y = 2\n" * 50)
    names = sorted(f["name"] for f in code_fixtures(str(tmp_path)))
    assert names == ["a_rather_long_module_name", "pkg_a/__init__", "pkg_b/__init__"]


BAD_FIXTURES = [  # (file bytes, what the one-line refusal says after "fixtures file PATH: ")
    (b"\xff\xfe[]", "not UTF-8 text (byte 0)"),
    (b"{oops", "not valid JSON"),
    (b"[]", "the list is empty"),
    (b'{"name": "a", "prompt": "x"}', "expected a JSON list of"),
    (b"[1, 2]", "entry 0 is 1, not an object"),
    (b'[{"name": "a", "prompt": "x"}, {"name": "b"}]', "entry 1 has no 'prompt'"),
    (b'[{"prompt": "x"}]', "entry 0 has no 'name'"),
    (b'[{"name": "a", "prompt": 3}]', "entry 0 'prompt' must be a string, got 3"),
    (b'[{"name": 7, "prompt": "x"}]', "entry 0 'name' must be a string, got 7"),
    (b'[{"name": "a", "prompt": "x", "chat": "no"}]', "entry 0 'chat' must be a boolean"),
    (b'[{"name": "a", "prompt": ""}]', "entry 0 'prompt' is empty"),
    (b'[{"name": "a", "prompt": "x"}, {"name": "a", "prompt": "y"}]', "entry 1 'name' 'a' is also entry 0's"),
    (b'[{"name": "a", "prompt": "x", "promt": "y"}]', "entry 0: unknown key 'promt'"),
    (b'[{"name": "a", "prompt": "\\ud800"}]', "entry 0 'prompt': not valid UTF-8"),
]


@pytest.mark.parametrize("content,needle", BAD_FIXTURES)
def test_bad_fixtures_file_is_refused_naming_the_file_and_entry(tmp_path, capsys, no_model_work, content, needle):
    path = tmp_path / "fx.json"
    path.write_bytes(content)
    code = main(["bench", "--synthetic", "tiny", "--device", "cpu", "--fixtures", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"blockspec: error: fixtures file {path}: ") and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_fixtures_file_not_utf8_is_refused_without_a_traceback(tmp_path):
    """Through the console entry point: one line on stderr, exit 2."""
    path = tmp_path / "fx.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    proc = subprocess.run([sys.executable, "-m", "blockspec.cli", "bench", "--synthetic", "tiny", "--device", "cpu",
                           "--fixtures", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"blockspec: error: fixtures file {path}: not UTF-8 text (byte 0)\n"


def test_a_fixtures_folder_with_a_file_that_is_not_text_is_refused(tmp_path, capsys, no_model_work):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_bytes(b"x = 1\n\xff\xfe")
    code = main(["bench", "--synthetic", "tiny", "--device", "cpu", "--fixtures", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err == f"blockspec: error: --fixtures {tmp_path}: {tmp_path / 'b.py'} is not UTF-8 text " \
                                "(byte 6)\n", err


@pytest.mark.parametrize("args,needle", [
    (["--synthetic", "tiny", "--model", "{dir}"], "--model and --synthetic both given"),
    (["--synthetic", "tiny", "--drafter", "{dir}", "--mode", "dflash2"], "--drafter and --synthetic both given"),
    (["--synthetic", "tiny", "--prompt", "hi", "--fixtures", "stdlib"], "--prompt and --fixtures both given"),
    (["--synthetic", "tiny", "--prompt", ""], "--prompt is empty"),
    (["--synthetic", "tiny", "--fixtures", ""], "--fixtures is empty"),
    (["--model", "{dir}", "--drafter", "{dir}", "--mode", "none,mtp"], "--drafter is used by mode dflash2 only"),
    (["--model", "{dir}", "--mode", "none,dflash2"], "--mode dflash2 needs a drafter: give --drafter DIR"),
    (["--model", "{dir}", "--drafter", "{dir}/missing", "--mode", "dflash2"], "/missing: no such folder"),
    (["--model", "{dir}", "--drafter", "", "--mode", "none,dflash2"], "--drafter is empty"),
    (["--synthetic", "tiny", "--bandwidth", "0"], "--bandwidth must be a positive number of GB/s (got 0.0)"),
    (["--synthetic", "tiny", "--bandwidth", "-1"], "--bandwidth must be a positive number of GB/s (got -1.0)"),
    (["--synthetic", "tiny", "--bandwidth", "nan"], "--bandwidth must be a positive number of GB/s (got nan)"),
    (["--synthetic", "tiny", "--bandwidth", "inf"], "--bandwidth must be a positive number of GB/s (got inf)"),
    (["--synthetic", "tiny", "--mode", "none", "--forced-acceptance", "0.5"], "--forced-acceptance sets the "
     "acceptance of proposals"),
    (["--synthetic", "tiny", "--mode", "none", "--draft-vocabulary", "100"], "--draft-vocabulary 100 applies to "
     "mode mtp or dflash2 only"),
    (["--synthetic", "tiny", "--mode", "none,mtp", "--dflash2-block-size", "4"], "--dflash2-block-size 4 applies "
     "to mode dflash2 only"),
    (["--synthetic", "tiny", "--mode", "mtp", "--dflash2-quantization", "int8"], "--dflash2-quantization int8 "
     "applies to mode dflash2 only"),
    (["--synthetic", "tiny", "--mode", "none,mtp", "--tree-lookup", "4"], "--tree-lookup 4 applies to mode dflash2 "
     "only"),
    (["--synthetic", "tiny", "--mode", "dflash2", "--tree-budget", "0", "--tree-lookup", "4"], "--tree-lookup 4 "
     "gives nodes of a draft tree to a branch from the context, but --tree-budget is 0 (the chain)"),
])
def test_flags_that_would_be_ignored_or_meaningless_are_refused(tmp_path, capsys, no_model_work, args, needle):
    """A flag the run would silently ignore, or a figure it cannot use, is refused before any model work."""
    args = [a.replace("{dir}", str(tmp_path)) for a in args]
    code = main(["bench", "--device", "cpu", "--max-tokens", "4", "--repeats", "1", *args])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err, err
