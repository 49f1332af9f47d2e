//! The agents' flows, asked of each over its TCP listener with the
//! operator's bound service account token (the agents accept no other).

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use tonic::transport::{Channel, Endpoint};
use weft_proto::flows::v1::flows_client::FlowsClient;
use weft_proto::flows::v1::{Filter, Flow, ListRequest};

use super::routes::{NodeAnswer, NodeCounts};

/// How long an agent may take to accept the connection, and to answer a list.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const LIST_TIMEOUT: Duration = Duration::from_secs(5);
/// Agents asked at once.
const FAN_OUT: usize = 32;

/// The `authorization` value the agents check.
type Token = tonic::metadata::MetadataValue<tonic::metadata::Ascii>;

/// One agent's records and counters, or why it did not answer.
type AgentAnswer = Result<(Vec<Flow>, NodeCounts), String>;

#[derive(Clone)]
pub struct Agents {
    pub pods: Api<Pod>,
    pub selector: String,
    pub port: u16,
    /// The projected token (audience flows.weft.dev), read at each use: the kubelet renews it.
    pub token_file: PathBuf,
}

/// One agent: its node, and where it listens.
#[derive(Debug, Clone)]
struct Agent {
    node: String,
    ip: IpAddr,
}

impl Agents {
    async fn find(&self) -> anyhow::Result<Vec<Agent>> {
        use anyhow::Context;
        let list = tokio::time::timeout(LIST_TIMEOUT, self.pods.list(&ListParams::default().labels(&self.selector)))
            .await
            .context("listing the agent pods timed out")?
            .context("listing the agent pods")?;
        Ok(list
            .items
            .into_iter()
            .filter_map(|p| {
                let node = p.spec.as_ref()?.node_name.clone()?;
                let ip = p.status.as_ref()?.host_ip.as_ref()?.parse().ok()?;
                Some(Agent { node, ip })
            })
            .collect())
    }

    async fn token(&self) -> anyhow::Result<Token> {
        use anyhow::Context;
        let token = tokio::fs::read_to_string(&self.token_file)
            .await
            .with_context(|| format!("reading the operator's flows token {}", self.token_file.display()))?;
        format!("Bearer {}", token.trim()).parse().context("the operator's flows token is not a header value")
    }

    /// A channel to `agent`; with `answer_within`, for a list (a follow has no end).
    async fn channel(&self, agent: &Agent, answer_within: Option<Duration>) -> Result<Channel, String> {
        let url = match agent.ip {
            IpAddr::V4(ip) => format!("http://{ip}:{}", self.port),
            IpAddr::V6(ip) => format!("http://[{ip}]:{}", self.port),
        };
        let endpoint = Endpoint::from_shared(url).map_err(|e| e.to_string())?;
        let endpoint = endpoint.connect_timeout(CONNECT_TIMEOUT);
        let endpoint = match answer_within {
            Some(t) => endpoint.timeout(t),
            None => endpoint,
        };
        endpoint.connect().await.map_err(|e| format!("cannot reach the agent at {}:{}: {e}", agent.ip, self.port))
    }

    /// Every agent's records that `filter` admits (the newest `limit` of each),
    /// and each node's counters or why it did not answer.
    pub async fn list(&self, filter: Filter, limit: u32) -> anyhow::Result<(Vec<Flow>, Vec<NodeAnswer>)> {
        let agents = self.find().await?;
        let token = self.token().await?;
        let answers: Vec<(String, AgentAnswer)> = futures::stream::iter(agents)
            .map(|agent| {
                let (filter, token) = (filter.clone(), token.clone());
                async move {
                    let answer = async {
                        let channel = self.channel(&agent, Some(LIST_TIMEOUT)).await?;
                        let request = list_request(filter, limit, token);
                        let r = FlowsClient::new(channel).list(request).await.map_err(|s| s.message().to_owned())?;
                        let r = r.into_inner();
                        Ok((r.flows, NodeCounts { lost: r.lost, evicted: r.evicted, capacity: r.capacity }))
                    };
                    let answer = answer.await;
                    (agent.node, answer)
                }
            })
            .buffer_unordered(FAN_OUT)
            .collect()
            .await;
        let mut flows = Vec::new();
        let mut nodes = Vec::new();
        for (node, answer) in answers {
            match answer {
                Ok((f, counts)) => {
                    flows.extend(f);
                    nodes.push(NodeAnswer { node, outcome: Ok(counts) });
                }
                Err(e) => nodes.push(NodeAnswer { node, outcome: Err(e) }),
            }
        }
        nodes.sort_by(|a, b| a.node.cmp(&b.node));
        Ok((flows, nodes))
    }

    /// Every agent's records as they come (after those held), merged; an
    /// agent that cannot be reached, or does not start answering in time
    /// (a hung one), is left out, and logged.
    pub async fn follow(
        &self,
        filter: Filter,
        limit: u32,
    ) -> anyhow::Result<impl futures::Stream<Item = Flow> + Send + 'static + use<>> {
        let agents = self.find().await?;
        let token = self.token().await?;
        let streams: Vec<_> = futures::stream::iter(agents)
            .map(|agent| {
                let request = list_request(filter.clone(), limit, token.clone());
                async move {
                    let started = async {
                        let channel = self.channel(&agent, None).await?;
                        let mut client = FlowsClient::new(channel);
                        match tokio::time::timeout(LIST_TIMEOUT, client.follow(request)).await {
                            Ok(Ok(stream)) => Ok(stream.into_inner()),
                            Ok(Err(status)) => Err(status.message().to_owned()),
                            Err(_) => Err(format!("no answer within {LIST_TIMEOUT:?}")),
                        }
                    };
                    match started.await {
                        Ok(stream) => Some(stream.filter_map(|f| async move { f.ok() }).boxed()),
                        Err(e) => {
                            tracing::warn!(node = %agent.node, error = %e, "flows API: an agent left out of a follow");
                            None
                        }
                    }
                }
            })
            .buffer_unordered(FAN_OUT)
            .filter_map(|s| async move { s })
            .collect()
            .await;
        Ok(futures::stream::select_all(streams))
    }
}

/// A list or follow request carrying the operator's token.
fn list_request(filter: Filter, limit: u32, token: Token) -> tonic::Request<ListRequest> {
    let mut request = tonic::Request::new(ListRequest { filter: Some(filter), limit });
    request.metadata_mut().insert("authorization", token);
    request
}
