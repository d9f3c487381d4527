//! The files applied to a real API server keep every field, and the
//! workloads, webhook and Service are what the cluster needs.

use super::*;
use crate::rbac::code;

#[tokio::test]
async fn manifests_apply_in_order_to_a_real_apiserver_and_keep_every_field() -> anyhow::Result<()> {
    let env = KubeEnv::start().await?;
    let all = apply_deploy(&env, true).await?;

    // Nothing the files set was dropped or changed by the API server.
    let mut wrong = Vec::new();
    for a in &all {
        let mut here = Vec::new();
        differences(&a.manifest.object, &a.answer, "", &mut here);
        wrong.extend(here.into_iter().map(|d| format!("{}: {d}", a.manifest.describe())));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));

    // The real ones exist; the workloads were dry runs.
    let admin = env.client();
    for ns in [NAMESPACE, CONTROLLER_NS] {
        Api::<Namespace>::all(admin.clone()).get(ns).await?;
    }
    for (ns, sa) in [(NAMESPACE, AGENT_SA), (CONTROLLER_NS, CONTROLLER_SA)] {
        Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(admin.clone(), ns)
            .get(sa)
            .await
            .with_context(|| format!("ServiceAccount {ns}/{sa}"))?;
    }
    let daemonsets: Api<DaemonSet> = Api::namespaced(admin.clone(), NAMESPACE);
    assert_eq!(code(&daemonsets.get(AGENT_SA).await), Some(404), "DaemonSet was a dry run");

    // A pod of each workload passes pod admission and validation (dry run):
    // the priority class resolves, privileged and hostPath are accepted.
    for (kind, name, ns) in
        [("DaemonSet", AGENT_SA, NAMESPACE), ("Deployment", CONTROLLER_SA, CONTROLLER_NS)]
    {
        let a = applied(&all, kind, name)?;
        let template = &a.answer["spec"]["template"];
        let pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": { "name": format!("{name}-admission"), "namespace": ns,
                          "labels": template["metadata"]["labels"] },
            "spec": template["spec"],
        });
        let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(admin.clone(), ns);
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(pod)?;
        let created = pods
            .create(&PostParams { dry_run: true, ..PostParams::default() }, &pod)
            .await
            .with_context(|| format!("a pod from {kind} {name}'s template"))?;
        if kind == "DaemonSet" {
            let priority = created.spec.and_then(|s| s.priority);
            assert_eq!(priority, Some(2_000_001_000), "system-node-critical resolved");
        }
    }

    workloads::agent_daemonset_is_as_a_node_needs(&all)?;
    workloads::mounter_daemonset_outlives_the_agent(&all)?;
    workloads::controller_deployment_is_locked_down(&all)?;
    webhook::reviews_the_agents_writes_failing_closed(&all)?;

    // Applying again works too (kubectl apply -k a second time).
    apply_deploy(&env, true).await.context("applying deploy/ a second time")?;
    Ok(())
}
