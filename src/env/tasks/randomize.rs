//! Entity randomisation: every train-split pool value (name, place, payee, item) replaced by a
//! random letter string wherever it occurs, the same one at every occurrence, so that a model
//! practises copying values it cannot have memorised. One rule ([`randomize_pool_words`] on
//! the JSON text) behind two uses, side by side: a conversation for the pretraining corpus
//! ([`with_random_entities`]) and a whole task for GRPO ([`randomized_task`]: a new id,
//! validated like a task file, refused when its gold run no longer replays).
//!
//! A replacement is never a test- or train-pool value, nor a word already in the text. Lower
//! case values (payees, items) may instead be replaced by real English nouns
//! ([`EntityStyle::Words`]): a tokenizer splits a real word differently inside a JSON string
//! than after a space (SmolLM2: ` tailor` is one token, `"tailor` is `tail`+`or`), which letter
//! strings never practise. [`EntityStyle::Vocab`] draws every value (names and places
//! capitalised) from ~11,000 such words (`assets/entity-words.txt`, `scripts/entity-words`), so
//! that the skill is spelling any word, not a list learnt by heart.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::env::ToolResponse;
use crate::env::tasks::{Task, validate_task};
use crate::message::{Message, Role};

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

/// What a random entity looks like.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum EntityStyle {
    /// Random letter strings (`Qevorl`, `tusk`) for every value.
    #[default]
    Letters,
    /// Payees and items become real nouns ([`PAYEE_NOUNS`], [`ITEM_NOUNS`]); names and places
    /// (capitalised) stay letter strings. System prompts are kept as they are.
    Words,
    /// Every value becomes a word of [`ENTITY_WORDS`] (capitalised for names and places): real
    /// English words that the tokenizer keeps whole after a space. System prompts are kept as
    /// they are.
    Vocab,
}

/// The words of [`EntityStyle::Vocab`], one per line: SmolLM2's vocabulary entries `Ġ` + 4-11
/// lower-case letters that are Webster's Second (web2) words, less the domains' pool values and
/// the held-out nouns of `assets/copy-probe-nouns.txt` (`scripts/entity-words` writes it).
const ENTITY_WORDS: &str = include_str!("../../../assets/entity-words.txt");

/// [`ENTITY_WORDS`] as a list.
pub(crate) fn entity_words() -> &'static [&'static str] {
    static WORDS: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    WORDS.get_or_init(|| {
        ENTITY_WORDS
            .lines()
            .map(str::trim)
            .filter(|w| !w.is_empty())
            .collect()
    })
}

/// Real lower-case nouns for [`EntityStyle::Words`] in place of a payee: trades and shops,
/// none of them a train- or test-pool value (a test checks).
#[rustfmt::skip]
pub(crate) const PAYEE_NOUNS: &[&str] = &[
    "carpenter", "jeweller", "cobbler", "mechanic", "locksmith", "tutor", "courier", "caterer",
    "painter", "electrician", "glazier", "roofer", "gardener", "cleaner", "notary", "lawyer",
    "accountant", "architect", "surveyor", "farmer", "fishmonger", "greengrocer", "baker",
    "brewery", "winery", "deli", "diner", "canteen", "salon", "clinic", "hospital", "school",
    "nursery", "kennel", "cattery", "marina", "station", "pharmacist", "stationer", "ironmonger",
    "tobacconist", "newsagent", "upholsterer", "saddler", "potter", "weaver", "framer", "engraver",
    "hairdresser", "masseur", "physio", "surgeon", "midwife", "chiropodist", "veterinarian",
    "chauffeur", "porter", "landlord", "council", "charity", "boutique", "creamery", "foundry",
    "garden centre", "hardware store", "launderette", "workshop",
];

