//! From kernel events to flow records, pure: which pods hold the
//! addresses, which ends are this node's, and what policy decided. The
//! policy is the one the chains of the local ends name for the packet
//! (`policy::explain::decide`), from the policy loop's latest pass; a
//! denied packet's is the drop rule's, which the kernel reported.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use weft_proto::flows::v1::{Endpoint, Event, Flow, Verdict};

use crate::dataplane::conntrack_events::{self, Kind};
use crate::policy::drop_log::Dropped;
use crate::policy::explain::{Decided, decide};
use crate::policy::model::{Chain, Compiler, Direction, PeerCache, PodInfo, PodPolicy, Proto};
use crate::policy::render::DEFAULT_DENY;
use crate::policy::sync::Latest;

/// What the policy loop computed last, indexed by address.
pub struct Index {
    node: String,
    pods: HashMap<IpAddr, Arc<PodInfo>>,
    chains: HashMap<IpAddr, Arc<PodPolicy>>,
    /// The standard policies isolating each local pod under policy, by
    /// direction (ingress, egress): what a default deny is named after.
    isolating: HashMap<IpAddr, Arc<[String; 2]>>,
}

impl Index {
    pub fn new(node: &str, snapshot: &Latest) -> Self {
        let pods: HashMap<IpAddr, Arc<PodInfo>> =
            snapshot.cluster.pods.iter().flat_map(|p| p.ips.iter().map(move |ip| (*ip, Arc::clone(p)))).collect();
        let chains = snapshot.local.iter().flat_map(|p| p.ips.iter().map(move |ip| (*ip, Arc::clone(p))));
        // Selecting policies are looked up without resolving any peer: cheap.
        let compiler = Compiler::with_cache(&snapshot.cluster, PeerCache::default());
        let mut isolating = HashMap::new();
        for (ip, pod) in snapshot.local.iter().flat_map(|p| p.ips.iter()).filter_map(|ip| Some((*ip, pods.get(ip)?))) {
            let standard = |dir| {
                let names = compiler.selecting(pod, dir).into_iter();
                names
                    .filter(|n| !n.starts_with("weft.dev/") && !n.starts_with("ClusterNetworkPolicy/"))
                    .collect::<Vec<_>>()
                    .join(",")
            };
            isolating.insert(ip, Arc::new([standard(Direction::Ingress), standard(Direction::Egress)]));
        }
        Index { node: node.to_owned(), pods, chains: chains.collect(), isolating }
    }

    /// Nothing known yet (before the policy loop's first pass).
    pub fn empty(node: &str) -> Self {
        Index { node: node.to_owned(), pods: HashMap::new(), chains: HashMap::new(), isolating: HashMap::new() }
    }

    /// The standard policies isolating the local pod at `addr` in `dir`, comma-separated.
    fn isolating(&self, addr: IpAddr, dir: Direction) -> Option<&str> {
        let names = self.isolating.get(&addr)?;
        let n = &names[usize::from(dir == Direction::Egress)];
        (!n.is_empty()).then_some(n.as_str())
    }

    fn local_pod(&self, addr: IpAddr) -> Option<&PodInfo> {
        self.pods.get(&addr).map(Arc::as_ref).filter(|p| p.node == self.node)
    }

    fn chain(&self, addr: IpAddr, dir: Direction) -> Option<&Chain> {
        let p = self.chains.get(&addr)?;
        match dir {
            Direction::Ingress => p.ingress.as_ref(),
            Direction::Egress => p.egress.as_ref(),
        }
    }

    fn endpoint(&self, addr: IpAddr, port: u16) -> Endpoint {
        let pod = self.pods.get(&addr);
        Endpoint {
            address: addr.to_string(),
            port: u32::from(port),
            namespace: pod.map(|p| p.namespace.clone()).unwrap_or_default(),
            pod: pod.map(|p| p.name.clone()).unwrap_or_default(),
        }
    }
}

