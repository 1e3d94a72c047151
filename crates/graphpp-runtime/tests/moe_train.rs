//! Training a MoE model: each step reports every expert's load (summed over microbatches and
//! replicas), moves each layer's routing bias by exactly ±γ against the load (DeepSeek-V3's
//! auxiliary-loss-free balancing, the same on every copy), and a run restored from a checkpoint
//! — parameters, moments and biases — continues bitwise.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use graphpp_models::MoeConfig;
use graphpp_runtime::kernels::tensor::to_f64;
use graphpp_runtime::verify::random_microbatches;
use graphpp_runtime::{TrainSetup, Trainer};
use graphpp_schedule::Kind;

/// 4 layers (1 dense, 3 MoE), 4 experts, 2 per token, vocabulary 256.
fn model() -> MoeConfig {
    let mut m = MoeConfig::tiny();
    m.base.hidden_size = 16;
    m.base.intermediate_size = 24;
    m.base.num_attention_heads = 2;
    m.n_routed_experts = 4;
    m.moe_intermediate_size = 8;
    m
}

fn setup(dp: usize, gamma: f64) -> TrainSetup {
    TrainSetup {
        model: Arc::new(model()),
        microbatch_size: 2,
        dp,
        expert_bias_update: gamma,
        ..common::tiny_setup(Kind::DualPipeV, 2, 2, 4)
    }
}

fn data(step: u64) -> graphpp_runtime::pipeline::stage::Microbatches {
    random_microbatches(256, 4, 2, 8, 40 + step).unwrap()
}

fn biases(t: &mut Trainer) -> Vec<Vec<f64>> {
    let state = t.gather_state(false).unwrap().unwrap();
    (1..4).map(|l| to_f64(&state[&MoeConfig::bias_name(l)]).unwrap()).collect()
}

#[test]
fn loads_are_counted_and_biases_move_against_them() {
    for dp in [1, 2] {
        let gamma = 0.01;
        let mut t = Trainer::new(setup(dp, gamma)).unwrap();
        assert!(biases(&mut t).iter().flatten().all(|&b| b == 0.0));
        let r = t.step(data(0)).unwrap();
        // m · B · T tokens, k = 2 copies each, in each of the 3 MoE layers.
        assert_eq!(r.stats.expert_load.len(), 3);
        for load in &r.stats.expert_load {
            assert_eq!(load.len(), 4);
            assert_eq!(load.iter().sum::<u64>(), 4 * 2 * 8 * 2, "dp={dp}: {load:?}");
        }
        for (load, bias) in r.stats.expert_load.iter().zip(biases(&mut t)) {
            let mean = load.iter().sum::<u64>() as f64 / 4.0;
            for (&l, b) in load.iter().zip(bias) {
                let want = if l as f64 > mean {
                    -gamma
                } else if (l as f64) < mean {
                    gamma
                } else {
                    0.0
                };
                assert!((b - want).abs() < 1e-7, "dp={dp}: load {l} (mean {mean}) gave bias {b}");
            }
        }
    }
}

