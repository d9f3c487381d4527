//! A scenario file, as `volagent plugin test` reads it (shipped beside a
//! plugin, so no more trusted than one), in both of its syntaxes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;
use volagent::policy::scenario::{ScenarioError, parse_str};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    // Outcomes a call can have, to drive the comparison and its diff.
    let outcomes = [
        serde_json::json!({"plan": [{"Unmount": {"target": "/var/lib/kubelet/pods/u/volumes/volagent~local-pv/pv", "force": false}}]}),
        serde_json::json!({"decision": "Grant"}),
        serde_json::json!({"refused": "step 1 (attach-device): loop backing file /x is outside the dirs"}),
    ];
    for json in [true, false] {
        let mut parsed = parse_str(Path::new("fuzz"), text, json, "local-pv");
        // Seeds of other backends: parse them as their own too.
        if let Err(ScenarioError::WrongBackend { expected, .. }) = &parsed {
            parsed = parse_str(Path::new("fuzz"), text, json, &expected.clone());
        }
        for prepared in parsed.into_iter().flatten().flatten() {
            for actual in &outcomes {
                let _ = prepared.check(actual);
            }
        }
    }
});
