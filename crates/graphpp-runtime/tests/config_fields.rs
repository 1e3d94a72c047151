//! Every Hugging Face Llama config field graphpp implements changes the forward output (a test
//! that fails if the field were ignored), grouped-query attention equals multi-head attention
//! with repeated kv heads, a tied LM head equals an untied one holding the embedding, and the
//! GELU layers give PyTorch's values. Run in f64 on a 2-layer model.

mod common;

use candle_core::Tensor;
use graphpp_graph::names::{LOGITS, TOKENS};
use graphpp_graph::{DType, GraphBuilder, InputKind};
use graphpp_models::rng::{hash, Rng};
use graphpp_models::{
    build_stage, split_layers, stage_buffers, stage_parameters, HiddenAct, LlamaConfig, StageOptions,
};
use graphpp_runtime::exec::{run_named, RunOptions};
use graphpp_runtime::kernels::tensor::{tensor_from_f64, tensor_u32, to_f64};
use std::collections::HashMap;

const B: usize = 2;
const T: usize = 6;

fn base() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 32,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        rms_norm_eps: 1e-6,
        ..LlamaConfig::tiny()
    }
}

/// A parameter drawn from its name alone (so two configs share the tensors they both have):
/// norms 1 + N(0, 0.1), biases N(0, 0.1), matrices N(0, 0.3).
fn draw(name: &str, shape: &[usize]) -> Vec<f64> {
    let mut rng = Rng::new(hash(name) ^ 0xf1e1d);
    let n: usize = shape.iter().product();
    (0..n)
        .map(|_| {
            let z = rng.normal();
            if name.ends_with("norm.weight") {
                1.0 + 0.1 * z
            } else if name.ends_with(".bias") {
                0.1 * z
            } else {
                0.3 * z
            }
        })
        .collect()
}

fn params(cfg: &LlamaConfig) -> HashMap<String, Vec<f64>> {
    let spec = &split_layers(cfg.num_hidden_layers, 1, None).unwrap()[0];
    stage_parameters(cfg, spec).into_iter().map(|(n, s)| (n.clone(), draw(&n, &s))).collect()
}

