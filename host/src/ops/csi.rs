//! CSI's node operations on the Flexvolume pipeline. A stage is a consumer
//! at the staging path: fenced, recorded in the ledger, attached by the
//! backend's plan, stashed. A publish is the host's bind of the staging
//! path into the pod's target, stashed as a publication. Unpublish and
//! unstage undo them; every call may be repeated.

use super::execute::blocking;
use super::mount_records::{MountRecord, Publication};
use super::{Agent, Failure, internal};
use crate::model::{AccessMode, Consumer, KeyValue, Volume, VolumeMode};
use crate::sys::Usage;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What a capability asks for: the access, and how the volume is consumed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    pub access: Access,
    /// Empty for block volumes, and when unspecified.
    pub fs_type: String,
    pub mode: VolumeMode,
    pub mount_flags: Vec<String>,
}

/// Why a CSI call failed, in the terms the spec gives codes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CsiError {
    /// A field missing or malformed (INVALID_ARGUMENT).
    Invalid(String),
    /// No such volume where the request says (NOT_FOUND).
    NotFound(String),
    /// The path is in use with another volume or capability (ALREADY_EXISTS).
    Exists(String),
    /// The request does not fit the volume's state (FAILED_PRECONDITION).
    Precondition(String),
    /// The volume cannot be the size asked (OUT_OF_RANGE).
    OutOfRange(String),
    /// The pipeline's own failure (busy → ABORTED, and so on).
    Op(Failure),
}

impl From<Failure> for CsiError {
    fn from(f: Failure) -> CsiError {
        CsiError::Op(f)
    }
}

/// How a CSI access mode is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// The Kubernetes access mode the backend's fence decides on.
    pub mode: AccessMode,
    pub read_only: bool,
    /// At most one publication on the node (ReadWriteOncePod).
    pub single_pod: bool,
}

/// A NodeStageVolume, checked.
#[derive(Debug)]
pub struct StageRequest {
    pub volume_id: String,
    /// Resolved beneath kubelet's root.
    pub staging: PathBuf,
    pub shape: Shape,
    /// The PV's volume attributes, kubelet's own keys removed.
    pub attributes: BTreeMap<String, String>,
    pub secrets: crate::secret::Secrets,
}

/// A NodePublishVolume, checked.
#[derive(Debug, Clone)]
pub struct PublishRequest {
    pub volume_id: String,
    pub staging: PathBuf,
    pub target: PathBuf,
    pub read_only: bool,
    pub access: Access,
    pub mode: VolumeMode,
    /// `<namespace>/<name>` of the pod, when kubelet said.
    pub pod: String,
}

/// What NodeGetVolumeStats answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeStats {
    /// None when the path is not mounted (nothing true to report).
    pub usage: Option<Usage>,
    /// Why the volume is not healthy, if it is not.
    pub abnormal: Option<String>,
}

/// The paths of a CSI stage: the backend's plan stages the volume right at
/// kubelet's staging path (its bind into the "pod" dir, the same path, is
/// then already done). A second mount of the device elsewhere (the agent's
/// own staging dir) would make kubelet refuse to unstage it: kubelet
/// checks that nothing else mounts what its staging path mounts.
fn csi_paths(
    config: &super::NodeConfig,
    backend: &str,
    volume: &str,
    staging: &str,
) -> crate::model::NodePaths {
    crate::model::NodePaths { staging_dir: staging.to_string(), ..config.paths(backend, volume) }
}

/// Where a stage puts its volume: a filesystem is mounted at the staging
/// path itself; a block volume's device node is bound at a file named after
/// the volume inside it (the staging path is kubelet's dir).
fn stage_point(staging: &str, volume_id: &str, mode: VolumeMode) -> String {
    match mode {
        VolumeMode::Filesystem => staging.to_string(),
        VolumeMode::Block => format!("{staging}/{volume_id}"),
    }
}

/// The stash entry of `volume_id`'s stage at `staging`, of either mode.
fn staged_entry(
    stash: &super::mount_records::MountRecords,
    staging: &str,
    volume_id: &str,
) -> Result<Option<MountRecord>, super::mount_records::MountRecordsError> {
    for mode in [VolumeMode::Filesystem, VolumeMode::Block] {
        let point = stage_point(staging, volume_id, mode);
        if let Some(e) = stash.get(&point)?
            && (e.volume.mode == mode || e.volume.name != volume_id)
        {
            return Ok(Some(e));
        }
    }
    Ok(None)
}

