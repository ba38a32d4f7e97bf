//! Tests of `ds4_argmax_rows` (shaders/cuda/decode_step.cu) and of the decoder's argmax steps:
//! the ids are the host's argmax of the same logits, bit for bit the same decision. Without a
//! GPU each test prints "skipped" and passes.

use std::sync::Arc;

use super::program::ARGMAX_THREADS;
use super::testutil::{context, read, Arg, DevBuf};
use super::NO_GREEDY;
use crate::backend::cuda::context::Context;
use crate::backend::tests::hard_rows;
use crate::backend::Greedy;
use crate::model::drafting::argmax;
use crate::model::{Logits, Model};
use crate::quant::testutil::Rng;
use crate::sampling::greedy;
use crate::session::Session;
use crate::state::KvPrecision;
use crate::Error;

/// Every row of `rows` (each `width` floats) through the kernel, the first row `skip` floats
/// into the buffer: the ids it writes.
fn kernel_ids(ctx: &Context, rows: &[Vec<f32>], width: usize, skip: usize) -> Vec<u32> {
    let mut flat = vec![0.0f32; skip];
    for r in rows {
        flat.extend_from_slice(r);
    }
    let x = DevBuf::from_slice(&flat).expect("rows");
    let out = DevBuf::zeroed(4 * rows.len()).expect("ids");
    let args = [Arg::Ptr(x.at(4 * skip)), Arg::I32(width as i32), Arg::Ptr(out.ptr)];
    ctx.launch_named("ds4_argmax_rows", (rows.len() as u32, 1, 1), ARGMAX_THREADS, 0, &args)
        .expect("launching ds4_argmax_rows");
    read(ctx, &out, rows.len())
}

/// Rows with ties, NaNs (at 0 and elsewhere), infinities and nothing above -inf, of widths
/// that take the float4 path (aligned multiples of 4, up to Flash's vocabulary) and the
/// scalar one (other widths, or rows not 16-byte aligned): the argmax is the host scan's
/// and the flag says what the greedy sampler refuses.
#[test]
fn argmax_rows_is_the_sequential_scan() {
    let Some(ctx) = context() else { return };
    let mut rng = Rng(0x000a_49ab);
    for width in [1usize, 3, 4, 5, 33, 128, 1000, 1001, 4096, 129_280] {
        let rows = hard_rows(width, &mut rng);
        for skip in [0, 1] {
            let ids = kernel_ids(&ctx, &rows, width, skip);
            for (r, (row, &id)) in rows.iter().zip(&ids).enumerate() {
                let what = format!("width {width}, skip {skip}, row {r}");
                assert_eq!(id & !NO_GREEDY, argmax(row), "{what}: argmax");
                assert_eq!(id & NO_GREEDY != 0, greedy(row).is_err(), "{what}: flag");
            }
        }
    }
}

/// tiny-l on the GPU, or `None` (after saying why) without one.
fn cuda_model() -> Option<Arc<Model>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tiny-l");
    let mut m = Model::load(dir.join("llamacpp-f32.gguf")).expect("tiny-l");
    match m.select_backend("cuda", &mut |_, _| {}) {
        Ok(()) => Some(Arc::new(m)),
        Err(Error::BackendUnavailable(e)) => {
            eprintln!("skipped: {e}");
            None
        }
        Err(e) => panic!("selecting the CUDA backend: {e}"),
    }
}

fn device_session(m: &Arc<Model>) -> Session {
    let mut s = Session::new(Arc::clone(m), 1024, KvPrecision::F32).expect("session");
    assert_eq!(s.forward_kind().expect("the decoder"), "device");
    s
}

fn ids(g: Greedy) -> Vec<u32> {
    match g {
        Greedy::Ids(ids) => ids,
        Greedy::Logits(_) => panic!("tiny-l's logits have a greedy token in every row"),
    }
}

/// Over a prompt (in chunks), decode steps and verifies of several rows (cut back), the
/// decoder's argmax steps give drafting's argmax of the logits its logits steps give, and the
/// same state; a session that alternates the two kinds of step (both programs of each size)
/// agrees with both.
#[test]
fn device_argmax_steps_are_the_argmax_of_the_device_logits() {
    let Some(m) = cuda_model() else { return };
    let vocab = m.config.vocab;
    let rows = |l: &[f32]| l.chunks(vocab).map(argmax).collect::<Vec<u32>>();
    let (mut a, mut b, mut c) = (device_session(&m), device_session(&m), device_session(&m));
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 500 + 3) as u32).collect();
    let want = rows(&a.eval(&prompt, Logits::Last).unwrap());
    assert_eq!(ids(b.eval_argmax(&prompt).unwrap()), want);
    assert_eq!(rows(&c.eval(&prompt, Logits::Last).unwrap()), want);
    let mut t = want[0];
    for step in 0..12 {
        let want = rows(&a.eval(&[t], Logits::Last).unwrap());
        assert_eq!(ids(b.eval_argmax(&[t]).unwrap()), want, "step {step}");
        let alt =
            if step % 2 == 0 { ids(c.eval_argmax(&[t]).unwrap()) } else { rows(&c.eval(&[t], Logits::Last).unwrap()) };
        assert_eq!(alt, want, "step {step}, alternating");
        t = want[0];
        if step % 3 == 2 {
            // A verify of a few rows (all 16 once), kept in part.
            let len = if step == 11 { 16 } else { 2 + step % 5 };
            let batch: Vec<u32> = (0..len).map(|i| (t + 7 * i as u32) % 500 + 3).collect();
            let (logits, alog) = a.verify(&batch).unwrap();
            let (g, blog) = b.verify_argmax(&batch).unwrap();
            assert_eq!(ids(g), rows(&logits), "verify after step {step}");
            let (g, clog) = c.verify_argmax(&batch).unwrap();
            assert_eq!(ids(g), rows(&logits), "verify after step {step}, alternating");
            let keep = 1 + step % len;
            a.keep(alog, keep).unwrap();
            b.keep(blog, keep).unwrap();
            c.keep(clog, keep).unwrap();
            t = batch[keep - 1];
        }
        assert_eq!(b.digest(), a.digest(), "state after step {step}");
        assert_eq!(c.digest(), a.digest(), "state after step {step}, alternating");
    }
}

