//! An emulated interconnect over any [`Comm`], so that communication costs — and whether a
//! schedule hides them — can be measured on one machine.
//!
//! [`EmulatedComm`] delays what it passes on by a [`LinkModel`]: a latency plus the bytes over a
//! bandwidth. A point-to-point message to a peer leaves through that peer's link, which carries
//! one message at a time: it starts when the link is free, occupies it for `bytes / bandwidth`,
//! and arrives `latency` after that (a send still never blocks: a per-peer thread hands the
//! message on when it is due). A collective completes no earlier than `latency + volume /
//! bandwidth` after it was started, with the volume a ring algorithm moves through each rank:
//! `2(n−1)/n` of the tensor for an all-reduce, `(n−1)/n` of the full tensor for an all-gather
//! or reduce-scatter, `(n−1)/n` of the rows for an all-to-all (n = group size; nothing for a
//! group of one). The values are those of the wrapped communicator, bit for bit.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::{AllToAllOutput, Comm, CommError, Group, Pending, PendingOp, Tag};

/// A link's latency and bandwidth (`--link LATENCY_US,GBPS`, e.g. `20,10`: 20 µs, 10 GB/s).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LinkModel {
    /// Delay of every message and collective, microseconds.
    pub latency_us: f64,
    /// Bandwidth, GB/s (10⁹ bytes per second).
    pub gb_per_s: f64,
}

impl LinkModel {
    /// The latency.
    pub fn latency(&self) -> Duration {
        Duration::from_secs_f64(self.latency_us / 1e6)
    }

    /// The time `bytes` take on the link after the latency.
    pub fn transfer(&self, bytes: f64) -> Duration {
        Duration::from_secs_f64(bytes / (self.gb_per_s * 1e9))
    }

    /// Latency plus the transfer time of `bytes`.
    pub fn delay(&self, bytes: f64) -> Duration {
        self.latency() + self.transfer(bytes)
    }
}

/// A `--link` value that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("link `{0}`: expected LATENCY_US,GBPS with a latency of 0 to 10^7 microseconds (10 s) and a bandwidth of 10^-6 to 10^6 GB/s (e.g. 20,10)")]
pub struct LinkParseError(pub String);

impl FromStr for LinkModel {
    type Err = LinkParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || LinkParseError(s.to_string());
        let (lat, bw) = s.split_once(',').ok_or_else(bad)?;
        let lat: f64 = lat.trim().parse().map_err(|_| bad())?;
        let bw: f64 = bw.trim().parse().map_err(|_| bad())?;
        // Bounded so that no message can stall a run for more than seconds.
        if !((0.0..=1e7).contains(&lat) && (1e-6..=1e6).contains(&bw)) {
            return Err(bad());
        }
        Ok(LinkModel { latency_us: lat, gb_per_s: bw })
    }
}

/// `20 µs, 10 GB/s`.
impl fmt::Display for LinkModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} µs, {} GB/s", self.latency_us, self.gb_per_s)
    }
}

fn bytes(t: &Tensor) -> f64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as f64
}

/// One outgoing link: its sender thread (and the queue feeding it) and when it is next free.
struct Outgoing {
    queue: Sender<(Instant, Tag, Tensor)>,
    thread: std::thread::JoinHandle<()>,
    free_at: Instant,
}

/// A [`Comm`] whose traffic takes the time a [`LinkModel`] says (see the module doc). Dropping it
/// waits until every queued message has been handed on, so a process that ends right after its
/// last send loses nothing.
pub struct EmulatedComm {
    inner: Arc<dyn Comm>,
    link: LinkModel,
    links: Mutex<HashMap<usize, Outgoing>>,
    /// The first error a link's thread met handing a message on; every later send returns it.
    failed: Arc<Mutex<Option<CommError>>>,
}

impl EmulatedComm {
    /// `inner` behind `link`.
    pub fn new(inner: Arc<dyn Comm>, link: LinkModel) -> Self {
        EmulatedComm { inner, link, links: Mutex::new(HashMap::new()), failed: Arc::new(Mutex::new(None)) }
    }