/// How a CSI stage is named as a consumer in the ledger.
pub const STAGE_NAMESPACE: &str = "csi";
pub const STAGE_POD: &str = "staged";

fn text(p: &Path) -> String {
    p.display().to_string()
}

impl Agent {
    pub async fn csi_stage(&self, backend: &str, req: StageRequest) -> Result<(), CsiError> {
        self.plugin(backend)?;
        let staging = text(&req.staging);
        let shape = &req.shape;
        let point = stage_point(&staging, &req.volume_id, shape.mode);
        if let Some(entry) =
            super::execute::read_mounts(&self.node, |s| staged_entry(s, &staging, &req.volume_id))?
        {
            let v = &entry.volume;
            if v.name != req.volume_id {
                return Err(CsiError::Exists(format!(
                    "{staging} is the staging path of volume {}, not {}",
                    v.name, req.volume_id
                )));
            }
            if v.backend != backend
                || v.fs_type != shape.fs_type
                || v.mode != shape.mode
                || v.mount_flags != shape.mount_flags
                || v.access_mode != shape.access.mode
                || entry.consumer.read_only != shape.access.read_only
            {
                return Err(CsiError::Exists(format!(
                    "volume {} is staged at {staging} with another capability (backend {}, {}, filesystem {:?}, {}{})",
                    v.name,
                    v.backend,
                    if v.mode == VolumeMode::Block { "block" } else { "mount" },
                    v.fs_type,
                    v.access_mode.name(),
                    if entry.consumer.read_only { ", read-only" } else { "" }
                )));
            }
            if self.mounted(&point).await? {
                return Ok(());
            }
            // A stage cut short: the pipeline finishes it.
        }
        let mut volume = Volume {
            name: req.volume_id.clone(),
            backend: backend.to_string(),
            access_mode: shape.access.mode,
            fs_type: shape.fs_type.clone(),
            mode: shape.mode,
            mount_flags: shape.mount_flags.clone(),
            options: req
                .attributes
                .iter()
                .map(|(k, v)| KeyValue { key: k.clone(), value: v.clone() })
                .collect(),
            secret_keys: req.secrets.keys().cloned().collect(),
        };
        // The stage is the node's one consumer of the volume (its pods come
        // with their publications, which the node settles by itself). The
        // record names it as a pseudo-pod `csi/staged`: records are read by
        // people, and every consumer names a pod.
        let me = Consumer {
            node: self.node.config.node.clone(),
            pod_namespace: STAGE_NAMESPACE.into(),
            pod: STAGE_POD.into(),
            pod_uid: format!("{STAGE_POD}-{}", self.node.config.node),
            mount_dir: point,
            read_only: shape.access.read_only,
            mount_group: None,
        };
        let mut secrets = req.secrets;
        self.connect_storage_cluster(backend, &mut volume, &mut secrets).await?;
        self.attach(
            backend,
            volume,
            me,
            secrets,
            csi_paths(&self.node.config, backend, &req.volume_id, &staging),
        )
        .await?;
        Ok(())
    }

    pub async fn csi_unstage(
        &self,
        backend: &str,
        volume_id: &str,
        staging: &Path,
    ) -> Result<(), CsiError> {
        let dir = text(staging);
        // A publication whose target is no longer mounted does not hold the
        // stage; it is left to its unpublish (or the next start-up), not
        // removed here without the volume's lock.
        for p in self.publications().await? {
            if p.staging == dir && p.volume == volume_id && self.mounted(&p.target).await? {
                return Err(CsiError::Precondition(format!(
                    "volume {volume_id} is still published at {}; unpublish it first",
                    p.target
                )));
            }
        }
        let entry = match super::execute::read_mounts(&self.node, |s| {
            staged_entry(s, &dir, volume_id)
        })? {
            Some(e) if e.volume.name != volume_id => {
                return Err(CsiError::NotFound(format!(
                    "volume {volume_id} is not staged at {dir} (volume {} is)",
                    e.volume.name
                )));
            }
            Some(e) => e,
            None => {
                // No entry: a stage of either mode that this agent lost,
                // rebuilt from the ledger, or nothing to do.
                let mut found = None;
                for mode in [VolumeMode::Filesystem, VolumeMode::Block] {
                    let point = stage_point(&dir, volume_id, mode);
                    if !self.mounted(&point).await? {
                        continue;
                    }
                    match super::record::entry_of_record(&self.node, backend, &point, volume_id)
                        .await?
                    {
                        Some(mut e) => {
                            e.paths = csi_paths(&self.node.config, backend, volume_id, &dir);
                            found = Some(e);
                            break;
                        }
                        None => {
                            return Err(CsiError::Precondition(format!(
                                "{point} is mounted, but this agent has no record of staging volume {volume_id} there; refusing to guess"
                            )));
                        }
                    }
                }
                match found {
                    Some(e) => e,
                    None => return Ok(()),
                }
            }
        };
        let point = entry.consumer.mount_dir.clone();
        self.detach(backend, entry, &point).await?;
        Ok(())
    }

