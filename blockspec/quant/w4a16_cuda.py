"""W4A16 matmul for 1..16 activation rows as a CUDA kernel (w4a16_cuda.cu), compiled at first use with NVRTC.

Status: a measured alternative, NOT used by the engine (Int4Linear runs w4a16_triton). It has the epilogues the
step's projections run with (rms scaling, SwiGLU, add_norm: layers/folded_norm.py; `matmul(rms=)`, `matmul_swiglu`,
`matmul_add_norm`; the kind a template parameter), correct against the Triton kernel's on the GPU
(tests/test_cuda.py). Session 11 (docs/benchmarks.md): with them, 1-8 rows, it is 1.03-1.09x Triton on out_proj
add_norm and gate_up SwiGLU, ~1.0x on down and in_proj, 0.74-0.85x at 16 rows: ~3 % of the INT4 step at best, not
worth a second weight layout and an NVRTC build in the engine.
Session 10 wrote it to test whether a hand-written kernel gets the projections nearer the bandwidth than Triton
(session 9: those launches are bound per program). H200, bench/w4a16_cuda.py run 12, docs/benchmarks.md "Session 10":
  * 1-8 rows (nvcc builds of the kernel before the epilogues): 1.02-1.37x the Triton kernel on every per-layer
    shape (gate_up 31.1 vs 33.7 us, down 18.2 vs 20.0, o 8.2 vs 10.1, gdn_z 7.8 vs 10.7), more when chained with
    programmatic dependent launch (PDL: a warp's first chunk loads are issued before it waits on its predecessor;
    o 7.0 us, gate_up 30.2); the vocabulary head 0.97x;
  * 16 rows: 0.72-0.90x, but for the 16 MB shapes (1.10-1.15x);
  * its math costs 25-40 % over its loads alone (-DW4A16_LOADS_ONLY: gate_up 87-97 % of the bandwidth with PDL).
  Dropped forms (measured slower): a warp's loads all at once (run 1), stream-K ranges (run 3), rings of 8-32 in
  registers or in shared memory (runs 5, 9), 128 + u operands with an all-ones MMA for the x sums (run 11).

Kernel: a warp owns a strip of 16 output features and a range of 64-input chunks; it keeps `ring` chunk loads in
flight in registers (refilled as each is consumed; 4 measured best), issued before `griddepcontrol.wait`. A block
holds `n_warps` strips x `k_warps` chunk ranges (summed in shared memory, fixed order); `k_splits` blocks along K
are summed through a fp32 workspace by the last to arrive (fixed order). The weight is the MMA's A operand (16
features x 16 inputs), x^T its B operand (16 inputs x 8 rows): one mma.m16n8k16 serves 8 rows, two serve 16.

Layout "mma" (`pack`; `unpack_codes` inverts it): int4 group 128, K a multiple of 128, N a multiple of 16.
  qw int32 [N/16, K/64, 32, 4]: strip s (features 16s..16s+15), chunk c (inputs 64c..64c+63), lane l = 4*g + t,
     word j; nibble p = i + 4e (i = hr + 2h) of the word holds the unsigned code u = q + 8 of
        feature 16s + g + 8*hr,  input 64c + 16t + 4j + 2h + e.
     Why: word j is lane l's A fragment of mma.m16n8k16 number j of the chunk (register i: row g + 8*(i&1),
     columns 2t + 8*(i>>1) + {0, 1} of a permuted K order), so `lop3` of (w >> 4i) with 0x000F000F | 0x43004300
     gives register i as bf16 128 + u, and lane l's B fragments (x) for the whole chunk are the 16 contiguous
     inputs 64c + 16t .. +15 of its row: two 16-byte loads.
  sc int32 [N/16, K/128, 8]: bf16 pairs (scale of feature 16s + g, scale of 16s + g + 8) for each group.
  zc like sc or None: bf16 pairs -(128 + z), z the unsigned zero point (symmetric: z = 8, built into the kernel).
Numerics: per group of 128 inputs, part = (u - z) @ x^T exactly in bf16 MMA operands with fp32 accumulation, then
acc += part * scale (fp32): the Triton kernel's numerics (not its summation order). A row's result does not depend
on the other rows, and the config is chosen by (M <= 8 or not, N, K), so row 0 of an 8-row launch == a 1-row launch.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels import arrival_counters

SOURCE = Path(__file__).with_name("w4a16_cuda.cu")
GROUP = 128
MAX_ROWS = 16


# ----------------------------------------------------------------------------------------------------------
# Layout (pure PyTorch)
# ----------------------------------------------------------------------------------------------------------

@dataclass
class MmaWeight:
    qw: torch.Tensor                # int32 [N/16, K/64, 32, 4]
    sc: torch.Tensor                # int32 [N/16, K/128, 8]
    zc: torch.Tensor | None         # like sc, or None (symmetric)
    n: int
    k: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qw, self.sc, self.zc) if t is not None)


def supports(n: int, k: int, bits: int = 4, group_size: int = GROUP) -> str | None:
    """None if the layout takes this weight, else why not."""
    if bits != 4 or group_size != GROUP:
        return f"int4 group {GROUP} only (got int{bits} group {group_size})"
    if n % 16 or k % GROUP:
        return f"N must be a multiple of 16 and K of {GROUP} (got N={n}, K={k})"
    return None


def _pairs(v: torch.Tensor) -> torch.Tensor:
    """[N, K/128] bf16 -> int32 [N/16, K/128, 8]: (feature g, feature g + 8) of each strip in one word."""
    n, groups = v.shape
    bits = v.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    b = bits.view(n // 16, 2, 8, groups).permute(0, 3, 2, 1)  # [strip, group, g, hr]
    return (b[..., 0] | (b[..., 1] << 16)).contiguous()


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None) -> MmaWeight:
    """Unsigned codes u [N, K] in 0..15, scales [N, K/128], unsigned zero points (same shape, or None) -> MmaWeight."""
    n, k = codes.shape
    why = supports(n, k)
    if why:
        raise ValueError(why)
    u = codes.to(torch.int64).view(n // 16, 2, 8, k // 64, 4, 4, 2, 2)  # [s, hr, g, c, t, j, h, e]
    u = u.permute(0, 3, 2, 4, 5, 7, 6, 1).reshape(n // 16, k // 64, 32, 4, 8)  # [s, c, l, j, p = hr + 2h + 4e]
    words = (u << (4 * torch.arange(8, device=u.device))).sum(-1)
    qw = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    zc = None if zeros is None else _pairs(-(128.0 + zeros.to(torch.float32)))
    return MmaWeight(qw.contiguous(), _pairs(scales), zc, n, k)


def unpack_codes(mw: MmaWeight) -> torch.Tensor:
    """Inverse of pack's code placement: unsigned codes [N, K]."""
    w = mw.qw.to(torch.int64) & 0xFFFFFFFF
    u = (w[..., None] >> (4 * torch.arange(8, device=w.device))) & 0xF  # [s, c, l, j, p]
    u = u.view(mw.n // 16, mw.k // 64, 8, 4, 4, 2, 2, 2)  # [s, c, g, t, j, e, h, hr]
    return u.permute(0, 7, 2, 1, 3, 4, 6, 5).reshape(mw.n, mw.k)


def swiglu_order(n: int) -> torch.Tensor:
    """Row order of a [gate; up] weight (n rows, n / 2 channels) for the swiglu epilogue: each 16-row strip holds 8
    gate rows, then the up rows of the same 8 channels, so that one lane holds both halves of a channel."""
    if n % 32:
        raise ValueError(f"a [gate; up] weight for the swiglu epilogue needs a multiple of 32 rows, got {n}")
    ch = torch.arange(n // 2).view(-1, 1, 8)
    return torch.cat([ch, ch + n // 2], dim=1).reshape(-1)


def from_q16(pw, swiglu: bool = False) -> MmaWeight:
    """A w4a16_triton.PackedWeight (q16 layout) in this layout; `swiglu`: a [gate; up] weight in `swiglu_order`."""
    from . import w4a16_triton as wq
    why = supports(pw.n, pw.k, pw.bits, pw.group_size)
    if why:
        raise ValueError(why)
    codes = wq.unpack_codes(pw.q, pw.bits, pw.group_size, pw.k)
    scales = wq.unpack_groups(pw.s, pw.k, pw.group_size)
    zeros = None if pw.z is None else wq.unpack_groups(pw.z, pw.k, pw.group_size)
    if swiglu:
        order = swiglu_order(pw.n).to(codes.device)
        codes, scales, zeros = codes[order], scales[order], None if zeros is None else zeros[order]
    return pack(codes, scales, zeros)


# ----------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CudaConfig:
    ring: int = 4            # D: 64-input chunks a warp keeps in flight
    k_warps: int = 4         # KS: warps of a block along K (summed in shared memory)
    n_warps: int = 1         # WS: strips of 16 features per block
    k_splits: int = 1        # blocks along K (summed through a fp32 workspace by the last to arrive)

    def short(self) -> str:
        return f"d{self.ring} k{self.k_warps} w{self.n_warps} s{self.k_splits}"

    def per_warp(self, k: int) -> int:
        """Chunks per warp (even: whole groups)."""
        per = math.ceil(k // 64 / (self.k_splits * self.k_warps))
        return per + per % 2


def default_config(m: int, n: int, k: int) -> CudaConfig:
    """The best of bench/w4a16_cuda.py's sweep on the H200 (session 10, runs 10-12): a ring of 4 and no K split;
    at 1-8 rows 8 warps along K for the 16 MB and the long-row (down) shapes, else 4; at 9-16 rows 4 warps along K
    and a ring of 8 for the 16 MB shapes."""
    if m <= 8:
        return CudaConfig(4, 8 if n * k < 40_000_000 or k > 8192 else 4, 1)
    return CudaConfig(8 if n * k < 40_000_000 else 4, 4, 1)


# ----------------------------------------------------------------------------------------------------------
# Compile (NVRTC), load and launch (driver API)
# ----------------------------------------------------------------------------------------------------------

STORE, ADD_NORM, SWIGLU = 0, 1, 2  # epilogue kinds (a template parameter of the kernel)


def kernel_name(cfg: CudaConfig, nt: int, zp: bool, epi: int = STORE) -> str:
    return f"w4a16_d{cfg.ring}_k{cfg.k_warps}_w{cfg.n_warps}_t{nt}_z{int(zp)}_e{epi}"


def _entry(c: CudaConfig, nt: int, zp: bool, epi: int = STORE) -> str:
    return (f'extern "C" __global__ void __launch_bounds__({32 * c.k_warps * c.n_warps}) '
            f'{kernel_name(c, nt, zp, epi)}(W4A16_ARGS) {{ w4a16_body<{c.ring}, {c.k_warps}, {c.n_warps}, {nt}, '
            f'{str(zp).lower()}, {epi}>(W4A16_PASS); }}')


def source(kernels: list[tuple]) -> str:
    """The kernel template and one extern "C" entry point per (config, row tiles, zero points[, epilogue kind])."""
    entries = [_entry(*kernel) for kernel in kernels]
    return SOURCE.read_text() + "\n" + "\n".join(entries) + "\n"


def _nvrtc():
    """libnvrtc: the one PyTorch's CUDA build depends on (found by torch), else the system's."""
    try:
        from torch.cuda._utils import _get_gpu_rtc_library
        return _get_gpu_rtc_library()
    except (ImportError, OSError, AttributeError):
        pass
    for name in ("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("libnvrtc not found: the CUDA W4A16 kernel is compiled at first use with NVRTC")


def compile_cubin(src: str, arch: str, defines: tuple[str, ...] = ()) -> bytes:
    """NVRTC: source -> cubin for `arch` (e.g. "sm_90"); `defines`: -D options (diagnostic builds)."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _nvrtc_check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"w4a16_cuda.cu", 0, None, None))
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", *(f"-D{d}".encode() for d in defines)]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    if rc != 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC failed to compile w4a16_cuda.cu:\n{log.value.decode(errors='replace')}")
    size = ctypes.c_size_t()
    _nvrtc_check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
    buf = ctypes.create_string_buffer(size.value)
    _nvrtc_check(lib, lib.nvrtcGetCUBIN(prog, buf))
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw


def _nvrtc_check(lib, rc: int) -> None:
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC error {rc}: {lib.nvrtcGetErrorString(rc).decode()}")


@functools.lru_cache(maxsize=None)
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def _cu_check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"CUDA driver error {rc} in {what}")


class Module:
    """A loaded cubin and its entry points."""

    def __init__(self, cubin: bytes):
        torch.empty(1, device="cuda")  # a current CUDA context for the driver calls
        self.handle = ctypes.c_void_p()
        _cu_check(_libcuda().cuModuleLoadData(ctypes.byref(self.handle), cubin), "cuModuleLoadData")
        self.funcs: dict[str, ctypes.c_void_p] = {}

    def function(self, name: str) -> ctypes.c_void_p:
        if name not in self.funcs:
            f = ctypes.c_void_p()
            _cu_check(_libcuda().cuModuleGetFunction(ctypes.byref(f), self.handle, name.encode()),
                      f"cuModuleGetFunction({name})")
            self.funcs[name] = f
        return self.funcs[name]

    def registers(self, name: str) -> int:
        """Registers per thread of an entry point (CU_FUNC_ATTRIBUTE_NUM_REGS)."""
        v = ctypes.c_int()
        _cu_check(_libcuda().cuFuncGetAttribute(ctypes.byref(v), 4, self.function(name)), "cuFuncGetAttribute")
        return v.value


_MODULES: dict[tuple, Module] = {}


def module_for(kernels: tuple, device: torch.device) -> Module:
    """Compiled once per (kernel set, device capability)."""
    major, minor = torch.cuda.get_device_capability(device)
    key = (kernels, major, minor)
    if key not in _MODULES:
        _MODULES[key] = Module(compile_cubin(source(list(kernels)), f"sm_{major}{minor}"))
    return _MODULES[key]


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def cu_launch(func, grid: tuple, block: int, args: list, device: torch.device, pdl: bool = False) -> None:
    """cuLaunchKernel on the current stream; with `pdl`, cuLaunchKernelEx with programmatic stream serialization
    (the kernel may start before its predecessor finishes; it waits in griddepcontrol.wait)."""
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
    stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    gx, gy = grid
    if not pdl:
        _cu_check(_libcuda().cuLaunchKernel(func, gx, gy, 1, block, 1, 1, 0, stream, params, None), "cuLaunchKernel")
        return
    attr = _LaunchAttr(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    cfg = _LaunchConfig((ctypes.c_uint * 3)(gx, gy, 1), (ctypes.c_uint * 3)(block, 1, 1), 0, stream,
                        ctypes.pointer(attr), 1)
    _cu_check(_libcuda().cuLaunchKernelEx(ctypes.byref(cfg), func, params, None), "cuLaunchKernelEx")


class Epilogue(ctypes.Structure):  # the kernel's `Epilogue` (w4a16_cuda.cu says what each field does)
    _fields_ = [("rms_sums", ctypes.c_void_p), ("rms_p", ctypes.c_int), ("eps", ctypes.c_float),
                ("kind", ctypes.c_int), ("residual", ctypes.c_void_p), ("norm_weight", ctypes.c_void_p),
                ("rows", ctypes.c_void_p), ("parts", ctypes.c_void_p)]


def _rms_fields(rms: tuple[torch.Tensor, float] | None, m: int) -> dict:
    if rms is None:
        return {}
    sums, eps = rms
    if sums.dim() != 2 or sums.shape[1] != m or sums.dtype != torch.float32 or not sums.is_contiguous():
        raise ValueError(f"rms sums must be a contiguous fp32 [P, {m}] tensor, got {tuple(sums.shape)} {sums.dtype}")
    return dict(rms_sums=sums.data_ptr(), rms_p=sums.shape[0], eps=float(eps))


def launch(module: Module, x2: torch.Tensor, mw: MmaWeight, cfg: CudaConfig, out: torch.Tensor,
           pdl: bool = False, early_release: bool = False, epi: Epilogue | None = None) -> None:
    m = x2.shape[0]
    epi = epi or Epilogue()
    name = kernel_name(cfg, 1 if m <= 8 else 2, mw.zc is not None, epi.kind)
    grid = (-(-(mw.n // 16) // cfg.n_warps), cfg.k_splits)
    ws = torch.empty(cfg.k_splits * m * mw.n if cfg.k_splits > 1 else 1, dtype=torch.float32, device=x2.device)
    cnt = arrival_counters(x2.device, grid[0] + 1)  # per block column (K splits), then one for add_norm's sums
    ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (x2, mw.qw, mw.sc, mw.sc if mw.zc is None else mw.zc, out, ws,
                                                     cnt)]
    ints = [ctypes.c_int(v) for v in (x2.stride(0), m, out.stride(0), mw.n, mw.k, cfg.per_warp(mw.k),
                                      int(early_release))]
    args = [ptrs[0], ints[0], ints[1], ptrs[1], ptrs[2], ptrs[3], ptrs[4], ints[2], ptrs[5], ptrs[6], ints[3],
            ints[4], ints[5], ints[6], epi]
    cu_launch(module.function(name), grid, 32 * cfg.k_warps * cfg.n_warps, args, x2.device, pdl)


def _prepare(x: torch.Tensor, mw: MmaWeight, cfg: CudaConfig | None, module: Module | None, epi: int = STORE):
    if x.dim() != 2 or x.shape[1] != mw.k or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [1..{MAX_ROWS}, {mw.k}], got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16 or not x.is_cuda:
        raise ValueError(f"the CUDA W4A16 kernel takes bf16 CUDA activations, got {x.dtype} on {x.device}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:  # rows of 16-byte loads
        x = x.clone(memory_format=torch.contiguous_format)
    cfg = cfg or default_config(x.shape[0], mw.n, mw.k)
    if module is None:
        module = module_for(((cfg, 1 if x.shape[0] <= 8 else 2, mw.zc is not None, epi),), x.device)
    return x, cfg, module


def matmul(x: torch.Tensor, mw: MmaWeight, cfg: CudaConfig | None = None, out: torch.Tensor | None = None,
           module: Module | None = None, pdl: bool = False, early_release: bool = False,
           rms: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [M <= 16, K] bf16 (CUDA) @ dequant(W)^T -> [M, N] bf16; `rms` (sums [P, M], eps): each row scaled by
    1 / rms, rms = sqrt(sum of its P sums / K + eps) (the norm an add_norm launch began)."""
    x, cfg, module = _prepare(x, mw, cfg, module)
    if out is None:
        out = torch.empty(x.shape[0], mw.n, dtype=torch.bfloat16, device=x.device)
    elif tuple(out.shape) != (x.shape[0], mw.n) or out.dtype != torch.bfloat16 or out.stride(1) != 1:
        raise ValueError(f"out must be a bf16 [{x.shape[0]}, {mw.n}] tensor with unit column stride")
    launch(module, x, mw, cfg, out, pdl, early_release, Epilogue(**_rms_fields(rms, x.shape[0])))
    return out


def matmul_swiglu(x: torch.Tensor, mw: MmaWeight, cfg: CudaConfig | None = None, module: Module | None = None,
                  pdl: bool = False, rms: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """silu(gate) * up [M, N / 2] of a [gate; up] weight packed in `swiglu_order` (from_q16(..., swiglu=True))."""
    x, cfg, module = _prepare(x, mw, cfg, module, SWIGLU)
    out = torch.empty(x.shape[0], mw.n // 2, dtype=torch.bfloat16, device=x.device)
    launch(module, x, mw, cfg, out, pdl, False, Epilogue(kind=SWIGLU, **_rms_fields(rms, x.shape[0])))
    return out


def matmul_add_norm(x: torch.Tensor, mw: MmaWeight, residual: torch.Tensor, norm_weight: torch.Tensor,
                    cfg: CudaConfig | None = None, module: Module | None = None, pdl: bool = False):
    """(out = residual + x @ W^T, rows = out * (1 + norm_weight), sums [1, M] of out^2 per row) in one launch: what
    w4a16_triton.wq_matmul_add_norm returns, its per-tile sums already added (in block order)."""
    x, cfg, module = _prepare(x, mw, cfg, module, ADD_NORM)
    m = x.shape[0]
    if (tuple(residual.shape) != (m, mw.n) or residual.dtype != torch.bfloat16 or tuple(norm_weight.shape) != (mw.n,)
            or norm_weight.dtype != torch.bfloat16):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} / norm weight {tuple(norm_weight.shape)} "
                         f"{norm_weight.dtype} do not match the bf16 output [{m}, {mw.n}]")
    out, rows = (torch.empty(m, mw.n, dtype=torch.bfloat16, device=x.device) for _ in range(2))
    blocks = -(-(mw.n // 16) // cfg.n_warps)
    parts = torch.empty(blocks + 1, m, dtype=torch.float32, device=x.device)
    residual, weight = residual.contiguous(), norm_weight.contiguous()
    epi = Epilogue(kind=ADD_NORM, residual=residual.data_ptr(), norm_weight=weight.data_ptr(), rows=rows.data_ptr(),
                   parts=parts.data_ptr())
    launch(module, x, mw, cfg, out, pdl, False, epi)
    return out, rows, parts[blocks:]
