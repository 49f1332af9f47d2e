//! `weft explain --from ns/pod --to ns/pod --port 80/TCP`: reads pods,
//! namespaces and every kind of policy from the API, and evaluates the
//! connection with the agent's policy model (`policy::explain`), as the
//! agents of both ends would. With `--probe`, run in the agent pod of the
//! source's node, it also sends one connection from the source pod and
//! shows how it ended and the flow records it made.

use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy as StandardPolicy;
use kube::{Api, Client};
use weft_agent::policy::caches::{namespace_labels, node_info, pod_info, valid_weft};
use weft_agent::policy::explain::{Decided, Endpoint, Explanation, Side, explain};
use weft_agent::policy::model::{Cluster, Compiler, PodInfo, Proto};
use weft_api::cluster_network_policy::ClusterNetworkPolicy;
use weft_api::network_policy::NetworkPolicy as WeftPolicy;

use crate::kube_read::{list_all, list_if_served};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The source: a pod as NAMESPACE/NAME, or an IP address.
    #[arg(long, value_parser = parse_target)]
    from: Target,
    /// The destination: a pod as NAMESPACE/NAME, or an IP address.
    #[arg(long, value_parser = parse_target)]
    to: Target,
    /// The destination port and protocol: PORT[/TCP|UDP|SCTP] (default TCP).
    #[arg(long, value_parser = parse_port)]
    port: (u16, Proto),
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = Output::Text)]
    output: Output,
    /// Also send one connection (TCP or UDP) from the source pod, from
    /// inside its network namespace, and show how it ended and the flow
    /// records it made. Run in the agent pod of the source pod's node:
    /// `kubectl exec -n <ns> <weft-agent pod> -- weft explain … --probe`.
    #[arg(long)]
    probe: bool,
    /// Whether ClusterNetworkPolicies count, as they do for the agents when
    /// they enforce them (chart `clusterNetworkPolicy.enforce`): `auto`
    /// reads them when the API serves them; `true`/`false`. In the agent's
    /// container it follows the agent's own setting.
    #[arg(long, env = "WEFT_CLUSTER_NETWORK_POLICY", default_value = "auto", value_parser = parse_cluster_policies)]
    cluster_network_policies: ClusterPolicies,
    /// The agent's socket, for --probe (in the agent's container, its WEFT_AGENT_SOCKET).
    #[arg(long, env = "WEFT_AGENT_SOCKET", default_value = weft_proto::DEFAULT_AGENT_SOCKET)]
    socket: PathBuf,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Output {
    Text,
    Json,
}

/// Whether ClusterNetworkPolicies are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterPolicies {
    /// When the API serves them.
    Auto,
    Enforced,
    Ignored,
}

fn parse_cluster_policies(s: &str) -> Result<ClusterPolicies, String> {
    match s {
        "auto" => Ok(ClusterPolicies::Auto),
        "true" => Ok(ClusterPolicies::Enforced),
        "false" => Ok(ClusterPolicies::Ignored),
        _ => Err(format!("{s:?}: auto, true or false")),
    }
}

/// One end as the user named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Pod { namespace: String, name: String },
    Address(IpAddr),
}

fn parse_target(s: &str) -> Result<Target, String> {
    if let Ok(addr) = s.parse::<IpAddr>() {
        return Ok(Target::Address(addr));
    }
    let Some((namespace, name)) = s.split_once('/') else {
        return Err(format!("{s:?} is neither NAMESPACE/NAME nor an IP address"));
    };
    weft_proto::validate::namespace(namespace)?;
    weft_proto::validate::pod_name(name)?;
    Ok(Target::Pod { namespace: namespace.to_owned(), name: name.to_owned() })
}

fn parse_port(s: &str) -> Result<(u16, Proto), String> {
    let (port, proto) = s.split_once('/').unwrap_or((s, "TCP"));
    let port: u16 =
        port.parse().ok().filter(|p| *p != 0).ok_or_else(|| format!("invalid port {port:?}: 1 to 65535"))?;
    let proto = Proto::parse(Some(&proto.to_ascii_uppercase()))
        .ok_or_else(|| format!("invalid protocol {proto:?}: TCP, UDP or SCTP"))?;
    Ok((port, proto))
}

pub async fn run(client: &Client, args: &Args) -> anyhow::Result<()> {
    let cluster = read_cluster(client, args.cluster_network_policies).await?;
    let (from, to) = resolve(&cluster, &args.from, &args.to)?;
    let compiler = Compiler::with_cache(&cluster, Default::default());
    let explanation = explain(&compiler, from, to, args.port.1, args.port.0);
    let probe = if args.probe {
        let pod = explanation.egress.pod.as_deref().context("--probe needs a pod as the source")?;
        if args.port.1 == Proto::Sctp {
            bail!("--probe sends TCP or UDP only");
        }
        let target = (explanation.to, args.port.0, args.port.1);
        Some(crate::probe::send(&args.socket, pod, target, explanation.allowed).await?)
    } else {
        None
    };
    match args.output {
        Output::Json => {
            let mut out = serde_json::to_value(&explanation).context("writing the explanation")?;
            if let Some(p) = &probe {
                out["probe"] = p.json();
            }
            println!("{}", serde_json::to_string_pretty(&out).context("writing the explanation")?)
        }
        Output::Text => {
            print!("{}", text(&explanation));
            if let Some(p) = &probe {
                print!("{}", p.text());
            }
        }
    }
    Ok(())
}

