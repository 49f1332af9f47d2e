//! A hostile pod on the real-node cluster: what a pod whose owner asked for
//! `NET_ADMIN` (root in its own network namespace) tries in order to get
//! past NetworkPolicy, each attack run inside the pod as kubelet and
//! containerd started it, in whatever families the cluster gives pods and
//! in either attachment mode. The namespace sandbox runs the same attacks
//! against pods made by exec'ing weft-cni (`sandbox_hostile.rs`).
//!
//! Not here: ARP and neighbour advertisements for another pod's address.
//! An ARP reply for it is a race the owner wins (the attacker's image has
//! no tool to send unsolicited ones), so it would pass without the guard
//! too; the guard's kernel tests check those frames, and the neighbour
//! solicitations and advertisements a pod sends to claim another pod's
//! IPv6 address (`a_bridged_pod_cannot_claim_another_pods_ipv6_address_by_
//! neighbour_discovery`), which the image cannot send either.
//!
//! Each attack is judged on its own ([`Attacks`]), so a run against older
//! images (`WEFT_IMAGES_DIR`) shows every one that gets through.

use std::net::IpAddr;
use std::time::Duration;

use super::testing::{apply, eventually, kubectl, kubectl_ok, node_exec, pod_exec};
use super::workloads::{HTTP_PORT, TestPod, delete_pods, http_hostname, namespace, pod_ips, wait_running};
use crate::attacks::Attacks;

/// Isolates `app=victim` for ingress and `app=attacker` for egress.
fn policies(ns: &str) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: victim-deny-all, namespace: {ns}}}\n\
         spec: {{podSelector: {{matchLabels: {{app: victim}}}}, policyTypes: [Ingress]}}\n---\n\
         apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: attacker-no-egress, namespace: {ns}}}\n\
         spec: {{podSelector: {{matchLabels: {{app: attacker}}}}, policyTypes: [Egress]}}\n"
    )
}

/// `ip` as the host part of a URL.
fn host(ip: &str) -> String {
    if ip.contains(':') { format!("[{ip}]") } else { ip.to_owned() }
}

/// Who answers `GET /hostname` on `ip` from inside pod `from` (its own
/// curl, not netexec's `/dial`, so that the pod's own tricks apply), with
/// extra curl arguments.
fn curl_hostname(ns: &str, from: &str, ip: &str, extra: &[&str]) -> Option<String> {
    let url = format!("http://{}:{HTTP_PORT}/hostname", host(ip));
    let mut cmd = vec!["curl", "-sg", "--max-time", "3"];
    cmd.extend_from_slice(extra);
    cmd.push(&url);
    let (ok, out) = pod_exec(ns, from, &cmd);
    ok.then(|| out.trim().to_owned()).filter(|s| !s.is_empty())
}

/// Runs a shell script in a pod; fails the test when it fails.
#[track_caller]
fn in_pod(ns: &str, pod: &str, script: &str) -> String {
    let (ok, out) = pod_exec(ns, pod, &["bash", "-c", script]);
    assert!(ok, "{script} in {ns}/{pod}: {out}");
    out
}

/// The usable (no longer tentative) IPv6 link-local address of a pod's eth0.
fn link_local(ns: &str, pod: &str) -> String {
    eventually(&format!("the link-local address of {pod}"), Duration::from_secs(20), || {
        let (_, out) = pod_exec(ns, pod, &["ip", "-6", "-o", "addr", "show", "dev", "eth0", "scope", "link"]);
        let addr = out.split_whitespace().skip_while(|w| *w != "inet6").nth(1)?;
        (!out.contains("tentative")).then(|| addr.split('/').next().unwrap_or_default().to_owned())
    })
}

/// An address of the pod's own range that no pod has (last byte 250, or
/// 0xfa in IPv6).
fn spare_address(ip: &str) -> String {
    match ip.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => {
            let [a, b, c, _] = v4.octets();
            std::net::Ipv4Addr::new(a, b, c, 250).to_string()
        }
        Ok(IpAddr::V6(v6)) => {
            let mut s = v6.segments();
            s[7] = 0xfa;
            std::net::Ipv6Addr::from(s).to_string()
        }
        Err(_) => panic!("{ip} is not an address"),
    }
}

/// Whether `node` tracks a TCP connection from `src`:`port`.
fn tracked_on(node: &str, src: &str, port: u16) -> bool {
    let family = if src.contains(':') { "ipv6" } else { "ipv4" };
    let port = port.to_string();
    let (ok, out) = node_exec(node, &["conntrack", "-L", "-f", family, "-p", "tcp", "-s", src, "--sport", &port]);
    assert!(ok || out.contains("0 flow entries"), "conntrack on {node}: {out}");
    out.lines().any(|l| l.contains(&format!("sport={port}")))
}

/// `ip addr add` of an address the pod does not own (IPv6 without duplicate
/// address detection, which the real owner would fail).
fn add_address(ns: &str, pod: &str, ip: &str) {
    let (prefix, flags) = if ip.contains(':') { (128, " nodad") } else { (32, "") };
    in_pod(ns, pod, &format!("ip addr add {ip}/{prefix} dev eth0{flags}"));
}

