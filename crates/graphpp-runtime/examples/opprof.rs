//! Where a stage's forward + full backward spends its time, by op and shape, on the compiled
//! executor: one stage holding every layer of a Llama preset, `--threads` intra-op threads (a rank
//! pool of that size, as `graphpp train --threads-per-rank` runs a rank), `--runs` timed runs
//! after two warm-up runs (per-node wall times, `RunOptions::time_nodes`). A fused group's time is
//! its anchor's, listed under the anchor's op (e.g. `fw Unary Exp [8, 4, 64, 64]` is softmax's
//! fused exponent with the scale, mask and max subtraction before it).
//!
//! Run: `cargo run --release -p graphpp-runtime --example opprof -- [--model tiny|small]
//! [--dtype f32|bf16] [--batch 8] [--seq-len 64] [--threads 1] [--runs 10] [--top 30]`

mod common;

/// The allocator the `graphpp` binary runs on (`graphpp_runtime::malloc` says why).
#[global_allocator]
static ALLOCATOR: graphpp_runtime::malloc::MiMalloc = graphpp_runtime::malloc::MiMalloc;

use graphpp_graph::{Graph, Op};
use graphpp_models::{LlamaConfig, StageOptions};
use graphpp_runtime::exec::RunOptions;
use graphpp_runtime::Program;
use std::collections::HashMap;

/// The row a node's time is added to: its op, with the input shapes of a matmul or reduction and
/// the output shape of an elementwise anchor.
fn row(g: &Graph, i: usize) -> String {
    let n = &g.nodes[i];
    let dims = |v: graphpp_graph::ValueId| format!("{:?}", g.nodes[v.0].ty.shape);
    match &n.op {
        Op::Matmul => format!("Matmul {} x {}", dims(n.inputs[0]), dims(n.inputs[1])),
        Op::Sum { axis, .. } => format!("Sum axis {axis} {}", dims(n.inputs[0])),
        Op::Max { axis, .. } => format!("Max axis {axis} {}", dims(n.inputs[0])),
        Op::Softmax { axis, .. } => format!("Softmax axis {axis} {}", dims(n.inputs[0])),
        Op::SoftmaxBackward { axis, .. } => format!("SoftmaxBackward axis {axis} {}", dims(n.inputs[0])),
        Op::Attention { .. } => format!("Attention {}", dims(n.inputs[0])),
        Op::AttentionBackward { .. } => format!("AttentionBackward {}", dims(n.inputs[0])),
        Op::RotateHalf => format!("RotateHalf {:?}", n.ty.shape),
        Op::LogSoftmax { axis } => format!("LogSoftmax axis {axis} {}", dims(n.inputs[0])),
        Op::LogSoftmaxBackward { axis } => format!("LogSoftmaxBackward axis {axis} {}", dims(n.inputs[0])),
        Op::Unary { f } => format!("Unary {f:?} {:?}", n.ty.shape),
        Op::Binary { f } => format!("Binary {f:?} {:?}", n.ty.shape),
        Op::Affine { .. } => format!("Affine {:?}", n.ty.shape),
        Op::Cast { dtype } => format!("Cast to {} {:?}", dtype.name(), n.ty.shape),
        Op::Reshape { .. } => {
            format!("Reshape {} to {:?} ({})", dims(n.inputs[0]), n.ty.shape, n.ty.dtype.name())
        }
        op => format!("{op:?}").split([' ', '{', '(']).next().unwrap_or("?").to_string(),
    }
}

fn main() {
    const USAGE: &str =
        "opprof [--model tiny|small] [--dtype f32|bf16] [--batch 8] [--seq-len 64] [--recompute pointwise] [--threads 1] [--runs 10] [--top 30]";
    let a = common::Flags::parse(
        USAGE,
        &[
            ("model", "tiny"),
            ("dtype", "f32"),
            ("batch", "8"),
            ("seq-len", "64"),
            ("recompute", "pointwise"),
            ("threads", "1"),
            ("runs", "10"),
            ("top", "30"),
        ],
    );
    let num = |k: &str| a.num(k);
    let model = a.text("model");
    if LlamaConfig::preset(model).is_err() {
        a.bad(format!("--model {model}: opprof runs the dense presets, tiny and small"));
    }
    let recompute = a.recompute("recompute");
    // As `graphpp train --threads-per-rank N` (graphpp::cmd::set_op_threads).
    let threads = num("threads");
    std::env::set_var("CANDLE_NUM_THREADS", "1");
    graphpp_runtime::malloc::retain_freed_memory();
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    let cfg = LlamaConfig::preset(model).expect("--model tiny or small");
    let opts = StageOptions::mixed(num("batch"), num("seq-len"), a.dtype("dtype"));
    let (sg, env) = common::whole_model_stage(&cfg, &opts, recompute);
    let runs = num("runs");
    let pool = graphpp_runtime::kernels::threads::rank_pool(0, threads).expect("thread pool");
    graphpp_runtime::kernels::threads::install_hot(&pool, true, || {
        let (pf, pb) = (Program::compile(&sg.fw), Program::compile(&sg.full_bw));
        let o = RunOptions { time_nodes: true, trace_peak: false };
        let mut rows: HashMap<String, (f64, usize)> = HashMap::new();
        let mut total = 0.0;
        for i in 0..runs + 2 {
            let t0 = std::time::Instant::now();
            let f = pf.run_named_with(&sg.fw, &env, &o, None).expect("fw runs");
            let mut e = env.clone();
            e.extend(sg.fw.output_names().into_iter().zip(f.outputs));
            let b = pb.run_named_with(&sg.full_bw, &e, &o, None).expect("full_bw runs");
            if i < 2 {
                continue;
            }
            total += t0.elapsed().as_secs_f64() * 1e3;
            for (g, times, tag) in [(&sg.fw, f.node_times, "fw"), (&sg.full_bw, b.node_times, "bw")] {
                for (n, t) in times.unwrap_or_default().iter().enumerate().filter(|(_, t)| !t.is_zero()) {
                    let r = rows.entry(format!("{tag} {}", row(g, n))).or_default();
                    r.0 += t.as_secs_f64() * 1e3;
                    r.1 += 1;
                }
            }
        }
        let mut rows: Vec<_> = rows.into_iter().collect();
        rows.sort_by(|x, y| y.1 .0.total_cmp(&x.1 .0));
        println!(
            "{} B={} T={} fw+full_bw, compiled, recompute {recompute}, {threads} thread(s): {:.2} ms a run (mean of {runs}, node timing on)",
            model,
            opts.batch,
            opts.seq,
            total / runs as f64
        );
        let matmul: f64 =
            rows.iter().filter(|(name, _)| name.contains(" Matmul ")).map(|(_, (ms, _))| ms).sum();
        let all: f64 = rows.iter().map(|(_, (ms, _))| ms).sum();
        println!(
            "matmuls {:.2} ms a run, everything else {:.2} (the nodes' own times)",
            matmul / runs as f64,
            (all - matmul) / runs as f64
        );
        println!("{:>9} {:>6}  op", "ms/run", "nodes");
        for (name, (ms, count)) in rows.iter().take(num("top")) {
            println!("{:>9.3} {:>6}  {name}", ms / runs as f64, count / runs);
        }
    });
}
