"""The few-row dense matmul kernel (kernels/linear_triton.py) against F.linear in float32, through the Triton
interpreter in a subprocess: both inner products (MMA tiles of 8 to 64 rows, CUDA-core row), with and without
split-K (the last program of a tile adds the partials; counters left clean), odd K and N; the config table; the module
wrapper."""

import json
from dataclasses import replace

import pytest
import torch
from helpers import patch_triton_interpreter, run_in_triton_interpreter, sm90_ptx

from blockspec import kernels
from blockspec.kernels import linear_triton
from blockspec.kernels.linear_triton import LinearConfig, linear_rows
from blockspec.kernels.unpack_ptx import unpack_asm
from blockspec.layers.linear import DenseLinear

# the pointer arguments of the W4A16 and few-row bf16 kernels as a launch with bf16 activations passes them
BF16_POINTERS = {"x_ptr": "*bf16", "q_ptr": "*i16", "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16",
                 "ws_ptr": "*fp32", "cnt_ptr": "*i32", "res_ptr": "*bf16", "nw_ptr": "*bf16", "rows_ptr": "*bf16",
                 "part_ptr": "*fp32", "eps": "fp32", "x": "*bf16", "w": "*bf16", "out": "*bf16", "ws": "*fp32",
                 "counters": "*i32"}
CASES = [  # rows, N, K, config (sms = 4 in the interpreter: waves * 4 programs before K is split)
    (1, 50, 300, LinearConfig(16, 64, False, waves=1)), (1, 50, 256, LinearConfig(16, 64, True, waves=4)),
    (5, 70, 200, LinearConfig(32, 32, True, waves=1)), (8, 33, 128, LinearConfig(16, 32, True, waves=2)),
    (12, 40, 96, LinearConfig(16, 32, True, waves=8)), (1, 17, 1000, LinearConfig(16, 128, False, waves=8)),
    (1, 45, 520, LinearConfig(8, 256, False, waves=1)),
    # draft trees' passes: 32- and 64-row tiles, rows past M masked
    (17, 40, 96, LinearConfig(16, 32, True, waves=8)), (33, 30, 130, LinearConfig(16, 64, True, waves=1)),
    (64, 24, 200, LinearConfig(32, 32, True, waves=2)),
]