    /// Whether a bind of the volume staged at `staging`, or its unmount,
    /// waits on local disks only: when its filesystem is a local one
    /// ([`crate::exec::runs_locally`]). Not staged (an error to come, or a
    /// staging gone): no.
    fn staged_locally(&self, staging: &str, volume_id: &str) -> bool {
        matches!(staged_entry(&self.node.mount_records, staging, volume_id), Ok(Some(e)) if crate::exec::runs_locally(crate::exec::holding(&e.volume), &[]))
    }

    pub async fn csi_publish(&self, backend: &str, req: PublishRequest) -> Result<(), CsiError> {
        let mut lock = Some(super::node::lock(&self.node, &req.volume_id)?);
        // The checks, the publication's record and the bind in one job:
        // each is a few syscalls, and each trip to another thread costs more.
        let local = self.staged_locally(&text(&req.staging), &req.volume_id);
        let (stash, sys, backend) =
            (self.node.mount_records.clone(), self.node.sys.clone(), backend.to_string());
        super::execute::on_plan_thread(&self.node, &mut lock, local, Arc::default(), move |exec| {
            let Some(entry) = publish_checked(&stash, &sys, &backend, &req)? else { return Ok(()) };
            let (staging, target) = (text(&req.staging), text(&req.target));
            let read_only = req.read_only || entry.consumer.read_only;
            let bind = match entry.volume.mode {
                VolumeMode::Filesystem => crate::policy::Step::BindMount(crate::model::BindMount { source: staging, target: target.clone(), read_only }),
                // The staged device node, bound again at kubelet's target file.
                VolumeMode::Block => crate::policy::Step::PublishBlock(crate::model::PublishBlock {
                    device: crate::policy::BlockSource::Device(entry.consumer.mount_dir.clone()),
                    target: target.clone(),
                    read_only,
                }),
            };
            if let Err(e) = exec.run(&[bind]) {
                if let Err(e) = stash.remove_publication(&target) {
                    tracing::error!(volume = %req.volume_id, "rolling back the publication failed: {e}");
                }
                return Err(CsiError::from(internal(e)));
            }
            Ok(())
        })
        .await
    }

    pub async fn csi_unpublish(&self, volume_id: &str, target: &Path) -> Result<(), CsiError> {
        let target = text(target);
        let found = self.publications().await?.into_iter().find(|p| p.target == target);
        if let Some(p) = &found
            && p.volume != volume_id
        {
            return Err(CsiError::NotFound(format!(
                "{target} publishes volume {}, not {volume_id}",
                p.volume
            )));
        }
        let mut lock = Some(super::node::lock(&self.node, volume_id)?);
        if found.is_none() {
            if self.mounted(&target).await? {
                return Err(CsiError::Precondition(format!(
                    "{target} is mounted, but this agent did not publish volume {volume_id} there; refusing to guess"
                )));
            }
            // Done before (or never done): an empty dir we made may remain.
            let (sys, dir) = (self.node.sys.clone(), PathBuf::from(&target));
            if let Err(e) = blocking(move || sys.mounts.remove_dir(&dir)).await? {
                tracing::debug!(target, "left in place: {e}");
            }
            return Ok(());
        }
        let unmount = crate::policy::Step::Unmount(crate::model::Unmount {
            target: target.clone(),
            force: false,
        });
        let local = found.as_ref().is_some_and(|p| self.staged_locally(&p.staging, volume_id));
        super::execute::run_plan(&self.node, vec![unmount], local, &mut lock).await?;
        let key = target.clone();
        super::execute::write_mounts(&self.node, move |s| s.remove_publication(&key))?;
        Ok(())
    }

