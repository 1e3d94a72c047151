//! The graph checker, [`check_graph`] (docs/ARCHITECTURE.md "Graph IR"): a graph is well formed
//! when its nodes are in topological order, each value has one definition, shapes match
//! inference, the input list is consistent, input and output names are unique, and collectives
//! pair up (a start is read only by waits; a wait reads a start). (`verify` is the runtime's
//! check of pipelined gradients against one device, and the command that runs it.)

use crate::error::{GraphError, Result};
use crate::graph::{Graph, ValueId};
use crate::infer::infer;
use crate::op::Op;
use std::collections::HashSet;

/// Location text for errors: `%id (scope)`.
pub fn at(g: &Graph, v: ValueId) -> String {
    format!("%{} ({})", v.0, g.node(v).meta.scope)
}

/// Checks every invariant of `g`. Errors: [`GraphError::Malformed`] naming the node and the problem.
pub fn check_graph(g: &Graph) -> Result<()> {
    let err = |at: String, reason: String| GraphError::Malformed { graph: g.name.clone(), at, reason };
    let mut input_ids = Vec::new();
    let mut names = HashSet::new();
    for (i, n) in g.nodes.iter().enumerate() {
        let v = ValueId(i);
        for &x in &n.inputs {
            if x.0 >= i {
                return Err(err(at(g, v), format!("operand %{} is not defined before use", x.0)));
            }
        }
        let tys: Vec<_> = n.inputs.iter().map(|&x| &g.node(x).ty).collect();
        let ty = infer(&n.op, &tys).map_err(|r| err(at(g, v), r))?;
        if ty != n.ty {
            return Err(err(at(g, v), format!("declared type {} but {} infers {ty}", n.ty, n.op.mnemonic())));
        }
        if let Op::Input { name, .. } = &n.op {
            input_ids.push(v);
            if !names.insert(name.clone()) {
                return Err(err(at(g, v), format!("duplicate input name {name:?}")));
            }
        }
        if matches!(n.op, Op::CollectiveWait) && !matches!(g.node(n.inputs[0]).op, Op::CollectiveStart { .. })
        {
            return Err(err(at(g, v), "wait does not read a collective start".into()));
        }
    }
    if input_ids != g.inputs {
        return Err(err("inputs".into(), "input list differs from the Input nodes in order".into()));
    }
    let users = g.users();
    for (i, n) in g.nodes.iter().enumerate() {
        if matches!(n.op, Op::CollectiveStart { .. })
            && users[i].iter().any(|u| !matches!(g.node(*u).op, Op::CollectiveWait))
        {
            return Err(err(at(g, ValueId(i)), "collective start read by a non-wait".into()));
        }
    }
    let mut out_names = HashSet::new();
    for o in &g.outputs {
        if o.value.0 >= g.nodes.len() {
            return Err(err(format!("output {}", o.name), format!("refers to undefined %{}", o.value.0)));
        }
        if matches!(g.node(o.value).op, Op::CollectiveStart { .. }) {
            return Err(err(format!("output {}", o.name), "returns an unwaited collective".into()));
        }
        if !out_names.insert(o.name.clone()) {
            return Err(err(format!("output {}", o.name), "duplicate output name".into()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder::GraphBuilder;
    use crate::dtype::{DType, TensorType};
    use crate::op::InputKind;

    #[test]
    fn rejects_bad_type_and_order() {
        let mut b = GraphBuilder::new("t", DType::F32);
        let x = b.input("x", InputKind::Activation, vec![2, 3]).unwrap();
        let y = b.exp(x).unwrap();
        b.output("y", y);
        let mut g = b.finish().unwrap();
        check_graph(&g).unwrap();
        let mut bad = g.clone();
        bad.nodes[1].ty = TensorType::new(DType::F32, vec![3, 2]);
        assert!(matches!(check_graph(&bad), Err(GraphError::Malformed { .. })));
        g.nodes[1].inputs[0] = ValueId(1);
        let e = check_graph(&g).unwrap_err().to_string();
        assert!(e.contains("not defined before use"), "{e}");
    }
}
