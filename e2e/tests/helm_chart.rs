//! The Helm chart (`charts/weft`): lint, render, schema validation, and a real
//! install / upgrade / uninstall against the shared test control plane.
//!
//! The control plane has no scheduler, kubelet or controller-manager: pods
//! never run, so these tests assert that every object is accepted by the
//! apiserver and changes as the values do, not that Weft starts.
//!
//! CRD policy: the chart ships the CRDs in `charts/weft/crds/` (byte-identical
//! copies of `crds/`, see [`chart_crds_are_the_generated_crds`]). Helm 3
//! installs them on the first `helm install`, never upgrades them and never
//! deletes them on `helm uninstall`; removing them is an explicit
//! `kubectl delete crd ...` because it deletes every Subnet with them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use serde::Deserialize;
use serde_yaml::Value;
use weft_api::subnet::LEASE_FINALIZER;
use weft_e2e::control_plane::{self, ControlPlane};
use weft_e2e::supervisor::StateFile;
use weft_e2e::{prereq, wait};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn chart_dir() -> PathBuf {
    repo_root().join("charts/weft")
}

/// The helm binary from e2e/scripts/build-tools.sh, or `None` (after a notice;
/// a failure under CI=true) when it is missing.
fn helm_bin() -> Option<PathBuf> {
    let helm = control_plane::tools_dir().join("helm");
    let what = format!("helm in {} (build it with e2e/scripts/build-tools.sh)", control_plane::tools_dir().display());
    prereq::require(&what, helm.is_file()).then_some(helm)
}

/// Runs helm with its caches and config in a private temp dir.
struct Helm {
    bin: PathBuf,
    home: tempfile::TempDir,
    kubeconfig: Option<PathBuf>,
}

impl Helm {
    fn new() -> Option<Helm> {
        let bin = helm_bin()?;
        Some(Helm { bin, home: tempfile::tempdir().expect("helm home"), kubeconfig: None })
    }

    fn with_cluster(cp: &ControlPlane) -> Option<Helm> {
        let mut h = Helm::new()?;
        h.kubeconfig = Some(cp.kubeconfig.clone());
        Some(h)
    }

    fn run(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(&self.bin);
        cmd.args(args)
            .env("HELM_CACHE_HOME", self.home.path().join("cache"))
            .env("HELM_CONFIG_HOME", self.home.path().join("config"))
            .env("HELM_DATA_HOME", self.home.path().join("data"));
        if let Some(kc) = &self.kubeconfig {
            cmd.arg("--kubeconfig").arg(kc);
        }
        cmd.output().unwrap_or_else(|e| panic!("cannot run {}: {e}", self.bin.display()))
    }

    #[track_caller]
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "helm {args:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs a command that must fail; returns its stderr.
    #[track_caller]
    fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(!out.status.success(), "helm {args:?} succeeded but should have failed");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }
}

fn kubectl(cp: &ControlPlane, args: &[&str], stdin: Option<&str>) -> Output {
    use std::io::Write;
    let mut child = Command::new(control_plane::tools_dir().join("kubectl"))
        .arg("--kubeconfig")
        .arg(&cp.kubeconfig)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl (build it with e2e/scripts/build-tools.sh)");
    let mut pipe = child.stdin.take().expect("stdin");
    if let Some(text) = stdin {
        pipe.write_all(text.as_bytes()).expect("writing kubectl stdin");
    }
    drop(pipe);
    child.wait_with_output().expect("kubectl output")
}

#[track_caller]
fn kubectl_ok(cp: &ControlPlane, args: &[&str]) -> String {
    let out = kubectl(cp, args, None);
    assert!(out.status.success(), "kubectl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every document of a rendered manifest.
fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|d| Value::deserialize(d).expect("rendered YAML parses"))
        .filter(|v| !v.is_null())
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str, name_suffix: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"].as_str().is_some_and(|n| n.ends_with(name_suffix)))
        .unwrap_or_else(|| panic!("no {kind} named *{name_suffix} in the rendered chart"))
}

fn env<'a>(container: &'a Value, name: &str) -> &'a Value {
    container["env"]
        .as_sequence()
        .and_then(|e| e.iter().find(|v| v["name"] == name))
        .unwrap_or_else(|| panic!("no env {name} in container {}", container["name"].as_str().unwrap_or("?")))
}

fn kinds(docs: &[Value]) -> Vec<String> {
    let mut k: Vec<String> = docs.iter().map(|d| d["kind"].as_str().unwrap_or("?").to_owned()).collect();
    k.sort();
    k
}

/// Non-default values that touch every template branch.
const CUSTOM_VALUES: &str = r#"
network:
  clusterCIDR: 10.100.0.0/14
  nodePrefixLength: 26
  backend: host-gw
  vni: 42
  mtu: 1400
  directRouting: true
  hostPortRange: {min: 20000, max: 20999}
images:
  pullPolicy: Always
  pullSecrets: [{name: regcred}]
  operator: {repository: registry.example.com/weft/operator, tag: "1.2.3"}
  agent: {repository: registry.example.com/weft/agent, tag: "1.2.3"}
logLevel: debug
operator:
  replicas: 3
  leaderElection: {enabled: true, leaseDurationSeconds: 20, renewDeadlineSeconds: 15, retryPeriodSeconds: 3}
  nodeSelectorLabels: "weft.dev/managed=true"
  hostNetwork: false
  metricsPort: 19090
agent:
  metricsPort: 19646
  runDir: /run/weft-alt
  stateDir: /var/lib/weft-alt
  podAttachment: routed
  policyDenyAction: drop
  policyDropLog: {enabled: true, group: 77, ratePerSecond: 5}
cni:
  binDir: /usr/libexec/cni
  confDir: /etc/cni/alt.d
  confFileName: 05-weft.conflist
metrics:
  serviceMonitor: {enabled: true, interval: 15s, labels: {release: prom}}
  prometheusRule: {enabled: true, labels: {release: prom}}
  dashboard: {enabled: false}
"#;

fn custom_values_file() -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(".yaml").tempfile().expect("values file");
    std::io::Write::write_all(&mut f, CUSTOM_VALUES.as_bytes()).expect("writing values");
    f
}

