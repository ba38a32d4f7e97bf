// Q2_K: super-blocks of 256 weights, 84 bytes in GGUF: 16 scale bytes (scale in the low
// nibble, min in the high nibble), 64 bytes of 2-bit quants qs, then f16 d and f16 dmin.
// Weight 128 h + 32 s + l is (qs[32 h + l] >> 2 s) & 3 with scale byte 8 h + 2 s + (l >= 16);
// w = (d * sc) * q - dmin * m (rust/engine/quant/q2_k.rs).
//
// On the device rows are split (rust/engine/quant/split/): the qs of all super-blocks, then
// per super-block 20 header bytes: the scale bytes reordered so that byte 8 h + 4 f + s is
// the scale of half h, shift s, quants 16 f..16 f + 16, then d and dmin. Lane l's 16 bytes of
// chunk c are qs[16 (l & 3)..] of super-block 8 c + l / 4: half h = (l & 3) / 2, quants
// 16 f.. with f = l & 1, all four shifts: 64 weights, four scales (one 32-bit word).
// Per shift and 4 weights: acc += dl * sum(q * x) - ml * sum(x); sum(x) serves all rows.

struct FmtQ2_K {
    static constexpr int BLOCK_ELEMS = 256;
    static constexpr int PAY = 64;
    static constexpr int CB = 8;
    MV_NO_LUT

    // Rows of expert products are short (one or two chunks): more resident warps pay more
    // than holding the next chunk (a Q2_K chunk and its headers are 6 registers per row).
    static constexpr int PREFETCH = 0;

    struct Chunk {
        uint4 v;
        u32 sc;  // the four scale bytes of the lane's half and quants, shift s in byte s
        u32 dd;  // the f16 bits of d (low half) and dmin (high half)
    };

    static __device__ __forceinline__ void load(const u8* row, int nb, int c, int lane, bool vec, Chunk& h) {
        const long long pay = (long long)nb * PAY;
        ld_lane16(row, pay, c, lane, vec, h.v);
        if (mv_lane_in(pay, c, lane)) {
            const u8* hp = row + pay + 20ll * (CB * c + (lane >> 2));
            h.sc = ld_u32_a2(hp + 8 * ((lane & 3) >> 1) + 4 * (lane & 1));
            h.dd = ld_u32_a2(hp + 16);
        }
    }

    template <int NB>
    static __device__ __forceinline__ void dot(const Chunk (&hh)[MV_ROWS], int nb, int c, int lane,
                                               const float* __restrict__ x, int n_in, int n,
                                               float (&acc)[MV_ROWS][NB], const u8*) {
        if (!mv_lane_in((long long)nb * PAY, c, lane)) {
            return;
        }
        const int sb = CB * c + (lane >> 2);
        const int e0 = 256 * sb + 128 * ((lane & 3) >> 1) + 16 * (lane & 1);
        u32 sc[MV_ROWS];
        float d[MV_ROWS], dmin[MV_ROWS];
#pragma unroll
        for (int q = 0; q < MV_ROWS; q++) {
            sc[q] = hh[q].sc;
            d[q] = f16_bits_to_f32(hh[q].dd & 0xffffu);
            dmin[q] = f16_bits_to_f32(hh[q].dd >> 16);
        }
#pragma unroll
        for (int s = 0; s < 4; s++) {
            float dl[MV_ROWS], nml[MV_ROWS];
#pragma unroll
            for (int q = 0; q < MV_ROWS; q++) {
                const u32 b = (sc[q] >> (8 * s)) & 0xffu;
                dl[q] = d[q] * u8f(b & 15u);
                nml[q] = 0.0f - dmin[q] * u8f(b >> 4);
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float qf[MV_ROWS][4];
#pragma unroll
                for (int q = 0; q < MV_ROWS; q++) {
                    const u32 qw = (word_of(hh[q].v, j) >> (2 * s)) & 0x03030303u;
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        qf[q][i] = byte_f(qw, i);
                    }
                }
#pragma unroll
                for (int r = 0; r < NB; r++) {
                    if (r < n) {
                        const float4 xv = __ldg((const float4*)(x + (long long)r * n_in + e0 + 32 * s + 4 * j));
                        float sx = xv.x + xv.y;
                        sx = sx + xv.z;
                        sx = sx + xv.w;
#pragma unroll
                        for (int q = 0; q < MV_ROWS; q++) {
                            float t = qf[q][0] * xv.x;
                            t = fmaf(qf[q][1], xv.y, t);
                            t = fmaf(qf[q][2], xv.z, t);
                            t = fmaf(qf[q][3], xv.w, t);
                            float a = fmaf(dl[q], t, acc[q][r]);
                            acc[q][r] = fmaf(nml[q], sx, a);
                        }
                    }
                }
            }
        }
    }
};

MVS_KERNELS(q2_k, FmtQ2_K)
