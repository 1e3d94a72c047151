//! Runs never mix and interrupted work is kept: a checkpoint folder belongs to one
//! run; SIGTERM / SIGINT save the step in progress and exit 143 / 130; a resumed run's
//! `--metrics` holds each step once; `--resume` extends a finished run; `--resume-if-present`
//! serves a job that a cluster scheduler restarts.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{graphpp, output};
use graphpp::checkpoint;

/// The corpus of these tests ([`common::corpus`]).
fn corpus(dir: &Path) -> PathBuf {
    common::corpus(dir, 300)
}

/// `graphpp train` on the small corpus with small shapes, plus `extra`.
fn train(data: &Path, extra: &[&str]) -> std::process::Command {
    let mut c = graphpp();
    c.args(["train", "--data", data.to_str().unwrap(), "--microbatch-size", "2", "--seq-len", "16"])
        .args(["--microbatches", "4", "--sample-bytes", "0", "--threads-per-rank", "1"])
        .args(extra);
    c
}

/// The JSON lines of a metrics file.
fn metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn steps(m: &[serde_json::Value]) -> Vec<u64> {
    m.iter().map(|r| r["step"].as_u64().unwrap()).collect()
}

/// The run identity recorded in a checkpoint sidecar.
fn run_id(sidecar: &Path) -> String {
    checkpoint::load_sidecar(sidecar).unwrap().state["run_id"].as_str().unwrap().to_string()
}

/// A fresh run into a folder holding another run's checkpoints is refused, naming that run, and
/// changes nothing; `--start-over` replaces them with the new run's.
#[test]
fn a_checkpoint_folder_belongs_to_one_run() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let ck_flag = ["--checkpoint-dir", ck.to_str().unwrap()];
    output(train(&data, &[&["--steps", "4", "--eval-every", "2", "--seed", "1"], &ck_flag[..]].concat()), 0);
    let first = run_id(&ck.join("step-000004.json"));
    assert_eq!(first.len(), 16);
    let before = std::fs::read(ck.join("step-000002.safetensors")).unwrap();
    let (_, err) = output(
        train(&data, &[&["--steps", "3", "--eval-every", "1", "--seed", "2"], &ck_flag[..]].concat()),
        1,
    );
    assert!(err.contains(&format!("holds checkpoints of run {first} (newest: step 4)")), "{err}");
    assert!(err.contains("--start-over"), "{err}");
    assert_eq!(std::fs::read(ck.join("step-000002.safetensors")).unwrap(), before, "nothing overwritten");
    assert!(!ck.join("step-000001.json").exists());
    let args = [&["--steps", "3", "--eval-every", "1", "--seed", "2", "--start-over"], &ck_flag[..]].concat();
    output(train(&data, &args), 0);
    let names: Vec<String> = checkpoint::sidecars(&ck).unwrap().iter().map(|(s, _)| s.to_string()).collect();
    assert_eq!(names, ["1", "2", "3"], "the old run's step 4 is gone");
    let second = run_id(&ck.join("step-000003.json"));
    assert_ne!(second, first);
    assert_eq!(run_id(&ck.join("step-000001.json")), second);
    // A resumed run keeps its identity.
    output(
        train(
            &data,
            &[&["--steps", "5", "--eval-every", "1", "--seed", "2", "--resume"], &ck_flag[..]].concat(),
        ),
        0,
    );
    assert_eq!(run_id(&ck.join("step-000005.json")), second);
}

/// After a crash that lost the steps after the last checkpoint, the resumed run's metrics file
/// holds each step once, equal to an uninterrupted run's.
#[test]
fn resumed_metrics_hold_each_step_once() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let (a, b) = (d.path().join("a.jsonl"), d.path().join("b.jsonl"));
    let common = ["--steps", "8", "--eval-every", "4"];
    output(train(&data, &[&common[..], &["--metrics", a.to_str().unwrap()]].concat()), 0);
    let (b_flag, ck_flag) = (b.to_str().unwrap(), ck.to_str().unwrap());
    let with = |extra: &'static str| {
        let mut args = common.to_vec();
        args.extend(["--metrics", b_flag, "--checkpoint-dir", ck_flag, extra]);
        args.extend(if extra == "--stop-after" { Some("6") } else { None });
        train(&data, &args)
    };
    output(with("--stop-after"), 0);
    // As if killed before the step-6 checkpoint was written: the log is 2 steps ahead of it.
    std::fs::remove_file(ck.join("step-000006.json")).unwrap();
    assert_eq!(steps(&metrics(&b)), [1, 2, 3, 4, 5, 6]);
    output(with("--resume"), 0);
    let (ma, mb) = (metrics(&a), metrics(&b));
    assert_eq!(steps(&mb), (1..=8).collect::<Vec<_>>());
    // The resumed run's clock continues the kept steps' (a loss-against-time plot has no jump back).
    let elapsed: Vec<f64> = mb.iter().map(|r| r["elapsed_s"].as_f64().unwrap()).collect();
    assert!(elapsed.windows(2).all(|w| w[1] >= w[0]), "{elapsed:?}");
    for (x, y) in ma.iter().zip(&mb) {
        assert_eq!((&x["loss"], &x["lr"], &x["val_loss"]), (&y["loss"], &y["lr"], &y["val_loss"]));
    }
}

