//! What a volume is, as the cluster says: the PersistentVolume bound to a
//! claim the pod uses, or (when an admin allows it for the backend) the
//! pod's own inline volume. Never what a pod's author wrote in options a
//! request carries: a pod could name any PV, path or node there.

use super::cluster::{Cluster, fencing_mode};
use crate::model::{AccessMode, KeyValue};
use crate::ops::cluster::{ClusterVolume, VolumeRequest, inline_key};
use k8s_openapi::api::core::v1::{
    Node, NodeSelectorRequirement, NodeSelectorTerm, PersistentVolume, PersistentVolumeClaim, Pod,
};
use kube::api::Api;
use std::collections::BTreeMap;

/// Why a request is not served.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// The cluster could not be asked.
    #[error("reading {what} from the Kubernetes API: {source}")]
    Api { what: String, source: kube::Error },
    /// What the cluster says does not allow it.
    #[error("{0}")]
    Refused(String),
}

/// The Flexvolume driver name of `backend` (what PVs and pods name).
pub fn driver_name(backend: &str) -> String {
    format!("volagent/{backend}")
}

impl Cluster {
    /// A local PV is what its node discovered: one made of a discovered
    /// volume names exactly that volume's path and device, and no PV names
    /// a discovered volume's path or device under another name. A refusal
    /// is also an Event on the PV, naming both.
    async fn check_discovered(&self, pv: &PersistentVolume, node: &str) -> Result<(), VolumeError> {
        use super::crds::{NODE_LABEL, PROVISIONER};
        let name = pv.metadata.name.clone().unwrap_or_default();
        let options = pv
            .spec
            .as_ref()
            .and_then(|s| s.flex_volume.as_ref())
            .and_then(|f| f.options.clone())
            .unwrap_or_default();
        let path = options.get("path").cloned().unwrap_or_default();
        let identity = options.get(crate::local::discovery::IDENTITY_OPTION).cloned();
        let labelled = pv.metadata.labels.as_ref().is_some_and(|l| l.contains_key(NODE_LABEL));
        let provisioned = pv
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("pv.kubernetes.io/provisioned-by"))
            .is_some_and(|p| p == PROVISIONER);
        let what = format!("NodeLocalVolumes {node}");
        let list = Api::<super::crds::NodeLocalVolumes>::all(self.client.clone())
            .get_opt(node)
            .await
            .map_err(|source| VolumeError::Api { what, source })?;
        let discovered = list.and_then(|l| l.status).map(|s| s.volumes).unwrap_or_default();
        if let Err(why) = super::local_claims::check_mount(
            &name,
            node,
            &path,
            identity.as_deref(),
            labelled || provisioned,
            &discovered,
        ) {
            self.pv_event(
                &name,
                pv.metadata.uid.as_deref().unwrap_or_default(),
                true,
                "LocalVolumeMismatch",
                &why,
            )
            .await;
            return Err(VolumeError::Refused(why));
        }
        Ok(())
    }

    /// The volume `req` is for, as the cluster defines it.
    pub async fn volume(&self, req: &VolumeRequest<'_>) -> Result<ClusterVolume, VolumeError> {
        let api_err = |what: String| move |source| VolumeError::Api { what, source };
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), req.namespace);
        let who = format!("pod {}/{}", req.namespace, req.pod);
        let pod = pods
            .get_opt(req.pod)
            .await
            .map_err(api_err(who.clone()))?
            .ok_or_else(|| VolumeError::Refused(format!("{who} does not exist")))?;
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        if uid != req.pod_uid {
            return Err(VolumeError::Refused(format!(
                "{who} has UID {uid}, not {} as the request says",
                req.pod_uid
            )));
        }
        let volumes = pod.spec.as_ref().and_then(|s| s.volumes.clone()).unwrap_or_default();
        let driver = driver_name(req.backend);

        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        let pv = pvs
            .get_opt(req.name)
            .await
            .map_err(api_err(format!("PersistentVolume {}", req.name)))?;
        let mut why_not_pv = format!("there is no PersistentVolume {}", req.name);
        if let Some(pv) = &pv {
            let spec = pv.spec.clone().unwrap_or_default();
            match (&spec.flex_volume, &spec.claim_ref) {
                (Some(flex), _) if flex.driver != driver => {
                    why_not_pv = format!(
                        "PersistentVolume {} is a {} volume, not {driver}",
                        req.name, flex.driver
                    );
                }
                (None, _) => {
                    why_not_pv =
                        format!("PersistentVolume {} is not a Flexvolume volume", req.name);
                }
                (Some(_), None) => {
                    why_not_pv = format!("PersistentVolume {} is bound to no claim", req.name);
                }
                (Some(flex), Some(claim)) => {
                    let claim_name = claim.name.as_deref().unwrap_or_default();
                    let uses_claim = claim.namespace.as_deref() == Some(req.namespace)
                        && volumes.iter().any(|v| {
                            v.persistent_volume_claim
                                .as_ref()
                                .is_some_and(|c| c.claim_name == claim_name)
                        });
                    if uses_claim
                        && self
                            .claim_bound(req.namespace, claim_name, claim.uid.as_deref(), req.name)
                            .await?
                    {
                        self.check_affinity(pv, req.node).await?;
                        if req.backend == super::crds::LOCAL_BACKEND {
                            self.check_discovered(pv, req.node).await?;
                        }
                        let modes = spec.access_modes.clone().unwrap_or_default();
                        return Ok(ClusterVolume {
                            key: req.name.to_string(),
                            access_mode: fencing_mode(&modes).unwrap_or(AccessMode::ReadWriteOnce),
                            fs_type: flex.fs_type.clone().unwrap_or_default(),
                            options: key_values(flex.options.as_ref()),
                            read_only: flex.read_only.unwrap_or(false),
                        });
                    }
                    why_not_pv =
                        format!("{who} uses no claim bound to PersistentVolume {}", req.name);
                }
            }
        }

        let inline = volumes
            .iter()
            .find(|v| v.name == req.name)
            .and_then(|v| v.flex_volume.as_ref())
            .filter(|f| f.driver == driver);
        match inline {
            Some(_) if !req.inline_allowed => Err(VolumeError::Refused(format!(
                "{who} has an inline {driver} volume {}, but inline volumes of backend {} are not enabled on this node (an admin enables them with --allow-inline-volumes {})",
                req.name, req.backend, req.backend
            ))),
            // A device under /dev named with its identity is for PVs an
            // admin's controller made of discovered disks: a pod's author
            // could name any disk of the node that way.
            Some(flex)
                if flex
                    .options
                    .as_ref()
                    .is_some_and(|o| o.contains_key(crate::local::discovery::IDENTITY_OPTION)) =>
            {
                Err(VolumeError::Refused(format!(
                    "{who}'s inline volume {} names a device by its identity, which only a PV may do",
                    req.name
                )))
            }
            Some(flex) => Ok(ClusterVolume {
                key: inline_key(uid, req.name),
                // Keyed by the pod: nobody else can ever share it.
                access_mode: AccessMode::ReadWriteOncePod,
                fs_type: flex.fs_type.clone().unwrap_or_default(),
                options: key_values(flex.options.as_ref()),
                read_only: flex.read_only.unwrap_or(false),
            }),
            None => Err(VolumeError::Refused(format!(
                "{why_not_pv}, and {who} has no inline {driver} volume {}",
                req.name
            ))),
        }
    }

    /// The claim `namespace/name` exists (with `uid`, when the PV's claimRef
    /// names one) and is bound to `pv`.
    async fn claim_bound(
        &self,
        namespace: &str,
        name: &str,
        uid: Option<&str>,
        pv: &str,
    ) -> Result<bool, VolumeError> {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), namespace);
        let what = format!("PersistentVolumeClaim {namespace}/{name}");
        let Some(claim) =
            claims.get_opt(name).await.map_err(|source| VolumeError::Api { what, source })?
        else {
            return Ok(false);
        };
        let bound = claim.spec.as_ref().and_then(|s| s.volume_name.as_deref()) == Some(pv);
        Ok(bound && uid.is_none_or(|u| u.is_empty() || claim.metadata.uid.as_deref() == Some(u)))
    }

    /// A PV with node affinity is usable only on the nodes it selects.
    async fn check_affinity(&self, pv: &PersistentVolume, node: &str) -> Result<(), VolumeError> {
        let Some(required) = pv
            .spec
            .as_ref()
            .and_then(|s| s.node_affinity.as_ref())
            .and_then(|a| a.required.as_ref())
        else {
            return Ok(());
        };
        let nodes: Api<Node> = Api::all(self.client.clone());
        let found = nodes
            .get_opt(node)
            .await
            .map_err(|source| VolumeError::Api { what: format!("Node {node}"), source })?;
        let labels = found.as_ref().and_then(|n| n.metadata.labels.clone()).unwrap_or_default();
        if required.node_selector_terms.iter().any(|t| term_selects(t, node, &labels)) {
            return Ok(());
        }
        let name = pv.metadata.name.as_deref().unwrap_or_default();
        Err(VolumeError::Refused(format!(
            "PersistentVolume {name}'s node affinity does not select node {node}"
        )))
    }
}

