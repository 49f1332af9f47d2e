use std::process::ExitCode;

use clap::Parser;
use weft_operator::config::Config;

#[tokio::main]
async fn main() -> ExitCode {
    weft_telemetry::logging::init("RUST_LOG");
    let config = Config::parse();
    match weft_operator::run::run(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}
