//! The agent socket protocol, version 1 (docs/protocol.md): one request and
//! one response per connection, each a frame of a 4-byte big-endian length
//! and that many bytes of JSON. A crate of its own, so that the Flexvolume
//! driver links nothing but this.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{Read, Write};

pub const PROTOCOL_VERSION: u32 = 1;
/// Where the agent listens unless told otherwise (`volagent agent
/// --runtime-dir` default, plus `agent.sock`).
pub const DEFAULT_SOCKET: &str = "/run/volagent/agent.sock";
/// Largest frame either side accepts.
pub const MAX_FRAME: u32 = 1 << 20;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestFrame {
    pub version: u32,
    pub request: Request,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The driver's `init`: is the agent there, and does it serve `backend`?
    Handshake { backend: String },
    /// kubelet's `mount <mount-dir> <options>`.
    Mount { backend: String, mount_dir: String, options: BTreeMap<String, String> },
    /// kubelet's `unmount <mount-dir>`.
    Unmount { backend: String, mount_dir: String },
    /// What the agent serves, and the volumes the node holds.
    Status,
    /// Record `backend`'s policy calls from now on, or stop (an agent
    /// started with `--record DIR`).
    Recording { backend: String, on: bool },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseFrame {
    pub version: u32,
    pub response: Response,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Response {
    Ok {
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<String>,
    },
    Status {
        node: String,
        backends: Vec<BackendStatus>,
        /// Degraded backends and removals waiting for volumes.
        #[serde(default)]
        problems: Vec<PluginProblem>,
        /// The volumes this node holds, by backend and name (absent from
        /// older agents' answers).
        #[serde(default)]
        volumes: Vec<HeldVolume>,
        /// How many held volumes were left out of `volumes` to keep the
        /// answer within a frame.
        #[serde(default, skip_serializing_if = "is_zero")]
        volumes_left_out: usize,
        /// Why the held volumes could not be listed (the ledger could not
        /// be read); `volumes` is then empty.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        volumes_error: Option<String>,
        /// The node's local volumes and running wipes, when the agent
        /// manages local volumes (it has local classes and a cluster).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        local: Option<Box<LocalReport>>,
        /// The CSI drivers and publications, when the agent serves CSI.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        csi: Option<Box<CsiReport>>,
        /// Candidate policies run in the shadow of the serving ones, and
        /// how their answers differed.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        shadows: Vec<ShadowReport>,
        /// The backends whose policy calls are being recorded.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        recording: Vec<String>,
    },
    Failed {
        kind: FailureKind,
        message: String,
    },
}

/// The node's discovered local volumes and the wipes running on it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LocalReport {
    pub volumes: Vec<LocalVolumeLine>,
    /// Volumes left out to keep the answer within a frame.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub volumes_left_out: usize,
    pub wipes: Vec<WipeLine>,
    /// RFC 3339 time of the last scan, and why it failed if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scanned_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalVolumeLine {
    /// Its PV's name.
    pub name: String,
    pub class: String,
    pub path: String,
    /// Filesystem, Block or File.
    pub kind: String,
    pub capacity: String,
    /// Available, WipeRequested, Wiping, WipeFailed or Wiped.
    pub state: String,
}

/// A wipe in progress: which step of how many, since when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WipeLine {
    pub volume: String,
    pub attempt: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// 1-based step now running, of `steps`, and its kind.
    pub step: usize,
    pub steps: usize,
    pub step_kind: String,
    pub started_at: String,
    pub elapsed_secs: u64,
}