#[test]
fn chart_crds_are_the_generated_crds() {
    // The chart carries copies of the generated CRDs (Helm packages a chart
    // directory on its own, so symlinks out of it would break `helm package`).
    // Regenerate both with:
    //   cargo run -p weft-api --bin crdgen -- crds/ && cp crds/*.yaml charts/weft/crds/
    let list = |dir: PathBuf| {
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("dir entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".yaml"))
            .collect();
        names.sort();
        names
    };
    let generated = list(repo_root().join("crds"));
    assert!(!generated.is_empty());
    assert_eq!(generated, list(chart_dir().join("crds")), "charts/weft/crds/ must hold exactly the files of crds/");
    for name in &generated {
        let a = std::fs::read(repo_root().join("crds").join(name)).expect("crd");
        let b = std::fs::read(chart_dir().join("crds").join(name)).expect("chart crd");
        assert!(a == b, "charts/weft/crds/{name} differs from crds/{name}: run `cp crds/*.yaml charts/weft/crds/`");
    }
}

#[test]
fn lint_passes_with_default_and_custom_values() {
    let Some(helm) = Helm::new() else { return };
    let chart = chart_dir();
    let chart = chart.to_str().expect("utf-8 path");
    helm.ok(&["lint", "--strict", chart]);
    let values = custom_values_file();
    helm.ok(&["lint", "--strict", chart, "-f", values.path().to_str().expect("path")]);
    // The whole default set, disabled extras included.
    helm.ok(&["lint", "--strict", chart, "--set", "metrics.service.enabled=false,metrics.dashboard.enabled=false"]);
}

#[test]
fn template_renders_defaults() {
    let Some(helm) = Helm::new() else { return };
    let out = helm.ok(&["template", "rel", chart_dir().to_str().expect("path"), "-n", "weft-system"]);
    let docs = documents(&out);
    assert_eq!(
        kinds(&docs),
        [
            "APIService",
            "ClusterRole",
            "ClusterRole",
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "ConfigMap",
            "ConfigMap",
            "DaemonSet",
            "Deployment",
            "Job",
            "Role",
            "RoleBinding",
            "RoleBinding",
            "Secret",
            "Service",
            "Service",
            "Service",
            "ServiceAccount",
            "ServiceAccount",
            "ServiceAccount",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicyBinding"
        ],
        "rendered: {out}"
    );
    // The admission policy applies to this release's agent and nobody else.
    let vap = find(&docs, "ValidatingAdmissionPolicy", "-agent-own-node");
    let who = vap["spec"]["matchConditions"][0]["expression"].as_str().expect("expression");
    assert!(who.contains("system:serviceaccount:weft-system:rel-weft-agent"), "{who}");
    let vap = find(&docs, "ValidatingAdmissionPolicy", "-operator-pod-annotations");
    let who = vap["spec"]["matchConditions"][0]["expression"].as_str().expect("expression");
    assert!(who.contains("system:serviceaccount:weft-system:rel-weft-operator"), "{who}");

    // helm uninstall's clean-up: a post-delete hook with RBAC of its own.
    let hook = find(&docs, "Job", "-uninstall");
    assert_eq!(hook["metadata"]["annotations"]["helm.sh/hook"], "post-delete");
    assert_eq!(hook["spec"]["template"]["spec"]["containers"][0]["args"][0], "--uninstall");

    let op = find(&docs, "Deployment", "-operator");
    assert_eq!(op["spec"]["replicas"], 2);
    // Nodes get pod networking only after the operator gave them a Subnet.
    assert_eq!(op["spec"]["template"]["spec"]["hostNetwork"], true);
    let tolerations = serde_yaml::to_string(&op["spec"]["template"]["spec"]["tolerations"]).expect("tolerations");
    assert!(tolerations.contains("node.kubernetes.io/not-ready"), "{tolerations}");
    let c = &op["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(env(c, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name");
    assert_eq!(env(c, "WEFT_LEADER_ELECT")["value"], "true");
    assert_eq!(env(c, "WEFT_LEADER_ELECTION_NAMESPACE")["value"], "weft-system");
    assert_eq!(env(c, "WEFT_CLUSTER_CIDR")["value"], "10.244.0.0/16");
    assert_eq!(env(c, "WEFT_BACKEND")["value"], "vxlan");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(op["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"], true);
    assert!(c["resources"]["requests"]["memory"].is_string());

    let ds = find(&docs, "DaemonSet", "-agent");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["tolerations"][0]["operator"], "Exists", "the agent tolerates every taint");
    let a = &pod["containers"][0];
    assert_eq!(env(a, "WEFT_NODE_NAME")["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName");
    assert_eq!(env(a, "WEFT_NODE_IP")["valueFrom"]["fieldRef"]["fieldPath"], "status.hostIP");
    assert_eq!(env(a, "WEFT_NODE_IPS")["valueFrom"]["fieldRef"]["fieldPath"], "status.hostIPs");
    assert_eq!(env(a, "WEFT_CLUSTER_CIDR")["value"], "10.244.0.0/16");
    assert_eq!(env(a, "WEFT_POD_ATTACHMENT")["value"], "bridge");
    assert_eq!(env(a, "WEFT_POLICY_DENY_ACTION")["value"], "reject");
    assert_eq!(env(a, "WEFT_FLOWS_CAPACITY")["value"], "4096", "flows are on by default");
    assert_eq!(env(a, "WEFT_POLICY_DROP_LOG_LINES")["value"], "false", "the drop log's lines are off by default");
    let mounts: Vec<&str> =
        pod["volumes"].as_sequence().expect("volumes").iter().filter_map(|v| v["hostPath"]["path"].as_str()).collect();
    for dir in ["/run/weft", "/var/lib/weft", "/opt/cni/bin", "/etc/cni/net.d"] {
        assert!(mounts.contains(&dir), "no hostPath {dir}: {mounts:?}");
    }
    let init = &pod["initContainers"][0];
    let script = init["command"][2].as_str().expect("install script");
    assert!(script.contains("mv -f /host/cni-conf/.00-weft.conflist.tmp /host/cni-conf/00-weft.conflist"), "{script}");
    assert!(script.contains("mv -f /host/cni-bin/.weft-cni.tmp /host/cni-bin/weft-cni"), "{script}");

    // The conflist is the one README.md documents.
    let cm = find(&docs, "ConfigMap", "-cni-config");
    let conf: serde_json::Value =
        serde_json::from_str(cm["data"]["00-weft.conflist"].as_str().expect("conflist")).expect("conflist is JSON");
    assert_eq!(conf["cniVersion"], "1.1.0");
    assert_eq!(conf["name"], "weft");
    assert_eq!(conf["plugins"][0]["type"], "weft-cni");
    assert_eq!(conf["plugins"][0]["agentSocket"], "/run/weft/agent.sock");
    assert!(conf["plugins"][0].get("mtu").is_none(), "no MTU by default: the agent derives it");

    // Least privilege: the agent writes only Subnet status, its node's
    // HostPortAllocations and Events (and creates TokenReviews, which store
    // nothing); it never creates or deletes anything else.
    let agent_role = find(&docs, "ClusterRole", "-agent");
    for rule in agent_role["rules"].as_sequence().expect("rules") {
        let text = serde_yaml::to_string(rule).expect("rule");
        let writes = ["create", "delete", "update"].iter().any(|v| text.contains(v));
        let resources: Vec<&str> =
            rule["resources"].as_sequence().expect("resources").iter().filter_map(|r| r.as_str()).collect();
        assert!(
            !writes || resources.iter().all(|r| ["hostportallocations", "events", "tokenreviews"].contains(r)),
            "agent rule too broad: {text}"
        );
    }
    let lease_role = find(&docs, "Role", "-operator-leader-election");
    assert_eq!(lease_role["metadata"]["namespace"], "weft-system");

    // The dashboard is valid JSON and shipped.
    let dash = find(&docs, "ConfigMap", "-dashboard");
    let dash: serde_json::Value =
        serde_json::from_str(dash["data"]["weft.json"].as_str().expect("dashboard")).expect("dashboard JSON");
    assert!(dash["panels"].as_array().is_some_and(|p| p.len() >= 8));
}

/// A server-side dry-run PATCH of `path` with `token`: (accepted, body and status code).
fn dry_run_patch(cp: &ControlPlane, token: &str, path: &str, content_type: &str, body: &str) -> (bool, String) {
    let url = format!("{}{path}?dryRun=All&fieldManager=weft-test", cp.server);
    let out = Command::new("curl")
        .args(["-sS", "--cacert", &cp.ca_cert.to_string_lossy(), "-X", "PATCH", "-w", "\n%{http_code}"])
        .args(["-H", &format!("Authorization: Bearer {}", token.trim())])
        .args(["-H", &format!("Content-Type: {content_type}"), "--data-binary", body, &url])
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    (text.trim_end().ends_with("200") || text.trim_end().ends_with("201"), text)
}

/// The operator's pod writes change its host port annotation and nothing
/// else (its RBAC says only "patch pods").
fn operator_changes_only_its_pod_annotation(cp: &ControlPlane, ns: &str, op_sa: &str) {
    let pod = control_plane::unique_name("annotated");
    let object = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {pod}, namespace: {ns}, labels: {{app: web}}}}\n\
         spec: {{serviceAccountName: {op_sa}, containers: [{{name: c, image: registry.k8s.io/pause:3.10.1}}]}}\n"
    );
    let created = kubectl(cp, &["apply", "-f", "-"], Some(&object));
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let token = kubectl_ok(cp, &["create", "token", op_sa, "-n", ns]);
    let path = format!("/api/v1/namespaces/{ns}/pods/{pod}");
    let patch = |body: &str| dry_run_patch(cp, &token, &path, "application/merge-patch+json", body);
    let (ok, text) = patch(r#"{"metadata":{"annotations":{"weft.dev/host-port-addresses":"{}"}}}"#);
    assert!(ok, "the operator cannot write its annotation: {text}");
    for other in [
        r#"{"metadata":{"labels":{"app":"db"}}}"#,
        r#"{"metadata":{"annotations":{"weft.dev/host-port-addresses":"{}","other":"x"}}}"#,
        r#"{"spec":{"activeDeadlineSeconds":5}}"#,
    ] {
        let (ok, text) = patch(other);
        assert!(
            !ok && text.contains("may only change pods' weft.dev/host-port-addresses"),
            "{other} was allowed: {text}"
        );
    }
    let _ = kubectl(cp, &["delete", "pod", &pod, "-n", ns, "--grace-period=0", "--force"], None);
}