/// What the agents compute policy from, read from the API.
async fn read_cluster(client: &Client, cluster_policies: ClusterPolicies) -> anyhow::Result<Cluster> {
    let pods = list_all(&Api::<Pod>::all(client.clone()), "pods").await?;
    let namespaces = list_all(&Api::<Namespace>::all(client.clone()), "namespaces").await?;
    let standard = list_all(&Api::<StandardPolicy>::all(client.clone()), "NetworkPolicies").await?;
    let weft = list_if_served(&Api::<WeftPolicy>::all(client.clone()), "weft.dev NetworkPolicies").await?;
    let api = Api::<ClusterNetworkPolicy>::all(client.clone());
    let cluster_policies = match cluster_policies {
        ClusterPolicies::Auto => list_if_served(&api, "ClusterNetworkPolicies").await?,
        ClusterPolicies::Enforced => list_all(&api, "ClusterNetworkPolicies").await?,
        ClusterPolicies::Ignored => Vec::new(),
    };
    // Only ClusterNetworkPolicy's node peers read nodes.
    let nodes = if cluster_policies.is_empty() {
        Vec::new()
    } else {
        list_all(&Api::<Node>::all(client.clone()), "nodes").await?
    };
    Ok(Cluster {
        pods: pods.iter().filter_map(pod_info).map(Arc::new).collect(),
        namespaces: namespace_labels(&namespaces),
        standard: standard.into_iter().map(Arc::new).collect(),
        weft: valid_weft(weft.into_iter().map(Arc::new).collect()),
        cluster_policies: cluster_policies.into_iter().map(Arc::new).collect(),
        nodes: nodes.iter().filter_map(node_info).map(Arc::new).collect(),
    })
}

/// Both ends as addresses of one family, with their pods. A pod named
/// must be on the pod network with an address; the destination's first
/// address (the one of the source's family when the source is an address)
/// picks the family.
fn resolve<'c>(cluster: &'c Cluster, from: &Target, to: &Target) -> anyhow::Result<(Endpoint<'c>, Endpoint<'c>)> {
    let pod_of = |t: &Target| -> anyhow::Result<Option<&'c PodInfo>> {
        Ok(match t {
            Target::Pod { namespace, name } => {
                let pod = cluster.pods.get(namespace, name).with_context(|| {
                    format!("pod {namespace}/{name} not found on the pod network (absent, host-network or finished)")
                })?;
                if pod.ips.is_empty() {
                    bail!("pod {namespace}/{name} has no address yet");
                }
                Some(pod.as_ref())
            }
            Target::Address(addr) => cluster.pods.iter().find(|p| p.ips.contains(addr)).map(Arc::as_ref),
        })
    };
    let (from_pod, to_pod) = (pod_of(from)?, pod_of(to)?);
    let to_addr = match (to, from) {
        (Target::Address(a), _) => *a,
        (Target::Pod { .. }, Target::Address(src)) => {
            let ips = to_pod.map(|p| p.ips.as_slice()).unwrap_or_default();
            *ips.iter()
                .find(|a| a.is_ipv4() == src.is_ipv4())
                .context("the destination pod has no address of the source's family")?
        }
        (Target::Pod { .. }, Target::Pod { .. }) => {
            to_pod.map(|p| p.ips[0]).context("the destination pod has no address")?
        }
    };
    let from_addr = match from {
        Target::Address(a) if a.is_ipv4() != to_addr.is_ipv4() => bail!("{a} and {to_addr} are of different families"),
        Target::Address(a) => *a,
        Target::Pod { namespace, name } => {
            let ips = from_pod.map(|p| p.ips.as_slice()).unwrap_or_default();
            *ips.iter()
                .find(|a| a.is_ipv4() == to_addr.is_ipv4())
                .with_context(|| format!("pod {namespace}/{name} has no address of {to_addr}'s family"))?
        }
    };
    Ok((Endpoint { addr: from_addr, pod: from_pod }, Endpoint { addr: to_addr, pod: to_pod }))
}

