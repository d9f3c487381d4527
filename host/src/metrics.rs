//! Prometheus metrics of this process, one registry for all: operations,
//! their latencies, fence decisions, guest calls, backend health.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::OnceLock;
use std::time::Duration;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    pub operation: String,
    pub backend: String,
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpKind {
    pub operation: String,
    pub backend: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FenceLabels {
    pub backend: String,
    pub decision: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub backend: String,
    pub function: String,
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabels {
    /// The resource (plural) written.
    pub resource: String,
    /// allowed or denied.
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WipeLabels {
    pub method: String,
    /// The volume's size class: "<1Gi", "1-10Gi", "10-100Gi", "100Gi-1Ti", ">=1Ti".
    pub size: String,
    pub result: String,
}

/// A size as a few classes: labels must stay few.
pub fn size_class(bytes: u64) -> &'static str {
    const GIB: u64 = 1 << 30;
    match bytes {
        b if b < GIB => "<1Gi",
        b if b < 10 * GIB => "1-10Gi",
        b if b < 100 * GIB => "10-100Gi",
        b if b < 1024 * GIB => "100Gi-1Ti",
        _ => ">=1Ti",
    }
}

pub struct Metrics {
    registry: Registry,
    pub local_wipe_seconds: Family<WipeLabels, Histogram>,
    pub local_volumes: Gauge,
    pub operations: Family<OpLabels, Counter>,
    pub operation_seconds: Family<OpKind, Histogram>,
    pub fence_decisions: Family<FenceLabels, Counter>,
    pub plugin_calls: Family<CallLabels, Counter>,
    pub plugin_call_seconds: Family<OpKind, Histogram>,
    pub leader: Gauge,
    pub plugin_reloads: Counter,
    pub plugin_compiles: Counter,
    pub backends_degraded: Family<BackendLabel, Gauge>,
    pub stash_quarantined: Counter,
    pub agent_writes: Family<AdmissionLabels, Counter>,
    pub policy_recorded: Family<BackendLabel, Counter>,
    pub policy_recordings_dropped: Family<BackendLabel, Counter>,
    pub shadow_calls: Family<BackendLabel, Counter>,
    pub shadow_skipped: Family<BackendLabel, Counter>,
    pub shadow_differences: Family<ShadowLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShadowLabels {
    pub backend: String,
    /// What differed: `became-refused`, `steps`, `device`, ...
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabel {
    pub backend: String,
}

fn new_histogram_family() -> Family<OpKind, Histogram> {
    Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.000_01, 2.0, 24)))
}

impl Metrics {
    fn new() -> Metrics {
        let mut registry = Registry::with_prefix("volagent");
        let m = Metrics {
            registry: Registry::default(),
            // 0.1 s to about 36 h.
            local_wipe_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.1, 2.0, 21))
            }),
            local_volumes: Gauge::default(),
            operations: Family::default(),
            operation_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_5, 2.0, 18))
            }),
            fence_decisions: Family::default(),
            plugin_calls: Family::default(),
            plugin_call_seconds: new_histogram_family(),
            leader: Gauge::default(),
            plugin_reloads: Counter::default(),
            plugin_compiles: Counter::default(),
            backends_degraded: Family::default(),
            stash_quarantined: Counter::default(),
            agent_writes: Family::default(),
            policy_recorded: Family::default(),
            policy_recordings_dropped: Family::default(),
            shadow_calls: Family::default(),
            shadow_skipped: Family::default(),
            shadow_differences: Family::default(),
        };
        registry.register(
            "operations",
            "Mount and unmount requests by result",
            m.operations.clone(),
        );
        registry.register(
            "operation_seconds",
            "Time to serve a mount or unmount",
            m.operation_seconds.clone(),
        );
        registry.register(
            "fence_decisions",
            "Fence decisions by outcome",
            m.fence_decisions.clone(),
        );
        registry.register("plugin_calls", "Guest policy calls by result", m.plugin_calls.clone());
        registry.register(
            "plugin_call_seconds",
            "Time of one guest policy call",
            m.plugin_call_seconds.clone(),
        );
        registry.register(
            "controller_leader",
            "1 while this controller holds the lease",
            m.leader.clone(),
        );
        registry.register(
            "stash_quarantined",
            "MountRecords entries that could not be decoded and were set aside",
            m.stash_quarantined.clone(),
        );
        registry.register("plugin_reloads", "Passes over the plugin dir", m.plugin_reloads.clone());
        registry.register(
            "plugin_compiles",
            "Policy versions compiled (a version loaded before is served without a compile)",
            m.plugin_compiles.clone(),
        );
        registry.register(
            "backend_degraded",
            "1 while a backend's newest file is rejected",
            m.backends_degraded.clone(),
        );
        registry.register(
            "local_wipe_seconds",
            "Time to wipe a released local volume, by method, size and result",
            m.local_wipe_seconds.clone(),
        );
        registry.register(
            "local_volumes",
            "Local volumes the last discovery found on this node",
            m.local_volumes.clone(),
        );
        registry.register(
            "admission_agent_writes",
            "Agents' writes the admission webhook reviewed, by resource and result",
            m.agent_writes.clone(),
        );
        registry.register(
            "policy_recorded",
            "Policy calls written to the recording dir",
            m.policy_recorded.clone(),
        );
        registry.register(
            "policy_recordings_dropped",
            "Policy calls not recorded (the recorder was behind, or the write failed)",
            m.policy_recordings_dropped.clone(),
        );
        registry.register(
            "policy_shadow_calls",
            "Calls made on a candidate policy in the shadow of the serving one",
            m.shadow_calls.clone(),
        );
        registry.register(
            "policy_shadow_skipped",
            "Calls not made on the candidate: the shadow was behind",
            m.shadow_skipped.clone(),
        );
        registry.register(
            "policy_shadow_differences",
            "Calls on which the candidate policy answered otherwise than the serving one, by kind",
            m.shadow_differences.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    pub fn operation(&self, operation: &str, backend: &str, result: &str, took: Duration) {
        self.operations
            .get_or_create(&OpLabels {
                operation: operation.into(),
                backend: backend.into(),
                result: result.into(),
            })
            .inc();
        self.operation_seconds
            .get_or_create(&OpKind { operation: operation.into(), backend: backend.into() })
            .observe(took.as_secs_f64());
    }

    pub fn local_wipe(&self, method: &str, bytes: u64, result: &str, took: Duration) {
        let labels = WipeLabels {
            method: method.into(),
            size: size_class(bytes).into(),
            result: result.into(),
        };
        self.local_wipe_seconds.get_or_create(&labels).observe(took.as_secs_f64());
    }

    pub fn fence(&self, backend: &str, decision: &str) {
        self.fence_decisions
            .get_or_create(&FenceLabels { backend: backend.into(), decision: decision.into() })
            .inc();
    }

    pub fn agent_write(&self, resource: &str, allowed: bool) {
        let result = if allowed { "allowed" } else { "denied" };
        self.agent_writes
            .get_or_create(&AdmissionLabels { resource: resource.into(), result: result.into() })
            .inc();
    }

    pub fn backend_degraded(&self, backend: &str, value: i64) {
        self.backends_degraded.get_or_create(&BackendLabel { backend: backend.into() }).set(value);
    }

    pub fn recorded(&self, backend: &str) {
        self.policy_recorded.get_or_create(&BackendLabel { backend: backend.into() }).inc();
    }

    pub fn recordings_dropped(&self, backend: &str) {
        self.policy_recordings_dropped
            .get_or_create(&BackendLabel { backend: backend.into() })
            .inc();
    }

    pub fn shadow_compared(&self, backend: &str) {
        self.shadow_calls.get_or_create(&BackendLabel { backend: backend.into() }).inc();
    }

    pub fn shadow_skipped(&self, backend: &str) {
        self.shadow_skipped.get_or_create(&BackendLabel { backend: backend.into() }).inc();
    }

    pub fn shadow_difference(&self, backend: &str, kind: &str) {
        self.shadow_differences
            .get_or_create(&ShadowLabels { backend: backend.into(), kind: kind.into() })
            .inc();
    }

    pub fn plugin_call(&self, backend: &str, function: &str, result: &str, took: Duration) {
        self.plugin_calls
            .get_or_create(&CallLabels {
                backend: backend.into(),
                function: function.into(),
                result: result.into(),
            })
            .inc();
        self.plugin_call_seconds
            .get_or_create(&OpKind { operation: function.into(), backend: backend.into() })
            .observe(took.as_secs_f64());
    }
}

/// The process's metrics.
pub fn get() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

#[cfg(test)]
mod tests {
    #[test]
    fn recorded_values_are_exposed() {
        let m = super::get();
        m.operation("mount", "local-pv", "ok", std::time::Duration::from_millis(3));
        m.fence("local-pv", "deny");
        let text = m.encode();
        assert!(
            text.contains(
                r#"volagent_operations_total{operation="mount",backend="local-pv",result="ok"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"volagent_fence_decisions_total{backend="local-pv",decision="deny"} 1"#
            ),
            "{text}"
        );
        assert!(text.contains("volagent_operation_seconds_bucket"), "{text}");
    }
}
