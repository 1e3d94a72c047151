//! Tensor parallelism (Megatron's column- and row-parallel attention and MLP, the `tp` mesh axis
//! innermost) composed with pipeline, data parallelism and FSDP, as threads: gradients equal
//! one device's under every schedule the issue names, on `tiny` and on a grouped-query config
//! with biases and a tied embedding; training at tp = 2 gives tp = 1's losses; a checkpoint
//! gathered at one tp resumes at another; the resident state per rank shrinks.

mod common;

use std::collections::HashMap;

use graphpp_models::LlamaConfig;
use graphpp_runtime::verify::{random_microbatches, verify_step, VerifySetup, TOLERANCE};
use graphpp_runtime::{TrainError, TrainSetup, Trainer};
use graphpp_schedule::{Kind, Shape};

const KINDS: [Kind; 5] = [Kind::Gpipe, Kind::OneFOneB, Kind::Interleaved1F1B, Kind::Zbv, Kind::DualPipeV];

/// tiny with 2 key/value heads for its 4 query heads, biases on every projection and a tied
/// embedding: every tensor-parallel rule at work (a split KV head, a row-parallel bias added
/// after the all-reduce, an embedding copy on the first and last stage).
fn gqa() -> LlamaConfig {
    LlamaConfig {
        num_key_value_heads: Some(2),
        attention_bias: true,
        mlp_bias: true,
        tie_word_embeddings: true,
        ..LlamaConfig::tiny()
    }
}

/// With and without sequence parallelism (the residual stream, norms and hand-overs split
/// along the sequence; all-gathers and reduce-scatters instead of the all-reduces; the
/// replicated parameters' partial gradients summed over the tp group).
#[test]
fn tensor_parallel_gradients_equal_one_devices_under_every_schedule() {
    for (model, name, gradients) in [(LlamaConfig::tiny(), "tiny", 39), (gqa(), "gqa", 66)] {
        for kind in KINDS {
            for (dp, fsdp, sp) in
                [(1, false, false), (2, false, false), (2, true, false), (1, false, true), (2, true, true)]
            {
                let shape = Shape::new(2, kind.default_stages_per_rank(), 4);
                let mut setup = VerifySetup::new(model.clone(), kind, shape, 2, 8);
                (setup.train.dp, setup.train.fsdp, setup.train.tp, setup.train.seed) = (dp, fsdp, 2, 5);
                setup.train.sequence_parallel = sp;
                let r = verify_step(&setup).unwrap();
                let what = format!("{name} {kind} dp={dp} fsdp={fsdp} sp={sp}");
                assert!(r.passes(TOLERANCE), "{what}: {r:?}");
                assert_eq!(r.gradients, gradients, "{what}: every gradient compared, whole");
            }
        }
    }
}

/// Sequence parallelism trains with the losses of one rank per stage, hands over half the
/// activation bytes between stages and holds fewer activations; refused where it cannot run.
#[test]
fn sequence_parallel_training_gives_tp_1s_losses() {
    let batches: Vec<_> = (0..3).map(|k| random_microbatches(256, 4, 2, 8, 90 + k).unwrap()).collect();
    // Pointwise recomputation (train's default): the backward gathers the projections' inputs
    // again instead of keeping them gathered.
    let run = |tp: usize, sp: bool| {
        let recompute = graphpp_models::Recompute::Pointwise;
        let setup = TrainSetup { sequence_parallel: sp, recompute, ..setup(Kind::Zbv, 1, false, tp) };
        let mut t = Trainer::new(setup).unwrap();
        let stats: Vec<_> = batches.iter().map(|b| t.step(b.clone()).unwrap().stats).collect();
        (stats.iter().map(|s| s.loss).collect::<Vec<_>>(), stats[2].peak_bytes.clone())
    };
    let (l1, _) = run(1, false);
    let (l2, p2) = run(2, false);
    let (ls, ps) = run(2, true);
    assert!(close(&ls, &l1) && close(&l2, &l1), "sp {ls:?}, tp {l2:?} vs tp=1 {l1:?}");
    assert!(ps.iter().zip(&p2).all(|(s, t)| s < t), "peaks with sp {ps:?} vs without {p2:?}");
    for (sp, tp, seq, why) in
        [(true, 1, 8, "needs --tp 2 or more"), (true, 2, 9, "divide the sequence length 9")]
    {
        let bad = TrainSetup { sequence_parallel: sp, seq_len: seq, ..setup(Kind::Zbv, 1, false, tp) };
        let e = Trainer::new(bad).unwrap_err();
        assert!(matches!(e, TrainError::TensorParallel { .. }) && e.to_string().contains(why), "{e}");
    }
}

