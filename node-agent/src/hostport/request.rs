//! What a pod asks for: automatic host ports from its `weft.dev/host-ports`
//! annotation (container ports by number/protocol or by name) and fixed
//! ones from the runtime's `portMappings` (the pod spec's `hostPort`).

use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize;
use weft_api::Protocol;

pub use weft_api::host_port::PORTS_ANNOTATION;
use weft_api::host_port::{NAMESPACE_OPT_IN_LABEL, NAMESPACE_OPT_IN_VALUE};

/// Whether a namespace with these labels lets its pods use the annotation.
pub fn namespace_allows(labels: Option<&std::collections::BTreeMap<String, String>>) -> bool {
    labels.and_then(|l| l.get(NAMESPACE_OPT_IN_LABEL)).is_some_and(|v| v == NAMESPACE_OPT_IN_VALUE)
}

/// One port the pod wants reachable from outside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub protocol: Protocol,
    pub container_port: u16,
    /// `None`: pick a free port from the node's range.
    pub host_port: Option<u16>,
    /// Only traffic to this address is forwarded; `None`: every local address.
    pub host_ip: Option<IpAddr>,
    /// The container port's name, when it was asked for by name.
    pub name: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestError {
    #[error("pod annotation {PORTS_ANNOTATION}: entry {entry:?}: {reason}")]
    Annotation { entry: String, reason: String },
    #[error("runtimeConfig.portMappings: {0}")]
    PortMappings(String),
    #[error(
        "pod annotation {PORTS_ANNOTATION}: namespace {namespace} does not allow automatic host ports; a cluster admin allows them with `kubectl label namespace {namespace} {NAMESPACE_OPT_IN_LABEL}={NAMESPACE_OPT_IN_VALUE}`"
    )]
    NotAllowed { namespace: String },
}

fn protocol_of(s: &str) -> Option<Protocol> {
    match s.to_ascii_uppercase().as_str() {
        "TCP" => Some(Protocol::Tcp),
        "UDP" => Some(Protocol::Udp),
        "SCTP" => Some(Protocol::Sctp),
        _ => None,
    }
}

/// The pod's automatic host port requests, resolved against its containers'
/// ports. Empty when the pod does not opt in.
pub fn from_pod(pod: &Pod) -> Result<Vec<Wanted>, RequestError> {
    let Some(value) = pod.metadata.annotations.as_ref().and_then(|a| a.get(PORTS_ANNOTATION)) else {
        return Ok(Vec::new());
    };
    let declared: Vec<(Option<String>, u16, Protocol)> = pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter().chain(s.init_containers.iter().flatten()))
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|p| {
            let port = u16::try_from(p.container_port).ok()?;
            let proto = p.protocol.as_deref().map_or(Some(Protocol::Tcp), protocol_of)?;
            Some((p.name.clone(), port, proto))
        })
        .collect();
    let mut wanted: Vec<Wanted> = Vec::new();
    for entry in value.split([',', ' ', '\n', '\t']).map(str::trim).filter(|e| !e.is_empty()) {
        let bad = |reason: &str| RequestError::Annotation { entry: entry.to_owned(), reason: reason.to_owned() };
        let (port, proto) = match entry.split_once('/') {
            Some((p, proto)) => (p, Some(protocol_of(proto).ok_or_else(|| bad("protocol must be TCP, UDP or SCTP"))?)),
            None => (entry, None),
        };
        let w = if port.bytes().all(|b| b.is_ascii_digit()) {
            let n: u16 = port.parse().ok().filter(|n| *n > 0).ok_or_else(|| bad("port must be 1-65535"))?;
            Wanted {
                protocol: proto.unwrap_or_default(),
                container_port: n,
                host_port: None,
                host_ip: None,
                name: None,
            }
        } else {
            let matches: Vec<_> = declared
                .iter()
                .filter(|(name, _, p)| name.as_deref() == Some(port) && proto.is_none_or(|want| want == *p))
                .collect();
            let (_, n, p) = matches.first().ok_or_else(|| bad("no container port has this name"))?;
            Wanted { protocol: *p, container_port: *n, host_port: None, host_ip: None, name: Some(port.to_owned()) }
        };
        if wanted.iter().any(|x| x.protocol == w.protocol && x.container_port == w.container_port) {
            return Err(bad("the same container port is listed twice"));
        }
        wanted.push(w);
    }
    Ok(wanted)
}

