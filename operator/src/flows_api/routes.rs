//! The API's paths, query and documents, and what a namespace's reader may
//! see of a record: pure, so that every rule here is unit-tested.

use serde_json::{Value, json};
use weft_proto::flows::v1::{Filter, Flow, Verdict};

pub const GROUP: &str = "flows.weft.dev";
pub const VERSION: &str = "v1alpha1";
pub const RESOURCE: &str = "flows";
/// The newest records one answer carries at most.
pub const MAX_LIMIT: u32 = 10_000;

/// What a request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// `/apis`, `/apis/flows.weft.dev`, `/apis/flows.weft.dev/v1alpha1`.
    GroupList,
    Group,
    Resources,
    /// The flows of one namespace, or (None) of all.
    Flows {
        namespace: Option<String>,
    },
    Health,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RouteError {
    #[error("the flows API has no {0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
}

pub fn route(path: &str) -> Result<Route, RouteError> {
    let base = format!("/apis/{GROUP}/{VERSION}");
    let route = match path.trim_end_matches('/') {
        "/healthz" | "/readyz" | "/livez" => Route::Health,
        "/apis" => Route::GroupList,
        p if p == format!("/apis/{GROUP}") => Route::Group,
        p if p == base => Route::Resources,
        p => match p.strip_prefix(&base) {
            Some(rest) if rest == format!("/{RESOURCE}") => Route::Flows { namespace: None },
            Some(rest) => {
                let ns = rest
                    .strip_prefix("/namespaces/")
                    .and_then(|r| r.strip_suffix(&format!("/{RESOURCE}")))
                    .ok_or_else(|| RouteError::NotFound(path.to_owned()))?;
                weft_proto::validate::namespace(ns).map_err(RouteError::BadRequest)?;
                Route::Flows { namespace: Some(ns.to_owned()) }
            }
            None => return Err(RouteError::NotFound(path.to_owned())),
        },
    };
    Ok(route)
}

/// A list's options, from its query: `verdict`, `pod` (a name in the
/// request's namespace, or NAMESPACE/NAME), `limit`, `watch` (follow).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Query {
    pub verdict: Option<Verdict>,
    pub pod: Option<String>,
    pub limit: u32,
    pub watch: bool,
}

pub fn query(raw: Option<&str>, namespace: Option<&str>) -> Result<Query, RouteError> {
    let bad = |m: String| RouteError::BadRequest(m);
    let mut q = Query::default();
    for pair in raw.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = value.replace("%2F", "/").replace("%2f", "/");
        match key {
            "verdict" => {
                q.verdict = Some(match value.as_str() {
                    "forwarded" => Verdict::Forwarded,
                    "dropped" => Verdict::Dropped,
                    "rejected" => Verdict::Rejected,
                    v => return Err(bad(format!("verdict {v:?} is not forwarded, dropped or rejected"))),
                })
            }
            "pod" => {
                let (ns, name) = match (value.split_once('/'), namespace) {
                    (Some((ns, name)), _) => (ns.to_owned(), name.to_owned()),
                    (None, Some(ns)) => (ns.to_owned(), value.clone()),
                    (None, None) => return Err(bad(format!("pod {value:?} must be NAMESPACE/NAME here"))),
                };
                weft_proto::validate::namespace(&ns).map_err(bad)?;
                weft_proto::validate::pod_name(&name).map_err(bad)?;
                if namespace.is_some_and(|n| n != ns) {
                    return Err(bad(format!("pod {ns}/{name} is not in namespace {}", namespace.unwrap_or(""))));
                }
                q.pod = Some(format!("{ns}/{name}"));
            }
            "limit" => {
                q.limit = value.parse().map_err(|_| bad(format!("limit {value:?} is not a count")))?;
                if q.limit > MAX_LIMIT {
                    return Err(bad(format!("limit {} is over {MAX_LIMIT}", q.limit)));
                }
            }
            "watch" => q.watch = matches!(value.as_str(), "" | "true" | "1"),
            // kubectl's and client libraries' own parameters.
            "timeout" | "timeoutSeconds" | "resourceVersion" | "allowWatchBookmarks" => {}
            k => return Err(bad(format!("unknown parameter {k:?} (verdict, pod, limit, watch)"))),
        }
    }
    Ok(q)
}

