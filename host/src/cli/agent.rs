//! `volagent agent`: the node agent, standalone (embedded ledger) for now.

use crate::ledger::embedded::EmbeddedLedger;
use crate::ops::mount_records::MountRecords;
use crate::ops::{Agent, NodeConfig};
use crate::plugin::install;
use crate::plugin::install::PodIdentity;
use crate::plugin::reload::{Integration, Reloader};
use crate::policy::{Limits, Runtime};
use crate::socket::server::{self, ServerConfig};
use crate::sys::Sys;
use anyhow::Context;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// This node's name (the DaemonSet passes NODE_NAME from the downward API).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// The agent's socket; default <runtime-dir>/agent.sock.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Where the agent keeps what lives as long as this boot's mounts and
    /// devices: the socket and the stash of what it mounted. Keep it on a
    /// tmpfs: a reboot then forgets exactly what it undid, and writes to
    /// it need no disk flush.
    #[arg(long, default_value = "/run/volagent")]
    runtime_dir: PathBuf,
    /// Where the agent keeps what outlives a reboot: the embedded ledger,
    /// the default plugin dir, backends' per-volume state.
    #[arg(long, default_value = "/var/lib/volagent")]
    state_dir: PathBuf,
    /// The embedded attachment ledger; default <state-dir>/ledger.redb.
    #[arg(long)]
    ledger: Option<PathBuf>,
    /// Other agents on this machine (simulated nodes) use the same ledger
    /// file; each change then costs one more disk flush.
    #[arg(long)]
    ledger_shared: bool,
    /// Join a cluster through this kubeconfig: the ledger is then the
    /// cluster's Attachment records, fencing reads Nodes and PVs.
    #[arg(long, env = "KUBECONFIG", conflicts_with = "in_cluster")]
    kubeconfig: Option<PathBuf>,
    /// Join the cluster the agent's pod runs in (its service account).
    #[arg(long)]
    in_cluster: bool,
    /// With a cluster: the agent's namespace, the only one it reads
    /// StorageClusters' credentials from.
    #[arg(long, env = "POD_NAMESPACE", default_value = "volagent-system")]
    namespace: String,
    /// With a cluster: how often the node's cleanup list and deleted
    /// storage clusters are checked besides on every change seen.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    cleanup_interval: Duration,
    /// Serve /metrics, /healthz and /readyz here: loopback or this node's
    /// own address (e.g. 127.0.0.1:9479, or $(NODE_IP):9479 in a pod); an
    /// address of every interface is refused.
    #[arg(long, value_parser = |s: &str| crate::http::parse_addr(s).and_then(crate::http::node_local))]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Backend policy components (*.wasm); default <state-dir>/plugins.
    #[arg(long)]
    plugin_dir: Option<PathBuf>,
    /// kubelet's root dir (its --root-dir).
    #[arg(long, default_value = "/var/lib/kubelet")]
    kubelet_root: PathBuf,
    /// Dirs under which local volumes live (repeatable).
    #[arg(long = "discovery-dir", default_value = "/mnt/disks")]
    discovery_dirs: Vec<PathBuf>,
    /// A local storage class and its discovery dirs, `<class>=<dir>[:<dir>…]`
    /// (repeatable): with a cluster, each mount point, block device (or
    /// link to one under /dev) and file in the dirs becomes a PV of the
    /// class, and is wiped by the local-pv policy when released. The dirs
    /// are discovery dirs too.
    #[arg(long = "local-class", value_name = "CLASS=DIRS")]
    local_classes: Vec<crate::local::LocalClass>,
    /// How often the local classes' dirs are scanned.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    local_scan_interval: Duration,
    /// kubelet's --volume-plugin-dir; default: the first known one that exists.
    #[arg(long)]
    volume_plugin_dir: Option<PathBuf>,
    /// The Flexvolume driver binary to install; default: volagent-flex beside this binary.
    #[arg(long)]
    flex_driver: Option<PathBuf>,
    /// Do not install Flexvolume drivers.
    #[arg(long)]
    no_driver_install: bool,
    /// Peer uids allowed on the socket (repeatable).
    #[arg(long = "allow-uid", default_value = "0")]
    allowed_uids: Vec<u32>,
    /// How long a mount or unmount waits for its steps, in seconds; steps
    /// still running then go on, with the volume locked.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    plan_deadline_secs: u64,
    /// With a cluster: serve this backend's inline pod volumes too
    /// (repeatable). Off by default: an inline volume's options are written
    /// by the pod's author, not an admin; each is then its pod's alone.
    #[arg(long = "allow-inline-volumes", value_name = "BACKEND")]
    inline_backends: Vec<String>,
    /// A userspace NBD client whose server has not answered a flush for
    /// this long is aborted, and a kernel nbd device fails a request its
    /// server has not answered for this long: I/O then fails instead of
    /// hanging the mounts and unmounts that wait on it.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    nbd_hung_after: Duration,
    /// The node's mounter (`volagent mounter`): the processes volumes need
    /// while mounted (userspace NBD clients and helper servers, rbd-fuse,
    /// GlusterFS clients) are started there, in a pod of their own, so that
    /// they outlive this agent's. Without it, the agent starts them itself.
    #[arg(long, env = "VOLAGENT_MOUNTER")]
    mounter: Option<PathBuf>,
    /// Do not serve CSI drivers (by default each backend is also the CSI
    /// driver `<backend>.csi.volagent.io`, registered with kubelet through
    /// <kubelet-root>/plugins_registry).
    #[arg(long)]
    no_csi: bool,
    /// Operations run at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024))]
    max_concurrent: u64,
    /// Record every policy call (its inputs, the node's answers to the
    /// guest's queries, the outcome) as a scenario file under
    /// DIR/<backend>/, for `volagent plugin record` and `plugin replay`.
    /// Switched per backend at run time with `volagent plugin recording`.
    #[arg(long, value_name = "DIR")]
    record: Option<PathBuf>,
    /// With --record: record only these backends from the start
    /// (repeatable); default: all.
    #[arg(long = "record-backend", value_name = "BACKEND", requires = "record")]
    record_backends: Vec<String>,
    /// With --record: recordings kept at most; the oldest go first.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    record_max_files: u64,
    /// With --record: bytes of recordings kept at most, in MiB.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    record_max_mib: u64,
    /// Which policies may be loaded: none but those listed or signed.
    #[command(flatten)]
    trust: crate::plugin::trust::TrustArgs,
    /// A dir of policy versions (`*.wasm`, any names; repeatable) from
    /// which the versions the cluster's BackendPolicy objects choose are
    /// put in place in the plugin dir, which must then be writable.
    #[arg(long = "policy-store", value_name = "DIR")]
    policy_stores: Vec<PathBuf>,
}

