//! NFS mounts through the system's `mount.nfs` (nfs-common). mount(2)
//! could mount NFS directly, but only with what the helper works out first:
//! the server's numeric address (`addr=`), the client's, and for version 3
//! the mount daemon's port and a lock daemon. The helper runs with a
//! deadline and `retry=0` (one attempt, not two minutes of them); a mount
//! left by an attempt that failed or ran out of time is detached, so a
//! wrong or unreachable server leaves nothing mounted.

use super::SysError;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// The helper (nfs-common), by the filesystem type it mounts: it takes
/// the version from its own name (mount.nfs4), not from an argument.
const HELPERS: &[(&str, &str)] = &[("nfs", "mount.nfs"), ("nfs4", "mount.nfs4")];

/// The filesystem types it mounts.
pub const FS_TYPES: &[&str] = &["nfs", "nfs4"];

/// Where Debian installs the helpers: the agent's PATH may not name /sbin.
const HELPER_DIRS: &[&str] = &["/sbin", "/usr/sbin"];

/// Options the host sets on every NFS mount, after the plan's: no set-uid
/// programs or device nodes from a server, and one attempt only.
const ENFORCED: &[&str] = &["nosuid", "nodev", "retry=0"];

/// A checked NFS source: "host:/path", the host a name, an IPv4 address
/// or a bracketed IPv6 one, the path absolute and plain.
fn check_source(source: &str, target: &Path) -> Result<(), SysError> {
    let refused = || SysError::Refused {
        path: target.to_path_buf(),
        what: format!("nfs source {source:?} is not host:/path"),
    };
    let (host, path) = match source.strip_prefix('[') {
        Some(rest) => {
            let (v6, path) = rest.split_once("]:").ok_or_else(refused)?;
            v6.parse::<std::net::Ipv6Addr>().map_err(|_| refused())?;
            (v6, path)
        }
        None => source.split_once(':').ok_or_else(refused)?,
    };
    let host_ok = !host.is_empty()
        && host.len() <= 253
        && !host.starts_with('-')
        && host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.:".contains(&b));
    let path_ok = path.starts_with('/')
        && path.len() <= 1024
        && path.bytes().all(|b| b.is_ascii_alphanumeric() || b"/-_.~+@=".contains(&b))
        && !path.split('/').any(|part| part == "..");
    if host_ok && path_ok { Ok(()) } else { Err(refused()) }
}

/// The options the helper is given: the plan's, then the enforced ones,
/// and `ro` for a read-only mount.
fn helper_options(options: &str, read_only: bool) -> String {
    let mut all: Vec<&str> = options.split(',').filter(|o| !o.is_empty()).collect();
    all.extend(ENFORCED);
    if read_only {
        all.push("ro");
    }
    all.join(",")
}

/// The helper for `fs_type`: its name, and its path where installed.
fn helper(fs_type: &str) -> (&'static str, std::path::PathBuf) {
    let name = HELPERS.iter().find(|(t, _)| *t == fs_type).map_or("mount.nfs", |(_, h)| *h);
    let path = HELPER_DIRS
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| name.into());
    (name, path)
}

/// Mount NFS export `source` ("host:/path") at `target` (an existing dir
/// the caller resolved beneath its roots) with `options` (checked against
/// the plan allow-list), through the helper, within `deadline`.
pub fn mount(
    source: &str,
    target: &Path,
    fs_type: &str,
    options: &str,
    read_only: bool,
    deadline: Duration,
) -> Result<(), SysError> {
    check_source(source, target)?;
    let (program, path) = helper(fs_type);
    let options = helper_options(options, read_only);
    let mut cmd = Command::new("setpriv");
    // -n: the mount table is the kernel's; nothing is written to /etc.
    cmd.args(["--pdeathsig", "KILL", "--"]).arg(path).arg(source).arg(target);
    cmd.args(["-n", "-o", &options]);
    let nfs = |fs: &str| FS_TYPES.contains(&fs);
    let context = format!(" (server {source})");
    let result = super::mount_helper::run(&mut cmd, program, target, deadline, nfs, &context);
    if result.is_err() {
        super::mount_helper::detach_left(target);
    }
    result.map_err(|e| match e {
        SysError::Timeout { secs, .. } => SysError::Command {
            program,
            path: target.to_path_buf(),
            message: format!("no answer from server {source} within {secs} s; stopped"),
        },
        e => e,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_host_colon_absolute_path() {
        let t = Path::new("/t");
        for ok in [
            "nfs1:/exports/a",
            "10.0.0.5:/",
            "[fe80::1]:/srv/nfs",
            "nfs.example.com:/data_1/v-2",
            "127.0.0.1:/home/~user",
        ] {
            assert!(check_source(ok, t).is_ok(), "{ok}");
        }
        for bad in [
            "nfs1:exports",
            "-o:/x",
            ":/x",
            "nfs1",
            "nfs1:/a/../etc",
            "nfs1:/a,ro",
            "nfs1:/a b",
            "nfs1 x:/a",
            "[fe80::1:/x",
            "[nothost]:/x",
            "nfs1:/a\n",
        ] {
            assert!(check_source(bad, t).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_host_sets_its_options_after_the_plans() {
        assert_eq!(helper_options("vers=4.2,hard", false), "vers=4.2,hard,nosuid,nodev,retry=0");
        assert_eq!(helper_options("", true), "nosuid,nodev,retry=0,ro");
    }
}
