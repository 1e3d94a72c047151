//! Zero-bubble ILP (`zb-auto --solver ilp`): the integer program of Qi et al. 2024, "Zero Bubble
//! Pipeline Parallelism", §3.1 ("ILP"), as the authors' `build_ilp` in
//! sail-sg/zero-bubble-pipeline-parallelism before commit 064369d6 set it up, solved with HiGHS
//! (through `good_lp`) under a time limit and warm-started from the heuristic's schedule
//! ([`super::zb_auto`]), so the answer is never slower than the heuristic's.
//!
//! One stage per rank (v = 1). Nodes are F, I, W of every (stage s, microbatch j). Variables:
//! - `e[n]`: the end time of node n (cost units), in `[T_n, H]`, where H is the heuristic's
//!   makespan (a bound that keeps every big-M tight: no better schedule ends later);
//! - `y`: for every pair of one stage's nodes that no dependency orders — (F_i, I_j), (F_i, W_j),
//!   (I_i, W_j) with i > j — a binary, 1 when the first runs before the second;
//! - `T`, the makespan: `T ≥ e[W(s, m−1)]` for every s (a stage's last W ends it).
//!
//! Constraints: the pipeline's dependencies (F(s, j) after F(s−1, j) + c, I(s, j) after
//! I(s+1, j) + c, I(p−1, j) after F(p−1, j), W(s, j) after I(s, j)) and each kind's microbatch
//! order on a stage (F(s, j) after F(s, j−1), likewise I and W: the authors' graph has the same
//! edges; equal microbatches make it no loss); for every `y` the disjunction "one ends before the
//! other starts" with big-M H; `y` monotone in both microbatch indices (implied by the orders, and
//! it tightens the relaxation); the memory after every F — (j+1)·M_B plus, for each earlier
//! microbatch whose I (W) ran before it, M_W − M_B (−M_W) — at most the cap. Objective: minimise T,
//! the simulator's makespan (every rank starts at 0).
//!
//! The per-stage orders are read from `y`, then validated and simulated: the schedule returned is
//! the ILP's when it is valid, under the cap and faster, else the heuristic's
//! ([`IlpOutcome::Heuristic`] says why). The ILP's space keeps each kind's microbatch order on a
//! stage; a test checks on small shapes that no order outside it is faster.

use std::time::Duration;

use good_lp::solvers::highs::highs;
use good_lp::{
    constraint, variable, Expression, ProblemVariables, ResolutionError, Solution, SolutionStatus,
    SolverModel, Variable, WithInitialSolution,
};

use super::tolerance::Tolerance;
use super::{check_common, check_model, check_size, require, zb_auto, GenerateError, Kind, Options, Shape};
use crate::action::{Action, ComputeKind};
use crate::costs::Costs;
use crate::schedule::Schedule;
use crate::simulate::simulate;
use crate::timeline::Timeline;
use crate::validate::{validate, ValidateOptions};

const F: usize = 0;
const I: usize = 1;
const W: usize = 2;
/// The most binaries a program may have (p = 8, m = 128 has 195,072): the program is built in
/// memory before HiGHS's time limit starts, so a larger one is refused up front.
pub const MAX_BINARIES: usize = 200_000;

/// The three pairs of kinds whose order on a stage the ILP chooses: (F_i, I_j), (F_i, W_j),
/// (I_i, W_j) for i > j.
const PAIRS: [(usize, usize); 3] = [(F, I), (F, W), (I, W)];

/// What the solver reported about the schedule it returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IlpOutcome {
    /// HiGHS proved the schedule optimal (within its default relative gap of 10⁻⁴).
    Optimal,
    /// The time limit ran out; the schedule is the best HiGHS found.
    TimeLimit,
    /// The heuristic's schedule was kept: the ILP found nothing faster (the heuristic's may then
    /// be optimal: `proven_optimal` in [`IlpSchedule`]), HiGHS failed, or the ILP's order did not
    /// validate or fit the cap (`reason`).
    Heuristic {
        /// Why.
        reason: &'static str,
    },
}

/// An ILP result with the heuristic's makespan beside it.
#[derive(Debug, Clone)]
pub struct IlpSchedule {
    /// The schedule returned (compute actions, one stage per rank).
    pub schedule: Schedule,
    /// Its simulated makespan (cost units).
    pub makespan: f64,
    /// The heuristic's simulated makespan (cost units), `>= makespan`.
    pub heuristic_makespan: f64,
    /// What the solver said.
    pub outcome: IlpOutcome,
    /// Binary variables in the program (3·p·m(m−1)/2).
    pub binaries: usize,
    /// HiGHS proved that no order is faster than the one returned.
    pub proven_optimal: bool,
}

