//! Loading a backend component: size and format checks, compile, import
//! allow-list, contract export and version, link, and `info`.

use super::contract::{self, Linked};
use super::invoke::CallError;
use super::queries::RecordedQueries;
use super::runtime::Runtime;
use super::{COMPAT_VERSIONS, CONTRACT_PACKAGE, CONTRACT_VERSION, POLICY_INTERFACE};
use crate::model::BackendInfo;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// WASI interfaces a std Rust guest imports even when it does no I/O. They
/// are linked to an empty context: no preopens, environment or arguments.
const ALLOWED_WASI_PACKAGES: &[&str] =
    &["wasi:cli/", "wasi:clocks/", "wasi:io/", "wasi:random/", "wasi:filesystem/"];
/// Our own interfaces a guest may import.
const ALLOWED_OWN_INTERFACES: &[&str] = &[
    "host",
    "types",
    "loop-devices",
    "nbd",
    "ceph",
    "provisioning",
    "ceph-provisioning",
    "gluster-provisioning",
    "local-provisioning",
];

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{}: cannot read: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}: the file is empty, not a WebAssembly component", path.display())]
    Empty { path: PathBuf },
    #[error("{}: {size} bytes is over the limit of {max} bytes for a plugin file", path.display())]
    TooLarge { path: PathBuf, size: u64, max: u64 },
    #[error("{}: not a WebAssembly file (it does not start with \\0asm)", path.display())]
    NotWasm { path: PathBuf },
    #[error("{}: a core WebAssembly module, not a component; build the policy with `cargo build --target wasm32-wasip2`", path.display())]
    CoreModule { path: PathBuf },
    #[error("{}: not a valid WebAssembly component: {message}", path.display())]
    Compile { path: PathBuf, message: String },
    #[error("{}: imports `{import}`, which a backend may not use (allowed: {CONTRACT_PACKAGE}/host of the contract it exports and the WASI cli, clocks, io, random and filesystem interfaces, linked with no access)", path.display())]
    DisallowedImport { path: PathBuf, import: String },
    #[error("{}: does not export {CONTRACT_PACKAGE}/{POLICY_INTERFACE}, so it is not a volagent backend (its exports: {exports})", path.display())]
    WrongWorld { path: PathBuf, exports: String },
    #[error("{}: built for {found}, which this host ({CONTRACT_PACKAGE}@{CONTRACT_VERSION}, also serving {}) cannot serve: {why}", path.display(), COMPAT_VERSIONS.join(", "))]
    IncompatibleVersion { path: PathBuf, found: String, why: String },
    #[error("{}: does not match the {CONTRACT_PACKAGE}@{CONTRACT_VERSION} contract: {message}", path.display())]
    Contract { path: PathBuf, message: String },
    #[error("{}: its info call failed: {source}", path.display())]
    Info { path: PathBuf, source: CallError },
    #[error("{}: its info is invalid: {reason}", path.display())]
    BadInfo { path: PathBuf, reason: String },
}

/// A loaded, checked backend, ready to be called. Cheap to share.
pub struct Plugin {
    pub(crate) pre: Arc<dyn Linked>,
    pub(crate) runtime: Arc<Runtime>,
    pub(crate) name: Arc<str>,
    /// Instances made ahead of calls.
    pub(crate) spares: Arc<super::prewarm::Prewarmed>,
    info: BackendInfo,
    path: PathBuf,
    sha256: String,
    size: u64,
    imports: Vec<String>,
    export: String,
    /// What sees its calls (the agent's recorder and shadow), once set.
    pub(crate) tap: std::sync::OnceLock<Arc<dyn super::recorded::Tap>>,
}

impl Plugin {
    /// Read and load `path`: a regular file (never a FIFO or device, which
    /// could block or never end), refused when oversized before it is read.
    pub fn load_file(runtime: &Arc<Runtime>, path: &Path) -> Result<Plugin, LoadError> {
        let max = runtime.limits.max_file_bytes;
        let size = std::fs::metadata(path)
            .map_err(|source| LoadError::Read { path: path.to_path_buf(), source })?
            .len();
        if size > max {
            return Err(LoadError::TooLarge { path: path.to_path_buf(), size, max });
        }
        let bytes = match crate::sys::beneath::read_file(path, max) {
            Ok(bytes) => bytes,
            Err(crate::sys::SysError::Io { source, .. }) => {
                return Err(LoadError::Read { path: path.to_path_buf(), source });
            }
            Err(e) => {
                return Err(LoadError::Read {
                    path: path.to_path_buf(),
                    source: std::io::Error::other(e.to_string()),
                });
            }
        };
        Self::load_bytes(runtime, path, &bytes)
    }

