// IQ2_XXS: super-blocks of 256 weights, 66 bytes in GGUF: f16 d, then 8 groups of 32 weights,
// each two little-endian u32 words. Word 0 holds four 8-bit indices into the lattice
// `iq2xxs_grid` (8 coordinates each); word 1 four 7-bit sign indices (bits 0..28) and a 4-bit
// scale s (bits 28..32). db = d * (0.5 + s) * 0.25; w = +-db * grid coordinate
// (rust/engine/quant/iq2_xxs.rs). The sign table ksigns_iq2xs is `i | parity(i) << 7`,
// computed here (iq2_sign_half0, iq2_sign_half1). `iq2xxs_grid` is emitted by the host from
// quant/tables.rs into the program, before this file; each block copies it to shared memory
// (random per-lane indices into constant memory would serialize, and into global memory touch
// many lines) as one 32-bit word of byte selectors an entry: nibble j is 0, 1 or 2 for
// coordinate j = 8, 25 or 43, and two byte permutes of the word 0x002B1908 rebuild the
// entry's 8 bytes. The lattice's random per-lane lookups are the kernel's largest stall
// (Nsight Compute: L1/TEX 76% busy, excessive shared-memory wavefronts from bank conflicts); a
// 4-byte lookup makes one wavefront of a warp's request where an 8-byte one made two, before
// conflicts. The same bits, and faster (H200 lab: 160 products at one row 258 us against 273-276
// with 8-byte entries). (Tried on top and not kept, the same bits: the dp4a chains split in two,
// both groups' x loaded before either is used, the lattice held in 8, 16 or 32 copies; 32
// copies made Flash steps 9.12 ms against 8.70.) With 4-byte entries the conflicts no longer
// bound the kernel, and a table of 16 or 32 KB a block costs more to fill than it saves.
// (Measurements: scripts/kernel_lab/HISTORY.md, "iq2_xxs.cu: iq2xxs_grid".)
//
// On the device rows are split (rust/engine/quant/split/): the 64-byte group runs of all
// super-blocks, then the 2-byte d's. Lane l's 16 bytes of chunk c are groups 2 (l & 3) and
// 2 (l & 3) + 1 of super-block 8 c + l / 4.
//
// x comes as 8-bit activations (rust/engine/quant/act8.rs): row r of a product's input, in
// the slot of its n_in floats (byte offset 4 r n_in), holds n_in int8 values q, then n_in / 32
// f32 block scales dx. Every writer of an IQ2_XXS product's input quantizes it so (the host
// for its products, ds4_gather for the routed experts). A group of 32 weights is
// w = s g db with g the lattice bytes (8, 25 or 43, all < 128) and s = +-1, so
// sum w x = db dx (sum g q - 2 sum (g & neg) q), neg the mask of the negative weights' bytes:
// four dp4a each, with no byte arithmetic on the signs. Per group and row:
// acc = fmaf(db * dx, (float)isum, acc). The kernel is bound by instruction issue: on an H200
// (scripts/kernel_lab) twelve 2048 x 4096 products take 25.1 us at one row, 30.8 at two. The
// sign masks, the lattice addresses and the row tests below took a third of the inner loop's
// instructions away, the same bits (Flash steps 8.79 ms against 8.96). (Tried and dropped: a
// sign table, float x; slower.) (Measurements: scripts/kernel_lab/HISTORY.md,
// "iq2_xxs.cu: inner loop".)

// The sign masks of a 7-bit sign index i, half 0 (weights 0..3) and half 1 (weights 4..7): byte
// j is 0xff when bit j of ksigns(i) = i | parity(i) << 7 is set. One multiply moves sign bit j
// onto bit 8 j + 7 (partial products 7 bits apart, which neither overlap nor carry for a 7-bit
// i: half 0 i * (2^7 + 2^14 + 2^21 + 2^28), half 1 bits 4..6 by i * (2^3 + 2^10 + 2^17) and the
// parity added on bit 31), and one byte permute replicates each byte's top bit over it. Computed,
// not looked up: the lattice lookups already keep the shared-memory pipe busy, and a second
// 8-byte lookup per 8 weights made it the kernel's bound (H200, Nsight Compute, twelve 2048 x
// 4096 products at one row: L1/TEX 79% busy with the table, 61% without).
__device__ __forceinline__ u32 iq2_sign_half0(u32 i) {
    u32 m;
    asm("prmt.b32 %0, %1, 0, 0xBA98;" : "=r"(m) : "r"(i * 0x10204080u));
    return m;
}

__device__ __forceinline__ u32 iq2_sign_half1(u32 i) {
    u32 m;
    asm("prmt.b32 %0, %1, 0, 0xBA98;" : "=r"(m) : "r"(i * 0x00020408u + ((u32)__popc(i) << 31)));
    return m;
}

// 4 bytes at shared-memory address a (4-byte aligned).
__device__ __forceinline__ u32 lds_u32(u32 a) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}

// The lattice's three coordinates as bytes 0..2, which the selectors' nibbles pick.
#define IQ2_GRID_BYTES 0x002B1908u

struct FmtIQ2_XXS {
    static constexpr int BLOCK_ELEMS = 256;
    static constexpr int PAY = 64;
    static constexpr int CB = 8;
    // The lattice as byte selectors (256 x 4 bytes, see the top of the file).
    static constexpr int LUT_BYTES = 256 * 4;

