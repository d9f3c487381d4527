//! The agent's DaemonSet and the controller's Deployment as the API server
//! stored them.

use super::*;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// The agent's DaemonSet: its update strategy, token, priority,
/// tolerations, container, probes and host paths.
pub(crate) fn agent_daemonset_is_as_a_node_needs(all: &[Applied]) -> anyhow::Result<()> {
    // The agent's DaemonSet, as the API server has it.
    let ds: DaemonSet =
        serde_json::from_value(applied(all, "DaemonSet", AGENT_SA)?.answer.clone())?;
    let spec = ds.spec;
    let strategy = spec.update_strategy.clone().unwrap_or_default();
    assert_eq!(
        strategy.type_.as_deref(),
        Some("RollingUpdate"),
        "nothing a volume needs runs in the agent's pod: it is rolled node by node"
    );
    assert_eq!(
        strategy.rolling_update.and_then(|r| r.max_unavailable),
        Some(IntOrString::Int(1)),
        "one node's agent at a time"
    );
    let pod = spec.template.spec.context("pod spec")?;
    assert_eq!(pod.service_account_name.as_deref(), Some(AGENT_SA));
    // Its token is the projected, pod-bound one (the webhook tells its node
    // by the pod), not the legacy Secret token.
    assert_eq!(pod.automount_service_account_token, Some(false));
    let projected = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "service-account")
        .and_then(|v| v.projected.clone())
        .context("the projected service-account volume")?;
    let sources = projected.sources.unwrap_or_default();
    assert!(
        sources.iter().any(|s| s.service_account_token.as_ref().is_some_and(|t| t.path == "token")),
        "a projected token: {sources:?}"
    );
    assert!(
        sources.iter().any(|s| s.config_map.as_ref().is_some_and(|c| c.name == "kube-root-ca.crt")),
        "the cluster's CA: {sources:?}"
    );
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    assert_eq!(pod.host_pid, Some(true), "the mounter's processes are found by their pids");
    let tolerations = pod.tolerations.clone().unwrap_or_default();
    assert!(
        tolerations.iter().any(|t| t.operator.as_deref() == Some("Exists")
            && t.key.is_none()
            && t.effect.is_none()),
        "tolerates every taint: {tolerations:?}"
    );
    let agent = container(&pod, "agent")?;
    assert_eq!(
        agent.image.as_deref(),
        Some("ghcr.io/volagent/volagent:0.1.0"),
        "the kustomization's images: entry"
    );
    assert_eq!(agent.security_context.as_ref().and_then(|s| s.privileged), Some(true));
    assert_eq!(
        agent.args,
        args(&[
            "agent",
            "--in-cluster",
            "--runtime-dir",
            "/run/volagent",
            "--state-dir",
            "/var/lib/volagent",
            "--plugin-dir",
            "/opt/volagent/plugins",
            "--trusted-policies",
            "/opt/volagent/trusted-policies",
            "--policy-store",
            "/opt/volagent/plugins",
            "--policy-store",
            "/var/lib/volagent/policies",
            "--kubelet-root",
            "/var/lib/kubelet",
            "--volume-plugin-dir",
            "/usr/libexec/kubernetes/kubelet-plugins/volume/exec",
            "--metrics-addr",
            "$(NODE_IP):9479",
            "--mounter",
            "/run/volagent/mounter.sock",
        ])
    );
    assert_eq!(agent.command, None, "the image's ENTRYPOINT (tini) stays");
    for (var, path) in [
        ("NODE_NAME", "spec.nodeName"),
        ("NODE_IP", "status.hostIP"),
        ("POD_NAMESPACE", "metadata.namespace"),
        ("POD_NAME", "metadata.name"),
        ("POD_UID", "metadata.uid"),
    ] {
        assert_eq!(field_ref_env(agent, var).as_deref(), Some(path), "env {var}");
    }
    let container_name = agent.env.iter().flatten().find(|e| e.name == "CONTAINER_NAME");
    assert_eq!(container_name.and_then(|e| e.value.as_deref()), Some("agent"));
    assert_eq!(http_probe(agent.liveness_probe.as_ref()), Some(("/healthz".into(), "9479".into())));
    assert_eq!(http_probe(agent.readiness_probe.as_ref()), Some(("/readyz".into(), "9479".into())));
    let requests = agent.resources.as_ref().and_then(|r| r.requests.clone());
    assert!(requests.is_some_and(|r| r.contains_key("cpu") && r.contains_key("memory")));

    // Host paths: each at the same path in the container as on the host.
    let volumes = pod.volumes.clone().unwrap_or_default();
    let mounts = agent.volume_mounts.clone().unwrap_or_default();
    let mut host_paths = BTreeSet::new();
    for v in volumes.iter().filter(|v| v.name != "service-account") {
        let host =
            v.host_path.as_ref().with_context(|| format!("volume {} is no hostPath", v.name))?;
        let mount = mounts
            .iter()
            .find(|m| m.name == v.name)
            .with_context(|| format!("volume {} is not mounted", v.name))?;
        assert_eq!(mount.mount_path, host.path, "volume {} at its host path", v.name);
        host_paths.insert((host.path.clone(), host.type_.clone().unwrap_or_default()));
        match host.path.as_str() {
            "/var/lib/kubelet" => assert_eq!(
                mount.mount_propagation.as_deref(),
                Some("Bidirectional"),
                "staging mounts made in the container must show on the host"
            ),
            "/var/lib/volagent" => assert_eq!(
                mount.mount_propagation.as_deref(),
                Some("Bidirectional"),
                "the mounter's FUSE mounts show here, and the agent's unmounts reach them"
            ),
            "/lib/modules" => assert_eq!(mount.read_only, Some(true), "/lib/modules read-only"),
            "/run/volagent" => assert_eq!(host.type_.as_deref(), Some("DirectoryOrCreate")),
            _ => {}
        }
    }
    for path in [
        "/dev",
        "/sys",
        "/var/lib/kubelet",
        "/usr/libexec/kubernetes/kubelet-plugins/volume/exec",
        "/var/lib/volagent",
        "/run/volagent",
        "/lib/modules",
    ] {
        assert!(
            host_paths.iter().any(|(p, _)| p == path),
            "hostPath {path} missing: {host_paths:?}"
        );
    }
    Ok(())
}

