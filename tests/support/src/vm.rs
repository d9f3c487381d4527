//! The VM tier's runner: boots Debian's kernel under qemu (scripts/vm-assets)
//! with this machine's root, read-only under a tmpfs overlay, as its root,
//! and runs the calling test binary's inner tests there, one process each,
//! after an optional prelude (shell). qemu emulates the CPU: no KVM needed.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long the whole VM may run.
pub const VM_DEADLINE: Duration = Duration::from_secs(20 * 60);

/// The VM's working dir: under /var/tmp, which the VM sees (its /tmp is its own).
pub fn work_dir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("volagent-vm-").tempdir_in("/var/tmp").unwrap()
}

/// The tests of this binary in module `module` that run in the VM, as
/// listed by the binary (they are `#[ignore]`d outside it).
pub fn listed(module: &str) -> Vec<String> {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--list", "--ignored", "--format", "terse"])
        .output()
        .unwrap();
    let prefix = format!("{module}::");
    let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_suffix(": test")?.strip_prefix(prefix.as_str()).map(str::to_string))
        .collect();
    names.sort();
    names
}

/// The guest call deadline of agents in the VM (VOLAGENT_DEADLINE_MS).
pub const VM_GUEST_DEADLINE_MS: u32 = 20_000;

/// Assert that `tests` names every inner test of `module` in this binary,
/// so that none is left out of the VM's run (and so never runs).
pub fn assert_every_test_is_run(module: &str, tests: &[&str]) {
    let mut run: Vec<String> = tests.iter().map(|s| s.to_string()).collect();
    run.sort();
    assert_eq!(listed(module), run, "the VM's list must name every test in {module}");
}

/// How long one inner test may run before it is killed (and fails), so
/// that a hung one cannot hold the VM until its deadline.
const TEST_DEADLINE_SECS: u32 = 240;

/// Boot the VM in `dir` with `mem_mib` of memory; run `prelude`, then each
/// of `tests` (in `module` of this binary), then, if one failed,
/// `on_failure` (diagnostics for the console); assert that each passed.
pub fn run_tests(
    dir: &Path,
    mem_mib: u32,
    prelude: &str,
    module: &str,
    tests: &[&str],
    on_failure: &str,
) {
    let assets = PathBuf::from(std::env::var("VOLAGENT_VM_ASSETS").expect(
        "VOLAGENT_VM_ASSETS: the dir with the VM tier's vmlinuz and initrd.gz (scripts/vm-assets makes it; scripts/test sets it)",
    ));
    let exe = std::env::current_exe().unwrap();
    // The emulated CPU runs compiled guests 20-50 times slower than the
    // hardware the 500 ms default deadline of a guest call is set for; every
    // agent started in the VM gets a deadline that measures emulation, not
    // the policy.
    let mut script = format!(
        "#!/bin/sh\nstatus=0\nexport RUST_BACKTRACE=1\nexport VOLAGENT_DEADLINE_MS={VM_GUEST_DEADLINE_MS}\n{prelude}\n"
    );
    for name in tests {
        script.push_str(&format!(
            "timeout -s KILL {TEST_DEADLINE_SECS} '{}' --ignored --exact --nocapture --color never {module}::{name} || {{ status=1; echo 'VOLAGENT_VM_TEST_FAILED: {name}'; }}\n",
            exe.display()
        ));
    }
    script.push_str(&format!("if [ $status != 0 ]; then\n{on_failure}\nfi\nexit $status\n"));
    let run = dir.join("run.sh");
    std::fs::write(&run, script).unwrap();
    std::fs::set_permissions(&run, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let console = dir.join("console.log");

    let started = Instant::now();
    let mut qemu = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg,thread=multi", "-cpu", "max", "-smp", "2", "-m", &mem_mib.to_string()])
        .args(["-nographic", "-no-reboot", "-kernel"])
        .arg(assets.join("vmlinuz"))
        .arg("-initrd")
        .arg(assets.join("initrd.gz"))
        .arg("-append")
        .arg(format!("console=ttyS0 quiet loglevel=3 panic=-1 VOLAGENT_VM_RUN={}", run.display()))
        .args(["-virtfs", "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap"])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&console).unwrap())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("qemu-system-x86_64 (scripts/vm-assets installs it)");
    let status = loop {
        if let Some(status) = qemu.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > VM_DEADLINE {
            let _ = qemu.kill();
            let _ = qemu.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let output = String::from_utf8_lossy(&std::fs::read(&console).unwrap()).into_owned();
    println!("--- the VM's console ({:?}) ---\n{output}", started.elapsed());
    assert!(status.is_some(), "the VM did not finish within {VM_DEADLINE:?}");
    assert!(
        !output.contains("VOLAGENT_VM_FAILED"),
        "the VM's set-up failed (see its console above)"
    );
    for name in tests {
        assert!(
            output.contains(&format!("test {module}::{name} ... ok")),
            "in the VM, {name} did not pass (see its console above)"
        );
    }
    assert!(
        output.contains("VOLAGENT_VM_EXIT=0"),
        "the tests in the VM failed (see its console above)"
    );
}

/// A test's node inside the VM whose kernel state (nbd connections, rbd
/// mappings) is not its mount namespace's and would outlive it: on drop,
/// even after a failure, `release` undoes it.
pub struct Guarded<T> {
    inner: T,
    release: fn(&mut T),
}

impl<T> Guarded<T> {
    pub fn new(inner: T, release: fn(&mut T)) -> Self {
        Guarded { inner, release }
    }
}

impl<T> std::ops::Deref for Guarded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T> std::ops::DerefMut for Guarded<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

impl<T> Drop for Guarded<T> {
    fn drop(&mut self) {
        (self.release)(&mut self.inner);
    }
}
