// IQ2_XXS: super-blocks of 256 weights, 66 bytes in GGUF: f16 d, then 8 groups of 32 weights,
// each two little-endian u32 words. Word 0 holds four 8-bit indices into the lattice
// `iq2xxs_grid` (8 coordinates each); word 1 four 7-bit sign indices (bits 0..28) and a 4-bit
// scale s (bits 28..32). db = d * (0.5 + s) * 0.25; w = +-db * grid coordinate
// (rust/engine/quant/iq2_xxs.rs). The sign table ksigns_iq2xs is `i | parity(i) << 7`,
// computed here with popc. `iq2xxs_grid` is emitted by the host from quant/tables.rs into
// the program, before this file; each block copies it to shared memory (random per-lane
// indices into constant memory would serialize, and into global memory touch many lines).
//
// On the device rows are split (rust/engine/quant/split/): the 64-byte group runs of all
// super-blocks, then the 2-byte d's. Lane l's 16 bytes of chunk c are groups 2 (l & 3) and
// 2 (l & 3) + 1 of super-block 8 c + l / 4. Per 4 weights: sum (+-grid) * x in an fmaf
// chain, then acc += db * sum.

struct FmtIQ2_XXS {
    static constexpr int BLOCK_ELEMS = 256;
    static constexpr int PAY = 64;
    static constexpr int CB = 8;
    static constexpr int LUT_BYTES = 256 * 8;

    static __device__ __forceinline__ void init_lut(u8* smem, int tid) {
        for (int i = tid; i < 256; i += 32 * MV_WARPS) {
            ((u64*)smem)[i] = iq2xxs_grid[i];
        }
    }

    static constexpr int PREFETCH = 1;

    typedef ScaleChunk Chunk;

    static __device__ __forceinline__ void load(const u8* row, int nb, int c, int lane, bool vec, Chunk& h) {
        ld_scale_chunk<PAY>(row, nb, c, lane, vec, h);
    }

    // Where element i of a row of x (i a multiple of 4; the row's length a multiple of 2048)
    // lies in lane order: i is in lane l = (i % 2048) / 64's run of chunk c = i / 2048, as its
    // float4 k = (i % 64) / 4, which is at 2048 c + 128 k + 4 l.
    static __device__ __forceinline__ int x_lane_pos(int i) {
        const int ii = i & 2047;
        return (i - ii) + 128 * ((ii & 63) >> 2) + 4 * (ii >> 6);
    }

    template <int NB, bool LANES>
    static __device__ __forceinline__ void dot(const Chunk (&h)[MV_ROWS], int nb, int c, int lane,
                                               const float* __restrict__ x, int n_in, int n,
                                               float (&acc)[MV_ROWS][NB], const u8* lut) {
        if (!mv_lane_in((long long)nb * PAY, c, lane)) {
            return;
        }
        const int sb = CB * c + (lane >> 2);
        float d[MV_ROWS];
#pragma unroll
        for (int q = 0; q < MV_ROWS; q++) {
            d[q] = f16_bits_to_f32(h[q].d);
        }
#pragma unroll
        for (int gg = 0; gg < 2; gg++) {
            const int e0 = 256 * sb + 32 * (2 * (lane & 3) + gg);
            float db[MV_ROWS];
            u32 aux0[MV_ROWS], aux1[MV_ROWS];
#pragma unroll
            for (int q = 0; q < MV_ROWS; q++) {
                aux0[q] = word_of(h[q].v, 2 * gg);
                aux1[q] = word_of(h[q].v, 2 * gg + 1);
                db[q] = d[q] * (0.5f + u8f(aux1[q] >> 28)) * 0.25f;
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                u64 g[MV_ROWS];
                u32 sg[MV_ROWS];
#pragma unroll
                for (int q = 0; q < MV_ROWS; q++) {
                    g[q] = ((const u64*)lut)[(aux0[q] >> (8 * k)) & 0xffu];
                    const u32 si = (aux1[q] >> (7 * k)) & 127u;
                    sg[q] = si | ((__popc(si) & 1u) << 7);
                }
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    float wf[MV_ROWS][4];
#pragma unroll
                    for (int q = 0; q < MV_ROWS; q++) {
                        const u32 coords = (u32)(g[q] >> (32 * half));
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            const float a = byte_f(coords, i);
                            const int bit = 4 * half + i;
                            wf[q][i] = __uint_as_float(__float_as_uint(a) ^ ((sg[q] << (31 - bit)) & 0x80000000u));
                        }
                    }
                    // Lane order: this float4 is the lane's (8 gg + 2 k + half)-th of chunk c, i.e.
                    // x_lane_pos(e0 + 8 k + 4 half) written out so that it folds to constants.
                    const int e = LANES ? 2048 * c + 128 * (8 * gg + 2 * k + half) + 4 * lane : e0 + 8 * k + 4 * half;
                    scaled_dot4<NB>(wf, db, x, n_in, n, e, acc);
                }
            }
        }
    }
};

MVS_KERNELS(iq2_xxs, FmtIQ2_XXS)
// x in lane order (matvec_split_lanes), for the routed experts' gate and up products, whose
// chunks hold one or two batch rows (rust/engine/backend/cuda/decode EXPERT_CHUNK).
MVS_LANES_KERNEL(iq2_xxs_lanes, FmtIQ2_XXS, 1)
MVS_LANES_KERNEL(iq2_xxs_lanes, FmtIQ2_XXS, 2)
