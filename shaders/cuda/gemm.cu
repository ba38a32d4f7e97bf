// Products of a prompt's steps on the tensor cores (the prefill programs of the device decoder:
// rust/engine/backend/cuda/decode/gemm.rs): y[r, o] = W[o] . x[r] for up to 64 batch rows, for
// F16 matrices and for Q8_0 matrices stored in the float-x split layout (payloads, then scales:
// rust/engine/quant/split), one launch a format. The decode's kernels (matvec_split in
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
// a fixed order per warp, warps of a group added in warp order, slices in slice order), so a
// row gives the same bits whatever other rows share the step. These sums are not bitwise the
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

// One unit's products of a warp's four tiles: x's rows g and g + 8 (xv: lane t's 8 inputs of
// each) times the tiles' weights (b, d0, d1 from gemm_prep_w), into acc.
__device__ __forceinline__ void gemm_unit(float (&acc)[GEMM_TILES][4], const float (&xv)[2][8],
                                          const u32 (&b)[GEMM_TILES][2][2], const float (&d0)[GEMM_TILES],
                                          const float (&d1)[GEMM_TILES]) {
    u32 hi[2][2][2], lo[2][2][2];
    const float b0 = gemm_split_x(xv[0], hi[0], lo[0]);
    const float b1 = gemm_split_x(xv[1], hi[1], lo[1]);
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int st = 0; st < 2; st++) {
            gemm_mma(c, hi[0][st][0], hi[1][st][0], hi[0][st][1], hi[1][st][1], b[q][st][0], b[q][st][1]);
            gemm_mma(c, lo[0][st][0], lo[1][st][0], lo[0][st][1], lo[1][st][1], b[q][st][0], b[q][st][1]);
        }
        acc[q][0] = fmaf(c[0], d0[q] * b0, acc[q][0]);
        acc[q][1] = fmaf(c[1], d1[q] * b0, acc[q][1]);
        acc[q][2] = fmaf(c[2], d0[q] * b1, acc[q][2]);
        acc[q][3] = fmaf(c[3], d1[q] * b1, acc[q][3]);
    }
}

// Loads lane t's 8 inputs of unit u of x's rows g and g + 8 of m16 tile mt (zeros past n).
__device__ __forceinline__ void gemm_load_x(int u, int t, const float* const (&xrow)[GEMM_MTILES][2], int mt,
                                            float (&xv)[2][8]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
        if (xrow[mt][h]) {
            const float4* p = (const float4*)(xrow[mt][h] + 32 * u + 8 * t);
            a = p[0];
            b = p[1];
        }
        xv[h][0] = a.x;
        xv[h][1] = a.y;
        xv[h][2] = a.z;
        xv[h][3] = a.w;
        xv[h][4] = b.x;
        xv[h][5] = b.y;
        xv[h][6] = b.z;
        xv[h][7] = b.w;
    }
}

