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

// The cosine and sine of rotary pair i's angle at position pos: as rust/engine/model/rope.rs,
// angle = f32 product inv_freq * pos, sin and cos in double, rounded to float.
__device__ __forceinline__ void ds4_rope_cs(const float* inv_freq, int pos, int i, float& c, float& s) {
    const float ang = inv_freq[i] * (float)pos;
    const double a = (double)ang;
    c = (float)cos(a);
    s = (float)sin(a);
}

// Rotates the pair p[0], p[1] by the angle of cosine c and sine s.
__device__ __forceinline__ void ds4_rope_rotate(float* p, float c, float s) {
    const float x0 = p[0];
    const float x1 = p[1];
    p[0] = x0 * c + (-x1) * s;
    p[1] = x1 * c + x0 * s;
}

// Rotary embedding of pair i (0 <= i < rope_dim / 2) of a vector whose last rope_dim features
// are rotary (`v` points at the vector, `width` its length), at position pos, inverse when
// `inverse` (ds4_rope_cs's angle, negated).
__device__ __forceinline__ void ds4_rope_pair(float* v, int width, const float* inv_freq, int rope_dim, int pos,
                                              int i, bool inverse) {
    float c;
    float s;
    ds4_rope_cs(inv_freq, pos, i, c, s);
    if (inverse) {
        s = -s;
    }
    ds4_rope_rotate(v + (width - rope_dim) + 2 * i, c, s);
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

// The largest |v| of the warp's 32 values, NaN if any is NaN (act8.rs quantize_row's max).
__device__ __forceinline__ float ds4_warp_amax(float v) {
    float m = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float t = __shfl_xor_sync(0xffffffffu, m, o);
        m = (t > m || t != t || m != m) ? (m != m ? m : t) : m;
    }
    return m;
}

// One block of 32 values as 8-bit activations (rust/engine/quant/act8.rs), lane l holding
// value l (every lane of the warp calls this): q[l] = round(v * (1 / dq)) (0 when dq is 0),
// *scale = dq = amax / 127, with amax = max |v|: the host's float operations, so the same
// bytes.
__device__ __forceinline__ void ds4_act8_block(float v, char* __restrict__ q, float* __restrict__ scale) {
    const int lane = threadIdx.x & 31;
    const float dq = ds4_warp_amax(v) / 127.0f;
    const float id = dq == 0.0f ? 0.0f : 1.0f / dq;
    const float r = roundf(v * id);
    // NaN -> 0 as Rust's saturating cast (|r| <= 127 otherwise).
    q[lane] = (char)(r != r ? 0 : (int)fminf(fmaxf(r, -128.0f), 127.0f));
    if (lane == 0) {
        *scale = dq;
    }
}

// ds4_warp_amax's step for two values: a NaN stays, else the larger.
__device__ __forceinline__ float ds4_amax2(float m, float t) {
    return (t > m || t != t || m != m) ? (m != m ? m : t) : m;
}

// ds4_act8_block four values a lane (the prompts' wide kernels, DS4_CUDA_WIDE=1): the eight
// lanes of group l / 8 hold a block of 32, lane l its values 4 (l % 8) .. + 3 (every lane of the
// warp calls this; `ok` the same for a group's eight lanes, whose block is written only when
// it holds). The block's largest |v| is exact in any order of the steps, and each value then
// gets ds4_act8_block's operations, so the bytes are the same (a block with a NaN: every byte
// 0 and a NaN scale either way). q: the block's 32 bytes; scale: its scale's slot.
__device__ __forceinline__ void ds4_act8_quad(float4 v, bool ok, char* __restrict__ q, float* __restrict__ scale) {
    const int lane = threadIdx.x & 31;
    float m = ds4_amax2(ds4_amax2(fabsf(v.x), fabsf(v.y)), ds4_amax2(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
        m = ds4_amax2(m, __shfl_xor_sync(0xffffffffu, m, o));
    }
    const float dq = m / 127.0f;
    const float id = dq == 0.0f ? 0.0f : 1.0f / dq;
    const float e[4] = {v.x, v.y, v.z, v.w};
    u32 packed = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float r = roundf(e[j] * id);
        const int b = r != r ? 0 : (int)fminf(fmaxf(r, -128.0f), 127.0f);
        packed |= (u32)(u8)(char)b << (8 * j);
    }
    if (ok) {
        *(u32*)(q + 4 * (lane & 7)) = packed;
        if ((lane & 7) == 0) {
            *scale = dq;
        }
    }
}

// ---- kernels (see rust/engine/backend/cuda/decode/ for who launches what)

// Every kernel below runs one batch row per blockIdx.y (or blockIdx.x where the grid says
// (n)); its block size must be a multiple of 32 of at most 1024 (the host launches 256). The
// static `red` scratch holds one double per warp.

// Values per thread that the RMS norms keep in registers between their two passes.
#define DS4_RMS_REGS 16

// ds4_rms_scale with x[threadIdx.x + k * blockDim.x] (k < DS4_RMS_REGS) loaded into v first:
// all of a thread's loads are in flight at once (the one-at-a-time loop waited for each), and
// the second pass reads them from registers. Same sum, in the same order, as ds4_rms_scale.
__device__ __forceinline__ float ds4_rms_scale_regs(const float* x, int width, float eps, double* red,
                                                    float (&v)[DS4_RMS_REGS]) {
#pragma unroll
    for (int k = 0; k < DS4_RMS_REGS; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        v[k] = i < width ? x[i] : 0.0f;
    }
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < DS4_RMS_REGS; k++) {
        if (threadIdx.x + k * blockDim.x < width) {
            const double d = (double)v[k];
            ss += d * d;
        }
    }
    for (int i = threadIdx.x + DS4_RMS_REGS * blockDim.x; i < width; i += blockDim.x) {
        const double d = (double)x[i];
        ss += d * d;
    }
    ss = ds4_block_sum_f64(ss, red);
    const float mean = (float)(ss / (double)width);
    return 1.0f / sqrtf(mean + eps);
}

// y = w * (x * rms_scale(x)) (w = nullptr: y = x * rms_scale(x)) of one row, v from
// ds4_rms_scale_regs; the caller has synchronized after every read of x (x may be y).
__device__ __forceinline__ void ds4_rms_store(const float* x, float* y, const float* w, int width, float s,
                                              const float (&v)[DS4_RMS_REGS]) {
#pragma unroll
    for (int k = 0; k < DS4_RMS_REGS; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < width) {
            y[i] = w ? w[i] * (v[k] * s) : v[k] * s;
        }
    }
    for (int i = threadIdx.x + DS4_RMS_REGS * blockDim.x; i < width; i += blockDim.x) {
        y[i] = w ? w[i] * (x[i] * s) : x[i] * s;
    }
}

// y = x * rms_scale(x), row by row (rust/engine/backend/cpu.rs rms_norm_plain). Grid (n);
// x and y are [n, width] and may be the same buffer.
extern "C" __global__ void ds4_rms_plain(const float* x, float* y, int width, float eps) {
    ds4_grid_lead();
    __shared__ double red[32];
    const long long off = (long long)blockIdx.x * width;
    float v[DS4_RMS_REGS];
    const float s = ds4_rms_scale_regs(x + off, width, eps, red, v);
    ds4_rms_store(x + off, y + off, nullptr, width, s, v);
}

// y = w * (x * rms_scale(x)), row by row (cpu.rs rms_norm: the weight after the scaling).
// Grid (n); x and y are [n, width] and may be the same buffer; w has width floats.
extern "C" __global__ void ds4_rms_weight(const float* x, float* y, const float* w, int width, float eps) {
    ds4_grid_lead();
    __shared__ double red[32];
    const long long off = (long long)blockIdx.x * width;
    float v[DS4_RMS_REGS];
    const float s = ds4_rms_scale_regs(x + off, width, eps, red, v);
    ds4_rms_store(x + off, y + off, w, width, s, v);
}

