//! Behaviour every ledger backend must have; run against each backend by
//! its tests (`run_all`). Panics on any deviation.

use super::{Ledger, LedgerError, Record, Version};
use crate::model::{AccessMode, Consumer, Holder};
use std::sync::Arc;

/// A record of `volume` with (node, pod) holders.
pub fn record(volume: &str, holders: &[(&str, &str)]) -> Record {
    Record {
        volume: volume.to_string(),
        backend: "local-pv".to_string(),
        access_mode: AccessMode::ReadWriteOnce,
        storage_cluster: Some("ceph-a".to_string()),
        // Round-trips through every backend, so records keep what a volume is.
        source: Some(super::VolumeSource {
            fs_type: "ext4".to_string(),
            options: [("path".to_string(), format!("/mnt/disks/{volume}.img"))].into(),
        }),
        holders: holders
            .iter()
            .map(|(node, pod)| Holder {
                consumer: Consumer {
                    node: node.to_string(),
                    pod_namespace: "default".to_string(),
                    pod: pod.to_string(),
                    pod_uid: format!("uid-{pod}"),
                    mount_dir: format!(
                        "/var/lib/kubelet/pods/uid-{pod}/volumes/volagent~local-pv/{volume}"
                    ),
                    read_only: false,
                    mount_group: None,
                },
                since: "2026-11-22T08:00:00Z".to_string(),
            })
            .collect(),
        // Round-trips too: how other nodes place the image's watchers.
        storage_clients: holders
            .first()
            .map(|(node, _)| super::StorageClient {
                node: node.to_string(),
                id: 4100,
                address: "10.0.0.7:0/3301".to_string(),
            })
            .into_iter()
            .collect(),
    }
}

pub async fn run_all(ledger: Arc<dyn Ledger>) {
    create_get_update_delete(&*ledger).await;
    stale_versions_conflict(&*ledger).await;
    list_by_node(&*ledger).await;
    racing_creates_have_one_winner(ledger.clone()).await;
    racing_updates_have_one_winner(ledger).await;
}

async fn create_get_update_delete(l: &dyn Ledger) {
    assert!(l.get("pv-a").await.expect("get").is_none());
    let r = record("pv-a", &[("n1", "a")]);
    let v1 = l.create(&r).await.expect("create");
    assert_eq!(l.get("pv-a").await.expect("get"), Some((r.clone(), v1.clone())));
    assert!(matches!(l.create(&r).await, Err(LedgerError::AlreadyExists { .. })));
    let r2 = record("pv-a", &[("n1", "a"), ("n1", "b")]);
    let v2 = l.update(&r2, &v1).await.expect("update");
    assert_ne!(v1, v2);
    assert_eq!(l.get("pv-a").await.expect("get"), Some((r2, v2.clone())));
    l.delete("pv-a", &v2).await.expect("delete");
    assert!(l.get("pv-a").await.expect("get").is_none());
    assert!(matches!(l.delete("pv-a", &v2).await, Err(LedgerError::NotFound { .. })));
    assert!(matches!(l.update(&record("pv-a", &[]), &v2).await, Err(LedgerError::NotFound { .. })));
}

async fn stale_versions_conflict(l: &dyn Ledger) {
    let v1 = l.create(&record("pv-b", &[("n1", "a")])).await.expect("create");
    let v2 = l.update(&record("pv-b", &[("n2", "b")]), &v1).await.expect("update");
    let err = l.update(&record("pv-b", &[("n3", "c")]), &v1).await.expect_err("stale update");
    assert!(err.is_race() && matches!(err, LedgerError::Conflict { .. }), "{err}");
    assert!(matches!(l.delete("pv-b", &v1).await, Err(LedgerError::Conflict { .. })));
    let (now, v) = l.get("pv-b").await.expect("get").expect("still there");
    assert_eq!((now.holders[0].consumer.node.as_str(), v.clone()), ("n2", v2));
    // A re-created record never takes a version a stale reader could hold.
    l.delete("pv-b", &v).await.expect("delete");
    let v_new = l.create(&record("pv-b", &[])).await.expect("create again");
    for stale in [&v1, &v] {
        let err = l
            .update(&record("pv-b", &[("n9", "z")]), stale)
            .await
            .expect_err("stale version of an old incarnation");
        assert!(matches!(err, LedgerError::Conflict { .. }), "{err}");
    }
    l.delete("pv-b", &v_new).await.expect("delete");
}

async fn list_by_node(l: &dyn Ledger) {
    l.create(&record("pv-c", &[("n1", "a"), ("n2", "b")])).await.expect("create");
    l.create(&record("pv-d", &[("n2", "c")])).await.expect("create");
    let names = |v: Vec<(Record, Version)>| {
        let mut n: Vec<String> = v.into_iter().map(|(r, _)| r.volume).collect();
        n.sort();
        n
    };
    assert_eq!(names(l.list_by_node("n1").await.expect("list")), vec!["pv-c"]);
    assert_eq!(names(l.list_by_node("n2").await.expect("list")), vec!["pv-c", "pv-d"]);
    assert!(l.list_by_node("n9").await.expect("list").is_empty());
    for pv in ["pv-c", "pv-d"] {
        let (_, v) = l.get(pv).await.expect("get").expect("there");
        l.delete(pv, &v).await.expect("delete");
    }
}

async fn racing_creates_have_one_winner(l: Arc<dyn Ledger>) {
    for round in 0..20 {
        let volume = format!("pv-race-{round}");
        let tasks: Vec<_> = (0..4)
            .map(|i| {
                let (l, volume) = (l.clone(), volume.clone());
                tokio::spawn(
                    async move { l.create(&record(&volume, &[(&format!("n{i}"), "p")])).await },
                )
            })
            .collect();
        let mut wins = 0;
        for t in tasks {
            match t.await.expect("task") {
                Ok(_) => wins += 1,
                Err(e) => assert!(matches!(e, LedgerError::AlreadyExists { .. }), "{e}"),
            }
        }
        assert_eq!(wins, 1, "round {round}");
        let (_, v) = l.get(&volume).await.expect("get").expect("there");
        l.delete(&volume, &v).await.expect("delete");
    }
}

async fn racing_updates_have_one_winner(l: Arc<dyn Ledger>) {
    let v0 = l.create(&record("pv-cas", &[])).await.expect("create");
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let (l, v0) = (l.clone(), v0.clone());
            tokio::spawn(async move {
                l.update(&record("pv-cas", &[(&format!("n{i}"), "p")]), &v0).await
            })
        })
        .collect();
    let mut wins = 0;
    for t in tasks {
        match t.await.expect("task") {
            Ok(_) => wins += 1,
            Err(e) => assert!(matches!(e, LedgerError::Conflict { .. }), "{e}"),
        }
    }
    assert_eq!(wins, 1);
    let (_, v) = l.get("pv-cas").await.expect("get").expect("there");
    l.delete("pv-cas", &v).await.expect("delete");
}
