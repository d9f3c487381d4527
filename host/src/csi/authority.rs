//! kubelet before 1.26 (its gRPC client dialled by path) sends a Unix
//! socket's path as the HTTP/2 `:authority` of every call, which the HTTP/2
//! server under tonic refuses as malformed (PROTOCOL_ERROR). This reader
//! sits between the socket and the server: it passes HTTP/2 frames through
//! and re-encodes each header block, with an `:authority` that is not a
//! valid authority replaced by `localhost` (what newer kubelets send). A
//! client names one authority for all its calls on a connection: the first
//! header block decides. Valid (kubelet 1.26 and later), the connection is
//! passed through untouched from then on; not, every header block after is
//! re-encoded, not only rewritten ones, so the server's HPACK state follows
//! one encoder.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The frame size every HTTP/2 peer accepts (SETTINGS_MAX_FRAME_SIZE's floor).
const MAX_FRAME: usize = 16_384;
/// Largest frame or header block taken from a client; the gRPC server
/// refuses bigger messages anyway.
const MAX_INPUT: usize = 1 << 20;

/// A header block being gathered from HEADERS and CONTINUATION frames.
struct Pending {
    stream: [u8; 4],
    end_stream: bool,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
    /// The block's frames as they came (for the first block only: passed
    /// on as they are when it needs no rewrite).
    frames: Vec<u8>,
}

pub struct AuthorityFix<S> {
    inner: S,
    input: Vec<u8>,
    output: Vec<u8>,
    preface_seen: bool,
    /// Not HTTP/2 with the preface, or a client whose first header block
    /// needed no rewrite: passed through untouched.
    passthrough: bool,
    /// Whether the first header block has been seen (and re-encoding chosen).
    rewriting: bool,
    pending: Option<Pending>,
    decoder: loona_hpack::Decoder<'static>,
    encoder: loona_hpack::Encoder<'static>,
    eof: bool,
}

impl<S> AuthorityFix<S> {
    pub fn new(inner: S) -> AuthorityFix<S> {
        AuthorityFix {
            inner,
            input: Vec::new(),
            output: Vec::new(),
            preface_seen: false,
            passthrough: false,
            rewriting: false,
            pending: None,
            decoder: loona_hpack::Decoder::new(),
            encoder: loona_hpack::Encoder::new(),
            eof: false,
        }
    }

    /// Move what can be moved from `input` to `output`; false when more
    /// input is needed first.
    fn process(&mut self) -> io::Result<bool> {
        if self.passthrough {
            let moved = !self.input.is_empty();
            self.output.append(&mut self.input);
            return Ok(moved);
        }
        if !self.preface_seen {
            let n = self.input.len().min(PREFACE.len());
            if self.input[..n] != PREFACE[..n] {
                self.passthrough = true;
                return self.process();
            }
            if n < PREFACE.len() {
                return Ok(false);
            }
            self.output.extend(self.input.drain(..PREFACE.len()));
            self.preface_seen = true;
            return Ok(true);
        }
        if self.input.len() < 9 {
            return Ok(false);
        }
        let len = u32::from_be_bytes([0, self.input[0], self.input[1], self.input[2]]) as usize;
        if len > MAX_INPUT {
            return Err(invalid(format!("an HTTP/2 frame of {len} bytes")));
        }
        if self.input.len() < 9 + len {
            return Ok(false);
        }
        let frame: Vec<u8> = self.input.drain(..9 + len).collect();
        let (kind, flags) = (frame[3], frame[4]);
        let stream = [frame[5], frame[6], frame[7], frame[8]];
        let payload = &frame[9..];
        match kind {
            HEADERS => {
                let mut at = 0;
                let pad = if flags & PADDED != 0 {
                    at = 1;
                    *payload
                        .first()
                        .ok_or_else(|| invalid("a padded HEADERS frame without its pad length"))?
                        as usize
                } else {
                    0
                };
                let priority = if flags & PRIORITY != 0 {
                    let p: [u8; 5] = payload
                        .get(at..at + 5)
                        .and_then(|p| p.try_into().ok())
                        .ok_or_else(|| invalid("a short HEADERS frame"))?;
                    at += 5;
                    Some(p)
                } else {
                    None
                };
                let end = payload
                    .len()
                    .checked_sub(pad)
                    .filter(|e| *e >= at)
                    .ok_or_else(|| invalid("HEADERS padding longer than the frame"))?;
                self.pending = Some(Pending {
                    stream,
                    end_stream: flags & END_STREAM != 0,
                    priority,
                    block: payload[at..end].to_vec(),
                    frames: if self.rewriting { Vec::new() } else { frame.clone() },
                });
            }
            CONTINUATION => {
                let p = self
                    .pending
                    .as_mut()
                    .ok_or_else(|| invalid("a CONTINUATION frame without HEADERS"))?;
                if p.block.len() + payload.len() > MAX_INPUT {
                    return Err(invalid("a header block over 1 MiB"));
                }
                p.block.extend_from_slice(payload);
                if !self.rewriting {
                    p.frames.extend_from_slice(&frame);
                }
            }
            _ => {
                self.output.extend_from_slice(&frame);
                return Ok(true);
            }
        }
        if flags & END_HEADERS != 0
            && let Some(p) = self.pending.take()
        {
            self.emit(p)?;
        }
        Ok(true)
    }