// ---- A product and the small step after it in one launch (the "tails", opt-in switches)
//
// A product's launch whose last block to finish does what the next, one-block launch would
// (decode/program.rs `tail_kernel`): that launch's dependent wait and SM slot are spared. The
// product's blocks are the plain kernel's (matvec_split), so its outputs are the same bits.

// Whether this block is the last of the launch to get here (every thread of every block of the
// launch calls it, once): each block's writes are fenced, then counted on `done`; the last
// block, which then sees every other block's writes, re-arms the count (zero between
// launches) and gets true. What it reads of the others' writes it must read from L2 (__ldcg),
// never through the read-only path.
__device__ __forceinline__ bool ds4_last_block(int* done) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(done, 1) == (int)(gridDim.x * gridDim.y * gridDim.z) - 1;
    }
    __syncthreads();
    if (last == 0) {
        return false;
    }
    __threadfence();
    if (threadIdx.x == 0) {
        *done = 0;
    }
    return true;
}

// ds4_rms_weight's row x -> y (y = w * (x * rms_scale(x)), y may be x) as a block of `vt`
// threads computes it (a multiple of 32 up to 1024: the host's launch of it), by a block of any
// multiple of 32 threads: warp j of this block takes the virtual warps j, j + its warps, ...;
// each virtual thread's squares in double in index order, each virtual warp's butterfly, then
// the warps' sums in order, as ds4_rms_scale_regs and ds4_block_sum_f64 add them: the same
// bits. x is read from L2 (written by other blocks of the launch).
__device__ __forceinline__ void ds4_rms_weight_as(const float* x, float* y, const float* w, int width, float eps,
                                                  int vt) {
    __shared__ double red[32];
    const int lane = threadIdx.x & 31;
    const int nvw = vt >> 5;
    for (int vw = threadIdx.x >> 5; vw < nvw; vw += blockDim.x >> 5) {
        double ss = 0.0;
        for (int i = 32 * vw + lane; i < width; i += vt) {
            const double d = (double)__ldcg(x + i);
            ss += d * d;
        }
        for (int o = 16; o > 0; o >>= 1) {
            ss += __shfl_xor_sync(0xffffffffu, ss, o);
        }
        if (lane == 0) {
            red[vw] = ss;
        }
    }
    __syncthreads();
    double ss = 0.0;
    for (int i = 0; i < nvw; i++) {
        ss += red[i];
    }
    const float mean = (float)(ss / (double)width);
    const float s = 1.0f / sqrtf(mean + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        y[i] = w[i] * (__ldcg(x + i) * s);
    }
}

// ds4_mv_<NAME>_1_norm (DS4_CUDA_NORM_TAIL=1): a one-row launch of products as ds4_mv_<NAME>_1
// runs it (the attention site's q_a and kv), then, in its last block, the norm of q_a's row
// in place as ds4_rms_weight launched with `vt` threads would (x = y: q_a's output, w: the
// q_a norm's weight, width its rows). Arguments: ds4_mv_*'s, then x, w, width, eps, vt and
// `done` (one int, zero between launches).
#define NORM_TAIL_KERNEL(NAME, F)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * MV_WARPS, (MvMinBlocks<F, 1>::value))                         \
        ds4_mv_##NAME##_1_norm(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters, int early,   \
                               float* x, const float* __restrict__ w, int width, float eps, int vt,                  \
                               int* __restrict__ done) {                                                             \
        extern __shared__ __align__(16) u8 smem[];                                                                   \
        matvec_split<F, 1>(descs, count, counters, smem, early);                                                     \
        if (ds4_last_block(done)) {                                                                                  \
            if (vt < 32 || vt > 1024 || (vt & 31) != 0) {                                                            \
                __trap();                                                                                            \
            }                                                                                                        \
            ds4_rms_weight_as(x, x, w, width, eps, vt);                                                              \
        }                                                                                                            \
    }

NORM_TAIL_KERNEL(f32, FmtF32)
NORM_TAIL_KERNEL(f16, FmtF16)
NORM_TAIL_KERNEL(bf16, FmtBF16)
NORM_TAIL_KERNEL(q8_0, FmtQ8_0)

// The MTP block's input norms (model/drafting.rs mtp_inputs) of pair p = blockIdx.y, one row
// a block: blocks 0..hc-1 the streams h [n, hc, d] with the weight hnorm, block hc the token's
// embedding e [n, d] with enorm. cat == 0 (e_proj and h_proj apart): the streams' norms to hn
// [n, hc, d], the embedding's to en [n, d]. cat == 1 (one [2d -> d] eh_proj): hn gets hc rows
// of 2d a pair, [enorm(e); hnorm(h_s)]. Grid (hc + 1, n), up to 1024 threads (wide(d)):
// without the bound the compiler gave it more registers than 512 threads may hold (MID's first
// run failed the graph's instantiation with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES).
extern "C" __global__ void __launch_bounds__(1024)
    ds4_mtp_in(const float* h, const float* e, const float* hnorm, const float* enorm, float* hn, float* en, int hc,
               int d, int cat, float eps) {
    ds4_grid_lead();
    __shared__ double red[32];
    const int r = blockIdx.x;
    const long long pr = blockIdx.y;
    h += pr * hc * d;
    e += pr * d;
    hn += pr * hc * (cat ? 2 : 1) * d;
    en += pr * d;
    const bool emb = r == hc;
    const float* x = emb ? e : h + (long long)r * d;
    float v[DS4_RMS_REGS];
    const float s = ds4_rms_scale_regs(x, d, eps, red, v);
    if (!cat) {
        ds4_rms_store(x, emb ? en : hn + (long long)r * d, emb ? enorm : hnorm, d, s, v);
    } else if (!emb) {
        ds4_rms_store(x, hn + (long long)r * 2 * d + d, hnorm, d, s, v);
    } else {
        for (int q = 0; q < hc; q++) {
            ds4_rms_store(x, hn + (long long)q * 2 * d, enorm, d, s, v);
        }
    }
}

// DSpark's window input (rust/engine/model/forward.rs mean_of_streams, in its order): row r's
// slice j of cat [n, k, d] is the mean of the hc streams of row r in capture slot j, the slots
// `slot` floats apart, each [n, hc, d]. Grid (ceil(d / 256), k, n), 256 threads.
extern "C" __global__ void ds4_mean_streams(const float* capture, int slot, float* cat, int k, int hc, int d) {
    ds4_grid_lead();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int j = blockIdx.y;
    const long long r = blockIdx.z;
    if (i < d) {
        const float* x = capture + (long long)j * slot + r * hc * d + i;
        float acc = 0.0f;
        for (int s = 0; s < hc; s++) {
            acc += x[(long long)s * d];
        }
        cat[(r * k + j) * d + i] = acc / (float)hc;
    }
}

// DSpark's Markov head input of block row r (rust/engine/model/drafting.rs dspark_choose):
// cat = [h_r; W1[prev]], prev the token before row r (the anchor, step[2], for row 0; else
// row r - 1's argmax, ids[r - 1] without its flag), h [n, d] the head's hidden rows, w1 the
// Markov embedding table as floats [vocab, rank]. Grid ((d + rank) / 256).
extern "C" __global__ void ds4_markov_in(const float* w1, int rank, const int* step, const unsigned* ids, int r,
                                         const float* h, int d, float* cat) {
    ds4_grid_lead();
    const long long prev = r == 0 ? (long long)step[2] : (long long)(ids[r - 1] & 0x7fffffffu);
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < d) {
        cat[i] = h[(long long)r * d + i];
    } else if (i < d + rank) {
        cat[i] = w1[prev * rank + (i - d)];
    }
}

