//! The seam between the engine/trainer and a model backend. Blocking by design: drivers call it
//! from `spawn_blocking`. Every generation reports prompt ids, response ids and per-token
//! logprobs, which RL needs to avoid re-tokenisation drift.

use serde::{Deserialize, Serialize};

use crate::message::Message;

pub use crate::cancel::CancelToken;
pub use crate::session::format::FinishReason;

/// Errors of the runtime; each names the file and field where one is involved.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("{path}: field `{field}`: {message}")]
    Field {
        path: String,
        field: String,
        message: String,
    },
    #[error("{path}: unsupported architecture `{got}` (supported: {supported})")]
    UnsupportedArchitecture {
        path: String,
        got: String,
        supported: String,
    },
    #[error("{path}: tensor `{name}`: {message}")]
    Tensor {
        path: String,
        name: String,
        message: String,
    },
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("device: {0}")]
    Device(String),
    #[error("generation: {0}")]
    Generation(String),
    /// A remote (OpenAI-compatible) server refused, failed or answered nonsense.
    #[error("{url}: {message}")]
    Remote { url: String, message: String },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// How to pick tokens. `temperature <= 0` means greedy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub seed: u64,
    pub max_tokens: usize,
    /// Generation stops when the decoded response ends with one of these (kept in the text).
    pub stop: Vec<String>,
    /// When not empty, a tool call's name can only be one of these (see
    /// [`super::tool_guard`]); a local model enforces it token by token, a remote server
    /// cannot and refuses the request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_names: Vec<String>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
            max_tokens: 256,
            stop: Vec::new(),
            tool_names: Vec::new(),
        }
    }
}

/// One finished continuation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    pub response_ids: Vec<u32>,
    /// Log-probability (under the sampling distribution before temperature) of each response token.
    pub logprobs: Vec<f32>,
    pub text: String,
    pub finish: FinishReason,
}

/// Facts about a loaded model for sessions and the UI.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub path: String,
    /// sha256 over the weight files (first 16 hex digits are enough to tell checkpoints apart).
    pub hash: String,
    pub architecture: String,
    pub device: String,
    pub dtype: String,
    pub parameters: usize,
    /// How tools, calls and results reach the model: through its own template, or rendered into
    /// the system message in a format it was tuned on (its template has no tools section).
    pub tool_rendering: crate::runtime::tool_format::ToolRendering,
}

/// Receives decoded text as it is produced: `(branch index, new text)`; never splits a UTF-8
/// character.
pub type StreamSink<'a> = &'a mut dyn FnMut(usize, &str);

/// One chat turn to continue: what [`LanguageModel::generate_chat`] renders (locally) or sends
/// (to a chat-completions server).
#[derive(Debug, Clone, Copy)]
pub struct ChatPrompt<'a> {
    pub messages: &'a [Message],
    /// OpenAI-style function entries (`ToolSpec::to_openai_json`).
    pub tools: &'a [serde_json::Value],
    pub enable_thinking: bool,
}

/// A model that can play both EnvACE roles.
pub trait LanguageModel: Send {
    fn info(&self) -> ModelInfo;
    /// Render a conversation with the model's own chat template (`tools` are OpenAI-style
    /// function entries, see `ToolSpec::to_openai_json`).
    fn render_chat(
        &self,
        messages: &[Message],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<String, RuntimeError>;
    fn encode(&self, text: &str) -> Result<Vec<u32>, RuntimeError>;
    fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError>;
    /// `n` continuations of one prompt (prefilled once; branches share its KV cache). With
    /// greedy sampling every branch equals the single-branch result. Branch `i` is seeded with
    /// `params.seed + i`.
    fn generate(
        &mut self,
        prompt_ids: &[u32],
        n: usize,
        params: &SamplingParams,
        stream: Option<StreamSink<'_>>,
        cancel: &CancelToken,
    ) -> Result<Vec<Generation>, RuntimeError>;

    /// `n` continuations of a chat (with the generation prompt added). The default renders it
    /// with [`Self::render_chat`], encodes and calls [`Self::generate`]; a chat-completions
    /// server gets the messages themselves.
    fn generate_chat(
        &mut self,
        chat: &ChatPrompt<'_>,
        n: usize,
        params: &SamplingParams,
        stream: Option<StreamSink<'_>>,
        cancel: &CancelToken,
    ) -> Result<Vec<Generation>, RuntimeError> {
        generate_rendered(self, chat, n, params, stream, cancel)
    }
}

/// [`LanguageModel::generate_chat`] through the model's own template: render, encode, generate
/// (the default, and a remote backend's completions path).
pub fn generate_rendered<M: LanguageModel + ?Sized>(
    model: &mut M,
    chat: &ChatPrompt<'_>,
    n: usize,
    params: &SamplingParams,
    stream: Option<StreamSink<'_>>,
    cancel: &CancelToken,
) -> Result<Vec<Generation>, RuntimeError> {
    let prompt = model.render_chat(chat.messages, chat.tools, true, chat.enable_thinking)?;
    let ids = model.encode(&prompt)?;
    model.generate(&ids, n, params, stream, cancel)
}
