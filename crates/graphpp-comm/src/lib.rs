//! A rank's communicator: point-to-point messages by (peer, [`Tag`]) and collectives over a
//! [`Group`], each collective started without blocking and completed by a wait, plus the abort
//! signal (docs/ARCHITECTURE.md, "Runtime": Comm).
//!
//! - [`Comm`] is the one trait the schedule executor and the graph executor program against. It is
//!   object safe (`&dyn Comm`): a collective returns a [`Pending`] handle that owns whatever the
//!   backend needs to finish it.
//! - [`ThreadComm`] connects ranks that are threads of one process (the embedded default).
//! - [`LinkComm`] is a rank that is its own process, over a byte [`Link`]; [`mpi::MpiComm`]
//!   (cargo feature `mpi`) is one over Open MPI, [`loopback`] one over in-process channels.
//! - [`Mesh`] places world ranks on the pipeline, data-parallel and expert-parallel axes and
//!   resolves a graph's `CommGroup` to the [`Group`] of one rank.
//! - [`wire`] is the byte form of a tensor (dtype + shape header, little-endian data) for backends
//!   whose ranks are processes (MPI).
//!
//! # Collective semantics
//!
//! Every member of a group calls the same collectives on it in the same order (as in MPI): the
//! k-th call a rank makes on a group is matched with the k-th call of every other member (the
//! call's sequence number, counted per rank and group), so two successive all-reduces on one group
//! never mix, and collectives on different groups are independent. A group is identified by its
//! name *and* its ordered rank list ([`Group`]). Tensors are split and concatenated along dim 0.
//! All reductions are sums computed in **group-rank order** (`((x₀ + x₁) + x₂) + …`) in f64 for
//! f64 tensors and in f32 otherwise (bf16 / f16 are widened, summed, rounded once), so the result is
//! bitwise identical on every rank and independent of arrival order.

mod combine;
pub mod emulated;
pub mod envelope;
pub mod link;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod thread;
pub mod wire;

use std::fmt;
use std::time::Duration;

use candle_core::{DType, Tensor};

pub use emulated::{EmulatedComm, LinkModel, LinkParseError};
pub use link::{loopback, Inbox, Link, LinkComm};
pub use mesh::{Coords, Mesh, MeshAxis, MeshError};
#[cfg(feature = "mpi")]
pub use mpi::MpiComm;
pub use thread::ThreadComm;

/// A point-to-point message tag: what the message carries and where it goes, so that a forward
/// activation and a backward gradient of the same (stage, microbatch) never mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tag {
    /// The activation of microbatch `mb` flowing forward into `stage`.
    Activation {
        /// The stage that consumes it.
        stage: usize,
        /// The microbatch.
        mb: usize,
    },
    /// The gradient of microbatch `mb` flowing backward into `stage` (the gradient of its
    /// output).
    Gradient {
        /// The stage that consumes it.
        stage: usize,
        /// The microbatch.
        mb: usize,
    },
    /// State or measurements sent to the leader (world rank 0) outside the schedule — a
    /// checkpoint's tensors, a step's intervals.
    Gather {
        /// What is gathered (a code of the sender's own, e.g. the trainer's).
        what: u8,
        /// Which item of it.
        item: usize,
    },
}

/// An ordered list of world ranks that run collectives together, with a name.
///
/// The position of a rank in the list is its *group rank*: all-gather concatenates and
/// reduce-scatter hands out chunks in this order. Two groups are the same group only when both
/// name and rank list are equal, so `dp[0,2]` and `dp[1,3]` (or `a[0,1]` and `b[0,1]`) run their
/// collectives independently.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Group {
    name: String,
    ranks: Vec<usize>,
}

impl Group {
    /// A group called `name` (e.g. `dp`, `pp`, `ep`) of the world ranks `ranks`, in group order.
    ///
    /// # Errors
    /// [`CommError::EmptyGroup`]; [`CommError::DuplicateRank`] when a rank appears twice. Ranks
    /// beyond the world size are reported when the group is used ([`CommError::BadPeer`]).
    pub fn new(name: impl Into<String>, ranks: Vec<usize>) -> Result<Group, CommError> {
        let name = name.into();
        if ranks.is_empty() {
            return Err(CommError::EmptyGroup { group: name });
        }
        for (i, r) in ranks.iter().enumerate() {
            if ranks[..i].contains(r) {
                return Err(CommError::DuplicateRank { group: format!("{name}{ranks:?}"), rank: *r });
            }
        }
        Ok(Group { name, ranks })
    }

    /// A group whose caller guarantees `ranks` is non-empty and duplicate-free (the mesh).
    pub(crate) fn checked_by_caller(name: &str, ranks: Vec<usize>) -> Group {
        debug_assert!(!ranks.is_empty());
        Group { name: name.to_string(), ranks }
    }

