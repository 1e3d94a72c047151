//! `split_fsdp_collectives` (docs/ARCHITECTURE.md "Graph IR"; Zhao et al., "PyTorch FSDP", VLDB 2023 §3):
//! parameter all-gathers leave `fw` for an `unshard` graph, gradient reduce-scatters leave the
//! backward for a `reduce_grad` graph, so the schedule can issue them as UNSHARD / REDUCE_GRAD.
//!
//! Interfaces: `unshard` takes the sharded parameters `<p>` and returns `unsharded.<p>`; the new
//! `fw` takes `unsharded.<p>` (kind parameter) in place of `<p>`; the new backward returns
//! `grad.unsharded.<p>` in place of `grad.<p>`; `reduce_grad` takes `grad.unsharded.<p>` (kind
//! saved) and returns `grad.<p>`.

use crate::error::Result;
use crate::extract::Extractor;
use crate::graph::{Graph, ValueId};
use crate::names::grad_of;
use crate::op::{CollectiveKind, InputKind, Op};
use std::collections::HashMap;

/// Result of [`split_fsdp_collectives`].
#[derive(Clone, Debug, PartialEq)]
pub struct FsdpSplit {
    /// All-gathers of the sharded parameters.
    pub unshard: Graph,
    /// Forward reading unsharded parameters.
    pub fw: Graph,
    /// Backward returning unsharded gradients.
    pub bw: Graph,
    /// Reduce-scatters of the gradients.
    pub reduce_grad: Graph,
}

/// Name of the unsharded copy of parameter `p`.
pub fn unsharded(p: &str) -> String {
    format!("unsharded.{p}")
}

/// Splits `fw` and `bw`. Parameters without an all-gather pass through unchanged. Errors: a
/// malformed graph.
pub fn split_fsdp_collectives(fw: &Graph, bw: &Graph) -> Result<FsdpSplit> {
    // fw: wait(all_gather_start(param)) → parameter name.
    let mut gathered: HashMap<ValueId, String> = HashMap::new();
    for (i, n) in fw.nodes.iter().enumerate() {
        if !matches!(n.op, Op::CollectiveWait) {
            continue;
        }
        let s = fw.node(n.inputs[0]);
        if let (
            Op::CollectiveStart { kind: CollectiveKind::AllGather, .. },
            Op::Input { name, kind: InputKind::Parameter, .. },
        ) = (&s.op, &fw.node(s.inputs[0]).op)
        {
            gathered.insert(ValueId(i), name.clone());
        }
    }
    let mut un = Extractor::new(fw, "unshard", "split_fsdp_collectives");
    let mut f = Extractor::new(fw, "fw", "split_fsdp_collectives");
    let mut waits: Vec<(&ValueId, &String)> = gathered.iter().collect();
    waits.sort();
    for (w, p) in &waits {
        let s = fw.node(**w).inputs[0];
        un.same_input(fw.node(s).inputs[0]);
        un.copy(s, None)?;
        un.copy(**w, None)?;
        un.output(&unsharded(p), **w)?;
    }
    let users = fw.users();
    for &v in &fw.inputs {
        let shard_only = !users[v.0].is_empty()
            && users[v.0].iter().all(|u| {
                matches!(fw.node(*u).op, Op::CollectiveStart { .. })
                    && users[u.0].iter().all(|w| gathered.contains_key(w))
            });
        if !shard_only {
            f.same_input(v);
        }
        for (w, p) in &waits {
            if fw.node(fw.node(**w).inputs[0]).inputs[0] == v {
                f.input(**w, &unsharded(p), InputKind::Parameter);
            }
        }
    }
    for (i, n) in fw.nodes.iter().enumerate() {
        let v = ValueId(i);
        let in_unshard = gathered.contains_key(&v)
            || (matches!(n.op, Op::CollectiveStart { .. })
                && users[i].iter().all(|w| gathered.contains_key(w))
                && !users[i].is_empty());
        if !matches!(n.op, Op::Input { .. }) && !in_unshard && f.get(v).is_none() {
            f.copy(v, None)?;
        }
    }
    for o in &fw.outputs {
        f.output(&o.name, o.value)?;
    }
    let (bw2, reduce) = split_reduce(bw, &gathered.values().cloned().collect::<Vec<_>>())?;
    Ok(FsdpSplit { unshard: un.finish()?, fw: f.finish()?, bw: bw2, reduce_grad: reduce })
}

/// Moves `grad.<p> = wait(reduce_scatter_start(x))` into `reduce_grad` for the gathered `params`.
fn split_reduce(bw: &Graph, params: &[String]) -> Result<(Graph, Graph)> {
    let mut moved: HashMap<String, ValueId> = HashMap::new();
    for o in &bw.outputs {
        let Some(p) = crate::names::grad_target(&o.name) else { continue };
        let w = bw.node(o.value);
        if params.iter().any(|q| q == p) && matches!(w.op, Op::CollectiveWait) {
            if let Op::CollectiveStart { kind: CollectiveKind::ReduceScatter, .. } = bw.node(w.inputs[0]).op {
                moved.insert(o.name.clone(), o.value);
            }
        }
    }
    let skip = |v: ValueId| moved.values().any(|w| *w == v || bw.node(*w).inputs[0] == v);
    let mut b = Extractor::new(bw, &bw.name, "split_fsdp_collectives");
    let mut r = Extractor::new(bw, "reduce_grad", "split_fsdp_collectives");
    for &v in &bw.inputs {
        b.same_input(v);
    }
    for i in 0..bw.nodes.len() {
        let v = ValueId(i);
        if !matches!(bw.node(v).op, Op::Input { .. }) && !skip(v) {
            b.copy(v, None)?;
        }
    }
    for o in &bw.outputs {
        match moved.get(&o.name) {
            Some(&w) => {
                let s = bw.node(w).inputs[0];
                let x = bw.node(s).inputs[0];
                let un = grad_of(&unsharded(
                    crate::names::grad_target(&o.name).expect("a moved output is a gradient"),
                ));
                b.output(&un, x)?;
                r.input(x, &un, InputKind::Saved);
                r.copy(s, None)?;
                r.copy(w, None)?;
                r.output(&o.name, w)?;
            }
            None => b.output(&o.name, o.value)?,
        }
    }
    Ok((b.finish()?, r.finish()?))
}
