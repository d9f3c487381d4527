//! The `volagent` binary: CLI wiring only.

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = volagent::cli::Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| cli.default_log_filter().into()),
        )
        .init();
    match volagent::cli::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("volagent: {e:#}");
            ExitCode::from(2)
        }
    }
}
