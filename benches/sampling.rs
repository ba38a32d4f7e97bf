//! Host sampling at DeepSeek V4's vocabulary (129280 logits): what a token costs on top of the
//! forward pass when it is sampled on the host (the CPU backend, and the CUDA decoder at
//! temperature > 0, whose logits come back to be sampled).
//!
//! - `distribution/<params>`: the filtered distribution of one row (`ds4::sampling::
//!   distribution`), for greedy, plain temperature, top-p, top-k, min-p and top-k with top-p.
//! - `verify/<accepted|rejected_first>/<rows>`: a speculative verify at temperature 0.8 and
//!   top-p 0.95 of a block whose drafts are all accepted (every row's distribution made), or
//!   whose first draft is rejected (one row read).
//!
//! The logits are Gaussian with a standard deviation of 3 (a few thousand tokens in a 0.95
//! nucleus). Run with `cargo bench --bench sampling`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use ds4::sampling::{distribution, Sampler, SamplingParams};
use ds4::spec::{accept, Draft};

const VOCAB: usize = 129_280;

/// Gaussian-like logits (a sum of uniforms), deterministic.
fn logits(seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    let mut uniform = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..VOCAB).map(|_| (3.0 * ((0..12).map(|_| uniform()).sum::<f64>() - 6.0)) as f32).collect()
}

fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
    SamplingParams { temperature, top_k, top_p, min_p, seed: 1 }
}

fn bench(c: &mut Criterion) {
    let row = logits(7);
    let mut g = c.benchmark_group("distribution");
    for (name, p) in [
        ("greedy", params(0.0, 0, 1.0, 0.0)),
        ("t1", params(1.0, 0, 1.0, 0.0)),
        ("t0.8_top_p0.95", params(0.8, 0, 0.95, 0.0)),
        ("t0.8_top_k40", params(0.8, 40, 1.0, 0.0)),
        ("t0.8_min_p0.05", params(0.8, 0, 1.0, 0.05)),
        ("t0.6_top_k20_top_p0.95", params(0.6, 20, 0.95, 0.0)),
    ] {
        g.bench_function(name, |b| b.iter(|| distribution(black_box(&row), &p).unwrap()));
    }
    g.finish();

    let mut g = c.benchmark_group("verify");
    for k in [1usize, 3, 5] {
        let mut rows: Vec<f32> = (0..=k as u64).flat_map(logits).collect();
        // Each draft 30 above the rest of its row (accepted, almost surely: every row's
        // distribution is made), or a token outside the nucleus (rejected at the first row).
        let sure: Vec<u32> = (0..k as u32).map(|i| 1000 + i).collect();
        for (i, &t) in sure.iter().enumerate() {
            rows[i * VOCAB + t as usize] = 40.0;
        }
        let never = vec![VOCAB as u32 - 1; k];
        rows[VOCAB - 1] = -40.0;
        let mut s = Sampler::new(params(0.8, 0, 0.95, 0.0)).unwrap();
        for (name, tokens) in [("accepted", sure), ("rejected_first", never)] {
            let draft = Draft::point(tokens);
            g.bench_function(format!("{name}/{}_rows", k + 1), |b| {
                b.iter(|| accept::verify(&mut s, black_box(&rows), VOCAB, &draft).unwrap())
            });
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
