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
    #[arg(
        long,
        env = "KUBECONFIG",
        conflicts_with = "in_cluster",
        required_unless_present = "in_cluster"
    )]
    kubeconfig: Option<PathBuf>,
    /// Use the pod's service account.
    #[arg(long)]
    in_cluster: bool,
    /// How often every attachment record is checked against the Nodes
    /// besides on its changes and on Node deletions; the resync interval of
    /// the controller's other objects too.
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    scan_interval: Duration,
    /// How long after a Node is deleted its attachments move to its cleanup
    /// list (meanwhile other nodes may take its volumes over, with fencing).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    gone_node_grace: Duration,
    /// How often a deleted StorageCluster is checked for release besides
    /// on every change of an attachment record naming it.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    cluster_interval: Duration,
    /// How often a node's local volumes' PVs are checked besides on every
    /// change of its local volumes or its local PVs.
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
    /// Serve the admission webhook that keeps each agent to its own node's
    /// objects here (e.g. 0.0.0.0:9443). Without it, agents are held to
    /// their nodes only where the ValidatingAdmissionPolicy is installed.
    #[arg(long)]
    webhook_addr: Option<std::net::SocketAddr>,
    /// The Secret (in --namespace) that keeps the webhook's CA and serving
    /// certificate.
    #[arg(long, default_value = "volagent-admission-tls")]
    webhook_secret: String,
    /// The Service (in --namespace) the API server reaches the webhook
    /// through: its DNS names go into the serving certificate.
    #[arg(long, default_value = "volagent-admission")]
    webhook_service: String,
    /// Another name or address the serving certificate carries (repeatable),
    /// for a configuration that names the webhook by URL.
    #[arg(long = "webhook-host")]
    webhook_hosts: Vec<String>,
    /// The ValidatingWebhookConfiguration whose caBundle the controller keeps.
    #[arg(long, default_value = "volagent-node-restriction")]
    webhook_configuration: String,
    /// The agents' ServiceAccount, <namespace>/<name>: its writes are held
    /// to the node of the pod its token is bound to.
    #[arg(long, default_value = "volagent-system/volagent-agent")]
    agent_service_account: crate::kube::admission::caller::AgentAccount,
    /// Backend policy components (*.wasm) whose provisioners make volumes;
    /// none: the controller provisions nothing. Read at start.
    #[arg(long)]
    plugin_dir: Option<PathBuf>,
    /// Serve each provisioning backend's CSI Controller service here, as
    /// <dir>/<backend>.csi.volagent.io.sock, for the upstream sidecars.
    #[arg(long, requires = "plugin_dir")]
    csi_dir: Option<PathBuf>,
    /// A uid allowed to connect to the CSI sockets (repeatable; default:
    /// root and the controller's own uid).
    #[arg(long = "csi-allowed-uid")]
    csi_allowed_uids: Vec<u32>,
    /// How long one controller step (an image made, grown, removed) may
    /// take before the request fails and is retried.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    step_deadline: Duration,
}

/// Every `*.wasm` in `dir`, loaded; a file that does not load is logged
/// and left out (the others are served).
fn load_policies(
    dir: &std::path::Path,
    limits: crate::policy::Limits,
) -> anyhow::Result<std::collections::BTreeMap<String, Arc<crate::policy::Plugin>>> {
    let runtime = crate::policy::Runtime::new(limits)?;
    let mut plugins = std::collections::BTreeMap::new();
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("reading the plugin dir {}", dir.display()))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "wasm"))
        .filter(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')))
        .collect();
    files.sort();
    for path in files {
        match crate::policy::Plugin::load_file(&runtime, &path) {
            Ok(plugin) => {
                tracing::info!(backend = plugin.name(), path = %path.display(), provisions = plugin.provisions(), "policy loaded");
                plugins.insert(plugin.name().to_string(), Arc::new(plugin));
            }
            Err(e) => tracing::error!("policy not loaded: {e}"),
        }
    }
    Ok(plugins)
}

