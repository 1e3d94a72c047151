//! The subcommands, plus [`emit`], the one way they write to standard output.

pub mod compare;
pub mod export;
pub mod graph;
pub mod hardware;
pub mod layout;
pub mod model;
pub mod plan;
pub mod profile;
pub mod schedule;
pub mod train;
pub mod value;
pub mod verify;

use std::io::Write;

use graphpp::launch::Launch;
use graphpp_graph::DType;

/// Parses `--dtype` / `--reference-dtype`: the compute dtype of the stage graphs, `f32` or `bf16`
/// (bf16 mixed precision: f32 master weights, gradients and optimizer state). Errors: any other
/// name (clap reports it with the flag, exit 2).
pub fn parse_compute_dtype(s: &str) -> Result<DType, String> {
    match s.parse::<DType>() {
        Ok(d @ (DType::F32 | DType::BF16)) => Ok(d),
        _ => Err(format!("`{s}` is not a compute dtype (expected f32 or bf16)")),
    }
}

/// Sets the intra-op threads per rank (`RAYON_NUM_THREADS`: the size of each rank's pool,
/// [`graphpp_runtime::kernels::threads`], and gemm's parallelism) to `explicit`, or to the available cores
/// divided among `ranks` rank threads (at least 1), unless the user set that variable; and
/// candle's spinning barrier pool (`CANDLE_NUM_THREADS`) to 1 unless the user set it (its idle
/// worker held a core that gemm's second thread needed); and makes the C allocator keep freed
/// memory ([`graphpp_runtime::malloc::retain_freed_memory`]); `ranks` are this host's, every
/// local process's ([`graphpp_runtime::kernels::threads::set_host_ranks`]: idle workers poll for work
/// only when all of them fit the cores). Returns the threads per rank and the oversubscription
/// warning to print ([`OpThreads::warn`]) once the run's settings are known to be valid (an
/// invalid run should say why, not warn first). Must run before the first tensor operation.
///
/// Why: every rank is an OS thread; with candle's default (all cores per operation) the ranks'
/// spinning worker pools fight over the cores — on this 2-core machine `graphpp train` with 2 ranks
/// ran 2.7× slower (8.1k vs 21.9k tokens/s).
pub fn set_op_threads(ranks: usize, explicit: Option<usize>) -> OpThreads {
    graphpp_runtime::malloc::retain_freed_memory();
    let own = std::thread::available_parallelism().map_or(1, |n| n.get());
    let host = graphpp_runtime::kernels::threads::host_cores();
    let n = explicit.unwrap_or_else(|| default_threads(ranks, own, host));
    if explicit.is_some() || std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    let threads = graphpp_runtime::kernels::threads::op_threads();
    graphpp_runtime::kernels::threads::set_host_ranks(ranks);
    let local_rank = std::env::var(LOCAL_RANK_VAR).ok();
    let warning = oversubscribed(ranks, threads, host).filter(|_| first_on_host(local_rank.as_deref()));
    OpThreads { threads, warning }
}

/// What [`set_op_threads`] chose.
pub struct OpThreads {
    /// Intra-op threads per rank.
    pub threads: usize,
    /// The oversubscription warning of this host, if any.
    warning: Option<String>,
}

impl OpThreads {
    /// Prints the oversubscription warning, if any, to standard error.
    pub fn warn(&self) {
        if let Some(w) = &self.warning {
            eprintln!("{w}");
        }
    }
}

/// Open MPI's variable for a process's rank among those on its host.
const LOCAL_RANK_VAR: &str = "OMPI_COMM_WORLD_LOCAL_RANK";

/// Whether this process speaks for its host: not under `mpirun` (`local_rank` unset), or its
/// first local process — the host's warnings are printed once, not by every process.
fn first_on_host(local_rank: Option<&str>) -> bool {
    local_rank.is_none_or(|r| r.trim() == "0")
}

/// Threads per rank when none is asked for: the host's cores shared among its `ranks`, but no
/// more than the `own` cores this process may run on (under `mpirun`, the cores it is bound to);
/// at least 1.
fn default_threads(ranks: usize, own: usize, host: usize) -> usize {
    (host / ranks.max(1)).min(own).max(1)
}

/// The warning when `ranks × threads` intra-op threads exceed the machine's `cores`: the ranks'
/// worker pools then contend for the cores and every rank slows down (measured on 2 cores:
/// `--threads-per-rank 2` with 2 ranks 1.8k tokens/s vs 21k with 1 thread).
fn oversubscribed(ranks: usize, threads: usize, cores: usize) -> Option<String> {
    (ranks.saturating_mul(threads) > cores).then(|| {
        format!(
            "warning: {ranks} ranks × {} per rank exceed this machine's {cores} cores: the ranks' \
             thread pools will contend (expect a slowdown{})",
            plural(threads as u64, "thread", "threads"),
            if threads > 1 { "; lower --threads-per-rank" } else { "; use fewer ranks or a larger machine" }
        )
    })
}

/// The contents of the files a command line names as its settings (`--strategy`,
/// `--schedule-file`), for the fingerprint the processes of a run compare before step 1
/// ([`graphpp::launch::command_fingerprint`]): the same path on two hosts may hold different
/// files. An unreadable file adds nothing (reading it fails elsewhere, naming it).
pub fn settings_files(files: &[Option<&std::path::Path>]) -> String {
    files.iter().flatten().filter_map(|p| std::fs::read_to_string(p).ok()).collect::<Vec<_>>().join("\0")
}

