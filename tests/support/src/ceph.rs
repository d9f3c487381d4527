//! The single-node Ceph of a test run (scripts/ceph-env starts it and
//! scripts/test exports VOLAGENT_CEPH_DIR): its dir, the `rbd` tool on it,
//! images removed on drop, and the test user's key.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The test cluster's dir (ceph.conf, keyrings), from the environment.
pub fn ceph_dir() -> PathBuf {
    let dir = PathBuf::from(std::env::var("VOLAGENT_CEPH_DIR").expect(
        "VOLAGENT_CEPH_DIR: the single-node Ceph of this run (scripts/ceph-env start makes it; scripts/test sets it)",
    ));
    assert!(dir.join("ready").exists(), "no Ceph ready in {}", dir.display());
    dir
}

pub fn rbd(dir: &Path, args: &[&str]) -> Output {
    let out = Command::new("rbd")
        .arg("-c")
        .arg(dir.join("ceph.conf"))
        .args(args)
        .output()
        .expect("rbd (ceph-common)");
    assert!(out.status.success(), "rbd {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// An image of `mib` MiB in pool `rbd`, removed on drop.
pub struct Image {
    pub dir: PathBuf,
    pub name: String,
}

impl Image {
    pub fn create(dir: &Path, mib: u64) -> Image {
        let name = format!("test-{}-{}", std::process::id(), rand_suffix());
        rbd(dir, &["create", "--size", &format!("{mib}M"), &format!("rbd/{name}")]);
        Image { dir: dir.to_path_buf(), name }
    }

    pub fn spec(&self) -> String {
        format!("rbd/{}", self.name)
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = Command::new("rbd")
            .arg("-c")
            .arg(self.dir.join("ceph.conf"))
            .args(["rm", "--no-progress", &self.spec()])
            .output();
    }
}

pub fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u8(0);
    h.finish()
}

/// The key of client.volagent, a node's user (mon 'allow r', osd 'profile
/// rbd pool=rbd': it may not blocklist).
pub fn volagent_key(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("volagent.key")).unwrap().trim().to_string()
}

/// The key of client.volagent-controller, the controller's user (also
/// mon 'allow command "osd blocklist"').
pub fn controller_key(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("volagent-controller.key")).unwrap().trim().to_string()
}

/// The clients watching `image` ("client.<id>" each).
pub fn watchers(image: &Image) -> Vec<String> {
    let out = rbd(&image.dir, &["status", "--format", "json", &image.spec()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["watchers"].as_array().unwrap().iter().map(|w| format!("client.{}", w["client"])).collect()
}

/// The addresses of the clients holding a lock on `image`.
pub fn lockers(image: &Image) -> Vec<String> {
    let out = rbd(&image.dir, &["lock", "ls", "--format", "json", &image.spec()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["address"].as_str().map(String::from))
        .collect()
}
