//! NBD through the kernel's nbd driver: Debian's `nbd-client` negotiates
//! with the server and hands the connected sockets to a free `/dev/nbdN`
//! over netlink, then exits — the kernel holds the connection, so it
//! outlives the agent and its container without any process of ours.
//!
//! A device whose server is the agent's own helper waits up to its
//! dead-connection timeout when that helper ends, and the helper started
//! again on the same export is handed to it with `NBD_CMD_RECONFIGURE`
//! ([`super::netlink`]): the workload sees a delay, not an I/O error.
//!
//! Which device serves which export is recorded in `<base>/<key>.kernel`:
//! the device, the pid the kernel reports for its connection and the boot
//! it was made in. A device is ours only while all three still match — a
//! device that was disconnected and taken by someone else, or a record from
//! before a reboot, names nothing.

use crate::sys::{KernelNbd, SysError, io};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// How long the kernel waits for a request unless told otherwise.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug)]
pub struct NbdDevices {
    base: PathBuf,
    program: PathBuf,
    /// How long one request may take before the kernel fails it (and the
    /// connection): a server that stops answering makes I/O fail, not hang.
    pub request_timeout: Duration,
    /// How long `nbd-client` may take to connect or disconnect.
    pub command_timeout: Duration,
    /// How long a device whose every connection to the agent's own helper
    /// died waits for the helper to be started again before it fails
    /// requests.
    pub dead_conn_timeout: Duration,
}

/// A connection this agent made: the device and how to recognise it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    device: String,
    pid: String,
    boot: String,
}

impl Record {
    fn parse(text: &str) -> Option<Record> {
        let mut words = text.split_whitespace();
        let (device, pid, boot) = (words.next()?, words.next()?, words.next()?);
        // Only a device name; nothing from the file reaches a path otherwise.
        let n = device.strip_prefix("nbd")?;
        (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) && words.next().is_none())
            .then(|| Record { device: device.into(), pid: pid.into(), boot: boot.into() })
    }
}

fn read_trimmed(path: &Path) -> Option<String> {
    Some(std::fs::read_to_string(path).ok()?.trim().to_string())
}

fn boot_id() -> String {
    read_trimmed(Path::new("/proc/sys/kernel/random/boot_id")).unwrap_or_default()
}

/// The pid the kernel reports for `/dev/<name>`'s connection; none when
/// the device is not connected.
fn connection_pid(name: &str) -> Option<String> {
    read_trimmed(&Path::new("/sys/block").join(name).join("pid")).filter(|p| !p.is_empty())
}

/// The nbd devices the kernel has, by number.
fn devices() -> Vec<String> {
    let mut found: Vec<(u32, String)> = std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let n = name.strip_prefix("nbd")?.parse().ok()?;
            Some((n, name))
        })
        .collect();
    found.sort();
    found.into_iter().map(|(_, name)| name).collect()
}

/// `server` ("unix:/path" or "host:port") as nbd-client's arguments.
fn server_args(server: &str) -> Vec<String> {
    if let Some(socket) = server.strip_prefix("unix:") {
        return vec!["-u".into(), socket.into()];
    }
    match server.rsplit_once(':') {
        Some((host, port)) => {
            vec![host.trim_start_matches('[').trim_end_matches(']').into(), port.into()]
        }
        None => vec![server.into()],
    }
}

fn remove(file: &Path) -> Result<(), SysError> {
    match std::fs::remove_file(file) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io("remove", file)(e)),
        _ => Ok(()),
    }
}

/// N of `/dev/nbdN`.
fn index_of(device: &Path) -> Option<u32> {
    device.file_name()?.to_str()?.strip_prefix("nbd")?.parse().ok()
}

/// The size the kernel has for `device`, in bytes.
fn device_bytes(device: &Path) -> Result<u64, SysError> {
    let name = device.file_name().unwrap_or_default();
    let file = Path::new("/sys/block").join(name).join("size");
    let text = std::fs::read_to_string(&file).map_err(io("read", &file))?;
    let sectors: u64 = text.trim().parse().map_err(|_| SysError::Refused {
        path: file.clone(),
        what: format!("not a size: {:?}", text.trim()),
    })?;
    Ok(sectors * 512)
}

