"""The CUDA W4A16 kernel's weight layout, checked on the CPU by emulating what each lane hands to mma.m16n8k16.

The emulator follows the PTX fragment definitions (A: register i of lane 4g + t holds row g + 8 (i & 1), columns
2t + 8 (i >> 1) + {0, 1}; B: register r holds rows 2t + 8r + {0, 1} of column g; D: rows g, g + 8, columns 2t +
{0, 1}) and the kernel's loads (word j of the lane's 16-byte load per chunk; x words 2j, 2j + 1 of the 16 inputs
64c + 16t .. at its row), so a layout that disagrees with the kernel's reading of it fails here without a GPU.
The kernel itself is checked on CUDA (tests/test_cuda.py, bench/w4a16_cuda.py).
"""

import pytest
import torch

from blockspec.quant import w4a16_cuda as wc
from blockspec.quant import w4a16_triton as wq


def _random(n, k, zp, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // 128, generator=g) * 0.015 + 0.005).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // 128), generator=g).to(torch.bfloat16) if zp else None
    return codes, scales, zeros


def _bf16_pair(word: torch.Tensor, high: bool) -> torch.Tensor:
    bits = (word >> 16) & 0xFFFF if high else word & 0xFFFF
    return (bits.to(torch.int32) << 16).view(torch.float32)


def emulate(x: torch.Tensor, mw: wc.MmaWeight) -> torch.Tensor:
    """What the kernel computes, lane by lane, in fp32 (summation order aside)."""
    s_n, c_n = mw.n // 16, mw.k // 64
    words = mw.qw.to(torch.int64) & 0xFFFFFFFF                      # [s, c, lane, j]
    sc = mw.sc.to(torch.int64) & 0xFFFFFFFF                          # [s, group, g]
    zc = None if mw.zc is None else mw.zc.to(torch.int64) & 0xFFFFFFFF
    a = torch.zeros(s_n, c_n, 4, 16, 16)                             # A of MMA j of chunk c: [row, col]
    part_rows = torch.zeros(s_n, c_n // 2, 16)                        # scale of each row of each group
    for g in range(8):
        for hr in range(2):
            scale = _bf16_pair(sc[:, :, g], hr == 1)                  # [s, group]
            part_rows[:, :, g + 8 * hr] = scale
            z = -136.0 if zc is None else _bf16_pair(zc[:, :, g], hr == 1)
            zz = z if zc is None else z.repeat_interleave(2, dim=1)[:, :, None]   # per chunk
            for t in range(4):
                w = words[:, :, 4 * g + t, :]                          # [s, c, j]
                for i in (hr, hr + 2):
                    for e in range(2):
                        nib = ((w >> (4 * (i + 4 * e))) & 0xF).to(torch.float32)
                        a[:, :, :, g + 8 * (i & 1), 2 * t + 8 * (i >> 1) + e] = nib + 128 + zz
    m = x.shape[0]
    xf = x.to(torch.float32)
    b = torch.zeros(c_n, 4, 16, m)                                    # B of MMA j of chunk c: [k, n]
    for t in range(4):
        for j in range(4):
            for r in range(2):
                for e in range(2):
                    cols = torch.arange(c_n) * 64 + 16 * t + 2 * (2 * j + r) + e
                    b[:, j, 2 * t + 8 * r + e, :] = xf[:, cols].t()
    d = torch.einsum("scjrk,cjkn->scrn", a, b)                        # [s, c, row, n]
    d = d.view(s_n, c_n // 2, 2, 16, m).sum(2) * part_rows[..., None]  # per group, scaled
    return d.sum(1).permute(2, 0, 1).reshape(m, mw.n)


@pytest.mark.parametrize("zp", [False, True])
def test_layout_round_trip_and_lane_emulation(zp):
    n, k = 48, 384
    codes, scales, zeros = _random(n, k, zp)
    mw = wc.pack(codes, scales, zeros)
    assert mw.qw.shape == (n // 16, k // 64, 32, 4) and mw.sc.shape == (n // 16, k // 128, 8)
    assert torch.equal(wc.unpack_codes(mw), codes)
    x = torch.randn(5, k).to(torch.bfloat16)
    z = 8.0 if zeros is None else zeros.to(torch.float32).repeat_interleave(128, dim=1)
    w = (codes.to(torch.float32) - z) * scales.to(torch.float32).repeat_interleave(128, dim=1)
    ref = x.to(torch.float32) @ w.t()
    got = emulate(x, mw)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4), (got - ref).abs().max()


def test_from_q16_matches_the_triton_layout():
    n, k = 32, 256
    codes, scales, zeros = _random(n, k, True, seed=1)
    pw = wq.pack(codes, scales, zeros, 4, 128)
    mw = wc.from_q16(pw)
    assert torch.equal(wc.unpack_codes(mw), codes)
    x = torch.randn(3, k).to(torch.bfloat16)
    assert torch.allclose(emulate(x, mw), wq.reference_matmul(x.float(), pw), rtol=1e-5, atol=1e-4)


def test_refuses_shapes_it_cannot_hold():
    assert wc.supports(40, 256) and wc.supports(32, 200) and wc.supports(32, 256, bits=8)
    with pytest.raises(ValueError, match="multiple of 16"):
        wc.pack(torch.zeros(40, 256, dtype=torch.int64), torch.ones(40, 2))


def test_source_has_one_entry_per_kernel():
    cfgs = [(wc.CudaConfig(8, 2, 2, 3), 1, False, wc.STORE), (wc.CudaConfig(4, 1, 4), 2, True, wc.SWIGLU)]
    src = wc.source(cfgs)
    for c, nt, zp, epi in cfgs:
        assert f"void __launch_bounds__({32 * c.k_warps * c.n_warps}) {wc.kernel_name(c, nt, zp, epi)}(" in src
        assert f"w4a16_body<{c.ring}, {c.k_warps}, {c.n_warps}, {nt}, {str(zp).lower()}, {epi}>" in src


def test_swiglu_order_puts_a_channels_gate_and_up_in_one_strip():
    order = wc.swiglu_order(64)  # 32 channels: gate rows 0..31, up rows 32..63
    strips = order.view(4, 16)
    assert torch.equal(strips[:, :8], torch.arange(32).view(4, 8))
    assert torch.equal(strips[:, 8:], 32 + torch.arange(32).view(4, 8))
    assert sorted(order.tolist()) == list(range(64))
    with pytest.raises(ValueError, match="multiple of 32"):
        wc.swiglu_order(48)
