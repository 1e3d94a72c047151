//! The blocked attention kernels (`graphpp_runtime::kernels::attention`) beside the composition they
//! replace (`q kᵀ`, softmax, `P v`, and its backward), on the same causal inputs, alternating in
//! one run: median milliseconds of each and the ratio. The composition's backward computes its
//! probabilities first (the kernel recomputes them too; a graph of the composition saved them
//! from the forward instead, `H·T²` values per sequence).
//!
//! `--kv-heads KV` (default: `--heads`) gives k and v KV heads (grouped-query attention; KV
//! divides the heads).
//!
//! `cargo run --release -p graphpp-runtime --example attnbench -- --seq-len 512`

#[allow(dead_code)] // only the flags: no stage graphs here
mod common;

/// The allocator the `graphpp` binary runs on (`graphpp_runtime::malloc` says why).
#[global_allocator]
static ALLOCATOR: graphpp_runtime::malloc::MiMalloc = graphpp_runtime::malloc::MiMalloc;

use candle_core::{Device, Tensor};
use graphpp_runtime::kernels::attention::{attention, attention_backward, composition, composition_backward};
use std::collections::HashMap;
use std::time::Instant;

const USAGE: &str =
    "attnbench [--batch 1] [--heads 8] [--kv-heads H] [--seq-len 512] [--head-dim 32] [--threads 1] [--rounds 5] [--runs 10]";

fn main() {
    let flags = common::Flags::parse(
        USAGE,
        &[
            ("batch", "1"),
            ("heads", "8"),
            ("kv-heads", "heads"),
            ("seq-len", "512"),
            ("head-dim", "32"),
            ("threads", "1"),
            ("rounds", "5"),
            ("runs", "10"),
        ],
    );
    let mut a: HashMap<String, usize> =
        ["batch", "heads", "seq-len", "head-dim", "threads", "rounds", "runs"]
            .map(|k| (k.to_string(), flags.num(k)))
            .into();
    // The query heads unless given.
    let kv = match flags.text("kv-heads") {
        "heads" => a["heads"],
        v => flags.positive("kv-heads", v),
    };
    if !a["heads"].is_multiple_of(kv) {
        common::exit_with_usage(
            USAGE,
            Some(format!("--kv-heads {kv} does not divide --heads {}", a["heads"])),
        );
    }
    a.insert("kv-heads".into(), kv);
    std::env::set_var("CANDLE_NUM_THREADS", "1");
    graphpp_runtime::malloc::retain_freed_memory();
    let pool = graphpp_runtime::kernels::threads::rank_pool(0, a["threads"]).expect("a thread pool");
    pool.install(|| run(&a));
}

fn run(a: &HashMap<String, usize>) {
    let (b, h, t, e) = (a["batch"], a["heads"], a["seq-len"], a["head-dim"]);
    let kv = a["kv-heads"];
    let draw =
        |heads: usize| Tensor::rand(-1f32, 1f32, &[b, heads, t, e], &Device::Cpu).expect("random operands");
    let (q, k, v, g) = (draw(h), draw(kv), draw(kv), draw(h));
    let m: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { -1e9 } else { 0.0 }).collect();
    let mask = Tensor::from_vec(m, (t, t), &Device::Cpu).expect("mask");
    let scale = 1.0 / (e as f64).sqrt();
    let o = attention(&q, &k, &v, &mask, scale).expect("attention");
    let ms = |f: &dyn Fn()| {
        f();
        let t0 = Instant::now();
        for _ in 0..a["runs"] {
            f();
        }
        t0.elapsed().as_secs_f64() * 1e3 / a["runs"] as f64
    };
    let kernel_fw = || drop(attention(&q, &k, &v, &mask, scale).expect("kernel"));
    let kernel_bw = || drop(attention_backward(&q, &k, &v, &mask, &o, &g, scale).expect("kernel"));
    let comp_fw = || drop(composition(&q, &k, &v, &mask, scale).expect("composition"));
    let comp_bw = || drop(composition_backward(&q, &k, &v, &mask, &g, scale).expect("composition"));
    let mut times: [Vec<f64>; 4] = Default::default();
    for _ in 0..a["rounds"] {
        for (i, f) in [&kernel_fw as &dyn Fn(), &comp_fw, &kernel_bw, &comp_bw].into_iter().enumerate() {
            times[i].push(ms(f));
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let [kf, cf, kb, cb] = times.each_mut().map(median);
    println!(
        "attention B={b} H={h} KV={kv} T={t} E={e}, causal, {} thread(s), median of {} rounds:",
        a["threads"], a["rounds"]
    );
    println!("forward  kernel {kf:.3} ms, composition {cf:.3} ms, kernel / composition {:.2}", kf / cf);
    println!("backward kernel {kb:.3} ms, composition {cb:.3} ms, kernel / composition {:.2}", kb / cb);
}