def _run_cases():  # executed in a subprocess with TRITON_INTERPRET=1
    patch_triton_interpreter()
    results = []
    for m, n, k, cfg in CASES:
        g = torch.Generator().manual_seed(m * n + k)
        x, w = torch.randn(m, k + 3, generator=g)[:, :k], torch.randn(n, k, generator=g)  # strided rows
        split = linear_triton.split_blocks(-(-n // cfg.block_n), -(-k // cfg.block_k), cfg.waves * 4)[0]
        y = linear_rows(x, w, cfg, sms=4)
        results.append({"case": [m, n, k, cfg.short()], "err": float((y - x @ w.t()).abs().max()), "split": split,
                        "counters_clean": int(kernels._COUNTERS[("cpu", None)].abs().sum()) == 0})
    print("RESULTS " + json.dumps(results))


def test_linear_kernel_matches_reference_in_interpreter():
    results = run_in_triton_interpreter(__file__)
    assert len(results) == len(CASES)
    for r in results:
        assert r["err"] < 1e-4 and r["counters_clean"], r
    assert max(r["split"] for r in results) > 1 and min(r["split"] for r in results) == 1  # both paths exercised


def test_default_configs_follow_the_measured_table():
    assert linear_triton.default_config(1, 5120, 17408).dot is False  # down, one row: CUDA-core row dot
    assert linear_triton.default_config(8, 5120, 17408).dot is True
    assert linear_triton.default_config(1, 34816, 5120).waves == 1    # gate_up: no split
    assert linear_triton.default_config(1, 5120, 6144).block_n == 8   # o / gdn out, one row: 8-row tiles
    assert linear_triton.default_config(8, 5120, 6144) is None        # o / gdn out, 8 rows: cuBLAS
    for m in (9, 17, 32):  # a tree's rows: wgmma, but onto o / gdn out
        assert linear_triton.default_config(m, 34816, 5120).dot is True
        assert linear_triton.default_config(m, 5120, 17408).dot is True
        assert linear_triton.default_config(m, 5120, 6144) is None
    for m in (33, 64):  # above 32 rows only gdn in and attention qkv beat cuBLAS
        assert linear_triton.default_config(m, 34816, 5120) is None
        assert linear_triton.default_config(m, 5120, 17408) is None
        assert linear_triton.default_config(m, 16480, 5120).dot is True
    assert linear_triton.default_config(65, 16480, 5120) is None      # prefill chunks: cuBLAS
    assert linear_triton.default_config(1, 248320, 5120) is None      # vocabulary head: cuBLAS


def test_dense_linear_shares_weights_and_matches_nn_linear_on_cpu():
    torch.manual_seed(0)
    original = torch.nn.Linear(24, 10, bias=True)
    wrapped = DenseLinear.wrap(original)
    assert wrapped.weight is original.weight and wrapped.bias is original.bias
    x = torch.randn(3, 24)
    assert torch.equal(wrapped(x), original(x))  # CPU float32: F.linear, bit for bit


if __name__ == "__main__":
    _run_cases()


def test_configs_that_do_not_fit_shared_memory_keep_cublas(monkeypatch):
    """The H200's configs need up to ~110 KB of shared memory; a card with ~100 KB per block (consumer Ampere / Ada)
    keeps F.linear instead of failing to launch."""
    gpu = torch.device("cuda", 0)
    wide = linear_triton.default_config(8, 34816, 5120)
    monkeypatch.setattr(linear_triton, "_shared_memory", lambda device: 227 * 1024)  # H100 / H200
    assert linear_triton.fits(wide, 8, gpu)
    monkeypatch.setattr(linear_triton, "_shared_memory", lambda device: 99 * 1024)  # RTX 4090
    assert not linear_triton.fits(wide, 8, gpu)
    assert linear_triton.fits(linear_triton.default_config(1, 5120, 17408), 1, gpu)  # the one-row dot: 40 KB
    monkeypatch.setattr(linear_triton, "_shared_memory", lambda device: 227 * 1024)
    assert linear_triton.fits(wide, 64, gpu)  # the 64-row x tile: 192 KB
    assert not linear_triton.fits(replace(wide, stages=4), 64, gpu)  # 256 KB
    assert linear_triton.fits(replace(wide, stages=4), 8, gpu)  # 144 KB: the x tile counts
    assert linear_triton.fits(wide, 8, torch.device("cpu"))  # the interpreter has no such limit


@pytest.mark.skipif(not kernels.TRITON_INSTALLED, reason="needs triton")
def test_wide_steps_unroll_their_blocks_on_hopper():
    """A main-loop step of 2 or 4 K blocks (blocks_per_step; int8 group 32, the drafter's gate_up at 8 rows)
    compiles for sm_90 to that many blocks' dots a step, mma.sync as one block's, and its loads stay in Triton's
    cp.async pipeline (compiled as a launch specializes the 27B's shapes: multiples of 16)."""
    from blockspec.kernels import quant_matmul_triton as wq

    cfg = wq.default_config(8, 34816, 5120, 8, 32)
    unpack = {f"U{i}": unpack_asm(8, i, False) if i < 2 else "" for i in range(4)}
    dots = {}
    for wide in (1, 2, 4):
        const = dict(BITS=8, G=32, BN=cfg.block_n, BM=cfg.block_m, STAGES=cfg.stages, HAS_ZP=False, EVEN_K=True,
                     USE_ASM=True, F32DOT=False, PREFETCH=0, PDL=0, EPI=0, RMS=False, PBLOCK=1, E4M3=False,
                     HALVES=1, WIDE=wide, **unpack)
        ptx = sm90_ptx(wq._wq_kernel, const, cfg.warps, cfg.stages, BF16_POINTERS,
                       aligned=("N", "K", "KH", "stride_xm", "stride_om"))
        assert "wgmma" not in ptx and "cp.async" in ptx, wide
        dots[wide] = ptx.count("mma.sync")
    assert dots[1] > 0 and dots[2] == 2 * dots[1] and dots[4] == 4 * dots[1], dots


@pytest.mark.skipif(not kernels.TRITON_INSTALLED, reason="needs triton")
def test_mma_instruction_follows_the_rows():
    """Both few-row kernels leave the choice of tensor-core instruction to Triton, which compiles an 8-row x tile
    (decode, a chain's verification: the weight tile times 8 columns) to mma.sync and taller ones (a draft tree's
    pass) to Hopper's wgmma, unless the config splits the tile into 8-row dots (dot_rows: the 16-row down). A Triton that chose otherwise would change the measured speed of every step: caught
    here, on the CPU, for the default configs of the 27B's gate_up."""
    from blockspec.kernels import quant_matmul_triton as wq

    for rows, instruction in ((8, "mma.sync"), (16, "wgmma"), (17, "wgmma")):
        for n, k in ((34816, 5120), (5120, 17408)) if rows == 16 else ((34816, 5120),):
            cfg = wq.default_config(rows, n, k)
            const = dict(BITS=4, G=128, BN=cfg.block_n, BM=cfg.block_m, STAGES=cfg.stages, HAS_ZP=False,
                         EVEN_K=True, USE_ASM=True, F32DOT=False, PREFETCH=0, PDL=0, EPI=0, RMS=False, PBLOCK=1,
                         E4M3=False, HALVES=cfg.block_m // (cfg.dot_rows or cfg.block_m), WIDE=1,
                         **{f"U{i}": unpack_asm(4, i, False) for i in range(4)})
            ptx = sm90_ptx(wq._wq_kernel, const, cfg.warps, cfg.stages, BF16_POINTERS)
            expect = "mma.sync" if cfg.dot_rows == 8 else instruction  # down's 16-row tile as two 8-row dots
            assert expect in ptx and ("wgmma" if expect == "mma.sync" else "mma.sync") not in ptx, (rows, cfg)
        lin = linear_triton.default_config(rows, 34816, 5120)
        const = dict(BN=lin.block_n, BK=lin.block_k, BM=linear_triton.block_rows(lin, rows), STAGES=lin.stages,
                     DOT=True, EVEN_K=True, F32DOT=False, PREFETCH=0, LINE=64, PDL=0)
        ptx = sm90_ptx(linear_triton._linear_kernel, const, lin.warps, lin.stages, BF16_POINTERS)
        assert instruction in ptx and ("wgmma" if instruction == "mma.sync" else "mma.sync") not in ptx, (rows, lin)
