//! Zero-bubble automatic schedule (ZB-1p / ZB-2p): the heuristic of Qi et al. 2024, "Zero Bubble
//! Pipeline Parallelism", §3.1 ("heuristic algorithm"), as in the initial solution of
//! sail-sg/zero-bubble-pipeline-parallelism `auto_schedule.py` (`manual_order` / `initial_solution`),
//! summarised in docs/ARCHITECTURE.md: F's in warm-up while memory allows, then 1F1B, a W into every gap of at
//! least T_W and whenever memory hits the cap, the remaining W's at the end; three flags are tried in
//! all combinations and the shortest schedule is kept.
//!
//! One stage per rank; stage `s` on rank `s`. Times use `opts.costs` (T_F, T_I, T_W, c); memory uses
//! `opts.memory`: F adds M_B, I frees M_B − M_W, W frees M_W; the cap is `opts.mem_cap` M_B units
//! (default `p`, i.e. ZB-1p; `2p` is ZB-2p). Times compare within [`Tolerance`], so the schedule
//! does not depend on the cost unit (the reference's does, through floating-point rounding).

use super::tolerance::Tolerance;
use super::{check_model, require, GenerateError, Kind, Options, Shape, Solver};
use crate::action::Action;
use crate::schedule::Schedule;

const F: usize = 0;
const I: usize = 1;
const W: usize = 2;

/// The flags `initial_solution` tries, in its order.
#[derive(Clone, Copy)]
struct Flags {
    /// Warm-up: allow an F that ends after the first I could start.
    allow_bubble_before_first_i: bool,
    /// Steady: skip an F on a stage already 2 F's ahead of the next one when an I is due sooner.
    prioritize_i: bool,
    /// Steady: also fill a gap shorter than T_W with a W when the stage's bubble is below the max.
    no_bubble_greedy: bool,
}

/// ZB auto for `shape` with `opts.costs`, `opts.memory`, `opts.mem_cap`, by `opts.solver`: the
/// heuristic, or the ILP warm-started from it (`zb_ilp`, the `ilp` feature).
///
/// # Errors
/// [`GenerateError::Constraint`] unless `stages_per_rank = 1`; when the costs are not finite and
/// `>= 0`, when `0 <= M_W < M_B` fails, when the cap is below 1 M_B, or when no flag combination fits
/// the memory cap; [`GenerateError::SolverUnavailable`] for the ILP in a build without `ilp`.
pub fn generate(shape: &Shape, opts: &Options) -> Result<Schedule, GenerateError> {
    match opts.solver {
        Solver::Heuristic => heuristic(shape, opts),
        #[cfg(feature = "ilp")]
        Solver::Ilp { time_limit } => super::zb_ilp::solve(shape, opts, time_limit).map(|r| r.schedule),
        #[cfg(not(feature = "ilp"))]
        Solver::Ilp { .. } => Err(GenerateError::SolverUnavailable { solver: opts.solver }),
    }
}

/// The heuristic (ZB auto's default solver); errors as [`generate`]'s.
pub(crate) fn heuristic(shape: &Shape, opts: &Options) -> Result<Schedule, GenerateError> {
    let kind = Kind::ZbAuto;
    let v = shape.stages_per_rank;
    require(v == 1, kind, shape, || format!("needs stages-per-rank = 1, got {v}"))?;
    let cap = check_model(kind, shape, opts)?;
    let mut best: Option<(f64, Vec<Vec<Action>>)> = None;
    for allow in [true, false] {
        for prioritize in [true, false] {
            for greedy in [true, false] {
                let flags = Flags {
                    allow_bubble_before_first_i: allow,
                    prioritize_i: prioritize,
                    no_bubble_greedy: greedy,
                };
                let mut h = Heuristic::new(shape, opts, cap);
                if h.run(flags).is_some() {
                    let (span, tol) = (h.span(), h.tol);
                    if best.as_ref().is_none_or(|(b, _)| tol.lt(span, *b)) {
                        best = Some((span, h.programs));
                    }
                }
            }
        }
    }
    match best {
        Some((_, programs)) => Ok(Schedule::from_programs(programs)),
        None => Err(GenerateError::constraint(
            kind,
            shape,
            format!("no schedule fits the memory cap of {cap} M_B (raise --mem-cap)"),
        )),
    }
}

