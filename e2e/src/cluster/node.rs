//! One real node: a network namespace on the underlay, a mount namespace with
//! the node's own directories over the host paths, cgroups of its own, and
//! containerd, kubelet and kube-proxy started inside all three.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::families::Families;
use super::{CGROUP_PARENT, CP_IP, NodeInfo, UNDERLAY_NS, configs, state_dir};
use crate::control_plane::process::spawn_detached;
use crate::sandbox::ip;

/// Host paths that are per node, and the directory under the node's own
/// directory bound over each. The chart's hostPaths are among them.
pub const NODE_PATHS: &[(&str, &str)] = &[
    ("/opt/cni/bin", "opt-cni-bin"),
    ("/etc/cni/net.d", "etc-cni-net.d"),
    ("/run/weft", "run-weft"),
    ("/var/lib/weft", "var-lib-weft"),
    ("/var/lib/kubelet", "var-lib-kubelet"),
    ("/var/lib/containerd", "var-lib-containerd"),
    ("/run/containerd", "run-containerd"),
    ("/var/log/pods", "var-log-pods"),
    ("/var/log/containers", "var-log-containers"),
    ("/run/netns", "run-netns"),
];

/// The node daemons, in start order.
pub const DAEMONS: &[&str] = &["containerd", "kubelet", "kube-proxy"];

/// Where a node-local host path lives on the host, outside the node.
pub fn host_view(node: &NodeInfo, path: &str) -> anyhow::Result<PathBuf> {
    let (prefix, sub) = NODE_PATHS
        .iter()
        .find(|(p, _)| path == *p || path.starts_with(&format!("{p}/")))
        .with_context(|| format!("{path} is not a per-node path"))?;
    Ok(node.dir().join(sub).join(path.trim_start_matches(prefix).trim_start_matches('/')))
}

/// A command run inside the node: its network and mount namespaces, its
/// pids cgroup (so that tearing the node down finds every process).
pub fn command(node: &NodeInfo, program: &Path) -> Command {
    let procs = cgroup_dir("pids", &node.cgroup()).join("daemons/cgroup.procs");
    let mut c = Command::new("sh");
    c.arg("-ec")
        .arg(r#"echo $$ > "$1"; net=$2; mnt=$3; uts=$4; shift 4; exec nsenter --net="$net" --mount="$mnt" --uts="$uts" -- "$@""#)
        .arg("sh")
        .arg(procs)
        .arg(format!("/run/netns/{}", node.netns))
        .arg(node.mount_ns())
        .arg(node.uts_ns())
        .arg(program);
    c
}

fn cgroup_root() -> PathBuf {
    PathBuf::from("/sys/fs/cgroup")
}

fn cgroup_dir(controller: &str, rel: &str) -> PathBuf {
    cgroup_root().join(controller).join(rel)
}

/// The cgroup v1 hierarchies mounted here (directories, not the
/// `cpu,cpuacct`-style links to them).
fn controllers() -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(cgroup_root()) else { return Vec::new() };
    let mut out: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()) && e.path().join("cgroup.procs").exists())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    out.sort();
    out
}

/// Creates the node's cgroup under every hierarchy (kubelet wants its
/// `cgroupRoot` to exist everywhere; cpuset needs its CPUs and memory
/// nodes filled in at each level) and the pids group of its daemons.
fn create_cgroups(node: &NodeInfo) -> anyhow::Result<()> {
    let rel = node.cgroup();
    for controller in controllers() {
        let mut dir = cgroup_root().join(&controller);
        for part in rel.split('/') {
            let parent = dir.clone();
            dir = dir.join(part);
            if !dir.exists() {
                std::fs::create_dir(&dir).with_context(|| format!("creating cgroup {}", dir.display()))?;
            }
            if controller == "cpuset" {
                for f in ["cpuset.cpus", "cpuset.mems"] {
                    let value = std::fs::read_to_string(parent.join(f)).unwrap_or_default();
                    std::fs::write(dir.join(f), value.trim())
                        .with_context(|| format!("writing {}", dir.join(f).display()))?;
                }
            }
        }
    }
    let daemons = cgroup_dir("pids", &rel).join("daemons");
    std::fs::create_dir_all(&daemons).with_context(|| format!("creating {}", daemons.display()))?;
    Ok(())
}

