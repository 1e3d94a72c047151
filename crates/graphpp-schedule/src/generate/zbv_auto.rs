//! Cost-adaptive ZB-V (`zbv-auto`): the V-shape heuristic of the zero-bubble authors (Qi et al.
//! 2024, "Zero Bubble Pipeline Parallelism", the ZB-V schedule of §6 and its greedy builder in
//! sail-sg/zero-bubble-pipeline-parallelism `zbv.py`, `try_v_schedule` / `create_schedule`),
//! written from its description; `zbv` stays PyTorch's fixed order.
//!
//! **Layout.** `p` ranks, `2p` stages in V placement: rank `r` holds chunk 0 = stage `r` and
//! chunk 1 = stage `2p-1-r`. A microbatch runs F down the ranks on chunk 0 and back up on
//! chunk 1, then I (dI) down on chunk 1 and up on chunk 0; each I leaves a W (dW) behind.
//!
//! **Building.** Every action starts when its rank is free and its input has arrived (`+ c` across
//! ranks); its start is the earliest such time, so the builder *is* an as-soon-as-possible
//! simulation. Warm-up: one chunk-0 F per rank; then, for each rank `r` from the last down, while
//! another chunk-0 F on `r` would end before the chunk-1 F of microbatch 0 comes back (and
//! memory allows), one more chunk-0 F on every rank `0..=r`; then `r`'s chunk-1 F; then the warm-up
//! F's alternate chunks until each rank is as far ahead as the one before it.
//! Steady state, `2m` rounds: each rank runs one I (chunk 1 where its input is there, else chunk
//! 0), then one F (the chunk whose input is there); before each, pending W's fill the wait for the
//! input, and one more W runs when the wait is longer than the rank's bubble allowance. W's run
//! whenever memory would exceed the cap, and the rest at the end.
//!
//! **Choosing.** The builder runs 32 ways: the two fill flags (the reference's `fill_b`,
//! `fill_f`) in all four combinations, each with three tie rules — whether an exact fit counts as
//! fitting for a W before an input, for a wait against the allowance and for a warm-up F — both
//! ways ([`Tolerance::ties_lose`]; the reference decides such ties by floating-point rounding,
//! so either way can win). Each run is repeated with the per-rank bubbles it produced as
//! allowances while the largest bubble shrinks (as the reference does; at most 16 times). Among every run that fits the cap the shortest makespan wins (ties:
//! the smaller largest bubble, then the earlier run) — the reference keeps the smallest largest
//! bubble instead, so `zbv-auto` is never slower than the reference on the runs they share.
//! Times compare within [`Tolerance`], so the choice does not depend on the cost unit.
//!
//! **Memory.** In M_B units of a full stage: a chunk's F adds `M_B/2`, its I frees
//! `(M_B − M_W)/2`, its W frees `M_W/2`; the cap is `opts.mem_cap` (default `p`, 1F1B's peak,
//! as the reference's default `2p` chunk activations).

use std::collections::VecDeque;

use super::tolerance::Tolerance;
use super::{check_model, require, GenerateError, Kind, Options, Shape};
use crate::action::Action;
use crate::schedule::Schedule;

const F: usize = 0;
const I: usize = 1;
const W: usize = 2;

/// Which optional W's a run puts before an I (`fill_b`) or an F (`fill_f`) when the wait for the
/// input exceeds the rank's bubble allowance, and whether an exact fit (a W that ends just as the
/// input arrives, a wait equal to the allowance) counts as fitting.
#[derive(Clone, Copy)]
struct Fill {
    before_i: bool,
    before_f: bool,
    /// Whether ties fit, for: a W before the input arrives, a wait longer than the allowance, a
    /// warm-up F before the chunk-1 F comes back.
    ties: [bool; 3],
}

