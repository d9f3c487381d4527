//! The agent's resident memory. It runs on every node of every cluster, so
//! what it keeps after a burst (the policies compiled at start-up or on a
//! reload, a hundred mounts at once) is paid on every node for as long as
//! it idles.
//!
//! Two things kept memory resident after a burst: mimalloc's arenas, whose
//! freed pages are purged only on a later allocator call (an idle agent
//! makes none), and the compiler's code in the binary's text, touched once
//! by each compile and mapped from then on.
#![allow(unsafe_code)]

use libmimalloc_sys as mi;

/// mimalloc's options as the agent wants them, each as (the names of its
/// environment variable, current and legacy, as mimalloc reads them; its
/// number in mimalloc.h's `mi_option_e` of the v3 line this crate builds;
/// the value).
const OPTIONS: [(&[&[u8]], mi::mi_option_t, std::ffi::c_long); 3] = [
    // Arenas committed as they are used rather than all at once: freed
    // pages of an arena committed eagerly stayed resident (an idle agent
    // held 67 MB more after its start-up compile).
    (&[b"MIMALLOC_ARENA_EAGER_COMMIT", b"MIMALLOC_EAGER_REGION_COMMIT"], 4, 0),
    (&[b"MIMALLOC_PURGE_DECOMMITS", b"MIMALLOC_RESET_DECOMMITS"], 5, 1),
    // Freed pages purged at once rather than at a next call that an idle
    // agent never makes.
    (&[b"MIMALLOC_PURGE_DELAY", b"MIMALLOC_RESET_DELAY"], 15, 0),
];

/// Set the allocator's options, each unless its variable is set (so that
/// an admin, or a bench comparing settings, can still choose). Called from
/// a constructor of the binary, before its first allocation: that
/// allocation reserves the first arena, under the options set by then.
/// So it allocates nothing itself. It reads the environment as the C
/// library keeps it, without a lock: while it runs, no thread may set a
/// variable (none does in a constructor, nor in the agent at all).
pub fn configure_allocator() {
    for (names, option, value) in OPTIONS {
        if !names.iter().any(|name| in_environment(name)) {
            // SAFETY: sets a plain integer option; mimalloc reads options
            // with relaxed atomics, so setting one at run time is allowed.
            unsafe { mi::mi_option_set(option, value) };
        }
    }
}

/// Whether `name` is set, in any case: mimalloc reads its variables so.
fn in_environment(name: &[u8]) -> bool {
    // SAFETY: environ is a NULL-terminated array of NUL-terminated strings,
    // which nothing writes while the process's constructors run (nor
    // later: the agent never sets a variable of its own).
    unsafe {
        // Read by value: the C library may replace the array (setenv).
        let mut entry = nix::libc::environ.cast_const();
        while !entry.is_null() && !(*entry).is_null() {
            if names_variable(std::ffi::CStr::from_ptr(*entry).to_bytes(), name) {
                return true;
            }
            entry = entry.add(1);
        }
    }
    false
}

/// Whether the environment entry `entry` ("NAME=value") sets `name`,
/// compared without regard to case.
fn names_variable(entry: &[u8], name: &[u8]) -> bool {
    entry.len() > name.len()
        && entry[name.len()] == b'='
        && entry[..name.len()].eq_ignore_ascii_case(name)
}

/// After a compile: give back what the compiler left resident. The
/// allocator's freed pages are purged now, and the binary's code pages
/// are dropped from this process's mappings; they stay in the page cache,
/// and those the agent runs fault back in on their next use (a minor
/// fault each), while the compiler's, touched only by compiles, stay out
/// until the next one.
pub fn release_after_compile() {
    // SAFETY: mi_collect takes no pointer; forcing it purges every arena.
    unsafe { mi::mi_collect(true) };
    if let Err(e) = drop_code_pages() {
        tracing::debug!("the binary's code pages stay mapped: {e}");
    }
}

