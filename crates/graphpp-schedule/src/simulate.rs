//! Event-driven simulation of a schedule: makespan, per-rank busy/idle, bubble figures and peak
//! in-flight activation memory (docs/ARCHITECTURE.md, "Simulation").
//!
//! An action starts at max(its rank is free, each dependency finished + c if the dependency ran on
//! another rank). Durations: T_F, T_B, T_I, T_W, T_overlap (default T_F + T_B); SEND/RECV and FSDP
//! actions take `comm_action` (default 0). Memory per rank, in full-stage M_B units: F adds M_B,
//! B frees M_B, I frees M_B − M_W, W frees M_W, each weighted 1/v where v is the number of stages
//! the rank holds; OVERLAP_F_B counts its F before its B.

use std::mem::MaybeUninit;
use std::ops::Range;

use rayon::prelude::*;

use crate::action::{Action, ComputeKind};
use crate::costs::{check_cost, CostError, Costs, Memory};
use crate::deps::{DepGraph, MissingDep, Walk};
use crate::schedule::{RankId, Schedule};
use crate::timeline::{Interval, Timeline};
use crate::validate::Validated;

/// Why a schedule cannot be simulated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimulateError {
    /// A cost or the hop latency is not a duration (negative, NaN, infinite or above
    /// [`crate::costs::MAX_COST`]).
    #[error("costs: {0}")]
    Costs(#[from] CostError),
    /// An action's producer is absent.
    #[error(transparent)]
    Missing(#[from] MissingDep),
    /// The ranks wait on each other in a cycle.
    #[error("deadlock: {0}")]
    Deadlock(String),
    /// An action names a microbatch beyond the schedule's action count (checked before the
    /// per-microbatch tables are sized: an unvalidated schedule file could ask for billions).
    #[error(transparent)]
    MicrobatchBeyondActions(Box<crate::validate::ValidationError>),
}

/// The simulator's figures. All times in cost units; memory in full-stage M_B units.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SimReport {
    /// End of the last action (every rank starts at 0).
    pub makespan: f64,
    /// Per-rank time spent running actions.
    pub busy: Vec<f64>,
    /// Per-rank in-iteration idle time: makespan − busy (global sync at iteration end).
    pub idle: Vec<f64>,
    /// In-iteration r_bubble = Σ idle / Σ busy (docs/ARCHITECTURE.md glossary "bubble").
    pub bubble_ratio: f64,
    /// In-iteration idle fraction = Σ idle / (p · makespan).
    pub idle_fraction: f64,
    /// Per-rank steady-state idle: first action start → last action end, minus busy.
    pub steady_idle: Vec<f64>,
    /// Steady-state r_bubble = Σ steady_idle / Σ busy.
    pub steady_bubble_ratio: f64,
    /// Per-rank peak in-flight activations (full-stage M_B units).
    pub peak_activations: Vec<f64>,
    /// Per-rank peak count of in-flight (stage, microbatch) pairs (F ran, B/I not yet).
    pub peak_in_flight: Vec<usize>,
    /// What ran when: rank by rank, each rank's intervals in step order.
    #[serde(skip)]
    pub timeline: Timeline,
}

/// Duration of one action.
pub fn duration(a: &Action, c: &Costs) -> f64 {
    match a {
        Action::Compute { kind, .. } => match kind {
            ComputeKind::F => c.f,
            ComputeKind::B => c.b,
            ComputeKind::I => c.i,
            ComputeKind::W => c.w,
        },
        Action::Overlap { .. } => c.overlap(),
        Action::Comm { .. } | Action::StageOp { .. } => c.comm_action,
    }
}

/// Simulates `schedule` with `costs` and the memory model `memory`.
///
/// # Errors
/// [`SimulateError::Costs`] when a cost fails [`Costs::check`], [`SimulateError::Missing`] when a
/// dependency is absent, [`SimulateError::Deadlock`] naming the waiting cycle when the ranks wait on
/// each other.
pub fn simulate(schedule: &Schedule, costs: &Costs, memory: &Memory) -> Result<SimReport, SimulateError> {
    costs.check()?;
    simulate_with(schedule, |a| duration(a, costs), costs.comm, memory)
}

