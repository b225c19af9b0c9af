// W4A16 matmul for 1..16 activation rows on tensor cores (mma.sync m16n8k16, sm_80+), no headers (NVRTC).
//   y[M, N] = x[M, K] @ dequant(W)[N, K]^T,  x / y bf16, fp32 accumulation, W int4 group 128.
// The weight is the MMA's A operand (16 output features x 16 inputs), x^T its B operand (16 inputs x 8 rows), so
// one MMA serves up to 8 rows (NT = 2 tiles for 9..16). Layout, numerics, configs and measurements: w4a16_cuda.py.
//
// Work: a warp owns one strip of 16 features and per_warp consecutive 64-input chunks, D of them in flight in a
// register ring (one 16-byte load per lane per chunk), the first D issued before it waits on the previous kernel
// (PDL), so a chained launch streams weights under its predecessor's tail. A block holds WS strips x KS chunk
// ranges; the KS partial sums meet in shared memory, the gridDim.y K splits in a fp32 workspace, summed by the last
// block to arrive (fixed orders: deterministic, and a row's result does not depend on the other rows).

#define DEVI __device__ __forceinline__

DEVI uint4 ld_stream(const uint4* p) {  // codes are read once: keep them out of L1
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

DEVI unsigned ld_u32(const unsigned* p) {
    unsigned v;
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

DEVI uint4 ld_x(const unsigned short* p) {  // activations: read by every block, cached; a plain load so the
    return *reinterpret_cast<const uint4*>(p);  // compiler may schedule it freely, but not above pdl_wait
}

// Nibbles i (low half) and i + 4 (high half) of w as bf16 (128 + u) + zc, i.e. u - z: exact.
DEVI unsigned dequant_pair(unsigned w, unsigned zc) {
    unsigned r, d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(0x000F000Fu), "r"(0x43004300u));  // (a & b) | c
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(r), "r"(0x3F803F80u), "r"(zc));
    return d;
}

DEVI void mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

DEVI unsigned short to_bf16(float v) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
}

#if __CUDA_ARCH__ >= 900  // programmatic dependent launch (no-ops unless launched with it)
DEVI void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
DEVI void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" :::); }
#else
DEVI void pdl_wait() {}
DEVI void pdl_launch_dependents() {}
#endif

// What a launch does with its finished sums besides storing them (w4a16_cuda.py `Epilogue`; why:
// layers/folded_norm.py). rms_sums: first scale each row by rsqrt(sum over rms_p rows of rms_sums [rms_p, M] / K +
// eps). kind 1 (add_norm; bf16 norm weight): out = residual + y (rounded as the plain add), rows = out * (1 + w), and the
// rows' sums of out^2: per block into parts[block, M], then by the last block, in block order, into
// parts[gridDim.x, M]. kind 2 (swiglu): the weight's strips hold 8 gate rows then the same 8 channels' up rows;
// out[:, channel] = silu(gate) * up, each rounded as the activation kernel of two launches rounds it.
struct Epilogue {
    const float* rms_sums;
    int rms_p;
    float eps;
    int kind;
    const unsigned short* residual;
    const unsigned short* norm_weight;
    unsigned short* rows;
    float* parts;
};

#define W4A16_ARGS                                                                                              \
    const unsigned short* __restrict__ x, int ldx, int M, const uint4* __restrict__ qw,                        \
        const unsigned* __restrict__ sc, const unsigned* __restrict__ zc, unsigned short* __restrict__ out,    \
        int ldo, float* __restrict__ ws, int* __restrict__ counters, int N, int K, int per_warp,                \
        int early_release, const Epilogue epi
#define W4A16_PASS x, ldx, M, qw, sc, zc, out, ldo, ws, counters, N, K, per_warp, early_release, epi

DEVI float bf16_to_f32(unsigned short h) { return __uint_as_float((unsigned)h << 16); }
DEVI float round_bf16(float v) { return bf16_to_f32(to_bf16(v)); }

