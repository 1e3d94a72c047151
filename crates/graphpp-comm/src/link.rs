//! [`LinkComm`]: the communicator of a rank that is its own process, over any byte [`Link`]
//! between processes (MPI's is [`super::mpi`]); and [`loopback`], the same over in-process
//! channels, which runs every byte path without MPI (docs/ARCHITECTURE.md "Runtime": Comm).
//!
//! A rank keeps a local [`ThreadComm`] world of `world` ends: its own end, on which it posts its
//! contributions, waits and receives, and one *proxy* end per other rank, through which the
//! link's receiver replays what that rank sent ([`Inbox::deliver`]): a point-to-point message
//! becomes the proxy's send, a contribution the proxy's start of the same collective (dropped at
//! once: only this rank's result is wanted), an abort the proxy's abort. So matching by sequence
//! number, the group-order reduction, the typed errors, timeouts and prompt aborts are
//! `ThreadComm`'s, bitwise: a run over processes computes exactly what the threads run does.
//!
//! The link must deliver the messages from one sender in the order they were posted (MPI's
//! non-overtaking rule): the proxy's sequence numbers count arrivals, and each envelope's own
//! sequence number is checked against that count.
//!
//! Cost: every member sends its whole contribution to every other member (all-reduce and
//! reduce-scatter: (n − 1) × the tensor per rank; all-to-all: only the rows each member gets), and
//! each member combines on its own — the simple, deterministic choice for the small groups of a
//! pipeline (dp, copies); a ring would be cheaper for large groups.

use std::collections::HashMap;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use candle_core::Tensor;

use super::envelope::Envelope;
use super::wire::WireError;
use super::{AllToAllOutput, CollectiveOp, Comm, CommError, Group, Pending, Tag, ThreadComm};

/// Moves byte buffers from this rank to another; the receiving side hands them to the peer's
/// [`Inbox::deliver`].
pub trait Link: Send + Sync {
    /// Queues `bytes` for rank `dest` (never this rank); must not block on the receiver.
    ///
    /// # Errors
    /// [`CommError::Aborted`] when the link is down (the reason names the failure).
    fn post(&self, dest: usize, bytes: Vec<u8>) -> Result<(), CommError>;
}

/// The receiving half of a [`LinkComm`]: where the link delivers what other ranks sent.
pub struct Inbox {
    rank: usize,
    /// Ends of the local rendezvous world; index = world rank.
    ends: Vec<ThreadComm>,
    /// Contributions each sender has delivered on each group (the next expected sequence number).
    seqs: Mutex<HashMap<(usize, Group), u64>>,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox").field("rank", &self.rank).field("world", &self.ends.len()).finish()
    }
}

impl Inbox {
    /// Replays what rank `src` sent (see the module doc).
    ///
    /// # Errors
    /// [`CommError::Wire`] for a malformed envelope or one out of sequence; [`CommError::BadPeer`]
    /// for a sender outside the world. The caller should abort the rank then: the stream from
    /// `src` can no longer be trusted.
    pub fn deliver(&self, src: usize, bytes: &[u8]) -> Result<(), CommError> {
        let world = self.ends.len();
        if src >= world || src == self.rank {
            return Err(CommError::BadPeer { rank: self.rank, peer: src, world });
        }
        let proxy = &self.ends[src];
        match Envelope::decode(bytes)? {
            Envelope::Message { tag, tensor } => proxy.send(self.rank, tag, tensor),
            Envelope::Abort { reason } => {
                proxy.abort(&reason);
                Ok(())
            }
            Envelope::Contribution { op, group, seq, tensor } => {
                let expected = {
                    let mut seqs = self.seqs.lock().unwrap_or_else(|e| e.into_inner());
                    let next = seqs.entry((src, group.clone())).or_insert(0);
                    let expected = *next;
                    *next += 1;
                    expected
                };
                if seq != expected {
                    return Err(WireError::Envelope {
                        message: format!(
                            "rank {src} sent {op} #{seq} on {group}, #{expected} was due (messages out of order)"
                        ),
                    }
                    .into());
                }
                self.replay(proxy, op, &group, tensor)
            }
        }
    }

    /// Stops this rank (every wait and receive fails with [`CommError::Aborted`] naming it):
    /// for a link that can no longer deliver, e.g. after a malformed message.
    pub fn abort_local(&self, reason: &str) {
        self.ends[self.rank].abort(reason);
    }

    /// Whether this rank was stopped: by itself ([`Comm::abort`]), by another rank's abort, or
    /// by [`Inbox::abort_local`].
    pub fn is_aborted(&self) -> bool {
        self.ends[self.rank].aborted().is_some()
    }

