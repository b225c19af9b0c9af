"""kernels.pdl on the CPU: the prefetch sizing and that nothing asks for PDL where it cannot run (the GPU side, a
PDL graph bitwise equal to serial launches, is in test_cuda.py)."""

import torch

from blockspec.kernels import pdl


def test_prefetch_blocks_sizes_to_the_budget():
    cpu = torch.device("cpu")
    for tile, programs, per_program in [(32768, 545, 20), (4096, 640, 24), (16384, 264, 3), (512, 10, 1000),
                                        (1 << 20, 1000, 8)]:
        blocks = pdl.prefetch_blocks(tile, programs, per_program, cpu)
        assert blocks & (blocks - 1) == 0 and 1 <= blocks <= per_program
        if blocks > 1:  # never more than the budget, unless one tile per program already exceeds it
            assert blocks * tile * programs <= pdl.PREFETCH_BYTES
        assert 2 * blocks > min(per_program, max(1, pdl.PREFETCH_BYTES // (tile * programs)))  # the largest such


def test_no_pdl_off_cuda():
    assert pdl.options(torch.zeros(1)) == {"PDL": False}
    assert not pdl.enabled(torch.zeros(1))
