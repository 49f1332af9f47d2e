//! Start-up reconciliation of IPAM records with the kernel. The runtime
//! never repeats an ADD, so a pod released here is disconnected for good:
//! only attachments that are certainly gone (no host veth) are released. Anything the agent cannot verify (a namespace it
//! cannot enter, routes someone changed) is kept, logged and counted in
//! `weft_agent_attachments_unverified`; the runtime's DEL or GC removes it
//! when its pod goes. Veths of ours with no record are removed: their ADD
//! never answered.

use std::path::Path;

use super::Attacher;
use super::observe::observe_pod;
use super::observed::{Expected, ObservedHost, ObservedPod, Verdict, on_start};
use super::{AttachError, driver};

/// What start-up reconciliation did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StartupReport {
    pub kept: usize,
    pub unverified: usize,
    pub released: usize,
    pub orphan_veths: usize,
}

/// How long start-up waits for the veth of a pod whose namespace is gone.
const NETNS_TEARDOWN: std::time::Duration = std::time::Duration::from_secs(2);

impl Attacher {
    /// The host veth of a pod whose namespace path is gone, once the kernel
    /// had [`NETNS_TEARDOWN`] to remove it with the namespace; `None` when
    /// it went.
    async fn host_veth_after_netns_teardown(
        &self,
        ip: std::net::IpAddr,
        record: &crate::ipam::Record,
    ) -> Result<Option<ObservedHost>, AttachError> {
        let deadline = tokio::time::Instant::now() + NETNS_TEARDOWN;
        loop {
            let host = self.observe_host(ip, record).await?;
            if host.is_none() || tokio::time::Instant::now() >= deadline {
                return Ok(host);
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// Restores missing routes to routed pods, judges every record, releases
    /// what is gone, removes veths no record accounts for and settles how new
    /// pods are attached.
    pub async fn reconcile_on_start(&self) -> Result<StartupReport, AttachError> {
        let mut report = StartupReport::default();
        // Routed pods are reached through their own routes: put back any
        // that went (with weft0's address, say) while the agent was down,
        // before judging them.
        self.repair_pod_routes().await?;
        for (ip, record) in self.ipam.all() {
            let want = Expected {
                driver: driver(record.attachment),
                ifname: &record.ifname,
                addresses: self.pod_addresses(ip, &record),
            };
            let mut host = self.observe_host(ip, &record).await?;
            // Without a host veth the pod's side needs no reading.
            let pod = match host {
                Some(_) => observe_pod(Path::new(&record.netns), &record.ifname).await,
                None => ObservedPod::Gone,
            };
            if pod == ObservedPod::Gone && host.is_some() {
                // A deleted namespace takes its veths with it a little later
                // (the kernel tears namespaces down asynchronously): give
                // the veth that time before judging.
                host = self.host_veth_after_netns_teardown(ip, &record).await?;
            }
            match on_start(&want, host.as_ref(), &pod) {
                Verdict::Keep => report.kept += 1,
                Verdict::KeepUnverified(why) => {
                    tracing::warn!(
                        container = %record.container_id, ifname = %record.ifname, pod = %record.pod, %ip,
                        reason = %why, "keeping an attachment that could not be verified"
                    );
                    report.unverified += 1;
                }
                Verdict::Release(why) => {
                    tracing::info!(
                        container = %record.container_id, ifname = %record.ifname, pod = %record.pod, %ip,
                        reason = %why, "releasing an attachment whose pod is gone"
                    );
                    self.teardown(&record.key(), &record.host_veth).await?;
                    report.released += 1;
                }
            }
        }
        report.orphan_veths = self.remove_orphan_veths().await?;
        self.metrics.released_on_start.inc_by(report.released as u64);
        self.metrics.unverified_attachments.set(report.unverified as i64);
        self.metrics.unreadable_records.set(self.ipam.unreadable().len() as i64);
        let attachment = self.settle_attachment();
        tracing::info!(?report, %attachment, "start-up reconciliation done");
        Ok(report)
    }
}
