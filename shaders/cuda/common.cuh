// ds4 CUDA kernels: what every matrix-vector kernel shares.
//
// The host (rust/engine/backend/cuda/context.rs) compiles one NVRTC program made of this file,
// the lookup tables emitted from rust/engine/quant/tables.rs, and every format's .cu file, in
// that order. No CUDA headers are used: the program is plain C++ over NVRTC's builtins.
//
// Shape of every product: `y[r, o] = W[o] . x[r]` for output rows o < n_out and batch rows
// r < n (n <= NB <= 16 per product chunk; the host cuts larger batches into chunks of 16, or
// of 8 for the split formats' float-x kernels: rust/engine/backend/cuda/mod.rs `chunk_rows`).
//
// One launch runs a table of products (MvDesc) of one format and one batch size: block b
// belongs to the product whose `block_start` is the last one <= b. A product's blocks are
// `row_blocks * slices`: a row block is MV_WARPS warps; each row group of D.warp_rows output
// rows (MV_ROWS, or MQ_WARP_ROWS in Q8_0's tensor-core kernel) belongs to `group` of them (1
// in matvec; 1, 2 or 4 in matvec_split and the tensor-core kernel, which split a group's
// chunks between its warps); a slice is a contiguous range of the row's tiles (the host splits
// the inputs of matrices with few rows so that they do not serialize on a few SMs). The group
// and slice counts depend only on the shape.
//
// Three kernel bodies share this launch shape (the first two also the store at the end,
// mv_store; all three mv_add_slices):
// - matvec_split (below, "Products of the split formats"): the float formats and the formats
//   whose rows the upload stores split (Q8_0, Q2_K, IQ2_XXS): direct 16-byte loads per lane,
//   no shared-memory staging.
// - matmul_q8_0 (q8_0.cu): Q8_0 on the tensor cores in exact integers, when the process
//   asks for it (DS4_CUDA_Q8=mma; rust/engine/backend/cuda/context.rs `tensor_cores`).
// - matvec, the staged kernel: Q4_K and MXFP4, whose rows stay in GGUF order. Its work split:
//
// Work split inside a block: the row is walked in tiles of 32 * F::UNIT elements. For each
// tile the block copies the x values of every batch row into shared memory once (all warps
// and rows use them), and each warp stages the tile's weight bytes of its MV_ROWS rows with
// coalesced vector loads (the next tile's loads are issued before the current tile is
// computed). Lane l then owns *unit* l of the tile: F::UNIT consecutive elements that share
// their scales, so the scales are decoded once per unit, not once per 4 elements. For each
// 4-element chunk of the unit the lane dequantizes the weights of its MV_ROWS rows and
// multiplies them with each batch row's x, so every x value read from shared memory serves
// MV_ROWS rows and every dequantized weight serves NB batch rows.
//
// Row invariance: the elements a lane accumulates, their order (units in tile order, chunks
// in unit order, an explicit fmaf chain per chunk), the warp butterfly, the sum of a group's
// warps in warp order and the sum of the slices in slice order depend only on the shape,
// never on the batch size: a kernel
// instantiated for NB batch rows runs the same operations on each accumulator as the one for
// 1 row. The host compiles with --fmad=false so that no expression is contracted differently
// in different instantiations; the kernels write the fused multiply-adds they want as fmaf.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Warps per thread block.
#define MV_WARPS 4
// Output rows per row group: the rows one warp holds (MV_ROWS on the host).
#define MV_ROWS 4
// The fewest blocks per SM the product kernels' register budget must allow (at most 128
// registers a thread: left alone, ptxas gives the kernels of 2..16 batch rows up to 250 and
// halves their occupancy, which costs more than the few spills of the 8- and 16-row ones).
// More blocks did not pay at one row either (H200 lab, Q8_0 4096 x 8192 at the host's group:
// 16.1 us at 4, 17.3 at 6 (80 registers), 29.6 at 8 (64, spills)); a format may ask for
// more at some batch size (MvMinBlocks: Q2_K at one row). A -D option may override the
// default (scripts/kernel_lab).
#ifndef MV_MIN_BLOCKS
#define MV_MIN_BLOCKS 4
#endif

// The fewest blocks per SM of format F's matvec_split kernel for NB batch rows. The register
// cap changes only how many warps fit, never the arithmetic (row invariance).
template <class F, int NB>
struct MvMinBlocks {
    static constexpr int value = MV_MIN_BLOCKS;
};

// Most batch rows one product chunk has.
#define MV_MAX_BATCH 16

// One product of a launch; the host writes the same layout (context.rs `Desc`, 64 bytes).
struct MvDesc {
    const u8* w;        // row 0 of the weights
    const float* x;     // n rows of n_in floats (16-byte aligned)
    float* y;           // n rows of n_out floats
    float* part;        // slices * n * n_out floats of partial sums (slices > 1)
    long long row_bytes;
    int n_out;
    int n_in;
    int n;
    int slices;
    int block_start;    // first block of this product in the launch
    int counter;        // first of its row_blocks arrival counters (slices > 1)
    int group;          // warps that share a row group (matvec_split; 1, 2 or 4; 1 in matvec)
    int y_stride;       // floats from one row of y to the next (n_out, or more when the
                        // product fills columns of wider rows)
    int warp_rows;      // output rows of a row group: MV_ROWS, or MQ_WARP_ROWS for the
                        // tensor-core kernels (Q8_0: q8_0.cu)
    int pad;            // the size a multiple of 16 bytes (the host's Desc)
};