fn key_values(options: Option<&BTreeMap<String, String>>) -> Vec<KeyValue> {
    options
        .into_iter()
        .flatten()
        .map(|(k, v)| KeyValue { key: k.clone(), value: v.clone() })
        .collect()
}

/// A node selector term (all its requirements) selects the node `name`
/// with `labels`.
fn term_selects(term: &NodeSelectorTerm, name: &str, labels: &BTreeMap<String, String>) -> bool {
    let fields: BTreeMap<String, String> = [("metadata.name".to_string(), name.to_string())].into();
    let exprs = term.match_expressions.iter().flatten().map(|r| (r, labels));
    let field_exprs = term.match_fields.iter().flatten().map(|r| (r, &fields));
    let mut all = exprs.chain(field_exprs).peekable();
    // An empty term selects nothing (as Kubernetes has it).
    all.peek().is_some() && all.all(|(r, values)| requirement_holds(r, values))
}

fn requirement_holds(r: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let value = labels.get(&r.key);
    let values = r.values.clone().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => !value.is_some_and(|v| values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => {
            matches!((value.and_then(|v| number(v)), values.first().and_then(|v| number(v))), (Some(a), Some(b)) if a > b)
        }
        "Lt" => {
            matches!((value.and_then(|v| number(v)), values.first().and_then(|v| number(v))), (Some(a), Some(b)) if a < b)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(key: &str, op: &str, values: &[&str]) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: Some(values.iter().map(|v| v.to_string()).collect()),
        }
    }

    #[test]
    fn node_affinity_terms() {
        let labels: BTreeMap<String, String> = [
            ("kubernetes.io/hostname".to_string(), "n1".to_string()),
            ("disks".to_string(), "4".to_string()),
        ]
        .into();
        let term = |exprs: Vec<NodeSelectorRequirement>| NodeSelectorTerm {
            match_expressions: Some(exprs),
            match_fields: None,
        };
        assert!(term_selects(
            &term(vec![req("kubernetes.io/hostname", "In", &["n1", "n2"])]),
            "n1",
            &labels
        ));
        assert!(!term_selects(
            &term(vec![req("kubernetes.io/hostname", "In", &["n2"])]),
            "n1",
            &labels
        ));
        assert!(term_selects(
            &term(vec![req("kubernetes.io/hostname", "NotIn", &["n2"])]),
            "n1",
            &labels
        ));
        assert!(term_selects(
            &term(vec![req("disks", "Gt", &["3"]), req("disks", "Lt", &["5"])]),
            "n1",
            &labels
        ));
        assert!(!term_selects(
            &term(vec![req("disks", "Exists", &[]), req("ssd", "Exists", &[])]),
            "n1",
            &labels
        ));
        assert!(term_selects(&term(vec![req("ssd", "DoesNotExist", &[])]), "n1", &labels));
        assert!(!term_selects(&term(vec![]), "n1", &labels), "an empty term selects nothing");
        let by_name = NodeSelectorTerm {
            match_expressions: None,
            match_fields: Some(vec![req("metadata.name", "In", &["n1"])]),
        };
        assert!(term_selects(&by_name, "n1", &labels));
        assert!(!term_selects(&by_name, "n2", &labels));
        assert!(!term_selects(&term(vec![req("disks", "Bogus", &["4"])]), "n1", &labels));
    }

    #[test]
    fn inline_keys_are_per_pod() {
        assert_ne!(inline_key("uid-a", "data"), inline_key("uid-b", "data"));
        assert_eq!(driver_name("local-pv"), "volagent/local-pv");
    }
}
