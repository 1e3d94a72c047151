//! `--init-from DIR` end to end: `graphpp verify` and `graphpp train` start from a Hugging Face
//! model folder (the fixture written by `tools/torch/hf_llama_logits.py`: tied embeddings, GQA,
//! head_dim ≠ hidden/heads, biases, GELU; and `hf_deepseek_logits.py`'s DeepSeek-V3); `--model`
//! with it is a usage error; an unsupported
//! config field fails naming the field.

use assert_cmd::Command;
use std::path::Path;

const GELU: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf-tiny-llama-gelu");
const DEEPSEEK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf-tiny-deepseek-v3");

fn graphpp(args: &[&str]) -> (bool, Option<i32>, String, String) {
    let out = Command::cargo_bin("graphpp").expect("binary builds").args(args).output().unwrap();
    let s = |b: Vec<u8>| String::from_utf8(b).unwrap();
    (out.status.success(), out.status.code(), s(out.stdout), s(out.stderr))
}

/// `graphpp verify --init-from dir --seq-len 8` with each of `cases` appended passes, names the
/// folder as `shown`, and starts from the folder's weights, not a seeded init: the loss on random
/// tokens is far above ln 256 (the fixtures' large weights give confident, mostly wrong logits).
fn verify_pretrained(dir: &str, shown: &str, cases: &[&[&str]]) {
    for args in cases {
        let mut all = vec!["verify", "--init-from", dir, "--seq-len", "8"];
        all.extend_from_slice(args);
        let (ok, _, out, err) = graphpp(&all);
        assert!(ok, "{args:?}: {out}{err}");
        assert!(out.contains(shown) && out.contains("PASS"), "{out}");
        let line = out.lines().find(|l| l.starts_with("loss single device")).unwrap();
        let loss: f64 = line.split_whitespace().nth(3).unwrap().parse().unwrap();
        assert!(loss > 6.0, "{line}");
    }
}

/// A DeepSeek-V3 folder (`tools/torch/hf_deepseek_logits.py`: MLA, YaRN, group-limited routing,
/// its routing biases) verifies under 1F1B over its 3 layers and under ZB-V on one rank.
#[test]
fn verify_a_pretrained_deepseek_v3_model() {
    verify_pretrained(
        DEEPSEEK,
        "hf-tiny-deepseek-v3, 3 layers",
        &[
            &["--schedule", "1f1b", "--ranks", "3", "--microbatches", "3"],
            &["--schedule", "zbv", "--ranks", "1", "--microbatches", "2", "--layers-per-stage", "2,1"],
        ],
    );
}

/// 1F1B: embedding on rank 0, its LM-head copy on rank 1; ZB-V on 1 rank: both on rank 0;
/// DualPipeV on 1 rank likewise; DualPipe: two pipeline copies, so four copies of the matrix
/// whose gradients add up — all equal one device.
#[test]
fn verify_a_tied_pretrained_model_under_pipelines() {
    let b = ["--microbatch-size", "2", "--microbatches"];
    verify_pretrained(
        GELU,
        "hf-tiny-llama-gelu, 2 layers",
        &[
            &[&b[..], &["4", "--schedule", "1f1b", "--ranks", "2"]].concat(),
            &[&b[..], &["4", "--schedule", "dualpipe", "--ranks", "2"]].concat(),
            &[&b[..], &["3", "--schedule", "zbv", "--ranks", "1"]].concat(),
            &[&b[..], &["2", "--schedule", "dualpipev", "--ranks", "1"]].concat(),
        ],
    );
}

#[test]
fn train_from_a_pretrained_folder_and_checkpoint_the_tied_matrix_once() {
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ck");
    let out = train_from(GELU, d.path(), &ck, ["--ranks", "2", "--sample-bytes", "4"]);
    assert!(out.contains("hf-tiny-llama-gelu (2 layers"), "{out}");
    let st = candle_core::safetensors::load(ck.join("step-000002.safetensors"), &candle_core::Device::Cpu)
        .unwrap();
    assert!(st.contains_key("model.embed_tokens.weight"), "{:?}", st.keys());
    assert!(!st.contains_key("lm_head.weight"));
    assert!(st.contains_key("model.layers.1.self_attn.q_proj.bias"));
    assert_eq!(st["model.layers.1.self_attn.q_proj.weight"].dims(), &[32, 24]);
}

