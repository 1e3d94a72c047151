//! Cross-rank dependencies of a schedule and their topological order.
//!
//! The dependency rules are docs/ARCHITECTURE.md's ("Validation"): F(s,j) needs F(s−1,j); B/I(s,j) needs
//! B/I(s+1,j), and the last stage of a microbatch's route needs its own F(s,j); W(s,j) needs I(s,j).
//! In a lowered schedule the cross-rank edges go through SEND/RECV: a compute action whose input
//! comes from another rank waits for its rank's RECV, and the RECV waits for the peer's SEND
//! (blocking RECV semantics); a WAIT_SEND waits for its SEND and for the peer's matching RECV (a
//! send completes once it is received; like every cross-rank edge, the news takes one hop
//! latency). Each rank also runs its program in order. Both the validator's
//! deadlock check and the simulator walk this graph.
//!
//! Storage is flat (one global index per action, dependencies in one array) and the producer
//! lookup is a dense (kind, stage, microbatch) table, so building and ordering are linear in the
//! number of actions: p = 64, v = 2, m = 1024 lowered (≈ 650k actions) takes tens of milliseconds.

use std::ops::Range;

use rayon::prelude::*;

use crate::action::{Action, CommKind, ComputeKind, Task};
use crate::route::{routes_of, tasks_of, widen_route};
use crate::schedule::{RankId, Schedule, Step};
use crate::table::TaskMap;

/// An action's position: rank and index into that rank's program with idle steps removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ActionRef {
    /// Rank.
    pub rank: RankId,
    /// Index into the rank's compacted program.
    pub index: usize,
}

/// One data dependency of an action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dep {
    /// The action that must finish first.
    pub on: ActionRef,
    /// True when `on` runs on another rank, so the dependency pays one hop latency `c`.
    pub hop: bool,
}

/// A dependency whose producer is absent from the schedule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank}, step {step}: `{action}` needs {needs}, which no rank runs")]
pub struct MissingDep {
    /// Rank of the waiting action.
    pub rank: RankId,
    /// Step (CSV cell index, 0-based, idle steps counted) of the waiting action.
    pub step: usize,
    /// The waiting action.
    pub action: Action,
    /// What it needs, in action text (e.g. `1F3`, or `3B2 or 3I2`).
    pub needs: String,
}

/// The dependency graph of a schedule.
#[derive(Debug, Clone)]
pub struct DepGraph {
    /// Per-rank programs without idle steps.
    pub programs: Vec<Vec<Action>>,
    /// `steps[r][i]`: the original step (cell index, idle steps counted) of `programs[r][i]`.
    pub steps: Vec<Vec<usize>>,
    /// `offsets[r]`: global index of rank r's first action; `offsets[p]` = number of actions.
    offsets: Vec<usize>,
    /// `rank_of[g]`: the rank of global index g.
    rank_of: Vec<u32>,
    /// `dep_start[g]..dep_start[g + 1]`: the slice of `dep_list` holding action g's dependencies.
    dep_start: Vec<u32>,
    dep_list: Vec<Dep>,
}

/// A program cell: an action ([`DepGraph::programs`]) or a step that may be idle ([`Schedule::ranks`]).
trait ProgramCell {
    fn action(&self) -> Option<&Action>;
}

impl ProgramCell for Action {
    fn action(&self) -> Option<&Action> {
        Some(self)
    }
}

impl ProgramCell for Step {
    fn action(&self) -> Option<&Action> {
        self.as_ref()
    }
}

/// A cell's rank and index in its row, packed (a schedule never has 2^32 ranks or steps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pos {
    /// Rank.
    pub rank: u32,
    /// Index in the rank's row.
    pub index: u32,
}

impl crate::table::Packed for Pos {
    #[inline]
    fn pack(self) -> u64 {
        crate::table::pack_pair(self.rank, self.index)
    }
    #[inline]
    fn unpack(x: u64) -> Self {
        let (rank, index) = crate::table::unpack_pair(x);
        Pos { rank, index }
    }
}

