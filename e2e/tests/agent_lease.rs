//! The agent against the real apiserver: it serves no CNI request until its
//! node's Subnet lease exists, then uses the lease's CIDR for pods and
//! publishes its node facts in the Subnet's status (again when wiped); an
//! IPv6 block added to the lease makes it restart to use it; a withdrawn
//! lease stops new pods and is let go once its pods are gone.

use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::time::Duration;

use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use weft_api::subnet::{LEASE_FINALIZER, Subnet};
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
    let start_agent = || {
        let log =
            std::fs::OpenOptions::new().create(true).append(true).open(dir.path().join("agent.log")).expect("log");
        Killed(
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
        )
    };
    let mut agent = start_agent();
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

    // A Subnet without a range (the pool had none free): still no lease,
    // and the agent's log says why.
    let subnet: Subnet = serde_json::from_value(json!({
        "apiVersion": "weft.dev/v1alpha1", "kind": "Subnet",
        "metadata": {"name": name, "finalizers": [LEASE_FINALIZER]},
        "spec": {"nodeName": name, "backend": "vxlan"},
    }))
    .expect("subnet");
    rt.block_on(subnets.create(&PostParams::default(), &subnet)).expect("create Subnet");
    let waits = json!({"status": {"conditions": [{"type": "Allocated", "status": "False", "reason": "SubnetPoolExhausted",
        "message": "no free /24 left", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
    rt.block_on(subnets.patch_status(&name, &PatchParams::default(), &Patch::Merge(&waits))).expect("condition");
    wait::until("the agent to log the Subnet without a range", Duration::from_secs(30), || {
        let log = agent_log();
        (log.contains("has no range yet") && log.contains("no free /24 left")).then_some(())
    });
    assert_eq!(weft.status().code(), 50, "no lease yet");

    // The lease arrives: the agent serves, pods get addresses from it.
    let range = json!({"spec": {"cidr": "10.252.7.0/24"}});
    rt.block_on(subnets.patch(&name, &PatchParams::default(), &Patch::Merge(&range))).expect("lease a range");
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

    // Facts wiped by someone else are published again (level-triggered).
    let wipe = json!({"status": {"nodeIP": null, "vtepIP": null, "vtepMAC": null}});
    rt.block_on(subnets.patch_status(&name, &PatchParams::default(), &Patch::Merge(&wipe))).expect("wipe status");
    wait::until("the facts published again", Duration::from_secs(30), || {
        let st = rt.block_on(subnets.get(&name)).ok()?.status?;
        (st.node_ip.as_deref() == Some("10.251.0.2") && st.vtep_mac.is_some()).then_some(())
    });

    // Dual-stack turned on: the lease gains an IPv6 block. The agent exits
    // to take it (a DaemonSet restarts it); restarted, it gives new pods an
    // IPv6 address too, and the running pod keeps its own.
    let extend = json!({"spec": {"cidrs": ["10.252.7.0/24", "fd00:252:7::/64"]}});
    rt.block_on(subnets.patch(&name, &PatchParams::default(), &Patch::Merge(&extend))).expect("add an IPv6 block");
    let exit = wait::until("the agent to exit for the IPv6 block", Duration::from_secs(30), || {
        agent.0.try_wait().ok().flatten()
    });
    assert!(!exit.success(), "the agent exits with an error so that it is restarted");
    assert!(agent_log().contains("now also leases the IPv6 block fd00:252:7::/64"), "{}", agent_log());
    drop(agent);
    agent = start_agent();
    wait::until("STATUS ok after the restart", Duration::from_secs(30), || weft.status().success.then_some(()));
    weft.check(&c, &result).assert_ok();
    let pod6 = Netns::new("leasepod6");
    let c6 = Container::new("lease6", &pod6);
    let result6 = weft.add(&c6).assert_ok().json();
    let ip6 = cni::pod_ip6(&result6).unwrap_or_else(|| panic!("no IPv6 address: {result6}"));
    assert!(ip6.starts_with("fd00:252:7::"), "{result6}");
    weft.del(&c6, None).assert_ok();

    // The lease withdrawn while a pod uses it: no new pods, said everywhere,
    // and the block stays reserved (finalizer) until the pod is gone.
    rt.block_on(subnets.delete(&name, &DeleteParams::default())).expect("delete Subnet");
    let status = wait::until("STATUS to report the withdrawn lease", Duration::from_secs(30), || {
        let out = weft.status();
        (!out.success).then_some(out)
    });
    assert_eq!(status.code(), 50);
    assert!(status.stdout.contains("lease is withdrawn"), "{}", status.stdout);
    let second = Container::new("lease2", &pod);
    let refused = weft.add(&second);
    assert_eq!(refused.code(), 11, "{}", refused.stdout);
    assert!(refused.stdout.contains("takes no new pods"), "{}", refused.stdout);
    let metrics = node.exec("curl", &["-s", "http://127.0.0.1:9646/metrics"]);
    assert!(String::from_utf8_lossy(&metrics.stdout).contains("weft_agent_lease_withdrawn 1"), "metric not set");
    // The agent's Ready=False follows its own state (STATUS, ADD) by an API write.
    wait::until("Ready=False, LeaseWithdrawn on the withdrawn Subnet", Duration::from_secs(30), || {
        let held = rt.block_on(subnets.get(&name)).expect("the withdrawn Subnet is kept while its pod runs");
        let ready = held.status.and_then(|st| st.conditions.into_iter().find(|c| c.type_ == "Ready"));
        (ready.map(|c| (c.status, c.reason)) == Some(("False".into(), "LeaseWithdrawn".into()))).then_some(())
    });

    // The pod gone: the agent lets the block go and exits for a new lease.
    weft.del(&c, None).assert_ok();
    wait::until("the Subnet to be gone", Duration::from_secs(30), || {
        rt.block_on(subnets.get_opt(&name)).ok().and_then(|s| s.is_none().then_some(()))
    });
    let exit = wait::until("the agent to exit", Duration::from_secs(30), || agent.0.try_wait().ok().flatten());
    assert!(!exit.success(), "the agent exits with an error so that it is restarted");
    assert!(agent_log().contains("no pod uses the old block any more"), "{}", agent_log());
}
