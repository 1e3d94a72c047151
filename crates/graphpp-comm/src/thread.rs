//! [`ThreadComm`]: the communicator of ranks that are OS threads of one process.
//!
//! Point-to-point messages go through one mailbox per receiving rank (a mutex-guarded map from
//! (sender, tag) to a queue, plus a condition variable). Collectives go
//! through one shared rendezvous table keyed by (group, sequence number): a start posts this
//! rank's contribution into its group-rank slot; a wait blocks until every slot is filled,
//! takes the contributions (cheap `Tensor` clones) and combines them itself, outside the lock
//! (`combine.rs`), so every rank computes the same result in group order. The entry is removed
//! once every member has taken its result (or dropped its handle).
//!
//! Tensors travel as `Tensor` values (shared storage, no copy, no encoding). An emulated link
//! (latency + bytes / bandwidth per message) would stamp each message and contribution with an
//! arrival time where `send` and `post` insert it, and make receives
//! and waits skip items that have not yet arrived; nothing else would change.
//!
//! Abort: the first [`Comm::abort`] is recorded once for all ranks; every waiter checks it while
//! holding the lock it sleeps on, and `abort` takes each of those locks before notifying, so no
//! waiter can miss the wake-up — waits fail at once, not at their timeout.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::combine::{self, Call, Contribution, Finish};
use super::{AllToAllOutput, Awaited, CollectiveOp, Comm, CommError, Group, Pending, PendingOp, Tag};

type Mailbox = HashMap<(usize, Tag), VecDeque<Tensor>>;

/// A collective call: the group and the call's sequence number on it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct SlotKey {
    group: Group,
    seq: u64,
}

/// The contributions to one collective call, by group rank, and who has taken the result.
struct Slot {
    posted: Vec<Option<Contribution>>,
    taken: Vec<bool>,
}

struct Shared {
    /// `mailboxes[r]`: messages waiting for rank r, by (sender, tag).
    mailboxes: Vec<Mutex<Mailbox>>,
    arrived: Vec<Condvar>,
    slots: Mutex<HashMap<SlotKey, Slot>>,
    slot_changed: Condvar,
    /// The first abort: (rank, reason).
    abort: OnceLock<(usize, String)>,
}

impl Shared {
    fn aborted(&self) -> Option<CommError> {
        self.abort.get().map(|(r, why)| CommError::Aborted { failed_rank: *r, reason: why.clone() })
    }
}

/// One rank's end of an in-process communicator; create all ends with [`ThreadComm::world`] and
/// move each to its rank's thread.
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
    /// Calls this rank made so far on each group (the next call's sequence number).
    seqs: Mutex<HashMap<Group, u64>>,
}

impl fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadComm").field("rank", &self.rank).field("world", &self.world()).finish()
    }
}

/// Locks a mutex, ignoring poisoning (a panicking rank must not take the others down with a
/// second panic: the abort carries the failure instead).
fn lock<X>(m: &Mutex<X>) -> MutexGuard<'_, X> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sleeps on `cv` until notified or `deadline` (none: no limit).
fn sleep<'a, X>(cv: &Condvar, g: MutexGuard<'a, X>, deadline: Option<Instant>) -> MutexGuard<'a, X> {
    match deadline {
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now());
            cv.wait_timeout(g, left).unwrap_or_else(|e| e.into_inner()).0
        }
        None => cv.wait(g).unwrap_or_else(|e| e.into_inner()),
    }
}

