//! Transports: point-to-point messages by (peer, tag) between ranks, plus the abort signal that
//! stops every rank when one fails (docs/ARCHITECTURE.md, "Runtime": Transport trait).
//!
//! [`ThreadTransport`] connects ranks that are OS threads in one process: sends never block
//! (unbounded mailboxes), receives block until the message arrives, the timeout passes, or some
//! rank aborts.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What a message carries, so that a forward activation and a backward gradient of the same
/// (stage, microbatch) never mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TagKind {
    /// Activation flowing forward into `stage`.
    Activation,
    /// Gradient flowing backward into `stage` (the gradient of its output).
    Gradient,
    /// A collective's contribution (`stage` = collective sequence number).
    Collective,
}

/// A message tag: kind, receiving stage, microbatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag {
    /// What the message carries.
    pub kind: TagKind,
    /// The stage that consumes it.
    pub stage: usize,
    /// The microbatch.
    pub mb: usize,
}

/// Transport failures.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TransportError {
    /// No message arrived in time.
    #[error("rank {rank}: timed out after {seconds:.1} s waiting for {tag:?} from rank {peer}")]
    Timeout {
        /// The waiting rank.
        rank: usize,
        /// The sender it waited for.
        peer: usize,
        /// The tag it waited for.
        tag: Tag,
        /// How long it waited.
        seconds: f64,
    },
    /// Another rank failed; this one stops.
    #[error("stopped because rank {failed_rank} failed: {reason}")]
    Aborted {
        /// The rank that failed first.
        failed_rank: usize,
        /// Its error.
        reason: String,
    },
    /// A peer index outside `0..world`.
    #[error("rank {rank}: peer {peer} out of range (world size {world})")]
    BadPeer {
        /// This rank.
        rank: usize,
        /// The bad peer.
        peer: usize,
        /// Number of ranks.
        world: usize,
    },
}

/// Point-to-point messaging between the ranks of one pipeline, and the stop signal.
pub trait Transport<T>: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Sends `msg` to `peer` under `tag`; never blocks.
    ///
    /// # Errors
    /// [`TransportError::Aborted`] once any rank aborted; [`TransportError::BadPeer`].
    fn send(&self, peer: usize, tag: Tag, msg: T) -> Result<(), TransportError>;
    /// Receives the message `peer` sent under `tag`, waiting at most `timeout`.
    ///
    /// # Errors
    /// [`TransportError::Timeout`], [`TransportError::Aborted`], [`TransportError::BadPeer`].
    fn recv(&self, peer: usize, tag: Tag, timeout: Duration) -> Result<T, TransportError>;
    /// Tells every rank to stop because this rank failed with `reason` (first abort wins).
    fn abort(&self, reason: &str);
}

type Mailbox<T> = HashMap<(usize, Tag), VecDeque<T>>;

struct Shared<T> {
    /// `mailboxes[r]`: messages waiting for rank r, by (sender, tag).
    mailboxes: Vec<Mutex<Mailbox<T>>>,
    arrived: Vec<Condvar>,
    abort: Mutex<Option<(usize, String)>>,
}

/// One rank's end of an in-process transport; create all ends with [`ThreadTransport::group`].
pub struct ThreadTransport<T> {
    rank: usize,
    shared: Arc<Shared<T>>,
}

impl<T: Send> ThreadTransport<T> {
    /// `world` connected ends, one per rank (index = rank).
    pub fn group(world: usize) -> Vec<ThreadTransport<T>> {
        let shared = Arc::new(Shared {
            mailboxes: (0..world).map(|_| Mutex::new(HashMap::new())).collect(),
            arrived: (0..world).map(|_| Condvar::new()).collect(),
            abort: Mutex::new(None),
        });
        (0..world).map(|rank| ThreadTransport { rank, shared: shared.clone() }).collect()
    }

    fn aborted(&self) -> Option<TransportError> {
        lock(&self.shared.abort)
            .as_ref()
            .map(|(r, why)| TransportError::Aborted { failed_rank: *r, reason: why.clone() })
    }

