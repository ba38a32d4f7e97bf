// Q8_0: blocks of 32 weights, 34 bytes in GGUF: an f16 scale d, then 32 signed bytes q;
// w = q * d (rust/engine/quant/q8_0.rs). Two kernels; which one multiplies a matrix depends
// only on its shape (rust/engine/backend/cuda/context.rs `tensor_cores`), never on the batch,
// so each row is computed the same way in every batch (row invariance) either way. By
// default the tensor-core kernel takes rows of at most 1024 elements (Flash's q_b, 32768 x
// 1024: as fast as the float-x kernel at one batch row, three times faster at eight), rows of
// at least 8192 (o_b, 4096 x 8192: as fast at one row, 2.8 times faster at eight; figures at
// Q8_MMA_MIN_IN in context.rs) and matrices of at least 65536 rows (the head, 129280 x 4096:
// faster at one row with its x staged, MQ_X_STAGED below, and 3.6 times faster at eight), the
// float-x kernel the rest. Adding rows of 2048 (the shared expert's down) made Flash's steps
// slower. The bound is set for Flash: the MID shape's rows are nearly all 1024 long, so there
// the default is close to DS4_CUDA_Q8=mma. (Measurements: scripts/kernel_lab/HISTORY.md,
// "q8_0.cu: kernel choice".)
//
// ---- The float-x kernel: matvec_split (common.cuh). On the device rows are
// split (rust/engine/quant/split/): the 32-byte quant runs of all blocks, then the 2-byte
// scales. Lane l's 16 bytes of chunk c are half (l & 1) of block 16 c + l / 2: elements
// 32 k + 16 (l & 1) + 0..15. Per 4 elements: sum q * x in an fmaf chain, then acc += d * sum.

struct FmtQ8_0 {
    static constexpr int BLOCK_ELEMS = 32;
    static constexpr int PAY = 32;
    static constexpr int CB = 16;
    static constexpr int PREFETCH = 1;
    MV_NO_LUT

    typedef ScaleChunk Chunk;

    static __device__ __forceinline__ void load(const u8* row, int nb, int c, int lane, bool vec, Chunk& h) {
        ld_scale_chunk<PAY>(row, nb, c, lane, vec, h);
    }

    template <int NB>
    static __device__ __forceinline__ void dot(const Chunk (&h)[MV_ROWS], int nb, int c, int lane,
                                               const float* __restrict__ x, int n_in, int n,
                                               float (&acc)[MV_ROWS][NB], const u8*) {
        if (!mv_lane_in((long long)nb * PAY, c, lane)) {
            return;
        }
        const int e0 = 32 * (CB * c + (lane >> 1)) + 16 * (lane & 1);
        float d[MV_ROWS];
#pragma unroll
        for (int q = 0; q < MV_ROWS; q++) {
            d[q] = f16_bits_to_f32(h[q].d);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float wf[MV_ROWS][4];
#pragma unroll
            for (int q = 0; q < MV_ROWS; q++) {
                const u32 word = word_of(h[q].v, j) ^ 0x80808080u;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    wf[q][i] = sbyte_f(word, i);
                }
            }
            scaled_dot4<NB>(wf, d, x, n_in, n, e0 + 4 * j, acc);
        }
    }
};

// Resident blocks a SM of the one-row kernel (MvMinBlocks); a -D option may override it for
// A/B timing (DS4_CUDA_DEFINES, rust/engine/backend/cuda/context.rs). More blocks made some
// products faster in the lab but Flash's steps slower in the engine (H200, at 2100 tokens: six
// (80 registers) 9.18 ms against 9.10; five, with q_b on the tensor cores, 8.92 against 8.81).
// (Measurements: scripts/kernel_lab/HISTORY.md, "q8_0.cu: MV_MIN_BLOCKS_Q8_0_1".)
#ifndef MV_MIN_BLOCKS_Q8_0_1
#define MV_MIN_BLOCKS_Q8_0_1 MV_MIN_BLOCKS
#endif
template <>
struct MvMinBlocks<FmtQ8_0, 1> {
    static constexpr int value = MV_MIN_BLOCKS_Q8_0_1;
};

MVS_KERNELS(q8_0, FmtQ8_0)

