//! The `volagent` binary: CLI wiring only.

use clap::Parser;
use std::process::ExitCode;

// A call allocates and frees hundreds of small buffers (HTTP/2 frames,
// headers, plans, records): glibc's malloc and free were 7% of a CSI
// thread's time in user space.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

// The allocator's options, set before the first allocation reserves its
// first arena (Rust's runtime allocates before main): a constructor of
// priority 200, before those of none. mimalloc's own start-up may run
// before or after it (its priority depends on the C compiler): it keeps
// options set before it.
#[used]
#[allow(unsafe_code)]
#[unsafe(link_section = ".init_array.00200")]
static CONFIGURE_ALLOCATOR: extern "C" fn() = configure_allocator;

extern "C" fn configure_allocator() {
    volagent::sys::memory::configure_allocator();
}

fn main() -> ExitCode {
    let cli = volagent::cli::Cli::parse();
    if let Some(code) = volagent::init::supervise_if_pid1() {
        return code;
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| cli.default_log_filter().into());
    let logs = tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter(filter);
    // One JSON object per line for log collectors in a cluster; text for people.
    if cli.json_logs() {
        logs.json().flatten_event(true).init();
    } else {
        logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init();
    }
    match volagent::cli::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("volagent: {e:#}");
            ExitCode::from(2)
        }
    }
}
