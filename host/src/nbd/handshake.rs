//! The fixed-newstyle handshake: greeting, client flags, then options until
//! the client picks an export (GO or EXPORT_NAME) or leaves. Every option is
//! bounded in size and count; anything out of step ends the connection.

use super::export::Export;
use super::wire::{self, Fields, OptionHeader};
use super::{Exports, ProtocolError};
use std::io::{Read, Write};
use std::sync::Arc;

/// Longest option payload read: a name (4096) and some requests.
const MAX_OPTION_LEN: u32 = 16 * 1024;
/// Longer payloads are skipped with ERR_TOO_BIG up to this; beyond, the
/// connection is closed.
const MAX_SKIPPED_LEN: u32 = 1 << 20;
/// Options one connection may send before choosing an export.
const MAX_OPTIONS: usize = 64;
/// Longest export name or context query.
const MAX_NAME: usize = 4096;
/// Meta context queries in one option.
const MAX_QUERIES: u32 = 16;

/// The largest read or write payload, advertised as NBD_INFO_BLOCK_SIZE.
pub const MAX_PAYLOAD: u32 = 32 * 1024 * 1024;
pub const PREFERRED_BLOCK: u32 = 4096;

/// What the client chose.
pub struct Session {
    pub name: String,
    pub export: Arc<dyn Export>,
    pub structured: bool,
    /// base:allocation was selected for this export.
    pub base_allocation: bool,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("name", &self.name)
            .field("structured", &self.structured)
            .finish()
    }
}

/// The transmission flags of `export` for a client that did (not)
/// negotiate structured replies.
pub fn transmission_flags(export: &dyn Export, structured: bool) -> u16 {
    let mut flags = wire::TFLAG_HAS_FLAGS
        | wire::TFLAG_SEND_FLUSH
        | wire::TFLAG_SEND_FUA
        | wire::TFLAG_SEND_TRIM
        | wire::TFLAG_SEND_WRITE_ZEROES
        | wire::TFLAG_SEND_FAST_ZERO
        | wire::TFLAG_SEND_CACHE
        // Every connection writes the same file, and a flush syncs it whole.
        | wire::TFLAG_CAN_MULTI_CONN;
    if export.read_only() {
        flags |= wire::TFLAG_READ_ONLY;
    }
    if structured {
        flags |= wire::TFLAG_SEND_DF;
    }
    flags
}

struct Negotiation<'a, S> {
    stream: &'a mut S,
    exports: &'a Exports,
    no_zeroes: bool,
    tls: Tls,
    structured: bool,
    /// The export the last SET_META_CONTEXT was for, and whether it selected base:allocation.
    meta: Option<(String, bool)>,
}

/// Where a connection stands with TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tls {
    /// Not offered: STARTTLS is refused.
    Off,
    /// Nothing but STARTTLS (or ABORT) is served until TLS is on.
    Required,
    /// On: the options now run inside it.
    Established,
}

/// How option haggling ended.
#[derive(Debug)]
pub enum Ending {
    Go(Session),
    /// The client left (ABORT) without choosing.
    Left,
    /// STARTTLS was acknowledged: the TLS handshake comes next, then the
    /// options again, inside it.
    StartTls,
}

/// The greeting and the client's flags; whether the client asked for NO_ZEROES.
pub fn greet<S: Read + Write>(stream: &mut S) -> Result<bool, ProtocolError> {
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&wire::NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(wire::FLAG_FIXED_NEWSTYLE | wire::FLAG_NO_ZEROES).to_be_bytes());
    stream.write_all(&greeting)?;
    let mut flags = [0u8; 4];
    stream.read_exact(&mut flags)?;
    let client = u32::from_be_bytes(flags);
    if client & !(wire::CLIENT_FIXED_NEWSTYLE | wire::CLIENT_NO_ZEROES) != 0 {
        return Err(ProtocolError::Handshake(format!("unknown client flags {client:#x}")));
    }
    if client & wire::CLIENT_FIXED_NEWSTYLE == 0 {
        return Err(ProtocolError::Handshake("the client does not speak fixed newstyle".into()));
    }
    Ok(client & wire::CLIENT_NO_ZEROES != 0)
}

/// A whole handshake without TLS; `None` when the client left without choosing.
pub fn negotiate<S: Read + Write>(
    stream: &mut S,
    exports: &Exports,
) -> Result<Option<Session>, ProtocolError> {
    let no_zeroes = greet(stream)?;
    match options(stream, exports, no_zeroes, Tls::Off)? {
        Ending::Go(session) => Ok(Some(session)),
        Ending::Left | Ending::StartTls => Ok(None),
    }
}

