//! The node's Subnet lease from the API: wait for it, publish this node's
//! datapath facts (node IP, VTEP IP and MAC, Ready) in its status, and keep
//! watching it. When the lease is withdrawn (the Subnet deleted, or leasing
//! another block) the agent takes no new pods, says so (STATUS, /readyz,
//! the Subnet's Ready condition, a metric), and lets the block go, by
//! removing the lease finalizer, only once no pod of this node holds an
//! address from it; then the agent exits so that its restart takes the new
//! lease.

use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use futures::TryStreamExt;
use ipnet::{IpNet, Ipv6Net};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::json;
use weft_api::subnet::{
    Backend, CONDITION_READY, LEASE_FINALIZER, REASON_LEASE_WITHDRAWN, Subnet, holds_lease, let_go_patch,
};

/// Field manager of everything the agent writes.
pub const FIELD_MANAGER: &str = "weft-agent";

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("watching Subnet {node}: {source}")]
    Watch { node: String, source: watcher::Error },
    #[error("the Subnet watch for node {0} ended")]
    Ended(String),
    #[error("publishing the status of Subnet {node}: {source}")]
    Publish { node: String, source: kube::Error },
    #[error("letting go of Subnet {node} (removing finalizer {LEASE_FINALIZER}): {source}")]
    Release { node: String, source: kube::Error },
}

/// What the agent takes from its Subnet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The pool's block: IPv4, or IPv6 in an IPv6-only cluster.
    pub cidr: IpNet,
    /// The IPv6 block beside an IPv4 `cidr` in a dual-stack cluster
    /// (`spec.cidrs[1]`).
    pub cidr6: Option<Ipv6Net>,
    pub backend: Backend,
}

/// Parses a Subnet's spec; `Err` says why it is unusable.
pub fn lease_of(subnet: &Subnet) -> Result<Lease, String> {
    let cidr: IpNet =
        subnet.spec.cidr.parse().map_err(|e| format!("cidr {:?} is not a CIDR: {e}", subnet.spec.cidr))?;
    if cidr != cidr.trunc() {
        return Err(format!("cidr {cidr} has host bits set"));
    }
    let mut cidr6 = None;
    for (i, c) in subnet.spec.cidrs.iter().enumerate() {
        let net: IpNet = c.parse().map_err(|e| format!("cidrs[{i}] {c:?} is not a CIDR: {e}"))?;
        if net != net.trunc() {
            return Err(format!("cidrs[{i}] {net} has host bits set"));
        }
        match (net, cidr) {
            _ if net == cidr => {}
            (IpNet::V4(n), IpNet::V6(_)) => {
                return Err(format!("cidrs[{i}] {n} is an IPv4 block beside IPv6 cidr {cidr}: list IPv4 first"));
            }
            (IpNet::V4(n), _) => return Err(format!("cidrs[{i}] {n} is not cidr {cidr}")),
            (IpNet::V6(_), IpNet::V6(_)) => return Err(format!("cidrs[{i}] {net} is a second IPv6 block")),
            (IpNet::V6(_), _) if cidr6.is_some() => return Err(format!("cidrs[{i}] {net} is a second IPv6 block")),
            // A pod's IPv6 address has its IPv4 address's host number.
            (IpNet::V6(n), IpNet::V4(v4)) if !crate::ipam::pool::ipv6_block_fits(n, v4) => {
                return Err(format!("cidrs[{i}] {n} holds fewer addresses than cidr {cidr}"));
            }
            (IpNet::V6(n), _) => cidr6 = Some(n),
        }
    }
    Ok(Lease { cidr, cidr6, backend: subnet.spec.backend })
}

/// Waits until the Subnet named after `node` exists with a usable spec.
pub async fn wait_for(api: &Api<Subnet>, node: &str) -> Result<Lease, LeaseError> {
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let stream = watcher::watcher(api.clone(), config);
    futures::pin_mut!(stream);
    tracing::info!(node, "waiting for this node's Subnet lease");
    while let Some(event) =
        stream.try_next().await.map_err(|source| LeaseError::Watch { node: node.to_owned(), source })?
    {
        let subnet = match event {
            watcher::Event::Apply(s) | watcher::Event::InitApply(s) => s,
            _ => continue,
        };
        if subnet.spec.is_pending() {
            let why = allocated_message(&subnet).unwrap_or_default();
            tracing::warn!(node, %why, "this node's Subnet has no range yet: waiting until the operator leases one");
            continue;
        }
        match lease_of(&subnet) {
            Ok(lease) => return Ok(lease),
            Err(why) => tracing::warn!(node, %why, "ignoring an unusable Subnet lease"),
        }
    }
    Err(LeaseError::Ended(node.to_owned()))
}

