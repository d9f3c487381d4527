//! `volagent plugin new NAME`: a backend crate that builds to a component
//! and passes `volagent plugin test` as written — the SDK this agent was
//! built with (and its copy of the contract), a `StagedBackend` skeleton
//! with native unit tests, a scenario file and a README.

use std::path::{Path, PathBuf};

/// The SDK as this agent was built with it: (path in the new crate, text).
const SDK: &[(&str, &str)] = &[
    ("Cargo.toml", include_str!("../../../guest-plugins/sdk/Cargo.toml")),
    ("wit/policy.wit", include_str!("../../../guest-plugins/sdk/wit/policy.wit")),
    ("src/lib.rs", include_str!("../../../guest-plugins/sdk/src/lib.rs")),
    ("src/model.rs", include_str!("../../../guest-plugins/sdk/src/model.rs")),
    ("src/glue.rs", include_str!("../../../guest-plugins/sdk/src/glue.rs")),
    ("src/staged.rs", include_str!("../../../guest-plugins/sdk/src/staged.rs")),
    ("src/plans.rs", include_str!("../../../guest-plugins/sdk/src/plans.rs")),
    ("src/fence.rs", include_str!("../../../guest-plugins/sdk/src/fence.rs")),
    ("src/options.rs", include_str!("../../../guest-plugins/sdk/src/options.rs")),
    ("src/fake.rs", include_str!("../../../guest-plugins/sdk/src/fake.rs")),
    ("src/provision.rs", include_str!("../../../guest-plugins/sdk/src/provision.rs")),
    ("src/provision_glue.rs", include_str!("../../../guest-plugins/sdk/src/provision_glue.rs")),
];

/// The new crate's own files: (path, template).
const TEMPLATE: &[(&str, &str)] = &[
    ("Cargo.toml", include_str!("template/Cargo.toml.tmpl")),
    ("src/lib.rs", include_str!("template/lib.rs.tmpl")),
    ("scenarios/{{name}}.yaml", include_str!("template/scenarios.yaml.tmpl")),
    ("README.md", include_str!("template/README.md.tmpl")),
    (".gitignore", "/target\n"),
];

/// Where the SDK goes in the new crate.
const SDK_DIR: &str = "volagent-guest-sdk";

#[derive(Debug, thiserror::Error)]
pub enum NewError {
    #[error(
        "{name:?} is not a backend name: a DNS label (lower-case letters, digits and '-', at most 63, not starting or ending with '-')"
    )]
    Name { name: String },
    #[error("{}: already exists and is not empty; choose another --dir", dir.display())]
    NotEmpty { dir: PathBuf },
    #[error("{}: {source}", path.display())]
    Write { path: PathBuf, source: std::io::Error },
}

fn dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// Write the crate for backend `name` into `dir` (made; it must not exist
/// or be empty). The paths written, relative to `dir`.
pub fn write(name: &str, dir: &Path) -> Result<Vec<PathBuf>, NewError> {
    if !dns_label(name) {
        return Err(NewError::Name { name: name.to_string() });
    }
    let occupied = std::fs::read_dir(dir).map(|mut d| d.next().is_some()).unwrap_or(false);
    if occupied {
        return Err(NewError::NotEmpty { dir: dir.to_path_buf() });
    }
    let fill = |text: &str| {
        text.replace("{{name}}", name)
            .replace("{{crate}}", &name.replace('-', "_"))
            .replace("{{contract}}", crate::policy::CONTRACT_VERSION)
    };
    let files = TEMPLATE
        .iter()
        .map(|(path, text)| (PathBuf::from(fill(path)), fill(text)))
        .chain(SDK.iter().map(|(path, text)| (Path::new(SDK_DIR).join(path), text.to_string())));
    let mut written = Vec::new();
    for (relative, text) in files {
        let path = dir.join(&relative);
        let err = |source| NewError::Write { path: path.clone(), source };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(err)?;
        }
        std::fs::write(&path, text).map_err(err)?;
        written.push(relative);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_labels() {
        for good in ["nfs", "my-store", "s3fs2"] {
            assert!(dns_label(good), "{good}");
        }
        for bad in ["", "NFS", "-nfs", "nfs-", "a_b", "../x", &"x".repeat(64)] {
            assert!(!dns_label(bad), "{bad}");
        }
    }

    #[test]
    fn the_crate_is_written_once_with_the_sdk_and_the_name_filled_in() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().join("demo");
        let written = write("my-store", &dir).expect("write");
        assert!(written.contains(&PathBuf::from("scenarios/my-store.yaml")));
        assert!(dir.join("volagent-guest-sdk/wit/policy.wit").is_file());
        let lib = std::fs::read_to_string(dir.join("src/lib.rs")).expect("lib.rs");
        assert!(lib.contains("const NAME: &'static str = \"my-store\";"));
        assert!(!lib.contains("{{"), "a placeholder is left");
        let readme = std::fs::read_to_string(dir.join("README.md")).expect("README");
        assert!(readme.contains("policy_my_store.wasm"));
        // Never over a crate that is there.
        assert!(matches!(write("my-store", &dir), Err(NewError::NotEmpty { .. })));
        assert!(matches!(write("My Store", &tmp.path().join("x")), Err(NewError::Name { .. })));
    }
}