/// With a token bound to an agent pod on node A (what kubelet hands the
/// agent there), the admission policy lets it write A's Subnet status and
/// HostPortAllocations, and nobody else's. Server-side dry runs: admission
/// runs, nothing is stored.
fn agent_writes_only_its_own_nodes_objects(cp: &ControlPlane, ns: &str, agent_sa: &str) {
    let (a, b) = (control_plane::unique_name("vap-a"), control_plane::unique_name("vap-b"));
    let pod = control_plane::unique_name("agent");
    let objects = format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {a}}}\n---\n\
         apiVersion: v1\nkind: Node\nmetadata: {{name: {b}}}\n---\n\
         apiVersion: weft.dev/v1alpha1\nkind: Subnet\nmetadata: {{name: {a}, finalizers: [{LEASE_FINALIZER}]}}\nspec: {{nodeName: {a}, cidr: 10.99.1.0/24}}\n---\n\
         apiVersion: weft.dev/v1alpha1\nkind: Subnet\nmetadata: {{name: {b}, finalizers: [{LEASE_FINALIZER}]}}\nspec: {{nodeName: {b}, cidr: 10.99.2.0/24}}\n---\n\
         apiVersion: v1\nkind: Pod\nmetadata: {{name: {pod}, namespace: {ns}}}\nspec:\n  serviceAccountName: {agent_sa}\n  \
         nodeName: {a}\n  containers: [{{name: agent, image: registry.k8s.io/pause:3.10.1}}]\n"
    );
    let applied = kubectl(cp, &["apply", "-f", "-"], Some(&objects));
    assert!(applied.status.success(), "{}", String::from_utf8_lossy(&applied.stderr));
    let token = kubectl_ok(
        cp,
        &["create", "token", agent_sa, "-n", ns, "--bound-object-kind", "Pod", "--bound-object-name", &pod],
    );
    // PATCH as the agent does it (kubectl would GET first, which the agent may not).
    let as_agent = |path: &str, content_type: &str, body: &str| dry_run_patch(cp, &token, path, content_type, body);
    let subnet_status = |node: &str| {
        let path = format!("/apis/weft.dev/v1alpha1/subnets/{node}/status");
        as_agent(&path, "application/merge-patch+json", r#"{"status":{"vtepMAC":"02:00:00:00:00:01"}}"#)
    };
    let (ok, text) = subnet_status(&a);
    assert!(ok, "the agent cannot write its own Subnet's status: {text}");
    let (ok, text) = subnet_status(&b);
    assert!(!ok && text.contains(&format!("may not write subnets of node {b}")), "{text}");
    let hpa = |node: &str| {
        let path = format!("/apis/weft.dev/v1alpha1/namespaces/{ns}/hostportallocations/vap-{node}");
        let body = format!(
            r#"{{"apiVersion":"weft.dev/v1alpha1","kind":"HostPortAllocation","metadata":{{"name":"vap-{node}","namespace":"{ns}"}},"spec":{{"nodeName":"{node}","nodeIP":"10.0.0.1","podRef":{{"name":"web"}},"ports":[{{"containerPort":80,"hostPort":8080}}]}}}}"#
        );
        as_agent(&path, "application/apply-patch+yaml", &body)
    };
    let (ok, text) = hpa(&a);
    assert!(ok, "the agent cannot apply its own node's HostPortAllocation: {text}");
    let (ok, text) = hpa(&b);
    assert!(!ok && text.contains("may not write hostportallocations"), "{text}");
    // Another node's existing allocation cannot be moved to its own node
    // (to be deleted next): the object as it was counts too.
    let theirs = format!(
        "apiVersion: weft.dev/v1alpha1\nkind: HostPortAllocation\nmetadata: {{name: vap-{a}, namespace: {ns}}}\n\
         spec: {{nodeName: {b}, nodeIP: 10.0.0.2, podRef: {{name: web}}, ports: [{{containerPort: 80, hostPort: 8080}}]}}\n"
    );
    let stored = kubectl(cp, &["apply", "-f", "-"], Some(&theirs));
    assert!(stored.status.success(), "{}", String::from_utf8_lossy(&stored.stderr));
    let path = format!("/apis/weft.dev/v1alpha1/namespaces/{ns}/hostportallocations/vap-{a}");
    let (ok, text) = as_agent(&path, "application/merge-patch+json", &format!(r#"{{"spec":{{"nodeName":"{a}"}}}}"#));
    assert!(!ok && text.contains(&format!("may not take over hostportallocations of node {b}")), "{text}");
    let _ = kubectl(cp, &["delete", "-f", "-"], Some(&theirs));
    // Its own Subnet: it may let go of the lease (remove the finalizer) and
    // do nothing else; another node's it may not touch at all.
    let subnet = |node: &str, body: &str| {
        as_agent(&format!("/apis/weft.dev/v1alpha1/subnets/{node}"), "application/merge-patch+json", body)
    };
    let let_go = r#"{"metadata":{"finalizers":null}}"#;
    let (ok, text) = subnet(&a, let_go);
    assert!(ok, "the agent cannot let go of its own lease: {text}");
    let (ok, text) = subnet(&b, let_go);
    assert!(!ok && text.contains(&format!("may not write subnets of node {b}")), "{text}");
    for change in
        [r#"{"spec":{"mtu":1400}}"#, r#"{"metadata":{"finalizers":["weft.dev/lease-in-use","x.example/hold"]}}"#]
    {
        let (ok, text) = subnet(&a, change);
        assert!(!ok && text.contains("may only remove the lease finalizer"), "{change} was allowed: {text}");
    }
    // Nor may it publish what other nodes take a pod to be.
    let path = format!("/apis/weft.dev/v1alpha1/namespaces/{ns}/podendpoints/forged");
    let body = format!(
        r#"{{"apiVersion":"weft.dev/v1alpha1","kind":"PodEndpoint","metadata":{{"name":"forged","namespace":"{ns}"}},"spec":{{"nodeName":"{a}","podIPs":["10.99.1.9"],"labels":{{"app":"db"}}}}}}"#
    );
    let (ok, text) = as_agent(&path, "application/apply-patch+yaml", &body);
    assert!(!ok && text.contains("forbidden"), "the agent wrote a PodEndpoint: {text}");
    // No kubelet runs here to finish the pod's deletion: force it.
    let _ = kubectl(cp, &["delete", "pod", &pod, "-n", ns, "--grace-period=0", "--force"], None);
    for node in [&a, &b] {
        let _ = kubectl(cp, &["patch", "subnet", node, "--type=merge", "-p", let_go], None);
    }
    let _ = kubectl(cp, &["delete", "-f", "-", "--ignore-not-found"], Some(&objects));
}

/// The chart's alert rules are valid and fire as their unit tests say.
#[test]
fn alert_rules_pass_promtool() {
    let present = Command::new("promtool").arg("--version").output().is_ok_and(|o| o.status.success());
    if !prereq::require("promtool (Debian prometheus, e2e/scripts/setup-machine.sh)", present) {
        return;
    }
    let rules = chart_dir().join("rules");
    for args in [&["check", "rules", "alerts.yaml"][..], &["test", "rules", "alerts_test.yaml"]] {
        let out = Command::new("promtool").args(args).current_dir(&rules).output().expect("promtool");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "promtool {args:?}:\n{text}");
    }
}

#[test]
fn template_renders_custom_values() {
    let Some(helm) = Helm::new() else { return };
    let values = custom_values_file();
    let out = helm.ok(&[
        "template",
        "weft",
        chart_dir().to_str().expect("path"),
        "-n",
        "net",
        "-f",
        values.path().to_str().expect("path"),
    ]);
    let docs = documents(&out);
    let k = kinds(&docs);
    assert_eq!(k.iter().filter(|k| *k == "ServiceMonitor").count(), 2, "{k:?}");
    // The alerts are the rule file promtool tests (alert_rules_pass_promtool).
    let rule = find(&docs, "PrometheusRule", "weft");
    assert_eq!(rule["metadata"]["labels"]["release"], "prom");
    let file: Value = serde_yaml::from_str(
        &std::fs::read_to_string(chart_dir().join("rules/alerts.yaml")).expect("rules/alerts.yaml"),
    )
    .expect("rule file YAML");
    assert_eq!(rule["spec"]["groups"], file["groups"]);
    assert_eq!(k.iter().filter(|k| *k == "ConfigMap").count(), 1, "dashboard disabled: {k:?}");

    let op = find(&docs, "Deployment", "-operator");
    assert_eq!(op["spec"]["replicas"], 3);
    assert!(op["spec"]["template"]["spec"]["hostNetwork"].is_null());
    assert!(!op["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"].is_null(), "replicas spread");
    let c = &op["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["image"], "registry.example.com/weft/operator:1.2.3");
    assert_eq!(c["imagePullPolicy"], "Always");
    assert_eq!(env(c, "WEFT_BACKEND")["value"], "host-gw");
    assert_eq!(env(c, "WEFT_NODE_PREFIX_LENGTH")["value"], "26");
    assert_eq!(env(c, "WEFT_VNI")["value"], "42");
    assert_eq!(env(c, "WEFT_MTU")["value"], "1400");
    assert_eq!(env(c, "WEFT_NODE_SELECTOR")["value"], "weft.dev/managed=true");
    assert_eq!(env(c, "WEFT_METRICS_ADDR")["value"], "0.0.0.0:19090");
    assert_eq!(env(c, "WEFT_LEASE_DURATION_SECONDS")["value"], "20");
    assert_eq!(env(c, "RUST_LOG")["value"], "debug");

    let ds = find(&docs, "DaemonSet", "-agent");
    let pod = &ds["spec"]["template"]["spec"];
    let a = &pod["containers"][0];
    assert_eq!(a["image"], "registry.example.com/weft/agent:1.2.3");
    assert_eq!(env(a, "WEFT_DIRECT_ROUTING")["value"], "true");
    assert_eq!(env(a, "WEFT_POD_ATTACHMENT")["value"], "routed");
    assert_eq!(env(a, "WEFT_AGENT_SOCKET")["value"], "/run/weft-alt/agent.sock");
    assert_eq!(env(a, "WEFT_METRICS_ADDR")["value"], "127.0.0.1:19646,$(WEFT_NODE_IP):19646");
    assert_eq!(env(a, "WEFT_LOG")["value"], "debug");
    assert_eq!(env(a, "WEFT_POLICY_DROP_LOG_GROUP")["value"], "77");
    assert_eq!(env(a, "WEFT_POLICY_DROP_LOG_RATE")["value"], "5");
    assert_eq!(env(a, "WEFT_POLICY_DROP_LOG_LINES")["value"], "true");
    assert_eq!(env(a, "WEFT_POLICY_DENY_ACTION")["value"], "drop");
    assert_eq!(pod["imagePullSecrets"][0]["name"], "regcred");
    let script = pod["initContainers"][0]["command"][2].as_str().expect("script");
    assert!(script.contains("/host/cni-conf/05-weft.conflist"), "{script}");
    let mounts = serde_yaml::to_string(&pod["volumes"]).expect("volumes");
    assert!(mounts.contains("/usr/libexec/cni") && mounts.contains("/etc/cni/alt.d"), "{mounts}");

    let cm = find(&docs, "ConfigMap", "-cni-config");
    let conf: serde_json::Value =
        serde_json::from_str(cm["data"]["05-weft.conflist"].as_str().expect("conflist")).expect("conflist JSON");
    assert_eq!(conf["plugins"][0]["mtu"], 1400);
    assert_eq!(conf["plugins"][0]["agentSocket"], "/run/weft-alt/agent.sock");

    let sm = find(&docs, "ServiceMonitor", "-agent");
    assert_eq!(sm["metadata"]["labels"]["release"], "prom");
    assert_eq!(sm["spec"]["endpoints"][0]["interval"], "15s");
}

#[test]
fn dual_stack_values_reach_the_operator_and_the_agents() {
    let Some(helm) = Helm::new() else { return };
    let chart = chart_dir();
    let chart = chart.to_str().expect("path");
    let containers = |sets: &[&str]| {
        let mut args = vec!["template", "weft", chart];
        for s in sets {
            args.extend(["--set", s]);
        }
        let docs = documents(&helm.ok(&args));
        let first = |kind, suffix| find(&docs, kind, suffix)["spec"]["template"]["spec"]["containers"][0].clone();
        (first("Deployment", "-operator"), first("DaemonSet", "-agent"))
    };
    let (op, agent) = containers(&["network.ipv6ClusterCIDR=fd00:10:244::/56"]);
    assert_eq!(env(&op, "WEFT_SECONDARY_CLUSTER_CIDR")["value"], "fd00:10:244::/56");
    assert_eq!(env(&op, "WEFT_SECONDARY_NODE_PREFIX_LENGTH")["value"], "64");
    assert_eq!(env(&agent, "WEFT_IPV6_CLUSTER_CIDR")["value"], "fd00:10:244::/56");
    assert_eq!(env(&agent, "WEFT_IPV6_MASQUERADE")["value"], "auto");
    let (_, agent) = containers(&["network.ipv6ClusterCIDR=2001:db8::/56", "network.ipv6Masquerade=off"]);
    assert_eq!(env(&agent, "WEFT_IPV6_MASQUERADE")["value"], "off");
    // host-gw and direct routing route IPv6 blocks to the nodes' IPv6 addresses.
    for routing in ["network.backend=host-gw", "network.directRouting=true", "agent.podAttachment=routed"] {
        let (_, agent) = containers(&["network.ipv6ClusterCIDR=fd00:10:244::/56", routing]);
        assert_eq!(env(&agent, "WEFT_NODE_IPS")["valueFrom"]["fieldRef"]["fieldPath"], "status.hostIPs", "{routing}");
    }
    let names = |c: &Value| -> Vec<String> {
        c["env"].as_sequence().expect("env").iter().filter_map(|e| e["name"].as_str().map(str::to_owned)).collect()
    };
    let (op, agent) = containers(&[]);
    assert!(!names(&op).contains(&"WEFT_SECONDARY_CLUSTER_CIDR".into()), "IPv4 only by default: {:?}", names(&op));
    assert!(!names(&agent).iter().any(|n| n.starts_with("WEFT_IPV6")), "{:?}", names(&agent));
    assert!(!names(&agent).contains(&"WEFT_VXLAN_UNDERLAY".into()), "VXLAN over IPv4 by default");
    // VXLAN over the IPv6 underlay, in a dual-stack or an IPv4 cluster.
    for sets in
        [&["network.vxlanUnderlay=ipv6"][..], &["network.vxlanUnderlay=ipv6", "network.ipv6ClusterCIDR=fd00::/56"]]
    {
        let (_, agent) = containers(sets);
        assert_eq!(env(&agent, "WEFT_VXLAN_UNDERLAY")["value"], "ipv6", "{sets:?}");
    }
    // IPv6-only: the IPv6 CIDR is the cluster CIDR, with its own prefix
    // length, and nothing is secondary.
    let (op, agent) = containers(&[
        "network.clusterCIDR=null",
        "network.ipv6ClusterCIDR=fd00:10:244::/56",
        "network.ipv6Masquerade=on",
    ]);
    assert_eq!(env(&op, "WEFT_CLUSTER_CIDR")["value"], "fd00:10:244::/56");
    assert_eq!(env(&op, "WEFT_NODE_PREFIX_LENGTH")["value"], "64");
    assert!(!names(&op).contains(&"WEFT_SECONDARY_CLUSTER_CIDR".into()), "{:?}", names(&op));
    assert_eq!(env(&agent, "WEFT_CLUSTER_CIDR")["value"], "fd00:10:244::/56");
    assert_eq!(env(&agent, "WEFT_IPV6_MASQUERADE")["value"], "on");
    assert!(!names(&agent).contains(&"WEFT_IPV6_CLUSTER_CIDR".into()), "{:?}", names(&agent));
    // Probes and scrapes reach the metrics servers over IPv6.
    assert_eq!(env(&op, "WEFT_METRICS_ADDR")["value"], "[::]:9647");
    assert_eq!(env(&agent, "WEFT_METRICS_ADDR")["value"], "127.0.0.1:9646,[$(WEFT_NODE_IP)]:9646");
}

#[test]
fn schema_and_checks_reject_bad_values_with_clear_messages() {
    let Some(helm) = Helm::new() else { return };
    let chart = chart_dir();
    let chart = chart.to_str().expect("path");
    for (set, expected) in [
        ("network.backend=gre", "at '/network/backend': value must be one of 'vxlan', 'host-gw'"),
        ("network.nodePrefixLength=40", "at '/network/nodePrefixLength': maximum: got 40, want 30"),
        ("network.clusterCIDR=10.0.0.0/33", "at '/network/clusterCIDR'"),
        ("network.clusterCIDR=fd00::/48", "at '/network/clusterCIDR'"),
        ("network.vni=0", "at '/network/vni'"),
        ("network.vxlanUnderlay=ipv5", "at '/network/vxlanUnderlay': value must be one of 'ipv4', 'ipv6'"),
        ("network.mtu=100", "at '/network/mtu'"),
        ("logLevel=loud", "at '/logLevel'"),
        ("agent.podAttachment=macvlan", "at '/agent/podAttachment': value must be one of 'bridge', 'routed'"),
        ("network.typo=1", "additional properties 'typo' not allowed"),
        ("agent.policyDenyAction=ignore", "at '/agent/policyDenyAction': value must be one of 'reject', 'drop'"),
        ("agent.policyDropLog.group=0", "at '/agent/policyDropLog/group'"),
        ("agent.policyDropLog.ratePerSecond=0", "at '/agent/policyDropLog/ratePerSecond'"),
        ("agent.flows.capacity=0", "at '/agent/flows/capacity'"),
        ("cni.confFileName=weft.conf", "at '/cni/confFileName'"),
        (
            "network.clusterCIDR=10.0.0.0/24",
            "network.nodePrefixLength (24) must be longer than the prefix of network.clusterCIDR (10.0.0.0/24)",
        ),
        (
            "operator.leaderElection.renewDeadlineSeconds=15",
            "operator.leaderElection.renewDeadlineSeconds (15) must be below leaseDurationSeconds (15)",
        ),
        ("operator.leaderElection.enabled=false", "operator.replicas > 1 needs operator.leaderElection.enabled"),
        ("network.hostPortRange.min=40000", "network.hostPortRange.min (40000) must not exceed"),
        ("network.ipv6ClusterCIDR=10.1.0.0/16", "at '/network/ipv6ClusterCIDR'"),
        ("network.ipv6Masquerade=yes", "at '/network/ipv6Masquerade': value must be one of 'auto', 'on', 'off'"),
        (
            "network.ipv6ClusterCIDR=fd00::/64",
            "network.ipv6NodePrefixLength (64) must be longer than the prefix of network.ipv6ClusterCIDR (fd00::/64)",
        ),
        (
            "network.ipv6ClusterCIDR=fd00::/56,network.ipv6NodePrefixLength=121",
            "network.ipv6NodePrefixLength (121) leaves fewer IPv6 addresses per node",
        ),
        ("network.clusterCIDR=null", "set network.clusterCIDR (IPv4), network.ipv6ClusterCIDR with clusterCIDR null"),
    ] {
        let err = helm.fails(&["template", "rel", chart, "--set", set]);
        assert!(err.contains(expected), "--set {set}: expected {expected:?} in:\n{err}");
        // `helm lint` reports schema violations but (by design) not `fail` calls.
        if expected.starts_with("at '/") || expected.starts_with("additional properties") {
            let out = helm.run(&["lint", chart, "--set", set]);
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(!out.status.success() && text.contains(expected), "lint --set {set}:\n{text}");
        }
    }
}

/// A release in its own namespace; uninstalled and the namespace deleted on drop.
struct Release<'a> {
    helm: &'a Helm,
    cp: &'a ControlPlane,
    name: String,
    ns: String,
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        let _ = self.helm.run(&["uninstall", &self.name, "-n", &self.ns, "--ignore-not-found"]);
        let _ = kubectl(self.cp, &["delete", "namespace", &self.ns, "--wait=false", "--ignore-not-found"], None);
    }
}

impl Release<'_> {
    fn manifest(&self) -> String {
        self.helm.ok(&["get", "manifest", &self.name, "-n", &self.ns])
    }

    /// Asserts that every object of the release's manifest exists in the apiserver.
    #[track_caller]
    fn assert_all_objects_exist(&self) -> Vec<String> {
        let manifest = self.manifest();
        let want = documents(&manifest).len();
        let out = kubectl(self.cp, &["get", "-f", "-", "-o", "name"], Some(&manifest));
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "objects missing: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
        let names: Vec<String> = stdout.lines().map(str::to_owned).collect();
        assert_eq!(names.len(), want, "{names:?}");
        names
    }

    /// Objects carrying this release's instance label, cluster-wide.
    fn labelled_objects(&self) -> Vec<String> {
        let selector = format!("app.kubernetes.io/instance={}", self.name);
        let mut found = Vec::new();
        for kinds in [
            "deployments,daemonsets,services,serviceaccounts,configmaps,secrets,roles,rolebindings",
            "clusterroles,clusterrolebindings,apiservices",
        ] {
            let out = kubectl_ok(self.cp, &["get", kinds, "-A", "-l", &selector, "-o", "name"]);
            found.extend(out.lines().map(str::to_owned));
        }
        found
    }
}