    /// The group `world` of all ranks `0..world`.
    ///
    /// # Errors
    /// [`CommError::EmptyGroup`] when `world` is 0.
    pub fn world(world: usize) -> Result<Group, CommError> {
        Group::new("world", (0..world).collect())
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// World ranks in group order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Group rank of world rank `rank`, if it is a member.
    pub fn index_of(&self, rank: usize) -> Option<usize> {
        self.ranks.iter().position(|&r| r == rank)
    }
}

impl fmt::Display for Group {
    /// `name[r0,r1,…]`, e.g. `dp[0,2]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.name)?;
        for (i, r) in self.ranks.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{r}")?;
        }
        f.write_str("]")
    }
}

/// The collectives a [`Comm`] runs (a graph's collective kinds run as these; the graph has no
/// barrier, its all-to-all is the equal-counts case of [`Comm::all_to_all`], and its replicate
/// moves no data).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CollectiveOp {
    /// Sum over the group; every member gets the whole sum.
    AllReduce,
    /// Concatenation of every member's tensor along dim 0, in group order.
    AllGather,
    /// Sum over the group, split along dim 0 into group-size chunks; group rank i keeps chunk i.
    ReduceScatter,
    /// Each member sends a (possibly different) number of rows to every member and receives what
    /// each sent it, concatenated in group order.
    AllToAll,
    /// Completes once every member arrived.
    Barrier,
}

impl CollectiveOp {
    /// The snake-case name (`all_reduce`, …), as in the graph's text form.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::ReduceScatter => "reduce_scatter",
            CollectiveOp::AllToAll => "all_to_all",
            CollectiveOp::Barrier => "barrier",
        }
    }
}

