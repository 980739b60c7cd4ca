//! `envace pretrain` from the command line: a continuation keeps its tokenizer and records its
//! lineage, training commands run with the training allocator settings, and `--full` from an
//! adapter writes a plain checkpoint of every weight (split from tests/train.rs, which tests the
//! trainers through the library).

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;
use common::{envace, ok_json};

use std::path::{Path, PathBuf};

use candle_core::Device;
use envace::runtime::LocalModel;

/// A two-step `envace pretrain --init init --out out` on a tiny corpus (seed 3, batch 2, 3 tasks
/// per domain, JSON report) at learning rate `lr`, with `extra` flags.
fn short_pretrain(init: &Path, out: &Path, lr: &str, extra: &[&str]) -> std::process::Output {
    use std::ffi::OsStr;
    let mut args: Vec<&OsStr> = vec!["pretrain".as_ref(), "--init".as_ref()];
    args.extend([init.as_os_str(), "--out".as_ref(), out.as_os_str()]);
    let fixed = [
        "--seed",
        "3",
        "--steps",
        "2",
        "--batch",
        "2",
        "--lr",
        lr,
        "--tasks-per-domain",
        "3",
        "--json",
    ];
    args.extend(fixed.iter().chain(extra).map(|a| OsStr::new(*a)));
    envace(&args)
}

/// `envace pretrain --init` continues the bundled model: the output loads, keeps the tokenizer,
/// has new weights, and its `pretrain.json` records what it continued from (and that model's
/// own record), so a shipped model's lineage stays in its directory. A parent whose record is
/// malformed is refused before any training, naming the file.
#[test]
fn a_pretrain_continuation_keeps_the_tokenizer_and_records_its_lineage() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bundled = root.join("models/envace-tiny");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("cont");
    let pretrain = |init: &Path, out: &Path| {
        let extra = [
            "--copy-per-task",
            "1",
            "--random-copy",
            "0.5",
            "--random-entities",
            "1",
        ];
        short_pretrain(init, out, "1e-4", &extra)
    };
    let report = ok_json(&pretrain(&bundled, &out));
    assert_eq!(report["sft"]["steps"], 2, "{report}");
    let read = |p: PathBuf| std::fs::read(&p).unwrap();
    assert_eq!(
        read(out.join("tokenizer.json")),
        read(bundled.join("tokenizer.json"))
    );
    assert_ne!(
        read(out.join("model.safetensors")),
        read(bundled.join("model.safetensors")),
        "two optimizer steps changed no weight"
    );
    let json = |p: PathBuf| serde_json::from_slice::<serde_json::Value>(&read(p)).unwrap();
    let record = json(out.join("pretrain.json"));
    assert_eq!(record["init"]["path"], bundled.display().to_string());
    assert_eq!(
        record["init"]["pretrain"],
        json(bundled.join("pretrain.json"))
    );
    assert_eq!(record["config"]["corpus"]["random_entity_fraction"], 1.0);
    assert!(
        !out.with_extension("work").exists(),
        "work directory left behind"
    );
    // And it runs: the continuation plays a test task to its end.
    let sessions = tmp.path().join("sessions");
    let eval = ok_json(&envace(&[
        "eval".as_ref(),
        "--model".as_ref(),
        out.as_os_str(),
        "--env".as_ref(),
        "bank".as_ref(),
        "--limit".as_ref(),
        "1".as_ref(),
        "--seed".as_ref(),
        "0".as_ref(),
        "--json".as_ref(),
        "--sessions".as_ref(),
        sessions.as_os_str(),
    ]));
    assert_eq!(eval["tasks"], 1, "{eval}");

    // A parent with a malformed record: refused up front, naming the file; nothing written.
    let broken = tmp.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    for f in std::fs::read_dir(&out).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, broken.join(f.file_name().unwrap())).unwrap();
    }
    std::fs::write(
        broken.join("pretrain.json"),
        "{\"kind\": \"pretrain\",\n  \"init\": ",
    )
    .unwrap();
    let out2 = tmp.path().join("cont2");
    let st = pretrain(&broken, &out2);
    assert!(
        !st.status.success(),
        "a malformed parent record was accepted"
    );
    let err = String::from_utf8_lossy(&st.stderr);
    assert!(
        err.contains("pretrain.json") && err.contains("line 2"),
        "{err}"
    );
    assert!(!out2.exists() && !out2.with_extension("work").exists());
}

