//! LoRA and training from sessions: only the adapters train (the base stays bit-identical),
//! adapters are saved with PEFT names and config, a merge equals base + (alpha/r)·B A (weights
//! and logits), LoRA GRPO checkpoints and resumes, `train sft` learns its session rows, and bad
//! inputs fail naming the pattern or file.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;
use common::{bundled, file_tensors, flat, max_abs_diff};

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{Device, Tensor};
use envace::runtime::config::Family;
use envace::runtime::decoder::{Decoder, LogitsAt, Pass, Weight};
use envace::runtime::fixture::write_tiny_checkpoint;
use envace::runtime::tokenizer::Tokenizer;
use envace::runtime::{CancelToken, DeviceChoice, LocalModel};
use envace::train::checkpoint::load_for_resume;
use envace::train::data::{SessionDataOptions, expand_glob, session_examples};
use envace::train::lora::{LoraConfig, merge_adapter};
use envace::train::metrics::MemorySink;
use envace::train::model::{Example, TrainableModel, masked_nll};
use envace::train::sft::{SftConfig, run_sft};

const ALL: &str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn examples() -> Vec<Example> {
    (0..6u32)
        .map(|k| {
            let ids: Vec<u32> = (0..20u32).map(|i| (i * 7 + k * 13) % 250).collect();
            let mask = (0..20).map(|i| if i >= 10 { 1.0 } else { 0.0 }).collect();
            Example { ids, mask }
        })
        .collect()
}

fn sft_cfg(steps: usize) -> SftConfig {
    SftConfig {
        steps,
        batch_size: 3,
        lr: 1e-2,
        warmup: 1,
        ..Default::default()
    }
}

/// `steps` SFT steps of model `m` on [`examples`] from the tokenizer beside `base`, written to
/// `out`; returns the final checkpoint directory.
fn sft_run(m: &TrainableModel, base: &Path, steps: usize, out: &Path) -> PathBuf {
    run_sft(
        m,
        &examples(),
        &sft_cfg(steps),
        &base.join("tokenizer.json"),
        Some(out),
        None,
        &mut MemorySink::default(),
        &CancelToken::new(),
    )
    .unwrap();
    out.join("final")
}

fn base_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_checkpoint(&dir.path().join("base"), Family::Qwen2, 3).unwrap();
    dir
}

/// A tiny base in a temp dir, an r = 4 (alpha 12) LoRA model on all seven projections, and the
/// adapter 8 SFT steps made of it: (the dir, the base path, the model, the adapter dir).
fn trained_adapter() -> (tempfile::TempDir, PathBuf, TrainableModel, PathBuf) {
    let dir = base_dir();
    let base = dir.path().join("base");
    let cfg = LoraConfig::new(4, Some(12.0), ALL, 2).unwrap();
    let m = TrainableModel::load_lora(&base, &cfg, &Device::Cpu).unwrap();
    let adapter = sft_run(&m, &base, 8, &dir.path().join("run"));
    (dir, base, m, adapter)
}

/// The decoder's dense weights by HF name (what a full checkpoint would hold).
fn decoder_weights(d: &Decoder) -> HashMap<String, Vec<f32>> {
    let mut out: HashMap<String, Vec<f32>> = d
        .named_linears()
        .into_iter()
        .map(|(n, l)| match &l.weight {
            Weight::Dense(w) => (format!("{n}.weight"), flat(w)),
            Weight::Quant { .. } => panic!("dense expected"),
        })
        .collect();
    out.insert("model.embed_tokens.weight".into(), flat(&d.embed.weight));
    out.insert("model.norm.weight".into(), flat(&d.norm.weight));
    out
}

fn logits(d: &Decoder, ids: &[u32]) -> Tensor {
    let t = Tensor::new(ids, &d.device).unwrap().unsqueeze(0).unwrap();
    d.forward(&t, &mut d.new_cache(), Pass::Infer, LogitsAt::All)
        .unwrap()
}

