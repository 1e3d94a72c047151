//! Dead-code elimination: keeps the inputs (the interface) and every node an output depends on.

use crate::error::Result;
use crate::extract::Extractor;
use crate::graph::{Graph, ValueId};
use crate::op::Op;

/// Removes nodes no output depends on; inputs are kept in order. The result is verified.
pub fn dce(g: &Graph) -> Result<Graph> {
    let live = g.ancestors(g.outputs.iter().map(|o| o.value));
    let mut ex = Extractor::new(g, &g.name, "dce");
    for (i, n) in g.nodes.iter().enumerate() {
        if matches!(n.op, Op::Input { .. }) {
            ex.same_input(ValueId(i));
        } else if live[i] {
            ex.copy(ValueId(i), None)?;
        }
    }
    for o in &g.outputs {
        ex.output(&o.name, o.value)?;
    }
    ex.finish()
}