/// zbv-auto for `shape` with `opts.costs` (per chunk: T_F, T_I, T_W, c), `opts.memory` and
/// `opts.mem_cap`.
///
/// # Errors
/// [`GenerateError::Constraint`] unless `stages_per_rank = 2`; for costs, memory model or cap
/// that [`check_model`] refuses; or when no run completes — naming the memory cap when a run
/// stopped at it.
pub fn generate(shape: &Shape, opts: &Options) -> Result<Schedule, GenerateError> {
    let kind = Kind::ZbvAuto;
    let v = shape.stages_per_rank;
    require(v == 2, kind, shape, || {
        format!("needs stages-per-rank = 2 (2p stages in V placement), got {v}")
    })?;
    let cap = check_model(kind, shape, opts)?;
    let (mut best, mut hit_cap): (Option<Run>, bool) = (None, false);
    for k in 0..32 {
        let bit = |b: u32| k & (1 << b) == 0;
        let fill = Fill { before_i: bit(4), before_f: bit(3), ties: [bit(2), bit(1), bit(0)] };
        let mut allowance: Option<Vec<f64>> = None;
        // Repeat with the bubbles of the last run as allowances while the largest shrinks.
        for _ in 0..MAX_REPEATS {
            let run = match Builder::new(shape, opts, cap, allowance.as_deref()).run(fill) {
                Ok(run) => run,
                Err(stopped_at_cap) => {
                    hit_cap |= stopped_at_cap;
                    break;
                }
            };
            let improved = allowance.as_ref().is_none_or(|a| run.tol.lt(run.max_bubble, max(a)));
            allowance = Some(run.bubble.clone());
            if best.as_ref().is_none_or(|b| run.better_than(b)) {
                best = Some(run);
            }
            if !improved {
                break;
            }
        }
    }
    match best {
        Some(run) => Ok(Schedule::from_programs(run.programs)),
        None if hit_cap => Err(GenerateError::constraint(
            kind,
            shape,
            format!("no schedule fits the memory cap of {cap} M_B (raise --mem-cap)"),
        )),
        None => Err(GenerateError::constraint(
            kind,
            shape,
            format!(
                "the V heuristic completes no schedule for this shape under the memory cap of {cap} M_B \
                 (raise --mem-cap, or use zbv)"
            ),
        )),
    }
}

/// Repeats of a run with its own bubbles as allowances (the reference repeats until the largest
/// bubble stops shrinking; a few repeats suffice on every shape tried, this bounds it).
const MAX_REPEATS: usize = 16;

fn max(xs: &[f64]) -> f64 {
    xs.iter().copied().fold(0.0, f64::max)
}

/// One finished run.
struct Run {
    programs: Vec<Vec<Action>>,
    makespan: f64,
    max_bubble: f64,
    bubble: Vec<f64>,
    tol: Tolerance,
}

impl Run {
    /// Shorter makespan, else a smaller largest bubble.
    fn better_than(&self, other: &Run) -> bool {
        let t = self.tol;
        t.lt(self.makespan, other.makespan)
            || (t.le(self.makespan, other.makespan) && t.lt(self.max_bubble, other.max_bubble))
    }
}

/// The state of one run: per rank the counters of each (kind, chunk), the time it is free, its
/// memory, its accumulated bubble and its pending W chunks; per action its end time.
struct Builder {
    p: usize,
    m: usize,
    cost: [f64; 3],
    /// Memory change of F, I and W of one chunk.
    mem: [f64; 3],
    max_mem: f64,
    comm: f64,
    tol: Tolerance,
    /// Memory comparisons (M_B units, not cost units).
    mem_tol: Tolerance,
    /// A placement stopped at the memory cap.
    hit_cap: bool,
    /// [`Builder::tol`] with the run's tie rule, for the decisions whether a W or an F fits a wait.
    fit: [Tolerance; 3],
    /// `count[r][kind * 2 + chunk]`; the chunk of an I or W is its order on the way back (0 is
    /// the second half of the V, which the backward meets first).
    count: Vec<[usize; 6]>,
    /// End time of (kind, chunk, rank, microbatch), see [`Builder::slot`].
    end: Vec<Option<f64>>,
    free: Vec<f64>,
    used: Vec<f64>,
    bubble: Vec<f64>,
    /// The largest of `bubble` (bubbles only grow).
    max_bubble: f64,
    /// Allowances: a rank may wait up to (largest allowance − its own) more than the others.
    allowance: Option<(Vec<f64>, f64)>,
    pending_w: Vec<VecDeque<usize>>,
    programs: Vec<Vec<Action>>,
}

