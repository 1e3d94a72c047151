//! The allocators of a training process: a stage's step allocates and frees the same tensor
//! sizes every microbatch.
//!
//! graphpp's binaries allocate from mimalloc ([`MiMalloc`]: each declares it the global
//! allocator). mimalloc puts a freed block on the free list of its size class and hands it out
//! again while it is still in cache; glibc's best fit often returns a cold block. mimalloc gives
//! freed memory back to the OS after 1 s by default (10 s for whole arenas), and the next step
//! then faults the same pages in again, so [`retain_freed_memory`] turns that purging off.
//!
//! glibc's `malloc` still serves the C libraries (Open MPI) and any binary that keeps the system
//! allocator. It serves a block of 128 KiB or more (its threshold grows with the blocks freed, up
//! to 32 MiB) with a fresh `mmap`, and gives the top of a heap back to the OS once 128 KiB of it
//! is free. Either way the next step's tensors land on pages the kernel must fault in and zero
//! again; `retain_freed_memory` also sets glibc to keep those pages. A caching allocator
//! (PyTorch's on GPUs) keeps freed memory for the same reason. (measured: docs/PERFORMANCE.md,
//! "Allocators")

pub use mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (its `mimalloc.h`, v3: the 16th option; the Rust bindings
/// name no constant for it): milliseconds before freed memory goes back to the OS, −1 never.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps freed memory in the process for reuse: blocks under 32 MiB come from the heap instead
/// of fresh mappings, and a heap's free top is never trimmed. The top pad matters for the
/// heaps of threads other than the main one (a rank's pool threads): glibc shrinks those down
/// to the pad whatever the trim threshold, so with the default pad (128 KiB) a pool thread's
/// freed pages go back to the OS and its next tensors fault them in again; a 64 MiB pad keeps
/// them (the pad is address space: pages never touched cost no memory). The resident size then
/// stays at its high-water mark: a training step's peak, which every step reaches again — per
/// malloc arena, and glibc gives threads arenas of their own, so with several rank threads the
/// sum of their peaks at most. Call once at start-up, before the first tensor is allocated (the
/// glibc settings are skipped where the C library is not glibc). Turns mimalloc's purging off
/// too (module doc): the same high-water mark, kept.
/// (measured: docs/PERFORMANCE.md, "Allocators")
pub fn retain_freed_memory() {
    // SAFETY: `mi_option_set` only stores the option's value (mimalloc reads it when it next
    // considers purging); −1 is its documented "never".
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The option index is mimalloc's purge delay: its default (1000 ms in v3's `options.c`; no
    /// other option defaults to 1000) until set, then −1 (the option is global to the test
    /// process: another test may have set it first).
    #[test]
    fn the_purge_delay_option_is_the_one_set() {
        // SAFETY: reading and storing an option value.
        let before = unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        let from_env = std::env::var_os("MIMALLOC_PURGE_DELAY").is_some();
        assert!(
            from_env || before == 1000 || before == -1,
            "option {MI_OPTION_PURGE_DELAY} read {before}: not the purge delay"
        );
        retain_freed_memory();
        // SAFETY: as above.
        assert_eq!(unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) }, -1);
    }
}
