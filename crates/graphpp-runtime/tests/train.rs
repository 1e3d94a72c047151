//! Training steps under pipeline schedules: the same run under different schedules and shapes
//! gives the same parameters as one device, DualPipe's two copies stay equal, and restoring the
//! saved state continues the exact loss sequence.

mod common;

use std::collections::HashMap;

use graphpp_models::Recompute;
use graphpp_runtime::kernels::tensor::to_f64;
use graphpp_runtime::verify::random_microbatches;
use graphpp_runtime::{TrainSetup, Trainer};
use graphpp_schedule::Kind;

fn setup(kind: Kind, p: usize, v: usize, m: usize) -> TrainSetup {
    common::tiny_setup(kind, p, v, m)
}

/// Runs `steps` steps on one random batch (so the loss can fall); returns the losses and the
/// final parameters.
fn train(s: TrainSetup, steps: u64) -> (Vec<f64>, HashMap<String, Vec<f64>>) {
    let m = s.shape.microbatches;
    let mut t = Trainer::new(s).unwrap();
    let mut losses = Vec::new();
    for _ in 0..steps {
        let data = random_microbatches(256, m, 1, 8, 100).unwrap();
        losses.push(t.step(data).unwrap().stats.loss);
    }
    let params = t.parameters().into_iter().map(|(n, v)| (n, to_f64(&v).unwrap())).collect();
    (losses, params)
}

fn max_rel(a: &HashMap<String, Vec<f64>>, b: &HashMap<String, Vec<f64>>) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut worst: f64 = 0.0;
    for (n, x) in a {
        let y = &b[n];
        let scale = y.iter().fold(1e-12f64, |s, v| s.max(v.abs()));
        let d = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max);
        worst = worst.max(d / scale);
    }
    worst
}

/// Four optimizer steps (warm-up, cosine, clipping active at max norm 0.5) under ZB-V p=2,
/// interleaved 1F1B p=2 v=2 and DualPipe p=2 end at the parameters one device reaches.
#[test]
fn pipelined_training_matches_one_device() {
    let (l1, p1) = train(setup(Kind::Gpipe, 1, 1, 4), 4);
    assert!(l1[3] < l1[0], "the loss falls: {l1:?}");
    for (kind, p, v) in [(Kind::Zbv, 2, 2), (Kind::Interleaved1F1B, 2, 2), (Kind::DualPipe, 2, 2)] {
        let (l, params) = train(setup(kind, p, v, 4), 4);
        for (a, b) in l.iter().zip(&l1) {
            assert!((a - b).abs() / b < 1e-5, "{kind}: losses {l:?} vs {l1:?}");
        }
        let r = max_rel(&params, &p1);
        assert!(r < 1e-4, "{kind}: parameters differ by {r:e} relative");
    }
}

/// DualPipe's two copies of each stage get the summed gradient and stay bitwise equal.
#[test]
fn dualpipe_copies_stay_equal() {
    let mut t = Trainer::new(setup(Kind::DualPipe, 2, 2, 4)).unwrap();
    for k in 0..3 {
        t.step(random_microbatches(256, 4, 1, 8, k).unwrap()).unwrap();
    }
    let state = t.optimizer_state().unwrap();
    assert_eq!(to_f64(&state["adam.step"]).unwrap()[0], 3.0);
    // Every parameter is held by two stages (on the two ranks); both copies are bitwise equal.
    let mut copies: HashMap<String, Vec<Vec<f64>>> = HashMap::new();
    for rank in t.ranks() {
        for st in rank.stages().values() {
            for (n, v) in st.parameters() {
                copies.entry(n).or_default().push(to_f64(&v).unwrap());
            }
        }
    }
    assert_eq!(copies.len(), t.parameters().len());
    for (n, c) in &copies {
        assert_eq!(c.len(), 2, "{n} has two copies");
        assert_eq!(c[0], c[1], "{n}: the copies differ");
    }
    let init = Trainer::new(setup(Kind::DualPipe, 2, 2, 4)).unwrap().parameters();
    let moved = to_f64(&init["lm_head.weight"]).unwrap() != copies["lm_head.weight"][0];
    assert!(moved, "the parameters were updated");
}

/// Saving parameters + optimizer state after 2 steps and loading them into a fresh trainer gives
/// bitwise the next losses of the uninterrupted run.
#[test]
fn restored_state_continues_the_loss_sequence() {
    let s = setup(Kind::Zbv, 2, 2, 4);
    let batches: Vec<_> = (0..5).map(|k| random_microbatches(256, 4, 1, 8, 7 + k).unwrap()).collect();
    let mut a = Trainer::new(s.clone()).unwrap();
    let mut saved = HashMap::new();
    let mut straight = Vec::new();
    for (k, b) in batches.iter().enumerate() {
        straight.push(a.step(b.clone()).unwrap().stats.loss);
        if k == 1 {
            saved.extend(a.parameters());
            saved.extend(a.optimizer_state().unwrap());
        }
    }
    let mut b = Trainer::new(s).unwrap();
    b.load_state(&saved).unwrap();
    assert_eq!(b.steps_done(), 2);
    let resumed: Vec<f64> = batches[2..].iter().map(|x| b.step(x.clone()).unwrap().stats.loss).collect();
    assert_eq!(resumed, straight[2..].to_vec());
}

