"""The warp-specialized W4A16 kernel (kernels/quant_matmul_gluon.py) on the CPU: where the config table sends launches
to it, how its schedule covers the weights, and its sm_90 code compiled here by Gluon's compiler. Its numerics
against the Triton kernel run on the GPU (tests/test_cuda.py)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockspec.kernels import quant_matmul_gluon as gk
from blockspec.kernels import quant_matmul_triton as wq
from blockspec.quant.int4 import Int4Linear

SHAPES = {"gate_up": (34816, 5120), "down": (5120, 17408), "gdn_in": (16480, 5120), "o": (5120, 6144),
          "qkv": (14336, 5120)}


class Refusing:
    """A kernel that another Triton's Gluon does not build: each launch raises the compiler's error."""

    def __getitem__(self, grid):
        def compile_and_launch(*args, **kwargs):
            from triton.compiler.errors import CompilationError
            raise CompilationError("", None, "unsupported op")
        return compile_and_launch


def test_config_table_sends_tree_rows_and_few_rows_of_int4_and_fp8_to_it():
    """17..32 rows of every INT4 layer projection, and 1..8 rows, whose x blocks of 8 rows take the lean footprint;
    not 9..16 or 33.. rows or the vocabulary head. 8-bit codes of group 128 (FP8): 1..8 rows of the layer
    projections, lean; not 9.. rows. The drafter's int8 group 32: its
    wide outputs (gate_up) and long rows (down) at 1..8 rows, lean, and every projection at 9..32 rows; down keeps
    the Triton kernel's 128-row tiles for where the program does not serve."""
    for n, k in SHAPES.values():
        for m in (17, 24, 32):
            assert wq.default_config(m, n, k).warp_specialized == gk.CONSUMERS, (n, k, m)
        for m in (1, 8):
            cfg = wq.default_config(m, n, k)
            assert cfg.warp_specialized == 2 and cfg.block_m == 8 and gk.footprint(2, 8) == gk.LEAN, (n, k, m)
        for m in (16, 33, 64):
            assert not wq.default_config(m, n, k).warp_specialized, (n, k, m)
        for m in (16, 32):  # 8-bit codes at 9.. rows: the Triton kernel
            assert not wq.default_config(m, n, k, 8, 128).warp_specialized, (n, k, m)
        for m in (1, 8):
            cfg = wq.default_config(m, n, k, 8, 128)
            assert cfg.warp_specialized == 2 and cfg.block_m == 8 and cfg.block_n == gk.BN, (n, k, m)
    for m in (1, 8, 32):  # the vocabulary head: not measured there
        assert not wq.default_config(m, 248320, 5120).warp_specialized
        assert not wq.default_config(m, 248320, 5120, 8, 128).warp_specialized
    for n, k in ((6144, 5120), (5120, 4096), (34816, 5120), (5120, 17408)):  # the drafter's
        for m in (1, 8, 9, 16, 17, 32):
            cfg = wq.default_config(m, n, k, 8, 32)
            taken = m > 8 or n >= 16384 or k > 8192
            assert cfg.warp_specialized == (2 if taken else 0), (n, k, m)
            assert cfg.block_n == (128 if m <= 8 and n < 16384 else gk.BN), (n, k, m)
            assert cfg.block_m == (8 if m <= 8 else 16 if m <= 16 else 32) and gk.footprint(2, 8) == gk.LEAN