#[test]
fn install_upgrade_uninstall_on_a_real_apiserver() {
    let Some(cp) = ControlPlane::shared() else { return };
    let Some(helm) = Helm::with_cluster(cp) else { return };
    let chart = chart_dir();
    let chart = chart.to_str().expect("path");
    let name = control_plane::unique_name("weft");
    let release = Release { helm: &helm, cp, name: name.clone(), ns: control_plane::unique_name("weft-helm") };
    let ns = release.ns.as_str();

    // No kubelet runs the uninstall hook's Job here (cluster_vxlan.rs runs it).
    helm.ok(&[
        "install",
        &name,
        chart,
        "-n",
        ns,
        "--create-namespace",
        "--timeout",
        "2m",
        "--set",
        // With the agents' read-only permission on PodEndpoints, which
        // agent_writes_only_its_own_nodes_objects checks is no more.
        "uninstall.removeWeftObjects=false,podEndpoints.enabled=true",
    ]);
    let objects = release.assert_all_objects_exist();
    assert_eq!(objects.len(), 24, "{objects:?}");
    // The CRDs came from the chart's crds/ directory and are served.
    for crd in ["subnets.weft.dev", "hostportallocations.weft.dev", "networkpolicies.weft.dev", "podendpoints.weft.dev"]
    {
        kubectl_ok(cp, &["get", "crd", crd]);
    }
    wait::until("the Subnet CRD to be served", Duration::from_secs(30), || {
        kubectl(cp, &["get", "subnets"], None).status.success().then_some(())
    });
    let deploy = format!("{name}-operator");
    let jsonpath = |kind: &str, obj: &str, path: &str| {
        kubectl_ok(cp, &["get", kind, obj, "-n", ns, "-o", &format!("jsonpath={path}")])
    };
    assert_eq!(jsonpath("deployment", &deploy, "{.spec.replicas}"), "2");
    let backend = r#"{.spec.template.spec.containers[0].env[?(@.name=="WEFT_BACKEND")].value}"#;
    assert_eq!(jsonpath("deployment", &deploy, backend), "vxlan");

    // The operator's service account may do its job and no more.
    let can = |sa: &str, verb: &str, what: &str, extra: &[&str]| {
        let user = format!("system:serviceaccount:{ns}:{sa}");
        let mut args = vec!["auth", "can-i", verb, what, "--as", &user, "-n", ns];
        args.extend_from_slice(extra);
        kubectl(cp, &args, None).stdout.starts_with(b"yes")
    };
    let op_sa = format!("{name}-operator");
    let agent_sa = format!("{name}-agent");
    assert!(can(&op_sa, "create", "subnets.weft.dev", &[]));
    assert!(can(&op_sa, "patch", "subnets.weft.dev", &["--subresource=status"]));
    assert!(can(&op_sa, "watch", "nodes", &[]));
    assert!(can(&op_sa, "patch", "nodes", &["--subresource=status"]));
    assert!(!can(&op_sa, "patch", "nodes", &[]));
    assert!(!can(&op_sa, "update", "subnets.weft.dev", &[]));
    assert!(can(&op_sa, "create", "events.events.k8s.io", &["-n", "default"]));
    assert!(can(&op_sa, "update", &format!("leases.coordination.k8s.io/{op_sa}"), &[]));
    assert!(!can(&op_sa, "update", "leases.coordination.k8s.io/other", &[]));
    assert!(!can(&op_sa, "delete", "nodes", &[]));
    assert!(!can(&op_sa, "get", "secrets", &[]));
    assert!(can(&agent_sa, "watch", "subnets.weft.dev", &[]));
    assert!(can(&agent_sa, "patch", "subnets.weft.dev", &["--subresource=status"]));
    // patch: only to remove its own lease finalizer, which the admission
    // policy enforces (agent_writes_only_its_own_nodes_objects).
    assert!(can(&agent_sa, "patch", "subnets.weft.dev", &[]));
    assert!(!can(&agent_sa, "update", "subnets.weft.dev", &[]));
    assert!(!can(&agent_sa, "create", "subnets.weft.dev", &[]));
    assert!(!can(&agent_sa, "delete", "subnets.weft.dev", &[]));
    // The agent lists Nodes (the addresses its peers claim are checked
    // against them) and never writes one; it applies its
    // HostPortAllocations (server-side apply creates them, so it needs
    // create as well as patch).
    assert!(can(&agent_sa, "watch", "nodes", &[]));
    assert!(!can(&agent_sa, "patch", "nodes", &[]));
    assert!(!can(&agent_sa, "patch", "nodes", &["--subresource=status"]));
    assert!(!can(&agent_sa, "delete", "nodes", &[]));
    assert!(can(&agent_sa, "create", "hostportallocations.weft.dev", &["-n", "default"]));
    assert!(can(&agent_sa, "patch", "hostportallocations.weft.dev", &["-n", "default"]));
    assert!(can(&agent_sa, "create", "events", &["-n", "default"]));
    assert!(!can(&agent_sa, "patch", "pods", &["-n", "default"]));
    assert!(can(&op_sa, "delete", "hostportallocations.weft.dev", &["-n", "default"]));
    assert!(can(&op_sa, "patch", "hostportallocations.weft.dev", &["--subresource=status", "-n", "default"]));
    assert!(!can(&op_sa, "create", "hostportallocations.weft.dev", &["-n", "default"]));
    assert!(can(&op_sa, "patch", "pods", &["-n", "default"]));
    assert!(!can(&agent_sa, "list", "secrets", &[]));
    // Network policy: the operator keeps weft.dev policy status, the agent only reads.
    assert!(can(&op_sa, "watch", "networkpolicies.weft.dev", &["-A"]));
    assert!(can(&op_sa, "patch", "networkpolicies.weft.dev", &["--subresource=status"]));
    assert!(!can(&op_sa, "patch", "networkpolicies.weft.dev", &[]));
    assert!(can(&op_sa, "watch", "pods", &["-A"]));
    for what in ["pods", "namespaces", "networkpolicies.networking.k8s.io", "networkpolicies.weft.dev"] {
        assert!(can(&agent_sa, "watch", what, &["-A"]), "agent cannot watch {what}");
    }
    assert!(!can(&agent_sa, "patch", "networkpolicies.weft.dev", &["--subresource=status"]));
    assert!(!can(&agent_sa, "create", "networkpolicies.networking.k8s.io", &[]));
    // The flows API: the operator delegates authentication and
    // authorization and reads the front proxy's configuration; the agent
    // checks the operator's token.
    assert!(can(&op_sa, "create", "tokenreviews.authentication.k8s.io", &[]));
    assert!(can(&op_sa, "create", "subjectaccessreviews.authorization.k8s.io", &[]));
    assert!(can(&op_sa, "get", "configmaps/extension-apiserver-authentication", &["-n", "kube-system"]));
    assert!(!can(&op_sa, "get", "configmaps/other", &["-n", "kube-system"]));
    assert!(can(&op_sa, "list", "pods", &["-n", ns]));
    assert!(can(&agent_sa, "create", "tokenreviews.authentication.k8s.io", &[]));
    assert!(!can(&agent_sa, "create", "subjectaccessreviews.authorization.k8s.io", &[]));
    let ca_bundle =
        || kubectl_ok(cp, &["get", "apiservice", "v1alpha1.flows.weft.dev", "-o", "jsonpath={.spec.caBundle}"]);
    let secret_ca = || jsonpath("secret", &format!("{name}-flows-api-tls"), r"{.data.ca\.crt}");
    let installed_ca = ca_bundle();
    assert!(!installed_ca.is_empty());
    assert_eq!(installed_ca, secret_ca(), "the APIService trusts the serving certificate's CA");

    agent_writes_only_its_own_nodes_objects(cp, ns, &agent_sa);
    operator_changes_only_its_pod_annotation(cp, ns, &op_sa);

    // Upgrade with changed values changes the objects, and removes disabled ones.
    helm.ok(&[
        "upgrade",
        &name,
        chart,
        "-n",
        ns,
        "--set",
        "network.backend=host-gw,operator.replicas=3,network.mtu=1400,metrics.service.enabled=false,\
         uninstall.removeWeftObjects=false",
    ]);
    assert_eq!(jsonpath("deployment", &deploy, "{.spec.replicas}"), "3");
    assert_eq!(jsonpath("deployment", &deploy, backend), "host-gw");
    let conf = jsonpath("configmap", &format!("{name}-cni-config"), r"{.data.00-weft\.conflist}");
    let conf: serde_json::Value = serde_json::from_str(&conf).expect("conflist JSON");
    assert_eq!(conf["plugins"][0]["mtu"], 1400);
    let objects = release.assert_all_objects_exist();
    assert_eq!(objects.len(), 22, "the metrics Services are gone: {objects:?}");
    let services = kubectl_ok(cp, &["get", "services", "-n", ns, "-o", "name"]);
    assert_eq!(services.trim(), format!("service/{name}-flows-api"), "stray services after upgrade");
    // The upgrade kept the flows API's CA and certificate (lookup).
    assert_eq!(ca_bundle(), installed_ca, "the upgrade issued a new CA");
    assert_eq!(secret_ca(), installed_ca);

    // Uninstall leaves nothing of the release; the CRDs stay (Helm's policy).
    helm.ok(&["uninstall", &name, "-n", ns, "--wait", "--timeout", "1m"]);
    let left = wait::until("the release's objects to disappear", Duration::from_secs(30), || {
        let left = release.labelled_objects();
        left.is_empty().then_some(left)
    });
    assert!(left.is_empty());
    let in_ns = kubectl_ok(cp, &["get", "all,configmaps,serviceaccounts,roles,rolebindings", "-n", ns, "-o", "name"]);
    let stray: Vec<&str> =
        in_ns.lines().filter(|l| !l.ends_with("/kube-root-ca.crt") && !l.ends_with("/default")).collect();
    assert!(stray.is_empty(), "stray objects after uninstall: {stray:?}");
    kubectl_ok(cp, &["get", "crd", "subnets.weft.dev"]);
}

