//! `--device` and the kernels a GPU runs: the candle compositions a CUDA tensor takes
//! (`graphpp_runtime::kernels::device`), forced on the CPU with `GRAPHPP_KERNELS=composed`, give
//! the CPU kernels' losses and pass `verify`; a CUDA device in a build without CUDA is refused by
//! name; a strategy file carries the device.

use assert_cmd::Command;

fn graphpp(kernels: &str, args: &[&str]) -> (bool, String) {
    let out = Command::cargo_bin("graphpp")
        .expect("binary builds")
        .env("GRAPHPP_KERNELS", kernels)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
    )
}

/// The number after `key` on the first line starting with `line`.
fn number(out: &str, line: &str, key: &str) -> f64 {
    let l = out.lines().find(|l| l.starts_with(line)).unwrap_or_else(|| panic!("no {line}: {out}"));
    let rest = &l[l.find(key).unwrap_or_else(|| panic!("no {key} in {l}")) + key.len()..];
    rest.split_whitespace().next().unwrap().trim_end_matches(',').parse().unwrap()
}

#[test]
fn the_compositions_a_gpu_runs_match_the_cpu_kernels() {
    // Dense, MoE with expert parallelism (the routing's host reads), tensor + sequence
    // parallelism, bf16 with FSDP, MLA: the composed pipelined step's loss and gradients equal
    // the single-device reference's, which keeps the CPU kernels (verify's tolerance), and its
    // loss is the compiled pipelined step's within f32 rounding.
    let shape = ["--ranks", "2", "--microbatches", "4"];
    for layout in [
        &["--schedule", "zbv"][..],
        &["--schedule", "dualpipev", "--model", "moe-tiny", "--ep", "2"],
        &["--schedule", "1f1b", "--tp", "2", "--sequence-parallel"],
        &["--schedule", "1f1b", "--dp", "2", "--fsdp", "--dtype", "bf16"],
        &["--schedule", "zbv", "--model", "moe-mla-tiny"],
    ] {
        let args = [&shape[..], layout].concat();
        let verify: Vec<&str> = std::iter::once("verify").chain(args.iter().copied()).collect();
        let (ok, composed) = graphpp("composed", &verify);
        assert!(ok, "{args:?}: {composed}");
        let (ok, compiled) = graphpp("compiled", &verify);
        assert!(ok, "{args:?}: {compiled}");
        let (a, b) = (
            number(&composed, "loss pipelined", "pipelined"),
            number(&compiled, "loss pipelined", "pipelined"),
        );
        let tolerance = if args.contains(&"bf16") { 1e-2 } else { 1e-6 };
        assert!((a - b).abs() <= tolerance * b.abs(), "{args:?}: composed {a} vs compiled {b}");
    }
}

#[test]
fn training_on_the_compositions_follows_the_cpu_kernels_losses() {
    // A large learning rate makes every step's update depend on the gradients: a wrong
    // composed backward shows in the later losses.
    let dir = tempfile::tempdir().unwrap();
    let losses = |kernels: &str| {
        let ck = dir.path().join(kernels);
        let args = [
            "train",
            "--schedule",
            "1f1b",
            "--steps",
            "4",
            "--lr",
            "1e-2",
            "--warmup",
            "0",
            "--eval-every",
            "1",
            "--sample-bytes",
            "0",
            "--checkpoint-dir",
            ck.to_str().unwrap(),
        ];
        let (ok, out) = graphpp(kernels, &args);
        assert!(ok, "{out}");
        out.lines()
            .filter(|l| l.starts_with("step"))
            .map(|l| number(l, "step", "train loss"))
            .collect::<Vec<f64>>()
    };
    let (composed, compiled) = (losses("composed"), losses("compiled"));
    assert_eq!(composed.len(), 4, "{composed:?}");
    assert!(
        compiled[3] < compiled[0] - 0.1,
        "the run must learn for the comparison to mean anything: {compiled:?}"
    );
    for (a, b) in composed.iter().zip(&compiled) {
        assert!((a - b).abs() <= 2e-4, "composed {composed:?} vs compiled {compiled:?}");
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_cuda_device_needs_a_cuda_build_and_names_it() {
    let (ok, out) = graphpp(
        "compiled",
        &["verify", "--device", "cuda:1", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2"],
    );
    assert!(!ok);
    assert!(
        out.contains(
            "--device (or a strategy's place.device): device cuda:1: this graphpp was built without CUDA"
        ),
        "{out}"
    );
    assert!(out.contains("--features cuda") && out.contains("tools/gpu/build.sh"), "{out}");
    let (ok, out) = graphpp("compiled", &["train", "--device", "npu"]);
    assert!(!ok);
    assert!(out.contains("device `npu`: expected cpu, cuda or cuda:N"), "{out}");
    let (ok, out) =
        graphpp("compose", &["verify", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2"]);
    assert!(!ok);
    assert!(out.contains("GRAPHPP_KERNELS=compose: expected composed or compiled"), "{out}");
}

#[test]
fn a_strategy_carries_the_device() {
    let (ok, cpu) = graphpp("compiled", &["train", "--print-strategy"]);
    assert!(ok, "{cpu}");
    assert!(!cpu.contains("device"), "the CPU default is not written: {cpu}");
    let (ok, gpu) = graphpp("compiled", &["train", "--print-strategy", "--device", "cuda:1"]);
    assert!(ok, "{gpu}");
    assert!(gpu.contains("device = \"cuda:1\""), "{gpu}");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("s.toml");
    std::fs::write(&file, gpu.lines().filter(|l| !l.starts_with('#')).collect::<Vec<_>>().join("\n"))
        .unwrap();
    let (ok, out) = graphpp("compiled", &["verify", "--strategy", file.to_str().unwrap()]);
    assert!(!ok, "{out}");
    assert!(out.contains("device cuda:1"), "the strategy's device reaches the run: {out}");
}