// One group of 128 inputs (chunks c, c + 1) of a warp: part = (u - z) @ x^T on the MMAs, acc += part * scale.
template <int NT>
DEVI void group_mma(float (&acc)[NT][4], const uint4 (&w)[2], unsigned s, unsigned z,
                    const unsigned short* const (&xc)[NT]) {
#ifdef W4A16_LOADS_ONLY  // diagnostic build (bench/w4a16_cuda.py DIAG=...): the loads without the math
    acc[0][0] += __uint_as_float((w[0].x ^ w[0].y ^ w[0].z ^ w[0].w ^ w[1].x ^ w[1].y ^ w[1].z ^ w[1].w ^ s ^ z) &
                                 0x807FFFFFu);
    return;
#endif
    unsigned xw[2][NT][8];  // all of the group's x first: its loads overlap, not each before its MMA
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {  // rows past M read row M - 1 again (L1 hits; never stored)
            const uint4 a = ld_x(xc[nt] + 64 * h), b = ld_x(xc[nt] + 64 * h + 8);
            xw[h][nt][0] = a.x; xw[h][nt][1] = a.y; xw[h][nt][2] = a.z; xw[h][nt][3] = a.w;
            xw[h][nt][4] = b.x; xw[h][nt][5] = b.y; xw[h][nt][6] = b.z; xw[h][nt][7] = b.w;
        }
    const unsigned zlo = __byte_perm(z, 0, 0x1010), zhi = __byte_perm(z, 0, 0x3232);
    float part[2][NT][4];  // one MMA chain per chunk: two chains of 4 instead of one of 8
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) part[h][nt][i] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned wj = j == 0 ? w[h].x : j == 1 ? w[h].y : j == 2 ? w[h].z : w[h].w;
            const unsigned a0 = dequant_pair(wj, zlo), a1 = dequant_pair(wj >> 4, zhi);
            const unsigned a2 = dequant_pair(wj >> 8, zlo), a3 = dequant_pair(wj >> 12, zhi);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                mma_bf16(part[h][nt], a0, a1, a2, a3, xw[h][nt][2 * j], xw[h][nt][2 * j + 1]);
        }
    const float s_lo = __uint_as_float(s << 16), s_hi = __uint_as_float(s & 0xFFFF0000u);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        acc[nt][0] += (part[0][nt][0] + part[1][nt][0]) * s_lo;
        acc[nt][1] += (part[0][nt][1] + part[1][nt][1]) * s_lo;
        acc[nt][2] += (part[0][nt][2] + part[1][nt][2]) * s_hi;
        acc[nt][3] += (part[0][nt][3] + part[1][nt][3]) * s_hi;
    }
}

// Calls f(nt, e, n) for each output row n = 8 nt + 2t + e (< M) whose sums this lane holds: acc[nt][e] (feature
// 16 strip + g) and acc[nt][2 + e] (feature + 8), the MMA's C fragment.
template <int NT, typename F>
DEVI void for_lane_rows(int t, int M, F&& f) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int n = nt * 8 + 2 * t + e;
            if (n < M) f(nt, e, n);
        }
}

// Arrival protocol of the cross-block sums: each block writes its partials, then calls this; true in the last block
// of `expected` to arrive at *counter, which then sees every partial (fences on both sides) and resets the counter
// for the next launch (and graph replay).
DEVI bool last_to_arrive(int* counter, int expected) {
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        is_last = atomicAdd(counter, 1) == expected - 1;
        if (is_last) *counter = 0;
    }
    __syncthreads();
    if (is_last) __threadfence();
    return is_last;
}

template <int WS, int NT>
DEVI void add_norm_epilogue(const float (&acc)[NT][4], bool owner, int strip, int strips, int wk, int wn, int f,
                            int M, int N, unsigned short* out, const Epilogue& epi, int* counters);

