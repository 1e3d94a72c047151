//! [`MpiComm`]: the communicator of a rank that is an Open MPI process (cargo feature `mpi`;
//! docs/ARCHITECTURE.md "Runtime": Comm).
//!
//! It is a [`LinkComm`] whose [`Link`] is MPI point-to-point: one *progress thread* per process
//! initializes MPI (`MPI_THREAD_FUNNELED`: it alone calls MPI), then loops: it starts an
//! `MPI_Isend` for every buffer the rank's threads queued, completes finished sends, and receives
//! every message that has arrived (`MPI_Improbe` on any source, then the matched receive) into
//! the rank's [`Inbox`]. Sends never block the rank's threads and a rank always drains what
//! arrives, so two ranks sending large tensors to each other cannot deadlock. Messages from one
//! rank arrive in the order it queued them (one thread sends them in that order; MPI does not let
//! messages of one source, tag and communicator overtake each other).
//!
//! The progress thread polls; when nothing happened for a while it sleeps 50 µs between polls.
//! [`MpiComm::finish`] drains the queued sends and calls `MPI_Finalize`. A failed rank first
//! [`Comm::abort`]s, which reaches every other rank as a message, so each of them fails its
//! pending waits at once, reports, and finalizes too. A failed rank whose `MPI_Finalize` does
//! not return within 10 s (a peer that is alive but silent, e.g. stopped, never joins it) exits,
//! so that `mpirun` ends the job; a healthy rank waits in it as long as the others work.

use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::request::{Request, StaticScope};
use mpi::topology::Communicator;
use mpi::Threading;

use super::link::{Inbox, Link, LinkComm};
#[cfg(doc)]
use super::Comm;
use super::CommError;

/// How long [`MpiComm::finish`] waits for queued sends to complete.
const DRAIN: Duration = Duration::from_secs(10);

/// Why MPI could not start.
#[derive(Debug, thiserror::Error)]
pub enum MpiError {
    /// `MPI_Init_thread` was already called in this process, or failed.
    #[error("MPI could not be initialized (it can be initialized once per process)")]
    Init,
    /// The MPI library does not give the threading level the progress thread needs.
    #[error("the MPI library gives threading level {got:?}; graphpp needs at least Funneled")]
    Threading {
        /// What it gave.
        got: Threading,
    },
    /// The progress thread could not be started or died during start-up.
    #[error("the MPI progress thread failed to start: {0}")]
    Thread(String),
}

/// A queued operation for the progress thread.
enum Command {
    Send { dest: usize, bytes: Vec<u8> },
    Stop,
}

/// The [`Link`] of an [`MpiComm`]: a queue to the progress thread, and that thread.
#[derive(Debug)]
pub struct MpiLink {
    tx: Mutex<Sender<Command>>,
    progress: Mutex<Option<JoinHandle<()>>>,
}

impl Link for MpiLink {
    fn post(&self, dest: usize, bytes: Vec<u8>) -> Result<(), CommError> {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        tx.send(Command::Send { dest, bytes }).map_err(|_| CommError::Aborted {
            failed_rank: dest,
            reason: "the MPI progress thread has stopped".into(),
        })
    }
}

impl MpiLink {
    /// Stops the progress thread (see [`MpiComm::finish`]) and waits for it.
    fn stop(&self) {
        let handle = self.progress.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            let _ = self.tx.lock().unwrap_or_else(|e| e.into_inner()).send(Command::Stop);
            let _ = h.join();
        }
    }
}

impl Drop for MpiLink {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One rank of a world of Open MPI processes: a [`LinkComm`] over MPI (see the module doc).
pub type MpiComm = LinkComm<MpiLink>;

impl LinkComm<MpiLink> {
    /// Initializes MPI and starts the progress thread; rank and world are `MPI_COMM_WORLD`'s.
    ///
    /// # Errors
    /// [`MpiError::Init`] when MPI was initialized before in this process;
    /// [`MpiError::Threading`]; [`MpiError::Thread`].
    pub fn init() -> Result<MpiComm, MpiError> {
        let (ready_tx, ready_rx) = mpsc::channel();
        let (inbox_tx, inbox_rx) = mpsc::channel::<Arc<Inbox>>();
        let (tx, rx) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("mpi-progress".into())
            .spawn(move || progress(ready_tx, inbox_rx, rx))
            .map_err(|e| MpiError::Thread(e.to_string()))?;
        let (rank, world) = ready_rx.recv().map_err(|_| MpiError::Thread("it exited".into()))??;
        let link = MpiLink { tx: Mutex::new(tx), progress: Mutex::new(Some(handle)) };
        let (comm, inbox) = LinkComm::new(rank, world, link).map_err(|e| MpiError::Thread(e.to_string()))?;
        inbox_tx.send(inbox).map_err(|_| MpiError::Thread("it exited".into()))?;
        Ok(comm)
    }

