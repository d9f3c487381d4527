//! local-pv's provisioner: a claim gets one whole discovered volume — the
//! smallest free one of its class that holds what it asks for, on the node
//! the scheduler chose (a `WaitForFirstConsumer` class) — and gives it back
//! wiped when it is deleted. The host offers the free volumes; this policy
//! chooses among them.
//!
//! Class parameters: `localClass` (the discovery class, the agents'
//! `--local-class` name; default: the StorageClass's own name), `wipe`
//! (how a released volume is wiped: `quick-reset` (default), `blkdiscard`,
//! `zero`, `shred`, `shred:<passes>`), and, as for every CSI driver,
//! `csi.storage.k8s.io/fstype` (what a block device or an image file is
//! formatted as: ext4 or xfs; ext4 when unset).
//!
//! A volume's id is the discovered volume's name (`local-<hash>`), which
//! is all that giving it back needs.

use volagent_guest_sdk::provision::{
    ControllerStep, ControllerStepKind, CreateRequest, LocalKind, LocalVolume, Provision,
    ProvisionError, Provisioner, Segment, Target, parameter,
};
use volagent_guest_sdk::{AccessMode, KeyValue, VolumeMode};

const WIPES: &[&str] = &["quick-reset", "blkdiscard", "zero", "shred"];
const FILESYSTEMS: &[&str] = &["ext4", "xfs"];
const NODE_KEYS: &[&str] = &["kubernetes.io/hostname", "topology.volagent.io/node"];

fn is_local_id(id: &str) -> bool {
    id.strip_prefix("local-").is_some_and(|h| {
        !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    })
}

/// The node a segment names, if it names one.
fn node_of(segment: &Segment) -> Option<&str> {
    segment.iter().find(|(k, _)| NODE_KEYS.contains(&k.as_str())).map(|(_, v)| v.as_str())
}

fn wipe(parameters: &[KeyValue]) -> Result<Option<String>, ProvisionError> {
    let Some(w) = parameter(parameters, "wipe") else { return Ok(None) };
    let known = WIPES.contains(&w)
        || w.strip_prefix("shred:").is_some_and(|n| n.parse::<u32>().is_ok_and(|n| n > 0));
    if !known {
        return Err(ProvisionError::Invalid(format!(
            "wipe {w:?} is not one of {} or shred:<passes>",
            WIPES.join(", ")
        )));
    }
    Ok(Some(w.to_string()))
}

/// Whether volume `v` can serve a claim in `mode` of `required` to `limit`
/// bytes (0: unbounded).
fn fits(v: &LocalVolume, mode: VolumeMode, required: u64, limit: u64) -> bool {
    let kind_ok = match mode {
        VolumeMode::Block => v.kind == LocalKind::Block,
        VolumeMode::Filesystem => true,
    };
    kind_ok && v.capacity_bytes >= required && (limit == 0 || v.capacity_bytes <= limit)
}

impl Provisioner for crate::LocalPv {
    const CONTROLLER_STEPS: &'static [ControllerStepKind] =
        &[ControllerStepKind::TakeVolume, ControllerStepKind::ReleaseVolume];

    fn create(r: CreateRequest) -> Result<Provision, ProvisionError> {
        if let Some(m) = r
            .access_modes
            .iter()
            .find(|m| matches!(m, AccessMode::ReadOnlyMany | AccessMode::ReadWriteMany))
        {
            return Err(ProvisionError::Unsupported(format!(
                "volume {}: a local volume lives on one node; {m:?} is not served",
                r.name
            )));
        }
        if r.source.is_some() {
            return Err(ProvisionError::Unsupported(format!(
                "volume {}: local volumes are not made from snapshots or other volumes",
                r.name
            )));
        }
        let wipe = wipe(&r.parameters)?;
        if r.mode == VolumeMode::Filesystem
            && !r.fs_type.is_empty()
            && !FILESYSTEMS.contains(&r.fs_type.as_str())
        {
            return Err(ProvisionError::Invalid(format!(
                "filesystem {:?} is not one of {}",
                r.fs_type,
                FILESYSTEMS.join(", ")
            )));
        }
        // The scheduler's node first, then any the request allows; within
        // each, the smallest volume that fits (the host lists them so).
        let preferred: Vec<&str> = r.preferred.iter().filter_map(node_of).collect();
        let requisite: Vec<&str> = r.requisite.iter().filter_map(node_of).collect();
        let allowed =
            |v: &LocalVolume| requisite.is_empty() || requisite.contains(&v.node.as_str());
        let rank =
            |v: &LocalVolume| preferred.iter().position(|n| *n == v.node).unwrap_or(usize::MAX);
        let chosen = r
            .local_volumes
            .iter()
            .filter(|v| allowed(v) && fits(v, r.mode, r.required_bytes, r.limit_bytes))
            .min_by_key(|v| (rank(v), v.capacity_bytes));
        let Some(v) = chosen else {
            let where_ = if preferred.is_empty() {
                "on any node".to_string()
            } else {
                format!("on node {}", preferred.join(", "))
            };
            return Err(ProvisionError::Exhausted(format!(
                "no free local volume {where_} holds {} bytes{} ({} free volume(s) offered)",
                r.required_bytes,
                if r.mode == VolumeMode::Block { " as a block device" } else { "" },
                r.local_volumes.len()
            )));
        };
        let attributes: Vec<KeyValue> =
            wipe.map(|w| KeyValue { key: "wipe".into(), value: w }).into_iter().collect();
        Ok(Provision {
            steps: vec![ControllerStep::TakeVolume(v.name.clone())],
            id: v.name.clone(),
            capacity_bytes: v.capacity_bytes,
            attributes,
            topology: vec![vec![("kubernetes.io/hostname".into(), v.node.clone())]],
        })
    }

