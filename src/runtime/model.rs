//! `LocalModel`: a checkpoint directory or GGUF file loaded into the decoder, with its tokenizer,
//! chat template and EOS ids, implementing [`LanguageModel`]. Keeps a few recent prompt
//! prefixes so that a growing conversation is not prefilled from scratch on every turn.
//! A PEFT LoRA adapter directory loads as its base model with the adapter folded in.

use std::path::{Path, PathBuf};

use candle_core::quantized::tokenizer::TokenizerFromGguf;
use candle_core::{DType, Device};
use serde_json::Value;
use sha2::Digest;

use super::backend::{
    CancelToken, Generation, LanguageModel, ModelInfo, RuntimeError, SamplingParams, StreamSink,
};
use super::chat_template::{ChatTemplate, from_tokenizer_config};
use super::decoder::Decoder;
use super::device::{DeviceChoice, default_dtype, describe};
use super::generate::{GenContext, Prefix, generate_batch};
use super::loader::{
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterConfig, CheckpointFiles, attach_adapter, hash_files,
    is_adapter_dir, load_gguf, load_hf, read_adapter,
};
use super::tokenizer::Tokenizer;
use crate::message::Message;

/// How many recent prompt prefixes to keep for reuse.
const PREFIX_SLOTS: usize = 4;

/// A loaded local model.
pub struct LocalModel {
    pub decoder: Decoder,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub eos_ids: Vec<u32>,
    pub path: PathBuf,
    hash: String,
    prefixes: Vec<Prefix>,
}

impl std::fmt::Debug for LocalModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalModel")
            .field("path", &self.path)
            .finish()
    }
}

fn add_eos(eos: &mut Vec<u32>, tok: &Tokenizer, s: &str) {
    if s.is_empty() {
        return;
    }
    if let Some(id) = tok.token_to_id(s)
        && !eos.contains(&id)
    {
        eos.push(id);
    }
}

impl LocalModel {
    /// Load a checkpoint directory or `.gguf` file.
    pub fn load(path: &Path, device: DeviceChoice) -> Result<Self, RuntimeError> {
        let device = device.open()?;
        Self::load_on(path, &device, None)
    }

    /// Load on a given device with an optional dtype override.
    pub fn load_on(
        path: &Path,
        device: &Device,
        dtype: Option<DType>,
    ) -> Result<Self, RuntimeError> {
        if path.is_file() && path.extension().and_then(|e| e.to_str()) == Some("gguf") {
            return Self::load_gguf(path, device);
        }
        if is_adapter_dir(path) {
            return Self::load_adapter(path, device, dtype);
        }
        if !path.exists() {
            return Err(RuntimeError::File {
                path: path.display().to_string(),
                message: "no such file or directory (expected an HF checkpoint directory or a .gguf file)".into(),
            });
        }
        let files = CheckpointFiles::locate(path)?;
        let dtype = dtype.unwrap_or_else(|| default_dtype(device));
        let decoder = load_hf(&files, dtype, device, None)?;
        let tokenizer = Tokenizer::from_file(&files.tokenizer)?;
        let template = match &files.tokenizer_config {
            Some(p) => read_template(p)?.unwrap_or_else(ChatTemplate::chatml),
            None => ChatTemplate::chatml(),
        };
        let mut eos_ids = decoder.cfg.eos_token_ids.clone();
        let eos = template.eos_token.clone();
        add_eos(&mut eos_ids, &tokenizer, &eos);
        let hash = hash_files(&files.hashed())?;
        Self::finish(
            decoder,
            tokenizer,
            template,
            eos_ids,
            path,
            hash,
            &files.tokenizer,
        )
    }

