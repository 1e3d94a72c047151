//! `--dtype bf16` end to end: `graphpp train` in bf16 mixed precision with f32
//! checkpoints, checkpoints from before `--dtype` resuming as f32, and `graphpp verify --dtype
//! bf16` against the one-device f32 step.

mod common;

use graphpp_runtime::kernels::bf16_gemm::Bf16Gemm;
use std::path::{Path, PathBuf};

use assert_cmd::Command;

fn graphpp() -> Command {
    Command::cargo_bin("graphpp").expect("binary builds")
}

/// The corpus of these tests ([`common::corpus`]).
fn corpus(dir: &Path) -> PathBuf {
    common::corpus(dir, 150)
}

const SMALL: [&str; 10] = [
    "--microbatch-size",
    "2",
    "--seq-len",
    "16",
    "--microbatches",
    "4",
    "--sample-bytes",
    "20",
    "--schedule",
    "1f1b",
];

fn train(data: &Path, ck: &Path, extra: &[&str]) -> std::process::Output {
    graphpp()
        .args(["train", "--data", data.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap()])
        .args(SMALL)
        .args(extra)
        .output()
        .unwrap()
}

fn train_losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter_map(|l| l.split("train loss ").nth(1))
        .map(|rest| rest.split_whitespace().next().unwrap().parse().unwrap())
        .collect()
}

/// bf16 training runs end to end, learns, writes f32 checkpoints that record the dtype, and a
/// resume under f32 is refused naming the dtype.
#[test]
fn train_dtype_bf16_end_to_end() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let out = train(&data, &ck, &["--dtype", "bf16", "--steps", "20", "--eval-every", "10", "--lr", "1e-2"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with("graphpp train: model tiny in bf16 mixed precision (4 layers"), "{stdout}");
    let path = graphpp_runtime::kernels::bf16_gemm::chosen().unwrap();
    assert!(stdout.lines().next().unwrap().contains(&format!(", bf16 matmuls on {path},")), "{stdout}");
    let losses = train_losses(&stdout);
    assert_eq!(losses.len(), 2, "{stdout}");
    assert!(losses[1] < 3.0, "20 bf16 steps learn the corpus (ln 256 = 5.55 at start): {stdout}");
    assert!(stdout.contains("sample (temperature 0.8, top-k 40):\nROMEO:"), "{stdout}");
    let sidecar: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("step-000020.json")).unwrap()).unwrap();
    assert_eq!(sidecar["state"]["config"]["dtype"], "bf16");
    let bytes = std::fs::read(ck.join("step-000020.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (name, view) in st.tensors() {
        if name != "adam.step" {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}: checkpoints stay f32");
        }
    }
    let out = train(&data, &ck, &["--steps", "20", "--resume"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            r#"it was written with dtype = "bf16", this run has "f32" (pass --dtype bf16 to resume it)"#
        ),
        "{err}"
    );
}

