//! The host's own model of what policies are asked and answer: volumes,
//! consumers, holders, node facts, plans and decisions.
//!
//! The node's state (mount records, the ledger, the CRDs) and the executor
//! speak these types; each contract version's bindings are converted to and
//! from them in `policy::contract` only, so a new contract version is never
//! a storage migration. Their serde form is the one the records have always
//! been written in (the field and case names of the 0.5 bindings), so
//! records written by earlier agents read as they are.

mod decision;
mod plan;
mod provision;
mod volume;

pub use decision::*;
pub use plan::*;
pub use provision::*;
pub use volume::*;
