//! Device-resident decode: the whole forward pass of decode-sized batches (1..=16 rows) on the
//! GPU, with the session's attention state mirrored in device memory.
//!
//! A step uploads the step parameters (position, tokens) and the rows' embeddings, replays the
//! step's *program* (the launches of every layer, built once per batch size and logits choice
//! by `program.rs`, so every kernel argument and product descriptor is fixed; captured once as
//! a CUDA graph),
//! packs what the host needs to follow the step (each row's raw K=V rows, compressor
//! projections and emitted rows) into one buffer, and brings that and the logits back in one
//! wait (or, for [`DeviceDecoder::forward_argmax`], each requested row's argmax instead of its
//! logits: the program then ends with `ds4_argmax_rows`). The host replays the state writes
//! from it (with the undo log), so the host state stays the reference copy (see
//! [`crate::backend::DeviceDecoder`]); a speculative cut is
//! followed on the device ([`DeviceDecoder::kept`]), anything else the host changes is
//! re-uploaded (the state's sync tag tells). Nothing in a step depends on the host between its
//! upload and its download: the routed experts' product descriptors are written on the device
//! by the routing kernel, and each row's visible rows follow from its position.
//!
//! Row invariance holds as in the products: every kernel computes each row with the same code
//! and order whatever the batch, so a verify of k rows is bitwise k single-row decodes. A
//! prompt's steps ([`DeviceDecoder::set_prefill`]) have programs of their own, whose F16 and
//! float-x Q8_0 products run on the tensor cores (`gemm.rs`): row invariant among themselves,
//! within about 1e-6 of the decode's sums.
//!
//! Kernels: `shaders/cuda/decode_ops.cu` (norms, hyper-connections, query/key finishing,
//! SwiGLU), `decode_attn.cu` (ring and compressor updates, indexer, attention),
//! `decode_moe.cu` (routing, expert gather and combine), `decode_step.cu` (packing, the logits
//! rows' argmax).

pub(super) mod gemm;
mod program;
#[cfg(test)]
mod tests_attn;
#[cfg(test)]
mod tests_gemm;
#[cfg(test)]
mod tests_moe;
#[cfg(test)]
mod tests_ops;
#[cfg(test)]
mod tests_step;
#[cfg(test)]
pub(crate) mod testutil;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::context::{driver_err, Context, MAX_BATCH};
use super::device::{blocks_per_sm, static_smem, Arg, DevBuf};
use super::{chunk_rows, row_blocks, slices, CudaBackend, MV_WARPS};
use crate::backend::{DeviceDecoder, Greedy};
use crate::model::config::AttentionKind;
use crate::model::draft::{DSparkWeights, DraftKind, MtpInput, MtpPairing, MtpWeights};
use crate::model::drafting::{Chooser, Proposal};
use crate::model::forward::mean_of_streams;
use crate::model::weights::{HyperWeights, Mat, Router};
use crate::model::{Logits, Model};
use crate::sampling::Sampler;
use crate::state::{BatchLog, DraftState, KvPrecision, LayerState, PendingWrites, State};
use crate::{Error, Result};

/// Rows of a step: one product chunk of the matrix kernels.
const N_MAX: usize = MAX_BATCH;

/// Most rows of a prompt's step (`DS4_CUDA_PREFILL_ROWS`; ds4_route's MOE_MAX_ROWS in
/// decode_moe.cu).
const P_MAX: usize = 1024;

/// Rows of a prompt's step by default. A step reads each weight once for all its rows, so more
/// rows read less a token; past about 256 rows every routed expert is read anyway, but the
/// routed tensor-core kernels decode an expert's weights once for up to 32 of its rows and the
/// dense products read theirs fewer times a token, so larger steps kept winning (H200, Flash:
/// 2048-token prompts at 2090 tok/s in 1024-row steps against 1948 in 512-row ones). The
/// routing of 1024 rows takes 137 KB of shared memory (Flash's router). The steps' sizes give
/// the same bits. (Measurements: scripts/kernel_lab/HISTORY.md, "mod.rs: P_DEFAULT".)
const P_DEFAULT: usize = 1024;

/// The rows of a prompt's step: `setting` (`DS4_CUDA_PREFILL_ROWS`, 16..=1024) or [`P_DEFAULT`],
/// cut to the most whose routing fits in `smem_max` bytes of shared memory a block (ds4_route
/// for this router: `k` experts a row of `experts`, [`program::route_smem`]). With a drafter
/// too: a step of more rows than [`draft_cap`] leaves it out (`CudaDecoder::step`), and the
/// prompt's last rows come in steps that keep it (session.rs `prompt_chunks`). (Until
/// 2026-12-04 a drafter made every prompt step N_MAX rows: its upkeep and the host's capture
/// were sized for a decode's rows.)
fn prefill_rows(setting: Option<&str>, k: usize, experts: usize, smem_max: usize) -> Result<usize> {
    let want = match setting.map(str::trim) {
        None | Some("") => P_DEFAULT,
        Some(v) => match v.parse::<usize>() {
            Ok(r) if (N_MAX..=P_MAX).contains(&r) => r,
            _ => {
                return Err(Error::invalid(format!(
                    "DS4_CUDA_PREFILL_ROWS takes a row count from {N_MAX} to {P_MAX}, not {v:?}"
                )))
            }
        },
    };
    let fits = (N_MAX..=want).rev().find(|&r| program::route_smem(r, k, experts) <= smem_max);
    Ok(fits.unwrap_or(N_MAX))
}

/// Rows of the drafter's buffers on the device (its upkeep, DSpark's captured streams): the
/// most rows of a step that keeps the drafter's window rows (a longer prompt step leaves the
/// drafter out, `CudaDecoder::step`). Enough for the rows a prompt must end with
/// (`DraftState::refill_rows`: the ring's `window` + MAX_DRAFT + 1 slots, one more for MTP's
/// lag) in one step, in whole verifies, within the prompt's steps (`prompt_rows`); N_MAX
/// without a drafter. (Flash: 160 rows, about 50 MB of buffers for MTP.)
fn draft_cap(window: usize, prompt_rows: usize, drafter: bool) -> usize {
    if !drafter {
        return N_MAX;
    }
    (window + crate::spec::MAX_DRAFT + 2).next_multiple_of(N_MAX).min(prompt_rows).max(N_MAX)
}

/// The bit of an argmax id that says its row has no greedy token (`ds4_argmax_rows`).
const NO_GREEDY: u32 = 1 << 31;

/// A new sync tag (never 0).
fn fresh_tag() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn f32_buf(floats: usize) -> Result<DevBuf> {
    DevBuf::zeroed(floats * 4)
}

/// One run of the pack kernel (`Ds4Copy` in decode_step.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct CopyRun {
    src: u64,
    off: i64,
    len: i64,
}

/// Per-kernel times of `DS4_DECODE_PROFILE=1`, kept per row count (a prefill's 16-row steps
/// and the decode's one-row steps each get their own table).
#[derive(Default)]
struct KernelProfile {
    /// rows -> the profile of the steps of that many rows.
    by_rows: HashMap<usize, RowsProfile>,
}

/// The steps of one row count: how many, and kernel name -> (launches, seconds).
type RowsProfile = (usize, HashMap<String, (u64, f64)>);

impl KernelProfile {
    /// Adds one step's kernel times; prints the table of its row count every 32 such steps.
    fn record(&mut self, n: usize, times: impl Iterator<Item = (String, f64)>) {
        let (steps, by_kernel) = self.by_rows.entry(n).or_default();
        for (name, secs) in times {
            let e = by_kernel.entry(name).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += secs;
        }
        *steps += 1;
        if !steps.is_multiple_of(32) {
            return;
        }
        let count = *steps as f64;
        let mut v: Vec<_> = by_kernel.iter().collect();
        v.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let total: f64 = v.iter().map(|x| x.1 .1).sum();
        eprintln!(
            "ds4 decode profile, {n} rows, over {steps} steps: {:.3} ms of kernels per step",
            1e3 * total / count
        );
        for (name, (calls, secs)) in v.iter().take(64) {
            eprintln!(
                "  {name:48} {:7.1} us/step  {:6.1} launches/step  {:6.2} us/launch",
                1e6 * secs / count,
                *calls as f64 / count,
                1e6 * secs / *calls as f64
            );
        }
    }
}

/// The journal runs of one compressor push: kv, gate, and the emitted row when it closes.
type PushRuns = (std::ops::Range<usize>, std::ops::Range<usize>, Option<std::ops::Range<usize>>);

/// One kernel launch of a program. `A` is [`Arg`] in a built program and `program::PArg` while
/// it is being built (descriptor table offsets not yet resolved).
#[derive(Debug)]
struct Launch<A = Arg> {
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    args: Vec<A>,
    /// What the launch computes, for the profile: the matrices' shapes of a product launch,
    /// else empty.
    label: String,
}

impl<A> Launch<A> {
    fn map_args<B>(self, f: impl FnMut(A) -> B) -> Launch<B> {
        Launch {
            f: self.f,
            grid: self.grid,
            block: self.block,
            smem: self.smem,
            args: self.args.into_iter().map(f).collect(),
            label: self.label,
        }
    }
}

/// One operation of a program: a launch, a device copy, or the side branch's fork and join.
#[derive(Debug)]
enum Op<A = Arg> {
    Launch(Launch<A>),
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    /// A launch on the side branch: it depends on everything queued before it, and nothing
    /// queued after it waits for it until the next [`Op::Join`].
    Side(Launch<A>),
    /// A launch on the prefetch branch (an L2 prefetch of weights, which writes nothing): it
    /// depends on everything queued before it, and the step waits for it only at its end, so
    /// that the side branch's launches never queue behind it.
    Ahead(Launch<A>),
    /// What comes after waits for the side branch's launches.
    Join,
}

/// The side branch of the decode's programs: a second stream that forks from the context's
/// stream at each [`Op::Side`] and joins it at each [`Op::Join`] (in a captured graph, a
/// parallel branch). It runs the hyper-connections' Sinkhorn iterations (ds4_hc_sinkhorn),
/// which only the site's expansion reads, while the sublayer runs; the compressors' and
/// indexer's projections beside the query path (program.rs, `DS4_CUDA_SIDE_PROJ`); and the
/// FFN's shared expert beside the router and the routed experts. With `DS4_CUDA_FORK=0` the
/// iterations run inside ds4_hc_pre (the same operations: the results are bitwise equal, which
/// `hc_pre_matches_cpu` and test_cuda.py check) and the rest in line. With the branch a Flash
/// decode step at 2K on an H200 took 11.12 ms against 11.87. (Tried and dropped: the compressors'
/// updates on it too; slower.) A second stream, the prefetch branch, runs the L2 prefetches of
/// weights ([`Op::Ahead`]), which nothing waits for before the step's end. The decoder's drop
/// destroys both while its context lives (a session may outlive its model).
/// (Measurements: scripts/kernel_lab/HISTORY.md, "decode/mod.rs: SideBranch".)
struct SideBranch {
    stream: sys::CUstream,
    fork: sys::CUevent,
    join: sys::CUevent,
    /// The prefetch branch ([`Op::Ahead`]) and the event the step's end waits for.
    ahead: sys::CUstream,
    ahead_join: sys::CUevent,
}

impl SideBranch {
    /// With the context bound on this thread.
    fn new() -> Result<Self> {
        let ev =
            || cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(driver_err("creating an event"));
        let new_stream =
            || cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(driver_err("creating a stream"));
        let mut side = SideBranch {
            stream: new_stream()?,
            fork: std::ptr::null_mut(),
            join: std::ptr::null_mut(),
            ahead: std::ptr::null_mut(),
            ahead_join: std::ptr::null_mut(),
        };
        side.fork = ev()?;
        side.join = ev()?;
        side.ahead_join = ev()?;
        side.ahead = new_stream()?;
        Ok(side)
    }
}

impl Drop for SideBranch {
    fn drop(&mut self) {
        // SAFETY: created by `new` on the context the decoder binds before dropping its parts;
        // each destroyed once (null when its creation failed).
        unsafe {
            for e in [self.fork, self.join, self.ahead_join] {
                if !e.is_null() {
                    cu::event::destroy(e).ok();
                }
            }
            for s in [self.stream, self.ahead] {
                if !s.is_null() {
                    cu::stream::synchronize(s).ok();
                    cu::stream::destroy(s).ok();
                }
            }
        }
    }
}

/// The launches of one step shape, with its descriptor tables.
struct Program {
    ops: Vec<Op>,
    _tables: DevBuf,
    graph: Option<sys::CUgraphExec>,
}

/// Per-layer constants in device memory.
struct LayerConsts {
    attn_norm: DevBuf,
    q_a_norm: DevBuf,
    kv_norm: DevBuf,
    sinks: DevBuf,
    ffn_norm: DevBuf,
    hc_attn: (DevBuf, DevBuf),
    hc_ffn: (DevBuf, DevBuf),
    inv_freq: DevBuf,
    comp: Option<(DevBuf, DevBuf)>,
    index: Option<(DevBuf, DevBuf)>,
    bias: Option<DevBuf>,
    hash: Option<DevBuf>,
}

/// One compressor's device state (see decode_attn.cu).
struct CompMirror {
    width: usize,
    ratio: usize,
    overlap: bool,
    cur_kv: DevBuf,
    cur_score: DevBuf,
    /// prev_kv then prev_score (overlap only).
    prev: Option<DevBuf>,
    /// 16 copies of `prev`, one per batch row that closed a window.
    backup: Option<DevBuf>,
    rows: DevBuf,
    cap: usize,
    /// Each batch row's projections (kv, and the gate before the position bias), written by
    /// the layer's products and read by the compressor; the host replays the pushes from them.
    /// (The slots of `cur_*` are not enough: a batch of more than `ratio` rows writes a slot
    /// twice.)
    log_kv: DevBuf,
    log_g: DevBuf,
}

struct LayerMirror {
    ring: DevBuf,
    slots: usize,
    comp: Option<CompMirror>,
    index: Option<CompMirror>,
}

impl LayerMirror {
    /// The most attention keys a row of this layer has: the window, then the selected (CSA)
    /// or all visible (HCA) compressed rows.
    fn max_keys(&self, window: usize, index_topk: usize) -> usize {
        window
            + match (&self.comp, &self.index) {
                (Some(cm), Some(_)) => index_topk.min(cm.cap),
                (Some(cm), None) => cm.cap,
                _ => 0,
            }
    }
}

/// The MTP drafter on the device ([`DeviceDecoder::propose`]): its block's constants and
/// window ring, its input norms, its head's constants, and the embedding row of the step's
/// token. The ring is a scratch copy of the host's, uploaded at the start of each proposal
/// (window + 17 rows, 290 KB for Flash): the host state stays the reference, kept up to date
/// after each step ([`Upkeep`], or `Model::draft_advance` on the host path), and a proposal's
/// rows are dropped with it. A
/// proposal step is the trunk's layer program on the MTP block at one row, between trunk steps
/// on the same stream and activation buffers.
struct MtpDevice {
    spec: crate::model::config::LayerSpec,
    consts: LayerConsts,
    mirror: LayerMirror,
    enorm: DevBuf,
    hnorm: DevBuf,
    emb: DevBuf,
    /// The final norm, the HC head's base and scale.
    head: (DevBuf, DevBuf, DevBuf),
    /// The step programs without and with the head.
    programs: [Option<Program>; 2],
}

/// The DSpark drafter on the device ([`DeviceDecoder::propose`]): its stages' constants and
/// window rings (scratch copies of the host's, uploaded at each proposal as for MTP) and its
/// head's constants. A proposal runs its block (the stages over `[anchor, noise...]`, every row
/// seeing the whole block, then the head on every row, then, when the device has them, the
/// Markov and confidence heads: [`MarkovDevice`]) as one program on the step's buffers. Without
/// those, or sampling, the logits before the Markov bias and the hidden rows come back and the
/// two heads run row by row as on the host path (`Model::dspark_choose`).
struct DSparkDevice {
    spec: crate::model::config::LayerSpec,
    stages: Vec<(LayerConsts, LayerMirror)>,
    /// The final norm, the HC head's base and scale.
    head: (DevBuf, DevBuf, DevBuf),
    /// The Markov and confidence heads on the device, for greedy proposals.
    markov: Option<MarkovDevice>,
    /// The norm after `main_proj` (the window rows' input: [`Upkeep`]).
    main_norm: DevBuf,
    program: Option<Program>,
}