/// `--resume` with a larger `--steps` continues a finished run under the new learning-rate
/// schedule and says so; `--resume-if-present` starts fresh without a checkpoint and resumes
/// with one, so the same command line serves every restart.
#[test]
fn resume_extends_a_finished_run_and_resume_if_present_restarts() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let m = d.path().join("m.jsonl");
    let job = |steps: &str, extra: &[&str]| {
        let base = ["--steps", steps, "--eval-every", "3", "--checkpoint-dir", ck.to_str().unwrap()];
        train(&data, &[&base[..], &["--metrics", m.to_str().unwrap()], extra].concat())
    };
    let (out, _) = output(job("6", &["--resume-if-present", "--stop-after", "3"]), 0);
    assert!(!out.contains("resumed"), "no checkpoint yet: a fresh start\n{out}");
    let (out, _) = output(job("6", &["--resume-if-present"]), 0);
    assert!(out.contains("at step 3"), "{out}");
    let (out, _) = output(job("9", &["--resume"]), 0);
    assert!(out.contains("the run now ends at step 9 (it was 6)"), "{out}");
    assert!(out.contains("3 steps in"), "{out}");
    let log = metrics(&m);
    assert_eq!(steps(&log), (1..=9).collect::<Vec<_>>());
    // Steps 7..9 follow a 9-step cosine schedule: their learning rate decays to --min-lr (lr/10).
    let lr = |k: usize| log[k - 1]["lr"].as_f64().unwrap();
    assert!(lr(7) > lr(8) && lr(8) > lr(9), "{log:?}");
    assert!((lr(9) - 3e-4).abs() < 1e-12, "the last step ends at min-lr: {}", lr(9));
}

/// Starts a long run in the background with a checkpoint folder and a metrics file.
fn spawn_long_run(data: &Path, ck: &Path, m: &Path) -> Child {
    let args = ["--steps", "5000", "--eval-every", "1000", "--checkpoint-dir", ck.to_str().unwrap()];
    train(data, &[&args[..], &["--metrics", m.to_str().unwrap()]].concat())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until the metrics file has `n` lines (the run is mid-way).
fn wait_for_steps(m: &Path, n: usize) {
    let t = Instant::now();
    while std::fs::read_to_string(m).map_or(0, |s| s.lines().count()) < n {
        assert!(t.elapsed() < Duration::from_secs(120), "the run did not reach step {n}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn kill(child: &Child, signal: &str) {
    let ok = std::process::Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap();
    assert!(ok.success());
}

/// SIGTERM mid-run: the step in progress finishes, a checkpoint of it is written, the exit
/// status is 143; `--resume` then continues exactly the loss sequence of an uninterrupted run.
#[test]
fn sigterm_saves_the_last_step_and_resume_continues_exactly() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let (ck, m) = (d.path().join("ck"), d.path().join("m.jsonl"));
    let child = spawn_long_run(&data, &ck, &m);
    wait_for_steps(&m, 3);
    kill(&child, "-TERM");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    let done = *steps(&metrics(&m)).last().unwrap();
    assert!(done >= 3);
    assert!(err.contains(&format!("stopped by SIGTERM after step {done}; checkpoint")), "{err}");
    let saved: Vec<u64> = checkpoint::sidecars(&ck).unwrap().iter().map(|(s, _)| *s).collect();
    assert_eq!(saved, [done], "one checkpoint, of the last finished step");
    checkpoint::load(&ck).unwrap();
    // Resume for 4 more steps; an uninterrupted run of the same length gives the same losses.
    let until = (done + 4).to_string();
    let resume = ["--steps", "5000", "--stop-after", &until, "--eval-every", "1000"];
    let ck_flag = ["--checkpoint-dir", ck.to_str().unwrap(), "--resume", "--metrics", m.to_str().unwrap()];
    output(train(&data, &[&resume[..], &ck_flag[..]].concat()), 0);
    let straight = d.path().join("straight.jsonl");
    output(train(&data, &[&resume[..], &["--metrics", straight.to_str().unwrap()]].concat()), 0);
    let (a, b) = (metrics(&straight), metrics(&m));
    assert_eq!(steps(&b), (1..=done + 4).collect::<Vec<_>>());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((&x["step"], &x["loss"], &x["grad_norm"]), (&y["step"], &y["loss"], &y["grad_norm"]));
    }
}

/// SIGINT exits 130 after saving; two signals in a row exit at once (143), saying so, and every
/// checkpoint left in the folder is complete.
#[test]
fn sigint_and_a_second_signal() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let (ck, m) = (d.path().join("ck"), d.path().join("m.jsonl"));
    let child = spawn_long_run(&data, &ck, &m);
    wait_for_steps(&m, 2);
    kill(&child, "-INT");
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", String::from_utf8_lossy(&out.stderr));
    let (ck2, m2) = (d.path().join("ck2"), d.path().join("m2.jsonl"));
    let child = spawn_long_run(&data, &ck2, &m2);
    wait_for_steps(&m2, 2);
    kill(&child, "-TERM");
    kill(&child, "-TERM");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    // Either the first signal's stop finished before the second arrived, or the second one
    // says why the run ended (it used to exit silently).
    assert!(
        err.contains("stopped by SIGTERM")
            || err.contains("a second stop signal (SIGTERM): exiting at once (143)"),
        "{err}"
    );
    if ck2.exists() {
        for (_, sidecar) in checkpoint::sidecars(&ck2).unwrap() {
            checkpoint::load(&sidecar).unwrap_or_else(|e| panic!("a checkpoint left half-written: {e}"));
        }
    }
}