#[test]
fn dockerfile_builds_what_the_chart_runs() {
    // No Docker daemon here: the images cannot be built in tests, so check
    // that the Dockerfile's stages and binaries match the chart and workspace.
    let dockerfile = std::fs::read_to_string(repo_root().join("Dockerfile")).expect("Dockerfile at the repo root");
    for stage in ["AS builder", "AS agent", "AS operator"] {
        assert!(dockerfile.contains(stage), "Dockerfile has no stage `{stage}`");
    }
    for bin in ["weft-agent", "weft-operator"] {
        assert!(dockerfile.contains(&format!("target/release/{bin}")), "Dockerfile does not build {bin}");
    }
    // weft-cni ships static, built by the script the tests and benchmarks use too.
    assert!(dockerfile.contains("cni-plugin/build-static.sh"), "Dockerfile does not build the static weft-cni");
    assert!(repo_root().join("cni-plugin/build-static.sh").exists());
    let stage = |name: &str| {
        let start = dockerfile.find(&format!("AS {name}")).expect("stage");
        let rest = &dockerfile[start..];
        rest[..rest[1..].find("\nFROM ").map_or(rest.len(), |i| i + 1)].to_owned()
    };
    let agent = stage("agent");
    assert!(agent.contains("/usr/local/bin/") && agent.contains("weft-cni"), "the init container copies weft-cni");
    assert!(agent.contains("nftables") && agent.contains("iptables"));
    assert!(stage("operator").contains("USER 65532"), "the operator image runs as non-root");
    // The chart's init container copies the binary from where the image puts it.
    let ds = std::fs::read_to_string(chart_dir().join("templates/agent-daemonset.yaml")).expect("daemonset");
    assert!(ds.contains("cp /usr/local/bin/weft-cni "));
    let op = std::fs::read_to_string(chart_dir().join("templates/operator-deployment.yaml")).expect("deployment");
    assert!(op.contains("runAsUser: 65532"), "the chart runs the operator as the image's user");
}

