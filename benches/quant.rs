//! Quantized-format throughput, single thread, in bytes of quantized weights per second.
//!
//! - `memcpy`: copy of a 64 MiB buffer (the reference bandwidth).
//! - `dequantize/<FMT>`: a ~64 MiB matrix of 4096-element rows, dequantized row by row into
//!   one (L1-resident) f32 buffer.
//! - `dot/<FMT>/<scalar|simd>`: the fused dot of every row of that matrix with one x of 4096
//!   f32 (so the weights stream from memory as in batch-1 decode; from a large L3 cache,
//!   where it holds 64 MiB).
//! - `dot_dram/<FMT>/simd` (Q8_0 and F16, the formats of the decode's largest matrices): the
//!   same over a 1 GiB matrix, which no cache holds, so the weights stream from DRAM. The
//!   matrix is only generated when the benchmark is selected.
//!
//! Run with `cargo bench --bench quant`; the whole run takes a few minutes.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput};
use ds4::quant::{self, GgmlType, Kernel};

const COLS: usize = 4096;
const MATRIX_BYTES: usize = 64 << 20;
const DRAM_MATRIX_BYTES: usize = 1 << 30;

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

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// Sane f16 scale bits: |d| in [2^-9, 2^-7), either sign.
fn scale_f16(rng: &mut Rng) -> [u8; 2] {
    (0x1800u16 | (rng.next() as u16 & 0x87ff)).to_le_bytes()
}

/// A matrix of random but valid rows: random quant bytes, finite scales.
fn matrix(ty: GgmlType, rng: &mut Rng) -> (Vec<u8>, usize) {
    matrix_of(ty, rng, MATRIX_BYTES)
}

/// [`matrix`] of about `bytes` bytes.
fn matrix_of(ty: GgmlType, rng: &mut Rng, bytes: usize) -> (Vec<u8>, usize) {
    let row = ty.row_bytes(COLS as u64).unwrap() as usize;
    let rows = bytes / row;
    let mut m = vec![0u8; rows * row];
    rng.fill(&mut m);
    let bb = ty.block_bytes();
    // Plain floats: uniform in [-1, 1) (random bit patterns would include subnormals,
    // whose products take slow microcode paths and say nothing about real weights).
    let mut uniform = || ((rng.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
    match ty {
        GgmlType::F32 => {
            for c in m.chunks_exact_mut(4) {
                c.copy_from_slice(&uniform().to_le_bytes());
            }
        }
        GgmlType::F16 | GgmlType::BF16 => {
            let mut w = vec![0f32; m.len() / 2];
            w.iter_mut().for_each(|v| *v = uniform());
            let mut h = vec![0u16; w.len()];
            if ty == GgmlType::F16 {
                quant::f32_to_f16(&w, &mut h).unwrap();
            } else {
                quant::f32_to_bf16(&w, &mut h).unwrap();
            }
            for (c, v) in m.chunks_exact_mut(2).zip(&h) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::MXFP4 => {
            for b in m.chunks_exact_mut(bb) {
                b[0] = 112 + b[0] % 16;
            }
        }
        _ => {
            let offsets: &[usize] = match ty {
                GgmlType::Q8_0 | GgmlType::IQ2_XXS => &[0],
                GgmlType::Q4_K => &[0, 2],
                GgmlType::Q2_K => &[80, 82],
                _ => unreachable!(),
            };
            for b in m.chunks_exact_mut(bb) {
                for &o in offsets {
                    b[o..o + 2].copy_from_slice(&scale_f16(rng));
                }
            }
        }
    }
    (m, row)
}

fn configure(c: &mut Criterion) -> Criterion {
    std::mem::take(c).sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1))
}

fn bench_memcpy(c: &mut Criterion) {
    let src = vec![1u8; MATRIX_BYTES];
    let mut dst = vec![0u8; MATRIX_BYTES];
    let mut g = c.benchmark_group("memcpy");
    g.throughput(Throughput::Bytes(MATRIX_BYTES as u64)).sampling_mode(SamplingMode::Flat);
    g.bench_function("64MiB", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
        })
    });
    g.finish();
}

