//! ADD+DEL latency of weft (weft-cni → weft-agent) against the reference
//! `bridge` + `host-local` chain, in the same run on the same machine.
//!
//! Run with `e2e/bench.sh cni` (builds release binaries first). Each plugin is
//! exec'd as a runtime does, from a process already inside the node's
//! namespace, so the figures contain no `ip netns exec` overhead. The two
//! plugins alternate every iteration so machine noise hits both alike.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use weft_e2e::agent::Agent;
use weft_e2e::bins;
use weft_e2e::netns::Netns;

const ITERATIONS: usize = 200;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--inner") {
        inner(&args[i + 1..]);
        return;
    }
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("cni_add_del needs root (network namespaces)");
        std::process::exit(1);
    }
    // SAFETY: setting an env var before any thread is spawned.
    if std::env::var_os("WEFT_BIN_DIR").is_none() {
        unsafe { std::env::set_var("WEFT_BIN_DIR", Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release")) };
    }
    let dir = tempfile::tempdir().expect("tempdir");

    let weft_node = Netns::new("bench-weft");
    let weft_pod = Netns::new("bench-wpod");
    let agent = Agent::start(&weft_node, "10.220.0.0/24", dir.path());
    let weft_conf = json!({"cniVersion": "1.0.0", "name": "weft", "type": "weft-cni", "agentSocket": agent.socket});

    let ref_node = Netns::new("bench-ref");
    let ref_pod = Netns::new("bench-rpod");
    let ref_conf = json!({
        "cniVersion": "1.0.0", "name": "refnet", "type": "bridge", "bridge": "cni0",
        "isGateway": true, "ipMasq": false,
        "ipam": {"type": "host-local", "subnet": "10.221.0.0/24", "dataDir": dir.path().join("host-local")},
    });

    let mut weft = Samples::default();
    let mut reference = Samples::default();
    for _ in 0..ITERATIONS {
        weft.push(run_inner(&weft_node, &bins::weft("weft-cni"), &weft_pod, &weft_conf));
        reference.push(run_inner(&ref_node, &bins::reference("bridge"), &ref_pod, &ref_conf));
    }
    drop(agent);

    println!("\nCNI ADD/DEL latency, {ITERATIONS} iterations each, alternating (ms)\n");
    println!("| chain               | ADD median | ADD p95 | DEL median | DEL p95 |");
    println!("|---------------------|-----------:|--------:|-----------:|--------:|");
    for (name, s) in [("weft", &weft), ("bridge + host-local", &reference)] {
        println!(
            "| {name:<19} | {:>10.2} | {:>7.2} | {:>10.2} | {:>7.2} |",
            ms(s.add.median()),
            ms(s.add.p95()),
            ms(s.del.median()),
            ms(s.del.p95())
        );
    }
    println!(
        "| ratio weft/ref      | {:>10.2} | {:>7.2} | {:>10.2} | {:>7.2} |",
        ms(weft.add.median()) / ms(reference.add.median()),
        ms(weft.add.p95()) / ms(reference.add.p95()),
        ms(weft.del.median()) / ms(reference.del.median()),
        ms(weft.del.p95()) / ms(reference.del.p95()),
    );
}

/// One ADD+DEL measured by a copy of this binary running inside `node`.
fn run_inner(node: &Netns, plugin: &Path, pod: &Netns, conf: &Value) -> (Duration, Duration) {
    let me = std::env::current_exe().expect("current exe");
    let out = node
        .command(me)
        .arg("--inner")
        .arg(plugin)
        .arg(pod.path())
        .arg(conf.to_string())
        .output()
        .expect("inner bench");
    assert!(out.status.success(), "inner bench failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let mut it = text.split_whitespace().map(|n| Duration::from_nanos(n.parse().expect("nanos")));
    (it.next().expect("add"), it.next().expect("del"))
}

/// Inside the node namespace: exec the plugin for ADD then DEL and print both times.
fn inner(args: &[String]) {
    let [plugin, netns, conf] = args else { panic!("usage: --inner PLUGIN NETNS CONF") };
    let plugin = PathBuf::from(plugin);
    let cni_path =
        format!("{}:{}", plugin.parent().map(|p| p.display().to_string()).unwrap_or_default(), bins::REFERENCE_PLUGINS);
    let exec = |verb: &str| {
        let started = Instant::now();
        let mut child = Command::new(&plugin)
            .env_clear()
            .env("CNI_COMMAND", verb)
            .env("CNI_CONTAINERID", "benchcontainer")
            .env("CNI_NETNS", netns)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", &cni_path)
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("exec plugin");
        child.stdin.take().expect("stdin").write_all(conf.as_bytes()).expect("stdin");
        let out = child.wait_with_output().expect("plugin");
        let elapsed = started.elapsed();
        assert!(out.status.success(), "{verb} failed: {}", String::from_utf8_lossy(&out.stdout));
        elapsed
    };
    let add = exec("ADD");
    let del = exec("DEL");
    println!("{} {}", add.as_nanos(), del.as_nanos());
}

#[derive(Default)]
struct Samples {
    add: Series,
    del: Series,
}

impl Samples {
    fn push(&mut self, (add, del): (Duration, Duration)) {
        self.add.0.push(add);
        self.del.0.push(del);
    }
}

#[derive(Default)]
struct Series(Vec<Duration>);

impl Series {
    fn quantile(&self, q: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        v[((v.len() - 1) as f64 * q).round() as usize]
    }
    fn median(&self) -> Duration {
        self.quantile(0.5)
    }
    fn p95(&self) -> Duration {
        self.quantile(0.95)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