// Loads unit u of each tile's weights, and Q8_0's block scale of each tile's row g.
template <bool Q8>
__device__ __forceinline__ void gemm_load_w(int u, int t, const u8* const (&wrow)[GEMM_TILES], int units,
                                            uint4 (&wv)[GEMM_TILES], float (&dw)[GEMM_TILES]) {
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

// The products of a launch's descriptors (MvDesc, as matvec's: warp_rows = 32, `group` warps
// splitting a row group's units, `slices` splitting them between blocks; x the rows as
// floats, n <= 64). 128 threads.
template <bool Q8>
__device__ __forceinline__ void gemm_body(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters) {
    const MvBlock B = mv_block(descs, count);
    const MvDesc& D = *B.D;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int G = D.group;
    const int units = D.n_in >> 5;
    const int n_out = D.n_out;
    const int n = D.n;
    // m16 tiles with rows (uniform in the block: one descriptor).
    const int mtiles = (n + 15) >> 4;
    int u0, u1;
    mv_slice(units, D.slices, B.slice, u0, u1);
    // Row g of each tile (null past n_out), x's rows 16 mt + g and 16 mt + g + 8 (null past n).
    const u8* wrow[GEMM_TILES];
#pragma unroll
    for (int q = 0; q < GEMM_TILES; q++) {
        const int o = B.o0 + 8 * q + g;
        wrow[q] = (B.nrows > 0 && o < n_out) ? D.w + (long long)o * D.row_bytes : nullptr;
    }
    const float* xrow[GEMM_MTILES][2];
#pragma unroll
    for (int mt = 0; mt < GEMM_MTILES; mt++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = 16 * mt + 8 * h + g;
            xrow[mt][h] = r < n ? D.x + (long long)r * D.n_in : nullptr;
        }
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
    // dependent launch, common.cuh), one warp of the group asks L2 for its 32 rows over the
    // slice (a lane a row), and each warp loads its first unit's weights.
    if (B.p == 0 && B.o0 + lane < n_out && B.nrows > 0) {
        const unsigned long long row = (unsigned long long)(D.w + (long long)(B.o0 + lane) * D.row_bytes);
        const int ub = Q8 ? 32 : 64;
        ds4_prefetch_l2(row + (unsigned long long)ub * u0, row + (unsigned long long)ub * u1);
        if (Q8) {
            ds4_prefetch_l2(row + 32ull * units + 2 * u0, row + 32ull * units + 2 * u1);
        }
    }
    // Two units in flight: the next one's weights (and, with one m16 tile, its x) are loaded
    // before this one's products.
    float xv[2][8], nxv[2][8], dw[GEMM_TILES], ndw[GEMM_TILES];
    uint4 wv[GEMM_TILES], nwv[GEMM_TILES];
    int u = u0 + B.p;
    if (u < u1) {
        gemm_load_w<Q8>(u, t, wrow, units, wv, dw);
    }
    ds4_grid_deps();
    if (u < u1) {
        gemm_load_x(u, t, xrow, 0, xv);
    }
    for (; u < u1; u += G) {
        const int nu = u + G;
        if (nu < u1) {
            gemm_load_w<Q8>(nu, t, wrow, units, nwv, ndw);
            if (mtiles == 1) {
                gemm_load_x(nu, t, xrow, 0, nxv);
            }
        }
        u32 bw[GEMM_TILES][2][2];
        float d0[GEMM_TILES], d1[GEMM_TILES];
        gemm_prep_w<Q8>(wv, dw, t, bw, d0, d1);
        gemm_unit(acc[0], xv, bw, d0, d1);
#pragma unroll
        for (int mt = 1; mt < GEMM_MTILES; mt++) {
            if (mt < mtiles) {
                float mx[2][8];
                gemm_load_x(u, t, xrow, mt, mx);
                gemm_unit(acc[mt], mx, bw, d0, d1);
            }
        }
        if (nu < u1) {
            if (mtiles == 1) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        xv[h][i] = nxv[h][i];
                    }
                }
            } else {
                gemm_load_x(nu, t, xrow, 0, xv);
            }
#pragma unroll
            for (int q = 0; q < GEMM_TILES; q++) {
                wv[q] = nwv[q];
                dw[q] = ndw[q];
            }
        }
    }
    // Every weight is read: the next kernel may launch (its blocks wait for this grid).
    ds4_grid_launch();
    // The group's warps in warp order, then the slices; tile by tile.
    float* y = D.slices > 1 ? D.part + (long long)B.slice * n * n_out : D.y;
    const int ys = D.slices > 1 ? n_out : D.y_stride;
    __shared__ float red[MV_WARPS][16][8 * GEMM_TILES];
#pragma unroll
    for (int mt = 0; mt < GEMM_MTILES; mt++) {
        if (mt >= mtiles) {
            break;
        }
        if (G > 1) {
            if (mt > 0) {
                __syncthreads();  // the previous tile's sums are read
            }
#pragma unroll
            for (int q = 0; q < GEMM_TILES; q++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    red[warp][g + 8 * (i >> 1)][8 * q + 2 * t + (i & 1)] = acc[mt][q][i];
                }
            }
            __syncthreads();
            if (B.p == 0) {
#pragma unroll
                for (int q = 0; q < GEMM_TILES; q++) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        float v = acc[mt][q][i];
                        for (int p = 1; p < G; p++) {
                            v += red[warp + p][g + 8 * (i >> 1)][8 * q + 2 * t + (i & 1)];
                        }
                        acc[mt][q][i] = v;
                    }
                }
            }
        }
        if (B.p == 0) {
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
    mv_add_slices(B.D, B.rb, counters);
}

extern "C" __global__ void __launch_bounds__(128) ds4_gemm_f16(const MvDesc* __restrict__ descs, int count,
                                                               int* __restrict__ counters) {
    gemm_body<false>(descs, count, counters);
}

extern "C" __global__ void __launch_bounds__(128) ds4_gemm_q8_0(const MvDesc* __restrict__ descs, int count,
                                                                int* __restrict__ counters) {
    gemm_body<true>(descs, count, counters);
}
