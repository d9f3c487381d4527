//! Running a network filesystem's mount helper (`mount.glusterfs`,
//! `mount.nfs`) on a path: with a deadline, and counted as mounted only when
//! the kernel's mount table shows the mount, not on the helper's word.

use super::SysError;
use super::launch::{Launch, Launcher, Output};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Run `cmd` (helper `program`, mounting at `target`) within `deadline`.
/// It succeeded when it exited 0 and the mount table has a mount at
/// `target` whose type `is_type` accepts; otherwise the error quotes its
/// exit status, `context` (e.g. the server) and what it printed.
pub fn run(
    cmd: &mut Command,
    program: &'static str,
    target: &Path,
    deadline: Duration,
    is_type: impl Fn(&str) -> bool,
    context: &str,
) -> Result<(), SysError> {
    cmd.stdout(std::process::Stdio::piped());
    let out = super::tool::run_with(cmd, program, target, deadline)?;
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let out =
        Output { exit: out.status.into(), stdout: text(&out.stdout), stderr: text(&out.stderr) };
    judge(out, program, target, is_type, context)
}

/// [`run`], the helper started by `launcher` (the node's mounter, for a
/// FUSE client that must outlive the agent).
pub fn launch(
    launcher: &dyn Launcher,
    launch: Launch,
    target: &Path,
    deadline: Duration,
    is_type: impl Fn(&str) -> bool,
    context: &str,
) -> Result<(), SysError> {
    let program = launch.program.name();
    let out = launcher.run(launch, deadline)?;
    judge(out, program, target, is_type, context)
}

fn judge(
    out: Output,
    program: &'static str,
    target: &Path,
    is_type: impl Fn(&str) -> bool,
    context: &str,
) -> Result<(), SysError> {
    let mounted =
        super::mountinfo::own()?.iter().any(|m| m.mount_point == target && is_type(&m.fs_type));
    if out.exit.success && mounted {
        return Ok(());
    }
    let said = format!("{} {}", out.stdout.trim(), out.stderr.trim());
    Err(SysError::Command {
        program,
        path: target.to_path_buf(),
        message: format!("{}{context}: {}", out.exit, said.trim()),
    })
}

/// Detach (lazily) whatever a failed attempt left mounted at `target`.
pub fn detach_left(target: &Path) {
    let mounted = super::mountinfo::own().is_ok_and(|t| t.iter().any(|m| m.mount_point == target));
    if mounted {
        let _ = nix::mount::umount2(target, nix::mount::MntFlags::MNT_DETACH);
    }
}
