//! Tokenizer wrapper: HF `tokenizer.json` or one built from GGUF metadata, plus an incremental
//! decoder that streams text without ever splitting a UTF-8 character.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use super::backend::RuntimeError;

/// A loaded tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Each token's text on its own, built on first use (for constrained decoding).
    pieces: OnceLock<Arc<Vec<String>>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer(vocab={})", self.vocab_size())
    }
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self, RuntimeError> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| RuntimeError::File {
            path: path.display().to_string(),
            message: format!("invalid tokenizer: {e}"),
        })?;
        Ok(Self::from_inner(inner))
    }

    pub fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        Self {
            inner,
            pieces: OnceLock::new(),
        }
    }

    /// The text of every token id decoded on its own (special tokens: empty), computed once.
    pub fn pieces(&self) -> Arc<Vec<String>> {
        self.pieces
            .get_or_init(|| {
                Arc::new(
                    (0..self.vocab_size() as u32)
                        .map(|id| self.decode(&[id]).unwrap_or_default())
                        .collect(),
                )
            })
            .clone()
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encode rendered text; special tokens written in the text are recognised, none are added
    /// (as `apply_chat_template(tokenize=True)` does).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, RuntimeError> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(|e| RuntimeError::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec())
    }

    /// Decode, keeping special tokens out of the text.
    pub fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| RuntimeError::Tokenizer(e.to_string()))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
}

/// Streams decoded text from a growing list of ids, decoding only a window at each step (the
/// tokens since the last emitted piece plus the ones before it, for context), so that a
/// response of n tokens costs O(n) decoding, not O(n²). Holds back output while the tail is an
/// incomplete UTF-8 sequence (decoded as U+FFFD). The text it builds equals the decode of all
/// the ids whenever that does not end in U+FFFD (tested on real tokenizers).
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    /// Start of the decode window (the context for the next piece).
    prefix: usize,
    /// End of what has been emitted.
    read: usize,
    text: String,
}

impl IncrementalDecoder {
    /// Given all ids so far (the previous ones plus new ones at the end), append the new text
    /// that is safe to emit to [`Self::text`] and return it ("" while it is incomplete).
    pub fn push(&mut self, tok: &Tokenizer, ids: &[u32]) -> Result<String, RuntimeError> {
        if ids.len() < self.read {
            // Not a continuation: start over.
            *self = Self::default();
        }
        let before = tok.decode(&ids[self.prefix..self.read])?;
        let now = tok.decode(&ids[self.prefix..])?;
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let piece = match now.get(before.len()..).filter(|_| now.starts_with(&before)) {
            Some(p) => p.to_string(),
            // The window's decode rewrote earlier text: fall back to the whole decode.
            None => {
                let all = tok.decode(ids)?;
                let p = all
                    .get(self.text.len()..)
                    .filter(|_| all.starts_with(&self.text))
                    .unwrap_or_default()
                    .to_string();
                self.text = all;
                self.prefix = self.read;
                self.read = ids.len();
                return Ok(p);
            }
        };
        self.text.push_str(&piece);
        self.prefix = self.read;
        self.read = ids.len();
        Ok(piece)
    }

    /// The full text decoded so far.
    pub fn text(&self) -> &str {
        &self.text
    }
}