// Output rows per block of a product: MV_WARPS / group row groups of warp_rows rows.
__device__ __forceinline__ int mv_block_rows(const MvDesc& D) {
    return MV_WARPS / D.group * D.warp_rows;
}

// Row blocks of a product (the host's `row_blocks`).
__device__ __forceinline__ int mv_row_blocks(const MvDesc& D) {
    return (D.n_out + mv_block_rows(D) - 1) / mv_block_rows(D);
}

// Programmatic dependent launch (sm_90 and later, when the host launches with the attribute:
// rust/engine/backend/cuda/device.rs): the next kernel of the stream may be launched before
// this one has finished, and its blocks wait here until this grid has finished and its writes
// are visible. Every __global__ kernel of the program calls this before it reads anything a
// kernel writes, so each kernel sees exactly what plain stream order gives it. Elsewhere it
// is a no-op.
//
// When the next kernel launches: as this one's blocks exit, unless this one triggers it
// earlier (griddepcontrol.launch_dependents). The default program (DS4_PDL_EARLY, below)
// triggers early only where a product follows: a trigger at the start of every kernel
// (DS4_CUDA_PDL=start, DS4_PDL_TRIGGER_AT_START) let a chain of later kernels place waiting
// blocks on the SMs long before their turn (H200, Flash decode at 2K: 11.26 ms against 10.88
// with no early trigger, DS4_CUDA_PDL=exit). (Measurements: scripts/kernel_lab/HISTORY.md,
// "common.cuh: ds4_grid_deps".)
__device__ __forceinline__ void ds4_grid_deps() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#ifdef DS4_PDL_TRIGGER_AT_START
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Early launch (DS4_PDL_EARLY, the default; rust/engine/backend/cuda/context.rs): a product
// whose weights and descriptors are known when it is queued (the decode's own products, not
// the routed experts, whose tables ds4_route writes) reads them before it waits for the
// previous kernel. Its blocks load their first chunk into registers and ask L2 for the rest of
// their rows (ds4_prefetch_l2) while that kernel still runs, so a product no longer starts with
// a memory round trip after each small kernel of the decode (norms, hyper-connection mixing,
// attention). For that the previous kernel lets it launch early: the small kernels that come
// before products call ds4_grid_lead (let the dependent launch now, then wait), and the
// products of matvec_split and the tensor-core Q8_0 kernel call ds4_grid_launch once their
// weights are read, before their sums are stored (the staged matvec waits first and does not
// trigger early; the tensor-core Q8_0 kernel only asks L2 for its rows before the wait, its
// loads carry x). Only reads of data no kernel writes move before the wait. On the H200,
// Flash decode at 2K: 9.02 ms against 9.53 with DS4_CUDA_PDL=exit. Without DS4_PDL_EARLY these
// two are no-ops and the products wait first. (Measurements: scripts/kernel_lab/HISTORY.md,
// "common.cuh: ds4_grid_launch".)
__device__ __forceinline__ void ds4_grid_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(DS4_PDL_EARLY)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The start of a product kernel (matvec_split, the tensor-core Q8_0 kernel): whether it reads
// its weights before waiting for the previous kernel (the launch's `early` argument, in a
// program compiled with DS4_PDL_EARLY); if not, the wait, now.
__device__ __forceinline__ bool ds4_product_begin(int early) {
#ifdef DS4_PDL_EARLY
    if (early) {
        return true;
    }
#endif
    ds4_grid_deps();
    return false;
}

// ds4_grid_deps for a small kernel that a product follows: its dependent may launch at once.
__device__ __forceinline__ void ds4_grid_lead() {
    ds4_grid_launch();
    ds4_grid_deps();
}

// ds4_grid_deps for a small kernel of a decode step's chain of small kernels (the attention
// site: finish_rows, the compressors, the indexer, the attention logits): with one row
// (`one_row`, from the grid or the kernel's row count), once this kernel's own wait is over
// its dependent may launch, so that the next small kernel's launch overlaps this one's work
// rather than following its exit. After the wait, not before: a trigger before it would let
// the next kernel trigger its own dependent in turn, and the whole chain would sit waiting on
// the SMs (the DS4_PDL_TRIGGER_AT_START case above). With more rows (a verify's, a prompt's)
// the dependent's blocks would take SM room the side branch's products use, so no trigger.
// On an H200, Flash at a 2100-token context: decode steps in a row 8.375 ms against 8.422
// without it. (Measurements: scripts/kernel_lab/HISTORY.md,
// "common.cuh: ds4_grid_deps_then_lead".)
__device__ __forceinline__ void ds4_grid_deps_then_lead(bool one_row) {
    ds4_grid_deps();
    if (one_row) {
        ds4_grid_launch();
    }
}