impl AgentArgs {
    fn socket(&self) -> PathBuf {
        self.socket.clone().unwrap_or_else(|| self.runtime_dir.join("agent.sock"))
    }
}

pub(super) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

/// Where drivers go and what they are, or None not to install them.
fn driver_target(args: &AgentArgs) -> (Option<PathBuf>, PathBuf) {
    let driver = args.flex_driver.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .map(|exe| exe.with_file_name("volagent-flex"))
            .unwrap_or_else(|_| PathBuf::from("volagent-flex"))
    });
    if args.no_driver_install {
        return (None, driver);
    }
    match install::volume_plugin_dir(args.volume_plugin_dir.as_deref()) {
        Ok(d) => (Some(d), driver),
        Err(e) => {
            tracing::error!("Flexvolume drivers will not be installed: {e}");
            (None, driver)
        }
    }
}

/// Use every file descriptor the hard limit allows: a node with many
/// volumes and connections needs more than the usual soft 1024.
fn raise_nofile() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::debug!(from = soft, to = hard, "raised the open file limit"),
            Err(e) => tracing::warn!("cannot raise the open file limit from {soft} to {hard}: {e}"),
        },
        Ok(_) => {}
        Err(e) => tracing::warn!("cannot read the open file limit: {e}"),
    }
}

