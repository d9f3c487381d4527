//! The mount dir kubelet passes to the driver.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;
use volagent::socket::flex_request::parse_mount_dir;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    if let Ok(dir) = parse_mount_dir(&[Path::new("/var/lib/kubelet")], "local-pv", s) {
        // An accepted dir stays beneath kubelet's root, with no way out.
        assert!(dir.dir.starts_with("/var/lib/kubelet/pods"));
        assert!(
            dir.dir.components().all(|c| matches!(
                c,
                std::path::Component::RootDir | std::path::Component::Normal(_)
            ))
        );
    }
});
