//! `deploy/admission-policy/`'s ValidatingAdmissionPolicy (for clusters on
//! Kubernetes 1.30 or later, which this machine's 1.20 API server cannot
//! run) holds agents to their nodes as the controller's webhook does: its
//! CEL (match conditions, variables, validations) is evaluated here as the
//! API server evaluates it — `object`, `oldObject`, `request` with the
//! user's node name in its extra fields, `variables` bound in order — on
//! one table of writes, and it agrees with the webhook's rules on every one
//! but the two its own comments name: removing a gone node's holder (a CEL
//! policy cannot look the Node up: it refuses) and the hashed names of
//! discovered volumes (it cannot hash: the controller checks them).

use kube_cel::KubeCelExt;
use kube_cel::cel::{Context, Program, Value};
use serde_json::{Value as Json, json};
use std::collections::HashMap;
use volagent::kube::admission::rules::{self, Change, Kind, Operation};

const AGENT: &str = "system:serviceaccount:volagent-system:volagent-agent";

struct Policy {
    match_conditions: Vec<String>,
    variables: Vec<(String, String)>,
    validations: Vec<String>,
}

fn policy() -> Policy {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/admission-policy/validating-admission-policy.yaml");
    let text = std::fs::read_to_string(&path).expect("the policy file");
    let docs: Vec<Json> = serde_norway::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("YAML"))
        .collect();
    let p = docs.iter().find(|d| d["kind"] == "ValidatingAdmissionPolicy").expect("the policy");
    let binding =
        docs.iter().find(|d| d["kind"] == "ValidatingAdmissionPolicyBinding").expect("its binding");
    assert_eq!(binding["spec"]["policyName"], p["metadata"]["name"]);
    assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
    assert_eq!(p["spec"]["failurePolicy"], "Fail");
    let strings = |key: &str, field: &str| -> Vec<String> {
        p["spec"][key]
            .as_array()
            .expect(key)
            .iter()
            .map(|v| v[field].as_str().expect(field).to_string())
            .collect()
    };
    Policy {
        match_conditions: strings("matchConditions", "expression"),
        variables: p["spec"]["variables"]
            .as_array()
            .expect("variables")
            .iter()
            .map(|v| {
                (
                    v["name"].as_str().expect("a name").to_string(),
                    v["expression"].as_str().expect("an expression").to_string(),
                )
            })
            .collect(),
        validations: strings("validations", "expression"),
    }
}

fn cel(json: &Json) -> Value {
    kube_cel::cel::to_value(json).expect("JSON as CEL")
}

fn run(expression: &str, ctx: &Context) -> Value {
    let program = Program::compile(expression).unwrap_or_else(|e| panic!("{expression}: {e}"));
    program.execute(ctx).unwrap_or_else(|e| panic!("{expression}: {e}"))
}

impl Policy {
    /// The policy's verdict on a write by `username` (whose token names
    /// `node`): Ok when allowed, else the expression that refused it.
    fn review(
        &self,
        username: &str,
        node: Option<&str>,
        change: &Change<'_>,
    ) -> Result<(), String> {
        let resource = match change.kind {
            Kind::Attachment => "attachments",
            Kind::NodeCleanup => "nodecleanups",
            Kind::NodeLocalVolumes => "nodelocalvolumes",
            Kind::FenceRequest => "fencerequests",
            Kind::BackendPolicy => "backendpolicies",
        };
        let operation = match change.operation {
            Operation::Create => "CREATE",
            Operation::Update => "UPDATE",
            Operation::Delete => "DELETE",
            Operation::Connect => "CONNECT",
        };
        let mut extra = json!({});
        if let Some(n) = node {
            extra["authentication.kubernetes.io/node-name"] = json!([n]);
        }
        let mut request = json!({
            "operation": operation, "name": change.name, "namespace": "",
            "resource": { "group": "volagent.io", "version": "v1alpha1", "resource": resource },
            "userInfo": { "username": username, "groups": ["system:serviceaccounts"], "extra": extra },
        });
        if let Some(sub) = change.sub_resource {
            request["subResource"] = json!(sub);
        }
        let mut ctx = Context::default();
        ctx.register_all();
        ctx.add_variable_from_value("object", change.new.map(cel).unwrap_or(Value::Null));
        ctx.add_variable_from_value("oldObject", change.old.map(cel).unwrap_or(Value::Null));
        ctx.add_variable_from_value("request", cel(&request));
        for m in &self.match_conditions {
            if run(m, &ctx) != Value::Bool(true) {
                return Ok(());
            }
        }
        let mut variables: HashMap<String, Value> = HashMap::new();
        for (name, expression) in &self.variables {
            ctx.add_variable_from_value("variables", variables.clone());
            let v = run(expression, &ctx);
            variables.insert(name.clone(), v);
        }
        ctx.add_variable_from_value("variables", variables);
        for v in &self.validations {
            if run(v, &ctx) != Value::Bool(true) {
                return Err(v.clone());
            }
        }
        Ok(())
    }
}