/// Every attack of a hostile pod on node-1 fails, in every family the
/// cluster gives pods, while what policy allows keeps working. Pods live
/// in namespace `ns` (made here) and are deleted at the end.
pub fn attacks_fail(ns: &str) {
    namespace(ns, &[]);
    let net_admin: &[&str] = &["NET_ADMIN"];
    let pods = [
        ("victim", "node-1", &[("app", "victim")][..], &[][..]),
        ("attacker", "node-1", &[("app", "attacker")], net_admin),
        ("bystander", "node-1", &[("app", "bystander")], &[]),
        ("remote", "node-2", &[("app", "remote")], &[]),
    ];
    for (name, node, labels, capabilities) in pods {
        apply(&TestPod { namespace: ns, name, node, labels, capabilities, ..Default::default() }.yaml());
    }
    for (name, ..) in pods {
        wait_running(ns, name);
    }
    let ips = |pod| pod_ips(ns, pod);
    let (victim, attacker, bystander, remote) = (ips("victim"), ips("attacker"), ips("bystander"), ips("remote"));

    apply(&policies(ns));
    let reaches = |from: &str, ip: &str| http_hostname(ns, from, &format!("{}:{HTTP_PORT}", host(ip)));
    eventually("the policies to isolate the victim and the attacker", Duration::from_secs(60), || {
        let closed = victim.iter().all(|ip| reaches("remote", ip).is_none())
            && remote.iter().all(|ip| reaches("attacker", ip).is_none());
        closed.then_some(())
    });
    // What policy allows still flows: the victim and the bystander reach
    // out, others reach the attacker.
    for (i, remote_ip) in remote.iter().enumerate() {
        assert_eq!(reaches("victim", remote_ip).as_deref(), Some("remote"));
        assert_eq!(curl_hostname(ns, "bystander", remote_ip, &[]).as_deref(), Some("remote"));
        assert_eq!(reaches("remote", &attacker[i]).as_deref(), Some("attacker"));
    }

    // 1. IPv6 link-local to the victim, whose ingress is denied (every pod
    // has an fe80:: address, IPv4-only ones too).
    let mut attacks = Attacks::new(&format!("real nodes, namespace {ns}"));
    let victim_ll = format!("{}%eth0", link_local(ns, "victim"));
    link_local(ns, "attacker");
    assert_eq!(
        curl_hostname(ns, "victim", &victim_ll, &[]).as_deref(),
        Some("victim"),
        "the victim answers on its own link-local address"
    );
    let got = curl_hostname(ns, "attacker", &victim_ll, &[]);
    attacks.judge("1. link-local dial to a pod isolated for ingress", got.is_none(), || format!("{got:?} answered"));

    // 2. Egress deny-all escaped with an added address of the pod range,
    // and 3. with the address of a pod that policy lets out. The remote
    // node's connection tracking shows whether the first packet got there
    // (the answer to a stolen address goes to its owner, so TCP alone
    // would not tell).
    let mut port = 40_000;
    for (i, remote_ip) in remote.iter().enumerate() {
        for (attack, src) in [
            ("2. egress deny-all escaped with an added address", spare_address(&attacker[i])),
            ("3. egress deny-all escaped with another pod's address", bystander[i].clone()),
        ] {
            add_address(ns, "attacker", &src);
            port += 1;
            let got =
                curl_hostname(ns, "attacker", remote_ip, &["--interface", &src, "--local-port", &port.to_string()]);
            let tracked = tracked_on("node-2", &src, port);
            attacks.judge(&format!("{attack} ({src} to {remote_ip})"), got.is_none() && !tracked, || {
                format!("answered by {got:?}; node-2 tracked the connection: {tracked}")
            });
        }
    }
    // The attacker's own traffic that policy allows is untouched.
    for ip in &attacker {
        assert_eq!(reaches("remote", ip).as_deref(), Some("attacker"));
    }

    // 4. A new pod under the egress deny-all connects from its first moment:
    // its container starts right after weft-cni's ADD returns.
    apply(&early_pod(ns, &remote[0]));
    let log = eventually("the early pod's connection attempts", Duration::from_secs(120), || {
        let (ok, log) = kubectl(&["logs", "-n", ns, "early"]);
        (ok && log.contains("DONE")).then_some(log)
    });
    let tries: u32 =
        log.split_whitespace().skip_while(|w| *w != "DONE").nth(1).and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(tries > 0, "no connection attempt ran: {log}");
    attacks.judge(
        "4. a new pod under egress deny-all connects from its first moment",
        !log.contains("CONNECTED"),
        || log.clone(),
    );

    delete_pods(ns, &["victim", "attacker", "bystander", "remote", "early"]);
    kubectl_ok(&["delete", "networkpolicy", "-n", ns, "victim-deny-all", "attacker-no-egress"]);
    attacks.finish();
}

/// A pod labelled as the attacker whose only program tries `remote` over and
/// over for its first 5 seconds, then prints how many tries ran.
fn early_pod(ns: &str, remote: &str) -> String {
    let url = format!("http://{}:{HTTP_PORT}/hostname", host(remote));
    let script = format!(
        "n=0; end=$((SECONDS+5)); while ((SECONDS < end)); do n=$((n+1)); \
         if curl -sg --max-time 0.3 {url} >/dev/null; then echo CONNECTED $n; fi; done; echo DONE $n; exec sleep 3600"
    );
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: early, namespace: {ns}, labels: {{app: attacker}}}}
spec:
  nodeSelector: {{kubernetes.io/hostname: node-1}}
  terminationGracePeriodSeconds: 1
  containers:
  - name: early
    image: {image}
    imagePullPolicy: Never
    command: ["bash", "-c", {script}]
"#,
        image = super::workloads::AGNHOST_IMAGE,
        script = serde_json::to_string(&script).expect("a string serializes"),
    )
}
