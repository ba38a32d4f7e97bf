// decode_moe: kernels of the device-resident decode (see rust/engine/backend/cuda/decode/):
// the routed experts of a batch of n rows (a decode's or verify's up to 16, a prompt's step more), as rust/engine/model/moe.rs computes them.
//
// The routed experts run as grouped matrix products (the ds4_mv_<fmt>_<NB> kernels of
// common.cuh, NB >= n) whose descriptor tables ds4_route writes on the device, so the host
// never waits for the routing. Per layer, the host queues:
//   1. the router product: logits [n, E] = router_proj . h (one MvDesc, any product kernel);
//   2. ds4_route: each row's experts and weights (moe::route), the union of the experts of
//      the batch, the gather list, the combine lists, and the gate/up and down tables;
//   3. ds4_gather: xg[j] = h[gather_src[j]] (the rows of each used expert, expert by expert;
//      as 8-bit activations when the gate and up products take them: IQ2_XXS);
//   4. the gate/up products over the 2 * max_descs descriptors of `gu` (one launch);
//   5. SwiGLU of the gate and up outputs (decode_ops.cu; as 8-bit activations when the down
//      products take them: Q2_K);
//   6. the down products over the max_descs descriptors of `down` (one launch);
//   7. ds4_moe_combine: out = sum over the row's experts of weight * down output, then plus
//      the shared expert's output; in the decode it goes straight into the FFN site's
//      hyper-connection expansion (ds4_hc_post_at, decode_ops.cu).
// Unused descriptor slots (the batch uses m <= max_descs experts) have n = 0: their blocks
// return at once in matvec.
//
// Row invariance: each row's routing is computed by one warp with the same code whatever the
// batch; each row's expert products are its own dot products (the product kernels are row
// invariant); the combine adds a row's experts in increasing expert id, then the shared one.
// Only where a row's data lands in the gathered buffers depends on the batch.

// Limits of ds4_route: experts per layer, experts per row, batch rows, warps per block. Its
// arrays live in dynamic shared memory sized by the batch (route_smem below; the host's
// `route_smem` in decode/program.rs computes the same bytes).
#define MOE_MAX_EXPERTS 1024
#define MOE_MAX_K 16
#define MOE_MAX_ROWS 1024
#define MOE_MAX_WARPS 8
#define MOE_WORDS (MOE_MAX_EXPERTS / 32)
// Scores ds4_route holds at once (rows of E).
#define MOE_SCORES 4096

// The 4-byte words of ds4_route's dynamic shared memory for n rows of k experts of E: the
// scores of a round of rows, then per (row, pick) pair its expert and weight, per expert its
// row bitmap (ceil(n / 32) words) and their prefix counts, its rows, and its offset and slot
// (one word, one more past the last), and per slot (at most min(n k, E)) its expert, offset,
// rows and first descriptor (plus one).
__device__ __forceinline__ int route_smem_words(int n, int k, int E) {
    const int R = (n + 31) >> 5;
    const int S = min(n * k, E);
    const int per_round = max(1, MOE_SCORES / E);
    return min(n, per_round) * E + 2 * n * k + 2 * E * R + 2 * E + 1 + 4 * S + 1;
}

// ds4_route's arrays in its dynamic shared memory `sm` for n rows of k experts of E (the words
// of route_smem_words): the scores of up to MOE_SCORES / E rows at a time (sc); each row's
// chosen experts (ascending, repeats kept) and their weights, row r's j-th at CH(r, j) (ch_,
// wt_); each expert's rows as a bitmap (word w of expert e at RBITS(e, w)) and the rows of the
// words before (RPRE(e, w)); per expert its rows (e_cnt), and (e_pk, E + 1 entries) its first
// gathered row in the low 16 bits and its slot among the used experts above them; per slot
// i < min(n k, E) its expert, gathered-row offset, rows (s_exp, s_off, s_cnt); then (step 4)
// each used expert's first descriptor (s_dstart, m + 1 entries).
struct RouteSm {
    float* sc;
    int* ch_;
    float* wt_;
    u32* rbits;
    int* rpre;
    int* e_cnt;
    int* e_pk;
    int* s_exp;
    int* s_off;
    int* s_cnt;
    int* s_dstart;
};

__device__ __forceinline__ RouteSm route_sm_at(int* sm, int n, int k, int E) {
    const int R = (n + 31) >> 5;
    const int S = min(n * k, E);
    RouteSm a;
    a.sc = (float*)sm;
    a.ch_ = sm + min(n, max(1, MOE_SCORES / E)) * E;
    a.wt_ = (float*)(a.ch_ + n * k);
    a.rbits = (u32*)(a.wt_ + n * k);
    a.rpre = (int*)(a.rbits + E * R);
    a.e_cnt = a.rpre + E * R;
    a.e_pk = a.e_cnt + E;
    a.s_exp = a.e_pk + E + 1;
    a.s_off = a.s_exp + S;
    a.s_cnt = a.s_off + S;
    a.s_dstart = a.s_cnt + S;
    return a;
}

// Whether ds4_route's (and ds4_router_route's) arguments are inside its limits and its
// dynamic shared memory holds route_smem_words(n, k, E) words; outside them the arrays would
// overflow, so the kernels trap (a host bug).
__device__ __forceinline__ bool route_args_ok(int n, int k, int E, int max_descs, int chunk, int chunk_dn) {
    u32 dyn_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    const int warps = blockDim.x >> 5;
    return E <= MOE_MAX_EXPERTS && k <= MOE_MAX_K && n <= MOE_MAX_ROWS && k >= 1 && warps >= 2 &&
           warps <= MOE_MAX_WARPS && max_descs <= n * k && chunk >= 1 && chunk_dn >= 1 &&
           dyn_smem >= 4u * (u32)route_smem_words(n, k, E);
}

