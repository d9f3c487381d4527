//! Contract 1.x as a guest without the SDK sees it: the least world (only
//! the core `policy` export), served with the host's fallbacks for every
//! optional interface it leaves out.

use volagent::policy::*;
use volagent_test_artifacts::CORE_ONLY;
use volagent_test_support::policy::*;

#[test]
fn a_guest_exporting_only_the_core_policy_loads_and_is_served() {
    let rt = runtime(500);
    let plugin = load(&rt, CORE_ONLY);
    assert_eq!(plugin.name(), "core-only");
    assert_eq!(plugin.contract(), CONTRACT_VERSION);
    assert!(plugin.optional_exports().is_empty(), "{:?}", plugin.optional_exports());
    let v = volume("pv1", "core-only");
    let c = consumer("n1", "a", "core-only", "pv1");
    let p = paths("core-only", "pv1");
    let plan = plugin.attach(facts(), &v, &c, &[], &p).expect("attach");
    assert_eq!(
        plan,
        [Step::BindMount(BindMount {
            source: p.staging_dir.clone(),
            target: c.mount_dir.clone(),
            read_only: false
        })]
    );
    let plan = plugin.detach(facts(), &v, &c, &[], &p).expect("detach");
    assert_eq!(plan, [Step::Unmount(Unmount { target: c.mount_dir.clone(), force: false })]);
}

#[test]
fn what_a_guest_does_not_export_the_host_does_without() {
    let rt = runtime(500);
    let plugin = load(&rt, CORE_ONLY);
    let mut v = volume("pv1", "core-only");
    let c = consumer("n1", "a", "core-only", "pv1");
    let p = paths("core-only", "pv1");
    // No `expand`: the host grows the filesystem at the consumer's dir.
    let plan = plugin.expand(facts(), &v, &c, &p).expect("expand");
    assert_eq!(plan, [Step::GrowFilesystem(GrowFilesystem { target: c.mount_dir.clone() })]);
    // No `health`: nothing beyond the host's own checks.
    assert_eq!(plugin.condition(facts(), &v, &c, &p).expect("condition"), None);
    // No `block-volumes`: a block volume is refused, saying why.
    v.mode = VolumeMode::Block;
    let err = plugin.attach(facts(), &v, &c, &[], &p).unwrap_err();
    assert!(err.is_policy_refusal(), "{err}");
    assert!(err.to_string().contains("volagent:policy/block-volumes"), "{err}");
}
