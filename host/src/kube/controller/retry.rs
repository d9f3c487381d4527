//! What a failed reconcile is, and when it runs again: by the error's class
//! (a lost compare-and-swap soon, an unreachable server later, a refusal
//! much later and loudly), backing off exponentially per object while it
//! keeps failing.

use kube::runtime::controller::Action;
use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// A reconcile's failure, naming the object it concerns.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// A call to the API server about `object` failed.
    #[error("{object}: {}", causes(.error))]
    Api { object: String, error: kube::Error },
    /// Every compare-and-swap on `object` lost to another writer.
    #[error("{object} keeps changing: every write conflicted")]
    KeepsChanging { object: String },
    /// A gone node's storage clients of a volume could not all be fenced,
    /// so its consumers stay on the record (a take-over still sees them).
    #[error(
        "Attachment {volume}: node {node}'s storage clients are not all fenced, so its consumers stay"
    )]
    NotFenced { volume: String, node: String },
    /// Provisioning `object` failed; `transient` when a retry may pass.
    #[error("{object}: {message}")]
    Provisioning { object: String, message: String, transient: bool },
}

/// `map_err` for a failed call about `object` ("Kind name").
pub fn api_error(object: impl Into<String>) -> impl FnOnce(kube::Error) -> ReconcileError {
    let object = object.into();
    move |error| ReconcileError::Api { object, error }
}

/// An error with its causes: "client error (Connect)" alone does not say why.
fn causes(error: &kube::Error) -> String {
    let mut out = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// How a failure is retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Another writer won a compare-and-swap: read again and retry soon.
    Conflict,
    /// The API server or the storage could not answer now.
    Transient,
    /// Retrying alone will not help (forbidden, invalid, gone): someone
    /// must change RBAC or the object.
    Permanent,
}

impl ReconcileError {
    /// The API server answered 403.
    fn is_forbidden(&self) -> bool {
        matches!(self, ReconcileError::Api { error: kube::Error::Api(s), .. } if s.code == 403)
    }

    pub fn class(&self) -> ErrorClass {
        match self {
            ReconcileError::Api { error, .. } => class_of(error),
            ReconcileError::KeepsChanging { .. } => ErrorClass::Conflict,
            ReconcileError::NotFenced { .. } => ErrorClass::Transient,
            ReconcileError::Provisioning { transient: true, .. } => ErrorClass::Transient,
            ReconcileError::Provisioning { .. } => ErrorClass::Permanent,
        }
    }
}

/// The class of a failed API call.
pub fn class_of(error: &kube::Error) -> ErrorClass {
    match error {
        kube::Error::Api(s) if s.code == 409 => ErrorClass::Conflict,
        kube::Error::Api(s) if s.code == 408 => ErrorClass::Transient,
        e if crate::kube::ledger::is_transient(e) => ErrorClass::Transient,
        // The connection broke mid-answer, or a token could not be refreshed.
        kube::Error::ReadEvents(_) | kube::Error::Auth(_) => ErrorClass::Transient,
        _ => ErrorClass::Permanent,
    }
}

/// How long after its `failures`-th failure in a row (from 1) an object of
/// `class` is tried again: doubling from the class's first delay, bounded.
pub fn retry_after(class: ErrorClass, failures: u32) -> Duration {
    let (first, most) = match class {
        ErrorClass::Conflict => (Duration::from_millis(250), Duration::from_secs(15)),
        ErrorClass::Transient => (Duration::from_secs(2), Duration::from_secs(300)),
        ErrorClass::Permanent => (Duration::from_secs(300), Duration::from_secs(3600)),
    };
    // Past 2^12 every class is at its bound anyway.
    let doublings = failures.saturating_sub(1).min(12);
    first.saturating_mul(1 << doublings).min(most)
}

/// How many 403s in a row are retried as transient before one is taken
/// for a real refusal: 2 + 4 + 8 s covers an API server's RBAC caches
/// filling after a restart.
const FORBIDDEN_RETRIED_SOON: u32 = 3;

/// The failures in a row of each object ("Kind/name") still failing.
#[derive(Default)]
pub struct Retries {
    failures: Mutex<HashMap<String, u32>>,
}

impl Retries {
    /// The error policy: count the failure of `key` and say when to retry.
    pub fn failed(&self, key: &str, error: &ReconcileError) -> Action {
        let failures = {
            let mut all = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
            let n = all.entry(key.to_string()).or_default();
            *n = n.saturating_add(1);
            *n
        };
        let (class, after) = match error.class() {
            // An API server just restarted answers 403 until its RBAC caches
            // hold the bindings: the first few are retried soon.
            ErrorClass::Permanent if error.is_forbidden() && failures <= FORBIDDEN_RETRIED_SOON => {
                (ErrorClass::Transient, retry_after(ErrorClass::Transient, failures))
            }
            ErrorClass::Permanent if error.is_forbidden() => (
                ErrorClass::Permanent,
                retry_after(ErrorClass::Permanent, failures - FORBIDDEN_RETRIED_SOON),
            ),
            class => (class, retry_after(class, failures)),
        };
        match class {
            ErrorClass::Conflict => {
                tracing::info!(object = key, failures, "{error} (retried in {after:?})");
            }
            ErrorClass::Transient => {
                tracing::warn!(object = key, failures, "{error} (retried in {after:?})");
            }
            ErrorClass::Permanent => tracing::error!(
                object = key,
                failures,
                "{error}: this will not pass by itself (the controller's RBAC, or the object, needs a fix); retried in {after:?}"
            ),
        }
        Action::requeue(after)
    }

