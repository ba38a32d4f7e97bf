//! CUDA backend tests. Without NVRTC (compile test) or without a GPU (the others) they print
//! why and pass: CI has neither. On a GPU machine: `cargo test --release --features cuda cuda`.

use super::device::{Arg, DevBuf};
use super::*;
use crate::backend::cpu;
use crate::quant::testutil::{random_blocks, Rng};
use crate::quant::{self, GgmlType};

/// The backend of device 0, or `None` (after saying why) when there is none.
fn backend() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

/// `rows` random valid rows of `n_in` elements of `ty`: the crate's quantizer or float
/// conversions where there is one, else random quant blocks with sane f16 scales
/// ([`random_blocks`]; MXFP4: exponents near 2^0).
fn random_matrix(ty: GgmlType, rows: usize, n_in: usize, rng: &mut Rng) -> Vec<u8> {
    let row = ty.row_bytes(n_in as u64).unwrap() as usize;
    let floats = rng.f32s(rows * n_in);
    match ty {
        GgmlType::F32 => floats.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 | GgmlType::BF16 => {
            let mut h = vec![0u16; floats.len()];
            if ty == GgmlType::F16 {
                quant::f32_to_f16(&floats, &mut h).unwrap();
            } else {
                quant::f32_to_bf16(&floats, &mut h).unwrap();
            }
            h.iter().flat_map(|v| v.to_le_bytes()).collect()
        }
        GgmlType::Q8_0 => {
            let mut m = vec![0u8; rows * row];
            quant::quantize_q8_0(&floats, &mut m).unwrap();
            m
        }
        _ => {
            let scales: &[usize] = match ty {
                GgmlType::IQ2_XXS => &[0],
                GgmlType::Q4_K => &[0, 2],
                GgmlType::Q2_K => &[80, 82],
                GgmlType::MXFP4 => &[],
                _ => unreachable!(),
            };
            let mut m = random_blocks(rng, ty, rows * row / ty.block_bytes(), scales);
            if ty == GgmlType::MXFP4 {
                for b in m.chunks_exact_mut(ty.block_bytes()) {
                    b[0] = 120 + (rng.next_u64() % 16) as u8;
                }
            }
            m
        }
    }
}

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

/// A file-like image: 96 bytes of header, then the matrix (at a 32-byte aligned offset).
fn image(ty: GgmlType, rows: usize, n_in: usize, rng: &mut Rng) -> (Vec<u8>, Mat) {
    image_at(ty, rows, n_in, 96, rng)
}

/// [`image`] with the matrix at offset `start`.
fn image_at(ty: GgmlType, rows: usize, n_in: usize, start: usize, rng: &mut Rng) -> (Vec<u8>, Mat) {
    let data = random_matrix(ty, rows, n_in, rng);
    let mut raw = vec![0xa5u8; start];
    raw.extend_from_slice(&data);
    let row_bytes = ty.row_bytes(n_in as u64).unwrap() as usize;
    (raw, Mat { ty, n_in, n_out: rows, start, row_bytes })
}

