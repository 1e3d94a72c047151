//! How this process takes part in a run (docs/ARCHITECTURE.md "Runtime": Comm): every rank as a
//! thread of this process (the default), or one rank of a world of processes started by
//! `mpirun -n W` (cargo feature `mpi`; Open MPI). The same `graphpp train` command line serves
//! both; under `mpirun` only the leader (world rank 0) prints and writes files.

use std::sync::Arc;
use std::time::Duration;

use graphpp_comm::Comm;
use graphpp_comm::{CommError, Group};
use graphpp_runtime::kernels::device::DeviceSpec;

/// Environment variables through which `mpirun` (Open MPI; MPICH and PMIx launchers) gives a
/// process its world size, and its number of processes on this host.
const WORLD_SIZE_VARS: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"];
const LOCAL_SIZE_VARS: [&str; 2] = ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"];
/// The variables launchers set to a process's rank among the run's processes on its host.
const LOCAL_RANK_VARS: [&str; 2] = ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"];

/// Why this process cannot join its run.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// Started by `mpirun` with several processes, but built without MPI.
    #[error(
        "started by mpirun as one of {world} processes, but this graphpp was built without MPI \
         (build it with `cargo build --release --features mpi`, which needs Debian's openmpi-bin \
         libopenmpi-dev libclang-dev), or run it without mpirun: its ranks are then threads"
    )]
    NoMpi {
        /// The world size mpirun gave.
        world: usize,
    },
    /// A GPU run started as several processes: its ranks run as threads sharing the device
    /// (a communicator over NCCL for one process per GPU is not built yet).
    #[error(
        "mpirun started {world} processes with --device {device}: a GPU run's ranks are threads \
         sharing the device in one process (one process per GPU over NCCL is not built yet); \
         run it without mpirun"
    )]
    DeviceProcesses {
        /// The world size mpirun gave.
        world: usize,
        /// The device asked for.
        device: DeviceSpec,
    },
    /// MPI did not start.
    #[cfg(feature = "mpi")]
    #[error(transparent)]
    Mpi(#[from] graphpp_comm::mpi::MpiError),
    /// The world size does not fit the mesh.
    #[error(
        "mpirun started {world} processes, but --ranks {pp} × --dp {dp} × --tp {tp} = {} ranks: \
         start `mpirun -n {}` or change --ranks / --dp / --tp",
        pp.saturating_mul(*dp).saturating_mul(*tp),
        pp.saturating_mul(*dp).saturating_mul(*tp)
    )]
    WorldSize {
        /// Processes started.
        world: usize,
        /// Pipeline ranks.
        pp: usize,
        /// Data-parallel replicas.
        dp: usize,
        /// Tensor-parallel degree.
        tp: usize,
    },
    /// The processes do not run the same thing (see [`Launch::agree`]).
    #[error(
        "the processes disagree on {what}: ranks {ranks:?} differ from rank 0; every process must \
         run the same command line and, to resume, find the same newest checkpoint"
    )]
    Disagree {
        /// What was compared.
        what: String,
        /// The ranks whose value differs from rank 0's.
        ranks: Vec<usize>,
    },
    /// The comparison itself failed (another rank stopped, a timeout).
    #[error("comparing the processes' settings: {0}")]
    Comm(#[from] CommError),
}

/// How long [`Launch::agree`] waits for the slowest process (it may still be reading its data).
const AGREE_TIMEOUT: Duration = Duration::from_secs(600);

/// A 64-bit fingerprint of this process's command line (after the program name) and `extra`
/// (e.g. the checkpoint it would resume from), for [`Launch::agree`].
pub fn command_fingerprint(extra: &str) -> u64 {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for a in std::env::args_os().skip(1) {
        h.update(a.as_encoded_bytes());
        h.update([0u8]);
    }
    h.update(extra.as_bytes());
    let d = h.finalize();
    u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

fn env_count(vars: &[&str]) -> Option<usize> {
    vars.iter().find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

/// The world size `mpirun` gave this process, if it started it.
pub fn launched_world_size() -> Option<usize> {
    env_count(&WORLD_SIZE_VARS)
}

/// Processes of this run on this host (1 without `mpirun`): they share its cores.
pub fn local_processes() -> usize {
    env_count(&LOCAL_SIZE_VARS).unwrap_or(1).max(1)
}

/// This process's rank among the run's processes on its host (0 without `mpirun`): a process
/// of local rank 0 is the first of its host.
pub fn local_rank() -> usize {
    env_count(&LOCAL_RANK_VARS).unwrap_or(0)
}

/// This process's place in its run.
pub struct Launch {
    /// `None`: every rank is a thread here.
    comm: Option<Arc<dyn Comm>>,
    #[cfg(feature = "mpi")]
    mpi: Option<Arc<graphpp_comm::mpi::MpiComm>>,
}

impl std::fmt::Debug for Launch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launch").field("rank", &self.rank()).field("world", &self.world()).finish()
    }
}

impl Launch {
    /// Every rank a thread of this process.
    pub fn threads() -> Launch {
        Launch {
            comm: None,
            #[cfg(feature = "mpi")]
            mpi: None,
        }
    }

