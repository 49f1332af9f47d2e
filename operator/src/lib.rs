//! Weft operator: per-node Subnet leases (later: host ports, policy).

pub mod config;
pub mod hostports;
pub mod ipam;
pub mod leader;
pub mod metrics;
pub mod pods;
pub mod policies;
pub mod run;
pub mod subnets;
pub mod uninstall;