// x[r, i] += v[r / group, i] for the rows r < rows of x [rows, width], v [rows / group, width]
// (the MTP inputs: each pair's hc h_proj rows plus its e_proj row; DSpark's Markov bias on a
// copy of a row's logits, group 1). Grid (rows * width / 256).
extern "C" __global__ void ds4_add_rows(float* x, const float* v, int rows, int width, int group) {
    ds4_grid_lead();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long long)rows * width) {
        x[i] += v[i / ((long long)group * width) * width + i % width];
    }
}

// 1 / (1 + e^-x) (cpu.rs sigmoid).
__device__ __forceinline__ float ds4_sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// Most hyper-connection streams the kernels below handle.
#define DS4_HC_MAX 8

// Collapse values per thread that ds4_hc_pre keeps in registers for its fused norm.
#define DS4_HC_REGS 8

// Most streams ds4_hc_pre handles: its mixing matrix (hc * hc) fits one warp.
#define DS4_HC_PRE_MAX 5

// The HC elements first, first + step, ... of a line of comb, held by warp 0 (lane k holds
// element k; every lane calls this).
template <int HC>
__device__ __forceinline__ void hc_line(float v, int first, int step, float (&e)[HC]) {
#pragma unroll
    for (int j = 0; j < HC; j++) {
        e[j] = __shfl_sync(0xffffffffu, v, first + j * step);
    }
}

// Sinkhorn (hyper.rs sinkhorn) on comb in warp 0, lane k < HC * HC holding element
// k = ci * HC + cj in v (the other lanes 0, which they keep): one column normalization, then
// iters - 1 rounds of row then column normalization; each divides an element by the sum of its
// line (in index order) + hc_eps. No iteration at all for iters = 0.
template <int HC>
__device__ __forceinline__ float hc_sinkhorn_warp(float v, int ci, int cj, float hc_eps, int iters) {
    float e[HC];
    auto normalize = [&](int first, int step) {
        hc_line<HC>(v, first, step, e);
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < HC; j++) {
            s += e[j];
        }
        s += hc_eps;
        v = v / s;  // lanes past HC * HC hold 0 and keep it (no divergent branch)
    };
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            normalize(ci * HC, 1);
        }
        normalize(cj, HC);
    }
    return v;
}

// Warp 0's part of ds4_hc_pre (every lane calls it): mix[k] = 2 sigmoid(mp * scale[1] +
// base[HC + k]) for lanes k < HC, mp their logit m[HC + k]; comb element k from its logit
// mc = m[2 HC + k] for lanes k < HC * HC: scaled and shifted, the softmax of its row + hc_eps,
// then the Sinkhorn iterations (hc_sinkhorn_warp), into mix[HC + k].
template <int HC>
__device__ __forceinline__ void hc_mix_warp(float mp, float mc, float* mix, const float* base, const float* scale,
                                            float hc_eps, int iters) {
    const int k = threadIdx.x & 31;
    const bool mine = k < HC * HC;
    const int ci = mine ? k / HC : 0;
    const int cj = mine ? k - ci * HC : 0;
    if (k < HC) {
        mix[k] = 2.0f * ds4_sigmoid(mp * scale[1] + base[HC + k]);
    }
    float v = mine ? mc * scale[2] + base[2 * HC + k] : 0.0f;
    // Softmax of each row, then + hc_eps.
    float e[HC];
    hc_line<HC>(v, ci * HC, 1, e);
    float mx = -__int_as_float(0x7f800000);
#pragma unroll
    for (int j = 0; j < HC; j++) {
        mx = fmaxf(mx, e[j]);
    }
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < HC; j++) {
        sum += expf(e[j] - mx);
    }
    v = mine ? expf(v - mx) / sum + hc_eps : 0.0f;
    v = hc_sinkhorn_warp<HC>(v, ci, cj, hc_eps, iters);
    if (mine) {
        mix[HC + k] = v;
    }
}

// One row of ds4_hc_pre with its pointers at the row: warp 0 computes the mix while the other
// warps collapse the streams (the collapse needs only pre, not the Sinkhorn iterations).
//
// The mixing math keeps comb in warp 0's registers (lane k < HC * HC holds element k) and
// reads other elements with shuffles. HC is a template parameter so that every loop over
// streams unrolls into straight code (with hc a runtime value the loops branched around each
// shuffle and load). The Sinkhorn iterations are the longest part: 2 * iters - 1 dependent
// steps in one warp, each shuffles, adds and an IEEE division, about 6 of the kernel's 12 us
// at the Flash shape on an H200 (scripts/kernel_lab/ops_lab.cu, 20 against 1 iteration);
// with its side branch (the default; DS4_CUDA_FORK=0 turns it off) the decode passes
// iters = 0 and runs them in ds4_hc_sinkhorn, off its critical path.
//
// The mixing logits come in unnormalized (the product of the raw streams): the row's RMS scale
// fs over its hc * d stream values is computed here and applied to each logit, m = raw * fs,
// where hyper.rs mix_logits scales the streams before the product. The two agree to float
// rounding (the decode's parity tests); doing it here saves a norm launch per site.
template <int HC>
__device__ __forceinline__ void hc_pre_row(const float* raw, const float* x, float* y, float* mix, const float* base,
                                           const float* scale, int d, float hc_eps, int iters, const float* norm,
                                           float eps) {
    __shared__ float pre[HC];
    __shared__ float m[(2 + HC) * HC];
    __shared__ double red[32];
    const int tid = threadIdx.x;
    {
        float v[DS4_RMS_REGS];
        const float fs = ds4_rms_scale_regs(x, HC * d, eps, red, v);
        if (tid < (2 + HC) * HC) {
            m[tid] = raw[tid] * fs;
        }
        if (tid < HC) {
            pre[tid] = ds4_sigmoid(m[tid] * scale[0] + base[tid]) + hc_eps;
        }
    }
    __syncthreads();
    // Collapse threads: thread t owns elements t + j * workers; the first DS4_HC_REGS of them
    // stay in registers for the norm.
    const int workers = blockDim.x - 32;
    const int t = tid - 32;
    float yv[DS4_HC_REGS];
    if (tid < 32) {
        const int k = tid;
        hc_mix_warp<HC>(k < HC ? m[HC + k] : 0.0f, k < HC * HC ? m[2 * HC + k] : 0.0f, mix, base, scale, hc_eps,
                        iters);
    } else {
        auto one = [&](int i) {
            float acc = 0.0f;
#pragma unroll
            for (int s = 0; s < HC; s++) {
                acc += pre[s] * x[(long long)s * d + i];
            }
            return acc;
        };
#pragma unroll
        for (int j = 0; j < DS4_HC_REGS; j++) {
            const int i = t + j * workers;
            yv[j] = 0.0f;
            if (i < d) {
                yv[j] = one(i);
                if (!norm) {
                    y[i] = yv[j];
                }
            }
        }
        for (int i = t + DS4_HC_REGS * workers; i < d; i += workers) {
            y[i] = one(i);
        }
    }
    if (!norm) {
        return;
    }
    // The norm: the sum of squares in double over the thread's elements in order, the block
    // sum, then y = norm * (y * scale) (ds4_rms_scale, ds4_rms_weight).
    double ss = 0.0;
    if (t >= 0) {
#pragma unroll
        for (int j = 0; j < DS4_HC_REGS; j++) {
            if (t + j * workers < d) {
                const double q = (double)yv[j];
                ss += q * q;
            }
        }
        for (int i = t + DS4_HC_REGS * workers; i < d; i += workers) {
            const double q = (double)y[i];
            ss += q * q;
        }
    }
    ss = ds4_block_sum_f64(ss, red);
    const float sc = 1.0f / sqrtf((float)(ss / (double)d) + eps);
    if (t >= 0) {
#pragma unroll
        for (int j = 0; j < DS4_HC_REGS; j++) {
            const int i = t + j * workers;
            if (i < d) {
                y[i] = norm[i] * (yv[j] * sc);
            }
        }
        for (int i = t + DS4_HC_REGS * workers; i < d; i += workers) {
            y[i] = norm[i] * (y[i] * sc);
        }
    }
}

