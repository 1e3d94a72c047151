//! Reference numerics from PyTorch: `tools/torch/adamw_fixture.py` (PyTorch 2.15) ran
//! `torch.optim.AdamW` (β = (0.9, 0.95), ε = 1e-8, λ = 0.1, a learning rate per step) with
//! `clip_grad_norm_(max_norm = 1)` on two small f32 parameters for six steps, three of them clipped,
//! and wrote every gradient, norm and resulting parameter to `fixtures/adamw_fixture.json`.
//! graphpp's clipping + AdamW must reproduce each step's parameters within 1e-6 relative.

mod common;

use candle_core::{Device, Tensor};
use graphpp_runtime::{clip_grad_norm, AdamW, AdamWConfig};
use serde_json::Value;
use std::collections::HashMap;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/adamw_fixture.json");

fn tensor(v: &Value) -> Tensor {
    let shape: Vec<usize> =
        v["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
    let data: Vec<f32> = v["data"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

fn tensors(v: &Value) -> HashMap<String, Tensor> {
    v.as_object().unwrap().iter().map(|(k, x)| (k.clone(), tensor(x))).collect()
}

#[test]
fn clipping_and_adamw_match_pytorch_every_step() {
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(FIXTURE).unwrap()).unwrap();
    let cfg = AdamWConfig {
        beta1: fx["betas"][0].as_f64().unwrap(),
        beta2: fx["betas"][1].as_f64().unwrap(),
        eps: fx["eps"].as_f64().unwrap(),
        weight_decay: fx["weight_decay"].as_f64().unwrap(),
    };
    let max_norm = fx["max_norm"].as_f64().unwrap();
    let mut opt = AdamW::new(cfg).unwrap();
    let mut params = tensors(&fx["init"]);
    let (mut worst, mut clipped) = (0.0f64, 0);
    for (i, step) in fx["steps"].as_array().unwrap().iter().enumerate() {
        let mut grads = tensors(&step["grads"]);
        let norm = clip_grad_norm(&mut grads, max_norm).unwrap();
        let want = step["total_norm"].as_f64().unwrap();
        assert!((norm - want).abs() <= 1e-6 * want, "step {i}: norm {norm} vs torch {want}");
        clipped += usize::from(step["clip_coef"].as_f64().unwrap() < 1.0);
        opt.step(&mut params, &grads, step["lr"].as_f64().unwrap()).unwrap();
        for (name, want) in tensors(&step["params"]) {
            let e = common::rel_err(&params[&name], &want, 1e-12);
            worst = worst.max(e);
            assert!(e < 1e-6, "step {i} {name}: rel err {e}");
        }
    }
    assert_eq!(clipped, 3, "the fixture should clip on some steps and not others");
    // The exported state is PyTorch's exp_avg / exp_avg_sq under our names.
    let state = opt.state_dict().unwrap();
    assert_eq!(state["adam.step"].to_scalar::<i64>().unwrap(), fx["final_step"].as_i64().unwrap());
    for (name, st) in fx["final_state"].as_object().unwrap() {
        for (ours, theirs) in [("m", "exp_avg"), ("v", "exp_avg_sq")] {
            let e = common::rel_err(&state[&format!("adam.{ours}.{name}")], &tensor(&st[theirs]), 1e-12);
            assert!(e < 1e-6, "{ours} of {name}: rel err {e}");
        }
    }
    eprintln!(
        "AdamW + clipping vs PyTorch: worst parameter rel err {worst:.2e} over {} steps",
        opt.step_count()
    );
}