/// Logits `[B·T, V]` of `cfg` with parameters `p` (shapes from the config) on fixed tokens.
fn logits(cfg: &LlamaConfig, p: &HashMap<String, Vec<f64>>) -> Vec<f64> {
    let spec = &split_layers(cfg.num_hidden_layers, 1, None).unwrap()[0];
    let opts = StageOptions { dtype: DType::F64, logits: true, ..StageOptions::new(B, T) };
    let g = build_stage(cfg, spec, &opts).unwrap();
    let mut env = HashMap::new();
    for (name, shape) in stage_parameters(cfg, spec) {
        env.insert(name.clone(), tensor_from_f64(&p[&name], &shape, DType::F64).unwrap());
    }
    for (name, shape, data) in stage_buffers(cfg, T) {
        env.insert(name, tensor_from_f64(&data, &shape, DType::F64).unwrap());
    }
    let tokens: Vec<u32> = (0..B * T).map(|k| ((k * 7 + 3) % cfg.vocab_size) as u32).collect();
    env.insert(TOKENS.into(), tensor_u32(&tokens, &[B, T]).unwrap());
    let r = run_named(&g, &env, &RunOptions::default()).unwrap();
    to_f64(r.output(&g, LOGITS).unwrap()).unwrap()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

#[test]
fn every_implemented_field_changes_the_logits() {
    let b = base();
    let reference = logits(&b, &params(&b));
    let variants: Vec<(&str, LlamaConfig)> = vec![
        ("rope_theta", LlamaConfig { rope_theta: 100.0, ..b.clone() }),
        ("rms_norm_eps", LlamaConfig { rms_norm_eps: 0.5, ..b.clone() }),
        ("hidden_act gelu", LlamaConfig { hidden_act: HiddenAct::Gelu, ..b.clone() }),
        ("hidden_act gelu_pytorch_tanh", LlamaConfig { hidden_act: HiddenAct::GeluPytorchTanh, ..b.clone() }),
        ("attention_bias", LlamaConfig { attention_bias: true, ..b.clone() }),
        ("mlp_bias", LlamaConfig { mlp_bias: true, ..b.clone() }),
        ("head_dim", LlamaConfig { head_dim: Some(6), ..b.clone() }),
        ("num_key_value_heads", LlamaConfig { num_key_value_heads: Some(1), ..b.clone() }),
        ("tie_word_embeddings", LlamaConfig { tie_word_embeddings: true, ..b.clone() }),
    ];
    let mut seen = vec![reference.clone()];
    for (field, cfg) in variants {
        let l = logits(&cfg, &params(&cfg));
        assert!(l.iter().all(|x| x.is_finite()), "{field}");
        let d = max_diff(&l, &reference);
        assert!(d > 1e-3, "{field}: logits moved only {d:e}; is the field ignored?");
        seen.push(l);
    }
    // gelu and gelu_pytorch_tanh differ from each other too (the tanh form is an approximation).
    let d = max_diff(&seen[3], &seen[4]);
    assert!(d > 1e-7 && d < 1e-2, "gelu vs gelu_pytorch_tanh differ by {d:e}");
}

#[test]
fn grouped_query_attention_equals_multi_head_with_repeated_kv_heads() {
    // HF repeat_kv: query head h reads kv head h / (H / KV). Build the multi-head model whose k/v
    // projections repeat each kv head's rows H / KV times; its logits must be the GQA model's.
    let gqa = LlamaConfig { num_key_value_heads: Some(2), head_dim: Some(6), ..base() };
    let mha = LlamaConfig { num_key_value_heads: Some(4), ..gqa.clone() };
    let (h, kv, hd, d) = (4, 2, 6, gqa.hidden_size);
    let p = params(&gqa);
    let mut q = p.clone();
    for l in 0..gqa.num_hidden_layers {
        for proj in ["k_proj", "v_proj"] {
            let name = format!("model.layers.{l}.self_attn.{proj}.weight");
            let w = &p[&name];
            let mut rep = Vec::with_capacity(h * hd * d);
            for head in 0..h {
                let src = head / (h / kv);
                rep.extend_from_slice(&w[src * hd * d..(src + 1) * hd * d]);
            }
            q.insert(name, rep);
        }
    }
    let diff = max_diff(&logits(&gqa, &p), &logits(&mha, &q));
    assert!(diff < 1e-12, "GQA vs repeated-head MHA: {diff:e}");
    // Tiling kv heads the other way (head h reads kv head h % KV) is a different model.
    let mut tiled = p.clone();
    for l in 0..gqa.num_hidden_layers {
        for proj in ["k_proj", "v_proj"] {
            let name = format!("model.layers.{l}.self_attn.{proj}.weight");
            let w = &p[&name];
            let rep: Vec<f64> =
                (0..h).flat_map(|head| w[(head % kv) * hd * d..(head % kv + 1) * hd * d].to_vec()).collect();
            tiled.insert(name, rep);
        }
    }
    assert!(max_diff(&logits(&gqa, &p), &logits(&mha, &tiled)) > 1e-3);
}

#[test]
fn a_tied_lm_head_is_the_embedding_matrix() {
    let tied = LlamaConfig { tie_word_embeddings: true, ..base() };
    let untied = base();
    let p = params(&tied);
    let mut q = params(&untied);
    for (k, v) in &p {
        q.insert(k.clone(), v.clone());
    }
    q.insert("lm_head.weight".into(), p["model.embed_tokens.weight"].clone());
    assert_eq!(logits(&tied, &p), logits(&untied, &q));
}

#[test]
fn gelu_layers_give_pytorchs_values() {
    // Python: 0.5*x*(1+math.erf(x/math.sqrt(2))) and 0.5*x*(1+math.tanh(math.sqrt(2/math.pi)*(x+0.044715*x**3))).
    let xs = [-2.0, -0.5, 0.0, 0.7, 1.0, 3.0];
    let erf = [
        -0.04550026389635842,
        -0.15426876936299344,
        0.0,
        0.5306254434438489,
        0.8413447460685429,
        2.99595030590511,
    ];
    let tanh = [
        -0.04540230591222494,
        -0.15428599017485606,
        0.0,
        0.5305701347051167,
        0.8411919906082768,
        2.996362607918227,
    ];
    for (f, want) in [
        (graphpp_graph::layers::gelu as fn(&mut GraphBuilder, _) -> _, erf),
        (graphpp_graph::layers::gelu_tanh, tanh),
    ] {
        let mut b = GraphBuilder::new("gelu", DType::F64);
        let x = b.input("x", InputKind::Activation, vec![xs.len()]).unwrap();
        let y = f(&mut b, x).unwrap();
        b.output("y", y);
        let g = b.finish().unwrap();
        let env: HashMap<String, Tensor> =
            [("x".to_string(), tensor_from_f64(&xs, &[xs.len()], DType::F64).unwrap())].into();
        let got = to_f64(&run_named(&g, &env, &RunOptions::default()).unwrap().outputs[0]).unwrap();
        for (k, (a, w)) in got.iter().zip(want).enumerate() {
            assert!((a - w).abs() < 1e-14, "x = {}: {a} vs {w}", xs[k]);
        }
    }
}
