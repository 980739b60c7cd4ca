//! The local model runtime: one trainable llama-family decoder (Llama, Qwen2, Qwen3 variants),
//! GGUF models, tokenizers, chat templates, seeded sampling and batched, forkable generation.
//! Everything above talks to a model through [`LanguageModel`]; an OpenAI-compatible server
//! (vLLM, SGLang, llama.cpp's server) stands behind the same seam ([`openai`]).

pub mod backend;
pub mod bench;
pub mod chat_template;
pub mod config;
pub mod decoder;
pub mod device;
pub mod fixture;
pub mod fused;
pub mod generate;
pub mod infer;
pub mod kv_cache;
pub mod loader;
pub mod model;
pub mod openai;
pub mod par;
pub mod quant_tiles;
pub mod sampler;
#[cfg(test)]
pub(crate) mod test_util;
pub mod tokenizer;
pub mod tool_format;
pub mod tool_guard;
pub mod train_attention;
pub mod train_pass;

pub use backend::{
    CancelToken, ChatPrompt, FinishReason, Generation, LanguageModel, ModelInfo, RuntimeError,
    SamplingParams, StreamSink,
};
pub use device::DeviceChoice;
pub use model::LocalModel;
