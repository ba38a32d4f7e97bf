// The routed experts' IQ2_XXS gate and up products and Q2_K down products of a prompt's steps
// on the tensor cores (rust/engine/backend/cuda/decode/program.rs; the decode and verifies keep
// iq2_xxs.cu's and q2_k.cu's kernels). In a prompt's step of 128 rows an expert serves about 3
// rows; iq2_xxs.cu decodes each weight once per product and then spends four dp4a and a scale
// per 8 weights and row, so its time grows with the rows (on an H200 a 4-row product costs 1.7
// one-row ones). Here the decoded weights go into mma.sync m16n8k32 (int8 in, int32 sums): up
// to 8 rows per instruction, and the cost per row is one int32-to-float and one multiply-add
// per output and group of 32 (Q2_K: two of each, for its scales and its mins).
//
// IQ2_XXS's numbers are the decode's: per group of 32 weights and row, the exact integer sum of the
// signed lattice bytes times the row's 8-bit activations (quant/act8.rs), times db * dx in f32;
// the groups' terms are added in group order (one warp holds an output's whole row). Only the
// order of the additions differs from iq2_xxs.cu's lanes, so prompt steps are not bitwise the
// decode (which `set_prefill` allows), and a row's sums do not depend on the other rows of its
// product or step (row invariance among prompt steps).
//
// Fragments (PTX ISA, mma.m16n8k32 .s8): lane l = 4 g + t holds A (16 x 32, row major) rows g
// and g + 8 at k = 4t..4t+3 (a0, a1) and 16+4t..16+4t+3 (a2, a3), B (32 x 8, column major)
// column g at the same k (b0, b1), and C rows g, g + 8 at columns 2t, 2t + 1. A dot product is
// a sum over its k in any order, so k is permuted the same way for A and B: lane t's eight k
// are the group's physical inputs 8t..8t+7, which are exactly lattice entry t of the group (one
// byte of aux0, seven sign bits of aux1). A is the weights (outputs are rows), B the rows of x
// (each lane one row's 8 bytes, one load), so a lane decodes two outputs' 8 weights a group.

// A warp's tile: MT m16 tiles of outputs (the host's warp_rows = 16 MT) by NT n8 tiles of rows
// (the host's most rows of a descriptor, 8 NT). Each weight a warp decodes feeds NT mma, and
// each row of x it loads feeds MT. Two shapes are built (`GX_TILES` in program.rs): 2 x 4 (32
// outputs, 32 rows; the kernels without a suffix) and 2 x 2 (16 rows, `_2x2`, for A/B). Both
// give the same bits for the same output and row: a C element is an exact integer sum, and its
// scaled terms are added in group order in both. In a 1024-row step an expert serves about 24
// rows, so with 2 x 4 it decodes its weights once instead of twice: on an H200 (Flash)
// 2048-token prompts ran at 2403 tok/s against 2209 with 2 x 2 (2162 with 1 x 4, 16 outputs a
// warp). Blocks an SM of ds4_moe_mma_iq2_xxs and ds4_moe_mma_q2_k: their registers are capped
// to fit that many (2 x 4: 128 and 168; 2 x 2: 96 and 128, from 104 and 138 uncapped). That
// spills a few words (stored before the loop and loaded for the stores after it) and changes no
// arithmetic: the same float operations on the same values (their SASS has the same multiset
// of float instructions; the compiler does not reassociate them). The caps won (H200, 2 x
// 2, Flash: 2048-token prompts at 1669 tok/s against 1552), and for 2 x 2 five and four blocks
// beat six and five or four and three. A/B with DS4_CUDA_DEFINES. (Measurements:
// scripts/kernel_lab/HISTORY.md, "gemm_experts.cu: GX_MIN_BLOCKS".)
#ifndef GX_MIN_BLOCKS_IQ2
#define GX_MIN_BLOCKS_IQ2 4
#endif
#ifndef GX_MIN_BLOCKS_Q2K
#define GX_MIN_BLOCKS_Q2K 3
#endif
#ifndef GX_MIN_BLOCKS_IQ2_22
#define GX_MIN_BLOCKS_IQ2_22 5
#endif
#ifndef GX_MIN_BLOCKS_Q2K_22
#define GX_MIN_BLOCKS_Q2K_22 4
#endif