    /// The link to `peer`, its sender thread started on first use: it sleeps until each
    /// message is due and hands it on; a failing hand-over is kept for the next send, and the
    /// communicator is aborted (after an abort by any rank the inner send fails, so the thread
    /// stops delivering).
    fn outgoing<'a>(&self, links: &'a mut HashMap<usize, Outgoing>, peer: usize) -> &'a mut Outgoing {
        links.entry(peer).or_insert_with(|| {
            let (tx, rx) = channel::<(Instant, Tag, Tensor)>();
            let (inner, failed) = (Arc::clone(&self.inner), Arc::clone(&self.failed));
            let thread = std::thread::spawn(move || {
                for (due, tag, x) in rx {
                    std::thread::sleep(due.saturating_duration_since(Instant::now()));
                    if let Err(e) = inner.send(peer, tag, x) {
                        let mut slot = failed.lock().unwrap_or_else(|p| p.into_inner());
                        if slot.is_none() {
                            *slot = Some(e.clone());
                        }
                        drop(slot);
                        inner.abort(&format!("rank {}: emulated link to rank {peer}: {e}", inner.rank()));
                        return;
                    }
                }
            });
            Outgoing { queue: tx, thread, free_at: Instant::now() }
        })
    }

    /// `p` completing no earlier than `volume` bytes after `start`.
    fn delayed<T: Send + Sync + 'static>(
        &self,
        p: Pending<T>,
        start: Instant,
        volume: f64,
        n: usize,
    ) -> Pending<T> {
        let ready_at = if n > 1 { start + self.link.delay(volume) } else { start };
        let (op, seq) = (p.op(), p.seq());
        Pending::new(op, seq, Box::new(Delayed { inner: p, ready_at }))
    }
}

impl Drop for EmulatedComm {
    /// Closes every link's queue and waits for its thread to hand on what is left.
    fn drop(&mut self) {
        let links = std::mem::take(self.links.get_mut().unwrap_or_else(|p| p.into_inner()));
        for (_, out) in links {
            drop(out.queue);
            let _ = out.thread.join();
        }
    }
}

/// A collective that completes at `ready_at` at the earliest.
struct Delayed<T> {
    inner: Pending<T>,
    ready_at: Instant,
}

impl<T: Send + Sync> PendingOp<T> for Delayed<T> {
    fn wait(self: Box<Self>, timeout: Duration) -> Result<T, CommError> {
        let out = self.inner.wait(timeout)?;
        std::thread::sleep(self.ready_at.saturating_duration_since(Instant::now()));
        Ok(out)
    }

    fn is_ready(&self) -> bool {
        self.inner.is_ready() && Instant::now() >= self.ready_at
    }
}

/// The share of a tensor a ring collective moves through each of `n` ranks: `(n−1)/n` (an
/// all-gather's or reduce-scatter's whole volume per byte of the full tensor; an all-reduce is
/// twice it). The emulated link and the planner's cost model both charge it.
pub fn ring(n: usize) -> f64 {
    (n.saturating_sub(1)) as f64 / n.max(1) as f64
}

impl Comm for EmulatedComm {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world(&self) -> usize {
        self.inner.world()
    }

