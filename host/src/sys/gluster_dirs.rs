//! Directories of GlusterFS volumes, made, limited and removed through
//! libgfapi: the gluster provisioner's controller steps, as a client of the
//! volume (Gluster has no users: the controller is a client like any
//! other). Each step is idempotent, so a retried plan ends where the first
//! would have. A volume's client is kept for the next step and closed once
//! idle: libgfapi's `glfs_fini` waits 10 s for frames that never finish.
//!
//! A directory's quota limit is the extended attribute that `gluster
//! volume quota <volume> limit-usage` itself sets through its own client
//! mount: `trusted.glusterfs.quota.limit-set`, the hard limit in bytes and
//! the soft limit in percent (-1: the volume's default), big-endian i64
//! each. The bricks' quota translator accepts that attribute only from a
//! client that declares itself gluster's quota helper (client pid -5,
//! `glfs_setfspid`), so only those calls run as it. The volume's quota must
//! have been enabled once by its admin (`gluster volume quota <volume>
//! enable`); a limit on a volume without it would never be enforced, so
//! it is refused instead.
//!
//! libgfapi is loaded at run time, not linked: the controller runs (and
//! serves every other backend) without it.
// FFI: every unsafe block calls libgfapi with the handles and buffers its
// header (glfs.h) describes.
#![allow(unsafe_code)]

use libloading::Library;
use nix::libc;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::io;
use std::os::fd::AsRawFd;

type Fs = *mut c_void;
type Fd = *mut c_void;

/// A gluster volume and the servers its volume file is fetched from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlusterVolume {
    /// "host" or "host:port" (24007 when none); the first is asked first.
    pub servers: Vec<String>,
    pub volume: String,
}

impl GlusterVolume {
    fn describe(&self) -> String {
        format!("gluster volume {} (servers {})", self.volume, self.servers.join(","))
    }
}

/// Why a directory step could not be done.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    #[error(
        "libgfapi cannot be loaded ({0}): install GlusterFS's client library (Debian: libgfapi0)"
    )]
    Library(String),
    /// The request names no directory beneath a volume's root, or no servers.
    #[error("{0}")]
    Invalid(String),
    /// What the step needs does not exist (the directory to limit).
    #[error("{0}")]
    NotFound(String),
    /// The path is taken by something other than what the step would make.
    #[error("{0}")]
    Conflict(String),
    /// Not now: the volume's quota is not enabled.
    #[error("{0}")]
    Unready(String),
    /// The step cannot be done to this directory (lowering its limit).
    #[error("{0}")]
    Refused(String),
    #[error("{object}: {op}: {source}")]
    Gluster { object: String, op: &'static str, source: io::Error },
}

/// A directory as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirState {
    /// Permission bits.
    pub mode: u32,
    /// Its quota's hard limit; none without one.
    pub quota_bytes: Option<u64>,
}

/// What the controller does to directories of gluster volumes. Paths are
/// relative to the volume's root. Blocking: run off the runtime.
pub trait GlusterDirs: Send + Sync {
    /// Make `path` and its missing parents, and limit it to `quota` bytes
    /// (0: none); true when it was made. There already with that limit (or
    /// none yet) is success; with another: [`DirError::Conflict`].
    fn create(&self, volume: &GlusterVolume, path: &str, quota: u64) -> Result<bool, DirError>;
    /// Remove `path` and everything in it; false when it was not there.
    fn remove(&self, volume: &GlusterVolume, path: &str) -> Result<bool, DirError>;
    /// Raise the limit of `path` to `bytes`; its limit afterwards (none:
    /// it has none, and keeps none). A higher limit is refused.
    fn raise_quota(
        &self,
        volume: &GlusterVolume,
        path: &str,
        bytes: u64,
    ) -> Result<Option<u64>, DirError>;
    /// `path` as it is; none when it does not exist.
    fn state(&self, volume: &GlusterVolume, path: &str) -> Result<Option<DirState>, DirError>;
}

