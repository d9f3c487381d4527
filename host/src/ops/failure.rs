//! What an operation answers, in the agent's own terms: done (with the
//! device, when one was attached) or a failure of a kind callers decide
//! retries by. Each edge maps these to its wire (the socket protocol's
//! response, a gRPC status).

use crate::text::bounded;

/// Why a request failed, as a caller decides whether and when to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The request itself is wrong: retrying it unchanged fails again.
    BadRequest,
    /// No policy is loaded for the backend named.
    UnknownBackend,
    /// A rule or the backend's policy refused it.
    Denied,
    /// Another operation holds the volume, or a race was lost: retry.
    Busy,
    Failed,
    /// Something the agent needs (the ledger, the API server) is away.
    Unavailable,
    /// The steps outlived the deadline and go on; the volume stays locked.
    TimedOut,
}

/// A failed request: its kind (for retry decisions) and a message for users.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    pub message: String,
    /// Denied by the backend's fence decision (another holder), as opposed
    /// to refused by a trust rule: the two get different Event reasons.
    pub fenced: bool,
}

/// Longest message a failure carries: a guest's refusal or a tool's output
/// may be of any size, and the reply must fit in a frame and an Event.
pub const MAX_MESSAGE: usize = 8 << 10;

impl Failure {
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Failure {
        Failure { kind, message: bounded(message.into(), MAX_MESSAGE), fenced: false }
    }

    /// A denial by the fence decision.
    pub fn fenced(message: impl Into<String>) -> Failure {
        Failure { fenced: true, ..Failure::new(FailureKind::Denied, message) }
    }
}

/// A mount or unmount that succeeded (or had nothing to do).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Done {
    pub message: String,
    /// The device the volume was attached as, when it has one.
    pub device: Option<String>,
}
