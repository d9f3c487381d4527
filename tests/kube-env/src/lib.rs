//! Test support: a real etcd + kube-apiserver on loopback, and (in
//! [`node`]) kube-controller-manager, containerd and kubelets for the
//! kubelet tier.
//!
//! [`KubeEnv::start`] starts an independent single-node cluster — an etcd and
//! a kube-apiserver (1.20.2) as child processes, on free loopback ports, with
//! everything in a private temporary directory — and waits until the API
//! server reports ready. Dropping the [`KubeEnv`] kills both and removes the
//! directory. The children also get `SIGKILL` if the test process dies.
//!
//! The binaries come from `$KUBEBUILDER_ASSETS` when that is set, otherwise
//! from the cache `scripts/kube-assets` fills
//! (`${XDG_CACHE_HOME:-~/.cache}/volagent/kube-assets/1.20.2/`). When they
//! are missing, [`KubeEnv::start`] fails (it does not skip) and says to run
//! `scripts/kube-assets`.
//!
//! Authentication is by static tokens: [`ADMIN_USER`] is in `system:masters`,
//! [`AGENT_USER`] is in no group, so it can do only what RBAC objects a test
//! creates grant it. Authorization is RBAC. [`KubeEnv::start`] starts no
//! controller-manager or scheduler: nothing garbage-collects, creates service
//! accounts or schedules pods, and the `ServiceAccount` admission plugin is
//! off so that pods can be created at all. An in-cluster env
//! ([`Options::in_cluster`], with [`node::ControllerManager::start_for_workloads`]
//! and [`node::Scheduler`]) is a whole cluster: pods get service-account
//! tokens and reach the API server at the `kubernetes` Service's address.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read as _};
use std::net::TcpListener;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use std::sync::Arc;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

pub mod node;
mod ns;

pub use ns::Namespaces;

/// The Kubernetes version `scripts/kube-assets` builds.
pub const KUBE_VERSION: &str = "1.20.2";
/// A user in `system:masters`: may do everything.
pub const ADMIN_USER: &str = "admin";
/// A user in no group: may do only what the test's RBAC objects grant.
pub const AGENT_USER: &str = "volagent-agent";

/// The `kubernetes` Service's ClusterIP (the first of the service range):
/// where pods find the API server. In an in-cluster env it is an address of
/// the namespace's loopback, so it needs no kube-proxy.
pub const SERVICE_IP: &str = "10.0.0.1";
/// The API server's advertised address in an in-cluster env (the
/// `kubernetes` Endpoints), also on the namespace's loopback.
pub const CONTROL_PLANE_IP: &str = "10.245.255.254";

/// How long etcd, and then the API server, may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Attempts with fresh ports when a port picked as free was taken meanwhile.
const PORT_ATTEMPTS: usize = 3;

/// How [`KubeEnv::start_with`] sets up the cluster.
#[derive(Clone, Default)]
pub struct Options {
    /// Where etcd and the API server run: the caller's namespaces, or the
    /// process's.
    pub namespaces: Option<Arc<Namespaces>>,
    /// Serve pods as a cluster does: the API server listens on port 443 of
    /// every address, [`SERVICE_IP`] and [`CONTROL_PLANE_IP`] are added to
    /// the loopback of `namespaces` (which must hold a private network
    /// namespace), and the `ServiceAccount` admission plugin is on, so that
    /// pods get service-account tokens (kube-controller-manager's token
    /// controller makes them, see [`KubeEnv::ca_file`]) and find the API
    /// server through `KUBERNETES_SERVICE_HOST`.
    pub in_cluster: bool,
}

/// A running etcd + kube-apiserver; see the crate documentation.
pub struct KubeEnv {
    dir: tempfile::TempDir,
    apiserver_bin: PathBuf,
    apiserver_args: Vec<OsString>,
    url: String,
    users: Vec<User>,
    etcd: Mutex<Option<Child>>,
    apiserver: Mutex<Option<Child>>,
    /// Where the children run: the caller's namespaces, or the process's.
    namespaces: Option<Arc<Namespaces>>,
    sa_key: PathBuf,
}

