//! The prefill products on the tensor cores (`shaders/cuda/gemm.cu`, `gemm.rs`) against the
//! float product of the dequantized weights, and their row invariance. Skipped without a GPU
//! of sm_80 or later.

use super::super::{tensor_cores, Desc};
use super::gemm;
use super::program::{GxTile, GX_TILES};
use super::testutil::{context_from, randn, split_image, Arg, DevBuf};
use crate::model::weights::Mat;
use crate::quant::{self, GgmlType};

/// A matrix of `ty` with `n_out` rows of `n_in` inputs (from random floats), in a file-like
/// image at offset 256, and its dequantized weights.
fn matrix(ty: GgmlType, n_out: usize, n_in: usize, seed: u64) -> (Vec<u8>, Mat, Vec<f32>) {
    let floats = randn(n_out * n_in, seed, 1.0);
    let row_bytes = ty.row_bytes(n_in as u64).unwrap() as usize;
    let mut data = vec![0u8; n_out * row_bytes];
    match ty {
        GgmlType::F16 => {
            let mut h = vec![0u16; floats.len()];
            quant::f32_to_f16(&floats, &mut h).unwrap();
            for (d, v) in data.chunks_exact_mut(2).zip(&h) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::Q8_0 => quant::quantize_q8_0(&floats, &mut data).unwrap(),
        _ => unreachable!(),
    }
    let mut deq = vec![0f32; n_out * n_in];
    quant::dequantize(ty, &data, &mut deq).unwrap();
    let mut raw = vec![0u8; 256];
    raw.extend_from_slice(&data);
    (raw, Mat { ty, n_in, n_out, start: 256, row_bytes }, deq)
}

/// `y = W x` of the `n` rows of `x` by the prefill kernel of `m`'s format (one descriptor).
fn run(ctx: &super::super::context::Context, w: &DevBuf, m: &Mat, x: &[f32], n: usize) -> Vec<f32> {
    let xb = DevBuf::from_slice(x).unwrap();
    let y = DevBuf::zeroed(4 * n * m.n_out).unwrap();
    let s = gemm::slices(m, m.n_out);
    let part = DevBuf::zeroed(4 * s * n * m.n_out).unwrap();
    let counters = DevBuf::zeroed(4 * 4096).unwrap();
    let (d, blocks): (Desc, usize) =
        gemm::desc(w.at(m.start), m, m.n_out, xb.at(0), y.at(0), m.n_out, part.at(0), n, 0);
    assert_eq!((d.group, d.slices as usize), (1, s));
    let table = DevBuf::from_slice(&[d]).unwrap();
    let f = ctx.function(gemm::kernel(m, true).unwrap().name()).unwrap();
    let args = [Arg::Ptr(table.at(0)), Arg::I32(1), Arg::Ptr(counters.at(0))];
    ctx.launch_args(f, (blocks as u32, 1, 1), 128, 0, &args).unwrap();
    ctx.sync().unwrap();
    y.read(0, n * m.n_out).unwrap()
}

/// `y = W x` of the `n` rows of `x` by `ds4_gemm_split` and the split-x form of `m`'s prefill
/// kernel (descriptors of at most [`gemm::GEMM_MAX_ROWS`] rows over the split's tiles).
fn run_px(ctx: &super::super::context::Context, w: &DevBuf, m: &Mat, x: &[f32], n: usize) -> Vec<f32> {
    let xb = DevBuf::from_slice(x).unwrap();
    let kind = gemm::kernel(m, true).unwrap();
    let tiled = kind == gemm::Kernel::Q8_0Tiled;
    let xs = DevBuf::zeroed(gemm::px_bytes(m.n_in, n)).unwrap();
    let split = ctx.function("ds4_gemm_split").unwrap();
    let args =
        [Arg::Ptr(xb.at(0)), Arg::I32(m.n_in as i32), Arg::I32(n as i32), Arg::I32(tiled as i32), Arg::Ptr(xs.at(0))];
    let grid = gemm::px_split_grid(m.n_in, n);
    ctx.launch_args(split, grid, 256, 0, &args).unwrap();
    let y = DevBuf::zeroed(4 * n * m.n_out).unwrap();
    let s = gemm::slices(m, m.n_out);
    let part = DevBuf::zeroed(4 * s * n * m.n_out).unwrap();
    let counters = DevBuf::zeroed(4 * 4096).unwrap();
    let (mut descs, mut blocks) = (Vec::new(), 0usize);
    for (ci, r0) in (0..n).step_by(gemm::GEMM_MAX_ROWS).enumerate() {
        let c = (n - r0).min(gemm::GEMM_MAX_ROWS);
        let tile = r0 / gemm::PX_TILE_ROWS * gemm::px_tile_bytes(m.n_in);
        let (mut d, nb): (Desc, usize) = gemm::desc(
            w.at(m.start),
            m,
            m.n_out,
            xs.at(tile),
            y.at(4 * r0 * m.n_out),
            m.n_out,
            part.at(4 * r0 * s * m.n_out),
            c,
            ci * nb_rows(m),
        );
        d.block_start = blocks as i32;
        blocks += nb;
        descs.push(d);
    }
    let table = DevBuf::from_slice(&descs).unwrap();
    let f = ctx.function(kind.px_name()).unwrap();
    let args = [Arg::Ptr(table.at(0)), Arg::I32(descs.len() as i32), Arg::Ptr(counters.at(0))];
    ctx.launch_args(f, (blocks as u32, 1, 1), 128, 0, &args).unwrap();
    ctx.sync().unwrap();
    y.read(0, n * m.n_out).unwrap()
}

/// Row blocks of a prefill product of `m` (a descriptor's counters).
fn nb_rows(m: &Mat) -> usize {
    m.n_out.div_ceil(128)
}

/// Each output within `2e-6 * sum |w x|` of the exact product of the dequantized weights (x
/// is kept to 22 bits a unit of 32, whatever the rest of its row holds), and bitwise the same
/// whatever the rows beside it (1..=64 rows: one to four m16 tiles a descriptor).
#[test]
fn prefill_products_match_the_float_product_and_are_row_invariant() {
    let Some(ctx) = context_from(8, "mma.sync m16n8k16") else { return };
    let shapes = [
        // A partial tile, rows of one warp's units; the HC projection (few rows, many slices);
        // the compressor's and q_a's class; rows that are not a whole block of 128.
        (GgmlType::F16, 37, 256),
        (GgmlType::F16, 24, 16384),
        (GgmlType::F16, 1024, 4096),
        (GgmlType::F16, 200, 1056),
        (GgmlType::Q8_0, 40, 2048),
        (GgmlType::Q8_0, 1024, 4096),
        (GgmlType::Q8_0, 77, 2560),
        // The decode's tensor-core layout by default (context.rs `tensor_cores`): rows of at
        // most 1024 inputs (q_b's class; a partial block of 128 rows; one warp's two tiles,
        // three units) and of at least 8192 (o_b's), for ds4_gemm_q8_0_mq.
        (GgmlType::Q8_0, 272, 1024),
        (GgmlType::Q8_0, 32, 96),
        (GgmlType::Q8_0, 48, 8192),
    ];
    const ROWS: usize = gemm::GEMM_MAX_ROWS;
    for (si, &(ty, n_out, n_in)) in shapes.iter().enumerate() {
        let (raw, m, deq) = matrix(ty, n_out, n_in, 11 + si as u64);
        if ty == GgmlType::Q8_0 && tensor_cores(ty, n_in, n_out) && n_out % 16 != 0 {
            // Rows that are not whole tiles on the tensor-core layout (DS4_CUDA_Q8=mma).
            assert!(!gemm::takes(&m, 256, 0, 1, true, true));
            eprintln!("{ty} {n_out}x{n_in}: not whole tiles of the tensor-core layout here");
            continue;
        }
        assert!(gemm::takes(&m, 256, 0, 1, true, true), "{ty} {n_out}x{n_in}: not a prefill tensor-core product");
        let w = DevBuf::from_slice(&split_image(&raw, &[(m, m.n_out)])).unwrap();
        // Rows of different scales, one of them all zeros, one with a large value.
        let mut x = randn(ROWS * n_in, 100 + si as u64, 1.0);
        for (r, row) in x.chunks_mut(n_in).enumerate() {
            let s = [1.0f32, 1e-3, 300.0, 0.0][r % 4];
            row.iter_mut().for_each(|v| *v *= s);
        }
        x[5 * n_in + 7] = 7.0e4;
        let alone: Vec<Vec<f32>> = (0..ROWS).map(|r| run(&ctx, &w, &m, &x[r * n_in..(r + 1) * n_in], 1)).collect();
        for n in [16, 1, 3, 8, 13, 17, 33, 50, ROWS] {
            let y = run(&ctx, &w, &m, &x[..n * n_in], n);
            for r in 0..n {
                for o in 0..n_out {
                    let (wr, xr) = (&deq[o * n_in..(o + 1) * n_in], &x[r * n_in..(r + 1) * n_in]);
                    let exact: f64 = wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let mag: f64 = wr.iter().zip(xr).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                    let got = y[r * n_out + o];
                    assert!(
                        (got as f64 - exact).abs() <= 2e-6 * mag + 1e-30,
                        "{ty} {n_out}x{n_in} n={n} row {r} out {o}: {got} against {exact} (sum |wx| {mag})"
                    );
                    assert_eq!(
                        got.to_bits(),
                        alone[r][o].to_bits(),
                        "{ty} {n_out}x{n_in} n={n}: row {r} out {o} differs from the row alone"
                    );
                }
            }
            // The split-x kernels: the same bits.
            let px = run_px(&ctx, &w, &m, &x[..n * n_in], n);
            for (j, (a, b)) in px.iter().zip(&y).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{ty} {n_out}x{n_in} n={n}: split-x output {j}: {a} against {b}");
            }
        }
        // Several descriptors over one split (a prompt's step of more rows than one takes).
        let many = 3 * ROWS + 5;
        let xm = randn(many * n_in, 300 + si as u64, 1.0);
        let px = run_px(&ctx, &w, &m, &xm, many);
        for r in [0, ROWS - 1, ROWS, 2 * ROWS + 17, many - 1] {
            let one = run(&ctx, &w, &m, &xm[r * n_in..(r + 1) * n_in], 1);
            for o in 0..n_out {
                assert_eq!(
                    px[r * n_out + o].to_bits(),
                    one[o].to_bits(),
                    "{ty} {n_out}x{n_in}: {many} rows, row {r} out {o}"
                );
            }
        }
        let kernel = gemm::kernel(&m, true).unwrap().name();
        eprintln!("{ty} {n_out}x{n_in}: ok ({kernel}, {} slices)", gemm::slices(&m, n_out));
    }
}