/// The discovery dirs, the local classes' among them, resolved (each is a
/// root the agent acts beneath).
fn discovery_dirs(args: &AgentArgs) -> anyhow::Result<Vec<PathBuf>> {
    let mut dirs: Vec<PathBuf> = args.discovery_dirs.clone();
    for class in &args.local_classes {
        dirs.extend(class.dirs.iter().cloned());
    }
    let mut resolved = Vec::new();
    for d in dirs {
        let r = crate::sys::beneath::resolve(&d)
            .with_context(|| format!("discovery dir {}", d.display()))?;
        if !resolved.contains(&r) {
            resolved.push(r);
        }
    }
    Ok(resolved)
}

/// `sys` with the fault layer and the step hooks the environment asks for
/// (the chaos tier's: [`crate::sys::faults`]).
#[cfg(feature = "testing")]
fn with_test_hooks(mut sys: Sys) -> Sys {
    if let Some(file) = std::env::var_os(crate::sys::faults::FAULTS_FILE_ENV) {
        tracing::warn!(rules = %std::path::Path::new(&file).display(), "fault injection on (a test hook): operations fail as the rules file says");
        sys = sys.with_faults(file.into());
    }
    if let Some(hooks) = crate::sys::faults::CrashHooks::from_env() {
        tracing::warn!("step hooks on (a test hook): {hooks:?}");
        sys = sys.with_step_hook(std::sync::Arc::new(hooks));
    }
    sys
}

