// Products of a prompt's steps on the tensor cores (the prefill programs of the device decoder:
// rust/engine/backend/cuda/decode/gemm.rs): y[r, o] = W[o] . x[r] for up to 64 batch rows, for
// F16 matrices and for Q8_0 matrices stored in the float-x split layout (payloads, then scales:
// rust/engine/quant/split) or in the decode's tensor-core layout of 16-row tiles
// (ds4_gemm_q8_0_mq), one launch a kernel. The decode's kernels (matvec_split in
// common.cuh) compute one dequantized weight times each batch row with a float FMA, which at 16
// rows makes them issue-bound (Flash's 16-row steps spent 18.7 of 50 ms in those products).
// Here mma.sync m16n8k16 (f16 inputs, f32 sums) takes 16 rows x 8 outputs x 16 inputs per
// instruction.
//
// Precision: x is not rounded to half precision. Each lane takes its rows' x as floats and
// splits each unit of 32 inputs of a row, scaled by a power of two (the unit's largest |x| to
// [2^13, 2^14)), into two halves, hi = f16(x) and lo = f16(x - hi): 22 significant bits. Each
// unit's product runs twice (hi, then lo) into a sum of its own, which is scaled back (exact: a
// power of two; Q8_0: times the block scale, one rounding) and added to the output's sum. F16
// weights are exact halves, Q8_0's 8-bit values too. So a product is the float product to
// about 2^-22 relative per input, summed in the tensor cores' f32 order instead of the
// decode's.
//
// Row invariance: each output's sum is a function of its own row of x and the shape (units in
// order within a slice, slices added in slice order), so a row gives the same bits whatever
// other rows share the step. These sums are not bitwise the
// decode kernels', which is why only a prompt's steps run them: a verify must be bitwise its
// rows' single decodes, and runs the decode's kernels.
//
// The inputs of a unit are permuted the same way for x and W: lane t of a quad holds physical
// inputs [8t, 8t + 8) of the unit, step s its [8t + 4s, 8t + 4s + 4), the first two as the
// m16n8k16 fragment's k = 2t, 2t + 1, the last two as k = 2t + 8, 2t + 9. A dot product is a
// sum over the same 32 pairs in any order, so a lane loads its W bytes as one contiguous vector
// (16 bytes of F16, 8 of Q8_0) and its x as two float4 a row; the quad's four lanes hold a
// row's whole unit, so its largest |x| is two shuffles away.

// Output rows one warp computes: four n8 tiles (gemm.rs GEMM_WARP_ROWS).
#define GEMM_TILES 4
// Batch rows one warp computes: up to four m16 tiles (gemm.rs GEMM_MAX_ROWS), each unit's
// weights loaded once for all of them. A row's sums do not depend on its tile (row r is row
// r % 16 of tile r / 16, computed as tile 0 computes it).
#define GEMM_MTILES 4

// Two floats as a pair of halves (round to nearest even), the first in the low half.
__device__ __forceinline__ u32 gemm_f16x2(float lo_half, float hi_half) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi_half), "f"(lo_half));
    return r;
#else
    u16 a, b;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(a) : "f"(lo_half));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(hi_half));
    return (u32)a | ((u32)b << 16);
#endif
}

// The pair's halves back as floats.
__device__ __forceinline__ void gemm_f16x2_to_f32(u32 h, float& a, float& b) {
    a = f16_bits_to_f32(h & 0xffffu);
    b = f16_bits_to_f32(h >> 16);
}

// A row's unit for lane t of its quad: v holds physical inputs [8t, 8t + 8). Returns the scale
// back (a power of two) and writes the hi and lo pairs: p[s][0] = inputs 8t + 4s + {0, 1},
// p[s][1] = 8t + 4s + {2, 3}.
__device__ __forceinline__ float gemm_split_x(const float (&v)[8], u32 (&hi)[2][2], u32 (&lo)[2][2]) {
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        m = fmaxf(m, fabsf(v[i]));
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    // m = 1.f * 2^(E - 127): scale by 2^(14 - (E - 126)), so that the largest |x| lands in
    // [2^13, 2^14): far from f16's overflow, and lo keeps its bits above f16's subnormals.
    int sh = 0;
    if (m > 0.0f && m <= 3.402823466e38f) {
        const int e = (int)((__float_as_uint(m) >> 23) & 0xff) - 126;
        sh = 14 - e;
        sh = sh < -100 ? -100 : (sh > 100 ? 100 : sh);
    }
    const float sc = __uint_as_float((u32)(127 + sh) << 23);
#pragma unroll
    for (int st = 0; st < 2; st++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const float a = v[4 * st + 2 * j] * sc;
            const float b = v[4 * st + 2 * j + 1] * sc;
            const u32 h = gemm_f16x2(a, b);
            float ha, hb;
            gemm_f16x2_to_f32(h, ha, hb);
            hi[st][j] = h;
            lo[st][j] = gemm_f16x2(a - ha, b - hb);
        }
    }
    return __uint_as_float((u32)(127 - sh) << 23);
}

// d += a * b on the tensor cores: 16 x 16 halves (a, row major) times 16 x 8 (b, column major),
// f32 sums.
__device__ __forceinline__ void gemm_mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
    // (Before sm_80 nothing: the host runs these kernels on sm_80 and later only, gemm.rs.)
}

// Four signed bytes as two pairs of halves (exact): each byte + 128 in the mantissa of 1024,
// minus 1152.
__device__ __forceinline__ void gemm_i8_to_f16(u32 w, u32& lo, u32& hi) {
    const u32 u = w ^ 0x80808080u;
    const u32 a = __byte_perm(u, 0x64646464u, 0x4140);
    const u32 b = __byte_perm(u, 0x64646464u, 0x4342);
    const u32 bias = 0x64806480u;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(lo) : "r"(a), "r"(bias));
    asm("sub.f16x2 %0, %1, %2;" : "=r"(hi) : "r"(b), "r"(bias));
}