/// The training path's fused projections (`runtime::fused_block`) give an adapter the same
/// gradients as candle's own matmuls (nonzero B, so that A's gradient is not trivially zero),
/// and the frozen base none.
#[test]
fn lora_gradients_fused_equal_slow() {
    use envace::runtime::fused::{Kernels, with_kernels};
    let dir = base_dir();
    let cfg = LoraConfig::new(4, Some(8.0), ALL, 1).unwrap();
    let m = TrainableModel::load_lora(&dir.path().join("base"), &cfg, &Device::Cpu).unwrap();
    for (n, v) in m.named_vars().iter() {
        if n.ends_with(".lora_B.weight") {
            let r = Tensor::randn(0f32, 0.05, v.as_tensor().shape(), &Device::Cpu).unwrap();
            v.set(&r).unwrap();
        }
    }
    let ex = examples();
    let refs: Vec<&Example> = ex.iter().collect();
    let run = |k| {
        with_kernels(k, || {
            let (loss, _) = masked_nll(&m.decoder, &refs).unwrap();
            (
                loss.to_scalar::<f32>().unwrap(),
                envace::runtime::train_pass::backward(&loss).unwrap(),
            )
        })
    };
    let (lf, gf) = run(Kernels::Fused);
    let (ls, gs) = run(Kernels::Slow);
    assert!(
        (lf - ls).abs() < 1e-5 * ls.abs().max(1.0),
        "loss {lf} vs {ls}"
    );
    for (n, v) in m.named_vars() {
        let (a, b) = (
            gf.get(v.as_tensor()).unwrap(),
            gs.get(v.as_tensor()).unwrap(),
        );
        let scale = flat(b).iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(scale > 0.0, "{n}: zero gradient");
        assert!(
            max_abs_diff(a, b) <= 1e-4 * scale.max(1e-3),
            "{n}: fused and slow differ"
        );
    }
    for (n, l) in m.decoder.named_linears() {
        if let Weight::Dense(w) = &l.weight {
            assert!(gf.get(w).is_none(), "{n}: the frozen base got a gradient");
        }
    }
}

#[test]
fn lora_trains_only_the_adapters_and_leaves_the_base_bit_identical() {
    let dir = base_dir();
    let base = dir.path().join("base");
    let cfg = LoraConfig::new(4, Some(8.0), ALL, 1).unwrap();
    let m = TrainableModel::load_lora(&base, &cfg, &Device::Cpu).unwrap();
    // Only A and B are variables, by PEFT name.
    let vars = m.named_vars();
    let layers = m.decoder.cfg.num_hidden_layers;
    assert_eq!(vars.len(), layers * 7 * 2);
    assert!(
        vars.iter()
            .all(|(n, _)| n.starts_with("base_model.model.model.layers.")
                && (n.ends_with(".lora_A.weight") || n.ends_with(".lora_B.weight")))
    );
    let expected: usize = m
        .decoder
        .named_linears()
        .iter()
        .map(|(_, l)| {
            let (o, i) = l.dims().unwrap();
            4 * (o + i)
        })
        .sum();
    assert_eq!(m.trainable_parameters(), expected);
    assert!(m.trainable_parameters() < m.decoder.cfg.parameter_count() / 4);
    // B = 0: the adapted model starts as the base, exactly.
    let plain = LocalModel::load_on(&base, &Device::Cpu, None).unwrap();
    let ids = [5u32, 17, 99, 3, 42, 7];
    assert_eq!(
        max_abs_diff(&logits(&m.decoder, &ids), &logits(&plain.decoder, &ids)),
        0.0
    );
    // Gradients reach every adapter tensor and no base tensor.
    let ex = examples();
    let refs: Vec<&Example> = ex.iter().take(3).collect();
    let (loss, _) = masked_nll(&m.decoder, &refs).unwrap();
    let grads = envace::runtime::train_pass::backward(&loss).unwrap();
    for (n, v) in &vars {
        assert!(grads.get(v.as_tensor()).is_some(), "no gradient for {n}");
    }
    for (n, l) in m.decoder.named_linears() {
        let Weight::Dense(w) = &l.weight else {
            panic!()
        };
        assert!(grads.get(w).is_none(), "{n} received a gradient");
        if let Some(b) = &l.bias {
            assert!(grads.get(b).is_none(), "{n}.bias received a gradient");
        }
    }
    assert!(grads.get(&m.decoder.embed.weight).is_none());
    assert!(grads.get(&m.decoder.norm.weight).is_none());
    // After optimizer steps the base is bit-identical to the file and the adapters moved.
    let before = decoder_weights(&m.decoder);
    let r = run_sft(
        &m,
        &ex,
        &sft_cfg(15),
        &base.join("tokenizer.json"),
        None,
        None,
        &mut MemorySink::default(),
        &CancelToken::new(),
    )
    .unwrap();
    assert!(r.last_loss < r.first_loss, "{r:?}");
    assert_eq!(decoder_weights(&m.decoder), before);
    let on_disk = file_tensors(&base.join("model.safetensors"));
    for (n, w) in &before {
        assert_eq!(&flat(&on_disk[n]), w, "{n} changed");
    }
    let moved = m
        .named_vars()
        .iter()
        .filter(|(n, v)| {
            n.ends_with("lora_B.weight") && flat(v.as_tensor()).iter().any(|&x| x != 0.0)
        })
        .count();
    assert_eq!(moved, layers * 7, "every B should have moved");
}

