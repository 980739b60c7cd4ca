//! The shipped SmolLM2 policy (models/smollm2-envace: a LoRA adapter naming its base GGUF
//! relative to itself) loads from a fresh clone once scripts/fetch-fixtures has run, and plays a
//! test task it solves in the README's table (bank-test-0000) through the release binary in
//! shadow mode, recording its tool rendering in the session header.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use envace::session::EventBody;
use envace::session::format::GenRole;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The shipped adapter plays built-in bank task `task` in shadow mode, seed 0, through the
/// release binary with `extra` flags; the session goes to `dir`. Fails naming the fixture when
/// scripts/fetch-fixtures has not run.
fn play_shipped(dir: &Path, task: &str, extra: &[&str]) -> (Output, PathBuf) {
    let gguf = root().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        gguf.is_file(),
        "missing fixture {}: run scripts/fetch-fixtures",
        gguf.display()
    );
    let out = dir.join(format!("{task}.jsonl"));
    let o = Command::new(env!("CARGO_BIN_EXE_envace"))
        .current_dir(root())
        .args([
            "run",
            "--model",
            "models/smollm2-envace",
            "--env",
            "bank",
            "--task",
            task,
            "--mode",
            "shadow",
            "--seed",
            "0",
        ])
        .args(extra)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    (o, out)
}

#[test]
fn the_shipped_smollm2_adapter_solves_a_test_task_in_shadow_mode() {
    let dir = tempfile::tempdir().unwrap();
    let (o, out) = play_shipped(dir.path(), "bank-test-0000", &["--json"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["reward"], 1.0, "{v}");
    let s = envace::session::read_session(&out).unwrap();
    assert!(
        s.header
            .adapter
            .as_deref()
            .is_some_and(|a| a.ends_with("smollm2-envace"))
    );
    assert_eq!(s.header.model.tool_rendering.as_deref(), Some("template"));
}

/// Constrained decoding (`SamplingParams::tool_names`) on the shipped policy: asked to create a
/// file with file tools it never saw, it writes a name the list does not have; constrained, every
/// call names a listed tool, and prose and arguments stay its own.
#[test]
fn constrained_tool_names_keep_the_policys_calls_on_the_list() {
    use envace::engine::parse::parse_actor;
    use envace::message::Message;
    use envace::runtime::{CancelToken, DeviceChoice, LanguageModel, LocalModel, SamplingParams};
    let mut m = LocalModel::load(&root().join("models/smollm2-envace"), DeviceChoice::Cpu).unwrap();
    let names = [
        "read_text_file",
        "write_file",
        "list_directory",
        "move_file",
    ];
    let tools: Vec<serde_json::Value> = names
        .iter()
        .map(|n| {
            serde_json::json!({"type": "function", "function": {"name": n, "description": "",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                "required": ["path"]}}})
        })
        .collect();
    let prompt = m
        .render_chat(
            &[Message::user(
                "Create a file todo.txt with the content: call the bank",
            )],
            &tools,
            true,
            false,
        )
        .unwrap();
    let ids = m.encode(&prompt).unwrap();
    let free = SamplingParams {
        max_tokens: 96,
        ..SamplingParams::default()
    };
    let called = |text: &str| -> Vec<String> {
        parse_actor(text)
            .calls()
            .iter()
            .map(|c| c.name.clone())
            .collect()
    };
    let g = m
        .generate(&ids, 1, &free, None, &CancelToken::new())
        .unwrap();
    let unguarded = called(&g[0].text);
    assert!(
        unguarded.iter().any(|n| !names.contains(&n.as_str())),
        "the free policy was expected to invent a name here: {}",
        g[0].text
    );
    let guarded = SamplingParams {
        tool_names: names.iter().map(|s| s.to_string()).collect(),
        ..free
    };
    // Greedy and sampled branches alike.
    for p in [
        guarded.clone(),
        SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..guarded.clone()
        },
    ] {
        let g = m.generate(&ids, 4, &p, None, &CancelToken::new()).unwrap();
        for b in &g {
            let calls = called(&b.text);
            assert!(!calls.is_empty(), "{}", b.text);
            assert!(
                calls.iter().all(|n| names.contains(&n.as_str())),
                "{calls:?} in {}",
                b.text
            );
            assert!(b.logprobs.iter().all(|l| l.is_finite()), "{:?}", b.logprobs);
        }
    }
}

/// `scripts/copy-probe` feeds `scripts/copy-probe.prompt` (a noun in place of `{NOUN}`) to
/// `envace generate --raw`: with `tailor` its tokens must be exactly the engine's actor prompt of
/// bank-test-0007 plus the shipped policy's call up to the payee's value, or the probe measures
/// some other prompt than the one the policy plays.
#[test]
fn the_copy_probe_prompt_is_the_engines_prompt_for_bank_test_0007() {
    let dir = tempfile::tempdir().unwrap();
    let (o, out) = play_shipped(dir.path(), "bank-test-0007", &["--max-turns", "1"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    // Played to its end, solved or not (the shipped policy pays `the tailor` here).
    assert!(matches!(o.status.code(), Some(0 | 1)), "{stderr}");
    let session = envace::session::read_session(&out).unwrap();
    let generation = session
        .events
        .iter()
        .find_map(|e| match &e.event {
            EventBody::Generation(g) if g.role == GenRole::Actor => Some(g),
            _ => None,
        })
        .expect("an actor generation");
    let tok = tokenizers::Tokenizer::from_file(root().join("models/smollm2-envace/tokenizer.json"))
        .unwrap();
    let prompt = std::fs::read_to_string(root().join("scripts/copy-probe.prompt"))
        .unwrap()
        .replace("{NOUN}", "tailor");
    let probe: Vec<u32> = tok.encode(prompt, false).unwrap().get_ids().to_vec();
    let (engine_prompt, response) = (&generation.prompt_ids, &generation.response_ids);
    assert!(probe.len() > engine_prompt.len());
    assert_eq!(&probe[..engine_prompt.len()], &engine_prompt[..]);
    let head = &probe[engine_prompt.len()..];
    assert_eq!(head, &response[..head.len()]);
    let decoded = tok.decode(head, false).unwrap();
    assert!(decoded.ends_with("\"payee\":"), "{decoded}");
}