// One unit's weights of a warp's four tiles as the B fragments of its two k16 steps (F16: as
// loaded; Q8_0: the bytes converted to halves, exactly) and, for Q8_0, the block scales of the
// outputs of the lane's C fragments (the tile's rows 2t and 2t + 1, whose scales are in the
// lanes of quads 2t and 2t + 1; 1 for F16). Made once per unit for all the m16 tiles of x.
template <bool Q8>
__device__ __forceinline__ void gemm_prep_w(const uint4 (&wv)[GEMM_TILES], const float (&dw)[GEMM_TILES], int t,
                                            u32 (&b)[GEMM_TILES][2][2], float (&d0)[GEMM_TILES],
                                            float (&d1)[GEMM_TILES]) {
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        d0[q] = 1.0f;
        d1[q] = 1.0f;
        if (Q8) {
            d0[q] = __shfl_sync(0xffffffffu, dw[q], 8 * t);
            d1[q] = __shfl_sync(0xffffffffu, dw[q], 8 * t + 4);
            gemm_i8_to_f16(wv[q].x, b[q][0][0], b[q][0][1]);
            gemm_i8_to_f16(wv[q].y, b[q][1][0], b[q][1][1]);
        } else {
            b[q][0][0] = wv[q].x;
            b[q][0][1] = wv[q].y;
            b[q][1][0] = wv[q].z;
            b[q][1][1] = wv[q].w;
        }
    }
}

// Units a stage of the kernel's loop takes (gemm_body): their loads are in flight together,
// and a barrier ends the stage. Blocks an SM should hold (registers capped to fit). A/B with
// DS4_CUDA_DEFINES (context.rs).
#ifndef GEMM_STAGE
#define GEMM_STAGE 2
#endif
// Two blocks an SM: three (168 registers, spills), four (128 registers; again on the px
// kernels) and GEMM_STAGE 1 were slower (kernel lab, H200: 1024 x 4096 at four descriptors of
// 64 rows 72 us with two blocks, 90 with three). (Measurements: scripts/kernel_lab/HISTORY.md,
// "gemm.cu: GEMM_MIN_BLOCKS".)
#ifndef GEMM_MIN_BLOCKS
#define GEMM_MIN_BLOCKS 2
#endif

// One unit's products of a warp's four tiles: x's rows g and g + 8 of an m16 tile, already
// split (hr, lr: the A fragments of the hi and lo halves, k16 step 0 then 1, as GemmX holds
// them; s0, s1 the rows' scales back), times the tiles' weights (b, d0, d1 from gemm_prep_w),
// into acc.
__device__ __forceinline__ void gemm_unit(float (&acc)[GEMM_TILES][4], const uint4 (&hr)[2], const uint4 (&lr)[2],
                                          float s0, float s1, const u32 (&b)[GEMM_TILES][2][2],
                                          const float (&d0)[GEMM_TILES], const float (&d1)[GEMM_TILES]) {
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        gemm_mma(c, hr[0].x, hr[0].y, hr[0].z, hr[0].w, b[q][0][0], b[q][0][1]);
        gemm_mma(c, lr[0].x, lr[0].y, lr[0].z, lr[0].w, b[q][0][0], b[q][0][1]);
        gemm_mma(c, hr[1].x, hr[1].y, hr[1].z, hr[1].w, b[q][1][0], b[q][1][1]);
        gemm_mma(c, lr[1].x, lr[1].y, lr[1].z, lr[1].w, b[q][1][0], b[q][1][1]);
        acc[q][0] = fmaf(c[0], d0[q] * s0, acc[q][0]);
        acc[q][1] = fmaf(c[1], d1[q] * s0, acc[q][1]);
        acc[q][2] = fmaf(c[2], d0[q] * s1, acc[q][2]);
        acc[q][3] = fmaf(c[3], d1[q] * s1, acc[q][3]);
    }
}

// One unit of the block's x, split once for the block's four warps: f[mt][hl][st][lane] the A
// fragment of m16 tile mt's k16 step st for lane 4 g + t, hi (hl 0) or lo (1) halves: rows g
// and g + 8, inputs 8t + 4st + {0, 1} then + {2, 3} (gemm_split_x's order), as the mma takes
// its four registers, so that each is one LDS.128 a lane, with no moves (the rows of a pair
// in separate uint4s cost about 230 register moves a unit and warp); s the rows' scales back.
// 8.25 KB. In the kernel lab this layout alone took the float-x Q8_0 products at Flash's
// shapes (eight descriptors of 64 rows) from 142 / 209 / 222 to 130 / 192 / 206 us, the same
// bits; F16's did not move (117 us).
// (Tried before and not kept: each warp staging its own m16 tile in this order with its loads
// in registers, 239 of them, 2048-token prompts at 1215 tok/s against 1202 and 1212 (with the
// loads through shared memory it pays: GEMM_RING below); the weights alone through a per-warp
// cp.async ring, slower: latency, with one warp a scheduler.) (Measurements:
// scripts/kernel_lab/HISTORY.md, "gemm.cu: GemmX".)
struct GemmX {
    uint4 f[GEMM_MTILES][2][2][32];
    float s[16 * GEMM_MTILES];
};

// One unit's products of a warp: its weights (wv, dw: gemm_load_w's) times x's m16 tiles in X,
// into acc.
template <bool Q8>
__device__ __forceinline__ void gemm_unit_all(float (&acc)[GEMM_MTILES][GEMM_TILES][4], const uint4 (&wv)[GEMM_TILES],
                                              const float (&dw)[GEMM_TILES], const GemmX& X, int t, int lane, int g,
                                              int mtiles) {
    u32 bw[GEMM_TILES][2][2];
    float d0[GEMM_TILES], d1[GEMM_TILES];
    gemm_prep_w<Q8>(wv, dw, t, bw, d0, d1);
#pragma unroll
    for (int mt = 0; mt < GEMM_MTILES; mt++) {
        if (mt < mtiles) {
            const uint4 hr[2] = {X.f[mt][0][0][lane], X.f[mt][0][1][lane]};
            const uint4 lr[2] = {X.f[mt][1][0][lane], X.f[mt][1][1][lane]};
            gemm_unit(acc[mt], hr, lr, X.s[16 * mt + g], X.s[16 * mt + 8 + g], bw, d0, d1);
        }
    }
}

