//! Inputs are checked up front: sizes from estimates before anything is allocated,
//! numbers finite and in range and given once, messages that name the flag and say the problem in
//! the command's own terms, and the CSV that spreadsheets write. Every rejection exits with
//! status 1 (status 2 is left to clap for a malformed command line).

use std::path::{Path, PathBuf};

use assert_cmd::Command;

/// Runs graphpp with `args`; asserts exit status 1 and returns standard error.
fn rejected(args: &[&str]) -> String {
    let out = Command::cargo_bin("graphpp").unwrap().args(args).output().unwrap();
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "{args:?} should exit 1: {err}");
    err
}

/// Runs graphpp with `args`; asserts success and returns standard output.
fn accepted(args: &[&str]) -> String {
    let out = Command::cargo_bin("graphpp").unwrap().args(args).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn has_all(text: &str, words: &[&str]) {
    for w in words {
        assert!(text.contains(w), "`{w}` missing from: {text}");
    }
}

/// A small UTF-8 corpus, so that no test would fetch the default one.
fn corpus(dir: &Path) -> PathBuf {
    let path = dir.join("corpus.txt");
    std::fs::write(&path, "To be, or not to be, that is the question.\n".repeat(200)).unwrap();
    path
}

fn train(extra: &[&str]) -> String {
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let mut args = vec!["train", "--data", data.to_str().unwrap(), "--steps", "1"];
    args.extend_from_slice(extra);
    rejected(&args)
}

// ---- sizes: refused from an estimate before allocating ----

#[test]
fn train_with_too_many_ranks_is_refused_from_the_schedule_size() {
    // ZB-V at 10^6 ranks and 8 microbatches: 2·10^6 stages × 8 × (F, I, W) = 4.8e7 actions.
    let err = train(&["--ranks", "1000000"]);
    has_all(&err, &["ranks=1000000", "4.8e7 actions", "the limit is 3.0e7 actions"]);
}

#[test]
fn train_with_a_billion_microbatches_is_refused() {
    let err = train(&["--microbatches", "1000000000"]);
    has_all(&err, &["microbatches=1000000000", "1.2e10 actions", "the limit is"]);
}

#[test]
fn train_with_a_huge_microbatch_is_refused_from_the_memory_estimate() {
    // One microbatch of 100000 × 64 tokens saves 194 GB of activations in the tiny model (more
    // than 3/4 of any machine up to 258 GB).
    let err = train(&["--microbatch-size", "100000", "--threads-per-rank", "1"]);
    has_all(
        &err,
        &["B=100000", "activations at the schedule's peak 194 GB", "the limit is", "--microbatch-size"],
    );
    // Beside the step the process holds its program, the test corpus and 24 MiB for each of its
    // two ranks (one thread each): more than 50.3 MB.
    let (_, after) = err.split_once("the program, its corpus and threads ").expect(&err);
    let (value, unit) = after.split_once(' ').expect(&err);
    let mb: f64 = value.parse().expect(&err);
    assert!(unit.starts_with("MB") && (50.3..200.0).contains(&mb), "{err}");
}

#[test]
fn generate_with_a_billion_microbatches_is_refused() {
    let err = rejected(&[
        "schedule",
        "generate",
        "--schedule",
        "1f1b",
        "--ranks",
        "4",
        "--microbatches",
        "1000000000",
    ]);
    has_all(&err, &["8.0e9 actions", "1.3 TB", "the limit is 3.0e7 actions"]);
}

#[test]
fn compare_with_a_hundred_thousand_ranks_is_refused() {
    let err = rejected(&["schedule", "compare", "--ranks", "100000", "--microbatches", "8"]);
    // ZB-V builds its 4.8e6 actions; zbv-auto runs its heuristic 8 times over them.
    has_all(&err, &["zbv-auto", "ranks=100000", "3.8e7 actions", "the limit is"]);
}

#[test]
fn graph_with_a_long_sequence_is_refused_without_allocating() {
    let err = rejected(&["graph", "--seq-len", "100000", "--stats"]);
    has_all(&err, &["T=100000", "--seq-len", "max_position_embeddings 512"]);
}

// ---- numbers: finite, in range, given once ----

fn simulate<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["schedule", "simulate", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2"];
    args.extend_from_slice(extra);
    args
}

#[test]
fn comm_latency_must_be_a_finite_non_negative_number() {
    // -1 made the makespan 7, below the zero-latency 9; NaN started rank 1 before its input.
    let err = rejected(&simulate(&["--comm-latency", "-1"]));
    has_all(&err, &["--comm-latency = -1", "must be >= 0"]);
    for bad in ["nan", "inf"] {
        let err = rejected(&simulate(&["--comm-latency", bad]));
        has_all(&err, &["--comm-latency", "must be a finite number"]);
    }
    let err =
        rejected(&["schedule", "compare", "--ranks", "2", "--microbatches", "2", "--comm-latency", "-0.5"]);
    has_all(&err, &["--comm-latency = -0.5", "must be >= 0"]);
    let ok = accepted(&simulate(&["--comm-latency", "0.5", "--format", "json"]));
    assert!(ok.contains("\"makespan\": 10.0"), "{ok}");
}

#[test]
fn verify_numbers_reach_graphpp_checks() {
    let base = ["verify", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2"];
    for bad in ["nan", "-1", "inf"] {
        let mut args = base.to_vec();
        args.extend(["--tolerance", bad]);
        has_all(&rejected(&args), &["--tolerance", "must be a finite number >= 0"]);
    }
    let err = rejected(&["verify", "--schedule", "1f1b", "--ranks", "-1", "--microbatches", "2"]);
    has_all(&err, &["--ranks", "-1", "cannot be negative"]);
    assert!(!err.contains("unexpected argument"), "{err}");
}

#[test]
fn costs_are_bounded_and_given_once() {
    let err = rejected(&simulate(&["--costs", "F=1e300"]));
    has_all(&err, &["--costs", "F = 1e300", "at most 1e9"]);
    assert!(err.len() < 400 && !err.contains("00000000000"), "printed short: {err}");
    let err = rejected(&simulate(&["--costs", "F=1,F=2"]));
    has_all(&err, &["--costs", "F is given twice"]);
    // The largest accepted cost prints in a readable form.
    let ok = accepted(&simulate(&["--costs", "F=1e9,B=1e9"]));
    assert!(ok.starts_with("costs               per whole stage (F=1000000000,"), "{ok}");
    assert!(ok.contains("\nmakespan            6.0000e9\n"), "{ok}");
}

#[test]
fn an_infinite_memory_cap_is_refused_for_not_being_finite() {
    let err = rejected(&[
        "schedule",
        "generate",
        "--schedule",
        "zb-auto",
        "--ranks",
        "2",
        "--microbatches",
        "4",
        "--mem-cap",
        "inf",
    ]);
    has_all(&err, &["memory cap must be a finite number of M_B units"]);
    assert!(!err.contains("at least 1 M_B"), "{err}");
}

// ---- messages ----

#[test]
fn more_stages_than_layers_suggests_nothing_invalid() {
    let err = rejected(&["graph", "--stages", "5"]);
    has_all(&err, &["5 stages exceed the model's 4 decoder layers"]);
    assert!(!err.contains("--layers-per-stage"), "{err}");
}

#[test]
fn grouped_interleaved_speaks_in_the_flags_of_train_and_verify() {
    let err =
        train(&["--schedule", "grouped-interleaved", "--ranks", "4", "--microbatches", "2", "--layers", "8"]);
    has_all(&err, &["at least as many microbatches as ranks (m=2, p=4)"]);
    assert!(!err.contains("group N"), "{err}");
    let err = rejected(&[
        "verify",
        "--schedule",
        "grouped-interleaved",
        "--ranks",
        "4",
        "--microbatches",
        "2",
        "--layers",
        "8",
    ]);
    has_all(&err, &["at least as many microbatches as ranks (m=2, p=4)"]);
    assert!(!err.contains("group N"), "{err}");
}

#[test]
fn an_option_the_kind_ignores_is_refused() {
    let err = rejected(&[
        "schedule",
        "generate",
        "--schedule",
        "zbv",
        "--ranks",
        "2",
        "--microbatches",
        "4",
        "--group",
        "2",
    ]);
    has_all(&err, &["zbv does not use a group size (--group)", "grouped-interleaved only"]);
    let err = rejected(&simulate(&["--mem-cap", "3"]));
    has_all(&err, &["1f1b does not use a memory cap (--mem-cap)", "zb-auto, zbv-auto only"]);
}

#[test]
fn a_json_array_schedule_gets_a_json_error() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("s.json");
    std::fs::write(&f, "[[\"0F0\", \"0B0\"]]\n").unwrap();
    let err = rejected(&["schedule", "validate", f.to_str().unwrap()]);
    has_all(&err, &["bad JSON schedule", "{\"ranks\": [["]);
    assert!(!err.contains("CSV"), "{err}");
}

#[test]
fn an_unknown_graph_names_the_flag_and_the_valid_ones() {
    let err = rejected(&["graph", "--show", "bogus"]);
    has_all(&err, &["--show", "bogus", "fw, full_bw, bw_di, bw_dw, overlap"]);
}

#[test]
fn counts_of_one_are_singular() {
    let out = accepted(&simulate(&[]));
    has_all(&out, &["one column = 1 cost unit; makespan 9 cost units"]);
    let out =
        accepted(&["verify", "--schedule", "1f1b", "--ranks", "1", "--microbatches", "1", "--layers", "1"]);
    has_all(&out, &["(model tiny, 1 layer, B=1"]);
    let out = accepted(&["graph", "--stats", "--recompute", "stage-inputs", "--stages", "4", "--stage", "1"]);
    has_all(&out, &["graph fw: 79 nodes, 13 inputs, 1 output\n"]);
    let d = tempfile::tempdir().unwrap();
    let data = corpus(d.path());
    let out = accepted(&[
        "train",
        "--data",
        data.to_str().unwrap(),
        "--steps",
        "1",
        "--microbatch-size",
        "1",
        "--seq-len",
        "16",
        "--microbatches",
        "2",
        "--sample-bytes",
        "0",
        "--threads-per-rank",
        "1",
    ]);
    has_all(&out, &["1 step, 1 thread per rank", "1 step in "]);
    assert!(!out.contains("1 steps") && !out.contains("thread(s)"), "{out}");
}

/// `graph --stats` gives what W holds from I to W beside what B holds from F, and their ratio as
/// the simulator's `--m-w`: on tiny's stage 1 of 2, 713,984 of 1,010,432 bytes (0.707; the
/// zero-bubble paper's M_W ≈ M_B / 2); under `layers` the same W bytes over 65,536 saved. A
/// first stage, which has no I/W split, has no such line.
#[test]
fn graph_stats_give_the_bytes_w_holds() {
    // The default (pointwise) saves less than save-all for B, the same for W.
    let out = accepted(&["graph", "--stats", "--stages", "2", "--stage", "1"]);
    has_all(&out, &["held for W (I → W): 35 values, 713984 bytes per microbatch (M_W / M_B = 0.954: `graphpp schedule simulate --m-w 0.954`)"]);
    let out = accepted(&["graph", "--stats", "--stages", "2", "--stage", "1", "--recompute", "save-all"]);
    has_all(&out, &["held for W (I → W): 35 values, 713984 bytes per microbatch (M_W / M_B = 0.707: `graphpp schedule simulate --m-w 0.707`)"]);
    let out = accepted(&["graph", "--stats", "--stages", "2", "--stage", "1", "--recompute", "layers"]);
    has_all(&out, &["65536 bytes per microbatch", "713984 bytes per microbatch (M_W / M_B = 10.895"]);
    assert!(out.contains("more than the simulator's --m-w takes (at most 1)"), "{out}");
    let out = accepted(&["graph", "--stats", "--stages", "2", "--stage", "1", "--recompute", "stage-inputs"]);
    has_all(
        &out,
        &["713984 bytes per microbatch (F saves nothing under this recompute policy: no M_W / M_B)"],
    );
    let out = accepted(&["graph", "--stats", "--stages", "2", "--stage", "0"]);
    assert!(!out.contains("held for W"), "{out}");
}

// ---- PyTorch CSV interop ----

#[test]
fn spreadsheet_csv_validates_and_simulates() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("s.csv");
    // DualPipeV p=2 m=4 as a spreadsheet saves it: BOM, every cell quoted, CRLF, spaced overlaps.
    let csv = accepted(&[
        "schedule",
        "generate",
        "--schedule",
        "dualpipev",
        "--ranks",
        "2",
        "--microbatches",
        "4",
        "--format",
        "csv",
    ]);
    assert!(csv.contains(";"), "the case has overlaps: {csv}");
    let mut text = String::from("\u{feff}");
    for line in csv.lines() {
        let cells: Vec<String> = line.split(',').map(|c| format!("\"{}\"", c.replace(';', "; "))).collect();
        text.push_str(&cells.join(","));
        text.push_str("\r\n");
    }
    std::fs::write(&f, &text).unwrap();
    let out = accepted(&["schedule", "validate", f.to_str().unwrap()]);
    has_all(&out, &["valid: 2 ranks, 4 stages (V placement), 4 microbatches"]);
    let lowered = accepted(&["schedule", "lower", f.to_str().unwrap()]);
    assert!(lowered.contains("SEND_F"), "{lowered}");
    // Junk stays an error with row and cell, quoted or not.
    std::fs::write(&f, "\u{feff}\"0F0\",\"0B0\"\r\n\"1F0\",\"1BW0\"\r\n").unwrap();
    let err = rejected(&["schedule", "validate", f.to_str().unwrap()]);
    has_all(&err, &["bad CSV schedule", "rank 1 (line 2), cell 2", "column 3", "1BW0"]);
    assert!(!err.contains('\u{feff}'), "{err}");
}

