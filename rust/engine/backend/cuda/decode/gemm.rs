//! The prefill programs' tensor-core products (`shaders/cuda/gemm.cu`): which products take
//! them, how a product's work is split, and what it needs of the scratch buffers.
//!
//! A *prefill* step is one of a prompt's chunks (a session's batch longer than the decoder's
//! rows: [`crate::backend::DeviceDecoder::set_prefill`]). Its F16 products and its Q8_0 products
//! on the float-x layout run `ds4_gemm_f16` / `ds4_gemm_q8_0`, those on the decode's tensor-core
//! layout `ds4_gemm_q8_0_mq`. These kernels are row-invariant among themselves but do not give the decode
//! kernels' bits, so decode steps and verifies never run them: a verify stays bitwise its rows'
//! single decodes, and a prompt is evaluated the same way in plain and speculative decoding.

use super::super::{tensor_cores, CudaBackend, Desc, MV_WARPS};
use crate::model::weights::Mat;
use crate::quant::split::q8_0::TILE_ROWS;
use crate::quant::GgmlType;

/// Output rows one warp of the kernels computes (`GEMM_TILES` n8 tiles in gemm.cu).
pub(super) const GEMM_WARP_ROWS: usize = 32;

/// Inputs of a unit (the kernels' step along a row: two m16n8k16 steps).
const UNIT: usize = 32;

/// Fewest units a slice keeps when the units of a product are split between blocks.
const MIN_UNITS_PER_SLICE: usize = 8;

/// Warps a product should have at least to keep the GPU busy: a prompt's step of 256 rows runs
/// four descriptors a product, so 1024 warps, 256 blocks, about one wave of an H200 at two
/// blocks an SM (the kernel's registers allow two). More slices cost more than the fuller GPU
/// gains: a target of 512 picked twice the slices and was slower on each shape measured (the
/// kernel lab's `ds4_gemm_q8_0` on an H200, 1024 x 4096: 86.7 us in 16 slices against 72.5 in
/// 8). The slices follow the shape only, so steps of 512 rows (eight descriptors a product)
/// split the same way. (Measurements: scripts/kernel_lab/HISTORY.md, "gemm.rs: TARGET_WARPS".)
const TARGET_WARPS: usize = 256;

/// Most batch rows of one product descriptor (`GEMM_MTILES` m16 tiles in gemm.cu, each unit of
/// weights loaded once for all of them); a prompt's step of more rows takes several.
pub(in crate::backend::cuda) const GEMM_MAX_ROWS: usize = 64;

/// The kernels (`shaders/cuda/gemm.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::backend::cuda) enum Kernel {
    F16,
    /// Q8_0 on the float-x layout.
    Q8_0,
    /// Q8_0 on the decode's tensor-core layout of 16-row tiles.
    Q8_0Tiled,
}

impl Kernel {
    pub(in crate::backend::cuda) const ALL: [Kernel; 3] = [Kernel::F16, Kernel::Q8_0, Kernel::Q8_0Tiled];

    /// The kernel's function name.
    pub(in crate::backend::cuda) fn name(self) -> &'static str {
        match self {
            Kernel::F16 => "ds4_gemm_f16",
            Kernel::Q8_0 => "ds4_gemm_q8_0",
            Kernel::Q8_0Tiled => "ds4_gemm_q8_0_mq",
        }
    }

    /// The function name of its form on split x (`ds4_gemm_split`'s tiles).
    pub(in crate::backend::cuda) fn px_name(self) -> &'static str {
        match self {
            Kernel::F16 => "ds4_gemm_px_f16",
            Kernel::Q8_0 => "ds4_gemm_px_q8_0",
            Kernel::Q8_0Tiled => "ds4_gemm_px_q8_0_mq",
        }
    }
}

/// Rows of a tile of `ds4_gemm_split`'s output (an m16 tile of the products).
pub(in crate::backend::cuda) const PX_TILE_ROWS: usize = 16;

// A descriptor's rows start on a tile of the split.
const _: () = assert!(GEMM_MAX_ROWS.is_multiple_of(PX_TILE_ROWS));

/// Bytes of one tile of `ds4_gemm_split`'s output for rows of `n_in` inputs (gemm.cu
/// `px_tile_bytes`: per unit of 32 inputs 2048 bytes of A fragments and 64 of scales).
pub(in crate::backend::cuda) fn px_tile_bytes(n_in: usize) -> usize {
    2112 * (n_in / UNIT)
}

/// The grid of `ds4_gemm_split` for `rows` rows of `n_in` inputs: blocks of eight warps, each
/// `PX_SPLIT_UNITS` (gemm.cu: 4) units of a tile.
pub(in crate::backend::cuda) fn px_split_grid(n_in: usize, rows: usize) -> (u32, u32, u32) {
    ((n_in / UNIT).div_ceil(8 * 4) as u32, rows.div_ceil(PX_TILE_ROWS) as u32, 1)
}

