//! Starting the processes a mounted volume needs for as long as it is
//! mounted — userspace NBD clients, the agent's helper NBD servers,
//! rbd-fuse, the GlusterFS client — through one seam: here in the agent's
//! own process ([`Local`], standalone), or in the node's mounter
//! ([`remote::Remote`], `volagent mounter`), a process of its own pod that
//! outlives the agent's, so that replacing the agent's pod kills nothing a
//! volume needs.
//!
//! What may be started is a short list ([`Program`]), never a path: the
//! mounter runs only its own binary's `nbd fuse` / `nbd serve`, rbd-fuse
//! and mount.glusterfs.

pub mod remote;
pub mod wire;

use super::SysError;
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The programs a launcher starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Program {
    /// This binary (the launcher's own): `nbd fuse` or `nbd serve` only.
    #[serde(rename = "volagent")]
    Volagent,
    #[serde(rename = "rbd-fuse")]
    RbdFuse,
    #[serde(rename = "mount.glusterfs")]
    MountGlusterfs,
}

impl Program {
    /// How errors name it.
    pub fn name(self) -> &'static str {
        match self {
            Program::Volagent => "volagent",
            Program::RbdFuse => "rbd-fuse",
            Program::MountGlusterfs => "mount.glusterfs",
        }
    }
}

/// Environment variables a launch may set (rbd-fuse takes its Ceph
/// arguments only there).
pub const ALLOWED_ENV: [&str; 1] = ["CEPH_ARGS"];
/// Bounds on a launch: argument count and each argument's bytes.
pub const MAX_ARGS: usize = 64;
pub const MAX_ARG_BYTES: usize = 4096;

/// What to start: a program, its arguments and environment, and the
/// files its standard input, output and error are (`/dev/null` if none).
#[derive(Debug)]
pub struct Launch {
    pub program: Program,
    /// As given: a path that is not UTF-8 is passed on exactly here, and
    /// refused by name where the mounter's protocol (JSON) cannot carry it.
    pub args: Vec<OsString>,
    pub env: Vec<(String, String)>,
    pub stdin: Option<std::fs::File>,
    pub stdout: Option<std::fs::File>,
    pub stderr: Option<std::fs::File>,
    /// What the process is for (a mount dir, a socket): errors name it.
    pub path: PathBuf,
}

impl Launch {
    pub fn new(program: Program, path: &Path) -> Launch {
        Launch {
            program,
            args: Vec::new(),
            env: Vec::new(),
            stdin: None,
            stdout: None,
            stderr: None,
            path: path.to_path_buf(),
        }
    }

    pub fn arg(mut self, arg: impl AsRef<std::ffi::OsStr>) -> Launch {
        self.args.push(arg.as_ref().to_os_string());
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: AsRef<std::ffi::OsStr>>(mut self, args: I) -> Launch {
        for a in args {
            self = self.arg(a);
        }
        self
    }

    /// Standard output and error both to `log`.
    pub fn log_to(mut self, log: std::fs::File) -> Result<Launch, SysError> {
        self.stdout = Some(log.try_clone().map_err(super::io("dup", &self.path))?);
        self.stderr = Some(log);
        Ok(self)
    }

    /// Whether the launch stays within what any launcher starts: the
    /// program's own subcommands, the bounds, the environment's names.
    pub fn check(&self) -> Result<(), String> {
        if self.args.len() > MAX_ARGS {
            return Err(format!("{} arguments, more than {MAX_ARGS}", self.args.len()));
        }
        if let Some(a) = self.args.iter().find(|a| {
            let bytes = a.as_encoded_bytes();
            bytes.len() > MAX_ARG_BYTES || bytes.contains(&0)
        }) {
            return Err(format!("an argument of {} bytes or with a NUL", a.len()));
        }
        if let Some((k, _)) = self.env.iter().find(|(k, _)| !ALLOWED_ENV.contains(&k.as_str())) {
            return Err(format!("environment variable {k:?} is not one a launch may set"));
        }
        if self.env.iter().any(|(_, v)| v.len() > MAX_ARG_BYTES || v.contains('\0')) {
            return Err("an environment value too long or with a NUL".into());
        }
        let sub: Vec<&std::ffi::OsStr> =
            self.args.iter().take(2).map(OsString::as_os_str).collect();
        if self.program == Program::Volagent && sub != ["nbd", "fuse"] && sub != ["nbd", "serve"] {
            let named: Vec<_> = sub.iter().map(|s| s.to_string_lossy()).collect();
            return Err(format!(
                "volagent {} is not a subcommand a launch may run",
                named.join(" ")
            ));
        }
        Ok(())
    }

    /// The command for this launch, run from `volagent` (this binary, or
    /// the mounter's): in its own process group, so that signals to the
    /// launcher's group (Ctrl-C, a supervisor stopping it) do not reach it.
    pub fn command(self, volagent: &Path) -> Command {
        let mut cmd = match self.program {
            Program::Volagent => Command::new(volagent),
            other => Command::new(other.name()),
        };
        cmd.args(&self.args).envs(self.env).current_dir("/").process_group(0);
        let stdio = |f: Option<std::fs::File>| f.map(Stdio::from).unwrap_or_else(Stdio::null);
        cmd.stdin(stdio(self.stdin)).stdout(stdio(self.stdout)).stderr(stdio(self.stderr));
        cmd
    }
}

/// How a process ended, as the error that quotes it says it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Exit {
    pub success: bool,
    pub status: String,
}

