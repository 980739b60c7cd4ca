//! Bounded randomized testing of the parsers (the in-suite stand-in for the cargo-fuzz targets
//! under `fuzz/`): seeded mutations of realistic outputs — format tokens inserted, ranges
//! deleted or duplicated, truncation, multi-byte characters — checked for totality (no panic)
//! and for the invariants of what each parser accepts.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{ActorAction, SimOutput, parse_actor, parse_simulator};

/// Tokens small models produce (and get wrong) most.
const PIECES: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<execution_result>",
    "</execution_result>",
    "{",
    "}",
    "[",
    "]",
    "\"",
    "'",
    ":",
    ",",
    "\\",
    "\n",
    " ",
    "\"name\"",
    "\"arguments\"",
    "\"parameters\"",
    "True",
    "None",
    "```json",
    "```",
    "é",
    "→",
    "\"error_tool_call\"",
    "{\"code\":\"x\",\"message\":\"y\"}",
    "0",
    "-1.5e3",
    "null",
];

/// Mutate text a few times (always on character boundaries).
pub(crate) fn mutate(rng: &mut StdRng, text: &str) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    for _ in 0..rng.random_range(1..6) {
        let len = chars.len();
        match rng.random_range(0..6) {
            0 | 1 => {
                let at = rng.random_range(0..=len);
                let piece = PIECES[rng.random_range(0..PIECES.len())];
                chars.splice(at..at, piece.chars());
            }
            2 if len > 0 => {
                let a = rng.random_range(0..len);
                let b = rng.random_range(a..=len.min(a + 12));
                chars.drain(a..b);
            }
            3 if len > 0 => {
                let a = rng.random_range(0..len);
                let b = rng.random_range(a..=len.min(a + 30));
                let dup: Vec<char> = chars[a..b].to_vec();
                let at = rng.random_range(0..=chars.len());
                chars.splice(at..at, dup);
            }
            4 if len > 0 => chars.truncate(rng.random_range(0..len)),
            _ => {
                let at = rng.random_range(0..=len);
                chars.insert(at, char::from(rng.random_range(32u8..127)));
            }
        }
    }
    chars.into_iter().collect()
}

/// Mutate bytes (may break UTF-8 on purpose).
pub(crate) fn mutate_bytes(rng: &mut StdRng, bytes: &[u8]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for _ in 0..rng.random_range(1..5) {
        let len = b.len();
        match rng.random_range(0..5) {
            0 if len > 0 => {
                let i = rng.random_range(0..len);
                b[i] = rng.random();
            }
            1 if len > 0 => b.truncate(rng.random_range(0..len)),
            2 => {
                let i = rng.random_range(0..=len);
                b.insert(i, b'\n');
            }
            3 if len > 0 => {
                let a = rng.random_range(0..len);
                let e = rng.random_range(a..=len.min(a + 40));
                b.drain(a..e);
            }
            _ => {
                let i = rng.random_range(0..=len);
                b.insert(i, rng.random_range(0x20..0x7f));
            }
        }
    }
    b
}

const ACTOR_SEEDS: &[&str] = &[
    "<think>plan</think>\n<tool_call>\n{\"name\": \"transfer\", \"arguments\": {\"from\": \"chk\", \"amount\": 5}}\n</tool_call>",
    "I'll do both.<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call><tool_call>{\"name\":\"b\",\"arguments\":{\"x\":[1,2]}}</tool_call>",
    "<tool_call>{'name': 'freeze', 'arguments': {'card': 'c1', 'now': True}}",
    "Sure: {\"name\": \"get\", \"arguments\": \"{\\\"id\\\": 3}\"} done",
    "Your balance is 5 dollars.",
    "<think>hmm</think>",
];

const SIM_SEEDS: &[&str] = &[
    "<execution_result>{\"balance\": 5}</execution_result>",
    "<think>ok</think><execution_result>[{\"id\": 1}]</execution_result>",
    "<execution_result>{\"error_tool_call\": {\"code\": \"schema\", \"message\": \"bad\"}}</execution_result>",
];

#[test]
fn actor_parser_survives_mutated_outputs() {
    let mut rng = StdRng::seed_from_u64(0xE4AC);
    for i in 0..20_000 {
        let seed = ACTOR_SEEDS[i % ACTOR_SEEDS.len()];
        let text = mutate(&mut rng, seed);
        let turn = parse_actor(&text);
        if let ActorAction::Calls { calls } = &turn.action {
            assert!(!calls.is_empty(), "{text:?}");
            for c in calls {
                assert!(!c.name.trim().is_empty(), "{text:?}");
                assert!(c.arguments.is_object(), "{text:?}");
            }
        }
        if turn.action == ActorAction::Malformed {
            assert!(turn.events.iter().any(|e| e.is_failure()), "{text:?}");
        }
    }
}

#[test]
fn simulator_parser_survives_mutated_outputs() {
    let mut rng = StdRng::seed_from_u64(0x51A);
    let mut accepted = 0;
    for i in 0..20_000 {
        let text = mutate(&mut rng, SIM_SEEDS[i % SIM_SEEDS.len()]);
        if let Ok(t) = parse_simulator(&text) {
            accepted += 1;
            match t.output {
                SimOutput::Result { value } => {
                    let ok = value.as_object().is_some_and(|o| !o.is_empty())
                        || value.as_array().is_some_and(|a| !a.is_empty());
                    assert!(ok, "{text:?}");
                }
                SimOutput::Rejected { code, .. } => assert!(!code.is_empty(), "{text:?}"),
            }
        }
    }
    // Strict, but not so strict that harmless mutations (whitespace) never pass.
    assert!(accepted > 100, "accepted only {accepted}");
}

#[test]
fn parsers_survive_random_bytes() {
    let mut rng = StdRng::seed_from_u64(9);
    for _ in 0..5_000 {
        let len = rng.random_range(0..200);
        let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        let text = String::from_utf8_lossy(&bytes);
        let _ = parse_actor(&text);
        let _ = parse_simulator(&text);
    }
}
