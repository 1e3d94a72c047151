//! Intra-op threads (docs/ARCHITECTURE.md "Runtime" → Threads): each rank runs
//! its kernels on its own fixed-size rayon pool ([`rank_pool`]), so ranks that are threads of one
//! process never share — or fight over — one pool. gemm's matmuls (candle passes it
//! `Parallelism::Rayon(RAYON_NUM_THREADS)`) and the compiled executor's fused kernels
//! ([`crate::exec::fusion`]) split their work over the pool they run in. candle's own barrier pool
//! (`CANDLE_NUM_THREADS`), whose workers spin between operations, is left at one thread: a
//! spinning worker holds a core that gemm's threads need, and gemm's two-thread matmuls then run
//! no faster than single-threaded ones (measured: docs/PERFORMANCE.md, "Thread pools").
//!
//! A rank's work (a step, an evaluation) runs through [`install_hot`]: while it runs, the pool's
//! other workers poll for work instead of sleeping. A stage runs thousands of operations a step,
//! each split into a few parallel parts; a sleeping rayon worker must be woken for every one,
//! and waking an idle vCPU goes through the hypervisor, so on a virtual machine the wake-ups can
//! cost more than the second thread gains (measured: docs/PERFORMANCE.md, "Thread pools").
//! OpenMP runtimes spin the same way between parallel regions (`OMP_WAIT_POLICY`,
//! `GOMP_SPINCOUNT`).

use rayon::{ThreadPool, Yield};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The intra-op threads per rank in effect: what candle asks gemm for — `RAYON_NUM_THREADS`
/// when set to a positive number (the CLI's `--threads-per-rank` sets it, and
/// `CANDLE_NUM_THREADS` to 1), else the physical cores. A library caller running several
/// ranks in one process sets both variables as the CLI does (`graphpp::cmd::set_op_threads`);
/// otherwise every rank's pool has all the cores.
pub fn op_threads() -> usize {
    candle_core::utils::get_num_threads()
}

/// A rank's pool of `threads` workers (at least 1), named `graphpp-rank{rank}-op{i}`.
///
/// # Errors
/// rayon's, when the OS refuses a thread.
pub fn rank_pool(rank: usize, threads: usize) -> Result<rayon::ThreadPool, rayon::ThreadPoolBuildError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(move |i| format!("graphpp-rank{rank}-op{i}"))
        .build()
}

/// The cores this host has online (`sysconf(_SC_NPROCESSORS_ONLN)`), whatever this process is
/// bound to — under `mpirun`, which binds each process to its own cores, more than
/// [`std::thread::available_parallelism`] sees; at least 1.
pub fn host_cores() -> usize {
    // SAFETY: sysconf reads a system constant; it has no preconditions.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let own = std::thread::available_parallelism().map_or(1, |n| n.get());
    usize::try_from(online).ok().filter(|&n| n > 0).unwrap_or(own).max(own)
}

/// The ranks this host runs in all, every process's (see [`set_host_ranks`]).
static HOST_RANKS: AtomicUsize = AtomicUsize::new(1);

/// Declares how many ranks run on this host in all — under `mpirun`, every local process's —
/// so that [`may_spin`] counts the pools of the other processes too (the CLI's
/// `set_op_threads` calls it). Without a call, a process counts only its own pools.
pub fn set_host_ranks(ranks: usize) {
    HOST_RANKS.store(ranks.max(1), Ordering::Relaxed);
}

/// Whether `pools` pools of `threads` workers each (or as many pools as [`set_host_ranks`]
/// declared, if more) fit this machine's cores, so that their workers may poll for work
/// ([`install_hot`]) without taking a core another pool needs.
pub fn may_spin(pools: usize, threads: usize) -> bool {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    pools.max(HOST_RANKS.load(Ordering::Relaxed)).saturating_mul(threads) <= cores
}

/// Runs `f` in `pool` as [`ThreadPool::install`] does; with `spin` and a pool of two or more
/// workers, the workers other than the one running `f` poll the pool for work (and run what
/// they find) until `f` returns or unwinds, instead of sleeping between the parallel parts of
/// its operations (see the module doc). Each such worker keeps its core busy meanwhile (offering
/// it to the OS every few polls): pass `spin` only when the pool's threads have cores of their
/// own ([`may_spin`]). Not re-entrant from a job of the same pool: a nested call's scope waits
/// for its copy of the pollers on `f`'s worker.
pub fn install_hot<R: Send>(pool: &ThreadPool, spin: bool, f: impl FnOnce() -> R + Send) -> R {
    if !spin || pool.current_num_threads() < 2 {
        return pool.install(f);
    }
    pool.install(|| {
        let done = AtomicBool::new(false);
        let me = rayon::current_thread_index();
        rayon::scope(|s| {
            // One poller per other worker (broadcast jobs go to each worker's own queue); the
            // copy that reaches the worker running `f` returns at once.
            s.spawn_broadcast(|_, ctx| {
                if Some(ctx.index()) != me {
                    poll(&done);
                }
            });
            // Set on return and on unwind alike, so the scope never waits on a poller forever.
            let _stop = Stop(&done);
            f()
        })
    })
}

/// Runs the pool's pending jobs until `done` is set. Every [`IDLE_SPINS`] idle polls it offers
/// its core to the OS (`sched_yield`): at once back when nothing else is runnable, and no core
/// held from another thread when something is (concurrent tests, a busy host).
fn poll(done: &AtomicBool) {
    let mut idle = 0u32;
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(Yield::Executed) {
            idle = 0;
        } else if idle == IDLE_SPINS {
            std::thread::yield_now();
            idle = 0;
        } else {
            std::hint::spin_loop();
            idle += 1;
        }
    }
}

/// Idle polls between two offers of the core.
const IDLE_SPINS: u32 = 64;

/// Sets its flag when dropped.
struct Stop<'a>(&'a AtomicBool);

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::sync::atomic::AtomicUsize;

    /// The pollers run the pool's jobs: with two workers, a job `f` pushes while it waits is
    /// taken by the other worker (a poller that ran nothing would leave `f` waiting forever on
    /// the flag only that job sets; the wait is bounded so a failure reports instead of hanging).
    #[test]
    fn pollers_take_the_jobs_f_pushes() {
        let pool = rank_pool(0, 2).unwrap();
        let ran_on = AtomicUsize::new(usize::MAX);
        let seen = install_hot(&pool, true, || {
            let me = rayon::current_thread_index();
            let set = AtomicBool::new(false);
            rayon::scope(|s| {
                s.spawn(|_| {
                    ran_on.store(rayon::current_thread_index().unwrap_or(usize::MAX), Ordering::SeqCst);
                    set.store(true, Ordering::SeqCst);
                });
                let t0 = std::time::Instant::now();
                while !set.load(Ordering::SeqCst) && t0.elapsed() < std::time::Duration::from_secs(10) {
                    std::hint::spin_loop();
                }
                set.load(Ordering::SeqCst).then_some(me)
            })
        });
        let me = seen.expect("the spawned job ran while f waited");
        assert_ne!(Some(ran_on.load(Ordering::SeqCst)), me, "run by the other worker");
    }

    /// A panic in `f` reaches the caller (the pollers stop; the scope does not wait forever).
    #[test]
    fn a_panic_in_f_reaches_the_caller() {
        let pool = rank_pool(0, 2).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            install_hot(&pool, true, || -> usize { panic!("rank failed") })
        }));
        assert!(r.is_err());
        // The pool still works afterwards.
        assert_eq!(install_hot(&pool, true, || (1..=10).into_par_iter().sum::<i32>()), 55);
    }
}
