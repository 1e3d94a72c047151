//! `graphpp train` end to end on a small corpus: outputs, checkpoints, exact resume, the trace,
//! and the errors bad input gets (with no checkpoint written).

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use graphpp::train::{Run, RunConfig, RunError};
use graphpp_models::{LlamaConfig, Recompute};
use graphpp_schedule::Kind;

fn graphpp() -> Command {
    Command::cargo_bin("graphpp").expect("binary builds")
}

/// A 24 KB corpus with learnable structure.
fn corpus(dir: &Path) -> PathBuf {
    let lines = [
        "To be, or not to be, that is the question:\n",
        "Whether 'tis nobler in the mind to suffer\n",
        "The slings and arrows of outrageous fortune,\n",
        "Or to take arms against a sea of troubles\n",
    ];
    let text: String = (0..150).map(|i| lines[i % 4]).collect();
    let path = dir.join("corpus.txt");
    std::fs::write(&path, text).unwrap();
    path
}

/// Small-shape flags shared by the CLI tests.
const SMALL: [&str; 8] =
    ["--microbatch-size", "2", "--seq-len", "16", "--microbatches", "4", "--sample-bytes", "20"];

fn config(data: PathBuf, kind: Kind) -> RunConfig {
    RunConfig {
        model_name: "tiny".into(),
        model: graphpp_models::ModelConfig::Llama(LlamaConfig::tiny()),
        kind,
        schedule_file: None,
        group: None,
        mem_cap: None,
        ranks: 2,
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
        seq_len: 16,
        layers_per_stage: None,
        steps: 15,
        lr: 1e-2,
        min_lr: 1e-3,
        warmup: 3,
        weight_decay: 0.01,
        grad_clip: Some(1.0),
        seed: 4,
        data: Some(data),
        recompute: Recompute::SaveAll,
        init_from: None,
        dtype: graphpp_graph::DType::F32,
        expert_bias_update: 0.001,
        link: None,
    }
}

/// Runs `steps` steps of `cfg`, writing a checkpoint into `dir` after step `at`; returns the run
/// and its losses.
fn run_saving_at(cfg: RunConfig, steps: usize, at: usize, dir: &Path) -> (Run, Vec<f64>) {
    let mut run = Run::new(cfg).unwrap();
    let mut losses = Vec::new();
    for k in 1..=steps {
        losses.push(run.step().unwrap().stats.loss);
        if k == at {
            run.save(dir, None).unwrap();
        }
    }
    (run, losses)
}

/// A checkpoint after step 5 and a resumed run give bitwise the losses of steps 6..15 of an
/// uninterrupted run, and the same validation loss at the end.
#[test]
fn resume_reproduces_the_next_ten_losses() {
    let d = tempfile::tempdir().unwrap();
    let cfg = config(corpus(d.path()), Kind::Zbv);
    let ck = d.path().join("ck");
    let (mut straight, losses) = run_saving_at(cfg.clone(), 15, 5, &ck);
    assert!(losses[14] < losses[0] - 0.5, "the run learns: {losses:?}");
    let mut resumed = Run::new(cfg).unwrap();
    assert_eq!(resumed.resume(&ck).unwrap(), 5);
    let again: Vec<f64> = (0..10).map(|_| resumed.step().unwrap().stats.loss).collect();
    assert_eq!(again, losses[5..].to_vec());
    assert_eq!(resumed.evaluate().unwrap(), straight.evaluate().unwrap());
}

/// A checkpoint does not depend on the pipeline layout: resumed under 1F1B (p = 2, v = 1) the
/// losses continue within f32 rounding of the ZB-V run.
#[test]
fn resume_under_another_schedule() {
    let d = tempfile::tempdir().unwrap();
    let zbv = config(corpus(d.path()), Kind::Zbv);
    let (_, losses) = run_saving_at(zbv.clone(), 8, 4, d.path());
    let mut other = Run::new(RunConfig { kind: Kind::OneFOneB, stages_per_rank: 1, ..zbv }).unwrap();
    other.resume(d.path()).unwrap();
    for want in &losses[4..] {
        let got = other.step().unwrap().stats.loss;
        assert!((got - want).abs() < 1e-5 * want, "{got} vs {want}");
    }
}

