// ds4 CUDA kernels of the device-resident decode: the attention state and attention (see
// rust/engine/backend/cuda/decode/). Conventions as in decode_ops.cu: `step[0]` is the position
// of batch row 0 (row r is at step[0] + r); every batch row is computed by the same code in the
// same order whatever the batch size (row invariance).
//
// Device state of one layer (floats):
// - ring [slots, head_dim]: the raw K=V rows, position p in slot p % slots.
// - a compressor (main: width = head_dim; indexer: width = index_head_dim), ratio R, overlap ov
//   (1 for CSA, 0 for HCA), pw = (ov ? 2 : 1) * width: cur_kv [R * pw], cur_score [R * pw],
//   prev [2 * R * width] (prev_kv then prev_score; overlap only), rows [cap, width]: row w is
//   emitted when position w * R + R - 1 is processed.
//
// Dot products follow rust/engine/backend/cpu.rs dot_f32 on x86 (AVX2): 16 fused accumulators
// (element i into accumulator i % 16), then the fixed lane sum (a[l] + a[l + 8], then + 4,
// + 2, + 1), so the indexer's scores, which choose the top-k rows, agree with the CPU's bit
// for bit. Lengths are multiples of 16.

// ---- 1. raw window ring

// ring[((step[0] + r) % slots) * head_dim + i] = kv[r * head_dim + i]. Grid (n), any block.
extern "C" __global__ void ds4_ring_write(const float* __restrict__ kv, float* __restrict__ ring, int slots,
                                          int head_dim, const int* __restrict__ step) {
    const int r = blockIdx.x;
    const long long pos = (long long)step[0] + r;
    float* dst = ring + (pos % slots) * head_dim;
    const float* src = kv + (long long)r * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        dst[i] = src[i];
    }
}

// ---- 2. compressor (rust/engine/state/layer.rs CompressorState::push, then
// rust/engine/model/forward.rs compress_step's norm, rope and rounding of an emitted row)

// Most features of a compressed row.
#define DS4_COMP_MAX_WIDTH 1024