/// `DS4_CUDA_SOURCES`: the shaders read from a folder are the embedded ones when the folder
/// is the repository's, under a line naming each file; a folder that lacks a file is an
/// error that names it.
#[test]
fn sources_from_a_folder() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders/cuda");
    let read = context::compile_source(Some(&dir)).unwrap();
    let strip = |s: &str| s.lines().filter(|l| !l.starts_with("// ---- ")).collect::<Vec<_>>().join("\n");
    assert_eq!(strip(&read), strip(&kernel_source()));
    let named = format!("// ---- {}/", dir.display());
    assert_eq!(read.lines().filter(|l| l.starts_with(&named)).count(), context::SOURCES.len());
    let tmp = std::env::temp_dir().join(format!("ds4-sources-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("common.cuh"), "// nothing\n").unwrap();
    let err = context::compile_source(Some(&tmp)).unwrap_err().to_string();
    std::fs::remove_dir_all(&tmp).unwrap();
    assert!(err.contains("DS4_CUDA_SOURCES") && err.contains("float.cu"), "{err}");
}

/// Whether NVRTC is here for the compile-only tests; without it they print why and skip, except
/// where CI sets DS4_REQUIRE_NVRTC: there a missing NVRTC is a failure, not a skip.
fn nvrtc_or_skip() -> bool {
    if nvrtc_available() {
        return true;
    }
    assert!(std::env::var_os("DS4_REQUIRE_NVRTC").is_none(), "DS4_REQUIRE_NVRTC is set but libnvrtc was not found");
    eprintln!("skipped: libnvrtc not found (set DS4_CUDA_LIB to a CUDA or pip nvidia-cuda-nvrtc lib dir)");
    false
}

#[test]
fn kernels_compile_with_nvrtc() {
    if !nvrtc_or_skip() {
        return;
    }
    // compute_75: the Q8_0 kernel's path for devices without the integer mma of sm_80.
    for arch in ["compute_75", "compute_80", "compute_90"] {
        match compile(arch) {
            Ok(ptx) => {
                for stem in context::FORMATS.iter().map(|f| f.1).chain(["q8_0_mq"]) {
                    for nb in context::BATCH_SIZES {
                        let name = format!("ds4_mv_{stem}_{nb}");
                        assert!(ptx.contains(&format!(".entry {name}(")), "{arch}: no kernel {name} in the PTX");
                    }
                }
                assert!(ptx.contains(".entry ds4_argmax_rows("), "{arch}: no kernel ds4_argmax_rows in the PTX");
                eprintln!("{arch}: {} bytes of PTX", ptx.len());
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// The variant of ds4_hc_site that exchanges the cluster's sums with st.async and mbarriers
/// (`DS4_CUDA_DEFINES=HC_SITE_ASYNC=1`, decode_ops.cu) compiles for sm_90, and the default
/// program has none of it.
#[test]
fn hc_site_async_variant_compiles() {
    if !nvrtc_or_skip() {
        return;
    }
    let (ptx, plain) = variant_and_plain("HC_SITE_ASYNC=1");
    assert!(ptx.contains(".entry ds4_hc_site("), "no ds4_hc_site in the PTX");
    assert!(ptx.contains("st.async.shared::cluster.mbarrier::complete_tx::bytes"), "no st.async in the variant");
    assert!(!plain.contains("st.async"), "the default program pushes with st.async");
}

/// The program for compute_90 built with `-D define`, and without it.
fn variant_and_plain(define: &str) -> (std::sync::Arc<String>, std::sync::Arc<String>) {
    let variant = context::compile_with("compute_90", &[define]).unwrap_or_else(|e| panic!("{e}"));
    let plain = context::compile_with("compute_90", &[]).unwrap_or_else(|e| panic!("{e}"));
    (variant, plain)
}

/// The PTX of kernel `name` in `ptx`: from its `.entry` to the next.
fn ptx_entry<'p>(ptx: &'p str, name: &str) -> &'p str {
    let at = ptx.find(&format!(".entry {name}(")).unwrap_or_else(|| panic!("no {name} in the PTX"));
    let rest = &ptx[at + 1..];
    &ptx[at..at + 1 + rest.find(".entry ").unwrap_or(rest.len())]
}

/// The routed tensor-core kernels' int32-to-float conversions through 1.5 * 2^23, the mma's
/// accumulator starting at it (`DS4_CUDA_DEFINES=GX_I2F_MAGIC=1`, gemm_experts.cu): the variant
/// compiles and converts no sum with cvt in those kernels; the default program converts them
/// all with cvt.
#[test]
fn gx_i2f_magic_variant_compiles() {
    if !nvrtc_or_skip() {
        return;
    }
    let (magic, plain) = variant_and_plain("GX_I2F_MAGIC=1");
    for name in ["ds4_moe_mma_iq2_xxs", "ds4_moe_mma_q2_k"] {
        let (m, p) = (ptx_entry(&magic, name), ptx_entry(&plain, name));
        assert!(m.contains("1262485504") && !m.contains("cvt.rn.f32.s32"), "{name}: the variant still converts");
        assert!(p.contains("cvt.rn.f32.s32") && !p.contains("1262485504"), "{name}: the default adds the magic");
    }
}

/// NVRTC behind the PTX disk cache (ptx_cache.rs): a first compile keeps its PTX in the folder;
/// a second of the same program and options takes that file's PTX (a copy altered on disk
/// proves it is read, not compiled again); other options compile anew, to a file of their own.
#[test]
fn nvrtc_ptx_goes_through_the_disk_cache() {
    if !nvrtc_or_skip() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ds4-nvrtc-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let src = "extern \"C\" __global__ void ds4_probe(float* x) { x[0] = 1.0f; }".to_string();
    let opts = vec!["--gpu-architecture=compute_80".to_string()];
    let files = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default()
    };
    let first = context::nvrtc_ptx(src.clone(), opts.clone(), "compute_80", Some(&dir)).unwrap();
    assert!(first.contains(".entry ds4_probe"), "{first}");
    let kept = files();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let text = std::fs::read_to_string(&kept[0]).unwrap();
    assert!(text.ends_with(&first));
    std::fs::write(&kept[0], text.replace(".entry ds4_probe", ".entry ds4_probx")).unwrap();
    let second = context::nvrtc_ptx(src.clone(), opts.clone(), "compute_80", Some(&dir)).unwrap();
    assert_eq!(second, first.replace(".entry ds4_probe", ".entry ds4_probx"));
    let mut other = opts.clone();
    other.push("-DDS4_PROBE=1".into());
    let third = context::nvrtc_ptx(src.clone(), other, "compute_80", Some(&dir)).unwrap();
    assert!(third.contains(".entry ds4_probe"), "{third}");
    assert_eq!(files().len(), 2);
    // Without a folder: compiled, nothing kept.
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(context::nvrtc_ptx(src, opts, "compute_80", None).unwrap(), first);
    assert!(files().is_empty());
}

#[test]
fn no_device_is_an_error_not_a_panic() {
    // On a machine without a GPU this must be BackendUnavailable; with one, a backend.
    match CudaBackend::new(0) {
        Ok(b) => {
            eprintln!("device 0: {} (sm_{}{})", b.device_name(), b.compute_capability().0, b.compute_capability().1)
        }
        Err(Error::BackendUnavailable(m)) => eprintln!("unavailable, as expected without a GPU: {m}"),
        Err(e) => panic!("wrong error kind: {e:?}"),
    }
    // A device ordinal that does not exist is never a panic.
    assert!(CudaBackend::new(4096).is_err());
}

/// `|gpu - cpu| <= 1e-4 * sum |w * x|` for every output, and row invariance.
fn check_format(b: &CudaBackend, ty: GgmlType, n_out: usize, n_in: usize, rng: &mut Rng) {
    check_format_at(b, ty, n_out, n_in, 96, rng)
}

/// [`check_format`] with the matrix at image offset `start`.
fn check_format_at(b: &CudaBackend, ty: GgmlType, n_out: usize, n_in: usize, start: usize, rng: &mut Rng) {
    let (raw, w) = image_at(ty, n_out, n_in, start, rng);
    b.upload_image(&raw, 32, &[w], |_, _| {}).unwrap();
    let mut deq = vec![0f32; n_out * n_in];
    quant::dequantize(ty, &raw[w.start..w.start + w.nbytes()], &mut deq).unwrap();
    let x: Vec<f32> = (0..17 * n_in).map(|_| rng.f32()).collect();
    // Each row alone: the reference of the invariance check.
    let alone: Vec<Vec<f32>> = (0..17).map(|r| b.matmul(&raw, &w, &x[r * n_in..(r + 1) * n_in]).unwrap()).collect();
    for n in 1..=17 {
        let xs = &x[..n * n_in];
        let gpu = b.matmul(&raw, &w, xs).unwrap();
        let cpu = cpu::matmul_many_new(&raw, &[(&w, xs)]).unwrap().pop().unwrap();
        for r in 0..n {
            for o in 0..n_out {
                let (g, c) = (gpu[r * n_out + o], cpu[r * n_out + o]);
                let mag: f64 = (0..n_in).map(|k| (deq[o * n_in + k] as f64 * x[r * n_in + k] as f64).abs()).sum();
                assert!(
                    ((g - c) as f64).abs() <= 1e-4 * mag + 1e-30,
                    "{ty} {n_out}x{n_in} n={n} row {r} out {o}: gpu {g} cpu {c} (sum |wx| {mag})"
                );
                assert_eq!(
                    g.to_bits(),
                    alone[r][o].to_bits(),
                    "{ty} n={n}: row {r} out {o} differs from the row alone"
                );
            }
        }
    }
    b.release(&raw).unwrap();
}

#[test]
fn every_format_matches_cpu_and_is_row_invariant() {
    let Some(b) = backend() else { return };
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for ty in FORMATS {
        // One tile or less, several tiles with a partial last one, and output rows that do
        // not fill the last thread block.
        for (n_out, n_in) in [(37, 256), (64, 4096 + 512), (5, 1024)] {
            check_format(&b, ty, n_out, n_in, &mut rng);
        }
        if ty == GgmlType::Q8_0 {
            // Rows long enough for the tensor-core kernel by default (o_b's class, 8192 and
            // more: `Q8_MMA_MIN_IN`), an odd block count, a partial last tile.
            check_format(&b, ty, 40, 8192 + 96, &mut rng);
        }
        eprintln!("{ty}: ok");
    }
}

#[test]
fn unaligned_rows_and_odd_float_shapes() {
    let Some(b) = backend() else { return };
    let mut rng = Rng(7);
    // Q8_0 rows of 34 * 3 bytes: not 16-byte aligned, read in 2-byte pieces; an odd block
    // count. 9 rows: all row by row; 40 rows: two 16-row tiles first, and at offset 98 the
    // tiles are not 16-byte aligned either.
    check_format(&b, GgmlType::Q8_0, 9, 96, &mut rng);
    check_format(&b, GgmlType::Q8_0, 40, 96, &mut rng);
    check_format_at(&b, GgmlType::Q8_0, 40, 96, 98, &mut rng);
    // MXFP4 rows of 17 bytes.
    check_format(&b, GgmlType::MXFP4, 9, 32, &mut rng);
    // F16 rows of 6 elements (12 bytes).
    check_format(&b, GgmlType::F16, 9, 12, &mut rng);
    // F32 with n_in % 4 != 0: the CPU fallback, same values.
    let (raw, w) = image(GgmlType::F32, 3, 7, &mut rng);
    b.upload_image(&raw, 32, &[w], |_, _| {}).unwrap();
    let x: Vec<f32> = (0..14).map(|_| rng.f32()).collect();
    let gpu = b.matmul(&raw, &w, &x).unwrap();
    assert_eq!(gpu, cpu::matmul_new(&raw, &w, &x).unwrap());
}

#[test]
fn many_products_in_one_call_and_the_cpu_fallback() {
    let Some(b) = backend() else { return };
    let mut rng = Rng(99);
    let (raw, w1) = image(GgmlType::Q8_0, 64, 512, &mut rng);
    let mut raw = raw;
    // A second matrix in the same image, Q4_K.
    let start2 = raw.len().next_multiple_of(32);
    raw.resize(start2, 0);
    raw.extend_from_slice(&random_matrix(GgmlType::Q4_K, 48, 512, &mut rng));
    let w2 = Mat { ty: GgmlType::Q4_K, n_in: 512, n_out: 48, start: start2, row_bytes: 288 };
    let x1: Vec<f32> = (0..3 * 512).map(|_| rng.f32()).collect();
    let x2: Vec<f32> = (0..20 * 512).map(|_| rng.f32()).collect();
    let specs: Vec<(&Mat, &[f32])> = vec![(&w1, &x1), (&w2, &x2), (&w1, &x1[..512])];
    // Not uploaded: exactly the CPU reference.
    assert_eq!(b.matmul_many(&raw, &specs).unwrap(), cpu::matmul_many_new(&raw, &specs).unwrap());
    b.upload_image(&raw, 32, &[w1, w2], |_, _| {}).unwrap();
    assert!(b.is_uploaded(&raw));
    let many = b.matmul_many(&raw, &specs).unwrap();
    for (i, &(w, x)) in specs.iter().enumerate() {
        assert_eq!(many[i], b.matmul(&raw, w, x).unwrap(), "product {i}");
    }
    // Row 0 of the 3-row product equals the 1-row product.
    assert_eq!(many[0][..64], many[2][..]);
    b.release(&raw).unwrap();
    assert!(!b.is_uploaded(&raw));
}

#[test]
fn upload_reports_progress() {
    let Some(b) = backend() else { return };
    let raw = vec![1u8; (64 << 20) + 1000];
    let mut steps = Vec::new();
    b.upload_image(&raw, 64, &[], |d, t| steps.push((d, t))).unwrap();
    let total = (raw.len() - 64) as u64;
    assert_eq!(steps.first(), Some(&(0, total)));
    assert_eq!(steps.last(), Some(&(total, total)));
    assert_eq!(steps.len(), 3);
    b.release(&raw).unwrap();
}

#[test]
fn split_formats_run_on_listed_tensors_only() {
    let Some(b) = backend() else { return };
    let mut rng = Rng(31);
    for ty in [GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::IQ2_XXS] {
        let (raw, w) = image(ty, 24, 4096, &mut rng);
        let x: Vec<f32> = (0..3 * 4096).map(|_| rng.f32()).collect();
        // Rows 16..24 of the tensor: a row offset inside a split tensor (for Q8_0, its rows
        // after the one whole 16-row tile).
        let part = Mat { n_out: 8, start: w.start + 16 * w.row_bytes, ..w };
        b.upload_image(&raw, 32, &[w], |_, _| {}).unwrap();
        let whole = b.matmul(&raw, &w, &x).unwrap();
        let rows = b.matmul(&raw, &part, &x).unwrap();
        for r in 0..3 {
            assert_eq!(rows[r * 8..(r + 1) * 8], whole[r * 24 + 16..r * 24 + 24], "{ty}: rows 16..24, batch row {r}");
        }
        if context::tensor_cores(ty, w.n_in, w.n_out) {
            // Rows 8..16 start inside a tile: the kernel cannot take them, the CPU does.
            let inside = Mat { n_out: 8, start: w.start + 8 * w.row_bytes, ..w };
            assert_eq!(b.matmul(&raw, &inside, &x).unwrap(), cpu::matmul_new(&raw, &inside, &x).unwrap());
        }
        b.release(&raw).unwrap();
        // Not listed at upload: stored as it is, so products on it run on the CPU.
        b.upload_image(&raw, 32, &[], |_, _| {}).unwrap();
        assert_eq!(b.matmul(&raw, &w, &x).unwrap(), cpu::matmul_new(&raw, &w, &x).unwrap(), "{ty}: unlisted");
        b.release(&raw).unwrap();
    }
}

/// A launch of same-shape products splits each as one matrix of all their rows would be split
/// (`split_in_launch`): Flash's o_a groups, 8 x 1024 rows, take one warp a row group and no
/// input slices (on the tensor cores: 2 input slices where one group alone takes 8); alone, a
/// product's split is its own.
#[test]
fn launch_of_several_products_splits_as_one_matrix() {
    let oa = Mat { ty: GgmlType::Q8_0, n_in: 4096, n_out: 1024, start: 0, row_bytes: 4352 };
    let plane = Mat { n_out: 8 * 1024, ..oa };
    if context::tensor_cores(GgmlType::Q8_0, oa.n_in, oa.n_out) {
        assert_eq!((group(&oa), slices(&oa)), (4, 8));
    } else {
        assert_eq!((group(&oa), slices(&oa)), (4, 1));
    }
    // The launch runs the plane's kernel, whichever the groups alone would take.
    let want = if context::tensor_cores(GgmlType::Q8_0, plane.n_in, plane.n_out) { (4, 2) } else { (1, 1) };
    assert_eq!(split_in_launch(&oa, 8 * 1024), want);
    assert_eq!(split_in_launch(&oa, 1024), (group(&oa), slices(&oa)));
    let hc = Mat { ty: GgmlType::F16, n_in: 16384, n_out: 24, start: 0, row_bytes: 32768 };
    assert_eq!(split_in_launch(&hc, 24), (group(&hc), slices(&hc)));
    assert!(slices(&hc) > 1);
}

/// Products whose outputs go to some columns of wider rows (`Desc::y_stride`, as the decode's
/// o_a groups write their ranks side by side): each group's columns equal its own product
/// bitwise, and the columns no product owns are left alone. Split (several input slices) and
/// unsplit shapes, 1..3 batch rows.
#[test]
fn strided_outputs_fill_columns_of_wider_rows() {
    let Some(b) = backend() else { return };
    let mut rng = Rng(0x57);
    // (Q8_0 ranks are whole 16-row tiles: a group starts a tile.)
    for (ty, rank, n_in) in [(GgmlType::Q8_0, 48, 4096 + 512), (GgmlType::F16, 300, 256), (GgmlType::Q8_0, 144, 1024)] {
        let groups = 3;
        let (raw, all) = image(ty, groups * rank, n_in, &mut rng);
        b.upload_image(&raw, 32, &[all], |_, _| {}).unwrap();
        let mats: Vec<Mat> =
            (0..groups).map(|g| Mat { n_out: rank, start: all.start + g * rank * all.row_bytes, ..all }).collect();
        let stride = groups * rank + 5;
        for n in 1..=3 {
            let xs: Vec<Vec<f32>> = (0..groups).map(|_| (0..n * n_in).map(|_| rng.f32()).collect()).collect();
            let want: Vec<Vec<f32>> = (0..groups).map(|g| b.matmul(&raw, &mats[g], &xs[g]).unwrap()).collect();
            let sentinel = -12345.5f32;
            let got: Vec<f32> = {
                let g = b.lock();
                g.ctx.bind().unwrap();
                let img = g.images.iter().find(|i| i.is(&raw)).unwrap();
                let xb: Vec<DevBuf> = xs.iter().map(|x| DevBuf::from_slice(x).unwrap()).collect();
                let y = DevBuf::from_slice(&vec![sentinel; n * stride]).unwrap();
                let part = DevBuf::zeroed(4 * groups * 32 * n * rank).unwrap();
                let counters = DevBuf::zeroed(4 * 4096).unwrap();
                let (mut table, mut blocks, mut part_off, mut counter) = (Vec::new(), 0, 0, 0);
                for (gi, m) in mats.iter().enumerate() {
                    let (mut d, nb) = CudaBackend::desc(
                        img.addr(m.start),
                        m,
                        &img.kernel_mat(m),
                        xb[gi].at(0),
                        y.at(4 * gi * rank),
                        part.at(4 * part_off),
                        n,
                        counter,
                    );
                    d.block_start = blocks as i32;
                    d.y_stride = stride as i32;
                    assert!(slices(m) <= 32);
                    if slices(m) > 1 {
                        part_off += slices(m) * n * rank;
                        counter += row_blocks(m);
                    }
                    blocks += nb;
                    table.push(d);
                }
                let tb = DevBuf::from_slice(&table).unwrap();
                let (f, smem) = g.ctx.kernel(ty, n_in, rank, n).unwrap();
                let args = [Arg::Ptr(tb.at(0)), Arg::I32(groups as i32), Arg::Ptr(counters.at(0)), Arg::I32(0)];
                g.ctx.launch_args(f, (blocks as u32, 1, 1), THREADS, smem, &args).unwrap();
                g.ctx.sync().unwrap();
                y.read(0, n * stride).unwrap()
            };
            for r in 0..n {
                for (gi, w) in want.iter().enumerate() {
                    let at = r * stride + gi * rank;
                    assert_eq!(
                        got[at..at + rank],
                        w[r * rank..(r + 1) * rank],
                        "{ty} rank {rank} n={n}: row {r} group {gi}"
                    );
                }
                assert!(
                    got[r * stride + groups * rank..(r + 1) * stride].iter().all(|&v| v == sentinel),
                    "{ty}: gap of row {r}"
                );
            }
        }
        b.release(&raw).unwrap();
    }
}

/// The products of `w` (uploaded in `img`) with the `n` rows of `x` by kernel `f`, one
/// descriptor, as the host lays it out. The context must be bound.
fn run_kernel(g: &Inner, img: &DeviceImage, w: &Mat, f: sys::CUfunction, smem: u32, x: &[f32], n: usize) -> Vec<f32> {
    let xb = DevBuf::from_slice(x).unwrap();
    let y = DevBuf::zeroed(4 * n * w.n_out).unwrap();
    let part = DevBuf::zeroed(4 * 32 * n * w.n_out).unwrap();
    let counters = DevBuf::zeroed(4 * 4096).unwrap();
    let (d, blocks) = CudaBackend::desc(img.addr(w.start), w, w, xb.at(0), y.at(0), part.at(0), n, 0);
    let tb = DevBuf::from_slice(&[d]).unwrap();
    let args = [Arg::Ptr(tb.at(0)), Arg::I32(1), Arg::Ptr(counters.at(0)), Arg::I32(0)];
    g.ctx.launch_args(f, (blocks as u32, 1, 1), THREADS, smem, &args).unwrap();
    g.ctx.sync().unwrap();
    y.read(0, n * w.n_out).unwrap()
}

/// PTX `ptx` loaded as a module of its own (the context bound); the caller unloads it.
fn load_module(ptx: &str) -> sys::CUmodule {
    let image = std::ffi::CString::new(ptx.as_bytes()).unwrap();
    // SAFETY: a NUL-terminated PTX image; the context is bound.
    unsafe { cu::module::load_data(image.as_ptr().cast()) }.unwrap()
}

/// Product kernel `ds4_mv_{stem}_{nb}` of a module from [`load_module`].
fn module_kernel(module: sys::CUmodule, stem: &str, nb: usize) -> sys::CUfunction {
    let name = std::ffi::CString::new(format!("ds4_mv_{stem}_{nb}")).unwrap();
    // SAFETY: the module is loaded and the context bound.
    unsafe { cu::module::get_function(module, name) }.unwrap()
}

/// The Q8_0 kernel built for compute_75 gives this device's bits: the module compiled for
/// compute_75 runs here too (the driver compiles its PTX for it). On the tensor cores
/// (`DS4_CUDA_Q8=mma`) that is the path for devices before sm_80 (the same integer products
/// from shuffled fragments and dp4a). Rows that are 16-byte aligned and rows that are not (an
/// odd block count), 1, 3 and 16 batch rows.
#[test]
fn q8_0_portable_path_gives_the_same_bits() {
    let Some(b) = backend() else { return };
    let mut rng = Rng(0x75);
    let ptx = compile("compute_75").unwrap();
    for n_in in [1024, 1120] {
        let (raw, w) = image(GgmlType::Q8_0, 70, n_in, &mut rng);
        b.upload_image(&raw, 32, &[w], |_, _| {}).unwrap();
        {
            let g = b.lock();
            g.ctx.bind().unwrap();
            let img = g.images.iter().find(|i| i.is(&raw)).unwrap();
            let module = load_module(&ptx);
            for n in [1, 3, 16] {
                let x: Vec<f32> = (0..n * n_in).map(|_| rng.f32()).collect();
                let (native, smem) = g.ctx.kernel(GgmlType::Q8_0, n_in, w.n_out, n).unwrap();
                let nb = context::BATCH_SIZES.iter().copied().find(|&s| s >= n).unwrap();
                let stem = context::stem(GgmlType::Q8_0, n_in, w.n_out).unwrap();
                let portable = module_kernel(module, stem, nb);
                let want = run_kernel(&g, img, &w, native, smem, &x, n);
                let got = run_kernel(&g, img, &w, portable, smem, &x, n);
                assert!(
                    want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "n_in {n_in}, n = {n}: the compute_75 kernel differs"
                );
                assert!(want.iter().any(|&v| v != 0.0));
            }
            // SAFETY: loaded above; nothing of it is used after this.
            unsafe { cu::module::unload(module) }.unwrap();
        }
        b.release(&raw).unwrap();
    }
}

/// Staging one batch row's x in shared memory (q8_0.cu MQ_X_STAGED) changes who quantizes it,
/// not its integers or the order of any sum: the tensor-core kernel staging every slice that
/// fits gives the bits of the one that never stages, on whole tiles, a plane's last rows
/// (70 rows) and an odd block count (1120 elements).
#[test]
fn q8_0_staged_x_gives_the_same_bits() {
    let Some(b) = backend() else { return };
    let mut rng = Rng(0x57a6);
    let cc = b.lock().ctx.compute_capability;
    let arch = format!("compute_{}{}", cc.0, cc.1);
    let always = context::compile_with(&arch, &["MQ_XS_MIN_CHUNKS=0"]).unwrap();
    let never = context::compile_with(&arch, &["MQ_X_STAGED=0"]).unwrap();
    for n_in in [1024, 1120] {
        if !context::tensor_cores(GgmlType::Q8_0, n_in, 70) {
            eprintln!("skipped: rows of {n_in} are not on the tensor cores in this process");
            continue;
        }
        let (raw, w) = image(GgmlType::Q8_0, 70, n_in, &mut rng);
        b.upload_image(&raw, 32, &[w], |_, _| {}).unwrap();
        {
            let g = b.lock();
            g.ctx.bind().unwrap();
            let img = g.images.iter().find(|i| i.is(&raw)).unwrap();
            let x: Vec<f32> = (0..n_in).map(|_| rng.f32()).collect();
            let (m1, m2) = (load_module(&always), load_module(&never));
            let (staged, plain) = (module_kernel(m1, "q8_0_mq", 1), module_kernel(m2, "q8_0_mq", 1));
            // The one-row kernel's shared memory, as this process's program declares it.
            let smem = g.ctx.kernel(GgmlType::Q8_0, n_in, w.n_out, 1).unwrap().1;
            assert!(smem > 0, "the one-row tensor-core kernel declares no shared memory for its x");
            let want = run_kernel(&g, img, &w, plain, smem, &x, 1);
            let got = run_kernel(&g, img, &w, staged, smem, &x, 1);
            assert!(want.iter().any(|&v| v != 0.0));
            for (o, (a, b)) in want.iter().zip(&got).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "n_in {n_in}, row {o}: staged {b}, not staged {a}");
            }
            // SAFETY: loaded above; nothing of them is used after this.
            unsafe { cu::module::unload(m1) }.unwrap();
            unsafe { cu::module::unload(m2) }.unwrap();
        }
        b.release(&raw).unwrap();
    }
}

