//! The schedule executor on a scalar chain model: stage s computes y = w_s · x, the last stage of a
//! route takes loss 0.5·y² / m per microbatch. Gradients from any schedule must equal the
//! closed-form single-device gradients; failures must stop every rank and name the culprit.
//! Activations and gradients travel as 0-dimensional f64 tensors.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use graphpp_comm::{Comm, CommError, Group, Mesh, Tag, ThreadComm};
use graphpp_runtime::{
    run_pipeline, run_rank, PipelineError, RankOptions, RankOutcome, StageWork, WorkError,
};
use graphpp_schedule::{generate, lower, Kind, LowerOptions, Options, Schedule, Shape, Task};

#[derive(Default, Clone, Debug)]
struct Chain {
    w: HashMap<usize, f64>,
    grad: HashMap<usize, f64>,
    last: HashSet<usize>,
    data: Vec<f64>,
    saved_x: HashMap<Task, f64>,
    saved_y: HashMap<Task, f64>,
    saved_gy: HashMap<Task, f64>,
    fail_at: Option<(Task, bool)>,
}

impl Chain {
    fn gy(&mut self, stage: usize, mb: usize, grad: Option<f64>) -> f64 {
        let m = self.data.len() as f64;
        grad.unwrap_or_else(|| self.saved_y[&Task::new(stage, mb)] / m)
    }
}

/// The value of a 0-dimensional f64 tensor.
fn scalar(t: Option<Tensor>) -> Result<Option<f64>, WorkError> {
    Ok(t.map(|t| t.to_scalar::<f64>()).transpose()?)
}

/// A 0-dimensional f64 tensor.
fn tensor(x: f64) -> Result<Tensor, WorkError> {
    Ok(Tensor::new(x, &Device::Cpu)?)
}

impl StageWork for Chain {
    fn forward(
        &mut self,
        stage: usize,
        mb: usize,
        input: Option<Tensor>,
    ) -> Result<Option<Tensor>, WorkError> {
        let input = scalar(input)?;
        let t = Task::new(stage, mb);
        if let Some((ft, panic)) = self.fail_at {
            if ft == t {
                if panic {
                    panic!("boom in {stage}F{mb}");
                }
                return Err(format!("shape mismatch in {stage}F{mb}").into());
            }
        }
        let x = input.unwrap_or(self.data[mb]);
        let y = self.w[&stage] * x;
        self.saved_x.insert(t, x);
        self.saved_y.insert(t, y);
        (!self.last.contains(&stage)).then(|| tensor(y)).transpose()
    }
    fn backward(
        &mut self,
        stage: usize,
        mb: usize,
        grad: Option<Tensor>,
    ) -> Result<Option<Tensor>, WorkError> {
        let gin = self.backward_input(stage, mb, grad)?;
        self.backward_weight(stage, mb)?;
        Ok(gin)
    }
    fn backward_input(
        &mut self,
        stage: usize,
        mb: usize,
        grad: Option<Tensor>,
    ) -> Result<Option<Tensor>, WorkError> {
        let gy = self.gy(stage, mb, scalar(grad)?);
        self.saved_gy.insert(Task::new(stage, mb), gy);
        Ok(Some(tensor(gy * self.w[&stage])?))
    }
    fn backward_weight(&mut self, stage: usize, mb: usize) -> Result<(), WorkError> {
        let t = Task::new(stage, mb);
        let gy = self.saved_gy.remove(&t).ok_or("W before I")?;
        let x = self.saved_x.remove(&t).ok_or("W before F")?;
        *self.grad.entry(stage).or_default() += gy * x;
        Ok(())
    }
}

/// Workers for `schedule`: stage s has weight 1 + 0.1·s, input x_j = 1 + j.
fn workers(schedule: &Schedule) -> Vec<Chain> {
    let m = schedule.num_microbatches();
    let data: Vec<f64> = (0..m).map(|j| 1.0 + j as f64).collect();
    let s = schedule.num_stages();
    let lasts: HashSet<usize> = schedule.routes().into_iter().flatten().map(|r| r.end - 1).collect();
    (0..schedule.num_ranks())
        .map(|r| {
            let stages: Vec<usize> = (0..s).filter(|st| schedule.placement()[st].contains(&r)).collect();
            Chain {
                w: stages.iter().map(|&st| (st, 1.0 + 0.1 * st as f64)).collect(),
                last: lasts.clone(),
                data: data.clone(),
                ..Chain::default()
            }
        })
        .collect()
}

