//! Weft operator: per-node Subnet leases, host port allocations' upkeep,
//! Weft NetworkPolicy status and Events for refused standard policies,
//! and (when asked) the PodEndpoints agents watch instead of every Pod.

pub mod cluster_policies;
pub mod config;
pub mod flows_api;
pub mod hostports;
pub mod ipam;
pub mod leader;
pub mod metrics;
#[cfg(test)]
mod mock_api;
pub mod pod_endpoints;
pub mod pods;
pub mod policies;
pub mod run;
pub mod standard_policies;
pub mod subnets;
pub mod uninstall;