/// Loading a state without a parameter is an error naming it, and changes nothing.
#[test]
fn load_state_names_a_missing_parameter() {
    let mut t = Trainer::new(setup(Kind::OneFOneB, 2, 1, 2)).unwrap();
    let mut state: HashMap<_, _> = t.parameters().into_iter().collect();
    state.remove("lm_head.weight");
    let e = t.load_state(&state).unwrap_err().to_string();
    assert!(e.contains("lm_head.weight") && e.contains("missing"), "{e}");
}

/// Evaluation equals the training loss of the same batch before any update, and generation draws
/// ids inside the vocabulary (greedy decoding is deterministic).
#[test]
fn evaluate_and_generate() {
    let mut t = Trainer::new(setup(Kind::OneFOneB, 2, 1, 2)).unwrap();
    let data = random_microbatches(256, 2, 1, 8, 11).unwrap();
    let batches: Vec<(Vec<u32>, Vec<u32>)> = (0..2)
        .map(|j| {
            let ids = |x: &candle_core::Tensor| x.flatten_all().unwrap().to_vec1::<u32>().unwrap();
            (ids(&data.tokens[j]), ids(&data.targets[j]))
        })
        .collect();
    let eval = t.evaluate(&batches, 1).unwrap().expect("the harness is the leader");
    let step = t.step(data).unwrap();
    assert!((eval - step.stats.loss).abs() < 1e-6, "{eval} vs {}", step.stats.loss);
    let mut rng = 5;
    let g1 = t.generate(&[72, 105], 12, 0.0, 0, &mut rng).unwrap().unwrap();
    let g2 = t.generate(&[72, 105], 12, 0.0, 0, &mut rng).unwrap().unwrap();
    assert_eq!(g1, g2);
    assert_eq!(g1.len(), 12);
    assert!(t.generate(&[], 3, 1.0, 0, &mut rng).is_err());
    assert!(t.generate(&[300], 3, 1.0, 0, &mut rng).is_err());
}

/// One step of `kind` (p = 2, m = 8) under `recompute`: the loss, each rank's reported peak
/// bytes, activation peak and parameter bytes.
fn memory_step(kind: Kind, recompute: Recompute) -> (f64, Vec<u64>, Vec<usize>, Vec<usize>) {
    let mut t = Trainer::new(TrainSetup { recompute, ..setup(kind, 2, 1, 8) }).unwrap();
    let r = t.step(random_microbatches(256, 8, 1, 8, 100).unwrap()).unwrap();
    let act = t.ranks().iter().map(|w| w.peak_activation_bytes()).collect();
    let params = t
        .ranks()
        .iter()
        .map(|w| {
            w.stages().values().flat_map(|s| s.parameters().into_values()).map(|p| 4 * p.elem_count()).sum()
        })
        .collect();
    (r.stats.loss, r.stats.peak_bytes, act, params)
}

/// Peak memory per rank = parameters, gradients and AdamW moments (4 × the f32 parameter bytes),
/// buffers and the activation peak. GPipe keeps all 8 microbatches' activations on rank 0, 1F1B
/// at most 2 (p); recomputing from the stage inputs keeps less on rank 0, with the same loss.
#[test]
fn peak_memory_follows_the_schedule_and_recompute() {
    let (l_gpipe, peak_gpipe, act_gpipe, params) = memory_step(Kind::Gpipe, Recompute::SaveAll);
    let (l_1f1b, peak_1f1b, act_1f1b, _) = memory_step(Kind::OneFOneB, Recompute::SaveAll);
    let (l_re, _, act_re, _) = memory_step(Kind::OneFOneB, Recompute::StageInputs);
    for r in 0..2 {
        assert!(peak_1f1b[r] >= (4 * params[r] + act_1f1b[r]) as u64, "rank {r}");
        assert_eq!(peak_gpipe[r] - act_gpipe[r] as u64, peak_1f1b[r] - act_1f1b[r] as u64, "same state");
    }
    assert!(
        act_gpipe[0] > 2 * act_1f1b[0],
        "GPipe {} vs 1F1B {} activation bytes",
        act_gpipe[0],
        act_1f1b[0]
    );
    // Rank 0 holds two microbatches in flight and saves less; rank 1 (the last stage, one in
    // flight) peaks inside a backward, which recomputation does not shrink.
    assert!(act_re[0] < act_1f1b[0] && act_re[1] <= act_1f1b[1], "recompute {act_re:?} vs {act_1f1b:?}");
    assert!((l_gpipe - l_1f1b).abs() < 1e-6 && (l_re - l_1f1b).abs() < 1e-6, "{l_gpipe} {l_1f1b} {l_re}");
}