pub fn run(args: AgentArgs, limits: Limits) -> anyhow::Result<ExitCode> {
    raise_nofile();
    let node = args.node_name.clone().unwrap_or_else(hostname);
    let plugin_dir = args.plugin_dir.clone().unwrap_or_else(|| args.state_dir.join("plugins"));
    std::fs::create_dir_all(&plugin_dir)
        .with_context(|| format!("plugin dir {}", plugin_dir.display()))?;
    let mut trust = crate::plugin::trust::TrustSources::new(&args.trust)?;
    let runtime = Runtime::new(limits)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let cluster = match (&args.kubeconfig, args.in_cluster) {
        (None, false) => None,
        (kubeconfig, _) => {
            let client = rt.block_on(crate::kube::cluster::client(kubeconfig.as_deref()))?;
            Some(crate::kube::cluster::Cluster {
                client,
                component: "volagent-agent".into(),
                node: node.clone(),
                namespace: args.namespace.clone(),
            })
        }
    };
    let ledger: Arc<dyn crate::ledger::Ledger> = match &cluster {
        Some(c) => {
            tracing::info!("ledger: Attachment records (attachments.volagent.io) in the cluster");
            Arc::new(crate::kube::ledger::KubeLedger::new(c.client.clone()))
        }
        None => {
            let ledger_path =
                args.ledger.clone().unwrap_or_else(|| args.state_dir.join("ledger.redb"));
            tracing::info!(path = %ledger_path.display(), "ledger: embedded (no cluster configured)");
            Arc::new(EmbeddedLedger::open(&ledger_path, args.ledger_shared)?)
        }
    };
    let stash = MountRecords::open(&args.runtime_dir.join("stash"))?;
    stash.import_legacy(&args.runtime_dir.join("stash.redb"))?;
    let socket = args.socket();
    // The dirs the agent acts in, resolved once: every path it acts on is
    // then resolved beneath one of them, following no symlink.
    let root = |p: &Path| {
        crate::sys::beneath::resolve(p).with_context(|| format!("root dir {}", p.display()))
    };
    let config = NodeConfig {
        node: node.clone(),
        kubelet_root: root(&args.kubelet_root)?,
        kubelet_root_given: args.kubelet_root.clone(),
        state_dir: root(&args.state_dir)?,
        discovery_dirs: discovery_dirs(&args)?,
        inline_backends: args.inline_backends.clone(),
    };
    let roots = crate::sys::Roots::open(&config.roots()).context("opening the root dirs")?;
    // The classes' dirs as resolved: PVs name paths as the agent acts on them.
    let local_classes: Vec<crate::local::LocalClass> = args
        .local_classes
        .iter()
        .map(|c| {
            Ok(crate::local::LocalClass {
                name: c.name.clone(),
                dirs: c.dirs.iter().map(|d| root(d)).collect::<anyhow::Result<_>>()?,
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let tag = crate::ops::loop_tag(&node, &config.state_dir);
    let mut remote = None;
    let launcher: Arc<dyn crate::sys::launch::Launcher> = match &args.mounter {
        Some(socket) => {
            let mounter = Arc::new(crate::sys::launch::remote::Remote::new(socket.clone()));
            remote = Some(mounter.clone());
            // Only said here: the mounter may start after the agent, and
            // each launch names the socket when it cannot be reached.
            match mounter.hello() {
                Ok(m) => tracing::info!(
                    socket = %socket.display(),
                    version = m.version,
                    protocol = m.protocol,
                    running = m.running,
                    "the node's mounter starts the processes volumes need"
                ),
                Err(e) => tracing::warn!("the node's mounter does not answer yet: {e}"),
            }
            mounter
        }
        None => Arc::new(crate::sys::launch::Local::default()),
    };
    let sys =
        Sys::linux_with(roots, &tag, config.state_dir.join("nbd"), args.nbd_hung_after, launcher);
    // The chaos tier's hooks exist only in a build for tests.
    #[cfg(feature = "testing")]
    let sys = with_test_hooks(sys);
    spawn_nbd_watchdog(&sys, args.nbd_hung_after);
    let mut agent = Agent::new(
        config,
        Vec::new(),
        ledger.clone(),
        stash,
        sys,
        Duration::from_secs(args.plan_deadline_secs),
    );
    if let Some(c) = cluster.clone() {
        agent = agent.with_cluster(Arc::new(c));
    }
    let agent = Arc::new(agent);
    rt.spawn(agent.clone().follow_replaced_clients());
    if let Some(mounter) = remote {
        rt.spawn(agent.clone().tell_the_mounter_pod(mounter));
    }
    // The backends: loaded (and their drivers installed) by the first pass
    // over the plugin dir, then kept in line with it by the watch.
    let (volume_plugin_dir, driver_binary) = driver_target(&args);
    let csi_threads = match args.no_csi {
        true => None,
        false => Some(
            crate::csi::threads::CsiThreads::start(crate::csi::threads::THREADS)
                .context("CSI threads")?,
        ),
    };
    let csi = csi_threads.as_ref().map(|t| {
        Arc::new(crate::csi::drivers::Drivers::new(
            agent.clone(),
            rt.handle().clone(),
            t.handles().to_vec(),
            args.allowed_uids.clone(),
        ))
    });
    let board = Arc::new(crate::socket::status::Board::default());
    if let Some(csi) = &csi {
        board.serve_csi(csi);
    }
    let pod = PodIdentity::from_env();
    let record = args.record.as_ref().map(|dir| crate::plugin::observe::RecordConfig {
        dir: dir.clone(),
        backends: args.record_backends.clone(),
        max_files: args.record_max_files as usize,
        max_bytes: args.record_max_mib << 20,
    });
    let events = cluster.clone().zip(pod.clone()).map(|(cluster, pod)| {
        crate::plugin::observe::EventTarget { cluster, pod, rt: rt.handle().clone() }
    });
    let observer = crate::plugin::observe::Observer::start(record, board.clone(), events)?;
    board.switch_recording_with(observer.clone());
    // In a cluster, the BackendPolicy objects' digests are trusted too:
    // listed once before the first pass, then kept up by their task.
    let listing = crate::kube::backend_policies::Listing::cached_in(
        args.state_dir.join("backend-policies.trusted"),
    );
    if let Some(c) = &cluster {
        let l = listing.clone();
        trust = trust.with_cluster(Arc::new(move || l.allow_list()));
        rt.block_on(listing.refresh(&c.client));
    }
    let trust = Arc::new(trust);
    if cluster.is_some() {
        // The versions the objects choose are in place before the first
        // pass: an agent whose plugin dir came back as its image made it (a
        // container's restart) never serves another version meanwhile.
        crate::kube::backend_policies::apply_at_start(
            &listing,
            &runtime,
            &trust,
            &plugin_dir,
            &args.policy_stores,
        );
    }
    let integration = Integration {
        volume_plugin_dir,
        driver_binary,
        socket: socket.clone(),
        kubelet_root: args.kubelet_root.clone(),
        pod,
        csi: csi.clone(),
        board: board.clone(),
        cluster: cluster.clone(),
        observer: Some(observer),
        trust: trust.clone(),
    };
    let mut reloader = Reloader::new(
        agent.clone(),
        runtime.clone(),
        plugin_dir.clone(),
        integration,
        rt.handle().clone(),
    );
    // The watch starts before the first pass: a file that lands after the
    // pass has read the dir (even before the socket appears) still counts.
    let watch = crate::plugin::watch::DirWatch::start(&plugin_dir, Some(&args.trust.allow_list))
        .map_err(|e| tracing::error!("backends will not be reloaded: {e:#}"))
        .ok();
    let poke = watch.as_ref().map(|w| w.poke());
    reloader.pass();
    let backends: Vec<String> = agent.backend_names();
    if backends.is_empty() {
        tracing::warn!(dir = %plugin_dir.display(), "no backend loaded yet: put <backend>.wasm files there");
    }
    let server_config = ServerConfig {
        socket: socket.clone(),
        allowed_uids: args.allowed_uids.clone(),
        max_concurrent: args.max_concurrent as usize,
        request_timeout: Duration::from_secs(10),
        slot_timeout: Duration::from_secs(120),
    };
    let served = rt.block_on(async move {
        // Caught from the start: a stop that comes as soon as the socket
        // is there (or during start-up's repairs) still stores the records
        // taken in memory, instead of killing the process.
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("SIGINT handler")?;
        let serving = Arc::new(std::sync::atomic::AtomicBool::new(false));
        if let Some(addr) = args.metrics_addr {
            let listener = crate::http::bind(addr).await?;
            let s = serving.clone();
            let ready: crate::http::Readiness = Arc::new(move || {
                if s.load(std::sync::atomic::Ordering::Relaxed) { Ok(()) } else { Err("reconciling; the socket is not open yet".into()) }
            });
            tokio::spawn(crate::http::serve(listener, ready));
        }
        crate::listener::ensure_free(&socket)?;
        // Before serving (and before the socket appears, so callers wait or
        // retry): repair what a crash left, so the first request meets a node
        // whose records and mounts agree.
        match agent.reconcile().await {
            Ok(report) => tracing::info!(
                kept = report.kept.len(),
                rolled_back = report.rolled_back.len(),
                stale_holders = report.stale_holders.len(),
                orphans = report.orphans.len(),
                errors = report.errors.len(),
                "start-up reconciliation done"
            ),
            Err(f) => tracing::error!("start-up reconciliation failed: {}", f.message),
        }
        // The CSI drivers first: a caller that finds the agent's socket
        // answering finds their sockets answering too.
        if let Some(csi) = &csi {
            csi.start();
        }
        let listener = match crate::listener::bind(&socket) {
            Ok(l) => l,
            Err(e) => {
                if let Some(csi) = &csi {
                    csi.stop_all();
                }
                return Err(e.into());
            }
        };
        if let Some(watch) = watch {
            tokio::spawn(async move {
                if let Err(e) = crate::plugin::watch::run(watch, reloader).await {
                    tracing::error!("backends will not be reloaded: {e:#}");
                }
            });
        }
        if let Some(c) = &cluster {
            tokio::spawn(crate::kube::node_tasks::run(agent.clone(), c.client.clone(), node.clone(), args.cleanup_interval));
            {
                let rollouts = crate::kube::backend_policies::Rollouts {
                    agent: agent.clone(),
                    runtime: runtime.clone(),
                    trust: trust.clone(),
                    board: board.clone(),
                    plugin_dir: plugin_dir.clone(),
                    stores: args.policy_stores.clone(),
                    poke,
                };
                tokio::spawn(crate::kube::backend_policies::run(c.client.clone(), node.clone(), listing.clone(), rollouts));
            }
            if !local_classes.is_empty() {
                let state = Arc::new(crate::socket::local_report::LocalState::default());
                board.manage_local(state.clone());
                let config = crate::kube::local_volumes::LocalConfig { classes: local_classes.clone(), interval: args.local_scan_interval };
                tokio::spawn(crate::kube::local_volumes::run(agent.clone(), c.clone(), config, state));
            }
        } else if !local_classes.is_empty() {
            tracing::warn!("--local-class needs a cluster (--kubeconfig or --in-cluster): local volumes are not published");
        }
        serving.store(true, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(node, socket = %socket.display(), backends = ?backends, "volagent agent serving");
        tokio::select! {
            r = server::serve(listener, agent, board, server_config) => r.context("socket server")?,
            _ = interrupt.recv() => tracing::info!("interrupted"),
            _ = term.recv() => tracing::info!("terminated"),
        }
        remove_socket(&socket);
        if let Some(csi) = &csi {
            csi.stop_all();
        }
        if let Err(e) = ledger.flush() {
            tracing::error!("the last attachment records were not stored: {e}");
        }
        anyhow::Ok(ExitCode::SUCCESS)
    });
    // A step hanging in the kernel must not hold the exit back: its
    // thread is left behind (reconciliation at the next start settles the
    // volume). Without a bound, dropping the runtime waits for it.
    if let Some(threads) = csi_threads {
        threads.stop(EXIT_GRACE);
    }
    rt.shutdown_timeout(EXIT_GRACE);
    served
}

/// How often ended helpers and clients are looked for.
const HEAL_EVERY: Duration = Duration::from_millis(500);

/// How long the agent's exit waits for steps still running.
const EXIT_GRACE: Duration = Duration::from_secs(5);

/// Start again the helpers and clients that ended under a mounted volume
/// (at once, for an agent that has just started: it keeps what the last
/// one started), and hand a restarted helper to the kernel devices it
/// served, then every `HEAL_EVERY`; check the userspace NBD clients'
/// servers a few times per `hung_after`.
fn spawn_nbd_watchdog(sys: &crate::sys::Sys, hung_after: Duration) {
    let helpers = sys.export_helpers.clone();
    let clients = sys.fuse_clients.clone();
    let reconnects = crate::sys::nbd::kernel::Reconnects::start(
        sys.kernel_nbd.clone(),
        helpers.clone(),
        hung_after,
    );
    let every = (hung_after / 4).clamp(Duration::from_millis(250), Duration::from_secs(15));
    let spawned = std::thread::Builder::new().name("nbd-watchdog".into()).spawn(move || {
        let mut checked = std::time::Instant::now();
        loop {
            reconnects.healed(helpers.heal());
            clients.heal(hung_after);
            if checked.elapsed() >= every {
                clients.abort_hung(hung_after);
                checked = std::time::Instant::now();
            }
            std::thread::sleep(HEAL_EVERY.min(every));
        }
    });
    if let Err(e) = spawned {
        tracing::error!("hung NBD clients will not be detected: {e}");
    }
}

fn remove_socket(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        tracing::warn!(socket = %path.display(), "cannot remove the socket: {e}");
    }
}
