//! `volagent mounter`: the node's long-running process that starts, on the
//! agent's request, the processes mounted volumes need (userspace NBD
//! clients, the agent's helper NBD servers, rbd-fuse, GlusterFS clients),
//! so that they live in the mounter's pod and not the agent's: the agent's
//! pod can then be replaced, killed or upgraded with no process a volume
//! needs inside it.
//!
//! It listens on a root-only Unix socket ([`crate::sys::launch::wire`]),
//! serves root peers only (`SO_PEERCRED`, as the agent's socket does), starts
//! only the programs a launch may name, and reaps what it started. It holds
//! no credentials and never talks to the API server.
//!
//! On SIGTERM (its pod is being replaced) it starts nothing more, asks each
//! userspace NBD client it started to answer the requests it holds and take
//! no more, waits for them, and ends. The agent keeps their connections and
//! starts successors in the next mounter: nothing a client took is lost,
//! even on a kernel that cannot resend it.

use crate::sys::launch::wire::{self, Envelope, Reply, Request, Start, Stream};
use crate::sys::launch::{Exit, Launch, run_to_end};
use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a peer may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest run (a mount helper) a request may ask for.
const MAX_RUN: Duration = Duration::from_secs(600);
/// Connections served at once; more are refused.
const MAX_CONNECTIONS: usize = 64;
/// How many ended processes' exits are kept for a status request.
const ENDED_KEPT: usize = 1024;
/// How long the clients may take to end after a SIGTERM (within the
/// DaemonSet's 30 s grace; a request held longer is resent by the kernel to
/// the next client, on Linux 6.9 and later).
const DRAIN: Duration = Duration::from_secs(20);

/// A process started and not yet ended.
#[derive(Default)]
struct Live {
    program: String,
    path: String,
    /// A userspace NBD client (`nbd fuse`): it drains on SIGTERM.
    client: bool,
}

#[derive(Default)]
struct Children {
    /// Started and not yet ended (the pid is still theirs: not reaped).
    live: HashMap<u32, Live>,
    ended: HashMap<u32, Exit>,
    order: VecDeque<u32>,
}

pub struct Mounter {
    volagent: PathBuf,
    children: Mutex<Children>,
    connections: AtomicUsize,
    /// SIGTERM came: nothing more is started.
    ending: std::sync::atomic::AtomicBool,
}

impl Mounter {
    /// A mounter whose `volagent` launches run `volagent` (this binary).
    pub fn new(volagent: PathBuf) -> Arc<Mounter> {
        Arc::new(Mounter {
            volagent,
            children: Default::default(),
            connections: AtomicUsize::new(0),
            ending: Default::default(),
        })
    }