// ds4_hc_pre's row when d = J * blockDim.x (J = 1, 2 or 4; the Flash shape: d = 4096, 1024
// threads): thread t loads x[s * d + t + j * blockDim.x] for every stream s and j < J once,
// which is ds4_rms_scale_regs' assignment of the hc * d values (the same RMS scale, bit for
// bit), and collapses its own J elements of y from those registers; its small inputs (its
// logits, base, scale and norm weights) are loaded with them. Nothing is read twice and only
// the two block sums wait on other warps: hc_pre_row's collapse re-read x after a barrier and
// the norm weights after the second sum, bound by those latencies (in a Flash decode step on an
// H200, 86 launches: 11.6 us each that way, 9.1 us this way). The arithmetic is hc_pre_row's
// (pre, collapse, mix); the norm's sum of squares is over the same values in another order
// (double, then rounded to float). Warp 0 also computes the mix (hc_mix_warp).
template <int HC, int J>
__device__ __forceinline__ void hc_pre_row_regs(const float* raw, const float* x, float* y, float* mix,
                                                const float* base, const float* scale, int d, float hc_eps, int iters,
                                                const float* norm, float eps) {
    __shared__ double red[32];
    const int tid = threadIdx.x;
    const int nt = blockDim.x;
    float v[HC][J];
#pragma unroll
    for (int s = 0; s < HC; s++) {
#pragma unroll
        for (int j = 0; j < J; j++) {
            v[s][j] = x[(long long)s * d + tid + j * nt];
        }
    }
    float rp[HC], bp[HC];
#pragma unroll
    for (int s = 0; s < HC; s++) {
        rp[s] = raw[s];
        bp[s] = base[s];
    }
    const float sc0 = scale[0];
    // Warp 0's logits of the mix: post (lanes < HC) and comb (lanes < HC * HC).
    const int lane = tid & 31;
    const float rpost = tid < HC ? raw[HC + lane] : 0.0f;
    const float rcomb = tid < HC * HC ? raw[2 * HC + lane] : 0.0f;
    float nw[J];
#pragma unroll
    for (int j = 0; j < J; j++) {
        nw[j] = norm ? norm[tid + j * nt] : 0.0f;
    }
    double ss = 0.0;
#pragma unroll
    for (int s = 0; s < HC; s++) {
#pragma unroll
        for (int j = 0; j < J; j++) {
            const double q = (double)v[s][j];
            ss += q * q;
        }
    }
    ss = ds4_block_sum_f64(ss, red);
    const float fs = 1.0f / sqrtf((float)(ss / (double)(HC * d)) + eps);
    float pre[HC];
#pragma unroll
    for (int s = 0; s < HC; s++) {
        pre[s] = ds4_sigmoid((rp[s] * fs) * sc0 + bp[s]) + hc_eps;
    }
    float yv[J];
#pragma unroll
    for (int j = 0; j < J; j++) {
        float acc = 0.0f;
#pragma unroll
        for (int s = 0; s < HC; s++) {
            acc += pre[s] * v[s][j];
        }
        yv[j] = acc;
    }
    if (tid < 32) {
        hc_mix_warp<HC>(rpost * fs, rcomb * fs, mix, base, scale, hc_eps, iters);
    }
    if (!norm) {
#pragma unroll
        for (int j = 0; j < J; j++) {
            y[tid + j * nt] = yv[j];
        }
        return;
    }
    double s2 = 0.0;
#pragma unroll
    for (int j = 0; j < J; j++) {
        const double q = (double)yv[j];
        s2 += q * q;
    }
    s2 = ds4_block_sum_f64(s2, red);
    const float sc = 1.0f / sqrtf((float)(s2 / (double)d) + eps);
#pragma unroll
    for (int j = 0; j < J; j++) {
        y[tid + j * nt] = nw[j] * (yv[j] * sc);
    }
}

// The Sinkhorn iterations of one row's comb (mix + hc) in warp 0, in place.
template <int HC>
__device__ __forceinline__ void hc_sinkhorn_row(float* comb, float hc_eps, int iters) {
    const int k = threadIdx.x;
    const bool mine = k < HC * HC;
    const int ci = mine ? k / HC : 0;
    const int cj = mine ? k - ci * HC : 0;
    const float v = hc_sinkhorn_warp<HC>(mine ? comb[k] : 0.0f, ci, cj, hc_eps, iters);
    if (mine) {
        comb[k] = v;
    }
}

template <int H>
__device__ __forceinline__ void hc_sinkhorn_streams(int hc, float* comb, float hc_eps, int iters) {
    if (hc == H) {
        hc_sinkhorn_row<H>(comb, hc_eps, iters);
    } else if constexpr (H > 1) {
        hc_sinkhorn_streams<H - 1>(hc, comb, hc_eps, iters);
    } else {
        __trap();  // the host checks hc (a host bug)
    }
}

// The Sinkhorn iterations of a hyper-connection site, apart from ds4_hc_pre: launched with
// iters = 0, ds4_hc_pre leaves each row's comb after the softmax, and this kernel finishes it
// in place with the same operations as ds4_hc_pre's warp 0 (so the two ways agree bitwise).
// Only the site's expansion reads comb, so the decode can run this on a side branch of its
// graph while the sublayer runs (the default; the iterations are a chain of dependent steps
// in one warp, about half of ds4_hc_pre's time). mix [n, hc + hc * hc]. Grid (n), block 32
// (warp 0 works; more warps are idle); hc <= DS4_HC_PRE_MAX.
extern "C" __global__ void ds4_hc_sinkhorn(float* mix, int hc, float hc_eps, int iters) {
    ds4_grid_deps();
    float* comb = mix + (long long)blockIdx.x * (hc + hc * hc) + hc;
    hc_sinkhorn_streams<DS4_HC_PRE_MAX>(hc, comb, hc_eps, iters);
}

// hc_pre_row for the runtime stream count hc <= H (one instance per count).
template <int H>
__device__ __forceinline__ void hc_pre_streams(int hc, const float* raw, const float* x, float* y, float* mix,
                                               const float* base, const float* scale, int d, float hc_eps, int iters,
                                               const float* norm, float eps) {
    if (hc == H) {
        const int nt = blockDim.x;
        // (Four elements a stream of five streams would not fit the 64 registers of 1024 threads.)
        if (H <= 4 && d == 4 * nt) {
            hc_pre_row_regs<H <= 4 ? H : 4, 4>(raw, x, y, mix, base, scale, d, hc_eps, iters, norm, eps);
        } else if (d == 2 * nt) {
            hc_pre_row_regs<H, 2>(raw, x, y, mix, base, scale, d, hc_eps, iters, norm, eps);
        } else if (d == nt) {
            hc_pre_row_regs<H, 1>(raw, x, y, mix, base, scale, d, hc_eps, iters, norm, eps);
        } else {
            hc_pre_row<H>(raw, x, y, mix, base, scale, d, hc_eps, iters, norm, eps);
        }
    } else if constexpr (H > 1) {
        hc_pre_streams<H - 1>(hc, raw, x, y, mix, base, scale, d, hc_eps, iters, norm, eps);
    } else {
        __trap();  // the host checks hc (a host bug)
    }
}