    /// A PEFT LoRA adapter directory: its base (`base_model_name_or_path`) with the adapter
    /// folded into the dense weights (attached, unmerged, on quantized bases). The tokenizer and
    /// template are the base's; the hash covers the base and the adapter.
    fn load_adapter(
        dir: &Path,
        device: &Device,
        dtype: Option<DType>,
    ) -> Result<Self, RuntimeError> {
        let (cfg, tensors) = read_adapter(dir)?;
        let base_dir = cfg.resolve_base(dir)?;
        if is_adapter_dir(&base_dir) {
            return Err(RuntimeError::Field {
                path: dir.join(ADAPTER_CONFIG).display().to_string(),
                field: "base_model_name_or_path".into(),
                message: format!("{} is itself an adapter", base_dir.display()),
            });
        }
        let mut model = Self::load_on(&base_dir, device, dtype)?;
        cfg.check_base(dir, &base_dir, &model.hash)?;
        // An adapter trained with its own chat template (as `envace pretrain --lora` writes
        // one beside it) speaks that template, not the base's; and it reads text as the
        // tokenizer saved beside it split it in training (adapters trained on a GGUF base
        // before 2026-12-07 saw candle's prefix spaces: see `tokenizer_of_gguf`).
        if let Some(template) = template_in_dir(dir)? {
            model.template = template;
        }
        if let Some(tokenizer) = tokenizer_in_dir(dir, model.tokenizer.vocab_size())? {
            model.tokenizer = tokenizer;
        }
        let dt = model.decoder.dtype;
        let tensors = tensors
            .into_iter()
            .map(|(k, v)| Ok((k, v.to_dtype(dt)?.to_device(device)?)))
            .collect::<candle_core::Result<_>>()?;
        attach_adapter(
            &mut model.decoder,
            &cfg,
            &tensors,
            &dir.join(ADAPTER_WEIGHTS),
            true,
        )?;
        let adapter_hash = hash_files(&[dir.join(ADAPTER_CONFIG), dir.join(ADAPTER_WEIGHTS)])?;
        model.hash = hex::encode(sha2::Sha256::digest(
            format!("{}+{adapter_hash}", model.hash).as_bytes(),
        ));
        model.path = dir.to_path_buf();
        model.prefixes.clear();
        Ok(model)
    }

    fn load_gguf(path: &Path, device: &Device) -> Result<Self, RuntimeError> {
        let (decoder, ct) = load_gguf(path, device)?;
        let tokenizer = tokenizer_of_gguf(path, &ct)?;
        let template = gguf_template(path, &ct, &tokenizer)?;
        let eos_ids = decoder.cfg.eos_token_ids.clone();
        let hash = hash_files(&[path.to_path_buf()])?;
        Self::finish(decoder, tokenizer, template, eos_ids, path, hash, path)
    }

    fn finish(
        decoder: Decoder,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        mut eos_ids: Vec<u32>,
        path: &Path,
        hash: String,
        tokenizer_path: &Path,
    ) -> Result<Self, RuntimeError> {
        let vocab = tokenizer.vocab_size();
        if vocab > decoder.cfg.vocab_size {
            return Err(RuntimeError::Field {
                path: tokenizer_path.display().to_string(),
                field: "vocab".into(),
                message: format!(
                    "tokenizer has {vocab} tokens but the embedding has only {} rows",
                    decoder.cfg.vocab_size
                ),
            });
        }
        // Chat models end a turn with the template's end-of-turn token.
        if template.source.contains("<|im_end|>") {
            add_eos(&mut eos_ids, &tokenizer, "<|im_end|>");
        }
        if eos_ids.is_empty() {
            add_eos(&mut eos_ids, &tokenizer, "<|endoftext|>");
        }
        Ok(Self {
            decoder,
            tokenizer,
            template,
            eos_ids,
            path: path.to_path_buf(),
            hash,
            prefixes: Vec::new(),
        })
    }

    /// A model over an existing decoder (e.g. the trainer's live weights: a `Decoder` clone
    /// shares their storage, so optimizer updates are seen without copying).
    pub fn from_parts(
        decoder: Decoder,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        eos_ids: Vec<u32>,
        path: &Path,
        hash: String,
    ) -> Self {
        Self {
            decoder,
            tokenizer,
            template,
            eos_ids,
            path: path.to_path_buf(),
            hash,
            prefixes: Vec::new(),
        }
    }

