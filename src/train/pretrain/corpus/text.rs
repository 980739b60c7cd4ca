//! A rendered training text split into trained and untrained segments: how a conversation
//! becomes an actor text (its assistant turns trained) or a simulator text (the
//! `<execution_result>` trained), tokenised segment by segment so that the loss mask lines up
//! with token boundaries.

use serde_json::Value;

use crate::message::{Message, Role};
use crate::runtime::chat_template::ChatTemplate;
use crate::runtime::tokenizer::Tokenizer;
use crate::train::TrainError;
use crate::train::model::Example;

/// A rendered training text split into (text, trained) segments.
#[derive(Debug, Clone, PartialEq)]
pub struct Segmented {
    pub role: Role,
    pub segments: Vec<(String, bool)>,
}

impl Segmented {
    pub fn text(&self) -> String {
        self.segments.iter().map(|(s, _)| s.as_str()).collect()
    }

    /// Tokenise segment by segment so that the mask lines up with token boundaries.
    pub fn to_example(&self, tok: &Tokenizer) -> Result<Example, TrainError> {
        let mut ids = Vec::new();
        let mut mask = Vec::new();
        for (s, trained) in &self.segments {
            let t = tok.encode(s)?;
            mask.extend(std::iter::repeat_n(
                if *trained { 1.0 } else { 0.0 },
                t.len(),
            ));
            ids.extend(t);
        }
        Ok(Example { ids, mask })
    }
}

/// Split `full` into untrained / trained parts at the given (start, end) byte ranges.
fn segment(full: &str, trained: &[(usize, usize)]) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let mut pos = 0;
    for &(a, b) in trained {
        if a > pos {
            out.push((full[pos..a].to_string(), false));
        }
        out.push((full[a..b].to_string(), true));
        pos = b;
    }
    if pos < full.len() {
        out.push((full[pos..].to_string(), false));
    }
    out
}

pub(crate) const END: &str = "<|im_end|>";

/// The actor text of a conversation: every assistant message (content, calls, `<|im_end|>`)
/// is trained.
pub fn actor_text(
    t: &ChatTemplate,
    msgs: &[Message],
    tools: &[Value],
) -> Result<Segmented, TrainError> {
    let full = t.render(msgs, tools, false, false)?;
    let mut ranges = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        if m.role != Role::Assistant {
            continue;
        }
        let start = t.render(&msgs[..i], tools, true, false)?.len();
        let end = t.render(&msgs[..=i], tools, false, false)?.len();
        let body = &full[start..end];
        let cut = body
            .rfind(END)
            .map(|p| start + p + END.len())
            .unwrap_or(end);
        ranges.push((start, cut));
    }
    Ok(Segmented {
        role: Role::Assistant,
        segments: segment(&full, &ranges),
    })
}

/// The simulator text for one call: its prompt, then the trained result.
pub fn simulator_text(
    t: &ChatTemplate,
    prompt: &[Message],
    result: &Value,
) -> Result<Segmented, TrainError> {
    let p = t.render(prompt, &[], true, false)?;
    let target = format!("{}{END}", crate::engine::parse::execution_result(result));
    Ok(Segmented {
        role: Role::Tool,
        segments: vec![(p, false), (target, true)],
    })
}

/// The actor text of a conversation whose last message (an assistant turn) is the only one
/// trained.
pub fn actor_text_last(
    t: &ChatTemplate,
    msgs: &[Message],
    tools: &[Value],
) -> Result<Segmented, TrainError> {
    let full = t.render(msgs, tools, false, false)?;
    let start = t.render(&msgs[..msgs.len() - 1], tools, true, false)?.len();
    let cut = full[start..]
        .rfind(END)
        .map(|p| start + p + END.len())
        .unwrap_or(full.len());
    Ok(Segmented {
        role: Role::Assistant,
        segments: segment(&full, &[(start, cut)]),
    })
}
