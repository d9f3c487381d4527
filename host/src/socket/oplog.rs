//! The operation log: exactly one line per mount and unmount the agent
//! serves, when it ends, with what an operator greps for as fields (the
//! JSON log format carries them as keys). Only the well-known pod keys of
//! kubelet's options are read: other option values may be secrets.

use crate::ops::request::{MAX_PATH, MountDir};
use crate::ops::{Agent, Done, Failure, FailureKind};
use crate::text::bounded;
use std::collections::BTreeMap;
use std::time::Duration;

/// The target of operation lines: `RUST_LOG=volagent::operation=info`
/// keeps only them.
pub const TARGET: &str = "volagent::operation";

/// Longest a field taken from a request may be in the log: a request is up
/// to 1 MiB, a log line should not be.
const MAX_FIELD: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Mount,
    Unmount,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Mount => "mount",
            Op::Unmount => "unmount",
        }
    }
}

/// What an operation concerns, filled in as the pipeline learns it: a
/// request refused early still gets its line, with less in it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Subject {
    pub volume: Option<String>,
    /// `namespace/name`, else the pod's UID.
    pub pod: Option<String>,
}

/// `namespace/name` when both are known, else the UID, else none.
pub fn pod_name(namespace: &str, name: &str, uid: &str) -> Option<String> {
    let pod = match (namespace, name, uid) {
        (ns, n, _) if !ns.is_empty() && !n.is_empty() => format!("{ns}/{n}"),
        (_, _, uid) if !uid.is_empty() => uid.to_string(),
        _ => return None,
    };
    Some(bounded(pod, MAX_FIELD))
}

impl Subject {
    /// The pod of kubelet's mount options (`kubernetes.io/pod.*` only).
    pub fn of_options(options: &BTreeMap<String, String>) -> Subject {
        let get = |k: &str| options.get(&format!("kubernetes.io/{k}")).map_or("", String::as_str);
        let uid = if get("pod.uid").is_empty() { get("pod.UID") } else { get("pod.uid") };
        Subject { volume: None, pod: pod_name(get("pod.namespace"), get("pod.name"), uid) }
    }

    /// What a parsed mount dir names: the volume, and the pod's UID when
    /// nothing better is known.
    pub fn learn_dir(&mut self, dir: &MountDir) {
        self.volume = Some(dir.name.clone());
        if self.pod.is_none() {
            self.pod = pod_name("", "", &dir.pod_uid);
        }
    }
}

/// One finished operation, as logged.
#[derive(Debug)]
pub struct Finished<'a> {
    pub op: Op,
    pub node: &'a str,
    pub backend: &'a str,
    pub mount_dir: &'a str,
    pub subject: &'a Subject,
    pub elapsed: Duration,
}

/// Log `done`'s line: info when it succeeded, warn (with the failure's
/// already bounded message) when it did not.
pub fn log(done: &Finished, result: &Result<Done, Failure>) {
    let op = done.op.name();
    let outcome = result_label(result);
    // Request strings are passed as &str: the text format quotes and
    // escapes them, so no request can forge a line.
    let backend = bounded(done.backend.to_string(), MAX_FIELD);
    let mount_dir = bounded(done.mount_dir.to_string(), MAX_PATH + 64);
    let volume = done.subject.volume.as_deref();
    let pod = done.subject.pod.as_deref();
    let duration_ms = (done.elapsed.as_secs_f64() * 1e6).round() / 1e3;
    match result {
        Ok(_) => tracing::info!(
            target: TARGET,
            op,
            volume,
            pod,
            node = done.node,
            backend = backend.as_str(),
            mount_dir = mount_dir.as_str(),
            outcome,
            duration_ms,
            "{op} {outcome}"
        ),
        Err(f) => tracing::warn!(
            target: TARGET,
            op,
            volume,
            pod,
            node = done.node,
            backend = backend.as_str(),
            mount_dir = mount_dir.as_str(),
            outcome,
            duration_ms,
            error = f.message.as_str(),
            "{op} {outcome}"
        ),
    }
}

/// A mount or unmount as kubelet asked for it.
#[derive(Debug, Clone, Copy)]
pub enum Asked<'a> {
    Mount { backend: &'a str, mount_dir: &'a str, options: &'a BTreeMap<String, String> },
    Unmount { backend: &'a str, mount_dir: &'a str },
}

/// The line of a mount or unmount refused before it reached the
/// pipeline (no operation slot came free).
pub fn log_unserved(agent: &Agent, asked: Asked, failure: &Failure, elapsed: Duration) {
    let (op, backend, mount_dir, mut subject) = match asked {
        Asked::Mount { backend, mount_dir, options } => {
            (Op::Mount, backend, mount_dir, Subject::of_options(options))
        }
        Asked::Unmount { backend, mount_dir } => {
            (Op::Unmount, backend, mount_dir, Subject::default())
        }
    };
    if let Ok(dir) =
        super::flex_request::parse_mount_dir(&agent.node.config.kubelet_roots(), backend, mount_dir)
    {
        subject.learn_dir(&dir);
    }
    let done = Finished {
        op,
        node: &agent.node.config.node,
        backend,
        mount_dir,
        subject: &subject,
        elapsed,
    };
    log(&done, &Err(failure.clone()));
}

