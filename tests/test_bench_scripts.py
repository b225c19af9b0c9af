"""Every script in bench/ runs: the H200 measurements' CPU dry runs (tiny shapes, the Triton kernels in the
interpreter, timers run once), all in one interpreter subprocess (one start of Python, torch and Triton), each
script as `python bench/SCRIPT.py ARGS` with its own $OUT; each test asserts on what its script wrote. Scripts run
by other test modules are named in ELSEWHERE, and a script in neither fails `test_every_bench_script_has_a_dry_run`."""

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import interpreter_part, patch_triton_interpreter, report_parts, run_in_triton_interpreter

BENCH = Path(__file__).resolve().parent.parent / "bench"
HELPER_MODULES = {"timing"}  # imported by the scripts, measures nothing
DRY_RUNS = {  # script: its arguments ({out}: its $OUT)
    "attention_kernels": ["--dry-run"],
    "norm_kernel": ["--dry-run"],
    "linear_kernels": ["--dry-run"],
    "gdn_kernel": ["--dry-run"],  # its tree part's dry run: test_tree_gdn_kernel.py
    "fp8_kernels": ["--dry-run"],
    "kernel_schedules": ["--dry-run"],
    "persistent_mlp": ["--dry-run"],
    "tma_stream": ["--dry-run"],
    "quant_kernels": [],  # TRITON_INTERPRET=1 alone is its dry run
    "drafter_training": ["--preset", "tiny", "--seq-len", "64", "--batch-tokens", "64", "--steps", "1",
                         "--profile", "5", "--json-out", "{out}/drafter_training.json"],
    "profile_cycle": ["--dry-run", "--modes", "mtp,dflash2"],
    "cycle_trace": ["--dry-run"],
    "cpu_recurrence": ["--dry-run"],
    # GraphedTarget's CUDA graphs have no CPU path: their imports and their argument check only
    "step_variants": ["--variants", "no such variant"],
    "launch_timeline": ["--variants", "no such variant"],
}
# no Triton on the CPU: PyTorch's paths, as on a machine without CUDA (not interpreted)
NATIVE = {"drafter_training", "profile_cycle", "cycle_trace", "cpu_recurrence"}
ELSEWHERE = {"checkpoint_loading": "test_checkpoint_loading.py", "drafter_scaling": "test_train.py",
             "train_step": "test_train.py", "drafter_recipes": "test_train.py",
             "multi_turn": "test_bench.py", "tree_acceptance": "test_bench.py",
             "warp_specialized": "test_quant_matmul_gluon.py"}


def _dry_run(script):
    """In the interpreter subprocess: runs bench/SCRIPT.py as __main__ with its DRY_RUNS arguments, stdout captured;
    its exit code, stdout's and stderr's ends, the JSON files it wrote under its $OUT and its seconds."""
    import contextlib
    import io
    import runpy
    import tempfile
    import time

    out = tempfile.mkdtemp(prefix=f"{script}-")
    path = str(BENCH / f"{script}.py")
    argv, sys.argv = sys.argv, [path, *(arg.format(out=out) for arg in DRY_RUNS[script])]
    os.environ["OUT"], stdout, stderr, code, start = out, io.StringIO(), io.StringIO(), 0, time.perf_counter()
    if script in NATIVE:  # read at each call (blockspec.kernels.triton_runs_on)
        del os.environ["TRITON_INTERPRET"]
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:  # quant_kernels exits with its verdict, a refused argument with 2
        code = stop.code
    finally:
        sys.argv = argv
        os.environ["TRITON_INTERPRET"] = "1"
    return {"exit": code, "stdout": stdout.getvalue()[-3000:], "stderr": stderr.getvalue()[-3000:],
            "seconds": round(time.perf_counter() - start, 1),
            "json": {f.name: json.loads(f.read_text()) for f in Path(out).glob("*.json")}}


@pytest.fixture(scope="module")
def dry_runs(request):
    """The dry runs of the scripts whose tests this session runs (after -k / -m)."""
    scripts = [item.callspec.params["script"] for item in request.session.items
               if item.module is request.module and item.originalname == "test_dry_run"]
    return run_in_triton_interpreter(__file__, *scripts)


def _max_errors(rows, key):
    return [row[key] for row in rows.values()]


def _refused(run):
    return run["exit"] == 2 and run["stderr"].startswith("unknown variant 'no such variant'; the variants: mixer BV")


