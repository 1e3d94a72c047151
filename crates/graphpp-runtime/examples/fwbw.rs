//! One forward + full backward of a Llama preset on one stage (all layers, B=2, T=64, f32):
//! the interpreter, the compiled executor and — given `--torch PYTHON` — PyTorch eager
//! (`tools/torch/time_fwbw.py`, same shapes), alternating in rounds in one run, each on
//! `--threads N` intra-op threads (graphpp in a rank pool of N, as `graphpp train` runs a rank).
//! Prints each one's median and the ratios. Issue 11's benchmark of the compiled executor.
//!
//! Run: `cargo run --release -p graphpp-runtime --example fwbw -- [--model small|tiny]
//! [--threads N] [--rounds R] [--runs K] [--torch /path/to/python]`

use candle_core::Tensor;
use graphpp_graph::{stage_graphs, DType, Graph, RecomputePolicy};
use graphpp_models::rng::Rng;
use graphpp_models::{build_stage, init_parameters, split_layers, stage_buffers, LlamaConfig, StageOptions};
use graphpp_runtime::executor::{run_named, tensor_from_f64, tensor_u32, RunOptions};
use graphpp_runtime::Program;
use std::collections::HashMap;
use std::time::Instant;

type Env = HashMap<String, Tensor>;

struct Args {
    model: String,
    threads: usize,
    rounds: usize,
    runs: usize,
    torch: Option<String>,
}

fn args() -> Args {
    let mut a = Args { model: "small".into(), threads: 1, rounds: 3, runs: 10, torch: None };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--model" => a.model = v,
            "--threads" => a.threads = v.parse().expect("--threads N"),
            "--rounds" => a.rounds = v.parse().expect("--rounds R"),
            "--runs" => a.runs = v.parse().expect("--runs K"),
            "--torch" => a.torch = Some(v),
            _ => panic!("unknown flag {k}"),
        }
    }
    a
}

/// Milliseconds of one fw + full_bw, median over `runs` after 2 warm-up runs.
fn time_graphpp(fw: &Graph, bw: &Graph, env: &Env, runs: usize, compiled: bool) -> f64 {
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
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    median(times)
}

/// PyTorch's median, parsed from `time_fwbw.py`'s line (`… median X ms …`).
fn time_torch(python: &str, a: &Args) -> f64 {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tools/torch/time_fwbw.py");
    let out = std::process::Command::new(python)
        .args([
            script,
            "--model",
            &a.model,
            "--runs",
            &a.runs.to_string(),
            "--threads",
            &a.threads.to_string(),
        ])
        .output()
        .expect("runs python");
    let text = String::from_utf8_lossy(&out.stdout);
    let ms = text.split("median ").nth(1).and_then(|r| r.split(' ').next()).and_then(|x| x.parse().ok());
    ms.unwrap_or_else(|| {
        panic!("no median in torch's output: {text}{}", String::from_utf8_lossy(&out.stderr))
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let a = args();
    // As `graphpp train --threads-per-rank N` (graphpp::cmd::set_op_threads), before any tensor op.
    std::env::set_var("RAYON_NUM_THREADS", a.threads.to_string());
    std::env::set_var("CANDLE_NUM_THREADS", "1");
    let cfg = LlamaConfig::preset(&a.model).expect("--model tiny or small");
    let opts = StageOptions::new(2, 64);
    let spec = split_layers(cfg.num_hidden_layers, 1, None).unwrap().remove(0);
    let sg = stage_graphs(&build_stage(&cfg, &spec, &opts).unwrap(), &RecomputePolicy::SaveAll).unwrap();
    let mut env = Env::new();
    for (name, shape, data) in init_parameters(&cfg, &spec, 0) {
        env.insert(name, Tensor::from_vec(data, shape, &candle_core::Device::Cpu).unwrap());
    }
    for (name, shape, data) in stage_buffers(&cfg, opts.seq) {
        env.insert(name, tensor_from_f64(&data, &shape, DType::F32).unwrap());
    }
    let mut rng = Rng::new(1);
    for name in ["tokens", "targets"] {
        let ids: Vec<u32> =
            (0..opts.batch * opts.seq).map(|_| rng.below(cfg.vocab_size as u64) as u32).collect();
        env.insert(name.into(), tensor_u32(&ids, &[opts.batch, opts.seq]).unwrap());
    }
    let pool = graphpp_runtime::threads::rank_pool(0, a.threads).expect("thread pool");
    let (mut interp, mut compiled, mut torch) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..a.rounds {
        let i = pool.install(|| time_graphpp(&sg.fw, &sg.full_bw, &env, a.runs, false));
        let c = pool.install(|| time_graphpp(&sg.fw, &sg.full_bw, &env, a.runs, true));
        let t = a.torch.as_deref().map(|py| time_torch(py, &a));
        let tt = t.map_or(String::new(), |t| format!(", torch eager {t:.1} ms"));
        println!("round {round}: interpreted {i:.1} ms, compiled {c:.1} ms{tt}");
        interp.push(i);
        compiled.push(c);
        torch.extend(t);
    }
    let (i, c) = (median(interp), median(compiled));
    print!("{} fw+full_bw B=2 T=64, {} thread(s), median of {} rounds: interpreted {i:.1} ms, compiled {c:.1} ms ({:.2}x)", a.model, a.threads, a.rounds, c / i);
    if !torch.is_empty() {
        let t = median(torch);
        print!(", torch eager {t:.1} ms; compiled / torch = {:.2}", c / t);
    }
    println!();
}