impl Builder {
    fn new(shape: &Shape, opts: &Options, cap: f64, allowance: Option<&[f64]>) -> Self {
        let (p, m) = (shape.ranks, shape.microbatches);
        let (c, mm) = (&opts.costs, &opts.memory);
        Builder {
            p,
            m,
            cost: [c.f, c.i, c.w],
            mem: [mm.m_b / 2.0, (mm.m_w - mm.m_b) / 2.0, -mm.m_w / 2.0],
            max_mem: cap * mm.m_b,
            comm: c.comm,
            tol: Tolerance::for_costs(c.f, c.i, c.w, c.comm),
            mem_tol: Tolerance::for_memory(mm.m_b),
            hit_cap: false,
            fit: [Tolerance::for_costs(c.f, c.i, c.w, c.comm); 3],
            count: vec![[0; 6]; p],
            end: vec![None; 6 * p * m],
            free: vec![0.0; p],
            used: vec![0.0; p],
            bubble: vec![0.0; p],
            max_bubble: 0.0,
            allowance: allowance.map(|a| (a.to_vec(), max(a))),
            pending_w: vec![VecDeque::new(); p],
            programs: vec![Vec::new(); p],
        }
    }

    fn slot(&self, kind: usize, chunk: usize, r: usize, mb: usize) -> usize {
        ((kind * 2 + chunk) * self.p + r) * self.m + mb
    }

    fn end_of(&self, kind: usize, chunk: usize, r: usize, mb: usize) -> Option<f64> {
        self.end[self.slot(kind, chunk, r, mb)]
    }

    /// The largest bubble any rank may reach before rank `r` stops filling waits with W's.
    fn allowed_bubble(&self, r: usize) -> f64 {
        let own = self.allowance.as_ref().map_or(0.0, |(a, top)| top - a[r]);
        self.max_bubble.max(own)
    }

    /// The stage a (kind, chunk) of rank `r` runs on (see [`Builder::count`] for I/W chunks).
    fn stage(&self, kind: usize, chunk: usize, r: usize) -> usize {
        let model_chunk = if kind == F { chunk } else { 1 - chunk };
        if model_chunk == 0 {
            r
        } else {
            2 * self.p - 1 - r
        }
    }

    /// The input a (kind, chunk) of rank `r` waits for from another rank: `(rank, counter)` of the
    /// same (kind, chunk) one rank up (chunk 1) or down (chunk 0); none for W's and at the turns.
    fn source(&self, kind: usize, chunk: usize, r: usize) -> Option<usize> {
        match (kind, chunk) {
            (W, _) => None,
            (_, 1) if r + 1 < self.p => Some(r + 1),
            (_, 0) if r > 0 => Some(r - 1),
            _ => None,
        }
    }

    /// When the input of the next (kind, chunk) of rank `r` arrives (`None`: not produced yet, or
    /// it needs no input from another rank).
    fn arrival(&self, kind: usize, chunk: usize, r: usize) -> Option<f64> {
        let src = self.source(kind, chunk, r)?;
        let mb = self.count[r][kind * 2 + chunk];
        (mb < self.m).then(|| self.end_of(kind, chunk, src, mb)).flatten().map(|t| t + self.comm)
    }

