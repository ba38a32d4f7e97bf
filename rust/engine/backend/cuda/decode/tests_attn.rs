//! Tests of the kernels of `shaders/cuda/decode_attn.cu` (raw window ring, compressors,
//! lightning-indexer scores and top-k, attention with sinks): each against the CPU reference
//! objects of the crate (`state::LayerState` and `CompressorState`, `model::indexer::select`,
//! `model::attention::attend` with `Rope::apply_heads`) on random inputs, and for row
//! invariance (a row of a batch is bitwise the row computed alone, at its position). Without a
//! GPU each test prints "skipped" and passes.

use half::f16;

use super::program::attention_blocks;
use super::testutil::{assert_bits, assert_close, context, context_from, randn, read, step, Arg, DevBuf};
use crate::backend::cpu::dot_f32;
use crate::backend::cuda::context::Context;
use crate::model::attention::{attend, raw_range, visible_compressed};
use crate::model::config::Yarn;
use crate::model::forward::compress_step;
use crate::model::indexer;
use crate::model::rope::Rope;
use crate::state::{CompressorState, KvPrecision, LayerState, RowStore};

const EPS: f32 = 1e-6;
const ROPE_DIM: usize = 64;
const WINDOW: usize = 128;
const NULL: Arg = Arg::Ptr(0);

fn buf<T: Copy>(v: &[T]) -> DevBuf {
    DevBuf::from_slice(v).expect("device buffer")
}

fn zeroed(bytes: usize) -> DevBuf {
    DevBuf::zeroed(bytes).expect("device buffer")
}

fn ptr(b: &DevBuf) -> Arg {
    Arg::Ptr(b.ptr)
}

fn int(v: usize) -> Arg {
    Arg::I32(i32::try_from(v).expect("an int parameter"))
}

fn launch(ctx: &Context, name: &str, grid: (usize, usize), block: u32, smem: usize, args: &[Arg]) {
    ctx.launch_named(name, (grid.0 as u32, grid.1 as u32, 1), block, smem as u32, args)
        .unwrap_or_else(|e| panic!("launching {name}: {e}"));
}

/// For f16-rounded outputs: every value is a half, and within `tol` (as [`assert_close`]) plus
/// one half step of the reference: the values before the rounding agree to `tol`, and the
/// rounding may then go to the neighbouring half.
#[track_caller]
fn assert_close_f16(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        assert!(f16::from_f32(a).to_f32().to_bits() == a.to_bits(), "{what}[{i}]: {a} is not a half");
        let step = (b.abs().max(6.2e-5) * (1.0 / 1024.0)) * 1.01;
        let ok = (a - b).abs() <= step + tol * b.abs().max(1.0);
        assert!(ok, "{what}[{i}]: got {a}, want {b} (more than {tol} and one half step)");
    }
}

fn rope(yarn: bool) -> Rope {
    if yarn {
        let y = Yarn { factor: 16.0, original_context: 65536, beta_fast: 32.0, beta_slow: 1.0 };
        Rope::yarn(160000.0, ROPE_DIM, &y)
    } else {
        Rope::plain(10000.0, ROPE_DIM)
    }
}

/// Batch sizes of successive launches: full batches and ragged ones.
const CHUNKS: [usize; 10] = [16, 3, 1, 16, 7, 16, 5, 16, 2, 11];

/// Launch sizes for the prompt's-step form of the compressor (ds4_compress_windows and
/// ds4_compress_state), up to [`BACKUP_AREAS`] rows.
const SPLIT_CHUNKS: [usize; 6] = [40, 3, 64, 1, 17, 9];

/// Rows of a launch whose backup areas the tests' compressors hold.
const BACKUP_AREAS: usize = 64;

// ---- 1. raw window ring

#[test]
fn ring_write_matches_layer_state() {
    let Some(ctx) = context() else { return };
    let hd = 512;
    let mut ls = LayerState::new(WINDOW, hd, None, None);
    let slots = ls.slots;
    let batch = zeroed(4 * slots * hd);
    let single = zeroed(4 * slots * hd);
    let mut pos = 0;
    // Past two turns of the ring, so that rows wrap around its end inside one launch.
    for (k, &n) in CHUNKS.iter().cycle().take(40).enumerate() {
        let kv = randn(n * hd, 100 + k as u64, 2.0);
        let kb = buf(&kv);
        let st = step(&ctx, pos, &vec![0; n]);
        launch(&ctx, "ds4_ring_write", (n, 1), 256, 0, &[ptr(&kb), ptr(&batch), int(slots), int(hd), ptr(&st)]);
        for r in 0..n {
            ls.push_raw(pos + r, &kv[r * hd..(r + 1) * hd]);
            let kr = buf(&kv[r * hd..(r + 1) * hd]);
            let sr = step(&ctx, pos + r, &[0]);
            launch(&ctx, "ds4_ring_write", (1, 1), 256, 0, &[ptr(&kr), ptr(&single), int(slots), int(hd), ptr(&sr)]);
            ctx.sync().expect("ring write");
        }
        pos += n;
        let got = read::<f32>(&ctx, &batch, slots * hd);
        assert_bits(&format!("ds4_ring_write: ring after positions ..{pos} (launch of {n})"), &got, &ls.ring);
        let one = read::<f32>(&ctx, &single, slots * hd);
        assert_bits(&format!("ds4_ring_write: ring after positions ..{pos}, rows alone vs batch"), &one, &got);
    }
}

// ---- 2. compressors

#[derive(Clone, Copy, Debug)]
struct CompCase {
    width: usize,
    ratio: usize,
    overlap: bool,
    /// First position (a multiple of the ratio: the compressor starts fresh there).
    pos0: usize,
    positions: usize,
    precision: KvPrecision,
    yarn: bool,
}

