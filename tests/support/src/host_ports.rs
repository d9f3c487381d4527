//! TCP ports of the host's loopback, reached from a node's network
//! namespace at the same address. The run's Ceph and GlusterFS listen on
//! the host's 127.0.0.1, and a DaemonSet node's pods (hostNetwork) live in
//! the node's own network namespace: for each port a thread accepts there
//! and connects in the host's namespace, copying both ways. The addresses
//! the cluster hands out (a monitor's, an OSD's, a brick's) are then the
//! same on both sides.

use anyhow::{Context as _, bail};
use std::fs::File;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsFd as _;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Join the network namespace `net` on the calling thread.
fn enter(net: &File) -> anyhow::Result<()> {
    nix::sched::setns(net.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
        .context("setns into a network namespace")
}

/// The TCP ports on 127.0.0.1 that processes whose name is one of
/// `programs` listen on, in the network namespace `net` (`ss`).
pub fn listening(net: &File, programs: &[&str]) -> anyhow::Result<Vec<u16>> {
    let net = net.try_clone()?;
    let out = std::thread::spawn(move || {
        enter(&net)?;
        Command::new("ss").args(["-Hltnp"]).output().context("ss (iproute2)")
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the ss thread panicked"))??;
    if !out.status.success() {
        bail!("ss: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut ports: Vec<u16> = text
        .lines()
        .filter(|l| programs.iter().any(|p| l.contains(&format!("((\"{p}\","))))
        .filter_map(|l| {
            let local = l.split_whitespace().nth(3)?;
            let (address, port) = local.rsplit_once(':')?;
            (address == "127.0.0.1" || address == "0.0.0.0" || address == "*")
                .then(|| port.parse().ok())?
        })
        .collect();
    ports.sort_unstable();
    ports.dedup();
    Ok(ports)
}

/// Forwarding threads; they stop accepting when this is dropped.
pub struct Forwarded {
    ports: Vec<u16>,
    stop: Arc<AtomicBool>,
}

impl Forwarded {
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }
}

impl Drop for Forwarded {
    /// From the thread in the node's namespace (the test's): a connection
    /// wakes each listener, which then ends.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for port in &self.ports {
            let _ = TcpStream::connect(("127.0.0.1", *port));
        }
    }
}

/// Listen on 127.0.0.1:`port` in namespace `inner` for each of `ports`,
/// and connect each accepted connection to 127.0.0.1:`port` in `outer`.
pub fn forward(outer: &File, inner: &File, ports: &[u16]) -> anyhow::Result<Forwarded> {
    let stop = Arc::new(AtomicBool::new(false));
    for &port in ports {
        let (outer, inner, stop) = (outer.try_clone()?, inner.try_clone()?, stop.clone());
        let (bound, bound_rx) = std::sync::mpsc::channel();
        std::thread::Builder::new().name(format!("forward-{port}")).spawn(move || {
            let listener = enter(&inner)
                .and_then(|()| {
                    TcpListener::bind(("127.0.0.1", port))
                        .with_context(|| format!("listen on 127.0.0.1:{port} in the node"))
                })
                .and_then(|l| enter(&outer).map(|()| l));
            let listener = match listener {
                Ok(l) => {
                    let _ = bound.send(Ok(()));
                    l
                }
                Err(e) => {
                    let _ = bound.send(Err(e));
                    return;
                }
            };
            for conn in listener.incoming() {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(down) = conn else { continue };
                // This thread is back in the outer namespace: the
                // connection out is made there.
                let Ok(up) = TcpStream::connect(("127.0.0.1", port)) else {
                    let _ = down.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = (down.set_nodelay(true), up.set_nodelay(true));
                copy_both_ways(down, up);
            }
        })?;
        bound_rx.recv().context("the forwarding thread")??;
    }
    Ok(Forwarded { ports: ports.to_vec(), stop })
}

fn copy_both_ways(a: TcpStream, b: TcpStream) {
    let pipe = |mut from: TcpStream, mut to: TcpStream| {
        move || {
            let _ = std::io::copy(&mut from, &mut to);
            let _ = to.shutdown(Shutdown::Write);
        }
    };
    if let (Ok(a2), Ok(b2)) = (a.try_clone(), b.try_clone()) {
        std::thread::spawn(pipe(a, b));
        std::thread::spawn(pipe(b2, a2));
    }
}