/// A plane of many rows (Flash's o_a and LM head) takes the tensor-core kernel by default at
/// any row length, and matches the CPU; a product on some of its rows (o_a's groups) takes the
/// plane's kernel and split even where its own shape would take the other kernel (which cannot
/// read the plane's layout), so its rows are the plane's product's bit for bit.
#[test]
fn q8_0_plane_of_many_rows_and_its_slices() {
    let Some(b) = backend() else { return };
    let mut rng = Rng(0x4ead);
    // Rows of 2048 elements: by default the plane is on the tensor cores by its row count, and
    // 1024 of its rows alone would not be.
    let (rows, n_in) = (context::Q8_MMA_MIN_ROWS, 2048);
    check_format(&b, GgmlType::Q8_0, rows, n_in, &mut rng);
    let (raw, w) = image(GgmlType::Q8_0, rows, n_in, &mut rng);
    b.upload_image(&raw, 32, &[w], |_, _| {}).unwrap();
    let x: Vec<f32> = (0..3 * n_in).map(|_| rng.f32()).collect();
    let whole = b.matmul(&raw, &w, &x).unwrap();
    // Rows 1024..2048 (o_a's second group): a tile-aligned range in the middle of the plane.
    let part = Mat { n_out: 1024, start: w.start + 1024 * w.row_bytes, ..w };
    {
        let g = b.lock();
        let img = g.images.iter().find(|i| i.is(&raw)).unwrap();
        assert!(img.holds_split(&part));
        assert_eq!(img.kernel_mat(&part), Mat { n_out: rows, ..part });
    }
    let got = b.matmul(&raw, &part, &x).unwrap();
    for r in 0..3 {
        let same = (0..1024).all(|o| got[r * 1024 + o].to_bits() == whole[r * rows + 1024 + o].to_bits());
        assert!(same, "batch row {r}: rows 1024..2048 alone differ from the plane's");
    }
    b.release(&raw).unwrap();
}

