//! Tests of the kernels of `shaders/cuda/decode_ops.cu` (norms, hyper-connections, query/key
//! finishing, SwiGLU, layout moves): each against the CPU reference of the crate on random
//! inputs, and for row invariance (a row of a batch is bitwise the row computed alone, at its
//! position). Without a GPU each test prints "skipped" and passes.

use half::f16;

use super::testutil::{assert_bits, assert_close, context, context_from, randn, read, step, Arg, DevBuf};
use crate::backend::cpu::{rms_norm, rms_norm_plain, rms_norm_rows, silu};
use crate::backend::cuda::context::Context;
use crate::backend::{Cpu, Ops};
use crate::model::block::finish_queries;
use crate::model::config::{ModelConfig, Yarn};
use crate::model::hyper::{self, Mix};
use crate::model::rope::Rope;
use crate::model::weights::{HyperWeights, Mat};
use crate::quant::GgmlType;
use crate::state::KvPrecision;

const EPS: f32 = 1e-6;
const HC: usize = 4;
const HC_EPS: f32 = 1e-6;
const ITERS: usize = 20;
const BLOCK: u32 = 256;
const POSITIONS: [usize; 4] = [0, 7, 1000, 70000];

fn buf(v: &[f32]) -> DevBuf {
    DevBuf::from_slice(v).expect("device buffer")
}

fn ptr(b: &DevBuf) -> Arg {
    Arg::Ptr(b.ptr)
}

/// Launches `name` on the context's stream (DevBuf's zeroing and uploads have finished when
/// they return).
fn launch(ctx: &Context, name: &str, grid: (usize, usize), args: &[Arg]) {
    ctx.launch_named(name, (grid.0 as u32, grid.1 as u32, 1), BLOCK, 0, args)
        .unwrap_or_else(|e| panic!("launching {name}: {e}"));
}

/// For f16-rounded outputs: every value is a half, and within one half step of the reference
/// (one f32 rounding step of difference before the rounding may cross a half boundary).
#[track_caller]
fn assert_close_f16(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        assert!(f16::from_f32(a).to_f32().to_bits() == a.to_bits(), "{what}[{i}]: {a} is not a half");
        let step = (b.abs().max(6.2e-5) * (1.0 / 1024.0)) * 1.01;
        assert!((a - b).abs() <= step, "{what}[{i}]: got {a}, want {b} (more than one half step)");
    }
}

/// Asserts that the rows of a batch run are bitwise the rows run alone: `alone(r)` is row r's
/// output computed as a batch of one (at row r's position).
#[track_caller]
fn assert_rows_invariant(what: &str, batch: &[f32], n: usize, mut alone: impl FnMut(usize) -> Vec<f32>) {
    let w = batch.len() / n;
    for r in 0..n {
        let one = alone(r);
        assert_bits(&format!("{what}: row {r} of {n} vs alone"), &batch[r * w..(r + 1) * w], &one);
    }
}

fn rope_plain() -> Rope {
    Rope::plain(10000.0, 64)
}

fn rope_yarn() -> Rope {
    let y = Yarn { factor: 16.0, original_context: 65536, beta_fast: 32.0, beta_slow: 1.0 };
    Rope::yarn(160000.0, 64, &y)
}

