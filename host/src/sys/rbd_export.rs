//! An NBD export served from a Ceph RBD image through librbd: the agent's
//! own userspace path to Ceph, behind the same NBD server (and so the same
//! kernel nbd or nbdfuse attach paths) as a local file.
//!
//! librados and librbd are loaded when an image is opened, not linked:
//! the agent runs (and serves every other backend) on nodes without them.
//! The C API used is the stable one of Ceph 14 and later.
// FFI: every unsafe block calls librados/librbd with the handles and
// buffers their headers describe.
#![allow(unsafe_code)]

use crate::nbd::{Export, Extent};
use crate::secret::Secret;
use libloading::Library;
use std::ffi::{CString, c_char, c_int, c_void};
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

type Handle = *mut c_void;

/// How to reach a Ceph cluster, and as whom.
#[derive(Debug, Clone, Default)]
pub struct CephClient {
    /// A ceph.conf naming the monitors.
    pub conf: Option<PathBuf>,
    /// Monitor addresses, when there is no conf file ("host:port,…").
    pub monitors: Option<String>,
    /// The Ceph user, without "client.".
    pub user: String,
    /// A keyring file with the user's key (read at connect, then unused).
    pub keyring: Option<PathBuf>,
    /// The user's key itself, for the agent's own short connections: it
    /// stays in memory and is never written anywhere.
    pub key: Option<Secret>,
}

impl CephClient {
    fn describe(&self) -> String {
        match (&self.monitors, &self.conf) {
            (Some(m), _) => format!("ceph cluster at {m} (as client.{})", self.user),
            (None, Some(c)) => format!("ceph cluster of {} (as client.{})", c.display(), self.user),
            (None, None) => format!("ceph cluster (as client.{})", self.user),
        }
    }
}

/// Where the image is and how to reach it.
#[derive(Debug, Clone)]
pub struct RbdTarget {
    pub client: CephClient,
    pub pool: String,
    pub image: String,
}

impl RbdTarget {
    fn describe(&self) -> String {
        format!("rbd image {}/{}", self.pool, self.image)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RbdError {
    #[error(
        "librbd/librados cannot be loaded ({0}): install Ceph's client libraries (Debian: librbd1)"
    )]
    Library(String),
    #[error("{object}: {op}: {source}")]
    Ceph { object: String, op: &'static str, source: io::Error },
    #[error("{object}: {what}")]
    Invalid { object: String, what: String },
}

/// One client watching an image (`rbd status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageWatcher {
    /// The client's address, as blocklisting takes it ("ip:port/nonce").
    pub address: String,
    /// Its global id: "client.<id>".
    pub id: i64,
}

/// librbd's `rbd_image_watcher_t`.
#[repr(C)]
struct RawWatcher {
    addr: *mut c_char,
    id: i64,
    cookie: u64,
}

