//! A backend's component, linked and ready to instantiate, by the contract
//! it was built against.

use super::bindings::BackendPre;
use super::compat;

/// A component linked for the contract it speaks.
#[derive(Clone)]
pub(crate) enum Pre {
    Current(BackendPre<super::imports::CallState>),
    V0_4(compat::v0_4::BackendPre<super::imports::CallState>),
}
