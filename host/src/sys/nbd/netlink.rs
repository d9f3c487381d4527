//! The kernel nbd driver's generic netlink family, for the one command
//! `nbd-client` cannot send: `NBD_CMD_RECONFIGURE`. It hands a device
//! whose server ended the sockets of a new one (the kernel takes one for
//! each dead connection and sends the requests that waited down it), and
//! sets how long a device with every connection dead waits for that before
//! it fails its requests. Messages are built with the rust-netlink crates;
//! this module knows only the family's numbers (uapi `linux/nbd-netlink.h`).

use crate::sys::SysError;
use netlink_packet_core::{
    DecodeError, DefaultNla, Emitable, NLM_F_ACK, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload,
    NlasIterator, Parseable, ParseableParametrized,
};
use netlink_packet_generic::ctrl::nlas::GenlCtrlAttrs;
use netlink_packet_generic::ctrl::{GenlCtrl, GenlCtrlCmd};
use netlink_packet_generic::{GenlFamily, GenlHeader, GenlMessage};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_GENERIC};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

const FAMILY: &str = "nbd";
const VERSION: u8 = 1;
const CMD_RECONFIGURE: u8 = 3;
const ATTR_INDEX: u16 = 1;
const ATTR_SOCKETS: u16 = 7;
const ATTR_DEAD_CONN_TIMEOUT: u16 = 8;
const SOCK_ITEM: u16 = 1;
const SOCK_FD: u16 = 1;

/// How long the kernel may take to answer: it answers at once, so this
/// only bounds a wait that should never happen.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// What to change on a connected device.
#[derive(Default)]
pub struct Reconfigure<'a> {
    /// How long requests wait for a new connection once every connection
    /// died, before they fail.
    pub dead_conn_timeout: Option<Duration>,
    /// Negotiated connections to the export (in transmission), one for each
    /// dead connection; the kernel takes those it has a dead one for.
    pub sockets: Vec<BorrowedFd<'a>>,
}

/// An nbd command: its number and attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct NbdCommand {
    cmd: u8,
    nlas: Vec<DefaultNla>,
}

impl GenlFamily for NbdCommand {
    fn family_name() -> &'static str {
        FAMILY
    }
    fn command(&self) -> u8 {
        self.cmd
    }
    fn version(&self) -> u8 {
        VERSION
    }
}

impl Emitable for NbdCommand {
    fn buffer_len(&self) -> usize {
        self.nlas.as_slice().buffer_len()
    }
    fn emit(&self, buffer: &mut [u8]) {
        self.nlas.as_slice().emit(buffer);
    }
}

