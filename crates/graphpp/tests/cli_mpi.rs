//! `graphpp train` with one process per rank under Open MPI's `mpirun` (cargo feature
//! `mpi`): the same losses as the threads run, checkpoints that resume under another layout,
//! a world that does not fit the mesh refused before step 1, a killed rank that stops the run.
#![cfg(feature = "mpi")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use graphpp::checkpoint;

fn exe() -> PathBuf {
    assert_cmd::cargo::cargo_bin("graphpp")
}

/// A fresh directory for one `mpirun`'s session files (its `TMPDIR`): concurrent `mpirun`s
/// sharing `/tmp/ompi.<host>.<uid>` raced to create it ("A call to mkdir was unable to create
/// the desired directory … File exists", seen once in `cargo test`).
fn mpi_tmpdir() -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("graphpp-mpi-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory for mpirun's session files");
    dir
}

/// `mpirun -n n graphpp …`, as root, more processes than cores allowed, with a session
/// directory of its own ([`mpi_tmpdir`]).
fn mpirun(n: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.env("TMPDIR", mpi_tmpdir());
    c.args(["--allow-run-as-root", "--oversubscribe", "-n", &n.to_string()]).arg(exe());
    c
}

/// The corpus of these tests ([`common::corpus`]).
fn corpus(dir: &Path) -> PathBuf {
    common::corpus(dir, 300)
}

/// The `graphpp train` arguments of these tests, plus `extra`.
fn train_args(data: &Path, extra: &[&str]) -> Vec<String> {
    let base = ["train", "--data", data.to_str().unwrap(), "--microbatch-size", "2", "--seq-len", "16"];
    let more = ["--microbatches", "4", "--sample-bytes", "0", "--threads-per-rank", "1"];
    base.iter().chain(&more).chain(extra).map(|s| s.to_string()).collect()
}

/// Runs `cmd`; returns (success, stdout, stderr).
fn run(mut cmd: Command) -> (bool, String, String) {
    let out = cmd.output().expect("mpirun runs (Debian: openmpi-bin)");
    let o = String::from_utf8_lossy(&out.stdout).into_owned();
    let e = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.success(), o, e)
}

/// Each step's (loss, grad norm) from a `--metrics` file.
fn losses(path: &Path) -> Vec<(f64, f64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["loss"].as_f64().unwrap(), v["grad_norm"].as_f64().unwrap())
        })
        .collect()
}

fn assert_close(a: &[(f64, f64)], b: &[(f64, f64)], rel: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x.0 - y.0).abs() <= rel * y.0.abs(), "{what}: losses {a:?} vs {b:?}");
        assert!((x.1 - y.1).abs() <= rel * y.1.abs(), "{what}: grad norms {a:?} vs {b:?}");
    }
}

/// `mpirun -n 2 graphpp train --steps 20` logs the losses and gradient norms of the threads run
/// of the same command (bitwise: the reductions run in the same order), prints once, and its
/// summary and final validation loss equal the threads run's.
#[test]
fn processes_log_the_losses_of_threads() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let (m_threads, m_mpi) = (d.path().join("threads.jsonl"), d.path().join("mpi.jsonl"));
    let args = |m: &Path| {
        train_args(&data, &["--schedule", "1f1b", "--steps", "20", "--metrics", m.to_str().unwrap()])
    };
    let (ok, threads_out, e) = run({
        let mut c = Command::new(exe());
        c.args(args(&m_threads));
        c
    });
    assert!(ok, "{e}");
    let (ok, mpi_out, e) = run({
        let mut c = mpirun(2);
        c.args(args(&m_mpi));
        c
    });
    assert!(ok, "{mpi_out}\n{e}");
    // Two processes of one rank and one thread each fit a host of two cores, even when mpirun
    // binds each to a core of its own (the process then sees one).
    if graphpp_runtime::kernels::threads::host_cores() >= 2 {
        assert!(!e.contains("exceed this machine"), "no oversubscription warning:\n{e}");
    }
    let (a, b) = (losses(&m_mpi), losses(&m_threads));
    assert_eq!(a.len(), 20);
    assert_close(&a, &b, 0.0, "mpirun -n 2 vs threads");
    assert_eq!(mpi_out.matches("graphpp train: model").count(), 1, "printed once:\n{mpi_out}");
    let val = |out: &str| out.lines().find(|l| l.starts_with("validation loss")).map(str::to_string);
    assert_eq!(val(&mpi_out), val(&threads_out));
    assert!(val(&mpi_out).is_some());
}