/// Options until the client chooses an export, leaves, or starts TLS.
pub fn options<S: Read + Write>(
    stream: &mut S,
    exports: &Exports,
    no_zeroes: bool,
    tls: Tls,
) -> Result<Ending, ProtocolError> {
    let mut n = Negotiation { stream, exports, no_zeroes, tls, structured: false, meta: None };
    for _ in 0..MAX_OPTIONS {
        let mut header = [0u8; wire::OPTION_HEADER_LEN];
        n.stream.read_exact(&mut header)?;
        let Some(OptionHeader { option, length }) = OptionHeader::parse(&header) else {
            return Err(ProtocolError::Handshake("option without IHAVEOPT magic".into()));
        };
        if length > MAX_OPTION_LEN {
            if length > MAX_SKIPPED_LEN {
                return Err(ProtocolError::Handshake(format!("option {option} of {length} bytes")));
            }
            std::io::copy(
                &mut Read::by_ref(n.stream).take(u64::from(length)),
                &mut std::io::sink(),
            )?;
            n.error(option, wire::REP_ERR_TOO_BIG, "option too long")?;
            continue;
        }
        let mut data = vec![0u8; length as usize];
        n.stream.read_exact(&mut data)?;
        if let Some(end) = n.option(option, &data)? {
            return Ok(end);
        }
    }
    Err(ProtocolError::Handshake(format!("more than {MAX_OPTIONS} options")))
}

