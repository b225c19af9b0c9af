"""The few-row dense matmul kernel (kernels/linear_triton.py) against F.linear in float32, through the Triton
interpreter in a subprocess: both inner products (MMA tiles of 8 to 64 rows, CUDA-core row), with and without
split-K (the last program of a tile adds the partials; counters left clean), odd K and N; the config table; the module
wrapper."""

import json
import os
from dataclasses import replace

import torch
from helpers import patch_triton_interpreter, run_in_triton_interpreter

from blockspec import kernels
from blockspec.kernels import linear_triton
from blockspec.kernels.linear_triton import LinearConfig, linear_rows
from blockspec.layers.linear import DenseLinear

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
        assert linear_triton.default_config(m, 34816, 5120).sync is False
        assert linear_triton.default_config(m, 5120, 17408).sync is False
        assert linear_triton.default_config(m, 5120, 6144) is None
    for m in (33, 64):  # above 32 rows only gdn in and attention qkv beat cuBLAS
        assert linear_triton.default_config(m, 34816, 5120) is None
        assert linear_triton.default_config(m, 5120, 17408) is None
        assert linear_triton.default_config(m, 16480, 5120).sync is False
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


def test_mma_sync_switch_is_set_only_while_a_variant_first_compiles(monkeypatch):
    """launch_fitting(mma_sync=True) sets DISABLE_MMA_V3 (Triton's only switch for mma.sync, read when it compiles)
    around the first launch of each compiled variant only: not on later launches of it, again for a new
    specialisation (an integer's divisibility by 16, a tensor's dtype), never for mma_sync=False, and a user's own
    value is given back."""
    from blockspec import kernels

    seen = []

    class Kernel:  # stands in for a Triton kernel: records the switch at each launch
        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append(os.environ.get("DISABLE_MMA_V3"))

    kernel = Kernel()
    monkeypatch.setenv("DISABLE_MMA_V3", "user")
    for n in (16, 16, 17, 32):
        kernels.launch_fitting(kernel, (1,), torch.zeros(2), n, mma_sync=True, BM=8)
    kernels.launch_fitting(kernel, (1,), torch.zeros(2, dtype=torch.float64), 16, mma_sync=True, BM=8)
    kernels.launch_fitting(kernel, (1,), torch.zeros(2), 48, mma_sync=False, BM=8)
    assert seen == ["1", "user", "1", "user", "1", "user"], seen
    assert os.environ["DISABLE_MMA_V3"] == "user"