/// Solves the zero-bubble ILP for `shape` with `opts.costs`, `opts.memory`, `opts.mem_cap`,
/// stopping after `time_limit`.
///
/// A failure of HiGHS keeps the heuristic's schedule ([`IlpOutcome::Heuristic`]).
///
/// # Errors
/// The heuristic's errors ([`zb_auto::generate`]: p, v or m of 0, v ≠ 1, bad costs or memory, a
/// cap nothing fits, a schedule too large to build); [`GenerateError::Constraint`] when the
/// program would have more than [`MAX_BINARIES`] binaries.
pub fn solve(shape: &Shape, opts: &Options, time_limit: Duration) -> Result<IlpSchedule, GenerateError> {
    let kind = Kind::ZbAuto;
    check_common(kind, shape)?;
    check_size(kind, shape)?;
    let (p, m) = (shape.ranks, shape.microbatches);
    let binaries = 3u128 * p as u128 * (m as u128 * (m as u128 - 1) / 2);
    require(binaries <= MAX_BINARIES as u128, kind, shape, || {
        format!(
            "the ILP would have {binaries} binaries (3·p·m(m−1)/2); the limit is {MAX_BINARIES}: use the \
             heuristic, or fewer --ranks or --microbatches"
        )
    })?;
    let cap = check_model(kind, shape, opts)?;
    let heuristic = zb_auto::heuristic(shape, opts)?;
    let h = simulate(&heuristic, &opts.costs, &opts.memory)
        .map_err(|e| GenerateError::constraint(kind, shape, format!("the heuristic's schedule: {e}")))?;
    let (vars, program) = Program::new(shape, &opts.costs, h.makespan);
    let binaries = program.binaries();
    let kept = |reason, proven_optimal| IlpSchedule {
        schedule: heuristic.clone(),
        makespan: h.makespan,
        heuristic_makespan: h.makespan,
        outcome: IlpOutcome::Heuristic { reason },
        binaries,
        proven_optimal,
    };
    if binaries == 0 {
        return Ok(kept("no order to choose (m = 1)", true));
    }
    let solved = program.solve(vars, shape, opts, cap, &heuristic, &h.timeline, time_limit);
    let Ok((solution, status)) = solved else {
        return Ok(kept("HiGHS failed or found no solution", false));
    };
    // good_lp reports HiGHS's "optimal within the default gap" as GapLimit.
    let proven = matches!(status, SolutionStatus::Optimal | SolutionStatus::GapLimit);
    let schedule = program.orders(shape, &solution);
    let at = ValidateOptions::microbatches(shape.microbatches);
    if validate(&schedule, &at).is_err() {
        return Ok(kept("the ILP's order did not validate", false));
    }
    let Ok(r) = simulate(&schedule, &opts.costs, &opts.memory) else {
        return Ok(kept("the ILP's order did not simulate", false));
    };
    let c = &opts.costs;
    let (tol, mem_tol) =
        (Tolerance::for_costs(c.f, c.i, c.w, c.comm), Tolerance::for_memory(opts.memory.m_b));
    // The simulator's peak is in the memory model's units (M_B = `memory.m_b`), as is the cap.
    let peak = r.peak_activations.iter().copied().fold(0.0, f64::max);
    if !mem_tol.le(peak, cap * opts.memory.m_b) {
        return Ok(kept("the ILP's order exceeds the memory cap", false));
    }
    if !tol.lt(r.makespan, h.makespan) {
        return Ok(kept("the ILP found nothing faster", proven));
    }
    let outcome = if proven { IlpOutcome::Optimal } else { IlpOutcome::TimeLimit };
    let makespan = r.makespan;
    Ok(IlpSchedule {
        schedule,
        makespan,
        heuristic_makespan: h.makespan,
        outcome,
        binaries,
        proven_optimal: proven,
    })
}

