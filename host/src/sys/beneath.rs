//! Paths resolved beneath trusted roots. The agent acts only inside dirs an
//! admin gave it (kubelet's root, the discovery dirs, its state dir), but
//! what lies inside them can be written by pods (a directory volume's
//! contents) and swapped at any time. So every path is opened from a handle
//! of its root with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`, and the
//! syscall that acts then uses the handle: a symlink planted or swapped after
//! a check cannot redirect it.

use super::{SysError, errno};
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
use nix::sys::stat::Mode;
use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// One trusted root: its resolved path. A handle on it is opened afresh
/// for each action: one kept from start-up would still name the dir under
/// whatever is mounted on the root later (kubelet bind-mounts its root dir
/// onto itself when it starts), so mounts made through it would be hidden
/// from every path lookup, kubelet's included.
#[derive(Debug)]
struct Root {
    path: PathBuf,
}

impl Root {
    /// A handle on the root as the mount table shows it now. The path was
    /// resolved at start-up, so it has no symlink; one planted since is refused.
    fn dir(&self) -> Result<OwnedFd, SysError> {
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        openat2(nix::fcntl::AT_FDCWD, &self.path, how).map_err(errno("open root dir", &self.path))
    }

    /// Open `rel` (a clean relative path: no `.`, `..` or empty part) below
    /// the root in one `openat2` of the whole path. With no symlink followed
    /// anywhere on it and no `..` in it, the walk cannot leave the root: the
    /// same guarantee as opening `rel` beneath a handle on the root, in one
    /// syscall instead of three.
    fn open(&self, rel: &Path, flags: OFlag) -> nix::Result<OwnedFd> {
        let how = OpenHow::new()
            .flags(flags | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        openat2(nix::fcntl::AT_FDCWD, &self.path.join(rel), how)
    }

    /// [`open`](Self::open) of an `O_PATH` handle from the kernel's caches
    /// alone (`RESOLVE_CACHED`): `EAGAIN` when a part of the path is not in
    /// the dentry cache or would need revalidating (a FUSE or network
    /// filesystem's entry past its timeout), so the walk never waits on a
    /// filesystem.
    fn handle_cached(&self, rel: &Path) -> rustix::io::Result<OwnedFd> {
        use rustix::fs::{Mode, OFlags, ResolveFlags};
        let resolve =
            ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS | ResolveFlags::CACHED;
        rustix::fs::openat2(
            rustix::fs::CWD,
            self.path.join(rel),
            OFlags::PATH | OFlags::CLOEXEC,
            Mode::empty(),
            resolve,
        )
    }
}

/// The roots the agent may act in. Cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub struct Roots {
    roots: Vec<Root>,
}

/// RESOLVE_NO_SYMLINKS refuses a symlink anywhere, the last component
/// included (ELOOP) — unless O_NOFOLLOW is set with O_PATH, which returns a
/// handle on the symlink itself: so no O_NOFOLLOW.
fn how(flags: OFlag) -> OpenHow {
    OpenHow::new().flags(flags | OFlag::O_CLOEXEC).resolve(
        ResolveFlag::RESOLVE_BENEATH
            | ResolveFlag::RESOLVE_NO_SYMLINKS
            | ResolveFlag::RESOLVE_NO_MAGICLINKS,
    )
}

impl Roots {
    /// Open each of `paths` (an admin's configuration: symlinks in them are
    /// followed, once, here). A root that does not exist is created.
    pub fn open(paths: &[PathBuf]) -> Result<Roots, SysError> {
        let mut roots = Vec::new();
        for p in paths {
            let root = Root { path: resolve(p)? };
            root.dir()?;
            roots.push(root);
        }
        // Longest first, so a root inside another is found first.
        roots.sort_by_key(|r| std::cmp::Reverse(r.path.as_os_str().len()));
        Ok(Roots { roots })
    }

