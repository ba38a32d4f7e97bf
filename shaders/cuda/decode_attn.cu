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
// The indexer's dot products follow rust/engine/backend/cpu.rs dot_f32 on x86 (AVX2): 16 fused
// accumulators (element i into accumulator i % 16), then the fixed lane sum (a[l] + a[l + 8],
// then + 4, + 2, + 1), so its scores, which choose the top-k rows, agree with the CPU's bit for
// bit. (The attention's own sums, section 5, use other fixed orders.) Lengths are multiples of
// 16.

// ---- 1. raw window ring

// ring[((step[0] + r) % slots) * head_dim + i] = kv[r * head_dim + i], by one block.
__device__ __forceinline__ void ds4_ring_write_row(const float* __restrict__ kv, float* __restrict__ ring, int slots,
                                                   int head_dim, const int* __restrict__ step, int r) {
    const long long pos = (long long)step[0] + r;
    float* dst = ring + (pos % slots) * head_dim;
    const float* src = kv + (long long)r * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        dst[i] = src[i];
    }
}

// ds4_ring_write_row alone (its test). Grid (n), any block.
extern "C" __global__ void ds4_ring_write(const float* __restrict__ kv, float* __restrict__ ring, int slots,
                                          int head_dim, const int* __restrict__ step) {
    ds4_grid_deps();
    ds4_ring_write_row(kv, ring, slots, head_dim, step, blockIdx.x);
}

// The decode's one launch after the projections of a layer, row r = blockIdx.y: blocks
// x < n_heads finish query head x (decode_ops.cu ds4_finish_q_head); block n_heads finishes the
// K=V row (ds4_finish_kv_row) and then writes it to the ring; blocks n_heads + 1 + h finish
// indexer head h (ds4_finish_index_head; index_heads 0: no indexer). The same block size for
// every launch (the RMS sums' trees depend on it). Grid (n_heads + 1 + index_heads, n).
extern "C" __global__ void ds4_finish_rows(float* q, int n_heads, int head_dim, float eps, const float* inv_freq,
                                           int rope_dim, const int* step, float* kv, const float* kv_norm,
                                           int round_mode, float* ring, int slots, float* iq, float* ig,
                                           int index_heads, int index_dim, float g_scale) {
    ds4_grid_deps_then_lead(gridDim.y == 1);
    __shared__ double red[32];
    const int x = blockIdx.x;
    const int r = blockIdx.y;
    if (x < n_heads) {
        ds4_finish_q_head(q, n_heads, head_dim, eps, inv_freq, rope_dim, step, x, r, red);
    } else if (x == n_heads) {
        ds4_finish_kv_row(kv, kv_norm, head_dim, eps, inv_freq, rope_dim, round_mode, step, r, red);
        __syncthreads();
        ds4_ring_write_row(kv, ring, slots, head_dim, step, r);
    } else {
        ds4_finish_index_head(iq, ig, index_heads, index_dim, inv_freq, rope_dim, round_mode, g_scale, step,
                              x - n_heads - 1, r);
    }
}

// ---- 2. compressor (rust/engine/state/layer.rs CompressorState::push, then
// rust/engine/model/forward.rs compress_step's norm, rope and rounding of an emitted row)
//
// Staged loads: in an H200 trace a one-row launch that closed a window took about 18 us more
// than one that did not, and a 16-row launch 46 us against 8. The loops waited on one global
// load after another: without __restrict__ a copy's next load could not pass its last store
// (the backup, the shift), and the pooling went over the candidates pass after pass. Here each
// round's loads are all issued before their values are used: the slots of the rows up to a
// window's close in one copy (DS4_COMP_STAGE floats per thread at a time, one barrier before
// the close, none between rows that do not close), and a window's pooling reads each feature's
// candidates and the shift's Ca halves into registers at once (DS4_COMP_CANDS), writing the
// backup and the shifted previous window from them; the rope's cos and sin are computed while
// those loads are in flight. The arithmetic is the reference's, operation for operation, in
// the same order, so the results are unchanged.

// Most features of a compressed row.
#define DS4_COMP_MAX_WIDTH 1024
// Floats per thread that a slot copy loads before storing.
#define DS4_COMP_STAGE 8
// Features per thread that a pooling pass handles together.
#define DS4_COMP_FEATS 2
// Candidates per feature that the pooling holds in registers: all of them when ratio <= half
// this (CSA's 4: the previous window's and this one's), else it goes over each window's in
// chunks of this many, three times (max, sum, weighted sum: HCA's 128).
#define DS4_COMP_CANDS 8
// Norm weights per thread held in registers (widths up to this many times the block).
#define DS4_COMP_NORM 4

// Feeds rows r = 0..n-1 (in order) of kv and gate ([n, pw] each) to one compressor. ape is
// [R, pw], norm [width], inv_freq [rope_dim / 2]. When the row closes a window (and overlap),
// prev is first saved to backup + r * 2 * R * width (16 areas), so the host can undo a
// rejected row's window close. round_mode: ds4_round_store's mode. Grid (1); block a multiple
// of 32, at most 256 (the host launches 256: about 128 registers a thread); the same block
// size for every launch (the RMS sum's tree depends on it). width <= DS4_COMP_MAX_WIDTH,
// rope_dim <= width. The buffers are distinct allocations (none aliases another).
extern "C" __global__ void __launch_bounds__(256)
    ds4_compress(const float* __restrict__ kv, const float* __restrict__ gate, const float* __restrict__ ape,
                 const float* __restrict__ norm, float eps, float* __restrict__ cur_kv, float* __restrict__ cur_score,
                 float* __restrict__ prev, float* __restrict__ backup, float* __restrict__ rows, int width, int ratio,
                 int overlap, const float* __restrict__ inv_freq, int rope_dim, int round_mode, int n,
                 const int* __restrict__ step) {
    ds4_grid_deps_then_lead(n == 1);
    __shared__ double red[32];
    __shared__ float row[DS4_COMP_MAX_WIDTH];
    constexpr int F = DS4_COMP_FEATS;
    constexpr int C = DS4_COMP_CANDS;
    constexpr int CS = C / 2;
    const int tid = threadIdx.x;
    const int bd = blockDim.x;
    const int R = ratio;
    const int pw = (overlap ? 2 : 1) * width;
    const int own = overlap ? width : 0;
    float* prev_kv = prev;
    float* prev_score = overlap ? prev + (long long)R * width : nullptr;
    const bool fits = R <= CS;
    const long long pos0 = step[0];
    for (int r = 0; r < n;) {
        // CompressorState::push: store the slots (score = gate + ape of the slot) of rows r ..
        // r + cnt - 1, up to the one that closes the window (consecutive slots s0 ..).
        const int s0 = (int)((pos0 + r) % R);
        const int cnt = min(n - r, R - s0);
        {
            const int len = cnt * pw;
            const float* kr = kv + (long long)r * pw;
            const float* gr = gate + (long long)r * pw;
            const float* ar = ape + (long long)s0 * pw;
            float* dk = cur_kv + (long long)s0 * pw;
            float* ds = cur_score + (long long)s0 * pw;
            for (int i0 = tid; i0 < len; i0 += DS4_COMP_STAGE * bd) {
                float a[DS4_COMP_STAGE];
                float b[DS4_COMP_STAGE];
#pragma unroll
                for (int k = 0; k < DS4_COMP_STAGE; k++) {
                    const int i = i0 + k * bd;
                    a[k] = i < len ? kr[i] : 0.0f;
                    b[k] = i < len ? gr[i] + ar[i] : 0.0f;
                }
#pragma unroll
                for (int k = 0; k < DS4_COMP_STAGE; k++) {
                    const int i = i0 + k * bd;
                    if (i < len) {
                        dk[i] = a[k];
                        ds[i] = b[k];
                    }
                }
            }
        }
        r += cnt;
        if (s0 + cnt != R) {
            break;  // the launch's last rows leave the window open
        }
        const int rc = r - 1;  // the row that closes the window
        const long long pos = pos0 + rc;
        const int rpos = (int)(pos + 1 - R);
        __syncthreads();
        float nw[DS4_COMP_NORM];
#pragma unroll
        for (int k = 0; k < DS4_COMP_NORM; k++) {
            const int f = tid + k * bd;
            nw[k] = f < width ? norm[f] : 0.0f;
        }
        // The cosine and sine of this thread's rope pair (tid < rope_dim / 2 <= width / 2),
        // computed while the first pooling loads are in flight.
        float rope_c = 0.0f;
        float rope_s = 0.0f;
        bool rope_cs = false;
        float* bk = overlap ? backup + rc * 2 * R * width : nullptr;
        // Pool each feature: softmax over the candidates. Thread tid pools features tid + q * bd;
        // it alone reads and writes column f of prev (and of the backup area).
        for (int f0 = tid; f0 < width; f0 += F * bd) {
            // The candidates' scores and kvs: when they fit, candidate j of segment seg (0: the
            // previous window, 1: this one) at seg * CS + j, else a chunk of one segment's.
            float s[F][C];
            float k[F][C];
            float ca_k[F][CS];  // when they fit (overlap): the shift's Ca halves
            float ca_s[F][CS];
            if (fits) {
#pragma unroll
                for (int q = 0; q < F; q++) {
                    const int f = f0 + q * bd;
#pragma unroll
                    for (int c = 0; c < C; c++) {
                        const int seg = c / CS;
                        const int j = c % CS;
                        const bool ok = f < width && j < R && (seg == 1 || overlap);
                        const int at = seg ? j * pw + own + f : j * width + f;
                        s[q][c] = ok ? (seg ? cur_score : prev_score)[at] : 0.0f;
                        k[q][c] = ok ? (seg ? cur_kv : prev_kv)[at] : 0.0f;
                    }
#pragma unroll
                    for (int j = 0; j < CS; j++) {
                        const bool ok = overlap && f < width && j < R;
                        ca_k[q][j] = ok ? cur_kv[j * pw + f] : 0.0f;
                        ca_s[q][j] = ok ? cur_score[j * pw + f] : 0.0f;
                    }
                }
            }
            if (f0 == tid && tid < rope_dim / 2) {
                ds4_rope_cs(inv_freq, rpos, tid, rope_c, rope_s);
                rope_cs = true;
            }
            float m[F];
            float denom[F];
            float acc[F];
#pragma unroll
            for (int q = 0; q < F; q++) {
                m[q] = __int_as_float(0xff800000);  // -inf
                denom[q] = 0.0f;
                acc[q] = 0.0f;
            }
            // Pass 0 (m = the max score), 1 (s becomes expf(score - m), the softmax numerator,
            // summed into denom) or 2 (acc = the weighted sum of the kvs) on candidate j of
            // segment seg, at c in s and k; passes 0 and 2 copy the previous window's to the
            // backup area.
            auto op = [&](int pass, int c, int seg, int j) {
#pragma unroll
                for (int q = 0; q < F; q++) {
                    const int f = f0 + q * bd;
                    if (pass == 0) {
                        m[q] = fmaxf(m[q], s[q][c]);
                        if (seg == 0 && f < width) {
                            bk[(R + j) * width + f] = s[q][c];  // prev_score
                        }
                    } else if (pass == 1) {
                        s[q][c] = expf(s[q][c] - m[q]);
                        denom[q] += s[q][c];
                    } else {
                        acc[q] += k[q][c] * (s[q][c] / denom[q]);
                        if (seg == 0 && f < width) {
                            bk[j * width + f] = k[q][c];  // prev_kv
                        }
                    }
                }
            };
            // Candidates j0 .. j0 + C - 1 of this thread's columns into s (scores at ps) and,
            // with kvs, k (kvs at pk), rows `stride` floats apart; zeros past the last.
            auto load_chunk = [&](const float* ps, const float* pk, int stride, int j0, bool kvs) {
#pragma unroll
                for (int q = 0; q < F; q++) {
                    const int f = f0 + q * bd;
#pragma unroll
                    for (int c = 0; c < C; c++) {
                        const bool ok = f < width && j0 + c < R;
                        s[q][c] = ok ? ps[(j0 + c) * stride + f] : 0.0f;
                        if (kvs) {
                            k[q][c] = ok ? pk[(j0 + c) * stride + f] : 0.0f;
                        }
                    }
                }
            };
            // Runs a pass on every candidate in the reference's order (the previous window's,
            // overlap only, then this window's own); when they do not fit, loads each chunk
            // first (with the kvs and expf(score - m) for pass 2).
            auto each = [&](int pass) {
                if (fits) {
#pragma unroll
                    for (int c = 0; c < C; c++) {
                        const int seg = c / CS;
                        const int j = c % CS;
                        if ((seg == 1 || overlap) && j < R) {
                            op(pass, c, seg, j);
                        }
                    }
                    return;
                }
                for (int seg = overlap ? 0 : 1; seg < 2; seg++) {
                    const float* ps = seg ? cur_score + own : prev_score;
                    const float* pk = seg ? cur_kv + own : prev_kv;
                    const int stride = seg ? pw : width;
                    for (int j0 = 0; j0 < R; j0 += C) {
                        load_chunk(ps, pk, stride, j0, pass == 2);
                        if (pass == 2) {
#pragma unroll
                            for (int q = 0; q < F; q++) {
#pragma unroll
                                for (int c = 0; c < C; c++) {
                                    s[q][c] = expf(s[q][c] - m[q]);
                                }
                            }
                        }
#pragma unroll
                        for (int c = 0; c < C; c++) {
                            if (j0 + c < R) {
                                op(pass, c, seg, j0 + c);
                            }
                        }
                    }
                }
            };
            each(0);
            each(1);
            each(2);
#pragma unroll
            for (int q = 0; q < F; q++) {
                const int f = f0 + q * bd;
                if (f < width) {
                    row[f] = acc[q];
                }
            }
            // The window's Ca halves become the previous window's (this thread's columns, all
            // read above).
            if (overlap && fits) {
#pragma unroll
                for (int q = 0; q < F; q++) {
                    const int f = f0 + q * bd;
#pragma unroll
                    for (int j = 0; j < CS; j++) {
                        if (f < width && j < R) {
                            prev_kv[j * width + f] = ca_k[q][j];
                            prev_score[j * width + f] = ca_s[q][j];
                        }
                    }
                }
            } else if (overlap) {
                for (int j0 = 0; j0 < R; j0 += C) {
                    load_chunk(cur_score, cur_kv, pw, j0, true);
#pragma unroll
                    for (int q = 0; q < F; q++) {
                        const int f = f0 + q * bd;
#pragma unroll
                        for (int c = 0; c < C; c++) {
                            if (f < width && j0 + c < R) {
                                prev_kv[(j0 + c) * width + f] = k[q][c];
                                prev_score[(j0 + c) * width + f] = s[q][c];
                            }
                        }
                    }
                }
            }
        }
        __syncthreads();
        // compress_step: rms_norm with the weight, rope at the window's first position, rounding.
        const float sc = ds4_rms_scale(row, width, eps, red);
#pragma unroll
        for (int k = 0; k < DS4_COMP_NORM; k++) {
            const int f = tid + k * bd;
            if (f < width) {
                row[f] = nw[k] * (row[f] * sc);
            }
        }
        for (int f = tid + DS4_COMP_NORM * bd; f < width; f += bd) {
            row[f] = norm[f] * (row[f] * sc);
        }
        __syncthreads();
        for (int i = tid; i < rope_dim / 2; i += bd) {
            if (i == tid && rope_cs) {  // (always, unless the block is smaller than rope_dim / 2)
                ds4_rope_rotate(row + (width - rope_dim) + 2 * i, rope_c, rope_s);
            } else {
                ds4_rope_pair(row, width, inv_freq, rope_dim, rpos, i, false);
            }
        }
        __syncthreads();
        float* out = rows + (pos / R) * width;
        for (int f = tid; f < width; f += bd) {
            out[f] = ds4_round_store(row[f], round_mode);
        }
        // The next rows' slots overwrite what this window read.
        __syncthreads();
    }
}

