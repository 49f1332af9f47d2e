//! Bringing the sandbox up and down. `up` starts a supervisor process that
//! owns everything (control plane, operator, agents, the forwarder) and
//! removes it all when it gets SIGTERM from `down`.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PostParams};
use serde_json::json;

use super::{CP_IP, CP_NS, FORWARD_PORT, State, UNDERLAY_NS, ip, state_dir};
use crate::control_plane::{self, Component, ControlPlane, Options, process};
use crate::supervisor::StateFile;

/// The sandbox's supervisor and starting locks (one sandbox per machine).
pub fn locks() -> crate::supervisor::MachineLocks {
    State::locks()
}

/// Starts the supervisor in the background and waits until the cluster is
/// ready (every node's Subnet Ready and its peers programmed).
pub fn up(
    nodes: usize,
    backend: &str,
    ipv6_only: bool,
    agent_args: &[String],
    operator_args: &[String],
) -> anyhow::Result<State> {
    let args = ["--nodes".to_owned(), nodes.to_string(), "--backend".to_owned(), backend.to_owned()];
    crate::supervisor::up::<State>(&args, || {
        let _ = std::fs::remove_file(state_dir().join("supervisor.log"));
        super::ExtraArgs::Agent.save(agent_args)?;
        super::ExtraArgs::Operator.save(operator_args)?;
        super::set_ipv6_only(ipv6_only)
    })
}

/// Stops the supervisor (which tears everything down) and removes leftovers.
pub fn down() -> anyhow::Result<()> {
    crate::supervisor::down::<State>()
}

/// Stops the sandbox's own processes: pod responders, every node's agent
/// (found by its directory, so also those of a start that failed before
/// the state was written) and the operators.
fn stop_processes() {
    for pod in super::pods::PodRecord::all() {
        pod.stop_responder();
    }
    for entry in std::fs::read_dir(state_dir()).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("node-") {
            super::nodes::stop_agent(&name);
        }
    }
    for replica in super::operators::REPLICAS {
        super::operators::stop(replica, true);
    }
}

/// Removes every sandbox namespace and the state directory.
pub fn cleanup_leftovers() {
    stop_processes();
    crate::supervisor::remove_namespaces(super::NS_PREFIX);
    let _ = std::fs::remove_dir_all(state_dir());
}

/// The supervisor: builds everything, writes the state, waits for SIGTERM.
pub async fn supervise(nodes: usize, backend: &str) -> anyhow::Result<()> {
    let Some(_lock) = locks().take_supervisor()? else {
        bail!("a sandbox is already up or starting on this machine");
    };
    let result = build(nodes, backend).await;
    let (cp, children) = match result {
        Ok(parts) => parts,
        Err(e) => {
            // Keep the log (the caller shows it); everything else goes.
            eprintln!("sandbox start failed: {e:#}");
            stop_processes();
            crate::supervisor::remove_namespaces(super::NS_PREFIX);
            return Err(e);
        }
    };
    eprintln!("sandbox ready");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    // `weft-sandbox etcd-restart` / `apiserver-restart`: the process crashes
    // and comes back.
    let mut usr1 = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())?;
    let mut usr2 = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined2())?;
    loop {
        let which = tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = usr1.recv() => Component::Etcd,
            _ = usr2.recv() => Component::Apiserver,
        };
        let restarted = tokio::task::block_in_place(|| cp.restart(which))
            .and_then(|()| cp.write_apiserver_pid(&state_dir().join("apiserver.pid")));
        let note = match restarted {
            Ok(()) => format!("{} restarted", which.name()),
            Err(e) => format!("{} restart failed: {e:#}", which.name()),
        };
        eprintln!("{note}");
        let result = restart_result(which);
        let tmp = result.with_extension("tmp");
        if std::fs::write(&tmp, note).is_ok() {
            let _ = std::fs::rename(&tmp, result);
        }
    }
    eprintln!("tearing the sandbox down");
    for mut c in children {
        process::stop(&mut c, Duration::from_secs(5));
    }
    if let Ok(state) = State::load() {
        for n in &state.nodes {
            super::nodes::stop_agent(&n.name);
        }
    }
    for replica in super::operators::REPLICAS {
        super::operators::stop(replica, false);
    }
    cp.shutdown();
    cleanup_leftovers();
    Ok(())
}

/// Where the supervisor writes the outcome of a restart it was asked for.
pub fn restart_result(which: Component) -> std::path::PathBuf {
    state_dir().join(format!("{}-restart.result", which.name()))
}

type Parts = (ControlPlane, Vec<std::process::Child>);

async fn build(nodes: usize, backend: &str) -> anyhow::Result<Parts> {
    let dir = state_dir();
    std::fs::create_dir_all(&dir)?;
    // The underlay: one bridge in its own namespace.
    ip(&["netns", "add", UNDERLAY_NS])?;
    ip(&["-n", UNDERLAY_NS, "link", "add", "br0", "type", "bridge"])?;
    ip(&["-n", UNDERLAY_NS, "link", "set", "br0", "up"])?;
    super::nodes::attach_to_underlay(CP_NS, "cp", CP_IP)?;

    super::forward::serve(SocketAddr::from(([127, 0, 0, 1], FORWARD_PORT)), CP_NS, SocketAddr::from((CP_IP, 6443)))?;
    let cp = tokio::task::spawn_blocking(move || {
        ControlPlane::start_with(&Options {
            netns: Some(CP_NS.to_owned()),
            address: Some(CP_IP),
            client_server: Some(format!("https://127.0.0.1:{FORWARD_PORT}")),
            dir: Some(state_dir()),
            ..Default::default()
        })
    })
    .await??;
    cp.write_apiserver_pid(&dir.join("apiserver.pid"))?;
    let client = cp.client().await?;
    control_plane::install_crds(&client).await?;
    let namespaces = Api::<Namespace>::all(client.clone());
    let ns = serde_json::from_value(json!({"metadata": {"name": "kube-system"}}))?;
    match namespaces.create(&PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(e).context("creating kube-system"),
    }
    // The sandbox's admin lets pods of `default` use automatic host ports.
    let opt_in = json!({"metadata": {"labels": {
        weft_api::host_port::NAMESPACE_OPT_IN_LABEL: weft_api::host_port::NAMESPACE_OPT_IN_VALUE,
    }}});
    namespaces
        .patch("default", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&opt_in))
        .await
        .context("allowing automatic host ports in namespace default")?;

    let in_cluster = cp.in_namespace_kubeconfig();
    let children = Vec::new();
    super::operators::start_all(&client, &in_cluster, backend).await?;

    let mut infos = Vec::new();
    for i in 1..=nodes {
        infos.push(super::nodes::add(&client, i, &in_cluster).await?);
    }

    super::nodes::wait_ready(&client, &infos).await?;
    let state = State {
        supervisor_pid: std::process::id(),
        kubeconfig: cp.kubeconfig.clone(),
        in_cluster_kubeconfig: in_cluster,
        backend: backend.to_owned(),
        nodes: infos,
    };
    state.save()?;
    Ok((cp, children))
}
