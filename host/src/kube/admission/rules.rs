//! What a node's agent may write, as Kubernetes' NodeRestriction does for
//! kubelets: only what belongs to its own node. Pure: the caller's node and
//! the facts of the other nodes a change touches come in as arguments, so
//! every rule is tested without an API server.
//!
//! - `Attachment`: consumers and storage clients of its own node, freely;
//!   another node's only removed, and only when that node is gone (its Node
//!   deleted or tainted out-of-service — the take-over path); the volume's
//!   identity (backend, mode, source, storage cluster) unchanged while
//!   another node holds it.
//! - `NodeCleanup`: its own list, entries only taken out (the controller
//!   appends, creates and deletes lists).
//! - `NodeLocalVolumes`: its own object, created with no operations; its
//!   status, where every volume is named as discovery names it on this
//!   node; never the spec (the wipes the controller requests).
//! - `FenceRequest`: made and deleted by its requester, never answered.
//! - `BackendPolicy`: only its own node's entry of the status; the spec
//!   (which versions every node runs) is the admin's.

use crate::kube::crds::{
    Attachment, AttachmentSpec, BackendPolicy, FenceRequest, NodeCleanup, NodeLocalVolumes,
};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// The objects the rules know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Attachment,
    NodeCleanup,
    NodeLocalVolumes,
    FenceRequest,
    BackendPolicy,
}

