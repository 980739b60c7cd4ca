//! `envace pretrain` (supervised training on the generated corpus, from scratch or from a
//! model), `envace train` (GRPO), `envace train sft` (on collected sessions) and `envace
//! merge`: the trainable model and the configuration the flags name, handed to `envace::train`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use super::require_local;
use crate::cli::{LoraArgs, MergeArgs, SftArgs, TrainArgs};
use envace::runtime::CancelToken;

/// The model to train: a checkpoint to resume (full or LoRA), else `model` fully trainable or
/// with fresh LoRA adapters.
fn trainable_model(
    model: &Path,
    lora: &LoraArgs,
    seed: u64,
    resume: Option<&Path>,
    device: &candle_core::Device,
) -> Result<(
    envace::train::model::TrainableModel,
    Option<envace::train::checkpoint::Loaded>,
    PathBuf,
)> {
    use envace::train::lora::LoraConfig;
    use envace::train::model::TrainableModel;
    require_local(model)?;
    Ok(match resume {
        Some(path) => {
            // A run directory resumes from its latest complete checkpoint.
            let dir = &envace::train::checkpoint::resolve_checkpoint(path)?;
            let loaded = envace::train::checkpoint::load_for_resume(dir, device)?;
            let m = TrainableModel::load(dir, device)
                .with_context(|| format!("loading checkpoint {}", dir.display()))?;
            if lora.lora.is_some() && m.lora.is_none() {
                bail!(
                    "--lora with --resume: {} is a full fine-tuning checkpoint",
                    dir.display()
                );
            }
            (m, Some(loaded), dir.to_path_buf())
        }
        None => {
            let m = match lora.lora {
                Some(r) => TrainableModel::load_lora(
                    model,
                    &LoraConfig::new(r, lora.lora_alpha, &lora.lora_targets, seed)?,
                    device,
                ),
                None => TrainableModel::load(model, device),
            }
            .with_context(|| format!("loading model {}", model.display()))?;
            (m, None, model.to_path_buf())
        }
    })
}

fn default_lr(lr: Option<f64>, lora: bool) -> f64 {
    lr.unwrap_or(if lora { 1e-3 } else { 1e-4 })
}

