//! Fuzz the tolerant actor parser: total over any UTF-8 text, and every call it returns has a
//! non-empty name and an object of arguments.
#![no_main]

use envace::engine::parse::{ActorAction, parse_actor};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let turn = parse_actor(text);
        if let ActorAction::Calls { calls } = &turn.action {
            assert!(!calls.is_empty());
            for c in calls {
                assert!(!c.name.trim().is_empty());
                assert!(c.arguments.is_object());
            }
        }
    }
});