/// The limit's attribute, and the size the quota's marker keeps on every
/// directory (the root's is there once quota is enabled).
const LIMIT_KEY: &str = "trusted.glusterfs.quota.limit-set";
const SIZE_KEY: &str = "trusted.glusterfs.quota.size";
/// GF_CLIENT_PID_QUOTA_MOUNT: the client pid of gluster's quota helper.
const QUOTA_HELPER_PID: libc::pid_t = -5;
/// The soft limit of a new limit: the volume's default (as the CLI sets it).
const DEFAULT_SOFT_LIMIT: i64 = -1;
const DEFAULT_PORT: c_int = 24007;
/// GF_LOG_ERROR.
const LOG_ERROR: c_int = 4;
/// Parents are the admin's; a volume's own directory is written by its
/// pods, whatever their uid (it is reached only through its volume).
const PARENT_MODE: libc::mode_t = 0o755;
const VOLUME_MODE: libc::mode_t = 0o777;

/// The functions used, resolved once per process.
struct Api {
    new: unsafe extern "C" fn(*const c_char) -> Fs,
    set_volfile_server: unsafe extern "C" fn(Fs, *const c_char, *const c_char, c_int) -> c_int,
    set_logging: unsafe extern "C" fn(Fs, *const c_char, c_int) -> c_int,
    init: unsafe extern "C" fn(Fs) -> c_int,
    fini: unsafe extern "C" fn(Fs) -> c_int,
    lstat: unsafe extern "C" fn(Fs, *const c_char, *mut libc::stat) -> c_int,
    mkdir: unsafe extern "C" fn(Fs, *const c_char, libc::mode_t) -> c_int,
    chmod: unsafe extern "C" fn(Fs, *const c_char, libc::mode_t) -> c_int,
    rmdir: unsafe extern "C" fn(Fs, *const c_char) -> c_int,
    unlink: unsafe extern "C" fn(Fs, *const c_char) -> c_int,
    opendir: unsafe extern "C" fn(Fs, *const c_char) -> Fd,
    readdirplus_r: unsafe extern "C" fn(
        Fd,
        *mut libc::stat,
        *mut libc::dirent,
        *mut *mut libc::dirent,
    ) -> c_int,
    closedir: unsafe extern "C" fn(Fd) -> c_int,
    lgetxattr: unsafe extern "C" fn(Fs, *const c_char, *const c_char, *mut c_void, usize) -> isize,
    lsetxattr: unsafe extern "C" fn(
        Fs,
        *const c_char,
        *const c_char,
        *const c_void,
        usize,
        c_int,
    ) -> c_int,
    /// Private to gluster's own tools (GFAPI_PRIVATE_6.1): only quotas need it.
    setfspid: Option<unsafe extern "C" fn(Fs, libc::pid_t) -> c_int>,
    _library: Library,
}

static API: std::sync::OnceLock<Result<Api, String>> = std::sync::OnceLock::new();

impl Api {
    fn get() -> Result<&'static Api, DirError> {
        API.get_or_init(Api::load).as_ref().map_err(|e| DirError::Library(e.clone()))
    }

    fn load() -> Result<Api, String> {
        // SAFETY: loading libgfapi runs its initialisers, which only set up
        // its own state.
        let lib =
            unsafe { Library::new("libgfapi.so.0") }.map_err(|e| format!("libgfapi.so.0: {e}"))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the signature is the one glfs.h declares.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{}: {e}", $name))?
            };
        }
        // SAFETY: glfs-internal.h's signature.
        let setfspid = unsafe { lib.get(b"glfs_setfspid\0") }.ok().map(|s| *s);
        Ok(Api {
            new: sym!("glfs_new"),
            set_volfile_server: sym!("glfs_set_volfile_server"),
            set_logging: sym!("glfs_set_logging"),
            init: sym!("glfs_init"),
            fini: sym!("glfs_fini"),
            lstat: sym!("glfs_lstat"),
            mkdir: sym!("glfs_mkdir"),
            chmod: sym!("glfs_chmod"),
            rmdir: sym!("glfs_rmdir"),
            unlink: sym!("glfs_unlink"),
            opendir: sym!("glfs_opendir"),
            readdirplus_r: sym!("glfs_readdirplus_r"),
            closedir: sym!("glfs_closedir"),
            lgetxattr: sym!("glfs_lgetxattr"),
            lsetxattr: sym!("glfs_lsetxattr"),
            setfspid,
            _library: lib,
        })
    }
}