    /// Usage of a volume where it is staged or published, and whether it
    /// is healthy there: mounted, and writable unless it was asked read-only.
    pub async fn csi_volume_stats(
        &self,
        volume_id: &str,
        path: &Path,
    ) -> Result<VolumeStats, CsiError> {
        let at = text(path);
        let (read_only, entry) = self.volume_at(volume_id, &at).await?;
        if !self.mounted(&at).await? {
            return Ok(VolumeStats { usage: None, abnormal: Some(format!("{at} is not mounted")) });
        }
        if entry.volume.mode == VolumeMode::Block {
            // A device node: no filesystem of its own to count in.
            return Ok(VolumeStats { usage: None, abnormal: self.backend_condition(&entry, &at)? });
        }
        let (sys, p) = (self.node.sys.clone(), path.to_path_buf());
        let usage = blocking(move || sys.mounts.usage(&p)).await?.map_err(internal)?;
        let abnormal = match (usage.read_only && !read_only)
            .then(|| format!("{at} is read-only though published read-write (the filesystem may have been remounted read-only after an error)"))
        {
            Some(found) => Some(found),
            None => self.backend_condition(&entry, &at)?,
        };
        Ok(VolumeStats { usage: Some(usage), abnormal })
    }

    /// Grow a volume where it is staged or published at `path` (after the
    /// storage under it grew), as its backend's expand plan says; the size
    /// in bytes of what grew (0: nothing on this node needed to).
    pub async fn csi_expand(&self, volume_id: &str, path: &Path) -> Result<u64, CsiError> {
        let at = text(path);
        let (_, entry) = self.volume_at(volume_id, &at).await?;
        let mut lock = Some(super::node::lock(&self.node, volume_id)?);
        if !self.mounted(&at).await? {
            return Err(CsiError::Precondition(format!(
                "{at} is not mounted; stage and publish the volume again"
            )));
        }
        let plugin = self.plugin(&entry.volume.backend)?;
        let consumer = Consumer { mount_dir: at.clone(), ..entry.consumer.clone() };
        let queries = super::plan::queries(&self.node, &plugin, &[]);
        let plan =
            plugin.expand(queries, &entry.volume, &consumer, &entry.paths).map_err(|e| match e
                .is_policy_refusal()
            {
                true => CsiError::Invalid(format!("volume {volume_id}: {e}")),
                false => CsiError::Op(internal(e)),
            })?;
        let local = crate::exec::runs_locally(crate::exec::holding(&entry.volume), &plan);
        let outcome = super::execute::run_plan(&self.node, plan, local, &mut lock).await?;
        Ok(outcome.grown.values().copied().max().unwrap_or(0))
    }

    /// What the backend says of the volume's health at `at`. Its own
    /// failure is reported as the condition (the volume cannot be judged).
    fn backend_condition(&self, entry: &MountRecord, at: &str) -> Result<Option<String>, CsiError> {
        let plugin = self.plugin(&entry.volume.backend)?;
        let consumer = Consumer { mount_dir: at.to_string(), ..entry.consumer.clone() };
        let queries = super::plan::queries(&self.node, &plugin, &[]);
        Ok(match plugin.condition(queries, &entry.volume, &consumer, &entry.paths) {
            Ok(said) => said,
            Err(e) => Some(format!("the backend could not judge the volume: {e}")),
        })
    }

    /// Whether `volume_id` is staged or published at `at`: read-only there,
    /// and its stage.
    async fn volume_at(&self, volume_id: &str, at: &str) -> Result<(bool, MountRecord), CsiError> {
        let found = super::execute::read_mounts(&self.node, |s| {
            if let Some(p) =
                s.publications()?.into_iter().find(|p| p.target == at && p.volume == volume_id)
            {
                return Ok(staged_entry(s, &p.staging, volume_id)?.map(|e| (p.read_only, e)));
            }
            Ok(s.get(at)?.filter(|e| e.volume.name == volume_id).map(|e| (e.consumer.read_only, e)))
        })?;
        found.ok_or_else(|| {
            CsiError::NotFound(format!(
                "volume {volume_id} is neither staged nor published at {at}"
            ))
        })
    }

