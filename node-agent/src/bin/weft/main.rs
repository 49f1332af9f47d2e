//! weft: the user's view of a Weft cluster. `weft explain` says which
//! policies decide a connection between two pods, computed by the agent's
//! own policy model from what the API holds (and with `--probe`, what one
//! connection sent from the source pod did); `weft flows`
//! shows the flow records of every node (through the flows.weft.dev API) or
//! of one (its agent's socket). Installed as `kubectl-weft`, it is also
//! `kubectl weft`.

mod explain;
mod flows;
mod kube_read;
mod probe;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "weft", version, about = "Inspect a Weft pod network")]
struct Cli {
    /// The kubeconfig to use (default: $KUBECONFIG, then ~/.kube/config, then in-cluster).
    #[arg(long, global = true)]
    kubeconfig: Option<std::path::PathBuf>,
    /// The kubeconfig context to use (default: its current context).
    #[arg(long, global = true)]
    context: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Which policies select each end of a connection, and which rule decides it.
    Explain(explain::Args),
    /// Flow records: every node's through the Kubernetes API (as your rights
    /// allow), or one node's from its agent's socket (--socket).
    Flows(flows::Args),
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    weft_telemetry::logging::init("WEFT_LOG");
    let cli = Cli::parse();
    let result = async {
        match cli.command {
            Command::Explain(args) => {
                let client = kube_read::client(cli.kubeconfig.as_deref(), cli.context.as_deref()).await?;
                explain::run(&client, &args).await
            }
            Command::Flows(args) => match &args.socket {
                Some(socket) => flows::run_local(socket, &args).await,
                None => {
                    let client = kube_read::client(cli.kubeconfig.as_deref(), cli.context.as_deref()).await?;
                    flows::run_api(&client, &args).await
                }
            },
        }
    }
    .await;
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weft: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