/// The drafter's window upkeep on the device: a trunk step's program also computes the K=V
/// rows the step adds to the drafter's rings (`Model::draft_rows` on the host path), and they
/// come back with its results, for `Model::draft_store` to write into the host's rings, which
/// stay the reference (proposals upload them). MTP: the pairs' input streams (the pending
/// streams, uploaded, then the step's rows), their input norms and products, the block's
/// attention-site collapse and norm, its K=V product and row; DSpark: each row's captured
/// streams averaged, `main_proj` and its norm, each stage's K=V product and row. On the host
/// path each of those products was a round trip: on an H200 (MID) an MTP drafter adds
/// 0.21–0.22 ms to a decode step this way, against 0.23–0.30 ms on the host path.
/// (Measurements: scripts/kernel_lab/HISTORY.md, "decode/mod.rs: Upkeep".)
struct Upkeep {
    /// The rows' step parameters: the position of the first row, the rows, the tokens (MTP;
    /// DSpark's rows are the trunk's).
    step: DevBuf,
    /// MTP: the pairs' streams [draft_cap, hc, d].
    h: DevBuf,
    /// MTP: the pairs' token embeddings [draft_cap, d].
    emb: DevBuf,
    /// MTP: the streams' norms [draft_cap, hc, 2d] (the fused input's rows are twice as wide).
    hn: DevBuf,
    /// MTP: the embeddings' norms [draft_cap, d]; DSpark: the averaged captures [draft_cap, k, d].
    en: DevBuf,
    /// MTP: e_proj's rows [draft_cap, d]; DSpark: the normed main_proj rows [draft_cap, d].
    ex: DevBuf,
    /// MTP: the block's input streams [draft_cap, hc, d].
    xs: DevBuf,
    /// DSpark: each stage's K=V products [stages, draft_cap, head_dim].
    kv: DevBuf,
    /// The new rows, ring `s`'s row at position p in slot `s * draft_cap + p % draft_cap` (rows
    /// of `head_dim`).
    rows: DevBuf,
    /// Rings (1 for MTP, DSpark's stages).
    rings: usize,
}

/// DSpark's Markov and confidence heads on the device: after the block's head the program
/// runs them row by row (ds4_markov_in, the W2 and confidence products, the bias added to a
/// copy of the row's logits, its argmax: the previous token of the next row), so a greedy
/// proposal brings back only its tokens and confidences. A sampled one (the tokens drawn on the
/// host from each row's distribution) and a row without a greedy token take the host's loop.
struct MarkovDevice {
    rank: usize,
    /// The Markov embedding table as floats [vocab, rank] (the host dequantizes it once per
    /// model, for all its sessions: 132 MB at Flash's vocabulary and rank 256).
    w1: Arc<DevBuf>,
    /// The current row's `[h_r; W1[prev]]`.
    cat: DevBuf,
    /// The current row's bias (`vocab` floats).
    bias: DevBuf,
    /// Each row's logits with its bias [N_MAX, vocab].
    logits: DevBuf,
    /// Each row's confidence logit.
    conf: DevBuf,
}

/// Activations of a step, each sized for 16 rows.
struct Bufs {
    step: DevBuf,
    x: DevBuf,
    flat: DevBuf,
    mixl: DevBuf,
    mix_a: DevBuf,
    mix_f: DevBuf,
    h: DevBuf,
    cq: DevBuf,
    kv: DevBuf,
    ig: DevBuf,
    q: DevBuf,
    iq: DevBuf,
    scores: DevBuf,
    score_stride: usize,
    sel: DevBuf,
    nsel: DevBuf,
    /// Attention logits [n, n_heads, keys], keys = the layer's [`LayerMirror::max_keys`].
    lg: DevBuf,
    o: DevBuf,
    u: DevBuf,
    attn_out: DevBuf,
    rl: DevBuf,
    gsh: DevBuf,
    ush: DevBuf,
    ash: DevBuf,
    dsh: DevBuf,
    xg: DevBuf,
    g_out: DevBuf,
    u_out: DevBuf,
    act: DevBuf,
    down_out: DevBuf,
    gather_src: DevBuf,
    comb_slot: DevBuf,
    comb_w: DevBuf,
    comb_cnt: DevBuf,
    /// The arrival counts of the tail launches' blocks ([`program::tail_kernel`]; zero
    /// between launches): `ds4_router_route`'s, then `ds4_mv_*_1_norm`'s.
    tail_done: DevBuf,
    /// Each row's routed experts and weights [rows, k] from `ds4_route_pick`
    /// ([`program::split_over_blocks`]).
    picks: DevBuf,
    pick_w: DevBuf,
    y: DevBuf,
    logits: DevBuf,
    /// The argmax of each logits row (u32), for the programs that end with it.
    ids: DevBuf,
    part: DevBuf,
    /// A prefill call's split x (`ds4_gemm_split`'s tiles, gemm.rs `px_bytes`), `px_bytes`
    /// bytes: the most any call of a prompt's step splits.
    px: DevBuf,
    px_bytes: usize,
    /// Floats of `part` and counters of `counters` that the main stream's launches use (each
    /// call's from 0); the side branch's split products have those past them
    /// (`side_part_floats`, `side_counters_len`), as they may run beside any main launch.
    part_floats: usize,
    counters: DevBuf,
    counters_len: usize,
    side_part_floats: usize,
    side_counters_len: usize,
    capture: DevBuf,
    runs: DevBuf,
    journal: DevBuf,
}

/// Pinned host memory, grown on demand.
struct Pinned {
    ptr: *mut u8,
    bytes: usize,
}

impl Pinned {
    fn reserve(&mut self, bytes: usize) -> Result<()> {
        if bytes <= self.bytes {
            return Ok(());
        }
        let cap = bytes.next_power_of_two().max(1 << 16);
        // SAFETY: allocated by malloc_host, nothing in flight (every step waits).
        unsafe {
            if !self.ptr.is_null() {
                cu::free_host(self.ptr.cast()).map_err(driver_err("freeing pinned memory"))?;
                self.ptr = std::ptr::null_mut();
                self.bytes = 0;
            }
            self.ptr = cu::malloc_host(cap, 0).map_err(driver_err("allocating pinned memory"))?.cast();
        }
        self.bytes = cap;
        Ok(())
    }

    fn floats(&mut self, off_bytes: usize, len: usize) -> &mut [f32] {
        assert!(off_bytes.is_multiple_of(4) && off_bytes + 4 * len <= self.bytes);
        if len == 0 {
            return &mut [];
        }
        // SAFETY: inside the pinned allocation owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off_bytes).cast(), len) }
    }

    fn bytes_mut(&mut self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.bytes);
        if len == 0 {
            return &mut [];
        }
        // SAFETY: inside the pinned allocation owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated by malloc_host, freed once.
            unsafe { cu::free_host(self.ptr.cast()).ok() };
        }
    }
}

/// Kernel handles looked up once.
struct Kernels {
    rms_plain: sys::CUfunction,
    rms_weight: sys::CUfunction,
    hc_pre: sys::CUfunction,
    hc_site: sys::CUfunction,
    hc_post: sys::CUfunction,
    hc_sinkhorn: sys::CUfunction,
    hc_head: sys::CUfunction,
    finish_rows: sys::CUfunction,
    swiglu: sys::CUfunction,
    /// `ds4_swiglu4` and `ds4_gather4`: four values a thread ([`program::wide_swiglu`]).
    swiglu4: sys::CUfunction,
    gather4: sys::CUfunction,
    compress: sys::CUfunction,
    compress_windows: sys::CUfunction,
    compress_state: sys::CUfunction,
    index_scores: sys::CUfunction,
    index_scores_mma: sys::CUfunction,
    index_topk: sys::CUfunction,
    attention_logits: sys::CUfunction,
    attention: sys::CUfunction,
    attention_mma: sys::CUfunction,
    route: sys::CUfunction,
    route_pick: sys::CUfunction,
    /// `ds4_router_route_{f32,f16,bf16}`: a one-row router product with the routing in its
    /// last block ([`program::tail_kernel`]).
    router_route: [sys::CUfunction; 3],
    /// `ds4_mv_{f32,f16,bf16,q8_0}_1_norm`: one-row products with the q_a norm in the last
    /// block ([`program::tail_kernel`]).
    norm_tail: [sys::CUfunction; 4],
    gather: sys::CUfunction,
    combine: sys::CUfunction,
    pack: sys::CUfunction,
    argmax: sys::CUfunction,
    prefetch: sys::CUfunction,
    mtp_in: sys::CUfunction,
    add_rows: sys::CUfunction,
    markov_in: sys::CUfunction,
    mean_streams: sys::CUfunction,
    gemm_f16: sys::CUfunction,
    gemm_q8_0: sys::CUfunction,
    gemm_q8_0_mq: sys::CUfunction,
    gemm_split: sys::CUfunction,
    gemm_px_f16: sys::CUfunction,
    gemm_px_q8_0: sys::CUfunction,
    gemm_px_q8_0_mq: sys::CUfunction,
    /// The routed experts' tensor-core kernels (IQ2_XXS, Q2_K) of each of
    /// [`program::GX_TILES`].
    moe_mma: [(sys::CUfunction, sys::CUfunction); 2],
    /// Every handle above with its name (profiles).
    names: Vec<(sys::CUfunction, &'static str)>,
}

impl Kernels {
    /// The name of one of these kernels.
    fn name_of(&self, f: sys::CUfunction) -> Option<&'static str> {
        self.names.iter().find(|(g, _)| *g == f).map(|(_, n)| *n)
    }

    fn load(ctx: &Context) -> Result<Self> {
        let mut names = Vec::new();
        let mut f = |n: &'static str| -> Result<sys::CUfunction> {
            let h = ctx.function(n)?;
            names.push((h, n));
            Ok(h)
        };
        let k = Kernels {
            rms_plain: f("ds4_rms_plain")?,
            rms_weight: f("ds4_rms_weight")?,
            hc_pre: f("ds4_hc_pre")?,
            hc_site: f("ds4_hc_site")?,
            hc_post: f("ds4_hc_post")?,
            hc_sinkhorn: f("ds4_hc_sinkhorn")?,
            hc_head: f("ds4_hc_head")?,
            finish_rows: f("ds4_finish_rows")?,
            swiglu: f("ds4_swiglu")?,
            swiglu4: f("ds4_swiglu4")?,
            gather4: f("ds4_gather4")?,
            compress: f("ds4_compress")?,
            compress_windows: f("ds4_compress_windows")?,
            compress_state: f("ds4_compress_state")?,
            index_scores: f("ds4_index_scores")?,
            index_scores_mma: f("ds4_index_scores_mma")?,
            index_topk: f("ds4_index_topk")?,
            attention_logits: f("ds4_attention_logits")?,
            attention: f("ds4_attention")?,
            attention_mma: f("ds4_attention_mma")?,
            route: f("ds4_route")?,
            route_pick: f("ds4_route_pick")?,
            router_route: [f("ds4_router_route_f32")?, f("ds4_router_route_f16")?, f("ds4_router_route_bf16")?],
            norm_tail: [
                f("ds4_mv_f32_1_norm")?,
                f("ds4_mv_f16_1_norm")?,
                f("ds4_mv_bf16_1_norm")?,
                f("ds4_mv_q8_0_1_norm")?,
            ],
            gather: f("ds4_gather")?,
            combine: f("ds4_moe_combine")?,
            pack: f("ds4_pack")?,
            argmax: f("ds4_argmax_rows")?,
            prefetch: f("ds4_prefetch")?,
            mtp_in: f("ds4_mtp_in")?,
            add_rows: f("ds4_add_rows")?,
            markov_in: f("ds4_markov_in")?,
            mean_streams: f("ds4_mean_streams")?,
            gemm_f16: f(gemm::Kernel::F16.name())?,
            gemm_q8_0: f(gemm::Kernel::Q8_0.name())?,
            gemm_q8_0_mq: f(gemm::Kernel::Q8_0Tiled.name())?,
            gemm_split: f("ds4_gemm_split")?,
            gemm_px_f16: f(gemm::Kernel::F16.px_name())?,
            gemm_px_q8_0: f(gemm::Kernel::Q8_0.px_name())?,
            gemm_px_q8_0_mq: f(gemm::Kernel::Q8_0Tiled.px_name())?,
            moe_mma: [
                (f("ds4_moe_mma_iq2_xxs")?, f("ds4_moe_mma_q2_k")?),
                (f("ds4_moe_mma_iq2_xxs_2x2")?, f("ds4_moe_mma_q2_k_2x2")?),
            ],
            names: Vec::new(),
        };
        Ok(Kernels { names, ..k })
    }
}

