//! weft-cni: the CNI plugin binary that container runtimes exec for each pod.
//!
//! It answers VERSION itself and forwards every other verb to the node's
//! weft-agent over a Unix socket. Stdout carries the CNI protocol and nothing
//! else; logs go to stderr (level from `WEFT_CNI_LOG`, default `warn`).

mod args;
mod client;
mod error;
mod result;
mod version;

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use tonic::Code as GrpcCode;
use weft_proto::cni::v1::{Attachment, CniRequest, GcRequest, StatusRequest, add_response};

use args::{Command, ConfOnly, Invocation};
use error::{CniError, Code};

fn main() -> ExitCode {
    // With the default level only failures are logged, so the subscriber
    // (its set-up shows in every ADD's latency) waits until there is one.
    if std::env::var_os(LOG_ENV).is_some() {
        init_logging();
    }
    let mut stdin = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut stdin) {
        return emit(
            Err(CniError::new(Code::Io, format!("cannot read the network configuration from stdin: {e}"))),
            version::LATEST,
        );
    }
    let command = match args::parse(&args::ProcessEnv, &stdin) {
        Ok(c) => c,
        Err(e) => {
            // Report in the configuration's version when it is readable.
            let v = serde_json::from_slice::<serde_json::Value>(&stdin)
                .ok()
                .and_then(|v| v.get("cniVersion").and_then(|s| s.as_str()).map(str::to_owned))
                .filter(|v| version::CniVersion::parse(v).is_some())
                .unwrap_or_else(|| version::LATEST.to_owned());
            return emit(Err(e), &v);
        }
    };
    let cni_version = command.version_str().to_owned();
    let outcome = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => {
            let outcome = rt.block_on(forward(command));
            // The process ends right after: shutting the runtime down would
            // only add to every ADD's latency.
            std::mem::forget(rt);
            outcome
        }
        Err(e) => Err(CniError::new(Code::Internal, format!("cannot start the async runtime: {e}"))),
    };
    emit(outcome, &cni_version)
}

/// Prints the outcome on stdout and picks the exit code.
fn emit(outcome: Result<Option<String>, CniError>, cni_version: &str) -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    match outcome {
        Ok(out) => {
            if let Some(out) = out {
                let _ = writeln!(stdout, "{out}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            init_logging();
            tracing::warn!(code = e.code, msg = %e.msg, details = %e.details, "CNI request failed");
            let _ = writeln!(stdout, "{}", e.to_json(cni_version));
            ExitCode::FAILURE
        }
    }
}

const LOG_ENV: &str = "WEFT_CNI_LOG";

/// Sets up logging to stderr, plain text unless it is a terminal (the
/// runtime quotes it in its own logs); a second call keeps the first set-up.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env(LOG_ENV)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .with_target(false)
        .try_init();
}

fn socket_of(conf: &args::NetConf) -> PathBuf {
    PathBuf::from(conf.agent_socket.as_deref().unwrap_or(weft_proto::DEFAULT_AGENT_SOCKET))
}

async fn forward(command: Command) -> Result<Option<String>, CniError> {
    match command {
        Command::Add(inv) => add(inv).await.map(Some),
        Command::Del(inv) => del(inv).await.map(|()| None),
        Command::Check(inv) => check(inv).await.map(|()| None),
        Command::Status(c) => status(c).await.map(|()| None),
        Command::Gc(c) => gc(c).await.map(|()| None),
        Command::Version { requested } => Ok(Some(version::version_json(requested.as_deref()))),
    }
}

fn request(inv: &Invocation) -> CniRequest {
    let c = &inv.container;
    CniRequest {
        container_id: c.id.clone(),
        netns: c.netns.clone().unwrap_or_default(),
        ifname: c.ifname.clone(),
        args: c.args.clone().into_iter().collect(),
        cni_version: inv.conf.cni_version.clone(),
        network_name: inv.conf.name.clone(),
        config_json: inv.raw.clone(),
        prev_result_json: inv.conf.prev_result.as_ref().map(|p| p.to_string().into_bytes()).unwrap_or_default(),
        mtu: inv.conf.mtu.unwrap_or(0),
    }
}

/// Maps a failure to reach or hear from the agent to a CNI error. `down` is
/// the code to use when the agent is not there (11 for container verbs, 50
/// for STATUS).
fn unreachable(down: Code, what: String) -> CniError {
    CniError::new(down, what)
}

