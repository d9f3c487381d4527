//! An NBD export served from a local regular file or block device:
//! positional reads and writes on one shared descriptor, `fdatasync` for
//! flushes and FUA, `fallocate` for trims and zeroes, SEEK_DATA/SEEK_HOLE
//! for allocation.

use crate::nbd::{Export, Extent};
use rustix::fs::{FallocateFlags, SeekFrom};
use std::fs::File;
use std::io::{self, Seek};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};

pub struct FileExport {
    file: File,
    path: PathBuf,
    size: u64,
    read_only: bool,
    block_device: bool,
}

impl FileExport {
    /// Open `path` (a regular file or a block device; symlinks are not
    /// followed) for serving; its size is fixed from now on.
    pub fn open(path: &Path, read_only: bool) -> Result<FileExport, super::SysError> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(path)
            .map_err(super::io("open export", path))?;
        FileExport::from_file(file, path, read_only)
    }

    /// Serve `file`, already open (for writing too unless `read_only`);
    /// `path` names it in errors and as the export's description.
    pub fn from_file(
        mut file: File,
        path: &Path,
        read_only: bool,
    ) -> Result<FileExport, super::SysError> {
        let kind = file.metadata().map_err(super::io("stat export", path))?.file_type();
        let block_device = kind.is_block_device();
        if !kind.is_file() && !block_device {
            return Err(super::SysError::Refused {
                path: path.to_path_buf(),
                what: "an export is a regular file or a block device".into(),
            });
        }
        // A block device's size is where its end is.
        let size = file.seek(io::SeekFrom::End(0)).map_err(super::io("size of export", path))?;
        Ok(FileExport { file, path: path.to_path_buf(), size, read_only, block_device })
    }

    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn fallocate(&self, flags: FallocateFlags, offset: u64, length: u64) -> io::Result<()> {
        rustix::fs::fallocate(&self.file, flags, offset, length).map_err(io::Error::from)
    }

    /// Write zeroes with plain writes, 1 MiB at a time.
    fn write_zero_bytes(&self, mut offset: u64, length: u64) -> io::Result<()> {
        let zeroes = vec![0u8; length.min(1 << 20) as usize];
        let end = offset + length;
        while offset < end {
            let n = (end - offset).min(zeroes.len() as u64) as usize;
            self.file.write_all_at(&zeroes[..n], offset)?;
            offset += n as u64;
        }
        Ok(())
    }
}

fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error().map(nix::errno::Errno::from_raw),
        Some(nix::errno::Errno::EOPNOTSUPP | nix::errno::Errno::ENOSYS)
    )
}

impl Export for FileExport {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn description(&self) -> String {
        self.path.display().to_string()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.file.write_all_at(buf, offset)?;
        if fua {
            self.sync()?;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.sync()
    }

    fn trim(&self, offset: u64, length: u64) -> io::Result<()> {
        match self.fallocate(FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, length)
        {
            // Trimming is advisory: a filesystem that cannot punch keeps the bytes.
            Err(e) if unsupported(&e) => Ok(()),
            other => other,
        }
    }

    fn write_zeroes(&self, offset: u64, length: u64, punch: bool, fast: bool) -> io::Result<()> {
        if length == 0 {
            return Ok(());
        }
        let mut attempts = vec![FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE];
        if punch {
            attempts.insert(0, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE);
        }
        for flags in attempts {
            match self.fallocate(flags, offset, length) {
                Ok(()) => return Ok(()),
                Err(e) if unsupported(&e) => continue,
                Err(e) => return Err(e),
            }
        }
        if fast {
            return Err(io::Error::from_raw_os_error(nix::errno::Errno::EOPNOTSUPP as i32));
        }
        self.write_zero_bytes(offset, length)
    }

    fn cache(&self, offset: u64, length: u64) -> io::Result<()> {
        use std::os::fd::AsFd;
        let (off, len) =
            (i64::try_from(offset).unwrap_or(i64::MAX), i64::try_from(length).unwrap_or(i64::MAX));
        nix::fcntl::posix_fadvise(
            self.file.as_fd(),
            off,
            len,
            nix::fcntl::PosixFadviseAdvice::POSIX_FADV_WILLNEED,
        )
        .map_err(|e| io::Error::from_raw_os_error(e as i32))
    }

    fn extents(&self, offset: u64, length: u32, max: usize) -> io::Result<Vec<Extent>> {
        let end = offset + u64::from(length);
        if self.block_device {
            return Ok(vec![Extent { length, hole: false }]);
        }
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < end && out.len() < max {
            // lseek moves the shared file offset, which nothing else uses.
            let (hole, next) = match rustix::fs::seek(&self.file, SeekFrom::Data(pos)) {
                Ok(data) if data > pos => (true, data),
                Ok(_) => (
                    false,
                    rustix::fs::seek(&self.file, SeekFrom::Hole(pos)).map_err(io::Error::from)?,
                ),
                // No data from here to the end of the file.
                Err(rustix::io::Errno::NXIO) => (true, end),
                Err(e) => return Err(e.into()),
            };
            let next = next.clamp(pos + 1, end);
            out.push(Extent { length: (next - pos) as u32, hole });
            pos = next;
        }
        Ok(out)
    }
}
