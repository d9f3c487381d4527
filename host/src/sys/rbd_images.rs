//! RBD images made, grown, snapshotted, cloned and removed through librbd:
//! the controller's provisioning steps, as the controller's Ceph user, over
//! a connection kept per cluster; each step is idempotent, so a retried
//! plan ends where the first would have.
// FFI: every unsafe block calls librbd with the handles and buffers its
// header describes.
#![allow(unsafe_code)]

use super::rbd_export::{CephClient, Pool, Rados, RbdError, cstring, pool_watchers};
use libloading::Library;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::io;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Handle = *mut c_void;

/// Why an image step could not be done.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// What the step needs does not exist (a clone's parent snapshot).
    #[error("{0}")]
    NotFound(String),
    /// The name is taken by something other than what the step would make.
    #[error("{0}")]
    Conflict(String),
    /// Not now: in use (mapped, watched) or holding snapshots; try again later.
    #[error("{0}")]
    Busy(String),
    /// The step cannot be done to this image (shrinking it).
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Ceph(#[from] RbdError),
}

/// What the controller does to RBD images. Blocking: run off the runtime.
pub trait RbdImages: Send + Sync {
    /// Make `pool/image` of `size` bytes; true when made, false when an
    /// image of that size was there (of another size: [`ImageError::Conflict`]).
    fn create(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
        size: u64,
        data_pool: Option<&str>,
        features: u64,
    ) -> Result<bool, ImageError>;
    /// Remove `pool/image`; false when it was not there. Refused while
    /// watched or with snapshots ([`ImageError::Busy`]).
    fn remove(&self, client: &CephClient, pool: &str, image: &str) -> Result<bool, ImageError>;
    /// Grow `pool/image` to `size` (at least that large already: nothing);
    /// its size afterwards.
    fn grow(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
        size: u64,
    ) -> Result<u64, ImageError>;
    /// Snapshot `pool/image` as `snapshot` (there already: nothing); the
    /// image's size, which a restore of it gets.
    fn snapshot(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
        snapshot: &str,
    ) -> Result<u64, ImageError>;
    /// Remove snapshot `pool/image@snapshot` (gone, or its image gone: nothing).
    fn remove_snapshot(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
        snapshot: &str,
    ) -> Result<(), ImageError>;
    /// Clone `pool/parent@snapshot` as `pool/image` (there already:
    /// nothing), flattened when its chain is deeper than `max_depth`; its size.
    #[allow(clippy::too_many_arguments)]
    fn clone_image(
        &self,
        client: &CephClient,
        pool: &str,
        parent: &str,
        snapshot: &str,
        image: &str,
        features: u64,
        max_depth: u32,
    ) -> Result<u64, ImageError>;
    /// The size of `pool/image`, none when it does not exist.
    fn size(&self, client: &CephClient, pool: &str, image: &str)
    -> Result<Option<u64>, ImageError>;
}

/// RBD feature bits by name (librbd's features.h).
pub fn feature_bits(names: &[String]) -> Result<u64, String> {
    let mut bits = 0;
    for name in names {
        bits |= match name.as_str() {
            "layering" => 1 << 0,
            "exclusive-lock" => 1 << 2,
            "object-map" => 1 << 3,
            "fast-diff" => 1 << 4,
            "deep-flatten" => 1 << 5,
            other => return Err(format!("unknown RBD feature {other:?}")),
        };
    }
    // Clones need layering; an image without any feature gets it too.
    Ok(bits | 1)
}

/// librbd's `rbd_linked_image_spec_t`.
#[repr(C)]
struct LinkedImage {
    pool_id: i64,
    pool_name: *mut c_char,
    pool_namespace: *mut c_char,
    image_id: *mut c_char,
    image_name: *mut c_char,
    trash: bool,
}

/// librbd's `rbd_snap_spec_t`.
#[repr(C)]
struct SnapSpec {
    id: u64,
    namespace_type: c_int,
    name: *mut c_char,
}

/// librbd's `rbd_snap_info_t`.
#[repr(C)]
struct SnapInfo {
    id: u64,
    size: u64,
    name: *const c_char,
}

const OPTION_FORMAT: c_int = 0;
const OPTION_FEATURES: c_int = 1;
const OPTION_DATA_POOL: c_int = 10;
const OPTION_CLONE_FORMAT: c_int = 12;

