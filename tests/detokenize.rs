//! Incremental detokenisation (what generation streams and stop strings see) equals the decode
//! of all the ids, on the committed real tokenizers: the bundled model's byte-level BPE and
//! SmolLM2's (models/smollm2-envace/tokenizer.json), for real text (multi-byte characters,
//! JSON, tool calls) pushed one token at a time and for random token sequences.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use envace::runtime::tokenizer::{IncrementalDecoder, Tokenizer};
use rand::{Rng, SeedableRng};

fn tokenizers() -> Vec<(&'static str, Tokenizer)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    [
        "models/envace-tiny/tokenizer.json",
        "models/smollm2-envace/tokenizer.json",
    ]
    .into_iter()
    .map(|p| (p, Tokenizer::from_file(&root.join(p)).unwrap()))
    .collect()
}

/// Push `ids` one at a time; the text built, and every piece's concatenation.
fn stream(tok: &Tokenizer, ids: &[u32]) -> (String, String) {
    let mut d = IncrementalDecoder::default();
    let mut pieces = String::new();
    for n in 1..=ids.len() {
        pieces.push_str(&d.push(tok, &ids[..n]).unwrap());
    }
    (d.text().to_string(), pieces)
}

#[test]
fn streamed_text_equals_the_whole_decode_on_real_text() {
    let texts = [
        "Pay 147 to the tailor with card card_220.",
        "<tool_call>{\"name\": \"transfer\", \"arguments\": {\"src\": \"acc_1\", \"amount\": 5}}</tool_call>",
        "Zürich → Kyiv: 3 nights, 1 240 € — ok? 日本語のテキスト 🙂🙂 done.",
        "  leading spaces\nand\ttabs\n\n",
    ];
    for (name, tok) in tokenizers() {
        for t in texts {
            let ids = tok.encode(t).unwrap();
            let whole = tok.decode(&ids).unwrap();
            let (text, pieces) = stream(&tok, &ids);
            assert_eq!(text, whole, "{name}: {t:?}");
            assert_eq!(pieces, whole, "{name}: {t:?}");
        }
    }
}

#[test]
fn streamed_text_equals_the_whole_decode_on_random_tokens() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for (name, tok) in tokenizers() {
        let vocab = tok.inner().get_vocab_size(true) as u32;
        for _ in 0..200 {
            let n = rng.random_range(1..60);
            let ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
            let whole = tok.decode(&ids).unwrap();
            let (text, pieces) = stream(&tok, &ids);
            assert_eq!(text, pieces, "{name}: {ids:?}");
            if !whole.ends_with('\u{FFFD}') {
                assert_eq!(text, whole, "{name}: {ids:?}");
            } else {
                // Held back: what was emitted is a prefix of the whole decode.
                assert!(whole.starts_with(&text), "{name}: {ids:?}");
            }
        }
    }
}
