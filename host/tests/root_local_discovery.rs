//! Discovery of local volumes on real parts: tmpfs and ext4-on-loop mount
//! points, a loop device reached through a by-id style link, a file image,
//! and what is not a volume — through `volagent local discover`, as an
//! admin checks a discovery dir. Needs root.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use serde_json::Value;
use std::path::Path;
use std::process::Command;
use volagent_test_support::scratch::RootScratch;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

fn losetup(file: &Path) -> String {
    let out = Command::new("losetup").args(["--find", "--show"]).arg(file).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn discover(node: &str, classes: &[String]) -> Value {
    let mut cmd = Command::new(VOLAGENT);
    cmd.args(["local", "discover", "--node-name", node]);
    for c in classes {
        cmd.args(["--class", c]);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn mount_points_devices_links_and_files_are_found_sized_and_named() {
    let scratch = RootScratch::enter();
    let fast = scratch.path("fast");
    let by_id = scratch.path("by-id");
    for d in [&fast, &by_id] {
        std::fs::create_dir_all(d).unwrap();
    }
    // A tmpfs mount point of 64 MiB.
    std::fs::create_dir(fast.join("tmp1")).unwrap();
    nix::mount::mount(
        Some("tmpfs"),
        &fast.join("tmp1"),
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some("size=64m"),
    )
    .unwrap();
    // An ext4 on a loop device, mounted.
    let img = scratch.image("ext4.img", 48);
    let dev = losetup(&img);
    assert!(Command::new("mkfs.ext4").args(["-q", &dev]).status().unwrap().success());
    std::fs::create_dir(fast.join("ext1")).unwrap();
    nix::mount::mount(
        Some(dev.as_str()),
        &fast.join("ext1"),
        Some("ext4"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .unwrap();
    // A raw block device, through a link as in /dev/disk/by-id.
    let raw_img = scratch.image("raw.img", 20);
    let raw = losetup(&raw_img);
    std::os::unix::fs::symlink(&raw, by_id.join("wwn-0xtest")).unwrap();
    // A file image (development) and things that are not volumes.
    scratch.image("fast/file1.img", 12);
    std::fs::create_dir(fast.join("plain-dir")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", by_id.join("escape")).unwrap();

    let classes = [format!("fast={}", fast.display()), format!("raw={}", by_id.display())];
    let out = discover("node-a", &classes);
    let volumes = out["volumes"].as_array().unwrap();
    let find = |name: &str| {
        volumes
            .iter()
            .find(|v| v["path"].as_str().unwrap().ends_with(name))
            .cloned()
            .unwrap_or(Value::Null)
    };

    let tmp = find("/tmp1");
    assert_eq!(
        (tmp["class"].as_str(), tmp["mode"].as_str(), tmp["fsType"].as_str()),
        (Some("fast"), Some("filesystem"), Some("tmpfs")),
        "{out:#}"
    );
    assert_eq!(tmp["capacity"], "64Mi", "{tmp}");
    let ext = find("/ext1");
    assert_eq!(
        (ext["mode"].as_str(), ext["fsType"].as_str()),
        (Some("filesystem"), Some("ext4")),
        "{out:#}"
    );
    let cap = ext["capacityBytes"].as_u64().unwrap();
    assert!(
        cap > 10 << 20 && cap <= 48 << 20 && cap % (1 << 20) == 0,
        "an ext4 of 48 MiB, less its metadata, in whole MiB: {cap}"
    );
    let blk = find("/wwn-0xtest");
    assert_eq!(blk["mode"], "block", "{out:#}");
    assert_eq!(blk["class"], "raw");
    assert_eq!(blk["device"].as_str(), Some(raw.as_str()), "the link is resolved at discovery");
    assert_eq!(blk["identity"].as_str().unwrap(), format!("loop:{}", raw_img.display()), "{blk}");
    assert_eq!(blk["capacity"], "20Mi");
    let file = find("/file1.img");
    assert_eq!(
        (file["mode"].as_str(), file["capacity"].as_str()),
        (Some("file"), Some("12Mi")),
        "{out:#}"
    );
    assert_eq!(volumes.len(), 4, "{out:#}");

    // Names: deterministic per node, class and path.
    let again = discover("node-a", &classes);
    assert_eq!(again["volumes"], out["volumes"]);
    let other = discover("node-b", &classes);
    assert_ne!(other["volumes"][0]["pvName"], out["volumes"][0]["pvName"]);

    let skipped = out["skipped"].as_array().unwrap();
    let why = |name: &str| {
        skipped
            .iter()
            .find(|s| s["path"].as_str().unwrap().ends_with(name))
            .map(|s| s["why"].to_string())
            .unwrap_or_default()
    };
    assert!(why("/plain-dir").contains("not a mount point"), "{out:#}");
    assert!(why("/escape").contains("not under /dev"), "{out:#}");

    for m in [fast.join("ext1"), fast.join("tmp1")] {
        nix::mount::umount2(&m, nix::mount::MntFlags::empty()).unwrap();
    }
    for d in [dev, raw] {
        assert!(Command::new("losetup").args(["-d", &d]).status().unwrap().success());
    }
}