#[test]
fn lora_checkpoints_use_peft_names_and_config_and_resume_bit_for_bit() {
    let dir = base_dir();
    let base = dir.path().join("base");
    let tok = base.join("tokenizer.json");
    let cfg = LoraConfig::new(4, Some(8.0), "", 0).unwrap();
    let ex = examples();
    let mut c = sft_cfg(6);
    c.checkpoint_every = 3;
    let m = TrainableModel::load_lora(&base, &cfg, &Device::Cpu).unwrap();
    let out = dir.path().join("straight");
    run_sft(
        &m,
        &ex,
        &c,
        &tok,
        Some(&out),
        None,
        &mut MemorySink::default(),
        &CancelToken::new(),
    )
    .unwrap();
    let fin = out.join("final");
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(fin.join(f).is_file(), "{f} missing");
    }
    assert!(!fin.join("model.safetensors").exists() && !fin.join("config.json").exists());
    // PEFT tensor names and shapes.
    let t = file_tensors(&fin.join("adapter_model.safetensors"));
    let (h, q, kv) = (
        m.decoder.cfg.hidden_size,
        m.decoder.cfg.num_attention_heads * m.decoder.cfg.head_dim,
        m.decoder.cfg.num_key_value_heads * m.decoder.cfg.head_dim,
    );
    let mut want = HashMap::new();
    for i in 0..m.decoder.cfg.num_hidden_layers {
        for (p, o, inp) in [
            ("q_proj", q, h),
            ("k_proj", kv, h),
            ("v_proj", kv, h),
            ("o_proj", h, q),
        ] {
            let n = format!("base_model.model.model.layers.{i}.self_attn.{p}");
            want.insert(format!("{n}.lora_A.weight"), vec![4, inp]);
            want.insert(format!("{n}.lora_B.weight"), vec![o, 4]);
        }
    }
    let got: HashMap<String, Vec<usize>> = t
        .iter()
        .map(|(k, v)| (k.clone(), v.dims().to_vec()))
        .collect();
    assert_eq!(got, want);
    // adapter_config.json with PEFT's keys.
    let ac: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fin.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(ac["peft_type"], "LORA");
    assert_eq!(ac["task_type"], "CAUSAL_LM");
    assert_eq!(ac["r"], 4);
    assert_eq!(ac["lora_alpha"], 8);
    assert_eq!(ac["lora_dropout"], 0.0);
    assert_eq!(ac["bias"], "none");
    assert_eq!(
        ac["target_modules"],
        serde_json::json!(["q_proj", "k_proj", "v_proj", "o_proj"])
    );
    assert_eq!(
        ac["base_model_name_or_path"],
        std::fs::canonicalize(&base).unwrap().display().to_string()
    );
    // An adapter whose base is named relative to itself (as shipped in models/) keeps its base
    // when it trains on: what it saves names the base resolved, so that a checkpoint written
    // at another depth still finds it.
    let moved = dir.path().join("a/b");
    std::fs::create_dir_all(&moved).unwrap();
    for f in std::fs::read_dir(&fin).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, moved.join(f.file_name().unwrap())).unwrap();
    }
    let mut rel = ac.clone();
    let rel_base = Path::new("../..").join(base.strip_prefix(dir.path()).unwrap());
    rel["base_model_name_or_path"] = rel_base.display().to_string().into();
    std::fs::write(moved.join("adapter_config.json"), rel.to_string()).unwrap();
    let m_rel = TrainableModel::load(&moved, &Device::Cpu).unwrap();
    assert_eq!(
        m_rel
            .lora
            .as_ref()
            .unwrap()
            .base_model_name_or_path
            .as_deref(),
        Some(
            std::fs::canonicalize(&base)
                .unwrap()
                .display()
                .to_string()
                .as_str()
        )
    );
    // Resume from step 3 in LoRA mode: the same adapter as the straight run.
    let ck = out.join("checkpoint-3");
    let loaded = load_for_resume(&ck, &Device::Cpu).unwrap();
    assert_eq!(loaded.state.step, 3);
    let m2 = TrainableModel::load(&ck, &Device::Cpu).unwrap();
    assert!(m2.lora.is_some());
    let out2 = dir.path().join("resumed");
    run_sft(
        &m2,
        &ex,
        &c,
        &tok,
        Some(&out2),
        Some(&loaded),
        &mut MemorySink::default(),
        &CancelToken::new(),
    )
    .unwrap();
    let a: HashMap<String, Vec<f32>> = t.iter().map(|(k, v)| (k.clone(), flat(v))).collect();
    let b: HashMap<String, Vec<f32>> = file_tensors(&out2.join("final/adapter_model.safetensors"))
        .iter()
        .map(|(k, v)| (k.clone(), flat(v)))
        .collect();
    assert_eq!(a, b);
    // A truncated adapter is refused naming the file.
    let w = std::fs::read(fin.join("adapter_model.safetensors")).unwrap();
    std::fs::write(fin.join("adapter_model.safetensors"), &w[..w.len() / 2]).unwrap();
    let e = load_for_resume(&fin, &Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("adapter_model.safetensors"), "{e}");
}

