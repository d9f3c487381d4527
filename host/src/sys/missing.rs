//! A capability this node lacks (no nbd module, no rbd module, no
//! rbd-fuse), found so at start-up and passed in as such: each action
//! refuses with one message naming the capability and why, and each look
//! answers what is true without it (nothing connected, nothing mapped).

use super::krbd::KernelMapping;
use super::rbd_export::{CephClient, RbdTarget};
use super::{KernelRbd, RbdFuse, SysError};
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct Missing {
    /// What is missing, as people call it ("kernel NBD").
    capability: &'static str,
    /// Why, as found at start-up.
    why: String,
}

impl Missing {
    pub fn new(capability: &'static str, why: impl Into<String>) -> Missing {
        let missing = Missing { capability, why: why.into() };
        tracing::info!("{}: {}", missing.capability, missing.why);
        missing
    }

    /// The refusal of an action on `what` (an export, an image).
    pub(crate) fn refuse(&self, what: impl Into<PathBuf>) -> SysError {
        SysError::Refused { path: what.into(), what: format!("{}: {}", self.capability, self.why) }
    }
}

impl KernelRbd for Missing {
    fn available(&self) -> bool {
        false
    }

    fn map(
        &self,
        _client: &CephClient,
        pool: &str,
        image: &str,
        _read_only: bool,
    ) -> Result<(KernelMapping, bool), SysError> {
        Err(self.refuse(format!("rbd image {pool}/{image}")))
    }

    fn mappings(&self) -> Result<Vec<KernelMapping>, SysError> {
        Ok(Vec::new())
    }

    fn unmap(&self, id: u32, _force: bool) -> Result<(), SysError> {
        Err(self.refuse(format!("/dev/rbd{id}")))
    }
}

impl RbdFuse for Missing {
    fn available(&self) -> bool {
        false
    }

    fn connect(&self, key: &str, target: &RbdTarget, _read_only: bool) -> Result<bool, SysError> {
        Err(self.refuse(format!("rbd image {}/{} ({key})", target.pool, target.image)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_name_the_capability_and_why_and_looks_find_nothing() {
        let missing = Missing::new("kernel RBD", "the rbd module is not loaded on this node");
        let client = CephClient {
            conf: None,
            monitors: Some("10.0.0.1:6789".into()),
            user: "admin".into(),
            keyring: None,
            key: None,
        };
        let e = missing.map(&client, "rbd", "img1", false).unwrap_err();
        assert_eq!(
            e.to_string(),
            "rbd image rbd/img1: kernel RBD: the rbd module is not loaded on this node"
        );
        assert!(!KernelRbd::available(&missing));
        assert!(missing.mappings().unwrap().is_empty());
    }
}
