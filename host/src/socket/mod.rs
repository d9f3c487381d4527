//! The agent's Unix socket: the wire protocol (shared with the driver), the
//! server and the dispatch of requests to operations.

pub mod protocol;
pub mod server;