// Loads this thread's share of unit u of x: row 16 warp + 8 p + g, inputs [8t, 8t + 8) (the
// tiled layout, TILED: [4t, 4t + 4) and [16 + 4t, 20 + 4t), the inputs of the lane's weight
// bytes there), for p = 0, 1 (zeros past n: xsrc null, else the row's x at input 8t, or 4t).
template <bool TILED>
__device__ __forceinline__ void gemm_fetch_x(int u, const float* const (&xsrc)[2], float4 (&xr)[2][2]) {
#pragma unroll
    for (int p = 0; p < 2; p++) {
        xr[p][0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        xr[p][1] = xr[p][0];
        if (xsrc[p]) {
            const float4* v = (const float4*)(xsrc[p] + 32 * (long long)u);
            xr[p][0] = v[0];
            xr[p][1] = v[TILED ? 4 : 1];
        }
    }
}

// Splits this thread's share (gemm_fetch_x: rows g and g + 8 of m16 tile `warp`) into X, if the
// block has that tile (the branch is the warp's, so gemm_split_x's quad shuffles see all 32
// lanes). Each uint4 is one A fragment of the mma, the two rows interleaved as its registers
// take them.
__device__ __forceinline__ void gemm_stage_x(const float4 (&xr)[2][2], GemmX& X, int warp, int lane, int mtiles) {
    if (warp < mtiles) {
        u32 hi[2][2][2], lo[2][2][2];
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const float v[8] = {xr[p][0].x, xr[p][0].y, xr[p][0].z, xr[p][0].w,
                                xr[p][1].x, xr[p][1].y, xr[p][1].z, xr[p][1].w};
            const float back = gemm_split_x(v, hi[p], lo[p]);
            if ((lane & 3) == 0) {
                X.s[16 * warp + 8 * p + (lane >> 2)] = back;
            }
        }
#pragma unroll
        for (int st = 0; st < 2; st++) {
            X.f[warp][0][st][lane] = make_uint4(hi[0][st][0], hi[1][st][0], hi[0][st][1], hi[1][st][1]);
            X.f[warp][1][st][lane] = make_uint4(lo[0][st][0], lo[1][st][0], lo[0][st][1], lo[1][st][1]);
        }
    }
}

// Loads unit u of each tile's weights, and Q8_0's block scale of each tile's row g. TILED: the
// Q8_0 rows of the decode's tensor-core layout (q8_0.cu, rust/engine/quant/split/q8_0.rs),
// wrow[2j] the warp's 16-row tile j (its n8 tiles 2j and 2j + 1), whose block u holds the
// lane's 16 bytes at 512 u + 16 lane: row g's inputs 4t..4t+3, row g + 8's, row g's 16+4t..,
// row g + 8's; and the rows' scales at 512 units + 32 u + 4 g (rows g, g + 8).
template <bool Q8, bool TILED>
__device__ __forceinline__ void gemm_load_w(int u, int lane, const u8* const (&wrow)[GEMM_TILES], int units,
                                            uint4 (&wv)[GEMM_TILES], float (&dw)[GEMM_TILES]) {
    const int t = lane & 3;
    if (TILED) {
#pragma unroll
        for (int j = 0; j < GEMM_TILES / 2; j++) {
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            u32 s = 0u;
            if (wrow[2 * j]) {
                v = *(const uint4*)(wrow[2 * j] + 512 * (long long)u + 16 * lane);
                s = *(const u32*)(wrow[2 * j] + 512 * (long long)units + 32 * (long long)u + 4 * (lane >> 2));
            }
            wv[2 * j] = make_uint4(v.x, v.z, 0u, 0u);
            wv[2 * j + 1] = make_uint4(v.y, v.w, 0u, 0u);
            dw[2 * j] = f16_bits_to_f32(s & 0xffffu);
            dw[2 * j + 1] = f16_bits_to_f32(s >> 16);
        }
        return;
    }
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        if (Q8) {
            uint2 v = make_uint2(0u, 0u);
            float d = 0.0f;
            if (wrow[q]) {
                v = *(const uint2*)(wrow[q] + 32 * (long long)u + 8 * t);
                d = f16_bits_to_f32(*(const u16*)(wrow[q] + 32 * (long long)units + 2 * u));
            }
            wv[q] = make_uint4(v.x, v.y, 0u, 0u);
            dw[q] = d;
        } else {
            wv[q] = wrow[q] ? *(const uint4*)(wrow[q] + 64 * (long long)u + 16 * t) : make_uint4(0u, 0u, 0u, 0u);
            dw[q] = 1.0f;
        }
    }
}

// Row g of each of a warp's four n8 tiles (null past n_out; TILED: each 16-row tile's run at
// 2j, null past n_out and at 2j + 1), and the rows of x this thread loads and splits
// (gemm_fetch_x: rows 16 warp + 8 p + g, null past n).
template <bool TILED>
__device__ __forceinline__ void gemm_rows(const MvBlock& B, int warp, int g, int t, const u8* (&wrow)[GEMM_TILES],
                                          const float* (&xsrc)[2]) {
    const MvDesc& D = *B.D;
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        const int o = TILED ? B.o0 + 8 * q : B.o0 + 8 * q + g;
        const bool has = B.nrows > 0 && o < D.n_out && (!TILED || (q & 1) == 0);
        wrow[q] = has ? D.w + (long long)o * D.row_bytes : nullptr;
    }
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const int r = 16 * warp + 8 * p + g;
        xsrc[p] = r < D.n ? D.x + (long long)r * D.n_in + (TILED ? 4 : 8) * t : nullptr;
    }
}

// Asks L2 for the warp's rows over units [u0, u1): a lane a row (Q8_0 also its scales);
// TILED, lanes 0 to 3: tile 0's quant bytes, its scales, tile 1's, its scales.
template <bool Q8, bool TILED>
__device__ __forceinline__ void gemm_prefetch(const MvBlock& B, int lane, const u8* const (&wrow)[GEMM_TILES],
                                              int units, int u0, int u1) {
    const MvDesc& D = *B.D;
    if (TILED) {
        const u8* tb = lane < 2 ? wrow[0] : wrow[2];
        if (lane < 4 && tb) {
            const unsigned long long a = (unsigned long long)tb + ((lane & 1) ? 512ull * units : 0ull);
            const unsigned long long ub = (lane & 1) ? 32 : 512;
            ds4_prefetch_l2(a + ub * u0, a + ub * u1);
        }
    } else if (B.o0 + lane < D.n_out && B.nrows > 0) {
        const unsigned long long row = (unsigned long long)(D.w + (long long)(B.o0 + lane) * D.row_bytes);
        const int ub = Q8 ? 32 : 64;
        ds4_prefetch_l2(row + (unsigned long long)ub * u0, row + (unsigned long long)ub * u1);
        if (Q8) {
            ds4_prefetch_l2(row + 32ull * units + 2 * u0, row + 32ull * units + 2 * u1);
        }
    }
}