/// The admin functions, resolved once per process.
struct Admin {
    open: unsafe extern "C" fn(Handle, *const c_char, *mut Handle, *const c_char) -> c_int,
    open_by_id: unsafe extern "C" fn(Handle, *const c_char, *mut Handle, *const c_char) -> c_int,
    close: unsafe extern "C" fn(Handle) -> c_int,
    get_size: unsafe extern "C" fn(Handle, *mut u64) -> c_int,
    create4: unsafe extern "C" fn(Handle, *const c_char, u64, Handle) -> c_int,
    clone3: unsafe extern "C" fn(
        Handle,
        *const c_char,
        *const c_char,
        Handle,
        *const c_char,
        Handle,
    ) -> c_int,
    remove: unsafe extern "C" fn(Handle, *const c_char) -> c_int,
    resize: unsafe extern "C" fn(Handle, u64) -> c_int,
    snap_create: unsafe extern "C" fn(Handle, *const c_char) -> c_int,
    snap_remove: unsafe extern "C" fn(Handle, *const c_char) -> c_int,
    snap_exists: unsafe extern "C" fn(Handle, *const c_char, *mut bool) -> c_int,
    snap_list: unsafe extern "C" fn(Handle, *mut SnapInfo, *mut c_int) -> c_int,
    snap_list_end: unsafe extern "C" fn(*mut SnapInfo),
    flatten: unsafe extern "C" fn(Handle) -> c_int,
    get_parent: unsafe extern "C" fn(Handle, *mut LinkedImage, *mut SnapSpec) -> c_int,
    linked_image_cleanup: unsafe extern "C" fn(*mut LinkedImage),
    snap_spec_cleanup: unsafe extern "C" fn(*mut SnapSpec),
    options_create: unsafe extern "C" fn(*mut Handle),
    options_destroy: unsafe extern "C" fn(Handle),
    options_set_string: unsafe extern "C" fn(Handle, c_int, *const c_char) -> c_int,
    options_set_uint64: unsafe extern "C" fn(Handle, c_int, u64) -> c_int,
    _library: Library,
}

static ADMIN: std::sync::OnceLock<Result<Admin, String>> = std::sync::OnceLock::new();

impl Admin {
    fn get() -> Result<&'static Admin, RbdError> {
        ADMIN.get_or_init(Admin::load).as_ref().map_err(|e| RbdError::Library(e.clone()))
    }

    fn load() -> Result<Admin, String> {
        // SAFETY: loading librbd runs its initialisers, which only set up
        // its own state (rbd_export loads it the same way).
        let lib =
            unsafe { Library::new("librbd.so.1") }.map_err(|e| format!("librbd.so.1: {e}"))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the signature is the one librbd.h declares.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{}: {e}", $name))?
            };
        }
        Ok(Admin {
            open: sym!("rbd_open"),
            open_by_id: sym!("rbd_open_by_id"),
            close: sym!("rbd_close"),
            get_size: sym!("rbd_get_size"),
            create4: sym!("rbd_create4"),
            clone3: sym!("rbd_clone3"),
            remove: sym!("rbd_remove"),
            resize: sym!("rbd_resize"),
            snap_create: sym!("rbd_snap_create"),
            snap_remove: sym!("rbd_snap_remove"),
            snap_exists: sym!("rbd_snap_exists"),
            snap_list: sym!("rbd_snap_list"),
            snap_list_end: sym!("rbd_snap_list_end"),
            flatten: sym!("rbd_flatten"),
            get_parent: sym!("rbd_get_parent"),
            linked_image_cleanup: sym!("rbd_linked_image_spec_cleanup"),
            snap_spec_cleanup: sym!("rbd_snap_spec_cleanup"),
            options_create: sym!("rbd_image_options_create"),
            options_destroy: sym!("rbd_image_options_destroy"),
            options_set_string: sym!("rbd_image_options_set_string"),
            options_set_uint64: sym!("rbd_image_options_set_uint64"),
            _library: lib,
        })
    }
}

fn ceph(object: &str, op: &'static str, ret: c_int) -> ImageError {
    ImageError::Ceph(RbdError::Ceph {
        object: object.to_string(),
        op,
        source: io::Error::from_raw_os_error(-ret),
    })
}

