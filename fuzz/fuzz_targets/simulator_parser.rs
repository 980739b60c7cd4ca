//! Fuzz the strict simulator parser: total over any UTF-8 text; an accepted result is a
//! non-empty JSON object or array.
#![no_main]

use envace::engine::parse::{SimOutput, parse_simulator};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(turn) = parse_simulator(text) {
            match turn.output {
                SimOutput::Result { value } => {
                    let non_empty = value.as_object().is_some_and(|o| !o.is_empty())
                        || value.as_array().is_some_and(|a| !a.is_empty());
                    assert!(non_empty);
                }
                SimOutput::Rejected { code, .. } => assert!(!code.is_empty()),
            }
        }
    }
});
