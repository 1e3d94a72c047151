//! Data parallelism and FSDP under every schedule kind the issue names (pp = 2, dp = 2): the
//! gradients are reduced by the lowered schedule's REDUCE_GRAD (and, with FSDP, parameters live
//! as shards between UNSHARD and RESHARD); losses and parameters equal one replica's on the same
//! global batch; FSDP's resident state is about half; a checkpoint gathered from an FSDP run
//! resumes under another schedule at dp = 1.

mod common;

use std::collections::HashMap;

use graphpp_runtime::kernels::tensor::to_f64;
use graphpp_runtime::verify::random_microbatches;
use graphpp_runtime::{TrainSetup, Trainer};
use graphpp_schedule::{Kind, StageOpKind};

fn setup(kind: Kind, dp: usize, fsdp: bool) -> TrainSetup {
    let v = kind.default_stages_per_rank();
    TrainSetup { microbatch_size: 2, dp, fsdp, ..common::tiny_setup(kind, 2, v, 4) }
}

/// Relative L2 distance of two tensors' values.
fn rel_l2(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f64 {
    let (x, y) = (to_f64(a).unwrap(), to_f64(b).unwrap());
    let d = x.iter().zip(&y).map(|(p, q)| (p - q) * (p - q)).sum::<f64>().sqrt();
    d / y.iter().map(|q| q * q).sum::<f64>().sqrt().max(1e-30)
}

/// Counts of UNSHARD, RESHARD and REDUCE_GRAD in a lowered schedule.
fn stage_ops(t: &Trainer) -> [usize; 3] {
    let s = t.schedule();
    let mut n = [0; 3];
    for r in 0..s.num_ranks() {
        for a in s.program(r) {
            if let graphpp_schedule::Action::StageOp { kind, .. } = a {
                n[match kind {
                    StageOpKind::Unshard => 0,
                    StageOpKind::Reshard => 1,
                    StageOpKind::ReduceGrad => 2,
                    StageOpKind::WaitReduceGrad => panic!("graphpp's lowering emits no WAIT_REDUCE_GRAD"),
                }] += 1;
            }
        }
    }
    n
}

/// Three steps of each layout on the same global batches: (losses, gathered parameters, the
/// last step's resident bytes per rank).
fn run(
    kind: Kind,
    dp: usize,
    fsdp: bool,
) -> (Vec<f64>, HashMap<String, candle_core::Tensor>, Vec<u64>, [usize; 3]) {
    let mut t = Trainer::new(setup(kind, dp, fsdp)).unwrap();
    let mut losses = Vec::new();
    let mut resident = Vec::new();
    for k in 0..3 {
        let r = t.step(random_microbatches(256, 4, 2, 8, 40 + k).unwrap()).unwrap();
        losses.push(r.stats.loss);
        resident = r.stats.resident_bytes;
    }
    let params = t.gather_state(false).unwrap().unwrap().into_iter().collect();
    let ops = stage_ops(&t);
    (losses, params, resident, ops)
}

#[test]
fn data_parallel_and_fsdp_equal_one_replica_under_every_schedule() {
    for kind in [Kind::Gpipe, Kind::OneFOneB, Kind::Interleaved1F1B, Kind::Zbv, Kind::DualPipeV, Kind::ZbH1] {
        let (l1, p1, r1, ops1) = run(kind, 1, false);
        let (l2, p2, r2, ops2) = run(kind, 2, false);
        let (lf, pf, rf, opsf) = run(kind, 2, true);
        let stages = 2 * kind.default_stages_per_rank();
        assert_eq!(ops1, [0, 0, 0], "{kind}: dp = 1 has no stage ops");
        assert_eq!(ops2, [0, 0, stages], "{kind}: one REDUCE_GRAD per stage");
        assert_eq!(opsf, [stages, stages, stages], "{kind}: FSDP gathers each stage once per step");
        for (name, want) in &p1 {
            assert!(rel_l2(&p2[name], want) <= 1e-5, "{kind} dp=2: {name}");
            assert!(rel_l2(&pf[name], want) <= 1e-5, "{kind} fsdp: {name}");
        }
        for (l, what) in [(&l2, "dp=2"), (&lf, "fsdp")] {
            for (a, b) in l.iter().zip(&l1) {
                assert!((a - b).abs() <= 1e-5 * b.abs(), "{kind} {what}: losses {l:?} vs {l1:?}");
            }
        }
        // Resident parameters + gradients + AdamW moments: FSDP keeps about half on each rank.
        assert_eq!(r2.len(), 4);
        assert_eq!(&r2[..2], &r1[..], "{kind}: plain dp replicates the state");
        for (rank, (&f, &d)) in rf.iter().zip(&r2).enumerate() {
            assert!((f as f64) <= 0.6 * d as f64, "{kind}: rank {rank} resident {f} vs {d} without FSDP");
        }
    }
}

/// A checkpoint of an FSDP run (gathered full tensors) resumes as threads at dp = 1 under another
/// schedule and continues the uninterrupted dp = 1 run's losses.
#[test]
fn an_fsdp_checkpoint_resumes_under_another_layout() {
    let batches: Vec<_> = (0..4).map(|k| random_microbatches(256, 4, 2, 8, 60 + k).unwrap()).collect();
    let mut straight = Trainer::new(setup(Kind::Zbv, 1, false)).unwrap();
    let want: Vec<f64> = batches.iter().map(|b| straight.step(b.clone()).unwrap().stats.loss).collect();
    let mut fsdp = Trainer::new(setup(Kind::DualPipeV, 2, true)).unwrap();
    for b in &batches[..2] {
        fsdp.step(b.clone()).unwrap();
    }
    let saved: HashMap<_, _> = fsdp.gather_state(true).unwrap().unwrap().into_iter().collect();
    let mut resumed = Trainer::new(setup(Kind::Zbv, 1, false)).unwrap();
    resumed.load_state(&saved).unwrap();
    let got: Vec<f64> = batches[2..].iter().map(|b| resumed.step(b.clone()).unwrap().stats.loss).collect();
    for (a, b) in got.iter().zip(&want[2..]) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "resumed {got:?} vs {:?}", &want[2..]);
    }
    // And back: the dp = 1 state loads into an FSDP run (sharded on load).
    let mut back = Trainer::new(setup(Kind::DualPipeV, 2, true)).unwrap();
    let state: HashMap<_, _> = resumed.gather_state(true).unwrap().unwrap().into_iter().collect();
    back.load_state(&state).unwrap();
    let again: HashMap<_, _> = back.gather_state(true).unwrap().unwrap().into_iter().collect();
    for (name, t) in &state {
        assert!(rel_l2(&again[name], t) == 0.0, "{name} changed through sharding");
    }
}

