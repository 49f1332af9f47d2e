//! Giving freed heap memory back to the kernel.
//!
//! Listing thousands of objects from the API (at start, and on each relist)
//! allocates their full form briefly; glibc keeps the freed pages in its
//! per-thread arenas, so the agent's resident size would stay at that peak
//! instead of what its caches hold. Called after such work, not on a
//! request path.

/// Returns the free pages of every malloc arena to the kernel. Takes a
/// millisecond or so; no effect where the C library is not glibc.
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}