CHECKS = {  # script: what its dry run must have written (the JSON files under its $OUT)
    "attention_kernels": lambda out: (
        sorted(out["attention_kernels.json"]) == sorted(
            [f"capacity=128 filled=100 T={t} {name}" for t in (1, 8) for name in ("sdpa", "triton")]
            + [f"capacity=128 filled=100 tree={t} {name}" for t in (16, 24)
               for name in ("triton", "triton row blocks")])
        and max(_max_errors(out["attention_kernels.json"], "max_err")) < 1e-5),
    "norm_kernel": lambda out: sorted(out["norm_kernel.json"]) == sorted(
        f"rows={rows} warps={warps}{' (default)' if warps == 16 else ''}" for rows in (1, 8) for warps in (1, 16)),
    "linear_kernels": lambda out: (
        sorted(out["linear_kernels.json"]) == ["tiny M=1", "tiny M=8"]
        and max(_max_errors(out["linear_kernels.json"], "max_err")) < 1e-5),
    "gdn_kernel": lambda out: (
        sorted(out["gdn_kernel.json"]) == sorted(
            f"T={t} {name}" for t in (1, 8) for name in ("conv BLOCK_C=64 warps=1", "recurrence BLOCK_V=8 warps=1",
                                                         "mixer, three launches", "mixer, one launch BLOCK_V=8 warps=1"))
        and max(_max_errors(out["gdn_kernel.json"], "max_err")) < 1e-5),
    "fp8_kernels": lambda out: (
        sorted(out["fp8_kernels.json"]) == ["tiny M=1", "tiny M=16"]
        and max(_max_errors(out["fp8_kernels.json"], "fp8_relative_err")
                + _max_errors(out["fp8_kernels.json"], "fp8_plain_relative_err")) < 1e-4),
    "kernel_schedules": lambda out: (
        [(r.get("kind"), r.get("shape")) for r in out["kernel_schedules.json"][1:]]
        == [("fp8", "tiny"), ("int4", "tiny"), ("fp8", "gate_up rows 136")]
        and all(r[v]["max_diff"] < 1e-4 for r in out["kernel_schedules.json"][1:3] for v in ("default", "unbalanced"))),
    "persistent_mlp": lambda out: (
        sorted(out["persistent_mlp.json"]["rows"]) == ["12"]
        and all(r["persistent_rel_err"] < 1e-5 and r["persistent_rel_err_after"] < 1e-5 and r["sync_left_zero"]
                and {"engine", "persistent", "stream-only"} <= set(r)
                for r in out["persistent_mlp.json"]["rows"].values())),
    "tma_stream": lambda out: (
        [(name, sorted(shape["rows"])) for name, shape in out["tma_stream.json"]["shapes"].items()]
        == [("tiny", ["1", "12"]), ("tiny long", ["12"])]
        and all(row[label]["equal"] and row[label]["us"] > 0 and row["engine"]["us"] > 0
                for shape in out["tma_stream.json"]["shapes"].values() for row in shape["rows"].values()
                for label in ("tma", "tma scales"))
        and all(row["x once"]["bound"] and row["x once"]["us"] > 0
                for shape in out["tma_stream.json"]["shapes"].values() for row in shape["rows"].values())),
    "quant_kernels": lambda out: (
        out["quant_kernels.json"]["production_failures"] == out["quant_kernels.json"]["alternative_failures"] == []
        and len(out["quant_kernels.json"]["checks"]) > 20 and all(c["ok"] for c in out["quant_kernels.json"]["checks"])
        and all(r["rel_err"] < 1e-2 and r["graph_equal"] for r in out["quant_kernels.json"]["records"])),
    "drafter_training": lambda out: (
        out["drafter_training.json"]["steps"] == 1 and out["drafter_training.json"]["block_rows_per_step"] == 64),
    "profile_cycle": lambda out: (
        set(out["profile_cycle.json"]["results"]) >= {"mtp", "dflash2"}
        and "verify_8_commit_8_ms" in out["profile_cycle.json"]["results"]["dflash2"]
        and out["profile_cycle.json"]["kernels"]["mtp mtp_observe_4_chain_3_graph_ms"]["kernels_per_call"] > 0),
    "cycle_trace": lambda out: (
        sorted(out["cycle_trace.json"]["results"]) == ["0", "15"]
        and all(r["tokens_per_s"] > 0 and r["profiled"]["cycles"] >= 1 and r["profiled"]["by_kernel_us"]
                for r in out["cycle_trace.json"]["results"].values())
        and "host_us DecodeState.commit_path" in out["cycle_trace.json"]["results"]["15"]["profiled"]
        and out["cycle_trace.json"]["results"]["15"]["unprofiled"]["host_us DecodeState.commit_path"] > 0),
    "cpu_recurrence": lambda out: (
        sorted(out["cpu_recurrence.json"]) == ["1", "2", "3", "40", "8"]
        and [r["engine"] for r in out["cpu_recurrence.json"].values()]
        == ["token by token", "token by token", "chunks of 3", "chunks of 8", "chunks of 32"]
        and max(v for r in out["cpu_recurrence.json"].values() for key, v in r.items() if key.endswith("max_err"))
        < 1e-5),
}
REFUSED = {"step_variants", "launch_timeline"}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(DRY_RUNS))
def test_dry_run(dry_runs, script):
    run = interpreter_part(dry_runs, script)
    assert _refused(run) if script in REFUSED else run["exit"] == 0 and CHECKS[script](run["json"]), run


