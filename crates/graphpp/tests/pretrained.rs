//! Loading Hugging Face model folders (`--init-from`): the fixtures written by
//! `tools/torch/hf_llama_logits.py` (transformers 5.24 `LlamaForCausalLM.save_pretrained`, with
//! the model's logits) and `tools/torch/hf_deepseek_logits.py` (transformers 5.25
//! `DeepseekV3ForCausalLM`) give PyTorch's logits and loss; bad folders give errors naming the file,
//! tensor or field; a tied embedding's pipeline copies stay equal through training.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType as CDType, Device, Tensor};
use graphpp::pretrained::{self, PretrainedError};
use graphpp::train::{Run, RunConfig};
use graphpp_graph::names::{LOGITS, LOSS, TARGETS, TOKENS};
use graphpp_graph::DType;
use graphpp_models::{split_layers, Model, ModelError, StageOptions};
use graphpp_runtime::exec::{run_named, RunOptions};
use graphpp_runtime::kernels::tensor::{candle_dtype, tensor_from_f64, to_f64};
use graphpp_schedule::Kind;

const GELU: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf-tiny-llama-gelu");
const TANH_BF16: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf-tiny-llama-tanh-bf16");
const DEEPSEEK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf-tiny-deepseek-v3");

/// The fixture's tokens, targets (u32 `[B, T]`), logits, logits_f64, loss, loss_f64.
fn reference(dir: &str) -> HashMap<String, Tensor> {
    let mut r = candle_core::safetensors::load(format!("{dir}/logits.safetensors"), &Device::Cpu).unwrap();
    for k in ["tokens", "targets"] {
        let t = r[k].to_dtype(CDType::U32).unwrap();
        r.insert(k.into(), t);
    }
    r
}

/// (logits `[B·T, V]`, loss) of one device from `weights`, in `dtype`.
fn forward(
    cfg: &dyn Model,
    weights: &BTreeMap<String, Tensor>,
    r: &HashMap<String, Tensor>,
    dtype: DType,
) -> (Vec<f64>, f64) {
    let (b, t) = r["tokens"].dims2().unwrap();
    let spec = &split_layers(cfg.num_layers(), 1, None).unwrap()[0];
    let mut env = HashMap::new();
    for (name, shape, data) in cfg.stage_buffers(t) {
        env.insert(name.clone(), tensor_from_f64(&data, &shape, cfg.buffer_dtype(&name, dtype)).unwrap());
    }
    // The weights, and the buffers the folder gives (MoE routing biases) over the model's.
    for (k, v) in weights {
        let dtype = if env.contains_key(k) { cfg.buffer_dtype(k, dtype) } else { dtype };
        env.insert(k.clone(), v.to_dtype(candle_dtype(dtype)).unwrap());
    }
    env.insert(TOKENS.into(), r["tokens"].clone());
    env.insert(TARGETS.into(), r["targets"].clone());
    let mut out = Vec::new();
    for logits in [true, false] {
        let opts = StageOptions { dtype, logits, ..StageOptions::new(b, t) };
        let g = cfg.build_stage(spec, &opts).unwrap();
        let run = run_named(&g, &env, &RunOptions::default()).unwrap();
        out.push(to_f64(run.output(&g, if logits { LOGITS } else { LOSS }).unwrap()).unwrap());
    }
    (out[0].clone(), out[1][0])
}

/// max |a − b| / max |b|.
fn rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f64, |s, x| s.max(x.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / scale
}

fn check_fixture(dir: &str) {
    let p = pretrained::load(Path::new(dir)).unwrap();
    let r = reference(dir);
    let want = to_f64(&r["logits"]).unwrap();
    let want64 = to_f64(&r["logits_f64"]).unwrap();
    let (loss_want, loss_want64) = (to_f64(&r["loss"]).unwrap()[0], to_f64(&r["loss_f64"]).unwrap()[0]);
    let (l32, loss32) = forward(&p.config, &p.tensors, &r, DType::F32);
    let (l64, loss64) = forward(&p.config, &p.tensors, &r, DType::F64);
    let (e32, e64) = (rel(&l32, &want), rel(&l64, &want64));
    let (le32, le64) = ((loss32 - loss_want).abs() / loss_want, (loss64 - loss_want64).abs() / loss_want64);
    eprintln!(
        "{dir}: logits max rel diff f32 {e32:.3e} (abs {:.3e}), f64 {e64:.3e}; loss rel diff f32 {le32:.3e}, f64 {le64:.3e}",
        e32 * want.iter().fold(0.0f64, |s, x| s.max(x.abs()))
    );
    assert!(e32 < 1e-5 && le32 < 1e-5, "f32: logits {e32:e}, loss {le32:e}");
    // The reference ran in float64 throughout (RoPE, RMSNorm and softmax too): the same function.
    assert!(e64 < 1e-12 && le64 < 1e-12, "f64: logits {e64:e}, loss {le64:e}");
}

