//! The kustomization itself: every manifest listed, in an order that applies,
//! every image set, and the workloads' args what the image and binary take.

use super::*;

#[test]
fn kustomization_lists_every_manifest_in_deploy() -> anyhow::Result<()> {
    let k = kustomization()?;
    let mut on_disk = BTreeSet::new();
    yaml_files(&deploy_dir(), "", &mut on_disk)?;
    on_disk.remove("kustomization.yaml");
    // admission-policy/ is a kustomization of its own (Kubernetes ≥ 1.30):
    // it lists its files, and the main one does not.
    let policy_dir = deploy_dir().join("admission-policy");
    let policy: Kustomization =
        serde_norway::from_str(&std::fs::read_to_string(policy_dir.join("kustomization.yaml"))?)?;
    let mut policy_files = BTreeSet::new();
    yaml_files(&policy_dir, "", &mut policy_files)?;
    policy_files.remove("kustomization.yaml");
    assert_eq!(
        policy.resources.iter().cloned().collect::<BTreeSet<_>>(),
        policy_files,
        "admission-policy/kustomization.yaml lists its files"
    );
    on_disk.retain(|f| !f.starts_with("admission-policy/"));
    // snapshot-crds/ too (only where the cluster has no snapshot API of
    // its own): the generated CRDs, checked against the code by a unit test.
    let snapshot_dir = deploy_dir().join("snapshot-crds");
    let snapshot: Kustomization =
        serde_norway::from_str(&std::fs::read_to_string(snapshot_dir.join("kustomization.yaml"))?)?;
    let mut snapshot_files = BTreeSet::new();
    yaml_files(&snapshot_dir, "", &mut snapshot_files)?;
    snapshot_files.remove("kustomization.yaml");
    assert_eq!(
        snapshot.resources.iter().cloned().collect::<BTreeSet<_>>(),
        snapshot_files,
        "snapshot-crds/kustomization.yaml lists its files"
    );
    on_disk.retain(|f| !f.starts_with("snapshot-crds/"));
    let listed: BTreeSet<String> = k.resources.iter().cloned().collect();
    assert_eq!(listed.len(), k.resources.len(), "a file listed twice: {:?}", k.resources);
    let forgotten: Vec<_> = on_disk.difference(&listed).collect();
    let missing: Vec<_> = listed.difference(&on_disk).collect();
    assert!(forgotten.is_empty(), "in deploy/ but not in kustomization.yaml: {forgotten:?}");
    assert!(missing.is_empty(), "in kustomization.yaml but not in deploy/: {missing:?}");
    for crd in [
        "crds/attachments.volagent.io.yaml",
        "crds/nodecleanups.volagent.io.yaml",
        "crds/storageclusters.volagent.io.yaml",
        "crds/fencerequests.volagent.io.yaml",
    ] {
        assert!(listed.contains(crd), "{crd} not listed");
    }
    // Applied in list order: what others need comes first.
    let position = |f: &str| k.resources.iter().position(|r| r == f);
    assert_eq!(position("namespace.yaml"), Some(0), "the namespace first");
    let last_crd = k.resources.iter().rposition(|r| r.starts_with("crds/"));
    let first_workload = ["agent-daemonset.yaml", "controller-deployment.yaml"]
        .iter()
        .filter_map(|f| position(f))
        .min();
    assert!(last_crd < first_workload && first_workload.is_some(), "CRDs before workloads");
    Ok(())
}

#[test]
fn every_workload_image_is_set_by_the_kustomization() -> anyhow::Result<()> {
    let k = kustomization()?;
    let mut images = Vec::new();
    for mut m in raw_manifests(&k)? {
        for c in containers_mut(&mut m.object) {
            images.push(c["image"].as_str().unwrap_or_default().to_string());
        }
    }
    ensure!(images.len() >= 2, "workload images: {images:?}");
    for image in &images {
        let rewritten = k
            .images
            .iter()
            .find_map(|o| o.rewrite(image))
            .with_context(|| format!("image {image:?} has no images: entry"))?;
        ensure!(
            rewritten.contains('/') && rewritten.contains(':'),
            "image {image} becomes {rewritten}: no registry or tag"
        );
    }
    Ok(())
}

#[test]
fn the_image_ships_what_the_daemonset_runs() -> anyhow::Result<()> {
    let dockerfile = std::fs::read_to_string(deploy_dir().join("Dockerfile"))?;
    let entrypoint = dockerfile
        .lines()
        .find(|l| l.starts_with("ENTRYPOINT"))
        .context("deploy/Dockerfile has no ENTRYPOINT")?;
    ensure!(
        entrypoint.contains("tini") && entrypoint.contains("\"/opt/volagent/volagent\""),
        "ENTRYPOINT: {entrypoint}"
    );
    ensure!(
        dockerfile.contains("/opt/volagent/plugins/") && dockerfile.contains("volagent-flex"),
        "the image must ship volagent-flex and the default plugins in /opt/volagent/plugins"
    );
    let all = manifests(&kustomization()?)?;
    let ds = all.iter().find(|m| m.kind() == "DaemonSet").context("no DaemonSet")?;
    let args: Vec<&str> = ds.object["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .context("the agent's args")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let plugin_dir = args.iter().position(|a| *a == "--plugin-dir").and_then(|i| args.get(i + 1));
    ensure!(
        plugin_dir == Some(&"/opt/volagent/plugins"),
        "the DaemonSet's --plugin-dir is the image's /opt/volagent/plugins: {args:?}"
    );
    Ok(())
}

/// The DaemonSet's and the Deployment's args are a command line the
/// binary accepts, with the environment the pods give it.
#[test]
fn the_workloads_args_parse_as_the_binary_expects() -> anyhow::Result<()> {
    use clap::Parser;
    let all = manifests(&kustomization()?)?;
    let workloads: Vec<_> =
        all.iter().filter(|m| ["DaemonSet", "Deployment"].contains(&m.kind())).collect();
    assert_eq!(
        workloads.len(),
        3,
        "the agent's and the mounter's DaemonSets, the controller's Deployment"
    );
    for w in workloads {
        let kind = format!("{} {}", w.kind(), w.name());
        let args: Vec<String> = w.object["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .with_context(|| format!("the {kind}'s args"))?
            .iter()
            .filter_map(|a| a.as_str().map(String::from))
            .collect();
        // kubelet expands $(VAR) from the container's env: the node's IP
        // comes from the downward API.
        let expanded = args.iter().map(|a| a.replace("$(NODE_IP)", "10.0.0.7"));
        let argv = std::iter::once("volagent".to_string()).chain(expanded);
        volagent::cli::Cli::try_parse_from(argv)
            .map_err(|e| anyhow::anyhow!("{kind} args {args:?}: {e}"))?;
    }
    Ok(())
}