/// `path` checked: names joined by '/', none empty, `.` or `..`, nor
/// with a NUL. The plan's check already refused worse; this is the last
/// line before the volume.
fn checked(volume: &GlusterVolume, path: &str) -> Result<Vec<String>, DirError> {
    let names: Vec<&str> = path.split('/').collect();
    let bad = |n: &&str| n.is_empty() || *n == "." || *n == ".." || n.contains('\0');
    if path.is_empty() || names.iter().any(bad) {
        return Err(DirError::Invalid(format!(
            "{}: {path:?} is not a directory path beneath the volume's root",
            volume.describe()
        )));
    }
    Ok(names.into_iter().map(String::from).collect())
}

/// "host" or "host:port" or "[v6]:port": host and port.
fn server(s: &str) -> Result<(String, c_int), String> {
    let (host, port) = match s.strip_prefix('[') {
        Some(rest) => {
            let (host, after) = rest.split_once(']').ok_or("an unclosed '['")?;
            (host, after.strip_prefix(':'))
        }
        None => match s.rsplit_once(':') {
            Some((host, port)) if !host.contains(':') => (host, Some(port)),
            _ => (s, None),
        },
    };
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p.parse::<u16>().ok().filter(|p| *p != 0).ok_or("a bad port")?.into(),
    };
    if host.is_empty() {
        return Err("no host".into());
    }
    Ok((host.to_string(), port))
}

fn is_dir(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

fn kind(st: &libc::stat) -> &'static str {
    match st.st_mode & libc::S_IFMT {
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFREG => "a file",
        _ => "not a directory",
    }
}

fn zeroed_stat() -> libc::stat {
    // SAFETY: `stat` is plain data; all zeroes is a valid value.
    unsafe { std::mem::zeroed() }
}

/// One client of one volume, closed on drop.
///
/// libgfapi's calls on one `glfs_t` are thread-safe, and the pid
/// `glfs_setfspid` sets applies to the calling thread's calls only.
struct Client {
    api: &'static Api,
    fs: Fs,
    what: String,
    /// Where libgfapi logs: its errors explain a failed connection.
    log: std::fs::File,
}

// SAFETY: see above; the handle is only used through libgfapi's calls.
unsafe impl Send for Client {}
// SAFETY: as for Send.
unsafe impl Sync for Client {}

impl Drop for Client {
    fn drop(&mut self) {
        // SAFETY: made once (even a failed init is finished this way), once.
        unsafe { (self.api.fini)(self.fs) };
    }
}

fn c(what: &str, text: &str) -> Result<CString, DirError> {
    CString::new(text).map_err(|_| DirError::Invalid(format!("{what}: {text:?} holds a NUL")))
}

