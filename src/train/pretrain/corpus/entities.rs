//! Random-entity copies: every train-split pool value (name, place, payee, item) in a text
//! replaced by a random letter string, the same one at every occurrence, so that the model
//! practises copying values it cannot have memorised. Shared by the pretraining corpus and
//! GRPO's randomized tasks. A replacement is never a test- or train-pool value.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::message::Message;
use crate::train::TrainError;

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
/// [`super::CorpusConfig::random_entity_fraction`]).
pub(super) fn with_random_entities(
    msgs: &[Message],
    seed: u64,
) -> Result<Vec<Message>, TrainError> {
    let text =
        serde_json::to_string(msgs).map_err(|e| TrainError::Data(format!("messages: {e}")))?;
    serde_json::from_str(&randomize_pool_words(&text, seed))
        .map_err(|e| TrainError::Data(format!("messages: {e}")))
}

/// `text` with every train-split pool value that occurs as a whole word replaced by a random
/// letter string (the same one at every occurrence, capitalised like the original, never a
/// test- or train-pool value nor a word already in the text), seeded. Shared by the pretraining corpus and GRPO's randomized tasks.
pub(crate) fn randomize_pool_words(text: &str, seed: u64) -> String {
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

pub(super) fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Byte offset of the first whole-word occurrence of `word` in `text`.
pub(super) fn find_word(text: &str, word: &str) -> Option<usize> {
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
pub(super) fn replace_words(text: &str, word: &str, new: &str) -> String {
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