    /// Decode the block, fix its authority, and write it as HEADERS (and
    /// CONTINUATION) frames no larger than every peer accepts.
    fn emit(&mut self, p: Pending) -> io::Result<()> {
        let mut headers =
            self.decoder.decode(&p.block).map_err(|e| invalid(format!("HPACK: {e}")))?;
        let mut rewritten = false;
        for (name, value) in &mut headers {
            if name.as_slice() == b":authority"
                && http::uri::Authority::try_from(value.as_slice()).is_err()
            {
                *value = b"localhost".to_vec();
                rewritten = true;
            }
        }
        if !self.rewriting && !rewritten {
            // The first block is fine as it is: so is the connection.
            self.output.extend_from_slice(&p.frames);
            self.passthrough = true;
            return Ok(());
        }
        self.rewriting = true;
        let block = self.encoder.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let mut first = Vec::new();
        if let Some(prio) = p.priority {
            first.extend_from_slice(&prio);
        }
        let room = MAX_FRAME - first.len();
        let (head, mut rest) = block.split_at(block.len().min(room));
        first.extend_from_slice(head);
        let mut flags = if p.end_stream { END_STREAM } else { 0 }
            | if p.priority.is_some() { PRIORITY } else { 0 };
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        self.frame(HEADERS, flags, p.stream, &first);
        while !rest.is_empty() {
            let (chunk, more) = rest.split_at(rest.len().min(MAX_FRAME));
            self.frame(
                CONTINUATION,
                if more.is_empty() { END_HEADERS } else { 0 },
                p.stream,
                chunk,
            );
            rest = more;
        }
        Ok(())
    }