/// The message of the operator's `Allocated` condition, if it set one.
fn allocated_message(subnet: &Subnet) -> Option<String> {
    let conditions = &subnet.status.as_ref()?.conditions;
    conditions.iter().find(|c| c.type_ == weft_api::subnet::CONDITION_ALLOCATED).map(|c| c.message.clone())
}

/// What the agent publishes about its node.
#[derive(Debug, Clone)]
pub struct NodeFacts {
    pub node_ip: String,
    pub node_ipv6: Option<String>,
    pub vtep_ip: Option<String>,
    pub vtep_mac: Option<String>,
    /// VXLAN only: which address peers send VXLAN packets to.
    pub vxlan_underlay: Option<weft_api::VxlanUnderlay>,
    /// wireguard only: the public key peers encrypt to (base64).
    pub wireguard_public_key: Option<String>,
}

/// Writes the agent's part of the Subnet status (facts and Ready=True) with server-side apply, so
/// the operator's fields (its own conditions) are left alone.
pub async fn publish(api: &Api<Subnet>, node: &str, facts: &NodeFacts) -> Result<(), LeaseError> {
    // Published once the datapath uses the lease; problems with peers go to
    // the PeersProgrammed condition (peer_sync.rs).
    publish_status(api, node, facts, ("True", "DatapathProgrammed", "the node's agent uses this lease")).await
}

async fn publish_status(
    api: &Api<Subnet>,
    node: &str,
    facts: &NodeFacts,
    (status, reason, message): (&str, &str, &str),
) -> Result<(), LeaseError> {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let mut st = json!({
        "nodeIP": facts.node_ip,
        "conditions": [{
            "type": CONDITION_READY,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": now,
        }],
    });
    if let Some(ip) = &facts.node_ipv6 {
        st["nodeIPv6"] = json!(ip);
    }
    if let Some(ip) = &facts.vtep_ip {
        st["vtepIP"] = json!(ip);
    }
    if let Some(mac) = &facts.vtep_mac {
        st["vtepMAC"] = json!(mac);
    }
    if let Some(underlay) = facts.vxlan_underlay {
        st["vxlanUnderlay"] = json!(underlay);
    }
    if let Some(key) = &facts.wireguard_public_key {
        st["wireguardPublicKey"] = json!(key);
    }
    let patch = json!({ "apiVersion": "weft.dev/v1alpha1", "kind": "Subnet", "status": st });
    api.patch_status(node, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch))
        .await
        .map_err(|source| LeaseError::Publish { node: node.to_owned(), source })?;
    Ok(())
}

/// One condition of this node's Subnet, as an agent task reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    pub kind: &'static str,
    pub ok: bool,
    pub reason: &'static str,
    pub message: String,
}

/// Writes `condition` into this node's Subnet status with server-side
/// apply as `manager`. Each task that reports a condition applies as a
/// manager of its own, so no apply removes another's condition.
pub async fn publish_condition(
    api: &Api<Subnet>,
    node: &str,
    manager: &str,
    condition: &Condition,
) -> Result<(), kube::Error> {
    let patch = json!({
        "apiVersion": "weft.dev/v1alpha1",
        "kind": "Subnet",
        "status": {"conditions": [{
            "type": condition.kind,
            "status": if condition.ok { "True" } else { "False" },
            "reason": condition.reason,
            "message": condition.message,
            "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string(),
        }]},
    });
    api.patch_status(node, &PatchParams::apply(manager).force(), &Patch::Apply(&patch)).await.map(|_| ())
}

/// Whether the lease is withdrawn, and why; read by ADD and STATUS.
#[derive(Debug, Default)]
pub struct Withdrawal(RwLock<Option<String>>);

