//! Helpers of the decode kernels' tests: a device context (or a skip), buffers, comparisons.

use crate::backend::cuda::context::Context;
pub(crate) use crate::backend::cuda::device::{Arg, DevBuf};

/// A bound context on device 0, or `None` (the test prints "skipped" and passes) when there is
/// no usable GPU, driver or NVRTC.
pub(crate) fn context() -> Option<Context> {
    match Context::new(0) {
        Ok(c) => {
            c.bind().expect("binding the context");
            Some(c)
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// The step parameters buffer: position of row 0, row count, the rows' tokens.
pub(crate) fn step(ctx: &Context, pos0: usize, tokens: &[u32]) -> DevBuf {
    let _ = ctx;
    let mut v = vec![pos0 as i32, tokens.len() as i32];
    v.extend(tokens.iter().map(|&t| t as i32));
    DevBuf::from_slice(&v).expect("step buffer")
}

/// Asserts `|a - b| <= tol * max(1, |b|)` elementwise, naming the first bad index.
#[track_caller]
pub(crate) fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let ok = (a - b).abs() <= tol * b.abs().max(1.0) || (a.is_nan() && b.is_nan()) || a == b;
        assert!(ok, "{what}[{i}]: got {a}, want {b}");
    }
}

/// The first `len` values of `b`, after the stream's work.
pub(crate) fn read<T: Copy + Default>(ctx: &Context, b: &DevBuf, len: usize) -> Vec<T> {
    ctx.sync().expect("running the kernels");
    b.read(0, len).expect("reading back")
}

/// Asserts bitwise equality, naming the first differing index.
#[track_caller]
pub(crate) fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(a.to_bits() == b.to_bits(), "{what}[{i}]: {a} ({:#x}) != {b} ({:#x})", a.to_bits(), b.to_bits());
    }
}

/// Deterministic pseudo-random floats in [-scale, scale).
pub(crate) fn randn(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A copy of the image `raw` with the rows of each of `tensors` that has a split format in the
/// split device layout, as [`super::super::CudaBackend::upload`] stores them.
pub(crate) fn split_image(raw: &[u8], tensors: &[crate::model::weights::Mat]) -> Vec<u8> {
    let mut out = raw.to_vec();
    for t in tensors.iter().filter(|t| crate::quant::split::is_split(t.ty)) {
        // Each tensor one plane, as upload_image takes them.
        let tiles = super::super::context::tensor_cores(t.ty).then_some((t.n_out, 0));
        crate::quant::split::split_rows(t.ty, t.row_bytes, &mut out[t.start..t.start + t.nbytes()], tiles);
    }
    out
}

/// A hyper-connection projection of `n_out` rows over `n_in` inputs in F16, rows uniform in
/// ±3/sqrt(n_in) (mixing logits of order one): (its bytes, rows contiguous as the writer
/// kernels read them, and its values as floats, exactly).
pub(crate) fn f16_proj(n_out: usize, n_in: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let vals: Vec<f32> = randn(n_out * n_in, seed, 3.0 / (n_in as f32).sqrt())
        .iter()
        .map(|&v| half::f16::from_f32(v).to_f32())
        .collect();
    let raw = vals.iter().flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes()).collect();
    (raw, vals)
}

/// The mixing logits [n, n_mix] from the partial products [n, blocks, n_mix] that ds4_hc_post
/// and ds4_moe_combine leave: each the sum of its partials in block order in float, from 0, as
/// ds4_hc_pre sums them.
pub(crate) fn sum_partials(parts: &[f32], n_mix: usize, blocks: usize) -> Vec<f32> {
    let n = parts.len() / (blocks * n_mix);
    let mut out = vec![0f32; n * n_mix];
    for r in 0..n {
        for k in 0..n_mix {
            let mut s = 0f32;
            for b in 0..blocks {
                s += parts[(r * blocks + b) * n_mix + k];
            }
            out[r * n_mix + k] = s;
        }
    }
    out
}

/// Asserts that `parts` [n, blocks, n_mix] are the products of the projection `proj`
/// [n_mix, hc * d] with the streams `x` [n, hc * d] over each block of `block` elements of d
/// (all hc streams of them): each within 1e-5 of the block's sum of |w x| of the exact (f64)
/// sum. Also that `x` has rows at all (a vacuous check fails).
#[track_caller]
pub(crate) fn assert_hc_partials(
    what: &str,
    parts: &[f32],
    proj: &[f32],
    x: &[f32],
    hc: usize,
    d: usize,
    block: usize,
) {
    let n_in = hc * d;
    let n_mix = proj.len() / n_in;
    let blocks = d.div_ceil(block);
    let n = x.len() / n_in;
    assert!(n > 0 && n_mix > 0, "{what}: no rows");
    assert_eq!(parts.len(), n * blocks * n_mix, "{what}: partials length");
    for r in 0..n {
        let xr = &x[r * n_in..(r + 1) * n_in];
        for b in 0..blocks {
            for k in 0..n_mix {
                let wk = &proj[k * n_in..(k + 1) * n_in];
                let (mut s, mut a) = (0f64, 0f64);
                for st in 0..hc {
                    for i in b * block..((b + 1) * block).min(d) {
                        let t = wk[st * d + i] as f64 * xr[st * d + i] as f64;
                        s += t;
                        a += t.abs();
                    }
                }
                let got = parts[(r * blocks + b) * n_mix + k];
                assert!(
                    (got as f64 - s).abs() <= 1e-5 * a + 1e-30,
                    "{what}: partial [{r}, {b}, {k}]: got {got}, want {s} (sum of |w x| {a})"
                );
            }
        }
    }
}
