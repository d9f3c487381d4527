//! A node in memory: mounts, loop devices, filesystems and dirs as state,
//! every operation logged, and failures injected on request. For tests of
//! the logic above `sys` that need no root.

use super::{
    Devices, ExportHelpers, FileId, Filesystems, FuseClients, KernelNbd, LoopDevice, MountInfo,
    Mounts, RbdFuse, Sys, SysError, Wipe,
};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

#[derive(Debug, Default)]
pub struct State {
    pub mounts: Vec<MountInfo>,
    pub loops: Vec<LoopDevice>,
    /// Device → filesystem type.
    pub filesystems: BTreeMap<PathBuf, String>,
    pub dirs: BTreeSet<PathBuf>,
    /// Regular files (what `kind_of` sees besides dirs).
    pub files: BTreeSet<PathBuf>,
    /// Paths that are symlinks now: never followed.
    pub links: BTreeSet<PathBuf>,
    /// Userspace NBD clients running: key → (uri, read-only).
    pub nbd_clients: BTreeMap<String, (String, bool)>,
    /// Helper NBD servers running: key → read-only.
    pub nbd_servers: BTreeMap<String, bool>,
    /// Helper servers of RBD images: key → ("pool/image", the key it was
    /// given, its client's global id: 5000, 5001, … in order of start).
    pub rbd_servers: BTreeMap<String, (String, Option<String>, u64)>,
    pub rbd_started: u64,
    /// Watchers of RBD images: "pool/image" → (global id, address).
    pub rbd_watchers: BTreeMap<String, Vec<(i64, String)>>,
    /// Addresses blocklisted, in order, with the user's key used.
    pub blocklisted: Vec<(String, Option<String>)>,
    /// Whether the node has the kernel's nbd driver.
    pub nbd_kernel_driver: bool,
    /// Kernel nbd connections: key → (device, server, export, read-only).
    pub nbd_kernel: BTreeMap<String, (PathBuf, String, String, bool)>,
    /// Whether the agent's rbd helper cannot serve here (no librbd).
    pub no_rbd_helper: bool,
    /// Whether rbd-fuse is installed.
    pub rbd_fuse: bool,
    /// rbd-fuse clients running: key → ("pool/image", read-only).
    pub rbd_fuse_clients: BTreeMap<String, (String, bool)>,
    /// Storage clients recorded for clients: key → (global id, address).
    pub client_ids: BTreeMap<String, (u64, String)>,
    /// Whether the kernel has the rbd driver.
    pub krbd: bool,
    /// Kernel rbd mappings.
    pub krbd_mappings: Vec<super::krbd::KernelMapping>,
    /// Every operation, as "op path".
    pub log: Vec<String>,
    /// Fail the next operation whose "op path" starts with one of these
    /// (each prefix fails once).
    pub fail: Vec<String>,
}

#[derive(Debug, Default)]
pub struct Fake {
    state: Mutex<State>,
}

impl Fake {
    pub fn new() -> Arc<Fake> {
        Arc::new(Fake::default())
    }

    pub fn sys(self: &Arc<Self>) -> Sys {
        Sys {
            mounts: self.clone(),
            devices: self.clone(),
            filesystems: self.clone(),
            kernel_nbd: self.clone(),
            fuse_clients: self.clone(),
            export_helpers: self.clone(),
            rbd_fuse: self.clone(),
            storage: self.clone(),
            krbd: self.clone(),
            inspect: self.clone(),
            #[cfg(feature = "testing")]
            step_hook: None,
        }
    }

    pub fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Make the next operation matching `prefix` ("mount /x", "mkfs") fail.
    pub fn fail_next(&self, prefix: &str) {
        self.state().fail.push(prefix.to_string());
    }

    /// Log the operation; fail it if a failure was injected for it.
    fn op(&self, op: &'static str, path: &Path) -> Result<MutexGuard<'_, State>, SysError> {
        let mut s = self.state();
        let entry = format!("{op} {}", path.display());
        s.log.push(entry.clone());
        if let Some(i) = s.fail.iter().position(|f| entry.starts_with(f.as_str())) {
            s.fail.remove(i);
            return Err(SysError::Errno {
                op,
                path: path.to_path_buf(),
                errno: nix::errno::Errno::EIO,
            });
        }
        Ok(s)
    }
}

fn mount_info(id: u32, source: &str, target: &Path, fs_type: &str, read_only: bool) -> MountInfo {
    MountInfo {
        id,
        parent: 1,
        device: (0, id),
        root: PathBuf::from("/"),
        mount_point: target.to_path_buf(),
        options: if read_only { "ro".into() } else { "rw".into() },
        propagation: vec![],
        fs_type: fs_type.to_string(),
        source: source.to_string(),
        super_options: "rw".into(),
    }
}

impl Mounts for Fake {
    fn mount_table(&self) -> Result<Vec<MountInfo>, SysError> {
        Ok(self.state().mounts.clone())
    }

