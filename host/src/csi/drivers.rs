//! The CSI drivers this agent serves, one per loaded backend: added when a
//! backend loads (at start or by hot reload), removed when its backend is
//! removed. Each has two sockets — the driver's own, and the registration
//! socket in kubelet's `plugins_registry`, whose appearance makes kubelet
//! register the driver and whose removal makes it deregister it.

use super::authority::AuthorityFix;
use super::identity::IdentityService;
use super::node::NodeService;
use super::proto::csi::identity_server::IdentityServer;
use super::proto::csi::node_server::NodeServer;
use super::proto::registration::registration_server::RegistrationServer;
use super::registration::{Registered, RegistrationService};
use crate::ops::Agent;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::net::UnixListener;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;

/// Where the driver of `backend` listens, under kubelet's root `root`.
pub fn socket_path(root: &Path, backend: &str) -> PathBuf {
    root.join("plugins").join(super::driver_name(backend)).join("csi.sock")
}

/// Where the registration socket of `backend`'s driver goes.
pub fn registration_path(root: &Path, backend: &str) -> PathBuf {
    root.join("plugins_registry").join(format!("{}-reg.sock", super::driver_name(backend)))
}

struct Running {
    stop: tokio::sync::watch::Sender<bool>,
    socket: PathBuf,
    registration: PathBuf,
    state: Arc<Mutex<Registered>>,
}

pub struct Drivers {
    agent: Arc<Agent>,
    /// The agent's runtime: the registration sockets are served there.
    rt: tokio::runtime::Handle,
    /// The CSI threads' runtimes ([`super::threads`]): each accepts on
    /// every driver's socket.
    threads: Vec<tokio::runtime::Handle>,
    allowed_uids: Vec<u32>,
    running: Mutex<BTreeMap<String, Running>>,
    /// Until [`Drivers::start`] (the agent has reconciled), backends added
    /// wait here: no call may meet a node not yet repaired.
    waiting: Mutex<Option<std::collections::BTreeSet<String>>>,
}

impl std::fmt::Debug for Drivers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drivers").field("backends", &self.backends()).finish()
    }
}

/// Accepted connections from peers whose uid is allowed (others are
/// closed), their header blocks mended for older kubelets.
fn allowed(
    listener: UnixListener,
    uids: Vec<u32>,
    what: &'static str,
) -> impl tokio_stream::Stream<Item = std::io::Result<AuthorityFix<tokio::net::UnixStream>>> {
    UnixListenerStream::new(listener)
        .filter(move |conn| match conn {
            Ok(stream) => match stream.peer_cred() {
                Ok(cred) if uids.contains(&cred.uid()) => true,
                Ok(cred) => {
                    tracing::warn!(
                        uid = cred.uid(),
                        socket = what,
                        "refused a connection from a peer that is not allowed"
                    );
                    false
                }
                Err(e) => {
                    tracing::warn!(
                        socket = what,
                        "refused a connection whose peer is unknown: {e}"
                    );
                    false
                }
            },
            Err(_) => true,
        })
        .map(|conn| conn.map(AuthorityFix::new))
}

impl Drivers {
    pub fn new(
        agent: Arc<Agent>,
        rt: tokio::runtime::Handle,
        threads: Vec<tokio::runtime::Handle>,
        allowed_uids: Vec<u32>,
    ) -> Drivers {
        Drivers {
            agent,
            rt,
            threads,
            allowed_uids,
            running: Mutex::default(),
            waiting: Mutex::new(Some(Default::default())),
        }
    }

    /// Serve the drivers of the backends added so far, and from now on
    /// each as it is added.
    pub fn start(&self) {
        let waiting =
            self.waiting.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or_default();
        for backend in waiting {
            if let Err(e) = self.add(&backend) {
                tracing::error!(backend, "CSI driver not served: {e}");
            }
        }
    }