// The hyper-connection collapse of one row after its mixing logits (rust/engine/model/hyper.rs
// pre): logits [n, n_mix] (n_mix = (2 + hc) * hc) the product of the site's projection with
// the raw streams (see hc_pre_row), x [n, hc * d] streams, y [n, d] the
// collapse, mix [n, hc + hc * hc] the row's Mix (post[0..hc], then comb[i * hc + j] = weight
// of input stream i in output stream j, after Sinkhorn). base and scale are the site's
// HyperWeights base (n_mix floats) and scale (3 floats). With `norm` (d floats, may be null)
// y is then replaced by its RMS norm with that weight, as ds4_rms_weight (the sublayer's input
// norm, fused). Grid (n), at least 64 threads; 1 <= hc <= DS4_HC_PRE_MAX.
extern "C" __global__ void __launch_bounds__(1024) ds4_hc_pre(const float* logits, int n_mix, const float* x, float* y, float* mix,
                                      const float* base, const float* scale, int hc, int d, float hc_eps,
                                      int iters, const float* norm, float eps) {
    ds4_grid_lead();
    if (blockDim.x < 64) {
        __trap();  // no collapse warps (a host bug)
    }
    const long long r = blockIdx.x;
    const float* m = logits + r * n_mix;
    const float* xr = x + r * hc * d;
    float* yr = y + r * d;
    float* mr = mix + r * (hc + hc * hc);
    hc_pre_streams<DS4_HC_PRE_MAX>(hc, m, xr, yr, mr, base, scale, d, hc_eps, iters, norm, eps);
}

// The hyper-connection expansion (hyper.rs post) of element i of row r, in place on x
// [n, hc * d]: x_j = post_j * fk + sum_i comb[i * hc + j] * old x_i, with fk element i of the
// row's sublayer output and mix [n, hc + hc * hc] from ds4_hc_pre; hc <= DS4_HC_MAX.
__device__ __forceinline__ void ds4_hc_post_at(float* x, float fk, const float* mix, int hc, int d, int r, int i) {
    const float* mr = mix + (long long)r * (hc + hc * hc);
    const float* comb = mr + hc;
    float* xs = x + (long long)r * hc * d;
    float old[DS4_HC_MAX];
    for (int s = 0; s < DS4_HC_MAX; s++) {
        if (s < hc) {
            old[s] = xs[(long long)s * d + i];
        }
    }
    for (int j = 0; j < hc; j++) {
        float acc = 0.0f;
        for (int s = 0; s < DS4_HC_MAX; s++) {
            if (s < hc) {
                acc += comb[s * hc + j] * old[s];
            }
        }
        xs[(long long)j * d + i] = mr[j] * fk + acc;
    }
}

// ds4_hc_post_at over rows of f [n, d], the sublayer output. Grid (ceil(d / blockDim.x), n).
extern "C" __global__ void ds4_hc_post(float* x, const float* f, const float* mix, int hc, int d) {
    ds4_grid_lead();
    const int r = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < d) {
        ds4_hc_post_at(x, f[(long long)r * d + i], mix, hc, d, r, i);
    }
}

// ---- A hyper-connection site in one launch (the decode's and verify's rows, sm_90 and later)
//
// ds4_hc_site does what the site's mixing product (the F16 projection of the raw streams to
// the n_mix logits) and ds4_hc_pre do, for each row on a thread block cluster of
// HC_SITE_CLUSTER blocks: block b of a row's cluster owns the columns [b * cols, (b + 1) *
// cols) of every stream (cols = d / HC_SITE_CLUSTER), one column a thread. Its threads read
// their columns' weights before the wait for the previous kernel (the weights are constant),
// then their stream values; each block sums its columns' part of the n_mix logits and of the
// streams' sum of squares, and every block adds the cluster's parts, read from each block's
// shared memory in rank order (distributed shared memory, `mapa`), so each block has the same
// logits, bit for bit; the collapse's sum of squares for the input norm goes the same way.
// Block 0's warp 0 writes the row's mix (hc_mix_warp, as ds4_hc_pre). The product's and
// ds4_hc_pre's launches become one, whose collapse is spread over the cluster's SMs rather than
// ds4_hc_pre's one block (what it gains: decode/program.rs, `hc_site`).
//
// The arithmetic is ds4_hc_pre's (hc_pre_row_regs) after the logits; the logits are the same
// dot products as the product kernel's in another order of sums (each thread's columns in
// stream order, fmaf; the warp's butterfly, the block's warps in order, the cluster's blocks
// in rank order), so the result agrees with the two-launch path to rounding, and every row is
// computed the same way whatever the batch (row invariance).
//
// With post_f (not null) the block first applies the previous site's expansion to its
// columns, as ds4_hc_post does (ds4_hc_post_at: the same operations), writing x back, and
// goes on with the new values: the attention site's expansion folded into the FFN site.
//
// proj: the site's projection, n_mix rows of hc * d weights, F16 (w_f16 = 1) or F32 (0),
// row_bytes apart. x [n, hc * d], y [n, d], mix [n, hc + hc * hc]; base, scale, hc_eps,
// iters, norm, eps as ds4_hc_pre's. post_f [n, d] and post_mix [n, hc + hc * hc]: the
// expansion's sublayer output and mix, or null. Grid (HC_SITE_CLUSTER, n); block
// ceil(cols / 32) * 32 threads, at most HC_SITE_THREADS; d a multiple of HC_SITE_CLUSTER;
// 1 <= hc <= HC_SITE_MAX.
#define HC_SITE_CLUSTER 8
#define HC_SITE_THREADS 512
#define HC_SITE_MAX 4

__device__ __forceinline__ u32 ds4_cluster_rank() {
    u32 r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}

// Every thread of the cluster arrives (its shared-memory writes released), then waits for all
// (the others' acquired).
__device__ __forceinline__ void ds4_cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The address of `p` (this block's shared memory) in the cluster's block `rank`.
__device__ __forceinline__ u32 ds4_cluster_map(const void* p, u32 rank) {
    u32 r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"((u32)__cvta_generic_to_shared(p)), "r"(rank));
#endif
    return r;
}

// The value at `p` (this block's shared memory) in the cluster's block `rank`.
__device__ __forceinline__ float ds4_cluster_ld(const float* p, u32 rank) {
    float v = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(ds4_cluster_map(p, rank)));
#endif
    return v;
}

__device__ __forceinline__ double ds4_cluster_ld(const double* p, u32 rank) {
    double v = 0.0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(ds4_cluster_map(p, rank)));
#endif
    return v;
}

// The sum in rank order of the cluster's values e[0], e[1], ... (the same order, so the same
// bits, wherever the blocks' parts are gathered).
template <class T>
__device__ __forceinline__ T ds4_rank_sum(const T (&e)[HC_SITE_CLUSTER]) {
    T a = e[0];
#pragma unroll
    for (int k = 1; k < HC_SITE_CLUSTER; k++) {
        a += e[k];
    }
    return a;
}

// The sum over the cluster's blocks, in rank order, of the value at `p` in each. (All of a
// thread's remote loads go out before the first add: each waits about as long as a global
// one.)
template <class T>
__device__ __forceinline__ T ds4_cluster_sum(const T* p) {
    T e[HC_SITE_CLUSTER];
#pragma unroll
    for (int k = 0; k < HC_SITE_CLUSTER; k++) {
        e[k] = ds4_cluster_ld(p, k);
    }
    return ds4_rank_sum(e);
}