impl Pos {
    pub fn new(rank: usize, index: usize) -> Self {
        Pos { rank: rank as u32, index: index as u32 }
    }
}

/// Producer tables: for each compute kind (F, B, I, W) and each comm kind (SEND/RECV/WAIT_SEND)
/// and each (stage, mb), the position of the first action that performs it. Two tables, so that
/// the validator's own indexes of compute and comm actions serve the walk as they are.
pub(crate) struct Index {
    /// Slot = [`ComputeKind`] as index.
    pub compute: TaskMap<Pos>,
    /// Slot = [`CommKind`] as index.
    pub comm: TaskMap<Pos>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Slot {
    Compute(ComputeKind),
    Comm(CommKind),
}

impl Slot {
    fn text(self, t: Task) -> String {
        match self {
            Slot::Compute(k) => format!("{}{k}{}", t.stage, t.mb),
            Slot::Comm(k) => format!("{}{k}{}", t.stage, t.mb),
        }
    }
}

impl Index {
    /// The producer tables and the routes (see [`routes`]) of `rows`, in two passes.
    fn new<C: ProgramCell>(rows: &[Vec<C>]) -> (Self, Vec<Option<Range<usize>>>) {
        let mut routes = Vec::new();
        for t in rows.iter().flatten().filter_map(C::action).flat_map(tasks_of) {
            widen_route(&mut routes, t);
        }
        (Self::with_routes(rows, &routes), routes)
    }

    /// The producer tables of `rows` given their routes (see [`routes`]).
    fn with_routes<C: ProgramCell>(rows: &[Vec<C>], routes: &[Option<Range<usize>>]) -> Self {
        let stages = routes.iter().flatten().map(|r| r.end).max().unwrap_or(0);
        let cells = rows.iter().map(Vec::len).sum();
        let mut ix = Index {
            compute: TaskMap::new(4, stages, routes.len(), cells),
            comm: TaskMap::new(6, stages, routes.len(), cells),
        };
        for (rank, row) in rows.iter().enumerate() {
            for (index, cell) in row.iter().enumerate() {
                let Some(a) = cell.action() else { continue };
                for (k, t) in a.computes() {
                    ix.compute.first(k as usize, t, Pos::new(rank, index));
                }
                if let Action::Comm { kind, task } = *a {
                    ix.comm.first(kind as usize, task, Pos::new(rank, index));
                }
            }
        }
        ix
    }

