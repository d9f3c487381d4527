//! GlusterFS mounts: there is no kernel filesystem to mount(2), so the
//! system's `mount.glusterfs` starts the FUSE client (a daemon that then
//! serves the mount) and waits for it. It runs with a deadline; a client
//! left behind by a mount that failed or ran out of time is stopped, so a
//! wrong or unreachable server leaves nothing mounted or running. A failed
//! mount's error quotes the end of the client's log.

use super::launch::{Launch, Launcher, Program};
use super::{SysError, io};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A checked gluster source: "host:/volume", or "host:/volume/subdir"
/// for a directory beneath the volume's root (names of letters, digits,
/// '-', '_' and '.', none starting with '.': never out of the volume).
fn check_source(source: &str, target: &Path) -> Result<(), SysError> {
    let refused = |what: String| SysError::Refused { path: target.to_path_buf(), what };
    let (host, path) = source.split_once(":/").ok_or_else(|| {
        refused(format!("gluster source {source:?} is not host:/volume[/subdir]"))
    })?;
    let (volume, subdir) = match path.split_once('/') {
        Some((volume, subdir)) => (volume, Some(subdir)),
        None => (path, None),
    };
    let subdir_ok = subdir.is_none_or(|subdir| {
        subdir.len() <= 1024
            && subdir.split('/').all(|n| {
                !n.is_empty()
                    && !n.starts_with('.')
                    && n.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            })
    });
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !host.is_empty()
                && host.len() <= 253
                && !host.starts_with('-')
                && host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.".contains(&b))
        }
    };
    let volume_ok = !volume.is_empty()
        && volume.len() <= 255
        && volume.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if host_ok && volume_ok && subdir_ok {
        Ok(())
    } else {
        Err(refused(format!("gluster source {source:?} is not host:/volume[/subdir]")))
    }
}

/// The `log-file=` among `options`.
fn log_file(options: &str) -> Option<PathBuf> {
    options.split(',').find_map(|o| o.strip_prefix("log-file=")).map(PathBuf::from)
}

/// `options` without `auto_unmount`, for clients that do not know it.
fn without_auto_unmount(options: &str) -> Option<String> {
    let kept: Vec<&str> = options.split(',').filter(|o| *o != "auto_unmount").collect();
    (kept.len() != options.split(',').count()).then(|| kept.join(","))
}

/// The last `n` error lines of `file` (gluster marks them "] E ["), or
/// its last `n` lines when it has none; at most its last 64 KiB are read.
pub(super) fn tail(file: &Path, n: usize) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(file) else { return String::new() };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut text = String::new();
    let _ = f.read_to_string(&mut text);
    let errors: Vec<&str> = text.lines().filter(|l| l.contains("] E [")).collect();
    let chosen: Vec<&str> = if errors.is_empty() {
        text.lines().filter(|l| !l.trim().is_empty()).collect()
    } else {
        errors
    };
    let lines: Vec<&str> = chosen.into_iter().rev().take(n).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// The pids of glusterfs clients serving (or trying to serve) `target`.
fn clients_of(target: &Path) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| {
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { return false };
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).filter(|a| !a.is_empty()).collect();
            let argv0 = args.first().map(|a| {
                Path::new(std::str::from_utf8(a).unwrap_or_default())
                    .file_name()
                    .is_some_and(|n| n == "glusterfs")
            });
            argv0 == Some(true)
                && args.last().is_some_and(|a| *a == target.as_os_str().as_encoded_bytes())
        })
        .collect()
}