/// The C functions, resolved once per process.
struct Api {
    rados_create: unsafe extern "C" fn(*mut Handle, *const c_char) -> c_int,
    rados_conf_read_file: unsafe extern "C" fn(Handle, *const c_char) -> c_int,
    rados_conf_set: unsafe extern "C" fn(Handle, *const c_char, *const c_char) -> c_int,
    rados_connect: unsafe extern "C" fn(Handle) -> c_int,
    rados_shutdown: unsafe extern "C" fn(Handle),
    rados_get_instance_id: unsafe extern "C" fn(Handle) -> u64,
    rados_getaddrs: unsafe extern "C" fn(Handle, *mut *mut c_char) -> c_int,
    rados_mon_command: unsafe extern "C" fn(
        Handle,
        *const *const c_char,
        usize,
        *const c_char,
        usize,
        *mut *mut c_char,
        *mut usize,
        *mut *mut c_char,
        *mut usize,
    ) -> c_int,
    rados_buffer_free: unsafe extern "C" fn(*mut c_char),
    rados_ioctx_create: unsafe extern "C" fn(Handle, *const c_char, *mut Handle) -> c_int,
    rados_ioctx_destroy: unsafe extern "C" fn(Handle),
    rbd_open: unsafe extern "C" fn(Handle, *const c_char, *mut Handle, *const c_char) -> c_int,
    rbd_open_read_only:
        unsafe extern "C" fn(Handle, *const c_char, *mut Handle, *const c_char) -> c_int,
    rbd_close: unsafe extern "C" fn(Handle) -> c_int,
    rbd_get_size: unsafe extern "C" fn(Handle, *mut u64) -> c_int,
    rbd_read2: unsafe extern "C" fn(Handle, u64, usize, *mut c_char, c_int) -> isize,
    rbd_write2: unsafe extern "C" fn(Handle, u64, usize, *const c_char, c_int) -> isize,
    rbd_flush: unsafe extern "C" fn(Handle) -> c_int,
    rbd_discard: unsafe extern "C" fn(Handle, u64, u64) -> c_int,
    rbd_write_zeroes: unsafe extern "C" fn(Handle, u64, usize, c_int, c_int) -> isize,
    rbd_watchers_list: unsafe extern "C" fn(Handle, *mut RawWatcher, *mut usize) -> c_int,
    rbd_watchers_list_cleanup: unsafe extern "C" fn(*mut RawWatcher, usize),
    rbd_lock_get_owners:
        unsafe extern "C" fn(Handle, *mut c_int, *mut *mut c_char, *mut usize) -> c_int,
    rbd_lock_get_owners_cleanup: unsafe extern "C" fn(*mut *mut c_char, usize),
    rbd_lock_break: unsafe extern "C" fn(Handle, c_int, *const c_char) -> c_int,
    /// Keeps the functions above valid; never unloaded (librados keeps
    /// threads and static state that outlive a connection).
    _libraries: (Library, Library),
}

static API: std::sync::OnceLock<Result<Api, String>> = std::sync::OnceLock::new();

/// Whether Ceph's client libraries load on this node.
pub fn libraries_available() -> bool {
    Api::get().is_ok()
}

impl Api {
    fn get() -> Result<&'static Api, RbdError> {
        API.get_or_init(|| Api::load().map_err(|e| e.clone()))
            .as_ref()
            .map_err(|e| RbdError::Library(e.clone()))
    }

    fn load() -> Result<Api, String> {
        let lib = |name: &str| {
            // SAFETY: loading Ceph's client libraries runs their
            // initialisers, which only set up their own state.
            unsafe { Library::new(name) }.map_err(|e| format!("{name}: {e}"))
        };
        let (rados, rbd) = (lib("librados.so.2")?, lib("librbd.so.1")?);
        macro_rules! sym {
            ($lib:expr, $name:literal) => {
                // SAFETY: the signature is the one librbd.h / librados.h declare.
                *unsafe { $lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{}: {e}", $name))?
            };
        }
        Ok(Api {
            rados_create: sym!(rados, "rados_create"),
            rados_conf_read_file: sym!(rados, "rados_conf_read_file"),
            rados_conf_set: sym!(rados, "rados_conf_set"),
            rados_connect: sym!(rados, "rados_connect"),
            rados_shutdown: sym!(rados, "rados_shutdown"),
            rados_get_instance_id: sym!(rados, "rados_get_instance_id"),
            rados_getaddrs: sym!(rados, "rados_getaddrs"),
            rados_mon_command: sym!(rados, "rados_mon_command"),
            rados_buffer_free: sym!(rados, "rados_buffer_free"),
            rados_ioctx_create: sym!(rados, "rados_ioctx_create"),
            rados_ioctx_destroy: sym!(rados, "rados_ioctx_destroy"),
            rbd_open: sym!(rbd, "rbd_open"),
            rbd_open_read_only: sym!(rbd, "rbd_open_read_only"),
            rbd_close: sym!(rbd, "rbd_close"),
            rbd_get_size: sym!(rbd, "rbd_get_size"),
            rbd_read2: sym!(rbd, "rbd_read2"),
            rbd_write2: sym!(rbd, "rbd_write2"),
            rbd_flush: sym!(rbd, "rbd_flush"),
            rbd_discard: sym!(rbd, "rbd_discard"),
            rbd_write_zeroes: sym!(rbd, "rbd_write_zeroes"),
            rbd_watchers_list: sym!(rbd, "rbd_watchers_list"),
            rbd_watchers_list_cleanup: sym!(rbd, "rbd_watchers_list_cleanup"),
            rbd_lock_get_owners: sym!(rbd, "rbd_lock_get_owners"),
            rbd_lock_get_owners_cleanup: sym!(rbd, "rbd_lock_get_owners_cleanup"),
            rbd_lock_break: sym!(rbd, "rbd_lock_break"),
            _libraries: (rados, rbd),
        })
    }
}