struct User {
    name: &'static str,
    kubeconfig: PathBuf,
    config: kube::Config,
}

impl KubeEnv {
    /// Starts a new, independent cluster and waits until its API server is
    /// ready (a few seconds).
    pub async fn start() -> anyhow::Result<KubeEnv> {
        KubeEnv::start_in(None).await
    }

    /// Like [`Self::start`], with etcd and the API server in `namespaces`
    /// (e.g. a test's private network namespace, where its kubelets run).
    pub async fn start_in(namespaces: Option<Arc<Namespaces>>) -> anyhow::Result<KubeEnv> {
        KubeEnv::start_with(Options { namespaces, in_cluster: false }).await
    }

    /// Starts a cluster as `options` say; see [`Options`].
    pub async fn start_with(options: Options) -> anyhow::Result<KubeEnv> {
        let Options { namespaces, in_cluster } = options;
        if in_cluster {
            let ns = namespaces
                .as_deref()
                .context("an in-cluster kube-env needs a private network namespace")?;
            for ip in [SERVICE_IP, CONTROL_PLANE_IP] {
                let mut cmd = Command::new("ip");
                cmd.args(["addr", "add", &format!("{ip}/32"), "dev", "lo"]);
                node::run_in(cmd, Some(ns), &format!("ip addr add {ip}/32 dev lo"))?;
            }
        }
        let assets = assets_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("volagent-kube-env-")
            .tempdir()
            .context("creating the kube-env directory")?;
        let d = dir.path();

        let sa_key = d.join("service-account.key");
        let out = tokio::process::Command::new("openssl")
            .args(["genrsa", "-out"])
            .arg(&sa_key)
            .arg("2048")
            .output()
            .await
            .context(
                "running `openssl genrsa` for the service-account key (is openssl installed?)",
            )?;
        if !out.status.success() {
            bail!("openssl genrsa failed: {}", String::from_utf8_lossy(&out.stderr));
        }

        let admin_token = random_token()?;
        let agent_token = random_token()?;
        let tokens = d.join("tokens.csv");
        fs::write(
            &tokens,
            format!(
                "{admin_token},{ADMIN_USER},{ADMIN_USER},\"system:masters\"\n\
                 {agent_token},{AGENT_USER},{AGENT_USER}\n"
            ),
        )
        .context("writing the token file")?;

        // etcd, on fresh ports until one pair is really free.
        let etcd_data = d.join("etcd");
        let etcd_log = d.join("etcd.log");
        let mut attempt = 0;
        let (etcd, etcd_url) = loop {
            attempt += 1;
            let (client_port, peer_port) = {
                let ports = free_ports(2)?;
                (ports[0], ports[1])
            };
            let client_url = format!("http://127.0.0.1:{client_port}");
            let peer_url = format!("http://127.0.0.1:{peer_port}");
            let mut cmd = Command::new(assets.join("etcd"));
            cmd.current_dir(d)
                .arg("--name=default")
                .arg(arg("--data-dir=", &etcd_data))
                .arg(format!("--listen-client-urls={client_url}"))
                .arg(format!("--advertise-client-urls={client_url}"))
                .arg(format!("--listen-peer-urls={peer_url}"))
                .arg(format!("--initial-advertise-peer-urls={peer_url}"))
                .arg(format!("--initial-cluster=default={peer_url}"))
                .arg("--logger=zap")
                .arg("--log-outputs=stderr");
            if std::env::consts::ARCH == "aarch64" {
                // etcd 3.4 refuses to start on arm64 unless told.
                cmd.env("ETCD_UNSUPPORTED_ARCH", "arm64");
            }
            let mut child = spawn_in(cmd, &etcd_log, false, namespaces.as_deref())
                .with_context(|| format!("starting {}", assets.join("etcd").display()))?;
            match wait_etcd(&mut child, client_port, &etcd_log).await {
                Ok(()) => break (child, client_url),
                Err(e) => {
                    kill(&mut child);
                    if attempt < PORT_ATTEMPTS && port_clash(&etcd_log) {
                        let _ = fs::remove_dir_all(&etcd_data);
                        continue;
                    }
                    return Err(e);
                }
            }
        };

        let mut env = KubeEnv {
            apiserver_bin: assets.join("kube-apiserver"),
            apiserver_args: Vec::new(),
            url: String::new(),
            users: Vec::new(),
            etcd: Mutex::new(Some(etcd)),
            apiserver: Mutex::new(None),
            namespaces,
            sa_key: sa_key.clone(),
            dir,
        };
        let d = env.dir.path().to_owned();

        let mut attempt = 0;
        loop {
            attempt += 1;
            // In its own network namespace an in-cluster API server has
            // port 443 to itself.
            let port = if in_cluster { 443 } else { free_ports(1)?[0] };
            env.url = format!("https://127.0.0.1:{port}");
            let (bind, advertise) =
                if in_cluster { ("0.0.0.0", CONTROL_PLANE_IP) } else { ("127.0.0.1", "127.0.0.1") };
            env.apiserver_args = vec![
                format!("--etcd-servers={etcd_url}").into(),
                format!("--secure-port={port}").into(),
                format!("--bind-address={bind}").into(),
                format!("--advertise-address={advertise}").into(),
                arg("--cert-dir=", &d.join("certs")),
                arg("--token-auth-file=", &tokens),
                "--authorization-mode=RBAC".into(),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                arg("--service-account-key-file=", &sa_key),
                arg("--service-account-signing-key-file=", &sa_key),
                "--service-cluster-ip-range=10.0.0.0/24".into(),
                "--allow-privileged=true".into(),
                // Local volumes' capacity for the scheduler (alpha in 1.20).
                "--runtime-config=storage.k8s.io/v1alpha1=true".into(),
                "--feature-gates=CSIStorageCapacity=true".into(),
                "--profiling=false".into(),
            ];
            if !in_cluster {
                env.apiserver_args.push("--disable-admission-plugins=ServiceAccount".into());
            } else {
                // No kube-proxy: a Service (an admission webhook's) is
                // reached at its endpoints' pod addresses, not its ClusterIP.
                env.apiserver_args.push("--enable-aggregator-routing=true".into());
            }
            env.users = Vec::new();
            for (name, token) in [(ADMIN_USER, &admin_token), (AGENT_USER, &agent_token)] {
                let kubeconfig = if name == ADMIN_USER {
                    d.join("kubeconfig")
                } else {
                    d.join(format!("kubeconfig-{name}"))
                };
                write_kubeconfig(&kubeconfig, &env.url, name, token)?;
                let config = config_from(&kubeconfig).await?;
                env.users.push(User { name, kubeconfig, config });
            }
            match env.run_apiserver(attempt > 1).await {
                Ok(()) => return Ok(env),
                Err(e) => {
                    env.stop_apiserver();
                    if attempt < PORT_ATTEMPTS && port_clash(&env.apiserver_log()) {
                        continue;
                    }
                    return Err(e);
                }
            }
        }
    }

