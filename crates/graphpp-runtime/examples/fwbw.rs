//! One forward + full backward of a Llama preset on one stage (all layers, B=`--batch`, T=64, in
//! f32 or in bf16 mixed precision from f32 master weights, `--dtype`):
//! the interpreter, the compiled executor and — given `--torch PYTHON` — PyTorch eager and
//! `torch.compile` in the same dtype (`tools/torch/time_fwbw.py`, same shapes, the model as
//! PyTorch users write it; bf16 under autocast), alternating in rounds in one run, each on every
//! intra-op thread count of `--threads` (graphpp in a rank pool of that size, as `graphpp train`
//! runs a rank). Prints each one's median over the rounds (each round's figure is the median of
//! `--runs` runs) and the ratios.
//!
//! With `--device cuda` (a build with `--features cuda`) the graph runs on the GPU through
//! candle's kernels (the interpreter: a compiled program runs off-CPU tensors that way) and
//! PyTorch on the same GPU; each figure is then synchronized with the device, and the achieved
//! TFLOP/s (the graphs' matmul FLOPs over the time) is printed. `--config FILE` takes a Hugging
//! Face Llama `config.json` instead of a preset (e.g. a ~1B model on a GPU).
//!
//! Run: `cargo run --release -p graphpp-runtime --example fwbw -- [--model small|tiny]
//! [--config FILE] [--dtype f32|bf16] [--batch 2] [--seq 64] [--device cpu|cuda] [--threads 1,2]
//! [--rounds R] [--runs K] [--torch /path/to/python]`

mod common;

/// The allocator the `graphpp` binary runs on (`graphpp_runtime::malloc` says why).
#[global_allocator]
static ALLOCATOR: graphpp_runtime::malloc::MiMalloc = graphpp_runtime::malloc::MiMalloc;

use common::Env;
use graphpp_graph::Graph;
use graphpp_models::{LlamaConfig, StageOptions};
use graphpp_runtime::exec::{run_named, RunOptions};
use graphpp_runtime::kernels::device::DeviceSpec;
use graphpp_runtime::Program;
use std::time::Instant;

struct Args {
    /// The preset's name, or the config file's path.
    model: String,
    cfg: LlamaConfig,
    seq: usize,
    device: DeviceSpec,
    dtype: graphpp_graph::DType,
    batch: usize,
    recompute: graphpp_models::Recompute,
    threads: Vec<usize>,
    rounds: usize,
    runs: usize,
    torch: Option<String>,
}

const USAGE: &str =
    "fwbw [--model small|tiny] [--config FILE] [--dtype f32|bf16] [--batch 2] [--seq 64] [--device cpu|cuda] [--recompute pointwise] [--threads 1,2] [--rounds 3] [--runs 10] [--torch PYTHON]";

fn args() -> Args {
    let f = common::Flags::parse(
        USAGE,
        &[
            ("model", "small"),
            ("config", ""),
            ("dtype", "f32"),
            ("seq", "64"),
            ("device", "cpu"),
            ("batch", "2"),
            ("recompute", "pointwise"),
            ("threads", "1,2"),
            ("rounds", "3"),
            ("runs", "10"),
            ("torch", ""),
        ],
    );
    let (model, cfg) = match f.text("config") {
        "" => {
            let model = f.text("model").to_string();
            let cfg = LlamaConfig::preset(&model).unwrap_or_else(|e| f.bad(format!("--model {model}: {e}")));
            (model, cfg)
        }
        path => {
            let text =
                std::fs::read_to_string(path).unwrap_or_else(|e| f.bad(format!("--config {path}: {e}")));
            let cfg =
                LlamaConfig::from_json(&text).unwrap_or_else(|e| f.bad(format!("--config {path}: {e}")));
            (path.to_string(), cfg)
        }
    };
    Args {
        cfg,
        seq: f.num("seq"),
        device: f.text("device").parse().unwrap_or_else(|e| f.bad(format!("--device: {e}"))),
        dtype: f.dtype("dtype"),
        batch: f.num("batch"),
        threads: f.text("threads").split(',').map(|n| f.positive("threads", n)).collect(),
        rounds: f.num("rounds"),
        runs: f.num("runs"),
        torch: Some(f.text("torch").to_string()).filter(|p| !p.is_empty()),
        recompute: f.recompute("recompute"),
        model,
    }
}