impl NbdDevices {
    pub fn new(base: PathBuf) -> NbdDevices {
        NbdDevices {
            base,
            program: PathBuf::from("nbd-client"),
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            command_timeout: Duration::from_secs(20),
            dead_conn_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    fn record_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.kernel"))
    }

    /// How many connections `key`'s device was made with (a file of its
    /// own, so that the record an earlier release reads is unchanged).
    fn connections_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.kernel.connections"))
    }

    /// Whether `server` is the agent's own helper serving `key`: the one
    /// server a device is reconnected to when it ends.
    fn own_helper(&self, key: &str, server: &str) -> bool {
        server.strip_prefix("unix:").map(Path::new)
            == Some(super::files::Layout::new(self.base.clone()).socket(key).as_path())
    }

    /// Make `name`'s requests wait for a new connection when every one to
    /// the helper died, instead of failing at once (nbd-client cannot say
    /// so). Without it the device still serves; only a helper's restart
    /// would then fail its I/O.
    fn wait_for_the_helper(&self, name: &str, device: &Path) {
        let change = super::netlink::Reconfigure {
            dead_conn_timeout: Some(self.dead_conn_timeout),
            ..Default::default()
        };
        if let Err(e) = index_of(device)
            .ok_or_else(|| SysError::Refused {
                path: device.into(),
                what: "not an nbd device".into(),
            })
            .and_then(|index| super::netlink::reconfigure(index, &change))
        {
            tracing::warn!(device = name, "a restart of its helper will fail its I/O: {e}");
        }
    }

    fn disconnect_device(&self, device: &Path) -> Result<(), SysError> {
        let mut cmd = Command::new(&self.program);
        cmd.arg("-d").arg(device).stdout(Stdio::null());
        let out = crate::sys::tool::run_with(&mut cmd, "nbd-client", device, self.command_timeout)?;
        crate::sys::tool::check("nbd-client", device, out).map(drop)
    }
}

impl KernelNbd for NbdDevices {
    /// Whether this node's kernel has the nbd driver (loaded, with devices).
    fn available(&self) -> bool {
        Path::new("/sys/module/nbd").exists() && !devices().is_empty()
    }

    /// The device connected for `key`, when its record still matches it.
    fn device(&self, key: &str) -> Option<PathBuf> {
        let record = Record::parse(&std::fs::read_to_string(self.record_file(key)).ok()?)?;
        let live = connection_pid(&record.device)? == record.pid && record.boot == boot_id();
        live.then(|| Path::new("/dev").join(&record.device))
    }

