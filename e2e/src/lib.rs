//! Test support for Weft: network namespaces, agents, the CNI "runtime" that
//! execs plugins, and the real control plane.

pub mod agent;
pub mod attacks;
pub mod bench_agent;
pub mod bench_exec;
pub mod bins;
pub mod capture;
pub mod cluster;
pub mod cni;
pub mod conformance;
pub mod control_plane;
pub mod flood;
pub mod netns;
pub mod prereq;
pub mod sandbox;
pub mod smuggle;
pub mod supervisor;
pub mod wait;
