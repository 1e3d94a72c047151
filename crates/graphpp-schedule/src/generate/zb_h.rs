//! Zero-bubble handcrafted schedules ZB-H1 and ZB-H2 (Qi et al. 2024, "Zero Bubble Pipeline
//! Parallelism", §3; docs/ARCHITECTURE.md table "Schedules and reference figures"; the tutorial seed `001_…`,
//! "ZB-H1" / "ZB-H2"). One stage per rank (`v = 1`), stage `r` on rank `r`; the backward is split
//! into I (input gradient) and W (weight gradient).

use std::collections::VecDeque;

use super::{require, GenerateError, Kind, Shape};
use crate::action::Action;
use crate::schedule::Schedule;

/// ZB-H1: 1F1B with the backward split. Stage `r` runs `w = min(p−1−r, m)` warm-up F's, then
/// `m − w` rounds of [F, I, W] and `w` rounds of [I, W], except that the W's of its first `r` rounds
/// are held back (the W count lags the I count by `r`); the held-back W's fill the cool-down,
/// oldest first. Peak in flight `p − r` (F done, I not yet), like 1F1B.
///
/// # Errors
/// [`GenerateError::Constraint`] unless `stages_per_rank = 1`.
pub fn generate_h1(shape: &Shape) -> Result<Schedule, GenerateError> {
    require_one_stage_per_rank(Kind::ZbH1, shape)?;
    let (p, m) = (shape.ranks, shape.microbatches);
    let programs = (0..p)
        .map(|r| {
            let warmup = (p - 1 - r).min(m);
            let mut prog: Vec<Action> = (0..warmup).map(|j| Action::f(r, j)).collect();
            let mut next_w = 0;
            for j in 0..m {
                if j + warmup < m {
                    prog.push(Action::f(r, j + warmup));
                }
                prog.push(Action::i(r, j));
                // After the (j+1)-th I, W's done = max(0, j+1−r).
                if j >= r {
                    prog.push(Action::w(r, next_w));
                    next_w += 1;
                }
            }
            prog.extend((next_w..m).map(|j| Action::w(r, j)));
            prog
        })
        .collect();
    Ok(Schedule::from_programs(programs))
}

/// ZB-H2: a time-stepped greedy over unit costs (T_F = T_I = T_W = 1, c = 0), the rule of docs/ARCHITECTURE.md
/// and the tutorial seed's simulator: whenever rank `r` is free it runs, in order of preference,
/// 1. the next I if it is ready (own F done; the next stage's I done, unless `r` is the last stage),
/// 2. else the next F if its input is ready and fewer than `2(p−r)−1` microbatches are in flight
///    (F done, I not yet) **and** fewer than `2p−1` are held (in flight or waiting for their W),
/// 3. else the oldest pending W,
///
/// and otherwise waits one time unit.
///
/// The second cap is ours: without it I and F are always preferred to W in the steady state, every
/// W drifts to the end and the M_W's held grow with `m`. With it a rank holds at most `2p−1`
/// (stage, mb) activations, so memory stays `≤ (2p−1)·M_B` (Qi et al. §3, ZB-H2) while later stages
/// still defer more W's (up to `2r`) than earlier ones. Steady-state bubble 0 once `m ≥ 2p−1`.
///
/// # Errors
/// [`GenerateError::Constraint`] unless `stages_per_rank = 1`.
pub fn generate_h2(shape: &Shape) -> Result<Schedule, GenerateError> {
    require_one_stage_per_rank(Kind::ZbH2, shape)?;
    let (p, m) = (shape.ranks, shape.microbatches);
    let mut g = Greedy::new(p, m);
    // Every time step some rank makes progress within p steps, so 3·m·p + 3p steps always suffice.
    let limit = 3 * m * p + 3 * p + 3;
    for t in 0..limit {
        if g.finished() {
            break;
        }
        g.step(t);
    }
    require(g.finished(), Kind::ZbH2, shape, || "the ZB-H2 greedy did not finish (internal error)".into())?;
    Ok(Schedule::from_programs(g.programs))
}

fn require_one_stage_per_rank(kind: Kind, shape: &Shape) -> Result<(), GenerateError> {
    let v = shape.stages_per_rank;
    require(v == 1, kind, shape, || format!("needs stages-per-rank = 1, got {v}"))
}

/// State of the ZB-H2 greedy: per stage, the next F / I microbatch, the pending W's, when the rank
/// is free, and the finish time of every F and I (unit costs, integer times).
struct Greedy {
    p: usize,
    m: usize,
    next_f: Vec<usize>,
    next_i: Vec<usize>,
    pending_w: Vec<VecDeque<usize>>,
    free_at: Vec<usize>,
    f_done: Vec<Vec<Option<usize>>>,
    i_done: Vec<Vec<Option<usize>>>,
    programs: Vec<Vec<Action>>,
}

impl Greedy {
    fn new(p: usize, m: usize) -> Self {
        Greedy {
            p,
            m,
            next_f: vec![0; p],
            next_i: vec![0; p],
            pending_w: vec![VecDeque::new(); p],
            free_at: vec![0; p],
            f_done: vec![vec![None; m]; p],
            i_done: vec![vec![None; m]; p],
            programs: vec![Vec::new(); p],
        }
    }

    fn finished(&self) -> bool {
        (0..self.p).all(|r| self.next_i[r] == self.m && self.pending_w[r].is_empty())
    }

    fn done_by(at: Option<usize>, t: usize) -> bool {
        at.is_some_and(|x| x <= t)
    }

    /// Lets every rank that is free at time `t` pick its action. Actions last 1 unit and c = 0, so
    /// nothing started at `t` can make anything ready at `t`: the order over ranks does not matter.
    fn step(&mut self, t: usize) {
        for r in 0..self.p {
            if self.free_at[r] > t {
                continue;
            }
            let (fi, ii) = (self.next_f[r], self.next_i[r]);
            let i_ready = ii < fi
                && Self::done_by(self.f_done[r][ii], t)
                && (r + 1 == self.p || Self::done_by(self.i_done[r + 1][ii], t));
            let cap = 2 * (self.p - r) - 1;
            let held = fi - ii + self.pending_w[r].len();
            let f_ready = fi < self.m
                && fi - ii < cap
                && held < 2 * self.p - 1
                && (r == 0 || Self::done_by(self.f_done[r - 1][fi], t));
            let action = if i_ready {
                self.i_done[r][ii] = Some(t + 1);
                self.next_i[r] += 1;
                self.pending_w[r].push_back(ii);
                Action::i(r, ii)
            } else if f_ready {
                self.f_done[r][fi] = Some(t + 1);
                self.next_f[r] += 1;
                Action::f(r, fi)
            } else if let Some(j) = self.pending_w[r].pop_front() {
                Action::w(r, j)
            } else {
                continue;
            };
            self.programs[r].push(action);
            self.free_at[r] = t + 1;
        }
    }
}
