//! What an NBD export serves: a range of bytes with the operations the
//! protocol has. The server checks bounds and read-only before calling;
//! implementations do the I/O. [`crate::sys::export_file`] serves a local
//! file or block device; [`Memory`] serves a buffer (tests, fuzzing).

use std::io;
use std::sync::RwLock;

/// A run of bytes with one allocation state (base:allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u32,
    /// Reads as zeroes and takes no space.
    pub hole: bool,
}

pub trait Export: Send + Sync {
    fn size(&self) -> u64;
    fn read_only(&self) -> bool;
    fn description(&self) -> String {
        String::new()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Write; with `fua`, durable before returning.
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()>;
    /// Make every write acknowledged so far durable.
    fn flush(&self) -> io::Result<()>;
    /// The client no longer needs these bytes (advisory).
    fn trim(&self, offset: u64, length: u64) -> io::Result<()>;
    /// Zero the range; `punch` allows freeing it; `fast` asks to fail with
    /// `Unsupported` rather than write zeroes one by one.
    fn write_zeroes(&self, offset: u64, length: u64, punch: bool, fast: bool) -> io::Result<()>;
    /// Prefetch (advisory).
    fn cache(&self, _offset: u64, _length: u64) -> io::Result<()> {
        Ok(())
    }
    /// Allocation of `[offset, offset+length)`: at least one extent, none
    /// past the range, at most `max` of them.
    fn extents(&self, offset: u64, length: u32, max: usize) -> io::Result<Vec<Extent>>;
}

/// An export held in memory; holes are not tracked (all data).
pub struct Memory {
    data: RwLock<Vec<u8>>,
    read_only: bool,
}

impl Memory {
    pub fn new(size: usize, read_only: bool) -> Self {
        Memory { data: RwLock::new(vec![0; size]), read_only }
    }

    pub fn snapshot(&self) -> Vec<u8> {
        self.data.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

fn range(offset: u64, length: usize, size: usize) -> io::Result<std::ops::Range<usize>> {
    let start =
        usize::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let end =
        start.checked_add(length).filter(|e| *e <= size).ok_or(io::ErrorKind::InvalidInput)?;
    Ok(start..end)
}

impl Export for Memory {
    fn size(&self) -> u64 {
        self.data.read().unwrap_or_else(|e| e.into_inner()).len() as u64
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let data = self.data.read().unwrap_or_else(|e| e.into_inner());
        buf.copy_from_slice(&data[range(offset, buf.len(), data.len())?]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> io::Result<()> {
        let mut data = self.data.write().unwrap_or_else(|e| e.into_inner());
        let r = range(offset, buf.len(), data.len())?;
        data[r].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn trim(&self, _offset: u64, _length: u64) -> io::Result<()> {
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, length: u64, _punch: bool, _fast: bool) -> io::Result<()> {
        let mut data = self.data.write().unwrap_or_else(|e| e.into_inner());
        let len =
            usize::try_from(length).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let r = range(offset, len, data.len())?;
        data[r].fill(0);
        Ok(())
    }

    fn extents(&self, _offset: u64, length: u32, _max: usize) -> io::Result<Vec<Extent>> {
        Ok(vec![Extent { length, hole: false }])
    }
}