    #[inline]
    fn get(&self, s: Slot, t: Task) -> Option<Pos> {
        match s {
            Slot::Compute(k) => self.compute.get(k as usize, t),
            Slot::Comm(k) => self.comm.get(k as usize, t),
        }
    }
    /// The backward-like action (B, else I) of a task.
    #[inline]
    fn backward(&self, t: Task) -> Option<Pos> {
        self.get(Slot::Compute(ComputeKind::B), t).or_else(|| self.get(Slot::Compute(ComputeKind::I), t))
    }
}

/// What is missing for one half of an action (its text is built only for the error).
#[derive(Clone, Copy)]
enum Missing {
    /// This action.
    One(Slot, Task),
    /// The B or the I of a task.
    Backward(Task),
    /// The SEND_F into stage 0 of a microbatch (there is no stage before stage 0).
    SendIntoStage0(usize),
}

impl Missing {
    fn text(self) -> String {
        match self {
            Missing::One(s, t) => s.text(t),
            Missing::Backward(t) => format!("{}B{} or {}I{}", t.stage, t.mb, t.stage, t.mb),
            Missing::SendIntoStage0(mb) => format!("a SEND_F{mb} from a stage before stage 0"),
        }
    }
}

/// What one half of an action needs: a producer's position, or what is missing.
type Need = Result<Pos, Missing>;

#[inline]
fn want(ix: &Index, s: Slot, t: Task) -> Need {
    ix.get(s, t).ok_or(Missing::One(s, t))
}

#[inline]
fn want_bw(ix: &Index, t: Task) -> Need {
    ix.backward(t).ok_or(Missing::Backward(t))
}

/// The producers one compute or comm half needs (at most two).
#[inline]
fn needs_of(half: Slot, t: Task, ix: &Index, route: &Range<usize>) -> [Option<Need>; 2] {
    use ComputeKind as C;
    match half {
        Slot::Compute(C::F) if t.stage > route.start => match ix.get(Slot::Comm(CommKind::RecvF), t) {
            Some(r) => [Some(Ok(r)), None],
            None => [Some(want(ix, Slot::Compute(C::F), Task::new(t.stage - 1, t.mb))), None],
        },
        Slot::Compute(C::F) => [None, None],
        Slot::Compute(C::B | C::I) => {
            let own = Some(want(ix, Slot::Compute(C::F), t));
            if t.stage + 1 >= route.end {
                return [own, None];
            }
            match ix.get(Slot::Comm(CommKind::RecvB), t) {
                Some(r) => [own, Some(Ok(r))],
                None => [own, Some(want_bw(ix, Task::new(t.stage + 1, t.mb)))],
            }
        }
        Slot::Compute(C::W) => [Some(want(ix, Slot::Compute(C::I), t)), None],
        Slot::Comm(CommKind::SendF) => [Some(want(ix, Slot::Compute(C::F), t)), None],
        Slot::Comm(CommKind::SendB) => [Some(want_bw(ix, t)), None],
        Slot::Comm(CommKind::RecvF) if t.stage == 0 => [Some(Err(Missing::SendIntoStage0(t.mb))), None],
        Slot::Comm(CommKind::RecvF) => {
            let prev = Task::new(t.stage - 1, t.mb);
            match ix.get(Slot::Comm(CommKind::SendF), prev) {
                Some(s) => [Some(Ok(s)), None],
                None => [
                    Some(
                        ix.get(Slot::Compute(C::F), prev)
                            .ok_or(Missing::One(Slot::Comm(CommKind::SendF), prev)),
                    ),
                    None,
                ],
            }
        }
        // A send completes once its peer has received it.
        Slot::Comm(CommKind::WaitSendF) => [
            Some(want(ix, Slot::Comm(CommKind::SendF), t)),
            Some(want(ix, Slot::Comm(CommKind::RecvF), Task::new(t.stage + 1, t.mb))),
        ],
        Slot::Comm(CommKind::WaitSendB) if t.stage == 0 => {
            [Some(want(ix, Slot::Comm(CommKind::SendB), t)), None]
        }
        Slot::Comm(CommKind::WaitSendB) => [
            Some(want(ix, Slot::Comm(CommKind::SendB), t)),
            Some(want(ix, Slot::Comm(CommKind::RecvB), Task::new(t.stage - 1, t.mb))),
        ],
        Slot::Comm(CommKind::RecvB) => {
            let next = Task::new(t.stage + 1, t.mb);
            match ix.get(Slot::Comm(CommKind::SendB), next) {
                Some(s) => [Some(Ok(s)), None],
                None => {
                    [Some(ix.backward(next).ok_or(Missing::One(Slot::Comm(CommKind::SendB), next))), None]
                }
            }
        }
    }
}

/// The (slot, task) halves of an action: one, two for OVERLAP_F_B, none for stage-level actions.
#[inline]
fn halves(a: &Action) -> [Option<(Slot, Task)>; 2] {
    match *a {
        Action::Compute { kind, task } => [Some((Slot::Compute(kind), task)), None],
        Action::Overlap { f, b } => {
            [Some((Slot::Compute(ComputeKind::F), f)), Some((Slot::Compute(ComputeKind::B), b))]
        }
        Action::Comm { kind, task } => [Some((Slot::Comm(kind), task)), None],
        Action::StageOp { .. } => [None, None],
    }
}

/// `offsets[r]..offsets[r + 1]` are rank r's global indices; the rank of each global index.
fn rank_of(offsets: &[usize]) -> Vec<u32> {
    let mut out = Vec::with_capacity(offsets.last().copied().unwrap_or(0));
    for (r, w) in offsets.windows(2).enumerate() {
        out.resize(w[1], r as u32);
    }
    out
}

/// Global starts of each row's cells and the total (`offsets[p]`).
fn offsets_of<C>(rows: &[Vec<C>]) -> Vec<usize> {
    let mut offsets = Vec::with_capacity(rows.len() + 1);
    let mut n = 0;
    for row in rows {
        offsets.push(n);
        n += row.len();
    }
    offsets.push(n);
    offsets
}

/// One rank's producer lists (global cell indexes), for [`Walk::with_index`].
struct RankProducers {
    /// `ends[i]..ends[i + 1]`: the producers of the rank's cell i in `producers` (`ends[0]` = 0).
    ends: Vec<u32>,
    /// The producers of the rank's actions, in step order.
    producers: Vec<u32>,
    /// Some action's producer is absent.
    missing: bool,
}

impl RankProducers {
    /// Lists the producers of `row`, rank `rank`'s cells.
    fn of(
        row: &[Step],
        rank: RankId,
        offsets: &[usize],
        ix: &Index,
        routes: &[Option<Range<usize>>],
    ) -> Self {
        let mut out = RankProducers {
            ends: Vec::with_capacity(row.len() + 1),
            producers: Vec::with_capacity(row.len() + row.len() / 2),
            missing: false,
        };
        out.ends.push(0);
        for (index, cell) in row.iter().enumerate() {
            if let Some(a) = cell {
                out.missing |= !out.list(a, Pos::new(rank, index), offsets, ix, routes);
            }
            out.ends.push(out.producers.len() as u32);
        }
        out
    }

