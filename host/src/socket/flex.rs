//! Kubelet's Flexvolume mount and unmount as the socket serves them:
//! parsed ([`super::flex_request`]), run through `ops`' pipeline, timed,
//! counted, logged in one line ([`super::oplog`]), and a failure told to
//! the pod as an Event.

use super::flex_request::{parse_mount, parse_mount_dir};
use super::oplog::{self, Finished, Op, Subject};
use crate::ops::events::PodRef;
use crate::ops::{Agent, Done, Failure, FailureKind};
use std::collections::BTreeMap;
use std::time::Instant;

fn bad_request(message: String) -> Failure {
    Failure::new(FailureKind::BadRequest, message)
}

/// kubelet's `mount <dir> <options>`.
pub async fn mount(
    agent: &Agent,
    backend: &str,
    mount_dir: &str,
    options: &BTreeMap<String, String>,
) -> Result<Done, Failure> {
    let start = Instant::now();
    let mut subject = Subject::of_options(options);
    let result = mount_parsed(agent, backend, mount_dir, options, &mut subject).await;
    finish(agent, Op::Mount, backend, mount_dir, &subject, start, &result);
    if let Err(f) = &result {
        tell_mount_failed(agent, options, f);
    }
    result
}

/// `subject` learns the volume as soon as it is known, for the log.
async fn mount_parsed(
    agent: &Agent,
    backend: &str,
    mount_dir: &str,
    options: &BTreeMap<String, String>,
    subject: &mut Subject,
) -> Result<Done, Failure> {
    let config = &agent.node.config;
    let dir = parse_mount_dir(&config.kubelet_roots(), backend, mount_dir).map_err(bad_request)?;
    subject.learn_dir(&dir);
    let mut req = parse_mount(&config.node, backend, &dir, options).map_err(bad_request)?;
    agent.define_volume(backend, &mut req).await?;
    subject.volume = Some(req.volume.name.clone());
    agent.mount(backend, req).await
}

/// kubelet's `unmount <dir>`.
pub async fn unmount(agent: &Agent, backend: &str, mount_dir: &str) -> Result<Done, Failure> {
    let start = Instant::now();
    let mut subject = Subject::default();
    let result = unmount_parsed(agent, backend, mount_dir, &mut subject).await;
    finish(agent, Op::Unmount, backend, mount_dir, &subject, start, &result);
    if let Err(f) = &result {
        tell_unmount_failed(agent, mount_dir, f);
    }
    result
}

async fn unmount_parsed(
    agent: &Agent,
    backend: &str,
    mount_dir: &str,
    subject: &mut Subject,
) -> Result<Done, Failure> {
    let dir = parse_mount_dir(&agent.node.config.kubelet_roots(), backend, mount_dir)
        .map_err(bad_request)?;
    subject.learn_dir(&dir);
    let path = dir.dir.display().to_string();
    let Some(entry) = agent.mounted_entry(backend, &dir).await? else {
        // Nothing is there: a retry after success, or never mounted.
        return Ok(Done { message: format!("{path} is not mounted"), device: None });
    };
    let c = &entry.consumer;
    *subject = Subject {
        volume: Some(entry.volume.name.clone()),
        pod: oplog::pod_name(&c.pod_namespace, &c.pod, &c.pod_uid),
    };
    agent.detach(backend, entry, &path).await
}

/// The operation's metric and its log line.
fn finish(
    agent: &Agent,
    op: Op,
    backend: &str,
    mount_dir: &str,
    subject: &Subject,
    start: Instant,
    result: &Result<Done, Failure>,
) {
    let elapsed = start.elapsed();
    crate::metrics::get().operation(
        op.name(),
        oplog::metric_backend(backend, result),
        oplog::result_label(result),
        elapsed,
    );
    let done = Finished { op, node: &agent.node.config.node, backend, mount_dir, subject, elapsed };
    oplog::log(&done, result);
}

/// A failed mount as an Event on its pod, when kubelet named the pod.
pub fn tell_mount_failed(agent: &Agent, options: &BTreeMap<String, String>, f: &Failure) {
    let get = |k: &str| options.get(&format!("kubernetes.io/{k}")).cloned().unwrap_or_default();
    let uid = options
        .get("kubernetes.io/pod.uid")
        .or(options.get("kubernetes.io/pod.UID"))
        .cloned()
        .unwrap_or_default();
    let pod = PodRef { namespace: get("pod.namespace"), name: get("pod.name"), uid };
    let reason = match f.kind {
        FailureKind::Denied if f.fenced => "VolumeFenced",
        FailureKind::Denied => "VolumeRefused",
        _ => "VolumeMountFailed",
    };
    agent.tell_pod(pod, reason, f);
}

/// A failed unmount as an Event on the pod the stash says mounted `mount_dir`.
pub fn tell_unmount_failed(agent: &Agent, mount_dir: &str, f: &Failure) {
    if f.kind == FailureKind::BadRequest {
        return;
    }
    if let Some(consumer) = agent.consumer_at(mount_dir) {
        agent.tell_pod(PodRef::from(&consumer), "VolumeUnmountFailed", f);
    }
}