    /// Connect the export to a free device; the device, and whether it was
    /// connected now (false: it was already).
    fn connect(
        &self,
        key: &str,
        server: &str,
        export: &str,
        connections: u8,
        read_only: bool,
    ) -> Result<(PathBuf, bool), SysError> {
        if let Some(device) = self.device(key) {
            return Ok((device, false));
        }
        std::fs::create_dir_all(&self.base).map_err(io("mkdir", &self.base))?;
        let mut last = None;
        // Another connection may take a device between the look and the
        // connect (the kernel then refuses it): the next free one.
        for name in devices().into_iter().filter(|n| connection_pid(n).is_none()) {
            let device = Path::new("/dev").join(&name);
            let mut cmd = Command::new(&self.program);
            cmd.args(server_args(server)).arg(&device);
            if !export.is_empty() {
                cmd.arg("-N").arg(export);
            }
            cmd.args(["-C", &connections.max(1).to_string(), "-b", "4096"]);
            cmd.args(["-t", &self.request_timeout.as_secs().max(1).to_string()]);
            if read_only {
                cmd.arg("-R");
            }
            cmd.stdout(Stdio::null());
            let out =
                crate::sys::tool::run_with(&mut cmd, "nbd-client", &device, self.command_timeout)?;
            match crate::sys::tool::check("nbd-client", &device, out) {
                Ok(_) => {}
                // Taken meanwhile (the kernel says so only in its log), or
                // still being released by a disconnect that has not ended
                // (busy): the next free one.
                Err(e)
                    if connection_pid(&name).is_some()
                        || e.to_string().to_ascii_lowercase().contains("busy") =>
                {
                    last = Some(e);
                    continue;
                }
                Err(e) => return Err(e),
            }
            let pid = connection_pid(&name).ok_or_else(|| SysError::Refused {
                path: device.clone(),
                what: "nbd-client succeeded but the kernel reports no connection".into(),
            })?;
            let record = format!("{name} {pid} {}\n", boot_id());
            let file = self.record_file(key);
            let count = self.connections_file(key);
            let written = std::fs::write(&count, connections.max(1).to_string())
                .map_err(io("write", &count))
                .and_then(|_| std::fs::write(&file, record).map_err(io("write", &file)));
            if let Err(e) = written {
                // Unrecorded, it would be nobody's: undo it.
                let _ = self.disconnect_device(&device);
                let _ = std::fs::remove_file(&count);
                return Err(e);
            }
            if self.own_helper(key, server) {
                self.wait_for_the_helper(&name, &device);
            }
            return Ok((device, true));
        }
        Err(last.unwrap_or_else(|| SysError::Refused {
            path: PathBuf::from("/dev/nbd*"),
            what: "no free nbd device (load the module with a larger nbds_max)".into(),
        }))
    }

    /// Disconnect `key`'s device (only while it is still the one recorded)
    /// and forget it; nothing connected is fine.
    fn disconnect(&self, key: &str) -> Result<(), SysError> {
        if let Some(device) = self.device(key) {
            self.disconnect_device(&device)?;
        }
        remove(&self.connections_file(key))?;
        remove(&self.record_file(key))
    }

    /// Hand `key`'s device new connections to `server`'s `export` in place
    /// of those that died; connections that did not die are kept (the
    /// kernel takes a socket only for a dead one). False when `key` has no
    /// device (detached meanwhile).
    fn reconnect(&self, key: &str, server: &str, export: &str) -> Result<bool, SysError> {
        let Some(device) = self.device(key) else { return Ok(false) };
        let index = index_of(&device).ok_or_else(|| SysError::Refused {
            path: device.clone(),
            what: "not an nbd device".into(),
        })?;
        // One for a device an earlier agent made (it recorded no count).
        let count = std::fs::read_to_string(self.connections_file(key))
            .ok()
            .and_then(|t| t.trim().parse::<u8>().ok())
            .unwrap_or(1)
            .clamp(1, 16);
        let size = device_bytes(&device)?;
        let mut clients = Vec::with_capacity(count.into());
        for _ in 0..count {
            let client = crate::nbd::client::Client::connect(server, export, self.command_timeout)
                .map_err(|e| SysError::Command {
                    program: "nbd reconnect",
                    path: device.clone(),
                    message: e.to_string(),
                })?;
            // Another export behind the same address would be written
            // where this one's filesystem thinks its blocks are. The
            // kernel counts whole 512-byte sectors.
            let served = client.info().size;
            if served / 512 * 512 != size {
                return Err(SysError::Refused {
                    path: device,
                    what: format!(
                        "{server} now serves {served} bytes, the device has {size}: not reconnected"
                    ),
                });
            }
            clients.push(client.into_socket());
        }
        // Still this export's device (not detached and taken meanwhile).
        if self.device(key).as_ref() != Some(&device) {
            return Ok(false);
        }
        let sockets = clients.iter().map(std::os::fd::AsFd::as_fd).collect();
        super::netlink::reconfigure(
            index,
            &super::netlink::Reconfigure { sockets, ..Default::default() },
        )?;
        Ok(true)
    }

    /// Have `key`'s device wait for its helper (the dead-connection
    /// timeout), when `server` is that helper: a device an earlier agent
    /// connected was not told to.
    fn wait_for_its_helper(&self, key: &str, server: &str) {
        if let Some(device) = self.device(key).filter(|_| self.own_helper(key, server)) {
            let name = device.file_name().unwrap_or_default().to_string_lossy().into_owned();
            self.wait_for_the_helper(&name, &device);
        }
    }