/// DualPipeV at pp=2 × dp=2 with FSDP as four processes: within 1e-5 the losses of the threads
/// runs with dp=2 and with dp=1 on the same global batch; its checkpoint (step 3, full
/// tensors) resumes as threads under ZB-V at dp=1 and continues the uninterrupted run's losses.
#[test]
fn data_parallel_processes_and_a_checkpoint_that_changes_layout() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let m = |name: &str| d.path().join(name);
    let common = ["--schedule", "dualpipev", "--steps", "6"];
    let (ok, o, e) = run({
        let mut c = mpirun(4);
        let extra = [&common[..], &["--dp", "2", "--fsdp", "--stop-after", "3", "--checkpoint-dir"]].concat();
        c.args(train_args(&data, &extra)).arg(&ck).arg("--metrics").arg(m("mpi.jsonl"));
        c
    });
    assert!(ok, "{o}\n{e}");
    let sidecars = checkpoint::sidecars(&ck).unwrap();
    assert_eq!(sidecars.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [3], "one checkpoint, written once");
    let (ok, o, e) = run({
        let mut c = Command::new(exe());
        c.args(train_args(&data, &["--schedule", "zbv", "--steps", "6", "--resume", "--checkpoint-dir"]))
            .arg(&ck)
            .arg("--metrics")
            .arg(m("mpi.jsonl"));
        c
    });
    assert!(ok, "{o}\n{e}");
    let (ok, o, e) = run({
        let mut c = Command::new(exe());
        c.args(train_args(&data, &common)).arg("--metrics").arg(m("dp1.jsonl"));
        c
    });
    assert!(ok, "{o}\n{e}");
    let (ok, o, e) = run({
        let mut c = Command::new(exe());
        c.args(train_args(&data, &[&common[..], &["--dp", "2"]].concat()))
            .arg("--metrics")
            .arg(m("dp2.jsonl"));
        c
    });
    assert!(ok, "{o}\n{e}");
    let (resumed, dp1, dp2) = (losses(&m("mpi.jsonl")), losses(&m("dp1.jsonl")), losses(&m("dp2.jsonl")));
    assert_close(&resumed[..3], &dp2[..3], 1e-5, "mpirun -n 4 dp=2 fsdp vs threads dp=2");
    assert_close(&dp2, &dp1, 1e-5, "dp=2 vs dp=1");
    assert_close(&resumed, &dp1, 1e-5, "resumed as threads under zbv vs uninterrupted");
}

/// A world that does not fit pp × dp is refused by every process before anything is built or
/// written.
#[test]
fn a_world_that_does_not_fit_the_mesh_is_refused_before_step_1() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let (ok, o, e) = run({
        let mut c = mpirun(3);
        c.args(train_args(&data, &["--ranks", "2", "--dp", "2", "--steps", "2", "--checkpoint-dir"]))
            .arg(&ck);
        c
    });
    assert!(!ok);
    let msg = "mpirun started 3 processes, but --ranks 2 × --dp 2 × --tp 1 = 4 ranks";
    assert!(e.matches(msg).count() >= 1, "{o}\n{e}");
    assert!(!o.contains("step "), "no step ran:\n{o}");
    assert!(!ck.exists(), "nothing written");
}

