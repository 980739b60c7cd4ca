//! Live BFCL-v4 answers: a model, shown one entry's question messages with the entry's functions
//! as tools through its own chat template, generates greedily once; the actor parser turns the
//! text into calls. `envace eval bfcl --model` drives it through the env layer's
//! [`BfclResponder`] seam, which writes and scores the responses (`env::bfcl`).
//!
//! Multi-turn categories use [`ModelResponder::step`]: the env layer (`env::bfcl_multi`) runs the
//! turns on the official environments and asks for one step at a time.
//!
//! It exists so that the env layer never imports the runtime or the engine. It must not score
//! anything itself (scoring is the checker's, in one place), nor change the prompt beyond what
//! BFCL gives: no system prompt of ours, no thinking, no retries.

use std::path::Path;

use serde_json::Value;

use crate::engine::parse::parse_actor;
use crate::engine::prompts::tools_json;
use crate::env::ToolSpec;
use crate::env::bfcl::{BfclEntry, BfclResponder, BfclResponse, BoxError};
use crate::message::{Message, ToolCall};
use crate::runtime::{
    CancelToken, ChatPrompt, DeviceChoice, LanguageModel, LocalModel, RuntimeError, SamplingParams,
};

#[derive(Debug, thiserror::Error)]
pub enum BfclEvalError {
    #[error("--device `{0}`: expected auto, cpu, cuda or metal")]
    Device(String),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

/// Answers BFCL entries with a model, greedily, up to `max_tokens` per entry (the model's EOS
/// ends a generation earlier).
pub struct ModelResponder<M> {
    model: M,
    params: SamplingParams,
    cancel: CancelToken,
    /// Constrain call names to the entry's functions.
    constrain: bool,
}

impl<M: LanguageModel> ModelResponder<M> {
    pub fn new(model: M, max_tokens: usize) -> Self {
        Self {
            model,
            params: SamplingParams {
                temperature: 0.0,
                max_tokens,
                ..SamplingParams::default()
            },
            cancel: CancelToken::new(),
            constrain: false,
        }
    }

    /// The sampling parameters for one generation offering `tools`.
    fn params_for(&self, tools: &[Value]) -> SamplingParams {
        let mut p = self.params.clone();
        if self.constrain {
            p.tool_names = crate::runtime::tool_format::tool_names(tools);
        }
        p
    }

    /// One entry's response: the calls parsed from the generation, and the generation itself.
    pub fn answer(&mut self, entry: &BfclEntry) -> Result<BfclResponse, RuntimeError> {
        let tools = tools_json(&entry.tools());
        let messages = entry.messages();
        let chat = ChatPrompt {
            messages: &messages,
            tools: &tools,
            enable_thinking: false,
        };
        let text = self
            .model
            .generate_chat(&chat, 1, &self.params_for(&tools), None, &self.cancel)?
            .into_iter()
            .next()
            .map(|g| g.text)
            .unwrap_or_default();
        Ok(BfclResponse {
            id: entry.id.clone(),
            calls: parse_actor(&text).calls().to_vec(),
            raw: Some(text),
        })
    }

    /// One step of a multi-turn entry (`env::bfcl_multi::run_entry` drives the turns): the
    /// conversation so far, with the tool results fed back, and the entry's tools, rendered the
    /// same way; the calls parsed from the generation, and the generation.
    pub fn step(
        &mut self,
        messages: &[Message],
        tools: &[ToolSpec],
    ) -> Result<(Vec<ToolCall>, String), RuntimeError> {
        let tools = tools_json(tools);
        let chat = ChatPrompt {
            messages,
            tools: &tools,
            enable_thinking: false,
        };
        let text = self
            .model
            .generate_chat(&chat, 1, &self.params_for(&tools), None, &self.cancel)?
            .into_iter()
            .next()
            .map(|g| g.text)
            .unwrap_or_default();
        Ok((parse_actor(&text).calls().to_vec(), text))
    }
}

impl<M: LanguageModel> BfclResponder for ModelResponder<M> {
    fn respond(&mut self, entry: &BfclEntry) -> Result<BfclResponse, BoxError> {
        Ok(self.answer(entry)?)
    }

    fn chat(
        &mut self,
        messages: &[Message],
        tools: &[ToolSpec],
    ) -> Result<(Vec<ToolCall>, String), BoxError> {
        Ok(self.step(messages, tools)?)
    }

    fn constrain_tool_names(&mut self, on: bool) {
        self.constrain = on;
    }
}

/// Load a checkpoint directory or `.gguf` file as a responder (the loader
/// `env::cli::run_eval_bfcl_with` takes).
pub fn load_responder(
    path: &Path,
    max_tokens: usize,
    device: &str,
) -> Result<Box<dyn BfclResponder>, BfclEvalError> {
    let device: DeviceChoice = device
        .parse()
        .map_err(|_| BfclEvalError::Device(device.to_string()))?;
    let spec = path.to_string_lossy();
    if crate::runtime::openai::is_remote(&spec) {
        let model = crate::runtime::openai::RemoteModel::open(&spec)?;
        return Ok(Box::new(ModelResponder::new(model, max_tokens)));
    }
    let model = LocalModel::load(path, device)?;
    Ok(Box::new(ModelResponder::new(model, max_tokens)))
}

#[cfg(test)]
mod tests {
    // Tests may unwrap: a panic is the failure report.
    #![allow(clippy::unwrap_used)]

    use serde_json::{Value, json};

    use super::*;
    use crate::message::Message;
    use crate::runtime::{FinishReason, Generation, ModelInfo, StreamSink};