/// `"{n} {one}"` or `"{n} {many}"`: the noun in the plural unless `n` is 1 (`1 step`, `2 steps`).
pub fn plural(n: impl Into<u128>, one: &str, many: &str) -> String {
    let n = n.into();
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Set in the processes of a run other than its leader: they print nothing to standard output.
static QUIET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// This process's world rank when the run has several processes (`usize::MAX`: one process).
static RANK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(usize::MAX);

/// Takes note of this process's place in its run: outside the leader [`emit`] (standard output)
/// is silenced, so that output is printed once; with several processes, error lines name the
/// rank ([`rank_prefix`]).
pub fn announce(launch: &graphpp::launch::Launch) {
    use std::sync::atomic::Ordering;
    if !launch.is_leader() {
        QUIET.store(true, Ordering::Relaxed);
    }
    if launch.world() > 1 {
        RANK.store(launch.rank(), Ordering::Relaxed);
    }
}

/// Whether this process prints nothing to standard output (a non-leader rank).
pub fn is_quiet() -> bool {
    QUIET.load(std::sync::atomic::Ordering::Relaxed)
}

/// `"rank R: "` in a run of several processes, else empty.
pub fn rank_prefix() -> String {
    match RANK.load(std::sync::atomic::Ordering::Relaxed) {
        usize::MAX => String::new(),
        r => format!("rank {r}: "),
    }
}

/// Writes `text` to standard output. A closed pipe (`graphpp … | head`) ends the output quietly
/// instead of panicking; other write errors are returned.
pub fn emit(text: &str) -> anyhow::Result<()> {
    if QUIET.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

/// Writes `line` to standard error in one write, so that the lines of several ranks under
/// `mpirun` (which merges their standard error) do not interleave.
pub fn report(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// `error: [rank N: ]<the error and its causes>`: the line a failed command ends with.
pub fn error_line(e: &anyhow::Error) -> String {
    format!("error: {}{}", rank_prefix(), message(e))
}

/// The error and its causes on one line ([`graphpp_schedule::error_text::with_causes`]).
fn message(e: &anyhow::Error) -> String {
    graphpp_schedule::error_text::with_causes(e.as_ref())
}

/// An error a rank has already written to standard error ([`launch`]); `main` exits 1 without
/// writing it again. Holds the message, which the rank's abort also carries to the others.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Reported(String);

/// Runs `f` under [`Launch::run`] (threads, or this process's rank under `mpirun`). In a run of
/// several processes a rank that fails writes its error line first and only then tells the
/// other ranks to stop: their answer (Open MPI's abort) may end this process before `main`
/// could write it. `benign` errors (a stop on a signal, a verification above tolerance) stop
/// no one.
///
/// # Errors
/// Those of `f`, the failure written already as [`Reported`].
pub fn launch(
    benign: impl Fn(&anyhow::Error) -> bool + Copy,
    f: impl FnOnce(&Launch) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    Launch::run(announce, benign, |launch| match f(launch) {
        Err(e) if launch.world() > 1 && !benign(&e) => {
            report(&error_line(&e));
            Err(Reported(message(&e)).into())
        }
        r => r,
    })
}

/// ", bf16 matmuls on PATH" for a run's first line where bf16 products run on graphpp's CPU
/// kernels (`path`: `TrainSetup::bf16_path`), else nothing.
pub(crate) fn bf16_matmuls(path: Option<graphpp_runtime::kernels::bf16_gemm::Bf16Gemm>) -> String {
    path.map_or(String::new(), |p| format!(", bf16 matmuls on {p}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversubscription_is_named() {
        assert_eq!(oversubscribed(2, 1, 2), None);
        assert_eq!(oversubscribed(1, 2, 2), None);
        let w = oversubscribed(2, 2, 2).unwrap();
        assert!(w.starts_with("warning: 2 ranks × 2 threads per rank exceed this machine's 2 cores"), "{w}");
        assert!(w.ends_with("lower --threads-per-rank)"), "{w}");
        let one = oversubscribed(4, 1, 2).unwrap();
        assert!(one.contains("4 ranks × 1 thread per rank") && !one.contains("--threads-per-rank"), "{one}");
    }

    /// Under mpirun each process saw the oversubscription and printed it: only a host's first
    /// local process does now.
    #[test]
    fn a_hosts_warning_is_printed_by_its_first_process() {
        assert!(first_on_host(None));
        assert!(first_on_host(Some("0")));
        assert!(!first_on_host(Some("1")) && !first_on_host(Some("3")));
    }

    /// Under `mpirun` each of 2 processes on a 2-core host is bound to 1 core: 1 thread each,
    /// and no warning (the host's cores are counted, not the process's); threads of one
    /// process share all the cores.
    #[test]
    fn processes_bound_to_their_cores_are_not_oversubscribed() {
        assert_eq!(default_threads(2, 1, 2), 1);
        assert_eq!(oversubscribed(2, default_threads(2, 1, 2), 2), None);
        assert_eq!(default_threads(1, 16, 16), 16);
        assert_eq!(default_threads(2, 16, 16), 8);
        assert_eq!(default_threads(4, 2, 2), 1);
        assert_eq!(default_threads(2, 4, 16), 4, "no more than the cores this process may use");
    }
}
