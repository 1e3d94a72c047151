//! Copying a subset of a graph's nodes into a new graph, with explicit boundary inputs. Shared by
//! partition, recompute and the splitting passes.

use crate::check::check_graph;
use crate::error::{GraphError, Result};
use crate::graph::{Graph, Node, Phase, ValueId};
use crate::op::{InputKind, Op};
use std::collections::HashMap;

/// Builds a new graph from nodes of `src`; every operand must have been mapped first.
pub struct Extractor<'a> {
    src: &'a Graph,
    pass: &'static str,
    /// The graph being built.
    pub graph: Graph,
    map: HashMap<ValueId, ValueId>,
}

impl<'a> Extractor<'a> {
    /// Starts a new graph called `name` from `src`, for pass `pass` (named in errors).
    pub fn new(src: &'a Graph, name: &str, pass: &'static str) -> Self {
        Extractor { src, pass, graph: Graph::new(name), map: HashMap::new() }
    }

    /// New-graph value of source value `v`, if copied or bound.
    pub fn get(&self, v: ValueId) -> Option<ValueId> {
        self.map.get(&v).copied()
    }

    /// Binds source value `v` to a new input `name` of `kind` (same type as `v`).
    pub fn input(&mut self, v: ValueId, name: &str, kind: InputKind) -> ValueId {
        let src = self.src.node(v);
        let mut meta = src.meta.clone();
        meta.phase = if kind == InputKind::Tangent { Phase::Backward } else { meta.phase };
        let node = Node {
            op: Op::Input { name: name.into(), kind, ty: src.ty.clone() },
            inputs: vec![],
            ty: src.ty.clone(),
            meta,
        };
        let id = self.graph.push(node);
        self.map.insert(v, id);
        id
    }

    /// Binds a source `Input` node to an input of the same name and kind.
    pub fn same_input(&mut self, v: ValueId) -> ValueId {
        match &self.src.node(v).op {
            Op::Input { name, kind, .. } => {
                let (name, kind) = (name.clone(), *kind);
                self.input(v, &name, kind)
            }
            _ => panic!("same_input on a non-input node"),
        }
    }

    /// Copies node `v` (operands must be mapped), optionally overriding its phase.
    pub fn copy(&mut self, v: ValueId, phase: Option<Phase>) -> Result<ValueId> {
        let src = self.src.node(v);
        let mut inputs = Vec::with_capacity(src.inputs.len());
        for x in &src.inputs {
            inputs.push(self.get(*x).ok_or_else(|| GraphError::Pass {
                pass: self.pass.into(),
                graph: self.src.name.clone(),
                reason: format!("%{} reads %{} which is not available in `{}`", v.0, x.0, self.graph.name),
            })?);
        }
        let mut node = src.clone();
        node.inputs = inputs;
        if let Some(p) = phase {
            node.meta.phase = p;
        }
        let id = self.graph.push(node);
        self.map.insert(v, id);
        Ok(id)
    }

    /// Adds output `name` returning source value `v`.
    pub fn output(&mut self, name: &str, v: ValueId) -> Result<()> {
        let id = self.get(v).ok_or_else(|| GraphError::Pass {
            pass: self.pass.into(),
            graph: self.src.name.clone(),
            reason: format!("output {name} (%{}) is not available in `{}`", v.0, self.graph.name),
        })?;
        self.graph.add_output(name, id);
        Ok(())
    }

    /// The verified graph.
    pub fn finish(self) -> Result<Graph> {
        check_graph(&self.graph)?;
        Ok(self.graph)
    }
}

/// Sort key putting inputs in interface order: parameters, buffers, activation, targets, saved,
/// tangents; ties by source position.
pub fn input_order(g: &Graph, v: ValueId) -> (InputKind, usize) {
    match &g.node(v).op {
        Op::Input { kind, .. } => (*kind, v.0),
        _ => (InputKind::Saved, v.0),
    }
}