impl CompCase {
    fn pw(&self) -> usize {
        if self.overlap {
            2 * self.width
        } else {
            self.width
        }
    }

    fn round_mode(&self) -> usize {
        match self.precision {
            KvPrecision::F32 => 0,
            KvPrecision::F16 => 1,
            KvPrecision::Fp8 => unreachable!("FP8 storage does not run on the device"),
        }
    }

    /// Rows the device buffer holds: row w is emitted at position w * ratio + ratio - 1.
    fn cap(&self) -> usize {
        (self.pos0 + self.positions) / self.ratio + 1
    }
}

/// The device state of one compressor, initialized as `CompressorState::new`.
struct DevComp {
    cur_kv: DevBuf,
    cur_score: DevBuf,
    prev: Option<DevBuf>,
    backup: Option<DevBuf>,
    rows: DevBuf,
}

impl DevComp {
    fn new(c: &CompCase, cs: &CompressorState) -> Self {
        let prev: Vec<f32> = cs.prev_kv.iter().chain(&cs.prev_score).copied().collect();
        DevComp {
            cur_kv: buf(&cs.cur_kv),
            cur_score: buf(&cs.cur_score),
            prev: c.overlap.then(|| buf(&prev)),
            backup: c.overlap.then(|| zeroed(4 * BACKUP_AREAS * 2 * c.ratio * c.width)),
            rows: zeroed(4 * c.cap() * c.width),
        }
    }

    /// Every state buffer's values (backup excluded): cur_kv, cur_score, prev, rows.
    fn state(&self, ctx: &Context, c: &CompCase) -> Vec<(&'static str, Vec<f32>)> {
        let (r, w, pw) = (c.ratio, c.width, c.pw());
        let mut v =
            vec![("cur_kv", read(ctx, &self.cur_kv, r * pw)), ("cur_score", read(ctx, &self.cur_score, r * pw))];
        if let Some(p) = &self.prev {
            v.push(("prev", read(ctx, p, 2 * r * w)));
        }
        v.push(("rows", read(ctx, &self.rows, c.cap() * w)));
        v
    }
}

/// Runs positions `pos0..pos0 + positions` of case `c` through `ds4_compress` (with `split`,
/// `ds4_compress_windows` then `ds4_compress_state`) in launches of `chunks` rows (cycled) and
/// through the CPU reference; checks the state against the CPU's (copies bitwise, emitted rows
/// to rounding) and every backup area a launch wrote; returns the device state.
fn run_compress(ctx: &Context, c: &CompCase, chunks: &[usize], split: bool) -> Vec<(&'static str, Vec<f32>)> {
    let (w, ratio, pw) = (c.width, c.ratio, c.pw());
    let what = format!("ds4_compress {c:?}, launches of {chunks:?}, split {split}");
    let rope = rope(c.yarn);
    let seed = (w * 7 + ratio * 13 + c.pos0) as u64;
    let kv_all = randn(c.positions * pw, seed, 1.0);
    let gate_all = randn(c.positions * pw, seed + 1, 2.0);
    let ape = randn(ratio * pw, seed + 2, 1.0);
    let norm: Vec<f32> = randn(w, seed + 3, 0.5).iter().map(|v| v + 1.0).collect();
    let (apeb, normb, freqb) = (buf(&ape), buf(&norm), buf(rope.inv_freq()));

    let mut cs = CompressorState::new(w, ratio, c.overlap);
    let dev = DevComp::new(c, &cs);
    let mut done = 0;
    for &n in chunks.iter().cycle() {
        if done == c.positions {
            break;
        }
        let n = n.min(c.positions - done);
        let pos = c.pos0 + done;
        let kvb = buf(&kv_all[done * pw..(done + n) * pw]);
        let gb = buf(&gate_all[done * pw..(done + n) * pw]);
        let st = step(ctx, pos, &vec![0; n]);
        let args = [
            ptr(&kvb),
            ptr(&gb),
            ptr(&apeb),
            ptr(&normb),
            Arg::F32(EPS),
            ptr(&dev.cur_kv),
            ptr(&dev.cur_score),
            dev.prev.as_ref().map_or(NULL, ptr),
            dev.backup.as_ref().map_or(NULL, ptr),
            ptr(&dev.rows),
            int(w),
            int(ratio),
            int(c.overlap as usize),
            ptr(&freqb),
            int(ROPE_DIM),
            int(c.round_mode()),
            int(n),
            ptr(&st),
        ];
        if split {
            launch(ctx, "ds4_compress_windows", (n.div_ceil(ratio), 1), 256, 0, &args);
            let state = [
                ptr(&kvb),
                ptr(&gb),
                ptr(&apeb),
                ptr(&dev.cur_kv),
                ptr(&dev.cur_score),
                dev.prev.as_ref().map_or(NULL, ptr),
                int(w),
                int(ratio),
                int(c.overlap as usize),
                int(n),
                ptr(&st),
            ];
            launch(ctx, "ds4_compress_state", ((ratio * pw).div_ceil(256), 1), 256, 0, &state);
        } else {
            launch(ctx, "ds4_compress", (1, 1), 256, 0, &args);
        }
        for r in 0..n {
            let p = pos + r;
            let (i, j) = ((done + r) * pw, (done + r + 1) * pw);
            let closes = (p + 1).is_multiple_of(ratio);
            if closes && c.overlap {
                // The backup area of row r holds prev (prev_kv then prev_score) before the close.
                let want: Vec<f32> = cs.prev_kv.iter().chain(&cs.prev_score).copied().collect();
                let got = read(ctx, dev.backup.as_ref().expect("backup"), BACKUP_AREAS * 2 * ratio * w);
                let area = 2 * ratio * w;
                assert_bits(&format!("{what}: backup area {r} at position {p}"), &got[r * area..(r + 1) * area], &want);
            }
            // The host pass's push (the main compressor rounds with `round_kv`, the indexer's
            // with `round_index`: the same for F32 and F16).
            compress_step(&mut cs, p, &kv_all[i..j], &gate_all[i..j], &ape, &norm, 0, EPS, &rope, |row| {
                c.precision.round_kv(row, ROPE_DIM)
            });
        }
        ctx.sync().expect("compress");
        done += n;
    }

    let got = dev.state(ctx, c);
    for (name, v) in &got {
        let at = format!("{what}: {name} after position {}", c.pos0 + c.positions - 1);
        match *name {
            "cur_kv" => assert_bits(&at, v, &cs.cur_kv),
            "cur_score" => assert_bits(&at, v, &cs.cur_score),
            "prev" => {
                let want: Vec<f32> = cs.prev_kv.iter().chain(&cs.prev_score).copied().collect();
                assert_bits(&at, v, &want);
            }
            _ => {
                // The CPU's row i is the device's row pos0 / ratio + i; no others are written.
                let first = c.pos0 / ratio;
                let emitted = cs.rows.len();
                assert_eq!(emitted, (c.pos0 + c.positions) / ratio - first, "{at}: emitted rows");
                assert!(emitted > 0, "{at}: the case emits no row");
                let want: Vec<f32> = cs.rows.iter_values().collect();
                let dev_rows = &v[first * w..(first + emitted) * w];
                match c.precision {
                    KvPrecision::F16 => assert_close_f16(&at, dev_rows, &want, 2e-5),
                    _ => assert_close(&at, dev_rows, &want, 2e-5),
                }
                assert!(
                    v[..first * w].iter().chain(&v[(first + emitted) * w..]).all(|&x| x == 0.0),
                    "{at}: stray rows"
                );
            }
        }
    }
    got
}

