//! A whole NBD client stream against the server: handshake options, then
//! requests, over a 64 KiB in-memory export, on a server with or without
//! required TLS. Whatever the bytes, the server answers or hangs up; it
//! never panics, and it writes only inside the export.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::io::{Cursor, Read, Write};
use std::sync::Arc;
use volagent::nbd::export::Memory;
use volagent::nbd::{Exports, handshake, transmission};

struct Duplex {
    input: Cursor<Vec<u8>>,
    output: Vec<u8>,
}

impl Read for Duplex {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Duplex {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // Bounded like a socket buffer the client never drains.
        if self.output.len() > 16 << 20 {
            return Err(std::io::ErrorKind::BrokenPipe.into());
        }
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let exports = Exports::default();
    let disk = Arc::new(Memory::new(64 * 1024, false));
    exports.insert("", disk.clone());
    exports.insert("ro", Arc::new(Memory::new(4096, true)));
    // The first byte picks a server that requires TLS: then only STARTTLS
    // (or ABORT) may end the options, and never with a session.
    let Some((&mode, data)) = data.split_first() else { return };
    let mut stream = Duplex { input: Cursor::new(data.to_vec()), output: Vec::new() };
    if mode & 1 == 1 {
        if let Ok(ending) = handshake::greet(&mut stream).and_then(|z| handshake::options(&mut stream, &exports, z, handshake::Tls::Required)) {
            assert!(!matches!(ending, handshake::Ending::Go(_)), "a session without TLS on a server that requires it");
        }
    } else if let Ok(Some(session)) = handshake::negotiate(&mut stream, &exports) {
        let _ = transmission::serve(stream, &session);
    }
    assert_eq!(disk.snapshot().len(), 64 * 1024);
});
