//! A take-over's fence steps. In a cluster, cutting a gone node's storage
//! client off is the controller's: no node holds credentials that may fence
//! another node, so each `blocklist-client` step becomes a request to the
//! controller ([`crate::kube::fencing`]), for a client the volume's record
//! says the gone holder's node had. Standalone (one machine, no other node
//! to contain) the steps run here as planned.

use super::Failure;
use super::node::Node;
use crate::ledger::StorageClient;
use crate::model::{Holder, Step};
use crate::ops::FailureKind;
use std::time::Duration;

/// How long a take-over waits for the controller to fence.
const CONTROLLER_FENCE_WAIT: Duration = Duration::from_secs(90);

/// Have the controller fence what `steps` blocklist, for volume
/// `volume` taken over from `stale`; the steps left to run here.
pub(super) async fn fence_through_controller(
    node: &Node,
    volume: &str,
    steps: Vec<Step>,
    stale: &[Holder],
    clients: &[StorageClient],
) -> Result<Vec<Step>, Failure> {
    let Some(cluster) = &node.cluster else { return Ok(steps) };
    let mut local = Vec::new();
    for step in steps {
        let Step::BlocklistClient(b) = &step else {
            local.push(step);
            continue;
        };
        let recorded = clients
            .iter()
            .find(|c| c.address == b.address && stale.iter().any(|h| h.consumer.node == c.node));
        let Some(client) = recorded else {
            return Err(Failure::new(
                FailureKind::Denied,
                format!(
                    "volume {volume}: the policy asks to fence client {}, which the volume's record holds as no client of a gone holder's node",
                    b.address
                ),
            ));
        };
        cluster
            .fence_client(volume, &client.node, &client.address, CONTROLLER_FENCE_WAIT)
            .await
            .map_err(|why| Failure::new(FailureKind::Failed, format!("volume {volume}: {why}")))?;
    }
    Ok(local)
}
