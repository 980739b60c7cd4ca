//! Token-level credit for GRPO: which generated tokens copy a value from the conversation.
//!
//! Success-only GRPO gives every token of an episode the same advantage, so a status or a name
//! the actor copied correctly from a tool response is reinforced as if the model had chosen it:
//! over many episodes the answer templates drift towards the values that happened to be right
//! most often ("is cancelled" over "is active", docs/TRAINING.md session 16). With
//! `train --mask-copies` the policy term skips the tokens of words that the conversation already
//! holds (a value in a user message, a tool response or an earlier turn), so RL trains what the
//! model decides — which tool, which key, a value it computed or made up — and not which value
//! came back. Words of the system turn (tool and parameter names) and JSON keys are never
//! masked: they are the decisions. The KL and entropy terms still cover every token.

use std::collections::HashSet;

use crate::runtime::tokenizer::Tokenizer;

/// A word: a maximal run of alphanumerics, `_`, `.`, `-` and `@`, trimmed of leading and
/// trailing `.` and `-` (sentence ends, dashes). Yields `(start, end)` byte offsets.
fn words(text: &str) -> Vec<(usize, usize)> {
    let is_word = |c: char| c.is_alphanumeric() || matches!(c, '_' | '.' | '-' | '@');
    let mut out = Vec::new();
    let mut start: Option<usize> = None;
    let push = |s: usize, e: usize, out: &mut Vec<(usize, usize)>| {
        let w = &text[s..e];
        let trimmed = w.trim_matches(['.', '-']);
        if !trimmed.is_empty() {
            let lead = w.len() - w.trim_start_matches(['.', '-']).len();
            out.push((s + lead, s + lead + trimmed.len()));
        }
    };
    for (i, c) in text.char_indices() {
        match (is_word(c), start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                push(s, i, &mut out);
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        push(s, text.len(), &mut out);
    }
    out
}

/// The set of words in `text`.
fn word_set(text: &str) -> HashSet<&str> {
    words(text).into_iter().map(|(s, e)| &text[s..e]).collect()
}

/// Whether the word ending at `end` is a JSON object key (`"word": …`).
fn is_json_key(text: &str, end: usize) -> bool {
    let rest = &text[end..];
    rest.strip_prefix('"')
        .is_some_and(|r| r.trim_start().starts_with(':'))
}

/// Whether the word at `start..end` is a markup tag's name (`<tool_call>`, `</tool_call>`):
/// structure the template writes, not a value.
fn is_tag(text: &str, start: usize, end: usize) -> bool {
    let before = &text[..start];
    (before.ends_with('<') || before.ends_with("</")) && text[end..].starts_with('>')
}

/// Per-response-token weights for the policy term: 0 for a token that overlaps a word copied
/// from the conversation, 1 otherwise. `system` is the system turn's text (tool and parameter
/// names live there), `conversation` everything after it; `pieces` the response decoded one
/// token at a time (their concatenation is the response text).
pub fn copy_mask_text(system: &str, conversation: &str, pieces: &[String]) -> Vec<u8> {
    let text: String = pieces.concat();
    let sys = word_set(system);
    let ctx = word_set(conversation);
    let copied: Vec<(usize, usize)> = words(&text)
        .into_iter()
        .filter(|&(s, e)| {
            let w = &text[s..e];
            ctx.contains(w) && !sys.contains(w) && !is_json_key(&text, e) && !is_tag(&text, s, e)
        })
        .collect();
    let mut mask = Vec::with_capacity(pieces.len());
    let mut at = 0;
    for p in pieces {
        let (s, e) = (at, at + p.len());
        at = e;
        let overlaps = s < e && copied.iter().any(|&(a, b)| s < b && a < e);
        mask.push(u8::from(!overlaps));
    }
    mask
}

/// The policy-term mask of one generated row, or `None` when the row's text cannot be mapped
/// to its tokens (then the row trains as without the option). `end_of_turn` is the id that
/// closes the system turn (ChatML `<|im_end|>`); without it the whole prompt is conversation.
pub fn copy_mask(
    tok: &Tokenizer,
    end_of_turn: Option<u32>,
    prompt_ids: &[u32],
    response_ids: &[u32],
) -> Option<Vec<u8>> {
    let split = end_of_turn
        .and_then(|eot| prompt_ids.iter().position(|&t| t == eot))
        .map_or(0, |i| i + 1);
    let system = tok.decode(&prompt_ids[..split]).ok()?;
    let conversation = tok.decode(&prompt_ids[split..]).ok()?;
    let pieces: Vec<String> = response_ids
        .iter()
        .map(|&t| tok.decode(&[t]))
        .collect::<Result<_, _>>()
        .ok()?;
    // Byte-level pieces of a multi-byte character decode to U+FFFD one by one: their
    // concatenation is not the text, and offsets would be wrong.
    if pieces.concat() != tok.decode(response_ids).ok()? {
        return None;
    }
    Some(copy_mask_text(&system, &conversation, &pieces))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(s: &[&str]) -> Vec<String> {
        s.iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn words_trim_sentence_ends_and_keep_ids_amounts_and_dates() {
        let t = "Booking bk_500 is cancelled. Total: 45.50 on 2026-12-03 - ok";
        let w: Vec<&str> = words(t).into_iter().map(|(s, e)| &t[s..e]).collect();
        assert_eq!(
            w,
            [
                "Booking",
                "bk_500",
                "is",
                "cancelled",
                "Total",
                "45.50",
                "on",
                "2026-12-03",
                "ok"
            ]
        );
    }

    #[test]
    fn copied_values_are_masked_and_decisions_are_not() {
        let system = "You are the travel desk.\ntools: get_booking(bk) cancel(bk)";
        let conversation =
            "What is the status of booking bk_500?\n{\"bk\": \"bk_500\", \"status\": \"active\"}";
        // The answer copies bk_500 and "active" (and "is"); "Booking" is capitalised, not in
        // the conversation, so it stays.
        let answer = pieces(&["Booking", " bk", "_500", " is", " active", "."]);
        assert_eq!(
            copy_mask_text(system, conversation, &answer),
            [1, 0, 0, 0, 0, 1]
        );
        // A status the conversation does not hold is the model's own choice: trained.
        let wrong = pieces(&["Booking", " bk", "_500", " is", " cancelled", "."]);
        assert_eq!(
            copy_mask_text(system, conversation, &wrong),
            [1, 0, 0, 0, 1, 1]
        );
        // In a call, the tool name (system turn) and the key ("bk" is a key, and in the system
        // turn) are decisions; the copied argument value is not.
        let call = pieces(&[
            "{\"name\": \"",
            "cancel",
            "\", \"arguments\": {\"",
            "bk",
            "\": \"",
            "bk",
            "_500",
            "\"}}",
        ]);
        assert_eq!(
            copy_mask_text(system, conversation, &call),
            [1, 1, 1, 1, 1, 0, 0, 1]
        );
    }

    #[test]
    fn markup_tags_from_earlier_turns_are_not_masked() {
        let conversation = "<tool_call>{\"name\": \"get\"}</tool_call> ok";
        let resp = pieces(&["<", "tool", "_call", ">", "ok", "</", "tool_call", ">"]);
        assert_eq!(
            copy_mask_text("", conversation, &resp),
            [1, 1, 1, 1, 0, 1, 1, 1]
        );
    }

    #[test]
    fn a_miscopied_value_is_trained() {
        let conversation = "Find flights from Kyiv to Riga on day 4";
        let call = pieces(&["{\"src\": \"", "Ky", "vi", "\", \"dst\": \"", "Riga", "\"}"]);
        assert_eq!(copy_mask_text("", conversation, &call), [1, 1, 1, 1, 0, 1]);
    }

    #[test]
    fn the_bundled_tokenizer_maps_ascii_rows_and_refuses_split_characters() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/envace-tiny");
        let tok = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
        let eot = tok.token_to_id("<|im_end|>");
        assert!(eot.is_some());
        let prompt = tok
            .encode("<|im_start|>system\ntools: search(src)<|im_end|>\n<|im_start|>user\nFly from Kyiv<|im_end|>\n<|im_start|>assistant\n")
            .unwrap();
        let resp = tok.encode("From Kyiv to search").unwrap();
        let m = copy_mask(&tok, eot, &prompt, &resp).unwrap();
        assert_eq!(m.len(), resp.len());
        // "Kyiv" is copied; "search" is a tool name from the system turn; "From" is not in
        // the conversation (it says "from").
        let kept: String = resp
            .iter()
            .zip(&m)
            .filter(|(_, k)| **k == 1)
            .map(|(t, _)| tok.decode(&[*t]).unwrap())
            .collect();
        assert_eq!(
            kept.split_whitespace().collect::<Vec<_>>(),
            ["From", "to", "search"]
        );
        // A character split across byte-level tokens cannot be mapped: no mask.
        let emoji = tok.encode("Kyiv \u{1F642}").unwrap();
        assert!(copy_mask(&tok, eot, &prompt, &emoji).is_none());
    }

    #[test]
    fn json_keys_that_the_conversation_holds_are_not_masked() {
        let conversation = "{\"status\": \"active\"}";
        let resp = pieces(&["{\"", "status", "\": \"", "active", "\"}"]);
        assert_eq!(copy_mask_text("", conversation, &resp), [1, 1, 1, 0, 1]);
    }
}