    /// Load a component from bytes; `path` names it in errors.
    pub fn load_bytes(
        runtime: &Arc<Runtime>,
        path: &Path,
        bytes: &[u8],
    ) -> Result<Plugin, LoadError> {
        Self::load_with(runtime, path, bytes, true)
    }

    /// Load a candidate version, called in the shadow of the serving one:
    /// checked as any other, but with no instances made ahead for it.
    pub fn load_candidate(
        runtime: &Arc<Runtime>,
        path: &Path,
        bytes: &[u8],
    ) -> Result<Plugin, LoadError> {
        Self::load_with(runtime, path, bytes, false)
    }

    fn load_with(
        runtime: &Arc<Runtime>,
        path: &Path,
        bytes: &[u8],
        warm: bool,
    ) -> Result<Plugin, LoadError> {
        let path_buf = || path.to_path_buf();
        let size = bytes.len() as u64;
        if size == 0 {
            return Err(LoadError::Empty { path: path_buf() });
        }
        if size > runtime.limits.max_file_bytes {
            return Err(LoadError::TooLarge {
                path: path_buf(),
                size,
                max: runtime.limits.max_file_bytes,
            });
        }
        check_header(path, bytes)?;
        let sha256 = hex::encode(Sha256::digest(bytes));
        let component = runtime
            .compiled
            .get(&sha256, bytes)
            .map_err(|e| LoadError::Compile { path: path_buf(), message: format!("{e:#}") })?;

        let ty = component.component_type();
        let exports: Vec<String> =
            ty.exports(&runtime.engine).map(|(name, _)| name.to_string()).collect();
        let (export, contract) = find_policy_export(path, &exports)?;
        let imports: Vec<String> =
            ty.imports(&runtime.engine).map(|(name, _)| name.to_string()).collect();
        if let Some(bad) = imports.iter().find(|i| !import_allowed(i, contract)) {
            return Err(LoadError::DisallowedImport { path: path_buf(), import: bad.clone() });
        }

        let contract_err = |e: wasmtime::Error| LoadError::Contract {
            path: path_buf(),
            message: format!("{e:#}"),
        };
        let instance_pre = runtime.linker.instantiate_pre(&component).map_err(contract_err)?;
        let pre = contract::link(contract, instance_pre).map_err(contract_err)?;

        let provisional: Arc<str> =
            Arc::from(path.file_stem().and_then(|s| s.to_str()).unwrap_or("plugin"));
        let info = super::invoke::call_info(
            runtime,
            &pre,
            &provisional,
            Arc::new(RecordedQueries::default()),
        )
        .map_err(|source| LoadError::Info { path: path_buf(), source })?;
        check_info(&info).map_err(|reason| LoadError::BadInfo { path: path_buf(), reason })?;
        let name: Arc<str> = Arc::from(info.name.as_str());
        // Every check passed: kept for the next load of these bytes.
        runtime.compiled.keep(&sha256, &component);
        let spares = if warm {
            let spares = super::prewarm::Prewarmed::new(pre.clone(), name.clone());
            runtime.register_spares(&spares);
            runtime.prewarmer.retire(None, &spares);
            spares
        } else {
            super::prewarm::Prewarmed::cold(pre.clone(), name.clone())
        };
        Ok(Plugin {
            pre,
            runtime: runtime.clone(),
            name,
            spares,
            info,
            path: path_buf(),
            sha256,
            size,
            imports,
            export,
            tap: std::sync::OnceLock::new(),
        })
    }

    /// Let `tap` see every call of this backend from now on; a tap once
    /// set stays (false when one was set already).
    pub fn set_tap(&self, tap: Arc<dyn super::recorded::Tap>) -> bool {
        self.tap.set(tap).is_ok()
    }

    pub fn info(&self) -> &BackendInfo {
        &self.info
    }
    /// Calls so far that found an instance made ahead (the others made
    /// their own): what a bench splits its figures by.
    pub fn instances_taken_ready(&self) -> u64 {
        self.spares.taken()
    }
    /// The limits each call runs under.
    pub fn limits(&self) -> &super::Limits {
        &self.runtime.limits
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn sha256(&self) -> &str {
        &self.sha256
    }
    pub fn size(&self) -> u64 {
        self.size
    }
    pub fn imports(&self) -> &[String] {
        &self.imports
    }
    /// The policy export's full name, e.g. `volagent:policy/policy@0.5.0`.
    pub fn export(&self) -> &str {
        &self.export
    }
    /// The optional interfaces of its contract the guest exports (of 1.x:
    /// `block-volumes`, `expand`, `health`); the host does without the rest.
    pub fn optional_exports(&self) -> Vec<&'static str> {
        self.pre.optional()
    }

    /// The contract version the guest is served under, e.g. `0.5.0`.
    pub fn contract(&self) -> &'static str {
        self.pre.version()
    }
}