#[test]
fn gelu_gqa_head_dim_bias_tied_fixture_gives_pytorchs_logits() {
    let p = pretrained::load(Path::new(GELU)).unwrap();
    let c = p.config.base();
    assert!(c.tie_word_embeddings && c.attention_bias && c.mlp_bias);
    assert_eq!((c.head_dim(), c.kv_heads(), c.rope_theta, c.rms_norm_eps), (8, 2, 500.0, 1e-5));
    assert!(!p.tensors.contains_key("lm_head.weight"));
    check_fixture(GELU);
}

#[test]
fn bf16_gelu_tanh_untied_fixture_gives_pytorchs_logits() {
    let p = pretrained::load(Path::new(TANH_BF16)).unwrap();
    assert_eq!((p.config.base().kv_heads(), p.config.base().rms_norm_eps), (1, 1e-6));
    assert!(p.tensors.values().all(|t| t.dtype() == CDType::F32));
    check_fixture(TANH_BF16);
}

/// A tiny `DeepseekV3ForCausalLM` (`tools/torch/hf_deepseek_logits.py`: MLA with a query latent,
/// YaRN, interleaved RoPE, q·k 12 ≠ v 6, group-limited routing with non-zero routing biases)
/// loads as a MoE model with MLA, its biases with it, and gives transformers' logits and loss
/// within 1e-5 relative in f32.
#[test]
fn deepseek_v3_folder_gives_transformers_logits() {
    let p = pretrained::load(Path::new(DEEPSEEK)).unwrap();
    let graphpp_models::ModelConfig::Moe(m) = &p.config else { panic!("a MoE config: {:?}", p.config) };
    let mla = m.mla.as_ref().expect("MLA");
    assert_eq!((mla.q_lora_rank, mla.qk_head_dim(), mla.v_head_dim, m.n_group), (Some(16), 12, 6, 4));
    assert!(m.rope_scaling.is_some() && m.grouped());
    let bias = to_f64(&p.tensors["model.layers.1.mlp.gate.e_score_correction_bias"]).unwrap();
    assert!(bias.iter().any(|&x| x != 0.0), "the routing biases are read");
    let r = reference(DEEPSEEK);
    let (logits, loss) = forward(&p.config, &p.tensors, &r, DType::F32);
    let want = to_f64(&r["logits"]).unwrap();
    let loss_want = to_f64(&r["loss"]).unwrap()[0];
    let (e, le) = (rel(&logits, &want), (loss - loss_want).abs() / loss_want);
    eprintln!("{DEEPSEEK}: logits max rel diff {e:.3e}, loss {loss} vs {loss_want} (rel {le:.3e})");
    assert!(e < 1e-5 && le < 1e-5, "logits {e:e}, loss {le:e}");
    // The folder's biases are the ones used: biases that send every token to expert 0 change
    // the logits by far more than the tolerance (4.7e-4 relative; the LM head's large logits
    // dominate the scale).
    let mut skewed = p.tensors.clone();
    for (_, t) in skewed.iter_mut().filter(|(k, _)| k.ends_with("e_score_correction_bias")) {
        let mut b = vec![0f32; t.dims()[0]];
        b[0] = 10.0;
        *t = Tensor::from_vec(b, t.dims(), &Device::Cpu).unwrap();
    }
    let (other, _) = forward(&p.config, &skewed, &r, DType::F32);
    assert!(rel(&other, &want) > 1e-4, "{}", rel(&other, &want));
}

