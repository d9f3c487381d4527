//! What an operator sees: `volagent status` (table and JSON) against a real
//! agent holding volumes mounted through the installed driver, and the
//! agent's one JSON log line per mount and unmount. Needs root.

use serde_json::Value;
use std::path::Path;
use std::process::Command;
use volagent_test_support::agent::Node;
use volagent_test_support::driver::{assert_failure, assert_success, kubelet_options};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

/// A node whose agent logs JSON (at info, whatever the caller's RUST_LOG).
fn json_logging_node() -> Node {
    let mut node = Node::start(VOLAGENT);
    node.stop_agent();
    std::fs::write(node.log_path("node-a"), b"").expect("empty the first agent's log");
    node.spawn_agent_env("node-a", &[("RUST_LOG", "info".to_string())], &["--log-format", "json"]);
    node
}

/// `volagent status [more] --socket <socket>`: (exit code, stdout, stderr).
fn status(socket: &Path, more: &[&str]) -> (i32, String, String) {
    let out = Command::new(VOLAGENT)
        .arg("status")
        .args(more)
        .arg("--socket")
        .arg(socket)
        .output()
        .expect("run volagent status");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn status_json(node: &Node) -> Value {
    let (code, out, err) = status(&node.socket, &["--json"]);
    assert_eq!(code, 0, "{out}{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("status --json is not JSON ({e}): {out}"))
}

/// A pod as `status --json` lists it: (namespace/name, uid, mount dir).
type Pod = (String, String, String);

/// (volume, its pods) of a `status --json` answer.
fn held(v: &Value) -> Vec<(String, Vec<Pod>)> {
    let s = |v: &Value| v.as_str().unwrap_or_else(|| panic!("not a string: {v}")).to_string();
    v["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|vol| {
            let pods = vol["pods"]
                .as_array()
                .expect("pods")
                .iter()
                .map(|p| {
                    (
                        format!("{}/{}", s(&p["namespace"]), s(&p["name"])),
                        s(&p["uid"]),
                        s(&p["mount_dir"]),
                    )
                })
                .collect();
            (s(&vol["volume"]), pods)
        })
        .collect()
}

/// The agent's operation lines, in order.
fn operation_lines(node: &Node) -> Vec<Value> {
    let text = std::fs::read_to_string(node.log_path("node-a")).expect("agent log");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {l}"))
        })
        .collect();
    let ops: Vec<Value> = lines.iter().filter(|l| l.get("op").is_some()).cloned().collect();
    assert!(ops.iter().all(|l| l["target"] == "volagent::operation"), "{ops:?}");
    ops
}

/// An operation line as expected: op, volume, pod, outcome, mount dir.
type Expected<'a> = (&'a str, Option<&'a str>, Option<&'a str>, &'a str, String);

