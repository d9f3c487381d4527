//! `volagent mounter`: run the node's mounter, or ask the running one who
//! it is.

use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct MounterArgs {
    /// The root-only socket agents ask on (`volagent agent --mounter`).
    #[arg(long, default_value = "/run/volagent/mounter.sock")]
    socket: PathBuf,
    /// Ask the mounter on the socket who it is, print it, and exit 1 if it
    /// does not answer (a readiness probe), instead of serving.
    #[arg(long)]
    check: bool,
}

pub fn run(args: MounterArgs) -> anyhow::Result<ExitCode> {
    if args.check {
        let remote = crate::sys::launch::remote::Remote::new(args.socket);
        return Ok(match remote.hello() {
            Ok(m) => {
                println!(
                    "volagent mounter {} (protocol {}), pid {}, {} processes running",
                    m.version, m.protocol, m.pid, m.running
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("volagent: {e}");
                ExitCode::FAILURE
            }
        });
    }
    let volagent = std::env::current_exe()?;
    crate::mounter::Mounter::new(volagent).serve(&args.socket)?;
    Ok(ExitCode::SUCCESS)
}
