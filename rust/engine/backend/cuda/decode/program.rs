//! The step programs of the device decoder: every launch of a step of `n` rows (each layer's
//! kernels in order, with their arguments and the product descriptor tables fixed), built once
//! per batch size and logits choice, then captured as a CUDA graph and replayed
//! (`CudaDecoder::replay`, in mod.rs). What each kernel computes is in `shaders/cuda/`; this
//! file decides which kernels run, in which order, on which buffers, and why in that order.

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::super::context::{driver_err, stem, Context, THREADS};
use super::super::device::{Arg, DevBuf};
use super::super::weights::DeviceImage;
use super::super::{
    chunk_rows, group, row_blocks, rows_per_block, slices, split_in_launch, tensor_cores, CudaBackend, Desc, MV_WARPS,
};
use super::gemm;
use super::{CompMirror, CudaDecoder, DSparkDevice, Launch, LayerConsts, LayerMirror, MtpDevice, Op, Program, N_MAX};
use crate::model::config::LayerSpec;
use crate::model::draft::{DSparkWeights, DraftKind, MtpInput, MtpWeights};
use crate::model::weights::{HyperWeights, LayerWeights, Mat};
use crate::model::Model;
use crate::{Error, Result};

/// ds4_hc_site's cluster blocks a row, most threads a block and most streams
/// (decode_ops.cu HC_SITE_CLUSTER, HC_SITE_THREADS, HC_SITE_MAX).
const HC_SITE_CLUSTER: usize = 8;
const HC_SITE_THREADS: usize = 512;
const HC_SITE_MAX: usize = 4;

/// Most rows of one routed-expert product in a decode step or a verify: the kernels for few
/// rows read the weights much faster per row (IQ2_XXS at 16 rows runs at a fifth of its
/// one-row speed), and in a batch most experts serve one or two rows. (Tried and dropped:
/// chunks of one row, every row and expert a descriptor of the one-row kernels; slower on an
/// H200, Flash verifies of 8 rows 27.46 ms against 26.33.)
/// (Measurements: scripts/kernel_lab/HISTORY.md, "program.rs: EXPERT_CHUNK".)
pub(super) const EXPERT_CHUNK: usize = 2;

/// A warp's tile in the routed experts' tensor-core kernels (`ds4_moe_mma_iq2_xxs`,
/// `ds4_moe_mma_q2_k` and their `_2x2` builds in gemm_experts.cu): m16 tiles of outputs by n8
/// tiles of rows. Every tile gives the same bits (gemm_experts.cu says why and what each
/// measured).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct GxTile {
    pub(super) m: usize,
    pub(super) n: usize,
}

/// The tiles built, in the order of [`Kernels`](super::Kernels)' `moe_mma`.
pub(super) const GX_TILES: [GxTile; 2] = [GxTile { m: 2, n: 4 }, GxTile { m: 2, n: 2 }];

impl GxTile {
    /// Output rows of a warp.
    pub(super) fn warp_rows(self) -> usize {
        16 * self.m
    }

    /// Most rows of one descriptor.
    pub(super) fn max_rows(self) -> usize {
        8 * self.n
    }

    /// Its place in [`GX_TILES`].
    pub(super) fn index(self) -> usize {
        GX_TILES.iter().position(|&t| t == self).unwrap_or(0)
    }
}

/// `DS4_CUDA_GX_TILE`: `MxN` of [`GX_TILES`] (unset: the first).
pub(super) fn gx_tile(setting: Option<&str>) -> Result<GxTile> {
    match setting.map(str::trim) {
        None | Some("") => Ok(GX_TILES[0]),
        Some(v) => GX_TILES
            .iter()
            .copied()
            .find(|t| format!("{}x{}", t.m, t.n) == v)
            .ok_or_else(|| Error::invalid(format!("DS4_CUDA_GX_TILE takes 2x4 or 2x2, not {v:?}"))),
    }
}

/// Whether `ds4_moe_mma_iq2_xxs` takes an expert stack's matrix `m` (expert 0's rows at device
/// address `at`, 2-byte aligned as every IQ2_XXS row): IQ2_XXS of whole super-blocks.
fn gx_takes(m: &Mat, at: u64) -> bool {
    m.ty == crate::quant::GgmlType::IQ2_XXS && m.n_in > 0 && m.n_in.is_multiple_of(256) && at.is_multiple_of(2)
}

/// Scores the routing holds in shared memory at once, rows of `experts` (decode_moe.cu
/// MOE_SCORES).
const MOE_SCORES: usize = 4096;

/// Bytes of ds4_route's dynamic shared memory for `n` rows of `k` experts of `experts`
/// (decode_moe.cu `route_smem_words`: a round of rows' scores, then per (row, pick) pair two
/// words, per expert its row bitmap and prefix counts (ceil(n / 32) words each) and two words
/// (one more past the last), per slot (at most min(n k, experts)) four words, one more).
pub(super) fn route_smem(n: usize, k: usize, experts: usize) -> usize {
    let r = n.div_ceil(32);
    let slots = (n * k).min(experts);
    let per_round = (MOE_SCORES / experts.max(1)).max(1);
    4 * (n.min(per_round) * experts + 2 * n * k + 2 * experts * r + 2 * experts + 1 + 4 * slots + 1)
}

/// Threads of a `ds4_route_pick` block: it routes as many rows as it has warps.
pub(super) const ROUTE_PICK_THREADS: u32 = 128;

/// Blocks of a `ds4_route_pick` launch for `n` rows of `experts` (decode_moe.cu: a block's
/// rows are its warps, at most MOE_SCORES / experts, whose scores it holds at once).
pub(super) fn route_pick_grid(n: usize, experts: usize) -> u32 {
    let per = (ROUTE_PICK_THREADS as usize / 32).min((MOE_SCORES / experts.max(1)).max(1));
    n.div_ceil(per) as u32
}

/// Whether a step of `n` rows spreads over many blocks work that a decode's or verify's step
/// (up to [`N_MAX`] rows) leaves to one block, when its switch is `on` (the default): a
/// prompt's step does. Two such splits, each with the same bits either way:
/// - the routing's step 1 in `ds4_route_pick` before `ds4_route` (`DS4_CUDA_ROUTE_PICK`): for
///   hundreds of rows one block's scores (a softplus in double each) and top-k ran on one SM,
///   and blocks of four rows take the whole GPU; a row's picks come from the same code
///   (route_round);
/// - each compressor as `ds4_compress_windows` and `ds4_compress_state`
///   (`DS4_CUDA_COMPRESS_SPLIT`), whose windows then close side by side (decode_attn.cu).
///
/// Up to [`N_MAX`] rows one block scores them in a round or two, or closes a few windows, and a
/// second launch would only add its latency. (Tried and dropped: a verify's compressors split
/// from 2 or from 5 rows on, its routing from 2; no faster on an H200, Flash verifies of 8 rows
/// with the compressors split from 2 at 26.91 ms against 26.75.)
/// (Measurements: scripts/kernel_lab/HISTORY.md, "program.rs: split_over_blocks".)
pub(super) fn split_over_blocks(on: bool, n: usize) -> bool {
    on && n > N_MAX
}

/// Whether `ds4_moe_mma_q2_k` takes an expert stack's matrix `m` (expert 0's rows at `at`):
/// Q2_K of whole super-blocks, rows 4-byte aligned (84 bytes a super-block).
fn gq_takes(m: &Mat, at: u64) -> bool {
    m.ty == crate::quant::GgmlType::Q2_K
        && m.n_in > 0
        && m.n_in.is_multiple_of(256)
        && at.is_multiple_of(4)
        && m.row_bytes.is_multiple_of(4)
}

/// Most rows of one routed-expert product of the decode's kernels in a prompt's step by default
/// ([`expert_chunk`]; the tensor-core kernels of gemm_experts.cu take up to [`GxTile::max_rows`]
/// whatever it is): its experts serve more rows (128 rows of Flash: about 3 an expert),
/// and each product of a chunk reads the expert's weights again. Chunks of 4 were the fastest
/// of 2, 4 and 8 on an H200 (Flash, 2048-token prompts in 128-row steps: 587 tok/s against 550
/// with 2). (Measurements: scripts/kernel_lab/HISTORY.md, "program.rs: PREFILL_EXPERT_CHUNK".)
const PREFILL_EXPERT_CHUNK: usize = 4;

/// The most rows of one routed-expert product in a prompt's step: `setting`
/// (`DS4_CUDA_EXPERT_CHUNK`: 1, 2, 4, 8 or 16, a product kernel's rows) or
/// [`PREFILL_EXPERT_CHUNK`]. Only the speed depends on it: the kernels are row invariant.
pub(super) fn expert_chunk(setting: Option<&str>) -> Result<usize> {
    match setting.map(str::trim) {
        None | Some("") => Ok(PREFILL_EXPERT_CHUNK),
        Some(v) => match v.parse::<usize>() {
            Ok(c) if [1, 2, 4, 8, 16].contains(&c) => Ok(c),
            _ => Err(Error::invalid(format!("DS4_CUDA_EXPERT_CHUNK takes 1, 2, 4, 8 or 16, not {v:?}"))),
        },
    }
}