fn check_compress(c: CompCase) {
    let Some(ctx) = context() else { return };
    let batch = run_compress(&ctx, &c, &CHUNKS, false);
    let single = run_compress(&ctx, &c, &[1], false);
    let split = run_compress(&ctx, &c, &SPLIT_CHUNKS, true);
    for (((name, b), (_, s)), (_, sp)) in batch.iter().zip(&single).zip(&split) {
        assert_bits(&format!("ds4_compress {c:?}: {name}, launches of 1 row vs batches"), s, b);
        assert_bits(&format!("ds4_compress {c:?}: {name}, launches of 1 row vs the split form"), s, sp);
    }
}

#[test]
fn compress_csa_main_matches_cpu() {
    let base = CompCase {
        width: 512,
        ratio: 4,
        overlap: true,
        pos0: 0,
        positions: 70,
        precision: KvPrecision::F32,
        yarn: true,
    };
    check_compress(base);
    check_compress(CompCase { pos0: 65536, precision: KvPrecision::F16, ..base });
}

#[test]
fn compress_csa_indexer_matches_cpu() {
    let base = CompCase {
        width: 128,
        ratio: 4,
        overlap: true,
        pos0: 0,
        positions: 70,
        precision: KvPrecision::F32,
        yarn: true,
    };
    check_compress(base);
    check_compress(CompCase { pos0: 4096, precision: KvPrecision::F16, ..base });
}

#[test]
fn compress_hca_matches_cpu() {
    let base = CompCase {
        width: 512,
        ratio: 128,
        overlap: false,
        pos0: 0,
        positions: 300,
        precision: KvPrecision::F32,
        yarn: true,
    };
    check_compress(base);
    check_compress(CompCase { width: 128, pos0: 128 * 40, positions: 270, precision: KvPrecision::F16, ..base });
}

#[test]
fn compress_small_ratio_matches_cpu() {
    let base = CompCase {
        width: 128,
        ratio: 2,
        overlap: true,
        pos0: 0,
        positions: 41,
        precision: KvPrecision::F32,
        yarn: false,
    };
    check_compress(base);
    check_compress(CompCase { width: 512, overlap: false, pos0: 1000, ..base });
    check_compress(CompCase { width: 512, overlap: true, pos0: 30, precision: KvPrecision::F16, ..base });
}

// ---- 3. indexer scores

/// rust/engine/model/indexer.rs `select`'s score of row `s` (inline there):
/// `Σ_h (max(q_h · K_s, 0) * scale) * w_h`, heads in order.
fn index_score(q: &[f32], weights: &[f32], keys: &RowStore, s: usize) -> f32 {
    let hd = keys.width();
    let scale = 1.0 / (hd as f32).sqrt();
    let k = keys.row(s);
    let mut acc = 0f32;
    for (h, qh) in q.chunks(hd).enumerate() {
        acc += (dot_f32(qh, k).max(0.0) * scale) * weights[h];
    }
    acc
}

/// The top-k under `select`'s order (score descending by total_cmp, index ascending), in
/// index order: the reference for scores that differ from the CPU's by rounding.
fn topk_of(scores: &[f32], top_k: usize) -> Vec<usize> {
    if scores.len() <= top_k {
        return (0..scores.len()).collect();
    }
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(top_k);
    idx.sort_unstable();
    idx
}

#[derive(Clone, Copy, Debug)]
struct IndexCase {
    heads: usize,
    head_dim: usize,
    ratio: usize,
    topk: usize,
    pos0: usize,
    n: usize,
}