/// `y = W x` of the `n` 8-bit activation rows at `xb` (slots of n_in floats) by the routed
/// experts' tensor-core kernel `name` (`ds4_moe_mma_iq2_xxs` or `ds4_moe_mma_q2_k`) built for
/// the warp tile `tile` (a suffix to the name for all but the first), with one descriptor as
/// ds4_route writes them for it, on a grid of `grid` blocks (None: one block per block of the
/// descriptor; fewer walk them).
fn run_moe_mma(
    ctx: &super::super::context::Context,
    (name, tile): (&str, GxTile),
    w: &DevBuf,
    m: &Mat,
    xb: &DevBuf,
    n: usize,
    grid: Option<u32>,
) -> Vec<f32> {
    use super::super::CudaBackend;
    assert!(n <= tile.max_rows());
    let y = DevBuf::zeroed(4 * n.max(1) * m.n_out).unwrap();
    let counters = DevBuf::zeroed(64).unwrap();
    let (mut d, _) = CudaBackend::desc_split(w.at(m.start), m, m, xb.at(0), y.at(0), 0, n, 0, (1, 1));
    d.warp_rows = tile.warp_rows() as i32;
    let table = DevBuf::from_slice(&[d]).unwrap();
    let name = if tile == GX_TILES[0] { name.to_string() } else { format!("{name}_{}x{}", tile.m, tile.n) };
    let f = ctx.function(&name).unwrap();
    let args = [Arg::Ptr(table.at(0)), Arg::I32(1), Arg::Ptr(counters.at(0))];
    let grid = grid.unwrap_or(m.n_out.div_ceil(4 * tile.warp_rows()) as u32);
    ctx.launch_args(f, (grid, 1, 1), 128, 0, &args).unwrap();
    ctx.sync().unwrap();
    y.read(0, n * m.n_out).unwrap()
}