/// Every process in the node's pids cgroup tree (daemons, shims, containers).
fn processes(node: &NodeInfo) -> Vec<i32> {
    fn walk(dir: &Path, out: &mut Vec<i32>) {
        if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            out.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
        }
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.filter_map(Result::ok) {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    walk(&e.path(), out);
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(&cgroup_dir("pids", &node.cgroup()), &mut out);
    out
}

/// Pids of the node's processes named `comm` (containers included); the
/// pid namespace is the host's, so `pgrep` would find other nodes' too.
pub fn find_processes(node: &NodeInfo, comm: &str) -> Vec<i32> {
    processes(node)
        .into_iter()
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == comm))
        .collect()
}

/// Removes the node's cgroups, deepest first, under every hierarchy.
fn remove_cgroups(node: &NodeInfo) {
    fn rmdir_tree(dir: &Path) {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.filter_map(Result::ok) {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    rmdir_tree(&e.path());
                }
            }
        }
        let _ = std::fs::remove_dir(dir);
    }
    for controller in controllers() {
        rmdir_tree(&cgroup_dir(&controller, &node.cgroup()));
        // The parent goes with its last node.
        let _ = std::fs::remove_dir(cgroup_dir(&controller, CGROUP_PARENT));
    }
}

/// The directory holding mount-namespace files must be a private mount, or
/// binding a namespace onto a file in it is refused.
fn ensure_ns_dir() -> anyhow::Result<PathBuf> {
    let dir = state_dir().join("ns");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    if !is_mountpoint(&dir) {
        run("mount", &["--bind", path_str(&dir)?, path_str(&dir)?])?;
    }
    run("mount", &["--make-private", path_str(&dir)?])?;
    Ok(dir)
}

fn is_mountpoint(path: &Path) -> bool {
    Command::new("mountpoint").arg("-q").arg(path).status().is_ok_and(|s| s.success())
}

fn path_str(p: &Path) -> anyhow::Result<&str> {
    p.to_str().with_context(|| format!("{} is not UTF-8", p.display()))
}