/// Checks a scores buffer `got` ([n, stride]) of case `c` against the CPU's scores of each row
/// (within 1e-5; NaN, unwritten, where every visible row is selected and past the visible
/// rows); returns whether every score is bitwise the CPU's.
fn check_scores(what: &str, c: &IndexCase, got: &[f32], stride: usize, iq: &[f32], g: &[f32], keys: &RowStore) -> bool {
    let (h, hd) = (c.heads, c.head_dim);
    let mut exact = true;
    for r in 0..c.n {
        let pos = c.pos0 + r;
        let n_vis = visible_compressed(pos, c.ratio);
        let row = &got[r * stride..(r + 1) * stride];
        let at = format!("{what}: row {r} (position {pos}, {n_vis} visible)");
        if n_vis <= c.topk {
            assert!(row.iter().all(|v| v.is_nan()), "{at}: scores written though every row is selected");
            continue;
        }
        let (q, w) = (&iq[r * h * hd..(r + 1) * h * hd], &g[r * h..(r + 1) * h]);
        let want: Vec<f32> = (0..n_vis).map(|s| index_score(q, w, keys, s)).collect();
        assert_close(&at, &row[..n_vis], &want, 1e-5);
        assert!(row[n_vis..].iter().all(|v| v.is_nan()), "{at}: scores written past the visible rows");
        exact &= row[..n_vis].iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
    }
    exact
}

/// Launches the scores kernel `name` (`ds4_index_scores` or `ds4_index_scores_mma`), with
/// `grid_x` blocks a row of `block` threads and `smem` bytes of dynamic shared memory.
#[allow(clippy::too_many_arguments)]
fn run_index_kernel(
    ctx: &Context,
    name: &str,
    c: &IndexCase,
    pos0: usize,
    iq: &[f32],
    g: &[f32],
    irows: &DevBuf,
    stride: usize,
    (grid_x, block, smem): (usize, u32, usize),
) -> Vec<f32> {
    let n = g.len() / c.heads;
    let (qb, gb) = (buf(iq), buf(g));
    let out = buf(&vec![f32::NAN; n * stride]);
    let st = step(ctx, pos0, &vec![0; n]);
    let args = [
        ptr(&qb),
        ptr(&gb),
        ptr(irows),
        int(c.heads),
        int(c.head_dim),
        int(c.ratio),
        int(c.topk),
        ptr(&out),
        int(stride),
        ptr(&st),
    ];
    launch(ctx, name, (grid_x, n), block, smem, &args);
    read(ctx, &out, n * stride)
}

/// Launches `ds4_index_topk` on `scores` ([n, stride]) at `pos0..`; returns (sel, nsel) with
/// sel entries never written left at -1.
fn run_topk(
    ctx: &Context,
    scores: &[f32],
    stride: usize,
    ratio: usize,
    topk: usize,
    pos0: usize,
    block: u32,
) -> (Vec<i32>, Vec<i32>) {
    let n = scores.len() / stride;
    let sb = buf(scores);
    let sel = buf(&vec![-1i32; n * topk]);
    let nsel = buf(&vec![-1i32; n]);
    let st = step(ctx, pos0, &vec![0; n]);
    let args = [ptr(&sb), int(stride), int(ratio), int(topk), ptr(&sel), ptr(&nsel), ptr(&st)];
    launch(ctx, "ds4_index_topk", (n, 1), block, 0, &args);
    (read(ctx, &sel, n * topk), read(ctx, &nsel, n))
}

/// Asserts that row r of a top-k result is `want` (and the rest of its sel row untouched).
#[track_caller]
fn assert_selected(what: &str, sel: &[i32], nsel: &[i32], r: usize, topk: usize, want: &[usize]) {
    assert_eq!(nsel[r], want.len() as i32, "{what}: nsel of row {r}");
    let row = &sel[r * topk..(r + 1) * topk];
    for (i, &w) in want.iter().enumerate() {
        assert_eq!(row[i], w as i32, "{what}: row {r} sel[{i}] (want {:?}..)", &want[..want.len().min(8)]);
    }
    assert!(row[want.len()..].iter().all(|&x| x == -1), "{what}: row {r}: entries written past nsel");
}

fn check_index(c: IndexCase) {
    let Some(ctx) = context() else { return };
    let what = format!("ds4_index_scores {c:?}");
    let (h, hd, n) = (c.heads, c.head_dim, c.n);
    let seed = (c.pos0 + hd) as u64;
    let rows = visible_compressed(c.pos0 + n - 1, c.ratio);
    let mut keys = RowStore::new(hd);
    for (s, row) in randn(rows * hd, seed, 1.0).chunks(hd).enumerate() {
        // A few duplicate rows, so that some scores tie.
        if s % 97 == 6 {
            let dup = keys.row(s - 1).to_vec();
            keys.push(&dup);
        } else {
            keys.push(row);
        }
    }
    let irows = buf(&keys.iter_values().collect::<Vec<_>>());
    let iq = randn(n * h * hd, seed + 1, 1.0);
    let g = randn(n * h, seed + 2, 0.2);
    let stride = rows + 3;
    // ds4_index_scores over rows at pos0.. (queries iq, weights g) on grid_x blocks a row of
    // `block` threads: the scores buffer ([n, stride], NaN where nothing was written).
    let run_scores = |pos0: usize, iq: &[f32], g: &[f32], grid_x: usize, block: u32| {
        run_index_kernel(&ctx, "ds4_index_scores", &c, pos0, iq, g, &irows, stride, (grid_x, block, 0))
    };
    let got = run_scores(c.pos0, &iq, &g, 132, 256);
    let exact = check_scores(&what, &c, &got, stride, &iq, &g, &keys);

    // Row invariance: each row alone, and the batch with another grid and block size.
    for r in 0..n {
        let one = run_scores(c.pos0 + r, &iq[r * h * hd..(r + 1) * h * hd], &g[r * h..(r + 1) * h], 132, 256);
        assert_bits(&format!("{what}: row {r} alone vs in the batch"), &one, &got[r * stride..(r + 1) * stride]);
    }
    let other = run_scores(c.pos0, &iq, &g, 5, 128);
    assert_bits(&format!("{what}: grid 5 x 128 threads vs 132 x 256"), &other, &got);
    // One block a row, as in a prompt's step of 132 rows or more (each block's batches of sweeps
    // as full as they get).
    let one_block = run_scores(c.pos0, &iq, &g, 1, 256);
    assert_bits(&format!("{what}: one block a row vs 132"), &one_block, &got);
    // The grid the decode's step of n rows uses (fewer blocks a row as rows are added).
    let bx = super::program::index_blocks(n) as usize;
    let at_step = run_scores(c.pos0, &iq, &g, bx, 256);
    assert_bits(&format!("{what}: the step's grid, {bx} blocks a row"), &at_step, &got);

    // The top-k of these scores is indexer::select's selection. The device's dot products
    // are the CPU's (x86 AVX2 dot_f32) operation for operation, so the scores agree bitwise
    // there and the selections must be equal; elsewhere the device's selection is checked
    // against the same order applied to its own scores.
    let (sel, nsel) = run_topk(&ctx, &got, stride, c.ratio, c.topk, c.pos0, 1024);
    for r in 0..n {
        let pos = c.pos0 + r;
        let n_vis = visible_compressed(pos, c.ratio);
        let at = format!("ds4_index_topk after {what}: row {r} (position {pos}, {n_vis} visible)");
        let want = if exact {
            indexer::select(&iq[r * h * hd..(r + 1) * h * hd], &g[r * h..(r + 1) * h], &keys, n_vis, c.topk)
        } else {
            eprintln!("{what}: scores differ from the CPU's by rounding; top-k checked on the device's scores");
            topk_of(&got[r * stride..r * stride + n_vis], c.topk)
        };
        assert_selected(&at, &sel, &nsel, r, c.topk, &want);
    }
}