fn bench_formats(c: &mut Criterion) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let x: Vec<f32> = (0..COLS).map(|_| ((rng.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).collect();
    let mut out = vec![0f32; COLS];
    for ty in FORMATS {
        let (m, row) = matrix(ty, &mut rng);
        let bytes = m.len() as u64;

        let mut g = c.benchmark_group("dequantize");
        g.throughput(Throughput::Bytes(bytes)).sampling_mode(SamplingMode::Flat);
        g.bench_function(ty.name(), |b| {
            b.iter(|| {
                for r in m.chunks_exact(row) {
                    quant::dequantize(ty, black_box(r), &mut out).unwrap();
                    black_box(&mut out);
                }
            })
        });
        g.finish();

        let mut g = c.benchmark_group(format!("dot/{}", ty.name()));
        g.throughput(Throughput::Bytes(bytes)).sampling_mode(SamplingMode::Flat);
        let mut kernels = vec![(Kernel::Scalar, "scalar")];
        if Kernel::simd_available() {
            kernels.push((Kernel::Simd, "simd"));
        }
        for &(k, name) in &kernels {
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    let mut s = 0f32;
                    for r in m.chunks_exact(row) {
                        s += quant::dot_with(ty, black_box(r), &x, k).unwrap();
                    }
                    black_box(s)
                })
            });
        }
        g.finish();

        // The dot a matrix product of this type uses when it takes 8-bit activations.
        if quant::act8::takes_act8(ty) {
            let qx = quant::act8::quantize_rows(&x, COLS).unwrap();
            let mut g = c.benchmark_group(format!("dot_act8/{}", ty.name()));
            g.throughput(Throughput::Bytes(bytes)).sampling_mode(SamplingMode::Flat);
            for &(k, name) in &kernels {
                let dot = quant::RowDot::new(ty, COLS, k).unwrap();
                g.bench_function(BenchmarkId::from_parameter(name), |b| {
                    b.iter(|| {
                        let mut s = 0f32;
                        for r in m.chunks_exact(row) {
                            s += dot.dot_act8(black_box(r), &qx);
                        }
                        black_box(s)
                    })
                });
            }
            g.finish();
        }
    }
}

fn bench_dram(c: &mut Criterion) {
    // `cargo test --all-targets` runs every bench once as a smoke test (without `--bench`);
    // building a 1 GiB matrix there would only slow CI down.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let mut rng = Rng(0x51_7cc1_b727_220a);
    let x: Vec<f32> = (0..COLS).map(|_| ((rng.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).collect();
    if !Kernel::simd_available() {
        return;
    }
    for ty in [GgmlType::Q8_0, GgmlType::F16] {
        let row = ty.row_bytes(COLS as u64).unwrap() as usize;
        let mut g = c.benchmark_group(format!("dot_dram/{}", ty.name()));
        g.throughput(Throughput::Bytes((DRAM_MATRIX_BYTES / row * row) as u64)).sampling_mode(SamplingMode::Flat);
        let mut m: Option<Vec<u8>> = None;
        g.bench_function("simd", |b| {
            let m = m.get_or_insert_with(|| matrix_of(ty, &mut rng, DRAM_MATRIX_BYTES).0);
            b.iter(|| {
                let mut s = 0f32;
                for r in m.chunks_exact(row) {
                    s += quant::dot_with(ty, black_box(r), &x, Kernel::Simd).unwrap();
                }
                black_box(s)
            })
        });
        g.finish();
    }
}

fn benches(c: &mut Criterion) {
    let mut c = configure(c);
    bench_memcpy(&mut c);
    bench_formats(&mut c);
    bench_dram(&mut c);
}

criterion_group!(quant_benches, benches);
criterion_main!(quant_benches);