    /// Drain and end on SIGTERM. (A handler, not a blocked signal: what
    /// the mounter starts would inherit a signal mask.)
    fn end_on_sigterm(self: &Arc<Self>) -> anyhow::Result<()> {
        let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM])?;
        let me = self.clone();
        std::thread::Builder::new().name("mounter-term".into()).spawn(move || {
            if signals.forever().next().is_some() {
                me.drain();
                std::process::exit(0);
            }
        })?;
        Ok(())
    }

    /// Start nothing more; SIGTERM each client and wait (at most `DRAIN`)
    /// for them to end.
    fn drain(&self) {
        let clients: Vec<u32> = {
            let children = self.lock();
            self.ending.store(true, Ordering::SeqCst);
            let clients: Vec<u32> =
                children.live.iter().filter(|(_, l)| l.client).map(|(pid, _)| *pid).collect();
            for pid in &clients {
                // Under the lock: still this child's pid.
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*pid as i32),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            clients
        };
        tracing::info!(
            clients = clients.len(),
            "SIGTERM: the clients answer the requests they hold and end; starting nothing more"
        );
        let deadline = std::time::Instant::now() + DRAIN;
        while std::time::Instant::now() < deadline
            && clients.iter().any(|pid| self.lock().live.contains_key(pid))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Serve `socket` until the process ends.
    pub fn serve(self: Arc<Self>, socket: &Path) -> anyhow::Result<()> {
        let listener = crate::listener::bind_std(socket)?;
        listener.set_nonblocking(false)?;
        self.end_on_sigterm()?;
        tracing::info!(socket = %socket.display(), protocol = wire::PROTOCOL, "mounter serving");
        let mut pause = crate::listener::AcceptPause::default();
        loop {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) => {
                    pause.wait_blocking("the mounter's socket", &e);
                    continue;
                }
            };
            pause.reset();
            if self.connections.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                self.connections.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!("refused a connection: {MAX_CONNECTIONS} are being served");
                continue;
            }
            let me = self.clone();
            let spawned = std::thread::Builder::new().name("mounter-conn".into()).spawn({
                let me = me.clone();
                move || {
                    me.connection(stream);
                    me.connections.fetch_sub(1, Ordering::SeqCst);
                }
            });
            if let Err(e) = spawned {
                me.connections.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!("no thread for a connection: {e}");
            }
        }
    }

    /// Answer one request on `stream`.
    pub fn connection(self: &Arc<Self>, mut stream: UnixStream) {
        let reply =
            match nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials)
            {
                Ok(cred) if cred.uid() == 0 => self.request(&mut stream),
                Ok(cred) => {
                    tracing::warn!(
                        uid = cred.uid(),
                        pid = cred.pid(),
                        "refused a peer that is not root"
                    );
                    Reply::Error { message: format!("uid {} may not use the mounter", cred.uid()) }
                }
                Err(e) => {
                    Reply::Error { message: format!("cannot read the peer's credentials: {e}") }
                }
            };
        let body = serde_json::to_vec(&reply).unwrap_or_default();
        let _ = stream.set_write_timeout(Some(REQUEST_TIMEOUT));
        if let Err(e) = wire::send(&mut stream, &body, &[]) {
            tracing::debug!("could not answer: {e}");
        }
    }

    fn request(self: &Arc<Self>, stream: &mut UnixStream) -> Reply {
        let error = |message: String| Reply::Error { message };
        if let Err(e) = stream.set_read_timeout(Some(REQUEST_TIMEOUT)) {
            return error(format!("set a timeout: {e}"));
        }
        let (body, fds) = match wire::receive(stream) {
            Ok(frame) => frame,
            Err(e) => return error(format!("unreadable request: {e}")),
        };
        let envelope: Envelope = match serde_json::from_slice(&body) {
            Ok(e) => e,
            Err(e) => {
                let protocol = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v["protocol"].as_u64());
                return error(match protocol {
                    Some(p) if p > u64::from(wire::PROTOCOL) => format!(
                        "protocol {p} is newer than this mounter's ({}), and the request is not one it knows: {e}",
                        wire::PROTOCOL
                    ),
                    _ => format!("a request this mounter does not know: {e}"),
                });
            }
        };
        if envelope.protocol == 0 {
            return error("protocol 0 is not one this mounter speaks".into());
        }
        match envelope.request {
            Request::Hello => Reply::Hello {
                protocol: wire::PROTOCOL,
                version: env!("CARGO_PKG_VERSION").into(),
                pid: std::process::id(),
                running: self.lock().live.len() as u32,
                pod: wire::PodName::from_env(),
            },
            Request::Spawn(start) => self.spawn(start, fds).unwrap_or_else(error),
            Request::Run { start, deadline_ms } => {
                self.run(start, fds, Duration::from_millis(deadline_ms)).unwrap_or_else(error)
            }
            Request::Status { pid } => {
                let children = self.lock();
                if children.live.contains_key(&pid) {
                    Reply::Status { exit: None }
                } else if let Some(exit) = children.ended.get(&pid) {
                    Reply::Status { exit: Some(exit.clone()) }
                } else {
                    error(format!("pid {pid} is not a process this mounter started"))
                }
            }
            Request::Kill { pid } => {
                let children = self.lock();
                if children.live.contains_key(&pid) {
                    // Still ours under the lock: its reaper takes the lock
                    // before the pid can be reaped and reused.
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid as i32),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                    Reply::Killed
                } else if children.ended.contains_key(&pid) {
                    Reply::Killed
                } else {
                    error(format!("pid {pid} is not a process this mounter started"))
                }
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Children> {
        self.children.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The launch a request describes, its descriptors in place.
    fn launch(start: Start, fds: Vec<OwnedFd>) -> Result<Launch, String> {
        if start.streams.len() != fds.len() {
            return Err(format!(
                "{} descriptors came with a request naming {} streams",
                fds.len(),
                start.streams.len()
            ));
        }
        let mut launch = Launch::new(start.program, Path::new(&start.path));
        launch.args = start.args.into_iter().map(Into::into).collect();
        launch.env = start.env;
        for (stream, fd) in start.streams.into_iter().zip(fds) {
            let slot = match stream {
                Stream::Stdin => &mut launch.stdin,
                Stream::Stdout => &mut launch.stdout,
                Stream::Stderr => &mut launch.stderr,
            };
            if slot.replace(std::fs::File::from(fd)).is_some() {
                return Err(format!("stream {stream:?} named twice"));
            }
        }
        launch.check()?;
        Ok(launch)
    }

    fn spawn(self: &Arc<Self>, start: Start, fds: Vec<OwnedFd>) -> Result<Reply, String> {
        let (program, path) = (start.program.name(), start.path.clone());
        let client = start.program == crate::sys::launch::Program::Volagent
            && start.args.get(..2).is_some_and(|a| a[0] == "nbd" && a[1] == "fuse");
        let launch = Self::launch(start, fds)?;
        // Registered before its reaper can look for it.
        let mut children = self.lock();
        // Under the lock the drain takes: a client started now is one it
        // sees.
        if self.ending.load(Ordering::SeqCst) {
            return Err("this mounter is ending (SIGTERM) and starts nothing more".into());
        }
        let child = launch
            .command(&self.volagent)
            .spawn()
            .map_err(|e| format!("run {program} for {path}: {e}"))?;
        let pid = child.id();
        children
            .live
            .insert(pid, Live { program: program.to_string(), path: path.clone(), client });
        drop(children);
        tracing::info!(pid, program, path, "started");
        let me = self.clone();
        std::thread::Builder::new()
            .name("mounter-reap".into())
            .spawn(move || me.reap(child))
            .map_err(|e| format!("no thread to reap {program} (pid {pid}): {e}"))?;
        Ok(Reply::Spawned { pid })
    }

    /// Wait for `child` to end, record how, then let its pid go.
    fn reap(&self, mut child: std::process::Child) {
        let pid = child.id();
        // Wait without reaping: while the pid is still this child's, a
        // kill under the lock cannot reach another process.
        let ended = nix::sys::wait::waitid(
            nix::sys::wait::Id::Pid(nix::unistd::Pid::from_raw(pid as i32)),
            nix::sys::wait::WaitPidFlag::WEXITED | nix::sys::wait::WaitPidFlag::WNOWAIT,
        );
        let mut children = self.lock();
        let exit = match child.wait() {
            Ok(status) => Exit::from(status),
            Err(e) => Exit { success: false, status: format!("unknown ({e}; {ended:?})") },
        };
        let Live { program, path, .. } = children.live.remove(&pid).unwrap_or_default();
        tracing::info!(pid, program, path, exit = %exit, "ended");
        children.ended.insert(pid, exit);
        children.order.push_back(pid);
        while children.order.len() > ENDED_KEPT {
            if let Some(old) = children.order.pop_front() {
                children.ended.remove(&old);
            }
        }
    }

    fn run(&self, start: Start, fds: Vec<OwnedFd>, deadline: Duration) -> Result<Reply, String> {
        if self.ending.load(Ordering::SeqCst) {
            return Err("this mounter is ending (SIGTERM) and starts nothing more".into());
        }
        let (program, path) = (start.program.name(), PathBuf::from(&start.path));
        let launch = Self::launch(start, fds)?;
        let deadline = deadline.min(MAX_RUN);
        let ran = run_to_end(launch.command(&self.volagent), program, &path, deadline);
        tracing::info!(program, path = %path.display(), "ran: {}", match &ran {
            Ok(output) => output.exit.to_string(),
            Err(e) => e.to_string(),
        });
        match ran {
            Ok(output) => Ok(Reply::Ran { output }),
            Err(crate::sys::SysError::Timeout { secs, .. }) => Ok(Reply::TimedOut { secs }),
            Err(e) => Err(e.to_string()),
        }
    }
}
