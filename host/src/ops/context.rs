//! One operation's context: what the request named, and what each step
//! leaves for the next (the backend's policy, the verified devices, the
//! volume's lock). Flexvolume mounts, CSI stages, unmounts and unstages
//! all run their steps over one of these.

use super::node::{LockGuard, Node, lock};
use super::plan::verified_devices;
use super::{Agent, Failure};
use crate::model::{Consumer, NodePaths, Volume};
use crate::policy::Plugin;
use crate::secret::Secrets;
use std::sync::Arc;

pub(crate) struct Operation {
    pub plugin: Arc<Plugin>,
    pub volume: Volume,
    pub consumer: Consumer,
    /// The volume's secret values: host-side only (the guest sees the keys).
    pub secrets: Arc<Secrets>,
    pub paths: NodePaths,
    /// Block devices the volume's PV names, checked to be them.
    pub devices: Vec<String>,
    /// Taken by [`Operation::lock`]; a step that outlives its request
    /// takes it along ([`super::execute::on_plan_thread`]).
    pub lock: Option<LockGuard>,
}

impl Operation {
    /// An operation on `volume` by `backend`'s policy (refused when no
    /// such backend is loaded).
    pub(crate) fn new(
        agent: &Agent,
        backend: &str,
        volume: Volume,
        consumer: Consumer,
        secrets: Secrets,
        paths: NodePaths,
    ) -> Result<Operation, Failure> {
        let plugin = agent.plugin(backend)?;
        Ok(Operation {
            plugin,
            volume,
            consumer,
            secrets: Arc::new(secrets),
            paths,
            devices: Vec::new(),
            lock: None,
        })
    }

    /// The device step: the devices the volume's PV names, verified.
    pub(crate) async fn verify_devices(&mut self, node: &Node) -> Result<(), Failure> {
        self.devices = verified_devices(&node.sys, &self.volume).await?;
        Ok(())
    }

    /// The lock step: refused while another operation on the volume runs.
    pub(crate) fn lock(&mut self, node: &Node) -> Result<(), Failure> {
        self.lock = Some(lock(node, &self.volume.name)?);
        Ok(())
    }

    /// The backend serving the operation.
    pub(crate) fn backend(&self) -> &str {
        self.plugin.name()
    }
}
