//! Test-only guests that misbehave, and files that are not backends: each
//! fails with its own clear error, and the runtime serves the next call.

use std::path::Path;
use std::sync::Arc;
use volagent::policy::*;
use volagent_test_artifacts::{MISBEHAVE, NET_IMPORT, WRONG_WORLD};
use volagent_test_support::policy::*;

fn fence_named(plugin: &Plugin, name: &str) -> Result<Decision, CallError> {
    let v = volume(name, "misbehave");
    let c = consumer("n1", "p", "misbehave", name);
    plugin.fence(facts(), &v, &c, &[], &[])
}

fn attach_named(plugin: &Plugin, name: &str) -> Result<Plan, CallError> {
    let v = volume(name, "misbehave");
    let c = consumer("n1", "p", "misbehave", name);
    plugin.attach(facts(), &v, &c, &[], &paths("misbehave", name))
}

/// After any failure the same plugin must still answer a normal call.
fn still_serves(plugin: &Plugin) {
    assert_eq!(fence_named(plugin, "ok").expect("the next call must work"), Decision::Grant);
    assert_eq!(attach_named(plugin, "ok").expect("the next call must work").len(), 1);
}

#[test]
fn an_endless_loop_hits_the_deadline() {
    let rt = runtime(100);
    let plugin = load(&rt, MISBEHAVE);
    let err = fence_named(&plugin, "spin").unwrap_err();
    assert!(matches!(err, CallError::Deadline { deadline_ms: 100, .. }), "{err}");
    assert!(err.to_string().contains("misbehave: fence ran past its deadline of 100 ms"), "{err}");
    still_serves(&plugin);
}

#[test]
fn unbounded_allocation_hits_the_memory_cap() {
    let rt = runtime(2000);
    let plugin = load(&rt, MISBEHAVE);
    let err = fence_named(&plugin, "hog").unwrap_err();
    assert!(matches!(err, CallError::Memory { cap_mib: 32, .. }), "{err}");
    assert!(err.to_string().contains("memory past the cap of 32 MiB"), "{err}");
    still_serves(&plugin);
}

#[test]
fn a_trap_fails_only_its_call() {
    let rt = runtime(500);
    let plugin = load(&rt, MISBEHAVE);
    let err = fence_named(&plugin, "trap").unwrap_err();
    assert!(matches!(err, CallError::Trap { .. }), "{err}");
    assert!(err.to_string().starts_with("backend misbehave: fence trapped: "), "{err}");
    still_serves(&plugin);
}

#[test]
fn many_traps_do_not_exhaust_the_instance_pool() {
    let rt = runtime(500);
    let plugin = load(&rt, MISBEHAVE);
    for _ in 0..300 {
        assert!(matches!(fence_named(&plugin, "trap"), Err(CallError::Trap { .. })));
    }
    still_serves(&plugin);
}

#[test]
fn a_policy_refusal_is_not_a_trap() {
    let rt = runtime(500);
    let plugin = load(&rt, MISBEHAVE);
    let err = attach_named(&plugin, "refuse").unwrap_err();
    assert!(err.is_policy_refusal(), "{err}");
    assert!(
        err.to_string().contains("refused: invalid options: volume refuse is refused on request"),
        "{err}"
    );
}

#[test]
fn a_log_flood_is_capped_and_the_call_succeeds() {
    let rt = runtime(2000);
    let plugin = load(&rt, MISBEHAVE);
    assert_eq!(fence_named(&plugin, "flood-log").unwrap(), Decision::Grant);
}

#[test]
fn steps_outside_the_declared_capabilities_are_refused() {
    let rt = runtime(500);
    let plugin = load(&rt, MISBEHAVE);
    let cases = [
        (
            "undeclared-device",
            "step 1 (attach-device): device kind rbd is not declared in the backend's capabilities",
        ),
        (
            "escape",
            "step 1 (bind-mount): bind target /etc is outside the dirs this backend may use here",
        ),
        ("dotdot", "contains \"..\""),
    ];
    for (name, expected) in cases {
        let err = attach_named(&plugin, name).unwrap_err();
        assert!(matches!(err, CallError::Plan { .. }), "{name}: {err}");
        assert!(err.to_string().contains(expected), "{name}: {err}");
    }
    still_serves(&plugin);
}