// ---- The tensor-core kernel (short rows by default; all Q8_0 matrices with DS4_CUDA_Q8=mma)
//
// Q8_0 products on the tensor cores in exact integer arithmetic, one kernel for every
// batch size (mma.sync m16n8k32 on 8-bit integers, 32-bit sums: sm_80 and later; older
// devices compute the same integers from shuffled fragments, so the same bits).
// - A: 16 weight rows x one block: the quant bytes as they are.
// - B: one block of 8 batch rows (the columns). Each batch row's block of x is written as
//   the integers N = round(x * 2^s), where the power of two 2^s puts the block's largest |x|
//   in [2^22, 2^23): 24 bits with the sign, what a float carries, at the block's largest
//   element. N is split in its bytes: N = n0 + 256 n1 + 65536 n2 (n0, n1 unsigned, n2 signed),
//   three B operands and three products per tile.
// - The three block dots are exact 32-bit integers; D0 + 256 D1 is exact too, and
//   d * 2^-s * (D0 + 256 D1 + 65536 D2) is added to the output's float sum, block after block.
// Each output's sum therefore uses only its own weight row and its own batch row's x, in an
// order fixed by the shape: a row computed inside a batch of 16 is bitwise the row computed
// alone (row invariance), and the x rounding (below 2^-23 of each block's largest |x|) stays
// at f32's level, so the products agree with the CPU's float ones to rounding.
//
// Why: the float-x kernel multiplies each weight once per batch row, and its time grows with
// the batch (H200, o_b 4096 x 8192: 16.2 us at one row, 62.1 at eight); here a tile's three
// products cover 8 batch rows. (The tf32 route, common.cuh notes, needed the quant bytes
// converted to floats and x in two tf32 parts; 8-bit integers need neither.)
//
// At one batch row the kernel paid for the per-block x quantization (about a third of the
// loop's instructions) and the scaling of four outputs a lane of which one is used: it issued
// every other cycle and waited on its loads (Nsight Compute, the head). At eight rows it is
// faster (H200 lab, q_b 32768 x 1024: 21.0 us against 62.4 with the float-x kernel); at one
// row the head is as fast (faster with its x staged, below), but q_a, o_b and the shared
// expert are slower whatever the warp group and input slices (q_a 1024 x 4096: 8.25 against
// 6.67 us). Hence the choice by shape (above). (Tried and dropped: deeper prefetch through
// cp.async rings of 3, 4 or 6 chunks; slower.) (Measurements: scripts/kernel_lab/HISTORY.md,
// "q8_0.cu: tensor-core kernel".)
//
// Layout on the device (rust/engine/quant/split/q8_0.rs): each whole 16-row tile of a plane (a
// 2-D tensor, or one expert of a 3-D one) as one run, block k's 512 quant bytes at 512 k in
// the order of the A operand (lane l's 16 bytes at 512 k + 16 l), then per block the 32 bytes
// of scales (rows g and g + 8 at 32 k + 4 g); a plane's last rows (past its last whole tile)
// row by row: the quant bytes of blocks 2j and 2j + 1 as one 64-byte pair at 64 j (lane t's 16
// bytes at 64 j + 16 t: block 2j's bytes 4t..4t+3 and 16+4t..19+4t, then block 2j+1's same; a
// last odd block 8 bytes a lane at 64 j + 8 t), then the row's scales.
//
// Work split: a warp holds MQ_TILES 16-row tiles (MQ_WARP_ROWS rows, the descriptor's
// warp_rows) and walks the row in *chunks*, one block pair each; as in matvec_split, the
// D->group warps of a row group take chunks p, p + G, ..., their sums added in warp order,
// and the host may split the chunks in slices over blocks (mv_slice, mv_add_slices). Each
// warp quantizes x itself, for each block, once for its tiles; at one batch row all 32 lanes
// share that work (mq_quantize_coop: two elements a lane instead of sixteen for the four lanes
// of the row's column; 279 instructions in the sm_90 loop of a chunk against 386, 110
// registers against 128; not yet timed on a GPU). A warp whose tiles are all
// whole runs the fast path (mq_loop<.., true, ..>); the few with a plane's last rows run a
// general one.

#ifndef MQ_TILES
#define MQ_TILES 2
#endif
// Whether a warp with one token group and whole tiles only loads its x with the weights of
// the chunk (1) or as it computes the chunk (0).
#ifndef MQ_X_PREFETCH
#define MQ_X_PREFETCH 1
#endif
// Whether a warp of one batch row quantizes its x together, each lane two elements of the
// chunk (1), or each lane of the row's column the 16 elements of its B fragments (0).
#ifndef MQ_X_COOP
#define MQ_X_COOP 1
#endif
// Whether a block of one batch row first quantizes the x of its slice into shared memory, once
// for its warps (1: mq_stage_x), when the slice is at most MQ_XS_CHUNKS chunks and each warp
// of a row group walks at least MQ_XS_MIN_CHUNKS of them, or else each warp quantizes the x
// of its chunks as it goes (0: MQ_X_COOP's way). The same integers and scales either way, so
// the same bits. The block's barrier and its quantization of the whole slice pay only where
// each warp would quantize many chunks itself (H200 lab, one batch row: the head, 64 chunks a
// warp, 160.7 us against 169.9; q_a 1024 x 4096, 2 chunks a warp, 8.64 against 7.84).
// (Measurements: scripts/kernel_lab/HISTORY.md, "q8_0.cu: MQ_X_STAGED".)
#ifndef MQ_X_STAGED
#define MQ_X_STAGED 1
#endif
#ifndef MQ_XS_MIN_CHUNKS
#define MQ_XS_MIN_CHUNKS 16
#endif
// Chunks (block pairs) of x the staged one-row kernel holds: 4096 elements, 256 bytes a chunk
// (16 KB of shared memory a block).
#define MQ_XS_CHUNKS 64
#define MQ_WARP_ROWS (16 * MQ_TILES)

