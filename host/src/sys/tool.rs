//! Running a node tool (mkfs, blkid, wipefs, nbd-client, glusterfs) on a
//! device or mount point: under a deadline, off the async workers, dying
//! with the agent, its output kept for the error.

use super::SysError;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Run `program` with `args` on `device`, killed after `deadline`, and
/// with the agent (setpriv --pdeathsig): a tool of a killed agent (mkfs,
/// wipefs) would hold the device open exclusively while the next agent
/// retries the same step, and be refused as in use. Its output is captured
/// and only shown when it fails.
pub fn run(
    program: &'static str,
    args: &[&str],
    device: &Path,
    deadline: Duration,
) -> Result<std::process::Output, SysError> {
    let mut cmd = Command::new("setpriv");
    cmd.args(["--pdeathsig", "KILL", "--", program]).args(args).arg(device).stdout(Stdio::piped());
    run_with(&mut cmd, program, device, deadline)
}

pub fn run_with(
    cmd: &mut Command,
    program: &'static str,
    device: &Path,
    deadline: Duration,
) -> Result<std::process::Output, SysError> {
    // A tool can run for seconds (mkfs of a big device): not on a worker.
    crate::workers::may_take_long(|| run_until(cmd, program, device, deadline))
}

fn run_until(
    cmd: &mut Command,
    program: &'static str,
    device: &Path,
    deadline: Duration,
) -> Result<std::process::Output, SysError> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| SysError::Io { op: program, path: device.to_path_buf(), source })?;
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if start.elapsed() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(SysError::Timeout {
                    program,
                    path: device.to_path_buf(),
                    secs: deadline.as_secs(),
                });
            }
            Err(source) => {
                return Err(SysError::Io { op: program, path: device.to_path_buf(), source });
            }
        }
    }
    // The pipes are small and the tools quiet; reading after exit is fine.
    child.wait_with_output().map_err(|source| SysError::Io {
        op: program,
        path: device.to_path_buf(),
        source,
    })
}

pub fn check(
    program: &'static str,
    device: &Path,
    out: std::process::Output,
) -> Result<std::process::Output, SysError> {
    if out.status.success() {
        return Ok(out);
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    Err(SysError::Command {
        program,
        path: device.to_path_buf(),
        message: format!("{}: {}", out.status, stderr.trim()),
    })
}
