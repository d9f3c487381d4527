//! The kernel's rbd driver (krbd): an image mapped as `/dev/rbdN` through
//! sysfs, as `rbd device map` does, without the `rbd` tool or a keyring
//! file. The user's key goes into the kernel's keyring for the one write
//! that maps, which names it (`key=`) rather than carrying it (`secret=`):
//! sysfs shows that line (`config_info`) for as long as the image is mapped.
//!
//! A mapping is found again by what sysfs says of it (pool, image, and the
//! monitors it was mapped with, from `config_info`), so a retried attach
//! reuses it. Which mappings are the agent's (an admin may map images by
//! hand) is kept as a mark file per mapping, naming its kernel client's
//! address (unique: it carries a nonce), written right after the map and
//! removed with the unmap, so that neither an attach nor start-up
//! reconciliation touches a mapping the agent did not make. Each mapping
//! gets a kernel client of its own (`noshare`): blocklisting one volume's
//! client fences that volume alone.

use super::keyring::ThreadKey;
use super::rbd_export::CephClient;
use super::{KernelRbd, SysError, io};
use std::net::ToSocketAddrs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// One image mapped by the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelMapping {
    /// Its number: `/sys/bus/rbd/devices/<id>`, `/dev/rbd<id>`.
    pub id: u32,
    pub pool: String,
    pub image: String,
    /// The monitors it was mapped with, as written ("ip:port,…").
    pub monitors: String,
    /// The kernel client's global id and address, as the cluster sees it.
    pub client_id: u64,
    pub client_addr: String,
    pub device: PathBuf,
    /// Whether this agent mapped it.
    pub ours: bool,
}

#[derive(Debug)]
pub struct Krbd {
    bus: PathBuf,
    dev: PathBuf,
    /// The marks of the mappings this agent made.
    marks: PathBuf,
    probed: std::sync::OnceLock<bool>,
    /// How long the kernel may try to reach the cluster (its `mount_timeout`).
    pub connect_timeout: Duration,
}

impl Krbd {
    /// The node's driver; marks kept in `marks` (beneath the state dir).
    pub fn new(marks: PathBuf) -> Self {
        Krbd {
            bus: PathBuf::from("/sys/bus/rbd"),
            dev: PathBuf::from("/dev"),
            marks,
            probed: std::sync::OnceLock::new(),
            connect_timeout: Duration::from_secs(20),
        }
    }
}

/// The monitors as the kernel takes them: resolved addresses, sorted, so
/// that a mapping made from the same list reads back the same.
pub fn kernel_monitors(monitors: &str) -> Result<String, String> {
    let mut addrs = Vec::new();
    for m in monitors.split(',').map(str::trim).filter(|m| !m.is_empty()) {
        let resolved = m.to_socket_addrs().map_err(|e| format!("monitor {m}: {e}"))?;
        // The kernel client speaks to one address per monitor.
        let first = resolved
            .into_iter()
            .next()
            .ok_or_else(|| format!("monitor {m} resolves to no address"))?;
        addrs.push(first.to_string());
    }
    if addrs.is_empty() {
        return Err("no monitors".into());
    }
    addrs.sort();
    addrs.dedup();
    Ok(addrs.join(","))
}

/// The options of one map request, in the kernel's syntax; `key_name` is
/// the description of the user's key in the writer's keyring.
fn map_options(user: &str, key_name: &str, read_only: bool, timeout: Duration) -> String {
    let mut options =
        format!("name={user},key={key_name},mount_timeout={},noshare", timeout.as_secs().max(1));
    if read_only {
        options.push_str(",read_only");
    }
    options
}

impl Krbd {
    fn mark(&self, id: u32) -> PathBuf {
        self.marks.join(format!("krbd-{id}"))
    }

    /// Whether mapping `id`, whose client is at `client_addr`, is ours.
    fn marked(&self, id: u32, client_addr: &str) -> bool {
        std::fs::read_to_string(self.mark(id))
            .is_ok_and(|m| m.split_whitespace().next() == Some(client_addr))
    }

    fn add_file(&self) -> PathBuf {
        self.bus.join("add_single_major")
    }

    fn remove_file(&self) -> PathBuf {
        self.bus.join("remove_single_major")
    }

    fn attr(&self, id: &str, name: &str) -> Option<String> {
        std::fs::read_to_string(self.bus.join("devices").join(id).join(name))
            .ok()
            .map(|s| s.trim().to_string())
    }
}

impl KernelRbd for Krbd {
    /// The first ask tries to load the driver, as `rbd device map` would.
    fn available(&self) -> bool {
        *self.probed.get_or_init(|| {
            if !self.add_file().exists() {
                let loaded = std::process::Command::new("modprobe")
                    .args(["-q", "rbd"])
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status();
                tracing::debug!(?loaded, "modprobe rbd");
            }
            self.add_file().exists()
        })
    }