#[test]
fn custom_values_render_objects_the_apiserver_accepts() {
    let Some(cp) = ControlPlane::shared() else { return };
    let Some(helm) = Helm::new() else { return };
    let ns = control_plane::unique_name("weft-dry");
    kubectl_ok(cp, &["create", "namespace", &ns]);
    struct DeleteNs<'a>(&'a ControlPlane, &'a str);
    impl Drop for DeleteNs<'_> {
        fn drop(&mut self) {
            let _ = kubectl(self.0, &["delete", "namespace", self.1, "--wait=false"], None);
        }
    }
    let _cleanup = DeleteNs(cp, &ns);
    let values = custom_values_file();
    // Every object of the non-default rendering passes the apiserver's
    // validation (server-side dry run; the ServiceMonitor and PrometheusRule
    // CRDs are not installed here, so those two objects are left out).
    let rendered = helm.ok(&[
        "template",
        "weft",
        chart_dir().to_str().expect("path"),
        "-n",
        &ns,
        "-f",
        values.path().to_str().expect("path"),
        "--set",
        "metrics.serviceMonitor.enabled=false",
        "--set",
        "metrics.prometheusRule.enabled=false",
    ]);
    // No -n: every namespaced object names its namespace, and one (the flows
    // API's RoleBinding) is in kube-system.
    let out = kubectl(cp, &["apply", "--dry-run=server", "-f", "-"], Some(&rendered));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "rejected: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        stdout.lines().filter(|l| l.contains("(server dry run)")).count(),
        documents(&rendered).len(),
        "{stdout}"
    );
}

/// The chart installed into the sandbox cluster (the apiserver the sandbox's
/// operator and agents use), as a user would after `e2e/sandbox.sh up`: every
/// object is accepted, and uninstall removes them. (The sandbox has no
/// kubelet, so the pods stay Pending; the sandbox's own daemons keep serving.)
#[test]
fn installs_into_the_sandbox_cluster() {
    use weft_e2e::sandbox::testing::{Up, ok};
    let Some(_up) = Up::start(&["--nodes", "1"], &[]) else { return };
    let Some(mut helm) = Helm::new() else { return };
    helm.kubeconfig = Some(weft_e2e::sandbox::State::load().expect("sandbox state").kubeconfig);
    let chart = chart_dir();
    let chart = chart.to_str().expect("path");
    let out = helm.ok(&[
        "install",
        "weft",
        chart,
        "-n",
        "weft-system",
        "--create-namespace",
        "--set",
        "network.clusterCIDR=10.244.0.0/16,network.hostPortRange.min=21000,network.hostPortRange.max=21999,\
         uninstall.removeWeftObjects=false",
    ]);
    assert!(out.contains("STATUS: deployed"), "{out}");
    let objects = ok(&[
        "kubectl",
        "get",
        "deployment,daemonset,configmap,serviceaccount,service",
        "-n",
        "weft-system",
        "-o",
        "name",
    ]);
    for want in ["deployment.apps/weft-operator", "daemonset.apps/weft-agent", "configmap/weft-cni-config"] {
        assert!(objects.lines().any(|l| l == want), "{want} missing:\n{objects}");
    }
    let env = ok(&["kubectl", "get", "daemonset", "weft-agent", "-n", "weft-system", "-o", "json"]);
    assert!(env.contains("\"WEFT_HOST_PORT_RANGE\"") && env.contains("\"21000-21999\""), "{env}");
    // The sandbox's own objects (its Subnet, managed by its operator) are untouched.
    assert!(ok(&["kubectl", "get", "subnets"]).contains("node-1"));
    helm.ok(&["uninstall", "weft", "-n", "weft-system", "--wait"]);
    let left = ok(&[
        "kubectl",
        "get",
        "deployment,daemonset,configmap,serviceaccount,service",
        "-n",
        "weft-system",
        "-o",
        "name",
    ]);
    assert!(!left.lines().any(|l| l.contains("weft-")), "left behind:\n{left}");
    let roles = ok(&["kubectl", "get", "clusterroles,clusterrolebindings", "-o", "name"]);
    assert!(!roles.lines().any(|l| l.contains("/weft-")), "cluster-scoped objects left behind:\n{roles}");
}

/// The ClusterNetworkPolicy CRD of each channel, as the chart renders it
/// with `clusterNetworkPolicy.installCRDs`.
fn rendered_cnp_crd(helm: &Helm, channel: &str) -> Value {
    let set = format!("clusterNetworkPolicy.installCRDs=true,clusterNetworkPolicy.crdChannel={channel}");
    let chart = chart_dir();
    let docs = documents(&helm.ok(&["template", "t", chart.to_str().expect("path"), "--set", &set]));
    let crds: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "CustomResourceDefinition").collect();
    assert_eq!(crds.len(), 1, "one CRD in the templates (Weft's own are in crds/)");
    crds[0].clone()
}

#[test]
fn the_cluster_network_policy_crds_are_the_modules_and_rendered_as_they_are_and_enforcement_is_a_value() {
    // The vendored files are the pinned module's, byte for byte (the script
    // downloads it through the Go module proxy).
    let script = repo_root().join("e2e/scripts/vendor-cnp-crds.sh");
    let go = Command::new("go").arg("version").output().is_ok_and(|o| o.status.success());
    if prereq::require("go (e2e/scripts/setup-machine.sh) to fetch sigs.k8s.io/network-policy-api", go) {
        let out = Command::new(&script).arg("--check").output().expect("vendor-cnp-crds.sh");
        assert!(out.status.success(), "run {}: {}", script.display(), String::from_utf8_lossy(&out.stderr));
    }
    let Some(helm) = Helm::new() else { return };
    let chart = chart_dir();
    let defaults = documents(&helm.ok(&["template", "t", chart.to_str().expect("path")]));
    assert!(!defaults.iter().any(|d| d["kind"] == "CustomResourceDefinition"), "off by default");
    for channel in ["standard", "experimental"] {
        let file = chart_dir().join(format!("files/clusternetworkpolicies/{channel}.yaml"));
        let mut vendored: Value = serde_yaml::from_str(&std::fs::read_to_string(&file).expect("vendored CRD"))
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let rendered = rendered_cnp_crd(&helm, channel);
        assert_eq!(rendered["metadata"]["annotations"]["helm.sh/resource-policy"], "keep");
        assert_eq!(rendered["metadata"]["annotations"]["policy.networking.k8s.io/channel"], channel);
        vendored["metadata"]["annotations"]["helm.sh/resource-policy"] = "keep".into();
        assert!(rendered == vendored, "the rendered {channel} CRD is not the vendored one plus the keep annotation");
    }
    // Enforcement: the agents' and the operator's flag, the agents'
    // permission to read the policies and the operator's to write their status.
    let granted = |docs: &[Value], who: &str, resource: &str| {
        let role = find(docs, "ClusterRole", who);
        role["rules"].as_sequence().expect("rules").iter().any(|r| r["resources"][0] == resource)
    };
    let reads_cnps = |docs: &[Value]| {
        granted(docs, "-agent", "clusternetworkpolicies") && granted(docs, "-operator", "clusternetworkpolicies/status")
    };
    let agent_env = |docs: &[Value]| {
        let ds = find(docs, "DaemonSet", "-agent");
        let operator = find(docs, "Deployment", "-operator");
        let agent =
            env(&ds["spec"]["template"]["spec"]["containers"][0], "WEFT_CLUSTER_NETWORK_POLICY")["value"].clone();
        let op =
            env(&operator["spec"]["template"]["spec"]["containers"][0], "WEFT_CLUSTER_NETWORK_POLICY")["value"].clone();
        assert_eq!(agent, op, "the agents and the operator agree");
        agent
    };
    assert!(
        !granted(&defaults, "-agent", "clusternetworkpolicies")
            && !granted(&defaults, "-operator", "clusternetworkpolicies/status")
            && agent_env(&defaults) == "false",
        "not enforced by default"
    );
    let enforced = documents(&helm.ok(&[
        "template",
        "t",
        chart.to_str().expect("path"),
        "--set",
        "clusterNetworkPolicy.enforce=true",
    ]));
    assert!(reads_cnps(&enforced) && agent_env(&enforced) == "true");

    let err = helm.fails(&[
        "template",
        "t",
        chart.to_str().expect("path"),
        "--set",
        "clusterNetworkPolicy.installCRDs=true,clusterNetworkPolicy.crdChannel=beta",
    ]);
    assert!(err.contains("crdChannel") && err.contains("'standard', 'experimental'"), "{err}");
}

