//! Network policy enforcement: standard `networking.k8s.io/v1` and Weft
//! (`weft.dev/v1alpha1`) NetworkPolicies compiled into the `policy` part of
//! Weft's nftables table for this node's pods (see docs/network-policy.md).
//!
//! `caches` is the view of the API, `pods` the pods a pass sees (shared
//! with the cache), `model` the semantics (pure),
//! `incremental` recompiles only what a change affects (pure), `render` the
//! nftables representation (pure), `limits` the bounds on what policies may
//! compile to, `sync` the watch-and-apply loop, `report` its failures as a
//! Subnet condition and Events, `attached` the pods ADD registered before
//! the API reports them, `drop_log` the optional log of dropped packets.
//! `render_iptables_old` and `ipset` are the engine it replaced, kept (in
//! `node-agent/old_engines/`, test builds only) for the upgrade test and the
//! benchmark beside the new one.

mod addr_ranges;
pub mod attached;
pub mod caches;
pub mod drop_log;
pub mod explain;
pub mod incremental;
pub mod limits;
pub mod metrics;
pub mod model;
pub mod pods;
pub mod render;
pub mod report;
pub mod sync;

// The engine this one replaced (iptables and ipset), kept outside `src/`
// for the upgrade test and the benchmark beside the new one.
#[cfg(test)]
#[path = "../../old_engines/policy_ipset.rs"]
mod ipset;
#[cfg(test)]
mod kernel_tests;
#[cfg(test)]
#[path = "../../old_engines/policy_iptables.rs"]
mod render_iptables_old;