    fn send(&self, peer: usize, tag: Tag, x: Tensor) -> Result<(), CommError> {
        if peer >= self.world() {
            return self.inner.send(peer, tag, x);
        }
        if let Some(e) = self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(e);
        }
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let size = bytes(&x);
        let link = self.link;
        let out = self.outgoing(&mut links, peer);
        let start = out.free_at.max(Instant::now());
        out.free_at = start + link.transfer(size);
        let due = out.free_at + link.latency();
        out.queue.send((due, tag, x)).map_err(|_| CommError::Aborted {
            failed_rank: self.rank(),
            reason: format!("the emulated link to rank {peer} stopped"),
        })
    }

    fn recv(&self, peer: usize, tag: Tag, timeout: Duration) -> Result<Tensor, CommError> {
        self.inner.recv(peer, tag, timeout)
    }

    fn all_reduce(&self, group: &Group, x: &Tensor) -> Result<Pending<Tensor>, CommError> {
        let start = Instant::now();
        let p = self.inner.all_reduce(group, x)?;
        Ok(self.delayed(p, start, 2.0 * ring(group.size()) * bytes(x), group.size()))
    }

    fn all_gather(&self, group: &Group, x: &Tensor) -> Result<Pending<Tensor>, CommError> {
        let start = Instant::now();
        let p = self.inner.all_gather(group, x)?;
        let n = group.size();
        Ok(self.delayed(p, start, ring(n) * n as f64 * bytes(x), n))
    }

    fn reduce_scatter(&self, group: &Group, x: &Tensor) -> Result<Pending<Tensor>, CommError> {
        let start = Instant::now();
        let p = self.inner.reduce_scatter(group, x)?;
        Ok(self.delayed(p, start, ring(group.size()) * bytes(x), group.size()))
    }

    fn all_to_all(
        &self,
        group: &Group,
        x: &Tensor,
        send_counts: &[usize],
    ) -> Result<Pending<AllToAllOutput>, CommError> {
        let start = Instant::now();
        let p = self.inner.all_to_all(group, x, send_counts)?;
        Ok(self.delayed(p, start, ring(group.size()) * bytes(x), group.size()))
    }

    fn barrier(&self, group: &Group) -> Result<Pending<()>, CommError> {
        let start = Instant::now();
        let p = self.inner.barrier(group)?;
        Ok(self.delayed(p, start, 0.0, group.size()))
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ThreadComm;
    use candle_core::Device;

    #[test]
    fn parses_latency_and_bandwidth() {
        let l: LinkModel = "20,10".parse().unwrap();
        assert_eq!((l.latency_us, l.gb_per_s), (20.0, 10.0));
        assert_eq!(l.delay(1e6), Duration::from_micros(120));
        assert_eq!(l.to_string(), "20 µs, 10 GB/s");
        for bad in ["20", "x,1", "-1,1", "1,0", "1,inf", "1e12,1", "0,1e-9", "nan,1"] {
            let e = bad.parse::<LinkModel>().unwrap_err();
            assert!(e.to_string().contains("LATENCY_US,GBPS"), "{bad}: {e}");
        }
    }

    fn pair(link: &str) -> Vec<EmulatedComm> {
        let link: LinkModel = link.parse().unwrap();
        ThreadComm::world(2).into_iter().map(|c| EmulatedComm::new(Arc::new(c), link)).collect()
    }

    /// A message arrives no earlier than latency + bytes / bandwidth after it was sent, the next
    /// one on the same link a transfer time later still; the values are unchanged.
    #[test]
    fn messages_take_the_links_time_in_order() {
        // 10 ms latency, 0.1 GB/s: 1 MB takes 10 ms on the wire.
        let [a, b]: [EmulatedComm; 2] = pair("10000,0.1").try_into().ok().unwrap();
        let x = Tensor::ones(250_000, candle_core::DType::F32, &Device::Cpu).unwrap();
        let tag = |mb| Tag::Activation { stage: 1, mb };
        let t0 = Instant::now();
        a.send(1, tag(0), x.clone()).unwrap();
        a.send(1, tag(1), (x.clone() * 2.0).unwrap()).unwrap();
        let first = b.recv(0, tag(0), Duration::from_secs(5)).unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(20));
        let second = b.recv(0, tag(1), Duration::from_secs(5)).unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(30));
        assert_eq!(first.to_vec1::<f32>().unwrap(), x.to_vec1::<f32>().unwrap());
        assert_eq!(second.sum_all().unwrap().to_scalar::<f32>().unwrap(), 500_000.0);
    }

    /// An all-reduce of 2 ranks completes after latency + 2·(1/2)·bytes / bandwidth at the
    /// earliest, with the wrapped communicator's sum.
    #[test]
    fn collectives_complete_after_their_volume() {
        let comms = pair("5000,0.1");
        let g = Group::world(2).unwrap();
        let t0 = Instant::now();
        let handles: Vec<_> = comms
            .iter()
            .map(|c| {
                let x = Tensor::full(c.rank() as f32 + 1.0, 250_000, &Device::Cpu).unwrap();
                c.all_reduce(&g, &x).unwrap()
            })
            .collect();
        for h in handles {
            let sum = h.wait(Duration::from_secs(5)).unwrap();
            assert_eq!(sum.max(0).unwrap().to_scalar::<f32>().unwrap(), 3.0);
        }
        // 5 ms + 1 MB / 0.1 GB/s = 15 ms.
        assert!(t0.elapsed() >= Duration::from_millis(15));
    }
}

#[cfg(test)]
mod lifetime_tests {
    use super::*;
    use crate::ThreadComm;
    use candle_core::Device;

    /// A rank that sends and drops its communicator at once still delivers (the drop waits for
    /// the link); after an abort the next send reports it instead of queueing.
    #[test]
    fn dropping_flushes_and_an_abort_stops_sending() {
        let link: LinkModel = "20000,1".parse().unwrap();
        let mut world = ThreadComm::world(2).into_iter();
        let (a, b) = (world.next().unwrap(), Arc::new(world.next().unwrap()));
        let a = EmulatedComm::new(Arc::new(a), link);
        let tag = Tag::Gradient { stage: 0, mb: 3 };
        a.send(1, tag, Tensor::new(&[7f32], &Device::Cpu).unwrap()).unwrap();
        drop(a);
        let got = b.recv(0, tag, Duration::from_millis(1)).unwrap();
        assert_eq!(got.to_vec1::<f32>().unwrap(), vec![7.0]);

        let mut world = ThreadComm::world(2).into_iter();
        let (a, b) = (world.next().unwrap(), world.next().unwrap());
        let a = EmulatedComm::new(Arc::new(a), "0,1".parse().unwrap());
        b.abort("rank 1: broken");
        a.send(1, tag, Tensor::new(&[1f32], &Device::Cpu).unwrap()).unwrap();
        // The link's thread meets the abort; the next send says so.
        let deadline = Instant::now() + Duration::from_secs(5);
        let e = loop {
            match a.send(1, tag, Tensor::new(&[1f32], &Device::Cpu).unwrap()) {
                Err(e) => break e,
                Ok(()) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                Ok(()) => panic!("sends after an abort keep succeeding"),
            }
        };
        assert!(e.to_string().contains("broken"), "{e}");
    }
}
