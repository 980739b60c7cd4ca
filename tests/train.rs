//! Training: SFT learns, the mask selects exactly the generated tokens, resume is bit-for-bit,
//! broken checkpoints are refused, and a GRPO step runs on the bundled model end to end.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;
use common::{envace, ok_json};

use std::path::Path;

use candle_core::Device;
use envace::runtime::config::Family;
use envace::runtime::fixture::write_tiny_checkpoint;
use envace::runtime::{CancelToken, LocalModel};
use envace::train::checkpoint::{load_for_resume, resolve_checkpoint};
use envace::train::metrics::MemorySink;
use envace::train::model::{Example, TrainableModel, batch_tensors, masked_nll, token_logprobs};
use envace::train::sft::{SftConfig, run_sft};

fn examples() -> Vec<Example> {
    (0..6u32)
        .map(|k| {
            let ids: Vec<u32> = (0..20u32).map(|i| (i * 7 + k * 13) % 250).collect();
            let mask = (0..20).map(|i| if i >= 10 { 1.0 } else { 0.0 }).collect();
            Example { ids, mask }
        })
        .collect()
}

fn tiny() -> (tempfile::TempDir, TrainableModel) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_checkpoint(dir.path(), Family::Qwen2, 3).unwrap();
    let m = TrainableModel::load(dir.path(), &Device::Cpu).unwrap();
    (dir, m)
}

fn cfg(steps: usize) -> SftConfig {
    SftConfig {
        steps,
        batch_size: 3,
        lr: 3e-3,
        warmup: 2,
        checkpoint_every: 0,
        ..Default::default()
    }
}