    fn is_mount_point(&self, target: &Path) -> Result<Option<bool>, SysError> {
        Ok(Some(self.state().mounts.iter().any(|m| m.mount_point == target)))
    }

    fn device_of_mount(&self, target: &Path) -> Result<Option<(u32, u32)>, SysError> {
        let s = self.state();
        let Some(m) = s.mounts.iter().rev().find(|m| m.mount_point == target) else {
            return Ok(None);
        };
        Ok(Some(
            s.loops
                .iter()
                .find(|l| l.device == Path::new(&m.source))
                .map(|l| l.number)
                .unwrap_or(m.device),
        ))
    }

    fn mount(
        &self,
        source: &str,
        target: &Path,
        fs_type: &str,
        _options: &str,
        read_only: bool,
    ) -> Result<(), SysError> {
        let mut s = self.op("mount", target)?;
        if !s.dirs.contains(target) {
            return Err(SysError::Errno {
                op: "mount",
                path: target.to_path_buf(),
                errno: nix::errno::Errno::ENOENT,
            });
        }
        let id = s.mounts.len() as u32 + 100;
        s.mounts.push(mount_info(id, source, target, fs_type, read_only));
        Ok(())
    }

    fn bind(&self, source: &Path, target: &Path, read_only: bool) -> Result<(), SysError> {
        let mut s = self.op("bind", target)?;
        if !s.dirs.contains(target) || !s.dirs.contains(source) {
            return Err(SysError::Errno {
                op: "bind-mount onto",
                path: target.to_path_buf(),
                errno: nix::errno::Errno::ENOENT,
            });
        }
        let from = s
            .mounts
            .iter()
            .rev()
            .find(|m| m.mount_point == source)
            .map(|m| (m.source.clone(), m.fs_type.clone()));
        let (src, fs) = from.unwrap_or_else(|| (source.display().to_string(), "none".into()));
        let id = s.mounts.len() as u32 + 100;
        s.mounts.push(mount_info(id, &src, target, &fs, read_only));
        Ok(())
    }

    fn unmount(&self, target: &Path, _force: bool) -> Result<(), SysError> {
        let mut s = self.op("unmount", target)?;
        match s.mounts.iter().rposition(|m| m.mount_point == target) {
            Some(i) => {
                s.mounts.remove(i);
                Ok(())
            }
            None => Err(SysError::Errno {
                op: "unmount",
                path: target.to_path_buf(),
                errno: nix::errno::Errno::EINVAL,
            }),
        }
    }

    fn ensure_dir(&self, dir: &Path) -> Result<bool, SysError> {
        let mut s = self.op("mkdir", dir)?;
        Ok(s.dirs.insert(dir.to_path_buf()))
    }

    fn remove_dir(&self, dir: &Path) -> Result<(), SysError> {
        let mut s = self.op("rmdir", dir)?;
        s.dirs.remove(dir);
        Ok(())
    }

    fn bind_device(&self, device: &Path, target: &Path, read_only: bool) -> Result<(), SysError> {
        let mut s = self.op("bind-device", target)?;
        if !s.files.contains(target) {
            return Err(SysError::Errno {
                op: "bind-mount onto",
                path: target.to_path_buf(),
                errno: nix::errno::Errno::ENOENT,
            });
        }
        let id = s.mounts.len() as u32 + 100;
        s.mounts.push(mount_info(id, &device.display().to_string(), target, "devtmpfs", read_only));
        Ok(())
    }

    /// Only loop devices have numbers here.
    fn published_device(&self, target: &Path) -> Result<Option<(u32, u32)>, SysError> {
        let s = self.state();
        let Some(m) = s.mounts.iter().rev().find(|m| m.mount_point == target) else {
            return Ok(None);
        };
        Ok(s.loops.iter().find(|l| l.device == Path::new(&m.source)).map(|l| l.number))
    }

    fn device_number(&self, device: &Path) -> Result<Option<(u32, u32)>, SysError> {
        Ok(self.state().loops.iter().find(|l| l.device == device).map(|l| l.number))
    }

