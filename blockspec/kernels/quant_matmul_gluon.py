"""The weight-only quantized projection (int4 group 128, symmetric; also 8-bit codes: e4m3, int8 of group 128 or 32)
of bf16 rows on Hopper, warp-specialized in Gluon: the same y = x @ dequant(W)^T and epilogues as
`quant_matmul_triton._wq_kernel`, whose plain PyTorch reference is quant_matmul.py. The config table takes it for
INT4 projections of 1..8 and 17..32 rows and FP8 ones of 1..8 rows.

Kernel
------
  One program per SM, three partitions:
  * a loader warp streams stages (the C consumers' [64, 128] int16 code tiles of one unit, 128 int16 columns: a
    K block of 4 groups of 128 inputs for 4-bit codes, 2 for 8-bit; 4 blocks of 2 groups of 32 for int8 group 32,
    a box of 32 columns each (BOXES); and x's unit, one box a group) through TMA into a ring of S shared-memory
    slots, each with a `ready` and an `empty` mbarrier;
  * C consumer warpgroups (4 warps each) take their 64-row tile of every stage: the block's group dots as wgmma
    with the dequantized codes (unpack_ptx.py) as the register operand and the shared x block as the other, each
    group's fp32 dot times its scale added in group order (the Triton kernel's arithmetic), then release the slot;
    with `overlap_dots` the dots' wgmma run asynchronously in pieces, the next piece unpacked meanwhile.
  The program walks a contiguous run of (tile group, unit) pairs in tile-major order, an equal share of all
  units, so the weight stream does not restart at tile boundaries and every SM streams the same bytes. A tile whose
  blocks one program streamed is finished by it; a tile cut between runs has its pieces' fp32 partials added by
  the last piece to arrive, in K order (`arrival_counters`, reset after use).
  Under PDL (pdl.py) the loader copies the first S stages' code tiles, model weights, before it waits for the
  previous kernel; x, the consumers' partials and residual reads and every store come after the wait.
  Why: at 17..32 rows the Triton kernel's programs (2 an SM, 255 registers) wait on their own loads; here the
  loader keeps S stages in flight whatever the consumers do. At 1..8 rows a lean program (`LEAN`) shares its SM
  with the small kernels around it (docs/benchmarks.md, "Warp-specialized W4A16").
  Results equal the Triton kernel's where a tile is unsplit in both; split tiles sum their pieces in another
  order (the last bits may differ, as between the Triton configs).
Epilogues (`Epilogue`): the input rows' 1 / rms (RMS), then store (0), residual add with the next norm begun (1),
or silu(gate) * up (2: a consumer's 64 rows are 32 gate channels, then the same channels' up rows).

The MLP in one launch (`launch_mlp`, the `persistent_mlp` setting; 1..8 rows): every program runs the lean
program's units of gate_up (epilogue 2, into h), then of down (epilogue 1) through the same ring; the loader copies
down's first codes while gate_up's last tiles finish, and down's x (h) once every consumer warpgroup has arrived on a
counter after its stores. Bit for bit the two launches; measured slower in the step so far (docs/benchmarks.md, "The
MLP in one warp-specialized launch"), hence off by default.
"""

from __future__ import annotations

import functools
import sys

import torch

from . import arrival_counters, pdl, sm_count
from .quant_matmul import PackedWeight
from .unpack_ptx import unpack_asm

try:  # Gluon ships with triton >= 3.5; without it the Triton kernel serves every row count
    import triton
    import triton.language as tl
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                 warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the environment
    gluon = None

BN = 64           # output rows of a consumer's tile (one wgmma M)
BM = 32           # activation rows of the x block (the wgmma N): 17..32 rows
G = 128           # inputs of a group, and int16 columns of codes in a stage: a K block of 16 // bits groups
CONSUMERS = 2     # consumer warpgroups per SM (3 measured slower at 32 rows)
SMEM = 200 * 1024  # the ring's budget of the 227 KB an SM gives one program (barriers and the SwiGLU scratch aside)
# Registers a thread by consumer count: at launch (12 warps in an SM's 64K at 168; 16 at 128), then after the split
# for each worker consumer warpgroup and for the loader warp; the default partition (consumer 0) keeps the rest
# (168 x 3 - 232 - 40 = 232).
REGISTERS = {2: (168, 232, 40), 3: (128, 160, 24)}
# x blocks of 8 rows (1..8 activation rows) with 2 consumers: a lean program, 104 registers a thread at launch (144
# a worker consumer, 24 the loader; no spills) and a 120 KB ring (3 stages). The small kernels around a launch
# (norms, the mixers) then start beside it on its SM under PDL, where a whole-SM program waits for them to leave.
LEAN = ((104, 144, 24), 120 * 1024)


def footprint(consumers: int, block_m: int) -> tuple[tuple[int, int, int], int]:
    """(registers a thread: at launch, a worker consumer's, the loader's; the ring's shared memory) of a program."""
    return LEAN if consumers == 2 and block_m == 8 else (REGISTERS[consumers], SMEM)


_BROKEN: list[str] = []  # why this kernel did not build here (then the Triton kernel serves its launches)
_MLP_BROKEN: list[str] = []  # why the MLP's kernel did not build here (then its projections launch apart)