/// Milliseconds of one fw + full_bw, median over `runs` after 2 warm-up runs, each run ended
/// by a synchronization with the inputs' device (a GPU's kernels run asynchronously).
fn time_graphpp(fw: &Graph, bw: &Graph, env: &Env, runs: usize, compiled: bool) -> f64 {
    let device = env.values().next().map(|t| t.device().clone());
    let (pf, pb) = (Program::compile(fw), Program::compile(bw));
    let o = RunOptions::default();
    let run = |g: &Graph, p: &Program, e: &Env| {
        if compiled { p.run_named_with(g, e, &o, None) } else { run_named(g, e, &o) }.expect("runs")
    };
    let mut times = Vec::new();
    for i in 0..runs + 2 {
        let t0 = Instant::now();
        let f = run(fw, &pf, env);
        let mut e = env.clone();
        e.extend(fw.output_names().into_iter().zip(f.outputs));
        run(bw, &pb, &e);
        if let Some(d) = &device {
            d.synchronize().expect("device synchronizes");
        }
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    median(times)
}

/// PyTorch's median in `mode` (`eager` or `compile`), parsed from `time_fwbw.py`'s line
/// (`… median X ms …`).
fn time_torch(python: &str, a: &Args, threads: usize, mode: &str) -> f64 {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tools/torch/time_fwbw.py");
    let out = std::process::Command::new(python)
        .args([script, "--runs", &a.runs.to_string(), "--threads", &threads.to_string()])
        .args(if a.model.ends_with(".json") { ["--config", &a.model] } else { ["--model", &a.model] })
        .args(["--dtype", a.dtype.name(), "--batch", &a.batch.to_string(), "--mode", mode])
        .args(["--seq", &a.seq.to_string(), "--device", &a.device.to_string()])
        .output()
        .unwrap_or_else(|e| {
            eprintln!("error: cannot run {python}: {e}");
            std::process::exit(1)
        });
    let text = String::from_utf8_lossy(&out.stdout);
    let ms = text.split("median ").nth(1).and_then(|r| r.split(' ').next()).and_then(|x| x.parse().ok());
    ms.unwrap_or_else(|| {
        eprintln!(
            "error: no timing from {python} {script} (does that python have torch?):\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::process::exit(1)
    })
}

/// The median (the upper one of an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let a = args();
    // As `graphpp train --threads-per-rank N` (graphpp::cmd::set_op_threads), before any tensor op.
    std::env::set_var("CANDLE_NUM_THREADS", "1");
    graphpp_runtime::malloc::retain_freed_memory();
    let opts = StageOptions::mixed(a.batch, a.seq, a.dtype);
    let (sg, env) = common::whole_model_stage(&a.cfg, &opts, a.recompute);
    if !a.device.is_cpu() {
        return on_device(&a, &sg, env);
    }
    // gemm is asked for the largest count; in a smaller pool its parts run on the pool's threads.
    let pools: Vec<_> = a
        .threads
        .iter()
        .map(|&n| graphpp_runtime::kernels::threads::rank_pool(0, n).expect("thread pool"))
        .collect();
    // Per thread count: interpreted, compiled, torch eager, torch.compile (one figure per round).
    let mut figs = vec![[Vec::new(), Vec::new(), Vec::new(), Vec::new()]; a.threads.len()];
    for round in 0..a.rounds {
        for (k, (&n, pool)) in a.threads.iter().zip(&pools).enumerate() {
            // candle reads it at every matmul: gemm is asked for this pool's size.
            std::env::set_var("RAYON_NUM_THREADS", n.to_string());
            let i = graphpp_runtime::kernels::threads::install_hot(pool, true, || {
                time_graphpp(&sg.fw, &sg.full_bw, &env, a.runs, false)
            });
            let c = graphpp_runtime::kernels::threads::install_hot(pool, true, || {
                time_graphpp(&sg.fw, &sg.full_bw, &env, a.runs, true)
            });
            let t = a.torch.as_deref().map(|py| time_torch(py, &a, n, "eager"));
            let tc = a.torch.as_deref().map(|py| time_torch(py, &a, n, "compile"));
            let tt = t.zip(tc).map_or(String::new(), |(t, tc)| {
                format!(", torch eager {t:.1} ms, torch.compile {tc:.1} ms")
            });
            println!("round {round}, {n} thread(s): interpreted {i:.1} ms, compiled {c:.1} ms{tt}");
            figs[k][0].push(i);
            figs[k][1].push(c);
            figs[k][2].extend(t);
            figs[k][3].extend(tc);
        }
    }
    // The best round beside the median: on a shared machine other load only ever slows a round.
    let mut compiled = Vec::new();
    for (&n, [i, c, t, tc]) in a.threads.iter().zip(figs) {
        let (bi, bc, bt, btc) = (best(&i), best(&c), best(&t), best(&tc));
        let (i, c) = (median(i), median(c));
        compiled.push((c, bc));
        print!("{} {} fw+full_bw B={} T={}, {n} thread(s), median (best) of {} rounds: interpreted {i:.1} ({bi:.1}) ms, compiled {c:.1} ({bc:.1}) ms, compiled / interpreted {:.2} ({:.2})", a.model, a.dtype.name(), a.batch, a.seq, a.rounds, c / i, bc / bi);
        if !t.is_empty() {
            let (t, tc) = (median(t), median(tc));
            print!(", torch eager {t:.1} ({bt:.1}) ms, compiled / torch eager {:.2} ({:.2})", c / t, bc / bt);
            print!(
                ", torch.compile {tc:.1} ({btc:.1}) ms, compiled / torch.compile {:.2} ({:.2})",
                c / tc,
                bc / btc
            );
        }
        println!();
    }
    for (k, &n) in a.threads.iter().enumerate().skip(1) {
        let ((c0, b0), (c, b)) = (compiled[0], compiled[k]);
        println!("compiled, {} → {n} threads: {:.2}x ({:.2}x best) faster", a.threads[0], c0 / c, b0 / b);
    }
}

/// `--device cuda`: graphpp (the interpreter on candle's CUDA kernels) and PyTorch eager and
/// `torch.compile` on the GPU, alternating in rounds; medians, ratios and achieved TFLOP/s.
fn on_device(a: &Args, sg: &graphpp_graph::StageGraphs, env: Env) {
    let device = a.device.open().unwrap_or_else(|e| {
        eprintln!("error: --device: {e}");
        std::process::exit(1)
    });
    let env: Env =
        env.into_iter().map(|(k, t)| (k, t.to_device(&device).expect("moves to the device"))).collect();
    let flops: u64 = [&sg.fw, &sg.full_bw]
        .iter()
        .flat_map(|g| (0..g.nodes.len()).filter_map(|i| g.node_flops(graphpp_graph::ValueId(i))))
        .sum();
    let mut figs = [Vec::new(), Vec::new(), Vec::new()];
    for round in 0..a.rounds {
        let g = time_graphpp(&sg.fw, &sg.full_bw, &env, a.runs, false);
        let t = a.torch.as_deref().map(|py| (time_torch(py, a, 0, "eager"), time_torch(py, a, 0, "compile")));
        println!(
            "round {round}, {}: graphpp {g:.2} ms{}",
            a.device,
            t.map_or(String::new(), |(t, tc)| format!(", torch eager {t:.2} ms, torch.compile {tc:.2} ms"))
        );
        figs[0].push(g);
        if let Some((t, tc)) = t {
            figs[1].push(t);
            figs[2].push(tc);
        }
    }
    let [g, t, tc] = figs;
    let g = median(g);
    print!(
        "{} {} fw+full_bw B={} T={} on {}, median of {} rounds: graphpp {g:.2} ms ({:.1} TFLOP/s)",
        a.model,
        a.dtype.name(),
        a.batch,
        a.seq,
        a.device,
        a.rounds,
        flops as f64 / g / 1e9
    );
    if !t.is_empty() {
        let (t, tc) = (median(t), median(tc));
        print!(", torch eager {t:.2} ms, torch.compile {tc:.2} ms, graphpp / torch.compile {:.2}", g / tc);
    }
    println!();
}

fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}