    /// Starts, on the proxy of the sender, the collective it contributed to.
    fn replay(
        &self,
        proxy: &ThreadComm,
        op: CollectiveOp,
        group: &Group,
        x: Option<Tensor>,
    ) -> Result<(), CommError> {
        let need = |x: Option<Tensor>| {
            x.ok_or_else(|| {
                CommError::from(WireError::Envelope {
                    message: format!("{op} contribution without a tensor"),
                })
            })
        };
        match op {
            CollectiveOp::AllReduce => drop(proxy.all_reduce(group, &need(x)?)?),
            CollectiveOp::AllGather => drop(proxy.all_gather(group, &need(x)?)?),
            CollectiveOp::ReduceScatter => drop(proxy.reduce_scatter(group, &need(x)?)?),
            CollectiveOp::AllToAll => {
                let x = need(x)?;
                let me = group
                    .index_of(self.rank)
                    .ok_or_else(|| CommError::NotInGroup { rank: self.rank, group: group.to_string() })?;
                let mut counts = vec![0; group.size()];
                counts[me] = x.dims().first().copied().unwrap_or(0);
                drop(proxy.all_to_all(group, &x, &counts)?)
            }
            CollectiveOp::Barrier => drop(proxy.barrier(group)?),
        }
        Ok(())
    }
}

/// What [`LinkComm::spread`] sends: the same tensor (or none, a barrier) to every member, or a
/// piece per member (all-to-all).
enum Contribution<'a> {
    Same(Option<&'a Tensor>),
    Pieces(&'a dyn Fn(usize) -> Result<Tensor, CommError>),
}

/// One rank's communicator over a [`Link`] (see the module doc).
pub struct LinkComm<L: Link> {
    inbox: Arc<Inbox>,
    link: L,
}

impl<L: Link> std::fmt::Debug for LinkComm<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkComm").field("rank", &self.inbox.rank).field("world", &self.world()).finish()
    }
}

impl<L: Link> LinkComm<L> {
    /// Rank `rank` of `world` over `link`; returns the communicator and the inbox the link's
    /// receiver delivers into.
    ///
    /// # Errors
    /// [`CommError::BadPeer`] when `rank` is not below `world`.
    pub fn new(rank: usize, world: usize, link: L) -> Result<(LinkComm<L>, Arc<Inbox>), CommError> {
        if rank >= world {
            return Err(CommError::BadPeer { rank, peer: rank, world });
        }
        let inbox =
            Arc::new(Inbox { rank, ends: ThreadComm::world(world), seqs: Mutex::new(HashMap::new()) });
        Ok((LinkComm { inbox: Arc::clone(&inbox), link }, inbox))
    }

    /// The link.
    pub fn link(&self) -> &L {
        &self.link
    }

    fn local(&self) -> &ThreadComm {
        &self.inbox.ends[self.inbox.rank]
    }

    /// Sends this rank's contribution to every other member of `group`: `x` to all (encoded
    /// once), or with `pieces` piece j to group rank j. On failure the rank aborts (the members
    /// that got it would wait forever).
    fn spread(
        &self,
        op: CollectiveOp,
        group: &Group,
        seq: u64,
        contribution: Contribution<'_>,
    ) -> Result<(), CommError> {
        let me = self.inbox.rank;
        let envelope = |tensor| Envelope::Contribution { op, group: group.clone(), seq, tensor }.encode();
        let to_others = |bytes: &dyn Fn(usize) -> Result<Vec<u8>, CommError>| {
            let mut others = group.ranks().iter().enumerate().filter(|&(_, &r)| r != me);
            others.try_for_each(|(j, &r)| self.link.post(r, bytes(j)?))
        };
        let result = match contribution {
            Contribution::Same(x) => envelope(x.cloned()).and_then(|b| to_others(&|_| Ok(b.clone()))),
            Contribution::Pieces(piece) => to_others(&|j| envelope(Some(piece(j)?))),
        };
        if let Err(e) = &result {
            self.abort(&format!("rank {me}: sending {op} #{seq} on {group}: {e}"));
        }
        result
    }
}

impl<L: Link> Comm for LinkComm<L> {
    fn rank(&self) -> usize {
        self.inbox.rank
    }

    fn world(&self) -> usize {
        self.inbox.ends.len()
    }

