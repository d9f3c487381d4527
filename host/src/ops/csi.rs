//! CSI's node operations on the Flexvolume pipeline. A stage is a consumer
//! at the staging path: fenced, recorded in the ledger, attached by the
//! backend's plan, stashed. A publish is the host's bind of the staging
//! path into the pod's target, stashed as a publication. Unpublish and
//! unstage undo them; every call may be repeated.

use super::stash::{Entry, Publication};
use super::{Agent, Failure, blocking, internal};
use crate::policy::{AccessMode, Consumer, KeyValue, Volume};
use crate::socket::protocol::FailureKind;
use crate::sys::Usage;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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
    pub fs_type: String,
    pub access: Access,
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
fn csi_paths(config: &super::NodeConfig, backend: &str, volume: &str, staging: &str) -> crate::policy::NodePaths {
    crate::policy::NodePaths { staging_dir: staging.to_string(), ..config.paths(backend, volume) }
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
        let key = staging.clone();
        if let Some(entry) = self.stash_op(move |s| s.get(&key)).await? {
            let v = &entry.volume;
            if v.name != req.volume_id {
                return Err(CsiError::Exists(format!("{staging} is the staging path of volume {}, not {}", v.name, req.volume_id)));
            }
            if v.backend != backend || v.fs_type != req.fs_type || v.access_mode != req.access.mode || entry.consumer.read_only != req.access.read_only {
                return Err(CsiError::Exists(format!(
                    "volume {} is staged at {staging} with another capability (backend {}, filesystem {:?}, {}{})",
                    v.name,
                    v.backend,
                    v.fs_type,
                    crate::policy::access_mode_name(v.access_mode),
                    if entry.consumer.read_only { ", read-only" } else { "" }
                )));
            }
            if self.mounted(&staging).await? {
                return Ok(());
            }
            // A stage cut short: the pipeline finishes it.
        }
        let volume = Volume {
            name: req.volume_id.clone(),
            backend: backend.to_string(),
            access_mode: req.access.mode,
            fs_type: req.fs_type.clone(),
            options: req.attributes.iter().map(|(k, v)| KeyValue { key: k.clone(), value: v.clone() }).collect(),
            secret_keys: req.secrets.keys().cloned().collect(),
        };
        // The stage is the node's one consumer of the volume (its pods come
        // with their publications, which the node settles by itself). The
        // record names it as a pseudo-pod `csi/staged`: records are read by
        // people, and every consumer names a pod.
        let me = Consumer {
            node: self.config.node.clone(),
            pod_namespace: STAGE_NAMESPACE.into(),
            pod: STAGE_POD.into(),
            pod_uid: format!("{STAGE_POD}-{}", self.config.node),
            mount_dir: staging.clone(),
            read_only: req.access.read_only,
        };
        self.attach(backend, volume, me, req.secrets, csi_paths(&self.config, backend, &req.volume_id, &staging)).await?;
        Ok(())
    }

    pub async fn csi_unstage(&self, backend: &str, volume_id: &str, staging: &Path) -> Result<(), CsiError> {
        let dir = text(staging);
        // A publication whose target is no longer mounted does not hold the
        // stage; it is left to its unpublish (or the next start-up), not
        // removed here without the volume's lock.
        for p in self.publications().await? {
            if p.staging == dir && p.volume == volume_id && self.mounted(&p.target).await? {
                return Err(CsiError::Precondition(format!("volume {volume_id} is still published at {}; unpublish it first", p.target)));
            }
        }
        let key = dir.clone();
        let entry = match self.stash_op(move |s| s.get(&key)).await? {
            Some(e) if e.volume.name != volume_id => {
                return Err(CsiError::NotFound(format!("volume {volume_id} is not staged at {dir} (volume {} is)", e.volume.name)));
            }
            Some(e) => e,
            None if !self.mounted(&dir).await? => return Ok(()),
            None => match self.entry_of_record(backend, &dir, volume_id).await? {
                Some(mut e) => {
                    e.paths = csi_paths(&self.config, backend, volume_id, &dir);
                    e
                }
                None => {
                    return Err(CsiError::Precondition(format!("{dir} is mounted, but this agent has no record of staging volume {volume_id} there; refusing to guess")));
                }
            },
        };
        self.detach(backend, entry, &dir).await?;
        Ok(())
    }

    pub async fn csi_publish(&self, backend: &str, req: PublishRequest) -> Result<(), CsiError> {
        let (staging, target) = (text(&req.staging), text(&req.target));
        let mut lock = Some(self.lock(&req.volume_id)?);
        // Every check and the publication's record in one trip to a
        // blocking thread: each is a few syscalls, and each trip costs more.
        let (stash, sys, backend_name, r) = (self.stash.clone(), self.sys.clone(), backend.to_string(), req.clone());
        let entry = blocking(move || publish_checked(&stash, &sys, &backend_name, &r)).await??;
        let Some(entry) = entry else { return Ok(()) };
        let bind = crate::policy::Step::BindMount(crate::policy::BindMount {
            source: staging,
            target: target.clone(),
            read_only: req.read_only || entry.consumer.read_only,
        });
        if let Err(f) = self.run_plan(vec![bind], &mut lock).await {
            if f.kind != FailureKind::TimedOut
                && let Err(e) = self.stash_op(move |s| s.remove_publication(&target)).await
            {
                tracing::error!(volume = %req.volume_id, "rolling back the publication failed: {}", e.message);
            }
            return Err(f.into());
        }
        Ok(())
    }

    pub async fn csi_unpublish(&self, volume_id: &str, target: &Path) -> Result<(), CsiError> {
        let target = text(target);
        let found = self.publications().await?.into_iter().find(|p| p.target == target);
        if let Some(p) = &found
            && p.volume != volume_id
        {
            return Err(CsiError::NotFound(format!("{target} publishes volume {}, not {volume_id}", p.volume)));
        }
        let mut lock = Some(self.lock(volume_id)?);
        if found.is_none() {
            if self.mounted(&target).await? {
                return Err(CsiError::Precondition(format!("{target} is mounted, but this agent did not publish volume {volume_id} there; refusing to guess")));
            }
            // Done before (or never done): an empty dir we made may remain.
            let (sys, dir) = (self.sys.clone(), PathBuf::from(&target));
            if let Err(e) = blocking(move || sys.mounts.remove_dir(&dir)).await? {
                tracing::debug!(target, "left in place: {e}");
            }
            return Ok(());
        }
        let unmount = crate::policy::Step::Unmount(crate::policy::Unmount { target: target.clone(), force: false });
        self.run_plan(vec![unmount], &mut lock).await?;
        let key = target.clone();
        self.stash_op(move |s| s.remove_publication(&key)).await?;
        Ok(())
    }

    /// Usage of a volume where it is staged or published, and whether it
    /// is healthy there: mounted, and writable unless it was asked read-only.
    pub async fn csi_volume_stats(&self, volume_id: &str, path: &Path) -> Result<VolumeStats, CsiError> {
        let at = text(path);
        let read_only = self.volume_at(volume_id, &at).await?;
        if !self.mounted(&at).await? {
            return Ok(VolumeStats { usage: None, abnormal: Some(format!("{at} is not mounted")) });
        }
        let (sys, p) = (self.sys.clone(), path.to_path_buf());
        let usage = blocking(move || sys.mounts.usage(&p)).await?.map_err(internal)?;
        let abnormal = (usage.read_only && !read_only)
            .then(|| format!("{at} is read-only though published read-write (the filesystem may have been remounted read-only after an error)"));
        Ok(VolumeStats { usage: Some(usage), abnormal })
    }

    /// Grow the filesystem of a volume staged or published at `path` to its
    /// device's size (after the storage under it grew); the size in bytes.
    pub async fn csi_expand(&self, volume_id: &str, path: &Path) -> Result<u64, CsiError> {
        let at = text(path);
        self.volume_at(volume_id, &at).await?;
        let mut _lock = self.lock(volume_id)?;
        let (sys, p) = (self.sys.clone(), path.to_path_buf());
        let mounted = blocking(move || sys.mount_at(&p)).await?.map_err(internal)?;
        let m = mounted.ok_or_else(|| CsiError::Precondition(format!("{at} is not mounted; stage and publish the volume again")))?;
        if !m.source.starts_with("/dev/") {
            return Err(CsiError::Invalid(format!("volume {volume_id} at {at} is {} from {}, not a filesystem on a block device: nothing to grow here", m.fs_type, m.source)));
        }
        let (sys, device, mount_point, fs) = (self.sys.clone(), PathBuf::from(&m.source), path.to_path_buf(), m.fs_type.clone());
        let size = blocking(move || sys.filesystems.grow_filesystem(&device, &mount_point, &fs)).await?.map_err(|e| match e {
            crate::sys::SysError::Refused { .. } => CsiError::Invalid(format!("volume {volume_id}: {e}")),
            other => CsiError::Op(internal(format!("volume {volume_id}: {other}"))),
        })?;
        Ok(size)
    }

    /// Whether `volume_id` is staged or published at `at`; read-only there?
    async fn volume_at(&self, volume_id: &str, at: &str) -> Result<bool, CsiError> {
        if let Some(p) = self.publications().await?.into_iter().find(|p| p.target == at && p.volume == volume_id) {
            return Ok(p.read_only);
        }
        let key = at.to_string();
        match self.stash_op(move |s| s.get(&key)).await? {
            Some(e) if e.volume.name == volume_id => Ok(e.consumer.read_only),
            _ => Err(CsiError::NotFound(format!("volume {volume_id} is neither staged nor published at {at}"))),
        }
    }

    pub(crate) async fn publications(&self) -> Result<Vec<Publication>, Failure> {
        self.stash_op(|s| s.publications()).await
    }

    /// Forget publications whose target is no longer mounted (an agent
    /// killed between recording and binding); the names of those forgotten.
    pub(crate) async fn forget_unmounted_publications(&self) -> Result<Vec<String>, Failure> {
        let mut gone = Vec::new();
        for p in self.publications().await? {
            if !self.mounted(&p.target).await? {
                let target = p.target.clone();
                self.stash_op(move |s| s.remove_publication(&target)).await?;
                gone.push(p.target);
            }
        }
        Ok(gone)
    }
}