/// The prompt steps' routed expert products on the tensor cores, IQ2_XXS gate/up and Q2_K
/// down: each output within `1e-6 * sum |w x|` of the CPU's reference dot with the same 8-bit
/// activations (per group of 32 exact integer sums times the scales; only the f32 roundings
/// and the order of the additions differ; for Q2_K, whose kernel sums a weight's scaled quant
/// and its min apart, `sum |w x|` counts both parts), an unused descriptor (0 rows) writes
/// nothing, and a row gives the same bits with 1..=32 rows beside it, on every warp tile and
/// grid.
#[test]
fn expert_products_on_the_tensor_cores_match_the_act8_dot() {
    let Some(ctx) = context_from(8, "mma.sync m16n8k32") else { return };
    let mut rng = crate::quant::testutil::Rng(0x1e2_0fa1);
    // A partial last warp and block (80 of 128 outputs) with rows of 2 super-blocks (IQ2_XXS:
    // 132 bytes, 2-byte aligned, read in pieces; Q2_K: 168 bytes at offset 256 + 4 mod 8, read
    // 4 bytes at a time); Flash's shapes (gate 2048 x 4096, down 4096 x 2048: 8-byte loads).
    let cases = [
        (GgmlType::IQ2_XXS, "ds4_moe_mma_iq2_xxs", 80usize, 512usize, 256usize),
        (GgmlType::IQ2_XXS, "ds4_moe_mma_iq2_xxs", 2048, 4096, 256),
        (GgmlType::Q2_K, "ds4_moe_mma_q2_k", 80, 512, 260),
        (GgmlType::Q2_K, "ds4_moe_mma_q2_k", 4096, 2048, 256),
    ];
    for (ty, name, n_out, n_in, start) in cases {
        let row_bytes = ty.row_bytes(n_in as u64).unwrap() as usize;
        // The f16 scales at sane values (IQ2_XXS d; Q2_K d and dmin).
        let f16s: &[usize] = if ty == GgmlType::Q2_K { &[80, 82] } else { &[0] };
        let data = crate::quant::testutil::random_blocks(&mut rng, ty, n_out * row_bytes / ty.block_bytes(), f16s);
        let mut raw = vec![0u8; start];
        raw.extend_from_slice(&data);
        let m = Mat { ty, n_in, n_out, start, row_bytes };
        let w = DevBuf::from_slice(&split_image(&raw, &[(m, m.n_out)])).unwrap();
        // Per weight the magnitude of what the kernel sums: |w| (IQ2_XXS), |d sc q| + |dmin m|
        // (Q2_K).
        let mut parts = vec![0f32; n_out * n_in];
        if ty == GgmlType::Q2_K {
            let f16 = |lo: u8, hi: u8| {
                let mut v = [0f32];
                quant::f16_to_f32(&[u16::from_le_bytes([lo, hi])], &mut v).unwrap();
                v[0]
            };
            for (b, blk) in data.chunks_exact(84).enumerate() {
                let (d, dmin) = (f16(blk[80], blk[81]), f16(blk[82], blk[83]));
                for e in 0..256 {
                    let (half, s, l) = (e / 128, (e % 128) / 32, e % 32);
                    let sc = blk[8 * half + 2 * s + l / 16];
                    let q = (blk[16 + 32 * half + l] >> (2 * s)) & 3;
                    parts[256 * b + e] =
                        (d * f32::from(sc & 15) * f32::from(q)).abs() + (dmin * f32::from(sc >> 4)).abs();
                }
            }
        } else {
            quant::dequantize(ty, &data, &mut parts).unwrap();
        }
        // Rows of different scales, one all zeros.
        const ROWS: usize = 32;
        let mut x = randn(ROWS * n_in, 7 + n_out as u64, 1.0);
        for (r, row) in x.chunks_mut(n_in).enumerate() {
            let s = [1.0f32, 1e-3, 300.0, 0.0][r % 4];
            row.iter_mut().for_each(|v| *v *= s);
        }
        let qx: Vec<Vec<u8>> = x.chunks(n_in).map(|r| quant::act8::quantize_rows(r, n_in).unwrap()).collect();
        // Each row in its slot of n_in floats.
        let slots = |rows: &[Vec<u8>]| {
            let mut v = vec![0u8; rows.len() * 4 * n_in];
            for (r, q) in rows.iter().enumerate() {
                v[r * 4 * n_in..r * 4 * n_in + q.len()].copy_from_slice(q);
            }
            DevBuf::from_slice(&v).unwrap()
        };
        let all = slots(&qx);
        let dot = quant::RowDot::new(ty, n_in, quant::Kernel::Scalar).unwrap();
        // All 32 rows on a tile of 4 n8 tiles; each tile's results must then be these bits.
        let wide = GX_TILES[0];
        let y = run_moe_mma(&ctx, (name, wide), &w, &m, &all, ROWS, None);
        for (r, q) in qx.iter().enumerate() {
            let xd: Vec<f32> = (0..n_in).map(|j| q[j] as i8 as f32 * quant::act8::scale(q, n_in, j / 32)).collect();
            for o in 0..n_out {
                let want = dot.dot_act8(&data[o * row_bytes..(o + 1) * row_bytes], q);
                let mag: f64 =
                    parts[o * n_in..(o + 1) * n_in].iter().zip(&xd).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                let got = y[r * n_out + o];
                assert!(
                    (got as f64 - want as f64).abs() <= 1e-6 * mag + 1e-30,
                    "{ty} {n_out}x{n_in} row {r} out {o}: {got} against {want} (sum |wx| {mag})"
                );
            }
        }
        for tile in GX_TILES {
            assert!(run_moe_mma(&ctx, (name, tile), &w, &m, &all, 0, None).is_empty());
            let most = tile.max_rows();
            // Fewer blocks than the descriptor's, each walking several: the same bits.
            for grid in [1, 3] {
                let yg = run_moe_mma(&ctx, (name, tile), &w, &m, &all, most, Some(grid));
                assert!(
                    yg.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "{ty} {n_out}x{n_in} {tile:?}: grid {grid}"
                );
            }
            for n in [1, 3, 8, 9, 13, 16, 17, 24, 31, 32].into_iter().filter(|&n| n <= most) {
                for first in [0, ROWS - n, (ROWS - n) / 2] {
                    let part = slots(&qx[first..first + n]);
                    let yn = run_moe_mma(&ctx, (name, tile), &w, &m, &part, n, None);
                    for r in 0..n {
                        let (a, b) =
                            (&yn[r * n_out..(r + 1) * n_out], &y[(first + r) * n_out..(first + r + 1) * n_out]);
                        assert!(
                            a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()),
                            "{ty} {n_out}x{n_in} {tile:?}: row {} differs among {n} rows from {first}",
                            first + r
                        );
                    }
                }
            }
        }
        eprintln!("{ty} {n_out}x{n_in}: ok");
    }
}
