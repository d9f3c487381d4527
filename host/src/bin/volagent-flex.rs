//! The Flexvolume driver kubelet runs (see the Flexvolume contract): it
//! forwards `init`, `mount` and `unmount` to the agent over its socket and
//! prints exactly one JSON object — and nothing else, on stdout or stderr,
//! whatever happens — because kubelet parses the combined output.
//!
//! kubelet runs it for every mount and unmount, so its start-up is on that
//! path: it has its own C `main` and skips std's runtime set-up, whose main
//! thread stack-guard lookup alone parses /proc/self/maps (about 0.15 ms of
//! a 1 ms exec here). What of that set-up matters here is done below.
//! (The test harness brings its own `main`.)
#![cfg_attr(not(test), no_main)]

use nix::sys::signal::{SigHandler, Signal, signal};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::ffi::CStr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;
use volagent::plugin::install::{DRIVER_CONFIG, DriverConfig};
use volagent::socket::protocol::{self, Request, Response};

const DEFAULT_SOCKET: &str = "/run/volagent/agent.sock";
/// kubelet applies no timeout to mount/unmount; the driver bounds its wait
/// so a wedged agent cannot hang kubelet's operation forever.
const AGENT_TIMEOUT: Duration = Duration::from_secs(600);

#[allow(unsafe_code)] // an exported symbol: the C entry point
#[cfg_attr(not(test), unsafe(no_mangle))]
extern "C" fn main(argc: std::ffi::c_int, argv: *const *const std::ffi::c_char) -> std::ffi::c_int {
    // As std's runtime would: a write to a socket the agent has closed
    // fails with EPIPE (and is reported) instead of killing the driver.
    // SAFETY: ignoring a signal installs no handler code.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigIgn) };
    // A panic must still produce the one JSON object kubelet expects; it
    // is caught here, as it may not unwind out of a C function.
    std::panic::set_hook(Box::new(|info| {
        println!("{}", json!({"status": "Failure", "message": format!("volagent-flex crashed: {info}")}));
    }));
    // SAFETY: the C runtime passes `argc` NUL-terminated strings in `argv`.
    let args = (0..usize::try_from(argc).unwrap_or(0)).map(|i| unsafe { CStr::from_ptr(*argv.add(i)) }.to_str().map(String::from));
    let args: Result<Vec<String>, _> = args.collect();
    let ok = std::panic::catch_unwind(|| {
        let (reply, ok) = match &args {
            Ok(args) => run(args),
            Err(e) => failure(format!("an argument is not UTF-8: {e}")),
        };
        println!("{reply}");
        ok
    });
    if ok.unwrap_or(false) { 0 } else { 1 }
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

fn ask(config: &DriverConfig, request: Request) -> Result<Response, String> {
    let socket = config.socket.display();
    let mut stream = UnixStream::connect(&config.socket)
        .map_err(|e| format!("volagent agent is not reachable at {socket}: {e}; is the volagent DaemonSet running on this node?"))?;
    let _ = stream.set_read_timeout(Some(AGENT_TIMEOUT));
    let _ = stream.set_write_timeout(Some(AGENT_TIMEOUT));
    protocol::exchange(&mut stream, request).map_err(|e| format!("volagent agent at {socket}: {e}"))
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
        Ok(Response::Status { .. }) => failure("volagent agent answered with a status; expected an operation result"),
    }
}

fn run(args: &[String]) -> (Value, bool) {
    // Installed as <dir>/volagent~<backend>/<backend>; the name of the link
    // kubelet ran wins over the resolved binary's, which is only looked up
    // (a /proc readlink) when argv[0] has no dir.
    let invoked = args.first().map(PathBuf::from).filter(|p| p.parent().is_some_and(|d| !d.as_os_str().is_empty())).unwrap_or_else(|| {
        std::env::current_exe().ok().or_else(|| args.first().map(PathBuf::from)).unwrap_or_default()
    });
    let config = config(&invoked);
    let backend = config.backend.clone();
    match args.get(1).map(String::as_str) {
        Some("init") => reply(ask(&config, Request::Handshake { backend }), true),
        Some("mount") => {
            let (Some(dir), Some(json)) = (args.get(2), args.get(3)) else {
                return failure("mount needs <mount-dir> <json-options>");
            };
            let options: BTreeMap<String, String> = match serde_json::from_str(json) {
                Ok(o) => o,
                Err(e) => return failure(format!("mount options are not a JSON object of strings: {e}")),
            };
            reply(ask(&config, Request::Mount { backend, mount_dir: dir.clone(), options }), false)
        }
        Some("unmount") => match args.get(2) {
            Some(dir) => reply(ask(&config, Request::Unmount { backend, mount_dir: dir.clone() }), false),
            None => failure("unmount needs <mount-dir>"),
        },
        _ => (json!({"status": "Not supported"}), true),
    }
}
