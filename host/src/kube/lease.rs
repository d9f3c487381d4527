//! Leader election on a coordination.k8s.io/v1 Lease: whoever holds an
//! unexpired lease leads; the holder renews it, others take it over only
//! once it has expired, and every write is a compare-and-swap on the
//! Lease's resourceVersion, so two candidates never both win.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ObjectMeta, PostParams};
use std::time::Duration;

pub struct LeaderElector {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
}

impl LeaderElector {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        name: &str,
        identity: &str,
        duration: Duration,
    ) -> LeaderElector {
        LeaderElector {
            api: Api::namespaced(client, namespace),
            name: name.into(),
            identity: identity.into(),
            duration,
        }
    }

    /// Take or renew the lease; true when this candidate leads now.
    pub async fn try_lead(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let spec = |transitions: i32, acquired: Option<MicroTime>| LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.duration.as_secs() as i32),
            acquire_time: acquired.or(Some(MicroTime(now))),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(transitions),
            ..Default::default()
        };
        let Some(current) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(self.name.clone()), ..Default::default() },
                spec: Some(spec(0, None)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let held = current.spec.clone().unwrap_or_default();
        let mine = held.holder_identity.as_deref() == Some(&self.identity);
        let expired = match (held.renew_time.as_ref(), held.lease_duration_seconds) {
            (Some(MicroTime(renewed)), Some(secs)) => {
                *renewed + SignedDuration::from_secs(i64::from(secs)) < now
            }
            _ => true,
        };
        if !mine && !expired {
            return Ok(false);
        }
        let transitions = held.lease_transitions.unwrap_or(0) + i32::from(!mine);
        let acquired = if mine { held.acquire_time.clone() } else { None };
        let mut next = current.clone();
        next.spec = Some(spec(transitions, acquired));
        match self.api.replace(&self.name, &PostParams::default(), &next).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }
}
