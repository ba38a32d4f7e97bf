// ds4 CUDA kernels of the device-resident decode: what a step brings back to the host
// (rust/engine/backend/cuda/decode/mod.rs): its state writes moved into one buffer, and the
// greedy token of each logits row.

// One contiguous run of floats to copy: `len` floats from `src` to `dst + off` of the
// destination.
struct Ds4Copy {
    const float* src;
    long long off;
    long long len;
};

// Block i copies run i of `runs` into `dst`: what a step wrote to the device state (ring rows,
// compressor slots, emitted rows), packed for one device-to-host copy.
extern "C" __global__ void ds4_pack(const Ds4Copy* __restrict__ runs, float* __restrict__ dst) {
    ds4_grid_deps();
    const Ds4Copy c = runs[blockIdx.x];
    for (long long i = threadIdx.x; i < c.len; i += blockDim.x) {
        dst[c.off + i] = c.src[i];
    }
}

// ---- the greedy token of each logits row (steps that need no logits: greedy decoding and
// temperature-0 verify bring back one id per row instead of the row)

// What the scan of some of a row's values has found: the index and value of the first largest
// value above -inf among them (idx -1: none yet). A NaN or -inf is never taken.
struct Ds4Best {
    int idx;
    float v;
};

// Whether `b` replaces `a` when two partial results are combined: b holds a value, and a holds
// none or a smaller one, or the same one at a higher index. This is a total order (value
// descending, then index ascending; a held value is never NaN), so any split of the indices
// between threads and any grouping and order of the combines give the same result. When a's
// indices are all below b's it is `b.idx >= 0 && (a.idx < 0 || b.v > a.v)`; the index
// tie-break is for the threads' interleaved indices.
__device__ __forceinline__ bool ds4_best_takes(Ds4Best a, Ds4Best b) {
    return b.idx >= 0 && (a.idx < 0 || b.v > a.v || (b.v == a.v && b.idx < a.idx));
}

// out[r] = the argmax of row r of x ([rows, width]) exactly as the host's sequential scan
// takes it (rust/engine/model/drafting.rs argmax: best = 0, then best = i wherever
// x[i] > x[best]): the lowest index of the largest value, 0 when x[0] is NaN (nothing is
// greater than a NaN, so the scan never leaves 0) or when no value is above -inf; a NaN
// elsewhere is never taken. Each thread scans its values in index order from (-1, -inf),
// taking x[i] iff x[i] > v, which keeps every NaN and -inf out; the partial results combine by
// ds4_best_takes, in each warp and then warp by warp; then the two cases of 0 above. Bit 31 is
// set when the row has no greedy token for the sampler (rust/engine/sampling/filters.rs
// argmax: a NaN or +inf in it, or no value above -inf): the host then reads the row's logits
// and lets the sampler report it. Grid (rows), blockDim a multiple of 32, at most 1024 (1024).
extern "C" __global__ void __launch_bounds__(1024)
    ds4_argmax_rows(const float* __restrict__ x, int width, u32* __restrict__ out) {
    ds4_grid_deps();
    __shared__ int s_idx[32];
    __shared__ float s_v[32];
    const float* row = x + (long long)blockIdx.x * width;
    const float inf = __int_as_float(0x7f800000);
    Ds4Best b = {-1, -inf};
    bool bad = false;  // a NaN or +inf among this thread's values
    auto scan = [&](float v, int i) {
        bad = bad || v != v || v == inf;
        if (v > b.v) {
            b.v = v;
            b.idx = i;
        }
    };
    if ((width & 3) == 0 && ((u64)row & 15) == 0) {
        // Thread t scans the float4s t, t + T, t + 2 T, ... (T = blockDim.x): its values in
        // index order, four loads in flight at a time (one block reads a whole row).
        const float4* r4 = reinterpret_cast<const float4*>(row);
        const int n4 = width / 4;
        const int t = blockDim.x;
        auto scan4 = [&](float4 q, int j) {
            scan(q.x, 4 * j);
            scan(q.y, 4 * j + 1);
            scan(q.z, 4 * j + 2);
            scan(q.w, 4 * j + 3);
        };
        int j = threadIdx.x;
        for (; j + 3 * t < n4; j += 4 * t) {
            float4 q[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                q[u] = r4[j + u * t];
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                scan4(q[u], j + u * t);
            }
        }
        for (; j < n4; j += t) {
            scan4(r4[j], j);
        }
    } else {
        for (int i = threadIdx.x; i < width; i += blockDim.x) {
            scan(row[i], i);
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const Ds4Best c = {__shfl_xor_sync(0xffffffffu, b.idx, o), __shfl_xor_sync(0xffffffffu, b.v, o)};
        if (ds4_best_takes(b, c)) {
            b = c;
        }
    }
    bad = __syncthreads_or(bad) != 0;
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        s_idx[warp] = b.idx;
        s_v[warp] = b.v;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) {
            const Ds4Best c = {s_idx[w], s_v[w]};
            if (ds4_best_takes(b, c)) {
                b = c;
            }
        }
        const float x0 = width > 0 ? row[0] : 0.0f;
        const u32 id = (x0 != x0 || b.idx < 0) ? 0u : (u32)b.idx;
        out[blockIdx.x] = id | ((bad || b.idx < 0) ? 0x80000000u : 0u);
    }
}