/// Simulates `schedule` with a duration per action (`duration(a)`, e.g. measured per stage) and a
/// hop latency `comm` added to every cross-rank dependency.
///
/// # Errors
/// As [`simulate`]; the latency `comm` must pass [`check_cost`] (durations are the caller's).
pub fn simulate_with(
    schedule: &Schedule,
    duration: impl Fn(&Action) -> f64 + Sync,
    comm: f64,
    memory: &Memory,
) -> Result<SimReport, SimulateError> {
    check_cost("C", comm)?;
    crate::validate::check_microbatch_numbers(schedule)
        .map_err(|e| SimulateError::MicrobatchBeyondActions(Box::new(e)))?;
    simulate_walk(schedule, &Walk::new(schedule), None, duration, comm, memory)
}

impl Validated<'_> {
    /// [`simulate`] of the validated schedule: the validation's producer tables and action order
    /// serve the simulation, so nothing is looked up twice.
    ///
    /// # Errors
    /// [`SimulateError::Costs`] when a cost fails [`Costs::check`] (a validated schedule has its
    /// producers and does not deadlock).
    pub fn simulate(&self, costs: &Costs, memory: &Memory) -> Result<SimReport, SimulateError> {
        costs.check()?;
        self.simulate_with(|a| duration(a, costs), costs.comm, memory)
    }

    /// [`simulate_with`] of the validated schedule.
    ///
    /// # Errors
    /// As [`Validated::simulate`], for the latency `comm`.
    pub fn simulate_with(
        &self,
        duration: impl Fn(&Action) -> f64 + Sync,
        comm: f64,
        memory: &Memory,
    ) -> Result<SimReport, SimulateError> {
        check_cost("C", comm)?;
        simulate_walk(self.schedule, &self.walk, Some(&self.order), duration, comm, memory)
    }
}

/// The simulation of `schedule` over its `walk`: in the walk's own order, or in `order` (one a
/// run of the walk visited).
fn simulate_walk(
    schedule: &Schedule,
    walk: &Walk<'_>,
    order: Option<&[[u32; 3]]>,
    duration: impl Fn(&Action) -> f64 + Sync,
    comm: f64,
    memory: &Memory,
) -> Result<SimReport, SimulateError> {
    let counts: Vec<usize> = schedule.ranks.par_iter().map(|row| row.iter().flatten().count()).collect();
    // The ranks run (sequentially) while the other workers fault in the timeline's buffer, the
    // pipeline's largest allocation (64 B an action); the first to finish helps the other.
    let ((ran_all, end), buf) =
        rayon::join(|| run_ends(schedule, walk, order, &duration, comm), || touched(counts.iter().sum()));
    if !ran_all {
        return Err(failure(schedule));
    }
    let (intervals, totals) = intervals_of(schedule, walk, &end, comm, &counts, buf);
    let timeline = Timeline { ranks: schedule.num_ranks(), intervals, comm: Vec::new(), unit: "unit".into() };
    Ok(report_with(timeline, schedule, memory, &walk.routes, totals))
}

/// An action's start: its rank is free at `free`, and each producer's output (global cell index)
/// is there `comm` after the producer ends unless it ran on the same rank (cells `row`).
#[inline]
fn start_of(free: f64, producers: &[u32], row: &Range<usize>, end: &[f64], comm: f64) -> f64 {
    let mut s = free;
    for &p in producers {
        let p = p as usize;
        let hop = if row.contains(&p) { 0.0 } else { comm };
        s = s.max(end[p] + hop);
    }
    s
}

/// Runs the ranks over `walk` (in `order` if given) and returns whether every action ran and the
/// end of every cell (by global cell index).
fn run_ends(
    schedule: &Schedule,
    walk: &Walk<'_>,
    order: Option<&[[u32; 3]]>,
    duration: &(impl Fn(&Action) -> f64 + Sync),
    comm: f64,
) -> (bool, Vec<f64>) {
    let mut end = vec![0.0f64; walk.cells()];
    let mut free = vec![0.0f64; schedule.num_ranks()];
    let mut visit = |rank: RankId, step: usize, a: &Action, producers: &[u32]| {
        let row = walk.row(rank);
        let e = start_of(free[rank], producers, &row, &end, comm) + duration(a);
        end[row.start + step] = e;
        free[rank] = e;
    };
    let ran_all = match order {
        Some(order) => {
            walk.replay(order, &mut visit);
            true
        }
        None => walk.run(&mut visit),
    };
    (ran_all, end)
}