    /// Every export with a record, and its device while it is connected.
    fn connections(&self) -> Vec<(String, Option<PathBuf>)> {
        let Ok(entries) = std::fs::read_dir(&self.base) else { return Vec::new() };
        let mut keys: Vec<String> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name();
                let name = name.to_str()?;
                // A connections file alone (a crash between the two writes,
                // or an older agent's detach) is listed too, to be forgotten.
                name.strip_suffix(".kernel")
                    .or_else(|| name.strip_suffix(".kernel.connections"))
                    .map(str::to_string)
            })
            .filter(|k| k.starts_with("export-"))
            .collect();
        keys.sort();
        keys.dedup();
        keys.into_iter()
            .map(|k| {
                let device = self.device(&k);
                (k, device)
            })
            .collect()
    }
}

/// How often a device not reconnected yet is tried again.
const RETRY_EVERY: Duration = Duration::from_millis(500);

/// Kernel devices whose helper was started again, each reconnected to it
/// as soon as its helper is back, and again every [`RETRY_EVERY`] while
/// that fails, until `give_up_after` (by then the kernel has failed what
/// waited). On a thread of its own: a helper that accepts and never
/// negotiates holds up only this, never the healing of other volumes.
pub struct Reconnects {
    healed: std::sync::mpsc::Sender<String>,
}

impl Reconnects {
    /// Start the thread; it first has every device an earlier agent
    /// connected to its helper wait for that helper, as this one does.
    pub fn start(
        kernel: std::sync::Arc<dyn KernelNbd>,
        helpers: std::sync::Arc<dyn crate::sys::ExportHelpers>,
        give_up_after: Duration,
    ) -> Reconnects {
        let (healed, keys) = std::sync::mpsc::channel::<String>();
        let spawned = std::thread::Builder::new().name("nbd-reconnect".into()).spawn(move || {
            for (key, device) in kernel.connections() {
                if device.is_some() {
                    kernel.wait_for_its_helper(&key, &helpers.server_address(&key));
                }
            }
            let mut due = std::collections::BTreeMap::new();
            loop {
                let wait = if due.is_empty() { Duration::from_secs(3600) } else { RETRY_EVERY };
                match keys.recv_timeout(wait) {
                    Ok(key) => {
                        due.insert(key, std::time::Instant::now());
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                }
                while let Ok(key) = keys.try_recv() {
                    due.insert(key, std::time::Instant::now());
                }
                due.retain(|key: &String, since: &mut std::time::Instant| {
                    reconnect_once(kernel.as_ref(), helpers.as_ref(), key, *since, give_up_after)
                });
            }
        });
        if let Err(e) = spawned {
            tracing::error!("kernel nbd devices will not be reconnected to their helpers: {e}");
        }
        Reconnects { healed }
    }

    /// Helpers started again: their devices are reconnected.
    pub fn healed(&self, keys: Vec<String>) {
        for key in keys {
            let _ = self.healed.send(key);
        }
    }
}

/// Try `key`'s device once; whether to try again.
fn reconnect_once(
    kernel: &dyn KernelNbd,
    helpers: &dyn crate::sys::ExportHelpers,
    key: &str,
    since: std::time::Instant,
    give_up_after: Duration,
) -> bool {
    match kernel.reconnect(key, &helpers.server_address(key), "") {
        Ok(true) => {
            tracing::info!(
                export = key,
                "its kernel nbd device was reconnected to its helper, started again"
            );
            false
        }
        // No kernel device (a userspace client's helper, or detached).
        Ok(false) => false,
        Err(e) if since.elapsed() < give_up_after => {
            tracing::debug!(export = key, "not reconnected yet: {e}");
            true
        }
        Err(e) => {
            tracing::error!(
                export = key,
                "its kernel nbd device could not be reconnected to its helper within {give_up_after:?}, so its I/O fails: {e}"
            );
            false
        }
    }
}

/// Kernel NBD on a node without the nbd driver: every connect refused by
/// `missing`, while the records earlier boots left (a node that rebooted
/// without the module) are still listed and forgotten, so reconciliation
/// clears them once rather than meeting them at every start.
pub struct Unloaded {
    pub records: NbdDevices,
    pub missing: crate::sys::missing::Missing,
}

impl KernelNbd for Unloaded {
    fn available(&self) -> bool {
        false
    }