/// Trains 2 steps of 1F1B from `dir` with a checkpoint in `ck` and `extra` flags (ranks, sample
/// bytes), writing the corpus into `tmp`; returns standard output.
fn train_from(dir: &str, tmp: &Path, ck: &Path, extra: [&str; 4]) -> String {
    let data = tmp.join("corpus.txt");
    let text: String =
        (0..300).map(|i| format!("{i}: a small corpus for a tiny pretrained model.\n")).collect();
    std::fs::write(&data, text).unwrap();
    let mut args = vec!["train", "--init-from", dir, "--schedule", "1f1b", "--steps", "2"];
    args.extend(["--microbatches", "2", "--microbatch-size", "2", "--seq-len", "8"]);
    args.extend(["--data", data.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap()]);
    args.extend(extra);
    let (ok, _, out, err) = graphpp(&args);
    assert!(ok, "{out}{err}");
    out
}

/// `graphpp export` writes a trained checkpoint as a Hugging Face folder: the config reads back
/// as the model trained (Llama with tied embeddings and biases; DeepSeek-V3 with MLA), the
/// weights are the checkpoint's parameters bit for bit (the DeepSeek routing biases included,
/// the AdamW moments not), `--init-from` verifies from it; a folder that already holds a model
/// is not overwritten, and a file that is no checkpoint is refused naming it.
#[test]
fn a_checkpoint_exports_as_a_folder_that_init_from_reads() {
    for (dir, tensors) in [(GELU, 34), (DEEPSEEK, 0)] {
        let d = tempfile::tempdir().unwrap();
        let (ck, hf) = (d.path().join("ck"), d.path().join("hf"));
        train_from(dir, d.path(), &ck, ["--ranks", "1", "--sample-bytes", "0"]);
        let (ok, _, out, err) = graphpp(&["export", ck.to_str().unwrap(), "--output", hf.to_str().unwrap()]);
        assert!(ok, "{out}{err}");
        assert!(out.contains("(step 2)"), "{out}");
        let exported = graphpp::pretrained::load(&hf).unwrap();
        let original = graphpp::pretrained::load_config(Path::new(dir)).unwrap();
        assert_eq!(exported.config, original, "{dir}: the config reads back as the model trained");
        let saved =
            candle_core::safetensors::load(ck.join("step-000002.safetensors"), &candle_core::Device::Cpu)
                .unwrap();
        let same = |a: &candle_core::Tensor, b: &candle_core::Tensor| {
            a.dims() == b.dims()
                && a.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                    == b.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        for (name, t) in &exported.tensors {
            assert!(same(t, &saved[name]), "{name} differs from the checkpoint");
        }
        let hf_names: Vec<String> =
            candle_core::safetensors::load(hf.join("model.safetensors"), &candle_core::Device::Cpu)
                .unwrap()
                .into_keys()
                .collect();
        assert!(hf_names.iter().all(|n| !n.starts_with("adam.")), "{hf_names:?}");
        if tensors > 0 {
            assert_eq!(hf_names.len(), tensors, "{hf_names:?}");
        } else {
            assert!(hf_names.iter().any(|n| n.ends_with("e_score_correction_bias")), "{hf_names:?}");
        }
        verify_pretrained(
            hf.to_str().unwrap(),
            "hf",
            &[&["--schedule", "1f1b", "--ranks", "1", "--microbatches", "2"]],
        );
        let (ok, code, _, err) = graphpp(&["export", ck.to_str().unwrap(), "--output", hf.to_str().unwrap()]);
        assert!(!ok && code == Some(1) && err.contains("already exists"), "{err}");
        let tensors = ck.join("step-000002.safetensors");
        let (ok, _, _, err) = graphpp(&["export", tensors.to_str().unwrap(), "--output", "/tmp/unused"]);
        assert!(!ok && err.contains("give its sidecar") && err.contains("step-000002.json"), "{err}");
    }
    let d = tempfile::tempdir().unwrap();
    let junk = d.path().join("step-000001.json");
    std::fs::write(&junk, b"{}").unwrap();
    let (ok, _, _, err) =
        graphpp(&["export", junk.to_str().unwrap(), "--output", d.path().join("o").to_str().unwrap()]);
    assert!(!ok && err.contains("step-000001.json"), "{err}");
}

#[test]
fn init_from_excludes_model_and_layers() {
    for extra in [&["--model", "tiny"][..], &["--layers", "1"]] {
        for cmd in [&["train"][..], &["verify", "--schedule", "1f1b", "--ranks", "1", "--microbatches", "1"]]
        {
            let mut args = cmd.to_vec();
            args.extend_from_slice(&["--init-from", GELU]);
            args.extend_from_slice(extra);
            let (ok, code, _, err) = graphpp(&args);
            assert!(!ok && code == Some(2), "{args:?}: {err}");
            assert!(err.contains("--init-from") && err.contains("cannot be used with"), "{err}");
        }
    }
}

#[test]
fn an_unsupported_config_field_fails_naming_it() {
    let d = tempfile::tempdir().unwrap();
    std::fs::copy(Path::new(GELU).join("model.safetensors"), d.path().join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(Path::new(GELU).join("config.json")).unwrap()).unwrap();
    cfg["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 2.0});
    std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
    let dir = d.path().to_str().unwrap();
    for args in [
        &["train", "--init-from", dir][..],
        &["verify", "--init-from", dir, "--schedule", "1f1b", "--ranks", "1", "--microbatches", "1"],
    ] {
        let (ok, code, _, err) = graphpp(args);
        assert!(!ok && code == Some(1), "{err}");
        assert!(
            err.contains("config.json") && err.contains("`rope_scaling`") && err.contains("linear"),
            "{err}"
        );
    }
    // A folder without weights names the missing file.
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    std::fs::copy(Path::new(GELU).join("config.json"), d.path().join("config.json")).unwrap();
    let (ok, _, _, err) =
        graphpp(&["verify", "--init-from", dir, "--schedule", "1f1b", "--ranks", "1", "--microbatches", "1"]);
    assert!(!ok && err.contains("model.safetensors: missing"), "{err}");
}

/// A checkpoint of a model with the multi-token-prediction module exports its layer L with
/// DeepSeek-V3's names, and `--init-from` reads it back (the module is built, so its layer is
/// loaded, not skipped) and verifies.
#[test]
fn the_mtp_module_exports_and_loads_back() {
    let d = tempfile::tempdir().unwrap();
    let (ck, hf, data) = (d.path().join("ck"), d.path().join("hf"), d.path().join("c.txt"));
    std::fs::write(&data, "a small corpus for the multi-token-prediction module.\n".repeat(60)).unwrap();
    let mut args = vec!["train", "--model", "moe-mla-tiny-mtp", "--schedule", "1f1b", "--steps", "2"];
    args.extend(["--microbatches", "2", "--microbatch-size", "2", "--seq-len", "8", "--sample-bytes", "0"]);
    args.extend(["--data", data.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap()]);
    let (ok, _, out, err) = graphpp(&args);
    assert!(ok, "{out}{err}");
    let (ok, _, out, err) = graphpp(&["export", ck.to_str().unwrap(), "--output", hf.to_str().unwrap()]);
    assert!(ok, "{out}{err}");
    let exported = graphpp::pretrained::load(&hf).unwrap();
    assert_eq!(graphpp_models::Model::mtp_loss_weight(&exported.config), 0.3);
    assert!(exported.tensors.contains_key("model.layers.4.eh_proj.weight"), "the module was read back");
    let hf = hf.to_str().unwrap();
    let (ok, _, out, err) =
        graphpp(&["verify", "--init-from", hf, "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2"]);
    assert!(ok && out.contains("PASS"), "{out}{err}");
}
