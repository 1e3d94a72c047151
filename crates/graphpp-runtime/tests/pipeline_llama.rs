//! Real stage graphs under every schedule kind: one pipelined step's loss and every gradient must
//! equal the single-device step on the whole batch (docs/ARCHITECTURE.md "Runtime" → Semantics) within
//! 1e-5 relative in f32; a failing stage stops the pipeline naming rank and action; every rank run
//! with `run_rank` on its own thread gives `run_pipeline`'s results bitwise.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use graphpp_comm::{Mesh, ThreadComm};
use graphpp_models::{LlamaConfig, StageOptions};
use graphpp_runtime::kernels::tensor::to_f64;
use graphpp_runtime::pipeline::stage::{GraphStages, Microbatches};
use graphpp_runtime::train::build::{stage_specs, StageBuild};
use graphpp_runtime::train::error::SetupError;
use graphpp_runtime::verify::{
    compare, pipelined_step, random_microbatches, single_device_step, StepResult, TOLERANCE,
};
use graphpp_runtime::{run_pipeline, run_rank, PipelineError, RankOptions, VerifySetup};
use graphpp_schedule::{
    generate, lower, Action, GenerateError, Kind, LowerOptions, Options, Schedule, Shape,
};

/// A model small enough for a sweep in debug: one decoder layer per model stage.
fn micro(layers: usize) -> LlamaConfig {
    LlamaConfig {
        vocab_size: 32,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: layers,
        num_attention_heads: 2,
        ..LlamaConfig::tiny()
    }
}

fn setup(kind: Kind, shape: Shape, batch: usize) -> VerifySetup {
    let layers = if kind == Kind::DualPipe { shape.ranks } else { shape.stages() };
    let mut s = VerifySetup::new(micro(layers), kind, shape, batch, 8);
    s.train.seed = 7;
    s.train.timeout = Duration::from_secs(30);
    s
}

/// (p, v) pairs per kind: v = 1 for single-chunk kinds, v = 2 for V placement, v ∈ {1, 2} for
/// interleaved loop-placement kinds.
fn stages_per_rank(kind: Kind) -> &'static [usize] {
    match kind {
        Kind::Gpipe | Kind::OneFOneB | Kind::ZbH1 | Kind::ZbH2 | Kind::ZbAuto => &[1],
        Kind::Zbv | Kind::ZbvAuto | Kind::VHalf | Kind::VMin | Kind::DualPipe | Kind::DualPipeV => &[2],
        Kind::Interleaved1F1B | Kind::LoopedBfs | Kind::GroupedInterleaved | Kind::InterleavedZb => &[1, 2],
    }
}

#[test]
fn every_kind_and_shape_matches_the_single_device_step() {
    let t0 = Instant::now();
    let mut exercised = BTreeSet::new();
    let mut runs = 0;
    for kind in Kind::ALL {
        for p in [1, 2, 4] {
            for &v in stages_per_rank(kind) {
                for m in [p, 2 * p + 1, 4 * p] {
                    let shape = Shape::new(p, v, m);
                    if let Err(GenerateError::Constraint { .. }) = generate(kind, &shape, &Options::default())
                    {
                        continue;
                    }
                    let s = setup(kind, shape, 1 + (m % 2));
                    let a = pipelined_step(&s).unwrap_or_else(|e| panic!("{kind} {shape:?}: {e}"));
                    let b = single_device_step(&s).unwrap();
                    let r = compare(&a, &b).unwrap();
                    assert!(r.passes(TOLERANCE), "{kind} p={p} v={v} m={m}: {r:?}");
                    // Every microbatch's loss was produced once, and the step loss is their mean.
                    assert_eq!(a.microbatch_losses.len(), m);
                    // A wrong gradient scale (e.g. a sum over microbatches) would fail above;
                    // also check the gradients are not trivially zero.
                    assert!(r.gradients >= 9 + 3, "{kind}: only {} gradients", r.gradients);
                    exercised.insert(kind);
                    runs += 1;
                }
            }
        }
    }
    let missing: Vec<_> = Kind::ALL.iter().filter(|k| !exercised.contains(k)).collect();
    assert!(missing.is_empty(), "kinds never exercised: {missing:?}");
    eprintln!("{runs} pipelined steps verified in {:.1} s", t0.elapsed().as_secs_f64());
}

