//! The five real backends, built as components, through the host runtime.

use std::path::{Path, PathBuf};
use volagent::policy::scenario;
use volagent::policy::*;
use volagent_test_artifacts::BACKENDS;
use volagent_test_support::policy::*;
use volagent_test_support::workspace;

#[test]
fn every_backend_loads_and_declares_itself() {
    let rt = runtime(500);
    for (name, path) in BACKENDS {
        let plugin = load(&rt, path);
        assert_eq!(plugin.name(), *name);
        assert_eq!(plugin.export(), "volagent:policy/policy@1.1.0");
        assert_eq!(plugin.contract(), "1.1.0");
        assert_eq!(plugin.sha256().len(), 64);
        // A policy imports the device interfaces of the devices it attaches
        // and no other.
        let own: Vec<&str> = plugin
            .imports()
            .iter()
            .filter_map(|i| i.strip_prefix("volagent:policy/"))
            .filter_map(|i| i.strip_suffix("@1.1.0"))
            .filter(|i| {
                [
                    "loop-devices",
                    "nbd",
                    "ceph",
                    "ceph-provisioning",
                    "gluster-provisioning",
                    "local-provisioning",
                ]
                .contains(i)
            })
            .collect();
        let expected: &[&str] = match *name {
            "rbd" => &["ceph-provisioning", "ceph"],
            "gluster" => &["gluster-provisioning"],
            "nbd" => &["nbd"],
            "local-pv" => &["local-provisioning", "loop-devices"],
            _ => &[],
        };
        assert_eq!(own, expected, "{name}: {:?}", plugin.imports());
        // The SDK exports every optional interface; the provisioner only
        // where the policy has one.
        let mut optional = vec!["block-volumes", "expand", "health"];
        let provisions = ["rbd", "gluster", "local-pv"].contains(name);
        if provisions {
            optional.push("provisioner");
        }
        assert_eq!(plugin.optional_exports(), optional, "{name}");
        assert_eq!(plugin.provisions(), provisions, "{name}");
        assert!(
            !plugin.imports().iter().any(|i| i.starts_with("wasi:sockets")),
            "{name}: {:?}",
            plugin.imports()
        );
        assert!(!plugin.info().capabilities.steps.is_empty());
    }
}

#[test]
fn every_backend_passes_its_shipped_scenarios() {
    let rt = runtime(500);
    for (name, path) in BACKENDS {
        let plugin = load(&rt, path);
        let ran = run_shipped_scenarios(&plugin, name, |_| true);
        assert!(ran >= 6, "{name}: only {ran} scenarios ran");
    }
}

/// The release builds of the policies for an earlier contract, kept as
/// they were built (tests/fixtures/contract-<version>): every backend of
/// its time (nfs came with 1.0).
fn builds_for(version: &str) -> Vec<(&'static str, PathBuf)> {
    let dir = workspace().join(format!("tests/fixtures/contract-{version}"));
    BACKENDS
        .iter()
        .filter(|(name, _)| version == "1.0" || *name != "nfs")
        .map(|(name, _)| (*name, dir.join(format!("{name}.wasm"))))
        .collect()
}

fn previous_contract_builds() -> Vec<(&'static str, PathBuf)> {
    builds_for("0.4")
}

/// Run the shipped scenarios of `name` that `wanted` picks (by name)
/// against `plugin`, failing on the first that fails; how many ran.
fn run_shipped_scenarios(plugin: &Plugin, name: &str, wanted: impl Fn(&str) -> bool) -> usize {
    let dir = workspace().join("guest-plugins").join(name).join("scenarios");
    let mut ran = 0;
    for file in scenario::files(&dir).unwrap_or_else(|e| panic!("{e}")) {
        for outcome in scenario::run_file(plugin, &file).unwrap_or_else(|e| panic!("{e}")) {
            if !wanted(&outcome.name) {
                continue;
            }
            ran += 1;
            if let Some(why) = outcome.failure {
                panic!(
                    "{name} ({}): {}: {}\n{why}",
                    plugin.contract(),
                    file.display(),
                    outcome.name
                );
            }
        }
    }
    ran
}

