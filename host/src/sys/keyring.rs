//! The kernel's keyring, for handing a key to a kernel client by name
//! rather than by value: the kernel's rbd driver, given `key=<name>` in
//! its map line, looks the key up itself, so the key never appears in the
//! line (which sysfs shows for as long as the image is mapped).
//!
//! Which keyring: the calling thread's own. The driver looks the key up
//! with request_key while it parses the line, in the context of the
//! thread writing it, and so searches that thread's thread, process and
//! session keyrings. One thread adds the key, writes the line and removes
//! the key (a [`ThreadKey`] cannot leave its thread): no other thread of
//! the agent, and no other process, possesses the key meanwhile. A
//! session keyring would not do: it is shared with other processes (in a
//! container, usually with all of the container's).

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};

/// The kernel's type for a Ceph key (net/ceph): its payload is the
/// base64-decoded key, as a keyring file holds it encoded.
struct Ceph;

impl keyutils::KeyType for Ceph {
    type Description = str;
    type Payload = [u8];

    fn name() -> &'static str {
        "ceph"
    }
}

/// A key in the calling thread's keyring, under a description unique to
/// it; invalidated (removed from every keyring, then destroyed) when
/// dropped, whatever happened meanwhile.
pub struct ThreadKey {
    key: Option<keyutils::Key>,
    description: String,
    /// Not `Send`: only its thread possesses the key, and so may remove it.
    _thread: PhantomData<*const ()>,
}

impl std::fmt::Debug for ThreadKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadKey({})", self.description)
    }
}

/// Why a key could not be added.
#[derive(Debug, thiserror::Error)]
#[error("adding a {kind} key to the kernel's keyring: {source}")]
pub struct AddError {
    kind: &'static str,
    source: std::io::Error,
}

static NEXT: AtomicU64 = AtomicU64::new(0);

impl ThreadKey {
    /// Add Ceph key `payload` (the key's bytes, decoded from its base64)
    /// to the calling thread's keyring. The kernel checks it is a Ceph
    /// key (EINVAL otherwise).
    pub fn ceph(payload: &[u8]) -> Result<ThreadKey, AddError> {
        Self::add::<Ceph>(payload)
    }

    fn add<K: keyutils::KeyType<Description = str, Payload = [u8]>>(
        payload: &[u8],
    ) -> Result<ThreadKey, AddError> {
        let failed = |e: keyutils::Error| AddError {
            kind: K::name(),
            source: std::io::Error::from_raw_os_error(e.0),
        };
        // Unique in the node: the process, and a count in it.
        let description =
            format!("volagent:{}:{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let mut ring = keyutils::Keyring::attach_or_create(keyutils::SpecialKeyring::Thread)
            .map_err(failed)?;
        let key = ring.add_key::<K, _, _>(description.as_str(), payload).map_err(failed)?;
        Ok(ThreadKey { key: Some(key), description, _thread: PhantomData })
    }

    /// The name to look the key up by.
    pub fn description(&self) -> &str {
        &self.description
    }
}

impl Drop for ThreadKey {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else { return };
        // Invalidating removes it at once, from every keyring that links
        // it; unlinking it from this thread's is the fallback (for a
        // kernel that refused the invalidation).
        let Err(invalidate) = key.clone().invalidate() else { return };
        let unlinked = keyutils::Keyring::attach(keyutils::SpecialKeyring::Thread)
            .and_then(|mut ring| ring.unlink_key(&key));
        if let Err(unlink) = unlinked {
            tracing::warn!(
                "kernel key {} left in the thread's keyring: invalidate: {invalidate}, unlink: {unlink}",
                self.description
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// The lines of /proc/keys that name `description`.
    fn listed(description: &str) -> Vec<String> {
        let keys = std::fs::read_to_string("/proc/keys").unwrap_or_default();
        keys.lines().filter(|l| l.contains(description)).map(str::to_string).collect()
    }

    #[test]
    fn a_key_is_in_the_threads_keyring_until_dropped() {
        // A "user" key: this machine's kernel may lack the Ceph type.
        let key = ThreadKey::add::<keyutils::keytypes::User>(b"payload").unwrap();
        let description = key.description().to_string();
        assert!(
            description.starts_with("volagent:") && !description.contains([',', ' ', '=']),
            "{description}"
        );
        let shown = listed(&description);
        assert_eq!(shown.len(), 1, "{shown:?}");
        assert!(!shown[0].contains("payload"), "{shown:?}");
        let found = keyutils::Keyring::attach(keyutils::SpecialKeyring::Thread)
            .unwrap()
            .search_for_key::<keyutils::keytypes::User, _, _>(
            description.as_str(),
            None::<&mut keyutils::Keyring>,
        );
        assert!(found.is_ok(), "in the thread's keyring: {found:?}");
        let other = ThreadKey::add::<keyutils::keytypes::User>(b"payload").unwrap();
        assert_ne!(other.description(), description, "each key is named apart");
        drop(key);
        // The kernel's garbage collector removes it from the list shortly.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !listed(&description).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(listed(&description).is_empty(), "{:?}", listed(&description));
        assert_eq!(listed(other.description()).len(), 1, "the other stays");
    }

    #[test]
    fn a_payload_the_kernel_refuses_is_an_error() {
        // Not a Ceph key: the Ceph type refuses it (EINVAL); where the
        // kernel lacks the type, add_key fails as well (ENODEV).
        let e = ThreadKey::ceph(b"\x01\x00not a key").unwrap_err();
        assert!(e.to_string().starts_with("adding a ceph key to the kernel's keyring: "), "{e}");
    }
}
