//! Matmul speed on a stage's matmul shapes, outside the model: each product `--reps` times in a
//! loop (after 50 warm-up products) in f32 through candle's matmul (the gemm crate, as the
//! executors call it) and in bf16 on every bf16 path the CPU has (`kernels::bf16_gemm`), in a rank pool of `--threads` threads, with the operands hot (one pair, in L2) and
//! cold (`--copies` pairs cycled, more than L2 holds). Prints milliseconds and GFLOP/s
//! (2·m·n·k per product) per shape; `tools/torch/time_matmul.py` times PyTorch on the same
//! shapes.
//!
//! Run: `cargo run --release -p graphpp-runtime --example matmul -- [--threads 1] [--copies 64]
//! [--reps 400]`

#[allow(dead_code)] // only the flags: no stage graphs here
mod common;

/// The allocator the `graphpp` binary runs on (`graphpp_runtime::malloc` says why).
#[global_allocator]
static ALLOCATOR: graphpp_runtime::malloc::MiMalloc = graphpp_runtime::malloc::MiMalloc;

use candle_core::{Device, Tensor};
use graphpp_runtime::kernels::bf16_gemm::{self, Bf16Gemm, Strided};
use half::bf16;
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

/// Milliseconds per product of `product(i)`, `i` cycling through `pairs` operand pairs.
fn time(pairs: usize, reps: usize, mut product: impl FnMut(usize)) -> f64 {
    for i in 0..50 {
        product(i % pairs);
    }
    let t0 = Instant::now();
    for i in 0..reps {
        product(i % pairs);
    }
    t0.elapsed().as_secs_f64() * 1e3 / reps as f64
}

/// An f32 operand's values in bf16, in its own layout (`Strided` over the same strides).
fn bf16_values(t: &Tensor) -> (Vec<bf16>, usize, usize) {
    let (rows, cols) = t.dims2().expect("a matrix");
    let (rs, cs) = (t.stride()[0], t.stride()[1]);
    // The storage in memory order: a transposed view's data is its contiguous transpose's.
    let stored = if cs == 1 { t.clone() } else { t.t().expect("transpose") };
    let v = stored.flatten_all().and_then(|x| x.to_vec1::<f32>()).expect("values");
    debug_assert_eq!(v.len(), rows * cols);
    (v.into_iter().map(bf16::from_f32).collect(), rs, cs)
}

fn main() {
    const USAGE: &str = "matmul [--threads 1] [--copies 64] [--reps 400]";
    let flags = common::Flags::parse(USAGE, &[("threads", "1"), ("copies", "64"), ("reps", "400")]);
    let (threads, copies, reps) = (flags.num("threads"), flags.num("copies"), flags.num("reps"));
    // As `graphpp train --threads-per-rank N` (graphpp::cmd::set_op_threads).
    std::env::set_var("CANDLE_NUM_THREADS", "1");
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    graphpp_runtime::malloc::retain_freed_memory();
    let pool = graphpp_runtime::kernels::threads::rank_pool(0, threads).expect("thread pool");
    let paths: Vec<Bf16Gemm> = Bf16Gemm::ALL.into_iter().filter(|p| p.available()).collect();
    println!(
        "{threads} thread(s), ms per product (GFLOP/s), hot and cold ({copies} operand pairs): f32 gemm via \
         candle, then bf16 (f32 sums) on each bf16 path this CPU has"
    );
    graphpp_runtime::kernels::threads::install_hot(&pool, true, || {
        for (m, k, n, ta, tb) in SHAPES {
            let pairs: Vec<_> =
                (0..copies).map(|s| (operand(m, k, ta, s), operand(k, n, tb, s + 1))).collect();
            let gflops = |ms: f64| 2.0 * (m * n * k) as f64 / ms / 1e6;
            let t = |x: bool| if x { "ᵀ" } else { "" };
            let mut line = format!("{m}×{k}{} · {k}×{n}{}:", t(ta), t(tb));
            let mut report = |name: &str, product: &mut dyn FnMut(usize)| {
                let (hot, cold) = (time(1, reps, &mut *product), time(copies, reps, &mut *product));
                line += &format!(" {name} {hot:.3}/{cold:.3} ms ({:.0}/{:.0})", gflops(hot), gflops(cold));
            };
            report("f32", &mut |i| {
                pairs[i].0.matmul(&pairs[i].1).expect("matmul");
            });
            let halves: Vec<_> = pairs.iter().map(|(a, b)| (bf16_values(a), bf16_values(b))).collect();
            let mut out = vec![std::mem::MaybeUninit::uninit(); m * n];
            for &path in &paths {
                report(path.name(), &mut |i| {
                    let ((va, ra, ca), (vb, rb, cb)) = &halves[i];
                    let a = Strided { data: va, row_stride: *ra, col_stride: *ca };
                    let b = Strided { data: vb, row_stride: *rb, col_stride: *cb };
                    bf16_gemm::gemm(path, (m, n, k), (a, b), bf16_gemm::Out::Rows(&mut out), true);
                });
            }
            println!("{line}");
        }
    });
}