/// An open image, closed on drop.
struct Image<'p> {
    admin: &'static Admin,
    handle: Handle,
    name: String,
    _pool: &'p Pool,
}

impl Drop for Image<'_> {
    fn drop(&mut self) {
        // SAFETY: opened once, closed once.
        unsafe { (self.admin.close)(self.handle) };
    }
}

impl Image<'_> {
    fn size(&self) -> Result<u64, ImageError> {
        let mut size = 0u64;
        // SAFETY: open image; `size` receives the value.
        let ret = unsafe { (self.admin.get_size)(self.handle, &mut size) };
        if ret < 0 { Err(ceph(&self.name, "read the image's size", ret)) } else { Ok(size) }
    }

    fn snapshot_count(&self) -> Result<usize, ImageError> {
        let mut max: c_int = 64;
        loop {
            let mut snaps: Vec<SnapInfo> =
                (0..max).map(|_| SnapInfo { id: 0, size: 0, name: std::ptr::null() }).collect();
            let mut n = max;
            // SAFETY: `snaps` has room for `n` entries.
            let ret = unsafe { (self.admin.snap_list)(self.handle, snaps.as_mut_ptr(), &mut n) };
            if ret == -nix::libc::ERANGE && n > max && n <= 65536 {
                max = n;
                continue;
            }
            if ret < 0 {
                return Err(ceph(&self.name, "list the image's snapshots", ret));
            }
            // SAFETY: frees the names librbd filled in.
            unsafe { (self.admin.snap_list_end)(snaps.as_mut_ptr()) };
            return Ok(ret as usize);
        }
    }

    /// The parent image (its id, and whether it is in the trash), if a clone.
    fn parent(&self) -> Result<Option<(String, String)>, ImageError> {
        let mut image = LinkedImage {
            pool_id: 0,
            pool_name: std::ptr::null_mut(),
            pool_namespace: std::ptr::null_mut(),
            image_id: std::ptr::null_mut(),
            image_name: std::ptr::null_mut(),
            trash: false,
        };
        let mut snap = SnapSpec { id: 0, namespace_type: 0, name: std::ptr::null_mut() };
        // SAFETY: open image; both specs are filled by librbd and cleaned below.
        let ret = unsafe { (self.admin.get_parent)(self.handle, &mut image, &mut snap) };
        if ret == -nix::libc::ENOENT {
            return Ok(None);
        }
        if ret < 0 {
            return Err(ceph(&self.name, "read the image's parent", ret));
        }
        let text = |p: *mut c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: a NUL-terminated string librbd filled in.
                unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        let found = (text(image.image_id), text(image.image_name));
        // SAFETY: cleans what get_parent filled, once.
        unsafe {
            (self.admin.linked_image_cleanup)(&mut image);
            (self.admin.snap_spec_cleanup)(&mut snap);
        }
        Ok(Some(found))
    }
}

struct Options {
    admin: &'static Admin,
    handle: Handle,
}

impl Options {
    fn new(admin: &'static Admin) -> Options {
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: `handle` receives a new options object, destroyed on drop.
        unsafe { (admin.options_create)(&mut handle) };
        Options { admin, handle }
    }
    fn number(&self, option: c_int, value: u64) -> Result<(), ImageError> {
        // SAFETY: a live options object.
        let ret = unsafe { (self.admin.options_set_uint64)(self.handle, option, value) };
        if ret < 0 { Err(ceph("image options", "set an image option", ret)) } else { Ok(()) }
    }
    fn text(&self, option: c_int, value: &str) -> Result<(), ImageError> {
        let v = cstring("image options", "an option", value)?;
        // SAFETY: a live options object and a C string.
        let ret = unsafe { (self.admin.options_set_string)(self.handle, option, v.as_ptr()) };
        if ret < 0 { Err(ceph("image options", "set an image option", ret)) } else { Ok(()) }
    }
}

impl Drop for Options {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        unsafe { (self.admin.options_destroy)(self.handle) };
    }
}

/// A connection to one pool, with the admin functions.
struct Session {
    admin: &'static Admin,
    pool: Pool,
    pool_name: String,
}

