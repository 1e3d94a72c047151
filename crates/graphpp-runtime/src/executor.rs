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

use crate::comm::{AllToAllOutput, Comm, CommError, Pending};
use crate::fusion::Fusion;
use crate::mesh::{Mesh, MeshError};
use candle_core::{CpuStorage, DType as CDType, Device, Tensor};
use graphpp_graph::{BinaryOp, CollectiveKind, CommGroup, DType, Graph, InputKind, Op, UnaryOp, ValueId};
use rayon::prelude::*;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use thiserror::Error;

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
    #[error("collective {kind} over group {group} (size {size}) at node %{node}: {source}")]
    Collective {
        /// Collective kind.
        kind: String,
        /// Graph group name.
        group: String,
        /// Graph group size.
        size: usize,
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

/// Why a graph collective failed.
#[derive(Debug, Error)]
pub enum CollectiveError {
    /// A group of more than one rank in a run without a communicator ([`run`], [`run_named`]).
    #[error("groups of more than one rank need a communicator (run_with)")]
    NoComm,
    /// The graph group does not resolve through the mesh (unknown name, wrong size).
    #[error(transparent)]
    Group(#[from] MeshError),
    /// The communicator failed (timeout, abort by another rank, mismatched contributions).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Swapping the collective's axis to dim 0 or back failed.
    #[error("moving the axis to dim 0: {0}")]
    Axis(Box<candle_core::Error>),
    /// A variable-count all-to-all whose counts or received rows do not fit (see
    /// [`CollectiveKind::AllToAllV`]).
    #[error("all_to_all_v: {0}")]
    Counts(String),
}

/// Where a graph's collectives run for one rank: its communicator, the mesh its graph groups
/// resolve through ([`Mesh::resolve`]), and how long a wait may take.
#[derive(Clone, Copy)]
pub struct GraphComm<'a> {
    /// This rank's communicator.
    pub comm: &'a dyn Comm,
    /// The mesh of the run.
    pub mesh: &'a Mesh,
    /// Bound on each collective's wait.
    pub timeout: Duration,
}

/// A started collective's handle.
enum Handle {
    Tensor(Pending<Tensor>),
    AllToAll(Pending<AllToAllOutput>),
    /// A variable-count all-to-all: the rows expected from each member and the padded row count.
    AllToAllV {
        pending: Pending<AllToAllOutput>,
        expected: Vec<usize>,
        rows: usize,
    },
}

/// A started collective: its handle, the start node, the axis to swap back to and when it was
/// started.
struct InFlight {
    handle: Handle,
    node: usize,
    axis: usize,
    started: Instant,
}

/// One collective over more than one rank as it ran (see [`RunReport::collectives`]):
/// `start ≤ wait ≤ end`. From `start` to `wait` the rank ran other nodes (compute, or waits on
/// other collectives) while the transfer progressed; from `wait` to `end` it was blocked on the
/// data.
#[derive(Clone, Debug)]
pub struct CollectiveSpan {
    /// Node id of the collective's start.
    pub node: usize,
    /// When the start was called.
    pub start: Instant,
    /// When the first node reading the result (normally the wait) asked for it.
    pub wait: Instant,
    /// When the result was there.
    pub end: Instant,
}

impl CollectiveSpan {
    /// A label for traces: the start node's region, kind and phase, e.g.
    /// `ep.dispatch all_to_all_v (forward)`.
    pub fn label(&self, graph: &Graph) -> String {
        let node = &graph.nodes[self.node];
        let kind = match &node.op {
            Op::CollectiveStart { kind, .. } => kind.name(),
            _ => "collective",
        };
        let region = match &node.meta.region {
            graphpp_graph::Region::Comm(name) => name.as_str(),
            graphpp_graph::Region::Compute => "compute",
        };
        let phase = match node.meta.phase {
            graphpp_graph::Phase::Forward => "forward",
            graphpp_graph::Phase::Backward => "backward",
            graphpp_graph::Phase::Recompute => "recompute",
        };
        format!("{region} {kind} ({phase})")
    }
}

/// A node's value: a tensor, or a collective still in flight.
enum Value {
    Ready(Tensor),
    InFlight(InFlight),
}

/// Swaps `axis` and dim 0 (its own inverse).
fn swap0(x: &Tensor, axis: usize) -> Result<Tensor, CollectiveError> {
    if axis == 0 {
        Ok(x.clone())
    } else {
        x.transpose(0, axis).map_err(|e| CollectiveError::Axis(Box::new(e)))
    }
}

/// Starts `kind` over `group` along `axis` on `args[0]` (identity for a group of size 1; an
/// all-to-all-v also reads its counts `args[1..3]`).
fn start(
    comm: Option<&GraphComm>,
    kind: CollectiveKind,
    group: &CommGroup,
    axis: usize,
    args: &[&Tensor],
    node: usize,
) -> Result<Value, CollectiveError> {
    let x = args[0];
    if group.size == 1 {
        return match kind {
            CollectiveKind::AllToAllV { rows } => Ok(Value::Ready(local_all_to_all_v(args, rows)?)),
            _ => Ok(Value::Ready(x.clone())),
        };
    }
    let c = comm.ok_or(CollectiveError::NoComm)?;
    let started = Instant::now();
    let g = c.mesh.resolve(group, c.comm.rank())?;
    // All-reduce keeps the shape: no axis to move.
    let axis = if kind == CollectiveKind::AllReduce { 0 } else { axis };
    let x = swap0(x, axis)?;
    let handle = match kind {
        CollectiveKind::AllReduce => Handle::Tensor(c.comm.all_reduce(&g, &x)?),
        CollectiveKind::AllGather => Handle::Tensor(c.comm.all_gather(&g, &x)?),
        CollectiveKind::ReduceScatter => Handle::Tensor(c.comm.reduce_scatter(&g, &x)?),
        CollectiveKind::AllToAll => {
            let rows = x.dims().first().copied().unwrap_or(0);
            let counts = vec![rows / g.size(); g.size()];
            Handle::AllToAll(c.comm.all_to_all(&g, &x, &counts)?)
        }
        CollectiveKind::AllToAllV { rows } => {
            let (send, expected) = (counts_of(args[1])?, counts_of(args[2])?);
            let sent: usize = send.iter().sum();
            if sent > x.dim(0).map_err(axis_err)? {
                return Err(CollectiveError::Counts(format!(
                    "send counts {send:?} add up to more than the {} rows given",
                    x.dims()[0]
                )));
            }
            let x = x.narrow(0, 0, sent).map_err(axis_err)?;
            Handle::AllToAllV { pending: c.comm.all_to_all(&g, &x, &send)?, expected, rows }
        }
    };
    Ok(Value::InFlight(InFlight { handle, node, axis, started }))
}

fn axis_err(e: candle_core::Error) -> CollectiveError {
    CollectiveError::Axis(Box::new(e))
}

/// A u32 count vector as `usize`s.
fn counts_of(t: &Tensor) -> Result<Vec<usize>, CollectiveError> {
    let v = t.to_vec1::<u32>().map_err(axis_err)?;
    Ok(v.into_iter().map(|c| c as usize).collect())
}

/// `data` (the rows received) padded with zeros to `rows` rows.
fn pad_rows(data: Tensor, rows: usize) -> Result<Tensor, CollectiveError> {
    let got = data.dim(0).map_err(axis_err)?;
    if got > rows {
        return Err(CollectiveError::Counts(format!(
            "received {got} rows, more than the {rows} the graph holds"
        )));
    }
    if got == rows {
        return Ok(data);
    }
    let mut dims = data.dims().to_vec();
    dims[0] = rows - got;
    let zeros = Tensor::zeros(dims, data.dtype(), data.device()).map_err(axis_err)?;
    Tensor::cat(&[&data, &zeros], 0).map_err(axis_err)
}

/// An all-to-all-v over a group of one: this rank's sent rows come back to it.
fn local_all_to_all_v(args: &[&Tensor], rows: usize) -> Result<Tensor, CollectiveError> {
    let (send, recv) = (counts_of(args[1])?, counts_of(args[2])?);
    if send != recv {
        return Err(CollectiveError::Counts(format!("a group of one sends {send:?} but expects {recv:?}")));
    }
    let sent = args[0].narrow(0, 0, send.iter().sum()).map_err(axis_err)?;
    pad_rows(sent, rows)
}

/// Waits for a started collective and swaps its axis back.
fn complete(f: InFlight, timeout: Duration) -> Result<Tensor, CollectiveError> {
    let t = match f.handle {
        Handle::Tensor(p) => p.wait(timeout)?,
        Handle::AllToAll(p) => p.wait(timeout)?.data,
        Handle::AllToAllV { pending, expected, rows } => {
            let out = pending.wait(timeout)?;
            if out.recv_counts != expected {
                return Err(CollectiveError::Counts(format!(
                    "received {:?} rows per member, the graph expected {expected:?}",
                    out.recv_counts
                )));
            }
            pad_rows(out.data, rows)?
        }
    };
    swap0(&t, f.axis)
}

/// The [`ExecError::Collective`] of the collective started at `node`.
fn collective_error(graph: &Graph, node: usize, source: CollectiveError) -> ExecError {
    let (kind, group) = match &graph.nodes[node].op {
        Op::CollectiveStart { kind, group, .. } => (kind.name().to_string(), group.clone()),
        other => (other.mnemonic(), CommGroup { name: "?".into(), size: 0 }),
    };
    ExecError::Collective { kind, group: group.name, size: group.size, node, source: Box::new(source) }
}

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
pub struct RunReport {
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

impl RunReport {
    /// Output called `name` of `graph`.
    pub fn output(&self, graph: &Graph, name: &str) -> Option<&Tensor> {
        graph.outputs.iter().position(|o| o.name == name).map(|i| &self.outputs[i])
    }
}

/// candle dtype of an IR dtype.
pub fn candle_dtype(d: DType) -> CDType {
    match d {
        DType::F32 => CDType::F32,
        DType::F64 => CDType::F64,
        DType::BF16 => CDType::BF16,
        DType::U32 => CDType::U32,
    }
}

/// Runs `graph` on `inputs` (in the graph's input order) without a communicator: collectives
/// over groups of size 1 only. Errors: wrong inputs, kernel failures,
/// [`CollectiveError::NoComm`] for a larger group.
pub fn run(graph: &Graph, inputs: &[Tensor], opts: &RunOptions) -> ExecResult<RunReport> {
    exec(graph, inputs, opts, None, None)
}

/// Runs `graph` binding its inputs by name. Errors: a missing input.
pub fn run_named(
    graph: &Graph,
    inputs: &HashMap<String, Tensor>,
    opts: &RunOptions,
) -> ExecResult<RunReport> {
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
) -> ExecResult<RunReport> {
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
) -> ExecResult<RunReport> {
    exec(graph, inputs, opts, Some(comm), None)
}

/// A graph compiled once for many runs (docs/ARCHITECTURE.md "Runtime" → Compiled executor): its
/// f32 elementwise chains fused into single-pass kernels ([`crate::fusion`]), an execution
/// order with independent matmuls side by side ([`crate::pairs`]) and, per node, the values the
/// run drops after it. [`Program::run_named_with`] computes bitwise what the interpreter
/// ([`run_named_with`]) computes and reports the same peak live bytes (the logical accounting
/// of the module doc, which the memory model predicts: a pair is kept only where its order
/// peaks exactly as the graph's; a fused group's inner values are never allocated, so the
/// memory actually held is at most that). With [`RunOptions::time_nodes`] a group's time is
/// its anchor's (its members read zero) and a pair's is its first product's (the second reads
/// about zero), and [`RunOptions::trace_peak`] lists only the values the run held.
#[derive(Clone, Debug)]
pub struct Program {
    /// Node count of the graph compiled (a run checks it).
    nodes: usize,
    fusion: Fusion,
    /// `frees[i]`: the values no node after `i` reads.
    frees: Vec<Vec<usize>>,
    /// Row-major copies of transposed parameters, kept across runs ([`crate::transposed`]).
    transposed: crate::transposed::Cache,
    /// The execution order and the matmuls that run side by side ([`crate::pairs`]).
    pairs: crate::pairs::Pairs,
}

impl Program {
    /// Compiles `graph`: the fusion plan, the pairs (each candidate pair costs one pass of the
    /// live-byte accounting over the graph) and the frees; nothing is run.
    pub fn compile(graph: &Graph) -> Program {
        let fusion = crate::fusion::plan(graph);
        let n = graph.nodes.len();
        // A fused group's inner member is never computed on its own.
        let runs: Vec<bool> =
            (0..n).map(|i| fusion.member_of[i].is_none_or(|g| fusion.groups[g].anchor == i)).collect();
        let pairs = crate::pairs::plan(graph, &runs, |p| peak_in_order(graph, &p.order, &p.partner));
        // Each value is freed after its last reader in the execution order.
        let mut last_read: Vec<Option<usize>> = vec![None; n];
        for &i in pairs.order.iter().filter(|&&i| runs[i]) {
            let reads = match fusion.member_of[i] {
                Some(g) => &fusion.groups[g].inputs,
                None => &graph.nodes[i].inputs,
            };
            for x in reads {
                last_read[x.0] = Some(i);
            }
        }
        let mut freed = runs;
        for o in &graph.outputs {
            freed[o.value.0] = false; // kept to the end: never freed
        }
        let mut frees = vec![Vec::new(); n];
        for v in (0..n).filter(|&v| freed[v]) {
            frees[last_read[v].unwrap_or(v)].push(v);
        }
        Program { nodes: n, fusion, frees, transposed: crate::transposed::Cache::plan(graph), pairs }
    }

    /// The execution order and its side-by-side matmuls ([`crate::pairs`]).
    pub fn pairs(&self) -> &crate::pairs::Pairs {
        &self.pairs
    }

    /// The fusion groups.
    pub fn fusion(&self) -> &Fusion {
        &self.fusion
    }

    /// Drops the row-major copies of transposed parameters this program keeps across runs
    /// ([`crate::transposed`]): their sources are going away (a stage's RESHARD).
    pub fn clear_kept(&self) {
        self.transposed.clear();
    }

    /// [`run_named_with`] through this program; `graph` must be the graph it was compiled from.
    ///
    /// # Errors
    /// Those of [`run_named_with`]; [`ExecError::Input`] when `graph` has another node count
    /// than the graph compiled.
    pub fn run_named_with(
        &self,
        graph: &Graph,
        inputs: &HashMap<String, Tensor>,
        opts: &RunOptions,
        comm: Option<&GraphComm>,
    ) -> ExecResult<RunReport> {
        debug_assert_eq!(
            crate::fusion::plan(graph),
            self.fusion,
            "a program runs the graph it was compiled from"
        );
        if graph.nodes.len() != self.nodes {
            return Err(ExecError::Input {
                graph: graph.name.clone(),
                name: "*".into(),
                reason: format!("compiled for {} nodes, the graph has {}", self.nodes, graph.nodes.len()),
            });
        }
        exec(graph, &ordered_inputs(graph, inputs)?, opts, comm, Some(self))
    }
}

fn exec(
    graph: &Graph,
    inputs: &[Tensor],
    opts: &RunOptions,
    comm: Option<&GraphComm>,
    program: Option<&Program>,
) -> ExecResult<RunReport> {
    if cfg!(debug_assertions) {
        graphpp_graph::verify(graph)?;
    }
    if inputs.len() != graph.inputs.len() {
        return Err(ExecError::Input {
            graph: graph.name.clone(),
            name: "*".into(),
            reason: format!("expected {} inputs, got {}", graph.inputs.len(), inputs.len()),
        });
    }
    let n = graph.nodes.len();
    let mut live = Liveness::new(graph);
    let mut vals: Vec<Option<Value>> = (0..n).map(|_| None).collect();
    let mut times = opts.time_nodes.then(|| vec![Duration::ZERO; n]);
    let mut next_input = 0;
    let mut at_peak = Vec::new();
    let mut spans = Vec::new();
    let graph_order: Vec<usize>;
    let order = match program {
        Some(p) => &p.pairs.order,
        None => {
            graph_order = (0..n).collect();
            &graph_order
        }
    };
    // The value of a pair's second matmul, computed beside the first (it comes next in `order`),
    // and the first, whose operands are released with the second's.
    let mut early: Option<(usize, Tensor)> = None;
    let mut deferred: Option<usize> = None;
    for &i in order {
        let node = &graph.nodes[i];
        let t0 = Instant::now();
        let value = if let Op::Input { name, ty, .. } = &node.op {
            let t = inputs[next_input].clone();
            next_input += 1;
            if t.dims() != ty.shape.as_slice() || t.dtype() != candle_dtype(ty.dtype) {
                return Err(ExecError::Input {
                    graph: graph.name.clone(),
                    name: name.clone(),
                    reason: format!("expected {ty}, got {:?} {:?}", t.dtype(), t.dims()),
                });
            }
            Value::Ready(t)
        } else if let Some((_, t)) = early.take_if(|(j, _)| *j == i) {
            // A pair's second value, computed beside the first.
            Value::Ready(t)
        } else {
            let group = program.and_then(|p| p.fusion.member_of[i].map(|g| &p.fusion.groups[g]));
            let reads = match group {
                // A fused group's inner value is never computed (its anchor computes the group).
                Some(g) if g.anchor != i => {
                    live.produce(i);
                    live.release(i, &node.inputs, |_| {});
                    continue;
                }
                Some(g) => &g.inputs,
                None => &node.inputs,
            };
            // A collective in flight completes when a node first reads it (normally its wait).
            for x in reads {
                if let Some(Value::InFlight(_)) = vals[x.0] {
                    let Some(Value::InFlight(f)) = vals[x.0].take() else { unreachable!("matched above") };
                    let t = finish(graph, f, comm, &mut spans)?;
                    vals[x.0] = Some(Value::Ready(t));
                }
            }
            let args = operands(&vals, reads);
            match (&node.op, group) {
                (_, Some(g)) => Value::Ready(g.eval(&args).map_err(|e| kernel_error(graph, i, e))?),
                (Op::CollectiveStart { kind, group, axis }, None) => {
                    start(comm, *kind, group, *axis, &args, i).map_err(|e| collective_error(graph, i, e))?
                }
                (Op::Permute { perm }, None) if program.is_some_and(|p| p.transposed.keeps(i)) => {
                    let p = program.expect("matched above");
                    Value::Ready(p.transposed.get(i, args[0], perm).map_err(|e| kernel_error(graph, i, e))?)
                }
                (Op::Matmul, None) if program.is_some() => {
                    let p = program.expect("matched above");
                    match p.pairs.partner[i] {
                        Some(j) => {
                            let (vi, vj) = matmul_pair(
                                graph,
                                [i, j],
                                [&args, &operands(&vals, &graph.nodes[j].inputs)],
                            )?;
                            early = Some((j, vj));
                            Value::Ready(vi)
                        }
                        None => Value::Ready(
                            compiled_matmul(args[0], args[1], Threads::Pool)
                                .map_err(|e| kernel_error(graph, i, e))?,
                        ),
                    }
                }
                (op, None) => Value::Ready(eval(graph, i, op, &args)?),
            }
        };
        if live.produce(i) && opts.trace_peak {
            at_peak = (0..n).filter(|&j| vals[j].is_some() || j == i).map(ValueId).collect();
        }
        vals[i] = Some(value);
        match program {
            Some(p) => {
                for k in released(i, &p.pairs.partner, &mut deferred) {
                    live.release(k, &graph.nodes[k].inputs, |_| {});
                    for &j in &p.frees[k] {
                        vals[j] = None;
                    }
                }
            }
            None => live.release(i, &node.inputs, |j| vals[j] = None),
        }
        if let Some(t) = times.as_mut() {
            t[i] = t0.elapsed();
        }
    }
    let mut outputs = Vec::with_capacity(graph.outputs.len());
    for o in &graph.outputs {
        let t = match vals[o.value.0].take() {
            Some(Value::Ready(t)) => t,
            // An output read straight from a start: complete it here.
            Some(Value::InFlight(f)) => finish(graph, f, comm, &mut spans)?,
            None => unreachable!("outputs are kept"),
        };
        vals[o.value.0] = Some(Value::Ready(t.clone()));
        outputs.push(t);
    }
    let live_at_peak = opts.trace_peak.then_some(at_peak);
    Ok(RunReport { outputs, peak_live_bytes: live.peak, node_times: times, live_at_peak, collectives: spans })
}

/// Completes `f` (waiting at most the communicator's timeout) and records its span.
fn finish(
    graph: &Graph,
    f: InFlight,
    comm: Option<&GraphComm>,
    spans: &mut Vec<CollectiveSpan>,
) -> ExecResult<Tensor> {
    let (node, start, wait) = (f.node, f.started, Instant::now());
    let timeout = comm.map_or(Duration::ZERO, |c| c.timeout);
    let t = complete(f, timeout).map_err(|e| collective_error(graph, node, e))?;
    spans.push(CollectiveSpan { node, start, wait, end: Instant::now() });
    Ok(t)
}

/// The peak live bytes a run of `graph` reports ([`RunReport::peak_live_bytes`]), from the
/// value types alone: the same accounting (module doc), without running anything. Exact for
/// every graph whose value shapes are static (all of graphpp's); a compiled [`Program`] runs
/// the nodes in another order only where that order peaks exactly as high ([`crate::pairs`]).
pub fn peak_live_bytes(graph: &Graph) -> usize {
    let n = graph.nodes.len();
    peak_in_order(graph, &(0..n).collect::<Vec<_>>(), &vec![None; n])
}

/// [`peak_live_bytes`] over the nodes run in `order` (every node once, a topological order),
/// where `partner[i] = Some(j)` runs `j` beside `i` ([`crate::pairs`]): both values exist before
/// either node's operands are released, as [`exec`] holds them.
fn peak_in_order(graph: &Graph, order: &[usize], partner: &[Option<usize>]) -> usize {
    let mut live = Liveness::new(graph);
    let mut deferred = None;
    for &i in order {
        live.produce(i);
        for k in released(i, partner, &mut deferred) {
            live.release(k, &graph.nodes[k].inputs, |_| {});
        }
    }
    live.peak
}

/// The nodes whose operands are released once node `i` has run: none after the first of a pair
/// (kept in `deferred`), both after its partner, else `i` — a pair's two values exist at once
/// ([`crate::pairs`]). The one rule of the run ([`exec`]) and its accounting ([`peak_in_order`]).
fn released(
    i: usize,
    partner: &[Option<usize>],
    deferred: &mut Option<usize>,
) -> impl Iterator<Item = usize> {
    if partner[i].is_some() {
        *deferred = Some(i);
        None.into_iter().chain(None)
    } else {
        deferred.take().into_iter().chain(Some(i))
    }
}

/// The values `reads`, each computed and complete (an operand in flight is completed before it
/// is read; a pair's second node reads only values computed before the first).
fn operands<'a>(vals: &'a [Option<Value>], reads: &[ValueId]) -> Vec<&'a Tensor> {
    reads
        .iter()
        .map(|x| match &vals[x.0] {
            Some(Value::Ready(t)) => t,
            _ => unreachable!("live operand, completed before it is read"),
        })
        .collect()
}