def test_add_norm_partials_hold_a_row_for_each_tile_of_the_kernel_that_runs(monkeypatch):
    """An add-norm launch's partials (one row a tile) count the 64-row tiles of the warp-specialized program where
    it runs, whatever the config's block_n (the Triton kernel's tiles, where it does not serve); where the program
    does not build, the Triton kernel runs in its tiles, so that every row of the partials is written."""
    from blockspec.quant.int8 import Int8Linear

    pw = Int8Linear.from_float(torch.randn(256, 8704) * 0.01, 32).packed()  # long rows, as down's
    cfg = wq.default_config(8, pw.n, pw.k, 8, 32)
    assert cfg.warp_specialized and cfg.block_n == 128
    x = torch.randn(8, pw.k, dtype=torch.bfloat16)
    assert wq.tile_rows(x, pw, cfg) == 128  # on the CPU: the Triton kernel
    monkeypatch.setattr(wq, "warp_specialized", lambda x2, pw, cfg: True)
    assert wq.tile_rows(x, pw, cfg) == gk.BN
    launched = []

    class Planned(Exception):
        pass

    def plan(x2, pw, cfg, out, epi):
        launched.append((cfg, epi.partials))
        raise Planned
    monkeypatch.setattr(gk, "launch", lambda *args: False)  # does not build
    monkeypatch.setattr(wq, "launch_plan", plan)
    with pytest.raises(Planned):
        wq.wq_matmul_add_norm(x, pw, torch.zeros(8, pw.n, dtype=torch.bfloat16), torch.zeros(pw.n))
    (ran, partials), = launched
    assert ran.block_n == gk.BN and partials.shape == (pw.n // gk.BN, 8)


def test_usable_only_for_its_launches(monkeypatch):
    """CUDA bf16 rows at a 16-byte address, up to the x block's rows, 4- or 8-bit group 128 codes or int8 group 32
    ones without zero points over whole units (512 columns for 4-bit codes, 256 for 8-bit), 2 or 3 consumers:
    anything else goes to the Triton kernel."""
    from blockspec.quant.fp8 import Fp8Linear, quantize
    from blockspec.quant.int8 import Int8Linear

    pw = Int4Linear.from_float(torch.randn(128, 1024) * 0.05).packed()
    x = torch.randn(25, 1024, dtype=torch.bfloat16)
    assert not gk.usable(x[:24], pw)  # CPU tensors
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(gk, "_hopper", lambda device: True)
    assert gk.usable(x[:24], pw) and gk.usable(x[:8], pw, 8, 3)
    refused = [gk.usable(x[:24].half(), pw), gk.usable(x[:24], pw, 16), gk.usable(x[:8], pw, 12),
               gk.usable(x[:8], pw, 8, 4), gk.usable(x[1:], pw),  # 1024 bf16 = 2 KB a row: x[1:] is aligned,
               gk.usable(x.view(-1)[1:1 + 24 * 1024].view(24, 1024), pw),  # this view is not
               gk.usable(x[:24], Int4Linear.from_float(torch.randn(128, 1024) * 0.05, symmetric=False).packed()),
               gk.usable(x[:24], Int4Linear.from_float(torch.randn(128, 1024) * 0.05, 64).packed()),
               gk.usable(x[:24, :640].contiguous(), Int4Linear.from_float(torch.randn(128, 640) * 0.05).packed()),
               gk.usable(x[:24, :640].contiguous(), Int8Linear.from_float(torch.randn(128, 640) * 0.05).packed()),
               gk.usable(x[:24], Int8Linear.from_float(torch.randn(128, 1024) * 0.05, 64).packed())]
    assert refused == [False, False, False, False, True, False, False, False, False, False, False], refused
    assert gk.usable(x[:24], Int8Linear.from_float(torch.randn(128, 1024) * 0.05).packed())  # group 32
    fp8 = Fp8Linear.from_blocks(*quantize(torch.randn(128, 768) * 0.05)).packed()
    assert gk.usable(x[:8, :768].contiguous(), fp8, 8)  # 3 blocks of 256
    assert gk.usable(x[:8, :768].contiguous(), Int8Linear.from_float(torch.randn(128, 768) * 0.05, 128).packed(), 8)
    assert not gk.usable(x[:8, :768].contiguous(), Int4Linear.from_float(torch.randn(128, 768) * 0.05).packed(), 8)


def test_a_kernel_that_does_not_build_hands_its_launches_back(monkeypatch, capsys):
    """Another Triton's Gluon may not build the kernel: the launch says so once on stderr, launches nothing, and
    the config's launches go to the Triton kernel from then on."""
    pytest.importorskip("triton.experimental.gluon")
    monkeypatch.setattr(gk, "_ws_kernel", Refusing())
    monkeypatch.setattr(gk, "_BROKEN", [])
    monkeypatch.setattr(gk, "_hopper", lambda device: True)
    pw = Int4Linear.from_float(torch.randn(256, 1024) * 0.05).packed()
    x, out = torch.randn(24, 1024, dtype=torch.bfloat16), torch.zeros(24, 256, dtype=torch.bfloat16)
    with monkeypatch.context() as cuda:
        cuda.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        assert gk.usable(x, pw) and not gk.usable(x, pw, 16) and not gk.usable(x[:8], pw, 12)
    assert not gk.launch(x, pw, out, wq.Epilogue()) and not out.any()
    assert "does not build" in capsys.readouterr().err and gk._BROKEN
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert not gk.usable(x, pw)


def test_an_mlp_launch_that_does_not_build_hands_back_to_the_two_launches(monkeypatch, capsys):
    """The MLP's one launch where another Triton's Gluon does not build it: one note on stderr, nothing launched,
    and from then on `mlp_usable` says no (the two launches serve), while the single projection's kernel stays."""
    pytest.importorskip("triton.experimental.gluon")
    monkeypatch.setattr(gk, "_mlp_kernel", Refusing())
    monkeypatch.setattr(gk, "_MLP_BROKEN", [])
    monkeypatch.setattr(gk, "_BROKEN", [])
    monkeypatch.setattr(gk, "_hopper", lambda device: True)
    gate_up = Int4Linear.from_float(torch.randn(2048, 512) * 0.05).packed()
    down = Int4Linear.from_float(torch.randn(512, 1024) * 0.05).packed()
    x, h = torch.randn(8, 512, dtype=torch.bfloat16), torch.zeros(8, 1024, dtype=torch.bfloat16)
    out, rows = torch.zeros(8, 512, dtype=torch.bfloat16), torch.zeros(8, 512, dtype=torch.bfloat16)
    partials = torch.zeros(8, 8)
    assert not gk.launch_mlp(x, gate_up, down, h, out, None, out.clone(), torch.zeros(512, dtype=torch.bfloat16),
                             rows, partials)
    assert not h.any() and not out.any() and not partials.any()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MLP kernel does not build" in err and "launch apart" in err
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert not gk.mlp_usable(x, gate_up, down) and gk.usable(x, gate_up, 8) and not gk._BROKEN


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("bits", [4, 8])
def test_schedule_covers_every_block_once(name, bits):
    """Programs take equal contiguous runs of (tile group, K block) units; a tile cut between runs has at most
    `pieces` of them, the workspace's depth."""
    n, k = SHAPES[name]
    for sms in (132, 114, 78):
        stages, units, per, pieces = gk.plan(n, k, sms, bits=bits)  # 2 consumers, 32 rows
        nblk = k // (gk.G * 16 // bits)
        assert units == -(-n // (gk.CONSUMERS * gk.BN)) * nblk and per == -(-units // sms)
        assert -(-units // per) <= sms  # every unit has a program
        owners = [u // per for u in range(units)]
        for t in range(units // nblk):
            streaming = len(set(owners[t * nblk:(t + 1) * nblk]))
            first = (t * nblk) // per  # the kernel's count of a tile's pieces (`_finish`)
            assert ((t + 1) * nblk - 1) // per - first + 1 == streaming <= pieces
        assert stages >= 2 and stages * (gk.CONSUMERS * gk.BN * gk.G * 2 + gk.BM * gk.G * 16 // bits * 2) <= gk.SMEM


@pytest.mark.parametrize("epi,rms,k,consumers,block_m,bits,e4m3", [
    (0, True, 5120, 2, 32, 4, False), (1, False, 17408, 2, 32, 4, False), (2, True, 5120, 2, 32, 4, False),
    (0, False, 5120, 3, 8, 4, False), (2, True, 5120, 3, 8, 4, False), (1, True, 17408, 2, 8, 4, False),
    (2, True, 5120, 2, 8, 8, True), (1, False, 17408, 2, 8, 8, True), (0, True, 5120, 2, 16, 8, False)])
def test_sm90_code(epi, rms, k, consumers, block_m, bits, e4m3):
    """Compiled for sm_90 on the CPU (bench/warp_specialized.py's compile): the group dots as m64nBMk16 wgmma, the
    stages through TMA (2 code boxes per consumer with the SwiGLU epilogue, one otherwise, and x's one per group),
    the codes unpacked as their format's (int4, int8, e4m3), the partitions' registers rebalanced, the split
    tiles' arrival counters, the shared memory within an SM's 227 KB."""
    pytest.importorskip("triton.experimental.gluon")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from warp_specialized import sm90_compile

    ptx, shared = sm90_compile(k, consumers, block_m, epi, rms, bits=bits, e4m3=e4m3)
    groups = 16 // bits
    dots = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_m}k16\.f32\.bf16\.bf16", ptx)
    assert len(dots) == 8 * groups * consumers  # 8 k16 steps a group and consumer
    codes = (2 if epi == 2 else 1) * consumers  # issued in two places: the first stages', then the loop's
    # each 256-byte row split in two under the 128-byte swizzle
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)) == 4 * codes + 2 * groups
    signature = {(4, False): "0xC308C308", (8, False): "0f4B000080", (8, True): "0x7B807B80"}  # unpack_ptx's
    assert all((signature[key] in ptx) == (key == (bits, e4m3)) for key in signature)
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx
    assert shared <= 232448


@pytest.mark.parametrize("epi,rms,k,consumers,block_m", [
    (0, True, 5120, 2, 8), (1, False, 17408, 2, 8), (2, True, 5120, 2, 8), (0, False, 5120, 2, 16),
    (2, True, 5120, 3, 32)])
def test_sm90_code_for_int8_group_32(epi, rms, k, consumers, block_m):
    """int8 codes of group 32 (the drafter's), a unit of 4 blocks: a consumer's tile as 4 boxes of a block's 32
    int16 columns (64-byte rows: one copy each), x as 8 boxes of a group's 32 columns, and every group's 2 k16
    steps of wgmma, its scale applied after them (8 scales a unit), the int8 unpacking."""
    pytest.importorskip("triton.experimental.gluon")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from warp_specialized import sm90_compile

    ptx, shared = sm90_compile(k, consumers, block_m, epi, rms, bits=8, group_size=32)
    dots = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_m}k16\.f32\.bf16\.bf16", ptx)
    assert len(dots) == 8 * 2 * consumers
    codes = 4 * (2 if epi == 2 else 1) * consumers  # issued in two places: the first stages', then the loop's
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)) == 2 * codes + 8
    assert "0f4B000080" in ptx and "0xC308C308" not in ptx
    assert shared <= 232448