/// A negative errno from Ceph as an error.
fn check(ret: i64) -> io::Result<u64> {
    if ret < 0 {
        Err(io::Error::from_raw_os_error(i32::try_from(-ret).unwrap_or(nix::libc::EIO)))
    } else {
        Ok(ret as u64)
    }
}

pub(super) fn cstring(object: &str, what: &str, value: &str) -> Result<CString, RbdError> {
    CString::new(value).map_err(|_| RbdError::Invalid {
        object: object.to_string(),
        what: format!("{what} contains a NUL byte"),
    })
}

/// A connected cluster handle, shut down on drop.
pub(super) struct Rados {
    api: &'static Api,
    pub(super) cluster: Handle,
    /// What errors name.
    pub(super) object: String,
}

impl Rados {
    pub(super) fn fail(&self, op: &'static str, ret: c_int) -> RbdError {
        RbdError::Ceph {
            object: self.object.clone(),
            op,
            source: io::Error::from_raw_os_error(-ret),
        }
    }

    /// Connect to the cluster `client` names; errors name `object`.
    pub(super) fn connect(client: &CephClient, object: String) -> Result<Rados, RbdError> {
        Rados::connect_with(client, object, &[])
    }

    /// [`connect`](Self::connect), with these client `options` set too.
    fn connect_with(
        client: &CephClient,
        object: String,
        options: &[(&str, &str)],
    ) -> Result<Rados, RbdError> {
        let api = Api::get()?;
        let user = cstring(&object, "the user", &client.user)?;
        let mut cluster: Handle = std::ptr::null_mut();
        // SAFETY: `cluster` receives a handle; `user` is a valid C string.
        let ret = unsafe { (api.rados_create)(&mut cluster, user.as_ptr()) };
        if ret < 0 {
            return Err(RbdError::Ceph {
                object,
                op: "create a cluster handle",
                source: io::Error::from_raw_os_error(-ret),
            });
        }
        // From here on the handle is released by Drop.
        let rados = Rados { api, cluster, object };
        if let Some(conf) = &client.conf {
            let path = cstring(&rados.object, "the conf path", &conf.to_string_lossy())?;
            // SAFETY: valid handle and C string.
            let ret = unsafe { (api.rados_conf_read_file)(rados.cluster, path.as_ptr()) };
            if ret < 0 {
                return Err(rados.fail("read the ceph.conf", ret));
            }
        }
        if let Some(monitors) = &client.monitors {
            rados.set("mon_host", monitors)?;
        }
        if let Some(keyring) = &client.keyring {
            rados.set("keyring", &keyring.to_string_lossy())?;
        }
        if let Some(key) = &client.key {
            let key = key
                .ceph_key("key")
                .map_err(|what| RbdError::Invalid { object: rados.object.clone(), what })?;
            rados.set("key", &key)?;
        }
        // Requests to a cluster that does not answer fail instead of hanging.
        rados.set("client_mount_timeout", "30")?;
        rados.set("rados_mon_op_timeout", "30")?;
        rados.set("rados_osd_op_timeout", "60")?;
        // No write-back cache: an image served here has a client (the
        // kernel's nbd, our FUSE client) that outlives this process. A
        // write acknowledged from the cache and lost with a killed process
        // would be gone for good, since the next flush is answered by a
        // successor that never saw it. Without it a write is acknowledged
        // once the cluster has it, as krbd does.
        rados.set("rbd_cache", "false")?;
        for (option, value) in options {
            rados.set(option, value)?;
        }
        // SAFETY: a configured cluster handle.
        let ret = unsafe { (api.rados_connect)(rados.cluster) };
        if ret < 0 {
            return Err(rados.fail("connect to the cluster", ret));
        }
        Ok(rados)
    }

