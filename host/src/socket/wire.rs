//! The agent's answers as the socket protocol spells them.

use super::protocol::{self, Response};
use crate::ops::{Done, Failure, FailureKind};

impl From<Failure> for Response {
    fn from(f: Failure) -> Response {
        Response::Failed { kind: kind(f.kind), message: f.message }
    }
}

impl From<Done> for Response {
    fn from(d: Done) -> Response {
        Response::Ok { message: d.message, device: d.device }
    }
}

fn kind(k: FailureKind) -> protocol::FailureKind {
    match k {
        FailureKind::BadRequest => protocol::FailureKind::BadRequest,
        FailureKind::UnknownBackend => protocol::FailureKind::UnknownBackend,
        FailureKind::Denied => protocol::FailureKind::Denied,
        FailureKind::Busy => protocol::FailureKind::Busy,
        FailureKind::Failed => protocol::FailureKind::Failed,
        FailureKind::Unavailable => protocol::FailureKind::Unavailable,
        FailureKind::TimedOut => protocol::FailureKind::TimedOut,
    }
}
