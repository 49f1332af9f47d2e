//! Host ports against a real nat table, in a throwaway network namespace:
//! what ADD/DEL/sync write, and (ignored, a benchmark) programming 1,000
//! allocations. Needs root; fails under CI=true without it.

use std::fs::File;
use std::process::Command;
use std::time::Instant;

use nix::sched::{CloneFlags, setns};
use weft_api::Protocol;

use super::{HostPorts, PodIdentity, Wanted, rules};
use crate::ipam::Key;
use crate::test_support::require_root;

/// A namespace removed on drop.
struct Ns(String);

impl Ns {
    fn new(tag: &str) -> Self {
        let name = format!("whp-{tag}-{}", std::process::id());
        let ok = Command::new("ip").args(["netns", "add", &name]).status().is_ok_and(|s| s.success());
        assert!(ok, "cannot create netns {name}");
        Ns(name)
    }

    fn nat(&self) -> String {
        let out = Command::new("ip").args(["netns", "exec", &self.0, "iptables-save", "-t", "nat"]).output();
        String::from_utf8_lossy(&out.expect("iptables-save").stdout).into_owned()
    }

    /// Runs `f` on a multi-threaded runtime whose threads all live in the namespace.
    fn run<T: Send + 'static>(&self, f: impl AsyncFnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let file = File::open(&path).expect("open netns");
            // If this fails the thread stops here, never acting on the root namespace.
            setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
            // Threads inherit the namespace of the thread that creates them.
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
            rt.block_on(f())
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

fn key(i: usize) -> Key {
    Key { container_id: format!("c{i:04}"), ifname: "eth0".into() }
}

fn pod(i: usize) -> PodIdentity {
    PodIdentity { namespace: "default".into(), name: format!("p{i}"), uid: String::new() }
}

fn auto(protocol: Protocol, port: u16) -> Wanted {
    Wanted { protocol, container_port: port, host_port: None, host_ip: None, name: None }
}

#[test]
fn add_release_and_sync_write_exactly_our_rules() {
    if !require_root() {
        return;
    }
    let ns = Ns::new("rules");
    ns.run(async move || {
        let hp = HostPorts::new("20000-20099".parse().unwrap(), "10.244.1.0/24".parse().unwrap(), vec![]);
        // Someone else's rules, there before us.
        let foreign = "*nat\n:OTHER - [0:0]\n-A PREROUTING -j OTHER\n-A OTHER -p tcp --dport 20000 -j RETURN\nCOMMIT\n";
        crate::dataplane::iptables::restore(foreign).unwrap();
        hp.sync().await.unwrap();
        let ip = "10.244.1.5".parse().unwrap();
        let a = hp.reserve(&key(1), &pod(1), ip, &[auto(Protocol::Tcp, 80), auto(Protocol::Udp, 53)]).unwrap();
        hp.program(a.as_ref()).await.unwrap();
        let a = a.unwrap();
        assert_eq!(a.ports.len(), 2);
        hp.check(&key(1)).await.unwrap();
        // Converged: a sync writes nothing.
        assert!(!hp.sync().await.unwrap());
        // A flushed chain is rewritten; CHECK notices before that.
        crate::dataplane::iptables::restore("*nat\n:WEFT-HOSTPORTS - [0:0]\nCOMMIT\n").unwrap();
        assert!(hp.check(&key(1)).await.unwrap_err().contains("host port rule missing"));
        assert!(hp.sync().await.unwrap());
        hp.release(&key(1)).await.unwrap();
        hp.release(&key(1)).await.unwrap();
        assert!(hp.all().is_empty());
    });
    let nat = ns.nat();
    assert!(
        nat.contains("-A PREROUTING -j OTHER") && nat.contains("-A OTHER -p tcp -m tcp --dport 20000 -j RETURN"),
        "{nat}"
    );
    assert!(!nat.contains("-A WEFT-HOSTPORTS "), "rules left after release:\n{nat}");
    assert_eq!(nat.matches("-j WEFT-HOSTPORTS\n").count(), 2, "one jump each from PREROUTING and OUTPUT:\n{nat}");
}

#[test]
fn names_over_the_comment_limit_are_written_and_converge() {
    if !require_root() {
        return;
    }
    let ns = Ns::new("long");
    ns.run(async move || {
        let hp = HostPorts::new("20000-20099".parse().unwrap(), "10.244.1.0/24".parse().unwrap(), vec![]);
        // The longest names Kubernetes allows: 63 + 253 characters.
        let long = PodIdentity { namespace: "n".repeat(63), name: "p".repeat(253), uid: String::new() };
        let a = hp.reserve(&key(1), &long, "10.244.1.5".parse().unwrap(), &[auto(Protocol::Tcp, 80)]).unwrap();
        hp.program(a.as_ref()).await.unwrap();
        hp.check(&key(1)).await.unwrap();
        assert!(!hp.sync().await.unwrap(), "a sync after the ADD rewrote the rules: the comment does not converge");
    });
    let nat = ns.nat();
    assert_eq!(nat.matches("--comment \"weft: nnn").count(), 2, "{nat}");
}

/// Benchmark: `cargo test -p weft-agent --release thousand_host_port -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark; run explicitly"]
fn thousand_host_port_allocations() {
    if !require_root() {
        return;
    }
    let ns = Ns::new("bench");
    let (adds, full, one, releases, rules_count) = ns.run(async move || {
        let hp = HostPorts::new("20000-29999".parse().unwrap(), "10.244.0.0/16".parse().unwrap(), vec![]);
        hp.sync().await.unwrap();
        let started = Instant::now();
        for i in 0..1000 {
            let ip = std::net::Ipv4Addr::from(0x0af4_0000u32 + i as u32 + 2);
            let a = hp.reserve(&key(i), &pod(i), ip, &[auto(Protocol::Tcp, 80)]).unwrap();
            hp.program(a.as_ref()).await.unwrap();
        }
        let adds = started.elapsed();
        // A restart on an empty table: one full sync programs everything.
        crate::dataplane::iptables::restore("*nat\n:WEFT-HOSTPORTS - [0:0]\nCOMMIT\n").unwrap();
        let started = Instant::now();
        assert!(hp.sync().await.unwrap());
        let full = started.elapsed();
        let started = Instant::now();
        let a =
            hp.reserve(&key(5000), &pod(5000), "10.244.200.1".parse().unwrap(), &[auto(Protocol::Tcp, 80)]).unwrap();
        hp.program(a.as_ref()).await.unwrap();
        let one = started.elapsed();
        let saved = rules::parse_save(&crate::dataplane::iptables::save("nat").unwrap());
        let rules_count = saved.chain.map(|c| c.len()).unwrap_or_default();
        let started = Instant::now();
        for i in 0..1000 {
            hp.release(&key(i)).await.unwrap();
        }
        (adds, full, one, started.elapsed(), rules_count)
    });
    println!("\nHost ports on one node (1,000 allocations of one TCP port each)\n");
    println!("| operation | total | per allocation |");
    println!("|---|---:|---:|");
    let row = |what: &str, d: std::time::Duration, n: u32| {
        println!("| {what} | {:.1} ms | {:.2} ms |", d.as_secs_f64() * 1e3, d.as_secs_f64() * 1e3 / f64::from(n));
    };
    row("1,000 allocations (ports taken + incremental iptables-restore each)", adds, 1000);
    row("full sync of 1,000 allocations (agent restart on an empty table)", full, 1000);
    row("one more ADD with 1,000 in place", one, 1);
    row("1,000 releases (incremental delete each)", releases, 1000);
    println!("\nrules in WEFT-HOSTPORTS: {rules_count}");
}