// The three templates of a routed table (gate, up, down) into `one` (shared), by warp 0's
// lanes, which alone read them, after a barrier or a __syncwarp (route_row1's).
__device__ __forceinline__ void route_copy_templ(MvDesc* one, const MvDesc* __restrict__ templ) {
    static_assert(3 * sizeof(MvDesc) / 8 <= 32, "warp 0 copies the three templates");
    if (threadIdx.x < 3 * sizeof(MvDesc) / 8) {
        ((unsigned long long*)one)[threadIdx.x] = ((const unsigned long long*)templ)[threadIdx.x];
    }
}

// Most descriptors a warp of ds4_route stages at a time on their way to the tables (in shared
// memory that its earlier steps are done with).
#ifndef ROUTE_STAGE
#define ROUTE_STAGE 16
#endif

// Exclusive prefix sums over i < len of v(i) = ceil(a[i] / div), or with div = 0 of a[i] + ((a[i]
// > 0) << 16) (an expert's rows and whether it is used, summed side by side: the rows of a
// batch stay below 2^16), into out[0..len), and their total into out[len], by the whole block
// of ds4_route (every thread calls it, after a barrier that follows the writes of a; it ends
// with one). Each thread sums a run of consecutive entries; a warp scan and the warps' totals
// (warp_tot, MOE_MAX_WARPS) give each run's start.
__device__ __forceinline__ int route_scan_value(int a, int div) {
    return div == 0 ? a + ((a > 0 ? 1 : 0) << 16) : (a + div - 1) / div;
}

__device__ __forceinline__ void route_scan(const int* a, int len, int div, int* out, int* warp_tot) {
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int per = (len + (int)blockDim.x - 1) / (int)blockDim.x;
    const int i0 = min(tid * per, len);
    const int i1 = min(i0 + per, len);
    int local = 0;
    for (int i = i0; i < i1; i++) {
        local += route_scan_value(a[i], div);
    }
    int v = local;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) {
            v += y;
        }
    }
    if (lane == 31) {
        warp_tot[warp] = v;
    }
    __syncthreads();
    int run = v - local;
    for (int p = 0; p < warp; p++) {
        run += warp_tot[p];
    }
    for (int i = i0; i < i1; i++) {
        out[i] = run;
        run += route_scan_value(a[i], div);
    }
    if (tid == (int)blockDim.x - 1) {
        out[len] = run;  // the last thread's run ends at len
    }
    __syncthreads();
}

// A float's key under Rust's f32::total_cmp: keys compare as signed ints in the total order
// (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN).
__device__ __forceinline__ int ds4_total_key(float x) {
    const int i = __float_as_int(x);
    return i ^ (int)(((unsigned)(i >> 31)) >> 1);
}

// softplus(x) = ln(1 + e^x), linear above 20 (rust/engine/backend/cpu.rs softplus): e^x
// rounded to float, then ln(1 + that) rounded to float, each computed in double (so each
// step is the correctly rounded float the CPU's libm gives in all but rare cases).
__device__ __forceinline__ float ds4_softplus(float x) {
    if (x > 20.0f) {
        return x;
    }
    const float e = (float)exp((double)x);
    return (float)log1p((double)e);
}

// Row r's j-th pick and its weight in route_round's and ds4_route's lists ([n, k]).
#define CH(r, j) ch_[(r) * k + (j)]
#define WT(r, j) wt_[(r) * k + (j)]

// Step 1 of the routing (moe::route) for rows r0 .. r0 + rows - 1 of a batch, by the whole
// block (every thread calls it; it ends with a barrier): the rows' scores sqrt(softplus(logit))
// into sc [rows, E] by all threads (the softplus in double is the routing's longest chain: with
// one warp per row, a lone row left the other warps idle), then one warp per row its k picks
// in ascending expert order (repeats kept) into ch_ and their weights into wt_ ([*, k], shared
// or global memory). Arguments as for ds4_route; rows * E <= MOE_SCORES.
template <int WORDS, bool FRESH>
__device__ __forceinline__ void route_round_w(const float* __restrict__ logits, int E, int k,
                                            const float* __restrict__ bias, const unsigned* __restrict__ hash,
                                            int norm, float wscale, const int* __restrict__ step, int r0, int rows,
                                            float* sc, int* ch_, float* wt_) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    for (int i = threadIdx.x; i < rows * E; i += blockDim.x) {
        const float* l = logits + (long long)r0 * E + i;
        sc[i] = sqrtf(ds4_softplus(FRESH ? __ldcg(l) : *l));
    }
    __syncthreads();
    for (int r = r0 + warp; r < r0 + rows; r += nw) {
        const float* rs = sc + (r - r0) * E;
        if (hash != nullptr) {
            const long long token = step[2 + r];
            if (lane < k) {
                CH(r, lane) = (int)hash[token * k + lane];
            }
        } else {
            // Top-k of scores + bias by descending total_cmp, ties to the lower index: k
            // rounds of an arg-max over the experts not yet taken. Each lane keeps the keys
            // of its experts lane, lane + 32, ... in registers, and which are still free.
            int keys[WORDS];
            u32 free_ = 0u;
#pragma unroll
            for (int i = 0; i < WORDS; i++) {
                const int e = lane + 32 * i;
                keys[i] = 0;
                if (e < E) {
                    keys[i] = ds4_total_key(rs[e] + bias[e]);
                    free_ |= 1u << i;
                }
            }
            for (int j = 0; j < k; j++) {
                bool have = false;
                int key = 0;
                int idx = 0;
#pragma unroll
                for (int i = 0; i < WORDS; i++) {
                    // Increasing expert per lane: equal keys keep the lower index.
                    if (((free_ >> i) & 1u) && (!have || keys[i] > key)) {
                        have = true;
                        key = keys[i];
                        idx = lane + 32 * i;
                    }
                }
                for (int o = 16; o > 0; o >>= 1) {
                    const int oh = __shfl_xor_sync(0xffffffffu, (int)have, o);
                    const int ok = __shfl_xor_sync(0xffffffffu, key, o);
                    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
                    if (oh && (!have || ok > key || (ok == key && oi < idx))) {
                        have = true;
                        key = ok;
                        idx = oi;
                    }
                }
                if (lane == (idx & 31)) {
                    free_ &= ~(1u << (idx >> 5));
                }
                if (lane == 0) {
                    CH(r, j) = idx;
                }
            }
        }
        __syncwarp();
        // Ascending expert ids (the fixed order of the sums over experts), lane j < k for
        // pick j: its rank counts the smaller picks and the equal ones before it (a stable
        // sort), so the row's list is the sorted picks.
        const int v = lane < k ? CH(r, lane) : 0;
        int rank = 0;
        for (int j = 0; j < k; j++) {
            const int o = __shfl_sync(0xffffffffu, v, j);
            rank += (o < v || (o == v && j < lane)) ? 1 : 0;
        }
        __syncwarp();  // every pick read before any is moved
        if (lane < k) {
            CH(r, rank) = v;
            WT(r, rank) = rs[v];
        }
        __syncwarp();
        if (norm) {
            // The sum in ascending order (every lane the same one), then each weight over it.
            float sum = WT(r, 0);
            for (int j = 1; j < k; j++) {
                sum += WT(r, j);
            }
            sum = sum + 1e-20f;
            __syncwarp();  // every lane's sum read before any weight is divided
            if (lane < k) {
                WT(r, lane) = WT(r, lane) / sum;
            }
        }
        if (lane < k) {
            WT(r, lane) = WT(r, lane) * wscale;
        }
        __syncwarp();
    }
    __syncthreads();
}

