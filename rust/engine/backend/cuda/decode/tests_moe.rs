//! Tests of the routed-expert kernels (shaders/cuda/decode_moe.cu: ds4_route, ds4_gather,
//! ds4_moe_combine, alone and fused with the hyper-connection expansion) against the CPU reference (rust/engine/model/moe.rs `route` and
//! `forward`), and of the whole routed-expert path on the device: router product, routing,
//! gather, gate/up products over the device-written table, SwiGLU, down products, combine.
//! Without a GPU they print "skipped" and pass.

use super::testutil::{assert_close, context, split_image, step, Arg, DevBuf};
use crate::backend::cuda::context::{Context, THREADS};
use crate::backend::cuda::device::static_smem;
use crate::backend::cuda::{row_blocks, slices, CudaBackend, Desc};
use crate::backend::{cpu, Cpu, Ops};
use crate::model::config::{AttentionKind, LayerSpec, ModelConfig};
use crate::model::moe;
use crate::model::weights::{HyperWeights, LayerWeights, Mat, Router, Stack};
use crate::quant::testutil::Rng;
use crate::quant::{self, GgmlType};

/// Arrival counters the tests give the product kernels (ints, zero between launches).
const COUNTERS: usize = 1 << 14;

/// A model configuration with the MoE shape of the tests (the rest is plausible filler).
fn config(n_experts: usize, k: usize, hidden: usize, ff: usize, norm: bool, scale: f32) -> ModelConfig {
    ModelConfig {
        vocab: 64,
        hidden,
        n_heads: 4,
        head_dim: 64,
        rope_dim: 16,
        q_lora_rank: 64,
        o_groups: 2,
        o_lora_rank: 32,
        window: 128,
        rms_eps: 1e-6,
        rope_base: 10000.0,
        compress_rope_base: 160000.0,
        yarn: None,
        index_heads: 0,
        index_head_dim: 0,
        index_topk: 0,
        n_experts,
        n_experts_used: k,
        expert_ff: ff,
        n_shared_experts: 1,
        expert_weights_scale: scale,
        expert_weights_norm: norm,
        hc_mult: 4,
        sinkhorn_iters: 20,
        hc_eps: 1e-6,
        context_length: 4096,
        nextn_layers: 0,
        bos: None,
        eos: None,
        layers: Vec::new(),
    }
}

fn layer_spec(hash: bool) -> LayerSpec {
    LayerSpec { kind: AttentionKind::Sliding, ratio: 0, hash_routed: hash, clamp_routed: 2.0, clamp_shared: 3.0 }
}

/// A matrix the MoE code never reads.
fn unused() -> Mat {
    Mat { ty: GgmlType::F32, n_in: 0, n_out: 0, start: 0, row_bytes: 0 }
}

/// The weights of one layer: the MoE tensors given, the rest unused placeholders.
fn layer_weights(router_proj: Mat, router: Router, exps: [Stack; 3], sh: [Mat; 3]) -> LayerWeights {
    let hyper = || HyperWeights { proj: unused(), base: Vec::new(), scale: Vec::new() };
    LayerWeights {
        hc_attn: hyper(),
        hc_ffn: hyper(),
        attn_norm: Vec::new(),
        q_a: unused(),
        q_a_norm: Vec::new(),
        q_b: unused(),
        kv: unused(),
        kv_norm: Vec::new(),
        sinks: Vec::new(),
        o_a: unused(),
        o_b: unused(),
        compressor: None,
        indexer: None,
        ffn_norm: Vec::new(),
        router_proj,
        router,
        gate_exps: exps[0],
        up_exps: exps[1],
        down_exps: exps[2],
        gate_sh: sh[0],
        up_sh: sh[1],
        down_sh: sh[2],
    }
}

/// A hash table of `vocab` tokens with `k` experts each, with repeated experts in many rows.
fn hash_table(rng: &mut Rng, vocab: usize, k: usize, n_experts: usize) -> Vec<u32> {
    let mut t = Vec::with_capacity(vocab * k);
    for tok in 0..vocab {
        for j in 0..k {
            let repeat = j > 0 && (tok % 3 == 0 || rng.next_u64().is_multiple_of(4));
            let e = if repeat {
                t[tok * k + (rng.next_u64() as usize % j)]
            } else {
                (rng.next_u64() % n_experts as u64) as u32
            };
            t.push(e);
        }
    }
    t
}

/// The routing of one layer: the learned router (with a selection bias) or a hash table.
fn router(rng: &mut Rng, hash: bool, vocab: usize, k: usize, n_experts: usize) -> Router {
    if hash {
        Router::Hash { table: hash_table(rng, vocab, k, n_experts) }
    } else {
        Router::Learned { bias: rng.f32s(n_experts).iter().map(|v| v * 0.3).collect() }
    }
}

// ---- the device side of the routing: launches, as the decode host code does them

/// The product of `w` (in the device image `img`) with `n` rows at `x` into `y` (partial sums
/// at `part`, counters from `counter`), and its block count.
fn product(img: &DevBuf, w: &Mat, x: u64, y: u64, part: u64, n: usize, counter: usize) -> (Desc, usize) {
    CudaBackend::desc(img.at(w.start), w, w, x, y, part, n, counter)
}

/// Launches the product kernel of matrices shaped as `w` for `n` batch rows over `count`
/// descriptors at `table`.
fn launch_products(ctx: &Context, w: &Mat, n: usize, table: u64, count: usize, blocks: usize, counters: &DevBuf) {
    let f = ctx.kernel(w.ty, w.n_in, w.n_out, n).expect("a product kernel");
    ctx.launch_args(
        f.0,
        (blocks as u32, 1, 1),
        THREADS,
        f.1,
        &[Arg::Ptr(table), Arg::I32(count as i32), Arg::Ptr(counters.at(0)), Arg::I32(0)],
    )
    .expect("launching products");
}

/// `silu(min(g, c)) * clamp(u, ±c)` (moe.rs `swiglu`, private there).
fn swiglu_host(g: &[f32], u: &[f32], clamp: f32) -> Vec<f32> {
    g.iter().zip(u).map(|(&g, &u)| cpu::silu(g.min(clamp)) * u.clamp(-clamp, clamp)).collect()
}

