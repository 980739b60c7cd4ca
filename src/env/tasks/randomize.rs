//! Entity randomisation: every train-split pool value (name, place, payee, item) replaced by a
//! random letter string wherever it occurs, the same one at every occurrence, so that a model
//! practises copying values it cannot have memorised. One rule ([`randomize_pool_words`] on
//! the JSON text) behind two uses, side by side: a conversation for the pretraining corpus
//! ([`with_random_entities`]) and a whole task for GRPO ([`randomized_task`]: a new id,
//! validated like a task file, refused when its gold run no longer replays).
//!
//! A replacement is never a test- or train-pool value, nor a word already in the text.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::env::ToolResponse;
use crate::env::tasks::{Task, validate_task};
use crate::message::Message;

/// Why a randomized copy could not be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum RandomizeError {
    /// Messages that do not survive the round trip through JSON.
    #[error("messages: {0}")]
    Messages(String),
    /// A task that cannot be written as JSON.
    #[error("task {task}: {message}")]
    Task { task: String, message: String },
    /// A randomized task that no longer parses or replays.
    #[error("randomized task {task}: {message}")]
    Randomized { task: String, message: String },
    /// A randomized task that fails validation on one field.
    #[error("randomized task {task}: field `{field}`: {message}")]
    Field {
        task: String,
        field: String,
        message: String,
    },
    /// A gold call of the randomized task answers other than the task says it does.
    #[error("randomized task {task}: gold call `{call}` answered {got:?}, expected {expected:?}")]
    GoldMismatch {
        task: String,
        call: String,
        got: Option<String>,
        expected: Option<String>,
    },
}

/// A random letter string of 3-8 letters (first letter upper case if `capital`), never a
/// test-pool value.
pub(crate) fn random_word_styled(rng: &mut StdRng, capital: bool) -> String {
    const LETTERS: &[u8] = b"abcdefghijklmnopqrstuvwxyz";
    loop {
        let len = rng.random_range(3..=8);
        let mut w: String = (0..len)
            .map(|_| char::from(LETTERS[rng.random_range(0..LETTERS.len())]))
            .collect();
        if capital {
            w = w[..1].to_uppercase() + &w[1..];
        }
        if !crate::env::domains::in_test_pools(&w) {
            return w;
        }
    }
}

/// `msgs` with every train-split pool value that occurs as a whole word replaced by a random
/// string (the same one at every occurrence, capitalised like the original; see
/// [`crate::train::pretrain::CorpusConfig::random_entity_fraction`]).
pub(crate) fn with_random_entities(
    msgs: &[Message],
    seed: u64,
) -> Result<Vec<Message>, RandomizeError> {
    let text = serde_json::to_string(msgs).map_err(|e| RandomizeError::Messages(e.to_string()))?;
    serde_json::from_str(&randomize_pool_words(&text, seed))
        .map_err(|e| RandomizeError::Messages(e.to_string()))
}

/// A copy of `task` with every train-split pool value (names, places, payees, items) replaced
/// by a random string wherever it occurs, seeded; validated like a task file, so a copy whose
/// gold run no longer replays is refused rather than played.
pub(crate) fn randomized_task(task: &Task, seed: u64) -> Result<Task, RandomizeError> {
    let text = serde_json::to_string(task).map_err(|e| RandomizeError::Task {
        task: task.id.clone(),
        message: e.to_string(),
    })?;
    let randomized = randomize_pool_words(&text, seed);
    if randomized == text {
        // Only ids and amounts: nothing to randomize, the task plays as it is.
        return Ok(task.clone());
    }
    let mut value: serde_json::Value =
        serde_json::from_str(&randomized).map_err(|e| RandomizeError::Randomized {
            task: task.id.clone(),
            message: e.to_string(),
        })?;
    value["id"] = serde_json::Value::from(format!("{}~r{:08x}", task.id, seed as u32));
    let out = validate_task(&value, 0).map_err(|(id, field, msg)| RandomizeError::Field {
        task: id,
        field,
        message: msg,
    })?;
    let steps = out.gold_steps().map_err(|e| RandomizeError::Randomized {
        task: out.id.clone(),
        message: e.to_string(),
    })?;
    let expected = out.turns.iter().flat_map(|t| t.actions.iter());
    for ((call, resp), gold) in steps.iter().zip(expected) {
        let got = match resp {
            ToolResponse::Error { code, .. } => Some(code.as_str()),
            _ => None,
        };
        if got != gold.error.as_deref() {
            return Err(RandomizeError::GoldMismatch {
                task: out.id.clone(),
                call: call.name.clone(),
                got: got.map(str::to_string),
                expected: gold.error.clone(),
            });
        }
    }
    Ok(out)
}

/// `text` with every train-split pool value that occurs as a whole word replaced by a random
/// letter string (the same one at every occurrence, capitalised like the original, never a
/// test- or train-pool value nor a word already in the text), seeded. Shared by the pretraining corpus and GRPO's randomized tasks.
fn randomize_pool_words(text: &str, seed: u64) -> String {
    let mut text = text.to_string();
    let mut rng = StdRng::seed_from_u64(seed);
    // Longest first, so that `Anna` is replaced before a shorter value could match inside it.
    let pool = crate::env::domains::train_pool_values();
    let mut values = pool.clone();
    values.sort_by_key(|v| std::cmp::Reverse(v.len()));
    for v in values {
        if find_word(&text, v).is_none() {
            continue;
        }
        let capital = v.chars().next().is_some_and(char::is_uppercase);
        // A replacement that is already a word of the text (another entity's replacement, a
        // JSON key, a pool value still to come) would merge two things into one.
        let new = loop {
            let w = random_word_styled(&mut rng, capital);
            if find_word(&text, &w).is_none() && !pool.contains(&w.as_str()) {
                break w;
            }
        };
        text = replace_words(&text, v, &new);
    }
    text
}

pub(crate) fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Byte offset of the first whole-word occurrence of `word` in `text`.
pub(crate) fn find_word(text: &str, word: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = text[from..].find(word) {
        let start = from + i;
        let end = start + word.len();
        let before = text[..start]
            .chars()
            .next_back()
            .is_none_or(|c| !is_word_char(c));
        let after = text[end..].chars().next().is_none_or(|c| !is_word_char(c));
        if before && after {
            return Some(start);
        }
        from = start + word.len().max(1);
    }
    None
}

/// `text` with every whole-word occurrence of `word` replaced by `new`.
pub(crate) fn replace_words(text: &str, word: &str, new: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = find_word(rest, word) {
        out.push_str(&rest[..i]);
        out.push_str(new);
        rest = &rest[i + word.len()..];
    }
    out.push_str(rest);
    out
}