/// DeepSeek-V3 checkpoints carry their multi-token-prediction module as layers `L..L+n`
/// (`num_nextn_predict_layers` = 1 in the fixture's config, 3 layers): those tensors are
/// skipped unread (a NaN there refuses nothing), a tensor of a layer beyond them is still an
/// unexpected one.
#[test]
fn deepseek_mtp_layers_are_skipped_and_nothing_else() {
    let extra = |name: &'static str, value: f32| {
        edited(DEEPSEEK, move |t, _| {
            t.insert(name.into(), Tensor::from_vec(vec![value; 4], (2, 2), &Device::Cpu).unwrap());
        })
    };
    let d = extra("model.layers.3.eh_proj.weight", f32::NAN);
    assert!(pretrained::load(d.path()).is_ok());
    let d = extra("model.layers.4.eh_proj.weight", 0.0);
    match load_err(d.path()) {
        PretrainedError::Unexpected { names, .. } => assert_eq!(names, ["model.layers.4.eh_proj.weight"]),
        other => panic!("{other}"),
    }
}

/// A copy of `src` in a temporary folder, with `edit` applied to its tensors (f32) and config.
fn edited(
    src: &str,
    edit: impl FnOnce(&mut HashMap<String, Tensor>, &mut serde_json::Value),
) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let mut tensors =
        candle_core::safetensors::load(format!("{src}/model.safetensors"), &Device::Cpu).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{src}/config.json")).unwrap()).unwrap();
    edit(&mut tensors, &mut cfg);
    candle_core::safetensors::save(&tensors, d.path().join("model.safetensors")).unwrap();
    std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
    d
}

fn load_err(dir: &Path) -> PretrainedError {
    pretrained::load(dir).unwrap_err()
}

#[test]
fn f16_weights_are_converted_to_f32() {
    let d = edited(TANH_BF16, |t, _| {
        for v in t.values_mut() {
            *v = v.to_dtype(CDType::F16).unwrap();
        }
    });
    let a = pretrained::load(d.path()).unwrap();
    let b = pretrained::load(Path::new(TANH_BF16)).unwrap();
    for (name, t) in &b.tensors {
        // bf16 values with few mantissa bits survive f16 when in range.
        let want = t.to_dtype(CDType::F16).unwrap().to_dtype(CDType::F32).unwrap();
        assert_eq!(to_f64(&a.tensors[name]).unwrap(), to_f64(&want).unwrap(), "{name}");
    }
}

#[test]
fn missing_files_are_named() {
    let d = tempfile::tempdir().unwrap();
    match load_err(d.path()) {
        PretrainedError::MissingFile { path } => assert!(path.ends_with("config.json")),
        e => panic!("{e}"),
    }
    std::fs::copy(format!("{GELU}/config.json"), d.path().join("config.json")).unwrap();
    let e = load_err(d.path());
    assert!(
        matches!(&e, PretrainedError::MissingFile { path } if path.ends_with("model.safetensors")),
        "{e}"
    );
    assert!(e.to_string().contains("model.safetensors: missing"), "{e}");
}

#[test]
fn a_missing_tensor_is_named() {
    let d = edited(GELU, |t, _| {
        t.remove("model.layers.1.self_attn.k_proj.bias");
    });
    let e = load_err(d.path());
    match &e {
        PretrainedError::MissingTensors { names, .. } => {
            assert_eq!(names, &vec!["model.layers.1.self_attn.k_proj.bias".to_string()])
        }
        e => panic!("{e}"),
    }
    assert!(e.to_string().contains("`model.layers.1.self_attn.k_proj.bias`"), "{e}");
}

#[test]
fn a_tensor_of_the_wrong_shape_is_named() {
    let d = edited(GELU, |t, _| {
        t.insert(
            "model.layers.0.self_attn.q_proj.weight".into(),
            Tensor::zeros((24, 24), CDType::F32, &Device::Cpu).unwrap(),
        );
    });
    match load_err(d.path()) {
        PretrainedError::Shape { name, found, expected, .. } => {
            assert_eq!(name, "model.layers.0.self_attn.q_proj.weight");
            assert_eq!((found, expected), (vec![24, 24], vec![32, 24]));
        }
        e => panic!("{e}"),
    }
}

