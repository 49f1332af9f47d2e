//! Weft operator: per-node Subnet leases, host port allocations' upkeep and
//! Weft NetworkPolicy status.

pub mod config;
pub mod hostports;
pub mod ipam;
pub mod leader;
pub mod metrics;
#[cfg(test)]
mod mock_api;
pub mod pods;
pub mod policies;
pub mod run;
pub mod subnets;
pub mod uninstall;