/// local-pv volume pv1 of file /mnt/disks/a.img on node n1, and host
/// answers in which that file is there.
fn local_pv_file_volume() -> (Volume, std::sync::Arc<RecordedQueries>) {
    let mut v = volume("pv1", "local-pv");
    v.options = vec![
        KeyValue { key: "path".into(), value: "/mnt/disks/a.img".into() },
        KeyValue { key: "node".into(), value: "n1".into() },
    ];
    let mut q = RecordedQueries::default();
    q.paths.insert("/mnt/disks/a.img".into(), PathKind::RegularFile);
    (v, std::sync::Arc::new(q))
}

#[test]
fn guests_of_the_previous_contract_load_and_pass_the_same_scenarios() {
    let rt = runtime(500);
    for (name, path) in previous_contract_builds() {
        let plugin = load(&rt, path.to_str().expect("utf-8 path"));
        assert_eq!(plugin.name(), name);
        assert_eq!(plugin.export(), "volagent:policy/policy@0.4.0", "{name}");
        assert_eq!(plugin.contract(), "0.4.0", "{name}");
        // Scenarios of what 0.4 could not be asked are 0.5's own.
        let ran = run_shipped_scenarios(&plugin, name, |scenario| !scenario.contains("(0.5)"));
        assert!(ran >= 6, "{name} built for 0.4: only {ran} scenarios ran");
    }
}

/// The compatibility promise: the 1.0 builds of the four policies, kept as
/// they were built, load on this host and pass every scenario of their
/// backends, today's included. A change to the contract that breaks a 1.0
/// guest fails here.
#[test]
fn guests_built_for_contract_1_0_load_and_pass_every_scenario() {
    let rt = runtime(500);
    for (name, path) in builds_for("1.0") {
        let plugin = load(&rt, path.to_str().expect("utf-8 path"));
        assert_eq!(plugin.name(), name);
        assert_eq!(plugin.export(), "volagent:policy/policy@1.0.0", "{name}");
        assert_eq!(plugin.contract(), CONTRACT_VERSION, "{name}: served as it is, no adapter");
        let ran = run_shipped_scenarios(&plugin, name, |_| true);
        assert!(ran >= 6, "{name} built for 1.0: only {ran} scenarios ran");
    }
}

#[test]
fn guests_of_contract_0_5_load_and_pass_every_scenario() {
    let rt = runtime(500);
    for (name, path) in builds_for("0.5") {
        let plugin = load(&rt, path.to_str().expect("utf-8 path"));
        assert_eq!(plugin.name(), name);
        assert_eq!(plugin.export(), "volagent:policy/policy@0.5.0", "{name}");
        assert_eq!(plugin.contract(), "0.5.0", "{name}");
        let ran = run_shipped_scenarios(&plugin, name, |_| true);
        assert!(ran >= 6, "{name} built for 0.5: only {ran} scenarios ran");
    }
}