    fn set(&self, option: &str, value: &str) -> Result<(), RbdError> {
        let (o, v) =
            (cstring(&self.object, option, option)?, cstring(&self.object, option, value)?);
        // SAFETY: valid handle and C strings.
        let ret = unsafe { (self.api.rados_conf_set)(self.cluster, o.as_ptr(), v.as_ptr()) };
        if ret < 0 { Err(self.fail("set a client option", ret)) } else { Ok(()) }
    }

    /// This client's global id and address, as watchers and the
    /// blocklist name it.
    fn identity(&self) -> (u64, String) {
        // SAFETY: connected handle.
        let id = unsafe { (self.api.rados_get_instance_id)(self.cluster) };
        let mut addrs: *mut c_char = std::ptr::null_mut();
        // SAFETY: connected handle; `addrs` receives a buffer we free below.
        let address = if unsafe { (self.api.rados_getaddrs)(self.cluster, &mut addrs) } >= 0
            && !addrs.is_null()
        {
            // SAFETY: a NUL-terminated string from librados, freed once.
            let text = unsafe { std::ffi::CStr::from_ptr(addrs) }.to_string_lossy().into_owned();
            // SAFETY: allocated by librados for the caller.
            unsafe { (self.api.rados_buffer_free)(addrs) };
            text
        } else {
            String::new()
        };
        (id, address)
    }

    /// Run a monitor command (JSON); its output text, or its error with
    /// what the monitor said.
    fn mon_command(&self, command: &str) -> Result<String, RbdError> {
        let cmd = cstring(&self.object, "the command", command)?;
        let cmds = [cmd.as_ptr()];
        let (mut out, mut out_len, mut status, mut status_len) =
            (std::ptr::null_mut(), 0usize, std::ptr::null_mut(), 0usize);
        // SAFETY: one valid C string; the out buffers are allocated by
        // librados and freed below.
        let ret = unsafe {
            (self.api.rados_mon_command)(
                self.cluster,
                cmds.as_ptr(),
                1,
                std::ptr::null(),
                0,
                &mut out,
                &mut out_len,
                &mut status,
                &mut status_len,
            )
        };
        let take = |buf: *mut c_char, len: usize| {
            if buf.is_null() {
                return String::new();
            }
            // SAFETY: librados allocated `len` bytes at `buf` for us.
            let text = String::from_utf8_lossy(unsafe {
                std::slice::from_raw_parts(buf.cast::<u8>(), len)
            })
            .into_owned();
            // SAFETY: as above; freed once.
            unsafe { (self.api.rados_buffer_free)(buf) };
            text
        };
        let (out, status) = (take(out, out_len), take(status, status_len));
        if ret < 0 {
            return Err(RbdError::Invalid {
                object: self.object.clone(),
                what: format!(
                    "monitor command failed: {} ({})",
                    io::Error::from_raw_os_error(-ret),
                    status.trim()
                ),
            });
        }
        Ok(if out.is_empty() { status } else { out })
    }

    /// An I/O context on `pool`, owning this connection.
    pub(super) fn into_pool(self, pool: &str) -> Result<Pool, RbdError> {
        Rados::pool(&Arc::new(self), pool)
    }

    /// An I/O context on `pool`, on a connection others may share.
    pub(super) fn pool(rados: &Arc<Rados>, pool: &str) -> Result<Pool, RbdError> {
        let name = cstring(&rados.object, "the pool", pool)?;
        let mut ioctx: Handle = std::ptr::null_mut();
        // SAFETY: connected handle; `ioctx` receives a handle.
        let ret =
            unsafe { (rados.api.rados_ioctx_create)(rados.cluster, name.as_ptr(), &mut ioctx) };
        if ret < 0 {
            return Err(RbdError::Ceph {
                object: format!("{} (pool {pool})", rados.object),
                op: "open the pool",
                source: io::Error::from_raw_os_error(-ret),
            });
        }
        Ok(Pool { ioctx, rados: rados.clone() })
    }
}

