//! Which policies an agent may load. A `.wasm` of the plugin dir is loaded
//! only when its sha256 is listed for a backend (by the allow-list file, or
//! by the cluster's `BackendPolicy` objects) and the file turns out to be
//! that backend, or when a detached minisign signature beside it
//! (`<file>.minisig`) verifies with a key the admin configured. Anything
//! else is refused before it is compiled: an untrusted file never runs.
//!
//! The allow-list is one `<backend> <sha256>` pair per line; `#` starts a
//! comment; `!<sha256>` revokes a digest (refused even when signed: a
//! signature cannot be taken back). It is read again on every pass over
//! the plugin dir, so listing a refused file's digest lets it load without
//! touching the file.

use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// An allow-list or a key larger than this is refused (a list of a few
/// hundred versions is a few tens of KiB).
const MAX_LIST_BYTES: u64 = 1 << 20;
const MAX_KEY_BYTES: u64 = 4096;
/// A minisign signature is about 300 bytes; a larger file is not one.
const MAX_SIGNATURE_BYTES: u64 = 4096;

/// The end of a detached signature's name: `<file>.minisig`, as minisign
/// names it by default.
pub const SIGNATURE: &str = ".minisig";

/// The default allow-list of an agent.
pub const DEFAULT_ALLOW_LIST: &str = "/etc/volagent/trusted-policies";

#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("{path}: line {line}: {why}")]
    Line { path: String, line: usize, why: String },
    #[error("policy key {path}: {why}")]
    Key { path: String, why: String },
}

/// The trust flags, shared by the agent and the commands that move
/// versions in its plugin dir.
#[derive(Debug, Clone, clap::Args)]
pub struct TrustArgs {
    /// The allow-list: `<backend> <sha256>` per line; a policy listed there
    /// for its backend may be loaded. Read again on every change.
    #[arg(long = "trusted-policies", value_name = "FILE", default_value = DEFAULT_ALLOW_LIST)]
    pub allow_list: PathBuf,
    /// A minisign public key (repeatable): a policy with a detached
    /// signature beside it (`<file>.minisig`) that verifies with one of
    /// these keys may be loaded.
    #[arg(long = "policy-key", value_name = "FILE")]
    pub keys: Vec<PathBuf>,
}

/// Digests listed per backend, and digests revoked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowList {
    by_sha: BTreeMap<String, BTreeSet<String>>,
    revoked: BTreeSet<String>,
}

fn is_backend_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl AllowList {
    /// Parse `text` (the contents of `path`, named in errors). A line that
    /// is not `<backend> <sha256>` fails the whole list: half a list could
    /// leave out the entry meant to replace a bad one.
    pub fn parse(path: &Path, text: &str) -> Result<AllowList, TrustError> {
        let mut list = AllowList::default();
        for (i, line) in text.lines().enumerate() {
            let line_no = i + 1;
            let content = line.split('#').next().unwrap_or_default().trim();
            if content.is_empty() {
                continue;
            }
            let bad = |why: String| TrustError::Line {
                path: path.display().to_string(),
                line: line_no,
                why,
            };
            if let Some(sha) = content.strip_prefix('!') {
                let sha = sha.trim().to_ascii_lowercase();
                if !is_sha256(&sha) {
                    return Err(bad(format!("!{sha:?} does not revoke a sha256 (64 hex digits)")));
                }
                list.revoked.insert(sha);
                continue;
            }
            let fields: Vec<&str> = content.split_whitespace().collect();
            let [backend, sha] = fields[..] else {
                return Err(bad(format!(
                    "{content:?} is not \"<backend> <sha256>\" ({} fields)",
                    fields.len()
                )));
            };
            if !is_backend_name(backend) {
                return Err(bad(format!("{backend:?} is not a backend name (a DNS label)")));
            }
            let sha = sha.to_ascii_lowercase();
            if !is_sha256(&sha) {
                return Err(bad(format!("{sha:?} is not a sha256 (64 hex digits)")));
            }
            list.add(backend, &sha);
        }
        Ok(list)
    }

    pub fn add(&mut self, backend: &str, sha256: &str) {
        self.by_sha.entry(sha256.to_string()).or_default().insert(backend.to_string());
    }

    /// The backends `sha256` is listed for.
    pub fn backends(&self, sha256: &str) -> Option<&BTreeSet<String>> {
        self.by_sha.get(sha256)
    }

    pub fn is_revoked(&self, sha256: &str) -> bool {
        self.revoked.contains(sha256)
    }

    pub fn len(&self) -> usize {
        self.by_sha.values().map(BTreeSet::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_sha.is_empty()
    }

    /// The list as its file holds it, sorted.
    pub fn render(&self) -> String {
        let mut lines: Vec<String> = self
            .by_sha
            .iter()
            .flat_map(|(sha, backends)| backends.iter().map(move |b| format!("{b} {sha}")))
            .collect();
        lines.sort();
        lines.extend(self.revoked.iter().map(|sha| format!("!{sha}")));
        lines.into_iter().map(|l| l + "\n").collect()
    }
}

/// A configured signing key, named by its file.
#[derive(Clone)]
pub struct Key {
    path: PathBuf,
    key: minisign_verify::PublicKey,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key({})", self.path.display())
    }
}