/// SwiGLU of `count` values: decode_ops.cu's ds4_swiglu when the program has it, else on the
/// host between the launches.
fn swiglu(ctx: &Context, g: &DevBuf, u: &DevBuf, out: &DevBuf, count: usize, clamp: f32) {
    if let Ok(f) = ctx.function("ds4_swiglu") {
        let args = [
            Arg::Ptr(g.at(0)),
            Arg::Ptr(u.at(0)),
            Arg::Ptr(out.at(0)),
            Arg::I32(count as i32),
            Arg::F32(clamp),
            Arg::I32(count as i32),
            Arg::I32(0),
        ];
        ctx.launch_args(f, (count.div_ceil(256) as u32, 1, 1), 256, 0, &args).expect("ds4_swiglu");
    } else {
        ctx.sync().expect("sync");
        let gv: Vec<f32> = g.read(0, count).expect("read g");
        let uv: Vec<f32> = u.read(0, count).expect("read u");
        out.write(0, &swiglu_host(&gv, &uv, clamp)).expect("write act");
    }
}

fn f32s(len: usize) -> DevBuf {
    DevBuf::zeroed(4 * len.max(1)).expect("device buffer")
}

/// What ds4_route wrote.
struct Routing {
    gather_src: Vec<i32>,
    comb_slot: Vec<i32>,
    comb_w: Vec<f32>,
    comb_cnt: Vec<i32>,
    gu: Vec<Desc>,
    down: Vec<Desc>,
}

/// The route kernel's output buffers of a batch of `n` rows.
struct RouteBufs {
    gu: DevBuf,
    down: DevBuf,
    gather_src: DevBuf,
    comb_slot: DevBuf,
    comb_w: DevBuf,
    comb_cnt: DevBuf,
    max_descs: usize,
    /// Most rows of a gate/up and of a down descriptor.
    chunks: (usize, usize),
}

impl RouteBufs {
    /// For one descriptor per used expert (the union).
    fn new(n: usize, k: usize, n_experts: usize) -> Self {
        Self::chunked(n, k, n_experts, (n, n))
    }

    /// For an expert's rows in descriptors of at most `chunks` rows (gate/up, down).
    fn chunked(n: usize, k: usize, n_experts: usize, chunks: (usize, usize)) -> Self {
        let max_descs = if chunks.0 >= n && chunks.1 >= n { (n * k).min(n_experts) } else { n * k };
        let desc = std::mem::size_of::<Desc>();
        let z = |bytes: usize| DevBuf::zeroed(bytes).expect("device buffer");
        RouteBufs {
            gu: z(2 * max_descs * desc),
            down: z(max_descs * desc),
            gather_src: z(4 * n * k),
            comb_slot: z(4 * n * k),
            comb_w: z(4 * n * k),
            comb_cnt: z(4 * n),
            max_descs,
            chunks,
        }
    }

    fn read(&self, ctx: &Context, n: usize, k: usize) -> Routing {
        ctx.sync().expect("running the kernels");
        Routing {
            gather_src: self.gather_src.read(0, n * k).expect("read"),
            comb_slot: self.comb_slot.read(0, n * k).expect("read"),
            comb_w: self.comb_w.read(0, n * k).expect("read"),
            comb_cnt: self.comb_cnt.read(0, n).expect("read"),
            gu: self.gu.read(0, 2 * self.max_descs).expect("read"),
            down: self.down.read(0, self.max_descs).expect("read"),
        }
    }
}

/// Queues ds4_route for the `n` rows of `logits` (device) with the product templates `templ`;
/// with `pick`, after ds4_route_pick (a prompt's step's split, program.rs `split_over_blocks`).
#[allow(clippy::too_many_arguments)]
fn launch_route(
    ctx: &Context,
    cfg: &ModelConfig,
    router: &Router,
    logits: &DevBuf,
    n: usize,
    step_buf: &DevBuf,
    templ: &DevBuf,
    out: &RouteBufs,
    keep: &mut Vec<DevBuf>,
    pick: bool,
) {
    let (bias, hash) = match router {
        Router::Learned { bias } => (DevBuf::from_slice(bias).expect("bias"), None),
        Router::Hash { table } => (f32s(1), Some(DevBuf::from_slice(table).expect("hash table"))),
    };
    let bias_ptr = if hash.is_some() { 0 } else { bias.at(0) };
    let hash_ptr = hash.as_ref().map_or(0, |h| h.at(0));
    let k = cfg.n_experts_used;
    let router_args = [
        Arg::Ptr(logits.at(0)),
        Arg::I32(cfg.n_experts as i32),
        Arg::I32(cfg.n_experts_used as i32),
        Arg::Ptr(bias_ptr),
        Arg::Ptr(hash_ptr),
        Arg::I32(cfg.expert_weights_norm as i32),
        Arg::F32(cfg.expert_weights_scale),
        Arg::I32(n as i32),
        Arg::Ptr(step_buf.at(0)),
    ];
    let (picks, pick_w) = (f32s(n * k), f32s(n * k));
    if pick {
        let mut args = router_args.to_vec();
        args.extend([Arg::Ptr(picks.at(0)), Arg::Ptr(pick_w.at(0))]);
        let grid = super::program::route_pick_grid(n, cfg.n_experts);
        let threads = super::program::ROUTE_PICK_THREADS;
        ctx.launch_named("ds4_route_pick", (grid, 1, 1), threads, 0, &args).expect("ds4_route_pick");
    }
    let mut args = router_args.to_vec();
    args.extend([
        Arg::Ptr(out.gu.at(0)),
        Arg::Ptr(out.down.at(0)),
        Arg::I32(out.max_descs as i32),
        Arg::Ptr(templ.at(0)),
        Arg::Ptr(out.gather_src.at(0)),
        Arg::Ptr(out.comb_slot.at(0)),
        Arg::Ptr(out.comb_w.at(0)),
        Arg::Ptr(out.comb_cnt.at(0)),
        // Descriptors of at most this many rows (gate/up, then down).
        Arg::I32(out.chunks.0 as i32),
        Arg::I32(out.chunks.1 as i32),
    ]);
    args.extend(if pick { [Arg::Ptr(picks.at(0)), Arg::Ptr(pick_w.at(0))] } else { [Arg::Ptr(0), Arg::Ptr(0)] });
    let smem = super::program::route_smem(n, cfg.n_experts_used, cfg.n_experts) as u32;
    ctx.launch_named("ds4_route", (1, 1, 1), 256, smem, &args).expect("ds4_route");
    keep.extend([bias, picks, pick_w]);
    keep.extend(hash);
}

// ---- the CPU side: what the routing must produce (moe::route, then moe::forward's grouping)