/// The CSI side of a node: its drivers, what kubelet said of each, and the
/// volumes published into pods.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CsiReport {
    pub drivers: Vec<CsiDriver>,
    pub publications: Vec<CsiPublication>,
    /// Publications not listed: the status frame has a size limit.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub publications_left_out: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CsiDriver {
    pub name: String,
    pub backend: String,
    /// `registered`, `waiting for kubelet`, or `refused: <kubelet's error>`.
    pub registration: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CsiPublication {
    pub volume: String,
    pub backend: String,
    /// `<namespace>/<name>`, when kubelet said.
    pub pod: String,
    pub target: String,
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackendStatus {
    pub name: String,
    pub version: String,
    pub file: String,
    pub sha256: String,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// A volume this node holds: its attachment record's view of this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldVolume {
    pub backend: String,
    /// The record's key: the PV's name (an inline volume's key with a cluster).
    pub volume: String,
    /// `ReadWriteOnce`, `ReadOnlyMany`, `ReadWriteMany` or `ReadWriteOncePod`.
    pub access_mode: String,
    /// The device mounted at the staging dir, when one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    pub staging_dir: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_cluster: Option<String>,
    /// The pods on this node holding it.
    pub pods: Vec<HeldBy>,
    /// The process serving its data that no successor can take over
    /// (rbd-fuse, the GlusterFS client, librbd in a helper): the pod
    /// running it (the node's mounter, or the agent without one) must not
    /// be replaced while the volume is mounted. None: nothing pins it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_by: Option<String>,
    /// Who this node is to the volume's storage cluster, as its record
    /// names it (what fencing would blocklist): a Ceph client's global id
    /// and address.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub storage_clients: Vec<HeldClient>,
}

/// One of a node's clients of a storage cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldClient {
    pub id: u64,
    pub address: String,
}

/// A pod holding a volume on this node, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldBy {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub mount_dir: String,
    pub read_only: bool,
    /// When it was recorded, RFC 3339.
    pub since: String,
}

/// Something wrong with a file in the plugin dir, or a removal waiting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginProblem {
    /// The backend concerned, when the file's `info` could be read or the
    /// file served one before.
    pub backend: Option<String>,
    pub file: String,
    pub sha256: String,
    /// `degraded` (a bad file; the last good version, if any, serves on)
    /// or `removal-pending` (the file is gone; volumes are still attached).
    pub state: String,
    pub reason: String,
}

/// A candidate policy in the shadow of a backend's serving one: every
/// call of the backend is made on it too, and the answers compared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShadowReport {
    pub backend: String,
    /// The candidate's file, version and digest.
    pub file: String,
    pub version: String,
    pub sha256: String,
    /// Calls compared, and calls not compared (the shadow was behind).
    pub compared: u64,
    pub skipped: u64,
    /// Differences by kind (`became-refused`, `steps`, `device`, ...).
    pub differences: BTreeMap<String, u64>,
    /// The latest differences, oldest first.
    pub examples: Vec<ShadowExample>,
}

/// One call on which the candidate answered otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShadowExample {
    pub kind: String,
    /// The call, the volume, the pod and the node.
    pub call: String,
    pub at: String,
    /// What each side answered, cut short.
    pub serving: String,
    pub candidate: String,
}

/// Why a request failed; `busy` and `unavailable` are worth retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    BadRequest,
    UnknownBackend,
    Denied,
    Busy,
    Failed,
    Unavailable,
    /// The steps outlived the deadline and go on; the volume stays locked.
    TimedOut,
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes is over the limit of {MAX_FRAME}")]
    TooLarge(u32),
    #[error("malformed frame: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("protocol version {0} is not {PROTOCOL_VERSION}")]
    Version(u32),
}

pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, FrameError> {
    let body = serde_json::to_vec(value)?;
    let len = u32::try_from(body.len())
        .ok()
        .filter(|l| *l <= MAX_FRAME)
        .ok_or(FrameError::TooLarge(u32::MAX))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// The body length in a frame header, checked against the limit.
pub fn body_len(header: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(header);
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    Ok(len as usize)
}

pub fn write_frame<T: Serialize>(w: &mut impl Write, value: &T) -> Result<(), FrameError> {
    w.write_all(&encode(value)?)?;
    w.flush()?;
    Ok(())
}

pub fn read_frame<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> Result<T, FrameError> {
    let mut header = [0u8; 4];
    r.read_exact(&mut header)?;
    let mut body = vec![0u8; body_len(header)?];
    r.read_exact(&mut body)?;
    Ok(serde_json::from_slice(&body)?)
}

/// Send one request and read its response (the driver's whole exchange).
pub fn exchange(
    stream: &mut (impl Read + Write),
    request: Request,
) -> Result<Response, FrameError> {
    write_frame(stream, &RequestFrame { version: PROTOCOL_VERSION, request })?;
    let frame: ResponseFrame = read_frame(stream)?;
    if frame.version != PROTOCOL_VERSION {
        return Err(FrameError::Version(frame.version));
    }
    Ok(frame.response)
}

/// The file beside an installed driver that tells it where the agent
/// listens and which backend it is.
pub const DRIVER_CONFIG: &str = "volagent.json";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DriverConfig {
    pub socket: std::path::PathBuf,
    pub backend: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let req = RequestFrame {
            version: 1,
            request: Request::Mount {
                backend: "local-pv".into(),
                mount_dir: "/var/lib/kubelet/pods/u/volumes/volagent~local-pv/pv".into(),
                options: BTreeMap::from([("kubernetes.io/fsType".into(), "ext4".into())]),
            },
        };
        let bytes = encode(&req).unwrap();
        assert_eq!(u32::from_be_bytes(bytes[..4].try_into().unwrap()) as usize, bytes.len() - 4);
        let back: RequestFrame = read_frame(&mut bytes.as_slice()).unwrap();
        assert_eq!(back, req);
        let json = String::from_utf8(bytes[4..].to_vec()).unwrap();
        assert!(
            json.starts_with(r#"{"version":1,"request":{"mount":{"backend":"local-pv""#),
            "{json}"
        );
    }

    #[test]
    fn a_status_without_volumes_is_read_as_holding_none() {
        // An older agent's answer: no volume fields.
        let old = br#"{"version":1,"response":{"status":{"node":"n1","backends":[]}}}"#;
        let mut frame = (old.len() as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(old);
        let back: ResponseFrame = read_frame(&mut frame.as_slice()).unwrap();
        let Response::Status { volumes, volumes_left_out, volumes_error, .. } = back.response
        else {
            panic!("{back:?}")
        };
        assert!(volumes.is_empty() && volumes_left_out == 0 && volumes_error.is_none());
        // And a full answer goes out and comes back as it was.
        let status = Response::Status {
            local: None,
            csi: None,
            shadows: vec![],
            recording: vec![],
            node: "n1".into(),
            backends: vec![],
            problems: vec![],
            volumes: vec![HeldVolume {
                backend: "local-pv".into(),
                volume: "pv1".into(),
                access_mode: "ReadWriteOnce".into(),
                device: Some("/dev/loop3".into()),
                staging_dir: "/k/plugins/volagent/local-pv/mounts/pv1".into(),
                storage_cluster: None,
                pods: vec![HeldBy {
                    namespace: "default".into(),
                    name: "web-0".into(),
                    uid: "u-1".into(),
                    mount_dir: "/k/pods/u-1/volumes/volagent~local-pv/pv1".into(),
                    read_only: false,
                    since: "2026-01-01T00:00:00Z".into(),
                }],
                pinned_by: Some("rbd-fuse".into()),
                storage_clients: vec![HeldClient { id: 4125, address: "10.0.0.3:0/2231".into() }],
            }],
            volumes_left_out: 3,
            volumes_error: None,
        };
        let bytes = encode(&ResponseFrame { version: 1, response: status.clone() }).unwrap();
        let back: ResponseFrame = read_frame(&mut bytes.as_slice()).unwrap();
        assert_eq!(back.response, status);
    }

    #[test]
    fn oversized_and_malformed_frames_are_errors() {
        let big = (MAX_FRAME + 1).to_be_bytes();
        assert!(matches!(
            read_frame::<RequestFrame>(&mut big.as_slice()),
            Err(FrameError::TooLarge(_))
        ));
        let mut junk = 5u32.to_be_bytes().to_vec();
        junk.extend_from_slice(b"{oops");
        assert!(matches!(
            read_frame::<RequestFrame>(&mut junk.as_slice()),
            Err(FrameError::Malformed(_))
        ));
        let mut short = 10u32.to_be_bytes().to_vec();
        short.extend_from_slice(b"{}");
        assert!(matches!(
            read_frame::<RequestFrame>(&mut short.as_slice()),
            Err(FrameError::Io(_))
        ));
        let mut unknown = Vec::new();
        let body = br#"{"version":1,"request":{"format_everything":{}}}"#;
        unknown.extend_from_slice(&(body.len() as u32).to_be_bytes());
        unknown.extend_from_slice(body);
        assert!(matches!(
            read_frame::<RequestFrame>(&mut unknown.as_slice()),
            Err(FrameError::Malformed(_))
        ));
    }
}