/// An adapter records the sha256 of the base it was trained on (`envace_base.json`); loaded on
/// another file at the base's path it is refused, naming the record and both hashes, by the
/// inference loader and by training alike. Without the record (PEFT's adapters) nothing is
/// checked.
#[test]
fn an_adapter_on_a_base_other_than_its_own_is_refused() {
    let dir = base_dir();
    let base = dir.path().join("base");
    let cfg = LoraConfig::new(4, Some(8.0), "", 0).unwrap();
    let m = TrainableModel::load_lora(&base, &cfg, &Device::Cpu).unwrap();
    let fin = sft_run(&m, &base, 1, &dir.path().join("run"));
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fin.join("envace_base.json")).unwrap())
            .unwrap();
    let hash = envace::runtime::loader::base_hash(&base).unwrap();
    assert_eq!(record["sha256"], hash.as_str());
    // Its own base: loads, for inference and for training.
    let own = LocalModel::load(&fin, DeviceChoice::Cpu).unwrap();
    drop(own);
    TrainableModel::load(&fin, &Device::Cpu).unwrap();
    // Another base at the same path (one weight changed).
    let weights = base.join("model.safetensors");
    let mut t = file_tensors(&weights);
    let name = t.keys().next().unwrap().clone();
    let bumped = (t[&name].clone() + 1.0).unwrap();
    t.insert(name, bumped);
    candle_core::safetensors::save(&t, &weights).unwrap();
    let other = envace::runtime::loader::base_hash(&base).unwrap();
    assert_ne!(other, hash);
    let merged = dir.path().join("merged");
    for msg in [
        LocalModel::load(&fin, DeviceChoice::Cpu)
            .unwrap_err()
            .to_string(),
        TrainableModel::load(&fin, &Device::Cpu)
            .unwrap_err()
            .to_string(),
        merge_adapter(Some(&base), &fin, &merged, None)
            .unwrap_err()
            .to_string(),
    ] {
        assert!(
            msg.contains("envace_base.json")
                && msg.contains("sha256")
                && msg.contains(&hash)
                && msg.contains(&other),
            "{msg}"
        );
    }
    assert!(!merged.exists(), "a refused merge writes nothing");
    // A record that is not a hash is an error naming its file and field.
    let record_path = fin.join("envace_base.json");
    std::fs::write(&record_path, r#"{"sha256": "abc"}"#).unwrap();
    let msg = LocalModel::load(&fin, DeviceChoice::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("envace_base.json") && msg.contains("sha256"),
        "{msg}"
    );
    // Without the record the adapter loads (as PEFT's do).
    std::fs::remove_file(&record_path).unwrap();
    LocalModel::load(&fin, DeviceChoice::Cpu).unwrap();
}