// The block's sums to y (or to its slice's partial sums), then the slices' addition.
__device__ __forceinline__ void gemm_store(const MvBlock& B, const float (&acc)[GEMM_MTILES][GEMM_TILES][4], int g,
                                           int t, int mtiles, int* __restrict__ counters) {
    const MvDesc& D = *B.D;
    const int n = D.n;
    const int n_out = D.n_out;
    float* y = D.slices > 1 ? D.part + (long long)B.slice * n * n_out : D.y;
    const int ys = D.slices > 1 ? n_out : D.y_stride;
    if (B.nrows > 0) {
#pragma unroll
        for (int mt = 0; mt < GEMM_MTILES; mt++) {
            if (mt < mtiles) {
#pragma unroll
                for (int q = 0; q < GEMM_TILES; q++) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const int r = 16 * mt + g + 8 * (i >> 1);
                        const int o = B.o0 + 8 * q + 2 * t + (i & 1);
                        if (r < n && o < n_out) {
                            y[(long long)r * ys + o] = acc[mt][q][i];
                        }
                    }
                }
            }
        }
    }
    mv_add_slices(B.D, B.rb, counters);
}

// The products of a launch's descriptors (MvDesc, as matvec's: warp_rows = 32, group = 1,
// `slices` splitting the units between blocks; x the rows as floats, n <= 64). 128 threads: a
// block's four warps take 128 output rows over the same units, so that each unit of x is
// loaded and split once for all of them (in shared memory, GemmX). TILED: Q8_0 in the
// decode's tensor-core layout, whole 16-row tiles only (n_out a multiple of 16; gemm.rs).
template <bool Q8, bool TILED>
__device__ __forceinline__ void gemm_body(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters) {
    const MvBlock B = mv_block(descs, count);
    const MvDesc& D = *B.D;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int units = D.n_in >> 5;
    // m16 tiles with rows (uniform in the block: one descriptor).
    const int mtiles = (D.n + 15) >> 4;
    int u0, u1;
    mv_slice(units, D.slices, B.slice, u0, u1);
    const u8* wrow[GEMM_TILES];
    const float* xsrc[2];
    gemm_rows<TILED>(B, warp, g, t, wrow, xsrc);
    float acc[GEMM_MTILES][GEMM_TILES][4] = {};
    // The weights are the model's: before waiting for the previous kernel (programmatic
    // dependent launch, common.cuh), each warp asks L2 for its 32 rows over the slice (a lane
    // a row) and loads its first unit's weights.
    gemm_prefetch<Q8, TILED>(B, lane, wrow, units, u0, u1);
    // Stages of GEMM_STAGE units, two in turn: stage k's x in xs[k & 1], its weights in
    // registers; the next stage's loads are in flight while this one's products run.
    __shared__ GemmX xs[2][GEMM_STAGE];
    float dw[GEMM_STAGE][GEMM_TILES];
    uint4 wv[GEMM_STAGE][GEMM_TILES];
#pragma unroll
    for (int k = 0; k < GEMM_STAGE; k++) {
        if (u0 + k < u1) {
            gemm_load_w<Q8, TILED>(u0 + k, lane, wrow, units, wv[k], dw[k]);
        }
    }
    ds4_grid_deps();
#pragma unroll
    for (int k = 0; k < GEMM_STAGE; k++) {
        if (u0 + k < u1) {
            float4 xr[2][2];
            gemm_fetch_x<TILED>(u0 + k, xsrc, xr);
            gemm_stage_x(xr, xs[0][k], warp, lane, mtiles);
        }
    }
    __syncthreads();
    // The loop's bounds are the block's: every warp reaches each barrier. The units are added
    // in order whatever GEMM_STAGE is (the same bits).
    for (int u = u0, i = 0; u < u1; u += GEMM_STAGE, i ^= 1) {
        const int nu = u + GEMM_STAGE;
        float ndw[GEMM_STAGE][GEMM_TILES];
        uint4 nwv[GEMM_STAGE][GEMM_TILES];
        float4 nxr[GEMM_STAGE][2][2];
#pragma unroll
        for (int k = 0; k < GEMM_STAGE; k++) {
            if (nu + k < u1) {
                gemm_load_w<Q8, TILED>(nu + k, lane, wrow, units, nwv[k], ndw[k]);
                gemm_fetch_x<TILED>(nu + k, xsrc, nxr[k]);
            }
        }
        if (B.nrows > 0) {
#pragma unroll
            for (int k = 0; k < GEMM_STAGE; k++) {
                if (u + k < u1) {
                    gemm_unit_all<Q8>(acc, wv[k], dw[k], xs[i][k], t, lane, g, mtiles);
                }
            }
        }
        // Buffers xs[i ^ 1] were last read before the previous barrier.
#pragma unroll
        for (int k = 0; k < GEMM_STAGE; k++) {
            if (nu + k < u1) {
                gemm_stage_x(nxr[k], xs[i ^ 1][k], warp, lane, mtiles);
#pragma unroll
                for (int q = 0; q < GEMM_TILES; q++) {
                    wv[k][q] = nwv[k][q];
                    dw[k][q] = ndw[k][q];
                }
            }
        }
        __syncthreads();
    }
    // Every weight is read: the next kernel may launch (its blocks wait for this grid).
    ds4_grid_launch();
    gemm_store(B, acc, g, t, mtiles, counters);
}

// The Q8_0 kernels' loads go through a ring of GEMM_RING units in shared memory, by cp.async,
// GEMM_RING - 1 units ahead, instead of through registers: each thread copies the x it splits
// and each lane the weight bytes it multiplies, so no barrier guards the ring, only the split x
// (GemmX, two in turn). The same sums in the same order, bit for bit. The registers the loads
// held went from 228 to 148 (tiled) and 231 to 156 (float-x), and the tiled kernel got faster
// (kernel lab, H200: Flash's q_b at eight descriptors of 64 rows 343 us a launch against 468
// through registers; the float-x kernel gained less). A ring of three units timed as two, and
// three blocks an SM as two. GEMM_RING=0: the register path. (F16 keeps the register path: its
// 64 weight bytes a lane and unit would take the ring past the 48 KB of static shared memory.)
// (Measurements: scripts/kernel_lab/HISTORY.md, "gemm.cu: GEMM_RING".)
#ifndef GEMM_RING
#define GEMM_RING 2
#endif

// One unit of the ring: the thread's x (gemm_fetch_x's four float4s) and the lane's weight
// bytes (gemm_load_w's): TILED, 16 bytes of each of its two 16-row tiles and their scale words;
// else 8 bytes of each of its four rows (their 2-byte scales, which cp.async cannot copy, come
// through registers one unit ahead).
template <bool TILED>
struct GemmSlot {
    float4 x[4][128];
    uint4 w[2][128];
    u32 s[2][128];
};

template <>
struct GemmSlot<false> {
    float4 x[4][128];
    uint2 w[4][128];
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool has) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(has ? 16 : 0) : "memory");
#else
    *(uint4*)dst = has ? *(const uint4*)src : make_uint4(0u, 0u, 0u, 0u);
