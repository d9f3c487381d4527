//! The `volagent plugin` commands, run as the real binary.

use std::process::Command;
use volagent_test_artifacts::{LOCAL_PV, RBD, WRONG_WORLD};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

fn volagent(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(VOLAGENT).args(args).output().expect("run volagent");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn plugin_test_passes_the_shipped_scenarios() {
    let dir = volagent_test_support::workspace().join("guest-plugins/local-pv/scenarios");
    let (code, out, err) =
        volagent(&["plugin", "test", LOCAL_PV, dir.to_str().expect("utf-8 path")]);
    assert_eq!(code, 0, "{out}{err}");
    let last = out.lines().last().unwrap_or_default();
    assert!(last.starts_with("local-pv 0.1.0: ") && last.ends_with(" passed, 0 failed"), "{out}");
    assert!(out.contains("PASS  ") && !out.contains("FAIL  "), "{out}");
}

#[test]
fn plugin_test_fails_with_a_readable_diff() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("wrong.yaml");
    std::fs::write(
        &file,
        r#"
backend: rbd
scenarios:
  - name: expects the wrong filesystem
    call: attach
    input:
      volume: { name: pv, backend: rbd, access_mode: ReadWriteOnce, fs_type: xfs, secret_keys: [],
                options: { monitors: "10.0.0.1:6789", image: img } }
      requester: { node: n1, pod_namespace: ns, pod: p, pod_uid: u, read_only: false,
                   mount_dir: /var/lib/kubelet/pods/u/volumes/volagent~rbd/pv }
      paths: { kubelet_root: /var/lib/kubelet, staging_dir: /var/lib/kubelet/plugins/volagent/rbd/mounts/pv,
               state_dir: /var/lib/volagent/volumes/pv, discovery_dirs: [] }
    expect:
      plan:
        - AttachDevice: {}
        - Format: { fs_type: ext4 }
        - Mount: {}
        - BindMount: {}
  - name: input that does not fit the call
    call: fence
    input: { volume: 7 }
    expect: { decision: Grant }
  - name: a misspelt nested field
    call: info
    host: { nodes: [{ name: n1, exists: true, ready: true, out_of_service: false, out_of_servce: true }] }
    expect: { info: {} }
  - name: an expectation that asserts nothing
    call: info
    expect: {}
"#,
    )
    .expect("write");
    let (code, out, _) = volagent(&["plugin", "test", RBD, file.to_str().expect("utf-8 path")]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL  ") && out.contains("expects the wrong filesystem"), "{out}");
    assert!(out.contains("first difference at $.plan[1].Format.fs_type"), "{out}");
    assert!(out.contains("-    fs_type: ext4") && out.contains("+    fs_type: xfs"), "{out}");
    assert!(out.contains("invalid input for a Fence call"), "{out}");
    assert!(out.contains("unknown field host.nodes[0].out_of_servce"), "{out}");
    assert!(
        out.contains(
            "expect must have exactly one of decision, plan, info, condition, error, refused"
        ),
        "{out}"
    );
    assert!(out.trim_end().ends_with("rbd 0.1.0: 0 passed, 4 failed"), "{out}");
}

#[test]
fn plugin_test_of_a_non_backend_names_the_file() {
    let (code, out, err) = volagent(&["plugin", "test", WRONG_WORLD, "."]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains(WRONG_WORLD) && err.contains("not a volagent backend"), "{err}");
}

#[test]
fn plugin_inspect_shows_world_version_info_and_imports() {
    let (code, out, err) = volagent(&["plugin", "inspect", RBD]);
    assert_eq!(code, 0, "{err}");
    for expected in [
        "world:       exports volagent:policy/policy@1.1.0\n",
        "optional:    block-volumes, expand, health, provisioner\n",
        "controller:  create-image, delete-image, resize-image, create-snapshot, delete-snapshot, clone-image\n",
        "backend:     rbd 0.1.0",
        "devices:     rbd",
        "blocklist-client",
        "publish-block",
        "volagent:policy/ceph@1.1.0",
        "volagent:policy/ceph-provisioning@1.1.0",
    ] {
        assert!(out.contains(expected), "missing {expected:?} in\n{out}");
    }
    let (code, out, _) = volagent(&["plugin", "inspect", "--json", RBD]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("inspect --json prints JSON");
    assert_eq!(v["info"]["name"], "rbd");
    assert_eq!(v["export"], "volagent:policy/policy@1.1.0");
    assert_eq!(v["contract"], "1.1.0");
    // A build for the previous contract says which it speaks, and that the
    // host serves it through its adapter.
    let old = volagent_test_support::workspace().join("tests/fixtures/contract-0.4/rbd.wasm");
    let (code, out, err) = volagent(&["plugin", "inspect", old.to_str().expect("utf-8")]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("exports volagent:policy/policy@0.4.0 (contract 0.4.0, served through the host's adapter)"), "{out}");
    assert!(!out.contains("publish-block"), "{out}");
}

#[test]
fn plugin_bench_reports_percentiles() {
    let dir = volagent_test_support::workspace().join("guest-plugins/rbd/scenarios/fence.yaml");
    let (code, out, err) =
        volagent(&["plugin", "bench", RBD, dir.to_str().expect("utf-8"), "-n", "20"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("p50 µs") && out.contains("p99 µs"), "{out}");
    assert!(out.contains("a deleted holder node is taken over"), "{out}");
}

/// cargo, for a crate outside this workspace: the host build's own flags
/// and target dir left out, a target dir of its own kept between runs.
#[test]
fn plugin_trust_adds_each_policy_once_to_an_allow_list_and_keeps_what_is_there() {
    use sha2::Digest;
    let dir = tempfile::tempdir().expect("dir");
    let list = dir.path().join("trusted-policies");
    std::fs::write(&list, "# the site's own\n").expect("list");
    let list_arg = list.to_str().expect("utf-8 path");
    let sha = |f: &str| hex::encode(sha2::Sha256::digest(std::fs::read(f).expect("guest")));
    let (code, out, err) = volagent(&["plugin", "trust", LOCAL_PV, RBD, "--list", list_arg]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&format!("local-pv {}  # ", sha(LOCAL_PV))), "{out}");
    assert!(out.contains("2 entries (2 new)"), "{out}");
    let (code, out, _) = volagent(&["plugin", "trust", LOCAL_PV, "--list", list_arg]);
    assert_eq!(code, 0);
    assert!(out.contains("2 entries (0 new)"), "{out}");
    let text = std::fs::read_to_string(&list).expect("list");
    assert!(text.starts_with("# the site's own\n"), "{text}");
    assert_eq!(text.lines().filter(|l| l.starts_with("local-pv ")).count(), 1, "{text}");
    assert!(text.contains(&format!("rbd {}", sha(RBD))), "{text}");
    // Not a policy, or a list that does not parse: refused, nothing written.
    let (code, _, err) = volagent(&["plugin", "trust", WRONG_WORLD, "--list", list_arg]);
    assert_ne!(code, 0);
    assert!(err.contains(WRONG_WORLD), "{err}");
    std::fs::write(&list, "rbd\n").expect("list");
    let (code, _, err) = volagent(&["plugin", "trust", LOCAL_PV, "--list", list_arg]);
    assert_ne!(code, 0);
    assert!(err.contains("line 1"), "{err}");
    assert_eq!(std::fs::read_to_string(&list).expect("list"), "rbd\n");
}

fn cargo_in(dir: &std::path::Path, args: &[&str]) -> (bool, String) {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| volagent_test_support::workspace().join("target"))
        .join("plugin-new");
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(dir).args(args).env("CARGO_TARGET_DIR", &target);
    for var in
        ["CARGO_ENCODED_RUSTFLAGS", "RUSTFLAGS", "CARGO_BUILD_TARGET", "RUSTC_WORKSPACE_WRAPPER"]
    {
        cmd.env_remove(var);
    }
    let out = cmd.output().expect("run cargo");
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// A new backend, as `plugin new` writes it and with no edit: its native
/// tests pass, it builds to a component outside this repository, and the
/// component passes its own scenarios and declares itself.
#[test]
fn a_new_backend_builds_and_passes_its_scenarios_as_written() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("demo-store");
    let (code, out, err) =
        volagent(&["plugin", "new", "demo-store", "--dir", dir.to_str().expect("utf-8")]);
    assert_eq!(code, 0, "{out}{err}");
    let (ok, log) = cargo_in(&dir, &["test", "--release", "--quiet"]);
    assert!(ok, "the native tests of the new crate:\n{log}");
    let (ok, log) = cargo_in(&dir, &["build", "--release", "--quiet", "--target", "wasm32-wasip2"]);
    assert!(ok, "building the new crate's component:\n{log}");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| volagent_test_support::workspace().join("target"))
        .join("plugin-new/wasm32-wasip2/release/policy_demo_store.wasm");
    let wasm = target.to_str().expect("utf-8");
    let scenarios = dir.join("scenarios");
    let (code, out, err) = volagent(&["plugin", "test", wasm, scenarios.to_str().expect("utf-8")]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.ends_with("demo-store 0.1.0: 5 passed, 0 failed\n"), "{out}");
    let (code, out, err) = volagent(&["plugin", "inspect", wasm]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("world:       exports volagent:policy/policy@1.1.0"), "{out}");
    assert!(out.contains("controller:  -\n"), "a new backend provisions nothing: {out}");
    assert!(out.contains("network fs:  nfs"), "{out}");
    // Written once: never over a crate that is there.
    let (code, _, err) =
        volagent(&["plugin", "new", "demo-store", "--dir", dir.to_str().expect("utf-8")]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("already exists and is not empty"), "{err}");
}
