//! GRPO with a KL term, resumed: the reference a run is held to is where the run started, also
//! after `--resume` (the checkpoint saves it as `reference.safetensors`); a checkpoint without
//! one (written before) resumes against its own weights and says so; a file that does not fit
//! the policy is refused, naming it. A resumed run's report counts the whole run's episodes.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use common::{bundled, file_tensors, flat};
use envace::runtime::CancelToken;
use envace::train::checkpoint::load_for_resume;
use envace::train::lora::LoraConfig;
use envace::train::metrics::MemorySink;
use envace::train::model::TrainableModel;

/// A GRPO run with a KL term holds the policy to where the run started. Resumed from a
/// checkpoint, it must keep that reference (saved as `reference.safetensors`), not take the
/// checkpoint's weights as the new one: the resumed run ends where the uninterrupted one does,
/// and one resumed from a checkpoint without the file (as written before) does not.
#[test]
fn lora_grpo_with_kl_resumes_with_the_reference_it_started_with() {
    use envace::engine::runner::ModeChoice;
    use envace::train::checkpoint::REFERENCE_WEIGHTS;
    use envace::train::grpo::{GrpoConfig, GrpoRun, run_grpo};
    let src = bundled();
    let cfg = LoraConfig::new(8, None, "", 0).unwrap();
    // Seed 1, real mode: step 2 has reward signal, so the adapter at checkpoint-2 has moved
    // from the start; the KL term trains every row of step 3.
    let grpo = GrpoConfig {
        steps: 3,
        batch: 4,
        group: 4,
        lr: 1e-3,
        kl_coef: 0.5,
        seed: 1,
        mode: ModeChoice::Real,
        checkpoint_every: 1,
        ..Default::default()
    };
    let model = TrainableModel::load_lora(&src, &cfg, &Device::Cpu).unwrap();
    let start = model.weights();
    let start: HashMap<String, Vec<f32>> =
        start.iter().map(|(k, v)| (k.clone(), flat(v))).collect();
    let out = tempfile::tempdir().unwrap();
    let run = |model: &TrainableModel, dir: &Path, out: &Path, resume| {
        let mut sink = MemorySink::default();
        let report = run_grpo(
            &grpo,
            GrpoRun {
                model,
                model_dir: dir,
                out: Some(out),
                resume,
                sink: &mut sink,
                cancel: &CancelToken::new(),
            },
        )
        .unwrap();
        (sink, report)
    };
    let (_, whole) = run(&model, &src, out.path(), None);
    let adapter = |f: &Path| -> HashMap<String, Vec<f32>> {
        file_tensors(f)
            .iter()
            .map(|(k, v)| (k.clone(), flat(v)))
            .collect()
    };
    let ck = out.path().join("checkpoint-2");
    // Every checkpoint holds the starting adapter as the reference; checkpoint-2's own adapter
    // has moved away from it.
    assert_eq!(adapter(&ck.join(REFERENCE_WEIGHTS)), start);
    assert_ne!(adapter(&ck.join("adapter_model.safetensors")), start);
    let fin = adapter(&out.path().join("final/adapter_model.safetensors"));

    let out2 = tempfile::tempdir().unwrap();
    let loaded = load_for_resume(&ck, &Device::Cpu).unwrap();
    assert!(loaded.reference.is_some());
    let m2 = TrainableModel::load(&ck, &Device::Cpu).unwrap();
    // The report counts the whole run's episodes, the steps before the checkpoint included.
    let (_, resumed) = run(&m2, &ck, out2.path(), Some(&loaded));
    assert_eq!((whole.steps, whole.episodes), (3, 3 * 4 * 4));
    assert_eq!((resumed.steps, resumed.episodes), (3, whole.episodes));
    assert_eq!(
        adapter(&out2.path().join("final/adapter_model.safetensors")),
        fin
    );
    assert_eq!(
        adapter(&out2.path().join("final").join(REFERENCE_WEIGHTS)),
        start
    );
    // (Equal final adapters also show that the resumed policy went on from the checkpoint's
    // weights: the reference was only put in place for the copy.)

    // Without the file the reference is the checkpoint's weights (said in the log), and the
    // run ends elsewhere.
    std::fs::remove_file(ck.join(REFERENCE_WEIGHTS)).unwrap();
    let loaded = load_for_resume(&ck, &Device::Cpu).unwrap();
    assert!(loaded.reference.is_none());
    let m3 = TrainableModel::load(&ck, &Device::Cpu).unwrap();
    let out3 = tempfile::tempdir().unwrap();
    let (sink, _) = run(&m3, &ck, out3.path(), Some(&loaded));
    assert!(
        sink.lines.iter().any(|l| l.contains(REFERENCE_WEIGHTS)),
        "{:?}",
        sink.lines
    );
    assert_ne!(
        adapter(&out3.path().join("final/adapter_model.safetensors")),
        fin
    );

    // A reference file that does not fit the policy is refused, naming the file and tensor.
    let mut bad = file_tensors(&ck.join("adapter_model.safetensors"));
    let name = bad.keys().min().unwrap().clone();
    bad.insert(
        name.clone(),
        Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&bad, ck.join(REFERENCE_WEIGHTS)).unwrap();
    let loaded = load_for_resume(&ck, &Device::Cpu).unwrap();
    let err = run_grpo(
        &grpo,
        GrpoRun {
            model: &m3,
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
        err.contains(REFERENCE_WEIGHTS) && err.contains(&name),
        "{err}"
    );
}
