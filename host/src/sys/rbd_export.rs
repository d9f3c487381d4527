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
use libloading::Library;
use std::ffi::{CString, c_char, c_int, c_void};
use std::io;
use std::path::PathBuf;

type Handle = *mut c_void;

/// Where the image is and how to reach it.
#[derive(Debug, Clone)]
pub struct RbdTarget {
    /// A ceph.conf naming the monitors.
    pub conf: Option<PathBuf>,
    /// Monitor addresses, when there is no conf file ("host:port,…").
    pub monitors: Option<String>,
    /// The Ceph user, without "client.".
    pub user: String,
    /// A keyring file with the user's key (read at connect, then unused).
    pub keyring: Option<PathBuf>,
    pub pool: String,
    pub image: String,
}

#[derive(Debug, thiserror::Error)]
pub enum RbdError {
    #[error("librbd/librados cannot be loaded ({0}): install Ceph's client libraries (Debian: librbd1)")]
    Library(String),
    #[error("rbd image {pool}/{image}: {op}: {source}")]
    Ceph { pool: String, image: String, op: &'static str, source: io::Error },
    #[error("rbd image {pool}/{image}: {what}")]
    Invalid { pool: String, image: String, what: String },
}

/// The C functions, resolved once.
struct Api {
    rados_create: unsafe extern "C" fn(*mut Handle, *const c_char) -> c_int,
    rados_conf_read_file: unsafe extern "C" fn(Handle, *const c_char) -> c_int,
    rados_conf_set: unsafe extern "C" fn(Handle, *const c_char, *const c_char) -> c_int,
    rados_connect: unsafe extern "C" fn(Handle) -> c_int,
    rados_shutdown: unsafe extern "C" fn(Handle),
    rados_ioctx_create: unsafe extern "C" fn(Handle, *const c_char, *mut Handle) -> c_int,
    rados_ioctx_destroy: unsafe extern "C" fn(Handle),
    rbd_open: unsafe extern "C" fn(Handle, *const c_char, *mut Handle, *const c_char) -> c_int,
    rbd_open_read_only: unsafe extern "C" fn(Handle, *const c_char, *mut Handle, *const c_char) -> c_int,
    rbd_close: unsafe extern "C" fn(Handle) -> c_int,
    rbd_get_size: unsafe extern "C" fn(Handle, *mut u64) -> c_int,
    rbd_read2: unsafe extern "C" fn(Handle, u64, usize, *mut c_char, c_int) -> isize,
    rbd_write2: unsafe extern "C" fn(Handle, u64, usize, *const c_char, c_int) -> isize,
    rbd_flush: unsafe extern "C" fn(Handle) -> c_int,
    rbd_discard: unsafe extern "C" fn(Handle, u64, u64) -> c_int,
    rbd_write_zeroes: unsafe extern "C" fn(Handle, u64, usize, c_int, c_int) -> isize,
    /// Keeps the functions above valid.
    _libraries: (Library, Library),
}

impl Api {
    fn load() -> Result<Api, RbdError> {
        let lib = |name: &str| {
            // SAFETY: loading Ceph's client libraries runs their
            // initialisers, which only set up their own state.
            unsafe { Library::new(name) }.map_err(|e| RbdError::Library(format!("{name}: {e}")))
        };
        let (rados, rbd) = (lib("librados.so.2")?, lib("librbd.so.1")?);
        macro_rules! sym {
            ($lib:expr, $name:literal) => {
                // SAFETY: the signature is the one librbd.h / librados.h declare.
                *unsafe { $lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| RbdError::Library(format!("{}: {e}", $name)))?
            };
        }
        Ok(Api {
            rados_create: sym!(rados, "rados_create"),
            rados_conf_read_file: sym!(rados, "rados_conf_read_file"),
            rados_conf_set: sym!(rados, "rados_conf_set"),
            rados_connect: sym!(rados, "rados_connect"),
            rados_shutdown: sym!(rados, "rados_shutdown"),
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
            _libraries: (rados, rbd),
        })
    }
}

/// A negative errno from Ceph as an error.
fn check(ret: i64) -> io::Result<u64> {
    if ret < 0 { Err(io::Error::from_raw_os_error(i32::try_from(-ret).unwrap_or(nix::libc::EIO))) } else { Ok(ret as u64) }
}

/// An open image: a cluster connection, an I/O context and the image.
pub struct RbdExport {
    api: Api,
    cluster: Handle,
    ioctx: Handle,
    image: Handle,
    size: u64,
    read_only: bool,
    name: String,
}

// SAFETY: librbd image handles are safe to use from several threads at
// once (librbd serialises what must be serialised); the handles are only
// closed in Drop, with no other user left.
unsafe impl Send for RbdExport {}
// SAFETY: as above.
unsafe impl Sync for RbdExport {}

fn cstring(what: &str, value: &str, target: &RbdTarget) -> Result<CString, RbdError> {
    CString::new(value).map_err(|_| RbdError::Invalid {
        pool: target.pool.clone(),
        image: target.image.clone(),
        what: format!("{what} contains a NUL byte"),
    })
}

impl RbdExport {
    /// Connect to the cluster and open the image (read-only: without the
    /// exclusive lock, so other readers may too).
    pub fn open(target: &RbdTarget, read_only: bool) -> Result<RbdExport, RbdError> {
        let api = Api::load()?;
        let fail = |op: &'static str, ret: c_int| RbdError::Ceph {
            pool: target.pool.clone(),
            image: target.image.clone(),
            op,
            source: io::Error::from_raw_os_error(-ret),
        };
        let user = cstring("the user", &target.user, target)?;
        let mut cluster: Handle = std::ptr::null_mut();
        // SAFETY: `cluster` receives a handle; `user` is a valid C string.
        let ret = unsafe { (api.rados_create)(&mut cluster, user.as_ptr()) };
        if ret < 0 {
            return Err(fail("create a cluster handle", ret));
        }
        // From here on the handles are released by Drop (or below).
        let mut export = RbdExport {
            api,
            cluster,
            ioctx: std::ptr::null_mut(),
            image: std::ptr::null_mut(),
            size: 0,
            read_only,
            name: format!("{}/{}", target.pool, target.image),
        };
        let set = |export: &RbdExport, option: &str, value: &str| -> Result<(), RbdError> {
            let (o, v) = (cstring(option, option, target)?, cstring(option, value, target)?);
            // SAFETY: valid handle and C strings.
            let ret = unsafe { (export.api.rados_conf_set)(export.cluster, o.as_ptr(), v.as_ptr()) };
            if ret < 0 { Err(fail("set a client option", ret)) } else { Ok(()) }
        };
        if let Some(conf) = &target.conf {
            let path = cstring("the conf path", &conf.to_string_lossy(), target)?;
            // SAFETY: valid handle and C string.
            let ret = unsafe { (export.api.rados_conf_read_file)(export.cluster, path.as_ptr()) };
            if ret < 0 {
                return Err(fail("read the ceph.conf", ret));
            }
        }
        if let Some(monitors) = &target.monitors {
            set(&export, "mon_host", monitors)?;
        }
        if let Some(keyring) = &target.keyring {
            set(&export, "keyring", &keyring.to_string_lossy())?;
        }
        // Requests to a cluster that does not answer fail instead of hanging.
        set(&export, "client_mount_timeout", "30")?;
        set(&export, "rados_mon_op_timeout", "30")?;
        set(&export, "rados_osd_op_timeout", "60")?;
        // SAFETY: a configured cluster handle.
        let ret = unsafe { (export.api.rados_connect)(export.cluster) };
        if ret < 0 {
            return Err(fail("connect to the cluster", ret));
        }
        let pool = cstring("the pool", &target.pool, target)?;
        // SAFETY: connected handle; `ioctx` receives a handle.
        let ret = unsafe { (export.api.rados_ioctx_create)(export.cluster, pool.as_ptr(), &mut export.ioctx) };
        if ret < 0 {
            return Err(fail("open the pool", ret));
        }
        let image = cstring("the image", &target.image, target)?;
        let open = if read_only { export.api.rbd_open_read_only } else { export.api.rbd_open };
        // SAFETY: valid ioctx and C string; no snapshot (NULL).
        let ret = unsafe { open(export.ioctx, image.as_ptr(), &mut export.image, std::ptr::null()) };
        if ret < 0 {
            return Err(fail("open the image", ret));
        }
        let mut size = 0u64;
        // SAFETY: open image.
        let ret = unsafe { (export.api.rbd_get_size)(export.image, &mut size) };
        if ret < 0 {
            return Err(fail("read the image's size", ret));
        }
        export.size = size;
        Ok(export)
    }
}