    fn connect(
        &self,
        key: &str,
        _server: &str,
        _export: &str,
        _connections: u8,
        _read_only: bool,
    ) -> Result<(PathBuf, bool), SysError> {
        Err(self.missing.refuse(key))
    }

    /// Without the driver no device is connected; a record only names one.
    fn device(&self, _key: &str) -> Option<PathBuf> {
        None
    }

    fn disconnect(&self, key: &str) -> Result<(), SysError> {
        remove(&self.records.connections_file(key))?;
        remove(&self.records.record_file(key))
    }

    fn connections(&self) -> Vec<(String, Option<PathBuf>)> {
        self.records.connections().into_iter().map(|(k, _)| (k, None)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_name_only_nbd_devices() {
        assert_eq!(
            Record::parse("nbd3 812 5d1c\n"),
            Some(Record { device: "nbd3".into(), pid: "812".into(), boot: "5d1c".into() })
        );
        for bad in ["", "nbd3 812", "loop0 1 b", "nbd 1 b", "nbd../x 1 b", "nbd1 1 b extra"] {
            assert_eq!(Record::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn servers_become_nbd_client_arguments() {
        assert_eq!(server_args("unix:/run/a.sock"), ["-u", "/run/a.sock"]);
        assert_eq!(server_args("10.0.0.5:10809"), ["10.0.0.5", "10809"]);
        assert_eq!(server_args("[fd00::1]:10809"), ["fd00::1", "10809"]);
    }

    #[test]
    fn without_the_driver_connects_are_refused_and_old_records_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let unloaded = Unloaded {
            records: NbdDevices::new(dir.path().to_path_buf()),
            missing: crate::sys::missing::Missing::new(
                "kernel NBD",
                "the nbd module is not loaded",
            ),
        };
        // A record an earlier boot left, when the node still had the module.
        std::fs::write(dir.path().join("export-1.kernel"), "nbd3 4242 an-earlier-boot\n").unwrap();
        let e = unloaded.connect("export-2", "unix:/s", "", 1, false).unwrap_err();
        assert_eq!(e.to_string(), "export-2: kernel NBD: the nbd module is not loaded");
        assert!(!unloaded.available());
        assert_eq!(unloaded.connections(), vec![("export-1".to_string(), None)]);
        assert!(unloaded.device("export-1").is_none());
        unloaded.disconnect("export-1").unwrap();
        assert!(unloaded.connections().is_empty(), "the record is gone");
        assert!(!dir.path().join("export-1.kernel").exists());
        unloaded.disconnect("export-1").expect("forgetting twice is fine");
    }

    #[test]
    fn a_connections_file_left_alone_is_listed_to_be_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let devices = NbdDevices::new(dir.path().to_path_buf());
        // A crash between the count and the record, or an older agent's detach.
        std::fs::write(dir.path().join("export-1.kernel.connections"), "2").unwrap();
        std::fs::write(dir.path().join("export-2.kernel"), "nbd3 4242 an-earlier-boot\n").unwrap();
        std::fs::write(dir.path().join("export-2.kernel.connections"), "1").unwrap();
        assert_eq!(
            devices.connections(),
            vec![("export-1".to_string(), None), ("export-2".to_string(), None)]
        );
        devices.disconnect("export-1").unwrap();
        devices.disconnect("export-2").unwrap();
        assert!(devices.connections().is_empty());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing left");
    }

    #[test]
    fn a_device_is_named_by_its_index() {
        assert_eq!(index_of(Path::new("/dev/nbd12")), Some(12));
        assert_eq!(index_of(Path::new("/dev/loop1")), None);
        assert_eq!(index_of(Path::new("/dev/nbd")), None);
    }
}
