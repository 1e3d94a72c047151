//! Cross-rank dependencies of a schedule and their topological order.
//!
//! The dependency rules are DESIGN.md's ("Validation"): F(s,j) needs F(s−1,j); B/I(s,j) needs
//! B/I(s+1,j), and the last stage of a microbatch's route needs its own F(s,j); W(s,j) needs I(s,j).
//! In a lowered schedule the cross-rank edges go through SEND/RECV: a compute action whose input
//! comes from another rank waits for its rank's RECV, and the RECV waits for the peer's SEND
//! (blocking RECV semantics). Each rank also runs its program in order. Both the validator's
//! deadlock check and the simulator walk this graph.

use std::collections::HashMap;
use std::ops::Range;

use crate::action::{Action, CommKind, ComputeKind, Task};
use crate::schedule::{RankId, Schedule};

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
    /// `deps[r][i]`: the data dependencies of `programs[r][i]` (program order not included).
    pub deps: Vec<Vec<Vec<Dep>>>,
}

/// Routes of all microbatches (see [`Schedule::route`]), computed in one pass; `None` for a
/// microbatch that no action names.
pub fn routes(programs: &[Vec<Action>]) -> Vec<Option<Range<usize>>> {
    let mut r: Vec<Option<Range<usize>>> = Vec::new();
    for a in programs.iter().flatten() {
        for t in tasks_of(a) {
            if r.len() <= t.mb {
                r.resize(t.mb + 1, None);
            }
            r[t.mb] = Some(match r[t.mb].take() {
                None => t.stage..t.stage + 1,
                Some(x) => x.start.min(t.stage)..x.end.max(t.stage + 1),
            });
        }
    }
    r
}

/// The (stage, microbatch) tasks an action names.
pub fn tasks_of(a: &Action) -> impl Iterator<Item = Task> {
    let (x, y) = match *a {
        Action::Compute { task, .. } | Action::Comm { task, .. } => (Some(task), None),
        Action::Overlap { f, b } => (Some(f), Some(b)),
        Action::StageOp { .. } => (None, None),
    };
    x.into_iter().chain(y)
}

#[derive(Default)]
struct Index {
    compute: HashMap<(ComputeKind, Task), ActionRef>,
    comm: HashMap<(CommKind, Task), ActionRef>,
}

impl Index {
    fn new(programs: &[Vec<Action>]) -> Self {
        let mut ix = Index::default();
        for (rank, p) in programs.iter().enumerate() {
            for (index, a) in p.iter().enumerate() {
                let at = ActionRef { rank, index };
                for (k, t) in a.computes() {
                    ix.compute.entry((k, t)).or_insert(at);
                }
                if let Action::Comm { kind, task } = *a {
                    ix.comm.entry((kind, task)).or_insert(at);
                }
            }
        }
        ix
    }
    /// The backward-like action (B, else I) of a task.
    fn backward(&self, t: Task) -> Option<ActionRef> {
        self.compute.get(&(ComputeKind::B, t)).or_else(|| self.compute.get(&(ComputeKind::I, t))).copied()
    }
}

/// What one compute or comm half of an action needs: `Ok(producer)` or `Err(needs text)`.
type Need = Result<ActionRef, String>;