fn passed(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

impl ThreadComm {
    /// `n` connected communicators, one per rank (index = rank).
    pub fn world(n: usize) -> Vec<ThreadComm> {
        let shared = Arc::new(Shared {
            mailboxes: (0..n).map(|_| Mutex::new(HashMap::new())).collect(),
            arrived: (0..n).map(|_| Condvar::new()).collect(),
            slots: Mutex::new(HashMap::new()),
            slot_changed: Condvar::new(),
            abort: OnceLock::new(),
        });
        (0..n)
            .map(|rank| ThreadComm { rank, shared: shared.clone(), seqs: Mutex::new(HashMap::new()) })
            .collect()
    }

    /// The abort every rank of this world sees, if any rank aborted.
    pub(crate) fn aborted(&self) -> Option<CommError> {
        self.shared.aborted()
    }

    fn check_peer(&self, peer: usize) -> Result<(), CommError> {
        let world = self.world();
        if peer < world {
            Ok(())
        } else {
            Err(CommError::BadPeer { rank: self.rank, peer, world })
        }
    }

    /// This rank's group rank in `group`, after checking every member exists.
    fn member(&self, group: &Group) -> Result<usize, CommError> {
        for &r in group.ranks() {
            self.check_peer(r)?;
        }
        group
            .index_of(self.rank)
            .ok_or_else(|| CommError::NotInGroup { rank: self.rank, group: group.to_string() })
    }

    /// Starts a collective: checks membership and the abort, builds this rank's contribution
    /// (`contribute` runs the local checks; a failed check consumes no sequence number), posts it
    /// under the group's next sequence number and returns the handle.
    fn start<T: 'static>(
        &self,
        group: &Group,
        op: CollectiveOp,
        contribute: impl FnOnce() -> Result<Contribution, CommError>,
        finish: Finish<T>,
    ) -> Result<Pending<T>, CommError> {
        let index = self.member(group)?;
        if let Some(e) = self.shared.aborted() {
            return Err(e);
        }
        let contribution = contribute()?;
        let seq = {
            let mut seqs = lock(&self.seqs);
            let next = seqs.entry(group.clone()).or_insert(0);
            let seq = *next;
            *next += 1;
            seq
        };
        let key = SlotKey { group: group.clone(), seq };
        self.post(&key, index, contribution);
        let call = Call { rank: self.rank, index, group: group.clone(), seq, op };
        let waiter = Waiter { shared: self.shared.clone(), key, call, finish, taken: false };
        Ok(Pending::new(op, seq, Box::new(waiter)))
    }

    /// Puts this rank's contribution into the call's slot and wakes the waiters.
    fn post(&self, key: &SlotKey, index: usize, c: Contribution) {
        let size = key.group.size();
        let mut slots = lock(&self.shared.slots);
        let slot = slots
            .entry(key.clone())
            .or_insert_with(|| Slot { posted: vec![None; size], taken: vec![false; size] });
        slot.posted[index] = Some(c);
        drop(slots);
        self.shared.slot_changed.notify_all();
    }
}

impl Comm for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.mailboxes.len()
    }

    fn send(&self, peer: usize, tag: Tag, x: Tensor) -> Result<(), CommError> {
        self.check_peer(peer)?;
        if let Some(e) = self.shared.aborted() {
            return Err(e);
        }
        lock(&self.shared.mailboxes[peer]).entry((self.rank, tag)).or_default().push_back(x);
        self.shared.arrived[peer].notify_all();
        Ok(())
    }

    fn recv(&self, peer: usize, tag: Tag, timeout: Duration) -> Result<Tensor, CommError> {
        self.check_peer(peer)?;
        let deadline = Instant::now().checked_add(timeout);
        let mut mb = lock(&self.shared.mailboxes[self.rank]);
        loop {
            if let Some(e) = self.shared.aborted() {
                return Err(e);
            }
            if let Some(x) = mb.get_mut(&(peer, tag)).and_then(VecDeque::pop_front) {
                return Ok(x);
            }
            if passed(deadline) {
                return Err(CommError::Timeout {
                    rank: self.rank,
                    awaited: Awaited::Message { peer, tag },
                    waited: timeout,
                });
            }
            mb = sleep(&self.shared.arrived[self.rank], mb, deadline);
        }
    }

    fn all_reduce(&self, group: &Group, x: &Tensor) -> Result<Pending<Tensor>, CommError> {
        let op = CollectiveOp::AllReduce;
        let contribute = || {
            combine::check_summable(self.rank, op, x)?;
            Ok(Contribution::AllReduce(x.clone()))
        };
        self.start(group, op, contribute, combine::finish_all_reduce)
    }

    fn all_gather(&self, group: &Group, x: &Tensor) -> Result<Pending<Tensor>, CommError> {
        let op = CollectiveOp::AllGather;
        let contribute = || {
            combine::rows(self.rank, op, x)?;
            Ok(Contribution::AllGather(x.clone()))
        };
        self.start(group, op, contribute, combine::finish_all_gather)
    }

    fn reduce_scatter(&self, group: &Group, x: &Tensor) -> Result<Pending<Tensor>, CommError> {
        let contribute = || {
            combine::check_reduce_scatter(self.rank, group.size(), x)?;
            Ok(Contribution::ReduceScatter(x.clone()))
        };
        self.start(group, CollectiveOp::ReduceScatter, contribute, combine::finish_reduce_scatter)
    }

    fn all_to_all(
        &self,
        group: &Group,
        x: &Tensor,
        send_counts: &[usize],
    ) -> Result<Pending<AllToAllOutput>, CommError> {
        let contribute = || combine::split_rows(self.rank, group.size(), x, send_counts);
        self.start(group, CollectiveOp::AllToAll, contribute, combine::finish_all_to_all)
    }

    fn barrier(&self, group: &Group) -> Result<Pending<()>, CommError> {
        self.start(group, CollectiveOp::Barrier, || Ok(Contribution::Barrier), combine::finish_barrier)
    }

    fn abort(&self, reason: &str) {
        // Only the first abort is kept.
        let _ = self.shared.abort.set((self.rank, reason.to_string()));
        // Taking each lock a waiter sleeps under guarantees it is either asleep (and gets the
        // notification) or has not yet checked the abort (and will see it).
        for (m, cv) in self.shared.mailboxes.iter().zip(&self.shared.arrived) {
            drop(lock(m));
            cv.notify_all();
        }
        drop(lock(&self.shared.slots));
        self.shared.slot_changed.notify_all();
    }
}