/// `verify_step` with dp = 2, with and without FSDP, for the kinds the issue names at pp = 2:
/// the replicas' reduced gradients equal one device's on the whole batch within 1e-5.
#[test]
fn verify_with_data_parallelism_matches_one_device() {
    use graphpp_runtime::verify::{verify_step, VerifySetup, TOLERANCE};
    let model = graphpp_models::LlamaConfig::tiny();
    for kind in [Kind::Gpipe, Kind::OneFOneB, Kind::Interleaved1F1B, Kind::Zbv, Kind::DualPipeV, Kind::ZbH1] {
        for fsdp in [false, true] {
            let shape = graphpp_schedule::Shape::new(2, kind.default_stages_per_rank(), 4);
            let mut setup = VerifySetup::new(model.clone(), kind, shape, 2, 8);
            (setup.train.dp, setup.train.fsdp, setup.train.seed) = (2, fsdp, 3);
            let r = verify_step(&setup).unwrap();
            assert!(r.passes(TOLERANCE), "{kind} fsdp={fsdp}: {r:?}");
            assert_eq!(r.gradients, 39, "{kind}: every gradient compared");
        }
    }
}

/// A schedule lowered for FSDP run by ranks without a data-parallel group fails at its first
/// UNSHARD, naming the stage — the stage ops are never silently skipped.
#[test]
fn fsdp_stage_ops_without_a_data_parallel_group_are_an_error() {
    use graphpp_runtime::train::build::{stage_specs, StageBuild};
    use graphpp_runtime::verify::random_microbatches;
    use graphpp_schedule::{generate, lower, LowerOptions, Shape};
    use std::sync::Arc;
    let model = graphpp_models::LlamaConfig::tiny();
    let shape = Shape::new(2, 1, 2);
    let s = generate(Kind::OneFOneB, &shape, &Default::default()).unwrap();
    let lowered = lower(&s, &LowerOptions { fsdp_max_unsharded: Some(1), ..Default::default() }).unwrap();
    let specs = stage_specs(&model, Kind::OneFOneB, &shape, None).unwrap();
    let opts = graphpp_models::StageOptions::mixed(1, 8, graphpp_graph::DType::F32);
    let data = Arc::new(random_microbatches(256, 2, 1, 8, 0).unwrap());
    let workers = StageBuild {
        model: &model,
        specs: &specs,
        opts: &opts,
        seed: 0,
        given: None,
        device: &candle_core::Device::Cpu,
    }
    .all_ranks(&lowered, data)
    .unwrap();
    let e = graphpp_runtime::run_pipeline(&lowered, workers, std::time::Duration::from_secs(20)).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("UNSHARD") && msg.contains("needs a data-parallel group"), "{msg}");
}