// A compressor's candidate at slot j (position p = j mod R) of the window starting at `wstart`,
// feature column `col` of the pw-wide slot: from the launch's row p - pos0 when the launch has
// it (its score gate + ape, as CompressorState::push stores it), else from the state's slot
// (which a launch stores before it is read). What ds4_compress would find in cur_kv and
// cur_score at the window's close.
__device__ __forceinline__ void ds4_comp_cand(const float* __restrict__ kv, const float* __restrict__ gate,
                                              const float* __restrict__ ape, const float* __restrict__ cur_kv,
                                              const float* __restrict__ cur_score, int pw, long long pos0,
                                              long long wstart, int j, int col, float& score, float& value) {
    const long long p = wstart + j;
    if (p >= pos0) {
        const long long at = (p - pos0) * pw + col;
        value = kv[at];
        score = gate[at] + ape[(long long)j * pw + col];
    } else {
        value = cur_kv[(long long)j * pw + col];
        score = cur_score[(long long)j * pw + col];
    }
}

// ds4_compress's work for a prompt's step (many rows) in two launches that run its windows side
// by side: in one block, window after window, a Flash CSA layer's 64 window closes of a 256-row
// step took 426 us (its indexer's 309; H200, CUPTI trace). ds4_compress_windows emits the rows
// (and fills the backup areas) of the launch's windows, one block a window close, reading the
// state but writing none of it; ds4_compress_state then leaves the state as ds4_compress does.
// Each value is computed by ds4_compress's float operations in its order (the pooling's max,
// exponentials, sum and weighted sum over the candidates, the previous window's first; the RMS
// sum's tree of a 256-thread block; the rope; the rounding), so the two launches write the same
// bits. Arguments as for ds4_compress.
//
// Block c takes the launch's c-th window close, at row rc = (R - 1 - pos0 mod R) + c R (none
// when rc >= n). Grid (ceil(n / R)), block 256 (as ds4_compress's, for the RMS sum's tree).
extern "C" __global__ void __launch_bounds__(256)
    ds4_compress_windows(const float* __restrict__ kv, const float* __restrict__ gate, const float* __restrict__ ape,
                         const float* __restrict__ norm, float eps, const float* __restrict__ cur_kv,
                         const float* __restrict__ cur_score, const float* __restrict__ prev,
                         float* __restrict__ backup, float* __restrict__ rows, int width, int ratio, int overlap,
                         const float* __restrict__ inv_freq, int rope_dim, int round_mode, int n,
                         const int* __restrict__ step) {
    ds4_grid_deps();
    __shared__ double red[32];
    __shared__ float row[DS4_COMP_MAX_WIDTH];
    const int R = ratio;
    const int pw = (overlap ? 2 : 1) * width;
    const int own = overlap ? width : 0;
    const long long pos0 = step[0];
    const int rc = (int)(R - 1 - pos0 % R) + (int)blockIdx.x * R;
    if (rc >= n) {
        return;
    }
    const long long pos = pos0 + rc;
    const long long wstart = pos + 1 - R;
    float* bk = overlap ? backup + (long long)rc * 2 * R * width : nullptr;
    // Candidate j of segment seg (0: the previous window, overlap only; 1: this one) at feature f.
    auto cand = [&](int seg, int j, int f, float& score, float& value) {
        if (seg == 1) {
            ds4_comp_cand(kv, gate, ape, cur_kv, cur_score, pw, pos0, wstart, j, own + f, score, value);
        } else if (blockIdx.x == 0) {
            // The window before the launch's first close: the state's previous window.
            value = prev[(long long)j * width + f];
            score = prev[(long long)(R + j) * width + f];
        } else {
            ds4_comp_cand(kv, gate, ape, cur_kv, cur_score, pw, pos0, wstart - R, j, f, score, value);
        }
    };
    for (int f = threadIdx.x; f < width; f += blockDim.x) {
        float m = __int_as_float(0xff800000);  // -inf
        for (int seg = overlap ? 0 : 1; seg < 2; seg++) {
            for (int j = 0; j < R; j++) {
                float s, v;
                cand(seg, j, f, s, v);
                m = fmaxf(m, s);
                if (seg == 0) {
                    bk[(R + j) * width + f] = s;  // prev_score
                }
            }
        }
        float denom = 0.0f;
        for (int seg = overlap ? 0 : 1; seg < 2; seg++) {
            for (int j = 0; j < R; j++) {
                float s, v;
                cand(seg, j, f, s, v);
                denom += expf(s - m);
            }
        }
        float acc = 0.0f;
        for (int seg = overlap ? 0 : 1; seg < 2; seg++) {
            for (int j = 0; j < R; j++) {
                float s, v;
                cand(seg, j, f, s, v);
                acc += v * (expf(s - m) / denom);
                if (seg == 0) {
                    bk[j * width + f] = v;  // prev_kv
                }
            }
        }
        row[f] = acc;
    }
    __syncthreads();
    // compress_step: rms_norm with the weight, rope at the window's first position, rounding.
    const float sc = ds4_rms_scale(row, width, eps, red);
    for (int f = threadIdx.x; f < width; f += blockDim.x) {
        row[f] = norm[f] * (row[f] * sc);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rope_dim / 2; i += blockDim.x) {
        ds4_rope_pair(row, width, inv_freq, rope_dim, (int)wstart, i, false);
    }
    __syncthreads();
    float* out = rows + (pos / R) * width;
    for (int f = threadIdx.x; f < width; f += blockDim.x) {
        out[f] = ds4_round_store(row[f], round_mode);
    }
}