/// A started collective of a [`ThreadComm`].
struct Waiter<T> {
    shared: Arc<Shared>,
    key: SlotKey,
    call: Call,
    finish: Finish<T>,
    /// Whether this rank has taken its contributions out of the slot.
    taken: bool,
}

impl<T> Waiter<T> {
    /// Marks this rank's result as taken; the last member to do so removes the slot.
    fn take(&mut self, slots: &mut HashMap<SlotKey, Slot>) {
        if self.taken {
            return;
        }
        self.taken = true;
        if let Some(slot) = slots.get_mut(&self.key) {
            slot.taken[self.call.index] = true;
            if slot.taken.iter().all(|&t| t) {
                slots.remove(&self.key);
            }
        }
    }
}

impl<T: 'static> PendingOp<T> for Waiter<T> {
    fn wait(mut self: Box<Self>, timeout: Duration) -> Result<T, CommError> {
        let deadline = Instant::now().checked_add(timeout);
        let shared = self.shared.clone();
        let mut slots = lock(&shared.slots);
        let contributions = loop {
            if let Some(e) = shared.aborted() {
                return Err(e);
            }
            let posted = slots.get(&self.key).map(|s| s.posted.as_slice()).unwrap_or_default();
            if let Some(all) = posted.iter().cloned().collect::<Option<Vec<Contribution>>>() {
                self.take(&mut slots);
                break all;
            }
            if passed(deadline) {
                let ranks = self.key.group.ranks();
                let missing = (0..ranks.len())
                    .filter(|&i| posted.get(i).is_none_or(Option::is_none))
                    .map(|i| ranks[i])
                    .collect();
                return Err(CommError::Timeout {
                    rank: self.call.rank,
                    awaited: Awaited::Collective {
                        op: self.call.op,
                        group: self.key.group.to_string(),
                        seq: self.key.seq,
                        missing,
                    },
                    waited: timeout,
                });
            }
            slots = sleep(&shared.slot_changed, slots, deadline);
        };
        drop(slots);
        (self.finish)(&self.call, &contributions)
    }

    fn is_ready(&self) -> bool {
        if self.shared.abort.get().is_some() {
            return true;
        }
        let slots = lock(&self.shared.slots);
        slots.get(&self.key).is_some_and(|s| s.posted.iter().all(Option::is_some))
    }
}

impl<T> Drop for Waiter<T> {
    fn drop(&mut self) {
        if !self.taken {
            let shared = self.shared.clone();
            let mut slots = lock(&shared.slots);
            self.take(&mut slots);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn finished_calls_leave_no_slot_behind() {
        let comms = ThreadComm::world(2);
        let g = Group::world(2).unwrap();
        let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        let a = comms[0].all_reduce(&g, &x).unwrap();
        let b = comms[1].all_reduce(&g, &x).unwrap();
        assert_eq!((a.seq(), b.seq()), (0, 0));
        assert!(a.is_ready());
        a.wait(Duration::from_secs(1)).unwrap();
        assert_eq!(lock(&comms[0].shared.slots).len(), 1, "rank 1 has not taken its result yet");
        drop(b); // abandoned without waiting
        assert_eq!(lock(&comms[0].shared.slots).len(), 0);
        let c = comms[0].barrier(&g).unwrap();
        assert_eq!(c.seq(), 1);
        assert!(!c.is_ready());
    }
}