/// The keys of `paths`, read once: a key that cannot be read or decoded is
/// an error (an agent told to trust a key it cannot use must not start).
pub fn read_keys(paths: &[PathBuf]) -> Result<Vec<Key>, TrustError> {
    paths
        .iter()
        .map(|path| {
            let bad = |why: String| TrustError::Key { path: path.display().to_string(), why };
            let bytes = crate::sys::beneath::read_file(path, MAX_KEY_BYTES)
                .map_err(|e| bad(e.to_string()))?;
            let text = String::from_utf8(bytes).map_err(|_| bad("not text".into()))?;
            let key = minisign_verify::PublicKey::decode(text.trim())
                .or_else(|_| minisign_verify::PublicKey::from_base64(text.trim()))
                .map_err(|e| bad(format!("not a minisign public key ({e})")))?;
            Ok(Key { path: path.clone(), key })
        })
        .collect()
}

/// Where trust comes from: the allow-list file (read on each pass), the
/// keys (read once, at start), and the cluster's listing when there is one.
pub struct TrustSources {
    allow_list: PathBuf,
    keys: Vec<Key>,
    cluster: Option<ClusterListing>,
}

/// The digests the cluster's `BackendPolicy` objects list now.
pub type ClusterListing = std::sync::Arc<dyn Fn() -> AllowList + Send + Sync>;

impl TrustSources {
    /// The sources `args` names; its keys must all be usable.
    pub fn new(args: &TrustArgs) -> Result<TrustSources, TrustError> {
        Ok(TrustSources {
            allow_list: args.allow_list.clone(),
            keys: read_keys(&args.keys)?,
            cluster: None,
        })
    }

    /// The cluster's listing counts too.
    pub fn with_cluster(mut self, listing: ClusterListing) -> TrustSources {
        self.cluster = Some(listing);
        self
    }

    pub fn allow_list(&self) -> &Path {
        &self.allow_list
    }

    /// What is trusted now.
    pub fn now(&self) -> Trust {
        Trust::read(&self.allow_list, self.keys.clone(), self.cluster.as_ref().map(|c| c()))
    }
}

/// What the allow-list file held when last read.
#[derive(Debug, Clone)]
enum ListState {
    Absent,
    Read(AllowList),
    /// Unreadable or malformed: nothing is trusted through it.
    Bad(String),
}

/// Why a file may be loaded: the backends its digest is listed for, and
/// the key whose signature beside it verified.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grant {
    pub listed: BTreeSet<String>,
    pub signed: Option<PathBuf>,
}

impl Grant {
    /// Whether the grant covers the backend the file turned out to be: a
    /// signature vouches for the bytes whatever backend they are, a
    /// listing only for the backends it names.
    pub fn covers(&self, backend: &str, sha256: &str) -> Result<(), String> {
        if self.signed.is_some() || self.listed.contains(backend) {
            return Ok(());
        }
        Err(format!(
            "not trusted: sha256 {sha256} is listed for {}, but the file is backend {backend}, and no valid signature vouches for it",
            self.listed.iter().cloned().collect::<Vec<_>>().join(", ")
        ))
    }

    pub fn describe(&self) -> String {
        match &self.signed {
            Some(key) => format!("signed with {}", key.display()),
            None => "listed".into(),
        }
    }
}