#[test]
fn index_scores_match_cpu() {
    // The model's shape (64 heads of 128): rows around the top-k size and far above it.
    check_index(IndexCase { heads: 64, head_dim: 128, ratio: 4, topk: 512, pos0: 4 * 512 - 10, n: 16 });
    check_index(IndexCase { heads: 64, head_dim: 128, ratio: 4, topk: 512, pos0: 4 * 3000, n: 16 });
    // The other paths: head_dim 64 in registers, 48 from memory, more heads than fit in
    // shared memory.
    check_index(IndexCase { heads: 4, head_dim: 64, ratio: 128, topk: 8, pos0: 128 * 20 - 3, n: 5 });
    check_index(IndexCase { heads: 8, head_dim: 48, ratio: 2, topk: 8, pos0: 100, n: 5 });
    check_index(IndexCase { heads: 160, head_dim: 128, ratio: 4, topk: 8, pos0: 400, n: 3 });
    // Few heads of 128: a sweep takes 64 rows of a 256-thread block, more than a warp adds.
    check_index(IndexCase { heads: 4, head_dim: 128, ratio: 4, topk: 8, pos0: 900, n: 3 });
}

#[test]
fn index_scores_on_tensor_cores_match_cpu_and_are_row_invariant() {
    let Some(ctx) = context_from(8, "mma.sync m16n8k8 tf32") else { return };
    // Flash's shape (64 heads of 128) past the top-k size, a context far above it, and 16 or
    // 48 heads (other numbers of m16 tiles); rows of a prompt's step at each.
    let cases = [
        IndexCase { heads: 64, head_dim: 128, ratio: 4, topk: 512, pos0: 4 * 512 - 10, n: 24 },
        IndexCase { heads: 64, head_dim: 128, ratio: 4, topk: 512, pos0: 4 * 3000, n: 20 },
        IndexCase { heads: 16, head_dim: 128, ratio: 4, topk: 8, pos0: 700, n: 17 },
        IndexCase { heads: 48, head_dim: 128, ratio: 2, topk: 8, pos0: 333, n: 18 },
        // A verify's and a decode's rows at a 32K context (decode steps run this kernel too).
        IndexCase { heads: 64, head_dim: 128, ratio: 4, topk: 512, pos0: 32768, n: 8 },
        IndexCase { heads: 64, head_dim: 128, ratio: 4, topk: 512, pos0: 2100, n: 1 },
    ];
    for c in cases {
        assert!(super::program::index_mma(true, true, true, true, c.heads, c.head_dim, ctx.smem_optin), "{c:?}");
        let what = format!("ds4_index_scores_mma {c:?}");
        let (h, hd, n) = (c.heads, c.head_dim, c.n);
        let seed = (c.pos0 + hd + 7) as u64;
        let rows = visible_compressed(c.pos0 + n - 1, c.ratio);
        let mut keys = RowStore::new(hd);
        for row in randn(rows * hd, seed, 1.0).chunks(hd) {
            keys.push(row);
        }
        let irows = buf(&keys.iter_values().collect::<Vec<_>>());
        let iq = randn(n * h * hd, seed + 1, 1.0);
        let g = randn(n * h, seed + 2, 0.2);
        let stride = rows + 3;
        let bx = super::program::index_mma_blocks(n) as usize;
        let smem = super::program::index_mma_smem(c.heads);
        let mma = |pos0: usize, iq: &[f32], g: &[f32], blocks: usize| {
            run_index_kernel(&ctx, "ds4_index_scores_mma", &c, pos0, iq, g, &irows, stride, (blocks, 256, smem))
        };
        let got = mma(c.pos0, &iq, &g, bx);
        // 3xTF32 keeps about 2^-21 of each product; the sums run in another order.
        check_scores(&what, &c, &got, stride, &iq, &g, &keys);
        // Row invariance: each row alone, and other grids, give the same bits.
        for r in [0, n / 2, n - 1] {
            let one = mma(c.pos0 + r, &iq[r * h * hd..(r + 1) * h * hd], &g[r * h..(r + 1) * h], bx);
            assert_bits(&format!("{what}: row {r} alone vs in the batch"), &one, &got[r * stride..(r + 1) * stride]);
        }
        for other in [1, 3, super::program::index_mma_blocks(1) as usize, super::program::index_mma_blocks(64) as usize]
        {
            let o = mma(c.pos0, &iq, &g, other);
            assert_bits(&format!("{what}: {other} blocks a row vs {bx}"), &o, &got);
        }
    }
}

