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
// (Three blocks an SM, 168 registers, spill: in the kernel lab, four descriptors of 64 rows of
// 1024 x 4096, 4096 x 2048, 2048 x 4096, 4096 x 4096 took 90 / 146 / 140 / 245 us where two
// blocks take 72 / 111 / 103 / 174; with GEMM_STAGE 1, 81 / 128 / 121 / 213, and a 2048-token
// Flash prompt 1166 / 1184 tok/s against 1264 / 1274. Four blocks, 128 registers: 109 / 177 /
// 171 / 307 us. H200, 2026-12-02.)
#ifndef GEMM_MIN_BLOCKS
#define GEMM_MIN_BLOCKS 2
#endif

// One unit's products of a warp's four tiles: x's rows g and g + 8 of an m16 tile, already
// split (hr, lr: the hi and lo pairs of row g, then of row g + 8, as gemm_stage_x stores them;
// s0, s1 their scales back), times the tiles' weights (b, d0, d1 from gemm_prep_w), into acc.
__device__ __forceinline__ void gemm_unit(float (&acc)[GEMM_TILES][4], const uint4 (&hr)[2], const uint4 (&lr)[2],
                                          float s0, float s1, const u32 (&b)[GEMM_TILES][2][2],
                                          const float (&d0)[GEMM_TILES], const float (&d1)[GEMM_TILES]) {
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        gemm_mma(c, hr[0].x, hr[1].x, hr[0].y, hr[1].y, b[q][0][0], b[q][0][1]);
        gemm_mma(c, lr[0].x, lr[1].x, lr[0].y, lr[1].y, b[q][0][0], b[q][0][1]);
        gemm_mma(c, hr[0].z, hr[1].z, hr[0].w, hr[1].w, b[q][1][0], b[q][1][1]);
        gemm_mma(c, lr[0].z, lr[1].z, lr[0].w, lr[1].w, b[q][1][0], b[q][1][1]);
        acc[q][0] = fmaf(c[0], d0[q] * s0, acc[q][0]);
        acc[q][1] = fmaf(c[1], d1[q] * s0, acc[q][1]);
        acc[q][2] = fmaf(c[2], d0[q] * s1, acc[q][2]);
        acc[q][3] = fmaf(c[3], d1[q] * s1, acc[q][3]);
    }
}

// One unit of the block's x, split once for the block's four warps: f[mt][h][0] the hi pairs,
// f[mt][h][1] the lo pairs of row 16 mt + 8 h + g, lane 4 g + t's (its inputs [8t, 8t + 8) in
// gemm_split_x's order), so that a warp reads a fragment as 32 consecutive uint4s; s the rows'
// scales back. 8.25 KB.
// (Tried and not kept: each warp staging its own m16 tile in the mma's A-fragment register
// order, rows clamped instead of null-checked, so that each LDS.128 lands in HMMA operands
// with no moves: a 2-unit loop iteration of 1071 sm_90 instructions against 1522 for Q8_0
// (893 against 1255 for F16), 239 registers, the same sums. Prompts of 2048 tokens on an H200,
// interleaved: 1215 tok/s against 1202 and 1212, and 8192 tokens 1100 against 1110 in another
// session: the kernel waits on its loads at two blocks an SM, it is not bound by issue.
// Nor its weights through a per-warp cp.async ring in dynamic shared memory, each lane copying
// the bytes it later reads (2 or 1 unit a stage, 3 to 6 stages, 168 to 196 registers, three
// blocks an SM): the same bits, and in the kernel lab 1024 x 4096 at four descriptors of 64
// rows 92 to 108 us against 86, in a Flash prompt's step 16.3 ms of these products against
// 15.2. Nsight Compute on that lab line: one warp a scheduler (242 registers, 12.5% occupancy),
// an instruction issued every 6 cycles, 20% of issue slots and 23% of memory throughput used,
// the stalls long scoreboard 1.5, wait 1.5 (dependent mma), short scoreboard 0.5 cycles an
// instruction: latency, with too few warps to hide it.)
struct GemmX {
    uint4 f[GEMM_MTILES][2][2][32];
    float s[16 * GEMM_MTILES];
};

// Loads this thread's share of unit u of x: row 32 p + 8 warp + g, inputs [8t, 8t + 8) (the
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

