//! A node's records written by the previous release (contract 0.5, when
//! the records were the bindings' types) are read by this one in place,
//! written back and read again with nothing lost.
//! Fixtures: tests/fixtures/records-0.5 (see its README).

use volagent::ledger::Ledger;
use volagent::ledger::embedded::EmbeddedLedger;
use volagent::model::{AccessMode, VolumeMode};
use volagent::ops::mount_records::MountRecords;
use volagent_test_support::workspace;

/// The fixture copied where this test may change it.
fn copy_of_fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    let from = workspace().join("tests/fixtures/records-0.5");
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(from.join("."))
        .arg(dir.path())
        .status()
        .expect("run cp");
    assert!(status.success());
    dir
}

#[test]
fn the_previous_releases_mount_records_are_read_and_kept() {
    let dir = copy_of_fixture();
    let stash_dir = dir.path().join("stash");
    let read = |stash: &MountRecords| {
        let mut all = stash.all().expect("read all entries");
        all.sort_by(|a, b| a.volume.name.cmp(&b.volume.name));
        all
    };
    let stash = MountRecords::open(&stash_dir).expect("open the old stash");
    assert!(stash.quarantined().expect("quarantine").is_empty(), "an old entry was set aside");
    let before = read(&stash);
    assert_eq!(before.len(), 2, "{before:#?}");
    let (block, fs) = (&before[0], &before[1]);
    assert_eq!(block.volume.name, "pv-block");
    assert_eq!(block.volume.mode, VolumeMode::Block);
    assert_eq!(block.volume.access_mode, AccessMode::ReadWriteOncePod);
    assert!(block.consumer.read_only);
    assert_eq!(block.since, None);
    assert_eq!(fs.volume.mount_flags, ["noatime", "discard"]);
    assert_eq!(fs.volume.option("image"), Some("img1"));
    assert_eq!(fs.volume.secret_keys, ["key"]);
    assert_eq!(fs.consumer.mount_group.as_deref(), Some("2000"));
    assert_eq!(fs.paths.discovery_dirs, ["/mnt/disks"]);
    assert_eq!(fs.since.as_deref(), Some("2026-11-26T10:00:00Z"));
    let publications = stash.publications().expect("publications");
    assert_eq!(publications.len(), 1);
    assert!(publications[0].single_pod);
    assert_eq!(publications[0].pod, "apps/db-0");

    // Written back by this release, and read again by a fresh open.
    for entry in &before {
        stash.put(entry).expect("write back");
    }
    drop(stash);
    let again = MountRecords::open(&stash_dir).expect("reopen");
    assert_eq!(read(&again), before);
    assert_eq!(again.publications().expect("publications"), publications);
}

#[tokio::test]
async fn the_previous_releases_ledger_is_read_and_kept() {
    let dir = copy_of_fixture();
    let path = dir.path().join("ledger.redb");
    let ledger = EmbeddedLedger::open(&path, false).expect("open the old ledger");
    let mut records = ledger.list_by_node("node-a").await.expect("list");
    records.sort_by(|a, b| a.0.volume.cmp(&b.0.volume));
    assert_eq!(records.len(), 2, "{records:#?}");
    let (block, fs) = (&records[0].0, &records[1].0);
    assert_eq!(block.access_mode, AccessMode::ReadWriteOncePod);
    assert_eq!(block.holders[0].consumer.pod, "db-0");
    assert_eq!(fs.storage_cluster.as_deref(), Some("ceph-a"));
    assert_eq!(fs.storage_clients[0].id, 4135);
    assert_eq!(fs.holders[0].consumer.mount_group.as_deref(), Some("2000"));
    assert_eq!(fs.holders[0].since, "2026-11-26T10:00:00Z");
    let source = fs.source.as_ref().expect("the volume's source");
    assert_eq!(source.fs_type, "xfs");
    assert_eq!(source.options.get("pool").map(String::as_str), Some("rbd"));

    // Updated by this release (one holder more), and read again.
    let (mut grown, version) = records[1].clone();
    let mut second = grown.holders[0].clone();
    second.consumer.pod = "web-1".into();
    second.consumer.pod_uid = "uid-web-1".into();
    grown.holders.push(second);
    ledger.update(&grown, &version).await.expect("update an old record");
    ledger.flush().expect("flush");
    drop(ledger);
    let reopened = EmbeddedLedger::open(&path, false).expect("reopen");
    let (read, _) = reopened.get("pv-fs").await.expect("get").expect("still there");
    assert_eq!(read, grown);
    let (untouched, _) = reopened.get("pv-block").await.expect("get").expect("still there");
    assert_eq!(&untouched, block);
}
