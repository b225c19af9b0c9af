"""Weight-only quantized matmul: the weights' q16 layout and the plain PyTorch reference.

y[M, N] = x[M, K] @ dequant(W)[N, K]^T, W in 4-bit (or 8-bit) unsigned codes u with one scale s (and optionally
one unsigned zero point z) per group of G consecutive inputs of a row: w = (u - z) * s, z = 2**(bits-1) if absent.

Layout "q16" (`pack`; `unpack_codes` / `dequantize` invert it)
--------------------------------------------------------------
  C = 16 // bits codes per int16 halfword (4 for int4, 2 for int8); a block is C groups = C*G inputs; K is padded
  to Kp, a multiple of the block (pad code = 2**(bits-1), i.e. weight 0).
  q: int16 [N, Kp / C]. Halfword c of block b of a row holds, in bits [bits*i, bits*(i+1)), the code of input
     k = b*C*G + i*G + c        (0 <= i < C, 0 <= c < G)   -- so group k // G is group i of block b.
  s: [Kp / (C*G), N, C] (scale dtype: bf16/fp16/fp32); one C-vector per row and block (8 bytes for int4 bf16).
  z: the same shape as s, or None.
  int4 group 128: q [N, Kp/4], blocks of 512 inputs, s [Kp/512, N, 4]. int8 group 32: blocks of 64 inputs.
e4m3 (FP8 checkpoints, quant/fp8.py: `pack_e4m3`): the float8_e4m3fn bytes as 8-bit codes, no zero point, one float32
scale per output and 128 inputs.

These functions (pack / unpack / dequantize / reference_matmul) are the CPU path and the tests' oracle; the Triton
kernel that runs the layout on CUDA is beside them in quant_matmul_triton.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def check_format(bits: int, group_size: int) -> None:
    """Raises ValueError unless (bits, group_size) is a layout the kernel takes."""
    if bits not in (4, 8):
        raise ValueError(f"the q16 layout holds 4- or 8-bit codes, got {bits}")
    if not (16 <= group_size <= 1024 and group_size & (group_size - 1) == 0):
        raise ValueError(f"group size must be a power of two in [16, 1024], got {group_size}")


def block_size(bits: int, group_size: int) -> int:
    """Inputs per block (16 // bits groups)."""
    return group_size * (16 // bits)


def padded_k(k: int, bits: int, group_size: int) -> int:
    blk = block_size(bits, group_size)
    return -(-k // blk) * blk


def pack_codes(codes: torch.Tensor, bits: int, group_size: int, offset: int = 0,
               chunk_rows: int = 4096) -> torch.Tensor:
    """Unsigned codes codes + offset [N, K] in [0, 2**bits) -> int16 [N, Kp * bits // 16]."""
    check_format(bits, group_size)
    n, k = codes.shape
    kp, cph = padded_k(k, bits, group_size), 16 // bits
    out = torch.empty(n, kp // cph, dtype=torch.int16, device=codes.device)
    shifts = (torch.arange(cph, device=codes.device, dtype=torch.int32) * bits).view(1, 1, cph, 1)
    for r0 in range(0, n, chunk_rows):
        c = F.pad(codes[r0:r0 + chunk_rows].to(torch.int32) + offset, (0, kp - k), value=1 << (bits - 1))
        h = (c.view(c.shape[0], -1, cph, group_size) << shifts).sum(2)  # disjoint bit fields: sum == or
        out[r0:r0 + chunk_rows] = torch.where(h >= 1 << 15, h - (1 << 16), h).view(c.shape[0], -1).to(torch.int16)
    return out


def unpack_codes(q: torch.Tensor, bits: int, group_size: int, k: int) -> torch.Tensor:
    """Inverse of `pack_codes`: int16 [N, Kp/C] -> unsigned codes int32 [N, k]."""
    n, cph = q.shape[0], 16 // bits
    shifts = (torch.arange(cph, device=q.device, dtype=torch.int32) * bits).view(1, 1, cph, 1)
    u = (q.view(n, -1, 1, group_size).to(torch.int32) >> shifts) & ((1 << bits) - 1)  # the mask drops sign copies
    return u.reshape(n, -1)[:, :k]


def pack_groups(t: torch.Tensor, bits: int, group_size: int, k: int, pad: float) -> torch.Tensor:
    """Per-group values [N, ceil(k/G)] (scales or zero points) -> [Kp/(C*G), N, C], same dtype."""
    n, cph = t.shape[0], 16 // bits
    gp = padded_k(k, bits, group_size) // group_size
    t = F.pad(t.to(torch.float32), (0, gp - t.shape[1]), value=pad).to(t.dtype)
    return t.view(n, gp // cph, cph).permute(1, 0, 2).contiguous()


def unpack_groups(t: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """Inverse of `pack_groups`: [Kp/(C*G), N, C] -> [N, ceil(k/G)]."""
    return t.permute(1, 0, 2).reshape(t.shape[1], -1)[:, :-(-k // group_size)]


@dataclass
class PackedWeight:
    """A weight in the q16 layout and what the kernel needs to know about it."""
    q: torch.Tensor                # int16 [N, Kp/C]
    s: torch.Tensor                # [Kp/(C*G), N, C]
    z: torch.Tensor | None         # like s (unsigned zero points as floats), or None (= 2**(bits-1))
    bits: int
    group_size: int
    n: int
    k: int
    codes: str = "uint"            # or "e4m3": 8-bit codes that are float8_e4m3fn values, w = value * s (no zero)

    def dequantize(self, dtype=torch.float32, rows=None) -> torch.Tensor:
        """Dense weight [N, k] (or of `rows`: an index tensor or a slice), computed in fp32."""
        q, s, z = self.q, self.s, self.z
        if rows is not None:
            q, s, z = q[rows], s[:, rows], None if z is None else z[:, rows]
        r, g = q.shape[0], self.group_size
        u = unpack_codes(q, self.bits, g, q.shape[1] * 16 // self.bits)
        if self.codes == "e4m3":
            u = u.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).view(r, -1, g)
            zz = 0.0
        else:
            u = u.to(torch.float32).view(r, -1, g)
            zz = float(1 << (self.bits - 1)) if z is None else z.permute(1, 0, 2).reshape(r, -1, 1).float()
        w = (u - zz) * s.permute(1, 0, 2).reshape(r, -1, 1).to(torch.float32)
        return w.view(r, -1)[:, :self.k].to(dtype).contiguous()  # (a copy only where K is padded)

    def nbytes(self) -> int:
        """Bytes the kernel reads for the weight: codes + scales (+ zero points)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.s, self.z) if t is not None)


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
         group_size: int) -> PackedWeight:
    """Unsigned codes [N, K], scales [N, ceil(K/G)] and unsigned zero points (same shape, or None) -> PackedWeight."""
    n, k = codes.shape
    z = None if zeros is None else pack_groups(zeros, bits, group_size, k, float(1 << (bits - 1)))
    return PackedWeight(pack_codes(codes, bits, group_size), pack_groups(scales, bits, group_size, k, 0.0), z,
                        bits, group_size, n, k)


def pack_e4m3(weight: torch.Tensor, scale: torch.Tensor, rows_per_scale: int = 128) -> PackedWeight:
    """A block-scaled FP8 weight (quant/fp8.py: float8_e4m3fn [N, K], float32 scales [ceil(N / 128), ceil(K / 128)];
    with rows_per_scale 1, scales [N, ceil(K / 128)], one per output) in the q16 layout: its bytes as 8-bit codes (the
    padding 0x80 is e4m3 -0), one float32 scale per output and 128 inputs (its block's). Lossless: dequantize() gives
    the FP8 reference's weights."""
    per_row = scale.to(torch.float32).repeat_interleave(rows_per_scale, dim=0)[:weight.shape[0]]  # [N, ceil(K/128)]
    return PackedWeight(pack_codes(weight.view(torch.uint8), 8, 128),
                        pack_groups(per_row, 8, 128, weight.shape[1], 0.0), None, 8, 128, weight.shape[0],
                        weight.shape[1], "e4m3")


def reference_matmul(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """x [..., K] @ dequant(W)^T in fp32, returned in x's dtype (the tests' oracle)."""
    y = x.reshape(-1, pw.k).to(torch.float32) @ pw.dequantize(torch.float32).t()
    return y.to(x.dtype).reshape(*x.shape[:-1], pw.n)


__all__ = ["PackedWeight", "check_format", "block_size", "padded_k", "pack", "pack_e4m3", "pack_codes", "unpack_codes",
           "pack_groups", "unpack_groups", "reference_matmul"]