/// Which Q8_0 kernel takes a matrix is one decision, a function of its shape alone (row
/// invariance; a product on a slice of a plane takes the plane's, `DeviceImage::kernel_mat`):
/// the kernel stem, tile, rows a warp and batch chunk all follow `tensor_cores`, the rows it
/// takes are those up to a bound, from another bound on, and matrices of many rows, and no
/// other format is affected. Host-side: no GPU needed.
#[test]
fn q8_0_kernel_choice_is_one_rule_of_the_shape() {
    for rows in [1, 24, 1024, 8192, 65535, 65536, 129280] {
        // Along the row length the choice changes at most twice: on, off, on again.
        let mut changes = 0;
        let mut last = true;
        for n_in in (32..=16384).step_by(32) {
            let mma = context::tensor_cores(GgmlType::Q8_0, n_in, rows);
            changes += usize::from(mma != last);
            assert!(changes <= 2, "the tensor cores leave rows of {n_in} twice ({rows} rows)");
            last = mma;
            if mma {
                // More rows never leave the tensor cores.
                assert!(context::tensor_cores(GgmlType::Q8_0, n_in, 2 * rows));
            }
            assert_eq!(context::stem(GgmlType::Q8_0, n_in, rows), Some(if mma { "q8_0_mq" } else { "q8_0" }));
            assert_eq!(context::tile_elems(GgmlType::Q8_0, n_in, rows), if mma { 64 } else { 512 });
            let want_rows = if mma { context::MQ_WARP_ROWS } else { context::MV_ROWS };
            assert_eq!(warp_rows(GgmlType::Q8_0, n_in, rows), want_rows);
            assert_eq!(chunk_rows(GgmlType::Q8_0, n_in, rows), if mma { MAX_BATCH } else { MAX_BATCH / 2 });
            for (ty, _) in context::FORMATS.iter().filter(|f| f.0 != GgmlType::Q8_0) {
                assert!(!context::tensor_cores(*ty, n_in, rows));
            }
        }
    }
    // Unless the process chose otherwise, Flash's q_b (32768 x 1024), o_b (4096 x 8192), o_a
    // (8192 x 4096) and head (129280 x 4096) are on the tensor cores, and its q_a (1024 x 4096),
    // kv (512 x 4096) and shared expert (2048 x 4096, 4096 x 2048) are not.
    let set = |v: &str| std::env::var_os(v).is_some();
    let vars = [
        "DS4_CUDA_Q8",
        "DS4_CUDA_Q8_MMA_MAX_IN",
        "DS4_CUDA_Q8_MMA_MIN_IN",
        "DS4_CUDA_Q8_MMA_MIN_ROWS",
        "DS4_CUDA_Q8_MMA_SHAPES",
    ];
    if !vars.iter().any(|v| set(v)) {
        let flash = [
            (1024, 32768, true),
            (8192, 4096, true),
            (4096, 129280, true),
            (4096, 8192, true),
            (4096, 512, false),
            (4096, 1024, false),
            (4096, 2048, false),
            (2048, 4096, false),
        ];
        for (n_in, rows, mma) in flash {
            assert_eq!(context::tensor_cores(GgmlType::Q8_0, n_in, rows), mma, "{rows} x {n_in}");
        }
    }
}

/// The prefill products' timing (benches/cuda.rs `prefill/`) runs F16 and float-x Q8_0 of at
/// most one descriptor's 64 rows, and is an error, not a panic, for anything else.
#[test]
fn prefill_timing_takes_its_products_only() {
    let Some(b) = backend() else { return };
    if b.compute_capability().0 < 8 {
        eprintln!("skipped: no mma.sync m16n8k16 before sm_80");
        return;
    }
    let mut rng = Rng(0x0bad_cafe_1234_5678);
    for ty in [GgmlType::F16, GgmlType::Q2_K] {
        let (raw, w) = image(ty, 64, 4096, &mut rng);
        b.upload_image(&raw, 32, &[w], |_, _| {}).unwrap();
        if ty == GgmlType::F16 {
            assert!(b.time_prefill_launches(&raw, &[w, w], 16, 4).unwrap() > 0.0);
            assert!(b.time_prefill_launches(&raw, &[w], 64, 1).unwrap() > 0.0);
            assert!(b.time_prefill_launches(&raw, &[w], 65, 1).is_err());
        } else {
            assert!(b.time_prefill_launches(&raw, &[w], 1, 1).is_err());
        }
        b.release(&raw).unwrap();
    }
}
