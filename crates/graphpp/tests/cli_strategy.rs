//! Strategies as data: every flag combination of `train` printed with
//! `--print-strategy` prints back as itself and, run with `--strategy`, trains bit for bit as
//! the flags do (losses and gradient norms of 3 steps); bad strategy
//! files are refused before any work with an error naming the directive and field.

mod common;

use std::path::{Path, PathBuf};

use assert_cmd::Command;

fn graphpp() -> Command {
    Command::cargo_bin("graphpp").expect("binary builds")
}

/// The non-strategy flags of these runs: data, sequence length, steps, no sample.
fn common_args(data: &Path, metrics: &Path) -> Vec<String> {
    let args = ["--data", data.to_str().unwrap(), "--seq-len", "16", "--steps", "3", "--sample-bytes", "0"];
    let more = ["--eval-every", "0", "--metrics", metrics.to_str().unwrap(), "--threads-per-rank", "1"];
    args.iter().chain(&more).map(|s| s.to_string()).collect()
}

/// Each step's loss and gradient norm, as bits.
fn losses(path: &Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["loss"].as_f64().unwrap().to_bits(), v["grad_norm"].as_f64().unwrap().to_bits())
        })
        .collect()
}

#[test]
fn printed_strategies_train_as_their_flags() {
    let d = tempfile::tempdir().unwrap();
    let data = common::corpus(d.path(), 200);
    let combos: [&[&str]; 10] = [
        &["--microbatch-size", "2", "--microbatches", "4"],
        &["--schedule", "1f1b", "--ranks", "4", "--microbatch-size", "2", "--microbatches", "4"],
        &[
            "--schedule",
            "interleaved-1f1b",
            "--layers-per-stage",
            "1,1,1,1",
            "--microbatch-size",
            "2",
            "--microbatches",
            "4",
        ],
        &["--schedule", "dualpipev", "--dp", "2", "--fsdp", "--microbatch-size", "4", "--microbatches", "4"],
        &[
            "--schedule",
            "zbv",
            "--recompute",
            "layers",
            "--post-validate",
            "--microbatch-size",
            "2",
            "--microbatches",
            "4",
        ],
        &[
            "--model",
            "moe-tiny",
            "--schedule",
            "1f1b",
            "--ep",
            "2",
            "--microbatch-size",
            "2",
            "--microbatches",
            "2",
        ],
        &["--schedule", "gpipe", "--stages-per-rank", "1", "--microbatch-size", "2", "--microbatches", "3"],
        &["--schedule", "1f1b", "--tp", "2", "--dp", "2", "--microbatch-size", "2", "--microbatches", "4"],
        &["--schedule", "zb-auto", "--mem-cap", "1.5", "--microbatch-size", "2", "--microbatches", "4"],
        &[
            "--schedule",
            "grouped-interleaved",
            "--group",
            "2",
            "--microbatch-size",
            "2",
            "--microbatches",
            "4",
        ],
    ];
    for (i, flags) in combos.iter().enumerate() {
        // The model is not a strategy directive: it stays a flag of both runs.
        let model: Vec<&str> =
            flags.windows(2).filter(|w| w[0] == "--model").flat_map(|w| w.to_vec()).collect();
        let out = graphpp().args(["train", "--print-strategy"]).args(*flags).output().unwrap();
        assert!(out.status.success(), "{flags:?}: {}", String::from_utf8_lossy(&out.stderr));
        let file = d.path().join(format!("s{i}.toml"));
        std::fs::write(&file, &out.stdout).unwrap();
        // Every directive reaches the run's settings: the file prints back as itself.
        let again = graphpp()
            .args(["train", "--print-strategy", "--strategy", file.to_str().unwrap()])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&again.stdout), String::from_utf8_lossy(&out.stdout), "{flags:?}");
        let (by_flags, by_file) =
            (d.path().join(format!("f{i}.jsonl")), d.path().join(format!("s{i}.jsonl")));
        graphpp().arg("train").args(*flags).args(common_args(&data, &by_flags)).assert().success();
        graphpp()
            .args(["train", "--strategy", file.to_str().unwrap()])
            .args(&model)
            .args(common_args(&data, &by_file))
            .assert()
            .success();
        let (a, b) = (losses(&by_flags), losses(&by_file));
        assert_eq!(a.len(), 3, "{flags:?}");
        assert_eq!(
            a,
            b,
            "{flags:?}: the strategy file trains differently:\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

/// Writes `text` to `name` in `dir`.
fn file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn bad_strategy_files_are_refused_naming_the_directive() {
    let d = tempfile::tempdir().unwrap();
    let data = common::corpus(d.path(), 200);
    let ok =
        "[place]\nranks = 2\n[split]\nmicrobatches = 4\nmicrobatch_size = 8\n[order]\nschedule = \"1f1b\"\n";
    let cases = [
        (format!("{ok}[pipeline]\nx = 1\n"), "unknown field `pipeline`"),
        (ok.replace("ranks = 2", "rank = 2"), "unknown field `rank`"),
        (ok.replace("[split]\nmicrobatches = 4\n", "[split]\n"), "missing field `microbatches`"),
        (ok.replace("ranks = 2", "ranks = 2\nstages = [[0], [0]]"), "place.stages: stage 1 is on no rank"),
        (
            format!("{ok}[replicate]\ndp = 3\n"),
            "replicate.dp: 3 replicas do not divide split.microbatch_size 8",
        ),
        (format!("{ok}[replicate]\ndp = 2\n[shard]\nep = 4\n"), "shard.ep: 4 does not divide replicate.dp 2"),
        (
            ok.replace("ranks = 2", "ranks = 2\nlayers_per_stage = [4]"),
            "place.layers_per_stage: 1 entries for the 2",
        ),
        (
            ok.replace("\"1f1b\"", "\"zbv\"").replace("ranks = 2", "ranks = 2\nstages = [[0, 1], [2, 3]]"),
            "but zbv places [0, 3] there",
        ),
        (ok.replace("microbatches = 4", "microbatches = 0"), "split.microbatches: must be at least 1"),
    ];
    for (i, (text, says)) in cases.iter().enumerate() {
        let f = file(d.path(), &format!("bad{i}.toml"), text);
        let out = graphpp()
            .args(["train", "--strategy", f.to_str().unwrap(), "--data", data.to_str().unwrap()])
            .args(["--checkpoint-dir", d.path().join("ck").to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "case {i}: expected `{says}` in:\n{err}");
        assert!(err.contains(&format!("bad{i}.toml")), "case {i}: the file is named:\n{err}");
        // One prefix for every strategy error: the flag and the file.
        assert!(
            err.contains(&format!("strategy file {}", d.path().join(format!("bad{i}.toml")).display())),
            "case {i}: {err}"
        );
        assert!(!d.path().join("ck").exists(), "case {i}: no work before the error");
        let out = graphpp().args(["verify", "--strategy", f.to_str().unwrap()]).output().unwrap();
        assert!(String::from_utf8_lossy(&out.stderr).contains(says), "verify, case {i}");
    }
    // A 10 MB line is not echoed whole (the TOML parser quotes the offending line twice).
    let long = file(
        d.path(),
        "long.toml",
        &ok.replace("ranks = 2", &format!("ranks = \"{}\"", "x".repeat(10_000_000))),
    );
    let out = graphpp().args(["train", "--strategy", long.to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("long.toml") && err.contains("more bytes)"),
        "{}",
        &err[..err.len().min(2000)]
    );
    assert!(err.len() < 2000, "{} bytes of error", err.len());
    // As --dp defaults to --ep, replicate.dp defaults to shard.ep.
    let f = file(d.path(), "ep.toml", &ok.replace("\"1f1b\"", "\"1f1b\"\n[shard]\nep = 2"));
    let out =
        graphpp().args(["train", "--strategy", f.to_str().unwrap(), "--print-strategy"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("[replicate]\ndp = 2"), "{text}");
    // A flag the strategy stands for is refused beside it; a missing file is named.
    let f = file(d.path(), "ok.toml", ok);
    let out = graphpp().args(["train", "--strategy", f.to_str().unwrap(), "--ranks", "4"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with '--ranks"));
    let out = graphpp().args(["train", "--strategy", "/nonexistent/s.toml"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("strategy file /nonexistent/s.toml"));
    // JSON works too, and verify runs a strategy.
    let json = r#"{"place": {"ranks": 2}, "split": {"microbatches": 4, "microbatch_size": 2}, "order": {"schedule": "zbv"}}"#;
    let f = file(d.path(), "s.json", json);
    let out = graphpp().args(["verify", "--strategy", f.to_str().unwrap()]).output().unwrap();
    let o = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && o.contains("verify zbv p=2 v=2 m=4") && o.contains("PASS"), "{o}");
}

/// A schedule file of one's own (`--schedule-file`, or `order.file` relative to the strategy
/// file): GPipe's order in 1F1B's placement trains exactly as `--schedule gpipe`, and the trace
/// shows the file's order ran (rank 0: all forwards first). A file for another shape, another
/// placement, or already lowered is refused naming the file — before any work.
#[test]
fn schedule_files_run_their_order() {
    let d = tempfile::tempdir().unwrap();
    let data = common::corpus(d.path(), 200);
    let order =
        file(d.path(), "gpipe.csv", "0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3\n");
    let shape = ["--microbatches", "4", "--microbatch-size", "2"];
    let run = |flags: &[&str], name: &str| {
        let m = d.path().join(format!("{name}.jsonl"));
        graphpp().arg("train").args(flags).args(common_args(&data, &m)).assert().success();
        losses(&m)
    };
    let trace = d.path().join("t.json");
    let file_flags = [
        "--schedule",
        "1f1b",
        "--schedule-file",
        order.to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
    ];
    let by_file = run(&[&file_flags[..], &shape[..]].concat(), "file");
    assert_eq!(by_file, run(&[&["--schedule", "gpipe"][..], &shape[..]].concat(), "gpipe"));
    // The shape flags not given are the file's: 1f1b (loop placement, one stage per rank), two
    // ranks and its 4 microbatches (train's default is 8).
    let inferred = ["--schedule-file", order.to_str().unwrap(), "--microbatch-size", "2"];
    assert_eq!(run(&inferred, "inferred"), by_file);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let mut rank0: Vec<(f64, String)> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["tid"] == 0)
        .map(|e| (e["ts"].as_f64().unwrap(), e["name"].as_str().unwrap().to_string()))
        .collect();
    rank0.sort_by(|a, b| a.0.total_cmp(&b.0));
    let first: Vec<&str> = rank0.iter().take(5).map(|(_, n)| n.as_str()).collect();
    assert_eq!(first, ["0F0", "0F1", "0F2", "0F3", "0B0"]);
    // The same through a strategy whose order.file is relative to its folder.
    // Printed, a relative --schedule-file becomes absolute: the strategy runs from anywhere and
    // prints back as itself.
    let printed = graphpp()
        .current_dir(d.path())
        .args(["train", "--print-strategy", "--schedule", "1f1b", "--schedule-file", "gpipe.csv"])
        .args(shape)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&printed.stdout).into_owned();
    let abs = std::path::absolute(&order).unwrap();
    assert!(text.contains(&format!("file = \"{}\"", abs.display())), "{text}");
    let s = file(d.path(), "s.toml", &text);
    assert_eq!(run(&["--strategy", s.to_str().unwrap()], "strategy"), by_file);
    let again =
        graphpp().args(["train", "--print-strategy", "--strategy", s.to_str().unwrap()]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&again.stdout), text);
    // A relative order.file is read from the strategy file's folder.
    let sub = d.path().join("conf");
    std::fs::create_dir(&sub).unwrap();
    std::fs::copy(&order, sub.join("mine.csv")).unwrap();
    let rel = file(&sub, "s.toml", &text.replace(&abs.display().to_string(), "mine.csv"));
    assert_eq!(run(&["--strategy", rel.to_str().unwrap()], "relative"), by_file);
    // Refusals, naming the file and what does not fit.
    let lowered = file(d.path(), "lowered.csv", "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n");
    for (flags, says) in [
        (vec!["--schedule", "1f1b", "--microbatches", "8"], "m=8 microbatches"),
        (vec!["--schedule", "zbv", "--microbatches", "4"], "expected 4"),
    ] {
        let out = graphpp()
            .args(["train", "--schedule-file", order.to_str().unwrap(), "--data", data.to_str().unwrap()])
            .args(flags)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("--schedule-file") && err.contains(says), "{err}");
        assert!(err.contains("give the file's own kind with --schedule"), "the way out is named: {err}");
    }
    let out = graphpp()
        .args(["verify", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "1"])
        .args(["--schedule-file", lowered.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("communication actions"));
    let bad = file(d.path(), "bad.toml", &text.replace("microbatches = 4", "microbatches = 6"));
    let out = graphpp().args(["train", "--strategy", bad.to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.toml: order.file:") && err.contains("m=6 microbatches"), "{err}");
}

/// DualPipe's order (two parameter copies, each microbatch on one of them) has ZB-V's placement:
/// given as zbv's order it is refused, naming the microbatch whose route differs (it used to
/// pass the check and fail at step 1 with a missing activation); given alone, its kind, ranks
/// and microbatches are read from it and it verifies.
#[test]
fn a_dualpipe_order_is_told_by_its_routes() {
    let d = tempfile::tempdir().unwrap();
    let order = generated(d.path(), "dualpipe", "4");
    let out = graphpp()
        .args(["verify", "--schedule", "zbv", "--ranks", "2", "--microbatches", "4"])
        .args(["--schedule-file", order.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("microbatch 0 visits stages 0..2 in the file"), "{err}");
    let (ok, o, _) = verify_file(&order);
    let header = format!("verify dualpipe (order of {}) p=2 v=2 m=4", order.display());
    assert!(ok && o.contains(&header) && o.contains("PASS"), "{o}");
    // DualPipeV's order (V placement, OVERLAP_F_B actions) is read as dualpipev, not zbv.
    let v = generated(d.path(), "dualpipev", "5");
    let (ok, o, _) = verify_file(&v);
    assert!(ok && o.contains("verify dualpipev (order of") && o.contains("PASS"), "{o}");
}

/// The CSV `graphpp schedule generate` writes for `kind` at 2 ranks and `m` microbatches, as
/// `dir/<kind>.csv`.
fn generated(dir: &Path, kind: &str, m: &str) -> PathBuf {
    let gen = graphpp()
        .args(["schedule", "generate", "--schedule", kind, "--ranks", "2", "--microbatches", m])
        .args(["--format", "csv"])
        .output()
        .unwrap();
    file(dir, &format!("{kind}.csv"), &String::from_utf8_lossy(&gen.stdout))
}

/// `graphpp verify --schedule-file path`: (success, stdout, stderr).
fn verify_file(path: &Path) -> (bool, String, String) {
    let out = graphpp().args(["verify", "--schedule-file", path.to_str().unwrap()]).output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// A schedule file that does not parse is refused naming the cell and why, as `schedule
/// validate` does.
#[test]
fn a_bad_schedule_file_cell_says_why() {
    let d = tempfile::tempdir().unwrap();
    let bad = file(d.path(), "bad.csv", "0F0,0XX2\n");
    let (ok, _, err) = verify_file(&bad);
    assert!(!ok && err.contains("cell 2") && err.contains("unknown action kind `XX2`"), "{err}");
    // A row that runs nothing gives no shape to read.
    let idle = file(d.path(), "idle.csv", "0F0,0B0\n,\n");
    let (ok, _, err) = verify_file(&idle);
    assert!(!ok && err.contains("rank(s) [1] run nothing"), "{err}");
}
