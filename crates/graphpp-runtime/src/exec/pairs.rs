//! Independent matmuls side by side: the compiled executor's inter-op parallelism: a second
//! thread of a rank's pool helps where one matmul alone cannot use it.
//!
//! A stage's matmuls are small (`small`: 128 × 256 · 256 × 688 at B = 2), and gemm splitting one
//! over two threads makes it well under twice as fast. But they come in independent pairs: a
//! linear layer's backward computes `dX = dY · W` and `dWᵀ = Xᵀ · dY` from the same `dY`, and the
//! forward's q, k, v (and gate, up) projections read the same normalised input. Two products on
//! one thread each, side by side, finish sooner than the same two with gemm splitting each over
//! both threads. (measured: docs/PERFORMANCE.md, "Matmul pairs and transposed weights")
//!
//! [`plan`] finds such pairs in a graph's order: a matmul `i` and a later matmul `j` (within
//! [`WINDOW`] nodes) whose operands are all ready before `i` runs — computed before `i`, or
//! views (reshape, permute) of such values placed between the two, which move up before `i`.
//! The execution order is the graph's with each pair's `j` (and the views it needs) moved up
//! next to its `i`: a topological order, since nothing `j` reads depends on anything moved
//! past. Both products exist at once, so the live-byte accounting counts a pair as both
//! produced before either's operands are released (`executor::peak_in_order`); a pair is kept
//! only if that accounting over the new order peaks exactly where the graph's order does (the
//! peak report, and the memory model that predicts it from the graph, stay exact). No operand
//! of either product is a collective still in flight, and no collective start lies between `i`
//! and `j` (moving `j` past it would start that collective later: an FSDP all-gather or the
//! overlap graph's exchange would hide less).
//!
//! Each product of a pair runs on one thread (`rayon::join` on the rank's pool); gemm's sums do
//! not depend on its thread count, so the values are the interpreter's bit for bit
//! (`tests/compiled.rs`). On a one-thread pool the pair runs one product after the other.

use graphpp_graph::{Graph, Op};

/// How far after `i` its partner may be (nodes in the graph's order): a linear's backward puts
/// its two products 2 apart, the forward's projections ~6.
pub const WINDOW: usize = 16;

/// The order a compiled program runs a graph's nodes in, and its pairs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pairs {
    /// Every node id once, in execution order.
    pub order: Vec<usize>,
    /// `partner[i] = Some(j)`: matmul `j` runs beside matmul `i`, and comes right after it in
    /// `order`.
    pub partner: Vec<Option<usize>>,
}

impl Pairs {
    /// The graph's own order, no pairs.
    pub fn none(n: usize) -> Pairs {
        Pairs { order: (0..n).collect(), partner: vec![None; n] }
    }
}

/// Pairs the matmuls of `g` (module doc). `runs[v]` is false for a node the program never
/// computes on its own (a fused group's inner member): such a node never moves.
/// `peak(pairs)` is the live-byte accounting's peak over an execution order and its pairs.
pub fn plan(g: &Graph, runs: &[bool], peak: impl Fn(&Pairs) -> usize) -> Pairs {
    let n = g.nodes.len();
    let mut pairs = Pairs::none(n);
    let limit = peak(&pairs);
    let is_matmul = |v: usize| matches!(g.nodes[v].op, Op::Matmul) && runs[v];
    let mut i = 0;
    while i < n {
        if !is_matmul(i) || !g.nodes[i].inputs.iter().all(|x| settled(g, x.0)) {
            i += 1;
            continue;
        }
        // Candidates up to the next collective start (module doc).
        let end = (i + 1..n.min(i + 1 + WINDOW)).find(|&v| !settled(g, v)).unwrap_or(n.min(i + 1 + WINDOW));
        let found = (i + 1..end).filter(|&j| is_matmul(j)).find_map(|j| {
            let mut moved = Vec::new();
            let ready = g.nodes[j].inputs.iter().all(|x| ready_before(g, runs, x.0, i, &mut moved));
            ready.then_some((j, moved))
        });
        let Some((j, mut moved)) = found else {
            i += 1;
            continue;
        };
        moved.sort_unstable();
        moved.dedup();
        debug_assert!(moved.iter().all(|&v| !matches!(g.nodes[v].op, Op::Input { .. })), "inputs never move");
        let mut tried = Pairs { order: reorder(&pairs.order, i, j, &moved), partner: pairs.partner.clone() };
        tried.partner[i] = Some(j);
        if peak(&tried) == limit {
            pairs = tried;
            i = j + 1;
        } else {
            i += 1;
        }
    }
    pairs
}

/// Whether `v`'s value is complete when computed (not a collective in flight).
fn settled(g: &Graph, v: usize) -> bool {
    !matches!(g.nodes[v].op, Op::CollectiveStart { .. })
}

