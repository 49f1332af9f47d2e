//! Test workloads on the real-node cluster: agnhost pods pinned to a node
//! through the scheduler, and the probes run from inside them.

use std::collections::BTreeMap;
use std::time::Duration;

use super::testing::{apply, eventually, kubectl, kubectl_ok, node_exec};

/// The test image the upstream e2e tests of Kubernetes v1.35 expect.
pub const AGNHOST_IMAGE: &str = "registry.k8s.io/e2e-test-images/agnhost:2.59";
/// agnhost netexec's HTTP and UDP ports in every test pod.
pub const HTTP_PORT: u16 = 8080;
pub const UDP_PORT: u16 = 8081;

/// An agnhost netexec pod, scheduled by the scheduler onto `node`.
#[derive(Default)]
pub struct TestPod<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub node: &'a str,
    pub labels: &'a [(&'a str, &'a str)],
    pub annotations: &'a [(&'a str, &'a str)],
    /// A spec `hostPort` for the HTTP port.
    pub host_port: Option<u16>,
    /// Capabilities added to the container's (`NET_ADMIN`: a pod owner may ask for it).
    pub capabilities: &'a [&'a str],
}

impl TestPod<'_> {
    pub fn yaml(&self) -> String {
        let map = |kv: &[(&str, &str)]| -> String {
            let m: BTreeMap<&str, &str> = kv.iter().copied().collect();
            serde_json::to_string(&m).expect("labels serialize")
        };
        let host_port = self.host_port.map(|p| format!(", hostPort: {p}")).unwrap_or_default();
        let capabilities = serde_json::to_string(self.capabilities).expect("capabilities serialize");
        format!(
            r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {ns}
  labels: {labels}
  annotations: {annotations}
spec:
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  terminationGracePeriodSeconds: 1
  containers:
  - name: agnhost
    image: {AGNHOST_IMAGE}
    imagePullPolicy: Never
    args: ["netexec", "--http-port={HTTP_PORT}", "--udp-port={UDP_PORT}"]
    ports:
    - {{name: http, containerPort: {HTTP_PORT}, protocol: TCP{host_port}}}
    - {{name: udp, containerPort: {UDP_PORT}, protocol: UDP}}
    securityContext: {{capabilities: {{add: {capabilities}}}}}
"#,
            name = self.name,
            ns = self.namespace,
            node = self.node,
            labels = map(self.labels),
            annotations = map(self.annotations),
        )
    }

    /// Creates the pod and waits until it runs; returns its IP.
    #[track_caller]
    pub fn run(&self) -> String {
        apply(&self.yaml());
        wait_running(self.namespace, self.name)
    }
}

/// Creates a namespace (idempotent).
pub fn namespace(name: &str, labels: &[(&str, &str)]) {
    let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
    apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n  labels: {}\n",
        serde_json::to_string(&labels).expect("labels serialize")
    ));
}

/// Waits until a pod is Running and Ready; returns its IP.
#[track_caller]
pub fn wait_running(namespace: &str, name: &str) -> String {
    eventually(&format!("pod {namespace}/{name} Running and Ready"), Duration::from_secs(120), || {
        let (ok, out) = kubectl(&[
            "get",
            "pod",
            "-n",
            namespace,
            name,
            "-o",
            "jsonpath={.status.phase} {.status.conditions[?(@.type=='Ready')].status} {.status.podIP}",
        ]);
        let fields: Vec<&str> = out.split_whitespace().collect();
        (ok && fields.len() == 3 && fields[0] == "Running" && fields[1] == "True").then(|| fields[2].to_owned())
    })
}

/// The pod's IP and node.
pub fn placement(namespace: &str, pod: &str) -> Option<(String, String)> {
    let (ok, out) = kubectl(&["get", "pod", "-n", namespace, pod, "-o", "jsonpath={.status.podIP} {.spec.nodeName}"]);
    let mut fields = out.split_whitespace();
    match (ok, fields.next(), fields.next()) {
        (true, Some(ip), Some(node)) => Some((ip.to_owned(), node.to_owned())),
        _ => None,
    }
}