@pytest.mark.parametrize("epi,rms,k,block_m,bits,e4m3,group", [
    (0, True, 5120, 32, 4, False, 128), (1, False, 17408, 32, 4, False, 128), (2, True, 5120, 32, 4, False, 128),
    (0, True, 5120, 8, 4, False, 128), (2, True, 5120, 8, 4, False, 128), (1, False, 17408, 8, 4, False, 128),
    (2, True, 5120, 8, 8, True, 128), (1, False, 17408, 8, 8, True, 128), (0, True, 5120, 8, 8, True, 128),
    (0, False, 5120, 8, 8, False, 32), (1, True, 17408, 8, 8, False, 32), (2, True, 5120, 32, 8, False, 32)])
def test_no_spills(epi, rms, k, block_m, bits, e4m3, group, tmp_path):
    """The config table's variants (2 consumers; x blocks of 32 rows in a whole SM's registers, of 8 rows in the
    lean footprint), every epilogue they serve, and FP8 (e4m3) and int8 group-32 codes: ptxas (Triton's own, run
    here on the CPU) reports no spill stores, which would put local-memory traffic beside the weight stream.
    (int8 codes of group 128, the vocabulary head's, which stays on the Triton kernel, spill 24 bytes in the lean
    footprint; int8 group 32 with the SwiGLU epilogue there, its 8 scales a unit held one unit ahead, 4 bytes.)"""
    pytest.importorskip("triton.experimental.gluon")
    from triton.backends.nvidia.compiler import get_ptxas
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from warp_specialized import sm90_compile

    (tmp_path / "ws.ptx").write_text(sm90_compile(k, gk.CONSUMERS, block_m, epi, rms, bits=bits, e4m3=e4m3,
                                                  group_size=group)[0])
    registers = gk.footprint(gk.CONSUMERS, block_m)[0][0]
    report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(tmp_path / "ws.ptx"), "-o",
                             str(tmp_path / "ws.cubin")], capture_output=True, text=True, check=True).stderr
    used = re.search(r"Used (\d+) registers", report)
    assert used and int(used[1]) <= registers, report
    assert re.search(r"\b0 bytes spill stores", report), report