/// The products of matmuls `nodes` from their `args`, side by side on one thread each where the
/// pool has two or more ([`crate::pairs`]), else one after the other.
fn matmul_pair(graph: &Graph, nodes: [usize; 2], args: [&[&Tensor]; 2]) -> ExecResult<(Tensor, Tensor)> {
    let product = |k: usize, threads: Threads| {
        compiled_matmul(args[k][0], args[k][1], threads).map_err(|e| kernel_error(graph, nodes[k], e))
    };
    let (a, b) = if rayon::current_num_threads() > 1 {
        rayon::join(|| product(0, Threads::One), || product(1, Threads::One))
    } else {
        (product(0, Threads::Pool), product(1, Threads::Pool))
    };
    Ok((a?, b?))
}

/// The executor's live-byte accounting (module doc): each value counted from when its node runs
/// until its last use (outputs to the end), state and values of state alone not at all.
struct Liveness {
    /// Remaining uses of each value (`usize::MAX` for an output: never freed).
    uses: Vec<usize>,
    /// Bytes each value counts while it lives.
    bytes: Vec<usize>,
    live: usize,
    /// Largest `live` so far.
    peak: usize,
}

impl Liveness {
    fn new(graph: &Graph) -> Self {
        let mut uses = vec![0usize; graph.nodes.len()];
        for node in &graph.nodes {
            for x in &node.inputs {
                uses[x.0] += 1;
            }
        }
        for o in &graph.outputs {
            uses[o.value.0] = usize::MAX;
        }
        let state = state_derived(graph);
        let bytes =
            graph.nodes.iter().zip(&state).map(|(n, &s)| if s { 0 } else { n.ty.size_bytes() }).collect();
        Liveness { uses, bytes, live: 0, peak: 0 }
    }

