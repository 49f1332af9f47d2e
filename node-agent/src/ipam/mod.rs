//! Pod address management for the node's pod CIDR.
//!
//! [`pool`] decides which address is next (pure, unit-tested); [`store`]
//! keeps one record per allocation so a crash or restart never hands
//! out an address twice and never forgets one.

pub mod pool;
pub mod store;

pub use pool::{Ipv6Block, Pool};
pub use store::{Ipam, IpamError, Key, Mapping, Record};