impl Client {
    fn connect(volume: &GlusterVolume) -> Result<Client, DirError> {
        let api = Api::get()?;
        let what = volume.describe();
        if volume.servers.is_empty() {
            return Err(DirError::Invalid(format!("{what}: no servers to reach it by")));
        }
        let name = c(&what, &volume.volume)?;
        // SAFETY: a C string; a null answer is a failure.
        let fs = unsafe { (api.new)(name.as_ptr()) };
        if fs.is_null() {
            return Err(DirError::Gluster {
                object: what,
                op: "start a client",
                source: io::Error::last_os_error(),
            });
        }
        // An anonymous file: the log lives as long as the connection.
        let log = rustix::fs::memfd_create("volagent-gfapi-log", rustix::fs::MemfdFlags::CLOEXEC)
            .map(std::fs::File::from)
            .map_err(|e| DirError::Gluster {
                object: what.clone(),
                op: "make the client's log",
                source: e.into(),
            })?;
        let client = Client { api, fs, what, log };
        let log_path = c(&client.what, &format!("/proc/self/fd/{}", client.log.as_raw_fd()))?;
        // SAFETY: a live fs and a C string.
        unsafe { (api.set_logging)(fs, log_path.as_ptr(), LOG_ERROR) };
        let tcp = c(&client.what, "tcp")?;
        for s in &volume.servers {
            let (host, port) = server(s)
                .map_err(|e| DirError::Invalid(format!("{}: server {s:?}: {e}", client.what)))?;
            let host = c(&client.what, &host)?;
            // SAFETY: a live fs and C strings; each call adds a server.
            let ret = unsafe { (api.set_volfile_server)(fs, tcp.as_ptr(), host.as_ptr(), port) };
            if ret != 0 {
                return Err(client.failure("add the server", io::Error::last_os_error()));
            }
        }
        // SAFETY: a live fs with its servers set.
        if unsafe { (api.init)(fs) } != 0 {
            let e = io::Error::last_os_error();
            let why = client.log_errors();
            let message = if why.is_empty() { e.to_string() } else { format!("{e}; {why}") };
            return Err(client.failure("connect", io::Error::new(e.kind(), message)));
        }
        Ok(client)
    }

    /// The error lines libgfapi logged, the last few.
    fn log_errors(&self) -> String {
        let path = std::path::PathBuf::from(format!("/proc/self/fd/{}", self.log.as_raw_fd()));
        super::gluster_mount::tail(&path, 3)
    }

    fn failure(&self, op: &'static str, source: io::Error) -> DirError {
        DirError::Gluster { object: self.what.clone(), op, source }
    }

    fn at(&self, path: &str) -> String {
        format!("{}: directory {}", self.what, path.trim_start_matches('/'))
    }

    fn fail_at(&self, path: &str, op: &'static str, source: io::Error) -> DirError {
        DirError::Gluster { object: self.at(path), op, source }
    }

