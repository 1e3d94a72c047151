//! The schedule executor on a scalar chain model: stage s computes y = w_s · x, the last stage of a
//! route takes loss 0.5·y² / m per microbatch. Gradients from any schedule must equal the
//! closed-form single-device gradients; failures must stop every rank and name the culprit.
//! Activations and gradients travel as 0-dimensional f64 tensors.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use candle_core::{Device, Tensor};
use graphpp_runtime::{run_pipeline, CommError, PipelineError, StageWork, WorkError};
use graphpp_schedule::{Schedule, Task};

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
        matches!(e, PipelineError::Comm { rank: 1, step: 0, source: CommError::Timeout { rank: 1, .. }, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("timed out"), "{e}");
}