    /// Node `i`'s value now lives; whether that makes a new peak.
    #[inline]
    fn produce(&mut self, i: usize) -> bool {
        self.live += self.bytes[i];
        let new_peak = self.live > self.peak;
        self.peak = self.peak.max(self.live);
        new_peak
    }

    /// After node `i` (reading `inputs`) ran: frees it if nothing reads it and each input it
    /// was the last use of, calling `free` with each freed value.
    #[inline]
    fn release(&mut self, i: usize, inputs: &[ValueId], mut free: impl FnMut(usize)) {
        if self.uses[i] == 0 {
            free(i);
            self.live -= self.bytes[i];
        }
        for x in inputs {
            if self.uses[x.0] != usize::MAX {
                self.uses[x.0] -= 1;
                if self.uses[x.0] == 0 {
                    free(x.0);
                    self.live -= self.bytes[x.0];
                }
            }
        }
    }
}

/// Values computed only from parameters and buffers (no constants, no collectives).
fn state_derived(g: &Graph) -> Vec<bool> {
    let mut s = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        s[i] = match &n.op {
            Op::Input { kind, .. } => matches!(kind, InputKind::Parameter | InputKind::Buffer),
            Op::Full { .. } | Op::CollectiveStart { .. } | Op::CollectiveWait => false,
            _ => n.inputs.iter().all(|x| s[x.0]),
        };
    }
    s
}