#endif
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool has) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(d), "l"(src), "r"(has ? 8 : 0) : "memory");
#else
    *(uint2*)dst = has ? *(const uint2*)src : make_uint2(0u, 0u);
#endif
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool has) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(has ? 4 : 0) : "memory");
#else
    *(u32*)dst = has ? *(const u32*)src : 0u;
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// The block scales of unit u of the float-x layout's rows (gemm_load_w's dw).
__device__ __forceinline__ void gemm_q8_scales(int u, const u8* const (&wrow)[GEMM_TILES], int units,
                                               float (&dw)[GEMM_TILES]) {
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        dw[q] = wrow[q] ? f16_bits_to_f32(*(const u16*)(wrow[q] + 32 * (long long)units + 2 * u)) : 0.0f;
    }
}

// A ring slot's weights as gemm_load_w gives them: the tiled layout's 16 bytes of each 16-row
// tile (two n8 tiles) and their scale words.
__device__ __forceinline__ void gemm_slot_w_tiled(const uint4 (&w)[2][128], const u32 (&s)[2][128], int tid,
                                                  uint4 (&wv)[GEMM_TILES], float (&dw)[GEMM_TILES]) {
#pragma unroll
    for (int j = 0; j < GEMM_TILES / 2; j++) {
        const uint4 v = w[j][tid];
        const u32 sc = s[j][tid];
        wv[2 * j] = make_uint4(v.x, v.z, 0u, 0u);
        wv[2 * j + 1] = make_uint4(v.y, v.w, 0u, 0u);
        dw[2 * j] = f16_bits_to_f32(sc & 0xffffu);
        dw[2 * j + 1] = f16_bits_to_f32(sc >> 16);
    }
}

// The float-x layout's 8 bytes of each n8 tile's row g (its scales come through registers).
__device__ __forceinline__ void gemm_slot_w_q8(const uint2 (&w)[4][128], int tid, uint4 (&wv)[GEMM_TILES]) {
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        const uint2 v = w[q][tid];
        wv[q] = make_uint4(v.x, v.y, 0u, 0u);
    }
}

#if GEMM_RING > 0
// Static shared memory, within the 48 KB a launch gets without opting in: 43.5 KB (tiled) and
// 40.5 KB at two units.
static_assert(GEMM_RING * sizeof(GemmSlot<true>) + 2 * sizeof(GemmX) <= 48 * 1024, "GEMM_RING too deep");

// The weights of unit u into slot S (gemm_load_w's bytes; zeros for a null row or tile).
__device__ __forceinline__ void gemm_ring_w(GemmSlot<true>& S, int u, int tid, int lane,
                                            const u8* const (&wrow)[GEMM_TILES], int units, const u8* any) {
#pragma unroll
    for (int j = 0; j < GEMM_TILES / 2; j++) {
        const u8* r = wrow[2 * j];
        cp_async16(&S.w[j][tid], r ? r + 512 * (long long)u + 16 * lane : any, r != nullptr);
        cp_async4(&S.s[j][tid], r ? r + 512 * (long long)units + 32 * (long long)u + 4 * (lane >> 2) : any,
                  r != nullptr);
    }
}

__device__ __forceinline__ void gemm_ring_w(GemmSlot<false>& S, int u, int tid, int lane,
                                            const u8* const (&wrow)[GEMM_TILES], int, const u8* any) {
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        const u8* r = wrow[q];
        cp_async8(&S.w[q][tid], r ? r + 32 * (long long)u + 8 * (lane & 3) : any, r != nullptr);
    }
}

// The thread's x of unit u into slot S (gemm_fetch_x<TILED>'s floats; zeros past n).
template <bool TILED>
__device__ __forceinline__ void gemm_ring_x(GemmSlot<TILED>& S, int u, int tid, const float* const (&xsrc)[2],
                                            const u8* any) {
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const float* v = xsrc[p] ? xsrc[p] + 32 * (long long)u : nullptr;
        cp_async16(&S.x[2 * p][tid], v ? (const void*)v : (const void*)any, v != nullptr);
        cp_async16(&S.x[2 * p + 1][tid], v ? (const void*)(v + (TILED ? 16 : 4)) : (const void*)any, v != nullptr);
    }
}

// A slot's weights as gemm_load_w gives them (TILED: the scales too; else dw is left as it is).
__device__ __forceinline__ void gemm_slot_w(const GemmSlot<true>& S, int tid, uint4 (&wv)[GEMM_TILES],
                                            float (&dw)[GEMM_TILES]) {
    gemm_slot_w_tiled(S.w, S.s, tid, wv, dw);
}

__device__ __forceinline__ void gemm_slot_w(const GemmSlot<false>& S, int tid, uint4 (&wv)[GEMM_TILES],
                                            float (&)[GEMM_TILES]) {
    gemm_slot_w_q8(S.w, tid, wv);
}

