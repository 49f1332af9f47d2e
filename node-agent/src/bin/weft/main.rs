//! weft: the user's view of a Weft cluster. `weft explain` says which
//! policies decide a connection between two pods, computed by the agent's
//! own policy model from what the API holds (and with `--probe`, what one
//! connection sent from the source pod did); `weft flows`
//! shows a node's flow records. Installed as `kubectl-weft`, it is also
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
    /// One node's flow records (run on the node: it reads the agent's socket).
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
            Command::Flows(args) => flows::run(&args).await,
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
