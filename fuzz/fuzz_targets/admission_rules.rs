//! An agent's write as the admission webhook reviews it: the old and the
//! new object are whatever a (possibly compromised) node's agent sent. The
//! first byte picks the resource, operation, subresource and whether the
//! other node is gone; the rest is a JSON array `[old, new]`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volagent::kube::admission::rules::{self, Change, Kind, Operation};

fuzz_target!(|data: &[u8]| {
    let Some((&head, rest)) = data.split_first() else { return };
    let kind = [Kind::Attachment, Kind::NodeCleanup, Kind::NodeLocalVolumes, Kind::FenceRequest]
        [usize::from(head & 3)];
    let operation = [Operation::Create, Operation::Update, Operation::Delete, Operation::Connect]
        [usize::from((head >> 2) & 3)];
    let sub_resource = (head & 16 != 0).then_some("status");
    let gone = head & 32 != 0;
    let Ok(values) = serde_json::from_slice::<Vec<serde_json::Value>>(rest) else { return };
    let change = Change {
        kind,
        operation,
        sub_resource,
        name: "node-a",
        old: values.first(),
        new: values.get(1),
    };
    let _ = rules::nodes_to_check("node-a", &change);
    let _ = rules::review("node-a", &change, &|_: &str| gone);
});