impl<S: Read + Write> Negotiation<'_, S> {
    /// Handle one option; `Some` ends the option haggling.
    fn option(&mut self, option: u32, data: &[u8]) -> Result<Option<Ending>, ProtocolError> {
        if self.tls == Tls::Required && ![wire::OPT_STARTTLS, wire::OPT_ABORT].contains(&option) {
            if option == wire::OPT_EXPORT_NAME {
                // The client has no way to hear an error here.
                return Err(ProtocolError::Handshake(
                    "EXPORT_NAME before STARTTLS on a server that requires TLS".into(),
                ));
            }
            return self
                .error(
                    option,
                    wire::REP_ERR_TLS_REQD,
                    "this server requires TLS: send STARTTLS first",
                )
                .map(|_| None);
        }
        match option {
            wire::OPT_EXPORT_NAME => {
                let Some(name) = std::str::from_utf8(data)
                    .ok()
                    .filter(|s| s.len() <= MAX_NAME && !s.contains('\0'))
                else {
                    return Err(ProtocolError::Handshake("export name is not a string".into()));
                };
                let Some(export) = self.exports.get(name) else {
                    // The client has no way to hear an error here.
                    return Err(ProtocolError::Handshake(format!("no export named {name:?}")));
                };
                let mut reply = Vec::with_capacity(10 + 124);
                reply.extend_from_slice(&export.size().to_be_bytes());
                reply.extend_from_slice(
                    &transmission_flags(export.as_ref(), self.structured).to_be_bytes(),
                );
                if !self.no_zeroes {
                    reply.resize(10 + 124, 0);
                }
                self.stream.write_all(&reply)?;
                Ok(Some(Ending::Go(self.session(name, export))))
            }
            wire::OPT_ABORT => {
                // The client may already be gone.
                let _ = self.reply(option, wire::REP_ACK, &[]);
                Ok(Some(Ending::Left))
            }
            wire::OPT_LIST => {
                if !data.is_empty() {
                    return self
                        .error(option, wire::REP_ERR_INVALID, "LIST takes no data")
                        .map(|_| None);
                }
                for name in self.exports.names() {
                    let mut entry = (name.len() as u32).to_be_bytes().to_vec();
                    entry.extend_from_slice(name.as_bytes());
                    self.reply(option, wire::REP_SERVER, &entry)?;
                }
                self.reply(option, wire::REP_ACK, &[]).map(|_| None)
            }
            wire::OPT_STARTTLS => match self.tls {
                Tls::Off => self
                    .error(option, wire::REP_ERR_POLICY, "TLS is not configured on this server")
                    .map(|_| None),
                Tls::Established => {
                    self.error(option, wire::REP_ERR_INVALID, "TLS is on already").map(|_| None)
                }
                Tls::Required if !data.is_empty() => self
                    .error(option, wire::REP_ERR_INVALID, "STARTTLS takes no data")
                    .map(|_| None),
                Tls::Required => {
                    self.reply(option, wire::REP_ACK, &[]).map(|_| Some(Ending::StartTls))
                }
            },
            wire::OPT_INFO | wire::OPT_GO => self.info(option, data),
            wire::OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    return self
                        .error(option, wire::REP_ERR_INVALID, "STRUCTURED_REPLY takes no data")
                        .map(|_| None);
                }
                self.structured = true;
                self.reply(option, wire::REP_ACK, &[]).map(|_| None)
            }
            wire::OPT_LIST_META_CONTEXT | wire::OPT_SET_META_CONTEXT => {
                self.meta_context(option, data).map(|_| None)
            }
            _ => self.error(option, wire::REP_ERR_UNSUP, "option not supported").map(|_| None),
        }
    }

    fn session(&self, name: &str, export: Arc<dyn Export>) -> Session {
        let base_allocation = self.structured && matches!(&self.meta, Some((n, true)) if n == name);
        Session { name: name.to_string(), export, structured: self.structured, base_allocation }
    }

    fn info(&mut self, option: u32, data: &[u8]) -> Result<Option<Ending>, ProtocolError> {
        let mut f = Fields::new(data);
        let parsed = (|| {
            let name = f.string(MAX_NAME)?;
            let count = f.u16()?;
            let requests: Vec<u16> = (0..count).map(|_| f.u16()).collect::<Option<_>>()?;
            f.is_empty().then_some((name, requests))
        })();
        let Some((name, requests)) = parsed else {
            return self
                .error(option, wire::REP_ERR_INVALID, "malformed INFO/GO request")
                .map(|_| None);
        };
        let Some(export) = self.exports.get(name) else {
            return self
                .error(option, wire::REP_ERR_UNKNOWN, &format!("no export named {name:?}"))
                .map(|_| None);
        };
        let mut info = wire::INFO_EXPORT.to_be_bytes().to_vec();
        info.extend_from_slice(&export.size().to_be_bytes());
        info.extend_from_slice(&transmission_flags(export.as_ref(), self.structured).to_be_bytes());
        self.reply(option, wire::REP_INFO, &info)?;
        // Block sizes are always sent: they tell the client the payload cap.
        let mut sizes = wire::INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [1, PREFERRED_BLOCK, MAX_PAYLOAD] {
            sizes.extend_from_slice(&v.to_be_bytes());
        }
        self.reply(option, wire::REP_INFO, &sizes)?;
        if requests.contains(&wire::INFO_NAME) {
            let mut reply = wire::INFO_NAME.to_be_bytes().to_vec();
            reply.extend_from_slice(name.as_bytes());
            self.reply(option, wire::REP_INFO, &reply)?;
        }
        let description = export.description();
        if requests.contains(&wire::INFO_DESCRIPTION) && !description.is_empty() {
            let mut reply = wire::INFO_DESCRIPTION.to_be_bytes().to_vec();
            reply.extend_from_slice(description.as_bytes());
            self.reply(option, wire::REP_INFO, &reply)?;
        }
        self.reply(option, wire::REP_ACK, &[])?;
        Ok((option == wire::OPT_GO).then(|| Ending::Go(self.session(name, export))))
    }

    fn meta_context(&mut self, option: u32, data: &[u8]) -> Result<(), ProtocolError> {
        if !self.structured {
            return self.error(
                option,
                wire::REP_ERR_INVALID,
                "meta contexts need structured replies first",
            );
        }
        let mut f = Fields::new(data);
        let parsed = (|| {
            let name = f.string(MAX_NAME)?;
            let count = f.u32()?;
            if count > MAX_QUERIES {
                return None;
            }
            let queries: Vec<&str> =
                (0..count).map(|_| f.string(MAX_NAME)).collect::<Option<_>>()?;
            f.is_empty().then_some((name, queries))
        })();
        let Some((name, queries)) = parsed else {
            return self.error(option, wire::REP_ERR_INVALID, "malformed meta context request");
        };
        if self.exports.get(name).is_none() {
            return self.error(option, wire::REP_ERR_UNKNOWN, &format!("no export named {name:?}"));
        }
        let set = option == wire::OPT_SET_META_CONTEXT;
        let matches =
            |q: &str| q == wire::BASE_ALLOCATION || (!set && (q == "base:" || q == "base"));
        let selected = if set {
            queries.contains(&wire::BASE_ALLOCATION)
        } else {
            queries.is_empty() || queries.iter().any(|q| matches(q))
        };
        if selected {
            let mut reply = wire::BASE_ALLOCATION_ID.to_be_bytes().to_vec();
            reply.extend_from_slice(wire::BASE_ALLOCATION.as_bytes());
            self.reply(option, wire::REP_META_CONTEXT, &reply)?;
        }
        if set {
            self.meta = Some((name.to_string(), selected));
        }
        self.reply(option, wire::REP_ACK, &[])
    }

    fn reply(&mut self, option: u32, kind: u32, payload: &[u8]) -> Result<(), ProtocolError> {
        Ok(self.stream.write_all(&wire::option_reply(option, kind, payload))?)
    }

    fn error(&mut self, option: u32, kind: u32, message: &str) -> Result<(), ProtocolError> {
        tracing::debug!(option, "nbd option refused: {message}");
        self.reply(option, kind, message.as_bytes())
    }
}