/// One run of the heuristic: per stage the F/I/W counters, end time `e`, memory, accumulated
/// bubble, and the finish time of every action.
struct Heuristic {
    p: usize,
    m: usize,
    cost: [f64; 3],
    mem: [f64; 3],
    max_mem: f64,
    comm: f64,
    tol: Tolerance,
    /// Memory comparisons (M_B units, not cost units).
    mem_tol: Tolerance,
    count: Vec<[usize; 3]>,
    end: Vec<f64>,
    used: Vec<f64>,
    bubble: Vec<f64>,
    start: Vec<f64>,
    done: Vec<[Vec<Option<f64>>; 3]>,
    programs: Vec<Vec<Action>>,
}

impl Heuristic {
    fn new(shape: &Shape, opts: &Options, cap: f64) -> Self {
        let (p, m) = (shape.ranks, shape.microbatches);
        let (c, mm) = (&opts.costs, &opts.memory);
        Heuristic {
            p,
            m,
            cost: [c.f, c.i, c.w],
            mem: [mm.m_b, mm.m_w - mm.m_b, -mm.m_w],
            max_mem: cap * mm.m_b,
            comm: c.comm,
            tol: Tolerance::for_costs(c.f, c.i, c.w, c.comm),
            mem_tol: Tolerance::for_memory(mm.m_b),
            count: vec![[0; 3]; p],
            end: vec![0.0; p],
            used: vec![0.0; p],
            bubble: vec![0.0; p],
            start: vec![0.0; p],
            done: (0..p).map(|_| [vec![None; m], vec![None; m], vec![None; m]]).collect(),
            programs: vec![Vec::new(); p],
        }
    }

    /// Longest per-stage span: first F start to last action end (the steady-state period).
    fn span(&self) -> f64 {
        (0..self.p).map(|s| self.end[s] - self.start[s]).fold(0.0, f64::max)
    }

    fn max_bubble(&self) -> f64 {
        self.bubble.iter().copied().fold(0.0, f64::max)
    }

    /// Finish time of `kind` on (`s`, `mb`); `None` if it has not been placed.
    fn at(&self, kind: usize, s: usize, mb: usize) -> Option<f64> {
        self.done[s][kind].get(mb).copied().flatten()
    }

    /// Places the next `kind` action of stage `s`; `None` if its dependency is not placed or an F
    /// would exceed the memory cap.
    fn put(&mut self, s: usize, kind: usize) -> Option<()> {
        let mb = self.count[s][kind];
        if mb >= self.m || (kind == F && !self.mem_tol.le(self.used[s] + self.mem[F], self.max_mem)) {
            return None;
        }
        let cost = self.cost[kind];
        let free = self.end[s];
        let input = match kind {
            F if s > 0 => self.at(F, s - 1, mb)? + self.comm,
            I if s + 1 < self.p => self.at(I, s + 1, mb)? + self.comm,
            _ => free,
        };
        let start = self.tol.start(free, input);
        let finish = start + cost;
        if self.count[s][F] > 0 {
            self.bubble[s] += start - free;
        } else {
            self.start[s] = start;
        }
        self.end[s] = finish;
        self.done[s][kind][mb] = Some(finish);
        self.used[s] += self.mem[kind];
        self.count[s][kind] += 1;
        self.programs[s].push(match kind {
            F => Action::f(s, mb),
            I => Action::i(s, mb),
            _ => Action::w(s, mb),
        });
        Some(())
    }

    fn pending_w(&self, s: usize) -> bool {
        self.count[s][W] < self.count[s][I]
    }

    /// Runs W's until `extra` more memory fits under the cap; `None` if no W is left to run.
    fn make_room(&mut self, s: usize, extra: f64) -> Option<()> {
        while !self.mem_tol.le(self.used[s] + extra, self.max_mem) {
            if !self.pending_w(s) {
                return None;
            }
            self.put(s, W)?;
        }
        Some(())
    }

    /// Fills the wait until `dep` (when the next action's input arrives) with W's: every W that ends
    /// by `dep`, then one more that overruns it when the stage's bubble allows (see [`Flags`]).
    fn fill_gap(&mut self, s: usize, dep: f64, flags: Flags) -> Option<()> {
        let t = self.tol;
        while self.pending_w(s) && t.le(self.end[s] + self.cost[W], dep) {
            self.put(s, W)?;
        }
        if self.pending_w(s) && t.lt(self.end[s], dep) {
            let small = t.le(dep - self.end[s], self.max_bubble() - self.bubble[s]);
            if !small || flags.no_bubble_greedy {
                self.put(s, W)?;
            }
        }
        Some(())
    }