@pytest.mark.parametrize("epi", [0, 2])
def test_sm90_code_under_pdl(epi):
    """Launched with PDL, the loader copies the first stages' code tiles (model weights) before it waits for the
    previous kernel, and x after; every partition waits before the previous kernel's outputs and releases the next
    kernel after its loop. Without PDL no griddepcontrol at all."""
    pytest.importorskip("triton.experimental.gluon")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from warp_specialized import sm90_compile

    ptx, _ = sm90_compile(5120, 2, 32, epi, True, pdl_level=3)
    assert ptx.count("griddepcontrol.wait;") >= 3 and ptx.count("griddepcontrol.launch_dependents;") >= 3
    loader = ptx[ptx.rindex("setmaxnreg.dec.sync.aligned.u32 \t40"):]  # the loader warp: down to 40 registers
    before, after = loader[:loader.index("griddepcontrol.launch_dependents;")].split("griddepcontrol.wait;", 1)
    codes = 2 * (2 if epi == 2 else 1) * 2  # boxes of the 2 consumers' tiles, each row in two
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", before)) == codes
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", after)) == codes + 8  # and x's 4 boxes
    assert "griddepcontrol" not in sm90_compile(5120, 2, 32, epi, True, pdl_level=0)[0]


@pytest.mark.parametrize("epi,block_m,bits,group", [(0, 8, 4, 128), (2, 8, 4, 128), (1, 32, 4, 128), (2, 8, 8, 32)])
def test_loader_prefetches_units_into_l2_before_its_pdl_wait(epi, block_m, bits, group):
    """With `l2_ahead` (KernelConfig.l2_ahead) the loader fetches the codes of the units after its ring's first
    stages into L2 (one bulk prefetch of a tile row's span of them, its size in a register: 2 rows a lane, both
    consumers' tiles) before it waits for the previous kernel, and no copy of x or anything else moves before the
    wait; without PDL, or with none ahead, no prefetch at all."""
    pytest.importorskip("triton.experimental.gluon")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from warp_specialized import sm90_compile

    ptx, _ = sm90_compile(5120, 2, block_m, epi, True, pdl_level=3, bits=bits, group_size=group, l2_ahead=8)
    plain, _ = sm90_compile(5120, 2, block_m, epi, True, pdl_level=3, bits=bits, group_size=group)
    loader = ptx[ptx.rindex("setmaxnreg.dec"):]
    before, after = loader.split("griddepcontrol.wait;", 1)
    assert before.count("cp.async.bulk.prefetch.L2.global") == 2 * 2 and "cp.async.bulk.prefetch" not in after
    assert len(re.findall(r"cp\.async\.bulk\.prefetch\.L2\.global \[%rd\d+\], %r\d+;", before)) == 2 * 2
    copies = r"cp\.async\.bulk\.tensor\.2d"
    plain_loader = plain[plain.rindex("setmaxnreg.dec"):]
    assert len(re.findall(copies, before)) == len(re.findall(copies, plain_loader.split("griddepcontrol.wait;")[0]))
    assert "cp.async.bulk.prefetch" not in plain
    assert "cp.async.bulk.prefetch" not in sm90_compile(5120, 2, block_m, epi, True, pdl_level=0, bits=bits,
                                                        group_size=group, l2_ahead=8)[0]