// An mma's int32 sum as a float. Every sum these kernels convert is below 2^22 in magnitude (32
// products of int8 activations, |x| <= 128, with IQ2_XXS lattice bytes <= 43 or Q2_K's q sc
// <= 45 and mins <= 15: at most 184 320), so 1.5 * 2^23 plus the sum, as an integer, is the
// float 1.5 * 2^23 + sum exactly, and a float subtraction gives the sum: the same value as
// I2F, which the CUDA guide lists at 16 results a clock an SM (a quarter of the integer adds')
// and of which the kernels issue one an output and group (Q2_K: two). With GX_I2F_MAGIC=1 (an
// experiment through DS4_CUDA_DEFINES) the mma's int32 accumulator starts at that constant
// (GX_C0), so the sum comes out with it added and one full-rate subtraction converts it. The
// same bits and loops of the same length, and no faster than I2F (H200, Flash: 2048- /
// 8192-token prompts at 2577 / 2468 tok/s against 2539 / 2490): the conversions' pipe does not
// bound these kernels. (Tried and dropped: adding the constant to each sum instead; longer
// loops.) (Measurements: scripts/kernel_lab/HISTORY.md, "gemm_experts.cu: GX_I2F_MAGIC".)
#ifndef GX_I2F_MAGIC
#define GX_I2F_MAGIC 0
#endif
#if GX_I2F_MAGIC
#define GX_C0 0x4b400000
#else
#define GX_C0 0
#endif
__device__ __forceinline__ float gx_i2f(int c) {
#if GX_I2F_MAGIC
    return __int_as_float(c) - 12582912.0f;
#else
    return (float)c;
#endif
}

// d += a * b, int8 inputs, int32 sums.
__device__ __forceinline__ void gx_mma(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
    // (Before sm_80 nothing: the host runs this kernel on sm_80 and later only.)
}

// Lattice entry t of a group (aux0, aux1) as signed bytes: coordinates 0..3 in lo, 4..7 in hi.
// A negative byte is (g ^ 0xff) + 1; g <= 43, so the + 1 never carries into the next byte.
__device__ __forceinline__ void gx_entry(u32 grid, u32 aux0, u32 aux1, int t, u32& lo, u32& hi) {
    const u32 sel = lds_u32(grid + 4u * __byte_perm(aux0, 0u, 0x4440u | (u32)t));
    const u32 g0 = __byte_perm(IQ2_GRID_BYTES, 0u, sel);
    const u32 g1 = __byte_perm(IQ2_GRID_BYTES, 0u, sel >> 16);
    const u32 i = (aux1 >> (7 * t)) & 127u;
    const u32 m0 = iq2_sign_half0(i), m1 = iq2_sign_half1(i);
    lo = (g0 ^ m0) + (m0 & 0x01010101u);
    hi = (g1 ^ m1) + (m1 & 0x01010101u);
}

// Lane (g, t)'s weight rows of the warp's outputs o0..: rows g and g + 8 of each m16 tile (A
// fragments), clamped to the last row past n_out (loaded, never stored).
template <int MT>
__device__ __forceinline__ void gx_wrows(const MvDesc& D, int o0, int g, const u8* (&wrow)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int o = min(o0 + 16 * mt + 8 * h + g, D.n_out - 1);
            wrow[mt][h] = D.w + (long long)o * D.row_bytes;
        }
    }
}

// Lane (g, t)'s view of a descriptor's rows of x (8-bit activations, each in a slot of n_in
// floats), as float offsets from D.x: row g of each n8 tile, whose 8 bytes a group it loads as
// B, and the scales of rows 2t and 2t + 1, the columns of its C. Rows past n are clamped to the
// last one: an mma's column of C depends only on the same column of B, so those columns'
// sums (never stored) cannot reach the others.
template <int NT>
struct GxRows {
    u32 xb[NT];
    u32 dx[NT][2];
};

template <int NT>
__device__ __forceinline__ GxRows<NT> gx_rows(const MvDesc& D, int g, int t) {
    GxRows<NT> X;
    const u32 slot = (u32)D.n_in;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        X.xb[nt] = (u32)min(8 * nt + g, D.n - 1) * slot;
#pragma unroll
        for (int c = 0; c < 2; c++) {
            // The scales follow the row's n_in bytes: n_in / 4 floats on.
            X.dx[nt][c] = (u32)min(8 * nt + 2 * t + c, D.n - 1) * slot + (slot >> 2);
        }
    }
    return X;
}