    /// Appends the producers of action `a` at `me`; false if one is absent.
    fn list(
        &mut self,
        a: &Action,
        me: Pos,
        offsets: &[usize],
        ix: &Index,
        routes: &[Option<Range<usize>>],
    ) -> bool {
        for (slot, t) in halves(a).into_iter().flatten() {
            let Some(route) = &routes[t.mb] else { return false };
            for need in needs_of(slot, t, ix, route).into_iter().flatten() {
                match need {
                    Ok(p) if p == me => {}
                    Ok(p) => self.producers.push((offsets[p.rank as usize] + p.index as usize) as u32),
                    Err(_) => return false,
                }
            }
        }
        true
    }
}

/// Runs a schedule's programs under blocking semantics without building a [`DepGraph`]: each
/// rank runs until an action needs an unfinished producer and resumes once the producer has run.
/// Linear in the number of cells (plus, per rank that advances, a look at its few waiters). The
/// producers are listed first, rank by rank, as global cell indexes, so the run reads them in
/// order.
pub(crate) struct Walk<'a> {
    rows: &'a [Vec<Step>],
    /// Global index of each rank's first cell (idle cells counted); `offsets[p]` = cells.
    offsets: Vec<usize>,
    /// Each rank's producer lists.
    lists: Vec<RankProducers>,
    /// Some action's producer is absent.
    missing: bool,
    /// The routes of every microbatch (see [`routes`]).
    pub routes: Vec<Option<Range<usize>>>,
}

/// What [`Walk::run`] ran: `(rank, from, to)` for each stretch of steps `from..to` a rank ran
/// without waiting, in the order the stretches ran (every producer before its consumer).
pub(crate) type RunOrder = Vec<[u32; 3]>;

impl<'a> Walk<'a> {
    /// Lists the producers of every action of `s`.
    pub fn new(s: &'a Schedule) -> Self {
        Self::with_routes(s, routes_of(s.ranks.iter().flatten().flatten()))
    }

    /// [`Walk::new`] given the routes of `s` (see [`routes`]: every task any action names).
    pub fn with_routes(s: &'a Schedule, routes: Vec<Option<Range<usize>>>) -> Self {
        let ix = Index::with_routes(&s.ranks, &routes);
        Self::with_index(s, routes, &ix)
    }

