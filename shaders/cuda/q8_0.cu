// Q8_0: blocks of 32 weights, 34 bytes in GGUF: an f16 scale d, then 32 signed bytes q;
// w = q * d (rust/engine/quant/q8_0.rs). On the device rows are split
// (rust/engine/quant/split/): the 32-byte quant runs of all blocks, then the 2-byte scales.
// Lane l's 16 bytes of chunk c are half (l & 1) of block 16 c + l / 2: elements
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

MVS_KERNELS(q8_0, FmtQ8_0)