/// The variable handles of one program (the variables themselves travel in the
/// [`ProblemVariables`] that [`Program::new`] returns beside it).
struct Program {
    /// `e[kind][s][j]`.
    e: [Vec<Vec<Variable>>; 3],
    /// `y[s * 3 + pair][pair_index(i, j)]` for i > j.
    y: Vec<Vec<Variable>>,
    makespan: Variable,
    cost: [f64; 3],
    /// H, the heuristic's makespan: every end time's upper bound and the big-M.
    bound: f64,
}

/// Where (i, j), i > j, sits in a pair's variable list.
fn pair_index(i: usize, j: usize) -> usize {
    i * (i - 1) / 2 + j
}

impl Program {
    fn new(shape: &Shape, costs: &Costs, bound: f64) -> (ProblemVariables, Self) {
        let (p, m) = (shape.ranks, shape.microbatches);
        let cost = [costs.f, costs.i, costs.w];
        let mut vars = ProblemVariables::new();
        let mut e: [Vec<Vec<Variable>>; 3] = Default::default();
        for (k, ek) in e.iter_mut().enumerate() {
            *ek = (0..p)
                .map(|_| (0..m).map(|_| vars.add(variable().min(cost[k]).max(bound))).collect())
                .collect();
        }
        let pairs = m * m.saturating_sub(1) / 2;
        let y = (0..p * PAIRS.len())
            .map(|_| (0..pairs).map(|_| vars.add(variable().binary())).collect())
            .collect();
        let makespan = vars.add(variable().min(0.0).max(bound));
        (vars, Program { e, y, makespan, cost, bound })
    }

    fn binaries(&self) -> usize {
        self.y.iter().map(Vec::len).sum()
    }

    /// Whether pair `pair`'s first kind at microbatch `i` runs before its second at `j` on stage
    /// `s`, as an expression: the binary when i > j, else 1 (the dependencies order them).
    fn before(&self, s: usize, pair: usize, i: usize, j: usize) -> Expression {
        if i > j {
            self.y[s * PAIRS.len() + pair][pair_index(i, j)].into()
        } else {
            Expression::from(1.0)
        }
    }

    /// Every `node ≥ dep + lag` edge: the pipeline's dependencies and each kind's microbatch
    /// order on a stage; `lag` is the node's cost plus the hop latency across ranks.
    fn edges(&self, shape: &Shape, comm: f64) -> Vec<(Variable, Variable, f64)> {
        let (p, m, e) = (shape.ranks, shape.microbatches, &self.e);
        let mut edges = Vec::new();
        for s in 0..p {
            for j in 0..m {
                let [tf, ti, tw] = self.cost;
                if s > 0 {
                    edges.push((e[F][s][j], e[F][s - 1][j], tf + comm));
                }
                edges.push(if s + 1 < p {
                    (e[I][s][j], e[I][s + 1][j], ti + comm)
                } else {
                    (e[I][s][j], e[F][s][j], ti)
                });
                edges.push((e[W][s][j], e[I][s][j], tw));
                if j > 0 {
                    edges.extend((0..3).map(|k| (e[k][s][j], e[k][s][j - 1], self.cost[k])));
                }
            }
        }
        edges
    }

    #[allow(clippy::too_many_arguments)]
    fn solve(
        &self,
        vars: ProblemVariables,
        shape: &Shape,
        opts: &Options,
        cap: f64,
        warm: &Schedule,
        timeline: &Timeline,
        time_limit: Duration,
    ) -> Result<(Vec<f64>, SolutionStatus), ResolutionError> {
        // A failure of any kind keeps the heuristic's schedule (see `solve`).
        let (m, big, e) = (shape.microbatches, self.bound, &self.e);
        let mut model = vars.minimise(self.makespan).using(highs);
        for (node, dep, lag) in self.edges(shape, opts.costs.comm) {
            model = model.with(constraint!(node >= dep + lag));
        }
        let mem = &opts.memory;
        for (s, last) in e[W].iter().map(|ws| ws[m - 1]).enumerate() {
            model = model.with(constraint!(self.makespan >= last));
            for (pair, &(a, b)) in PAIRS.iter().enumerate() {
                for i in 1..m {
                    for j in 0..i {
                        let y = self.y[s * PAIRS.len() + pair][pair_index(i, j)];
                        let (ea, eb) = (e[a][s][i], e[b][s][j]);
                        model = model.with(constraint!(eb >= ea + self.cost[b] - big + big * y));
                        model = model.with(constraint!(ea >= eb + self.cost[a] - big * y));
                        model = model.with(constraint!(y <= self.before(s, pair, i - 1, j)));
                        model = model.with(constraint!(y <= self.before(s, pair, i, j + 1)));
                    }
                }
            }
            for i in 1..m {
                let mut held = Expression::from((i + 1) as f64 * mem.m_b);
                for j in 0..i {
                    held += (mem.m_b - mem.m_w) * self.before(s, 0, i, j) - (mem.m_b - mem.m_w);
                    held += mem.m_w * self.before(s, 1, i, j) - mem.m_w;
                }
                model = model.with(constraint!(held <= cap * mem.m_b * (1.0 + 1e-9)));
            }
        }
        let start = self.warm_start(shape, warm, timeline);
        let solution = model.with_initial_solution(start).set_time_limit(time_limit.as_secs_f64()).solve()?;
        let values = self.y.iter().flatten().map(|&v| solution.value(v)).collect();
        Ok((values, solution.status()))
    }