// ---- 4. top-k

/// Scores whose `indexer::select` is known: with one-wide keys K_s, the queries (1, -1) and
/// weights (1, -1), select scores row s as max(K_s, 0) + max(-K_s, 0) * -1 = K_s exactly
/// (scale 1). So `select` on such a store is the reference top-k of the scores K.
fn select_of_scores(scores: &[f32], top_k: usize) -> Vec<usize> {
    let mut keys = RowStore::new(1);
    for &s in scores {
        keys.push(&[s]);
    }
    indexer::select(&[1.0, -1.0], &[1.0, -1.0], &keys, scores.len(), top_k)
}

#[derive(Clone, Copy, Debug)]
enum Pattern {
    /// Uniform in [-10, 10): negatives, few ties.
    Random,
    /// Multiples of 1/4 in [-2, 2]: many ties, some infinities.
    Ties,
    /// Every score equal.
    Equal,
}

fn scores_of(p: Pattern, len: usize, seed: u64) -> Vec<f32> {
    let v = randn(len, seed, 10.0);
    match p {
        Pattern::Random => v,
        Pattern::Ties => v
            .iter()
            .enumerate()
            .map(|(i, &x)| match i % 101 {
                // + 0.0: no negative zeros (select's scores are never -0).
                7 => f32::INFINITY,
                8 => f32::NEG_INFINITY,
                _ => (x * 0.8).round() / 4.0 + 0.0,
            })
            .collect(),
        Pattern::Equal => vec![-1.5; len],
    }
}

fn check_topk(ratio: usize, topk: usize, pos0: usize, n: usize, p: Pattern) {
    let Some(ctx) = context() else { return };
    let what = format!("ds4_index_topk ratio {ratio} topk {topk} positions {pos0}..+{n} {p:?}");
    let stride = visible_compressed(pos0 + n - 1, ratio) + 1;
    let mut scores = vec![f32::NAN; n * stride];
    for r in 0..n {
        let row = scores_of(p, stride, (pos0 * 31 + r) as u64);
        scores[r * stride..(r + 1) * stride].copy_from_slice(&row);
    }
    let (sel, nsel) = run_topk(&ctx, &scores, stride, ratio, topk, pos0, 1024);
    let mut crossed = (false, false);
    for r in 0..n {
        let pos = pos0 + r;
        let n_vis = visible_compressed(pos, ratio);
        let want = select_of_scores(&scores[r * stride..r * stride + n_vis], topk);
        assert_selected(&format!("{what}: row {r} (position {pos}, {n_vis} visible)"), &sel, &nsel, r, topk, &want);
        if n_vis <= topk {
            crossed.0 = true;
        } else {
            crossed.1 = true;
        }
        // Row invariance: the row alone, at its position.
        let (one, none) = run_topk(&ctx, &scores[r * stride..(r + 1) * stride], stride, ratio, topk, pos, 1024);
        assert_eq!(none[0], nsel[r], "{what}: row {r} alone: nsel");
        assert_eq!(one, sel[r * topk..(r + 1) * topk], "{what}: row {r} alone vs in the batch");
    }
    eprintln!("{what}: rows with all selected {}, rows with a top-k {}", crossed.0, crossed.1);
    // Another block size selects the same.
    let (sel2, nsel2) = run_topk(&ctx, &scores, stride, ratio, topk, pos0, 256);
    assert_eq!((sel2, nsel2), (sel, nsel), "{what}: 256 threads vs 1024");
}

#[test]
fn index_topk_small_k_matches_select() {
    // n_vis 1..16 crossing k = 8.
    for p in [Pattern::Random, Pattern::Ties, Pattern::Equal] {
        check_topk(1, 8, 0, 16, p);
    }
    // n_vis about 5000.
    for p in [Pattern::Random, Pattern::Ties, Pattern::Equal] {
        check_topk(2, 8, 2 * 4990, 16, p);
    }
}

#[test]
fn index_topk_large_k_matches_select() {
    // n_vis 504..519 crossing k = 512.
    for p in [Pattern::Random, Pattern::Ties, Pattern::Equal] {
        check_topk(1, 512, 503, 16, p);
    }
    // n_vis about 5000 (several chunks of the compaction).
    for p in [Pattern::Random, Pattern::Ties, Pattern::Equal] {
        check_topk(4, 512, 4 * 5000, 7, p);
    }
    check_topk(128, 512, 128 * 3000, 3, Pattern::Ties);
    // n_vis about 8200 (Flash's CSA layers at a 32K context: 8 scores a thread of 1024) and
    // 16400 (16 a thread).
    for p in [Pattern::Random, Pattern::Ties] {
        check_topk(4, 512, 4 * 8200, 2, p);
    }
    check_topk(4, 512, 4 * 16400, 2, Pattern::Random);
}

// ---- 5. attention

#[derive(Clone, Copy, Debug)]
enum Keys {
    /// The raw window only (crows null).
    Sliding,
    /// Every compressed row visible (sel null).
    Hca { ratio: usize },
    /// The selected compressed rows.
    Csa { ratio: usize, topk: usize },
    /// A drafter's block: every row sees the window before the step and all of the step's rows.
    Block,
}

/// Heads, head dim and output groups of an attention test.
#[derive(Clone, Copy, Debug)]
struct Shape {
    heads: usize,
    hd: usize,
    groups: usize,
}

/// The model's head dim, with 16 heads in 4 output groups (the model has 64 in 8).
const MAIN: Shape = Shape { heads: 16, hd: 512, groups: 4 };