/// Real lower-case nouns for [`EntityStyle::Words`] in place of an item: household things,
/// none of them a train- or test-pool value (a test checks).
#[rustfmt::skip]
pub(crate) const ITEM_NOUNS: &[&str] = &[
    "spoon", "fork", "knife", "teapot", "saucepan", "skillet", "colander", "whisk", "grater",
    "blanket", "curtain", "mattress", "wardrobe", "cabinet", "drawer", "cushion", "duvet", "carpet",
    "doormat", "umbrella", "jacket", "sweater", "glove", "sock", "sandal", "sneaker", "wallet",
    "backpack", "suitcase", "notebook", "pencil", "stapler", "monitor", "keyboard", "speaker",
    "headset", "charger", "cable", "battery", "torch", "lantern", "shovel", "rake", "hose",
    "wrench", "screwdriver", "saw", "chisel", "pliers", "glue", "paint", "easel", "canvas",
    "guitar", "violin", "drum", "piano", "trumpet", "flute", "bicycle", "scooter", "skateboard",
    "kayak", "paddle", "compass", "binoculars", "telescope", "microscope", "camera", "tripod",
    "album", "puzzle", "kite", "marble", "chessboard", "dartboard", "trophy", "medal", "badge",
    "ribbon", "button", "zipper", "thimble", "needle", "thread", "yarn", "loom", "kiln", "anvil",
    "barrel", "crate", "pallet", "trolley", "wagon", "sled", "canoe", "hammock", "toolbox",
    "thermos", "kettlebell", "dumbbell", "treadmill",
];

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
            w = capitalised(&w);
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
    style: EntityStyle,
) -> Result<Vec<Message>, RandomizeError> {
    let err = |e: serde_json::Error| RandomizeError::Messages(e.to_string());
    if style == EntityStyle::Letters {
        // The whole conversation, system prompt included (`the bank desk` → `the bank Qevorl`):
        // kept so that the corpora of earlier commands reproduce.
        let text = serde_json::to_string(msgs).map_err(err)?;
        return serde_json::from_str(&randomize_pool_words(&text, seed, style)).map_err(err);
    }
    // The system prompt names no entity (`desk` in "the bank desk" is not the item).
    let rest: Vec<&Message> = msgs.iter().filter(|m| m.role != Role::System).collect();
    let text = serde_json::to_string(&rest).map_err(err)?;
    let mut new: std::vec::IntoIter<Message> =
        serde_json::from_str::<Vec<Message>>(&randomize_pool_words(&text, seed, style))
            .map_err(err)?
            .into_iter();
    msgs.iter()
        .map(|m| match m.role {
            Role::System => Ok(m.clone()),
            _ => new
                .next()
                .ok_or_else(|| RandomizeError::Messages("a message was lost".into())),
        })
        .collect()
}

/// A copy of `task` with every train-split pool value (names, places, payees, items) replaced
/// by a random string (payees and items by real nouns in [`EntityStyle::Words`]) wherever it
/// occurs, seeded; validated like a task file, so a copy whose
/// gold run no longer replays is refused rather than played.
pub(crate) fn randomized_task(
    task: &Task,
    seed: u64,
    style: EntityStyle,
) -> Result<Task, RandomizeError> {
    let text = serde_json::to_string(task).map_err(|e| RandomizeError::Task {
        task: task.id.clone(),
        message: e.to_string(),
    })?;
    let randomized = randomize_pool_words(&text, seed, style);
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
/// test- or train-pool value nor a word already in the text), seeded; with
/// [`EntityStyle::Words`] a payee or an item becomes a noun of [`PAYEE_NOUNS`] or [`ITEM_NOUNS`]
/// instead (a letter string when every noun is taken). Shared by the pretraining corpus and GRPO's randomized
/// tasks.
fn randomize_pool_words(text: &str, seed: u64, style: EntityStyle) -> String {
    let mut text = text.to_string();
    let mut rng = StdRng::seed_from_u64(seed);
    // Longest first, so that `Anna` is replaced before a shorter value could match inside it.
    let pool = crate::env::domains::train_pool_values();
    let payees = crate::env::domains::Pools::new(crate::env::tasks::Split::Train).payees;
    let mut values = pool.clone();
    values.sort_by_key(|v| std::cmp::Reverse(v.len()));
    for v in values {
        if find_word(&text, v).is_none() {
            continue;
        }
        let capital = v.chars().next().is_some_and(char::is_uppercase);
        // A replacement that is already a word of the text (another entity's replacement, a
        // JSON key, a pool value still to come) would merge two things into one.
        let free = |w: &str| {
            find_word(&text, w).is_none()
                && !pool.contains(&w)
                && !crate::env::domains::in_test_pools(w)
        };
        let noun = if style == EntityStyle::Vocab {
            vocab_word(&mut rng, capital, free)
        } else if style == EntityStyle::Words && !capital {
            let list = if payees.contains(&v) {
                PAYEE_NOUNS
            } else {
                ITEM_NOUNS
            };
            let mut nouns: Vec<&str> = list.iter().copied().filter(|w| free(w)).collect();
            nouns.shuffle(&mut rng);
            nouns.first().map(|w| w.to_string())
        } else {
            None
        };
        let new = match noun {
            Some(w) => w,
            None => loop {
                let w = random_word_styled(&mut rng, capital);
                if free(&w) {
                    break w;
                }
            },
        };
        text = replace_words(&text, v, &new);
    }
    text
}

/// A word of [`entity_words`] (first letter upper case if `capital`) that `free` accepts, or
/// `None` after 64 draws that it did not. Shared by the random entities and the spelling drills.
pub(crate) fn vocab_word(
    rng: &mut StdRng,
    capital: bool,
    free: impl Fn(&str) -> bool,
) -> Option<String> {
    let words = entity_words();
    if words.is_empty() {
        return None;
    }
    (0..64).find_map(|_| {
        let w = words[rng.random_range(0..words.len())];
        let w = if capital {
            capitalised(w)
        } else {
            w.to_string()
        };
        free(&w).then_some(w)
    })
}

/// `w` with its first letter upper case (ASCII words).
pub(crate) fn capitalised(w: &str) -> String {
    let mut c = w.chars();
    c.next()
        .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
        .unwrap_or_default()
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