/// The device decoder of one session (see the module documentation).
pub(crate) struct CudaDecoder {
    backend: Arc<CudaBackend>,
    k: Kernels,
    round_mode: i32,
    ctx_len: usize,
    consts: Vec<LayerConsts>,
    head_consts: (DevBuf, DevBuf, DevBuf),
    mirror: Vec<LayerMirror>,
    bufs: Bufs,
    /// By (rows, requested logits rows: 0 all, 1 the last, 2 none; whether the argmax of
    /// each requested row comes back instead of its logits; whether it keeps the drafter's
    /// window rows, [`Upkeep`]; whether it is a prefill step, `gemm.rs`).
    programs: HashMap<(usize, u8, bool, bool, bool), Program>,
    up: Pinned,
    down: Pinned,
    /// Staging of [`DeviceDecoder::kept`]'s slot restores.
    fix: Pinned,
    /// The tag of the device state (0: stale, re-upload before the next step).
    tag: u64,
    /// The last step: (first position, rows), for [`DeviceDecoder::kept`].
    last: Option<(usize, usize)>,
    use_graphs: bool,
    /// Whether greedy steps take their tokens from the device's argmax (`DS4_CUDA_ARGMAX=0`:
    /// from the downloaded logits, as `DeviceDecoder::forward_argmax`'s default; for A/B
    /// timing).
    device_argmax: bool,
    /// `DS4_DECODE_PROFILE=1`: every step runs its launches one by one with CUDA events
    /// between them and adds each kernel's time here (name -> (launches, seconds)); printed to
    /// stderr every 32 steps.
    profile: Option<KernelProfile>,
    /// `DS4_DECODE_RESYNC=1`: re-upload the state after every cut instead of following it
    /// on the device (a debugging switch).
    resync_after_cut: bool,
    /// The side branch (None with `DS4_CUDA_FORK=0`).
    side: Option<SideBranch>,
    /// Whether each layer asks L2 for its q_b weights early ([`program::prefetch_q_b`]).
    prefetch_q_b: bool,
    /// Whether a decode's and a verify's step run that prefetch on a branch of its own
    /// ([`Op::Ahead`]) rather than first on the side branch, where the compressor and indexer
    /// projections queued behind it (`DS4_CUDA_PREFETCH_BRANCH`; a prompt's steps keep the side
    /// branch).
    prefetch_branch: bool,
    /// Whether a decode's or verify's compressor and indexer projections run on the side
    /// branch beside the query path (`DS4_CUDA_SIDE_PROJ`; see the layer's attention site in
    /// program.rs).
    side_proj: bool,
    /// Whether a decode's and verify's hyper-connection sites run as one cluster launch each
    /// (`ds4_hc_site`, sm_90 and later; `DS4_CUDA_HC_SITE=0`: the mixing product and
    /// ds4_hc_pre, and the attention site's expansion in ds4_hc_post).
    hc_fused: bool,
    /// Whether prefill steps run the tensor-core products (`gemm.rs`; `DS4_CUDA_GEMM=0`: no).
    gemm_on: bool,
    /// Whether those take the Q8_0 products on the decode's tensor-core layout too
    /// (`ds4_gemm_q8_0_mq`; `DS4_CUDA_GEMM_MQ=0`: the decode's kernel, 16 rows a weight read).
    gemm_mq: bool,
    /// Whether those products read x split once a call (`ds4_gemm_split`, then
    /// `ds4_gemm_px_*`: the same bits) rather than each block splitting what it reads
    /// (`DS4_CUDA_GEMM_PX=0`).
    gemm_px: bool,
    /// Whether the steps now are a prompt's ([`DeviceDecoder::set_prefill`]).
    prefill: bool,
    /// Most rows of a prompt's step ([`prefill_rows`]); the buffers hold this many rows.
    prefill_rows: usize,
    /// Most rows of a step that keeps the drafter's rows ([`draft_cap`]).
    draft_cap: usize,
    /// Most rows of a routed-expert product in a prompt's step ([`program::expert_chunk`]).
    prefill_chunk: usize,
    /// Whether a prompt's IQ2_XXS gate and up products run on the tensor cores (`DS4_CUDA_EXPERT_MMA`).
    expert_mma: bool,
    /// Whether a prompt's Q2_K down products do too (and `DS4_CUDA_EXPERT_MMA_DOWN`).
    expert_mma_down: bool,
    /// The grids of those two kernels (IQ2_XXS, Q2_K): the blocks the GPU holds at once, or
    /// None for a block per block of their tables (`DS4_CUDA_GX_GRID=0`).
    gx_grid: Option<(usize, usize)>,
    /// Their warp tile (`DS4_CUDA_GX_TILE`).
    gx_tile: program::GxTile,
    /// Whether a prompt's step routes its rows over many blocks ([`program::split_over_blocks`],
    /// `DS4_CUDA_ROUTE_PICK`).
    route_pick: bool,
    /// Whether a decode row's routing runs in the router product's launch, and its q_a norm in
    /// the q_a product's ([`program::tail_kernel`]: `DS4_CUDA_ROUTE_TAIL=1`,
    /// `DS4_CUDA_NORM_TAIL=1`).
    route_tail: bool,
    norm_tail: bool,
    /// Whether a prompt's step gathers and takes its SwiGLUs four values a thread
    /// ([`program::wide_swiglu`]: `DS4_CUDA_WIDE=1`).
    wide: bool,
    /// Whether a prompt's step runs its compressors' windows side by side
    /// ([`program::split_over_blocks`], `DS4_CUDA_COMPRESS_SPLIT`).
    compress_split: bool,
    /// Whether a prompt's step runs its attention on the tensor cores
    /// ([`program::attention_mma`], `DS4_CUDA_ATTN_MMA`).
    attn_mma: bool,
    /// Whether a prompt's steps score the indexer's rows on the tensor cores
    /// ([`program::index_mma`], `DS4_CUDA_INDEX_MMA`).
    index_mma: bool,
    /// Whether decode and verify steps do (`DS4_CUDA_INDEX_MMA_STEPS`).
    index_mma_steps: bool,
    /// A prompt's tensor-core Q8_0 products in bands of output rows ([`program::band_rows`],
    /// `DS4_CUDA_BANDS`).
    bands: Option<usize>,
    /// Whether a step leaves its state writes pending in the state ([`StepWrites`], made
    /// while the GPU runs the next step) rather than making them before it returns;
    /// `DS4_CUDA_DEFER=0` makes them at once (A/B timing).
    defer: bool,
    /// The MTP drafter's device path (None: no MTP drafter, one the device does not run, or
    /// `DS4_CUDA_DRAFT=0`; proposals then run on the host).
    mtp: Option<MtpDevice>,
    /// The DSpark drafter's device path (as `mtp`).
    dspark: Option<DSparkDevice>,
    /// The drafter's window upkeep on the device (with `mtp` or `dspark`).
    upkeep: Option<Upkeep>,
    /// Each layer's compressors' position biases (the compressor, then the indexer's), which
    /// the journal's replay adds to the gates.
    apes: Arc<Vec<Vec<Vec<f32>>>>,
    /// Journal copies that pending writes no longer hold, for the next steps.
    spare: Arc<Mutex<Vec<Vec<f32>>>>,
}

// SAFETY: the raw handles (functions, graphs, pinned pointers) are only used by the thread
// that holds the decoder, with the backend's context bound and its lock held.
unsafe impl Send for CudaDecoder {}

impl Drop for CudaDecoder {
    fn drop(&mut self) {
        let g = self.backend.lock();
        if g.ctx.bind().is_ok() {
            g.ctx.sync().ok();
            let mtp_programs = self.mtp.iter_mut().flat_map(|m| m.programs.iter_mut().flatten());
            let dspark_program = self.dspark.iter_mut().filter_map(|m| m.program.as_mut());
            for p in self.programs.values_mut().chain(mtp_programs).chain(dspark_program) {
                if let Some(exec) = p.graph.take() {
                    // SAFETY: instantiated by this decoder, destroyed once.
                    unsafe { cu::graph::exec_destroy(exec).ok() };
                }
            }
            // The side stream and its events go now, while the context surely lives: `backend`
            // is the first field to drop after this, and when it is the last reference the
            // context goes with it (a stream destroyed after its context crashes the driver).
            drop(self.side.take());
        } else {
            // No context to destroy them in.
            std::mem::forget(self.side.take());
        }
        // The buffers are freed after this, with the context still bound on this thread.
    }
}

/// The matrices of one products launch group, for sizing the partial sums.
fn split_need(mats: &[Mat], n: usize) -> (usize, usize) {
    let mut part = 0;
    let mut counters = 0;
    for w in mats {
        let s = slices(w);
        if s > 1 {
            part += s * n * w.n_out;
            counters += n.div_ceil(chunk_rows(w.ty, w.n_in, w.n_out)) * row_blocks(w);
        }
    }
    (part, counters)
}

impl CudaBackend {
    /// Whether every matrix the device decoder multiplies by runs on the GPU.
    fn decodable(&self, model: &Model) -> bool {
        let g = self.lock();
        let Some(img) = g.image(model.file.raw()) else { return false };
        let routed_in = |l: &crate::model::weights::LayerWeights| {
            [l.gate_exps.first.start, l.up_exps.first.start, l.down_exps.first.start]
        };
        let routed: Vec<usize> = model.weights.layers.iter().flat_map(routed_in).collect();
        // Only the routed experts' products get 8-bit activations on the device (quant/act8.rs:
        // ds4_gather quantizes the gate and up inputs, ds4_swiglu the down inputs); a model
        // with such weights anywhere else (none that ds4 writes) runs its forward on the host,
        // with this backend's products.
        all_mats(model)
            .iter()
            .all(|m| Self::gpu_shape(img, m) && (!crate::quant::act8::takes_act8(m.ty) || routed.contains(&m.start)))
    }
}

/// Every matrix of the trunk and head.
fn all_mats(model: &Model) -> Vec<Mat> {
    let w = &model.weights;
    let mut v = vec![w.output, w.hc_head.proj];
    for l in &w.layers {
        v.extend([l.hc_attn.proj, l.hc_ffn.proj, l.q_a, l.q_b, l.kv, l.o_a, l.o_b, l.router_proj]);
        v.extend([l.gate_sh, l.up_sh, l.down_sh, l.gate_exps.first, l.up_exps.first, l.down_exps.first]);
        if let Some(c) = &l.compressor {
            v.extend([c.kv, c.gate]);
        }
        if let Some(i) = &l.indexer {
            v.extend([i.q_b, i.proj, i.compressor.kv, i.compressor.gate]);
        }
    }
    v
}

/// The decoder for `model` on `backend`, or `None` when this model or state precision is not
/// run on the device (FP8 state simulation, a shape the kernels do not take, weights not
/// uploaded, `DS4_DEVICE_DECODE=0`).
pub(crate) fn decoder_for(
    backend: Arc<CudaBackend>,
    model: &Model,
    ctx: usize,
    precision: KvPrecision,
) -> Option<Result<Box<dyn DeviceDecoder>>> {
    match program::switch("DS4_DEVICE_DECODE", std::env::var("DS4_DEVICE_DECODE").ok().as_deref()) {
        Ok(true) => {}
        Ok(false) => return None,
        Err(e) => return Some(Err(e)),
    }
    let round_mode = match precision {
        KvPrecision::F32 => 0,
        KvPrecision::F16 => 1,
        KvPrecision::Fp8 => return None,
    };
    let cfg = &model.config;
    let csa_without_indexer =
        cfg.layers.iter().zip(&model.weights.layers).any(|(s, l)| s.kind == AttentionKind::Csa && l.indexer.is_none());
    // ds4_hc_pre keeps a site's hc x hc mixing matrix in one warp (DS4_HC_PRE_MAX).
    if cfg.hc_mult > 5
        || cfg.hc_mult == 0
        || !cfg.n_heads.is_multiple_of(cfg.o_groups)
        || csa_without_indexer
        || !backend.decodable(model)
    {
        return None;
    }
    Some(CudaDecoder::new(backend, model, ctx, round_mode).map(|d| Box::new(d) as Box<dyn DeviceDecoder>))
}

/// A layer's constants in device memory (`rope`: its rotary table).
fn layer_consts(l: &crate::model::weights::LayerWeights, rope: &crate::model::rope::Rope) -> Result<LayerConsts> {
    let hyper = |h: &HyperWeights| -> Result<(DevBuf, DevBuf)> {
        Ok((DevBuf::from_slice(&h.base)?, DevBuf::from_slice(&h.scale)?))
    };
    Ok(LayerConsts {
        attn_norm: DevBuf::from_slice(&l.attn_norm)?,
        q_a_norm: DevBuf::from_slice(&l.q_a_norm)?,
        kv_norm: DevBuf::from_slice(&l.kv_norm)?,
        sinks: DevBuf::from_slice(&l.sinks)?,
        ffn_norm: DevBuf::from_slice(&l.ffn_norm)?,
        hc_attn: hyper(&l.hc_attn)?,
        hc_ffn: hyper(&l.hc_ffn)?,
        inv_freq: DevBuf::from_slice(rope.inv_freq())?,
        comp: match &l.compressor {
            Some(c) => Some((DevBuf::from_slice(&c.ape)?, DevBuf::from_slice(&c.norm)?)),
            None => None,
        },
        index: match &l.indexer {
            Some(i) => Some((DevBuf::from_slice(&i.compressor.ape)?, DevBuf::from_slice(&i.compressor.norm)?)),
            None => None,
        },
        bias: match &l.router {
            Router::Learned { bias } => Some(DevBuf::from_slice(bias)?),
            Router::Hash { .. } => None,
        },
        hash: match &l.router {
            Router::Hash { table } => Some(DevBuf::from_slice(table)?),
            Router::Learned { .. } => None,
        },
    })
}

/// Whether the MTP drafter `mw` of `model` runs on the device: its block
/// ([`block_on_device`]) with its input products, and its head.
fn mtp_on_device(backend: &CudaBackend, model: &Model, mw: &MtpWeights) -> bool {
    let Some(dm) = model.draft.as_ref() else { return false };
    let g = backend.lock();
    let (Some(timg), Some(dimg)) = (g.image(model.file.raw()), g.image(dm.file.raw())) else { return false };
    let input = match &mw.input {
        MtpInput::Split { e_proj, h_proj } => vec![*e_proj, *h_proj],
        MtpInput::Fused { eh_proj } => vec![*eh_proj],
    };
    let head_img = if mw.head_from_target { timg } else { dimg };
    block_on_device(model, dm, dimg, &mw.block, &input)
        && CudaBackend::gpu_shape(head_img, &mw.hc_head.proj)
        && !crate::quant::act8::takes_act8(mw.hc_head.proj.ty)
}

/// Whether the DSpark drafter `dw` of `model` runs on the device: as [`mtp_on_device`] for each
/// stage and its head, and a block that fits a step.
fn dspark_on_device(backend: &CudaBackend, model: &Model, dw: &DSparkWeights) -> bool {
    let Some(dm) = model.draft.as_ref() else { return false };
    let g = backend.lock();
    let Some(dimg) = g.image(dm.file.raw()) else { return false };
    (1..=N_MAX).contains(&dw.block_size)
        && dw.stages.iter().all(|st| block_on_device(model, dm, dimg, st, &[]))
        && CudaBackend::gpu_shape(dimg, &dw.hc_head.proj)
        && !crate::quant::act8::takes_act8(dw.hc_head.proj.ty)
}

/// Whether DSpark's Markov head (and its confidence head, if any) runs on the device: W2
/// [rank -> vocab] and the confidence [d + rank -> 1] in a shape the kernels take, with float
/// activations.
fn markov_on_device(backend: &CudaBackend, model: &Model, dw: &DSparkWeights) -> bool {
    let (Some(dm), Some(w1), Some(w2)) = (model.draft.as_ref(), dw.markov_w1, dw.markov_w2) else { return false };
    let g = backend.lock();
    let Some(dimg) = g.image(dm.file.raw()) else { return false };
    let (d, v, rank) = (model.config.hidden, model.config.vocab, dw.markov_rank);
    let fits = |m: &Mat, n_in: usize, n_out: usize| {
        (m.n_in, m.n_out) == (n_in, n_out) && CudaBackend::gpu_shape(dimg, m) && !crate::quant::act8::takes_act8(m.ty)
    };
    rank > 0
        && (w1.n_in, w1.n_out) == (rank, v)
        && fits(&w2, rank, v)
        && dw.confidence.as_ref().is_none_or(|cw| fits(cw, d + rank, 1))
}

/// Whether a drafter block `b` (and the `extra` dense matrices before it) runs on the device in
/// the decoder's layer program: its weights in `dimg` in a shape the kernels take, a
/// window-only block with a learned router and the target's expert and projection shapes (the
/// decoder's buffers are the target's), 8-bit activations only for its routed experts.
fn block_on_device(
    model: &Model,
    dm: &crate::model::DraftModel,
    dimg: &super::weights::DeviceImage,
    b: &crate::model::weights::LayerWeights,
    extra: &[Mat],
) -> bool {
    let l0 = &model.weights.layers[0];
    let same = |x: &Mat, y: &Mat| (x.n_in, x.n_out) == (y.n_in, y.n_out);
    let mut dense = extra.to_vec();
    dense.extend([b.hc_attn.proj, b.q_a, b.q_b, b.kv, b.o_a, b.o_b, b.hc_ffn.proj, b.router_proj]);
    dense.extend([b.gate_sh, b.up_sh, b.down_sh]);
    let routed = [b.gate_exps.first, b.up_exps.first, b.down_exps.first];
    let shapes = [
        (b.q_a, l0.q_a),
        (b.q_b, l0.q_b),
        (b.kv, l0.kv),
        (b.o_a, l0.o_a),
        (b.o_b, l0.o_b),
        (b.router_proj, l0.router_proj),
        (b.gate_sh, l0.gate_sh),
        (b.down_sh, l0.down_sh),
        (b.gate_exps.first, l0.gate_exps.first),
        (b.up_exps.first, l0.up_exps.first),
        (b.down_exps.first, l0.down_exps.first),
    ];
    dm.spec.kind == AttentionKind::Sliding
        && matches!(b.router, Router::Learned { .. })
        && b.compressor.is_none()
        && b.indexer.is_none()
        && shapes.iter().all(|(x, y)| same(x, y))
        && dense.iter().all(|m| CudaBackend::gpu_shape(dimg, m) && !crate::quant::act8::takes_act8(m.ty))
        && routed.iter().all(|m| CudaBackend::gpu_shape(dimg, m))
}

