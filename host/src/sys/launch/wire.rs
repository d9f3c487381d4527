//! The mounter's protocol: one request and one reply per connection on a
//! root-only Unix socket, each a frame of a 4-byte big-endian length and
//! that many bytes of JSON; a spawn's standard input, output and error
//! travel beside its request as file descriptors (SCM_RIGHTS).
//!
//! Versioning: every request says the protocol it speaks. A mounter
//! serves every protocol up to its own ([`PROTOCOL`]) and ignores fields it
//! does not know, so an agent of a later release, which adds fields and
//! requests but never changes what an existing one means, talks to the
//! mounter of this one; a request the mounter does not know is answered
//! with an error naming it, never a dropped connection.

use super::{Exit, Output, Program};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// The newest protocol this build speaks.
pub const PROTOCOL: u32 = 1;
/// The longest frame either side accepts.
pub const MAX_FRAME: usize = 512 * 1024;
/// The most descriptors a request carries.
pub const MAX_FDS: usize = 3;

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Envelope {
    pub protocol: u32,
    #[serde(flatten)]
    pub request: Request,
}

/// Which of a spawn's standard streams the descriptors sent with it are,
/// in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Stream {
    Stdin,
    Stdout,
    Stderr,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Start {
    pub program: Program,
    pub args: Vec<String>,
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// What the descriptors sent with the request are, in order.
    #[serde(default)]
    pub streams: Vec<Stream>,
    /// What the process is for, for errors.
    pub path: String,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    /// Who the mounter is.
    Hello,
    /// Start a process and answer once it runs.
    Spawn(Start),
    /// Run a process to its end (within `deadline_ms`) and answer with
    /// its output.
    Run {
        #[serde(flatten)]
        start: Start,
        deadline_ms: u64,
    },
    /// How a process this mounter started is doing.
    Status { pid: u32 },
    /// Kill (SIGKILL) a process this mounter started.
    Kill { pid: u32 },
}

#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "reply", rename_all = "kebab-case")]
pub enum Reply {
    Hello {
        protocol: u32,
        version: String,
        pid: u32,
        /// Processes it started that run.
        running: u32,
        /// Its pod, when the downward API says (absent from mounters before
        /// it was added): Events about what holds it are written on it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pod: Option<PodName>,
    },
    Spawned {
        pid: u32,
    },
    /// `exit` is none while it runs.
    Status {
        exit: Option<Exit>,
    },
    Ran {
        output: Output,
    },
    /// A run killed at its deadline.
    TimedOut {
        secs: u64,
    },
    Killed,
    Error {
        message: String,
    },
}

/// A pod: namespace, name and uid.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PodName {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl PodName {
    /// From POD_NAMESPACE, POD_NAME and POD_UID (the downward API), when all are set.
    pub fn from_env() -> Option<PodName> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Some(PodName {
            namespace: var("POD_NAMESPACE")?,
            name: var("POD_NAME")?,
            uid: var("POD_UID")?,
        })
    }
}

/// Send `body` as one frame, with `fds` beside its first bytes.
pub fn send(stream: &mut UnixStream, body: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    if body.len() > MAX_FRAME {
        return Err(std::io::Error::other(format!(
            "a frame of {} bytes, more than {MAX_FRAME}",
            body.len()
        )));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(body);
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    let sent = sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(&frame)],
        cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(std::io::Error::from)?;
    stream.write_all(&frame[sent..])
}

/// Receive one frame and the descriptors that came with it (close-on-exec).
#[allow(unsafe_code)]
pub fn receive(stream: &mut UnixStream) -> std::io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut head = [0u8; 4];
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let (got, fds) = {
        let mut iov = [IoSliceMut::new(&mut head)];
        let msg = recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(std::io::Error::from)?;
        let mut fds = Vec::new();
        for c in msg.cmsgs().map_err(std::io::Error::from)? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: the kernel just installed these descriptors in
                // this process for this message; nothing else owns them.
                // Owned at once, so that every path closes them.
                fds.extend(raw.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
            }
        }
        if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
            return Err(std::io::Error::other(format!(
                "more than {MAX_FDS} descriptors came with a frame"
            )));
        }
        (msg.bytes, fds)
    };
    if got == 0 {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
    }
    stream.read_exact(&mut head[got..])?;
    let len = u32::from_be_bytes(head) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!(
            "a frame of {len} bytes, more than {MAX_FRAME}"
        )));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    Ok((body, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_carry_their_descriptors_and_are_bounded() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let file = tempfile::tempfile().unwrap();
        send(&mut a, b"{\"x\":1}", &[file.as_raw_fd()]).unwrap();
        let (body, fds) = receive(&mut b).unwrap();
        assert_eq!((body.as_slice(), fds.len()), (&b"{\"x\":1}"[..], 1));
        // The descriptor is the same open file.
        let mut sent = std::fs::File::from(fds.into_iter().next().unwrap());
        sent.write_all(b"hello").unwrap();
        let mut back = String::new();
        use std::io::Seek;
        let mut file = file;
        file.seek(std::io::SeekFrom::Start(0)).unwrap();
        file.read_to_string(&mut back).unwrap();
        assert_eq!(back, "hello");

        a.write_all(&((MAX_FRAME + 1) as u32).to_be_bytes()).unwrap();
        let err = receive(&mut b).unwrap_err();
        assert!(err.to_string().contains("more than"), "{err}");
        drop(a);
        assert_eq!(receive(&mut b).unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn a_later_agents_request_is_read_and_an_unknown_one_named() {
        // Fields this build does not know are ignored.
        let later = r#"{"protocol":1,"op":"status","pid":7,"since":"2027"}"#;
        let e: Envelope = serde_json::from_str(later).unwrap();
        assert!(matches!(e.request, Request::Status { pid: 7 }));
        let unknown = r#"{"protocol":2,"op":"hand-over","pid":7}"#;
        let err = serde_json::from_str::<Envelope>(unknown).unwrap_err().to_string();
        assert!(err.contains("hand-over"), "{err}");
        let spawn = Envelope {
            protocol: PROTOCOL,
            request: Request::Run {
                start: Start {
                    program: Program::MountGlusterfs,
                    args: vec!["g:/v".into()],
                    env: vec![],
                    streams: vec![],
                    path: "/t".into(),
                },
                deadline_ms: 5,
            },
        };
        let text = serde_json::to_string(&spawn).unwrap();
        assert!(
            text.contains(r#""op":"run""#) && text.contains(r#""program":"mount.glusterfs""#),
            "{text}"
        );
        let back: Envelope = serde_json::from_str(&text).unwrap();
        assert!(matches!(back.request, Request::Run { deadline_ms: 5, .. }));
    }
}