// route_round_w with the fewest words of experts a lane holds for E: one round of the top-k is
// an arg-max over WORDS registers, so Flash's 256 experts take 8 where MOE_WORDS is 32 (the same
// picks: the words past E hold no expert). FRESH: the logits were written by other blocks of
// the same launch (ds4_router_route), so they are read from L2, never through the read-only
// path.
template <bool FRESH = false>
__device__ __forceinline__ void route_round(const float* __restrict__ logits, int E, int k,
                                            const float* __restrict__ bias, const unsigned* __restrict__ hash,
                                            int norm, float wscale, const int* __restrict__ step, int r0, int rows,
                                            float* sc, int* ch_, float* wt_) {
    if (E <= 256) {
        route_round_w<8, FRESH>(logits, E, k, bias, hash, norm, wscale, step, r0, rows, sc, ch_, wt_);
    } else {
        route_round_w<MOE_WORDS, FRESH>(logits, E, k, bias, hash, norm, wscale, step, r0, rows, sc, ch_, wt_);
    }
}

// Step 1 of ds4_route alone, its rows spread over blocks: for a prompt's step, where one block
// scoring and choosing for hundreds of rows left the other SMs idle. Block b routes rows
// b * per .. b * per + per - 1 (per = its warps, at most MOE_SCORES / E) with route_round, the
// code ds4_route runs for a row itself, so the picks and weights are the same; they go to picks
// and pick_w [n, k], for ds4_route's arguments of those names. Arguments as for ds4_route.
// Grid (ceil(n / per)), block a multiple of 32 up to 256.
extern "C" __global__ void __launch_bounds__(256)
    ds4_route_pick(const float* __restrict__ logits, int E, int k, const float* __restrict__ bias,
                   const unsigned* __restrict__ hash, int norm, float wscale, int n, const int* __restrict__ step,
                   int* __restrict__ picks, float* __restrict__ pick_w) {
    ds4_grid_deps();
    __shared__ float sc[MOE_SCORES];
    if (E > MOE_MAX_EXPERTS || k > MOE_MAX_K || k < 1) {
        __trap();
    }
    const int per = min((int)(blockDim.x >> 5), max(1, MOE_SCORES / E));
    const int r0 = blockIdx.x * per;
    if (r0 < n) {
        route_round(logits, E, k, bias, hash, norm, wscale, step, r0, min(per, n - r0), sc, picks, pick_w);
    }
}

// Descriptor q of a routed product table from its template T (ds4_route's step 4): expert e's
// matrix, c rows (0 for an unused slot) from gathered row `off`, slot q's partial sums and
// counters with chunks of ck rows, and its first block in the launch.
__device__ __forceinline__ MvDesc route_desc(const MvDesc& T, int e, int off, int c, int q, int ck, int block_start) {
    MvDesc D = T;
    D.w = T.w + (long long)e * T.row_bytes * T.n_out;
    D.x = T.x + (long long)off * T.n_in;
    D.y = T.y + (long long)off * T.n_out;
    D.part = T.part + (long long)q * T.slices * ck * T.n_out;
    D.n = c;
    D.counter = T.counter + q * mv_row_blocks(T);
    D.block_start = block_start;
    return D;
}