    /// [`Walk::with_routes`] given the producer tables of `s` as well (the validator's). The
    /// ranks' producer lists are built in parallel (rayon's current pool).
    pub fn with_index(s: &'a Schedule, routes: Vec<Option<Range<usize>>>, ix: &Index) -> Self {
        let offsets = offsets_of(&s.ranks);
        // Global cell indexes are u32: 2^32 cells of 40 B would be 170 GB of schedule.
        debug_assert!(offsets[s.ranks.len()] < u32::MAX as usize, "more cells than a u32 indexes");
        let lists: Vec<RankProducers> = s
            .ranks
            .par_iter()
            .enumerate()
            .map(|(rank, row)| RankProducers::of(row, rank, &offsets, ix, &routes))
            .collect();
        let missing = lists.iter().any(|l| l.missing);
        Walk { rows: &s.ranks, lists, offsets, missing, routes }
    }

    /// Number of cells, idle ones included.
    pub fn cells(&self) -> usize {
        self.offsets[self.rows.len()]
    }

    /// The global cell indexes of rank `r`'s cells.
    #[inline]
    pub fn row(&self, r: RankId) -> Range<usize> {
        self.offsets[r]..self.offsets[r + 1]
    }

    /// The position of a global cell index.
    fn pos(&self, g: usize) -> Pos {
        // The last rank starting at or before g: an empty rank shares its start with the next.
        let rank = self.offsets.partition_point(|&o| o <= g) - 1;
        Pos::new(rank, g - self.offsets[rank])
    }

    /// The producers (global cell indexes) of rank `r`'s cell `step`.
    #[inline]
    pub fn producers_of(&self, r: RankId, step: usize) -> &[u32] {
        let l = &self.lists[r];
        &l.producers[l.ends[step] as usize..l.ends[step + 1] as usize]
    }

    /// Runs rank `r` from `pc[r]` on until it ends (`None`) or waits (the producer it waits for,
    /// a global index); `done[g]` tells whether cell g has run.
    fn advance<F>(&self, r: RankId, pc: &mut [usize], done: &mut [bool], visit: &mut F) -> Option<usize>
    where
        F: FnMut(RankId, usize, &Action, &[u32]),
    {
        let row = &self.rows[r];
        let base = self.offsets[r];
        while let Some(cell) = row.get(pc[r]) {
            let g = base + pc[r];
            if let Some(a) = cell {
                let producers = self.producers_of(r, pc[r]);
                if let Some(&p) = producers.iter().find(|&&p| !done[p as usize]) {
                    return Some(p as usize);
                }
                visit(r, pc[r], a, producers);
            }
            done[g] = true;
            pc[r] += 1;
        }
        None
    }

    /// Calls `visit(rank, step, action, producers)` for each action of the stretches of `order`
    /// (what [`Walk::run_order`] returned, so every producer comes before its consumer).
    pub fn replay<F>(&self, order: &[[u32; 3]], mut visit: F)
    where
        F: FnMut(RankId, usize, &Action, &[u32]),
    {
        for &[r, from, to] in order {
            let r = r as usize;
            for step in from as usize..to as usize {
                if let Some(a) = &self.rows[r][step] {
                    visit(r, step, a, self.producers_of(r, step));
                }
            }
        }
    }

    /// Runs every rank to its end, calling `visit(rank, step, action, producers)` for each action
    /// after all its producers (global cell indexes). Returns true when every action ran: every
    /// producer exists and the ranks do not deadlock, which is what [`DepGraph::build`] and
    /// [`DepGraph::topo_order`] check.
    pub fn run<F>(&self, visit: F) -> bool
    where
        F: FnMut(RankId, usize, &Action, &[u32]),
    {
        self.run_stretches(visit, |_, _, _| {})
    }

    /// [`Walk::run`] with no visit, returning the order it ran the cells in when every action ran.
    pub fn run_order(&self) -> Option<RunOrder> {
        let mut order = RunOrder::new();
        let ran = self.run_stretches(
            |_, _, _, _| {},
            |r, from, to| {
                if to > from {
                    order.push([r as u32, from as u32, to as u32]);
                }
            },
        );
        ran.then_some(order)
    }