impl Withdrawal {
    pub fn reason(&self) -> Option<String> {
        self.0.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Records the new state; true when it changed.
    fn set(&self, reason: Option<String>) -> bool {
        let mut current = self.0.write().unwrap_or_else(PoisonError::into_inner);
        let changed = *current != reason;
        *current = reason;
        changed
    }
}

/// What the agent makes of its Subnet as it is now.
#[derive(Debug, PartialEq, Eq)]
pub enum Standing {
    /// The lease in use; `publish` when the status lacks this node's facts
    /// (e.g. someone cleared it).
    Held { publish: bool },
    /// The block is being taken back; the reason, for humans.
    Withdrawn(String),
    /// The Subnet now also leases an IPv6 block (dual-stack turned on): the
    /// agent restarts to give new pods addresses from it.
    Extended(String),
}

/// Why [`hold`] stopped holding the lease in use.
#[derive(Debug, PartialEq, Eq)]
pub enum LeaseEnd {
    /// Withdrawn, and let go once no pod used it.
    LetGo(String),
    /// Extended by an IPv6 block.
    Extended(String),
}

/// Judges the Subnet (None: it does not exist) against the lease in use.
pub fn standing(subnet: Option<&Subnet>, lease: &Lease, facts: &NodeFacts) -> Standing {
    let Some(subnet) = subnet else {
        return Standing::Withdrawn(format!("this node's Subnet (lease of {}) was deleted", lease.cidr));
    };
    let name = subnet.name_any();
    if subnet.metadata.deletion_timestamp.is_some() {
        return Standing::Withdrawn(format!("Subnet {name} (lease of {}) is being deleted", lease.cidr));
    }
    if subnet.spec.cidr.parse::<IpNet>().ok() != Some(lease.cidr) {
        return Standing::Withdrawn(format!(
            "Subnet {name} now leases {} but this node's pods use {}",
            subnet.spec.cidr, lease.cidr
        ));
    }
    if lease.cidr6.is_none()
        && let Some(block) = lease_of(subnet).ok().and_then(|l| l.cidr6)
    {
        return Standing::Extended(format!("Subnet {name} now also leases the IPv6 block {block}"));
    }
    let status = subnet.status.clone().unwrap_or_default();
    let published = status.node_ip.as_deref() == Some(facts.node_ip.as_str())
        && status.node_ipv6 == facts.node_ipv6
        && status.vtep_ip == facts.vtep_ip
        && status.vtep_mac == facts.vtep_mac
        && status.vxlan_underlay == facts.vxlan_underlay
        && status.wireguard_public_key == facts.wireguard_public_key
        && status.conditions.iter().any(|c| c.type_ == CONDITION_READY && c.status == "True");
    Standing::Held { publish: !published }
}

/// Carries out a key rotation request (the value of the Subnet's rotation
/// annotation), returning the new public key to publish, or `None` when the
/// request was carried out before.
pub type RotateKey = Box<dyn Fn(&str) -> Result<Option<String>, String> + Send + Sync>;

/// What [`hold`] needs besides the API.
pub struct Holder {
    pub api: Api<Subnet>,
    pub node: String,
    pub lease: Lease,
    pub facts: NodeFacts,
    pub withdrawal: Arc<Withdrawal>,
    /// 1 while the lease is withdrawn.
    pub gauge: Gauge,
    pub resync: Duration,
    /// wireguard: how to rotate this node's key when its Subnet asks.
    pub rotate_key: Option<RotateKey>,
}

/// Watches this node's Subnet until the lease has been withdrawn and let go,
/// or extended by an IPv6 block (returns which and why), keeping the
/// published facts in place meanwhile. `addresses_in_use` counts the pod
/// addresses this node still hands out.
pub async fn hold(mut h: Holder, addresses_in_use: impl Fn() -> usize) -> LeaseEnd {
    let changed = Arc::new(tokio::sync::Notify::new());
    let config = watcher::Config::default().fields(&format!("metadata.name={}", h.node));
    let store = weft_api::watch::reflect(
        h.api.clone(),
        config,
        "own Subnet",
        weft_api::watch::keep_all,
        Some(Arc::clone(&changed)),
    );
    if store.wait_until_ready().await.is_err() {
        std::future::pending::<()>().await;
    }
    let mut told_in_use = None;
    loop {
        let subnet = store.get(&ObjectRef::new(&h.node));
        let request = subnet.as_deref().and_then(|s| s.annotations().get(weft_api::subnet::WIREGUARD_KEY_ROTATION));
        if let (Some(rotate), Some(token)) = (&h.rotate_key, request) {
            match rotate(token) {
                Ok(Some(public)) => {
                    tracing::info!(node = %h.node, public_key = %public, "rotated this node's WireGuard key on request");
                    h.facts.wireguard_public_key = Some(public);
                }
                Ok(None) => {}
                Err(e) => tracing::error!(error = %e, "cannot rotate this node's WireGuard key; retrying"),
            }
        }
        match standing(subnet.as_deref(), &h.lease, &h.facts) {
            Standing::Extended(why) => return LeaseEnd::Extended(why),
            Standing::Held { publish: republish } => {
                if h.withdrawal.set(None) {
                    tracing::warn!(node = %h.node, cidr = %h.lease.cidr, "this node's Subnet lease is held again");
                    h.gauge.set(0);
                }
                if republish {
                    match publish(&h.api, &h.node, &h.facts).await {
                        Ok(()) => tracing::info!(node = %h.node, "published this node's facts in its Subnet again"),
                        Err(e) => tracing::warn!(error = %e, "cannot publish this node's facts"),
                    }
                }
            }
            Standing::Withdrawn(why) => {
                let in_use = addresses_in_use();
                if h.withdrawal.set(Some(why.clone())) {
                    h.gauge.set(1);
                    tracing::error!(
                        node = %h.node, cidr = %h.lease.cidr, reason = %why, pods = in_use,
                        "this node's Subnet lease is withdrawn: no new pods are attached; the block is let go once no pod uses it"
                    );
                    if subnet.is_some() {
                        let message = format!("{why}; {in_use} pod addresses still in use, no new pods attached");
                        if let Err(e) =
                            publish_status(&h.api, &h.node, &h.facts, ("False", REASON_LEASE_WITHDRAWN, &message)).await
                        {
                            tracing::warn!(error = %e, "cannot report the withdrawn lease in the Subnet");
                        }
                    }
                }
                if in_use == 0 {
                    match let_go(&h.api, subnet.as_deref()).await {
                        Ok(()) => return LeaseEnd::LetGo(why),
                        Err(e) => tracing::error!(error = %e, "cannot let go of the withdrawn lease; retrying"),
                    }
                } else if told_in_use != Some(in_use) {
                    tracing::warn!(node = %h.node, pods = in_use, "waiting for this node's pods to leave the withdrawn lease");
                    told_in_use = Some(in_use);
                }
            }
        }
        tokio::select! {
            () = changed.notified() => {}
            () = tokio::time::sleep(h.resync) => {}
        }
    }
}

/// Removes the lease finalizer (if the Subnet still has it), guarded by the
/// resourceVersion so that nothing else's change to the list is lost.
async fn let_go(api: &Api<Subnet>, subnet: Option<&Subnet>) -> Result<(), LeaseError> {
    let Some(subnet) = subnet.filter(|s| holds_lease(s)) else {
        return Ok(());
    };
    let name = subnet.name_any();
    match api.patch(&name, &PatchParams::default(), &Patch::Merge(&let_go_patch(subnet))).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(source) => Err(LeaseError::Release { node: name, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    use weft_api::subnet::{SubnetSpec, SubnetStatus};

    fn facts() -> NodeFacts {
        NodeFacts {
            node_ip: "10.0.0.2".into(),
            node_ipv6: None,
            vtep_ip: Some("10.244.1.0".into()),
            vtep_mac: None,
            vxlan_underlay: None,
            wireguard_public_key: None,
        }
    }

    fn lease() -> Lease {
        Lease { cidr: "10.244.1.0/24".parse().expect("cidr"), cidr6: None, backend: Backend::Vxlan }
    }

    #[test]
    fn a_dual_stack_lease_takes_its_ipv6_block_from_cidrs() {
        let with = |cidrs: &[&str]| {
            let mut s = subnet("10.244.1.0/24", false);
            s.spec.cidrs = cidrs.iter().map(|c| (*c).to_owned()).collect();
            lease_of(&s)
        };
        assert_eq!(with(&[]).expect("v4").cidr6, None);
        let dual = with(&["10.244.1.0/24", "fd00:10:244:1::/64"]).expect("dual");
        assert_eq!(dual.cidr6, Some("fd00:10:244:1::/64".parse().expect("cidr")));
        let fail = |cidrs: &[&str], why: &str| {
            let e = with(cidrs).expect_err("unusable");
            assert!(e.contains(why), "{cidrs:?}: {e}");
        };
        fail(&["10.244.1.0/24", "fd00::1/64"], "host bits");
        fail(&["10.244.2.0/24", "fd00::/64"], "is not cidr 10.244.1.0/24");
        fail(&["10.244.1.0/24", "fd00::/64", "fd01::/64"], "second IPv6 block");
        fail(&["10.244.1.0/24", "fd00::/121"], "fewer addresses");
        fail(&["10.244.1.0/24", "bogus"], "not a CIDR");
    }

    #[test]
    fn an_ipv6_only_lease_has_one_ipv6_block() {
        let with = |cidrs: &[&str]| {
            let mut s = subnet("fd00:10:244:1::/64", false);
            s.spec.cidrs = cidrs.iter().map(|c| (*c).to_owned()).collect();
            lease_of(&s)
        };
        let v6 = with(&["fd00:10:244:1::/64"]).expect("v6-only");
        assert_eq!((v6.cidr.to_string(), v6.cidr6), ("fd00:10:244:1::/64".into(), None));
        assert_eq!(with(&[]).expect("without cidrs").cidr, v6.cidr);
        let e = with(&["fd00:10:244:1::/64", "10.244.1.0/24"]).expect_err("IPv4 second");
        assert!(e.contains("IPv4 block beside IPv6 cidr"), "{e}");
        let e = with(&["fd00:10:244:1::/64", "fd00:10:244:2::/64"]).expect_err("two IPv6");
        assert!(e.contains("second IPv6 block"), "{e}");
    }

    fn subnet(cidr: &str, published: bool) -> Subnet {
        let mut s = Subnet::new(
            "n1",
            SubnetSpec {
                node_name: "n1".into(),
                cidr: cidr.into(),
                cidrs: Vec::new(),
                backend: Backend::Vxlan,
                vni: None,
                mtu: None,
            },
        );
        if published {
            s.status = Some(SubnetStatus {
                node_ip: Some("10.0.0.2".into()),
                node_ipv6: None,
                vtep_ip: Some("10.244.1.0".into()),
                vtep_mac: None,
                vxlan_underlay: None,
                wireguard_public_key: None,
                conditions: vec![Condition {
                    type_: CONDITION_READY.into(),
                    status: "True".into(),
                    reason: "DatapathProgrammed".into(),
                    message: String::new(),
                    last_transition_time: Time(k8s_openapi::jiff::Timestamp::now()),
                    observed_generation: None,
                }],
            });
        }
        s
    }

    #[test]
    fn the_lease_in_use_is_held_and_its_facts_are_published_when_missing() {
        assert_eq!(
            standing(Some(&subnet("10.244.1.0/24", true)), &lease(), &facts()),
            Standing::Held { publish: false }
        );
        assert_eq!(
            standing(Some(&subnet("10.244.1.0/24", false)), &lease(), &facts()),
            Standing::Held { publish: true }
        );
        let mut other_ip = subnet("10.244.1.0/24", true);
        other_ip.status.as_mut().expect("status").node_ip = Some("10.0.0.9".into());
        assert_eq!(standing(Some(&other_ip), &lease(), &facts()), Standing::Held { publish: true });
    }

    #[test]
    fn a_deleted_deleting_or_changed_subnet_withdraws_the_lease() {
        let gone = standing(None, &lease(), &facts());
        assert!(matches!(&gone, Standing::Withdrawn(why) if why.contains("was deleted")), "{gone:?}");
        let mut deleting = subnet("10.244.1.0/24", true);
        deleting.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        let d = standing(Some(&deleting), &lease(), &facts());
        assert!(matches!(&d, Standing::Withdrawn(why) if why.contains("being deleted")), "{d:?}");
        let moved = standing(Some(&subnet("10.244.9.0/24", true)), &lease(), &facts());
        assert!(
            matches!(&moved, Standing::Withdrawn(why) if why.contains("now leases 10.244.9.0/24") && why.contains("use 10.244.1.0/24")),
            "{moved:?}"
        );
    }

    #[test]
    fn an_ipv6_block_added_to_the_lease_in_use_extends_it() {
        let mut dual = subnet("10.244.1.0/24", true);
        dual.spec.cidrs = vec!["10.244.1.0/24".into(), "fd00:10:244:1::/64".into()];
        let s = standing(Some(&dual), &lease(), &facts());
        assert!(matches!(&s, Standing::Extended(why) if why.contains("IPv6 block fd00:10:244:1::/64")), "{s:?}");
        // Already in use: held as before.
        let in_use = Lease { cidr6: Some("fd00:10:244:1::/64".parse().expect("cidr")), ..lease() };
        assert_eq!(standing(Some(&dual), &in_use, &facts()), Standing::Held { publish: false });
        // An unusable block changes nothing.
        dual.spec.cidrs[1] = "fd00::1/64".into();
        assert_eq!(standing(Some(&dual), &lease(), &facts()), Standing::Held { publish: false });
    }

    #[test]
    fn withdrawal_reports_changes_only() {
        let w = Withdrawal::default();
        assert!(!w.set(None));
        assert!(w.set(Some("gone".into())));
        assert!(!w.set(Some("gone".into())));
        assert_eq!(w.reason().as_deref(), Some("gone"));
        assert!(w.set(None));
    }
}
