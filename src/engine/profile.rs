//! A model's prompt profile (`envace.json` beside its weights): which simulator prompt form and
//! thinking setting it was trained with, so that the engine shows it the text it knows.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::engine::types::SimPromptConfig;

/// The profile; absent file = the defaults (full prompts, as for general chat models).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptProfile {
    pub sim_prompt: SimPromptConfig,
    pub actor_thinking: bool,
}

/// Errors reading a profile name the file.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ProfileError {
    pub path: String,
    pub message: String,
}

impl PromptProfile {
    /// The profile of the bundled model: compact simulator prompts, no thinking.
    pub fn compact() -> Self {
        Self {
            sim_prompt: SimPromptConfig {
                max_history_messages: 6,
                max_message_chars: 300,
                max_examples: 2,
                include_policy: false,
                compact: true,
            },
            actor_thinking: false,
        }
    }

    /// The profile of a model spec: beside a local model, or beside the `&tokenizer=` of a
    /// remote (`openai:`) one (a served model fine-tuned here speaks its profile); `None` for a
    /// remote model without a local tokenizer.
    pub fn for_model(spec: &Path) -> Result<Option<Self>, ProfileError> {
        let s = spec.to_string_lossy();
        if !crate::runtime::openai::is_remote(&s) {
            return Self::read(spec);
        }
        match crate::runtime::openai::RemoteSpec::parse(&s)
            .ok()
            .and_then(|r| r.tokenizer)
        {
            Some(t) => Self::read(&t),
            None => Ok(None),
        }
    }

    /// Read `envace.json` from a model directory (or the directory of a model file).
    pub fn read(model_path: &Path) -> Result<Option<Self>, ProfileError> {
        let dir = if model_path.is_dir() {
            model_path
        } else {
            model_path.parent().unwrap_or(Path::new("."))
        };
        let p = dir.join("envace.json");
        if !p.is_file() {
            return Ok(None);
        }
        let err = |m: String| ProfileError {
            path: p.display().to_string(),
            message: m,
        };
        let text = std::fs::read_to_string(&p).map_err(|e| err(e.to_string()))?;
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| err(e.to_string()))
    }
}
