//! The C allocator's settings for a training process (issue 11: a stage's step allocates and
//! frees the same tensor sizes every microbatch).
//!
//! glibc's `malloc` serves a block of 128 KiB or more (its threshold grows with the blocks freed,
//! up to 32 MiB) with a fresh `mmap`, and gives the top of a heap back to the OS once 128 KiB of
//! it is free. Either way the next step's tensors land on pages the kernel must fault in and
//! zero again: on a 2-vCPU KVM guest, `perf` of `small`'s fw + full_bw (one stage, B = 2,
//! T = 64) put ≈ 5% of the time in page faults; with the settings below, 30 runs of it at one
//! thread (`examples/opprof --runs 30`, two alternating pairs) took 69.0 / 72.2 ms a run against
//! 75.8 / 75.9 without, with 22k page faults against 56k / 100k (`perf stat`). A
//! caching allocator (PyTorch's on GPUs) keeps freed memory for the same reason.

/// Keeps freed memory in the process for reuse: blocks under 32 MiB come from the heap instead
/// of fresh mappings, and a heap's free top is never trimmed. The top pad matters for the
/// heaps of threads other than the main one (a rank's pool threads): glibc shrinks those down
/// to the pad whatever the trim threshold, and with the default pad (128 KiB) `small`'s fwbw
/// at one thread (`opprof --model small --runs 20`) ran at 62–63 ms with ≈ 120k page faults in
/// about half the processes against 54–56 ms and 32k in the others; with a 16 or 64 MiB pad
/// every process ran at 53–57 ms with 27.6k faults (the pad is address space: pages never
/// touched cost no memory). The resident size then stays at
/// its high-water mark: a training step's peak, which every step reaches again — per malloc
/// arena, and glibc gives threads arenas of their own, so with several rank threads the sum of
/// their peaks at most. Call once at start-up, before the first tensor is allocated; a no-op
/// where the C library is not glibc.
pub fn retain_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only changes the allocator's parameters; glibc serialises it with
        // allocations, and the values are in the ranges its documentation allows (the mmap
        // threshold at most 32 MiB on 64-bit).
        let set = unsafe {
            [
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20),
                libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX),
                libc::mallopt(libc::M_TOP_PAD, 64 << 20),
            ]
        };
        debug_assert_eq!(set, [1, 1, 1], "glibc took the three settings");
    }
}