/// Stop what a failed mount left: its mount (lazily) and its client.
fn clean_up(target: &Path) {
    super::mount_helper::detach_left(target);
    for pid in clients_of(target) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Mount gluster volume `source` ("host:/volume") at `target` (an existing
/// dir the caller resolved beneath its roots) with `options`, through the
/// helper, within `deadline`. Retried once without `auto_unmount` when the
/// client refuses that option.
pub fn mount(
    launcher: &dyn Launcher,
    source: &str,
    target: &Path,
    options: &str,
    read_only: bool,
    deadline: Duration,
) -> Result<(), SysError> {
    check_source(source, target)?;
    let mut options = options.to_string();
    if read_only {
        options = if options.is_empty() { "ro".into() } else { format!("{options},ro") };
    }
    let log = log_file(&options);
    if let Some(dir) = log.as_ref().and_then(|l| l.parent()) {
        std::fs::create_dir_all(dir).map_err(io("mkdir", dir))?;
    }
    match attempt(launcher, source, target, &options, log.as_deref(), deadline) {
        Err(SysError::Command { message, .. })
            if message.contains("auto_unmount") && without_auto_unmount(&options).is_some() =>
        {
            tracing::warn!(target = %target.display(), "this glusterfs client does not take auto_unmount; mounting without it");
            let options = without_auto_unmount(&options).unwrap_or_default();
            attempt(launcher, source, target, &options, log.as_deref(), deadline)
        }
        other => other,
    }
}

fn attempt(
    launcher: &dyn Launcher,
    source: &str,
    target: &Path,
    options: &str,
    log: Option<&Path>,
    deadline: Duration,
) -> Result<(), SysError> {
    // Its FUSE client must outlive the agent: started by the launcher.
    let mut launch = Launch::new(Program::MountGlusterfs, target).arg(source).arg(target);
    if !options.is_empty() {
        launch = launch.arg("-o").arg(options);
    }
    let fuse = |fs: &str| fs.starts_with("fuse");
    match super::mount_helper::launch(launcher, launch, target, deadline, fuse, "") {
        Ok(()) => Ok(()),
        Err(e) => {
            clean_up(target);
            // The helper says little ("Mount failed"); the client's log says why.
            let why = log.map(|l| tail(l, 5)).filter(|t| !t.is_empty());
            Err(match (e, why) {
                (SysError::Command { program, path, message }, Some(why)) => SysError::Command {
                    program,
                    path,
                    message: format!("{message}; the client's log ends: {why}"),
                },
                (SysError::Timeout { program, path, secs }, Some(why)) => SysError::Command {
                    program,
                    path,
                    message: format!(
                        "no mount within {secs} s, stopped; the client's log ends: {why}"
                    ),
                },
                (e, _) => e,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_host_colon_slash_volume() {
        let t = Path::new("/t");
        for ok in [
            "g1:/gv0",
            "10.0.0.5:/v-1",
            "[fe80::1]:/v0",
            "gluster.example.com:/data_1",
            "g1:/gv0/volagent/pvc-1",
            "g1:/gv0/a_b/c.d",
        ] {
            assert!(check_source(ok, t).is_ok(), "{ok}");
        }
        for bad in [
            "g1:gv0",
            "-o:/x",
            "g1:/",
            ":/v0",
            "g1 x:/v",
            "g1:/v,ro",
            "g1:/v/",
            "g1:/v/../x",
            "g1:/v/a//b",
            "g1:/v/.x",
            "g1:/v/a b",
            "g1:/v/a,ro",
        ] {
            assert!(check_source(bad, t).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_logs_errors_are_quoted_before_its_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("g.log");
        std::fs::write(&log, "[t] I [a] starting\n[t] E [name.c:1] 0-resolver: DNS resolution failed on host nosuch\n[t] W [b] shutting down\n").unwrap();
        assert_eq!(
            tail(&log, 5),
            "[t] E [name.c:1] 0-resolver: DNS resolution failed on host nosuch"
        );
        std::fs::write(&log, "[t] I [a] one\n\n[t] W [b] two\n").unwrap();
        assert_eq!(tail(&log, 5), "[t] I [a] one | [t] W [b] two");
        assert_eq!(tail(&dir.path().join("none"), 5), "");
    }

    #[test]
    fn options_for_the_helper() {
        assert_eq!(
            log_file("auto_unmount,log-file=/s/v/glusterfs.log"),
            Some(PathBuf::from("/s/v/glusterfs.log"))
        );
        assert_eq!(log_file("auto_unmount"), None);
        assert_eq!(
            without_auto_unmount("backup-volfile-servers=a:b,auto_unmount,log-file=/l").as_deref(),
            Some("backup-volfile-servers=a:b,log-file=/l")
        );
        assert_eq!(without_auto_unmount("log-file=/l"), None);
    }
}