// How a warp of whole tiles gets its x (the MqChunk and mq_load template argument XM):
// loaded as a chunk is computed (0), loaded with the chunk's weights by the lanes of each
// batch row's column (1), or, for one batch row, loaded with the weights by all 32 lanes, two
// elements each (2: mq_quantize_coop), or, for one batch row, read as B operands from the
// block's shared memory, where mq_stage_x wrote them (3).
#define MQ_X_LATE 0
#define MQ_X_LANES 1
#define MQ_X_SPREAD 2
#define MQ_X_STAGE 3

// The format tag of the kernel's instantiations (MV_KERNEL_RUN takes one; no lookup table:
// its shared memory holds only a one-row x, MQ_X_STAGED).
struct FmtQ8_0Mq {};

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 800
// c + the dot of the signed bytes of a and the bytes of b (unsigned when U).
template <bool U>
__device__ __forceinline__ int mq_dp4a(u32 a, u32 b, int c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
    int d;
    if (U) {
        asm("dp4a.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    } else {
        asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    }
    return d;
#else
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int ai = (int)(signed char)(a >> (8 * i));
        const int bi = U ? (int)((b >> (8 * i)) & 0xffu) : (int)(signed char)(b >> (8 * i));
        c += ai * bi;
    }
    return c;
#endif
}
#endif

// d = a (16 x 32, s8) * b (32 x 8, u8 or s8, by U), the m16n8k32 integer product.
template <bool U>
__device__ __forceinline__ void mq_mma(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const int z = 0;
    if (U) {
        asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%10,%10,%10,%10};"
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(z));
    } else {
        asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%10,%10,%10,%10};"
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(z));
    }
#else
    // The same integers from the fragments of the four lanes of each row and column group.
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        d[i] = 0;
    }
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int ra = 4 * g + q;
        const u32 a0 = __shfl_sync(0xffffffffu, a[0], ra), a1 = __shfl_sync(0xffffffffu, a[1], ra);
        const u32 a2 = __shfl_sync(0xffffffffu, a[2], ra), a3 = __shfl_sync(0xffffffffu, a[3], ra);
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int rb = 4 * (2 * t + j) + q;
            const u32 c0 = __shfl_sync(0xffffffffu, b0, rb), c1 = __shfl_sync(0xffffffffu, b1, rb);
            d[j] = mq_dp4a<U>(a2, c1, mq_dp4a<U>(a0, c0, d[j]));
            d[2 + j] = mq_dp4a<U>(a3, c1, mq_dp4a<U>(a1, c0, d[2 + j]));
        }
    }
#endif
}

__device__ __forceinline__ u32 umax(u32 a, u32 b) {
    return a > b ? a : b;
}