/// Threads of a one-block-per-row kernel over rows of `width` floats: a whole row is read by
/// one block, so wide rows get the most threads.
pub(super) fn wide(width: usize) -> u32 {
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
pub(super) fn attention_blocks(n_heads: usize, head_dim: usize, lg_stride: usize) -> Result<(u32, u32)> {
    let groups = n_heads.div_ceil(8);
    let blocks =
        |x: usize| u32::try_from(x).map_err(|_| Error::Backend("CUDA decode: attention grid too large".into()));
    Ok((blocks(groups * lg_stride.div_ceil(64))?, blocks(groups * head_dim.div_ceil(32))?))
}

/// Most head dim of `ds4_attention_mma` (decode_attn.cu DS4_ATTN_MMA_MAX_DIM); it also takes
/// only multiples of 64.
const ATTN_MMA_MAX_DIM: usize = 512;

/// Bytes of `ds4_attention_mma`'s dynamic shared memory (decode_attn.cu ds4_attn_mma_smem): Q's
/// fragments, the key pointers, the logits of 16 heads in rows of `lg_stride` keys rounded up to
/// 32, plus 4.
pub(super) fn attention_mma_smem(head_dim: usize, lg_stride: usize) -> usize {
    head_dim * 128 + lg_stride.div_ceil(8) * 8 * 8 + 16 * (lg_stride.div_ceil(32) * 32 + 4) * 4
}

/// Whether a step's attention runs `ds4_attention_mma` (the tensor cores, decode_attn.cu
/// section 6) rather than section 5's two launches: a prompt's step (`prefill`; its rows are
/// row-invariant among prompt steps but not bitwise a decode's, as the tensor-core products), when
/// `on` (`DS4_CUDA_ATTN_MMA`, on by default), on sm_80 or later, for head dims it takes and
/// key counts whose logits fit the shared memory a block may have (`smem_max`).
pub(super) fn attention_mma(
    on: bool,
    prefill: bool,
    sm80: bool,
    head_dim: usize,
    lg_stride: usize,
    smem_max: usize,
) -> bool {
    on && prefill
        && sm80
        && head_dim.is_multiple_of(64)
        && head_dim <= ATTN_MMA_MAX_DIM
        && attention_mma_smem(head_dim, lg_stride) <= smem_max
}

/// Bytes of `ds4_index_scores_mma`'s dynamic shared memory (decode_attn.cu
/// ds4_index_mma_smem): Q's split fragments, 16 KB a tile of 16 heads.
pub(super) fn index_mma_smem(heads: usize) -> usize {
    heads / 16 * 16 * 2 * 32 * 16
}

/// Whether a step's indexer scores run `ds4_index_scores_mma` (the tensor cores, 3xTF32) rather
/// than `ds4_index_scores`: a prompt's step (`prefill`) when `on` (`DS4_CUDA_INDEX_MMA`), a
/// decode's or verify's when `on_steps` (`DS4_CUDA_INDEX_MMA_STEPS`), both on by default, on
/// sm_80 or later, for the shapes it takes (head_dim 128, heads a multiple of 16 up to 64)
/// within the shared memory a block may have. Its scores agree with the float kernel's to
/// rounding and depend only on the row (row invariance), so a verify is still bitwise its rows'
/// single decodes, both on this kernel. On an H200 an 8192-token Flash prompt ran at 1888 tok/s
/// against 1728 with the float kernel (a 2048-token one the same: its indexer keeps at most 512
/// rows, which every row then sees, so no scores). In decode steps the float kernel, one thread
/// a (row, head) walking every indexer row of the context, was a CSA layer's largest stage at
/// 32K tokens. (Measurements: scripts/kernel_lab/HISTORY.md, "program.rs: index_mma".)
pub(super) fn index_mma(
    on: bool,
    on_steps: bool,
    prefill: bool,
    sm80: bool,
    heads: usize,
    head_dim: usize,
    smem_max: usize,
) -> bool {
    (if prefill { on } else { on_steps })
        && sm80
        && head_dim == 128
        && heads.is_multiple_of(16)
        && (16..=64).contains(&heads)
        && index_mma_smem(heads) <= smem_max
}

/// Blocks per batch row of `ds4_index_scores_mma` for a step of `n` rows: about four waves'
/// worth of an H200's blocks in all (two a SM, [`INDEX_WAVE`] SMs) for a prompt's step, one
/// for a decode's or verify's (up to [`N_MAX`] rows), each walking its share of the row's tiles
/// of 128 indexer rows (which block scores a row never changes the score; blocks past the
/// row's tiles return at once). A decode step at 32K tokens has 64 tiles a CSA layer.
pub(super) fn index_mma_blocks(n: usize) -> u32 {
    let waves = if n <= N_MAX { 1 } else { 4 };
    (waves * 2 * INDEX_WAVE).div_ceil(n.max(1)) as u32
}

/// Blocks of a `ds4_index_scores` launch in all, shared by its batch rows.
const INDEX_WAVE: usize = 132;

/// Blocks per batch row of `ds4_index_scores` for a step of `n` rows: [`INDEX_WAVE`] in all
/// (its grid-stride loop gives each block its share of the indexer rows, and which block
/// scores a row never changes the score, so only the speed depends on it). A thread holds its
/// query head in registers (128 floats: few 256-thread blocks fit an SM) and a block loads
/// them once for all the rows it scores. With 132 blocks a row, as before, a verify of 8 rows
/// ran many waves of blocks that each loaded 64 KB of queries to score 4 indexer rows; on an
/// H200 (Flash at 2100 tokens) verifies of 8 rows took 26.60 ms this way against 27.31, one
/// row the same. (Measurements: scripts/kernel_lab/HISTORY.md, "program.rs: index_blocks".)
pub(super) fn index_blocks(n: usize) -> u32 {
    INDEX_WAVE.div_ceil(n.max(1)) as u32
}

/// Threads of `ds4_argmax_rows` (one block per logits row).
pub(super) const ARGMAX_THREADS: u32 = 1024;

/// Where one of a layer's projections of h at the attention site goes ([`projections_of_h`]).
#[derive(Clone, Copy)]
pub(super) enum OfH {
    CompKv,
    CompGate,
    IndexProj,
    IndexKv,
    IndexGate,
}

/// The compressor's and indexer's projections of h in layer `lw`, in the order the step
/// programs queue them (the attention site in `build`); the decoder sizes the side branch's
/// partial sums from the same list (mod.rs).
pub(super) fn projections_of_h(lw: &LayerWeights) -> Vec<(Mat, OfH)> {
    let mut v = Vec::new();
    if let Some(c) = &lw.compressor {
        v.extend([(c.kv, OfH::CompKv), (c.gate, OfH::CompGate)]);
    }
    if let Some(i) = &lw.indexer {
        v.extend([(i.proj, OfH::IndexProj), (i.compressor.kv, OfH::IndexKv), (i.compressor.gate, OfH::IndexGate)]);
    }
    v
}

/// Bytes a thread of `ds4_prefetch` asks L2 for.
const PREFETCH_PIECE: usize = 32768;

/// Threads of a `ds4_prefetch` block (Flash's q_b: 9 blocks).
const PREFETCH_THREADS: usize = 128;

/// Whether each layer asks L2 for its q_b weights ahead of their product (`ds4_prefetch` on
/// the side branch, from the layer's start), unless `DS4_CUDA_PREFETCH=0`. Between the layer's
/// start and q_b run only kernels that read little (the attention site's mixing, q_a and kv,
/// the q_a norm), so DRAM is mostly idle. On an H200 (Flash at a 2100-token context) steps in
/// a row took 9.04 ms against 9.15 without it.
///
/// The prefetch runs on a branch of its own (`Op::Ahead`), not first on the side branch: the
/// launch takes about 22 us (the bulk prefetches of 35.6 MB), and the compressor and indexer
/// projections queued behind it started about 11 us after the attention site's mixing had made
/// their input (steps 8.26 against 8.45 ms; `DS4_CUDA_PREFETCH_BRANCH=0` for the old order). A
/// prompt's steps keep the old order: they were slower on the branch, and their products read
/// each weight once for hundreds of rows, so the prefetch has little to give them.
/// (Tried and dropped: prefetches of o_a, o_b, the shared expert, the routed down matrices, the
/// layer's attention state, and the next layer's q_a, kv and q_b; q_b in 8 KB pieces; slower or
/// no gain. q_a and o_b wait on their own latency, not on DRAM.)
/// (Measurements: scripts/kernel_lab/HISTORY.md, "program.rs: prefetch_q_b".)
pub(super) fn prefetch_q_b(setting: Option<&str>) -> Result<bool> {
    switch("DS4_CUDA_PREFETCH", setting)
}

/// An on/off setting of the decoder, `name` = `setting` (the environment's, read when a
/// session makes its decoder): on when unset, empty or 1, off with 0, and anything else
/// refused (the session's first evaluation fails with the error, session.rs
/// `ensure_decoder`) rather than read as either.
pub(super) fn switch(name: &str, setting: Option<&str>) -> Result<bool> {
    match setting.map(str::trim) {
        None | Some("" | "1") => Ok(true),
        Some("0") => Ok(false),
        Some(other) => Err(Error::invalid(format!("{name} takes 0 or 1, not {other:?}"))),
    }
}

/// An opt-in setting of the decoder (for a change not yet timed as a default): on with 1, off
/// when unset, empty or 0, anything else refused as by [`switch`].
pub(super) fn opt_in(name: &str, setting: Option<&str>) -> Result<bool> {
    match setting.map(str::trim) {
        None | Some("" | "0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(Error::invalid(format!("{name} takes 0 or 1, not {other:?}"))),
    }
}

/// The kernel (0 F32, 1 F16, 2 BF16, 3 Q8_0; of the first `formats`) of a "tail" launch: a
/// one-row product's launch whose last block also does the one-block step after it, so that
/// step has no launch of its own (decode_ops.cu, `ds4_last_block`). Two tails, each behind an
/// opt-in switch (`on`) because neither has yet been timed on a GPU:
/// - `DS4_CUDA_ROUTE_TAIL=1`: the router product and the row's routing (`ds4_router_route_*`,
///   decode_moe.cu; no `ds4_route` launch). In a traced Flash step (H200, 2026-12-03) a
///   layer's routing ended about 11 us after the router product.
/// - `DS4_CUDA_NORM_TAIL=1`: the attention site's q_a and kv products and the q_a norm
///   (`ds4_mv_*_1_norm`, decode_ops.cu; no `ds4_rms_weight` launch). In a traced step
///   (2026-12-04) that norm started a median 4.0 us after q_a ended in the CSA layers, while
///   the side branch's products held the SMs.
///
/// Only for a decode or verify step of one row (not a prompt's, whose products may take the
/// tensor cores), and only where the product's launch is that of the decode's plain kernel
/// (`take_tail` in `build`). The product's blocks are the plain kernel's and the step after
/// it computes what its own launch would, in the same order, so the step's bits are the same
/// either way (test_cuda.py `test_opt_in_switches_change_no_bits`).
pub(super) fn tail_kernel(
    on: bool,
    n: usize,
    prefill: bool,
    ty: crate::quant::GgmlType,
    formats: usize,
) -> Option<usize> {
    use crate::quant::GgmlType;
    if !on || n != 1 || prefill {
        return None;
    }
    let i = match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::BF16 => 2,
        GgmlType::Q8_0 => 3,
        _ => return None,
    };
    (i < formats).then_some(i)
}

/// `DS4_CUDA_WIDE=1` (opt-in until it is timed on a GPU): a prompt's step gathers its routed
/// rows and takes its SwiGLUs four values a thread (`ds4_gather4`, `ds4_swiglu4`: the same
/// bytes with a quarter of the blocks). In a traced 1024-row step of Flash the two kernels took
/// 5.6 and 4.9 ms of 394, two to four times their bytes' time, at a value a thread in tens of
/// thousands of blocks. Whether a SwiGLU of `count` values (as 8-bit activations in rows of
/// `width` when `act8`) takes the wide kernel: `on`, a prompt's step, and the kernel's shape
/// (whole float4s; with act8 whole blocks of 32). The gather's rule is `on`, a prompt's step and
/// 8-bit activations (whose rows are whole blocks of 32).
pub(super) fn wide_swiglu(on: bool, prefill: bool, count: usize, width: usize, act8: bool) -> bool {
    on && prefill && count.is_multiple_of(4) && (!act8 || (count.is_multiple_of(32) && width.is_multiple_of(32)))
}

/// Product blocks one band of a prompt's product should run as (about a wave of an H200: 132
/// SMs, four blocks each of the tensor-core Q8_0 kernel), [`band_rows`].
const BAND_BLOCKS: usize = 512;

/// `DS4_CUDA_BANDS`: unset or 1, bands of [`BAND_BLOCKS`]; 0, none (A/B); any other row
/// count, bands of that many rows (rounded up to whole row blocks: for tests). (Only for the
/// products that `ds4_gemm_q8_0_mq` does not take: all of that layout's whole tiles, unless
/// `DS4_CUDA_GEMM_MQ=0`.) On by default:
/// in a 256-row step of an 8192-token Flash prompt on an H200 (`DS4_DECODE_PROFILE`), o_b's
/// product took 16.10 ms a step in bands against 17.52 without, q_b's 15.02 against 15.14.
pub(super) fn bands_setting(setting: Option<&str>) -> Result<Option<usize>> {
    match setting.map(str::trim) {
        Some("0") => Ok(None),
        None | Some("" | "1") => Ok(Some(0)),
        Some(v) => match v.parse::<usize>() {
            Ok(r) if r > 1 => Ok(Some(r)),
            _ => Err(Error::invalid(format!("DS4_CUDA_BANDS takes 0, 1 or a row count, not {v:?}"))),
        },
    }
}

/// Output rows of a band of a prompt's product on the tensor-core Q8_0 kernel whose `rows` rows
/// of x take `chunks` descriptors. Each descriptor reads the whole matrix, and one of them has
/// about a wave of blocks (o_b at a 256-row step: 16 descriptors of 512 blocks), so a step read
/// the weights from DRAM once per descriptor. In bands, the descriptors of all the chunks come
/// for one band of output rows, then for the next, and the band's weights come from L2 for all
/// but the first: `setting` from [`bands_setting`], rows a block `rpb`, `slices` a row block.
/// The same outputs and sums (a descriptor of a band is the product's descriptor on a slice of
/// its rows, the slices and groups of the whole product), so the same bits.
pub(super) fn band_rows(setting: Option<usize>, rpb: usize, n_out: usize, chunks: usize, slices: usize) -> usize {
    let rows = match setting {
        None => return n_out,
        _ if chunks < 2 => return n_out,
        Some(0) => (BAND_BLOCKS / (chunks * slices)).max(1) * rpb,
        Some(r) => r.div_ceil(rpb) * rpb,
    };
    rows.min(n_out)
}

/// A kernel argument of a program: a plain argument, or an offset in the program's table of
/// product descriptors (its device address is known once the table is uploaded).
#[derive(Clone, Copy, Debug)]
enum PArg {
    A(Arg),
    Table(usize),
}

/// Moves the launches of `ops` from `first` on to the side branch, in their order.
fn to_side(ops: &mut Vec<Op<PArg>>, first: usize) {
    let tail: Vec<_> = ops.drain(first..).collect();
    ops.extend(tail.into_iter().map(|op| match op {
        Op::Launch(l) => Op::Side(l),
        other => other,
    }));
}

/// The bytes of a descriptor as the kernels read it.
fn desc_bytes(d: &Desc) -> &[u8] {
    // SAFETY: Desc is repr(C) plain data without implicit padding (four u64, one i64, ten i32,
    // the last two an explicit pad that keeps its size a multiple of 16).
    unsafe { std::slice::from_raw_parts((d as *const Desc).cast::<u8>(), std::mem::size_of::<Desc>()) }
}

/// The shapes of a product launch's matrices, for the profile (`"8x[1024x4096],512x4096"`).
fn shapes_label<'m>(mats: impl Iterator<Item = &'m Mat>) -> String {
    let mut shapes: Vec<(usize, usize, usize)> = Vec::new();
    for m in mats {
        match shapes.iter_mut().find(|s| (s.0, s.1) == (m.n_out, m.n_in)) {
            Some(s) => s.2 += 1,
            None => shapes.push((m.n_out, m.n_in, 1)),
        }
    }
    let parts: Vec<String> =
        shapes.iter().map(|&(o, i, c)| if c > 1 { format!("{c}x[{o}x{i}]") } else { format!("{o}x{i}") }).collect();
    parts.join(",")
}