// HC_SITE_ASYNC (a DS4_CUDA_DEFINES variant, off by default): the cluster's
// exchanges without ds4_cluster_sync. A cluster barrier with release / acquire semantics is a
// GPU-scope fence in SASS (MEMBAR.ALL.GPU before the barrier, an L1 invalidation after: three
// of them a launch), which may be much of the kernel's time. With the variant each block
// pushes its parts into every block's shared memory with st.async, whose bytes complete a
// transaction count on the receiver's mbarrier, and waits on its own mbarrier; the one barrier
// left that orders anything is the relaxed one after the mbarriers' initialization, arrived at
// before the wait for the previous kernel. The receivers add the same values in the same rank
// order, so the results are the default's bit for bit (the GPU tests pass with it). Not the
// default: faster alone in the lab on an H200 (10.1 us a launch against 10.6 to 10.9), but no
// gain in Flash steps (8.42 ms against 8.39).
// (Measurements: scripts/kernel_lab/HISTORY.md, "decode_ops.cu: HC_SITE_ASYNC".)
#ifdef HC_SITE_ASYNC
__device__ __forceinline__ void ds4_mbar_init(u64* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"((u32)__cvta_generic_to_shared(bar)) : "memory");
}

// The block's one arrival on `bar`, expecting `bytes` from st.async.
__device__ __forceinline__ void ds4_mbar_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 ::"r"((u32)__cvta_generic_to_shared(bar)), "r"(bytes)
                 : "memory");
}

// Waits for phase 0 of `bar` to complete (each barrier serves one exchange a launch).
__device__ __forceinline__ void ds4_mbar_wait0(u64* bar) {
    const u32 a = (u32)__cvta_generic_to_shared(bar);
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(a)
            : "memory");
    }
}

// Stores 4 (st.async .b32) or 8 bytes (.b64) at `dst` of block `rank`, completing as many
// bytes of that block's mbarrier `bar` (both at this block's addresses).
__device__ __forceinline__ void ds4_push(const float* dst, u64* bar, u32 rank, float v) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 ::"r"(ds4_cluster_map(dst, rank)), "r"(__float_as_uint(v)), "r"(ds4_cluster_map(bar, rank))
                 : "memory");
}

__device__ __forceinline__ void ds4_push(const double* dst, u64* bar, u32 rank, double v) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [%0], %1, [%2];"
                 ::"r"(ds4_cluster_map(dst, rank)), "l"(__double_as_longlong(v)), "r"(ds4_cluster_map(bar, rank))
                 : "memory");
}
#endif