/// The record of a connection event, when one of its ends is a pod of
/// this node (other connections of the node are not recorded). After DNAT
/// (a Service) the destination is the backend that replies.
pub fn connection(index: &Index, e: &conntrack_events::Event, time_unix_ms: u64) -> Option<Flow> {
    let dst = e.reply_src.unwrap_or(e.dst);
    if index.local_pod(e.src).is_none() && index.local_pod(dst).is_none() {
        return None;
    }
    let (policy, direction, rule) = allowed_by(index, e.src, dst, e.proto, e.dport);
    let (packets, bytes) = e.counters.unwrap_or_default();
    Some(Flow {
        seq: 0,
        time_unix_ms,
        node: index.node.clone(),
        event: match e.kind {
            Kind::New => Event::Opened,
            Kind::Destroy => Event::Closed,
        } as i32,
        protocol: u32::from(e.proto),
        source: Some(index.endpoint(e.src, e.sport)),
        destination: Some(index.endpoint(dst, e.dport)),
        verdict: Verdict::Forwarded as i32,
        policy,
        direction,
        rule,
        packets,
        bytes,
    })
}

/// What admitted a connection: the destination's ingress rule when it is a
/// local pod that policy selects, else the source's egress rule; empty
/// when no policy selects either local end.
fn allowed_by(index: &Index, src: IpAddr, dst: IpAddr, proto: u8, port: u16) -> (String, String, i32) {
    let Some(proto) = Proto::from_number(proto) else { return (String::new(), String::new(), -1) };
    let sides = [(dst, Direction::Ingress, src), (src, Direction::Egress, dst)];
    for (at, dir, remote) in sides {
        if index.local_pod(at).is_none() {
            continue;
        }
        if let Some(chain) = index.chain(at, dir) {
            return match decide(Some(chain), remote, proto, port) {
                Decided::Rule { origin, rule, .. } => (origin, dir.as_str().to_owned(), rule as i32),
                _ => (String::new(), dir.as_str().to_owned(), -1),
            };
        }
    }
    (String::new(), String::new(), -1)
}

