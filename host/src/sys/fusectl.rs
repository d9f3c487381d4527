//! Aborting a FUSE connection through fusectl, without aborting someone
//! else's. The kernel names a connection by its superblock's anonymous
//! device minor, and hands that number to the next FUSE mount as soon as
//! the old superblock is gone: writing to `<fusectl>/<n>/abort` by number,
//! after the connection may have ended (a lazily unmounted client
//! finishing meanwhile), can abort another volume's client. A switch opened
//! while the connection is known alive stays bound to it: once that
//! connection is gone, the kernel makes its open control files refer to
//! nothing, and pulling the switch is a no-op.

use std::io::Write;
use std::path::Path;

const FUSECTL: &str = "/sys/fs/fuse/connections";

/// How many requests of connection `conn` wait for an answer (queued, or
/// read by a client and not answered), as fusectl counts them.
pub fn waiting(conn: u32) -> std::io::Result<u64> {
    let text = std::fs::read_to_string(Path::new(FUSECTL).join(conn.to_string()).join("waiting"))?;
    text.trim().parse().map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidData))
}

/// An open `abort` file of one FUSE connection.
#[derive(Debug)]
pub struct AbortSwitch {
    conn: u32,
    file: std::fs::File,
}

impl AbortSwitch {
    /// Open connection `conn`'s switch. Call it only while a mount known
    /// to be the caller's holds `conn` (the number is then not reusable);
    /// fusectl is mounted first where it is not.
    pub fn open(conn: u32) -> std::io::Result<AbortSwitch> {
        let fusectl = Path::new(FUSECTL);
        let dir = fusectl.join(conn.to_string());
        if !dir.exists() {
            let _ = nix::mount::mount(
                Some("fusectl"),
                fusectl,
                Some("fusectl"),
                nix::mount::MsFlags::empty(),
                None::<&str>,
            );
        }
        let file = std::fs::OpenOptions::new().write(true).open(dir.join("abort"))?;
        Ok(AbortSwitch { conn, file })
    }

    /// Fail every request of the connection and make it refuse new ones;
    /// nothing if it has ended.
    pub fn pull(mut self) {
        match self.file.write_all(b"1") {
            Ok(()) => tracing::warn!(
                conn = self.conn,
                "aborted a FUSE connection (nothing happens if it had ended)"
            ),
            Err(e) => tracing::warn!(
                conn = self.conn,
                "cannot abort FUSE connection through fusectl: {e}"
            ),
        }
    }
}
