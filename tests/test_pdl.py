"""kernels.pdl and the kernels' launch helpers on the CPU: the prefetch sizing, that nothing asks for PDL where it
cannot run, the engine's default level, the arrival counters' buffers (the GPU side, a PDL graph bitwise equal to
serial launches, is in test_cuda.py)."""

import pytest
import torch

from blockspec.kernels import pdl


def test_prefetch_blocks_sizes_to_the_budget():
    budget = 16 << 20
    for tile, programs, per_program in [(32768, 545, 20), (4096, 640, 24), (16384, 264, 3), (512, 10, 1000),
                                        (1 << 20, 1000, 8)]:
        blocks = pdl.blocks_for_budget(tile, programs, per_program, budget)
        assert blocks & (blocks - 1) == 0 and 1 <= blocks <= per_program
        if blocks > 1:  # never more than the budget, unless one tile per program already exceeds it
            assert blocks * tile * programs <= budget
        assert 2 * blocks > min(per_program, max(1, budget // (tile * programs)))  # the largest such
        assert pdl.blocks_for_budget(tile, programs, per_program, 0) == 0  # no PDL: no prefetch


def test_no_pdl_off_cuda():
    assert pdl.options(torch.zeros(1)) == {"PDL": 0}
    assert not pdl.enabled(torch.zeros(1))
    assert pdl.prefetch_blocks(4096, 100, 8, torch.device("cpu")) == 0


def test_settings_are_scoped_and_come_from_the_config(monkeypatch):
    """The launch settings an engine chooses hold only around its own work; nothing global, no environment."""
    from blockspec.config import PredictConfig
    from blockspec.errors import BlockspecError
    from blockspec.kernels import KernelSettings, active, use

    monkeypatch.setenv("BLOCKSPEC_PDL", "3")  # no longer read by anything
    assert active() == KernelSettings()
    with use(KernelSettings(pdl_level=3, fusion=True)) as chosen:
        assert active() is chosen
        with use(KernelSettings()):
            assert active().pdl_level == 0
        assert active() is chosen
        assert pdl.settings(torch.device("cpu")) == (0, 0)  # never on the CPU, whatever is asked
    assert active() == KernelSettings()
    with pytest.raises(BlockspecError, match="'pdl_level'"):
        PredictConfig.build({"pdl_level": 4})


def test_engine_default_level_follows_the_target_weights(tiny_checkpoint):
    """Unset, pdl_level is what each target's weights measured best with: 3 for INT4 and FP8, 0 (off) for bf16
    (docs/benchmarks.md); set, it is taken as given."""
    from blockspec.engine.engine import Engine

    directory = tiny_checkpoint()
    kw = dict(device="cpu", compute_dtype="float32", context_length=64)
    levels = {q: Engine.load(directory, target_quantization=q, **kw).kernels.pdl_level for q in ("none", "int4", "fp8")}
    assert levels == {"none": 0, "int4": 3, "fp8": 3}
    assert Engine.load(directory, target_quantization="fp8", pdl_level=2, **kw).kernels.pdl_level == 2


def test_outgrown_counters_stay_allocated():
    """A larger request replaces the per-device counter buffer; the old one stays allocated, since CUDA graphs
    recorded with it keep using it at every replay."""
    import weakref

    from blockspec import kernels

    device = torch.device("cpu")
    first = kernels.arrival_counters(device, 10)
    assert kernels.arrival_counters(device, 10) is first  # one buffer serves every launch
    alive = weakref.ref(first)
    del first
    bigger = kernels.arrival_counters(device, (1 << 16) + 1)
    assert bigger.numel() > 1 << 16 and int(bigger.abs().sum()) == 0
    assert alive() is not None and kernels.arrival_counters(device, 10) is bigger
