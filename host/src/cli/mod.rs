//! Command-line interface of the `volagent` binary.

mod agent;
mod controller;
mod local;
mod mounter;
mod nbd;
mod plugin;
mod plugin_new;
mod plugin_replay;
mod plugin_rollout;
mod status;

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "volagent",
    version,
    about = "Storage node agent for Kubernetes with WebAssembly backend policies"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log format on stderr: text, or json (one object per line).
    #[arg(long, global = true, env = "VOLAGENT_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the node agent: serve the socket, load the backends, install
    /// their Flexvolume drivers.
    Agent {
        #[command(flatten)]
        args: Box<agent::AgentArgs>,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Ask the running agent which volumes this node holds, and for which
    /// pods; exit 1 if it cannot list them.
    Status {
        #[command(flatten)]
        args: status::StatusArgs,
    },
    /// Offline tools for backend policy components.
    Plugin {
        #[command(subcommand)]
        command: plugin::PluginCommand,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Run the cluster-wide controller: moves vanished nodes' attachments
    /// to their cleanup lists, releases deleted StorageClusters, and
    /// provisions volumes as the backends' policies plan them.
    Controller {
        #[command(flatten)]
        args: controller::ControllerArgs,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Local persistent volumes: discovery, as the agent does it.
    Local {
        #[command(subcommand)]
        command: local::LocalCommand,
    },
    /// Run the node's mounter: it starts, on the agent's request, the
    /// processes mounted volumes need, in a pod that outlives the agent's.
    Mounter {
        #[command(flatten)]
        args: mounter::MounterArgs,
    },
    /// The agent's NBD server, on its own.
    Nbd {
        #[command(subcommand)]
        command: nbd::NbdCommand,
    },
    /// Print the CustomResourceDefinitions (volagent.io/v1alpha1) as YAML,
    /// or write one file per CRD into a dir.
    Crds {
        /// Write <crd-name>.yaml files here instead of printing.
        #[arg(long)]
        dir: Option<std::path::PathBuf>,
        /// The CSI snapshot API's CRDs (snapshot.storage.k8s.io/v1) instead,
        /// for a cluster that has none from the upstream snapshot controller.
        #[arg(long)]
        snapshots: bool,
    },
}

/// Per-call limits of the guest runtime.
#[derive(Debug, clap::Args)]
pub struct LimitArgs {
    /// Deadline of one guest call, in milliseconds (1 to 600000).
    #[arg(long, global = true, env = "VOLAGENT_DEADLINE_MS", default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    deadline_ms: u64,
    /// Memory cap of one guest call, in MiB (2 to 4096).
    #[arg(long, global = true, default_value_t = 64, value_parser = clap::value_parser!(u64).range(2..=4096))]
    memory_mib: u64,
    /// Instances of each backend made ahead of its calls (0 to 8; 16 of
    /// all backends at most): each takes a call's instantiation off the
    /// mount's path, and keeps its memory resident while it waits.
    #[arg(long, global = true, default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=8))]
    instances_ahead: u64,
}

impl LimitArgs {
    fn limits(&self) -> crate::policy::Limits {
        crate::policy::Limits {
            deadline: Duration::from_millis(self.deadline_ms),
            // In range by the parser: at most 4 GiB.
            memory_bytes: (self.memory_mib as usize) << 20,
            // In range by the parser: at most 8.
            instances_ahead: self.instances_ahead as usize,
            ..Default::default()
        }
    }
}

impl Cli {
    /// The log filter when RUST_LOG is not set: the agent tells what it
    /// does; the tools print only errors (guest log lines would clutter them).
    pub fn json_logs(&self) -> bool {
        self.log_format == "json"
    }

    pub fn default_log_filter(&self) -> &'static str {
        match self.command {
            Command::Agent { .. }
            | Command::Controller { .. }
            | Command::Mounter { .. }
            | Command::Nbd { .. } => "info",
            Command::Plugin { .. }
            | Command::Status { .. }
            | Command::Crds { .. }
            | Command::Local { .. } => "error",
        }
    }
}

/// Run a parsed command line; the exit code says whether it succeeded.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Agent { args, limits } => agent::run(*args, limits.limits()),
        Command::Status { args } => status::run(args),
        Command::Plugin { command, limits } => plugin::run(command, limits.limits()),
        Command::Controller { args, limits } => controller::run(args, limits.limits()),
        Command::Mounter { args } => mounter::run(args),
        Command::Nbd { command } => nbd::run(command),
        Command::Local { command } => local::run(command),
        Command::Crds { dir: None, snapshots } => {
            let files = if snapshots {
                crate::kube::snapshot_crds::all()
            } else {
                crate::kube::crds::all()
            };
            print!("{}", crate::kube::crds::yaml_stream_of(files));
            Ok(ExitCode::SUCCESS)
        }
        Command::Crds { dir: Some(dir), snapshots } => {
            use anyhow::Context;
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let files = if snapshots {
                crate::kube::snapshot_crds::all()
            } else {
                crate::kube::crds::all()
            };
            for (file, yaml) in files {
                let path = dir.join(file);
                std::fs::write(&path, yaml)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