#[test]
fn status_lists_the_held_volumes_and_their_pods_and_every_operation_is_one_log_line() {
    let node = json_logging_node();
    let (img1, img2) = (node.image("vol1.img", 64), node.image("vol2.img", 64));
    let (a, c, b) = (
        node.mount_dir("uid-a", "pv1"),
        node.mount_dir("uid-c", "pv1"),
        node.mount_dir("uid-b", "pv2"),
    );
    let mut expected: Vec<Expected> = Vec::new();

    assert_success(&node.mount(&a, &kubelet_options("pv1", "pod-a", "uid-a", "ext4", &img1)));
    expected.push(("mount", Some("pv1"), Some("default/pod-a"), "ok", a.clone()));
    let mut read_only = kubelet_options("pv1", "pod-c", "uid-c", "ext4", &img1);
    read_only["kubernetes.io/readwrite"] = Value::from("ro");
    assert_success(&node.mount(&c, &read_only));
    expected.push(("mount", Some("pv1"), Some("default/pod-c"), "ok", c.clone()));
    assert_success(&node.mount(&b, &kubelet_options("pv2", "pod-b", "uid-b", "ext4", &img2)));
    expected.push(("mount", Some("pv2"), Some("default/pod-b"), "ok", b.clone()));
    // Failures are logged too: a dir outside kubelet's root (nothing known
    // but the pod), and a volume the policy's fence denies.
    let outside = "/etc/volagent-test";
    assert_failure(
        &node.mount(outside, &kubelet_options("pv3", "pod-d", "uid-d", "ext4", &img2)),
        "is not under the kubelet root",
    );
    expected.push(("mount", None, Some("default/pod-d"), "bad_request", outside.to_string()));
    let d = node.mount_dir("uid-d", "pv3");
    let mut elsewhere =
        kubelet_options("pv3", "pod-d", "uid-d", "ext4", &node.image("vol3.img", 16));
    elsewhere["node"] = Value::from("node-b");
    assert_failure(&node.mount(&d, &elsewhere), "lives on node node-b");
    expected.push(("mount", Some("pv3"), Some("default/pod-d"), "denied", d.clone()));

    // The table: one row per pod, the device the staging dir's.
    let (code, table, err) = status(&node.socket, &[]);
    assert_eq!(code, 0, "{table}{err}");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines[0], "node node-a holds 2 volumes", "{table}");
    assert!(lines[1].starts_with("BACKEND") && lines[1].contains("MOUNT DIR"), "{table}");
    // The volumes' rows end where the next section (CSI drivers) starts.
    let rows: Vec<Vec<&str>> = lines[2..]
        .iter()
        .take_while(|l| !l.is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert!(
        table.contains("CSI drivers: 2") && table.contains("local-pv.csi.volagent.io"),
        "{table}"
    );
    let cells = |r: &Vec<&str>| {
        (
            r[0].to_string(),
            r[1].to_string(),
            r[2].to_string(),
            r[4].to_string(),
            r[5].to_string(),
            r[6].to_string(),
            r[8].to_string(),
        )
    };
    let got: Vec<_> = rows.iter().map(cells).collect();
    let row = |vol: &str, pod: &str, mode: &str, dir: &str| {
        (
            "local-pv".to_string(),
            vol.to_string(),
            "ReadWriteOnce".to_string(),
            format!("default/{pod}"),
            pod.replace("pod-", "uid-"),
            mode.to_string(),
            dir.to_string(),
        )
    };
    assert_eq!(
        got,
        [
            row("pv1", "pod-a", "rw", &a),
            row("pv1", "pod-c", "ro", &c),
            row("pv2", "pod-b", "rw", &b)
        ],
        "{table}"
    );
    assert!(rows.iter().all(|r| r[3].starts_with("/dev/loop")), "{table}");
    assert_eq!(rows[0][3], rows[1][3], "one device for pv1's pods: {table}");
    assert_ne!(rows[0][3], rows[2][3], "{table}");
    for r in &rows {
        humantime::parse_rfc3339(r[7]).unwrap_or_else(|e| panic!("since {:?}: {e}", r[7]));
    }

    // The JSON: the same, with the staging dirs.
    let v = status_json(&node);
    assert_eq!(v["node"], "node-a");
    assert_eq!(v["volumes_left_out"], 0);
    let pod =
        |p: &str, dir: &str| (format!("default/{p}"), p.replace("pod-", "uid-"), dir.to_string());
    assert_eq!(
        held(&v),
        [
            ("pv1".to_string(), vec![pod("pod-a", &a), pod("pod-c", &c)]),
            ("pv2".to_string(), vec![pod("pod-b", &b)])
        ]
    );
    for vol in v["volumes"].as_array().expect("volumes") {
        assert_eq!(vol["backend"], "local-pv");
        assert_eq!(vol["access_mode"], "ReadWriteOnce");
        let staging = vol["staging_dir"].as_str().expect("staging dir");
        assert!(
            staging.ends_with(&format!(
                "/kubelet/plugins/volagent/local-pv/mounts/{}",
                vol["volume"].as_str().unwrap_or_default()
            )),
            "{vol}"
        );
        assert!(
            node.scratch.mounts().iter().any(|m| m == Path::new(staging)),
            "{staging} is mounted"
        );
        assert!(vol["device"].as_str().is_some_and(|d| d.starts_with("/dev/loop")), "{vol}");
    }
    assert_eq!(v["volumes"][0]["pods"][1]["read_only"], true);

    // Unmounted, a volume is gone; a volume keeps its other pods.
    assert_success(&node.driver(&["unmount", &b]));
    expected.push(("unmount", Some("pv2"), Some("default/pod-b"), "ok", b.clone()));
    assert_eq!(
        held(&status_json(&node)),
        [("pv1".to_string(), vec![pod("pod-a", &a), pod("pod-c", &c)])]
    );
    assert_success(&node.driver(&["unmount", &a]));
    expected.push(("unmount", Some("pv1"), Some("default/pod-a"), "ok", a.clone()));
    assert_eq!(held(&status_json(&node)), [("pv1".to_string(), vec![pod("pod-c", &c)])]);
    // A retried unmount of a dir that is no longer mounted: the dir names
    // the volume and the pod's UID.
    assert_success(&node.driver(&["unmount", &a]));
    expected.push(("unmount", Some("pv1"), Some("uid-a"), "ok", a.clone()));
    assert_success(&node.driver(&["unmount", &c]));
    expected.push(("unmount", Some("pv1"), Some("default/pod-c"), "ok", c.clone()));
    let (code, table, _) = status(&node.socket, &[]);
    assert_eq!((code, table.lines().next()), (0, Some("node node-a holds no volumes")), "{table}");
    assert!(
        table.lines().nth(1) == Some("") && table.contains("\nCSI drivers: 2\n"),
        "then the CSI drivers: {table}"
    );
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());

    // Exactly one line per operation, in order, with its fields.
    let ops = operation_lines(&node);
    assert_eq!(ops.len(), expected.len(), "one line per mount and unmount: {ops:#?}");
    for (line, (op, volume, pod, outcome, dir)) in ops.iter().zip(&expected) {
        assert_eq!(line["op"], *op, "{line}");
        assert_eq!(line["volume"].as_str(), *volume, "{line}");
        assert_eq!(line["pod"].as_str(), *pod, "{line}");
        assert_eq!(line["outcome"], *outcome, "{line}");
        assert_eq!(line["mount_dir"], dir.as_str(), "{line}");
        assert_eq!(line["node"], "node-a", "{line}");
        assert_eq!(line["backend"], "local-pv", "{line}");
        assert!(line["duration_ms"].as_f64().is_some_and(|ms| ms >= 0.0), "{line}");
        if *outcome == "ok" {
            assert_eq!(line["level"], "INFO", "{line}");
            assert!(line.get("error").is_none(), "{line}");
        } else {
            assert_eq!(line["level"], "WARN", "{line}");
            assert!(line["error"].as_str().is_some_and(|e| !e.is_empty()), "{line}");
        }
        // Option values other than the pod's are never logged.
        assert!(!line.to_string().contains(".img"), "{line}");
    }
    assert!(ops[4]["error"].as_str().unwrap_or_default().contains("node-b"), "{}", ops[4]);
}

#[test]
fn status_without_an_agent_fails_naming_the_socket() {
    // A stopped agent (its socket removed), and a socket file nobody
    // listens on.
    let mut node = Node::start(VOLAGENT);
    node.stop_agent();
    let stale = node.scratch.path("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    for socket in [node.socket.as_path(), stale.as_path()] {
        for more in [&[][..], &["--json"]] {
            let (code, out, err) = status(socket, more);
            assert_ne!(code, 0, "{more:?} {out}{err}");
            assert!(out.is_empty(), "nothing on stdout: {out}");
            assert!(
                err.contains(&format!("cannot reach the agent at {}: ", socket.display())),
                "{err}"
            );
        }
    }
}
