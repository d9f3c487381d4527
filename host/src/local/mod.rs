//! Local persistent volumes: what the agent discovers under the discovery
//! dirs of each local storage class, and how it is named and sized for the
//! PVs the controller makes of it.

pub mod discovery;

/// One local storage class: the dirs whose entries are its volumes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalClass {
    /// The StorageClass name.
    pub name: String,
    pub dirs: Vec<std::path::PathBuf>,
}

impl std::str::FromStr for LocalClass {
    type Err = String;

    /// `<class>=<dir>[:<dir>…]`, e.g. `fast-disks=/mnt/fast`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, dirs) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected <storage class>=<dir>[:<dir>…]"))?;
        let valid_name = !name.is_empty()
            && name.len() <= 253
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && name.starts_with(|c: char| c.is_ascii_alphanumeric())
            && name.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !valid_name {
            return Err(format!(
                "{name:?} is not a StorageClass name (lowercase letters, digits, '-' and '.')"
            ));
        }
        let dirs: Vec<std::path::PathBuf> =
            dirs.split(':').filter(|d| !d.is_empty()).map(Into::into).collect();
        if dirs.is_empty() || dirs.iter().any(|d| !d.is_absolute()) {
            return Err(format!("class {name}: its dirs must be absolute paths"));
        }
        Ok(LocalClass { name: name.to_string(), dirs })
    }
}

impl discovery::Volume {
    /// What its PV's `path` names: the mount point, the file, or the
    /// device node a link resolved to.
    pub fn data_path(&self) -> &std::path::Path {
        match &self.kind {
            discovery::Kind::Block { device, .. } => device,
            _ => &self.path,
        }
    }

    pub fn kind_name(&self) -> &'static str {
        match self.kind {
            discovery::Kind::Filesystem { .. } => "Filesystem",
            discovery::Kind::Block { .. } => "Block",
            discovery::Kind::File => "File",
        }
    }
}

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A volume's capacity as its PV states it: rounded down to whole GiB above
/// 10 GiB, to whole MiB above 10 MiB (so that a PV never promises bytes the
/// volume lacks, and sizes read as people expect), else exact.
pub fn round_capacity(bytes: u64) -> u64 {
    if bytes > 10 * GIB {
        bytes / GIB * GIB
    } else if bytes > 10 * MIB {
        bytes / MIB * MIB
    } else {
        bytes
    }
}

/// A rounded capacity as a Kubernetes quantity ("12Gi", "512Mi", "4096").
pub fn quantity(bytes: u64) -> String {
    if bytes >= GIB && bytes.is_multiple_of(GIB) {
        format!("{}Gi", bytes / GIB)
    } else if bytes >= MIB && bytes.is_multiple_of(MIB) {
        format!("{}Mi", bytes / MIB)
    } else {
        bytes.to_string()
    }
}

/// The PV name of the volume at `path` of `class` on `node`: the same on
/// every scan and every agent, and another for every other volume.
pub fn pv_name(node: &str, class: &str, path: &std::path::Path) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for part in [node.as_bytes(), class.as_bytes(), path.as_os_str().as_encoded_bytes()] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    format!("local-{}", hex::encode(&h.finalize()[..10]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn capacities_round_down_to_whole_units_by_size() {
        assert_eq!(round_capacity(10 * GIB + 5), 10 * GIB, "above 10 GiB: whole GiB");
        assert_eq!(round_capacity(10 * GIB - 5), 10 * GIB - MIB, "below: whole MiB");
        assert_eq!(round_capacity(10 * GIB + GIB - 1), 10 * GIB);
        assert_eq!(round_capacity(100 * GIB + 123_456_789), 100 * GIB);
        assert_eq!(round_capacity(512 * MIB + 4096), 512 * MIB);
        assert_eq!(round_capacity(10 * MIB), 10 * MIB);
        assert_eq!(round_capacity(4 * MIB + 1), 4 * MIB + 1, "small volumes: exact");
        assert_eq!(quantity(100 * GIB), "100Gi");
        assert_eq!(quantity(512 * MIB), "512Mi");
        assert_eq!(quantity(4 * MIB + 1), "4194305");
        assert_eq!(quantity(0), "0");
    }

    #[test]
    fn pv_names_are_deterministic_and_distinct() {
        let a = pv_name("node-a", "fast", Path::new("/mnt/fast/disk1"));
        assert_eq!(a, pv_name("node-a", "fast", Path::new("/mnt/fast/disk1")));
        assert!(a.starts_with("local-") && a.len() == "local-".len() + 20, "{a}");
        assert_ne!(a, pv_name("node-b", "fast", Path::new("/mnt/fast/disk1")));
        assert_ne!(a, pv_name("node-a", "slow", Path::new("/mnt/fast/disk1")));
        assert_ne!(a, pv_name("node-a", "fast", Path::new("/mnt/fast/disk2")));
        // Lengths are part of the hash: fields cannot run into each other.
        assert_ne!(pv_name("ab", "c", Path::new("/d")), pv_name("a", "bc", Path::new("/d")));
    }

    #[test]
    fn classes_parse_and_bad_ones_are_refused() {
        let c: LocalClass = "fast-disks=/mnt/fast:/mnt/fast2".parse().unwrap();
        assert_eq!(c.name, "fast-disks");
        assert_eq!(c.dirs, vec![Path::new("/mnt/fast"), Path::new("/mnt/fast2")]);
        for bad in ["fast", "=/mnt", "Fast=/mnt", "fast=relative", "fast=", "-x=/mnt"] {
            assert!(bad.parse::<LocalClass>().is_err(), "{bad}");
        }
    }
}
