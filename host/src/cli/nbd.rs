//! `volagent nbd serve`: the agent's NBD server on its own, exporting
//! local files or block devices, or Ceph RBD images through librbd (for
//! tests, benchmarks, the agent's helper servers, and nodes that serve a
//! disk to others: over a Unix socket or loopback, or beyond loopback over
//! TLS to clients with certificates); and `volagent nbd fuse`, the
//! agent's userspace client, which serves an export as a file.

use crate::nbd::{ClientAuth, Exports, Listener, Server, Settings, Timeouts};
use crate::sys::export_file::FileExport;
use anyhow::Context;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

// Parsed once per process: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, clap::Subcommand)]
pub enum NbdCommand {
    /// Serve exports until SIGTERM or Ctrl-C.
    Serve(ServeArgs),
    /// Serve an export as the file FILE (its dir becomes a FUSE mount)
    /// until the mount is unmounted: how the agent attaches an export on a
    /// node without the kernel's nbd driver.
    Fuse(FuseArgs),
}

#[derive(Debug, clap::Args)]
pub struct FuseArgs {
    /// The server: "unix:PATH" or "HOST:PORT".
    #[arg(long)]
    server: String,
    /// The export's name (empty: the default export).
    #[arg(long, default_value = "")]
    export: String,
    /// Up to this many connections, when the server allows more than one.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u8).range(1..=16))]
    connections: u8,
    /// Refuse writes.
    #[arg(long)]
    read_only: bool,
    /// Ask the server for the export's size again at each stat of the file
    /// (a connection of its own each time): for servers whose exports grow,
    /// as the agent's helper does when an rbd image is resized. Without
    /// it, the size the server said at connect is served.
    #[arg(long)]
    follow_size: bool,
    /// Write this process's pid here once the file is served.
    #[arg(long, value_name = "FILE")]
    pid_file: Option<PathBuf>,
    /// Serve the FUSE connection open on standard input, already mounted
    /// at FILE's dir by a client that ended (its keeper hands it over),
    /// instead of mounting a new one.
    #[arg(long)]
    connection_stdin: bool,
    /// Send a request again on a new connection when its connection broke
    /// (for up to 30 s), instead of failing it: only for a server that
    /// keeps every write it acknowledged when it ends (the agent's helper
    /// serving a local file).
    #[arg(long)]
    reconnect: bool,
    /// `<mount dir>/<file name>`.
    file: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Listen on this Unix socket.
    #[arg(long, required_unless_present = "tcp")]
    unix: Option<PathBuf>,
    /// Listen on this TCP address: beyond loopback only with TLS and
    /// --tls-client-ca (or --allow-unauthenticated-clients).
    #[arg(long, conflicts_with = "unix")]
    tcp: Option<std::net::SocketAddr>,
    /// Require TLS (STARTTLS) of every client, with this PEM certificate
    /// chain (leaf first)...
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// ...and this PEM private key.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// With TLS: clients must present a certificate this PEM CA signed.
    #[arg(long, requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Serve a --tcp address beyond loopback over TLS without
    /// --tls-client-ca: any client that reaches it may read and write the
    /// exports.
    #[arg(long, requires = "tcp")]
    allow_unauthenticated_clients: bool,
    /// Close a connection that sends no request for this long ("10m");
    /// 0, the default, never does: the kernel's nbd driver, nbdfuse and qemu
    /// stay connected, silent, while their volume is idle.
    #[arg(long, default_value = "0", value_parser = humantime::parse_duration)]
    idle_timeout: std::time::Duration,
    /// Once a request has begun, each read of it and each write of its
    /// reply must make progress within this ("30s").
    #[arg(long, default_value = "30s", value_parser = positive_duration)]
    request_timeout: std::time::Duration,
    /// NAME=PATH: serve the file or block device PATH as export NAME
    /// (repeatable; an empty NAME is the default export).
    #[arg(long = "export", value_name = "NAME=PATH", required_unless_present_any = ["export_stdin", "rbd_exports"], value_parser = parse_export)]
    exports: Vec<(String, PathBuf)>,
    /// Serve the file or block device open on standard input as export
    /// NAME: how the agent hands its helper a file it opened beneath its roots.
    #[arg(long, value_name = "NAME")]
    export_stdin: Option<String>,
    /// NAME=POOL/IMAGE: serve the Ceph RBD image as export NAME, through
    /// librbd (repeatable), with the --ceph-* options below.
    #[arg(long = "export-rbd", value_name = "NAME=POOL/IMAGE", value_parser = parse_rbd_export)]
    rbd_exports: Vec<(String, String, String)>,
    /// The ceph.conf naming the cluster's monitors.
    #[arg(long, value_name = "FILE")]
    ceph_conf: Option<PathBuf>,
    /// The cluster's monitors ("host:port,…"), instead of or over the conf.
    #[arg(long, value_name = "ADDRS")]
    ceph_monitors: Option<String>,
    /// The Ceph user, without "client.".
    #[arg(long, default_value = "admin")]
    ceph_user: String,
    /// A keyring file with the user's key.
    #[arg(long, value_name = "FILE")]
    ceph_keyring: Option<PathBuf>,
    /// Write each RBD export's Ceph client ("<global id> <address>") to
    /// this file once it has opened its image.
    #[arg(long, value_name = "FILE", requires = "rbd_exports")]
    ceph_client_file: Option<PathBuf>,
    /// Take the RBD exports over from the Ceph client at ADDRESS
    /// (repeatable), a helper that ended: refuse if it was blocklisted
    /// (the node was fenced) or if another client holds the image's lock;
    /// break its lock, without blocklisting it, if it holds it. The
    /// agent's way to start a helper again in place of one it saw end.
    /// Never name a client that may still be running.
    #[arg(long, value_name = "ADDRESS", requires = "rbd_exports")]
    ceph_break_lock_of: Vec<String>,
    /// Refuse writes.
    #[arg(long)]
    read_only: bool,
    /// Clients served at once.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    max_connections: u64,
}