pub fn run(args: ControllerArgs, limits: crate::policy::Limits) -> anyhow::Result<ExitCode> {
    if args.lease_duration < Duration::from_secs(3) {
        anyhow::bail!("--lease-duration must be at least 3s (it is renewed every third of it)");
    }
    let identity = args
        .identity
        .clone()
        .unwrap_or_else(|| format!("{}-{}", super::agent::hostname(), std::process::id()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(async move {
        let client = crate::kube::cluster::client(if args.in_cluster { None } else { args.kubeconfig.as_deref() }).await?;
        let state = Arc::new(State::default());
        let serving = Arc::new(crate::kube::admission::Serving::default());
        let webhook = args.webhook_addr.map(|addr| {
            let mut names = crate::kube::admission::WebhookConfig::service_names(&args.webhook_service, &args.namespace);
            names.extend(args.webhook_hosts.iter().cloned());
            crate::kube::admission::WebhookConfig {
                addr,
                namespace: args.namespace.clone(),
                secret: args.webhook_secret.clone(),
                names,
                configuration: args.webhook_configuration.clone(),
                agent: args.agent_service_account.clone(),
            }
        });
        if webhook.is_none() {
            tracing::warn!("no --webhook-addr: agents' writes are not held to their own nodes unless the ValidatingAdmissionPolicy in deploy/ is installed");
        }
        if let Some(addr) = args.metrics_addr {
            let listener = crate::http::bind(addr).await?;
            let (s, w, with_webhook) = (state.clone(), serving.clone(), webhook.is_some());
            let ready: crate::http::Readiness = Arc::new(move || {
                if !s.reachable.load(Ordering::Relaxed) {
                    return Err("the Kubernetes API is not reachable".into());
                }
                if with_webhook && !w.ready.load(Ordering::Relaxed) {
                    return Err("the admission webhook is not serving yet".into());
                }
                Ok(())
            });
            tokio::spawn(crate::http::serve(listener, ready));
        }
        let webhook = match webhook {
            Some(config) => {
                // A port it cannot bind ends the controller with the error.
                let (client, serving) = (client.clone(), serving.clone());
                let listener = tokio::spawn(crate::kube::admission::run(client, config, serving));
                Some(listener)
            }
            None => None,
        };
        let config = ControllerConfig {
            namespace: args.namespace.clone(),
            lease_name: "volagent-controller".into(),
            identity,
            lease_duration: args.lease_duration,
            scan_interval: args.scan_interval,
            gone_node_grace: args.gone_node_grace,
            cluster_interval: args.cluster_interval,
            local_interval: args.local_interval,
        };
        let provisioner = match &args.plugin_dir {
            Some(dir) => Some(Arc::new(crate::provision::Provisioner::new(
                load_policies(dir, limits)?,
                client.clone(),
                crate::provision::execute::Mechanisms::real(),
                args.step_deadline,
            ))),
            None => None,
        };
        let csi_ended = async {
            match (&provisioner, &args.csi_dir) {
                (Some(p), Some(dir)) => {
                    let mut uids = args.csi_allowed_uids.clone();
                    if uids.is_empty() {
                        uids = vec![0, nix::unistd::getuid().as_raw()];
                    }
                    crate::provision::csi::serve(p.clone(), dir, uids).await
                }
                _ => std::future::pending().await,
            }
        };
        tracing::info!(identity = %config.identity, scan_interval = ?config.scan_interval, "volagent controller starting");
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("SIGTERM handler")?;
        let webhook_ended = async {
            match webhook {
                Some(w) => match w.await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(e),
                    Err(e) => Err(anyhow::anyhow!("admission webhook task: {e}")),
                },
                None => std::future::pending().await,
            }
        };
        let identity = config.identity.clone();
        let namespace = args.namespace.clone();
        tokio::select! {
            () = controller::run(client.clone(), config, state, provisioner.clone().map(|p| {
                let client = client.clone();
                let identity = identity.clone();
                let work: controller::LeaderWork = Arc::new(move || {
                    Box::pin(crate::provision::claims::run(
                        client.clone(),
                        p.clone(),
                        identity.clone(),
                        namespace.clone(),
                    ))
                });
                work
            })) => {}
            ended = webhook_ended => ended?,
            ended = csi_ended => ended?,
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupted"),
            _ = term.recv() => tracing::info!("terminated"),
        }
        anyhow::Ok(ExitCode::SUCCESS)
    })
}