/// The backend label of a request: a name no loaded backend has is not
/// kept (a caller could make up any number of them).
pub fn metric_backend<'b, T>(backend: &'b str, r: &Result<T, Failure>) -> &'b str {
    match r {
        Err(f) if f.kind == FailureKind::UnknownBackend => "unknown",
        _ => backend,
    }
}

pub fn result_label<T>(r: &Result<T, Failure>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(f) => match f.kind {
            FailureKind::Denied => "denied",
            FailureKind::Busy => "busy",
            FailureKind::TimedOut => "timed_out",
            FailureKind::BadRequest => "bad_request",
            FailureKind::Unavailable => "unavailable",
            FailureKind::UnknownBackend => "unknown_backend",
            _ => "failed",
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// This thread's log, as the agent's `--log-format json` writes it,
    /// while the capture lives.
    struct Capture {
        buf: Buf,
        _guard: tracing::subscriber::DefaultGuard,
    }

    impl Capture {
        fn start() -> Capture {
            let buf = Buf::default();
            let out = buf.clone();
            let subscriber = tracing_subscriber::fmt()
                .json()
                .flatten_event(true)
                .with_writer(move || out.clone())
                .finish();
            Capture { buf, _guard: tracing::subscriber::set_default(subscriber) }
        }

        /// The operation lines logged so far.
        fn lines(&self) -> Vec<serde_json::Value> {
            let text = String::from_utf8(self.buf.0.lock().unwrap().clone()).unwrap();
            let all: Vec<serde_json::Value> = text
                .lines()
                .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
                .collect();
            all.into_iter().filter(|l| l["target"] == TARGET).collect()
        }
    }

    fn json_lines(f: impl FnOnce()) -> Vec<serde_json::Value> {
        let capture = Capture::start();
        f();
        capture.lines()
    }

    fn options(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    const DIR: &str = "/var/lib/kubelet/pods/u-1/volumes/volagent~local-pv/pv1";

    #[test]
    fn a_success_is_one_info_line_with_every_field() {
        let subject = Subject { volume: Some("pv1".into()), pod: Some("shop/web-0".into()) };
        let done = Finished {
            op: Op::Mount,
            node: "n1",
            backend: "local-pv",
            mount_dir: DIR,
            subject: &subject,
            elapsed: Duration::from_micros(12_345),
        };
        let lines = json_lines(|| {
            log(&done, &Ok(Done { message: "mounted".into(), device: None }));
        });
        assert_eq!(lines.len(), 1, "{lines:?}");
        let l = &lines[0];
        assert_eq!(l["level"], "INFO");
        assert_eq!(l["target"], TARGET);
        assert_eq!(l["message"], "mount ok");
        for (field, want) in [
            ("op", "mount"),
            ("volume", "pv1"),
            ("pod", "shop/web-0"),
            ("node", "n1"),
            ("backend", "local-pv"),
            ("mount_dir", DIR),
            ("outcome", "ok"),
        ] {
            assert_eq!(l[field], want, "{field} in {l}");
        }
        assert_eq!(l["duration_ms"].as_f64(), Some(12.345), "{l}");
        assert!(l.get("error").is_none(), "{l}");
    }

    #[test]
    fn a_failure_is_one_warn_line_with_its_kind_and_message_and_unknowns_are_left_out() {
        let subject = Subject::default();
        let done = Finished {
            op: Op::Unmount,
            node: "n1",
            backend: "local-pv",
            mount_dir: "/etc",
            subject: &subject,
            elapsed: Duration::ZERO,
        };
        let failure = Failure::new(FailureKind::Denied, "volume pv1 is held by pod a on node n2");
        let lines = json_lines(|| log(&done, &Err(failure)));
        assert_eq!(lines.len(), 1, "{lines:?}");
        let l = &lines[0];
        assert_eq!(
            (l["level"].as_str(), l["op"].as_str(), l["outcome"].as_str()),
            (Some("WARN"), Some("unmount"), Some("denied")),
            "{l}"
        );
        assert_eq!(l["error"], "volume pv1 is held by pod a on node n2");
        assert!(
            l.get("volume").is_none() && l.get("pod").is_none(),
            "unknown fields are absent: {l}"
        );
    }

    #[test]
    fn the_pod_is_namespace_and_name_else_its_uid_and_no_other_option_is_read() {
        let full = options(&[
            ("kubernetes.io/pod.namespace", "shop"),
            ("kubernetes.io/pod.name", "web-0"),
            ("kubernetes.io/pod.uid", "u-1"),
            ("kubernetes.io/secret/password", "hunter2"),
            ("password", "hunter2"),
        ]);
        assert_eq!(Subject::of_options(&full).pod.as_deref(), Some("shop/web-0"));
        assert_eq!(
            Subject::of_options(&options(&[
                ("kubernetes.io/pod.name", "web-0"),
                ("kubernetes.io/pod.UID", "u-2")
            ]))
            .pod
            .as_deref(),
            Some("u-2")
        );
        assert_eq!(Subject::of_options(&options(&[("path", "/mnt/disks/a")])), Subject::default());
        let mut subject = Subject::of_options(&full);
        let dir = super::super::flex_request::parse_mount_dir(
            &[std::path::Path::new("/var/lib/kubelet")],
            "local-pv",
            DIR,
        )
        .unwrap();
        subject.learn_dir(&dir);
        assert_eq!(subject, Subject { volume: Some("pv1".into()), pod: Some("shop/web-0".into()) });
        let mut bare = Subject::default();
        bare.learn_dir(&dir);
        assert_eq!(bare.pod.as_deref(), Some("u-1"), "the dir's UID when the options had none");

        let done = Finished {
            op: Op::Mount,
            node: "n1",
            backend: "local-pv",
            mount_dir: DIR,
            subject: &subject,
            elapsed: Duration::ZERO,
        };
        let lines =
            json_lines(|| log(&done, &Err(Failure::new(FailureKind::Failed, "mkfs failed"))));
        assert!(!lines[0].to_string().contains("hunter2"), "{}", lines[0]);
    }

    #[test]
    fn fields_from_a_request_are_bounded() {
        let huge = format!("/var/lib/kubelet/pods/{}", "x".repeat(1 << 20));
        let pod = pod_name(&"n".repeat(100_000), "p", "");
        assert!(pod.as_ref().is_some_and(|p| p.len() <= MAX_FIELD), "{:?}", pod.map(|p| p.len()));
        let subject = Subject { volume: None, pod };
        let backend = "b".repeat(100_000);
        let done = Finished {
            op: Op::Mount,
            node: "n1",
            backend: &backend,
            mount_dir: &huge,
            subject: &subject,
            elapsed: Duration::ZERO,
        };
        let lines = json_lines(|| {
            log(&done, &Err(Failure::new(FailureKind::BadRequest, "mount dir too long")));
        });
        assert!(lines[0].to_string().len() < 8 << 10, "{} bytes", lines[0].to_string().len());
    }

    fn pod_options() -> BTreeMap<String, String> {
        options(&[
            ("kubernetes.io/pvOrVolumeName", "pv1"),
            ("kubernetes.io/pod.namespace", "shop"),
            ("kubernetes.io/pod.name", "web-0"),
            ("kubernetes.io/pod.uid", "u-1"),
        ])
    }

    #[tokio::test]
    async fn the_agents_mounts_and_unmounts_log_one_line_each_even_when_refused_early() {
        let tmp = tempfile::tempdir().unwrap();
        let (agent, _, _) = crate::ops::tests::test_agent(tmp.path());
        let dir = "/k/pods/u-1/volumes/volagent~nope/pv1";
        let capture = Capture::start();

        let r = super::super::flex::mount(&agent, "nope", dir, &pod_options()).await;
        assert_eq!(r.unwrap_err().kind, FailureKind::UnknownBackend);
        // Nothing mounted there: a retried unmount succeeds.
        super::super::flex::unmount(&agent, "nope", dir).await.unwrap();
        let busy =
            Failure::new(FailureKind::Busy, "all 16 operation slots stayed busy for 120s; retry");
        let options = pod_options();
        log_unserved(
            &agent,
            Asked::Mount { backend: "nope", mount_dir: dir, options: &options },
            &busy,
            Duration::from_secs(120),
        );
        log_unserved(
            &agent,
            Asked::Unmount { backend: "nope", mount_dir: "/elsewhere" },
            &busy,
            Duration::ZERO,
        );

        let lines = capture.lines();
        let got: Vec<(&str, Option<&str>, Option<&str>, &str)> = lines
            .iter()
            .map(|l| {
                (
                    l["op"].as_str().unwrap(),
                    l["volume"].as_str(),
                    l["pod"].as_str(),
                    l["outcome"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("mount", Some("pv1"), Some("shop/web-0"), "unknown_backend"),
                ("unmount", Some("pv1"), Some("u-1"), "ok"),
                ("mount", Some("pv1"), Some("shop/web-0"), "busy"),
                ("unmount", None, None, "busy"),
            ],
            "{lines:#?}"
        );
        assert!(lines.iter().all(|l| l["node"] == "n1" && l["backend"] == "nope"), "{lines:#?}");
        assert_eq!(lines[2]["duration_ms"].as_f64(), Some(120_000.0));
        assert!(
            lines[0]["error"].as_str().unwrap().contains("\"nope\" is not loaded"),
            "{}",
            lines[0]
        );
    }
}