/// Drop the resident pages of the executable's own text mappings.
fn drop_code_pages() -> std::io::Result<()> {
    let exe = std::fs::read_link("/proc/self/exe")?;
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    for (start, end) in code_ranges(&smaps, &exe) {
        // SAFETY: the range is a private, read-only, executable mapping of
        // the binary's file: MADV_DONTNEED only unmaps its pages, which
        // the next access reads back from the file's page cache unchanged.
        let rc = unsafe {
            nix::libc::madvise(
                start as *mut nix::libc::c_void,
                end - start,
                nix::libc::MADV_DONTNEED,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The ranges of /proc/self/smaps that map `exe` private, read and
/// execute, never write, and hold no page of their own: a page copied on
/// write is a breakpoint or a uprobe someone put there, which dropping
/// would silently take away.
fn code_ranges(smaps: &str, exe: &std::path::Path) -> Vec<(usize, usize)> {
    let exe = exe.to_string_lossy();
    let mut ranges = Vec::new();
    // The mapping being read, while it is one of the binary's code.
    let mut current: Option<(usize, usize)> = None;
    for line in smaps.lines() {
        if let Some(kib) = line.strip_prefix("Anonymous:") {
            if let Some(range) = current.take()
                && kib.trim().strip_suffix("kB").is_some_and(|k| k.trim() == "0")
            {
                ranges.push(range);
            }
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else { continue };
        let Some((start, end)) = range.split_once('-') else { continue };
        let (Ok(start), Ok(end)) =
            (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16))
        else {
            continue;
        };
        // A mapping's first line: whatever was being read ends here.
        current = (perms == "r-xp" && fields.nth(3) == Some(&*exe) && start < end)
            .then_some((start, end));
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variable_is_found_in_any_case() {
        assert!(names_variable(b"MIMALLOC_PURGE_DELAY=10", b"MIMALLOC_PURGE_DELAY"));
        assert!(names_variable(b"mimalloc_purge_delay=10", b"MIMALLOC_PURGE_DELAY"));
        assert!(names_variable(b"MIMALLOC_PURGE_DELAY=", b"MIMALLOC_PURGE_DELAY"));
        assert!(!names_variable(b"MIMALLOC_PURGE_DELAYS=1", b"MIMALLOC_PURGE_DELAY"));
        assert!(!names_variable(b"MIMALLOC_PURGE_DELAY", b"MIMALLOC_PURGE_DELAY"));
        assert!(!names_variable(b"MIMALLOC_PURGE", b"MIMALLOC_PURGE_DELAY"));
        // PATH, if the test runs with one, is found under any case.
        assert_eq!(in_environment(b"path"), std::env::var_os("PATH").is_some());
        assert!(!in_environment(b"VOLAGENT_NO_SUCH_VARIABLE_IS_SET"));
    }

    #[test]
    fn only_the_binarys_code_is_dropped() {
        let smaps = "\
55d0c0000000-55d0c0100000 r--p 00000000 fd:01 12 /usr/bin/volagent
Rss:                 100 kB
Anonymous:             0 kB
55d0c0100000-55d0c2000000 r-xp 00100000 fd:01 12 /usr/bin/volagent
Rss:               13000 kB
Anonymous:             0 kB
55d0c2000000-55d0c2100000 rw-p 02000000 fd:01 12 /usr/bin/volagent
Anonymous:            12 kB
55d0c3000000-55d0c3100000 r-xp 03000000 fd:01 12 /usr/bin/volagent
Rss:                  40 kB
Anonymous:             4 kB
7f0000000000-7f0000100000 r-xp 00000000 fd:01 13 /usr/lib/x86_64-linux-gnu/libc.so.6
Anonymous:             0 kB
7f0000200000-7f0000300000 r-xp 00000000 00:00 0
Anonymous:             0 kB
7f0000400000-7f0000500000 r-xp 00000000 fd:01 14 /usr/bin/volagent-other
Anonymous:             0 kB
";
        // The one with a page of its own (a breakpoint) is left alone.
        assert_eq!(
            code_ranges(smaps, std::path::Path::new("/usr/bin/volagent")),
            [(0x55d0c0100000, 0x55d0c2000000)]
        );
    }

    #[test]
    fn dropping_code_pages_keeps_the_process_running() {
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        assert!(!code_ranges(&smaps, &exe).is_empty(), "this test binary's code is found");
        drop_code_pages().unwrap();
        // Code runs on after its pages were dropped: they fault back in.
        release_after_compile();
        assert_eq!(code_ranges("", std::path::Path::new("/x")), []);
    }
}