// The state after ds4_compress_windows (see there): each slot holds the launch's last row of
// that slot (its kv and score), or what it held; with overlap, prev holds the first halves of
// the slots of the launch's last closed window (none closed: unchanged). Thread (j, col) reads
// slot j's column col before it writes it, and no other thread reads it. Grid
// (ceil(R * pw / 256)), block 256.
extern "C" __global__ void ds4_compress_state(const float* __restrict__ kv, const float* __restrict__ gate,
                                              const float* __restrict__ ape, float* __restrict__ cur_kv,
                                              float* __restrict__ cur_score, float* __restrict__ prev, int width,
                                              int ratio, int overlap, int n, const int* __restrict__ step) {
    ds4_grid_deps();
    const int R = ratio;
    const int pw = (overlap ? 2 : 1) * width;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)R * pw) {
        return;
    }
    const int j = (int)(i / pw);
    const int col = (int)(i - (long long)j * pw);
    const long long pos0 = step[0];
    const int s0 = (int)(pos0 % R);
    const int first_close = R - 1 - s0;
    if (overlap && col < width && first_close < n) {
        const int rc = first_close + (n - 1 - first_close) / R * R;
        float score, value;
        ds4_comp_cand(kv, gate, ape, cur_kv, cur_score, pw, pos0, pos0 + rc + 1 - R, j, col, score, value);
        prev[(long long)j * width + col] = value;
        prev[(long long)(R + j) * width + col] = score;
    }
    const int r_first = (j - s0 + R) % R;  // the launch's first row in slot j
    if (r_first < n) {
        const long long r = r_first + (long long)(n - 1 - r_first) / R * R;
        cur_kv[(long long)j * pw + col] = kv[r * pw + col];
        cur_score[(long long)j * pw + col] = gate[r * pw + col] + ape[(long long)j * pw + col];
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

// ds4_index_score_regs of the row at k (HD floats in global memory, 16-byte aligned), loaded
// into registers first.
template <int HD>
__device__ __forceinline__ float ds4_index_score_row(const float* qs, const float* gs, int heads, float scale,
                                                     const float* k) {
    float kr[HD];
#pragma unroll
    for (int i = 0; i < HD; i += 4) {
        const float4 v = *reinterpret_cast<const float4*>(k + i);
        kr[i] = v.x;
        kr[i + 1] = v.y;
        kr[i + 2] = v.z;
        kr[i + 3] = v.w;
    }
    return ds4_index_score_regs<HD>(qs, gs, heads, scale, kr);
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
// Most sweeps of rows whose terms ds4_index_scores_by_head holds between two barriers, and the
// shared floats that hold them.
#define DS4_INDEX_BATCH 8
#define DS4_INDEX_TERMS 2304

// The wide indexer kernels (the default; DS4_CUDA_INDEX=row compiles the program without them,
// rust/engine/backend/cuda/context.rs): the scores one thread per (row, head)
// (ds4_index_scores_by_head) and the top-k's digit by a block scan. The same results by
// construction (the decode's index tests check both ways bitwise against the CPU). On an H200,
// Flash decode past the top-k size (2100-token context, filled experts): 9.18 ms a step against
// 10.31 with DS4_CUDA_INDEX=row, 9.12 against 10.24 ms for steps in a row.
#ifdef DS4_INDEX_ROW
#define DS4_INDEX_WIDE_ON false
#else
#define DS4_INDEX_WIDE_ON true
#endif

// ds4_index_scores with one thread per (row, head) rather than per row, for head_dim 128 and
// heads dividing the block: thread t takes head h = t % heads of the block's row t / heads,
// with its query head in registers, and row s's terms are then added in head order by one
// thread. Every term and the sum are ds4_index_score_regs' operations in its order, so the
// scores are bitwise the same; what changes is the latency: one thread per row ran 64 heads x
// 128 FMAs in sequence, and at the Flash shape a row just past the top-k size (n_vis = 513)
// left all but 3 blocks idle (10.7 us a launch this way, in a CUPTI trace of Flash steps).
//
// A sweep computes the terms of `per` rows; up to DS4_INDEX_BATCH sweeps (as many as the
// busiest block has, at most 32 rows) fill the shared terms before a barrier, and then one
// thread a row adds that row's terms, all the batch's rows at once. With one sweep a barrier, a
// prompt's step (one block a row, some 600 indexer rows each) waited on one thread's chain of 64
// dependent adds every 4 rows: 634 us a Flash CSA layer for 256 rows (H200, CUPTI trace). A
// row's terms are `heads + 1` floats apart, so the adding threads read distinct banks.
__device__ __forceinline__ void ds4_index_scores_by_head(const float* __restrict__ qr, const float* g_sh, int heads,
                                                         float scale, const float* __restrict__ irows, int n_vis,
                                                         float* out) {
    __shared__ float terms[DS4_INDEX_TERMS];
    const int h = (int)threadIdx.x % heads;
    const int lr = (int)threadIdx.x / heads;
    const int per = (int)blockDim.x / heads;  // rows per block and sweep
    const int hp = heads + 1;
    const int span = (int)gridDim.x * per;
    int batch = min((n_vis + span - 1) / span, DS4_INDEX_BATCH);
    batch = min(batch, max(1, 32 / per));
    batch = max(1, min(batch, DS4_INDEX_TERMS / (per * hp)));
    const int rows_b = batch * per;  // rows per block and batch
    float q[128];
#pragma unroll
    for (int i = 0; i < 128; i += 4) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(qr + (long long)h * 128 + i));
        q[i] = v.x;
        q[i + 1] = v.y;
        q[i + 2] = v.z;
        q[i + 3] = v.w;
    }
    const float gh = g_sh[h];
    // Every thread runs the same batches (the barriers below).
    for (int s0 = blockIdx.x * rows_b; s0 < n_vis; s0 += gridDim.x * rows_b) {
        for (int i = 0; i < batch; i++) {
            const int j = i * per + lr;  // the row's place in the batch
            const int s = s0 + j;
            float term = 0.0f;
            if (s < n_vis) {
                const float* k = irows + (long long)s * 128;
                float a[16];
#pragma unroll
                for (int l = 0; l < 16; l++) {
                    a[l] = 0.0f;
                }
#pragma unroll
                for (int c = 0; c < 8; c++) {
#pragma unroll
                    for (int l4 = 0; l4 < 4; l4++) {
                        const float4 kv = __ldg(reinterpret_cast<const float4*>(k + 16 * c + 4 * l4));
                        a[4 * l4 + 0] = fmaf(q[16 * c + 4 * l4 + 0], kv.x, a[4 * l4 + 0]);
                        a[4 * l4 + 1] = fmaf(q[16 * c + 4 * l4 + 1], kv.y, a[4 * l4 + 1]);
                        a[4 * l4 + 2] = fmaf(q[16 * c + 4 * l4 + 2], kv.z, a[4 * l4 + 2]);
                        a[4 * l4 + 3] = fmaf(q[16 * c + 4 * l4 + 3], kv.w, a[4 * l4 + 3]);
                    }
                }
                const float d = ds4_dot_lanes(a);
                term = (fmaxf(d, 0.0f) * scale) * gh;
            }
            terms[j * hp + h] = term;
        }
        __syncthreads();
        const int s = s0 + (int)threadIdx.x;
        if ((int)threadIdx.x < rows_b && s < n_vis) {
            const float* t = terms + threadIdx.x * hp;
            float total = 0.0f;
            for (int jj = 0; jj < heads; jj++) {
                total += t[jj];
            }
            out[s] = total;
        }
        __syncthreads();
    }
}

// scores[r * score_stride + s] = Σ_h (max(q_h · K_s, 0) * scale) * g[r * heads + h] for every
// visible indexer row s < n_vis = (pos + 1) / ratio, when n_vis > topk (else the row does
// nothing: every row is selected). iq [n, heads * head_dim], g [n, heads], irows [cap, head_dim].
// Grid (bx, n) for any bx; one thread per indexer row s (grid-stride over blockIdx.x), or per
// (row, head) for head_dim 128 with heads dividing the block (ds4_index_scores_by_head), so the
// block size (a multiple of 32, at most 256) changes nothing in the results. No dynamic shared
// memory. head_dim a multiple of 16.
extern "C" __global__ void __launch_bounds__(256)
    ds4_index_scores(const float* __restrict__ iq, const float* __restrict__ g, const float* __restrict__ irows,
                     int heads, int head_dim, int ratio, int topk, float* __restrict__ scores, int score_stride,
                     const int* __restrict__ step) {
    ds4_grid_deps_then_lead(gridDim.y == 1);
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
    // Keys in registers and the query in shared memory, or the general path.
    const bool fast = q_fits && g_fits && ((unsigned long long)irows & 15ull) == 0ull;
    // One thread per (row, head): its query head in registers, not in shared memory.
    const bool by_head =
        DS4_INDEX_WIDE_ON && head_dim == 128 && fast && heads <= (int)blockDim.x && blockDim.x % heads == 0;
    if (q_fits && !by_head) {
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
    if (by_head) {
        ds4_index_scores_by_head(qr, g_sh, heads, scale, irows, n_vis, out);
        return;
    }
    for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < n_vis; s += stride) {
        const float* k = irows + (long long)s * head_dim;
        float score;
        if (head_dim == 128 && fast) {
            score = ds4_index_score_row<128>(q_sh, g_sh, heads, scale, k);
        } else if (head_dim == 64 && fast) {
            score = ds4_index_score_row<64>(q_sh, g_sh, heads, scale, k);
        } else {
            score = ds4_index_score_mem(qs, gs, heads, head_dim, scale, k);
        }
        out[s] = score;
    }
}

// ds4_index_scores on the tensor cores (mma.sync m16n8k8, 3xTF32 as
// ds4_attention_mma in section 6, with the helpers here). The scores of a row are S = Q K^T over
// its heads (M) and indexer rows (N), then score_s = sum_h (max(S_hs, 0) * scale) * g_h; the
// float kernel forms each dot in float FMAs, one thread per (row, head), and a Flash CSA layer
// of a 512-row step took about 1 ms that way at a 2100-token context (CUPTI trace, H200),
// more as the context grows (the indexer's rows are a quarter of the positions). The sums
// here run in the tensor cores' order, then the 64 heads' terms in a fixed order (a lane's
// eight, then a butterfly over the lanes of a column), so a row's scores agree with the float
// kernel's to rounding, not bit for bit, and depend only on the row's own query and the
// indexer rows (row invariance), not on the grid. Every step runs it, a decode's and a
// verify's too (decode/program.rs `index_mma`), so a verify's scores stay its rows' single
// decodes'.
//
// A block takes one batch row (blockIdx.y) and walks its indexer rows in tiles of
// DS4_INDEX_MMA_KEYS (block x takes tiles x, x + gridDim.x, ...): warp w the 16 keys 16 w ..
// as two n8 tiles, every head (heads / 16 m16 tiles) at once. Q's fragments, split into tf32
// high and low parts, are built once a block in dynamic shared memory (the dims of each 16
// permuted alike in Q and K, so that a lane reads a key's four dims with one 16-byte load, as
// in section 6). Grid (bx, n) for any bx; block 256; dynamic shared memory
// ds4_index_mma_smem(heads) bytes. head_dim 128; heads a multiple of 16 up to
// DS4_INDEX_MMA_MAX_HEADS; irows 16-byte aligned. sm_80 or later (the host launches it only
// there).
#define DS4_INDEX_MMA_MAX_HEADS 64
#define DS4_INDEX_MMA_KEYS 128

