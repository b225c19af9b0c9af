"""PTX that turns the q16 layout's codes (quant_matmul.py) into tensor-core operands in registers: one inline-asm
block per 32-bit register of two int16 halfwords, shared by the Triton and Gluon W4A16 / W8A16 kernels."""

import functools


@functools.lru_cache(maxsize=None)
def unpack_asm(bits: int, i: int, fp16: bool, e4m3: bool = False) -> str:
    """PTX for one 32-bit register (two halfwords): (u - 2**(bits-1)) of code i of each, as bf16x2 / f16x2; with
    e4m3, the float8_e4m3fn value of byte i of each."""
    if e4m3:  # byte i and byte 2 + i at the top of each half; sign kept, exponent and mantissa moved down into the
        # bf16's (fp16's) so the half holds the value times 2**-120 (2**-8), subnormals included; times 2**120 (2**8)
        # in one packed FMA (+ -0 keeps the sign of zeros): exact, 2.5 PTX instr. per weight, any sm_80+ GPU
        shift, scale = (1, "0x5C005C00") if fp16 else (4, "0x7B807B80")
        return (f"{{ .reg .b32 t, v, k, z; prmt.b32 t, $1, 0, 0x{2 + i}4{i}4; and.b32 v, t, 0x7F007F00; "
                f"shr.b32 v, v, {shift}; lop3.b32 v, t, 0x80008000, v, 0xEA; mov.b32 k, {scale}; "
                f"mov.b32 z, 0x80008000; fma.rn.{'f16x2' if fp16 else 'bf16x2'} $0, v, k, z; }}")
    if bits == 4:  # (u | 0x4300) as bf16 is 128 + u, (u | 0x6400) as fp16 is 1024 + u; then * 1 - 136 / - 1032
        magic, one, bias = ("0x64006400", "0x3C003C00", "0xE408E408") if fp16 else \
            ("0x43004300", "0x3F803F80", "0xC308C308")
        src = f"shr.u32 w, $1, {4 * i};" if i else "mov.b32 w, $1;"
        return (f"{{ .reg .b32 w, t, k, one; mov.b32 k, {bias}; mov.b32 one, {one}; {src} "
                f"lop3.b32 t, w, 0x000F000F, {magic}, 0xEA; fma.rn.{'f16x2' if fp16 else 'bf16x2'} $0, t, one, k; }}")
    if fp16:  # bytes (0x64, u) -> fp16 1024 + u, minus 1152
        return (f"{{ .reg .b32 t, k; mov.b32 k, 0x64806480; prmt.b32 t, $1, 0x64646464, 0x4{2 + i}4{i}; "
                "sub.rn.f16x2 $0, t, k; }")
    # bytes (0x4B, 0, 0, u) -> fp32 2**23 + u, minus 2**23 + 128, both halfwords packed to bf16x2 (exact)
    return (f"{{ .reg .b32 lo, hi; prmt.b32 lo, $1, 0x4B000000, 0x744{i}; prmt.b32 hi, $1, 0x4B000000, 0x744{2 + i}; "
            "sub.rn.f32 lo, lo, 0f4B000080; sub.rn.f32 hi, hi, 0f4B000080; cvt.rn.bf16x2.f32 $0, hi, lo; }")