#[test]
fn an_unexpected_tensor_is_named() {
    let d = edited(GELU, |t, _| {
        t.insert(
            "model.layers.2.mlp.up_proj.weight".into(),
            Tensor::zeros((40, 24), CDType::F32, &Device::Cpu).unwrap(),
        );
        // transformers' RoPE buffers (written by older versions) are skipped, not refused.
        t.insert(
            "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            Tensor::zeros(4, CDType::F32, &Device::Cpu).unwrap(),
        );
    });
    let e = load_err(d.path());
    match &e {
        PretrainedError::Unexpected { names, .. } => {
            assert_eq!(names, &vec!["model.layers.2.mlp.up_proj.weight".to_string()])
        }
        e => panic!("{e}"),
    }
    // The same tensors are unexpected when the config says there are no biases.
    let d = edited(GELU, |_, c| c["attention_bias"] = false.into());
    match load_err(d.path()) {
        PretrainedError::Unexpected { names, .. } => {
            assert_eq!(names.len(), 8);
            assert!(names.iter().all(|n| n.contains("self_attn") && n.ends_with(".bias")), "{names:?}");
        }
        e => panic!("{e}"),
    }
}

#[test]
fn tied_lm_head_in_the_file_must_equal_the_embedding() {
    let d = edited(GELU, |t, _| {
        let e = t["model.embed_tokens.weight"].clone();
        t.insert("lm_head.weight".into(), e);
    });
    assert!(!pretrained::load(d.path()).unwrap().tensors.contains_key("lm_head.weight"));
    let d = edited(GELU, |t, _| {
        let e = (t["model.embed_tokens.weight"].clone() * 2.0).unwrap();
        t.insert("lm_head.weight".into(), e);
    });
    assert!(matches!(load_err(d.path()), PretrainedError::TiedMismatch { .. }));
    // Untied: the config asks for lm_head.weight, which the tied fixture does not hold.
    let d = edited(GELU, |_, c| c["tie_word_embeddings"] = false.into());
    match load_err(d.path()) {
        PretrainedError::MissingTensors { names, .. } => {
            assert_eq!(names, vec!["lm_head.weight".to_string()])
        }
        e => panic!("{e}"),
    }
}

#[test]
fn unsupported_config_fields_are_refused_by_name() {
    for (field, value) in [
        ("rope_scaling", serde_json::json!({"rope_type": "llama3", "factor": 8.0})),
        ("model_type", "gpt2".into()),
        ("hidden_act", "relu".into()),
        ("attention_dropout", 0.1.into()),
    ] {
        let d = edited(GELU, |_, c| c[field] = value.clone());
        match load_err(d.path()) {
            PretrainedError::Config { path, source: ModelError::Unsupported { field: f, .. } } => {
                assert!(path.ends_with("config.json"));
                assert_eq!(f, field);
            }
            e => panic!("{field}: {e}"),
        }
    }
}

