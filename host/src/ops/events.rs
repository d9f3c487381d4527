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

impl From<&Consumer> for PodRef {
    fn from(c: &Consumer) -> PodRef {
        PodRef { namespace: c.pod_namespace.clone(), name: c.pod.clone(), uid: c.pod_uid.clone() }
    }
}
