//! rbd volumes through the kernel's rbd driver (krbd), which this machine's
//! kernel lacks. The tests in `in_the_vm` run inside the VM tier's VM
//! (volagent_test_support::vm), whose Debian kernel has rbd: the prelude starts a
//! single-node Ceph inside the VM (scripts/ceph-env, copied beside the VM's
//! run script — the kernel client must reach the monitor and OSD at the
//! addresses the cluster's maps give, 127.0.0.1, which outside the VM
//! would be the VM itself), then each inner test runs this binary once.
//! The inner tests drive the installed `volagent-flex` driver, the real
//! agent and the rbd policy, with the Ceph key from the volume's Secret as
//! kubelet passes it: the policy's `auto` picks the kernel's driver. The
//! key reaches the kernel through its keyring: it shows nowhere in sysfs,
//! and no key stays in the keyring after the map.
//! Outside the VM the inner tests are ignored; they fail, not pass, when
//! run without the kernel's rbd driver.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use volagent_test_support::vm;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

/// The inner tests, by name (each runs in its own process in the VM).
const IN_THE_VM: &[&str] = &[
    "an_image_is_mapped_by_the_kernel_shared_on_its_node_and_unmapped_whole",
    "a_mount_cut_short_after_the_map_is_rolled_back_by_the_next_agent",
    "start_up_reconciliation_unmaps_a_mapping_no_record_names",
    "an_admins_own_mapping_is_never_reused_or_unmapped",
    "the_recorded_kernel_client_is_the_one_blocklisting_fences",
];

#[test]
fn every_test_for_the_vm_is_run_by_it() {
    vm::assert_every_test_is_run("in_the_vm", IN_THE_VM);
}

#[test]
fn the_kernel_rbd_path_works_in_a_vm_whose_kernel_has_rbd() {
    let dir = vm::work_dir();
    // The project's Ceph script, where the VM can read it (a clone under
    // /tmp is hidden there: the VM's /tmp is its own).
    let scripts = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts");
    std::fs::create_dir_all(dir.path().join("scripts/lib")).unwrap();
    for f in ["ceph-env", "lib/debian.sh"] {
        std::fs::copy(scripts.join(f), dir.path().join("scripts").join(f)).unwrap();
    }
    // Each ceph command gets 120 s, not the 30 s meant for hardware: in CI
    // the cluster failed to start twice, silently, within two minutes of
    // boot, under emulation with the tier's other VM beside it. A cluster
    // that does not start ends the run at once with the step that failed
    // and the daemons' logs, not with five tests failing after it.
    let prelude = format!(
        "export VOLAGENT_CEPH_DIR=/run/volagent-ceph VOLAGENT_CEPH_TIMEOUT=120\n\
         bash '{}/scripts/ceph-env' start >/dev/null || {{ echo 'VOLAGENT_VM_FAILED: scripts/ceph-env start'; \
         tail -n 30 /run/volagent-ceph/log/*.log; exit 1; }}",
        dir.path().display()
    );
    // On a failure: what the kernel and the cluster said.
    let on_failure = "dmesg | tail -n 40; ceph -c /run/volagent-ceph/ceph.conf -s --connect-timeout 10; \
                      tail -n 15 /run/volagent-ceph/log/*.log";
    vm::run_tests(dir.path(), 3072, &prelude, "in_the_vm", IN_THE_VM, on_failure);
}

mod in_the_vm {
    use serde_json::Value;
    use std::path::Path;
    use std::process::Command;
    use volagent_test_support::agent::Node;
    use volagent_test_support::ceph::{Image, ceph_dir, rbd, volagent_key, watchers};
    use volagent_test_support::driver::{assert_success, rbd_options, run_driver};

    const WHY: &str = "needs the kernel's rbd driver: runs inside the VM (the_kernel_rbd_path_works_in_a_vm_whose_kernel_has_rbd)";
    const BUS: &str = "/sys/bus/rbd";

    /// A test's node; on drop, even after a failure, its mounts are
    /// detached and every rbd mapping is unmapped by force.
    type VmNode = super::vm::Guarded<Node>;