    fn ensure_file(&self, file: &Path) -> Result<bool, SysError> {
        let mut s = self.op("touch", file)?;
        Ok(s.files.insert(file.to_path_buf()))
    }

    fn remove_file(&self, file: &Path) -> Result<(), SysError> {
        let mut s = self.op("rm", file)?;
        s.files.remove(file);
        Ok(())
    }

    /// The fake's filesystems hold nothing and have no size.
    fn usage(&self, path: &Path) -> Result<super::Usage, SysError> {
        let s = self.op("usage", path)?;
        let read_only =
            s.mounts.iter().rev().find(|m| m.mount_point == path).is_some_and(|m| m.read_only());
        Ok(super::Usage { read_only, ..Default::default() })
    }
}

/// The fake's file identity: one per path.
fn fake_id(file: &Path) -> FileId {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    file.hash(&mut h);
    FileId { dev: 0, ino: h.finish() }
}

impl Devices for Fake {
    fn loop_tag(&self) -> &str {
        "volagent:fake"
    }

    fn loop_attach(&self, file: &Path, _read_only: bool) -> Result<PathBuf, SysError> {
        let mut s = self.op("loop-attach", file)?;
        let n = (0..)
            .find(|n| !s.loops.iter().any(|l| l.device == Path::new(&format!("/dev/loop{n}"))))
            .unwrap_or(0);
        let device = PathBuf::from(format!("/dev/loop{n}"));
        s.loops.push(LoopDevice {
            device: device.clone(),
            backing_file: file.to_path_buf(),
            backing: Some(fake_id(file)),
            tag: self.loop_tag().into(),
            number: (7, n),
        });
        // The file's filesystem shows through the device.
        if let Some(fs) = s.filesystems.get(file).cloned() {
            s.filesystems.insert(device.clone(), fs);
        }
        Ok(device)
    }

    fn loop_devices(&self) -> Result<Vec<LoopDevice>, SysError> {
        Ok(self.state().loops.clone())
    }

    fn loop_keep(&self, device: &Path, backing: FileId) -> Result<bool, SysError> {
        Ok(self.state().loops.iter().any(|l| l.device == device && l.backing == Some(backing)))
    }

    fn loop_detach(&self, device: &Path) -> Result<(), SysError> {
        let mut s = self.op("loop-detach", device)?;
        if let Some(i) = s.loops.iter().position(|l| l.device == device) {
            let l = s.loops.remove(i);
            if let Some(fs) = s.filesystems.remove(device) {
                s.filesystems.insert(l.backing_file, fs);
            }
        }
        Ok(())
    }

    fn file_id(&self, file: &Path) -> Result<Option<FileId>, SysError> {
        if self.state().links.contains(file) {
            return Err(SysError::Refused {
                path: file.to_path_buf(),
                what: "is or passes through a symbolic link".into(),
            });
        }
        Ok(Some(fake_id(file)))
    }

    fn kind_of(&self, path: &Path) -> Result<Option<super::Kind>, SysError> {
        let s = self.state();
        if s.links.contains(path) {
            return Ok(Some(super::Kind::Other));
        }
        if s.dirs.contains(path) {
            return Ok(Some(super::Kind::Dir));
        }
        Ok(s.files.contains(path).then_some(super::Kind::File))
    }

    /// The fake has no caches: `kind_of` answers.
    fn kind_of_cached(&self, _path: &Path) -> Option<Result<Option<super::Kind>, SysError>> {
        None
    }

    fn block_device(&self, path: &Path) -> Result<PathBuf, SysError> {
        Ok(path.to_path_buf())
    }

    /// Any file the state holds opens (as /dev/null: nothing reads it).
    fn open_file(&self, file: &Path, _write: bool) -> Result<std::fs::File, SysError> {
        let s = self.op("open", file)?;
        if !s.files.contains(file) {
            return Err(SysError::Errno {
                op: "open",
                path: file.to_path_buf(),
                errno: nix::errno::Errno::ENOENT,
            });
        }
        std::fs::File::open("/dev/null").map_err(super::io("open", file))
    }
}

impl Filesystems for Fake {
    fn probe(&self, device: &Path) -> Result<Option<String>, SysError> {
        let s = self.op("probe", device)?;
        Ok(s.filesystems.get(device).cloned())
    }

    fn probe_attached(
        &self,
        _device: &Path,
        file: &Path,
        _backing: Option<&std::fs::File>,
    ) -> Result<Option<String>, SysError> {
        let s = self.op("probe", file)?;
        Ok(s.filesystems.get(file).cloned())
    }