    pub fn context(&self) -> GenContext<'_> {
        GenContext {
            decoder: &self.decoder,
            tokenizer: &self.tokenizer,
            eos: &self.eos_ids,
        }
    }

    /// A prefilled prefix for `ids`, reusing the longest cached common prefix.
    pub fn prefix_for(&mut self, ids: &[u32]) -> Result<Prefix, RuntimeError> {
        let best = self
            .prefixes
            .iter()
            .enumerate()
            .map(|(i, p)| (i, common_len(p.ids(), ids)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(_, n)| n);
        let prefix = match best {
            Some((i, n)) => {
                let mut p = self.prefixes.remove(i);
                let reuse = p.clone();
                self.prefixes.push(reuse);
                if n < p.len() {
                    p.truncate(&self.decoder, n)?;
                }
                if n < ids.len() {
                    p.extend(&self.decoder, &ids[n..])?;
                }
                p
            }
            None => Prefix::new(&self.decoder, ids)?,
        };
        self.prefixes.push(prefix.clone());
        while self.prefixes.len() > PREFIX_SLOTS {
            self.prefixes.remove(0);
        }
        Ok(prefix)
    }

    /// Generate for several different prompts in one padded batch.
    pub fn generate_many(
        &mut self,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
        cancel: &CancelToken,
    ) -> Result<Vec<Generation>, RuntimeError> {
        Ok(
            generate_batch(self.context(), prompts, params, None, cancel)?
                .into_iter()
                .map(|(g, _)| g)
                .collect(),
        )
    }
}

/// The chat template of a `tokenizer_config.json` (`None` when it has none).
fn read_template(p: &Path) -> Result<Option<ChatTemplate>, RuntimeError> {
    let text = std::fs::read_to_string(p).map_err(|e| RuntimeError::File {
        path: p.display().to_string(),
        message: e.to_string(),
    })?;
    let v: Value = serde_json::from_str(&text).map_err(|e| RuntimeError::File {
        path: p.display().to_string(),
        message: format!("invalid JSON: {e}"),
    })?;
    // Recent transformers save the template beside the config, in `chat_template.jinja`.
    let jinja = p.with_file_name("chat_template.jinja");
    let (found, from) =
        match std::fs::read_to_string(&jinja) {
            Ok(src) => {
                let (_, bos, eos) = from_tokenizer_config(&json_with_template(&v, &src))
                    .unwrap_or((String::new(), String::new(), String::new()));
                (Some((src, bos, eos)), (jinja.as_path(), "template"))
            }
            Err(_) => (from_tokenizer_config(&v), (p, "chat_template")),
        };
    found
        .map(|(src, bos, eos)| {
            ChatTemplate::new(&src, &bos, &eos).map_err(|e| RuntimeError::Field {
                path: from.0.display().to_string(),
                field: from.1.into(),
                message: e.to_string(),
            })
        })
        .transpose()
}

/// `v` with `chat_template` set to `src` (to read the special tokens the usual way).
fn json_with_template(v: &Value, src: &str) -> Value {
    let mut v = v.clone();
    if let Some(o) = v.as_object_mut() {
        o.insert("chat_template".into(), Value::String(src.to_string()));
    }
    v
}

/// The chat template of `dir/tokenizer_config.json` (or `dir/chat_template.jinja`), when that
/// file exists and has one.
fn template_in_dir(dir: &Path) -> Result<Option<ChatTemplate>, RuntimeError> {
    let p = dir.join("tokenizer_config.json");
    if p.is_file() {
        read_template(&p)
    } else {
        Ok(None)
    }
}

