//! A graph's collectives on one rank: a `*_start` node starts its collective on the rank's
//! [`Comm`] (the graph group resolved through the [`Mesh`]), the matching wait completes it
//! (module doc of [`crate::exec`]).

use std::time::{Duration, Instant};

use candle_core::Tensor;
use graphpp_comm::mesh::{Mesh, MeshError};
use graphpp_comm::{AllToAllOutput, Comm, CommError, Pending};
use graphpp_graph::{CollectiveKind, CommGroup, Graph, Op};
use thiserror::Error;

use super::ExecError;

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
pub(super) struct InFlight {
    handle: Handle,
    pub(super) node: usize,
    axis: usize,
    pub(super) started: Instant,
}

/// One collective over more than one rank as it ran (see [`ExecReport::collectives`]):
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
pub(super) enum Value {
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

/// Starts `kind` over `group` along `axis` on `args[0]` (identity for a group of size 1 and
/// for a replicate, which moves no data; an all-to-all-v also reads its counts `args[1..3]`).
pub(super) fn start(
    comm: Option<&GraphComm>,
    kind: CollectiveKind,
    group: &CommGroup,
    axis: usize,
    args: &[&Tensor],
    node: usize,
) -> Result<Value, CollectiveError> {
    let x = args[0];
    if group.size == 1 || kind == CollectiveKind::Replicate {
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
        // Returned above; total here so that no kind can reach the communicator by mistake.
        CollectiveKind::Replicate => return Ok(Value::Ready(args[0].clone())),
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
    crate::kernels::device::count_host_read(t);
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
pub(super) fn complete(f: InFlight, timeout: Duration) -> Result<Tensor, CollectiveError> {
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
pub(super) fn collective_error(graph: &Graph, node: usize, source: CollectiveError) -> ExecError {
    let (kind, group) = match &graph.nodes[node].op {
        Op::CollectiveStart { kind, group, .. } => (kind.name().to_string(), Some(*group)),
        other => (other.mnemonic(), None),
    };
    ExecError::Collective { kind, group, node, source: Box::new(source) }
}