/// A GPU run under mpirun is refused by every process, naming why (its ranks are threads sharing
/// the device; one process per GPU is not built), before anything is built or written.
#[test]
fn a_gpu_run_as_processes_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let (ok, o, e) = run({
        let mut c = mpirun(2);
        c.args(train_args(&data, &["--ranks", "2", "--device", "cuda", "--steps", "2", "--checkpoint-dir"]))
            .arg(&ck);
        c
    });
    assert!(!ok);
    assert!(e.contains("mpirun started 2 processes with --device cuda:0"), "{o}\n{e}");
    assert!(!o.contains("step "), "no step ran:\n{o}");
    assert!(!ck.exists(), "nothing written");
}

/// A rank killed with SIGKILL mid-run: the run ends within seconds with a non-zero status that
/// names the rank; every checkpoint left loads; `--resume` continues from the newest.
#[test]
fn a_killed_rank_stops_the_run_and_the_last_checkpoint_resumes() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let ck = d.path().join("ck");
    let metrics = d.path().join("m.jsonl");
    let ck_flag = ["--eval-every", "5", "--checkpoint-dir", ck.to_str().unwrap()];
    let mut child = spawn_two_ranks(&data, &ck_flag, &metrics);
    // Wait for two checkpoints, then kill rank 1 (the second `graphpp` child of mpirun).
    let t0 = Instant::now();
    while checkpoint::sidecars(&ck).map_or(0, |s| s.len()) < 2 {
        assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoints appeared");
        if let Some(status) = child.try_wait().unwrap() {
            let mut e = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut e).unwrap();
            panic!("the run ended early ({status}):\n{e}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let ranks = pids_of_rank(child.id());
    let victim = ranks.iter().find(|(_, r)| *r == 1).expect("rank 1 runs").0;
    let killed = Instant::now();
    Command::new("kill").args(["-9", &victim.to_string()]).status().unwrap();
    let out = child.wait_with_output().unwrap();
    let waited = killed.elapsed();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(waited < Duration::from_secs(30), "took {waited:?} to stop");
    assert!(e.contains("rank 1") && e.contains("signal 9"), "{e}");
    let saved = checkpoint::sidecars(&ck).unwrap();
    for (_, path) in &saved {
        checkpoint::load(path).unwrap();
    }
    let newest = saved.last().unwrap().0;
    let (ok, o, e) = run({
        let mut c = Command::new(exe());
        let stop = (newest + 2).to_string();
        let extra = [
            "--schedule",
            "1f1b",
            "--steps",
            "100000",
            "--stop-after",
            &stop,
            "--resume",
            "--checkpoint-dir",
        ];
        c.args(train_args(&data, &extra)).arg(&ck);
        c
    });
    assert!(ok, "{o}\n{e}");
    assert!(o.contains(&format!("from {} at step {newest}", ck.display())), "{o}");
}

/// A rank stopped with SIGSTOP (alive, silent): with `--timeout 5` the others fail within
/// seconds naming the rank they waited for, and the job ends (it used to wait 300 s without a
/// word).
#[test]
fn a_silent_rank_times_out_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let metrics = d.path().join("m.jsonl");
    let mut child = spawn_two_ranks(&data, &["--eval-every", "0", "--timeout", "5"], &metrics);
    let t0 = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |s| s.lines().count()) < 2 {
        assert!(t0.elapsed() < Duration::from_secs(120), "no steps ran");
        std::thread::sleep(Duration::from_millis(50));
    }
    let victim = pids_of_rank(child.id()).into_iter().find(|(_, r)| *r == 1).expect("rank 1 runs").0;
    let stopped = Instant::now();
    Command::new("kill").args(["-STOP", &victim.to_string()]).status().unwrap();
    // The job must end by itself; if it does not, the stopped rank is killed so the test ends.
    let ended = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if stopped.elapsed() > Duration::from_secs(90) {
            Command::new("kill").args(["-9", &victim.to_string()]).status().unwrap();
            panic!("the job still ran 90 s after rank 1 stopped");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let waited = stopped.elapsed();
    let _ = Command::new("kill").args(["-9", &victim.to_string()]).status();
    let mut e = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut e).unwrap();
    assert!(!ended.success());
    assert!(waited < Duration::from_secs(60), "took {waited:?}");
    assert!(e.contains("timed out after 5") && e.contains("rank 1"), "{e}");
}