// Activation block u (inputs 32 u..32 u + 31) of the first LIVE n8 tiles: each tile's B
// fragment (inputs 32 u + 8 t .. + 7 of row g) and its columns' scales dx.
template <int NT, int LIVE>
__device__ __forceinline__ void gx_x(const float* x, const GxRows<NT>& X, int u, int t, uint2 (&xv)[NT],
                                     float (&dx)[NT][2]) {
#pragma unroll
    for (int nt = 0; nt < LIVE; nt++) {
        xv[nt] = *(const uint2*)((const char*)(x + X.xb[nt]) + 32 * u + 8 * t);
#pragma unroll
        for (int c = 0; c < 2; c++) {
            dx[nt][c] = x[X.dx[nt][c] + u];
        }
    }
}

// The warp's outputs o0.. (MT m16 tiles) of the descriptor's rows (NT n8 tiles) from C
// fragments: lane (g, t) holds outputs g and g + 8 of a tile at rows 2t and 2t + 1.
template <int MT, int NT>
__device__ __forceinline__ void gx_store(const MvDesc& D, int o0, int g, int t, const float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int o = o0 + 16 * mt + g + 8 * (i >> 1);
                const int r = 8 * nt + 2 * t + (i & 1);
                if (o < D.n_out && r < D.n) {
                    D.y[(long long)r * D.y_stride + o] = acc[mt][nt][i];
                }
            }
        }
    }
}

// The compile-time shape of one block's work: LIVE n8 tiles with rows, rows VEC-aligned.
template <int LIVE, bool VEC>
struct GxShape {
    static constexpr int live = LIVE;
    static constexpr bool vec = VEC;
};