__device__ __host__ __forceinline__ int ds4_index_mma_smem(int heads) {
    return heads / 16 * 16 * 2 * 32 * 16;  // m16 tiles x k8 steps x (hi, lo) x lanes x uint4
}

// d += a * b: 16 x 8 tf32 (a, row major) times 8 x 8 (b, column major), f32 sums.
__device__ __forceinline__ void ds4_mma_tf32(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// d += a * b in 3xTF32 from the split parts: the two low products first.
__device__ __forceinline__ void ds4_mma_3xtf32(float (&d)[4], const u32 (&ah)[4], const u32 (&al)[4], u32 bh0,
                                               u32 bh1, u32 bl0, u32 bl1) {
    ds4_mma_tf32(d, al, bh0, bh1);
    ds4_mma_tf32(d, ah, bl0, bl1);
    ds4_mma_tf32(d, ah, bh0, bh1);
}

// x as a high tf32 part and the low part of the rest (round to nearest, ties away: cvt.rna).
// The high part is cvt.rna's integer form, half a tf32 unit added to the magnitude's bits and
// the 13 low bits cleared: what the SASS of cvt.rna does for a finite x, without its test and
// select for Inf and NaN (two of its four instructions; these splits are most of the integer
// work of the prompt attention's loops). An infinite x gives the same parts; a NaN x may give
// another high part, but its rest, and so the low part and the products, are NaN as before.
// (Tried and dropped: the low part as the rest's float bits, unrounded, since an mma reads only
// a tf32 operand's top 19 bits: fewer instructions, but prompts ran the same, at twice the low
// part's error; ds4_attention_mma waits on memory latency, not on issue.) (Measurements:
// scripts/kernel_lab/HISTORY.md, "decode_attn.cu: ds4_tf32_split".)
__device__ __forceinline__ void ds4_tf32_split(float x, u32& hi, u32& lo) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    const float rest = x - __uint_as_float(hi);
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(rest));
#else
    hi = __float_as_uint(x);
    lo = 0u;
#endif
}

