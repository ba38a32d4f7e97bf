//! CUDA matrix-product throughput, in weight bytes per second (feature `cuda`; without a
//! device it prints why and measures nothing).
//!
//! - `kernel/<FMT>/<n_out>x<n_in>/n=<n>`: back-to-back launches timed by CUDA events, cycling
//!   over copies of the matrix that together exceed the L2 cache, so the weights stream from
//!   HBM as in decode.
//! - `matmul/<FMT>/4096x4096/n=1`: one `Backend::matmul` call end to end (input copy, launch,
//!   output copy, one stream sync), the cost a decode step pays per call.
//!
//! - `small/F16/<n_out>x16384/n=<n>`: the hyper-connection and router shapes, few rows of
//!   long inputs (split over blocks by input slices).
//! - `call/Q8_0/<k>x(64x4096)/n=1`: one `matmul_many` call of k small products, the fixed
//!   cost of a call (one input copy, one launch per kernel group, one output copy, one sync).
//! - `prefill/<FMT>/<n_out>x<n_in>/n=<n>`: the products of a prompt's steps on the tensor cores
//!   (`shaders/cuda/gemm.cu`; sm_80 and later), Flash's F16 and Q8_0 shapes (float-x, and by
//!   default q_b's and o_b's on the tiled layout: `ds4_gemm_q8_0_mq`), timed as `kernel/`.
//!
//! Run with `cargo bench --features cuda --bench cuda`; with `DS4_CUDA_Q8=mma` the Q8_0 rows
//! time the tensor-core kernel and its tiled weight layout, with `DS4_CUDA_Q8=fma` the float-x
//! kernel (by default rows of at most 1024 elements go to the first, longer ones to the second).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ds4::backend::cuda::CudaBackend;
use ds4::backend::Backend;
use ds4::model::weights::Mat;
use ds4::quant::{self, GgmlType};

const FORMATS: [GgmlType; 8] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q2_K,
    GgmlType::IQ2_XXS,
    GgmlType::MXFP4,
];
/// `(n_out, n_in)` of decode-shaped products: square, Flash's query up-projection (many
/// short rows) and one routed expert's gate (few long rows).
const SHAPES: [(usize, usize); 3] = [(4096, 4096), (32768, 1024), (2048, 4096)];
const BATCHES: [usize; 4] = [1, 2, 8, 16];
/// Bytes of matrix copies cycled through (H200's L2 is 50 MB).
const WORKING_SET: usize = 512 << 20;
/// Where the matrices start in the fake file image.
const DATA_OFFSET: usize = 4096;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Random valid rows: uniform floats, or random quant bytes with sane scales.
fn matrix(ty: GgmlType, rows: usize, n_in: usize, rng: &mut Rng) -> Vec<u8> {
    let row = ty.row_bytes(n_in as u64).unwrap() as usize;
    let mut m: Vec<u8> = Vec::with_capacity(rows * row);
    match ty {
        GgmlType::F32 => (0..rows * n_in).for_each(|_| m.extend_from_slice(&rng.uniform().to_le_bytes())),
        GgmlType::F16 | GgmlType::BF16 => {
            let w: Vec<f32> = (0..rows * n_in).map(|_| rng.uniform()).collect();
            let mut h = vec![0u16; w.len()];
            if ty == GgmlType::F16 {
                quant::f32_to_f16(&w, &mut h).unwrap();
            } else {
                quant::f32_to_bf16(&w, &mut h).unwrap();
            }
            h.iter().for_each(|v| m.extend_from_slice(&v.to_le_bytes()));
        }
        _ => {
            (0..rows * row).for_each(|_| m.push(rng.next() as u8));
            let offsets: &[usize] = match ty {
                GgmlType::Q8_0 | GgmlType::IQ2_XXS => &[0],
                GgmlType::Q4_K => &[0, 2],
                GgmlType::Q2_K => &[80, 82],
                _ => &[],
            };
            for b in m.chunks_exact_mut(ty.block_bytes()) {
                if ty == GgmlType::MXFP4 {
                    b[0] = 120 + (rng.next() % 16) as u8;
                }
                for &o in offsets {
                    b[o..o + 2].copy_from_slice(&(0x1800u16 | (rng.next() as u16 & 0x87ff)).to_le_bytes());
                }
            }
        }
    }
    m
}

/// Copies of one random matrix, together larger than the L2 cache, in a file-like image (from
/// `DATA_OFFSET`), and the bytes of one.
fn working_set(ty: GgmlType, n_out: usize, n_in: usize, rng: &mut Rng) -> (Vec<u8>, Vec<Mat>, usize) {
    let one = matrix(ty, n_out, n_in, rng);
    let copies = WORKING_SET.div_ceil(one.len()).max(2);
    let mut raw = vec![0u8; DATA_OFFSET];
    let mut mats = Vec::with_capacity(copies);
    for _ in 0..copies {
        mats.push(Mat { ty, n_in, n_out, start: raw.len(), row_bytes: one.len() / n_out });
        raw.extend_from_slice(&one);
    }
    (raw, mats, one.len())
}

