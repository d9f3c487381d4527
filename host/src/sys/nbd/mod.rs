//! The node's NBD machinery, one module per mechanism: the kernel's nbd
//! devices ([`kernel`]), userspace FUSE clients ([`fuse`]: nbdfuse, and
//! the process handling rbd-fuse shares with it), and the agent's own
//! helper servers ([`helpers`]); [`files`] is where they all keep their
//! files, beneath one dir of the agent's state.

pub mod files;
pub mod fuse;
pub mod fuse_file;
pub mod helpers;
pub mod keeper;
pub mod kernel;
pub mod lost_requests;
pub mod netlink;

/// `server` ("unix:/path" or "host:port") and `export` as an NBD URI.
pub fn uri(server: &str, export: &str) -> String {
    let export = percent_encode(export);
    match server.strip_prefix("unix:") {
        Some(socket) => format!("nbd+unix:///{export}?socket={}", percent_encode(socket)),
        None => format!("nbd://{server}/{export}"),
    }
}

fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_encode_what_they_must() {
        assert_eq!(uri("unix:/run/nbd.sock", "disk0"), "nbd+unix:///disk0?socket=/run/nbd.sock");
        assert_eq!(uri("unix:/run/a b.sock", "x?y"), "nbd+unix:///x%3Fy?socket=/run/a%20b.sock");
        assert_eq!(uri("10.0.0.5:10809", ""), "nbd://10.0.0.5:10809/");
    }
}
