//! The access matrix: issue 4's grants of each service account, as data,
//! and what the API server's access reviews answer for every verb on every
//! resource checked.

use super::*;

pub(crate) const VERBS: [&str; 8] =
    ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"];

/// (group, resource, subresource, namespaced) checked for both accounts.
pub(crate) const RESOURCES: [(&str, &str, &str, bool); 32] = [
    ("volagent.io", "backendpolicies", "", false),
    ("volagent.io", "backendpolicies", "status", false),
    ("volagent.io", "attachments", "", false),
    ("volagent.io", "provisionrecords", "", false),
    ("volagent.io", "fencerequests", "", false),
    ("volagent.io", "fencerequests", "status", false),
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations", "", false),
    ("volagent.io", "nodelocalvolumes", "", false),
    ("volagent.io", "nodelocalvolumes", "status", false),
    ("storage.k8s.io", "storageclasses", "", false),
    ("storage.k8s.io", "csistoragecapacities", "", true),
    ("volagent.io", "nodecleanups", "", false),
    ("volagent.io", "storageclusters", "", false),
    ("volagent.io", "storageclusters", "status", false),
    ("", "nodes", "", false),
    ("", "nodes", "status", false),
    ("", "persistentvolumes", "", false),
    ("", "secrets", "", true),
    ("", "events", "", true),
    ("", "pods", "", true),
    ("", "configmaps", "", true),
    ("", "persistentvolumeclaims", "", true),
    ("", "persistentvolumeclaims", "status", true),
    ("snapshot.storage.k8s.io", "volumesnapshots", "", true),
    ("snapshot.storage.k8s.io", "volumesnapshots", "status", true),
    ("snapshot.storage.k8s.io", "volumesnapshotcontents", "", false),
    ("snapshot.storage.k8s.io", "volumesnapshotcontents", "status", false),
    ("snapshot.storage.k8s.io", "volumesnapshotclasses", "", false),
    ("coordination.k8s.io", "leases", "", true),
    ("apps", "daemonsets", "", true),
    ("rbac.authorization.k8s.io", "clusterroles", "", false),
    ("apiextensions.k8s.io", "customresourcedefinitions", "", false),
];

/// One grant of issue 4's RBAC: `namespace` None is cluster-wide,
/// `names` None is any name.
pub(crate) struct Grant {
    group: &'static str,
    resource: &'static str,
    verbs: &'static [&'static str],
    namespace: Option<&'static str>,
    names: Option<&'static [&'static str]>,
}

pub(crate) const fn grant(
    group: &'static str,
    resource: &'static str,
    verbs: &'static [&'static str],
) -> Grant {
    Grant { group, resource, verbs, namespace: None, names: None }
}

pub(crate) const READ: &[&str] = &["get", "list", "watch"];

pub(crate) const AGENT_GRANTS: &[Grant] = &[
    grant("volagent.io", "attachments", &["get", "list", "watch", "create", "update", "delete"]),
    grant("volagent.io", "nodecleanups", &["get", "list", "watch", "update", "patch"]),
    grant("volagent.io", "storageclusters", READ),
    // A take-over's request that the controller fence a gone node.
    grant("volagent.io", "fencerequests", &["get", "create", "delete"]),
    // Its node's local volumes: the object, and the status it writes.
    grant("volagent.io", "nodelocalvolumes", &["get", "list", "watch", "create"]),
    grant("volagent.io", "nodelocalvolumes/status", &["get", "patch", "update"]),
    // Policy rollouts: the objects followed, its own status entry applied.
    grant("volagent.io", "backendpolicies", READ),
    grant("volagent.io", "backendpolicies/status", &["get", "patch"]),
    grant("", "nodes", READ),
    grant("", "persistentvolumes", READ),
    // A mount's pod and its claim are read back (found by the DaemonSet
    // tier: the agent in its pod was refused).
    grant("", "pods", &["get"]),
    grant("", "persistentvolumeclaims", &["get"]),
    // Credentials: only in its own namespace.
    Grant { namespace: Some(NAMESPACE), ..grant("", "secrets", &["get"]) },
    grant("", "events", &["create", "patch"]),
];