#[test]
fn a_restored_run_continues_bitwise_with_its_biases() {
    let mut straight = Trainer::new(setup(2, 0.05)).unwrap();
    for s in 0..2 {
        straight.step(data(s)).unwrap();
    }
    let saved: HashMap<_, _> = straight.gather_state(true).unwrap().unwrap().into_iter().collect();
    assert!(saved.contains_key(&MoeConfig::bias_name(3)));
    let last = straight.step(data(2)).unwrap();
    let mut resumed = Trainer::new(setup(2, 0.05)).unwrap();
    resumed.load_state(&saved).unwrap();
    let again = resumed.step(data(2)).unwrap();
    assert_eq!(last.stats.loss.to_bits(), again.stats.loss.to_bits());
    assert_eq!(last.stats.expert_load, again.stats.expert_load);
    // Without the biases the routing differs: the restored run used them.
    let mut fresh = Trainer::new(setup(2, 0.05)).unwrap();
    let params: HashMap<_, _> = saved
        .iter()
        .filter(|(k, _)| !k.contains("e_score_correction_bias"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    fresh.load_state(&params).unwrap();
    assert_ne!(fresh.step(data(2)).unwrap().stats.loss.to_bits(), last.stats.loss.to_bits());
}

/// An emulated link changes when messages and collectives arrive, never what they carry: the
/// same losses bit for bit (DualPipeV × dp 2: activations, gradients, all-reduces, the loss);
/// and it is in the path: each step waits at least its latency (the loss all-reduce alone).
#[test]
fn an_emulated_link_changes_no_loss() {
    let run = |link: Option<&str>| {
        let mut t =
            Trainer::new(TrainSetup { link: link.map(|l| l.parse().unwrap()), ..setup(2, 0.01) }).unwrap();
        let t0 = std::time::Instant::now();
        let losses = (0..2).map(|s| t.step(data(s)).unwrap().stats.loss.to_bits()).collect::<Vec<_>>();
        (losses, t0.elapsed())
    };
    let (plain, _) = run(None);
    let (linked, took) = run(Some("60000,0.5"));
    assert_eq!(plain, linked);
    assert!(took >= std::time::Duration::from_millis(120), "2 steps behind a 60 ms link took {took:?}");
}

/// Under bf16 mixed precision the routing biases stay f32: after three steps each is a multiple
/// of γ to f32 precision (bf16 would round 0.003 to 0.0030060).
#[test]
fn bf16_keeps_the_biases_in_f32() {
    let gamma = 0.001;
    let mut t = Trainer::new(TrainSetup { dtype: graphpp_graph::DType::BF16, ..setup(1, gamma) }).unwrap();
    for s in 0..3 {
        t.step(data(s)).unwrap();
    }
    for b in biases(&mut t).into_iter().flatten() {
        let steps = (b / gamma).round();
        assert!((b - steps * gamma).abs() < 1e-8 && steps.abs() <= 3.0, "bias {b}");
    }
}

/// DualPipe holds every layer twice (one copy per direction); each microbatch runs through one
/// copy, so the step's loads still add up to the tokens once, and the biases move against the
/// global load. With FSDP over 2 replicas a restored run (parameters, moments, biases gathered and
/// re-sharded) continues bitwise.
#[test]
fn dualpipe_copies_and_fsdp_restore() {
    let mut t = Trainer::new(TrainSetup { kind: Kind::DualPipe, ..setup(1, 0.01) }).unwrap();
    let r = t.step(data(0)).unwrap();
    for load in &r.stats.expert_load {
        assert_eq!(load.iter().sum::<u64>(), 4 * 2 * 8 * 2, "{load:?}");
    }
    // The gathered biases (from each layer's owning copy) moved by ±γ against the global load.
    for (load, bias) in r.stats.expert_load.iter().zip(biases(&mut t)) {
        let mean = load.iter().sum::<u64>() as f64 / 4.0;
        for (&l, b) in load.iter().zip(bias) {
            let want = if l as f64 > mean {
                -0.01
            } else if (l as f64) < mean {
                0.01
            } else {
                0.0
            };
            assert!((b - want).abs() < 1e-7, "load {l} (mean {mean}) gave bias {b}");
        }
    }

    let fsdp = || TrainSetup { fsdp: true, ..setup(2, 0.05) };
    let mut straight = Trainer::new(fsdp()).unwrap();
    for s in 0..2 {
        straight.step(data(s)).unwrap();
    }
    let saved: HashMap<_, _> = straight.gather_state(true).unwrap().unwrap().into_iter().collect();
    let last = straight.step(data(2)).unwrap();
    let mut resumed = Trainer::new(fsdp()).unwrap();
    resumed.load_state(&saved).unwrap();
    assert_eq!(resumed.step(data(2)).unwrap().stats.loss.to_bits(), last.stats.loss.to_bits());
}

/// Expert parallelism (dp 2, ep 2: each replica holds half of every layer's experts) trains as
/// the replicated run does — the same losses and loads to rounding (only the order of a few
/// sums differs) — and its checkpoint holds every expert: restored into an ep 2 run it
/// continues bitwise, and into a run without expert parallelism it continues to rounding.
#[test]
fn expert_parallel_training_matches_and_restores() {
    let ep = || TrainSetup { ep: 2, ..setup(2, 0.05) };
    let mut replicated = Trainer::new(setup(2, 0.05)).unwrap();
    let mut sharded = Trainer::new(ep()).unwrap();
    // World rank r = dp·2 + pp: replica 0 holds experts 0–1 of every layer, replica 1 experts 2–3.
    for (rank, stages) in sharded.ranks().into_iter().enumerate() {
        let mut experts: Vec<usize> = stages
            .stages()
            .values()
            .flat_map(|s| s.parameter_names().iter())
            .filter_map(|n| n.split(".experts.").nth(1)?.split('.').next()?.parse().ok())
            .collect();
        experts.sort();
        experts.dedup();
        assert_eq!(experts, if rank < 2 { vec![0, 1] } else { vec![2, 3] }, "rank {rank}");
    }
    for s in 0..2 {
        let (a, b) = (replicated.step(data(s)).unwrap(), sharded.step(data(s)).unwrap());
        assert!(
            (a.stats.loss - b.stats.loss).abs() <= 1e-6 * a.stats.loss.abs(),
            "step {s}: {} vs {}",
            a.stats.loss,
            b.stats.loss
        );
        assert!((a.stats.grad_norm - b.stats.grad_norm).abs() <= 1e-5 * a.stats.grad_norm, "step {s}: norms");
        assert_eq!(a.stats.expert_load, b.stats.expert_load, "step {s}");
    }
    let saved: HashMap<_, _> = sharded.gather_state(true).unwrap().unwrap().into_iter().collect();
    let full: HashMap<_, _> = replicated.gather_state(true).unwrap().unwrap().into_iter().collect();
    let mut keys: Vec<_> = saved.keys().collect();
    let mut want: Vec<_> = full.keys().collect();
    keys.sort();
    want.sort();
    assert_eq!(keys, want, "the expert-parallel checkpoint holds what a replicated one does");
    let last = sharded.step(data(2)).unwrap();
    let mut resumed = Trainer::new(ep()).unwrap();
    resumed.load_state(&saved).unwrap();
    assert_eq!(resumed.step(data(2)).unwrap().stats.loss.to_bits(), last.stats.loss.to_bits());
    let mut unsharded = Trainer::new(setup(2, 0.05)).unwrap();
    unsharded.load_state(&saved).unwrap();
    let other = unsharded.step(data(2)).unwrap().stats.loss;
    assert!(
        (other - last.stats.loss).abs() <= 1e-6 * last.stats.loss.abs(),
        "{other} vs {}",
        last.stats.loss
    );
}

/// DualPipeV's overlapped F&B hides expert parallelism's all-to-alls behind the other
/// microbatch's work: behind a 50 ms emulated link (dp = ep = 2), on
/// the rank holding two MoE stages, every OVERLAP_F_B has a forward and a backward all-to-all
/// in flight at the same time, and takes less time — and less time blocked on the link — than
/// the same rank's plain F and B of those stages back to back. All from the measured intervals
/// of one step; every in-graph collective lasts at least the link's latency (the link is in
/// the path).
#[test]
fn overlapped_f_and_b_hide_the_expert_all_to_alls() {
    use graphpp_schedule::{Action, CommSpan, ComputeKind, Interval};
    let latency = 0.05;
    let link = Some("50000,100".parse().unwrap());
    let mut t = Trainer::new(TrainSetup { ep: 2, link, ..setup(2, 0.01) }).unwrap();
    t.step(data(0)).unwrap(); // the first step also builds the multiplexed graphs
    let tl = t.step(data(1)).unwrap().timeline;
    // DualPipeV at p = 2: rank 1 holds stages 1 and 2, both MoE layers.
    let on1: Vec<&Interval> = tl.intervals.iter().filter(|i| i.rank == 1).collect();
    let spans =
        |a: Action| -> Vec<&CommSpan> { tl.comm.iter().filter(|c| c.rank == 1 && c.action == a).collect() };
    let ep_spans: Vec<&CommSpan> = tl.comm.iter().filter(|c| c.label.starts_with("ep.")).collect();
    assert!(!ep_spans.is_empty());
    for c in &ep_spans {
        assert!(c.start <= c.wait && c.wait <= c.end, "{c:?}");
        assert!(c.end - c.start >= 0.95 * latency, "{c:?} is shorter than the link's latency");
    }
    let blocked = |cs: &[&CommSpan]| cs.iter().map(|c| c.blocked()).sum::<f64>();
    let alone = |kind: ComputeKind, stage: usize| -> (f64, f64) {
        let runs: Vec<&&Interval> = on1
            .iter()
            .filter(
                |i| matches!(i.action, Action::Compute { kind: k, task } if k == kind && task.stage == stage),
            )
            .collect();
        assert!(!runs.is_empty(), "rank 1 runs no plain {kind:?} of stage {stage}");
        let n = runs.len() as f64;
        let time = runs.iter().map(|i| i.end - i.start).sum::<f64>() / n;
        (time, runs.iter().map(|i| blocked(&spans(i.action))).sum::<f64>() / n)
    };
    let mut overlaps = 0;
    for i in &on1 {
        let Action::Overlap { f, b } = i.action else { continue };
        overlaps += 1;
        let own = spans(i.action);
        let (fw, bw): (Vec<&CommSpan>, Vec<&CommSpan>) =
            own.iter().partition(|c| c.label.ends_with("(forward)"));
        assert!(fw.len() >= 2 && bw.len() >= 2, "{}: {own:?}", i.action);
        assert!(
            fw.iter().any(|x| bw.iter().any(|y| x.start < y.end && y.start < x.end)),
            "{}: no forward all-to-all in flight during the backward's: {own:?}",
            i.action
        );
        let (ft, fb) = alone(ComputeKind::F, f.stage);
        let (bt, bb) = alone(ComputeKind::B, b.stage);
        let took = i.end - i.start;
        assert!(took < ft + bt, "{}: {took} s overlapped vs {ft} + {bt} s back to back", i.action);
        assert!(blocked(&own) < fb + bb, "{}: blocked {} s vs {fb} + {bb} s", i.action, blocked(&own));
    }
    assert_eq!(overlaps, 3, "DualPipeV p=2 m=4 overlaps three F&B on rank 1");
}

/// The auxiliary balance loss (α = 0.1) is reported per step as a mean over microbatches and
/// replicas of the MoE layers' sum: the same on one rank, DualPipeV on 2, with 2 replicas, and
/// with expert parallelism (a wrong average over microbatches or replicas would differ by 2× or
/// 4×); a near-uniform routing gives about α per layer (Σ f_i P_i = 1 when uniform), and none
/// without α.
#[test]
fn the_aux_loss_is_reported_the_same_in_every_layout() {
    let aux = |kind: Kind, p: usize, v: usize, dp: usize, ep: usize, alpha: f64| {
        let model = Arc::new(MoeConfig { aux_loss_alpha: alpha, ..model() });
        let s = TrainSetup { model, microbatch_size: 2, dp, ep, ..common::tiny_setup(kind, p, v, 4) };
        Trainer::new(s).unwrap().step(data(0)).unwrap().stats.aux_loss
    };
    let one = aux(Kind::OneFOneB, 1, 1, 1, 1, 0.1);
    assert!(one > 0.1 * 3.0 * 0.8 && one < 0.1 * 3.0 * 2.0, "3 layers at α = 0.1: {one}");
    for (kind, p, v, dp, ep) in
        [(Kind::DualPipeV, 2, 2, 1, 1), (Kind::DualPipeV, 2, 2, 2, 1), (Kind::DualPipeV, 2, 2, 2, 2)]
    {
        let got = aux(kind, p, v, dp, ep, 0.1);
        assert!((got - one).abs() <= 1e-5 * one, "{kind} p={p} dp={dp} ep={ep}: {got} vs {one}");
    }
    assert_eq!(aux(Kind::OneFOneB, 1, 1, 1, 1, 0.0), 0.0);
}

/// Multi-token prediction (DeepSeek-V3 §2.2): the step reports the MTP module's cross-entropy
/// apart from the loss and from the balance losses, the same whatever λ (λ scales its share of
/// the objective, not the value reported), while the gradients follow λ; its MoE layer (layer
/// 4) has its expert load counted like the others.
#[test]
fn the_mtp_loss_is_reported_apart_and_weighted_by_lambda() {
    let with = |lambda: f64| {
        let m = MoeConfig { num_nextn_predict_layers: 1, mtp_loss_weight: lambda, ..model() };
        let mut t = Trainer::new(TrainSetup { model: Arc::new(m), ..setup(1, 0.0) }).unwrap();
        t.step(data(0)).unwrap().stats
    };
    let (a, b) = (with(0.3), with(0.6));
    // About ln 256 at the start, as the main loss.
    assert!((a.mtp_loss - 256f64.ln()).abs() < 0.5, "{}", a.mtp_loss);
    assert!((a.mtp_loss - b.mtp_loss).abs() < 1e-6 * a.mtp_loss, "{} vs {}", a.mtp_loss, b.mtp_loss);
    assert_eq!((a.loss, a.aux_loss), (b.loss, 0.0));
    assert!((a.grad_norm - b.grad_norm).abs() > 1e-3 * a.grad_norm, "{} vs {}", a.grad_norm, b.grad_norm);
    assert_eq!(a.expert_load.len(), 4, "the 3 MoE layers and the MTP module's");
    let without = Trainer::new(setup(1, 0.0)).unwrap().step(data(0)).unwrap().stats;
    assert_eq!((without.mtp_loss, without.loss), (0.0, a.loss));
}
