//! `split_di_dw` (docs/ARCHITECTURE.md "Graph IR"; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
//! §2): `full_bw` → `bw_di` (the nodes the stage-input gradient needs; on the critical path) +
//! `bw_dw` (the rest: weight gradients, movable into bubbles). The dI-set values that `bw_dw` reads
//! are returned by `bw_di` as `stash.<n>` outputs and taken by `bw_dw` as `Saved` inputs.

use crate::autodiff::grad_name;
use crate::error::Result;
use crate::extract::Extractor;
use crate::graph::{Graph, ValueId};
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
pub fn split_di_dw(full_bw: &Graph) -> Result<Option<DiDw>> {
    let Some(dinput) = full_bw.output_by_name(&grad_name(INPUT)) else { return Ok(None) };
    let is_input = |v: ValueId| matches!(full_bw.node(v).op, Op::Input { .. });
    let is_const = |v: ValueId| matches!(full_bw.node(v).op, Op::Full { .. });
    let di = full_bw.ancestors([dinput]);
    let w_outs: Vec<_> =
        full_bw.outputs.iter().filter(|o| o.value != dinput || o.name != grad_name(INPUT)).collect();
    let w_live = full_bw.ancestors(w_outs.iter().map(|o| o.value));
    let in_dw = |v: ValueId| w_live[v.0] && !di[v.0] && !is_input(v);
    // Stash: dI-set computed values read by dW nodes or returned as weight gradients.
    let mut stash: Vec<ValueId> = Vec::new();
    let mark = |v: ValueId, stash: &mut Vec<ValueId>| {
        if di[v.0] && !is_input(v) && !is_const(v) && !stash.contains(&v) {
            stash.push(v);
        }
    };
    for i in 0..full_bw.nodes.len() {
        if in_dw(ValueId(i)) {
            for &x in &full_bw.nodes[i].inputs {
                mark(x, &mut stash);
            }
        }
    }
    for o in &w_outs {
        mark(o.value, &mut stash);
    }
    stash.sort();
    let names: Vec<String> = (0..stash.len()).map(|k| format!("stash.{k}")).collect();

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
    d.output(&grad_name(INPUT), dinput)?;
    for (v, n) in stash.iter().zip(&names) {
        d.output(n, *v)?;
    }

    let mut w = Extractor::new(full_bw, "bw_dw", "split_di_dw");
    let users = full_bw.users();
    for &v in &full_bw.inputs {
        if users[v.0].iter().any(|u| in_dw(*u)) || w_outs.iter().any(|o| o.value == v) {
            w.same_input(v);
        }
    }
    for (v, n) in stash.iter().zip(&names) {
        w.input(*v, n, InputKind::Saved);
    }
    for v in (0..full_bw.nodes.len()).map(ValueId) {
        if w.get(v).is_none() && (in_dw(v) || (is_const(v) && w_live[v.0])) {
            w.copy(v, None)?;
        }
    }
    for o in &w_outs {
        w.output(&o.name, o.value)?;
    }
    Ok(Some(DiDw { bw_di: d.finish()?, bw_dw: w.finish()?, stash: names }))
}
