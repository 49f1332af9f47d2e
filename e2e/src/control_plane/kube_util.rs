//! Small client-side helpers for tests against the control plane.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// A client from a kubeconfig file.
pub async fn client_from(kubeconfig: &Path) -> anyhow::Result<Client> {
    let kc = Kubeconfig::read_from(kubeconfig).with_context(|| format!("reading {}", kubeconfig.display()))?;
    let config =
        Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.context("loading kubeconfig")?;
    Client::try_from(config).context("building client")
}

/// A DNS-1123 name with `prefix` and a random suffix, unique per call.
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand::random::<u32>())
}

/// Creates a namespace with a unique name starting with `prefix`.
pub async fn new_namespace(client: &Client, prefix: &str) -> anyhow::Result<String> {
    let name = unique_name(prefix);
    let ns: Namespace = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}
    }))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .with_context(|| format!("creating namespace {name}"))?;
    Ok(name)
}

/// Directory of the generated CRD YAML files (`crds/` at the workspace root).
pub fn crds_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds")
}

/// The ClusterNetworkPolicy CRD as the chart vendors it (experimental
/// channel: every field), installed beside Weft's own.
pub fn cluster_network_policy_crd() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/weft/files/clusternetworkpolicies/experimental.yaml")
}

/// Applies every CRD file in `crds/` and the ClusterNetworkPolicy CRD
/// (server-side apply, so concurrent and repeated installs are harmless)
/// and waits until each is Established.
pub async fn install_crds(client: &Client) -> anyhow::Result<Vec<String>> {
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    let mut names = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(crds_dir())
        .context("reading crds/")?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    entries.sort();
    entries.push(cluster_network_policy_crd());
    for path in entries {
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let crd: CustomResourceDefinition =
            serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let name = crd.metadata.name.clone().context("CRD without a name")?;
        api.patch(&name, &PatchParams::apply("weft-e2e").force(), &Patch::Apply(&crd))
            .await
            .with_context(|| format!("applying {}", path.display()))?;
        names.push(name);
    }
    for name in &names {
        wait_for(Duration::from_secs(30), &format!("CRD {name} Established"), || async {
            let crd = api.get(name).await?;
            Ok(crd
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True"))
        })
        .await?;
    }
    Ok(names)
}

/// Waits until the apiserver no longer holds back creates of the CRDs
/// `names`' objects: it delays every create by 2 s while a CRD was
/// Established less than 2 s ago (kubernetes/kubernetes#99199, so that HA
/// apiservers agree). Benchmarks that time creates wait for this first: in
/// a cluster, Weft's CRDs are installed long before its objects are made.
pub async fn wait_until_crds_take_creates(client: &Client, names: &[String]) -> anyhow::Result<()> {
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    for name in names {
        let crd = api.get(name).await.with_context(|| format!("reading CRD {name}"))?;
        let established = crd
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "Established" && c.status == "True")
            .and_then(|c| c.last_transition_time)
            .with_context(|| format!("CRD {name} is not Established"))?;
        // The condition's time is whole seconds; the apiserver compares
        // against the same stored value. A little margin for the clocks'
        // reading order.
        let settled = established.0 + k8s_openapi::jiff::SignedDuration::from_millis(2_100);
        wait_for(Duration::from_secs(10), &format!("CRD {name} Established for 2 s"), || async {
            Ok(k8s_openapi::jiff::Timestamp::now() >= settled)
        })
        .await?;
    }
    Ok(())
}

/// Polls `check` until it returns `Ok(true)` or `timeout` passes. Errors from
/// `check` are retried and reported if the deadline passes.
pub async fn wait_for<F, Fut>(timeout: Duration, what: &str, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        match check().await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => last = format!(" (last error: {e:#})"),
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}{last}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether `node`'s Subnet among `subnets` is Ready with its peers programmed.
pub fn subnet_ready(subnets: &[weft_api::subnet::Subnet], node: &str) -> bool {
    subnets.iter().any(|s| {
        s.spec.node_name == node
            && s.status.as_ref().is_some_and(|st| {
                ["Ready", "PeersProgrammed"]
                    .iter()
                    .all(|t| st.conditions.iter().any(|c| c.type_ == *t && c.status == "True"))
            })
    })
}