#[test]
fn what_the_previous_contract_cannot_be_asked_is_refused_not_narrowed() {
    let rt = runtime(500);
    let (_, path) =
        previous_contract_builds().into_iter().find(|(n, _)| *n == "local-pv").expect("local-pv");
    let old = load(&rt, path.to_str().expect("utf-8 path"));
    let new = load(&rt, volagent_test_artifacts::LOCAL_PV);
    let (mut v, q) = local_pv_file_volume();
    let mut c = consumer("n1", "a", "local-pv", "pv1");
    let p = paths("local-pv", "pv1");
    // The same filesystem request gets the same plan from both builds.
    assert_eq!(
        old.attach(q.clone(), &v, &c, &[], &p).unwrap(),
        new.attach(q.clone(), &v, &c, &[], &p).unwrap()
    );
    // A block volume: the 0.5 build publishes the device; the 0.4 build is
    // never asked, and the refusal says why.
    v.mode = VolumeMode::Block;
    c.mount_dir = format!("{}/pv1", p.staging_dir);
    let plan = new.attach(q.clone(), &v, &c, &[], &p).unwrap();
    assert!(
        matches!(plan.as_slice(), [Step::AttachDevice(_), Step::PublishBlock(b)] if b.target == c.mount_dir),
        "{plan:?}"
    );
    let err = old.attach(q.clone(), &v, &c, &[], &p).unwrap_err();
    assert!(
        err.is_policy_refusal() && err.to_string().contains("0.4.0, which has no block volumes"),
        "{err}"
    );
    v.mode = VolumeMode::Filesystem;
    v.mount_flags = vec!["noatime".into()];
    let err = old.attach(q.clone(), &v, &c, &[], &p).unwrap_err();
    assert!(err.to_string().contains("no mount flags"), "{err}");
    let plan = new.attach(q.clone(), &v, &c, &[], &p).unwrap();
    assert!(
        plan.iter().any(|s| matches!(s, Step::Mount(m) if m.options == ["noatime"])),
        "the 0.5 build passes the volume's mount flags: {plan:?}"
    );
    // Expansion: the 0.5 build decides (the filesystem at the consumer's
    // dir grows); a 0.4 build gets what 0.4 hosts did, the same step.
    v.mount_flags.clear();
    let c = consumer("n1", "a", "local-pv", "pv1");
    let grow = vec![Step::GrowFilesystem(GrowFilesystem { target: c.mount_dir.clone() })];
    assert_eq!(new.expand(q.clone(), &v, &c, &p).unwrap(), grow);
    assert_eq!(old.expand(q, &v, &c, &p).unwrap(), grow);
}

#[test]
fn rwo_fencing_through_the_runtime() {
    let rt = runtime(500);
    let plugin = load(&rt, volagent_test_artifacts::GLUSTER);
    let mut v = volume("pv1", "gluster");
    v.options = vec![
        KeyValue { key: "servers".into(), value: "g1".into() },
        KeyValue { key: "volume".into(), value: "gv0".into() },
    ];
    let a = consumer("n1", "a", "gluster", "pv1");
    let b = consumer("n1", "b", "gluster", "pv1");
    let c = consumer("n2", "c", "gluster", "pv1");
    let nodes = [
        NodeFacts { name: "n1".into(), exists: true, ready: true, out_of_service: false },
        NodeFacts { name: "n2".into(), exists: true, ready: true, out_of_service: false },
    ];
    let held = [holder(&a)];
    assert_eq!(plugin.fence(facts(), &v, &b, &held, &nodes).unwrap(), Decision::Grant);
    match plugin.fence(facts(), &v, &c, &held, &nodes).unwrap() {
        Decision::Deny(reason) => assert!(reason.contains("pod default/a on node n1"), "{reason}"),
        other => panic!("expected a denial, got {other:?}"),
    }
    v.access_mode = AccessMode::ReadWriteMany;
    assert_eq!(plugin.fence(facts(), &v, &c, &held, &nodes).unwrap(), Decision::Grant);
}

#[test]
fn a_plan_is_checked_against_this_calls_paths() {
    // The same policy output is fine for its own pod dir, and refused when
    // the host's paths say the pod dir is elsewhere.
    let rt = runtime(500);
    let plugin = load(&rt, volagent_test_artifacts::LOCAL_PV);
    let (v, q) = local_pv_file_volume();
    let c = consumer("n1", "a", "local-pv", "pv1");
    let plan = plugin.attach(q.clone(), &v, &c, &[], &paths("local-pv", "pv1")).unwrap();
    assert_eq!(plan.len(), 4);
    let mut elsewhere = paths("local-pv", "pv1");
    elsewhere.discovery_dirs = vec!["/srv/volumes".into()];
    let err = plugin.attach(q, &v, &c, &[], &elsewhere).unwrap_err();
    assert!(matches!(err, CallError::Plan { .. }), "{err}");
    assert!(err.to_string().contains("/mnt/disks/a.img"), "{err}");
}

