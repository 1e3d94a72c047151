//! Intra-op threads (docs/ARCHITECTURE.md "Runtime" → Threads; issue 11 item 2): each rank runs
//! its kernels on its own fixed-size rayon pool ([`rank_pool`]), so ranks that are threads of one
//! process never share — or fight over — one pool. gemm's matmuls (candle passes it
//! `Parallelism::Rayon(RAYON_NUM_THREADS)`) and the compiled executor's fused kernels
//! ([`crate::fusion`]) split their work over the pool they run in. candle's own barrier pool
//! (`CANDLE_NUM_THREADS`), whose workers spin between operations, is left at one thread: a
//! spinning worker held the second core and made gemm's two-thread matmuls no faster than one
//! (measured: 128×256 · 256×688 after an elementwise op, 1.28 ms with the barrier pool at 2
//! threads vs 0.69 ms at 1; 1.24 ms single-threaded).

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