/// Started by `mpirun` (its environment says a world of 2) in a build without the `mpi`
/// feature: refused before anything runs, saying how to build with MPI.
#[cfg(not(feature = "mpi"))]
#[test]
fn mpirun_without_the_mpi_feature_is_refused() {
    let out = Command::cargo_bin("graphpp")
        .unwrap()
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .args(["train", "--steps", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("one of 2 processes, but this graphpp was built without MPI"), "{e}");
    assert!(e.contains("--features mpi"), "{e}");
    assert!(out.stdout.is_empty());
}

/// A 68-byte schedule file naming microbatch 4294967295 took 23.5 GB before being killed:
/// every command that reads a schedule file now refuses it at once, naming the cell.
#[test]
fn a_schedule_file_naming_a_huge_microbatch_is_refused_at_once() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("huge.csv");
    std::fs::write(&f, "0F0,0F4294967295,0B4294967295,0B0\n1F0,1F4294967295,1B4294967295,1B0\n").unwrap();
    assert!(std::fs::metadata(&f).unwrap().len() < 80);
    let path = f.to_str().unwrap();
    for cmd in [
        &["schedule", "validate", path][..],
        &["schedule", "simulate", "--file", path],
        &["schedule", "lower", path],
    ] {
        let t0 = std::time::Instant::now();
        let err = rejected(cmd);
        has_all(&err, &["0F4294967295", "microbatch 4294967295 is beyond the schedule's 8 actions"]);
        assert!(t0.elapsed() < std::time::Duration::from_secs(5), "{cmd:?} took {:?}", t0.elapsed());
    }
    let d2 = tempfile::tempdir().unwrap();
    let err = train(&[
        "--schedule",
        "1f1b",
        "--microbatches",
        "2",
        "--schedule-file",
        path,
        "--checkpoint-dir",
        d2.path().to_str().unwrap(),
    ]);
    has_all(&err, &["--schedule-file", "microbatch 4294967295"]);
}

