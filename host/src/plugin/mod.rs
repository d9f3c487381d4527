//! Backends on this node: keeping what is served in line with the plugin
//! dir, and installing each backend's Flexvolume driver where kubelet looks
//! for it.

pub mod directed;
pub mod install;
pub mod observe;
pub mod reload;
pub mod rollout;
pub mod trust;
pub mod watch;
