//! Claims provisioned per second by the controller without sidecars,
//! against a real kube-apiserver and the run's Ceph: N claims of an rbd
//! StorageClass made at once (default 200), timed from the first claim to
//! the last PV; one claim alone, claim to PV; and the release of all of
//! them, PV released to image gone. The reference, in the same run: the
//! same number of images made one after another by `rbd create`, the
//! storage's own pace on this machine. (The upstream external-provisioner
//! cannot run here; its figures are in docs/provisioning.md.)
//! Needs root and a cluster: `scripts/ceph-env start`, then
//! `VOLAGENT_CEPH_DIR=/var/tmp/volagent-ceph KUBEBUILDER_ASSETS=$(scripts/kube-assets)
//! cargo bench -p volagent --bench provision_rate`; `PROVISION_BENCH_CLAIMS`
//! sets N.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, PersistentVolumeStatus};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::Api;
use std::time::{Duration, Instant};
use volagent_test_support::api_cluster::Cluster;
use volagent_test_support::bench::env_or;
use volagent_test_support::ceph::{ceph_dir, rand_suffix, rbd};
use volagent_test_support::{Deadline, ceph_cluster, wait_until};

const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

fn claim(name: &str) -> PersistentVolumeClaim {
    serde_json::from_value(serde_json::json!({
        "metadata": { "name": name, "namespace": "default" },
        "spec": {
            "storageClassName": "rbd-bench",
            "accessModes": ["ReadWriteOnce"],
            "resources": { "requests": { "storage": "64Mi" } },
        },
    }))
    .expect("a claim")
}

/// PVs this controller provisioned, by name.
fn provisioned(c: &Cluster) -> Vec<PersistentVolume> {
    let pvs: Api<PersistentVolume> = Api::all(c.client());
    let list = c.rt.block_on(pvs.list(&Default::default())).expect("PVs");
    list.items
        .into_iter()
        .filter(|p| p.metadata.name.as_deref().is_some_and(|n| n.starts_with("pvc-")))
        .collect()
}

fn wait(what: &str, secs: u64, done: impl FnMut() -> bool) {
    let deadline = Deadline::within(Duration::from_secs(secs)).polling(Duration::from_millis(20));
    wait_until(deadline, what, done);
}

fn main() {
    let n = env_or("PROVISION_BENCH_CLAIMS", 200);
    let dir = ceph_dir();
    let suffix = rand_suffix() % 1_000_000;

    // The reference: `rbd create`, one image after another.
    let started = Instant::now();
    for i in 0..n {
        rbd(&dir, &["create", "--size", "64M", &format!("rbd/bench-{suffix}-{i}")]);
    }
    let reference = n as f64 / started.elapsed().as_secs_f64();
    for i in 0..n {
        rbd(&dir, &["rm", "--no-progress", &format!("rbd/bench-{suffix}-{i}")]);
    }

    let mut c = Cluster::start(VOLAGENT, &[], &[(volagent_test_artifacts::RBD, "rbd")]);
    ceph_cluster::provisioning(&mut c);
    let class: StorageClass = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "rbd-bench" },
        "provisioner": "rbd.csi.volagent.io",
        "parameters": { "storageCluster": "ceph" },
        "reclaimPolicy": "Delete",
    }))
    .expect("a class");
    c.rt.block_on(Api::<StorageClass>::all(c.client()).create(&Default::default(), &class))
        .expect("the class");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(c.client(), "default");

    // One claim alone.
    let started = Instant::now();
    c.rt.block_on(claims.create(&Default::default(), &claim("one"))).expect("a claim");
    wait("the one claim's PV", 60, || provisioned(&c).len() == 1);
    let one = started.elapsed();

    // N at once.
    let started = Instant::now();
    c.rt.block_on(async {
        let made = futures_util::future::join_all((0..n).map(|i| {
            let claims = claims.clone();
            async move { claims.create(&Default::default(), &claim(&format!("c{i}"))).await }
        }))
        .await;
        for m in made {
            m.expect("a claim");
        }
    });
    let posted = started.elapsed();
    wait("every claim's PV", 1800, || provisioned(&c).len() == n as usize + 1);
    let all = started.elapsed();
    let rate = n as f64 / all.as_secs_f64();

    // Every PV released (what the PV controller does when claims go):
    // timed to the last image removed.
    let pvs: Api<PersistentVolume> = Api::all(c.client());
    let started = Instant::now();
    for mut pv in provisioned(&c) {
        pv.status =
            Some(PersistentVolumeStatus { phase: Some("Released".into()), ..Default::default() });
        let name = pv.metadata.name.clone().expect("a name");
        c.rt.block_on(pvs.replace_status(&name, &Default::default(), &pv)).expect("released");
    }
    let images = || {
        let out = rbd(&dir, &["ls", "rbd"]);
        String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with("pvc-")).count()
    };
    wait("every image removed", 1800, || images() == 0);
    let removed = n as f64 / started.elapsed().as_secs_f64();

    println!(
        "provision_rate: {n} claims at once, controller without sidecars, real kube-apiserver and Ceph"
    );
    println!("  one claim, claim to PV:      {:>8.0} ms", one.as_secs_f64() * 1e3);
    println!("  {n} claims posted in:         {:>8.2} s", posted.as_secs_f64());
    println!(
        "  {n} claims to {n} PVs:          {:>8.2} s  = {rate:.1} claims/s",
        all.as_secs_f64()
    );
    println!(
        "  reference, rbd create serial: {reference:>8.1} images/s  (ratio {:.2})",
        rate / reference
    );
    println!("  release, PV to image removed: {removed:>8.1} volumes/s");
}