    /// The heuristic's schedule as a value of every variable: end times from its simulated
    /// timeline, `y` from each stage's order.
    fn warm_start(&self, shape: &Shape, warm: &Schedule, timeline: &Timeline) -> Vec<(Variable, f64)> {
        let (p, m) = (shape.ranks, shape.microbatches);
        let mut end = vec![[0.0; 3]; p * m];
        let mut pos = vec![[0usize; 3]; p * m];
        for iv in &timeline.intervals {
            if let Some((k, s, j)) = node(&iv.action) {
                end[s * m + j][k] = iv.end.min(self.bound);
            }
        }
        for s in 0..p {
            for (n, a) in warm.program(s).iter().enumerate() {
                if let Some((k, s, j)) = node(a) {
                    pos[s * m + j][k] = n;
                }
            }
        }
        let mut start = vec![(self.makespan, self.bound)];
        for (k, ek) in self.e.iter().enumerate() {
            for (s, es) in ek.iter().enumerate() {
                start.extend(es.iter().enumerate().map(|(j, &v)| (v, end[s * m + j][k])));
            }
        }
        for s in 0..p {
            for (pair, &(a, b)) in PAIRS.iter().enumerate() {
                for i in 1..m {
                    for j in 0..i {
                        let y = self.y[s * PAIRS.len() + pair][pair_index(i, j)];
                        start.push((y, f64::from(u8::from(pos[s * m + i][a] < pos[s * m + j][b]))));
                    }
                }
            }
        }
        start
    }

    /// Each stage's order from the solved binaries (flattened as `self.y`): a node's position is
    /// its index in its kind's order plus the nodes of the other two kinds the binaries put
    /// before it.
    fn orders(&self, shape: &Shape, y: &[f64]) -> Schedule {
        let (p, m) = (shape.ranks, shape.microbatches);
        let pairs = m * (m - 1) / 2;
        let before = |s: usize, pair: usize, i: usize, j: usize| -> bool {
            i <= j || y[(s * PAIRS.len() + pair) * pairs + pair_index(i, j)] > 0.5
        };
        let count = |n: usize, f: &dyn Fn(usize) -> bool| (0..n).filter(|&x| f(x)).count();
        let programs = (0..p)
            .map(|s| {
                let mut nodes: Vec<(usize, usize, usize)> = Vec::with_capacity(3 * m);
                for j in 0..m {
                    let f = j + count(j, &|i| !before(s, 0, j, i)) + count(j, &|i| !before(s, 1, j, i));
                    let i = j + count(m, &|i| before(s, 0, i, j)) + count(j, &|k| !before(s, 2, j, k));
                    let w = j + count(m, &|i| before(s, 1, i, j)) + count(m, &|i| before(s, 2, i, j));
                    nodes.extend([(f, F, j), (i, I, j), (w, W, j)]);
                }
                nodes.sort_unstable();
                nodes.into_iter().map(|(_, k, j)| [Action::f, Action::i, Action::w][k](s, j)).collect()
            })
            .collect();
        Schedule::from_programs(programs)
    }
}

/// (kind, stage, microbatch) of a compute F, I or W; `None` for anything else.
fn node(a: &Action) -> Option<(usize, usize, usize)> {
    match a {
        Action::Compute { kind, task } => {
            let k = match kind {
                ComputeKind::F => F,
                ComputeKind::I => I,
                ComputeKind::W => W,
                ComputeKind::B => return None,
            };
            Some((k, task.stage, task.mb))
        }
        _ => None,
    }
}