    /// Drains the queued sends, then calls `MPI_Finalize`; when a send has not completed after
    /// 10 s (its receiver is gone) it calls `MPI_Abort` instead, which makes `mpirun` stop every
    /// rank. Call it once, when the rank is done (after [`Comm::abort`] if it failed); later
    /// communication fails with [`CommError::Aborted`]. Dropping the communicator does the same.
    pub fn finish(&self) {
        self.link().stop();
    }
}

/// `MPI_Finalize` (dropping `universe`) for a rank whose run failed, or — when it has not
/// returned after [`DRAIN`]: a peer that is alive but silent (stopped, hung) never reaches it —
/// a line on standard error and `_exit(1)`, which makes `mpirun` end the job instead of waiting
/// for that peer forever.
fn finalize_or_exit(universe: mpi::environment::Universe) {
    let (done_tx, done_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = done_rx.recv_timeout(DRAIN) {
            eprintln!(
                "MPI_Finalize did not return in {} s (another rank is silent: stopped or hung): exiting",
                DRAIN.as_secs()
            );
            // SAFETY: _exit ends the process at once; MPI state is abandoned on purpose.
            unsafe { libc::_exit(1) };
        }
    });
    drop(universe);
    let _ = done_tx.send(());
}

/// An `MPI_Isend` in flight and the buffer it reads, owned here until it completes.
struct InFlight {
    request: Request<'static, [u8], StaticScope>,
    buffer: *mut [u8],
}

impl InFlight {
    fn start(world: &mpi::topology::SimpleCommunicator, dest: usize, bytes: Vec<u8>) -> InFlight {
        let buffer: &'static mut [u8] = Box::leak(bytes.into_boxed_slice());
        let ptr: *mut [u8] = buffer;
        // dest < world size: the LinkComm checked it.
        let request = world.process_at_rank(dest as i32).immediate_send(StaticScope, &*buffer);
        InFlight { request, buffer: ptr }
    }

    /// `Ok` once the send completed (its buffer freed), else the still pending send.
    fn test(self) -> Result<(), InFlight> {
        match self.request.test() {
            Ok(_) => {
                // SAFETY: `buffer` came from `Box::leak` in `start`, and MPI no longer reads it
                // once the request completed; nothing else holds it.
                drop(unsafe { Box::from_raw(self.buffer) });
                Ok(())
            }
            Err(request) => Err(InFlight { request, buffer: self.buffer }),
        }
    }
}

/// The progress thread (see the module doc).
fn progress(
    ready: Sender<Result<(usize, usize), MpiError>>,
    inbox: Receiver<Arc<Inbox>>,
    commands: Receiver<Command>,
) {
    let Some((universe, threading)) = mpi::initialize_with_threading(Threading::Funneled) else {
        let _ = ready.send(Err(MpiError::Init));
        return;
    };
    if threading < Threading::Funneled {
        let _ = ready.send(Err(MpiError::Threading { got: threading }));
        return;
    }
    let world = universe.world();
    let _ = ready.send(Ok((world.rank() as usize, world.size() as usize)));
    let Ok(inbox) = inbox.recv() else { return };
    let mut in_flight: Vec<InFlight> = Vec::new();
    let mut stop: Option<Instant> = None;
    let mut idle = 0u32;
    loop {
        let mut busy = false;
        while stop.is_none() {
            match commands.try_recv() {
                Ok(Command::Send { dest, bytes }) => {
                    in_flight.push(InFlight::start(&world, dest, bytes));
                    busy = true;
                }
                Ok(Command::Stop) | Err(TryRecvError::Disconnected) => stop = Some(Instant::now() + DRAIN),
                Err(TryRecvError::Empty) => break,
            }
        }
        let before = in_flight.len();
        in_flight = in_flight.into_iter().filter_map(|f| f.test().err()).collect();
        busy |= in_flight.len() != before;
        while let Some(probed) = world.any_process().immediate_matched_probe() {
            let (bytes, status) = probed.matched_receive_vec::<u8>();
            let src = status.source_rank() as usize;
            if let Err(e) = inbox.deliver(src, &bytes) {
                inbox.abort_local(&format!("rank {}: a message from rank {src}: {e}", world.rank()));
            }
            busy = true;
        }
        if let Some(deadline) = stop {
            if in_flight.is_empty() || Instant::now() >= deadline {
                if !in_flight.is_empty() {
                    // Sends that never completed must not be freed: MPI may still read them.
                    std::mem::forget(in_flight);
                    world.abort(1);
                }
                // A healthy rank finalizes and waits there for the leader's last solo work (the
                // final checkpoint, the sample, the report); one whose run failed must not wait
                // for a peer that may never come.
                if inbox.is_aborted() {
                    finalize_or_exit(universe);
                } else {
                    drop(universe);
                }
                return;
            }
        }
        if busy {
            idle = 0;
        } else {
            idle = idle.saturating_add(1);
            if idle > 64 {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::yield_now();
            }
        }
    }
}
