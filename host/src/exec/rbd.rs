//! rbd images: the choice of transport (the kernel's rbd driver, librbd
//! behind the agent's NBD server, rbd-fuse), mapping and unmapping them, and
//! the Ceph client a step acts as, blocklisting included.

use super::*;

impl Run<'_> {
    pub(super) fn blocklist_client(
        &mut self,
        b: &crate::model::BlocklistClient,
    ) -> Result<(), StepError> {
        let client = self.ceph_client(&b.monitors, &b.user, b.secret_key.as_deref())?;
        tracing::warn!(address = %b.address, monitors = %b.monitors.join(","), "blocklisting a storage client");
        Ok(self.sys.storage.blocklist(&client, &b.address)?)
    }

    /// An RBD image as a block device, by the path the volume's plan asks
    /// for (or, for `auto`, the first the node has): the kernel's rbd
    /// driver; the agent's helper NBD server in front of librbd, reached
    /// through the kernel's nbd device or a userspace client on a loop
    /// device; rbd-fuse's file of the image on a loop device. A device
    /// already there for the image, whichever path made it, is reused.
    pub(super) fn attach_rbd(
        &mut self,
        spec: &RbdSpec,
        read_only: bool,
    ) -> Result<PathBuf, StepError> {
        let key = rbd_key(spec);
        let device = match self.rbd_device(spec, &key)? {
            Some(device) => device,
            None => match self.rbd_path(spec)? {
                RbdAttach::Kernel => self.attach_krbd(spec, read_only)?,
                RbdAttach::Fuse => self.attach_rbd_fuse(&key, spec, read_only)?,
                _ => self.attach_rbd_export(&key, spec, read_only)?,
            },
        };
        // Who the node is to the cluster, for the ledger: other nodes'
        // agents place the image's watchers by it.
        let mut clients: Vec<(u64, String)> =
            self.krbd_mappings(spec)?.into_iter().map(|m| (m.client_id, m.client_addr)).collect();
        clients.extend(
            self.sys
                .export_helpers
                .storage_clients()
                .into_iter()
                .filter(|(k, _, _)| *k == key)
                .map(|(_, id, address)| (id, address)),
        );
        self.outcome.storage_clients.extend(clients);
        Ok(device)
    }

    /// Which path maps `spec` on this node.
    pub(super) fn rbd_path(&self, spec: &RbdSpec) -> Result<RbdAttach, StepError> {
        let image = format!("rbd image {}/{}", spec.pool, spec.image);
        let (kernel, helper, fuse) = (
            || self.sys.krbd.available(),
            || self.sys.export_helpers.rbd_available(),
            || self.sys.rbd_fuse.available(),
        );
        let missing = |what: &str, option: &str| {
            refused(format!(
                "{image}: the volume asks for {what}, which this node does not have; use attach: {option}"
            ))
        };
        match spec.attach {
            RbdAttach::Auto if kernel() => Ok(RbdAttach::Kernel),
            RbdAttach::Auto if helper() => Ok(RbdAttach::Nbd),
            RbdAttach::Auto if fuse() => Ok(RbdAttach::Fuse),
            RbdAttach::Auto => Err(refused(format!(
                "{image}: this node has no way to map it: no kernel rbd driver, no librbd with an NBD client (nbd.ko or /dev/fuse), no rbd-fuse"
            ))),
            RbdAttach::Kernel if !kernel() => {
                Err(missing("the kernel's rbd driver (no rbd module)", "nbd, fuse or auto"))
            }
            RbdAttach::Nbd if !helper() => Err(missing(
                "the agent's NBD server on librbd (librbd, and nbd.ko or /dev/fuse)",
                "kernel, fuse or auto",
            )),
            RbdAttach::Fuse if !fuse() => {
                Err(missing("rbd-fuse (not installed)", "kernel, nbd or auto"))
            }
            chosen => Ok(chosen),
        }
    }

    /// The device already there for `spec` (key `key`), whichever path made it.
    pub(super) fn rbd_device(
        &self,
        spec: &RbdSpec,
        key: &str,
    ) -> Result<Option<PathBuf>, StepError> {
        if let Some(m) = self.krbd_mappings(spec)?.into_iter().next() {
            return Ok(Some(m.device));
        }
        if let Some(device) = self.export_device(key)? {
            return Ok(Some(device));
        }
        Ok(self
            .loops_over(&self.sys.fuse_clients.rbd_fuse_file(key, &spec.image))?
            .into_iter()
            .next())
    }

    /// The agent's kernel mappings of `spec`'s image (none where the kernel
    /// has no rbd driver): one an admin made by hand is never reused or
    /// unmapped.
    pub(super) fn krbd_mappings(
        &self,
        spec: &RbdSpec,
    ) -> Result<Vec<crate::sys::krbd::KernelMapping>, StepError> {
        if !self.sys.krbd.available() {
            return Ok(Vec::new());
        }
        // Monitors that do not resolve now name no mapping that could be found.
        let Ok(monitors) = crate::sys::krbd::kernel_monitors(&spec.monitors.join(",")) else {
            return Ok(Vec::new());
        };
        Ok(self
            .sys
            .krbd
            .mappings_of(&monitors, &spec.pool, &spec.image)?
            .into_iter()
            .filter(|m| m.ours)
            .collect())
    }

    pub(super) fn attach_krbd(
        &mut self,
        spec: &RbdSpec,
        read_only: bool,
    ) -> Result<PathBuf, StepError> {
        let mut client =
            self.ceph_client(&spec.monitors, &spec.user, spec.secret_key.as_deref())?;
        let monitors = crate::sys::krbd::kernel_monitors(&spec.monitors.join(","))
            .map_err(|e| refused(format!("rbd image {}/{}: {e}", spec.pool, spec.image)))?;
        client.monitors = Some(monitors);
        let (mapping, mapped) = self.sys.krbd.map(&client, &spec.pool, &spec.image, read_only)?;
        if mapped {
            self.undo.push(Undo::KrbdUnmap(mapping.id));
        }
        Ok(mapping.device)
    }

    /// rbd-fuse's file of the image on a loop device. rbd-fuse says
    /// nothing of its Ceph client; the watcher that appears when the loop
    /// device opens the image is it.
    pub(super) fn attach_rbd_fuse(
        &mut self,
        key: &str,
        spec: &RbdSpec,
        read_only: bool,
    ) -> Result<PathBuf, StepError> {
        let target = RbdTarget {
            client: self.ceph_client(&spec.monitors, &spec.user, spec.secret_key.as_deref())?,
            pool: spec.pool.clone(),
            image: spec.image.clone(),
        };
        // Best effort: without the lists the client stays unknown (other
        // nodes then deny exclusive mounts of the image: fail closed).
        let watchers = |run: &Self| match run.sys.storage.rbd_watchers(
            &target.client,
            &spec.pool,
            &spec.image,
        ) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(
                    "cannot list the watchers of rbd image {}/{}: {e}",
                    spec.pool,
                    spec.image
                );
                None
            }
        };
        let before = watchers(self);
        if self.sys.rbd_fuse.connect(key, &target, read_only)? {
            self.undo.push(Undo::NbdDisconnect(key.to_string()));
        }
        let device = self
            .sys
            .devices
            .loop_attach(&self.sys.fuse_clients.rbd_fuse_file(key, &spec.image), read_only)?;
        self.undo.push(Undo::Detach(device.clone()));
        let new: Vec<_> = match (before, watchers(self)) {
            (Some(before), Some(after)) => {
                after.into_iter().filter(|w| !before.iter().any(|b| b.id == w.id)).collect()
            }
            _ => Vec::new(),
        };
        match new.as_slice() {
            [w] => self.sys.export_helpers.set_storage_client(
                key,
                u64::try_from(w.id).unwrap_or_default(),
                &w.address,
            )?,
            other => tracing::warn!(
                image = %format!("{}/{}", spec.pool, spec.image),
                "rbd-fuse's Ceph client is not known ({} new watchers): other nodes cannot place it and deny exclusive mounts meanwhile",
                other.len()
            ),
        }
        Ok(device)
    }

    pub(super) fn attach_rbd_export(
        &mut self,
        key: &str,
        spec: &RbdSpec,
        read_only: bool,
    ) -> Result<PathBuf, StepError> {
        let key = key.to_string();
        let target = RbdTarget {
            client: self.ceph_client(&spec.monitors, &spec.user, spec.secret_key.as_deref())?,
            pool: spec.pool.clone(),
            image: spec.image.clone(),
        };
        if self.sys.export_helpers.serve_rbd(&key, &target, read_only)? {
            self.undo.push(Undo::NbdStopServing(key.clone()));
        }
        let (server, kernel) =
            (self.sys.export_helpers.server_address(&key), self.sys.kernel_nbd.available());
        // A second connection keeps requests in flight while librbd
        // completes others.
        self.connect_export(key, &server, "", RBD_CONNECTIONS, kernel, read_only)
    }

    /// How to reach a Ceph cluster as `user`, with the key the volume's
    /// secret holds under `secret_key` (none: the node's own keyring).
    pub(super) fn ceph_client(
        &self,
        monitors: &[String],
        user: &str,
        secret_key: Option<&str>,
    ) -> Result<CephClient, StepError> {
        let key = match secret_key {
            Some(name) => Some(self.secrets.get(name).cloned().ok_or_else(|| {
                refused(format!(
                    "the volume's secret has no value for key {name:?} (kubelet passes a secret's values only on mount)"
                ))
            })?),
            None => None,
        };
        if let Some(secret) = &key {
            secret.ceph_key(secret_key.unwrap_or_default()).map_err(refused)?;
        }
        Ok(CephClient {
            conf: None,
            monitors: Some(monitors.join(",")),
            user: user.to_string(),
            keyring: None,
            key,
        })
    }

    /// Undo what attaching `spec` did, whichever path it took.
    pub(super) fn detach_rbd(&mut self, spec: &RbdSpec, force: bool) -> Result<(), StepError> {
        for m in self.krbd_mappings(spec)? {
            self.sys.krbd.unmap(m.id, force)?;
        }
        let key = rbd_key(spec);
        for device in self.loops_over(&self.sys.fuse_clients.rbd_fuse_file(&key, &spec.image))? {
            self.sys.devices.loop_detach(&device)?;
        }
        self.detach_export(&key)
    }
}

/// The name of an RBD image's helper server and client on this node: one
/// per image of a cluster, whatever volume names it.
pub fn rbd_key(spec: &RbdSpec) -> String {
    use sha2::Digest;
    let mut monitors = spec.monitors.clone();
    monitors.sort();
    let mut h = sha2::Sha256::new();
    h.update(b"rbd\0");
    h.update(monitors.join(",").as_bytes());
    h.update([0]);
    h.update(spec.pool.as_bytes());
    h.update([0]);
    h.update(spec.image.as_bytes());
    format!("export-{}", hex::encode(&h.finalize()[..12]))
}
