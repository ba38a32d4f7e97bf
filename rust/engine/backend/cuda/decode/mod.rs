//! Device-resident decode: the whole forward pass of decode-sized batches (1..=16 rows) on the
//! GPU, with the session's attention state mirrored in device memory.
//!
//! A step uploads the step parameters (position, tokens) and the rows' embeddings, replays the
//! step's *program* (the launches of every layer, built once per batch size and logits choice,
//! so every kernel argument and product descriptor is fixed; captured once as a CUDA graph),
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
//! and order whatever the batch, so a verify of k rows is bitwise k single-row decodes.
//!
//! Kernels: `shaders/cuda/decode_ops.cu` (norms, hyper-connections, query/key finishing,
//! SwiGLU), `decode_attn.cu` (ring and compressor updates, indexer, attention),
//! `decode_moe.cu` (routing, expert gather and combine), `decode_step.cu` (packing, the logits
//! rows' argmax).

#[cfg(test)]
mod tests_attn;
#[cfg(test)]
mod tests_moe;
#[cfg(test)]
mod tests_ops;
#[cfg(test)]
mod tests_step;
#[cfg(test)]
mod testutil;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::context::{driver_err, Context, BATCH_SIZES, MAX_BATCH, THREADS};
use super::device::{Arg, DevBuf};
use super::weights::DeviceImage;
use super::{chunk_rows, group, row_blocks, slices, split_in_launch, CudaBackend, Desc};
use crate::backend::{DeviceDecoder, Greedy};
use crate::model::config::AttentionKind;
use crate::model::draft::DraftKind;
use crate::model::forward::mean_of_streams;
use crate::model::weights::{HyperWeights, Mat, Router};
use crate::model::{Logits, Model};
use crate::state::{BatchLog, KvPrecision, State};
use crate::{Error, Result};

/// Rows of a step: one product chunk of the matrix kernels.
const N_MAX: usize = MAX_BATCH;

/// Most rows of one routed-expert product: the kernels for few rows read the weights much
/// faster per row (IQ2_XXS at 16 rows runs at a fifth of its one-row speed), and in a batch
/// most experts serve one or two rows.
const EXPERT_CHUNK: usize = 2;

/// Threads of a one-block-per-row kernel over rows of `width` floats: a whole row is read by
/// one block, so wide rows get the most threads.
fn wide(width: usize) -> u32 {
    if width >= 4096 {
        1024
    } else if width >= 1024 {
        512
    } else {
        256
    }
}

/// Blocks per row of the attention's two launches (decode_attn.cu section 5): groups of
/// `DS4_ATTN_HEADS` = 8 heads, times `lg_stride` keys in chunks of `DS4_ATTN_KEYS` = 64 for
/// `ds4_attention_logits` and `head_dim` columns in slices of `DS4_ATTN_COLS` = 32 for
/// `ds4_attention`; both launch 256 threads (`DS4_ATTN_THREADS`).
fn attention_blocks(n_heads: usize, head_dim: usize, lg_stride: usize) -> Result<(u32, u32)> {
    let groups = n_heads.div_ceil(8);
    let blocks =
        |x: usize| u32::try_from(x).map_err(|_| Error::Backend("CUDA decode: attention grid too large".into()));
    Ok((blocks(groups * lg_stride.div_ceil(64))?, blocks(groups * head_dim.div_ceil(32))?))
}

/// Threads of `ds4_argmax_rows` (one block per logits row).
const ARGMAX_THREADS: u32 = 1024;

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

/// A kernel argument of a program: a plain argument, or an offset in the program's table of
/// product descriptors (its device address is known once the table is uploaded).
#[derive(Clone, Copy, Debug)]
enum PArg {
    A(Arg),
    Table(usize),
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

/// One kernel launch of a program. `A` is [`Arg`] in a built program and [`PArg`] while it is
/// being built (descriptor table offsets not yet resolved).
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
    /// What comes after waits for the side branch's launches.
    Join,
}

/// The side branch of the decode's programs: a second stream that forks from the context's
/// stream at each [`Op::Side`] and joins it at each [`Op::Join`] (in a captured graph, a
/// parallel branch). It runs the hyper-connections' Sinkhorn iterations (ds4_hc_sinkhorn),
/// which only the site's expansion reads, while the sublayer runs, and the FFN's shared
/// expert beside the router and the routed experts; with `DS4_CUDA_FORK=0` the iterations run
/// inside ds4_hc_pre (the same operations: the results are bitwise equal, which
/// `hc_pre_matches_cpu` and test_cuda.py check) and the shared expert in line. A Flash decode
/// step at 2K on an H200, both ways in one run: 11.87 ms without the branch, 11.12 ms with it.
/// (The compressors' and indexer's projections and updates on it too, beside the query path,
/// measured 11.32 ms against 10.99 in one run: not kept.) The decoder's drop destroys the
/// branch while its context lives (a session may outlive its model).
struct SideBranch {
    stream: sys::CUstream,
    fork: sys::CUevent,
    join: sys::CUevent,
}

impl SideBranch {
    /// With the context bound on this thread.
    fn new() -> Result<Self> {
        let ev =
            || cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(driver_err("creating an event"));
        let stream =
            cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(driver_err("creating a stream"))?;
        let mut side = SideBranch { stream, fork: std::ptr::null_mut(), join: std::ptr::null_mut() };
        side.fork = ev()?;
        side.join = ev()?;
        Ok(side)
    }
}