template <int HC>
__device__ __forceinline__ void hc_site_row(const u8* proj, int row_bytes, int w_f16, float* x, float* y, float* mix,
                                            const float* base, const float* scale, int d, float hc_eps, int iters,
                                            const float* norm, float eps, const float* post_f,
                                            const float* post_mix) {
    constexpr int NM = (2 + HC) * HC;
    __shared__ float red_f[HC_SITE_THREADS / 32][NM];
    __shared__ double red_d[HC_SITE_THREADS / 32];
    __shared__ float part_f[NM];
    __shared__ double part_d[2];
    __shared__ float tot_f[NM];
    __shared__ double tot_d[2];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int nw = blockDim.x >> 5;
    const u32 rank = ds4_cluster_rank();
    const int cols = d / HC_SITE_CLUSTER;
    const bool mine = tid < cols;
    const int c = (int)rank * cols + tid;
    // Before the wait: this column's weights (F16 kept as pairs of halves) and norm weight.
    u32 w16[(NM * HC + 1) / 2];
#pragma unroll
    for (int i = 0; i < (NM * HC + 1) / 2; i++) {
        w16[i] = 0u;
    }
    if (mine && w_f16) {
#pragma unroll
        for (int o = 0; o < NM; o++) {
            const unsigned short* wr = (const unsigned short*)(proj + (long long)o * row_bytes);
#pragma unroll
            for (int s = 0; s < HC; s++) {
                const int i = o * HC + s;
                w16[i >> 1] |= (u32)wr[(long long)s * d + c] << (16 * (i & 1));
            }
        }
    }
    const float nwc = (mine && norm) ? norm[c] : 0.0f;
#ifdef HC_SITE_ASYNC
    // Every block's parts, by rank, for the logits and sum of squares (round 0) and the
    // collapse's sum of squares (round 1), with one mbarrier a round, initialized before any
    // block may push (the relaxed barrier's wait comes before the first push).
    __shared__ float recv_f[HC_SITE_CLUSTER][NM];
    __shared__ double recv_d[2][HC_SITE_CLUSTER];
    __shared__ __align__(8) u64 bars[2];
    if (tid == 0) {
        ds4_mbar_init(&bars[0]);
        ds4_mbar_init(&bars[1]);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
    ds4_grid_lead();
    float v[HC];
#pragma unroll
    for (int s = 0; s < HC; s++) {
        v[s] = 0.0f;
    }
    if (mine && post_f) {
        // The previous site's expansion of this column (ds4_hc_post_at's operations).
        const float* mr = post_mix + (long long)blockIdx.y * (HC + HC * HC);
        const float* comb = mr + HC;
        const float fk = post_f[(long long)blockIdx.y * d + c];
        float old[HC];
#pragma unroll
        for (int s = 0; s < HC; s++) {
            old[s] = x[(long long)s * d + c];
        }
#pragma unroll
        for (int j = 0; j < HC; j++) {
            float acc = 0.0f;
#pragma unroll
            for (int s = 0; s < HC; s++) {
                acc += comb[s * HC + j] * old[s];
            }
            v[j] = mr[j] * fk + acc;
            x[(long long)j * d + c] = v[j];
        }
    } else if (mine) {
#pragma unroll
        for (int s = 0; s < HC; s++) {
            v[s] = x[(long long)s * d + c];
        }
    }
    // This thread's part of the logits and of the streams' sum of squares.
    float p[NM];
    double ss = 0.0;
#pragma unroll
    for (int s = 0; s < HC; s++) {
        const double q = (double)v[s];
        ss += q * q;
    }
#pragma unroll
    for (int o = 0; o < NM; o++) {
        p[o] = 0.0f;
#pragma unroll
        for (int s = 0; s < HC; s++) {
            const int i = o * HC + s;
            float w;
            if (w_f16) {
                w = f16_bits_to_f32(w16[i >> 1] >> (16 * (i & 1)));
            } else {
                w = mine ? ((const float*)(proj + (long long)o * row_bytes))[(long long)s * d + c] : 0.0f;
            }
            p[o] = fmaf(w, v[s], p[o]);
        }
    }
    // The block's part: each warp's butterfly, then the warps in order. (Tried and dropped: a
    // reduce-scatter butterfly, 31 shuffles a warp instead of 120, with the last cluster barrier
    // split around the stores of y; slower.)
    // (Measurements: scripts/kernel_lab/HISTORY.md, "decode_ops.cu: hc_site_row".)
#pragma unroll
    for (int o = 0; o < NM; o++) {
        for (int k = 16; k > 0; k >>= 1) {
            p[o] += __shfl_xor_sync(0xffffffffu, p[o], k);
        }
    }
    for (int k = 16; k > 0; k >>= 1) {
        ss += __shfl_xor_sync(0xffffffffu, ss, k);
    }
    if (lane == 0) {
#pragma unroll
        for (int o = 0; o < NM; o++) {
            red_f[warp][o] = p[o];
        }
        red_d[warp] = ss;
    }
    __syncthreads();
    if (tid < NM) {
        float a = red_f[0][tid];
        for (int k = 1; k < nw; k++) {
            a += red_f[k][tid];
        }
        part_f[tid] = a;
    } else if (tid == NM) {
        double a = red_d[0];
        for (int k = 1; k < nw; k++) {
            a += red_d[k];
        }
        part_d[0] = a;
    }
    // The cluster's sums, in rank order, by every block alike.
#ifdef HC_SITE_ASYNC
    __syncthreads();
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    if (tid == 0) {
        ds4_mbar_expect(&bars[0], HC_SITE_CLUSTER * (NM * 4 + 8));
    }
    for (int j = tid; j < HC_SITE_CLUSTER * (NM + 1); j += blockDim.x) {
        const u32 k = (u32)(j / (NM + 1));
        const int o = j - (int)k * (NM + 1);
        if (o < NM) {
            ds4_push(&recv_f[rank][o], &bars[0], k, part_f[o]);
        } else {
            ds4_push(&recv_d[0][rank], &bars[0], k, part_d[0]);
        }
    }
    ds4_mbar_wait0(&bars[0]);
    if (tid < NM) {
        float e[HC_SITE_CLUSTER];
#pragma unroll
        for (int k = 0; k < HC_SITE_CLUSTER; k++) {
            e[k] = recv_f[k][tid];
        }
        tot_f[tid] = ds4_rank_sum(e);
    } else if (tid == NM) {
        tot_d[0] = ds4_rank_sum(recv_d[0]);
    }
#else
    ds4_cluster_sync();
    if (tid < NM) {
        tot_f[tid] = ds4_cluster_sum(&part_f[tid]);
    } else if (tid == NM) {
        tot_d[0] = ds4_cluster_sum(&part_d[0]);
    }
#endif
    __syncthreads();
    const float fs = 1.0f / sqrtf((float)(tot_d[0] / (double)(HC * d)) + eps);
    float yv = 0.0f;
#pragma unroll
    for (int s = 0; s < HC; s++) {
        const float pre = ds4_sigmoid((tot_f[s] * fs) * scale[0] + base[s]) + hc_eps;
        yv += pre * v[s];
    }
    if (rank == 0 && warp == 0) {
        const float rpost = lane < HC ? tot_f[HC + lane] : 0.0f;
        const float rcomb = lane < HC * HC ? tot_f[2 * HC + lane] : 0.0f;
        hc_mix_warp<HC>(rpost * fs, rcomb * fs, mix + (long long)blockIdx.y * (HC + HC * HC), base, scale, hc_eps,
                        iters);
    }
    float* yr = y + (long long)blockIdx.y * d;
    if (norm) {
        double s2 = mine ? (double)yv * (double)yv : 0.0;
        for (int k = 16; k > 0; k >>= 1) {
            s2 += __shfl_xor_sync(0xffffffffu, s2, k);
        }
        if (lane == 0) {
            red_d[warp] = s2;
        }
        __syncthreads();
        if (tid == 0) {
            double a = red_d[0];
            for (int k = 1; k < nw; k++) {
                a += red_d[k];
            }
            part_d[1] = a;
        }
#ifdef HC_SITE_ASYNC
        __syncthreads();
        if (tid == 0) {
            ds4_mbar_expect(&bars[1], HC_SITE_CLUSTER * 8);
        }
        if (tid < HC_SITE_CLUSTER) {
            ds4_push(&recv_d[1][rank], &bars[1], (u32)tid, part_d[1]);
        }
        ds4_mbar_wait0(&bars[1]);
        if (tid == 0) {
            tot_d[1] = ds4_rank_sum(recv_d[1]);
        }
#else
        ds4_cluster_sync();
        if (tid == 0) {
            tot_d[1] = ds4_cluster_sum(&part_d[1]);
        }
#endif
        __syncthreads();
        const float sc = 1.0f / sqrtf((float)(tot_d[1] / (double)d) + eps);
        if (mine) {
            yr[c] = nwc * (yv * sc);
        }
    } else if (mine) {
        yr[c] = yv;
    }
#ifdef HC_SITE_ASYNC
    // No block leaves before every block has received its pushes (no ordering needed).
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
#else
    // No block leaves while another may still read its shared memory.
    ds4_cluster_sync();
#endif
}

template <int H>
__device__ __forceinline__ void hc_site_streams(int hc, const u8* proj, int row_bytes, int w_f16, float* x, float* y,
                                                float* mix, const float* base, const float* scale, int d,
                                                float hc_eps, int iters, const float* norm, float eps,
                                                const float* post_f, const float* post_mix) {
    if (hc == H) {
        hc_site_row<H>(proj, row_bytes, w_f16, x, y, mix, base, scale, d, hc_eps, iters, norm, eps, post_f, post_mix);
    } else if constexpr (H > 1) {
        hc_site_streams<H - 1>(hc, proj, row_bytes, w_f16, x, y, mix, base, scale, d, hc_eps, iters, norm, eps,
                               post_f, post_mix);
    } else {
        __trap();  // the host checks hc (a host bug)
    }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DS4_HC_SITE_CLUSTER_DIMS __cluster_dims__(HC_SITE_CLUSTER, 1, 1)
#else
#define DS4_HC_SITE_CLUSTER_DIMS
#endif

extern "C" __global__ void DS4_HC_SITE_CLUSTER_DIMS __launch_bounds__(HC_SITE_THREADS)
    ds4_hc_site(const u8* proj, int row_bytes, int w_f16, float* x, float* y, float* mix, const float* base,
                const float* scale, int hc, int d, float hc_eps, int iters, const float* norm, float eps,
                const float* post_f, const float* post_mix) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (d % HC_SITE_CLUSTER != 0 || (int)blockDim.x * HC_SITE_CLUSTER < d || gridDim.x != HC_SITE_CLUSTER) {
        __trap();  // a host bug
    }
    x += (long long)blockIdx.y * hc * d;
    hc_site_streams<HC_SITE_MAX>(hc, proj, row_bytes, w_f16, x, y, mix, base, scale, d, hc_eps, iters, norm, eps,
                                 post_f, post_mix);
#else
    __trap();  // clusters need sm_90 (the host never launches this kernel before it)
#endif
}

// The output head's collapse (hyper.rs head): logits [n, hc], x [n, hc * d], y [n, d];
// base (hc floats) and scale (scale[0] used) of hc_head. Grid (n); hc <= DS4_HC_MAX.
extern "C" __global__ void ds4_hc_head(const float* logits, const float* x, float* y, const float* base,
                                       const float* scale, int hc, int d, float hc_eps) {
    ds4_grid_lead();
    __shared__ float pre[DS4_HC_MAX];
    const int r = blockIdx.x;
    if (threadIdx.x < hc) {
        const int s = threadIdx.x;
        pre[s] = ds4_sigmoid(logits[(long long)r * hc + s] * scale[0] + base[s]) + hc_eps;
    }
    __syncthreads();
    const float* xs = x + (long long)r * hc * d;
    float* yr = y + (long long)r * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < hc; s++) {
            acc += pre[s] * xs[(long long)s * d + i];
        }
        yr[i] = acc;
    }
}

// Query rows after q_b, in place (rust/engine/model/block.rs finish_queries): head h of row r
// (q [n, n_heads * head_dim]) RMS-normalized without weight, then its last rope_dim features
// rotated at position step[0] + r. inv_freq: rope_dim / 2 floats. One block per (h, r).
__device__ __forceinline__ void ds4_finish_q_head(float* q, int n_heads, int head_dim, float eps,
                                                  const float* inv_freq, int rope_dim, const int* step, int h,
                                                  int r, double* red) {
    float* v = q + ((long long)r * n_heads + h) * head_dim;
    const float s = ds4_rms_scale(v, head_dim, eps, red);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        v[i] = v[i] * s;
    }
    __syncthreads();
    const int pos = step[0] + r;
    for (int i = threadIdx.x; i < rope_dim / 2; i += blockDim.x) {
        ds4_rope_pair(v, head_dim, inv_freq, rope_dim, pos, i, false);
    }
}

