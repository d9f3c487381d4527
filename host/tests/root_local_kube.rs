//! Local volumes end to end against a real etcd + kube-apiserver and
//! kube-controller-manager's PV binder and PV protection: agents of two
//! simulated nodes discover real volumes (a tmpfs mount point, a loop
//! device through a by-id style link, a file image), the controller makes
//! their PVs, and a claim's release has the volume wiped by the local-pv
//! policy and offered again as a new PV. Needs root.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use k8s_openapi::api::core::v1::{Event, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use volagent::kube::crds::{LocalOperationPhase, NodeLocalVolumes};
use volagent_test_support::api_cluster::Cluster;
use volagent_test_support::{Deadline, wait_until_or};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

const LOCAL_PV: (&str, &str) = (volagent_test_artifacts::LOCAL_PV, "local-pv");
const MARKER: &[u8] = b"volagent-marker: the last tenant's data";

/// What this tier's tests ask of the cluster beyond [`Cluster`]'s own.
trait LocalCluster {
    fn local(&self, node: &str) -> Option<NodeLocalVolumes>;
    fn pv(&self, name: &str) -> Option<PersistentVolume>;
    fn local_pvs(&self) -> Vec<PersistentVolume>;
    fn wait_for<T>(&self, what: &str, secs: u64, f: impl FnMut() -> Option<T>) -> T;
    fn storage_class(&self, name: &str, params: &[(&str, &str)]);
    fn local_agent(&mut self, node: &str, class: &str, dir: &Path, env: &[(&str, &str)]);
    fn claim(&self, pv: &str, class: &str) -> String;
    fn release(&self, claim: &str);
    fn comes_back(&self, name: &str, old_uid: &str, secs: u64) -> PersistentVolume;
    fn events_of(&self, pv: &str) -> Vec<String>;
    fn status(&self, node: &str) -> serde_json::Value;
}

impl LocalCluster for Cluster {
    fn local(&self, node: &str) -> Option<NodeLocalVolumes> {
        self.rt.block_on(Api::<NodeLocalVolumes>::all(self.client()).get_opt(node)).unwrap()
    }

    fn pv(&self, name: &str) -> Option<PersistentVolume> {
        self.rt.block_on(Api::<PersistentVolume>::all(self.client()).get_opt(name)).unwrap()
    }

    fn local_pvs(&self) -> Vec<PersistentVolume> {
        let lp = ListParams::default().labels(volagent::kube::local_pvs::NODE_LABEL);
        self.rt.block_on(Api::<PersistentVolume>::all(self.client()).list(&lp)).unwrap().items
    }