/// A buffer of `n` intervals whose pages have been written once (so the kernel has mapped them),
/// in parallel (rayon's current pool).
fn touched(n: usize) -> Vec<MaybeUninit<Interval>> {
    let mut buf = Vec::with_capacity(n);
    let per_page = (4096 / std::mem::size_of::<Interval>()).max(1);
    buf.spare_capacity_mut().par_chunks_mut(per_page * 256).for_each(|chunk| {
        for slot in chunk.iter_mut().step_by(per_page) {
            *slot = MaybeUninit::zeroed();
        }
    });
    buf.resize_with(n, MaybeUninit::uninit);
    buf
}

/// The interval of every action, rank by rank in step order, and their [`Totals`], given the end
/// of every cell (by global cell index; idle cells are skipped), the number of actions of each
/// rank and a buffer of as many intervals. Each start is found again as the run found it
/// ([`start_of`], the same operations in the same order, so the same bits); the ranks are filled
/// in parallel (rayon's current pool), each into its own part of the buffer.
fn intervals_of(
    schedule: &Schedule,
    walk: &Walk<'_>,
    end: &[f64],
    comm: f64,
    counts: &[usize],
    mut buf: Vec<MaybeUninit<Interval>>,
) -> (Vec<Interval>, Totals) {
    assert_eq!(buf.len(), counts.iter().sum::<usize>(), "one slot per action");
    let mut parts = Vec::with_capacity(counts.len());
    let mut rest = &mut buf[..];
    for &c in counts {
        let (part, tail) = rest.split_at_mut(c);
        parts.push(part);
        rest = tail;
    }
    let totals: Totals = parts
        .into_par_iter()
        .enumerate()
        .map(|(rank, part)| {
            let row = walk.row(rank);
            let actions = schedule.ranks[rank].iter().enumerate().filter_map(|(i, c)| c.map(|a| (i, a)));
            let (mut total, mut written, mut free) = (RankTotal::NONE, 0, 0.0f64);
            for (slot, (step, action)) in part.iter_mut().zip(actions) {
                let (s, e) =
                    (start_of(free, walk.producers_of(rank, step), &row, end, comm), end[row.start + step]);
                free = e;
                slot.write(Interval { rank, start: s, end: e, action });
                total.add(s, e);
                written += 1;
            }
            assert_eq!(written, part.len(), "rank {rank}: one interval per action");
            total
        })
        .collect();
    let mut buf = std::mem::ManuallyDrop::new(buf);
    // SAFETY: `buf` is the concatenation of `parts`, and the loop above wrote every slot of each
    // part (the assert); `MaybeUninit<Interval>` has `Interval`'s size and alignment.
    let intervals =
        unsafe { Vec::from_raw_parts(buf.as_mut_ptr().cast::<Interval>(), buf.len(), buf.capacity()) };
    (intervals, totals)
}

/// One rank's sums over its intervals.
#[derive(Clone, Copy)]
struct RankTotal {
    /// Σ (end − start).
    busy: f64,
    /// Earliest start (∞ for none).
    first: f64,
    /// Latest end (0 for none).
    last: f64,
}

impl RankTotal {
    /// No interval yet.
    const NONE: RankTotal = RankTotal { busy: 0.0, first: f64::INFINITY, last: 0.0 };

    /// Adds an interval from `start` to `end`.
    #[inline]
    fn add(&mut self, start: f64, end: f64) {
        self.busy += end - start;
        self.first = self.first.min(start);
        self.last = self.last.max(end);
    }
}

/// Every rank's sums over its intervals, index = rank.
type Totals = Vec<RankTotal>;

/// The totals of `timeline`.
fn totals_of(timeline: &Timeline) -> Totals {
    let mut t = vec![RankTotal::NONE; timeline.ranks];
    for i in &timeline.intervals {
        t[i.rank].add(i.start, i.end);
    }
    t
}

