//! `split_di_dw` (docs/ARCHITECTURE.md "Graph IR"; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
//! §2): `full_bw` → `bw_di` (the nodes the stage-input gradient needs; on the critical path) +
//! `bw_dw` (the rest: weight gradients, movable into bubbles). What `bw_dw` holds from I to W is a
//! minimum cut by bytes ([`split_di_dw`]); the computed values on it are returned by `bw_di` as
//! `stash.<n>` outputs and taken by `bw_dw` as `Saved` inputs.

use crate::error::Result;
use crate::extract::Extractor;
use crate::graph::{Graph, ValueId};
use crate::names::grad_of;
use crate::names::INPUT;
use crate::op::{InputKind, Op};

/// Result of [`split_di_dw`].
#[derive(Clone, Debug, PartialEq)]
pub struct DiDw {
    /// Outputs: `grad.input`, then the `stash.<n>` values.
    pub bw_di: Graph,
    /// Inputs: the `full_bw` inputs it reads, then the stash; outputs: the weight gradients.
    pub bw_dw: Graph,
    /// Names of the stashed values, in order.
    pub stash: Vec<String>,
}

/// Splits `full_bw`. Returns `Ok(None)` when the graph has no `grad.input` output (a first stage,
/// whose input is token ids, keeps `full_bw` only). Errors: a malformed graph.
///
/// What W holds between I and W is chosen by bytes: a minimum cut ([`w_cut`]) over the values
/// the weight gradients depend on, where every value I computes anyway (the ancestors of
/// `grad.input`) and every non-state input is available at I, and a forward matmul (one
/// recomputed under a recompute policy) may run in I but never in W. The cut values are what W
/// keeps — `stash.<n>` outputs of `bw_di` for computed values, the `full_bw` inputs W reads.
/// Under a recompute policy W holds no more than under `save-all`.
pub fn split_di_dw(full_bw: &Graph) -> Result<Option<DiDw>> {
    let Some(dinput) = full_bw.output_by_name(&grad_of(INPUT)) else { return Ok(None) };
    let w_outs: Vec<_> =
        full_bw.outputs.iter().filter(|o| o.value != dinput || o.name != grad_of(INPUT)).collect();
    let cut = w_cut(full_bw, dinput, &w_outs.iter().map(|o| o.value).collect::<Vec<_>>());
    let is_input = |v: ValueId| matches!(full_bw.node(v).op, Op::Input { .. });
    let stash: Vec<ValueId> = cut.held.iter().copied().filter(|&v| !is_input(v)).collect();
    let names: Vec<String> = (0..stash.len()).map(|k| format!("stash.{k}")).collect();
    let di = full_bw.ancestors(std::iter::once(dinput).chain(stash.iter().copied()));

    let mut d = Extractor::new(full_bw, "bw_di", "split_di_dw");
    for &v in &full_bw.inputs {
        if di[v.0] {
            d.same_input(v);
        }
    }
    for v in (0..full_bw.nodes.len()).map(ValueId) {
        if di[v.0] && !is_input(v) {
            d.copy(v, None)?;
        }
    }
    d.output(&grad_of(INPUT), dinput)?;
    for (v, n) in stash.iter().zip(&names) {
        d.output(n, *v)?;
    }

    let mut w = Extractor::new(full_bw, "bw_dw", "split_di_dw");
    let users = full_bw.users();
    let in_w = |v: ValueId| cut.in_w[v.0];
    for &v in &full_bw.inputs {
        if users[v.0].iter().any(|u| in_w(*u)) || w_outs.iter().any(|o| o.value == v) {
            w.same_input(v);
        }
    }
    for (v, n) in stash.iter().zip(&names) {
        w.input(*v, n, InputKind::Saved);
    }
    for v in (0..full_bw.nodes.len()).map(ValueId) {
        if w.get(v).is_none() && in_w(v) {
            w.copy(v, None)?;
        }
    }
    for o in &w_outs {
        w.output(&o.name, o.value)?;
    }
    Ok(Some(DiDw { bw_di: d.finish()?, bw_dw: w.finish()?, stash: names }))
}

/// The I/W boundary of [`split_di_dw`]: the values W holds (sorted) and the nodes W computes.
struct WCut {
    /// Values held from I to W: computed values (the stash) and non-state inputs W reads.
    held: Vec<ValueId>,
    /// `in_w[v]`: W computes node `v` (never an input).
    in_w: Vec<bool>,
}