/// σ(x) = 1 / (1 + e^(−x)) in one pass over a contiguous f32/f64 tensor (the same arithmetic as
/// the four-op form used otherwise: negate, exp, add 1, reciprocal). A bf16 operand is computed
/// in f32 and rounded to bf16 once, as a GPU kernel does (the four-op form would round four times).
fn sigmoid(x: &Tensor) -> candle_core::Result<Tensor> {
    if x.dtype() == CDType::BF16 {
        return sigmoid(&x.to_dtype(CDType::F32)?)?.to_dtype(CDType::BF16);
    }
    if x.is_contiguous() && matches!(x.dtype(), CDType::F32 | CDType::F64) {
        x.apply_op1_no_bwd(&SigmoidOp)
    } else {
        (x.neg()?.exp()? + 1.0)?.recip()
    }
}

/// The one-pass CPU sigmoid kernel of [`sigmoid`].
struct SigmoidOp;

impl candle_core::CustomOp1 for SigmoidOp {
    fn name(&self) -> &'static str {
        "sigmoid"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::CpuStorage as S;
        let Some((lo, hi)) = layout.contiguous_offsets() else {
            candle_core::bail!("sigmoid kernel needs a contiguous input")
        };
        let out = match storage {
            S::F32(v) => S::F32(v[lo..hi].iter().map(|&x| 1.0 / ((-x).exp() + 1.0)).collect()),
            S::F64(v) => S::F64(v[lo..hi].iter().map(|&x| 1.0 / ((-x).exp() + 1.0)).collect()),
            _ => candle_core::bail!("sigmoid kernel takes f32 or f64"),
        };
        Ok((out, layout.shape().clone()))
    }
}

