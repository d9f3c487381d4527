//! Discovered local volumes handed out as provisioned volumes, one whole
//! volume per claim: which of them a request may take (free: no PV, no
//! provisioned volume and no wipe holds one), the check that a plan took
//! one of those, what the volume's attributes then are, and the wipe that
//! gives one back — asked of its node's agent through the node's
//! NodeLocalVolumes, as for a discovered volume's own PV.
//!
//! What agents report is a claim, not a fact: a volume is offered only
//! under the name discovery gives its path on that node, and the agent
//! that wipes it checks the PV against what it discovered.

use super::records::Records;
use super::{Code, Failure};
use crate::kube::crds::{
    DiscoveredVolume, LocalOperation, LocalOperationKind, LocalOperationPhase, NodeLocalVolumes,
    ProvisionKind,
};
use crate::model::{ControllerStep, KeyValue, LocalKind, LocalVolume, Provision, Segment};
use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::{Api, Patch, PatchParams};
use std::collections::{BTreeMap, BTreeSet};

/// The class parameter naming the discovery class whose volumes a request
/// may take; without it, the claim's StorageClass.
pub const CLASS_PARAMETER: &str = "localClass";

/// Topology keys that name one node.
const NODE_KEYS: [&str; 2] = ["kubernetes.io/hostname", "topology.volagent.io/node"];

/// The key a provisioned local volume's topology names its node by.
pub const NODE_KEY: &str = "kubernetes.io/hostname";

fn api_failure(what: String) -> impl FnOnce(kube::Error) -> Failure {
    move |e| Failure::new(Code::Unavailable, format!("{what}: {e}"))
}

/// The nodes `segments` allow; None: any node (no segment, or one that
/// names no node — a zone, say — which this does not narrow).
pub fn nodes_of(segments: &[Segment]) -> Option<BTreeSet<String>> {
    let mut nodes = BTreeSet::new();
    for segment in segments {
        let node = segment.iter().find(|(k, _)| NODE_KEYS.contains(&k.as_str()))?;
        nodes.insert(node.1.clone());
    }
    (!nodes.is_empty()).then_some(nodes)
}

/// The discovery class a request takes volumes of.
pub fn class_of(parameters: &BTreeMap<String, String>, class: Option<&str>) -> Option<String> {
    parameters.get(CLASS_PARAMETER).cloned().or_else(|| class.map(str::to_string))
}

/// A free volume, and what its node discovered.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub volume: LocalVolume,
    pub discovered: DiscoveredVolume,
}

fn kind_of(v: &DiscoveredVolume) -> Option<LocalKind> {
    match v.kind.as_str() {
        "Filesystem" => Some(LocalKind::Filesystem),
        "Block" => Some(LocalKind::Block),
        "File" => Some(LocalKind::File),
        _ => None,
    }
}

/// What holds discovered volumes already: PVs (a discovered volume's own,
/// by name; a provisioned one's, by handle) and the records of
/// `backend`'s volumes other than request `own`'s.
async fn held(
    client: &kube::Client,
    records: &Records,
    backend: &str,
    own: Option<&str>,
) -> Result<BTreeSet<String>, Failure> {
    let driver = crate::csi::driver_name(backend);
    let mut held = BTreeSet::new();
    let pvs = Api::<PersistentVolume>::all(client.clone())
        .list(&Default::default())
        .await
        .map_err(api_failure("listing the PersistentVolumes".into()))?;
    for pv in pvs.items {
        held.extend(pv.metadata.name.clone());
        if let Some(csi) = pv.spec.and_then(|s| s.csi).filter(|c| c.driver == driver) {
            held.insert(csi.volume_handle);
        }
    }
    for r in records.list(backend, ProvisionKind::Volume).await? {
        if Some(r.spec.name.as_str()) != own {
            held.insert(r.spec.id);
        }
    }
    Ok(held)
}

/// The free volumes of `class` on `nodes` (None: every node), smallest
/// first; request `own`'s own (a retry) counts as free for it.
pub async fn free(
    client: &kube::Client,
    records: &Records,
    backend: &str,
    class: &str,
    nodes: Option<&BTreeSet<String>>,
    own: Option<&str>,
) -> Result<Vec<Candidate>, Failure> {
    let held = held(client, records, backend, own).await?;
    let lists = Api::<NodeLocalVolumes>::all(client.clone())
        .list(&Default::default())
        .await
        .map_err(api_failure("listing the NodeLocalVolumes".into()))?;
    let mut out = Vec::new();
    for list in lists.items {
        let node = list.metadata.name.clone().unwrap_or_default();
        if nodes.is_some_and(|n| !n.contains(&node)) {
            continue;
        }
        let pending: BTreeSet<&str> =
            list.spec.operations.iter().map(|o| o.volume.as_str()).collect();
        for v in list.status.as_ref().map(|s| s.volumes.as_slice()).unwrap_or_default() {
            let named = crate::kube::local_claims::named_as_discovered(&node, v).is_ok();
            if v.class != class || !named || held.contains(&v.name) || pending.contains(&*v.name) {
                continue;
            }
            let (Some(kind), Some(bytes)) =
                (kind_of(v), super::objects::quantity_bytes(&v.capacity))
            else {
                continue;
            };
            out.push(Candidate {
                volume: LocalVolume {
                    name: v.name.clone(),
                    node: node.clone(),
                    kind,
                    capacity_bytes: bytes,
                },
                discovered: v.clone(),
            });
        }
    }
    out.sort_by(|a, b| {
        (a.volume.capacity_bytes, &a.volume.name).cmp(&(b.volume.capacity_bytes, &b.volume.name))
    });
    Ok(out)
}

