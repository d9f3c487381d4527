//! What the agent reads from and tells the cluster: node facts for fencing,
//! the access mode of a PV, and Events about pods.

use crate::model::{AccessMode, NodeFacts};
use k8s_openapi::api::core::v1::{Event, Node, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use kube::api::{Api, ObjectMeta, PostParams};
use std::time::Duration;

pub use crate::kube::crds::CLEANUP_FINALIZER;

/// The taint that declares a node shut down for good.
pub const OUT_OF_SERVICE_TAINT: &str = "node.kubernetes.io/out-of-service";

/// A connection to the cluster, as one node's agent or the controller.
#[derive(Clone)]
pub struct Cluster {
    pub client: kube::Client,
    /// Who writes Events (`volagent-agent` on a node, `volagent-controller`).
    pub component: String,
    pub node: String,
    /// The agent's own namespace: the only one it reads credentials from.
    pub namespace: String,
}

/// A client from a kubeconfig file, or the pod's service account. Every
/// request has a deadline, so an API server that stops answering cannot
/// hang an operation.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<kube::Client> {
    use anyhow::Context;
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .with_context(|| format!("kubeconfig {}", path.display()))?
        }
        None => kube::Config::incluster().context(
            "in-cluster configuration (is this running in a pod with a service account?)",
        )?,
    };
    config.connect_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(Duration::from_secs(15));
    config.write_timeout = Some(Duration::from_secs(15));
    kube::Client::try_from(config).context("Kubernetes client")
}

/// Facts of `node` as a fence decision needs them. A node the API cannot be
/// asked about counts as existing and not ready: a take-over must be proven.
pub fn facts_of(name: &str, node: Option<&Node>) -> NodeFacts {
    let Some(node) = node else {
        return NodeFacts {
            name: name.to_string(),
            exists: false,
            ready: false,
            out_of_service: false,
        };
    };
    let status = node.status.as_ref();
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    let out_of_service = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == OUT_OF_SERVICE_TAINT));
    NodeFacts { name: name.to_string(), exists: true, ready, out_of_service }
}

/// The mode fencing applies to a PV listing `modes`: its only one; of
/// several, ReadWriteOnce when listed (the claim may be any of them, and
/// it is the safe choice for writers), else the first known.
pub fn fencing_mode(modes: &[String]) -> Option<AccessMode> {
    let known: Vec<AccessMode> = modes.iter().filter_map(|m| AccessMode::parse(m)).collect();
    if known.contains(&AccessMode::ReadWriteOncePod) {
        return Some(AccessMode::ReadWriteOncePod);
    }
    if known.len() > 1 && known.contains(&AccessMode::ReadWriteOnce) {
        return Some(AccessMode::ReadWriteOnce);
    }
    known.first().copied()
}

impl Cluster {
    pub async fn node_facts(&self, names: &[&str]) -> Result<Vec<NodeFacts>, kube::Error> {
        let api: Api<Node> = Api::all(self.client.clone());
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            let node = api.get_opt(name).await?;
            out.push(facts_of(name, node.as_ref()));
        }
        Ok(out)
    }

    /// A core/v1 Event about a pod, in the pod's namespace. Best effort: a
    /// failure is logged, never fails the operation.
    pub async fn pod_event(
        &self,
        namespace: &str,
        pod: &str,
        pod_uid: &str,
        warning: bool,
        reason: &str,
        message: &str,
    ) {
        let about = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(pod.to_string()),
            namespace: Some(namespace.to_string()),
            uid: Some(pod_uid.to_string()),
            ..Default::default()
        };
        self.event(namespace, about, warning, reason, message).await;
    }

    /// An Event about a PersistentVolume (cluster-scoped: its Events live
    /// in `default`, where kubectl describe looks for them).
    pub async fn pv_event(
        &self,
        pv: &str,
        pv_uid: &str,
        warning: bool,
        reason: &str,
        message: &str,
    ) {
        let about = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("PersistentVolume".into()),
            name: Some(pv.to_string()),
            uid: Some(pv_uid.to_string()),
            ..Default::default()
        };
        self.event("default", about, warning, reason, message).await;
    }

    /// A core/v1 Event about `about`, written into `namespace`. Best
    /// effort, as every Event here.
    pub async fn event(
        &self,
        namespace: &str,
        about: ObjectReference,
        warning: bool,
        reason: &str,
        message: &str,
    ) {
        let api: Api<Event> = Api::namespaced(self.client.clone(), namespace);
        let now = k8s_openapi::jiff::Timestamp::now();
        let name = about.name.clone().unwrap_or_default();
        let event = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!("{name}.volagent-")),
                namespace: Some(namespace.to_string()),
                ..Default::default()
            },
            involved_object: about,
            reason: Some(reason.to_string()),
            message: Some(message.chars().take(1024).collect()),
            type_: Some(if warning { "Warning" } else { "Normal" }.to_string()),
            source: Some(k8s_openapi::api::core::v1::EventSource {
                component: Some(self.component.clone()),
                host: Some(self.node.clone()),
            }),
            reporting_component: Some(format!("volagent.io/{}", self.component)),
            reporting_instance: Some(self.node.clone()),
            first_timestamp: Some(Time(now)),
            last_timestamp: Some(Time(now)),
            event_time: None::<MicroTime>,
            count: Some(1),
            ..Default::default()
        };
        if let Err(e) = api.create(&PostParams::default(), &event).await {
            tracing::warn!(object = %name, reason, "cannot record an Event: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeCondition, NodeSpec, NodeStatus, Taint};

    fn node(ready: &str, taint: Option<&str>) -> Node {
        Node {
            spec: Some(NodeSpec {
                taints: taint.map(|k| {
                    vec![Taint { key: k.into(), effect: "NoExecute".into(), ..Default::default() }]
                }),
                ..Default::default()
            }),
            status: Some(NodeStatus {
                conditions: Some(vec![NodeCondition {
                    type_: "Ready".into(),
                    status: ready.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn node_facts_follow_the_node_object() {
        assert_eq!(
            facts_of("a", None),
            NodeFacts { name: "a".into(), exists: false, ready: false, out_of_service: false }
        );
        assert!(facts_of("a", Some(&node("True", None))).ready);
        assert!(!facts_of("a", Some(&node("Unknown", None))).ready);
        let tainted = facts_of("a", Some(&node("False", Some(OUT_OF_SERVICE_TAINT))));
        assert!(tainted.exists && tainted.out_of_service);
        assert!(!facts_of("a", Some(&node("True", Some("other")))).out_of_service);
    }

    #[test]
    fn fencing_mode_prefers_the_safe_reading() {
        let m = |v: &[&str]| fencing_mode(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(m(&["ReadWriteMany"]), Some(AccessMode::ReadWriteMany));
        assert_eq!(m(&["ReadWriteMany", "ReadWriteOnce"]), Some(AccessMode::ReadWriteOnce));
        assert_eq!(m(&["ReadOnlyMany", "ReadWriteOncePod"]), Some(AccessMode::ReadWriteOncePod));
        assert_eq!(m(&["Bogus"]), None);
        assert_eq!(m(&[]), None);
    }
}