// Steps 2 to 4 of ds4_route for a batch of one row (every decode step), by one warp with no
// block barriers: with one row each used expert has one gathered row and one descriptor, so
// the slot of the row's j-th distinct expert (ascending) is j, its gathered row j, and the
// outputs follow from the row's sorted picks ch_, wt_ ([k], shared) alone. The same values as
// the batch path would write for n = 1 (tests_moe's route_matches_cpu checks one-row and
// batch launches against the CPU's routing, and each batch row against the row alone, bit
// for bit). s_exp: shared scratch of k ints. This path spares a decode row the batch path's
// barriers and scans over every expert: in a traced Flash step on an H200 a layer's routing
// ended 11.3 us after the router product this way, against 13.8 (median over the layers).
// (Measurements: scripts/kernel_lab/HISTORY.md, "decode_moe.cu: route_one".)
__device__ __forceinline__ void route_one(int k, MvDesc* __restrict__ gu, MvDesc* __restrict__ down, int max_descs,
                                          const MvDesc* templ, int* __restrict__ gather_src,
                                          int* __restrict__ comb_slot, float* __restrict__ comb_w,
                                          int* __restrict__ comb_cnt, int chunk, int chunk_dn, const int* ch_,
                                          const float* wt_, int* s_exp) {
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    const int v = lane < k ? ch_[lane] : -1;
    const float w = lane < k ? wt_[lane] : 0.0f;
    const int before = __shfl_up_sync(full, v, 1);
    const bool first = lane < k && (lane == 0 || before != v);  // FIRST(0, lane)
    const u32 fm = __ballot_sync(full, first);
    const int m = __popc(fm);                        // distinct experts: used slots, gathered rows
    const int dj = __popc(fm & ((1u << lane) - 1u));  // distinct experts below pick `lane`
    // The weights of the row's picks of one expert, added in pick order.
    float ws = w;
    bool run = true;
    for (int d = 1; d < k; d++) {
        const int vo = __shfl_sync(full, v, (lane + d) & 31);
        const float wo = __shfl_sync(full, w, (lane + d) & 31);
        run = run && lane + d < k && vo == v;
        if (run) {
            ws += wo;
        }
    }
    if (first) {
        gather_src[dj] = 0;
        comb_slot[dj] = dj;
        comb_w[dj] = ws;
        s_exp[dj] = v;
    }
    if (lane < k && lane >= m) {
        gather_src[lane] = -1;
        comb_slot[lane] = 0;
        comb_w[lane] = 0.0f;
    }
    if (lane == 0) {
        comb_cnt[0] = m;
    }
    __syncwarp();
    // The tables: slot q < m is expert s_exp[q]'s one row (off = q, n = 1); past m, n = 0.
    const int bpd_gate = mv_row_blocks(templ[0]) * templ[0].slices;
    for (int i = lane; i < 3 * max_descs; i += 32) {
        const int t = i / max_descs;
        const int q = i - t * max_descs;
        const MvDesc& T = templ[t];
        const bool used = q < m;
        const int start = (t == 1 ? m * bpd_gate : 0) + min(q, m) * mv_row_blocks(T) * T.slices;
        (t == 2 ? down : gu + (t == 1 ? max_descs : 0))[q] =
            route_desc(T, used ? s_exp[q] : 0, used ? q : 0, used ? 1 : 0, q, t == 2 ? chunk_dn : chunk, start);
    }
}

// A decode step's row (ds4_route with n = 1, and the tail of ds4_router_route): step 1 by the
// block (route_round), or the row's picks from ds4_route_pick, then the rest by warp 0 alone
// (route_one). Every thread of the block calls it; warp 0 has copied the templates to
// one_templ. Arguments as for ds4_route; `a`: its shared arrays for one row.
template <bool FRESH>
__device__ __forceinline__ void route_row1(const float* __restrict__ logits, int E, int k,
                                           const float* __restrict__ bias, const unsigned* __restrict__ hash,
                                           int norm, float wscale, const int* __restrict__ step,
                                           MvDesc* __restrict__ gu, MvDesc* __restrict__ down, int max_descs,
                                           const MvDesc* one_templ, int* __restrict__ gather_src,
                                           int* __restrict__ comb_slot, float* __restrict__ comb_w,
                                           int* __restrict__ comb_cnt, int chunk, int chunk_dn,
                                           const int* __restrict__ picks, const float* __restrict__ pick_w,
                                           const RouteSm& a) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (picks == nullptr) {
        route_round<FRESH>(logits, E, k, bias, hash, norm, wscale, step, 0, 1, a.sc, a.ch_, a.wt_);
    } else if (warp == 0) {
        if (lane < k) {
            a.ch_[lane] = picks[lane];
            a.wt_[lane] = pick_w[lane];
        }
        __syncwarp();
    }
    if (warp == 0) {
        route_one(k, gu, down, max_descs, one_templ, gather_src, comb_slot, comb_w, comb_cnt, chunk, chunk_dn, a.ch_,
                  a.wt_, a.s_exp);
    }
}

