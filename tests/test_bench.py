"""`blockspec bench` on the tiny synthetic preset (CPU): output schema, fixtures, forced acceptance."""

import json
import subprocess
import sys

import pytest

from blockspec.cli import main


def bench(tmp_path, *args):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "blockspec.cli", "bench", "--synthetic", "tiny", "--device", "cpu",
                           "--dtype", "float32", "--json-out", str(out), *map(str, args)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_schema_default_fixtures_and_forced_rates(tmp_path):
    rates = [0.553, 0.297, 0.516]
    result, stdout = bench(tmp_path, "--mode", "none,mtp,dflash2", "--max-tokens", 64, "--repeats", 2,
                           "--forced-acceptance", ",".join(map(str, rates)))
    assert "SYNTHETIC" in result["label"] and "FORCED" in result["label"] and "SYNTHETIC" in stdout
    assert {"device", "bytes_per_plain_step", "rows", "max_tokens", "repeats"} <= set(result)
    assert result["bytes_per_plain_step"] > 0
    rows = result["rows"]
    assert [(r["mode"], r["fixture"]) for r in rows] == [
        (m, f) for m in ("none", "mtp", "dflash2") for f in ("code", "english", "translation")]
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
    (["--synthetic", "tiny", "--forced-acceptance", "1.5"], "--forced-acceptance"),
    (["--synthetic", "tiny", "--forced-acceptance", "0.1,0.2"], "one per fixture"),
    (["--model", "/nonexistent", "--forced-acceptance", "0.5"], "needs --synthetic"),
    (["--synthetic", "tiny", "--fixtures", "/nonexistent.json"], "fixtures file"),
])
def test_bad_bench_arguments(capsys, args, needle):
    code = main(["bench", "--device", "cpu", "--max-tokens", "4", "--repeats", "1", *args])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1, err