/// The expected outputs of ds4_route for the rows' `routes` (moe::route of each row), as the
/// kernel's documentation specifies them from moe::forward's grouping.
fn expected_routing(
    routes: &[(Vec<usize>, Vec<f32>)],
    n_experts: usize,
    k: usize,
    templ: &[Desc; 3],
    chunks: (usize, usize),
) -> Routing {
    let n = routes.len();
    let max_descs = if chunks.0 >= n && chunks.1 >= n { (n * k).min(n_experts) } else { n * k };
    // moe::forward's `used`: the experts in increasing id with their rows.
    let used: Vec<(usize, Vec<usize>)> = (0..n_experts)
        .map(|e| (e, (0..n).filter(|&r| routes[r].0.contains(&e)).collect::<Vec<_>>()))
        .filter(|(_, rows)| !rows.is_empty())
        .collect();
    let mut off = Vec::with_capacity(used.len());
    let mut gather_src = vec![-1i32; n * k];
    let mut o = 0;
    for (_, rows) in &used {
        off.push(o);
        for (t, &r) in rows.iter().enumerate() {
            gather_src[o + t] = r as i32;
        }
        o += rows.len();
    }
    let mut comb_slot = vec![0i32; n * k];
    let mut comb_w = vec![0f32; n * k];
    let mut comb_cnt = vec![0i32; n];
    for r in 0..n {
        let (experts, weights) = &routes[r];
        let mut j = 0;
        for (i, (e, rows)) in used.iter().enumerate() {
            if let Some(t) = rows.iter().position(|&q| q == r) {
                // As moe::forward: the weights of equal entries add up, in chosen order.
                let wk: f32 = experts.iter().zip(weights).filter(|(x, _)| *x == e).map(|(_, w)| w).sum();
                comb_slot[r * k + j] = (off[i] + t) as i32;
                comb_w[r * k + j] = wk;
                j += 1;
            }
        }
        comb_cnt[r] = j as i32;
    }
    let rb = |t: &Desc| t.row_blocks() as i32;
    let bpd = |t: &Desc| rb(t) * t.slices;
    // Descriptor q of a chunking: (expert, first gathered row, rows), in expert then row order.
    let slots = |chunk: usize| -> Vec<(usize, usize, usize)> {
        let mut v = Vec::new();
        for (i, (e, rows)) in used.iter().enumerate() {
            for t in (0..rows.len()).step_by(chunk) {
                v.push((*e, off[i] + t, chunk.min(rows.len() - t)));
            }
        }
        v
    };
    let slot = |t: &Desc, q: usize, chunk: usize, sl: &[(usize, usize, usize)]| {
        let (e, off, c) = sl.get(q).copied().unwrap_or((0, 0, 0));
        let (n_out, n_in) = (t.n_out as u64, t.n_in as u64);
        Desc {
            w: t.w + e as u64 * t.row_bytes as u64 * n_out,
            x: t.x + 4 * off as u64 * n_in,
            y: t.y + 4 * off as u64 * n_out,
            part: t.part + 4 * (q * t.slices as usize * chunk) as u64 * n_out,
            n: c as i32,
            counter: t.counter + q as i32 * rb(t),
            ..*t
        }
    };
    let (sg, sd) = (slots(chunks.0), slots(chunks.1));
    // The used slots' blocks first, without gaps; an unused slot starts where they end (in the
    // gate table, where up's begin).
    let (ug, ud) = (sg.len(), sd.len());
    let mut gu = Vec::with_capacity(2 * max_descs);
    for q in 0..max_descs {
        gu.push(Desc { block_start: q.min(ug) as i32 * bpd(&templ[0]), ..slot(&templ[0], q, chunks.0, &sg) });
    }
    for q in 0..max_descs {
        let start = ug as i32 * bpd(&templ[0]) + q.min(ug) as i32 * bpd(&templ[1]);
        gu.push(Desc { block_start: start, ..slot(&templ[1], q, chunks.0, &sg) });
    }
    let down = (0..max_descs)
        .map(|q| Desc { block_start: q.min(ud) as i32 * bpd(&templ[2]), ..slot(&templ[2], q, chunks.1, &sd) })
        .collect();
    Routing { gather_src, comb_slot, comb_w, comb_cnt, gu, down }
}

/// Checks a device routing against the expected one: exact integers and descriptors, weights
/// to rounding (the scores' exp and log1p differ from libm's by an ulp at most).
#[track_caller]
fn check_routing(what: &str, got: &Routing, want: &Routing) {
    assert_eq!(got.comb_cnt, want.comb_cnt, "{what}: comb_cnt");
    assert_eq!(got.gather_src, want.gather_src, "{what}: gather_src");
    assert_eq!(got.comb_slot, want.comb_slot, "{what}: comb_slot");
    assert_close(&format!("{what}: comb_w"), &got.comb_w, &want.comb_w, 2e-6);
    for (name, g, w) in [("gu", &got.gu, &want.gu), ("down", &got.down, &want.down)] {
        assert_eq!(g.len(), w.len(), "{what}: {name} length");
        for (i, (a, b)) in g.iter().zip(w.iter()).enumerate() {
            assert_eq!(format!("{a:?}"), format!("{b:?}"), "{what}: {name}[{i}]");
        }
    }
}

/// Route templates with made-up addresses (ds4_route only does arithmetic on them).
fn fake_templates(d: usize, ff: usize) -> [Desc; 3] {
    let q8 = |n_in: usize| GgmlType::Q8_0.row_bytes(n_in as u64).expect("row bytes") as i64;
    let t = |w: u64, n_in: usize, n_out: usize, slices: i32, counter: i32| Desc {
        w,
        x: w + 0x100_0000,
        y: w + 0x200_0000,
        part: w + 0x300_0000,
        row_bytes: q8(n_in),
        n_out: n_out as i32,
        n_in: n_in as i32,
        n: 77,
        slices,
        block_start: 12345,
        counter,
        group: 2,
        y_stride: n_out as i32,
        warp_rows: crate::backend::cuda::warp_rows(GgmlType::Q8_0, n_in, n_out) as i32,
        pad: 0,
    };
    [t(0x1000_0000_0000, d, ff, 2, 100), t(0x2000_0000_0000, d, ff, 3, 5000), t(0x3000_0000_0000, ff, d, 1, 9000)]
}