/// Runs a program to completion, failing with its stderr.
pub fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program).args(args).output().with_context(|| format!("cannot run {program}"))?;
    if !out.status.success() {
        bail!("{program} {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Creates the node's namespaces, directories and cgroups (no processes).
pub fn create(node: &NodeInfo) -> anyhow::Result<()> {
    crate::sandbox::nodes::attach_to_bridge(UNDERLAY_NS, &node.netns, &format!("n{}", node.index), node.ip)?;
    // Service IPs are routed before kube-proxy's DNAT sees them, so a node
    // needs a default route. Nothing behind it forwards: traffic stays here.
    ip(&["-n", &node.netns, "route", "add", "default", "via", &CP_IP.to_string()])?;
    let cp6 = crate::sandbox::node_ipv6(CP_IP).to_string();
    ip(&["-n", &node.netns, "-6", "route", "add", "default", "via", &cp6])?;

    let ns_dir = ensure_ns_dir()?;
    let ns_file = ns_dir.join(&node.name);
    std::fs::write(&ns_file, b"").with_context(|| format!("creating {}", ns_file.display()))?;
    run("unshare", &[&format!("--mount={}", path_str(&ns_file)?), "--propagation", "slave", "true"])?;
    let uts_file = node.uts_ns();
    std::fs::write(&uts_file, b"").with_context(|| format!("creating {}", uts_file.display()))?;
    run("unshare", &[&format!("--uts={}", path_str(&uts_file)?), "hostname", &node.name])?;

    let mut script = String::from("set -e\n");
    for (host, sub) in NODE_PATHS {
        let own = node.dir().join(sub);
        std::fs::create_dir_all(&own).with_context(|| format!("creating {}", own.display()))?;
        // The mount point must exist on the host; it stays empty there.
        std::fs::create_dir_all(host).with_context(|| format!("creating mount point {host}"))?;
        // Shared within the node, as on a systemd host: mounts made later
        // (containerd's pod network namespaces under /run/netns, kubelet's
        // volumes) must reach containers that mount these paths, such as
        // the agent's HostToContainer /run/netns. Slave to the host, so
        // nothing propagates back.
        script.push_str(&format!("mount --bind '{}' '{host}'\nmount --make-rshared '{host}'\n", path_str(&own)?));
    }
    let out = Command::new("nsenter")
        .arg(format!("--mount={}", ns_file.display()))
        .args(["--", "sh", "-c", &script])
        .output()
        .context("cannot run nsenter")?;
    if !out.status.success() {
        bail!("setting up {}'s mounts failed: {}", node.name, String::from_utf8_lossy(&out.stderr).trim());
    }
    create_cgroups(node)?;
    std::fs::create_dir_all(node.dir().join("logs"))?;
    Ok(())
}

/// Starts one daemon of the node detached (its pid in the node's directory).
pub fn start_daemon(node: &NodeInfo, name: &str, program: &Path, args: &[String]) -> anyhow::Result<u32> {
    let mut cmd = command(node, program);
    cmd.args(args);
    let tools = crate::control_plane::tools_dir();
    cmd.env("PATH", format!("{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", tools.display()));
    let pid = spawn_detached(cmd, &node.dir().join("logs").join(format!("{name}.log")))?.id();
    std::fs::write(node.dir().join(format!("{name}.pid")), pid.to_string())?;
    std::fs::write(node.dir().join(format!("{name}.cmd.json")), serde_json::to_vec(&(program, args))?)?;
    Ok(pid)
}

/// Pid of a daemon the node started, if it still runs.
pub fn daemon_pid(node: &NodeInfo, name: &str) -> Option<i32> {
    let pid = std::fs::read_to_string(node.dir().join(format!("{name}.pid"))).ok()?.trim().parse::<i32>().ok()?;
    crate::supervisor::running(pid).then_some(pid)
}

/// Stops a daemon: SIGTERM, then SIGKILL after `grace`.
pub fn stop_daemon(node: &NodeInfo, name: &str, grace: Duration) {
    let Some(pid) = daemon_pid(node, name) else { return };
    // SAFETY: plain kill(2) of a process we started.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = Instant::now() + grace;
    while daemon_pid(node, name).is_some() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

/// Waits for a file (a socket) to appear inside the node, failing early when
/// the daemon that should make it has exited.
pub fn wait_for_path(node: &NodeInfo, path: &str, daemon: &str, timeout: Duration) -> anyhow::Result<()> {
    let on_host = host_view(node, path)?;
    let deadline = Instant::now() + timeout;
    while !on_host.exists() {
        if daemon_pid(node, daemon).is_none() {
            bail!(
                "{daemon} on {} exited; its log:\n{}",
                node.name,
                crate::control_plane::process::log_tail(&node.dir().join("logs").join(format!("{daemon}.log")), 4000)
            );
        }
        if Instant::now() > deadline {
            bail!("{path} did not appear on {} within {timeout:?}", node.name);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Starts the node's containerd.
pub fn start_containerd(node: &NodeInfo) -> anyhow::Result<()> {
    let tools = crate::control_plane::tools_dir();
    let config = node.dir().join("containerd.toml");
    std::fs::write(&config, configs::containerd_toml())?;
    start_daemon(node, "containerd", &tools.join("containerd"), &[format!("--config={}", config.display())])?;
    wait_for_path(node, configs::CONTAINERD_SOCKET, "containerd", Duration::from_secs(60))?;
    // The socket file appears a moment before containerd listens on it.
    let socket = host_view(node, configs::CONTAINERD_SOCKET)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = std::os::unix::net::UnixStream::connect(&socket) {
        if Instant::now() > deadline {
            bail!("{}'s containerd does not accept connections on {}: {e}", node.name, socket.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Gives the node's image whose name starts with `repo` (the one tag it
/// imported) each of the names in `aliases` it does not have yet, so that pods
/// naming another tag of the same repository run it. Returns the image aliased.
pub fn alias_image(node: &NodeInfo, repo: &str, aliases: &[String]) -> anyhow::Result<String> {
    let ctr = |args: &[&str]| -> anyhow::Result<String> {
        let out = command(node, &crate::control_plane::tools_dir().join("ctr"))
            .args(["--address", configs::CONTAINERD_SOCKET, "-n", "k8s.io", "images"])
            .args(args)
            .output()
            .context("cannot run ctr")?;
        if !out.status.success() {
            bail!("ctr images {} in {}: {}", args.join(" "), node.name, String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let names: Vec<String> = ctr(&["ls", "-q"])?.lines().map(str::to_owned).collect();
    let source = names
        .iter()
        .find(|n| n.starts_with(repo) && !aliases.contains(n))
        .with_context(|| format!("{} has no image {repo}*: is agnhost.tar imported?", node.name))?;
    for alias in aliases.iter().filter(|a| !names.contains(a)) {
        ctr(&["tag", source, alias])?;
    }
    Ok(source.clone())
}

/// Imports `images` into every node's containerd, the nodes side by side
/// (the bulk of a cluster's start).
pub fn import_images_everywhere(nodes: &[NodeInfo], images: &[PathBuf]) -> anyhow::Result<()> {
    std::thread::scope(|s| {
        let imports: Vec<_> = nodes.iter().map(|n| s.spawn(|| import_images(n, images))).collect();
        imports.into_iter().try_for_each(|h| h.join().map_err(|_| anyhow::anyhow!("an image import panicked"))?)
    })
}

/// Imports `images` (docker-archive tarballs) into the node's containerd
/// (Kubernetes namespace), each once: a marker file in the node's directory
/// remembers what was imported.
pub fn import_images(node: &NodeInfo, images: &[PathBuf]) -> anyhow::Result<()> {
    let tools = crate::control_plane::tools_dir();
    for image in images {
        let name = image.file_name().context("an image tarball without a file name")?.to_string_lossy();
        let marker = node.dir().join(format!("imported-{name}"));
        if marker.exists() {
            continue;
        }
        let out = command(node, &tools.join("ctr"))
            .args(["--address", configs::CONTAINERD_SOCKET, "-n", "k8s.io", "images", "import"])
            .arg(image)
            .output()
            .context("cannot run ctr")?;
        if !out.status.success() {
            bail!(
                "importing {} into {}'s containerd failed: {}",
                image.display(),
                node.name,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        std::fs::write(&marker, b"")?;
    }
    Ok(())
}

/// Where a node finds the apiserver and its credentials: the cluster CA and
/// the directory of the client certificates issued for kubelets and kube-proxy.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Credentials {
    pub server: String,
    pub ca: PathBuf,
    pub certs_dir: PathBuf,
}

/// Starts kubelet and kube-proxy with the node's credentials, with the node
/// addresses of the cluster's `families` (both in a dual-stack cluster, the
/// IPv6 one alone in an IPv6-only cluster).
pub fn start_kubelet_and_proxy(node: &NodeInfo, creds: &Credentials, families: &Families) -> anyhow::Result<()> {
    let tools = crate::control_plane::tools_dir();
    let dir = node.dir();
    let cert = |stem: &str| (creds.certs_dir.join(format!("{stem}.crt")), creds.certs_dir.join(format!("{stem}.key")));
    let (kubelet_cert, kubelet_key) = cert(&format!("kubelet-{}", node.name));
    let kubelet_kc = dir.join("kubelet.kubeconfig");
    let user = format!("system:node:{}", node.name);
    std::fs::write(
        &kubelet_kc,
        configs::cert_kubeconfig(&creds.server, &creds.ca, &user, &kubelet_cert, &kubelet_key),
    )?;
    let kubelet_cfg = dir.join("kubelet.yaml");
    std::fs::write(&kubelet_cfg, configs::kubelet_yaml(node, &creds.ca, families))?;
    let node_ips: Vec<String> = families.node_ips(node).iter().map(ToString::to_string).collect();
    start_daemon(
        node,
        "kubelet",
        &tools.join("kubelet"),
        &[
            format!("--config={}", kubelet_cfg.display()),
            format!("--kubeconfig={}", kubelet_kc.display()),
            format!("--hostname-override={}", node.name),
            format!("--node-ip={}", node_ips.join(",")),
            "--v=1".into(),
        ],
    )?;

    let (proxy_cert, proxy_key) = cert("kube-proxy");
    let proxy_kc = dir.join("kube-proxy.kubeconfig");
    std::fs::write(
        &proxy_kc,
        configs::cert_kubeconfig(&creds.server, &creds.ca, "system:kube-proxy", &proxy_cert, &proxy_key),
    )?;
    let proxy_cfg = dir.join("kube-proxy.yaml");
    let mode = configs::ProxyMode::from_env().map_err(|e| anyhow::anyhow!(e))?;
    std::fs::write(&proxy_cfg, configs::kube_proxy_yaml(node, &proxy_kc, mode, families))?;
    start_daemon(node, "kube-proxy", &tools.join("kube-proxy"), &[format!("--config={}", proxy_cfg.display())])?;
    Ok(())
}

/// Starts a daemon again with the program and flags it was first started with.
pub fn restart_daemon(node: &NodeInfo, name: &str) -> anyhow::Result<u32> {
    let path = node.dir().join(format!("{name}.cmd.json"));
    let text = std::fs::read_to_string(&path).with_context(|| format!("{name} never ran on {}", node.name))?;
    let (program, args): (PathBuf, Vec<String>) =
        serde_json::from_str(&text).with_context(|| format!("corrupt {}", path.display()))?;
    start_daemon(node, name, &program, &args)
}

/// Removes everything of the node: every process in its cgroups, its mount
/// namespace (and with it every mount its runtime made), cgroups, network
/// namespace and directories. Safe to call on a half-made node.
pub fn destroy(node: &NodeInfo) {
    for daemon in ["kubelet", "kube-proxy"] {
        stop_daemon(node, daemon, Duration::from_secs(5));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pids = processes(node);
        if pids.is_empty() || Instant::now() > deadline {
            break;
        }
        for pid in pids {
            // SAFETY: plain kill(2) of a process in the node's own cgroup.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for ns_file in [node.mount_ns(), node.uts_ns()] {
        if ns_file.exists() {
            let _ = Command::new("umount").arg(&ns_file).status();
            let _ = std::fs::remove_file(&ns_file);
        }
    }
    remove_cgroups(node);
    let _ = ip(&["netns", "del", &node.netns]);
    // Nothing of the node is mounted in this namespace (its mounts were
    // private to it), so this removes only its own files.
    let _ = Command::new("rm").args(["-rf", "--one-file-system"]).arg(node.dir()).status();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_paths_map_into_the_nodes_directory() {
        let n = NodeInfo::new(1);
        let p = host_view(&n, "/run/containerd/containerd.sock").unwrap();
        assert_eq!(p, n.dir().join("run-containerd/containerd.sock"));
        assert_eq!(host_view(&n, "/opt/cni/bin").unwrap(), n.dir().join("opt-cni-bin"));
        assert!(host_view(&n, "/etc/passwd").is_err());
        assert!(host_view(&n, "/run/weftx").is_err(), "a prefix of a name is not the path");
    }
}
