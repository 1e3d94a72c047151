//! Shared helpers: random tensors, running fw + bw, comparing tensors.
#![allow(dead_code)]

use candle_core::Tensor;
use graphpp_graph::{Graph, InputKind, InputSpec};
use graphpp_models::rng::Rng;
use graphpp_runtime::exec::{run_named, RunOptions};
use graphpp_runtime::kernels::tensor::{tensor_from_f64, tensor_u32, to_f64};
use std::collections::HashMap;

/// Random tensor for an input spec: floats uniform in `lo..hi`, u32 below `index_bound`.
pub fn random_input(spec: &InputSpec, rng: &mut Rng, lo: f64, hi: f64, index_bound: u64) -> Tensor {
    let n = spec.ty.numel();
    if spec.ty.dtype.is_float() {
        let data: Vec<f64> = (0..n).map(|_| lo + (hi - lo) * rng.uniform()).collect();
        tensor_from_f64(&data, &spec.ty.shape, spec.ty.dtype).unwrap()
    } else {
        let data: Vec<u32> = (0..n).map(|_| rng.below(index_bound) as u32).collect();
        tensor_u32(&data, &spec.ty.shape).unwrap()
    }
}

/// Runs `fw` then `bw` (binding saved values and tangents by name); returns the fw outputs and
/// the bw outputs by name, and both peaks.
pub fn fw_then_bw(
    fw: &Graph,
    bw: &Graph,
    inputs: &HashMap<String, Tensor>,
    tangents: &HashMap<String, Tensor>,
) -> (HashMap<String, Tensor>, HashMap<String, Tensor>, usize, usize) {
    let f = run_named(fw, inputs, &RunOptions::default()).unwrap();
    let fo: HashMap<String, Tensor> = fw.output_names().into_iter().zip(f.outputs.iter().cloned()).collect();
    let mut env = inputs.clone();
    env.extend(fo.clone());
    env.extend(tangents.clone());
    let b = run_named(bw, &env, &RunOptions::default()).unwrap();
    let bo = bw.output_names().into_iter().zip(b.outputs.iter().cloned()).collect();
    (fo, bo, f.peak_live_bytes, b.peak_live_bytes)
}

/// Largest |a − b| / max(|b|max, floor) over all elements (relative to the reference's scale).
pub fn rel_err(a: &Tensor, b: &Tensor, floor: f64) -> f64 {
    let (a, b) = (to_f64(a).unwrap(), to_f64(b).unwrap());
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(floor, |m, x| m.max(x.abs()));
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / scale
}

/// Whether two tensors are bitwise equal.
pub fn same(a: &Tensor, b: &Tensor) -> bool {
    to_f64(a).unwrap() == to_f64(b).unwrap() && a.dims() == b.dims()
}

/// Input kinds that take random data from the tests.
pub fn is_data(k: InputKind) -> bool {
    !matches!(k, InputKind::Saved | InputKind::Tangent)
}

/// The small training setup the trainer tests share: tiny Llama, B=1, T=8, seed 3, AdamW (0.9,
/// 0.95, wd 0.1), cosine 1e-2 → 1e-3 over 6 steps with 2 of warm-up, clipping at 0.5, f32, dp 1.
pub fn tiny_setup(kind: graphpp_schedule::Kind, p: usize, v: usize, m: usize) -> graphpp_runtime::TrainSetup {
    graphpp_runtime::TrainSetup {
        model: std::sync::Arc::new(graphpp_models::LlamaConfig::tiny()),
        kind,
        shape: graphpp_schedule::Shape::new(p, v, m),
        options: graphpp_schedule::Options::default(),
        schedule: None,
        layers_per_stage: None,
        microbatch_size: 1,
        dp: 1,
        fsdp: false,
        ep: 1,
        tp: 1,
        sequence_parallel: false,
        post_validate: false,
        seq_len: 8,
        seed: 3,
        adamw: graphpp_runtime::AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 },
        lr: graphpp_runtime::CosineSchedule::new(1e-2, 1e-3, 2, 6).unwrap(),
        grad_clip: Some(0.5),
        recompute: graphpp_models::Recompute::SaveAll,
        expert_bias_update: 0.001,
        link: None,
        timeout: std::time::Duration::from_secs(60),
        dtype: graphpp_graph::DType::F32,
        device: candle_core::Device::Cpu,
        ranks_here: None,
        process_bytes: 0,
    }
}