    static __device__ __forceinline__ void init_lut(u8* smem, int tid) {
        for (int i = tid; i < 256; i += 32 * MV_WARPS) {
            const u64 g = iq2xxs_grid[i];
            u32 sel = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const u32 b = (u32)(g >> (8 * j)) & 0xffu;
                sel |= (b == 8u ? 0u : b == 25u ? 1u : 2u) << (4 * j);
            }
            ((u32*)smem)[i] = sel;
        }
    }

    static constexpr int PREFETCH = 1;

    typedef ScaleChunk Chunk;

    static __device__ __forceinline__ void load(const u8* row, int nb, int c, int lane, bool vec, Chunk& h) {
        ld_scale_chunk<PAY>(row, nb, c, lane, vec, h);
    }

    template <int NB>
    static __device__ __forceinline__ void dot(const Chunk (&h)[MV_ROWS], int nb, int c, int lane,
                                               const float* __restrict__ x, int n_in, int n,
                                               float (&acc)[MV_ROWS][NB], const u8* lut) {
        if (!mv_lane_in((long long)nb * PAY, c, lane)) {
            return;
        }
        // The lattice's shared-memory address, once: through the generic pointer each lookup
        // paid four instructions to find the shared window.
        const u32 grid = (u32)__cvta_generic_to_shared(lut);
        const int sb = CB * c + (lane >> 2);
        // Row 0 of a batch always exists (a descriptor of no rows returns before the kernel
        // gets here), so its loads and dots carry no test. (The same in the other formats' dots
        // and in mv_store was slower: Flash steps 9.00 against 8.81 ms on an H200.)
        // (Measurements: scripts/kernel_lab/HISTORY.md, "iq2_xxs.cu: dot row 0".)
        float d[MV_ROWS];
#pragma unroll
        for (int q = 0; q < MV_ROWS; q++) {
            d[q] = f16_bits_to_f32(h[q].d);
        }
#pragma unroll
        for (int gg = 0; gg < 2; gg++) {
            const int e0 = 256 * sb + 32 * (2 * (lane & 3) + gg);
            int xi[NB][8];
            float dx[NB];
#pragma unroll
            for (int r = 0; r < NB; r++) {
                if (r == 0 || r < n) {
                    const char* xr = (const char*)(x + (long long)r * n_in);
                    const int4 a = __ldg((const int4*)(xr + e0));
                    const int4 b = __ldg((const int4*)(xr + e0 + 16));
                    xi[r][0] = a.x;
                    xi[r][1] = a.y;
                    xi[r][2] = a.z;
                    xi[r][3] = a.w;
                    xi[r][4] = b.x;
                    xi[r][5] = b.y;
                    xi[r][6] = b.z;
                    xi[r][7] = b.w;
                    dx[r] = __ldg((const float*)(xr + n_in) + (e0 >> 5));
                }
            }
#pragma unroll
            for (int q = 0; q < MV_ROWS; q++) {
                const u32 aux0 = word_of(h[q].v, 2 * gg);
                const u32 aux1 = word_of(h[q].v, 2 * gg + 1);
                const float db = d[q] * (0.5f + u8f(aux1 >> 28)) * 0.25f;
                int sp[NB], sn[NB];
#pragma unroll
                for (int r = 0; r < NB; r++) {
                    sp[r] = 0;
                    sn[r] = 0;
                }
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const u32 i = (aux1 >> (7 * k)) & 127u;
                    const u32 sel = lds_u32(grid + 4u * __byte_perm(aux0, 0u, 0x4440u | (u32)k));
                    const u32 g0 = __byte_perm(IQ2_GRID_BYTES, 0u, sel);
                    const u32 g1 = __byte_perm(IQ2_GRID_BYTES, 0u, sel >> 16);
                    const u32 m0 = iq2_sign_half0(i), m1 = iq2_sign_half1(i);
                    const int n0 = (int)(g0 & m0), n1 = (int)(g1 & m1);
#pragma unroll
                    for (int r = 0; r < NB; r++) {
                        if (r == 0 || r < n) {
                            sp[r] = __dp4a((int)g0, xi[r][2 * k], sp[r]);
                            sp[r] = __dp4a((int)g1, xi[r][2 * k + 1], sp[r]);
                            sn[r] = __dp4a(n0, xi[r][2 * k], sn[r]);
                            sn[r] = __dp4a(n1, xi[r][2 * k + 1], sn[r]);
                        }
                    }
                }
#pragma unroll
                for (int r = 0; r < NB; r++) {
                    if (r == 0 || r < n) {
                        acc[q][r] = fmaf(db * dx[r], (float)(sp[r] - 2 * sn[r]), acc[q][r]);
                    }
                }
            }
        }
    }
};

// Resident blocks a SM of the one- and two-row kernels (MvMinBlocks), -D options for A/B timing
// (DS4_CUDA_DEFINES). The default four (124 and 128 registers) won in the engine (H200, Flash:
// steps 8.81 ms against 8.97 with five and 9.01 with six at one row); in the lab five and six
// were faster only for 160 products at once. Likewise for Q8_0's float-x kernel
// (MV_MIN_BLOCKS_Q8_0_1, q8_0.cu). (Measurements: scripts/kernel_lab/HISTORY.md,
// "iq2_xxs.cu: MV_MIN_BLOCKS_IQ2".)
#ifndef MV_MIN_BLOCKS_IQ2_1
#define MV_MIN_BLOCKS_IQ2_1 MV_MIN_BLOCKS
#endif
#ifndef MV_MIN_BLOCKS_IQ2_2
#define MV_MIN_BLOCKS_IQ2_2 MV_MIN_BLOCKS
#endif
template <>
struct MvMinBlocks<FmtIQ2_XXS, 1> {
    static constexpr int value = MV_MIN_BLOCKS_IQ2_1;
};
template <>
struct MvMinBlocks<FmtIQ2_XXS, 2> {
    static constexpr int value = MV_MIN_BLOCKS_IQ2_2;
};

MVS_KERNELS(iq2_xxs, FmtIQ2_XXS)