// Feeds rows r = 0..n-1 (in order) of kv and gate ([n, pw] each) to one compressor. ape is
// [R, pw], norm [width], inv_freq [rope_dim / 2]. When the row closes a window (and overlap),
// prev is first saved to backup + r * 2 * R * width (16 areas), so the host can undo a
// rejected row's window close. round_mode: ds4_round_store's mode. Grid (1); block a multiple
// of 32, at most 1024 (the host launches 256); the same block size for every launch (the RMS
// sum's tree depends on it). width <= DS4_COMP_MAX_WIDTH.
extern "C" __global__ void ds4_compress(const float* __restrict__ kv, const float* __restrict__ gate,
                                        const float* __restrict__ ape, const float* __restrict__ norm, float eps,
                                        float* cur_kv, float* cur_score, float* prev, float* backup, float* rows,
                                        int width, int ratio, int overlap, const float* __restrict__ inv_freq,
                                        int rope_dim, int round_mode, int n, const int* __restrict__ step) {
    __shared__ double red[32];
    __shared__ float row[DS4_COMP_MAX_WIDTH];
    const int R = ratio;
    const int pw = (overlap ? 2 : 1) * width;
    const int own = overlap ? width : 0;
    float* prev_kv = prev;
    float* prev_score = overlap ? prev + (long long)R * width : nullptr;
    const long long pos0 = step[0];
    for (int r = 0; r < n; r++) {
        const long long pos = pos0 + r;
        const int slot = (int)(pos % R);
        // CompressorState::push: store the slot (score = gate + ape of the slot).
        const float* kr = kv + (long long)r * pw;
        const float* gr = gate + (long long)r * pw;
        const float* ar = ape + (long long)slot * pw;
        for (int f = threadIdx.x; f < pw; f += blockDim.x) {
            cur_kv[slot * pw + f] = kr[f];
            cur_score[slot * pw + f] = gr[f] + ar[f];
        }
        __syncthreads();
        if ((pos + 1) % R != 0) {
            continue;
        }
        if (overlap) {
            float* b = backup + (long long)r * 2 * R * width;
            for (int i = threadIdx.x; i < 2 * R * width; i += blockDim.x) {
                b[i] = prev[i];
            }
        }
        // Pool each feature: softmax over the candidates (the previous window's Ca slots when
        // overlapping, then this window's own slots), in the reference's order.
        for (int f = threadIdx.x; f < width; f += blockDim.x) {
            float m = __int_as_float(0xff800000);  // -inf
            if (overlap) {
                for (int j = 0; j < R; j++) {
                    m = fmaxf(m, prev_score[j * width + f]);
                }
            }
            for (int j = 0; j < R; j++) {
                m = fmaxf(m, cur_score[j * pw + own + f]);
            }
            float denom = 0.0f;
            if (overlap) {
                for (int j = 0; j < R; j++) {
                    denom += expf(prev_score[j * width + f] - m);
                }
            }
            for (int j = 0; j < R; j++) {
                denom += expf(cur_score[j * pw + own + f] - m);
            }
            float acc = 0.0f;
            if (overlap) {
                for (int j = 0; j < R; j++) {
                    acc += prev_kv[j * width + f] * (expf(prev_score[j * width + f] - m) / denom);
                }
            }
            for (int j = 0; j < R; j++) {
                acc += cur_kv[j * pw + own + f] * (expf(cur_score[j * pw + own + f] - m) / denom);
            }
            row[f] = acc;
        }
        __syncthreads();
        // compress_step: rms_norm with the weight, rope at the window's first position, rounding.
        const float s = ds4_rms_scale(row, width, eps, red);
        for (int f = threadIdx.x; f < width; f += blockDim.x) {
            row[f] = norm[f] * (row[f] * s);
        }
        __syncthreads();
        const int rpos = (int)(pos + 1 - R);
        for (int i = threadIdx.x; i < rope_dim / 2; i += blockDim.x) {
            ds4_rope_pair(row, width, inv_freq, rope_dim, rpos, i, false);
        }
        __syncthreads();
        float* out = rows + (pos / R) * width;
        for (int f = threadIdx.x; f < width; f += blockDim.x) {
            out[f] = ds4_round_store(row[f], round_mode);
        }
        // The window's Ca halves become the previous window's.
        if (overlap) {
            for (int i = threadIdx.x; i < R * width; i += blockDim.x) {
                const int j = i / width;
                const int f = i - j * width;
                prev_kv[i] = cur_kv[j * pw + f];
                prev_score[i] = cur_score[j * pw + f];
            }
        }
        __syncthreads();
    }
}

// ---- 3 and 4. the lightning indexer (rust/engine/model/indexer.rs select)

// cpu.rs dot_f32's (x86) lane sum of 16 accumulators.
__device__ __forceinline__ float ds4_dot_lanes(const float* a) {
    float v[8];
#pragma unroll
    for (int l = 0; l < 8; l++) {
        v[l] = a[l] + a[l + 8];
    }
    const float q0 = v[0] + v[4];
    const float q1 = v[1] + v[5];
    const float q2 = v[2] + v[6];
    const float q3 = v[3] + v[7];
    return (q0 + q2) + (q1 + q3);
}