#[test]
fn dualpipe_sums_the_two_parameter_copies() {
    // Each copy alone sees half the microbatches: its gradient differs from the full one, and
    // only the sum of both copies matches one device. DualPipe also runs OVERLAP_F_B actions.
    let s = setup(Kind::DualPipe, Shape::new(2, 2, 4), 1);
    let schedule =
        lower(&generate(s.train.kind, &s.train.shape, &s.train.options).unwrap(), &LowerOptions::default())
            .unwrap();
    assert!(schedule.actions().any(|(_, a)| matches!(a, Action::Overlap { .. })));
    let specs = stage_specs(&*s.train.model, s.train.kind, &s.train.shape, None).unwrap();
    assert_eq!(specs[2].layers, specs[0].layers, "stage p + i holds stage i's layers");
    let data = Arc::new(random_microbatches(32, 4, 1, 8, s.train.seed).unwrap());
    let ws = StageBuild {
        model: &*s.train.model,
        specs: &specs,
        opts: &StageOptions::new(1, 8),
        seed: s.train.seed,
        given: None,
        device: &candle_core::Device::Cpu,
    }
    .all_ranks(&schedule, data)
    .unwrap();
    let (ws, _) = run_pipeline(&schedule, ws, s.train.timeout).unwrap();
    let b = single_device_step(&s).unwrap();
    let copy0 = StepResult {
        loss: b.loss,
        microbatch_losses: vec![],
        grads: ws[0].stages()[&0].grads().iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
    };
    let partial = StepResult {
        grads: b
            .grads
            .iter()
            .filter(|(k, _)| copy0.grads.contains_key(*k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        loss: b.loss,
        microbatch_losses: vec![],
    };
    let r = compare(&copy0, &partial).unwrap();
    assert!(r.max_rel > 1e-2, "one copy alone should not match: {r:?}");
    assert!(compare(&pipelined_step(&s).unwrap(), &b).unwrap().passes(TOLERANCE));
}

#[test]
fn a_wrong_gradient_is_detected() {
    // The comparison itself must fail when gradients differ: scale one pipelined gradient.
    let s = setup(Kind::OneFOneB, Shape::new(2, 1, 2), 1);
    let mut a = pipelined_step(&s).unwrap();
    let b = single_device_step(&s).unwrap();
    let name = a.grads.keys().next().unwrap().clone();
    let g = a.grads[&name].affine(1.001, 0.0).unwrap();
    a.grads.insert(name.clone(), g);
    let r = compare(&a, &b).unwrap();
    assert!(!r.passes(TOLERANCE) && r.worst == name, "{r:?}");
    assert!((r.max_rel - 1e-3).abs() < 1e-4, "{r:?}");
}

#[test]
fn losses_are_the_mean_over_microbatches() {
    let s = setup(Kind::Gpipe, Shape::new(2, 1, 3), 2);
    let a = pipelined_step(&s).unwrap();
    let mean = a.microbatch_losses.iter().sum::<f64>() / 3.0;
    assert!((a.loss - mean).abs() < 1e-12);
    // Random tokens over a vocabulary of 32 at init: each loss near ln 32.
    for l in &a.microbatch_losses {
        assert!((l - 32f64.ln()).abs() < 0.3, "{l}");
    }
    // Microbatches hold different tokens, so their losses differ.
    assert!(a.microbatch_losses[0] != a.microbatch_losses[1]);
}

#[test]
fn caches_are_freed_after_the_step() {
    for kind in [Kind::ZbH1, Kind::DualPipeV, Kind::OneFOneB] {
        let v = if kind == Kind::DualPipeV { 2 } else { 1 };
        let s = setup(kind, Shape::new(2, v, 4), 1);
        let schedule =
            lower(&generate(kind, &s.train.shape, &s.train.options).unwrap(), &LowerOptions::default())
                .unwrap();
        let specs = stage_specs(&*s.train.model, kind, &s.train.shape, None).unwrap();
        let data = Arc::new(random_microbatches(32, 4, 1, 8, 1).unwrap());
        let ws = StageBuild {
            model: &*s.train.model,
            specs: &specs,
            opts: &StageOptions::new(1, 8),
            seed: 0,
            given: None,
            device: &candle_core::Device::Cpu,
        }
        .all_ranks(&schedule, data)
        .unwrap();
        let (ws, tl) = run_pipeline(&schedule, ws, s.train.timeout).unwrap();
        assert!(ws.iter().all(|w| w.live_caches() == 0), "{kind}: caches left");
        assert!(!tl.intervals.is_empty());
    }
}

#[test]
fn a_failing_stage_is_named_and_nothing_hangs() {
    let s = setup(Kind::OneFOneB, Shape::new(2, 1, 3), 1);
    let schedule =
        lower(&generate(s.train.kind, &s.train.shape, &s.train.options).unwrap(), &LowerOptions::default())
            .unwrap();
    let specs = stage_specs(&*s.train.model, s.train.kind, &s.train.shape, None).unwrap();
    let mut data: Microbatches = random_microbatches(32, 3, 1, 8, 1).unwrap();
    // Microbatch 1's tokens have a bad shape [1, 5] instead of [1, 8].
    data.tokens[1] = graphpp_runtime::kernels::tensor::tensor_u32(&[1, 2, 3, 4, 5], &[1, 5]).unwrap();
    let ws = StageBuild {
        model: &*s.train.model,
        specs: &specs,
        opts: &StageOptions::new(1, 8),
        seed: 0,
        given: None,
        device: &candle_core::Device::Cpu,
    }
    .all_ranks(&schedule, Arc::new(data))
    .unwrap();
    let t0 = Instant::now();
    let e = run_pipeline(&schedule, ws, Duration::from_secs(20)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    let msg = e.to_string();
    match e {
        PipelineError::Action { rank, ref action, .. } => {
            assert_eq!(rank, 0, "{msg}");
            assert_eq!(action, "0F1", "{msg}");
        }
        other => panic!("{other}"),
    }
    assert!(msg.contains("tokens"), "{msg}");
}

#[test]
fn too_few_layers_is_a_typed_error() {
    let cfg = LlamaConfig::tiny();
    let e = stage_specs(&cfg, Kind::Interleaved1F1B, &Shape::new(4, 2, 8), None).unwrap_err();
    assert!(matches!(e, SetupError::TooFewLayers { layers: 4, stages: 8, .. }), "{e}");
    // DualPipe needs p model stages only.
    assert_eq!(stage_specs(&cfg, Kind::DualPipe, &Shape::new(4, 2, 8), None).unwrap().len(), 8);
}

/// Every microbatch loss and every gradient (as f64 bits) of a step's workers, by stage.
#[allow(clippy::type_complexity)]
fn results(ws: &[GraphStages]) -> (Vec<(usize, u64)>, Vec<(usize, String, Vec<u64>)>) {
    let losses = ws.iter().flat_map(|w| w.losses().iter().map(|(&mb, l)| (mb, l.to_bits()))).collect();
    let mut grads = Vec::new();
    for w in ws {
        for (&stage, st) in w.stages() {
            for (name, g) in st.grads() {
                grads.push((stage, name.clone(), to_f64(g).unwrap().iter().map(|v| v.to_bits()).collect()));
            }
        }
    }
    grads.sort();
    (losses, grads)
}

/// One step with every rank run by `run_rank` on its own thread over `ThreadComm::world(p)`.
fn run_each_rank(schedule: &Schedule, ws: Vec<GraphStages>, timeout: Duration) -> Vec<GraphStages> {
    let p = schedule.num_ranks();
    let mesh = Mesh::new(p, 1).unwrap();
    let opts = RankOptions::new(timeout);
    std::thread::scope(|s| {
        let hs: Vec<_> = ws
            .into_iter()
            .zip(ThreadComm::world(p))
            .enumerate()
            .map(|(rank, (w, comm))| {
                let opts = &opts;
                s.spawn(move || {
                    let pipeline = mesh.pipeline_group(rank).unwrap();
                    run_rank(schedule, &pipeline, w, &comm, opts).unwrap().work
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn run_rank_on_threads_gives_run_pipeline_results_bitwise() {
    for (kind, shape) in [(Kind::OneFOneB, Shape::new(4, 1, 6)), (Kind::Zbv, Shape::new(2, 2, 4))] {
        let s = setup(kind, shape, 1);
        let schedule =
            lower(&generate(kind, &s.train.shape, &s.train.options).unwrap(), &LowerOptions::default())
                .unwrap();
        let specs = stage_specs(&*s.train.model, kind, &s.train.shape, None).unwrap();
        let data = Arc::new(random_microbatches(32, shape.microbatches, 1, 8, 3).unwrap());
        let build = || {
            StageBuild {
                model: &*s.train.model,
                specs: &specs,
                opts: &StageOptions::new(1, 8),
                seed: 5,
                given: None,
                device: &candle_core::Device::Cpu,
            }
            .all_ranks(&schedule, Arc::clone(&data))
            .unwrap()
        };
        let (a, _) = run_pipeline(&schedule, build(), s.train.timeout).unwrap();
        let b = run_each_rank(&schedule, build(), s.train.timeout);
        let (la, ga) = results(&a);
        let (lb, gb) = results(&b);
        assert_eq!(la.len(), shape.microbatches, "{kind}");
        assert!(ga.len() >= 9 + 3, "{kind}: {} gradients", ga.len());
        assert_eq!(la, lb, "{kind}: losses differ");
        assert_eq!(ga, gb, "{kind}: gradients differ");
        assert!(b.iter().all(|w| w.live_caches() == 0), "{kind}: caches left");
    }
}
