//! The agent's side of the mounter ([`super::wire`]): each request on a
//! connection of its own, with a deadline on every wait.

use super::wire::{self, Envelope, Reply, Request, Start, Stream};
use super::{Exit, Launch, Launcher, Output, Spawned};
use crate::sys::SysError;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

const MOUNTER: &str = "volagent mounter";

/// Processes started by the node's mounter, listening on `socket`.
#[derive(Debug, Clone)]
pub struct Remote {
    socket: PathBuf,
    /// How long a request other than a run may take.
    pub timeout: Duration,
}

/// Who answered a hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mounter {
    pub protocol: u32,
    pub version: String,
    pub pid: u32,
    pub running: u32,
    pub pod: Option<super::wire::PodName>,
}

impl Remote {
    pub fn new(socket: PathBuf) -> Remote {
        Remote { socket, timeout: Duration::from_secs(10) }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn failed(&self, message: String) -> SysError {
        SysError::Command { program: MOUNTER, path: self.socket.clone(), message }
    }

    fn call(
        &self,
        request: Request,
        fds: &[std::fs::File],
        timeout: Duration,
    ) -> Result<Reply, SysError> {
        let io = |op| crate::sys::io(op, &self.socket);
        let mut stream =
            UnixStream::connect(&self.socket).map_err(io("connect to the mounter at"))?;
        stream.set_read_timeout(Some(timeout)).map_err(io("set a timeout on"))?;
        stream.set_write_timeout(Some(self.timeout)).map_err(io("set a timeout on"))?;
        let body = serde_json::to_vec(&Envelope { protocol: wire::PROTOCOL, request })
            .map_err(|e| self.failed(format!("encode a request: {e}")))?;
        let raw: Vec<_> = fds.iter().map(|f| f.as_raw_fd()).collect();
        // A mounter that refuses the peer answers before it reads, and
        // closes: the send may then fail, and its answer says why.
        let sent =
            wire::send(&mut stream, &body, &raw).map_err(io("send a request to the mounter at"));
        let (reply, _) = match wire::receive(&mut stream) {
            Ok(frame) => frame,
            Err(e) => {
                sent?;
                return Err(
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) {
                        self.failed(format!("no answer within {} s", timeout.as_secs()))
                    } else {
                        io("read the answer of the mounter at")(e)
                    },
                );
            }
        };
        match serde_json::from_slice(&reply) {
            Ok(Reply::Error { message }) => Err(self.failed(message)),
            Ok(reply) => Ok(reply),
            Err(e) => Err(self.failed(format!("an answer that is not the protocol's: {e}"))),
        }
    }

    /// Ask the mounter who it is.
    pub fn hello(&self) -> Result<Mounter, SysError> {
        match self.call(Request::Hello, &[], self.timeout)? {
            Reply::Hello { protocol, version, pid, running, pod } => {
                Ok(Mounter { protocol, version, pid, running, pod })
            }
            other => Err(self.unexpected(&other)),
        }
    }

    fn unexpected(&self, reply: &Reply) -> SysError {
        self.failed(format!("an answer out of turn: {reply:?}"))
    }

    /// The request's start and the descriptors it sends.
    fn start(launch: Launch) -> Result<(Start, Vec<std::fs::File>), SysError> {
        let path = launch.path.to_string_lossy().into_owned();
        launch.check().map_err(|what| SysError::Refused { path: launch.path.clone(), what })?;
        // JSON carries text: a path that is not UTF-8 is refused, never
        // passed on changed.
        let args = launch
            .args
            .iter()
            .map(|a| a.to_str().map(String::from))
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| SysError::Refused {
                path: launch.path.clone(),
                what: "an argument that is not UTF-8 cannot be sent to the mounter".into(),
            })?;
        let mut streams = Vec::new();
        let mut fds = Vec::new();
        for (stream, file) in [
            (Stream::Stdin, launch.stdin),
            (Stream::Stdout, launch.stdout),
            (Stream::Stderr, launch.stderr),
        ] {
            if let Some(f) = file {
                streams.push(stream);
                fds.push(f);
            }
        }
        let start = Start { program: launch.program, args, env: launch.env, streams, path };
        Ok((start, fds))
    }
}

struct RemoteChild {
    remote: Remote,
    pid: u32,
    /// When the mounter was last asked: callers poll every few ms while
    /// they wait for readiness, and each ask is a connection.
    asked: Option<std::time::Instant>,
}

/// How often a waiting caller's polls reach the mounter.
const STATUS_EVERY: Duration = Duration::from_millis(50);

impl Spawned for RemoteChild {
    fn pid(&self) -> u32 {
        self.pid
    }

    fn try_wait(&mut self) -> Result<Option<Exit>, SysError> {
        if self.asked.is_some_and(|at| at.elapsed() < STATUS_EVERY) {
            return Ok(None);
        }
        self.asked = Some(std::time::Instant::now());
        match self.remote.call(Request::Status { pid: self.pid }, &[], self.remote.timeout)? {
            Reply::Status { exit } => Ok(exit),
            other => Err(self.remote.unexpected(&other)),
        }
    }

    fn kill(&mut self) {
        if let Err(e) = self.remote.call(Request::Kill { pid: self.pid }, &[], self.remote.timeout)
        {
            tracing::warn!(pid = self.pid, "the mounter did not kill a process it started: {e}");
        }
    }

    /// The mounter reaps it.
    fn keep(self: Box<Self>) {}
}

impl Launcher for Remote {
    fn spawn(&self, launch: Launch) -> Result<Box<dyn Spawned>, SysError> {
        let (start, fds) = Self::start(launch)?;
        match self.call(Request::Spawn(start), &fds, self.timeout)? {
            Reply::Spawned { pid } => {
                Ok(Box::new(RemoteChild { remote: self.clone(), pid, asked: None }))
            }
            other => Err(self.unexpected(&other)),
        }
    }

    fn run(&self, launch: Launch, deadline: Duration) -> Result<Output, SysError> {
        let (program, path) = (launch.program.name(), launch.path.clone());
        let (start, fds) = Self::start(launch)?;
        let request = Request::Run { start, deadline_ms: deadline.as_millis() as u64 };
        // The mounter kills the run at its deadline; its answer may take a
        // little longer.
        let reply =
            crate::workers::may_take_long(|| self.call(request, &fds, deadline + self.timeout))?;
        match reply {
            Reply::Ran { output } => Ok(output),
            Reply::TimedOut { secs } => Err(SysError::Timeout { program, path, secs }),
            other => Err(self.unexpected(&other)),
        }
    }
}