    fn mappings(&self) -> Result<Vec<KernelMapping>, SysError> {
        let devices = self.bus.join("devices");
        let entries = match std::fs::read_dir(&devices) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io("list", &devices)(e)),
        };
        let mut found = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Ok(id) = name.parse::<u32>() else { continue };
            // Gone between the listing and the read: not a mapping any more.
            let (Some(pool), Some(image)) = (self.attr(&name, "pool"), self.attr(&name, "name"))
            else {
                continue;
            };
            // config_info is the line that mapped it. The agent's name their
            // key (key=…), but one mapped by hand may carry it (secret=…):
            // only its first word (the monitors) is kept, and the rest wiped.
            let config =
                zeroize::Zeroizing::new(self.attr(&name, "config_info").unwrap_or_default());
            let monitors = config.split_whitespace().next().unwrap_or_default().to_string();
            let client_id = self
                .attr(&name, "client_id")
                .and_then(|c| c.trim_start_matches("client").parse().ok())
                .unwrap_or_default();
            let client_addr = self.attr(&name, "client_addr").unwrap_or_default();
            let device = self.dev.join(format!("rbd{id}"));
            let ours = self.marked(id, &client_addr);
            found.push(KernelMapping {
                id,
                pool,
                image,
                monitors,
                client_id,
                client_addr,
                device,
                ours,
            });
        }
        found.sort_by_key(|m| m.id);
        Ok(found)
    }

    fn map(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
        read_only: bool,
    ) -> Result<(KernelMapping, bool), SysError> {
        let what = PathBuf::from(format!("rbd image {pool}/{image}"));
        let refuse = |why: String| SysError::Refused { path: what.clone(), what: why };
        let monitors =
            kernel_monitors(client.monitors.as_deref().unwrap_or_default()).map_err(refuse)?;
        let before = self.mappings_of(&monitors, pool, image)?;
        if let Some(m) = before.iter().find(|m| m.ours) {
            return Ok((m.clone(), false));
        }
        let key = match &client.key {
            Some(secret) => secret.ceph_key_bytes("key").map_err(refuse)?,
            None => return Err(refuse("the kernel's rbd driver needs the user's key from the volume's secret (it reads no keyring file)".into())),
        };
        // Image and pool names reach the kernel as words of one line.
        for (name, value) in [("pool", pool), ("image", image), ("user", client.user.as_str())] {
            if value.is_empty()
                || value.chars().any(|c| c.is_whitespace() || c == ',' || c.is_control())
            {
                return Err(refuse(format!("{name} {value:?} cannot be mapped by the kernel")));
            }
        }
        std::fs::create_dir_all(&self.marks).map_err(io("mkdir", &self.marks))?;
        let add = self.add_file();
        let started = Instant::now();
        let written = {
            // The kernel copies the key out of the keyring while it parses
            // the line, on this thread (see keyring): the key is there for
            // the write alone, and leaves when `handed` drops, mapped or not.
            let handed = ThreadKey::ceph(&key)
                .map_err(|e| refuse(format!("the kernel's rbd driver gets no key: {e}")))?;
            drop(key);
            let line = format!(
                "{monitors} {} {pool} {image}",
                map_options(&client.user, handed.description(), read_only, self.connect_timeout)
            );
            // The write blocks until the kernel has mapped it or given up.
            std::fs::write(&add, line.as_bytes())
        };
        if let Err(e) = written {
            return Err(SysError::Refused {
                path: what,
                what: format!(
                    "the kernel's rbd driver refused to map it (monitors {monitors}, user {}): {e}",
                    client.user
                ),
            });
        }
        tracing::debug!(ms = started.elapsed().as_millis() as u64, "krbd map {pool}/{image}");
        // The new one: of this image, and not there before.
        let mut mapping = self
            .mappings_of(&monitors, pool, image)?
            .into_iter()
            .find(|m| !before.iter().any(|b| b.id == m.id))
            .ok_or_else(|| refuse("mapped, but the kernel lists no new mapping of it".into()))?;
        let mark = self.mark(mapping.id);
        if let Err(e) =
            std::fs::write(&mark, format!("{} {monitors} {pool} {image}\n", mapping.client_addr))
        {
            let _ = self.unmap(mapping.id, false);
            return Err(io("write", &mark)(e));
        }
        mapping.ours = true;
        // devtmpfs makes the node; give it a moment where udev does.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !mapping.device.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if !mapping.device.exists() {
            let _ = self.unmap(mapping.id, false);
            return Err(refuse(format!(
                "mapped as {}, but no device node appeared",
                mapping.device.display()
            )));
        }
        Ok((mapping, true))
    }

    fn unmap(&self, id: u32, force: bool) -> Result<(), SysError> {
        if !self.bus.join("devices").join(id.to_string()).exists() {
            // Gone already; so is its mark, then.
            let _ = std::fs::remove_file(self.mark(id));
            return Ok(());
        }
        let request = if force { format!("{id} force") } else { id.to_string() };
        let remove = self.remove_file();
        match std::fs::write(&remove, request) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(nix::libc::ENOENT) => {}
            Err(e) => {
                return Err(SysError::Refused {
                    path: self.dev.join(format!("rbd{id}")),
                    what: format!("unmap: {e}"),
                });
            }
        }
        let mark = self.mark(id);
        match std::fs::remove_file(&mark) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io("remove", &mark)(e));
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monitors_are_resolved_sorted_and_deduplicated() {
        assert_eq!(
            kernel_monitors("127.0.0.2:6789, 127.0.0.1:6789,127.0.0.1:6789").unwrap(),
            "127.0.0.1:6789,127.0.0.2:6789"
        );
        assert_eq!(kernel_monitors("localhost:3300").unwrap().rsplit_once(':').unwrap().1, "3300");
        assert!(kernel_monitors("").is_err());
        assert!(kernel_monitors("no-such-host.invalid:6789").is_err());
    }

    #[test]
    fn options_name_the_key_and_carry_the_timeout_and_read_only() {
        assert_eq!(
            map_options("u", "volagent:7:0", false, Duration::from_secs(20)),
            "name=u,key=volagent:7:0,mount_timeout=20,noshare"
        );
        assert_eq!(
            map_options("u", "volagent:7:1", true, Duration::from_millis(10)),
            "name=u,key=volagent:7:1,mount_timeout=1,noshare,read_only"
        );
        for read_only in [false, true] {
            let options = map_options("u", "K", read_only, Duration::from_secs(20));
            assert!(!options.contains("secret"), "the key itself is never in the line: {options}");
            assert_eq!(
                options.split(',').filter(|o| o.starts_with("key=")).collect::<Vec<_>>(),
                ["key=K"]
            );
        }
    }

    #[test]
    fn mappings_are_read_from_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        // One mapped by hand with the key in the line, and one as the agent
        // maps: the line names the key in the keyring.
        for (id, config, client) in [
            (3, "127.0.0.1:6789 name=u,secret=K rbd img\n", "4120"),
            (
                4,
                "127.0.0.1:6789 name=u,key=volagent:1:0,mount_timeout=20,noshare rbd img\n",
                "4121",
            ),
        ] {
            let dev = dir.path().join(format!("devices/{id}"));
            std::fs::create_dir_all(&dev).unwrap();
            for (name, value) in [
                ("pool", "rbd\n".to_string()),
                ("name", "img\n".to_string()),
                ("config_info", config.to_string()),
                ("client_id", format!("client{client}\n")),
                ("client_addr", format!("127.0.0.1:0/{}\n", id + 26)),
            ] {
                std::fs::write(dev.join(name), value).unwrap();
            }
        }
        std::fs::create_dir_all(dir.path().join("devices/not-a-number")).unwrap();
        let k = Krbd {
            bus: dir.path().to_path_buf(),
            dev: "/dev".into(),
            ..Krbd::new(dir.path().join("marks"))
        };
        let found = k.mappings().unwrap();
        assert_eq!(found.len(), 2);
        assert_eq!(
            found[1],
            KernelMapping {
                id: 4,
                pool: "rbd".into(),
                image: "img".into(),
                monitors: "127.0.0.1:6789".into(),
                client_id: 4121,
                client_addr: "127.0.0.1:0/30".into(),
                device: "/dev/rbd4".into(),
                ours: false,
            }
        );
        assert_eq!(
            found[0],
            KernelMapping {
                id: 3,
                pool: "rbd".into(),
                image: "img".into(),
                monitors: "127.0.0.1:6789".into(),
                client_id: 4120,
                client_addr: "127.0.0.1:0/29".into(),
                device: "/dev/rbd3".into(),
                ours: false,
            }
        );
        std::fs::create_dir_all(dir.path().join("marks")).unwrap();
        std::fs::write(k.mark(3), "127.0.0.1:0/28 127.0.0.1:6789 rbd img\n").unwrap();
        assert!(
            !k.mappings().unwrap()[0].ours,
            "a mark of an earlier mapping with that number: not this one"
        );
        std::fs::write(k.mark(3), "127.0.0.1:0/29 127.0.0.1:6789 rbd img\n").unwrap();
        assert!(k.mappings().unwrap()[0].ours, "marked: the agent's own");
        assert_eq!(
            k.mappings_of("127.0.0.1:6789", "rbd", "img").unwrap().len(),
            2,
            "found again by monitors, pool and image, either line"
        );
        assert!(k.mappings_of("127.0.0.2:6789", "rbd", "img").unwrap().is_empty());
        // Unmapping what is not mapped is done already.
        k.unmap(9, false).unwrap();
    }
}
