use std::process::ExitCode;

use clap::Parser;
use weft_operator::config::Config;

#[tokio::main]
async fn main() -> ExitCode {
    weft_telemetry::logging::init("RUST_LOG");
    let config = Config::parse();
    let result = if config.uninstall { uninstall().await } else { weft_operator::run::run(config).await };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn uninstall() -> anyhow::Result<()> {
    use anyhow::Context;
    let client = kube::Client::try_default().await.context("connecting to the Kubernetes API")?;
    let removed = weft_operator::uninstall::remove_weft_objects(client).await?;
    tracing::info!(removed.subnets, removed.allocations, removed.endpoints, "removed Weft's objects");
    Ok(())
}