    fn mkfs(&self, device: &Path, fs_type: &str) -> Result<(), SysError> {
        let mut s = self.op("mkfs", device)?;
        s.filesystems.insert(device.to_path_buf(), fs_type.to_string());
        Ok(())
    }

    fn wipe(&self, device: &Path, _method: Wipe) -> Result<(), SysError> {
        let mut s = self.op("wipe", device)?;
        s.filesystems.remove(device);
        Ok(())
    }

    fn clear_dir(&self, dir: &Path) -> Result<u64, SysError> {
        drop(self.op("clear-dir", dir)?);
        Ok(0)
    }
    /// The fake's devices have no size: grown to 0 bytes.
    fn grow_filesystem(
        &self,
        device: &Path,
        _mount_point: &Path,
        _fs_type: &str,
    ) -> Result<u64, SysError> {
        drop(self.op("grow", device)?);
        Ok(0)
    }
}

impl KernelNbd for Fake {
    fn available(&self) -> bool {
        self.state().nbd_kernel_driver
    }

    /// Devices are /dev/nbd0, /dev/nbd1, … in order of connection.
    fn connect(
        &self,
        key: &str,
        server: &str,
        export: &str,
        _connections: u8,
        read_only: bool,
    ) -> Result<(PathBuf, bool), SysError> {
        let mut s = self.op("nbd-kernel-connect", Path::new(key))?;
        if let Some((device, ..)) = s.nbd_kernel.get(key) {
            return Ok((device.clone(), false));
        }
        let taken: BTreeSet<&PathBuf> = s.nbd_kernel.values().map(|(d, ..)| d).collect();
        let device = (0..)
            .map(|n| PathBuf::from(format!("/dev/nbd{n}")))
            .find(|d| !taken.contains(d))
            .unwrap_or_default();
        s.nbd_kernel.insert(
            key.to_string(),
            (device.clone(), server.to_string(), export.to_string(), read_only),
        );
        Ok((device, true))
    }

    fn device(&self, key: &str) -> Option<PathBuf> {
        self.state().nbd_kernel.get(key).map(|(d, ..)| d.clone())
    }

    fn disconnect(&self, key: &str) -> Result<(), SysError> {
        let mut s = self.op("nbd-kernel-disconnect", Path::new(key))?;
        s.nbd_kernel.remove(key);
        Ok(())
    }

    fn connections(&self) -> Vec<(String, Option<PathBuf>)> {
        self.state().nbd_kernel.iter().map(|(k, (d, ..))| (k.clone(), Some(d.clone()))).collect()
    }
}

/// Clients expose their export as `/fake-nbd/<key>/<key>`.
impl FuseClients for Fake {
    fn file(&self, key: &str) -> PathBuf {
        Path::new("/fake-nbd").join(key).join(key)
    }

    fn rbd_fuse_file(&self, key: &str, image: &str) -> PathBuf {
        self.file(key).with_file_name(image)
    }

    fn connect(
        &self,
        key: &str,
        server: &str,
        export: &str,
        _connections: u8,
        read_only: bool,
    ) -> Result<bool, SysError> {
        let file = self.file(key);
        let mut s = self.op("nbd-connect", &file)?;
        if s.nbd_clients.contains_key(key) {
            return Ok(false);
        }
        let uri = super::nbd::uri(server, export);
        s.nbd_clients.insert(key.to_string(), (uri, read_only));
        s.files.insert(file);
        Ok(true)
    }

    fn disconnect(&self, key: &str) -> Result<(), SysError> {
        let file = self.file(key);
        let mut s = self.op("nbd-disconnect", &file)?;
        s.nbd_clients.remove(key);
        s.files.remove(&file);
        if let Some((image, _)) = s.rbd_fuse_clients.remove(key) {
            let name = image.rsplit('/').next().unwrap_or_default().to_string();
            s.files.remove(&file.with_file_name(name));
        }
        s.client_ids.remove(key);
        Ok(())
    }

    fn clients(&self) -> Result<Vec<(String, bool)>, SysError> {
        let s = self.state();
        let keys: BTreeSet<&String> = s
            .nbd_clients
            .keys()
            .chain(s.nbd_servers.keys())
            .chain(s.rbd_fuse_clients.keys())
            .collect();
        Ok(keys
            .into_iter()
            .map(|k| {
                (k.clone(), s.nbd_clients.contains_key(k) || s.rbd_fuse_clients.contains_key(k))
            })
            .collect())
    }