// The B operands of one block of x for this lane's batch row r = 8 tg + g (zeros when r >= n)
// and 2^-s, the block's scale (NaN when the block holds an infinity or a NaN, so that the
// outputs are not finite either). xa, xb: the row's elements 4t..4t+3 and 16+4t..19+4t.
__device__ __forceinline__ float mq_quantize(float4 xa, float4 xb, u32 (&b)[3][2]) {
    const float v[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    // The largest |x| as bits: unsigned order is float order for |x|, and a NaN wins (fmaxf
    // would drop it).
    u32 m = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        m = umax(m, __float_as_uint(v[i]) & 0x7fffffffu);
    }
    m = umax(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = umax(m, __shfl_xor_sync(0xffffffffu, m, 2));
    // |x| in [2^(E-127), 2^(E-126)): 2^s = 2^(149-E) puts it in [2^22, 2^23). Blocks below
    // 2^-104 keep fewer bits (s is capped at 126; zero blocks give zeros).
    const int eb = (int)(m >> 23);
    const int e = eb < 23 ? 23 : eb;
    const float mul = __uint_as_float((u32)(276 - e) << 23);
    const float inv = e == 255 ? __uint_as_float(0x7fc00000u) : __uint_as_float((u32)(e - 22) << 23);
    // N = round(x 2^s) (to nearest even), |N| < 2^23: its bytes n0 and n1 (unsigned) and n2
    // (signed). (The float adder's rounding trick, x 2^s + 1.5 * 2^23, would save the
    // conversions but holds only 22 bits: the error of a block's small elements doubles.)
    int q[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        // |x| 2^s < 2^23 exactly, but rounds up to 2^23 from 2^23 - 1/2: keep n2 a signed byte.
        q[i] = imin(__float2int_rn(v[i] * mul), 8388607);
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const u32 lo01 = __byte_perm((u32)q[4 * h], (u32)q[4 * h + 1], 0x5140);
        const u32 lo23 = __byte_perm((u32)q[4 * h + 2], (u32)q[4 * h + 3], 0x5140);
        b[0][h] = __byte_perm(lo01, lo23, 0x5410);
        b[1][h] = __byte_perm(lo01, lo23, 0x7632);
        b[2][h] = __byte_perm(__byte_perm((u32)q[4 * h], (u32)q[4 * h + 1], 0x0062),
                              __byte_perm((u32)q[4 * h + 2], (u32)q[4 * h + 3], 0x0062), 0x5410);
    }
    return inv;
}

// The B operands and scales of the chunk's two blocks (b[kk], sx[kk]) for one batch row, from
// the row's x spread over the warp: lane l holds elements 2 (l & 15) and 2 (l & 15) + 1 of
// block l / 16 (zeros past the row's last block). The same integers and scales as
// mq_quantize (row invariance), computed by all 32 lanes instead of the 4 of the row's
// column: the 16 lanes of a block find its largest |x| in four steps, each lane converts two
// elements, adjacent lanes join their bytes to the four-byte runs of the fragments, and each
// lane takes the runs of its fragment positions. Every column of B gets row 0's values; only
// column 0's outputs are stored.
__device__ __forceinline__ void mq_quantize_coop(float2 xv, int lane, u32 (&b)[2][3][2], float (&sx)[2]) {
    u32 m = umax(__float_as_uint(xv.x) & 0x7fffffffu, __float_as_uint(xv.y) & 0x7fffffffu);
#pragma unroll
    for (int o = 1; o < 16; o *= 2) {
        m = umax(m, __shfl_xor_sync(0xffffffffu, m, o));
    }
    // As in mq_quantize.
    const int eb = (int)(m >> 23);
    const int e = eb < 23 ? 23 : eb;
    const float mul = __uint_as_float((u32)(276 - e) << 23);
    const float inv = e == 255 ? __uint_as_float(0x7fc00000u) : __uint_as_float((u32)(e - 22) << 23);
    const u32 q0 = (u32)imin(__float2int_rn(xv.x * mul), 8388607);
    const u32 q1 = (u32)imin(__float2int_rn(xv.y * mul), 8388607);
    // This lane's two elements: bytes 0 and 1 (n0, n1) in one word, byte 2 (n2) in another;
    // with the odd neighbour's, the even lane 2j of a half holds elements 4j..4j+3 per byte.
    const u32 p01 = __byte_perm(q0, q1, 0x5140);
    const u32 p2 = __byte_perm(q0, q1, 0x0062);
    const u32 o01 = __shfl_xor_sync(0xffffffffu, p01, 1);
    const u32 o2 = __shfl_xor_sync(0xffffffffu, p2, 1);
    const u32 run[3] = {__byte_perm(p01, o01, 0x5410), __byte_perm(p01, o01, 0x7632), __byte_perm(p2, o2, 0x5410)};
    // Fragment lane (g, t) takes elements 4t..4t+3 (even lane 2t) and 16+4t..19+4t (lane 8 + 2t).
    const int t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
#pragma unroll
        for (int p = 0; p < 3; p++) {
            b[kk][p][0] = __shfl_sync(0xffffffffu, run[p], 16 * kk + 2 * t);
            b[kk][p][1] = __shfl_sync(0xffffffffu, run[p], 16 * kk + 8 + 2 * t);
        }
        sx[kk] = __shfl_sync(0xffffffffu, inv, 16 * kk);
    }
}

// The B operands and scales of one batch row's x, chunks [c0, c1) of the row (c1 - c0 <=
// MQ_XS_CHUNKS), into the block's shared memory S, for mq_chunk's MQ_X_STAGE: the warps of the
// block take chunks c0 + warp, c0 + warp + MV_WARPS, ..., each with mq_quantize_coop (so the
// same integers and scales as every other way of getting them), and lanes t = 0..3 store what
// fragment column t needs: per chunk, block kk, lane t, two uint4 at S[8 (2 (c - c0) + kk) + 2 t]:
// {part 0 (h 0, 1), part 1 (h 0, 1)}, {part 2 (h 0, 1), the block's 2^-s, 0}. Why: at one batch
// row the x of a chunk was quantized by every warp that reads the chunk (a third of the loop's
// instructions), and a warp's first loads had to wait for the previous kernel (they carried x);
// staged, a block quantizes each chunk once and its weight loads can start before the wait.
// Every thread of the block calls it (it ends with a barrier).
__device__ __forceinline__ void mq_stage_x(const float* __restrict__ x, int nb, int c0, int c1, uint4* S) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    for (int c = c0 + warp; c < c1; c += MV_WARPS) {
        const bool two = 2 * c + 1 < nb;
        float2 xs = make_float2(0.0f, 0.0f);
        if (lane < 16 || two) {
            xs = __ldg((const float2*)(x + 64ll * c + 2 * lane));
        }
        u32 b[2][3][2];
        float sx[2];
        mq_quantize_coop(xs, lane, b, sx);
        if (lane < 4) {
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                uint4* q = S + 8 * (2 * (c - c0) + kk) + 2 * lane;
                q[0] = make_uint4(b[kk][0][0], b[kk][0][1], b[kk][1][0], b[kk][1][1]);
                q[1] = make_uint4(b[kk][2][0], b[kk][2][1], __float_as_uint(sx[kk]), 0u);
            }
        }
    }
    __syncthreads();
}