fn grpc_error(down: Code, verb: &str, s: tonic::Status) -> CniError {
    match s.code() {
        GrpcCode::Unavailable | GrpcCode::DeadlineExceeded | GrpcCode::Cancelled => {
            unreachable(down, format!("weft-agent did not answer {verb}: {}", s.message()))
        }
        _ if connection_lost(&s) => {
            unreachable(down, format!("weft-agent went away during {verb} (restarting?): {}", s.message()))
        }
        _ => CniError::new(Code::Internal, format!("weft-agent failed {verb}: {}", s.message())),
    }
}

/// The connection broke mid-request (the agent died or restarted): tonic
/// reports that as `Unknown` with the transport error as its source.
fn connection_lost(s: &tonic::Status) -> bool {
    std::error::Error::source(s).is_some_and(|e| e.is::<tonic::transport::Error>())
}

async fn add(inv: Invocation) -> Result<String, CniError> {
    let mut client =
        client::connect(&socket_of(&inv.conf)).await.map_err(|e| unreachable(Code::TryAgainLater, e.to_string()))?;
    let reply = client.add(request(&inv)).await.map_err(|s| grpc_error(Code::TryAgainLater, "ADD", s))?.into_inner();
    match reply.outcome {
        Some(add_response::Outcome::Result(r)) => {
            result::render(&r, &inv.conf.cni_version, inv.version, inv.conf.prev_result.as_ref())
        }
        Some(add_response::Outcome::Error(e)) => Err(e.into()),
        None => Err(CniError::new(Code::Internal, "weft-agent returned an empty ADD reply")),
    }
}

async fn del(inv: Invocation) -> Result<(), CniError> {
    let mut client =
        client::connect(&socket_of(&inv.conf)).await.map_err(|e| unreachable(Code::TryAgainLater, e.to_string()))?;
    let reply = client.del(request(&inv)).await.map_err(|s| grpc_error(Code::TryAgainLater, "DEL", s))?.into_inner();
    reply.error.map_or(Ok(()), |e| Err(e.into()))
}

async fn check(inv: Invocation) -> Result<(), CniError> {
    if inv.conf.prev_result.is_none() {
        return Err(CniError::new(Code::InvalidConfig, "CHECK needs prevResult in the network configuration"));
    }
    let mut client =
        client::connect(&socket_of(&inv.conf)).await.map_err(|e| unreachable(Code::TryAgainLater, e.to_string()))?;
    let reply =
        client.check(request(&inv)).await.map_err(|s| grpc_error(Code::TryAgainLater, "CHECK", s))?.into_inner();
    reply.error.map_or(Ok(()), |e| Err(e.into()))
}

async fn status(c: ConfOnly) -> Result<(), CniError> {
    let mut client =
        client::connect(&socket_of(&c.conf)).await.map_err(|e| unreachable(Code::NotAvailable, e.to_string()))?;
    let req = StatusRequest { network_name: c.conf.name.clone(), config_json: c.raw.clone() };
    let reply = tokio::time::timeout(client::STATUS_TIMEOUT, client.status(req))
        .await
        .map_err(|_| {
            unreachable(
                Code::NotAvailable,
                format!("weft-agent did not answer STATUS within {:?}", client::STATUS_TIMEOUT),
            )
        })?
        .map_err(|s| grpc_error(Code::NotAvailable, "STATUS", s))?
        .into_inner();
    reply.error.map_or(Ok(()), |e| Err(e.into()))
}

async fn gc(c: ConfOnly) -> Result<(), CniError> {
    let Some(valid) = c.conf.valid_attachments.clone().or_else(|| c.conf.legacy_attachments.clone()) else {
        return Err(CniError::new(
            Code::InvalidConfig,
            "GC needs cni.dev/valid-attachments in the network configuration",
        ));
    };
    let mut client =
        client::connect(&socket_of(&c.conf)).await.map_err(|e| unreachable(Code::TryAgainLater, e.to_string()))?;
    let req = GcRequest {
        network_name: c.conf.name.clone(),
        config_json: c.raw.clone(),
        valid_attachments: valid
            .into_iter()
            .map(|a| Attachment { container_id: a.container_id, ifname: a.ifname })
            .collect(),
    };
    let reply = client.gc(req).await.map_err(|s| grpc_error(Code::TryAgainLater, "GC", s))?.into_inner();
    reply.error.map_or(Ok(()), |e| Err(e.into()))
}
