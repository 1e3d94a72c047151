//! Memory in bytes: the static byte model (graph value types, the runtime's cache rule, the
//! executor's liveness accounting) predicts the peak bytes a real step measures, per rank, under
//! every kind of schedule and recompute policy; a model built from one schedule's stage graphs
//! predicts another schedule of the same stages.

mod common;

use graphpp_models::Recompute;
use graphpp_runtime::exec::{peak_live_bytes, run, RunOptions};
use graphpp_runtime::train::build::run_byte_model;
use graphpp_runtime::verify::random_microbatches;
use graphpp_runtime::{TrainSetup, Trainer};
use graphpp_schedule::Kind;

/// One step of `setup` (B = 2, T = 16): the peak bytes each pipeline rank of replica 0
/// measured and those the byte model predicts for the trainer's lowered schedule.
fn measured_and_predicted(setup: TrainSetup) -> (Vec<u64>, Vec<u64>) {
    let s = TrainSetup { microbatch_size: 2, seq_len: 16, ..setup };
    let (m, p) = (s.shape.microbatches, s.shape.ranks);
    let model = run_byte_model(&s, &s.lowered_schedule().unwrap()).unwrap();
    let mut t = Trainer::new(s).unwrap();
    let r = t.step(random_microbatches(256, m, 2, 16, 7).unwrap()).unwrap();
    let predicted = model.peak_bytes(t.schedule()).unwrap();
    assert_eq!(predicted.len(), p);
    (r.stats.peak_bytes[..p].to_vec(), predicted)
}

#[test]
fn the_byte_model_predicts_the_measured_peak_of_every_rank() {
    let cases = [
        (Kind::Gpipe, 2, 1, 4, Recompute::SaveAll),
        (Kind::OneFOneB, 2, 1, 4, Recompute::Layers),
        (Kind::Interleaved1F1B, 2, 2, 4, Recompute::SaveAll),
        (Kind::ZbH1, 2, 1, 4, Recompute::Matmuls),
        (Kind::Zbv, 2, 2, 4, Recompute::SaveAll),
        (Kind::Zbv, 2, 2, 4, Recompute::StageInputs),
        (Kind::DualPipeV, 2, 2, 4, Recompute::SaveAll),
        (Kind::DualPipe, 2, 2, 4, Recompute::SaveAll),
    ];
    for (kind, p, v, m, recompute) in cases {
        let (measured, predicted) =
            measured_and_predicted(TrainSetup { recompute, ..common::tiny_setup(kind, p, v, m) });
        // The byte model is the runtime's own accounting: equal to the byte.
        assert_eq!(measured, predicted, "{kind:?} {recompute:?}");
    }
}

/// With data parallelism REDUCE_GRAD hands each stage's gradients to the reduction before the
/// step ends: they are still held, and counted (a measured figure without them was one
/// parameter copy short of the prediction).
#[test]
fn data_parallel_ranks_hold_the_gradients_being_reduced() {
    for kind in [Kind::OneFOneB, Kind::Zbv] {
        let v = kind.default_stages_per_rank();
        let (measured, predicted) =
            measured_and_predicted(TrainSetup { dp: 2, ..common::tiny_setup(kind, 2, v, 4) });
        assert_eq!(measured, predicted, "{kind:?}");
    }
}

/// The activation part differs between schedules by more than the tolerance, so a model that
/// ignored the order (or the schedule) would fail the test above.
#[test]
fn schedules_of_the_same_stages_differ_in_peak_and_the_model_follows() {
    let (gpipe, gpipe_pred) = measured_and_predicted(common::tiny_setup(Kind::Gpipe, 2, 1, 8));
    let (one, one_pred) = measured_and_predicted(common::tiny_setup(Kind::OneFOneB, 2, 1, 8));
    assert!(gpipe[0] as f64 > 1.1 * one[0] as f64, "GPipe {} vs 1F1B {}", gpipe[0], one[0]);
    assert!(gpipe_pred[0] as f64 > 1.1 * one_pred[0] as f64, "{gpipe_pred:?} vs {one_pred:?}");
}

#[test]
fn the_static_peak_equals_the_executed_one() {
    let cfg = graphpp_models::LlamaConfig::tiny();
    let spec = graphpp_models::StageSpec { stage: 1, stages: 2, ..graphpp_models::StageSpec::whole(4) };
    let spec = graphpp_models::StageSpec { layers: 2..4, ..spec };
    let opts = graphpp_models::StageOptions::new(2, 16);
    let graphs = graphpp_runtime::train::build::graphs_of(&cfg, &spec, &opts).unwrap();
    let (di, dw) = graphs.di_dw.as_ref().unwrap();
    let mut rng = graphpp_models::rng::Rng::new(5);
    for g in [&graphs.fw, &graphs.full_bw, di, dw] {
        let inputs: Vec<_> =
            g.input_specs().iter().map(|s| common::random_input(s, &mut rng, -0.5, 0.5, 16)).collect();
        let report = run(g, &inputs, &RunOptions::default()).unwrap();
        assert_eq!(report.peak_live_bytes, peak_live_bytes(g), "{}", g.name);
        assert!(report.peak_live_bytes > 0);
    }
}