    pub(crate) async fn publications(&self) -> Result<Vec<Publication>, Failure> {
        super::execute::read_mounts(&self.node, |s| s.publications())
    }

    /// Forget publications whose target is no longer mounted (an agent
    /// killed between recording and binding); the names of those forgotten.
    pub(crate) async fn forget_unmounted_publications(&self) -> Result<Vec<String>, Failure> {
        let mut gone = Vec::new();
        for p in self.publications().await? {
            if !self.mounted(&p.target).await? {
                let target = p.target.clone();
                super::execute::write_mounts(&self.node, move |s| s.remove_publication(&target))?;
                gone.push(p.target);
            }
        }
        Ok(gone)
    }
}

fn stash_failure(e: super::mount_records::MountRecordsError) -> CsiError {
    CsiError::Op(internal(e))
}

fn mounted_now(sys: &crate::sys::Sys, path: &str) -> Result<bool, CsiError> {
    sys.is_mounted(Path::new(path)).map_err(|e| CsiError::Op(internal(e)))
}

/// The checks of a publish, then its publication recorded: the stage of the
/// volume in place, the target free or already this very publication, and a
/// ReadWriteOncePod volume published nowhere else. None: published already.
fn publish_checked(
    stash: &super::mount_records::MountRecords,
    sys: &crate::sys::Sys,
    backend: &str,
    req: &PublishRequest,
) -> Result<Option<MountRecord>, CsiError> {
    let (staging, target) = (text(&req.staging), text(&req.target));
    let volume_id = &req.volume_id;
    let entry = match staged_entry(stash, &staging, volume_id).map_err(stash_failure)? {
        Some(e) if e.volume.name == *volume_id => e,
        Some(e) => {
            return Err(CsiError::Precondition(format!(
                "{staging} is the staging path of volume {}, not {volume_id}",
                e.volume.name
            )));
        }
        None => {
            return Err(CsiError::Precondition(format!(
                "volume {volume_id} is not staged at {staging}; NodeStageVolume comes first"
            )));
        }
    };
    if !mounted_now(sys, &entry.consumer.mount_dir)? {
        return Err(CsiError::Precondition(format!(
            "volume {volume_id}'s staging path {staging} is not mounted; stage it again"
        )));
    }
    if entry.volume.mode != req.mode {
        let m = |mode| if mode == VolumeMode::Block { "block" } else { "mount" };
        return Err(CsiError::Precondition(format!(
            "volume {volume_id} is staged as a {} volume, not {}",
            m(entry.volume.mode),
            m(req.mode)
        )));
    }
    if entry.volume.backend != backend {
        return Err(CsiError::Precondition(format!(
            "volume {volume_id} is staged by backend {}, not {backend}",
            entry.volume.backend
        )));
    }
    let publications = stash.publications().map_err(stash_failure)?;
    // A publication at the target counts while the target is mounted; one
    // whose mount is gone (unmounted behind the agent's back) is replaced.
    if let Some(p) = publications.iter().find(|p| p.target == target)
        && mounted_now(sys, &target)?
    {
        if p.volume != *volume_id || p.staging != staging || p.read_only != req.read_only {
            return Err(CsiError::Exists(format!(
                "{target} is already published{} from {}{}",
                if p.volume != *volume_id {
                    format!(" with volume {}", p.volume)
                } else {
                    String::new()
                },
                p.staging,
                if p.read_only { " read-only" } else { "" }
            )));
        }
        return Ok(None);
    }
    if req.access.single_pod {
        for p in publications.iter().filter(|p| p.volume == *volume_id && p.target != target) {
            if mounted_now(sys, &p.target)? {
                let by =
                    if p.pod.is_empty() { String::new() } else { format!(" by pod {}", p.pod) };
                return Err(CsiError::Precondition(format!(
                    "volume {volume_id} is ReadWriteOncePod and already published at {}{by}",
                    p.target
                )));
            }
        }
    }
    let publication = Publication {
        volume: volume_id.clone(),
        backend: backend.to_string(),
        staging,
        target,
        read_only: req.read_only,
        single_pod: req.access.single_pod,
        pod: req.pod.clone(),
    };
    stash.put_publication(&publication).map_err(stash_failure)?;
    Ok(Some(entry))
}