#[test]
fn a_takeover_of_a_live_node_is_refused() {
    let rt = runtime(500);
    let plugin = load(&rt, MISBEHAVE);
    let v = volume("takeover-live", "misbehave");
    let old = consumer("n2", "old", "misbehave", "takeover-live");
    let new = consumer("n1", "new", "misbehave", "takeover-live");
    let nodes =
        [NodeFacts { name: "n2".into(), exists: true, ready: false, out_of_service: false }];
    let err = plugin.fence(facts(), &v, &new, &[holder(&old)], &nodes).unwrap_err();
    assert!(matches!(err, CallError::TakeOver { .. }), "{err}");
    assert!(err.to_string().contains("node n2 is not known to be gone"), "{err}");
    // Proven gone: the same answer is accepted.
    let gone =
        [NodeFacts { name: "n2".into(), exists: false, ready: false, out_of_service: false }];
    assert!(matches!(
        plugin.fence(facts(), &v, &new, &[holder(&old)], &gone),
        Ok(Decision::TakeOver(_))
    ));
}

#[test]
fn concurrent_calls_each_get_their_own_instance() {
    let rt = runtime(2000);
    let plugin = Arc::new(load(&rt, MISBEHAVE));
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let plugin = plugin.clone();
            std::thread::spawn(move || {
                for j in 0..50 {
                    let name = if (i + j) % 5 == 0 { "trap" } else { "ok" };
                    let r = fence_named(&plugin, name);
                    assert_eq!(r.is_ok(), name == "ok", "{name}: {r:?}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("no thread panics");
    }
}

fn load_err(rt: &Arc<Runtime>, path: &Path) -> LoadError {
    match Plugin::load_file(rt, path) {
        Ok(p) => panic!("{} loaded as backend {}", path.display(), p.name()),
        Err(e) => {
            assert!(
                e.to_string().starts_with(&path.display().to_string()),
                "error must name the file: {e}"
            );
            e
        }
    }
}

#[test]
fn a_component_of_another_world_is_refused() {
    let rt = runtime(500);
    let err = load_err(&rt, Path::new(WRONG_WORLD));
    assert!(matches!(err, LoadError::WrongWorld { .. }), "{err}");
    assert!(err.to_string().contains("wasi:cli/run"), "{err}");
}

#[test]
fn a_component_importing_sockets_is_refused() {
    let rt = runtime(500);
    let err = load_err(&rt, Path::new(NET_IMPORT));
    match &err {
        LoadError::DisallowedImport { import, .. } => {
            assert!(import.starts_with("wasi:sockets/"), "{err}");
        }
        other => panic!("expected a disallowed import, got {other}"),
    }
}

#[test]
fn files_that_are_not_components_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rt =
        Runtime::new(Limits { max_file_bytes: 1 << 20, ..Default::default() }).expect("runtime");
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).expect("write");
        p
    };
    let empty = write("empty.wasm", b"");
    assert!(matches!(load_err(&rt, &empty), LoadError::Empty { .. }));
    let garbage = write("garbage.wasm", b"#!/bin/sh\nrm -rf /\n");
    assert!(matches!(load_err(&rt, &garbage), LoadError::NotWasm { .. }));
    // The smallest valid core module: magic and version 1.
    let core = write("core.wasm", b"\0asm\x01\0\0\0");
    let err = load_err(&rt, &core);
    assert!(matches!(err, LoadError::CoreModule { .. }), "{err}");
    assert!(err.to_string().contains("wasm32-wasip2"), "{err}");
    let big = write("big.wasm", &vec![0u8; (1 << 20) + 1]);
    let err = load_err(&rt, &big);
    assert!(matches!(err, LoadError::TooLarge { size: 1048577, max: 1048576, .. }), "{err}");
    // A component header with a body that is not a component.
    let broken = write("broken.wasm", b"\0asm\x0d\0\x01\0\xff\xff\xff\xff");
    assert!(matches!(load_err(&rt, &broken), LoadError::Compile { .. }));
    // A real component, truncated.
    let bytes = std::fs::read(volagent_test_artifacts::RBD).expect("rbd component");
    let cut = write("truncated.wasm", &bytes[..bytes.len() / 2]);
    assert!(matches!(load_err(&rt, &cut), LoadError::Compile { .. }));
    let missing = dir.path().join("missing.wasm");
    assert!(matches!(load_err(&rt, &missing), LoadError::Read { .. }));
}

