//! Timing CNI plugins the way a runtime execs them, for the benchmarks: a
//! copy of the bench binary runs inside the node's namespace (so no
//! `ip netns exec` overhead is measured) and execs a plugin, or a chain of
//! them with `prevResult` passed along, for ADD then DEL.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::bins;
use crate::netns::Netns;

/// What one measured ADD+DEL needs.
pub struct Case<'a> {
    pub node: &'a Netns,
    /// The plugin, or the directory of a chain's plugins (with `conf.plugins`).
    pub plugin: PathBuf,
    pub pod: &'a Netns,
    /// A network configuration, or a configuration list (`plugins`).
    pub conf: Value,
    /// CNI_ARGS, e.g. `K8S_POD_NAMESPACE=default;K8S_POD_NAME=web`.
    pub cni_args: String,
}

/// One ADD+DEL of `case`, measured by a copy of the running binary (which
/// must call [`inner_main`] for `--inner`) inside the node namespace.
pub fn measure(case: &Case) -> (Duration, Duration) {
    let me = std::env::current_exe().expect("current exe");
    let out = case
        .node
        .command(me)
        .arg("--inner")
        .arg(&case.plugin)
        .arg(case.pod.path())
        .arg(case.conf.to_string())
        .arg(&case.cni_args)
        .output()
        .expect("inner bench");
    assert!(out.status.success(), "inner bench failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let mut it = text.split_whitespace().map(|n| Duration::from_nanos(n.parse().expect("nanos")));
    (it.next().expect("add"), it.next().expect("del"))
}

/// The `--inner` side: ADD then DEL, printing both times in nanoseconds.
pub fn inner_main(args: &[String]) {
    let [plugin, netns, conf, cni_args] = args else { panic!("usage: --inner PLUGIN NETNS CONF CNI_ARGS") };
    let conf: Value = serde_json::from_str(conf).expect("conf JSON");
    let plugin = PathBuf::from(plugin);
    let started = Instant::now();
    let result = match conf["plugins"].as_array() {
        None => exec(&plugin, "ADD", netns, cni_args, &conf),
        Some(chain) => {
            let mut prev: Option<Value> = None;
            for p in chain {
                let c = chained(&conf, p, prev.as_ref());
                prev = Some(exec(&plugin.join(p["type"].as_str().expect("type")), "ADD", netns, cni_args, &c));
            }
            prev.unwrap_or_default()
        }
    };
    let add = started.elapsed();
    let started = Instant::now();
    match conf["plugins"].as_array() {
        None => {
            exec(&plugin, "DEL", netns, cni_args, &conf);
        }
        Some(chain) => {
            for p in chain.iter().rev() {
                let c = chained(&conf, p, Some(&result));
                exec(&plugin.join(p["type"].as_str().expect("type")), "DEL", netns, cni_args, &c);
            }
        }
    }
    println!("{} {}", add.as_nanos(), started.elapsed().as_nanos());
}

/// One plugin's configuration within a list, as a runtime builds it.
fn chained(list: &Value, plugin: &Value, prev: Option<&Value>) -> Value {
    let mut c = plugin.clone();
    c["name"] = list["name"].clone();
    c["cniVersion"] = list["cniVersion"].clone();
    if plugin["capabilities"]["portMappings"] == json!(true) {
        c["runtimeConfig"] = json!({"portMappings": list["runtimeConfig"]["portMappings"]});
    }
    if let Some(prev) = prev {
        c["prevResult"] = prev.clone();
    }
    c
}

fn exec(plugin: &Path, verb: &str, netns: &str, cni_args: &str, conf: &Value) -> Value {
    let cni_path =
        format!("{}:{}", plugin.parent().map(|p| p.display().to_string()).unwrap_or_default(), bins::REFERENCE_PLUGINS);
    let mut child = Command::new(plugin)
        .env_clear()
        .env("CNI_COMMAND", verb)
        .env("CNI_CONTAINERID", "benchcontainer")
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", &cni_path)
        .env("CNI_ARGS", cni_args)
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("exec {}: {e}", plugin.display()));
    child.stdin.take().expect("stdin").write_all(conf.to_string().as_bytes()).expect("stdin");
    let out = child.wait_with_output().expect("plugin");
    assert!(out.status.success(), "{verb} {} failed: {}", plugin.display(), String::from_utf8_lossy(&out.stdout));
    serde_json::from_slice(&out.stdout).unwrap_or_default()
}

/// ADD and DEL durations of many runs.
#[derive(Default)]
pub struct Samples {
    pub add: Series,
    pub del: Series,
}

impl Samples {
    pub fn push(&mut self, (add, del): (Duration, Duration)) {
        self.add.0.push(add);
        self.del.0.push(del);
    }
}

#[derive(Default)]
pub struct Series(pub Vec<Duration>);

impl Series {
    pub fn quantile(&self, q: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        v[((v.len() - 1) as f64 * q).round() as usize]
    }
    pub fn median(&self) -> Duration {
        self.quantile(0.5)
    }
    pub fn p95(&self) -> Duration {
        self.quantile(0.95)
    }
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Prints the usual table: one row per chain, then ratios of each chain to the last.
pub fn print_table(title: &str, rows: &[(&str, &Samples)]) {
    println!("\n{title}\n");
    println!("| chain | ADD median | ADD p95 | DEL median | DEL p95 |");
    println!("|---|---:|---:|---:|---:|");
    for (name, s) in rows {
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} |",
            ms(s.add.median()),
            ms(s.add.p95()),
            ms(s.del.median()),
            ms(s.del.p95())
        );
    }
    let Some((ref_name, reference)) = rows.last() else { return };
    for (name, s) in &rows[..rows.len() - 1] {
        println!(
            "| ratio {name} / {ref_name} | {:.2} | {:.2} | {:.2} | {:.2} |",
            ms(s.add.median()) / ms(reference.add.median()),
            ms(s.add.p95()) / ms(reference.add.p95()),
            ms(s.del.median()) / ms(reference.del.median()),
            ms(s.del.p95()) / ms(reference.del.p95()),
        );
    }
}
