//! The floors hold: the layers below the edges (operations, execution,
//! the ledger, the guest runtime, local discovery, side effects, the NBD
//! server and the leaves) import no edge — neither the edges' modules
//! (`cli`, `socket`, `csi`, `kube`, `plugin`, `http`) nor the crates of
//! their wire formats (the socket protocol, gRPC, the Kubernetes API).
//! Each edge turns its format into `ops`' requests; a reach upwards here is
//! how the old cycles began. A source scan, comments left out.

use std::path::{Path, PathBuf};

/// What lies below the edges, relative to `src/`.
const BELOW_THE_EDGES: &[&str] = &[
    "model",
    "ops",
    "exec",
    "ledger",
    "policy",
    "local",
    "sys",
    "nbd",
    "fuse",
    "workers.rs",
    "metrics.rs",
    "secret.rs",
    "reopening_db.rs",
    "text.rs",
    "clock.rs",
    "listener.rs",
    "init.rs",
    "stats.rs",
];

/// The edges, as paths in the crate.
const EDGE_MODULES: &[&str] =
    &["cli", "socket", "csi", "kube", "plugin", "provision", "http", "mounter"];

/// The crates of the edges' wire formats.
const EDGE_CRATES: &[&str] = &["volagent_protocol", "tonic", "prost", "k8s_openapi", "kube"];

fn rust_files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(path)
            .expect("source dir")
            .map(|e| e.expect("entry").path())
            .collect();
        entries.sort();
        for e in entries {
            rust_files(&e, out);
        }
    } else if path.extension().is_some_and(|e| e == "rs") {
        out.push(path.to_path_buf());
    }
}

/// `line` without a `//` comment (doc comments included). A `//` inside a
/// string is cut too, which can only hide, never invent, a reach.
fn code(line: &str) -> &str {
    line.find("//").map_or(line, |i| &line[..i])
}

/// Whether `code` names `path` as a path's start: `crate::kube::…`,
/// `kube::Api` (not `crate::kube` for an external crate, not `my_kube::`).
fn names(code: &str, path: &str, after_crate: bool) -> bool {
    let mut from = 0;
    while let Some(i) = code[from..].find(path) {
        let at = from + i;
        let end = at + path.len();
        let before = &code[..at];
        let followed = code[end..].starts_with("::") || code[end..].starts_with(';');
        let starts = if after_crate {
            before.ends_with("crate::")
        } else {
            !before.ends_with("::")
                && !before.chars().last().is_some_and(|c| c.is_alphanumeric() || c == '_')
        };
        if followed && starts {
            return true;
        }
        from = end;
    }
    false
}

fn reaches(src: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for below in BELOW_THE_EDGES {
        let mut files = Vec::new();
        rust_files(&src.join(below), &mut files);
        assert!(!files.is_empty(), "{below}: no source found under {}", src.display());
        for file in files {
            let text = std::fs::read_to_string(&file).expect("source file");
            for (n, line) in text.lines().enumerate() {
                let code = code(line);
                let hit = EDGE_MODULES
                    .iter()
                    .find(|m| names(code, m, true))
                    .or_else(|| EDGE_CRATES.iter().find(|c| names(code, c, false)));
                if let Some(edge) = hit {
                    let file = file.strip_prefix(src).expect("beneath src").display();
                    found.push(format!("{file}:{}: reaches {edge}: {}", n + 1, line.trim()));
                }
            }
        }
    }
    found
}

#[test]
fn nothing_below_the_edges_imports_an_edge() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = reaches(&src);
    assert!(found.is_empty(), "imports that run up into an edge:\n{}", found.join("\n"));
}

