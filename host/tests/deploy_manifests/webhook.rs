//! The admission webhook's configuration and its Service.

use super::*;

/// Every write of agents' objects is reviewed, failing closed, at the
/// controller's Service.
pub(crate) fn reviews_the_agents_writes_failing_closed(all: &[Applied]) -> anyhow::Result<()> {
    // The webhook: every write of agents' objects, failing closed, at the
    // controller's Service.
    let hooks: k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration =
        serde_json::from_value(
            applied(all, "ValidatingWebhookConfiguration", WEBHOOK)?.answer.clone(),
        )?;
    let hook = hooks.webhooks.as_ref().and_then(|w| w.first()).context("a webhook")?;
    assert_eq!(hook.failure_policy.as_deref(), Some("Fail"));
    assert_eq!(hook.side_effects, "None");
    let service = hook.client_config.service.as_ref().context("a Service")?;
    assert_eq!(
        (service.namespace.as_str(), service.name.as_str(), service.path.as_deref()),
        (CONTROLLER_NS, "volagent-admission", Some("/validate"))
    );
    let resources: Vec<String> =
        hook.rules.iter().flatten().flat_map(|r| r.resources.clone().unwrap_or_default()).collect();
    for r in [
        "attachments",
        "nodecleanups",
        "nodelocalvolumes",
        "nodelocalvolumes/status",
        "fencerequests",
        "fencerequests/status",
    ] {
        assert!(resources.iter().any(|x| x == r), "the webhook reviews {r}: {resources:?}");
    }
    let svc: k8s_openapi::api::core::v1::Service =
        serde_json::from_value(applied(all, "Service", "volagent-admission")?.answer.clone())?;
    let port =
        svc.spec.and_then(|s| s.ports).unwrap_or_default().into_iter().next().context("a port")?;
    assert_eq!(
        (port.port, port.target_port),
        (
            443,
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(
                "webhook".into()
            ))
        )
    );
    Ok(())
}
