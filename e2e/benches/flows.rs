//! What recording flows costs: the sandbox cluster's agent (one node, two
//! pods) with flow recording off and on (`--flows-capacity 4096`, the
//! chart's default), under 1,000 and 10,000 new TCP connections a second
//! from one pod to the other: the agent's CPU (share of one core) and RSS,
//! the share of connections recorded, and pod-to-pod throughput (iperf3).
//! Same run, same machine: the off column is the baseline.
//!
//! Run with `cargo bench -p weft-e2e --bench flows` after
//! `cargo build --release --workspace --bins` and with
//! `WEFT_BIN_DIR=target/release` (a debug agent measures the debug build).
//! `WEFT_FLOWS_SECONDS` sets each rate's duration and each iperf3 run's
//! (default 5); `WEFT_FLOWS_IPERF_RUNS` the iperf3 runs per column (default
//! 3; the table gives their median and range).

use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use weft_e2e::sandbox::testing::{Up, ok, pod_ip};
use weft_e2e::sandbox::{self, NS_PREFIX, State};
use weft_e2e::supervisor::StateFile;

const PORT: u16 = 7000;
const RATES: [u64; 2] = [1_000, 10_000];

/// Runs `f` on a thread in network namespace `ns`.
fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> std::thread::JoinHandle<T> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).expect("open netns");
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        f()
    })
}

fn pod_ns(name: &str) -> String {
    format!("{NS_PREFIX}pod-default-{name}")
}