def usable(x2: torch.Tensor, pw: PackedWeight, block_m: int = BM, consumers: int = CONSUMERS) -> bool:
    """Whether this kernel serves x2 @ W^T with 2 or 3 consumers and x blocks of block_m rows: Hopper, bf16
    activations of at most block_m rows (8, 16 or 32) at a 16-byte aligned address (TMA), 4- or 8-bit group 128
    codes (int4, int8, e4m3) or 8-bit group 32 codes (int8) without zero points, K in whole units (512 or 256
    columns), and the kernel builds with this Triton. (The config table takes it for int4 at 1..8 and 17..32
    rows, e4m3 at 1..8.)"""
    return (gluon is not None and not _BROKEN and x2.is_cuda and consumers in (2, 3) and block_m in (8, 16, 32)
            and x2.shape[0] <= block_m and x2.dtype == torch.bfloat16 and x2.data_ptr() % 16 == 0
            and pw.bits in (4, 8) and (pw.group_size == G or (pw.bits, pw.group_size, pw.codes) == (8, 32, "uint"))
            and pw.z is None and pw.k % (G * 16 // pw.bits) == 0 and _hopper(x2.device))


@functools.cache
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


if gluon is not None:
    _BN, _G = gl.constexpr(BN), gl.constexpr(G)

    @triton.jit
    def _fence_proxy_async_global():
        tl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _rows(t, c: gl.constexpr, rows, N, C: gl.constexpr, EPI: gl.constexpr):
        """Output rows of consumer c's tile in tile group t (EPI 2: gate channels, then their up rows; a channel
        past the last points past N, so no store lands on another tile's rows) and which are real."""
        if EPI == 2:
            channels = (t * C + c) * (_BN // 2) + rows % (_BN // 2)
            ok = channels < N // 2
            n = gl.where(ok, channels + (rows >= _BN // 2).to(gl.int32) * (N // 2), N)
        else:
            n = (t * C + c) * _BN + rows
            ok = n < N
        return n, ok

    @gluon.jit
    def _scales(s_ptr, u, live, N, rows, NBLK: gl.constexpr, C: gl.constexpr, c: gl.constexpr,
                EPI: gl.constexpr, GROUPS: gl.constexpr, BOXES: gl.constexpr):
        """The scales of unit u's groups for consumer c's rows: one block of 4-bit codes, 4 (8-bit: 2, then 2
        unread); 4 blocks of 8-bit group-32 codes (BOXES 4), 8 in K order."""
        n, ok = _rows(u // NBLK, c, rows, N, C, EPI)
        sc = s_ptr + (u % NBLK) * BOXES * N * GROUPS + n * GROUPS
        m = ok & live
        s0, s1 = gl.load(sc, mask=m, other=0.0), gl.load(sc + 1, mask=m, other=0.0)
        if BOXES == 4:  # (one return: the compiler checks every return's types, also in a branch not taken)
            scales = (s0, s1, gl.load(sc + 2 * N, mask=m, other=0.0), gl.load(sc + 2 * N + 1, mask=m, other=0.0),
                      gl.load(sc + 4 * N, mask=m, other=0.0), gl.load(sc + 4 * N + 1, mask=m, other=0.0),
                      gl.load(sc + 6 * N, mask=m, other=0.0), gl.load(sc + 6 * N + 1, mask=m, other=0.0))
        elif GROUPS == 4:
            scales = (s0, s1, gl.load(sc + 2, mask=m, other=0.0), gl.load(sc + 3, mask=m, other=0.0))
        else:
            scales = (s0, s1, s0, s1)
        return scales

    @gluon.jit
    def _finish(acc, inv_rms, scratch, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, t, n, n_ok,
                cols, M, N, PER, stride_om, NBLK: gl.constexpr, C: gl.constexpr, c: gl.constexpr,
                EPI: gl.constexpr, RMS: gl.constexpr, BM: gl.constexpr):
        """Consumer c's finished piece of tile group t: the tile's total (this piece alone, or the pieces' sum by
        the last to arrive), then the epilogue."""
        first = (t * NBLK) // PER
        parts = ((t + 1) * NBLK - 1) // PER - first + 1
        mask = n_ok[:, None] & (cols < M)[None, :]
        off = cols[None, :] * N + n[:, None]
        total = acc
        done = parts == parts
        if parts > 1:
            gl.store(ws_ptr + (gl.program_id(0) - first) * M * N + off, acc, mask=mask)
            gl.thread_barrier()
            done = gl.atomic_add(cnt_ptr + t * C + c, 1, sem="acq_rel") == parts - 1
            if done:
                total = gl.zeros_like(acc)
                for piece in range(parts):
                    total += gl.load(ws_ptr + piece * M * N + off, mask=mask, other=0.0, cache_modifier=".cg")
                gl.atomic_xchg(cnt_ptr + t * C + c, 0)  # clean for the next launch / graph replay
        if done:
            if RMS:
                total = total * inv_rms[None, :]
            if EPI == 1:  # out = r + y rounded as the plain add; rows = out * (1 + w); the tile's sums of out^2
                res = gl.load(res_ptr + off, mask=mask, other=0.0).to(gl.float32)
                summed = (res + total.to(out_ptr.dtype.element_ty).to(gl.float32)).to(out_ptr.dtype.element_ty)
                gl.store(out_ptr + off, summed, mask=mask)
                v = summed.to(gl.float32)
                gl.store(part_ptr + (t * C + c) * M + cols, gl.sum(v * v, axis=0),  # a tile past N has no row
                         mask=(cols < M) & ((t * C + c) * _BN < N))
                w = gl.load(nw_ptr + n, mask=n_ok, other=0.0).to(gl.float32)
                gl.store(rows_ptr + off, (v * (1.0 + w)[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
            elif EPI == 2:  # gate rows and up rows sit in different warps: meet in shared memory
                HALF: gl.constexpr = _BN // 2
                pair: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
                scratch.store(total.to(out_ptr.dtype.element_ty).to(gl.float32))
                gl.thread_barrier()
                gate = scratch.slice(0, HALF).load(pair)
                up = scratch.slice(HALF, HALF).load(pair)
                gl.thread_barrier()
                channels = (t * C + c) * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, pair))
                m_out = gl.arange(0, BM, layout=gl.SliceLayout(0, pair))
                gl.store(out_ptr + m_out[None, :] * stride_om + channels[:, None],
                         (up * (gate * (1 / (1 + gl.exp(-gate))))).to(out_ptr.dtype.element_ty),  # tl.sigmoid
                         mask=(channels < N // 2)[:, None] & (m_out < M)[None, :])
            else:
                gl.store(out_ptr + cols[None, :] * stride_om + n[:, None], total.to(out_ptr.dtype.element_ty),
                         mask=mask)

    @gluon.jit
    def _inv_rms(part_ptr, M, K, PARTS, eps, RMS: gl.constexpr, PBLOCK: gl.constexpr, BM: gl.constexpr):
        """The input rows' 1 / rms from the previous launch's per-tile sums of squares (zeros without RMS)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        inv_rms = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(0, mma))
        if RMS:
            sums_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
            p_rows = gl.arange(0, PBLOCK, layout=gl.SliceLayout(1, sums_layout))
            p_cols = gl.arange(0, BM, layout=gl.SliceLayout(0, sums_layout))
            sums = gl.load(part_ptr + p_rows[:, None] * M + p_cols[None, :],
                           mask=(p_rows < PARTS)[:, None] & (p_cols < M)[None, :], other=0.0)
            inv_rms = gl.convert_layout(gl.rsqrt(gl.sum(sums, axis=0) / K + eps), gl.SliceLayout(0, mma))
        return inv_rms

    @gluon.jit
    def _group_dot(acc, h, ring_x, xi, s, U: gl.constexpr, zero):
        """acc + (the group's codes in h, unpacked by U) @ (x box xi of the ring)^T from zero, times the rows'
        scales s: one group of the Triton kernel's arithmetic."""
        a = gl.inline_asm_elementwise(U, "=r,r", [h], dtype=gl.bfloat16, is_pure=True, pack=2)
        dot = warpgroup_mma(a, ring_x.index(xi).permute((1, 0)), zero, use_acc=False)
        return acc + dot * s.to(gl.float32)[:, None]

    @gluon.jit
    def _unpack(h, i: gl.constexpr, U0: gl.constexpr, U1: gl.constexpr, U2: gl.constexpr, U3: gl.constexpr):
        """Code i of each halfword of h as the wgmma's bf16 register operand (unpack_ptx.py's U0..U3)."""
        return gl.inline_asm_elementwise((U0, U1, U2, U3)[i], "=r,r", [h], dtype=gl.bfloat16, is_pure=True, pack=2)

    @gluon.jit
    def _overlapped_dots(acc, ring_q, ring_x, slot, c: gl.constexpr, scales, zero, a_layout: gl.constexpr,
                         C: gl.constexpr, GROUPS: gl.constexpr, BOXES: gl.constexpr, U0: gl.constexpr,
                         U1: gl.constexpr, U2: gl.constexpr, U3: gl.constexpr):
        """A unit's group dots as `_group_dot`'s, their wgmma issued asynchronously in pieces of K (halves of a
        128-input group; a 32-input group whole) and each next piece's codes unpacked while the one before runs (a
        synchronous wgmma leaves the warpgroup idle for its latency, the unpacking waiting on it). A group's
        pieces chain its dot from zero in K order, the same k16 steps as one wgmma of the group, and the dots are
        scaled and added in group order: the same bits. At most two pieces' operands are held at once (the lean
        footprint's 144 registers a consumer)."""
        NG: gl.constexpr = GROUPS * BOXES
        P: gl.constexpr = 2 if BOXES == 1 else 1
        W: gl.constexpr = _G // BOXES // P  # columns of a piece
        if BOXES == 1:
            box = ring_q.index(slot * C + c)
            h0 = box.slice(0, W, dim=1).load(a_layout)
            h1 = box.slice(W, W, dim=1).load(a_layout)
        else:
            h0 = ring_q.index((slot * C + c) * 4).load(a_layout)
            h1 = h0
        a = _unpack(h0, 0, U0, U1, U2, U3)
        dot = warpgroup_mma(a, ring_x.index(slot * NG).slice(0, W, dim=1).permute((1, 0)), zero, use_acc=False,
                            is_async=True)
        for step in gl.static_range(1, NG * P):
            if BOXES == 4:
                if step % 2 == 0:  # 8-bit group 32: each box holds two groups
                    h0 = ring_q.index((slot * C + c) * 4 + step // 2).load(a_layout)
            if step % P == 0:
                a_next = _unpack(h0, step // P % GROUPS, U0, U1, U2, U3)
                x = ring_x.index(slot * NG + step // P).slice(0, W, dim=1).permute((1, 0))
                dot_next = warpgroup_mma(a_next, x, zero, use_acc=False, is_async=True)
                dot, a = warpgroup_mma_wait(1, deps=[dot, a])  # the group before's dot is whole
                acc = acc + dot * scales[step // P - 1].to(gl.float32)[:, None]
                dot = dot_next
            else:
                a_next = _unpack(h1, step // P % GROUPS, U0, U1, U2, U3)
                dot = warpgroup_mma(a_next, ring_x.index(slot * NG + step // P).slice(W, W, dim=1).permute((1, 0)), dot,
                                    use_acc=True, is_async=True)
                a = warpgroup_mma_wait(1, deps=[a])  # the piece before has read its operand
            a = a_next
        dot, a = warpgroup_mma_wait(0, deps=[dot, a])
        return acc + dot * scales[NG - 1].to(gl.float32)[:, None]

    @gluon.jit
    def _units(c: gl.constexpr, j0, nx, inv_rms, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr,
               part_ptr, ring_q, ring_x, scratch, ready, empty, start, count, M, N, PER, stride_om,
               NBLK: gl.constexpr, C: gl.constexpr, S: gl.constexpr, EPI: gl.constexpr, RMS: gl.constexpr,
               BM: gl.constexpr, GROUPS: gl.constexpr, BOXES: gl.constexpr, U0: gl.constexpr, U1: gl.constexpr,
               U2: gl.constexpr, U3: gl.constexpr, OVERLAP: gl.constexpr = False):
        """Consumer c's run of `count` units from `start`, the stages j0 .. j0 + count - 1 of the ring; nx: the
        first unit's scales. OVERLAP: the group dots of `_overlapped_dots`."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        rows = gl.arange(0, _BN, layout=gl.SliceLayout(1, mma))
        cols = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        zero = gl.zeros([_BN, BM], gl.float32, layout=mma)
        acc = gl.zeros([_BN, BM], gl.float32, layout=mma)
        for j in range(count):
            u = start + j
            t = u // NBLK
            b = u % NBLK
            scales = nx
            nx = _scales(s_ptr, u + 1, j + 1 < count, N, rows, NBLK, C, c, EPI, GROUPS, BOXES)
            slot = (j0 + j) % S
            mbarrier.wait(ready.index(slot), ((j0 + j) // S) & 1)
            if OVERLAP:
                acc = _overlapped_dots(acc, ring_q, ring_x, slot, c, scales, zero, a_layout, C, GROUPS, BOXES, U0, U1,
                                       U2, U3)
            elif BOXES == 4:  # 8-bit group 32: each block's box, its two groups
                for i in gl.static_range(4):
                    h = ring_q.index((slot * C + c) * 4 + i).load(a_layout)
                    acc = _group_dot(acc, h, ring_x, slot * 8 + 2 * i, scales[2 * i], U0, zero)
                    acc = _group_dot(acc, h, ring_x, slot * 8 + 2 * i + 1, scales[2 * i + 1], U1, zero)
            else:
                s0, s1, s2, s3 = scales
                h = ring_q.index(slot * C + c).load(a_layout)
                acc = _group_dot(acc, h, ring_x, slot * GROUPS, s0, U0, zero)
                acc = _group_dot(acc, h, ring_x, slot * GROUPS + 1, s1, U1, zero)
                if GROUPS == 4:
                    acc = _group_dot(acc, h, ring_x, slot * 4 + 2, s2, U2, zero)
                    acc = _group_dot(acc, h, ring_x, slot * 4 + 3, s3, U3, zero)
            fence_async_shared()  # the slot's reads before the loader's next TMA writes
            mbarrier.arrive(empty.index(slot), count=1)
            flush = (b == NBLK - 1) | (j == count - 1)
            if flush:
                n, n_ok = _rows(t, c, rows, N, C, EPI)
                _finish(acc, inv_rms, scratch.index(c if EPI == 2 else 0), out_ptr, ws_ptr, cnt_ptr, res_ptr,
                        nw_ptr, rows_ptr, part_ptr, t, n, n_ok, cols, M, N, PER, stride_om, NBLK, C, c, EPI, RMS, BM)
            acc = gl.where(flush, zero, acc)

    @gluon.jit
    def _consume(c: gl.constexpr, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q,
                 ring_x, scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps,
                 NBLK: gl.constexpr, C: gl.constexpr, S: gl.constexpr, EPI: gl.constexpr, RMS: gl.constexpr,
                 PBLOCK: gl.constexpr, BM: gl.constexpr, PDL: gl.constexpr, GROUPS: gl.constexpr,
                 BOXES: gl.constexpr, U0: gl.constexpr, U1: gl.constexpr, U2: gl.constexpr, U3: gl.constexpr,
                 OVERLAP: gl.constexpr):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        rows = gl.arange(0, _BN, layout=gl.SliceLayout(1, mma))
        nx = _scales(s_ptr, start, count > 0, N, rows, NBLK, C, c, EPI, GROUPS, BOXES)  # a unit ahead: DRAM latency
        pdl.wait(PDL)  # before the previous kernel's outputs: the partials, the residual
        inv_rms = _inv_rms(part_ptr, M, K, PARTS, eps, RMS, PBLOCK, BM)
        _units(c, 0, nx, inv_rms, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q, ring_x,
               scratch, ready, empty, start, count, M, N, PER, stride_om, NBLK, C, S, EPI, RMS, BM, GROUPS, BOXES,
               U0, U1, U2, U3, OVERLAP)
        pdl.release(PDL)

    @gluon.jit
    def _load_codes(q_desc, ring_q, bar, slot, t, b, N, C: gl.constexpr, EPI: gl.constexpr, BM: gl.constexpr,
                    GROUPS: gl.constexpr, BOXES: gl.constexpr):
        """A stage's expected bytes (codes and x) on its `ready` barrier, then its code tiles' copies: each
        consumer's tile as BOXES boxes of a block's _G // BOXES columns."""
        W: gl.constexpr = _G // BOXES
        mbarrier.expect(bar, C * _BN * _G * 2 + GROUPS * BOXES * BM * W * 2)
        for c in gl.static_range(C):
            for i in gl.static_range(BOXES):
                box = ring_q.index((slot * C + c) * BOXES + i)
                if EPI == 2:  # 32 gate rows, then the same channels' up rows
                    ch = (t * C + c) * (_BN // 2)
                    tma.async_copy_global_to_shared(q_desc, [ch, (b * BOXES + i) * W], bar, box.slice(0, _BN // 2))
                    tma.async_copy_global_to_shared(q_desc, [N // 2 + ch, (b * BOXES + i) * W], bar,
                                                    box.slice(_BN // 2, _BN // 2))
                else:
                    tma.async_copy_global_to_shared(q_desc, [(t * C + c) * _BN, (b * BOXES + i) * W], bar, box)

    @gluon.jit
    def _stream(q_desc, x_desc, ring_q, ring_x, ready, empty, j0, start, count, N, gate_ptr, gate,
                NBLK: gl.constexpr, C: gl.constexpr, S: gl.constexpr, EPI: gl.constexpr, BM: gl.constexpr,
                PDL: gl.constexpr, GROUPS: gl.constexpr, BOXES: gl.constexpr, GATE: gl.constexpr):
        """The loader's run of `count` units from `start` into the ring's stages j0 ..: the first S stages' codes,
        model weights, before the gate (GATE 0: the previous kernel, under PDL; 1: the counter at gate_ptr
        reaching `gate`, what an earlier phase of the same launch wrote); x, an output of what the gate waits
        for, only after it."""
        for j in range(gl.minimum(count, S)):
            if j0 + j >= S:
                mbarrier.wait(empty.index((j0 + j) % S), (((j0 + j) // S) & 1) ^ 1)
            _load_codes(q_desc, ring_q, ready.index((j0 + j) % S), (j0 + j) % S, (start + j) // NBLK,
                        (start + j) % NBLK, N, C, EPI, BM, GROUPS, BOXES)
        if GATE == 0:
            pdl.wait(PDL)
        else:
            while gl.atomic_add(gate_ptr, 0, sem="acquire") < gate:
                pass
            _fence_proxy_async_global()  # the generic stores seen before TMA (the async proxy) reads them
        for j in range(count):
            b = (start + j) % NBLK
            slot = (j0 + j) % S
            if j >= S:
                mbarrier.wait(empty.index(slot), (((j0 + j) // S) & 1) ^ 1)
                _load_codes(q_desc, ring_q, ready.index(slot), slot, (start + j) // NBLK, b, N, C, EPI, BM, GROUPS,
                            BOXES)
            for i in gl.static_range(GROUPS * BOXES):  # a box of x a group, in K order
                tma.async_copy_global_to_shared(x_desc, [0, (b * GROUPS * BOXES + i) * (_G // BOXES)],
                                                ready.index(slot), ring_x.index(slot * GROUPS * BOXES + i))

    @gluon.jit
    def _prefetch_l2(q_ptr, start, count, N, K: gl.constexpr, NBLK: gl.constexpr, C: gl.constexpr,
                     S: gl.constexpr, EPI: gl.constexpr, GROUPS: gl.constexpr, AHEAD: gl.constexpr):
        """The codes of the run's units S .. S + AHEAD - 1 (those after the ring's first stages), model weights,
        fetched into L2: a tile row's span of them (256 bytes a unit, contiguous) by one bulk prefetch, the warp's
        lanes 2 rows each."""
        lanes: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        r = gl.arange(0, _BN, layout=lanes)
        lo = start + S
        hi = start + gl.minimum(count, S + AHEAD)
        for t in range(lo // NBLK, (hi + NBLK - 1) // NBLK):
            b0 = gl.maximum(lo, t * NBLK) - t * NBLK
            size = (gl.minimum(hi, (t + 1) * NBLK) - t * NBLK - b0) * (_G * 2)
            for c in gl.static_range(C):
                n, ok = _rows(t, c, r, N, C, EPI)
                row = q_ptr + gl.where(ok, n, 0).to(gl.int64) * (K // GROUPS) + b0 * _G
                gl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r",
                                          [row.to(gl.int64, bitcast=True), gl.full([_BN], 0, gl.int32, lanes) + size],
                                          dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _loader(q_desc, x_desc, q_ptr, ring_q, ring_x, ready, empty, start, count, N, K: gl.constexpr,
                NBLK: gl.constexpr, C: gl.constexpr, S: gl.constexpr, EPI: gl.constexpr, BM: gl.constexpr,
                PDL: gl.constexpr, GROUPS: gl.constexpr, BOXES: gl.constexpr, L2AHEAD: gl.constexpr):
        """The worker partition that streams the stages; under PDL with L2AHEAD, the L2 prefetch of the units after
        the ring's first stages before it waits (`_prefetch_l2`)."""
        if L2AHEAD > 0 and PDL > 0:
            _prefetch_l2(q_ptr, start, count, N, K, NBLK, C, S, EPI, GROUPS, L2AHEAD)
        _stream(q_desc, x_desc, ring_q, ring_x, ready, empty, 0, start, count, N, 0, 0, NBLK, C, S, EPI, BM, PDL,
                GROUPS, BOXES, 0)
        pdl.release(PDL)

    @gluon.jit
    def _ring(x_desc, C: gl.constexpr, S: gl.constexpr, SCRATCH: gl.constexpr, BM: gl.constexpr,
              GROUPS: gl.constexpr, BOXES: gl.constexpr):
        """A program's shared memory: the ring's S stages of C code tiles (BOXES boxes each) and
        GROUPS * BOXES boxes of x (x_desc's layout), each stage's `ready` (one arrival: the loader's expected
        bytes) and `empty` (one a consumer) barriers, and SCRATCH tiles for the SwiGLU epilogue."""
        W: gl.constexpr = _G // BOXES
        ring_q = gl.allocate_shared_memory(gl.int16, [S * C * BOXES, _BN, W],
                                           gl.NVMMASharedLayout.get_default_for([_BN, W], gl.int16))
        ring_x = gl.allocate_shared_memory(gl.bfloat16, [S * GROUPS * BOXES, BM, W], x_desc.layout)
        scratch = gl.allocate_shared_memory(gl.float32, [SCRATCH, _BN, BM], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(S):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=C)
        return ring_q, ring_x, scratch, ready, empty

    @gluon.jit
    def _ws_kernel(q_desc, x_desc, q_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, M, N,
                   UNITS, PER, PARTS, stride_om, eps, K: gl.constexpr, C: gl.constexpr, BM: gl.constexpr,
                   S: gl.constexpr, EPI: gl.constexpr, RMS: gl.constexpr, PBLOCK: gl.constexpr,
                   PDL: gl.constexpr, CREGS: gl.constexpr, LREGS: gl.constexpr, GROUPS: gl.constexpr,
                   BOXES: gl.constexpr, L2AHEAD: gl.constexpr, U0: gl.constexpr, U1: gl.constexpr,
                   U2: gl.constexpr, U3: gl.constexpr, OVERLAP: gl.constexpr,
                   num_warps: gl.constexpr):
        NBLK: gl.constexpr = K // (_G * GROUPS)  # units a tile: 128 columns of codes each
        ring_q, ring_x, scratch, ready, empty = _ring(x_desc, C, S, C if EPI == 2 else 1, BM, GROUPS, BOXES)
        start = gl.program_id(0) * PER
        count = gl.maximum(gl.minimum(UNITS - start, PER), 0)
        # (the argument tuples are written out in each call: a tuple held in a variable loses its constexprs)
        if C == 2:
            gl.warp_specialize([
                (_consume, (0, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q, ring_x,
                            scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps, NBLK, C, S, EPI,
                            RMS, PBLOCK, BM, PDL, GROUPS, BOXES, U0, U1, U2, U3, OVERLAP)),
                (_consume, (1, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q, ring_x,
                            scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps, NBLK, C, S, EPI,
                            RMS, PBLOCK, BM, PDL, GROUPS, BOXES, U0, U1, U2, U3, OVERLAP)),
                (_loader, (q_desc, x_desc, q_ptr, ring_q, ring_x, ready, empty, start, count, N, K, NBLK, C, S, EPI,
                           BM, PDL, GROUPS, BOXES, L2AHEAD))],
                [4, 1], [CREGS, LREGS])
        else:
            gl.warp_specialize([
                (_consume, (0, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q, ring_x,
                            scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps, NBLK, C, S, EPI,
                            RMS, PBLOCK, BM, PDL, GROUPS, BOXES, U0, U1, U2, U3, OVERLAP)),
                (_consume, (1, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q, ring_x,
                            scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps, NBLK, C, S, EPI,
                            RMS, PBLOCK, BM, PDL, GROUPS, BOXES, U0, U1, U2, U3, OVERLAP)),
                (_consume, (2, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q, ring_x,
                            scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps, NBLK, C, S, EPI,
                            RMS, PBLOCK, BM, PDL, GROUPS, BOXES, U0, U1, U2, U3, OVERLAP)),
                (_loader, (q_desc, x_desc, q_ptr, ring_q, ring_x, ready, empty, start, count, N, K, NBLK, C, S, EPI,
                           BM, PDL, GROUPS, BOXES, L2AHEAD))],
                [4, 4, 1], [CREGS, CREGS, LREGS])


    @gluon.jit
    def _consume_mlp(c: gl.constexpr, sa_ptr, h_ptr, wsa_ptr, cnta_ptr, parta_ptr, sb_ptr, out_ptr, wsb_ptr,
                     cntb_ptr, res_ptr, nw_ptr, rows_ptr, partb_ptr, done_ptr, ring_q, ring_x, scratch, ready, empty,
                     start_a, count_a, start_b, count_b, M, NA, KA, PER_A, PARTS, stride_h, NB, PER_B, stride_om,
                     eps, NBLK_A: gl.constexpr, NBLK_B: gl.constexpr, C: gl.constexpr, S: gl.constexpr,
                     RMS: gl.constexpr, PBLOCK: gl.constexpr, BM: gl.constexpr, PDL: gl.constexpr,
                     GROUPS: gl.constexpr, U0: gl.constexpr, U1: gl.constexpr, U2: gl.constexpr, U3: gl.constexpr):
        """Consumer c of the MLP's launch: its gate_up units (SwiGLU into h), an arrival on the done counter once
        its stores are made, then its down units (residual add, the next norm begun)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        rows = gl.arange(0, _BN, layout=gl.SliceLayout(1, mma))
        nx = _scales(sa_ptr, start_a, count_a > 0, NA, rows, NBLK_A, C, c, 2, GROUPS, 1)
        pdl.wait(PDL)
        inv_rms = _inv_rms(parta_ptr, M, KA, PARTS, eps, RMS, PBLOCK, BM)
        _units(c, 0, nx, inv_rms, sa_ptr, h_ptr, wsa_ptr, cnta_ptr, h_ptr, sa_ptr, h_ptr, parta_ptr, ring_q, ring_x,
               scratch, ready, empty, start_a, count_a, M, NA, PER_A, stride_h, NBLK_A, C, S, 2, RMS, BM, GROUPS,
               1, U0, U1, U2, U3)
        gl.thread_barrier()  # this warpgroup's stores of h (and of the split tiles it finished) before the arrival
        gl.atomic_add(done_ptr, 1, sem="release")
        nx = _scales(sb_ptr, start_b, count_b > 0, NB, rows, NBLK_B, C, c, 1, GROUPS, 1)
        _units(c, count_a, nx, inv_rms, sb_ptr, out_ptr, wsb_ptr, cntb_ptr, res_ptr, nw_ptr, rows_ptr, partb_ptr,
               ring_q, ring_x, scratch, ready, empty, start_b, count_b, M, NB, PER_B, stride_om, NBLK_B, C, S, 1,
               False, BM, GROUPS, 1, U0, U1, U2, U3)
        pdl.release(PDL)

    @gluon.jit
    def _loader_mlp(qa_desc, xa_desc, qb_desc, xb_desc, ring_q, ring_x, ready, empty, start_a, count_a, start_b,
                    count_b, NA, NB, done_ptr, exit_ptr, arrivals, programs, NBLK_A: gl.constexpr,
                    NBLK_B: gl.constexpr, C: gl.constexpr, S: gl.constexpr, BM: gl.constexpr, PDL: gl.constexpr,
                    GROUPS: gl.constexpr):
        """The MLP launch's loader: gate_up's stages, then down's, whose first codes stream while the last gate_up
        tiles finish and whose x (h) waits for every consumer's arrival; the last program past that wait resets
        both counters for the next launch."""
        _stream(qa_desc, xa_desc, ring_q, ring_x, ready, empty, 0, start_a, count_a, NA, done_ptr, 0, NBLK_A, C, S,
                2, BM, PDL, GROUPS, 1, 0)
        _stream(qb_desc, xb_desc, ring_q, ring_x, ready, empty, count_a, start_b, count_b, NB, done_ptr, arrivals,
                NBLK_B, C, S, 1, BM, PDL, GROUPS, 1, 1)
        if gl.atomic_add(exit_ptr, 1, sem="acq_rel") == programs - 1:
            gl.atomic_xchg(done_ptr, 0)
            gl.atomic_xchg(exit_ptr, 0)
        pdl.release(PDL)

    @gluon.jit
    def _mlp_kernel(qa_desc, xa_desc, qb_desc, xb_desc, sa_ptr, h_ptr, wsa_ptr, cnta_ptr, parta_ptr, sb_ptr,
                    out_ptr, wsb_ptr, cntb_ptr, res_ptr, nw_ptr, rows_ptr, partb_ptr, done_ptr, exit_ptr, M, NA, NB,
                    UNITS_A, PER_A, UNITS_B, PER_B, PARTS, stride_h, stride_om, eps, ARRIVALS, KA: gl.constexpr,
                    KB: gl.constexpr, C: gl.constexpr, BM: gl.constexpr, S: gl.constexpr, RMS: gl.constexpr,
                    PBLOCK: gl.constexpr, PDL: gl.constexpr, CREGS: gl.constexpr, LREGS: gl.constexpr,
                    GROUPS: gl.constexpr, U0: gl.constexpr, U1: gl.constexpr, U2: gl.constexpr, U3: gl.constexpr,
                    num_warps: gl.constexpr):
        NBLK_A: gl.constexpr = KA // (_G * GROUPS)
        NBLK_B: gl.constexpr = KB // (_G * GROUPS)
        ring_q, ring_x, scratch, ready, empty = _ring(xa_desc, C, S, C, BM, GROUPS, 1)
        pid = gl.program_id(0)
        start_a = pid * PER_A
        count_a = gl.maximum(gl.minimum(UNITS_A - start_a, PER_A), 0)
        start_b = pid * PER_B
        count_b = gl.maximum(gl.minimum(UNITS_B - start_b, PER_B), 0)
        gl.warp_specialize([
            (_consume_mlp, (0, sa_ptr, h_ptr, wsa_ptr, cnta_ptr, parta_ptr, sb_ptr, out_ptr, wsb_ptr, cntb_ptr,
                            res_ptr, nw_ptr, rows_ptr, partb_ptr, done_ptr, ring_q, ring_x, scratch, ready, empty,
                            start_a, count_a, start_b, count_b, M, NA, KA, PER_A, PARTS, stride_h, NB, PER_B,
                            stride_om, eps, NBLK_A, NBLK_B, C, S, RMS, PBLOCK, BM, PDL, GROUPS, U0, U1, U2, U3)),
            (_consume_mlp, (1, sa_ptr, h_ptr, wsa_ptr, cnta_ptr, parta_ptr, sb_ptr, out_ptr, wsb_ptr, cntb_ptr,
                            res_ptr, nw_ptr, rows_ptr, partb_ptr, done_ptr, ring_q, ring_x, scratch, ready, empty,
                            start_a, count_a, start_b, count_b, M, NA, KA, PER_A, PARTS, stride_h, NB, PER_B,
                            stride_om, eps, NBLK_A, NBLK_B, C, S, RMS, PBLOCK, BM, PDL, GROUPS, U0, U1, U2, U3)),
            (_loader_mlp, (qa_desc, xa_desc, qb_desc, xb_desc, ring_q, ring_x, ready, empty, start_a, count_a,
                           start_b, count_b, NA, NB, done_ptr, exit_ptr, ARRIVALS, gl.num_programs(0), NBLK_A,
                           NBLK_B, C, S, BM, PDL, GROUPS))],
            [4, 1], [CREGS, LREGS])


def plan(n: int, k: int, sms: int, consumers: int = CONSUMERS, block_m: int = BM,
         bits: int = 4) -> tuple[int, int, int, int]:
    """(stages, units, units per program, most pieces a tile is cut into: 1 where every run is whole tiles) of a
    launch over W [n, k] of `bits`-bit codes (a [gate; up] one: as many tile groups, of half the channels)."""
    groups = 16 // bits
    stages = min(8, footprint(consumers, block_m)[1] // (consumers * BN * G * 2 + block_m * G * groups * 2))
    nblk = k // (G * groups)
    units = -(-n // (consumers * BN)) * nblk
    per = -(-units // sms)
    return stages, units, per, 1 if per % nblk == 0 else -(-nblk // per) + 1


def launch(x2: torch.Tensor, pw: PackedWeight, out: torch.Tensor, epi, consumers: int = CONSUMERS,
           block_m: int = BM, l2_ahead: int = 0, overlap_dots: bool = False) -> bool:
    """x2 [M, K] @ W^T into out through `epi` (quant_matmul_triton.Epilogue) with 2 or 3 consumer warpgroups;
    `usable(x2, pw, block_m)` must hold; under PDL the loader first fetches the l2_ahead units after its ring's
    into L2; overlap_dots: the group dots' wgmma issued asynchronously in pieces (`_overlapped_dots`). False, with
    one note on stderr, where the kernel does not build: nothing was launched."""
    m, k = x2.shape
    sms = sm_count(x2.device)
    stages, units, per, pieces = plan(pw.n, k, sms, consumers, block_m, pw.bits)
    registers = footprint(consumers, block_m)[0]
    q_rows, width = BN // 2 if epi.kind == 2 else BN, pw.group_size  # a box: one block's int16 columns
    q_desc = TensorDescriptor.from_tensor(pw.q, [q_rows, width],
                                          gl.NVMMASharedLayout.get_default_for([q_rows, width], gl.int16))
    x_desc = TensorDescriptor.from_tensor(x2, [block_m, width],
                                          gl.NVMMASharedLayout.get_default_for([block_m, width], gl.bfloat16))
    ws = torch.empty(pieces * m * pw.n, dtype=torch.float32, device=x2.device)
    cnt = arrival_counters(x2.device, -(-pw.n // (consumers * BN)) * consumers)
    parts = ws if epi.partials is None else epi.partials
    return _built(lambda: _ws_kernel[(sms,)](
        q_desc, x_desc, pw.q, pw.s, out, ws, cnt,
        *(out if t is None else t for t in (epi.residual, epi.weight, epi.rows)), parts, m, pw.n, units, per,
        parts.shape[0], out.stride(0), epi.eps, K=k, C=consumers, BM=block_m, S=stages,
        EPI=epi.kind, RMS=epi.rms, PBLOCK=triton.next_power_of_2(parts.shape[0]) if epi.rms else 1,
        CREGS=registers[1], LREGS=registers[2], BOXES=G // pw.group_size, L2AHEAD=l2_ahead, OVERLAP=overlap_dots,
        **unpacking(pw.bits, pw.codes == "e4m3"), num_warps=4, maxnreg=registers[0], **pdl.options(x2)), _BROKEN,
        "the warp-specialized W4A16 kernel", "the Triton kernel runs its launches")


def _built(launch_kernel, broken: list, what: str, instead: str) -> bool:
    """Runs launch_kernel; False, with one note on stderr and the reason kept in `broken`, where another Triton's
    Gluon does not build the kernel (nothing was launched)."""
    try:
        launch_kernel()
    except (CompilationError, OutOfResources, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and "PassManager" not in str(exc):
            raise  # not a compiler pass: a launch's error is the caller's
        broken.append(str(exc).splitlines()[0])
        print(f"blockspec: {what} does not build with triton {triton.__version__} ({broken[0][:120]}); {instead}",
              file=sys.stderr)
        return False
    return True


def mlp_usable(x2: torch.Tensor, gate_up: PackedWeight, down: PackedWeight) -> bool:
    """Whether one launch (`launch_mlp`) serves a SwiGLU MLP of x2's rows: gate_up and down both usable in the
    lean program (1..8 rows) with 4-bit codes, down's inputs gate_up's SwiGLU outputs, and the kernel builds."""
    return (not _MLP_BROKEN and gate_up.bits == down.bits == 4 and gate_up.n == 2 * down.k
            and usable(x2, gate_up, 8) and usable(x2, down, 8))


def launch_mlp(x2: torch.Tensor, gate_up: PackedWeight, down: PackedWeight, h: torch.Tensor, out: torch.Tensor,
               rms: tuple[torch.Tensor, float] | None, residual: torch.Tensor, weight: torch.Tensor,
               rows: torch.Tensor, partials: torch.Tensor) -> bool:
    """One launch of the MLP with the next norm begun: h = silu(gate) * up of x2 (scaled by 1 / rms where `rms`
    holds the previous launch's partials), then out = residual + h @ down^T, rows = out * (1 + weight) and the
    per-tile sums of out^2 into partials, as `launch` does them in two (the lean program's units, plans and
    epilogues, bit for bit). Every program streams an equal run of gate_up's units, then of down's: its loader
    copies down's first stages' codes while gate_up's last tiles finish, and down's x (h) once every consumer has
    stored its gate_up tiles (an arrival counter). False, with one note on stderr, where the kernel does not
    build: nothing was launched."""
    m = x2.shape[0]
    sms = sm_count(x2.device)
    stages, units_a, per_a, pieces_a = plan(gate_up.n, gate_up.k, sms, CONSUMERS, 8, 4)
    _, units_b, per_b, pieces_b = plan(down.n, down.k, sms, CONSUMERS, 8, 4)
    registers = LEAN[0]
    layout = gl.NVMMASharedLayout.get_default_for
    qa = TensorDescriptor.from_tensor(gate_up.q, [BN // 2, G], layout([BN // 2, G], gl.int16))
    qb = TensorDescriptor.from_tensor(down.q, [BN, G], layout([BN, G], gl.int16))
    xa = TensorDescriptor.from_tensor(x2, [8, G], layout([8, G], gl.bfloat16))
    xb = TensorDescriptor.from_tensor(h, [8, G], layout([8, G], gl.bfloat16))
    tiles_a, tiles_b = -(-gate_up.n // (CONSUMERS * BN)), -(-down.n // (CONSUMERS * BN))
    cnt = arrival_counters(x2.device, (tiles_a + tiles_b) * CONSUMERS + 2)
    ws_a = torch.empty(pieces_a * m * gate_up.n, dtype=torch.float32, device=x2.device)
    ws_b = torch.empty(pieces_b * m * down.n, dtype=torch.float32, device=x2.device)
    flags = cnt[(tiles_a + tiles_b) * CONSUMERS:]
    parts_in = partials if rms is None else rms[0]
    return _built(lambda: _mlp_kernel[(sms,)](
        qa, xa, qb, xb, gate_up.s, h, ws_a, cnt, parts_in, down.s, out, ws_b, cnt[tiles_a * CONSUMERS:], residual,
        weight, rows, partials, flags, flags[1:], m, gate_up.n, down.n, units_a, per_a, units_b, per_b,
        parts_in.shape[0], h.stride(0), out.stride(0), 0.0 if rms is None else rms[1], sms * CONSUMERS, KA=gate_up.k,
        KB=down.k,
        C=CONSUMERS, BM=8, S=stages, RMS=rms is not None,
        PBLOCK=triton.next_power_of_2(parts_in.shape[0]) if rms is not None else 1, CREGS=registers[1],
        LREGS=registers[2], **unpacking(4), num_warps=4, maxnreg=registers[0], **pdl.options(x2)),
        _MLP_BROKEN, "the warp-specialized MLP kernel", "its two projections launch apart")


def unpacking(bits: int, e4m3: bool = False) -> dict:
    """The kernel's constexprs for `bits`-bit codes (e4m3: float8 values): its groups a K block and each group's
    PTX unpacking (unpack_ptx.py; unused ones empty)."""
    groups = 16 // bits
    return dict(GROUPS=groups, **{f"U{i}": unpack_asm(bits, i, False, e4m3) if i < groups else "" for i in range(4)})
