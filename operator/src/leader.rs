//! Leader election with a `coordination.k8s.io/v1` Lease, so that two
//! replicas never allocate at the same time.
//!
//! Expiry is judged the way client-go does it: by how long *we* have seen
//! the Lease unchanged, not by comparing its renewTime with our clock, so
//! clock skew between replicas does not matter.
//!
//! The leader stops acting before anyone can take its place, whatever its
//! API calls do: every renewal attempt is cut off at the renew deadline
//! (shorter than the lease duration a standby waits out), and every writer
//! checks the [`Term`] first, which ends at that same deadline even when
//! the renewal loop itself is not running (a process stopped with SIGSTOP
//! and continued finds its term over before it writes anything).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use tokio::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("lease {name}: {source}")]
    Api {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("lost leadership: lease {name} not renewed within {deadline:?}")]
    Lost { name: String, deadline: Duration },
}

/// Until when this replica may act as the leader. Shared with every writer.
#[derive(Clone, Debug)]
pub struct Term {
    /// `None`: no leader election, this replica always acts.
    until: Option<Arc<Mutex<Option<Instant>>>>,
}

/// A write refused because this replica's term as leader is over.
#[derive(Debug, thiserror::Error)]
#[error("not the leader: this replica's term ended, refusing to write")]
pub struct NotLeader;

impl Term {
    /// For a replica that runs without leader election.
    pub fn always() -> Self {
        Term { until: None }
    }

    fn elected() -> Self {
        Term { until: Some(Arc::new(Mutex::new(None))) }
    }

    /// `Ok` while this replica may write as the leader.
    pub fn check(&self) -> Result<(), NotLeader> {
        let Some(until) = &self.until else { return Ok(()) };
        match *until.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(t) if Instant::now() < t => Ok(()),
            _ => Err(NotLeader),
        }
    }

    fn extend_to(&self, t: Instant) {
        if let Some(until) = &self.until {
            *until.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
        }
    }

    fn end(&self) {
        if let Some(until) = &self.until {
            *until.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
    }
}

pub struct LeaderElector {
    api: Api<Lease>,
    name: String,
    identity: String,
    lease_duration: Duration,
    renew_deadline: Duration,
    retry_period: Duration,
    /// resourceVersion of the Lease as last seen, and when we first saw it.
    observed: Option<(String, Instant)>,
    term: Term,
}

impl LeaderElector {
    pub fn new(
        api: Api<Lease>,
        name: String,
        identity: String,
        lease_duration: Duration,
        renew_deadline: Duration,
        retry_period: Duration,
    ) -> Self {
        LeaderElector {
            api,
            name,
            identity,
            lease_duration,
            renew_deadline,
            retry_period,
            observed: None,
            term: Term::elected(),
        }
    }

    /// The term every writer checks.
    pub fn term(&self) -> Term {
        self.term.clone()
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Blocks until this replica holds the Lease.
    pub async fn acquire(&mut self) -> Result<(), LeaderError> {
        loop {
            let attempt = Instant::now();
            match self.try_acquire_or_renew().await {
                Ok(true) => {
                    self.term.extend_to(attempt + self.renew_deadline);
                    tracing::info!(lease = %self.name, identity = %self.identity, "acquired leadership");
                    return Ok(());
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election attempt failed"),
            }
            tokio::time::sleep(self.retry_period).await;
        }
    }

    /// Renews the Lease every retry period; returns when a renewal has not
    /// succeeded within the renew deadline (leadership is then lost, and the
    /// term already over). A renewal whose API calls hang is cut off at the
    /// deadline: it counts from the start of the last successful attempt.
    pub async fn hold(&mut self) -> LeaderError {
        let mut last_ok = Instant::now();
        let lost = loop {
            tokio::time::sleep(self.retry_period).await;
            let attempt = Instant::now();
            let deadline = last_ok + self.renew_deadline;
            match tokio::time::timeout_at(deadline, self.try_acquire_or_renew()).await {
                Ok(Ok(true)) => {
                    last_ok = attempt;
                    self.term.extend_to(attempt + self.renew_deadline);
                }
                Ok(Ok(false)) => break self.lost(),
                Ok(Err(e)) => tracing::warn!(error = %e, "renewing leader lease failed"),
                Err(_) => {
                    tracing::warn!(lease = %self.name, "renewing leader lease took until the renew deadline");
                    break self.lost();
                }
            }
            if Instant::now() >= last_ok + self.renew_deadline {
                break self.lost();
            }
        };
        self.term.end();
        lost
    }

    fn lost(&self) -> LeaderError {
        LeaderError::Lost { name: self.name.clone(), deadline: self.renew_deadline }
    }

    /// Gives the Lease up so that a successor does not wait for expiry.
    pub async fn release(&mut self) {
        let Ok(Some(mut lease)) = self.api.get_opt(&self.name).await else { return };
        let Some(spec) = lease.spec.as_mut() else { return };
        if spec.holder_identity.as_deref() != Some(&self.identity) {
            return;
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(_) => tracing::info!(lease = %self.name, "released leadership"),
            Err(e) => tracing::warn!(error = %e, "releasing leader lease failed"),
        }
    }

    /// One attempt: create the Lease, renew ours, or take over an expired
    /// one. Conflicts (another replica won the race) yield `Ok(false)`.
    async fn try_acquire_or_renew(&mut self) -> Result<bool, LeaderError> {
        let now = MicroTime(Timestamp::now());
        let duration_secs = i32::try_from(self.lease_duration.as_secs()).unwrap_or(i32::MAX);
        let existing = self.api.get_opt(&self.name).await.map_err(|e| self.err(e))?;
        let Some(mut lease) = existing else {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(self.name.clone()), ..Default::default() },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(duration_secs),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(self.err(e)),
            };
        };

        let rv = lease.metadata.resource_version.clone().unwrap_or_default();
        let first_seen = match &self.observed {
            Some((seen_rv, at)) if *seen_rv == rv => *at,
            _ => {
                let at = Instant::now();
                self.observed = Some((rv, at));
                at
            }
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let ours = holder.as_deref() == Some(self.identity.as_str());
        let held_for =
            Duration::from_secs(spec.lease_duration_seconds.unwrap_or(duration_secs).max(0).unsigned_abs().into());
        let expired = holder.is_none() || first_seen.elapsed() > held_for;
        if !ours && !expired {
            return Ok(false);
        }
        if !ours {
            tracing::info!(previous = ?holder, "taking over leader lease");
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(self.identity.clone());
        spec.lease_duration_seconds = Some(duration_secs);
        spec.renew_time = Some(now);
        // replace() carries the resourceVersion: a concurrent writer makes it 409.
        match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(updated) => {
                if let Some(rv) = updated.metadata.resource_version {
                    self.observed = Some((rv, Instant::now()));
                }
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(self.err(e)),
        }
    }

    fn err(&self, source: kube::Error) -> LeaderError {
        LeaderError::Api { name: self.name.clone(), source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_term_lasts_until_its_deadline_and_no_longer() {
        assert!(Term::always().check().is_ok(), "without leader election a replica always acts");
        let term = Term::elected();
        assert!(term.check().is_err(), "not yet elected");
        term.extend_to(Instant::now() + Duration::from_secs(60));
        assert!(term.check().is_ok());
        let writer = term.clone();
        term.extend_to(Instant::now() - Duration::from_millis(1));
        assert!(writer.check().is_err(), "a deadline in the past ends the term for every writer");
        term.extend_to(Instant::now() + Duration::from_secs(60));
        term.end();
        assert!(writer.check().is_err());
    }
}