def test_stamped_kernel_for_the_launch_timeline_compiles_for_hopper():
    """bench/launch_timeline.py's stamped copy of the kernel compiles for sm_90 as the engine launches it (lean, 8
    rows, PDL 3): the same loader and wgmma dots, the global timer and the SM's clock read, and its program's row of 8
    stamps stored (its results and stamps on a GPU: tests/test_cuda.py)."""
    pytest.importorskip("triton.experimental.gluon")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import launch_timeline
    from warp_specialized import sm90_compile

    ptx, _ = sm90_compile(5120, 2, 8, 2, True, pdl_level=3, kernel=launch_timeline._stamped_ws_kernel,
                          pointers={"trace_ptr": "*i64"})
    plain, _ = sm90_compile(5120, 2, 8, 2, True, pdl_level=3)
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor.2d", "griddepcontrol.wait;"):
        assert ptx.count(instruction) == plain.count(instruction) > 0, instruction
    assert "%globaltimer" in ptx and "%clock64" in ptx and "%smid" in ptx and "%globaltimer" not in plain
    assert len(re.findall(r"st\.global\.b64", ptx)) == 8 and not re.findall(r"st\.global\.b64", plain)


def test_mlp_in_one_launch_only_where_both_projections_take_the_lean_program(monkeypatch):
    """One launch serves a SwiGLU MLP where the lean program serves both projections (CUDA, Hopper, bf16 rows, 1..8 of
    them, 4-bit group 128 codes over whole blocks) and down's inputs are gate_up's SwiGLU outputs."""
    from blockspec.quant.fp8 import Fp8Linear, quantize

    gate_up = Int4Linear.from_float(torch.randn(2048, 512) * 0.05).packed()
    down = Int4Linear.from_float(torch.randn(512, 1024) * 0.05).packed()
    x = torch.randn(9, 512, dtype=torch.bfloat16)
    assert not gk.mlp_usable(x[:8], gate_up, down)  # CPU tensors
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(gk, "_hopper", lambda device: True)
    assert gk.mlp_usable(x[:8], gate_up, down) and gk.mlp_usable(x[:1], gate_up, down)
    fp8 = Fp8Linear.from_blocks(*quantize(torch.randn(512, 1024) * 0.05)).packed()
    refused = [gk.mlp_usable(x, gate_up, down), gk.mlp_usable(x[:8].half(), gate_up, down),
               gk.mlp_usable(x[:8], gate_up, fp8),
               gk.mlp_usable(x[:8], gate_up, Int4Linear.from_float(torch.randn(512, 512) * 0.05).packed()),
               gk.mlp_usable(x[:8], Int4Linear.from_float(torch.randn(2048, 512) * 0.05, 64).packed(), down)]
    assert refused == [False] * 5, refused
    monkeypatch.setattr(gk, "_MLP_BROKEN", ["unsupported op"])
    assert not gk.mlp_usable(x[:8], gate_up, down)