/// Closed-form gradients: loss = Σ_j 0.5 (Π w · x_j)² / m over the route 0..S.
fn expected_grads(s: usize, m: usize) -> Vec<f64> {
    let w: Vec<f64> = (0..s).map(|st| 1.0 + 0.1 * st as f64).collect();
    let prod: f64 = w.iter().product();
    let sum_x2: f64 = (0..m).map(|j| (1.0 + j as f64).powi(2)).sum();
    // d/dw_k 0.5 (P x)² = P² x² / w_k.
    (0..s).map(|k| prod * prod * sum_x2 / w[k] / m as f64).collect()
}

fn grads(ws: &[Chain], s: usize) -> Vec<f64> {
    (0..s).map(|st| ws.iter().find_map(|w| w.grad.get(&st)).copied().unwrap_or(f64::NAN)).collect()
}

/// A hand-lowered 2-rank 1F1B with m = 2.
const ONE_F_ONE_B_2X2: &str = "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n\
1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n";

#[test]
fn hand_lowered_1f1b_matches_closed_form() {
    let s = Schedule::from_csv(ONE_F_ONE_B_2X2).unwrap();
    let (ws, timeline) = run_pipeline(&s, workers(&s), Duration::from_secs(10)).unwrap();
    let g = grads(&ws, 2);
    let e = expected_grads(2, 2);
    for k in 0..2 {
        assert!((g[k] - e[k]).abs() < 1e-12, "stage {k}: {} vs {}", g[k], e[k]);
    }
    assert_eq!(timeline.intervals.len(), 16);
    assert!(ws.iter().all(|w| w.saved_x.is_empty() && w.saved_gy.is_empty()));
}

#[test]
fn local_handover_and_split_backward() {
    // One rank holding both stages: no comm; I/W split.
    let s = Schedule::from_csv("0F0,1F0,1I0,0I0,1W0,0W0,0F1,1F1,1I1,1W1,0B1\n").unwrap();
    let (ws, _) = run_pipeline(&s, workers(&s), Duration::from_secs(10)).unwrap();
    let (g, e) = (grads(&ws, 2), expected_grads(2, 2));
    for k in 0..2 {
        assert!((g[k] - e[k]).abs() < 1e-12, "stage {k}: {} vs {}", g[k], e[k]);
    }
}

#[test]
fn failing_rank_stops_all_and_is_named() {
    let s = Schedule::from_csv(ONE_F_ONE_B_2X2).unwrap();
    for panic in [false, true] {
        let mut ws = workers(&s);
        ws[1].fail_at = Some((Task::new(1, 1), panic));
        let e = run_pipeline(&s, ws, Duration::from_secs(30)).unwrap_err();
        let msg = e.to_string();
        match e {
            PipelineError::Action { rank, step, .. } | PipelineError::Panic { rank, step, .. } => {
                assert_eq!((rank, step), (1, 5), "{msg}")
            }
            other => panic!("{other}"),
        }
        assert!(msg.contains("1F1"), "{msg}");
        assert!(msg.contains(if panic { "boom" } else { "shape mismatch" }), "{msg}");
    }
}

#[test]
fn unmatched_recv_times_out_naming_rank() {
    let s = Schedule::from_csv("0F0\n1RECV_F0,1F0\n").unwrap();
    let e = run_pipeline(&s, workers(&s), Duration::from_millis(100)).unwrap_err();
    assert!(
        matches!(&e, PipelineError::Comm { rank: 1, step: 0, source, .. }
            if matches!(**source, CommError::Timeout { rank: 1, .. })),
        "{e}"
    );
    assert!(e.to_string().contains("timed out"), "{e}");
}

