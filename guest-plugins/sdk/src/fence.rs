//! The fencing rules every backend shares: Kubernetes access-mode semantics
//! (ReadWriteOnce is per node) and take-over only from provably gone nodes.

use crate::{AccessMode, Consumer, Decision, Holder, NodeFacts, TakeOver, describe, mode_name};

/// The taint that declares a node shut down for good.
pub const OUT_OF_SERVICE_TAINT: &str = "node.kubernetes.io/out-of-service";

/// Facts of `name`; a node the host told us nothing about counts as alive,
/// because a take-over must be proven, never assumed.
pub fn node<'n>(nodes: &'n [NodeFacts], name: &str) -> Option<&'n NodeFacts> {
    nodes.iter().find(|n| n.name == name)
}

/// True only when the node is provably gone: deleted, or tainted out-of-service.
pub fn node_gone(nodes: &[NodeFacts], name: &str) -> bool {
    node(nodes, name).is_some_and(|n| !n.exists || n.out_of_service)
}

/// Does `holder` stand in the way of `requester` under `mode`?
pub fn conflicts(mode: AccessMode, requester: &Consumer, holder: &Consumer) -> bool {
    match mode {
        AccessMode::ReadWriteOnce => holder.node != requester.node,
        AccessMode::ReadWriteOncePod => holder.pod_uid != requester.pod_uid,
        AccessMode::ReadOnlyMany | AccessMode::ReadWriteMany => false,
    }
}

/// Decide under the standard rules, treating the volume as having `mode`
/// (a backend may narrow the volume's declared mode, e.g. to one writer).
///
/// - the same pod asking again is granted (kubelet retries);
/// - ReadOnlyMany grants read-only consumers only;
/// - conflicting holders on gone nodes are taken over, with no fence steps
///   (the backend adds its own); any conflicting holder on a live node denies,
///   and the reason names it.
pub fn standard(
    volume_name: &str,
    mode: AccessMode,
    requester: &Consumer,
    holders: &[Holder],
    nodes: &[NodeFacts],
) -> Decision {
    if mode == AccessMode::ReadOnlyMany && !requester.read_only {
        return Decision::Deny(format!(
            "volume {volume_name} is ReadOnlyMany: {} asked for a read-write mount; mount it read-only",
            describe(requester)
        ));
    }
    let others = holders.iter().filter(|h| {
        !(h.consumer.pod_uid == requester.pod_uid && h.consumer.node == requester.node)
    });
    let (stale, live): (Vec<&Holder>, Vec<&Holder>) = others
        .filter(|h| conflicts(mode, requester, &h.consumer))
        .partition(|h| node_gone(nodes, &h.consumer.node));
    if let Some(holder) = live.first() {
        return Decision::Deny(deny_reason(volume_name, mode, holder, nodes));
    }
    if stale.is_empty() {
        Decision::Grant
    } else {
        Decision::TakeOver(TakeOver {
            stale: stale.into_iter().cloned().collect(),
            fence_steps: Vec::new(),
        })
    }
}

fn deny_reason(
    volume_name: &str,
    mode: AccessMode,
    holder: &Holder,
    nodes: &[NodeFacts],
) -> String {
    let mut reason = format!(
        "volume {volume_name} ({}) is in use by {} since {}",
        mode_name(mode),
        describe(&holder.consumer),
        holder.since
    );
    let node_name = &holder.consumer.node;
    match node(nodes, node_name) {
        Some(n) if !n.ready => reason.push_str(&format!(
            "; node {node_name} is NotReady, but a volume is only taken over from a deleted node or one tainted {OUT_OF_SERVICE_TAINT}"
        )),
        None => reason.push_str(&format!("; nothing is known of node {node_name}, so it is treated as alive")),
        Some(_) => {}
    }
    reason
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{consumer, holder, live_node};

    fn gone(name: &str) -> NodeFacts {
        NodeFacts { name: name.into(), exists: false, ready: false, out_of_service: false }
    }

    #[test]
    fn rwo_is_per_node() {
        let a = consumer("n1", "a");
        let b = consumer("n1", "b");
        let c = consumer("n2", "c");
        let nodes = [live_node("n1"), live_node("n2")];
        let held = [holder(&a)];
        assert_eq!(standard("pv", AccessMode::ReadWriteOnce, &b, &held, &nodes), Decision::Grant);
        let Decision::Deny(reason) = standard("pv", AccessMode::ReadWriteOnce, &c, &held, &nodes)
        else {
            panic!("a pod on another node must be denied")
        };
        assert!(reason.contains("pod default/a on node n1"), "{reason}");
    }

    #[test]
    fn same_pod_again_is_granted_even_for_rwop() {
        let a = consumer("n1", "a");
        assert_eq!(
            standard("pv", AccessMode::ReadWriteOncePod, &a, &[holder(&a)], &[live_node("n1")]),
            Decision::Grant
        );
        let b = consumer("n1", "b");
        assert!(matches!(
            standard("pv", AccessMode::ReadWriteOncePod, &b, &[holder(&a)], &[live_node("n1")]),
            Decision::Deny(_)
        ));
    }

    #[test]
    fn rox_grants_readers_only() {
        let mut r = consumer("n2", "r");
        r.read_only = true;
        let w = consumer("n2", "w");
        let held = [holder(&{
            let mut h = consumer("n1", "h");
            h.read_only = true;
            h
        })];
        assert_eq!(standard("pv", AccessMode::ReadOnlyMany, &r, &held, &[]), Decision::Grant);
        assert!(matches!(
            standard("pv", AccessMode::ReadOnlyMany, &w, &held, &[]),
            Decision::Deny(_)
        ));
    }

    #[test]
    fn rwx_grants_many() {
        let held = [holder(&consumer("n1", "a")), holder(&consumer("n2", "b"))];
        assert_eq!(
            standard("pv", AccessMode::ReadWriteMany, &consumer("n3", "c"), &held, &[]),
            Decision::Grant
        );
    }

    #[test]
    fn takeover_only_from_gone_or_out_of_service_nodes() {
        let c = consumer("n2", "c");
        let held = [holder(&consumer("n1", "a"))];
        // NotReady alone is not proof.
        let not_ready = NodeFacts { ready: false, ..live_node("n1") };
        let Decision::Deny(reason) =
            standard("pv", AccessMode::ReadWriteOnce, &c, &held, &[not_ready])
        else {
            panic!("NotReady must not be taken over")
        };
        assert!(reason.contains("NotReady"), "{reason}");
        // Unknown node: alive.
        assert!(matches!(
            standard("pv", AccessMode::ReadWriteOnce, &c, &held, &[]),
            Decision::Deny(_)
        ));
        for dead in [gone("n1"), NodeFacts { out_of_service: true, ..live_node("n1") }] {
            let Decision::TakeOver(t) =
                standard("pv", AccessMode::ReadWriteOnce, &c, &held, &[dead])
            else {
                panic!("a gone node's holder must be taken over")
            };
            assert_eq!(t.stale, held.to_vec());
            assert!(t.fence_steps.is_empty());
        }
    }

    #[test]
    fn a_live_holder_blocks_takeover_of_a_dead_one() {
        let c = consumer("n3", "c");
        let held = [holder(&consumer("n1", "a")), holder(&consumer("n2", "b"))];
        let d =
            standard("pv", AccessMode::ReadWriteOnce, &c, &held, &[gone("n1"), live_node("n2")]);
        assert!(matches!(d, Decision::Deny(r) if r.contains("node n2")));
    }
}