    /// `path` (absolute in the volume) as it is, not followed; none when missing.
    fn lstat(&self, path: &str) -> Result<Option<libc::stat>, DirError> {
        let p = c(&self.what, path)?;
        let mut st = zeroed_stat();
        // SAFETY: a live fs, a C string and a stat buffer.
        if unsafe { (self.api.lstat)(self.fs, p.as_ptr(), &mut st) } == 0 {
            return Ok(Some(st));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENOENT) => Ok(None),
            _ => Err(self.fail_at(path, "look at it", e)),
        }
    }

    /// `names` as an absolute path, its parents checked to be directories,
    /// never links (nothing is followed out of the volume); none when one
    /// of them is missing.
    fn resolve(&self, names: &[String]) -> Result<Option<String>, DirError> {
        let mut path = String::new();
        for (i, name) in names.iter().enumerate() {
            path.push('/');
            path.push_str(name);
            if i + 1 == names.len() {
                break;
            }
            match self.lstat(&path)? {
                None => return Ok(None),
                Some(st) if is_dir(&st) => {}
                Some(st) => {
                    return Err(DirError::Conflict(format!(
                        "{} is {}, not a directory: refused, nothing is followed",
                        self.at(&path),
                        kind(&st)
                    )));
                }
            }
        }
        Ok(Some(path))
    }

    /// Make `names`' missing directories; true when the last was made.
    fn make(&self, names: &[String]) -> Result<bool, DirError> {
        let mut path = String::new();
        let mut made = false;
        for (i, name) in names.iter().enumerate() {
            path.push('/');
            path.push_str(name);
            let mode = if i + 1 == names.len() { VOLUME_MODE } else { PARENT_MODE };
            match self.lstat(&path)? {
                Some(st) if is_dir(&st) => {
                    made = false;
                    continue;
                }
                Some(st) => {
                    return Err(DirError::Conflict(format!(
                        "{} is {}: refused, nothing is followed or replaced",
                        self.at(&path),
                        kind(&st)
                    )));
                }
                None => {}
            }
            let p = c(&self.what, &path)?;
            // SAFETY: a live fs and a C string.
            if unsafe { (self.api.mkdir)(self.fs, p.as_ptr(), mode) } != 0 {
                let e = io::Error::last_os_error();
                // Made meanwhile (another replica's retry): a directory is as good.
                if e.raw_os_error() == Some(libc::EEXIST)
                    && self.lstat(&path)?.is_some_and(|st| is_dir(&st))
                {
                    made = false;
                    continue;
                }
                return Err(self.fail_at(&path, "make it", e));
            }
            // The brick applies its own umask: the mode is set as meant.
            // SAFETY: a live fs and a C string.
            if unsafe { (self.api.chmod)(self.fs, p.as_ptr(), mode) } != 0 {
                return Err(self.fail_at(&path, "set its mode", io::Error::last_os_error()));
            }
            made = true;
        }
        Ok(made)
    }

    /// Run `f` as gluster's quota helper, the only client whose quota
    /// attributes the bricks take; the calls after it run as this process.
    fn as_quota_helper<T>(
        &self,
        f: impl FnOnce(&Client) -> Result<T, DirError>,
    ) -> Result<T, DirError> {
        let setfspid = self.api.setfspid.ok_or_else(|| {
            DirError::Library(
                "glfs_setfspid is missing: quotas need libgfapi of GlusterFS 6.1 or later".into(),
            )
        })?;
        // SAFETY: a live fs; the pid applies to this thread's calls.
        unsafe { setfspid(self.fs, QUOTA_HELPER_PID) };
        let answer = f(self);
        // SAFETY: as above, back to this process's own pid.
        unsafe { setfspid(self.fs, nix::unistd::getpid().as_raw()) };
        answer
    }

    /// Attribute `key` of `path`; none when it has none.
    fn xattr(&self, path: &str, key: &str, buf: &mut [u8]) -> Result<Option<usize>, DirError> {
        let (p, k) = (c(&self.what, path)?, c(&self.what, key)?);
        // SAFETY: a live fs, C strings and a buffer of its length.
        let n = unsafe {
            (self.api.lgetxattr)(
                self.fs,
                p.as_ptr(),
                k.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENODATA) => Ok(None),
            _ => Err(self.fail_at(path, "read its quota", e)),
        }
    }

    /// Whether the volume's quota is on: its marker keeps the root's size.
    fn quota_enabled(&self) -> Result<bool, DirError> {
        let mut buf = [0u8; 64];
        Ok(self.as_quota_helper(|c| c.xattr("/", SIZE_KEY, &mut buf))?.is_some())
    }

    /// The hard and soft limits on `path`; none without one.
    fn limit(&self, path: &str) -> Result<Option<(i64, i64)>, DirError> {
        let mut buf = [0u8; 16];
        match self.as_quota_helper(|c| c.xattr(path, LIMIT_KEY, &mut buf))? {
            None => Ok(None),
            Some(16) => {
                let hard = i64::from_be_bytes(buf[..8].try_into().unwrap_or_default());
                let soft = i64::from_be_bytes(buf[8..].try_into().unwrap_or_default());
                // A limit of 0 or less is none (the CLI's remove leaves none).
                Ok((hard > 0).then_some((hard, soft)))
            }
            Some(n) => Err(self.fail_at(
                path,
                "read its quota",
                io::Error::new(io::ErrorKind::InvalidData, format!("{n} bytes, not 16")),
            )),
        }
    }

    fn set_limit(&self, path: &str, hard: u64, soft: i64) -> Result<(), DirError> {
        let hard = i64::try_from(hard).map_err(|_| {
            DirError::Refused(format!("{}: a quota of {hard} bytes is too large", self.at(path)))
        })?;
        let mut value = [0u8; 16];
        value[..8].copy_from_slice(&hard.to_be_bytes());
        value[8..].copy_from_slice(&soft.to_be_bytes());
        let (p, k) = (c(&self.what, path)?, c(&self.what, LIMIT_KEY)?);
        self.as_quota_helper(|c| {
            // SAFETY: a live fs, C strings and a 16-byte value.
            let ret = unsafe {
                (c.api.lsetxattr)(c.fs, p.as_ptr(), k.as_ptr(), value.as_ptr().cast(), 16, 0)
            };
            if ret != 0 {
                return Err(c.fail_at(path, "set its quota", io::Error::last_os_error()));
            }
            Ok(())
        })
    }

    /// The entries of directory `path`: (name, is a directory) each.
    fn entries(&self, path: &str) -> Result<Vec<(String, bool)>, DirError> {
        let p = c(&self.what, path)?;
        // SAFETY: a live fs and a C string; a null answer is a failure.
        let fd = unsafe { (self.api.opendir)(self.fs, p.as_ptr()) };
        if fd.is_null() {
            return Err(self.fail_at(path, "open it", io::Error::last_os_error()));
        }
        let mut out = Vec::new();
        let answer = loop {
            let mut st = zeroed_stat();
            // SAFETY: `dirent` is plain data; all zeroes is a valid value.
            let mut entry: libc::dirent = unsafe { std::mem::zeroed() };
            let mut result: *mut libc::dirent = std::ptr::null_mut();
            // SAFETY: an open dir fd and buffers for one entry.
            let ret = unsafe { (self.api.readdirplus_r)(fd, &mut st, &mut entry, &mut result) };
            if ret != 0 {
                break Err(self.fail_at(path, "list it", io::Error::last_os_error()));
            }
            if result.is_null() {
                break Ok(());
            }
            // SAFETY: d_name is NUL-terminated within the entry.
            let name =
                unsafe { CStr::from_ptr(entry.d_name.as_ptr()) }.to_string_lossy().into_owned();
            if name == "." || name == ".." {
                continue;
            }
            let dir = if st.st_mode != 0 {
                is_dir(&st)
            } else {
                // No attributes came with the entry: look.
                self.lstat(&format!("{path}/{name}"))?.is_some_and(|st| is_dir(&st))
            };
            out.push((name, dir));
        };
        // SAFETY: opened once, closed once.
        unsafe { (self.api.closedir)(fd) };
        answer.map(|()| out)
    }

    /// Remove the directory (`dir`) or other entry at `path`; gone already
    /// is success.
    fn remove_one(&self, path: &str, dir: bool) -> Result<(), DirError> {
        let p = c(&self.what, path)?;
        // SAFETY: a live fs and a C string.
        let ret = unsafe {
            if dir {
                (self.api.rmdir)(self.fs, p.as_ptr())
            } else {
                (self.api.unlink)(self.fs, p.as_ptr())
            }
        };
        let e = io::Error::last_os_error();
        match ret {
            0 => Ok(()),
            _ if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            _ => {
                Err(self.fail_at(path, if dir { "remove a directory" } else { "remove a file" }, e))
            }
        }
    }

    /// Remove directory `root` and everything beneath it, depth first
    /// with a stack of its own (no recursion: a deep tree is the user's).
    fn remove_tree(&self, root: &str) -> Result<(), DirError> {
        let mut stack = vec![root.to_string()];
        while let Some(dir) = stack.last().cloned() {
            let mut subdirs = Vec::new();
            for (name, sub) in self.entries(&dir)? {
                let path = format!("{dir}/{name}");
                if sub {
                    subdirs.push(path);
                } else {
                    self.remove_one(&path, false)?;
                }
            }
            if subdirs.is_empty() {
                self.remove_one(&dir, true)?;
                stack.pop();
            } else {
                stack.extend(subdirs);
            }
        }
        Ok(())
    }
}