struct AttnSetup {
    shape: Shape,
    ls: LayerState,
    q: Vec<f32>,
    sinks: Vec<f32>,
    crows: RowStore,
    /// Per row: the selected compressed rows (CSA).
    sel: Vec<Vec<usize>>,
}

fn attn_setup(shape: Shape, keys: Keys, pos0: usize, n: usize) -> AttnSetup {
    let Shape { heads, hd, .. } = shape;
    let seed = (pos0 * 3 + n) as u64;
    let mut ls = LayerState::new(WINDOW, hd, None, None);
    let last = pos0 + n - 1;
    for p in (last + 1).saturating_sub(ls.slots)..=last {
        ls.push_raw(p, &randn(hd, seed + 10 + p as u64, 1.0));
    }
    let ratio = match keys {
        Keys::Sliding | Keys::Block => 0,
        Keys::Hca { ratio } | Keys::Csa { ratio, .. } => ratio,
    };
    let mut crows = RowStore::new(hd);
    if ratio > 0 {
        for row in randn(visible_compressed(last, ratio) * hd, seed + 1, 1.0).chunks(hd) {
            crows.push(row);
        }
    }
    let sel = match keys {
        Keys::Csa { ratio, topk } => (0..n)
            .map(|r| {
                let n_vis = visible_compressed(pos0 + r, ratio);
                select_of_scores(&randn(n_vis, seed + 100 + r as u64, 1.0), topk)
            })
            .collect(),
        _ => Vec::new(),
    };
    AttnSetup { shape, ls, q: randn(n * heads * hd, seed + 2, 2.5), sinks: randn(heads, seed + 3, 2.0), crows, sel }
}

/// rust/engine/model/forward.rs Model::attention's per-row attention: the raw window, then
/// the selected (CSA) or all visible (HCA) compressed rows; attend, then the inverse rope.
fn attn_cpu(s: &AttnSetup, keys: Keys, pos: usize, r: usize, rope: &Rope) -> Vec<f32> {
    let Shape { heads, hd, .. } = s.shape;
    let mut k: Vec<&[f32]> = raw_range(pos, WINDOW).map(|p| s.ls.raw(p)).collect();
    match keys {
        Keys::Sliding => {}
        Keys::Block => {
            // window_block (model/block.rs): the context rows raw_range(pos0 - 1), then the step's.
            let (pos0, n) = (pos - r, s.q.len() / (heads * hd));
            k = (pos0.saturating_sub(WINDOW)..pos0 + n).map(|p| s.ls.raw(p)).collect();
        }
        Keys::Hca { ratio } => k.extend((0..visible_compressed(pos, ratio)).map(|w| s.crows.row(w))),
        Keys::Csa { .. } => k.extend(s.sel[r].iter().map(|&w| s.crows.row(w))),
    }
    let mut o = vec![0f32; heads * hd];
    attend(&s.q[r * heads * hd..(r + 1) * heads * hd], &k, &s.sinks, hd, &mut o);
    rope.apply_heads(&mut o, hd, pos, true);
    o
}

/// Runs `ds4_attention_logits` then `ds4_attention` (with `mma`, `ds4_attention_mma`: a
/// prompt's steps) for rows `rows` of the setup placed at `pos0..` (row i of the launch is
/// setup row rows[i]); returns the output in row layout [n, heads * hd] (from the kernel's
/// grouped layout).
fn attn_device(
    ctx: &Context,
    s: &AttnSetup,
    keys: Keys,
    pos0: usize,
    rows: &[usize],
    rope: &Rope,
    mma: bool,
) -> Vec<f32> {
    let Shape { heads, hd, groups } = s.shape;
    let n = rows.len();
    let q: Vec<f32> = rows.iter().flat_map(|&r| s.q[r * heads * hd..(r + 1) * heads * hd].iter().copied()).collect();
    let (qb, ringb, sinkb, freqb) = (buf(&q), buf(&s.ls.ring), buf(&s.sinks), buf(rope.inv_freq()));
    let crows = buf(&s.crows.iter_values().chain([0.0]).collect::<Vec<_>>());
    let out = buf(&vec![f32::NAN; n * heads * hd]);
    let (ratio, topk) = match keys {
        Keys::Sliding | Keys::Block => (1, 0),
        Keys::Hca { ratio } => (ratio, 0),
        Keys::Csa { ratio, topk } => (ratio, topk),
    };
    let mut sel = vec![-1i32; n * topk.max(1)];
    let mut nsel = vec![0i32; n];
    if let Keys::Csa { .. } = keys {
        for (i, &r) in rows.iter().enumerate() {
            for (j, &w) in s.sel[r].iter().enumerate() {
                sel[i * topk + j] = w as i32;
            }
            nsel[i] = s.sel[r].len() as i32;
        }
    }
    let (selb, nselb) = (buf(&sel), buf(&nsel));
    let st = step(ctx, pos0, &vec![0; n]);
    let (crows_arg, sel_arg, nsel_arg) = match keys {
        Keys::Sliding | Keys::Block => (NULL, NULL, NULL),
        Keys::Hca { .. } => (ptr(&crows), NULL, NULL),
        Keys::Csa { .. } => (ptr(&crows), ptr(&selb), ptr(&nselb)),
    };
    let lgs = key_capacity(s, keys, n);
    let lg = zeroed(n * heads * lgs * 4);
    let (logit_blocks, out_blocks) = attention_blocks(heads, hd, lgs).expect("attention grid");
    let block = int(matches!(keys, Keys::Block) as usize);
    let keys_args =
        [ptr(&ringb), int(s.ls.slots), int(WINDOW), block, crows_arg, int(ratio), sel_arg, nsel_arg, int(topk)];
    if mma {
        let mut args = vec![ptr(&qb)];
        args.extend(keys_args);
        args.extend([ptr(&sinkb), int(heads), int(hd), ptr(&out), int(groups), ptr(&freqb), int(ROPE_DIM)]);
        args.extend([int(lgs), ptr(&st)]);
        let smem = super::program::attention_mma_smem(hd, lgs);
        launch(ctx, "ds4_attention_mma", (heads.div_ceil(16), n), 256, smem, &args);
    } else {
        let mut args = vec![ptr(&qb)];
        args.extend(keys_args);
        args.extend([int(heads), int(hd), ptr(&lg), int(lgs), ptr(&st)]);
        launch(ctx, "ds4_attention_logits", (logit_blocks as usize, n), 256, 0, &args);
        let mut args = vec![ptr(&lg), int(lgs)];
        args.extend(keys_args);
        args.extend([ptr(&sinkb), int(heads), int(hd), ptr(&out), int(groups), ptr(&freqb), int(ROPE_DIM), ptr(&st)]);
        launch(ctx, "ds4_attention", (out_blocks as usize, n), 256, 0, &args);
    }
    let grouped = read::<f32>(ctx, &out, n * heads * hd);
    let hpg = heads / groups;
    let mut o = vec![0f32; n * heads * hd];
    for r in 0..n {
        for h in 0..heads {
            let src = ((h / hpg * n + r) * hpg + h % hpg) * hd;
            o[(r * heads + h) * hd..(r * heads + h + 1) * hd].copy_from_slice(&grouped[src..src + hd]);
        }
    }
    o
}

