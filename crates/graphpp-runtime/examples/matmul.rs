//! gemm's speed on a stage's matmul shapes, outside the model: each product `--reps` times in a
//! loop (after 50 warm-up products) through candle's matmul (the gemm crate, as the executors
//! call it), in a rank pool of `--threads` threads, with the operands hot (one pair, in L2) and
//! cold (`--copies` pairs cycled, more than L2 holds). Prints milliseconds and GFLOP/s
//! (2·m·n·k per product) per shape; `tools/torch/time_matmul.py` times PyTorch on the same
//! shapes.
//!
//! Run: `cargo run --release -p graphpp-runtime --example matmul -- [--threads 1] [--copies 64]
//! [--reps 400]`

#[allow(dead_code)] // only the flags: no stage graphs here
mod common;

use candle_core::{Device, Tensor};
use std::time::Instant;

/// `small`'s linear-layer products (B·T = 128 tokens): (m, k, n, lhs transposed, rhs transposed)
/// — fw x·Wᵀ, bw dY·W and Xᵀ·dY.
const SHAPES: [(usize, usize, usize, bool, bool); 5] = [
    (128, 256, 688, false, true),
    (128, 256, 688, false, false),
    (256, 128, 688, true, false),
    (128, 256, 256, false, true),
    (128, 688, 256, false, true),
];

/// An `r × c` operand filled from `seed`; stored transposed (as a `c × r` matrix viewed
/// transposed) when `t`.
fn operand(r: usize, c: usize, t: bool, seed: usize) -> Tensor {
    let v: Vec<f32> = (0..r * c).map(|i| (((i + seed) * 7 % 13) as f32 - 6.0) * 0.1).collect();
    let dev = &Device::Cpu;
    if t {
        Tensor::from_vec(v, (c, r), dev).and_then(|x| x.t()).expect("operand")
    } else {
        Tensor::from_vec(v, (r, c), dev).expect("operand")
    }
}

/// Milliseconds per product, cycling through `pairs`.
fn time(pairs: &[(Tensor, Tensor)], reps: usize) -> f64 {
    for i in 0..50 {
        let (a, b) = &pairs[i % pairs.len()];
        a.matmul(b).expect("matmul");
    }
    let t0 = Instant::now();
    for i in 0..reps {
        let (a, b) = &pairs[i % pairs.len()];
        a.matmul(b).expect("matmul");
    }
    t0.elapsed().as_secs_f64() * 1e3 / reps as f64
}

fn main() {
    const USAGE: &str = "matmul [--threads 1] [--copies 64] [--reps 400]";
    let flags = common::Flags::parse(USAGE, &[("threads", "1"), ("copies", "64"), ("reps", "400")]);
    let (threads, copies, reps) = (flags.num("threads"), flags.num("copies"), flags.num("reps"));
    // As `graphpp train --threads-per-rank N` (graphpp::cmd::set_op_threads).
    std::env::set_var("CANDLE_NUM_THREADS", "1");
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    let pool = graphpp_runtime::kernels::threads::rank_pool(0, threads).expect("thread pool");
    println!(
        "gemm via candle, {threads} thread(s), ms per product (GFLOP/s): hot, cold ({copies} operand pairs)"
    );
    graphpp_runtime::kernels::threads::install_hot(&pool, true, || {
        for (m, k, n, ta, tb) in SHAPES {
            let pairs: Vec<_> =
                (0..copies).map(|s| (operand(m, k, ta, s), operand(k, n, tb, s + 1))).collect();
            let (hot, cold) = (time(&pairs[..1], reps), time(&pairs, reps));
            let gflops = |ms: f64| 2.0 * (m * n * k) as f64 / ms / 1e6;
            let t = |x: bool| if x { "ᵀ" } else { "" };
            println!(
                "{m}×{k}{} · {k}×{n}{}: hot {hot:.3} ms ({:.0}), cold {cold:.3} ms ({:.0})",
                t(ta),
                t(tb),
                gflops(hot),
                gflops(cold)
            );
        }
    });
}
