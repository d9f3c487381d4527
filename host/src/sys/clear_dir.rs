//! Emptying a released filesystem volume: every entry inside a directory is
//! removed, the directory itself kept. Whatever a pod left there is hostile:
//! symlinks are removed, never followed; a directory on another filesystem
//! (a mount inside) is refused, never descended into; and the walk works
//! from file descriptors, so renaming things mid-walk cannot lead it out.

use super::{SysError, errno};
use nix::dir::{Dir, Type};
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, SFlag, fstat, fstatat};
use nix::unistd::{UnlinkatFlags, unlinkat};
use std::ffi::CString;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

/// How deep a tree may be; deeper is refused (each level holds a descriptor).
const MAX_DEPTH: usize = 4096;

/// One open directory of the walk: read through `dir`, acted in through
/// `at` (a second descriptor, as reading borrows `dir`), and its name in
/// its parent (none for the top).
struct Level {
    dir: Dir,
    at: OwnedFd,
    name: Option<CString>,
}

fn level(fd: OwnedFd, name: Option<CString>, path: &Path) -> Result<Level, SysError> {
    let at = fd.try_clone().map_err(super::io("duplicate a descriptor of", path))?;
    Ok(Level { dir: Dir::from_fd(fd).map_err(errno("read dir", path))?, at, name })
}

/// Remove everything inside the directory open at `top` (`path` names it in
/// errors); how many entries were removed.
pub fn clear(top: OwnedFd, path: &Path) -> Result<u64, SysError> {
    let dev = fstat(top.as_fd()).map_err(errno("stat", path))?.st_dev;
    let mut removed = 0u64;
    // Each level: the open directory, and the name of a subdirectory of it
    // that is being emptied (removed once its level is done).
    let mut stack: Vec<Level> = vec![level(top, None, path)?];
    loop {
        let depth = stack.len();
        let Some(Level { dir, at, .. }) = stack.last_mut() else { break };
        let mut descend = None;
        let at = at.as_fd();
        for entry in dir.iter() {
            let entry = entry.map_err(errno("read dir", path))?;
            let name = entry.file_name();
            if name.to_bytes() == b"." || name.to_bytes() == b".." {
                continue;
            }
            let is_dir = match entry.file_type() {
                Some(Type::Directory) => true,
                Some(_) => false,
                None => SFlag::from_bits_truncate(
                    fstatat(at, name, AtFlags::AT_SYMLINK_NOFOLLOW)
                        .map_err(errno("stat", path))?
                        .st_mode,
                )
                .contains(SFlag::S_IFDIR),
            };
            if !is_dir {
                unlinkat(at, name, UnlinkatFlags::NoRemoveDir)
                    .map_err(errno("remove an entry of", path))?;
                removed += 1;
                continue;
            }
            descend = Some(name.to_owned());
            break;
        }
        match descend {
            Some(name) => {
                if depth >= MAX_DEPTH {
                    return Err(SysError::Refused {
                        path: path.to_path_buf(),
                        what: format!("holds a tree deeper than {MAX_DEPTH} levels"),
                    });
                }
                let sub = nix::fcntl::openat(
                    at,
                    name.as_c_str(),
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
                .map_err(errno("open a dir in", path))?;
                if fstat(sub.as_fd()).map_err(errno("stat", path))?.st_dev != dev {
                    return Err(SysError::Refused {
                        path: path.to_path_buf(),
                        what: format!(
                            "{name:?} inside it is another filesystem (a mount): not cleared"
                        ),
                    });
                }
                stack.push(level(sub, Some(name), path)?);
            }
            None => {
                // This level is empty: remove it from its parent.
                let done = stack.pop().expect("non-empty stack");
                if let (Some(name), Some(parent)) = (done.name, stack.last()) {
                    unlinkat(parent.at.as_fd(), name.as_c_str(), UnlinkatFlags::RemoveDir)
                        .map_err(errno("remove a dir in", path))?;
                    removed += 1;
                }
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(dir: &Path) -> OwnedFd {
        nix::fcntl::open(
            dir,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
    }

    #[test]
    fn everything_inside_goes_and_links_are_not_followed() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), b"not the volume's").unwrap();
        let vol = tempfile::tempdir().unwrap();
        let v = vol.path();
        std::fs::create_dir_all(v.join("a/b/c")).unwrap();
        std::fs::write(v.join("a/b/c/deep"), b"x").unwrap();
        std::fs::write(v.join("top"), b"x").unwrap();
        std::os::unix::fs::symlink(outside.path(), v.join("a/link-to-outside")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("keep"), v.join("file-link")).unwrap();
        let removed = clear(open(v), v).unwrap();
        assert_eq!(removed, 7, "a, b, c, deep, top and two links");
        assert_eq!(std::fs::read_dir(v).unwrap().count(), 0);
        assert!(v.is_dir(), "the volume's dir itself stays");
        assert_eq!(std::fs::read(outside.path().join("keep")).unwrap(), b"not the volume's");
        assert_eq!(clear(open(v), v).unwrap(), 0, "an empty dir is fine");
    }

    #[test]
    fn a_deep_tree_is_refused_not_overflowed() {
        let vol = tempfile::tempdir().unwrap();
        // Built from handles: the path itself would pass PATH_MAX.
        let mut fd = open(vol.path());
        for _ in 0..MAX_DEPTH + 1 {
            nix::sys::stat::mkdirat(fd.as_fd(), "d", Mode::from_bits_truncate(0o700)).unwrap();
            fd = nix::fcntl::openat(
                fd.as_fd(),
                "d",
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .unwrap();
        }
        let e = clear(open(vol.path()), vol.path()).unwrap_err();
        assert!(e.to_string().contains("deeper than"), "{e}");
    }
}