#[test]
fn merge_equals_base_plus_scaled_ba_in_weights_and_logits() {
    let (dir, base, m, adapter) = trained_adapter();
    let merged = dir.path().join("merged");
    // A GGUF output needs a GGUF base: refused for this HF one, nothing written.
    let gguf = dir.path().join("merged.gguf");
    let e = envace::train::lora::merge_adapter_gguf(
        Some(&base),
        &adapter,
        &gguf,
        candle_core::quantized::GgmlDType::Q8_0,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("GGUF base") && e.contains("convert_hf_to_gguf"),
        "{e}"
    );
    assert!(!gguf.exists());
    let r = merge_adapter(Some(&base), &adapter, &merged, None).unwrap();
    assert_eq!(r.merged_projections, m.decoder.cfg.num_hidden_layers * 7);
    assert!(!dir.path().join("merged.tmp").exists());
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(merged.join(f).is_file(), "{f} missing");
    }
    // Weights: W' = W + (alpha/r)·B A; every other tensor unchanged.
    let w0 = file_tensors(&base.join("model.safetensors"));
    let w1 = file_tensors(&merged.join("model.safetensors"));
    let ad = file_tensors(&adapter.join("adapter_model.safetensors"));
    assert_eq!(w0.len(), w1.len());
    let scale = 12.0 / 4.0;
    for (n, w) in &w0 {
        let module = n.strip_suffix(".weight").unwrap_or(n);
        let a = ad.get(&format!("base_model.model.{module}.lora_A.weight"));
        let b = ad.get(&format!("base_model.model.{module}.lora_B.weight"));
        match (a, b) {
            (Some(a), Some(b)) => {
                let want = (w + (b.matmul(a).unwrap() * scale).unwrap()).unwrap();
                assert!(max_abs_diff(&want, &w1[n]) < 1e-6, "{n}");
                assert!(max_abs_diff(w, &w1[n]) > 0.0, "{n} unchanged");
            }
            _ => assert_eq!(flat(w), flat(&w1[n]), "{n}"),
        }
    }
    // Logits: the merged checkpoint, the adapter directory loaded as a model (folded at load)
    // and the trainer's unmerged adapted decoder agree.
    let ids = [1u32, 40, 7, 200, 13, 13, 90, 5];
    let adapted = logits(&m.decoder, &ids);
    let from_merged = logits(
        &LocalModel::load_on(&merged, &Device::Cpu, None)
            .unwrap()
            .decoder,
        &ids,
    );
    let from_adapter = logits(
        &LocalModel::load_on(&adapter, &Device::Cpu, None)
            .unwrap()
            .decoder,
        &ids,
    );
    let plain = logits(
        &LocalModel::load_on(&base, &Device::Cpu, None)
            .unwrap()
            .decoder,
        &ids,
    );
    assert!(max_abs_diff(&adapted, &from_merged) < 1e-4);
    assert!(max_abs_diff(&adapted, &from_adapter) < 1e-4);
    assert!(
        max_abs_diff(&adapted, &plain) > 1e-3,
        "the adapter changed nothing"
    );
}

