// ds4 CUDA kernels: what every matrix-vector kernel shares.
//
// The host (rust/engine/backend/cuda/context.rs) compiles one NVRTC program made of this file,
// the lookup tables emitted from rust/engine/quant/tables.rs, and every format's .cu file, in
// that order. No CUDA headers are used: the program is plain C++ over NVRTC's builtins.
//
// Shape of every product: `y[r, o] = W[o] . x[r]` for output rows o < n_out and batch rows
// r < n (n <= 16 per launch; the host cuts larger batches into chunks of 16).
//
// Work split: a thread block of MV_WARPS warps; warp w owns output row
// `blockIdx.x * MV_WARPS + w` alone. The warp walks the row in tiles of a fixed number of
// elements (F::TILE_ELEMS): it stages the tile's weight bytes in shared memory with coalesced
// 16-byte loads (the next tile's loads are issued before the current tile is computed), then
// lane l dequantizes the groups of 4 consecutive elements l, l + 32, l + 64, ... of the tile
// and adds their products with each batch row into that row's register accumulator.
//
// Row invariance: the elements a lane accumulates, their order, the fmaf chain of each group
// and the final butterfly over the warp depend only on n_in and on the lane, never on the
// batch size: a kernel instantiated for NB batch rows runs the same operations on each
// accumulator as the one for 1 row. The host compiles with --fmad=false so that no
// expression is contracted differently in different instantiations; the kernels write the
// fused multiply-adds they want as explicit fmaf calls.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Output rows (warps) per thread block.
#define MV_WARPS 4
// Most batch rows one launch computes.
#define MV_MAX_BATCH 16

__device__ __forceinline__ int imin(int a, int b) {
    return a < b ? a : b;
}

// IEEE half bits to float, exactly (subnormals and infinities included): the hardware
// conversion, one instruction.
__device__ __forceinline__ float f16_bits_to_f32(u32 h) {
    float f;
    const unsigned short b = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
    return f;
}

// The float of an unsigned byte value b (0..255), exactly. 2^23 + b has b in its low mantissa
// bits, so this is an OR and a subtraction: the int-to-float converter runs at a fraction of
// the FMA rate, and the quantized kernels convert one or more integers per weight.
__device__ __forceinline__ float u8f(u32 b) {
    return __uint_as_float(0x4B000000u | b) - 8388608.0f;
}

// The float of a signed byte given as its bits b (0..255), exactly (see u8f).
__device__ __forceinline__ float s8f(u32 b) {
    return __uint_as_float(0x4B000000u | (b ^ 0x80u)) - 8388736.0f;
}

// bfloat16 bits to float: the high half of the float.
__device__ __forceinline__ float bf16_bits_to_f32(u32 h) {
    return __uint_as_float(h << 16);
}

// Little-endian u16 at a 2-byte aligned shared-memory address.
__device__ __forceinline__ u32 ld_u16(const u8* p) {
    return *(const u16*)p;
}

// Little-endian u32 at a 2-byte aligned address (two 16-bit loads).
__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {
    return (u32)(*(const u16*)p) | ((u32)(*(const u16*)(p + 2)) << 16);
}

// Little-endian u32 at a 4-byte aligned address.
__device__ __forceinline__ u32 ld_u32_a4(const u8* p) {
    return *(const u32*)p;
}

// Chunks of 16 bytes each lane stages per tile.
template <class F>
struct Staging {
    static constexpr int BYTES = F::TILE_ELEMS / F::BLOCK_ELEMS * F::BLOCK_BYTES;
    static constexpr int CHUNKS = (BYTES + 15) / 16;
    static constexpr int PER_LANE = (CHUNKS + 31) / 32;
    // Shared memory per warp, rounded to whole chunks.
    static constexpr int SMEM = CHUNKS * 16;
};