fn consumer(node: &str, dir: &str) -> Json {
    json!({ "node": node, "podNamespace": "default", "pod": "p", "podUID": format!("uid-{node}"), "mountDir": dir, "readOnly": false, "since": "2026-01-01T00:00:00Z" })
}

fn attachment(consumers: &[Json], clients: &[(&str, i64)]) -> Json {
    let clients: Vec<Json> = clients
        .iter()
        .map(|(n, id)| json!({ "node": n, "id": id, "address": format!("10.0.0.1:0/{id}") }))
        .collect();
    json!({ "apiVersion": "volagent.io/v1alpha1", "kind": "Attachment", "metadata": { "name": "pv1" },
            "spec": { "backend": "rbd", "accessMode": "ReadWriteOnce", "consumers": consumers, "storageClients": clients } })
}

fn cleanup(node: &str, dirs: &[&str]) -> Json {
    let entries: Vec<Json> = dirs.iter().map(|d| json!({ "volume": "pv1", "backend": "rbd", "accessMode": "ReadWriteOnce", "consumer": consumer(node, d), "reason": "NodeGone", "movedAt": "2026-01-01T00:00:01Z" })).collect();
    json!({ "apiVersion": "volagent.io/v1alpha1", "kind": "NodeCleanup", "metadata": { "name": node }, "spec": { "entries": entries } })
}

fn local(node: &str, volumes: &[(&str, &str)], operations: usize) -> Json {
    let volumes: Vec<Json> = volumes.iter().map(|(name, path)| json!({ "name": name, "class": "fast", "path": path, "kind": "File", "capacity": "1Gi" })).collect();
    let ops: Vec<Json> = (0..operations).map(|i| json!({ "volume": format!("v{i}"), "kind": "Delete", "pvUID": "u", "requestedAt": "t" })).collect();
    json!({ "apiVersion": "volagent.io/v1alpha1", "kind": "NodeLocalVolumes", "metadata": { "name": node }, "spec": { "operations": ops }, "status": { "volumes": volumes } })
}

fn fence(requester: &str, node: &str) -> Json {
    json!({ "apiVersion": "volagent.io/v1alpha1", "kind": "FenceRequest", "metadata": { "name": "f" }, "spec": { "volume": "pv1", "requester": requester, "node": node, "address": "10.0.0.1:0/1" } })
}

/// A BackendPolicy whose status has these nodes' entries (node, state).
fn rollout(entries: &[(&str, &str)]) -> Json {
    let nodes: Vec<Json> = entries
        .iter()
        .map(|(node, state)| json!({ "node": node, "serving": "a".repeat(64), "compared": 3, "differences": 0, "state": state, "updatedAt": "2026-01-01T00:00:00Z" }))
        .collect();
    json!({ "apiVersion": "volagent.io/v1alpha1", "kind": "BackendPolicy", "metadata": { "name": "local-pv" },
            "spec": { "backend": "local-pv", "serving": "a".repeat(64), "mode": "Shadow" }, "status": { "nodes": nodes } })
}

/// Why the two may differ on a case (and then must), or None.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Known {
    /// The webhook looks the Node up; the policy cannot and refuses.
    GoneNode,
    /// The webhook hashes discovered names; the policy cannot and allows.
    HashedName,
}

