//! Drills: short synthetic conversations beside the gold runs. Copy drills echo a list of
//! train-split entities (or random letter strings) exactly; tool drills act on made-up tools
//! (see [`super::tool_drill`]); calculation drills call, or decline, calculator functions (see
//! [`super::calc_drill`]); spelling drills copy real words into tool calls' JSON strings. A
//! random string is never a test-pool value.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::engine::profile::PromptProfile;
use crate::engine::prompts::actor::tools_json;
use crate::engine::prompts::simulator::{SimulatorPromptInput, simulator_prompt};
use crate::env::domains::sample_entities;
use crate::env::tasks::Split;
use crate::env::tasks::randomize::{random_word_styled, vocab_word};
use crate::env::{ToolAnnotations, ToolSpec};
use crate::message::{Message, MessageToolCall, ToolCall};
use crate::runtime::chat_template::ChatTemplate;
use crate::train::TrainError;

use super::text::{Segmented, actor_text, actor_text_last, simulator_text};

/// The actor text of tool drill `seed` and, with `with_sim`, the simulator text of its first
/// call (the response it got).
pub(super) fn tool_drill_texts(
    t: &ChatTemplate,
    profile: &PromptProfile,
    seed: u64,
    with_sim: bool,
    style: super::tool_drill::DrillStyle,
) -> Result<Vec<Segmented>, TrainError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let server = format!("mcp:{}", random_word_styled(&mut rng, false));
    let d = super::tool_drill::tool_drill_styled(
        seed,
        &crate::engine::spec::mcp_system(&server),
        style,
    );
    let mut out = vec![actor_text(t, &d.messages, &tools_json(&d.tools))?];
    if let (true, Some((call, response))) = (with_sim, d.calls.first()) {
        let at = d
            .messages
            .iter()
            .position(|m| !m.tool_calls.is_empty())
            .unwrap_or(d.messages.len() - 1);
        let prompt = simulator_prompt(
            &SimulatorPromptInput {
                tools: &d.tools,
                examples: &[],
                conversation: &d.messages[..=at],
                call,
            },
            &profile.sim_prompt,
        );
        out.push(simulator_text(t, &prompt, response)?);
    }
    Ok(out)
}

/// The actor texts of calculation drill `seed`: half of them with the system prompt the engine
/// gives an MCP server's tools, half with none (as BFCL asks); with probability `twins` also
/// its declining twin (the same request without the function it called, see
/// [`super::calc_drill::decline_twin`]).
pub(super) fn calc_drill_texts(
    t: &ChatTemplate,
    seed: u64,
    twins: f64,
) -> Result<Vec<Segmented>, TrainError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let system = rng.random::<bool>().then(|| {
        crate::engine::spec::mcp_system(&format!("mcp:{}", random_word_styled(&mut rng, false)))
    });
    let d = super::calc_drill::calc_drill(seed, system.as_deref());
    let mut out = vec![actor_text(t, &d.messages, &tools_json(&d.tools))?];
    if rng.random::<f64>() < twins
        && let Some(twin) = super::calc_drill::decline_twin(&d, seed)
    {
        out.push(actor_text(t, &twin.messages, &tools_json(&twin.tools))?);
    }
    Ok(out)
}

/// The argument names of the spelling drills, their plurals, and whether their values are
/// capitalised.
const SPELL_KEYS: &[(&str, &str, bool)] = &[
    ("payee", "payees", false),
    ("item", "items", false),
    ("product", "products", false),
    ("label", "labels", false),
    ("name", "names", true),
    ("city", "cities", true),
];

/// A spelling drill (see [`super::CorpusConfig::spell_drills_per_task`]): a user lists 3-8
/// words of [`crate::env::tasks::randomize::entity_words`] (`the arena, the clerk and the seamstress`; capitalised for names
/// and cities) and the assistant makes one call of a made-up `add_<key>` tool per word, the
/// word as the JSON string value. A tokenizer keeps most of these words whole after a space and
/// splits them inside a JSON string, so each call spells a word in other pieces than the
/// request gave it. Actor text only; the model learns the calls, not a reply.
pub(super) fn spell_drill(t: &ChatTemplate, seed: u64) -> Result<Segmented, TrainError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (key, plural, capital) = SPELL_KEYS[rng.random_range(0..SPELL_KEYS.len())];
    let n = rng.random_range(3..=8);
    let mut picked: Vec<String> = Vec::with_capacity(n);
    while picked.len() < n {
        match vocab_word(&mut rng, capital, |w| !picked.iter().any(|p| p == w)) {
            Some(w) => picked.push(w),
            None => break,
        }
    }
    let article = !capital && rng.random::<f64>() < 0.7;
    let shown: Vec<String> = picked
        .iter()
        .map(|w| {
            if article {
                format!("the {w}")
            } else {
                w.clone()
            }
        })
        .collect();
    let list = match shown.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => shown.join(""),
    };
    let name = format!("add_{key}");
    let request = match rng.random_range(0..3) {
        0 => format!("Add {list}."),
        1 => format!("Please add {list}, one {key} each."),
        _ => format!("Record these as {plural}: {list}."),
    };
    let spec = ToolSpec {
        name: name.clone(),
        description: format!("Add one {key}."),
        input_schema: serde_json::json!({
            "type": "object",
            "properties": {key: {"type": "string", "description": key}},
            "required": [key],
        }),
        annotations: ToolAnnotations {
            read_only: false,
            destructive: false,
            idempotent: false,
            open_world: false,
        },
    };
    let server = format!("mcp:{}", random_word_styled(&mut rng, false));
    let calls = picked
        .iter()
        .enumerate()
        .map(|(i, w)| MessageToolCall {
            id: format!("call_{i}"),
            kind: "function".into(),
            function: ToolCall {
                name: name.clone(),
                arguments: serde_json::json!({ key: w }),
            },
        })
        .collect();
    let msgs = vec![
        Message::system(crate::engine::spec::mcp_system(&server)),
        Message::user(request),
        Message {
            tool_calls: calls,
            ..Message::assistant("")
        },
    ];
    actor_text_last(t, &msgs, &tools_json(&[spec]))
}

/// System prompt of the copy drills.
pub const COPY_SYSTEM: &str = "Repeat the items exactly.";

/// A copy drill: 4-10 entities of the split, echoed in order (see
/// [`super::CorpusConfig::copy_per_task`]); each is replaced by a random letter string with
/// probability `random_fraction` ([`super::CorpusConfig::random_copy_fraction`]).
pub(super) fn copy_drill(
    t: &ChatTemplate,
    split: Split,
    seed: u64,
    random_fraction: f64,
) -> Result<Segmented, TrainError> {
    let n = 4 + (seed % 7) as usize;
    let mut entities = sample_entities(split, seed, n);
    if random_fraction > 0.0 {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x7261_6e64);
        for e in &mut entities {
            if rng.random::<f64>() < random_fraction {
                *e = random_word(&mut rng);
            }
        }
    }
    let items = entities.join(", ");
    let msgs = vec![
        Message::system(COPY_SYSTEM),
        Message::user(items.clone()),
        Message::assistant(items),
    ];
    actor_text_last(t, &msgs, &[])
}

/// A random letter string of 3-8 letters, capitalised half the time, never a test-pool value.
fn random_word(rng: &mut StdRng) -> String {
    let capital = rng.random::<bool>();
    random_word_styled(rng, capital)
}
