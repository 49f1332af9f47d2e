//! The CLI's access to the API: a client from the kubeconfig, and lists
//! read in pages (a large cluster's pods do not come in one answer).

use anyhow::Context;
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config, Resource};
use serde::de::DeserializeOwned;

/// Objects per page of a list.
const PAGE: u32 = 500;

/// A client from `kubeconfig` (else the usual places) and `context`.
pub async fn client(kubeconfig: Option<&std::path::Path>, context: Option<&str>) -> anyhow::Result<Client> {
    let options = KubeConfigOptions { context: context.map(str::to_owned), ..KubeConfigOptions::default() };
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &options).await.context("using the kubeconfig")?
        }
        None if context.is_some() => Config::from_kubeconfig(&options).await.context("using the kubeconfig")?,
        None => Config::infer().await.context("finding a kubeconfig (set --kubeconfig or KUBECONFIG)")?,
    };
    Client::try_from(config).context("creating a Kubernetes client")
}

/// Every object of `api`, page by page. `what` names them in errors.
pub async fn list_all<K>(api: &Api<K>, what: &str) -> anyhow::Result<Vec<K>>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut out = Vec::new();
    let mut params = ListParams::default().limit(PAGE);
    loop {
        let page = api.list(&params).await.with_context(|| format!("listing {what}"))?;
        out.extend(page.items);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(out),
        }
    }
}

/// Like [`list_all`], but a kind the API does not serve (its CRD not
/// installed) is an empty list.
pub async fn list_if_served<K>(api: &Api<K>, what: &str) -> anyhow::Result<Vec<K>>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    match api.list(&ListParams::default().limit(1)).await {
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Vec::new()),
        _ => list_all(api, what).await,
    }
}