impl Drop for RbdExport {
    fn drop(&mut self) {
        // SAFETY: each handle is released once, in reverse order of opening.
        unsafe {
            if !self.image.is_null() {
                (self.api.rbd_close)(self.image);
            }
            if !self.ioctx.is_null() {
                (self.api.rados_ioctx_destroy)(self.ioctx);
            }
            (self.api.rados_shutdown)(self.cluster);
        }
    }
}

impl Export for RbdExport {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn description(&self) -> String {
        format!("rbd {}", self.name)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        // SAFETY: `buf` is valid for `buf.len()` bytes.
        let n = check(unsafe { (self.api.rbd_read2)(self.image, offset, buf.len(), buf.as_mut_ptr().cast(), 0) } as i64)?;
        if n as usize != buf.len() {
            // Within the image (the server checks bounds): a short read is an error.
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        // SAFETY: `buf` is valid for `buf.len()` bytes.
        let n = check(unsafe { (self.api.rbd_write2)(self.image, offset, buf.len(), buf.as_ptr().cast(), 0) } as i64)?;
        if n as usize != buf.len() {
            return Err(io::Error::from(io::ErrorKind::WriteZero));
        }
        if fua { self.flush() } else { Ok(()) }
    }

    fn flush(&self) -> io::Result<()> {
        // SAFETY: open image.
        check(i64::from(unsafe { (self.api.rbd_flush)(self.image) })).map(drop)
    }

    fn trim(&self, offset: u64, length: u64) -> io::Result<()> {
        // SAFETY: open image.
        check(i64::from(unsafe { (self.api.rbd_discard)(self.image, offset, length) })).map(drop)
    }

    fn write_zeroes(&self, offset: u64, length: u64, _punch: bool, _fast: bool) -> io::Result<()> {
        // librbd zeroes by discarding where whole objects are covered.
        let len = usize::try_from(length).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: open image.
        check(unsafe { (self.api.rbd_write_zeroes)(self.image, offset, len, 0, 0) } as i64).map(drop)
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
