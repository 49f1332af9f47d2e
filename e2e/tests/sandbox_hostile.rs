//! A hostile pod in the sandbox cluster (real agents, pods made through
//! weft-cni): what a pod with root in its namespace tries in order to get
//! past NetworkPolicy, each attack scripted as the pod would run it, and
//! the traffic policy allows still flowing. Each attack is judged on its
//! own ([`Attacks`]): the table at the end says which got through. Against
//! the binaries from before the source guard (`WEFT_BIN_DIR`), all but the
//! readiness flood do (that one is a race the old start-up rarely lost);
//! against those from before the encapsulation guard, the smuggled VXLAN
//! packets (8) do.
//!
//! One sandbox runs per machine, so these tests take turns ([`Up`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use weft_e2e::attacks::Attacks;
use weft_e2e::flood;
use weft_e2e::sandbox::testing::{PausedAgent, Up, apply, connect, kubectl, ok, run, smuggled_arrives, tracked};
use weft_e2e::{smuggle, wait};

const CONVERGE: Duration = Duration::from_secs(45);

/// Isolates `app=victim` for ingress and `app=attacker` for egress.
const POLICIES: &str = "\
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: victim-deny-all, namespace: prod}
spec: {podSelector: {matchLabels: {app: victim}}, policyTypes: [Ingress]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: attacker-no-egress, namespace: prod}
spec: {podSelector: {matchLabels: {app: attacker}}, policyTypes: [Egress]}
";

/// Runs a shell command inside a pod (`namespace/name`); success and output.
fn in_pod(pod: &str, script: &str) -> (bool, String) {
    let (ns, name) = pod.split_once('/').expect("namespace/name");
    run(&["exec", name, "-n", ns, "--", "sh", "-c", script])
}

/// A pod's IPv4 address, from `weft-sandbox pods`.
fn pod_ip(pod: &str) -> String {
    let out = ok(&["pods"]);
    out.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|w| w.len() >= 3 && w[0] == pod)
        .map(|w| w[2].to_owned())
        .unwrap_or_else(|| panic!("{pod} not in\n{out}"))
}

/// The IPv6 link-local address of a pod's eth0 (every pod has one, even
/// in an IPv4-only cluster), once duplicate address detection let it be used.
fn link_local(pod: &str) -> String {
    wait::until(&format!("the link-local address of {pod}"), Duration::from_secs(10), || {
        let (_, out) = in_pod(pod, "ip -6 -o addr show dev eth0 scope link");
        let word = out.split_whitespace().skip_while(|w| *w != "inet6").nth(1)?;
        (!out.contains("tentative")).then(|| word.split('/').next().unwrap_or_default().to_owned())
    })
}

/// Whether a TCP connection from `pod` to `host` (any form getaddrinfo
/// takes, `fe80::1%eth0` included) on port 80 gets the responder's answer.
fn tcp_answers(pod: &str, host: &str) -> bool {
    let script = format!("timeout 3 bash -c 'exec 3<>/dev/tcp/{host}/80 && head -c 64 <&3' | grep -q .");
    in_pod(pod, &script).0
}

