//! The candle compositions a GPU runs (`graphpp_runtime::kernels::device`) against the CPU
//! kernels they stand for, op by op, in one process (`with_composed` chooses per thread): the
//! softmax family and their backwards, attention under grouped-query heads and its backward, and
//! AdamW's update. A wrong composition differs far beyond f32 rounding.

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use graphpp_models::rng::Rng;
use graphpp_runtime::kernels::attention::{attention, attention_backward};
use graphpp_runtime::kernels::device::with_composed;
use graphpp_runtime::kernels::softmax::{log_softmax, log_softmax_backward, softmax, softmax_backward};
use graphpp_runtime::kernels::tensor::tensor_from_f64;
use graphpp_runtime::{AdamW, AdamWConfig};

/// Values uniform in [-2, 2), drawn from `seed`.
fn values(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = Rng::new(seed);
    let v: Vec<f64> = (0..shape.iter().product()).map(|_| 4.0 * rng.uniform() - 2.0).collect();
    tensor_from_f64(&v, shape, graphpp_graph::DType::F32).unwrap()
}

/// Both paths of `f`: (CPU kernels, compositions).
fn both(f: impl Fn() -> Tensor) -> (Tensor, Tensor) {
    (with_composed(false, &f), with_composed(true, &f))
}

/// The largest |a − b| relative to `a`'s scale ([`common::rel_err`]).
fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    common::rel_err(b, a, 1e-30)
}

fn causal(t: usize) -> Tensor {
    let m: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { -1e9 } else { 0.0 }).collect();
    Tensor::from_vec(m, (t, t), &Device::Cpu).unwrap()
}

#[test]
fn the_softmax_family_composed_equals_the_cpu_kernels() {
    let x = values(&[2, 3, 5, 7], 1);
    let g = values(&[2, 3, 5, 7], 2);
    let mask = values(&[5, 7], 3);
    for axis in [3, 1] {
        let m = (axis == 3).then_some(&mask);
        let (a, b) = both(|| softmax(&x, m, axis, 0.5).unwrap());
        assert!(rel_diff(&a, &b) < 1e-6, "softmax axis {axis}: {}", rel_diff(&a, &b));
        let y = softmax(&x, m, axis, 0.5).unwrap();
        let (a, b) = both(|| softmax_backward(&y, &g, axis, 0.5).unwrap());
        assert!(rel_diff(&a, &b) < 1e-6, "softmax backward axis {axis}: {}", rel_diff(&a, &b));
        let (a, b) = both(|| log_softmax(&x, axis).unwrap());
        assert!(rel_diff(&a, &b) < 1e-6, "log-softmax axis {axis}: {}", rel_diff(&a, &b));
        let ly = log_softmax(&x, axis).unwrap();
        let (a, b) = both(|| log_softmax_backward(&ly, &g, axis).unwrap());
        assert!(rel_diff(&a, &b) < 1e-6, "log-softmax backward axis {axis}: {}", rel_diff(&a, &b));
    }
    // bf16 operands: f32 math inside both paths, one rounding each.
    let x16 = x.to_dtype(DType::BF16).unwrap();
    let (a, b) = both(|| softmax(&x16, None, 3, 1.0).unwrap());
    assert_eq!(a.dtype(), DType::BF16);
    assert!(rel_diff(&a, &b) < 1e-2, "bf16 softmax: {}", rel_diff(&a, &b));
}

#[test]
fn attention_composed_equals_the_cpu_kernel_under_grouped_query_heads() {
    // B = 2, H = 4 query heads over KV = 2 key/value heads, T = 6, E = 8; causal.
    let (q, k, v) = (values(&[2, 4, 6, 8], 4), values(&[2, 2, 6, 8], 5), values(&[2, 2, 6, 8], 6));
    let mask = causal(6);
    let (a, b) = both(|| attention(&q, &k, &v, &mask, 0.35).unwrap());
    assert!(rel_diff(&a, &b) < 1e-6, "attention: {}", rel_diff(&a, &b));
    let o = attention(&q, &k, &v, &mask, 0.35).unwrap();
    let g = values(&[2, 4, 6, 8], 7);
    let (a, b) = both(|| attention_backward(&q, &k, &v, &mask, &o, &g, 0.35).unwrap());
    assert_eq!(a.dims(), &[2, 4 + 2 * 2, 6, 8]);
    assert!(rel_diff(&a, &b) < 1e-5, "attention backward: {}", rel_diff(&a, &b));
}

#[test]
fn adamw_composed_takes_the_fused_update() {
    let cfg = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
    let run = |composed: bool| {
        with_composed(composed, || {
            let mut opt = AdamW::new(cfg).unwrap();
            let mut params = HashMap::from([("w".to_string(), values(&[16, 9], 8))]);
            for step in 0..3 {
                let grads = HashMap::from([("w".to_string(), values(&[16, 9], 20 + step))]);
                opt.step(&mut params, &grads, 1e-2).unwrap();
            }
            params.remove("w").unwrap()
        })
    };
    let (a, b) = (run(false), run(true));
    let moved = rel_diff(&values(&[16, 9], 8), &a);
    assert!(moved > 1e-3, "three steps move the weights: {moved}");
    assert!(rel_diff(&a, &b) < 1e-6, "AdamW: {}", rel_diff(&a, &b));
}
