//! The API-server tier works: real AlreadyExists / Conflict semantics, RBAC,
//! and an API outage that etcd survives. These tests fail (they do not skip)
//! when the binaries are missing: run `scripts/kube-assets`.

use std::collections::BTreeMap;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use volagent_kube_env::{AGENT_USER, KubeEnv};

fn config_map(name: &str, value: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta { name: Some(name.into()), ..ObjectMeta::default() },
        data: Some(BTreeMap::from([("k".to_string(), value.to_string())])),
        ..ConfigMap::default()
    }
}

fn api_code(result: Result<ConfigMap, kube::Error>) -> Option<(u16, String)> {
    match result {
        Err(kube::Error::Api(status)) => Some((status.code, status.reason)),
        _ => None,
    }
}

#[tokio::test]
async fn conflicts_and_an_api_outage() -> anyhow::Result<()> {
    let env = KubeEnv::start().await?;
    let cms: Api<ConfigMap> = Api::namespaced(env.client(), "default");
    let pp = PostParams::default();

    let created = cms.create(&pp, &config_map("cm", "1")).await?;
    let again = cms.create(&pp, &config_map("cm", "2")).await;
    assert_eq!(api_code(again), Some((409, "AlreadyExists".to_string())), "second create");

    let mut newer = created.clone();
    newer.data = Some(BTreeMap::from([("k".to_string(), "2".to_string())]));
    cms.replace("cm", &pp, &newer).await?;
    let mut stale = created.clone(); // still carries the first resourceVersion
    stale.data = Some(BTreeMap::from([("k".to_string(), "3".to_string())]));
    assert_eq!(
        api_code(cms.replace("cm", &pp, &stale).await),
        Some((409, "Conflict".to_string())),
        "update with a stale resourceVersion"
    );

    env.stop_apiserver();
    let during = cms.get("cm").await;
    assert!(during.is_err(), "a request during the outage: {during:?}");

    env.start_apiserver().await?;
    let after = cms.get("cm").await.context("get after the restart")?;
    assert_eq!(after.data.and_then(|d| d.get("k").cloned()).as_deref(), Some("2"));
    Ok(())
}

#[tokio::test]
async fn the_agent_user_is_subject_to_rbac() -> anyhow::Result<()> {
    let env = KubeEnv::start().await?;
    let as_agent: Api<ConfigMap> = Api::namespaced(env.client_for(AGENT_USER)?, "default");
    let denied = as_agent.list(&Default::default()).await;
    assert!(
        matches!(&denied, Err(kube::Error::Api(s)) if s.code == 403),
        "list as {AGENT_USER} without a role: {denied:?}"
    );

    // The kubeconfig file works for a child process's client too.
    let parsed = kube::config::Kubeconfig::read_from(env.kubeconfig_path())?;
    let config =
        kube::Config::from_custom_kubeconfig(parsed, &kube::config::KubeConfigOptions::default())
            .await?;
    let as_admin: Api<ConfigMap> = Api::namespaced(kube::Client::try_from(config)?, "default");
    as_admin.list(&Default::default()).await?;
    Ok(())
}