// SAFETY: a librados cluster handle may be used from several threads at
// once (librados is thread-safe); the controller shares one per cluster.
unsafe impl Send for Rados {}
// SAFETY: as above.
unsafe impl Sync for Rados {}

impl Drop for Rados {
    fn drop(&mut self) {
        // SAFETY: released once, after every ioctx and image of it.
        unsafe { (self.api.rados_shutdown)(self.cluster) };
    }
}

/// An I/O context and the connection it is on (released after it, when
/// nothing else holds it).
pub(super) struct Pool {
    pub(super) ioctx: Handle,
    pub(super) rados: Arc<Rados>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: released once, after every image opened in it and
        // before its cluster handle (the next field to drop).
        unsafe { (self.rados.api.rados_ioctx_destroy)(self.ioctx) };
    }
}

impl Pool {
    /// Open `image`; read-only opens take no lock and register no watch.
    pub(super) fn open(&self, image: &str, read_only: bool) -> Result<Handle, RbdError> {
        let api = self.rados.api;
        let name = cstring(&self.rados.object, "the image", image)?;
        let open = if read_only { api.rbd_open_read_only } else { api.rbd_open };
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: valid ioctx and C string; no snapshot (NULL).
        let ret = unsafe { open(self.ioctx, name.as_ptr(), &mut handle, std::ptr::null()) };
        if ret < 0 {
            return Err(self.rados.fail("open the image", ret));
        }
        Ok(handle)
    }
}

/// The clients watching `target`'s image (each client with the image open
/// for writing has one), read without becoming one.
pub fn watchers(target: &RbdTarget) -> Result<Vec<ImageWatcher>, RbdError> {
    let pool = Rados::connect(&target.client, target.describe())?.into_pool(&target.pool)?;
    pool_watchers(&pool, &target.image)
}

/// The clients watching `image` in `pool`.
pub(super) fn pool_watchers(pool: &Pool, image: &str) -> Result<Vec<ImageWatcher>, RbdError> {
    let image = pool.open(image, true)?;
    let (rados, api) = (&pool.rados, pool.rados.api);
    let mut capacity = 16usize;
    let listed = loop {
        let mut raw: Vec<RawWatcher> = (0..capacity)
            .map(|_| RawWatcher { addr: std::ptr::null_mut(), id: 0, cookie: 0 })
            .collect();
        let mut count = capacity;
        // SAFETY: `raw` has room for `count` entries.
        let ret = unsafe { (api.rbd_watchers_list)(image, raw.as_mut_ptr(), &mut count) };
        if ret == -nix::libc::ERANGE && count > capacity && count <= 4096 {
            capacity = count;
            continue;
        }
        if ret < 0 {
            break Err(rados.fail("list the image's watchers", ret));
        }
        let list = raw[..count]
            .iter()
            .map(|w| ImageWatcher {
                // SAFETY: librbd filled `count` entries with C strings.
                address: if w.addr.is_null() {
                    String::new()
                } else {
                    unsafe { std::ffi::CStr::from_ptr(w.addr) }.to_string_lossy().into_owned()
                },
                id: w.id,
            })
            .collect();
        // SAFETY: frees what librbd allocated in the first `count` entries.
        unsafe { (api.rbd_watchers_list_cleanup)(raw.as_mut_ptr(), count) };
        break Ok(list);
    };
    // SAFETY: opened above, closed once before its ioctx goes.
    unsafe { (api.rbd_close)(image) };
    listed
}

