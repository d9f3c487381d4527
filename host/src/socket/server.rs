//! The agent's socket server: a root-owned 0600 Unix socket, each peer's
//! credentials checked, one request per connection with a deadline to
//! arrive, and a bounded number of operations at once.

use super::oplog::{Asked, log_unserved};
use super::protocol::{self, PROTOCOL_VERSION, Request, RequestFrame, Response, ResponseFrame};
use super::status::Board;
use crate::listener::AcceptPause;
use crate::ops::{Agent, Failure, FailureKind};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub socket: PathBuf,
    /// Peer uids allowed to send requests.
    pub allowed_uids: Vec<u32>,
    /// Operations run at once; more wait for a slot, up to `slot_timeout`.
    pub max_concurrent: usize,
    /// A request must arrive this soon after connecting.
    pub request_timeout: Duration,
    pub slot_timeout: Duration,
}

/// Serve until the listener fails.
pub async fn serve(
    listener: UnixListener,
    agent: Arc<Agent>,
    board: Arc<Board>,
    config: ServerConfig,
) -> std::io::Result<()> {
    // Accept in a task of its own, on a runtime worker: each connection's
    // task then starts on that same worker (tokio's LIFO slot), where from
    // the thread awaiting `serve` (the agent's main thread) it went through
    // two thread wake-ups, which cost most on a busy node. Dropping the set
    // (the caller stops serving) aborts the loop.
    let mut accepting = tokio::task::JoinSet::new();
    accepting.spawn(accept_loop(listener, agent, board, config));
    match accepting.join_next().await {
        Some(Ok(result)) => result,
        Some(Err(e)) => Err(std::io::Error::other(e)),
        None => Ok(()),
    }
}

async fn accept_loop(
    listener: UnixListener,
    agent: Arc<Agent>,
    board: Arc<Board>,
    config: ServerConfig,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(config.max_concurrent.max(1)));
    let config = Arc::new(config);
    let mut pause = AcceptPause::default();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => {
                pause.reset();
                stream
            }
            // Out of file descriptors (or memory) for now: the connection
            // waits in the backlog; serve again once some are back.
            Err(e) => {
                pause.wait("agent socket", &e).await;
                continue;
            }
        };
        let (agent, board, slots, config) =
            (agent.clone(), board.clone(), slots.clone(), config.clone());
        tokio::spawn(async move {
            if let Err(e) = connection(stream, agent, board, slots, config).await {
                tracing::debug!("connection ended: {e}");
            }
        });
    }
}

async fn connection(
    mut stream: UnixStream,
    agent: Arc<Agent>,
    board: Arc<Board>,
    slots: Arc<Semaphore>,
    config: Arc<ServerConfig>,
) -> std::io::Result<()> {
    let response = match stream.peer_cred() {
        Ok(cred) if config.allowed_uids.contains(&cred.uid()) => {
            match tokio::time::timeout(config.request_timeout, read_request(&mut stream)).await {
                Err(_) => failed(
                    FailureKind::BadRequest,
                    format!("no request within {:?}", config.request_timeout),
                ),
                Ok(Err(e)) => failed(FailureKind::BadRequest, format!("unreadable request: {e}")),
                Ok(Ok(frame)) if frame.version != PROTOCOL_VERSION => failed(
                    FailureKind::BadRequest,
                    format!("protocol version {} is not {PROTOCOL_VERSION}", frame.version),
                ),
                Ok(Ok(frame)) => dispatch(&agent, &board, &slots, &config, frame.request).await,
            }
        }
        Ok(cred) => {
            tracing::warn!(uid = cred.uid(), "refused a request from a peer that is not allowed");
            failed(
                FailureKind::Denied,
                format!("uid {} may not use the volagent socket", cred.uid()),
            )
        }
        Err(e) => failed(FailureKind::Denied, format!("cannot check the peer's credentials: {e}")),
    };
    let bytes = protocol::encode(&ResponseFrame { version: PROTOCOL_VERSION, response })
        .map_err(std::io::Error::other)?;
    stream.write_all(&bytes).await?;
    stream.shutdown().await
}