// D: chunk loads a warp keeps in flight in a register ring, refilled as each chunk is consumed; per_warp: its chunks.
template <int D, int KS, int WS, int NT, bool ZP, int EPI>  // EPI: epi.kind (a template: no epilogue code, no
DEVI void w4a16_body(W4A16_ARGS) {                                   // registers for it, in the other kernels)
    static_assert(D % 2 == 0, "the ring holds whole groups of 128 inputs");
    __shared__ float red[KS > 1 ? (KS - 1) * WS * NT * 4 * 32 : 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wn = warp % WS, wk = warp / WS;
    const int g = lane >> 2, t = lane & 3;
    const int strips = N >> 4, nchunks = K >> 6, ngroups = K >> 7;
    const int strip = blockIdx.x * WS + wn;
    const int c0 = (blockIdx.y * KS + wk) * per_warp, c1 = min(c0 + per_warp, nchunks);  // both even
    const bool active = strip < strips && c0 < c1;

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;

    const uint4* wp = qw + (size_t)strip * nchunks * 32 + lane;
    const size_t sp = (size_t)strip * ngroups * 8 + g;
    uint4 wbuf[D];
    unsigned sbuf[D / 2], zbuf[D / 2];
    if (early_release) pdl_launch_dependents();  // the next kernel may be placed (and load its weights) at once
    if (active) {
#pragma unroll
        for (int i = 0; i < D; ++i)
            if (c0 + i < c1) wbuf[i] = ld_stream(wp + (size_t)(c0 + i) * 32);
#pragma unroll
        for (int i = 0; i < D / 2; ++i)
            if (c0 + 2 * i < c1) {
                sbuf[i] = ld_u32(sc + sp + ((c0 >> 1) + i) * 8);
                zbuf[i] = ZP ? ld_u32(zc + sp + ((c0 >> 1) + i) * 8) : 0xC308C308u;  // bf16 -136 = -(128 + 8)
            }
    }
    pdl_wait();  // x is the previous kernel's output
    if (!early_release) pdl_launch_dependents();

    if (active) {
        const unsigned short* xc[NT];  // this lane's 16 inputs of the current chunk, per row tile
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) xc[nt] = x + (size_t)min(nt * 8 + g, M - 1) * ldx + 64 * c0 + 16 * t;
        const uint4* wnext = wp + (size_t)(c0 + D) * 32;  // the next chunk into the ring, and its group's scales
        size_t snext = sp + ((c0 + D) >> 1) * 8;
        for (int base = c0; base < c1; base += D) {
#pragma unroll
            for (int i = 0; i < D; i += 2) {
                const int c = base + i;
                if (c >= c1) break;
                const uint4 w[2] = {wbuf[i], wbuf[i + 1]};
                const unsigned s = sbuf[i / 2], z = zbuf[i / 2];
                const bool refill = c + D < c1;  // the ring's next chunks: c + D, c + D + 1
                if (refill) {
                    wbuf[i] = ld_stream(wnext);
                    wbuf[i + 1] = ld_stream(wnext + 32);
                    sbuf[i / 2] = ld_u32(sc + snext);
                    if (ZP) zbuf[i / 2] = ld_u32(zc + snext);
                }
                group_mma<NT>(acc, w, s, z, xc);
                wnext += 64;
                snext += 8;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) xc[nt] += 128;
            }
        }
    }

    if (KS > 1) {  // chunk ranges of one block meet in shared memory, added in a fixed order
        if (wk > 0)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) red[(((wk - 1) * WS + wn) * NT * 4 + nt * 4 + i) * 32 + lane] = acc[nt][i];
        __syncthreads();
        if (wk == 0)
            for (int s = 1; s < KS; ++s)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[nt][i] += red[(((s - 1) * WS + wn) * NT * 4 + nt * 4 + i) * 32 + lane];
    }
    const bool owner = wk == 0 && strip < strips;
    const int f = strip * 16 + g;  // features f (acc[.][0..1]) and f + 8 (acc[.][2..3])
    if (gridDim.y > 1) {  // K splits: fp32 partials [split, M, N]; the last block to arrive adds them in order
        if (owner)
            for_lane_rows<NT>(t, M, [&](int nt, int e, int n) {
                float* p = ws + ((size_t)blockIdx.y * M + n) * N + f;
                p[0] = acc[nt][e];
                p[8] = acc[nt][2 + e];
            });
        if (!last_to_arrive(&counters[blockIdx.x], gridDim.y)) return;
        if (owner)
            for_lane_rows<NT>(t, M, [&](int nt, int e, int n) {
                float lo = 0.f, hi = 0.f;
                for (int y = 0; y < (int)gridDim.y; ++y) {
                    const float* p = ws + ((size_t)y * M + n) * N + f;
                    lo += __ldcg(p);
                    hi += __ldcg(p + 8);
                }
                acc[nt][e] = lo;
                acc[nt][2 + e] = hi;
            });
    }
    if (epi.rms_sums && owner)  // the norm its input began: each row's 1 / rms
        for_lane_rows<NT>(t, M, [&](int nt, int e, int n) {
            float sum = 0.f;
            for (int p = 0; p < epi.rms_p; ++p) sum += epi.rms_sums[(size_t)p * M + n];
            const float r = rsqrtf(sum / K + epi.eps);
            acc[nt][e] *= r;
            acc[nt][2 + e] *= r;
        });
    if constexpr (EPI == 2) {  // swiglu: gate (row g) and up (row g + 8) of channel 8 strip + g are this lane's
        if (owner)
            for_lane_rows<NT>(t, M, [&](int nt, int e, int n) {
                const float gate = round_bf16(acc[nt][e]), up = round_bf16(acc[nt][2 + e]);
                out[(size_t)n * ldo + strip * 8 + g] = to_bf16(up * (gate / (1.f + __expf(-gate))));
            });
    } else if constexpr (EPI == 0) {
        if (owner)
            for_lane_rows<NT>(t, M, [&](int nt, int e, int n) {
                out[(size_t)n * ldo + f] = to_bf16(acc[nt][e]);
                out[(size_t)n * ldo + f + 8] = to_bf16(acc[nt][2 + e]);
            });
    } else {
        add_norm_epilogue<WS, NT>(acc, owner, strip, strips, wk, wn, f, M, N, out, epi, counters);
    }
}