// A warp's weights in one chunk (block pair): per tile, for a tile stored whole
// (rust/engine/quant/split/q8_0.rs) the lane's A registers of each block (v[mt][kk]) and its
// rows' scales (s[mt][kk]: rows g, g + 8); for a plane's last rows, row by row, per row g and
// g + 8 (h) the lane's 16 bytes of the pair (8 for a last odd block, in .x, .y) and the two
// blocks' scales. With XM (MQ_X_LANES, MQ_X_SPREAD), the lane's x of the chunk too (loaded
// with the weights, so that it waits on nothing).
template <int XM>
struct MqChunk {
    uint4 v[MQ_TILES][2];
    u32 s[MQ_TILES][2];
    float4 x[XM == MQ_X_LANES ? 2 : 1][2];
    float2 xs;  // MQ_X_SPREAD
};

// The rows of tile mt: a tile stored whole (the first n_out & ~15 rows), or row by row.
struct MqRows {
    const u8* p[MQ_TILES][2];  // tile start, or rows g and g + 8
    bool tiled[MQ_TILES];
    bool vec_tile;  // tile starts 16-byte aligned (else 2-byte loads)
    bool vec_row;   // rows 16-byte aligned
};

// ALL: every tile of the warp is stored whole and 16-byte aligned (the fast path: no row-by-row
// code and no 2-byte loads at all). With the unaligned tiles' 2-byte loads behind a run-time
// test in the fast path too, the one-row loops issued them predicated off (73 of the staged
// loop's 229 SASS instructions a chunk); without them, Flash's steps are faster on an H200:
// 8.04 ms against 8.22, the same bits. MQ_FAST_VEC=0, a DS4_CUDA_DEFINES variant, gives the
// old code back. (Measurements: scripts/kernel_lab/HISTORY.md, "q8_0.cu: MQ_FAST_VEC".)
#ifndef MQ_FAST_VEC
#define MQ_FAST_VEC 1
#endif
template <bool ALL, int XM>
__device__ __forceinline__ void mq_load(const MqRows& R, long long pay, int nb, int c, int lane,
                                        const float* __restrict__ x, int n_in, int n, MqChunk<XM>& k) {
    const bool two = 2 * c + 1 < nb;
    const int t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MQ_TILES; mt++) {
        if (ALL || R.tiled[mt]) {
            const u8* tb = R.p[mt][0];
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                if (kk == 0 || two) {
                    const u8* q = tb + 512ll * (2 * c + kk) + 16 * lane;
                    const u8* sp = tb + 512ll * nb + 32 * (2 * c + kk) + 4 * (lane >> 2);
                    const bool vec = (ALL && MQ_FAST_VEC) || R.vec_tile;
                    k.v[mt][kk] = vec ? __ldg((const uint4*)q) : ld16_a2(q);
                    k.s[mt][kk] = vec ? __ldg((const u32*)sp) : ld_u32_a2(sp);
                }
            }
        } else {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const u8* p = R.p[mt][h] + 64ll * c;
                const u8* sp = R.p[mt][h] + pay + 4ll * c;
                const bool vec = R.vec_row;
                if (two) {
                    k.v[mt][h] = vec ? __ldg((const uint4*)(p + 16 * t)) : ld16_a2(p + 16 * t);
                    k.s[mt][h] = vec ? __ldg((const u32*)sp) : ld_u32_a2(sp);
                } else {
                    k.v[mt][h].x = vec ? __ldg((const u32*)(p + 8 * t)) : ld_u32_a2(p + 8 * t);
                    k.v[mt][h].y = vec ? __ldg((const u32*)(p + 8 * t + 4)) : ld_u32_a2(p + 8 * t + 4);
                    k.v[mt][h].z = 0;
                    k.v[mt][h].w = 0;
                    k.s[mt][h] = ld_u16(sp);
                }
            }
        }
    }
    if (XM == MQ_X_SPREAD) {
        // Row 0's elements 64 c + 2 lane and the next (block 2c + lane / 16).
        k.xs = make_float2(0.0f, 0.0f);
        if (lane < 16 || two) {
            k.xs = __ldg((const float2*)(x + 64ll * c + 2 * lane));
        }
    }
    if (XM == MQ_X_LANES) {
        const int r = lane >> 2;
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            k.x[kk][0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            k.x[kk][1] = k.x[kk][0];
            if (r < n && (kk == 0 || two)) {
                const float* xr = x + (long long)r * n_in + 32 * (2 * c + kk) + 4 * t;
                k.x[kk][0] = __ldg((const float4*)xr);
                k.x[kk][1] = __ldg((const float4*)(xr + 16));
            }
        }
    }
}