impl From<std::process::ExitStatus> for Exit {
    fn from(s: std::process::ExitStatus) -> Exit {
        Exit { success: s.success(), status: s.to_string() }
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.status)
    }
}

/// What a run to completion printed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Output {
    pub exit: Exit,
    pub stdout: String,
    pub stderr: String,
}

/// The most of a run's output kept, per stream.
pub const MAX_OUTPUT: usize = 16 * 1024;

/// A started process, while its starter waits for it to be ready.
pub trait Spawned: Send {
    fn pid(&self) -> u32;
    /// How it ended, if it has.
    fn try_wait(&mut self) -> Result<Option<Exit>, SysError>;
    /// Kill it (SIGKILL) and reap it.
    fn kill(&mut self);
    /// It runs on, serving; whoever started it reaps it when it ends.
    fn keep(self: Box<Self>);
}

/// Where the processes volumes need are started.
pub trait Launcher: Send + Sync + std::fmt::Debug {
    /// Start `launch`, and return as soon as it runs.
    fn spawn(&self, launch: Launch) -> Result<Box<dyn Spawned>, SysError>;
    /// Run `launch` to its end (a mount helper), killed after `deadline`;
    /// its output, at most [`MAX_OUTPUT`] of each stream.
    fn run(&self, launch: Launch, deadline: Duration) -> Result<Output, SysError>;
}

/// Processes started by this process, as children of its own.
#[derive(Debug)]
pub struct Local {
    volagent: PathBuf,
}

impl Default for Local {
    fn default() -> Local {
        Local { volagent: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("volagent")) }
    }
}

impl Local {
    /// The binary `Program::Volagent` runs.
    pub fn volagent(&self) -> &Path {
        &self.volagent
    }
}

struct LocalChild(std::process::Child);

impl Spawned for LocalChild {
    fn pid(&self) -> u32 {
        self.0.id()
    }

    fn try_wait(&mut self) -> Result<Option<Exit>, SysError> {
        self.0
            .try_wait()
            .map(|s| s.map(Exit::from))
            .map_err(super::io("wait for", Path::new("a child")))
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    fn keep(self: Box<Self>) {
        let mut child = self.0;
        // Reaped when it ends, while this process runs.
        std::thread::spawn(move || drop(child.wait()));
    }
}

impl Launcher for Local {
    fn spawn(&self, launch: Launch) -> Result<Box<dyn Spawned>, SysError> {
        let (program, path) = (launch.program.name(), launch.path.clone());
        launch.check().map_err(|what| SysError::Refused { path: path.clone(), what })?;
        let child = launch.command(&self.volagent).spawn().map_err(|source| SysError::Io {
            op: program,
            path,
            source,
        })?;
        Ok(Box::new(LocalChild(child)))
    }

    fn run(&self, launch: Launch, deadline: Duration) -> Result<Output, SysError> {
        let (program, path) = (launch.program.name(), launch.path.clone());
        launch.check().map_err(|what| SysError::Refused { path: path.clone(), what })?;
        run_to_end(launch.command(&self.volagent), program, &path, deadline)
    }
}

/// Run `cmd` with its output piped, killed after `deadline`.
pub fn run_to_end(
    mut cmd: Command,
    program: &'static str,
    path: &Path,
    deadline: Duration,
) -> Result<Output, SysError> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = super::tool::run_with(&mut cmd, program, path, deadline)?;
    let text = |b: &[u8]| {
        let b = &b[..b.len().min(MAX_OUTPUT)];
        String::from_utf8_lossy(b).into_owned()
    };
    Ok(Output { exit: out.status.into(), stdout: text(&out.stdout), stderr: text(&out.stderr) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_stay_within_their_programs_subcommands_and_bounds() {
        let p = Path::new("/x");
        let ok = Launch::new(Program::Volagent, p).args(["nbd", "fuse", "--server", "unix:/s"]);
        assert_eq!(ok.check(), Ok(()));
        let ok = Launch::new(Program::Volagent, p).args(["nbd", "serve"]);
        assert_eq!(ok.check(), Ok(()));
        for bad in [vec!["agent"], vec!["nbd"], vec!["plugin", "test"], vec![]] {
            let l = Launch::new(Program::Volagent, p).args(bad.clone());
            assert!(l.check().is_err(), "{bad:?}");
        }
        let mut env = Launch::new(Program::RbdFuse, p);
        env.env.push(("LD_PRELOAD".into(), "/tmp/x.so".into()));
        assert!(env.check().unwrap_err().contains("LD_PRELOAD"));
        let many = Launch::new(Program::RbdFuse, p).args(vec!["x"; MAX_ARGS + 1]);
        assert!(many.check().is_err());
        let long = Launch::new(Program::RbdFuse, p).arg("y".repeat(MAX_ARG_BYTES + 1));
        assert!(long.check().is_err());
    }
}