// K=V rows after the kv projection, in place (block.rs finish_kv): kv [n, head_dim], each row
// RMS-normalized with the weight w (kv_norm, head_dim floats), rotated at step[0] + r, then
// every feature rounded to the storage precision (round_mode: 0 f32, 1 f16). One block per r.
__device__ __forceinline__ void ds4_finish_kv_row(float* kv, const float* w, int head_dim, float eps,
                                                  const float* inv_freq, int rope_dim, int round_mode,
                                                  const int* step, int r, double* red) {
    float* v = kv + (long long)r * head_dim;
    const float s = ds4_rms_scale(v, head_dim, eps, red);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        v[i] = w[i] * (v[i] * s);
    }
    __syncthreads();
    const int pos = step[0] + r;
    for (int i = threadIdx.x; i < rope_dim / 2; i += blockDim.x) {
        ds4_rope_pair(v, head_dim, inv_freq, rope_dim, pos, i, false);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        v[i] = ds4_round_store(v[i], round_mode);
    }
}

// Indexer queries and weights of a CSA layer, in place (the `idx` part of Model::attention in
// rust/engine/model/forward.rs): head h of row r (iq [n, heads * head_dim]) rotated at
// step[0] + r and rounded (round_mode as ds4_finish_kv_row); g [n, heads] scaled by g_scale
// (1 / sqrt(heads)), the block of head h doing g[r * heads + h]. One block per (h, r).
__device__ __forceinline__ void ds4_finish_index_head(float* iq, float* g, int heads, int head_dim,
                                                      const float* inv_freq, int rope_dim, int round_mode,
                                                      float g_scale, const int* step, int h, int r) {
    float* v = iq + ((long long)r * heads + h) * head_dim;
    const int pos = step[0] + r;
    for (int i = threadIdx.x; i < rope_dim / 2; i += blockDim.x) {
        ds4_rope_pair(v, head_dim, inv_freq, rope_dim, pos, i, false);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        v[i] = ds4_round_store(v[i], round_mode);
    }
    if (threadIdx.x == 0) {
        g[(long long)r * heads + h] *= g_scale;
    }
}

// Each of the three alone (their tests; the decode runs them in one launch, ds4_finish_rows in
// decode_attn.cu). Grid (n_heads, n), (n), (heads, n).
extern "C" __global__ void ds4_finish_q(float* q, int n_heads, int head_dim, float eps, const float* inv_freq,
                                        int rope_dim, const int* step) {
    ds4_grid_deps();
    __shared__ double red[32];
    ds4_finish_q_head(q, n_heads, head_dim, eps, inv_freq, rope_dim, step, blockIdx.x, blockIdx.y, red);
}

extern "C" __global__ void ds4_finish_kv(float* kv, const float* w, int head_dim, float eps, const float* inv_freq,
                                         int rope_dim, int round_mode, const int* step) {
    ds4_grid_deps();
    __shared__ double red[32];
    ds4_finish_kv_row(kv, w, head_dim, eps, inv_freq, rope_dim, round_mode, step, blockIdx.x, red);
}

extern "C" __global__ void ds4_finish_index(float* iq, float* g, int heads, int head_dim, const float* inv_freq,
                                            int rope_dim, int round_mode, float g_scale, const int* step) {
    ds4_grid_deps();
    ds4_finish_index_head(iq, g, heads, head_dim, inv_freq, rope_dim, round_mode, g_scale, step, blockIdx.x,
                          blockIdx.y);
}

// SwiGLU with clamps (rust/engine/model/moe.rs swiglu): out = silu(min(g, clamp)) *
// clamp(u, -clamp, clamp), silu(x) = x / (1 + e^-x) (cpu.rs silu), over count elements: rows
// of `width`. With act8 != 0 each row is written as 8-bit activations in its slot of width
// floats (ds4_act8_block; width and the block size multiples of 32), the input of the routed
// experts' down products when they take them (Q2_K). Grid (ceil(count / blockDim.x)).
__device__ __forceinline__ float ds4_swiglu_one(float g, float u, float clamp) {
    const float a = fminf(g, clamp);
    float b = u;
    if (b < -clamp) {
        b = -clamp;
    }
    if (b > clamp) {
        b = clamp;
    }
    return a / (1.0f + expf(-a)) * b;
}

extern "C" __global__ void ds4_swiglu(const float* g, const float* u, float* out, int count, float clamp, int width,
                                      int act8) {
    ds4_grid_lead();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) {
        return;  // a whole warp when act8 (count is a multiple of 32)
    }
    const float v = ds4_swiglu_one(g[i], u[i], clamp);
    if (act8) {
        const long long row = i / width;
        const int p = (int)(i - row * width);
        char* slot = (char*)(out + row * width);
        ds4_act8_block(v, slot + (p & ~31), (float*)(slot + width) + (p >> 5));
    } else {
        out[i] = v;
    }
}

// ds4_swiglu four values a thread (DS4_CUDA_WIDE=1, a prompt's steps): 16-byte loads of g and
// u, the same operations on each value, 8-bit activations through ds4_act8_quad; the same
// values and bytes with a quarter of the blocks. count a multiple of 4 (with act8, of 32, and
// width too); g, u and out 16-byte aligned. Grid (ceil(count / (4 blockDim.x))), block a
// multiple of 32.
extern "C" __global__ void ds4_swiglu4(const float* g, const float* u, float* out, int count, float clamp,
                                       int width, int act8) {
    ds4_grid_lead();
    const long long i = 4 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
    const bool ok = i < count;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float4 a = ok ? *(const float4*)(g + i) : zero;
    const float4 b = ok ? *(const float4*)(u + i) : zero;
    const float4 v = make_float4(ds4_swiglu_one(a.x, b.x, clamp), ds4_swiglu_one(a.y, b.y, clamp),
                                 ds4_swiglu_one(a.z, b.z, clamp), ds4_swiglu_one(a.w, b.w, clamp));
    if (act8) {
        // Every lane takes part in the block's shuffles; lanes past count write nothing.
        const long long row = ok ? i / width : 0;
        const int p = (int)(ok ? i - row * width : 0);
        char* slot = (char*)(out + row * width);
        ds4_act8_quad(v, ok, slot + (p & ~31), (float*)(slot + width) + (p >> 5));
    } else if (ok) {
        *(float4*)(out + i) = v;
    }
}

// ---- L2 prefetch of a later product's weights (the decode's side branch)

// Asks L2 for the bytes [a, end) (inside one allocation), `piece` bytes a thread (a multiple
// of 16). A hint: it moves nothing to the SMs, reads nothing a kernel writes and waits for
// nothing, so it runs on the side branch while the main stream's small kernels leave DRAM
// idle, and the product that reads the bytes next finds them in L2 (rust/engine/backend/cuda/
// decode/program.rs, prefetch_q_b). A no-op before sm_90 (ds4_prefetch_l2). Grid: enough
// blocks for ceil((end - a) / piece) threads.
extern "C" __global__ void ds4_prefetch(const u8* a, const u8* end, int piece) {
    const unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    const unsigned long long lo = (unsigned long long)a + i * piece;
    const unsigned long long e = (unsigned long long)end;
    if (lo < e) {
        ds4_prefetch_l2(lo, lo + piece < e ? lo + piece : e);
    }
}