    fn check_peer(&self, peer: usize) -> Result<(), TransportError> {
        let world = self.shared.mailboxes.len();
        if peer < world {
            Ok(())
        } else {
            Err(TransportError::BadPeer { rank: self.rank, peer, world })
        }
    }
}

/// Locks a mutex, ignoring poisoning (a panicking rank must not take the others down with a
/// second panic: the abort flag carries the failure instead).
fn lock<X>(m: &Mutex<X>) -> MutexGuard<'_, X> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T: Send> Transport<T> for ThreadTransport<T> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.mailboxes.len()
    }

    fn send(&self, peer: usize, tag: Tag, msg: T) -> Result<(), TransportError> {
        self.check_peer(peer)?;
        if let Some(e) = self.aborted() {
            return Err(e);
        }
        lock(&self.shared.mailboxes[peer]).entry((self.rank, tag)).or_default().push_back(msg);
        self.shared.arrived[peer].notify_all();
        Ok(())
    }

    fn recv(&self, peer: usize, tag: Tag, timeout: Duration) -> Result<T, TransportError> {
        self.check_peer(peer)?;
        let deadline = Instant::now() + timeout;
        let mut mb = lock(&self.shared.mailboxes[self.rank]);
        loop {
            if let Some(msg) = mb.get_mut(&(peer, tag)).and_then(VecDeque::pop_front) {
                return Ok(msg);
            }
            if let Some(e) = self.aborted() {
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::Timeout {
                    rank: self.rank,
                    peer,
                    tag,
                    seconds: timeout.as_secs_f64(),
                });
            }
            // Wake at least every 50 ms to notice an abort raised without a notification.
            let wait = (deadline - now).min(Duration::from_millis(50));
            mb = self.shared.arrived[self.rank].wait_timeout(mb, wait).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn abort(&self, reason: &str) {
        let mut a = lock(&self.shared.abort);
        if a.is_none() {
            *a = Some((self.rank, reason.to_string()));
        }
        drop(a);
        for c in &self.shared.arrived {
            c.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(mb: usize) -> Tag {
        Tag { kind: TagKind::Activation, stage: 1, mb }
    }

    #[test]
    fn messages_match_by_peer_and_tag() {
        let mut g = ThreadTransport::<u32>::group(3).into_iter();
        let (t0, t1, t2) = (g.next().unwrap(), g.next().unwrap(), g.next().unwrap());
        t0.send(2, tag(1), 10).unwrap();
        t1.send(2, tag(1), 11).unwrap();
        t0.send(2, tag(0), 20).unwrap();
        let d = Duration::from_secs(1);
        assert_eq!(t2.recv(1, tag(1), d).unwrap(), 11);
        assert_eq!(t2.recv(0, tag(0), d).unwrap(), 20);
        assert_eq!(t2.recv(0, tag(1), d).unwrap(), 10);
    }

    #[test]
    fn recv_blocks_until_sent_from_another_thread() {
        let mut g = ThreadTransport::<u32>::group(2).into_iter();
        let (t0, t1) = (g.next().unwrap(), g.next().unwrap());
        let h = std::thread::spawn(move || t1.recv(0, tag(3), Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(20));
        t0.send(1, tag(3), 7).unwrap();
        assert_eq!(h.join().unwrap().unwrap(), 7);
    }

    #[test]
    fn timeout_and_abort_are_errors_naming_ranks() {
        let mut g = ThreadTransport::<u32>::group(2).into_iter();
        let (t0, t1) = (g.next().unwrap(), g.next().unwrap());
        let e = t1.recv(0, tag(0), Duration::from_millis(10)).unwrap_err();
        assert!(matches!(e, TransportError::Timeout { rank: 1, peer: 0, .. }));
        let h = std::thread::spawn(move || t1.recv(0, tag(0), Duration::from_secs(30)));
        t0.abort("0F3 failed: shape mismatch");
        let e = h.join().unwrap().unwrap_err();
        assert_eq!(
            e,
            TransportError::Aborted { failed_rank: 0, reason: "0F3 failed: shape mismatch".into() }
        );
        assert!(matches!(t0.send(5, tag(0), 1), Err(TransportError::BadPeer { peer: 5, .. })));
    }
}