pub fn train(a: TrainArgs) -> Result<()> {
    use envace::train::grpo::{GrpoConfig, GrpoRun, run_grpo};
    use envace::train::metrics::JsonlSink;
    if a.algo != "grpo" {
        bail!("--algo `{}`: only `grpo` is available", a.algo);
    }
    let Some(out) = a.out.clone() else {
        bail!("--out is required");
    };
    if a.epochs == 0 {
        bail!("--epochs 0: at least one optimisation pass per step");
    }
    if a.micro_batch_tokens == Some(0) {
        bail!("--micro-batch-tokens 0: a micro-batch holds at least one row");
    }
    let device = candle_core::Device::Cpu;
    let (model, resume, model_dir) =
        trainable_model(&a.model, &a.lora, a.seed, a.resume.as_deref(), &device)?;
    let cfg = GrpoConfig {
        domains: a.env.split(',').map(str::to_string).collect(),
        mode: a.mode,
        steps: a.steps,
        batch: a.batch,
        group: a.group,
        lr: a.lr.unwrap_or(if model.lora.is_some() {
            1e-3
        } else {
            GrpoConfig::default().lr
        }),
        temperature: a.temperature,
        sim_temperature: a.sim_temperature,
        kl_coef: a.kl,
        entropy_coef: a.entropy,
        seed: a.seed,
        checkpoint_every: a.checkpoint_every,
        time_budget_s: a.minutes.map(|m| m * 60.0),
        grounding_coef: a.grounding,
        grounding_sessions: a.grounding_sessions.clone(),
        rollouts_dir: a.rollouts.clone(),
        collapse_patience: a.collapse_patience,
        epochs: a.epochs,
        frozen: a.freeze.clone(),
        random_entities: a.random_entities,
        entity_style: a.entity_style,
        task_limit: a.limit,
        task_ids: a.tasks.clone(),
        negative_weight: a.negative_weight,
        imitation: a.imitation,
        sim_recall: a.sim_recall,
        roles: envace::train::data::parse_roles(&a.roles)?,
        mask_copies: a.mask_copies,
        micro_batch_tokens: a.micro_batch_tokens,
        ..GrpoConfig::default()
    };
    // Bad settings are refused before the output directory is made.
    cfg.validate()?;
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let mut sink = JsonlSink::create(&out.join("metrics.jsonl"), a.json)?;
    let report = run_grpo(
        &cfg,
        GrpoRun {
            model: &model,
            model_dir: &model_dir,
            out: Some(&out),
            resume: resume.as_ref(),
            sink: &mut sink,
            cancel: &CancelToken::new(),
        },
    )?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// `envace train sft`: supervised fine-tuning on collected sessions (rows chosen by
/// `envace::train::data`), through the same SFT loop and checkpoints as pretraining.
pub fn train_sft(a: SftArgs) -> Result<()> {
    use envace::train::data::{SessionDataOptions, expand_glob, parse_roles, session_examples};
    use envace::train::metrics::JsonlSink;
    use envace::train::sft::{SftConfig, run_sft};
    let files = expand_glob(&a.sessions)?;
    let device = candle_core::Device::Cpu;
    let (model, resume, model_dir) =
        trainable_model(&a.model, &a.lora, a.seed, a.resume.as_deref(), &device)?;
    let tok_json = model_dir.join("tokenizer.json");
    let tok = envace::runtime::tokenizer::Tokenizer::from_file(&tok_json)?;
    let opts = SessionDataOptions {
        roles: parse_roles(&a.roles)?,
        min_reward: a.min_reward,
    };
    let data = session_examples(&files, &opts, &tok)?;
    if data.examples.is_empty() {
        bail!(
            "--sessions `{}`: no rows pass the filters (--roles {}, --min-reward {}): {}",
            a.sessions,
            a.roles,
            a.min_reward,
            serde_json::to_string(&data.stats)?
        );
    }
    let cfg = SftConfig {
        steps: a.steps,
        batch_size: a.batch,
        lr: default_lr(a.lr, model.lora.is_some()),
        warmup: (a.steps / 10).min(20),
        seed: a.seed,
        // Session prompts are long: never cut the response off.
        max_len: model.decoder.cfg.max_position_embeddings,
        checkpoint_every: a.checkpoint_every,
        ..SftConfig::default()
    };
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut sink = JsonlSink::create(&a.out.join("metrics.jsonl"), a.json)?;
    let report = run_sft(
        &model,
        &data.examples,
        &cfg,
        &tok_json,
        Some(&a.out),
        resume.as_ref(),
        &mut sink,
        &CancelToken::new(),
    )?;
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "data": data.stats,
            "trainable_parameters": model.trainable_parameters(),
            "lora": model.lora.as_ref().map(|c| c.to_peft_json()),
            "report": report,
            "final": a.out.join("final"),
        }))?
    );
    Ok(())
}

/// `envace merge`.
pub fn merge(a: MergeArgs) -> Result<()> {
    use envace::train::lora::{merge_adapter, merge_adapter_gguf};
    let gguf = a.out.extension().and_then(|e| e.to_str()) == Some("gguf");
    let r = if gguf {
        let dtype = a.dtype.unwrap_or(crate::cli::MergeDtype::Q8_0).ggml();
        merge_adapter_gguf(a.model.as_deref(), &a.adapter, &a.out, dtype)?
    } else {
        let dtype = match a.dtype {
            None => None,
            Some(d) => Some(d.dense().ok_or_else(|| {
                let name = clap::ValueEnum::to_possible_value(&d)
                    .map(|v| v.get_name().to_string())
                    .unwrap_or_default();
                anyhow::anyhow!(
                    "--dtype {name}: an HF checkpoint directory stores f32, bf16 or f16; GGUF quantizations need an --out ending in .gguf"
                )
            })?),
        };
        merge_adapter(a.model.as_deref(), &a.adapter, &a.out, dtype)?
    };
    println!("{}", serde_json::to_string_pretty(&r)?);
    Ok(())
}