def test_persistent_mlp_compiles_for_hopper():
    """The persistent MLP's launch compiles for sm_90 at the 27B's shapes (its dry run checks its results in the
    interpreter): the queue's atomics, the L2 prefetch, the wait's back-off, mma.sync at 8 rows and wgmma at 16, and
    the time stamps only where asked for."""
    pytest.importorskip("triton")
    from helpers import sm90_ptx

    sys.path.insert(0, str(BENCH))
    import persistent_mlp

    from blockspec.kernels.unpack_ptx import unpack_asm

    pointers = {"x_ptr": "*bf16", "gq": "*i16", "gs": "*bf16", "dq": "*i16", "ds": "*bf16", "h_ptr": "*bf16",
                "out_ptr": "*bf16", "partial_ptr": "*fp32", "sync": "*i32", "stamps": "*i64"}
    for rows, instruction, stamps, split in ((8, "mma.sync", False, 4), (16, "wgmma", False, 1),
                                             (8, "mma.sync", True, 8)):
        constants = dict(H=5120, I=17408, G=128, BM=rows, BN_G=64, BN_D=32, SPLIT=split, STAGES=3, ASM=True,
                         WAIT=True, PREFETCH=2, STAMPS=stamps, **{f"U{i}": unpack_asm(4, i, False) for i in range(4)})
        ptx = sm90_ptx(persistent_mlp._mlp_kernel, constants, 4, 3, pointers)
        assert instruction in ptx and "atom.global" in ptx and "prefetch.global.L2" in ptx and "nanosleep" in ptx, rows
        assert ("%globaltimer" in ptx) == stamps, rows


def test_tma_stream_compiles_for_hopper():
    """bench/tma_stream.py's kernel compiles for sm_90 (its dry run checks its results in the interpreter): the codes
    (and scales) through TMA bulk copies, mma.sync at 8 rows, wgmma at 16, two 8-row dots (mma.sync) for down."""
    pytest.importorskip("triton")
    from helpers import sm90_ptx

    sys.path.insert(0, str(BENCH))
    import tma_stream

    from blockspec.kernels.unpack_ptx import unpack_asm

    pointers = {"x_ptr": "*bf16", "q_desc": "tensordesc<i16[64,128]>", "s_ptr": "*bf16",
                "s_desc": "tensordesc<bf16[1,256]>", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    for rows, halves, scale_desc, stages, instruction in ((8, 1, False, 2, "mma.sync"), (16, 1, True, 3, "wgmma"),
                                                          (16, 2, False, 3, "mma.sync")):
        constants = dict(G=128, BN=64, BM=rows, STAGES=stages, ASM=True, F32DOT=False, HALVES=halves,
                         SCALE_DESC=scale_desc, WS=False, X_ONCE=False,
                         **{f"U{i}": unpack_asm(4, i, False) for i in range(4)})
        ptx = sm90_ptx(tma_stream._tma_kernel, constants, 4, stages, pointers)
        assert "cp.async.bulk.tensor.2d" in ptx and instruction in ptx, (rows, halves)


def test_every_bench_script_has_a_dry_run():
    """A script added to bench/ without a dry run here or in another test module fails; so does a test module that
    no longer names the script it is said to run."""
    scripts = {path.stem for path in BENCH.glob("*.py")} - HELPER_MODULES
    assert scripts == set(DRY_RUNS) | set(ELSEWHERE) and set(DRY_RUNS).isdisjoint(ELSEWHERE), scripts
    tests = Path(__file__).parent
    for script, module in ELSEWHERE.items():
        assert f'"{script}.py"' in (tests / module).read_text(), (script, module)


if __name__ == "__main__":  # python test_bench_scripts.py SCRIPT..., with TRITON_INTERPRET=1
    sys.path.insert(0, str(BENCH))  # the scripts' `timing` import
    patch_triton_interpreter()
    # the native ones last: Triton's jit reads TRITON_INTERPRET when a module is first imported
    scripts = sorted(sys.argv[1:], key=lambda script: script in NATIVE)
    report_parts({script: lambda script=script: _dry_run(script) for script in DRY_RUNS}, scripts)
