//! kubelet's `mount` options JSON, as a pod's author may shape it (inline
//! volumes), parsed against a valid mount dir.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;
use std::path::PathBuf;
use volagent::ops::request::MountDir;
use volagent::socket::flex_request::parse_mount;

fuzz_target!(|data: &[u8]| {
    let Ok(options) = serde_json::from_slice::<BTreeMap<String, String>>(data) else { return };
    let dir = MountDir {
        dir: PathBuf::from("/var/lib/kubelet/pods/uid-a/volumes/volagent~local-pv/pv-local-1"),
        pod_uid: "uid-a".into(),
        name: "pv-local-1".into(),
    };
    if let Ok(req) = parse_mount("node-a", "local-pv", &dir, &options) {
        // What the request promises about itself.
        assert_eq!(req.volume.name, dir.name);
        assert_eq!(req.consumer.pod_uid, dir.pod_uid);
        assert!(req.volume.options.iter().all(|kv| !kv.key.starts_with("kubernetes.io/")));
    }
});