/// A long 1F1B training run (100,000 steps) as two processes with `extra` flags, its metrics in
/// `metrics`, standard error piped: the tests stop or kill a rank of it.
fn spawn_two_ranks(data: &Path, extra: &[&str], metrics: &Path) -> std::process::Child {
    let long = [&["--schedule", "1f1b", "--steps", "100000"][..], extra].concat();
    mpirun(2)
        .args(train_args(data, &long))
        .arg("--metrics")
        .arg(metrics)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The `graphpp` processes under `mpirun` pid `parent`, with their world rank (from their
/// `OMPI_COMM_WORLD_RANK` environment).
fn pids_of_rank(parent: u32) -> Vec<(u32, usize)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Field 4 (after the parenthesised name) is the parent pid.
        let ppid =
            stat.rsplit(')').next().and_then(|r| r.split_whitespace().nth(1)).and_then(|p| p.parse().ok());
        if ppid != Some(parent) {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let rank = env
            .split(|&b| b == 0)
            .filter_map(|kv| std::str::from_utf8(kv).ok())
            .find_map(|kv| kv.strip_prefix("OMPI_COMM_WORLD_RANK=")?.parse().ok());
        if let Some(r) = rank {
            out.push((pid, r));
        }
    }
    out
}

/// `mpirun -n 4 graphpp verify --dp 2` (and `--fsdp`) for every kind the issue names at pp = 2,
/// and the MoE model under 1f1b, zbv and dualpipev, also with `--ep 2` (dp = ep = 2: the
/// experts' tokens cross processes by all-to-all): four processes, the leader compares the
/// reduced gradients with one device (≤ 1e-5) and prints once.
#[test]
fn verify_as_four_processes_with_data_parallelism_fsdp_and_ep() {
    let kinds = ["gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev", "zb-h1"].map(|k| (k, "tiny"));
    // The MoE model too: its expert loads ride in the loss all-reduce across the processes.
    let moe =
        [("1f1b", "moe-tiny"), ("zbv", "moe-tiny"), ("dualpipev", "moe-tiny"), ("dualpipev", "moe-mla-tiny")];
    for (kind, model) in kinds.into_iter().chain(moe) {
        let mut layouts: Vec<(&[&str], &str)> =
            vec![(&["--dp", "2"], "dp=2,"), (&["--dp", "2", "--fsdp"], "dp=2 fsdp,")];
        if model.starts_with("moe") {
            layouts.push((&["--ep", "2"], "dp=2 ep=2,"));
        }
        for (layout, says) in layouts {
            let (ok, o, e) = run({
                let mut c = mpirun(4);
                c.args(["verify", "--schedule", kind, "--ranks", "2", "--microbatches", "4"])
                    .args(["--microbatch-size", "2", "--model", model])
                    .args(layout);
                c
            });
            assert!(ok, "{kind} {layout:?}:\n{o}\n{e}");
            assert_eq!(o.matches("PASS").count(), 1, "{kind}: printed once:\n{o}");
            assert!(o.contains(says) && o.contains("4 processes"), "{o}");
        }
    }
}

/// Tensor parallelism across processes: `verify --tp 2` as four processes (pp = 2 × tp = 2) under
/// the five kinds the issue names, and as eight with `--dp 2` (and FSDP): the tp ranks'
/// all-reduces cross processes (with sequence parallelism, the all-gathers and reduce-scatters),
/// the leader gathers the shards whole and compares with one device.
#[test]
fn verify_tensor_parallel_as_four_and_eight_processes() {
    let runs: Vec<(&str, usize, &[&str])> = vec![
        ("gpipe", 4, &[]),
        ("1f1b", 4, &[]),
        ("interleaved-1f1b", 4, &[]),
        ("zbv", 4, &[]),
        ("dualpipev", 4, &[]),
        ("1f1b", 8, &["--dp", "2"]),
        ("dualpipev", 8, &["--dp", "2", "--fsdp"]),
        ("zbv", 8, &["--dp", "2", "--sequence-parallel"]),
    ];
    for (kind, n, layout) in runs {
        let (ok, o, e) = run({
            let mut c = mpirun(n);
            c.args(["verify", "--schedule", kind, "--ranks", "2", "--microbatches", "4", "--tp", "2"])
                .args(["--microbatch-size", "2"])
                .args(layout);
            c
        });
        assert!(ok, "{kind} {layout:?}:\n{o}\n{e}");
        assert_eq!(o.matches("PASS").count(), 1, "{kind}: printed once:\n{o}");
        assert!(o.contains(" tp=2") && o.contains(&format!("{n} processes")), "{o}");
    }
}

/// Expert-parallel training as four processes (`--ep 2`, DualPipeV): the leader's `--trace`
/// holds the stage graphs' all-to-alls of both pipeline ranks — rank 1's gathered from its
/// process, labels included — as async slices on the comm tracks, and the summary reports them.
#[test]
fn expert_parallel_training_traces_the_all_to_alls_of_every_rank() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let trace = d.path().join("trace.json");
    let extra = ["--model", "moe-tiny", "--ep", "2", "--schedule", "dualpipev", "--steps", "2"];
    let (ok, o, e) = run({
        let mut c = mpirun(4);
        c.args(train_args(&data, &extra)).args(["--trace", trace.to_str().unwrap()]);
        c
    });
    assert!(ok, "{o}\n{e}");
    assert!(o.contains("in-graph collectives (per rank and step)"), "{o}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let slices: Vec<&serde_json::Value> =
        v["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "b").collect();
    for tid in [2, 3] {
        let on: Vec<&str> =
            slices.iter().filter(|e| e["tid"] == tid).filter_map(|e| e["name"].as_str()).collect();
        assert!(
            on.iter().any(|n| n.starts_with("ep.dispatch all_to_all_v (forward)")),
            "comm track {tid}: {on:?}"
        );
        assert!(
            on.iter().any(|n| n.starts_with("ep.combine all_to_all_v (backward)")),
            "comm track {tid}: {on:?}"
        );
    }
}

/// A rank that fails on its own — the same command line, but rank 1's working folder has no
/// corpus at the relative `--data` path, as on a misconfigured host: it reports its error naming
/// itself; rank 0, already waiting in step 1, stops within seconds with an error naming rank 1;
/// the job exits non-zero.
#[test]
fn a_rank_that_fails_alone_stops_the_others_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let (w0, w1) = (d.path().join("w0"), d.path().join("w1"));
    std::fs::create_dir_all(&w0).unwrap();
    std::fs::create_dir_all(&w1).unwrap();
    corpus(&w0);
    let args = train_args(Path::new("corpus.txt"), &["--schedule", "1f1b", "--steps", "5"]);
    let t0 = Instant::now();
    let (ok, o, e) = run({
        let mut c = Command::new("mpirun");
        c.args(["--allow-run-as-root", "--oversubscribe", "-n", "1", "-wdir"])
            .arg(&w0)
            .arg(exe())
            .args(&args);
        c.args([":", "-n", "1", "-wdir"]).arg(&w1).arg(exe()).args(&args);
        c
    });
    assert!(!ok, "{o}\n{e}");
    assert!(t0.elapsed() < Duration::from_secs(60), "took {:?}", t0.elapsed());
    assert!(e.contains("error: rank 1: data path corpus.txt does not exist"), "rank 1 names itself:\n{e}");
    // Rank 0 names rank 1 itself — wherever it was (in step 1, or still comparing settings) —
    // unless mpirun, seeing rank 1 exit non-zero, ended the job first; its banner then names the
    // process (`[[job,1],1]`) that failed.
    let rank0 = e.contains("error: rank 0: ") && e.contains("because rank 1 failed: rank 1: data path");
    assert!(rank0 || (e.contains("Process name") && e.contains(",1],1]")), "{e}");
    assert!(!o.contains("step      5"), "{o}");
}

/// Processes that do not run the same command (here rank 1 asks for fewer steps), or that would
/// resume from different checkpoints (rank 1's working folder holds none), are refused before
/// step 1 by every process, naming rank 1 — not a hang, not silently different losses.
#[test]
fn processes_that_disagree_are_refused_before_step_1() {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let args = train_args(&data, &["--schedule", "1f1b", "--steps", "6"]);
    let mut fewer = args.clone();
    let at = fewer.iter().position(|a| a == "6").unwrap();
    fewer[at] = "3".into();
    let (ok, o, e) = run({
        let mut c = Command::new("mpirun");
        c.args(["--allow-run-as-root", "--oversubscribe", "-n", "1"]).arg(exe()).args(&args);
        c.args([":", "-n", "1"]).arg(exe()).args(&fewer);
        c
    });
    assert!(!ok);
    assert!(
        e.contains("disagree on the command line or the checkpoint to resume: ranks [1] differ from rank 0"),
        "{e}"
    );
    assert!(!o.contains("step "), "{o}");
    // A checkpoint in rank 0's working folder only.
    let (w0, w1) = (d.path().join("w0"), d.path().join("w1"));
    std::fs::create_dir_all(&w1).unwrap();
    let mut first = Command::new(exe());
    first
        .current_dir(d.path())
        .args(train_args(&data, &["--schedule", "1f1b", "--steps", "6", "--stop-after", "2"]));
    first.args(["--checkpoint-dir", w0.join("ck").to_str().unwrap()]);
    assert!(first.status().unwrap().success());
    let resume = train_args(
        &data,
        &["--schedule", "1f1b", "--steps", "6", "--resume-if-present", "--checkpoint-dir", "ck"],
    );
    let (ok, o, e) = run({
        let mut c = Command::new("mpirun");
        c.args(["--allow-run-as-root", "--oversubscribe", "-n", "1", "-wdir"])
            .arg(&w0)
            .arg(exe())
            .args(&resume);
        c.args([":", "-n", "1", "-wdir"]).arg(&w1).arg(exe()).args(&resume);
        c
    });
    assert!(!ok);
    assert!(e.contains("ranks [1] differ from rank 0"), "{o}\n{e}");
    assert!(!o.contains("step      4"), "{o}");
}

/// `mpirun -n 2 graphpp hardware probe` measures the MPI link between its two processes (one
/// host: both links of the file) beside the threads' link, rank 0 writing the file once.
#[test]
fn the_probe_measures_the_mpi_link_between_processes() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("here.toml");
    let mut c = mpirun(2);
    c.args(["hardware", "probe", "--output"]).arg(&file);
    let (ok, out, err) = run(c);
    assert!(ok, "{out}\n{err}");
    assert_eq!(out.matches("probed in").count(), 1, "{out}");
    assert!(
        out.contains("; MPI between ranks 0 and 1: ") && out.contains("(intra_node and inter_node)"),
        "{out}"
    );
    let h = graphpp::hardware::Hardware::load(file.to_str().unwrap()).unwrap();
    assert!(h.source.contains("measured over MPI between ranks 0 and 1 of 2"), "{}", h.source);
    assert_eq!(h.intra_node, h.inter_node);
    assert!(h.intra_node.bandwidth > 1e6 && h.intra_node.latency_us > 0.0, "{h:?}");
}
