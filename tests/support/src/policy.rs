//! Policy-level fixtures: a runtime with the tests' limits, plugins loaded
//! from a path, and the volumes, consumers and node paths a call is about.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use volagent::policy::*;

pub fn runtime(deadline_ms: u64) -> Arc<Runtime> {
    Runtime::new(Limits {
        deadline: Duration::from_millis(deadline_ms),
        memory_bytes: 32 << 20,
        ..Default::default()
    })
    .expect("runtime")
}

pub fn load(runtime: &Arc<Runtime>, path: &str) -> Plugin {
    Plugin::load_file(runtime, Path::new(path)).unwrap_or_else(|e| panic!("{e}"))
}

pub fn volume(name: &str, backend: &str) -> Volume {
    Volume {
        name: name.into(),
        backend: backend.into(),
        access_mode: AccessMode::ReadWriteOnce,
        fs_type: String::new(),
        mode: volagent::policy::VolumeMode::Filesystem,
        mount_flags: Vec::new(),
        options: vec![],
        secret_keys: vec![],
    }
}

pub fn consumer(node: &str, pod: &str, backend: &str, volume: &str) -> Consumer {
    Consumer {
        node: node.into(),
        pod_namespace: "default".into(),
        pod: pod.into(),
        pod_uid: format!("uid-{pod}"),
        mount_dir: format!("/var/lib/kubelet/pods/uid-{pod}/volumes/volagent~{backend}/{volume}"),
        read_only: false,
        mount_group: None,
    }
}

pub fn holder(c: &Consumer) -> Holder {
    Holder { consumer: c.clone(), since: "2026-11-01T10:00:00Z".into() }
}

pub fn paths(backend: &str, volume: &str) -> NodePaths {
    NodePaths {
        kubelet_root: "/var/lib/kubelet".into(),
        staging_dir: format!("/var/lib/kubelet/plugins/volagent/{backend}/mounts/{volume}"),
        state_dir: format!("/var/lib/volagent/volumes/{volume}"),
        discovery_dirs: vec!["/mnt/disks".into()],
    }
}

pub fn facts() -> Arc<RecordedQueries> {
    Arc::new(RecordedQueries::default())
}

/// `bytes` with a custom section (id 0) named `name` appended: still a
/// valid component, with another sha256.
pub fn with_custom_section(bytes: &[u8], name: &str) -> Vec<u8> {
    let mut payload = Vec::new();
    leb128(&mut payload, name.len() as u64);
    payload.extend_from_slice(name.as_bytes());
    let mut out = bytes.to_vec();
    out.push(0);
    leb128(&mut out, payload.len() as u64);
    out.extend_from_slice(&payload);
    out
}

fn leb128(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}