    fn running(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Running>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The backends whose drivers are served, and what kubelet said of each.
    pub fn backends(&self) -> Vec<(String, Registered)> {
        self.running()
            .iter()
            .map(|(b, r)| (b.clone(), r.state.lock().unwrap_or_else(|p| p.into_inner()).clone()))
            .collect()
    }

    /// Serve `router` on `listener` (registered with `rt`) to allowed peers
    /// until `until` changes, on `rt`.
    fn serve(
        &self,
        rt: &tokio::runtime::Handle,
        router: tonic::transport::server::Router,
        listener: UnixListener,
        socket: &'static str,
        mut until: tokio::sync::watch::Receiver<bool>,
        what: String,
    ) {
        let incoming = allowed(listener, self.allowed_uids.clone(), socket);
        rt.spawn(async move {
            let stopped = async move {
                let _ = until.changed().await;
            };
            if let Err(e) = router.serve_with_incoming_shutdown(incoming, stopped).await {
                tracing::error!("{what} stopped serving: {e}");
            }
        });
    }

    /// Serve `backend`'s driver socket on every CSI thread: each accepts
    /// connections of its own from the one socket.
    fn serve_driver(
        &self,
        backend: &str,
        listener: std::os::unix::net::UnixListener,
        until: &tokio::sync::watch::Receiver<bool>,
        what: &str,
    ) -> std::io::Result<()> {
        let router = || {
            let node = NodeServer::new(NodeService {
                agent: self.agent.clone(),
                backend: backend.to_string(),
            })
            .max_decoding_message_size(super::MAX_MESSAGE);
            let identity = IdentityServer::new(IdentityService {
                agent: self.agent.clone(),
                backend: backend.to_string(),
            })
            .max_decoding_message_size(super::MAX_MESSAGE);
            tonic::transport::Server::builder().add_service(identity).add_service(node)
        };
        // Every thread's listener first, each registered with the runtime
        // that serves it: a failure serves none.
        let mut listeners = Vec::with_capacity(self.threads.len());
        for rt in &self.threads {
            let _entered = rt.enter();
            listeners.push(UnixListener::from_std(listener.try_clone()?)?);
        }
        if listeners.is_empty() {
            return Err(std::io::Error::other("no CSI thread to serve it"));
        }
        for (rt, l) in self.threads.iter().zip(listeners) {
            self.serve(rt, router(), l, "csi", until.clone(), what.to_string());
        }
        Ok(())
    }

    /// Serve `backend`'s driver (already served is fine).
    pub fn add(&self, backend: &str) -> Result<(), String> {
        if let Some(waiting) = self.waiting.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            waiting.insert(backend.to_string());
            return Ok(());
        }
        let mut running = self.running();
        if running.contains_key(backend) {
            return Ok(());
        }
        let config = &self.agent.node.config;
        let driver = super::driver_name(backend);
        let socket = socket_path(&config.kubelet_root, backend);
        let registration = registration_path(&config.kubelet_root, backend);
        // kubelet dials the endpoint as it spells its root.
        let endpoint = socket_path(&config.kubelet_root_given, backend).display().to_string();
        let driver_listener =
            crate::listener::bind_std(&socket).map_err(|e| format!("CSI driver {driver}: {e}"))?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        if let Err(e) =
            self.serve_driver(backend, driver_listener, &stopped, &format!("CSI driver {driver}"))
        {
            remove(&socket);
            return Err(format!("CSI driver {driver}: {}: {e}", socket.display()));
        }
        // The registration socket last: kubelet calls the driver as soon as
        // it sees it.
        let state = Arc::new(Mutex::new(Registered::NotYet));
        let _entered = self.rt.enter();
        let reg_listener = match crate::listener::bind(&registration) {
            Ok(l) => l,
            Err(e) => {
                let _ = stop.send(true);
                remove(&socket);
                return Err(format!("CSI driver {driver}: {e}"));
            }
        };
        let service = RegistrationServer::new(RegistrationService {
            driver: driver.clone(),
            endpoint,
            state: state.clone(),
        })
        .max_decoding_message_size(64 << 10);
        let router = tonic::transport::Server::builder().add_service(service);
        self.serve(
            &self.rt,
            router,
            reg_listener,
            "registration",
            stopped,
            format!("CSI registration of {driver}"),
        );
        tracing::info!(backend, driver, socket = %socket.display(), registration = %registration.display(), "CSI driver serving");
        running.insert(backend.to_string(), Running { stop, socket, registration, state });
        Ok(())
    }

    /// Stop serving `backend`'s driver: the registration socket goes
    /// first, so kubelet deregisters the driver before its socket closes.
    pub fn remove(&self, backend: &str) {
        if let Some(waiting) = self.waiting.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            waiting.remove(backend);
        }
        let Some(r) = self.running().remove(backend) else { return };
        remove(&r.registration);
        let _ = r.stop.send(true);
        remove(&r.socket);
        if let Some(dir) = r.socket.parent() {
            let _ = std::fs::remove_dir(dir);
        }
        tracing::info!(backend, "CSI driver removed");
    }

    /// Stop every driver (the agent is stopping). The registration sockets
    /// go too: kubelet sees the drivers gone until the agent is back.
    pub fn stop_all(&self) {
        let backends: Vec<String> = self.running().keys().cloned().collect();
        for b in backends {
            self.remove(&b);
        }
    }
}

fn remove(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(socket = %path.display(), "cannot remove the socket: {e}"),
    }
}
