//! `volagent controller`: the cluster-wide controller (one leader among
//! replicas).

use crate::kube::controller::{self, ControllerConfig, State};
use anyhow::Context;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    /// The cluster's kubeconfig.
    #[arg(long, env = "KUBECONFIG", conflicts_with = "in_cluster", required_unless_present = "in_cluster")]
    kubeconfig: Option<PathBuf>,
    /// Use the pod's service account.
    #[arg(long)]
    in_cluster: bool,
    /// How often every attachment record is checked against the Nodes.
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    scan_interval: Duration,
    /// How often deleted StorageClusters are checked for release.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    cluster_interval: Duration,
    /// How often local volumes' PVs are checked besides on every change of
    /// a node's local volumes or a local PV.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    local_interval: Duration,
    /// The namespace of the leader-election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "volagent-system")]
    namespace: String,
    /// This replica's name in the Lease.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// How long a leader's Lease lasts unrenewed.
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
    lease_duration: Duration,
    /// Serve /metrics, /healthz and /readyz here (e.g. 0.0.0.0:9480).
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
}

pub fn run(args: ControllerArgs) -> anyhow::Result<ExitCode> {
    if args.lease_duration < Duration::from_secs(3) {
        anyhow::bail!("--lease-duration must be at least 3s (it is renewed every third of it)");
    }
    let identity = args.identity.clone().unwrap_or_else(|| format!("{}-{}", super::agent::hostname(), std::process::id()));
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("tokio runtime")?;
    rt.block_on(async move {
        let client = crate::kube::cluster::client(if args.in_cluster { None } else { args.kubeconfig.as_deref() }).await?;
        let state = Arc::new(State::default());
        if let Some(addr) = args.metrics_addr {
            let listener = crate::http::bind(addr).await?;
            let s = state.clone();
            let ready: crate::http::Readiness = Arc::new(move || {
                if s.reachable.load(Ordering::Relaxed) { Ok(()) } else { Err("the Kubernetes API is not reachable".into()) }
            });
            tokio::spawn(crate::http::serve(listener, ready));
        }
        let config = ControllerConfig {
            namespace: args.namespace.clone(),
            lease_name: "volagent-controller".into(),
            identity,
            lease_duration: args.lease_duration,
            scan_interval: args.scan_interval,
            cluster_interval: args.cluster_interval,
            local_interval: args.local_interval,
        };
        tracing::info!(identity = %config.identity, scan_interval = ?config.scan_interval, "volagent controller starting");
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("SIGTERM handler")?;
        tokio::select! {
            () = controller::run(client, config, state) => {}
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupted"),
            _ = term.recv() => tracing::info!("terminated"),
        }
        anyhow::Ok(ExitCode::SUCCESS)
    })
}