/// `pretrain --full` from an adapter: the adapter folded into its base, every weight a
/// trainable variable; it starts as the adapted model and saves as a plain checkpoint.
#[test]
fn full_fine_tuning_from_an_adapter_starts_at_the_adapted_model_and_trains_every_weight() {
    let (dir, base, m, adapter) = trained_adapter();
    let full = TrainableModel::load_folded(&adapter, &Device::Cpu).unwrap();
    assert!(full.lora.is_none());
    let plain = TrainableModel::load(&base, &Device::Cpu).unwrap();
    assert_eq!(
        full.trainable_parameters(),
        plain.trainable_parameters(),
        "every weight trains"
    );
    let ids = [1u32, 40, 7, 200, 13, 13, 90, 5];
    assert!(max_abs_diff(&logits(&m.decoder, &ids), &logits(&full.decoder, &ids)) < 1e-4);
    let before = decoder_weights(&full.decoder);
    let fin = sft_run(&full, &base, 2, &dir.path().join("full"));
    assert!(fin.join("model.safetensors").is_file());
    assert!(!fin.join("adapter_config.json").exists());
    let saved = file_tensors(&fin.join("model.safetensors"));
    // Weights no adapter touched (the embeddings, the norms) trained too.
    for n in ["model.embed_tokens.weight", "model.norm.weight"] {
        assert_ne!(flat(&saved[n]), before[n], "{n} did not train");
    }
    LocalModel::load_on(&fin, &Device::Cpu, None).unwrap();
}