fn exports_count(args: &ServeArgs) -> usize {
    args.exports.len() + args.rbd_exports.len() + usize::from(args.export_stdin.is_some())
}

fn positive_duration(s: &str) -> Result<std::time::Duration, String> {
    match humantime::parse_duration(s) {
        Ok(d) if d.is_zero() => Err("must be more than 0".into()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.to_string()),
    }
}

fn parse_rbd_export(s: &str) -> Result<(String, String, String), String> {
    let (name, image) = s.split_once('=').ok_or("expected NAME=POOL/IMAGE")?;
    if name.len() > 4096 || name.contains('\0') {
        return Err("an export name is at most 4096 bytes, without NUL".into());
    }
    let (pool, image) = crate::sys::rbd_export::parse_image(image).ok_or("expected POOL/IMAGE")?;
    Ok((name.to_string(), pool.to_string(), image.to_string()))
}

fn parse_export(s: &str) -> Result<(String, PathBuf), String> {
    let (name, path) = s.split_once('=').ok_or("expected NAME=PATH")?;
    if name.len() > 4096 || name.contains('\0') {
        return Err("an export name is at most 4096 bytes, without NUL".into());
    }
    if path.is_empty() {
        return Err("the export's PATH is empty".into());
    }
    Ok((name.to_string(), PathBuf::from(path)))
}