/// The logits' row stride of a step of `n` rows: the window and the most compressed keys a row
/// has (the decoder's `max_keys`; a block's rows).
fn key_capacity(s: &AttnSetup, keys: Keys, n: usize) -> usize {
    WINDOW
        + match keys {
            Keys::Sliding => 0,
            Keys::Block => n,
            Keys::Hca { .. } => s.crows.len(),
            Keys::Csa { topk, .. } => topk,
        }
}

fn check_attention(keys: Keys, pos0: usize, n: usize) {
    check_attention_shaped(MAIN, keys, pos0, n);
}

fn check_attention_shaped(shape: Shape, keys: Keys, pos0: usize, n: usize) {
    let Some(ctx) = context() else { return };
    let what = format!("ds4_attention {shape:?} {keys:?} positions {pos0}..+{n}");
    let rope = rope(!matches!(keys, Keys::Sliding | Keys::Block));
    let s = attn_setup(shape, keys, pos0, n);
    let rows: Vec<usize> = (0..n).collect();
    // Section 5's kernels, then (where it takes the shape) the prompt steps' tensor-core kernel.
    let mma_fits = super::program::attention_mma(
        true,
        true,
        ctx.compute_capability.0 >= 8,
        shape.hd,
        key_capacity(&s, keys, n),
        ctx.smem_optin,
    );
    for mma in [false, true] {
        if mma && !mma_fits {
            continue;
        }
        let what = format!("{what}{}", if mma { " on the tensor cores" } else { "" });
        let got = attn_device(&ctx, &s, keys, pos0, &rows, &rope, mma);
        let w = shape.heads * shape.hd;
        for r in 0..n {
            let pos = pos0 + r;
            let want = attn_cpu(&s, keys, pos, r, &rope);
            assert_close(&format!("{what}: row {r} (position {pos})"), &got[r * w..(r + 1) * w], &want, 2e-5);
            if matches!(keys, Keys::Block) {
                continue; // a block row's keys depend on the block
            }
            let one = attn_device(&ctx, &s, keys, pos, &[r], &rope, mma);
            assert_bits(&format!("{what}: row {r} alone vs in the batch"), &one, &got[r * w..(r + 1) * w]);
        }
    }
}

#[test]
fn attention_sliding_matches_cpu() {
    check_attention(Keys::Sliding, 0, 16);
    check_attention(Keys::Sliding, 120, 16);
    check_attention(Keys::Sliding, 5000, 5);
}

#[test]
fn attention_block_matches_cpu() {
    // No context, part of a window, a whole window and the step's 16 rows (the ring's slots).
    check_attention(Keys::Block, 0, 5);
    check_attention(Keys::Block, 60, 5);
    check_attention(Keys::Block, 5000, 16);
}

#[test]
fn attention_hca_matches_cpu() {
    // Around the first window close (no compressed row, then one), and far on.
    check_attention(Keys::Hca { ratio: 128 }, 120, 16);
    check_attention(Keys::Hca { ratio: 128 }, 3000, 16);
    check_attention(Keys::Hca { ratio: 128 }, 1_000_000, 2);
}

#[test]
fn attention_csa_matches_cpu() {
    let csa = Keys::Csa { ratio: 4, topk: 64 };
    // All visible rows selected; crossing the top-k size; a top-k of many rows.
    check_attention(csa, 1, 16);
    check_attention(csa, 250, 16);
    check_attention(csa, 2000, 8);
    check_attention(Keys::Csa { ratio: 4, topk: 512 }, 20000, 3);
}

#[test]
fn attention_other_shapes_match_cpu() {
    // Head counts that are not a multiple of the kernels' groups of 8 heads, head dims below
    // (the small test models: 2 heads of 128) and above one 512-column pass.
    check_attention_shaped(Shape { heads: 2, hd: 128, groups: 2 }, Keys::Csa { ratio: 4, topk: 8 }, 300, 5);
    check_attention_shaped(Shape { heads: 12, hd: 64, groups: 3 }, Keys::Hca { ratio: 8 }, 700, 4);
    check_attention_shaped(Shape { heads: 4, hd: 1024, groups: 2 }, Keys::Sliding, 200, 3);
    // An odd number of the tensor-core kernel's output tiles a warp (192 / 64) and heads past
    // its last group of 16.
    check_attention_shaped(Shape { heads: 20, hd: 192, groups: 4 }, Keys::Csa { ratio: 4, topk: 16 }, 400, 6);
}