// Asks L2 to fetch the bytes [a, b) (absolute addresses inside one allocation), both ends
// rounded down to 16 bytes, so never past the allocation's end: a hint, no data moves to the
// SM, and nothing waits for it.
__device__ __forceinline__ void ds4_prefetch_l2(unsigned long long a, unsigned long long b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    a &= ~15ull;
    b &= ~15ull;
    if (b > a) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"((u32)(b - a)) : "memory");
    }
#endif
}

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
// the FMA rate, and the quantized kernels convert one integer per weight.
__device__ __forceinline__ float u8f(u32 b) {
    return __uint_as_float(0x4B000000u | b) - 8388608.0f;
}

// The float of byte i (0..3) of `word`, exactly: one byte permute builds 2^23 + byte.
__device__ __forceinline__ float byte_f(u32 word, int i) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | (u32)i)) - 8388608.0f;
}

// The float of the signed byte i of `word ^ 0x80808080` (pass the flipped word), exactly.
__device__ __forceinline__ float sbyte_f(u32 flipped, int i) {
    return __uint_as_float(__byte_perm(flipped, 0x4B000000u, 0x7440u | (u32)i)) - 8388736.0f;
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

// Little-endian u32 at any address (four byte loads).
__device__ __forceinline__ u32 ld_u32_a1(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// The staging load of F::VEC bytes.
template <int V>
struct VecT;
template <>
struct VecT<16> {
    typedef uint4 T;
};

// Sizes of the kernel of format F for NB batch rows.
template <class F, int NB>
struct Mv {
    static constexpr int U = F::UNIT;
    static constexpr int TILE = 32 * U;
    static constexpr int TILE_BYTES = TILE / F::BLOCK_ELEMS * F::BLOCK_BYTES;
    // Staging loads per row and tile, and the staging bytes per row.
    static constexpr int CH = (TILE_BYTES + F::VEC - 1) / F::VEC;
    static constexpr int WS = (CH * F::VEC + 15) / 16 * 16;
    static constexpr int PER_LANE = (MV_ROWS * CH + 31) / 32;
    // Floats per unit in the shared x tile: the unit's NB rows of U floats, then 4 floats of
    // padding when needed so that lane l's 16-byte reads start l * (an odd number) of 16-byte
    // bank groups apart: the 8 lanes of each phase of a 16-byte shared load hit distinct banks.
    static constexpr int XU = NB * U + (((NB * U / 4) % 2) == 0 ? 4 : 0);
    static constexpr int XS = 32 * XU;
    static constexpr int SMEM = F::LUT_BYTES + XS * 4 + MV_WARPS * MV_ROWS * WS;
};

__device__ __forceinline__ void mv_add_slices(const MvDesc* D, int rb, int* __restrict__ counters);

// The end of every product kernel: each accumulator's warp sum (a fixed butterfly); when the
// G = D->group warps of a row group split its chunks, their sums added in warp order (warp
// p of the group holds chunks p, p + G, ...); the result written to y, or to the slice's
// partial sums when the row's inputs are split over several blocks; then the last block of a
// split row block to finish adds the slices' partial sums. Every thread of the block calls it.
template <int NB>
__device__ __forceinline__ void mv_store(float (&acc)[MV_ROWS][NB], const MvDesc* D, int slice, int rb, int o0,
                                         int nrows, int* __restrict__ counters) {
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int n = D->n;
    const int n_out = D->n_out;
    const int slices = D->slices;
    const int G = D->group;
    float* y = slices > 1 ? D->part + (long long)slice * n * n_out : D->y;
    const int ys = slices > 1 ? n_out : D->y_stride;
    __shared__ float red[MV_WARPS][MV_ROWS][NB];
#pragma unroll
    for (int q = 0; q < MV_ROWS; q++) {
#pragma unroll
        for (int r = 0; r < NB; r++) {
            if (r < n) {
                float v = acc[q][r];
                v += __shfl_xor_sync(0xffffffffu, v, 16);
                v += __shfl_xor_sync(0xffffffffu, v, 8);
                v += __shfl_xor_sync(0xffffffffu, v, 4);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                if (lane == 0) {
                    if (G == 1) {
                        if (q < nrows) {
                            y[(long long)r * ys + o0 + q] = v;
                        }
                    } else {
                        red[warp][q][r] = v;
                    }
                }
            }
        }
    }
    if (G > 1) {
        __syncthreads();
        if (warp % G == 0 && lane == 0) {
            for (int q = 0; q < nrows; q++) {
                for (int r = 0; r < n; r++) {
                    float v = red[warp][q][r];
                    for (int p = 1; p < G; p++) {
                        v += red[warp + p][q][r];
                    }
                    y[(long long)r * ys + o0 + q] = v;
                }
            }
        }
    }
    mv_add_slices(D, rb, counters);
}

// When a product's inputs are split in slices (after each block has written its slice's
// partial sums): the last block of row block rb to finish adds the slices' partial sums, in
// slice order (a fixed order: row invariance), and re-arms the counter for the next launch.
// Every thread of the block calls it.
__device__ __forceinline__ void mv_add_slices(const MvDesc* D, int rb, int* __restrict__ counters) {
    const int slices = D->slices;
    if (slices == 1) {
        return;
    }
    const int tid = threadIdx.x;
    const int n = D->n;
    const int n_out = D->n_out;
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const int prev = atomicAdd(counters + D->counter + rb, 1);
        last = prev == slices - 1;
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    const int ob = rb * mv_block_rows(*D);
    const int rows = imin(mv_block_rows(*D), n_out - ob);
    const long long step = (long long)n * n_out;
    for (int i = tid; i < n * rows; i += 32 * MV_WARPS) {
        const int r = i / rows;
        const int o = ob + i % rows;
        const float* p = D->part + (long long)r * n_out + o;
        // Eight slices' loads in flight before their adds (in slice order, as one at a time):
        // a prompt's step splits its products in up to 32 slices of 64 rows, and one block
        // adds them, at the end of the launch, while the other SMs wait.
        float v = 0.0f;
        int s = 0;
        for (; s + 8 <= slices; s += 8) {
            float a[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                a[j] = __ldcg(p + (s + j) * step);
            }
#pragma unroll
            for (int j = 0; j < 8; j++) {
                v += a[j];
            }
        }
        for (; s < slices; s++) {
            v += __ldcg(p + s * step);
        }
        D->y[(long long)r * D->y_stride + o] = v;
    }
    if (tid == 0) {
        counters[D->counter + rb] = 0;
    }
}

// Where block b (mv_block: blockIdx.x) of a launch works: its product D (the one whose
// block_start is the last one <= b), its row block rb and input slice, its warp's first output
// row o0 and row count nrows (0 for a warp past n_out), and the warp's place p in its row group.
struct MvBlock {
    const MvDesc* D;
    int rb;
    int slice;
    int o0;
    int nrows;
    int p;
};

__device__ __forceinline__ MvBlock mv_block_at(const MvDesc* __restrict__ descs, int count, int b) {
    // Binary search (block starts never decrease; descs[0] starts at block 0): a routed
    // launch of 16 rows has up to 192 products, and a walk from the first is one dependent
    // load per product (a 16-row prefill ran at 158 tok/s with it, 187 with this).
    int p = 0;
    int hi = count - 1;
    while (p < hi) {
        const int mid = (p + hi + 1) >> 1;
        if (descs[mid].block_start <= b) {
            p = mid;
        } else {
            hi = mid - 1;
        }
    }
    MvBlock B;
    B.D = descs + p;
    const int n_out = B.D->n_out;
    const int G = B.D->group;
    const int row_blocks = mv_row_blocks(*B.D);
    const int local = b - B.D->block_start;
    const int warp = threadIdx.x >> 5;
    B.rb = local % row_blocks;
    B.slice = local / row_blocks;
    B.o0 = B.rb * mv_block_rows(*B.D) + (warp / G) * B.D->warp_rows;
    B.nrows = n_out - B.o0 < 0 ? 0 : imin(B.D->warp_rows, n_out - B.o0);
    B.p = warp % G;
    return B;
}

__device__ __forceinline__ MvBlock mv_block(const MvDesc* __restrict__ descs, int count) {
    return mv_block_at(descs, count, blockIdx.x);
}

// The units (tiles or chunks) [u0, u1) of slice `slice` of `units`, split in `slices`.
__device__ __forceinline__ void mv_slice(int units, int slices, int slice, int& u0, int& u1) {
    const int per = (units + slices - 1) / slices;
    u0 = slice * per;
    u1 = imin(units, u0 + per);
}

template <class F, int NB>
__device__ __forceinline__ void matvec(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters,
                                       u8* smem, int) {
    ds4_grid_deps();
    typedef Mv<F, NB> M;
    typedef typename VecT<F::VEC>::T V;
    constexpr int U = M::U;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const MvBlock B = mv_block(descs, count);
    const MvDesc* D = B.D;
    // A product with no rows (an unused expert slot of a routed batch) does nothing; all of
    // its blocks return here, so its arrival counters are never touched.
    if (D->n == 0) {
        return;
    }
    const u8* w = D->w;
    const float* x = D->x;
    const long long row_bytes = D->row_bytes;
    const int n_in = D->n_in;
    const int n = D->n;
    const int o0 = B.o0;
    const int nrows = B.nrows;
    int t0, t1;
    mv_slice((n_in + M::TILE - 1) / M::TILE, D->slices, B.slice, t0, t1);

    F::init_lut(smem, tid);
    float* xs = (float*)(smem + F::LUT_BYTES);
    u8* stage = smem + F::LUT_BYTES + M::XS * 4 + warp * MV_ROWS * M::WS;
    const bool vec = (((unsigned long long)w | (unsigned long long)row_bytes) & (unsigned long long)(F::VEC - 1)) == 0;
    const u8* row0 = w + (long long)(nrows > 0 ? o0 : 0) * row_bytes;

    float acc[MV_ROWS][NB];
#pragma unroll
    for (int q = 0; q < MV_ROWS; q++) {
#pragma unroll
        for (int r = 0; r < NB; r++) {
            acc[q][r] = 0.0f;
        }
    }

    V buf[M::PER_LANE];
    // Issues the loads of tile t of this warp's rows into buf (vector path only).
    auto load = [&](int t) {
        const int e0 = t * M::TILE;
        const int ne = imin(M::TILE, n_in - e0);
        const int chunks = (ne / F::BLOCK_ELEMS * F::BLOCK_BYTES + F::VEC - 1) / F::VEC;
        const u8* src = row0 + (long long)(e0 / F::BLOCK_ELEMS) * F::BLOCK_BYTES;
#pragma unroll
        for (int i = 0; i < M::PER_LANE; i++) {
            const int c = lane + 32 * i;
            const int q = c / M::CH;
            const int cc = c - q * M::CH;
            if (q < nrows && cc < chunks) {
                buf[i] = __ldg((const V*)(src + (long long)q * row_bytes) + cc);
            }
        }
    };
    // The x tiles: XR batch rows at a time, XPT float4 per thread and row; all the loads of
    // a batch are issued before any is stored (a load-store loop would wait for each one).
    // The first XR rows of the next tile are loaded with the next tile's weights.
    constexpr int XR = NB < 4 ? NB : 4;
    constexpr int XPT = (M::TILE / 4 + 32 * MV_WARPS - 1) / (32 * MV_WARPS);
    auto xload = [&](int t, int r0, float4 (&dst)[XR][XPT]) {
        const int e0 = t * M::TILE;
        const int q4 = imin(M::TILE, n_in - e0) >> 2;
#pragma unroll
        for (int rr = 0; rr < XR; rr++) {
#pragma unroll
            for (int i = 0; i < XPT; i++) {
                const int k4 = tid + 32 * MV_WARPS * i;
                if (r0 + rr < n && k4 < q4) {
                    dst[rr][i] = __ldg((const float4*)(x + (long long)(r0 + rr) * n_in + e0) + k4);
                }
            }
        }
    };
    // Stores them in the padded unit-major layout of xs.
    auto xstore = [&](int t, int r0, const float4 (&src)[XR][XPT]) {
        const int q4 = imin(M::TILE, n_in - t * M::TILE) >> 2;
#pragma unroll
        for (int rr = 0; rr < XR; rr++) {
#pragma unroll
            for (int i = 0; i < XPT; i++) {
                const int k4 = tid + 32 * MV_WARPS * i;
                if (r0 + rr < n && k4 < q4) {
                    const int k = 4 * k4;
                    *(float4*)(xs + (k / U) * M::XU + (r0 + rr) * U + (k % U)) = src[rr][i];
                }
            }
        }
    };
    float4 xb[XR][XPT];
    if (t0 < t1) {
        if (vec) {
            load(t0);
        }
        xload(t0, 0, xb);
    }
    for (int t = t0; t < t1; t++) {
        const int e0 = t * M::TILE;
        const int ne = imin(M::TILE, n_in - e0);
#pragma unroll
        for (int r0 = XR; r0 < NB; r0 += XR) {
            if (r0 < n) {
                float4 tmp[XR][XPT];
                xload(t, r0, tmp);
                xstore(t, r0, tmp);
            }
        }
        xstore(t, 0, xb);
        if (vec) {
            const int chunks = (ne / F::BLOCK_ELEMS * F::BLOCK_BYTES + F::VEC - 1) / F::VEC;
#pragma unroll
            for (int i = 0; i < M::PER_LANE; i++) {
                const int c = lane + 32 * i;
                const int q = c / M::CH;
                const int cc = c - q * M::CH;
                if (q < nrows && cc < chunks) {
                    ((V*)(stage + q * M::WS))[cc] = buf[i];
                }
            }
        } else {
            const int bytes = ne / F::BLOCK_ELEMS * F::BLOCK_BYTES;
            const u8* src = row0 + (long long)(e0 / F::BLOCK_ELEMS) * F::BLOCK_BYTES;
            for (int q = 0; q < nrows; q++) {
                for (int i = lane; i < bytes; i += 32) {
                    stage[q * M::WS + i] = src[(long long)q * row_bytes + i];
                }
            }
        }
        __syncthreads();
        if (t + 1 < t1) {
            if (vec) {
                load(t + 1);
            }
            xload(t + 1, 0, xb);
        }
        const int nu = (ne + U - 1) / U;
        if (lane < nu && nrows > 0) {
            const int nch = imin(U / 4, (ne - lane * U) >> 2);
            typename F::Unit st[MV_ROWS];
#pragma unroll
            for (int q = 0; q < MV_ROWS; q++) {
                if (q < nrows) {
                    F::load(stage + q * M::WS, lane, st[q], smem);
                }
            }
            const float* xu = xs + lane * M::XU;
#pragma unroll
            for (int j = 0; j < U / 4; j++) {
                if (j < nch) {
                    float4 wv[MV_ROWS];
#pragma unroll
                    for (int q = 0; q < MV_ROWS; q++) {
                        if (q < nrows) {
                            wv[q] = F::get(st[q], j, smem);
                        }
                    }
#pragma unroll
                    for (int r = 0; r < NB; r++) {
                        if (r < n) {
                            const float4 xv = *(const float4*)(xu + r * U + 4 * j);
#pragma unroll
                            for (int q = 0; q < MV_ROWS; q++) {
                                if (q < nrows) {
                                    float a = acc[q][r];
                                    a = fmaf(wv[q].x, xv.x, a);
                                    a = fmaf(wv[q].y, xv.y, a);
                                    a = fmaf(wv[q].z, xv.z, a);
                                    a = fmaf(wv[q].w, xv.w, a);
                                    acc[q][r] = a;
                                }
                            }
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

    mv_store<NB>(acc, D, B.slice, B.rb, o0, nrows, counters);
}

// ---- Products of the split formats (Q8_0, Q2_K, IQ2_XXS; rust/engine/quant/split/) and the
// float formats
//
// Their rows are read straight from global memory, in *chunks* of 512 payload bytes (the
// split formats store each row's payloads, the quant bytes, first and the headers after them:
// rust/engine/quant/split/). Each row group of MV_ROWS rows belongs to G = D->group warps
// of a block (1, 2 or 4, chosen by the host from the shape so that short rows are not split
// and long ones are walked by several warps at once): warp p of the group takes chunks
// p, p + G, p + 2 G, ... of the block's slice, and mv_store adds the G warps' sums in warp
// order. A lane holds its part of a chunk of each of its rows in registers (F::Chunk); with
// F::PREFETCH the next chunk's loads are issued before the current one is computed. x is read
// straight from global memory (it is small and stays in L1/L2; each float4 serves MV_ROWS
// rows). There is no shared-memory staging and no barrier in the loop.
//
// What the H200 measurements say about this design (scripts/kernel_lab, Nsight Compute):
// - At one batch row the kernels are bound by the bytes in flight, not by instructions, so a
//   lane's loads are 16 bytes: lanes reading 4-byte words 128 bytes apart (so that x would be
//   read in contiguous runs) made a Q8_0 4096 x 8192 product 2.5x slower, and a second chunk
//   in flight (PREFETCH 2) was slower too.
// - x's layout costs too, but less: a lane's x run is 64 (Q8_0) to 256 (IQ2_XXS) bytes from
//   its neighbour's, so a warp-wide float4 load of x touches 16 to 32 cache lines.
// - 16 batch rows spill at the 128-register cap (MV_MIN_BLOCKS); more registers, fewer warps
//   was slower still, so the host cuts the quantized formats' batches at 8 rows
//   (rust/engine/backend/cuda/mod.rs `chunk_rows`).
// - With float x the IQ2_XXS kernel was bound by issue (its dequantization cost about 5
//   instructions a weight); hence its int8 x and dp4a (iq2_xxs.cu), and Q2_K's (q2_k.cu).
// - Q8_0 keeps float x: 8-bit x and dp4a was faster in the lab (Flash q_b 32768 x 1024 at 4
//   batch rows: 36.4 -> 23.4 us), but every writer of a Q8_0 product's input, the attention's
//   included, would have to quantize it, and the attention products' numerics would change.
//   Float x costs the one-row kernels little; it is the batches of a verify that pay for it.
// - Q8_0 on the tensor cores in tf32 (the quant bytes as A, x as B split in a high and a low
//   tf32 part): its time hardly depends on the batch, but at one row it is 1.4 to 2.2 times
//   slower (Flash 2K decode 9.3 -> 12.2 ms); decode is the common case, so the FMA kernel
//   stays. The exact 8-bit integer route of q8_0.cu (DS4_CUDA_Q8=mma) needs neither the
//   conversions nor the split: flat in the batch too, but still slower at one row (its notes).
// - (Tried and dropped, to cut x's L1 traffic: a padded copy of the block's x slice in shared
//   memory, slower at one row, and x stored lane-permuted, at most about 2% in the engine; for
//   the float-x IQ2_XXS kernel, a float copy of its lattice in shared memory, slower.)
// (Measurements: scripts/kernel_lab/HISTORY.md, "common.cuh: matvec_split design".)
//
// F provides: BLOCK_ELEMS, PAY (payload bytes per block), CB = 512 / PAY (blocks per chunk),
// LUT_BYTES / init_lut, PREFETCH, a Chunk type, load(row, nb, c, lane, vec, ch), which issues
// the loads of lane l's part of chunk c of a row of nb blocks (vec: the row is 16-byte
// aligned), and dot<NB>(ch, nb, c, lane, x, n_in, n, acc, smem), which adds lane l's part of
// chunk c of every row to acc in a fixed order. Both are called by every lane of the warp for
// every chunk of the slice (a last partial chunk included); they skip the lanes with no data
// themselves, so that dot may use warp-wide operations. With PREFETCH, chunk c + G's loads go
// out before chunk c is computed. (Tried and dropped: two chunks ahead, a ring of three a warp;
// the same bits, more registers, slower: Flash steps at 2100 tokens 8.92 against 8.82 ms.)
// (Measurements: scripts/kernel_lab/HISTORY.md, "common.cuh: matvec_split PREFETCH".)
//
// The input split (slices, groups) is by chunks; a row's chunks, lanes, fmaf chains, butterfly
// and group order do not depend on the batch size (row invariance), as in matvec.

// 16 bytes at a 2-byte aligned address (eight 16-bit loads).
__device__ __forceinline__ uint4 ld16_a2(const u8* p) {
    return make_uint4(ld_u32_a2(p), ld_u32_a2(p + 4), ld_u32_a2(p + 8), ld_u32_a2(p + 12));
}

// Word i (0..3) of a uint4.
__device__ __forceinline__ u32 word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Whether lane l has bytes in chunk c of a row whose payload is `pay` bytes (its bytes are
// 512 c + 16 l ..; only a last partial chunk leaves lanes without).
__device__ __forceinline__ bool mv_lane_in(long long pay, int c, int lane) {
    return 512ll * c + 16 * lane < pay;
}

// Lane l's 16 bytes of chunk c of a row whose payload is `pay` bytes: bytes 512 c + 16 l
// (no load past the payload).
__device__ __forceinline__ void ld_lane16(const u8* row, long long pay, int c, int lane, bool vec, uint4& v) {
    if (mv_lane_in(pay, c, lane)) {
        const u8* p = row + 512ll * c + 16 * lane;
        v = vec ? __ldg((const uint4*)p) : ld16_a2(p);
    }
}

// The chunk of a format whose blocks are a 2-byte f16 scale and PAY payload bytes (Q8_0,
// IQ2_XXS; `split_scale_first` in rust/engine/quant/split/): lane l's 16 payload bytes and
// the scale of their block (PAY / 16 lanes share one), loaded together.
struct ScaleChunk {
    uint4 v;
    u32 d;  // the f16 bits of the block's scale
};

template <int PAY>
__device__ __forceinline__ void ld_scale_chunk(const u8* row, int nb, int c, int lane, bool vec, ScaleChunk& h) {
    const long long pay = (long long)nb * PAY;
    ld_lane16(row, pay, c, lane, vec, h.v);
    if (mv_lane_in(pay, c, lane)) {
        h.d = ld_u16(row + pay + 2 * ((512 / PAY) * c + lane / (PAY / 16)));
    }
}

// For each row r < n: acc[q][r] += s[q] * (w[q] . x[r][e..e + 4]), the dot an fmaf chain from
// the first product (the scaled step of the quantized formats of matvec_split).
template <int NB>
__device__ __forceinline__ void scaled_dot4(const float (&wf)[MV_ROWS][4], const float (&s)[MV_ROWS],
                                            const float* __restrict__ x, int n_in, int n, int e,
                                            float (&acc)[MV_ROWS][NB]) {
#pragma unroll
    for (int r = 0; r < NB; r++) {
        if (r < n) {
            const float4 xv = __ldg((const float4*)(x + (long long)r * n_in + e));
#pragma unroll
            for (int q = 0; q < MV_ROWS; q++) {
                float t = wf[q][0] * xv.x;
                t = fmaf(wf[q][1], xv.y, t);
                t = fmaf(wf[q][2], xv.z, t);
                t = fmaf(wf[q][3], xv.w, t);
                acc[q][r] = fmaf(s[q], t, acc[q][r]);
            }
        }
    }
}

template <class F, int NB>
__device__ __forceinline__ void matvec_split(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters,
                                             u8* smem, int launch_early) {
    const bool early = ds4_product_begin(launch_early);
    const int tid = threadIdx.x;
    const MvBlock B = mv_block(descs, count);
    const MvDesc* D = B.D;
    if (D->n == 0) {
        if (early) {
            ds4_grid_deps();
        }
        return;  // an unused expert slot (see matvec)
    }
    const u8* w = D->w;
    const float* x = D->x;
    const long long row_bytes = D->row_bytes;
    const int n_out = D->n_out;
    const int n_in = D->n_in;
    const int n = D->n;
    const int G = D->group;
    const int lane = tid & 31;
    const int nb = n_in / F::BLOCK_ELEMS;
    int c0, c1;
    mv_slice((nb + F::CB - 1) / F::CB, D->slices, B.slice, c0, c1);

    // Rows past n_out read the last row again (harmless loads; their sums are not stored).
    const u8* rows[MV_ROWS];
#pragma unroll
    for (int q = 0; q < MV_ROWS; q++) {
        rows[q] = w + (long long)imin(B.o0 + q, n_out - 1) * row_bytes;
    }
    const bool vec = (((unsigned long long)w | (unsigned long long)row_bytes) & 15ull) == 0;

    float acc[MV_ROWS][NB];
#pragma unroll
    for (int q = 0; q < MV_ROWS; q++) {
#pragma unroll
        for (int r = 0; r < NB; r++) {
            acc[q][r] = 0.0f;
        }
    }
    typedef typename F::Chunk C;
    C cur[MV_ROWS];
    auto load = [&](int c, C (&dst)[MV_ROWS]) {
#pragma unroll
        for (int q = 0; q < MV_ROWS; q++) {
            F::load(rows[q], nb, c, lane, vec, dst[q]);
        }
    };
    const int first = c0 + B.p;
    const bool work = B.nrows > 0 && first < c1;
    if (work) {
        load(first, cur);
    }
    if (early) {
        // The rest of the slice of the warp's rows into L2 (the first warp of a row group;
        // lanes 0.. the payloads, lanes MV_ROWS.. the headers after them), then the wait
        // (early launch: see ds4_grid_launch). The first chunk is in flight already.
        if (work && vec && B.p == 0 && lane < 2 * MV_ROWS) {
            const int q = lane % MV_ROWS;
            const u8* row = rows[0];  // rows[q] without indexing registers at run time
#pragma unroll
            for (int i = 1; i < MV_ROWS; i++) {
                row = q == i ? rows[i] : row;
            }
            const long long pay = (long long)nb * F::PAY;
            const long long hb = (row_bytes - pay) / nb;
            const long long b0 = (long long)F::CB * c0;
            const long long b1 = imin(F::CB * c1, nb);
            const unsigned long long r = (unsigned long long)row;
            if (lane < MV_ROWS) {
                ds4_prefetch_l2(r + b0 * F::PAY, r + b1 * F::PAY);
            } else if (hb > 0) {
                ds4_prefetch_l2(r + pay + b0 * hb, r + pay + b1 * hb);
            }
        }
        ds4_grid_deps();
    }
    // The lookup table is filled while the first loads are in flight.
    if (F::LUT_BYTES > 0) {
        F::init_lut(smem, tid);
        __syncthreads();
    }
    if (work) {
        if (F::PREFETCH) {
            C nxt[MV_ROWS];
            for (int c = first; c < c1; c += G) {
                if (c + G < c1) {
                    load(c + G, nxt);
                }
                F::template dot<NB>(cur, nb, c, lane, x, n_in, n, acc, smem);
#pragma unroll
                for (int q = 0; q < MV_ROWS; q++) {
                    cur[q] = nxt[q];
                }
            }
        } else {
            for (int c = first; c < c1; c += G) {
                if (c != first) {
                    load(c, cur);
                }
                F::template dot<NB>(cur, nb, c, lane, x, n_in, n, acc, smem);
            }
        }
    }
    ds4_grid_launch();
    mv_store<NB>(acc, D, B.slice, B.rb, B.o0, B.nrows, counters);
}

// (Tried and dropped: the routed experts' launches on as many blocks as are resident, each
// block looping over the launch's blocks with its next block's first chunk in flight. The same
// bits, but slower on an H200 (Flash steps at a 2100-token context 8.89 ms against 8.74):
// launching and retiring blocks costs it less than the loop's registers and serial blocks do.)
// (Measurements: scripts/kernel_lab/HISTORY.md, "common.cuh: matvec_split persistent blocks".)
//
// (Tried and dropped: the two-row kernels running the blocks of a one-row descriptor with the
// one-row code, for a verify's routed experts, most of which serve one row. The same bits, but
// slower on an H200: the two-row code's unused row costs little, and the block's second
// descriptor lookup and larger kernel more.) (Measurements: scripts/kernel_lab/HISTORY.md,
// "common.cuh: matvec_split one-row descriptors".)
//
// One product kernel, ds4_mv_<NAME>_<NB>, which runs RUN<F, NB> (matvec or matvec_split)
// under the launch bounds BOUNDS (parenthesized), and ds4_smem_<NAME>_<NB> = SMEM, the dynamic
// shared memory it needs.
#define MV_KERNEL_RUN(NAME, F, NB, RUN, BOUNDS, SMEM)                                                             \
    extern "C" __device__ int ds4_smem_##NAME##_##NB = SMEM;                                                     \
    extern "C" __global__ void __launch_bounds__ BOUNDS                                                          \
        ds4_mv_##NAME##_##NB(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters, int early) {\
        extern __shared__ __align__(16) u8 smem[];                                                               \
        RUN<F, NB>(descs, count, counters, smem, early);                                                         \
    }

// KERNEL(NAME, F, NB) for NB in 1, 2, 4, 8, 16 (the host picks the smallest NB >= n).
#define MV_BATCHES(KERNEL, NAME, F) \
    KERNEL(NAME, F, 1)              \
    KERNEL(NAME, F, 2)              \
    KERNEL(NAME, F, 4)              \
    KERNEL(NAME, F, 8)              \
    KERNEL(NAME, F, 16)

// The kernels of one format F through matvec, and of a split format through matvec_split
// (register-capped: see MV_MIN_BLOCKS and MvMinBlocks).
#define MV_KERNEL(NAME, F, NB) MV_KERNEL_RUN(NAME, F, NB, matvec, (32 * MV_WARPS), (Mv<F, NB>::SMEM))
#define MVS_KERNEL(NAME, F, NB) \
    MV_KERNEL_RUN(NAME, F, NB, matvec_split, (32 * MV_WARPS, MvMinBlocks<F, NB>::value), F::LUT_BYTES)
#define MV_KERNELS(NAME, F) MV_BATCHES(MV_KERNEL, NAME, F)
#define MVS_KERNELS(NAME, F) MV_BATCHES(MVS_KERNEL, NAME, F)

// Formats without lookup tables.
#define MV_NO_LUT                                                          \
    static constexpr int LUT_BYTES = 0;                                    \
    static __device__ __forceinline__ void init_lut(u8*, int) {}