template <bool TILED>
__device__ __forceinline__ void gemm_body_ring(const MvDesc* __restrict__ descs, int count,
                                               int* __restrict__ counters) {
    __shared__ GemmSlot<TILED> ring[GEMM_RING];
    __shared__ GemmX xs[2];
    const MvBlock B = mv_block(descs, count);
    const MvDesc& D = *B.D;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int units = D.n_in >> 5;
    const int mtiles = (D.n + 15) >> 4;
    int u0, u1;
    mv_slice(units, D.slices, B.slice, u0, u1);
    const u8* wrow[GEMM_TILES];
    const float* xsrc[2];
    gemm_rows<TILED>(B, warp, g, t, wrow, xsrc);
    float acc[GEMM_MTILES][GEMM_TILES][4] = {};
    gemm_prefetch<true, TILED>(B, lane, wrow, units, u0, u1);
    // The float-x layout's scales: unit u's in dw, the next unit's loaded a unit ahead.
    float dw[GEMM_TILES], dwn[GEMM_TILES];
    if (!TILED && u0 < u1) {
        gemm_q8_scales(u0, wrow, units, dw);
    }
    const u8* any = D.w;
    // The first GEMM_RING - 1 units' weights (one group), then, after the previous kernel, their
    // x (a group each): unit k's copies are done once at most GEMM_RING - 1 later groups are not.
#pragma unroll
    for (int k = 0; k < GEMM_RING - 1; k++) {
        if (u0 + k < u1) {
            gemm_ring_w(ring[k], u0 + k, tid, lane, wrow, units, any);
        }
    }
    cp_async_commit();
    ds4_grid_deps();
#pragma unroll
    for (int k = 0; k < GEMM_RING - 1; k++) {
        if (u0 + k < u1) {
            gemm_ring_x(ring[k], u0 + k, tid, xsrc, any);
        }
        cp_async_commit();
    }
    int slot = 0;
    for (int u = u0, i = 0; u < u1; u++, i ^= 1) {
        const int nu = u + GEMM_RING - 1;
        if (!TILED && u + 1 < u1) {
            gemm_q8_scales(u + 1, wrow, units, dwn);
        }
        if (nu < u1) {
            GemmSlot<TILED>& S = ring[slot == 0 ? GEMM_RING - 1 : slot - 1];
            gemm_ring_w(S, nu, tid, lane, wrow, units, any);
            gemm_ring_x(S, nu, tid, xsrc, any);
        }
        cp_async_commit();
        cp_async_wait<GEMM_RING - 1>();
        const GemmSlot<TILED>& S = ring[slot];
        {
            float4 xr[2][2];
#pragma unroll
            for (int p = 0; p < 2; p++) {
                xr[p][0] = S.x[2 * p][tid];
                xr[p][1] = S.x[2 * p + 1][tid];
            }
            // xs[i] was last read before the previous barrier.
            gemm_stage_x(xr, xs[i], warp, lane, mtiles);
        }
        __syncthreads();
        if (B.nrows > 0) {
            uint4 wv[GEMM_TILES];
            gemm_slot_w(S, tid, wv, dw);
            gemm_unit_all<true>(acc, wv, dw, xs[i], t, lane, g, mtiles);
        }
        if (!TILED) {
#pragma unroll
            for (int q = 0; q < GEMM_TILES; q++) {
                dw[q] = dwn[q];
            }
        }
        slot = slot == GEMM_RING - 1 ? 0 : slot + 1;
    }
    ds4_grid_launch();
    gemm_store(B, acc, g, t, mtiles, counters);
}
#endif


extern "C" __global__ void __launch_bounds__(128, GEMM_MIN_BLOCKS) ds4_gemm_f16(const MvDesc* __restrict__ descs, int count,
                                                               int* __restrict__ counters) {
    gemm_body<false, false>(descs, count, counters);
}

extern "C" __global__ void __launch_bounds__(128, GEMM_MIN_BLOCKS) ds4_gemm_q8_0(const MvDesc* __restrict__ descs, int count,
                                                                int* __restrict__ counters) {
#if GEMM_RING > 0
    gemm_body_ring<false>(descs, count, counters);
#else
    gemm_body<true, false>(descs, count, counters);
#endif
}

// Q8_0 in the decode's tensor-core layout (q_b, o_a, o_b and the head of Flash by default:
// context.rs `tensor_cores`), which the decode's kernel there reads once per 16 rows of x. The
// same split of x as ds4_gemm_q8_0's, each lane's x taken at the inputs of its bytes in the
// tiles, the loads through the ring above (GEMM_RING). Faster than the decode's kernel
// (DS4_CUDA_GEMM_MQ=0), before the ring: on an H200, Flash prompts of 2048 tokens at 1470 tok/s
// against 1334. (The head's one row of a prompt's last step is slower here, 540 us against
// 201, but a kernel chosen by the row count would make a row's bits depend on its step.)
// (Measurements: scripts/kernel_lab/HISTORY.md, "gemm.cu: ds4_gemm_q8_0_mq".)
extern "C" __global__ void __launch_bounds__(128, GEMM_MIN_BLOCKS)
    ds4_gemm_q8_0_mq(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters) {
#if GEMM_RING > 0
    gemm_body_ring<true>(descs, count, counters);
#else
    gemm_body<true, true>(descs, count, counters);
#endif
}


// ---- A prompt's products on x split once a call (ds4_gemm_split, then ds4_gemm_px_*)
//
// The kernels above split each unit of x (gemm_split_x) in every block that reads it: a
// product of n_out rows splits each unit n_out / 128 times (q_b: 256 times), and the split and
// the staging of its halves were about a third of the loop (ds4_gemm_q8_0_mq: 588 SASS
// instructions a unit for 64 HMMA). Here ds4_gemm_split writes each row's split once, already
// as the mma's A fragments, and the products copy those into shared memory by cp.async as they
// copy their weights, from sources set up once and advanced a unit at a time (the loop: 403
// instructions a unit). The split is gemm_split_x's and the sums gemm_unit's, in the same
// order, so the results are the kernels' above bit for bit (tests_gemm checks it). Faster on an
// H200 (Flash, against the kernels above, DS4_CUDA_GEMM_PX=0): 2048-token prompts at 2202 tok/s
// against 2101. (Tried and dropped: products of fewer than 512 rows on the kernels above, with
// no split; no better. Also one power of two a row instead of one a unit, so that a unit's sums
// need no scaling of their own: an input 2^-17 below its row's largest then keeps fewer than 22
// bits, and rows with one large value fail tests_gemm's bound.) (Measurements:
// scripts/kernel_lab/HISTORY.md, "gemm.cu: ds4_gemm_split".)
//
// The split of rows in tiles of 16 (px_tile_bytes(U) bytes a tile of U = n_in / 32 units):
// unit u's 2048 bytes at 2048 u, fragment f = 0..3 (hi step 0, hi step 1, lo step 0, lo step 1)
// of lane l at 16 (32 f + l), as gemm_stage_x lays out GemmX (rows g and g + 8 interleaved as
// the mma takes its registers); then the units' scales back, 16 floats a unit (row order) at
// 2048 U + 64 u. A lane's eight inputs of a row are those of the weight layout (TILED: [4t,
// 4t + 4) and [16 + 4t, 20 + 4t); else [8t, 8t + 8)). Rows past the last are split as zeros.

__device__ __forceinline__ long long px_tile_bytes(int units) {
    return 2112ll * units;
}

// Units of a row a warp of ds4_gemm_split takes (their loads in flight together).
#define PX_SPLIT_UNITS 4

