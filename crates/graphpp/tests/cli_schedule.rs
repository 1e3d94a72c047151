//! `graphpp schedule …` end to end: exit codes, outputs and error messages a user sees.

use assert_cmd::Command;

fn graphpp() -> Command {
    Command::cargo_bin("graphpp").expect("binary builds")
}

fn stdout(args: &[&str]) -> String {
    let out = graphpp().args(args).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn failure(args: &[&str]) -> String {
    let out = graphpp().args(args).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{args:?} should fail");
    String::from_utf8(out.stderr).unwrap()
}

const TORCH_CASE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../graphpp-schedule/tests/data/torch_dualpipev/dualpipev_4rank_10mb.csv"
);

#[test]
fn generates_pytorch_dualpipev_case_byte_for_byte() {
    let want = std::fs::read_to_string(TORCH_CASE)
        .expect("the PyTorch DualPipeV case is in the schedule crate's test data");
    let got = stdout(&[
        "schedule",
        "generate",
        "--kind",
        "dualpipev",
        "--ranks",
        "4",
        "--microbatches",
        "10",
        "--format",
        "csv",
    ]);
    assert_eq!(got, want);
}

#[test]
fn validate_summarises_or_names_the_deadlock() {
    let out = stdout(&["schedule", "validate", TORCH_CASE]);
    assert!(out.contains("valid: 4 ranks, 8 stages (V placement), 10 microbatches"), "{out}");
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("deadlock.csv");
    std::fs::write(&f, "0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n").unwrap();
    let err = failure(&["schedule", "validate", f.to_str().unwrap()]);
    assert!(err.contains("rank 0 at step 1 (0B0) waits for 1B0 on rank 1"), "{err}");
    assert!(err.contains("rank 1 at step 0 (1F1) waits for 0F1 on rank 0"), "{err}");
    std::fs::write(&f, "0F0,0B0\n1F0,1BW0\n").unwrap();
    let err = failure(&["schedule", "validate", f.to_str().unwrap()]);
    assert!(
        err.contains("rank 1 (line 2), cell 2") && err.contains("column 3") && err.contains("1BW0"),
        "{err}"
    );
}

#[test]
fn simulate_json_reproduces_1f1b_makespan_22() {
    let out = stdout(&[
        "schedule",
        "simulate",
        "--kind",
        "1f1b",
        "--ranks",
        "4",
        "--microbatches",
        "8",
        "--costs",
        "F=1,B=1",
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["makespan"], 22.0);
    assert_eq!(v["peak_activations"], serde_json::json!([4.0, 3.0, 2.0, 1.0]));
    assert_eq!(v["busy"].as_array().unwrap().len(), 4);
    assert!((v["bubble_ratio"].as_f64().unwrap() - 6.0 / 16.0).abs() < 1e-12);
}

#[test]
fn simulate_writes_svg_and_chrome_trace_files() {
    let dir = tempfile::tempdir().unwrap();
    let actions =
        std::fs::read_to_string(TORCH_CASE).unwrap().split([',', '\n']).filter(|c| !c.is_empty()).count();
    assert_eq!(actions, 141);
    for (fmt, name) in [("svg", "t.svg"), ("chrome", "t.json")] {
        let p = dir.path().join(name);
        stdout(&[
            "schedule",
            "simulate",
            "--file",
            TORCH_CASE,
            "--format",
            fmt,
            "--output",
            p.to_str().unwrap(),
        ]);
        let text = std::fs::read_to_string(&p).unwrap();
        if fmt == "svg" {
            // One rectangle per action of the PyTorch case.
            assert_eq!(text.matches("<rect").count(), actions, "svg rect count");
        } else {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            let complete = v["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "X").count();
            assert_eq!(complete, actions);
        }
    }
}

#[test]
fn lower_adds_matching_send_recv() {
    let out = stdout(&["schedule", "lower", TORCH_CASE]);
    let sends = out.matches("SEND_").count();
    let recvs = out.matches("RECV_").count();
    // 8 stages in V placement: 6 cross-rank boundaries (3↔4 is local), F and B, 10 microbatches.
    assert_eq!((sends, recvs), (120, 120));
}

#[test]
fn compare_has_a_row_per_kind() {
    let out = stdout(&["schedule", "compare", "--ranks", "4", "--microbatches", "8"]);
    for kind in ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipe", "dualpipev"] {
        assert!(out.lines().any(|l| l.starts_with(&format!("{kind} "))), "{kind} missing:\n{out}");
    }
    let row = out.lines().find(|l| l.starts_with("1f1b ")).unwrap();
    // 1F1B, p=4, m=8, T_B = 2 T_F: makespan 33, r_bubble 9/24 = 0.375.
    assert!(row.contains("33.00") && row.contains("0.375"), "{row}");
}

#[test]
fn bad_input_is_a_clear_error() {
    let err =
        failure(&["schedule", "generate", "--kind", "dualpipev", "--ranks", "4", "--microbatches", "6"]);
    assert!(err.contains("m >= 2p"), "{err}");
    let out = graphpp()
        .args(["schedule", "generate", "--kind", "nope", "--ranks", "2", "--microbatches", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown schedule kind `nope`"));
    let err = failure(&["schedule", "validate", TORCH_CASE, "--microbatches", "0"]);
    assert!(err.contains("--microbatches must be at least 1"), "{err}");
    let err = failure(&["schedule", "validate", TORCH_CASE, "--microbatches", "12"]);
    assert!(err.contains("microbatch 10") || err.contains("missing"), "{err}");
    let err = failure(&["schedule", "validate", "/nonexistent/schedule.csv"]);
    assert!(err.contains("cannot read /nonexistent/schedule.csv"), "{err}");
    let ok =
        stdout(&["schedule", "generate", "--kind", "Schedule1F1B", "--ranks", "4", "--microbatches", "2"]);
    assert!(ok.starts_with("rank 0: 0F0 0F1 0B0 0B1"), "PyTorch alias and m < p served: {ok}");
}