impl Kind {
    /// The kind of a request on `resource` (plural) of group volagent.io.
    pub fn of(group: &str, resource: &str) -> Option<Kind> {
        if group != crate::kube::crds::GROUP {
            return None;
        }
        match resource {
            "attachments" => Some(Kind::Attachment),
            "nodecleanups" => Some(Kind::NodeCleanup),
            "nodelocalvolumes" => Some(Kind::NodeLocalVolumes),
            "fencerequests" => Some(Kind::FenceRequest),
            "backendpolicies" => Some(Kind::BackendPolicy),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Create,
    Update,
    Delete,
    Connect,
}

/// One write, as admission sees it.
#[derive(Debug, Clone)]
pub struct Change<'a> {
    pub kind: Kind,
    pub operation: Operation,
    pub sub_resource: Option<&'a str>,
    pub name: &'a str,
    pub old: Option<&'a Value>,
    pub new: Option<&'a Value>,
}

/// Whether a node is gone: no Node object, or tainted out-of-service.
pub trait Nodes {
    fn gone(&self, node: &str) -> bool;
}

impl<F: Fn(&str) -> bool> Nodes for F {
    fn gone(&self, node: &str) -> bool {
        self(node)
    }
}

/// Allow `change` by the agent of node `me`, or say why not.
pub fn review(me: &str, change: &Change<'_>, nodes: &dyn Nodes) -> Result<(), String> {
    match change.kind {
        Kind::Attachment => attachment(me, change, nodes),
        Kind::NodeCleanup => node_cleanup(me, change),
        Kind::NodeLocalVolumes => local_volumes(me, change),
        Kind::FenceRequest => fence_request(me, change),
        Kind::BackendPolicy => backend_policy(me, change),
    }
}

/// A BackendPolicy's status, by an update of that subresource that leaves
/// every other node's entry as it was (in the same order, as the
/// admission policy's CEL compares them).
fn backend_policy(me: &str, change: &Change<'_>) -> Result<(), String> {
    let name = change.name;
    let own_entry_only = format!(
        "the agent of node {me} may write only its own node's entry of BackendPolicy {name}'s status"
    );
    if change.operation != Operation::Update || change.sub_resource != Some("status") {
        return Err(own_entry_only);
    }
    let old: BackendPolicy = parse(change.old, "the old object")?;
    let new: BackendPolicy = parse(change.new, "the object")?;
    let others = |p: &BackendPolicy| {
        p.status
            .as_ref()
            .map(|s| s.nodes.iter().filter(|e| e.node != me).cloned().collect::<Vec<_>>())
            .unwrap_or_default()
    };
    if others(&old) != others(&new) {
        return Err(own_entry_only);
    }
    Ok(())
}

/// The nodes other than `me` whose entries `change` takes out of an
/// Attachment: their facts are needed to review it.
pub fn nodes_to_check(me: &str, change: &Change<'_>) -> Vec<String> {
    if change.kind != Kind::Attachment {
        return Vec::new();
    }
    let (Ok(old), new) = (
        parse::<Attachment>(change.old, "the old object"),
        parse::<Attachment>(change.new, "the object").ok(),
    ) else {
        return Vec::new();
    };
    let mut out: Vec<String> = foreign_nodes(me, &old.spec)
        .into_iter()
        .filter(|n| {
            new.as_ref().is_none_or(|new| entries_of(n, &new.spec) != entries_of(n, &old.spec))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

fn parse<T: DeserializeOwned>(v: Option<&Value>, what: &str) -> Result<T, String> {
    let v = v.ok_or_else(|| format!("{what} is missing from the request"))?;
    serde_json::from_value(v.clone()).map_err(|e| format!("{what} does not parse: {e}"))
}

fn finalizers(v: Option<&Value>) -> Option<&Value> {
    v?.get("metadata")?
        .get("finalizers")
        .filter(|f| !f.is_null() && f.as_array().is_none_or(|a| !a.is_empty()))
}

fn same_finalizers(change: &Change<'_>) -> Result<(), String> {
    if finalizers(change.old) != finalizers(change.new) {
        return Err(format!("an agent may not change the finalizers of {}", change.name));
    }
    Ok(())
}

/// Every node but `me` that holds a consumer or a storage client.
fn foreign_nodes(me: &str, spec: &AttachmentSpec) -> Vec<String> {
    let mut nodes: Vec<String> = spec
        .consumers
        .iter()
        .map(|c| c.node.clone())
        .chain(spec.storage_clients.iter().map(|c| c.node.clone()))
        .filter(|n| n != me)
        .collect();
    nodes.sort();
    nodes.dedup();
    nodes
}

/// What an Attachment holds of `node`, comparable as a whole.
fn entries_of(node: &str, spec: &AttachmentSpec) -> (Vec<String>, Vec<String>) {
    let consumers = spec
        .consumers
        .iter()
        .filter(|c| c.node == node)
        .map(|c| serde_json::to_string(c).unwrap_or_default())
        .collect();
    let clients = spec
        .storage_clients
        .iter()
        .filter(|c| c.node == node)
        .map(|c| serde_json::to_string(c).unwrap_or_default())
        .collect();
    (consumers, clients)
}

fn attachment(me: &str, change: &Change<'_>, nodes: &dyn Nodes) -> Result<(), String> {
    let name = change.name;
    match change.operation {
        Operation::Create => {
            let new: Attachment = parse(change.new, "the object")?;
            if let Some(other) = foreign_nodes(me, &new.spec).first() {
                return Err(format!(
                    "the agent of node {me} may record only its own node's consumers and clients; Attachment {name} names node {other}"
                ));
            }
            same_finalizers(change)
        }
        Operation::Update => {
            let old: Attachment = parse(change.old, "the old object")?;
            let new: Attachment = parse(change.new, "the object")?;
            same_finalizers(change)?;
            let foreign_before = foreign_nodes(me, &old.spec);
            for node in foreign_nodes(me, &new.spec) {
                if !foreign_before.contains(&node) {
                    return Err(format!(
                        "the agent of node {me} may not add node {node}'s consumers or clients to Attachment {name}"
                    ));
                }
            }
            for node in &foreign_before {
                let (before, after) = (entries_of(node, &old.spec), entries_of(node, &new.spec));
                if before == after {
                    continue;
                }
                let kept = after.0.iter().all(|c| before.0.contains(c))
                    && after.1.iter().all(|c| before.1.contains(c));
                if !kept {
                    return Err(format!(
                        "the agent of node {me} may not change node {node}'s consumers or clients in Attachment {name}"
                    ));
                }
                if !nodes.gone(node) {
                    return Err(format!(
                        "the agent of node {me} may not remove node {node}'s consumers or clients from Attachment {name}: node {node} is not gone (neither deleted nor tainted out-of-service)"
                    ));
                }
            }
            let others_hold = old.spec.consumers.iter().any(|c| c.node != me);
            let identity = |s: &AttachmentSpec| {
                (s.backend.clone(), s.access_mode, s.storage_cluster.clone(), s.source.clone())
            };
            if others_hold && identity(&old.spec) != identity(&new.spec) {
                return Err(format!(
                    "the agent of node {me} may not change what volume {name} is (backend, access mode, source, storage cluster) while other nodes hold it"
                ));
            }
            Ok(())
        }
        Operation::Delete => {
            let old: Attachment = parse(change.old, "the old object")?;
            for node in foreign_nodes(me, &old.spec) {
                if !nodes.gone(&node) {
                    return Err(format!(
                        "the agent of node {me} may not delete Attachment {name}: node {node} still holds it"
                    ));
                }
            }
            Ok(())
        }
        Operation::Connect => Err(format!("an agent may not connect to Attachment {name}")),
    }
}

fn own(me: &str, kind: &str, name: &str) -> Result<(), String> {
    if name != me {
        return Err(format!(
            "the agent of node {me} may write only its own node's {kind}, not {kind} {name}"
        ));
    }
    Ok(())
}

fn node_cleanup(me: &str, change: &Change<'_>) -> Result<(), String> {
    let name = change.name;
    match change.operation {
        Operation::Update => {
            own(me, "NodeCleanup", name)?;
            same_finalizers(change)?;
            let old: NodeCleanup = parse(change.old, "the old object")?;
            let new: NodeCleanup = parse(change.new, "the object")?;
            if let Some(added) = new.spec.entries.iter().find(|e| !old.spec.entries.contains(e)) {
                return Err(format!(
                    "the agent of node {me} may only take entries out of its cleanup list; the update adds or changes the entry of volume {} at {}",
                    added.volume, added.consumer.mount_dir
                ));
            }
            Ok(())
        }
        Operation::Create | Operation::Delete | Operation::Connect => Err(format!(
            "cleanup lists are the controller's to create and delete; the agent of node {me} may only work its own off (NodeCleanup {name})"
        )),
    }
}

fn local_volumes(me: &str, change: &Change<'_>) -> Result<(), String> {
    let name = change.name;
    own(me, "NodeLocalVolumes", name)?;
    match (change.operation, change.sub_resource) {
        (Operation::Create, None) => {
            let new: NodeLocalVolumes = parse(change.new, "the object")?;
            if !new.spec.operations.is_empty() {
                return Err(format!(
                    "the operations in NodeLocalVolumes {name} are the controller's to request"
                ));
            }
            discovered_names(me, &new)
        }
        (Operation::Update, Some("status")) => {
            same_finalizers(change)?;
            let new: NodeLocalVolumes = parse(change.new, "the object")?;
            discovered_names(me, &new)
        }
        (Operation::Update, None) => {
            same_finalizers(change)?;
            let old: NodeLocalVolumes = parse(change.old, "the old object")?;
            let new: NodeLocalVolumes = parse(change.new, "the object")?;
            if old.spec != new.spec {
                return Err(format!(
                    "the operations in NodeLocalVolumes {name} are the controller's to request"
                ));
            }
            Ok(())
        }
        _ => Err(format!(
            "the agent of node {me} may only create its NodeLocalVolumes and write their status"
        )),
    }
}

/// Every volume the status lists carries the name discovery gives it on
/// node `me`: a name is a PV's name, and no node may claim another's.
fn discovered_names(me: &str, list: &NodeLocalVolumes) -> Result<(), String> {
    for v in list.status.iter().flat_map(|s| s.volumes.iter()) {
        let expected = crate::local::pv_name(me, &v.class, std::path::Path::new(&v.path));
        if v.name != expected {
            return Err(format!(
                "NodeLocalVolumes {me} lists volume {} at {} of class {}: on node {me} that volume is {expected}",
                v.name, v.path, v.class
            ));
        }
    }
    Ok(())
}

fn fence_request(me: &str, change: &Change<'_>) -> Result<(), String> {
    let name = change.name;
    match (change.operation, change.sub_resource) {
        (Operation::Create, None) => {
            let new: FenceRequest = parse(change.new, "the object")?;
            if new.spec.requester != me {
                return Err(format!(
                    "the agent of node {me} may ask for fencing only as itself, not as node {}",
                    new.spec.requester
                ));
            }
            if new.spec.node == me {
                return Err(format!(
                    "the agent of node {me} may not ask to fence its own node's clients"
                ));
            }
            Ok(())
        }
        (Operation::Delete, None) => {
            let old: FenceRequest = parse(change.old, "the old object")?;
            if old.spec.requester != me {
                return Err(format!(
                    "FenceRequest {name} is node {}'s, not node {me}'s",
                    old.spec.requester
                ));
            }
            Ok(())
        }
        _ => Err(format!(
            "fence requests are answered by the controller; the agent of node {me} may only make and delete its own (FenceRequest {name})"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn consumer(node: &str, dir: &str) -> Value {
        json!({ "node": node, "podNamespace": "default", "pod": "p", "podUID": format!("uid-{node}"), "mountDir": dir, "readOnly": false, "since": "2026-01-01T00:00:00Z" })
    }

    fn attachment(consumers: &[Value], clients: &[(&str, i64)]) -> Value {
        let clients: Vec<Value> = clients
            .iter()
            .map(|(n, id)| json!({ "node": n, "id": id, "address": format!("10.0.0.1:0/{id}") }))
            .collect();
        json!({
            "apiVersion": "volagent.io/v1alpha1", "kind": "Attachment", "metadata": { "name": "pv1" },
            "spec": { "backend": "rbd", "accessMode": "ReadWriteOnce", "consumers": consumers, "storageClients": clients }
        })
    }

    fn change<'a>(
        kind: Kind,
        operation: Operation,
        name: &'a str,
        old: Option<&'a Value>,
        new: Option<&'a Value>,
    ) -> Change<'a> {
        Change { kind, operation, sub_resource: None, name, old, new }
    }

    const NONE_GONE: fn(&str) -> bool = |_| false;

    #[test]
    fn an_agent_records_only_its_own_node() {
        let mine = attachment(&[consumer("a", "/k/a")], &[("a", 1)]);
        assert_eq!(
            review(
                "a",
                &change(Kind::Attachment, Operation::Create, "pv1", None, Some(&mine)),
                &NONE_GONE
            ),
            Ok(())
        );
        let theirs = attachment(&[consumer("b", "/k/b")], &[]);
        let e = review(
            "a",
            &change(Kind::Attachment, Operation::Create, "pv1", None, Some(&theirs)),
            &NONE_GONE,
        )
        .unwrap_err();
        assert!(e.contains("names node b"), "{e}");
        let their_client = attachment(&[consumer("a", "/k/a")], &[("b", 2)]);
        assert!(
            review(
                "a",
                &change(Kind::Attachment, Operation::Create, "pv1", None, Some(&their_client)),
                &NONE_GONE
            )
            .is_err()
        );
    }

    #[test]
    fn another_nodes_holder_is_removed_only_when_that_node_is_gone() {
        let old = attachment(&[consumer("b", "/k/b")], &[("b", 2)]);
        let taken = attachment(&[consumer("a", "/k/a")], &[]);
        let c = change(Kind::Attachment, Operation::Update, "pv1", Some(&old), Some(&taken));
        assert_eq!(nodes_to_check("a", &c), vec!["b".to_string()]);
        let e = review("a", &c, &NONE_GONE).unwrap_err();
        assert!(e.contains("node b is not gone"), "{e}");
        assert_eq!(review("a", &c, &|n: &str| n == "b"), Ok(()));
        // Joining beside a live holder changes nothing of the holder's.
        let joined = attachment(&[consumer("b", "/k/b"), consumer("a", "/k/a")], &[("b", 2)]);
        let c = change(Kind::Attachment, Operation::Update, "pv1", Some(&old), Some(&joined));
        assert!(nodes_to_check("a", &c).is_empty());
        assert_eq!(review("a", &c, &NONE_GONE), Ok(()));
        // Rewriting the holder (its mount dir) is never allowed, gone or not.
        let moved = attachment(&[consumer("b", "/k/elsewhere")], &[("b", 2)]);
        let e = review(
            "a",
            &change(Kind::Attachment, Operation::Update, "pv1", Some(&old), Some(&moved)),
            &|_: &str| true,
        )
        .unwrap_err();
        assert!(e.contains("may not change node b's"), "{e}");
        // Nor adding a third node.
        let added = attachment(&[consumer("b", "/k/b"), consumer("c", "/k/c")], &[("b", 2)]);
        let e = review(
            "a",
            &change(Kind::Attachment, Operation::Update, "pv1", Some(&old), Some(&added)),
            &NONE_GONE,
        )
        .unwrap_err();
        assert!(e.contains("may not add node c's"), "{e}");
    }

    #[test]
    fn a_shared_volume_keeps_what_it_is_and_is_deleted_only_by_its_last_live_holder() {
        let old = attachment(&[consumer("b", "/k/b"), consumer("a", "/k/a")], &[]);
        let mut other = old.clone();
        other["spec"]["accessMode"] = json!("ReadWriteMany");
        let e = review(
            "a",
            &change(Kind::Attachment, Operation::Update, "pv1", Some(&old), Some(&other)),
            &NONE_GONE,
        )
        .unwrap_err();
        assert!(e.contains("while other nodes hold it"), "{e}");
        let alone = attachment(&[consumer("a", "/k/a")], &[]);
        let mut alone_rwx = alone.clone();
        alone_rwx["spec"]["accessMode"] = json!("ReadWriteMany");
        assert_eq!(
            review(
                "a",
                &change(Kind::Attachment, Operation::Update, "pv1", Some(&alone), Some(&alone_rwx)),
                &NONE_GONE
            ),
            Ok(())
        );
        let e = review(
            "a",
            &change(Kind::Attachment, Operation::Delete, "pv1", Some(&old), None),
            &NONE_GONE,
        )
        .unwrap_err();
        assert!(e.contains("node b still holds it"), "{e}");
        assert_eq!(
            review(
                "a",
                &change(Kind::Attachment, Operation::Delete, "pv1", Some(&alone), None),
                &NONE_GONE
            ),
            Ok(())
        );
        assert_eq!(
            review(
                "a",
                &change(Kind::Attachment, Operation::Delete, "pv1", Some(&old), None),
                &|n: &str| n == "b"
            ),
            Ok(())
        );
    }

    #[test]
    fn finalizers_are_not_the_agents() {
        let old = attachment(&[consumer("a", "/k/a")], &[]);
        let mut new = old.clone();
        new["metadata"]["finalizers"] = json!(["x"]);
        assert!(
            review(
                "a",
                &change(Kind::Attachment, Operation::Update, "pv1", Some(&old), Some(&new)),
                &NONE_GONE
            )
            .is_err()
        );
        // An absent list and an empty one are the same.
        new["metadata"]["finalizers"] = json!([]);
        assert_eq!(
            review(
                "a",
                &change(Kind::Attachment, Operation::Update, "pv1", Some(&old), Some(&new)),
                &NONE_GONE
            ),
            Ok(())
        );
    }

    fn cleanup(node: &str, dirs: &[&str]) -> Value {
        let entries: Vec<Value> = dirs
            .iter()
            .map(|d| json!({ "volume": "pv1", "backend": "rbd", "accessMode": "ReadWriteOnce", "consumer": consumer(node, d), "reason": "NodeGone", "movedAt": "2026-01-01T00:00:01Z" }))
            .collect();
        json!({ "apiVersion": "volagent.io/v1alpha1", "kind": "NodeCleanup", "metadata": { "name": node }, "spec": { "entries": entries } })
    }

    #[test]
    fn a_cleanup_list_is_only_worked_off_by_its_own_node() {
        let old = cleanup("a", &["/k/1", "/k/2"]);
        let less = cleanup("a", &["/k/2"]);
        let empty = cleanup("a", &[]);
        let more = cleanup("a", &["/k/1", "/k/2", "/k/3"]);
        let up = |old: &'static str, o: &Value, n: &Value| {
            review(
                old,
                &change(Kind::NodeCleanup, Operation::Update, "a", Some(o), Some(n)),
                &NONE_GONE,
            )
        };
        assert_eq!(up("a", &old, &less), Ok(()));
        assert_eq!(up("a", &old, &empty), Ok(()));
        assert!(up("a", &old, &more).unwrap_err().contains("only take entries out"));
        assert!(up("b", &old, &empty).unwrap_err().contains("only its own node's NodeCleanup"));
        assert!(
            review(
                "a",
                &change(Kind::NodeCleanup, Operation::Delete, "a", Some(&empty), None),
                &NONE_GONE
            )
            .is_err()
        );
        assert!(
            review(
                "a",
                &change(Kind::NodeCleanup, Operation::Create, "a", None, Some(&empty)),
                &NONE_GONE
            )
            .is_err()
        );
    }

    fn local(node: &str, volumes: &[(&str, &str)], operations: usize) -> Value {
        let volumes: Vec<Value> = volumes.iter().map(|(name, path)| json!({ "name": name, "class": "fast", "path": path, "kind": "File", "capacity": "1Gi" })).collect();
        let ops: Vec<Value> = (0..operations).map(|i| json!({ "volume": format!("v{i}"), "kind": "Delete", "pvUID": "u", "requestedAt": "t" })).collect();
        json!({ "apiVersion": "volagent.io/v1alpha1", "kind": "NodeLocalVolumes", "metadata": { "name": node }, "spec": { "operations": ops }, "status": { "volumes": volumes } })
    }

    #[test]
    fn local_volumes_are_published_only_under_their_own_node_and_names() {
        let name = crate::local::pv_name("a", "fast", std::path::Path::new("/mnt/fast/d1"));
        let good = local("a", &[(&name, "/mnt/fast/d1")], 0);
        let status = |me: &'static str, obj: &Value| {
            review(
                me,
                &Change {
                    kind: Kind::NodeLocalVolumes,
                    operation: Operation::Update,
                    sub_resource: Some("status"),
                    name: "a",
                    old: Some(obj),
                    new: Some(obj),
                },
                &NONE_GONE,
            )
        };
        assert_eq!(status("a", &good), Ok(()));
        assert!(status("b", &good).unwrap_err().contains("only its own node's NodeLocalVolumes"));
        // A name of its own choosing, or another node's name for the path.
        let chosen = local("a", &[("victim-pv", "/mnt/fast/d1")], 0);
        assert!(status("a", &chosen).unwrap_err().contains("that volume is"));
        let borrowed = crate::local::pv_name("b", "fast", std::path::Path::new("/mnt/fast/d1"));
        assert!(status("a", &local("a", &[(&borrowed, "/mnt/fast/d1")], 0)).is_err());
        // The spec is the controller's.
        assert_eq!(
            review(
                "a",
                &change(
                    Kind::NodeLocalVolumes,
                    Operation::Create,
                    "a",
                    None,
                    Some(&local("a", &[], 0))
                ),
                &NONE_GONE
            ),
            Ok(())
        );
        assert!(
            review(
                "a",
                &change(
                    Kind::NodeLocalVolumes,
                    Operation::Create,
                    "a",
                    None,
                    Some(&local("a", &[], 1))
                ),
                &NONE_GONE
            )
            .is_err()
        );
        let e = review(
            "a",
            &change(
                Kind::NodeLocalVolumes,
                Operation::Update,
                "a",
                Some(&local("a", &[], 1)),
                Some(&local("a", &[], 0)),
            ),
            &NONE_GONE,
        )
        .unwrap_err();
        assert!(e.contains("controller's to request"), "{e}");
        assert!(
            review(
                "a",
                &change(Kind::NodeLocalVolumes, Operation::Delete, "a", Some(&good), None),
                &NONE_GONE
            )
            .is_err()
        );
    }

    #[test]
    fn fence_requests_are_made_and_deleted_by_their_requester_only() {
        let req = |requester: &str, node: &str| json!({ "apiVersion": "volagent.io/v1alpha1", "kind": "FenceRequest", "metadata": { "name": "f" }, "spec": { "volume": "pv1", "requester": requester, "node": node, "address": "10.0.0.1:0/1" } });
        let (ab, ba, aa) = (req("a", "b"), req("b", "a"), req("a", "a"));
        assert_eq!(
            review(
                "a",
                &change(Kind::FenceRequest, Operation::Create, "f", None, Some(&ab)),
                &NONE_GONE
            ),
            Ok(())
        );
        assert!(
            review(
                "a",
                &change(Kind::FenceRequest, Operation::Create, "f", None, Some(&ba)),
                &NONE_GONE
            )
            .is_err()
        );
        assert!(
            review(
                "a",
                &change(Kind::FenceRequest, Operation::Create, "f", None, Some(&aa)),
                &NONE_GONE
            )
            .is_err()
        );
        assert_eq!(
            review(
                "a",
                &change(Kind::FenceRequest, Operation::Delete, "f", Some(&ab), None),
                &NONE_GONE
            ),
            Ok(())
        );
        assert!(
            review(
                "b",
                &change(Kind::FenceRequest, Operation::Delete, "f", Some(&ab), None),
                &NONE_GONE
            )
            .is_err()
        );
        let answer = Change {
            kind: Kind::FenceRequest,
            operation: Operation::Update,
            sub_resource: Some("status"),
            name: "f",
            old: Some(&ab),
            new: Some(&ab),
        };
        assert!(review("a", &answer, &NONE_GONE).is_err());
    }

    #[test]
    fn malformed_objects_are_refused_with_the_reason() {
        let junk = json!({ "spec": { "consumers": "nope" } });
        let e = review(
            "a",
            &change(Kind::Attachment, Operation::Create, "pv1", None, Some(&junk)),
            &NONE_GONE,
        )
        .unwrap_err();
        assert!(e.contains("does not parse"), "{e}");
        let e = review(
            "a",
            &change(Kind::Attachment, Operation::Update, "pv1", None, Some(&junk)),
            &NONE_GONE,
        )
        .unwrap_err();
        assert!(e.contains("missing"), "{e}");
    }

    #[test]
    fn an_agent_writes_only_its_own_entry_of_a_rollouts_status() {
        let policy = |entries: &[(&str, &str)]| {
            let nodes: Vec<Value> = entries
                .iter()
                .map(|(n, state)| json!({ "node": n, "state": state, "updatedAt": "t" }))
                .collect();
            json!({ "apiVersion": "volagent.io/v1alpha1", "kind": "BackendPolicy", "metadata": { "name": "nbd" },
                    "spec": { "backend": "nbd", "serving": "a".repeat(64) }, "status": { "nodes": nodes } })
        };
        let nobody = |_: &str| false;
        let status = |old: &Value, new: &Value| {
            let c = Change {
                kind: Kind::BackendPolicy,
                operation: Operation::Update,
                sub_resource: Some("status"),
                name: "nbd",
                old: Some(old),
                new: Some(new),
            };
            review("a", &c, &nobody)
        };
        let before = policy(&[("a", "Pending"), ("b", "Applied")]);
        assert!(status(&before, &policy(&[("a", "Applied"), ("b", "Applied")])).is_ok());
        let e = status(&before, &policy(&[("a", "Pending"), ("b", "Refused")])).unwrap_err();
        assert!(e.contains("only its own node's entry of BackendPolicy nbd"), "{e}");
        assert!(status(&before, &policy(&[("a", "Pending")])).is_err(), "B's entry removed");
        let spec = Change {
            kind: Kind::BackendPolicy,
            operation: Operation::Update,
            sub_resource: None,
            name: "nbd",
            old: Some(&before),
            new: Some(&before),
        };
        assert!(review("a", &spec, &nobody).is_err(), "the spec is the admin's");
    }
}
