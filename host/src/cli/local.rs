//! `volagent local discover`: what the agent would publish as this node's
//! local volumes, scanned now — for an admin checking a discovery dir.

use crate::local::{LocalClass, discovery, pv_name, quantity};
use std::process::ExitCode;

#[derive(Debug, clap::Subcommand)]
pub enum LocalCommand {
    /// Scan the classes' discovery dirs and print the volumes found (with
    /// the PV name each gets) and the entries skipped, as JSON.
    Discover {
        /// A local storage class and its discovery dirs:
        /// `<class>=<dir>[:<dir>…]`; repeat for more classes.
        #[arg(long = "class", required = true)]
        classes: Vec<LocalClass>,
        /// The node the PV names are for.
        #[arg(long, env = "NODE_NAME")]
        node_name: String,
    },
}

pub fn run(command: LocalCommand) -> anyhow::Result<ExitCode> {
    let LocalCommand::Discover { classes, node_name } = command;
    let table = crate::sys::mountinfo::parse(&std::fs::read_to_string("/proc/self/mountinfo")?)?;
    let started = std::time::Instant::now();
    let scan = discovery::scan(&crate::sys::inspect::Node, &classes, &table);
    let took = started.elapsed();
    let volumes: Vec<serde_json::Value> = scan
        .volumes
        .iter()
        .map(|v| {
            let mut j = serde_json::to_value(v).unwrap_or_default();
            j["pvName"] = pv_name(&node_name, &v.class, &v.path).into();
            j["capacity"] = quantity(v.capacity_bytes).into();
            j
        })
        .collect();
    let out = serde_json::json!({ "node": node_name, "volumes": volumes, "skipped": scan.skipped, "scanMicros": took.as_micros() as u64 });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(ExitCode::SUCCESS)
}