pub(crate) const CONTROLLER_GRANTS: &[Grant] = &[
    grant("volagent.io", "attachments", &["get", "list", "watch", "update", "delete"]),
    grant(
        "volagent.io",
        "nodecleanups",
        &["get", "list", "watch", "create", "update", "patch", "delete"],
    ),
    grant("volagent.io", "fencerequests", &["get", "list", "watch", "delete"]),
    grant("volagent.io", "fencerequests/status", &["get", "update", "patch"]),
    grant("volagent.io", "storageclusters", &["get", "list", "watch", "update", "patch"]),
    grant("volagent.io", "storageclusters/status", &["get", "update", "patch"]),
    // Its own records of what it provisions.
    grant(
        "volagent.io",
        "provisionrecords",
        &["get", "list", "watch", "create", "patch", "delete"],
    ),
    grant("", "nodes", READ),
    // Local volumes: the operations it requests, the PVs it makes and
    // deletes, the classes' reclaim policies and parameters.
    grant("volagent.io", "nodelocalvolumes", &["get", "list", "watch", "patch", "update"]),
    grant("", "persistentvolumes", &["get", "list", "watch", "create", "patch", "delete"]),
    grant("storage.k8s.io", "storageclasses", READ),
    // Claims it provisions (sidecar-less).
    grant("", "persistentvolumeclaims", &["get", "list", "watch", "patch"]),
    grant("", "persistentvolumeclaims/status", &["patch"]),
    // VolumeSnapshots of its volumes (sidecar-less).
    grant("snapshot.storage.k8s.io", "volumesnapshots", &["get", "list", "watch", "patch"]),
    grant("snapshot.storage.k8s.io", "volumesnapshots/status", &["patch"]),
    grant(
        "snapshot.storage.k8s.io",
        "volumesnapshotcontents",
        &["get", "list", "watch", "create", "patch", "delete"],
    ),
    grant("snapshot.storage.k8s.io", "volumesnapshotcontents/status", &["patch"]),
    grant("snapshot.storage.k8s.io", "volumesnapshotclasses", READ),
    grant("", "events", &["create", "patch"]),
    // Its webhook's CA, into its own configuration.
    Grant {
        names: Some(&[WEBHOOK]),
        ..grant(
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
            &["get", "update"],
        )
    },
    // The agents' pods, to tell an agent's node (webhook).
    Grant { namespace: Some(NAMESPACE), ..grant("", "pods", &["get"]) },
    Grant { namespace: Some(CONTROLLER_NS), ..grant("coordination.k8s.io", "leases", &["create"]) },
    Grant {
        namespace: Some(CONTROLLER_NS),
        names: Some(&[LEASE]),
        ..grant("coordination.k8s.io", "leases", &["get", "update"])
    },
    // Its own namespace's Secrets: the credentials StorageClusters name
    // for it, and its webhook's certificate, which it makes and renews.
    Grant { namespace: Some(CONTROLLER_NS), ..grant("", "secrets", &["get", "create"]) },
    Grant {
        namespace: Some(CONTROLLER_NS),
        names: Some(&[WEBHOOK_TLS]),
        ..grant("", "secrets", &["update"])
    },
    // Local capacity per class and node, for the scheduler.
    Grant {
        namespace: Some(CONTROLLER_NS),
        ..grant(
            "storage.k8s.io",
            "csistoragecapacities",
            &["get", "list", "watch", "create", "update", "delete"],
        )
    },
];

pub(crate) fn expected(grants: &[Grant], attrs: &ResourceAttributes) -> bool {
    let resource = match attrs.subresource.as_deref() {
        Some(sub) if !sub.is_empty() => {
            format!("{}/{sub}", attrs.resource.as_deref().unwrap_or_default())
        }
        _ => attrs.resource.clone().unwrap_or_default(),
    };
    let ns = attrs.namespace.as_deref().unwrap_or_default();
    let name = attrs.name.as_deref().unwrap_or_default();
    grants.iter().any(|g| {
        g.group == attrs.group.as_deref().unwrap_or_default()
            && g.resource == resource
            && g.verbs.contains(&attrs.verb.as_deref().unwrap_or_default())
            && g.namespace.is_none_or(|n| n == ns)
            && g.names.is_none_or(|names| !name.is_empty() && names.contains(&name))
    })
}

/// Asks the API server, as the client's user, about every verb on every
/// resource of [`RESOURCES`] (cluster-wide and, for namespaced ones, in
/// volagent-system and default; leases also by name) and lists where its
/// answer differs from `grants`.
pub(crate) async fn access_differences(
    client: kube::Client,
    grants: &[Grant],
) -> anyhow::Result<Vec<String>> {
    let reviews: Api<SelfSubjectAccessReview> = Api::all(client);
    let mut wrong = Vec::new();
    for (group, resource, subresource, namespaced) in RESOURCES {
        let namespaces: &[&str] =
            if namespaced { &["", NAMESPACE, CONTROLLER_NS, "default"] } else { &[""] };
        let names: &[&str] = match resource {
            "leases" => &["", LEASE, "other"],
            "secrets" => &["", WEBHOOK_TLS, "other"],
            "validatingwebhookconfigurations" => &["", WEBHOOK, "other"],
            _ => &[""],
        };
        for ns in namespaces {
            for name in names {
                for verb in VERBS {
                    let attrs = ResourceAttributes {
                        group: Some(group.into()),
                        resource: Some(resource.into()),
                        subresource: Some(subresource.into()),
                        namespace: Some(ns.to_string()),
                        name: Some(name.to_string()),
                        verb: Some(verb.into()),
                        ..ResourceAttributes::default()
                    };
                    let review = SelfSubjectAccessReview {
                        spec: SelfSubjectAccessReviewSpec {
                            resource_attributes: Some(attrs.clone()),
                            ..SelfSubjectAccessReviewSpec::default()
                        },
                        ..SelfSubjectAccessReview::default()
                    };
                    let answer = reviews.create(&PostParams::default(), &review).await?;
                    let allowed = answer.status.is_some_and(|s| s.allowed);
                    let want = expected(grants, &attrs);
                    if allowed != want {
                        let full = if subresource.is_empty() {
                            resource.to_string()
                        } else {
                            format!("{resource}/{subresource}")
                        };
                        let group = if group.is_empty() { "core" } else { group };
                        wrong.push(format!(
                            "{verb} {group} {full} ns={ns:?} name={name:?}: allowed {allowed}, \
                             issue 4 says {want}"
                        ));
                    }
                }
            }
        }
    }
    Ok(wrong)
}