    /// A client acting as [`ADMIN_USER`] (`system:masters`).
    ///
    /// Panics outside a Tokio runtime, like every `kube::Client`.
    pub fn client(&self) -> kube::Client {
        kube::Client::try_from(self.users[0].config.clone())
            .expect("a kube client from the env's own kubeconfig")
    }

    /// A client acting as `user`, one of [`ADMIN_USER`] and [`AGENT_USER`].
    pub fn client_for(&self, user: &str) -> anyhow::Result<kube::Client> {
        let config = self.user(user)?.config.clone();
        kube::Client::try_from(config).context("building a kube client")
    }

    /// A kubeconfig file for [`ADMIN_USER`] (token auth,
    /// `insecure-skip-tls-verify`), for child processes.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.users[0].kubeconfig
    }

    /// A kubeconfig file for `user`, one of [`ADMIN_USER`] and [`AGENT_USER`].
    pub fn kubeconfig_path_for(&self, user: &str) -> anyhow::Result<&Path> {
        Ok(&self.user(user)?.kubeconfig)
    }

    /// A token of ServiceAccount `namespace/name` from the TokenRequest
    /// API, valid for `seconds`; bound to pod `bound_pod` (its name and UID)
    /// when given, as kubelet's projected tokens are: the API server then
    /// puts the pod's name and UID into the user's extra fields, and the
    /// token dies with the pod.
    pub async fn service_account_token(
        &self,
        namespace: &str,
        name: &str,
        bound_pod: Option<(&str, &str)>,
        seconds: i64,
    ) -> anyhow::Result<String> {
        use k8s_openapi::api::authentication::v1::{
            BoundObjectReference, TokenRequest, TokenRequestSpec,
        };
        use k8s_openapi::api::core::v1::ServiceAccount;
        let api: kube::Api<ServiceAccount> = kube::Api::namespaced(self.client(), namespace);
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(seconds),
                bound_object_ref: bound_pod.map(|(pod, uid)| BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(pod.into()),
                    uid: Some(uid.into()),
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let answer = api
            .create_token_request(name, &Default::default(), &request)
            .await
            .with_context(|| format!("a token of ServiceAccount {namespace}/{name}"))?;
        answer.status.and_then(|s| s.token).context("the TokenRequest answered no token")
    }

    /// A kubeconfig at `path` for this API server that authenticates with
    /// `token` (as user `user` in its contexts), for child processes.
    pub fn kubeconfig_with_token(
        &self,
        path: &Path,
        user: &str,
        token: &str,
    ) -> anyhow::Result<()> {
        write_kubeconfig(path, &self.url, user, token)
    }

    /// The API server's URL, `https://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The certificate the API server serves (its self-signed serving
    /// certificate followed by the CA that signed it): what pods must trust,
    /// kube-controller-manager's `--root-ca-file`.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("certs/apiserver.crt")
    }

    /// The key service-account tokens are signed with (and checked by the
    /// API server): kube-controller-manager's
    /// `--service-account-private-key-file`.
    pub fn service_account_key(&self) -> &Path {
        &self.sa_key
    }

    /// The env's private directory (logs: `etcd.log`, `kube-apiserver.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Kills the API server (`SIGKILL`) and waits for it; etcd keeps
    /// running. Requests fail until [`Self::start_apiserver`]. Does nothing
    /// if it is not running.
    pub fn stop_apiserver(&self) {
        if let Some(mut child) = lock(&self.apiserver).take() {
            kill(&mut child);
        }
    }

    /// Starts the API server again, on the same port with the same etcd, and
    /// waits until it is ready. Does nothing but wait if it is running.
    pub async fn start_apiserver(&self) -> anyhow::Result<()> {
        self.run_apiserver(true).await
    }

    async fn run_apiserver(&self, append_log: bool) -> anyhow::Result<()> {
        let log = self.apiserver_log();
        {
            let mut slot = lock(&self.apiserver);
            if slot.is_none() {
                let mut cmd = Command::new(&self.apiserver_bin);
                cmd.current_dir(self.dir.path()).args(&self.apiserver_args);
                let child = spawn_in(cmd, &log, append_log, self.namespaces.as_deref())
                    .with_context(|| format!("starting {}", self.apiserver_bin.display()))?;
                *slot = Some(child);
            }
        }

        let mut probe = self.users[0].config.clone();
        probe.default_retry = false;
        probe.connect_timeout = Some(Duration::from_secs(2));
        probe.read_timeout = Some(Duration::from_secs(5));
        let probe = kube::Client::try_from(probe).context("building the readiness client")?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = exited(&self.apiserver)? {
                bail!("kube-apiserver exited ({status}) before it was ready\n{}", log_tail(&log));
            }
            let request = http::Request::get("/readyz").body(Vec::new())?;
            let Err(last) = probe.request_text(request).await else { return Ok(()) };
            if Instant::now() > deadline {
                bail!(
                    "kube-apiserver not ready after {READY_TIMEOUT:?} (last: {last})\n{}",
                    log_tail(&log)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn apiserver_log(&self) -> PathBuf {
        self.dir.path().join("kube-apiserver.log")
    }

    fn user(&self, user: &str) -> anyhow::Result<&User> {
        self.users.iter().find(|u| u.name == user).with_context(|| {
            format!("kube-env has no user {user:?}; it has {ADMIN_USER:?} and {AGENT_USER:?}")
        })
    }
}

impl Drop for KubeEnv {
    fn drop(&mut self) {
        self.stop_apiserver();
        if let Some(mut child) = lock(&self.etcd).take() {
            kill(&mut child);
        }
        if std::thread::panicking() {
            // The directory (and its logs) goes away; show what the API server said.
            eprintln!("{}", log_tail(&self.apiserver_log()));
        }
    }
}

/// The directory with `etcd` and `kube-apiserver` (and, from
/// `scripts/kube-assets`, `kube-controller-manager` and `kubelet`).
pub fn assets_dir() -> anyhow::Result<PathBuf> {
    let has = |d: &Path| is_executable(&d.join("etcd")) && is_executable(&d.join("kube-apiserver"));
    if let Some(d) = std::env::var_os("KUBEBUILDER_ASSETS").filter(|d| !d.is_empty()) {
        let d = PathBuf::from(d);
        if has(&d) {
            return Ok(d);
        }
        bail!(
            "KUBEBUILDER_ASSETS={} holds no executable etcd and kube-apiserver; \
             unset it and run scripts/kube-assets, or point it at a directory that has them",
            d.display()
        );
    }
    let d = cache_dir()
        .context("neither KUBEBUILDER_ASSETS nor HOME is set")?
        .join("kube-assets")
        .join(KUBE_VERSION);
    if has(&d) {
        return Ok(d);
    }
    bail!(
        "etcd and kube-apiserver not found in {} and KUBEBUILDER_ASSETS is not set: \
         run scripts/kube-assets once (it builds kube-apiserver {KUBE_VERSION}, about 7 minutes) \
         or set KUBEBUILDER_ASSETS to a directory holding both",
        d.display()
    )
}

/// `${XDG_CACHE_HOME:-~/.cache}/volagent`, where the scripts keep what they
/// build; None without a HOME.
pub(crate) fn cache_dir() -> Option<PathBuf> {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|c| c.join("volagent"))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

pub(crate) fn arg(flag: &str, path: &Path) -> OsString {
    let mut s = OsString::from(flag);
    s.push(path);
    s
}

/// `n` distinct loopback ports that were free a moment ago.
pub fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    // Hold every listener until all are picked, so that they differ.
    let listeners = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<io::Result<Vec<_>>>()
        .context("picking a free loopback port")?;
    listeners.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

fn port_clash(log: &Path) -> bool {
    fs::read_to_string(log).is_ok_and(|s| s.contains("address already in use"))
}

fn random_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 16];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn write_kubeconfig(path: &Path, url: &str, user: &str, token: &str) -> anyhow::Result<()> {
    let kubeconfig = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{
            "name": "kube-env",
            "cluster": { "server": url, "insecure-skip-tls-verify": true },
        }],
        "users": [{ "name": user, "user": { "token": token } }],
        "contexts": [{
            "name": user,
            "context": { "cluster": "kube-env", "user": user, "namespace": "default" },
        }],
        "current-context": user,
    });
    fs::write(path, serde_json::to_vec_pretty(&kubeconfig)?)
        .with_context(|| format!("writing {}", path.display()))
}

