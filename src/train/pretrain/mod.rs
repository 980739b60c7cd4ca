//! `envace pretrain`: builds the bundled model from scratch on the built-in domains. The corpus
//! is the train split's gold runs, as the engine will show them: actor conversations (trained on
//! the assistant turns: tool calls, including ones that fail, and replies) and one simulator
//! prompt per call (trained on the real response, errors included), then a byte-level BPE
//! tokenizer (digits split, entity names kept out of the merges so held-out names tokenise like
//! training ones), then SFT. Writes an HF checkpoint directory plus `envace.json` (the prompt
//! profile the engine must use with it).
//!
//! The corpus is built in `corpus/` (one file per kind of text); this module trains the
//! tokenizer and the model on it and writes the result.

use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::TrainError;
use super::metrics::MetricsSink;
use super::model::TrainableModel;
use super::sft::{SftConfig, SftReport, run_sft};
use crate::engine::profile::PromptProfile;
use crate::engine::prompts::actor::MEMORY_HEADING;
use crate::env::domains::Domain;
use crate::env::tasks::Split;
use crate::message::Role;
use crate::runtime::CancelToken;
use crate::runtime::config::{DecoderConfig, Family};
use crate::runtime::fixture::tokenizer_config_with;
use crate::runtime::loader::{is_adapter_dir, is_gguf};
use crate::runtime::model::gguf_tokenizer;
use crate::runtime::tokenizer::Tokenizer;
use crate::train::lora::LoraConfig;

pub(super) mod corpus;

use corpus::text::END;
pub use corpus::{
    COPY_SYSTEM, CorpusConfig, CorpusTemplate, EntityStyle, PriceStepStyle, Segmented, SlipValues,
    actor_text, actor_text_last, corpus, simulator_text, unknown_kinds,
};

/// Pretraining settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PretrainConfig {
    pub seed: u64,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate_size: usize,
    pub max_len: usize,
    #[serde(default)]
    pub corpus: CorpusConfig,
    pub sft: SftConfig,
    /// Train a LoRA adapter on the `--init` model instead of every weight.
    #[serde(default)]
    pub lora: Option<LoraConfig>,
    /// An `--init` LoRA adapter is folded into its base and every weight trains (without it,
    /// an adapter `--init` continues as an adapter).
    #[serde(default)]
    pub full: bool,
}

impl Default for PretrainConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            vocab_size: 768,
            hidden_size: 256,
            layers: 6,
            heads: 8,
            kv_heads: 4,
            intermediate_size: 704,
            max_len: 512,
            corpus: CorpusConfig {
                tasks_per_domain: 4000,
                sim_per_task: 1,
                memory_fraction: 0.4,
                slip_fraction: 0.3,
                copy_per_task: 1.0,
                ..CorpusConfig::default()
            },
            sft: SftConfig {
                steps: 3000,
                batch_size: 16,
                lr: 2e-3,
                warmup: 100,
                min_lr_ratio: 0.05,
                weight_decay: 0.01,
                grad_clip: 1.0,
                seed: 0,
                max_len: 512,
                checkpoint_every: 0,
                time_budget_s: Some(900.0),
                stop_at: None,
            },
            lora: None,
            full: false,
        }
    }
}