impl fmt::Display for CollectiveOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Dtype and shape of a tensor, for error messages (`f32[2, 3]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// Element type.
    pub dtype: DType,
    /// Dimensions.
    pub shape: Vec<usize>,
}

impl TensorDesc {
    /// The description of `t`.
    pub fn of(t: &Tensor) -> TensorDesc {
        TensorDesc { dtype: t.dtype(), shape: t.dims().to_vec() }
    }
}

impl fmt::Display for TensorDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:?}", self.dtype.as_str(), self.shape)
    }
}

/// What a timed-out receive or wait was waiting for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Awaited {
    /// A point-to-point message from `peer` under `tag`.
    Message {
        /// The sender.
        peer: usize,
        /// The tag.
        tag: Tag,
    },
    /// The contributions of `missing` (world ranks) to collective number `seq` on `group`.
    Collective {
        /// The collective.
        op: CollectiveOp,
        /// The group, as `name[ranks]`.
        group: String,
        /// Sequence number of the call on this group (0 for the first).
        seq: u64,
        /// Members that had not started it.
        missing: Vec<usize>,
    },
}

impl fmt::Display for Awaited {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Awaited::Message { peer, tag } => write!(f, "{tag:?} from rank {peer}"),
            Awaited::Collective { op, group, seq, missing } => {
                write!(f, "{op} #{seq} on group {group} (not started by ranks {missing:?})")
            }
        }
    }
}

/// Communicator failures. Every variant names the rank that reports it or the ranks at fault.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CommError {
    /// Nothing arrived in time.
    #[error("rank {rank}: timed out after {:.2} s waiting for {awaited}", waited.as_secs_f64())]
    Timeout {
        /// The waiting rank.
        rank: usize,
        /// What it waited for.
        awaited: Awaited,
        /// How long it waited.
        waited: Duration,
    },
    /// Some rank called [`Comm::abort`]; this rank stops.
    #[error("stopped because rank {failed_rank} failed: {reason}")]
    Aborted {
        /// The rank that aborted first.
        failed_rank: usize,
        /// Its reason.
        reason: String,
    },
    /// A peer or group member outside `0..world`.
    #[error("rank {rank}: peer {peer} out of range (world size {world})")]
    BadPeer {
        /// This rank.
        rank: usize,
        /// The bad peer.
        peer: usize,
        /// Number of ranks.
        world: usize,
    },
    /// This rank called a collective on a group it is not a member of.
    #[error("rank {rank} is not a member of group {group}")]
    NotInGroup {
        /// This rank.
        rank: usize,
        /// The group, as `name[ranks]`.
        group: String,
    },
    /// A group with no ranks.
    #[error("group `{group}` has no ranks")]
    EmptyGroup {
        /// The group's name.
        group: String,
    },
    /// A group that lists a rank twice.
    #[error("group {group} lists rank {rank} twice")]
    DuplicateRank {
        /// The group, as `name[ranks]`.
        group: String,
        /// The repeated rank.
        rank: usize,
    },
    /// Two members called different collectives as the same call on a group.
    #[error("call #{seq} on group {group}: rank {rank} called {op} but rank {other_rank} called {other_op}")]
    OpMismatch {
        /// The group, as `name[ranks]`.
        group: String,
        /// Sequence number of the call.
        seq: u64,
        /// The first member (group order).
        rank: usize,
        /// What it called.
        op: CollectiveOp,
        /// The first member that called something else.
        other_rank: usize,
        /// What that member called.
        other_op: CollectiveOp,
    },
    /// Two members' contributions disagree in dtype or shape (all dims for all-reduce, all-gather
    /// and reduce-scatter; all dims but the first for all-to-all).
    #[error(
        "{op} #{seq} on group {group}: rank {rank} contributed {desc} but rank {other_rank} contributed {other_desc}"
    )]
    Mismatch {
        /// The collective.
        op: CollectiveOp,
        /// The group, as `name[ranks]`.
        group: String,
        /// Sequence number of the call.
        seq: u64,
        /// The first member (group order).
        rank: usize,
        /// Its contribution.
        desc: TensorDesc,
        /// The first member whose contribution differs.
        other_rank: usize,
        /// That contribution.
        other_desc: TensorDesc,
    },
    /// A sum of a dtype the reduction does not support (only f32, f64, bf16 and f16).
    #[error("rank {rank}: {op} cannot sum {dtype:?} tensors (f32, f64, bf16, f16 only)")]
    Dtype {
        /// This rank.
        rank: usize,
        /// The collective.
        op: CollectiveOp,
        /// The rejected dtype.
        dtype: DType,
    },
    /// A collective that splits or concatenates along dim 0 got a 0-dimensional tensor.
    #[error("rank {rank}: {op} needs a tensor with at least one dimension, got a scalar")]
    Scalar {
        /// This rank.
        rank: usize,
        /// The collective.
        op: CollectiveOp,
    },
    /// Reduce-scatter of a tensor whose dim 0 does not split into equal chunks over the group.
    #[error("rank {rank}: reduce_scatter of {rows} rows does not split over a group of {group_size}")]
    Indivisible {
        /// This rank.
        rank: usize,
        /// Length of dim 0.
        rows: usize,
        /// Group size.
        group_size: usize,
    },
    /// All-to-all send counts that are not one per member or do not add up to dim 0.
    #[error(
        "rank {rank}: all_to_all send counts {counts:?} must be {group_size} counts adding up to the {rows} rows sent"
    )]
    Counts {
        /// This rank.
        rank: usize,
        /// The counts given.
        counts: Vec<usize>,
        /// Length of dim 0 of the tensor sent.
        rows: usize,
        /// Group size.
        group_size: usize,
    },
    /// A tensor kernel failed while combining contributions.
    #[error("rank {rank}: {op}: {source}")]
    Tensor {
        /// This rank.
        rank: usize,
        /// The collective.
        op: CollectiveOp,
        /// The candle error.
        source: std::sync::Arc<candle_core::Error>,
    },
    /// A malformed wire buffer or a tensor the wire form cannot carry.
    #[error(transparent)]
    Wire(#[from] wire::WireError),
}

/// The backend's half of a started collective (see [`Pending`]); implemented by each [`Comm`].
pub trait PendingOp<T>: Send + Sync {
    /// Blocks until the collective completes, `timeout` passes or a rank aborts.
    ///
    /// # Errors
    /// As [`Pending::wait`].
    fn wait(self: Box<Self>, timeout: Duration) -> Result<T, CommError>;
    /// Whether every member has started the collective (so [`PendingOp::wait`] would not block).
    fn is_ready(&self) -> bool;
}

/// The handle a collective's start returns: this rank's contribution is posted; the result is
/// collected by [`Pending::wait`]. Dropping it without waiting abandons this rank's result (the
/// other members still complete).
pub struct Pending<T> {
    op: CollectiveOp,
    seq: u64,
    inner: Box<dyn PendingOp<T>>,
}

impl<T> Pending<T> {
    /// Wraps a backend's pending operation (for [`Comm`] implementations).
    pub fn new(op: CollectiveOp, seq: u64, inner: Box<dyn PendingOp<T>>) -> Pending<T> {
        Pending { op, seq, inner }
    }

    /// The collective.
    pub fn op(&self) -> CollectiveOp {
        self.op
    }

    /// Its sequence number on its group (0 for the first call).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Whether every member has started it (a wait would not block).
    pub fn is_ready(&self) -> bool {
        self.inner.is_ready()
    }

    /// Waits at most `timeout` for the result.
    ///
    /// # Errors
    /// [`CommError::Timeout`] naming the members that had not started the collective;
    /// [`CommError::Aborted`] (promptly) once any rank aborted; [`CommError::OpMismatch`] and
    /// [`CommError::Mismatch`] when members disagree; [`CommError::Tensor`].
    pub fn wait(self, timeout: Duration) -> Result<T, CommError> {
        self.inner.wait(timeout)
    }
}

impl<T> fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Pending({} #{})", self.op, self.seq)
    }
}

/// What an all-to-all delivers to one member.
#[derive(Clone, Debug)]
pub struct AllToAllOutput {
    /// The rows every member sent to this one, concatenated along dim 0 in group order.
    pub data: Tensor,
    /// How many rows came from each member, in group order (`data.dim(0)` is their sum).
    pub recv_counts: Vec<usize>,
}

/// One rank's communicator. Ranks are numbered `0..world`.
///
/// Point-to-point: [`Comm::send`] never blocks; [`Comm::recv`] takes the oldest message `peer`
/// sent under `tag`. Collectives: each call *starts* the collective on `group` (this rank must be
/// a member) and returns a [`Pending`]; the rank may compute, send and receive before waiting.
/// See the module doc for matching, ordering and the reduction order.
pub trait Comm: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world(&self) -> usize;

    /// Sends `x` to `peer` under `tag`; never blocks.
    ///
    /// # Errors
    /// [`CommError::BadPeer`]; [`CommError::Aborted`] once any rank aborted.
    fn send(&self, peer: usize, tag: Tag, x: Tensor) -> Result<(), CommError>;

    /// Receives the oldest tensor `peer` sent to this rank under `tag`, waiting at most `timeout`.
    ///
    /// # Errors
    /// [`CommError::Timeout`] (naming peer and tag); [`CommError::Aborted`] (promptly);
    /// [`CommError::BadPeer`].
    fn recv(&self, peer: usize, tag: Tag, timeout: Duration) -> Result<Tensor, CommError>;

    /// Starts the sum of every member's `x` (same dtype and shape on all; f32, f64, bf16 or f16).
    /// The result has `x`'s dtype and shape.
    ///
    /// # Errors
    /// [`CommError::NotInGroup`], [`CommError::BadPeer`], [`CommError::Dtype`],
    /// [`CommError::Aborted`]; at the wait, see [`Pending::wait`].
    fn all_reduce(&self, group: &Group, x: &Tensor) -> Result<Pending<Tensor>, CommError>;

    /// Starts the concatenation along dim 0 of every member's `x` (same dtype and shape on all),
    /// in group order: `[n, …]` per member gives `[size·n, …]`.
    ///
    /// # Errors
    /// [`CommError::NotInGroup`], [`CommError::BadPeer`], [`CommError::Scalar`],
    /// [`CommError::Aborted`]; at the wait, see [`Pending::wait`].
    fn all_gather(&self, group: &Group, x: &Tensor) -> Result<Pending<Tensor>, CommError>;

    /// Starts the sum of every member's `x` (same dtype and shape `[size·n, …]` on all) split
    /// along dim 0: group rank i gets rows `[i·n, (i+1)·n)` of the sum, shape `[n, …]`.
    ///
    /// # Errors
    /// [`CommError::NotInGroup`], [`CommError::BadPeer`], [`CommError::Dtype`],
    /// [`CommError::Scalar`], [`CommError::Indivisible`], [`CommError::Aborted`]; at the wait,
    /// see [`Pending::wait`].
    fn reduce_scatter(&self, group: &Group, x: &Tensor) -> Result<Pending<Tensor>, CommError>;

    /// Starts an all-to-all with variable counts: the rows of `x` are cut along dim 0 into
    /// consecutive pieces of `send_counts[j]` rows, piece j going to group rank j. Every member's
    /// `x` has the same dtype and dims after the first.
    ///
    /// # Errors
    /// [`CommError::NotInGroup`], [`CommError::BadPeer`], [`CommError::Scalar`],
    /// [`CommError::Counts`], [`CommError::Aborted`]; at the wait, see [`Pending::wait`].
    fn all_to_all(
        &self,
        group: &Group,
        x: &Tensor,
        send_counts: &[usize],
    ) -> Result<Pending<AllToAllOutput>, CommError>;

    /// Starts a barrier: the wait returns once every member has started it.
    ///
    /// # Errors
    /// [`CommError::NotInGroup`], [`CommError::BadPeer`], [`CommError::Aborted`].
    fn barrier(&self, group: &Group) -> Result<Pending<()>, CommError>;

    /// Tells every rank to stop because this rank failed with `reason` (the first abort wins):
    /// every pending and later receive or wait on any rank fails with [`CommError::Aborted`]
    /// naming this rank, without waiting for its timeout.
    fn abort(&self, reason: &str);
}