#[test]
fn the_policy_and_the_webhook_agree_but_where_cel_cannot_look() {
    let policy = policy();
    let good_name = volagent::local::pv_name("a", "fast", std::path::Path::new("/mnt/fast/d1"));
    let theirs = volagent::local::pv_name("b", "fast", std::path::Path::new("/mnt/fast/d1"));
    let held_b = attachment(&[consumer("b", "/k/b")], &[("b", 2)]);
    let mut rwx = held_b.clone();
    rwx["spec"]["accessMode"] = json!("ReadWriteMany");
    let mut fin = attachment(&[consumer("a", "/k/a")], &[]);
    fin["metadata"]["finalizers"] = json!(["x"]);
    use Kind::*;
    use Operation::*;
    type Case = (
        &'static str,
        Kind,
        Operation,
        Option<&'static str>,
        &'static str,
        Option<Json>,
        Option<Json>,
        bool,
        Option<Known>,
    );
    // (what, kind, op, subresource, name, old, new, gone nodes: b, known difference)
    let cases: Vec<Case> = vec![
        (
            "own consumer",
            Attachment,
            Create,
            None,
            "pv1",
            None,
            Some(attachment(&[consumer("a", "/k/a")], &[("a", 1)])),
            false,
            None,
        ),
        (
            "B's consumer",
            Attachment,
            Create,
            None,
            "pv1",
            None,
            Some(attachment(&[consumer("b", "/k/b")], &[])),
            false,
            None,
        ),
        (
            "B's client",
            Attachment,
            Create,
            None,
            "pv1",
            None,
            Some(attachment(&[consumer("a", "/k/a")], &[("b", 2)])),
            false,
            None,
        ),
        (
            "join beside B",
            Attachment,
            Update,
            None,
            "pv1",
            Some(held_b.clone()),
            Some(attachment(&[consumer("b", "/k/b"), consumer("a", "/k/a")], &[("b", 2)])),
            false,
            None,
        ),
        (
            "take live B out",
            Attachment,
            Update,
            None,
            "pv1",
            Some(held_b.clone()),
            Some(attachment(&[consumer("a", "/k/a")], &[])),
            false,
            None,
        ),
        (
            "take gone B out",
            Attachment,
            Update,
            None,
            "pv1",
            Some(held_b.clone()),
            Some(attachment(&[consumer("a", "/k/a")], &[])),
            true,
            Some(Known::GoneNode),
        ),
        (
            "rewrite B's holder",
            Attachment,
            Update,
            None,
            "pv1",
            Some(held_b.clone()),
            Some(attachment(&[consumer("b", "/k/x")], &[("b", 2)])),
            true,
            None,
        ),
        (
            "add C",
            Attachment,
            Update,
            None,
            "pv1",
            Some(held_b.clone()),
            Some(attachment(&[consumer("b", "/k/b"), consumer("c", "/k/c")], &[("b", 2)])),
            false,
            None,
        ),
        (
            "change a shared volume",
            Attachment,
            Update,
            None,
            "pv1",
            Some(held_b.clone()),
            Some(rwx),
            false,
            None,
        ),
        (
            "delete B's record",
            Attachment,
            Delete,
            None,
            "pv1",
            Some(held_b.clone()),
            None,
            false,
            None,
        ),
        (
            "delete gone B's record",
            Attachment,
            Delete,
            None,
            "pv1",
            Some(held_b.clone()),
            None,
            true,
            Some(Known::GoneNode),
        ),
        (
            "delete own record",
            Attachment,
            Delete,
            None,
            "pv1",
            Some(attachment(&[consumer("a", "/k/a")], &[])),
            None,
            false,
            None,
        ),
        (
            "add a finalizer",
            Attachment,
            Update,
            None,
            "pv1",
            Some(attachment(&[consumer("a", "/k/a")], &[])),
            Some(fin),
            false,
            None,
        ),
        (
            "work own list off",
            NodeCleanup,
            Update,
            None,
            "a",
            Some(cleanup("a", &["/k/1", "/k/2"])),
            Some(cleanup("a", &["/k/2"])),
            false,
            None,
        ),
        (
            "empty own list",
            NodeCleanup,
            Update,
            None,
            "a",
            Some(cleanup("a", &["/k/1"])),
            Some(cleanup("a", &[])),
            false,
            None,
        ),
        (
            "add to own list",
            NodeCleanup,
            Update,
            None,
            "a",
            Some(cleanup("a", &["/k/1"])),
            Some(cleanup("a", &["/k/1", "/k/2"])),
            false,
            None,
        ),
        (
            "empty B's list",
            NodeCleanup,
            Update,
            None,
            "b",
            Some(cleanup("b", &["/k/1"])),
            Some(cleanup("b", &[])),
            false,
            None,
        ),
        (
            "delete own list",
            NodeCleanup,
            Delete,
            None,
            "a",
            Some(cleanup("a", &[])),
            None,
            false,
            None,
        ),
        (
            "create own local volumes",
            NodeLocalVolumes,
            Create,
            None,
            "a",
            None,
            Some(local("a", &[], 0)),
            false,
            None,
        ),
        (
            "create B's local volumes",
            NodeLocalVolumes,
            Create,
            None,
            "b",
            None,
            Some(local("b", &[], 0)),
            false,
            None,
        ),
        (
            "create with an operation",
            NodeLocalVolumes,
            Create,
            None,
            "a",
            None,
            Some(local("a", &[], 1)),
            false,
            None,
        ),
        (
            "publish own",
            NodeLocalVolumes,
            Update,
            Some("status"),
            "a",
            Some(local("a", &[], 0)),
            Some(local("a", &[(&good_name, "/mnt/fast/d1")], 0)),
            false,
            None,
        ),
        (
            "publish B's",
            NodeLocalVolumes,
            Update,
            Some("status"),
            "b",
            Some(local("b", &[], 0)),
            Some(local("b", &[(&theirs, "/mnt/fast/d1")], 0)),
            false,
            None,
        ),
        (
            "publish a chosen name",
            NodeLocalVolumes,
            Update,
            Some("status"),
            "a",
            Some(local("a", &[], 0)),
            Some(local("a", &[("victim", "/mnt/fast/d1")], 0)),
            false,
            Some(Known::HashedName),
        ),
        (
            "request a wipe",
            NodeLocalVolumes,
            Update,
            None,
            "a",
            Some(local("a", &[], 0)),
            Some(local("a", &[], 1)),
            false,
            None,
        ),
        (
            "delete own local volumes",
            NodeLocalVolumes,
            Delete,
            None,
            "a",
            Some(local("a", &[], 0)),
            None,
            false,
            None,
        ),
        (
            "ask to fence B",
            FenceRequest,
            Create,
            None,
            "f",
            None,
            Some(fence("a", "b")),
            false,
            None,
        ),
        ("ask as B", FenceRequest, Create, None, "f", None, Some(fence("b", "a")), false, None),
        (
            "ask to fence itself",
            FenceRequest,
            Create,
            None,
            "f",
            None,
            Some(fence("a", "a")),
            false,
            None,
        ),
        (
            "delete own request",
            FenceRequest,
            Delete,
            None,
            "f",
            Some(fence("a", "b")),
            None,
            false,
            None,
        ),
        (
            "delete B's request",
            FenceRequest,
            Delete,
            None,
            "f",
            Some(fence("b", "c")),
            None,
            false,
            None,
        ),
        (
            "answer a request",
            FenceRequest,
            Update,
            Some("status"),
            "f",
            Some(fence("a", "b")),
            Some(fence("a", "b")),
            false,
            None,
        ),
        (
            "its own rollout entry, added",
            BackendPolicy,
            Update,
            Some("status"),
            "local-pv",
            Some(rollout(&[("b", "Applied")])),
            Some(rollout(&[("b", "Applied"), ("a", "Pending")])),
            false,
            None,
        ),
        (
            "its own rollout entry, changed",
            BackendPolicy,
            Update,
            Some("status"),
            "local-pv",
            Some(rollout(&[("a", "Pending"), ("b", "Applied")])),
            Some(rollout(&[("a", "Applied"), ("b", "Applied")])),
            false,
            None,
        ),
        (
            "B's rollout entry",
            BackendPolicy,
            Update,
            Some("status"),
            "local-pv",
            Some(rollout(&[("a", "Applied"), ("b", "Applied")])),
            Some(rollout(&[("a", "Applied"), ("b", "Refused")])),
            false,
            None,
        ),
        (
            "B's rollout entry, removed",
            BackendPolicy,
            Update,
            Some("status"),
            "local-pv",
            Some(rollout(&[("a", "Applied"), ("b", "Applied")])),
            Some(rollout(&[("a", "Applied")])),
            false,
            None,
        ),
        (
            "the versions every node runs",
            BackendPolicy,
            Update,
            None,
            "local-pv",
            Some(rollout(&[])),
            Some(rollout(&[])),
            false,
            None,
        ),
        (
            "a rollout",
            BackendPolicy,
            Create,
            None,
            "local-pv",
            None,
            Some(rollout(&[])),
            false,
            None,
        ),
    ];
    let (mut allowed, mut denied) = (0, 0);
    for (what, kind, operation, sub_resource, name, old, new, b_gone, known) in &cases {
        let change = Change {
            kind: *kind,
            operation: *operation,
            sub_resource: *sub_resource,
            name,
            old: old.as_ref(),
            new: new.as_ref(),
        };
        let gone = |n: &str| *b_gone && n == "b";
        let webhook = rules::review("a", &change, &gone);
        let cel = policy.review(AGENT, Some("a"), &change);
        match known {
            None => assert_eq!(
                webhook.is_ok(),
                cel.is_ok(),
                "{what}: webhook {webhook:?}, policy {cel:?}"
            ),
            Some(Known::GoneNode) => assert!(
                webhook.is_ok() && cel.is_err(),
                "{what}: the webhook allows a gone node's take-over, the policy cannot tell: {webhook:?} / {cel:?}"
            ),
            Some(Known::HashedName) => assert!(
                webhook.is_err() && cel.is_ok(),
                "{what}: only the webhook (and the controller) check names: {webhook:?} / {cel:?}"
            ),
        }
        if cel.is_ok() {
            allowed += 1;
        } else {
            denied += 1;
        }
        // Anyone but the agents is left to RBAC; an agent whose token
        // names no node may write nothing.
        assert_eq!(
            policy.review(
                "system:serviceaccount:volagent-controller:volagent-controller",
                None,
                &change
            ),
            Ok(()),
            "{what}: the controller"
        );
        assert!(policy.review(AGENT, None, &change).is_err(), "{what}: an agent with no node");
    }
    assert!(allowed >= 8 && denied >= 15, "the table has both: {allowed} allowed, {denied} denied");
}