async fn config_from(kubeconfig: &Path) -> anyhow::Result<kube::Config> {
    let parsed = kube::config::Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    kube::Config::from_custom_kubeconfig(parsed, &kube::config::KubeConfigOptions::default())
        .await
        .with_context(|| format!("loading {}", kubeconfig.display()))
}

/// Waits until etcd answers `/health` with `"health":"true"`.
async fn wait_etcd(child: &mut Child, port: u16, log: &Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("etcd exited ({status}) before it was ready\n{}", log_tail(log));
        }
        if etcd_healthy(port).await {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("etcd not ready after {READY_TIMEOUT:?}\n{}", log_tail(log));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn etcd_healthy(port: u16) -> bool {
    let ask = async {
        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        conn.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").await?;
        let mut answer = Vec::new();
        conn.read_to_end(&mut answer).await?;
        io::Result::Ok(String::from_utf8_lossy(&answer).contains(r#""health":"true""#))
    };
    matches!(tokio::time::timeout(Duration::from_secs(2), ask).await, Ok(Ok(true)))
}

fn lock(m: &Mutex<Option<Child>>) -> MutexGuard<'_, Option<Child>> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn exited(m: &Mutex<Option<Child>>) -> anyhow::Result<Option<String>> {
    match lock(m).as_mut() {
        None => Ok(Some("stopped".into())),
        Some(child) => Ok(child.try_wait()?.map(|s| s.to_string())),
    }
}

fn kill(child: &mut Child) {
    let _ = child.kill(); // SIGKILL
    let _ = child.wait();
}

/// The last lines of a log file, for error messages.
pub fn log_tail(log: &Path) -> String {
    const LINES: usize = 40;
    match fs::read_to_string(log) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            let from = lines.len().saturating_sub(LINES);
            let tail = &lines[from..];
            // A Go daemon's fatal error (klog's `F` lines, a panic) comes
            // before the goroutine dump that fills the tail: named first.
            let fatal: Vec<&str> = lines[..from]
                .iter()
                .filter(|l| {
                    let b = l.as_bytes();
                    (b.len() > 5 && b[0] == b'F' && b[1..5].iter().all(u8::is_ascii_digit))
                        || l.starts_with("panic:")
                        || l.starts_with("fatal error:")
                })
                .take(5)
                .copied()
                .collect();
            let fatal = if fatal.is_empty() {
                String::new()
            } else {
                format!("--- its fatal lines ---\n{}\n", fatal.join("\n"))
            };
            format!("{fatal}--- last lines of {} ---\n{}", log.display(), tail.join("\n"))
        }
        Err(e) => format!("({}: {e})", log.display()),
    }
}

