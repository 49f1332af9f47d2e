//! Test workloads on the real-node cluster: agnhost pods pinned to a node
//! through the scheduler, and the probes run from inside them.

use std::collections::BTreeMap;
use std::time::Duration;

use super::testing::{apply, eventually, kubectl, kubectl_ok, pod_exec};

/// The test image the upstream e2e tests of Kubernetes v1.35 expect.
pub const AGNHOST_IMAGE: &str = "registry.k8s.io/e2e-test-images/agnhost:2.59";
/// agnhost netexec's HTTP and UDP ports in every test pod.
pub const HTTP_PORT: u16 = 8080;
pub const UDP_PORT: u16 = 8081;

/// An agnhost netexec pod, scheduled by the scheduler onto `node`.
pub struct TestPod<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub node: &'a str,
    pub labels: &'a [(&'a str, &'a str)],
    pub annotations: &'a [(&'a str, &'a str)],
    /// A spec `hostPort` for the HTTP port.
    pub host_port: Option<u16>,
}

impl TestPod<'_> {
    pub fn yaml(&self) -> String {
        let map = |kv: &[(&str, &str)]| -> String {
            let m: BTreeMap<&str, &str> = kv.iter().copied().collect();
            serde_json::to_string(&m).expect("labels serialize")
        };
        let host_port = self.host_port.map(|p| format!(", hostPort: {p}")).unwrap_or_default();
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

/// What `GET http://target/hostname` from inside a pod answers (the
/// answering pod's name), or `None` when nothing answered within 3 s.
pub fn http_hostname(namespace: &str, from: &str, target: &str) -> Option<String> {
    let url = format!("http://{target}/hostname");
    let (ok, out) = pod_exec(namespace, from, &["wget", "-q", "-T", "3", "-O", "-", &url]);
    ok.then(|| out.trim().to_owned()).filter(|s| !s.is_empty())
}

/// What agnhost's UDP server at `ip` answers to `hostname` from inside a pod.
pub fn udp_hostname(namespace: &str, from: &str, ip: &str) -> Option<String> {
    let script = format!("echo hostname | nc -u -w 2 {ip} {UDP_PORT}");
    let (ok, out) = pod_exec(namespace, from, &["sh", "-c", &script]);
    ok.then(|| out.trim().to_owned()).filter(|s| !s.is_empty())
}

/// Deletes pods at once (grace period 0) and waits until they are gone.
pub fn delete_pods(namespace: &str, names: &[&str]) {
    let mut args = vec!["delete", "pod", "-n", namespace, "--grace-period=0", "--force", "--wait=true"];
    args.extend_from_slice(names);
    kubectl_ok(&args);
}
