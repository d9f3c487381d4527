//! The ledger on a real kube-apiserver passes the same conformance tests as
//! the embedded one, and an outage is retried, then reported, never lost.

mod kube_common;

use std::sync::Arc;
use std::time::Duration;
use volagent::kube::ledger::{Backoff, KubeLedger};
use volagent::ledger::{Ledger, LedgerError, conformance};
use volagent_kube_env::KubeEnv;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_ledger_conforms() {
    let env = KubeEnv::start().await.expect("a real kube-apiserver (scripts/kube-assets)");
    kube_common::install_crds(&env.client()).await;
    conformance::run_all(Arc::new(KubeLedger::new(env.client()))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_outage_is_retried_then_reported_and_loses_nothing() {
    let env = KubeEnv::start().await.expect("a real kube-apiserver (scripts/kube-assets)");
    kube_common::install_crds(&env.client()).await;
    let ledger = KubeLedger::new(env.client()).with_backoff(Backoff { attempts: 3, first: Duration::from_millis(50) });
    let record = conformance::record("pv-outage", &[("n1", "a")]);
    let v1 = ledger.create(&record).await.expect("create");

    env.stop_apiserver();
    let err = ledger.get("pv-outage").await.expect_err("the API server is down");
    assert!(matches!(err, LedgerError::Store { .. }) && !err.is_race(), "{err}");
    assert!(err.to_string().contains("pv-outage"), "the error names the record: {err}");

    // Back within the retry window: the call succeeds.
    let patient = KubeLedger::new(env.client()).with_backoff(Backoff { attempts: 8, first: Duration::from_millis(200) });
    let restart = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        env.start_apiserver().await.expect("restart the API server");
    };
    let (got, ()) = tokio::join!(patient.get("pv-outage"), restart);
    assert_eq!(got.expect("retried until the API server was back"), Some((record, v1)));
}
