//! Tokenizer wrapper: HF `tokenizer.json` or one built from GGUF metadata, plus an incremental
//! decoder that streams text without ever splitting a UTF-8 character.

use std::path::Path;

use super::backend::RuntimeError;

/// A loaded tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
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
        Ok(Self { inner })
    }

    pub fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        Self { inner }
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

/// Streams decoded text from a growing list of ids; holds back output while the tail is an
/// incomplete UTF-8 sequence (decoded as U+FFFD).
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    emitted: usize,
    text: String,
}

impl IncrementalDecoder {
    /// Given all ids so far, return the new text that is safe to emit.
    pub fn push(&mut self, tok: &Tokenizer, ids: &[u32]) -> Result<String, RuntimeError> {
        let text = tok.decode(ids)?;
        if text.ends_with('\u{FFFD}') {
            self.text = text;
            return Ok(String::new());
        }
        let new = if text.len() >= self.emitted && text.is_char_boundary(self.emitted) {
            text[self.emitted..].to_string()
        } else {
            String::new()
        };
        self.emitted = text.len();
        self.text = text;
        Ok(new)
    }

    /// The full text decoded so far.
    pub fn text(&self) -> &str {
        &self.text
    }
}