@pytest.mark.parametrize("pdl_level", [0, 3])
def test_mlp_launch_sm90_code(pdl_level):
    """The MLP's one launch compiled for sm_90 (the 27B's shapes): both projections' group dots, each consumer's
    release arrival once its gate_up stores are made, and the loader's order: down's first code tiles, then the
    acquire of the arrival counter, the proxy fence (TMA reads what other SMs stored), then down's x; under PDL the
    previous kernel waited for before gate_up's x, and the next released after the loops; without PDL none of it."""
    pytest.importorskip("triton.experimental.gluon")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from warp_specialized import sm90_compile_mlp

    ptx, shared = sm90_compile_mlp(pdl_level=pdl_level)
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n8k16", ptx)) == 2 * 32 * gk.CONSUMERS
    assert len(re.findall(r"atom\.global\.gpu\.release\.add", ptx)) == gk.CONSUMERS
    loader = ptx[ptx.index("fence.proxy.async.global") - 20000:]
    gate = loader.index("ld.global.gpu.acquire")
    fence = loader.index("fence.proxy.async.global")
    assert gate < fence < loader.index("cp.async.bulk.tensor.2d", fence)  # down's x after the fence
    assert "cp.async.bulk.tensor.2d" in loader[:gate]  # down's first code tiles before the wait
    assert ("griddepcontrol.wait;" in ptx and "griddepcontrol.launch_dependents;" in ptx) == (pdl_level > 0)
    assert shared <= 128 * 1024


