//! `graphpp verify` end to end: a pipelined step equals the single-device step (exit 0), the
//! printed numbers are consistent, bad shapes and differences above tolerance exit 1.

use assert_cmd::Command;

fn verify(args: &[&str]) -> std::process::Output {
    Command::cargo_bin("graphpp").expect("binary builds").arg("verify").args(args).output().unwrap()
}

/// The number after `key` on the line starting with `line`.
fn number(out: &str, line: &str, key: &str) -> f64 {
    let l = out.lines().find(|l| l.starts_with(line)).unwrap_or_else(|| panic!("no {line}: {out}"));
    let rest = &l[l.find(key).unwrap_or_else(|| panic!("no {key} in {l}")) + key.len()..];
    rest.split_whitespace().next().unwrap().trim_end_matches(',').parse().unwrap()
}

#[test]
fn pipelined_steps_match_one_device() {
    for args in [
        &["--schedule", "dualpipev", "--ranks", "2", "--stages-per-rank", "2", "--microbatches", "5"][..],
        &[
            "--schedule",
            "ScheduleInterleaved1F1B",
            "--ranks",
            "4",
            "--stages-per-rank",
            "2",
            "--microbatches",
            "8",
            "--layers",
            "8",
        ],
    ] {
        let out = verify(args);
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(out.status.success(), "{args:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
        let a = number(&text, "loss pipelined", "pipelined");
        let b = number(&text, "loss single device", "device");
        // Random tokens over tiny's 256-token vocabulary at init: loss near ln 256.
        assert!((b - 256f64.ln()).abs() < 0.2, "{text}");
        assert!((a - b).abs() / b < 1e-5, "{text}");
        assert!(number(&text, "gradients:", "max relative difference") <= 1e-5, "{text}");
        assert!(text.contains("PASS"), "{text}");
    }
}

#[test]
fn too_few_layers_names_both_numbers() {
    let out = verify(&[
        "--schedule",
        "interleaved-1f1b",
        "--ranks",
        "4",
        "--stages-per-rank",
        "2",
        "--microbatches",
        "8",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    // The message says where the stage count comes from (p × v of the kind).
    assert!(err.contains("4 decoder layers") && err.contains("the 8 model stages"), "{err}");
    assert!(err.contains("p=4, v=2"), "{err}");
}

#[test]
fn difference_above_tolerance_exits_1() {
    // f32 summation order differs between the two steps, so a zero tolerance cannot hold.
    let out = verify(&["--schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--tolerance", "0"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("FAIL: difference above tolerance 0 relative"), "{err}");
}

#[test]
fn a_shape_the_kind_rejects_is_reported() {
    let out =
        verify(&["--schedule", "dualpipe", "--ranks", "3", "--stages-per-rank", "2", "--microbatches", "6"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("dualpipe cannot serve"), "{out:?}");
}

/// `--dp 2` and `--dp 2 --fsdp`: the replicas' reduced gradients equal one device's on the whole
/// batch (the printed differences are below 1e-5); a batch that does not split over dp is
/// refused naming both flags.
#[test]
fn data_parallel_and_fsdp_steps_match_one_device() {
    for extra in [&["--dp", "2"][..], &["--dp", "2", "--fsdp"][..]] {
        let base = ["--schedule", "zbv", "--ranks", "2", "--microbatches", "4", "--microbatch-size", "2"];
        let out = verify(&[&base[..], extra].concat());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(
            text.starts_with(&format!(
                "verify zbv p=2 v=2 m=4 dp=2{}",
                if extra.len() == 3 { " fsdp" } else { "" }
            )),
            "{text}"
        );
        assert!(number(&text, "gradients:", "max relative difference") <= 1e-5, "{text}");
        assert!(number(&text, "gradients:", "gradients:") == 39.0, "{text}");
    }
    let out = verify(&[
        "--schedule",
        "1f1b",
        "--ranks",
        "2",
        "--microbatches",
        "2",
        "--microbatch-size",
        "3",
        "--dp",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("--dp 2 does not divide --microbatch-size 3"), "{e}");
}

/// `--tp 2` (with `--dp 2 --fsdp`, and with `--sequence-parallel`) on the grouped-query, biased, tied-embedding HF fixture's
/// config: its gradients, gathered whole, equal one device's — also at `--tp 4`, where each of
/// its 2 key/value heads is held by 2 ranks; a head count tp does not divide is refused naming
/// the field.
#[test]
fn tensor_parallel_steps_match_one_device() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf-tiny-llama-gelu/config.json");
    let base = ["--schedule", "1f1b", "--ranks", "2", "--microbatches", "4", "--microbatch-size", "2"];
    let sp = ["--tp", "2", "--sequence-parallel", "--dp", "2", "--fsdp"];
    // tp 4 over the 2 key/value heads: each held by 2 ranks.
    let kv = ["--tp", "4", "--seq-len", "8"];
    for extra in [&["--tp", "2"][..], &["--tp", "2", "--dp", "2", "--fsdp"][..], &sp[..], &kv[..]] {
        let out = verify(&[&base[..], &["--model", config], extra].concat());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        let says = match extra {
            e if e.contains(&"--sequence-parallel") => " tp=2 sequence-parallel ",
            e if e.contains(&"4") => " tp=4 ",
            _ => " tp=2 ",
        };
        assert!(text.lines().next().unwrap().contains(says), "{text}");
        assert!(number(&text, "gradients:", "max relative difference") <= 1e-5, "{text}");
    }
    let out = verify(&[&base[..], &["--model", config, "--tp", "3"]].concat());
    assert_eq!(out.status.code(), Some(1));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("`num_attention_heads` = 4 does not split over tp = 3"), "{e}");
}

/// `--ep 2` (pp = 2, so 4 ranks: --dp defaults to --ep) under 1f1b, zbv and dualpipev equals
/// one device, with Llama attention, with DeepSeek's MLA and group-limited routing
/// (`moe-mla-tiny`) and with its multi-token-prediction module (`moe-mla-tiny-mtp`, whose
/// gradients reach the shared embedding from both ends of the pipeline); an expert-parallel
/// degree the run cannot have is refused naming --ep.
#[test]
fn expert_parallel_steps_match_one_device() {
    let models = ["moe-tiny", "moe-mla-tiny", "moe-mla-tiny-mtp"];
    let runs = ["1f1b", "zbv", "dualpipev"].into_iter().flat_map(|k| models.map(|m| (k, m)));
    for (kind, model) in runs {
        let out = verify(&[
            "--model",
            model,
            "--schedule",
            kind,
            "--ranks",
            "2",
            "--microbatches",
            "4",
            "--microbatch-size",
            "2",
            "--ep",
            "2",
        ]);
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(out.status.success(), "{kind}: {text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("dp=2 ep=2"), "{text}");
        assert!(number(&text, "gradients:", "max relative difference") <= 1e-5, "{text}");
    }
    for (args, want) in [
        (
            &["--model", "moe-tiny", "--ep", "3", "--dp", "3", "--microbatch-size", "3"][..],
            "--ep 3: config field `n_routed_experts`: 8 routed experts do not split evenly",
        ),
        (
            &["--model", "moe-tiny", "--ep", "4", "--dp", "2", "--microbatch-size", "2"][..],
            "--ep 4: the expert-parallel degree must divide",
        ),
        (
            &["--model", "tiny", "--ep", "2", "--microbatch-size", "2"][..],
            "--ep 2: expert parallelism needs a mixture-of-experts model",
        ),
    ] {
        let out =
            verify(&[&["--schedule", "1f1b", "--ranks", "2", "--microbatches", "2"][..], args].concat());
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// The MoE models (Llama attention; MLA) under every kind of schedule the issue names equal one
/// device; a MoE config with a missing or impossible field is refused naming it, before any step.
#[test]
fn moe_steps_match_one_device_and_bad_configs_are_named() {
    let runs = ["1f1b", "zbv", "dualpipev"].into_iter().flat_map(|k| [(k, "moe-tiny"), (k, "moe-mla-tiny")]);
    for (kind, model) in runs {
        let out = verify(&["--model", model, "--schedule", kind, "--ranks", "2", "--microbatches", "4"]);
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(out.status.success(), "{kind}: {text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(number(&text, "gradients:", "max relative difference") <= 1e-5, "{text}");
        assert!(text.contains("(grad.model.layers."), "the largest difference names a tensor: {text}");
    }
    let d = tempfile::tempdir().unwrap();
    let base = r#""vocab_size":256,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":2,"n_routed_experts":4,"n_shared_experts":1,"moe_intermediate_size":8,"first_k_dense_replace":1,"routed_scaling_factor":1.0"#;
    for (extra, want) in [
        ("", "missing field `num_experts_per_tok`"),
        (r#","num_experts_per_tok":5"#, "config field `num_experts_per_tok`: 5 must be in 1..=4"),
    ] {
        let f = d.path().join("moe.json");
        std::fs::write(&f, format!("{{{base}{extra}}}")).unwrap();
        let out = verify(&[
            "--model",
            f.to_str().unwrap(),
            "--schedule",
            "1f1b",
            "--ranks",
            "2",
            "--microbatches",
            "2",
        ]);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{extra}: {err}");
    }
}

/// `--dp` alone runs: the microbatch size defaults to one sequence per replica (B = dp), where a
/// fixed default of 1 was refused as not divisible by dp (a B that dp does not divide is still
/// refused: `pipelined_steps_match_one_device`).
#[test]
fn data_parallelism_without_a_microbatch_size_runs_a_sequence_per_replica() {
    let out = verify(&["--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--dp", "2"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.starts_with("verify 1f1b p=2 v=1 m=2 dp=2 (model tiny, 4 layers, B=2 T=16"), "{text}");
}

/// A shape the model cannot serve is refused before the warning about ranks contending for
/// cores (a new user saw the warning first), and a shape the kind cannot serve still names the
/// kind's rule.
#[test]
fn a_refused_shape_is_refused_before_any_warning() {
    let out = verify(&["--schedule", "zbv", "--ranks", "3", "--microbatches", "4"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("too few for the 6 model stages"), "{err}");
    assert!(!err.contains("warning:"), "{err}");
}

/// The multi-token-prediction module under DualPipe's two parameter copies (each copy's last
/// stage runs it), the interleaved loop, FSDP, and bf16 against a bf16 single device.
#[test]
fn the_mtp_module_verifies_under_more_layouts() {
    let base = ["--model", "moe-mla-tiny-mtp", "--ranks", "2", "--microbatches", "4"];
    for extra in [
        &["--schedule", "dualpipe"][..],
        &["--schedule", "interleaved-1f1b"],
        &["--schedule", "1f1b", "--dp", "2", "--microbatch-size", "2", "--fsdp"],
        &["--schedule", "zbv", "--dtype", "bf16", "--reference-dtype", "bf16"],
    ] {
        let out = verify(&[&base[..], extra].concat());
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            out.status.success() && text.contains("PASS"),
            "{extra:?}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("gradients: 167 tensors"), "the module's gradients are compared: {text}");
    }
}