/// `DS4_CUDA_PREFETCH` and the decoder's other switches: on by default, off with 0, and a typo
/// refused (the session then runs on the host, as for any decoder it cannot make) rather than
/// read as either, the error naming the setting. Host-side.
#[test]
fn prefetch_setting_parses() {
    use super::program::{prefetch_q_b, switch};
    for v in [None, Some(""), Some("1"), Some(" 1 ")] {
        assert!(prefetch_q_b(v).expect("a valid setting"), "{v:?}");
        assert!(switch("DS4_CUDA_EXPERT_MMA", v).expect("a valid setting"), "{v:?}");
    }
    assert!(!prefetch_q_b(Some("0")).expect("a valid setting"));
    assert!(!switch("DS4_CUDA_GEMM", Some("0")).expect("a valid setting"));
    for v in ["yes", "2", "all", "none", "wide"] {
        assert!(matches!(prefetch_q_b(Some(v)), Err(Error::InvalidArgument(_))), "{v:?}");
    }
    let err = switch("DS4_CUDA_DEFER", Some("on")).unwrap_err().to_string();
    assert!(err.contains("DS4_CUDA_DEFER") && err.contains("\"on\""), "{err}");
}

/// The tails' settings (`DS4_CUDA_ROUTE_TAIL`, `DS4_CUDA_NORM_TAIL`: opt-in, off unless 1, a
/// typo refused with its name) and where a tail applies: a one-row step that is not a
/// prompt's, on weights of a format the tail has a kernel for. Host-side.
#[test]
fn tail_settings_and_scope() {
    use super::program::{opt_in, tail_kernel};
    use crate::quant::GgmlType;
    for v in [None, Some(""), Some("0"), Some(" 0 ")] {
        assert!(!opt_in("DS4_CUDA_ROUTE_TAIL", v).expect("a valid setting"), "{v:?}");
    }
    assert!(opt_in("DS4_CUDA_NORM_TAIL", Some(" 1 ")).expect("a valid setting"));
    let err = opt_in("DS4_CUDA_ROUTE_TAIL", Some("yes")).unwrap_err().to_string();
    assert!(err.contains("DS4_CUDA_ROUTE_TAIL") && err.contains("\"yes\""), "{err}");
    for (ty, want) in [(GgmlType::F32, 0), (GgmlType::F16, 1), (GgmlType::BF16, 2), (GgmlType::Q8_0, 3)] {
        assert_eq!(tail_kernel(true, 1, false, ty, 4), Some(want), "{ty}");
    }
    assert_eq!(tail_kernel(true, 1, false, GgmlType::Q8_0, 3), None, "no Q8_0 router kernel");
    assert_eq!(tail_kernel(false, 1, false, GgmlType::F16, 3), None);
    assert_eq!(tail_kernel(true, 2, false, GgmlType::F16, 3), None);
    assert_eq!(tail_kernel(true, 1, true, GgmlType::F16, 3), None);
    assert_eq!(tail_kernel(true, 1, false, GgmlType::Q2_K, 4), None);
}

/// Where the wide SwiGLU applies (`DS4_CUDA_WIDE=1`): a prompt's step, whole float4s, and with
/// 8-bit activations whole blocks of 32 in rows of whole blocks. Host-side.
#[test]
fn wide_swiglu_scope() {
    use super::program::wide_swiglu;
    // Flash's routed SwiGLU of a 1024-row step (6 experts of 2048, 8-bit activations for
    // Q2_K) and its shared one (floats).
    assert!(wide_swiglu(true, true, 1024 * 6 * 2048, 2048, true));
    assert!(wide_swiglu(true, true, 1024 * 2048, 2048, false));
    assert!(!wide_swiglu(false, true, 1024 * 2048, 2048, false), "off");
    assert!(!wide_swiglu(true, false, 16 * 2048, 2048, false), "not in a decode's or verify's step");
    assert!(!wide_swiglu(true, true, 1022, 1022, false), "no whole float4s");
    assert!(wide_swiglu(true, true, 1020, 1020, false));
    assert!(!wide_swiglu(true, true, 32 * 36, 36, true), "rows not of whole blocks of 32");
    assert!(!wide_swiglu(true, true, 20 * 36, 36, true), "not whole blocks of 32");
    assert!(wide_swiglu(true, true, 20 * 96, 96, true));
}