    /// The resolved paths of the roots.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.roots.iter().map(|r| r.path.as_path())
    }

    /// The root `path` lies strictly below and the rest of it, which must be
    /// plain names (no `.`, `..` or empty parts). A root itself is never the
    /// object of an action.
    fn locate<'p>(&self, path: &'p Path) -> Result<(&Root, &'p Path), SysError> {
        for root in &self.roots {
            if let Ok(rel) = path.strip_prefix(&root.path)
                && !rel.as_os_str().is_empty()
            {
                // By bytes: `components()` would quietly drop a "." or an
                // empty part, which are not a clean path's.
                let clean = rel
                    .as_os_str()
                    .as_encoded_bytes()
                    .split(|b| *b == b'/')
                    .all(|c| !matches!(c, b"" | b"." | b".."));
                if !clean || path.as_os_str().as_encoded_bytes().contains(&0) {
                    return Err(refused(path, "is not a clean path"));
                }
                return Ok((root, rel));
            }
        }
        if self.roots.iter().any(|r| r.path == path) {
            return Err(refused(
                path,
                "is one of the agent's roots, which is never acted on itself",
            ));
        }
        let roots: Vec<String> = self.paths().map(|p| p.display().to_string()).collect();
        Err(refused(
            path,
            &format!("is outside the dirs this agent acts in ({})", roots.join(", ")),
        ))
    }

    /// Whether `path` lies strictly below one of the roots.
    pub fn contains(&self, path: &Path) -> bool {
        self.locate(path).is_ok()
    }

    /// Open `path` beneath its root with `flags` (`O_CLOEXEC` added),
    /// following no symlink on the way or at its end.
    pub fn open_at(&self, path: &Path, flags: OFlag) -> Result<OwnedFd, SysError> {
        let (root, rel) = self.locate(path)?;
        root.open(rel, flags).map_err(|e| resolve_error(path, e))
    }

    /// An `O_PATH` handle on `path` (no open of the object itself: FIFOs,
    /// devices and files on a FUSE mount are not opened by it).
    pub fn handle(&self, path: &Path) -> Result<OwnedFd, SysError> {
        self.open_at(path, OFlag::O_PATH)
    }

    /// [`handle`](Self::handle) when the kernel can give it without asking
    /// the filesystem; none when it would have to (or cannot tell: a
    /// kernel older than 5.12), and the caller must go the slow way.
    pub fn handle_cached(&self, path: &Path) -> Result<Option<OwnedFd>, SysError> {
        let (root, rel) = self.locate(path)?;
        match root.handle_cached(rel) {
            Ok(fd) => Ok(Some(fd)),
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INVAL) => Ok(None),
            Err(e) => Err(resolve_error(path, nix::errno::Errno::from_raw(e.raw_os_error()))),
        }
    }

    /// A handle on the dir holding `path`, and `path`'s last component.
    pub fn parent(&self, path: &Path) -> Result<(OwnedFd, PathBuf), SysError> {
        let (root, rel) = self.locate(path)?;
        let name = rel.file_name().ok_or_else(|| refused(path, "has no last component"))?;
        let parent = rel.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let dir = match parent.as_os_str() == "." {
            true => root.dir()?,
            false => root
                .open(parent, OFlag::O_PATH | OFlag::O_DIRECTORY)
                .map_err(|e| resolve_error(path, e))?,
        };
        Ok((dir, PathBuf::from(name)))
    }

    /// Create `dir` and its missing parents beneath its root, one component
    /// at a time from a handle on the one before; true when `dir` was made.
    pub fn mkdir_all(&self, dir: &Path) -> Result<bool, SysError> {
        let (root, rel) = self.locate(dir)?;
        // Most often it is there already: one open says so.
        match root.open(rel, OFlag::O_PATH | OFlag::O_DIRECTORY) {
            Ok(_) => return Ok(false),
            Err(nix::errno::Errno::ENOENT) => {}
            Err(e) => return Err(resolve_error(dir, e)),
        }
        // Next most often only the last one is missing (a pod's target).
        if let (Some(parent), Some(name)) =
            (rel.parent().filter(|p| !p.as_os_str().is_empty()), rel.file_name())
        {
            match root.open(parent, OFlag::O_PATH | OFlag::O_DIRECTORY) {
                Ok(at) => {
                    match nix::sys::stat::mkdirat(at.as_fd(), name, Mode::from_bits_truncate(0o750))
                    {
                        Ok(()) => return Ok(true),
                        // Made meanwhile: the walk below checks what it is.
                        Err(nix::errno::Errno::EEXIST) => {}
                        Err(e) => return Err(errno("create dir", dir)(e)),
                    }
                }
                Err(nix::errno::Errno::ENOENT) => {}
                Err(e) => return Err(resolve_error(dir, e)),
            }
        }
        let mut at = root.dir()?;
        let mut made = false;
        for name in rel {
            made = match nix::sys::stat::mkdirat(at.as_fd(), name, Mode::from_bits_truncate(0o750))
            {
                Ok(()) => true,
                Err(nix::errno::Errno::EEXIST) => false,
                Err(e) => return Err(errno("create dir", dir)(e)),
            };
            at = openat2(at.as_fd(), name, how(OFlag::O_PATH | OFlag::O_DIRECTORY))
                .map_err(|e| resolve_error(dir, e))?;
        }
        Ok(made)
    }

    /// Create the empty regular file `file` (its dir must exist); true when
    /// it was made, false when a regular file is there already.
    pub fn make_file(&self, file: &Path) -> Result<bool, SysError> {
        let (parent, name) = self.parent(file)?;
        let flags =
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        match nix::fcntl::openat(
            parent.as_fd(),
            name.as_path(),
            flags,
            Mode::from_bits_truncate(0o600),
        ) {
            Ok(_) => Ok(true),
            Err(nix::errno::Errno::EEXIST) => {
                let st = nix::sys::stat::fstatat(
                    parent.as_fd(),
                    name.as_path(),
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(errno("inspect", file))?;
                if nix::sys::stat::SFlag::from_bits_truncate(st.st_mode)
                    & nix::sys::stat::SFlag::S_IFMT
                    == nix::sys::stat::SFlag::S_IFREG
                {
                    Ok(false)
                } else {
                    Err(refused(file, "is there and is not a regular file"))
                }
            }
            Err(e) => Err(errno("create file", file)(e)),
        }
    }

    /// Remove `file` if it is an empty regular file (a block publication's
    /// mount point); one already gone is fine, anything else stays.
    pub fn remove_empty_file(&self, file: &Path) -> Result<(), SysError> {
        let (parent, name) = match self.parent(file) {
            Ok(p) => p,
            Err(SysError::Errno { errno: nix::errno::Errno::ENOENT, .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let st = match nix::sys::stat::fstatat(
            parent.as_fd(),
            name.as_path(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        ) {
            Ok(st) => st,
            Err(nix::errno::Errno::ENOENT) => return Ok(()),
            Err(e) => return Err(errno("inspect", file)(e)),
        };
        let regular = nix::sys::stat::SFlag::from_bits_truncate(st.st_mode)
            & nix::sys::stat::SFlag::S_IFMT
            == nix::sys::stat::SFlag::S_IFREG;
        if !regular || st.st_size != 0 {
            return Err(refused(file, "is not an empty regular file; left in place"));
        }
        match nix::unistd::unlinkat(
            parent.as_fd(),
            name.as_path(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        ) {
            Ok(()) | Err(nix::errno::Errno::ENOENT) => Ok(()),
            Err(e) => Err(errno("remove file", file)(e)),
        }
    }

    /// Remove the empty dir `dir`; one already gone is fine.
    pub fn rmdir(&self, dir: &Path) -> Result<(), SysError> {
        let (parent, name) = match self.parent(dir) {
            Ok(p) => p,
            Err(SysError::Errno { errno: nix::errno::Errno::ENOENT, .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        match nix::unistd::unlinkat(
            parent.as_fd(),
            name.as_path(),
            nix::unistd::UnlinkatFlags::RemoveDir,
        ) {
            Ok(()) | Err(nix::errno::Errno::ENOENT) => Ok(()),
            Err(e) => Err(errno("remove dir", dir)(e)),
        }
    }
}

/// The bytes of the regular file `name` in `dir`, at most `max` of them:
/// opened beneath `dir` (symlinks that stay inside it are followed, as a
/// ConfigMap volume's are; none that leave it), non-blocking, and read only
/// when it is a regular file of at most `max` bytes.
pub fn read_beneath(dir: &Path, name: &Path, max: u64) -> Result<Vec<u8>, SysError> {
    let path = dir.join(name);
    let d =
        nix::fcntl::open(dir, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(errno("open dir", dir))?;
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let fd = openat2(d.as_fd(), name, how).map_err(|e| resolve_error(&path, e))?;
    read_regular(std::fs::File::from(fd), &path, max)
}

/// The bytes of the regular file `path` (which may be a symlink an admin
/// made), opened non-blocking, at most `max` of them.
pub fn read_file(path: &Path, max: u64) -> Result<Vec<u8>, SysError> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_CLOEXEC | nix::libc::O_NOCTTY)
        .open(path)
        .map_err(super::io("open", path))?;
    read_regular(f, path, max)
}

/// The bytes of the open file `f` (`path`, for errors), refused when it is
/// not a regular file or holds more than `max` bytes.
pub fn read_regular(f: std::fs::File, path: &Path, max: u64) -> Result<Vec<u8>, SysError> {
    use std::io::Read;
    let meta = f.metadata().map_err(super::io("stat", path))?;
    if !meta.is_file() {
        return Err(refused(path, "is not a regular file"));
    }
    if meta.len() > max {
        return Err(refused(
            path,
            &format!("is {} bytes, more than the {max} allowed", meta.len()),
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // Bounded even if the file grows while it is read.
    f.take(max + 1).read_to_end(&mut bytes).map_err(super::io("read", path))?;
    if bytes.len() as u64 > max {
        return Err(refused(path, &format!("grew past the {max} bytes allowed while it was read")));
    }
    Ok(bytes)
}

/// `root` as a root: created if missing, its symlinks resolved, and not `/`.
pub fn resolve(root: &Path) -> Result<PathBuf, SysError> {
    std::fs::create_dir_all(root).map_err(super::io("create root dir", root))?;
    let path = std::fs::canonicalize(root).map_err(super::io("resolve root dir", root))?;
    if path == Path::new("/") {
        return Err(SysError::Refused {
            path,
            what: "/ cannot be a root the agent acts in".into(),
        });
    }
    Ok(path)
}

/// The path through which a syscall taking a path acts on exactly what a
/// handle refers to: its magic link in procfs.
pub fn fd_path(fd: &impl AsRawFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// [`fd_path`] of a dir handle joined with a name in it; the name itself is
/// then not followed if the syscall is told so (e.g. `UMOUNT_NOFOLLOW`).
pub fn fd_path_in(dir: &impl AsRawFd, name: &OsStr) -> PathBuf {
    fd_path(dir).join(name)
}

fn refused(path: &Path, what: &str) -> SysError {
    SysError::Refused { path: path.to_path_buf(), what: what.to_string() }
}

/// openat2's errors, said in the words of what happened.
fn resolve_error(path: &Path, e: nix::errno::Errno) -> SysError {
    match e {
        nix::errno::Errno::ELOOP => {
            refused(path, "is or passes through a symbolic link, which the agent does not follow")
        }
        nix::errno::Errno::EXDEV => refused(path, "escapes its root"),
        e => SysError::Errno { op: "open", path: path.to_path_buf(), errno: e },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (tempfile::TempDir, Roots) {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/file"), b"x").unwrap();
        std::fs::create_dir_all(t.path().join("outside")).unwrap();
        std::os::unix::fs::symlink(t.path().join("outside"), root.join("link")).unwrap();
        std::os::unix::fs::symlink("a", root.join("rel-link")).unwrap();
        let roots = Roots::open(&[root]).unwrap();
        (t, roots)
    }

    #[test]
    fn opens_beneath_and_follows_no_symlink() {
        let (t, roots) = setup();
        let root = std::fs::canonicalize(t.path().join("root")).unwrap();
        roots.handle(&root.join("a/b")).expect("a plain dir");
        roots.handle(&root.join("a/file")).expect("a plain file");
        for bad in ["link", "link/x", "rel-link", "rel-link/file"] {
            let e = roots.handle(&root.join(bad)).unwrap_err().to_string();
            assert!(e.contains("symbolic link"), "{bad}: {e}");
        }
        let e = roots.handle(&root).unwrap_err().to_string();
        assert!(e.contains("never acted on itself"), "{e}");
        let e = roots.handle(Path::new("/etc/passwd")).unwrap_err().to_string();
        assert!(e.contains("outside the dirs"), "{e}");
        // Not clean paths never reach the kernel.
        assert!(roots.handle(&root.join("a/../a/file")).is_err());
        assert!(roots.handle(&root.join("a/./file")).is_err());
    }

    #[test]
    fn a_cached_handle_follows_no_symlink_either() {
        let (t, roots) = setup();
        let root = std::fs::canonicalize(t.path().join("root")).unwrap();
        // Just made, so in the dentry cache.
        assert!(roots.handle_cached(&root.join("a/file")).unwrap().is_some());
        for bad in ["link/x", "rel-link/file"] {
            // Refused, or not answered from the cache: never followed.
            match roots.handle_cached(&root.join(bad)) {
                Ok(found) => assert!(found.is_none(), "{bad}: followed a link"),
                Err(e) => assert!(e.to_string().contains("symbolic link"), "{bad}: {e}"),
            }
        }
        assert!(
            roots
                .handle_cached(Path::new("/etc/passwd"))
                .unwrap_err()
                .to_string()
                .contains("outside the dirs")
        );
        assert!(roots.handle_cached(&root.join("a/../a/file")).is_err());
    }

    #[test]
    fn makes_and_removes_dirs_without_following_links() {
        let (t, roots) = setup();
        let root = std::fs::canonicalize(t.path().join("root")).unwrap();
        assert!(roots.mkdir_all(&root.join("x/y/z")).unwrap());
        assert!(!roots.mkdir_all(&root.join("x/y/z")).unwrap(), "already there");
        assert!(root.join("x/y/z").is_dir());
        assert!(roots.mkdir_all(&root.join("link/evil")).is_err());
        assert!(!t.path().join("outside/evil").exists(), "nothing made through the link");
        roots.rmdir(&root.join("x/y/z")).unwrap();
        roots.rmdir(&root.join("x/y/z")).expect("gone is fine");
        assert!(!root.join("x/y/z").exists());
        assert!(roots.mkdir_all(&root.join("x/y/z")).unwrap(), "only the last one missing");
        assert!(root.join("x/y/z").is_dir());
        assert!(roots.mkdir_all(&root.join("link/deeper/evil")).is_err());
        assert!(roots.rmdir(&root.join("link")).is_err(), "a symlink is not a dir to remove");
    }

    #[test]
    fn plugin_files_are_read_only_when_regular_small_and_inside() {
        let (t, _) = setup();
        let dir = t.path().join("root");
        std::fs::write(dir.join("a/p.wasm"), b"wasm").unwrap();
        std::os::unix::fs::symlink("a/p.wasm", dir.join("link.wasm")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.join("escape.wasm")).unwrap();
        nix::unistd::mkfifo(&dir.join("fifo.wasm"), Mode::from_bits_truncate(0o600)).unwrap();
        assert_eq!(read_beneath(&dir, Path::new("a/p.wasm"), 16).unwrap(), b"wasm");
        assert_eq!(
            read_beneath(&dir, Path::new("link.wasm"), 16).unwrap(),
            b"wasm",
            "a link inside (a ConfigMap's)"
        );
        assert!(
            read_beneath(&dir, Path::new("escape.wasm"), 16)
                .unwrap_err()
                .to_string()
                .contains("escapes")
        );
        assert!(
            read_beneath(&dir, Path::new("fifo.wasm"), 16)
                .unwrap_err()
                .to_string()
                .contains("not a regular file"),
            "and it did not block"
        );
        assert!(
            read_beneath(&dir, Path::new("a/p.wasm"), 3)
                .unwrap_err()
                .to_string()
                .contains("more than the 3")
        );
        assert!(read_file(&dir.join("fifo.wasm"), 16).is_err());
    }

    #[test]
    fn the_root_cannot_be_slash() {
        assert!(Roots::open(&[PathBuf::from("/")]).is_err());
    }
}