/// The mounter's DaemonSet: replaced only when an operator deletes its pod,
/// no API access, the agent's node paths where its processes mount, a
/// readiness probe that asks it on its socket and no liveness probe.
pub(crate) fn mounter_daemonset_outlives_the_agent(all: &[Applied]) -> anyhow::Result<()> {
    let ds: DaemonSet =
        serde_json::from_value(applied(all, "DaemonSet", "volagent-mounter")?.answer.clone())?;
    let spec = ds.spec;
    assert_eq!(
        spec.update_strategy.and_then(|u| u.type_).as_deref(),
        Some("OnDelete"),
        "replacing the mounter ends its volumes' processes: only by an operator"
    );
    let pod = spec.template.spec.context("pod spec")?;
    assert_eq!(pod.automount_service_account_token, Some(false), "no token");
    assert!(
        pod.volumes.iter().flatten().all(|v| v.projected.is_none() && v.secret.is_none()),
        "no credentials of any kind"
    );
    assert_eq!((pod.host_pid, pod.host_network), (Some(true), Some(true)));
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    let mounter = container(&pod, "mounter")?;
    assert_eq!(mounter.image.as_deref(), Some("ghcr.io/volagent/volagent:0.1.0"));
    assert_eq!(mounter.args, args(&["mounter", "--socket", "/run/volagent/mounter.sock"]));
    assert_eq!(mounter.liveness_probe, None, "a restart would end every process it runs");
    let probe = mounter.readiness_probe.as_ref().and_then(|p| p.exec.clone());
    assert_eq!(
        probe.and_then(|e| e.command),
        args(&[
            "/opt/volagent/volagent",
            "mounter",
            "--check",
            "--socket",
            "/run/volagent/mounter.sock"
        ])
    );
    assert!(mounter.resources.as_ref().is_some_and(|r| r.limits.is_none()), "no limits");
    // Its pod, for the Events that name what pins it.
    for (var, path) in [
        ("POD_NAMESPACE", "metadata.namespace"),
        ("POD_NAME", "metadata.name"),
        ("POD_UID", "metadata.uid"),
    ] {
        assert_eq!(field_ref_env(mounter, var).as_deref(), Some(path), "mounter env {var}");
    }
    let volumes = pod.volumes.clone().unwrap_or_default();
    let mounts = mounter.volume_mounts.clone().unwrap_or_default();
    for (path, propagation) in [
        ("/dev", None),
        ("/var/lib/kubelet", Some("Bidirectional")),
        ("/var/lib/volagent", Some("Bidirectional")),
        ("/run/volagent", None),
    ] {
        let mount = mounts
            .iter()
            .find(|m| m.mount_path == path)
            .with_context(|| format!("{path} is not mounted"))?;
        let volume = volumes
            .iter()
            .find(|v| v.name == mount.name)
            .and_then(|v| v.host_path.clone())
            .with_context(|| format!("{path} is no hostPath"))?;
        assert_eq!(volume.path, path, "{path} at its host path");
        assert_eq!(mount.mount_propagation.as_deref(), propagation, "{path}'s propagation");
    }
    assert_eq!(mounts.len(), 4, "only those: {mounts:?}");
    Ok(())
}

/// The controller's Deployment: two replicas, non-root, read-only, no
/// capabilities.
pub(crate) fn controller_deployment_is_locked_down(all: &[Applied]) -> anyhow::Result<()> {
    // The controller's Deployment.
    let deploy: Deployment =
        serde_json::from_value(applied(all, "Deployment", CONTROLLER_SA)?.answer.clone())?;
    let spec = deploy.spec;
    assert_eq!(spec.replicas, Some(2), "two replicas, one leader");
    let pod = spec.template.spec.context("pod spec")?;
    assert_eq!(pod.service_account_name.as_deref(), Some(CONTROLLER_SA));
    assert_eq!(pod.host_network, None);
    assert_eq!(pod.security_context.as_ref().and_then(|s| s.run_as_non_root), Some(true));
    let controller = container(&pod, "controller")?;
    assert_eq!(
        controller.args,
        args(&[
            "controller",
            "--in-cluster",
            "--scan-interval",
            "1h",
            "--metrics-addr",
            "0.0.0.0:9480",
            "--webhook-addr",
            "0.0.0.0:9443",
            // The image's policies: the controller provisions with them.
            "--plugin-dir",
            "/opt/volagent/plugins",
        ])
    );
    let sc = controller.security_context.clone().context("container securityContext")?;
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_ne!(sc.privileged, Some(true));
    assert_eq!(sc.capabilities.and_then(|c| c.drop), Some(vec!["ALL".to_string()]));
    for (var, path) in [("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace")] {
        assert_eq!(field_ref_env(controller, var).as_deref(), Some(path), "env {var}");
    }
    assert_eq!(
        http_probe(controller.liveness_probe.as_ref()),
        Some(("/healthz".into(), "9480".into()))
    );
    assert_eq!(
        http_probe(controller.readiness_probe.as_ref()),
        Some(("/readyz".into(), "9480".into()))
    );
    Ok(())
}
