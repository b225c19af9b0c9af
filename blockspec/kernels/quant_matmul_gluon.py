"""The weight-only quantized projection (int4 group 128, symmetric; also 8-bit codes: e4m3, int8) of bf16 rows on
Hopper, warp-specialized in Gluon: the same y = x @ dequant(W)^T and epilogues as `quant_matmul_triton._wq_kernel`,
whose plain PyTorch reference is quant_matmul.py. The config table takes it for INT4 projections of 1..8 and
17..32 rows.

Kernel
------
  One program per SM, three partitions:
  * a loader warp streams stages (the C consumers' [64, 128] int16 code tiles of one K block: 4 groups of 128 inputs
    for 4-bit codes, 2 for 8-bit; and x's block, one [BM, 128] box a group) through TMA into a ring of S
    shared-memory slots, each with a `ready` and an `empty` mbarrier;
  * C consumer warpgroups (4 warps each) take their 64-row tile of every stage: the block's group dots as wgmma
    with the dequantized codes (unpack_ptx.py) as the register operand and the shared x block as the other, each
    group's fp32 dot times its scale added in group order (the Triton kernel's arithmetic), then release the slot.
  The program walks a contiguous run of (tile group, K block) units in tile-major order, an equal share of all
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
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
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


def usable(x2: torch.Tensor, pw: PackedWeight, block_m: int = BM, consumers: int = CONSUMERS) -> bool:
    """Whether this kernel serves x2 @ W^T with 2 or 3 consumers and x blocks of block_m rows: Hopper, bf16
    activations of at most block_m rows (8, 16 or 32) at a 16-byte aligned address (TMA), 4- or 8-bit group 128
    codes without zero points (int4, int8, e4m3), K in whole blocks (512 or 256 columns), and the kernel builds
    with this Triton. (The config table takes it for int4 at 1..8 and 17..32 rows.)"""
    return (gluon is not None and not _BROKEN and x2.is_cuda and consumers in (2, 3) and block_m in (8, 16, 32)
            and x2.shape[0] <= block_m and x2.dtype == torch.bfloat16 and x2.data_ptr() % 16 == 0
            and pw.bits in (4, 8) and pw.group_size == G and pw.z is None and pw.k % (G * 16 // pw.bits) == 0
            and _hopper(x2.device))


@functools.cache
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


if gluon is not None:
    _BN, _G = gl.constexpr(BN), gl.constexpr(G)

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
                EPI: gl.constexpr, GROUPS: gl.constexpr):
        """The GROUPS scales of unit u's block for consumer c's rows (4-bit codes: 4, 8-bit: 2, then 2 unread)."""
        n, ok = _rows(u // NBLK, c, rows, N, C, EPI)
        sc = s_ptr + (u % NBLK) * N * GROUPS + n * GROUPS
        m = ok & live
        s0, s1 = gl.load(sc, mask=m, other=0.0), gl.load(sc + 1, mask=m, other=0.0)
        if GROUPS == 4:
            return s0, s1, gl.load(sc + 2, mask=m, other=0.0), gl.load(sc + 3, mask=m, other=0.0)
        return s0, s1, s0, s1

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
    def _consume(c: gl.constexpr, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q,
                 ring_x, scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps,
                 NBLK: gl.constexpr, C: gl.constexpr, S: gl.constexpr, EPI: gl.constexpr, RMS: gl.constexpr,
                 PBLOCK: gl.constexpr, BM: gl.constexpr, PDL: gl.constexpr, GROUPS: gl.constexpr,
                 U0: gl.constexpr, U1: gl.constexpr, U2: gl.constexpr, U3: gl.constexpr):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        rows = gl.arange(0, _BN, layout=gl.SliceLayout(1, mma))
        cols = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        zero = gl.zeros([_BN, BM], gl.float32, layout=mma)
        acc = gl.zeros([_BN, BM], gl.float32, layout=mma)
        inv_rms = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(0, mma))
        nx = _scales(s_ptr, start, count > 0, N, rows, NBLK, C, c, EPI, GROUPS)  # one unit ahead: DRAM latency
        pdl.wait(PDL)  # before the previous kernel's outputs: the partials, the residual
        if RMS:  # the input rows' 1 / rms from the previous launch's per-tile sums of squares
            sums_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
            p_rows = gl.arange(0, PBLOCK, layout=gl.SliceLayout(1, sums_layout))
            p_cols = gl.arange(0, BM, layout=gl.SliceLayout(0, sums_layout))
            sums = gl.load(part_ptr + p_rows[:, None] * M + p_cols[None, :],
                           mask=(p_rows < PARTS)[:, None] & (p_cols < M)[None, :], other=0.0)
            inv_rms = gl.convert_layout(gl.rsqrt(gl.sum(sums, axis=0) / K + eps), gl.SliceLayout(0, mma))
        for j in range(count):
            u = start + j
            t = u // NBLK
            b = u % NBLK
            s0, s1, s2, s3 = nx
            nx = _scales(s_ptr, u + 1, j + 1 < count, N, rows, NBLK, C, c, EPI, GROUPS)
            slot = j % S
            mbarrier.wait(ready.index(slot), (j // S) & 1)
            h = ring_q.index(slot * C + c).load(a_layout)
            a = gl.inline_asm_elementwise(U0, "=r,r", [h], dtype=gl.bfloat16, is_pure=True, pack=2)
            acc += warpgroup_mma(a, ring_x.index(slot * GROUPS).permute((1, 0)), zero, use_acc=False) \
                * s0.to(gl.float32)[:, None]
            a = gl.inline_asm_elementwise(U1, "=r,r", [h], dtype=gl.bfloat16, is_pure=True, pack=2)
            acc += warpgroup_mma(a, ring_x.index(slot * GROUPS + 1).permute((1, 0)), zero, use_acc=False) \
                * s1.to(gl.float32)[:, None]
            if GROUPS == 4:
                a = gl.inline_asm_elementwise(U2, "=r,r", [h], dtype=gl.bfloat16, is_pure=True, pack=2)
                acc += warpgroup_mma(a, ring_x.index(slot * 4 + 2).permute((1, 0)), zero, use_acc=False) \
                    * s2.to(gl.float32)[:, None]
                a = gl.inline_asm_elementwise(U3, "=r,r", [h], dtype=gl.bfloat16, is_pure=True, pack=2)
                acc += warpgroup_mma(a, ring_x.index(slot * 4 + 3).permute((1, 0)), zero, use_acc=False) \
                    * s3.to(gl.float32)[:, None]
            fence_async_shared()  # the slot's reads before the loader's next TMA writes
            mbarrier.arrive(empty.index(slot), count=1)
            flush = (b == NBLK - 1) | (j == count - 1)
            if flush:
                n, n_ok = _rows(t, c, rows, N, C, EPI)
                _finish(acc, inv_rms, scratch.index(c if EPI == 2 else 0), out_ptr, ws_ptr, cnt_ptr, res_ptr,
                        nw_ptr, rows_ptr, part_ptr, t, n, n_ok, cols, M, N, PER, stride_om, NBLK, C, c, EPI, RMS, BM)
            acc = gl.where(flush, zero, acc)
        pdl.release(PDL)

    @gluon.jit
    def _load_codes(q_desc, ring_q, bar, slot, t, b, N, C: gl.constexpr, EPI: gl.constexpr, BM: gl.constexpr,
                    GROUPS: gl.constexpr):
        """A stage's expected bytes (codes and x) on its `ready` barrier, then its code tiles' copies."""
        mbarrier.expect(bar, C * _BN * _G * 2 + GROUPS * BM * _G * 2)
        for c in gl.static_range(C):
            if EPI == 2:  # 32 gate rows, then the same channels' up rows
                ch = (t * C + c) * (_BN // 2)
                tma.async_copy_global_to_shared(q_desc, [ch, b * _G], bar,
                                                ring_q.index(slot * C + c).slice(0, _BN // 2))
                tma.async_copy_global_to_shared(q_desc, [N // 2 + ch, b * _G], bar,
                                                ring_q.index(slot * C + c).slice(_BN // 2, _BN // 2))
            else:
                tma.async_copy_global_to_shared(q_desc, [(t * C + c) * _BN, b * _G], bar, ring_q.index(slot * C + c))

    @gluon.jit
    def _loader(q_desc, x_desc, ring_q, ring_x, ready, empty, start, count, N, NBLK: gl.constexpr, C: gl.constexpr,
                S: gl.constexpr, EPI: gl.constexpr, BM: gl.constexpr, PDL: gl.constexpr, GROUPS: gl.constexpr):
        """The worker partition that streams the stages. The first S stages' codes are model weights, copied before
        the previous kernel has finished (PDL); x, its output, only after."""
        for j in range(gl.minimum(count, S)):
            _load_codes(q_desc, ring_q, ready.index(j), j, (start + j) // NBLK, (start + j) % NBLK, N, C, EPI, BM,
                        GROUPS)
        pdl.wait(PDL)
        for j in range(count):
            b = (start + j) % NBLK
            slot = j % S
            if j >= S:
                mbarrier.wait(empty.index(slot), ((j // S) & 1) ^ 1)
                _load_codes(q_desc, ring_q, ready.index(slot), slot, (start + j) // NBLK, b, N, C, EPI, BM, GROUPS)
            for i in gl.static_range(GROUPS):
                tma.async_copy_global_to_shared(x_desc, [0, (b * GROUPS + i) * _G], ready.index(slot),
                                                ring_x.index(slot * GROUPS + i))
        pdl.release(PDL)

    @gluon.jit
    def _ws_kernel(q_desc, x_desc, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, M, N,
                   UNITS, PER, PARTS, stride_om, eps, K: gl.constexpr, C: gl.constexpr, BM: gl.constexpr,
                   S: gl.constexpr, EPI: gl.constexpr, RMS: gl.constexpr, PBLOCK: gl.constexpr,
                   PDL: gl.constexpr, CREGS: gl.constexpr, LREGS: gl.constexpr, GROUPS: gl.constexpr,
                   U0: gl.constexpr, U1: gl.constexpr, U2: gl.constexpr, U3: gl.constexpr,
                   num_warps: gl.constexpr):
        NBLK: gl.constexpr = K // (_G * GROUPS)
        ring_q = gl.allocate_shared_memory(gl.int16, [S * C, _BN, _G],
                                           gl.NVMMASharedLayout.get_default_for([_BN, _G], gl.int16))
        ring_x = gl.allocate_shared_memory(gl.bfloat16, [S * GROUPS, BM, _G], x_desc.layout)
        scratch = gl.allocate_shared_memory(gl.float32, [C if EPI == 2 else 1, _BN, BM],
                                            gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(S):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=C)
        start = gl.program_id(0) * PER
        count = gl.maximum(gl.minimum(UNITS - start, PER), 0)
        # (the argument tuples are written out in each call: a tuple held in a variable loses its constexprs)
        if C == 2:
            gl.warp_specialize([
                (_consume, (0, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q, ring_x,
                            scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps, NBLK, C, S, EPI,
                            RMS, PBLOCK, BM, PDL, GROUPS, U0, U1, U2, U3)),
                (_consume, (1, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q, ring_x,
                            scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps, NBLK, C, S, EPI,
                            RMS, PBLOCK, BM, PDL, GROUPS, U0, U1, U2, U3)),
                (_loader, (q_desc, x_desc, ring_q, ring_x, ready, empty, start, count, N, NBLK, C, S, EPI, BM, PDL,
                           GROUPS))],
                [4, 1], [CREGS, LREGS])
        else:
            gl.warp_specialize([
                (_consume, (0, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q, ring_x,
                            scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps, NBLK, C, S, EPI,
                            RMS, PBLOCK, BM, PDL, GROUPS, U0, U1, U2, U3)),
                (_consume, (1, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q, ring_x,
                            scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps, NBLK, C, S, EPI,
                            RMS, PBLOCK, BM, PDL, GROUPS, U0, U1, U2, U3)),
                (_consume, (2, s_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, nw_ptr, rows_ptr, part_ptr, ring_q, ring_x,
                            scratch, ready, empty, start, count, M, N, K, PER, PARTS, stride_om, eps, NBLK, C, S, EPI,
                            RMS, PBLOCK, BM, PDL, GROUPS, U0, U1, U2, U3)),
                (_loader, (q_desc, x_desc, ring_q, ring_x, ready, empty, start, count, N, NBLK, C, S, EPI, BM, PDL,
                           GROUPS))],
                [4, 4, 1], [CREGS, CREGS, LREGS])


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
           block_m: int = BM) -> bool:
    """x2 [M, K] @ W^T into out through `epi` (quant_matmul_triton.Epilogue) with 2 or 3 consumer warpgroups;
    `usable(x2, pw, block_m)` must hold. False, with one note on stderr, where the kernel does not build: nothing
    was launched."""
    m, k = x2.shape
    sms = sm_count(x2.device)
    stages, units, per, pieces = plan(pw.n, k, sms, consumers, block_m, pw.bits)
    registers = footprint(consumers, block_m)[0]
    q_rows = BN // 2 if epi.kind == 2 else BN
    q_desc = TensorDescriptor.from_tensor(pw.q, [q_rows, G],
                                          gl.NVMMASharedLayout.get_default_for([q_rows, G], gl.int16))
    x_desc = TensorDescriptor.from_tensor(x2, [block_m, G],
                                          gl.NVMMASharedLayout.get_default_for([block_m, G], gl.bfloat16))
    ws = torch.empty(pieces * m * pw.n, dtype=torch.float32, device=x2.device)
    cnt = arrival_counters(x2.device, -(-pw.n // (consumers * BN)) * consumers)
    parts = ws if epi.partials is None else epi.partials
    try:
        _ws_kernel[(sms,)](q_desc, x_desc, pw.s, out, ws, cnt,
                           *(out if t is None else t for t in (epi.residual, epi.weight, epi.rows)), parts,
                           m, pw.n, units, per, parts.shape[0], out.stride(0), epi.eps, K=k, C=consumers, BM=block_m,
                           S=stages, EPI=epi.kind, RMS=epi.rms,
                           PBLOCK=triton.next_power_of_2(parts.shape[0]) if epi.rms else 1,
                           CREGS=registers[1], LREGS=registers[2], **unpacking(pw.bits, pw.codes == "e4m3"),
                           num_warps=4, maxnreg=registers[0], **pdl.options(x2))
    except (CompilationError, OutOfResources, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and "PassManager" not in str(exc):
            raise  # not a compiler pass: a launch's error is the caller's
        # another Triton's Gluon: nothing was launched; the Triton kernel takes over
        _BROKEN.append(str(exc).splitlines()[0])
        print(f"blockspec: the warp-specialized W4A16 kernel does not build with triton {triton.__version__} "
              f"({_BROKEN[0][:120]}); the Triton kernel runs its launches", file=sys.stderr)
        return False
    return True


def unpacking(bits: int, e4m3: bool = False) -> dict:
    """The kernel's constexprs for `bits`-bit codes (e4m3: float8 values): its groups a K block and each group's
    PTX unpacking (unpack_ptx.py; unused ones empty)."""
    groups = 16 // bits
    return dict(GROUPS=groups, **{f"U{i}": unpack_asm(bits, i, False, e4m3) if i < groups else "" for i in range(4)})