#[test]
fn route_matches_cpu() {
    let Some(ctx) = context() else { return };
    let mut rng = Rng(0x5eed_0001);
    // (experts, k, hash, norm, scale)
    let cases = [
        (32, 6, false, true, 1.5f32),
        (256, 8, false, false, 2.5),
        (1024, 16, false, true, 1.0),
        (32, 6, true, true, 1.5),
        (64, 8, true, false, 1.0),
        (7, 7, false, true, 1.0),
    ];
    let (d, ff, vocab) = (512, 128, 64);
    // What the cases must have covered: a tie at the top-k boundary, unused descriptor slots,
    // rows with a repeated (hash) expert.
    let (mut split_ties, mut empty_slots, mut repeats) = (0, 0, 0);
    for (n_exp, k, hash, norm, scale) in cases {
        let cfg = config(n_exp, k, d, ff, norm, scale);
        let mut rt = router(&mut rng, hash, vocab, k, n_exp);
        if let Router::Learned { bias } = &mut rt {
            // Exact ties of score + bias: experts 5i and 5i + 1 get equal biases (and below,
            // equal logits in some rows).
            for e in (1..n_exp).step_by(5) {
                bias[e] = bias[e - 1];
            }
        }
        let lw = layer_weights(unused(), rt.clone(), [Stack { first: unused(), n_exp }; 3], [unused(); 3]);
        let templ = fake_templates(d, ff);
        let templ_buf = DevBuf::from_slice(&templ).expect("templates");
        // Up to the most rows the kernel takes (a prompt's step: P_MAX), as far as its shared
        // memory (with its static arrays, as the decoder's `prefill_rows` counts it) fits on
        // this device (E = 1024, k = 16: 136 KB at 256 rows).
        let room = ctx.smem_optin - static_smem(ctx.function("ds4_route").expect("ds4_route")).expect("static");
        let most = (16..=super::P_MAX).rev().find(|&r| super::program::route_smem(r, k, n_exp) <= room).unwrap_or(16);
        // And the most rows whose dynamic shared memory fits the 48 KiB a launch gets without
        // opting in: with the kernel's static arrays it may not (E = 256, k = 8: 192 rows,
        // 47112 bytes), which the launch must opt in for (it once counted the dynamic part
        // only: Flash's router at 154 rows, a prompt's last step, would not have launched).
        let edge =
            (16..=super::P_MAX).rev().find(|&r| super::program::route_smem(r, k, n_exp) <= 48 * 1024).unwrap_or(16);
        let mut counts = vec![1usize, 3, 16, edge, most];
        counts.dedup();
        for n in counts {
            let what = format!("E={n_exp} k={k} hash={hash} norm={norm} n={n}");
            // Logits over the softplus range: linear part (> 20), tiny scores, and exact ties
            // (equal logits of experts with equal biases, broken by the lower index).
            let mut logits: Vec<f32> = rng.f32s(n * n_exp).iter().map(|v| v * 4.0).collect();
            for r in 0..n {
                logits[r * n_exp] = 25.0 + r as f32;
                logits[r * n_exp + n_exp / 2] = -30.0;
            }
            if !hash {
                for r in 0..n {
                    for e in (1..n_exp).step_by(5).filter(|e| (e / 5 + r) % 2 == 0) {
                        logits[r * n_exp + e] = logits[r * n_exp + e - 1];
                    }
                }
            }
            let tokens: Vec<u32> =
                (0..n).map(|r| if r % 4 == 3 { 5 } else { (rng.next_u64() % vocab as u64) as u32 }).collect();
            let routes: Vec<(Vec<usize>, Vec<f32>)> =
                (0..n).map(|r| moe::route(&cfg, &lw, &logits[r * n_exp..(r + 1) * n_exp], tokens[r])).collect();
            let want = expected_routing(&routes, n_exp, k, &templ, (n, n));
            for r in 0..n {
                let (ch, z) = (&routes[r].0, &logits[r * n_exp..(r + 1) * n_exp]);
                if !hash {
                    split_ties += (1..n_exp)
                        .step_by(5)
                        .filter(|&e| z[e] == z[e - 1] && ch.contains(&e) != ch.contains(&(e - 1)))
                        .count();
                }
                repeats += usize::from((want.comb_cnt[r] as usize) < k);
            }
            empty_slots += want.down.iter().filter(|d| d.n == 0).count();

            let logits_buf = DevBuf::from_slice(&logits).expect("logits");
            let st = step(&ctx, 0, &tokens);
            let out = RouteBufs::new(n, k, n_exp);
            let mut keep = Vec::new();
            launch_route(&ctx, &cfg, &rt, &logits_buf, n, &st, &templ_buf, &out, &mut keep, false);
            let got = out.read(&ctx, n, k);
            check_routing(&what, &got, &want);
            // The same with the rows routed by ds4_route_pick's blocks first.
            let split = RouteBufs::new(n, k, n_exp);
            launch_route(&ctx, &cfg, &rt, &logits_buf, n, &st, &templ_buf, &split, &mut keep, true);
            check_routing(&format!("{what} picked apart"), &split.read(&ctx, n, k), &want);
            // Chunked tables, of a different size for gate/up and down (a prompt's step), the
            // second with the split.
            for chunks in [(2, 1), (16, 4), (3, 16)] {
                let out = RouteBufs::chunked(n, k, n_exp, chunks);
                let pick = chunks == (16, 4);
                launch_route(&ctx, &cfg, &rt, &logits_buf, n, &st, &templ_buf, &out, &mut keep, pick);
                let want = expected_routing(&routes, n_exp, k, &templ, chunks);
                check_routing(&format!("{what} chunks {chunks:?}"), &out.read(&ctx, n, k), &want);
            }

            // Row invariance: each row alone has the same weights, bit for bit.
            for row in 0..n {
                let lb = DevBuf::from_slice(&logits[row * n_exp..(row + 1) * n_exp]).expect("logits");
                let st1 = step(&ctx, row, &tokens[row..row + 1]);
                let o1 = RouteBufs::new(1, k, n_exp);
                launch_route(&ctx, &cfg, &rt, &lb, 1, &st1, &templ_buf, &o1, &mut keep, false);
                let g1 = o1.read(&ctx, 1, k);
                let cnt = g1.comb_cnt[0] as usize;
                assert_eq!(g1.comb_cnt[0], got.comb_cnt[row], "{what}: row {row} alone: comb_cnt");
                for j in 0..cnt {
                    assert_eq!(
                        g1.comb_w[j].to_bits(),
                        got.comb_w[row * k + j].to_bits(),
                        "{what}: row {row} alone: comb_w[{j}] {} vs {} in the batch",
                        g1.comb_w[j],
                        got.comb_w[row * k + j]
                    );
                }
            }
        }
    }
    eprintln!("ties at the top-k boundary: {split_ties}, unused slots: {empty_slots}, rows with repeats: {repeats}");
    assert!(split_ties > 0 && empty_slots > 0 && repeats > 0, "the cases missed a tie, an unused slot or a repeat");
}

