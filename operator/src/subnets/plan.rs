//! The pure part of leasing: which block each waiting node gets, what a
//! new lease looks like, which of two overlapping leases keeps its block,
//! and when a withdrawn block may be let go.

use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use weft_api::Subnet;
use weft_api::subnet::{CONDITION_READY, LEASE_FINALIZER, REASON_LEASE_WITHDRAWN, SubnetSpec};

use super::NODE_LABEL;
use crate::config::Config;
use crate::ipam::Pool;

/// What an allocation pass does for one waiting node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The node has a Subnet already: `existing[i]` (also a withdrawn one,
    /// which the node waits out).
    Has(usize),
    /// Lease these blocks: the primary pool's, then the secondary's.
    Lease(Vec<IpNet>),
    /// `existing[i]` waits for a range (made when the pool had none free):
    /// give it these blocks, as [`Decision::Lease`].
    Fill(usize, Vec<IpNet>),
    /// `existing[i]` has no block of the secondary pool's family yet: add this one.
    Extend(usize, IpNet),
    /// No block is free in what was listed, but the list may have missed
    /// deletions: list again fully consistently before reporting exhaustion.
    LookAgain,
    /// `pool` has no free block (`in_use` of them are leased).
    Exhausted { pool: Pool, in_use: u128 },
}

/// The allocation plan, pure: for each waiting node in order, from every
/// Subnet listed (withdrawn ones included: their blocks stay reserved until
/// let go), the pool and, in a dual-stack cluster, the other family's pool.
/// A new node gets a block of each; a lease from before the cluster was
/// made dual-stack gets the block it lacks. Also returns how many blocks of
/// the primary pool are then in use.
pub fn plan(
    existing: &[Subnet],
    nodes: &[&str],
    pool: &Pool,
    secondary: Option<&Pool>,
    fully_consistent: bool,
) -> (Vec<Decision>, u128) {
    let mut used: Vec<IpNet> = existing.iter().flat_map(blocks).collect();
    let mut in_pool = used.iter().filter(|n| pool.contains(n)).count() as u128;
    let lease_from = |p: &Pool, used: &mut Vec<IpNet>| match p.next_free(used.as_slice()) {
        Some(cidr) => {
            used.push(cidr);
            Ok(cidr)
        }
        None if !fully_consistent => Err(Decision::LookAgain),
        None => Err(Decision::Exhausted { pool: *p, in_use: used.iter().filter(|n| p.contains(n)).count() as u128 }),
    };
    let decisions = nodes
        .iter()
        .map(|node| {
            let existing_at = existing.iter().position(|s| s.name_any() == *node);
            let waiting = existing_at
                .filter(|i| existing[*i].spec.is_pending() && existing[*i].metadata.deletion_timestamp.is_none());
            if let Some(i) = existing_at.filter(|_| waiting.is_none()) {
                let missing = secondary.filter(|p| {
                    existing[i].metadata.deletion_timestamp.is_none() && !blocks(&existing[i]).any(|b| p.contains(&b))
                });
                return match missing {
                    Some(p) => lease_from(p, &mut used).map(|cidr| Decision::Extend(i, cidr)).unwrap_or_else(|d| d),
                    None => Decision::Has(i),
                };
            }
            let first = match lease_from(pool, &mut used) {
                Ok(cidr) => cidr,
                Err(d) => return d,
            };
            let mut cidrs = vec![first];
            if let Some(p) = secondary {
                match lease_from(p, &mut used) {
                    Ok(cidr) => cidrs.push(cidr),
                    Err(d) => {
                        // Not leased after all: the node waits for both.
                        used.retain(|u| *u != first);
                        return d;
                    }
                }
            }
            in_pool += 1;
            match waiting {
                Some(i) => Decision::Fill(i, cidrs),
                None => Decision::Lease(cidrs),
            }
        })
        .collect();
    (decisions, in_pool)
}

/// Every block a Subnet reserves, parsed (one per family).
pub fn blocks(subnet: &Subnet) -> impl Iterator<Item = IpNet> + '_ {
    subnet.spec.blocks().filter_map(|b| b.parse().ok())
}