// Splits rows [0, rows) of x (rows of n_in floats, 16-byte aligned) into out. Block 256; grid
// (ceil(units / (8 PX_SPLIT_UNITS)), ceil(rows / 16)): warp w of block x takes units
// 8 PX_SPLIT_UNITS x + w + 8 k of tile y, k < PX_SPLIT_UNITS.
extern "C" __global__ void __launch_bounds__(256)
    ds4_gemm_split(const float* __restrict__ x, int n_in, int rows, int tiled, u8* __restrict__ out) {
    ds4_grid_deps();
    const int units = n_in >> 5;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int ub = 8 * PX_SPLIT_UNITS * blockIdx.x + warp;
    float4 xv[PX_SPLIT_UNITS][2][2];
#pragma unroll
    for (int k = 0; k < PX_SPLIT_UNITS; k++) {
        const int u = ub + 8 * k;
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const int r = 16 * blockIdx.y + 8 * p + g;
            xv[k][p][0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            xv[k][p][1] = xv[k][p][0];
            if (u < units && r < rows) {
                const float4* xr = (const float4*)(x + (long long)r * n_in + 32 * u);
                xv[k][p][0] = tiled ? xr[t] : xr[2 * t];
                xv[k][p][1] = tiled ? xr[4 + t] : xr[2 * t + 1];
            }
        }
    }
    ds4_grid_launch();
    u8* tb = out + (long long)blockIdx.y * px_tile_bytes(units);
#pragma unroll
    for (int k = 0; k < PX_SPLIT_UNITS; k++) {
        const int u = ub + 8 * k;
        if (u >= units) {
            break;  // the whole warp
        }
        u32 hi[2][2][2], lo[2][2][2];
        float back[2];
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const float v[8] = {xv[k][p][0].x, xv[k][p][0].y, xv[k][p][0].z, xv[k][p][0].w,
                                xv[k][p][1].x, xv[k][p][1].y, xv[k][p][1].z, xv[k][p][1].w};
            back[p] = gemm_split_x(v, hi[p], lo[p]);
        }
        uint4* f = (uint4*)(tb + 2048ll * u);
#pragma unroll
        for (int st = 0; st < 2; st++) {
            f[32 * st + lane] = make_uint4(hi[0][st][0], hi[1][st][0], hi[0][st][1], hi[1][st][1]);
            f[32 * (2 + st) + lane] = make_uint4(lo[0][st][0], lo[1][st][0], lo[0][st][1], lo[1][st][1]);
        }
        if (t == 0) {
            float* sc = (float*)(tb + 2048ll * units + 64ll * u);
            sc[g] = back[0];
            sc[8 + g] = back[1];
        }
    }
}

// Units of split x and weights the ring holds (PX_RING - 1 ahead); F16's weights take twice
// the bytes (two units). A/B with DS4_CUDA_DEFINES.
#ifndef PX_RING
#define PX_RING 3
#endif
#define PX_F16 0
#define PX_Q8 1
#define PX_TILED 2

// One unit of the block in shared memory: the split x of its m16 tiles (fragments in the
// split's order, so a lane's are four LDS.128 with no moves) and their scales, and each lane's
// weight bytes (as GemmSlot's: a lane copies and reads only its own).
template <int KIND>
struct PxSlot {
    uint4 x[GEMM_MTILES][128];
    float xs[GEMM_MTILES][16];
    uint4 w[4][128];  // F16: 16 bytes of each n8 tile's row g
};

template <>
struct PxSlot<PX_Q8> {
    uint4 x[GEMM_MTILES][128];
    float xs[GEMM_MTILES][16];
    uint2 w[4][128];  // 8 bytes of each n8 tile's row g (scales through registers)
};

template <>
struct PxSlot<PX_TILED> {
    uint4 x[GEMM_MTILES][128];
    float xs[GEMM_MTILES][16];
    uint4 w[2][128];  // 16 bytes of each 16-row tile
    u32 s[2][128];    // the tile's scale word of rows g and g + 8
};

// A thread's copy sources, each at the unit to copy next and advanced a unit at a time (by 0
// for a row or tile the warp lacks, whose copies are zeros from a valid address): x its 16-byte
// piece of tile 0 (tiles tb apart), xs (threads 4 mt + 0..3) its quarter of tile mt's scales; w
// its weight bytes of each n8 tile (TILED: of each 16-row tile, and ws their scale words).
struct PxSrc {
    const u8* x;
    const u8* xs;
    const u8* w[GEMM_TILES];
    const u8* ws[GEMM_TILES / 2];
    int wstep[GEMM_TILES];
    int sstep[GEMM_TILES / 2];
    bool has[GEMM_TILES];
};

template <int KIND>
__device__ __forceinline__ PxSrc px_src(const MvDesc& D, const u8* const (&wrow)[GEMM_TILES], int units, int u0,
                                        int tid, int lane) {
    PxSrc P;
    P.x = (const u8*)D.x + 16 * tid + 2048ll * u0;
    P.xs = (const u8*)D.x + (tid >> 2) * px_tile_bytes(units) + 2048ll * units + 16 * (tid & 3) + 64ll * u0;
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        if (KIND == PX_TILED) {
            if (q < GEMM_TILES / 2) {
                const u8* tr = wrow[2 * q];
                P.has[q] = tr != nullptr;
                P.w[q] = tr ? tr + 16 * lane + 512ll * u0 : D.w;
                P.wstep[q] = tr ? 512 : 0;
                P.ws[q] = tr ? tr + 512ll * units + 4 * (lane >> 2) + 32ll * u0 : D.w;
                P.sstep[q] = tr ? 32 : 0;
            }
        } else {
            const u8* r = wrow[q];
            const int ub = KIND == PX_Q8 ? 32 : 64;
            P.has[q] = r != nullptr;
            P.w[q] = r ? r + (KIND == PX_Q8 ? 8 : 16) * (lane & 3) + (long long)ub * u0 : D.w;
            P.wstep[q] = r ? ub : 0;
        }
    }
    return P;
}

// The weights of the unit at P into S (gemm_load_w's bytes; zeros where the warp lacks the
// row), then P's weight sources advanced a unit.
__device__ __forceinline__ void px_copy_w(PxSlot<PX_TILED>& S, PxSrc& P, int tid) {
#pragma unroll
    for (int j = 0; j < GEMM_TILES / 2; j++) {
        cp_async16(&S.w[j][tid], P.w[j], P.has[j]);
        cp_async4(&S.s[j][tid], P.ws[j], P.has[j]);
        P.w[j] += P.wstep[j];
        P.ws[j] += P.sstep[j];
    }
}

__device__ __forceinline__ void px_copy_w(PxSlot<PX_Q8>& S, PxSrc& P, int tid) {
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        cp_async8(&S.w[q][tid], P.w[q], P.has[q]);
        P.w[q] += P.wstep[q];
    }
}

__device__ __forceinline__ void px_copy_w(PxSlot<PX_F16>& S, PxSrc& P, int tid) {
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        cp_async16(&S.w[q][tid], P.w[q], P.has[q]);
        P.w[q] += P.wstep[q];
    }
}