#[test]
fn sharded_weights_are_read_through_the_index() {
    let d = edited(GELU, |_, _| {});
    let all = candle_core::safetensors::load(d.path().join("model.safetensors"), &Device::Cpu).unwrap();
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    let (mut a, mut b) = (HashMap::new(), HashMap::new());
    let mut map = serde_json::Map::new();
    for (k, v) in all {
        let shard = if k.contains("layers.1") {
            "model-00002-of-00002.safetensors"
        } else {
            "model-00001-of-00002.safetensors"
        };
        map.insert(k.clone(), shard.into());
        if k.contains("layers.1") {
            b.insert(k, v)
        } else {
            a.insert(k, v)
        };
    }
    candle_core::safetensors::save(&a, d.path().join("model-00001-of-00002.safetensors")).unwrap();
    candle_core::safetensors::save(&b, d.path().join("model-00002-of-00002.safetensors")).unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(d.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    let got = pretrained::load(d.path()).unwrap();
    let want = pretrained::load(Path::new(GELU)).unwrap();
    assert_eq!(got.tensors.len(), want.tensors.len());
    for (k, t) in &want.tensors {
        assert_eq!(to_f64(&got.tensors[k]).unwrap(), to_f64(t).unwrap(), "{k}");
    }
}

fn corpus(dir: &Path) -> PathBuf {
    let path = dir.join("corpus.txt");
    let text: String =
        (0..400).map(|i| format!("line {i}: the quick brown fox jumps over the lazy dog.\n")).collect();
    std::fs::write(&path, text).unwrap();
    path
}

fn run_config(data: PathBuf, kind: Kind, ranks: usize) -> RunConfig {
    let model = pretrained::load_config(Path::new(GELU)).unwrap();
    RunConfig {
        model_name: GELU.into(),
        model,
        kind,
        schedule_file: None,
        group: None,
        mem_cap: None,
        ranks,
        stages_per_rank: kind.default_stages_per_rank(),
        microbatches: 4,
        microbatch_size: 2,
        dp: 1,
        fsdp: false,
        ep: 1,
        tp: 1,
        sequence_parallel: false,
        timeout: 300.0,
        device: Default::default(),
        post_validate: false,
        seq_len: 8,
        layers_per_stage: None,
        steps: 3,
        lr: 1e-2,
        min_lr: 1e-3,
        warmup: 1,
        weight_decay: 0.01,
        grad_clip: Some(1.0),
        seed: 0,
        data: Some(data),
        init_from: Some(GELU.into()),
        recompute: graphpp_models::Recompute::SaveAll,
        dtype: graphpp_graph::DType::F32,
        expert_bias_update: 0.001,
        link: None,
    }
}

#[test]
fn training_starts_from_the_folder_and_tied_copies_stay_equal() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let want = pretrained::load(Path::new(GELU)).unwrap().tensors;
    // 1F1B over 2 ranks: the embedding on rank 0, its copy for the LM head on rank 1.
    let cfg = run_config(data, Kind::OneFOneB, 2);
    let mut run = Run::new(cfg.clone()).unwrap();
    let start = run.trainer().parameters();
    assert_eq!(start.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
    for (k, t) in &want {
        assert_eq!(to_f64(&start[k]).unwrap(), to_f64(t).unwrap(), "{k}");
    }
    for _ in 0..3 {
        let r = run.step().unwrap();
        assert!(r.stats.loss.is_finite());
    }
    let copies: Vec<Vec<f64>> = run
        .trainer()
        .ranks()
        .iter()
        .flat_map(|w| w.stages().values())
        .filter_map(|s| s.parameters().get("model.embed_tokens.weight").map(|t| to_f64(t).unwrap()))
        .collect();
    assert_eq!(copies.len(), 2);
    assert_eq!(copies[0], copies[1], "the tied copies diverged");
    assert_ne!(copies[0], to_f64(&want["model.embed_tokens.weight"]).unwrap(), "the embedding did not train");
    // A checkpoint holds the tied matrix once, under the embedding's name.
    let ck = d.path().join("ck");
    let sidecar = run.save(&ck, None).unwrap().unwrap();
    let st = candle_core::safetensors::load(sidecar.with_extension("safetensors"), &Device::Cpu).unwrap();
    assert!(st.contains_key("model.embed_tokens.weight") && !st.contains_key("lm_head.weight"));
    // Resuming under ZB-V on one rank (it holds both the first and the last stage) gives both
    // copies the checkpoint's matrix.
    let mut again = Run::new(RunConfig { kind: Kind::Zbv, ranks: 1, stages_per_rank: 2, ..cfg }).unwrap();
    again.resume(&ck).unwrap();
    let embeds: Vec<Vec<f64>> = again
        .trainer()
        .ranks()
        .iter()
        .flat_map(|w| w.stages().values())
        .filter_map(|s| s.parameters().get("model.embed_tokens.weight").map(|t| to_f64(t).unwrap()))
        .collect();
    assert_eq!(embeds, vec![copies[0].clone(), copies[0].clone()]);
}

/// A weight of NaNs (or with an infinity) is refused on load, naming it; it failed at the first
/// step naming no tensor.
#[test]
fn a_tensor_that_is_not_finite_is_named() {
    let d = edited(GELU, |t, _| {
        let w = t["model.layers.1.mlp.down_proj.weight"].clone();
        let mut v = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v[3] = f32::NAN;
        v[7] = f32::INFINITY;
        t.insert(
            "model.layers.1.mlp.down_proj.weight".into(),
            Tensor::from_vec(v, w.dims(), &Device::Cpu).unwrap(),
        );
    });
    let e = load_err(d.path());
    match &e {
        PretrainedError::NotFinite { name, count, .. } => {
            assert_eq!((name.as_str(), *count), ("model.layers.1.mlp.down_proj.weight", 2))
        }
        e => panic!("{e}"),
    }
    assert!(
        e.to_string()
            .contains("tensor `model.layers.1.mlp.down_proj.weight` holds 2 NaN or infinite value(s)"),
        "{e}"
    );
}