/// Why the ranks of `schedule` cannot all run to their end: the missing producer, or the cycle.
fn failure(schedule: &Schedule) -> SimulateError {
    match DepGraph::build(schedule) {
        Err(missing) => missing.into(),
        Ok(g) => match g.topo_order() {
            Err(cycle) => SimulateError::Deadlock(describe_cycle(&g, &cycle)),
            Ok(_) => SimulateError::Deadlock("the ranks stop before the end of their programs".into()),
        },
    }
}

/// Figures of a timeline (simulated or measured) and the memory of `schedule`'s programs.
pub fn report(timeline: Timeline, schedule: &Schedule, memory: &Memory) -> SimReport {
    let totals = totals_of(&timeline);
    report_with(timeline, schedule, memory, &schedule.routes(), totals)
}

/// [`report`] given `schedule`'s routes ([`Schedule::routes`]) and the timeline's [`Totals`].
fn report_with(
    timeline: Timeline,
    schedule: &Schedule,
    memory: &Memory,
    routes: &[Option<std::ops::Range<usize>>],
    totals: Totals,
) -> SimReport {
    let p = timeline.ranks;
    let makespan = totals.iter().map(|t| t.last).fold(0.0, f64::max);
    let busy: Vec<f64> = totals.iter().map(|t| t.busy).collect();
    let idle: Vec<f64> = busy.iter().map(|b| makespan - b).collect();
    let steady_idle: Vec<f64> = totals
        .iter()
        .map(|t| if t.busy > 0.0 || t.first.is_finite() { t.last - t.first - t.busy } else { 0.0 })
        .collect();
    let total_busy: f64 = busy.iter().sum();
    let ratio = |x: f64, y: f64| if y > 0.0 { x / y } else { 0.0 };
    let p_ranks = active_ranks(schedule);
    let weights: Vec<f64> = routes.iter().map(|r| route_weight(r, p_ranks)).collect();
    let weight = |mb: usize| weights.get(mb).copied().unwrap_or(1.0);
    let (peak_activations, peak_in_flight) =
        schedule.ranks.par_iter().map(|prog| peak_of(prog.iter().flatten(), weight, memory)).unzip();
    SimReport {
        makespan,
        bubble_ratio: ratio(idle.iter().sum(), total_busy),
        idle_fraction: ratio(idle.iter().sum(), p as f64 * makespan),
        steady_bubble_ratio: ratio(steady_idle.iter().sum(), total_busy),
        busy,
        idle,
        steady_idle,
        peak_activations,
        peak_in_flight,
        timeline,
    }
}

/// Peak in-flight activation memory (full-stage M_B units) and peak in-flight (stage, mb) count
/// of rank `r`, walking its program in order.
///
/// One (stage, mb) weighs `p / len(route(mb))` full stages: 1/v for v equal chunks per rank, and
/// 1 for DualPipe, whose two stages per rank are each a full stage of one parameter copy.
pub fn peak_memory(schedule: &Schedule, r: RankId, memory: &Memory) -> (f64, usize) {
    let routes = schedule.routes();
    peak_memory_with(schedule.ranks[r].iter().flatten(), &routes, active_ranks(schedule), memory)
}

/// Ranks that run a compute action: the `p` of the stage weights (an idle row of a schedule file
/// holds no stage and must not make the others' chunks lighter).
fn active_ranks(schedule: &Schedule) -> usize {
    schedule.ranks.iter().filter(|row| row.iter().flatten().any(Action::is_compute)).count().max(1)
}

/// [`peak_memory`] of one program, given the microbatch routes and the number of ranks `p`.
pub fn peak_memory_with<'a>(
    program: impl IntoIterator<Item = &'a Action>,
    routes: &[Option<std::ops::Range<usize>>],
    p: usize,
    memory: &Memory,
) -> (f64, usize) {
    peak_of(program, |mb| routes.get(mb).map_or(1.0, |r| route_weight(r, p)), memory)
}

