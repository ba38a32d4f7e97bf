// F32, F16 and BF16 weights: plain little-endian floats, run by matvec_split as a "format"
// of 1-element blocks with no header (the payload is the row). Lane l's 16 bytes of chunk c
// hold 4 (F32) or 8 (F16, BF16) consecutive elements. Rows have n_in % 4 == 0 (the host
// runs other shapes on the CPU); when n_in % 8 == 4 the last lane of a half-precision row
// holds 4 elements, and the bytes it loads past the row are not used.

// The chunk of a float format: lane l's 16 bytes, loaded with the next chunk in flight.
#define MV_FLOAT_CHUNK                                                                                        \
    MV_NO_LUT                                                                                                 \
    static constexpr int PREFETCH = 1;                                                                        \
    struct Chunk {                                                                                            \
        uint4 v;                                                                                              \
    };                                                                                                        \
    static __device__ __forceinline__ void load(const u8* row, int nb, int c, int lane, bool vec, Chunk& ch) { \
        ld_lane16(row, (long long)nb * PAY, c, lane, vec, ch.v);                                              \
    }

// Adds sum_i w[i] * x[r][e0 + i] (i < 4) to each row's accumulators, one fmaf per element.
template <int NB>
__device__ __forceinline__ void float_dot4(const float (&wf)[MV_ROWS][4], const float* __restrict__ x, int n_in,
                                           int n, int e0, float (&acc)[MV_ROWS][NB]) {
#pragma unroll
    for (int r = 0; r < NB; r++) {
        if (r < n) {
            const float4 xv = __ldg((const float4*)(x + (long long)r * n_in + e0));
#pragma unroll
            for (int q = 0; q < MV_ROWS; q++) {
                float a = acc[q][r];
                a = fmaf(wf[q][0], xv.x, a);
                a = fmaf(wf[q][1], xv.y, a);
                a = fmaf(wf[q][2], xv.z, a);
                a = fmaf(wf[q][3], xv.w, a);
                acc[q][r] = a;
            }
        }
    }
}

struct FmtF32 {
    static constexpr int BLOCK_ELEMS = 1;
    static constexpr int PAY = 4;
    static constexpr int CB = 128;
    MV_FLOAT_CHUNK

    template <int NB>
    static __device__ __forceinline__ void dot(const Chunk (&v)[MV_ROWS], int nb, int c, int lane,
                                               const float* __restrict__ x, int n_in, int n,
                                               float (&acc)[MV_ROWS][NB], const u8*) {
        if (!mv_lane_in((long long)nb * PAY, c, lane)) {
            return;
        }
        float wf[MV_ROWS][4];
#pragma unroll
        for (int q = 0; q < MV_ROWS; q++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                wf[q][i] = __uint_as_float(word_of(v[q].v, i));
            }
        }
        float_dot4<NB>(wf, x, n_in, n, 128 * c + 4 * lane, acc);
    }
};

// F16 (BF = false) and BF16 (BF = true).
template <bool BF>
struct FmtHalf {
    static constexpr int BLOCK_ELEMS = 1;
    static constexpr int PAY = 2;
    static constexpr int CB = 256;
    MV_FLOAT_CHUNK

    static __device__ __forceinline__ float half_f(u32 h) {
        return BF ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
    }

    template <int NB>
    static __device__ __forceinline__ void dot(const Chunk (&v)[MV_ROWS], int nb, int c, int lane,
                                               const float* __restrict__ x, int n_in, int n,
                                               float (&acc)[MV_ROWS][NB], const u8*) {
        if (!mv_lane_in((long long)nb * PAY, c, lane)) {
            return;
        }
        const int e0 = 256 * c + 8 * lane;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            if (j == 0 || e0 + 4 < n_in) {
                float wf[MV_ROWS][4];
#pragma unroll
                for (int q = 0; q < MV_ROWS; q++) {
                    const u32 a = word_of(v[q].v, 2 * j);
                    const u32 b = word_of(v[q].v, 2 * j + 1);
                    wf[q][0] = half_f(a & 0xffffu);
                    wf[q][1] = half_f(a >> 16);
                    wf[q][2] = half_f(b & 0xffffu);
                    wf[q][3] = half_f(b >> 16);
                }
                float_dot4<NB>(wf, x, n_in, n, e0 + 4 * j, acc);
            }
        }
    }
};

typedef FmtHalf<false> FmtF16;
typedef FmtHalf<true> FmtBF16;

MVS_KERNELS(f32, FmtF32)
MVS_KERNELS(f16, FmtF16)
MVS_KERNELS(bf16, FmtBF16)
