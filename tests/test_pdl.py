"""kernels.pdl on the CPU: the prefetch sizing and that nothing asks for PDL where it cannot run (the GPU side, a
PDL graph bitwise equal to serial launches, is in test_cuda.py)."""

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


def test_bad_environment_is_one_line(monkeypatch):
    from blockspec.errors import BlockspecError

    monkeypatch.setenv("BLOCKSPEC_PDL", "fast")
    pdl.reset()
    try:
        with pytest.raises(BlockspecError, match="BLOCKSPEC_PDL='fast'"):
            pdl.settings(torch.device("cpu"))
    finally:
        monkeypatch.delenv("BLOCKSPEC_PDL")
        pdl.reset()