/// Fence the client at `address` ("ip:port/nonce") out of the cluster:
/// the OSDs refuse its I/O from now on (`ceph osd blocklist add`).
pub fn blocklist(client: &CephClient, address: &str) -> Result<(), RbdError> {
    let rados = Rados::connect(client, client.describe())?;
    let command =
        serde_json::json!({ "prefix": "osd blocklist", "blocklistop": "add", "addr": address })
            .to_string();
    rados.mon_command(&command).map(drop).map_err(|e| match e {
        RbdError::Invalid { object, what } => {
            RbdError::Invalid { object, what: format!("blocklisting client {address}: {what}") }
        }
        e => e,
    })
}

/// librbd's `RBD_LOCK_MODE_EXCLUSIVE`.
const EXCLUSIVE: c_int = 0;

/// The clients holding `image`'s lock (none: unlocked).
fn lock_owners(rados: &Rados, image: Handle) -> Result<Vec<String>, RbdError> {
    let api = rados.api;
    let mut raw: Vec<*mut c_char> = vec![std::ptr::null_mut(); 16];
    let (mut mode, mut count): (c_int, usize) = (EXCLUSIVE, raw.len());
    // SAFETY: `raw` has room for `count` entries.
    let ret = unsafe { (api.rbd_lock_get_owners)(image, &mut mode, raw.as_mut_ptr(), &mut count) };
    if ret == -nix::libc::ENOENT {
        return Ok(Vec::new());
    }
    if ret < 0 {
        return Err(rados.fail("list the image's lock owners", ret));
    }
    // SAFETY: librbd filled `count` entries with C strings.
    let owners: Vec<String> = raw[..count]
        .iter()
        .filter(|p| !p.is_null())
        .map(|p| unsafe { std::ffi::CStr::from_ptr(*p) }.to_string_lossy().into_owned())
        .collect();
    // SAFETY: frees what librbd allocated in the first `count` entries.
    unsafe { (api.rbd_lock_get_owners_cleanup)(raw.as_mut_ptr(), count) };
    Ok(owners)
}

/// Break `image`'s exclusive lock held by `address`; whether it did.
fn break_lock(rados: &Rados, image: Handle, address: &str) -> Result<bool, RbdError> {
    let owner = cstring(&rados.object, "the lock owner", address)?;
    // SAFETY: open image, valid C string.
    let ret = unsafe { (rados.api.rbd_lock_break)(image, EXCLUSIVE, owner.as_ptr()) };
    if ret < 0 && ret != -nix::libc::ENOENT {
        return Err(rados.fail("break the image's lock", ret));
    }
    Ok(ret == 0)
}

/// Open `target`'s image on a connection that breaks a lock without
/// blocklisting its owner (the caller has made sure it writes no more),
/// run `f`, and close it.
fn with_unfenced_image<T>(
    target: &RbdTarget,
    f: impl FnOnce(&Rados, Handle) -> Result<T, RbdError>,
) -> Result<T, RbdError> {
    let unfenced = [("rbd_blocklist_on_break_lock", "false")];
    let pool = Rados::connect_with(&target.client, target.describe(), &unfenced)?
        .into_pool(&target.pool)?;
    let image = pool.open(&target.image, false)?;
    let result = f(&pool.rados, image);
    // SAFETY: opened above, closed once before its ioctx goes.
    unsafe { (pool.rados.api.rbd_close)(image) };
    result
}

/// Break the exclusive lock on `target`'s image if the client at
/// `address` holds it; whether it did. After that client was blocklisted,
/// this is what lets a new writer take the image without fencing anyone
/// itself (librbd and krbd would blocklist a dead owner before breaking
/// its lock, which a node's user may not; so this break does not).
pub fn break_lock_of(target: &RbdTarget, address: &str) -> Result<bool, RbdError> {
    with_unfenced_image(target, |rados, image| {
        if !lock_owners(rados, image)?.iter().any(|o| o == address) {
            return Ok(false);
        }
        break_lock(rados, image, address)
    })
}