// The score of one indexer row against all heads: Σ_h (max(q_h · k, 0) * scale) * g_h, heads in
// order; q and g in shared memory, k (HD floats) in registers.
template <int HD>
__device__ __forceinline__ float ds4_index_score_regs(const float* qs, const float* gs, int heads, float scale,
                                                      const float* k) {
    float total = 0.0f;
    for (int h = 0; h < heads; h++) {
        const float* qh = qs + h * HD;
        float a[16];
#pragma unroll
        for (int l = 0; l < 16; l++) {
            a[l] = 0.0f;
        }
#pragma unroll
        for (int c = 0; c < HD / 16; c++) {
#pragma unroll
            for (int l4 = 0; l4 < 4; l4++) {
                const float4 qv = *reinterpret_cast<const float4*>(qh + 16 * c + 4 * l4);
                a[4 * l4 + 0] = fmaf(qv.x, k[16 * c + 4 * l4 + 0], a[4 * l4 + 0]);
                a[4 * l4 + 1] = fmaf(qv.y, k[16 * c + 4 * l4 + 1], a[4 * l4 + 1]);
                a[4 * l4 + 2] = fmaf(qv.z, k[16 * c + 4 * l4 + 2], a[4 * l4 + 2]);
                a[4 * l4 + 3] = fmaf(qv.w, k[16 * c + 4 * l4 + 3], a[4 * l4 + 3]);
            }
        }
        const float d = ds4_dot_lanes(a);
        total += (fmaxf(d, 0.0f) * scale) * gs[h];
    }
    return total;
}

// The same for any head_dim (a multiple of 16), k read from memory.
__device__ __forceinline__ float ds4_index_score_mem(const float* qs, const float* gs, int heads, int hd,
                                                     float scale, const float* k) {
    float total = 0.0f;
    for (int h = 0; h < heads; h++) {
        const float* qh = qs + h * hd;
        float a[16];
#pragma unroll
        for (int l = 0; l < 16; l++) {
            a[l] = 0.0f;
        }
        for (int c = 0; c < hd; c += 16) {
#pragma unroll
            for (int l = 0; l < 16; l++) {
                a[l] = fmaf(qh[c + l], k[c + l], a[l]);
            }
        }
        const float d = ds4_dot_lanes(a);
        total += (fmaxf(d, 0.0f) * scale) * gs[h];
    }
    return total;
}

// Most query floats (heads * head_dim) and heads ds4_index_scores keeps in shared memory (more
// are read from global memory, with the same results).
#define DS4_INDEX_MAX_Q 8192
#define DS4_INDEX_MAX_HEADS 128

// scores[r * score_stride + s] = Σ_h (max(q_h · K_s, 0) * scale) * g[r * heads + h] for every
// visible indexer row s < n_vis = (pos + 1) / ratio, when n_vis > topk (else the row does
// nothing: every row is selected). iq [n, heads * head_dim], g [n, heads], irows [cap, head_dim].
// Grid (bx, n) for any bx; one thread per indexer row s (grid-stride over blockIdx.x), so the
// block size (a multiple of 32, at most 256) changes nothing in the results. No dynamic shared
// memory. head_dim a multiple of 16.
extern "C" __global__ void __launch_bounds__(256)
    ds4_index_scores(const float* __restrict__ iq, const float* __restrict__ g, const float* __restrict__ irows,
                     int heads, int head_dim, int ratio, int topk, float* __restrict__ scores, int score_stride,
                     const int* __restrict__ step) {
    __shared__ __align__(16) float q_sh[DS4_INDEX_MAX_Q];
    __shared__ float g_sh[DS4_INDEX_MAX_HEADS];
    const int r = blockIdx.y;
    const long long pos = (long long)step[0] + r;
    const int n_vis = (int)((pos + 1) / ratio);
    if (n_vis <= topk) {
        return;
    }
    const float* qr = iq + (long long)r * heads * head_dim;
    const float* gr = g + (long long)r * heads;
    const bool q_fits = heads * head_dim <= DS4_INDEX_MAX_Q;
    const bool g_fits = heads <= DS4_INDEX_MAX_HEADS;
    if (q_fits) {
        for (int i = threadIdx.x; i < heads * head_dim; i += blockDim.x) {
            q_sh[i] = qr[i];
        }
    }
    if (g_fits) {
        for (int h = threadIdx.x; h < heads; h += blockDim.x) {
            g_sh[h] = gr[h];
        }
    }
    __syncthreads();
    const float* qs = q_fits ? q_sh : qr;
    const float* gs = g_fits ? g_sh : gr;
    const float scale = 1.0f / sqrtf((float)head_dim);
    float* out = scores + (long long)r * score_stride;
    const int stride = gridDim.x * blockDim.x;
    // Keys in registers and the query in shared memory, or the general path.
    const bool fast = q_fits && g_fits && ((unsigned long long)irows & 15ull) == 0ull;
    for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < n_vis; s += stride) {
        const float* k = irows + (long long)s * head_dim;
        float score;
        if (head_dim == 128 && fast) {
            float kr[128];
#pragma unroll
            for (int i = 0; i < 128; i += 4) {
                const float4 v = *reinterpret_cast<const float4*>(k + i);
                kr[i] = v.x;
                kr[i + 1] = v.y;
                kr[i + 2] = v.z;
                kr[i + 3] = v.w;
            }
            score = ds4_index_score_regs<128>(q_sh, g_sh, heads, scale, kr);
        } else if (head_dim == 64 && fast) {
            float kr[64];
#pragma unroll
            for (int i = 0; i < 64; i += 4) {
                const float4 v = *reinterpret_cast<const float4*>(k + i);
                kr[i] = v.x;
                kr[i + 1] = v.y;
                kr[i + 2] = v.z;
                kr[i + 3] = v.w;
            }
            score = ds4_index_score_regs<64>(q_sh, g_sh, heads, scale, kr);
        } else {
            score = ds4_index_score_mem(qs, gs, heads, head_dim, scale, k);
        }
        out[s] = score;
    }
}

