//! `volagent status`: ask the running agent which volumes this node holds
//! and for which pods, as a table for people or JSON for tools.

use crate::socket::client;
use crate::socket::protocol::{
    CsiReport, DEFAULT_SOCKET, HeldVolume, LocalReport, Request, Response,
};
use serde::Serialize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// The agent answers a status within its ledger wait (10 s); more means
/// it is stuck.
const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// The agent's socket (its --socket).
    #[arg(long, default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// What `volagent status` shows (and prints as JSON).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeVolumes {
    pub node: String,
    pub volumes: Vec<HeldVolume>,
    /// Held volumes the agent left out to fit its answer in a frame.
    pub volumes_left_out: usize,
    /// Why the agent could not list the volumes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volumes_error: Option<String>,
    /// Local volumes and running wipes, when the agent manages them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local: Option<LocalReport>,
    /// CSI drivers and publications, when the agent serves CSI.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub csi: Option<CsiReport>,
}

/// Exit 0 when the agent listed its volumes, 1 when it could not, and an
/// error (exit 2) when it cannot be asked.
pub fn run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let response = client::ask(&args.socket, Request::Status, TIMEOUT)?;
    let status = match response {
        Response::Status { node, volumes, volumes_left_out, volumes_error, local, csi, .. } => {
            NodeVolumes {
                node,
                volumes,
                volumes_left_out,
                volumes_error,
                local: local.map(|l| *l),
                csi: csi.map(|c| *c),
            }
        }
        Response::Failed { kind, message } => {
            anyhow::bail!("the agent at {} refused ({kind:?}): {message}", args.socket.display())
        }
        other => {
            anyhow::bail!("the agent at {} answered {other:?}, not a status", args.socket.display())
        }
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", table(&status));
    }
    Ok(if status.volumes_error.is_some() { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

const HEADER: [&str; 9] =
    ["BACKEND", "VOLUME", "ACCESS", "DEVICE", "POD", "POD UID", "MODE", "SINCE", "MOUNT DIR"];

/// One row per pod holding a volume, columns as wide as their widest cell.
pub fn table(status: &NodeVolumes) -> String {
    let mut out = String::new();
    let held = status.volumes.len() + status.volumes_left_out;
    match held {
        0 if status.volumes_error.is_none() => {
            out.push_str(&format!("node {} holds no volumes\n", cell(&status.node)));
        }
        0 => out.push_str(&format!("node {}\n", cell(&status.node))),
        1 => out.push_str(&format!("node {} holds 1 volume\n", cell(&status.node))),
        n => out.push_str(&format!("node {} holds {n} volumes\n", cell(&status.node))),
    }
    let mut rows: Vec<[String; 9]> = Vec::new();
    for v in &status.volumes {
        for p in &v.pods {
            rows.push([
                cell(&v.backend),
                cell(&v.volume),
                cell(&v.access_mode),
                v.device.as_deref().map_or("-".into(), cell),
                cell(&format!("{}/{}", p.namespace, p.name)),
                cell(&p.uid),
                if p.read_only { "ro" } else { "rw" }.into(),
                cell(&p.since),
                cell(&p.mount_dir),
            ]);
        }
    }
    if !rows.is_empty() {
        let mut widths = HEADER.map(|h| h.chars().count());
        for row in &rows {
            for (w, c) in widths.iter_mut().zip(row) {
                *w = (*w).max(c.chars().count());
            }
        }
        let header = HEADER.map(String::from);
        for row in std::iter::once(&header).chain(&rows) {
            let line: Vec<String> =
                row.iter().zip(widths).map(|(c, w)| format!("{c:<w$}")).collect();
            out.push_str(line.join("  ").trim_end());
            out.push('\n');
        }
    }
    if status.volumes_left_out > 0 {
        out.push_str(&format!(
            "… and {} more volumes, left out to keep the agent's answer within 1 MiB (the first {} are listed)\n",
            status.volumes_left_out,
            status.volumes.len()
        ));
    }
    if let Some(e) = &status.volumes_error {
        out.push_str(&format!("the agent cannot list the volumes: {}\n", cell(e)));
    }
    out.push_str(&pinned_table(&status.volumes));
    if let Some(local) = &status.local {
        out.push_str(&local_table(local));
    }
    if let Some(csi) = &status.csi {
        out.push_str(&csi_table(csi));
    }
    out
}

/// The volumes whose data a process no successor can take over serves:
/// its pod (the mounter's) must not be replaced while they are mounted.
fn pinned_table(volumes: &[HeldVolume]) -> String {
    let rows: Vec<Vec<String>> = volumes
        .iter()
        .filter_map(|v| {
            let by = v.pinned_by.as_deref()?;
            Some(vec![cell(&v.backend), cell(&v.volume), cell(by)])
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    format!(
        "\nthe pod serving these volumes (the node's mounter) must not be replaced while they are mounted: \
         no successor can take over what serves them\n{}",
        aligned(&["BACKEND", "VOLUME", "SERVED BY"], &rows)
    )
}

/// The CSI drivers and what kubelet said of each, then the publications.
fn csi_table(csi: &CsiReport) -> String {
    let mut out = format!(
        "
CSI drivers: {}
",
        csi.drivers.len()
    );
    let rows: Vec<Vec<String>> = csi
        .drivers
        .iter()
        .map(|d| vec![cell(&d.name), cell(&d.backend), cell(&d.registration)])
        .collect();
    if !rows.is_empty() {
        out.push_str(&aligned(&["DRIVER", "BACKEND", "KUBELET"], &rows));
    }
    if !csi.publications.is_empty() {
        let more = if csi.publications_left_out > 0 {
            format!(" ({} more not shown)", csi.publications_left_out)
        } else {
            String::new()
        };
        out.push_str(&format!(
            "
CSI publications: {}{more}
",
            csi.publications.len()
        ));
        let rows: Vec<Vec<String>> = csi
            .publications
            .iter()
            .map(|p| {
                vec![
                    cell(&p.backend),
                    cell(&p.volume),
                    if p.pod.is_empty() { "-".into() } else { cell(&p.pod) },
                    if p.read_only { "ro" } else { "rw" }.into(),
                    cell(&p.target),
                ]
            })
            .collect();
        out.push_str(&aligned(&["BACKEND", "VOLUME", "POD", "MODE", "TARGET"], &rows));
    }
    out
}

/// The local volumes, then the wipes running with their progress.
fn local_table(local: &LocalReport) -> String {
    let mut out = format!("\nlocal volumes: {}", local.volumes.len() + local.volumes_left_out);
    if let Some(at) = &local.scanned_at {
        out.push_str(&format!(" (scanned {})", cell(at)));
    }
    out.push('\n');
    let rows: Vec<Vec<String>> = local
        .volumes
        .iter()
        .map(|v| {
            vec![
                cell(&v.name),
                cell(&v.class),
                cell(&v.kind),
                cell(&v.capacity),
                cell(&v.state),
                cell(&v.path),
            ]
        })
        .collect();
    out.push_str(&aligned(&["PV", "CLASS", "KIND", "CAPACITY", "STATE", "PATH"], &rows));
    if local.volumes_left_out > 0 {
        out.push_str(&format!("… and {} more\n", local.volumes_left_out));
    }
    if !local.wipes.is_empty() {
        out.push_str(&format!("\nwipes running: {}\n", local.wipes.len()));
        let rows: Vec<Vec<String>> = local
            .wipes
            .iter()
            .map(|w| {
                vec![
                    cell(&w.volume),
                    w.method.as_deref().map_or("-".into(), cell),
                    format!("{}/{} {}", w.step, w.steps, cell(&w.step_kind)),
                    format!("{}s", w.elapsed_secs),
                    w.attempt.to_string(),
                    cell(&w.started_at),
                ]
            })
            .collect();
        out.push_str(&aligned(&["PV", "METHOD", "STEP", "ELAPSED", "ATTEMPT", "STARTED"], &rows));
    }
    if let Some(e) = &local.error {
        out.push_str(&format!("the last discovery failed: {}\n", cell(e)));
    }
    out
}

/// `rows` under `header`, columns as wide as their widest cell.
fn aligned(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    let mut out = String::new();
    for row in std::iter::once(&header).chain(rows) {
        let line: Vec<String> = row.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// A value as one cell: control characters escaped, so a recorded name
/// cannot break the table or the terminal.
fn cell(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::socket::protocol::HeldBy;

    fn pod(name: &str, read_only: bool) -> HeldBy {
        HeldBy {
            namespace: "default".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            mount_dir: format!("/var/lib/kubelet/pods/uid-{name}/volumes/volagent~local-pv/pv1"),
            read_only,
            since: "2026-01-02T03:04:05Z".into(),
        }
    }

    fn volume(name: &str, device: Option<&str>, pods: Vec<HeldBy>) -> HeldVolume {
        HeldVolume {
            backend: "local-pv".into(),
            volume: name.into(),
            access_mode: "ReadWriteOnce".into(),
            device: device.map(String::from),
            staging_dir: format!("/var/lib/kubelet/plugins/volagent/local-pv/mounts/{name}"),
            storage_cluster: None,
            pods,
            pinned_by: None,
            storage_clients: vec![],
        }
    }

    fn status(volumes: Vec<HeldVolume>) -> NodeVolumes {
        NodeVolumes {
            node: "node-a".into(),
            volumes,
            volumes_left_out: 0,
            volumes_error: None,
            local: None,
            csi: None,
        }
    }

    #[test]
    fn local_volumes_and_running_wipes_are_listed() {
        use crate::socket::protocol::{LocalVolumeLine, WipeLine};
        let mut s = status(vec![]);
        let line = |name: &str, state: &str| LocalVolumeLine {
            name: name.into(),
            class: "fast".into(),
            path: format!("/mnt/fast/{name}"),
            kind: "Block".into(),
            capacity: "100Gi".into(),
            state: state.into(),
        };
        s.local = Some(LocalReport {
            volumes: vec![line("local-aaa", "Available"), line("local-bbb", "Wiping")],
            volumes_left_out: 0,
            wipes: vec![WipeLine {
                volume: "local-bbb".into(),
                attempt: 2,
                method: Some("shred:3".into()),
                step: 3,
                steps: 4,
                step_kind: "wipe".into(),
                started_at: "2026-01-02T03:04:05Z".into(),
                elapsed_secs: 42,
            }],
            scanned_at: Some("2026-01-02T03:05:00Z".into()),
            error: None,
        });
        let text = table(&s);
        assert!(text.contains("local volumes: 2 (scanned 2026-01-02T03:05:00Z)"), "{text}");
        let row = |name: &str, n: usize| {
            text.lines()
                .filter(|l| l.starts_with(name))
                .nth(n)
                .map(|l| l.split_whitespace().collect::<Vec<_>>())
                .unwrap_or_default()
        };
        assert_eq!(
            row("local-aaa", 0),
            ["local-aaa", "fast", "Block", "100Gi", "Available", "/mnt/fast/local-aaa"]
        );
        assert_eq!(
            row("local-bbb", 1),
            ["local-bbb", "shred:3", "3/4", "wipe", "42s", "2", "2026-01-02T03:04:05Z"],
            "{text}"
        );
        assert!(text.contains("wipes running: 1"), "{text}");
    }

    #[test]
    fn one_aligned_row_per_pod() {
        let s = status(vec![
            volume("pv1", Some("/dev/loop0"), vec![pod("web-0", false), pod("reader", true)]),
            volume("data-long-name", None, vec![pod("db", false)]),
        ]);
        let text = table(&s);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "node node-a holds 2 volumes");
        assert_eq!(lines.len(), 5, "{text}");
        let header = lines[1];
        assert!(
            header.starts_with("BACKEND   VOLUME          ACCESS         DEVICE      POD"),
            "{text}"
        );
        // Every column starts where its header does.
        let at = |h: &str| header.find(h).unwrap();
        for line in &lines[2..] {
            for h in ["VOLUME", "ACCESS", "DEVICE", "POD UID", "MODE", "SINCE", "MOUNT DIR"] {
                let i = at(h);
                assert!(
                    &line[i - 2..i] == "  " && line.as_bytes()[i] != b' ',
                    "{h} misaligned in {line:?}"
                );
            }
        }
        assert_eq!(
            lines[2].split_whitespace().collect::<Vec<_>>(),
            [
                "local-pv",
                "pv1",
                "ReadWriteOnce",
                "/dev/loop0",
                "default/web-0",
                "uid-web-0",
                "rw",
                "2026-01-02T03:04:05Z",
                "/var/lib/kubelet/pods/uid-web-0/volumes/volagent~local-pv/pv1"
            ]
        );
        assert_eq!(lines[3].split_whitespace().nth(4), Some("default/reader"));
        assert_eq!(lines[3].split_whitespace().nth(6), Some("ro"));
        assert_eq!(lines[4].split_whitespace().nth(3), Some("-"), "no device");
        assert!(lines.iter().all(|l| !l.ends_with(' ')), "{text:?}");
    }

    #[test]
    fn volumes_that_pin_the_mounter_are_listed_after_the_pods() {
        let mut fuse = volume("pv-fuse", Some("/dev/loop3"), vec![pod("web-0", false)]);
        fuse.pinned_by = Some("rbd-fuse".into());
        let free = volume("pv-free", Some("/dev/loop4"), vec![pod("web-1", false)]);
        let text = table(&status(vec![fuse, free]));
        let lines: Vec<&str> = text.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.contains("must not be replaced"))
            .unwrap_or_else(|| panic!("no pinned section: {text}"));
        assert_eq!(
            lines[at + 1].split_whitespace().collect::<Vec<_>>(),
            ["BACKEND", "VOLUME", "SERVED", "BY"]
        );
        assert_eq!(
            lines[at + 2].split_whitespace().collect::<Vec<_>>(),
            ["local-pv", "pv-fuse", "rbd-fuse"]
        );
        assert_eq!(lines.len(), at + 3, "only the pinned volume: {text}");
        assert!(
            !table(&status(vec![volume("pv-free", None, vec![])])).contains("must not be replaced")
        );
    }

    #[test]
    fn nothing_held_a_truncated_list_and_a_ledger_error_are_said() {
        assert_eq!(table(&status(vec![])), "node node-a holds no volumes\n");
        let mut cut = status(vec![volume("pv1", None, vec![pod("a", false)])]);
        cut.volumes_left_out = 4999;
        let text = table(&cut);
        assert!(text.starts_with("node node-a holds 5000 volumes\n"), "{text}");
        assert!(text.ends_with("… and 4999 more volumes, left out to keep the agent's answer within 1 MiB (the first 1 are listed)\n"), "{text}");
        let mut failed = status(vec![]);
        failed.volumes_error = Some("attachment ledger /x: no".into());
        assert_eq!(
            table(&failed),
            "node node-a\nthe agent cannot list the volumes: attachment ledger /x: no\n"
        );
    }

    #[test]
    fn control_characters_cannot_break_the_table() {
        let mut p = pod("evil\npod", false);
        p.mount_dir = "/k/\x1b[2Jx".into();
        let text = table(&status(vec![volume("pv1", None, vec![p])]));
        assert_eq!(text.lines().count(), 3, "{text}");
        assert!(
            text.contains("default/evil\\npod")
                && text.contains("/k/\\u{1b}[2Jx")
                && !text.contains('\x1b'),
            "{text}"
        );
    }

    #[test]
    fn json_output_has_the_volumes_and_their_pods() {
        let s = status(vec![volume("pv1", Some("/dev/loop0"), vec![pod("web-0", false)])]);
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["node"], "node-a");
        assert_eq!(v["volumes_left_out"], 0);
        assert_eq!(v["volumes"][0]["volume"], "pv1");
        assert_eq!(v["volumes"][0]["device"], "/dev/loop0");
        assert_eq!(v["volumes"][0]["pods"][0]["name"], "web-0");
        assert!(v.get("volumes_error").is_none());
    }
}