impl CudaDecoder {
    fn new(backend: Arc<CudaBackend>, model: &Model, ctx_len: usize, round_mode: i32) -> Result<Self> {
        let prefetch_q_b = program::prefetch_q_b(std::env::var("DS4_CUDA_PREFETCH").ok().as_deref())?;
        let setting = |name: &str| program::switch(name, std::env::var(name).ok().as_deref());
        let defer = setting("DS4_CUDA_DEFER")?;
        let prefetch_branch = setting("DS4_CUDA_PREFETCH_BRANCH")?;
        // A prompt's steps on the tensor-core products (gemm.rs), unless DS4_CUDA_GEMM=0 (A/B
        // timing) or the device predates mma.sync m16n8k16.
        let gemm_on = setting("DS4_CUDA_GEMM")? && backend.compute_capability().0 >= 8;
        // A prompt's IQ2_XXS gate and up products on the tensor cores (gemm_experts.cu) rather
        // than the decode's kernels, unless DS4_CUDA_EXPERT_MMA=0 (A/B timing).
        let expert_mma = setting("DS4_CUDA_EXPERT_MMA")?;
        // Its Q2_K down products too, unless either setting is 0.
        let expert_mma_down = expert_mma && setting("DS4_CUDA_EXPERT_MMA_DOWN")?;
        let route_pick = setting("DS4_CUDA_ROUTE_PICK")?;
        let opt_in = |name: &str| program::opt_in(name, std::env::var(name).ok().as_deref());
        let (route_tail, norm_tail) = (opt_in("DS4_CUDA_ROUTE_TAIL")?, opt_in("DS4_CUDA_NORM_TAIL")?);
        let wide = opt_in("DS4_CUDA_WIDE")?;
        let (use_graphs, device_argmax, fork) =
            (setting("DS4_CUDA_GRAPHS")?, setting("DS4_CUDA_ARGMAX")?, setting("DS4_CUDA_FORK")?);
        let (profile, resync_after_cut) = (opt_in("DS4_DECODE_PROFILE")?, opt_in("DS4_DECODE_RESYNC")?);
        let compress_split = setting("DS4_CUDA_COMPRESS_SPLIT")?;
        let side_proj = setting("DS4_CUDA_SIDE_PROJ")?;
        let hc_fused = setting("DS4_CUDA_HC_SITE")? && backend.compute_capability().0 >= 9;
        let gemm_mq = setting("DS4_CUDA_GEMM_MQ")?;
        let gemm_px = gemm_on && setting("DS4_CUDA_GEMM_PX")?;
        let attn_mma = setting("DS4_CUDA_ATTN_MMA")?;
        let index_mma = setting("DS4_CUDA_INDEX_MMA")?;
        let index_mma_steps = setting("DS4_CUDA_INDEX_MMA_STEPS")?;
        let bands = program::bands_setting(std::env::var("DS4_CUDA_BANDS").ok().as_deref())?;
        // The routed tensor-core kernels' warp tile (gemm_experts.cu; A/B timing).
        let gx_tile = program::gx_tile(std::env::var("DS4_CUDA_GX_TILE").ok().as_deref())?;
        let g = backend.lock();
        g.ctx.bind()?;
        let k = Kernels::load(&g.ctx)?;
        let smem_optin = g.ctx.smem_optin;
        // The routed tensor-core kernels' grids: the blocks the GPU holds at once, each walking
        // the table's live blocks (gemm_experts.cu), unless DS4_CUDA_GX_GRID=0 (A/B timing: a
        // block per table block).
        let gx_grid = if setting("DS4_CUDA_GX_GRID")? {
            let sms = g.ctx.multiprocessors.max(1) as usize;
            let per = |f| blocks_per_sm(f, (32 * MV_WARPS) as u32).map(|b| b * sms);
            let (iq2, q2k) = k.moe_mma[gx_tile.index()];
            Some((per(iq2)?, per(q2k)?))
        } else {
            None
        };
        drop(g);
        let cfg = &model.config;
        // The rows of a prompt's step, at least a verify's: those of the activation buffers.
        let rows = prefill_rows(
            std::env::var("DS4_CUDA_PREFILL_ROWS").ok().as_deref(),
            cfg.n_experts_used,
            cfg.n_experts,
            // What ds4_route's dynamic shared memory may take: the block's opt-in size less
            // its static arrays.
            smem_optin.saturating_sub(static_smem(k.route)?),
        )?;
        let prefill_chunk = program::expert_chunk(std::env::var("DS4_CUDA_EXPERT_CHUNK").ok().as_deref())?;
        let draft_cap = draft_cap(cfg.window, rows, model.draft.is_some());
        // The most rows of a routed product's descriptor (program.rs `chunk`).
        let chunk_max = prefill_chunk.max(program::EXPERT_CHUNK);
        let w = &model.weights;
        let (d, hc, hd) = (cfg.hidden, cfg.hc_mult, cfg.head_dim);
        let consts =
            w.layers.iter().zip(&model.ropes).map(|(l, rope)| layer_consts(l, rope)).collect::<Result<Vec<_>>>()?;
        let head_consts = (
            DevBuf::from_slice(&w.output_norm)?,
            DevBuf::from_slice(&w.hc_head.base)?,
            DevBuf::from_slice(&w.hc_head.scale)?,
        );

        // The device state.
        let mut mirror = Vec::with_capacity(cfg.layers.len());
        let mut score_stride = 1;
        let mut max_keys = 0;
        for (spec, l) in cfg.layers.iter().zip(&w.layers) {
            // A step's last row must not overwrite a key its first row reads: the window and
            // the step's rows, at least the host ring's slots (`upload_state` maps them).
            let slots = cfg.window + (crate::spec::MAX_DRAFT + 1).max(rows);
            let comp_mirror = |width: usize, overlap: bool| -> Result<CompMirror> {
                let ratio = spec.ratio;
                let pw = if overlap { 2 * width } else { width };
                let cap = ctx_len / ratio + 1;
                Ok(CompMirror {
                    width,
                    ratio,
                    overlap,
                    cur_kv: f32_buf(ratio * pw)?,
                    cur_score: f32_buf(ratio * pw)?,
                    prev: if overlap { Some(f32_buf(2 * ratio * width)?) } else { None },
                    backup: if overlap { Some(f32_buf(rows * 2 * ratio * width)?) } else { None },
                    rows: f32_buf(cap * width)?,
                    cap,
                    log_kv: f32_buf(rows * pw)?,
                    log_g: f32_buf(rows * pw)?,
                })
            };
            let comp = match spec.kind {
                AttentionKind::Sliding => None,
                AttentionKind::Hca => Some(comp_mirror(hd, false)?),
                AttentionKind::Csa => Some(comp_mirror(hd, true)?),
            };
            let index = match (spec.kind, &l.indexer) {
                (AttentionKind::Csa, Some(_)) => {
                    score_stride = score_stride.max(ctx_len / spec.ratio + 1);
                    Some(comp_mirror(cfg.index_head_dim, true)?)
                }
                _ => None,
            };
            let m = LayerMirror { ring: f32_buf(slots * hd)?, slots, comp, index };
            max_keys = max_keys.max(m.max_keys(cfg.window, cfg.index_topk));
            mirror.push(m);
        }

        // The drafter's device path, when its blocks run here (not with DS4_CUDA_DRAFT=0).
        let device_draft = setting("DS4_CUDA_DRAFT")?;
        let mtp_w: Option<&MtpWeights> = match model.draft.as_ref().map(|dm| &dm.kind) {
            Some(DraftKind::Mtp(mw)) if device_draft && mtp_on_device(&backend, model, mw) => Some(mw),
            _ => None,
        };
        let dspark_w: Option<&DSparkWeights> = match model.draft.as_ref().map(|dm| &dm.kind) {
            Some(DraftKind::DSpark(dw)) if device_draft && dspark_on_device(&backend, model, dw) => Some(dw),
            _ => None,
        };
        if dspark_w.is_some() {
            // A block row's keys: the window before the step and the step's rows.
            max_keys = max_keys.max(cfg.window + N_MAX);
        }

        // Partial sums and counters: the most any launch group needs at the most rows.
        let kk = cfg.n_experts_used;
        let max_descs = rows * kk;
        let (mut part_floats, mut counters_len) = (0usize, 0usize);
        let mut need = |mats: &[Mat], n: usize| {
            let (p, c) = split_need(mats, n);
            part_floats = part_floats.max(p);
            counters_len = counters_len.max(c);
            // A prefill step runs some of these on the tensor-core products (gemm.rs) and the
            // rest on the decode's, in one call: each product's larger need, summed.
            if gemm_on {
                let (mut p, mut c) = (0, 0);
                for m in mats.iter().map(std::slice::from_ref) {
                    let ((p1, c1), (p2, c2)) = (gemm::need(m, n, gemm_mq), split_need(m, n));
                    (p, c) = (p + p1.max(p2), c + c1.max(c2));
                }
                part_floats = part_floats.max(p);
                counters_len = counters_len.max(c);
            }
        };
        let dspark_stages = dspark_w.map(|dw| dw.stages.as_slice()).unwrap_or_default();
        // The side branch's products of a decode or verify (program.rs: the compressors' and
        // indexer's projections of h, then the indexer's q_b), at most N_MAX rows.
        let mut side_need = (0usize, 0usize);
        for l in w.layers.iter().chain(mtp_w.map(|m| &m.block)).chain(dspark_stages) {
            let of_h: Vec<Mat> = program::projections_of_h(l).into_iter().map(|(m, _)| m).collect();
            let (p1, c1) = split_need(&of_h, N_MAX);
            let (p2, c2) = l.indexer.as_ref().map_or((0, 0), |i| split_need(&[i.q_b], N_MAX));
            side_need = (side_need.0.max(p1).max(p2), side_need.1.max(c1).max(c2));
        }
        // The split x of a prompt's call (gemm_px): one split per input of its tensor-core
        // products, `inputs` of each matrix.
        let px_of = |mats: &[Mat], inputs: usize| -> usize {
            if !gemm_px {
                return 0;
            }
            mats.iter()
                .filter(|m| gemm::kernel(m, gemm_mq).is_some())
                .map(|m| inputs * gemm::px_bytes(m.n_in, rows))
                .sum()
        };
        let mut px_bytes = 0usize;
        let mut routed_need = (0usize, 0usize);
        for l in w.layers.iter().chain(mtp_w.map(|m| &m.block)).chain(dspark_stages) {
            // q_b with the compressors' and indexer's products (as `build` groups them).
            let mut g2 = vec![l.q_b];
            g2.extend(program::projections_of_h(l).into_iter().map(|(m, _)| m));
            g2.extend(l.indexer.as_ref().map(|i| i.q_b));
            // The calls of a layer, and their inputs a matrix: o_a's groups are one launch split
            // as their whole plane (program.rs `split_in_launch`), each group its own input.
            let calls = [
                (vec![l.hc_attn.proj], 1),
                (vec![l.q_a, l.kv], 1),
                (g2, 1),
                (vec![l.o_a], cfg.o_groups),
                (vec![l.o_b], 1),
                (vec![l.hc_ffn.proj], 1),
                (vec![l.router_proj, l.gate_sh, l.up_sh], 1),
                (vec![l.down_sh], 1),
            ];
            for (mats, inputs) in &calls {
                need(mats, rows);
                px_bytes = px_bytes.max(px_of(mats, *inputs));
            }
            // The routed products, as program.rs lays them out: a descriptor slot's chunk of rows
            // per input slice, and its row blocks' counters (the up products' after the gate's).
            let routed = |m: &Mat| {
                if slices(m) > 1 {
                    (max_descs * slices(m) * chunk_max * m.n_out, max_descs * row_blocks(m))
                } else {
                    (0, 0)
                }
            };
            let ((pg, cg), (pu, cu), (pd, cd)) =
                (routed(&l.gate_exps.first), routed(&l.up_exps.first), routed(&l.down_exps.first));
            routed_need = (routed_need.0.max(pg + pu).max(pd), routed_need.1.max(cg + cu).max(cd));
        }
        for head in [w.hc_head.proj, w.output] {
            need(&[head], rows);
            px_bytes = px_bytes.max(px_of(&[head], 1));
        }
        if let Some(mw) = mtp_w {
            match &mw.input {
                // The upkeep's `draft_cap` pairs: hc rows of streams each.
                MtpInput::Split { e_proj, h_proj } => need(&[*e_proj, *h_proj], draft_cap * hc),
                MtpInput::Fused { eh_proj } => need(&[*eh_proj], draft_cap * hc),
            }
            need(&[mw.hc_head.proj], N_MAX);
        }
        if let Some(dw) = dspark_w {
            need(&[dw.main_proj], draft_cap);
            need(&dw.stages.iter().map(|st| st.kv).collect::<Vec<_>>(), draft_cap);
            need(&[dw.hc_head.proj], N_MAX);
            let heads: Vec<Mat> = dw.markov_w2.into_iter().chain(dw.confidence).collect();
            need(&heads, N_MAX);
        }
        part_floats = part_floats.max(routed_need.0);
        counters_len = counters_len.max(routed_need.1);
        let slots = cfg.window + crate::spec::MAX_DRAFT + 1;
        let dspark = match (dspark_w, model.draft.as_ref()) {
            (Some(dw), Some(dm)) => Some(DSparkDevice {
                spec: dm.spec,
                stages: dw
                    .stages
                    .iter()
                    .map(|st| -> Result<(LayerConsts, LayerMirror)> {
                        let ring = f32_buf(slots * hd)?;
                        Ok((layer_consts(st, &dm.rope)?, LayerMirror { ring, slots, comp: None, index: None }))
                    })
                    .collect::<Result<Vec<_>>>()?,
                head: (
                    DevBuf::from_slice(&dw.norm)?,
                    DevBuf::from_slice(&dw.hc_head.base)?,
                    DevBuf::from_slice(&dw.hc_head.scale)?,
                ),
                markov: match (dw.markov_w1, markov_on_device(&backend, model, dw)) {
                    (Some(w1), true) => {
                        let rank = dw.markov_rank;
                        let raw = dm.file.raw();
                        let table = backend.derived(raw, w1.start, || {
                            let mut table = vec![0f32; cfg.vocab * rank];
                            for (t, row) in table.chunks_mut(rank).enumerate() {
                                crate::quant::dequantize(w1.ty, w1.row(raw, t), row)?;
                            }
                            DevBuf::from_slice(&table)
                        })?;
                        let w1 = table.ok_or_else(|| {
                            Error::Backend("CUDA decode: the drafter's weights are not on the device".into())
                        })?;
                        Some(MarkovDevice {
                            rank,
                            w1,
                            cat: f32_buf(d + rank)?,
                            bias: f32_buf(cfg.vocab)?,
                            logits: f32_buf(N_MAX * cfg.vocab)?,
                            conf: f32_buf(N_MAX)?,
                        })
                    }
                    _ => None,
                },
                main_norm: DevBuf::from_slice(&dw.main_norm)?,
                program: None,
            }),
            _ => None,
        };
        let mtp = match (mtp_w, model.draft.as_ref()) {
            (Some(mw), Some(dm)) => Some(MtpDevice {
                spec: dm.spec,
                consts: layer_consts(&mw.block, &dm.rope)?,
                mirror: LayerMirror { ring: f32_buf(slots * hd)?, slots, comp: None, index: None },
                enorm: DevBuf::from_slice(&mw.enorm)?,
                hnorm: DevBuf::from_slice(&mw.hnorm)?,
                emb: f32_buf(d)?,
                head: (
                    DevBuf::from_slice(&mw.norm)?,
                    DevBuf::from_slice(&mw.hc_head.base)?,
                    DevBuf::from_slice(&mw.hc_head.scale)?,
                ),
                programs: [None, None],
            }),
            _ => None,
        };

        let upkeep = match (mtp_w, dspark_w) {
            (None, None) => None,
            (_, dsw) => {
                let k = dsw.map_or(0, |dw| dw.target_layers.len());
                let rings = dsw.map_or(1, |dw| dw.stages.len());
                let mtp = mtp_w.is_some() as usize;
                Some(Upkeep {
                    step: DevBuf::zeroed(STEP_BYTES)?,
                    h: f32_buf((mtp * draft_cap * hc * d).max(1))?,
                    emb: f32_buf((mtp * draft_cap * d).max(1))?,
                    hn: f32_buf((mtp * draft_cap * hc * 2 * d).max(1))?,
                    en: f32_buf(draft_cap * k.max(1) * d)?,
                    ex: f32_buf(draft_cap * d)?,
                    xs: f32_buf((mtp * draft_cap * hc * d).max(1))?,
                    kv: f32_buf(rings * draft_cap * hd)?,
                    rows: f32_buf(rings * draft_cap * hd)?,
                    rings,
                })
            }
        };

        let l0 = &w.layers[0];
        let ff = l0.gate_exps.first.n_out;
        let ff_sh = l0.gate_sh.n_out;
        let n_mix = (2 + hc) * hc;
        let capture_layers = match model.draft.as_ref().map(|dm| &dm.kind) {
            Some(DraftKind::DSpark(w)) => w.target_layers.len(),
            _ => 0,
        };
        let journal_floats = Self::journal_floats(cfg, rows);
        let bufs = Bufs {
            step: DevBuf::zeroed(STEP_BYTES)?,
            x: f32_buf(rows * hc * d)?,
            flat: f32_buf(rows * hc * d)?,
            mixl: f32_buf(rows * n_mix)?,
            mix_a: f32_buf(rows * (hc + hc * hc))?,
            mix_f: f32_buf(rows * (hc + hc * hc))?,
            h: f32_buf(rows * d)?,
            cq: f32_buf(rows * cfg.q_lora_rank)?,
            kv: f32_buf(rows * hd)?,
            ig: f32_buf(rows * cfg.index_heads.max(1))?,
            q: f32_buf(rows * cfg.n_heads * hd)?,
            iq: f32_buf(rows * cfg.index_heads.max(1) * cfg.index_head_dim.max(1))?,
            scores: f32_buf(rows * score_stride)?,
            score_stride,
            sel: DevBuf::zeroed(4 * rows * cfg.index_topk.max(1))?,
            nsel: DevBuf::zeroed(4 * rows)?,
            lg: f32_buf(rows * cfg.n_heads * max_keys)?,
            o: f32_buf(rows * cfg.n_heads * hd)?,
            u: f32_buf(rows * cfg.o_groups * cfg.o_lora_rank)?,
            attn_out: f32_buf(rows * d)?,
            rl: f32_buf(rows * cfg.n_experts)?,
            gsh: f32_buf(rows * ff_sh)?,
            ush: f32_buf(rows * ff_sh)?,
            ash: f32_buf(rows * ff_sh)?,
            dsh: f32_buf(rows * d)?,
            xg: f32_buf(rows * kk * d)?,
            g_out: f32_buf(rows * kk * ff)?,
            u_out: f32_buf(rows * kk * ff)?,
            act: f32_buf(rows * kk * ff)?,
            down_out: f32_buf(rows * kk * d)?,
            gather_src: DevBuf::zeroed(4 * rows * kk)?,
            comb_slot: DevBuf::zeroed(4 * rows * kk)?,
            comb_w: f32_buf(rows * kk)?,
            comb_cnt: DevBuf::zeroed(4 * rows)?,
            tail_done: DevBuf::zeroed(8)?,
            picks: DevBuf::zeroed(4 * rows * kk)?,
            pick_w: f32_buf(rows * kk)?,
            y: f32_buf(rows * d)?,
            logits: f32_buf(rows * cfg.vocab)?,
            ids: DevBuf::zeroed(4 * rows)?,
            part: f32_buf(part_floats + side_need.0)?,
            px: DevBuf::zeroed(px_bytes.max(16))?,
            px_bytes,
            part_floats,
            counters: DevBuf::zeroed(4 * (counters_len + side_need.1).max(1))?,
            counters_len,
            side_part_floats: side_need.0,
            side_counters_len: side_need.1,
            capture: f32_buf(capture_layers.max(1) * draft_cap * hc * d)?,
            runs: DevBuf::zeroed(std::mem::size_of::<CopyRun>() * Self::journal_runs(cfg, rows))?,
            journal: f32_buf(journal_floats)?,
        };
        Ok(CudaDecoder {
            backend,
            k,
            round_mode,
            ctx_len,
            consts,
            head_consts,
            mirror,
            bufs,
            programs: HashMap::new(),
            up: Pinned { ptr: std::ptr::null_mut(), bytes: 0 },
            down: Pinned { ptr: std::ptr::null_mut(), bytes: 0 },
            fix: Pinned { ptr: std::ptr::null_mut(), bytes: 0 },
            tag: 0,
            last: None,
            use_graphs,
            device_argmax,
            profile: profile.then(KernelProfile::default),
            resync_after_cut,
            side: if fork { Some(SideBranch::new()?) } else { None },
            prefetch_q_b,
            prefetch_branch,
            side_proj,
            hc_fused,
            gemm_on,
            gemm_mq,
            gemm_px,
            prefill: false,
            prefill_rows: rows,
            draft_cap,
            prefill_chunk,
            expert_mma,
            expert_mma_down,
            gx_grid,
            gx_tile,
            route_pick,
            route_tail,
            norm_tail,
            wide,
            compress_split,
            attn_mma,
            index_mma,
            index_mma_steps,
            bands,
            defer,
            mtp,
            dspark,
            upkeep,
            apes: Arc::new(
                w.layers
                    .iter()
                    .map(|l| {
                        [
                            l.compressor.as_ref().map(|c| c.ape.clone()),
                            l.indexer.as_ref().map(|i| i.compressor.ape.clone()),
                        ]
                        .into_iter()
                        .flatten()
                        .collect()
                    })
                    .collect(),
            ),
            spare: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// Floats a step of `n` rows writes to the state (ring rows, compressor slots, emitted
    /// rows), an upper bound.
    fn journal_floats(cfg: &crate::ModelConfig, n: usize) -> usize {
        let mut t = 0;
        for spec in &cfg.layers {
            t += n * cfg.head_dim;
            if spec.kind != AttentionKind::Sliding {
                let series = if spec.kind == AttentionKind::Csa { 2 } else { 1 };
                t += 2 * n * series * cfg.head_dim + n * cfg.head_dim;
            }
            if spec.kind == AttentionKind::Csa {
                t += 2 * n * 2 * cfg.index_head_dim + n * cfg.index_head_dim;
            }
        }
        t
    }

    /// Copy runs of a step of `n` rows, an upper bound.
    fn journal_runs(cfg: &crate::ModelConfig, n: usize) -> usize {
        cfg.layers.len() * n * 7
    }

    /// Runs a program's operations on the stream (through its CUDA graph when it has one).
    fn replay(ctx: &Context, prog: &mut Program, use_graphs: bool, side: Option<&SideBranch>) -> Result<()> {
        if let Some(exec) = prog.graph {
            // SAFETY: a graph instantiated from this program on this context.
            return unsafe { cu::graph::launch(exec, ctx.stream) }.map_err(driver_err("launching a graph"));
        }
        if use_graphs {
            // Capture the program once; later steps launch it with one call.
            // SAFETY: the stream is this context's; every op is queued on it while capturing.
            unsafe {
                cu::stream::begin_capture(ctx.stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .map_err(driver_err("capturing a graph"))?;
            }
            let queued = Self::queue_ops(ctx, &prog.ops, side);
            // SAFETY: ends the capture begun above, whatever happened in between.
            let graph = unsafe { cu::stream::end_capture(ctx.stream) };
            if let (Err(_), Ok(g)) = (&queued, &graph) {
                // SAFETY: the graph just captured, used by nothing else.
                unsafe { cu::graph::destroy(*g).ok() };
            }
            queued?;
            let graph = graph.map_err(driver_err("capturing a graph"))?;
            // SAFETY: a graph just captured; destroyed after instantiation.
            let exec = unsafe {
                let e = cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0));
                cu::graph::destroy(graph).ok();
                e.map_err(driver_err("instantiating a graph"))?
            };
            prog.graph = Some(exec);
            // SAFETY: as above.
            return unsafe { cu::graph::launch(exec, ctx.stream) }.map_err(driver_err("launching a graph"));
        }
        Self::queue_ops(ctx, &prog.ops, side)
    }

    /// Runs `ops` one at a time with an event after each, and returns each one's seconds.
    fn profile_ops(ctx: &Context, ops: &[Op]) -> Result<Vec<f64>> {
        let ev = || cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(driver_err("creating an event"));
        let events: Vec<sys::CUevent> = (0..=ops.len()).map(|_| ev()).collect::<Result<_>>()?;
        let run = || -> Result<Vec<f64>> {
            // SAFETY: events of this context recorded on its stream.
            unsafe { cu::event::record(events[0], ctx.stream) }.map_err(driver_err("recording an event"))?;
            for (i, op) in ops.iter().enumerate() {
                Self::queue_ops(ctx, std::slice::from_ref(op), None)?;
                // SAFETY: as above.
                unsafe { cu::event::record(events[i + 1], ctx.stream) }.map_err(driver_err("recording an event"))?;
            }
            ctx.sync()?;
            (0..ops.len())
                // SAFETY: both events recorded and complete.
                .map(|i| unsafe { cu::event::elapsed(events[i], events[i + 1]) }.map(|ms| f64::from(ms) / 1e3))
                .collect::<std::result::Result<Vec<f64>, _>>()
                .map_err(driver_err("timing"))
        };
        let out = run();
        for e in events {
            // SAFETY: created above, destroyed once.
            unsafe { cu::event::destroy(e).ok() };
        }
        out
    }

    /// Queues `ops` on the context's stream, the side launches on `side` and the prefetch
    /// launches on its prefetch branch (both on the context's stream too, in order, without
    /// one).
    fn queue_ops(ctx: &Context, ops: &[Op], side: Option<&SideBranch>) -> Result<()> {
        let mut ahead = false;
        for op in ops {
            match op {
                Op::Launch(l) => ctx.launch_args(l.f, l.grid, l.block, l.smem, &l.args)?,
                Op::Side(l) | Op::Ahead(l) => match side {
                    Some(sb) => {
                        let on_side = matches!(op, Op::Side(_));
                        let branch = if on_side { sb.stream } else { sb.ahead };
                        // SAFETY: events and streams of this context.
                        unsafe {
                            cu::event::record(sb.fork, ctx.stream).map_err(driver_err("recording an event"))?;
                            cu::stream::wait_event(branch, sb.fork, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                                .map_err(driver_err("waiting for an event"))?;
                        }
                        ctx.launch_on(branch, false, l.f, l.grid, l.block, l.smem, &l.args)?;
                        if on_side {
                            // SAFETY: as above.
                            unsafe { cu::event::record(sb.join, sb.stream) }
                                .map_err(driver_err("recording an event"))?;
                        } else {
                            ahead = true;
                        }
                    }
                    None => ctx.launch_args(l.f, l.grid, l.block, l.smem, &l.args)?,
                },
                Op::Join => {
                    if let Some(sb) = side {
                        // SAFETY: as above.
                        unsafe {
                            cu::stream::wait_event(ctx.stream, sb.join, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                        }
                        .map_err(driver_err("waiting for an event"))?;
                    }
                }
                // SAFETY: both ranges are inside live device buffers of this decoder.
                Op::Copy { dst, src, bytes } => unsafe {
                    cu::memcpy_dtod_async(*dst, *src, *bytes, ctx.stream)
                        .map_err(driver_err("copying on the device"))?
                },
            }
        }
        if let (true, Some(sb)) = (ahead, side) {
            // The step ends when its prefetches have (a captured graph joins every branch).
            // SAFETY: events and streams of this context.
            unsafe {
                cu::event::record(sb.ahead_join, sb.ahead).map_err(driver_err("recording an event"))?;
                cu::stream::wait_event(ctx.stream, sb.ahead_join, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                    .map_err(driver_err("waiting for an event"))?;
            }
        }
        Ok(())
    }

    // ------------------------------------------------------------------ state mirror

    /// Copies the whole host state to the device.
    fn upload_state(&mut self, state: &mut State) -> Result<()> {
        let pos = state.pos;
        for (ls, mm) in state.layers().iter().zip(&self.mirror) {
            if ls.slots == mm.slots {
                mm.ring.write(0, &ls.ring)?;
            } else {
                // More slots here (a prompt's steps): each position's row the host ring holds,
                // from its slot there to its slot here.
                let hd = ls.head_dim;
                let mut ring = vec![0f32; mm.slots * hd];
                for p in pos.saturating_sub(ls.slots.min(mm.slots))..pos {
                    let (h, d) = (p % ls.slots, p % mm.slots);
                    ring[d * hd..(d + 1) * hd].copy_from_slice(&ls.ring[h * hd..(h + 1) * hd]);
                }
                mm.ring.write(0, &ring)?;
            }
            for (cs, cm) in [(&ls.compressor, &mm.comp), (&ls.indexer, &mm.index)] {
                let (Some(cs), Some(cm)) = (cs, cm) else { continue };
                cm.cur_kv.write(0, &cs.cur_kv)?;
                cm.cur_score.write(0, &cs.cur_score)?;
                if let Some(prev) = &cm.prev {
                    prev.write(0, &cs.prev_kv)?;
                    prev.write(4 * cs.prev_kv.len(), &cs.prev_score)?;
                }
                if cs.rows.len() > cm.cap {
                    return Err(Error::invalid(
                        "the state holds more compressed rows than the device copy has room for",
                    ));
                }
                let rows: Vec<f32> = cs.rows.iter_values().collect();
                cm.rows.write(0, &rows)?;
            }
        }
        Ok(())
    }

    /// The pack runs of a step of `n` rows from `pos0`, in the order [`replay_journal`] reads
    /// them; returns the runs and the floats they hold.
    fn journal(&self, cfg: &crate::ModelConfig, pos0: usize, n: usize) -> (Vec<CopyRun>, usize) {
        let mut runs = Vec::new();
        let mut off = 0i64;
        let mut add = |runs: &mut Vec<CopyRun>, src: u64, len: usize| {
            runs.push(CopyRun { src, off, len: len as i64 });
            off += len as i64;
        };
        let hd = cfg.head_dim;
        for mm in &self.mirror {
            for r in 0..n {
                add(&mut runs, mm.ring.ptr + 4 * (((pos0 + r) % mm.slots) * hd) as u64, hd);
            }
            for cm in [&mm.comp, &mm.index].into_iter().flatten() {
                let pw = if cm.overlap { 2 * cm.width } else { cm.width };
                for r in 0..n {
                    let pos = pos0 + r;
                    add(&mut runs, cm.log_kv.ptr + 4 * (r * pw) as u64, pw);
                    add(&mut runs, cm.log_g.ptr + 4 * (r * pw) as u64, pw);
                    if (pos + 1).is_multiple_of(cm.ratio) {
                        add(&mut runs, cm.rows.ptr + 4 * ((pos / cm.ratio) * cm.width) as u64, cm.width);
                    }
                }
            }
        }
        (runs, off as usize)
    }
}

/// Makes a step's packed state writes in the host state's layers (logging what they
/// overwrite): the raw rows, and each compressor push replayed from the row's projections
/// (score = gate + position bias, the one addition the device made) with the emitted rows.
/// `j` is laid out as [`CudaDecoder::journal`] packs it for `n` rows, of which the first
/// `keep` are made; `apes` holds each layer's position biases (the compressor's, then the
/// indexer's).
///
/// Made before a step returned, these writes took about 0.23 ms of a 9.0 ms Flash step at a
/// 2100-token context on an H200, and more at several rows (the logging of a verify's rows, the
/// undo of its rejected ones). Hence [`StepWrites`]: a step leaves them pending in the state,
/// made during the next step's GPU work, and a cut keeps only the kept rows'. Verifies of 8
/// rows took 27.73 ms this way against 29.38 with the writes made at once (`DS4_CUDA_DEFER=0`).
/// (Measurements: scripts/kernel_lab/HISTORY.md, "decode/mod.rs: replay_journal".)
#[allow(clippy::too_many_arguments)]
fn replay_journal(
    layers: &mut [LayerState],
    apes: &[Vec<Vec<f32>>],
    pos0: usize,
    n: usize,
    keep: usize,
    j: &[f32],
    mut log: Option<&mut BatchLog>,
) {
    let mut at = 0usize;
    let mut take = |len: usize| {
        let s = at;
        at += len;
        s..at
    };
    let hd = layers.first().map_or(0, |l| l.head_dim);
    for (li, ls) in layers.iter_mut().enumerate() {
        let ring: Vec<std::ops::Range<usize>> = (0..n).map(|_| take(hd)).collect();
        // Compressor runs per row: kv, score, and the emitted row when the row closes.
        let mut comp_runs: Vec<Vec<PushRuns>> = Vec::new();
        for cs in [&ls.compressor, &ls.indexer].into_iter().flatten() {
            let pw = cs.proj_width();
            let v = (0..n)
                .map(|r| {
                    let kv = take(pw);
                    let sc = take(pw);
                    let row = (pos0 + r + 1).is_multiple_of(cs.ratio).then(|| take(cs.width));
                    (kv, sc, row)
                })
                .collect();
            comp_runs.push(v);
        }
        let apes = &apes[li];
        let mut score = Vec::new();
        for r in 0..keep.min(n) {
            let pos = pos0 + r;
            if let Some(log) = log.as_deref_mut() {
                log.before_row(li, pos, ls);
            }
            ls.push_raw(pos, &j[ring[r].clone()]);
            for (ci, cs) in [ls.compressor.as_mut(), ls.indexer.as_mut()].into_iter().flatten().enumerate() {
                let (kv, g, row) = &comp_runs[ci][r];
                let pw = cs.proj_width();
                let slot = pos % cs.ratio;
                score.clear();
                score.extend(j[g.clone()].iter().zip(&apes[ci][slot * pw..(slot + 1) * pw]).map(|(g, a)| g + a));
                let row = row.clone().map_or(&[][..], |rg| &j[rg]);
                cs.push_computed(pos, &j[kv.clone()], &score, row);
            }
        }
    }
}

/// A step's state writes left pending in the state ([`State::defer`]): its journal, copied
/// out of the pinned download (which the next step overwrites), made when the state's layers
/// are next read, normally by the next step while the GPU runs it.
/// A speculative cut keeps the writes of the kept rows only ([`PendingWrites::prefix`]), so a
/// verify's rejected rows are never written to the host state, nor logged and undone.
#[derive(Debug)]
struct StepWrites {
    pos0: usize,
    n: usize,
    /// Rows made (the first `keep` of the `n` the journal holds).
    keep: usize,
    journal: Arc<Vec<f32>>,
    apes: Arc<Vec<Vec<Vec<f32>>>>,
    /// Where the journal's buffer goes back when no writes hold it any more.
    spare: Arc<Mutex<Vec<Vec<f32>>>>,
}

impl PendingWrites for StepWrites {
    fn apply(&self, layers: &mut [LayerState]) {
        replay_journal(layers, &self.apes, self.pos0, self.n, self.keep, &self.journal, None);
    }

    fn rows(&self) -> (usize, usize) {
        (self.pos0, self.keep)
    }

    fn prefix(&self, keep: usize) -> Arc<dyn PendingWrites> {
        Arc::new(StepWrites {
            keep: keep.min(self.keep),
            journal: Arc::clone(&self.journal),
            apes: Arc::clone(&self.apes),
            spare: Arc::clone(&self.spare),
            ..*self
        })
    }
}

impl Drop for StepWrites {
    fn drop(&mut self) {
        let journal = std::mem::take(&mut self.journal);
        if let (Ok(v), Ok(mut spare)) = (Arc::try_unwrap(journal), self.spare.lock()) {
            if spare.len() < 2 {
                spare.push(v);
            }
        }
    }
}

/// The error for a step program missing from the cache right after it was built (cannot
/// happen; an error rather than a panic in library code).
fn lost_program() -> Error {
    Error::Backend("CUDA decode: a step program went missing from its cache".into())
}

impl CudaDecoder {
    /// One step ([`DeviceDecoder::forward`]): the requested rows' logits, or with `argmax`
    /// their argmax ids (`ds4_argmax_rows`, with [`NO_GREEDY`]) and, only when some row has no
    /// greedy token, their logits too.
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        model: &Model,
        state: &mut State,
        tokens: &[u32],
        which: Logits,
        argmax: bool,
        mut log: Option<&mut BatchLog>,
    ) -> Result<(Vec<f32>, Vec<u32>)> {
        let _t = crate::profile::scope(crate::profile::Phase::DeviceStep);
        let n = tokens.len();
        let most = if self.prefill { self.prefill_rows } else { N_MAX };
        if n == 0 || n > most {
            return Err(Error::invalid(format!("the device decoder takes 1..={most} rows, not {n}")));
        }
        let cfg = &model.config;
        let (d, hc) = (cfg.hidden, cfg.hc_mult);
        let pos0 = state.pos;
        if pos0 + n > self.ctx_len {
            return Err(Error::ContextOverflow { needed: pos0 + n, capacity: self.ctx_len });
        }
        let backend = Arc::clone(&self.backend);
        let guard = backend.lock();
        let ctx = &guard.ctx;
        ctx.bind()?;
        if self.tag == 0 || state.sync != self.tag {
            self.tag = 0;
            self.upload_state(state)?;
        }
        let drafting = state.draft.is_some() && model.draft.is_some();
        // The drafter's rows on the device ([`Upkeep`]), except for MTP's first step in
        // DeepSeek's pairing (no pending streams yet: its rows are one fewer than the step's),
        // and with DS4_CUDA_DRAFT=0 (the host computes them from the downloaded streams).
        let on_device = self.upkeep.is_some()
            && match (state.draft.as_ref(), model.draft.as_ref().map(|dm| dm.pairing)) {
                (Some(DraftState::Mtp { pending, .. }), Some(MtpPairing::Next)) => pending.len() == hc * d,
                (Some(DraftState::Mtp { .. }), _) => true,
                (Some(DraftState::DSpark { .. }), _) => true,
                (None, _) => false,
            };
        // A prompt's step of more rows than those paths take (the device's buffers hold
        // `draft_cap` rows, the host's capture N_MAX) leaves the drafter out: its rings are
        // written again by the prompt's last rows, which the session evaluates in steps that
        // keep it (session.rs `prompt_chunks`, DeviceDecoder::draft_rows); MTP keeps the step's
        // last streams as its pending ones (`Model::draft_skip`).
        let skip_draft = drafting && n > if on_device { self.draft_cap } else { N_MAX };
        if skip_draft && log.is_some() {
            return Err(Error::Backend("CUDA decode: a logged step of more rows than a verify's (internal)".into()));
        }
        let want_x = drafting && !skip_draft;
        let upkeep = want_x && on_device;
        let mtp_upkeep = upkeep && self.mtp.is_some();
        // Stale until this step completes.
        self.tag = 0;
        self.last = None;
        let head = match which {
            Logits::All => Some((0, n)),
            Logits::Last => Some((n - 1, 1)),
            Logits::None => None,
        };
        let argmax = argmax && head.is_some();
        let key = (
            n,
            match which {
                Logits::All => 0u8,
                Logits::Last => 1,
                Logits::None => 2,
            },
            argmax,
            upkeep,
            self.prefill && self.gemm_on,
        );
        if !self.programs.contains_key(&key) {
            let img = guard
                .image(model.file.raw())
                .ok_or_else(|| Error::Backend("CUDA decode: the model's weights are not on the device".into()))?;
            let dimg = match model.draft.as_ref() {
                Some(dm) if upkeep => Some(drafter_images(&guard, model, dm)?.1),
                _ => None,
            };
            let prog =
                self.build(ctx, img, model, n, program::Body::Trunk { head, argmax, upkeep: dimg, prefill: key.4 })?;
            self.programs.insert(key, prog);
        }

        // Upload: step parameters, the streams (each row's embedding in every stream), the
        // pack runs.
        let (runs, jfloats) = self.journal(cfg, pos0, n);
        let step_bytes = STEP_BYTES;
        let x_bytes = 4 * n * hc * d;
        let runs_bytes = std::mem::size_of_val(runs.as_slice());
        let up_main = step_bytes + x_bytes + runs_bytes;
        // MTP's upkeep: its rows' step parameters, the pending streams, the tokens' embeddings.
        let uk_bytes = if mtp_upkeep { step_bytes + 4 * hc * d + 4 * n * d } else { 0 };
        self.up.reserve(up_main + uk_bytes)?;
        {
            put_step(model, &mut self.up, pos0, tokens, hc, d)?;
            // SAFETY: CopyRun is plain repr(C) data.
            let rb = unsafe { std::slice::from_raw_parts(runs.as_ptr().cast::<u8>(), runs_bytes) };
            self.up.bytes_mut(step_bytes + x_bytes, runs_bytes).copy_from_slice(rb);
        }
        let mut positions = Vec::new();
        if upkeep {
            positions = model.draft_positions(state, pos0, n);
            if positions.len() != n {
                return Err(Error::Backend("CUDA decode: the drafter's rows are not the step's (internal)".into()));
            }
        }
        if mtp_upkeep {
            put_params(&mut self.up, up_main, positions[0], tokens);
            if let Some(DraftState::Mtp { pending, .. }) = state.draft.as_ref() {
                // Empty in ds4's pairing, whose pairs are the step's rows only.
                self.up.floats(up_main + step_bytes, pending.len()).copy_from_slice(pending);
            }
            // The tokens' embeddings: each row's first input stream, which put_step wrote.
            let all = self.up.floats(0, (up_main + uk_bytes) / 4);
            let emb0 = (up_main + step_bytes) / 4 + hc * d;
            for r in 0..n {
                let src = step_bytes / 4 + r * hc * d;
                all.copy_within(src..src + d, emb0 + r * d);
            }
        }
        let logit_rows = head.map_or(0, |h| h.1);
        // What comes back of the requested rows: one u32 id each, or their logits.
        let head_words = if argmax { logit_rows } else { logit_rows * cfg.vocab };
        // The host path's upkeep reads every row's streams (and DSpark's captures); MTP's
        // pending streams are the last row's.
        let capture_layers = match model.draft.as_ref().map(|dm| &dm.kind) {
            Some(DraftKind::DSpark(w)) if want_x && !upkeep => w.target_layers.len(),
            _ => 0,
        };
        let x_down = if want_x && !(upkeep && self.dspark.is_some()) { n * hc * d } else { 0 };
        let dcap = self.draft_cap;
        let uk_rows = self.upkeep.as_ref().filter(|_| upkeep).map_or(0, |u| u.rings * dcap * cfg.head_dim);
        // A step that leaves the drafter out: its last row's streams (MTP's pending ones).
        let last_down = if skip_draft { hc * d } else { 0 };
        let down_floats = head_words + jfloats + x_down * (1 + capture_layers) + uk_rows + last_down;
        self.down.reserve(4 * down_floats)?;
        if runs.len() * std::mem::size_of::<CopyRun>() > self.bufs.runs.bytes || jfloats * 4 > self.bufs.journal.bytes {
            return Err(Error::Backend("CUDA decode: journal buffers too small (internal)".into()));
        }
        let stream = ctx.stream;
        let run = || -> Result<()> {
            // SAFETY: pinned host ranges inside `up`/`down`, device ranges inside the buffers;
            // the host waits for the stream before touching either again.
            unsafe {
                let upb = std::slice::from_raw_parts(self.up.ptr, step_bytes + x_bytes + runs_bytes);
                cu::memcpy_htod_async(self.bufs.step.ptr, &upb[..step_bytes], stream).map_err(driver_err("upload"))?;
                cu::memcpy_htod_async(self.bufs.x.ptr, &upb[step_bytes..step_bytes + x_bytes], stream)
                    .map_err(driver_err("upload"))?;
                cu::memcpy_htod_async(self.bufs.runs.ptr, &upb[step_bytes + x_bytes..], stream)
                    .map_err(driver_err("upload"))?;
                if let (Some(uk), true) = (self.upkeep.as_ref(), mtp_upkeep) {
                    let ukb = std::slice::from_raw_parts(self.up.ptr.add(up_main), uk_bytes);
                    let (st, rest) = ukb.split_at(step_bytes);
                    let (pend, emb) = rest.split_at(4 * hc * d);
                    cu::memcpy_htod_async(uk.step.ptr, st, stream).map_err(driver_err("upload"))?;
                    cu::memcpy_htod_async(uk.h.ptr, pend, stream).map_err(driver_err("upload"))?;
                    cu::memcpy_htod_async(uk.emb.ptr, emb, stream).map_err(driver_err("upload"))?;
                }
            }
            Ok(())
        };
        run()?;
        let use_graphs = self.use_graphs && self.profile.is_none();
        if let Some(prof) = self.profile.as_mut() {
            let prog = self.programs.get(&key).ok_or_else(lost_program)?;
            let times = Self::profile_ops(ctx, &prog.ops)?;
            let k = &self.k;
            let names = prog.ops.iter().map(|op| match op {
                Op::Launch(l) | Op::Side(l) | Op::Ahead(l) => {
                    let name = k
                        .name_of(l.f)
                        .map(str::to_string)
                        .or_else(|| ctx.product_kernel_name(l.f))
                        .unwrap_or_else(|| "?".into());
                    if l.label.is_empty() {
                        name
                    } else {
                        format!("{name} {}", l.label)
                    }
                }
                Op::Copy { .. } => "copy".into(),
                Op::Join => "join".into(),
            });
            prof.record(n, names.zip(times));
        } else {
            let prog = self.programs.get_mut(&key).ok_or_else(lost_program)?;
            Self::replay(ctx, prog, use_graphs, self.side.as_ref())?;
        }
        let k = &self.k;
        ctx.launch_args(
            k.pack,
            (runs.len() as u32, 1, 1),
            128,
            0,
            &[Arg::Ptr(self.bufs.runs.ptr), Arg::Ptr(self.bufs.journal.ptr)],
        )?;
        // SAFETY: as above.
        unsafe {
            let dn = std::slice::from_raw_parts_mut(self.down.ptr.cast::<f32>(), down_floats);
            let (lg, rest) = dn.split_at_mut(head_words);
            let (jr, xr) = rest.split_at_mut(jfloats);
            if argmax {
                let ids = std::slice::from_raw_parts_mut(lg.as_mut_ptr().cast::<u32>(), lg.len());
                cu::memcpy_dtoh_async(ids, self.bufs.ids.ptr, stream).map_err(driver_err("download"))?;
            } else if !lg.is_empty() {
                cu::memcpy_dtoh_async(lg, self.bufs.logits.ptr, stream).map_err(driver_err("download"))?;
            }
            cu::memcpy_dtoh_async(jr, self.bufs.journal.ptr, stream).map_err(driver_err("download"))?;
            let (xf, rest) = xr.split_at_mut(x_down);
            let (cap, rest) = rest.split_at_mut(x_down * capture_layers);
            let (ukr, last) = rest.split_at_mut(uk_rows);
            if last_down > 0 {
                cu::memcpy_dtoh_async(last, self.bufs.x.ptr + (4 * (n - 1) * hc * d) as u64, stream)
                    .map_err(driver_err("download"))?;
            }
            if x_down > 0 {
                cu::memcpy_dtoh_async(xf, self.bufs.x.ptr, stream).map_err(driver_err("download"))?;
            }
            for j in 0..capture_layers {
                let dst = &mut cap[j * n * hc * d..(j + 1) * n * hc * d];
                cu::memcpy_dtoh_async(dst, self.bufs.capture.ptr + (j * dcap * hc * d * 4) as u64, stream)
                    .map_err(driver_err("download"))?;
            }
            if let (Some(uk), false) = (self.upkeep.as_ref(), ukr.is_empty()) {
                cu::memcpy_dtoh_async(ukr, uk.rows.ptr, stream).map_err(driver_err("download"))?;
            }
        }
        {
            // The previous step's writes, while the GPU runs this one.
            let _j = crate::profile::scope(crate::profile::Phase::Journal);
            state.flush();
        }
        {
            let _w = crate::profile::scope(crate::profile::Phase::DeviceWait);
            ctx.sync()?;
        }
        let ids: Vec<u32> = if argmax {
            // SAFETY: the first `logit_rows` words of the pinned download, written by the copy
            // waited for above.
            unsafe { std::slice::from_raw_parts(self.down.ptr.cast::<u32>(), logit_rows) }.to_vec()
        } else {
            Vec::new()
        };
        // A row without a greedy token (NaN or infinite logits): the rows' logits too, for the
        // sampler to report as it does on logits.
        let fallback = if ids.iter().any(|&id| id & NO_GREEDY != 0) {
            self.bufs.logits.read::<f32>(0, logit_rows * cfg.vocab)?
        } else {
            Vec::new()
        };
        drop(guard);

        // SAFETY: the pinned download holds `down_floats` floats, all written by the copies
        // waited for above; nothing writes `self.down` again before the next step.
        let dn: &[f32] = unsafe { std::slice::from_raw_parts(self.down.ptr.cast::<f32>(), down_floats) };
        let (lg, rest) = dn.split_at(head_words);
        let (jr, xr) = rest.split_at(jfloats);
        let (xf, rest) = xr.split_at(x_down);
        let (cap, rest) = rest.split_at(x_down * capture_layers);
        let (ukr, last) = rest.split_at(uk_rows);
        if skip_draft {
            // Nothing else after the GPU work can fail (its check comes before its write).
            model.draft_skip(state, last)?;
        } else if upkeep {
            // Ring s's row at position p is in slot s * dcap + p % dcap.
            let hd = cfg.head_dim;
            let rings = ukr.len() / (dcap * hd);
            let rows: Vec<Vec<f32>> = (0..rings)
                .map(|s| {
                    let slot = |p: usize| &ukr[(s * dcap + p % dcap) * hd..(s * dcap + p % dcap + 1) * hd];
                    positions.iter().flat_map(|&p| slot(p).iter().copied()).collect()
                })
                .collect();
            // Nothing else after the GPU work can fail (its checks come before its writes).
            model.draft_store(state, n, xf, &rows, pos0, log.as_deref_mut())?;
        } else if want_x {
            // DSpark's capture: each target layer's streams averaged, as the host pass does.
            let mut captured = vec![0f32; n * capture_layers * d];
            for j in 0..capture_layers {
                for r in 0..n {
                    let streams = &cap[(j * n + r) * hc * d..(j * n + r + 1) * hc * d];
                    let k = capture_layers;
                    mean_of_streams(streams, &mut captured[(r * k + j) * d..(r * k + j + 1) * d]);
                }
            }
            // First: it changes nothing when it fails (its products come before its writes),
            // and nothing else after the GPU work can fail.
            model.draft_advance(state, xf, &captured, tokens, pos0, log.as_deref_mut())?;
        }
        {
            let _j = crate::profile::scope(crate::profile::Phase::Journal);
            if self.defer {
                // Made while the GPU runs the next step, and for a cut only the kept rows'.
                let mut journal = self.spare.lock().ok().and_then(|mut s| s.pop()).unwrap_or_default();
                journal.clear();
                journal.extend_from_slice(jr);
                let (journal, apes, spare) = (Arc::new(journal), Arc::clone(&self.apes), Arc::clone(&self.spare));
                state.defer(Arc::new(StepWrites { pos0, n, keep: n, journal, apes, spare }));
                if let Some(log) = log.as_deref_mut() {
                    log.layers_pending = true;
                }
            } else {
                replay_journal(state.layers_mut(), &self.apes, pos0, n, n, jr, log);
            }
        }
        state.pos += n;
        state.tokens.extend_from_slice(tokens);
        let tag = fresh_tag();
        state.sync = tag;
        self.tag = tag;
        self.last = Some((pos0, n));
        Ok((if argmax { fallback } else { lg.to_vec() }, ids))
    }
}

/// The images of the target's and the drafter's files (the same image for a drafter in the
/// target's file).
fn drafter_images<'a>(
    g: &'a super::Inner,
    model: &Model,
    dm: &crate::model::DraftModel,
) -> Result<(&'a super::weights::DeviceImage, &'a super::weights::DeviceImage)> {
    let find = |raw: &[u8]| {
        g.image(raw).ok_or_else(|| Error::Backend("CUDA decode: the drafter's weights are not on the device".into()))
    };
    Ok((find(model.file.raw())?, find(dm.file.raw())?))
}

/// Bytes of the step parameters: the position of row 0, the row count, the rows' tokens.
const STEP_BYTES: usize = 4 * (2 + P_MAX);

/// Writes the step parameters of rows at `pos0..` with these `tokens` ([`STEP_BYTES`]) at
/// byte `off` of `up`.
fn put_params(up: &mut Pinned, off: usize, pos0: usize, tokens: &[u32]) {
    let mut vals = vec![pos0 as i32, tokens.len() as i32];
    vals.extend(tokens.iter().map(|&t| t as i32));
    vals.resize(2 + P_MAX, 0);
    for (c, v) in up.bytes_mut(off, STEP_BYTES).chunks_mut(4).zip(vals) {
        c.copy_from_slice(&v.to_le_bytes());
    }
}

/// Writes the step parameters of rows at `pos0..` with these `tokens` to the start of `up`,
/// then, after them, each row's embedding into every one of its `hc` streams of `d` floats (the
/// rows' input streams).
fn put_step(model: &Model, up: &mut Pinned, pos0: usize, tokens: &[u32], hc: usize, d: usize) -> Result<()> {
    put_params(up, 0, pos0, tokens);
    let x = up.floats(STEP_BYTES, tokens.len() * hc * d);
    let mut e = vec![0f32; d];
    for (r, &t) in tokens.iter().enumerate() {
        model.embed_row(t, &mut e)?;
        for s in 0..hc {
            x[(r * hc + s) * d..(r * hc + s + 1) * d].copy_from_slice(&e);
        }
    }
    Ok(())
}

impl CudaDecoder {
    /// [`DeviceDecoder::propose`] for the MTP drafter: `Model::propose`'s steps (see
    /// `propose_mtp` in model/drafting.rs), each one program run on the device. The first step
    /// uploads the host's drafter ring and the pending trunk streams; every step uploads its
    /// position, token and the token's embedding row, and brings back the argmax of the logits
    /// (and the logits when `want_logits` or a non-greedy chooser needs them). Nothing in the
    /// state changes.
    fn propose_mtp(
        &mut self,
        model: &Model,
        state: &State,
        anchor: u32,
        k: usize,
        mut chooser: Chooser<'_>,
        want_logits: bool,
    ) -> Result<Proposal> {
        let _t = crate::profile::scope(crate::profile::Phase::DeviceDraft);
        let cfg = &model.config;
        let (d, hc, v) = (cfg.hidden, cfg.hc_mult, cfg.vocab);
        let (Some(dm), Some(DraftState::Mtp { ring, pending })) = (model.draft.as_ref(), state.draft.as_ref()) else {
            return Err(Error::invalid("the session was created without the model's drafter state"));
        };
        let DraftKind::Mtp(mw) = &dm.kind else {
            return Err(Error::invalid("the session's drafter state does not match the model's drafter"));
        };
        let mut out = Proposal::default();
        if state.pos == 0 || k == 0 {
            return Ok(out);
        }
        let p = state.pos - 1;
        let slots = self.mtp.as_ref().map_or(0, |m| m.mirror.slots);
        if pending.len() != hc * d || ring.ring.len() != slots * cfg.head_dim {
            return Err(Error::Backend("CUDA decode: the drafter state does not fit the device's (internal)".into()));
        }
        // The first step's input: the trunk's last streams with the anchor (DeepSeek's
        // pairing), or with the last token, whose output is then chained with the anchor (ds4's).
        let (mut tok, mut pos) = match dm.pairing {
            MtpPairing::Next => (anchor, p),
            MtpPairing::Same => (state.tokens[p], p),
        };
        let backend = Arc::clone(&self.backend);
        let guard = backend.lock();
        let ctx = &guard.ctx;
        ctx.bind()?;
        let (timg, dimg) = drafter_images(&guard, model, dm)?;
        // ds4's pairing also runs one step without the head.
        let heads: &[bool] = if dm.pairing == MtpPairing::Same { &[false, true] } else { &[true] };
        for &head in heads {
            let Some(dev) = self.mtp.as_ref() else {
                return Err(Error::Backend("CUDA decode: no MTP path (internal)".into()));
            };
            if dev.programs[head as usize].is_none() {
                let prog = self.build(ctx, timg, model, 1, program::Body::Mtp { dev, w: mw, img: dimg, head })?;
                if let Some(dev) = self.mtp.as_mut() {
                    dev.programs[head as usize] = Some(prog);
                }
            }
        }
        let step_bytes = STEP_BYTES;
        let ring_bytes = 4 * ring.ring.len();
        let h_bytes = 4 * hc * d;
        self.up.reserve(step_bytes + 4 * d + h_bytes + ring_bytes)?;
        self.down.reserve(4 * (1 + v))?;
        // The ring and the streams, once (they are the host's: this proposal's rows live only
        // on the device).
        self.up.floats(step_bytes + 4 * d, hc * d).copy_from_slice(pending);
        self.up.floats(step_bytes + 4 * d + h_bytes, ring.ring.len()).copy_from_slice(&ring.ring);
        let stream = ctx.stream;
        let (x_dev, ring_dev, emb_dev) = match self.mtp.as_ref() {
            Some(dev) => (self.bufs.x.ptr, dev.mirror.ring.ptr, dev.emb.ptr),
            None => return Err(Error::Backend("CUDA decode: no MTP path (internal)".into())),
        };
        // SAFETY: pinned host ranges inside `up`, device buffers of this decoder of at least
        // these sizes; the host waits for the stream before writing `up` again.
        unsafe {
            let upb = std::slice::from_raw_parts(self.up.ptr, step_bytes + 4 * d + h_bytes + ring_bytes);
            cu::memcpy_htod_async(x_dev, &upb[step_bytes + 4 * d..step_bytes + 4 * d + h_bytes], stream)
                .map_err(driver_err("upload"))?;
            cu::memcpy_htod_async(ring_dev, &upb[step_bytes + 4 * d + h_bytes..], stream)
                .map_err(driver_err("upload"))?;
        }
        let use_graphs = self.use_graphs && self.profile.is_none();
        let mut first = true;
        while out.tokens.len() < k {
            let chained = dm.pairing == MtpPairing::Same && first;
            first = false;
            // The token's embedding once (the block's input norms take it apart from the streams).
            put_step(model, &mut self.up, pos, &[tok], 1, d)?;
            let logits_back = !chained && (want_logits || !chooser.is_greedy());
            // SAFETY: as above; `down` is written only by these copies and read after the wait.
            unsafe {
                let upb = std::slice::from_raw_parts(self.up.ptr, step_bytes + 4 * d);
                cu::memcpy_htod_async(self.bufs.step.ptr, &upb[..step_bytes], stream).map_err(driver_err("upload"))?;
                cu::memcpy_htod_async(emb_dev, &upb[step_bytes..], stream).map_err(driver_err("upload"))?;
            }
            let prog =
                self.mtp.as_mut().and_then(|m| m.programs[!chained as usize].as_mut()).ok_or_else(lost_program)?;
            Self::replay(ctx, prog, use_graphs, self.side.as_ref())?;
            if !chained {
                // SAFETY: as above.
                unsafe {
                    let dn = std::slice::from_raw_parts_mut(self.down.ptr.cast::<u32>(), 1 + v);
                    cu::memcpy_dtoh_async(&mut dn[..1], self.bufs.ids.ptr, stream).map_err(driver_err("download"))?;
                    if logits_back {
                        let lg = std::slice::from_raw_parts_mut(self.down.ptr.cast::<f32>().add(1), v);
                        cu::memcpy_dtoh_async(lg, self.bufs.logits.ptr, stream).map_err(driver_err("download"))?;
                    }
                }
            }
            ctx.sync()?;
            pos += 1;
            if chained {
                tok = anchor;
                continue;
            }
            // SAFETY: written by the copies waited for above.
            let id = unsafe { *self.down.ptr.cast::<u32>() };
            let logits: Vec<f32> = if logits_back {
                // SAFETY: as above.
                unsafe { std::slice::from_raw_parts(self.down.ptr.cast::<f32>().add(1), v) }.to_vec()
            } else if id & NO_GREEDY != 0 {
                // No greedy token on the device (NaN or infinite logits): the host's argmax
                // decides, as on the host path.
                self.bufs.logits.read::<f32>(0, v)?
            } else {
                Vec::new()
            };
            // Greedy: the device's argmax (the host's scan of the same logits, bit for bit).
            tok = if chooser.is_greedy() && id & NO_GREEDY == 0 { id } else { chooser.choose(&logits)? };
            out.tokens.push(tok);
            if want_logits {
                out.logits.extend_from_slice(&logits);
            }
        }
        drop(guard);
        chooser.finish(&mut out);
        Ok(out)
    }

    /// [`DeviceDecoder::propose`] for DSpark (`propose_dspark` in model/drafting.rs): the
    /// block and its head on the device (the host's stage rings uploaded first), then, greedy,
    /// the Markov and confidence heads there too ([`MarkovDevice`]), else as on the host path.
    fn propose_dspark(
        &mut self,
        model: &Model,
        state: &State,
        anchor: u32,
        k: usize,
        chooser: Chooser<'_>,
        want_logits: bool,
    ) -> Result<Proposal> {
        let _t = crate::profile::scope(crate::profile::Phase::DeviceDraft);
        let cfg = &model.config;
        let (d, hc, v) = (cfg.hidden, cfg.hc_mult, cfg.vocab);
        let (Some(dm), Some(DraftState::DSpark { rings })) = (model.draft.as_ref(), state.draft.as_ref()) else {
            return Err(Error::invalid("the session was created without the model's drafter state"));
        };
        let DraftKind::DSpark(dw) = &dm.kind else {
            return Err(Error::invalid("the session's drafter state does not match the model's drafter"));
        };
        if state.pos == 0 || k == 0 {
            return Ok(Proposal::default());
        }
        let nb = dw.block_size;
        let slots = self.dspark.as_ref().map_or(0, |m| m.stages.first().map_or(0, |s| s.1.slots));
        if rings.len() != dw.stages.len() || rings.iter().any(|r| r.ring.len() != slots * cfg.head_dim) {
            return Err(Error::Backend("CUDA decode: the drafter state does not fit the device's (internal)".into()));
        }
        let backend = Arc::clone(&self.backend);
        let guard = backend.lock();
        let ctx = &guard.ctx;
        ctx.bind()?;
        let (timg, dimg) = drafter_images(&guard, model, dm)?;
        let Some(dev) = self.dspark.as_ref() else {
            return Err(Error::Backend("CUDA decode: no DSpark path (internal)".into()));
        };
        if dev.program.is_none() {
            let prog = self.build(ctx, timg, model, nb, program::Body::DSpark { dev, w: dw, img: dimg })?;
            if let Some(dev) = self.dspark.as_mut() {
                dev.program = Some(prog);
            }
        }
        // Upload: the step (the block's positions p + 1.., its tokens), the rows' streams (each
        // row's embedding in every stream: the anchor, then the noise token), the stage rings.
        let step_bytes = STEP_BYTES;
        let x_floats = nb * hc * d;
        let ring_floats = slots * cfg.head_dim;
        let up_bytes = step_bytes + 4 * (x_floats + rings.len() * ring_floats);
        self.up.reserve(up_bytes)?;
        let mut block = vec![dw.noise_token; nb];
        block[0] = anchor;
        put_step(model, &mut self.up, state.pos, &block, hc, d)?;
        for (i, ring) in rings.iter().enumerate() {
            self.up.floats(step_bytes + 4 * (x_floats + i * ring_floats), ring_floats).copy_from_slice(&ring.ring);
        }
        self.down.reserve(4 * nb * (v + d))?;
        let stream = ctx.stream;
        let ring_ptrs: Vec<u64> = match self.dspark.as_ref() {
            Some(dev) => dev.stages.iter().map(|s| s.1.ring.ptr).collect(),
            None => return Err(Error::Backend("CUDA decode: no DSpark path (internal)".into())),
        };
        // SAFETY: pinned host ranges inside `up` and `down`, device buffers of this decoder of
        // at least these sizes; the host waits for the stream before touching either again.
        unsafe {
            let upb = std::slice::from_raw_parts(self.up.ptr, up_bytes);
            cu::memcpy_htod_async(self.bufs.step.ptr, &upb[..step_bytes], stream).map_err(driver_err("upload"))?;
            let xe = step_bytes + 4 * x_floats;
            cu::memcpy_htod_async(self.bufs.x.ptr, &upb[step_bytes..xe], stream).map_err(driver_err("upload"))?;
            for (i, &rp) in ring_ptrs.iter().enumerate() {
                let o = xe + 4 * i * ring_floats;
                cu::memcpy_htod_async(rp, &upb[o..o + 4 * ring_floats], stream).map_err(driver_err("upload"))?;
            }
        }
        let use_graphs = self.use_graphs && self.profile.is_none();
        let prog = self.dspark.as_mut().and_then(|m| m.program.as_mut()).ok_or_else(lost_program)?;
        Self::replay(ctx, prog, use_graphs, self.side.as_ref())?;
        let k = k.min(nb);
        let markov = self.dspark.as_ref().and_then(|m| m.markov.as_ref());
        if let (Some(mk), true) = (markov, chooser.is_greedy()) {
            // The tokens and confidences (and, asked for, the rows the host path returns).
            ctx.sync()?;
            let (ids, conf) = (self.bufs.ids.read::<u32>(0, k)?, mk.conf.read::<f32>(0, k)?);
            if ids.iter().all(|&id| id & NO_GREEDY == 0) {
                let mut out =
                    Proposal { tokens: ids, confidence: dw.confidence.is_some().then_some(conf), ..Default::default() };
                if want_logits {
                    out.logits = mk.logits.read::<f32>(0, k * v)?;
                    out.base_logits = Some(self.bufs.logits.read::<f32>(0, k * v)?);
                    out.hidden = Some(self.bufs.y.read::<f32>(0, k * d)?);
                }
                return Ok(out);
            }
            // A row without a greedy token: the host's loop decides, from the same rows.
        }
        // SAFETY: as above.
        unsafe {
            let dn = std::slice::from_raw_parts_mut(self.down.ptr.cast::<f32>(), nb * (v + d));
            let (lg, hr) = dn.split_at_mut(nb * v);
            cu::memcpy_dtoh_async(lg, self.bufs.logits.ptr, stream).map_err(driver_err("download"))?;
            cu::memcpy_dtoh_async(hr, self.bufs.y.ptr, stream).map_err(driver_err("download"))?;
        }
        ctx.sync()?;
        // SAFETY: written by the copies waited for above.
        let dn = unsafe { std::slice::from_raw_parts(self.down.ptr.cast::<f32>(), nb * (v + d)) };
        let (base, h) = (dn[..nb * v].to_vec(), dn[nb * v..].to_vec());
        // The Markov and confidence heads' products take the backend's lock.
        drop(guard);
        model.dspark_choose(dm, dw, &base, &h, anchor, k, chooser)
    }
}

impl DeviceDecoder for CudaDecoder {
    fn max_rows(&self) -> usize {
        N_MAX
    }

    fn prefill_rows(&self) -> usize {
        self.prefill_rows
    }

    fn draft_rows(&self) -> usize {
        if self.upkeep.is_some() {
            self.draft_cap
        } else {
            N_MAX
        }
    }

    fn propose(
        &mut self,
        model: &Model,
        state: &State,
        anchor: u32,
        k: usize,
        sampler: Option<&mut Sampler>,
        want_logits: bool,
    ) -> Option<Result<Proposal>> {
        if self.mtp.is_some() {
            return Some(self.propose_mtp(model, state, anchor, k, Chooser::new(sampler), want_logits));
        }
        self.dspark.is_some().then(|| self.propose_dspark(model, state, anchor, k, Chooser::new(sampler), want_logits))
    }

    fn forward(
        &mut self,
        model: &Model,
        state: &mut State,
        tokens: &[u32],
        which: Logits,
        log: Option<&mut BatchLog>,
    ) -> Result<Vec<f32>> {
        Ok(self.step(model, state, tokens, which, false, log)?.0)
    }

    fn forward_argmax(
        &mut self,
        model: &Model,
        state: &mut State,
        tokens: &[u32],
        which: Logits,
        log: Option<&mut BatchLog>,
    ) -> Result<Greedy> {
        if !self.device_argmax {
            let logits = self.forward(model, state, tokens, which, log)?;
            return Ok(Greedy::from_logits(logits, model.config.vocab));
        }
        let (logits, ids) = self.step(model, state, tokens, which, true, log)?;
        Ok(if ids.iter().any(|&id| id & NO_GREEDY != 0) { Greedy::Logits(logits) } else { Greedy::Ids(ids) })
    }

    fn set_prefill(&mut self, on: bool) {
        self.prefill = on;
    }

    fn sync(&mut self, state: &mut State) -> Result<()> {
        if self.tag != 0 && state.sync == self.tag {
            return Ok(());
        }
        let backend = Arc::clone(&self.backend);
        let guard = backend.lock();
        guard.ctx.bind()?;
        self.tag = 0;
        self.last = None;
        self.upload_state(state)?;
        drop(guard);
        let t = fresh_tag();
        state.sync = t;
        self.tag = t;
        Ok(())
    }

    fn kept(&mut self, state: &mut State, tag: u64, keep: usize) -> Result<()> {
        if state.sync != 0 && state.sync == self.tag {
            return Ok(()); // nothing was cut
        }
        let Some((pos0, n)) = self.last else { return Ok(()) };
        if tag == 0 || tag != self.tag || state.pos != pos0 + keep || keep > n || self.resync_after_cut {
            self.tag = 0;
            return Ok(());
        }
        // What the rejected rows wrote that is read later, put back:
        // - the previous window of the overlapping compressors, when a rejected row closed a
        //   window: from the backup the first such row made;
        // - compressor slots of kept positions of the open window that a rejected row of the
        //   next window overwrote (a batch longer than the ratio): from the host state, which
        //   the undo has just restored.
        // The rest is rewritten before it is read: ring slots and compressor slots of the
        // rejected positions, their emitted rows (the visible row counts follow from the
        // position).
        let backend = Arc::clone(&self.backend);
        let guard = backend.lock();
        let ctx = &guard.ctx;
        ctx.bind()?;
        let cut = pos0 + keep;
        let mut fixes: Vec<(u64, usize, usize)> = Vec::new(); // (device address, layer, float offset)
        let mut staged: Vec<f32> = Vec::new();
        // The slots of the open window's kept positions that rejected rows overwrote, for a
        // compressor of `ratio`.
        let w0 = |ratio: usize| cut - cut % ratio;
        let overwritten = |ratio: usize| {
            let mut slots: Vec<usize> = Vec::new();
            for p in pos0 + keep..pos0 + n {
                let slot = p % ratio;
                if p >= w0(ratio) + ratio && w0(ratio) + slot < cut && !slots.contains(&slot) {
                    slots.push(slot);
                }
            }
            slots
        };
        // The host state is read only for those (its pending writes, the kept rows', are
        // otherwise made during the next step's GPU work).
        let comps = || self.mirror.iter().flat_map(|mm| [&mm.comp, &mm.index]).flatten();
        let host = if comps().any(|cm| !overwritten(cm.ratio).is_empty()) { Some(state.layers()) } else { None };
        for (li, mm) in self.mirror.iter().enumerate() {
            for (ci, cm) in [&mm.comp, &mm.index].into_iter().enumerate() {
                let Some(cm) = cm else { continue };
                if let (Some(prev), Some(backup)) = (&cm.prev, &cm.backup) {
                    if let Some(r) = (keep..n).find(|&r| (pos0 + r + 1).is_multiple_of(cm.ratio)) {
                        let bytes = 4 * 2 * cm.ratio * cm.width;
                        // SAFETY: both ranges inside the decoder's buffers; queued on the
                        // stream before any later step.
                        unsafe {
                            cu::memcpy_dtod_async(prev.ptr, backup.ptr + (r * bytes) as u64, bytes, ctx.stream)
                                .map_err(driver_err("restoring a compressor window"))?;
                        }
                    }
                }
                let slots = overwritten(cm.ratio);
                let Some(layers) = host.filter(|_| !slots.is_empty()) else { continue };
                let ls = &layers[li];
                let Some(cs) = (if ci == 0 { &ls.compressor } else { &ls.indexer }) else { continue };
                let pw = cs.proj_width();
                for slot in slots {
                    for (dev, host) in [(&cm.cur_kv, &cs.cur_kv), (&cm.cur_score, &cs.cur_score)] {
                        fixes.push((dev.ptr + 4 * (slot * pw) as u64, staged.len(), pw));
                        staged.extend_from_slice(&host[slot * pw..(slot + 1) * pw]);
                    }
                }
            }
        }
        if !fixes.is_empty() {
            self.fix.reserve(4 * staged.len())?;
            self.fix.floats(0, staged.len()).copy_from_slice(&staged);
            for &(dst, off, len) in &fixes {
                // SAFETY: pinned source inside `fix` (kept until the sync below), destination
                // inside a compressor buffer.
                unsafe {
                    let src = std::slice::from_raw_parts(self.fix.ptr.cast::<f32>().add(off), len);
                    cu::memcpy_htod_async(dst, src, ctx.stream).map_err(driver_err("restoring compressor slots"))?;
                }
            }
            ctx.sync()?;
        }
        let t = fresh_tag();
        state.sync = t;
        self.tag = t;
        self.last = None;
        Ok(())
    }
}

#[cfg(test)]
mod prefill_rows_tests {
    use super::{prefill_rows, N_MAX, P_DEFAULT};

    /// The setting's range, ds4_route's shared memory (Flash's router, 6 of 256 experts: 256
    /// rows take 50 KB).
    #[test]
    fn prefill_rows_follow_the_setting_and_the_router_limits() {
        const SMEM: usize = 227 * 1024;
        assert_eq!(prefill_rows(None, 6, 256, SMEM).unwrap(), P_DEFAULT);
        assert_eq!(P_DEFAULT, 1024);
        assert_eq!(prefill_rows(Some(" 256 "), 6, 256, SMEM).unwrap(), 256);
        assert_eq!(prefill_rows(Some("512"), 6, 256, SMEM).unwrap(), 512);
        assert_eq!(prefill_rows(Some("128"), 6, 256, SMEM).unwrap(), 128);
        // The default takes the most that fit: 224 rows in 48 KB.
        assert_eq!(prefill_rows(None, 6, 256, 48 * 1024).unwrap(), 224);
        assert_eq!(prefill_rows(Some("16"), 6, 256, SMEM).unwrap(), 16);
        assert_eq!(prefill_rows(Some("40"), 6, 256, SMEM).unwrap(), 40);
        assert_eq!(prefill_rows(Some("1024"), 6, 256, SMEM).unwrap(), 1024);
        for bad in ["15", "1025", "0", "x", "-64"] {
            assert!(prefill_rows(Some(bad), 6, 256, SMEM).is_err(), "{bad}");
        }
        // The words of 256 rows of 6 of 256 experts: 16 rows of scores, 12 ints a row for its
        // pairs, per expert 2 x 8 for its row bitmap and prefix counts and 2 more (one past the
        // last), 4 per slot (256 slots), one more.
        assert_eq!(
            super::program::route_smem(256, 6, 256),
            4 * (16 * 256 + 256 * 12 + 256 * (16 + 2) + 1 + 4 * 256 + 1)
        );
        // 1024 rows (the most, P_MAX): 137224 bytes, within an H200's 227 KB a block.
        assert_eq!(super::program::route_smem(1024, 6, 256), 137224);
        // 512 rows: 79880 bytes, within an H200's 227 KB a block; one row fewer in 78 KB.
        assert_eq!(super::program::route_smem(512, 6, 256), 79880);
        assert_eq!(prefill_rows(None, 6, 256, 78 * 1024).unwrap(), 511);
        // The largest row count that fits 48 KB (no opt-in): 224 rows of Flash's router, 32 of
        // 16 experts a row of 1024 (scores of 4 rows, 32 words a row, then 2 x 1024 + 2 x 1024
        // + 1 words, 4 per slot, one more).
        assert_eq!(prefill_rows(Some("256"), 6, 256, 48 * 1024).unwrap(), 224);
        assert_eq!(prefill_rows(Some("256"), 16, 1024, 48 * 1024).unwrap(), 32);
        // Never below a verify's rows.
        assert_eq!(prefill_rows(Some("256"), 16, 1024, 1024).unwrap(), N_MAX);
    }

    /// A prompt's routed products: the rows of a product kernel, nothing else.
    #[test]
    fn expert_chunks_are_product_kernel_rows() {
        use super::program::expert_chunk;
        assert_eq!(expert_chunk(None).unwrap(), 4);
        for c in [1, 2, 4, 8, 16] {
            assert_eq!(expert_chunk(Some(&c.to_string())).unwrap(), c);
        }
        for bad in ["0", "3", "32", "four"] {
            assert!(expert_chunk(Some(bad)).is_err(), "{bad}");
        }
    }

    /// The routed tensor-core kernels' warp tiles: the first unless another built one is named;
    /// each tile's rows of outputs and of x are its m16 and n8 tiles'.
    #[test]
    fn gx_tiles_are_the_built_ones() {
        use super::program::{gx_tile, GxTile, GX_TILES};
        assert_eq!(gx_tile(None).unwrap(), GX_TILES[0]);
        assert_eq!(gx_tile(Some("")).unwrap(), GX_TILES[0]);
        for (i, t) in GX_TILES.iter().enumerate() {
            assert_eq!(gx_tile(Some(&format!(" {}x{} ", t.m, t.n))).unwrap(), *t);
            assert_eq!(t.index(), i);
        }
        assert_eq!((GX_TILES[0].warp_rows(), GX_TILES[0].max_rows()), (32, 32));
        assert_eq!((GX_TILES[1].warp_rows(), GX_TILES[1].max_rows()), (32, 16));
        assert_eq!(GxTile { m: 1, n: 4 }.warp_rows(), 16);
        for bad in ["1x4", "4x4", "2", "2x", "x2", "big"] {
            assert!(gx_tile(Some(bad)).is_err(), "{bad}");
        }
    }

    /// A prompt's product bands: on unless turned off; whole row blocks, at most the matrix; about
    /// BAND_BLOCKS blocks for all the descriptors of a band; none for a single descriptor.
    #[test]
    fn product_bands_are_whole_row_blocks() {
        use super::program::{band_rows, bands_setting};
        assert_eq!(bands_setting(None).unwrap(), Some(0));
        assert_eq!(bands_setting(Some("0")).unwrap(), None);
        assert_eq!(bands_setting(Some("1")).unwrap(), Some(0));
        assert_eq!(bands_setting(Some(" 40 ")).unwrap(), Some(40));
        for bad in ["-1", "x", "1.5"] {
            assert!(bands_setting(Some(bad)).is_err(), "{bad}");
        }
        // Flash's o_b at a 256-row step: 16 descriptors of 16 rows, 16 slices, 128 rows a block:
        // two row blocks a band (512 blocks).
        assert_eq!(band_rows(None, 128, 4096, 16, 16), 4096);
        assert_eq!(band_rows(Some(0), 128, 4096, 16, 16), 256);
        assert_eq!(band_rows(Some(0), 128, 4096, 1, 16), 4096);
        assert_eq!(band_rows(Some(0), 64, 100, 16, 64), 64);
        assert_eq!(band_rows(Some(40), 64, 4096, 16, 1), 64);
        assert_eq!(band_rows(Some(200), 64, 150, 4, 1), 150);
    }
}
