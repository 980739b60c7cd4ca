//! Real checkpoints' chat templates (tests/fixtures/templates: Qwen2.5-Instruct, Qwen3,
//! SmolLM2-135M-Instruct) with a tool-using conversation: the model must see every tool, call and
//! result whether or not its template has a tools section; renderings of the templates' own
//! tool sections match Python jinja2 (as transformers' apply_chat_template renders them, see
//! scripts/render-template-fixtures) byte for byte; prompts stay prefixes of their continuations;
//! and the calls a model would emit in its format parse back into the same calls.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::PathBuf;

use envace::engine::parse::{ActorAction, parse_actor};
use envace::message::{Message, Role, ToolCall};
use envace::runtime::chat_template::{ChatTemplate, from_tokenizer_config, python_json};
use envace::runtime::tool_format::ToolRendering;
use serde_json::Value;

const QWEN25: &str = "qwen2.5-instruct";
const QWEN3: &str = "qwen3";
const SMOLLM2: &str = "smollm2-135m-instruct";

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates")
}

/// A model's template as transformers loads it: `chat_template.jinja` beside
/// `tokenizer_config.json` wins over the config's own `chat_template`.
fn load(model: &str) -> ChatTemplate {
    let dir = fixtures().join(model);
    let text = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    let mut cfg: Value = serde_json::from_str(&text).unwrap();
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        cfg["chat_template"] = Value::String(std::fs::read_to_string(jinja).unwrap());
    }
    let (src, bos, eos) = from_tokenizer_config(&cfg).unwrap();
    ChatTemplate::new(&src, &bos, &eos).unwrap()
}