/// Text for tokenizer training: capitalised words (entity names) are removed so that names
/// never become merged tokens.
fn tokenizer_corpus(texts: &[Segmented]) -> Vec<String> {
    texts
        .iter()
        .map(|s| {
            s.text()
                .split(' ')
                .filter(|w| !w.chars().next().is_some_and(char::is_uppercase))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// Corpus statistics and one sample text per role (`envace pretrain --dry-run`).
pub fn corpus_stats(texts: &[Segmented], tok: Option<&Tokenizer>) -> Value {
    let mut by_role = serde_json::Map::new();
    for role in [Role::Assistant, Role::Tool] {
        let items: Vec<&Segmented> = texts.iter().filter(|t| t.role == role).collect();
        let chars: Vec<usize> = items.iter().map(|t| t.text().len()).collect();
        let tokens: Vec<usize> = match tok {
            Some(tok) => items
                .iter()
                .filter_map(|t| tok.encode(&t.text()).ok().map(|v| v.len()))
                .collect(),
            None => Vec::new(),
        };
        let mean = |v: &[usize]| v.iter().sum::<usize>() as f64 / v.len().max(1) as f64;
        let name = if role == Role::Assistant {
            "actor"
        } else {
            "simulator"
        };
        by_role.insert(
            name.into(),
            json!({
                "texts": items.len(),
                "mean_chars": mean(&chars),
                "mean_tokens": mean(&tokens),
                "max_tokens": tokens.iter().max(),
                "sample": items.first().map(|t| t.text()),
            }),
        );
    }
    by_role.insert(
        "memory_sample".into(),
        json!(
            texts
                .iter()
                .map(Segmented::text)
                .find(|t| t.contains(MEMORY_HEADING))
        ),
    );
    Value::Object(by_role)
}

/// The corpus of the bundled model's recipe, tokenised with a freshly trained tokenizer.
pub fn dry_run(cfg: &PretrainConfig) -> Result<Value, TrainError> {
    let texts = corpus(
        &Domain::ALL,
        Split::Train,
        &PromptProfile::compact(),
        &cfg.corpus,
    )?;
    let tok = Tokenizer::from_inner(super::tokenizer::train_bpe(
        &tokenizer_corpus(&texts),
        cfg.vocab_size,
        8,
    )?);
    Ok(corpus_stats(&texts, Some(&tok)))
}

/// What `envace pretrain` reports.
#[derive(Debug, Clone, Serialize)]
pub struct PretrainReport {
    pub out: String,
    pub vocab_size: usize,
    pub parameters: usize,
    pub actor_examples: usize,
    pub simulator_examples: usize,
    pub mean_tokens: f64,
    pub sft: SftReport,
    pub seconds: f64,
}

/// The `pretrain.json` of the model a continuation starts from: `None` when it has none (a
/// checkpoint not made by `envace pretrain`); an unreadable or malformed one is an error that
/// names the file (and the line and column).
fn parent_record(dir: &Path) -> Result<Option<serde_json::Value>, TrainError> {
    if !dir.is_dir() {
        // A model file (GGUF) carries no record.
        return Ok(None);
    }
    let path = dir.join("pretrain.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TrainError::Data(format!("{}: {e}", path.display()))),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))
}

/// Run the whole pipeline into `out` (an HF checkpoint directory). With `init`, training
/// continues from that model (its tokenizer and weights) with a fresh schedule.
pub fn run_pretrain(
    cfg: &PretrainConfig,
    init: Option<&Path>,
    out: &Path,
    sink: &mut dyn MetricsSink,
    cancel: &CancelToken,
) -> Result<PretrainReport, TrainError> {
    let t0 = Instant::now();
    // Read the parent's record before any work: a malformed one is refused now, not after
    // the training it would otherwise be silently dropped from.
    let init_record = init
        .map(|dir| {
            parent_record(dir)
                .map(|parent| json!({ "path": dir.display().to_string(), "pretrain": parent }))
        })
        .transpose()?;
    let profile = PromptProfile::compact();
    let texts = corpus(&Domain::ALL, Split::Train, &profile, &cfg.corpus)?;
    sink.log(&format!("corpus: {} texts", texts.len()));
    let work = out.with_extension("work");
    std::fs::create_dir_all(&work)
        .map_err(|e| TrainError::Data(format!("{}: {e}", work.display())))?;
    let tok_path = work.join("tokenizer.json");
    let hf_tok = match init {
        // A GGUF file: its own tokenizer, as the inference path builds it.
        Some(file) if is_gguf(file) => gguf_tokenizer(file)?.inner().clone(),
        // Continue training an existing model: keep its tokenizer.
        Some(dir) => {
            std::fs::copy(dir.join("tokenizer.json"), &tok_path).map_err(|e| {
                TrainError::Data(format!("{}: {e}", dir.join("tokenizer.json").display()))
            })?;
            tokenizers::Tokenizer::from_file(&tok_path)
                .map_err(|e| TrainError::Data(format!("{}: {e}", tok_path.display())))?
        }
        None => super::tokenizer::train_bpe(&tokenizer_corpus(&texts), cfg.vocab_size, 8)?,
    };
    super::tokenizer::save(&hf_tok, &tok_path)?;
    let tc = tokenizer_config_with(cfg.corpus.template.source());
    std::fs::write(
        work.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tc).unwrap_or_default(),
    )
    .map_err(|e| TrainError::Data(e.to_string()))?;
    let tok = Tokenizer::from_inner(hf_tok);
    let mut examples = Vec::with_capacity(texts.len());
    let (mut actor, mut sim) = (0, 0);
    for t in &texts {
        match t.role {
            Role::Assistant => actor += 1,
            _ => sim += 1,
        }
        examples.push(t.to_example(&tok)?);
    }
    let mean_tokens =
        examples.iter().map(|e| e.ids.len() as f64).sum::<f64>() / examples.len().max(1) as f64;
    sink.log(&format!(
        "tokenizer: {} tokens; {actor} actor + {sim} simulator examples, {mean_tokens:.0} tokens on average",
        tok.vocab_size()
    ));
    let vocab = tok.vocab_size().div_ceil(64) * 64;
    let im_end = tok
        .token_to_id(END)
        .ok_or_else(|| TrainError::Data("tokenizer lacks <|im_end|>".into()))?;
    let dcfg = DecoderConfig {
        family: Family::Llama,
        vocab_size: vocab,
        hidden_size: cfg.hidden_size,
        intermediate_size: cfg.intermediate_size,
        num_hidden_layers: cfg.layers,
        num_attention_heads: cfg.heads,
        num_key_value_heads: cfg.kv_heads,
        head_dim: cfg.hidden_size / cfg.heads,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 2048,
        tie_word_embeddings: true,
        qkv_bias: false,
        qk_norm: false,
        rope_interleaved: false,
        bos_token_id: None,
        eos_token_ids: vec![im_end],
    };
    let device = candle_core::Device::Cpu;
    let model = match (init, &cfg.lora) {
        (Some(dir), Some(lora)) => TrainableModel::load_lora(dir, lora, &device)?,
        (Some(dir), None) if cfg.full && is_adapter_dir(dir) => {
            TrainableModel::load_folded(dir, &device)?
        }
        (Some(dir), None) => TrainableModel::load(dir, &device)?,
        (None, Some(_)) => {
            return Err(TrainError::Data(
                "--lora needs --init: an adapter trains on an existing model".into(),
            ));
        }
        (None, None) => TrainableModel::init(&dcfg, cfg.seed, &device)?,
    };
    let dcfg = model.decoder.cfg.clone();
    let mut sft = cfg.sft.clone();
    sft.seed = cfg.seed;
    sft.max_len = cfg.max_len;
    let report = run_sft(
        &model,
        &examples,
        &sft,
        &tok_path,
        Some(&work),
        None,
        sink,
        cancel,
    )?;
    // The final checkpoint becomes the model directory; the prompt profile goes beside it.
    let fin = work.join("final");
    let profile_json = serde_json::to_string_pretty(&profile).unwrap_or_default();
    std::fs::write(fin.join("envace.json"), profile_json)
        .map_err(|e| TrainError::Data(e.to_string()))?;
    // The shipped model needs no optimizer state.
    let _ = std::fs::remove_file(fin.join("optimizer.safetensors"));
    // A continuation records what it continued from (and that model's own record, read
    // above), so a shipped model's whole lineage stays in its directory.
    let summary = json!({
        "kind": "pretrain",
        "init": init_record,
        "config": cfg,
        "vocab_size": tok.vocab_size(),
        "parameters": dcfg.parameter_count(),
        "actor_examples": actor,
        "simulator_examples": sim,
        "mean_tokens": mean_tokens,
        "sft": report,
    });
    std::fs::write(
        fin.join("pretrain.json"),
        serde_json::to_string_pretty(&summary).unwrap_or_default(),
    )
    .map_err(|e| TrainError::Data(e.to_string()))?;
    if out.exists() {
        std::fs::remove_dir_all(out)
            .map_err(|e| TrainError::Data(format!("{}: {e}", out.display())))?;
    }
    std::fs::rename(&fin, out).map_err(|e| TrainError::Data(format!("{}: {e}", out.display())))?;
    let _ = std::fs::remove_dir_all(&work);
    Ok(PretrainReport {
        out: out.display().to_string(),
        vocab_size: tok.vocab_size(),
        parameters: dcfg.parameter_count(),
        actor_examples: actor,
        simulator_examples: sim,
        mean_tokens,
        sft: report,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