    /// [`Walk::run`], also calling `stretch(rank, from, to)` after each stretch of steps a rank ran.
    fn run_stretches<F, G>(&self, mut visit: F, mut stretch: G) -> bool
    where
        F: FnMut(RankId, usize, &Action, &[u32]),
        G: FnMut(RankId, usize, usize),
    {
        if self.missing {
            return false;
        }
        let p = self.rows.len();
        let mut pc = vec![0usize; p];
        let mut done = vec![false; self.cells()];
        let mut waits_for = vec![0usize; p];
        let mut waiters: Vec<Vec<RankId>> = vec![Vec::new(); p];
        let mut ready: Vec<RankId> = (0..p).rev().collect();
        while let Some(r) = ready.pop() {
            let from = pc[r];
            let blocked = self.advance(r, &mut pc, &mut done, &mut visit);
            stretch(r, from, pc[r]);
            if let Some(on) = blocked.map(|g| self.pos(g)) {
                waits_for[r] = on.index as usize;
                waiters[on.rank as usize].push(r);
            }
            let mut still = std::mem::take(&mut waiters[r]);
            still.retain(|&w| {
                let go = waits_for[w] < pc[r];
                if go {
                    ready.push(w);
                }
                !go
            });
            waiters[r] = still;
        }
        (0..p).all(|r| pc[r] == self.rows[r].len())
    }
}

impl DepGraph {
    /// Builds the dependency graph.
    ///
    /// # Errors
    /// [`MissingDep`] for the first action (rank by rank) whose producer no rank runs.
    pub fn build(schedule: &Schedule) -> Result<DepGraph, MissingDep> {
        let mut programs = Vec::with_capacity(schedule.num_ranks());
        let mut steps = Vec::with_capacity(schedule.num_ranks());
        for p in &schedule.ranks {
            let (a, s): (Vec<Action>, Vec<usize>) =
                p.iter().enumerate().filter_map(|(i, s)| s.map(|a| (a, i))).unzip();
            programs.push(a);
            steps.push(s);
        }
        let offsets = offsets_of(&programs);
        let n = offsets[programs.len()];
        let (ix, routes) = Index::new(&programs);
        let mut g = DepGraph {
            programs,
            steps,
            rank_of: rank_of(&offsets),
            offsets,
            dep_start: Vec::with_capacity(n + 1),
            dep_list: Vec::with_capacity(2 * n),
        };
        g.dep_start.push(0);
        for rank in 0..g.programs.len() {
            for index in 0..g.programs[rank].len() {
                let a = g.programs[rank][index];
                let me = Pos::new(rank, index);
                for (slot, t) in halves(&a).into_iter().flatten() {
                    let route = routes[t.mb].clone().expect("a named microbatch has a route");
                    for need in needs_of(slot, t, &ix, &route).into_iter().flatten() {
                        let on = need.map_err(|missing| MissingDep {
                            rank,
                            step: g.steps[rank][index],
                            action: a,
                            needs: missing.text(),
                        })?;
                        if on != me {
                            let on = ActionRef { rank: on.rank as usize, index: on.index as usize };
                            g.dep_list.push(Dep { on, hop: on.rank != rank });
                        }
                    }
                }
                g.dep_start.push(g.dep_list.len() as u32);
            }
        }
        Ok(g)
    }

    /// Global index of an action (rank-major).
    pub fn global(&self, at: ActionRef) -> usize {
        self.offsets[at.rank] + at.index
    }

    /// The action reference of a global index.
    pub fn at(&self, global: usize) -> ActionRef {
        let rank = self.rank_of[global] as usize;
        ActionRef { rank, index: global - self.offsets[rank] }
    }

    /// The data dependencies of `at` (program order not included).
    pub fn deps(&self, at: ActionRef) -> &[Dep] {
        let g = self.global(at);
        &self.dep_list[self.dep_start[g] as usize..self.dep_start[g + 1] as usize]
    }

    /// Every data dependency of every action.
    pub fn all_deps(&self) -> &[Dep] {
        &self.dep_list
    }