// The routing of a batch (moe::route per row, then the grouping of moe::forward).
//
// logits [n, E]: the router product of each row. k experts per row. bias [E]: the selection
// bias of learned routing (unused when hash != null). hash [vocab, k]: the experts of each
// token id (hash routing), or null. norm: divide each row's weights by their sum (+1e-20);
// wscale: then multiply them by it. step: the step parameters (step[2 + r] = token of row r).
//
// Outputs (m = the number of distinct experts of the batch, e_0 < ... < e_{m-1}; c_i = rows
// of expert e_i; off_i = c_0 + ... + c_{i-1}; total = sum of c_i):
// - gather_src [n * k]: gather_src[off_i + t] = the t-th row (ascending) of e_i; -1 from
//   total on.
// - comb_cnt [n]: distinct experts of row r; comb_slot, comb_w [n, k]: for row r's j-th
//   distinct expert (ascending), the gathered row of (expert, r) and its weight (the weights
//   of equal hash entries added in chosen order); entries from comb_cnt[r] on are 0.
// - gu [2 * max_descs], down [max_descs]: the gate, up and down product tables, built from
//   templ[0..3] (gate, up, down: w = expert 0's matrix, x, y, part = bases of the gathered
//   input, output and partial-sum buffers, row_bytes, n_out, n_in, slices, counter = first
//   counter). Expert e_i's rows are cut in chunks of at most `chunk` rows (gu) or `chunk_dn`
//   rows (down), one slot each, in expert then row order: the slot of chunk t of e_i has
//   w = templ.w + e_i * (one matrix), x = templ.x + (off_i + t * chunk) rows, y likewise,
//   n = its rows; the `used` slots past the last chunk have n = 0 and the template's w, x and
//   y. part = templ.part + q * slices * chunk * n_out floats for slot q, counter =
//   templ.counter + q * row_blocks. block_start (bpd = row_blocks * slices of the template):
//   the used slots' blocks first and without gaps, gate q * bpd_gate, up used * bpd_gate + q *
//   bpd_up, down q * bpd_down; every unused slot starts where the used blocks end (gate: where
//   up's begin), so a launch's live blocks are [0, the last slot's start) when that slot is
//   unused, and the binary search of mv_block never lands a live block on an unused slot
//   (gemm_experts.cu `gx_live`). With a chunk >= n every expert has one slot (the union of
//   the batch).
//
// picks, pick_w: null, or each row's picks and weights [n, k] as ds4_route_pick wrote them,
// which then stand for step 1 here (logits, bias, hash, norm and wscale unused).
//
// Work: every step is spread over the block's threads by (row, pick) pair or by expert, with
// no thread walking all rows. Each expert's rows are a bitmap (expert-major, R = ceil(n / 32)
// words) with its words' prefix counts, so a pair's place among its expert's rows is a lookup
// and a popcount; the descriptor tables go out through a small staging area in shared memory
// as whole 8-byte words, each warp's stores contiguous. (The first form walked all n rows per
// expert and wrote each descriptor by one thread: 240 us a layer in a traced 512-row step of
// Flash on an H200, this one's first form 66. A single row, which this form served more slowly
// than the first, takes route_one's path after step 1.)
// (Measurements: scripts/kernel_lab/HISTORY.md, "decode_moe.cu: ds4_route work".)
//
// Grid (1), block 128 or 256 threads (any multiple of 32 from 64 to 256), dynamic shared
// memory of 4 * route_smem_words(n, k, E) bytes or more (a 512-row step of Flash's 6 of 256
// experts: 78 KB, past the default 48 KB: the host opts the kernel in). Requires E <= 1024,
// k <= 16, n <= 512, chunks >= 1, max_descs >= the number of chunks of either (n * k always
// is; min(n * k, E) is when both chunks >= n) and <= n * k, hash entries < E.
//
// (Tried and dropped: the templates and the selection bias copied to shared memory before the
// wait for the router product for every batch, with the rope's cos / sin and the norms'
// weights loaded before the wait in ds4_finish_rows, ds4_attention and ds4_rms_weight: no
// gain. The top-k's 8-word rounds (route_round) and the one-row templates, tried with them,
// came back with route_one.)
// (Measurements: scripts/kernel_lab/HISTORY.md, "decode_moe.cu: ds4_route dropped".)
extern "C" __global__ void __launch_bounds__(256)
    ds4_route(const float* __restrict__ logits, int E, int k, const float* __restrict__ bias,
              const unsigned* __restrict__ hash, int norm, float wscale, int n, const int* __restrict__ step,
              MvDesc* __restrict__ gu, MvDesc* __restrict__ down, int max_descs, const MvDesc* __restrict__ templ,
              int* __restrict__ gather_src, int* __restrict__ comb_slot, float* __restrict__ comb_w,
              int* __restrict__ comb_cnt, int chunk, int chunk_dn, const int* __restrict__ picks,
              const float* __restrict__ pick_w) {
    // One row (route_one): the templates, which the host wrote before any kernel of the
    // program ran, come in before the wait.
    __shared__ __align__(16) MvDesc one_templ[3];
    if (n == 1) {
        route_copy_templ(one_templ, templ);
    }
    // With one row the gather (6 x 16 blocks for Flash) may launch now, its blocks waiting for
    // this grid to finish. (With more rows not: at a verify's 8 rows its 768 waiting blocks
    // took the SM room of the side branch's shared expert, and verifies of 8 rows took 23.4
    // ms against 22.7.)
    if (n == 1) {
        ds4_grid_launch();
    }
    ds4_grid_deps();
    const int R = (n + 31) >> 5;
    if (!route_args_ok(n, k, E, max_descs, chunk, chunk_dn)) {
        __trap();
    }
    extern __shared__ __align__(16) int route_sm[];
    // The arrays (route_sm_at says what each holds).
    const RouteSm a = route_sm_at(route_sm, n, k, E);
    float* sc = a.sc;
    int* ch_ = a.ch_;
    float* wt_ = a.wt_;
    u32* rbits = a.rbits;
    int* rpre = a.rpre;
    int* e_cnt = a.e_cnt;
    int* e_pk = a.e_pk;
    const int S = min(n * k, E);
    int* s_exp = a.s_exp;
    int* s_off = a.s_off;
    int* s_cnt = a.s_cnt;
    int* s_dstart = a.s_dstart;
    // Each warp's sum in the scans.
    __shared__ int warp_tot[MOE_MAX_WARPS];
    // In step 4, each warp's staging of descriptors on their way out, stage_n of them, over the
    // arrays of steps 1 to 3 (sc to rpre, 8-byte aligned: MvDesc is 80 bytes); none for tables
    // of one warp's slots (a decode's: its stores are few) or when those arrays are too small
    // for one a warp (each lane then stores its own).
    constexpr int DW = (int)(sizeof(MvDesc) / 8);
    const int dead_words = min(n, max(1, MOE_SCORES / E)) * E + 2 * n * k + 2 * E * R;
    const int stage_n =
        max_descs <= 32 ? 0 : min(ROUTE_STAGE, dead_words / (2 * DW * (int)(blockDim.x >> 5)));

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
#define RBITS(e, w) rbits[(e) * R + (w)]
#define RPRE(e, w) rpre[(e) * R + (w)]
// Whether row r's pick j is its first of that expert (equal picks are adjacent).
#define FIRST(r, j) ((j) == 0 || CH(r, (j) - 1) != CH(r, j))

    if (n == 1) {
        route_row1<false>(logits, E, k, bias, hash, norm, wscale, step, gu, down, max_descs, one_templ, gather_src,
                          comb_slot, comb_w, comb_cnt, chunk, chunk_dn, picks, pick_w, a);
        return;
    }

    // rbits, rpre (all zeros when R = 1) and e_cnt, which follow each other.
    for (int i = tid; i < 2 * E * R + E; i += blockDim.x) {
        rbits[i] = 0u;
    }
    __syncthreads();

    // ---- 1. each row's experts and weights (moe::route): here a round of rows at a time, or
    // ds4_route_pick's; then each expert's rows.
    if (picks == nullptr) {
        const int per_round = MOE_SCORES / E;
        for (int r0 = 0; r0 < n; r0 += per_round) {
            route_round(logits, E, k, bias, hash, norm, wscale, step, r0, min(per_round, n - r0), sc, ch_, wt_);
        }
    } else {
        for (int i = tid; i < n * k; i += blockDim.x) {
            ch_[i] = picks[i];
            wt_[i] = pick_w[i];
        }
        __syncthreads();
    }
    for (int i = tid; i < n * k; i += blockDim.x) {
        const int r = i / k;
        const int v = ch_[i];
        if (FIRST(r, i - r * k)) {
            atomicOr(&RBITS(v, r >> 5), 1u << (r & 31));
            atomicAdd(&e_cnt[v], 1);
        }
    }
    __syncthreads();

    // ---- 2. per expert the prefix counts of its rows' words (past 32 rows); then the experts'
    // offsets and slots
    if (R > 1) {
        for (int e = tid; e < E; e += blockDim.x) {
            int c = 0;
            for (int w = 0; w < R; w++) {
                RPRE(e, w) = c;
                c += __popc(RBITS(e, w));
            }
        }
        __syncthreads();
    }
    route_scan(e_cnt, E, 0, e_pk, warp_tot);
    const int m = e_pk[E] >> 16;
    const int total = e_pk[E] & 0xffff;

    // ---- 3. the used experts' slots, the gather list and the combine lists
    for (int e = tid; e < E; e += blockDim.x) {
        if (e_cnt[e] > 0) {
            const int s = e_pk[e] >> 16;
            s_exp[s] = e;
            s_off[s] = e_pk[e] & 0xffff;
            s_cnt[s] = e_cnt[e];
        }
    }
    for (int idx = tid; idx < n * k; idx += blockDim.x) {
        const int r = idx / k;
        const int j = idx - r * k;
        // The row's distinct experts below pick j, and in all.
        int dj = 0;
        int cnt = 0;
        for (int j2 = 0; j2 < k; j2++) {
            const int f = FIRST(r, j2) ? 1 : 0;
            dj += j2 < j ? f : 0;
            cnt += f;
        }
        if (FIRST(r, j)) {
            // The gathered row of (e, r): e's offset plus the rows before r that use e. Its
            // combine entry: the weights of the row's picks of e, added in pick order.
            const int e = CH(r, j);
            const int w = r >> 5;
            const int pos = (e_pk[e] & 0xffff) + RPRE(e, w) + __popc(RBITS(e, w) & ((1u << (r & 31)) - 1u));
            float ws = WT(r, j);
            for (int j2 = j + 1; j2 < k && CH(r, j2) == e; j2++) {
                ws += WT(r, j2);
            }
            gather_src[pos] = r;
            comb_slot[r * k + dj] = pos;
            comb_w[r * k + dj] = ws;
        }
        // The rest of the combine lists (entries past a row's distinct experts) and of the
        // gather list (past its total rows).
        if (j == 0) {
            comb_cnt[r] = cnt;
        }
        if (idx >= total) {
            gather_src[idx] = -1;
        }
        if (j >= cnt) {
            comb_slot[idx] = 0;
            comb_w[idx] = 0.0f;
        }
    }
    __syncthreads();

    // ---- 4. the product tables: expert e_i's c_i rows in chunks of at most `chunk` rows (the
    // gate and up tables) or `chunk_dn` rows (the down table), one descriptor per chunk
    // (descriptor q of e_i covers its rows t * chunk .., t = q - first). The host runs them
    // with the product kernel for that many rows: a kernel for few rows is faster per row than
    // one for many, and experts of a batch mostly serve one or two rows (a prompt's step's
    // gate and up products on the tensor cores take more: gemm_experts.cu).
    // One pass per chunking: gate and up, then down; one pass for the three when the chunks
    // are equal (a decode's and a verify's).
    const int passes = chunk == chunk_dn ? 1 : 2;
    for (int pass = 0; pass < passes; pass++) {
        const int ck = pass == 0 ? chunk : chunk_dn;
        // s_dstart[i] = the descriptors of the used experts before i (i <= m).
        route_scan(s_cnt, m, ck, s_dstart, warp_tot);
        const int used = s_dstart[m];
        const int t0 = pass == 0 ? 0 : 2;
        const int t1 = passes == 1 ? 3 : (pass == 0 ? 2 : 3);
        const int bpd_first = mv_row_blocks(templ[t0]) * templ[t0].slices;
        // Each warp writes runs of `per` consecutive slots of each of its tables: lane l < per
        // builds slot q0 + l in its staging area, then the warp stores the run as 8-byte words,
        // contiguous (one thread a descriptor, ten stores 80 bytes apart, took tens of
        // microseconds for the thousands of slots of a prompt's step); without staging, lane l
        // stores slot q0 + l itself.
        const int per = stage_n > 0 ? stage_n : 32;
        unsigned long long* stage = (unsigned long long*)route_sm + warp * stage_n * DW;
        const int runs = (max_descs + per - 1) / per;
        for (int run = warp; run < runs; run += blockDim.x >> 5) {
            const int q0 = run * per;
            const int nq = min(per, max_descs - q0);
            const int q = q0 + lane;
            int e = 0;
            int off = 0;
            int c = 0;
            if (lane < nq && q < used) {
                // The expert whose descriptors hold q: the last i with s_dstart[i] <= q (every
                // used expert has at least one).
                int lo = 0;
                int hi = m - 1;
                while (lo < hi) {
                    const int mid = (lo + hi + 1) >> 1;
                    if (s_dstart[mid] <= q) {
                        lo = mid;
                    } else {
                        hi = mid - 1;
                    }
                }
                const int t = q - s_dstart[lo];
                e = s_exp[lo];
                off = s_off[lo] + t * ck;
                c = min(ck, s_cnt[lo] - t * ck);
            }
            for (int t = t0; t < t1; t++) {
                const MvDesc T = templ[t];
                const int rb = mv_row_blocks(T);
                const int bpd = rb * T.slices;
                // The blocks of the table's earlier matrix (gate before up).
                const int base = t == 1 ? used * bpd_first : 0;
                if (lane < nq) {
                    const MvDesc D = route_desc(T, e, off, c, q, ck, base + min(q, used) * bpd);
                    if (stage_n > 0) {
                        *(MvDesc*)(stage + lane * DW) = D;
                    } else {
                        (t == 2 ? down : gu + (t == 1 ? max_descs : 0))[q] = D;
                    }
                }
                if (stage_n > 0) {
                    __syncwarp();
                    MvDesc* dst = t == 2 ? down + q0 : (t == 1 ? gu + max_descs + q0 : gu + q0);
                    for (int i = lane; i < nq * DW; i += 32) {
                        ((unsigned long long*)dst)[i] = stage[i];
                    }
                    __syncwarp();
                }
            }
        }
        __syncthreads();  // s_dstart is the next pass's
    }
#undef CH
#undef WT
#undef RBITS
#undef RPRE
#undef FIRST
}

