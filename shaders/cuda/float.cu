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

// Rows of x whose float4 loads float_dot4 issues together before using any (DS4_CUDA_DEFINES
// may set MV_XROWS for A/B timing; 1 is the former code). Issued row by row, each load right
// before its row's FMAs (so the SASS of ds4_mv_f16_8 had it), a verify of 8 rows waited for
// sixteen round trips to L2 a chunk, one after another; now two or more are in flight. Only
// the loads move, not the arithmetic: the same bits. 4 registers a row, no spills up to 8
// rows; the one-row kernels (a group of one is the former code) and the 16-row ones (where
// groups spilled: ds4_mv_f16_16 228 bytes of spill loads against 48) keep their SASS. On an
// H200 (Flash at a 2100-token context) greedy verifies of 8 rows took 22.73 to 22.80 ms against
// 23.34 to 23.38, decode steps unchanged. (Tried and dropped: the same grouping in Q8_0's
// float-x kernel, scaled_dot4 in common.cuh; slower.) (Measurements:
// scripts/kernel_lab/HISTORY.md, "float.cu: MV_XROWS".)
#ifndef MV_XROWS
#define MV_XROWS 4
#endif
template <int NB>
struct MvXRows {
    static constexpr int value = NB > 8 ? 1 : NB < MV_XROWS ? NB : MV_XROWS;
};

// Adds sum_i w[i] * x[r][e0 + i] (i < 4) to each row's accumulators, one fmaf per element,
// the x of MvXRows rows loaded before their FMAs.
template <int NB>
__device__ __forceinline__ void float_dot4(const float (&wf)[MV_ROWS][4], const float* __restrict__ x, int n_in,
                                           int n, int e0, float (&acc)[MV_ROWS][NB]) {
    constexpr int XR = MvXRows<NB>::value;
#pragma unroll
    for (int r0 = 0; r0 < NB; r0 += XR) {
        float4 xv[XR];
        if constexpr (XR > 1) {
#pragma unroll
            for (int i = 0; i < XR; i++) {
                if (r0 + i < n) {
                    xv[i] = __ldg((const float4*)(x + (long long)(r0 + i) * n_in + e0));
                }
            }
        }
#pragma unroll
        for (int i = 0; i < XR; i++) {
            const int r = r0 + i;
            if (r < n) {
                if constexpr (XR == 1) {
                    xv[0] = __ldg((const float4*)(x + (long long)r * n_in + e0));
                }
#pragma unroll
                for (int q = 0; q < MV_ROWS; q++) {
                    float a = acc[q][r];
                    a = fmaf(wf[q][0], xv[i].x, a);
                    a = fmaf(wf[q][1], xv[i].y, a);
                    a = fmaf(wf[q][2], xv[i].z, a);
                    a = fmaf(wf[q][3], xv[i].w, a);
                    acc[q][r] = a;
                }
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