/// Training commands restart themselves with glibc's allocator tuned for training (freed
/// buffers stay mapped), unless the user set `MALLOC_MMAP_MAX_` themselves.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn training_commands_run_with_the_training_allocator_settings() {
    let environ = |user: Option<&str>| -> String {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_envace"));
        cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["bench", "train", "--steps", "100000"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        if let Some(v) = user {
            cmd.env("MALLOC_MMAP_MAX_", v);
        }
        let mut child = cmd.spawn().unwrap();
        // exec keeps the pid: poll until the restarted process (or the original) is settled.
        let path = format!("/proc/{}/environ", child.id());
        let t0 = std::time::Instant::now();
        let mut env = String::new();
        while t0.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(300));
            env = std::fs::read(&path)
                .map(|b| String::from_utf8_lossy(&b).replace('\0', "\n"))
                .unwrap_or_default();
            if env.contains("MALLOC_MMAP_MAX_") {
                break;
            }
        }
        child.kill().unwrap();
        child.wait().unwrap();
        env
    };
    let ours = environ(None);
    assert!(
        ours.contains("MALLOC_MMAP_MAX_=0") && ours.contains("MALLOC_TRIM_THRESHOLD_=100000000000"),
        "{ours}"
    );
    let users = environ(Some("65536"));
    assert!(users.contains("MALLOC_MMAP_MAX_=65536"), "{users}");
    assert!(!users.contains("MALLOC_TRIM_THRESHOLD_"), "{users}");
}

/// `envace pretrain --full` end to end: a LoRA continuation of the bundled model, then `--full`
/// from that adapter writes a plain checkpoint in which weights no adapter touches (the
/// embeddings) trained too, and records `full` in its `pretrain.json`; without `--full` the
/// same `--init` stays an adapter. `--full` without `--init`, or with `--lora`, is refused.
#[test]
fn pretrain_full_from_an_adapter_writes_a_plain_checkpoint_of_every_weight() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bundled = root.join("models/envace-tiny");
    let tmp = tempfile::tempdir().unwrap();
    let pretrain =
        |init: &Path, out: &Path, extra: &[&str]| short_pretrain(init, out, "1e-3", extra);
    let adapter = tmp.path().join("adapter");
    ok_json(&pretrain(&bundled, &adapter, &["--lora", "4"]));
    assert!(adapter.join("adapter_config.json").is_file());
    let full = tmp.path().join("full");
    ok_json(&pretrain(&adapter, &full, &["--full"]));
    assert!(
        !full.join("adapter_config.json").exists(),
        "still an adapter"
    );
    let tensors = |p: PathBuf| {
        candle_core::safetensors::load(p, &Device::Cpu)
            .unwrap()
            .remove("model.embed_tokens.weight")
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    assert_ne!(
        tensors(full.join("model.safetensors")),
        tensors(bundled.join("model.safetensors")),
        "the embeddings did not train"
    );
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(full.join("pretrain.json")).unwrap()).unwrap();
    assert_eq!(record["config"]["full"], true, "{record}");
    LocalModel::load_on(&full, &Device::Cpu, None).unwrap();
    // The same --init without --full continues the adapter.
    let again = tmp.path().join("again");
    ok_json(&pretrain(&adapter, &again, &[]));
    assert!(again.join("adapter_config.json").is_file());
    // Refused by the CLI, before any work.
    let o = envace(&["pretrain".as_ref(), "--full".as_ref()]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--init"));
    let o = pretrain(&adapter, &tmp.path().join("x"), &["--full", "--lora", "4"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot be used with"));
}
