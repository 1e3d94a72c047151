//! `multiplex_fw_bw` (docs/ARCHITECTURE.md "Graph IR"; DeepSeek-V3 report §3.2.2 DualPipe overlap): one graph
//! that runs the forward of one (stage, microbatch) and the backward of another.
//!
//! Interface: inputs `f.<name>` for every fw input then `b.<name>` for every bw input; outputs
//! `f.<name>` then `b.<name>`. Order inside each source graph is kept.
//!
//! * [`Multiplex::Concat`]: all fw nodes, then all bw nodes.
//! * [`Multiplex::CommOverlap`]: each graph is cut into segments "compute run, then the
//!   communication that follows it"; segments alternate `bw, fw, bw, fw, …`, and every collective
//!   wait is moved to just before its first use, so one graph's communication is in flight while
//!   the other computes.

use crate::check::check_graph;
use crate::error::Result;
use crate::extract::Extractor;
use crate::graph::{Graph, Region, ValueId};
use crate::names::Side;
use crate::op::{InputKind, Op};
use serde::{Deserialize, Serialize};

/// Node ordering of the multiplexed graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Multiplex {
    /// fw then bw.
    Concat,
    /// Interleave compute of one graph with communication of the other.
    CommOverlap,
}

/// Whether a (non-wait) node is communication: a collective start or a node in a comm region.
pub fn is_comm(g: &Graph, v: ValueId) -> bool {
    let n = g.node(v);
    matches!(n.op, Op::CollectiveStart { .. })
        || (matches!(n.meta.region, Region::Comm(_)) && !matches!(n.op, Op::CollectiveWait))
}

/// Segments of a graph's non-input, non-wait nodes: each a compute run followed by its comm run.
fn segments(g: &Graph) -> Vec<Vec<ValueId>> {
    let mut segs: Vec<Vec<ValueId>> = vec![Vec::new()];
    let mut in_comm = false;
    for i in 0..g.nodes.len() {
        let v = ValueId(i);
        match g.node(v).op {
            Op::Input { .. } | Op::CollectiveWait => continue,
            _ => {}
        }
        let comm = is_comm(g, v);
        if !comm && in_comm {
            segs.push(Vec::new());
        }
        in_comm = comm;
        segs.last_mut().expect("non-empty").push(v);
    }
    segs
}

/// Builds the overlap graph of `fw` and `bw`. Errors: a malformed input graph.
pub fn multiplex_fw_bw(fw: &Graph, bw: &Graph, mode: Multiplex) -> Result<Graph> {
    check_graph(fw)?;
    check_graph(bw)?;
    let name = format!("overlap({};{})", fw.name, bw.name);
    let mut order: Vec<(Side, ValueId)> = Vec::new();
    match mode {
        Multiplex::Concat => {
            order.extend(non_inputs(fw).into_iter().map(|v| (Side::Fw, v)));
            order.extend(non_inputs(bw).into_iter().map(|v| (Side::Bw, v)));
        }
        Multiplex::CommOverlap => {
            let (sf, sb) = (segments(fw), segments(bw));
            for k in 0..sf.len().max(sb.len()) {
                if let Some(s) = sb.get(k) {
                    order.extend(s.iter().map(|v| (Side::Bw, *v)));
                }
                if let Some(s) = sf.get(k) {
                    order.extend(s.iter().map(|v| (Side::Fw, *v)));
                }
            }
            order = place_waits(fw, bw, order);
        }
    }
    let mut out = Graph::new(&name);
    let mut maps = [Vec::new(), Vec::new()];
    for (side, g) in [(Side::Fw, fw), (Side::Bw, bw)] {
        let mut ex = Extractor::new(g, "tmp", "multiplex_fw_bw");
        ex.graph = std::mem::take(&mut out);
        for &v in &g.inputs {
            if let Op::Input { name, kind, .. } = &g.node(v).op {
                let kind: InputKind = *kind;
                ex.input(v, &side.name(name), kind);
            }
        }
        maps[side as usize] = (0..g.nodes.len()).map(|i| ex.get(ValueId(i))).collect();
        out = ex.graph;
    }
    for (side, v) in order {
        let g = if side == Side::Fw { fw } else { bw };
        let map = &mut maps[side as usize];
        let mut node = g.node(v).clone();
        node.inputs = node.inputs.iter().map(|x| map[x.0].expect("operands precede users")).collect();
        map[v.0] = Some(out.push(node));
    }
    for (side, g) in [(Side::Fw, fw), (Side::Bw, bw)] {
        for o in &g.outputs {
            out.add_output(side.name(&o.name), maps[side as usize][o.value.0].expect("mapped"));
        }
    }
    check_graph(&out)?;
    Ok(out)
}

fn non_inputs(g: &Graph) -> Vec<ValueId> {
    (0..g.nodes.len()).map(ValueId).filter(|v| !matches!(g.node(*v).op, Op::Input { .. })).collect()
}

/// Inserts every wait of both graphs just before its first user in `order` (or at the end).
fn place_waits(fw: &Graph, bw: &Graph, order: Vec<(Side, ValueId)>) -> Vec<(Side, ValueId)> {
    let waits = |g: &Graph, side: Side| -> Vec<(Side, ValueId)> {
        (0..g.nodes.len())
            .map(ValueId)
            .filter(|v| matches!(g.node(*v).op, Op::CollectiveWait))
            .map(|v| (side, v))
            .collect()
    };
    let mut pending: Vec<(Side, ValueId)> = waits(fw, Side::Fw);
    pending.extend(waits(bw, Side::Bw));
    let mut out = Vec::with_capacity(order.len() + pending.len());
    for (side, v) in order {
        let g = if side == Side::Fw { fw } else { bw };
        let reads: Vec<ValueId> = g.node(v).inputs.clone();
        // A wait whose result this node reads goes right before it (waits may chain: repeat).
        let mut k = 0;
        while k < pending.len() {
            let (ws, w) = pending[k];
            if ws == side && reads.contains(&w) {
                out.push(pending.remove(k));
            } else {
                k += 1;
            }
        }
        out.push((side, v));
    }
    out.extend(pending);
    out
}
