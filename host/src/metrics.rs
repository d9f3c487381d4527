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

pub struct Metrics {
    registry: Registry,
    pub operations: Family<OpLabels, Counter>,
    pub operation_seconds: Family<OpKind, Histogram>,
    pub fence_decisions: Family<FenceLabels, Counter>,
    pub plugin_calls: Family<CallLabels, Counter>,
    pub plugin_call_seconds: Family<OpKind, Histogram>,
    pub leader: Gauge,
    pub plugin_reloads: Counter,
    pub backends_degraded: Family<BackendLabel, Gauge>,
    pub stash_quarantined: Counter,
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
            operations: Family::default(),
            operation_seconds: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.000_5, 2.0, 18))),
            fence_decisions: Family::default(),
            plugin_calls: Family::default(),
            plugin_call_seconds: new_histogram_family(),
            leader: Gauge::default(),
            plugin_reloads: Counter::default(),
            backends_degraded: Family::default(),
            stash_quarantined: Counter::default(),
        };
        registry.register("operations", "Mount and unmount requests by result", m.operations.clone());
        registry.register("operation_seconds", "Time to serve a mount or unmount", m.operation_seconds.clone());
        registry.register("fence_decisions", "Fence decisions by outcome", m.fence_decisions.clone());
        registry.register("plugin_calls", "Guest policy calls by result", m.plugin_calls.clone());
        registry.register("plugin_call_seconds", "Time of one guest policy call", m.plugin_call_seconds.clone());
        registry.register("controller_leader", "1 while this controller holds the lease", m.leader.clone());
        registry.register("stash_quarantined", "Stash entries that could not be decoded and were set aside", m.stash_quarantined.clone());
        registry.register("plugin_reloads", "Passes over the plugin dir", m.plugin_reloads.clone());
        registry.register("backend_degraded", "1 while a backend's newest file is rejected", m.backends_degraded.clone());
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
        self.operations.get_or_create(&OpLabels { operation: operation.into(), backend: backend.into(), result: result.into() }).inc();
        self.operation_seconds.get_or_create(&OpKind { operation: operation.into(), backend: backend.into() }).observe(took.as_secs_f64());
    }

    pub fn fence(&self, backend: &str, decision: &str) {
        self.fence_decisions.get_or_create(&FenceLabels { backend: backend.into(), decision: decision.into() }).inc();
    }

    pub fn backend_degraded(&self, backend: &str, value: i64) {
        self.backends_degraded.get_or_create(&BackendLabel { backend: backend.into() }).set(value);
    }

    pub fn plugin_call(&self, backend: &str, function: &str, result: &str, took: Duration) {
        self.plugin_calls.get_or_create(&CallLabels { backend: backend.into(), function: function.into(), result: result.into() }).inc();
        self.plugin_call_seconds.get_or_create(&OpKind { operation: function.into(), backend: backend.into() }).observe(took.as_secs_f64());
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
        assert!(text.contains(r#"volagent_operations_total{operation="mount",backend="local-pv",result="ok"} 1"#), "{text}");
        assert!(text.contains(r#"volagent_fence_decisions_total{backend="local-pv",decision="deny"} 1"#), "{text}");
        assert!(text.contains("volagent_operation_seconds_bucket"), "{text}");
    }
}