// add_norm: this lane's two features of each of its rows, then the rows' sums of squares over the block, then over
// the grid (the last block to arrive).
template <int WS, int NT>
DEVI void add_norm_epilogue(const float (&acc)[NT][4], bool owner, int strip, int strips, int wk, int wn, int f,
                            int M, int N, unsigned short* out, const Epilogue& epi, int* counters) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    float sq[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) sq[nt][0] = sq[nt][1] = 0.f;
    if (owner) {
        const float w_lo = 1.f + bf16_to_f32(epi.norm_weight[f]), w_hi = 1.f + bf16_to_f32(epi.norm_weight[f + 8]);
        for_lane_rows<NT>(t, M, [&](int nt, int e, int n) {
            const size_t o = (size_t)n * N + f;
            const float v_lo = round_bf16(bf16_to_f32(epi.residual[o]) + round_bf16(acc[nt][e]));
            const float v_hi = round_bf16(bf16_to_f32(epi.residual[o + 8]) + round_bf16(acc[nt][2 + e]));
            out[o] = to_bf16(v_lo);
            out[o + 8] = to_bf16(v_hi);
            epi.rows[o] = to_bf16(v_lo * w_lo);
            epi.rows[o + 8] = to_bf16(v_hi * w_hi);
            sq[nt][e] = v_lo * v_lo + v_hi * v_hi;
        });
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) sq[nt][e] += __shfl_xor_sync(0xffffffffu, sq[nt][e], off);
    __shared__ float strip_sq[WS][NT * 8];  // the block's strips, summed in strip order
    if (wk == 0 && g == 0)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) strip_sq[wn][nt * 8 + 2 * t + e] = strip < strips ? sq[nt][e] : 0.f;
    __syncthreads();
    if (threadIdx.x < M) {
        float total = 0.f;
        for (int w = 0; w < WS; ++w) total += strip_sq[w][threadIdx.x];
        epi.parts[(size_t)blockIdx.x * M + threadIdx.x] = total;
    }
    if (!last_to_arrive(&counters[gridDim.x], gridDim.x)) return;
    for (int n = warp; n < M; n += blockDim.x >> 5) {  // a warp per row: lane l adds blocks l, l + 32, ...
        float total = 0.f;
        for (int b = lane; b < (int)gridDim.x; b += 32) total += __ldcg(epi.parts + (size_t)b * M + n);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
        if (lane == 0) epi.parts[(size_t)gridDim.x * M + n] = total;
    }
}

