//! Reference numerics from PyTorch: `tools/torch/llama_fixture.py` and `tools/torch/moe_fixture.py`
//! (with `mla_reference.py` for the MLA fixtures)
//! (PyTorch 2.15, float64) wrote the weights, token ids, loss and every gradient of the same
//! Llama-style and DeepSeek-style MoE architectures into `fixtures/{llama,moe}_fixture.safetensors`
//! (the MoE one with non-zero load-balancing biases that change the routing; `moe_aux_fixture`
//! adds the sequence-wise auxiliary loss); graphpp's derived graphs must reproduce them.

mod common;

use candle_core::{DType as CDType, Device, Tensor};
use graphpp_graph::names::{grad_of, AUX_LOSS, EXPERT_LOAD, GRAD};
use graphpp_graph::{stage_graphs, DType, RecomputePolicy};
use graphpp_models::{split_layers, LlamaConfig, Model, MoeConfig, StageOptions};
use graphpp_runtime::kernels::tensor::{tensor_from_f64, to_f64};
use graphpp_runtime::pipeline::stage::aux_loss_seeds;
use std::collections::HashMap;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

fn check(dtype: DType, stages: usize, tol: f64) {
    let text = std::fs::read_to_string(format!("{DIR}/llama_fixture.json")).unwrap();
    check_model("llama_fixture", &LlamaConfig::from_json(&text).unwrap(), &text, dtype, stages, tol);
}

fn check_moe(fixture: &str, dtype: DType, stages: usize, tol: f64) {
    let text = std::fs::read_to_string(format!("{DIR}/{fixture}.json")).unwrap();
    check_model(fixture, &MoeConfig::from_json(&text).unwrap(), &text, dtype, stages, tol);
}

fn check_model(fixture: &str, cfg: &dyn Model, text: &str, dtype: DType, stages: usize, tol: f64) {
    let meta: serde_json::Value = serde_json::from_str(text).unwrap();
    let (b, t) =
        (meta["graphpp_batch"].as_u64().unwrap() as usize, meta["graphpp_seq"].as_u64().unwrap() as usize);
    let fx = candle_core::safetensors::load(format!("{DIR}/{fixture}.safetensors"), &Device::Cpu).unwrap();
    let opts = StageOptions { dtype, ..StageOptions::new(b, t) };
    let specs = split_layers(cfg.num_layers(), stages, None).unwrap();
    let cast = |x: &Tensor| x.to_dtype(graphpp_runtime::kernels::tensor::candle_dtype(dtype)).unwrap();
    let mut base: HashMap<String, Tensor> = HashMap::new();
    // The model's buffers first; the fixture's (the MoE biases) replace them.
    for (name, shape, data) in cfg.stage_buffers(t) {
        base.insert(name.clone(), tensor_from_f64(&data, &shape, cfg.buffer_dtype(&name, dtype)).unwrap());
    }
    for (k, v) in &fx {
        let v = if v.dtype() == CDType::U32 { v.clone() } else { cast(v) };
        base.insert(k.clone(), v);
    }
    // Run the stages forward, then backward, handing activations and gradients across.
    let graphs: Vec<_> = specs
        .iter()
        .map(|s| stage_graphs(&cfg.build_stage(s, &opts).unwrap(), &RecomputePolicy::SaveAll).unwrap())
        .collect();
    let mut envs = vec![base.clone(); stages];
    let mut loss = None;
    let mut aux = 0.0;
    let mut loads = HashMap::new();
    for s in 0..stages {
        let (fo, _) = run(&graphs[s].fw, &envs[s]);
        if let Some(x) = fo.get("output") {
            envs[s + 1].insert("input".into(), x.clone());
        }
        loss = fo.get("loss").cloned().or(loss);
        loads.extend(
            fo.iter().filter(|(k, _)| k.starts_with(EXPERT_LOAD)).map(|(k, v)| (k.clone(), v.clone())),
        );
        aux += fo
            .iter()
            .filter(|(k, _)| k.starts_with(AUX_LOSS))
            .map(|(_, v)| to_f64(v).unwrap()[0])
            .sum::<f64>();
        envs[s].extend(fo);
    }
    if let Some(want) = fx.get("aux_loss") {
        let want = to_f64(want).unwrap()[0];
        assert!(want > 0.0 && (aux - want).abs() <= tol * want, "{dtype:?} aux loss {aux} vs {want}");
    } else {
        assert_eq!(aux, 0.0);
    }
    check_routing(&fx, &loads);
    let mut grads = HashMap::new();
    for s in (0..stages).rev() {
        envs[s].extend(aux_loss_seeds(&graphs[s].full_bw, 1.0).unwrap());
        let (bo, _) = run(&graphs[s].full_bw, &envs[s]);
        if s > 0 {
            envs[s - 1].insert(grad_of("output"), bo[&grad_of("input")].clone());
        }
        grads.extend(bo.into_iter().filter(|(k, _)| *k != grad_of("input")));
    }
    let loss_err = common::rel_err(&loss.unwrap(), &fx["loss"], 1e-12);
    assert!(loss_err < tol, "{dtype:?} loss rel err {loss_err}");
    let want: Vec<&String> = fx.keys().filter(|k| k.starts_with(GRAD)).collect();
    assert_eq!(grads.len(), want.len());
    let mut worst = 0.0f64;
    for k in want {
        let e = common::rel_err(&grads[k], &fx[k], 1e-12);
        worst = worst.max(e);
        assert!(e < tol, "{dtype:?} {k}: rel err {e} (tol {tol})");
    }
    eprintln!(
        "{fixture} {dtype:?}, {stages} stage(s): loss {} rel err {loss_err:.2e}, worst gradient rel err {worst:.2e}",
        to_f64(&fx["loss"]).unwrap()[0]
    );
}