// ---- The router's product and a decode row's routing in one launch (DS4_CUDA_ROUTE_TAIL=1)
//
// ds4_router_route_<f32|f16|bf16> runs the blocks of the router's one-row product exactly as
// ds4_mv_<f32|f16|bf16>_1 does (matvec_split: the same logits, bit for bit); the last block to
// finish (ds4_last_block, decode_ops.cu: every logit, the slices' sums included, is written
// and fenced by then) runs ds4_route's one-row work (route_row1, reading the logits from L2).
// That spares the routing its own dependent launch after the product (in a traced Flash step
// the routing ended about 11 us after the router product, 2026-12-03). The launch: the product's grid and table (descs, count, counters,
// early as ds4_mv_*), then ds4_route's arguments up to chunk_dn (n = 1), then `done` (one
// int, zero between launches); blocks of 32 * MV_WARPS threads and dynamic shared memory of 4 *
// route_smem_words(1, k, E) bytes or more (the float formats have no lookup table).
// Same limits as ds4_route (route_args_ok).
template <class F>
__device__ __forceinline__ void router_route(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters,
                                             int early, const float* __restrict__ logits, int E, int k,
                                             const float* __restrict__ bias, const unsigned* __restrict__ hash,
                                             int norm, float wscale, int n, const int* __restrict__ step,
                                             MvDesc* __restrict__ gu, MvDesc* __restrict__ down, int max_descs,
                                             const MvDesc* __restrict__ templ, int* __restrict__ gather_src,
                                             int* __restrict__ comb_slot, float* __restrict__ comb_w,
                                             int* __restrict__ comb_cnt, int chunk, int chunk_dn,
                                             int* __restrict__ done) {
    extern __shared__ __align__(16) u8 smem[];
    matvec_split<F, 1>(descs, count, counters, smem, early);
    if (!ds4_last_block(done)) {
        return;
    }
    if (n != 1 || !route_args_ok(n, k, E, max_descs, chunk, chunk_dn)) {
        __trap();
    }
    __shared__ __align__(16) MvDesc one_templ[3];
    route_copy_templ(one_templ, templ);
    route_row1<true>(logits, E, k, bias, hash, norm, wscale, step, gu, down, max_descs, one_templ, gather_src,
                     comb_slot, comb_w, comb_cnt, chunk, chunk_dn, nullptr, nullptr,
                     route_sm_at((int*)smem, 1, k, E));
}

