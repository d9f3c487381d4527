//! The Flexvolume driver kubelet runs (see the Flexvolume contract): it
//! forwards `init`, `mount` and `unmount` to the agent over its socket and
//! prints exactly one JSON object — and nothing else, on stdout or stderr,
//! whatever happens — because kubelet parses the combined output.

use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use volagent_protocol::{
    self as protocol, DEFAULT_SOCKET, DRIVER_CONFIG, DriverConfig, Request, Response,
};

/// kubelet applies no timeout to mount/unmount; the driver bounds its wait
/// so a wedged agent cannot hang kubelet's operation forever.
const AGENT_TIMEOUT: Duration = Duration::from_secs(600);

fn main() -> ExitCode {
    // A panic must still produce the one JSON object kubelet expects.
    std::panic::set_hook(Box::new(|info| {
        println!(
            "{}",
            json!({"status": "Failure", "message": format!("volagent-flex crashed: {info}")})
        );
    }));
    let args: Vec<String> = std::env::args().collect();
    let (reply, ok) = run(&args);
    println!("{reply}");
    if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

fn failure(message: impl Into<String>) -> (Value, bool) {
    (json!({"status": "Failure", "message": message.into()}), false)
}

fn config(exe: &Path) -> DriverConfig {
    let backend = exe.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
    let file = exe.parent().map(|d| d.join(DRIVER_CONFIG));
    file.and_then(|f| std::fs::read(f).ok())
        .and_then(|b| serde_json::from_slice::<DriverConfig>(&b).ok())
        .unwrap_or(DriverConfig { socket: PathBuf::from(DEFAULT_SOCKET), backend })
}

/// Why the agent could not be asked.
enum AskError {
    /// Nothing listens on the socket (yet): the agent is starting or down.
    NotServing(String),
    Other(String),
}

impl From<AskError> for String {
    fn from(e: AskError) -> String {
        match e {
            AskError::NotServing(m) | AskError::Other(m) => m,
        }
    }
}

fn ask(config: &DriverConfig, request: Request) -> Result<Response, AskError> {
    let socket = config.socket.display();
    let mut stream = UnixStream::connect(&config.socket).map_err(|e| {
        let message = format!("volagent agent is not reachable at {socket}: {e}; is the volagent DaemonSet running on this node?");
        match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => AskError::NotServing(message),
            _ => AskError::Other(message),
        }
    })?;
    let _ = stream.set_read_timeout(Some(AGENT_TIMEOUT));
    let _ = stream.set_write_timeout(Some(AGENT_TIMEOUT));
    protocol::exchange(&mut stream, request)
        .map_err(|e| AskError::Other(format!("volagent agent at {socket}: {e}")))
}

/// `init`: the agent's handshake when it serves. When nothing listens yet,
/// still Success: kubelet probes a driver the moment its files appear —
/// which the agent installs before it serves — and kubelet 1.20 drops every
/// driver probed in a round where one init failed, retrying only the failed
/// one. Mounts wait for the agent instead (kubelet retries them).
fn init(config: &DriverConfig) -> (Value, bool) {
    match ask(config, Request::Handshake { backend: config.backend.clone() }) {
        Err(AskError::NotServing(message)) => reply(
            Ok(Response::Ok { message: format!("{message} (mounts wait for it)"), device: None }),
            true,
        ),
        other => reply(other.map_err(String::from), true),
    }
}

fn reply(response: Result<Response, String>, init: bool) -> (Value, bool) {
    match response {
        Err(message) => failure(message),
        Ok(Response::Failed { message, .. }) => failure(message),
        Ok(Response::Ok { message, device }) => {
            let mut v = json!({"status": "Success", "message": message});
            if init {
                v["capabilities"] = json!({"attach": false});
            }
            if let Some(d) = device {
                v["device"] = json!(d);
            }
            (v, true)
        }
        Ok(Response::Status { .. }) => {
            failure("volagent agent answered with a status; expected an operation result")
        }
    }
}

fn run(args: &[String]) -> (Value, bool) {
    let exe = std::env::current_exe()
        .ok()
        .or_else(|| args.first().map(PathBuf::from))
        .unwrap_or_default();
    // Installed as <dir>/volagent~<backend>/<backend>; the name of the link
    // kubelet ran wins over the resolved binary's.
    let invoked = args
        .first()
        .map(PathBuf::from)
        .filter(|p| p.parent().is_some_and(|d| !d.as_os_str().is_empty()))
        .unwrap_or(exe);
    let config = config(&invoked);
    let backend = config.backend.clone();
    match args.get(1).map(String::as_str) {
        Some("init") => init(&config),
        Some("mount") => {
            let (Some(dir), Some(json)) = (args.get(2), args.get(3)) else {
                return failure("mount needs <mount-dir> <json-options>");
            };
            let options: BTreeMap<String, String> = match serde_json::from_str(json) {
                Ok(o) => o,
                Err(e) => {
                    return failure(format!("mount options are not a JSON object of strings: {e}"));
                }
            };
            reply(
                ask(&config, Request::Mount { backend, mount_dir: dir.clone(), options })
                    .map_err(String::from),
                false,
            )
        }
        Some("unmount") => match args.get(2) {
            Some(dir) => reply(
                ask(&config, Request::Unmount { backend, mount_dir: dir.clone() })
                    .map_err(String::from),
                false,
            ),
            None => failure("unmount needs <mount-dir>"),
        },
        _ => (json!({"status": "Not supported"}), true),
    }
}