/// What the operator asks each agent for.
pub fn filter(namespace: Option<&str>, q: &Query) -> Filter {
    Filter {
        namespaces: namespace.map(str::to_owned).into_iter().collect(),
        pod: q.pod.clone().unwrap_or_default(),
        verdict: q.verdict.unwrap_or(Verdict::Unspecified) as i32,
    }
}

/// What a reader of `namespace` may see of a record with a pod of
/// `namespace` at one end: the other end's pod, and a policy of another
/// namespace, are not theirs to read (addresses are: their pod saw them).
pub fn redact(namespace: &str, mut f: Flow) -> Flow {
    for end in [f.source.as_mut(), f.destination.as_mut()].into_iter().flatten() {
        if end.namespace != namespace {
            end.namespace.clear();
            end.pod.clear();
        }
    }
    let policy_ns = f.policy.strip_prefix("weft.dev/").unwrap_or(&f.policy).split_once('/').map(|(ns, _)| ns);
    let cluster_scoped = f.policy.starts_with("ClusterNetworkPolicy/") || f.policy.starts_with("AdminNetworkPolicy/");
    if !cluster_scoped && policy_ns.is_some_and(|ns| ns != namespace) {
        f.policy = "(a policy of another namespace)".to_owned();
        f.rule = -1;
    }
    f
}

/// Each node's answer, for the list's `nodes`: its counters, or why it did not answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAnswer {
    pub node: String,
    pub outcome: Result<NodeCounts, String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeCounts {
    pub lost: u64,
    pub evicted: u64,
    pub capacity: u32,
}

/// The merged list: oldest first, at most `limit` (0: all) of the newest.
pub fn flow_list(mut flows: Vec<Flow>, nodes: &[NodeAnswer], limit: u32) -> Value {
    flows.sort_by(|a, b| (a.time_unix_ms, &a.node, a.seq).cmp(&(b.time_unix_ms, &b.node, b.seq)));
    if limit > 0 && flows.len() > limit as usize {
        flows.drain(..flows.len() - limit as usize);
    }
    let nodes: Vec<Value> = nodes
        .iter()
        .map(|n| match &n.outcome {
            Ok(c) => json!({"node": n.node, "lost": c.lost, "evicted": c.evicted, "capacity": c.capacity}),
            Err(e) => json!({"node": n.node, "error": e}),
        })
        .collect();
    json!({
        "kind": "FlowList",
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "metadata": {},
        "items": flows.iter().map(weft_proto::flows_json::to_json).collect::<Vec<_>>(),
        "nodes": nodes,
    })
}

pub fn group_list() -> Value {
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group()]})
}

pub fn group() -> Value {
    let gv = json!({"groupVersion": format!("{GROUP}/{VERSION}"), "version": VERSION});
    json!({"kind": "APIGroup", "apiVersion": "v1", "name": GROUP, "versions": [gv], "preferredVersion": gv})
}

pub fn resources() -> Value {
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": format!("{GROUP}/{VERSION}"),
        "resources": [{
            "name": RESOURCE,
            "singularName": "flow",
            "namespaced": true,
            "kind": "Flow",
            "verbs": ["list", "watch"],
        }],
    })
}

/// A `Status` as the apiserver writes errors.
pub fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

#[cfg(test)]
mod tests {
    use weft_proto::flows::v1::Endpoint;

    use super::*;

