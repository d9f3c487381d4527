//! Checking a provisioner's controller plan before the controller runs it:
//! only the controller steps the backend declared, names that are names,
//! and an id, attributes and topology of bounded size.

use super::{MAX_TEXT, PlanError, bounded, name_ok};
use crate::model::{Capabilities, ControllerStep, DirectoryRef, ImageRef, Provision, Segment};

/// Longest id of a volume or snapshot (CSI: 128 bytes).
pub const MAX_ID: usize = 128;
/// Most attributes a volume may carry.
pub const MAX_ATTRIBUTES: usize = 32;
/// Most topology segments a volume may list, and keys in one.
pub const MAX_SEGMENTS: usize = 16;
/// Most controller steps in one plan.
const MAX_STEPS: usize = 32;
/// Longest directory path in a gluster volume, and most names in one.
const MAX_DIR_PATH: usize = 1024;
const MAX_DIR_DEPTH: usize = 16;
/// RBD features a plan may ask for (krbd maps images with these).
const RBD_FEATURES: &[&str] =
    &["layering", "exclusive-lock", "object-map", "fast-diff", "deep-flatten"];

/// Check `p`, a provisioner's answer; `needs_id` for calls whose answer
/// names what they made (create, snapshot).
pub fn provision(p: &Provision, caps: &Capabilities, needs_id: bool) -> Result<(), PlanError> {
    let whole = |reason: String| PlanError { index: p.steps.len(), step: "provision", reason };
    if p.steps.len() > MAX_STEPS {
        return Err(PlanError {
            index: MAX_STEPS,
            step: "provision",
            reason: format!("the plan has more steps than the {MAX_STEPS} allowed"),
        });
    }
    for (index, step) in p.steps.iter().enumerate() {
        let kind = step.kind();
        let fail = |reason: String| PlanError { index, step: kind.name(), reason };
        if !caps.controller_steps.contains(&kind) {
            return Err(fail(format!(
                "the backend did not declare {} among its steps",
                kind.name()
            )));
        }
        check_step(step).map_err(fail)?;
    }
    if needs_id || !p.id.is_empty() {
        id(&p.id).map_err(whole)?;
    }
    // A volume made of a discovered one is that one: one taken, by its id.
    let taken: Vec<&String> = p
        .steps
        .iter()
        .filter_map(|s| match s {
            ControllerStep::TakeLocalVolume(v) => Some(v),
            _ => None,
        })
        .collect();
    match taken.as_slice() {
        [] => {}
        [v] if **v == p.id => {}
        [v] => {
            return Err(whole(format!(
                "the plan takes local volume {v} but names the volume {:?}: its id must be the taken volume's name",
                p.id
            )));
        }
        _ => return Err(whole("the plan takes more than one local volume".into())),
    }
    if p.attributes.len() > MAX_ATTRIBUTES {
        return Err(whole(format!("more than {MAX_ATTRIBUTES} attributes")));
    }
    for kv in &p.attributes {
        attribute_key(&kv.key).map_err(whole)?;
        bounded(&format!("attribute {}", kv.key), &kv.value, MAX_TEXT).map_err(whole)?;
    }
    if p.topology.len() > MAX_SEGMENTS {
        return Err(whole(format!("more than {MAX_SEGMENTS} topology segments")));
    }
    p.topology.iter().try_for_each(segment).map_err(whole)
}

/// Printable ASCII without spaces, 1 to 128 bytes: it is stored in a PV's
/// volumeHandle and passed back in every call.
fn id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("the plan names no id (set-id)".into());
    }
    bounded("the id", id, MAX_ID)?;
    if !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!("the id {id:?} is not printable ASCII without spaces"));
    }
    Ok(())
}

/// A label-like key: what Kubernetes accepts in volumeAttributes and
/// topology keys, an optional DNS prefix and a name.
fn attribute_key(key: &str) -> Result<(), String> {
    let (prefix, name) = key.rsplit_once('/').unwrap_or(("", key));
    let dns = |s: &str| s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.".contains(&b));
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && prefix.len() <= 253
        && dns(prefix);
    if ok { Ok(()) } else { Err(format!("key {key:?} is not a label key")) }
}

fn segment(s: &Segment) -> Result<(), String> {
    if s.is_empty() || s.len() > MAX_SEGMENTS {
        return Err(format!("a topology segment has {} keys (1 to {MAX_SEGMENTS})", s.len()));
    }
    for (key, value) in s {
        attribute_key(key)?;
        let ok = value.len() <= 63
            && value.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !ok {
            return Err(format!("topology value {value:?} of {key} is not a label value"));
        }
    }
    Ok(())
}

fn image(i: &ImageRef) -> Result<(), String> {
    name_ok("StorageCluster", &i.cluster)?;
    name_ok("pool", &i.pool)?;
    name_ok("image", &i.image)?;
    [&i.cluster, &i.pool, &i.image].iter().try_for_each(|t| bounded("a name", t, 253))
}