    /// Answers every prompt with one fixed text and keeps what it was asked: the rendered
    /// prompt travels to `generate` as one id per byte (`render_chat` and `encode` take `&self`).
    struct Scripted {
        reply: String,
        prompts: Vec<Value>,
        max_tokens: Vec<usize>,
        tool_names: Vec<Vec<String>>,
    }

    fn scripted(reply: &str) -> Scripted {
        Scripted {
            reply: reply.into(),
            prompts: vec![],
            max_tokens: vec![],
            tool_names: vec![],
        }
    }

    impl LanguageModel for Scripted {
        fn info(&self) -> ModelInfo {
            ModelInfo {
                path: "scripted".into(),
                hash: "0".into(),
                architecture: "test".into(),
                device: "cpu".into(),
                dtype: "f32".into(),
                parameters: 0,
                tool_rendering: crate::runtime::tool_format::ToolRendering::Template,
            }
        }
        fn render_chat(
            &self,
            messages: &[Message],
            tools: &[Value],
            add_generation_prompt: bool,
            thinking: bool,
        ) -> Result<String, RuntimeError> {
            Ok(json!([messages, tools, add_generation_prompt, thinking]).to_string())
        }
        fn encode(&self, text: &str) -> Result<Vec<u32>, RuntimeError> {
            Ok(text.bytes().map(u32::from).collect())
        }
        fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError> {
            Ok(ids.iter().filter_map(|&i| char::from_u32(i)).collect())
        }
        fn generate(
            &mut self,
            prompt_ids: &[u32],
            _n: usize,
            params: &SamplingParams,
            _stream: Option<StreamSink<'_>>,
            _cancel: &CancelToken,
        ) -> Result<Vec<Generation>, RuntimeError> {
            let bytes: Vec<u8> = prompt_ids.iter().map(|&i| i as u8).collect();
            self.prompts.push(serde_json::from_slice(&bytes).unwrap());
            self.max_tokens.push(params.max_tokens);
            self.tool_names.push(params.tool_names.clone());
            Ok(vec![Generation {
                prompt_ids: prompt_ids.to_vec(),
                response_ids: vec![],
                logprobs: vec![],
                text: self.reply.clone(),
                finish: FinishReason::Eos,
            }])
        }
    }

    fn entry() -> BfclEntry {
        serde_json::from_value(json!({
            "id": "live_simple_0-0-0",
            "question": [[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "User 7890?"}
            ]],
            "function": [{
                "name": "get_user_info",
                "description": "Details of a user.",
                "parameters": {"type": "dict", "required": ["user_id"],
                    "properties": {"user_id": {"type": "integer"}}}
            }],
            "ground_truth": [{"get_user_info": {"user_id": [7890]}}]
        }))
        .unwrap()
    }

    #[test]
    fn prompt_keeps_roles_and_offers_functions_as_object_tools_without_thinking() {
        let mut r = ModelResponder::new(scripted("no call"), 256);
        r.answer(&entry()).unwrap();
        let p = &r.model.prompts[0];
        assert_eq!(p[0][0]["role"], "system");
        assert_eq!(p[0][1]["role"], "user");
        assert_eq!(p[0][1]["content"], "User 7890?");
        assert_eq!(p[1][0]["function"]["name"], "get_user_info");
        assert_eq!(p[1][0]["function"]["parameters"]["type"], "object");
        assert_eq!((&p[2], &p[3]), (&json!(true), &json!(false)));
    }

    #[test]
    fn generation_is_greedy_within_the_token_budget() {
        let mut r = ModelResponder::new(scripted(""), 17);
        r.answer(&entry()).unwrap();
        assert_eq!(r.model.max_tokens, vec![17]);
        assert_eq!(r.params.temperature, 0.0);
    }

    #[test]
    fn tool_call_text_becomes_calls_and_the_raw_text_is_kept() {
        let text = "<tool_call>\n{\"name\": \"get_user_info\", \"arguments\": {\"user_id\": 7890}}\n</tool_call>";
        let mut r = ModelResponder::new(scripted(text), 256);
        let got = r.respond(&entry()).unwrap();
        assert_eq!(got.id, "live_simple_0-0-0");
        assert_eq!(got.calls.len(), 1, "{got:?}");
        assert_eq!(got.calls[0].name, "get_user_info");
        assert_eq!(got.calls[0].arguments, json!({"user_id": 7890}));
        assert_eq!(got.raw.as_deref(), Some(text));
    }

    #[test]
    fn prose_without_a_call_is_a_response_with_no_calls() {
        let mut r = ModelResponder::new(scripted("I cannot help with that."), 256);
        let got = r.respond(&entry()).unwrap();
        assert!(got.calls.is_empty());
        assert_eq!(got.raw.as_deref(), Some("I cannot help with that."));
    }

    #[test]
    fn unknown_device_is_refused_naming_the_choices() {
        let e = load_responder(Path::new("nowhere.gguf"), 8, "tpu")
            .err()
            .unwrap();
        assert!(e.to_string().contains("auto, cpu, cuda or metal"), "{e}");
    }

    #[test]
    fn constrained_responders_offer_the_entrys_function_names_to_the_decoder() {
        let mut r = ModelResponder::new(scripted("no call"), 64);
        r.answer(&entry()).unwrap();
        r.constrain_tool_names(true);
        r.answer(&entry()).unwrap();
        r.step(&[Message::user("hi")], &entry().tools()).unwrap();
        assert_eq!(
            r.model.tool_names,
            [
                vec![],
                vec!["get_user_info".to_string()],
                vec!["get_user_info".to_string()]
            ]
        );
    }
}