// Adds chunk c (blocks 2c and 2c + 1) of the warp's rows to acc[tile][token group][i]: the
// output of row 16 tile + g + 8 (i / 2) and batch row 8 group + 2t + i % 2.
// With MQ_X_STAGE, xq is the chunk's staged x (mq_stage_x).
template <int NB, bool ALL, int XM>
__device__ __forceinline__ void mq_chunk(const MqChunk<XM>& k, const MqRows& R, int nb, int c,
                                         const float* __restrict__ x, int n_in, int n, int lane,
                                         float (&acc)[MQ_TILES][(NB + 7) / 8][4], const uint4* xq = nullptr) {
    constexpr int NG = (NB + 7) / 8;
    const int g = lane >> 2;
    const int t = lane & 3;
    u32 bs[2][3][2];
    float ss[2];
    if (XM == MQ_X_SPREAD) {
        mq_quantize_coop(k.xs, lane, bs, ss);
    }
    if (XM == MQ_X_STAGE) {
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            const uint4 u = xq[8 * kk + 2 * t];
            const uint4 v = xq[8 * kk + 2 * t + 1];
            bs[kk][0][0] = u.x;
            bs[kk][0][1] = u.y;
            bs[kk][1][0] = u.z;
            bs[kk][1][1] = u.w;
            bs[kk][2][0] = v.x;
            bs[kk][2][1] = v.y;
            ss[kk] = __uint_as_float(v.z);
        }
    }
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
        if (kk == 1 && 2 * c + 1 >= nb) {
            break;
        }
        u32 b[NG][3][2];
        float sx[NG][2];
#pragma unroll
        for (int tg = 0; tg < NG; tg++) {
            if (XM == MQ_X_SPREAD || XM == MQ_X_STAGE) {
#pragma unroll
                for (int p = 0; p < 3; p++) {
                    b[tg][p][0] = bs[kk][p][0];
                    b[tg][p][1] = bs[kk][p][1];
                }
                sx[tg][0] = ss[kk];
                sx[tg][1] = 0.0f;
                continue;
            }
            float4 xa;
            float4 xb;
            if (XM == MQ_X_LANES) {
                xa = k.x[kk][0];
                xb = k.x[kk][1];
            } else {
                const int r = 8 * tg + g;
                xa = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                xb = xa;
                if (r < n) {
                    const float* xr = x + (long long)r * n_in + 32 * (2 * c + kk) + 4 * t;
                    xa = __ldg((const float4*)xr);
                    xb = __ldg((const float4*)(xr + 16));
                }
            }
            const float inv = mq_quantize(xa, xb, b[tg]);
            // The scales of the two batch rows whose outputs this lane holds.
            sx[tg][0] = __shfl_sync(0xffffffffu, inv, 8 * t);
            sx[tg][1] = NB > 1 ? __shfl_sync(0xffffffffu, inv, 8 * t + 4) : 0.0f;
        }
#pragma unroll
        for (int mt = 0; mt < MQ_TILES; mt++) {
            const uint4& lo = k.v[mt][0];
            const uint4& hi = k.v[mt][1];
            const uint4& tv = k.v[mt][kk];
            const bool whole = ALL || R.tiled[mt];
            const u32 a[4] = {whole ? tv.x : kk ? lo.z : lo.x, whole ? tv.y : kk ? hi.z : hi.x,
                              whole ? tv.z : kk ? lo.w : lo.y, whole ? tv.w : kk ? hi.w : hi.y};
            const u32 s0 = whole ? k.s[mt][kk] : __byte_perm(k.s[mt][0], k.s[mt][1], kk ? 0x7632 : 0x5410);
            const float dw[2] = {f16_bits_to_f32(s0), f16_bits_to_f32(s0 >> 16)};
#pragma unroll
            for (int tg = 0; tg < NG; tg++) {
                int d0[4], d1[4], d2[4];
                mq_mma<true>(d0, a, b[tg][0][0], b[tg][0][1]);
                mq_mma<true>(d1, a, b[tg][1][0], b[tg][1][1]);
                mq_mma<false>(d2, a, b[tg][2][0], b[tg][2][1]);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    // One batch row: only the even columns hold outputs.
                    if (NB == 1 && (i & 1)) {
                        continue;
                    }
                    // (Tried and dropped: each sum started from the float bits of 1.5 * 2^23
                    // through the mma's c operand, so that its float is a subtraction, with no
                    // int-to-float conversions: the same bits, and no faster on an H200.)
                    // (Measurements: scripts/kernel_lab/HISTORY.md, "q8_0.cu: mq_chunk".)
                    const float lo16 = (float)(d0[i] + (d1[i] << 8));
                    const float f = fmaf((float)d2[i], 65536.0f, lo16);
                    acc[mt][tg][i] = fmaf(dw[i >> 1] * sx[tg][i & 1], f, acc[mt][tg][i]);
                }
            }
        }
    }
}