#[test]
fn pod_endpoints_are_one_value_for_the_operator_the_agents_and_their_permissions() {
    let Some(helm) = Helm::new() else { return };
    let chart = chart_dir();
    let render = |set: &[&str]| {
        let mut args = vec!["template", "t", chart.to_str().expect("path")];
        args.extend(set.iter().flat_map(|s| ["--set", *s]));
        documents(&helm.ok(&args))
    };
    // (agent's pod source, operator publishes, agent may read, operator may write)
    let switches = |docs: &[Value]| {
        let agent = &find(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]["containers"][0];
        let operator = &find(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0];
        let verbs = |who: &str| -> Vec<String> {
            let role = find(docs, "ClusterRole", who);
            let rules = role["rules"].as_sequence().expect("rules").iter();
            let rule = rules.filter(|r| r["resources"][0] == "podendpoints").flat_map(|r| r["verbs"].as_sequence());
            rule.flatten().filter_map(|v| v.as_str().map(str::to_owned)).collect()
        };
        (
            env(agent, "WEFT_POD_SOURCE")["value"].as_str().unwrap_or_default().to_owned(),
            env(operator, "WEFT_PUBLISH_POD_ENDPOINTS")["value"].as_str().unwrap_or_default().to_owned(),
            verbs("-agent"),
            verbs("-operator"),
        )
    };
    let none: Vec<String> = Vec::new();
    assert_eq!(switches(&render(&[])), ("pods".into(), "false".into(), none.clone(), none), "off by default");
    let (source, publish, agent, operator) = switches(&render(&["podEndpoints.enabled=true"]));
    assert_eq!((source.as_str(), publish.as_str()), ("endpoints", "true"));
    assert_eq!(agent, ["list", "watch"], "the agents only read them");
    assert!(["create", "patch", "delete"].iter().all(|v| operator.iter().any(|o| o == v)), "{operator:?}");
}

#[test]
fn the_cluster_network_policy_crd_installs_validates_and_outlives_the_release() {
    let Some(cp) = ControlPlane::shared() else { return };
    let Some(helm) = Helm::with_cluster(cp) else { return };
    let chart = chart_dir();
    let name = control_plane::unique_name("weft-cnp");
    let ns = control_plane::unique_name("weft-cnp");
    // Without the flows API: its APIService is one per cluster, and
    // install_upgrade_uninstall_on_a_real_apiserver may hold it meanwhile.
    let set = "uninstall.removeWeftObjects=false,clusterNetworkPolicy.installCRDs=true,\
               clusterNetworkPolicy.crdChannel=experimental,flowsApi.enabled=false";
    let chart = chart.to_str().expect("path");
    helm.ok(&["install", &name, chart, "-n", &ns, "--create-namespace", "--timeout", "2m", "--set", set]);
    let crd = "clusternetworkpolicies.policy.networking.k8s.io";
    wait::until("the ClusterNetworkPolicy CRD to be established", Duration::from_secs(30), || {
        let out = kubectl(
            cp,
            &["get", "crd", crd, "-o", "jsonpath={.status.conditions[?(@.type==\"Established\")].status}"],
            None,
        );
        (String::from_utf8_lossy(&out.stdout) == "True").then_some(())
    });
    let channel = kubectl_ok(
        cp,
        &["get", "crd", crd, "-o", r"jsonpath={.metadata.annotations.policy\.networking\.k8s\.io/channel}"],
    );
    assert_eq!(channel, "experimental");
    let policy = |tier: &str, priority: i32| {
        format!(
            "apiVersion: policy.networking.k8s.io/v1beta1\nkind: ClusterNetworkPolicy\n\
             metadata: {{name: {name}}}\n\
             spec:\n  tier: {tier}\n  priority: {priority}\n  subject: {{namespaces: {{}}}}\n\
             \x20 ingress:\n  - action: Deny\n    from: [{{namespaces: {{matchLabels: {{team: other}}}}}}]\n"
        )
    };
    // The CRD's own validation answers bad input with its message.
    let bad = kubectl(cp, &["apply", "-f", "-"], Some(&policy("Middle", 10)));
    let why = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && why.contains("spec.tier") && why.contains("Admin"), "{why}");
    let bad = kubectl(cp, &["apply", "-f", "-"], Some(&policy("Admin", 1001)));
    let why = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && why.contains("spec.priority"), "{why}");
    let good = kubectl(cp, &["apply", "-f", "-"], Some(&policy("Admin", 10)));
    assert!(good.status.success(), "{}", String::from_utf8_lossy(&good.stderr));

    // Uninstall keeps the CRD and so every ClusterNetworkPolicy.
    helm.ok(&["uninstall", &name, "-n", &ns, "--wait", "--timeout", "1m"]);
    kubectl_ok(cp, &["get", "clusternetworkpolicy", &name]);
    kubectl_ok(cp, &["delete", "clusternetworkpolicy", &name]);
    kubectl_ok(cp, &["delete", "namespace", &ns, "--wait=false"]);
}

#[test]
fn flows_turn_on_the_drop_log_group_without_its_lines() {
    let Some(helm) = Helm::new() else { return };
    let chart = chart_dir();
    let env_of = |set: &str| {
        let docs = documents(&helm.ok(&["template", "t", chart.to_str().expect("path"), "--set", set]));
        let ds = find(&docs, "DaemonSet", "-agent");
        ds["spec"]["template"]["spec"]["containers"][0].clone()
    };
    // Flows alone: the group feeds them, the log lines stay off.
    let a = env_of("agent.flows.enabled=true,agent.flows.capacity=1000");
    assert_eq!(env(&a, "WEFT_FLOWS_CAPACITY")["value"], "1000");
    assert_eq!(env(&a, "WEFT_POLICY_DROP_LOG_GROUP")["value"], "100");
    assert_eq!(env(&a, "WEFT_POLICY_DROP_LOG_LINES")["value"], "false");
    // Turned off, neither the ring nor the group.
    let off = serde_yaml::to_string(&env_of("agent.flows.enabled=false")["env"]).expect("env");
    assert!(!off.contains("WEFT_FLOWS_CAPACITY") && !off.contains("WEFT_POLICY_DROP_LOG"), "{off}");
    // With the drop log asked for too, its lines are on.
    let both = env_of("agent.flows.enabled=true,agent.policyDropLog.enabled=true");
    assert_eq!(env(&both, "WEFT_FLOWS_CAPACITY")["value"], "4096");
    assert_eq!(env(&both, "WEFT_POLICY_DROP_LOG_LINES")["value"], "true");
}

/// Kinds and names of what the flows API adds to a rendering, with `sets`.
fn flows_api_objects(helm: &Helm, sets: &str) -> Vec<String> {
    let chart = chart_dir();
    let mut args = vec!["template", "rel", chart.to_str().expect("path"), "-n", "weft-system"];
    if !sets.is_empty() {
        args.extend(["--set", sets]);
    }
    let out = helm.ok(&args);
    let mut found: Vec<String> = documents(&out)
        .iter()
        .filter(|d| {
            let name = d["metadata"]["name"].as_str().unwrap_or("");
            name.contains("flows") || name.ends_with("-auth-delegator") || name.ends_with("-authentication-reader")
        })
        .map(|d| format!("{}/{}", d["kind"].as_str().unwrap_or("?"), d["metadata"]["name"].as_str().unwrap_or("?")))
        .collect();
    found.sort();
    // Nor anything in the pods or the agent's role.
    for (what, needle) in [
        ("WEFT_FLOWS_API_ADDR", "WEFT_FLOWS_API_ADDR"),
        ("WEFT_FLOWS_LISTEN", "WEFT_FLOWS_LISTEN"),
        ("WEFT_FLOWS_READER", "WEFT_FLOWS_READER"),
        ("the flows token volume", "flows.weft.dev"),
        ("tokenreviews", "tokenreviews"),
    ] {
        if out.contains(needle) {
            found.push(what.to_owned());
        }
    }
    found
}

