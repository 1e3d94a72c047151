//! The global training DAG of one step (Piper's "one training DAG"): every
//! compute and communication action of every rank's lowered program as a node — with the stage
//! graph a compute action runs — and every dependency as an edge: program order within a rank,
//! data dependencies within a rank, and hops between ranks (a SEND's RECV, an activation or
//! gradient handed over). Built from the schedule's dependency graph
//! ([`graphpp_schedule::deps::DepGraph`]); printed as text, Graphviz DOT or JSON.

use std::fmt::Write as _;

use graphpp_graph::GraphKind;
use graphpp_schedule::deps::{ActionRef, DepGraph, MissingDep};
use graphpp_schedule::{Action, ComputeKind, Schedule, StageOpKind};
use serde::Serialize;

/// What a dependency edge is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EdgeKind {
    /// The next action of the same rank's program.
    Program,
    /// A data dependency within one rank (F before its B, I before its W, …).
    Data,
    /// A data dependency across ranks: one hop between them.
    Hop,
}

/// One action of one rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DagNode {
    /// Node id: rank-major over the programs without idle steps.
    pub id: usize,
    /// The rank.
    pub rank: usize,
    /// Position in the rank's program (idle steps left out).
    pub index: usize,
    /// The action, in schedule text (`0F1`, `1SEND_B0`, `2REDUCE_GRAD`).
    pub action: String,
    /// What runs: a stage graph (`fw`, `full_bw`, `bw_di`, `bw_dw`, `overlap`), a collective
    /// (`all_gather` for UNSHARD, `reduce` for REDUCE_GRAD), or nothing.
    pub runs: Option<&'static str>,
}

/// One dependency: `to` waits for `from`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DagEdge {
    /// The node that finishes first.
    pub from: usize,
    /// The node that waits.
    pub to: usize,
    /// What kind of dependency.
    pub kind: EdgeKind,
}

/// The DAG of one training step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainingDag {
    /// Ranks.
    pub ranks: usize,
    /// Every action.
    pub nodes: Vec<DagNode>,
    /// Every dependency.
    pub edges: Vec<DagEdge>,
}

/// What `a` runs, where stage `s` has the dI/dW split when `split(s)` (a model's first stage has
/// none: its I keeps its inputs and its W runs the full backward).
fn runs(a: &Action, split: &dyn Fn(usize) -> bool) -> Option<&'static str> {
    Some(match *a {
        Action::Compute { kind, task } => match (kind, split(task.stage)) {
            (ComputeKind::F, _) => GraphKind::Fw.name(),
            (ComputeKind::B, _) | (ComputeKind::W, false) => GraphKind::FullBw.name(),
            (ComputeKind::I, true) => GraphKind::BwDi.name(),
            (ComputeKind::I, false) => return None,
            (ComputeKind::W, true) => GraphKind::BwDw.name(),
        },
        Action::Overlap { .. } => GraphKind::Overlap.name(),
        Action::StageOp { kind: StageOpKind::Unshard, .. } => "all_gather",
        Action::StageOp { kind: StageOpKind::ReduceGrad, .. } => "reduce",
        Action::Comm { .. } | Action::StageOp { .. } => return None,
    })
}

impl TrainingDag {
    /// The DAG of `schedule` (compute-only or lowered); `split(s)` tells whether stage `s` has the
    /// dI/dW split.
    ///
    /// # Errors
    /// [`MissingDep`] for an action whose producer no rank runs.
    pub fn of(schedule: &Schedule, split: &dyn Fn(usize) -> bool) -> Result<TrainingDag, MissingDep> {
        let g = DepGraph::build(schedule)?;
        let mut nodes = Vec::with_capacity(g.len());
        let mut edges = Vec::new();
        for (rank, program) in g.programs.iter().enumerate() {
            for (index, a) in program.iter().enumerate() {
                let at = ActionRef { rank, index };
                let id = g.global(at);
                nodes.push(DagNode { id, rank, index, action: a.to_string(), runs: runs(a, split) });
                if index > 0 {
                    edges.push(DagEdge { from: id - 1, to: id, kind: EdgeKind::Program });
                }
                for d in g.deps(at) {
                    let kind = if d.hop { EdgeKind::Hop } else { EdgeKind::Data };
                    edges.push(DagEdge { from: g.global(d.on), to: id, kind });
                }
            }
        }
        Ok(TrainingDag { ranks: schedule.num_ranks(), nodes, edges })
    }

    /// Edges of `kind`.
    pub fn count(&self, kind: EdgeKind) -> usize {
        self.edges.iter().filter(|e| e.kind == kind).count()
    }

    fn label(n: &DagNode) -> String {
        match n.runs {
            Some(r) => format!("{}[{r}]", n.action),
            None => n.action.clone(),
        }
    }