    fn send(&self, peer: usize, tag: Tag, x: Tensor) -> Result<(), CommError> {
        if peer == self.rank() || peer >= self.world() {
            // To itself: straight into its own mailbox (and the range check).
            return self.local().send(peer, tag, x);
        }
        if let Some(e) = self.local().aborted() {
            return Err(e);
        }
        let bytes = Envelope::Message { tag, tensor: x }.encode()?;
        self.link.post(peer, bytes)
    }

    fn recv(&self, peer: usize, tag: Tag, timeout: Duration) -> Result<Tensor, CommError> {
        self.local().recv(peer, tag, timeout)
    }

    fn all_reduce(&self, group: &Group, x: &Tensor) -> Result<Pending<Tensor>, CommError> {
        let p = self.local().all_reduce(group, x)?;
        self.spread(p.op(), group, p.seq(), Contribution::Same(Some(x)))?;
        Ok(p)
    }

    fn all_gather(&self, group: &Group, x: &Tensor) -> Result<Pending<Tensor>, CommError> {
        let p = self.local().all_gather(group, x)?;
        self.spread(p.op(), group, p.seq(), Contribution::Same(Some(x)))?;
        Ok(p)
    }

    fn reduce_scatter(&self, group: &Group, x: &Tensor) -> Result<Pending<Tensor>, CommError> {
        let p = self.local().reduce_scatter(group, x)?;
        self.spread(p.op(), group, p.seq(), Contribution::Same(Some(x)))?;
        Ok(p)
    }

    fn all_to_all(
        &self,
        group: &Group,
        x: &Tensor,
        send_counts: &[usize],
    ) -> Result<Pending<AllToAllOutput>, CommError> {
        let p = self.local().all_to_all(group, x, send_counts)?;
        // The local start checked the counts: they cover x's rows, one per member.
        let starts: Vec<usize> =
            send_counts.iter().scan(0, |a, &c| Some(std::mem::replace(a, *a + c))).collect();
        let piece = |j: usize| {
            x.narrow(0, starts[j], send_counts[j])
                .map_err(|e| WireError::Tensor { message: e.to_string() }.into())
        };
        self.spread(p.op(), group, p.seq(), Contribution::Pieces(&piece))?;
        Ok(p)
    }

    fn barrier(&self, group: &Group) -> Result<Pending<()>, CommError> {
        let p = self.local().barrier(group)?;
        self.spread(p.op(), group, p.seq(), Contribution::Same(None))?;
        Ok(p)
    }

    fn abort(&self, reason: &str) {
        self.local().abort(reason);
        let bytes = Envelope::Abort { reason: reason.to_string() }.encode().unwrap_or_default();
        for r in (0..self.world()).filter(|&r| r != self.rank()) {
            // Best effort: a peer that cannot be reached has failed already.
            let _ = self.link.post(r, bytes.clone());
        }
    }
}

/// A buffer in flight on a [`ChannelLink`]: (sender, bytes).
type Delivery = (usize, Vec<u8>);

/// The in-process [`Link`] of [`loopback`]: one channel per receiving rank.
#[derive(Debug)]
pub struct ChannelLink {
    rank: usize,
    to: Vec<Mutex<mpsc::Sender<Delivery>>>,
}

impl Link for ChannelLink {
    fn post(&self, dest: usize, bytes: Vec<u8>) -> Result<(), CommError> {
        let tx = self.to[dest].lock().unwrap_or_else(|e| e.into_inner());
        tx.send((self.rank, bytes)).map_err(|_| CommError::Aborted {
            failed_rank: dest,
            reason: format!("rank {dest} no longer receives"),
        })
    }
}

/// `n` [`LinkComm`]s connected by in-process channels, each with a receiver thread that
/// delivers into its inbox (index = rank): every message and contribution goes through its
/// byte form, as between processes. The receiver threads end when every communicator is
/// dropped. A malformed buffer aborts the receiving rank.
pub fn loopback(n: usize) -> Vec<LinkComm<ChannelLink>> {
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| mpsc::channel::<Delivery>()).unzip();
    let mut comms = Vec::with_capacity(n);
    for (rank, rx) in rxs.into_iter().enumerate() {
        let link = ChannelLink { rank, to: txs.iter().map(|t| Mutex::new(t.clone())).collect() };
        // rank < n: cannot fail.
        let Ok((comm, inbox)) = LinkComm::new(rank, n, link) else { unreachable!("rank below world") };
        std::thread::spawn(move || {
            for (src, bytes) in rx {
                if let Err(e) = inbox.deliver(src, &bytes) {
                    inbox.abort_local(&format!("rank {}: from rank {src}: {e}", inbox.rank));
                }
            }
        });
        comms.push(comm);
    }
    comms
}