/// Asks the agnhost of pod `from` to send `hostname` to `target` (IP:PORT)
/// over `protocol` (`http` or `udp`), as the upstream e2e tests do through
/// netexec's `/dial`; returns who answered, or `None` when nobody did. The
/// request reaches `from` from its own node, which policy never blocks.
pub fn dial(namespace: &str, from: &str, protocol: &str, target: &str) -> Option<String> {
    let (ip, node) = placement(namespace, from)?;
    let (host, port) = target.rsplit_once(':')?;
    // netexec joins host and port itself: an IPv6 address goes bare.
    let host = host.trim_start_matches('[').trim_end_matches(']');
    // The pod's own address is IPv6 in an IPv6-only cluster: bracketed in a URL.
    let ip = if ip.contains(':') { format!("[{ip}]") } else { ip };
    let url =
        format!("http://{ip}:{HTTP_PORT}/dial?request=hostname&protocol={protocol}&host={host}&port={port}&tries=1");
    let (ok, out) = node_exec(&node, &["curl", "-s", "--max-time", "6", &url]);
    if !ok {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(out.trim()).ok()?;
    v["responses"].as_array()?.first()?.as_str().map(str::to_owned)
}

/// Who answers `GET /hostname` at `target` (IP:PORT) from pod `from`.
pub fn http_hostname(namespace: &str, from: &str, target: &str) -> Option<String> {
    dial(namespace, from, "http", target)
}

/// Who answers `hostname` at agnhost's UDP port of `ip` from pod `from`.
pub fn udp_hostname(namespace: &str, from: &str, ip: &str) -> Option<String> {
    dial(namespace, from, "udp", &format!("{ip}:{UDP_PORT}"))
}

/// A pod's addresses (`status.podIPs`), IPv4 first.
pub fn pod_ips(namespace: &str, name: &str) -> Vec<String> {
    let out = kubectl_ok(&["get", "pod", "-n", namespace, name, "-o", "jsonpath={.status.podIPs[*].ip}"]);
    out.split_whitespace().map(str::to_owned).collect()
}

/// Deletes pods at once (grace period 0) and waits until they are gone.
pub fn delete_pods(namespace: &str, names: &[&str]) {
    let mut args = vec!["delete", "pod", "-n", namespace, "--grace-period=0", "--force", "--wait=true"];
    args.extend_from_slice(names);
    kubectl_ok(&args);
}

/// Pod `from` reaches pod `want` at address `ip` (either family) over TCP
/// and over UDP, within a minute and half a minute.
#[track_caller]
pub fn assert_tcp_and_udp(ns: &str, from: &str, ip: &str, want: &str) {
    let target = if ip.contains(':') { format!("[{ip}]:{HTTP_PORT}") } else { format!("{ip}:{HTTP_PORT}") };
    let answer = eventually(&format!("{from} → {want} over TCP at {ip}"), Duration::from_secs(60), || {
        http_hostname(ns, from, &target)
    });
    assert_eq!(answer, want, "TCP {from} → {ip}");
    let answer = eventually(&format!("{from} → {want} over UDP at {ip}"), Duration::from_secs(30), || {
        udp_hostname(ns, from, ip)
    });
    assert_eq!(answer, want, "UDP {from} → {ip}");
}

/// Three pods (two on node-1, one on node-2) reach each other over TCP and
/// UDP, and a ClusterIP Service through kube-proxy answers from both nodes.
pub fn pods_and_a_service_connect(ns: &str) -> String {
    let pod = |name: &'static str, node: &'static str| TestPod {
        namespace: ns,
        name,
        node,
        labels: &[("app", "echo")],
        annotations: &[],
        host_port: None,
        capabilities: &[],
    };
    let a = pod("a", "node-1").run();
    let b = pod("b", "node-1").run();
    let c = pod("c", "node-2").run();
    for (from, target, name) in [("a", &b, "b"), ("a", &c, "c"), ("c", &a, "a"), ("c", &b, "b")] {
        assert_tcp_and_udp(ns, from, target, name);
    }
    apply(&format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: echo, namespace: {ns}}}\n\
         spec:\n  selector: {{app: echo}}\n  ports: [{{port: 80, targetPort: {HTTP_PORT}}}]\n"
    ));
    let ip = kubectl_ok(&["get", "svc", "-n", ns, "echo", "-o", "jsonpath={.spec.clusterIP}"]);
    let mut seen = std::collections::BTreeSet::new();
    eventually("the Service to answer from pods on both nodes", Duration::from_secs(60), || {
        if let Some(name) = http_hostname(ns, "a", &format!("{ip}:80")) {
            seen.insert(name);
        }
        (seen.contains("c") && (seen.contains("a") || seen.contains("b"))).then_some(())
    });
    ip
}
