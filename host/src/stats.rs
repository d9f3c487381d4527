//! Latency summaries for the benchmarks.

use std::time::Duration;

/// Latency percentiles in µs.
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub p50: f64,
    pub p99: f64,
    pub mean: f64,
    pub max: f64,
}

/// Sorts `samples` and summarises them. Empty input gives zeros.
pub fn summarize(samples: &mut [Duration]) -> Summary {
    if samples.is_empty() {
        return Summary { p50: 0.0, p99: 0.0, mean: 0.0, max: 0.0 };
    }
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let at = |q: f64| us(samples[((samples.len() - 1) as f64 * q).round() as usize]);
    let mean = samples.iter().map(|d| us(*d)).sum::<f64>() / samples.len() as f64;
    Summary { p50: at(0.50), p99: at(0.99), mean, max: us(samples[samples.len() - 1]) }
}