#[test]
fn the_scan_sees_a_reach_in_each_form() {
    // The scan itself: each way of naming an edge is caught, comments and
    // look-alikes are not.
    assert!(names("use crate::kube::cluster::Cluster;", "kube", true));
    assert!(names("let x = crate::socket::protocol::Response::Ok;", "socket", true));
    assert!(names("use crate::csi;", "csi", true));
    assert!(names("use kube::Api;", "kube", false));
    assert!(names("    x: volagent_protocol::Response,", "volagent_protocol", false));
    assert!(names("use tonic::Status;", "tonic", false));
    assert!(!names("use crate::kube_like::X;", "kube", true));
    assert!(!names("use crate::ops::kube::X;", "kube", true));
    assert!(!names("use crate::kube::X;", "kube", false), "crate::kube is not the kube crate");
    assert!(!names(code("/// see [`crate::csi::threads`]"), "csi", true));
    assert!(!names("let sockets = 1;", "socket", true));

    // And on a tree: a file below the edges that imports one is reported.
    let tmp = tempfile::tempdir().unwrap();
    for below in BELOW_THE_EDGES {
        let path = tmp.path().join(below);
        if below.ends_with(".rs") {
            std::fs::write(&path, "pub fn f() {}\n").unwrap();
        } else {
            std::fs::create_dir_all(&path).unwrap();
            std::fs::write(path.join("mod.rs"), "//! crate::kube in a comment\n").unwrap();
        }
    }
    assert!(reaches(tmp.path()).is_empty());
    std::fs::write(tmp.path().join("ops/held.rs"), "use crate::socket::protocol::Response;\n")
        .unwrap();
    let found = reaches(tmp.path());
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("ops/held.rs:1: reaches socket"), "{found:?}");
}

/// Flexvolume's option keys (`kubernetes.io/pod.uid`, …) are the socket
/// edge's to read: below it, a mount is a typed `ops::request::MountRequest`.
#[test]
fn only_the_socket_edge_reads_flexvolume_options() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for below in ["ops", "exec", "ledger", "local", "sys"] {
        let mut files = Vec::new();
        rust_files(&src.join(below), &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).expect("source file");
            for (n, line) in text.lines().enumerate() {
                let code = code(line);
                if code.contains("\"kubernetes.io/") || code.contains("pvOrVolumeName") {
                    found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
                }
            }
        }
    }
    let flex =
        std::fs::read_to_string(src.join("socket/flex_request.rs")).expect("flex_request.rs");
    assert!(flex.contains("pvOrVolumeName"), "the scan's marker is where the options are parsed");
    assert!(found.is_empty(), "Flexvolume options read below the edge:\n{}", found.join("\n"));
}

/// The contract's bindings are the contract adapters' alone: everything
/// else — the node's records, the ledger, the executor — speaks the host's
/// model, so a new contract version is never a storage migration. And the
/// model knows nothing of guests.
#[test]
fn only_the_contract_adapters_see_the_bindings() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let adapters = src.join("policy/contract");
    let mut found = Vec::new();
    let mut bindgens = 0;
    for file in files {
        let text = std::fs::read_to_string(&file).expect("source file");
        let in_adapters = file.starts_with(&adapters);
        let in_model = file.starts_with(src.join("model"));
        for (n, line) in text.lines().enumerate() {
            let code = code(line);
            if code.contains("bindgen!") {
                bindgens += 1;
            }
            let bad = (!in_adapters && (code.contains("bindgen!") || code.contains("bindings::")))
                || (in_model && (code.contains("crate::policy") || code.contains("wasmtime")));
            if bad {
                found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(bindgens >= 2, "the scan's marker: every version adapter has its bindgen!");
    assert!(found.is_empty(), "bindings outside policy/contract:\n{}", found.join("\n"));
}

/// The SDK carries its own copy of the contract (so that it builds outside
/// this repository); it is the one the host speaks.
#[test]
fn the_sdk_carries_the_contract_the_host_speaks() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let host = std::fs::read_to_string(root.join("wit/policy.wit")).expect("wit/policy.wit");
    let sdk = std::fs::read_to_string(root.join("guest-plugins/sdk/wit/policy.wit"))
        .expect("the SDK's copy");
    assert!(
        host.contains(&format!("package volagent:policy@{};", volagent::policy::CONTRACT_VERSION))
    );
    assert!(
        host == sdk,
        "guest-plugins/sdk/wit/policy.wit differs from wit/policy.wit: copy it over"
    );
}