/// A checkpoint whose sidecar has no `dtype` (written before `--dtype` existed) resumes as f32:
/// the resumed run logs the same losses as the uninterrupted one.
#[test]
fn checkpoint_without_dtype_resumes_as_f32() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let out = train(&data, &ck, &["--steps", "6", "--eval-every", "3"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let straight = train_losses(&String::from_utf8_lossy(&out.stdout));
    let side = ck.join("step-000003.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&side).unwrap()).unwrap();
    assert_eq!(v["state"]["config"].as_object_mut().unwrap().remove("dtype"), Some("f32".into()));
    std::fs::write(&side, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    std::fs::remove_file(ck.join("step-000006.json")).unwrap();
    let out = train(&data, &ck, &["--steps", "6", "--eval-every", "3", "--resume"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("resumed run") && stdout.contains("at step 3"), "{stdout}");
    assert_eq!(train_losses(&stdout), straight[1..].to_vec());
}

/// `graphpp verify --dtype bf16` checks the pipelined bf16 step against one-device f32 at the
/// bf16 tolerance; an f32 tolerance rejects it; `--reference-dtype bf16` compares like with like.
#[test]
fn verify_dtype_bf16() {
    let args = ["verify", "--schedule", "zbv", "--ranks", "2", "--microbatches", "4", "--dtype", "bf16"];
    let out = graphpp().args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("seed 0, pipelined bf16 vs single device f32)"), "{stdout}");
    let path = graphpp_runtime::kernels::bf16_gemm::chosen().unwrap();
    assert!(stdout.lines().next().unwrap().contains(&format!(", bf16 matmuls on {path} (model")), "{stdout}");
    assert!(stdout.contains("PASS (tolerance 5e-2 relative)"), "{stdout}");
    let out = graphpp().args(args).args(["--tolerance", "1e-5"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("FAIL: difference above tolerance 1e-5") && !stderr.contains("MoE"), "{stderr}");
    // A MoE model in bf16 against f32 fails on rerouted tokens: the failure names the remedy.
    let out = graphpp().args(args).args(["--model", "moe-tiny"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("compare a MoE model in one dtype (e.g. --dtype bf16 --reference-dtype bf16)"),
        "{stderr}"
    );
    let out = graphpp()
        .args(["verify", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "1", "--dtype", "bf16"])
        .args(["--reference-dtype", "bf16"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("max abs difference 0.000e0"), "one microbatch: bitwise equal: {stdout}");
}

/// Only f32 and bf16 are compute dtypes (a value graphpp rejects: exit 1).
#[test]
fn unknown_dtype_is_a_usage_error() {
    for cmd in [
        &["train", "--dtype", "fp16"][..],
        &["verify", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--dtype", "f64"],
    ] {
        let out = graphpp().args(cmd).output().unwrap();
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("is not a compute dtype (expected f32 or bf16)"), "{err}");
    }
}

/// `GRAPHPP_BF16_GEMM` picks the bf16 matmul path: a path the CPU has runs (and the header names
/// it), one it does not know is refused at setup — before any rank starts — naming the variable
/// and the paths; an f32 run ignores it.
#[test]
fn the_bf16_path_is_chosen_by_the_environment_and_checked_at_setup() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let run = |path: &str, dtype: &str, ck: &str| {
        graphpp()
            .env("GRAPHPP_BF16_GEMM", path)
            .args(["train", "--data", data.to_str().unwrap(), "--checkpoint-dir"])
            .arg(d.path().join(ck))
            .args(SMALL)
            .args(["--dtype", dtype, "--steps", "2", "--eval-every", "0"])
            .output()
            .unwrap()
    };
    let out = run("widened", "bf16", "a");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(", bf16 matmuls on widened,"), "{stdout}");
    let out = run("tiles", "bf16", "b");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "GRAPHPP_BF16_GEMM=\"tiles\" names no bf16 matmul path (expected one of: amx, avx512-bf16, widened)"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("rank 0"), "refused before any rank ran: {stderr}");
    assert!(run("tiles", "f32", "c").status.success());
    // verify checks the reference step's path before either step runs, also where the pipelined
    // step runs candle's kernels (the reference runs the CPU's own).
    for kernels in ["compiled", "composed"] {
        let out = graphpp()
            .env("GRAPHPP_BF16_GEMM", "tiles")
            .env("GRAPHPP_KERNELS", kernels)
            .args(["verify", "--reference-dtype", "bf16", "--schedule", "1f1b", "--ranks", "2"])
            .args(["--microbatches", "2"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{kernels}: {stderr}");
        assert!(stderr.contains("GRAPHPP_BF16_GEMM=\"tiles\" names no bf16 matmul path"), "{stderr}");
        assert!(
            !stderr.contains("single-device step"),
            "{kernels}: refused at setup, not by the step: {stderr}"
        );
    }
    // On candle's kernels the variable names nothing that runs: not read, not named.
    let out = graphpp()
        .env("GRAPHPP_BF16_GEMM", "tiles")
        .env("GRAPHPP_KERNELS", "composed")
        .args(["train", "--data", data.to_str().unwrap(), "--checkpoint-dir"])
        .arg(d.path().join("e"))
        .args(SMALL)
        .args(["--dtype", "bf16", "--steps", "1", "--eval-every", "0"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("composed kernels") && !stdout.contains("bf16 matmuls on"), "{stdout}");
    // A path this process cannot run is refused the same way, saying why.
    if let Some(why) = Bf16Gemm::Amx.unavailable() {
        let out = run("amx", "bf16", "d");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(&format!("GRAPHPP_BF16_GEMM=amx: {why}; this process can run: ")),
            "{stderr}"
        );
    }
}