// The product of one row of weights with NB (at most) batch rows, for the output row of
// this warp. `w` points at row 0 of the matrix, rows `row_bytes` apart; `x` holds n rows of
// n_in floats (16-byte aligned, n_in a multiple of 4); `y` n rows of n_out floats.
//
// Loads of 16 bytes need the row 16-byte aligned; a matrix whose rows are not (an odd
// shape) is staged byte by byte instead, with the same arithmetic. Staging may read up to 15
// bytes past the end of the last row: the host pads every device image by 256 bytes.
template <class F, int NB>
__device__ __forceinline__ void matvec(const u8* __restrict__ w, int n_out, int n_in, long long row_bytes,
                                       const float* __restrict__ x, float* __restrict__ y, int n, u8* smem) {
    typedef Staging<F> S;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int o = blockIdx.x * MV_WARPS + warp;
    if (o >= n_out) {
        return;
    }
    u8* tile = smem + warp * S::SMEM;
    const u8* row = w + (long long)o * row_bytes;
    const int tiles = (n_in + F::TILE_ELEMS - 1) / F::TILE_ELEMS;
    const bool vec = (((unsigned long long)w | (unsigned long long)row_bytes) & 15ull) == 0;

    float acc[NB];
#pragma unroll
    for (int r = 0; r < NB; r++) {
        acc[r] = 0.0f;
    }

    uint4 buf[S::PER_LANE];
    // Issues the loads of tile t into buf (16-byte path only).
    auto load = [&](int t) {
        const int e0 = t * F::TILE_ELEMS;
        const int ne = imin(F::TILE_ELEMS, n_in - e0);
        const int chunks = (ne / F::BLOCK_ELEMS * F::BLOCK_BYTES + 15) / 16;
        const uint4* src = (const uint4*)(row + (long long)(e0 / F::BLOCK_ELEMS) * F::BLOCK_BYTES);
#pragma unroll
        for (int i = 0; i < S::PER_LANE; i++) {
            const int c = lane + 32 * i;
            if (c < chunks) {
                buf[i] = __ldg(src + c);
            }
        }
    };
    if (vec) {
        load(0);
    }
    for (int t = 0; t < tiles; t++) {
        const int e0 = t * F::TILE_ELEMS;
        const int ne = imin(F::TILE_ELEMS, n_in - e0);
        if (vec) {
            const int chunks = (ne / F::BLOCK_ELEMS * F::BLOCK_BYTES + 15) / 16;
#pragma unroll
            for (int i = 0; i < S::PER_LANE; i++) {
                const int c = lane + 32 * i;
                if (c < chunks) {
                    ((uint4*)tile)[c] = buf[i];
                }
            }
            __syncwarp();
            if (t + 1 < tiles) {
                load(t + 1);
            }
        } else {
            const int bytes = ne / F::BLOCK_ELEMS * F::BLOCK_BYTES;
            const u8* src = row + (long long)(e0 / F::BLOCK_ELEMS) * F::BLOCK_BYTES;
            for (int b = lane; b < bytes; b += 32) {
                tile[b] = src[b];
            }
            __syncwarp();
        }
        const int groups = ne >> 2;
        // Unrolled so that the next groups' loads are in flight (less for larger batches, whose
        // accumulators already take the registers); the order of the additions into each
        // accumulator is unchanged.
        constexpr int UNROLL = NB <= 2 ? 4 : (NB <= 8 ? 2 : 1);
#pragma unroll UNROLL
        for (int g = lane; g < groups; g += 32) {
            const float4 wv = F::dequant4(tile, g);
            const float* xc = x + e0 + 4 * g;
#pragma unroll
            for (int r = 0; r < NB; r++) {
                if (r < n) {
                    const float4 xv = __ldg((const float4*)(xc + (long long)r * n_in));
                    float a = acc[r];
                    a = fmaf(wv.x, xv.x, a);
                    a = fmaf(wv.y, xv.y, a);
                    a = fmaf(wv.z, xv.z, a);
                    a = fmaf(wv.w, xv.w, a);
                    acc[r] = a;
                }
            }
        }
        __syncwarp();
    }

#pragma unroll
    for (int r = 0; r < NB; r++) {
        if (r < n) {
            float v = acc[r];
            v += __shfl_xor_sync(0xffffffffu, v, 16);
            v += __shfl_xor_sync(0xffffffffu, v, 8);
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            if (lane == 0) {
                y[(long long)r * n_out + o] = v;
            }
        }
    }
}

// The kernels of one format F: ds4_mv_<NAME>_<NB> for NB in 1, 2, 4, 8, 16 (the host picks
// the smallest NB >= n).
#define MV_KERNEL(NAME, F, NB)                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * MV_WARPS)                                       \
        ds4_mv_##NAME##_##NB(const u8* __restrict__ w, int n_out, int n_in, long long row_bytes,       \
                             const float* __restrict__ x, float* __restrict__ y, int n) {             \
        __shared__ __align__(16) u8 smem[MV_WARPS * Staging<F>::SMEM];                                \
        matvec<F, NB>(w, n_out, n_in, row_bytes, x, y, n, smem);                                      \
    }

#define MV_KERNELS(NAME, F) \
    MV_KERNEL(NAME, F, 1)   \
    MV_KERNEL(NAME, F, 2)   \
    MV_KERNEL(NAME, F, 4)   \
    MV_KERNEL(NAME, F, 8)   \
    MV_KERNEL(NAME, F, 16)