/// What ds4_gather writes into a row's slot of d floats (plain, or 8-bit activations), as bits.
type RowImage = fn(&[f32]) -> Vec<u32>;

/// A row as 8-bit activations in its slot (quant/act8.rs; the rest of the slot unwritten, 7.0).
fn act8_image(x: &[f32]) -> Vec<u32> {
    let mut q = vec![0u8; crate::quant::act8::bytes(x.len())];
    crate::quant::act8::quantize_row(x, &mut q).expect("act8");
    let mut out: Vec<u32> = q.chunks_exact(4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect();
    out.resize(x.len(), 7.0f32.to_bits());
    out
}

#[test]
fn gather_and_combine_match_reference() {
    let Some(ctx) = context() else { return };
    let mut rng = Rng(0x5eed_0002);
    for (n, k, d) in [(1usize, 6usize, 1024usize), (3, 6, 1000), (16, 8, 4096)] {
        let what = format!("n={n} k={k} d={d}");
        // Gather: some rows used several times, some slots unused (-1).
        let mut h = rng.f32s(n * d);
        h[32..64].fill(0.0); // an all-zero block of 8-bit activations (scale 0)
        h[70] = 40.0; // and one with an outlier
        let total = n * k - n.min(3);
        let src: Vec<i32> =
            (0..n * k).map(|j| if j < total { (rng.next_u64() % n as u64) as i32 } else { -1 }).collect();
        let hb = DevBuf::from_slice(&h).expect("h");
        let sb = DevBuf::from_slice(&src).expect("gather_src");
        // Plain rows, and when d allows, rows as 8-bit activations (the routed IQ2_XXS gate and
        // up inputs): each slot must hold `image` of its source row, bitwise (the host's bytes).
        let mut cases: Vec<(i32, RowImage)> = vec![(0, |r| r.iter().map(|v| v.to_bits()).collect())];
        if d % 32 == 0 {
            cases.push((1, act8_image));
        }
        for (act8, image) in cases {
            let xg = DevBuf::from_slice(&vec![7.0f32; n * k * d]).expect("xg");
            let args = [Arg::Ptr(hb.at(0)), Arg::Ptr(xg.at(0)), Arg::Ptr(sb.at(0)), Arg::I32(d as i32), Arg::I32(act8)];
            // Rows split over 3 blocks (any split must write the same).
            ctx.launch_named("ds4_gather", ((n * k) as u32, 3, 1), 256, 0, &args).expect("ds4_gather");
            ctx.sync().expect("ds4_gather");
            let got: Vec<u32> = xg.read::<f32>(0, n * k * d).expect("read").iter().map(|v| v.to_bits()).collect();
            for (j, &s) in src.iter().enumerate() {
                let row = &got[j * d..(j + 1) * d];
                if s < 0 {
                    assert!(
                        row.iter().all(|&v| v == 7.0f32.to_bits()),
                        "{what} act8={act8}: gather slot {j} (unused) was written"
                    );
                } else {
                    let s = s as usize;
                    let want = image(&h[s * d..(s + 1) * d]);
                    assert!(row == &want[..], "{what} act8={act8}: gather slot {j} is not row {s}");
                }
            }
        }

        // Combine: the end of moe::forward (experts in list order, then the shared one).
        let slots = n * k;
        let down_out = rng.f32s(slots * d);
        let shared = rng.f32s(n * d);
        let cnt: Vec<i32> = (0..n).map(|r| (k - r % 3) as i32).collect();
        let mut slot = vec![0i32; n * k];
        let mut wts = vec![0f32; n * k];
        for r in 0..n {
            for j in 0..cnt[r] as usize {
                slot[r * k + j] = (rng.next_u64() % slots as u64) as i32;
                wts[r * k + j] = rng.f32() * 2.0;
            }
        }
        let mut want = vec![0f32; n * d];
        for r in 0..n {
            let o = &mut want[r * d..(r + 1) * d];
            for j in 0..cnt[r] as usize {
                let (s, wk) = (slot[r * k + j] as usize, wts[r * k + j]);
                for (v, &u) in o.iter_mut().zip(&down_out[s * d..(s + 1) * d]) {
                    *v += u * wk;
                }
            }
            for (v, &u) in o.iter_mut().zip(&shared[r * d..(r + 1) * d]) {
                *v += u;
            }
        }
        let bufs: Vec<DevBuf> =
            [&down_out[..], &wts[..], &shared[..]].iter().map(|v| DevBuf::from_slice(v).expect("buffer")).collect();
        let slot_b = DevBuf::from_slice(&slot).expect("comb_slot");
        let cnt_b = DevBuf::from_slice(&cnt).expect("comb_cnt");
        let out = f32s(n * d);
        let args = [
            Arg::Ptr(bufs[0].at(0)),
            Arg::Ptr(slot_b.at(0)),
            Arg::Ptr(bufs[1].at(0)),
            Arg::Ptr(cnt_b.at(0)),
            Arg::Ptr(bufs[2].at(0)),
            Arg::Ptr(out.at(0)),
            Arg::I32(k as i32),
            Arg::I32(d as i32),
        ];
        let grid = (d.div_ceil(256) as u32, n as u32, 1);
        let alone = [Arg::Ptr(0), Arg::Ptr(0), Arg::I32(0)];
        ctx.launch_named("ds4_moe_combine", grid, 256, 0, &[&args[..], &alone].concat()).expect("ds4_moe_combine");
        ctx.sync().expect("ds4_moe_combine");
        let got: Vec<f32> = out.read(0, n * d).expect("read");
        // The same float operations in the same order: bitwise.
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{what}: combine out[{}, {}]: got {a}, want {b}", i / d, i % d);
        }

        // Fused with the FFN site's hyper-connection expansion: bitwise ds4_hc_post of x with
        // the combined output.
        let hc = 4;
        let x = rng.f32s(n * hc * d);
        let mix = rng.f32s(n * (hc + hc * hc));
        let (xa, xb, mb) = (
            DevBuf::from_slice(&x).expect("x"),
            DevBuf::from_slice(&x).expect("x"),
            DevBuf::from_slice(&mix).expect("mix"),
        );
        let post =
            [Arg::Ptr(xa.at(0)), Arg::Ptr(out.at(0)), Arg::Ptr(mb.at(0)), Arg::I32(hc as i32), Arg::I32(d as i32)];
        ctx.launch_named("ds4_hc_post", grid, 256, 0, &post).expect("ds4_hc_post");
        let fused = [Arg::Ptr(xb.at(0)), Arg::Ptr(mb.at(0)), Arg::I32(hc as i32)];
        ctx.launch_named("ds4_moe_combine", grid, 256, 0, &[&args[..], &fused].concat())
            .expect("fused ds4_moe_combine");
        ctx.sync().expect("ds4_moe_combine with ds4_hc_post");
        let (want_x, got_x): (Vec<f32>, Vec<f32>) = (xa.read(0, x.len()).expect("x"), xb.read(0, x.len()).expect("x"));
        assert_ne!(want_x, x, "{what}: ds4_hc_post changed nothing");
        for (i, (a, b)) in got_x.iter().zip(&want_x).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{what}: fused expansion x[{i}]: got {a}, want {b}");
        }
    }
}