/// Starts `cmd` with stdout and stderr going to `log`, and with `SIGKILL` as
/// its parent-death signal, so it dies with the test process; in
/// `namespaces` when given.
pub fn spawn_in(
    mut cmd: Command,
    log: &Path,
    append: bool,
    namespaces: Option<&Namespaces>,
) -> anyhow::Result<Child> {
    let out = OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    cmd.stdin(Stdio::null()).stdout(out.try_clone()?).stderr(out);
    set_parent_death_signal(&mut cmd);
    if let Some(ns) = namespaces {
        ns.enter_on_exec(&mut cmd);
    }

    // The parent-death signal fires when the *thread* that forked the child
    // ends, not the process; Tokio's threads come and go. So children are
    // forked by one thread that lives as long as the process.
    type Job = (Command, mpsc::Sender<io::Result<Child>>);
    static SPAWNER: OnceLock<mpsc::Sender<Job>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("kube-env-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("starting the kube-env spawner thread");
        tx
    });
    let (reply, answer) = mpsc::channel();
    spawner.send((cmd, reply)).context("the kube-env spawner thread is gone")?;
    Ok(answer.recv().context("the kube-env spawner thread is gone")??)
}

#[allow(unsafe_code)]
fn set_parent_death_signal(cmd: &mut Command) {
    use nix::sys::signal::Signal;
    use nix::unistd::{Pid, getppid};
    let parent = Pid::from_raw(std::process::id() as i32);
    // SAFETY: the closure runs in the forked child before exec; it only makes
    // two system calls (prctl, getppid), which are async-signal-safe, and
    // neither allocates nor takes locks.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            // The parent may have died before prctl: then do not start at all.
            if getppid() != parent {
                return Err(io::Error::from(nix::errno::Errno::ESRCH));
            }
            Ok(())
        });
    }
}