    fn abort_hung(&self, _after: std::time::Duration) -> Vec<String> {
        Vec::new()
    }
}

impl ExportHelpers for Fake {
    fn serve(&self, key: &str, _file: std::fs::File, read_only: bool) -> Result<bool, SysError> {
        let mut s = self.op("nbd-serve", Path::new(key))?;
        Ok(s.nbd_servers.insert(key.to_string(), read_only).is_none())
    }

    fn serve_rbd(
        &self,
        key: &str,
        target: &super::rbd_export::RbdTarget,
        read_only: bool,
    ) -> Result<bool, SysError> {
        let image = format!("{}/{}", target.pool, target.image);
        let mut s = self.op("nbd-serve-rbd", Path::new(&image))?;
        let secret =
            target.client.key.as_ref().map(|k| String::from_utf8_lossy(k.expose()).into_owned());
        if !s.rbd_servers.contains_key(key) {
            let id = 5000 + s.rbd_started;
            s.rbd_started += 1;
            s.rbd_servers.insert(key.to_string(), (image, secret, id));
        }
        Ok(s.nbd_servers.insert(key.to_string(), read_only).is_none())
    }

    fn rbd_available(&self) -> bool {
        !self.state().no_rbd_helper
    }

    fn server_address(&self, key: &str) -> String {
        format!("unix:/fake-nbd/{key}.sock")
    }

    fn stop_serving(&self, key: &str) -> Result<(), SysError> {
        let mut s = self.op("nbd-stop-serving", Path::new(key))?;
        s.nbd_servers.remove(key);
        s.rbd_servers.remove(key);
        Ok(())
    }

    fn set_storage_client(&self, key: &str, id: u64, address: &str) -> Result<(), SysError> {
        self.state().client_ids.insert(key.to_string(), (id, address.to_string()));
        Ok(())
    }

    fn storage_clients(&self) -> Vec<(String, u64, String)> {
        let s = self.state();
        let helpers = s
            .rbd_servers
            .iter()
            .map(|(key, (_, _, id))| (key.clone(), *id, format!("10.0.0.9:0/{id}")));
        helpers
            .chain(
                s.client_ids.iter().map(|(key, (id, address))| (key.clone(), *id, address.clone())),
            )
            .collect()
    }
}

impl RbdFuse for Fake {
    fn available(&self) -> bool {
        self.state().rbd_fuse
    }

    fn connect(
        &self,
        key: &str,
        target: &super::rbd_export::RbdTarget,
        read_only: bool,
    ) -> Result<bool, SysError> {
        let file = self.rbd_fuse_file(key, &target.image);
        let mut s = self.op("rbd-fuse-connect", &file)?;
        if s.rbd_fuse_clients.contains_key(key) {
            return Ok(false);
        }
        let image = format!("{}/{}", target.pool, target.image);
        s.rbd_fuse_clients.insert(key.to_string(), (image.clone(), read_only));
        s.files.insert(file);
        // Its Ceph client watches the image.
        s.rbd_watchers.entry(image).or_default().push((4100, "10.0.0.9:0/41".into()));
        Ok(true)
    }
}

impl super::Storage for Fake {
    fn rbd_watchers(
        &self,
        _client: &super::rbd_export::CephClient,
        pool: &str,
        image: &str,
    ) -> Result<Vec<super::rbd_export::ImageWatcher>, SysError> {
        let name = format!("{pool}/{image}");
        let s = self.op("rbd-watchers", Path::new(&name))?;
        let listed = s.rbd_watchers.get(&name).cloned().unwrap_or_default();
        Ok(listed
            .into_iter()
            .map(|(id, address)| super::rbd_export::ImageWatcher { address, id })
            .collect())
    }

    fn blocklist(
        &self,
        client: &super::rbd_export::CephClient,
        address: &str,
    ) -> Result<(), SysError> {
        let mut s = self.op("blocklist", Path::new(address))?;
        let key = client.key.as_ref().map(|k| String::from_utf8_lossy(k.expose()).into_owned());
        s.blocklisted.push((address.to_string(), key));
        Ok(())
    }

    fn break_lock(
        &self,
        _client: &super::rbd_export::CephClient,
        pool: &str,
        image: &str,
        address: &str,
    ) -> Result<bool, SysError> {
        drop(self.op("break-lock", Path::new(&format!("{pool}/{image}")))?);
        Ok(!address.is_empty())
    }
}

/// Mappings are numbered 0, 1, … in order; client ids start at 7000.
impl super::KernelRbd for Fake {
    fn available(&self) -> bool {
        self.state().krbd
    }