// ---- the whole routed-expert path

/// A layer's MoE weights in a file-like image (Q8_0 experts, an F32 router).
struct MoeLayer {
    raw: Vec<u8>,
    cfg: ModelConfig,
    spec: LayerSpec,
    lw: LayerWeights,
    /// Every tensor of `raw` with the rows of its planes (for the split device layout).
    tensors: Vec<(Mat, usize)>,
}

/// Random weights: rows uniform in ±3/sqrt(n_in), so that every product is of order 1.
fn build_layer(rng: &mut Rng, hash: bool, n_exp: usize, k: usize, d: usize, ff: usize) -> MoeLayer {
    let mut raw = vec![0u8; 256];
    let mut tensors = Vec::new();
    let mut add = |ty: GgmlType, n_in: usize, n_out: usize, plane: usize, rng: &mut Rng| -> Mat {
        let start = raw.len().next_multiple_of(256);
        raw.resize(start, 0);
        let a = 3.0 / (n_in as f32).sqrt();
        let floats: Vec<f32> = rng.f32s(n_in * n_out).iter().map(|v| v * a).collect();
        let row_bytes = ty.row_bytes(n_in as u64).expect("row bytes") as usize;
        match ty {
            GgmlType::F32 => raw.extend(floats.iter().flat_map(|v| v.to_le_bytes())),
            GgmlType::Q8_0 => {
                let mut m = vec![0u8; n_out * row_bytes];
                quant::quantize_q8_0(&floats, &mut m).expect("quantize");
                raw.extend_from_slice(&m);
            }
            _ => unreachable!(),
        }
        tensors.push((Mat { ty, n_in, n_out, start, row_bytes }, plane));
        Mat { ty, n_in, n_out, start, row_bytes }
    };
    let router_proj = add(GgmlType::F32, d, n_exp, n_exp, rng);
    let mut stack = |n_in: usize, n_out: usize, rng: &mut Rng| {
        // One tensor: n_exp whole matrices back to back, a plane each.
        let first = add(GgmlType::Q8_0, n_in, n_out * n_exp, n_out, rng);
        Stack { first: Mat { n_out, ..first }, n_exp }
    };
    let exps = [stack(d, ff, rng), stack(d, ff, rng), stack(ff, d, rng)];
    let sh =
        [add(GgmlType::Q8_0, d, ff, ff, rng), add(GgmlType::Q8_0, d, ff, ff, rng), add(GgmlType::Q8_0, ff, d, d, rng)];
    let cfg = config(n_exp, k, d, ff, true, 1.5);
    let r = router(rng, hash, cfg.vocab, k, n_exp);
    let lw = layer_weights(router_proj, r, exps, sh);
    MoeLayer { raw, cfg, spec: layer_spec(hash), lw, tensors }
}