/// One entry of the `portMappings` capability, as the runtime passes it:
/// the CNI conventions' camelCase, or the Go field names containerd sends
/// (go-cni's `PortMapping` has no JSON tags; Go plugins read it because
/// Go's JSON decoding ignores case).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PortMapping {
    #[serde(alias = "HostPort")]
    host_port: i64,
    #[serde(alias = "ContainerPort")]
    container_port: i64,
    #[serde(default, alias = "Protocol")]
    protocol: Option<String>,
    #[serde(default, rename = "hostIP", alias = "HostIP")]
    host_ip: Option<String>,
}

/// Fixed host ports from `runtimeConfig.portMappings` of the network
/// configuration (JSON as received on stdin).
pub fn from_runtime_config(config_json: &[u8]) -> Result<Vec<Wanted>, RequestError> {
    let bad = |m: String| RequestError::PortMappings(m);
    let v: serde_json::Value = serde_json::from_slice(config_json).map_err(|e| bad(e.to_string()))?;
    let Some(list) = v.get("runtimeConfig").and_then(|r| r.get("portMappings")) else { return Ok(Vec::new()) };
    let list: Vec<PortMapping> = serde_json::from_value(list.clone()).map_err(|e| bad(e.to_string()))?;
    let mut wanted = Vec::new();
    for m in list {
        let port = |n: i64, what: &str| {
            u16::try_from(n).ok().filter(|n| *n > 0).ok_or_else(|| bad(format!("{what} {n} is not in 1-65535")))
        };
        let protocol = match m.protocol.as_deref() {
            None | Some("") => Protocol::Tcp,
            Some(p) => protocol_of(p).ok_or_else(|| bad(format!("protocol {p:?} must be tcp, udp or sctp")))?,
        };
        let host_ip = match m.host_ip.as_deref() {
            // The unspecified address of either family: every local address.
            None | Some("") | Some("0.0.0.0") | Some("::") => None,
            Some(ip) => Some(ip.parse().map_err(|_| bad(format!("hostIP {ip:?} is not an IP address")))?),
        };
        wanted.push(Wanted {
            protocol,
            container_port: port(m.container_port, "containerPort")?,
            host_port: Some(port(m.host_port, "hostPort")?),
            host_ip,
            name: None,
        });
    }
    Ok(wanted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_namespaces_labelled_allowed_open_the_annotation() {
        let labels = |pairs: &[(&str, &str)]| -> std::collections::BTreeMap<String, String> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        assert!(namespace_allows(Some(&labels(&[("weft.dev/host-ports", "allowed")]))));
        assert!(!namespace_allows(None));
        assert!(!namespace_allows(Some(&labels(&[("weft.dev/host-ports", "true")]))));
        assert!(!namespace_allows(Some(&labels(&[("other", "allowed")]))));
    }

    fn pod(annotation: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "annotations": {PORTS_ANNOTATION: annotation}},
            "spec": {"containers": [{"name": "app", "ports": [
                {"name": "http", "containerPort": 8080},
                {"name": "dns", "containerPort": 53, "protocol": "UDP"},
                {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"},
            ]}]},
        }))
        .unwrap()
    }

    #[test]
    fn names_numbers_and_protocols_resolve() {
        let w = from_pod(&pod("http, 53/udp 9000")).unwrap();
        assert_eq!(w.len(), 3);
        assert_eq!((w[0].protocol, w[0].container_port, w[0].name.as_deref()), (Protocol::Tcp, 8080, Some("http")));
        assert_eq!((w[1].protocol, w[1].container_port), (Protocol::Udp, 53));
        assert_eq!((w[2].protocol, w[2].container_port, w[2].host_port), (Protocol::Tcp, 9000, None));
    }

    #[test]
    fn a_name_with_a_protocol_picks_that_port() {
        let w = from_pod(&pod("dns/UDP,dns-tcp")).unwrap();
        assert_eq!((w[0].protocol, w[0].container_port), (Protocol::Udp, 53));
        assert_eq!((w[1].protocol, w[1].container_port), (Protocol::Tcp, 53));
    }

    #[test]
    fn bad_entries_name_the_entry_and_the_reason() {
        let e = from_pod(&pod("grpc")).unwrap_err().to_string();
        assert!(e.contains("\"grpc\"") && e.contains("no container port has this name"), "{e}");
        assert!(from_pod(&pod("80/ICMP")).unwrap_err().to_string().contains("TCP, UDP or SCTP"));
        assert!(from_pod(&pod("0")).unwrap_err().to_string().contains("1-65535"));
        assert!(from_pod(&pod("70000")).is_err());
        assert!(from_pod(&pod("http,8080")).unwrap_err().to_string().contains("twice"));
    }

    #[test]
    fn no_annotation_asks_for_nothing() {
        let p: Pod = serde_json::from_value(serde_json::json!({"metadata": {"name": "x"}})).unwrap();
        assert_eq!(from_pod(&p).unwrap(), vec![]);
    }

    #[test]
    fn port_mappings_as_containerd_sends_them() {
        // containerd 2.2 through go-cni: Go field names, lower-case protocol.
        let conf = serde_json::json!({"runtimeConfig": {"portMappings": [
            {"HostPort": 18088, "ContainerPort": 8080, "Protocol": "tcp", "HostIP": ""},
        ]}});
        let wanted = from_runtime_config(conf.to_string().as_bytes()).unwrap();
        assert_eq!(wanted.len(), 1);
        assert_eq!((wanted[0].host_port, wanted[0].container_port), (Some(18088), 8080));
        assert_eq!(wanted[0].protocol, Protocol::Tcp);
        assert_eq!(wanted[0].host_ip, None);
    }

    #[test]
    fn port_mappings_are_fixed_ports() {
        let conf = br#"{"runtimeConfig":{"portMappings":[
            {"hostPort":8080,"containerPort":80,"protocol":"tcp"},
            {"hostPort":5353,"containerPort":53,"protocol":"udp","hostIP":"10.0.0.1"},
            {"hostPort":5354,"containerPort":53,"protocol":"udp","hostIP":"fd00:250::11"},
            {"hostPort":8081,"containerPort":80,"hostIP":"::"}]}}"#;
        let w = from_runtime_config(conf).unwrap();
        assert_eq!(w[0].host_port, Some(8080));
        assert_eq!((w[1].protocol, w[1].host_ip), (Protocol::Udp, Some("10.0.0.1".parse().unwrap())));
        assert_eq!(w[2].host_ip, Some("fd00:250::11".parse().unwrap()));
        assert_eq!(w[3].host_ip, None, "the unspecified IPv6 address is every address");
        let bad = br#"{"runtimeConfig":{"portMappings":[{"hostPort":1,"containerPort":80,"hostIP":"fd00::1::2"}]}}"#;
        assert!(from_runtime_config(bad).unwrap_err().to_string().contains("is not an IP address"));
        assert_eq!(from_runtime_config(b"{}").unwrap(), vec![]);
        let bad = br#"{"runtimeConfig":{"portMappings":[{"hostPort":0,"containerPort":80}]}}"#;
        assert!(from_runtime_config(bad).unwrap_err().to_string().contains("hostPort 0"));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Any annotation text: no panic; what is accepted names declared
            /// ports (by name) or a valid port number.
            #[test]
            fn any_annotation_resolves_or_is_refused(text in "\\PC{0,60}|[a-z0-9/, -]{0,40}") {
                if let Ok(wanted) = from_pod(&pod(&text)) {
                    for w in wanted {
                        prop_assert!(w.container_port > 0 && w.host_port.is_none());
                        if let Some(name) = &w.name {
                            prop_assert!(["http", "dns", "dns-tcp"].contains(&name.as_str()), "{}", name);
                        }
                    }
                }
            }

            /// Any runtime portMappings: no panic; accepted ports are 1-65535.
            #[test]
            fn any_port_mappings_decode_or_are_refused(
                container in any::<i64>(), host in any::<i64>(),
                protocol in "\\PC{0,6}|tcp|UDP", host_ip in "\\PC{0,16}|10[.]0[.]0[.][0-9]{1,3}",
                garbage in prop::collection::vec(any::<u8>(), 0..64),
            ) {
                let conf = serde_json::json!({"runtimeConfig": {"portMappings": [
                    {"containerPort": container, "hostPort": host, "protocol": protocol, "hostIP": host_ip},
                    {"ContainerPort": container, "HostPort": host},
                ]}});
                if let Ok(wanted) = from_runtime_config(conf.to_string().as_bytes()) {
                    for w in wanted {
                        prop_assert!(w.container_port > 0 && w.host_port.is_some_and(|p| p > 0));
                    }
                }
                let _ = from_runtime_config(&garbage);
            }
        }
    }
}