fn ropes() -> [(&'static str, Rope); 2] {
    [("plain", rope_plain()), ("yarn", rope_yarn())]
}

/// A configuration with the fields the tested functions read (the rest are placeholders).
fn config(hidden: usize, n_heads: usize, head_dim: usize) -> ModelConfig {
    ModelConfig {
        vocab: 1,
        hidden,
        n_heads,
        head_dim,
        rope_dim: 64,
        q_lora_rank: 1,
        o_groups: 1,
        o_lora_rank: 1,
        window: 128,
        rms_eps: EPS,
        rope_base: 10000.0,
        compress_rope_base: 160000.0,
        yarn: None,
        index_heads: 0,
        index_head_dim: 0,
        index_topk: 0,
        n_experts: 1,
        n_experts_used: 1,
        expert_ff: 1,
        n_shared_experts: 1,
        expert_weights_scale: 1.0,
        expert_weights_norm: true,
        hc_mult: HC,
        sinkhorn_iters: ITERS,
        hc_eps: HC_EPS,
        context_length: 1 << 20,
        nextn_layers: 0,
        bos: None,
        eos: None,
        layers: Vec::new(),
    }
}

// ---- RMS norms

/// `ds4_rms_plain` (w = None) or `ds4_rms_weight` over the rows of `x`, in place or not.
fn run_rms(ctx: &Context, x: &[f32], w: Option<&[f32]>, width: usize, in_place: bool) -> Vec<f32> {
    let n = x.len() / width;
    let xb = buf(x);
    let yb = if in_place { None } else { Some(DevBuf::zeroed(x.len() * 4).expect("y")) };
    let out = yb.as_ref().unwrap_or(&xb);
    let wb = w.map(buf);
    match &wb {
        None => launch(ctx, "ds4_rms_plain", (n, 1), &[ptr(&xb), ptr(out), Arg::I32(width as i32), Arg::F32(EPS)]),
        Some(wb) => {
            launch(ctx, "ds4_rms_weight", (n, 1), &[ptr(&xb), ptr(out), ptr(wb), Arg::I32(width as i32), Arg::F32(EPS)])
        }
    }
    read(ctx, out, x.len())
}

#[test]
fn rms_plain_matches_cpu() {
    let Some(ctx) = context() else { return };
    for (k, &width) in [64usize, 512, 1000, 4096, 16384].iter().enumerate() {
        let n = 5;
        let x = randn(n * width, 10 + k as u64, 3.0);
        let mut want = x.clone();
        for row in want.chunks_mut(width) {
            rms_norm_plain(row, EPS);
        }
        for in_place in [false, true] {
            let got = run_rms(&ctx, &x, None, width, in_place);
            assert_close(&format!("ds4_rms_plain width {width} in_place {in_place}"), &got, &want, 1e-5);
        }
        let batch = run_rms(&ctx, &x, None, width, false);
        assert_rows_invariant(&format!("ds4_rms_plain width {width}"), &batch, n, |r| {
            run_rms(&ctx, &x[r * width..(r + 1) * width], None, width, false)
        });
    }
}

/// A launch whose arguments do not match the kernel's parameters (too few, too many, a pointer
/// for an int) is an error, not a kernel reading past its arguments; a right one still runs.
/// Needs a driver that describes parameters (CUDA 12.4 and later).
#[test]
fn launch_with_wrong_arguments_is_an_error() {
    let Some(ctx) = context() else { return };
    if !ctx.param_info {
        eprintln!("skipped: the driver does not describe kernel parameters");
        return;
    }
    let x = randn(64, 5, 1.0);
    let xb = buf(&x);
    let yb = DevBuf::zeroed(64 * 4).expect("y");
    let right = [ptr(&xb), ptr(&yb), Arg::I32(64), Arg::F32(EPS)];
    let short = &right[..3];
    let long = [ptr(&xb), ptr(&yb), Arg::I32(64), Arg::F32(EPS), Arg::I32(1)];
    let swapped = [ptr(&xb), ptr(&yb), ptr(&xb), Arg::F32(EPS)];
    for (what, args) in [("too few", short), ("too many", &long[..]), ("a pointer for an int", &swapped[..])] {
        let e = ctx.launch_named("ds4_rms_plain", (1, 1, 1), BLOCK, 0, args);
        assert!(matches!(e, Err(crate::Error::Backend(_))), "{what}: {e:?}");
    }
    launch(&ctx, "ds4_rms_plain", (1, 1), &right);
    let mut want = x.clone();
    rms_norm_plain(&mut want, EPS);
    assert_close("ds4_rms_plain after refused launches", &read(&ctx, &yb, 64), &want, 1e-5);
}

#[test]
fn rms_weight_matches_cpu() {
    let Some(ctx) = context() else { return };
    for (k, &width) in [64usize, 512, 1000, 4096, 7168].iter().enumerate() {
        let n = 16;
        let x = randn(n * width, 20 + k as u64, 2.0);
        let w = randn(width, 30 + k as u64, 1.5);
        let mut want = x.clone();
        for row in want.chunks_mut(width) {
            rms_norm(row, &w, EPS);
        }
        for in_place in [false, true] {
            let got = run_rms(&ctx, &x, Some(&w), width, in_place);
            assert_close(&format!("ds4_rms_weight width {width} in_place {in_place}"), &got, &want, 1e-5);
        }
        let batch = run_rms(&ctx, &x, Some(&w), width, true);
        assert_rows_invariant(&format!("ds4_rms_weight width {width}"), &batch, n, |r| {
            run_rms(&ctx, &x[r * width..(r + 1) * width], Some(&w), width, true)
        });
    }
}

// ---- hyper-connections

/// A hyper-connection site with an F32 projection of `n_out` rows over `hc * d` inputs, in
/// its own file image; scaled so that the mixing logits are of order one.
fn hyper_site(n_out: usize, hc: usize, d: usize, seed: u64) -> (Vec<u8>, HyperWeights) {
    let n_in = hc * d;
    let proj = randn(n_out * n_in, seed, 3.0 / (n_in as f32).sqrt());
    let raw: Vec<u8> = proj.iter().flat_map(|v| v.to_le_bytes()).collect();
    let row_bytes = GgmlType::F32.row_bytes(n_in as u64).expect("f32 row") as usize;
    let w = HyperWeights {
        proj: Mat { ty: GgmlType::F32, n_in, n_out, start: 0, row_bytes },
        base: randn(n_out, seed + 1, 1.0),
        scale: randn(3, seed + 2, 2.0),
    };
    (raw, w)
}

/// The mixing logits exactly as hyper.rs mix_logits computes them (each row of the flattened
/// streams RMS-normalized, then the CPU product): the kernels' input.
fn mix_logits(ops: Ops<'_>, w: &HyperWeights, x: &[f32]) -> Vec<f32> {
    let mut flat = x.to_vec();
    for row in flat.chunks_mut(w.proj.n_in) {
        rms_norm_plain(row, EPS);
    }
    ops.matmul(&w.proj, &flat).expect("mixing logits")
}

/// `ds4_hc_pre` with `hc` streams over the rows of `logits` (the raw streams' mixing logits),
/// its collapse normed with weight `norm` when given: (y, mix). The Sinkhorn iterations run
/// inside ds4_hc_pre, or with `apart` (as the decode's side branch does) none there and all
/// ITERS in ds4_hc_sinkhorn after it.
#[allow(clippy::too_many_arguments)]
fn run_hc_pre(
    ctx: &Context,
    hc: usize,
    logits: &[f32],
    x: &[f32],
    w: &HyperWeights,
    d: usize,
    norm: Option<&[f32]>,
    apart: bool,
) -> (Vec<f32>, Vec<f32>) {
    let n_mix = (2 + hc) * hc;
    let n = logits.len() / n_mix;
    let (lb, xb, bb, sb) = (buf(logits), buf(x), buf(&w.base), buf(&w.scale));
    let nb = norm.map(buf);
    let yb = DevBuf::zeroed(n * d * 4).expect("y");
    let mb = DevBuf::zeroed(n * (hc + hc * hc) * 4).expect("mix");
    // As many threads as the decode gives a row of d (ds4_hc_pre's register path needs d to be
    // 1, 2 or 4 times the block).
    ctx.launch_named(
        "ds4_hc_pre",
        (n as u32, 1, 1),
        super::program::wide(d),
        0,
        &[
            ptr(&lb),
            Arg::I32(n_mix as i32),
            ptr(&xb),
            ptr(&yb),
            ptr(&mb),
            ptr(&bb),
            ptr(&sb),
            Arg::I32(hc as i32),
            Arg::I32(d as i32),
            Arg::F32(HC_EPS),
            Arg::I32(if apart { 0 } else { ITERS as i32 }),
            nb.as_ref().map_or(Arg::Ptr(0), ptr),
            Arg::F32(EPS),
        ],
    )
    .expect("launching ds4_hc_pre");
    if apart {
        let args = [ptr(&mb), Arg::I32(hc as i32), Arg::F32(HC_EPS), Arg::I32(ITERS as i32)];
        ctx.launch_named("ds4_hc_sinkhorn", (n as u32, 1, 1), 32, 0, &args).expect("launching ds4_hc_sinkhorn");
    }
    (read(ctx, &yb, n * d), read(ctx, &mb, n * (hc + hc * hc)))
}

/// The Flash case (4 streams) at several widths, then every other stream count the kernel
/// takes (it is compiled once per count).
#[test]
fn hc_pre_matches_cpu() {
    let Some(ctx) = context() else { return };
    // At the decode's block sizes: d = 4096, 2048, 512, 256 and 1024 take the register path
    // (d a multiple 1, 2 or 4 of the block), the others the general one.
    let cases = [
        (HC, 64usize),
        (HC, 1000),
        (HC, 4096),
        (HC, 2048),
        (1, 300),
        (1, 256),
        (2, 1000),
        (2, 1024),
        (3, 512),
        (5, 700),
        (5, 2048),
    ];
    for (k, &(hc, d)) in cases.iter().enumerate() {
        let what = format!("ds4_hc_pre hc {hc} d {d}");
        let n = 5;
        let n_mix = (2 + hc) * hc;
        let (raw, w) = hyper_site(n_mix, hc, d, 40 + k as u64);
        let ops = Ops { raw: &raw, backend: &Cpu };
        let x = randn(n * hc * d, 50 + k as u64, 2.0);
        let cfg = ModelConfig { hc_mult: hc, ..config(d, 1, 64) };
        let (want_y, mixes) = hyper::pre(ops, &w, &x, &cfg).expect("hyper::pre");
        // ds4_hc_pre takes the product of the raw streams and applies their RMS scale itself.
        let logits = ops.matmul(&w.proj, &x).expect("raw mixing logits");
        let row = |r: usize| (&logits[r * n_mix..(r + 1) * n_mix], &x[r * hc * d..(r + 1) * hc * d]);
        let (y, mix) = run_hc_pre(&ctx, hc, &logits, &x, &w, d, None, false);
        assert_close(&format!("{what}: y"), &y, &want_y, 1e-5);
        // With the sublayer's norm fused: the CPU's rms_norm of the collapse.
        let nw = randn(d, 60 + k as u64, 1.0);
        let mut want_normed = want_y.clone();
        for row in want_normed.chunks_mut(d) {
            rms_norm(row, &nw, EPS);
        }
        let (normed, mix2) = run_hc_pre(&ctx, hc, &logits, &x, &w, d, Some(&nw), false);
        assert_close(&format!("{what}: normed y"), &normed, &want_normed, 1e-5);
        assert_eq!(mix2, mix, "{what}: mix with the norm");
        // The decode's way: no iterations in ds4_hc_pre, all of them in ds4_hc_sinkhorn.
        let (normed3, mix3) = run_hc_pre(&ctx, hc, &logits, &x, &w, d, Some(&nw), true);
        assert_eq!(normed3, normed, "{what}: normed y, Sinkhorn apart");
        assert_eq!(mix3, mix, "{what}: mix, Sinkhorn apart");
        assert_rows_invariant(&format!("{what}: normed y"), &normed, n, |r| {
            let (lr, xr) = row(r);
            run_hc_pre(&ctx, hc, lr, xr, &w, d, Some(&nw), false).0
        });
        for (r, m) in mixes.iter().enumerate() {
            let got = &mix[r * (hc + hc * hc)..(r + 1) * (hc + hc * hc)];
            assert_close(&format!("{what}: post, row {r}"), &got[..hc], &m.post, 1e-5);
            assert_close(&format!("{what}: comb, row {r}"), &got[hc..], &m.comb, 5e-5);
        }
        assert_rows_invariant(&format!("{what}: y"), &y, n, |r| {
            let (lr, xr) = row(r);
            run_hc_pre(&ctx, hc, lr, xr, &w, d, None, false).0
        });
        assert_rows_invariant(&format!("{what}: mix"), &mix, n, |r| {
            let (lr, xr) = row(r);
            run_hc_pre(&ctx, hc, lr, xr, &w, d, None, false).1
        });
    }
}

/// `ds4_hc_site` over the rows of `x` (hc streams of d each) with the projection `proj` (the
/// bytes of `w.proj`, F16 or F32), its collapse normed with `norm` when given, the previous
/// site's expansion (`post`: its sublayer output and mix) first when given: (y, mix, x after).
/// `iters`: the Sinkhorn iterations inside the kernel (0: none, as the decode's side branch).
#[allow(clippy::too_many_arguments)]
fn run_hc_site(
    ctx: &Context,
    hc: usize,
    proj: &[u8],
    w: &HyperWeights,
    x: &[f32],
    d: usize,
    norm: Option<&[f32]>,
    iters: usize,
    post: Option<(&[f32], &[f32])>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let n = x.len() / (hc * d);
    let pb = DevBuf::from_slice(proj).expect("projection");
    let (xb, bb, sb) = (buf(x), buf(&w.base), buf(&w.scale));
    let nb = norm.map(buf);
    let post = post.map(|(f, m)| (buf(f), buf(m)));
    let yb = DevBuf::zeroed(n * d * 4).expect("y");
    let mb = DevBuf::zeroed(n * (hc + hc * hc) * 4).expect("mix");
    let cols = d / 8;
    ctx.launch_named(
        "ds4_hc_site",
        (8, n as u32, 1),
        (cols.div_ceil(32) * 32) as u32,
        0,
        &[
            Arg::Ptr(pb.ptr),
            Arg::I32(w.proj.row_bytes as i32),
            Arg::I32((w.proj.ty == GgmlType::F16) as i32),
            ptr(&xb),
            ptr(&yb),
            ptr(&mb),
            ptr(&bb),
            ptr(&sb),
            Arg::I32(hc as i32),
            Arg::I32(d as i32),
            Arg::F32(HC_EPS),
            Arg::I32(iters as i32),
            nb.as_ref().map_or(Arg::Ptr(0), ptr),
            Arg::F32(EPS),
            post.as_ref().map_or(Arg::Ptr(0), |p| ptr(&p.0)),
            post.as_ref().map_or(Arg::Ptr(0), |p| ptr(&p.1)),
        ],
    )
    .expect("launching ds4_hc_site");
    (read(ctx, &yb, n * d), read(ctx, &mb, n * (hc + hc * hc)), read(ctx, &xb, x.len()))
}

/// The site in one cluster launch against the CPU's hyper::pre (and hyper::post before it),
/// for F32 and F16 projections, the Flash shape and smaller ones (threads past d / 8 idle);
/// the expansion folded in gives ds4_hc_post's x bit for bit; Sinkhorn inside or apart the
/// same mix; every row bitwise the row alone.
#[test]
fn hc_site_matches_cpu() {
    let Some(ctx) = context_from(9, "thread block clusters") else { return };
    let cases = [(HC, 4096usize, true), (HC, 4096, false), (HC, 1024, true), (HC, 1000, false), (HC, 64, true)];
    let cases = cases.into_iter().chain([(1, 256, true), (2, 512, false), (3, 136, true)]);
    for (k, (hc, d, half)) in cases.enumerate() {
        let what = format!("ds4_hc_site hc {hc} d {d} {}", if half { "F16" } else { "F32" });
        let n = 5;
        let n_mix = (2 + hc) * hc;
        let (mut raw, mut w) = hyper_site(n_mix, hc, d, 140 + k as u64);
        if half {
            raw = raw
                .chunks(4)
                .flat_map(|b| f16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes())
                .collect();
            w.proj = Mat { ty: GgmlType::F16, row_bytes: 2 * hc * d, ..w.proj };
        }
        let ops = Ops { raw: &raw, backend: &Cpu };
        let x0 = randn(n * hc * d, 150 + k as u64, 2.0);
        let cfg = ModelConfig { hc_mult: hc, ..config(d, 1, 64) };
        let nw = randn(d, 160 + k as u64, 1.0);
        let check = |got: (&[f32], &[f32]), x: &[f32], tag: &str| {
            let (want_y, mixes) = hyper::pre(ops, &w, x, &cfg).expect("hyper::pre");
            let mut want = want_y.clone();
            for row in want.chunks_mut(d) {
                rms_norm(row, &nw, EPS);
            }
            assert_close(&format!("{what}{tag}: normed y"), got.0, &want, 1e-5);
            for (r, m) in mixes.iter().enumerate() {
                let g = &got.1[r * (hc + hc * hc)..(r + 1) * (hc + hc * hc)];
                assert_close(&format!("{what}{tag}: post, row {r}"), &g[..hc], &m.post, 1e-5);
                assert_close(&format!("{what}{tag}: comb, row {r}"), &g[hc..], &m.comb, 5e-5);
            }
        };
        let (y, mix, x_after) = run_hc_site(&ctx, hc, &raw, &w, &x0, d, Some(&nw), ITERS, None);
        check((&y, &mix), &x0, "");
        assert_bits(&format!("{what}: x untouched"), &x_after, &x0);
        // Without the norm: the plain collapse.
        let (plain, mix1, _) = run_hc_site(&ctx, hc, &raw, &w, &x0, d, None, ITERS, None);
        let (want_plain, _) = hyper::pre(ops, &w, &x0, &cfg).expect("hyper::pre");
        assert_close(&format!("{what}: y"), &plain, &want_plain, 1e-5);
        assert_bits(&format!("{what}: mix without the norm"), &mix1, &mix);
        // The decode's way: no iterations here, all of them in ds4_hc_sinkhorn after.
        let (y0, mix0, _) = run_hc_site(&ctx, hc, &raw, &w, &x0, d, Some(&nw), 0, None);
        let mb = buf(&mix0);
        let args = [ptr(&mb), Arg::I32(hc as i32), Arg::F32(HC_EPS), Arg::I32(ITERS as i32)];
        ctx.launch_named("ds4_hc_sinkhorn", (n as u32, 1, 1), 32, 0, &args).expect("launching ds4_hc_sinkhorn");
        assert_bits(&format!("{what}: y, Sinkhorn apart"), &y0, &y);
        assert_bits(&format!("{what}: mix, Sinkhorn apart"), &read(&ctx, &mb, mix.len()), &mix);
        assert_rows_invariant(&format!("{what}: normed y"), &y, n, |r| {
            run_hc_site(&ctx, hc, &raw, &w, &x0[r * hc * d..(r + 1) * hc * d], d, Some(&nw), ITERS, None).0
        });
        assert_rows_invariant(&format!("{what}: mix"), &mix, n, |r| {
            run_hc_site(&ctx, hc, &raw, &w, &x0[r * hc * d..(r + 1) * hc * d], d, Some(&nw), ITERS, None).1
        });
        if hc != HC {
            continue;
        }
        // The previous site's expansion folded in: x as ds4_hc_post leaves it, bit for bit,
        // then the site on it.
        let f = randn(n * d, 170 + k as u64, 2.0);
        let prev: Vec<f32> = (0..n * (HC + HC * HC)).map(|i| 0.5 + 0.01 * (i % 37) as f32).collect();
        let want_x = run_hc_post(&ctx, &x0, &f, &prev, d);
        let (y2, mix2, x2) = run_hc_site(&ctx, hc, &raw, &w, &x0, d, Some(&nw), ITERS, Some((&f, &prev)));
        assert_bits(&format!("{what}: x after the expansion"), &x2, &want_x);
        check((&y2, &mix2), &want_x, " after the expansion");
        let (y3, mix3, _) = run_hc_site(&ctx, hc, &raw, &w, &want_x, d, Some(&nw), ITERS, None);
        assert_bits(&format!("{what}: y after the expansion"), &y2, &y3);
        assert_bits(&format!("{what}: mix after the expansion"), &mix2, &mix3);
    }
}

/// `ds4_hc_post` in place on `x` (n rows of hc * d).
fn run_hc_post(ctx: &Context, x: &[f32], f: &[f32], mix: &[f32], d: usize) -> Vec<f32> {
    let n = f.len() / d;
    let (xb, fb, mb) = (buf(x), buf(f), buf(mix));
    launch(
        ctx,
        "ds4_hc_post",
        (d.div_ceil(BLOCK as usize), n),
        &[ptr(&xb), ptr(&fb), ptr(&mb), Arg::I32(HC as i32), Arg::I32(d as i32)],
    );
    read(ctx, &xb, x.len())
}

#[test]
fn hc_post_matches_cpu() {
    let Some(ctx) = context() else { return };
    for (k, &d) in [64usize, 1000, 4096].iter().enumerate() {
        let n = 16;
        let seed = 60 + 10 * k as u64;
        let x = randn(n * HC * d, seed, 2.0);
        let f = randn(n * d, seed + 1, 2.0);
        let post = randn(n * HC, seed + 2, 1.0);
        let comb = randn(n * HC * HC, seed + 3, 0.5);
        let mixes: Vec<Mix> = (0..n)
            .map(|r| Mix {
                post: post[r * HC..(r + 1) * HC].iter().map(|v| v + 1.0).collect(),
                comb: comb[r * HC * HC..(r + 1) * HC * HC].iter().map(|v| v + 0.5).collect(),
            })
            .collect();
        let mix: Vec<f32> = mixes.iter().flat_map(|m| m.post.iter().chain(&m.comb).copied()).collect();
        let mut want = x.clone();
        hyper::post(&mut want, &f, &mixes, HC, d);
        let got = run_hc_post(&ctx, &x, &f, &mix, d);
        assert_close(&format!("ds4_hc_post d {d}"), &got, &want, 1e-5);
        let w = HC + HC * HC;
        assert_rows_invariant(&format!("ds4_hc_post d {d}"), &got, n, |r| {
            run_hc_post(&ctx, &x[r * HC * d..(r + 1) * HC * d], &f[r * d..(r + 1) * d], &mix[r * w..(r + 1) * w], d)
        });
    }
}

/// `ds4_hc_head` over the rows of `logits` (hc per row).
fn run_hc_head(ctx: &Context, logits: &[f32], x: &[f32], w: &HyperWeights, d: usize) -> Vec<f32> {
    let n = logits.len() / HC;
    let (lb, xb, bb, sb) = (buf(logits), buf(x), buf(&w.base), buf(&w.scale));
    let yb = DevBuf::zeroed(n * d * 4).expect("y");
    launch(
        ctx,
        "ds4_hc_head",
        (n, 1),
        &[ptr(&lb), ptr(&xb), ptr(&yb), ptr(&bb), ptr(&sb), Arg::I32(HC as i32), Arg::I32(d as i32), Arg::F32(HC_EPS)],
    );
    read(ctx, &yb, n * d)
}

#[test]
fn hc_head_matches_cpu() {
    let Some(ctx) = context() else { return };
    for (k, &d) in [64usize, 1000, 4096].iter().enumerate() {
        let n = 5;
        let (raw, w) = hyper_site(HC, HC, d, 90 + k as u64);
        let ops = Ops { raw: &raw, backend: &Cpu };
        let x = randn(n * HC * d, 95 + k as u64, 2.0);
        let want = hyper::head(ops, &w, &x, HC, d, EPS, HC_EPS).expect("hyper::head");
        let logits = mix_logits(ops, &w, &x);
        let got = run_hc_head(&ctx, &logits, &x, &w, d);
        assert_close(&format!("ds4_hc_head d {d}"), &got, &want, 1e-5);
        assert_rows_invariant(&format!("ds4_hc_head d {d}"), &got, n, |r| {
            run_hc_head(&ctx, &logits[r * HC..(r + 1) * HC], &x[r * HC * d..(r + 1) * HC * d], &w, d)
        });
    }
}

// ---- query / key finishing

/// `ds4_finish_q` in place on `q` (rows of n_heads * head_dim), row 0 at `pos0`.
fn run_finish_q(ctx: &Context, q: &[f32], n_heads: usize, head_dim: usize, rope: &Rope, pos0: usize) -> Vec<f32> {
    let n = q.len() / (n_heads * head_dim);
    let (qb, fb) = (buf(q), buf(rope.inv_freq()));
    let sb = step(ctx, pos0, &vec![0; n]);
    launch(
        ctx,
        "ds4_finish_q",
        (n_heads, n),
        &[
            ptr(&qb),
            Arg::I32(n_heads as i32),
            Arg::I32(head_dim as i32),
            Arg::F32(EPS),
            ptr(&fb),
            Arg::I32(rope.dim() as i32),
            ptr(&sb),
        ],
    );
    read(ctx, &qb, q.len())
}

#[test]
fn finish_q_matches_cpu() {
    let Some(ctx) = context() else { return };
    let (n_heads, head_dim, n) = (16, 512, 5);
    let cfg = config(64, n_heads, head_dim);
    for (name, rope) in ropes() {
        for (k, &pos0) in POSITIONS.iter().enumerate() {
            let what = format!("ds4_finish_q rope {name} pos {pos0}");
            let q = randn(n * n_heads * head_dim, 100 + k as u64, 3.0);
            let mut want = q.clone();
            let positions: Vec<usize> = (pos0..pos0 + n).collect();
            finish_queries(&mut want, &cfg, &rope, &positions);
            let got = run_finish_q(&ctx, &q, n_heads, head_dim, &rope, pos0);
            assert_close(&what, &got, &want, 1e-5);
            let w = n_heads * head_dim;
            assert_rows_invariant(&what, &got, n, |r| {
                run_finish_q(&ctx, &q[r * w..(r + 1) * w], n_heads, head_dim, &rope, pos0 + r)
            });
        }
    }
}

/// The reference of block.rs finish_kv (whose LayerWeights are not built here): `kv_norm`,
/// rotation at the row's position, rounding to the storage precision.
fn finish_kv_ref(kv: &mut [f32], w: &[f32], rope: &Rope, precision: KvPrecision, pos0: usize) {
    rms_norm_rows(kv, w, EPS);
    for (r, k) in kv.chunks_mut(w.len()).enumerate() {
        rope.apply(k, pos0 + r, false);
        precision.round_kv(k, rope.dim());
    }
}

/// `ds4_finish_kv` in place on `kv` (rows of head_dim), row 0 at `pos0`.
fn run_finish_kv(ctx: &Context, kv: &[f32], w: &[f32], rope: &Rope, mode: i32, pos0: usize) -> Vec<f32> {
    let head_dim = w.len();
    let n = kv.len() / head_dim;
    let (kb, wb, fb) = (buf(kv), buf(w), buf(rope.inv_freq()));
    let sb = step(ctx, pos0, &vec![0; n]);
    launch(
        ctx,
        "ds4_finish_kv",
        (n, 1),
        &[
            ptr(&kb),
            ptr(&wb),
            Arg::I32(head_dim as i32),
            Arg::F32(EPS),
            ptr(&fb),
            Arg::I32(rope.dim() as i32),
            Arg::I32(mode),
            ptr(&sb),
        ],
    );
    read(ctx, &kb, kv.len())
}

#[test]
fn finish_kv_matches_cpu() {
    let Some(ctx) = context() else { return };
    let (head_dim, n) = (512, 16);
    let w = randn(head_dim, 7, 1.5);
    for (name, rope) in ropes() {
        for (mode, precision) in [(0, KvPrecision::F32), (1, KvPrecision::F16)] {
            for (k, &pos0) in POSITIONS.iter().enumerate() {
                let what = format!("ds4_finish_kv rope {name} mode {mode} pos {pos0}");
                let kv = randn(n * head_dim, 200 + k as u64, 3.0);
                let mut want = kv.clone();
                finish_kv_ref(&mut want, &w, &rope, precision, pos0);
                let got = run_finish_kv(&ctx, &kv, &w, &rope, mode, pos0);
                if mode == 0 {
                    assert_close(&what, &got, &want, 1e-5);
                } else {
                    assert_close_f16(&what, &got, &want);
                }
                assert_rows_invariant(&what, &got, n, |r| {
                    run_finish_kv(&ctx, &kv[r * head_dim..(r + 1) * head_dim], &w, &rope, mode, pos0 + r)
                });
            }
        }
    }
}

/// `ds4_finish_rows` (decode_attn.cu), the decode's one launch, is bitwise the finishing
/// kernels and the ring write launched one after the other at its block size, with and without
/// indexer heads.
#[test]
fn finish_rows_is_the_kernels_in_one_launch() {
    let Some(ctx) = context() else { return };
    let (nh, hd, idim, slots, n, pos0, mode) = (4usize, 512usize, 128usize, 8usize, 5usize, 13usize, 1);
    let [_, (_, rope)] = ropes();
    let rd = Arg::I32(rope.dim() as i32);
    let (wb, fb, sb) = (buf(&randn(hd, 8, 1.5)), buf(rope.inv_freq()), step(&ctx, pos0, &[0; 5]));
    let run = |name: &str, grid: (usize, usize), args: &[Arg]| {
        ctx.launch_named(name, (grid.0 as u32, grid.1 as u32, 1), 128, 0, args)
            .unwrap_or_else(|e| panic!("launching {name}: {e}"));
    };
    for ih in [0usize, 3] {
        let what = format!("ds4_finish_rows, {ih} indexer heads");
        let gs = 1.0 / (ih.max(1) as f32).sqrt();
        let inputs = [
            randn(n * nh * hd, 400, 3.0),
            randn(n * hd, 401, 3.0),
            randn(slots * hd, 402, 1.0),
            randn(n * ih.max(1) * idim, 403, 3.0),
            randn(n * ih.max(1), 404, 2.0),
        ];
        // q, kv, ring, iq, g: one by one, then in one launch.
        let one: Vec<DevBuf> = inputs.iter().map(|v| buf(v)).collect();
        let [q, kv, ring, iq, g] = &one[..] else { unreachable!() };
        run(
            "ds4_finish_q",
            (nh, n),
            &[ptr(q), Arg::I32(nh as i32), Arg::I32(hd as i32), Arg::F32(EPS), ptr(&fb), rd, ptr(&sb)],
        );
        let kv_args = [ptr(kv), ptr(&wb), Arg::I32(hd as i32), Arg::F32(EPS), ptr(&fb), rd, Arg::I32(mode), ptr(&sb)];
        run("ds4_finish_kv", (n, 1), &kv_args);
        run("ds4_ring_write", (n, 1), &[ptr(kv), ptr(ring), Arg::I32(slots as i32), Arg::I32(hd as i32), ptr(&sb)]);
        if ih > 0 {
            let (h, d) = (Arg::I32(ih as i32), Arg::I32(idim as i32));
            run(
                "ds4_finish_index",
                (ih, n),
                &[ptr(iq), ptr(g), h, d, ptr(&fb), rd, Arg::I32(mode), Arg::F32(gs), ptr(&sb)],
            );
        }
        let fused: Vec<DevBuf> = inputs.iter().map(|v| buf(v)).collect();
        let [q2, kv2, ring2, iq2, g2] = &fused[..] else { unreachable!() };
        run(
            "ds4_finish_rows",
            (nh + 1 + ih, n),
            &[
                ptr(q2),
                Arg::I32(nh as i32),
                Arg::I32(hd as i32),
                Arg::F32(EPS),
                ptr(&fb),
                rd,
                ptr(&sb),
                ptr(kv2),
                ptr(&wb),
                Arg::I32(mode),
                ptr(ring2),
                Arg::I32(slots as i32),
                ptr(iq2),
                ptr(g2),
                Arg::I32(ih as i32),
                Arg::I32(idim as i32),
                Arg::F32(gs),
            ],
        );
        for (k, name) in ["q", "kv", "ring", "iq", "g"].iter().enumerate() {
            let len = inputs[k].len();
            let (want, got): (Vec<f32>, Vec<f32>) = (read(&ctx, &one[k], len), read(&ctx, &fused[k], len));
            assert_bits(&format!("{what}: {name}"), &got, &want);
            let changed = want != inputs[k];
            assert!(changed == (ih > 0 || k < 3), "{what}: {name} changed: {changed}");
        }
    }
}

/// The reference of the indexer-query part of Model::attention (rust/engine/model/forward.rs):
/// each row's heads rotated at the row's position and rounded, the weights scaled by gs.
fn finish_index_ref(iq: &mut [f32], g: &mut [f32], heads: usize, id: usize, rope: &Rope, p: KvPrecision, pos0: usize) {
    for (r, qr) in iq.chunks_mut(heads * id).enumerate() {
        rope.apply_heads(qr, id, pos0 + r, false);
        p.round_index(qr, id);
    }
    let gs = 1.0 / (heads as f32).sqrt();
    g.iter_mut().for_each(|v| *v *= gs);
}

/// `ds4_finish_index` in place on `iq` and `g` (`shape`: heads, head_dim), row 0 at `pos0`:
/// (iq, g).
fn run_finish_index(
    ctx: &Context,
    iq: &[f32],
    g: &[f32],
    (heads, head_dim): (usize, usize),
    rope: &Rope,
    mode: i32,
    pos0: usize,
) -> (Vec<f32>, Vec<f32>) {
    let n = g.len() / heads;
    let (qb, gb, fb) = (buf(iq), buf(g), buf(rope.inv_freq()));
    let sb = step(ctx, pos0, &vec![0; n]);
    let gs = 1.0 / (heads as f32).sqrt();
    launch(
        ctx,
        "ds4_finish_index",
        (heads, n),
        &[
            ptr(&qb),
            ptr(&gb),
            Arg::I32(heads as i32),
            Arg::I32(head_dim as i32),
            ptr(&fb),
            Arg::I32(rope.dim() as i32),
            Arg::I32(mode),
            Arg::F32(gs),
            ptr(&sb),
        ],
    );
    (read(ctx, &qb, iq.len()), read(ctx, &gb, g.len()))
}

#[test]
fn finish_index_matches_cpu() {
    let Some(ctx) = context() else { return };
    let (heads, id, n) = (64, 128, 5);
    for (name, rope) in ropes() {
        for (mode, precision) in [(0, KvPrecision::F32), (1, KvPrecision::F16)] {
            for (k, &pos0) in POSITIONS.iter().enumerate() {
                let what = format!("ds4_finish_index rope {name} mode {mode} pos {pos0}");
                let iq = randn(n * heads * id, 300 + k as u64, 3.0);
                let g = randn(n * heads, 310 + k as u64, 2.0);
                let (mut want_q, mut want_g) = (iq.clone(), g.clone());
                finish_index_ref(&mut want_q, &mut want_g, heads, id, &rope, precision, pos0);
                let (got_q, got_g) = run_finish_index(&ctx, &iq, &g, (heads, id), &rope, mode, pos0);
                if mode == 0 {
                    assert_close(&format!("{what} iq"), &got_q, &want_q, 1e-5);
                } else {
                    assert_close_f16(&format!("{what} iq"), &got_q, &want_q);
                }
                assert_bits(&format!("{what} g"), &got_g, &want_g);
                let w = heads * id;
                let alone = |r: usize| {
                    run_finish_index(
                        &ctx,
                        &iq[r * w..(r + 1) * w],
                        &g[r * heads..(r + 1) * heads],
                        (heads, id),
                        &rope,
                        mode,
                        pos0 + r,
                    )
                };
                assert_rows_invariant(&format!("{what} iq"), &got_q, n, |r| alone(r).0);
                assert_rows_invariant(&format!("{what} g"), &got_g, n, |r| alone(r).1);
            }
        }
    }
}

// ---- SwiGLU and layout

/// The reference of moe.rs swiglu (private there): `silu(min(g, c)) * clamp(u, ±c)`.
fn swiglu_ref(g: &[f32], u: &[f32], clamp: f32) -> Vec<f32> {
    g.iter().zip(u).map(|(&g, &u)| silu(g.min(clamp)) * u.clamp(-clamp, clamp)).collect()
}

fn run_swiglu(ctx: &Context, g: &[f32], u: &[f32], clamp: f32) -> Vec<f32> {
    let count = g.len();
    let (gb, ub) = (buf(g), buf(u));
    let ob = DevBuf::zeroed(count * 4).expect("out");
    launch(
        ctx,
        "ds4_swiglu",
        (count.div_ceil(BLOCK as usize), 1),
        &[ptr(&gb), ptr(&ub), ptr(&ob), Arg::I32(count as i32), Arg::F32(clamp), Arg::I32(count as i32), Arg::I32(0)],
    );
    read(ctx, &ob, count)
}

#[test]
fn swiglu_matches_cpu() {
    let Some(ctx) = context() else { return };
    let (ff, n) = (2048 + 17, 5);
    for (k, &clamp) in [10.0f32, 7.0, f32::INFINITY].iter().enumerate() {
        let what = format!("ds4_swiglu clamp {clamp}");
        let mut g = randn(n * ff, 400 + k as u64, 20.0);
        let u = randn(n * ff, 410 + k as u64, 20.0);
        // Large negative gates (e^-g overflows to infinity) as well.
        g[3] = -120.0;
        g[4] = 120.0;
        let want = swiglu_ref(&g, &u, clamp);
        let got = run_swiglu(&ctx, &g, &u, clamp);
        assert_close(&what, &got, &want, 1e-5);
        assert_rows_invariant(&what, &got, n, |r| {
            run_swiglu(&ctx, &g[r * ff..(r + 1) * ff], &u[r * ff..(r + 1) * ff], clamp)
        });
    }
}
