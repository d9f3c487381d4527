//! Calling the installed Flexvolume driver as kubelet does, and checking
//! its one-JSON-object answers.

use serde_json::Value;
use std::process::Command;

pub fn run_driver(cmd: &mut Command) -> (i32, Value) {
    let out = cmd.output().expect("run the driver");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.stderr.is_empty(),
        "the driver wrote to stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(stdout.trim_end())
        .unwrap_or_else(|e| panic!("not one JSON object ({e}): {stdout:?}"));
    assert!(v.is_object() && stdout.trim_end().lines().count() == 1, "{stdout:?}");
    (out.status.code().unwrap_or(-1), v)
}

/// kubelet's options for an rbd PV of `image` (pool `rbd`, the run's Ceph
/// at 127.0.0.1:6789, user volagent) with `secret` (the Ceph key as the
/// Secret holds it; kubelet sends base64 of it) under key "key".
pub fn rbd_options(
    volume: &str,
    pod: &str,
    uid: &str,
    image: &str,
    secret: Option<&str>,
    mode: &str,
) -> Value {
    use base64::Engine;
    let mut o = kubelet_options(volume, pod, uid, "ext4", "");
    let m = o.as_object_mut().expect("kubelet_options is an object");
    m.remove("path");
    m.insert("monitors".into(), "127.0.0.1:6789".into());
    m.insert("pool".into(), "rbd".into());
    m.insert("image".into(), image.into());
    m.insert("user".into(), "volagent".into());
    m.insert("accessMode".into(), mode.into());
    if let Some(secret) = secret {
        m.insert(
            "kubernetes.io/secret/key".into(),
            base64::engine::general_purpose::STANDARD.encode(secret).into(),
        );
    }
    o
}

/// The options JSON kubelet sends for a PV-backed flexVolume.
pub fn kubelet_options(volume: &str, pod: &str, pod_uid: &str, fs: &str, path: &str) -> Value {
    serde_json::json!({
        "kubernetes.io/fsType": fs,
        "kubernetes.io/readwrite": "rw",
        "kubernetes.io/pvOrVolumeName": volume,
        "kubernetes.io/pod.name": pod,
        "kubernetes.io/pod.namespace": "default",
        "kubernetes.io/pod.uid": pod_uid,
        "kubernetes.io/serviceAccount.name": "default",
        "path": path,
        "node": "node-a",
    })
}

pub fn assert_success(r: &(i32, Value)) {
    assert_eq!((r.0, r.1["status"].as_str()), (0, Some("Success")), "{}", r.1);
}

pub fn assert_failure(r: &(i32, Value), contains: &str) {
    assert_eq!((r.0, r.1["status"].as_str()), (1, Some("Failure")), "{}", r.1);
    let msg = r.1["message"].as_str().unwrap_or_default();
    assert!(msg.contains(contains), "{msg:?} does not say {contains:?}");
}
