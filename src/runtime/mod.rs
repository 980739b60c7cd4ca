//! The local model runtime: one trainable llama-family decoder (Llama, Qwen2, Qwen3 variants),
//! GGUF models through candle-transformers, tokenizers, chat templates, seeded sampling and
//! batched, forkable generation. Everything above talks to a model through [`LanguageModel`],
//! so an OpenAI-compatible server (vLLM/SGLang) can later stand behind the same seam.

pub mod backend;

pub use backend::{
    CancelToken, FinishReason, Generation, LanguageModel, ModelInfo, RuntimeError, SamplingParams,
    StreamSink,
};