fn setup(kind: Kind, dp: usize, fsdp: bool, tp: usize) -> TrainSetup {
    let v = kind.default_stages_per_rank();
    TrainSetup { microbatch_size: 2, dp, fsdp, tp, ..common::tiny_setup(kind, 2, v, 4) }
}

fn close(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs())
}

/// Four steps at tp = 2 (with clipping and AdamW) give tp = 1's losses on the same batches;
/// each rank's resident parameters, gradients and moments are its shard: the split matrices,
/// the embedding and the LM head halve, the norms stay whole.
#[test]
fn training_at_tp_2_gives_tp_1s_losses_on_half_the_matrices() {
    let batches: Vec<_> = (0..4).map(|k| random_microbatches(256, 4, 2, 8, 70 + k).unwrap()).collect();
    let run = |tp: usize| {
        let mut t = Trainer::new(setup(Kind::OneFOneB, 1, false, tp)).unwrap();
        let stats: Vec<_> = batches.iter().map(|b| t.step(b.clone()).unwrap().stats).collect();
        (
            stats.iter().map(|s| s.loss).collect::<Vec<_>>(),
            stats[3].resident_bytes.clone(),
            stats[0].grad_norm,
        )
    };
    let (l1, r1, n1) = run(1);
    let (l2, r2, n2) = run(2);
    assert!(close(&l2, &l1), "tp=2 {l2:?} vs tp=1 {l1:?}");
    // The first step's norm (same weights): each split shard counted once, each replicated
    // parameter once. (Later steps drift by ~1e-5: the vocabulary-parallel softmax sums in
    // another order, and AdamW amplifies the last bits of near-zero gradients.)
    assert!((n2 - n1).abs() <= 1e-6 * n1, "grad norm {n2} vs {n1}");
    // World rank = pipeline rank · 2 + tp index: both tp ranks of a position hold the same bytes.
    assert_eq!(r2.len(), 4);
    let cfg = LlamaConfig::tiny();
    let (d, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    // Per layer 4·D² attention and 3·D·F MLP floats are split, and the V·D embedding (first
    // stage) or LM head (last stage); 16 bytes each (f32 parameter, gradient, two moments).
    let split = 2 * (4 * d * d + 3 * d * f) + v * d;
    for p in 0..2 {
        assert_eq!(r2[2 * p], r2[2 * p + 1], "pipeline rank {p}: tp ranks hold equal shards");
        let saved = r1[p] - r2[2 * p];
        assert_eq!(saved as usize, 16 * split / 2, "pipeline rank {p}: half of its matrices");
    }
    assert!(r1[0] as usize > 16 * v * d, "the embedding is in rank 0's state");
}

/// A checkpoint gathered at tp = 2 (whole tensors) resumes at tp = 1 and continues the straight
/// tp = 1 run's losses; and a tp = 1 checkpoint resumes at tp = 2 with dp = 2 and FSDP.
#[test]
fn a_checkpoint_resumes_under_another_tensor_parallel_degree() {
    let batches: Vec<_> = (0..4).map(|k| random_microbatches(256, 4, 2, 8, 80 + k).unwrap()).collect();
    let mut straight = Trainer::new(setup(Kind::Zbv, 1, false, 1)).unwrap();
    let want: Vec<f64> = batches.iter().map(|b| straight.step(b.clone()).unwrap().stats.loss).collect();
    let mut tp2 = Trainer::new(setup(Kind::Zbv, 1, false, 2)).unwrap();
    for b in &batches[..2] {
        tp2.step(b.clone()).unwrap();
    }
    let saved: HashMap<_, _> = tp2.gather_state(true).unwrap().unwrap().into_iter().collect();
    let mut resumed = Trainer::new(setup(Kind::Zbv, 1, false, 1)).unwrap();
    resumed.load_state(&saved).unwrap();
    let got: Vec<f64> = batches[2..].iter().map(|b| resumed.step(b.clone()).unwrap().stats.loss).collect();
    assert!(close(&got, &want[2..]), "tp=2 → tp=1: {got:?} vs {:?}", &want[2..]);

    let mut tp1 = Trainer::new(setup(Kind::DualPipeV, 1, false, 1)).unwrap();
    for b in &batches[..2] {
        tp1.step(b.clone()).unwrap();
    }
    let saved: HashMap<_, _> = tp1.gather_state(true).unwrap().unwrap().into_iter().collect();
    let mut wide = Trainer::new(setup(Kind::DualPipeV, 2, true, 2)).unwrap();
    wide.load_state(&saved).unwrap();
    let again: HashMap<_, _> = wide.gather_state(true).unwrap().unwrap().into_iter().collect();
    for (name, t) in &saved {
        let same = common::same(&again[name], t);
        assert!(same, "{name} changed through tp and FSDP sharding");
    }
    let got: Vec<f64> = batches[2..].iter().map(|b| wide.step(b.clone()).unwrap().stats.loss).collect();
    assert!(close(&got, &want[2..]), "tp=1 → tp=2 dp=2 fsdp: {got:?} vs {:?}", &want[2..]);
}

/// Key/value heads fewer than tp (one, multi-query attention, at tp = 2): each rank holds the
/// whole head, as Megatron replicates it, and the two ranks' partial gradients of it are summed;
/// gradients equal one device's (with sequence parallelism and FSDP too), and a checkpoint's
/// whole tensors go into the shards and come back whole.
#[test]
fn key_value_heads_fewer_than_tp_are_replicated() {
    let mqa = LlamaConfig { num_key_value_heads: Some(1), ..gqa() };
    for kind in [Kind::OneFOneB, Kind::DualPipeV] {
        for (dp, fsdp, sp) in [(1, false, false), (2, true, true)] {
            let shape = Shape::new(2, kind.default_stages_per_rank(), 4);
            let mut setup = VerifySetup::new(mqa.clone(), kind, shape, 2, 8);
            (setup.train.dp, setup.train.fsdp, setup.train.tp, setup.train.seed) = (dp, fsdp, 2, 7);
            setup.train.sequence_parallel = sp;
            let r = verify_step(&setup).unwrap();
            assert!(r.passes(TOLERANCE), "{kind} dp={dp} sp={sp}: {r:?}");
        }
    }
    let make = |tp: usize| {
        let s = TrainSetup { model: std::sync::Arc::new(mqa.clone()), ..setup(Kind::OneFOneB, 1, false, tp) };
        Trainer::new(s).unwrap()
    };
    let mut one = make(1);
    one.step(random_microbatches(256, 4, 2, 8, 3).unwrap()).unwrap();
    let saved: HashMap<_, _> = one.gather_state(true).unwrap().unwrap().into_iter().collect();
    let mut two = make(2);
    two.load_state(&saved).unwrap();
    let again: HashMap<_, _> = two.gather_state(true).unwrap().unwrap().into_iter().collect();
    for (name, t) in &saved {
        assert!(common::same(&again[name], t), "{name} changed through the tp = 2 shards");
    }
}

/// MoE models under tensor parallelism, with and without expert parallelism: the attention
/// (grouped-query, or multi-head latent attention replicated), the dense layers' MLPs, the shared
/// experts and the vocabulary split; the router and routed experts computed whole on every tp
/// rank (the experts split over ep): gradients equal one device's.
#[test]
fn moe_models_under_tensor_and_expert_parallelism() {
    for name in ["moe-tiny", "moe-mla-tiny"] {
        let model = graphpp_models::ModelConfig::preset(name).unwrap();
        for (kind, dp, ep) in [(Kind::OneFOneB, 1, 1), (Kind::DualPipeV, 2, 2)] {
            let shape = Shape::new(2, kind.default_stages_per_rank(), 4);
            let mut setup = VerifySetup::new(model.clone(), kind, shape, 2, 8);
            (setup.train.dp, setup.train.ep, setup.train.tp, setup.train.seed) = (dp, ep, 2, 11);
            let r = verify_step(&setup).unwrap();
            assert!(r.passes(TOLERANCE), "{name} {kind} ep={ep}: {r:?}");
        }
    }
}

/// A degree that does not split the heads is refused before anything is built, naming the
/// field.
#[test]
fn a_degree_that_does_not_divide_the_heads_is_refused() {
    let e = Trainer::new(setup(Kind::OneFOneB, 1, false, 3)).unwrap_err();
    assert!(matches!(e, TrainError::TensorParallel { tp: 3, .. }), "{e:?}");
    assert!(e.to_string().contains("`num_attention_heads` = 4 does not split over tp = 3"), "{e}");
    let e = Trainer::new(setup(Kind::OneFOneB, 1, false, 0)).unwrap_err();
    assert!(matches!(e, TrainError::TensorParallel { tp: 0, .. }), "{e:?}");
}