// A 4-byte field of a descriptor, loaded anew at each call (not hoisted out of a loop).
__device__ __forceinline__ int gx_field(const int* p) {
    int v;
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// The live blocks of a launch over a table of ds4_route's (count descriptors): the used
// slots' blocks come first, and an unused last slot (n = 0) starts where they end
// (decode_moe.cu). The launch's grid may be smaller than the table's blocks (the host gives it
// the blocks the GPU holds at once): each block walks b = blockIdx.x, + gridDim.x, ... below
// the live count, so the unused slots' blocks (most of a prompt step's table: one slot per
// (row, expert) pair, about one in eight used) cost nothing. A block's work is the same
// whichever block does it, so the bits do not depend on the grid (DS4_CUDA_GX_GRID=0: a block
// per table block). The bound is loaded again at each step: kept in a register across the
// body, it and the loop counter pushed values of the IQ2_XXS kernel's inner loop into local
// memory (14 spill loads there, 7 like this, none in one block's single pass).
// Before, every block of a table searched for its slot, and the unused slots' blocks returned;
// the walk took a traced 512-row Flash step's IQ2_XXS kernel from 2254 to 1289 us a filled
// layer (H200). (Measurements: scripts/kernel_lab/HISTORY.md, "gemm_experts.cu: gx_live".)
__device__ __forceinline__ int gx_live(const MvDesc* __restrict__ descs, int count) {
    const MvDesc* L = descs + count - 1;
    const int bs = gx_field(&L->block_start);
    if (gx_field(&L->n) == 0) {
        return bs;
    }
    const int rows = MV_WARPS / gx_field(&L->group) * gx_field(&L->warp_rows);
    return bs + (gx_field(&L->n_out) + rows - 1) / rows * gx_field(&L->slices);
}

// Walks a launch's live blocks (gx_live) and does each one's work: w(D, o0, GxShape<LIVE,
// VEC>()) for the warp's outputs o0.. of descriptor D, on a kernel of NT n8 tiles. VEC when D's
// weight rows are aligned to `align` bytes, and then LIVE its tiles with rows (n is uniform
// over the block); else every tile (rows past n are clamped, so their tiles are only wasted
// work).
template <int NT, class W>
__device__ __forceinline__ void gx_walk(const MvDesc* __restrict__ descs, int count, unsigned long long align,
                                        const W& w) {
    static_assert(NT == 2 || NT == 4, "gx_walk: the built tiles' 2 or 4 n8 tiles");
    for (int b = blockIdx.x; b < gx_live(descs, count); b += gridDim.x) {
        const MvBlock B = mv_block_at(descs, count, b);
        const MvDesc& D = *B.D;
        if (D.n == 0 || B.nrows <= 0) {
            continue;  // an unused expert slot, or rows past n_out
        }
        const int live = (D.n + 7) >> 3;
        if ((((unsigned long long)D.w | (unsigned long long)D.row_bytes) & (align - 1)) != 0) {
            w(D, B.o0, GxShape<NT, false>());
        } else if (live >= NT) {
            w(D, B.o0, GxShape<NT, true>());
        } else if (live == 1) {
            w(D, B.o0, GxShape<1, true>());
        } else if constexpr (NT == 4) {
            if (live == 2) {
                w(D, B.o0, GxShape<2, true>());
            } else {
                w(D, B.o0, GxShape<3, true>());
            }
        }
    }
}

// The gate and up products of a step's routed experts (MvDesc tables written by ds4_route:
// warp_rows 16 MT, group 1, slices 1; x the gathered rows as 8-bit activations, n <= 8 NT).
// Block 128 (four warps of 16 MT outputs each); n_in a multiple of 256. Rows of an odd number
// of super-blocks (66 bytes each) are only 2-byte aligned: their groups are read in 2-byte
// pieces.
// (Tried and dropped: this kernel's and ds4_moe_mma_q2_k's start as one shared function, and
// both kernels loading their next step's weights while computing this one; the same results,
// slower.) (Measurements: scripts/kernel_lab/HISTORY.md, "gemm_experts.cu: ds4_moe_mma_iq2_xxs".)
// One block's work of ds4_moe_mma_iq2_xxs: the warp's outputs o0.. of descriptor D over its
// first LIVE n8 tiles of rows (the others hold no rows), its weight rows 16-byte aligned (VEC)
// or only 2-byte aligned (read in 2-byte pieces). LIVE and VEC as template arguments keep the
// loop free of run-time tests: a test there costs every pass its untaken side's instructions
// (predicated loads) or a branch and a warp barrier before each mma.sync (sass_loops.py).
template <int MT, int NT, int LIVE, bool VEC>
__device__ __forceinline__ void gx_iq2_tile(const MvDesc& D, int o0, u32 grid) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int nb = D.n_in >> 8;
    const u8* wrow[MT][2];
    gx_wrows<MT>(D, o0, g, wrow);
    const GxRows<NT> X = gx_rows<NT>(D, g, t);
    float acc[MT][NT][4] = {};
    for (int sb = 0; sb < nb; sb++) {
        float d[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                d[mt][h] = f16_bits_to_f32(*(const u16*)(wrow[mt][h] + 64ll * nb + 2 * sb));
            }
        }
        // Two groups a step: each row's 16 bytes at once.
#pragma unroll 2
        for (int jj = 0; jj < 8; jj += 2) {
            uint4 wv[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const u8* p = wrow[mt][h] + 64ll * sb + 8 * jj;
                    if (VEC) {
                        wv[mt][h] = *(const uint4*)p;
                    } else {
                        const u16* q = (const u16*)p;
                        wv[mt][h] = make_uint4((u32)q[0] | ((u32)q[1] << 16), (u32)q[2] | ((u32)q[3] << 16),
                                               (u32)q[4] | ((u32)q[5] << 16), (u32)q[6] | ((u32)q[7] << 16));
                    }
                }
            }
#pragma unroll
            for (int s = 0; s < 2; s++) {
                const int u = 8 * sb + jj + s;  // the group of 32 (the activation block)
                uint2 xv[NT];
                float dx[NT][2];
                gx_x<NT, LIVE>(D.x, X, u, t, xv, dx);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    u32 a[2][2];  // [h][lo/hi]
                    float db[2];
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const u32 aux0 = s ? wv[mt][h].z : wv[mt][h].x;
                        const u32 aux1 = s ? wv[mt][h].w : wv[mt][h].y;
                        gx_entry(grid, aux0, aux1, t, a[h][0], a[h][1]);
                        db[h] = d[mt][h] * (0.5f + u8f(aux1 >> 28)) * 0.25f;
                    }
#pragma unroll
                    for (int nt = 0; nt < LIVE; nt++) {
                        int c[4] = {GX_C0, GX_C0, GX_C0, GX_C0};
                        gx_mma(c, a[0][0], a[1][0], a[0][1], a[1][1], xv[nt].x, xv[nt].y);
                        acc[mt][nt][0] = fmaf(db[0] * dx[nt][0], gx_i2f(c[0]), acc[mt][nt][0]);
                        acc[mt][nt][1] = fmaf(db[0] * dx[nt][1], gx_i2f(c[1]), acc[mt][nt][1]);
                        acc[mt][nt][2] = fmaf(db[1] * dx[nt][0], gx_i2f(c[2]), acc[mt][nt][2]);
                        acc[mt][nt][3] = fmaf(db[1] * dx[nt][1], gx_i2f(c[3]), acc[mt][nt][3]);
                    }
                }
            }
        }
    }
    gx_store<MT, NT>(D, o0, g, t, acc);
}