    fn release(node: &mut Node) {
        node.stop_agent();
        for m in node.scratch.mounts().into_iter().rev() {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
        for id in mappings() {
            let _ = std::fs::write(format!("{BUS}/remove_single_major"), format!("{id} force"));
        }
    }

    fn node() -> VmNode {
        assert!(Path::new(BUS).join("add_single_major").exists(), "{WHY}");
        let mut node = VmNode::new(
            Node::start_with(super::VOLAGENT, &[(volagent_test_artifacts::RBD, "rbd")]),
            release,
        );
        spawn(&mut node, None);
        node
    }

    /// (Re)start the node's agent, killing itself after `kill_after` steps
    /// of a plan. The emulated CPU is slow: the fence's call to the cluster
    /// (a librados connect) needs more than the default 500 ms guest deadline,
    /// which the VM's runner raises for every agent (VOLAGENT_DEADLINE_MS).
    fn spawn(node: &mut Node, kill_after: Option<usize>) {
        node.stop_agent();
        let env: Vec<(&str, String)> = kill_after
            .map(|n| (volagent::sys::faults::KILL_AFTER_STEP_ENV, n.to_string()))
            .into_iter()
            .collect();
        node.spawn_agent_env("node-a", &env, &[]);
    }

    /// The kernel's rbd mappings, by id.
    fn mappings() -> Vec<String> {
        let mut ids: Vec<String> = std::fs::read_dir(format!("{BUS}/devices"))
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        ids.sort();
        ids
    }

    fn attr(id: &str, name: &str) -> String {
        std::fs::read_to_string(format!("{BUS}/devices/{id}/{name}")).unwrap().trim().to_string()
    }

    /// The forms the user's key could take in a file: its base64 text,
    /// its decoded bytes, and the AES secret in them (after a 2-byte type,
    /// an 8-byte creation time and a 2-byte length), raw and in hex.
    fn key_forms(key: &str) -> Vec<Vec<u8>> {
        let decoded = volagent::secret::Secret::new(key.as_bytes().to_vec())
            .ceph_key_bytes("key")
            .unwrap()
            .to_vec();
        let secret = decoded.get(12..).unwrap_or_default().to_vec();
        assert_eq!(secret.len(), 16, "an AES key");
        vec![key.as_bytes().to_vec(), hex::encode(&secret).into_bytes(), secret, decoded]
    }

    /// The files of mapping `id` in sysfs (every readable attribute, in
    /// its subdirs too, not following links out) that hold any of `forms`,
    /// and how many files were read.
    fn files_holding(id: &str, forms: &[Vec<u8>]) -> (Vec<std::path::PathBuf>, usize) {
        fn walk(
            dir: &Path,
            forms: &[Vec<u8>],
            holding: &mut Vec<std::path::PathBuf>,
            read: &mut usize,
        ) {
            for entry in std::fs::read_dir(dir).unwrap().flatten() {
                let Ok(kind) = entry.file_type() else { continue };
                if kind.is_dir() {
                    walk(&entry.path(), forms, holding, read);
                } else if kind.is_file() {
                    // Write-only attributes (refresh, …) refuse reading.
                    let Ok(content) = std::fs::read(entry.path()) else { continue };
                    *read += 1;
                    if forms.iter().any(|f| content.windows(f.len()).any(|w| w == f.as_slice())) {
                        holding.push(entry.path());
                    }
                }
            }
        }
        let (mut holding, mut read) = (Vec::new(), 0);
        walk(Path::new(&format!("{BUS}/devices/{id}")), forms, &mut holding, &mut read);
        assert!(read >= 10, "read only {read} files of mapping {id}");
        (holding, read)
    }

    /// The Ceph keys in /proc/keys. It lists the keys the reader may view:
    /// those it possesses, and (add_key gives a key's owner view
    /// permission) every key of its UID — so the agent's, both root's.
    fn ceph_keys() -> Vec<String> {
        let keys = std::fs::read_to_string("/proc/keys").unwrap();
        keys.lines()
            .filter(|l| l.split_whitespace().nth(7) == Some("ceph"))
            .map(str::to_string)
            .collect()
    }

    /// [`ceph_keys`], once the kernel's key collector, which runs shortly
    /// after a key is removed, has had up to 2 s.
    fn ceph_keys_collected() -> Vec<String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while !ceph_keys().is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        ceph_keys()
    }

