//! Weft's one packet-filtering and NAT engine.
//!
//! Features (masquerade, host ports, policy) compute what they want as a
//! [`ruleset::Part`] (pure, unit-tested); an [`Engine`] makes the kernel
//! hold it through a [`Backend`]. A full sync reads the kernel and writes
//! the difference (nothing when it matches); an update diffs against the
//! part last applied and reads nothing, falling back to a full sync when it
//! fails or when the kernel's state is not known. Each part's objects carry
//! its owner's prefix, so parts never touch each other's objects.
//!
//! Only nftables is implemented (`nft`): iptables-legacy is on its way out
//! of distributions, and a second backend would have to hold to every test.
//! `legacy` removes what the iptables-based agents left behind.

pub mod build;
pub mod legacy;
pub mod nflog;
pub mod nfnl;
pub mod nfnl_rule;
pub mod nft;
pub mod ruleset;

use std::sync::Mutex;

use ruleset::{Observed, Op, Part};

#[derive(Debug, thiserror::Error)]
pub enum FirewallError {
    #[error(transparent)]
    Nft(#[from] crate::dataplane::exec::ExecError),
    #[error(transparent)]
    Netlink(#[from] nfnl::NetlinkError),
    #[error("cannot encode the nftables transaction: {0}")]
    Encode(serde_json::Error),
    #[error("cannot read nft's listing of Weft's table: {0}")]
    Decode(serde_json::Error),
}

/// A firewall implementation: reads Weft's table, commits transactions.
/// Blocking; acts in the calling thread's network namespace.
pub trait Backend: Send + Sync {
    /// Everything in Weft's table (all parts).
    fn observe(&self) -> Result<Observed, FirewallError>;
    /// Applies `ops` atomically: all of them or none.
    fn commit(&self, ops: &[Op]) -> Result<(), FirewallError>;
    /// The named counters in Weft's table (cheaper than [`Backend::observe`]).
    fn counters(&self) -> Result<std::collections::BTreeMap<String, ruleset::Count>, FirewallError>;
}

/// Keeps one part in the kernel, remembering what it last applied. Writes
/// of one engine are meant to be serialised by its caller (each diff
/// assumes the state the previous one left).
pub struct Engine<B> {
    backend: B,
    /// The part last applied, as the kernel shows it, and its owner; None
    /// when the kernel's state is unknown (start, or a failed write), so the
    /// next write reads it first.
    applied: Mutex<Option<(&'static str, Observed)>>,
}

impl<B: Backend> Engine<B> {
    pub fn new(backend: B) -> Self {
        Engine { backend, applied: Mutex::new(None) }
    }

    fn applied(&self) -> std::sync::MutexGuard<'_, Option<(&'static str, Observed)>> {
        self.applied.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the kernel and writes what differs from `want`; `Ok(true)`
    /// when something was written.
    pub fn sync(&self, want: &Part) -> Result<bool, FirewallError> {
        self.sync_counted(want).map(|(wrote, _)| wrote)
    }

    /// Like [`Engine::sync`], also returning the part's counters as read
    /// (the read a resync makes anyway).
    pub fn sync_counted(
        &self,
        want: &Part,
    ) -> Result<(bool, std::collections::BTreeMap<String, ruleset::Count>), FirewallError> {
        let mut have = self.backend.observe()?.of(want.owner);
        let counters = std::mem::take(&mut have.counters);
        // The diff needs the counters' names only.
        have.counters = counters.keys().map(|n| (n.clone(), ruleset::Count::default())).collect();
        let wrote = self.write(have, want)?;
        Ok((wrote, counters))
    }

    /// The named counters of `owner`'s part.
    pub fn counters(&self, owner: &str) -> Result<std::collections::BTreeMap<String, ruleset::Count>, FirewallError> {
        let prefix = format!("{owner}-");
        let mut all = self.backend.counters()?;
        all.retain(|n, _| n.starts_with(&prefix));
        Ok(all)
    }

    /// Writes the difference between the part last applied and `want`
    /// without reading the kernel (a full sync when nothing is known).
    pub fn update(&self, want: &Part) -> Result<bool, FirewallError> {
        let known = self.applied().take().filter(|(owner, _)| *owner == want.owner).map(|(_, o)| o);
        match known {
            Some(have) => match self.write(have, want) {
                Ok(wrote) => Ok(wrote),
                Err(e) => {
                    tracing::warn!(part = want.owner, error = %e, "incremental firewall update failed; reading the kernel and syncing");
                    self.sync(want)
                }
            },
            None => self.sync(want),
        }
    }

    fn write(&self, mut have: Observed, want: &Part) -> Result<bool, FirewallError> {
        let ops = ruleset::diff(&have, want);
        // Unknown until the commit is known to have landed.
        *self.applied() = None;
        self.backend.commit(&ops)?;
        have.apply(&ops);
        *self.applied() = Some((want.owner, have));
        Ok(!ops.is_empty())
    }

    /// The kernel's view of this part (CHECK, counters).
    pub fn observe(&self, owner: &str) -> Result<Observed, FirewallError> {
        Ok(self.backend.observe()?.of(owner))
    }

    /// Removes every object of `owner`'s part.
    #[allow(dead_code)] // the clean-up path: tests, and an uninstall hook later
    pub fn remove(&self, owner: &'static str) -> Result<bool, FirewallError> {
        self.sync(&Part::new(owner))
    }
}