#define ROUTER_ROUTE_KERNEL(NAME, F)                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * MV_WARPS, (MvMinBlocks<F, 1>::value))                         \
        ds4_router_route_##NAME(const MvDesc* __restrict__ descs, int count, int* __restrict__ counters, int early,  \
                                const float* __restrict__ logits, int E, int k, const float* __restrict__ bias,      \
                                const unsigned* __restrict__ hash, int norm, float wscale, int n,                    \
                                const int* __restrict__ step, MvDesc* __restrict__ gu, MvDesc* __restrict__ down,    \
                                int max_descs, const MvDesc* __restrict__ templ, int* __restrict__ gather_src,       \
                                int* __restrict__ comb_slot, float* __restrict__ comb_w, int* __restrict__ comb_cnt, \
                                int chunk, int chunk_dn, int* __restrict__ done) {                                   \
        router_route<F>(descs, count, counters, early, logits, E, k, bias, hash, norm, wscale, n, step, gu, down,    \
                        max_descs, templ, gather_src, comb_slot, comb_w, comb_cnt, chunk, chunk_dn, done);           \
    }

ROUTER_ROUTE_KERNEL(f32, FmtF32)
ROUTER_ROUTE_KERNEL(f16, FmtF16)
ROUTER_ROUTE_KERNEL(bf16, FmtBF16)

