//! Credentials kubelet hands a mount (`kubernetes.io/secret/<key>`, the
//! base64 of each value of the volume's Secret): kept host-side only. A
//! guest sees the keys, never a value; values are never logged (their
//! `Debug` is redacted) and are wiped from memory when dropped.

use base64::Engine;
use std::collections::BTreeMap;
use zeroize::{Zeroize, Zeroizing};

/// One secret value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn new(value: Vec<u8>) -> Secret {
        Secret(value)
    }

    pub fn expose(&self) -> &[u8] {
        &self.0
    }

    /// The value as a Ceph key: base64 text (surrounding whitespace, as a
    /// Secret made from a file has, dropped). Anything else is refused,
    /// since the key is written into a keyring file line.
    pub fn ceph_key(&self, name: &str) -> Result<String, String> {
        let text = std::str::from_utf8(&self.0)
            .map_err(|_| format!("secret key {name:?} is not text"))?
            .trim();
        let ok = !text.is_empty()
            && text.len() <= 1024
            && text.bytes().all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b));
        if ok {
            Ok(text.to_string())
        } else {
            Err(format!("secret key {name:?} does not hold a Ceph key (base64 text)"))
        }
    }

    /// The Ceph key's bytes, decoded from its base64 ([`ceph_key`]): what
    /// the kernel's keyring takes. Wiped when dropped, as is every copy
    /// made on the way.
    ///
    /// [`ceph_key`]: Self::ceph_key
    pub fn ceph_key_bytes(&self, name: &str) -> Result<Zeroizing<Vec<u8>>, String> {
        let text = Zeroizing::new(self.ceph_key(name)?);
        // Room for all of it up front: a vector that grows leaves copies behind.
        let mut bytes =
            Zeroizing::new(Vec::with_capacity(base64::decoded_len_estimate(text.len()) + 3));
        base64::engine::general_purpose::STANDARD
            .decode_vec(text.as_bytes(), &mut bytes)
            .map_err(|_| format!("secret key {name:?} does not hold a Ceph key (base64 text)"))?;
        Ok(bytes)
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes, redacted>)", self.0.len())
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

/// A volume's secret values by key.
pub type Secrets = BTreeMap<String, Secret>;

/// Longest a secret value kubelet sends may be (base64, before decoding).
pub const MAX_SECRET: usize = 64 * 1024;

/// The secret values in kubelet's options, decoded; a malformed one is
/// refused, naming its key (never its value).
pub fn from_options(options: &BTreeMap<String, String>) -> Result<Secrets, String> {
    let mut secrets = Secrets::new();
    for (option, value) in options {
        let Some(key) = option.strip_prefix("kubernetes.io/secret/") else { continue };
        if value.len() > MAX_SECRET {
            return Err(format!(
                "secret value {key:?} is {} bytes long, more than the {MAX_SECRET} allowed",
                value.len()
            ));
        }
        let decoded =
            base64::engine::general_purpose::STANDARD.decode(value.trim()).map_err(|_| {
                format!("secret value {key:?} is not base64, as kubelet sends secret values")
            })?;
        secrets.insert(key.to_string(), Secret(decoded));
    }
    Ok(secrets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn values_are_decoded_and_never_shown() {
        let s =
            from_options(&opts(&[("kubernetes.io/secret/key", "QVFCdTN3TnI="), ("pool", "rbd")]))
                .unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s["key"].expose(), b"AQBu3wNr");
        assert_eq!(s["key"].ceph_key("key").unwrap(), "AQBu3wNr");
        let shown = format!("{s:?}");
        assert!(!shown.contains("AQB") && shown.contains("redacted"), "{shown}");
    }

    #[test]
    fn malformed_values_are_refused_by_key() {
        let e = from_options(&opts(&[("kubernetes.io/secret/key", "not base64!")])).unwrap_err();
        assert!(e.contains("\"key\"") && !e.contains("not base64!"), "{e}");
        let long = "A".repeat(MAX_SECRET + 4);
        assert!(
            from_options(&opts(&[("kubernetes.io/secret/k", &long)]))
                .unwrap_err()
                .contains("allowed")
        );
        // A key that would add lines to a keyring file.
        let injected = Secret::new(b"AQB=\n[client.admin]\nkey = x".to_vec());
        assert!(injected.ceph_key("key").is_err());
        assert_eq!(Secret::new(b"  AQB+/x==\n".to_vec()).ceph_key("key").unwrap(), "AQB+/x==");
    }

    #[test]
    fn a_ceph_key_is_decoded_for_the_kernel() {
        assert_eq!(
            Secret::new(b" QVFCdTN3TnI=\n".to_vec()).ceph_key_bytes("key").unwrap().as_slice(),
            b"AQBu3wNr"
        );
        // Base64's letters, but not base64: refused, naming the key only.
        let e = Secret::new(b"QVFC=dTN3".to_vec()).ceph_key_bytes("key").unwrap_err();
        assert!(e.contains("\"key\"") && !e.contains("QVFC"), "{e}");
        assert!(Secret::new(b"AQB=\n[client.admin]".to_vec()).ceph_key_bytes("key").is_err());
    }
}