/// How long a volume's client is kept without use.
const IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// The controller's [`GlusterDirs`]: libgfapi, one client per volume kept
/// while in use.
#[derive(Default)]
pub struct LibGfapiDirs {
    clients: std::sync::Mutex<Vec<Kept>>,
}

struct Kept {
    volume: GlusterVolume,
    client: std::sync::Arc<Client>,
    used: std::time::Instant,
}

impl LibGfapiDirs {
    pub fn new() -> LibGfapiDirs {
        LibGfapiDirs::default()
    }

    /// `f` with the client of `volume` (connected when there is none). A
    /// client whose call failed on the way to the volume is dropped, so
    /// the next call connects afresh; idle ones are closed off this thread.
    fn with<T>(
        &self,
        volume: &GlusterVolume,
        f: impl FnOnce(&Client) -> Result<T, DirError>,
    ) -> Result<T, DirError> {
        let kept = {
            let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
            let idle: Vec<Kept> = {
                let (idle, busy) = std::mem::take(&mut *clients).into_iter().partition(|k| {
                    k.used.elapsed() > IDLE && std::sync::Arc::strong_count(&k.client) == 1
                });
                *clients = busy;
                idle
            };
            if !idle.is_empty() {
                std::thread::spawn(move || drop(idle));
            }
            clients.iter_mut().find(|k| k.volume == *volume).map(|k| {
                k.used = std::time::Instant::now();
                k.client.clone()
            })
        };
        let client = match kept {
            Some(c) => c,
            None => {
                let c = std::sync::Arc::new(Client::connect(volume)?);
                let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
                clients.push(Kept {
                    volume: volume.clone(),
                    client: c.clone(),
                    used: std::time::Instant::now(),
                });
                c
            }
        };
        let answer = f(&client);
        if matches!(answer, Err(DirError::Gluster { .. })) {
            let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
            clients.retain(|k| !std::sync::Arc::ptr_eq(&k.client, &client));
            drop(clients);
            // Closed off this thread: the step's answer does not wait for it.
            std::thread::spawn(move || drop(client));
        }
        answer
    }
}