// The warp's chunks first, first + G, ... < c1, each chunk's loads issued before the one before
// it is computed.
template <int NB, bool ALL, int XM>
__device__ __forceinline__ void mq_loop(const MqRows& R, const MvDesc* D, long long pay, int nb, int first, int c1,
                                        int lane, float (&acc)[MQ_TILES][(NB + 7) / 8][4]) {
    const float* x = D->x;
    const int n_in = D->n_in;
    const int n = D->n;
    const int G = D->group;
    MqChunk<XM> cur;
    if (!ALL) {
        // The tail of a matrix (a plane's last rows): few warps, no prefetch (registers).
        for (int c = first; c < c1; c += G) {
            mq_load<ALL, XM>(R, pay, nb, c, lane, x, n_in, n, cur);
            mq_chunk<NB, ALL, XM>(cur, R, nb, c, x, n_in, n, lane, acc);
        }
        return;
    }
    MqChunk<XM> nxt;
    mq_load<ALL, XM>(R, pay, nb, first, lane, x, n_in, n, cur);
    for (int c = first; c < c1; c += G) {
        if (c + G < c1) {
            mq_load<ALL, XM>(R, pay, nb, c + G, lane, x, n_in, n, nxt);
        }
        mq_chunk<NB, ALL, XM>(cur, R, nb, c, x, n_in, n, lane, acc);
        cur = nxt;
    }
}

// mq_loop for one batch row with x staged (mq_stage_x, from chunk c0 at S), whole tiles only,
// the first chunk's weights already in cur.
__device__ __forceinline__ void mq_loop_staged(const MqRows& R, long long pay, int nb, int first, int c1, int G,
                                               int c0, const uint4* S, int lane, MqChunk<MQ_X_STAGE>& cur,
                                               float (&acc)[MQ_TILES][1][4]) {
    MqChunk<MQ_X_STAGE> nxt;
    for (int c = first; c < c1; c += G) {
        if (c + G < c1) {
            mq_load<true, MQ_X_STAGE>(R, pay, nb, c + G, lane, nullptr, 0, 1, nxt);
        }
        mq_chunk<1, true, MQ_X_STAGE>(cur, R, nb, c, nullptr, 0, 1, lane, acc, S + 16 * (c - c0));
        cur = nxt;
    }
}

// The end of the kernel: the G warps of a row group add their sums in warp order (warp p of
// the group holds chunks p, p + G, ...), the first writes them to y (or to the slice's
// partial sums), then mv_add_slices. Every thread of the block calls it.
template <int NB>
__device__ __forceinline__ void mq_store(float (&acc)[MQ_TILES][(NB + 7) / 8][4], const MvDesc* D, const MvBlock& B,
                                         int* __restrict__ counters) {
    constexpr int NG = (NB + 7) / 8;
    constexpr int V = MQ_TILES * NG * 4;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int G = D->group;
    const int n = D->n;
    const int n_out = D->n_out;
    __shared__ float red[MV_WARPS][V][32];
    float* a = &acc[0][0][0];  // the V sums, in [tile][group][i] order
    if (G > 1) {
#pragma unroll
        for (int v = 0; v < V; v++) {
            red[warp][v][lane] = a[v];
        }
        __syncthreads();
        if (B.p == 0) {
            for (int p = 1; p < G; p++) {
#pragma unroll
                for (int v = 0; v < V; v++) {
                    a[v] += red[warp + p][v][lane];
                }
            }
        }
    }
    if (B.p == 0 && B.nrows > 0) {
        const bool split = D->slices > 1;
        float* y = split ? D->part + (long long)B.slice * n * n_out : D->y;
        const int ys = split ? n_out : D->y_stride;
        const int g = lane >> 2;
        const int t = lane & 3;
#pragma unroll
        for (int mt = 0; mt < MQ_TILES; mt++) {
#pragma unroll
            for (int tg = 0; tg < NG; tg++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int o = B.o0 + 16 * mt + g + 8 * (i >> 1);
                    const int r = 8 * tg + 2 * t + (i & 1);
                    if (o < n_out && r < n) {
                        y[(long long)r * ys + o] = acc[mt][tg][i];
                    }
                }
            }
        }
    }
    mv_add_slices(D, B.rb, counters);
}