    fn delete(volume: Target) -> Result<Provision, ProvisionError> {
        if !is_local_id(&volume.id) {
            return Err(ProvisionError::NotFound(format!(
                "{:?} is not a local volume's id",
                volume.id
            )));
        }
        Ok(Provision {
            steps: vec![ControllerStep::ReleaseVolume(volume.id)],
            ..Default::default()
        })
    }

    /// A local volume is as large as its disk: growing within that is
    /// nothing to do, past it impossible.
    fn expand(volume: Target) -> Result<Provision, ProvisionError> {
        Err(ProvisionError::Unsupported(format!(
            "volume {}: a local volume is a whole disk, file or directory and does not grow",
            volume.id
        )))
    }

    fn capacity(
        request: volagent_guest_sdk::provision::CapacityRequest,
    ) -> Result<Option<u64>, ProvisionError> {
        // One claim takes one volume: the largest free one is the most a
        // new volume can get.
        Ok(Some(request.local_volumes.iter().map(|v| v.capacity_bytes).max().unwrap_or(0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volagent_guest_sdk::provision::ContentSource;

    fn volume(name: &str, node: &str, kind: LocalKind, gib: u64) -> LocalVolume {
        LocalVolume { name: name.into(), node: node.into(), kind, capacity_bytes: gib << 30 }
    }

    fn request(required_gib: u64, node: Option<&str>) -> CreateRequest {
        let segment = |n: &str| vec![("kubernetes.io/hostname".to_string(), n.to_string())];
        CreateRequest {
            name: "pvc-1".into(),
            required_bytes: required_gib << 30,
            access_modes: vec![AccessMode::ReadWriteOnce],
            requisite: node.map(segment).into_iter().collect(),
            preferred: node.map(segment).into_iter().collect(),
            local_volumes: vec![
                volume("local-a1", "node-a", LocalKind::File, 1),
                volume("local-a2", "node-a", LocalKind::Block, 4),
                volume("local-b1", "node-b", LocalKind::Filesystem, 2),
                volume("local-a3", "node-a", LocalKind::Block, 8),
            ],
            ..Default::default()
        }
    }

    #[test]
    fn the_smallest_volume_that_fits_on_the_chosen_node_is_taken() {
        let p = crate::LocalPv::create(request(2, Some("node-a"))).unwrap();
        assert_eq!(p.steps, vec![ControllerStep::TakeVolume("local-a2".into())]);
        assert_eq!((p.id.as_str(), p.capacity_bytes), ("local-a2", 4 << 30));
        assert_eq!(p.topology, vec![vec![("kubernetes.io/hostname".into(), "node-a".into())]]);
        // Without a node: the smallest anywhere.
        let p = crate::LocalPv::create(request(2, None)).unwrap();
        assert_eq!(p.id, "local-b1");
        // A block claim takes a block device only.
        let mut block = request(1, Some("node-a"));
        block.mode = VolumeMode::Block;
        assert_eq!(crate::LocalPv::create(block).unwrap().id, "local-a2");
        // A limit below every volume that holds the request: none fits.
        let mut limited = request(2, Some("node-a"));
        limited.limit_bytes = 3 << 30;
        assert!(matches!(crate::LocalPv::create(limited), Err(ProvisionError::Exhausted(_))));
    }

    #[test]
    fn nothing_free_is_exhausted_and_what_is_not_local_is_refused() {
        let mut r = request(16, Some("node-a"));
        let Err(ProvisionError::Exhausted(why)) = crate::LocalPv::create(r.clone()) else {
            panic!("exhausted")
        };
        assert!(why.contains("node-a") && why.contains("4 free"), "{why}");
        r.required_bytes = 1;
        r.access_modes = vec![AccessMode::ReadWriteMany];
        assert!(matches!(crate::LocalPv::create(r.clone()), Err(ProvisionError::Unsupported(_))));
        r.access_modes = vec![AccessMode::ReadWriteOnce];
        r.source = Some(ContentSource::Snapshot("s".into()));
        assert!(matches!(crate::LocalPv::create(r.clone()), Err(ProvisionError::Unsupported(_))));
        r.source = None;
        r.parameters = vec![KeyValue { key: "wipe".into(), value: "burn".into() }];
        assert!(matches!(crate::LocalPv::create(r.clone()), Err(ProvisionError::Invalid(_))));
        r.parameters = vec![KeyValue { key: "wipe".into(), value: "shred:2".into() }];
        let p = crate::LocalPv::create(r).unwrap();
        assert!(p.attributes.iter().any(|kv| kv.key == "wipe" && kv.value == "shred:2"));
    }

    #[test]
    fn a_volume_is_given_back_by_its_id_and_never_grows() {
        let target = |id: &str| Target { id: id.into(), ..Default::default() };
        let p = crate::LocalPv::delete(target("local-0a1b")).unwrap();
        assert_eq!(p.steps, vec![ControllerStep::ReleaseVolume("local-0a1b".into())]);
        for bad in ["pvc-1", "local-", "local-XYZ", "local-../x"] {
            assert!(matches!(
                crate::LocalPv::delete(target(bad)),
                Err(ProvisionError::NotFound(_))
            ));
        }
        assert!(matches!(
            crate::LocalPv::expand(target("local-0a1b")),
            Err(ProvisionError::Unsupported(_))
        ));
    }
}