    fn wait_for<T>(&self, what: &str, secs: u64, f: impl FnMut() -> Option<T>) -> T {
        let deadline =
            Deadline::within(Duration::from_secs(secs)).polling(Duration::from_millis(200));
        wait_until_or(deadline, what, f, || {
            let pvs: Vec<_> = self
                .local_pvs()
                .iter()
                .map(|p| (p.metadata.name.clone(), p.status.clone().and_then(|s| s.phase)))
                .collect();
            let lists = self
                .rt
                .block_on(Api::<NodeLocalVolumes>::all(self.client()).list(&Default::default()))
                .map(|l| l.items);
            let logs: Vec<String> = ["node-a.log", "node-b.log", "controller.log"]
                .iter()
                .map(|f| std::fs::read_to_string(self.scratch.path(f)).unwrap_or_default())
                .map(|t| {
                    t.lines()
                        .rev()
                        .take(30)
                        .collect::<Vec<_>>()
                        .into_iter()
                        .rev()
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .collect();
            format!(
                "local PVs: {pvs:#?}\nNodeLocalVolumes: {lists:#?}\nlogs (agents, controller):\n{}",
                logs.join("\n----\n")
            )
        })
    }

    fn storage_class(&self, name: &str, params: &[(&str, &str)]) {
        let sc = StorageClass {
            metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
            provisioner: "kubernetes.io/no-provisioner".into(),
            reclaim_policy: Some("Delete".into()),
            volume_binding_mode: Some("Immediate".into()),
            parameters: Some(params.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..Default::default()
        };
        self.rt
            .block_on(Api::<StorageClass>::all(self.client()).create(&PostParams::default(), &sc))
            .unwrap();
    }

    /// The agent of `node`, managing local class `class` in `dir`.
    fn local_agent(&mut self, node: &str, class: &str, dir: &Path, env: &[(&str, &str)]) {
        self.kill_agent(node);
        let spec = format!("{class}={}", dir.display());
        self.spawn_agent_env(node, &["--local-class", &spec, "--local-scan-interval", "1s"], env);
    }

    /// A claim on PV `pv` (pre-bound by name), bound by kube-controller-manager.
    fn claim(&self, pv: &str, class: &str) -> String {
        let name = format!("claim-{pv}");
        let pvc = PersistentVolumeClaim {
            metadata: ObjectMeta { name: Some(name.clone()), ..Default::default() },
            spec: Some(k8s_openapi::api::core::v1::PersistentVolumeClaimSpec {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                storage_class_name: Some(class.into()),
                volume_name: Some(pv.into()),
                resources: Some(k8s_openapi::api::core::v1::VolumeResourceRequirements {
                    requests: Some(
                        [(
                            "storage".to_string(),
                            k8s_openapi::apimachinery::pkg::api::resource::Quantity("1Mi".into()),
                        )]
                        .into(),
                    ),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client(), "default");
        self.rt.block_on(claims.create(&PostParams::default(), &pvc)).unwrap();
        self.wait_for(&format!("PV {pv} Bound"), 60, || {
            (phase(&self.pv(pv)?) == "Bound").then_some(())
        });
        name
    }

    fn release(&self, claim: &str) {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client(), "default");
        self.rt.block_on(claims.delete(claim, &DeleteParams::default())).unwrap();
    }

    /// Waits until PV `name` is gone and back with another UID; the new PV.
    fn comes_back(&self, name: &str, old_uid: &str, secs: u64) -> PersistentVolume {
        self.wait_for(&format!("PV {name} back as a new PV"), secs, || {
            self.pv(name)
                .filter(|p| p.metadata.uid.as_deref() != Some(old_uid) && phase(p) == "Available")
        })
    }

    fn events_of(&self, pv: &str) -> Vec<String> {
        let events: Api<Event> = Api::namespaced(self.client(), "default");
        let list = self.rt.block_on(events.list(&ListParams::default())).unwrap().items;
        list.into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(pv))
            .filter_map(|e| e.reason)
            .collect()
    }

    /// `volagent status --json` of `node`'s agent.
    fn status(&self, node: &str) -> serde_json::Value {
        let socket = self.scratch.path(&format!("{node}/run/agent.sock"));
        let out = Command::new(VOLAGENT)
            .args(["status", "--json", "--socket"])
            .arg(&socket)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

fn phase(pv: &PersistentVolume) -> String {
    pv.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default()
}

fn uid(pv: &PersistentVolume) -> String {
    pv.metadata.uid.clone().unwrap()
}

fn losetup(file: &Path) -> String {
    let out = Command::new("losetup").args(["--find", "--show"]).arg(file).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn write_at(path: &Path, offset: u64, bytes: &[u8]) {
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
}

fn holds_at(path: &Path, offset: u64, bytes: &[u8]) -> bool {
    let mut f = std::fs::File::open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    let mut buf = vec![0u8; bytes.len()];
    f.read_exact(&mut buf).unwrap();
    buf == bytes
}

fn pv_name(node: &str, class: &str, path: &Path) -> String {
    volagent::local::pv_name(node, class, path)
}

/// Three volumes on two nodes become three PVs, each bound to its node;
/// two are claimed, written, released — wiped (their marker gone) and
/// offered again as new PVs; a file outside the discovery dirs with the
/// same marker is never touched.
#[test]
fn discovered_volumes_become_pvs_and_come_back_wiped_after_release() {
    let mut c = Cluster::start(VOLAGENT, &["node-a", "node-b"], &[LOCAL_PV]);
    let _kcm = c.pv_binder();
    c.storage_class("local-fast", &[("wipe", "zero")]);
    let (dir_a, dir_b) = (c.scratch.path("local-a"), c.scratch.path("local-b"));
    std::fs::create_dir_all(&dir_a).unwrap();
    std::fs::create_dir_all(&dir_b).unwrap();
    // node-a: a tmpfs mount point and a file image; node-b: a loop device
    // through a by-id style link.
    let fs1 = dir_a.join("fs1");
    std::fs::create_dir(&fs1).unwrap();
    nix::mount::mount(
        Some("tmpfs"),
        &fs1,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some("size=32m"),
    )
    .unwrap();
    let img = c.scratch.image("local-a/img1.img", 24);
    let raw = c.scratch.image("raw-b.img", 24);
    let dev = losetup(&raw);
    std::os::unix::fs::symlink(&dev, dir_b.join("wwn-0xb")).unwrap();
    let outside = c.scratch.image("outside.img", 4);
    write_at(&outside, 0, MARKER);

    c.local_agent("node-a", "local-fast", &dir_a, &[]);
    c.local_agent("node-b", "local-fast", &dir_b, &[]);
    let (pv_fs, pv_img, pv_blk) = (
        pv_name("node-a", "local-fast", &fs1),
        pv_name("node-a", "local-fast", &img),
        pv_name("node-b", "local-fast", &dir_b.join("wwn-0xb")),
    );
    c.wait_for("3 local PVs", 60, || (c.local_pvs().len() == 3).then_some(()));
    for (pv, node, path) in [
        (&pv_fs, "node-a", fs1.display().to_string()),
        (&pv_img, "node-a", img.display().to_string()),
        (&pv_blk, "node-b", dev.clone()),
    ] {
        let p = c.pv(pv).unwrap_or_else(|| panic!("PV {pv}"));
        let spec = p.spec.clone().unwrap();
        let term = &spec.node_affinity.unwrap().required.unwrap().node_selector_terms[0];
        assert_eq!(
            term.match_expressions.as_ref().unwrap()[0].values,
            Some(vec![node.to_string()]),
            "{pv}"
        );
        let options = spec.flex_volume.unwrap().options.unwrap();
        assert_eq!(
            (options["path"].as_str(), options["node"].as_str()),
            (path.as_str(), node),
            "{pv}"
        );
        assert_eq!(spec.storage_class_name.as_deref(), Some("local-fast"));
        assert_eq!(spec.persistent_volume_reclaim_policy.as_deref(), Some("Delete"));
        assert_eq!(phase(&p), "Available", "{pv}");
    }
    assert_eq!(
        c.pv(&pv_blk).unwrap().spec.unwrap().flex_volume.unwrap().options.unwrap()["identity"],
        format!("loop:{}", raw.display())
    );
    assert_eq!(c.pv(&pv_fs).unwrap().spec.unwrap().capacity.unwrap()["storage"].0, "32Mi");
    let status = c.local("node-a").unwrap().status.unwrap();
    assert_eq!(status.volume_count, 2, "{status:?}");
    let shown = c.status("node-a");
    let names: Vec<&str> = shown["local"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&pv_fs.as_str()) && names.contains(&pv_img.as_str()) && names.len() == 2,
        "{shown:#}"
    );
    assert_eq!(c.local("node-b").unwrap().status.unwrap().volume_count, 1);

    // The tenants write; then their claims go.
    let claim_fs = c.claim(&pv_fs, "local-fast");
    let claim_blk = c.claim(&pv_blk, "local-fast");
    std::fs::create_dir_all(fs1.join("app/data")).unwrap();
    std::fs::write(fs1.join("app/data/marker"), MARKER).unwrap();
    std::os::unix::fs::symlink(&outside, fs1.join("app/link-out")).unwrap();
    write_at(Path::new(&dev), 1 << 20, MARKER);
    let (uid_fs, uid_blk) = (uid(&c.pv(&pv_fs).unwrap()), uid(&c.pv(&pv_blk).unwrap()));
    c.release(&claim_fs);
    c.release(&claim_blk);

    let new_fs = c.comes_back(&pv_fs, &uid_fs, 90);
    let new_blk = c.comes_back(&pv_blk, &uid_blk, 90);
    assert_eq!(std::fs::read_dir(&fs1).unwrap().count(), 0, "the filesystem volume was emptied");
    assert!(!holds_at(Path::new(&dev), 1 << 20, MARKER), "the block volume was zeroed");
    assert!(
        holds_at(&outside, 0, MARKER),
        "a file outside the discovery dirs is never touched (a link to it was removed, not followed)"
    );
    assert!(
        new_fs
            .metadata
            .finalizers
            .unwrap_or_default()
            .contains(&"volagent.io/local-wipe".to_string())
    );
    for pv in [&pv_fs, &pv_blk] {
        let reasons = c.events_of(pv);
        assert!(
            reasons.contains(&"WipeStarted".to_string())
                && reasons.contains(&"WipeComplete".to_string()),
            "{pv}: {reasons:?}"
        );
    }
    assert_eq!(phase(&new_blk), "Available");
    // The operations are done with: the spec is empty again.
    c.wait_for("the operations removed", 30, || {
        c.local("node-a").unwrap().spec.operations.is_empty().then_some(())
    });
    assert_eq!(c.local_pvs().len(), 3, "never two PVs for one volume");
    assert!(
        c.pv(&pv_img).is_some_and(|p| phase(&p) == "Available"),
        "the unclaimed volume is left alone"
    );
}

/// An agent killed mid-wipe starts the wipe again on restart and finishes
/// it (never reporting the cut-short one complete); a wipe that fails ends
/// in Error with the reason, and no PV is made for that volume.
#[test]
fn a_wipe_cut_short_is_started_again_and_a_failed_one_ends_in_error() {
    let mut c = Cluster::start(VOLAGENT, &["node-a"], &[LOCAL_PV]);
    let _kcm = c.pv_binder();
    c.storage_class("local-slow", &[("wipe", "shred:2")]);
    let dir = c.scratch.path("local-a");
    std::fs::create_dir_all(&dir).unwrap();
    let img = c.scratch.image("local-a/slow.img", 48);
    let raw = c.scratch.image("busy.img", 24);
    let dev = losetup(&raw);
    std::os::unix::fs::symlink(&dev, dir.join("wwn-0xbusy")).unwrap();
    // The first plan (the wipe: unmount, attach, shred, detach) stalls
    // after its shred, as a long wipe would run on: the agent is killed then.
    c.local_agent(
        "node-a",
        "local-slow",
        &dir,
        &[(volagent::sys::faults::STALL_AFTER_STEP_ENV, "3:120000")],
    );
    let (pv_img, pv_busy) = (
        pv_name("node-a", "local-slow", &img),
        pv_name("node-a", "local-slow", &dir.join("wwn-0xbusy")),
    );
    c.wait_for("2 local PVs", 60, || (c.local_pvs().len() == 2).then_some(()));

    let claim = c.claim(&pv_img, "local-slow");
    write_at(&img, 8 << 20, MARKER);
    let old = uid(&c.pv(&pv_img).unwrap());
    c.release(&claim);
    c.wait_for("the wipe to start", 60, || {
        let s = c.local("node-a")?.status?;
        s.operations
            .iter()
            .any(|o| o.volume == pv_img && o.phase == LocalOperationPhase::InProgress)
            .then_some(())
    });
    c.wait_for("the wipe's shred", 30, || {
        std::fs::read_to_string(c.scratch.path("node-a.log"))
            .ok()?
            .contains("VOLAGENT_TEST_STALL")
            .then_some(())
    });
    let shown = c.status("node-a");
    let wipe = &shown["local"]["wipes"][0];
    assert_eq!(
        (
            wipe["volume"].as_str(),
            wipe["method"].as_str(),
            wipe["step"].as_u64(),
            wipe["steps"].as_u64()
        ),
        (Some(pv_img.as_str()), Some("shred:2"), Some(3), Some(4)),
        "{shown:#}"
    );
    c.kill_agent("node-a");
    let status = c.local("node-a").unwrap().status.unwrap();
    let op = status.operations.iter().find(|o| o.volume == pv_img).unwrap();
    assert_eq!(
        (op.phase, op.attempt),
        (LocalOperationPhase::InProgress, 1),
        "killed mid-wipe: {status:?}"
    );
    assert!(
        c.pv(&pv_img).is_some_and(|p| uid(&p) == old),
        "the PV stays while its wipe is unfinished"
    );
    c.local_agent("node-a", "local-slow", &dir, &[]);
    c.comes_back(&pv_img, &old, 240);
    assert!(!holds_at(&img, 8 << 20, MARKER), "the marker is gone");
    let log = std::fs::read_to_string(c.scratch.path("node-a.log")).unwrap();
    assert!(log.contains("cut short by an agent restart"), "{log}");

    // A wipe that cannot run: the device is mounted elsewhere.
    let claim = c.claim(&pv_busy, "local-slow");
    assert!(Command::new("mkfs.ext4").args(["-q", &dev]).status().unwrap().success());
    let busy_at = c.scratch.path("busy-mount");
    std::fs::create_dir_all(&busy_at).unwrap();
    nix::mount::mount(
        Some(dev.as_str()),
        &busy_at,
        Some("ext4"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .unwrap();
    c.release(&claim);
    let failed = c.wait_for("the wipe to fail", 60, || {
        let s = c.local("node-a")?.status?;
        s.operations
            .into_iter()
            .find(|o| o.volume == pv_busy && o.phase == LocalOperationPhase::Error)
    });
    let message = failed.message.clone().unwrap_or_default();
    assert!(
        message.contains(&dev) && message.contains("in use"),
        "the reason names the device: {message}"
    );
    assert!(c.events_of(&pv_busy).contains(&"WipeFailed".to_string()));
    std::thread::sleep(Duration::from_secs(3));
    let pv = c.pv(&pv_busy).expect("the released PV stays");
    assert_eq!(phase(&pv), "Released", "no new PV for a volume whose wipe failed");
    assert_eq!(c.local("node-a").unwrap().status.unwrap().failed, 1);
    nix::mount::umount2(&busy_at, nix::mount::MntFlags::MNT_DETACH).unwrap();
}

/// Faults injected at the sys seam into the two steps only a release runs:
/// `wipe` (a device) fails with EIO, `clear-directory` (a mount point) with
/// ENOSPC. Each operation ends in Error naming its step and the fault, the
/// tenant's data is untouched, and no PV is made for either volume. Once
/// the faults are gone and an admin removes the operations (as the docs
/// say), the controller requests the wipes again and both complete — one
/// after hanging in `clear-directory`, shown by `volagent status`, until the
/// hang is lifted.
#[test]
fn faults_at_wipe_and_clear_directory_end_in_error_and_the_admins_retry_succeeds() {
    let mut c = Cluster::start(VOLAGENT, &["node-a"], &[LOCAL_PV]);
    let _kcm = c.pv_binder();
    c.storage_class("local-faulty", &[("wipe", "zero")]);
    let dir = c.scratch.path("local-a");
    let fs1 = dir.join("fs1");
    std::fs::create_dir_all(&fs1).unwrap();
    nix::mount::mount(
        Some("tmpfs"),
        &fs1,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some("size=16m"),
    )
    .unwrap();
    let raw = c.scratch.image("raw-a.img", 16);
    let dev = losetup(&raw);
    std::os::unix::fs::symlink(&dev, dir.join("wwn-0xfault")).unwrap();
    let faults = c.scratch.path("faults");
    std::fs::write(&faults, "wipe EIO\nclear-directory ENOSPC\n").unwrap();
    let faults_env = faults.display().to_string();
    c.local_agent(
        "node-a",
        "local-faulty",
        &dir,
        &[(volagent::sys::faults::FAULTS_FILE_ENV, faults_env.as_str())],
    );
    let (pv_fs, pv_blk) = (
        pv_name("node-a", "local-faulty", &fs1),
        pv_name("node-a", "local-faulty", &dir.join("wwn-0xfault")),
    );
    c.wait_for("2 local PVs", 60, || (c.local_pvs().len() == 2).then_some(()));

    let claims = [c.claim(&pv_fs, "local-faulty"), c.claim(&pv_blk, "local-faulty")];
    std::fs::write(fs1.join("marker"), MARKER).unwrap();
    write_at(Path::new(&dev), 1 << 20, MARKER);
    let (uid_fs, uid_blk) = (uid(&c.pv(&pv_fs).unwrap()), uid(&c.pv(&pv_blk).unwrap()));
    for claim in &claims {
        c.release(claim);
    }
    for (pv, step, errno) in [(&pv_blk, "wipe", "EIO"), (&pv_fs, "clear-directory", "ENOSPC")] {
        let failed = c.wait_for(&format!("the wipe of {pv} to fail"), 60, || {
            let s = c.local("node-a")?.status?;
            s.operations
                .into_iter()
                .find(|o| &o.volume == pv && o.phase == LocalOperationPhase::Error)
        });
        let message = failed.message.unwrap_or_default();
        assert!(
            message.contains(&format!("{step} (injected fault)")) && message.contains(errno),
            "{pv}: the reason names the step and the fault: {message}"
        );
        assert!(c.events_of(pv).contains(&"WipeFailed".to_string()), "{pv}");
    }
    assert!(
        holds_at(Path::new(&dev), 1 << 20, MARKER)
            && std::fs::read(fs1.join("marker")).unwrap() == MARKER,
        "a failed step destroyed nothing"
    );
    std::thread::sleep(Duration::from_secs(3));
    for pv in [&pv_fs, &pv_blk] {
        assert_eq!(
            phase(&c.pv(pv).expect("the released PV stays")),
            "Released",
            "{pv}: no new PV while its wipe failed"
        );
    }
    assert_eq!(c.local("node-a").unwrap().status.unwrap().failed, 2);

    // The faults go but for a hang in clear-directory; the admin asks again.
    std::fs::write(&faults, "clear-directory hang\n").unwrap();
    let api: Api<NodeLocalVolumes> = Api::all(c.client());
    let patch = serde_json::json!({ "spec": { "operations": [] } });
    c.rt.block_on(api.patch(
        "node-a",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&patch),
    ))
    .unwrap();
    c.comes_back(&pv_blk, &uid_blk, 90);
    assert!(
        !holds_at(Path::new(&dev), 1 << 20, MARKER),
        "the block volume was zeroed on the retry"
    );
    let hung = c.wait_for("the retried wipe to hang in clear-directory", 60, || {
        let shown = c.status("node-a");
        let wipe = shown["local"]["wipes"]
            .as_array()?
            .iter()
            .find(|w| w["volume"].as_str() == Some(pv_fs.as_str()))?
            .clone();
        (wipe["step_kind"].as_str() == Some("clear-directory")).then_some(wipe)
    });
    assert_eq!(hung["method"].as_str(), Some("clear-directory"), "{hung:#}");
    assert!(c.pv(&pv_fs).is_some_and(|p| uid(&p) == uid_fs), "the PV stays while its wipe hangs");
    std::fs::remove_file(&faults).unwrap();
    c.comes_back(&pv_fs, &uid_fs, 90);
    assert_eq!(
        std::fs::read_dir(&fs1).unwrap().count(),
        0,
        "the filesystem volume was emptied on the retry"
    );
    c.wait_for("the operations removed", 30, || {
        c.local("node-a").unwrap().spec.operations.is_empty().then_some(())
    });
    let status = c.local("node-a").unwrap().status.unwrap();
    assert_eq!((status.failed, status.wiping), (0, 0), "{status:?}");
    assert_eq!(c.local_pvs().len(), 2, "never two PVs for one volume");
}

/// What a node discovered is what its PVs may name: a PV edited to name
/// another path, or a second PV aliasing a discovered volume's path, is
/// refused at mount with an Event on the PV naming both (the tenant's data
/// stays the tenant's); and a wipe the spec asks for is done only while its
/// PV is released under Delete (an admin's mistaken or stale operation on a
/// PV in use destroys nothing).
#[test]
fn an_edited_or_aliased_local_pv_is_refused_and_a_wipe_needs_a_released_pv() {
    use k8s_openapi::api::core::v1::PersistentVolume;
    use volagent_test_support::driver::{
        assert_failure, assert_success, kubelet_options, run_driver,
    };
    let mut c = Cluster::start(VOLAGENT, &["node-a"], &[LOCAL_PV]);
    let _kcm = c.pv_binder();
    c.storage_class("local-strict", &[("wipe", "zero")]);
    let dir = c.scratch.path("local-a");
    std::fs::create_dir_all(&dir).unwrap();
    let (img1, img2) =
        (c.scratch.image("local-a/one.img", 24), c.scratch.image("local-a/two.img", 24));
    assert!(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&img1).status().unwrap().success());
    write_at(&img1, 20 << 20, MARKER);
    let outside = c.scratch.image("outside.img", 24);
    c.local_agent("node-a", "local-strict", &dir, &[]);
    let (pv1, pv2) =
        (pv_name("node-a", "local-strict", &img1), pv_name("node-a", "local-strict", &img2));
    c.wait_for("2 local PVs", 60, || (c.local_pvs().len() == 2).then_some(()));
    let pvs: Api<PersistentVolume> = Api::all(c.client());
    let mount = |pv: &str, pod: &str| {
        let uid = c.pod_uid(pod, pv);
        let d =
            c.scratch.path(&format!("node-a/kubelet/pods/{uid}/volumes/volagent~local-pv/{pv}"));
        std::fs::create_dir_all(&d).unwrap();
        let d = d.display().to_string();
        let opts = kubelet_options(pv, pod, &uid, "ext4", "");
        (
            d.clone(),
            run_driver(
                Command::new(c.scratch.path("node-a/vpd/volagent~local-pv/local-pv")).args([
                    "mount",
                    &d,
                    &opts.to_string(),
                ]),
            ),
        )
    };

    // An alias: an admin's second PV naming the discovered file.
    let mut alias = c.pv(&pv1).unwrap();
    alias.metadata = ObjectMeta { name: Some("alias".into()), ..Default::default() };
    alias.status = None;
    if let Some(spec) = alias.spec.as_mut() {
        spec.claim_ref = None;
    }
    c.rt.block_on(pvs.create(&PostParams::default(), &alias)).unwrap();
    c.claim("alias", "local-strict");
    let (_, r) = mount("alias", "p-alias");
    assert_failure(
        &r,
        &format!(
            "which node node-a discovered as local volume {} (its PV is {pv1}): a second PV may not alias it",
            img1.display()
        ),
    );
    assert!(
        c.events_of("alias").contains(&"LocalVolumeMismatch".to_string()),
        "an Event on the alias PV"
    );

    // Not what was discovered: a PV of a discovered volume's name (made
    // before the volume showed up, so the controller leaves it) naming
    // another file. (A PV's source is immutable: this is how one differs.)
    let img3 = c.scratch.path("local-a/three.img");
    let pv3 = pv_name("node-a", "local-strict", &img3);
    let mut forged = c.pv(&pv2).unwrap();
    forged.metadata = ObjectMeta {
        name: Some(pv3.clone()),
        labels: forged.metadata.labels.clone(),
        annotations: forged.metadata.annotations.clone(),
        ..Default::default()
    };
    forged.status = None;
    if let Some(flex) = forged.spec.as_mut().and_then(|s| s.flex_volume.as_mut()) {
        flex.options.as_mut().unwrap().insert("path".into(), outside.display().to_string());
    }
    c.rt.block_on(pvs.create(&PostParams::default(), &forged)).unwrap();
    c.scratch.image("local-a/three.img", 24);
    c.wait_for("three.img discovered", 60, || {
        c.local("node-a")?.status?.volumes.iter().any(|v| v.name == pv3).then_some(())
    });
    c.claim(&pv3, "local-strict");
    let (_, r) = mount(&pv3, "p-forged");
    assert_failure(
        &r,
        &format!(
            "PersistentVolume {pv3} names {}, but node node-a discovered {pv3} as {}: the PV was changed",
            outside.display(),
            img3.display()
        ),
    );
    assert!(c.events_of(&pv3).contains(&"LocalVolumeMismatch".to_string()));
    // One that says it was discovered on node-a, but was not.
    let mut invented = forged.clone();
    invented.metadata.name = Some("local-invented".into());
    c.rt.block_on(pvs.create(&PostParams::default(), &invented)).unwrap();
    c.claim("local-invented", "local-strict");
    let (_, r) = mount("local-invented", "p-invented");
    assert_failure(
        &r,
        "says it is a discovered local volume of node node-a, but node node-a discovered no volume local-invented",
    );
    assert!(c.scratch.mounts().is_empty(), "nothing was mounted");

    // The real PV mounts; a wipe of it asked while it is bound wipes nothing.
    c.claim(&pv1, "local-strict");
    let (d1, r) = mount(&pv1, "p-real");
    assert_success(&r);
    let pv = c.pv(&pv1).unwrap();
    let op = serde_json::json!({ "spec": { "operations": [{ "volume": pv1, "kind": "Delete", "pvUID": uid(&pv), "requestedAt": "2026-01-01T00:00:00Z" }] } });
    let lists: Api<NodeLocalVolumes> = Api::all(c.client());
    c.rt.block_on(lists.patch(
        "node-a",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&op),
    ))
    .unwrap();
    let failed = c.wait_for("the wipe refused", 60, || {
        let s = c.local("node-a")?.status?;
        s.operations.into_iter().find(|o| o.volume == pv1 && o.phase == LocalOperationPhase::Error)
    });
    assert!(
        failed.message.as_deref().unwrap_or("").contains("not released under Delete"),
        "{failed:?}"
    );
    assert_success(&run_driver(
        Command::new(c.scratch.path("node-a/vpd/volagent~local-pv/local-pv"))
            .args(["unmount", &d1]),
    ));
    assert!(holds_at(&img1, 20 << 20, MARKER), "the tenant's data is intact");
}

/// A claim on a dynamic local class (provisioner `local-pv.csi.volagent.io`,
/// the scheduler's choice in `volume.kubernetes.io/selected-node`).
fn dynamic_claim(c: &Cluster, name: &str, class: &str, size: &str, node: &str) -> String {
    let pvc: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": name,
            "annotations": { "volume.kubernetes.io/selected-node": node },
        },
        "spec": {
            "storageClassName": class,
            "accessModes": ["ReadWriteOnce"],
            "resources": { "requests": { "storage": size } },
        },
    }))
    .unwrap();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(c.client(), "default");
    let made = c.rt.block_on(claims.create(&PostParams::default(), &pvc)).unwrap();
    format!("pvc-{}", made.metadata.uid.unwrap())
}

/// Dynamic mode, against the API server with kube-controller-manager's PV
/// binder: a class whose provisioner is local-pv's driver gets no PV made
/// ahead for its volumes. A claim gets the smallest free volume that holds
/// it on the node the scheduler chose, as PV `pvc-<uid>` (CSI, its handle
/// the discovered volume's name, its attributes what the node discovered);
/// a claim that finds none left on its node has the node taken off for the
/// scheduler to choose again. A released claim's volume is wiped by its
/// node's agent, its PV goes, and the volume serves the next claim. The
/// CSI controller serves the same volumes: a retried create is the same
/// volume, none left is RESOURCE_EXHAUSTED, capacity is the largest free
/// volume, and a volume no PV ever named is free again at once.
#[test]
fn a_dynamic_local_class_hands_discovered_volumes_to_claims_and_takes_them_back_wiped() {
    use tonic::Code;
    use volagent::csi::proto::csi::controller_client::ControllerClient;
    use volagent::csi::proto::csi::volume_capability::{
        AccessMode, AccessType, MountVolume, access_mode::Mode,
    };
    use volagent::csi::proto::csi::*;
    const CLASS: &str = "local-dyn";
    const SELECTED: &str = "volume.kubernetes.io/selected-node";
    let mut c = Cluster::start(VOLAGENT, &["node-a", "node-b"], &[LOCAL_PV]);
    let _kcm = c.pv_binder();
    let sc: StorageClass = serde_json::from_value(serde_json::json!({
        "metadata": { "name": CLASS },
        "provisioner": "local-pv.csi.volagent.io",
        "parameters": { "wipe": "zero" },
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "WaitForFirstConsumer",
    }))
    .unwrap();
    c.rt.block_on(Api::<StorageClass>::all(c.client()).create(&PostParams::default(), &sc))
        .unwrap();
    let (dir_a, dir_b) = (c.scratch.path("local-a"), c.scratch.path("local-b"));
    std::fs::create_dir_all(&dir_a).unwrap();
    std::fs::create_dir_all(&dir_b).unwrap();
    let small = c.scratch.image("local-a/small.img", 24);
    let big = c.scratch.image("local-a/big.img", 48);
    let on_b = c.scratch.image("local-b/one.img", 24);
    c.local_agent("node-a", CLASS, &dir_a, &[]);
    c.local_agent("node-b", CLASS, &dir_b, &[]);
    let csi = volagent_test_support::ceph_cluster::provisioning_controller(&mut c);
    c.wait_for("the volumes discovered", 60, || {
        let count = |n: &str| c.local(n).and_then(|l| l.status).map_or(0, |s| s.volume_count);
        (count("node-a") == 2 && count("node-b") == 1).then_some(())
    });
    let (v_small, v_big, v_b) = (
        pv_name("node-a", CLASS, &small),
        pv_name("node-a", CLASS, &big),
        pv_name("node-b", CLASS, &on_b),
    );
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(c.client(), "default");
    // What the scheduler is told: per node, the largest free volume.
    let capacities = kube::api::Api::<kube::api::DynamicObject>::namespaced_with(
        c.client(),
        volagent_test_support::shipped::CONTROLLER_NAMESPACE,
        &kube::api::ApiResource {
            group: "storage.k8s.io".into(),
            version: "v1alpha1".into(),
            api_version: "storage.k8s.io/v1alpha1".into(),
            kind: "CSIStorageCapacity".into(),
            plural: "csistoragecapacities".into(),
        },
    );
    let capacity_of = |node: &str| -> Option<String> {
        let list = c.rt.block_on(capacities.list(&Default::default())).unwrap().items;
        list.iter()
            .find(|o| {
                o.data["storageClassName"] == CLASS
                    && o.data["nodeTopology"]["matchLabels"]["kubernetes.io/hostname"] == node
            })
            .and_then(|o| o.data["capacity"].as_str().map(String::from))
    };
    let bytes = |n: u64| Some((n << 20).to_string());
    c.wait_for("the capacity published", 60, || {
        (capacity_of("node-a") == bytes(48) && capacity_of("node-b") == bytes(24)).then_some(())
    });

    // The first claim: the smallest volume on node-a that holds 16 MiB.
    let pv_a = dynamic_claim(&c, "data-a", CLASS, "16Mi", "node-a");
    let bound = c.wait_for("data-a's PV Bound", 60, || c.pv(&pv_a).filter(|p| phase(p) == "Bound"));
    let spec = bound.spec.clone().unwrap();
    let source = spec.csi.clone().unwrap();
    assert_eq!(
        (source.driver.as_str(), source.volume_handle.as_str()),
        ("local-pv.csi.volagent.io", v_small.as_str())
    );
    let attributes = source.volume_attributes.unwrap();
    assert_eq!(attributes["path"], small.display().to_string());
    assert_eq!(attributes["node"], "node-a");
    assert_eq!(attributes["wipe"], "zero");
    assert_eq!(spec.capacity.unwrap()["storage"].0, (24u64 << 20).to_string());
    let term = &spec.node_affinity.unwrap().required.unwrap().node_selector_terms[0];
    assert_eq!(
        term.match_expressions.as_ref().unwrap()[0].values,
        Some(vec!["node-a".to_string()])
    );
    assert!(
        c.pv(&v_small).is_none() && c.local_pvs().is_empty(),
        "no PV made ahead in dynamic mode"
    );

    // The second takes the big one; a third finds node-a full, and the
    // scheduler is asked to choose again.
    let pv_a2 = dynamic_claim(&c, "data-a2", CLASS, "32Mi", "node-a");
    let second = c.wait_for("data-a2's PV", 60, || c.pv(&pv_a2));
    assert_eq!(second.spec.unwrap().csi.unwrap().volume_handle, v_big);
    let pv_a3 = dynamic_claim(&c, "data-a3", CLASS, "16Mi", "node-a");
    c.wait_for("data-a3's selected node taken off", 60, || {
        let claim = c.rt.block_on(claims.get("data-a3")).unwrap();
        (!claim.metadata.annotations.unwrap_or_default().contains_key(SELECTED)).then_some(())
    });
    assert!(c.pv(&pv_a3).is_none(), "no PV without a volume");
    c.wait_for("node-a's capacity down to nothing", 60, || {
        (capacity_of("node-a") == bytes(0)).then_some(())
    });

    // The first tenant writes; its claim goes; its volume is wiped and free.
    write_at(&small, 8 << 20, MARKER);
    c.release("data-a");
    c.wait_for("data-a's PV wiped and gone", 120, || c.pv(&pv_a).is_none().then_some(()));
    assert!(!holds_at(&small, 8 << 20, MARKER), "the volume was zeroed");
    let reasons = c.events_of(&pv_a);
    assert!(
        reasons.contains(&"WipeStarted".to_string())
            && reasons.contains(&"WipeComplete".to_string()),
        "{reasons:?}"
    );
    c.wait_for("the wipe's operation removed", 30, || {
        c.local("node-a").unwrap().spec.operations.is_empty().then_some(())
    });
    let records: Api<volagent::kube::crds::ProvisionRecord> = Api::all(c.client());
    let left = c.rt.block_on(records.list(&Default::default())).unwrap().items;
    assert!(!left.iter().any(|r| r.spec.name == pv_a), "data-a's record went: {left:?}");
    // The scheduler chooses node-a again for data-a3: the wiped volume serves it.
    let patch = serde_json::json!({ "metadata": { "annotations": { SELECTED: "node-a" } } });
    c.rt.block_on(claims.patch("data-a3", &Default::default(), &kube::api::Patch::Merge(&patch)))
        .unwrap();
    let third = c.wait_for("data-a3's PV", 60, || c.pv(&pv_a3));
    assert_eq!(third.spec.unwrap().csi.unwrap().volume_handle, v_small);

    // The same volumes through the CSI controller.
    let socket = volagent::provision::csi::socket_path(&csi, "local-pv");
    c.wait_for("the local-pv controller socket", 30, || socket.exists().then_some(()));
    let on = |node: &str| Topology {
        segments: [("kubernetes.io/hostname".to_string(), node.to_string())].into(),
    };
    let create = |name: &str, node: &str| CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 }),
        volume_capabilities: vec![VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
        }],
        parameters: [("localClass".to_string(), CLASS.to_string())].into(),
        accessibility_requirements: Some(TopologyRequirement {
            requisite: vec![on(node)],
            preferred: vec![on(node)],
        }),
        ..Default::default()
    };
    let capacity = |node: &str| GetCapacityRequest {
        parameters: [("localClass".to_string(), CLASS.to_string())].into(),
        accessible_topology: Some(on(node)),
        ..Default::default()
    };
    c.rt.block_on(async {
        let channel = volagent::csi::client::connect(socket.clone()).await.unwrap();
        let mut ctl = ControllerClient::new(channel);
        let free_b = ctl.get_capacity(capacity("node-b")).await.unwrap().into_inner();
        assert_eq!(free_b.available_capacity, 24 << 20);
        let made = ctl.create_volume(create("csi-1", "node-b")).await.unwrap().into_inner();
        let made = made.volume.unwrap();
        assert_eq!((made.volume_id.as_str(), made.capacity_bytes), (v_b.as_str(), 24 << 20));
        assert_eq!(made.volume_context["path"], on_b.display().to_string());
        let again = ctl.create_volume(create("csi-1", "node-b")).await.unwrap().into_inner();
        assert_eq!(again.volume.unwrap(), made, "a retried create is the same volume");
        let none = ctl.create_volume(create("csi-2", "node-b")).await.unwrap_err();
        assert_eq!(none.code(), Code::ResourceExhausted, "{}", none.message());
        let full_b = ctl.get_capacity(capacity("node-b")).await.unwrap().into_inner();
        assert_eq!(full_b.available_capacity, 0);
        let mut unnamed = create("csi-3", "node-b");
        unnamed.parameters.clear();
        let refused = ctl.create_volume(unnamed).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{}", refused.message());
        // No PV ever named it: free again at once, and again after.
        let delete =
            DeleteVolumeRequest { volume_id: made.volume_id.clone(), ..Default::default() };
        ctl.delete_volume(delete.clone()).await.unwrap();
        ctl.delete_volume(delete).await.unwrap();
        let free_b = ctl.get_capacity(capacity("node-b")).await.unwrap().into_inner();
        assert_eq!(free_b.available_capacity, 24 << 20);
    });
}
