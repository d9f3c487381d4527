//! The agent as PID 1 of its PID namespace (a container without an init):
//! it serves through a supervised child, reaps orphans reparented to it,
//! and stops cleanly on SIGTERM. Needs root (namespaces).

use std::process::{Command, Stdio};
use std::time::Duration;
use volagent_test_support::agent::AgentBuilder;
use volagent_test_support::scratch::RootScratch;
use volagent_test_support::wait_until;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[test]
fn as_pid_1_the_agent_serves_reaps_orphans_and_stops_on_sigterm() {
    let s = RootScratch::enter();
    std::fs::create_dir_all(s.path("plugins")).expect("dir");
    std::fs::copy(volagent_test_artifacts::LOCAL_PV, s.path("plugins/local-pv.wasm"))
        .expect("plugin");
    let agent = AgentBuilder::new(VOLAGENT, "node-a").under(&s.path(""));
    let socket = agent.socket_path();
    let mut unshare = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc"])
        .arg(VOLAGENT)
        .args(agent.argv())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("unshare");
    agent.within(Duration::from_secs(30)).wait_ready();
    let pid1 = *children(unshare.id()).first().expect("the namespace's PID 1");
    let status = std::fs::read_to_string(format!("/proc/{pid1}/status")).expect("status");
    assert!(
        status.lines().any(|l| l.starts_with("NSpid:") && l.trim_end().ends_with("\t1")),
        "PID 1 in its namespace: {status}"
    );
    let agent = children(pid1);
    assert_eq!(agent.len(), 1, "PID 1 runs the agent as its one child: {agent:?}");

    // The supervised child serves.
    let out = Command::new(s.path("vpd/volagent~local-pv/local-pv"))
        .arg("init")
        .output()
        .expect("driver");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));

    // An orphan in the namespace is reparented to PID 1 and must be reaped.
    let ok = Command::new("nsenter")
        .args(["-t", &pid1.to_string(), "-p", "--", "sh", "-c", "sleep 0.2 & exit 0"])
        .status()
        .expect("nsenter")
        .success();
    assert!(ok, "nsenter");
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(children(pid1), agent, "the orphan was reaped: PID 1 has only the agent as a child");

    // SIGTERM to PID 1 reaches the agent, which stops cleanly.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid1 as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let code = wait_until(Duration::from_secs(20), "the agent to stop on SIGTERM", || {
        unshare.try_wait().expect("wait")
    });
    assert!(code.success(), "exit status {code:?}");
    assert!(!socket.exists(), "the agent removed its socket on the way out");
}
