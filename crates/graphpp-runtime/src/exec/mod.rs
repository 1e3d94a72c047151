//! Graph executor (docs/ARCHITECTURE.md "Runtime" → Executor): interprets a graph node by node on candle CPU
//! tensors, frees each value after its last use, and reports the peak live bytes and optionally the
//! time of every node.
//!
//! Live bytes = logical size (`numel × dtype size`) of every value the executor holds: node
//! results and the inputs of kind activation / target / saved / tangent, each until its last use
//! (outputs until the end). Parameters and buffers are stage state and are not counted, nor are
//! values computed from them alone (e.g. a transposed weight: a view of the state, not an
//! activation). Views of activations (reshape, permute, broadcast) are counted at their logical
//! size.
//!
//! Collectives: a `*_start` node over a graph group of size 1 is the identity (no communication).
//! Over a larger group it resolves the group through the [`Mesh`] to world ranks and starts the
//! collective on the rank's [`Comm`] ([`run_with`]); the matching wait — or any other node that
//! reads the started value — completes it. The `Comm` splits and joins along dim 0, so a
//! collective along another axis is run on the tensor with that axis swapped to dim 0, and the
//! result swapped back. A graph all-to-all sends equal parts to every member.

mod collective;
pub mod fusion;
pub mod kept;
mod kernel;
mod liveness;
pub mod pairs;
mod program;

use std::collections::HashMap;
use std::time::Duration;

use candle_core::Tensor;
use graphpp_graph::{Graph, ValueId};

use program::exec;
use thiserror::Error;

pub use collective::{CollectiveError, CollectiveSpan, GraphComm};
pub use liveness::peak_live_bytes;
pub use program::Program;

/// Errors of graph execution, each naming the node or input concerned.
#[derive(Debug, Error)]
pub enum ExecError {
    /// A tensor kernel failed.
    #[error("node %{node} {op} ({scope}) in graph `{graph}`: {source}")]
    Kernel {
        /// Graph name.
        graph: String,
        /// Node id.
        node: usize,
        /// Op mnemonic.
        op: String,
        /// Node scope.
        scope: String,
        /// The candle error.
        source: Box<candle_core::Error>,
    },
    /// An input is missing or has the wrong type.
    #[error("graph `{graph}` input `{name}`: {reason}")]
    Input {
        /// Graph name.
        graph: String,
        /// Input name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A collective could not be started or completed.
    #[error(
        "collective {kind} over group {} at node %{node}: {source}",
        group.map_or("?".to_string(), |g| g.to_string())
    )]
    Collective {
        /// Collective kind.
        kind: String,
        /// The graph group (`None` when the node is no collective start).
        group: Option<graphpp_graph::CommGroup>,
        /// Node id of the start.
        node: usize,
        /// What went wrong (boxed: a communicator error is large).
        source: Box<CollectiveError>,
    },
    /// The graph failed verification.
    #[error(transparent)]
    Graph(#[from] graphpp_graph::GraphError),
}

/// Result alias for execution.
pub type ExecResult<T> = std::result::Result<T, ExecError>;

/// What a run reports besides its outputs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// Record the wall time of every node.
    pub time_nodes: bool,
    /// Record which values are live at the peak (memory debugging).
    pub trace_peak: bool,
}

/// Outputs and measurements of one run.
#[derive(Debug)]
pub struct ExecReport {
    /// Output tensors, in the graph's output order.
    pub outputs: Vec<Tensor>,
    /// Peak live bytes (see the module doc).
    pub peak_live_bytes: usize,
    /// Wall time per node (index = node id) when asked for.
    pub node_times: Option<Vec<Duration>>,
    /// Values live at the peak, when asked for.
    pub live_at_peak: Option<Vec<ValueId>>,
    /// Every collective over more than one rank, in completion order.
    pub collectives: Vec<CollectiveSpan>,
}

impl ExecReport {
    /// Output called `name` of `graph`.
    pub fn output(&self, graph: &Graph, name: &str) -> Option<&Tensor> {
        graph.outputs.iter().position(|o| o.name == name).map(|i| &self.outputs[i])
    }
}

/// Runs `graph` on `inputs` (in the graph's input order) without a communicator: collectives
/// over groups of size 1 only. Errors: wrong inputs, kernel failures,
/// [`CollectiveError::NoComm`] for a larger group.
pub fn run(graph: &Graph, inputs: &[Tensor], opts: &RunOptions) -> ExecResult<ExecReport> {
    exec(graph, inputs, opts, None, None)
}

/// Runs `graph` binding its inputs by name. Errors: a missing input.
pub fn run_named(
    graph: &Graph,
    inputs: &HashMap<String, Tensor>,
    opts: &RunOptions,
) -> ExecResult<ExecReport> {
    run_named_with(graph, inputs, opts, None)
}

/// [`run_named`] as one rank of a run when `comm` is given (see [`run_with`]).
///
/// # Errors
/// A missing input; those of [`run_with`].
pub fn run_named_with(
    graph: &Graph,
    inputs: &HashMap<String, Tensor>,
    opts: &RunOptions,
    comm: Option<&GraphComm>,
) -> ExecResult<ExecReport> {
    exec(graph, &ordered_inputs(graph, inputs)?, opts, comm, None)
}

/// `inputs` in `graph`'s input order. Errors: a missing input.
fn ordered_inputs(graph: &Graph, inputs: &HashMap<String, Tensor>) -> ExecResult<Vec<Tensor>> {
    let mut ordered = Vec::with_capacity(graph.inputs.len());
    for name in graph.input_names() {
        let t = inputs.get(&name).ok_or_else(|| ExecError::Input {
            graph: graph.name.clone(),
            name: name.clone(),
            reason: "not provided".into(),
        })?;
        ordered.push(t.clone());
    }
    Ok(ordered)
}

/// Runs `graph` as one rank of a run: collectives over groups of more than one rank go through
/// `comm` (see the module doc); every member rank must run the same collectives in the same
/// order. Errors: wrong inputs, kernel failures, [`ExecError::Collective`] (a group the mesh does
/// not resolve, a timeout, an abort by another rank).
pub fn run_with(
    graph: &Graph,
    inputs: &[Tensor],
    opts: &RunOptions,
    comm: &GraphComm,
) -> ExecResult<ExecReport> {
    exec(graph, inputs, opts, Some(comm), None)
}