#[test]
fn a_scenario_file_for_another_backend_is_an_error() {
    let rt = runtime(500);
    let plugin = load(&rt, volagent_test_artifacts::NBD);
    let file = workspace().join("guest-plugins/rbd/scenarios/fence.yaml");
    let err = scenario::run_file(&plugin, Path::new(&file)).unwrap_err();
    assert!(err.to_string().contains("written for backend \"rbd\""), "{err}");
}

#[test]
fn rbd_provisions_through_the_host_with_checked_plans_and_nbd_is_refused_with_the_reason() {
    let rt = runtime(500);
    let rbd = load(&rt, volagent_test_artifacts::RBD);
    let request = CreateRequest {
        name: "pvc-7".into(),
        required_bytes: 3 << 20,
        parameters: vec![
            KeyValue { key: "storageCluster".into(), value: "ceph".into() },
            KeyValue { key: "imageFeatures".into(), value: "layering,exclusive-lock".into() },
        ],
        access_modes: vec![AccessMode::ReadWriteOnce],
        ..Default::default()
    };
    let made = rbd.create_volume(&request).unwrap().unwrap();
    assert_eq!(made.id, "ceph.rbd.pvc-7");
    assert_eq!(made.capacity_bytes, 3 << 20);
    assert!(matches!(&made.steps[..], [ControllerStep::CreateImage(c)]
        if c.size_bytes == 3 << 20 && c.features == ["layering", "exclusive-lock"]));
    // A feature the host does not allow is refused by the host's check,
    // whatever the policy passed on.
    let mut bad = request.clone();
    bad.parameters.push(KeyValue { key: "imageFeatures".into(), value: "journaling".into() });
    let err = rbd.create_volume(&bad).unwrap_err();
    assert!(
        matches!(err, CallError::Plan { .. }) && err.to_string().contains("journaling"),
        "{err}"
    );
    // The policy's own refusals keep their kind.
    let mut from = request.clone();
    from.source = Some(ContentSource::Snapshot("ceph.rbd.pvc-1".into()));
    assert!(matches!(rbd.create_volume(&from).unwrap(), Err(ProvisionError::NotFound(_))));
    let gone = Target { id: "not-ours".into(), ..Default::default() };
    assert!(matches!(rbd.delete_volume(&gone).unwrap(), Err(ProvisionError::NotFound(_))));
    let nbd = load(&rt, volagent_test_artifacts::NBD);
    assert!(!nbd.provisions());
    match nbd.create_volume(&request).unwrap() {
        Err(ProvisionError::Unsupported(why)) => {
            assert!(why.contains("does not export volagent:policy/provisioner"), "{why}");
        }
        other => panic!("{other:?}"),
    }
}

/// local-pv's provisioner through the host: it chooses among the free
/// volumes the host offers (the smallest that holds the claim, on the
/// chosen node), names the volume after it, and gives it back by name.
#[test]
fn local_pv_places_claims_on_the_offered_volumes_through_the_host() {
    let rt = runtime(500);
    let local = load(&rt, volagent_test_artifacts::LOCAL_PV);
    assert!(local.provisions());
    assert_eq!(
        local.info().capabilities.controller_steps,
        [ControllerStepKind::TakeLocalVolume, ControllerStepKind::ReleaseLocalVolume]
    );
    let offered = |name: &str, node: &str, mib: u64| LocalVolume {
        name: name.into(),
        node: node.into(),
        kind: LocalKind::File,
        capacity_bytes: mib << 20,
    };
    let on = |node: &str| vec![("kubernetes.io/hostname".to_string(), node.to_string())];
    let request = CreateRequest {
        name: "pvc-9".into(),
        required_bytes: 20 << 20,
        access_modes: vec![AccessMode::ReadWriteOnce],
        requisite: vec![on("node-a")],
        preferred: vec![on("node-a")],
        parameters: vec![KeyValue { key: "wipe".into(), value: "zero".into() }],
        local_volumes: vec![
            offered("local-a1", "node-a", 16),
            offered("local-a2", "node-a", 24),
            offered("local-a3", "node-a", 64),
            offered("local-b1", "node-b", 24),
        ],
        ..Default::default()
    };
    let made = local.create_volume(&request).unwrap().unwrap();
    assert_eq!(made.steps, [ControllerStep::TakeLocalVolume("local-a2".into())]);
    assert_eq!((made.id.as_str(), made.capacity_bytes), ("local-a2", 24 << 20));
    assert_eq!(made.topology, [on("node-a")]);
    assert!(made.attributes.contains(&KeyValue { key: "wipe".into(), value: "zero".into() }));
    let mut full = request.clone();
    full.local_volumes.retain(|v| v.node == "node-b");
    assert!(matches!(local.create_volume(&full).unwrap(), Err(ProvisionError::Exhausted(_))));
    let target = Target { id: made.id.clone(), ..Default::default() };
    let gone = local.delete_volume(&target).unwrap().unwrap();
    assert_eq!(gone.steps, [ControllerStep::ReleaseLocalVolume("local-a2".into())]);
    assert!(matches!(local.expand_volume(&target).unwrap(), Err(ProvisionError::Unsupported(_))));
    let capacity =
        CapacityRequest { local_volumes: request.local_volumes.clone(), ..Default::default() };
    assert_eq!(local.capacity(&capacity).unwrap().unwrap(), Some(64 << 20));
}