/// The weight of one (stage, mb) whose microbatch has route `route`, in full stages (see
/// [`peak_memory`]): `p / len(route)`, 1 for a microbatch without a route.
fn route_weight(route: &Option<std::ops::Range<usize>>, p: usize) -> f64 {
    route.as_ref().map_or(1.0, |r| p as f64 / r.len() as f64)
}

/// [`peak_memory_with`] given the weight of each microbatch's (stage, mb).
fn peak_of<'a>(
    program: impl IntoIterator<Item = &'a Action>,
    weight: impl Fn(usize) -> f64,
    memory: &Memory,
) -> (f64, usize) {
    let (mut mem, mut peak, mut count, mut peak_count) = (0.0f64, 0.0f64, 0usize, 0usize);
    for (kind, task) in program.into_iter().flat_map(|a| a.computes()) {
        let w = weight(task.mb);
        match kind {
            ComputeKind::F => {
                mem += memory.m_b * w;
                count += 1;
            }
            ComputeKind::B => {
                mem -= memory.m_b * w;
                count = count.saturating_sub(1);
            }
            ComputeKind::I => {
                mem -= (memory.m_b - memory.m_w) * w;
                count = count.saturating_sub(1);
            }
            ComputeKind::W => mem -= memory.m_w * w,
        }
        peak = peak.max(mem);
        peak_count = peak_count.max(count);
    }
    (peak, peak_count)
}