/// Where the fixture holds the tokens per expert of each MoE layer (`expert_load.<l>`, the
/// group-limited fixtures), graphpp's routing gives exactly those; and on at least one layer a
/// plain top-k (`plain_topk_load.<l>`) would have chosen differently, so the fixture tells
/// group-limited routing from top-k.
fn check_routing(fx: &HashMap<String, Tensor>, loads: &HashMap<String, Tensor>) {
    let want: Vec<&String> = fx.keys().filter(|k| k.starts_with(EXPERT_LOAD)).collect();
    let mut differs = false;
    for k in &want {
        let counts = |t: &Tensor| t.to_dtype(CDType::U32).unwrap().to_vec1::<u32>().unwrap();
        assert_eq!(counts(&loads[*k]), counts(&fx[*k]), "{k}: graphpp's experts differ from the reference's");
        let plain = fx[&k.replace(EXPERT_LOAD, "plain_topk_load.")].clone();
        differs |= counts(&plain) != counts(&fx[*k]);
    }
    assert!(want.is_empty() || differs, "the fixture's groups change no choice: it cannot test them");
}

fn run(g: &graphpp_graph::Graph, env: &HashMap<String, Tensor>) -> (HashMap<String, Tensor>, usize) {
    let r = graphpp_runtime::run_named(g, env, &Default::default()).unwrap();
    (g.output_names().into_iter().zip(r.outputs).collect(), r.peak_live_bytes)
}

/// f32 on one stage: loss and every gradient within 1e-4 relative (to the tensor's max |value|).
#[test]
fn f32_single_stage_matches_pytorch() {
    check(DType::F32, 1, 1e-4);
}

/// f32 split into two pipeline stages gives the same reference numbers.
#[test]
fn f32_two_stages_match_pytorch() {
    check(DType::F32, 2, 1e-4);
}

/// f64 run against the f32-rounded reference: only the storage rounding (≈ 6e-8) remains.
#[test]
fn f64_matches_pytorch_to_storage_precision() {
    check(DType::F64, 1, 1e-6);
}

/// The MoE decoder (biased routing, shared experts) on one stage and split in three: loss and every
/// gradient within 1e-4 relative in f32, 1e-6 in f64.
#[test]
fn moe_matches_pytorch() {
    check_moe("moe_fixture", DType::F32, 1, 1e-4);
    check_moe("moe_fixture", DType::F32, 3, 1e-4);
    check_moe("moe_fixture", DType::F64, 1, 1e-6);
}

/// The sequence-wise auxiliary balance loss (α = 0.05, the `moe_fixture` model and weights):
/// its value and every gradient of loss + aux loss, on one stage and split in three.
#[test]
fn moe_aux_loss_matches_pytorch() {
    check_moe("moe_aux_fixture", DType::F32, 1, 1e-4);
    check_moe("moe_aux_fixture", DType::F32, 3, 1e-4);
    check_moe("moe_aux_fixture", DType::F64, 1, 1e-6);
}

/// The softmax scorer (DeepSeek-V2 style) without weight normalisation, scaled by 1.5, no
/// shared experts: the same agreement.
#[test]
fn moe_softmax_matches_pytorch() {
    check_moe("moe_softmax_fixture", DType::F32, 3, 1e-4);
    check_moe("moe_softmax_fixture", DType::F64, 1, 1e-6);
}

/// DeepSeek-V3's multi-head latent attention (query latent, YaRN RoPE with interleaved pairs,
/// q·k width 12 ≠ value width 6) and group-limited `noaux_tc` routing (4 groups of 2, the best
/// 2 per token), against `tools/torch/mla_reference.py` in float64: the experts chosen equal
/// the reference's (where a plain top-k would differ), loss and gradients within 1e-10 in f64
/// and 1e-5 in f32, on one and on three stages.
#[test]
fn mla_matches_pytorch() {
    check_moe("mla_fixture", DType::F64, 1, 1e-10);
    check_moe("mla_fixture", DType::F64, 3, 1e-10);
    check_moe("mla_fixture", DType::F32, 1, 1e-5);
    check_moe("mla_fixture", DType::F32, 3, 1e-5);
}

/// DeepSeek-V2 style: a full-rank `q_proj` (`q_lora_rank` null), rotate-half RoPE, value width
/// 10 above the q·k width 8, softmax scores and `group_limited_greedy` routing.
#[test]
fn mla_v2_matches_pytorch() {
    check_moe("mla_v2_fixture", DType::F64, 1, 1e-10);
    check_moe("mla_v2_fixture", DType::F32, 3, 1e-5);
}