/// The tokenizer saved in an adapter directory (`tokenizer.json`, as training writes it), when it
/// has one; its vocabulary must be the base's (`base_vocab` tokens).
fn tokenizer_in_dir(dir: &Path, base_vocab: usize) -> Result<Option<Tokenizer>, RuntimeError> {
    let p = dir.join("tokenizer.json");
    if !p.is_file() {
        return Ok(None);
    }
    let tokenizer = Tokenizer::from_file(&p)?;
    if tokenizer.vocab_size() != base_vocab {
        return Err(RuntimeError::File {
            path: p.display().to_string(),
            message: format!(
                "{} tokens, where the adapter's base has {base_vocab}",
                tokenizer.vocab_size()
            ),
        });
    }
    Ok(Some(tokenizer))
}

/// The tokenizer a GGUF file describes (`tokenizer.ggml.*`), splitting text as llama.cpp does.
///
/// candle builds byte-level BPE files whose `tokenizer.ggml.pre` it does not know (`gpt2`,
/// `smollm`, `starcoder`, …) with a prefix space before every run of text between special
/// tokens: `<|im_start|>system` became `<|im_start|>`, `Ġsystem` where the model (and
/// llama.cpp) read `system`, and each `<|im_end|>\n` ended in `ĠĊ`. llama.cpp adds no such
/// space, and for `smollm` and its kin splits every digit off first (`\p{N}`) — as the models'
/// own `tokenizer.json` files do (Digits + ByteLevel without a prefix space).
fn tokenizer_of_gguf(
    path: &Path,
    ct: &candle_core::quantized::gguf_file::Content,
) -> Result<Tokenizer, RuntimeError> {
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::digits::Digits;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    let mut inner = tokenizers::Tokenizer::from_gguf(ct).map_err(|e| RuntimeError::Field {
        path: path.display().to_string(),
        field: "tokenizer.ggml.*".into(),
        message: format!("cannot build tokenizer: {e}"),
    })?;
    let meta = |k: &str| {
        ct.metadata
            .get(k)
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default()
    };
    if meta("tokenizer.ggml.model") == "gpt2" {
        let byte_level = ByteLevel::new(false, true, true);
        match meta("tokenizer.ggml.pre").as_str() {
            // candle's own pipelines for these already match their models.
            "qwen2" | "llama3" | "smaug-bpe" | "lfm2" => {}
            // llama.cpp: `\p{N}`, then the GPT-2 expression.
            "smollm" | "starcoder" | "refact" | "codeshell" | "command-r" | "exaone"
            | "minerva-7b" => {
                inner.with_pre_tokenizer(Some(Sequence::new(vec![
                    Digits::new(true).into(),
                    byte_level.into(),
                ])));
            }
            // `gpt2` and the rest candle sends to its default: the GPT-2 expression alone.
            _ => {
                inner.with_pre_tokenizer(Some(byte_level));
            }
        }
    }
    Ok(Tokenizer::from_inner(inner))
}

/// The chat template a GGUF file carries (`tokenizer.chat_template`; ChatML when it has none).
fn gguf_template(
    path: &Path,
    ct: &candle_core::quantized::gguf_file::Content,
    tokenizer: &Tokenizer,
) -> Result<ChatTemplate, RuntimeError> {
    let token_str = |key: &str| -> String {
        ct.metadata
            .get(key)
            .and_then(|v| v.to_u32().ok())
            .and_then(|id| tokenizer.id_to_token(id))
            .unwrap_or_default()
    };
    let bos = token_str("tokenizer.ggml.bos_token_id");
    let eos = token_str("tokenizer.ggml.eos_token_id");
    match ct
        .metadata
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
    {
        Some(src) => ChatTemplate::new(src, &bos, &eos).map_err(|e| RuntimeError::Field {
            path: path.display().to_string(),
            field: "tokenizer.chat_template".into(),
            message: e.to_string(),
        }),
        None => Ok(ChatTemplate::chatml()),
    }
}

/// A model's text side without its weights: what a remote backend needs to render prompts
/// exactly as [`LocalModel`] would (tokenizer, chat template with its tool rendering).
#[derive(Debug)]
pub struct TextSide {
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    /// sha256 over the files read (tells two text sides apart in session headers).
    pub hash: String,
}

