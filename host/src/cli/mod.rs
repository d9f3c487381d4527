//! Command-line interface of the `volagent` binary.

mod plugin;

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(name = "volagent", version, about = "Storage node agent for Kubernetes with WebAssembly backend policies")]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Offline tools for backend policy components.
    Plugin {
        #[command(subcommand)]
        command: plugin::PluginCommand,
        #[command(flatten)]
        limits: LimitArgs,
    },
}

/// Per-call limits of the guest runtime.
#[derive(Debug, clap::Args)]
pub struct LimitArgs {
    /// Deadline of one guest call, in milliseconds.
    #[arg(long, global = true, default_value_t = 500)]
    deadline_ms: u64,
    /// Memory cap of one guest call, in MiB.
    #[arg(long, global = true, default_value_t = 64)]
    memory_mib: usize,
}

impl LimitArgs {
    fn limits(&self) -> crate::policy::Limits {
        crate::policy::Limits {
            deadline: Duration::from_millis(self.deadline_ms),
            memory_bytes: self.memory_mib << 20,
            ..Default::default()
        }
    }
}

/// Run a parsed command line; the exit code says whether it succeeded.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Plugin { command, limits } => plugin::run(command, limits.limits()),
    }
}