/// Take `target`'s image over from `dead`, Ceph clients of this node's
/// helpers whose processes the agent saw end, before a successor opens it:
/// - none of them may be blocklisted: then this node was fenced (the
///   controller gave the volume to another node), and a successor, a new
///   client no one fenced, would be a second writer;
/// - the image's lock, if held, must be held by one of them, and is then
///   broken without blocklisting (a node's user may not; the process is
///   gone, and what it had sent reached the OSDs as its socket closed);
///   held by anyone else, the image is theirs.
pub fn take_over_from(target: &RbdTarget, dead: &[String]) -> Result<Vec<String>, RbdError> {
    with_unfenced_image(target, |rados, image| {
        let listed = rados.mon_command(
            &serde_json::json!({ "prefix": "osd blocklist ls", "format": "json" }).to_string(),
        )?;
        let invalid = |what: String| RbdError::Invalid { object: rados.object.clone(), what };
        // Not known is not "not fenced": an answer that does not parse
        // stops the take-over.
        // The first JSON value: the monitor may put more after it.
        let blocklisted: Vec<String> = serde_json::Deserializer::from_str(&listed)
            .into_iter::<serde_json::Value>()
            .next()
            .and_then(Result::ok)
            .and_then(|v| v.as_array().cloned())
            .ok_or_else(|| invalid(format!("the blocklist came back unreadable: {listed:.200}")))?
            .iter()
            .filter_map(|e| e["addr"].as_str().map(String::from))
            .collect();
        if let Some(fenced) = dead.iter().find(|a| blocklisted.contains(a)) {
            return Err(invalid(format!(
                "the helper's client {fenced} was blocklisted: this node was fenced from the image, and is not to write it again"
            )));
        }
        let mut broken = Vec::new();
        for owner in lock_owners(rados, image)? {
            if !dead.contains(&owner) {
                return Err(invalid(format!(
                    "its lock is held by {owner}, not by a helper of this node that ended: the image is another client's now"
                )));
            }
            if break_lock(rados, image, &owner)? {
                broken.push(owner);
            }
        }
        Ok(broken)
    })
}

/// The [`Storage`](super::Storage) of a real node: librados and librbd.
pub struct LibCeph;

impl super::Storage for LibCeph {
    fn rbd_watchers(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
    ) -> Result<Vec<ImageWatcher>, super::SysError> {
        Ok(watchers(&RbdTarget {
            client: client.clone(),
            pool: pool.to_string(),
            image: image.to_string(),
        })?)
    }

    fn blocklist(&self, client: &CephClient, address: &str) -> Result<(), super::SysError> {
        Ok(blocklist(client, address)?)
    }

    fn break_lock(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
        address: &str,
    ) -> Result<bool, super::SysError> {
        Ok(break_lock_of(
            &RbdTarget { client: client.clone(), pool: pool.to_string(), image: image.to_string() },
            address,
        )?)
    }
}

/// An open image: a cluster connection, an I/O context and the image.
pub struct RbdExport {
    image: Handle,
    /// Released after the image (fields drop after `Drop::drop`).
    pool: Pool,
    /// The size last read: librbd's, which follows a resize made anywhere
    /// (it watches the image's header), so a grown image is served whole.
    size: std::sync::atomic::AtomicU64,
    read_only: bool,
    name: String,
    identity: (u64, String),
}

// SAFETY: librbd image handles are safe to use from several threads at
// once (librbd serialises what must be serialised); the handles are only
// closed in Drop, with no other user left.
unsafe impl Send for RbdExport {}
// SAFETY: as above.
unsafe impl Sync for RbdExport {}

impl RbdExport {
    /// Connect to the cluster and open the image (read-only: without the
    /// exclusive lock, so other readers may too).
    pub fn open(target: &RbdTarget, read_only: bool) -> Result<RbdExport, RbdError> {
        RbdExport::open_with(target, read_only, &[])
    }