/// The trust sources as one pass over the plugin dir sees them.
#[derive(Debug, Clone)]
pub struct Trust {
    allow_list_path: PathBuf,
    list: ListState,
    keys: Vec<Key>,
    /// Digests listed by the cluster's `BackendPolicy` objects, if the
    /// agent runs in a cluster.
    cluster: Option<AllowList>,
}

impl Trust {
    /// Read the allow-list at `path` now (absent is an empty list).
    pub fn read(path: &Path, keys: Vec<Key>, cluster: Option<AllowList>) -> Trust {
        let list = match crate::sys::beneath::read_file(path, MAX_LIST_BYTES) {
            Err(e) if e.is_not_found() => ListState::Absent,
            Err(e) => ListState::Bad(format!("unreadable: {e}")),
            Ok(bytes) => match std::str::from_utf8(&bytes) {
                Err(_) => ListState::Bad(format!("{}: not text", path.display())),
                Ok(text) => match AllowList::parse(path, text) {
                    Ok(list) => ListState::Read(list),
                    Err(e) => ListState::Bad(e.to_string()),
                },
            },
        };
        Trust { allow_list_path: path.to_path_buf(), list, keys, cluster }
    }

    /// A problem with the allow-list itself, to report.
    pub fn problem(&self) -> Option<String> {
        match &self.list {
            ListState::Bad(why) => Some(format!("the allow-list trusts nothing: {why}")),
            _ => None,
        }
    }

    /// What decides whether `sha256` with the signature of digest
    /// `signature` (see [`signature_state`]) is trusted: a refusal is
    /// reconsidered when this changes, and only then (an unrelated line
    /// added to the list does not report every refused file again).
    pub fn state_of(&self, sha256: &str, signature: &str) -> String {
        let mut h = Sha256::new();
        match &self.list {
            ListState::Absent => h.update(b"absent"),
            ListState::Read(l) => {
                h.update(format!("{:?} {}", l.backends(sha256), l.is_revoked(sha256)));
            }
            ListState::Bad(why) => h.update(why),
        }
        h.update(b"\0");
        h.update(format!("{:?}", self.cluster.as_ref().and_then(|c| c.backends(sha256))));
        h.update(b"\0");
        h.update(signature);
        hex::encode(h.finalize())
    }

    /// Whether `bytes` (of digest `sha256`) may be loaded, given the
    /// signature file beside it (`signature`: its name, and its bytes or
    /// why they cannot be read; None when there is none).
    pub fn check(
        &self,
        sha256: &str,
        bytes: &[u8],
        signature: Option<(&str, Result<Vec<u8>, String>)>,
    ) -> Result<Grant, String> {
        if let ListState::Read(list) = &self.list
            && list.is_revoked(sha256)
        {
            return Err(format!(
                "not trusted: sha256 {sha256} is revoked by the allow-list {}",
                self.allow_list_path.display()
            ));
        }
        let mut grant = Grant::default();
        if let ListState::Read(list) = &self.list
            && let Some(b) = list.backends(sha256)
        {
            grant.listed.extend(b.iter().cloned());
        }
        if let Some(b) = self.cluster.as_ref().and_then(|c| c.backends(sha256)) {
            grant.listed.extend(b.iter().cloned());
        }
        // Checked even when listed: a listing for another backend is no
        // grant, and a valid signature still is.
        let verified = signature.map(|(name, sig)| (name, self.verify(name, sig, bytes)));
        if let Some((_, Ok(key))) = &verified {
            grant.signed = Some(key.clone());
        }
        if !grant.listed.is_empty() || grant.signed.is_some() {
            return Ok(grant);
        }
        let not_listed = format!(
            "not trusted: sha256 {sha256} is listed by no BackendPolicy{} and by no line of the allow-list {} ({})",
            if self.cluster.is_some() { "" } else { " (not in a cluster)" },
            self.allow_list_path.display(),
            match &self.list {
                ListState::Absent => "absent".to_string(),
                ListState::Read(l) => format!("{} entries", l.len()),
                ListState::Bad(why) => why.clone(),
            }
        );
        match verified {
            None => Err(format!("{not_listed}, and it has no signature beside it")),
            Some((_, Err(why))) => Err(format!("{not_listed}, and {why}")),
            Some((_, Ok(_))) => unreachable!("a verified signature is a grant"),
        }
    }