/// The record of a packet policy denied (the drop log's record), with the
/// deciding rule's position when the local chain still names that policy.
/// `rejects`: denies answer (the agent's deny action), unless the rule is
/// a ClusterNetworkPolicy's Deny, which never answers.
pub fn denied(index: &Index, d: &Dropped, rejects: bool, time_unix_ms: u64) -> Option<Flow> {
    let (src, dst) = (d.src?, d.dst?);
    let direction = d.direction.unwrap_or_default();
    let dir = match direction {
        "ingress" => Some((Direction::Ingress, dst, src)),
        "egress" => Some((Direction::Egress, src, dst)),
        _ => None,
    };
    // A default deny's counter is shared: name the policies isolating the pod.
    let policy = match (d.policy.as_deref(), dir) {
        (Some(DEFAULT_DENY), Some((dir, at, _))) => index.isolating(at, dir).unwrap_or(DEFAULT_DENY).to_owned(),
        (p, _) => p.unwrap_or_default().to_owned(),
    };
    let proto = d.proto_number.and_then(Proto::from_number);
    let rule = match (dir, proto, d.dport) {
        (Some((dir, at, remote)), Some(proto), Some(port)) => {
            match index.chain(at, dir).map(|c| decide(Some(c), remote, proto, port)) {
                Some(Decided::Rule { origin, rule, allow: false }) if origin == policy => rule as i32,
                _ => -1,
            }
        }
        _ => -1,
    };
    let silent = policy.starts_with("ClusterNetworkPolicy/");
    Some(Flow {
        seq: 0,
        time_unix_ms,
        node: index.node.clone(),
        event: Event::Denied as i32,
        protocol: u32::from(d.proto_number.unwrap_or_default()),
        source: Some(index.endpoint(src, d.sport.unwrap_or_default())),
        destination: Some(index.endpoint(dst, d.dport.unwrap_or_default())),
        verdict: if rejects && !silent { Verdict::Rejected } else { Verdict::Dropped } as i32,
        policy,
        direction: direction.to_owned(),
        rule,
        packets: 1,
        bytes: 0,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use serde_json::json;

    use super::*;
    use crate::policy::explain::tests::db_admits_cache_then_web_on_5432;
    use crate::policy::model::Cluster;
    use crate::policy::model::tests::{NODE, cluster, std_policy};

    pub(crate) fn snapshot(c: Cluster) -> Latest {
        let compiler = Compiler::new(&c);
        let local =
            c.pods.iter().filter(|p| p.node == NODE).filter_map(|p| compiler.pod_policy(p)).map(Arc::new).collect();
        Latest { cluster: Arc::new(c), local }
    }

    /// What the drop log says of dev/tool's (10.0.1.3) connection to prod/db (10.0.1.2) on 5432, dropped by `policy`.
    pub(crate) fn dropped(policy: &str) -> Dropped {
        Dropped {
            policy: Some(policy.into()),
            direction: Some("ingress"),
            src: Some("10.0.1.3".parse().unwrap()),
            dst: Some("10.0.1.2".parse().unwrap()),
            proto: Some("tcp".into()),
            proto_number: Some(6),
            sport: Some(40000),
            dport: Some(5432),
        }
    }

    pub(crate) fn event(kind: Kind, src: &str, dst: &str, dport: u16) -> conntrack_events::Event {
        conntrack_events::Event {
            kind,
            proto: 6,
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            sport: 40000,
            dport,
            reply_src: None,
            counters: (kind == Kind::Destroy).then_some((10, 900)),
        }
    }

    fn end(f: &Flow, src: bool) -> (String, String) {
        let e = if src { f.source.as_ref() } else { f.destination.as_ref() }.unwrap();
        (e.namespace.clone(), e.pod.clone())
    }

    #[test]
    fn connections_of_local_pods_name_both_pods_and_the_admitting_rule() {
        let mut c = cluster();
        c.standard.push(db_admits_cache_then_web_on_5432());
        let index = Index::new(NODE, &snapshot(c));
        // prod/web (10.0.1.1, local) to prod/db (10.0.1.2, local).
        let f = connection(&index, &event(Kind::New, "10.0.1.1", "10.0.1.2", 5432), 7).expect("recorded");
        assert_eq!((end(&f, true), end(&f, false)), (("prod".into(), "web".into()), ("prod".into(), "db".into())));
        assert_eq!((f.policy.as_str(), f.direction.as_str(), f.rule), ("prod/db", "ingress", 1));
        assert_eq!((f.event, f.verdict, f.time_unix_ms), (Event::Opened as i32, Verdict::Forwarded as i32, 7));

        // dev/web (10.0.2.2, elsewhere) to prod/cache (n2): no local end, not recorded.
        assert!(connection(&index, &event(Kind::New, "10.0.2.2", "10.0.2.1", 80), 0).is_none());
        // dev/tool (local, no policy) to an outside address: recorded, no policy.
        let out = connection(&index, &event(Kind::Destroy, "10.0.1.3", "192.0.2.1", 443), 0).expect("recorded");
        assert_eq!((out.policy.as_str(), out.rule, out.packets, out.bytes), ("", -1, 10, 900));
        assert_eq!(end(&out, false), (String::new(), String::new()));

        // Through a Service: the backend that replied is the destination.
        let mut via = event(Kind::New, "10.0.1.1", "10.96.0.10", 5432);
        via.reply_src = Some("10.0.1.2".parse().unwrap());
        let f = connection(&index, &via, 0).expect("recorded");
        assert_eq!((end(&f, false), f.policy.as_str()), (("prod".into(), "db".into()), "prod/db"));
    }

    #[test]
    fn a_denied_packet_names_the_drop_rule_s_policy_and_the_answer() {
        let mut c = cluster();
        c.standard.push(std_policy("prod", "deny-all", json!({"podSelector": {}})));
        let index = Index::new(NODE, &snapshot(c));
        let d = dropped("prod/deny-all");
        let f = denied(&index, &d, true, 0).expect("recorded");
        assert_eq!((f.policy.as_str(), f.direction.as_str(), f.rule), ("prod/deny-all", "ingress", -1));
        // The end of the chain: its counter is the shared default deny's; the record names the isolating policy.
        let chain_end = Dropped { policy: Some(DEFAULT_DENY.into()), ..d.clone() };
        assert_eq!(denied(&index, &chain_end, true, 0).unwrap().policy, "prod/deny-all");
        assert_eq!((f.event, f.verdict), (Event::Denied as i32, Verdict::Rejected as i32));
        assert_eq!((end(&f, true), end(&f, false)), (("dev".into(), "tool".into()), ("prod".into(), "db".into())));
        assert_eq!(denied(&index, &d, false, 0).unwrap().verdict, Verdict::Dropped as i32);
        let no_addresses = Dropped { src: None, ..d };
        assert!(denied(&index, &no_addresses, true, 0).is_none());
    }
}