/// Data parallelism is a layout too: a dp = 1 checkpoint resumed with dp = 2 (each replica runs
/// one of the two sequences of every microbatch) continues the losses within f32 rounding.
#[test]
fn resume_with_data_parallel_replicas() {
    let d = tempfile::tempdir().unwrap();
    let cfg = config(corpus(d.path()), Kind::OneFOneB);
    let (_, losses) = run_saving_at(cfg.clone(), 6, 3, d.path());
    let mut dp = Run::new(RunConfig { dp: 2, ..cfg }).unwrap();
    dp.resume(d.path()).unwrap();
    for want in &losses[3..] {
        let got = dp.step().unwrap().stats.loss;
        assert!((got - want).abs() < 1e-5 * want, "{got} vs {want}");
    }
}

/// Resuming with a setting that changes the loss sequence names the setting.
#[test]
fn resume_with_other_settings_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let cfg = config(corpus(d.path()), Kind::Zbv);
    let mut run = Run::new(cfg.clone()).unwrap();
    run.step().unwrap();
    run.save(d.path(), None).unwrap();
    let mut other = Run::new(RunConfig { seq_len: 8, ..cfg }).unwrap();
    match other.resume(d.path()) {
        Err(e @ RunError::Resume { .. }) => assert!(e.to_string().contains("seq_len = 16"), "{e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn trains_evaluates_checkpoints_and_traces() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let trace = d.path().join("trace.json");
    let ck = d.path().join("ck");
    let out = graphpp()
        .args(["train", "--data", data.to_str().unwrap(), "--steps", "6", "--eval-every", "3"])
        .args(SMALL)
        .args(["--trace", trace.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap()])
        .args(["--metrics", d.path().join("m.jsonl").to_str().unwrap()])
        .args(["--report", d.path().join("report").to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The report: a row per evaluation (the logged values), the strategy, both timelines.
    let page = std::fs::read_to_string(d.path().join("report/index.html")).unwrap();
    for m in losses(&d.path().join("m.jsonl")).iter().filter(|m| m["val_loss"].is_f64()) {
        let row = format!(
            "<tr><td>{}</td><td>{:.4}</td><td>{:.4}</td>",
            m["step"],
            m["loss"].as_f64().unwrap(),
            m["val_loss"].as_f64().unwrap()
        );
        assert!(page.contains(&row), "{row} missing");
    }
    assert!(page.contains("<td>zbv p=2 v=2 m=4</td>") && page.contains("<td>pointwise</td>"), "strategy");
    assert_eq!(page.matches("<svg").count(), 4, "loss, tokens/s, measured and predicted timelines");
    assert!(stdout.contains("schedule zbv p=2 v=2 m=4, B=2 T=16 (128 tokens/step)"), "{stdout}");
    let evals: Vec<&str> = stdout.lines().filter(|l| l.contains("val loss")).collect();
    assert_eq!(evals.len(), 2, "{stdout}");
    assert!(evals[0].starts_with("step      3") && evals[1].starts_with("step      6"), "{stdout}");
    assert!(stdout.contains("sample (temperature 0.8, top-k 40):\nROMEO:"), "{stdout}");
    assert!(stdout.contains("bubble (median of the last 6 steps): measured r = "), "{stdout}");
    let metrics = losses(&d.path().join("m.jsonl"));
    assert_eq!(metrics.iter().map(|m| m["step"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
    let vals: Vec<bool> = metrics.iter().map(|m| m["val_loss"].is_f64()).collect();
    assert_eq!(vals, [false, false, true, false, false, true]);
    let last = format!("val loss {:.4}", metrics[5]["val_loss"].as_f64().unwrap());
    assert!(evals[1].contains(&last), "{} vs {last}", evals[1]);
    for step in ["000003", "000006"] {
        assert!(ck.join(format!("step-{step}.json")).is_file());
        assert!(ck.join(format!("step-{step}.safetensors")).is_file());
    }
    let t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().or(t.as_array()).unwrap();
    let names: Vec<&str> =
        events.iter().filter(|e| e["ph"] == "X").filter_map(|e| e["name"].as_str()).collect();
    // 6 steps × (2 ranks × 2 stages × 4 microbatches) × F, I, W, plus SEND/RECV.
    for kind in ["F", "I", "W"] {
        let is = |n: &str| {
            let body = n.trim_start_matches(|c: char| c.is_ascii_digit());
            body.strip_prefix(kind).is_some_and(|mb| mb.chars().all(|c| c.is_ascii_digit()))
        };
        let n = names.iter().filter(|n| is(n)).count();
        assert_eq!(n, 6 * 16, "{kind} events");
    }
}

/// Runs `graphpp train` on `data` with [`SMALL`], `length` (steps, evaluation) and `--metrics
/// dir/<name>` plus the extra flags given to the returned closure; each run must succeed.
fn metered_runs<'a>(data: &'a Path, dir: &'a Path, length: [&'a str; 4]) -> impl Fn(&str, &[&str]) + 'a {
    move |metrics: &str, extra: &[&str]| {
        let out = graphpp()
            .args(["train", "--data", data.to_str().unwrap()])
            .args(length)
            .args(SMALL)
            .args(["--metrics", dir.join(metrics).to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

fn losses(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Through the CLI: stopped after step 5 and resumed, the run logs bitwise the train losses,
/// learning rates and validation losses of an uninterrupted run for steps 6..15.
#[test]
fn cli_resume_continues_the_loss_sequence() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let run = metered_runs(&data, d.path(), ["--steps", "15", "--eval-every", "5"]);
    run("a.jsonl", &[]);
    run("b.jsonl", &["--stop-after", "5", "--checkpoint-dir", ck.to_str().unwrap()]);
    run("b.jsonl", &["--resume", "--checkpoint-dir", ck.to_str().unwrap()]);
    let (a, b) = (losses(&d.path().join("a.jsonl")), losses(&d.path().join("b.jsonl")));
    assert_eq!(b.len(), 15);
    for (x, y) in a.iter().zip(&b) {
        for key in ["step", "loss", "lr", "grad_norm", "val_loss"] {
            assert_eq!(x[key], y[key], "{key} at step {}", x["step"]);
        }
    }
}

/// Through the CLI: `--tp 2` (four threads: two pipeline ranks of two tensor-parallel ranks)
/// logs `--tp 1`'s losses within 1e-5 for 20 steps, and its checkpoint at step 10 resumes at
/// `--tp 1`, continuing them.
#[test]
fn tensor_parallel_training_logs_the_losses_of_one_rank_per_stage() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let run = metered_runs(&data, d.path(), ["--steps", "20", "--eval-every", "10"]);
    run("tp1.jsonl", &[]);
    run("tp2.jsonl", &["--tp", "2"]);
    run("moved.jsonl", &["--tp", "2", "--stop-after", "10", "--checkpoint-dir", ck.to_str().unwrap()]);
    run("moved.jsonl", &["--tp", "1", "--resume", "--checkpoint-dir", ck.to_str().unwrap()]);
    let tp1 = losses(&d.path().join("tp1.jsonl"));
    for file in ["tp2.jsonl", "moved.jsonl"] {
        let other = losses(&d.path().join(file));
        assert_eq!(other.len(), 20, "{file}");
        for (x, y) in tp1.iter().zip(&other) {
            let (a, b) = (x["loss"].as_f64().unwrap(), y["loss"].as_f64().unwrap());
            assert!((a - b).abs() <= 1e-5 * a.abs(), "{file} step {}: {b} vs {a}", x["step"]);
        }
        let ranks = other.last().unwrap()["resident_bytes"].as_array().unwrap().len();
        assert_eq!(ranks, if file == "tp2.jsonl" { 4 } else { 2 }, "{file}: one entry per rank");
    }
}

/// DualPipeV at `--tp 2` over a slow emulated link (2 ms, 1 GB/s): the stage graphs' tensor-
/// parallel collectives are measured as in-graph collectives — two all-reduces per layer in each
/// F and each B: 4 microbatches × 2 one-layer stages × 4 = 32 per rank; rank 0 (stages 0 and 3)
/// also runs per microbatch the vocabulary-parallel embedding's all-reduce, the cross-entropy's
/// all-gather and two all-reduces, and the LM head's input-gradient all-reduce: 52; the mean
/// over the 2 ranks is 42 — and the overlapped forward and backward (OVERLAP_F_B) hide part of
/// their time behind other work.
#[test]
fn tensor_parallel_all_reduces_overlap_under_dualpipev() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let out = graphpp()
        .args(["train", "--data", data.to_str().unwrap(), "--steps", "3", "--eval-every", "3"])
        .args(SMALL)
        .args(["--schedule", "dualpipev", "--tp", "2", "--link", "2000,1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find(|l| l.starts_with("in-graph collectives")).expect("a collectives line");
    let number = |after: &str| -> f64 {
        let rest = &line[line.find(after).unwrap_or_else(|| panic!("{after} in {line}")) + after.len()..];
        rest.trim_start().split([',', ' ']).next().unwrap().parse().unwrap()
    };
    assert_eq!(number("(per rank and step):"), 42.0, "{line}");
    assert!(number("in flight") > 0.0 && number("ms,") > 0.0, "some all-reduce time overlapped: {line}");
}

/// Each bad input fails with exit 1, an error naming the problem, and no checkpoint.
#[test]
fn bad_input_is_a_clear_error_without_checkpoints() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let data = data.to_str().unwrap();
    let ck = d.path().join("ck");
    let cases: [(&[&str], &str); 13] = [
        (&["--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
        (&["--data", data, "--ranks", "0"], "--ranks must be at least 1"),
        (&["--data", data, "--schedule", "1f1b", "--ranks", "3"], "--layers-per-stage"),
        (&["--data", data, "--schedule", "dualpipev", "--ranks", "4"], "m >= 2p"),
        (&["--data", data, "--layers-per-stage", "2,2,1,1"], "must be 4 numbers adding up to 4"),
        (&["--data", data, "--prompt", ""], "--prompt is empty"),
        (&["--data", data, "--grad-clip", "-1"], "--grad-clip -1 must be a finite number >= 0"),
        (
            &["--data", data, "--trace", "/nonexistent/dir/t.json"],
            "the folder /nonexistent/dir does not exist",
        ),
        (&["--data", data, "--lr", "0"], "peak learning rate 0 must be finite and > 0"),
        (&["--data", data, "--dp", "3"], "--dp 3 does not divide --microbatch-size 2"),
        (
            &["--data", data, "--tp", "3"],
            "--tp 3: tensor parallelism: config field `num_attention_heads` = 4",
        ),
        (&["--data", data, "--tp", "0"], "--tp must be at least 1"),
        (
            &["--data", data, "--tp", "1", "--sequence-parallel"],
            "--sequence-parallel splits the sequence over the tensor-parallel ranks: it needs --tp 2 or more",
        ),
    ];
    // Without --tp at all, --sequence-parallel is a usage error (clap's exit 2).
    let out = graphpp().args(["train", "--data", data, "--sequence-parallel"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tp <TP>"));
    for (args, want) in cases {
        let out = graphpp()
            .arg("train")
            .args(SMALL)
            .args(args)
            .args(["--steps", "2", "--checkpoint-dir", ck.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.matches(want).count(), 1, "the cause is not repeated: {err}");
        // A run that cannot start says why, without a warning about how it would have run.
        assert!(!err.contains("exceed this machine's"), "{args:?}: {err}");
        assert!(!ck.exists(), "{args:?} wrote a checkpoint");
    }
}

/// A corrupt checkpoint (tensor bytes changed after saving) is refused naming the file.
#[test]
fn corrupt_checkpoint_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let run = |extra: &[&str]| {
        graphpp()
            .args(["train", "--data", data.to_str().unwrap(), "--steps", "2", "--eval-every", "1"])
            .args(SMALL)
            .args(["--checkpoint-dir", ck.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap()
    };
    assert!(run(&["--stop-after", "1"]).status.success());
    let st = ck.join("step-000001.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x55;
    std::fs::write(&st, bytes).unwrap();
    let out = run(&["--resume"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("step-000001.safetensors") && err.contains("corrupt checkpoint"), "{err}");
    assert!(!ck.join("step-000002.json").exists(), "no checkpoint after a failed resume");
}

/// Output paths are checked before the first step: a checkpoint "folder" that is a file,
/// resuming from a folder that does not exist (which is not created), unwritable folders.
#[test]
fn bad_output_paths_fail_before_training() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let file = d.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let run = |extra: &[&str]| {
        let out = graphpp()
            .args(["train", "--data", data.to_str().unwrap(), "--steps", "2"])
            .args(SMALL)
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        assert!(!String::from_utf8_lossy(&out.stdout).contains("val loss"), "no step ran");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&["--checkpoint-dir", file.to_str().unwrap()]);
    assert!(err.contains("--checkpoint-dir") && err.contains("exists and is not a folder"), "{err}");
    let missing = d.path().join("none");
    let err = run(&["--checkpoint-dir", missing.to_str().unwrap(), "--resume"]);
    assert!(err.contains(&format!("the checkpoint folder {} does not exist", missing.display())), "{err}");
    assert!(!missing.exists(), "--resume of a missing folder created it");
    // Folders nobody can write into (even root: /proc takes no new files), and a folder given
    // as the trace file.
    let err = run(&["--trace", "/proc/graphpp-trace.json"]);
    assert!(err.contains("--trace /proc/graphpp-trace.json: cannot write into /proc"), "{err}");
    let err = run(&["--checkpoint-dir", "/proc/graphpp-ck"]);
    assert!(err.contains("--checkpoint-dir /proc/graphpp-ck: cannot write there"), "{err}");
    let err = run(&["--trace", d.path().to_str().unwrap()]);
    assert!(err.contains("is a folder; give a file path"), "{err}");
    let err = run(&["--report", "/proc/graphpp-report"]);
    assert!(err.contains("--report /proc/graphpp-report: cannot write there"), "{err}");
    let err = run(&["--metrics", "/proc/graphpp-metrics.jsonl"]);
    assert!(err.contains("--metrics /proc/graphpp-metrics.jsonl: cannot write into /proc"), "{err}");
}

/// Each evaluation line shows the achieved model FLOP/s and the peak memory of every rank; the
/// metrics log them per step (FLOP/s = model FLOPs per token × tokens/s); `--recompute` is in
/// the header and gives the same losses as saving everything.
#[test]
fn eval_lines_show_flops_and_memory_and_recompute_keeps_losses() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let run = |metrics: &str, recompute: &str| {
        let out = graphpp()
            .args(["train", "--data", data.to_str().unwrap(), "--steps", "4", "--eval-every", "2"])
            .args(SMALL)
            .args(["--recompute", recompute, "--metrics", d.path().join(metrics).to_str().unwrap()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let stdout = run("a.jsonl", "save-all");
    assert!(stdout.contains("recompute save-all"), "{stdout}");
    let evals: Vec<&str> = stdout.lines().filter(|l| l.contains("val loss")).collect();
    assert_eq!(evals.len(), 2, "{stdout}");
    let per_token = graphpp_models::flops_per_token(&LlamaConfig::tiny(), 16);
    for m in losses(&d.path().join("a.jsonl")) {
        let peaks: Vec<u64> =
            m["peak_bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).collect();
        assert_eq!(peaks.len(), 2, "one figure per rank");
        // Each rank holds half the tiny model's 0.23M parameters: 4 copies of f32 ≈ 1.8 MB.
        assert!(peaks.iter().all(|&b| b > 1_500_000 && b < 10_000_000), "{peaks:?}");
        let want = per_token * m["tokens_per_s"].as_f64().unwrap();
        assert!((m["flops_per_s"].as_f64().unwrap() / want - 1.0).abs() < 1e-9);
        if let Some(v) = m["val_loss"].as_f64() {
            let line = evals
                .iter()
                .find(|l| l.starts_with(&format!("step {:>6}", m["step"].as_u64().unwrap())))
                .unwrap();
            let mib: Vec<String> = peaks.iter().map(|b| format!("{:.2}", *b as f64 / 1048576.0)).collect();
            assert!(line.contains(&format!("peak MiB/rank {}", mib.join("/"))), "{line}");
            assert!(line.contains(" GFLOP/s") && line.contains(&format!("val loss {v:.4}")), "{line}");
        }
    }
    let stdout = run("b.jsonl", "layers");
    assert!(stdout.contains("recompute layers"), "{stdout}");
    let (a, b) = (losses(&d.path().join("a.jsonl")), losses(&d.path().join("b.jsonl")));
    for (x, y) in a.iter().zip(&b) {
        let (lx, ly) = (x["loss"].as_f64().unwrap(), y["loss"].as_f64().unwrap());
        assert!((lx - ly).abs() <= 1e-6 * lx.abs(), "step {}: {lx} vs {ly}", x["step"]);
    }
    // The default recomputes pointwise values inside the fused backward: save-all's losses bit
    // for bit, in less memory on every rank.
    let stdout = run("c.jsonl", "pointwise");
    assert!(stdout.contains("recompute pointwise"), "{stdout}");
    let c = losses(&d.path().join("c.jsonl"));
    let peaks = |m: &serde_json::Value| -> Vec<u64> {
        m["peak_bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).collect()
    };
    for (x, z) in a.iter().zip(&c) {
        assert_eq!(x["loss"].as_f64(), z["loss"].as_f64(), "step {}", x["step"]);
        assert!(peaks(z).iter().zip(peaks(x)).all(|(p, s)| *p < s), "{:?} vs {:?}", peaks(z), peaks(x));
    }
}

/// `--model moe-tiny` trains: the header names the MoE layout, every evaluation line gives the
/// least balanced layer's expert load (min ≤ max, within the step's B·T·k = 64 routed tokens),
/// and the balancing flag is checked before training.
#[test]
fn moe_model_trains_and_reports_its_expert_load() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let out = graphpp()
        .args(["train", "--data", data.to_str().unwrap(), "--steps", "2", "--eval-every", "1"])
        .args(SMALL)
        .args(["--model", "moe-tiny", "--schedule", "dualpipev"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("3 MoE: 8 routed experts (2 per token) + 1 shared"), "{stdout}");
    let evals: Vec<&str> = stdout.lines().filter(|l| l.contains("val loss")).collect();
    assert_eq!(evals.len(), 2, "{stdout}");
    for l in evals {
        let load = &l[l.find("expert load ").expect("an expert load") + "expert load ".len()..];
        let (min, rest) = load.split_once('–').unwrap();
        let max: u64 = rest.split(' ').next().unwrap().parse().unwrap();
        assert!(min.parse::<u64>().unwrap() <= max && max <= 4 * 2 * 16 * 2, "{l}");
    }
    let out = graphpp()
        .args(["train", "--data", data.to_str().unwrap(), "--steps", "1", "--expert-bias-update", "-1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--expert-bias-update -1 must be"));
}

/// `--link` is named in the header and in the bubble prediction (which charges its hand-over
/// time); a malformed link is refused before training.
#[test]
fn an_emulated_link_is_reported() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let out = graphpp()
        .args(["train", "--data", data.to_str().unwrap(), "--steps", "2", "--eval-every", "2"])
        .args(SMALL)
        .args(["--link", "100,1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(", emulated link 100 µs, 1 GB/s,"), "{stdout}");
    // B=2, T=16, D=64 in f32: 8 KiB a hand-over, 100 µs + 8.2 µs.
    assert!(stdout.contains("and the emulated link (0.108 ms a hand-over)"), "{stdout}");
    let out = graphpp().args(["train", "--data", data.to_str().unwrap(), "--link", "fast"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected LATENCY_US,GBPS"));
}

/// Multi-token prediction's cross-entropy is logged on train's step lines and in `--metrics`,
/// apart from the train loss, and it falls as the module trains (2 steps at lr 1e-2).
#[test]
fn the_mtp_loss_is_logged() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let metrics = d.path().join("m.jsonl");
    let out = graphpp()
        .args(["train", "--model", "moe-mla-tiny-mtp", "--steps", "3", "--seq-len", "16", "--lr", "1e-2"])
        .args(["--eval-every", "0", "--sample-bytes", "0", "--data"])
        .arg(&data)
        .arg("--metrics")
        .arg(&metrics)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("mtp loss "), "{text}");
    let mtp: Vec<f64> = losses(&metrics).iter().map(|l| l["mtp_loss"].as_f64().unwrap()).collect();
    assert!(mtp.len() == 3 && mtp[2] < mtp[0], "{mtp:?}");
}