    /// Proof that [`ceph_keys`] sees a key as the agent holds one while it
    /// maps: added the agent's way, in the keyring of a thread other than
    /// the reading one (which therefore does not possess it); and that it
    /// sees the key go when removed, while that thread lives on (as the
    /// agent's do: a thread's keyring goes with it).
    fn a_key_held_by_another_thread_is_listed(key: &str) {
        assert!(ceph_keys().is_empty(), "Ceph keys before the test: {:?}", ceph_keys());
        let payload =
            volagent::secret::Secret::new(key.as_bytes().to_vec()).ceph_key_bytes("key").unwrap();
        let (told, hear) = std::sync::mpsc::channel::<Result<String, String>>();
        let (tell, heard) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            // The kernel's Ceph key type takes the payload as the agent makes it.
            let held = match volagent::sys::keyring::ThreadKey::ceph(&payload) {
                Ok(k) => k,
                Err(e) => {
                    let _ = told.send(Err(e.to_string()));
                    return;
                }
            };
            let _ = told.send(Ok(held.description().to_string()));
            let _ = heard.recv();
            drop(held);
            let _ = told.send(Ok("removed".into()));
            let _ = heard.recv();
        });
        let description = hear.recv().unwrap().unwrap();
        let listed = ceph_keys();
        assert_eq!(
            listed.len(),
            1,
            "the key {description} held by another thread is not listed: {listed:?}"
        );
        tell.send(()).unwrap();
        assert_eq!(hear.recv().unwrap().unwrap(), "removed");
        assert!(
            ceph_keys_collected().is_empty(),
            "the key stays listed after its removal: {:?}",
            ceph_keys()
        );
        tell.send(()).unwrap();
        holder.join().unwrap();
    }

    fn driver(node: &Node, args: &[&str]) -> (i32, Value) {
        run_driver(Command::new(node.driver_of("node-a", "rbd")).args(args))
    }

    fn mount(node: &Node, uid: &str, image: &Image, key: &str) -> (String, (i32, Value)) {
        let dir = node.mount_dir_of("node-a", "rbd", uid, "pv1");
        let options =
            rbd_options("pv1", &format!("pod-{uid}"), uid, &image.name, Some(key), "ReadWriteOnce");
        let r = driver(node, &["mount", &dir, &options.to_string()]);
        (dir, r)
    }

    /// The agent's NBD dir (its helpers' files and its krbd marks).
    fn left_in_state(node: &Node) -> Vec<std::path::PathBuf> {
        std::fs::read_dir(node.scratch.path("node-a/state/nbd"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default()
    }

    #[test]
    #[ignore = "runs inside the VM"]
    fn an_image_is_mapped_by_the_kernel_shared_on_its_node_and_unmapped_whole() {
        let ceph = ceph_dir();
        let key = volagent_key(&ceph);
        let node = node();
        let image = Image::create(&ceph, 64);
        a_key_held_by_another_thread_is_listed(&key);
        let (dir_a, r) = mount(&node, "uid-a", &image, &key);
        assert_success(&r);
        let device = r.1["device"].as_str().unwrap_or_default().to_string();
        assert!(device.starts_with("/dev/rbd"), "auto chose the kernel's driver: {}", r.1);
        let ids = mappings();
        assert_eq!(ids.len(), 1, "{ids:?}");
        assert_eq!(
            (attr(&ids[0], "pool"), attr(&ids[0], "name")),
            ("rbd".to_string(), image.name.clone())
        );
        // The key went to the kernel through the keyring, and left it: sysfs
        // shows the line that mapped it, which only names the key.
        let config = attr(&ids[0], "config_info");
        assert!(config.contains(",key=volagent:") && !config.contains("secret="), "{config}");
        let (holding, read) = files_holding(&ids[0], &key_forms(&key));
        assert!(holding.is_empty(), "the key is in sysfs, in {holding:?} (of {read} files)");
        // A key left behind would stay (in a keyring of the agent's thread,
        // which lives on well past 2 s), not pass as collected.
        assert!(
            ceph_keys_collected().is_empty(),
            "a Ceph key left in the kernel's keyring: {:?}",
            ceph_keys()
        );
        assert!(node.scratch.loops_left().is_empty(), "no loop device on the kernel's path");
        assert_eq!(watchers(&image).len(), 1, "one client: the kernel's");
        let log = std::fs::read_to_string(node.log_path("node-a")).unwrap();
        assert!(!log.contains(&key), "the agent logged the key");
        let payload: Vec<u8> = (0..200_000u32).map(|i| (i * 11 % 251) as u8).collect();
        std::fs::write(format!("{dir_a}/data"), &payload).unwrap();

        // A second pod on the node: the one watcher is this node's kernel
        // client, so the exclusive volume is shared here, on the same mapping.
        let (dir_b, r) = mount(&node, "uid-b", &image, &key);
        assert_success(&r);
        assert_eq!(std::fs::read(format!("{dir_b}/data")).unwrap(), payload);
        assert_eq!(mappings().len(), 1, "still one mapping");
        assert_success(&driver(&node, &["unmount", &dir_b]));
        assert_success(&driver(&node, &["unmount", &dir_a]));
        assert!(mappings().is_empty(), "unmapped: {:?}", mappings());
        assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
        assert!(left_in_state(&node).is_empty(), "left behind: {:?}", left_in_state(&node));
        // What the pod wrote is in the image, read through librbd.
        let copy = node.scratch.path("copy.raw");
        rbd(&ceph, &["export", "--no-progress", &image.spec(), &copy.display().to_string()]);
        let out = Command::new("debugfs").args(["-R", "cat /data"]).arg(&copy).output().unwrap();
        assert_eq!(out.stdout, payload);
    }

    #[test]
    #[ignore = "runs inside the VM"]
    fn a_mount_cut_short_after_the_map_is_rolled_back_by_the_next_agent() {
        let ceph = ceph_dir();
        let key = volagent_key(&ceph);
        let mut node = node();
        let image = Image::create(&ceph, 64);
        // The agent dies (SIGKILL) right after the plan's first step: the map.
        spawn(&mut node, Some(1));
        let (dir, r) = mount(&node, "uid-a", &image, &key);
        assert_ne!(r.1["status"], "Success", "{}", r.1);
        assert_eq!(mappings().len(), 1, "the crash came after the map");
        // The next agent's start-up reconciliation rolls the operation back.
        spawn(&mut node, None);
        assert!(mappings().is_empty(), "{:?} still mapped", mappings());
        let log = std::fs::read_to_string(node.log_path("node-a")).unwrap();
        assert!(
            log.contains("rolled back an operation cut short"),
            "the agent says what it did:\n{log}"
        );
        assert!(left_in_state(&node).is_empty(), "left behind: {:?}", left_in_state(&node));
        // kubelet's retry mounts it.
        let options =
            rbd_options("pv1", "pod-uid-a", "uid-a", &image.name, Some(&key), "ReadWriteOnce");
        assert_success(&driver(&node, &["mount", &dir, &options.to_string()]));
        assert_success(&driver(&node, &["unmount", &dir]));
        assert!(mappings().is_empty());
    }

    #[test]
    #[ignore = "runs inside the VM"]
    fn start_up_reconciliation_unmaps_a_mapping_no_record_names() {
        let ceph = ceph_dir();
        let key = volagent_key(&ceph);
        let mut node = node();
        let image = Image::create(&ceph, 64);
        let (_dir, r) = mount(&node, "uid-a", &image, &key);
        assert_success(&r);
        node.stop_agent();
        // The agent's stash of what it mounted is lost (its runtime dir is
        // a tmpfs that went), and the mounts went with the pods: only the
        // mapping and its mark remain.
        for m in node.scratch.mounts().into_iter().rev() {
            nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH).unwrap();
        }
        std::fs::remove_dir_all(node.scratch.path("node-a/run")).unwrap();
        assert_eq!(mappings().len(), 1);
        spawn(&mut node, None);
        assert!(mappings().is_empty(), "{:?} still mapped", mappings());
        let log = std::fs::read_to_string(node.log_path("node-a")).unwrap();
        assert!(
            log.contains("orphan kernel rbd mapping"),
            "the agent says what it removed:\n{log}"
        );
        assert!(left_in_state(&node).is_empty(), "left behind: {:?}", left_in_state(&node));
    }

    #[test]
    #[ignore = "runs inside the VM"]
    fn an_admins_own_mapping_is_never_reused_or_unmapped() {
        let ceph = ceph_dir();
        let key = volagent_key(&ceph);
        let mut node = node();
        let image = Image::create(&ceph, 64);
        // An admin maps the image by hand, as `rbd device map` would.
        std::fs::write(
            format!("{BUS}/add_single_major"),
            format!("127.0.0.1:6789 name=volagent,secret={key} rbd {}", image.name),
        )
        .unwrap();
        let theirs = mappings();
        assert_eq!(theirs.len(), 1);
        // Their line holds the key: the sysfs check sees a key where there is one.
        let forms = key_forms(&key);
        let (holding, _) = files_holding(&theirs[0], &forms);
        assert!(
            holding.iter().any(|f| f.ends_with("config_info")),
            "the check missed the key in {holding:?}"
        );
        // A restart's reconciliation leaves it.
        spawn(&mut node, None);
        assert_eq!(mappings(), theirs, "the admin's mapping is not the agent's to sweep");
        // A read-many volume of the image gets a mapping of its own, and
        // unmapping it leaves the admin's.
        let dir = node.mount_dir_of("node-a", "rbd", "uid-a", "pv1");
        let options =
            rbd_options("pv1", "pod-a", "uid-a", &image.name, Some(&key), "ReadWriteMany");
        // (The admin's device holds no filesystem: the agent formats its own mapping.)
        let r = driver(&node, &["mount", &dir, &options.to_string()]);
        assert_success(&r);
        assert_ne!(
            r.1["device"].as_str(),
            Some(format!("/dev/rbd{}", theirs[0]).as_str()),
            "{}",
            r.1
        );
        assert_eq!(mappings().len(), 2);
        let ours = mappings().into_iter().find(|id| !theirs.contains(id)).unwrap();
        let (holding, read) = files_holding(&ours, &forms);
        assert!(holding.is_empty(), "the key is in sysfs, in {holding:?} (of {read} files)");
        assert_success(&driver(&node, &["unmount", &dir]));
        assert_eq!(mappings(), theirs);
        std::fs::write(format!("{BUS}/remove_single_major"), &theirs[0]).unwrap();
    }

    #[test]
    #[ignore = "runs inside the VM"]
    fn the_recorded_kernel_client_is_the_one_blocklisting_fences() {
        let ceph = ceph_dir();
        let key = volagent_key(&ceph);
        let node = node();
        let image = Image::create(&ceph, 64);
        let (dir, r) = mount(&node, "uid-a", &image, &key);
        assert_success(&r);
        let id = mappings().pop().unwrap();
        // The cluster's one watcher is the kernel client sysfs names: the
        // client the agent records for take-overs to blocklist.
        let client = attr(&id, "client_id").trim_start_matches("client").to_string();
        assert_eq!(watchers(&image), vec![format!("client.{client}")]);
        std::fs::write(format!("{dir}/before"), b"written before").unwrap();
        let sync = Command::new("sync").arg("-f").arg(format!("{dir}/before")).status().unwrap();
        assert!(sync.success());
        // Blocklisted (as a take-over's blocklist-client step does, by the
        // recorded address), its writes fail.
        let address = attr(&id, "client_addr");
        let out = Command::new("ceph")
            .arg("-c")
            .arg(ceph.join("ceph.conf"))
            .args(["osd", "blocklist", "add", &address])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let write = std::fs::write(format!("{dir}/after"), vec![7u8; 1 << 20])
            .and_then(|()| std::fs::File::open(format!("{dir}/after"))?.sync_all());
        let err = write.expect_err("a blocklisted client's write reached the image");
        // EIO from the write itself, or EROFS when ext4 met the refused
        // journal write first (the kernel's timing) and went read-only:
        // either way nothing of it reached the image.
        assert!(matches!(err.raw_os_error(), Some(nix::libc::EIO | nix::libc::EROFS)), "{err}");
        let _ = Command::new("ceph")
            .arg("-c")
            .arg(ceph.join("ceph.conf"))
            .args(["osd", "blocklist", "rm", &address])
            .output();
    }
}