// The split x of the unit at P into S (the block's m16 tiles, a 16-byte piece of each a
// thread), then P's x advanced a unit.
template <int KIND>
__device__ __forceinline__ void px_copy_x(PxSlot<KIND>& S, PxSrc& P, long long tb, int mtiles, int tid) {
#pragma unroll
    for (int mt = 0; mt < GEMM_MTILES; mt++) {
        if (mt < mtiles) {
            cp_async16(&S.x[mt][tid], P.x + mt * tb, true);
        }
    }
    if (tid < 4 * mtiles) {
        cp_async16(&S.xs[tid >> 2][4 * (tid & 3)], P.xs, true);
    }
    P.x += 2048;
    P.xs += 64;
}

// A slot's weights as gemm_load_w gives them (TILED: the scales too; Q8_0's float-x scales
// stay as they are in dw; F16's are 1).
__device__ __forceinline__ void px_slot_w(const PxSlot<PX_TILED>& S, int tid, uint4 (&wv)[GEMM_TILES],
                                          float (&dw)[GEMM_TILES]) {
    gemm_slot_w_tiled(S.w, S.s, tid, wv, dw);
}

__device__ __forceinline__ void px_slot_w(const PxSlot<PX_Q8>& S, int tid, uint4 (&wv)[GEMM_TILES],
                                          float (&)[GEMM_TILES]) {
    gemm_slot_w_q8(S.w, tid, wv);
}

__device__ __forceinline__ void px_slot_w(const PxSlot<PX_F16>& S, int tid, uint4 (&wv)[GEMM_TILES],
                                          float (&dw)[GEMM_TILES]) {
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        wv[q] = S.w[q][tid];
        dw[q] = 1.0f;
    }
}

// The products of a launch's descriptors as gemm_body's, x being ds4_gemm_split's tiles (a
// descriptor's x: the split's tile of its row 0; its rows start on a tile, GEMM_MAX_ROWS
// apart).
// (Tried and dropped: the loop built for a descriptor of all GEMM_MTILES m16 tiles with no test
// of mt, so that a unit's 64 mma are sixteen independent chains: the same bits, more registers
// or spills, no gain.) (Measurements: scripts/kernel_lab/HISTORY.md, "gemm.cu: gemm_body_px".)
template <int KIND>
__device__ __forceinline__ void gemm_body_px(const MvDesc* __restrict__ descs, int count,
                                             int* __restrict__ counters) {
    constexpr bool Q8 = KIND != PX_F16;
    constexpr bool TILED = KIND == PX_TILED;
    constexpr int RING = KIND == PX_F16 ? 2 : PX_RING;
    __shared__ PxSlot<KIND> ring[RING];
    const MvBlock B = mv_block(descs, count);
    const MvDesc& D = *B.D;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int units = D.n_in >> 5;
    const long long tb = px_tile_bytes(units);
    const int mtiles = (D.n + 15) >> 4;
    int u0, u1;
    mv_slice(units, D.slices, B.slice, u0, u1);
    const u8* wrow[GEMM_TILES];
    const float* xsrc_unused[2];
    gemm_rows<TILED>(B, warp, g, t, wrow, xsrc_unused);
    PxSrc P = px_src<KIND>(D, wrow, units, u0, tid, lane);
    float acc[GEMM_MTILES][GEMM_TILES][4] = {};
    gemm_prefetch<Q8, TILED>(B, lane, wrow, units, u0, u1);
    // The float-x layout's scales: unit u's in dw, the next unit's loaded a unit ahead.
    float dw[GEMM_TILES], dwn[GEMM_TILES];
    if (KIND == PX_Q8 && u0 < u1) {
        gemm_q8_scales(u0, wrow, units, dw);
    }
    // The first RING - 1 units' weights (one group), then, after the previous kernel, their x
    // (a group each).
#pragma unroll
    for (int k = 0; k < RING - 1; k++) {
        if (u0 + k < u1) {
            px_copy_w(ring[k], P, tid);
        }
    }
    cp_async_commit();
    ds4_grid_deps();
#pragma unroll
    for (int k = 0; k < RING - 1; k++) {
        if (u0 + k < u1) {
            px_copy_x(ring[k], P, tb, mtiles, tid);
        }
        cp_async_commit();
    }
    int slot = 0;
    for (int u = u0; u < u1; u++) {
        if (KIND == PX_Q8 && u + 1 < u1) {
            gemm_q8_scales(u + 1, wrow, units, dwn);
        }
        // This thread's copies of unit u are done; after the barrier every thread's are, and
        // every warp is past unit u - 1, whose slot the next copies fill.
        cp_async_wait<RING - 2>();
        __syncthreads();
        if (u + RING - 1 < u1) {
            PxSlot<KIND>& N = ring[slot == 0 ? RING - 1 : slot - 1];
            px_copy_w(N, P, tid);
            px_copy_x(N, P, tb, mtiles, tid);
        }
        cp_async_commit();
        const PxSlot<KIND>& S = ring[slot];
        if (B.nrows > 0) {
            uint4 wv[GEMM_TILES];
            px_slot_w(S, tid, wv, dw);
            u32 bw[GEMM_TILES][2][2];
            float d0[GEMM_TILES], d1[GEMM_TILES];
            gemm_prep_w<Q8>(wv, dw, t, bw, d0, d1);
#pragma unroll
            for (int mt = 0; mt < GEMM_MTILES; mt++) {
                if (mt < mtiles) {
                    const uint4 hr[2] = {S.x[mt][lane], S.x[mt][32 + lane]};
                    const uint4 lr[2] = {S.x[mt][64 + lane], S.x[mt][96 + lane]};
                    gemm_unit(acc[mt], hr, lr, S.xs[mt][g], S.xs[mt][8 + g], bw, d0, d1);
                }
            }
        }
        if (KIND == PX_Q8) {
#pragma unroll
            for (int q = 0; q < GEMM_TILES; q++) {
                dw[q] = dwn[q];
            }
        }
        slot = slot == RING - 1 ? 0 : slot + 1;
    }
    ds4_grid_launch();
    gemm_store(B, acc, g, t, mtiles, counters);
}

extern "C" __global__ void __launch_bounds__(128, GEMM_MIN_BLOCKS)
    ds4_gemm_px_f16(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters) {
    gemm_body_px<PX_F16>(descs, count, counters);
}

extern "C" __global__ void __launch_bounds__(128, GEMM_MIN_BLOCKS)
    ds4_gemm_px_q8_0(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters) {
    gemm_body_px<PX_Q8>(descs, count, counters);
}

extern "C" __global__ void __launch_bounds__(128, GEMM_MIN_BLOCKS)
    ds4_gemm_px_q8_0_mq(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters) {
    gemm_body_px<PX_TILED>(descs, count, counters);
}