    /// Places the next (kind, chunk) of rank `r`; `None` if all are placed, its memory would pass
    /// the cap, or an input it needs has not been produced.
    fn put(&mut self, kind: usize, chunk: usize, r: usize) -> Option<()> {
        let mb = self.count[r][kind * 2 + chunk];
        if mb >= self.m {
            return None;
        }
        if !self.mem_tol.le(self.used[r] + self.mem[kind], self.max_mem) {
            self.hit_cap = true;
            return None;
        }
        // The same microbatch's previous action on this rank must have run (F0 → F1 → I0 → I1,
        // and the W after its I).
        let before = match (kind, chunk) {
            (F, 0) => None,
            (W, ch) => Some((I, ch)),
            (k, 1) => Some((k, 0)),
            (_, _) => Some((F, 1)),
        };
        if let Some((k, ch)) = before {
            self.end_of(k, ch, r, mb)?;
        }
        let cost = self.cost[kind];
        let ready = match self.source(kind, chunk, r) {
            Some(src) => Some(self.end_of(kind, chunk, src, mb)? + self.comm),
            None => None,
        };
        let start = ready.map_or(self.free[r], |t| self.tol.start(self.free[r], t));
        if self.count[r][0] > 0 {
            self.bubble[r] += start - self.free[r];
            self.max_bubble = self.max_bubble.max(self.bubble[r]);
        }
        let finish = start + cost;
        let slot = self.slot(kind, chunk, r, mb);
        self.end[slot] = Some(finish);
        self.free[r] = finish;
        self.used[r] += self.mem[kind];
        self.count[r][kind * 2 + chunk] += 1;
        if kind == I {
            self.pending_w[r].push_back(chunk);
        }
        let stage = self.stage(kind, chunk, r);
        self.programs[r].push(match kind {
            F => Action::f(stage, mb),
            I => Action::i(stage, mb),
            _ => Action::w(stage, mb),
        });
        Some(())
    }

    /// Runs the oldest pending W of rank `r`.
    fn put_w(&mut self, r: usize) -> Option<()> {
        let chunk = self.pending_w[r].pop_front()?;
        self.put(W, chunk, r)
    }

    /// Runs W's until `extra` more memory fits under the cap.
    fn make_room(&mut self, r: usize, extra: f64) -> Option<()> {
        while !self.mem_tol.le(self.used[r] + extra, self.max_mem) {
            if self.pending_w[r].is_empty() {
                self.hit_cap = true;
                return None;
            }
            self.put_w(r)?;
        }
        Some(())
    }

    /// Before the next (kind, chunk) of rank `r`: W's that end before its input arrives, then one
    /// more when the remaining wait is longer than the rank's bubble allowance and `optional`.
    fn fill_wait(&mut self, kind: usize, chunk: usize, r: usize, optional: bool) -> Option<()> {
        let Some(arrival) = self.arrival(kind, chunk, r) else { return Some(()) };
        while !self.pending_w[r].is_empty() && self.fit[0].le(self.free[r] + self.cost[W], arrival) {
            self.put_w(r)?;
        }
        let wait = arrival - self.free[r];
        let long = self.fit[1].lt(self.allowed_bubble(r) - self.bubble[r], wait);
        if !self.pending_w[r].is_empty() && long && optional {
            self.put_w(r)?;
        }
        Some(())
    }

    /// One run with `fill`: the schedule, or `Err(true)` when it stopped at the memory cap,
    /// `Err(false)` when it stopped for want of an input or an action.
    fn run(mut self, fill: Fill) -> Result<Run, bool> {
        for (fit, ties_fit) in self.fit.iter_mut().zip(fill.ties) {
            if !ties_fit {
                *fit = fit.ties_lose();
            }
        }
        let done =
            self.place_all(fill).is_some() && self.count.iter().all(|c| c.iter().all(|&n| n == self.m));
        if !done {
            return Err(self.hit_cap);
        }
        let makespan = self.free.iter().copied().fold(0.0, f64::max);
        let max_bubble = max(&self.bubble);
        Ok(Run { programs: self.programs, makespan, max_bubble, bubble: self.bubble, tol: self.tol })
    }