pub fn run(command: NbdCommand) -> anyhow::Result<ExitCode> {
    let args = match command {
        NbdCommand::Serve(args) => args,
        NbdCommand::Fuse(args) => return fuse(&args),
    };
    let exports = Exports::default();
    let mut images = Vec::new();
    for (name, path) in &args.exports {
        let export =
            FileExport::open(path, args.read_only).with_context(|| format!("export {name:?}"))?;
        exports.insert(name, Arc::new(export));
    }
    for (name, pool, image) in &args.rbd_exports {
        let target = crate::sys::rbd_export::RbdTarget {
            client: crate::sys::rbd_export::CephClient {
                conf: args.ceph_conf.clone(),
                monitors: args.ceph_monitors.clone(),
                user: args.ceph_user.clone(),
                keyring: args.ceph_keyring.clone(),
                key: None,
            },
            pool: pool.clone(),
            image: image.clone(),
        };
        if !args.ceph_break_lock_of.is_empty() && !args.read_only {
            let dead = &args.ceph_break_lock_of;
            let broken = crate::sys::rbd_export::take_over_from(&target, dead)
                .with_context(|| format!("export {name:?}: take it over from {dead:?}"))?;
            for owner in broken {
                tracing::info!(export = %name, "broke the image's lock held by {owner}, which has ended");
            }
        }
        let export = Arc::new(
            crate::sys::rbd_export::RbdExport::open(&target, args.read_only)
                .with_context(|| format!("export {name:?}"))?,
        );
        if let Some(file) = &args.ceph_client_file {
            // Who this export is to the cluster: the agent places its
            // watcher on this node, and fencing names it to blocklist.
            let (id, address) = export.client();
            std::fs::write(file, format!("{id} {address}\n"))
                .with_context(|| format!("write {}", file.display()))?;
        }
        exports.insert(name, export.clone());
        images.push(export);
    }
    if let Some(name) = &args.export_stdin {
        use std::os::fd::AsFd;
        let fd = std::io::stdin().as_fd().try_clone_to_owned().context("standard input")?;
        let export = FileExport::from_file(
            std::fs::File::from(fd),
            std::path::Path::new("/dev/stdin"),
            args.read_only,
        )
        .with_context(|| format!("export {name:?} from standard input"))?;
        exports.insert(name, Arc::new(export));
    }
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            Some(crate::nbd::tls::server_config(cert, key, args.tls_client_ca.as_deref())?)
        }
        _ => None,
    };
    let clients = match (&tls, &args.tls_client_ca) {
        (None, _) => ClientAuth::None,
        (Some(_), None) => ClientAuth::Tls,
        (Some(_), Some(_)) => ClientAuth::Certificates,
    };
    let listener = match (&args.unix, args.tcp) {
        (Some(path), _) => Listener::unix(path),
        (None, Some(addr)) => Listener::tcp(addr, clients, args.allow_unauthenticated_clients),
        (None, None) => unreachable!("clap requires one"),
    }
    .context("nbd listener")?;
    let with_tls = tls.is_some();
    let timeouts = Timeouts {
        idle: (!args.idle_timeout.is_zero()).then_some(args.idle_timeout),
        request: args.request_timeout,
        ..Timeouts::default()
    };
    let settings = Settings { max_connections: args.max_connections as usize, tls, timeouts };
    let server = Server::start_with(listener, exports, settings).context("nbd server")?;
    tracing::info!(listener = %server.describe(), exports = exports_count(&args), tls = with_tls, "volagent nbd server serving");
    // Readiness for scripts: the socket exists and accepts from now on.
    println!("serving on {}", server.describe());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("SIGTERM handler")?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        anyhow::Ok(())
    })?;
    drop(server);
    close_images(images);
    Ok(ExitCode::SUCCESS)
}

/// Close each RBD image before exiting, once its connections have let go
/// of it: closing removes the image's watch at once, where a process that
/// just exits leaves it to time out (30 s), and the image would look in use
/// by a client that is gone.
fn close_images(images: Vec<Arc<crate::sys::rbd_export::RbdExport>>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    for mut image in images {
        loop {
            match Arc::try_unwrap(image) {
                Ok(last) => {
                    drop(last);
                    break;
                }
                Err(shared) if std::time::Instant::now() < deadline => {
                    image = shared;
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(_) => {
                    tracing::warn!(
                        "an RBD image is still in use by a connection at exit; its watch will time out"
                    );
                    break;
                }
            }
        }
    }
}

fn fuse(args: &FuseArgs) -> anyhow::Result<ExitCode> {
    if args.export.len() > 4096 || args.export.contains('\0') {
        anyhow::bail!("an export name is at most 4096 bytes, without NUL");
    }
    crate::sys::nbd::fuse_file::FuseFile {
        server: &args.server,
        export: &args.export,
        file: &args.file,
        connections: args.connections,
        read_only: args.read_only,
        follow_size: args.follow_size,
        pid_file: args.pid_file.as_deref(),
        handed: args
            .connection_stdin
            .then(|| std::io::stdin().as_fd().try_clone_to_owned())
            .transpose()
            .context("standard input: the FUSE connection handed over")?,
        reconnect: args.reconnect,
    }
    .serve()?;
    Ok(ExitCode::SUCCESS)
}