// A u32 key whose unsigned order is f32::total_cmp's order.
__device__ __forceinline__ u32 ds4_score_key(float x) {
    const u32 b = __float_as_uint(x);
    return b ^ ((b & 0x80000000u) ? 0xffffffffu : 0x80000000u);
}

// Exclusive prefix sum over the block of one u32 per thread (every thread calls it);
// `*total` gets the block's sum. `ws` is shared scratch of 33 u32. Ends with a barrier.
__device__ __forceinline__ u32 ds4_block_scan_u32(u32 v, u32* ws, u32* total) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    u32 x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) {
            x += y;
        }
    }
    if (lane == 31) {
        ws[warp] = x;
    }
    __syncthreads();
    if (warp == 0) {
        u32 w = lane < nw ? ws[lane] : 0u;
        for (int o = 1; o < 32; o <<= 1) {
            const u32 y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) {
                w += y;
            }
        }
        ws[lane] = w;  // inclusive sums of the warps
    }
    __syncthreads();
    const u32 before = (warp > 0 ? ws[warp - 1] : 0u) + x - v;
    *total = ws[nw - 1];
    __syncthreads();
    return before;
}

// The top-k of each row's scores (indexer.rs select): with n_vis = (pos + 1) / ratio, if
// n_vis <= topk every row is selected (sel[r * topk + i] = i, nsel[r] = n_vis); else the topk
// indices with the highest scores under (score descending by f32 total_cmp, index ascending),
// in ascending index order, and nsel[r] = topk. Radix select of the topk-th largest key
// (8 bits per pass), then an in-order compaction of the keys above it and the first ties.
// Grid (n); block a multiple of 32, at most 1024 (1024 suggested).
extern "C" __global__ void __launch_bounds__(1024)
    ds4_index_topk(const float* __restrict__ scores, int score_stride, int ratio, int topk, int* __restrict__ sel,
                   int* __restrict__ nsel, const int* __restrict__ step) {
    __shared__ u32 hist[256];
    __shared__ u32 ws[33];
    __shared__ u32 s_digit;
    __shared__ u32 s_krem;
    const int r = blockIdx.x;
    const long long pos = (long long)step[0] + r;
    const int n_vis = (int)((pos + 1) / ratio);
    int* out = sel + (long long)r * topk;
    if (n_vis <= topk) {
        for (int i = threadIdx.x; i < n_vis; i += blockDim.x) {
            out[i] = i;
        }
        if (threadIdx.x == 0) {
            nsel[r] = n_vis;
        }
        return;
    }
    const float* sc = scores + (long long)r * score_stride;
    // Radix select: the prefix of the topk-th largest key, 8 bits at a time from the top;
    // krem = how many of the keys matching the prefix are still to be taken.
    u32 prefix = 0u;
    u32 mask = 0u;
    u32 krem = (u32)topk;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) {
            hist[b] = 0u;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n_vis; i += blockDim.x) {
            const u32 key = ds4_score_key(sc[i]);
            if ((key & mask) == prefix) {
                atomicAdd(&hist[(key >> shift) & 255u], 1u);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 cum = 0u;
            for (int b = 255; b >= 0; b--) {
                const u32 c = hist[b];
                if (cum + c >= krem) {
                    s_digit = (u32)b;
                    s_krem = krem - cum;
                    break;
                }
                cum += c;
            }
        }
        __syncthreads();
        prefix |= s_digit << shift;
        mask |= 255u << shift;
        krem = s_krem;
        __syncthreads();
    }
    // Keys above the threshold all go in; of those equal to it, the `need` lowest indices.
    const u32 thr = prefix;
    const u32 need = krem;
    u32 gt_total = 0u;  // keys > thr before the chunk
    u32 eq_total = 0u;  // keys == thr before the chunk
    for (int base = 0; base < n_vis; base += blockDim.x) {
        const int i = base + threadIdx.x;
        u32 gt = 0u;
        u32 eq = 0u;
        if (i < n_vis) {
            const u32 key = ds4_score_key(sc[i]);
            gt = key > thr ? 1u : 0u;
            eq = key == thr ? 1u : 0u;
        }
        u32 total;
        const u32 before = ds4_block_scan_u32((gt << 16) | eq, ws, &total);
        const u32 gb = gt_total + (before >> 16);
        const u32 eb = eq_total + (before & 0xffffu);
        if (gt) {
            out[gb + (eb < need ? eb : need)] = i;
        } else if (eq && eb < need) {
            out[gb + eb] = i;
        }
        gt_total += total >> 16;
        eq_total += total & 0xffffu;
        if (gt_total + need == (u32)topk && eq_total >= need) {
            break;  // all taken (the same decision in every thread)
        }
    }
    if (threadIdx.x == 0) {
        nsel[r] = topk;
    }
}