    /// The action at `at`.
    pub fn action(&self, at: ActionRef) -> Action {
        self.programs[at.rank][at.index]
    }

    /// Total number of actions.
    pub fn len(&self) -> usize {
        *self.offsets.last().unwrap_or(&0)
    }

    /// True when no rank has an action.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A topological order of all actions respecting program order and data dependencies
    /// (Kahn's algorithm), or the waiting cycle when there is none: `(waiting, waited_on)` pairs,
    /// one per cross-rank wait of the cycle, each on a different rank than the next.
    pub fn topo_order(&self) -> Result<Vec<ActionRef>, Vec<(ActionRef, ActionRef)>> {
        let n = self.len();
        // In-degrees: data deps plus the program-order predecessor.
        let mut indeg: Vec<u32> = (0..n).map(|g| self.dep_start[g + 1] - self.dep_start[g]).collect();
        for r in 0..self.programs.len() {
            // Every action of the rank but its first (none for an empty rank).
            let later = indeg.get_mut(self.offsets[r] + 1..self.offsets[r + 1]).unwrap_or_default();
            later.iter_mut().for_each(|d| *d += 1);
        }
        // Successors of data deps in CSR form.
        let mut succ_start = vec![0u32; n + 1];
        for d in &self.dep_list {
            succ_start[self.global(d.on) + 1] += 1;
        }
        for g in 0..n {
            succ_start[g + 1] += succ_start[g];
        }
        let mut fill = succ_start.clone();
        let mut succ = vec![0u32; self.dep_list.len()];
        for g in 0..n {
            for d in &self.dep_list[self.dep_start[g] as usize..self.dep_start[g + 1] as usize] {
                let on = self.global(d.on);
                succ[fill[on] as usize] = g as u32;
                fill[on] += 1;
            }
        }
        // The first action of each non-empty program (an empty rank's offset is the next rank's
        // start, which must not be listed twice).
        let mut ready: Vec<usize> = (0..self.programs.len())
            .filter(|&r| self.offsets[r] < self.offsets[r + 1])
            .map(|r| self.offsets[r])
            .filter(|&g| indeg[g] == 0)
            .collect();
        let mut order = Vec::with_capacity(n);
        while let Some(g) = ready.pop() {
            let at = self.at(g);
            order.push(at);
            let next = (at.index + 1 < self.programs[at.rank].len()).then_some(g + 1);
            for s in succ[succ_start[g] as usize..succ_start[g + 1] as usize]
                .iter()
                .map(|&s| s as usize)
                .chain(next)
            {
                indeg[s] -= 1;
                if indeg[s] == 0 {
                    ready.push(s);
                }
            }
        }
        if order.len() == n {
            return Ok(order);
        }
        Err(self.find_cycle(&indeg))
    }

    /// Follows unfinished predecessors from a blocked action until one repeats.
    fn find_cycle(&self, indeg: &[u32]) -> Vec<(ActionRef, ActionRef)> {
        let blocked = |a: ActionRef| indeg[self.global(a)] > 0;
        let start =
            (0..self.len()).map(|g| self.at(g)).find(|&a| blocked(a)).expect("Kahn left a blocked action");
        let mut path = vec![start];
        let mut seen = std::collections::HashMap::from([(start, 0usize)]);
        let mut cur = start;
        loop {
            // The earlier action on the rank if it is still blocked, else a blocked data dep.
            let prev = (cur.index > 0 && blocked(ActionRef { rank: cur.rank, index: cur.index - 1 }))
                .then(|| ActionRef { rank: cur.rank, index: cur.index - 1 });
            let next = prev
                .or_else(|| self.deps(cur).iter().map(|d| d.on).find(|&a| blocked(a)))
                .expect("a blocked action waits on a blocked action");
            if let Some(&i) = seen.get(&next) {
                return cross_rank_waits(path.split_off(i));
            }
            seen.insert(next, path.len());
            path.push(next);
            cur = next;
        }
    }
}