fn failed(kind: FailureKind, message: String) -> Response {
    Failure::new(kind, message).into()
}

async fn read_request(stream: &mut UnixStream) -> Result<RequestFrame, protocol::FrameError> {
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).await?;
    let mut body = vec![0u8; protocol::body_len(header)?];
    stream.read_exact(&mut body).await?;
    Ok(serde_json::from_slice(&body)?)
}

async fn dispatch(
    agent: &Arc<Agent>,
    board: &Board,
    slots: &Semaphore,
    config: &ServerConfig,
    request: Request,
) -> Response {
    // Only the wait for a slot is cut short: a running operation is never
    // abandoned half-way (its lock would be released while its steps still
    // run); each of its steps has a deadline of its own instead.
    let start = std::time::Instant::now();
    let slot = match tokio::time::timeout(config.slot_timeout, slots.acquire()).await {
        Ok(Ok(slot)) => Ok(slot),
        Ok(Err(_)) => Err(Failure::new(FailureKind::Unavailable, "the agent is shutting down")),
        Err(_) => Err(Failure::new(
            FailureKind::Busy,
            format!(
                "all {} operation slots stayed busy for {:?}; retry",
                config.max_concurrent, config.slot_timeout
            ),
        )),
    };
    let _slot = match slot {
        Ok(slot) => slot,
        Err(f) => {
            // A mount or unmount refused here still gets its log line.
            if let Some(asked) = asked(&request) {
                log_unserved(agent, asked, &f, start.elapsed());
            }
            return f.into();
        }
    };
    let result = match &request {
        Request::Handshake { backend } => agent.plugin(backend).map(|p| Response::Ok {
            message: format!("volagent serves {} {}", p.name(), p.info().version),
            device: None,
        }),
        Request::Status => Ok(super::status::status(agent, board).await),
        Request::Recording { backend, on } => board
            .switch_recording(backend, *on)
            .map(|message| Response::Ok { message, device: None })
            .map_err(|m| Failure::new(FailureKind::BadRequest, m)),
        Request::Mount { backend, mount_dir, options } => {
            let (a, b, d, o) = (agent.clone(), backend.clone(), mount_dir.clone(), options.clone());
            served(agent, &request, start, async move {
                super::flex::mount(&a, &b, &d, &o).await.map(Into::into)
            })
            .await
        }
        Request::Unmount { backend, mount_dir } => {
            let (a, b, d) = (agent.clone(), backend.clone(), mount_dir.clone());
            served(agent, &request, start, async move {
                super::flex::unmount(&a, &b, &d).await.map(Into::into)
            })
            .await
        }
    };
    result.unwrap_or_else(Failure::into)
}

/// A mount or unmount, for the agent's operation log.
fn asked(request: &Request) -> Option<Asked<'_>> {
    match request {
        Request::Mount { backend, mount_dir, options } => {
            Some(Asked::Mount { backend, mount_dir, options })
        }
        Request::Unmount { backend, mount_dir } => Some(Asked::Unmount { backend, mount_dir }),
        Request::Handshake { .. } | Request::Status | Request::Recording { .. } => None,
    }
}

/// A mount or unmount on a task of its own, answered by the plan deadline
/// (`ops::served`): a hanging step does not hold the answer back.
async fn served(
    agent: &Agent,
    request: &Request,
    start: std::time::Instant,
    op: impl std::future::Future<Output = Result<Response, Failure>> + Send + 'static,
) -> Result<Response, Failure> {
    crate::ops::served(agent.plan_deadline(), op).await.unwrap_or_else(|f| {
        // The operation logs itself (and tells the pod) when it ends; the
        // answer given before that is logged here.
        if let Some(asked) = asked(request) {
            log_unserved(agent, asked, &f, start.elapsed());
        }
        match request {
            Request::Mount { options, .. } => super::flex::tell_mount_failed(agent, options, &f),
            Request::Unmount { mount_dir, .. } => {
                super::flex::tell_unmount_failed(agent, mount_dir, &f);
            }
            Request::Handshake { .. } | Request::Status | Request::Recording { .. } => {}
        }
        Err(f)
    })
}
