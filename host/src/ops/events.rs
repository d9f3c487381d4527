//! Failures told to the cluster as Events on the pod they concern, off the
//! request's path (an Event is for people; the request's answer does not
//! wait for it).

use super::execute::read_mounts;
use super::{Agent, Failure, FailureKind};
use crate::model::Consumer;

/// The pod an Event is about.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl Agent {
    /// `failure` as a warning Event with `reason` on `pod`, when there is
    /// a cluster and the pod is named; a refused request (bad input) is not
    /// told: it names nothing the agent checked.
    pub fn tell_pod(&self, pod: PodRef, reason: &'static str, failure: &Failure) {
        let Some(cluster) = &self.node.cluster else { return };
        if pod.namespace.is_empty()
            || pod.name.is_empty()
            || failure.kind == FailureKind::BadRequest
        {
            return;
        }
        let cluster = cluster.clone();
        let message = format!("volagent on {}: {}", self.node.config.node, failure.message);
        tokio::spawn(async move {
            cluster.pod_event(&pod.namespace, &pod.name, &pod.uid, true, reason, &message).await;
        });
    }

    /// The consumer the stash records at `mount_dir`, if any.
    pub fn consumer_at(&self, mount_dir: &str) -> Option<Consumer> {
        read_mounts(&self.node, |s| s.get(mount_dir)).ok().flatten().map(|e| e.consumer)
    }
}

/// How often the volumes pinning the node's mounter are looked at.
const PINS_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

impl Agent {
    /// Say on the node's mounter pod, as an Event, which mounted volumes
    /// pin it ([`crate::sys::pins`]) each time that changes or the pod is
    /// a new one: a Warning naming them, a Normal one once none does. The
    /// mounter names its pod in its hello (the downward API); one that does
    /// not is not told about. Runs for good.
    pub async fn tell_the_mounter_pod(
        self: std::sync::Arc<Self>,
        mounter: std::sync::Arc<crate::sys::launch::remote::Remote>,
    ) {
        let Some(cluster) = self.node.cluster.clone() else { return };
        // What the mounter's pod (by uid: a new pod is told again) was
        // told; nothing pinned at start is nothing to say.
        let mut told: (String, Vec<String>) = Default::default();
        let mut answered = true;
        loop {
            tokio::time::sleep(PINS_EVERY).await;
            let pinned = match self.pinned_volumes().await {
                Ok(p) => p,
                Err(f) => {
                    tracing::debug!("the volumes pinning the mounter are not known: {}", f.message);
                    continue;
                }
            };
            if pinned.is_empty() && told.1.is_empty() {
                continue;
            }
            let asked = mounter.clone();
            let pod = match super::execute::blocking(move || asked.hello()).await {
                Ok(Ok(hello)) => {
                    answered = true;
                    hello.pod
                }
                Ok(Err(e)) => {
                    if std::mem::replace(&mut answered, false) {
                        tracing::warn!("the node's mounter is not told what pins it: {e}");
                    }
                    continue;
                }
                Err(_) => continue,
            };
            // A mounter without the downward API names no pod: status says it all.
            let Some(pod) = pod else { continue };
            if told.0 == pod.uid && told.1 == pinned {
                continue;
            }
            let node = &self.node.config.node;
            let (warning, reason, message) = if pinned.is_empty() {
                (
                    false,
                    "MounterFree",
                    format!("volagent on {node}: no mounted volume pins this mounter now"),
                )
            } else {
                (
                    true,
                    "MounterPinned",
                    format!(
                        "volagent on {node}: deleting this pod fails the I/O of {} mounted volumes that no new mounter can take over: {}; move their pods off the node first",
                        pinned.len(),
                        pinned.join(", ")
                    ),
                )
            };
            cluster.pod_event(&pod.namespace, &pod.name, &pod.uid, warning, reason, &message).await;
            told = (pod.uid, pinned);
        }
    }
}

impl From<&Consumer> for PodRef {
    fn from(c: &Consumer) -> PodRef {
        PodRef { namespace: c.pod_namespace.clone(), name: c.pod.clone(), uid: c.pod_uid.clone() }
    }
}