template <class F, int NB>
__device__ __forceinline__ void matmul_q8_0(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters,
                                            u8* smem, int launch_early) {
    const bool early = ds4_product_begin(launch_early);
    constexpr int NG = (NB + 7) / 8;
    const int lane = threadIdx.x & 31;
    const MvBlock B = mv_block(descs, count);
    const MvDesc* D = B.D;
    if (D->n == 0) {
        if (early) {
            ds4_grid_deps();
        }
        return;  // an unused expert slot (see matvec)
    }
    const u8* w = D->w;
    const long long row_bytes = D->row_bytes;
    const int n_out = D->n_out;
    const int nb = D->n_in / 32;
    const long long pay = 32ll * nb;
    int c0, c1;
    mv_slice((nb + 1) / 2, D->slices, B.slice, c0, c1);
    // Tiles past the whole ones are read row by row; rows past n_out read the last row again
    // (harmless loads; their sums are not stored).
    MqRows R;
    const int whole_rows = n_out & ~15;
#pragma unroll
    for (int mt = 0; mt < MQ_TILES; mt++) {
        const int r0 = B.o0 + 16 * mt;
        R.tiled[mt] = r0 + 16 <= whole_rows;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            R.p[mt][h] = R.tiled[mt] ? w + (long long)r0 * row_bytes
                                     : w + (long long)imin(r0 + (lane >> 2) + 8 * h, n_out - 1) * row_bytes;
        }
    }
    R.vec_tile = ((unsigned long long)w & 15ull) == 0;
    R.vec_row = (((unsigned long long)w | (unsigned long long)row_bytes) & 15ull) == 0;
    float acc[MQ_TILES][NG][4] = {};
    const int first = c0 + B.p;
    const bool fast =
        B.nrows > 0 && first < c1 && B.o0 + MQ_WARP_ROWS <= whole_rows && (R.vec_tile || !MQ_FAST_VEC);
    // One batch row, x staged (mq_stage_x): the same for the whole block.
    const bool staged =
        NB == 1 && MQ_X_STAGED && c1 - c0 <= MQ_XS_CHUNKS && c1 - c0 >= MQ_XS_MIN_CHUNKS * D->group;
    MqChunk<MQ_X_STAGE> cur;
    if (staged && fast) {
        // Weights only: no kernel writes them, so before the wait when launched early.
        mq_load<true, MQ_X_STAGE>(R, pay, nb, first, lane, nullptr, 0, 1, cur);
    }
    if (early) {
        // Early launch (common.cuh ds4_grid_launch): the whole tiles' slice, payload and
        // scales, into L2 before the wait (lanes 0.. the payloads, lanes MQ_TILES.. the scales;
        // the first warp of a row group). Otherwise the chunks' first loads come after the wait
        // when they carry x, which the previous kernel writes (not when x is staged).
        if (B.nrows > 0 && first < c1 && B.p == 0 && lane < 2 * MQ_TILES) {
            const int mt = lane % MQ_TILES;
            bool tiled = R.tiled[0];
            const u8* tb = R.p[0][0];  // R.p[mt][0] without indexing registers at run time
#pragma unroll
            for (int i = 1; i < MQ_TILES; i++) {
                tiled = mt == i ? R.tiled[i] : tiled;
                tb = mt == i ? R.p[i][0] : tb;
            }
            const unsigned long long t = (unsigned long long)tb;
            const long long b0 = 2ll * c0;
            const long long b1 = 2ll * c1 < nb ? 2ll * c1 : nb;
            if (tiled && lane < MQ_TILES) {
                ds4_prefetch_l2(t + 512 * b0, t + 512 * b1);
            } else if (tiled) {
                ds4_prefetch_l2(t + 512ll * nb + 32 * b0, t + 512ll * nb + 32 * b1);
            }
        }
        ds4_grid_deps();
    }
    if constexpr (NB == 1) {
        if (staged) {
            uint4* S = (uint4*)smem;
            mq_stage_x(D->x, nb, c0, c1, S);
            if (fast) {
                mq_loop_staged(R, pay, nb, first, c1, D->group, c0, S, lane, cur, acc);
            } else if (B.nrows > 0 && first < c1) {
                mq_loop<NB, false, MQ_X_LATE>(R, D, pay, nb, first, c1, lane, acc);
            }
        }
    }
    if (!staged && B.nrows > 0 && first < c1) {
        if (fast) {
            constexpr int XM = NB == 1 && MQ_X_COOP ? MQ_X_SPREAD : NG == 1 && MQ_X_PREFETCH ? MQ_X_LANES : MQ_X_LATE;
            mq_loop<NB, true, XM>(R, D, pay, nb, first, c1, lane, acc);
        } else {
            mq_loop<NB, false, MQ_X_LATE>(R, D, pay, nb, first, c1, lane, acc);
        }
    }
    ds4_grid_launch();
    mq_store<NB>(acc, D, B, counters);
}

// Shared memory: the staged x of one batch row (MQ_X_STAGED).
#define MQ_KERNEL(NAME, F, NB) \
    MV_KERNEL_RUN(NAME, F, NB, matmul_q8_0, (32 * MV_WARPS, 4), (NB == 1 && MQ_X_STAGED ? 256 * MQ_XS_CHUNKS : 0))
MV_BATCHES(MQ_KERNEL, q8_0_mq, FmtQ8_0Mq)