impl GlusterDirs for LibGfapiDirs {
    fn create(&self, volume: &GlusterVolume, path: &str, quota: u64) -> Result<bool, DirError> {
        let names = checked(volume, path)?;
        self.with(volume, |client| create(client, volume, &names, path, quota))
    }

    fn remove(&self, volume: &GlusterVolume, path: &str) -> Result<bool, DirError> {
        let names = checked(volume, path)?;
        self.with(volume, |client| remove(client, &names))
    }

    fn raise_quota(
        &self,
        volume: &GlusterVolume,
        path: &str,
        bytes: u64,
    ) -> Result<Option<u64>, DirError> {
        let names = checked(volume, path)?;
        self.with(volume, |client| raise_quota(client, &names, path, bytes))
    }

    fn state(&self, volume: &GlusterVolume, path: &str) -> Result<Option<DirState>, DirError> {
        let names = checked(volume, path)?;
        self.with(volume, |client| state(client, &names))
    }
}

fn create(
    client: &Client,
    volume: &GlusterVolume,
    names: &[String],
    path: &str,
    quota: u64,
) -> Result<bool, DirError> {
    // Checked before anything is made: a refused request changes nothing.
    if quota > 0 && !client.quota_enabled()? {
        return Err(DirError::Unready(format!(
            "{}: its quota is not enabled, so no limit would hold: its admin enables it once (gluster volume quota {} enable), or the class sets quota \"false\"",
            volume.describe(),
            volume.volume
        )));
    }
    let made = client.make(names)?;
    let abs = format!("/{path}");
    match (client.limit(&abs)?, quota) {
        (None, 0) => {}
        // Made, or a create cut short before its limit: limited now.
        (None, _) => client.set_limit(&abs, quota, DEFAULT_SOFT_LIMIT)?,
        (Some((have, _)), _) if have as u64 == quota => {}
        (Some((have, _)), _) => {
            let asked = if quota == 0 { "none".to_string() } else { format!("{quota} bytes") };
            return Err(DirError::Conflict(format!(
                "{} exists with a quota of {have} bytes, not {asked} as asked",
                client.at(&abs)
            )));
        }
    }
    Ok(made)
}