fn bench(c: &mut Criterion) {
    let backend = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return;
        }
    };
    eprintln!("device: {} ({} SMs)", backend.device_name(), backend.multiprocessors());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for ty in FORMATS {
        for (si, &(n_out, n_in)) in SHAPES.iter().enumerate() {
            let (raw, mats, one) = working_set(ty, n_out, n_in, &mut rng);
            backend.upload_image(&raw, DATA_OFFSET, &mats, |_, _| {}).unwrap();
            let mut g = c.benchmark_group(format!("kernel/{ty}/{n_out}x{n_in}"));
            g.sample_size(10).warm_up_time(Duration::from_millis(200)).measurement_time(Duration::from_millis(600));
            g.throughput(Throughput::Bytes(one as u64));
            for n in BATCHES {
                g.bench_function(BenchmarkId::from_parameter(format!("n={n}")), |b| {
                    b.iter_custom(|iters| {
                        Duration::from_secs_f64(backend.time_launches(&raw, &mats, n, iters).unwrap())
                    })
                });
            }
            g.finish();
            if si == 0 {
                let x: Vec<f32> = (0..n_in).map(|_| rng.uniform()).collect();
                let mut g = c.benchmark_group(format!("matmul/{ty}/{n_out}x{n_in}"));
                g.sample_size(10).warm_up_time(Duration::from_millis(200)).measurement_time(Duration::from_millis(600));
                g.throughput(Throughput::Bytes(one as u64));
                let mut i = 0;
                g.bench_function("n=1", |b| {
                    b.iter(|| {
                        i += 1;
                        backend.matmul(&raw, &mats[i % mats.len()], &x).unwrap()
                    })
                });
                g.finish();
            }
            backend.release(&raw).unwrap();
        }
    }
}

/// Few-row products and the per-call overhead of `matmul_many`.
fn bench_small(c: &mut Criterion) {
    let backend = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(_) => return,
    };
    let mut rng = Rng(0x5151_7a7a_0101_2323);
    for n_out in [24, 6] {
        let (ty, n_in) = (GgmlType::F16, 16384);
        let (raw, mats, one) = working_set(ty, n_out, n_in, &mut rng);
        backend.upload_image(&raw, DATA_OFFSET, &mats, |_, _| {}).unwrap();
        let mut g = c.benchmark_group(format!("small/{ty}/{n_out}x{n_in}"));
        g.sample_size(10).warm_up_time(Duration::from_millis(200)).measurement_time(Duration::from_millis(400));
        g.throughput(Throughput::Bytes(one as u64));
        for n in [1, 4, 16] {
            g.bench_function(BenchmarkId::from_parameter(format!("n={n}")), |b| {
                b.iter_custom(|iters| Duration::from_secs_f64(backend.time_launches(&raw, &mats, n, iters).unwrap()))
            });
        }
        g.finish();
        backend.release(&raw).unwrap();
    }
    let (ty, n_out, n_in) = (GgmlType::Q8_0, 64, 4096);
    let one = matrix(ty, n_out, n_in, &mut rng);
    let mut raw = vec![0u8; DATA_OFFSET];
    let mut mats = Vec::new();
    for _ in 0..14 {
        mats.push(Mat { ty, n_in, n_out, start: raw.len(), row_bytes: one.len() / n_out });
        raw.extend_from_slice(&one);
    }
    backend.upload_image(&raw, DATA_OFFSET, &mats, |_, _| {}).unwrap();
    let x: Vec<f32> = (0..n_in).map(|_| rng.uniform()).collect();
    let mut g = c.benchmark_group(format!("call/{ty}"));
    g.sample_size(20).warm_up_time(Duration::from_millis(200)).measurement_time(Duration::from_millis(400));
    for k in [1, 14] {
        let specs: Vec<(&Mat, &[f32])> = mats[..k].iter().map(|m| (m, &x[..])).collect();
        g.bench_function(format!("{k}x(64x4096)/n=1"), |b| b.iter(|| backend.matmul_many(&raw, &specs).unwrap()));
    }
    g.finish();
    backend.release(&raw).unwrap();
}

/// The prefill products on the tensor cores at Flash's shapes: q_a's and an o_a group's
/// (1024 x 4096), the shared expert's gate and down, q_b and o_b (the tiled layout by
/// default), the hyper-connection projection.
fn bench_prefill(c: &mut Criterion) {
    let backend = match CudaBackend::new(0) {
        Ok(b) if b.compute_capability().0 >= 8 => b,
        _ => return,
    };
    let mut rng = Rng(0x7a7a_1234_0f0f_5555);
    let shapes = [
        (GgmlType::Q8_0, 1024, 4096),
        (GgmlType::Q8_0, 2048, 4096),
        (GgmlType::Q8_0, 4096, 2048),
        (GgmlType::Q8_0, 32768, 1024),
        (GgmlType::Q8_0, 4096, 8192),
        (GgmlType::F16, 1024, 4096),
        (GgmlType::F16, 24, 16384),
    ];
    for (ty, n_out, n_in) in shapes {
        let (raw, mats, one) = working_set(ty, n_out, n_in, &mut rng);
        backend.upload_image(&raw, DATA_OFFSET, &mats, |_, _| {}).unwrap();
        let mut g = c.benchmark_group(format!("prefill/{ty}/{n_out}x{n_in}"));
        g.sample_size(10).warm_up_time(Duration::from_millis(200)).measurement_time(Duration::from_millis(600));
        g.throughput(Throughput::Bytes(one as u64));
        for n in [1, 16, 64] {
            g.bench_function(BenchmarkId::from_parameter(format!("n={n}")), |b| {
                b.iter_custom(|iters| {
                    Duration::from_secs_f64(backend.time_prefill_launches(&raw, &mats, n, iters).unwrap())
                })
            });
        }
        g.finish();
        backend.release(&raw).unwrap();
    }
}

criterion_group!(benches, bench, bench_small, bench_prefill);
criterion_main!(benches);