impl TextSide {
    /// Read from a `.gguf` file (metadata only), an HF checkpoint or tokenizer directory
    /// (`tokenizer.json`, `tokenizer_config.json`), or a LoRA adapter directory (its base's
    /// tokenizer; the adapter's own template wins, as when the adapter is loaded).
    pub fn load(path: &Path) -> Result<Self, RuntimeError> {
        if path.is_file() && path.extension().and_then(|e| e.to_str()) == Some("gguf") {
            let ct = gguf_metadata(path)?;
            let tokenizer = tokenizer_of_gguf(path, &ct)?;
            let template = gguf_template(path, &ct, &tokenizer)?;
            let hash = hash_files(&[path.to_path_buf()])?;
            return Ok(Self {
                tokenizer,
                template,
                hash,
            });
        }
        if is_adapter_dir(path) {
            let base = AdapterConfig::read(path)?.resolve_base(path)?;
            let mut side = Self::load(&base)?;
            if let Some(template) = template_in_dir(path)? {
                side.template = template;
            }
            if let Some(tokenizer) = tokenizer_in_dir(path, side.tokenizer.vocab_size())? {
                side.tokenizer = tokenizer;
            }
            return Ok(side);
        }
        let tok_path = path.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(RuntimeError::File {
                path: path.display().to_string(),
                message: "no tokenizer here (expected a .gguf file, or a directory with tokenizer.json, or a LoRA adapter directory)".into(),
            });
        }
        let tokenizer = Tokenizer::from_file(&tok_path)?;
        let template = template_in_dir(path)?.unwrap_or_else(ChatTemplate::chatml);
        let mut files = vec![tok_path];
        let config = path.join("tokenizer_config.json");
        if config.is_file() {
            files.push(config);
        }
        let hash = hash_files(&files)?;
        Ok(Self {
            tokenizer,
            template,
            hash,
        })
    }
}

/// The tokenizer of a GGUF file, read without its weights (for training on a GGUF base).
pub fn gguf_tokenizer(path: &Path) -> Result<Tokenizer, RuntimeError> {
    tokenizer_of_gguf(path, &gguf_metadata(path)?)
}

/// A GGUF file's metadata and tensor index, without reading its weights.
fn gguf_metadata(path: &Path) -> Result<candle_core::quantized::gguf_file::Content, RuntimeError> {
    let mut f = std::fs::File::open(path).map_err(|e| RuntimeError::File {
        path: path.display().to_string(),
        message: format!("cannot open: {e}"),
    })?;
    candle_core::quantized::gguf_file::Content::read(&mut f).map_err(|e| RuntimeError::File {
        path: path.display().to_string(),
        message: format!("not a valid GGUF file: {e}"),
    })
}

fn common_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl LanguageModel for LocalModel {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            path: self.path.display().to_string(),
            hash: self.hash.clone(),
            architecture: format!("{:?}", self.decoder.cfg.family).to_lowercase(),
            device: describe(&self.decoder.device),
            dtype: format!("{:?}", self.decoder.dtype).to_lowercase(),
            parameters: self.decoder.cfg.parameter_count(),
            tool_rendering: self.template.tool_rendering,
        }
    }

    fn render_chat(
        &self,
        messages: &[Message],
        tools: &[Value],
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<String, RuntimeError> {
        self.template
            .render(messages, tools, add_generation_prompt, enable_thinking)
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, RuntimeError> {
        self.tokenizer.encode(text)
    }

    fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError> {
        self.tokenizer.decode(ids)
    }

    fn generate(
        &mut self,
        prompt_ids: &[u32],
        n: usize,
        params: &SamplingParams,
        stream: Option<StreamSink<'_>>,
        cancel: &CancelToken,
    ) -> Result<Vec<Generation>, RuntimeError> {
        let mut prefix = self.prefix_for(prompt_ids)?;
        let out = prefix.generate(self.context(), n, params, stream, cancel)?;
        Ok(out.into_iter().map(|(g, _)| g).collect())
    }
}