/// Check that `plan` took one of `candidates` (a policy is trusted to
/// choose, not to name any volume), and give the volume the attributes
/// that say what its node discovered — the agent checks them against its
/// own discovery again before it mounts or wipes — and its node as
/// topology when the policy gave none.
pub fn settle(plan: &mut Provision, candidates: &[Candidate]) -> Result<(), Failure> {
    let taken = plan.steps.iter().find_map(|s| match s {
        ControllerStep::TakeLocalVolume(v) => Some(v.clone()),
        _ => None,
    });
    let Some(taken) = taken else { return Ok(()) };
    let c = candidates.iter().find(|c| c.volume.name == taken).ok_or_else(|| {
        Failure::new(
            Code::Internal,
            format!("the policy took local volume {taken}, which is not one of the free volumes it was offered"),
        )
    })?;
    let d = &c.discovered;
    let mut facts = vec![
        ("path", crate::kube::local_claims::offered_path(d).to_string()),
        ("node", c.volume.node.clone()),
    ];
    if let Some(identity) = &d.identity {
        facts.push((crate::local::discovery::IDENTITY_OPTION, identity.clone()));
    }
    plan.attributes.retain(|kv| !facts.iter().any(|(k, _)| *k == kv.key));
    plan.attributes
        .extend(facts.into_iter().map(|(key, value)| KeyValue { key: key.into(), value }));
    if plan.topology.is_empty() {
        plan.topology.push(vec![(NODE_KEY.to_string(), c.volume.node.clone())]);
    }
    if plan.capacity_bytes == 0 {
        plan.capacity_bytes = c.volume.capacity_bytes;
    }
    Ok(())
}

/// Give discovered volume `volume` back, wiped: its node's agent wipes it
/// when its PV (of `backend`'s CSI driver, handle `volume`) is released
/// under Delete; the volume is free once the wipe is complete. Until then
/// this fails with `FailedPrecondition` and the deletion is tried again. A
/// volume no node reports any more, or one no PV ever named (a create
/// undone before its PV was made), is given back at once.
pub async fn release(client: &kube::Client, backend: &str, volume: &str) -> Result<(), Failure> {
    let lists: Api<NodeLocalVolumes> = Api::all(client.clone());
    let all = lists
        .list(&Default::default())
        .await
        .map_err(api_failure("listing the NodeLocalVolumes".into()))?;
    let Some(list) = all.items.into_iter().find(|l| {
        l.spec.operations.iter().any(|o| o.volume == volume)
            || l.status.as_ref().is_some_and(|s| s.volumes.iter().any(|v| v.name == volume))
    }) else {
        tracing::info!(volume, "local volume given back: no node reports it any more");
        return Ok(());
    };
    let node = list.metadata.name.clone().unwrap_or_default();
    let driver = crate::csi::driver_name(backend);
    let pvs = Api::<PersistentVolume>::all(client.clone())
        .list(&Default::default())
        .await
        .map_err(api_failure("listing the PersistentVolumes".into()))?;
    let pv = pvs.items.into_iter().find(|pv| {
        pv.spec
            .as_ref()
            .and_then(|s| s.csi.as_ref())
            .is_some_and(|c| c.driver == driver && c.volume_handle == volume)
    });
    let mut ops = list.spec.operations.clone();
    let Some(pv) = pv else {
        // Never handed to a pod: nothing to wipe. An operation left from
        // an earlier try goes with it.
        ops.retain(|o| o.volume != volume);
        if ops != list.spec.operations {
            write_operations(&lists, &list, ops).await?;
        }
        return Ok(());
    };
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    let pv_uid = pv.metadata.uid.clone().unwrap_or_default();
    if !crate::kube::local_pvs::needs_wipe(&pv) {
        return Err(Failure::new(
            Code::FailedPrecondition,
            format!(
                "local volume {volume} on node {node}: its PV {pv_name} is not released under reclaim policy Delete; it is not wiped"
            ),
        ));
    }
    let status = list.status.clone().unwrap_or_default();
    let mine = |o: &LocalOperation| o.volume == volume && o.pv_uid == pv_uid;
    let Some(op) = ops.iter().find(|o| mine(o)).cloned() else {
        ops.retain(|o| o.volume != volume);
        ops.push(LocalOperation {
            volume: volume.to_string(),
            kind: LocalOperationKind::Delete,
            pv_uid: pv_uid.clone(),
            requested_at: crate::clock::now_rfc3339(),
            pv: Some(pv_name.clone()),
        });
        write_operations(&lists, &list, ops).await?;
        tracing::info!(volume, pv = %pv_name, node = %node, "provisioned local volume released: wipe requested");
        return Err(waiting(volume, &node, "requested"));
    };
    match status.operations.iter().find(|s| op.is(s)).map(|s| (s.phase, s.message.clone())) {
        Some((LocalOperationPhase::Complete, _)) => {
            ops.retain(|o| !mine(o));
            write_operations(&lists, &list, ops).await?;
            tracing::info!(volume, pv = %pv_name, node = %node, "provisioned local volume wiped: free again");
            Ok(())
        }
        Some((LocalOperationPhase::Error, message)) => Err(Failure::new(
            Code::FailedPrecondition,
            format!(
                "the wipe of local volume {volume} on node {node} failed: {}; once its cause is fixed, remove the operation from NodeLocalVolumes {node} and it is requested again",
                message.unwrap_or_default()
            ),
        )),
        _ => Err(waiting(volume, &node, "running")),
    }
}