fn conversation() -> (Vec<Message>, Vec<Value>) {
    let text = std::fs::read_to_string(fixtures().join("conversation.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let messages: Vec<Message> = serde_json::from_value(v["messages"].clone()).unwrap();
    let tools: Vec<Value> = serde_json::from_value(v["tools"].clone()).unwrap();
    (messages, tools)
}

fn expected(name: &str) -> String {
    std::fs::read_to_string(fixtures().join("expected").join(format!("{name}.txt"))).unwrap()
}

/// Every (model, rendering, enable_thinking) pair under test: each fixture as detected, and
/// SmolLM2 also with the Hermes format forced.
fn setups() -> Vec<(&'static str, ChatTemplate, bool)> {
    vec![
        (QWEN25, load(QWEN25), true),
        (QWEN3, load(QWEN3), true),
        (SMOLLM2, load(SMOLLM2), true),
        (
            SMOLLM2,
            load(SMOLLM2).with_tool_rendering(ToolRendering::SystemHermes),
            true,
        ),
    ]
}

fn calls_of(m: &Message) -> Vec<ToolCall> {
    m.tool_calls.iter().map(|c| c.function.clone()).collect()
}

#[test]
fn qwen_templates_take_tools_and_smollm2_gets_its_own_format() {
    assert_eq!(load(QWEN25).tool_rendering, ToolRendering::Template);
    assert_eq!(load(QWEN3).tool_rendering, ToolRendering::Template);
    assert_eq!(load(SMOLLM2).tool_rendering, ToolRendering::SystemSmolLM2);
}

#[test]
fn every_fixture_prompt_shows_all_tools_calls_and_responses() {
    let (msgs, tools) = conversation();
    for (model, t, thinking) in setups() {
        let who = format!("{model} ({})", t.tool_rendering);
        let out = t.render(&msgs, &tools, false, thinking).unwrap();
        for tool in &tools {
            let f = &tool["function"];
            let name = f["name"].as_str().unwrap();
            assert!(
                out.contains(&format!("\"name\": \"{name}\"")),
                "{who}: tool {name}"
            );
            assert!(
                out.contains(&python_json(&f["description"])),
                "{who}: {name} description"
            );
            assert!(
                out.contains(&python_json(&f["parameters"])),
                "{who}: {name} schema"
            );
        }
        let calls: Vec<ToolCall> = msgs.iter().flat_map(calls_of).collect();
        assert_eq!(calls.len(), 2);
        for c in &calls {
            let call = format!(
                "{{\"name\": \"{}\", \"arguments\": {}}}",
                c.name,
                python_json(&c.arguments)
            );
            assert!(out.contains(&call), "{who}: call {call}");
        }
        for m in msgs.iter().filter(|m| m.role == Role::Tool) {
            let block = format!("<tool_response>\n{}\n</tool_response>", m.content);
            assert!(out.contains(&block), "{who}: response {block}");
        }
        assert!(
            !out.contains("<|im_start|>tool"),
            "{who}: a tool turn the model never saw"
        );
        assert!(
            out.contains(&msgs[0].content),
            "{who}: the task's system text"
        );
    }
}

#[test]
fn qwen25_tools_section_matches_python_jinja2() {
    let (msgs, tools) = conversation();
    let t = load(QWEN25);
    let full = t.render(&msgs, &tools, false, true).unwrap();
    assert_eq!(full, expected("qwen2.5-instruct.full"));
    let next = t
        .render(&msgs[..msgs.len() - 1], &tools, true, true)
        .unwrap();
    assert_eq!(next, expected("qwen2.5-instruct.next"));
}

#[test]
fn qwen3_tools_section_matches_python_jinja2_with_thinking_on_and_off() {
    let (msgs, tools) = conversation();
    let t = load(QWEN3);
    assert_eq!(
        t.render(&msgs, &tools, false, true).unwrap(),
        expected("qwen3.full")
    );
    let pending = &msgs[..msgs.len() - 1];
    assert_eq!(
        t.render(pending, &tools, true, true).unwrap(),
        expected("qwen3.next.thinking")
    );
    assert_eq!(
        t.render(pending, &tools, true, false).unwrap(),
        expected("qwen3.next.no-thinking")
    );
}

#[test]
fn smollm2_plain_conversations_match_python_jinja2() {
    let (msgs, _) = conversation();
    let plain = vec![
        msgs[0].clone(),
        msgs[1].clone(),
        Message::assistant("Hello."),
        Message::user("Thanks!"),
    ];
    let t = load(SMOLLM2);
    assert_eq!(
        t.render(&plain, &[], true, true).unwrap(),
        expected("smollm2-135m-instruct.plain")
    );
    assert_eq!(
        t.render(&plain[1..], &[], true, true).unwrap(),
        expected("smollm2-135m-instruct.plain-no-system")
    );
}

#[test]
fn prompts_are_prefixes_of_their_continuations_at_assistant_turns() {
    let (msgs, tools) = conversation();
    for (model, t, thinking) in setups() {
        let full = t.render(&msgs, &tools, false, thinking).unwrap();
        for k in (0..msgs.len()).filter(|&k| msgs[k].role == Role::Assistant) {
            let prompt = t.render(&msgs[..k], &tools, true, thinking).unwrap();
            let turn = t.render(&msgs[..=k], &tools, false, thinking).unwrap();
            let who = format!("{model} ({}) k={k}", t.tool_rendering);
            assert!(turn.starts_with(&prompt), "{who}");
            assert!(full.starts_with(&prompt), "{who}");
        }
    }
}

/// Qwen3's own template opens the next turn with an empty think block when thinking is off but
/// prints earlier assistant turns without it: such prompts are not prefixes of the next ones.
#[test]
fn qwen3_without_thinking_is_not_prefix_stable_by_its_own_template() {
    let (msgs, tools) = conversation();
    let t = load(QWEN3);
    let prompt = t.render(&msgs[..2], &tools, true, false).unwrap();
    let full = t.render(&msgs, &tools, false, false).unwrap();
    assert!(prompt.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    assert!(!full.starts_with(&prompt));
}

#[test]
fn what_each_format_makes_the_model_emit_parses_back_into_the_same_calls() {
    let (msgs, tools) = conversation();
    for (model, t, thinking) in setups() {
        for k in (0..msgs.len()).filter(|&k| msgs[k].role == Role::Assistant) {
            let who = format!("{model} ({}) k={k}", t.tool_rendering);
            let prompt = t.render(&msgs[..k], &tools, true, thinking).unwrap();
            let turn = t.render(&msgs[..=k], &tools, false, thinking).unwrap();
            let emitted = turn[prompt.len()..]
                .strip_suffix("<|im_end|>\n")
                .unwrap_or_else(|| panic!("{who}: turn does not end with <|im_end|>"));
            let parsed = parse_actor(emitted);
            assert!(
                parsed.events.iter().all(|e| !e.is_failure()),
                "{who}: {:?}",
                parsed.events
            );
            if msgs[k].tool_calls.is_empty() {
                assert_eq!(parsed.action, ActorAction::Answer, "{who}");
                assert_eq!(parsed.content, msgs[k].content, "{who}");
            } else {
                assert_eq!(
                    parsed.calls(),
                    calls_of(&msgs[k]).as_slice(),
                    "{who}: {emitted}"
                );
            }
        }
    }
}

/// The shipped models speak exactly the compact templates the code renders their corpora with
/// (both are built from one macro; a drift would silently change what the models see).
#[test]
fn shipped_models_carry_the_compact_templates_byte_for_byte() {
    use envace::runtime::chat_template::{COMPACT_TOOLS_TEMPLATE, COMPACT_TOOLS_TEMPLATE_V2};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let template = |m: &str| -> String {
        let p = root.join(m).join("tokenizer_config.json");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        v["chat_template"].as_str().unwrap().to_string()
    };
    assert_eq!(template("models/envace-tiny"), COMPACT_TOOLS_TEMPLATE);
    assert_eq!(template("models/smollm2-envace"), COMPACT_TOOLS_TEMPLATE_V2);
}
