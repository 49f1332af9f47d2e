//! Leader election with a `coordination.k8s.io/v1` Lease, so that two
//! replicas never allocate at the same time.
//!
//! Expiry is judged the way client-go does it: by how long *we* have seen
//! the Lease unchanged, not by comparing its renewTime with our clock, so
//! clock skew between replicas does not matter.

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

pub struct LeaderElector {
    api: Api<Lease>,
    name: String,
    identity: String,
    lease_duration: Duration,
    renew_deadline: Duration,
    retry_period: Duration,
    /// resourceVersion of the Lease as last seen, and when we first saw it.
    observed: Option<(String, Instant)>,
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
        LeaderElector { api, name, identity, lease_duration, renew_deadline, retry_period, observed: None }
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Blocks until this replica holds the Lease.
    pub async fn acquire(&mut self) -> Result<(), LeaderError> {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => {
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
    /// succeeded within the renew deadline (leadership is then lost).
    pub async fn hold(&mut self) -> LeaderError {
        let mut last_renew = Instant::now();
        loop {
            tokio::time::sleep(self.retry_period).await;
            match self.try_acquire_or_renew().await {
                Ok(true) => last_renew = Instant::now(),
                Ok(false) => {
                    return LeaderError::Lost { name: self.name.clone(), deadline: self.renew_deadline };
                }
                Err(e) => tracing::warn!(error = %e, "renewing leader lease failed"),
            }
            if last_renew.elapsed() > self.renew_deadline {
                return LeaderError::Lost { name: self.name.clone(), deadline: self.renew_deadline };
            }
        }
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