    #[test]
    fn paths_map_to_routes_and_bad_namespaces_are_refused() {
        assert_eq!(route("/apis/flows.weft.dev/v1alpha1"), Ok(Route::Resources));
        assert_eq!(route("/apis/flows.weft.dev/v1alpha1/flows"), Ok(Route::Flows { namespace: None }));
        assert_eq!(
            route("/apis/flows.weft.dev/v1alpha1/namespaces/team-a/flows"),
            Ok(Route::Flows { namespace: Some("team-a".into()) })
        );
        assert!(matches!(route("/apis/flows.weft.dev/v1alpha1/namespaces/A..b/flows"), Err(RouteError::BadRequest(_))));
        assert!(matches!(route("/apis/flows.weft.dev/v1alpha1/namespaces/a/flows/x"), Err(RouteError::NotFound(_))));
        assert!(matches!(route("/api/v1/pods"), Err(RouteError::NotFound(_))));
    }

    #[test]
    fn the_query_is_checked_and_a_pod_stays_in_the_namespace_asked_for() {
        let q = query(Some("verdict=dropped&pod=web&limit=5"), Some("a")).unwrap();
        assert_eq!(q, Query { verdict: Some(Verdict::Dropped), pod: Some("a/web".into()), limit: 5, watch: false });
        assert_eq!(filter(Some("a"), &q).namespaces, ["a"]);
        assert!(query(Some("pod=b%2Fweb"), Some("a")).unwrap_err().to_string().contains("not in namespace a"));
        assert_eq!(query(Some("pod=b%2Fweb"), None).unwrap().pod.as_deref(), Some("b/web"));
        assert!(query(Some("pod=web"), None).is_err());
        assert!(query(Some("verdict=maybe"), None).is_err());
        assert!(query(Some("limit=99999999"), None).is_err());
        assert!(query(Some("fieldSelector=x"), None).is_err());
        assert!(query(Some("pod=Web%20x"), Some("a")).is_err());
        assert!(query(Some("watch=true"), None).unwrap().watch);
    }

    fn end(ns: &str, pod: &str) -> Option<Endpoint> {
        Some(Endpoint { address: "10.0.0.1".into(), port: 80, namespace: ns.into(), pod: pod.into() })
    }

    #[test]
    fn a_namespace_reader_sees_nothing_of_other_namespaces_but_addresses() {
        let f = Flow {
            source: end("b", "spy"),
            destination: end("a", "web"),
            policy: "b/egress-lockdown".into(),
            rule: 2,
            ..Flow::default()
        };
        let r = redact("a", f.clone());
        assert_eq!(r.source, Some(Endpoint { address: "10.0.0.1".into(), port: 80, ..Endpoint::default() }));
        assert_eq!(r.destination, f.destination);
        assert_eq!((r.policy.as_str(), r.rule), ("(a policy of another namespace)", -1));
        let own = Flow { policy: "weft.dev/a/web".into(), rule: 1, ..f.clone() };
        assert_eq!(redact("a", own.clone()).policy, own.policy);
        let other_weft = Flow { policy: "weft.dev/b/x".into(), ..f.clone() };
        assert_eq!(redact("a", other_weft).rule, -1);
        let cluster = Flow { policy: "ClusterNetworkPolicy/baseline".into(), ..f };
        assert_eq!(redact("a", cluster).policy, "ClusterNetworkPolicy/baseline");
    }

    #[test]
    fn the_merged_list_is_oldest_first_and_keeps_the_newest() {
        let at = |t, node: &str| Flow { time_unix_ms: t, node: node.into(), ..Flow::default() };
        let nodes = [
            NodeAnswer { node: "n1".into(), outcome: Ok(NodeCounts { lost: 2, evicted: 0, capacity: 10 }) },
            NodeAnswer { node: "n2".into(), outcome: Err("unreachable".into()) },
        ];
        let v = flow_list(vec![at(3, "n1"), at(1, "n2"), at(2, "n1")], &nodes, 2);
        let times: Vec<u64> =
            v["items"].as_array().unwrap().iter().map(|i| i["timeUnixMs"].as_u64().unwrap()).collect();
        assert_eq!(times, [2, 3]);
        assert_eq!(v["nodes"][0]["lost"], 2);
        assert_eq!(v["nodes"][1]["error"], "unreachable");
    }
}