fn needs_of(kind_task: Needy, ix: &Index, route: &Range<usize>) -> Vec<Need> {
    let found = |x: Option<&ActionRef>, what: String| x.copied().ok_or(what);
    let bw = |t: Task| ix.backward(t).ok_or(format!("{}B{} or {}I{}", t.stage, t.mb, t.stage, t.mb));
    match kind_task {
        Needy::Compute(ComputeKind::F, t) if t.stage > route.start => {
            let prev = Task::new(t.stage - 1, t.mb);
            match ix.comm.get(&(CommKind::RecvF, t)) {
                Some(r) => vec![Ok(*r)],
                None => vec![found(
                    ix.compute.get(&(ComputeKind::F, prev)),
                    format!("{}F{}", prev.stage, prev.mb),
                )],
            }
        }
        Needy::Compute(ComputeKind::F, _) => vec![],
        Needy::Compute(ComputeKind::B | ComputeKind::I, t) => {
            let own = found(ix.compute.get(&(ComputeKind::F, t)), format!("{}F{}", t.stage, t.mb));
            if t.stage + 1 >= route.end {
                return vec![own];
            }
            let next = Task::new(t.stage + 1, t.mb);
            match ix.comm.get(&(CommKind::RecvB, t)) {
                Some(r) => vec![own, Ok(*r)],
                None => vec![own, bw(next)],
            }
        }
        Needy::Compute(ComputeKind::W, t) => {
            vec![found(ix.compute.get(&(ComputeKind::I, t)), format!("{}I{}", t.stage, t.mb))]
        }
        Needy::Comm(CommKind::SendF, t) => {
            vec![found(ix.compute.get(&(ComputeKind::F, t)), format!("{}F{}", t.stage, t.mb))]
        }
        Needy::Comm(CommKind::SendB, t) => vec![bw(t)],
        Needy::Comm(CommKind::RecvF, t) if t.stage == 0 => {
            vec![Err(format!("a SEND_F{} from a stage before stage 0", t.mb))]
        }
        Needy::Comm(CommKind::RecvF, t) => {
            let prev = Task::new(t.stage - 1, t.mb);
            match ix.comm.get(&(CommKind::SendF, prev)) {
                Some(s) => vec![Ok(*s)],
                None => vec![found(
                    ix.compute.get(&(ComputeKind::F, prev)),
                    format!("{}SEND_F{}", prev.stage, prev.mb),
                )],
            }
        }
        Needy::Comm(CommKind::RecvB, t) => {
            let next = Task::new(t.stage + 1, t.mb);
            match ix.comm.get(&(CommKind::SendB, next)) {
                Some(s) => vec![Ok(*s)],
                None => vec![ix.backward(next).ok_or(format!("{}SEND_B{}", next.stage, next.mb))],
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Needy {
    Compute(ComputeKind, Task),
    Comm(CommKind, Task),
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
        let ix = Index::new(&programs);
        let routes = routes(&programs);
        let mut deps = Vec::with_capacity(programs.len());
        for (rank, p) in programs.iter().enumerate() {
            let mut rd = Vec::with_capacity(p.len());
            for (index, a) in p.iter().enumerate() {
                let needy: Vec<Needy> = match *a {
                    Action::Compute { kind, task } => vec![Needy::Compute(kind, task)],
                    Action::Overlap { f, b } => {
                        vec![Needy::Compute(ComputeKind::F, f), Needy::Compute(ComputeKind::B, b)]
                    }
                    Action::Comm { kind, task } => vec![Needy::Comm(kind, task)],
                    Action::StageOp { .. } => vec![],
                };
                let mut d = Vec::new();
                for n in needy {
                    let t = match n {
                        Needy::Compute(_, t) | Needy::Comm(_, t) => t,
                    };
                    let route = routes[t.mb].clone().expect("a named microbatch has a route");
                    for need in needs_of(n, &ix, &route) {
                        let on = need.map_err(|needs| MissingDep {
                            rank,
                            step: steps[rank][index],
                            action: *a,
                            needs,
                        })?;
                        if on != (ActionRef { rank, index }) {
                            d.push(Dep { on, hop: on.rank != rank });
                        }
                    }
                }
                rd.push(d);
            }
            deps.push(rd);
        }
        Ok(DepGraph { programs, steps, deps })
    }

    /// The action at `at`.
    pub fn action(&self, at: ActionRef) -> Action {
        self.programs[at.rank][at.index]
    }

    /// Total number of actions.
    pub fn len(&self) -> usize {
        self.programs.iter().map(Vec::len).sum()
    }

    /// True when no rank has an action.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A topological order of all actions respecting program order and data dependencies
    /// (Kahn's algorithm), or the waiting cycle when there is none: `(waiting, waited_on)` pairs,
    /// one per cross-rank wait of the cycle, each on a different rank than the next.
    pub fn topo_order(&self) -> Result<Vec<ActionRef>, Vec<(ActionRef, ActionRef)>> {
        let n_r = self.programs.len();
        // Successor lists of data deps; program order is implicit.
        let mut indeg: Vec<Vec<usize>> = self.deps.iter().map(|r| r.iter().map(Vec::len).collect()).collect();
        let mut succ: Vec<Vec<Vec<ActionRef>>> =
            self.programs.iter().map(|p| vec![Vec::new(); p.len()]).collect();
        for (rank, rd) in self.deps.iter().enumerate() {
            for (index, d) in rd.iter().enumerate() {
                for dep in d {
                    succ[dep.on.rank][dep.on.index].push(ActionRef { rank, index });
                }
            }
        }
        for r in indeg.iter_mut() {
            r.iter_mut().skip(1).for_each(|d| *d += 1);
        }
        let mut ready: Vec<ActionRef> = (0..n_r)
            .filter(|&r| !self.programs[r].is_empty() && indeg[r][0] == 0)
            .map(|r| ActionRef { rank: r, index: 0 })
            .collect();
        let mut order = Vec::with_capacity(self.len());
        while let Some(at) = ready.pop() {
            order.push(at);
            let next = (at.index + 1 < self.programs[at.rank].len())
                .then_some(ActionRef { rank: at.rank, index: at.index + 1 });
            for s in succ[at.rank][at.index].iter().copied().chain(next) {
                indeg[s.rank][s.index] -= 1;
                if indeg[s.rank][s.index] == 0 {
                    ready.push(s);
                }
            }
        }
        if order.len() == self.len() {
            return Ok(order);
        }
        Err(self.find_cycle(&indeg))
    }

    /// Follows unfinished predecessors from a blocked action until one repeats.
    fn find_cycle(&self, indeg: &[Vec<usize>]) -> Vec<(ActionRef, ActionRef)> {
        let blocked = |a: ActionRef| indeg[a.rank][a.index] > 0;
        // Start at the first blocked action of the first rank that has one.
        let start = (0..self.programs.len())
            .find_map(|r| {
                (0..self.programs[r].len()).map(|i| ActionRef { rank: r, index: i }).find(|&a| blocked(a))
            })
            .expect("Kahn left a blocked action");
        let mut path = vec![start];
        let mut seen: HashMap<ActionRef, usize> = HashMap::from([(start, 0)]);
        let mut cur = start;
        loop {
            // The first earlier action on the rank that is still blocked, else a blocked data dep.
            let prev = (cur.index > 0 && blocked(ActionRef { rank: cur.rank, index: cur.index - 1 }))
                .then(|| ActionRef { rank: cur.rank, index: cur.index - 1 });
            let next = prev
                .or_else(|| self.deps[cur.rank][cur.index].iter().map(|d| d.on).find(|&a| blocked(a)))
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
/// waits: `(a, b)` where `a` waits on `b` and `b` runs on another rank, rotated so that the first
/// pair's waiting action has the lowest (rank, index). A cycle within one rank (an action waiting
/// on a later action of its own rank) is kept as its one self-rank wait.
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
        assert_eq!(g.deps[1][0], vec![Dep { on: ActionRef { rank: 0, index: 0 }, hop: true }]);
        assert_eq!(g.deps[0][1].len(), 2); // own F, and 1B0
        assert!(g.deps[0][1].contains(&Dep { on: ActionRef { rank: 1, index: 1 }, hop: true }));
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
    fn lowered_edges_go_through_recv() {
        let g = DepGraph::build(&sched("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n")).unwrap();
        // 1F0 waits on its local RECV, which waits on 0SEND_F0.
        assert_eq!(g.deps[1][1], vec![Dep { on: ActionRef { rank: 1, index: 0 }, hop: false }]);
        assert_eq!(g.deps[1][0], vec![Dep { on: ActionRef { rank: 0, index: 1 }, hop: true }]);
        assert!(g.topo_order().is_ok());
    }
}