/// Reduces a cycle of actions (each waits on the next, the last on the first) to its cross-rank
/// waits: `(a, b)` where `a` waits on `b` and `b` runs on another rank. A cycle within one rank
/// (an action waiting on a later action of its own rank) is kept as its one self-rank wait.
fn cross_rank_waits(cycle: Vec<ActionRef>) -> Vec<(ActionRef, ActionRef)> {
    let n = cycle.len();
    let pairs: Vec<(ActionRef, ActionRef)> = (0..n).map(|i| (cycle[i], cycle[(i + 1) % n])).collect();
    let mut cross: Vec<_> = pairs.iter().copied().filter(|(a, b)| a.rank != b.rank).collect();
    if cross.is_empty() {
        return pairs.into_iter().filter(|(a, b)| b.index > a.index).take(1).collect();
    }
    // Canonical start: the wait whose waiting action has the lowest (rank, index).
    let first = (0..cross.len()).min_by_key(|&i| cross[i].0).unwrap_or(0);
    cross.rotate_left(first);
    cross
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(csv: &str) -> Schedule {
        Schedule::from_csv(csv).unwrap()
    }

    #[test]
    fn compute_only_edges() {
        let g = DepGraph::build(&sched("0F0,0B0\n1F0,1B0\n")).unwrap();
        assert_eq!(
            g.deps(ActionRef { rank: 1, index: 0 }),
            [Dep { on: ActionRef { rank: 0, index: 0 }, hop: true }]
        );
        assert_eq!(g.deps(ActionRef { rank: 0, index: 1 }).len(), 2); // own F, and 1B0
        assert!(g
            .deps(ActionRef { rank: 0, index: 1 })
            .contains(&Dep { on: ActionRef { rank: 1, index: 1 }, hop: true }));
        assert!(g.topo_order().is_ok());
    }

    #[test]
    fn missing_producer_named() {
        let e = DepGraph::build(&sched("0F0,0B0\n1F0,,1B0\n2B0\n")).unwrap_err();
        assert_eq!((e.rank, e.step, e.needs.as_str()), (2, 0, "2F0"));
    }

    #[test]
    fn two_rank_cycle_found() {
        // Rank 0 runs 0B0 before 0F1; rank 1 needs 0F1 before it can produce 1B1... build a real
        // cycle: rank 0 waits for 1B0 first, rank 1 waits for 0F1 (after rank 0's 0B0).
        let g = DepGraph::build(&sched("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n")).unwrap();
        let cycle = g.topo_order().unwrap_err();
        let mut waits: Vec<(String, String)> =
            cycle.iter().map(|(a, b)| (g.action(*a).to_string(), g.action(*b).to_string())).collect();
        waits.sort();
        assert_eq!(waits, vec![("0B0".into(), "1B0".into()), ("1F1".into(), "0F1".into())]);
    }

    #[test]
    fn an_empty_rank_between_two_is_ordered_once() {
        // Rank 1 has no cells: its offset is rank 2's start, which Kahn's queue once held twice.
        let mut s = sched("1F0,1B0\n\n0F0,0B0\n");
        s.ranks[1].clear();
        let g = DepGraph::build(&s).unwrap();
        let order = g.topo_order().unwrap();
        let texts: Vec<String> = order.iter().map(|&a| g.action(a).to_string()).collect();
        assert_eq!(texts, ["0F0", "1F0", "1B0", "0B0"]);
    }

    #[test]
    fn lowered_edges_go_through_recv() {
        let g = DepGraph::build(&sched("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n")).unwrap();
        // 1F0 waits on its local RECV, which waits on 0SEND_F0.
        assert_eq!(
            g.deps(ActionRef { rank: 1, index: 1 }),
            [Dep { on: ActionRef { rank: 1, index: 0 }, hop: false }]
        );
        assert_eq!(
            g.deps(ActionRef { rank: 1, index: 0 }),
            [Dep { on: ActionRef { rank: 0, index: 1 }, hop: true }]
        );
        assert!(g.topo_order().is_ok());
    }
}