// Splits this thread's share (gemm_fetch_x) into X, for the m16 tiles the block has: a warp's
// eight rows of a pass lie in one half of one tile (mt = 2p + warp / 2, h = warp % 2), so the
// branch is the warp's, and gemm_split_x's quad shuffles see all 32 lanes.
__device__ __forceinline__ void gemm_stage_x(const float4 (&xr)[2][2], GemmX& X, int warp, int lane, int mtiles) {
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const int mt = 2 * p + (warp >> 1);
        const int h = warp & 1;
        if (mt < mtiles) {
            const float v[8] = {xr[p][0].x, xr[p][0].y, xr[p][0].z, xr[p][0].w,
                                xr[p][1].x, xr[p][1].y, xr[p][1].z, xr[p][1].w};
            u32 hi[2][2], lo[2][2];
            const float back = gemm_split_x(v, hi, lo);
            X.f[mt][h][0][lane] = make_uint4(hi[0][0], hi[0][1], hi[1][0], hi[1][1]);
            X.f[mt][h][1][lane] = make_uint4(lo[0][0], lo[0][1], lo[1][0], lo[1][1]);
            if ((lane & 3) == 0) {
                X.s[16 * mt + 8 * h + (lane >> 2)] = back;
            }
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
    const int n_out = D.n_out;
    const int n = D.n;
    // m16 tiles with rows (uniform in the block: one descriptor).
    const int mtiles = (n + 15) >> 4;
    int u0, u1;
    mv_slice(units, D.slices, B.slice, u0, u1);
    // Row g of each tile (null past n_out); TILED: each 16-row tile's run at 2j (null past
    // n_out, and at 2j + 1).
    const u8* wrow[GEMM_TILES];
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        const int o = TILED ? B.o0 + 8 * q : B.o0 + 8 * q + g;
        const bool has = B.nrows > 0 && o < n_out && (!TILED || (q & 1) == 0);
        wrow[q] = has ? D.w + (long long)o * D.row_bytes : nullptr;
    }
    // The rows of x this thread loads and splits (gemm_fetch_x).
    const float* xsrc[2];
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const int r = 32 * p + 8 * warp + g;
        xsrc[p] = r < n ? D.x + (long long)r * D.n_in + (TILED ? 4 : 8) * t : nullptr;
    }
    float acc[GEMM_MTILES][GEMM_TILES][4];
#pragma unroll
    for (int mt = 0; mt < GEMM_MTILES; mt++) {
#pragma unroll
        for (int q = 0; q < GEMM_TILES; q++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                acc[mt][q][i] = 0.0f;
            }
        }
    }
    // The weights are the model's: before waiting for the previous kernel (programmatic
    // dependent launch, common.cuh), each warp asks L2 for its 32 rows over the slice (a lane
    // a row) and loads its first unit's weights.
    if (TILED) {
        // Lanes 0 to 3: tile 0's quant bytes, its scales, tile 1's, its scales.
        const u8* tb = lane < 2 ? wrow[0] : wrow[2];
        if (lane < 4 && tb) {
            const unsigned long long a = (unsigned long long)tb + ((lane & 1) ? 512ull * units : 0ull);
            const unsigned long long ub = (lane & 1) ? 32 : 512;
            ds4_prefetch_l2(a + ub * u0, a + ub * u1);
        }
    } else if (B.o0 + lane < n_out && B.nrows > 0) {
        const unsigned long long row = (unsigned long long)(D.w + (long long)(B.o0 + lane) * D.row_bytes);
        const int ub = Q8 ? 32 : 64;
        ds4_prefetch_l2(row + (unsigned long long)ub * u0, row + (unsigned long long)ub * u1);
        if (Q8) {
            ds4_prefetch_l2(row + 32ull * units + 2 * u0, row + 32ull * units + 2 * u1);
        }
    }
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
                    u32 bw[GEMM_TILES][2][2];
                    float d0[GEMM_TILES], d1[GEMM_TILES];
                    gemm_prep_w<Q8>(wv[k], dw[k], t, bw, d0, d1);
                    const GemmX& X = xs[i][k];
#pragma unroll
                    for (int mt = 0; mt < GEMM_MTILES; mt++) {
                        if (mt < mtiles) {
                            const uint4 hr[2] = {X.f[mt][0][0][lane], X.f[mt][1][0][lane]};
                            const uint4 lr[2] = {X.f[mt][0][1][lane], X.f[mt][1][1][lane]};
                            gemm_unit(acc[mt], hr, lr, X.s[16 * mt + g], X.s[16 * mt + 8 + g], bw, d0, d1);
                        }
                    }
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


extern "C" __global__ void __launch_bounds__(128, GEMM_MIN_BLOCKS) ds4_gemm_f16(const MvDesc* __restrict__ descs, int count,
                                                               int* __restrict__ counters) {
    gemm_body<false, false>(descs, count, counters);
}

extern "C" __global__ void __launch_bounds__(128, GEMM_MIN_BLOCKS) ds4_gemm_q8_0(const MvDesc* __restrict__ descs, int count,
                                                                int* __restrict__ counters) {
    gemm_body<true, false>(descs, count, counters);
}

// Q8_0 in the decode's tensor-core layout (q_b, o_a, o_b and the head of Flash by default:
// context.rs `tensor_cores`), which the decode's kernel there reads once per 16 rows of x. The
// same loop as ds4_gemm_q8_0's, each lane's x taken at the inputs of its bytes in the tiles. On
// an H200 (Flash, one process, interleaved, 2026-12-03): prompts of 2048 / 8192 tokens at 1470
// / 1301 tok/s against 1334 / 1195 on the decode's kernel (DS4_CUDA_GEMM_MQ=0); a 512-row
// step's products of this layout 572 us a launch against 837 (CUPTI trace). (The head's one
// row of a prompt's last step is slower here, 540 us against 201, but a kernel chosen by the
// row count would make a row's bits depend on its step.)
extern "C" __global__ void __launch_bounds__(128, GEMM_MIN_BLOCKS)
    ds4_gemm_q8_0_mq(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters) {
    gemm_body<true, true>(descs, count, counters);
}