#[test]
fn gluster_provisions_directories_through_the_host_with_checked_plans() {
    let rt = runtime(500);
    let gluster = load(&rt, volagent_test_artifacts::GLUSTER);
    assert!(gluster.provisions());
    let controller = &gluster.info().capabilities.controller_steps;
    assert_eq!(
        controller,
        &[
            ControllerStepKind::CreateDirectory,
            ControllerStepKind::RemoveDirectory,
            ControllerStepKind::SetQuota
        ]
    );
    let kv = |k: &str, v: &str| KeyValue { key: k.into(), value: v.into() };
    let request = CreateRequest {
        name: "pvc-7".into(),
        required_bytes: 3 << 20,
        parameters: vec![kv("storageCluster", "gluster-a"), kv("volume", "gv0")],
        access_modes: vec![AccessMode::ReadWriteMany],
        ..Default::default()
    };
    let made = gluster.create_volume(&request).unwrap().unwrap();
    assert_eq!(made.id, "gluster-a.gv0.pvc-7");
    assert_eq!(made.capacity_bytes, 3 << 20);
    let dir = DirectoryRef {
        cluster: "gluster-a".into(),
        volume: "gv0".into(),
        path: "volagent/pvc-7".into(),
    };
    assert_eq!(
        made.steps,
        [ControllerStep::CreateDirectory(CreateDirectory {
            dir: dir.clone(),
            quota_bytes: 3 << 20
        })]
    );
    assert!(made.attributes.contains(&kv("subdir", "volagent/pvc-7")), "{:?}", made.attributes);
    let target = Target { id: made.id.clone(), required_bytes: 5 << 20, ..Default::default() };
    let grown = gluster.expand_volume(&target).unwrap().unwrap();
    assert_eq!(
        grown.steps,
        [ControllerStep::SetQuota(SetQuota { dir: dir.clone(), bytes: 5 << 20 })]
    );
    let gone = gluster.delete_volume(&target).unwrap().unwrap();
    assert_eq!(gone.steps, [ControllerStep::RemoveDirectory(dir)]);
    // The policy's own refusals keep their kind.
    let mut block = request.clone();
    block.mode = VolumeMode::Block;
    assert!(matches!(gluster.create_volume(&block).unwrap(), Err(ProvisionError::Unsupported(_))));
    assert!(matches!(gluster.snapshot(&target).unwrap(), Err(ProvisionError::Unsupported(_))));
    let foreign = Target { id: "not-ours".into(), ..Default::default() };
    assert!(matches!(gluster.delete_volume(&foreign).unwrap(), Err(ProvisionError::NotFound(_))));
    // A base dir the host would refuse never gets past the policy's own check.
    let mut sneaky = request.clone();
    sneaky.parameters.push(kv("baseDir", ".."));
    assert!(matches!(gluster.create_volume(&sneaky).unwrap(), Err(ProvisionError::Invalid(_))));
}