/// The MoE output of the rows `h` on the device: every step queued on the stream in the
/// order of the decode (router product, route, gather, gate/up, SwiGLU, down, combine; the
/// shared expert before the routed ones). Returns the output and the router logits.
fn moe_on_device(ctx: &Context, l: &MoeLayer, img: &DevBuf, h: &[f32], tokens: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let (cfg, lw) = (&l.cfg, &l.lw);
    let (n, d, n_exp, k, ff) = (tokens.len(), cfg.hidden, cfg.n_experts, cfg.n_experts_used, cfg.expert_ff);
    let mut keep: Vec<DevBuf> = Vec::new();
    let counters = DevBuf::zeroed(4 * COUNTERS).expect("counters");
    let hb = DevBuf::from_slice(h).expect("h");
    let st = step(ctx, 0, tokens);

    // Router product.
    let rp = &lw.router_proj;
    let logits = f32s(n * n_exp);
    let rpart = f32s(slices(rp) * n * rp.n_out);
    let (desc, blocks) = product(img, rp, hb.at(0), logits.at(0), rpart.at(0), n, 0);
    let table = DevBuf::from_slice(&[desc]).expect("table");
    launch_products(ctx, rp, n, table.at(0), 1, blocks, &counters);
    keep.extend([rpart, table]);

    // Shared expert: gate and up in one launch, SwiGLU, down.
    let (gs, us, ds) = (&lw.gate_sh, &lw.up_sh, &lw.down_sh);
    let (g_out, u_out, act_sh, sh_out) = (f32s(n * gs.n_out), f32s(n * us.n_out), f32s(n * gs.n_out), f32s(n * d));
    let (pg, pu, pd) = (f32s(slices(gs) * n * gs.n_out), f32s(slices(us) * n * us.n_out), f32s(slices(ds) * n * d));
    let (dg, bg) = product(img, gs, hb.at(0), g_out.at(0), pg.at(0), n, 0);
    let (mut du, bu) = product(img, us, hb.at(0), u_out.at(0), pu.at(0), n, row_blocks(gs));
    du.block_start = bg as i32;
    let table = DevBuf::from_slice(&[dg, du]).expect("table");
    launch_products(ctx, gs, n, table.at(0), 2, bg + bu, &counters);
    swiglu(ctx, &g_out, &u_out, &act_sh, n * gs.n_out, l.spec.clamp_shared);
    let (dd, bd) = product(img, ds, act_sh.at(0), sh_out.at(0), pd.at(0), n, 0);
    let table2 = DevBuf::from_slice(&[dd]).expect("table");
    launch_products(ctx, ds, n, table2.at(0), 1, bd, &counters);
    keep.extend([g_out, u_out, act_sh, pg, pu, pd, table, table2]);

    // Routed experts. Templates: expert 0's matrices, the gathered buffers, distinct
    // partial-sum areas and counters for gate and up (they run in one launch).
    let route = RouteBufs::new(n, k, n_exp);
    let md = route.max_descs;
    let (gate, up, down) = (lw.gate_exps.first, lw.up_exps.first, lw.down_exps.first);
    let (sg, su, sd) = (slices(&gate), slices(&up), slices(&down));
    let rows = n * k;
    let (xg, gout, uout, act, dout) =
        (f32s(rows * d), f32s(rows * ff), f32s(rows * ff), f32s(rows * ff), f32s(rows * d));
    let (part_g, part_u, part_d) = (f32s(md * sg * n * ff), f32s(md * su * n * ff), f32s(md * sd * n * d));
    let c_gate = 64;
    let c_up = c_gate + md * row_blocks(&gate);
    let c_down = c_up + md * row_blocks(&up);
    assert!(c_down + md * row_blocks(&down) <= COUNTERS, "counters");
    let templ = [
        product(img, &gate, xg.at(0), gout.at(0), part_g.at(0), 0, c_gate).0,
        product(img, &up, xg.at(0), uout.at(0), part_u.at(0), 0, c_up).0,
        product(img, &down, act.at(0), dout.at(0), part_d.at(0), 0, c_down).0,
    ];
    let templ_buf = DevBuf::from_slice(&templ).expect("templates");
    let pick = super::program::split_over_blocks(true, n);
    launch_route(ctx, cfg, &lw.router, &logits, n, &st, &templ_buf, &route, &mut keep, pick);
    let args =
        [Arg::Ptr(hb.at(0)), Arg::Ptr(xg.at(0)), Arg::Ptr(route.gather_src.at(0)), Arg::I32(d as i32), Arg::I32(0)];
    ctx.launch_named("ds4_gather", (rows as u32, 1, 1), 256, 0, &args).expect("ds4_gather");
    let bpd = |m: &Mat, s: usize| row_blocks(m) * s;
    launch_products(ctx, &gate, n, route.gu.at(0), 2 * md, md * (bpd(&gate, sg) + bpd(&up, su)), &counters);
    swiglu(ctx, &gout, &uout, &act, rows * ff, l.spec.clamp_routed);
    launch_products(ctx, &down, n, route.down.at(0), md, md * bpd(&down, sd), &counters);
    let out = f32s(n * d);
    let args = [
        Arg::Ptr(dout.at(0)),
        Arg::Ptr(route.comb_slot.at(0)),
        Arg::Ptr(route.comb_w.at(0)),
        Arg::Ptr(route.comb_cnt.at(0)),
        Arg::Ptr(sh_out.at(0)),
        Arg::Ptr(out.at(0)),
        Arg::I32(k as i32),
        Arg::I32(d as i32),
        Arg::Ptr(0),
        Arg::Ptr(0),
        Arg::I32(0),
    ];
    ctx.launch_named("ds4_moe_combine", (d.div_ceil(256) as u32, n as u32, 1), 256, 0, &args).expect("ds4_moe_combine");
    ctx.sync().expect("running the MoE kernels");
    // Every product re-armed the counters it used (unused slots touch none).
    let c: Vec<i32> = counters.read_all().expect("counters");
    assert!(c.iter().all(|&v| v == 0), "counters left non-zero at {:?}", c.iter().position(|&v| v != 0));
    let result = (out.read(0, n * d).expect("out"), logits.read(0, n * n_exp).expect("logits"));
    drop(keep);
    result
}

#[test]
fn routed_experts_match_cpu_and_are_row_invariant() {
    let Some(ctx) = context() else { return };
    match ctx.function("ds4_swiglu") {
        Ok(_) => eprintln!("SwiGLU: ds4_swiglu on the device"),
        Err(_) => eprintln!("SwiGLU: on the host (no ds4_swiglu in the program yet)"),
    }
    let mut rng = Rng(0x5eed_0003);
    // d = 2048: the gate/up products split their input in 2 slices (partial sums, counters);
    // the F32 router in 8.
    let (n_exp, k, d, ff) = (32, 6, 2048, 256);
    for hash in [false, true] {
        let l = build_layer(&mut rng, hash, n_exp, k, d, ff);
        let img = DevBuf::from_slice(&split_image(&l.raw, &l.tensors)).expect("image");
        let ops = Ops { raw: &l.raw, backend: &Cpu };
        let mut batch16 = None;
        for n in [1usize, 3, 16] {
            let what = format!("hash={hash} n={n}");
            let h = rng.f32s(n * d);
            let tokens: Vec<u32> =
                (0..n).map(|r| if r % 5 == 4 { 3 } else { (rng.next_u64() % l.cfg.vocab as u64) as u32 }).collect();
            let want = moe::forward(ops, &l.cfg, &l.spec, &l.lw, &h, &tokens).expect("moe::forward");
            let (got, logits) = moe_on_device(&ctx, &l, &img, &h, &tokens);
            let want_logits = cpu::matmul_many_new(&l.raw, &[(&l.lw.router_proj, &h[..])]).expect("router")[0].clone();
            assert_close(&format!("{what}: router logits"), &logits, &want_logits, 1e-4);
            // The device picks the experts from its own logits: the same as the CPU's unless
            // two biased scores are within rounding of each other.
            for r in 0..n {
                let dev = moe::route(&l.cfg, &l.lw, &logits[r * n_exp..(r + 1) * n_exp], tokens[r]).0;
                let cpu = moe::route(&l.cfg, &l.lw, &want_logits[r * n_exp..(r + 1) * n_exp], tokens[r]).0;
                assert_eq!(dev, cpu, "{what}: row {r}: the experts of the device logits differ from the CPU's");
            }
            let mag = want.iter().fold(0f32, |a, &v| a.max(v.abs()));
            assert!(mag > 0.1, "{what}: the reference output is too small to compare ({mag})");
            assert_close(&format!("{what}: MoE output"), &got, &want, 1e-4);
            if n == 16 {
                batch16 = Some((h, tokens, got));
            }
        }
        // Row invariance: each row alone gives bitwise the same output row as in the batch.
        let (h, tokens, batch) = batch16.expect("the 16-row batch ran");
        for r in 0..tokens.len() {
            let (alone, _) = moe_on_device(&ctx, &l, &img, &h[r * d..(r + 1) * d], &tokens[r..r + 1]);
            for (i, (a, b)) in alone.iter().zip(&batch[r * d..(r + 1) * d]).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "hash={hash}: row {r} alone differs from the batch at {i}: {a} vs {b}"
                );
            }
        }
    }
}