// Row s (d floats) quantized to 8-bit activations (rust/engine/quant/act8.rs) into o, the row's
// slot of d floats: d int8 values, then d / 32 f32 scales. The warps of the row's blocks (part
// `part` of `parts`) take its blocks of 32 in turn (ds4_act8_block).
__device__ __forceinline__ void ds4_act8_row(const float* __restrict__ s, char* __restrict__ o, int d, int part,
                                             int parts) {
    const int warps = (blockDim.x >> 5) * parts;
    for (int blk = part * (blockDim.x >> 5) + (threadIdx.x >> 5); blk < (d >> 5); blk += warps) {
        ds4_act8_block(s[32 * blk + (threadIdx.x & 31)], o + 32 * blk, (float*)(o + d) + blk);
    }
}

// ds4_gather of 8-bit activations four values a lane (DS4_CUDA_WIDE=1, a prompt's steps): each
// warp takes four blocks of 32 at a time, one 16-byte load a lane (ds4_act8_quad), where
// ds4_gather's warps take one block, a value a lane: the same bytes with a quarter of the
// blocks (a 1024-row step gathers 6144 rows). d a multiple of 32. Grid (n * k, parts), block a
// multiple of 32 (the host: 256, parts ceil(d / 1024)).
extern "C" __global__ void ds4_gather4(const float* __restrict__ h, float* __restrict__ xg,
                                       const int* __restrict__ gather_src, int d) {
    ds4_grid_deps();
    const int src = gather_src[blockIdx.x];
    if (src < 0) {
        return;
    }
    const float* s = h + (long long)src * d;
    char* o = (char*)(xg + (long long)blockIdx.x * d);
    const int lane = threadIdx.x & 31;
    const int nblk = d >> 5;
    const int warps = (blockDim.x >> 5) * gridDim.y;
    // The loop's test is the warp's (b0), so every lane of it runs the shuffles.
    for (int b0 = 4 * (blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5)); b0 < nblk; b0 += 4 * warps) {
        const int blk = b0 + (lane >> 3);
        const bool ok = blk < nblk;
        const float4 v = ok ? __ldg((const float4*)(s + 32 * blk) + (lane & 7)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        ds4_act8_quad(v, ok, o + 32 * blk, (float*)(o + d) + blk);
    }
}

// xg[j] = h[gather_src[j]] (d floats), nothing where gather_src[j] < 0; with act8 != 0 each row
// is written as 8-bit activations (ds4_act8_row; d a multiple of 32), the input of IQ2_XXS
// gate and up products. Grid (n * k, parts): the parts of a row split its work (with one
// block a row, its warps' chains of 16 quantized blocks took 9.5 us at d = 4096 on an H200).
// Block 256 (any multiple of 32).
extern "C" __global__ void ds4_gather(const float* __restrict__ h, float* __restrict__ xg,
                                      const int* __restrict__ gather_src, int d, int act8) {
    ds4_grid_deps();
    const int j = blockIdx.x;
    const int src = gather_src[j];
    if (src < 0) {
        return;
    }
    const float* s = h + (long long)src * d;
    float* o = xg + (long long)j * d;
    const int first = blockIdx.y * blockDim.x + threadIdx.x;
    const int step = gridDim.y * blockDim.x;
    if (act8) {
        ds4_act8_row(s, (char*)o, d, blockIdx.y, gridDim.y);
    } else if (((d & 3) == 0) && ((((unsigned long long)h | (unsigned long long)xg) & 15) == 0)) {
        const int d4 = d >> 2;
        for (int i = first; i < d4; i += step) {
            ((float4*)o)[i] = ((const float4*)s)[i];
        }
    } else {
        for (int i = first; i < d; i += step) {
            o[i] = s[i];
        }
    }
}

// out[r, i] = sum over j < comb_cnt[r] (ascending) of down_out[comb_slot[r, j], i] *
// comb_w[r, j], starting from 0, then + shared[r, i] (the end of moe::forward: the row's
// experts in increasing id, then the shared expert). down_out: [n * k, d] gathered rows.
// With x (not null) the row's output is not stored: it goes straight into the FFN site's
// hyper-connection expansion of x with mix (ds4_hc_post_at, hc streams), as ds4_hc_post
// would do with it. Grid (ceil(d / 256), n), block 256.
extern "C" __global__ void ds4_moe_combine(const float* __restrict__ down_out, const int* __restrict__ comb_slot,
                                           const float* __restrict__ comb_w, const int* __restrict__ comb_cnt,
                                           const float* __restrict__ shared, float* __restrict__ out, int k, int d,
                                           float* x, const float* mix, int hc) {
    ds4_grid_lead();
    const int r = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= d) {
        return;
    }
    const int cnt = comb_cnt[r];
    float o = 0.0f;
    for (int j = 0; j < cnt; j++) {
        const float u = down_out[(long long)comb_slot[r * k + j] * d + i];
        o = o + u * comb_w[r * k + j];
    }
    o = o + shared[(long long)r * d + i];
    if (x != nullptr) {
        ds4_hc_post_at(x, o, mix, hc, d, r, i);
    } else {
        out[(long long)r * d + i] = o;
    }
}