/// A directory beneath a gluster volume's root: relative, names joined by
/// '/', none empty, `.` or `..` (nor starting with '.'): the controller
/// never leaves the volume, and the path is safe in a mount source.
fn directory(d: &DirectoryRef) -> Result<(), String> {
    name_ok("StorageCluster", &d.cluster)?;
    name_ok("gluster volume", &d.volume)?;
    [&d.cluster, &d.volume].iter().try_for_each(|t| bounded("a name", t, 253))?;
    bounded("the directory path", &d.path, MAX_DIR_PATH)?;
    let names: Vec<&str> = d.path.split('/').collect();
    if names.len() > MAX_DIR_DEPTH {
        return Err(format!("directory path {:?} has more than {MAX_DIR_DEPTH} names", d.path));
    }
    for name in names {
        name_ok("directory", name)
            .and_then(|()| bounded("a directory name", name, 255))
            .map_err(|e| format!("directory path {:?}: {e}", d.path))?;
    }
    Ok(())
}

fn features(fs: &[String]) -> Result<(), String> {
    for f in fs {
        if !RBD_FEATURES.contains(&f.as_str()) {
            return Err(format!("RBD feature {f:?} is not one of {}", RBD_FEATURES.join(", ")));
        }
    }
    Ok(())
}

fn check_step(step: &ControllerStep) -> Result<(), String> {
    match step {
        ControllerStep::CreateImage(c) => {
            image(&c.image)?;
            if c.size_bytes == 0 {
                return Err("an image of 0 bytes".into());
            }
            if let Some(pool) = &c.data_pool {
                name_ok("data pool", pool)?;
            }
            features(&c.features)
        }
        ControllerStep::DeleteImage(i) => image(i),
        ControllerStep::ResizeImage(r) => {
            image(&r.image)?;
            if r.size_bytes == 0 { Err("a size of 0 bytes".into()) } else { Ok(()) }
        }
        ControllerStep::CreateSnapshot(s) | ControllerStep::DeleteSnapshot(s) => {
            image(&s.image)?;
            name_ok("snapshot", &s.snapshot)
        }
        ControllerStep::CloneImage(c) => {
            image(&c.parent.image)?;
            name_ok("snapshot", &c.parent.snapshot)?;
            name_ok("image", &c.image)?;
            features(&c.features)
        }
        ControllerStep::CreateDirectory(c) => directory(&c.dir),
        ControllerStep::RemoveDirectory(d) => directory(d),
        ControllerStep::SetQuota(q) => {
            directory(&q.dir)?;
            if q.bytes == 0 { Err("a quota of 0 bytes".into()) } else { Ok(()) }
        }
        ControllerStep::TakeLocalVolume(v) | ControllerStep::ReleaseLocalVolume(v) => {
            name_ok("local volume", v)?;
            bounded("a name", v, 253)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ControllerStepKind, CreateDirectory, CreateImage, KeyValue, SetQuota};

    fn caps() -> Capabilities {
        Capabilities {
            steps: vec![],
            device_kinds: vec![],
            filesystems: vec![],
            network_filesystems: vec![],
            path_roots: vec![],
            controller_steps: vec![ControllerStepKind::CreateImage],
        }
    }

    fn good() -> Provision {
        Provision {
            steps: vec![ControllerStep::CreateImage(CreateImage {
                image: ImageRef {
                    cluster: "ceph".into(),
                    pool: "rbd".into(),
                    image: "pvc-1".into(),
                },
                size_bytes: 1 << 30,
                data_pool: None,
                features: vec!["layering".into()],
            })],
            id: "ceph/rbd/pvc-1".into(),
            capacity_bytes: 1 << 30,
            attributes: vec![KeyValue { key: "pool".into(), value: "rbd".into() }],
            topology: vec![vec![("topology.volagent.io/node".into(), "node-a".into())]],
        }
    }

    fn create(p: &mut Provision) -> &mut CreateImage {
        match &mut p.steps[0] {
            ControllerStep::CreateImage(c) => c,
            other => panic!("{other:?}"),
        }
    }

    fn refused(change: impl FnOnce(&mut Provision)) -> String {
        let mut p = good();
        change(&mut p);
        provision(&p, &caps(), true).unwrap_err().to_string()
    }

    #[test]
    fn a_good_plan_passes() {
        provision(&good(), &caps(), true).unwrap();
    }

    #[test]
    fn undeclared_steps_names_and_features_are_refused() {
        assert!(
            refused(|p| p.steps.push(ControllerStep::DeleteImage(ImageRef {
                cluster: "ceph".into(),
                pool: "rbd".into(),
                image: "x".into()
            })))
            .contains("did not declare delete-image")
        );
        for (bad, what) in [("../x", "image"), ("a b", "image"), ("", "image")] {
            let message = refused(|p| create(p).image.image = bad.into());
            assert!(message.contains(what), "{bad:?}: {message}");
        }
        assert!(
            refused(|p| create(p).features = vec!["journaling".into()]).contains("RBD feature")
        );
        assert!(refused(|p| create(p).size_bytes = 0).contains("0 bytes"));
    }

    #[test]
    fn ids_attributes_and_topology_are_bounded() {
        assert!(refused(|p| p.id.clear()).contains("no id"));
        assert!(refused(|p| p.id = "x".repeat(129)).contains("more than the 128"));
        assert!(refused(|p| p.id = "a b".into()).contains("printable"));
        assert!(refused(|p| p.attributes[0].key = "bad key".into()).contains("label key"));
        assert!(refused(|p| p.topology[0][0].1 = "a/b".into()).contains("not a label value"));
        assert!(refused(|p| p.topology.push(Vec::new())).contains("0 keys"));
        let many = (0..40).map(|i| KeyValue { key: format!("k{i}"), value: String::new() });
        assert!(refused(|p| p.attributes.extend(many)).contains("attributes"));
        // A delete's plan needs no id.
        let mut p = good();
        p.id.clear();
        provision(&p, &caps(), false).unwrap();
    }

    #[test]
    fn a_plan_takes_at_most_one_local_volume_and_is_named_after_it() {
        let mut caps = caps();
        caps.controller_steps = ControllerStepKind::ALL.to_vec();
        let take = |v: &str| ControllerStep::TakeLocalVolume(v.into());
        let plan = |steps: Vec<ControllerStep>, id: &str| Provision {
            steps,
            id: id.into(),
            ..Default::default()
        };
        provision(&plan(vec![take("local-1a2b")], "local-1a2b"), &caps, true).unwrap();
        let e = provision(&plan(vec![take("local-1a2b")], "pvc-1"), &caps, true).unwrap_err();
        assert!(e.to_string().contains("must be the taken volume's name"), "{e}");
        let two = plan(vec![take("local-1"), take("local-2")], "local-1");
        assert!(provision(&two, &caps, true).unwrap_err().to_string().contains("more than one"));
        for bad in ["../x", "a/b", "", ".x", "a b"] {
            let e = provision(&plan(vec![take(bad)], bad), &caps, true).unwrap_err();
            assert!(e.to_string().contains("local volume"), "{bad:?}: {e}");
            let release = plan(vec![ControllerStep::ReleaseLocalVolume(bad.into())], "");
            assert!(provision(&release, &caps, false).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn gluster_directories_stay_beneath_their_volume() {
        let mut caps = caps();
        caps.controller_steps = ControllerStepKind::ALL.to_vec();
        let dir = |path: &str| DirectoryRef {
            cluster: "gluster-a".into(),
            volume: "gv0".into(),
            path: path.into(),
        };
        let plan = |step: ControllerStep| Provision {
            steps: vec![step],
            id: "gluster-a.gv0.pvc-1".into(),
            ..Default::default()
        };
        let create = |path: &str| {
            ControllerStep::CreateDirectory(CreateDirectory { dir: dir(path), quota_bytes: 0 })
        };
        for ok in ["pvc-1", "volagent/pvc-1", "a/b_c/d.e"] {
            provision(&plan(create(ok)), &caps, true).unwrap();
            provision(&plan(ControllerStep::RemoveDirectory(dir(ok))), &caps, false).unwrap();
        }
        let too_deep = vec!["d"; 17].join("/");
        let too_long = "d".repeat(256);
        for bad in [
            "",
            "/abs",
            "a/../b",
            "..",
            "./a",
            "a//b",
            "a/",
            "a/.hidden",
            "a b",
            "a,ro",
            "a\n",
            "a:b",
            &too_deep,
            &too_long,
        ] {
            let e = provision(&plan(create(bad)), &caps, true).unwrap_err().to_string();
            assert!(e.contains("create-directory") && e.contains("directory"), "{bad:?}: {e}");
        }
        let mut other = dir("pvc-1");
        other.volume = "../v".into();
        let e = provision(&plan(ControllerStep::RemoveDirectory(other)), &caps, false).unwrap_err();
        assert!(e.to_string().contains("gluster volume"), "{e}");
        let zero = ControllerStep::SetQuota(SetQuota { dir: dir("pvc-1"), bytes: 0 });
        assert!(provision(&plan(zero), &caps, false).unwrap_err().to_string().contains("0 bytes"));
        // Steps the backend did not declare are refused as ever.
        let e = provision(&plan(create("pvc-1")), &super::tests::caps(), true).unwrap_err();
        assert!(e.to_string().contains("did not declare create-directory"), "{e}");
    }
}