    fn frame(&mut self, kind: u8, flags: u8, stream: [u8; 4], payload: &[u8]) {
        let len = (payload.len() as u32).to_be_bytes();
        self.output.extend_from_slice(&len[1..]);
        self.output.extend_from_slice(&[kind, flags]);
        self.output.extend_from_slice(&stream);
        self.output.extend_from_slice(payload);
    }
}

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if !this.output.is_empty() {
                let n = this.output.len().min(buf.remaining());
                buf.put_slice(&this.output[..n]);
                this.output.drain(..n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // What is left is not a whole frame: the server sees it cut.
                this.output.append(&mut this.input);
                if this.output.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            if this.process()? {
                continue;
            }
            let mut chunk = [0u8; 16_384];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                this.eof = true;
            } else {
                this.input.extend_from_slice(read.filled());
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S> tonic::transport::server::Connected for AuthorityFix<S>
where
    S: Send + 'static,
{
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[kind, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// What the server reads when a client sends `bytes`.
    async fn through(bytes: Vec<u8>) -> io::Result<Vec<u8>> {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        tokio::io::AsyncWriteExt::write_all(&mut client, &bytes).await?;
        drop(client);
        let mut out = Vec::new();
        AuthorityFix::new(server).read_to_end(&mut out).await?;
        Ok(out)
    }

    /// The header blocks of the HEADERS (and CONTINUATION) frames in `bytes`, decoded.
    fn blocks(bytes: &[u8]) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut d = loona_hpack::Decoder::new();
        let (mut at, mut out, mut block) = (PREFACE.len(), Vec::new(), Vec::new());
        while at + 9 <= bytes.len() {
            let len = u32::from_be_bytes([0, bytes[at], bytes[at + 1], bytes[at + 2]]) as usize;
            let (kind, flags) = (bytes[at + 3], bytes[at + 4]);
            let payload = &bytes[at + 9..at + 9 + len];
            if kind == HEADERS || kind == CONTINUATION {
                let skip = if kind == HEADERS && flags & PRIORITY != 0 { 5 } else { 0 };
                block.extend_from_slice(&payload[skip..]);
                if flags & END_HEADERS != 0 {
                    out.push(d.decode(&block).unwrap());
                    block.clear();
                }
            }
            at += 9 + len;
        }
        out
    }

    #[tokio::test]
    async fn a_socket_path_authority_becomes_localhost_and_the_rest_is_kept() {
        let mut enc = loona_hpack::Encoder::new();
        let req = |path: &[u8]| {
            vec![
                (b":method".to_vec(), b"POST".to_vec()),
                (b":authority".to_vec(), path.to_vec()),
                (b":path".to_vec(), b"/csi.v1.Node/NodeGetInfo".to_vec()),
            ]
        };
        let first = enc.encode(
            req(b"/var/lib/kubelet/plugins/x/csi.sock")
                .iter()
                .map(|(n, v)| (n.as_slice(), v.as_slice())),
        );
        // The second block leans on the client's dynamic table.
        let second = enc.encode(
            req(b"/var/lib/kubelet/plugins/x/csi.sock")
                .iter()
                .map(|(n, v)| (n.as_slice(), v.as_slice())),
        );
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(0x4, 0, 0, &[])); // SETTINGS
        // Padded, with priority, split over a CONTINUATION.
        let mut padded = vec![3u8];
        padded.extend_from_slice(&[0, 0, 0, 0, 16]);
        padded.extend_from_slice(&first[..4]);
        padded.extend_from_slice(&[0, 0, 0]);
        bytes.extend(frame(HEADERS, PADDED | PRIORITY, 1, &padded));
        bytes.extend(frame(CONTINUATION, END_HEADERS, 1, &first[4..]));
        bytes.extend(frame(0x0, END_STREAM, 1, b"data"));
        bytes.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &second));
        let out = through(bytes).await.unwrap();
        let got = blocks(&out);
        assert_eq!(got.len(), 2);
        for b in &got {
            assert_eq!(b[1], (b":authority".to_vec(), b"localhost".to_vec()));
            assert_eq!(b[2].1, b"/csi.v1.Node/NodeGetInfo");
        }
        assert!(out.windows(4).any(|w| w == b"data"), "other frames pass through");
        assert!(out.starts_with(PREFACE));
    }

    #[tokio::test]
    async fn a_connection_whose_first_authority_is_valid_passes_through_unchanged() {
        let mut enc = loona_hpack::Encoder::new();
        let req = [
            (&b":method"[..], &b"POST"[..]),
            (b":authority", b"localhost"),
            (b":path", b"/csi.v1.Node/NodeStageVolume"),
        ];
        let first = enc.encode(req);
        // Leans on the client's dynamic table: decodable only if nothing
        // before it was re-encoded.
        let second = enc.encode(req);
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(0x4, 0, 0, &[])); // SETTINGS
        bytes.extend(frame(HEADERS, 0, 1, &first[..3]));
        bytes.extend(frame(CONTINUATION, END_HEADERS, 1, &first[3..]));
        bytes.extend(frame(0x0, END_STREAM, 1, b"data"));
        bytes.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &second));
        let out = through(bytes.clone()).await.unwrap();
        assert_eq!(out, bytes, "byte for byte");
        assert_eq!(blocks(&out)[1][1].1, b"localhost");
    }

    #[tokio::test]
    async fn a_valid_authority_is_kept_and_garbage_is_refused() {
        let mut enc = loona_hpack::Encoder::new();
        let block = enc.encode([(&b":authority"[..], &b"localhost:1234"[..])]);
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(HEADERS, END_HEADERS, 1, &block));
        let got = blocks(&through(bytes).await.unwrap());
        assert_eq!(got[0][0].1, b"localhost:1234");
        let mut bad = PREFACE.to_vec();
        bad.extend(frame(HEADERS, END_HEADERS, 1, &[0xff, 0xff, 0xff, 0xff]));
        assert!(through(bad).await.is_err(), "an undecodable header block closes the connection");
        let mut huge = PREFACE.to_vec();
        huge.extend_from_slice(&[0xff, 0xff, 0xff, 0x0, 0x0, 0, 0, 0, 1]);
        assert!(through(huge).await.is_err(), "a frame over the limit closes the connection");
        // Not HTTP/2: passed through as it came.
        assert_eq!(
            through(b"GET / HTTP/1.1\r\n\r\n".to_vec()).await.unwrap(),
            b"GET / HTTP/1.1\r\n\r\n"
        );
    }
}