/// Runs every rank of `schedule` with `run_rank` on its own thread over `ThreadComm::world(p)`
/// (pipeline = all ranks); results by rank.
fn each_rank(
    schedule: &Schedule,
    ws: Vec<Chain>,
    timeout: Duration,
) -> Vec<Result<RankOutcome<Chain>, PipelineError>> {
    let p = schedule.num_ranks();
    let pipeline = Mesh::new(p, 1).unwrap().pipeline_group(0).unwrap();
    let opts = RankOptions::new(timeout);
    std::thread::scope(|s| {
        let hs: Vec<_> = ws
            .into_iter()
            .zip(ThreadComm::world(p))
            .map(|(w, comm)| {
                let (pipeline, opts) = (&pipeline, &opts);
                s.spawn(move || run_rank(schedule, pipeline, w, &comm, opts))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_failing_rank_aborts_every_other_run_rank_naming_it() {
    let s = lower(
        &generate(Kind::OneFOneB, &Shape::new(4, 1, 4), &Options::default()).unwrap(),
        &LowerOptions::default(),
    )
    .unwrap();
    for panic in [false, true] {
        let mut ws = workers(&s);
        ws[2].fail_at = Some((Task::new(2, 1), panic));
        // A long receive timeout: the other ranks must stop on the abort, not on the timeout.
        let t0 = Instant::now();
        let results = each_rank(&s, ws, Duration::from_secs(600));
        assert!(t0.elapsed() < Duration::from_secs(60), "took {:?}", t0.elapsed());
        for (r, res) in results.into_iter().enumerate() {
            match (r, res) {
                (2, Err(PipelineError::Action { rank: 2, action, message, .. })) if !panic => {
                    assert_eq!((action.as_str(), message.as_str()), ("2F1", "shape mismatch in 2F1"))
                }
                (2, Err(PipelineError::Panic { rank: 2, action, message, .. })) if panic => {
                    assert_eq!((action.as_str(), message.as_str()), ("2F1", "boom in 2F1"))
                }
                (_, Err(PipelineError::Aborted { rank, failed_rank: 2, reason, .. })) if r != 2 => {
                    assert_eq!(rank, r);
                    assert!(reason.starts_with("rank 2 "), "{reason}");
                }
                (r, other) => panic!("rank {r}: {:?}", other.map(|_| ())),
            }
        }
        // The harness reports the failing rank's own error, not the echoes.
        let mut ws = workers(&s);
        ws[2].fail_at = Some((Task::new(2, 1), panic));
        match run_pipeline(&s, ws, Duration::from_secs(600)).unwrap_err() {
            PipelineError::Action { rank: 2, action, .. } if !panic => assert_eq!(action, "2F1"),
            PipelineError::Panic { rank: 2, action, .. } if panic => assert_eq!(action, "2F1"),
            other => panic!("{other}"),
        }
    }
}

#[test]
fn run_rank_gives_run_pipeline_gradients_and_checks_its_group() {
    let s = lower(
        &generate(Kind::OneFOneB, &Shape::new(4, 1, 4), &Options::default()).unwrap(),
        &LowerOptions::default(),
    )
    .unwrap();
    let ws: Vec<Chain> =
        each_rank(&s, workers(&s), Duration::from_secs(30)).into_iter().map(|r| r.unwrap().work).collect();
    let (g, e) = (grads(&ws, 4), expected_grads(4, 4));
    for k in 0..4 {
        assert!((g[k] - e[k]).abs() < 1e-12, "stage {k}: {} vs {}", g[k], e[k]);
    }
    // A pipeline group without this rank, or of the wrong size, is a setup error that also
    // aborts the communicator (so the other ranks would not wait for this one).
    let comms = ThreadComm::world(2);
    let s2 = Schedule::from_csv(ONE_F_ONE_B_2X2).unwrap();
    let opts = RankOptions::new(Duration::from_secs(1));
    let other = Group::new("pp", vec![1, 2]).unwrap();
    let e = run_rank(&s2, &other, workers(&s2).remove(0), &comms[0], &opts).unwrap_err();
    assert!(
        matches!(e, PipelineError::Setup(ref m) if m == "rank 0 is not in its pipeline group pp[1,2]"),
        "{e}"
    );
    let wrong = Group::new("pp", vec![1]).unwrap();
    let e = run_rank(&s2, &wrong, workers(&s2).remove(0), &comms[0], &opts).unwrap_err();
    assert!(
        matches!(e, PipelineError::Setup(ref m) if m.contains("pp[1] has 1 ranks, the schedule 2")),
        "{e}"
    );
    match comms[1].recv(0, Tag::Activation { stage: 1, mb: 0 }, Duration::from_secs(600)) {
        Err(CommError::Aborted { failed_rank: 0, .. }) => {}
        other => panic!("{other:?}"),
    }
}
