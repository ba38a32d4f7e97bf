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

/// [`context`] on a device of compute capability `major` or later; on an older one the test
/// prints "skipped: sm_XY has no {lacks}" and passes.
pub(crate) fn context_from(major: i32, lacks: &str) -> Option<Context> {
    let ctx = context()?;
    let (ma, mi) = ctx.compute_capability;
    if ma < major {
        eprintln!("skipped: sm_{ma}{mi} has no {lacks}");
        return None;
    }
    Some(ctx)
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

/// A copy of the image `raw` with the rows of each of `tensors` (a tensor and the rows of its
/// planes: an expert stack's are one expert's) that has a split format in the split device
/// layout, as [`super::super::CudaBackend::upload`] stores them: each plane in the layout of
/// its kernel.
pub(crate) fn split_image(raw: &[u8], tensors: &[(crate::model::weights::Mat, usize)]) -> Vec<u8> {
    let mut out = raw.to_vec();
    for (t, plane) in tensors.iter().filter(|(t, _)| crate::quant::split::is_split(t.ty)) {
        let tiles = super::super::context::tensor_cores(t.ty, t.n_in, *plane).then_some((*plane, 0));
        for p in (0..t.n_out).step_by(*plane) {
            let at = t.start + p * t.row_bytes;
            crate::quant::split::split_rows(t.ty, t.row_bytes, &mut out[at..at + plane * t.row_bytes], tiles);
        }
    }
    out
}