impl ParseableParametrized<[u8], GenlHeader> for NbdCommand {
    fn parse_with_param(buf: &[u8], header: GenlHeader) -> Result<Self, DecodeError> {
        let nlas = NlasIterator::new(buf)
            .map(|nla| nla.and_then(|nla| DefaultNla::parse(&nla)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(NbdCommand { cmd: header.cmd, nlas })
    }
}

/// Attributes nested in one.
fn nested(kind: u16, inner: &[DefaultNla]) -> DefaultNla {
    let mut value = vec![0; inner.buffer_len()];
    inner.emit(&mut value);
    DefaultNla::new(kind | netlink_packet_core::NLA_F_NESTED, value)
}

/// The reconfigure command for device `index`.
fn reconfigure_command(index: u32, change: &Reconfigure) -> NbdCommand {
    let mut nlas = vec![DefaultNla::new(ATTR_INDEX, index.to_ne_bytes().to_vec())];
    if let Some(t) = change.dead_conn_timeout {
        nlas.push(DefaultNla::new(
            ATTR_DEAD_CONN_TIMEOUT,
            t.as_secs().max(1).to_ne_bytes().to_vec(),
        ));
    }
    if !change.sockets.is_empty() {
        let items: Vec<DefaultNla> = change
            .sockets
            .iter()
            .map(|fd| {
                let fd = fd.as_raw_fd() as u32;
                nested(SOCK_ITEM, &[DefaultNla::new(SOCK_FD, fd.to_ne_bytes().to_vec())])
            })
            .collect();
        nlas.push(nested(ATTR_SOCKETS, &items));
    }
    NbdCommand { cmd: CMD_RECONFIGURE, nlas }
}

/// Send `change` for `/dev/nbd<index>`; the kernel's refusal is an error
/// naming the device.
pub fn reconfigure(index: u32, change: &Reconfigure) -> Result<(), SysError> {
    let device = PathBuf::from(format!("/dev/nbd{index}"));
    let link = Link::open(&device)?;
    let family = link.family_id(&device)?;
    let mut message = GenlMessage::from_payload(reconfigure_command(index, change));
    message.set_resolved_family_id(family);
    link.request(&device, message, |_: NbdCommand| {}).map_err(|e| match e {
        Failed::Kernel(errno) => SysError::Errno { op: "reconfigure", path: device.clone(), errno },
        Failed::Io(e) => e,
    })
}

enum Failed {
    Kernel(nix::errno::Errno),
    Io(SysError),
}

/// A generic netlink socket to the kernel.
struct Link {
    socket: Socket,
}

impl Link {
    fn open(device: &Path) -> Result<Link, SysError> {
        let failed = |e| SysError::Io { op: "netlink", path: device.to_path_buf(), source: e };
        let mut socket = Socket::new(NETLINK_GENERIC).map_err(failed)?;
        socket.bind_auto().map_err(failed)?;
        socket.connect(&SocketAddr::new(0, 0)).map_err(failed)?;
        let within = nix::sys::time::TimeVal::new(ANSWER_WITHIN.as_secs() as i64, 0);
        nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::ReceiveTimeout, &within)
            .map_err(|errno| SysError::Errno { op: "netlink timeout", path: device.into(), errno })?;
        Ok(Link { socket })
    }

    /// The id the kernel gave the nbd family (absent: no nbd driver).
    fn family_id(&self, device: &Path) -> Result<u16, SysError> {
        let ask = GenlMessage::from_payload(GenlCtrl {
            cmd: GenlCtrlCmd::GetFamily,
            nlas: vec![GenlCtrlAttrs::FamilyName(FAMILY.into())],
        });
        let mut id = None;
        self.request(device, ask, |answer: GenlCtrl| {
            for nla in answer.nlas {
                if let GenlCtrlAttrs::FamilyId(found) = nla {
                    id = Some(found);
                }
            }
        })
        .map_err(|e| match e {
            Failed::Kernel(errno) => {
                SysError::Errno { op: "find the nbd netlink family", path: device.into(), errno }
            }
            Failed::Io(e) => e,
        })?;
        id.ok_or_else(|| SysError::Refused {
            path: device.into(),
            what: "the kernel named no id for the nbd netlink family".into(),
        })
    }

    /// Send `message` and read the answers up to its acknowledgement,
    /// each one's payload to `answer`.
    fn request<F>(
        &self,
        device: &Path,
        message: GenlMessage<F>,
        mut answer: impl FnMut(F),
    ) -> Result<(), Failed>
    where
        F: GenlFamily + Emitable + ParseableParametrized<[u8], GenlHeader> + std::fmt::Debug,
    {
        let io = |op| move |e| Failed::Io(SysError::Io { op, path: device.into(), source: e });
        let mut message = NetlinkMessage::from(message);
        message.header.flags = NLM_F_REQUEST | NLM_F_ACK;
        message.header.sequence_number = 1;
        message.finalize();
        let mut out = vec![0; message.buffer_len()];
        message.serialize(&mut out);
        self.socket.send(&out, 0).map_err(io("netlink send"))?;
        loop {
            let (buf, _) = self.socket.recv_from_full().map_err(io("netlink receive"))?;
            let mut at = 0;
            while at < buf.len() {
                let answer_msg = NetlinkMessage::<GenlMessage<F>>::deserialize(&buf[at..])
                    .map_err(|e| {
                        io("netlink parse")(std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            e.to_string(),
                        ))
                    })?;
                let length = answer_msg.header.length as usize;
                match answer_msg.payload {
                    NetlinkPayload::Error(e) => {
                        return match e.code {
                            None => Ok(()),
                            Some(code) => {
                                Err(Failed::Kernel(nix::errno::Errno::from_raw(code.get().abs())))
                            }
                        };
                    }
                    NetlinkPayload::InnerMessage(m) => answer(m.payload),
                    _ => {}
                }
                if length == 0 {
                    break;
                }
                at += (length + 3) & !3;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use netlink_packet_core::NlaBuffer;

    /// Attributes as the kernel would read them back: kind and value.
    fn attributes(bytes: &[u8]) -> Vec<(u16, Vec<u8>)> {
        NlasIterator::new(bytes)
            .map(|n| {
                let n: NlaBuffer<&[u8]> = n.unwrap();
                (n.kind(), n.value().to_vec())
            })
            .collect()
    }

    #[test]
    fn a_reconfigure_names_the_device_its_timeout_and_each_socket_in_an_item() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let change = Reconfigure {
            dead_conn_timeout: Some(Duration::from_secs(30)),
            sockets: vec![std::os::fd::AsFd::as_fd(&a), std::os::fd::AsFd::as_fd(&b)],
        };
        let command = reconfigure_command(3, &change);
        assert_eq!(command.cmd, CMD_RECONFIGURE);
        let mut bytes = vec![0; command.buffer_len()];
        command.emit(&mut bytes);
        let top = attributes(&bytes);
        assert_eq!(top[0], (ATTR_INDEX, 3u32.to_ne_bytes().to_vec()));
        assert_eq!(top[1], (ATTR_DEAD_CONN_TIMEOUT, 30u64.to_ne_bytes().to_vec()));
        assert_eq!(top[2].0, ATTR_SOCKETS);
        let items = attributes(&top[2].1);
        let fds: Vec<u32> = items
            .iter()
            .map(|(kind, value)| {
                assert_eq!(*kind, SOCK_ITEM);
                let inner = attributes(value);
                assert_eq!(inner.len(), 1);
                assert_eq!(inner[0].0, SOCK_FD);
                u32::from_ne_bytes(inner[0].1.clone().try_into().unwrap())
            })
            .collect();
        assert_eq!(fds, [a.as_raw_fd() as u32, b.as_raw_fd() as u32]);
    }

    #[test]
    fn without_sockets_or_timeout_only_the_device_is_named() {
        let command = reconfigure_command(0, &Reconfigure::default());
        let mut bytes = vec![0; command.buffer_len()];
        command.emit(&mut bytes);
        assert_eq!(attributes(&bytes), [(ATTR_INDEX, 0u32.to_ne_bytes().to_vec())]);
    }
}