/// A lease of `cidrs` (the primary pool's block first; two in a dual-stack cluster).
pub fn new_subnet(node: &str, cidrs: &[IpNet], config: &Config) -> Subnet {
    let backend: weft_api::Backend = config.backend.into();
    let mut subnet = Subnet::new(
        node,
        SubnetSpec {
            node_name: node.to_string(),
            cidr: cidrs.first().map(IpNet::to_string).unwrap_or_default(),
            cidrs: if cidrs.len() > 1 { cidrs.iter().map(IpNet::to_string).collect() } else { Vec::new() },
            backend,
            vni: (backend == weft_api::Backend::Vxlan).then_some(config.vni),
            mtu: config.mtu,
        },
    );
    subnet.metadata.labels = Some([(NODE_LABEL.to_string(), node.to_string())].into());
    // No owner reference to the Node: the garbage collector would withdraw
    // the lease the moment a Node object is deleted, also when the node
    // registers again at once with its pods still running.
    subnet.metadata.finalizers = Some(vec![LEASE_FINALIZER.to_string()]);
    subnet
}

/// The Subnet of a node the pool has no range for: no range yet, no
/// finalizer (it reserves nothing); its `Allocated` condition says why.
pub fn waiting_subnet(node: &str, config: &Config) -> Subnet {
    let mut subnet = new_subnet(node, &[], config);
    subnet.metadata.finalizers = None;
    subnet
}

/// The merge patch that gives a waiting Subnet its blocks and the lease
/// finalizer, guarded by the resourceVersion the plan saw (a changed
/// Subnet answers 409 and the node is planned again).
pub fn fill_patch(subnet: &Subnet, cidrs: &[IpNet]) -> serde_json::Value {
    let mut finalizers: Vec<String> = subnet.finalizers().to_vec();
    if !finalizers.iter().any(|f| f == LEASE_FINALIZER) {
        finalizers.push(LEASE_FINALIZER.to_string());
    }
    let mut spec = serde_json::json!({"cidr": cidrs.first().map(IpNet::to_string).unwrap_or_default()});
    if cidrs.len() > 1 {
        spec["cidrs"] = cidrs.iter().map(IpNet::to_string).collect();
    }
    serde_json::json!({
        "metadata": {"resourceVersion": subnet.resource_version(), "finalizers": finalizers},
        "spec": spec,
    })
}

/// One side of an overlap between two Subnets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// A present node's agent has published the lease (its `Ready`
    /// condition) and not let it go: pods may have addresses in the block.
    in_use: bool,
    created: Option<Timestamp>,
    name: String,
}

impl Claim {
    pub fn of(subnet: &Subnet, node_present: bool) -> Self {
        let ready = ready_condition(subnet);
        Self {
            in_use: node_present
                && subnet.metadata.deletion_timestamp.is_none()
                && ready.is_some_and(|c| c.reason != REASON_LEASE_WITHDRAWN),
            created: subnet.metadata.creation_timestamp.as_ref().map(|t| t.0),
            name: subnet.name_any(),
        }
    }

    /// Whether this side keeps the block over `other`. A lease a live node
    /// uses beats one nobody uses, so that a hand-written or restored
    /// object, however old, never takes a working node's block; between
    /// equals the older wins, then the name. A total order, so both
    /// reconciles agree on the loser.
    pub fn beats(&self, other: &Claim) -> bool {
        let key = |c: &Claim| (!c.in_use, c.created, c.name.clone());
        key(self) < key(other)
    }
}

/// The `Ready` condition the node's agent publishes on its Subnet.
pub fn ready_condition(subnet: &Subnet) -> Option<&Condition> {
    subnet.status.as_ref()?.conditions.iter().find(|c| c.type_ == CONDITION_READY)
}

/// What the Subnet's `Ready` condition says about the node's agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Agent {
    /// No agent ever published it: no pod got an address from the block.
    NeverUsed,
    /// The agent saw the withdrawal and lets go once its pods are gone.
    Draining,
    /// The agent used the lease and has not (yet) answered the withdrawal.
    Silent,
}

/// How long a gone node's agent has to answer a withdrawal before the
/// operator takes it for dead; a live agent answers within a second or two.
const ANSWER_WAIT: Duration = Duration::from_secs(15);