/// Batched matmul on the lhs's own strides and a row-major rhs: a rhs whose rows are not
/// contiguous (a transposed weight) is copied first, as gemm reads it faster so and a compiled
/// program reads its kept copy ([`crate::transposed`]: the same bits); operands whose layout
/// candle's matmul cannot take (e.g. a permuted 4-D view) are made contiguous first.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let copied;
    let b = if b.rank() >= 2 && b.stride()[b.rank() - 1] != 1 && b.dims()[b.rank() - 1] > 1 {
        copied = b.contiguous()?;
        &copied
    } else {
        b
    };
    match a.matmul(b) {
        Err(e) if is_striding(&e) => a.contiguous()?.matmul(&b.contiguous()?),
        r => r,
    }
}

/// The threads a compiled matmul runs on.
#[derive(Clone, Copy, Debug)]
enum Threads {
    /// The current pool's (gemm's split, batch elements split): a product on its own.
    Pool,
    /// One (gemm unthreaded, batch elements in turn): one product of a pair ([`crate::pairs`]).
    One,
}

/// The compiled executor's matmul: an f32 product of rank 2–4 runs as [`batched_gemm`]
/// on the operands [`batched_operands`] picks — each read in place where that gives the bits of
/// its copy; every other product is the interpreter's [`matmul`]. The same bits as [`matmul`]
/// (`matmul_tests`, `tests/compiled.rs`).
fn compiled_matmul(a: &Tensor, b: &Tensor, threads: Threads) -> candle_core::Result<Tensor> {
    // A dim of 1 sends gemm down a path whose sums depend on the strides (a 2 × 3 · 3 × 1
    // product of a transposed lhs differed from its copy's): those are left to `matmul`.
    let (da, db) = (a.dims(), b.dims());
    let unit = da.len() < 2 || db.len() < 2 || da[da.len() - 2..].contains(&1) || db[db.len() - 1] == 1;
    match if unit { None } else { batched_operands(a, b)? } {
        Some((a, b)) => batched_gemm(&a, &b, threads),
        None => matmul(a, b),
    }
}

/// The operands [`batched_gemm`] reads for `a · b`, each as it is or its contiguous copy, or
/// `None` for a product it does not take — not f32 of rank 2–4, an empty dim, batch or inner
/// dims that do not match, or a stride-0 batch dim (an operand broadcast over the batch: left to
/// candle, which folds a batch-invariant rhs into one product). A rhs whose rows are not
/// contiguous is copied, as [`matmul`] copies it (kᵀ: gemm's sums change with a transposed
/// rhs's layout, a 2 × 3 · 3 × 2 product differed by 1 ulp). Where candle refuses the operands
/// (batch dims that do not collapse into one stride: heads-split q, k, v in an attention composed
/// of matmuls) and
/// [`matmul`] copies both, this keeps every operand whose layout gives its copy's bits — a lhs
/// candle can step through (softmax's transposed Pᵀ: beside a rhs with contiguous rows, the
/// only kind passed here, gemm's sums do not depend on the lhs's orientation) and any operand
/// whose rows are contiguous (a permuted q, k or v: its copy differs only in the row stride,
/// which gemm's sums do not depend on). A rank-2 lhs is kept as it is, on any strides, as
/// candle's matmul takes it (a weight gradient's transposed activations).
fn batched_operands(a: &Tensor, b: &Tensor) -> candle_core::Result<Option<(Tensor, Tensor)>> {
    let (da, db) = (a.dims(), b.dims());
    let r = da.len();
    let f32s = a.dtype() == CDType::F32 && b.dtype() == CDType::F32;
    let batch_ok = |t: &Tensor| t.stride()[..r - 2].iter().all(|&s| s > 0);
    if !(2..=4).contains(&r)
        || db.len() != r
        || !f32s
        || da.iter().chain(db).any(|&d| d == 0)
        || da[..r - 2] != db[..r - 2]
        || da[r - 1] != db[r - 2]
        || !batch_ok(a)
        || !batch_ok(b)
    {
        return Ok(None);
    }
    let rows_contiguous = |t: &Tensor| t.stride()[r - 1] == 1;
    let a = if r == 2 || batch_skip(a).is_some() || rows_contiguous(a) { a.clone() } else { a.contiguous()? };
    let b = if rows_contiguous(b) { b.clone() } else { b.contiguous()? };
    Ok(Some((a, b)))
}

/// The stride between consecutive batch elements of a rank-3 or rank-4 operand, where its batch
/// dims collapse into one stride — candle's rule for the operands its matmul takes; `None` where
/// they do not.
fn batch_skip(t: &Tensor) -> Option<usize> {
    let (dims, strides) = (t.dims(), t.stride());
    match (&dims[..dims.len() - 2], &strides[..strides.len() - 2]) {
        ([_], &[s]) => Some(s),
        ([_, d1], &[s0, s1]) if s0 == s1 * d1 => Some(s1),
        ([1, _], &[_, s1]) => Some(s1),
        ([_, 1], &[s0, _]) => Some(s0),
        _ => None,
    }
}