/// `fsdp` with one replica is allowed and is the plain run: no stage ops, bitwise the same losses.
#[test]
fn fsdp_with_one_replica_equals_no_fsdp() {
    let mut plain = Trainer::new(setup(Kind::Zbv, 1, false)).unwrap();
    let mut fsdp = Trainer::new(setup(Kind::Zbv, 1, true)).unwrap();
    assert_eq!(stage_ops(&fsdp), [0, 0, 0]);
    for k in 0..2 {
        let data = random_microbatches(256, 4, 2, 8, 90 + k).unwrap();
        let (a, b) = (plain.step(data.clone()).unwrap(), fsdp.step(data).unwrap());
        assert_eq!(a.stats.loss.to_bits(), b.stats.loss.to_bits());
        assert_eq!(a.stats.resident_bytes, b.stats.resident_bytes);
    }
}

/// Mixed precision under FSDP: the shards are gathered in bf16 (half the bytes:
/// `data_parallel`'s unit test), which changes no value the stages compute — rounding a shard
/// commutes with gathering it — so three bf16 steps of FSDP (dp = 2) give plain data
/// parallelism's losses and parameters (the f32 reductions differ only in their order).
#[test]
fn bf16_fsdp_gathers_change_no_value() {
    let run = |fsdp: bool| {
        let setup = TrainSetup { dtype: graphpp_graph::DType::BF16, ..setup(Kind::OneFOneB, 2, fsdp) };
        let mut t = Trainer::new(setup).unwrap();
        let losses: Vec<f64> = (0..3)
            .map(|k| t.step(random_microbatches(256, 4, 2, 8, 80 + k).unwrap()).unwrap().stats.loss)
            .collect();
        let params: HashMap<String, candle_core::Tensor> =
            t.gather_state(false).unwrap().unwrap().into_iter().collect();
        (losses, params)
    };
    let ((ld, pd), (lf, pf)) = (run(false), run(true));
    for (a, b) in lf.iter().zip(&ld) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "fsdp {lf:?} vs dp {ld:?}");
    }
    for (name, want) in &pd {
        assert!(rel_l2(&pf[name], want) <= 1e-5, "{name}: {}", rel_l2(&pf[name], want));
    }
}
