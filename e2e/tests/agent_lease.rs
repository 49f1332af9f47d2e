//! The agent against the real apiserver: it serves no CNI request until its
//! node's Subnet lease exists, then uses the lease's CIDR for pods and
//! publishes its node facts in the Subnet's status.

use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::time::Duration;

use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use weft_api::subnet::Subnet;
use weft_e2e::cni::{self, Container, Weft};
use weft_e2e::control_plane::{ControlPlane, install_crds, unique_name};
use weft_e2e::netns::Netns;
use weft_e2e::sandbox::forward;
use weft_e2e::{bins, prereq, wait};

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn agent_waits_for_its_lease_then_uses_it_and_publishes_its_facts() {
    if !prereq::require_root() {
        return;
    }
    let Some(cp) = ControlPlane::shared() else { return };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let client = rt.block_on(cp.client()).expect("client");
    rt.block_on(install_crds(&client)).expect("CRDs");
    let subnets = Api::<Subnet>::all(client);

    // A node namespace with an underlay address, reaching the apiserver
    // through a forwarder on its own loopback.
    let node = Netns::new("lease");
    node.ip(&["link", "add", "eth0", "type", "veth", "peer", "name", "eth0p"]);
    node.ip(&["link", "set", "eth0p", "up"]);
    node.ip(&["addr", "add", "10.251.0.2/24", "dev", "eth0"]);
    node.ip(&["link", "set", "eth0", "up"]);
    let api_port: u16 = cp.server.rsplit(':').next().and_then(|p| p.parse().ok()).expect("apiserver port");
    forward::serve_between(
        Some(node.name()),
        SocketAddr::from(([127, 0, 0, 1], 6443)),
        None,
        SocketAddr::from(([127, 0, 0, 1], api_port)),
    )
    .expect("forwarder");
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("kubeconfig");
    let text = std::fs::read_to_string(&cp.kubeconfig).expect("kubeconfig");
    std::fs::write(&kubeconfig, text.replace(&cp.server, "https://127.0.0.1:6443")).expect("node kubeconfig");

    let name = unique_name("lease-node");
    let socket = dir.path().join("agent.sock");
    let log = std::fs::File::create(dir.path().join("agent.log")).expect("log");
    let _agent = Killed(
        node.command(bins::weft("weft-agent"))
            .args(["--node-name", &name, "--node-ip", "10.251.0.2", "--cluster-cidr", "10.252.0.0/16"])
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(["--metrics-addr", "127.0.0.1:9646"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("weft-agent"),
    );
    let agent_log = || std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default();

    // Without a lease: /readyz says why, and weft-cni gets STATUS 50 / ADD 11.
    let why = wait::until("the agent's /readyz", Duration::from_secs(30), || {
        let out = node.exec("curl", &["-s", "http://127.0.0.1:9646/readyz"]);
        let body = String::from_utf8_lossy(&out.stdout).into_owned();
        (!body.is_empty()).then_some(body)
    });
    assert!(why.contains("waiting for this node's Subnet lease"), "{why}\n{}", agent_log());
    let weft = Weft::new(&node, &socket);
    assert_eq!(weft.status().code(), 50);
    let pod = Netns::new("leasepod");
    let c = Container::new("lease1", &pod);
    assert_eq!(weft.add(&c).code(), 11);

    // The lease arrives: the agent serves, pods get addresses from it.
    let subnet: Subnet = serde_json::from_value(json!({
        "apiVersion": "weft.dev/v1alpha1", "kind": "Subnet",
        "metadata": {"name": name},
        "spec": {"nodeName": name, "cidr": "10.252.7.0/24", "backend": "vxlan"},
    }))
    .expect("subnet");
    rt.block_on(subnets.create(&PostParams::default(), &subnet)).expect("create Subnet");
    wait::until("STATUS ok once leased", Duration::from_secs(30), || weft.status().success.then_some(()));
    let result = weft.add(&c).assert_ok().json();
    assert!(cni::pod_ip(&result).starts_with("10.252.7."), "{result}");
    assert_eq!(result["interfaces"][1]["mtu"], 1450, "pod MTU is the underlay's minus VXLAN overhead: {result}");

    let published = wait::until("the agent's facts in the Subnet status", Duration::from_secs(30), || {
        let s = rt.block_on(subnets.get(&name)).ok()?;
        let st = s.status?;
        let ready = st.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True");
        (ready && st.vtep_mac.is_some()).then_some((st.node_ip, st.vtep_ip))
    });
    assert_eq!(published, (Some("10.251.0.2".to_owned()), Some("10.252.7.0".to_owned())));

    weft.del(&c, None).assert_ok();
    let _ = rt.block_on(subnets.delete(&name, &DeleteParams::default()));
}
