//! Which PV may offer which local volume. Nothing a node reports is taken
//! on trust: a discovered volume's name is the one discovery gives its
//! path on that node, a path or a device identity is offered by one PV
//! only, and a PV that says it is a discovered volume must be exactly what
//! its node discovered — an edited PV, or a second PV aliasing a
//! discovered volume's path, is refused. Pure: the controller checks
//! reports with it, and the agent every local PV it mounts.

use super::crds::DiscoveredVolume;

/// What a discovered volume's PV names as its `path`: the device node a
/// link resolved to, or the mount point or file itself.
pub fn offered_path(v: &DiscoveredVolume) -> &str {
    v.device.as_deref().unwrap_or(&v.path)
}

/// Whether `v`, listed in node `node`'s NodeLocalVolumes, carries the name
/// discovery gives its path there.
pub fn named_as_discovered(node: &str, v: &DiscoveredVolume) -> Result<(), String> {
    let expected = crate::local::pv_name(node, &v.class, std::path::Path::new(&v.path));
    if v.name != expected {
        return Err(format!(
            "node {node} reports volume {} at {} of class {}, but on node {node} that volume is {expected}",
            v.name, v.path, v.class
        ));
    }
    Ok(())
}

/// A PV as a local volume's claim to a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer<'a> {
    pub pv: &'a str,
    pub node: &'a str,
    pub path: &'a str,
    pub identity: Option<&'a str>,
}

/// The offer of `new` clashes with `existing` (another PV): the same path
/// on the same node, or the same device identity on any node.
pub fn clash(new: &Offer<'_>, existing: &Offer<'_>) -> Option<String> {
    if new.pv == existing.pv {
        return None;
    }
    if new.node == existing.node && new.path == existing.path {
        return Some(format!(
            "{} on node {} is already offered by PV {}",
            new.path, new.node, existing.pv
        ));
    }
    match (new.identity, existing.identity) {
        (Some(a), Some(b)) if a == b => Some(format!(
            "device {a} is already offered by PV {} (node {})",
            existing.pv, existing.node
        )),
        _ => None,
    }
}

/// Whether PV `pv` (of node `node`, naming `path` and `identity`) may be
/// mounted there, given what that node discovered. A PV that says it was
/// made of a discovered volume (`made_of_discovery`) must be that volume,
/// as discovered; no PV may name a discovered volume's path or device
/// under another name. The reason names both.
pub fn check_mount(
    pv: &str,
    node: &str,
    path: &str,
    identity: Option<&str>,
    made_of_discovery: bool,
    discovered: &[DiscoveredVolume],
) -> Result<(), String> {
    if let Some(d) = discovered.iter().find(|d| {
        d.name != pv
            && (offered_path(d) == path
                || (identity.is_some() && d.identity.as_deref() == identity))
    }) {
        return Err(format!(
            "PersistentVolume {pv} names {path}, which node {node} discovered as local volume {} (its PV is {}): a second PV may not alias it",
            d.path, d.name
        ));
    }
    let Some(d) = discovered.iter().find(|d| d.name == pv) else {
        if made_of_discovery {
            return Err(format!(
                "PersistentVolume {pv} says it is a discovered local volume of node {node}, but node {node} discovered no volume {pv}"
            ));
        }
        return Ok(());
    };
    if offered_path(d) != path || d.identity.as_deref() != identity {
        return Err(format!(
            "PersistentVolume {pv} names {path}{}, but node {node} discovered {pv} as {}{}: the PV was changed",
            identity.map(|i| format!(" ({i})")).unwrap_or_default(),
            offered_path(d),
            d.identity.as_deref().map(|i| format!(" ({i})")).unwrap_or_default(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn discovered(
        node: &str,
        path: &str,
        device: Option<&str>,
        identity: Option<&str>,
    ) -> DiscoveredVolume {
        DiscoveredVolume {
            name: crate::local::pv_name(node, "fast", std::path::Path::new(path)),
            class: "fast".into(),
            path: path.into(),
            kind: if device.is_some() { "Block" } else { "File" }.into(),
            fs_type: None,
            device: device.map(String::from),
            identity: identity.map(String::from),
            capacity: "1Gi".into(),
        }
    }

    #[test]
    fn a_report_names_each_volume_as_its_node_would() {
        let v = discovered("a", "/mnt/fast/d1", None, None);
        assert_eq!(named_as_discovered("a", &v), Ok(()));
        assert!(named_as_discovered("b", &v).unwrap_err().contains("on node b that volume is"));
        let mut chosen = v.clone();
        chosen.name = "pvc-victim".into();
        assert!(named_as_discovered("a", &chosen).is_err());
    }

    #[test]
    fn a_path_or_identity_is_offered_once() {
        let a1 = Offer { pv: "p1", node: "a", path: "/dev/sdb", identity: Some("wwn-1") };
        assert_eq!(clash(&a1, &a1), None, "a PV does not clash with itself");
        let same_path = Offer { pv: "p2", node: "a", path: "/dev/sdb", identity: None };
        assert!(clash(&same_path, &a1).unwrap().contains("already offered by PV p1"));
        let other_node = Offer { pv: "p3", node: "b", path: "/dev/sdb", identity: None };
        assert_eq!(clash(&other_node, &a1), None, "paths are a node's own");
        let same_disk = Offer { pv: "p4", node: "b", path: "/dev/sdc", identity: Some("wwn-1") };
        assert!(clash(&same_disk, &a1).unwrap().contains("device wwn-1"));
    }

    #[test]
    fn a_mounted_pv_is_what_its_node_discovered() {
        let d = discovered("a", "/mnt/fast/link", Some("/dev/loop3"), Some("loop:/img"));
        let list = [d.clone()];
        assert_eq!(check_mount(&d.name, "a", "/dev/loop3", Some("loop:/img"), true, &list), Ok(()));
        // Edited: another path or identity under the discovered name.
        let e =
            check_mount(&d.name, "a", "/dev/loop4", Some("loop:/img"), true, &list).unwrap_err();
        assert!(e.contains("the PV was changed") && e.contains("/dev/loop3"), "{e}");
        assert!(check_mount(&d.name, "a", "/dev/loop3", None, true, &list).is_err());
        // An alias: another PV naming the discovered device, by path or identity.
        let e = check_mount("alias", "a", "/dev/loop3", None, false, &list).unwrap_err();
        assert!(e.contains("alias") && e.contains(&d.name), "{e}");
        assert!(check_mount("alias", "a", "/dev/sdz", Some("loop:/img"), false, &list).is_err());
        // Says it is discovered, but is not.
        assert!(
            check_mount("local-0000", "a", "/mnt/other", None, true, &list)
                .unwrap_err()
                .contains("discovered no volume local-0000")
        );
        // An admin's own PV elsewhere is the admin's business.
        assert_eq!(check_mount("admins", "a", "/mnt/other", None, false, &list), Ok(()));
    }
}
