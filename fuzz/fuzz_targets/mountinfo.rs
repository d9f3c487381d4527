//! /proc/self/mountinfo: its mount points and sources come from whoever
//! mounted (a pod's FUSE mount, a path with odd bytes).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    if let Ok(mounts) = volagent::sys::mountinfo::parse(s) {
        for m in &mounts {
            let _ = m.read_only();
        }
    }
});