/// Whether value `v` can be ready before node `i` runs: computed before `i`, or a view (reshape,
/// permute) between `i` and its partner of values that can be; such views are pushed to `moved`.
fn ready_before(g: &Graph, runs: &[bool], v: usize, i: usize, moved: &mut Vec<usize>) -> bool {
    if !settled(g, v) {
        return false;
    }
    if v < i {
        return true;
    }
    let view = matches!(g.nodes[v].op, Op::Reshape { .. } | Op::Permute { .. }) && runs[v] && v != i;
    if view && g.nodes[v].inputs.iter().all(|x| ready_before(g, runs, x.0, i, moved)) {
        moved.push(v);
        return true;
    }
    false
}

/// `order` with `moved` (ascending) and then `j` placed right before `i`, `j` after `i`.
fn reorder(order: &[usize], i: usize, j: usize, moved: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(order.len());
    for &v in order {
        if v == j || moved.binary_search(&v).is_ok() {
            continue;
        }
        if v == i {
            out.extend_from_slice(moved);
            out.extend([i, j]);
        } else {
            out.push(v);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphpp_graph::{DType, GraphBuilder, InputKind};

    /// A linear layer's backward shape: dX = dY · W and dWᵀ = permute(X) · dY pair up, the
    /// permute moving before dX; a product that reads dX does not pair with it.
    #[test]
    fn a_linears_two_gradients_pair() {
        let mut b = GraphBuilder::new("g", DType::F32);
        let dy = b.input("dy", InputKind::Activation, vec![8, 6]).unwrap();
        let w = b.input("w", InputKind::Parameter, vec![6, 4]).unwrap();
        let x = b.input("x", InputKind::Activation, vec![8, 4]).unwrap();
        let dx = b.matmul(dy, w).unwrap();
        let xt = b.permute(x, vec![1, 0]).unwrap();
        let dwt = b.matmul(xt, dy).unwrap();
        let after = b.matmul(dx, xt).unwrap();
        for (name, v) in [("dx", dx), ("dwt", dwt), ("after", after)] {
            b.output(name, v);
        }
        let g = b.finish().unwrap();
        let runs = vec![true; g.nodes.len()];
        let p = plan(&g, &runs, |_| 0);
        assert_eq!(p.partner[dx.0], Some(dwt.0));
        assert_eq!(p.partner[dwt.0], None, "a partner does not pair again");
        assert_eq!(p.partner[after.0], None, "reads dx: not independent");
        assert_eq!(&p.order[dx.0..], &[xt.0, dx.0, dwt.0, after.0][..], "the permute moved up");
        let mut sorted = p.order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..g.nodes.len()).collect::<Vec<_>>(), "every node once");
    }

    /// No pair spans a collective start (the start would move later); products after it pair.
    #[test]
    fn collectives_bound_the_pairs() {
        use graphpp_graph::{CollectiveKind, CommGroup, MeshAxis};
        let group = CommGroup::new(MeshAxis::DataParallel, 2);
        let mut b = GraphBuilder::new("g", DType::F32);
        let a = b.input("a", InputKind::Activation, vec![8, 8]).unwrap();
        let m1 = b.matmul(a, a).unwrap();
        let s = b.collective_start(CollectiveKind::AllReduce, &group, 0, a).unwrap();
        let m2 = b.matmul(a, a).unwrap();
        let w = b.wait(s).unwrap();
        let m3 = b.matmul(w, a).unwrap();
        let m4 = b.matmul(a, a).unwrap();
        for (name, v) in [("m1", m1), ("m2", m2), ("m3", m3), ("m4", m4), ("w", w)] {
            b.output(name, v);
        }
        let g = b.finish().unwrap();
        let runs = vec![true; g.nodes.len()];
        let p = plan(&g, &runs, |_| 0);
        assert_eq!(p.partner[m1.0], None, "the start lies between m1 and m2");
        assert_eq!(p.partner[m2.0], Some(m4.0), "m3 reads the wait (after m2); a wait bounds nothing");
        assert_eq!(p.partner[m3.0], None);
    }

    /// A pair whose order raises the accounted peak is dropped.
    #[test]
    fn a_pair_that_raises_the_peak_is_dropped() {
        let mut b = GraphBuilder::new("g", DType::F32);
        let a = b.input("a", InputKind::Activation, vec![8, 8]).unwrap();
        let m1 = b.matmul(a, a).unwrap();
        let e = b.exp(m1).unwrap();
        let m2 = b.matmul(a, a).unwrap();
        b.output("e", e);
        b.output("m2", m2);
        let g = b.finish().unwrap();
        let runs = vec![true; g.nodes.len()];
        let graph_order: Vec<usize> = (0..g.nodes.len()).collect();
        assert_eq!(plan(&g, &runs, |p| usize::from(p.order != graph_order)).partner[m1.0], None);
        assert_eq!(plan(&g, &runs, |_| 0).partner[m1.0], Some(m2.0));
    }
}