/// A batched f32 product `[.., m, k] · [.., k, n]` (rank 2–4, the operands' batch dims equal:
/// those [`batched_operands`] passes) on the operands' own strides: per batch element the gemm call candle's matmul makes (same
/// sizes, strides within the element, and parallelism, so the same bits), each element's
/// operands found from its batch index through each batch dim's stride (candle needs the batch
/// dims to collapse into one). On a pool of two or more threads the elements are split over
/// it: per-head products (64 × 64 × 32 and alike) are each too small for gemm to split.
fn batched_gemm(a: &Tensor, b: &Tensor, threads: Threads) -> candle_core::Result<Tensor> {
    let (da, db) = (a.dims(), b.dims());
    let r = da.len();
    let (m, k, n) = (da[r - 2], da[r - 1], db[r - 1]);
    debug_assert!((2..=4).contains(&r) && db.len() == r && db[..r - 2] == da[..r - 2] && db[r - 2] == k);
    let batch_dims = &da[..r - 2];
    let batch: usize = batch_dims.iter().product();
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (candle_core::Storage::Cpu(CpuStorage::F32(va)), candle_core::Storage::Cpu(CpuStorage::F32(vb))) =
        (&*sa, &*sb)
    else {
        candle_core::bail!("batched_gemm takes CPU f32 tensors")
    };
    let (lhs, rhs) = (&va[la.start_offset()..], &vb[lb.start_offset()..]);
    let (ls, rs) = (la.stride(), lb.stride());
    // Batch element i's first element in an operand of strides `s`.
    let offset = |s: &[usize], i: usize| {
        let mut rest = i;
        let mut off = 0;
        for d in (0..r - 2).rev() {
            off += (rest % batch_dims[d]) * s[d];
            rest /= batch_dims[d];
        }
        off
    };
    // The last element an operand's strides reach must lie in its storage.
    let reach = |s: &[usize], rows: usize, cols: usize| {
        offset(s, batch - 1) + (rows - 1) * s[r - 2] + (cols - 1) * s[r - 1] + 1
    };
    if reach(ls, m, k) > lhs.len() || reach(rs, k, n) > rhs.len() {
        candle_core::bail!("batched_gemm: operands {da:?} · {db:?} reach outside their storage")
    }
    let pool = matches!(threads, Threads::Pool);
    let gemm_threads = if pool { candle_core::utils::get_num_threads() } else { 1 };
    let parallelism =
        if gemm_threads > 1 { gemm::Parallelism::Rayon(gemm_threads) } else { gemm::Parallelism::None };
    let element = |i: usize, dst: &mut [std::mem::MaybeUninit<f32>]| {
        // SAFETY: batch element i's operands lie in `lhs` and `rhs` (the reach checked above:
        // offsets grow with every index), and `dst` holds its contiguous m × n result.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr().cast::<f32>(),
                1,
                n as isize,
                false,
                lhs[offset(ls, i)..].as_ptr(),
                ls[r - 1] as isize,
                ls[r - 2] as isize,
                rhs[offset(rs, i)..].as_ptr(),
                rs[r - 1] as isize,
                rs[r - 2] as isize,
                0f32,
                1f32,
                false,
                false,
                false,
                parallelism,
            )
        }
    };
    // Not zeroed (candle zeroes its output first: ~5% of `small`'s fwbw in `perf`): gemm with
    // `read_dst` false writes every element of each m × n block before it reads any.
    let mut out: Vec<f32> = Vec::with_capacity(batch * m * n);
    let spare = &mut out.spare_capacity_mut()[..batch * m * n];
    if batch > 1 && pool && rayon::current_num_threads() > 1 {
        spare.par_chunks_mut(m * n).enumerate().for_each(|(i, dst)| element(i, dst));
    } else {
        spare.chunks_mut(m * n).enumerate().for_each(|(i, dst)| element(i, dst));
    }
    // SAFETY: each batch element's gemm wrote its m × n block (above), and the blocks tile `out`.
    unsafe { out.set_len(batch * m * n) };
    drop((sa, sb));
    Tensor::from_vec(out, batch_dims.iter().copied().chain([m, n]).collect::<Vec<_>>(), &Device::Cpu)
}

/// candle's refusal of operands whose batch dims do not collapse into one stride.
fn is_striding(e: &candle_core::Error) -> bool {
    match e {
        candle_core::Error::MatMulUnexpectedStriding(_) => true,
        candle_core::Error::WithBacktrace { inner, .. } => is_striding(inner),
        _ => false,
    }
}

/// `a f b` with broadcasting for the arithmetic ops.
///
/// bf16 operands are widened to f32 by the caller and the f32 result rounded once: the same
/// values candle's bf16 kernels produce (they compute each element in f32 and round), but its
/// CPU bf16 add re-detects the CPU's bf16 instructions per 8 elements and ran ~5× slower than
/// widening (`perf` of `graphpp train --dtype bf16`: half the step time in that add).
fn arithmetic(f: BinaryOp, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    match f {
        BinaryOp::Add => a.broadcast_add(b),
        BinaryOp::Sub => a.broadcast_sub(b),
        BinaryOp::Mul => a.broadcast_mul(b),
        BinaryOp::Div => a.broadcast_div(b),
        BinaryOp::Eq => a.broadcast_eq(b)?.to_dtype(a.dtype()),
    }
}

/// `f` of a CPU f32 tensor's elements in row-major order, read in place where the tensor is
/// contiguous (copied first where it is not).
///
/// # Errors
/// A tensor that is not a CPU f32 one; candle's, from the copy.
pub(crate) fn read_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
        candle_core::bail!("expected a CPU f32 tensor, got {:?}", t.dtype())
    };
    Ok(f(&data[layout.start_offset()..layout.start_offset() + t.elem_count()]))
}

/// RoPE's rotate-half along the last axis ([`Op::RotateHalf`]): `[−x2, x1]` for halves `x1`,
/// `x2`. An f32 operand in one pass over its rows (negation and copies are exact: the bits of
/// the slice-negate-concatenate it replaces); others through candle's narrow, neg and cat.
fn rotate_half(x: &Tensor) -> candle_core::Result<Tensor> {
    let Some(last) = x.rank().checked_sub(1) else { candle_core::bail!("rotate_half of a scalar") };
    let n = x.dims()[last];
    if !n.is_multiple_of(2) {
        candle_core::bail!("rotate_half needs a last axis of even length, got {:?}", x.dims())
    }
    let h = n / 2;
    if x.dtype() != CDType::F32 || h == 0 {
        let (x1, x2) = (x.narrow(last, 0, h)?, x.narrow(last, h, h)?);
        return Tensor::cat(&[&x2.neg()?, &x1], last);
    }
    let out = read_f32(x, |src| {
        let mut out = vec![0f32; src.len()];
        for (y, row) in out.chunks_exact_mut(n).zip(src.chunks_exact(n)) {
            let (y1, y2) = y.split_at_mut(h);
            for (o, &v) in y1.iter_mut().zip(&row[h..]) {
                *o = -v;
            }
            y2.copy_from_slice(&row[..h]);
        }
        out
    })?;
    Tensor::from_vec(out, x.dims(), &Device::Cpu)
}

/// Sum over `axis`. A bf16 operand is summed in f32 and the result rounded to bf16 once (candle's
/// CPU sum would accumulate in bf16, losing the small terms of a long sum; GPU reductions
/// accumulate in f32).
fn sum(x: &Tensor, axis: usize, keepdim: bool) -> candle_core::Result<Tensor> {
    if x.dtype() == CDType::F32 && axis + 1 < x.rank() {
        return sum_rows(x, axis, keepdim);
    }
    let wide = if x.dtype() == CDType::BF16 { x.to_dtype(CDType::F32)? } else { x.clone() };
    let s = if keepdim { wide.sum_keepdim(axis)? } else { wide.sum(axis)? };
    s.to_dtype(x.dtype())
}

/// The [`ExecError::Kernel`] of node `i`.
fn kernel_error(graph: &Graph, i: usize, e: candle_core::Error) -> ExecError {
    let node = &graph.nodes[i];
    ExecError::Kernel {
        graph: graph.name.clone(),
        node: i,
        op: node.op.mnemonic(),
        scope: node.meta.scope.clone(),
        source: Box::new(e),
    }
}