/// Bytes of `ds4_gemm_split`'s output for `rows` rows of `n_in` inputs (whole tiles).
pub(in crate::backend::cuda) fn px_bytes(n_in: usize, rows: usize) -> usize {
    rows.div_ceil(PX_TILE_ROWS) * px_tile_bytes(n_in)
}

/// The kernel of the products on `m` (the matrix whose shape picks the kernel, a plane's for
/// its rows: `DeviceImage::kernel_mat`): F16; Q8_0 on the float-x layout; Q8_0 on the decode's
/// tensor-core layout (`tensor_cores`) in whole 16-row tiles, with `tiled` (else those keep the
/// decode's kernel, which reads their weights once per 16 rows: `DS4_CUDA_GEMM_MQ=0`). None: no
/// kernel here takes them (nor any whose rows are not whole units).
pub(in crate::backend::cuda) fn kernel(m: &Mat, tiled: bool) -> Option<Kernel> {
    if m.n_in == 0 || !m.n_in.is_multiple_of(UNIT) {
        return None;
    }
    match m.ty {
        GgmlType::F16 => Some(Kernel::F16),
        GgmlType::Q8_0 if !tensor_cores(m.ty, m.n_in, m.n_out) => Some(Kernel::Q8_0),
        GgmlType::Q8_0 if tiled && m.n_out.is_multiple_of(TILE_ROWS) => Some(Kernel::Q8_0Tiled),
        _ => None,
    }
}

/// Whether a prefill step runs the product of `m` (the matrix that picks the kernel: see
/// [`kernel`]; the product's rows start at device address `at`) by the `rows` rows of floats at
/// `x` on the tensor cores: a shape a kernel takes, on a device of sm_80 or later (mma.sync
/// m16n8k16), with rows aligned for the kernels' vector loads (16 bytes of F16, 8 of float-x
/// Q8_0 a lane; a tile's 16 bytes a lane, tiles 16 rows of whole blocks apart; x in float4s).
pub(in crate::backend::cuda) fn takes(m: &Mat, at: u64, x: u64, rows: usize, sm80: bool, tiled: bool) -> bool {
    let Some(k) = kernel(m, tiled) else { return false };
    let (row_align, at_align) = match k {
        Kernel::F16 => (16, 16),
        Kernel::Q8_0 => (8, 8),
        Kernel::Q8_0Tiled => (1, 16),
    };
    sm80 && rows >= 1 && m.row_bytes.is_multiple_of(row_align) && at.is_multiple_of(at_align) && x.is_multiple_of(16)
}

/// The warp group of every product: a block's four warps take 128 output rows over the same
/// units, sharing each unit of x, so no warps of a block split a row group's units.
const GROUP: usize = 1;

/// The input slices (blocks that split the units) of `m`'s products in a launch of
/// `launch_rows` output rows in all (the products of one format in one call: those of a single
/// matrix of that many rows, whose blocks the launch has). A function of the shapes only (row
/// invariance): enough warps for the GPU, at least [`MIN_UNITS_PER_SLICE`] units a slice. The
/// partial sums of a split cost a round trip, so a launch of many products (the eight o_a
/// groups) splits less.
pub(in crate::backend::cuda) fn slices(m: &Mat, launch_rows: usize) -> usize {
    let units = (m.n_in / UNIT).max(1);
    let whole = Mat { n_out: launch_rows.max(m.n_out), ..*m };
    let warps = row_blocks(&whole) * MV_WARPS;
    let want = TARGET_WARPS.div_ceil(warps).clamp(1, 32).min((units / MIN_UNITS_PER_SLICE).max(1));
    // No empty slice: the kernel gives each slice ceil(units / slices) units.
    units.div_ceil(units.div_ceil(want))
}

/// Row blocks of `m`'s products: blocks of `MV_WARPS` warps of [`GEMM_WARP_ROWS`] rows.
fn row_blocks(m: &Mat) -> usize {
    m.n_out.div_ceil(MV_WARPS * GEMM_WARP_ROWS)
}

/// The descriptor of one product of `n <= GEMM_MAX_ROWS` rows of x at `x` in a launch of
/// `launch_rows` output rows ([`slices`]), and its blocks.
#[allow(clippy::too_many_arguments)]
pub(in crate::backend::cuda) fn desc(
    at: u64,
    m: &Mat,
    launch_rows: usize,
    x: u64,
    y: u64,
    y_stride: usize,
    part: u64,
    n: usize,
    counter: usize,
) -> (Desc, usize) {
    let s = slices(m, launch_rows);
    let (mut d, _) = CudaBackend::desc_split(at, m, m, x, y, part, n, counter, (GROUP, s));
    d.y_stride = y_stride as i32;
    d.warp_rows = GEMM_WARP_ROWS as i32;
    (d, row_blocks(m) * s)
}

