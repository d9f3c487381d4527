//! The attachment records follow the node's rbd helpers: one started again
//! in place of a dead one is a new Ceph client, and the record must name
//! it, since fencing blocklists the clients a record names (and other
//! nodes place the image's watchers by them).

use super::Agent;
use std::sync::Arc;
use std::time::Duration;

/// How often the helpers are asked for clients they replaced.
const EVERY: Duration = Duration::from_secs(1);

impl Agent {
    /// Runs for the agent's life: each replaced client is written into the
    /// records that name the dead one, retried while the ledger fails.
    pub async fn follow_replaced_clients(self: Arc<Self>) {
        let mut failing = false;
        loop {
            tokio::time::sleep(EVERY).await;
            let helpers = self.node.sys.export_helpers.clone();
            // Files, and a lock a helper's start may hold for seconds: off
            // the runtime's workers.
            let listed = {
                let helpers = helpers.clone();
                super::execute::blocking(move || helpers.replaced_clients()).await
            };
            for replaced in listed.unwrap_or_default() {
                let ((old, old_address), (id, address)) = (&replaced.old, &replaced.new);
                let changed = super::record::replace_storage_client(
                    &self.node,
                    (*old, old_address),
                    (*id, address),
                )
                .await;
                match changed {
                    Ok(volumes) => {
                        failing = false;
                        for volume in volumes {
                            tracing::info!(
                                volume,
                                "its record names the restarted helper's Ceph client {id} ({address}) in place of {old} ({old_address})"
                            );
                        }
                        let helpers = helpers.clone();
                        let _ = super::execute::blocking(move || {
                            helpers.clients_replaced(&replaced.key, &replaced.old);
                        })
                        .await;
                    }
                    Err(f) => {
                        if !failing {
                            tracing::warn!(
                                "the records naming Ceph client {old} cannot be given its successor {id} yet (retried): {}",
                                f.message
                            );
                        }
                        failing = true;
                    }
                }
            }
        }
    }
}
