//! weft-agent's library: everything the node agent is made of, so that
//! the `weft` CLI can use the same policy model (`policy::model`,
//! `policy::explain`) the agent enforces with.

pub mod attach;
pub mod attachment;
pub mod cni_server;
pub mod config;
pub mod dataplane;
pub mod encapsulation_guard;
pub mod events;
pub mod firewall;
pub mod flows;
pub mod guard;
pub mod heap;
pub mod hostport;
pub mod http;
pub mod ipam;
pub mod lease;
pub mod masquerade;
pub mod metrics;
pub mod node_settings;
pub mod overlay;
pub mod peer_sync;
pub mod policy;
pub mod stable_hash;
#[cfg(test)]
mod test_support;
pub mod tunnel;