/// Sum of an f32 tensor over a non-last `axis`, as whole rows: viewing `x` as `[A, K, B]` (`K` the
/// axis), `out[a] = Σ_k x[a, k]` with rows of `B` added in ascending `k` from 0.0 — each element's
/// additions in candle's order (its CPU sum visits the source in row-major order), so the same
/// bits, but a vectorised pass over rows instead of one index computation per element (the
/// RMSNorm weight gradients' sums over batch and sequence took 0.4 ms per 32k elements).
fn sum_rows(x: &Tensor, axis: usize, keepdim: bool) -> candle_core::Result<Tensor> {
    let dims = x.dims();
    let (a, k) = (dims[..axis].iter().product::<usize>(), dims[axis]);
    let b: usize = dims[axis + 1..].iter().product();
    let out = read_f32(x, |src| {
        let mut out = vec![0f32; a * b];
        for (o, block) in out.chunks_mut(b.max(1)).zip(src.chunks((k * b).max(1))) {
            for row in block.chunks(b.max(1)) {
                o.iter_mut().zip(row).for_each(|(o, &v)| *o += v);
            }
        }
        out
    })?;
    let mut shape = dims.to_vec();
    if keepdim {
        shape[axis] = 1;
    } else {
        shape.remove(axis);
    }
    Tensor::from_vec(out, shape, &Device::Cpu)
}

fn eval(graph: &Graph, i: usize, op: &Op, a: &[&Tensor]) -> ExecResult<Tensor> {
    if let Op::CollectiveWait = op {
        // The start's value was completed when this node read it.
        return Ok(a[0].clone());
    }
    kernel(op, a, &graph.nodes[i].ty).map_err(|e| kernel_error(graph, i, e))
}

fn kernel(op: &Op, a: &[&Tensor], ty: &graphpp_graph::TensorType) -> candle_core::Result<Tensor> {
    Ok(match op {
        Op::Input { .. } | Op::CollectiveStart { .. } | Op::CollectiveWait => {
            unreachable!("handled by caller")
        }
        Op::Full { value, ty } => {
            (Tensor::zeros(ty.shape.clone(), candle_dtype(ty.dtype), &Device::Cpu)? + *value)?
        }
        Op::Unary { f } => match f {
            UnaryOp::Neg => a[0].neg()?,
            UnaryOp::Exp => a[0].exp()?,
            UnaryOp::Log => a[0].log()?,
            UnaryOp::Sqrt => a[0].sqrt()?,
            UnaryOp::Recip => a[0].recip()?,
            UnaryOp::Sigmoid => sigmoid(a[0])?,
            UnaryOp::Erf => a[0].erf()?,
        },
        Op::Affine { mul, add } => a[0].affine(*mul, *add)?,
        Op::Binary { f: BinaryOp::Eq } => a[0].broadcast_eq(a[1])?.to_dtype(a[0].dtype())?,
        Op::Binary { f } if a[0].dtype() == CDType::BF16 => {
            let (x, y) = (a[0].to_dtype(CDType::F32)?, a[1].to_dtype(CDType::F32)?);
            arithmetic(*f, &x, &y)?.to_dtype(CDType::BF16)?
        }
        Op::Binary { f } => arithmetic(*f, a[0], a[1])?,
        Op::Sum { axis, keepdim } => sum(a[0], *axis, *keepdim)?,
        Op::Max { axis, keepdim } => {
            if *keepdim {
                a[0].max_keepdim(*axis)?
            } else {
                a[0].max(*axis)?
            }
        }
        Op::Softmax { axis, scale } => crate::softmax::softmax(a[0], a.get(1).copied(), *axis, *scale)?,
        Op::SoftmaxBackward { axis, scale } => crate::softmax::softmax_backward(a[0], a[1], *axis, *scale)?,
        Op::Attention { scale } => crate::attention::attention(a[0], a[1], a[2], a[3], *scale)?,
        Op::AttentionBackward { scale } => {
            crate::attention::attention_backward(a[0], a[1], a[2], a[3], a[4], a[5], *scale)?
        }
        Op::RotateHalf => rotate_half(a[0])?,
        Op::LogSoftmax { axis } => crate::softmax::log_softmax(a[0], *axis)?,
        Op::LogSoftmaxBackward { axis } => crate::softmax::log_softmax_backward(a[0], a[1], *axis)?,
        Op::Matmul => matmul(a[0], a[1])?,
        Op::Reshape { shape } => a[0].contiguous()?.reshape(shape.clone())?,
        Op::Permute { perm } => a[0].permute(perm.clone())?,
        Op::Broadcast { shape } => a[0].broadcast_as(shape.clone())?,
        Op::Slice { axis, start, end } => a[0].narrow(*axis, *start, end - start)?,
        Op::Concat { axis } => Tensor::cat(a, *axis)?,
        Op::IndexSelect { axis } => a[0].contiguous()?.index_select(&a[1].contiguous()?, *axis)?,
        Op::IndexAdd { axis } => {
            a[0].contiguous()?.index_add(&a[1].contiguous()?, &a[2].contiguous()?, *axis)?
        }
        Op::Gather { axis } => a[0].contiguous()?.gather(&a[1].contiguous()?, *axis)?,
        Op::ScatterAdd { axis } => {
            a[0].contiguous()?.scatter_add(&a[1].contiguous()?, &a[2].contiguous()?, *axis)?
        }
        Op::TopK { k } => {
            let last = ty.shape.len() - 1;
            a[0].contiguous()?.arg_sort_last_dim(false)?.narrow(last, 0, *k)?.contiguous()?
        }
        Op::SortByExpert { experts } => crate::segment::sort_by_expert(a[0], *experts)?,
        Op::Bincount { bins } => crate::segment::bincount(a[0], *bins)?,
        Op::SegmentMatmul { transpose } => crate::segment::segment_matmul(a[0], a[1], a[2], *transpose)?,
        Op::SegmentOuter => crate::segment::segment_outer(a[0], a[1], a[2])?,
        Op::Cast { dtype } => a[0].to_dtype(candle_dtype(*dtype))?,
    })
}

/// A tensor of IR type (`dtype`, `shape`) from f64 row-major data (cast to `dtype`).
pub fn tensor_from_f64(data: &[f64], shape: &[usize], dtype: DType) -> candle_core::Result<Tensor> {
    Tensor::from_slice(data, shape.to_vec(), &Device::Cpu)?.to_dtype(candle_dtype(dtype))
}

/// A u32 tensor from row-major data.
pub fn tensor_u32(data: &[u32], shape: &[usize]) -> candle_core::Result<Tensor> {
    Tensor::from_slice(data, shape.to_vec(), &Device::Cpu)
}