fn stash_failure(e: super::stash::StashError) -> CsiError {
    CsiError::Op(internal(e))
}

fn mounted_now(sys: &crate::sys::Sys, path: &str) -> Result<bool, CsiError> {
    sys.is_mounted(Path::new(path)).map_err(|e| CsiError::Op(internal(e)))
}

/// The checks of a publish, then its publication recorded: the stage of the
/// volume in place, the target free or already this very publication, and a
/// ReadWriteOncePod volume published nowhere else. None: published already.
fn publish_checked(stash: &super::stash::Stash, sys: &crate::sys::Sys, backend: &str, req: &PublishRequest) -> Result<Option<Entry>, CsiError> {
    let (staging, target) = (text(&req.staging), text(&req.target));
    let volume_id = &req.volume_id;
    let entry = match stash.get(&staging).map_err(stash_failure)? {
        Some(e) if e.volume.name == *volume_id => e,
        Some(e) => return Err(CsiError::Precondition(format!("{staging} is the staging path of volume {}, not {volume_id}", e.volume.name))),
        None => return Err(CsiError::Precondition(format!("volume {volume_id} is not staged at {staging}; NodeStageVolume comes first"))),
    };
    if !mounted_now(sys, &staging)? {
        return Err(CsiError::Precondition(format!("volume {volume_id}'s staging path {staging} is not mounted; stage it again")));
    }
    if entry.volume.backend != backend {
        return Err(CsiError::Precondition(format!("volume {volume_id} is staged by backend {}, not {backend}", entry.volume.backend)));
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
                if p.volume != *volume_id { format!(" with volume {}", p.volume) } else { String::new() },
                p.staging,
                if p.read_only { " read-only" } else { "" }
            )));
        }
        return Ok(None);
    }
    if req.access.single_pod {
        for p in publications.iter().filter(|p| p.volume == *volume_id && p.target != target) {
            if mounted_now(sys, &p.target)? {
                let by = if p.pod.is_empty() { String::new() } else { format!(" by pod {}", p.pod) };
                return Err(CsiError::Precondition(format!("volume {volume_id} is ReadWriteOncePod and already published at {}{by}", p.target)));
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
