//! The ledger on a real kube-apiserver passes the same conformance tests as
//! the embedded one, and an outage is retried, then reported, never lost;
//! leader election among controller replicas. Each runs as the
//! ServiceAccount that does it in a cluster, with `deploy/`'s RBAC (and no
//! admission webhook: these are about the store, not about nodes).

use std::sync::Arc;
use std::time::Duration;
use volagent::kube::ledger::{Backoff, KubeLedger};
use volagent::ledger::{Ledger, LedgerError, conformance};
use volagent_kube_env::KubeEnv;
use volagent_test_support::shipped;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_ledger_conforms() {
    let env = KubeEnv::start().await.expect("a real kube-apiserver (scripts/kube-assets)");
    let dir = tempfile::tempdir().expect("a dir");
    let agent = agent(&env, dir.path()).await;
    conformance::run_all(Arc::new(KubeLedger::new(agent))).await;
}

/// `deploy/`'s RBAC applied; a client of the agents' ServiceAccount.
async fn agent(env: &KubeEnv, dir: &std::path::Path) -> kube::Client {
    shipped::install_rbac(&env.client()).await.expect("deploy/'s CRDs and RBAC");
    shipped::account_client(env, shipped::AGENT_NAMESPACE, shipped::AGENT_ACCOUNT, dir)
        .await
        .expect("the agents' ServiceAccount")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_outage_is_retried_then_reported_and_loses_nothing() {
    let env = KubeEnv::start().await.expect("a real kube-apiserver (scripts/kube-assets)");
    let dir = tempfile::tempdir().expect("a dir");
    let agent = agent(&env, dir.path()).await;
    let ledger = KubeLedger::new(agent.clone())
        .with_backoff(Backoff { attempts: 3, first: Duration::from_millis(50) });
    let record = conformance::record("pv-outage", &[("n1", "a")]);
    let v1 = ledger.create(&record).await.expect("create");

    env.stop_apiserver();
    let err = ledger.get("pv-outage").await.expect_err("the API server is down");
    assert!(matches!(err, LedgerError::Store { .. }) && !err.is_race(), "{err}");
    assert!(err.to_string().contains("pv-outage"), "the error names the record: {err}");

    // Back within the retry window: the call succeeds.
    let patient = KubeLedger::new(agent)
        .with_backoff(Backoff { attempts: 8, first: Duration::from_millis(200) });
    let restart = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        env.start_apiserver().await.expect("restart the API server");
    };
    let (got, ()) = tokio::join!(patient.get("pv-outage"), restart);
    assert_eq!(got.expect("retried until the API server was back"), Some((record, v1)));
}

/// Two controller replicas: one leads, the other waits; the leader renews;
/// when it stops renewing, the other takes the Lease only after it expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_at_a_time_and_a_take_over_only_after_expiry() {
    use volagent::kube::lease::LeaderElector;
    let env = KubeEnv::start().await.expect("a real kube-apiserver (scripts/kube-assets)");
    let dir = tempfile::tempdir().expect("a dir");
    shipped::install_rbac(&env.client()).await.expect("deploy/'s CRDs and RBAC");
    let controller = shipped::account_client(
        &env,
        shipped::CONTROLLER_NAMESPACE,
        shipped::CONTROLLER_ACCOUNT,
        dir.path(),
    )
    .await
    .expect("the controller's ServiceAccount");
    let lease = Duration::from_secs(3);
    let ns = shipped::CONTROLLER_NAMESPACE;
    let a = LeaderElector::new(controller.clone(), ns, "volagent-controller", "replica-a", lease);
    let b = LeaderElector::new(controller, ns, "volagent-controller", "replica-b", lease);
    // Racing for a Lease that does not exist yet: exactly one wins.
    let (ra, rb) = tokio::join!(a.try_lead(), b.try_lead());
    let (ra, rb) = (ra.expect("a"), rb.expect("b"));
    assert!(ra ^ rb, "exactly one leads: a {ra}, b {rb}");
    let (leader, other) = if ra { (&a, &b) } else { (&b, &a) };
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert!(leader.try_lead().await.expect("renew"), "the leader renews");
        assert!(
            !other.try_lead().await.expect("try"),
            "the other waits while the lease is renewed"
        );
    }
    // The leader stops renewing: before expiry the other still waits.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!other.try_lead().await.expect("try"), "not before the lease expired");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(other.try_lead().await.expect("take over"), "after expiry the other takes over");
    assert!(!leader.try_lead().await.expect("try"), "and the old leader no longer leads");
}
