//! Builds every guest component (the five backends and the test-only
//! guests) for wasm32-wasip2, and the Flexvolume driver as it ships
//! (statically linked), and writes their paths as constants, so a missing
//! or broken one fails the host's test build instead of skipping.

use std::env;
use std::path::PathBuf;
use std::process::Command;

/// (constant, cargo package, artifact file stem)
const GUESTS: &[(&str, &str, &str)] = &[
    ("RBD", "policy-rbd", "policy_rbd"),
    ("NBD", "policy-nbd", "policy_nbd"),
    ("LOCAL_PV", "policy-local-pv", "policy_local_pv"),
    ("GLUSTER", "policy-gluster", "policy_gluster"),
    ("NFS", "policy-nfs", "policy_nfs"),
    ("MISBEHAVE", "test-guest-misbehave", "test_guest_misbehave"),
    ("NET_IMPORT", "test-guest-net-import", "test_guest_net_import"),
    ("WRONG_WORLD", "test-guest-wrong-world", "test-guest-wrong-world"),
    ("SHARED_FILE", "test-guest-shared-file", "test_guest_shared_file"),
    ("CORE_ONLY", "test-guest-core-only", "test_guest_core_only"),
    ("LOCAL_PV_STRICT", "test-guest-local-pv-strict", "test_guest_local_pv_strict"),
];

/// Guests built in a target dir of their own: they wrap a backend's crate,
/// whose component (built without its exports) would otherwise replace the
/// backend's own in the shared dir.
const APART: &[&str] = &["test-guest-local-pv-strict"];

fn main() {
    let manifest =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let root = manifest.join("../..").canonicalize().expect("workspace root");
    for dir in
        ["wit", "guest-plugins", "tests/guests", "protocol", "flex", "Cargo.toml", "Cargo.lock"]
    {
        println!("cargo:rerun-if-changed={}", root.join(dir).display());
    }
    // A target dir of its own: the outer cargo holds the lock on its own.
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let target_dir =
        env::var_os("VOLAGENT_GUEST_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| {
            out.ancestors().nth(4).expect("OUT_DIR is inside the target dir").join("guests")
        });

    // One build per guest: cargo unifies the features of the packages one
    // build selects, and a guest imports the SDK's device interfaces only
    // of the features it asks for.
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let dir_of = |package: &str| {
        if APART.contains(&package) { target_dir.join(package) } else { target_dir.clone() }
    };
    for (_, package, _) in GUESTS {
        let mut cmd = Command::new(&cargo);
        cmd.current_dir(&root)
            .args(["build", "--profile", "guest", "--target", "wasm32-wasip2", "--target-dir"])
            .arg(dir_of(package))
            .args(["-p", package]);
        // Flags meant for the host build must not leak into the guest build.
        for var in [
            "CARGO_ENCODED_RUSTFLAGS",
            "RUSTFLAGS",
            "CARGO_BUILD_TARGET",
            "CARGO_TARGET_DIR",
            "RUSTC_WORKSPACE_WRAPPER",
        ] {
            cmd.env_remove(var);
        }
        let status = cmd.status().expect("run cargo for the guests");
        assert!(
            status.success(),
            "building guest {package} failed (is the wasm32-wasip2 target installed? run scripts/setup)"
        );
    }

    let mut consts = String::new();
    consts.push_str(&format!(
        "pub const FLEX_DRIVER: &str = {:?};\n",
        flex_driver(&root, &out).display().to_string()
    ));
    for (name, package, stem) in GUESTS {
        let path = dir_of(package).join("wasm32-wasip2/guest").join(format!("{stem}.wasm"));
        assert!(path.is_file(), "guest artifact {} is missing", path.display());
        consts.push_str(&format!("pub const {name}: &str = {:?};\n", path.display().to_string()));
    }
    std::fs::write(out.join("guests.rs"), consts).expect("write guests.rs");
}

/// The driver, built as scripts/build-flex builds it (same flags, same dir).
fn flex_driver(root: &std::path::Path, out: &std::path::Path) -> PathBuf {
    let target_dir = out.ancestors().nth(4).expect("OUT_DIR is inside the target dir").join("flex");
    let triple = env::var("TARGET").expect("cargo sets TARGET");
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
        .args([
            "build",
            "--quiet",
            "--release",
            "--locked",
            "-p",
            "volagent-flex",
            "--target",
            &triple,
            "--target-dir",
        ])
        .arg(&target_dir);
    for var in [
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
        "RUSTC_WORKSPACE_WRAPPER",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("RUSTFLAGS", "-C target-feature=+crt-static");
    let status = cmd.status().expect("run cargo for the Flexvolume driver");
    assert!(status.success(), "building the Flexvolume driver failed");
    let path = target_dir.join(&triple).join("release/volagent-flex");
    assert!(path.is_file(), "the Flexvolume driver {} is missing", path.display());
    path
}