fn waiting(volume: &str, node: &str, how: &str) -> Failure {
    Failure::new(
        Code::FailedPrecondition,
        format!(
            "the wipe of local volume {volume} on node {node} is {how}; the deletion waits for it"
        ),
    )
}

/// The node's operations, replaced as a compare-and-swap on what was read
/// (a conflict is retried with the deletion).
async fn write_operations(
    api: &Api<NodeLocalVolumes>,
    list: &NodeLocalVolumes,
    ops: Vec<LocalOperation>,
) -> Result<(), Failure> {
    let node = list.metadata.name.clone().unwrap_or_default();
    let patch = serde_json::json!({
        "metadata": { "resourceVersion": list.metadata.resource_version },
        "spec": { "operations": ops },
    });
    match api.patch(&node, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Err(Failure::new(
            Code::Aborted,
            format!("NodeLocalVolumes {node} changed meanwhile; try again"),
        )),
        Err(e) => Err(api_failure(format!("writing NodeLocalVolumes {node}"))(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(pairs: &[(&str, &str)]) -> Segment {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn segments_name_nodes_or_leave_any() {
        assert_eq!(nodes_of(&[]), None);
        let two =
            [seg(&[("kubernetes.io/hostname", "a")]), seg(&[("topology.volagent.io/node", "b")])];
        assert_eq!(nodes_of(&two), Some(["a".to_string(), "b".to_string()].into()));
        assert_eq!(nodes_of(&[seg(&[("topology.kubernetes.io/zone", "z1")])]), None);
    }

    fn candidate(name: &str, node: &str, identity: Option<&str>) -> Candidate {
        Candidate {
            volume: LocalVolume {
                name: name.into(),
                node: node.into(),
                kind: LocalKind::Block,
                capacity_bytes: 1 << 30,
            },
            discovered: DiscoveredVolume {
                name: name.into(),
                class: "fast".into(),
                path: "/mnt/fast/d1".into(),
                kind: "Block".into(),
                fs_type: None,
                device: Some("/dev/sdb".into()),
                identity: identity.map(String::from),
                capacity: "1Gi".into(),
            },
        }
    }

    #[test]
    fn a_plan_takes_an_offered_volume_and_gets_its_facts() {
        let offered = [candidate("local-1", "node-a", Some("wwid:1"))];
        let mut plan = Provision {
            steps: vec![ControllerStep::TakeLocalVolume("local-1".into())],
            id: "local-1".into(),
            attributes: vec![
                KeyValue { key: "path".into(), value: "/etc".into() },
                KeyValue { key: "wipe".into(), value: "zero".into() },
            ],
            ..Default::default()
        };
        settle(&mut plan, &offered).unwrap();
        let attr =
            |k: &str| plan.attributes.iter().find(|kv| kv.key == k).map(|kv| kv.value.clone());
        assert_eq!(
            attr("path").as_deref(),
            Some("/dev/sdb"),
            "the discovered path, not the policy's"
        );
        assert_eq!(attr("node").as_deref(), Some("node-a"));
        assert_eq!(attr("identity").as_deref(), Some("wwid:1"));
        assert_eq!(attr("wipe").as_deref(), Some("zero"), "the policy's own attributes stay");
        assert_eq!(plan.topology, vec![seg(&[("kubernetes.io/hostname", "node-a")])]);
        assert_eq!(plan.capacity_bytes, 1 << 30);

        let mut other = Provision {
            steps: vec![ControllerStep::TakeLocalVolume("local-9".into())],
            id: "local-9".into(),
            ..Default::default()
        };
        let e = settle(&mut other, &offered).unwrap_err();
        assert!(e.message.contains("not one of the free volumes"), "{e}");
        // A plan that takes none is left as it is.
        let mut none = Provision::default();
        settle(&mut none, &offered).unwrap();
        assert_eq!(none, Provision::default());
    }
}