    /// The key whose signature (the file `name`, read as `signature`)
    /// verifies `bytes`, or why none does.
    fn verify(
        &self,
        name: &str,
        signature: Result<Vec<u8>, String>,
        bytes: &[u8],
    ) -> Result<PathBuf, String> {
        let text = signature.map_err(|e| format!("its signature {name} is unreadable: {e}"))?;
        if self.keys.is_empty() {
            return Err(format!(
                "its signature {name} cannot be checked: no --policy-key is configured"
            ));
        }
        let text =
            String::from_utf8(text).map_err(|_| format!("its signature {name} is not text"))?;
        let sig = minisign_verify::Signature::decode(&text)
            .map_err(|e| format!("its signature {name} is not a minisign signature ({e})"))?;
        let mut tried = Vec::new();
        for key in &self.keys {
            match key.key.verify(bytes, &sig, false) {
                Ok(()) => return Ok(key.path.clone()),
                Err(e) => tried.push(format!("{}: {e}", key.path.display())),
            }
        }
        Err(format!(
            "its signature {name} verifies with none of the configured keys ({})",
            tried.join("; ")
        ))
    }
}

/// The signature beside the plugin dir's file `name`, read beneath `dir`:
/// its file name, and its bytes or why not; None when there is none.
pub fn signature_beside(dir: &Path, name: &str) -> Option<(String, Result<Vec<u8>, String>)> {
    let sig = format!("{name}{SIGNATURE}");
    match crate::sys::beneath::read_beneath(dir, Path::new(&sig), MAX_SIGNATURE_BYTES) {
        Err(e) if e.is_not_found() => None,
        read => Some((sig, read.map_err(|e| e.to_string()))),
    }
}