/// The agent's CPU time so far (user + system), in clock ticks, and its RSS in MiB.
fn agent_usage(pid: i32) -> (u64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("agent stat");
    let after = &stat[stat.rfind(')').expect("stat") + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("agent status");
    let rss_kib: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    (ticks, rss_kib / 1024.0)
}

/// A sample of the agent's metric `series` (0 when absent).
fn metric(node: &sandbox::NodeInfo, series: &str) -> f64 {
    let out = Command::new("ip")
        .args(["netns", "exec", &node.netns, "curl", "-sf", "-m", "5"])
        .arg(format!("http://{}:9646/metrics", node.ip))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().filter(|l| l.starts_with(series)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

/// Opens (and resets: no TIME_WAIT to run out of ports) `rate` connections
/// a second to `to` for `secs` from pod `a`; returns how many were made.
fn connections(rate: u64, secs: u64, to: SocketAddrV4) -> u64 {
    in_netns(&pod_ns("a"), move || {
        let start = Instant::now();
        let total = rate * secs;
        let mut made = 0;
        for i in 0..total {
            let due = start + Duration::from_nanos(i * 1_000_000_000 / rate);
            while Instant::now() < due {
                std::hint::spin_loop();
            }
            if let Ok(s) = TcpStream::connect_timeout(&to.into(), Duration::from_secs(1)) {
                let linger = libc::linger { l_onoff: 1, l_linger: 0 };
                let _ = nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Linger, &linger);
                made += 1;
            }
        }
        made
    })
    .join()
    .expect("client thread")
}

/// Pod-to-pod TCP throughput a -> b, in Gbit/s, measured `runs` times
/// against one server (the first run also waits for the server to listen).
fn throughput(b: Ipv4Addr, secs: u64, runs: usize) -> Vec<f64> {
    let mut server = Command::new("ip")
        .args(["netns", "exec", &pod_ns("b"), "iperf3", "-s", "-p", "5201"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("iperf3 server");
    let client = || {
        let out = Command::new("ip")
            .args(["netns", "exec", &pod_ns("a"), "iperf3", "-c", &b.to_string(), "-p", "5201", "-J", "-t"])
            .arg(secs.to_string())
            .output()
            .ok()?;
        if !out.status.success() {
            eprintln!(
                "iperf3 client: {}",
                String::from_utf8_lossy(&out.stdout).lines().find(|l| l.contains("error")).unwrap_or("")
            );
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        Some(v["end"]["sum_received"]["bits_per_second"].as_f64()? / 1e9)
    };
    let first = weft_e2e::wait::until("iperf3 client to run", Duration::from_secs(10 + secs), client);
    let mut gbps = vec![first];
    for _ in 1..runs {
        gbps.push(client().expect("iperf3 client run"));
    }
    let _ = server.kill();
    let _ = server.wait();
    gbps
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Run {
    /// Per rate: made, agent CPU share of one core, RSS MiB, recorded.
    rates: Vec<(u64, u64, f64, f64, f64)>,
    /// Each iperf3 run's Gbit/s.
    gbps: Vec<f64>,
}

fn measure(flows: bool, secs: u64, iperf_runs: usize) -> Option<Run> {
    let mut args = vec!["--nodes", "1"];
    if flows {
        args.extend([
            "--agent-arg=--flows-capacity=4096",
            "--agent-arg=--policy-drop-log-group=100",
            "--agent-arg=--policy-drop-log-lines=false",
        ]);
    }
    let up = Up::start(&args, &[("iperf3", std::path::Path::new("/usr/bin/iperf3").is_file())])?;
    for pod in ["a", "b"] {
        ok(&["add-pod", pod, "--node", "node-1"]);
    }
    let state = State::load().expect("sandbox state");
    let node = state.node("node-1").expect("node-1").clone();
    let pid = sandbox::read_pid(&sandbox::state_dir().join("node-1").join("agent.pid")).expect("agent pid");
    let b: Ipv4Addr = pod_ip("default/b").parse().expect("b's address");
    let stop = Arc::new(AtomicBool::new(false));
    let serving = Arc::clone(&stop);
    let server = in_netns(&pod_ns("b"), move || {
        let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, PORT)).expect("listen");
        listener.set_nonblocking(true).expect("nonblocking");
        while !serving.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((s, _)) => drop(s),
                Err(_) => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    });
    let mut rates = Vec::new();
    for rate in RATES {
        let opened = || metric(&node, "weft_agent_flow_records_total{event=\"opened\"");
        let (before, (cpu0, _)) = (opened(), agent_usage(pid));
        let started = Instant::now();
        eprintln!("flows {}: {rate} connections/s for {secs} s", if flows { "on" } else { "off" });
        let made = connections(rate, secs, SocketAddrV4::new(b, PORT));
        let elapsed = started.elapsed().as_secs_f64();
        // Records come a little after the connections: wait for them (up to 3 s).
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut recorded = opened() - before;
        while flows && recorded < made as f64 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
            recorded = opened() - before;
        }
        let (cpu1, rss) = agent_usage(pid);
        let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100) as f64;
        let cpu = (cpu1 - cpu0) as f64 / ticks / elapsed;
        rates.push((rate, made, cpu, rss, recorded));
        // Let the reset connections' entries expire from the table's view of load.
        std::thread::sleep(Duration::from_secs(1));
    }
    stop.store(true, Ordering::Relaxed);
    server.join().expect("server thread");
    eprintln!("flows {}: iperf3", if flows { "on" } else { "off" });
    let gbps = throughput(b, secs, iperf_runs);
    drop(up);
    Some(Run { rates, gbps })
}

fn main() {
    let secs: u64 = std::env::var("WEFT_FLOWS_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    let runs: usize = std::env::var("WEFT_FLOWS_IPERF_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(3).max(1);
    let Some(off) = measure(false, secs, runs) else { return };
    let Some(on) = measure(true, secs, runs) else { return };
    println!("\n## Flow recording: agent cost and pod throughput ({secs} s per rate, one node, pod a -> pod b)\n");
    println!(
        "| new connections/s | made (off / on) | agent CPU off | agent CPU on | CPU on − off | RSS off / on (MiB) | recorded (on) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for (o, n) in off.rates.iter().zip(&on.rates) {
        println!(
            "| {} | {} / {} | {:.1} % | {:.1} % | {:+.1} pt | {:.0} / {:.0} | {:.1} % |",
            o.0,
            o.1,
            n.1,
            o.2 * 100.0,
            n.2 * 100.0,
            (n.2 - o.2) * 100.0,
            o.3,
            n.3,
            100.0 * n.4 / n.1.max(1) as f64
        );
    }
    let range = |v: &[f64]| {
        let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        format!("{lo:.2}–{hi:.2}")
    };
    println!("\n| pod-to-pod TCP (iperf3, {runs} runs of {secs} s each) | off | on | on / off |");
    println!("|---|---:|---:|---:|");
    let (m_off, m_on) = (median(off.gbps.clone()), median(on.gbps.clone()));
    println!("| Gbit/s, median | {m_off:.2} | {m_on:.2} | {:.3} |", m_on / m_off);
    println!("| Gbit/s, range | {} | {} | |", range(&off.gbps), range(&on.gbps));
}