fn remove(client: &Client, names: &[String]) -> Result<bool, DirError> {
    let Some(abs) = client.resolve(names)? else { return Ok(false) };
    match client.lstat(&abs)? {
        None => Ok(false),
        // A link or file where the directory was: removed, not followed.
        Some(st) if !is_dir(&st) => client.remove_one(&abs, false).map(|()| true),
        Some(_) => client.remove_tree(&abs).map(|()| true),
    }
}

fn raise_quota(
    client: &Client,
    names: &[String],
    path: &str,
    bytes: u64,
) -> Result<Option<u64>, DirError> {
    let missing = || DirError::NotFound(format!("{} does not exist", client.at(path)));
    let abs = client.resolve(names)?.ok_or_else(missing)?;
    match client.lstat(&abs)? {
        None => return Err(missing()),
        Some(st) if !is_dir(&st) => {
            return Err(DirError::Conflict(format!(
                "{} is {}: refused, nothing is followed",
                client.at(&abs),
                kind(&st)
            )));
        }
        Some(_) => {}
    }
    match client.limit(&abs)? {
        None => Ok(None),
        Some((have, _)) if have as u64 == bytes => Ok(Some(bytes)),
        Some((have, _)) if have as u64 > bytes => Err(DirError::Refused(format!(
            "{} has a quota of {have} bytes, more than the {bytes} asked for: quotas are never lowered",
            client.at(&abs)
        ))),
        // The soft limit stays what it was, as the CLI keeps it.
        Some((_, soft)) => client.set_limit(&abs, bytes, soft).map(|()| Some(bytes)),
    }
}

fn state(client: &Client, names: &[String]) -> Result<Option<DirState>, DirError> {
    let Some(abs) = client.resolve(names)? else { return Ok(None) };
    let Some(st) = client.lstat(&abs)? else { return Ok(None) };
    if !is_dir(&st) {
        return Err(DirError::Conflict(format!("{} is {}", client.at(&abs), kind(&st))));
    }
    let quota_bytes = if client.api.setfspid.is_some() {
        match client.limit(&abs) {
            Ok(limit) => limit.map(|(hard, _)| hard as u64),
            // Removed between the look (its answer may come from the
            // client's cache) and the read: it is not there.
            Err(DirError::Gluster { source, .. })
                if source.raw_os_error() == Some(libc::ENOENT) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(e),
        }
    } else {
        None
    };
    Ok(Some(DirState { mode: st.st_mode & 0o7777, quota_bytes }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume() -> GlusterVolume {
        GlusterVolume { servers: vec!["g1".into()], volume: "gv0".into() }
    }

    #[test]
    fn servers_are_hosts_with_an_optional_port() {
        assert_eq!(server("g1"), Ok(("g1".into(), 24007)));
        assert_eq!(server("g1.example.com:24008"), Ok(("g1.example.com".into(), 24008)));
        assert_eq!(server("10.0.0.1"), Ok(("10.0.0.1".into(), 24007)));
        assert_eq!(server("[fe80::1]:24009"), Ok(("fe80::1".into(), 24009)));
        assert_eq!(server("[fe80::1]"), Ok(("fe80::1".into(), 24007)));
        for bad in ["", ":24007", "g1:0", "g1:x", "[fe80::1", "g1:70000"] {
            assert!(server(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn paths_stay_beneath_the_volumes_root() {
        assert_eq!(checked(&volume(), "volagent/pvc-1").unwrap(), ["volagent", "pvc-1"]);
        for bad in ["", "/x", "a/../b", "..", "a/./b", "a//b", "a/", "a\0b"] {
            let e = checked(&volume(), bad).unwrap_err().to_string();
            assert!(e.contains("gluster volume gv0") && e.contains("not a directory path"), "{e}");
        }
    }
}