extern "C" __global__ void __launch_bounds__(256)
    ds4_index_scores_mma(const float* __restrict__ iq, const float* __restrict__ g, const float* __restrict__ irows,
                         int heads, int head_dim, int ratio, int topk, float* __restrict__ scores,
                         int score_stride, const int* __restrict__ step) {
    ds4_grid_deps();
    extern __shared__ __align__(16) uint4 qf[];  // [mt][ks][hi, lo][lane]
    __shared__ float g_sh[DS4_INDEX_MMA_MAX_HEADS];
    if (head_dim != 128 || heads % 16 != 0 || heads > DS4_INDEX_MMA_MAX_HEADS || (((unsigned long long)irows) & 15ull)) {
        __trap();  // the host checks the shape (a host bug)
    }
    const int r = blockIdx.y;
    const long long pos = (long long)step[0] + r;
    const int n_vis = (int)((pos + 1) / ratio);
    // Nothing to score, or no tile of this block's (before Q's fragments are made).
    if (n_vis <= topk || (long long)blockIdx.x * DS4_INDEX_MMA_KEYS >= n_vis) {
        return;
    }
    const int mts = heads / 16;
    const float* qr = iq + (long long)r * heads * 128;
    // 1. Q's A fragments: entry (mt, ks, lane (g, t)) holds rows 16 mt + g, + 8 at the dims
    //    d0 = 16 (ks / 2) + 4 t + 2 (ks % 2) and d0 + 1 (a0 = (g, d0), a1 = (g + 8, d0),
    //    a2 = (g, d0 + 1), a3 = (g + 8, d0 + 1)), its high parts, then its low parts.
    for (int i = threadIdx.x; i < mts * 16 * 32; i += blockDim.x) {
        const int lane = i & 31;
        const int ks = (i >> 5) & 15;
        const int mt = i >> 9;
        const int gq = lane >> 2;
        const int tq = lane & 3;
        const int d0 = 16 * (ks >> 1) + 4 * tq + 2 * (ks & 1);
        const float* r0 = qr + (long long)(16 * mt + gq) * 128;
        const float* r1 = r0 + 8 * 128;
        u32 h0, l0, h1, l1, h2, l2, h3, l3;
        ds4_tf32_split(r0[d0], h0, l0);
        ds4_tf32_split(r1[d0], h1, l1);
        ds4_tf32_split(r0[d0 + 1], h2, l2);
        ds4_tf32_split(r1[d0 + 1], h3, l3);
        uint4* e = qf + ((mt * 16 + ks) * 2) * 32 + lane;
        e[0] = make_uint4(h0, h1, h2, h3);
        e[32] = make_uint4(l0, l1, l2, l3);
    }
    for (int h = threadIdx.x; h < heads; h += blockDim.x) {
        g_sh[h] = g[(long long)r * heads + h];
    }
    __syncthreads();
    const float scale = 1.0f / sqrtf(128.0f);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int gl = lane >> 2;
    const int tl = lane & 3;
    float* out = scores + (long long)r * score_stride;
    for (int s0 = blockIdx.x * DS4_INDEX_MMA_KEYS; s0 < n_vis; s0 += gridDim.x * DS4_INDEX_MMA_KEYS) {
        // 2. This warp's two n8 tiles of keys: the lane's key g of each, all 128 dims, loaded
        //    first (zeros past n_vis).
        const int kb = s0 + 16 * warp;
        float4 kv[2][8];
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            const int s = kb + 8 * nt + gl;
            const float* k = s < n_vis ? irows + (long long)s * 128 : nullptr;
#pragma unroll
            for (int c = 0; c < 8; c++) {
                kv[nt][c] = k ? __ldg((const float4*)(k + 16 * c + 4 * tl)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
        if (kb >= n_vis) {
            continue;  // the whole warp past the row's keys (no barrier below)
        }
        float acc[DS4_INDEX_MMA_MAX_HEADS / 16][2][4] = {};
#pragma unroll
        for (int c = 0; c < 8; c++) {
#pragma unroll
            for (int sub = 0; sub < 2; sub++) {
                const int ks = 2 * c + sub;
                u32 bh[2][2], bl[2][2];
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    ds4_tf32_split(sub ? kv[nt][c].z : kv[nt][c].x, bh[nt][0], bl[nt][0]);
                    ds4_tf32_split(sub ? kv[nt][c].w : kv[nt][c].y, bh[nt][1], bl[nt][1]);
                }
#pragma unroll
                for (int mt = 0; mt < DS4_INDEX_MMA_MAX_HEADS / 16; mt++) {
                    if (mt < mts) {
                        const uint4 ah = qf[((mt * 16 + ks) * 2) * 32 + lane];
                        const uint4 al = qf[((mt * 16 + ks) * 2 + 1) * 32 + lane];
                        const u32 ahv[4] = {ah.x, ah.y, ah.z, ah.w};
                        const u32 alv[4] = {al.x, al.y, al.z, al.w};
#pragma unroll
                        for (int nt = 0; nt < 2; nt++) {
                            ds4_mma_3xtf32(acc[mt][nt], ahv, alv, bh[nt][0], bh[nt][1], bl[nt][0], bl[nt][1]);
                        }
                    }
                }
            }
        }
        // 3. Lane (g, t) holds heads 16 mt + g and + 8 of keys 2 t, 2 t + 1 of each tile: its
        //    terms in head order, then the sum over g (a butterfly, the same for every key).
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int cc = 0; cc < 2; cc++) {
                float part = 0.0f;
#pragma unroll
                for (int mt = 0; mt < DS4_INDEX_MMA_MAX_HEADS / 16; mt++) {
                    if (mt < mts) {
                        part += (fmaxf(acc[mt][nt][cc], 0.0f) * scale) * g_sh[16 * mt + gl];
                        part += (fmaxf(acc[mt][nt][2 + cc], 0.0f) * scale) * g_sh[16 * mt + gl + 8];
                    }
                }
                part += __shfl_xor_sync(0xffffffffu, part, 4);
                part += __shfl_xor_sync(0xffffffffu, part, 8);
                part += __shfl_xor_sync(0xffffffffu, part, 16);
                const int s = kb + 8 * nt + 2 * tl + cc;
                if (gl == 0 && s < n_vis) {
                    out[s] = part;
                }
            }
        }
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
// (8 bits per pass), stopping after a pass whose digit's keys are all taken (the threshold is
// then on the bits decided so far), then an in-order compaction of the keys above it and the
// first ties. The scores are read again in each pass (from L1 / L2: a row is a few tens of KB
// at most). The early stop shortens a launch (H200, scripts/kernel_lab/topk_lab.cu: one row of
// 525 scores in 4.44 us against 6.15 for all four passes); in Flash steps it is within the
// noise. (Tried and dropped: up to 16 keys a thread held in registers and the first pass counted
// through match.any; slower.) (Measurements: scripts/kernel_lab/HISTORY.md,
// "decode_attn.cu: ds4_index_topk".)
// Grid (n); block a multiple of 32, at most 1024 (1024 suggested).
extern "C" __global__ void __launch_bounds__(1024)
    ds4_index_topk(const float* __restrict__ scores, int score_stride, int ratio, int topk, int* __restrict__ sel,
                   int* __restrict__ nsel, const int* __restrict__ step) {
    ds4_grid_deps_then_lead(gridDim.x == 1);
    __shared__ u32 hist[256];
    __shared__ u32 ws[33];
    __shared__ u32 s_digit;
    __shared__ u32 s_krem;
    __shared__ u32 s_all;
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
        // The digit: the largest b whose keys, with those of the larger digits, reach krem.
        // Thread t holds the count of digit 255 - t; the block's prefix sum gives each the
        // count of the larger digits, and the one thread with before < krem <= before + c has
        // it (krem >= 1). By default a scan rather than the loop in one thread over the 256 bins
        // (kept for blocks of fewer than 256 threads, and DS4_CUDA_INDEX=row), which is
        // 4 x 256 dependent steps on the path of every decode step past the top-k size.
        if (DS4_INDEX_WIDE_ON && blockDim.x >= 256) {
            const u32 c = threadIdx.x < 256 ? hist[255 - threadIdx.x] : 0u;
            u32 total;
            const u32 before = ds4_block_scan_u32(c, ws, &total);
            if (threadIdx.x < 256 && before < krem && krem <= before + c) {
                s_digit = 255u - threadIdx.x;
                s_krem = krem - before;
                s_all = krem - before == c;
            }
        } else if (threadIdx.x == 0) {
            u32 cum = 0u;
            for (int b = 255; b >= 0; b--) {
                const u32 c = hist[b];
                if (cum + c >= krem) {
                    s_digit = (u32)b;
                    s_krem = krem - cum;
                    s_all = krem - cum == c;
                    break;
                }
                cum += c;
            }
        }
        __syncthreads();
        prefix |= s_digit << shift;
        mask |= 255u << shift;
        krem = s_krem;
        const bool all = s_all != 0u;
        __syncthreads();
        if (all) {
            break;  // every key of the digit is taken: the same decision in every thread
        }
    }
    // Keys above the threshold all go in; of those equal to it, the `need` lowest indices.
    // (After an early stop the threshold is on the bits of `mask`.)
    const u32 thr = prefix;
    const u32 need = krem;
    u32 gt_total = 0u;  // keys > thr before the chunk
    u32 eq_total = 0u;  // keys == thr before the chunk
    for (int base = 0; base < n_vis; base += blockDim.x) {
        const int i = base + threadIdx.x;
        u32 gt = 0u;
        u32 eq = 0u;
        if (i < n_vis) {
            const u32 key = ds4_score_key(sc[i]) & mask;
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
//
// The keys of batch row r: the raw rows of positions max(0, pos - window + 1) ..= pos (from
// the ring; with `block`, a drafter's block whose rows all see each other, DSpark's stages in
// rust/engine/model/block.rs window_block: every row sees max(0, pos0 - window) ..= pos0 + n - 1,
// the window before the step and all of the step's rows), then, if crows: the selected compressed rows crows[sel[r * sel_stride + i]] for
// i < nsel[r] when sel (CSA), else rows 0 .. (pos + 1) / ratio (HCA). Every key is also its
// value, and all heads share them (one KV head), so a block takes DS4_ATTN_HEADS heads and
// each key row it reads serves all of them. Two launches, each spread over many blocks so that
// a one-row step still fills the GPU:
// 1. ds4_attention_logits: lg[(r * n_heads + h) * lg_stride + j] = (q_h · k_j) / sqrt(head_dim),
//    DS4_ATTN_KEYS keys per block;
// 2. ds4_attention: the softmax with the sink, o_h = Σ_j w_hj k_j, the inverse rope and the
//    grouped output, DS4_ATTN_COLS output columns per block.
// Every sum runs in a fixed order that depends only on the row's own keys, head_dim and the
// constants below (row invariance); it is not the CPU's order, so the results agree with the
// CPU's to rounding, not bit for bit.
//
// (Tried and dropped: both launches as one, a cluster of 8 blocks per row and group of 8 heads,
// the row's keys split over the cluster and its parts added through distributed shared memory.
// It agreed with these kernels to rounding, but on an H200 Flash steps took about as long and
// verifies of 8 rows longer (23.4 to 23.9 ms against 22.9 to 23.2): each block walks its keys
// twice, in chains of dependent loads as long as these kernels' over fewer blocks.)
// (Measurements: scripts/kernel_lab/HISTORY.md, "decode_attn.cu: ds4_attention".)

#define DS4_ATTN_THREADS 256  // block size of both kernels (8 warps)
#define DS4_ATTN_HEADS 8      // heads per block of both kernels (ds4_warp_sum8: 8)
#define DS4_ATTN_KEYS 64      // keys per block of ds4_attention_logits (8 per warp)
#define DS4_ATTN_SLICES 4     // query columns a lane holds per pass: float4 slices of 128 columns
#define DS4_ATTN_COLS 32      // output columns per block of ds4_attention (8 lanes of float4)
#define DS4_ATTN_TILE 256     // keys per weight tile of ds4_attention (one per thread)

// Where row r's keys are.
struct Ds4AttnRow {
    long long pos;
    int nraw;         // raw rows: keys 0 .. nraw
    int nk;           // all keys (raw, then compressed)
    int lo_slot;      // ring slot of key 0
    const int* selr;  // CSA: the row's selected compressed rows; else null
};

__device__ __forceinline__ Ds4AttnRow ds4_attn_row(int r, int slots, int window, int block, const float* crows,
                                                   int ratio, const int* sel, const int* nsel, int sel_stride,
                                                   const int* step) {
    Ds4AttnRow a;
    a.pos = (long long)step[0] + r;
    const long long first = block ? (long long)step[0] : a.pos + 1;  // the window ends before it
    const long long last = block ? (long long)step[0] + step[1] - 1 : a.pos;
    const long long lo = first > window ? first - window : 0;
    a.nraw = (int)(last - lo + 1);
    a.lo_slot = (int)(lo % slots);
    a.selr = sel ? sel + (long long)r * sel_stride : nullptr;
    int ncomp = 0;
    if (crows) {
        ncomp = sel ? nsel[r] : (int)((a.pos + 1) / ratio);
    }
    a.nk = a.nraw + ncomp;
    return a;
}

// The row of key j < nk.
__device__ __forceinline__ const float* ds4_attn_key(const Ds4AttnRow& a, int j, const float* ring, int slots,
                                                     const float* crows, int head_dim) {
    if (j < a.nraw) {
        int s = a.lo_slot + j;
        if (s >= slots) {
            s -= slots;
        }
        return ring + (long long)s * head_dim;
    }
    const int c = j - a.nraw;
    return crows + (long long)(a.selr ? a.selr[c] : c) * head_dim;
}

// The float4 slices cb + 128 * i + 4 * lane of a row: zeros for a null row and past head_dim
// (lanes without columns there). Rows are 16-byte aligned (head_dim a multiple of 16).
__device__ __forceinline__ void ds4_attn_slices(float4 (&v)[DS4_ATTN_SLICES], const float* row, int cb, int lane,
                                                int head_dim) {
#pragma unroll
    for (int i = 0; i < DS4_ATTN_SLICES; i++) {
        const int c = cb + 128 * i + 4 * lane;
        v[i] = row && c < head_dim ? __ldg((const float4*)(row + c)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

// A lane's part of a dot product: one fused chain over its slices in order.
__device__ __forceinline__ float ds4_attn_dot(const float4 (&a)[DS4_ATTN_SLICES], const float4 (&b)[DS4_ATTN_SLICES]) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < DS4_ATTN_SLICES; i++) {
        s = fmaf(a[i].x, b[i].x, s);
        s = fmaf(a[i].y, b[i].y, s);
        s = fmaf(a[i].z, b[i].z, s);
        s = fmaf(a[i].w, b[i].w, s);
    }
    return s;
}

// The warp sums of 8 values at once (a transposed butterfly: 9 shuffles instead of 40). Lane l
// gets the sum over all lanes of v[(l >> 2) & 7]; each halving step adds the lane's own half to
// its partner's, so the order is fixed.
__device__ __forceinline__ float ds4_warp_sum8(const float (&v)[8]) {
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    const bool u4 = (lane & 16) != 0;
    float a[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float send = u4 ? v[k] : v[k + 4];
        a[k] = (u4 ? v[k + 4] : v[k]) + __shfl_xor_sync(full, send, 16);
    }
    const bool u3 = (lane & 8) != 0;
    float b[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const float send = u3 ? a[k] : a[k + 2];
        b[k] = (u3 ? a[k + 2] : a[k]) + __shfl_xor_sync(full, send, 8);
    }
    const bool u2 = (lane & 4) != 0;
    float s = (u2 ? b[1] : b[0]) + __shfl_xor_sync(full, u2 ? b[0] : b[1], 4);
    s = s + __shfl_xor_sync(full, s, 2);
    s = s + __shfl_xor_sync(full, s, 1);
    return s;
}

// Logits of row r (blockIdx.y) for heads h0 .. h0 + 8 and keys kb .. kb + DS4_ATTN_KEYS, with
// blockIdx.x = (h0 / 8) * chunks + kb / DS4_ATTN_KEYS, chunks = ceil(lg_stride / DS4_ATTN_KEYS).
// q [n, n_heads * head_dim]; lg [n, n_heads, lg_stride], lg_stride >= every row's key count
// (window + the most compressed keys any row has; with block, window + n); keys past the row's
// count are not written.
// Grid (ceil(n_heads / 8) * chunks, n); block DS4_ATTN_THREADS; no dynamic shared memory.
// head_dim a multiple of 16.
//
// Warp w takes keys kb + w + 8 t in order, the next key's loads in flight while it works on
// one. A lane keeps the 8 queries' columns 128 * i + 4 * lane (i < 4) of a 512-column pass in
// registers, loads the same columns of the key (a warp reads 512 contiguous bytes per load),
// forms its 8 partial dot products (one fused chain each, slices in order), and ds4_warp_sum8
// adds the lanes; passes (head_dim > 512) add in order.
extern "C" __global__ void __launch_bounds__(DS4_ATTN_THREADS)
    ds4_attention_logits(const float* __restrict__ q, const float* __restrict__ ring, int slots, int window,
                         int block, const float* __restrict__ crows, int ratio, const int* __restrict__ sel,
                         const int* __restrict__ nsel, int sel_stride, int n_heads, int head_dim,
                         float* __restrict__ lg, int lg_stride, const int* __restrict__ step) {
    ds4_grid_deps_then_lead(gridDim.y == 1);
    constexpr int NW = DS4_ATTN_THREADS / 32;
    constexpr int KPW = DS4_ATTN_KEYS / NW;  // keys per warp
    static_assert(DS4_ATTN_HEADS == 8 && DS4_ATTN_KEYS <= DS4_ATTN_THREADS && DS4_ATTN_KEYS % NW == 0,
                  "ds4_warp_sum8 sums 8 heads; a thread per key row; whole keys per warp");
    __shared__ const float* kp[DS4_ATTN_KEYS];
    const int r = blockIdx.y;
    const Ds4AttnRow a = ds4_attn_row(r, slots, window, block, crows, ratio, sel, nsel, sel_stride, step);
    const int chunks = (lg_stride + DS4_ATTN_KEYS - 1) / DS4_ATTN_KEYS;
    const int kb = (int)(blockIdx.x % chunks) * DS4_ATTN_KEYS;
    const int h0 = (int)(blockIdx.x / chunks) * DS4_ATTN_HEADS;
    if (kb >= a.nk) {
        return;  // the whole block: no key of this row here
    }
    if (threadIdx.x < DS4_ATTN_KEYS) {
        const int j = kb + threadIdx.x;
        kp[threadIdx.x] = j < a.nk ? ds4_attn_key(a, j, ring, slots, crows, head_dim) : nullptr;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const float* qr = q + ((long long)r * n_heads + h0) * head_dim;
    float dot[KPW];  // lane l: head h0 + ((l >> 2) & 7) of key kb + warp + 8 t
#pragma unroll
    for (int t = 0; t < KPW; t++) {
        dot[t] = 0.0f;
    }
    for (int cb = 0; cb < head_dim; cb += 128 * DS4_ATTN_SLICES) {
        float4 qv[DS4_ATTN_HEADS][DS4_ATTN_SLICES];
#pragma unroll
        for (int hh = 0; hh < DS4_ATTN_HEADS; hh++) {
            ds4_attn_slices(qv[hh], h0 + hh < n_heads ? qr + (long long)hh * head_dim : nullptr, cb, lane, head_dim);
        }
        float4 kv[DS4_ATTN_SLICES];
        ds4_attn_slices(kv, kp[warp], cb, lane, head_dim);
#pragma unroll
        for (int t = 0; t < KPW; t++) {
            if (!kp[warp + NW * t]) {
                break;  // past the row's keys (the same for the whole warp)
            }
            // The next key's loads go out before this key's products.
            float4 kn[DS4_ATTN_SLICES];
            if (t + 1 < KPW) {
                ds4_attn_slices(kn, kp[warp + NW * (t + 1)], cb, lane, head_dim);
            }
            float d[DS4_ATTN_HEADS];
#pragma unroll
            for (int hh = 0; hh < DS4_ATTN_HEADS; hh++) {
                d[hh] = ds4_attn_dot(qv[hh], kv);
            }
            dot[t] += ds4_warp_sum8(d);
            if (t + 1 < KPW) {
#pragma unroll
                for (int i = 0; i < DS4_ATTN_SLICES; i++) {
                    kv[i] = kn[i];
                }
            }
        }
    }
    const int h = h0 + (lane >> 2);
    if ((lane & 3) == 0 && h < n_heads) {
        const float scale = 1.0f / sqrtf((float)head_dim);
        float* out = lg + ((long long)r * n_heads + h) * lg_stride;
#pragma unroll
        for (int t = 0; t < KPW; t++) {
            const int j = kb + warp + NW * t;
            if (j < a.nk) {
                out[j] = dot[t] * scale;
            }
        }
    }
}

// ds4_attention's inputs for key j of a weight tile, loaded ahead of their use: its logits for
// the block's heads and its row.
struct Ds4AttnTileKey {
    float l[DS4_ATTN_HEADS];
    const float* row;
};

__device__ __forceinline__ Ds4AttnTileKey ds4_attn_tile_load(const Ds4AttnRow& a, int j, const float* lgr,
                                                             int lg_stride, int nh, const float* ring, int slots,
                                                             const float* crows, int head_dim) {
    Ds4AttnTileKey t;
    t.row = nullptr;
#pragma unroll
    for (int hh = 0; hh < DS4_ATTN_HEADS; hh++) {
        t.l[hh] = 0.0f;
    }
    if (j < a.nk) {
        t.row = ds4_attn_key(a, j, ring, slots, crows, head_dim);
#pragma unroll
        for (int hh = 0; hh < DS4_ATTN_HEADS; hh++) {
            if (hh < nh) {
                t.l[hh] = lgr[(long long)hh * lg_stride + j];
            }
        }
    }
    return t;
}

// Stores key t's weights w = e^{l - M} / denom (as attend; 0 for heads past n_heads) and row.
__device__ __forceinline__ void ds4_attn_tile_store(const Ds4AttnTileKey& t, int nh, const float* st_m,
                                                    const float* st_d, float* w, const float** row) {
    if (!t.row) {
        return;
    }
    float v[DS4_ATTN_HEADS];
#pragma unroll
    for (int hh = 0; hh < DS4_ATTN_HEADS; hh++) {
        v[hh] = hh < nh ? expf(t.l[hh] - st_m[hh]) / st_d[hh] : 0.0f;
    }
    *(float4*)w = make_float4(v[0], v[1], v[2], v[3]);
    *(float4*)(w + 4) = make_float4(v[4], v[5], v[6], v[7]);
    *row = t.row;
}

// Attention output of row r (blockIdx.y) for heads h0 .. h0 + 8 and columns c0 .. c0 + 32, with
// blockIdx.x = (h0 / 8) * slices + c0 / 32, slices = ceil(head_dim / 32), from the logits of
// ds4_attention_logits (lg, lg_stride as there). sinks [n_heads]; out in the grouped layout
// out[((g * n + r) * hpg + h % hpg) * head_dim + i], hpg = n_heads / groups, g = h / hpg.
// Grid (ceil(n_heads / 8) * slices, n); block DS4_ATTN_THREADS; no dynamic shared memory.
// head_dim a multiple of 16; rope_dim even, at most head_dim.
//
// 1. Softmax statistics, warp w for head h0 + w: M = max(sink, logits) (lane-strided, then a
//    butterfly), denom = e^{sink - M} + Σ_j e^{l_j - M} (a double sum, lane-strided in key
//    order, then a butterfly).
// 2. o = Σ_j w_j k_j over tiles of DS4_ATTN_TILE keys: the weights and rows of a tile go to
//    shared memory (thread i: key i of the tile; the next tile's are loaded while this one is
//    summed). A lane owns columns c0 + 4 * (lane & 7) .. + 4 of all 8 heads and sums the keys
//    j ≡ 4 w + (lane >> 3) (mod 32) in increasing j, one fused chain per value, so a warp reads
//    4 key rows of 128 bytes per load. Then the 4 streams of a warp add by a butterfly, and the 8 warps' sums add
//    in warp order.
// 3. The inverse rope of the pairs in the slice, and the output.
extern "C" __global__ void __launch_bounds__(DS4_ATTN_THREADS)
    ds4_attention(const float* __restrict__ lg, int lg_stride, const float* __restrict__ ring, int slots, int window,
                  int block, const float* __restrict__ crows, int ratio, const int* __restrict__ sel,
                  const int* __restrict__ nsel, int sel_stride, const float* __restrict__ sinks, int n_heads,
                  int head_dim, float* __restrict__ out, int groups, const float* __restrict__ inv_freq,
                  int rope_dim, const int* __restrict__ step) {
    ds4_grid_lead();
    constexpr int NW = DS4_ATTN_THREADS / 32;
    static_assert(NW == DS4_ATTN_HEADS && DS4_ATTN_TILE == DS4_ATTN_THREADS &&
                      DS4_ATTN_HEADS * DS4_ATTN_COLS == DS4_ATTN_THREADS && DS4_ATTN_COLS == 32,
                  "a warp per head; a key per thread; a value per thread; 8 lanes of float4 per key");
    __shared__ __align__(16) float wt[2][DS4_ATTN_TILE][DS4_ATTN_HEADS];  // the weights, double buffered
    __shared__ const float* kp[2][DS4_ATTN_TILE];                         // the key rows
    __shared__ __align__(16) float part[NW][DS4_ATTN_HEADS][DS4_ATTN_COLS];
    __shared__ float os[DS4_ATTN_HEADS][DS4_ATTN_COLS];
    __shared__ float st_m[DS4_ATTN_HEADS];
    __shared__ float st_d[DS4_ATTN_HEADS];
    const unsigned full = 0xffffffffu;
    const int r = blockIdx.y;
    const int n = gridDim.y;
    const Ds4AttnRow a = ds4_attn_row(r, slots, window, block, crows, ratio, sel, nsel, sel_stride, step);
    const int slices = (head_dim + DS4_ATTN_COLS - 1) / DS4_ATTN_COLS;
    const int c0 = (int)(blockIdx.x % slices) * DS4_ATTN_COLS;
    const int h0 = (int)(blockIdx.x / slices) * DS4_ATTN_HEADS;
    const int nh = min(DS4_ATTN_HEADS, n_heads - h0);  // heads of this block
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const float* lgr = lg + ((long long)r * n_heads + h0) * lg_stride;  // head h0 + hh at hh * lg_stride

    // The first tile's inputs, loaded before the statistics so that the latencies overlap.
    Ds4AttnTileKey next = ds4_attn_tile_load(a, threadIdx.x, lgr, lg_stride, nh, ring, slots, crows, head_dim);

    // 1. Softmax statistics.
    if (warp < nh) {
        const float* l = lgr + (long long)warp * lg_stride;
        const float sink = sinks[h0 + warp];
        float m = sink;
        for (int j = lane; j < a.nk; j += 32) {
            m = fmaxf(m, l[j]);
        }
        for (int o = 16; o > 0; o >>= 1) {
            m = fmaxf(m, __shfl_xor_sync(full, m, o));
        }
        double s = 0.0;
        for (int j = lane; j < a.nk; j += 32) {
            s += (double)expf(l[j] - m);
        }
        for (int o = 16; o > 0; o >>= 1) {
            s += __shfl_xor_sync(full, s, o);
        }
        if (lane == 0) {
            st_m[warp] = m;
            st_d[warp] = (float)((double)expf(sink - m) + s);
        }
    }
    __syncthreads();
    ds4_attn_tile_store(next, nh, st_m, st_d, wt[0][threadIdx.x], &kp[0][threadIdx.x]);
    __syncthreads();

    // 2. The weighted sum.
    const int ks = 4 * warp + (lane >> 3);  // this lane's key stream
    const int c = c0 + 4 * (lane & 7);      // this lane's first column
    const bool live = c < head_dim;
    float4 acc[DS4_ATTN_HEADS];
#pragma unroll
    for (int hh = 0; hh < DS4_ATTN_HEADS; hh++) {
        acc[hh] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    int b = 0;
    for (int tb = 0; tb < a.nk; tb += DS4_ATTN_TILE) {
        const int jn = tb + DS4_ATTN_TILE + threadIdx.x;
        next = ds4_attn_tile_load(a, jn, lgr, lg_stride, nh, ring, slots, crows, head_dim);
        const int tn = min(DS4_ATTN_TILE, a.nk - tb);
        // All of the lane's key loads first, so that they are in flight together.
        float4 kv[DS4_ATTN_TILE / 32];
#pragma unroll
        for (int u = 0; u < DS4_ATTN_TILE / 32; u++) {
            const int jj = ks + 32 * u;
            kv[u] = live && jj < tn ? __ldg((const float4*)(kp[b][jj] + c)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < DS4_ATTN_TILE / 32; u++) {
            const int jj = ks + 32 * u;
            if (jj < tn) {
                const float4 k = kv[u];
                const float4 w0 = *(const float4*)&wt[b][jj][0];
                const float4 w1 = *(const float4*)&wt[b][jj][4];
                const float w[DS4_ATTN_HEADS] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
                for (int hh = 0; hh < DS4_ATTN_HEADS; hh++) {
                    acc[hh].x = fmaf(w[hh], k.x, acc[hh].x);
                    acc[hh].y = fmaf(w[hh], k.y, acc[hh].y);
                    acc[hh].z = fmaf(w[hh], k.z, acc[hh].z);
                    acc[hh].w = fmaf(w[hh], k.w, acc[hh].w);
                }
            }
        }
        // The next tile goes to the other buffer, which every warp finished with before the
        // barrier of the previous tile.
        ds4_attn_tile_store(next, nh, st_m, st_d, wt[b ^ 1][threadIdx.x], &kp[b ^ 1][threadIdx.x]);
        __syncthreads();
        b ^= 1;
    }
#pragma unroll
    for (int hh = 0; hh < DS4_ATTN_HEADS; hh++) {
#pragma unroll
        for (int o = 8; o <= 16; o <<= 1) {
            acc[hh].x += __shfl_xor_sync(full, acc[hh].x, o);
            acc[hh].y += __shfl_xor_sync(full, acc[hh].y, o);
            acc[hh].z += __shfl_xor_sync(full, acc[hh].z, o);
            acc[hh].w += __shfl_xor_sync(full, acc[hh].w, o);
        }
    }
    if (lane < 8) {
#pragma unroll
        for (int hh = 0; hh < DS4_ATTN_HEADS; hh++) {
            *(float4*)&part[warp][hh][4 * lane] = acc[hh];
        }
    }
    __syncthreads();
    const int hh = threadIdx.x / DS4_ATTN_COLS;
    const int col = threadIdx.x % DS4_ATTN_COLS;
    float v = part[0][hh][col];
#pragma unroll
    for (int w = 1; w < NW; w++) {
        v += part[w][hh][col];
    }
    os[hh][col] = v;
    __syncthreads();

    // 3. The inverse rope: thread t rotates pair t % 16 of the slice for head t / 16.
    if (threadIdx.x < DS4_ATTN_HEADS * DS4_ATTN_COLS / 2) {
        const int ph = threadIdx.x / (DS4_ATTN_COLS / 2);
        const int pc = c0 + 2 * (threadIdx.x % (DS4_ATTN_COLS / 2));
        const int rope0 = head_dim - rope_dim;  // the first rotary column (even)
        if (ph < nh && pc >= rope0 && pc < head_dim) {
            // os[ph] seen as the whole head: only this slice's columns are touched.
            ds4_rope_pair(os[ph] - c0, head_dim, inv_freq, rope_dim, (int)a.pos, (pc - rope0) / 2, true);
        }
    }
    __syncthreads();
    if (hh < nh && c0 + col < head_dim) {
        const int h = h0 + hh;
        const int hpg = n_heads / groups;
        out[(((long long)(h / hpg) * n + r) * hpg + (h % hpg)) * head_dim + c0 + col] = os[hh][col];
    }
}

// ---- 6. a prompt's attention on the tensor cores
//
// The same attention as section 5 (the row's keys, the sink, the inverse rope, the grouped
// output) for a prompt's steps, on mma.sync m16n8k8 in tf32. A block takes one batch row and 16
// heads, so each key row it reads serves 16 heads as the n operand of QK^T and the k operand of
// PV. (Section 5's blocks take 8 heads and 32 columns or 64 keys, for a one-row step to fill the
// GPU; for 256 rows a Flash CSA layer spent 2.2 ms in them, in float FMAs.) Each product is
// split in a high and a low tf32 part (3xTF32: hi*hi + hi*lo + lo*hi, the low products first),
// about 2^-21 of each term, summed in the tensor cores' order: a row's results agree with
// section 5's to rounding, not bit for bit, which is why only a prompt's steps run this (a
// verify stays bitwise its rows' single decodes); they depend only on the row's own keys and
// the shape (row invariance).
//
// 1. Q's 16 heads (zeros past n_heads), split into their A fragments, to shared memory (a k
//    step's high parts for the 32 lanes, then its low parts: each lane's 16 bytes in a row,
//    no bank conflicts); the row's key pointers (section 5's order: the raw window, then the
//    compressed rows) too.
// 2. S = Q K^T / sqrt(head_dim): warp w takes key tiles of 8 keys w, w + 8, ..., each a chain
//    of head_dim / 8 mma steps (two tiles' chains side by side); S to shared memory. The dims
//    of each 16 are permuted alike in Q and K so that a lane reads a key's four dims with one
//    16-byte load, four such chunks ahead of the products.
// 3. The softmax with the sink per head as ds4_attention's statistics: M = max(sink, S),
//    denom = e^{sink - M} + sum e^{S - M} (a double sum), P = e^{S - M} / denom in place.
// 4. O = P V: warp w takes head_dim / 8 consecutive output columns as head_dim / 64 n8 tiles
//    whose columns interleave, so that a lane's columns of a key are consecutive (16-byte
//    loads); a chain over the keys in steps of 8, the next step's values loaded ahead.
// 5. O to shared memory, then the inverse rope of the rotary pairs and the grouped store.
//
// Why the loads are so arranged: with each key's value for an mma operand read by 4-byte loads
// as it went, this kernel waited on them; with 16-byte loads issued ahead, a CSA layer took 1.36
// ms in it against 2.51 (H200, Flash, a 512-row step after a 2100-token prompt). The tf32
// splits without cvt.rna's Inf/NaN select (ds4_tf32_split) and step 4 built for Flash's width
// (ds4_attn_mma_pv<8>: no test of nt, the values in 16-byte loads only) give the same bits for
// finite inputs in fewer instructions (the P V loop 173 SASS instructions a pass against 361),
// and prompts ran faster. (Tried and dropped: S's correction products in an accumulator of their
// own, the values two steps ahead, blocks of 32 heads sharing each key's split parts; no
// faster.) (Measurements: scripts/kernel_lab/HISTORY.md, "decode_attn.cu: ds4_attention_mma".)
//
// Grid (ceil(n_heads / 16), n); block 256; dynamic shared memory of
// ds4_attn_mma_smem(head_dim, lg_stride) bytes. head_dim a multiple of 64 up to
// DS4_ATTN_MMA_MAX_DIM; lg_stride >= every row's key count (as ds4_attention_logits'); rope_dim
// even, at most head_dim. sm_80 or later (the host launches it only there).

#define DS4_ATTN_MMA_HEADS 16
#define DS4_ATTN_MMA_MAX_DIM 512

// The row stride of S in floats: room for whole tiles of 8 keys, and 4 mod 32, so that the
// lanes of an A fragment (rows g, columns t: g * stride + t) read distinct banks.
__device__ __host__ __forceinline__ int ds4_attn_mma_stride(int lg_stride) {
    return ((lg_stride + 31) / 32) * 32 + 4;
}

// Bytes of shared memory: Q's fragments (head_dim / 8 steps x 32 lanes x 8 words), the key
// pointers (lg_stride rounded up to 8), S (16 rows).
__device__ __host__ __forceinline__ int ds4_attn_mma_smem(int head_dim, int lg_stride) {
    return head_dim * 128 + ((lg_stride + 7) / 8) * 8 * 8 + DS4_ATTN_MMA_HEADS * ds4_attn_mma_stride(lg_stride) * 4;
}


// The key row of the key slots past a row's count (and of a warp's missing second tile): zeros,
// so that every key and value load of the loops is unconditional. (They were null rows, each
// load then a test and a select of zeros: 32 CS2R of the QK^T loop's pass were those zeros.)
__device__ const float ds4_attn_zero_row[DS4_ATTN_MMA_MAX_DIM] = {};

// A lane's keys of k16 chunks c0 .. c0 + DS4_ATTN_MMA_KQ - 1 of its two key rows: dims 16 c +
// 4 t .. + 3, one 16-byte load each.
#define DS4_ATTN_MMA_KQ 4
__device__ __forceinline__ void ds4_attn_mma_keys(const float* const (&krow)[2], int c0, int t,
                                                  float4 (&k)[2][DS4_ATTN_MMA_KQ]) {
#pragma unroll
    for (int u = 0; u < 2; u++) {
#pragma unroll
        for (int cc = 0; cc < DS4_ATTN_MMA_KQ; cc++) {
            k[u][cc] = __ldg((const float4*)(krow[u] + 16 * (c0 + cc) + 4 * t));
        }
    }
}

// A lane's values of one key tile for O = P V: keys j0 and j0 + 4, the nt
// consecutive columns at `col` (the lane's column of each of its nt output tiles), in loads as
// wide as nt allows (the branch is the launch's).
__device__ __forceinline__ void ds4_attn_mma_values(const float* v0, const float* v1, int col, int nt,
                                                    float (&v)[2][DS4_ATTN_MMA_MAX_DIM / 64]) {
    constexpr int NT = DS4_ATTN_MMA_MAX_DIM / 64;
    const float* rows[2] = {v0, v1};
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const float* p = rows[u] + col;
        if ((nt & 3) == 0) {
#pragma unroll
            for (int i = 0; i < NT; i += 4) {
                float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (i < nt) {
                    x = __ldg((const float4*)(p + i));
                }
                v[u][i] = x.x;
                v[u][i + 1] = x.y;
                v[u][i + 2] = x.z;
                v[u][i + 3] = x.w;
            }
        } else if ((nt & 1) == 0) {
#pragma unroll
            for (int i = 0; i < NT; i += 2) {
                float2 x = make_float2(0.0f, 0.0f);
                if (i < nt) {
                    x = __ldg((const float2*)(p + i));
                }
                v[u][i] = x.x;
                v[u][i + 1] = x.y;
            }
        } else {
#pragma unroll
            for (int i = 0; i < NT; i++) {
                v[u][i] = i < nt ? __ldg(p + i) : 0.0f;
            }
        }
    }
}

// Step 4 of ds4_attention_mma (O += P V over the key tiles): a lane's nt output tiles; NTC = nt
// known at compile time (the widest head, nt = DS4_ATTN_MMA_MAX_DIM / 64: no test of nt in the
// loop, the values' loads at their widest), or 0 for nt read at run time.
template <int NTC>
__device__ __forceinline__ void ds4_attn_mma_pv(float (&acc)[DS4_ATTN_MMA_MAX_DIM / 64][4], const float* const* kp,
                                                const float* S, int sst, int tiles, int vcol, int nt_run, int g,
                                                int t) {
    constexpr int NT = DS4_ATTN_MMA_MAX_DIM / 64;
    const int nt = NTC > 0 ? NTC : nt_run;
    float vc[2][NT];
    ds4_attn_mma_values(kp[t], kp[t + 4], vcol, nt, vc);
    for (int s = 0; s < tiles; s++) {
        const int j0 = 8 * s + t;
        float vn[2][NT];
        const int jn = s + 1 < tiles ? j0 + 8 : j0;
        ds4_attn_mma_values(kp[jn], kp[jn + 4], vcol, nt, vn);
        u32 ah[4], al[4];
        ds4_tf32_split(S[g * sst + j0], ah[0], al[0]);
        ds4_tf32_split(S[(g + 8) * sst + j0], ah[1], al[1]);
        ds4_tf32_split(S[g * sst + j0 + 4], ah[2], al[2]);
        ds4_tf32_split(S[(g + 8) * sst + j0 + 4], ah[3], al[3]);
#pragma unroll
        for (int i = 0; i < NT; i++) {
            if (i < nt) {
                u32 bh0, bl0, bh1, bl1;
                ds4_tf32_split(vc[0][i], bh0, bl0);
                ds4_tf32_split(vc[1][i], bh1, bl1);
                ds4_mma_3xtf32(acc[i], ah, al, bh0, bh1, bl0, bl1);
            }
        }
#pragma unroll
        for (int i = 0; i < NT; i++) {
            vc[0][i] = vn[0][i];
            vc[1][i] = vn[1][i];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
    ds4_attention_mma(const float* __restrict__ q, const float* __restrict__ ring, int slots, int window, int block,
                      const float* __restrict__ crows, int ratio, const int* __restrict__ sel,
                      const int* __restrict__ nsel, int sel_stride, const float* __restrict__ sinks, int n_heads,
                      int head_dim, float* __restrict__ out, int groups, const float* __restrict__ inv_freq,
                      int rope_dim, int lg_stride, const int* __restrict__ step) {
    ds4_grid_lead();
    constexpr int H = DS4_ATTN_MMA_HEADS;
    constexpr int NW = 8;
    constexpr int NT = DS4_ATTN_MMA_MAX_DIM / 64;  // most output tiles of a warp
    constexpr int KQ = DS4_ATTN_MMA_KQ;
    extern __shared__ __align__(16) u8 attn_sm[];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int r = blockIdx.y;
    const int n = gridDim.y;
    const int h0 = blockIdx.x * H;
    const int steps = head_dim / 8;
    const int chunks = head_dim / 16;
    const int sst = ds4_attn_mma_stride(lg_stride);
    const int kcap = ((lg_stride + 7) / 8) * 8;
    uint4* qs = (uint4*)attn_sm;                                  // [steps][hi, lo][32 lanes]
    const float** kp = (const float**)(attn_sm + head_dim * 128);  // [kcap]
    float* S = (float*)(kp + kcap);                                // [H][sst]
    const Ds4AttnRow a = ds4_attn_row(r, slots, window, block, crows, ratio, sel, nsel, sel_stride, step);
    if (head_dim % 64 != 0 || head_dim > DS4_ATTN_MMA_MAX_DIM || a.nk > lg_stride || (blockDim.x >> 5) != NW) {
        __trap();  // outside the kernel's shapes: a host bug
    }
    const int nk = a.nk;
    const int tiles = (nk + 7) / 8;  // key tiles of 8 (keys past nk: the zero row, zero weights)

    // 1. Q's fragments and the key pointers. The dims of a k16 chunk c are permuted so that
    //    lane t's four are consecutive, 16 c + 4 t .. + 3 (one 16-byte load of a key in step
    //    2): k step s = 2 c + m takes dims 16 c + 4 t + 2 m as k = t and the next as k = t + 4
    //    (lane (g, t): rows g and g + 8 of the heads; the high parts, then the low ones).
    const float* qr = q + (long long)r * n_heads * head_dim;
    for (int i = threadIdx.x; i < steps * 32; i += blockDim.x) {
        const int s = i >> 5;
        const int l = i & 31;
        const int fg = l >> 2;
        const int ft = l & 3;
        const int c = 16 * (s >> 1) + 4 * ft + 2 * (s & 1);
        const int ha = h0 + fg;
        const int hb = h0 + fg + 8;
        const float2 za = make_float2(0.0f, 0.0f);
        const float2 va = ha < n_heads ? *(const float2*)(qr + (long long)ha * head_dim + c) : za;
        const float2 vb = hb < n_heads ? *(const float2*)(qr + (long long)hb * head_dim + c) : za;
        const float v[4] = {va.x, vb.x, va.y, vb.y};
        u32 hi[4], lo[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            ds4_tf32_split(v[e], hi[e], lo[e]);
        }
        qs[64 * s + l] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        qs[64 * s + 32 + l] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
    for (int j = threadIdx.x; j < kcap; j += blockDim.x) {
        kp[j] = j < nk ? ds4_attn_key(a, j, ring, slots, crows, head_dim) : ds4_attn_zero_row;
    }
    __syncthreads();

    // 2. S = Q K^T * scale (lane: key 8 tile + g as the n index), two key tiles at a time (tile
    //    and tile + 8: two independent chains of mma, each tile's sums in its own order). The
    //    keys of the next KQ chunks are loaded while this batch's products run.
    const float scale = 1.0f / sqrtf((float)head_dim);
    for (int tile = warp; tile < tiles; tile += 2 * NW) {
        const bool two = tile + NW < tiles;
        const float* krow[2] = {kp[8 * tile + g], two ? kp[8 * (tile + NW) + g] : ds4_attn_zero_row};
        float c[2][4] = {};
        float4 kc[2][KQ];
        ds4_attn_mma_keys(krow, 0, t, kc);
        for (int cb = 0; cb < chunks; cb += KQ) {
            float4 kn[2][KQ];
            ds4_attn_mma_keys(krow, cb + KQ < chunks ? cb + KQ : cb, t, kn);
#pragma unroll
            for (int cc = 0; cc < KQ; cc++) {
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    const int s = 2 * (cb + cc) + m;
                    const uint4 qh = qs[64 * s + lane];
                    const uint4 ql = qs[64 * s + 32 + lane];
                    const u32 ah[4] = {qh.x, qh.y, qh.z, qh.w};
                    const u32 al[4] = {ql.x, ql.y, ql.z, ql.w};
#pragma unroll
                    for (int u = 0; u < 2; u++) {
                        const float k0 = m ? kc[u][cc].z : kc[u][cc].x;
                        const float k1 = m ? kc[u][cc].w : kc[u][cc].y;
                        u32 bh0, bl0, bh1, bl1;
                        ds4_tf32_split(k0, bh0, bl0);
                        ds4_tf32_split(k1, bh1, bl1);
                        ds4_mma_3xtf32(c[u], ah, al, bh0, bh1, bl0, bl1);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < 2; u++) {
#pragma unroll
                for (int cc = 0; cc < KQ; cc++) {
                    kc[u][cc] = kn[u][cc];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (u == 1 && !two) {
                break;
            }
            const int j = 8 * (tile + NW * u) + 2 * t;
            S[g * sst + j] = c[u][0] * scale;
            S[g * sst + j + 1] = c[u][1] * scale;
            S[(g + 8) * sst + j] = c[u][2] * scale;
            S[(g + 8) * sst + j + 1] = c[u][3] * scale;
        }
    }
    __syncthreads();

    // 3. The softmax with the sink (ds4_attention's statistics), P in place; zeros past nk and
    //    for heads past n_heads.
    const unsigned full = 0xffffffffu;
    for (int hh = warp; hh < H; hh += NW) {
        float* l = S + hh * sst;
        if (h0 + hh >= n_heads) {
            for (int j = lane; j < 8 * tiles; j += 32) {
                l[j] = 0.0f;
            }
            continue;
        }
        const float sink = sinks[h0 + hh];
        float m = sink;
        for (int j = lane; j < nk; j += 32) {
            m = fmaxf(m, l[j]);
        }
        for (int o = 16; o > 0; o >>= 1) {
            m = fmaxf(m, __shfl_xor_sync(full, m, o));
        }
        double sum = 0.0;
        for (int j = lane; j < nk; j += 32) {
            sum += (double)expf(l[j] - m);
        }
        for (int o = 16; o > 0; o >>= 1) {
            sum += __shfl_xor_sync(full, sum, o);
        }
        const float denom = (float)((double)expf(sink - m) + sum);
        for (int j = lane; j < 8 * tiles; j += 32) {
            l[j] = j < nk ? expf(l[j] - m) / denom : 0.0f;
        }
    }
    __syncthreads();

    // 4. O = P V: warp w takes the head_dim / 8 columns from w head_dim / 8, as nt = head_dim /
    //    64 output tiles whose n index g is column nt g + i of the warp's (tile i), so that a
    //    lane's nt columns of a key are consecutive (one or two 16-byte loads); a chain over the
    //    keys in steps of 8, the next tile's values loaded while this one's products run.
    const int nt = head_dim / 64;
    const int vcol = warp * (head_dim / NW) + nt * g;
    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; i++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            acc[i][e] = 0.0f;
        }
    }
    if (nt == NT) {
        ds4_attn_mma_pv<NT>(acc, kp, S, sst, tiles, vcol, nt, g, t);  // Flash's head_dim 512
    } else {
        ds4_attn_mma_pv<0>(acc, kp, S, sst, tiles, vcol, nt, g, t);
    }

    // 5. O to shared memory (over Q's fragments, which no warp reads after step 2; rows of
    //    head_dim + 4 floats), then the inverse rope of the rotary pairs and the grouped store,
    //    four columns a thread.
    const int ost = head_dim + 4;
    float* O = (float*)attn_sm;
#pragma unroll
    for (int i = 0; i < NT; i++) {
        if (i < nt) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = warp * (head_dim / NW) + nt * (2 * t + (e & 1)) + i;
                O[(g + 8 * (e >> 1)) * ost + col] = acc[i][e];
            }
        }
    }
    __syncthreads();
    const int rope0 = head_dim - rope_dim;
    const int hpg = n_heads / groups;
    const int quads = head_dim / 4;
    for (int idx = threadIdx.x; idx < H * quads; idx += blockDim.x) {
        const int hh = idx / quads;
        const int col = 4 * (idx % quads);
        const int h = h0 + hh;
        if (h >= n_heads) {
            break;
        }
        float4 v = *(const float4*)&O[hh * ost + col];
        float x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const int pc = col + 2 * p;
            if (pc >= rope0) {
                float cs, sn;
                ds4_rope_cs(inv_freq, (int)a.pos, (pc - rope0) / 2, cs, sn);
                const float x0 = x[2 * p];
                const float x1 = x[2 * p + 1];
                x[2 * p] = x0 * cs + (-x1) * (-sn);
                x[2 * p + 1] = x1 * cs + x0 * (-sn);
            }
        }
        float* dst = out + (((long long)(h / hpg) * n + r) * hpg + (h % hpg)) * head_dim + col;
        *(float4*)dst = make_float4(x[0], x[1], x[2], x[3]);
    }
}