impl Session {
    fn on(rados: Arc<Rados>, pool: &str) -> Result<Session, ImageError> {
        let admin = Admin::get()?;
        let pool_name = pool.to_string();
        let pool = Rados::pool(&rados, pool)?;
        Ok(Session { admin, pool, pool_name })
    }

    fn describe(&self, image: &str) -> String {
        format!("rbd image {}/{image}", self.pool_name)
    }

    /// Open `image`; none when it does not exist.
    fn open(&self, image: &str) -> Result<Option<Image<'_>>, ImageError> {
        let name = cstring(&self.describe(image), "the image", image)?;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: valid ioctx and C string; no snapshot.
        let ret = unsafe {
            (self.admin.open)(self.pool.ioctx, name.as_ptr(), &mut handle, std::ptr::null())
        };
        if ret == -nix::libc::ENOENT {
            return Ok(None);
        }
        if ret < 0 {
            return Err(ceph(&self.describe(image), "open the image", ret));
        }
        Ok(Some(Image { admin: self.admin, handle, name: self.describe(image), _pool: &self.pool }))
    }

    fn open_by_id(&self, id: &str) -> Result<Image<'_>, ImageError> {
        let what = format!("rbd image id {id} in pool {}", self.pool_name);
        let cid = cstring(&what, "the image id", id)?;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: valid ioctx and C string; no snapshot.
        let ret = unsafe {
            (self.admin.open_by_id)(self.pool.ioctx, cid.as_ptr(), &mut handle, std::ptr::null())
        };
        if ret < 0 {
            return Err(ceph(&what, "open the image", ret));
        }
        Ok(Image { admin: self.admin, handle, name: what, _pool: &self.pool })
    }

    fn existing(&self, image: &str) -> Result<Image<'_>, ImageError> {
        self.open(image)?
            .ok_or_else(|| ImageError::NotFound(format!("{} does not exist", self.describe(image))))
    }

    /// How many parents `image` has above it (its parents may be in the trash).
    fn depth(&self, image: &Image<'_>) -> Result<u32, ImageError> {
        let mut depth = 0;
        let mut parent = image.parent()?;
        while let Some((id, _)) = parent {
            depth += 1;
            if depth > 64 {
                break; // a chain this long is not ours; flattening ends it
            }
            parent = self.open_by_id(&id)?.parent()?;
        }
        Ok(depth)
    }
}

/// The controller's [`RbdImages`]: librbd, over one connection per Ceph
/// cluster and user, kept while it is used (a connection takes longer than
/// most steps) and dropped once idle for [`IDLE`] or after a Ceph error (a
/// connection whose user was blocklisted or whose monitors moved is not
/// used again).
pub struct LibRbdImages {
    kept: Mutex<HashMap<String, Kept>>,
}

/// How long an unused connection is kept.
pub const IDLE: Duration = Duration::from_secs(300);

struct Kept {
    rados: Arc<Rados>,
    used: Instant,
}

impl Default for LibRbdImages {
    fn default() -> Self {
        LibRbdImages { kept: Mutex::new(HashMap::new()) }
    }
}

/// What tells two clients' connections apart: the cluster, the user and
/// the key (a digest: a rotated key is a new connection; the key itself
/// is not kept here).
fn connection_key(client: &CephClient) -> String {
    use sha2::Digest;
    let key = client
        .key
        .as_ref()
        .map(|k| hex::encode(sha2::Sha256::digest(k.expose())))
        .unwrap_or_default();
    format!("{:?}|{:?}|{}|{:?}|{key}", client.conf, client.monitors, client.user, client.keyring)
}

impl LibRbdImages {
    /// Run `step` on a session to `pool`, over the kept connection (made
    /// when there is none); a Ceph error drops the connection.
    fn on<T>(
        &self,
        client: &CephClient,
        pool: &str,
        step: impl FnOnce(&Session) -> Result<T, ImageError>,
    ) -> Result<T, ImageError> {
        let key = connection_key(client);
        let found = {
            let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
            kept.retain(|_, k| k.used.elapsed() < IDLE);
            kept.get_mut(&key).map(|k| {
                k.used = Instant::now();
                k.rados.clone()
            })
        };
        let rados = match found {
            Some(rados) => rados,
            None => {
                // Connected outside the lock: another cluster's steps go on.
                let rados = Arc::new(Rados::connect(
                    client,
                    format!("ceph cluster as client.{}", client.user),
                )?);
                let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
                kept.insert(key.clone(), Kept { rados: rados.clone(), used: Instant::now() });
                rados
            }
        };
        let result = Session::on(rados, pool).and_then(|s| step(&s));
        if let Err(ImageError::Ceph(_)) = &result {
            self.kept.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
        }
        result
    }