    /// One line per rank (its program, each action with what it runs), then the edge counts and
    /// every hop.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        for r in 0..self.ranks {
            let prog: Vec<String> = self.nodes.iter().filter(|n| n.rank == r).map(Self::label).collect();
            let _ = writeln!(out, "rank {r}: {}", prog.join(" "));
        }
        let _ = writeln!(
            out,
            "{} actions; {} program-order, {} same-rank data and {} cross-rank edges",
            self.nodes.len(),
            self.count(EdgeKind::Program),
            self.count(EdgeKind::Data),
            self.count(EdgeKind::Hop)
        );
        for e in self.edges.iter().filter(|e| e.kind == EdgeKind::Hop) {
            let (a, b) = (&self.nodes[e.from], &self.nodes[e.to]);
            let _ = writeln!(out, "hop: rank {} {} -> rank {} {}", a.rank, a.action, b.rank, b.action);
        }
        let is_i = |n: &&DagNode| {
            let a = n.action.parse::<graphpp_schedule::Action>();
            matches!(a, Ok(graphpp_schedule::Action::Compute { kind: graphpp_schedule::ComputeKind::I, .. }))
        };
        let bare_i = self.nodes.iter().filter(|n| n.runs.is_none()).find(is_i);
        if let Some(n) = bare_i {
            let _ = writeln!(
                out,
                "{}: an I without a graph is a stage without the dI/dW split (the first stage: its \
                 input is the tokens, so it has no input gradient); its W runs the full backward",
                n.action
            );
        }
        out
    }

    /// Graphviz DOT: a cluster per rank, program order grey, same-rank data dashed, hops bold.
    pub fn to_dot(&self) -> String {
        let mut out =
            String::from("digraph training_step {\n  rankdir=LR;\n  node [shape=box, fontsize=10];\n");
        for r in 0..self.ranks {
            let _ = writeln!(out, "  subgraph cluster_rank{r} {{\n    label=\"rank {r}\";");
            for n in self.nodes.iter().filter(|n| n.rank == r) {
                let _ = writeln!(out, "    n{} [label=\"{}\"];", n.id, Self::label(n));
            }
            out.push_str("  }\n");
        }
        for e in &self.edges {
            let style = match e.kind {
                EdgeKind::Program => "color=gray",
                EdgeKind::Data => "style=dashed",
                EdgeKind::Hop => "penwidth=2, color=firebrick",
            };
            let _ = writeln!(out, "  n{} -> n{} [{style}];", e.from, e.to);
        }
        out.push_str("}\n");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphpp_schedule::{generate, lower, Kind, LowerOptions, Options, Shape};

    #[test]
    fn a_lowered_one_f_one_b_step_has_its_hops_and_graphs() {
        let s = generate(Kind::OneFOneB, &Shape::new(2, 1, 2), &Options::default()).unwrap();
        let s = lower(&s, &LowerOptions::default()).unwrap();
        let dag = TrainingDag::of(&s, &|stage| stage > 0).unwrap();
        let text = dag.to_text();
        // Rank 0 (first stage, no split) sends activations and receives gradients.
        assert!(
            text.starts_with("rank 0: 0F0[fw] 0SEND_F0 0F1[fw] 0SEND_F1 0RECV_B0 0B0[full_bw]"),
            "{text}"
        );
        // Each microbatch crosses twice: F's activation 0 → 1, B's gradient 1 → 0.
        assert_eq!(dag.count(EdgeKind::Hop), 4, "{text}");
        assert!(text.contains("hop: rank 0 0SEND_F0 -> rank 1 1RECV_F0"), "{text}");
        assert!(text.contains("hop: rank 1 1SEND_B1 -> rank 0 0RECV_B1"), "{text}");
        assert!(!text.contains("an I without a graph"), "1F1B has no I: {text}");
        assert_eq!(dag.count(EdgeKind::Program), dag.nodes.len() - 2);
        let dot = dag.to_dot();
        assert!(dot.contains("subgraph cluster_rank1") && dot.contains("penwidth=2"), "{dot}");
    }

    #[test]
    fn zero_bubble_actions_name_their_graphs() {
        let s = generate(Kind::ZbH1, &Shape::new(2, 1, 2), &Options::default()).unwrap();
        let dag = TrainingDag::of(&s, &|stage| stage > 0).unwrap();
        let runs = |a: &str| dag.nodes.iter().find(|n| n.action == a).unwrap().runs;
        assert_eq!(runs("1I0"), Some("bw_di"));
        assert_eq!(runs("1W0"), Some("bw_dw"));
        // The first stage has no split: I keeps its inputs, W runs the full backward.
        assert_eq!(runs("0I0"), None);
        assert_eq!(runs("0W0"), Some("full_bw"));
        // The text says why 0I0 runs no graph.
        assert!(dag.to_text().contains("0I0: an I without a graph is a stage without the dI/dW split"));
        // 1I0 needs 1F0 on its own rank (data) and 0I0 needs 1I0 (a hop).
        let id = |a: &str| dag.nodes.iter().find(|n| n.action == a).unwrap().id;
        assert!(dag.edges.contains(&DagEdge { from: id("1F0"), to: id("1I0"), kind: EdgeKind::Data }));
        assert!(dag.edges.contains(&DagEdge { from: id("1I0"), to: id("0I0"), kind: EdgeKind::Hop }));
    }
}