/// "rank 0 at step 3 (0B0) waits for 1B0 on rank 1; …" for a waiting cycle from
/// [`DepGraph::topo_order`].
pub fn describe_cycle(g: &DepGraph, cycle: &[(crate::deps::ActionRef, crate::deps::ActionRef)]) -> String {
    cycle
        .iter()
        .map(|(a, b)| {
            format!(
                "rank {} at step {} ({}) waits for {} on rank {}",
                a.rank,
                g.steps[a.rank][a.index],
                g.action(*a),
                g.action(*b),
                b.rank
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An unvalidated schedule naming microbatch 4·10⁹ in one action is refused before any
    /// per-microbatch table is sized (it once asked for ~100 GB).
    #[test]
    fn a_microbatch_beyond_the_actions_is_refused_first() {
        let s = Schedule::parse("0F4000000000,0B4000000000\n").unwrap();
        let e = simulate(&s, &Costs::default(), &Memory::default()).unwrap_err();
        assert!(matches!(e, SimulateError::MicrobatchBeyondActions(_)), "{e}");
        assert!(e.to_string().contains("microbatch 4000000000 is beyond the schedule's 2 actions"), "{e}");
    }

    /// 1F1B by its docs/ARCHITECTURE.md rule, written out independently of the generators.
    fn one_f_one_b(p: usize, m: usize) -> Schedule {
        let progs = (0..p)
            .map(|r| {
                let w = m.min(p - 1 - r);
                let mut v: Vec<Action> = (0..w).map(|j| Action::f(r, j)).collect();
                for j in 0..m - w {
                    v.push(Action::f(r, j + w));
                    v.push(Action::b(r, j));
                }
                v.extend((m - w..m).map(|j| Action::b(r, j)));
                v
            })
            .collect();
        Schedule::from_programs(progs)
    }

    #[test]
    fn one_f_one_b_reference_figures() {
        // docs/ARCHITECTURE.md: p=4, m=8, t_f=t_b=1 → makespan 22.
        let c = Costs { f: 1.0, b: 1.0, ..Costs::default() };
        let r = simulate(&one_f_one_b(4, 8), &c, &Memory::default()).unwrap();
        assert_eq!(r.makespan, 22.0);
        assert_eq!(r.peak_in_flight, vec![4, 3, 2, 1]);
        // r_bubble = (p-1)/m with T_B = 2 T_F: p=8, m=8 → 0.875, idle 47%.
        let r = simulate(&one_f_one_b(8, 8), &Costs::default(), &Memory::default()).unwrap();
        assert!((r.bubble_ratio - 0.875).abs() < 1e-12);
        assert!((r.idle_fraction - 21.0 / 45.0).abs() < 1e-12);
        let r = simulate(&one_f_one_b(8, 32), &Costs::default(), &Memory::default()).unwrap();
        assert!((r.bubble_ratio - 7.0 / 32.0).abs() < 1e-12);
        assert_eq!((r.idle_fraction * 100.0).round(), 18.0);
        let r = simulate(&one_f_one_b(8, 64), &Costs::default(), &Memory::default()).unwrap();
        assert_eq!((r.idle_fraction * 100.0).round(), 10.0);
    }

    #[test]
    fn comm_latency_adds_per_hop() {
        // Two ranks, one microbatch: F0 → hop → F1 → B1 → hop → B0.
        let s = Schedule::from_csv("0F0,0B0\n1F0,1B0\n").unwrap();
        let c = Costs { comm: 0.5, ..Costs::default() };
        let r = simulate(&s, &c, &Memory::default()).unwrap();
        assert_eq!(r.makespan, 1.0 + 0.5 + 1.0 + 2.0 + 0.5 + 2.0);
        assert_eq!(r.steady_idle, vec![4.0, 0.0]);
        assert_eq!(r.idle, vec![4.0, 4.0]);
    }

    #[test]
    fn a_latency_that_is_not_a_duration_is_refused() {
        // A negative c made the 2-rank makespan 7 < 9 (the zero-latency one); NaN let rank 1 start
        // F0 at t = 0 before its input existed.
        let s = Schedule::from_csv("0F0,0B0\n1F0,1B0\n").unwrap();
        for (c, problem) in [
            (-1.0, crate::costs::CostProblem::Negative),
            (f64::NAN, crate::costs::CostProblem::NotFinite),
            (f64::INFINITY, crate::costs::CostProblem::NotFinite),
        ] {
            let costs = Costs { comm: c, ..Costs::default() };
            let e = simulate(&s, &costs, &Memory::default()).unwrap_err();
            assert!(
                matches!(&e, SimulateError::Costs(ce) if ce.problem == problem && ce.name == "C"),
                "{e:?}"
            );
        }
        let r = simulate(&s, &Costs::default(), &Memory::default()).unwrap();
        assert_eq!(r.makespan, 6.0);
    }

    #[test]
    fn memory_model_i_and_w() {
        // One stage: F0 F1 I0 W0 I1 W1 with M_B = 1, M_W = 0.5 → peak 2.
        let s = Schedule::from_csv("0F0,0F1,0I0,0W0,0I1,0W1\n").unwrap();
        let m = Memory { m_b: 1.0, m_w: 0.5 };
        assert_eq!(peak_memory(&s, 0, &m), (2.0, 2));
        let s = Schedule::from_csv("0F0,0I0,0F1,0I1,0W0,0W1\n").unwrap();
        assert_eq!(peak_memory(&s, 0, &m), (1.5, 1));
    }

    #[test]
    fn huge_stage_number_is_a_missing_producer() {
        let s = Schedule::from_csv("0F0,1000000000000F0\n").unwrap();
        let e = simulate(&s, &Costs::default(), &Memory::default()).unwrap_err();
        let SimulateError::Missing(m) = e else { panic!("{e:?}") };
        assert_eq!((m.rank, m.step, m.needs.as_str()), (0, 1, "999999999999F0"));
    }

    #[test]
    fn deadlock_is_named() {
        let s = Schedule::from_csv("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n").unwrap();
        let e = simulate(&s, &Costs::default(), &Memory::default()).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("rank 0 at step 1 (0B0) waits for 1B0 on rank 1"), "{msg}");
        assert!(msg.contains("rank 1 at step 0 (1F1) waits for 0F1 on rank 0"), "{msg}");
    }

    #[test]
    fn idle_rows_do_not_change_the_peaks() {
        let two = Schedule::from_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n").unwrap();
        let idle = Schedule::from_csv("0F0,0F1,0B0,0B1\n,,\n1F0,1B0,1F1,1B1\n,\n").unwrap();
        let peaks =
            |s: &Schedule| simulate(s, &Costs::default(), &Memory::default()).unwrap().peak_activations;
        assert_eq!(peaks(&two), vec![2.0, 1.0]);
        assert_eq!(peaks(&idle), vec![2.0, 0.0, 1.0, 0.0]);
    }
}