    /// How many connections are kept now.
    pub fn connections(&self) -> usize {
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl RbdImages for LibRbdImages {
    fn create(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
        size: u64,
        data_pool: Option<&str>,
        features: u64,
    ) -> Result<bool, ImageError> {
        self.on(client, pool, |s| {
            let what = s.describe(image);
            if let Some(found) = s.open(image)? {
                let have = found.size()?;
                return if have == size {
                    Ok(false)
                } else {
                    Err(ImageError::Conflict(format!(
                        "{what} exists with {have} bytes, not the {size} asked for"
                    )))
                };
            }
            let opts = Options::new(s.admin);
            opts.number(OPTION_FORMAT, 2)?;
            opts.number(OPTION_FEATURES, features)?;
            if let Some(data_pool) = data_pool {
                opts.text(OPTION_DATA_POOL, data_pool)?;
            }
            let name = cstring(&what, "the image", image)?;
            // SAFETY: valid ioctx, C string and options object.
            let ret = unsafe { (s.admin.create4)(s.pool.ioctx, name.as_ptr(), size, opts.handle) };
            if ret == -nix::libc::EEXIST {
                // Made meanwhile (another replica's retry): check it as above.
                return self.create(client, pool, image, size, data_pool, features);
            }
            if ret < 0 {
                return Err(ceph(&what, "create the image", ret));
            }
            Ok(true)
        })
    }

    fn remove(&self, client: &CephClient, pool: &str, image: &str) -> Result<bool, ImageError> {
        self.on(client, pool, |s| {
            let what = s.describe(image);
            let Some(found) = s.open(image)? else { return Ok(false) };
            let snapshots = found.snapshot_count()?;
            drop(found);
            if snapshots > 0 {
                return Err(ImageError::Busy(format!(
                    "{what} has {snapshots} snapshot(s); delete them first"
                )));
            }
            let watchers = pool_watchers(&s.pool, image)?;
            if !watchers.is_empty() {
                let who: Vec<String> =
                    watchers.iter().map(|w| format!("client.{} at {}", w.id, w.address)).collect();
                return Err(ImageError::Busy(format!(
                    "{what} is in use (watched by {}): it is still mapped somewhere",
                    who.join(", ")
                )));
            }
            let name = cstring(&what, "the image", image)?;
            // SAFETY: valid ioctx and C string.
            let ret = unsafe { (s.admin.remove)(s.pool.ioctx, name.as_ptr()) };
            match ret {
                0 => Ok(true),
                r if r == -nix::libc::ENOENT => Ok(false),
                r if r == -nix::libc::EBUSY || r == -nix::libc::ENOTEMPTY => Err(ImageError::Busy(
                    format!("{what} is in use or has clones: {}", io::Error::from_raw_os_error(-r)),
                )),
                r => Err(ceph(&what, "remove the image", r)),
            }
        })
    }

    fn grow(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
        size: u64,
    ) -> Result<u64, ImageError> {
        self.on(client, pool, |s| {
            let found = s.existing(image)?;
            let have = found.size()?;
            if have >= size {
                return Ok(have);
            }
            // SAFETY: open image.
            let ret = unsafe { (s.admin.resize)(found.handle, size) };
            if ret < 0 {
                return Err(ceph(&found.name, "grow the image", ret));
            }
            Ok(size)
        })
    }

    fn snapshot(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
        snapshot: &str,
    ) -> Result<u64, ImageError> {
        self.on(client, pool, |s| {
            let found = s.existing(image)?;
            let snap = cstring(&found.name, "the snapshot", snapshot)?;
            let mut exists = false;
            // SAFETY: open image, C string, `exists` receives the answer.
            let ret = unsafe { (s.admin.snap_exists)(found.handle, snap.as_ptr(), &mut exists) };
            if ret < 0 {
                return Err(ceph(&found.name, "look for the snapshot", ret));
            }
            if !exists {
                // SAFETY: open image and C string.
                let ret = unsafe { (s.admin.snap_create)(found.handle, snap.as_ptr()) };
                if ret < 0 && ret != -nix::libc::EEXIST {
                    return Err(ceph(&found.name, "snapshot the image", ret));
                }
            }
            found.size()
        })
    }

    fn remove_snapshot(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
        snapshot: &str,
    ) -> Result<(), ImageError> {
        self.on(client, pool, |s| {
            let Some(found) = s.open(image)? else { return Ok(()) };
            let snap = cstring(&found.name, "the snapshot", snapshot)?;
            // SAFETY: open image and C string. A snapshot with clones (format
            // 2) goes to the image's trash until they no longer need it.
            let ret = unsafe { (s.admin.snap_remove)(found.handle, snap.as_ptr()) };
            match ret {
                0 => Ok(()),
                r if r == -nix::libc::ENOENT => Ok(()),
                r if r == -nix::libc::EBUSY => Err(ImageError::Busy(format!(
                    "snapshot {}@{snapshot} has clones that need it",
                    found.name
                ))),
                r => Err(ceph(&found.name, "remove the snapshot", r)),
            }
        })
    }

    fn clone_image(
        &self,
        client: &CephClient,
        pool: &str,
        parent: &str,
        snapshot: &str,
        image: &str,
        features: u64,
        max_depth: u32,
    ) -> Result<u64, ImageError> {
        self.on(client, pool, |s| {
            let what = s.describe(image);
            if s.open(image)?.is_none() {
                let source = s.open(parent)?.ok_or_else(|| {
                    ImageError::NotFound(format!("{} does not exist", s.describe(parent)))
                })?;
                let snap = cstring(&source.name, "the snapshot", snapshot)?;
                let mut exists = false;
                // SAFETY: open image, C string, `exists` receives the answer.
                let ret =
                    unsafe { (s.admin.snap_exists)(source.handle, snap.as_ptr(), &mut exists) };
                if ret < 0 {
                    return Err(ceph(&source.name, "look for the snapshot", ret));
                }
                if !exists {
                    return Err(ImageError::NotFound(format!(
                        "snapshot {}@{snapshot} does not exist",
                        s.describe(parent)
                    )));
                }
                drop(source);
                let opts = Options::new(s.admin);
                opts.number(OPTION_FEATURES, features)?;
                // Format 2: the parent's snapshot needs no protection, and can be
                // removed while the clone still needs it (it waits in the trash).
                opts.number(OPTION_CLONE_FORMAT, 2)?;
                let (p, c) =
                    (cstring(&what, "the parent", parent)?, cstring(&what, "the image", image)?);
                // SAFETY: valid ioctxs, C strings and options object.
                let ret = unsafe {
                    (s.admin.clone3)(
                        s.pool.ioctx,
                        p.as_ptr(),
                        snap.as_ptr(),
                        s.pool.ioctx,
                        c.as_ptr(),
                        opts.handle,
                    )
                };
                if ret < 0 && ret != -nix::libc::EEXIST {
                    return Err(ceph(&what, "clone the image", ret));
                }
            }
            let clone = s.existing(image)?;
            if s.depth(&clone)? > max_depth {
                // SAFETY: open image. Copies the parent's data in: the clone
                // no longer depends on it.
                let ret = unsafe { (s.admin.flatten)(clone.handle) };
                if ret < 0 {
                    return Err(ceph(&what, "flatten the clone", ret));
                }
            }
            clone.size()
        })
    }

    fn size(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
    ) -> Result<Option<u64>, ImageError> {
        self.on(client, pool, |s| s.open(image)?.map(|i| i.size()).transpose())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_are_librbds_bits_with_layering_always() {
        assert_eq!(feature_bits(&[]), Ok(1));
        let names = ["exclusive-lock", "object-map", "fast-diff", "deep-flatten"];
        assert_eq!(feature_bits(&names.map(String::from)), Ok(0b111101));
        assert!(feature_bits(&["journaling".into()]).unwrap_err().contains("journaling"));
    }
}