// gx_iq2_tile as gx_walk's work (NVRTC takes no device lambdas).
template <int MT, int NT>
struct GxIq2Work {
    u32 grid;
    template <class S>
    __device__ __forceinline__ void operator()(const MvDesc& D, int o0, S) const {
        gx_iq2_tile<MT, NT, S::live, S::vec>(D, o0, grid);
    }
};

template <int MT, int NT>
__device__ __forceinline__ void gx_iq2_xxs(const MvDesc* __restrict__ descs, int count) {
    __shared__ u32 lut[256];
    FmtIQ2_XXS::init_lut((u8*)lut, threadIdx.x);
    // The tables are ds4_route's, written by the kernel before.
    ds4_grid_deps();
    __syncthreads();
    gx_walk<NT>(descs, count, 16, GxIq2Work<MT, NT>{(u32)__cvta_generic_to_shared(lut)});
    ds4_grid_launch();
}

extern "C" __global__ void __launch_bounds__(128, GX_MIN_BLOCKS_IQ2)
    ds4_moe_mma_iq2_xxs(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters) {
    gx_iq2_xxs<2, 4>(descs, count);
}

extern "C" __global__ void __launch_bounds__(128, GX_MIN_BLOCKS_IQ2_22)
    ds4_moe_mma_iq2_xxs_2x2(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters) {
    gx_iq2_xxs<2, 2>(descs, count);
}

// The down products of a step's routed experts, Q2_K (q2_k.cu's split rows: the quants qs of
// all super-blocks, then 20 header bytes each, scale byte 8 h + 4 f + s for half h, shift s,
// sub-block f, then d and dmin), on the same tiles as ds4_moe_mma_iq2_xxs. An activation block
// of 32 inputs is half h and shift s of a super-block: inputs 128 h + 32 s + l with quants
// (qs[32 h + l] >> 2 s) & 3, l < 16 in sub-block 0 and the rest in sub-block 1. The k
// permutation: lane t's eight k are inputs l = 8 t..8 t + 7 (sub-block t / 2; one 8-byte load
// of qs a half). Per block and row, two exact int32 sums: S = sum of q * sc * x8 (the 4-bit
// scale sc folded into the weight bytes: q * sc <= 45, so a 32-bit multiply scales four bytes
// without carries) and M = sum of m * x8 (the 4-bit min m, a second mma on the same B), then
// acc += dx * (d * S - dmin * M) in f32 (d * S fused with the subtraction: one rounding fewer,
// one instruction fewer an output). The decode's kernel adds dx * (d sc sq - dmin m sx)
// per sub-block: the same sums, other float roundings (within about 1e-6 of the exact dot, as
// tests_gemm checks), and as in ds4_moe_mma_iq2_xxs a row's sums do not depend on the other
// rows. Block 128; n_in a multiple of 256; rows 4-byte aligned (84 bytes a super-block; with
// 8-byte alignment the quants are read 8 bytes at a time).
//
// gx_q2_k_tile is one block's work, as gx_iq2_tile's (VEC: rows 8-byte aligned, else 4).
template <int MT, int NT, int LIVE, bool VEC>
__device__ __forceinline__ void gx_q2_k_tile(const MvDesc& D, int o0) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int nb = D.n_in >> 8;
    const long long pay = 64ll * nb;
    const u8* wrow[MT][2];
    gx_wrows<MT>(D, o0, g, wrow);
    const GxRows<NT> X = gx_rows<NT>(D, g, t);
    float acc[MT][NT][4] = {};
    for (int sb = 0; sb < nb; sb++) {
        // Per output row ([mt][row g or g + 8]): the lane's 8 quant bytes of each half, the
        // scale bytes of its sub-block in each half (shift s in byte s), d and dmin.
        uint2 qv[MT][2][2];
        u32 scw[MT][2][2];
        float dd[MT][2][2];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const u8* row = wrow[mt][h];
                const u8* hd = row + pay + 20ll * sb;
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    const u8* q = row + 64ll * sb + 32 * half + 8 * t;
                    qv[mt][h][half] = VEC ? *(const uint2*)q : make_uint2(ld_u32_a4(q), ld_u32_a4(q + 4));
                    scw[mt][h][half] = ld_u32_a4(hd + 8 * half + 4 * (t >> 1));
                }
                const u32 w = ld_u32_a4(hd + 16);
                dd[mt][h][0] = f16_bits_to_f32(w & 0xffffu);
                dd[mt][h][1] = f16_bits_to_f32(w >> 16);
            }
        }