impl Drop for SideBranch {
    fn drop(&mut self) {
        // SAFETY: created by `new` on the context the decoder binds before dropping its parts;
        // each destroyed once (null when its creation failed).
        unsafe {
            for e in [self.fork, self.join] {
                if !e.is_null() {
                    cu::event::destroy(e).ok();
                }
            }
            cu::stream::synchronize(self.stream).ok();
            cu::stream::destroy(self.stream).ok();
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
    y: DevBuf,
    logits: DevBuf,
    /// The argmax of each logits row (u32), for the programs that end with it.
    ids: DevBuf,
    part: DevBuf,
    part_floats: usize,
    counters: DevBuf,
    counters_len: usize,
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
    hc_post: sys::CUfunction,
    hc_sinkhorn: sys::CUfunction,
    hc_head: sys::CUfunction,
    finish_rows: sys::CUfunction,
    swiglu: sys::CUfunction,
    compress: sys::CUfunction,
    index_scores: sys::CUfunction,
    index_topk: sys::CUfunction,
    attention_logits: sys::CUfunction,
    attention: sys::CUfunction,
    route: sys::CUfunction,
    gather: sys::CUfunction,
    combine: sys::CUfunction,
    pack: sys::CUfunction,
    argmax: sys::CUfunction,
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
            hc_post: f("ds4_hc_post")?,
            hc_sinkhorn: f("ds4_hc_sinkhorn")?,
            hc_head: f("ds4_hc_head")?,
            finish_rows: f("ds4_finish_rows")?,
            swiglu: f("ds4_swiglu")?,
            compress: f("ds4_compress")?,
            index_scores: f("ds4_index_scores")?,
            index_topk: f("ds4_index_topk")?,
            attention_logits: f("ds4_attention_logits")?,
            attention: f("ds4_attention")?,
            route: f("ds4_route")?,
            gather: f("ds4_gather")?,
            combine: f("ds4_moe_combine")?,
            pack: f("ds4_pack")?,
            argmax: f("ds4_argmax_rows")?,
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
    /// each requested row comes back instead of its logits).
    programs: HashMap<(usize, u8, bool), Program>,
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
}

// SAFETY: the raw handles (functions, graphs, pinned pointers) are only used by the thread
// that holds the decoder, with the backend's context bound and its lock held.
unsafe impl Send for CudaDecoder {}

impl Drop for CudaDecoder {
    fn drop(&mut self) {
        let g = self.backend.lock();
        if g.ctx.bind().is_ok() {
            g.ctx.sync().ok();
            for p in self.programs.values_mut() {
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
            counters += n.div_ceil(chunk_rows(w.ty, w.n_in)) * row_blocks(w);
        }
    }
    (part, counters)
}

impl CudaBackend {
    /// Whether every matrix the device decoder multiplies by runs on the GPU.
    fn decodable(&self, model: &Model) -> bool {
        let g = self.lock();
        let Some(img) = g.images.iter().find(|i| i.is(model.file.raw())) else { return false };
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
    if std::env::var("DS4_DEVICE_DECODE").is_ok_and(|v| v == "0") {
        return None;
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

impl CudaDecoder {
    fn new(backend: Arc<CudaBackend>, model: &Model, ctx_len: usize, round_mode: i32) -> Result<Self> {
        let g = backend.lock();
        g.ctx.bind()?;
        let k = Kernels::load(&g.ctx)?;
        drop(g);
        let cfg = &model.config;
        let w = &model.weights;
        let (d, hc, hd) = (cfg.hidden, cfg.hc_mult, cfg.head_dim);
        let consts = w
            .layers
            .iter()
            .zip(&model.ropes)
            .map(|(l, rope)| -> Result<LayerConsts> {
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
                        Some(i) => {
                            Some((DevBuf::from_slice(&i.compressor.ape)?, DevBuf::from_slice(&i.compressor.norm)?))
                        }
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
            })
            .collect::<Result<Vec<_>>>()?;
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
            let slots = cfg.window + crate::spec::MAX_DRAFT + 1;
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
                    backup: if overlap { Some(f32_buf(N_MAX * 2 * ratio * width)?) } else { None },
                    rows: f32_buf(cap * width)?,
                    cap,
                    log_kv: f32_buf(N_MAX * pw)?,
                    log_g: f32_buf(N_MAX * pw)?,
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

        // Partial sums and counters: the most any launch group needs at 16 rows.
        let kk = cfg.n_experts_used;
        let max_descs = N_MAX * kk;
        let (mut part_floats, mut counters_len) = (0usize, 0usize);
        let mut need = |mats: &[Mat], n: usize| {
            let (p, c) = split_need(mats, n);
            part_floats = part_floats.max(p);
            counters_len = counters_len.max(c);
        };
        for l in &w.layers {
            need(&[l.hc_attn.proj], N_MAX);
            need(&[l.q_a, l.kv], N_MAX);
            // q_b with the compressors' and indexer's products (as `build` groups them).
            let mut g2 = vec![l.q_b];
            if let Some(c) = &l.compressor {
                g2.extend([c.kv, c.gate]);
            }
            if let Some(i) = &l.indexer {
                g2.extend([i.proj, i.compressor.kv, i.compressor.gate, i.q_b]);
            }
            need(&g2, N_MAX);
            let oa = Mat { n_out: cfg.o_lora_rank, ..l.o_a };
            need(&vec![oa; cfg.o_groups], N_MAX);
            need(&[l.o_b], N_MAX);
            need(&[l.hc_ffn.proj], N_MAX);
            need(&[l.router_proj, l.gate_sh, l.up_sh], N_MAX);
            need(&[l.down_sh], N_MAX);
            let gu = [vec![l.gate_exps.first; max_descs], vec![l.up_exps.first; max_descs]].concat();
            need(&gu, N_MAX);
            need(&vec![l.down_exps.first; max_descs], N_MAX);
        }
        need(&[w.hc_head.proj], N_MAX);
        need(&[w.output], N_MAX);

        let l0 = &w.layers[0];
        let ff = l0.gate_exps.first.n_out;
        let ff_sh = l0.gate_sh.n_out;
        let n_mix = (2 + hc) * hc;
        let capture_layers = match model.draft.as_ref().map(|dm| &dm.kind) {
            Some(DraftKind::DSpark(w)) => w.target_layers.len(),
            _ => 0,
        };
        let journal_floats = Self::journal_floats(cfg, N_MAX);
        let bufs = Bufs {
            step: DevBuf::zeroed(4 * (2 + N_MAX))?,
            x: f32_buf(N_MAX * hc * d)?,
            flat: f32_buf(N_MAX * hc * d)?,
            mixl: f32_buf(N_MAX * n_mix)?,
            mix_a: f32_buf(N_MAX * (hc + hc * hc))?,
            mix_f: f32_buf(N_MAX * (hc + hc * hc))?,
            h: f32_buf(N_MAX * d)?,
            cq: f32_buf(N_MAX * cfg.q_lora_rank)?,
            kv: f32_buf(N_MAX * hd)?,
            ig: f32_buf(N_MAX * cfg.index_heads.max(1))?,
            q: f32_buf(N_MAX * cfg.n_heads * hd)?,
            iq: f32_buf(N_MAX * cfg.index_heads.max(1) * cfg.index_head_dim.max(1))?,
            scores: f32_buf(N_MAX * score_stride)?,
            score_stride,
            sel: DevBuf::zeroed(4 * N_MAX * cfg.index_topk.max(1))?,
            nsel: DevBuf::zeroed(4 * N_MAX)?,
            lg: f32_buf(N_MAX * cfg.n_heads * max_keys)?,
            o: f32_buf(N_MAX * cfg.n_heads * hd)?,
            u: f32_buf(N_MAX * cfg.o_groups * cfg.o_lora_rank)?,
            attn_out: f32_buf(N_MAX * d)?,
            rl: f32_buf(N_MAX * cfg.n_experts)?,
            gsh: f32_buf(N_MAX * ff_sh)?,
            ush: f32_buf(N_MAX * ff_sh)?,
            ash: f32_buf(N_MAX * ff_sh)?,
            dsh: f32_buf(N_MAX * d)?,
            xg: f32_buf(N_MAX * kk * d)?,
            g_out: f32_buf(N_MAX * kk * ff)?,
            u_out: f32_buf(N_MAX * kk * ff)?,
            act: f32_buf(N_MAX * kk * ff)?,
            down_out: f32_buf(N_MAX * kk * d)?,
            gather_src: DevBuf::zeroed(4 * N_MAX * kk)?,
            comb_slot: DevBuf::zeroed(4 * N_MAX * kk)?,
            comb_w: f32_buf(N_MAX * kk)?,
            comb_cnt: DevBuf::zeroed(4 * N_MAX)?,
            y: f32_buf(N_MAX * d)?,
            logits: f32_buf(N_MAX * cfg.vocab)?,
            ids: DevBuf::zeroed(4 * N_MAX)?,
            part: f32_buf(part_floats)?,
            part_floats,
            counters: DevBuf::zeroed(4 * counters_len.max(1))?,
            counters_len,
            capture: f32_buf(capture_layers.max(1) * N_MAX * hc * d)?,
            runs: DevBuf::zeroed(std::mem::size_of::<CopyRun>() * Self::journal_runs(cfg, N_MAX))?,
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
            use_graphs: !std::env::var("DS4_CUDA_GRAPHS").is_ok_and(|v| v == "0"),
            device_argmax: !std::env::var("DS4_CUDA_ARGMAX").is_ok_and(|v| v == "0"),
            profile: std::env::var("DS4_DECODE_PROFILE").is_ok_and(|v| v == "1").then(KernelProfile::default),
            resync_after_cut: std::env::var("DS4_DECODE_RESYNC").is_ok_and(|v| v == "1"),
            side: if std::env::var("DS4_CUDA_FORK").is_ok_and(|v| v == "0") { None } else { Some(SideBranch::new()?) },
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

    // ------------------------------------------------------------------ programs

    /// Builds the program of a step of `n` rows whose head runs on `head` = (first row, rows),
    /// followed by the argmax of each of those logits rows when `argmax`.
    fn build(
        &self,
        ctx: &Context,
        img: &DeviceImage,
        model: &Model,
        n: usize,
        head: Option<(usize, usize)>,
        argmax: bool,
    ) -> Result<Program> {
        let cfg = &model.config;
        let w = &model.weights;
        let b = &self.bufs;
        let k = &self.k;
        let (d, hc, hd, nh) = (cfg.hidden, cfg.hc_mult, cfg.head_dim, cfg.n_heads);
        let n_mix = (2 + hc) * hc;
        let step = b.step.ptr;
        let mut ops: Vec<Op<PArg>> = Vec::new();
        let mut table: Vec<u8> = Vec::new();
        let nn = n as u32;
        let p = |x: u64| PArg::A(Arg::Ptr(x));
        let i = |x: usize| PArg::A(Arg::I32(x as i32));
        let fl = |x: f32| PArg::A(Arg::F32(x));
        let null = PArg::A(Arg::Ptr(0));
        let fork = self.side.is_some();
        let launch =
            |ops: &mut Vec<_>, f: sys::CUfunction, grid: (u32, u32, u32), block: u32, smem: u32, args: Vec<PArg>| {
                ops.push(Op::Launch(Launch { f, grid, block, smem, args, label: String::new() }));
            };
        // Products: (matrix, x, y, rows), y's rows `y_stride` floats apart (None: n_out). One
        // launch per format; partial sums and counters laid out from 0 for each call (launches
        // of different calls never overlap).
        let products_strided = |ops: &mut Vec<_>,
                                table: &mut Vec<u8>,
                                prods: &[(Mat, u64, u64, usize)],
                                y_stride: Option<usize>|
         -> Result<()> {
            let mut part_off = 0usize;
            let mut counter = 0usize;
            // One launch per kernel: (format, stem), in call order.
            let stem_of = |m: &Mat| super::context::stem(m.ty, m.n_in);
            let mut kernels: Vec<(crate::quant::GgmlType, Option<&'static str>)> = Vec::new();
            for pr in prods {
                if !kernels.contains(&(pr.0.ty, stem_of(&pr.0))) {
                    kernels.push((pr.0.ty, stem_of(&pr.0)));
                }
            }
            for (ty, stem) in kernels {
                let mine = |pr: &&(Mat, u64, u64, usize)| pr.0.ty == ty && stem_of(&pr.0) == stem;
                if crate::quant::act8::takes_act8(ty) {
                    // `decodable` keeps such weights to the routed experts.
                    return Err(Error::Backend(format!("CUDA decode: a dense {ty} product (internal)")));
                }
                let start = table.len();
                let mut blocks = 0usize;
                let mut count = 0usize;
                let mut nmax = 1;
                // Strided outputs are the o_a groups: products of one shape that share the
                // launch's row blocks (split_in_launch).
                let launch_rows: usize = prods.iter().filter(mine).map(|pr| pr.0.n_out).sum();
                for &(m, x, y, rows) in prods.iter().filter(mine) {
                    let ys = y_stride.unwrap_or(m.n_out);
                    let split =
                        if y_stride.is_some() { split_in_launch(&m, launch_rows) } else { (group(&m), slices(&m)) };
                    let mut r0 = 0;
                    while r0 < rows {
                        let c = (rows - r0).min(chunk_rows(ty, m.n_in));
                        let part = b.part.ptr + 4 * part_off as u64;
                        let (xc, yc) = (x + 4 * (r0 * m.n_in) as u64, y + 4 * (r0 * ys) as u64);
                        let (mut dsc, nblocks) =
                            CudaBackend::desc_split(img.addr(m.start), &m, xc, yc, part, c, counter, split);
                        dsc.block_start = blocks as i32;
                        dsc.y_stride = ys as i32;
                        // Only split products use partial sums and counters.
                        let s = split.1;
                        if s > 1 {
                            part_off += s * c * m.n_out;
                            counter += nblocks / s;
                        }
                        blocks += nblocks;
                        count += 1;
                        nmax = nmax.max(c);
                        table.extend_from_slice(desc_bytes(&dsc));
                        r0 += c;
                    }
                }
                if part_off > b.part_floats || counter > b.counters_len {
                    return Err(Error::Backend("CUDA decode: partial-sum buffer too small (internal)".into()));
                }
                let (f, smem) = stem
                    .and_then(|st| ctx.kernel_named(st, BATCH_SIZES.iter().copied().find(|&b| b >= nmax)?))
                    .ok_or_else(|| Error::Backend("CUDA: no product kernel".into()))?;
                ops.push(Op::Launch(Launch {
                    f,
                    grid: (blocks as u32, 1, 1),
                    block: THREADS,
                    smem,
                    // Early (common.cuh ds4_grid_launch): the table is the program's, written once,
                    // and the weights are the model's.
                    args: vec![
                        PArg::Table(start),
                        PArg::A(Arg::I32(count as i32)),
                        PArg::A(Arg::Ptr(b.counters.ptr)),
                        PArg::A(Arg::I32(1)),
                    ],
                    label: {
                        let mut shapes: Vec<(usize, usize, usize)> = Vec::new();
                        for pr in prods.iter().filter(mine) {
                            match shapes.iter_mut().find(|s| (s.0, s.1) == (pr.0.n_out, pr.0.n_in)) {
                                Some(s) => s.2 += 1,
                                None => shapes.push((pr.0.n_out, pr.0.n_in, 1)),
                            }
                        }
                        let parts: Vec<String> = shapes
                            .iter()
                            .map(|&(o, i, c)| if c > 1 { format!("{c}x[{o}x{i}]") } else { format!("{o}x{i}") })
                            .collect();
                        parts.join(",")
                    },
                }));
            }
            Ok(())
        };
        let products = |ops: &mut Vec<_>, table: &mut Vec<u8>, prods: &[(Mat, u64, u64, usize)]| {
            products_strided(ops, table, prods, None)
        };
        let g1 = (nn, 1, 1);
        let rows_grid = |blocks_x: usize| (blocks_x as u32, nn, 1);
        let capture: Vec<usize> = match model.draft.as_ref().map(|dm| &dm.kind) {
            Some(DraftKind::DSpark(w)) => w.target_layers.clone(),
            _ => Vec::new(),
        };
        let ff = w.layers[0].gate_exps.first.n_out;
        let ff_sh = w.layers[0].gate_sh.n_out;
        let kk = cfg.n_experts_used;
        // Routed expert products: each expert's rows in chunks of at most `chunk` rows (see
        // ds4_route), at most one descriptor per (row, expert) pair.
        let chunk = n.min(EXPERT_CHUNK);
        let max_descs = if chunk >= n { (n * kk).min(cfg.n_experts) } else { n * kk };

        for (li, (lw, spec)) in w.layers.iter().zip(&cfg.layers).enumerate() {
            let c = &self.consts[li];
            let mm = &self.mirror[li];
            let hc_site = |ops: &mut Vec<_>,
                           table: &mut Vec<u8>,
                           hw: &HyperWeights,
                           base_scale: &(DevBuf, DevBuf),
                           mix: u64,
                           norm: u64|
             -> Result<()> {
                // The mixing logits of the raw streams; ds4_hc_pre applies their RMS scale.
                // (Tried and dropped: the kernels that write the streams (ds4_hc_post,
                // ds4_moe_combine) leaving each block's partial products with this projection,
                // summed by ds4_hc_pre, with no product launch here. It held 96 F16 weights a
                // thread in those kernels (230 registers) and made Flash steps slower on an
                // H200: 10.24 against 9.81 ms at a 2100-token context, interleaved A/B.)
                products(ops, table, &[(hw.proj, b.x.ptr, b.mixl.ptr, n)])?;
                launch(
                    ops,
                    k.hc_pre,
                    g1,
                    wide(d),
                    0,
                    vec![
                        p(b.mixl.ptr),
                        i(n_mix),
                        p(b.x.ptr),
                        p(b.h.ptr),
                        p(mix),
                        p(base_scale.0.ptr),
                        p(base_scale.1.ptr),
                        i(hc),
                        i(d),
                        fl(cfg.hc_eps),
                        i(if fork { 0 } else { cfg.sinkhorn_iters }),
                        p(norm),
                        fl(cfg.rms_eps),
                    ],
                );
                if fork {
                    ops.push(Op::Side(Launch {
                        f: k.hc_sinkhorn,
                        grid: g1,
                        block: 32,
                        smem: 0,
                        args: vec![p(mix), i(hc), fl(cfg.hc_eps), i(cfg.sinkhorn_iters)],
                        label: String::new(),
                    }));
                }
                Ok(())
            };
            // ---- attention
            hc_site(&mut ops, &mut table, &lw.hc_attn, &c.hc_attn, b.mix_a.ptr, c.attn_norm.ptr)?;
            products(&mut ops, &mut table, &[(lw.q_a, b.h.ptr, b.cq.ptr, n), (lw.kv, b.h.ptr, b.kv.ptr, n)])?;
            launch(
                &mut ops,
                k.rms_weight,
                g1,
                wide(cfg.q_lora_rank),
                0,
                vec![p(b.cq.ptr), p(b.cq.ptr), p(c.q_a_norm.ptr), i(cfg.q_lora_rank), fl(cfg.rms_eps)],
            );
            // After q_b (which needs only q_a and its norm), in one call: the compressors' and
            // indexer's products (F16 in ds4's layout), which finish_rows and the compressors
            // need. With q_a, as they were, they held the query path back and took a launch of
            // their own (on an H200, a Flash CSA layer's F16 products ran 14.8 us between q_a
            // and its norm, and the indexer's q_b 8.3 us after q_b); here they take 19 us after
            // q_b, one launch less a CSA layer for about the same step (steps in a row at a
            // 2100-token context, interleaved A/B: 10.24 ms against 10.28 with them with q_a). The
            // compressors' projections go to the layer's own buffers, which the compressor reads
            // and the journal packs for the host's replay of the step. (A layer has compressor
            // weights exactly when its mirror has a compressor, and indexer weights exactly when
            // it has an indexer: see `decoder_for`.)
            let mut g = vec![(lw.q_b, b.cq.ptr, b.q.ptr, n)];
            if let (Some(cw), Some(cm)) = (&lw.compressor, &mm.comp) {
                g.extend([(cw.kv, b.h.ptr, cm.log_kv.ptr, n), (cw.gate, b.h.ptr, cm.log_g.ptr, n)]);
            }
            if let (Some(iw), Some(im)) = (&lw.indexer, &mm.index) {
                g.extend([
                    (iw.proj, b.h.ptr, b.ig.ptr, n),
                    (iw.compressor.kv, b.h.ptr, im.log_kv.ptr, n),
                    (iw.compressor.gate, b.h.ptr, im.log_g.ptr, n),
                    (iw.q_b, b.cq.ptr, b.iq.ptr, n),
                ]);
            }
            products(&mut ops, &mut table, &g)?;
            let rope_dim = cfg.rope_dim;
            // Query heads, the K=V row (then its ring slot) and the indexer heads: one launch.
            let ih = if lw.indexer.is_some() { cfg.index_heads } else { 0 };
            launch(
                &mut ops,
                k.finish_rows,
                ((nh + 1 + ih) as u32, nn, 1),
                128,
                0,
                vec![
                    p(b.q.ptr),
                    i(nh),
                    i(hd),
                    fl(cfg.rms_eps),
                    p(c.inv_freq.ptr),
                    i(rope_dim),
                    p(step),
                    p(b.kv.ptr),
                    p(c.kv_norm.ptr),
                    i(self.round_mode as usize),
                    p(mm.ring.ptr),
                    i(mm.slots),
                    p(b.iq.ptr),
                    p(b.ig.ptr),
                    i(ih),
                    i(cfg.index_head_dim),
                    fl(1.0 / (cfg.index_heads.max(1) as f32).sqrt()),
                ],
            );
            let compress = |ops: &mut Vec<_>, cm: &CompMirror, cc: &(DevBuf, DevBuf)| {
                launch(
                    ops,
                    k.compress,
                    (1, 1, 1),
                    256,
                    0,
                    vec![
                        p(cm.log_kv.ptr),
                        p(cm.log_g.ptr),
                        p(cc.0.ptr),
                        p(cc.1.ptr),
                        fl(cfg.rms_eps),
                        p(cm.cur_kv.ptr),
                        p(cm.cur_score.ptr),
                        cm.prev.as_ref().map_or(null, |b| p(b.ptr)),
                        cm.backup.as_ref().map_or(null, |b| p(b.ptr)),
                        p(cm.rows.ptr),
                        i(cm.width),
                        i(cm.ratio),
                        i(cm.overlap as usize),
                        p(c.inv_freq.ptr),
                        i(rope_dim),
                        i(self.round_mode as usize),
                        i(n),
                        p(step),
                    ],
                );
            };
            if let (Some(cm), Some(cc)) = (&mm.comp, &c.comp) {
                compress(&mut ops, cm, cc);
            }
            if let (Some(im), Some(ic)) = (&mm.index, &c.index) {
                compress(&mut ops, im, ic);
                launch(
                    &mut ops,
                    k.index_scores,
                    (132, nn, 1),
                    256,
                    0,
                    vec![
                        p(b.iq.ptr),
                        p(b.ig.ptr),
                        p(im.rows.ptr),
                        i(cfg.index_heads),
                        i(cfg.index_head_dim),
                        i(spec.ratio),
                        i(cfg.index_topk),
                        p(b.scores.ptr),
                        i(b.score_stride),
                        p(step),
                    ],
                );
                launch(
                    &mut ops,
                    k.index_topk,
                    g1,
                    1024,
                    0,
                    vec![
                        p(b.scores.ptr),
                        i(b.score_stride),
                        i(spec.ratio),
                        i(cfg.index_topk),
                        p(b.sel.ptr),
                        p(b.nsel.ptr),
                        p(step),
                    ],
                );
            }
            let (crows, ratio, sel, nsel) = match (&mm.comp, &mm.index) {
                (Some(cm), Some(_)) => (cm.rows.ptr, cm.ratio, b.sel.ptr, b.nsel.ptr),
                (Some(cm), None) => (cm.rows.ptr, cm.ratio, 0, 0),
                _ => (0, 1, 0, 0),
            };
            let lgs = mm.max_keys(cfg.window, cfg.index_topk);
            let (logit_blocks, out_blocks) = attention_blocks(nh, hd, lgs)?;
            // The keys of each row, as both kernels take them.
            let keys =
                [p(mm.ring.ptr), i(mm.slots), i(cfg.window), p(crows), i(ratio), p(sel), p(nsel), i(cfg.index_topk)];
            launch(
                &mut ops,
                k.attention_logits,
                (logit_blocks, nn, 1),
                256,
                0,
                [vec![p(b.q.ptr)], keys.to_vec(), vec![i(nh), i(hd), p(b.lg.ptr), i(lgs), p(step)]].concat(),
            );
            launch(
                &mut ops,
                k.attention,
                (out_blocks, nn, 1),
                256,
                0,
                [
                    vec![p(b.lg.ptr), i(lgs)],
                    keys.to_vec(),
                    vec![
                        p(c.sinks.ptr),
                        i(nh),
                        i(hd),
                        p(b.o.ptr),
                        i(cfg.o_groups),
                        p(c.inv_freq.ptr),
                        i(rope_dim),
                        p(step),
                    ],
                ]
                .concat(),
            );
            // Each group's product fills its rank columns of u's rows [n, groups * rank].
            let (groups, rank) = (cfg.o_groups, cfg.o_lora_rank);
            let gin = nh * hd / groups;
            let oa: Vec<(Mat, u64, u64, usize)> = (0..groups)
                .map(|gi| {
                    let m = Mat { n_out: rank, start: lw.o_a.start + gi * rank * lw.o_a.row_bytes, ..lw.o_a };
                    (m, b.o.ptr + 4 * (gi * n * gin) as u64, b.u.ptr + 4 * (gi * rank) as u64, n)
                })
                .collect();
            products_strided(&mut ops, &mut table, &oa, Some(groups * rank))?;
            products(&mut ops, &mut table, &[(lw.o_b, b.u.ptr, b.attn_out.ptr, n)])?;
            // The attention site's hyper-connection expansion of x (the FFN site's is fused
            // into ds4_moe_combine).
            let args = vec![p(b.x.ptr), p(b.attn_out.ptr), p(b.mix_a.ptr), i(hc), i(d)];
            if fork {
                ops.push(Op::Join);
            }
            launch(&mut ops, k.hc_post, rows_grid(d.div_ceil(256)), 256, 0, args);

            // ---- MoE
            hc_site(&mut ops, &mut table, &lw.hc_ffn, &c.hc_ffn, b.mix_f.ptr, c.ffn_norm.ptr)?;
            // The shared expert (its products, its swiglu) reads only h and its own buffers,
            // and only ds4_moe_combine reads its output: with the side branch it runs there,
            // beside the router and the routed experts, whose kernels leave DRAM bandwidth
            // unused (they are bound by issue and L1). Its products must not be split
            // (slices > 1): the partial sums and counters belong to the main stream's launches.
            let shared_side = fork && [lw.gate_sh, lw.up_sh, lw.down_sh].iter().all(|m| slices(m) == 1);
            let shared_swiglu = |ops: &mut Vec<_>| {
                launch(
                    ops,
                    k.swiglu,
                    ((n * ff_sh).div_ceil(256) as u32, 1, 1),
                    256,
                    0,
                    vec![p(b.gsh.ptr), p(b.ush.ptr), p(b.ash.ptr), i(n * ff_sh), fl(spec.clamp_shared), i(ff_sh), i(0)],
                )
            };
            let gate_up_sh = [(lw.gate_sh, b.h.ptr, b.gsh.ptr, n), (lw.up_sh, b.h.ptr, b.ush.ptr, n)];
            let down_sh = [(lw.down_sh, b.ash.ptr, b.dsh.ptr, n)];
            if shared_side {
                let mut sh = Vec::new();
                products(&mut sh, &mut table, &gate_up_sh)?;
                shared_swiglu(&mut sh);
                products(&mut sh, &mut table, &down_sh)?;
                ops.extend(sh.into_iter().map(|op| match op {
                    Op::Launch(l) => Op::Side(l),
                    other => other,
                }));
                products(&mut ops, &mut table, &[(lw.router_proj, b.h.ptr, b.rl.ptr, n)])?;
            } else {
                let mut g = vec![(lw.router_proj, b.h.ptr, b.rl.ptr, n)];
                g.extend(gate_up_sh);
                products(&mut ops, &mut table, &g)?;
            }
            // Templates of the routed products (ds4_route fills in expert, rows, offsets).
            let templ = |m: Mat, x: u64, y: u64, part_base: usize, counter: usize| {
                CudaBackend::desc(img.addr(m.start), &m, x, y, b.part.ptr + 4 * part_base as u64, 0, counter).0
            };
            let (gm, um, dm) = (lw.gate_exps.first, lw.up_exps.first, lw.down_exps.first);
            // Partial sums only for split products (as `products` lays them out).
            let part_of = |m: &Mat| if slices(m) > 1 { max_descs * slices(m) * chunk * m.n_out } else { 0 };
            let gate_part = part_of(&gm);
            let gate_counters = max_descs * row_blocks(&gm);
            let up_part = part_of(&um);
            let down_part = part_of(&dm);
            if gate_part + up_part > b.part_floats || down_part > b.part_floats {
                return Err(Error::Backend(
                    "CUDA decode: partial-sum buffer too small for the experts (internal)".into(),
                ));
            }
            let t_off = table.len();
            for t in [
                templ(gm, b.xg.ptr, b.g_out.ptr, 0, 0),
                templ(um, b.xg.ptr, b.u_out.ptr, gate_part, gate_counters),
                templ(dm, b.act.ptr, b.down_out.ptr, 0, 0),
            ] {
                table.extend_from_slice(desc_bytes(&t));
            }
            let gu_off = table.len();
            table.resize(gu_off + 2 * max_descs * std::mem::size_of::<Desc>(), 0);
            let down_off = table.len();
            table.resize(down_off + max_descs * std::mem::size_of::<Desc>(), 0);
            launch(
                &mut ops,
                k.route,
                (1, 1, 1),
                256,
                0,
                vec![
                    p(b.rl.ptr),
                    i(cfg.n_experts),
                    i(kk),
                    c.bias.as_ref().map_or(null, |x| p(x.ptr)),
                    c.hash.as_ref().map_or(null, |x| p(x.ptr)),
                    i(cfg.expert_weights_norm as usize),
                    fl(cfg.expert_weights_scale),
                    i(n),
                    p(step),
                    PArg::Table(gu_off),
                    PArg::Table(down_off),
                    i(max_descs),
                    PArg::Table(t_off),
                    p(b.gather_src.ptr),
                    p(b.comb_slot.ptr),
                    p(b.comb_w.ptr),
                    p(b.comb_cnt.ptr),
                    i(chunk),
                ],
            );
            // The gathered rows as 8-bit activations when their gate and up products take them.
            // (Tried and dropped for one row: ds4_route quantizing the row itself and every
            // descriptor reading that copy, with no gather launch. The routing got slower by more
            // than the gather cost: Flash steps at a 2100-token context 10.24 against 10.09 ms,
            // interleaved A/B on an H200.)
            let act8 = crate::quant::act8::takes_act8(gm.ty);
            launch(
                &mut ops,
                k.gather,
                // One warp per block of 32 values (act8) or per 32 float4s (a copy).
                ((n * kk) as u32, d.div_ceil(if act8 { 256 } else { 1024 }) as u32, 1),
                256,
                0,
                vec![p(b.h.ptr), p(b.xg.ptr), p(b.gather_src.ptr), i(d), i(act8 as usize)],
            );
            let bpd = |m: &Mat| row_blocks(m) * slices(m);
            let (fg, sg) =
                ctx.kernel(gm.ty, gm.n_in, chunk).ok_or_else(|| Error::Backend("CUDA: no product kernel".into()))?;
            if um.ty != gm.ty || um.n_out != gm.n_out || um.n_in != gm.n_in {
                return Err(Error::Backend("CUDA decode: expert gate and up differ in shape (unsupported)".into()));
            }
            launch(
                &mut ops,
                fg,
                ((max_descs * (bpd(&gm) + bpd(&um))) as u32, 1, 1),
                THREADS,
                sg,
                // Not early: ds4_route writes this table.
                vec![PArg::Table(gu_off), i(2 * max_descs), p(b.counters.ptr), i(0)],
            );
            if !shared_side {
                shared_swiglu(&mut ops);
            }
            launch(
                &mut ops,
                k.swiglu,
                ((n * kk * ff).div_ceil(256) as u32, 1, 1),
                256,
                0,
                vec![
                    p(b.g_out.ptr),
                    p(b.u_out.ptr),
                    p(b.act.ptr),
                    i(n * kk * ff),
                    fl(spec.clamp_routed),
                    i(ff),
                    // The activations as 8-bit ones when the down products take them (Q2_K).
                    i(crate::quant::act8::takes_act8(dm.ty) as usize),
                ],
            );
            if !shared_side {
                products(&mut ops, &mut table, &down_sh)?;
            }
            let (fd, sd) =
                ctx.kernel(dm.ty, dm.n_in, chunk).ok_or_else(|| Error::Backend("CUDA: no product kernel".into()))?;
            launch(
                &mut ops,
                fd,
                ((max_descs * bpd(&dm)) as u32, 1, 1),
                THREADS,
                sd,
                vec![PArg::Table(down_off), i(max_descs), p(b.counters.ptr), i(0)],
            );
            if fork {
                ops.push(Op::Join);
            }
            launch(
                &mut ops,
                k.combine,
                rows_grid(d.div_ceil(256)),
                256,
                0,
                vec![
                    p(b.down_out.ptr),
                    p(b.comb_slot.ptr),
                    p(b.comb_w.ptr),
                    p(b.comb_cnt.ptr),
                    p(b.dsh.ptr),
                    null,
                    i(kk),
                    i(d),
                    // The FFN site's expansion of x, fused (no separate ds4_hc_post).
                    p(b.x.ptr),
                    p(b.mix_f.ptr),
                    i(hc),
                ],
            );
            if let Some(j) = capture.iter().position(|&c| c == li) {
                let bytes = n * hc * d * 4;
                ops.push(Op::Copy { dst: b.capture.ptr + (j * N_MAX * hc * d * 4) as u64, src: b.x.ptr, bytes });
            }
        }

        // ---- head
        if let Some((r0, rows)) = head {
            let xr = b.x.ptr + 4 * (r0 * hc * d) as u64;
            let gr = (rows as u32, 1, 1);
            let (norm, base, scale) = &self.head_consts;
            launch(&mut ops, k.rms_plain, gr, wide(hc * d), 0, vec![p(xr), p(b.flat.ptr), i(hc * d), fl(cfg.rms_eps)]);
            products(&mut ops, &mut table, &[(w.hc_head.proj, b.flat.ptr, b.mixl.ptr, rows)])?;
            launch(
                &mut ops,
                k.hc_head,
                gr,
                wide(d),
                0,
                vec![p(b.mixl.ptr), p(xr), p(b.y.ptr), p(base.ptr), p(scale.ptr), i(hc), i(d), fl(cfg.hc_eps)],
            );
            launch(
                &mut ops,
                k.rms_weight,
                gr,
                wide(d),
                0,
                vec![p(b.y.ptr), p(b.y.ptr), p(norm.ptr), i(d), fl(cfg.rms_eps)],
            );
            products(&mut ops, &mut table, &[(w.output, b.y.ptr, b.logits.ptr, rows)])?;
            if argmax {
                launch(&mut ops, k.argmax, gr, ARGMAX_THREADS, 0, vec![p(b.logits.ptr), i(cfg.vocab), p(b.ids.ptr)]);
            }
        }

        let tables = DevBuf::from_slice(&table)?;
        let resolve = |a: PArg| match a {
            PArg::A(a) => a,
            PArg::Table(off) => Arg::Ptr(tables.ptr + off as u64),
        };
        let ops = ops
            .into_iter()
            .map(|op| match op {
                Op::Copy { dst, src, bytes } => Op::Copy { dst, src, bytes },
                Op::Launch(l) => Op::Launch(l.map_args(resolve)),
                Op::Side(l) => Op::Side(l.map_args(resolve)),
                Op::Join => Op::Join,
            })
            .collect();
        Ok(Program { ops, _tables: tables, graph: None })
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

    /// Queues `ops` on the context's stream, the side launches on `side` (on the context's
    /// stream too, in order, without one).
    fn queue_ops(ctx: &Context, ops: &[Op], side: Option<&SideBranch>) -> Result<()> {
        for op in ops {
            match op {
                Op::Launch(l) => ctx.launch_args(l.f, l.grid, l.block, l.smem, &l.args)?,
                Op::Side(l) => match side {
                    Some(sb) => {
                        // SAFETY: events and streams of this context.
                        unsafe {
                            cu::event::record(sb.fork, ctx.stream).map_err(driver_err("recording an event"))?;
                            cu::stream::wait_event(sb.stream, sb.fork, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                                .map_err(driver_err("waiting for an event"))?;
                        }
                        ctx.launch_on(sb.stream, false, l.f, l.grid, l.block, l.smem, &l.args)?;
                        // SAFETY: as above.
                        unsafe { cu::event::record(sb.join, sb.stream) }.map_err(driver_err("recording an event"))?;
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
        Ok(())
    }

    // ------------------------------------------------------------------ state mirror

    /// Copies the whole host state to the device.
    fn upload_state(&mut self, state: &State) -> Result<()> {
        for (ls, mm) in state.layers.iter().zip(&self.mirror) {
            mm.ring.write(0, &ls.ring)?;
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

    /// The pack runs of a step of `n` rows from `pos0`, in the order [`Self::apply`] reads
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

    /// Applies a step's packed state writes to the host state (logging what they overwrite):
    /// the raw rows, and each compressor push replayed from the row's projections (score =
    /// gate + position bias, the one addition the device made) with the emitted rows.
    fn apply(
        &self,
        model: &Model,
        state: &mut State,
        pos0: usize,
        n: usize,
        j: &[f32],
        mut log: Option<&mut BatchLog>,
    ) {
        let mut at = 0usize;
        let mut take = |len: usize| {
            let s = at;
            at += len;
            s..at
        };
        let hd = state.layers.first().map_or(0, |l| l.head_dim);
        for (li, ls) in state.layers.iter_mut().enumerate() {
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
            let lw = &model.weights.layers[li];
            let apes: Vec<&[f32]> = [
                lw.compressor.as_ref().map(|c| c.ape.as_slice()),
                lw.indexer.as_ref().map(|i| i.compressor.ape.as_slice()),
            ]
            .into_iter()
            .flatten()
            .collect();
            let mut score = Vec::new();
            for r in 0..n {
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
}

/// The error for a step program missing from the cache right after it was built (cannot
/// happen; an error rather than a panic in library code).
fn lost_program() -> Error {
    Error::Backend("CUDA decode: a step program went missing from its cache".into())
}

/// The bytes of a descriptor as the kernels read it.
fn desc_bytes(d: &Desc) -> &[u8] {
    // SAFETY: Desc is repr(C) plain data without implicit padding (four u64, one i64, ten i32,
    // the last two an explicit pad that keeps its size a multiple of 16).
    unsafe { std::slice::from_raw_parts((d as *const Desc).cast::<u8>(), std::mem::size_of::<Desc>()) }
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
        if n == 0 || n > N_MAX {
            return Err(Error::invalid(format!("the device decoder takes 1..={N_MAX} rows, not {n}")));
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
        );
        if !self.programs.contains_key(&key) {
            let img = guard
                .images
                .iter()
                .find(|i| i.is(model.file.raw()))
                .ok_or_else(|| Error::Backend("CUDA decode: the model's weights are not on the device".into()))?;
            let prog = self.build(ctx, img, model, n, head, argmax)?;
            self.programs.insert(key, prog);
        }

        // Upload: step parameters, the streams (each row's embedding in every stream), the
        // pack runs.
        let (runs, jfloats) = self.journal(cfg, pos0, n);
        let step_bytes = 4 * (2 + N_MAX);
        let x_bytes = 4 * n * hc * d;
        let runs_bytes = std::mem::size_of_val(runs.as_slice());
        self.up.reserve(step_bytes + x_bytes + runs_bytes)?;
        {
            let st = self.up.bytes_mut(0, step_bytes);
            let mut vals = vec![pos0 as i32, n as i32];
            vals.extend(tokens.iter().map(|&t| t as i32));
            vals.resize(2 + N_MAX, 0);
            for (c, v) in st.chunks_mut(4).zip(vals) {
                c.copy_from_slice(&v.to_le_bytes());
            }
            let x = self.up.floats(step_bytes, n * hc * d);
            let mut e = vec![0f32; d];
            for (r, &t) in tokens.iter().enumerate() {
                model.embed_row(t, &mut e)?;
                for s in 0..hc {
                    x[(r * hc + s) * d..(r * hc + s + 1) * d].copy_from_slice(&e);
                }
            }
            // SAFETY: CopyRun is plain repr(C) data.
            let rb = unsafe { std::slice::from_raw_parts(runs.as_ptr().cast::<u8>(), runs_bytes) };
            self.up.bytes_mut(step_bytes + x_bytes, runs_bytes).copy_from_slice(rb);
        }
        let logit_rows = head.map_or(0, |h| h.1);
        // What comes back of the requested rows: one u32 id each, or their logits.
        let head_words = if argmax { logit_rows } else { logit_rows * cfg.vocab };
        let want_x = state.draft.is_some() && model.draft.is_some();
        let capture_layers = match model.draft.as_ref().map(|dm| &dm.kind) {
            Some(DraftKind::DSpark(w)) if want_x => w.target_layers.len(),
            _ => 0,
        };
        let down_floats = head_words + jfloats + if want_x { n * hc * d * (1 + capture_layers) } else { 0 };
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
                Op::Launch(l) | Op::Side(l) => {
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
            if want_x {
                let (xf, cap) = xr.split_at_mut(n * hc * d);
                cu::memcpy_dtoh_async(xf, self.bufs.x.ptr, stream).map_err(driver_err("download"))?;
                for j in 0..capture_layers {
                    let dst = &mut cap[j * n * hc * d..(j + 1) * n * hc * d];
                    cu::memcpy_dtoh_async(dst, self.bufs.capture.ptr + (j * N_MAX * hc * d * 4) as u64, stream)
                        .map_err(driver_err("download"))?;
                }
            }
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
        {
            let _j = crate::profile::scope(crate::profile::Phase::Journal);
            self.apply(model, state, pos0, n, jr, log.as_deref_mut());
        }
        if want_x {
            let (xf, cap) = xr.split_at(n * hc * d);
            // DSpark's capture: each target layer's streams averaged, as the host pass does.
            let mut captured = vec![0f32; n * capture_layers * d];
            for j in 0..capture_layers {
                for r in 0..n {
                    let streams = &cap[(j * n + r) * hc * d..(j * n + r + 1) * hc * d];
                    let k = capture_layers;
                    mean_of_streams(streams, &mut captured[(r * k + j) * d..(r * k + j + 1) * d]);
                }
            }
            model.draft_advance(state, xf, &captured, tokens, pos0, log)?;
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

impl DeviceDecoder for CudaDecoder {
    fn max_rows(&self) -> usize {
        N_MAX
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
        for (ls, mm) in state.layers.iter().zip(&self.mirror) {
            for (cs, cm) in [(&ls.compressor, &mm.comp), (&ls.indexer, &mm.index)] {
                let (Some(cs), Some(cm)) = (cs, cm) else { continue };
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
                let pw = cs.proj_width();
                let w0 = cut - cut % cm.ratio;
                let mut slots: Vec<usize> = Vec::new();
                for r in keep..n {
                    let p = pos0 + r;
                    let slot = p % cm.ratio;
                    if p >= w0 + cm.ratio && w0 + slot < cut && !slots.contains(&slot) {
                        slots.push(slot);
                    }
                }
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