#[test]
fn loss_falls_on_a_tiny_overfit_set() {
    let (dir, m) = tiny();
    let r = run_sft(
        &m,
        &examples(),
        &cfg(40),
        &dir.path().join("tokenizer.json"),
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

/// `stop_at` ends a run early on the long run's schedule: its steps are the long run's first
/// steps (same batches, same learning rates), as a run cut by its time budget was.
#[test]
fn stop_at_reproduces_the_first_steps_of_the_longer_run() {
    let losses = |c: &SftConfig| {
        let (dir, m) = tiny();
        let mut sink = MemorySink::default();
        let r = run_sft(
            &m,
            &examples(),
            c,
            &dir.path().join("tokenizer.json"),
            None,
            None,
            &mut sink,
            &CancelToken::new(),
        )
        .unwrap();
        let l: Vec<(f64, f64)> = sink
            .steps
            .iter()
            .filter_map(|p| {
                Some((
                    p.values.get("loss")?.as_f64()?,
                    p.values.get("lr")?.as_f64()?,
                ))
            })
            .collect();
        (r.steps, l)
    };
    let c = |steps: usize, stop_at: Option<usize>| SftConfig {
        warmup: 1,
        stop_at,
        ..cfg(steps)
    };
    let (n_full, full) = losses(&c(8, None));
    let (n_cut, cut) = losses(&c(8, Some(3)));
    let (_, short) = losses(&c(3, None));
    assert_eq!((n_full, n_cut), (8, 3));
    assert_eq!(cut.len(), 3);
    assert_eq!(cut[..], full[..3]);
    // A 3-step run has its own (shorter) schedule: not the same learning rates.
    assert_ne!(short[2].1, cut[2].1);
}

#[test]
fn the_loss_is_the_mean_over_masked_tokens_only() {
    let (_dir, m) = tiny();
    let ex = examples();
    let refs: Vec<&Example> = ex.iter().take(2).collect();
    let (loss, n) = masked_nll(&m.decoder, &refs).unwrap();
    let (ids, mask) = batch_tensors(&refs, &Device::Cpu).unwrap();
    let lp = token_logprobs(&m.decoder, &ids)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let mask = mask.to_vec2::<f32>().unwrap();
    let mut sum = 0f64;
    let mut count = 0f64;
    for (r, row) in lp.iter().enumerate() {
        for (t, v) in row.iter().enumerate() {
            if mask[r][t] > 0.0 {
                sum += *v as f64;
                count += 1.0;
            }
        }
    }
    assert_eq!(n, count);
    assert_eq!(count, 2.0 * 10.0);
    let want = -sum / count;
    assert!((loss.to_scalar::<f32>().unwrap() as f64 - want).abs() < 1e-4);
    // A fully masked-out example contributes nothing: its loss is zero.
    let none = Example {
        ids: ex[0].ids.clone(),
        mask: vec![0.0; 20],
    };
    let (l0, n0) = masked_nll(&m.decoder, &[&none]).unwrap();
    assert_eq!(n0, 0.0);
    assert_eq!(l0.to_scalar::<f32>().unwrap(), 0.0);
}

fn weights_of(dir: &Path) -> std::collections::HashMap<String, Vec<f32>> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

#[test]
fn resume_continues_bit_for_bit() {
    let ex = examples();
    // Straight run: 8 steps with a checkpoint every 4.
    let (dir, m) = tiny();
    let tok = dir.path().join("tokenizer.json");
    let out = dir.path().join("straight");
    let mut c = cfg(8);
    c.checkpoint_every = 4;
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
    // Resumed run: from checkpoint-4 to 8.
    let ck = out.join("checkpoint-4");
    let loaded = load_for_resume(&ck, &Device::Cpu).unwrap();
    assert_eq!(loaded.state.step, 4);
    let m2 = TrainableModel::load(&ck, &Device::Cpu).unwrap();
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
    assert_eq!(
        weights_of(&out.join("final")),
        weights_of(&out2.join("final"))
    );
    // The checkpoint is a loadable model directory.
    LocalModel::load_on(&out2.join("final"), &Device::Cpu, None).unwrap();
    // `--resume` takes the run directory too: its latest complete checkpoint (`final` once the
    // run finished, else the highest `checkpoint-N`).
    assert_eq!(resolve_checkpoint(&out).unwrap(), out.join("final"));
    assert_eq!(resolve_checkpoint(&ck).unwrap(), ck);
    std::fs::rename(out.join("final"), dir.path().join("final-moved")).unwrap();
    std::fs::create_dir_all(out.join("checkpoint-12-tmp")).unwrap();
    assert_eq!(resolve_checkpoint(&out).unwrap(), out.join("checkpoint-8"));
    let e = resolve_checkpoint(&dir.path().join("nothing-here"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nothing-here"), "{e}");
    let empty = dir.path().join("empty-run");
    std::fs::create_dir_all(&empty).unwrap();
    let e = resolve_checkpoint(&empty).unwrap_err().to_string();
    assert!(e.contains("no `final` or `checkpoint-N`"), "{e}");
}

#[test]
fn partial_or_corrupt_checkpoints_are_refused() {
    let (dir, m) = tiny();
    let tok = dir.path().join("tokenizer.json");
    let out = dir.path().join("run");
    run_sft(
        &m,
        &examples(),
        &cfg(2),
        &tok,
        Some(&out),
        None,
        &mut MemorySink::default(),
        &CancelToken::new(),
    )
    .unwrap();
    let fin = out.join("final");
    // Truncated weights.
    let bad = dir.path().join("truncated");
    std::fs::create_dir_all(&bad).unwrap();
    for f in std::fs::read_dir(&fin).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), bad.join(f.file_name())).unwrap();
    }
    let w = std::fs::read(bad.join("model.safetensors")).unwrap();
    std::fs::write(bad.join("model.safetensors"), &w[..w.len() / 3]).unwrap();
    let e = load_for_resume(&bad, &Device::Cpu).unwrap_err().to_string();
    assert!(
        e.contains("truncated") && e.contains("model.safetensors"),
        "{e}"
    );
    // Interrupted before the state file was written.
    std::fs::write(bad.join("model.safetensors"), &w).unwrap();
    std::fs::remove_file(bad.join("trainer_state.json")).unwrap();
    let e = load_for_resume(&bad, &Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("trainer_state.json is missing"), "{e}");
    // A leftover temp directory from a killed save never replaces the good checkpoint.
    assert!(!out.join("final.tmp").exists());
}

#[test]
fn a_grpo_step_runs_on_the_bundled_model_and_checkpoints() {
    use envace::engine::runner::ModeChoice;
    use envace::train::grpo::GrpoConfig;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/envace-tiny");
    assert!(
        src.join("model.safetensors").is_file(),
        "the bundled model is missing"
    );
    let out = tempfile::tempdir().unwrap();
    let rollouts = out.path().join("rollouts");
    let cfg = GrpoConfig {
        steps: 1,
        batch: 2,
        group: 3,
        mode: ModeChoice::Rehearse,
        rollouts_dir: Some(rollouts.clone()),
        ..Default::default()
    };
    let sink = grpo_on_bundled(&cfg, out.path()).unwrap();
    assert_eq!(sink.steps.len(), 1);
    let m = &sink.steps[0];
    assert!(m.get("rows").unwrap() >= 6.0, "{m:?}");
    assert!(m.get("loss").unwrap().is_finite());
    let fin = out.path().join("final");
    assert!(fin.join("envace.json").is_file());
    assert_eq!(
        load_for_resume(&fin, &Device::Cpu).unwrap().state.kind,
        "grpo"
    );
    LocalModel::load_on(&fin, &Device::Cpu, None).unwrap();
    // Every rollout episode is on disk as a session, and the sessions hold the rows trained.
    let files: Vec<_> = std::fs::read_dir(rollouts.join("step-0000"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 6, "{files:?}");
    let mut rows = 0;
    for f in &files {
        let s = envace::session::read_session(f).unwrap();
        assert_eq!(s.header.environment, "bank");
        assert!(
            f.display()
                .to_string()
                .contains(s.header.task_id.as_deref().unwrap())
        );
        rows += envace::session::training_rows(&s.events).len();
    }
    assert_eq!(rows as f64, m.get("rows").unwrap());
}

#[test]
fn the_kl_term_trains_every_row_and_the_policy_term_only_rows_with_signal() {
    use envace::train::grpo::GrpoConfig;
    let run = |kl: f64| {
        balance_step(GrpoConfig {
            kl_coef: kl,
            ..Default::default()
        })
    };
    let (off, on) = (run(0.0), run(0.1));
    let get = |m: &envace::train::metrics::StepMetrics, k: &str| m.get(k).unwrap();
    // Same seed, same rollouts.
    assert_eq!(get(&off, "rows"), get(&on, "rows"));
    assert_eq!(get(&off, "rows_with_signal"), get(&on, "rows_with_signal"));
    let (rows, signal) = (get(&on, "rows"), get(&on, "rows_with_signal"));
    assert!(signal < rows, "every row had signal: {on:?}");
    // Without KL only the rows with signal are trained; with it, every row.
    assert_eq!(get(&off, "rows_trained"), signal, "{off:?}");
    assert_eq!(get(&on, "rows_trained"), rows, "{on:?}");
    assert_eq!(get(&off, "kl"), 0.0);
    // At the first step the policy is the reference (KL 0), and the policy term is still
    // normalised by the signal rows' tokens: the loss is the one without KL.
    assert!(get(&on, "kl").abs() < 1e-6, "{on:?}");
    let (a, b) = (get(&off, "loss"), get(&on, "loss"));
    assert!((a - b).abs() <= 1e-4 * a.abs().max(1e-3), "{a} vs {b}");
}

#[test]
fn self_imitation_gives_signal_to_groups_that_all_succeeded() {
    use envace::train::grpo::GrpoConfig;
    let run = |imitation: f64| {
        balance_step(GrpoConfig {
            imitation,
            ..Default::default()
        })
    };
    let (off, on) = (run(0.0), run(0.5));
    let get = |m: &envace::train::metrics::StepMetrics, k: &str| m.get(k).unwrap();
    assert_eq!(get(&off, "rows"), get(&on, "rows"), "same rollouts");
    assert!(get(&off, "rows_with_signal") < get(&off, "rows"), "{off:?}");
    // The rows of successful episodes in groups without advantage now carry the bonus.
    assert!(
        get(&on, "rows_with_signal") > get(&off, "rows_with_signal"),
        "{off:?} / {on:?}"
    );
    assert_eq!(get(&on, "rows_trained"), get(&on, "rows_with_signal"));
}

#[test]
fn sim_recall_answers_recorded_calls_from_the_record_in_rollouts() {
    use envace::engine::runner::ModeChoice;
    use envace::session::EventBody;
    use envace::train::grpo::GrpoConfig;
    let out = tempfile::tempdir().unwrap();
    let rollouts = out.path().join("rollouts");
    // A status question: its one gold call is `get_booking`, recorded with the true status.
    let cfg = GrpoConfig {
        domains: vec!["travel".into()],
        steps: 1,
        batch: 1,
        group: 2,
        mode: ModeChoice::Rehearse,
        sim_recall: true,
        task_ids: vec!["travel-train-0026".into()],
        rollouts_dir: Some(rollouts.clone()),
        ..Default::default()
    };
    grpo_on_bundled(&cfg, out.path()).unwrap();
    let mut recalled = 0;
    for f in std::fs::read_dir(rollouts.join("step-0000")).unwrap() {
        let s = envace::session::read_session(f.unwrap().path()).unwrap();
        for e in &s.events {
            if let EventBody::Simulated {
                call,
                outcome,
                recalled: true,
                ..
            } = &e.event
            {
                assert_eq!(call.name, "get_booking");
                assert_eq!(outcome.value().unwrap()["status"], "active");
                recalled += 1;
            }
        }
    }
    assert!(
        recalled >= 2,
        "each episode's lookup is recalled: {recalled}"
    );
}

#[test]
fn grpo_trains_only_the_roles_it_is_given() {
    use envace::engine::runner::ModeChoice;
    use envace::engine::types::GenRole;
    use envace::train::grpo::GrpoConfig;
    let run = |roles: Vec<GenRole>| {
        let out = tempfile::tempdir().unwrap();
        let cfg = GrpoConfig {
            steps: 1,
            batch: 2,
            group: 3,
            mode: ModeChoice::Rehearse,
            roles,
            ..Default::default()
        };
        grpo_on_bundled(&cfg, out.path()).unwrap().steps[0].clone()
    };
    let both = run(vec![GenRole::Actor, GenRole::Simulator]);
    let actor = run(vec![GenRole::Actor]);
    let get = |m: &envace::train::metrics::StepMetrics, k: &str| m.get(k).unwrap();
    assert_eq!(get(&both, "rows"), get(&actor, "rows"), "same rollouts");
    let (b, a) = (get(&both, "rows_trained"), get(&actor, "rows_trained"));
    assert!(a > 0.0 && a < b, "actor-only {a} of {b} rows trained");
}

#[test]
fn the_copy_mask_leaves_copied_values_out_of_the_policy_term_only() {
    use envace::train::grpo::GrpoConfig;
    let run = |mask_copies: bool| {
        balance_step(GrpoConfig {
            mask_copies,
            kl_coef: 0.1,
            // Every episode of these groups succeeds: the imitation bonus gives the rows the
            // policy signal the mask acts on.
            imitation: 0.5,
            ..Default::default()
        })
    };
    let (off, on) = (run(false), run(true));
    let get = |m: &envace::train::metrics::StepMetrics, k: &str| m.get(k).unwrap();
    assert_eq!(get(&off, "rows"), get(&on, "rows"), "same rollouts");
    assert!(off.get("copy_masked_frac").is_none(), "{off:?}");
    // Balance answers copy the account and the amount from the question and the tool response.
    let f = get(&on, "copy_masked_frac");
    assert!(f > 0.1 && f < 0.9, "masked fraction {f}");
    // The bundled model's text is ASCII: every row maps onto its tokens.
    assert_eq!(get(&on, "copy_mask_unmapped_rows"), 0.0);
    // The same rows are trained (the KL term covers all of them); the policy term's gradient
    // comes from fewer tokens (its loss, a mean of ratio × weight, is the same at ratio 1).
    assert_eq!(get(&off, "rows_trained"), get(&on, "rows_trained"));
    assert!(get(&on, "rows_with_signal") > 0.0, "{on:?}");
    let (a, b) = (get(&off, "grad_norm"), get(&on, "grad_norm"));
    assert!((a - b).abs() > 1e-3 * a, "grad norm {a} vs {b}");
}

/// One real-mode GRPO step (group 2) on three balance questions the bundled model answers
/// reliably, so some groups all succeed and their rows carry no GRPO advantage (the tests that
/// use it assert that, or they would prove nothing); `cfg` supplies the knob under test.
fn balance_step(cfg: envace::train::grpo::GrpoConfig) -> envace::train::metrics::StepMetrics {
    let out = tempfile::tempdir().unwrap();
    let cfg = envace::train::grpo::GrpoConfig {
        steps: 1,
        batch: 3,
        group: 2,
        mode: envace::engine::runner::ModeChoice::Real,
        task_ids: vec![
            "bank-train-0000".into(),
            "bank-train-0001".into(),
            "bank-train-0002".into(),
        ],
        ..cfg
    };
    grpo_on_bundled(&cfg, out.path()).unwrap().steps[0].clone()
}

/// Run GRPO with `cfg` on the bundled model into `out`; the step metrics, or the error.
fn grpo_on_bundled(
    cfg: &envace::train::grpo::GrpoConfig,
    out: &Path,
) -> Result<MemorySink, envace::train::TrainError> {
    use envace::train::grpo::{GrpoRun, run_grpo};
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/envace-tiny");
    let model = TrainableModel::load(&src, &Device::Cpu).unwrap();
    let mut sink = MemorySink::default();
    run_grpo(
        cfg,
        GrpoRun {
            model: &model,
            model_dir: &src,
            out: Some(out),
            resume: None,
            sink: &mut sink,
            cancel: &CancelToken::new(),
        },
    )?;
    Ok(sink)
}

#[test]
fn small_micro_batches_accumulate_to_the_same_step() {
    use envace::engine::runner::ModeChoice;
    use envace::train::grpo::GrpoConfig;
    // The same rollouts (same seed) trained as one micro-batch and as many: the step's loss and
    // gradient norm are sums over micro-batches normalised by the whole batch, so they agree to
    // float rounding.
    let run = |micro_batch_tokens: usize| {
        let out = tempfile::tempdir().unwrap();
        let cfg = GrpoConfig {
            steps: 1,
            batch: 2,
            group: 4,
            mode: ModeChoice::Real,
            lr: 1e-3,
            micro_batch_tokens: Some(micro_batch_tokens),
            ..Default::default()
        };
        let sink = grpo_on_bundled(&cfg, out.path()).unwrap();
        let m = &sink.steps[0];
        let get = |k: &str| m.get(k).unwrap_or_else(|| panic!("{k} missing: {m:?}"));
        (get("loss"), get("grad_norm"), get("rows_trained"))
    };
    let (whole, split) = (run(1 << 20), run(64));
    assert_eq!(whole.2, split.2, "rows trained");
    assert!(
        whole.0 != 0.0 && whole.1 > 0.0,
        "nothing trained: {whole:?}"
    );
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * (a.abs() + b.abs()) + 1e-7;
    assert!(
        close(whole.0, split.0) && close(whole.1, split.1),
        "one micro-batch {whole:?} vs many {split:?}"
    );
    // And the CLI refuses an empty budget by name.
    let args: Vec<&std::ffi::OsStr> = [
        "train",
        "--micro-batch-tokens",
        "0",
        "--out",
        "/nonexistent",
    ]
    .iter()
    .map(|a| a.as_ref())
    .collect();
    let o = envace(&args);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--micro-batch-tokens 0"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn frozen_parameters_stay_fixed_while_the_others_train() {
    use envace::engine::runner::ModeChoice;
    use envace::train::grpo::GrpoConfig;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/envace-tiny");
    let out = tempfile::tempdir().unwrap();
    let cfg = GrpoConfig {
        steps: 2,
        batch: 2,
        group: 4,
        mode: ModeChoice::Real,
        lr: 1e-3,
        frozen: vec!["embed_tokens".into()],
        ..Default::default()
    };
    let sink = grpo_on_bundled(&cfg, out.path()).unwrap();
    let signal: f64 = sink
        .steps
        .iter()
        .map(|m| m.get("rows_with_signal").unwrap())
        .sum();
    assert!(
        signal > 0.0,
        "no step had a reward signal: {:?}",
        sink.steps
    );
    let (before, after) = (weights_of(&src), weights_of(&out.path().join("final")));
    let emb = "model.embed_tokens.weight";
    assert_eq!(before[emb], after[emb], "the frozen embedding moved");
    let moved = before
        .keys()
        .filter(|k| k.as_str() != emb && before[*k] != after[*k])
        .count();
    assert!(moved > 0, "no trainable weight moved");
    // A pattern that matches nothing, or one that matches everything, is refused up front.
    for (frozen, says) in [
        ("embed_tokenz", "no trainable parameter"),
        ("model.", "nothing left"),
    ] {
        let bad = GrpoConfig {
            frozen: vec![frozen.into()],
            ..cfg.clone()
        };
        let err = grpo_on_bundled(&bad, out.path()).err().unwrap().to_string();
        assert!(err.contains(frozen) && err.contains(says), "{err}");
    }
}

/// Record `n` train-split episodes of the bundled model in `mode` into `dir`.
fn record_sessions(dir: &Path, mode: &str, n: usize) {
    let n = n.to_string();
    let mut args: Vec<&std::ffi::OsStr> = Vec::new();
    for a in [
        "eval",
        "--env",
        "bank",
        "--split",
        "train",
        "--mode",
        mode,
        "--limit",
        &n,
        "--seed",
        "0",
        "--json",
        "--sessions",
    ] {
        args.push(a.as_ref());
    }
    args.push(dir.as_os_str());
    ok_json(&envace(&args));
}

#[test]
fn the_grounding_loss_teaches_the_simulator_the_real_responses_of_shadow_sessions() {
    use envace::engine::runner::ModeChoice;
    use envace::engine::types::GenRole;
    use envace::train::data::{SessionDataOptions, expand_glob, session_examples};
    use envace::train::grpo::{GrpoConfig, GrpoRun, run_grpo};
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/envace-tiny");
    let sessions = tempfile::tempdir().unwrap();
    record_sessions(sessions.path(), "shadow", 3);
    let pattern = sessions.path().display().to_string();
    let model = TrainableModel::load(&src, &Device::Cpu).unwrap();
    let tok = LocalModel::load_on(&src, &Device::Cpu, None)
        .unwrap()
        .tokenizer;
    let rows = session_examples(
        &expand_glob(&pattern).unwrap(),
        &SessionDataOptions {
            roles: vec![GenRole::Simulator],
            min_reward: f64::INFINITY,
        },
        &tok,
    )
    .unwrap();
    assert!(rows.stats.simulator_relabelled > 0, "{:?}", rows.stats);
    let refs: Vec<&Example> = rows.examples.iter().collect();
    let before = masked_nll(&model.decoder, &refs)
        .unwrap()
        .0
        .to_scalar::<f32>()
        .unwrap();
    // Group 1: every advantage is 0, so only the grounding loss can move the weights.
    let cfg = GrpoConfig {
        steps: 3,
        batch: 1,
        group: 1,
        lr: 1e-3,
        mode: ModeChoice::Rehearse,
        grounding_coef: 1.0,
        grounding_sessions: Some(pattern.clone()),
        grounding_batch: 16,
        ..Default::default()
    };
    let mut sink = MemorySink::default();
    run_grpo(
        &cfg,
        GrpoRun {
            model: &model,
            model_dir: &src,
            out: None,
            resume: None,
            sink: &mut sink,
            cancel: &CancelToken::new(),
        },
    )
    .unwrap();
    assert!(
        sink.steps
            .iter()
            .all(|m| m.get("rows_with_signal") == Some(0.0))
    );
    assert!(sink.steps.iter().all(|m| m.get("grounding_nll").is_some()));
    let after = masked_nll(&model.decoder, &refs)
        .unwrap()
        .0
        .to_scalar::<f32>()
        .unwrap();
    assert!(after < before, "grounding NLL {before} -> {after}");

    // Sessions without shadow-mode simulator rows are refused, naming the pattern.
    let real = tempfile::tempdir().unwrap();
    record_sessions(real.path(), "real", 1);
    let bad = GrpoConfig {
        grounding_sessions: Some(real.path().display().to_string()),
        ..cfg
    };
    let err = run_grpo(
        &bad,
        GrpoRun {
            model: &model,
            model_dir: &src,
            out: None,
            resume: None,
            sink: &mut MemorySink::default(),
            cancel: &CancelToken::new(),
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("no shadow-mode simulator row"), "{err}");
    assert!(err.contains(&real.path().display().to_string()), "{err}");
}

#[test]
fn random_entity_groups_play_randomized_copies_and_bad_fractions_are_refused() {
    use envace::engine::runner::ModeChoice;
    use envace::train::grpo::GrpoConfig;
    let out = tempfile::tempdir().unwrap();
    let rollouts = out.path().join("rollouts");
    let cfg = GrpoConfig {
        domains: vec!["travel".into()],
        steps: 1,
        batch: 4,
        group: 2,
        mode: ModeChoice::Real,
        random_entities: 1.0,
        rollouts_dir: Some(rollouts.clone()),
        ..Default::default()
    };
    grpo_on_bundled(&cfg, out.path()).unwrap();
    // Every travel task names a place or a passenger (in the request or the state), so every
    // group plays a copy; its episodes are recorded under the copy's id, and where the request
    // names one, the request the actor saw is the copy's.
    let files: Vec<std::path::PathBuf> = std::fs::read_dir(rollouts.join("step-0000"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 8, "{files:?}");
    let mut named = 0;
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        let (train_id, _) = name.split_once("~r").expect("a randomized copy's id");
        let task = envace::env::tasks::find_builtin(train_id).expect("a train task");
        let request = &task.turns[0].user;
        let names_one = envace::env::domains::train_pool_values().iter().any(|v| {
            request
                .split(|c: char| !c.is_alphanumeric())
                .any(|w| w == *v)
        });
        if names_one {
            named += 1;
            let session = std::fs::read_to_string(f).unwrap();
            assert!(
                !session.contains(request.as_str()),
                "{name} shows the original request `{request}`"
            );
        }
    }
    assert!(named > 0, "no request named anything: {files:?}");
    for bad in [-0.1, 1.5, f64::NAN] {
        let cfg = GrpoConfig {
            random_entities: bad,
            ..cfg.clone()
        };
        let err = grpo_on_bundled(&cfg, out.path()).err().unwrap().to_string();
        assert!(err.contains("random_entities"), "{err}");
    }
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let cfg = GrpoConfig {
            random_entities: 0.0,
            negative_weight: bad,
            ..cfg.clone()
        };
        let err = grpo_on_bundled(&cfg, out.path()).err().unwrap().to_string();
        assert!(err.contains("--negative-weight"), "{err}");
    }
    for bad in [-0.5, f64::NAN, f64::INFINITY] {
        let cfg = GrpoConfig {
            random_entities: 0.0,
            imitation: bad,
            ..cfg.clone()
        };
        let err = grpo_on_bundled(&cfg, out.path()).err().unwrap().to_string();
        assert!(err.contains("--imitation"), "{err}");
    }
    let cfg = GrpoConfig {
        random_entities: 0.0,
        roles: Vec::new(),
        ..cfg.clone()
    };
    let err = grpo_on_bundled(&cfg, out.path()).err().unwrap().to_string();
    assert!(err.contains("--roles"), "{err}");
    let cfg = GrpoConfig {
        roles: vec![envace::engine::types::GenRole::Actor],
        sim_recall: true,
        mode: ModeChoice::Real,
        ..cfg
    };
    let err = grpo_on_bundled(&cfg, out.path()).err().unwrap().to_string();
    assert!(
        err.contains("`--sim-recall` needs `--mode rehearse`"),
        "{err}"
    );
}
