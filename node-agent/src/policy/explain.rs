//! Why policy admits or refuses one connection, pure: the chains the agent
//! enforces (`model::Compiler`), evaluated for one packet at both ends.
//! The egress side is the source pod's, the ingress side the destination
//! pod's; an end that is not a pod has no side of its own (nothing of
//! Weft's filters there). What `weft explain` prints, and what the agent
//! names as the policy of a flow.

use std::net::IpAddr;

use serde::Serialize;

use super::model::{Chain, Compiler, Direction, PodInfo, Proto, Verdict};

/// One end of a connection: an address, and the pod that holds it if any.
#[derive(Clone, Copy, Debug)]
pub struct Endpoint<'c> {
    pub addr: IpAddr,
    pub pod: Option<&'c PodInfo>,
}

/// What decided one direction at one pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "by", rename_all = "camelCase")]
pub enum Decided {
    /// No policy selects this end in this direction (or it is no pod): admitted.
    NotSelected,
    /// The first rule that matched: `origin` (`ns/name`,
    /// `weft.dev/ns/name`, `ClusterNetworkPolicy/name`), the rule's
    /// position in that policy's rules of this direction (from 0).
    #[serde(rename_all = "camelCase")]
    Rule { origin: String, rule: u32, allow: bool },
    /// Selected by a standard policy of this direction and no rule
    /// admitted it: refused.
    DefaultDeny,
    /// Selected only by policies that neither isolate (Weft's, cluster
    /// ones) nor matched: admitted.
    NoRuleMatched,
}

impl Decided {
    pub fn admitted(&self) -> bool {
        match self {
            Decided::NotSelected | Decided::NoRuleMatched => true,
            Decided::Rule { allow, .. } => *allow,
            Decided::DefaultDeny => false,
        }
    }
}

/// The decision at one end.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Side {
    /// `ns/name` of the pod at this end; None: no pod.
    pub pod: Option<String>,
    pub direction: &'static str,
    /// The policies selecting the pod in this direction.
    pub selected_by: Vec<String>,
    pub decided: Decided,
}

/// Both ends' decisions; admitted only when both admit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Explanation {
    pub from: IpAddr,
    pub to: IpAddr,
    pub protocol: &'static str,
    pub port: u16,
    pub egress: Side,
    pub ingress: Side,
    pub allowed: bool,
}

impl Explanation {
    /// The side that refused (egress first: it is where the packet is
    /// dropped first), if one did.
    pub fn refused_by(&self) -> Option<&Side> {
        [&self.egress, &self.ingress].into_iter().find(|s| !s.decided.admitted())
    }
}

/// What `chain` (None: no policy selects) decides for a packet from (ingress)
/// or to (egress) `remote` with destination port `proto`/`port`.
pub fn decide(chain: Option<&Chain>, remote: IpAddr, proto: Proto, port: u16) -> Decided {
    let Some(chain) = chain else { return Decided::NotSelected };
    match chain.rules.iter().find(|r| r.matches.iter().any(|m| m.hits(remote, proto, port))) {
        Some(r) => Decided::Rule { origin: r.origin.clone(), rule: r.index, allow: r.verdict == Verdict::Allow },
        None if chain.default_deny => Decided::DefaultDeny,
        None => Decided::NoRuleMatched,
    }
}

/// Explains a connection from `from` to `to`'s `proto`/`port`.
pub fn explain(compiler: &Compiler<'_>, from: Endpoint<'_>, to: Endpoint<'_>, proto: Proto, port: u16) -> Explanation {
    let side = |end: Endpoint<'_>, dir: Direction, remote: IpAddr| -> Side {
        let Some(pod) = end.pod else {
            return Side { pod: None, direction: dir.as_str(), selected_by: Vec::new(), decided: Decided::NotSelected };
        };
        let policy = compiler.pod_policy(pod);
        let chain = policy.as_ref().and_then(|p| match dir {
            Direction::Ingress => p.ingress.as_ref(),
            Direction::Egress => p.egress.as_ref(),
        });
        Side {
            pod: Some(pod.key()),
            direction: dir.as_str(),
            selected_by: compiler.selecting(pod, dir),
            decided: decide(chain, remote, proto, port),
        }
    };
    let egress = side(from, Direction::Egress, to.addr);
    let ingress = side(to, Direction::Ingress, from.addr);
    let allowed = egress.decided.admitted() && ingress.decided.admitted();
    Explanation { from: from.addr, to: to.addr, protocol: proto_name(proto), port, egress, ingress, allowed }
}

fn proto_name(p: Proto) -> &'static str {
    match p {
        Proto::Tcp => "TCP",
        Proto::Udp => "UDP",
        Proto::Sctp => "SCTP",
    }
}

#[cfg(test)]
#[path = "explain_tests.rs"]
pub(crate) mod tests;
