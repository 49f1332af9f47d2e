//! The source guard: pods send only with their own addresses, and nothing
//! that policy cannot see (link-local, multicast, spoofed ARP and
//! neighbour discovery). What it allows is [`desired`]'s (pure); this is
//! the thin layer that keeps the kernel holding it, through the same
//! firewall engine as policy and host ports, in two tables: `bridge weft`
//! for bridged pods (the only place a bridge port can be told apart) and
//! `inet weft` for routed ones.
//!
//! ADD admits a pod before it answers, DEL forgets it, and start-up and
//! every resync write the whole guard again from the IPAM records (the
//! truth): a flushed table is put back, and what a write derives is always
//! the records at that moment, so writes never race each other.

pub mod desired;
#[cfg(test)]
mod kernel_tests;

use std::sync::Arc;

pub use desired::GuardedPort;

use crate::firewall::nft::Nft;
use crate::firewall::{Engine, FirewallError};

#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("cannot program the pods' source guard: {0}")]
    Firewall(#[from] FirewallError),
    #[error("source guard task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

struct Engines {
    bridge: Engine<Nft>,
    inet: Engine<Nft>,
}

/// Cheap to clone: clones share the engines and the turn.
#[derive(Clone)]
pub struct Guard {
    engines: Arc<Engines>,
    /// One write at a time: each derives the ports and writes them, so a
    /// later write always holds a later view of the records.
    turn: Arc<tokio::sync::Mutex<()>>,
}

impl Default for Guard {
    fn default() -> Self {
        Guard {
            engines: Arc::new(Engines { bridge: Engine::new(Nft::bridge()), inet: Engine::new(Nft::default()) }),
            turn: Arc::new(tokio::sync::Mutex::new(())),
        }
    }
}

/// How a write reaches the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    /// The difference from what this guard last wrote (ADD, DEL).
    Update,
    /// Read the kernel first and put back whatever differs (start-up, resync).
    Full,
}

/// What a write did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Written {
    /// Something had to be written.
    pub changed: bool,
    /// Frames the guard has dropped so far, both tables together (read in
    /// the same pass as the rules by a [`Write::Full`]; `None` otherwise).
    pub dropped: Option<u64>,
}

impl Guard {
    /// Makes the kernel allow exactly `ports()` (called under this guard's
    /// turn, so it sees the records as of this write).
    pub async fn write(&self, how: Write, ports: impl FnOnce() -> Vec<GuardedPort>) -> Result<Written, GuardError> {
        let _turn = self.turn.lock().await;
        let (bridge, inet) = desired::parts(&ports());
        let engines = Arc::clone(&self.engines);
        let written = tokio::task::spawn_blocking(move || -> Result<Written, FirewallError> {
            let write = |engine: &Engine<Nft>, part| -> Result<(bool, Option<u64>), FirewallError> {
                match how {
                    Write::Update => Ok((engine.update(part)?, None)),
                    Write::Full => {
                        let (changed, counters) = engine.sync_counted(part)?;
                        Ok((changed, Some(counters.get(desired::DROPPED).map_or(0, |c| c.packets))))
                    }
                }
            };
            // Both are always written: one failing must not leave the other stale.
            let (b, i) = (write(&engines.bridge, &bridge), write(&engines.inet, &inet));
            let ((bc, bd), (ic, id)) = (b?, i?);
            Ok(Written { changed: bc | ic, dropped: bd.zip(id).map(|(b, i)| b + i) })
        })
        .await??;
        Ok(written)
    }
}