/// Whether the block of a withdrawn lease may be let go; `Err` says what is
/// still waited for. A node's agent lets go itself once its pods are gone;
/// the operator steps in only for a node without a working agent: one that
/// is gone (after giving a draining agent `grace`, a silent one
/// [`ANSWER_WAIT`]) or whose agent never used the lease. Either way no pod
/// in the API may hold an address in it.
pub fn may_let_go(
    node_present: bool,
    agent: Agent,
    pods_in_block: usize,
    withdrawn_for: Duration,
    grace: Duration,
) -> Result<(), String> {
    if pods_in_block > 0 {
        return Err(format!("{pods_in_block} pods on its node still have addresses in it"));
    }
    match agent {
        Agent::NeverUsed => Ok(()),
        _ if node_present => Err("the node's agent lets it go once its pods are gone".into()),
        Agent::Draining if withdrawn_for < grace => {
            Err(format!("the node is gone and its agent is letting go; it has {grace:?} to finish"))
        }
        Agent::Silent if withdrawn_for < ANSWER_WAIT => {
            Err(format!("the node is gone; its agent has {ANSWER_WAIT:?} to answer"))
        }
        Agent::Draining | Agent::Silent => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;

    #[test]
    fn new_subnet_is_reserved_by_the_finalizer_and_carries_backend_data() {
        let cfg = Config::try_parse_from(["x", "--vni", "42", "--mtu", "1400"]).expect("config");
        let s = new_subnet("n1", &["10.244.3.0/24".parse().expect("cidr")], &cfg);
        assert_eq!(s.name_any(), "n1");
        assert_eq!(s.spec.cidr, "10.244.3.0/24");
        assert_eq!(s.spec.vni, Some(42));
        assert_eq!(s.spec.mtu, Some(1400));
        assert_eq!(s.finalizers(), [LEASE_FINALIZER.to_string()]);
        assert!(s.owner_references().is_empty(), "no owner: the garbage collector must not withdraw leases");
        let cfg = Config::try_parse_from(["x", "--backend", "host-gw"]).expect("config");
        let s = new_subnet("n1", &["10.244.3.0/24".parse().expect("cidr")], &cfg);
        assert_eq!(s.spec.vni, None, "host-gw has no VNI");
    }

    fn leased(node: &str, cidr: &str, withdrawn: bool) -> Subnet {
        let cfg = Config::try_parse_from(["x"]).expect("config");
        let mut s = new_subnet(node, &[cidr.parse().expect("cidr")], &cfg);
        if withdrawn {
            s.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        }
        s
    }

    #[test]
    fn the_plan_keeps_leases_fills_holes_and_never_reuses_a_withdrawn_block() {
        let pool = Pool::new("10.9.0.0/16".parse().expect("cidr"), 24).expect("pool");
        let existing = [
            leased("a", "10.9.0.0/24", false),
            // Withdrawn but not let go: its block is still reserved.
            leased("gone", "10.9.1.0/24", true),
            leased("c", "10.9.3.0/24", false),
        ];
        let (decisions, in_pool) = plan(&existing, &["new1", "a", "new2", "gone", "new3"], &pool, None, true);
        assert_eq!(
            decisions,
            [
                Decision::Lease(vec!["10.9.2.0/24".parse().expect("cidr")]),
                Decision::Has(0),
                Decision::Lease(vec!["10.9.4.0/24".parse().expect("cidr")]),
                Decision::Has(1),
                Decision::Lease(vec!["10.9.5.0/24".parse().expect("cidr")]),
            ]
        );
        assert_eq!(in_pool, 6);
    }

    #[test]
    fn dual_stack_leases_a_block_of_each_family_and_extends_older_leases() {
        let pool = Pool::new("10.9.0.0/23".parse().expect("cidr"), 24).expect("pool");
        let v6 = Pool::new("fd00:9::/63".parse().expect("cidr"), 64).expect("pool");
        let net = |s: &str| -> IpNet { s.parse().expect("cidr") };
        let cfg = Config::try_parse_from(["x"]).expect("config");
        // `a` leased both; `old` is from before the cluster was dual-stack.
        let existing =
            [new_subnet("a", &[net("10.9.0.0/24"), net("fd00:9::/64")], &cfg), leased("old", "10.9.1.0/24", false)];
        assert_eq!(existing[0].spec.cidrs, ["10.9.0.0/24", "fd00:9::/64"]);
        assert!(existing[1].spec.cidrs.is_empty(), "single-stack leases list no cidrs");
        let (decisions, _) = plan(&existing, &["a", "old", "new"], &pool, Some(&v6), true);
        assert_eq!(
            decisions,
            [
                Decision::Has(0),
                Decision::Extend(1, net("fd00:9:0:1::/64")),
                // The IPv4 pool is full: the node waits, and takes no IPv6 block meanwhile.
                Decision::Exhausted { pool, in_use: 2 },
            ]
        );
        let existing = [new_subnet("a", &[net("10.9.0.0/24"), net("fd00:9::/64")], &cfg)];
        let (decisions, in_pool) = plan(&existing, &["b", "c"], &pool, Some(&v6), true);
        assert_eq!(
            decisions,
            [
                Decision::Lease(vec![net("10.9.1.0/24"), net("fd00:9:0:1::/64")]),
                Decision::Exhausted { pool, in_use: 2 },
            ]
        );
        assert_eq!(in_pool, 2);
        // An exhausted secondary pool holds the primary block back too.
        let (decisions, _) = plan(&[leased("x", "fd00:9::/63", false)], &["b"], &pool, Some(&v6), true);
        assert_eq!(decisions, [Decision::Exhausted { pool: v6, in_use: 1 }]);
        let (decisions, _) = plan(&[leased("x", "fd00:9::/63", false)], &["b", "c"], &pool, Some(&v6), false);
        assert_eq!(decisions, [Decision::LookAgain, Decision::LookAgain]);
    }

    #[test]
    fn a_full_pool_is_looked_at_again_before_it_is_reported_exhausted() {
        let pool = Pool::new("10.9.0.0/23".parse().expect("cidr"), 24).expect("pool");
        let existing = [leased("a", "10.9.0.0/24", false)];
        let (cheap, _) = plan(&existing, &["b", "c"], &pool, None, false);
        assert_eq!(cheap, [Decision::Lease(vec!["10.9.1.0/24".parse().expect("cidr")]), Decision::LookAgain]);
        let (consistent, in_pool) = plan(&existing, &["b", "c"], &pool, None, true);
        assert_eq!(consistent[1], Decision::Exhausted { pool, in_use: 2 });
        assert_eq!(in_pool, 2);
    }

    #[test]
    fn a_node_waiting_for_a_range_gets_one_in_its_own_subnet_once_one_is_free() {
        let pool = Pool::new("10.9.0.0/23".parse().expect("cidr"), 24).expect("pool");
        let cfg = Config::try_parse_from(["x"]).expect("config");
        let waiting = waiting_subnet("w", &cfg);
        assert!(waiting.spec.is_pending() && waiting.spec.blocks().next().is_none());
        assert!(waiting.finalizers().is_empty(), "it reserves nothing");
        let json = serde_json::to_value(&waiting).expect("json");
        assert!(json["spec"].get("cidr").is_none(), "no range is written: {json}");
        // Full: it keeps waiting, and is counted as reserving nothing.
        let full = [leased("a", "10.9.0.0/24", false), leased("b", "10.9.1.0/24", false), waiting.clone()];
        let (decisions, _) = plan(&full, &["w"], &pool, None, true);
        assert_eq!(decisions, [Decision::Exhausted { pool, in_use: 2 }]);
        // A range freed: the waiting Subnet is filled, not made anew.
        let freed = [leased("a", "10.9.0.0/24", false), waiting.clone()];
        let (decisions, in_pool) = plan(&freed, &["w"], &pool, None, true);
        let cidr: IpNet = "10.9.1.0/24".parse().expect("cidr");
        assert_eq!(decisions, [Decision::Fill(1, vec![cidr])]);
        assert_eq!(in_pool, 2);
        let mut with_rv = waiting.clone();
        with_rv.metadata.resource_version = Some("7".into());
        let patch = fill_patch(&with_rv, &[cidr, "fd00:9::/64".parse().expect("cidr")]);
        assert_eq!(
            patch,
            serde_json::json!({
                "metadata": {"resourceVersion": "7", "finalizers": [LEASE_FINALIZER]},
                "spec": {"cidr": "10.9.1.0/24", "cidrs": ["10.9.1.0/24", "fd00:9::/64"]},
            })
        );
    }

    #[test]
    fn a_withdrawn_block_is_let_go_only_when_nobody_can_use_it() {
        use Agent::*;
        let grace = Duration::from_secs(60);
        let (short, middle, long) = (Duration::from_secs(5), Duration::from_secs(20), Duration::from_secs(61));
        // Pods in the API with addresses in the block: never.
        for agent in [NeverUsed, Draining, Silent] {
            for present in [true, false] {
                assert!(may_let_go(present, agent, 1, long, grace).is_err(), "{agent:?} {present}");
            }
        }
        // A live node whose agent used it: only the agent lets go.
        assert!(may_let_go(true, Draining, 0, long, grace).is_err());
        assert!(may_let_go(true, Silent, 0, long, grace).is_err());
        // A gone node: a draining agent gets the grace period, a silent one
        // a short while to answer.
        assert!(may_let_go(false, Draining, 0, middle, grace).is_err());
        assert!(may_let_go(false, Draining, 0, long, grace).is_ok());
        assert!(may_let_go(false, Silent, 0, short, grace).is_err());
        assert!(may_let_go(false, Silent, 0, middle, grace).is_ok());
        // No agent ever used it: nothing to wait for.
        assert!(may_let_go(true, NeverUsed, 0, short, grace).is_ok());
        assert!(may_let_go(false, NeverUsed, 0, short, grace).is_ok());
    }
}