    /// Threads, or — when `mpirun` started this process with a world of more than one —
    /// one rank over MPI (initialized here).
    ///
    /// # Errors
    /// [`LaunchError::NoMpi`] under `mpirun -n W` (W > 1) in a build without the `mpi` feature;
    /// `LaunchError::Mpi` when MPI does not start.
    pub fn detect() -> Result<Launch, LaunchError> {
        match launched_world_size() {
            Some(world) if world > 1 => Self::mpi(world),
            _ => Ok(Launch::threads()),
        }
    }

    #[cfg(feature = "mpi")]
    fn mpi(_world: usize) -> Result<Launch, LaunchError> {
        let mpi = Arc::new(graphpp_comm::mpi::MpiComm::init()?);
        Ok(Launch { comm: Some(mpi.clone()), mpi: Some(mpi) })
    }

    #[cfg(not(feature = "mpi"))]
    fn mpi(world: usize) -> Result<Launch, LaunchError> {
        Err(LaunchError::NoMpi { world })
    }

    /// The communicator of this process's rank; `None` when every rank is a thread here.
    pub fn comm(&self) -> Option<Arc<dyn Comm>> {
        self.comm.clone()
    }

    /// This process's world rank (0 when every rank is a thread here).
    pub fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, |c| c.rank())
    }

    /// Number of processes of the run (1 when every rank is a thread here).
    pub fn world(&self) -> usize {
        self.comm.as_ref().map_or(1, |c| c.world())
    }

    /// Whether this process prints and writes the run's files (world rank 0).
    pub fn is_leader(&self) -> bool {
        self.rank() == 0
    }

    /// Checks that a run of `pp` × `dp` × `tp` ranks on `device` fits the processes started.
    ///
    /// # Errors
    /// [`LaunchError::WorldSize`]; [`LaunchError::DeviceProcesses`] for a GPU run under mpirun.
    pub fn check_world(
        &self,
        pp: usize,
        dp: usize,
        tp: usize,
        device: DeviceSpec,
    ) -> Result<(), LaunchError> {
        let world = self.world();
        if world > 1 && !device.is_cpu() {
            return Err(LaunchError::DeviceProcesses { world, device });
        }
        if world > 1 && Some(world) != pp.checked_mul(dp).and_then(|n| n.checked_mul(tp)) {
            return Err(LaunchError::WorldSize { world, pp, dp, tp });
        }
        Ok(())
    }

    /// Runs a command's body `f` as this process's part of a run: detects the launch, tells
    /// `announce` (which silences standard output outside the leader and names the rank in
    /// error lines), and afterwards [`Launch::finish`]es —
    /// aborting the other ranks when `f` failed, unless `benign` says the error is not a rank
    /// failure (an interruption, a verdict).
    ///
    /// # Errors
    /// [`LaunchError`] (as `anyhow`), or `f`'s.
    pub fn run(
        announce: impl FnOnce(&Launch),
        benign: impl Fn(&anyhow::Error) -> bool,
        f: impl FnOnce(&Launch) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let launch = Launch::detect()?;
        announce(&launch);
        let result = f(&launch);
        let failure = result.as_ref().err().filter(|e| !benign(e));
        launch.finish(failure.map(|e| format!("{e:#}")).as_deref());
        result
    }

    /// Checks that every process holds the same `fingerprint` of `what` (e.g.
    /// [`command_fingerprint`]): an all-reduce of every rank's value at its own index, 16 bits per
    /// f32 entry (exact). Nothing to do for threads.
    ///
    /// # Errors
    /// [`LaunchError::Disagree`] on every process, naming the ranks that differ from rank 0;
    /// [`LaunchError::Comm`].
    pub fn agree(&self, what: &str, fingerprint: u64) -> Result<(), LaunchError> {
        let Some(comm) = &self.comm else { return Ok(()) };
        let world = comm.world();
        let mut v = vec![0f32; 4 * world];
        for k in 0..4 {
            v[4 * comm.rank() + k] = ((fingerprint >> (16 * k)) & 0xffff) as f32;
        }
        let t = candle_core::Tensor::from_vec(v, 4 * world, &candle_core::Device::Cpu)
            .map_err(|e| CommError::Wire(graphpp_comm::wire::WireError::Tensor { message: e.to_string() }))?;
        let all: Vec<f32> =
            comm.all_reduce(&Group::world(world)?, &t)?.wait(AGREE_TIMEOUT)?.to_vec1().map_err(|e| {
                CommError::Wire(graphpp_comm::wire::WireError::Tensor { message: e.to_string() })
            })?;
        let ranks: Vec<usize> = (1..world).filter(|&r| all[4 * r..4 * r + 4] != all[..4]).collect();
        if ranks.is_empty() {
            Ok(())
        } else {
            Err(LaunchError::Disagree { what: what.to_string(), ranks })
        }
    }

    /// Ends this process's part: after a failure, tells every other rank to stop (`reason`
    /// names this rank and the error); then ends MPI. Nothing to do for threads.
    pub fn finish(&self, failure: Option<&str>) {
        if let (Some(c), Some(reason)) = (&self.comm, failure) {
            c.abort(&format!("rank {}: {reason}", c.rank()));
        }
        #[cfg(feature = "mpi")]
        if let Some(m) = &self.mpi {
            m.finish();
        }
    }
}