/// `envace pretrain`: the corpus and training settings the flags name (fractions and kind
/// weights checked first), then `envace::train::pretrain::run_pretrain`.
pub fn pretrain(a: crate::cli::PretrainArgs) -> Result<()> {
    use envace::train::metrics::{JsonlSink, MetricsSink, NullSink};
    use envace::train::pretrain::{PretrainConfig, run_pretrain};
    let mut cfg = PretrainConfig {
        seed: a.seed,
        vocab_size: a.vocab,
        hidden_size: a.hidden,
        layers: a.layers,
        ..Default::default()
    };
    cfg.intermediate_size = a.hidden * 11 / 4;
    cfg.sft.steps = a.steps;
    cfg.sft.batch_size = a.batch;
    cfg.sft.lr = a.lr;
    cfg.sft.time_budget_s = Some(a.minutes * 60.0);
    cfg.sft.stop_at = a.stop_at;
    cfg.sft.checkpoint_every = a.checkpoint_every;
    cfg.sft.warmup = a.warmup;
    cfg.corpus.tasks_per_domain = a.tasks_per_domain;
    cfg.corpus.sim_per_task = a.sim_per_task;
    cfg.corpus.memory_fraction = a.memory_fraction;
    cfg.corpus.slip_fraction = a.slip_fraction;
    cfg.corpus.slip_values = a.slip_values;
    cfg.corpus.copy_per_task = a.copy_per_task;
    cfg.corpus.recorded_fraction = a.recorded_fraction;
    cfg.corpus.random_copy_fraction = a.random_copy;
    cfg.corpus.random_entity_fraction = a.random_entities;
    cfg.corpus.random_entity_style = a.entity_style;
    cfg.corpus.tool_drills_per_task = a.tool_drills;
    cfg.corpus.tool_drill_style = a.tool_drill_style;
    cfg.corpus.calc_drills_per_task = a.calc_drills;
    cfg.corpus.spell_drills_per_task = a.spell_drills;
    cfg.corpus.price_steps = a.price_steps;
    cfg.corpus.template = a.template;
    cfg.corpus.kind_weights = a.kind_weights.iter().cloned().collect();
    let unknown =
        envace::train::pretrain::unknown_kinds(&envace::env::domains::Domain::ALL, &cfg.corpus);
    if !unknown.is_empty() {
        anyhow::bail!(
            "--kind-weight: no train-split task of the corpus has kind {} (the kinds are the second column of `envace tasks DOMAIN --split train`)",
            unknown.join(", ")
        );
    }
    for (flag, v) in [
        ("--random-entities", a.random_entities),
        ("--random-copy", a.random_copy),
        ("--memory-fraction", a.memory_fraction),
        ("--slip-fraction", a.slip_fraction),
        ("--recorded-fraction", a.recorded_fraction),
    ] {
        if !(0.0..=1.0).contains(&v) {
            anyhow::bail!("{flag} {v}: a fraction between 0 and 1");
        }
    }
    if a.entity_style != envace::train::pretrain::EntityStyle::Letters && a.random_entities == 0.0 {
        anyhow::bail!("--entity-style shapes the copies of --random-entities F, which is 0");
    }
    cfg.corpus.seed = a.seed;
    if let Some(r) = a.lora.lora {
        cfg.lora = Some(envace::train::lora::LoraConfig::new(
            r,
            a.lora.lora_alpha,
            &a.lora.lora_targets,
            a.seed,
        )?);
    }
    cfg.full = a.full;
    if a.dry_run {
        let stats = envace::train::pretrain::dry_run(&cfg)?;
        println!("{}", serde_json::to_string_pretty(&stats)?);
        return Ok(());
    }
    let mut sink: Box<dyn MetricsSink> = match &a.metrics {
        Some(p) => Box::new(JsonlSink::create(p, a.json)?),
        None => Box::new(NullSink),
    };
    let report = run_pretrain(
        &cfg,
        a.init.as_deref(),
        &a.out,
        sink.as_mut(),
        &CancelToken::new(),
    )?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