#[test]
fn lora_grpo_runs_two_steps_and_its_adapter_checkpoint_resumes() {
    use envace::engine::runner::ModeChoice;
    use envace::train::grpo::{GrpoConfig, GrpoRun, run_grpo};
    let src = bundled();
    let cfg = LoraConfig::new(8, None, "", 0).unwrap();
    // Real mode, seed 1: step 1 has no reward signal (no optimizer step), step 2 has some, so
    // the resumed step 2 must restore the optimizer's own step count, not the trainer's.
    let grpo = GrpoConfig {
        steps: 2,
        batch: 4,
        group: 4,
        lr: 1e-3,
        seed: 1,
        mode: ModeChoice::Real,
        checkpoint_every: 1,
        ..Default::default()
    };
    let model = TrainableModel::load_lora(&src, &cfg, &Device::Cpu).unwrap();
    let before = decoder_weights(&model.decoder);
    let out = tempfile::tempdir().unwrap();
    let mut sink = MemorySink::default();
    let r = run_grpo(
        &grpo,
        GrpoRun {
            model: &model,
            model_dir: &src,
            out: Some(out.path()),
            resume: None,
            sink: &mut sink,
            cancel: &CancelToken::new(),
        },
    )
    .unwrap();
    assert_eq!(r.steps, 2);
    assert!(
        sink.lines.iter().any(|l| l.starts_with("LoRA r=8")),
        "{:?}",
        sink.lines
    );
    assert_eq!(sink.steps[0].get("rows_with_signal"), Some(0.0));
    assert!(sink.steps[1].get("rows_with_signal").unwrap() > 0.0);
    assert_eq!(decoder_weights(&model.decoder), before, "the base moved");
    let ck = out.path().join("checkpoint-1");
    for d in [&ck, &out.path().join("final")] {
        assert!(d.join("adapter_model.safetensors").is_file());
        assert!(d.join("envace.json").is_file());
        assert!(!d.join("model.safetensors").exists());
    }
    // Resume the LoRA run from step 1 (model directory = the checkpoint).
    let loaded = load_for_resume(&ck, &Device::Cpu).unwrap();
    assert_eq!((loaded.state.kind.as_str(), loaded.state.step), ("grpo", 1));
    let m2 = TrainableModel::load(&ck, &Device::Cpu).unwrap();
    assert!(m2.lora.is_some());
    let out2 = tempfile::tempdir().unwrap();
    let r2 = run_grpo(
        &grpo,
        GrpoRun {
            model: &m2,
            model_dir: &ck,
            out: Some(out2.path()),
            resume: Some(&loaded),
            sink: &mut MemorySink::default(),
            cancel: &CancelToken::new(),
        },
    )
    .unwrap();
    assert_eq!(r2.steps, 2);
    let fin = |d: &Path| -> HashMap<String, Vec<f32>> {
        file_tensors(&d.join("final/adapter_model.safetensors"))
            .iter()
            .map(|(k, v)| (k.clone(), flat(v)))
            .collect()
    };
    assert_eq!(fin(out.path()), fin(out2.path()));
    // Resuming with another learning rate would not continue the saved run: refused, naming
    // the checkpoint and the setting, before any rollout.
    let err = run_grpo(
        &GrpoConfig {
            lr: 5e-4,
            ..grpo.clone()
        },
        GrpoRun {
            model: &m2,
            model_dir: &ck,
            out: Some(tempfile::tempdir().unwrap().path()),
            resume: Some(&loaded),
            sink: &mut MemorySink::default(),
            cancel: &CancelToken::new(),
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("checkpoint-1") && err.contains("lr: "),
        "{err}"
    );
    // The adapter directory loads as a model (for run / eval --model).
    LocalModel::load_on(&out2.path().join("final"), &Device::Cpu, None).unwrap();
}

#[test]
fn train_sft_on_the_sample_sessions_overfits_its_rows() {
    let src = bundled();
    let files = expand_glob(&format!("{}/sessions/*.jsonl", root().display())).unwrap();
    assert_eq!(files.len(), 3);
    let tok = Tokenizer::from_file(&src.join("tokenizer.json")).unwrap();
    let data = session_examples(&files, &SessionDataOptions::default(), &tok).unwrap();
    let s = &data.stats;
    // bank-success (reward 1): its 2 actor turns; the shadow session (reward 0): its one
    // main-line simulator call that reached the real bank, relabelled with the real answer.
    assert_eq!(
        (s.actor_rows, s.simulator_rows, s.simulator_relabelled),
        (2, 1, 1),
        "{s:?}"
    );
    assert!(
        s.skipped_branch_rows > 0 && s.skipped_low_reward_rows > 0,
        "{s:?}"
    );
    let relabelled = data
        .examples
        .iter()
        .map(|e| {
            let start = e.mask.iter().position(|&m| m > 0.0).unwrap();
            tok.decode(&e.ids[start..]).unwrap()
        })
        .find(|t| t.contains("execution_result"))
        .unwrap();
    assert!(
        relabelled.contains("account acc_597 not found"),
        "{relabelled}"
    );
    let cfg = LoraConfig::new(8, None, ALL, 0).unwrap();
    let m = TrainableModel::load_lora(&src, &cfg, &Device::Cpu).unwrap();
    let r = run_sft(
        &m,
        &data.examples,
        &SftConfig {
            steps: 30,
            batch_size: 3,
            lr: 5e-3,
            warmup: 2,
            max_len: 2048,
            ..Default::default()
        },
        &src.join("tokenizer.json"),
        None,
        None,
        &mut MemorySink::default(),
        &CancelToken::new(),
    )
    .unwrap();
    assert!(
        r.last_loss < 0.5 * r.first_loss,
        "{} -> {}",
        r.first_loss,
        r.last_loss
    );
}

#[test]
fn unmatched_globs_and_unreadable_sessions_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let pat = format!("{}/none-*.jsonl", dir.path().display());
    let e = expand_glob(&pat).unwrap_err().to_string();
    assert!(
        e.contains(&pat) && e.contains("matches no session files"),
        "{e}"
    );
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "this is not a session\n{}\n").unwrap();
    let tok = Tokenizer::from_file(&bundled().join("tokenizer.json")).unwrap();
    let e = session_examples(
        std::slice::from_ref(&bad),
        &SessionDataOptions::default(),
        &tok,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(&bad.display().to_string()) && e.contains("cannot read session"),
        "{e}"
    );
    // Through the binary.
    let o = envace()
        .args(["train", "sft", "--sessions", &pat, "--out"])
        .arg(dir.path().join("o"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("matches no session files"), "{err}");
}

