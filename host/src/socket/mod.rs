//! The agent's Unix socket: the wire protocol (shared with the driver), the
//! server and the dispatch of requests to operations, and the client the
//! CLI's status commands use.

pub mod client;
pub mod flex;
pub mod flex_request;
pub use volagent_protocol as protocol;
pub mod local_report;
pub mod oplog;
pub mod server;
pub mod status;
mod wire;