/// ds4_swiglu's 8-bit activations (the routed Q2_K down products' input): each row's slot holds
/// exactly the bytes `act8::quantize_row` makes of the kernel's own float output, and the
/// float output equals the host's SwiGLU to rounding (the device's expf).
#[test]
fn swiglu_writes_8_bit_activations_of_its_rows() {
    let Some(ctx) = context() else { return };
    let mut rng = Rng(0x5eed_0a08);
    let (rows, width, clamp) = (5usize, 512usize, 7.0f32);
    let mut g = rng.f32s(rows * width);
    let u = rng.f32s(rows * width);
    g.iter_mut().for_each(|v| *v *= 12.0); // some values past the clamp
    g[3 * width..3 * width + 32].fill(0.0); // a zero block (scale 0)
    let (gb, ub) = (DevBuf::from_slice(&g).expect("g"), DevBuf::from_slice(&u).expect("u"));
    let (plain, quant) = (f32s(rows * width), f32s(rows * width));
    for (out, act8) in [(&plain, 0), (&quant, 1)] {
        let args = [
            Arg::Ptr(gb.at(0)),
            Arg::Ptr(ub.at(0)),
            Arg::Ptr(out.at(0)),
            Arg::I32((rows * width) as i32),
            Arg::F32(clamp),
            Arg::I32(width as i32),
            Arg::I32(act8),
        ];
        ctx.launch_named("ds4_swiglu", ((rows * width).div_ceil(256) as u32, 1, 1), 256, 0, &args).expect("ds4_swiglu");
    }
    ctx.sync().expect("sync");
    let plain: Vec<f32> = plain.read_all().expect("plain");
    let quant: Vec<f32> = quant.read_all().expect("quant");
    assert_close("swiglu", &plain, &swiglu_host(&g, &u, clamp), 1e-6);
    let bytes = crate::quant::act8::bytes(width);
    for r in 0..rows {
        let mut want = vec![0u8; bytes];
        crate::quant::act8::quantize_row(&plain[r * width..(r + 1) * width], &mut want).expect("act8");
        let got: Vec<u8> = quant[r * width..(r + 1) * width].iter().flat_map(|v| v.to_ne_bytes()).collect();
        assert_eq!(&got[..bytes], &want[..], "row {r}: 8-bit activations differ from act8::quantize_row");
    }
}

/// The prompts' wide kernels (`DS4_CUDA_WIDE=1`: ds4_gather4 and ds4_swiglu4, four values a
/// thread) write what the plain ones write, bit for bit: gathered rows as 8-bit activations
/// (the host's bytes, `act8_image`; an unused slot untouched), whatever the split of a row
/// between blocks, and SwiGLUs as floats and as 8-bit activations, with an all-zero block of
/// 32, an outlier, clamped values, a NaN, and counts that leave warps and groups of eight
/// lanes past the end.
#[test]
fn wide_gather_and_swiglu_match_the_plain_kernels() {
    let Some(ctx) = context() else { return };
    let mut rng = Rng(0x5eed_0009);
    for (n, k, d) in [(3usize, 6usize, 1024usize), (5, 2, 96), (2, 8, 4096)] {
        let mut h = rng.f32s(n * d);
        h[32..64].fill(0.0);
        h[70] = 40.0;
        let src: Vec<i32> =
            (0..n * k).map(|j| if j + 1 < n * k { (rng.next_u64() % n as u64) as i32 } else { -1 }).collect();
        let hb = DevBuf::from_slice(&h).expect("h");
        let sb = DevBuf::from_slice(&src).expect("gather_src");
        for parts in [d.div_ceil(1024), 3] {
            let what = format!("gather n={n} k={k} d={d} parts={parts}");
            let xg = DevBuf::from_slice(&vec![7.0f32; n * k * d]).expect("xg");
            let args = [Arg::Ptr(hb.at(0)), Arg::Ptr(xg.at(0)), Arg::Ptr(sb.at(0)), Arg::I32(d as i32)];
            ctx.launch_named("ds4_gather4", ((n * k) as u32, parts as u32, 1), 256, 0, &args).expect("ds4_gather4");
            ctx.sync().expect("ds4_gather4");
            let got: Vec<u32> = xg.read::<f32>(0, n * k * d).expect("read").iter().map(|v| v.to_bits()).collect();
            for (j, &s) in src.iter().enumerate() {
                let row = &got[j * d..(j + 1) * d];
                let want = if s < 0 { vec![7.0f32.to_bits(); d] } else { act8_image(&h[s as usize * d..][..d]) };
                assert!(row == &want[..], "{what}: slot {j} (source {s})");
            }
        }
    }
    for (count, width, act8) in [(12 * 2048usize, 2048usize, 1i32), (5 * 96, 96, 1), (1000, 1000, 0), (4 * 36, 36, 0)] {
        let what = format!("swiglu count={count} width={width} act8={act8}");
        let mut g: Vec<f32> = rng.f32s(count).iter().map(|v| 8.0 * v).collect();
        let mut u: Vec<f32> = rng.f32s(count).iter().map(|v| 8.0 * v).collect();
        g[64..96].fill(-1e30); // silu(-1e30) is -0: an all-zero block
        (g[100], u[100]) = (50.0, 50.0); // an outlier in its block (the clamp is 60)
        (g[101], u[102]) = (100.0, -100.0); // clamped
        u[130] = f32::NAN; // a block with a NaN (through u: min(NaN, c) is c): bytes 0, a NaN scale
        let (gb, ub) = (DevBuf::from_slice(&g).expect("g"), DevBuf::from_slice(&u).expect("u"));
        let run = |name: &str, per: usize| -> Vec<u32> {
            let out = DevBuf::from_slice(&vec![7.0f32; count]).expect("out");
            let args = [
                Arg::Ptr(gb.at(0)),
                Arg::Ptr(ub.at(0)),
                Arg::Ptr(out.at(0)),
                Arg::I32(count as i32),
                Arg::F32(60.0),
                Arg::I32(width as i32),
                Arg::I32(act8),
            ];
            ctx.launch_named(name, (count.div_ceil(per) as u32, 1, 1), 256, 0, &args).expect(name);
            ctx.sync().expect(name);
            out.read::<f32>(0, count).expect("read").iter().map(|v| v.to_bits()).collect()
        };
        let (plain, wide) = (run("ds4_swiglu", 256), run("ds4_swiglu4", 1024));
        if let Some(i) = plain.iter().zip(&wide).position(|(a, b)| a != b) {
            panic!("{what}: word {i} differs: {:#x} against {:#x}", wide[i], plain[i]);
        }
    }
}
