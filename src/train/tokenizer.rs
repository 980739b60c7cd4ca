//! Trains the byte-level BPE tokenizer of the bundled model on the domain corpus, with ChatML
//! special tokens and digits split one by one (numbers must copy digit by digit to generalise to
//! held-out amounts and ids).

use std::path::Path;

use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use super::TrainError;
use crate::runtime::fixture::SPECIAL_TOKENS;

/// Train a tokenizer with at most `vocab_size` entries (specials included) on `corpus`.
pub fn train_bpe(
    corpus: &[String],
    vocab_size: usize,
    min_frequency: u64,
) -> Result<Tokenizer, TrainError> {
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|t| AddedToken::from(t.to_string(), true))
        .collect();
    let mut tok = Tokenizer::new(BPE::default());
    let pre = PreTokenizerWrapper::Sequence(Sequence::new(vec![
        PreTokenizerWrapper::Digits(Digits::new(true)),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
    ]));
    tok.with_pre_tokenizer(Some(pre));
    tok.with_decoder(Some(ByteLevel::default()));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(min_frequency)
        .show_progress(false)
        .special_tokens(specials.clone())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tok.train(&mut trainer, corpus.iter())
        .map_err(|e| TrainError::Data(format!("tokenizer training failed: {e}")))?;
    tok.add_special_tokens(specials)
        .map_err(|e| TrainError::Data(format!("adding special tokens: {e}")))?;
    Ok(tok)
}

/// Save as `tokenizer.json`.
pub fn save(tok: &Tokenizer, path: &Path) -> Result<(), TrainError> {
    tok.save(path, false)
        .map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))
}