    /// Warm-up, `2m` rounds of [I, F], then the remaining W's.
    fn place_all(&mut self, fill: Fill) -> Option<()> {
        self.warmup()?;
        for _ in 0..2 * self.m {
            self.backward_round(fill)?;
            self.forward_round(fill)?;
        }
        for r in 0..self.p {
            while !self.pending_w[r].is_empty() {
                self.put_w(r)?;
            }
        }
        Some(())
    }

    /// F's before the first I: chunk 0 down the ranks, extra chunk-0 F's that fit before the
    /// chunk-1 F comes back, then alternating chunks until each rank has caught up with the one
    /// before it.
    fn warmup(&mut self) -> Option<()> {
        let p = self.p;
        for r in 0..p {
            self.put(F, 0, r)?;
        }
        for r in (0..p).rev() {
            if r + 1 < p {
                let back = self.end_of(F, 1, r + 1, 0)? + self.comm;
                // Room for this rank's F's plus those it will hand up the V later.
                while self.mem_tol.le(self.used[r] + self.mem[F] * (2 * r + 2) as f64, self.max_mem)
                    && self.fit[2].le(self.free[r] + self.cost[F], back)
                    && self.count[r][0] < self.m
                {
                    for j in 0..=r {
                        self.put(F, 0, j)?;
                    }
                }
            }
            self.put(F, 1, r)?;
        }
        let (mut chunk, m) = (0, self.m);
        for r in 1..p {
            let behind = |c: &[[usize; 6]]| {
                c[r][0] + c[r][1] < c[r - 1][0] + c[r - 1][1] || (c[r][1] <= c[r - 1][1] && c[r - 1][1] < m)
            };
            while behind(&self.count) {
                for j in (r..p).rev() {
                    if self.count[j][chunk] < self.m {
                        self.put(F, chunk, j)?;
                    }
                }
                chunk = 1 - chunk;
            }
        }
        Some(())
    }

    /// One I per rank: chunk 1 (on the way up) where its input is there or chunk 0 is done,
    /// chunk 0 otherwise; chunk-1 ranks go from the top of the V down, then chunk-0 ranks up.
    fn backward_round(&mut self, fill: Fill) -> Option<()> {
        let p = self.p;
        // As the reference does; an I frees memory, so this acts only above the cap.
        for r in 0..p {
            self.make_room(r, self.mem[I])?;
        }
        let (mut up, mut down) = (Vec::new(), Vec::new());
        for r in 0..p {
            let [_, _, i0, i1, _, _] = self.count[r];
            let chunk1 = i1 < i0
                && (r + 1 == p || i0 >= self.m || (i1 < self.m && self.end_of(I, 1, r + 1, i1).is_some()));
            if chunk1 {
                up.push(r);
            } else {
                down.push(r);
            }
        }
        let order = up.into_iter().rev().map(|r| (r, 1)).chain(down.into_iter().map(|r| (r, 0)));
        for (r, chunk) in order.collect::<Vec<_>>() {
            self.fill_wait(I, chunk, r, chunk == 1 || fill.before_i)?;
            self.put(I, chunk, r)?;
        }
        Some(())
    }

    /// One F per rank that has one whose input is there: chunk 1 first, else chunk 0.
    fn forward_round(&mut self, fill: Fill) -> Option<()> {
        let p = self.p;
        for r in 0..p {
            let [f0, f1, ..] = self.count[r];
            if f1 >= self.m {
                continue;
            }
            let chunk = if f1 >= f0 || r + 1 == p {
                Some(if f1 >= f0 { 0 } else { 1 })
            } else if self.end_of(F, 1, r + 1, f1).is_some() {
                Some(1)
            } else if f0 < self.m && (r == 0 || self.end_of(F, 0, r - 1, f0).is_some()) {
                Some(0)
            } else {
                None
            };
            let Some(chunk) = chunk else { continue };
            self.make_room(r, self.mem[F])?;
            self.fill_wait(F, chunk, r, fill.before_f)?;
            self.put(F, chunk, r)?;
        }
        Some(())
    }
}