/// Partial-sum floats and counters the products of `mats` take at `n` rows (those whose shape
/// the kernels take), at most: each split as if alone, with the most slices, in descriptors of
/// at most [`GEMM_MAX_ROWS`] rows.
pub(super) fn need(mats: &[Mat], n: usize, tiled: bool) -> (usize, usize) {
    let (mut part, mut counters) = (0, 0);
    for m in mats.iter().filter(|m| kernel(m, tiled).is_some()) {
        let s = slices(m, m.n_out);
        if s > 1 {
            part += s * n * m.n_out;
            counters += row_blocks(m) * n.div_ceil(GEMM_MAX_ROWS);
        }
    }
    (part, counters)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mat(ty: GgmlType, n_out: usize, n_in: usize) -> Mat {
        Mat { ty, n_in, n_out, start: 0, row_bytes: ty.row_bytes(n_in as u64).unwrap() as usize }
    }

    /// Every split covers the units without an empty slice, keeps a slice's share, and fills
    /// the GPU when the shape allows it.
    #[test]
    fn splits_cover_the_units() {
        for (n_out, n_in) in [(24, 16384), (1024, 4096), (8192, 1024), (64, 4096), (2048, 4096), (5, 32), (37, 96)] {
            let m = mat(GgmlType::F16, n_out, n_in);
            let s = slices(&m, n_out);
            // More rows in the launch: no more slices.
            assert!(slices(&m, 8 * n_out) <= s);
            let units = n_in / UNIT;
            assert!(s >= 1, "{n_out}x{n_in}: {s}");
            let per = units.div_ceil(s);
            assert!((s - 1) * per < units, "{n_out}x{n_in}: slice {} empty", s - 1);
            if s > 1 {
                assert!(per >= MIN_UNITS_PER_SLICE, "{n_out}x{n_in}: {per} units a slice");
            }
            let warps = row_blocks(&m) * MV_WARPS * s;
            let most = row_blocks(&m) * MV_WARPS * (units / MIN_UNITS_PER_SLICE).max(1);
            assert!(warps >= TARGET_WARPS.min(most) / 2, "{n_out}x{n_in}: {warps} warps");
        }
    }

    /// The kernels take F16, float-x Q8_0 and (when asked) tiled Q8_0 of whole tiles, with
    /// whole units, aligned rows and x, any rows (in descriptors of at most
    /// [`GEMM_MAX_ROWS`]), nothing else.
    #[test]
    fn which_products_take_the_tensor_cores() {
        let f16 = mat(GgmlType::F16, 64, 4096);
        assert!(takes(&f16, 256, 512, 16, true, true));
        assert!(!takes(&f16, 256, 512, 16, false, true));
        assert!(takes(&f16, 256, 512, 128, true, true));
        assert!(!takes(&f16, 256, 512, 0, true, true));
        assert!(!takes(&f16, 264, 512, 1, true, true));
        assert!(!takes(&f16, 256, 520, 1, true, true));
        assert!(!takes(&mat(GgmlType::F16, 64, 48), 256, 512, 1, true, true));
        let q8 = mat(GgmlType::Q8_0, 1024, 4096);
        assert_eq!(takes(&q8, 264, 512, 1, true, false), !tensor_cores(GgmlType::Q8_0, 4096, 1024));
        // 34 bytes a block: an odd block count leaves rows 2-byte aligned.
        assert!(!takes(&mat(GgmlType::Q8_0, 1024, 4096 + 32), 256, 512, 1, true, false));
        assert!(!takes(&mat(GgmlType::Q2_K, 1024, 4096), 256, 512, 1, true, true));
        assert!(!takes(&mat(GgmlType::F32, 1024, 4096), 256, 512, 1, true, true));
        // The tiled layout (rows of at most 1024 inputs by default: q_b's class): whole tiles
        // at 16-byte addresses, and only when asked.
        if tensor_cores(GgmlType::Q8_0, 1024, 4096) {
            let qb = mat(GgmlType::Q8_0, 4096, 1024);
            assert_eq!(kernel(&qb, true), Some(Kernel::Q8_0Tiled));
            assert!(takes(&qb, 256, 512, 64, true, true));
            assert!(!takes(&qb, 256, 512, 64, true, false));
            assert!(!takes(&qb, 264, 512, 64, true, true));
            assert!(!takes(&mat(GgmlType::Q8_0, 4096 + 8, 1024), 256, 512, 64, true, true));
            assert!(takes(&mat(GgmlType::Q8_0, 32, 96), 256, 512, 64, true, true));
        }
        // Shapes it never takes add nothing to the scratch it needs, whatever their size.
        assert_eq!(need(&[mat(GgmlType::F32, 8, 16), mat(GgmlType::F16, 3, 16)], 16, true), (0, 0));
    }
}