#pragma unroll
        for (int half = 0; half < 2; half++) {
#pragma unroll
            for (int s = 0; s < 4; s++) {
                uint2 xv[NT];
                float dx[NT][2];
                gx_x<NT, LIVE>(D.x, X, 8 * sb + 4 * half + s, t, xv, dx);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    u32 lo[2], hi[2], mn[2];
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const u32 b = (scw[mt][h][half] >> (8 * s)) & 0xffu;
                        const u32 sc = b & 15u;
                        lo[h] = ((qv[mt][h][half].x >> (2 * s)) & 0x03030303u) * sc;
                        hi[h] = ((qv[mt][h][half].y >> (2 * s)) & 0x03030303u) * sc;
                        mn[h] = (b >> 4) * 0x01010101u;
                    }
#pragma unroll
                    for (int nt = 0; nt < LIVE; nt++) {
                        int c[4] = {GX_C0, GX_C0, GX_C0, GX_C0};
                        int e[4] = {GX_C0, GX_C0, GX_C0, GX_C0};
                        gx_mma(c, lo[0], lo[1], hi[0], hi[1], xv[nt].x, xv[nt].y);
                        gx_mma(e, mn[0], mn[1], mn[0], mn[1], xv[nt].x, xv[nt].y);
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            const float v = fmaf(dd[mt][i >> 1][0], gx_i2f(c[i]), -(dd[mt][i >> 1][1] * gx_i2f(e[i])));
                            acc[mt][nt][i] = fmaf(dx[nt][i & 1], v, acc[mt][nt][i]);
                        }
                    }
                }
            }
        }
    }
    gx_store<MT, NT>(D, o0, g, t, acc);
}

// gx_q2_k_tile as gx_walk's work.
template <int MT, int NT>
struct GxQ2kWork {
    template <class S>
    __device__ __forceinline__ void operator()(const MvDesc& D, int o0, S) const {
        gx_q2_k_tile<MT, NT, S::live, S::vec>(D, o0);
    }
};

template <int MT, int NT>
__device__ __forceinline__ void gx_q2_k(const MvDesc* __restrict__ descs, int count) {
    // The tables are ds4_route's and x is ds4_swiglu's, written by kernels before.
    ds4_grid_deps();
    gx_walk<NT>(descs, count, 8, GxQ2kWork<MT, NT>{});
    ds4_grid_launch();
}

extern "C" __global__ void __launch_bounds__(128, GX_MIN_BLOCKS_Q2K)
    ds4_moe_mma_q2_k(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters) {
    gx_q2_k<2, 4>(descs, count);
}

extern "C" __global__ void __launch_bounds__(128, GX_MIN_BLOCKS_Q2K_22)
    ds4_moe_mma_q2_k_2x2(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters) {
    gx_q2_k<2, 2>(descs, count);
}
