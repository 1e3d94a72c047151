//! The graph IR container: SSA nodes in topological order, ordered inputs and named outputs,
//! per-node scope / phase / region metadata (docs/ARCHITECTURE.md "Graph IR").

use crate::dtype::TensorType;
use crate::op::{InputKind, Op};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Id of a value = index of the node defining it in [`Graph::nodes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ValueId(pub usize);

/// Which part of the training step a node belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Forward computation.
    #[default]
    Forward,
    /// Backward (gradient) computation.
    Backward,
    /// A forward value recomputed inside the backward (activation checkpointing).
    Recompute,
}

/// Compute, or a named communication region (e.g. `ep.dispatch`, `fsdp.unshard`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Region {
    /// Plain compute.
    #[default]
    Compute,
    /// A named communication region.
    Comm(String),
}

/// Metadata of one node.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeMeta {
    /// Dotted module path, e.g. `model.layers.3.mlp.gate_proj`.
    pub scope: String,
    /// Forward / backward / recompute.
    pub phase: Phase,
    /// Compute or communication region.
    pub region: Region,
}

/// One SSA node: an op, its operands and the type of the value it defines.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// The operation.
    pub op: Op,
    /// Operand values (all defined by earlier nodes).
    pub inputs: Vec<ValueId>,
    /// Type of the defined value.
    pub ty: TensorType,
    /// Scope, phase, region.
    pub meta: NodeMeta,
}

/// A named graph output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GraphOutput {
    /// Unique output name (`loss`, `output`, `grad.input`, `grad.<param>`, `saved.<n>`).
    pub name: String,
    /// The value returned.
    pub value: ValueId,
}

/// A tensor program: nodes in topological order; `inputs` lists the `Input` nodes in interface order.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
pub struct Graph {
    /// Graph name (`fw`, `full_bw`, `bw_di`, …).
    pub name: String,
    /// All nodes; a value's id is its node's index.
    pub nodes: Vec<Node>,
    /// The input nodes, in interface order.
    pub inputs: Vec<ValueId>,
    /// Outputs, in interface order.
    pub outputs: Vec<GraphOutput>,
}

/// Description of one graph input for callers (name, kind, type).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputSpec {
    /// Unique input name.
    pub name: String,
    /// Role.
    pub kind: InputKind,
    /// Type.
    pub ty: TensorType,
}

impl Graph {
    /// An empty graph with a name.
    pub fn new(name: impl Into<String>) -> Self {
        Graph { name: name.into(), ..Default::default() }
    }

    /// The node defining `v`.
    pub fn node(&self, v: ValueId) -> &Node {
        &self.nodes[v.0]
    }

    /// Appends a node (no checks; see [`crate::check`]) and returns its value id.
    pub fn push(&mut self, node: Node) -> ValueId {
        let id = ValueId(self.nodes.len());
        if matches!(node.op, Op::Input { .. }) {
            self.inputs.push(id);
        }
        self.nodes.push(node);
        id
    }

    /// Adds an output.
    pub fn add_output(&mut self, name: impl Into<String>, value: ValueId) {
        self.outputs.push(GraphOutput { name: name.into(), value });
    }

    /// Interface of the inputs, in order.
    pub fn input_specs(&self) -> Vec<InputSpec> {
        self.inputs
            .iter()
            .map(|&v| match &self.node(v).op {
                Op::Input { name, kind, ty } => InputSpec { name: name.clone(), kind: *kind, ty: ty.clone() },
                _ => unreachable!("inputs list holds only Input nodes (check_graph)"),
            })
            .collect()
    }

    /// Names of the inputs, in order.
    pub fn input_names(&self) -> Vec<String> {
        self.input_specs().into_iter().map(|s| s.name).collect()
    }

    /// Value of the input called `name`.
    pub fn input_by_name(&self, name: &str) -> Option<ValueId> {
        self.inputs
            .iter()
            .copied()
            .find(|&v| matches!(&self.node(v).op, Op::Input { name: n, .. } if n == name))
    }

    /// Value of the output called `name`.
    pub fn output_by_name(&self, name: &str) -> Option<ValueId> {
        self.outputs.iter().find(|o| o.name == name).map(|o| o.value)
    }

    /// Names of the outputs, in order.
    pub fn output_names(&self) -> Vec<String> {
        self.outputs.iter().map(|o| o.name.clone()).collect()
    }

    /// For each value, the nodes reading it (in order, with repeats for repeated operands).
    pub fn users(&self) -> Vec<Vec<ValueId>> {
        let mut users = vec![Vec::new(); self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for &x in &n.inputs {
                users[x.0].push(ValueId(i));
            }
        }
        users
    }

    /// Set of values that `roots` depend on (including the roots), as a mask over node ids.
    pub fn ancestors(&self, roots: impl IntoIterator<Item = ValueId>) -> Vec<bool> {
        let mut mark = vec![false; self.nodes.len()];
        let mut stack: Vec<ValueId> = roots.into_iter().collect();
        while let Some(v) = stack.pop() {
            if !mark[v.0] {
                mark[v.0] = true;
                stack.extend(self.node(v).inputs.iter().copied());
            }
        }
        mark
    }

    /// Number of nodes per op mnemonic (for `--stats`).
    pub fn op_counts(&self) -> Vec<(String, usize)> {
        let mut counts: HashMap<String, usize> = HashMap::new();
        for n in &self.nodes {
            *counts.entry(n.op.mnemonic()).or_default() += 1;
        }
        let mut v: Vec<_> = counts.into_iter().collect();
        v.sort();
        v
    }

    /// Multiply-add FLOPs of the matmuls (2·m·n·k per batch element), the MoE segment matmuls
    /// (2·R·N·K over all segments) and their weight gradients, and the products inside attention
    /// nodes (forward `4·T²·E`, backward `10·T²·E` per batch element and head, the mask not
    /// skipped) — a cost estimate for `--stats`: the sum of [`Graph::node_flops`].
    pub fn matmul_flops(&self) -> u64 {
        (0..self.nodes.len()).filter_map(|i| self.node_flops(ValueId(i))).sum()
    }

    /// The multiply-add FLOPs of node `v` when it is a product ([`Graph::matmul_flops`]'s
    /// terms), `None` for any other node. A segment product over counts `[G, E]` (the rows
    /// expert parallelism receives from G members into G times the static rows one member
    /// sends) counts the 1/G of its rows balanced routing fills.
    pub fn node_flops(&self, v: ValueId) -> Option<u64> {
        let n = self.node(v);
        let a = || &self.node(n.inputs[0]).ty.shape;
        // The members whose rows a segment product's counts lay out (1 without expert parallelism).
        let members = || {
            n.inputs.get(2).map_or(1, |&c| {
                let s = &self.node(c).ty.shape;
                if s.len() == 2 {
                    s[0].max(1) as u64
                } else {
                    1
                }
            })
        };
        match n.op {
            // out [.., m, n] from [.., m, k]: 2·k per output element.
            Op::Matmul => Some(2 * *a().last()? as u64 * n.ty.numel() as u64),
            Op::SegmentMatmul { .. } => Some(2 * *a().last()? as u64 * n.ty.numel() as u64 / members()),
            // q kᵀ (2·T·T·E per (batch, query head)) and P v (2·T·T·E_v): 2·T per element of q
            // and of the output (the whole T × T, masked or not).
            Op::Attention { .. } => {
                let q = a().iter().product::<usize>() as u64;
                Some(2 * n.ty.shape[2] as u64 * (q + n.ty.numel() as u64))
            }
            // The scores again, dS k and dSᵀ q over E; g vᵀ and Pᵀ g over E_v: five products,
            // 6·T per element of q and 4·T per element of g (per query head, whatever the
            // key/value heads).
            Op::AttentionBackward { .. } => {
                let q = a().iter().product::<usize>() as u64;
                let g = self.node(*n.inputs.get(5)?).ty.numel() as u64;
                Some(n.ty.shape[2] as u64 * (6 * q + 4 * g))
            }
            // out [E, N, K] sums over the R rows: 2·R·N·K in all.
            Op::SegmentOuter => Some(
                2 * *a().first()? as u64 * (n.ty.numel() as u64 / n.ty.shape[0].max(1) as u64) / members(),
            ),
            _ => None,
        }
    }
}