    /// `key` reconciled: its next failure starts the backoff afresh.
    pub fn succeeded(&self, key: &str) {
        self.failures.lock().unwrap_or_else(PoisonError::into_inner).remove(key);
    }

    #[cfg(test)]
    fn count(&self, key: &str) -> u32 {
        self.failures.lock().unwrap_or_else(PoisonError::into_inner).get(key).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    fn api(code: u16) -> kube::Error {
        kube::Error::Api(Box::new(Status::failure("refused", "Reason").with_code(code)))
    }

    #[test]
    fn errors_are_classed_by_what_a_retry_can_change() {
        assert_eq!(class_of(&api(409)), ErrorClass::Conflict, "a lost compare-and-swap");
        for code in [408, 429, 500, 503, 504] {
            assert_eq!(class_of(&api(code)), ErrorClass::Transient, "{code}");
        }
        for code in [400, 401, 403, 404, 422] {
            assert_eq!(class_of(&api(code)), ErrorClass::Permanent, "{code}");
        }
        let decode = serde_json::from_str::<u8>("x").expect_err("not a number");
        assert_eq!(class_of(&kube::Error::SerdeError(decode)), ErrorClass::Permanent);
        let io = std::io::Error::other("connection reset");
        assert_eq!(class_of(&kube::Error::ReadEvents(io)), ErrorClass::Transient);
        let keeps = ReconcileError::KeepsChanging { object: "NodeCleanup node-a".into() };
        assert_eq!(keeps.class(), ErrorClass::Conflict);
        let unfenced = ReconcileError::NotFenced { volume: "pv-1".into(), node: "node-a".into() };
        assert_eq!(unfenced.class(), ErrorClass::Transient);
    }

    #[test]
    fn errors_name_their_object() {
        let e = api_error("StorageCluster sc1")(api(403));
        assert!(e.to_string().starts_with("StorageCluster sc1: "), "{e}");
        assert_eq!(e.class(), ErrorClass::Permanent);
    }

    #[test]
    fn backoff_doubles_per_class_and_is_bounded() {
        let secs = |class, n| retry_after(class, n).as_secs_f64();
        assert_eq!(secs(ErrorClass::Conflict, 1), 0.25);
        assert_eq!(secs(ErrorClass::Conflict, 3), 1.0);
        assert_eq!(secs(ErrorClass::Conflict, 100), 15.0);
        assert_eq!(secs(ErrorClass::Transient, 1), 2.0);
        assert_eq!(secs(ErrorClass::Transient, 2), 4.0);
        assert_eq!(secs(ErrorClass::Transient, 9), 300.0);
        assert_eq!(secs(ErrorClass::Transient, u32::MAX), 300.0);
        assert_eq!(secs(ErrorClass::Permanent, 1), 300.0);
        assert_eq!(secs(ErrorClass::Permanent, 3), 1200.0);
        assert_eq!(secs(ErrorClass::Permanent, 50), 3600.0);
        for n in 1..40 {
            for class in [ErrorClass::Conflict, ErrorClass::Transient, ErrorClass::Permanent] {
                assert!(retry_after(class, n) <= retry_after(class, n + 1), "{class:?} {n}");
            }
        }
        assert_eq!(retry_after(ErrorClass::Transient, 0), retry_after(ErrorClass::Transient, 1));
    }

    #[test]
    fn each_object_backs_off_on_its_own_until_it_succeeds() {
        let retries = Retries::default();
        let conflict = ReconcileError::KeepsChanging { object: "NodeCleanup a".into() };
        let forbidden = api_error("StorageCluster b")(api(422));
        let requeue = Action::requeue;
        assert_eq!(retries.failed("NodeCleanup/a", &conflict), requeue(Duration::from_millis(250)));
        assert_eq!(retries.failed("NodeCleanup/a", &conflict), requeue(Duration::from_millis(500)));
        assert_eq!(
            retries.failed("StorageCluster/b", &forbidden),
            requeue(Duration::from_secs(300))
        );
        assert_eq!((retries.count("NodeCleanup/a"), retries.count("StorageCluster/b")), (2, 1));
        retries.succeeded("NodeCleanup/a");
        assert_eq!(retries.count("NodeCleanup/a"), 0);
        assert_eq!(retries.failed("NodeCleanup/a", &conflict), requeue(Duration::from_millis(250)));
        assert_eq!(retries.count("StorageCluster/b"), 1, "another object's count is its own");
    }

    #[test]
    fn a_403_is_retried_soon_a_few_times_then_as_a_refusal() {
        let retries = Retries::default();
        let forbidden = api_error("StorageCluster b")(api(403));
        assert_eq!(forbidden.class(), ErrorClass::Permanent);
        let after: Vec<Action> =
            (0..6).map(|_| retries.failed("StorageCluster/b", &forbidden)).collect();
        let s = Duration::from_secs;
        let want: Vec<Action> =
            [s(2), s(4), s(8), s(300), s(600), s(1200)].into_iter().map(Action::requeue).collect();
        assert_eq!(after, want);
        retries.succeeded("StorageCluster/b");
        assert_eq!(
            retries.failed("StorageCluster/b", &forbidden),
            Action::requeue(s(2)),
            "a success starts it afresh"
        );
    }
}