fn check_header(path: &Path, bytes: &[u8]) -> Result<(), LoadError> {
    if bytes.len() < 8 || &bytes[0..4] != b"\0asm" {
        return Err(LoadError::NotWasm { path: path.to_path_buf() });
    }
    // Bytes 6..8 are the layer: 0 for a core module, 1 for a component.
    if bytes[6..8] == [0, 0] {
        return Err(LoadError::CoreModule { path: path.to_path_buf() });
    }
    Ok(())
}

/// `name@version` → (name, version).
fn split_version(name: &str) -> (&str, Option<&str>) {
    match name.split_once('@') {
        Some((n, v)) => (n, Some(v)),
        None => (name, None),
    }
}

/// Whether a guest built for `found` is served under `contract`: from 1.0
/// on, the same major version and a minor version no later than the
/// host's (a minor version only adds); before 1.0, the same minor version.
fn same_line(found: &str, contract: &str) -> bool {
    let (Ok(found), Ok(ours)) = (semver::Version::parse(found), semver::Version::parse(contract))
    else {
        return false;
    };
    found.major == ours.major
        && if ours.major == 0 { found.minor == ours.minor } else { found.minor <= ours.minor }
}

/// Why a guest built for `found` is not served, for the one who built it.
fn why_not_served(found: &str) -> String {
    let ours = semver::Version::parse(CONTRACT_VERSION).ok();
    match (semver::Version::parse(found), ours) {
        (Ok(f), Some(o)) if f.major == o.major && f.minor > o.minor => format!(
            "it is newer than this host; upgrade the agent, or build the policy against {CONTRACT_VERSION}"
        ),
        (Ok(f), Some(o)) if f.major > o.major => format!(
            "a later major version than this host's; upgrade the agent, or build the policy against {CONTRACT_VERSION}"
        ),
        (Ok(_), _) => {
            format!("no adapter is kept for it; rebuild the policy against {CONTRACT_VERSION}")
        }
        (Err(_), _) => "not a semantic version".to_string(),
    }
}

/// The contract this host serves a guest speaking `found` under: its own,
/// or one it keeps an adapter for.
pub(crate) fn contract_of(found: &str) -> Option<&'static str> {
    std::iter::once(CONTRACT_VERSION)
        .chain(COMPAT_VERSIONS.iter().copied())
        .find(|c| same_line(found, c))
}

/// Our own interfaces only of the contract the guest exports (a guest
/// mixing versions would get one version's types for another's).
fn import_allowed(import: &str, contract: &str) -> bool {
    let (name, version) = split_version(import);
    if let Some(iface) = name.strip_prefix(CONTRACT_PACKAGE).and_then(|r| r.strip_prefix('/')) {
        return ALLOWED_OWN_INTERFACES.contains(&iface)
            && version.is_some_and(|v| same_line(v, contract));
    }
    ALLOWED_WASI_PACKAGES.iter().any(|p| name.starts_with(p))
}

/// The policy export and the contract it is served under.
fn find_policy_export(
    path: &Path,
    exports: &[String],
) -> Result<(String, &'static str), LoadError> {
    let wanted = format!("{CONTRACT_PACKAGE}/{POLICY_INTERFACE}");
    let Some(export) = exports.iter().find(|e| split_version(e).0 == wanted) else {
        let list = if exports.is_empty() { "none".to_string() } else { exports.join(", ") };
        return Err(LoadError::WrongWorld { path: path.to_path_buf(), exports: list });
    };
    match split_version(export).1.and_then(contract_of) {
        Some(contract) => Ok((export.clone(), contract)),
        None => Err(LoadError::IncompatibleVersion {
            path: path.to_path_buf(),
            found: export.clone(),
            why: why_not_served(split_version(export).1.unwrap_or("")),
        }),
    }
}