// ---- 5. attention with sinks (rust/engine/model/attention.rs attend, then the inverse rope
// of rust/engine/model/forward.rs Model::attention)

// One (head, row) per block: keys are the raw rows of positions max(0, pos - window + 1) ..= pos
// (from the ring), then, if crows: the selected compressed rows crows[sel[r * sel_stride + i]]
// for i < nsel[r] when sel (CSA), else rows 0 .. (pos + 1) / ratio (HCA). Every key is also
// its value. q [n, n_heads * head_dim]; sinks [n_heads]; out in the grouped layout
// out[((g * n + r) * hpg + h % hpg) * head_dim + i], hpg = n_heads / groups, g = h / hpg.
// Grid (n_heads, n); block a multiple of 32 (256 suggested); dynamic shared memory
// (window + max_compressed + head_dim) * 4 bytes, max_compressed = the most compressed keys
// any row has. head_dim a multiple of 16.
extern "C" __global__ void ds4_attention(const float* __restrict__ q, const float* __restrict__ ring, int slots,
                                         int window, const float* __restrict__ crows, int ratio,
                                         const int* __restrict__ sel, const int* __restrict__ nsel, int sel_stride,
                                         const float* __restrict__ sinks, int n_heads, int head_dim,
                                         float* __restrict__ out, int groups, const float* __restrict__ inv_freq,
                                         int rope_dim, const int* __restrict__ step) {
    extern __shared__ __align__(16) float ds4_attn_smem[];
    __shared__ double red[32];
    const int h = blockIdx.x;
    const int r = blockIdx.y;
    const int n = gridDim.y;
    const long long pos = (long long)step[0] + r;
    float* qs = ds4_attn_smem;              // the query head, later the output
    float* lg = ds4_attn_smem + head_dim;   // logits, later weights
    const long long lo = pos + 1 > window ? pos + 1 - window : 0;
    const int nraw = (int)(pos - lo + 1);
    const int* selr = sel ? sel + (long long)r * sel_stride : nullptr;
    int ncomp = 0;
    if (crows) {
        ncomp = sel ? nsel[r] : (int)((pos + 1) / ratio);
    }
    const int nk = nraw + ncomp;
    const int lo_slot = (int)(lo % slots);
    const float* qh = q + ((long long)r * n_heads + h) * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        qs[i] = qh[i];
    }
    __syncthreads();

    // Logits: half a warp per key, lane l accumulates the elements i with i % 16 == l.
    const float scale = 1.0f / sqrtf((float)head_dim);
    const int lane = threadIdx.x & 31;
    const int half = lane >> 4;
    const int l16 = lane & 15;
    const int warp = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    for (int jb = 2 * warp; jb < nk; jb += 2 * nw) {
        const int j = jb + half;
        float a = 0.0f;
        if (j < nk) {
            const float* k;
            if (j < nraw) {
                int s = lo_slot + j;
                if (s >= slots) {
                    s -= slots;
                }
                k = ring + (long long)s * head_dim;
            } else {
                const int c = j - nraw;
                k = crows + (long long)(selr ? selr[c] : c) * head_dim;
            }
            for (int c = l16; c < head_dim; c += 16) {
                a = fmaf(qs[c], k[c], a);
            }
        }
        // The x86 lane sum: a[l] + a[l + 8], then + 4, + 2, + 1 (within each half warp).
        a = a + __shfl_down_sync(0xffffffffu, a, 8);
        a = a + __shfl_down_sync(0xffffffffu, a, 4);
        a = a + __shfl_down_sync(0xffffffffu, a, 2);
        a = a + __shfl_down_sync(0xffffffffu, a, 1);
        if (l16 == 0 && j < nk) {
            lg[j] = a * scale;
        }
    }
    __syncthreads();

    // Softmax with the sink: M = max(sink, logits); weights e^{l - M} / denom.
    const float sink = sinks[h];
    float m = sink;
    for (int j = threadIdx.x; j < nk; j += blockDim.x) {
        m = fmaxf(m, lg[j]);
    }
    m = ds4_block_max(m, (float*)red);
    double part = 0.0;
    for (int j = threadIdx.x; j < nk; j += blockDim.x) {
        const float e = expf(lg[j] - m);
        lg[j] = e;
        part += (double)e;
    }
    const double sum = ds4_block_sum_f64(part, red);
    const float denom = (float)((double)expf(sink - m) + sum);
    for (int j = threadIdx.x; j < nk; j += blockDim.x) {
        lg[j] = lg[j] / denom;
    }
    __syncthreads();

    // o = Σ_j w_j k_j, keys in order, one fused multiply-add per key (cpu.rs weighted_sum).
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        float acc = 0.0f;
        int s = lo_slot;
        for (int j = 0; j < nraw; j++) {
            acc = fmaf(lg[j], ring[(long long)s * head_dim + i], acc);
            s = s + 1 == slots ? 0 : s + 1;
        }
        for (int c = 0; c < ncomp; c++) {
            const long long w = selr ? selr[c] : c;
            acc = fmaf(lg[nraw + c], crows[w * head_dim + i], acc);
        }
        qs[i] = acc;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rope_dim / 2; i += blockDim.x) {
        ds4_rope_pair(qs, head_dim, inv_freq, rope_dim, (int)pos, i, true);
    }
    __syncthreads();
    const int hpg = n_heads / groups;
    const int g = h / hpg;
    float* o = out + (((long long)g * n + r) * hpg + (h % hpg)) * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        o[i] = qs[i];
    }
}