def test_bench_dry_run(tmp_path):
    """bench/warp_specialized.py's dry run ("warp_specialized.py" --dry-run), in a process of its own: the other
    scripts' dry runs share one with the Triton interpreter, whose patches of triton.language break Gluon's
    compiler. Every variant it times (2 or 3 consumers, x blocks of 8, 16, 32 rows) compiles for sm_90."""
    pytest.importorskip("triton.experimental.gluon")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "bench" / "warp_specialized.py"), "--dry-run"], cwd=str(root),
                          env=dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(root)), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    compiled = json.loads((tmp_path / "warp_specialized.json").read_text())
    mlp = compiled.pop("MLP")  # the MLP's one launch: 2 projections' dots
    assert mlp["wgmma"] == 2 * 32 * gk.CONSUMERS and mlp["shared"] <= 128 * 1024
    assert sorted(compiled) == sorted([f"C{c} m{m}" for c in (2, 3) for m in (8, 16, 32)]
                                      + ["C2 m8 whole SM", "C2 m16 lean"])
    assert compiled["C2 m8"]["shared"] <= 128 * 1024 < compiled["C2 m8 whole SM"]["shared"]  # the lean 120 KB ring
    assert all(v["wgmma"] == 32 * int(k[1]) and v["shared"] <= 232448 for k, v in compiled.items())


@pytest.mark.parametrize("epi,rms,k,block_m,bits,group", [
    (0, True, 5120, 8, 4, 128), (1, False, 17408, 32, 4, 128), (2, True, 5120, 8, 8, 32)])
def test_overlapped_dots_issue_each_piece_before_waiting_for_the_last(epi, rms, k, block_m, bits, group, tmp_path):
    """With `overlap_dots` (KernelConfig.overlap_dots) the consumers issue the same k16 wgmma steps as the default,
    in asynchronous pieces (halves of a 128-input group, a 32-input group whole), each wait leaving the piece just
    issued in flight; the stream (TMA copies, waits on the ring's barriers, PDL) is the default's, and ptxas fits
    it in the footprint's registers with no more spill stores than the default's (4 bytes for int8 group 32's
    SwiGLU in the lean footprint, test_no_spills)."""
    pytest.importorskip("triton.experimental.gluon")
    from triton.backends.nvidia.compiler import get_ptxas
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from warp_specialized import sm90_compile

    default, _ = sm90_compile(k, 2, block_m, epi, rms, bits=bits, group_size=group)
    overlapped, _ = sm90_compile(k, 2, block_m, epi, rms, bits=bits, group_size=group, overlap_dots=True)
    steps = rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_m}k16"
    assert len(re.findall(steps, overlapped)) == len(re.findall(steps, default))
    groups, pieces = 16 // bits * 128 // group, 2 if group == 128 else 1
    assert overlapped.count("wgmma.commit_group") == 2 * groups * pieces  # a commit a piece and consumer
    assert overlapped.count("wgmma.wait_group.sync.aligned 1;") == 2 * (groups * pieces - 1)
    assert "wgmma.wait_group.sync.aligned 1;" not in default
    for loads in (r"cp\.async\.bulk\.tensor\.2d", r"mbarrier\.try_wait", "griddepcontrol"):
        assert len(re.findall(loads, overlapped)) == len(re.findall(loads, default))
    spills = []
    for name, ptx in (("default", default), ("overlapped", overlapped)):
        (tmp_path / f"{name}.ptx").write_text(ptx)
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(tmp_path / f"{name}.ptx"), "-o",
                                 str(tmp_path / f"{name}.cubin")], capture_output=True, text=True, check=True).stderr
        used = re.search(r"Used (\d+) registers", report)
        assert used and int(used[1]) <= gk.footprint(2, block_m)[0][0], report
        spills.append(int(re.search(r"(\d+) bytes spill stores", report)[1]))
    assert spills[1] <= spills[0] <= 4