/// Backend names become driver names and file names: a DNS label.
fn check_info(info: &BackendInfo) -> Result<(), String> {
    let name = &info.name;
    let label_ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if !label_ok {
        return Err(format!(
            "name {name:?} must be a DNS label (lower-case letters, digits, '-', at most 63)"
        ));
    }
    if semver::Version::parse(&info.version).is_err() {
        return Err(format!(
            "version {:?} of backend {name} is not a semantic version",
            info.version
        ));
    }
    let caps = &info.capabilities;
    if caps.steps.is_empty() {
        return Err(format!("backend {name} declares no steps"));
    }
    for fs in caps.filesystems.iter().chain(&caps.network_filesystems) {
        if fs.is_empty() || !fs.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_')
        {
            return Err(format!(
                "backend {name} declares filesystem {fs:?}, which is not a filesystem type name"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        assert_eq!(contract_of("0.5.0"), Some("0.5.0"));
        assert_eq!(contract_of("0.5.7"), Some("0.5.0"));
        assert_eq!(
            contract_of("0.4.0"),
            Some("0.4.0"),
            "0.4 guests are served through the adapter"
        );
        assert_eq!(contract_of("0.4.2"), Some("0.4.0"));
        assert_eq!(contract_of("0.1.0"), None, "0.2 changed nbd-spec: a 0.1 guest is refused");
        assert_eq!(contract_of("0.2.0"), None, "0.3 changed rbd-spec: a 0.2 guest is refused");
        assert_eq!(
            contract_of("0.3.0"),
            None,
            "0.4 added the clear-directory step: a 0.3 guest is refused"
        );
        assert_eq!(contract_of("0.6.0"), None);
        assert_eq!(contract_of("1.0.0"), Some("1.1.0"), "1.0 guests are served as they are");
        assert_eq!(contract_of("1.0.4"), Some("1.1.0"));
        assert_eq!(contract_of("1.1.0"), Some("1.1.0"));
        assert_eq!(contract_of("1.2.0"), None, "a later minor version than the host's");
        assert_eq!(contract_of("2.0.0"), None);
        assert_eq!(contract_of("garbage"), None);
        assert!(why_not_served("1.2.0").contains("newer than this host"));
        assert!(why_not_served("0.3.0").contains("rebuild the policy against 1.1.0"));
    }

    #[test]
    fn a_later_minor_guest_is_refused_naming_both_versions() {
        let p = Path::new("x.wasm");
        let e = find_policy_export(p, &["volagent:policy/policy@1.2.0".into()]).unwrap_err();
        let message = e.to_string();
        assert!(message.contains("built for volagent:policy/policy@1.2.0"), "{message}");
        assert!(message.contains("volagent:policy@1.1.0"), "{message}");
        assert!(message.contains("upgrade the agent"), "{message}");
    }

    #[test]
    fn import_allow_list() {
        assert!(import_allowed("volagent:policy/host@1.0.0", "1.0.0"));
        assert!(import_allowed("volagent:policy/ceph@1.0.0", "1.0.0"));
        assert!(!import_allowed("volagent:policy/host@1.1.0", "1.0.0"));
        assert!(import_allowed("volagent:policy/ceph-provisioning@1.1.0", "1.1.0"));
        assert!(import_allowed("volagent:policy/gluster-provisioning@1.1.0", "1.1.0"));
        assert!(!import_allowed("volagent:policy/gluster-provisioning@1.1.0", "1.0.0"));
        assert!(import_allowed("volagent:policy/local-provisioning@1.1.0", "1.1.0"));
        assert!(import_allowed("volagent:policy/host@0.5.0", "0.5.0"));
        assert!(import_allowed("volagent:policy/types@0.5.2", "0.5.0"));
        assert!(import_allowed("volagent:policy/host@0.4.0", "0.4.0"));
        assert!(
            !import_allowed("volagent:policy/host@0.4.0", "0.5.0"),
            "one contract's imports with another's export"
        );
        assert!(!import_allowed("volagent:policy/host@0.1.0", "0.5.0"));
        assert!(!import_allowed("volagent:policy/host", "0.5.0"));
        assert!(!import_allowed("volagent:policy/secrets@0.5.0", "0.5.0"));
        assert!(import_allowed("wasi:cli/environment@0.2.3", "0.5.0"));
        assert!(import_allowed("wasi:io/streams@0.2.0", "0.5.0"));
        assert!(!import_allowed("wasi:sockets/tcp@0.2.0", "0.5.0"));
        assert!(!import_allowed("wasi:http/outgoing-handler@0.2.0", "0.5.0"));
        assert!(!import_allowed("evil:thing/x", "0.5.0"));
    }

    #[test]
    fn export_version_is_checked() {
        let p = Path::new("x.wasm");
        assert_eq!(
            find_policy_export(p, &["volagent:policy/policy@0.5.3".into()]).unwrap().1,
            "0.5.0"
        );
        assert_eq!(
            find_policy_export(p, &["volagent:policy/policy@0.4.0".into()]).unwrap().1,
            "0.4.0"
        );
        assert!(matches!(
            find_policy_export(p, &["volagent:policy/policy@0.1.0".into()]),
            Err(LoadError::IncompatibleVersion { .. })
        ));
        assert!(matches!(
            find_policy_export(p, &["wasi:cli/run@0.2.0".into()]),
            Err(LoadError::WrongWorld { .. })
        ));
    }

    #[test]
    fn headers() {
        let p = Path::new("x.wasm");
        assert!(matches!(check_header(p, b"hello world"), Err(LoadError::NotWasm { .. })));
        assert!(matches!(check_header(p, b"\0asm\x01\0\0\0"), Err(LoadError::CoreModule { .. })));
        assert!(check_header(p, b"\0asm\x0d\0\x01\0").is_ok());
    }
}
