// ds4 CUDA kernels of the device-resident decode: norms, hyper-connections, query/key
// finishing, SwiGLU and layout moves (rust/engine/backend/cuda/decode/). Every kernel computes
// each batch row with the same code and reduction order whatever the batch (row invariance),
// and follows the CPU reference (rust/engine/model/) operation for operation; it agrees with
// it to rounding (the CPU sums in other orders and uses libm's exp).
//
// Conventions of all decode kernels:
// - `step` points at the step's parameters in device memory: step[0] = position of batch row
//   0 (row r is at step[0] + r), step[1] = batch rows n, step[2 + r] = token id of row r.
// - Matrices are row-major float arrays; "[n, w]" means n rows of w floats.
// - Compiled with --fmad=false: write fmaf where a fused multiply-add is meant.

// ---- helpers shared by the decode kernels (decode_attn.cu and decode_moe.cu use them too)

// The block-wide sum of one double per thread, in a fixed tree order (the same for every
// launch of the same block size). `red` is shared scratch of blockDim.x / 32 doubles. Every
// thread gets the sum. Ends with a barrier, so `red` may be reused afterwards.
__device__ __forceinline__ double ds4_block_sum_f64(double v, double* red) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    const int warp = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) {
        red[warp] = v;
    }
    __syncthreads();
    double s = 0.0;
    for (int i = 0; i < nw; i++) {
        s += red[i];
    }
    __syncthreads();
    return s;
}

// The block-wide max of one float per thread (every thread gets it). `red` as above (floats).
__device__ __forceinline__ float ds4_block_max(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    const int warp = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) {
        red[warp] = v;
    }
    __syncthreads();
    float m = red[0];
    for (int i = 1; i < nw; i++) {
        m = fmaxf(m, red[i]);
    }
    __syncthreads();
    return m;
}

// The RMS scale of x[0..width) as the CPU computes it (rust/engine/backend/cpu.rs
// rms_scale): the mean of squares accumulated in double, rounded to float, then
// 1 / sqrt(mean + eps). Block-wide; every thread gets it. `red`: blockDim.x / 32 doubles.
__device__ __forceinline__ float ds4_rms_scale(const float* x, int width, float eps, double* red) {
    double ss = 0.0;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const double v = (double)x[i];
        ss += v * v;
    }
    ss = ds4_block_sum_f64(ss, red);
    const float mean = (float)(ss / (double)width);
    return 1.0f / sqrtf(mean + eps);
}

// Rotary embedding of pair i (0 <= i < rope_dim / 2) of a vector whose last rope_dim features
// are rotary (`v` points at the vector, `width` its length), at position pos, inverse when
// `inverse`: as rust/engine/model/rope.rs (angle = f32 product inv_freq * pos, sin and cos in
// double, rounded to float).
__device__ __forceinline__ void ds4_rope_pair(float* v, int width, const float* inv_freq, int rope_dim, int pos,
                                              int i, bool inverse) {
    const float ang = inv_freq[i] * (float)pos;
    const double a = (double)ang;
    const float c = (float)cos(a);
    float s = (float)sin(a);
    if (inverse) {
        s = -s;
    }
    float* p = v + (width - rope_dim) + 2 * i;
    const float x0 = p[0];
    const float x1 = p[1];
    p[0] = x0 * c + (-x1) * s;
    p[1] = x1 * c + x0 * s;
}

// Rounds to half precision and back (round to nearest even), as half::f16::from_f32.
__device__ __forceinline__ float ds4_round_f16(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Storage rounding of a stored row value: mode 0 keeps f32, mode 1 rounds through f16
// (KvPrecision::F32 / F16; FP8 is not run on the device).
__device__ __forceinline__ float ds4_round_store(float x, int mode) {
    return mode == 1 ? ds4_round_f16(x) : x;
}

// ---- kernels (see rust/engine/backend/cuda/decode/ for who launches what)
