//! The fence step: the backend's policy decides whether this consumer may
//! hold the volume beside the holders the ledger records — grant, deny,
//! or take over from holders on gone nodes (their fence steps run first).

use super::context::Operation;
use super::execute::run_plan_with;
use super::node::Node;
use super::plan::{ceph_client, node_facts, node_queries};
use super::queries::NodeQueries;
use super::{Failure, internal, takeover};
use crate::ledger::{Record, StorageClient};
use crate::model::{Decision, Holder};
use std::sync::Arc;

/// What the fence step leaves for the record step.
pub(crate) struct Fenced {
    /// The holders as read.
    pub read: Vec<Holder>,
    /// The holders that stay: the read ones less those taken over.
    pub kept: Vec<Holder>,
    /// The volume's storage clients that stay.
    pub clients: Vec<StorageClient>,
    /// What the policy was told, for its plan too.
    pub queries: Arc<NodeQueries>,
}

/// Decide `op`'s consumer against `current` (the record as read); a take-over's
/// fence steps are run (or asked of the controller) before this returns.
pub(crate) async fn decide(
    node: &Node,
    op: &mut Operation,
    current: Option<&Record>,
) -> Result<Fenced, Failure> {
    let read = current.map(|r| r.holders.clone()).unwrap_or_default();
    let mut clients = current.map(|r| r.storage_clients.clone()).unwrap_or_default();
    let nodes = node_facts(node, &read).await?;
    let queries = Arc::new(
        node_queries(node, &op.plugin, &nodes)
            .with_devices(op.devices.clone())
            .with_ceph(ceph_client(&op.volume, &op.secrets))
            .with_known_clients(clients.iter().map(|c| (c.id, c.node.clone())).collect()),
    );
    let decision = op
        .plugin
        .fence(queries.clone(), &op.volume, &op.consumer, &read, &nodes)
        .map_err(internal)?;
    let outcome = match &decision {
        Decision::Grant => "grant",
        Decision::Deny(_) => "deny",
        Decision::TakeOver(_) => "take-over",
    };
    crate::metrics::get().fence(op.backend(), outcome);
    let mut kept = read.clone();
    match decision {
        Decision::Grant => {}
        Decision::Deny(reason) => return Err(Failure::fenced(reason)),
        Decision::TakeOver(take) => {
            let here = takeover::fence_through_controller(
                node,
                &op.volume.name,
                take.fence_steps.clone(),
                &take.stale,
                &clients,
            )
            .await?;
            run_plan_with(node, here, false, &mut op.lock, op.secrets.clone()).await?;
            kept.retain(|h| !take.stale.contains(h));
            // The gone nodes' clients were fenced with them.
            clients.retain(|c| !take.stale.iter().any(|h| h.consumer.node == c.node));
        }
    }
    Ok(Fenced { read, kept, clients, queries })
}