    /// [`open`](Self::open) with these client options over the agent's
    /// (`rbd_cache` on, for a benchmark of what turning it off costs).
    pub fn open_with(
        target: &RbdTarget,
        read_only: bool,
        options: &[(&str, &str)],
    ) -> Result<RbdExport, RbdError> {
        let pool = Rados::connect_with(&target.client, target.describe(), options)?
            .into_pool(&target.pool)?;
        let image = pool.open(&target.image, read_only)?;
        let identity = pool.rados.identity();
        let mut export = RbdExport {
            image,
            pool,
            size: Default::default(),
            read_only,
            name: format!("{}/{}", target.pool, target.image),
            identity,
        };
        let mut size = 0u64;
        // SAFETY: open image.
        let ret = unsafe { (export.api().rbd_get_size)(export.image, &mut size) };
        if ret < 0 {
            return Err(export.pool.rados.fail("read the image's size", ret));
        }
        export.size = size.into();
        Ok(export)
    }

    fn api(&self) -> &'static Api {
        self.pool.rados.api
    }

    /// This export's client: its global id and address, as the image's
    /// watchers list names it.
    pub fn client(&self) -> (u64, &str) {
        (self.identity.0, &self.identity.1)
    }
}

impl Drop for RbdExport {
    fn drop(&mut self) {
        // SAFETY: the image is closed once, before its pool and cluster.
        unsafe { (self.api().rbd_close)(self.image) };
    }
}

impl Export for RbdExport {
    fn size(&self) -> u64 {
        use std::sync::atomic::Ordering;
        let mut size = 0u64;
        // SAFETY: open image; librbd reads its cached header (refreshed
        // when another client changed it).
        let ret = unsafe { (self.api().rbd_get_size)(self.image, &mut size) };
        if ret < 0 {
            return self.size.load(Ordering::Relaxed);
        }
        self.size.store(size, Ordering::Relaxed);
        size
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn description(&self) -> String {
        format!("rbd {}", self.name)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        // SAFETY: `buf` is valid for `buf.len()` bytes.
        let n = check(unsafe {
            (self.api().rbd_read2)(self.image, offset, buf.len(), buf.as_mut_ptr().cast(), 0)
        } as i64)?;
        if n as usize != buf.len() {
            // Within the image (the server checks bounds): a short read is an error.
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        // SAFETY: `buf` is valid for `buf.len()` bytes.
        let n = check(unsafe {
            (self.api().rbd_write2)(self.image, offset, buf.len(), buf.as_ptr().cast(), 0)
        } as i64)?;
        if n as usize != buf.len() {
            return Err(io::Error::from(io::ErrorKind::WriteZero));
        }
        if fua { self.flush() } else { Ok(()) }
    }

    fn flush(&self) -> io::Result<()> {
        // SAFETY: open image.
        check(i64::from(unsafe { (self.api().rbd_flush)(self.image) })).map(drop)
    }

    fn trim(&self, offset: u64, length: u64) -> io::Result<()> {
        // SAFETY: open image.
        check(i64::from(unsafe { (self.api().rbd_discard)(self.image, offset, length) })).map(drop)
    }

    fn write_zeroes(&self, offset: u64, length: u64, _punch: bool, _fast: bool) -> io::Result<()> {
        // librbd zeroes by discarding where whole objects are covered.
        let len =
            usize::try_from(length).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: open image.
        check(unsafe { (self.api().rbd_write_zeroes)(self.image, offset, len, 0, 0) } as i64)
            .map(drop)
    }

    fn extents(&self, _offset: u64, length: u32, _max: usize) -> io::Result<Vec<Extent>> {
        Ok(vec![Extent { length, hole: false }])
    }
}

/// "pool/image" as its parts.
pub fn parse_image(spec: &str) -> Option<(&str, &str)> {
    let (pool, image) = spec.split_once('/')?;
    let ok = |s: &str| !s.is_empty() && !s.contains(['/', '@', '\0']);
    (ok(pool) && ok(image)).then_some((pool, image))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_pool_slash_name() {
        assert_eq!(parse_image("rbd/img1"), Some(("rbd", "img1")));
        for bad in ["rbd", "/img", "rbd/", "rbd/a/b", "rbd/img@snap"] {
            assert_eq!(parse_image(bad), None, "{bad}");
        }
    }
}
