//! glibc allocator settings for the long-running cluster processes (coordinator, aggregator,
//! worker, edge).
//!
//! A node receives and sends layer messages of up to a few MB many times a second. With
//! glibc's defaults a freed block of that size raises the mmap threshold, so later ones come
//! from the heap arenas (one per thread that allocates, up to 8 per core) and the freed space
//! stays resident. Fixed settings keep large blocks in their own mappings, returned on free,
//! and two arenas: measured on the 3-edge example (`cluster examples/cluster-lossy.toml`, two
//! runs each, this machine), peak RSS fell from 145–148 to 120–121 MB on the 2-worker node
//! and from 119–125 to 108 MB on the clean-link edge (`docs/cluster.md`). Someone who set any
//! `MALLOC_*` variable keeps their own settings.

/// Two arenas, blocks of 256 KiB and more in their own mappings, trim above 1 MiB free.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn tune_for_a_long_running_node() {
    if std::env::vars_os().any(|(k, _)| k.to_string_lossy().starts_with("MALLOC_")) {
        return;
    }
    // SAFETY: mallopt only changes allocator parameters; called before other threads start.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1024 * 1024);
    }
}

/// Other platforms keep their allocator's defaults.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn tune_for_a_long_running_node() {}
