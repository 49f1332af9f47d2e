//! Network policy enforcement: standard `networking.k8s.io/v1` and Weft
//! (`weft.dev/v1alpha1`) NetworkPolicies compiled into iptables chains and
//! ipsets for this node's pods (see docs/network-policy.md).
//!
//! `model` is the semantics (pure), `render` the kernel representation and
//! its diff (pure), `ipset` the set runner, `sync` the watch-and-apply loop.

pub mod ipset;
pub mod metrics;
pub mod model;
pub mod render;
pub mod sync;

#[cfg(test)]
mod kernel_tests;