/// The minimum-bytes cut between what I has and the weight gradients `w_outs`, by max-flow /
/// min-cut (Dinic) on the value graph with each value split into an in and an out vertex joined
/// by an edge of its byte size (constants: unbounded, W makes them). I has the non-state inputs
/// and every value it computes anyway (`dinput`'s ancestors: W never redoes them), and runs the
/// forward's matmuls and collectives (recomputed ones included); W runs its own
/// weight-gradient matmuls. W's other, cheap work runs where the cut puts it: a reduction whose
/// result is smaller than its inputs (a norm weight's gradient) runs in I and W holds the result.
/// Dependencies, availability at I and the weight gradients are unbounded edges. Parameters and
/// buffers are stage state: free to read in W.
fn w_cut(g: &Graph, dinput: ValueId, w_outs: &[ValueId]) -> WCut {
    const INF: u64 = u64::MAX / 4;
    let n = g.nodes.len();
    let (src, sink) = (2 * n, 2 * n + 1);
    let di = g.ancestors([dinput]);
    let live = g.ancestors(w_outs.iter().copied());
    let state =
        |v: usize| matches!(g.nodes[v].op, Op::Input { kind: InputKind::Parameter | InputKind::Buffer, .. });
    let mut net = FlowNet::new(2 * n + 2);
    for v in (0..n).filter(|&v| live[v] && !state(v)) {
        let node = &g.nodes[v];
        // Matmuls and collectives run where they belong: the forward's in I (W only holds them
        // or what follows), W's own weight-gradient ones in W.
        let heavy = node.op.is_product() || node.op.is_collective();
        let backward = node.meta.phase == crate::graph::Phase::Backward;
        let free = matches!(node.op, Op::Full { .. });
        let at_i = matches!(node.op, Op::Input { .. }) || (di[v] && !free) || (heavy && !backward);
        net.edge(2 * v, 2 * v + 1, if free { INF } else { node.ty.size_bytes() as u64 });
        if at_i {
            net.edge(src, 2 * v, INF);
        } else if heavy {
            net.edge(2 * v, sink, INF);
        }
        for x in node.inputs.iter().filter(|x| !state(x.0)) {
            net.edge(2 * x.0 + 1, 2 * v, INF);
            // What I computes, it computes from what I has: a value on I's side pulls its
            // inputs there (never a W matmul into I).
            net.edge(2 * v, 2 * x.0, INF);
        }
    }
    for o in w_outs.iter().filter(|o| !state(o.0)) {
        net.edge(2 * o.0 + 1, sink, INF);
    }
    net.max_flow(src, sink);
    let reach = net.reachable(src);
    let held: Vec<ValueId> = (0..n).filter(|&v| reach[2 * v] && !reach[2 * v + 1]).map(ValueId).collect();
    let in_w = (0..n)
        .map(|v| live[v] && !state(v) && !reach[2 * v] && !matches!(g.nodes[v].op, Op::Input { .. }))
        .collect();
    WCut { held, in_w }
}

/// A flow network for [`w_cut`]: adjacency lists of edge indices; edge `e ^ 1` is `e`'s reverse.
struct FlowNet {
    adj: Vec<Vec<usize>>,
    to: Vec<usize>,
    cap: Vec<u64>,
}

impl FlowNet {
    fn new(vertices: usize) -> Self {
        FlowNet { adj: vec![Vec::new(); vertices], to: Vec::new(), cap: Vec::new() }
    }

    fn edge(&mut self, a: usize, b: usize, cap: u64) {
        self.adj[a].push(self.to.len());
        self.to.push(b);
        self.cap.push(cap);
        self.adj[b].push(self.to.len());
        self.to.push(a);
        self.cap.push(0);
    }

    /// BFS levels from `s` over edges with residual capacity.
    fn levels(&self, s: usize) -> Vec<u32> {
        let mut level = vec![u32::MAX; self.adj.len()];
        level[s] = 0;
        let mut queue = std::collections::VecDeque::from([s]);
        while let Some(u) = queue.pop_front() {
            for &e in &self.adj[u] {
                let v = self.to[e];
                if self.cap[e] > 0 && level[v] == u32::MAX {
                    level[v] = level[u] + 1;
                    queue.push_back(v);
                }
            }
        }
        level
    }

    /// Dinic's algorithm: blocking flows along BFS levels until `t` is unreachable.
    fn max_flow(&mut self, s: usize, t: usize) {
        loop {
            let level = self.levels(s);
            if level[t] == u32::MAX {
                return;
            }
            let mut next = vec![0usize; self.adj.len()];
            while self.augment(s, t, u64::MAX, &level, &mut next) > 0 {}
        }
    }

    /// One augmenting path of at most `limit` from `u` to `t` along increasing levels
    /// (iterative depth-first search with per-vertex edge cursors `next`).
    fn augment(&mut self, s: usize, t: usize, limit: u64, level: &[u32], next: &mut [usize]) -> u64 {
        let mut path: Vec<usize> = Vec::new();
        let mut u = s;
        loop {
            if u == t {
                let flow = path.iter().map(|&e| self.cap[e]).fold(limit, u64::min);
                for &e in &path {
                    self.cap[e] -= flow;
                    self.cap[e ^ 1] += flow;
                }
                return flow;
            }
            let mut advanced = false;
            while next[u] < self.adj[u].len() {
                let e = self.adj[u][next[u]];
                let v = self.to[e];
                if self.cap[e] > 0 && level[v] == level[u].wrapping_add(1) {
                    path.push(e);
                    u = v;
                    advanced = true;
                    break;
                }
                next[u] += 1;
            }
            if !advanced {
                // Dead end: retreat one edge and skip it.
                let Some(e) = path.pop() else { return 0 };
                u = self.to[e ^ 1];
                next[u] += 1;
            }
        }
    }

    /// Vertices reachable from `s` over edges with residual capacity (the source side of the
    /// minimum cut once the flow is maximal).
    fn reachable(&self, s: usize) -> Vec<bool> {
        self.levels(s).into_iter().map(|l| l != u32::MAX).collect()
    }
}