/// The explanation in words.
fn text(e: &Explanation) -> String {
    let end = |side: &Side, addr: IpAddr| match &side.pod {
        Some(pod) => format!("{pod} ({addr})"),
        None => addr.to_string(),
    };
    let verdict = |ok: bool| if ok { "allowed" } else { "denied" };
    let mut out = format!(
        "{} -> {} {}/{}: {}\n",
        end(&e.egress, e.from),
        end(&e.ingress, e.to),
        e.port,
        e.protocol,
        verdict(e.allowed).to_uppercase()
    );
    for side in [&e.egress, &e.ingress] {
        let Some(pod) = &side.pod else {
            let _ = writeln!(out, "  {}: not a pod, nothing of Weft's filters there", side.direction);
            continue;
        };
        let why = match &side.decided {
            Decided::NotSelected => "no policy selects it in this direction".to_owned(),
            Decided::Rule { origin, rule, allow } => {
                format!("{} by {origin} spec.{}[{rule}]", if *allow { "allowed" } else { "denied" }, side.direction)
            }
            Decided::DefaultDeny => "no rule admits it, and a NetworkPolicy isolates the pod".to_owned(),
            Decided::NoRuleMatched => "no rule matches, and no NetworkPolicy isolates the pod".to_owned(),
        };
        let selected = if side.selected_by.is_empty() {
            String::new()
        } else {
            format!(" (selected by {})", side.selected_by.join(", "))
        };
        let _ = writeln!(out, "  {} at {pod}: {}: {why}{selected}", side.direction, verdict(side.decided.admitted()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str, name: &str, ips: &[&str]) -> Arc<PodInfo> {
        Arc::new(PodInfo {
            namespace: ns.into(),
            name: name.into(),
            labels: Default::default(),
            ips: ips.iter().map(|a| a.parse().unwrap()).collect(),
            node: "n1".into(),
            ports: vec![],
        })
    }

    #[test]
    fn targets_and_ports_are_checked_where_they_enter() {
        assert_eq!(parse_target("prod/db-0").unwrap(), Target::Pod { namespace: "prod".into(), name: "db-0".into() });
        assert_eq!(parse_target("fd00::1").unwrap(), Target::Address("fd00::1".parse().unwrap()));
        for bad in ["db", "Prod/db", "prod/db/x", "prod/../x", "prod/", "/db", "prod/db%2f"] {
            assert!(parse_target(bad).is_err(), "{bad} accepted");
        }
        assert_eq!(parse_cluster_policies("false"), Ok(ClusterPolicies::Ignored));
        assert!(parse_cluster_policies("yes").is_err());
        assert_eq!(parse_port("80").unwrap(), (80, Proto::Tcp));
        assert_eq!(parse_port("53/udp").unwrap(), (53, Proto::Udp));
        for bad in ["0", "65536", "80/icmp", "http", "80/"] {
            assert!(parse_port(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn ends_resolve_to_addresses_of_one_family() {
        let c = Cluster {
            pods: vec![pod("a", "web", &["10.0.0.1", "fd00::1"]), pod("a", "v6", &["fd00::2"]), pod("a", "new", &[])]
                .into(),
            ..Cluster::default()
        };
        let web = Target::Pod { namespace: "a".into(), name: "web".into() };
        let v6 = Target::Pod { namespace: "a".into(), name: "v6".into() };
        let (f, t) = resolve(&c, &web, &v6).unwrap();
        assert_eq!((f.addr, t.addr), ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap()));
        let (f, t) = resolve(&c, &Target::Address("10.0.0.1".parse().unwrap()), &web).unwrap();
        assert_eq!(f.pod.map(PodInfo::key), Some("a/web".into()), "an address of a pod is that pod");
        assert_eq!(t.addr, "10.0.0.1".parse::<IpAddr>().unwrap());
        let err = resolve(&c, &v6, &Target::Address("10.0.0.9".parse().unwrap())).unwrap_err();
        assert!(format!("{err:#}").contains("no address of 10.0.0.9's family"), "{err:#}");
        let gone = Target::Pod { namespace: "a".into(), name: "gone".into() };
        assert!(format!("{:#}", resolve(&c, &gone, &web).unwrap_err()).contains("a/gone not found"));
        let new = Target::Pod { namespace: "a".into(), name: "new".into() };
        assert!(format!("{:#}", resolve(&c, &web, &new).unwrap_err()).contains("no address yet"));
    }

    #[test]
    fn text_names_the_deciding_rule_and_the_selecting_policies() {
        let e = Explanation {
            from: "10.0.0.1".parse().unwrap(),
            to: "10.0.0.2".parse().unwrap(),
            protocol: "TCP",
            port: 80,
            egress: Side { pod: None, direction: "egress", selected_by: vec![], decided: Decided::NotSelected },
            ingress: Side {
                pod: Some("prod/db".into()),
                direction: "ingress",
                selected_by: vec!["prod/db".into(), "prod/deny-all".into()],
                decided: Decided::Rule { origin: "prod/db".into(), rule: 1, allow: true },
            },
            allowed: true,
        };
        let t = text(&e);
        assert!(t.starts_with("10.0.0.1 -> prod/db (10.0.0.2) 80/TCP: ALLOWED\n"), "{t}");
        assert!(
            t.contains(
                "ingress at prod/db: allowed: allowed by prod/db spec.ingress[1] (selected by prod/db, prod/deny-all)"
            ),
            "{t}"
        );
        assert!(t.contains("egress: not a pod"), "{t}");
    }
}