/// `/dev/zero` has no end: reading it whole took the machine's memory. A schedule (or strategy,
/// profile, model config) is read up to 64 MiB and refused beyond.
#[test]
fn a_schedule_file_without_end_is_refused_at_the_bound() {
    let err = rejected(&["schedule", "validate", "/dev/zero"]);
    has_all(&err, &["/dev/zero", "longer than 64 MiB"]);
    let err = rejected(&["schedule", "simulate", "--file", "/dev/zero"]);
    has_all(&err, &["/dev/zero", "longer than 64 MiB"]);
}

/// A corpus larger than memory can hold (its text and a u32 token a byte) is refused from its
/// size on disk, before a byte is read: a sparse 15 GB file here.
#[test]
fn a_corpus_larger_than_memory_is_refused_before_reading() {
    let d = tempfile::tempdir().unwrap();
    let big = d.path().join("big.txt");
    let total = graphpp_runtime::train::memory::machine_memory().unwrap_or(16 << 30);
    std::fs::File::create(&big).unwrap().set_len(total.max(15_000_000_000)).unwrap();
    let t0 = std::time::Instant::now();
    let out = Command::cargo_bin("graphpp")
        .unwrap()
        .args(["train", "--data", big.to_str().unwrap(), "--steps", "1"])
        .arg("--checkpoint-dir")
        .arg(d.path().join("ck"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    has_all(&err, &["big.txt", "bytes of text would take", "of memory"]);
    assert!(t0.elapsed() < std::time::Duration::from_secs(5), "took {:?}", t0.elapsed());
}

/// `--threads-per-rank 1000000` spawned threads for 97 s and panicked; `--sample-bytes` of
/// 10^11 generated for minutes. Both are bounded on the command line.
#[test]
fn thread_and_sample_counts_are_bounded() {
    for (flag, value, range) in
        [("--threads-per-rank", "1000000", "1..=1024"), ("--sample-bytes", "100000000000", "0..=65536")]
    {
        let err = rejected(&["train", flag, value]);
        has_all(&err, &[flag, value, range]);
    }
}

/// `--seed -1` was clap's "unexpected argument '-1'" while `--ranks -1` was graphpp's own
/// message: every count, the seed included, now says what is wrong with the value.
#[test]
fn a_negative_seed_is_named_like_any_count() {
    for flag in ["--seed", "--ranks"] {
        let err = rejected(&["train", flag, "-1"]);
        has_all(&err, &[&format!("invalid value '-1' for '{flag}"), "a count cannot be negative"]);
    }
    let err = rejected(&["verify", "--seed", "-1"]);
    has_all(&err, &["a count cannot be negative"]);
}

/// `--stop-after` beyond `--steps` ran the whole schedule without a word, and `--stop-after 0`
/// trained nothing yet evaluated: both are refused, naming the flag.
#[test]
fn stop_after_must_be_within_the_run() {
    let err = train(&["--stop-after", "10"]);
    has_all(&err, &["--stop-after 10 is beyond --steps 1"]);
    let err = rejected(&["train", "--stop-after", "0"]);
    has_all(&err, &["--stop-after", "0"]);
}