/// A closed standard output (`graphpp train | head -1`) neither crashes the run nor costs a
/// checkpoint: the run finishes, exits 0 and saves its last step.
#[test]
fn a_closed_stdout_does_not_stop_the_run() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let mut child =
        train(&data, &["--steps", "6", "--eval-every", "2", "--checkpoint-dir", ck.to_str().unwrap()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let saved: Vec<u64> = checkpoint::sidecars(&ck).unwrap().iter().map(|(s, _)| *s).collect();
    assert_eq!(saved, [2, 4, 6]);
}

/// A second run into a folder a running one holds is refused (its lock), and a resume with a
/// `--steps` below the checkpoint's step is an error, not a run that trains nothing.
#[test]
fn a_held_folder_and_a_shorter_run_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let ck_flag = ["--checkpoint-dir", ck.to_str().unwrap()];
    output(train(&data, &[&["--steps", "4", "--eval-every", "4"], &ck_flag[..]].concat()), 0);
    let held = checkpoint::lock(&ck).unwrap();
    let (_, err) = output(train(&data, &[&["--steps", "6", "--resume"], &ck_flag[..]].concat()), 1);
    assert!(err.contains("another graphpp run is using this checkpoint folder"), "{err}");
    drop(held);
    let (_, err) = output(train(&data, &[&["--steps", "3", "--resume"], &ck_flag[..]].concat()), 1);
    assert!(err.contains("--steps 3 is below the checkpoint's step 4"), "{err}");
    output(train(&data, &[&["--steps", "6", "--resume"], &ck_flag[..]].concat()), 0);
}

/// `--post-validate` logs the losses and gradient norms of the synchronous run bitwise, under
/// data parallelism with FSDP too; the summary counts the rolled-back steps (every step clips at
/// `--grad-clip 0.01`).
#[test]
fn post_validation_logs_the_synchronous_losses() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let run = |name: &str, extra: &[&str]| {
        let m = d.path().join(name);
        let base = ["--schedule", "dualpipev", "--steps", "5", "--dp", "2", "--fsdp", "--grad-clip", "0.01"];
        let (out, _) =
            output(train(&data, &[&base[..], extra, &["--metrics", m.to_str().unwrap()]].concat()), 0);
        let rows: Vec<(u64, u64)> = metrics(&m)
            .iter()
            .map(|r| (r["loss"].as_f64().unwrap().to_bits(), r["grad_norm"].as_f64().unwrap().to_bits()))
            .collect();
        (rows, out)
    };
    let (sync, _) = run("sync.jsonl", &[]);
    let (post, out) = run("post.jsonl", &["--post-validate"]);
    assert_eq!(sync.len(), 5);
    assert_eq!(post, sync);
    assert!(out.contains("post-validation rolled back 5 steps"), "{out}");
}