fn envace() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_envace"));
    c.current_dir(root());
    c
}

#[test]
fn cli_train_sft_with_lora_then_merge_then_generate_from_both() {
    let dir = tempfile::tempdir().unwrap();
    let sft = dir.path().join("sft");
    let o = envace()
        .args([
            "train",
            "sft",
            "--sessions",
            "sessions",
            "--steps",
            "3",
            "--batch",
            "2",
            "--lora",
            "4",
            "--lora-targets",
            "q_proj,v_proj",
            "--json",
            "--out",
        ])
        .arg(&sft)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["report"]["steps"], 3);
    assert_eq!(
        report["lora"]["target_modules"],
        serde_json::json!(["q_proj", "v_proj"])
    );
    let adapter = sft.join("final");
    assert!(adapter.join("adapter_model.safetensors").is_file());
    let merged = dir.path().join("merged");
    let o = envace()
        .args(["merge", "--model", "models/envace-tiny", "--adapter"])
        .arg(&adapter)
        .arg("--out")
        .arg(&merged)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let gen_text = |model: &Path| -> String {
        let o = envace()
            .args([
                "generate",
                "--prompt",
                "Move 5 from acc_1 to acc_2.",
                "--max-tokens",
                "12",
                "--json",
                "--model",
            ])
            .arg(model)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["text"].as_str().unwrap().to_string()
    };
    assert_eq!(gen_text(&adapter), gen_text(&merged));
    // A session recorded with the adapter names it in its header; the merged model has none.
    let header_adapter = |model: &Path, name: &str| -> serde_json::Value {
        let out = dir.path().join(name);
        let o = envace()
            .args([
                "run",
                "--env",
                "bank",
                "--task",
                "bank-test-0001",
                "--json",
                "--model",
            ])
            .arg(model)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        // 0 or 1: the episode was played (1: it did not succeed).
        assert!(
            matches!(o.status.code(), Some(0 | 1)),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let text = std::fs::read_to_string(&out).unwrap();
        let h: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        h["adapter"].clone()
    };
    let a = header_adapter(&adapter, "with-adapter.jsonl");
    assert!(a.as_str().unwrap().ends_with("final"), "{a}");
    assert!(header_adapter(&merged, "merged.jsonl").is_null());
    // `envace train` without a subcommand is still GRPO (0 steps: just the final checkpoint).
    let grpo = dir.path().join("grpo");
    let o = envace()
        .args(["train", "--steps", "0", "--lora", "2", "--json", "--out"])
        .arg(&grpo)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        load_for_resume(&grpo.join("final"), &Device::Cpu)
            .unwrap()
            .state
            .kind,
        "grpo"
    );
    assert!(grpo.join("final/adapter_config.json").is_file());
}