/// All elements as f64, row-major.
pub fn to_f64(t: &Tensor) -> candle_core::Result<Vec<f64>> {
    t.to_dtype(CDType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// Named value map from parallel names and tensors.
pub fn named(names: &[String], tensors: &[Tensor]) -> HashMap<String, Tensor> {
    names.iter().cloned().zip(tensors.iter().cloned()).collect::<HashMap<_, _>>()
}

/// Ids of the nodes sorted by recorded time, longest first (for `--stats`).
pub fn slowest_nodes(times: &[Duration], k: usize) -> Vec<(ValueId, Duration)> {
    let mut v: Vec<(ValueId, Duration)> = times.iter().enumerate().map(|(i, d)| (ValueId(i), *d)).collect();
    v.sort_by_key(|x| std::cmp::Reverse(x.1));
    v.truncate(k);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotate_half_is_the_slices_negated_and_swapped() {
        let x = Tensor::arange(0f32, 2.0 * 3.0 * 6.0, &Device::Cpu).unwrap().reshape((2, 3, 6)).unwrap();
        let permuted = x.permute((1, 0, 2)).unwrap(); // read through .contiguous()
        for t in [&x, &permuted] {
            let got = rotate_half(t).unwrap();
            let (x1, x2) = (t.narrow(2, 0, 3).unwrap(), t.narrow(2, 3, 3).unwrap());
            let want = Tensor::cat(&[&x2.neg().unwrap(), &x1], 2).unwrap();
            assert_eq!(got.to_vec3::<f32>().unwrap(), want.to_vec3::<f32>().unwrap());
        }
        // Row 0 of the contiguous operand: [0 1 2 3 4 5] → [−3 −4 −5 0 1 2].
        let row = rotate_half(&x).unwrap().get(0).unwrap().get(0).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(row, [-3.0, -4.0, -5.0, 0.0, 1.0, 2.0]);
        assert!(rotate_half(&Tensor::zeros((2, 3), CDType::F32, &Device::Cpu).unwrap()).is_err());
    }

    #[test]
    fn sum_rows_gives_candles_bits() {
        // Values of mixed magnitude so that the order of the additions shows in the bits.
        let data: Vec<f32> = (0..2 * 5 * 3 * 4)
            .map(|i| ((i * 7919 % 113) as f32 - 56.0) * 1.37e-3 + (i % 3) as f32 * 1e3)
            .collect();
        let x = Tensor::from_vec(data, (2, 5, 3, 4), &Device::Cpu).unwrap();
        let permuted = x.permute((2, 0, 3, 1)).unwrap(); // not contiguous: read through .contiguous()
        for t in [&x, &permuted] {
            for axis in 0..3 {
                for keepdim in [false, true] {
                    let ours = sum_rows(t, axis, keepdim).unwrap();
                    let candle = if keepdim { t.sum_keepdim(axis) } else { t.sum(axis) }.unwrap();
                    assert_eq!(ours.dims(), candle.dims());
                    let (a, b) = (
                        ours.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        candle.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    );
                    assert!(
                        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "axis {axis}: {a:?} vs {b:?}"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod matmul_tests {
    use super::*;
    use proptest::prelude::*;

    /// `dims` filled from `seed`, then permuted by `perm`.
    fn view(dims: [usize; 4], perm: [usize; 4], seed: u64) -> Tensor {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let data: Vec<f32> = (0..dims.iter().product::<usize>())
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        Tensor::from_vec(data, dims.to_vec(), &Device::Cpu).unwrap().permute(perm.to_vec()).unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    /// `small`'s shapes, past gemm's own threading threshold (48 · 48 · 256 multiply-adds) and
    /// its larger kernel blocks: batched rank-3 and rank-4 products, contiguous and permuted,
    /// and rank-2 ones (a linear's forward and its two gradients, one with a transposed lhs),
    /// on one thread and split over a pool, and with gemm held to one thread (a pair's
    /// product, [`crate::pairs`]), give the interpreter's bits — the interpreter's gemm runs on
    /// as many threads as candle's setting says (the machine's cores by default).
    #[test]
    fn large_products_give_the_interpreters_bits() {
        let cases = [
            (view([2, 1, 128, 256], [0, 1, 2, 3], 1), view([2, 1, 256, 688], [0, 1, 2, 3], 2)),
            (view([2, 128, 3, 256], [0, 2, 1, 3], 3), view([2, 256, 3, 200], [0, 2, 1, 3], 4)),
            (view([3, 2, 256, 130], [0, 1, 3, 2], 5), view([3, 2, 256, 96], [0, 1, 2, 3], 6)),
            (view([1, 1, 128, 256], [0, 1, 2, 3], 7), view([1, 1, 256, 688], [0, 1, 2, 3], 8)),
            (view([1, 1, 128, 256], [0, 1, 3, 2], 9), view([1, 1, 128, 688], [0, 1, 2, 3], 10)),
            (view([1, 1, 128, 688], [0, 1, 2, 3], 11), view([1, 1, 688, 256], [0, 1, 2, 3], 12)),
        ];
        for (x, y) in cases {
            let squeeze = |t: &Tensor| {
                if t.dims()[0] == 1 {
                    t.squeeze(0).unwrap().squeeze(0).unwrap()
                } else {
                    t.squeeze(1).unwrap_or(t.clone())
                }
            };
            for (x, y) in [(x.clone(), y.clone()), (squeeze(&x), squeeze(&y))] {
                let want = bits(&matmul(&x, &y).unwrap());
                for threads in [1, 2, 3] {
                    let pool = crate::threads::rank_pool(0, threads).unwrap();
                    for t in [Threads::Pool, Threads::One] {
                        let got = pool.install(|| bits(&compiled_matmul(&x, &y, t).unwrap()));
                        assert_eq!(got, want, "{:?} · {:?} on {threads} threads, {t:?}", x.dims(), y.dims());
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

        /// Attention's operand pairs — lhs contiguous, transposed (Pᵀ) or permuted (q), rhs
        /// permuted (k, v), permuted and transposed (kᵀ), contiguous or transposed — give the
        /// interpreter's bits, on one thread and with the batch split over a pool.
        #[test]
        fn compiled_matmul_equals_the_interpreters(
            b in 1usize..3, h in 1usize..4, m in 1usize..80, k in 1usize..80, n in 1usize..80,
            lhs in 0usize..3, rhs in 0usize..4, seed in 0u64..1000
        ) {
            let x = match lhs {
                0 => view([b, h, m, k], [0, 1, 2, 3], seed),
                1 => view([b, h, k, m], [0, 1, 3, 2], seed),
                _ => view([b, m, h, k], [0, 2, 1, 3], seed),
            };
            let y = match rhs {
                0 => view([b, k, h, n], [0, 2, 1, 3], seed + 1),
                1 => view([b, n, h, k], [0, 2, 3, 1], seed + 1),
                2 => view([b, h, k, n], [0, 1, 2, 3], seed + 1),
                _ => view([b, h, n, k], [0, 1, 3, 2], seed + 1),
            };
            let want = bits(&matmul(&x, &y).unwrap());
            prop_assert_eq!(bits(&compiled_matmul(&x, &y, Threads::Pool).unwrap()), want.clone());
            prop_assert_eq!(bits(&compiled_matmul(&x, &y, Threads::One).unwrap()), want.clone());
            // With batch elements split over a pool (batched_gemm).
            let pool = crate::threads::rank_pool(0, 3).unwrap();
            prop_assert_eq!(pool.install(|| bits(&compiled_matmul(&x, &y, Threads::Pool).unwrap())), want);
        }
    }
}