    fn run(&mut self, flags: Flags) -> Option<()> {
        self.warmup(flags)?;
        for i in 1..self.m {
            self.steady_forwards(flags)?;
            self.steady_backwards(i, flags)?;
        }
        for s in 0..self.p {
            while self.count[s][W] < self.m {
                self.put(s, W)?;
            }
        }
        Some(())
    }

    /// Microbatch 0: one F per stage, then as many extra F's per stage as fit before its first I
    /// (and under the cap), kept strictly decreasing along the pipeline, then the I's of microbatch 0.
    fn warmup(&mut self, flags: Flags) -> Option<()> {
        let (p, m) = (self.p, self.m);
        for s in 0..p {
            self.put(s, F)?;
        }
        let mut extra = vec![0usize; p];
        let mut last = self.at(F, p - 1, 0)? + self.cost[I];
        for s in (0..p - 1).rev() {
            let (mut used, mut t) = (self.used[s], self.end[s]);
            let (tol, mem_tol) = (self.tol, self.mem_tol);
            while self.count[s][F] + extra[s] < m && mem_tol.le(used + self.mem[F], self.max_mem) {
                let stop = if flags.allow_bubble_before_first_i {
                    tol.lt(last + self.comm, t + self.cost[F])
                } else {
                    tol.le(last + self.comm, t)
                };
                if stop {
                    break;
                }
                used += self.mem[F];
                t += self.cost[F];
                extra[s] += 1;
            }
            last = t.max(last + self.comm) + self.cost[I];
        }
        for s in 1..p {
            while extra[s] > 0 && extra[s] >= extra[s - 1] && self.count[s][F] + extra[s] < m {
                extra[s] -= 1;
            }
        }
        for (s, &n) in extra.iter().enumerate() {
            for _ in 0..n {
                self.put(s, F)?;
            }
        }
        for s in (0..p).rev() {
            self.put(s, I)?;
        }
        Some(())
    }

    /// Whether stage `s` takes an F this round (before the `prioritize_i` and monotonicity rules).
    fn wants_forward(&self, s: usize, flags: Flags) -> bool {
        let [f, _, _] = self.count[s];
        if f >= self.m {
            return false;
        }
        if !(flags.prioritize_i && s + 1 < self.p && f >= self.count[s + 1][F] + 2) {
            return true;
        }
        let next_due = self.end[s + 1] + self.cost[F] + self.cost[I] + self.comm;
        let t = self.tol;
        if t.le(next_due, self.end[s]) {
            return false;
        }
        let (mut w_cost, mut n_w, mut used) = (0.0, 0, self.used[s] + self.mem[F]);
        while !self.mem_tol.le(used, self.max_mem) && self.count[s][W] + n_w < self.count[s][I] {
            w_cost += self.cost[W];
            used += self.mem[W];
            n_w += 1;
        }
        if t.le(self.end[s] + self.cost[F] + w_cost, next_due) {
            return true;
        }
        t.lt(self.max_bubble() - self.bubble[s], next_due - self.end[s])
    }

    /// One steady round of forwards: each stage that wants one (and whose successors all do) runs
    /// its next F after making room and filling the wait for its input with W's.
    fn steady_forwards(&mut self, flags: Flags) -> Option<()> {
        let p = self.p;
        let mut want: Vec<bool> = (0..p).map(|s| self.wants_forward(s, flags)).collect();
        for s in (0..p - 1).rev() {
            want[s] &= want[s + 1];
        }
        for s in (0..p).filter(|&s| want[s]) {
            self.make_room(s, self.mem[F])?;
            if s > 0 {
                let dep = self.at(F, s - 1, self.count[s][F])? + self.comm;
                self.fill_gap(s, dep, flags)?;
            }
            self.put(s, F)?;
        }
        Some(())
    }

    /// One steady round of backwards: the I of microbatch `i` on every stage, last stage first, each
    /// after filling the wait for the next stage's I with W's; stage 0 drains its W's before its I
    /// once all its F's are done.
    fn steady_backwards(&mut self, i: usize, flags: Flags) -> Option<()> {
        for s in (0..self.p).rev() {
            self.make_room(s, self.mem[I])?;
            if s + 1 < self.p {
                let dep = self.at(I, s + 1, i)? + self.comm;
                self.fill_gap(s, dep, flags)?;
            }
            if s == 0 && self.count[s][F] == self.m {
                while self.pending_w(s) {
                    self.put(s, W)?;
                }
            }
            self.put(s, I)?;
        }
        Some(())
    }
}