/// A digest of the signature beside `name` (or of its absence): part of
/// what a refusal is reconsidered on.
pub fn signature_state(sig: &Option<(String, Result<Vec<u8>, String>)>) -> String {
    match sig {
        None => "none".into(),
        Some((_, Ok(bytes))) => hex::encode(Sha256::digest(bytes)),
        Some((_, Err(e))) => format!("error {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHA: &str = "aa00000000000000000000000000000000000000000000000000000000000001";

    #[test]
    fn an_allow_list_is_backend_and_digest_per_line() {
        let text = format!("# shipped\n\nlocal-pv {SHA}  # 0.1.0\nrbd {}\n", SHA.to_uppercase());
        let list = AllowList::parse(Path::new("/l"), &text).unwrap();
        assert_eq!(list.len(), 2);
        let b: Vec<_> = list.backends(SHA).unwrap().iter().cloned().collect();
        assert_eq!(b, ["local-pv", "rbd"]);
        assert_eq!(AllowList::parse(Path::new("/l"), &list.render()).unwrap(), list);
    }

    #[test]
    fn a_bad_line_fails_the_whole_list_and_names_it() {
        for (text, says) in [
            (format!("local-pv {SHA}\nlocal-pv\n"), "line 2"),
            (format!("Local_PV {SHA}\n"), "not a backend name"),
            ("local-pv abc\n".to_string(), "not a sha256"),
            (format!("local-pv {SHA} extra\n"), "3 fields"),
        ] {
            let e = AllowList::parse(Path::new("/etc/l"), &text).unwrap_err().to_string();
            assert!(e.contains("/etc/l") && e.contains(says), "{e}");
        }
    }

    #[test]
    fn a_listed_digest_is_granted_for_its_backends_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("list");
        std::fs::write(&path, format!("local-pv {SHA}\n")).unwrap();
        let trust = Trust::read(&path, Vec::new(), None);
        let grant = trust.check(SHA, b"x", None).unwrap();
        assert!(grant.covers("local-pv", SHA).is_ok());
        let e = grant.covers("rbd", SHA).unwrap_err();
        assert!(e.contains("listed for local-pv") && e.contains("backend rbd"), "{e}");
        // Revoked: refused, listed or not.
        std::fs::write(&path, format!("local-pv {SHA}\n!{SHA}\n")).unwrap();
        let e = Trust::read(&path, Vec::new(), None).check(SHA, b"x", None).unwrap_err();
        assert!(e.contains("revoked"), "{e}");

        let other = "bb".repeat(32);
        let e = trust.check(&other, b"y", None).unwrap_err();
        assert!(e.contains(&other) && e.contains("no signature") && e.contains("1 entries"), "{e}");
        let e = trust.check(&other, b"y", Some(("f.wasm.minisig", Ok(b"x".to_vec())))).unwrap_err();
        assert!(e.contains("no --policy-key"), "{e}");
    }

    #[test]
    fn a_cluster_listing_counts_and_changes_that_digests_state_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent");
        let alone = Trust::read(&path, Vec::new(), None);
        assert!(alone.check(SHA, b"x", None).unwrap_err().contains("(absent)"));
        let mut c = AllowList::default();
        c.add("nbd", SHA);
        let listed = Trust::read(&path, Vec::new(), Some(c));
        let grant = listed.check(SHA, b"x", None).unwrap();
        assert_eq!(grant.listed, ["nbd".to_string()].into());
        assert_ne!(alone.state_of(SHA, "none"), listed.state_of(SHA, "none"));
        // Another digest's state does not change with this one's listing.
        let other = "cc".repeat(32);
        assert_eq!(alone.state_of(&other, "none"), listed.state_of(&other, "none"));
    }

    /// Made with Debian's minisign 0.11 (`minisign -G -W`, `minisign -S`)
    /// over the bytes "a policy".
    const KEY: &str = "untrusted comment: minisign public key 39D3460AF8A203F9\nRWT5A6L4CkbTOSN4Gmr1fmGZGNQtJdvsMv1EncfPgJtZaBXhkX11tX0l\n";
    const OTHER_KEY: &str = "RWQnn0OBIVbmGAy1jgP3bTzTUb4KhDDt5J1eaD3u6KmAYKCrhLfNChN2";
    const SIGNATURE_OF: &str = "untrusted comment: signature from minisign secret key\nRUT5A6L4CkbTOakxan62SGXEJ/DPyYcsDtr2hg2valKxNeB7j9DMtUwRGEA3JXG3WAESAhTMBTSjLMhHHV9mDycL38ZFK9k7zgo=\ntrusted comment: timestamp:1795927957\tfile:f\thashed\niXz7fp27x5V7ubrYbM9wDHIiUl6QE5Xw1ZM307ViDuOpah3/sttcXA8N45xJj+CXZASuCpyGP3tXgp79jSVHAw==\n";

    #[test]
    fn a_signature_from_a_configured_key_is_a_grant_and_nothing_else_is() {
        let dir = tempfile::tempdir().unwrap();
        let (key, other) = (dir.path().join("k.pub"), dir.path().join("other.pub"));
        std::fs::write(&key, KEY).unwrap();
        std::fs::write(&other, OTHER_KEY).unwrap();
        let sig = |b: &str| Some(("f.wasm.minisig", Ok(b.as_bytes().to_vec())));
        let list = dir.path().join("absent");
        let both = Trust::read(&list, read_keys(&[other.clone(), key.clone()]).unwrap(), None);
        let sha = hex::encode(Sha256::digest(b"a policy"));
        let grant = both.check(&sha, b"a policy", sig(SIGNATURE_OF)).unwrap();
        assert_eq!(grant.signed, Some(key));
        assert!(grant.covers("any-backend", &sha).is_ok(), "a signature vouches for the bytes");
        // Other bytes, another key, garbage: refused, each saying why.
        let e = both.check(&sha, b"a policy!", sig(SIGNATURE_OF)).unwrap_err();
        assert!(e.contains("verifies with none") && e.contains("other.pub"), "{e}");
        let alone = Trust::read(&list, read_keys(&[other]).unwrap(), None);
        assert!(alone.check(&sha, b"a policy", sig(SIGNATURE_OF)).is_err());
        let e = both.check(&sha, b"a policy", sig("nonsense")).unwrap_err();
        assert!(e.contains("not a minisign signature"), "{e}");
        // A key file that is not a key stops the agent from starting.
        std::fs::write(dir.path().join("bad.pub"), "hello").unwrap();
        let e = read_keys(&[dir.path().join("bad.pub")]).unwrap_err().to_string();
        assert!(e.contains("bad.pub") && e.contains("not a minisign public key"), "{e}");
    }

    #[test]
    fn a_malformed_list_trusts_nothing_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("list");
        std::fs::write(&path, format!("local-pv {SHA}\nnonsense\n")).unwrap();
        let trust = Trust::read(&path, Vec::new(), None);
        assert!(trust.problem().is_some_and(|p| p.contains("line 2")));
        assert!(trust.check(SHA, b"x", None).is_err());
    }
}
