//! The attachment path under faults, with weft-cni exec'd as a runtime does:
//! an agent restart with pods it cannot verify, weft-cni killed in the middle
//! of an ADD held up by a stuck program, ADD and DEL of one attachment racing,
//! readiness probed while the node's bridge is broken, and pod names crafted
//! to break out of a firewall rule. Every test creates its own namespaces and
//! removes them, also on failure.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};
use serde_json::{Value, json};
use weft_e2e::agent::Node;
use weft_e2e::cni::{self, Container, Weft};
use weft_e2e::netns::Netns;
use weft_e2e::{bins, prereq, wait};

fn metrics(n: &Node) -> String {
    String::from_utf8_lossy(&n.ns.exec("curl", &["-s", "http://127.0.0.1:9646/metrics"]).stdout).into_owned()
}

fn readyz(n: &Node) -> String {
    String::from_utf8_lossy(&n.ns.exec("curl", &["-s", "http://127.0.0.1:9646/readyz"]).stdout).into_owned()
}

fn mount(args: &[&str]) {
    let out = Command::new("mount").args(args).output().expect("mount");
    assert!(out.status.success(), "mount {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Makes a pod's namespace path unusable (an empty file where the namespace
/// was mounted) while a second mount keeps the namespace and its pod alive;
/// puts it back on drop.
struct Unreadable {
    path: String,
    keep: PathBuf,
}

impl Unreadable {
    fn new(pod: &Netns, dir: &Path) -> Self {
        let keep = dir.join(format!("keep-{}", pod.name()));
        File::create(&keep).expect("mount point");
        let path = pod.path();
        mount(&["--bind", &path, &keep.to_string_lossy()]);
        let it = Self { path, keep };
        mount(&["--make-private", &it.keep.to_string_lossy()]);
        let out = Command::new("umount").arg(&it.path).output().expect("umount");
        assert!(out.status.success(), "umount {}: {}", it.path, String::from_utf8_lossy(&out.stderr));
        it
    }
}

impl Drop for Unreadable {
    fn drop(&mut self) {
        let keep = self.keep.to_string_lossy().into_owned();
        let _ = Command::new("mount").args(["--bind", &keep, &self.path]).output();
        let _ = Command::new("umount").arg(&keep).output();
    }
}

#[test]
fn a_restart_keeps_pods_it_cannot_verify_and_releases_those_gone() {
    let Some(mut n) = Node::start("keep", "10.214.0.0/24") else { return };
    if !prereq::require("curl", prereq::have("curl")) {
        return;
    }
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let (vpn, hidden, gone) = (Netns::new("pod"), Netns::new("pod"), Netns::new("pod"));
    let ips: Vec<String> = [("vpn1", &vpn), ("hidden1", &hidden), ("gone1", &gone)]
        .iter()
        .map(|(id, pod)| cni::pod_ip(&weft.add(&Container::new(*id, pod)).assert_ok().json()))
        .collect();

    // An in-pod VPN replaces the default route through Weft's gateway.
    vpn.ip(&["link", "add", "vpn0", "type", "veth", "peer", "name", "vpn1"]);
    vpn.ip(&["link", "set", "vpn0", "up"]);
    vpn.ip(&["addr", "add", "172.31.0.2/24", "dev", "vpn0"]);
    vpn.ip(&["route", "replace", "default", "via", "172.31.0.1", "dev", "vpn0"]);
    // The agent cannot enter this pod's namespace, which still runs.
    let _hidden = Unreadable::new(&hidden, n.dir.path());
    // This pod is gone: its namespace, and with it both ends of its veth.
    drop(gone);

    n.agent.restart(&n.ns);
    let records = n.agent.ipam_records();
    assert!(records.contains(&ips[0]) && records.contains(&ips[1]), "kept pods lost their records: {records:?}");
    assert!(!records.contains(&ips[2]), "the gone pod's address was not released: {records:?}");
    assert_eq!(n.veths().len(), 2, "{:?}", n.veths());
    assert!(n.ns.ping(&ips[0]) && n.ns.ping(&ips[1]), "a kept pod is unreachable after the restart");
    let log = n.agent.log_text();
    assert_eq!(log.matches("keeping an attachment that could not be verified").count(), 2, "{log}");
    assert!(log.contains("no default route via 10.214.0.1"), "{log}");
    let m = metrics(&n);
    assert!(m.contains("weft_agent_attachments_unverified 2"), "{m}");
    assert!(m.contains("weft_agent_ipam_released_on_start_total 1"), "{m}");
}

/// A stand-in for `program` that waits while the test holds a lock (as a
/// program stuck behind a slow kernel or another writer), then runs the
/// real one.
fn held(dir: &Path, program: &str) -> (PathBuf, PathBuf) {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("bin dir");
    let lock = dir.join("hold");
    File::create(&lock).expect("lock file");
    let found = Command::new("sh").args(["-c", &format!("command -v {program}")]).output().expect("sh");
    let real = String::from_utf8_lossy(&found.stdout).trim().to_owned();
    assert!(!real.is_empty(), "{program} is not installed");
    let script = format!(
        "#!/bin/sh\ntouch '{lock}.waiting'\nflock '{lock}' true\nexec '{real}' \"$@\"\n",
        lock = lock.display()
    );
    let path = bin.join(program);
    std::fs::write(&path, script).expect("script");
    let out = Command::new("chmod").args(["755", &path.to_string_lossy()]).output().expect("chmod");
    assert!(out.status.success());
    (bin, lock)
}

fn with_host_port(conf: &Value, host_port: u16, protocol: &str) -> Value {
    let mut c = conf.clone();
    c["capabilities"] = json!({"portMappings": true});
    c["runtimeConfig"] = json!({"portMappings": [{"hostPort": host_port, "containerPort": 80, "protocol": protocol}]});
    c
}

#[test]
fn an_add_whose_weft_cni_is_killed_finishes_and_gc_leaves_nothing() {
    if !prereq::require("flock (util-linux)", prereq::have("flock")) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    // A UDP host port's ADD flushes the port's conntrack entries with the
    // `conntrack` program after programming the DNAT (over netlink): that
    // is where the ADD is held.
    let (bin, lock) = held(dir.path(), "conntrack");
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let Some(n) = Node::start_with("abandon", "10.215.0.0/24", &[], &[("PATH", &path)]) else { return };
    let mut weft = Weft::new(&n.ns, &n.agent.socket);
    weft.conf = with_host_port(&weft.conf, 18090, "udp");
    let pod = Netns::new("pod");
    let c = Container::new("abandon1", &pod);

    // The agent's first host port sync (its chains) is done: the node is
    // ready for host ports.
    let table = || String::from_utf8_lossy(&n.ns.exec("nft", &["list", "table", "inet", "weft"]).stdout).into_owned();
    wait::until("the agent's first host port sync", Duration::from_secs(20), || {
        table().contains("chain hostport-prerouting").then_some(())
    });
    // Hold the lock, start the ADD, and kill weft-cni once the agent has
    // reserved its address and its conntrack waits.
    let waiting = PathBuf::from(format!("{}.waiting", lock.display()));
    let _ = std::fs::remove_file(&waiting);
    let held = Flock::lock(File::open(&lock).expect("lock"), FlockArg::LockExclusive).expect("flock");
    let mut add = cni::spawn(&n.ns, &weft.plugin, "ADD", &c, &weft.conf);
    let ip = wait::until("the ADD to reach conntrack", Duration::from_secs(20), || {
        if waiting.exists() { n.agent.ipam_records().pop() } else { None }
    });
    add.kill().expect("kill weft-cni");
    let status = add.wait().expect("reap weft-cni");
    assert!(!status.success());
    drop(held);

    // The agent finishes the abandoned ADD on its own. CHECK takes its turn
    // after it, so it answers only then, and sees a finished attachment.
    let prev = json!({"cniVersion": "1.1.0", "ips": [{"address": format!("{ip}/24")}]});
    weft.check(&c, &prev).assert_ok();

    // The runtime never saw it succeed, so GC lists nothing: all of it goes.
    weft.gc(&[]).assert_ok();
    assert!(n.agent.ipam_records().is_empty(), "records left: {:?}", n.agent.ipam_records());
    assert!(n.veths().is_empty(), "veths left: {:?}", n.veths());
    let table = table();
    assert!(!table.contains("hostport-udp-18090"), "host port rules left:\n{table}");
}

#[test]
fn racing_add_and_del_of_one_attachment_always_ends_consistent() {
    let Some(n) = Node::start("race", "10.216.0.0/24") else { return };
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let pod = Netns::new("pod");
    let c = Container::new("race1", &pod);
    for round in 0..1000 {
        let (add, del) = std::thread::scope(|s| {
            let add = s.spawn(|| weft.add(&c));
            let del = s.spawn(|| weft.del(&c, None));
            (add.join().expect("ADD thread"), del.join().expect("DEL thread"))
        });
        del.assert_ok();
        // Whichever came second decided: all of the attachment, or none of it.
        let (records, veths) = (n.agent.ipam_records(), n.veths());
        let in_pod = pod.links().contains(&"eth0".to_owned());
        let whole = records.len() == 1 && veths.len() == 1 && in_pod;
        let none = records.is_empty() && veths.is_empty() && !in_pod;
        assert!(
            whole || none,
            "round {round}: ADD ok={} records {records:?} veths {veths:?} eth0 in pod={in_pod}",
            add.success
        );
        if whole {
            assert!(add.success, "round {round}: an attachment exists but its ADD failed: {}", add.stdout);
        }
        weft.del(&c, None).assert_ok();
    }
    assert!(n.agent.ipam_records().is_empty() && n.veths().is_empty());
}

#[test]
fn readiness_only_observes_and_the_repair_loop_repairs() {
    // A resync period far beyond this test: nothing but readiness runs.
    let Some(mut n) = Node::start_with("ready", "10.217.0.0/24", &["--resync-seconds", "3600"], &[]) else { return };
    if !prereq::require("curl", prereq::have("curl")) {
        return;
    }
    let weft = Weft::new(&n.ns, &n.agent.socket);
    assert_eq!(readyz(&n), "ready");
    n.ns.ip(&["link", "del", "weft0"]);
    for _ in 0..20 {
        let r = readyz(&n);
        assert!(r.contains("not ready") && r.contains("bridge weft0 is missing"), "{r}");
        let status = weft.status();
        assert_eq!(status.code(), 50, "{}", status.stdout);
    }
    assert!(!n.ns.links().contains(&"weft0".to_owned()), "a health check recreated the bridge");

    // The repair loop puts it back, with the gateway address.
    n.agent.stop();
    n.agent = weft_e2e::agent::Agent::start_with(&n.ns, "10.217.0.0/24", n.dir.path(), &["--resync-seconds", "1"]);
    n.ns.ip(&["link", "del", "weft0"]);
    wait::until("the repair loop to recreate weft0", Duration::from_secs(15), || (readyz(&n) == "ready").then_some(()));
    assert!(n.ns.ip(&["-o", "addr", "show", "weft0"]).contains("10.217.0.1/24"));
}

#[test]
fn pod_names_that_could_break_a_rule_are_refused_before_anything_is_written() {
    let Some(n) = Node::start("names", "10.218.0.0/24") else { return };
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let pod = Netns::new("pod");
    let conf = with_host_port(&weft.conf, 18091, "tcp");
    let netns = pod.path();
    let env = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "names1"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_NETNS", netns.as_str()),
        ("CNI_ARGS", "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web\" -j ACCEPT\n-A INPUT -j ACCEPT"),
    ];
    let out = cni::exec_raw(&n.ns, &bins::weft("weft-cni"), &env, conf.to_string().as_bytes());
    assert_eq!(out.code(), 4, "{}", out.stdout);
    assert!(out.msg().contains("K8S_POD_NAME") && out.msg().contains("DNS-1123"), "{}", out.msg());
    assert!(n.agent.ipam_records().is_empty() && n.veths().is_empty());
    let table = String::from_utf8_lossy(&n.ns.exec("nft", &["list", "ruleset"]).stdout).into_owned();
    assert!(!table.contains("18091") && !table.contains("-A INPUT"), "{table}");
}