#[test]
fn flows_api_renders_with_defaults() {
    let Some(helm) = Helm::new() else { return };
    let out = helm.ok(&["template", "rel", chart_dir().to_str().expect("path"), "-n", "weft-system"]);
    let docs = documents(&out);

    // The serving certificate and its CA, which the APIService trusts.
    let secret = find(&docs, "Secret", "-flows-api-tls");
    assert_eq!(secret["metadata"]["name"], "rel-weft-flows-api-tls");
    assert_eq!(secret["metadata"]["namespace"], "weft-system");
    assert_eq!(secret["type"], "kubernetes.io/tls");
    // k8s-openapi decodes the Secret's base64 data.
    let typed: k8s_openapi::api::core::v1::Secret = serde_yaml::from_value(secret.clone()).expect("a Secret");
    let data = |key: &str| {
        let bytes = typed.data.as_ref().and_then(|d| d.get(key)).unwrap_or_else(|| panic!("no {key} in the Secret"));
        String::from_utf8(bytes.0.clone()).expect("PEM is text")
    };
    assert!(data("ca.crt").starts_with("-----BEGIN CERTIFICATE-----"));
    assert!(data("tls.crt").starts_with("-----BEGIN CERTIFICATE-----"));
    assert!(data("tls.key").contains("PRIVATE KEY-----"));
    assert_ne!(data("ca.crt"), data("tls.crt"));

    let svc = find(&docs, "Service", "-flows-api");
    assert_eq!(svc["metadata"]["name"], "rel-weft-flows-api");
    assert_eq!(svc["metadata"]["namespace"], "weft-system");
    assert_eq!(svc["spec"]["selector"]["app.kubernetes.io/component"], "operator");
    assert_eq!(svc["spec"]["selector"]["app.kubernetes.io/instance"], "rel");
    assert_eq!(svc["spec"]["ports"][0]["port"], 443);
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], 9648);

    let api = find(&docs, "APIService", "v1alpha1.flows.weft.dev");
    assert_eq!(api["apiVersion"], "apiregistration.k8s.io/v1");
    let spec = &api["spec"];
    assert_eq!(spec["group"], "flows.weft.dev");
    assert_eq!(spec["version"], "v1alpha1");
    assert_eq!(spec["groupPriorityMinimum"], 1000);
    assert_eq!(spec["versionPriority"], 15);
    assert_eq!(spec["service"]["name"], "rel-weft-flows-api");
    assert_eq!(spec["service"]["namespace"], "weft-system");
    assert_eq!(spec["service"]["port"], 443);
    assert!(spec["insecureSkipTLSVerify"].is_null() || spec["insecureSkipTLSVerify"] == false);
    assert_eq!(spec["caBundle"], secret["data"]["ca.crt"], "the caBundle is the serving certificate's CA");

    // Readers: aggregated into view, edit and admin.
    let reader = find(&docs, "ClusterRole", "-flows-reader");
    assert_eq!(reader["metadata"]["name"], "rel-weft-flows-reader");
    for role in ["view", "edit", "admin"] {
        assert_eq!(
            reader["metadata"]["labels"][format!("rbac.authorization.k8s.io/aggregate-to-{role}").as_str()],
            "true"
        );
    }
    assert_eq!(reader["rules"].as_sequence().expect("rules").len(), 1);
    let rule = &reader["rules"][0];
    assert_eq!(rule["apiGroups"][0], "flows.weft.dev");
    assert_eq!(rule["resources"].as_sequence().expect("resources").len(), 1);
    assert_eq!(rule["resources"][0], "flows");
    assert_eq!(
        serde_yaml::to_string(&rule["verbs"]).expect("verbs"),
        "- get\n- list\n- watch\n",
        "watch: weft flows --follow"
    );

    // The operator delegates authentication and authorization to the
    // apiserver and reads the front proxy's configuration.
    let op_subject = |binding: &Value| {
        assert_eq!(binding["subjects"][0]["kind"], "ServiceAccount");
        assert_eq!(binding["subjects"][0]["name"], "rel-weft-operator");
        assert_eq!(binding["subjects"][0]["namespace"], "weft-system");
    };
    let delegator = find(&docs, "ClusterRoleBinding", "-operator-auth-delegator");
    assert_eq!(delegator["roleRef"]["kind"], "ClusterRole");
    assert_eq!(delegator["roleRef"]["name"], "system:auth-delegator");
    op_subject(delegator);
    let reader_binding = find(&docs, "RoleBinding", "-operator-authentication-reader");
    assert_eq!(reader_binding["metadata"]["namespace"], "kube-system");
    assert_eq!(reader_binding["roleRef"]["kind"], "Role");
    assert_eq!(reader_binding["roleRef"]["name"], "extension-apiserver-authentication-reader");
    op_subject(reader_binding);
    // It lists the agents' pods (the cluster-wide pods rule covers it).
    let op_role = find(&docs, "ClusterRole", "rel-weft-operator");
    let pods = op_role["rules"]
        .as_sequence()
        .expect("rules")
        .iter()
        .find(|r| r["apiGroups"][0] == "" && r["resources"][0] == "pods")
        .expect("a pods rule");
    assert!(pods["verbs"].as_sequence().expect("verbs").iter().any(|v| v == "list"));
    // The agents check the operator's token.
    let agent_role = find(&docs, "ClusterRole", "-agent");
    let reviews = agent_role["rules"]
        .as_sequence()
        .expect("rules")
        .iter()
        .find(|r| r["resources"][0] == "tokenreviews")
        .expect("a tokenreviews rule");
    assert_eq!(reviews["apiGroups"][0], "authentication.k8s.io");
    assert_eq!(serde_yaml::to_string(&reviews["verbs"]).expect("verbs"), "- create\n");

    // The operator serves the API with the Secret's certificate and calls the
    // agents with a token only they accept.
    let op = find(&docs, "Deployment", "-operator");
    let pod = &op["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    for (name, value) in [
        ("WEFT_FLOWS_API_ADDR", "0.0.0.0:9648"),
        ("WEFT_FLOWS_API_CERT", "/etc/weft/flows-api/tls.crt"),
        ("WEFT_FLOWS_API_KEY", "/etc/weft/flows-api/tls.key"),
        ("WEFT_FLOWS_TOKEN_FILE", "/var/run/secrets/weft/flows/token"),
        ("WEFT_FLOWS_AGENT_PORT", "9654"),
        ("WEFT_FLOWS_AGENT_NAMESPACE", "weft-system"),
        (
            "WEFT_FLOWS_AGENT_SELECTOR",
            "app.kubernetes.io/name=weft,app.kubernetes.io/instance=rel,app.kubernetes.io/component=agent",
        ),
    ] {
        assert_eq!(env(c, name)["value"], value, "{name}");
    }
    // The selector is the agents' own.
    let ds = find(&docs, "DaemonSet", "-agent");
    for (k, v) in ds["spec"]["selector"]["matchLabels"].as_mapping().expect("matchLabels") {
        let pair = format!("{}={}", k.as_str().expect("key"), v.as_str().expect("value"));
        assert!(env(c, "WEFT_FLOWS_AGENT_SELECTOR")["value"].as_str().expect("selector").contains(&pair), "{pair}");
    }
    let port = c["ports"].as_sequence().expect("ports").iter().find(|p| p["name"] == "flows-api").expect("port");
    assert_eq!(port["containerPort"], 9648);
    assert_eq!(port["hostPort"], 9648, "hostNetwork: the port is a host port");
    let mount = |path: &str| {
        c["volumeMounts"]
            .as_sequence()
            .expect("volumeMounts")
            .iter()
            .find(|m| m["mountPath"] == path)
            .unwrap_or_else(|| panic!("nothing mounted at {path}"))
            .clone()
    };
    let volume = |name: &Value| {
        pod["volumes"]
            .as_sequence()
            .expect("volumes")
            .iter()
            .find(|v| &v["name"] == name)
            .unwrap_or_else(|| panic!("no volume {name:?}"))
            .clone()
    };
    let tls = mount("/etc/weft/flows-api");
    assert_eq!(tls["readOnly"], true);
    assert_eq!(volume(&tls["name"])["secret"]["secretName"], "rel-weft-flows-api-tls");
    let token = mount("/var/run/secrets/weft/flows");
    assert_eq!(token["readOnly"], true);
    let projected = &volume(&token["name"])["projected"]["sources"][0]["serviceAccountToken"];
    assert_eq!(projected["audience"], "flows.weft.dev");
    assert_eq!(projected["expirationSeconds"], 3600);
    assert_eq!(projected["path"], "token");

    // Each agent serves its node's records on the node IP to the operator alone.
    let a = &ds["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(env(a, "WEFT_FLOWS_LISTEN")["value"], "$(WEFT_NODE_IP):9654");
    assert_eq!(env(a, "WEFT_FLOWS_READER")["value"], "system:serviceaccount:weft-system:rel-weft-operator");
    let names: Vec<&str> = a["env"].as_sequence().expect("env").iter().filter_map(|e| e["name"].as_str()).collect();
    let pos = |n: &str| names.iter().position(|x| *x == n).unwrap_or_else(|| panic!("no {n}"));
    assert!(pos("WEFT_NODE_IP") < pos("WEFT_FLOWS_LISTEN"), "$(WEFT_NODE_IP) is defined before its use");
    let port = a["ports"].as_sequence().expect("ports").iter().find(|p| p["name"] == "flows").expect("port");
    assert_eq!(port["containerPort"], 9654);

    // IPv6-only: the operator binds [::] (as its metrics do), the agent its
    // node IP in brackets.
    let out = helm.ok(&[
        "template",
        "rel",
        chart_dir().to_str().expect("path"),
        "--set",
        "network.clusterCIDR=null,network.ipv6ClusterCIDR=fd00:10:244::/56",
    ]);
    let docs = documents(&out);
    let c = &find(&docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(env(c, "WEFT_FLOWS_API_ADDR")["value"], "[::]:9648");
    let a = &find(&docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(env(a, "WEFT_FLOWS_LISTEN")["value"], "[$(WEFT_NODE_IP)]:9654");

    // Ports and aggregation are values.
    let out = helm.ok(&[
        "template",
        "rel",
        chart_dir().to_str().expect("path"),
        "--set",
        "flowsApi.port=19648,flowsApi.agentPort=19654,flowsApi.aggregateToView=false,operator.hostNetwork=false",
    ]);
    let docs = documents(&out);
    assert_eq!(find(&docs, "Service", "-flows-api")["spec"]["ports"][0]["targetPort"], 19648);
    let c = &find(&docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(env(c, "WEFT_FLOWS_API_ADDR")["value"], "0.0.0.0:19648");
    assert_eq!(env(c, "WEFT_FLOWS_AGENT_PORT")["value"], "19654");
    let port = c["ports"].as_sequence().expect("ports").iter().find(|p| p["name"] == "flows-api").expect("port");
    assert!(port["hostPort"].is_null(), "no host port off the host network");
    let a = &find(&docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(env(a, "WEFT_FLOWS_LISTEN")["value"], "$(WEFT_NODE_IP):19654");
    let labels =
        serde_yaml::to_string(&find(&docs, "ClusterRole", "-flows-reader")["metadata"]["labels"]).expect("labels");
    assert!(!labels.contains("aggregate-to"), "{labels}");
}

#[test]
fn flows_api_is_off_unless_both_flows_values_are_on() {
    let Some(helm) = Helm::new() else { return };
    let on = flows_api_objects(&helm, "");
    assert_eq!(
        on,
        [
            "APIService/v1alpha1.flows.weft.dev",
            "ClusterRole/rel-weft-flows-reader",
            "ClusterRoleBinding/rel-weft-operator-auth-delegator",
            "RoleBinding/rel-weft-operator-authentication-reader",
            "Secret/rel-weft-flows-api-tls",
            "Service/rel-weft-flows-api",
            "WEFT_FLOWS_API_ADDR",
            "WEFT_FLOWS_LISTEN",
            "WEFT_FLOWS_READER",
            "the flows token volume",
            "tokenreviews",
        ]
    );
    for off in
        ["flowsApi.enabled=false", "agent.flows.enabled=false", "flowsApi.enabled=false,agent.flows.enabled=false"]
    {
        let left = flows_api_objects(&helm, off);
        assert!(left.is_empty(), "with {off}: {left:?}");
    }
    // The agents keep their own flow records with the API off.
    let out = helm.ok(&["template", "rel", chart_dir().to_str().expect("path"), "--set", "flowsApi.enabled=false"]);
    let docs = documents(&out);
    let a = &find(&docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(env(a, "WEFT_FLOWS_CAPACITY")["value"], "4096");
    let op = serde_yaml::to_string(&find(&docs, "Deployment", "-operator")["spec"]).expect("operator");
    assert!(!op.contains("flows"), "{op}");
}
