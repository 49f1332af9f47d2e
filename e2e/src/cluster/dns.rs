//! Cluster DNS: CoreDNS at the kube-dns Service's fixed address (kubelet's
//! clusterDNS), as kubeadm deploys it. `weft-conformance` deploys it before
//! the upstream suites, whose Service and DNS tests reach Services by name.
//! `e2e/cluster.sh up` does not yet: with CoreDNS on the nodes, the helm
//! upgrade step of `cluster_vxlan.rs` loses pings (an open Weft defect, see
//! docs/conformance.md).

use std::path::Path;
use std::process::Command;

use anyhow::Context;

use crate::control_plane;

/// The CoreDNS image (`e2e/scripts/build-images.sh coredns`, the version
/// build-tools.sh builds).
pub const COREDNS_IMAGE: &str = "registry.k8s.io/coredns/coredns:v1.13.1";

const MANIFEST: &str = include_str!("coredns.yaml");

/// The manifests, with the image and the Service address (kubelet's
/// clusterDNS) filled in.
pub fn manifest(cluster_ip: &str) -> String {
    MANIFEST.replace("{image}", COREDNS_IMAGE).replace("{cluster_ip}", cluster_ip)
}

fn kubectl(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> anyhow::Result<()> {
    use std::io::Write;
    let mut child = Command::new(control_plane::tools_dir().join("kubectl"))
        .env("KUBECONFIG", kubeconfig)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("cannot run kubectl")?;
    if let Some(text) = stdin {
        child.stdin.take().context("kubectl stdin")?.write_all(text.as_bytes())?;
    }
    drop(child.stdin.take());
    let out = child.wait_with_output()?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl {} failed: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Whether the cluster has a `kube-dns` Service (ours or another DNS).
pub fn deployed(kubeconfig: &Path) -> bool {
    kubectl(kubeconfig, &["get", "service", "-n", "kube-system", "kube-dns", "-o", "name"], None).is_ok()
}

/// Applies the manifests and waits (bounded by kubectl) until every CoreDNS
/// replica is ready.
/// `cluster_ip`: the Service's address, kubelet's clusterDNS.
pub fn deploy(kubeconfig: &Path, cluster_ip: &str) -> anyhow::Result<()> {
    kubectl(kubeconfig, &["apply", "-f", "-"], Some(&manifest(cluster_ip))).context("deploying CoreDNS")?;
    kubectl(kubeconfig, &["-n", "kube-system", "rollout", "status", "deployment/coredns", "--timeout=180s"], None)
        .context("waiting for CoreDNS to be ready")
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[test]
    fn the_manifest_is_complete_yaml_with_the_service_at_kubelets_dns_address() {
        let text = manifest(super::super::CLUSTER_DNS_IP);
        assert!(!text.contains("{image}") && !text.contains("{cluster_ip}"));
        let docs: Vec<serde_yaml::Value> =
            serde_yaml::Deserializer::from_str(&text).map(|d| serde_yaml::Value::deserialize(d).unwrap()).collect();
        let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
        assert_eq!(
            kinds,
            ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "Service"]
        );
        assert_eq!(docs[5]["spec"]["clusterIP"].as_str(), Some(super::super::CLUSTER_DNS_IP));
        assert_eq!(docs[4]["spec"]["template"]["spec"]["containers"][0]["image"].as_str(), Some(COREDNS_IMAGE));
    }
}