#[test]
fn a_hostile_pod_gets_past_no_policy() {
    let Some(_up) = Up::start(&["--nodes", "3"], &[]) else { return };
    ok(&["add-pod", "victim", "-n", "prod", "--node", "node-1", "-l", "app=victim"]);
    ok(&["add-pod", "attacker", "-n", "prod", "--node", "node-1", "-l", "app=attacker"]);
    ok(&["add-pod", "remote", "-n", "dev", "--node", "node-2", "-l", "app=remote"]);
    let (victim, attacker, remote) = ("prod/victim", "prod/attacker", "dev/remote");
    let (victim_ip, attacker_ip, remote_ip) = (pod_ip(victim), pod_ip(attacker), pod_ip(remote));

    apply(POLICIES);
    wait::until("the policies to isolate both pods", CONVERGE, || {
        let closed = connect(remote, "tcp", &format!("{victim_ip}:80")).is_none()
            && connect(attacker, "tcp", &format!("{remote_ip}:80")).is_none();
        closed.then_some(())
    });
    // What policy allows still flows: the victim reaches out, others reach the attacker.
    assert_eq!(connect(victim, "tcp", &format!("{remote_ip}:80")).as_deref(), Some(remote));
    assert_eq!(connect(remote, "tcp", &format!("{attacker_ip}:80")).as_deref(), Some(attacker));

    let mut attacks = Attacks::new("sandbox, IPv4, bridged");
    // 1. IPv6 link-local to a pod whose ingress is denied, in an IPv4-only cluster.
    let target = format!("{}%eth0", link_local(victim));
    link_local(attacker); // usable on the attacker's side too
    assert!(tcp_answers(victim, &target), "the victim's responder listens on its link-local address");
    attacks.judge("1. link-local dial to a pod isolated for ingress", !tcp_answers(attacker, &target), || {
        format!("{target} answered")
    });
    let (_, all) = in_pod(attacker, "ping -6 -c2 -i0.2 -W1 ff02::1%eth0");
    attacks.judge("1. IPv6 multicast ping finds a neighbour pod", !all.contains(&link_local(victim)), || all.clone());

    // 2. Egress deny-all escaped with an added address of the node's pod range.
    let spoofed = attacker_ip.rsplit_once('.').map(|(net, _)| format!("{net}.250")).expect("IPv4");
    let (added, out) = in_pod(attacker, &format!("ip addr add {spoofed}/32 dev eth0"));
    assert!(added, "{out}");
    let (reached, tracked) = ping_from(attacker, &spoofed, &remote_ip);
    attacks.judge("2. egress deny-all escaped with an added address", !reached && !tracked, || {
        format!("answered: {reached}; node-2 tracked it: {tracked}")
    });
    // 3. The same with another pod's address (the victim's), to a pod that
    // admits the victim. The answer goes to the victim, so node-2's
    // connection tracking tells whether the spoofed packets got there.
    let (_, _) = in_pod(attacker, &format!("ip addr add {victim_ip}/32 dev eth0"));
    let (_, tracked) = ping_from(attacker, &victim_ip, &remote_ip);
    attacks.judge("3. egress deny-all escaped with another pod's address", !tracked, || {
        "node-2 tracked the spoofed ping".to_owned()
    });

    // 8. A pod (the victim: its egress is open) writes a packet with a
    // made-up source, hides it in a VXLAN packet of its own and sends that
    // to node-2's tunnel port, and to its own node's (whose VXLAN socket
    // takes any of its addresses): masqueraded, it would come from
    // node-1's address, and the packet inside pass for a node-1 pod's.
    let subnet_field = |node: &str, field: &str| {
        kubectl(&["get", "subnet", node, "-o", &format!("jsonpath={{.status.{field}}}")]).trim().to_owned()
    };
    for (node, made_up) in [("node-2", 251), ("node-1", 252)] {
        let to = format!("{}:8472", subnet_field(node, "nodeIP")).parse().expect("a node address");
        let vtep = smuggle::mac(&subnet_field(node, "vtepMAC")).expect("a VTEP MAC");
        let src = spoofed.replace(".250", &format!(".{made_up}"));
        let arrived = smuggled_arrives(victim, to, Some(vtep), &src, &remote_ip, "node-2");
        attacks.judge(&format!("8. a made-up source smuggled in a pod's own VXLAN packet to {node}"), !arrived, || {
            format!("node-2 tracked {src} -> {remote_ip}")
        });
    }

    // The attacker's own traffic that policy allows is untouched.
    assert_eq!(connect(remote, "tcp", &format!("{attacker_ip}:80")).as_deref(), Some(attacker));

    // 4. A new pod under the egress deny-all, connecting from its very
    // first moment: from inside its namespace while its ADD runs, before
    // the API has its address.
    let target = remote_ip.clone();
    let early = std::thread::spawn(move || connects_while_attached("weft-sbx-pod-prod-early", &target));
    ok(&["add-pod", "early", "-n", "prod", "--node", "node-1", "-l", "app=attacker"]);
    let (tries, connected) = early.join().expect("the connecting thread");
    assert!(tries > 0, "no connection attempt ran while the pod was attached");
    attacks.judge("4. a new pod under egress deny-all connects during its ADD", !connected, || {
        format!("connected within {tries} tries")
    });

    // 5. A pod floods its node's agent with readiness requests (the node
    // address is reachable from pods) while the agent starts: start-up
    // still finishes (an aborted one exits the agent) and pods are
    // attached, as readiness checks run one at a time on a netlink socket
    // of their own.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let to: SocketAddr = "10.250.0.11:9646".parse().expect("node-1's agent");
    // Four senders, each waiting for its answer and 1 ms more (refused
    // connections come back at once; without the pause, four busy loops
    // would only measure how slow a 2-core machine gets).
    let pace = Some(Duration::from_millis(1));
    let floods: Vec<_> = (0..4)
        .map(|_| flood::readyz("/run/netns/weft-sbx-pod-prod-victim", to, pace, Arc::clone(&stop), Arc::clone(&sent)))
        .collect();
    ok(&["restart-agent", "node-1", "--kill"]);
    let started = std::time::Instant::now();
    let attached = wait::try_until(Duration::from_secs(90), || {
        run(&["add-pod", "after-flood", "-n", "dev", "--node", "node-1"]).0.then_some(())
    });
    let during = sent.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    let answered: u64 = floods.into_iter().map(|f| f.join().expect("a flood thread")).sum();
    assert!(during > 100 && answered > 0, "the flood did not reach the agent: {during} sent, {answered} answered");
    eprintln!(
        "attack 5: {during} readiness requests ({answered} answered) while node-1's agent started; waited {:?}",
        started.elapsed()
    );
    let reached =
        attached.is_some() && connect("dev/after-flood", "tcp", &format!("{remote_ip}:80")).as_deref() == Some(remote);
    attacks.judge("5. a readiness flood while the agent starts", reached, || {
        format!("no pod attached and reaching node-2 within 90 s (attached: {})", attached.is_some())
    });

    // 6. A node (its agent's token stolen) announces node-1's VTEP MAC as
    // its own: the other nodes must keep reaching node-1. (node-2's agent is
    // paused so that it does not put its own MAC back.)
    ok(&["add-pod", "observer", "-n", "dev", "--node", "node-3", "-l", "app=observer"]);
    let observer = "dev/observer";
    assert_eq!(connect(observer, "tcp", &format!("{attacker_ip}:80")).as_deref(), Some(attacker));
    let mac_of = |node: &str| kubectl(&["get", "subnet", node, "-o", "jsonpath={.status.vtepMAC}"]).trim().to_owned();
    let node1_mac = mac_of("node-1");
    let _paused = PausedAgent::new("node-2");
    let patch = format!(r#"{{"status":{{"vtepMAC":"{node1_mac}"}}}}"#);
    kubectl(&["patch", "subnet", "node-2", "--subresource=status", "--type=merge", "-p", &patch]);
    let rejected = wait::try_until(CONVERGE, || {
        let conditions = kubectl(&["get", "subnet", "node-3", "-o", "jsonpath={.status.conditions}"]);
        (conditions.contains("node-2") && conditions.contains(&node1_mac)).then_some(())
    });
    let reached = connect(observer, "tcp", &format!("{attacker_ip}:80"));
    attacks.judge(
        "6. another node announces node-1's VTEP MAC",
        rejected.is_some() && reached.as_deref() == Some(attacker),
        || format!("node-3 rejected the claim: {}; node-1's pod reached: {reached:?}", rejected.is_some()),
    );

    // 7. The same node claims node-1's address as its own node address
    // (where its peers would tunnel or route its pods' traffic): its Node
    // does not list that address, so the others refuse the claim.
    let node1_ip = kubectl(&["get", "subnet", "node-1", "-o", "jsonpath={.status.nodeIP}"]).trim().to_owned();
    let patch = format!(r#"{{"status":{{"nodeIP":"{node1_ip}"}}}}"#);
    kubectl(&["patch", "subnet", "node-2", "--subresource=status", "--type=merge", "-p", &patch]);
    let refused = wait::try_until(CONVERGE, || {
        let conditions = kubectl(&["get", "subnet", "node-3", "-o", "jsonpath={.status.conditions}"]);
        (conditions.contains("node-2") && conditions.contains(&format!("claims node address {node1_ip}"))).then_some(())
    });
    let reached = connect(observer, "tcp", &format!("{attacker_ip}:80"));
    attacks.judge(
        "7. another node claims node-1's address",
        refused.is_some() && reached.as_deref() == Some(attacker),
        || format!("node-3 refused the claim: {}; node-1's pod reached: {reached:?}", refused.is_some()),
    );
    attacks.finish();
}

/// Pings `dst` from `pod` with source `src` (an address the pod added):
/// whether an answer came, and whether node-2 (where `dst` lives) tracks
/// the ping, i.e. whether it got there.
fn ping_from(pod: &str, src: &str, dst: &str) -> (bool, bool) {
    let (answered, _) = in_pod(pod, &format!("ping -c2 -i0.2 -W1 -I {src} {dst}"));
    (answered, tracked("node-2", "icmp", src, dst))
}

/// From inside the network namespace `netns` (waiting for it to appear),
/// tries TCP to `ip`:80 over and over for 4 s; returns how many tries ran
/// with the namespace present and whether one connected.
fn connects_while_attached(netns: &str, ip: &str) -> (u32, bool) {
    let path = format!("/run/netns/{netns}");
    wait::until(&format!("the network namespace {netns}"), Duration::from_secs(60), || {
        std::path::Path::new(&path).exists().then_some(())
    });
    let script = format!(
        "n=0; end=$((SECONDS+4)); while ((SECONDS < end)); do n=$((n+1)); \
         if timeout 0.3 bash -c 'exec 3<>/dev/tcp/{ip}/80 && head -c1 <&3' 2>/dev/null | grep -q .; then echo \"$n connected\"; exit 0; fi; \
         done; echo \"$n\""
    );
    let out = std::process::Command::new("ip").args(["netns", "exec", netns, "bash", "-c", &script]).output();
    let out = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
    let tries = out.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(0);
    (tries, out.contains("connected"))
}