/// What a program runs.
pub(super) enum Body<'a> {
    /// A step of the target: every layer, then the head on `head` = (first row, rows)
    /// followed by the argmax of each of those logits rows when `argmax`; with `upkeep` (the
    /// image of the drafter's file), then the drafter's new window rows (`Upkeep`, mod.rs);
    /// `prefill`: a prompt's step, whose F16 and float-x Q8_0 products run on the tensor cores
    /// (`gemm.rs`).
    Trunk { head: Option<(usize, usize)>, argmax: bool, upkeep: Option<&'a DeviceImage>, prefill: bool },
    /// One step of the MTP drafter on one row (`MtpDevice`, mod.rs): its input from the streams
    /// in `x` and the token's embedding, its block (`img`: the image of the file that holds the
    /// drafter), then, when `head`, its head and the argmax of its logits.
    Mtp { dev: &'a MtpDevice, w: &'a MtpWeights, img: &'a DeviceImage, head: bool },
    /// DSpark's block on the step's rows (`DSparkDevice`, mod.rs): its stages, each row seeing
    /// all of the block, then its head on every row; the head's unnormalized output stays in
    /// `y` (the hidden rows), the logits before the Markov bias in `logits`.
    DSpark { dev: &'a DSparkDevice, w: &'a DSparkWeights, img: &'a DeviceImage },
}

/// One layer of a program: its weights (in `img`), constants and device state, and the
/// capture slot its output streams are copied to (DSpark's target layers).
struct Job<'a> {
    lw: &'a LayerWeights,
    spec: &'a LayerSpec,
    c: &'a LayerConsts,
    mm: &'a LayerMirror,
    img: &'a DeviceImage,
    capture: Option<usize>,
    /// Whether the step's rows see each other (a drafter's block, decode_attn.cu section 5).
    block: bool,
}

impl CudaDecoder {
    /// Builds the program of a step of `n` rows (`img`: the target's weights).
    pub(super) fn build(
        &self,
        ctx: &Context,
        img: &DeviceImage,
        model: &Model,
        n: usize,
        body: Body<'_>,
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
        let prefill = matches!(body, Body::Trunk { prefill: true, .. });
        let sm80 = ctx.compute_capability.0 >= 8;
        // The image whose weights the products being added read (the drafter's file may not be
        // the target's).
        let cur = std::cell::Cell::new(img);
        let launch =
            |ops: &mut Vec<_>, f: sys::CUfunction, grid: (u32, u32, u32), block: u32, smem: u32, args: Vec<PArg>| {
                ops.push(Op::Launch(Launch { f, grid, block, smem, args, label: String::new() }));
            };
        // SwiGLU of `count` values from g and u into out (`act8`: as 8-bit activations in rows of
        // `width`): ds4_swiglu, or ds4_swiglu4 where `wide_swiglu` says.
        let swiglu = |ops: &mut Vec<_>, [g, u, out]: [u64; 3], count: usize, clamp: f32, width: usize, act8: bool| {
            let (f, per) = if wide_swiglu(self.wide, prefill, count, width, act8) {
                (k.swiglu4, 4 * 256)
            } else {
                (k.swiglu, 256)
            };
            let args = vec![p(g), p(u), p(out), i(count), fl(clamp), i(width), i(act8 as usize)];
            launch(ops, f, (count.div_ceil(per) as u32, 1, 1), 256, 0, args);
        };
        // A tail's launch (`tail_kernel`): the one launch that `products` added at `at`, when it
        // is the plain one-row kernel of `m`'s products, taken out of `ops` with `f`, the tail's
        // kernel, in its place; None (and `ops` untouched) otherwise.
        let take_tail = |ops: &mut Vec<Op<PArg>>, at: usize, m: &Mat, f: sys::CUfunction| -> Option<Launch<PArg>> {
            let plain = ctx.kernel(m.ty, m.n_in, m.n_out, 1).map(|k| k.0);
            if ops.len() != at + 1 || !matches!(&ops[at], Op::Launch(l) if Some(l.f) == plain) {
                return None;
            }
            let Some(Op::Launch(mut l)) = ops.pop() else { return None };
            l.f = f;
            Some(l)
        };
        // Products: (matrix, x, y, rows), y's rows `y_stride` floats apart (None: n_out). One
        // launch per format; partial sums and counters laid out from 0 for each call (launches
        // of different main-stream calls never overlap), or for the side branch's (`side`)
        // past the main stream's, in a region of their own.
        let products_on = |ops: &mut Vec<_>,
                           table: &mut Vec<u8>,
                           prods: &[(Mat, u64, u64, usize)],
                           y_stride: Option<usize>,
                           side: bool|
         -> Result<()> {
            let (mut part_off, mut counter) = if side { (b.part_floats, b.counters_len) } else { (0, 0) };
            let (part_cap, counters_cap) = if side {
                (b.part_floats + b.side_part_floats, b.counters_len + b.side_counters_len)
            } else {
                (b.part_floats, b.counters_len)
            };
            let first = ops.len();
            // The matrix whose shape picks a product's kernel (`DeviceImage::kernel_mat`): its
            // own, or for rows of a plane (o_a's groups) the plane's, whose kernel laid out the
            // weights at upload.
            let kmat = |m: &Mat| cur.get().kernel_mat(m);
            // A prefill step's tensor-core products first (gemm.rs): one launch per format.
            // (Tried and dropped: the trunk's F16 products there in every step, decode and
            // verify too, or those of at least 512 rows only; slower on an H200, Flash steps
            // 10.97 and 10.36 ms against 8.66.)
            // (Measurements: scripts/kernel_lab/HISTORY.md, "program.rs: products_on".)
            let on_tc = |pr: &(Mat, u64, u64, usize)| {
                prefill && gemm::takes(&kmat(&pr.0), cur.get().addr(pr.0.start), pr.1, pr.3, sm80, self.gemm_mq)
            };
            let tc: Vec<(Mat, u64, u64, usize)> = prods.iter().copied().filter(on_tc).collect();
            let rest: Vec<(Mat, u64, u64, usize)> = prods.iter().copied().filter(|pr| !on_tc(pr)).collect();
            let prods = rest.as_slice();
            if !tc.is_empty() {
                // With gemm_px each input of the call (its x, width and layout) is split once
                // into b.px, inputs that follow one another in memory (o_a's groups) as one:
                // (x, n_in, tiled, rows, offset in b.px). (Only the main stream's calls: a
                // prompt's step queues no products on the side branch.)
                let px = self.gemm_px && !side;
                let tiled_of = |m: &Mat| gemm::kernel(&kmat(m), self.gemm_mq) == Some(gemm::Kernel::Q8_0Tiled);
                let mut splits: Vec<(u64, usize, bool, usize, usize)> = Vec::new();
                // Whether split `s` holds the `rows` rows at x of a product of `n_in` inputs in
                // that layout (whole tiles before them).
                let holds = |s: &(u64, usize, bool, usize, usize), x: u64, n_in: usize, tiled: bool, rows: usize| {
                    let row_bytes = 4 * n_in as u64;
                    (s.1, s.2) == (n_in, tiled)
                        && x >= s.0
                        && (x - s.0).is_multiple_of(row_bytes)
                        && ((x - s.0) / row_bytes).is_multiple_of(gemm::PX_TILE_ROWS as u64)
                        && (x - s.0) / row_bytes + rows as u64 <= s.3 as u64
                };
                if px {
                    let mut end = 0usize;
                    for &(m, x, _, rows) in &tc {
                        let (n_in, tiled) = (m.n_in, tiled_of(&m));
                        if splits.iter().any(|s| holds(s, x, n_in, tiled, rows)) {
                            continue;
                        }
                        if let Some(last) = splits.last_mut() {
                            if (last.1, last.2) == (n_in, tiled)
                                && last.3.is_multiple_of(gemm::PX_TILE_ROWS)
                                && x == last.0 + 4 * (last.3 * n_in) as u64
                            {
                                last.3 += rows;
                                end = last.4 + gemm::px_bytes(n_in, last.3);
                                continue;
                            }
                        }
                        splits.push((x, n_in, tiled, rows, end));
                        end += gemm::px_bytes(n_in, rows);
                    }
                    if end > b.px_bytes {
                        return Err(Error::Backend("CUDA decode: split-x buffer too small (internal)".into()));
                    }
                    for &(x, n_in, tiled, rows, off) in &splits {
                        launch(
                            ops,
                            k.gemm_split,
                            gemm::px_split_grid(n_in, rows),
                            256,
                            0,
                            vec![p(x), i(n_in), i(rows), i(tiled as usize), p(b.px.ptr + off as u64)],
                        );
                    }
                }
                // The split of row r0 (a multiple of the tile rows) of a product's x of `rows`
                // rows: the split that holds all of them.
                let split_x = |m: &Mat, x: u64, rows: usize, r0: usize| -> Result<u64> {
                    let (n_in, tiled) = (m.n_in, tiled_of(m));
                    let row_bytes = 4 * n_in as u64;
                    splits
                        .iter()
                        .find(|s| holds(s, x, n_in, tiled, rows))
                        .map(|s| {
                            let r = ((x - s.0) / row_bytes) as usize + r0;
                            b.px.ptr + (s.4 + r / gemm::PX_TILE_ROWS * gemm::px_tile_bytes(n_in)) as u64
                        })
                        .ok_or_else(|| Error::Backend("CUDA decode: an input without its split (internal)".into()))
                };
                for kind in gemm::Kernel::ALL {
                    let f = match (kind, px) {
                        (gemm::Kernel::F16, false) => k.gemm_f16,
                        (gemm::Kernel::Q8_0, false) => k.gemm_q8_0,
                        (gemm::Kernel::Q8_0Tiled, false) => k.gemm_q8_0_mq,
                        (gemm::Kernel::F16, true) => k.gemm_px_f16,
                        (gemm::Kernel::Q8_0, true) => k.gemm_px_q8_0,
                        (gemm::Kernel::Q8_0Tiled, true) => k.gemm_px_q8_0_mq,
                    };
                    let mine: Vec<&(Mat, u64, u64, usize)> =
                        tc.iter().filter(|pr| gemm::kernel(&kmat(&pr.0), self.gemm_mq) == Some(kind)).collect();
                    if mine.is_empty() {
                        continue;
                    }
                    let start = table.len();
                    let mut blocks = 0usize;
                    let mut count = 0usize;
                    let launch_rows: usize = mine.iter().map(|pr| pr.0.n_out).sum();
                    for &&(m, x, y, rows) in &mine {
                        let ys = y_stride.unwrap_or(m.n_out);
                        // A prompt's step of more rows than a descriptor takes: chunks of them.
                        let mut r0 = 0;
                        while r0 < rows {
                            let c = (rows - r0).min(gemm::GEMM_MAX_ROWS);
                            let part = b.part.ptr + 4 * part_off as u64;
                            let xc = if px { split_x(&m, x, rows, r0)? } else { x + 4 * (r0 * m.n_in) as u64 };
                            let yc = y + 4 * (r0 * ys) as u64;
                            let (mut dsc, nblocks) =
                                gemm::desc(cur.get().addr(m.start), &m, launch_rows, xc, yc, ys, part, c, counter);
                            dsc.block_start = blocks as i32;
                            let s = dsc.slices as usize;
                            if s > 1 {
                                part_off += s * c * m.n_out;
                                counter += nblocks / s;
                            }
                            blocks += nblocks;
                            count += 1;
                            table.extend_from_slice(desc_bytes(&dsc));
                            r0 += c;
                        }
                    }
                    if part_off > part_cap || counter > counters_cap {
                        return Err(Error::Backend("CUDA decode: partial-sum buffer too small (internal)".into()));
                    }
                    ops.push(Op::Launch(Launch {
                        f,
                        grid: (blocks as u32, 1, 1),
                        block: 128,
                        smem: 0,
                        args: vec![
                            // Descriptors, not products: a product of more rows than one takes
                            // has several.
                            PArg::Table(start),
                            PArg::A(Arg::I32(count as i32)),
                            PArg::A(Arg::Ptr(b.counters.ptr)),
                        ],
                        label: shapes_label(mine.iter().map(|pr| &pr.0)),
                    }));
                }
            }
            // One launch per kernel, in call order: (format, stem, the matrix whose shape picks
            // the kernel of every product of the launch).
            let stem_of = |m: &Mat| stem(m.ty, m.n_in, kmat(m).n_out);
            let mut kernels: Vec<(crate::quant::GgmlType, Option<&'static str>, Mat)> = Vec::new();
            for pr in prods {
                if !kernels.iter().any(|k| (k.0, k.1) == (pr.0.ty, stem_of(&pr.0))) {
                    kernels.push((pr.0.ty, stem_of(&pr.0), kmat(&pr.0)));
                }
            }
            for (ty, kstem, km) in kernels {
                let mine = |pr: &&(Mat, u64, u64, usize)| pr.0.ty == ty && stem_of(&pr.0) == kstem;
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
                    let k = kmat(&m);
                    let split =
                        if y_stride.is_some() { split_in_launch(&m, launch_rows) } else { (group(&k), slices(&k)) };
                    let chunk = chunk_rows(ty, k.n_in, k.n_out);
                    let at = cur.get().addr(m.start);
                    // Rows a block (whole 16-row tiles of the tensor-core layout), and the bands
                    // (band_rows: the whole matrix unless a prompt's tensor-core Q8_0 product).
                    let rpb = rows_per_block(&k, split.0);
                    let banded = prefill && y_stride.is_none() && tensor_cores(ty, k.n_in, k.n_out);
                    let band =
                        band_rows(if banded { self.bands } else { None }, rpb, m.n_out, rows.div_ceil(chunk), split.1);
                    for b0 in (0..m.n_out).step_by(band.max(1)) {
                        let bn = band.min(m.n_out - b0);
                        let mut r0 = 0;
                        while r0 < rows {
                            let c = (rows - r0).min(chunk);
                            let part = b.part.ptr + 4 * part_off as u64;
                            let (xc, yc) = (x + 4 * (r0 * m.n_in) as u64, y + 4 * (r0 * ys) as u64);
                            let (mut dsc, _) = CudaBackend::desc_split(at, &m, &k, xc, yc, part, c, counter, split);
                            // The band's rows: the whole product's descriptor on them (its kernel,
                            // warp rows, group and slices).
                            dsc.w = at + (b0 * m.row_bytes) as u64;
                            dsc.n_out = bn as i32;
                            dsc.y = yc + 4 * b0 as u64;
                            let nblocks = bn.div_ceil(rpb) * split.1;
                            dsc.block_start = blocks as i32;
                            dsc.y_stride = ys as i32;
                            // Only split products use partial sums and counters.
                            let s = split.1;
                            if s > 1 {
                                part_off += s * c * bn;
                                counter += nblocks / s;
                            }
                            blocks += nblocks;
                            count += 1;
                            nmax = nmax.max(c);
                            table.extend_from_slice(desc_bytes(&dsc));
                            r0 += c;
                        }
                    }
                }
                if part_off > part_cap || counter > counters_cap {
                    return Err(Error::Backend("CUDA decode: partial-sum buffer too small (internal)".into()));
                }
                let (f, smem) = ctx
                    .kernel(ty, km.n_in, km.n_out, nmax)
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
                    label: shapes_label(prods.iter().filter(mine).map(|pr| &pr.0)),
                }));
            }
            if side {
                to_side(ops, first);
            }
            Ok(())
        };
        let products_strided =
            |ops: &mut Vec<_>, table: &mut Vec<u8>, prods: &[(Mat, u64, u64, usize)], y_stride: Option<usize>| {
                products_on(ops, table, prods, y_stride, false)
            };
        let products = |ops: &mut Vec<_>, table: &mut Vec<u8>, prods: &[(Mat, u64, u64, usize)]| {
            products_on(ops, table, prods, None, false)
        };
        // A launch that asks L2 for a matrix's weights, on the prefetch branch in a decode's or
        // verify's step (`Op::Ahead`; first on the side branch in a prompt's step, or with
        // `DS4_CUDA_PREFETCH_BRANCH=0`: see `prefetch_q_b`), nothing without the side branch
        // (in line, the launch would only delay the main stream).
        let prefetch = |ops: &mut Vec<_>, m: &Mat| {
            if !fork {
                return;
            }
            let (a, bytes) = (cur.get().addr(m.start), m.row_bytes * m.n_out);
            let l = Launch {
                f: k.prefetch,
                grid: (bytes.div_ceil(PREFETCH_PIECE).div_ceil(PREFETCH_THREADS) as u32, 1, 1),
                block: PREFETCH_THREADS as u32,
                smem: 0,
                args: vec![p(a), p(a + bytes as u64), i(PREFETCH_PIECE)],
                label: String::new(),
            };
            ops.push(if self.prefetch_branch && !prefill { Op::Ahead(l) } else { Op::Side(l) });
        };
        let g1 = (nn, 1, 1);
        let rows_grid = |blocks_x: usize| (blocks_x as u32, nn, 1);
        // (Not in a step of more rows than the capture buffer's `draft_cap`: such a step leaves
        // the drafter out, mod.rs `step`.)
        let cap = self.draft_cap;
        let capture: Vec<usize> = match model.draft.as_ref().map(|dm| &dm.kind) {
            Some(DraftKind::DSpark(w)) if n <= cap => w.target_layers.clone(),
            _ => Vec::new(),
        };
        let jobs: Vec<Job<'_>> = match &body {
            Body::Trunk { .. } => w
                .layers
                .iter()
                .zip(&cfg.layers)
                .enumerate()
                .map(|(li, (lw, spec))| Job {
                    lw,
                    spec,
                    c: &self.consts[li],
                    mm: &self.mirror[li],
                    img,
                    capture: capture.iter().position(|&c| c == li),
                    block: false,
                })
                .collect(),
            Body::Mtp { dev, w: mw, img: dimg, .. } => vec![Job {
                lw: &mw.block,
                spec: &dev.spec,
                c: &dev.consts,
                mm: &dev.mirror,
                img: dimg,
                capture: None,
                block: false,
            }],
            Body::DSpark { dev, w: dw, img: dimg } => dw
                .stages
                .iter()
                .zip(&dev.stages)
                .map(|(lw, (c, mm))| Job { lw, spec: &dev.spec, c, mm, img: dimg, capture: None, block: true })
                .collect(),
        };
        // The MTP block's input streams of `rows` pairs (the drafter's image current): per
        // stream e_proj . enorm(E[t]) + h_proj . hnorm(H_s) (or the fused [2d -> d] product of
        // the two norms), H the pairs' streams in `h`, E[t] their embeddings in `emb`; the
        // norms go to `hn` and `en`, e_proj's rows to `ex`, the streams to `xs`.
        let mtp_input = |ops: &mut Vec<_>,
                         table: &mut Vec<u8>,
                         mw: &MtpWeights,
                         dev: &MtpDevice,
                         rows: usize,
                         [h, emb, hn, en, ex, xs]: [u64; 6]|
         -> Result<()> {
            let fused = matches!(mw.input, MtpInput::Fused { .. });
            launch(
                ops,
                k.mtp_in,
                ((hc + 1) as u32, rows as u32, 1),
                wide(d),
                0,
                vec![
                    p(h),
                    p(emb),
                    p(dev.hnorm.ptr),
                    p(dev.enorm.ptr),
                    p(hn),
                    p(en),
                    i(hc),
                    i(d),
                    i(fused as usize),
                    fl(cfg.rms_eps),
                ],
            );
            match &mw.input {
                MtpInput::Split { e_proj, h_proj } => {
                    products(ops, table, &[(*e_proj, en, ex, rows), (*h_proj, hn, xs, rows * hc)])?;
                    launch(
                        ops,
                        k.add_rows,
                        ((rows * hc * d).div_ceil(256) as u32, 1, 1),
                        256,
                        0,
                        vec![p(xs), p(ex), i(rows * hc), i(d), i(hc)],
                    );
                }
                MtpInput::Fused { eh_proj } => products(ops, table, &[(*eh_proj, hn, xs, rows * hc)])?,
            }
            Ok(())
        };
        if let Body::Mtp { dev, w: mw, img: dimg, .. } = &body {
            // H: the streams in x (the trunk's, uploaded, or the previous MTP step's output),
            // E[t] uploaded to `emb`; the streams back to x.
            cur.set(dimg);
            mtp_input(&mut ops, &mut table, mw, dev, 1, [b.x.ptr, dev.emb.ptr, b.flat.ptr, b.y.ptr, b.h.ptr, b.x.ptr])?;
        }
        let ff = w.layers[0].gate_exps.first.n_out;
        let ff_sh = w.layers[0].gate_sh.n_out;
        let kk = cfg.n_experts_used;
        // Routed expert products: each expert's rows in chunks of at most `chunk` rows (see
        // ds4_route), at most one descriptor per (row, expert) pair.
        let chunk = n.min(if prefill { self.prefill_chunk } else { EXPERT_CHUNK });
        // A prompt's IQ2_XXS gate and up products and Q2_K down products on the tensor cores
        // (gemm_experts.cu): an expert's rows in chunks of up to 32 (the layers whose weights
        // they take, `gx_takes` and `gq_takes`).
        let gx = prefill && self.expert_mma && sm80;
        let chunk_gx = n.min(self.gx_tile.max_rows());
        let max_descs = if chunk >= n && (!gx || chunk_gx >= n) { (n * kk).min(cfg.n_experts) } else { n * kk };

        // The Sinkhorn iterations of a site's mix on the side branch (queued by the caller).
        let sinkhorn = |mix: u64| {
            Op::Side(Launch {
                f: k.hc_sinkhorn,
                grid: g1,
                block: 32,
                smem: 0,
                args: vec![p(mix), i(hc), fl(cfg.hc_eps), i(cfg.sinkhorn_iters)],
                label: String::new(),
            })
        };
        // A hyper-connection site on the streams `x` (`n` rows): the mixing logits, then
        // ds4_hc_pre's collapse into h with the sublayer's input norm and its mix; with
        // `expand`, the Sinkhorn iterations the expansion's mixing matrix needs (on the side
        // branch, returned for the caller to queue, or inside ds4_hc_pre), else none (the
        // drafter upkeep reads only h). With `post` (the sublayer output and mix of the
        // previous site), that site's expansion of x first (ds4_hc_post).
        let hc_site = |ops: &mut Vec<_>,
                       table: &mut Vec<u8>,
                       hw: &HyperWeights,
                       base_scale: &(DevBuf, DevBuf),
                       x: u64,
                       mix: u64,
                       norm: u64,
                       expand: bool,
                       post: Option<(u64, u64)>|
         -> Result<Option<Op<PArg>>> {
            let iters = if fork || !expand { 0 } else { cfg.sinkhorn_iters };
            // The arguments ds4_hc_site and ds4_hc_pre share, in their order.
            let common = vec![
                p(x),
                p(b.h.ptr),
                p(mix),
                p(base_scale.0.ptr),
                p(base_scale.1.ptr),
                i(hc),
                i(d),
                fl(cfg.hc_eps),
                i(iters),
                p(norm),
                fl(cfg.rms_eps),
            ];
            // A decode's or verify's site in one cluster launch (ds4_hc_site, decode_ops.cu),
            // the expansion folded in, where its shape allows; a prompt's step keeps the
            // product and ds4_hc_pre (for hundreds of rows a cluster a row is slower), unless
            // its products are the decode's too (DS4_CUDA_GEMM=0: every call's rows then have
            // the bits of single decodes). Faster on an H200 (Flash at a 2100-token context:
            // steps 8.43 against 8.49 ms with DS4_CUDA_HC_SITE=0), if by less than the launches
            // it saves: the cluster's barriers and remote reads make the launch slow (in the
            // lab 10.6 us back to back against 6.9 for ds4_hc_pre alone).
            // (Measurements: scripts/kernel_lab/HISTORY.md, "program.rs: hc_site cluster".)
            let proj = hw.proj;
            let w_f16 = match proj.ty {
                crate::quant::GgmlType::F16 => Some(1),
                crate::quant::GgmlType::F32 => Some(0),
                _ => None,
            };
            let cols = d / HC_SITE_CLUSTER;
            let threads = cols.div_ceil(32) * 32;
            let elem = if w_f16 == Some(1) { 2 } else { 4 };
            if let Some(w_f16) = w_f16.filter(|_| {
                self.hc_fused
                    && (!prefill || !self.gemm_on)
                    && (1..=HC_SITE_MAX).contains(&hc)
                    && d.is_multiple_of(HC_SITE_CLUSTER)
                    && threads <= HC_SITE_THREADS
                    && proj.n_out == n_mix
                    && proj.n_in == hc * d
                    && proj.row_bytes == elem * hc * d
            }) {
                let (pf, pm) = post.map_or((null, null), |(f, m)| (p(f), p(m)));
                launch(
                    ops,
                    k.hc_site,
                    (HC_SITE_CLUSTER as u32, nn, 1),
                    threads as u32,
                    0,
                    [vec![p(cur.get().addr(proj.start)), i(proj.row_bytes), i(w_f16)], common, vec![pf, pm]].concat(),
                );
                return Ok((fork && expand).then(|| sinkhorn(mix)));
            }
            if let Some((f, m)) = post {
                launch(ops, k.hc_post, rows_grid(d.div_ceil(256)), 256, 0, vec![p(x), p(f), p(m), i(hc), i(d)]);
            }
            // The mixing logits of the raw streams; ds4_hc_pre applies their RMS scale.
            // (Tried and dropped: the kernels that write the streams (ds4_hc_post,
            // ds4_moe_combine) leaving their partial products with this projection for
            // ds4_hc_pre to sum; the whole site in one launch whose last block to arrive (an
            // atomic count) sums the slices; both slower. ds4_hc_site, above, is that idea on a
            // cluster: every block stays resident and adds the others' parts itself, with no
            // last block and no atomic count.)
            // (Measurements: scripts/kernel_lab/HISTORY.md, "program.rs: hc_site logits".)
            products(ops, table, &[(hw.proj, x, b.mixl.ptr, n)])?;
            launch(ops, k.hc_pre, g1, wide(d), 0, [vec![p(b.mixl.ptr), i(n_mix)], common].concat());
            Ok((fork && expand).then(|| sinkhorn(mix)))
        };
        for job in &jobs {
            let (lw, spec, c, mm) = (job.lw, job.spec, job.c, job.mm);
            cur.set(job.img);
            // ---- attention
            if self.prefetch_q_b {
                prefetch(&mut ops, &lw.q_b);
            }
            let mut sinkhorn_a = hc_site(
                &mut ops,
                &mut table,
                &lw.hc_attn,
                &c.hc_attn,
                b.x.ptr,
                b.mix_a.ptr,
                c.attn_norm.ptr,
                true,
                None,
            )?;
            // The compressors' and indexer's projections of h (all but the indexer's q_b, which
            // reads the normed q_a), which only finish_rows and the compressors read.
            // Each to its state in the layer's mirror (a layer has compressor weights exactly
            // when its mirror has a compressor, and indexer weights exactly when it has an
            // indexer: see `decoder_for`).
            let of_h: Vec<(Mat, u64, u64, usize)> = projections_of_h(lw)
                .into_iter()
                .filter_map(|(m, to)| {
                    let y = match (to, &mm.comp, &mm.index) {
                        (OfH::CompKv, Some(cm), _) => cm.log_kv.ptr,
                        (OfH::CompGate, Some(cm), _) => cm.log_g.ptr,
                        (OfH::IndexProj, _, Some(_)) => b.ig.ptr,
                        (OfH::IndexKv, _, Some(im)) => im.log_kv.ptr,
                        (OfH::IndexGate, _, Some(im)) => im.log_g.ptr,
                        _ => return None,
                    };
                    Some((m, b.h.ptr, y, n))
                })
                .collect();
            // In a decode or verify they run on the side branch from here, beside the query
            // path (q_a and kv, the q_a norm, q_b), with their partial sums in the side's own
            // region (`products_on`), and the main stream waits for them before finish_rows;
            // the Sinkhorn iterations then fork after that wait, so that it does not wait for
            // them too. `DS4_CUDA_SIDE_PROJ=0` keeps them on the main stream after q_b, in q_b's
            // call. On an H200 (Flash at a 2100-token context) verifies of 8 rows took 23.65 ms
            // against 24.18, steps the same. The indexer's q_b on the main stream after q_b gave
            // the same within the noise. (An earlier try with the compressors' updates on the
            // branch too was slower: see `SideBranch`.)
            // (Measurements: scripts/kernel_lab/HISTORY.md, "program.rs: proj_side".)
            let proj_side = fork && self.side_proj && !prefill && n <= N_MAX && !of_h.is_empty();
            if proj_side {
                products_on(&mut ops, &mut table, &of_h, None, true)?;
            } else {
                ops.extend(sinkhorn_a.take());
            }
            let qa_at = ops.len();
            products(&mut ops, &mut table, &[(lw.q_a, b.h.ptr, b.cq.ptr, n), (lw.kv, b.h.ptr, b.kv.ptr, n)])?;
            // The q_a norm in that launch (`tail_kernel`), as ds4_rms_weight's launch below
            // computes it, or that launch.
            let (qa_norm, qa_threads) = (c.q_a_norm.ptr, wide(cfg.q_lora_rank));
            match tail_kernel(self.norm_tail, n, prefill, lw.q_a.ty, 4)
                .and_then(|fi| take_tail(&mut ops, qa_at, &lw.q_a, k.norm_tail[fi]))
            {
                Some(mut l) => {
                    l.args.extend([p(b.cq.ptr), p(qa_norm), i(cfg.q_lora_rank), fl(cfg.rms_eps)]);
                    l.args.extend([i(qa_threads as usize), p(b.tail_done.ptr + 4)]);
                    ops.push(Op::Launch(l));
                }
                None => launch(
                    &mut ops,
                    k.rms_weight,
                    g1,
                    qa_threads,
                    0,
                    vec![p(b.cq.ptr), p(b.cq.ptr), p(qa_norm), i(cfg.q_lora_rank), fl(cfg.rms_eps)],
                ),
            }
            // After q_b (which needs only q_a and its norm), in one call, unless they run on the
            // side branch (above): the compressors' and indexer's products (F16 in ds4's
            // layout), which finish_rows and the compressors need. With q_a, as they were, they
            // held the query path back and took a launch of their own; here a CSA layer has one
            // launch less for about the same step. The compressors' projections go to the
            // layer's own buffers, which the compressor reads and the journal packs for the
            // host's replay of the step. (A layer has compressor weights exactly when its mirror
            // has a compressor, and indexer weights exactly when it has an indexer: see
            // `decoder_for`.) (Measurements: scripts/kernel_lab/HISTORY.md,
            // "program.rs: q_b products".)
            let mut g = vec![(lw.q_b, b.cq.ptr, b.q.ptr, n)];
            if !proj_side {
                g.extend(of_h);
            }
            if let (Some(iw), Some(_)) = (&lw.indexer, &mm.index) {
                let iqb = (iw.q_b, b.cq.ptr, b.iq.ptr, n);
                if proj_side {
                    // The indexer's q_b on the side branch too, forked after the q_a norm.
                    products_on(&mut ops, &mut table, &[iqb], None, true)?;
                } else {
                    g.push(iqb);
                }
            }
            products(&mut ops, &mut table, &g)?;
            if proj_side {
                ops.push(Op::Join);
                ops.extend(sinkhorn_a.take());
            }
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
                let prev = cm.prev.as_ref().map_or(null, |b| p(b.ptr));
                let args = vec![
                    p(cm.log_kv.ptr),
                    p(cm.log_g.ptr),
                    p(cc.0.ptr),
                    p(cc.1.ptr),
                    fl(cfg.rms_eps),
                    p(cm.cur_kv.ptr),
                    p(cm.cur_score.ptr),
                    prev,
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
                ];
                if !split_over_blocks(self.compress_split, n) {
                    launch(ops, k.compress, (1, 1, 1), 256, 0, args);
                    return;
                }
                launch(ops, k.compress_windows, (n.div_ceil(cm.ratio) as u32, 1, 1), 256, 0, args);
                let pw = if cm.overlap { 2 } else { 1 } * cm.width;
                launch(
                    ops,
                    k.compress_state,
                    ((cm.ratio * pw).div_ceil(256) as u32, 1, 1),
                    256,
                    0,
                    vec![
                        p(cm.log_kv.ptr),
                        p(cm.log_g.ptr),
                        p(cc.0.ptr),
                        p(cm.cur_kv.ptr),
                        p(cm.cur_score.ptr),
                        prev,
                        i(cm.width),
                        i(cm.ratio),
                        i(cm.overlap as usize),
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
                let imma = index_mma(
                    self.index_mma,
                    self.index_mma_steps,
                    prefill,
                    sm80,
                    cfg.index_heads,
                    cfg.index_head_dim,
                    ctx.smem_optin,
                );
                let (f, grid, smem) = if imma {
                    (k.index_scores_mma, index_mma_blocks(n), index_mma_smem(cfg.index_heads) as u32)
                } else {
                    (k.index_scores, index_blocks(n), 0)
                };
                launch(
                    &mut ops,
                    f,
                    (grid, nn, 1),
                    256,
                    smem,
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
            let lgs = if job.block { cfg.window + n } else { mm.max_keys(cfg.window, cfg.index_topk) };
            let (logit_blocks, out_blocks) = attention_blocks(nh, hd, lgs)?;
            // The keys of each row, as both kernels take them.
            let keys = [p(mm.ring.ptr), i(mm.slots), i(cfg.window), i(job.block as usize), p(crows), i(ratio), p(sel)]
                .into_iter()
                .chain([p(nsel), i(cfg.index_topk)])
                .collect::<Vec<_>>();
            // What both kernels take after the keys: the sinks, the shape, the grouped output
            // and the inverse rope.
            let out = [p(c.sinks.ptr), i(nh), i(hd), p(b.o.ptr), i(cfg.o_groups), p(c.inv_freq.ptr), i(rope_dim)];
            let on_tc = !job.block && attention_mma(self.attn_mma, prefill, sm80, hd, lgs, ctx.smem_optin);
            if on_tc {
                launch(
                    &mut ops,
                    k.attention_mma,
                    (nh.div_ceil(16) as u32, nn, 1),
                    256,
                    attention_mma_smem(hd, lgs) as u32,
                    [vec![p(b.q.ptr)], keys.to_vec(), out.to_vec(), vec![i(lgs), p(step)]].concat(),
                );
            } else {
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
                    [vec![p(b.lg.ptr), i(lgs)], keys.to_vec(), out.to_vec(), vec![p(step)]].concat(),
                );
            }
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
            // The attention site's hyper-connection expansion of x, in the FFN site's launch
            // (hc_site's `post`; the FFN site's own is fused into ds4_moe_combine).
            if fork {
                ops.push(Op::Join);
            }

            // ---- MoE
            let post = Some((b.attn_out.ptr, b.mix_a.ptr));
            let sinkhorn_f =
                hc_site(&mut ops, &mut table, &lw.hc_ffn, &c.hc_ffn, b.x.ptr, b.mix_f.ptr, c.ffn_norm.ptr, true, post)?;
            ops.extend(sinkhorn_f);
            // The shared expert (its products, its swiglu) reads only h and its own buffers,
            // and only ds4_moe_combine reads its output: with the side branch it runs there,
            // beside the router and the routed experts, whose kernels leave DRAM bandwidth
            // unused (they are bound by issue and L1). Its products must not be split
            // (slices > 1): the partial sums and counters belong to the main stream's launches.
            // (Nor in a prefill step: its tensor-core products are split by gemm.rs's rule.)
            // (Tried and dropped: forking it only after ds4_route, no gain (nor did
            // DS4_CUDA_PRIORITY=1 change that); queuing it on the side branch before the Sinkhorn
            // iterations, beside the router, slower: Flash steps 8.48 ms against 8.37 on an H200.)
            // (Measurements: scripts/kernel_lab/HISTORY.md, "program.rs: shared_side".)
            let shared_side = fork && !prefill && [lw.gate_sh, lw.up_sh, lw.down_sh].iter().all(|m| slices(m) == 1);
            // Where the router product's launch is, when it has one of its own.
            let mut router_at: Option<usize> = None;
            let shared_swiglu = |ops: &mut Vec<_>| {
                swiglu(ops, [b.gsh.ptr, b.ush.ptr, b.ash.ptr], n * ff_sh, spec.clamp_shared, ff_sh, false)
            };
            let gate_up_sh = [(lw.gate_sh, b.h.ptr, b.gsh.ptr, n), (lw.up_sh, b.h.ptr, b.ush.ptr, n)];
            let down_sh = [(lw.down_sh, b.ash.ptr, b.dsh.ptr, n)];
            if shared_side {
                let first = ops.len();
                products(&mut ops, &mut table, &gate_up_sh)?;
                shared_swiglu(&mut ops);
                products(&mut ops, &mut table, &down_sh)?;
                to_side(&mut ops, first);
                router_at = Some(ops.len());
                products(&mut ops, &mut table, &[(lw.router_proj, b.h.ptr, b.rl.ptr, n)])?;
            } else {
                let mut g = vec![(lw.router_proj, b.h.ptr, b.rl.ptr, n)];
                g.extend(gate_up_sh);
                products(&mut ops, &mut table, &g)?;
            }
            // Templates of the routed products (ds4_route fills in expert, rows, offsets).
            let templ = |m: Mat, x: u64, y: u64, part_base: usize, counter: usize| {
                CudaBackend::desc(cur.get().addr(m.start), &m, &m, x, y, b.part.ptr + 4 * part_base as u64, 0, counter)
                    .0
            };
            let (gm, um, dm) = (lw.gate_exps.first, lw.up_exps.first, lw.down_exps.first);
            let gx_on = gx && gx_takes(&gm, cur.get().addr(gm.start)) && gx_takes(&um, cur.get().addr(um.start));
            let chunk_gu = if gx_on { chunk_gx } else { chunk };
            let dx_on = gx && self.expert_mma_down && gq_takes(&dm, cur.get().addr(dm.start));
            let chunk_dn = if dx_on { chunk_gx } else { chunk };
            // Partial sums only for split products (as `products` lays them out); none on the
            // tensor cores.
            let part_of = |m: &Mat| if slices(m) > 1 { max_descs * slices(m) * chunk * m.n_out } else { 0 };
            let gate_part = if gx_on { 0 } else { part_of(&gm) };
            let gate_counters = max_descs * row_blocks(&gm);
            let up_part = if gx_on { 0 } else { part_of(&um) };
            let down_part = if dx_on { 0 } else { part_of(&dm) };
            if gate_part + up_part > b.part_floats || down_part > b.part_floats {
                return Err(Error::Backend(
                    "CUDA decode: partial-sum buffer too small for the experts (internal)".into(),
                ));
            }
            // The tensor-core kernel's template: warps of the tile's outputs, no split.
            let templ_gx = |m: Mat, x: u64, y: u64| {
                let (mut t, _) = CudaBackend::desc_split(cur.get().addr(m.start), &m, &m, x, y, 0, 0, 0, (1, 1));
                t.warp_rows = self.gx_tile.warp_rows() as i32;
                t
            };
            let t_off = table.len();
            let (tg, tu) = if gx_on {
                (templ_gx(gm, b.xg.ptr, b.g_out.ptr), templ_gx(um, b.xg.ptr, b.u_out.ptr))
            } else {
                (templ(gm, b.xg.ptr, b.g_out.ptr, 0, 0), templ(um, b.xg.ptr, b.u_out.ptr, gate_part, gate_counters))
            };
            let td = if dx_on {
                templ_gx(dm, b.act.ptr, b.down_out.ptr)
            } else {
                templ(dm, b.act.ptr, b.down_out.ptr, 0, 0)
            };
            for t in [tg, tu, td] {
                table.extend_from_slice(desc_bytes(&t));
            }
            let gu_off = table.len();
            table.resize(gu_off + 2 * max_descs * std::mem::size_of::<Desc>(), 0);
            let down_off = table.len();
            table.resize(down_off + max_descs * std::mem::size_of::<Desc>(), 0);
            let router_args = vec![
                p(b.rl.ptr),
                i(cfg.n_experts),
                i(kk),
                c.bias.as_ref().map_or(null, |x| p(x.ptr)),
                c.hash.as_ref().map_or(null, |x| p(x.ptr)),
                i(cfg.expert_weights_norm as usize),
                fl(cfg.expert_weights_scale),
                i(n),
                p(step),
            ];
            // The gate, up and down tables and the routing's other outputs, for either launch.
            let tables = vec![
                PArg::Table(gu_off),
                PArg::Table(down_off),
                i(max_descs),
                PArg::Table(t_off),
                p(b.gather_src.ptr),
                p(b.comb_slot.ptr),
                p(b.comb_w.ptr),
                p(b.comb_cnt.ptr),
                i(chunk_gu),
                i(chunk_dn),
            ];
            // The routing in the router product's launch (`tail_kernel`), with the routing's
            // arguments and shared memory.
            let tail = tail_kernel(self.route_tail, n, prefill, lw.router_proj.ty, 3)
                .zip(router_at)
                .and_then(|(fi, at)| take_tail(&mut ops, at, &lw.router_proj, k.router_route[fi]));
            let routed_in_tail = tail.is_some();
            if let Some(mut l) = tail {
                l.smem = l.smem.max(route_smem(1, kk, cfg.n_experts) as u32);
                l.args.extend(router_args.iter().chain(&tables).copied());
                l.args.push(p(b.tail_done.ptr));
                ops.push(Op::Launch(l));
            }
            let picks = if !routed_in_tail && split_over_blocks(self.route_pick, n) {
                let mut args = router_args.clone();
                args.extend([p(b.picks.ptr), p(b.pick_w.ptr)]);
                launch(&mut ops, k.route_pick, (route_pick_grid(n, cfg.n_experts), 1, 1), ROUTE_PICK_THREADS, 0, args);
                [p(b.picks.ptr), p(b.pick_w.ptr)]
            } else {
                [null, null]
            };
            let mut args = router_args;
            args.extend(tables);
            args.extend(picks);
            if !routed_in_tail {
                launch(&mut ops, k.route, (1, 1, 1), 256, route_smem(n, kk, cfg.n_experts) as u32, args);
            }
            // The gathered rows as 8-bit activations when their gate and up products take them.
            // (Tried and dropped at one row, each with no gather launch: ds4_route quantizing
            // the row itself, slower; ds4_hc_pre writing the FFN site's collapse as 8-bit
            // activations, no faster.)
            // (Measurements: scripts/kernel_lab/HISTORY.md, "program.rs: ds4_gather".)
            let act8 = crate::quant::act8::takes_act8(gm.ty);
            if self.wide && prefill && act8 {
                // Four blocks of 32 values a warp (`wide_swiglu`'s note).
                let args = vec![p(b.h.ptr), p(b.xg.ptr), p(b.gather_src.ptr), i(d)];
                launch(&mut ops, k.gather4, ((n * kk) as u32, d.div_ceil(1024) as u32, 1), 256, 0, args);
            } else {
                launch(
                    &mut ops,
                    k.gather,
                    // One warp per block of 32 values (act8) or per 32 float4s (a copy).
                    ((n * kk) as u32, d.div_ceil(if act8 { 256 } else { 1024 }) as u32, 1),
                    256,
                    0,
                    vec![p(b.h.ptr), p(b.xg.ptr), p(b.gather_src.ptr), i(d), i(act8 as usize)],
                );
            }
            let bpd = |m: &Mat| row_blocks(m) * slices(m);
            let bpd_gx = |m: &Mat| m.n_out.div_ceil(MV_WARPS * self.gx_tile.warp_rows());
            if um.ty != gm.ty || um.n_out != gm.n_out || um.n_in != gm.n_in {
                return Err(Error::Backend("CUDA decode: expert gate and up differ in shape (unsupported)".into()));
            }
            // A launch of routed products over the table ds4_route writes at `off` (max_descs
            // descriptors a matrix of `mats`, which share one shape): the tensor-core kernel
            // `mma`, or the decode's product kernel for `chunk` rows (not early: ds4_route
            // writes the table).
            // A launch of the tensor-core kernel takes at most `resident` blocks (the table's
            // blocks when None), which walk the live ones.
            let routed =
                |ops: &mut Vec<Op<PArg>>, mma: Option<(sys::CUfunction, Option<usize>)>, mats: &[Mat], off: usize| {
                    let count = mats.len() * max_descs;
                    match mma {
                        Some((f, resident)) => {
                            let all: usize = mats.iter().map(|m| max_descs * bpd_gx(m)).sum();
                            let blocks = resident.map_or(all, |r| r.min(all));
                            let args = vec![PArg::Table(off), i(count), p(b.counters.ptr)];
                            launch(ops, f, (blocks as u32, 1, 1), (32 * MV_WARPS) as u32, 0, args);
                        }
                        None => {
                            let (f, smem) = ctx
                                .kernel(mats[0].ty, mats[0].n_in, mats[0].n_out, chunk)
                                .ok_or_else(|| Error::Backend("CUDA: no product kernel".into()))?;
                            let blocks: usize = mats.iter().map(|m| max_descs * bpd(m)).sum();
                            let args = vec![PArg::Table(off), i(count), p(b.counters.ptr), i(0)];
                            launch(ops, f, (blocks as u32, 1, 1), THREADS, smem, args);
                        }
                    }
                    Ok::<(), Error>(())
                };
            let (mma_iq2, mma_q2k) = k.moe_mma[self.gx_tile.index()];
            routed(&mut ops, gx_on.then_some((mma_iq2, self.gx_grid.map(|g| g.0))), &[gm, um], gu_off)?;
            if !shared_side {
                shared_swiglu(&mut ops);
            }
            // The activations as 8-bit ones when the down products take them (Q2_K).
            let act8_down = crate::quant::act8::takes_act8(dm.ty);
            swiglu(&mut ops, [b.g_out.ptr, b.u_out.ptr, b.act.ptr], n * kk * ff, spec.clamp_routed, ff, act8_down);
            if !shared_side {
                products(&mut ops, &mut table, &down_sh)?;
            }
            routed(&mut ops, dx_on.then_some((mma_q2k, self.gx_grid.map(|g| g.1))), &[dm], down_off)?;
            if fork {
                ops.push(Op::Join);
            }
            // (Tried and dropped: this combine and expansion folded into the next layer's
            // attention-site ds4_hc_site; the same bits, but Flash steps no faster on an H200:
            // 8.68 ms against 8.61 without the fold.)
            // (Measurements: scripts/kernel_lab/HISTORY.md, "program.rs: ds4_moe_combine".)
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
            if let Some(j) = job.capture {
                let bytes = n * hc * d * 4;
                ops.push(Op::Copy { dst: b.capture.ptr + (j * cap * hc * d * 4) as u64, src: b.x.ptr, bytes });
            }
        }

        // ---- head: the target's, or a drafter's HC head and norm before the target's output
        // matrix (DSpark's normed rows apart, in h, so that y keeps the hidden rows).
        let (head, argmax, hc_proj, head_img, (norm, base, scale)) = match &body {
            Body::Trunk { head, argmax, .. } => (*head, *argmax, w.hc_head.proj, img, &self.head_consts),
            Body::Mtp { dev, w: mw, img: dimg, head } => (
                head.then_some((0, 1)),
                true,
                mw.hc_head.proj,
                if mw.head_from_target { img } else { *dimg },
                &dev.head,
            ),
            Body::DSpark { dev, w: dw, img: dimg } => (Some((0, n)), false, dw.hc_head.proj, *dimg, &dev.head),
        };
        let normed = if matches!(body, Body::DSpark { .. }) { b.h.ptr } else { b.y.ptr };
        if let Some((r0, rows)) = head {
            let xr = b.x.ptr + 4 * (r0 * hc * d) as u64;
            let gr = (rows as u32, 1, 1);
            cur.set(head_img);
            launch(&mut ops, k.rms_plain, gr, wide(hc * d), 0, vec![p(xr), p(b.flat.ptr), i(hc * d), fl(cfg.rms_eps)]);
            products(&mut ops, &mut table, &[(hc_proj, b.flat.ptr, b.mixl.ptr, rows)])?;
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
                vec![p(b.y.ptr), p(normed), p(norm.ptr), i(d), fl(cfg.rms_eps)],
            );
            cur.set(img);
            products(&mut ops, &mut table, &[(w.output, normed, b.logits.ptr, rows)])?;
            if argmax {
                launch(&mut ops, k.argmax, gr, ARGMAX_THREADS, 0, vec![p(b.logits.ptr), i(cfg.vocab), p(b.ids.ptr)]);
            }
        }

        // ---- DSpark's Markov and confidence heads, row by row (MarkovDevice, mod.rs).
        if let Body::DSpark { dev, w: dw, img: dimg } = &body {
            if let (Some(mk), Some(w2)) = (&dev.markov, dw.markov_w2) {
                cur.set(dimg);
                let v = cfg.vocab;
                for r in 0..n {
                    launch(
                        &mut ops,
                        k.markov_in,
                        ((d + mk.rank).div_ceil(256) as u32, 1, 1),
                        256,
                        0,
                        vec![p(mk.w1.ptr), i(mk.rank), p(step), p(b.ids.ptr), i(r), p(b.y.ptr), i(d), p(mk.cat.ptr)],
                    );
                    let mut heads = vec![(w2, mk.cat.ptr + 4 * d as u64, mk.bias.ptr, 1)];
                    if let Some(cw) = dw.confidence {
                        heads.push((cw, mk.cat.ptr, mk.conf.ptr + 4 * r as u64, 1));
                    }
                    products(&mut ops, &mut table, &heads)?;
                    let row = mk.logits.ptr + 4 * (r * v) as u64;
                    ops.push(Op::Copy { dst: row, src: b.logits.ptr + 4 * (r * v) as u64, bytes: 4 * v });
                    launch(
                        &mut ops,
                        k.add_rows,
                        (v.div_ceil(256) as u32, 1, 1),
                        256,
                        0,
                        vec![p(row), p(mk.bias.ptr), i(1), i(v), i(1)],
                    );
                    launch(
                        &mut ops,
                        k.argmax,
                        (1, 1, 1),
                        ARGMAX_THREADS,
                        0,
                        vec![p(row), i(v), p(b.ids.ptr + 4 * r as u64)],
                    );
                }
            }
        }

        // ---- the drafter's new window rows (Upkeep, mod.rs), as Model::draft_rows computes them
        if let (Body::Trunk { upkeep: Some(dimg), .. }, Some(uk), Some(dm)) = (&body, &self.upkeep, &model.draft) {
            cur.set(dimg);
            let hdb = (hd * 4) as u64;
            // finish_rows' K=V block alone (no query or indexer heads), into the upkeep's slots.
            let kv_rows = |ops: &mut Vec<_>, st: u64, kv: u64, c: &LayerConsts, rows: u64| {
                launch(
                    ops,
                    k.finish_rows,
                    (1, nn, 1),
                    128,
                    0,
                    vec![
                        null,
                        i(0),
                        i(hd),
                        fl(cfg.rms_eps),
                        p(c.inv_freq.ptr),
                        i(cfg.rope_dim),
                        p(st),
                        p(kv),
                        p(c.kv_norm.ptr),
                        i(self.round_mode as usize),
                        p(rows),
                        i(cap),
                        null,
                        null,
                        i(0),
                        i(cfg.index_head_dim),
                        fl(1.0),
                    ],
                );
            };
            match (&dm.kind, &self.mtp, &self.dspark) {
                (DraftKind::Mtp(mw), Some(dev), _) => {
                    // The pairs' streams: the pending ones (uploaded to row 0) and the step's
                    // rows but the last in DeepSeek's pairing, else the step's rows.
                    let (first, rows) = match dm.pairing {
                        crate::model::draft::MtpPairing::Next => (1, n - 1),
                        crate::model::draft::MtpPairing::Same => (0, n),
                    };
                    if rows > 0 {
                        let dst = uk.h.ptr + (4 * first * hc * d) as u64;
                        ops.push(Op::Copy { dst, src: b.x.ptr, bytes: 4 * rows * hc * d });
                    }
                    let bufs = [uk.h.ptr, uk.emb.ptr, uk.hn.ptr, uk.en.ptr, uk.ex.ptr, uk.xs.ptr];
                    mtp_input(&mut ops, &mut table, mw, dev, n, bufs)?;
                    // The block's attention-site collapse and its norm (no Sinkhorn: only the
                    // expansion reads the mixing matrix), then its K=V rows.
                    let c = &dev.consts;
                    let hw = &mw.block.hc_attn;
                    let none = hc_site(
                        &mut ops,
                        &mut table,
                        hw,
                        &c.hc_attn,
                        uk.xs.ptr,
                        b.mix_a.ptr,
                        c.attn_norm.ptr,
                        false,
                        None,
                    )?;
                    debug_assert!(none.is_none(), "no expansion, no Sinkhorn iterations");
                    products(&mut ops, &mut table, &[(mw.block.kv, b.h.ptr, b.kv.ptr, n)])?;
                    kv_rows(&mut ops, uk.step.ptr, b.kv.ptr, c, uk.rows.ptr);
                }
                (DraftKind::DSpark(dw), _, Some(dev)) => {
                    // Each row's captured streams averaged, main_proj and its norm, then each
                    // stage's K=V rows, at the step's positions.
                    let kl = dw.target_layers.len();
                    launch(
                        &mut ops,
                        k.mean_streams,
                        (d.div_ceil(256) as u32, kl as u32, nn),
                        256,
                        0,
                        vec![p(b.capture.ptr), i(cap * hc * d), p(uk.en.ptr), i(kl), i(hc), i(d)],
                    );
                    products(&mut ops, &mut table, &[(dw.main_proj, uk.en.ptr, uk.ex.ptr, n)])?;
                    launch(
                        &mut ops,
                        k.rms_weight,
                        g1,
                        wide(d),
                        0,
                        vec![p(uk.ex.ptr), p(uk.ex.ptr), p(dev.main_norm.ptr), i(d), fl(cfg.rms_eps)],
                    );
                    let at = |buf: &DevBuf, s: usize| buf.ptr + (s * cap) as u64 * hdb;
                    let kvs: Vec<_> =
                        dw.stages.iter().enumerate().map(|(s, st)| (st.kv, uk.ex.ptr, at(&uk.kv, s), n)).collect();
                    products(&mut ops, &mut table, &kvs)?;
                    for (s, (c, _)) in dev.stages.iter().enumerate() {
                        kv_rows(&mut ops, step, at(&uk.kv, s), c, at(&uk.rows, s));
                    }
                }
                _ => {
                    return Err(Error::Backend("CUDA decode: no device path for the drafter's rows (internal)".into()))
                }
            }
        }

        // Every launch within its kernel's threads a block (what its registers allow): a wrong
        // one would fail only when the program's graph is instantiated, without saying which.
        let mut max_threads: std::collections::HashMap<usize, i32> = std::collections::HashMap::new();
        for op in &ops {
            let (Op::Launch(l) | Op::Side(l) | Op::Ahead(l)) = op else { continue };
            let max = match max_threads.get(&(l.f as usize)) {
                Some(&m) => m,
                None => {
                    // SAFETY: a function of this context's module.
                    let m = unsafe {
                        cu::function::get_function_attribute(
                            l.f,
                            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                        )
                    }
                    .map_err(driver_err("reading a kernel's attributes"))?;
                    max_threads.insert(l.f as usize, m);
                    m
                }
            };
            if l.block as i32 > max {
                let name = k.name_of(l.f).map(str::to_string).or_else(|| ctx.product_kernel_name(l.f));
                return Err(Error::Backend(format!(
                    "CUDA decode: {} launched with {} threads a block, more than its {max} (internal)",
                    name.as_deref().unwrap_or("a kernel"),
                    l.block
                )));
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
                Op::Ahead(l) => Op::Ahead(l.map_args(resolve)),
                Op::Join => Op::Join,
            })
            .collect();
        Ok(Program { ops, _tables: tables, graph: None })
    }
}