    fn map(
        &self,
        client: &super::rbd_export::CephClient,
        pool: &str,
        image: &str,
        _read_only: bool,
    ) -> Result<(super::krbd::KernelMapping, bool), SysError> {
        let name = format!("{pool}/{image}");
        let mut s = self.op("krbd-map", Path::new(&name))?;
        let monitors = client.monitors.clone().unwrap_or_default();
        if let Some(m) = s
            .krbd_mappings
            .iter()
            .find(|m| m.pool == pool && m.image == image && m.monitors == monitors)
        {
            return Ok((m.clone(), false));
        }
        let id = (0..).find(|n| !s.krbd_mappings.iter().any(|m| m.id == *n)).unwrap_or_default();
        let mapping = super::krbd::KernelMapping {
            id,
            pool: pool.into(),
            image: image.into(),
            monitors,
            client_id: 7000 + u64::from(id),
            client_addr: format!("10.0.0.9:0/7{id}"),
            device: PathBuf::from(format!("/dev/rbd{id}")),
            ours: true,
        };
        s.krbd_mappings.push(mapping.clone());
        Ok((mapping, true))
    }

    fn mappings(&self) -> Result<Vec<super::krbd::KernelMapping>, SysError> {
        Ok(self.state().krbd_mappings.clone())
    }

    fn unmap(&self, id: u32, force: bool) -> Result<(), SysError> {
        let op = if force { "krbd-unmap-force" } else { "krbd-unmap" };
        let mut s = self.op(op, Path::new(&format!("/dev/rbd{id}")))?;
        s.krbd_mappings.retain(|m| m.id != id);
        Ok(())
    }
}

/// Discovery's looks at the fake's dirs, files and links; its links lead
/// nowhere and its devices have no size or identity beyond their numbers.
impl super::Inspect for Fake {
    fn list_dir(&self, dir: &Path) -> Result<Vec<PathBuf>, SysError> {
        let s = self.op("list", dir)?;
        if !s.dirs.contains(dir) {
            return Err(SysError::Errno {
                op: "list",
                path: dir.to_path_buf(),
                errno: nix::errno::Errno::ENOENT,
            });
        }
        let inside: BTreeSet<PathBuf> = s
            .dirs
            .iter()
            .chain(&s.files)
            .chain(&s.links)
            .filter(|p| p.parent() == Some(dir))
            .cloned()
            .collect();
        Ok(inside.into_iter().collect())
    }

    fn entry(&self, path: &Path) -> Result<super::InspectedEntry, SysError> {
        use super::InspectedEntry;
        let s = self.state();
        if s.links.contains(path) {
            return Ok(InspectedEntry::Link);
        }
        if s.dirs.contains(path) {
            return Ok(InspectedEntry::Dir);
        }
        if s.files.contains(path) {
            return Ok(InspectedEntry::File { bytes: 0 });
        }
        if let Some(l) = s.loops.iter().find(|l| l.device == path) {
            let rdev = nix::sys::stat::makedev(u64::from(l.number.0), u64::from(l.number.1));
            return Ok(InspectedEntry::Block { rdev });
        }
        Err(SysError::Errno {
            op: "stat",
            path: path.to_path_buf(),
            errno: nix::errno::Errno::ENOENT,
        })
    }

    fn resolve(&self, link: &Path) -> Result<PathBuf, SysError> {
        Err(SysError::Errno {
            op: "resolve",
            path: link.to_path_buf(),
            errno: nix::errno::Errno::ENOENT,
        })
    }

    fn filesystem_size(&self, path: &Path) -> Result<u64, SysError> {
        drop(self.op("statvfs", path)?);
        Ok(0)
    }

    fn block_node(&self, rdev: u64, what: &Path) -> Result<(PathBuf, u64), SysError> {
        let s = self.state();
        let number = (nix::sys::stat::major(rdev) as u32, nix::sys::stat::minor(rdev) as u32);
        match s.loops.iter().find(|l| l.number == number) {
            Some(l) => Ok((l.device.clone(), 0)),
            None => Err(SysError::Refused {
                path: what.to_path_buf(),
                what: format!("no block device {}:{}", number.0, number.1),
            }),
        }
    }

    fn identity(&self, rdev: u64) -> String {
        format!("dev:{}:{}", nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev))
    }
}