#[test]
fn more_calls_than_pool_slots_fail_clearly_and_recover() {
    let rt = Runtime::new(Limits {
        concurrent_calls: 2,
        deadline: std::time::Duration::from_secs(5),
        ..Default::default()
    })
    .expect("runtime");
    let plugin = Arc::new(load(&rt, MISBEHAVE));
    // Two endless calls hold both slots until their deadline.
    let spinners: Vec<_> = (0..2)
        .map(|_| {
            let p = plugin.clone();
            std::thread::spawn(move || fence_named(&p, "spin"))
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_secs(1));
    let err = fence_named(&plugin, "ok").unwrap_err();
    assert!(matches!(err, CallError::Instantiate { .. }), "{err}");
    assert!(err.to_string().contains("cannot start an instance for fence"), "{err}");
    for s in spinners {
        assert!(matches!(s.join().expect("thread"), Err(CallError::Deadline { .. })));
    }
    still_serves(&plugin);
}

#[test]
fn oversized_plans_are_refused_and_the_next_call_served() {
    // Memory enough for the guest to build them.
    let rt = Runtime::new(Limits {
        deadline: std::time::Duration::from_secs(5),
        memory_bytes: 512 << 20,
        ..Default::default()
    })
    .expect("runtime");
    let plugin = load(&rt, MISBEHAVE);
    // A million steps: the host keeps no more of a plan than its limit
    // while the guest builds it, and refuses it.
    let err = attach_named(&plugin, "huge-plan").unwrap_err();
    assert!(matches!(err, CallError::Plan { .. }), "{err}");
    assert!(err.to_string().contains("more steps than the 512 allowed"), "{err}");
    still_serves(&plugin);
    // Thousands: the plan's own limit.
    let err = attach_named(&plugin, "big-plan").unwrap_err();
    assert!(matches!(err, CallError::Plan { .. }), "{err}");
    assert!(err.to_string().contains("the plan has more steps than the 512 allowed"), "{err}");
    still_serves(&plugin);
    // Under the usual memory cap the guest cannot even build the million.
    let rt = runtime(2000);
    let plugin = load(&rt, MISBEHAVE);
    assert!(matches!(attach_named(&plugin, "huge-plan"), Err(CallError::Memory { .. })));
    still_serves(&plugin);
}

#[test]
fn a_guest_hoarding_what_the_host_makes_for_it_is_stopped() {
    let rt = runtime(2000);
    let plugin = load(&rt, MISBEHAVE);
    let err = attach_named(&plugin, "hoard-plans").unwrap_err();
    assert!(matches!(err, CallError::Trap { .. }), "{err}");
    assert!(err.to_string().contains("more than 64 plans made in one call"), "{err}");
    still_serves(&plugin);
    let err = attach_named(&plugin, "hoard-nodes").unwrap_err();
    assert!(matches!(err, CallError::Trap { .. }), "{err}");
    assert!(err.to_string().contains("more than 1024 node-state answers in one call"), "{err}");
    still_serves(&plugin);
}

#[test]
fn a_two_mib_refusal_is_cut_to_a_bounded_message() {
    let rt = runtime(2000);
    let plugin = load(&rt, MISBEHAVE);
    let err = attach_named(&plugin, "huge-error").unwrap_err();
    assert!(err.is_policy_refusal(), "{err}");
    let failure = volagent::ops::Failure::new(volagent::ops::FailureKind::Failed, err.to_string());
    assert!(failure.message.len() <= volagent::ops::MAX_MESSAGE, "{}", failure.message.len());
    assert!(
        failure.message.ends_with("bytes cut)"),
        "{}",
        &failure.message[failure.message.len() - 40..]
    );
    still_serves(&plugin);
}
