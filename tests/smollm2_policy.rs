//! The shipped SmolLM2 policy (models/smollm2-envace: a LoRA adapter naming its base GGUF
//! relative to itself) loads from a fresh clone once scripts/fetch-fixtures has run, and plays
//! the TUI's default test task (bank-test-0007) to success through the release binary in
//! shadow mode, recording its tool rendering in the session header; the GGUF's text is split as
//! llama.cpp splits it; and `envace merge` exports the policy for other engines (HF and GGUF).

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

mod common;
use common::{max_abs_diff, smollm2_gguf as smollm2};

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{DType, Device, Tensor};
use envace::runtime::LocalModel;
use envace::runtime::decoder::{LogitsAt, Pass};

use envace::session::EventBody;
use envace::session::format::GenRole;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The shipped adapter plays built-in bank task `task` in shadow mode, seed 0, through the
/// release binary with `extra` flags; the session goes to `dir`. Fails naming the fixture when
/// scripts/fetch-fixtures has not run.
fn play_shipped(dir: &Path, task: &str, extra: &[&str]) -> (Output, PathBuf) {
    let gguf = root().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        gguf.is_file(),
        "missing fixture {}: run scripts/fetch-fixtures",
        gguf.display()
    );
    let out = dir.join(format!("{task}.jsonl"));
    let o = Command::new(env!("CARGO_BIN_EXE_envace"))
        .current_dir(root())
        .args([
            "run",
            "--model",
            "models/smollm2-envace",
            "--env",
            "bank",
            "--task",
            task,
            "--mode",
            "shadow",
            "--seed",
            "0",
        ])
        .args(extra)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    (o, out)
}

/// bank-test-0007 is the TUI's default task ("Pay 147 to the tailor with card card_220.": the
/// card is frozen, the user then asks to unfreeze it and pay again); the payee is a held-out
/// word the model must copy (`tailor`, not `the tailor`).
#[test]
fn the_shipped_smollm2_adapter_solves_the_tuis_default_task_in_shadow_mode() {
    let dir = tempfile::tempdir().unwrap();
    let (o, out) = play_shipped(dir.path(), "bank-test-0007", &["--json"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["reward"], 1.0, "{v}");
    let s = envace::session::read_session(&out).unwrap();
    assert!(
        s.header
            .adapter
            .as_deref()
            .is_some_and(|a| a.ends_with("smollm2-envace"))
    );
    assert_eq!(s.header.model.tool_rendering.as_deref(), Some("template"));
    let paid: Vec<&serde_json::Value> = s
        .events
        .iter()
        .filter_map(|e| match &e.event {
            EventBody::Real { call, .. } if call.name == "card_pay" => Some(&call.arguments),
            _ => None,
        })
        .collect();
    assert!(!paid.is_empty());
    assert!(paid.iter().all(|a| a["payee"] == "tailor"), "{paid:?}");
}

/// Constrained decoding (`SamplingParams::tool_names`) on the shipped policy: asked to create a
/// file with file tools it never saw, it writes a name the list does not have; constrained, every
/// call names a listed tool, and prose and arguments stay its own.
#[test]
fn constrained_tool_names_keep_the_policys_calls_on_the_list() {
    use envace::engine::parse::parse_actor;
    use envace::message::Message;
    use envace::runtime::{CancelToken, DeviceChoice, LanguageModel, LocalModel, SamplingParams};
    let mut m = LocalModel::load(&root().join("models/smollm2-envace"), DeviceChoice::Cpu).unwrap();
    let names = [
        "read_text_file",
        "write_file",
        "list_directory",
        "move_file",
    ];
    let tools: Vec<serde_json::Value> = names
        .iter()
        .map(|n| {
            serde_json::json!({"type": "function", "function": {"name": n, "description": "",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                "required": ["path"]}}})
        })
        .collect();
    let prompt = m
        .render_chat(
            &[Message::user(
                "Create a file todo.txt with the content: call the bank",
            )],
            &tools,
            true,
            false,
        )
        .unwrap();
    let ids = m.encode(&prompt).unwrap();
    let free = SamplingParams {
        max_tokens: 96,
        ..SamplingParams::default()
    };
    let called = |text: &str| -> Vec<String> {
        parse_actor(text)
            .calls()
            .iter()
            .map(|c| c.name.clone())
            .collect()
    };
    let g = m
        .generate(&ids, 1, &free, None, &CancelToken::new())
        .unwrap();
    let unguarded = called(&g[0].text);
    assert!(
        unguarded.iter().any(|n| !names.contains(&n.as_str())),
        "the free policy was expected to invent a name here: {}",
        g[0].text
    );
    let guarded = SamplingParams {
        tool_names: names.iter().map(|s| s.to_string()).collect(),
        ..free
    };
    // Greedy and sampled branches alike.
    for p in [
        guarded.clone(),
        SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..guarded.clone()
        },
    ] {
        let g = m.generate(&ids, 4, &p, None, &CancelToken::new()).unwrap();
        for b in &g {
            let calls = called(&b.text);
            assert!(!calls.is_empty(), "{}", b.text);
            assert!(
                calls.iter().all(|n| names.contains(&n.as_str())),
                "{calls:?} in {}",
                b.text
            );
            assert!(b.logprobs.iter().all(|l| l.is_finite()), "{:?}", b.logprobs);
        }
    }
}

/// `scripts/copy-probe` feeds `scripts/copy-probe.prompt` (a noun in place of `{NOUN}`) to
/// `envace generate --raw`: with `tailor` its tokens must be exactly the engine's actor prompt of
/// bank-test-0007 plus the shipped policy's call up to the payee's value, or the probe measures
/// some other prompt than the one the policy plays.
#[test]
fn the_copy_probe_prompt_is_the_engines_prompt_for_bank_test_0007() {
    let dir = tempfile::tempdir().unwrap();
    let (o, out) = play_shipped(dir.path(), "bank-test-0007", &["--max-turns", "1"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    // Played to its end (one turn: the card is frozen, the call fails).
    assert!(matches!(o.status.code(), Some(0 | 1)), "{stderr}");
    let session = envace::session::read_session(&out).unwrap();
    let generation = session
        .events
        .iter()
        .find_map(|e| match &e.event {
            EventBody::Generation(g) if g.role == GenRole::Actor => Some(g),
            _ => None,
        })
        .expect("an actor generation");
    let tok = tokenizers::Tokenizer::from_file(root().join("models/smollm2-envace/tokenizer.json"))
        .unwrap();
    let prompt = std::fs::read_to_string(root().join("scripts/copy-probe.prompt"))
        .unwrap()
        .replace("{NOUN}", "tailor");
    let probe: Vec<u32> = tok.encode(prompt, false).unwrap().get_ids().to_vec();
    let (engine_prompt, response) = (&generation.prompt_ids, &generation.response_ids);
    assert!(probe.len() > engine_prompt.len());
    assert_eq!(&probe[..engine_prompt.len()], &engine_prompt[..]);
    let head = &probe[engine_prompt.len()..];
    assert_eq!(head, &response[..head.len()]);
    let decoded = tok.decode(head, false).unwrap();
    assert!(decoded.ends_with("\"payee\":"), "{decoded}");
}

/// The SmolLM2 GGUF reads text as llama.cpp does: no prefix space before a run of text after a
/// special token, digits split one by one. The ids are llama.cpp's own (`llama-server`'s
/// `/tokenize`, the build of scripts/fetch-llama-cpp, 2026-12-07). Until then candle's GGUF
/// tokenizer read `<|im_start|>system` as `<|im_start|>`, `Ġsystem` (817) and each
/// `<|im_end|>\n` as `<|im_end|>`, `ĠĊ` (3717).
#[test]
fn the_smollm2_gguf_tokenizes_as_llama_cpp_does() {
    use envace::runtime::model::TextSide;
    let side = TextSide::load(&smollm2()).unwrap();
    let cases: [(&str, &[u32]); 5] = [
        (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
            &[
                1, 9690, 198, 2683, 359, 253, 5356, 11173, 30, 2, 198, 1, 4093, 198, 1780, 314,
                260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
            ],
        ),
        (
            "Pay 147 to the tailor from account acc_1234, balance 1,250.75 on 2026-12-07.",
            &[
                25017, 216, 33, 36, 39, 288, 260, 22605, 429, 2051, 698, 79, 33, 34, 35, 36, 28,
                3630, 216, 33, 28, 34, 37, 32, 30, 39, 37, 335, 216, 34, 32, 34, 38, 29, 33, 34,
                29, 32, 39, 30,
            ],
        ),
        (
            "<tool_call>{\"name\": \"pay\", \"arguments\": {\"payee\": \"tailor\", \"amount\": 147}}</tool_call>",
            &[
                44, 19324, 79, 4350, 46, 39428, 1245, 1799, 476, 9480, 1002, 476, 24370, 1799,
                9583, 9480, 1992, 1799, 476, 14332, 270, 1002, 476, 18654, 1799, 216, 33, 36, 39,
                17859, 9617, 19324, 79, 4350, 46,
            ],
        ),
        (
            "  leading spaces\n\n\ttabs and CAPS, don't won't I'll 3.14159 x=42;",
            &[
                216, 2899, 5600, 1116, 197, 100, 7366, 284, 29146, 67, 28, 1326, 982, 3763, 982,
                339, 3060, 216, 35, 30, 33, 36, 33, 37, 41, 1792, 45, 36, 34, 43,
            ],
        ),
        (
            "h\u{e9}llo w\u{f6}rld \u{f1} \u{65e5}\u{672c}\u{8a9e} emoji \u{1f642} end",
            &[
                88, 2756, 31394, 267, 29989, 400, 5549, 126, 17097, 241, 115, 40993, 179, 120, 248,
                649, 33777, 47526, 1112,
            ],
        ),
    ];
    for (text, want) in cases {
        assert_eq!(side.tokenizer.encode(text).unwrap(), want, "{text:?}");
        let plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "");
        assert_eq!(
            side.tokenizer.decode(want).unwrap(),
            plain,
            "{text:?} round trip"
        );
    }
    // An adapter reads text as it was trained to, with the tokenizer saved beside it, not the
    // base's: the shipped adapter was trained on llama.cpp's splitting; the adapters before it on
    // candle's prefix spaces, which a copy of it with such a tokenizer must keep.
    let adapter = root().join("models/smollm2-envace");
    let shipped = TextSide::load(&adapter).unwrap();
    assert_eq!(
        shipped.tokenizer.encode("<|im_start|>system\n").unwrap(),
        [1, 9690, 198]
    );
    let dir = tempfile::tempdir().unwrap();
    let old = dir.path().join("prefix-space-adapter");
    std::fs::create_dir(&old).unwrap();
    for f in std::fs::read_dir(&adapter).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, old.join(f.file_name().unwrap())).unwrap();
    }
    let base = smollm2().display().to_string();
    for (file, key) in [
        ("adapter_config.json", "base_model_name_or_path"),
        ("envace_base.json", "base"),
    ] {
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(old.join(file)).unwrap()).unwrap();
        v[key] = serde_json::json!(base);
        std::fs::write(old.join(file), v.to_string()).unwrap();
    }
    let mut tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(old.join("tokenizer.json")).unwrap()).unwrap();
    tok["pre_tokenizer"] = serde_json::json!({"type": "ByteLevel", "add_prefix_space": true,
        "trim_offsets": true, "use_regex": true});
    std::fs::write(old.join("tokenizer.json"), tok.to_string()).unwrap();
    let own = TextSide::load(&old).unwrap();
    assert_eq!(
        own.tokenizer.encode("<|im_start|>system\n").unwrap(),
        [1, 817, 198]
    );
}

/// `envace merge` of the shipped SmolLM2 adapter, which sits on a GGUF base, with no `--model`
/// (the adapter names its base): a plain HF checkpoint whose weights are exactly what full
/// fine-tuning starts from (the fold of `load_folded`), with a config that loads as an HF
/// checkpoint, the adapter's own tokenizer files and prompt profile; `--dtype bf16` stores
/// bfloat16 weights and says so, within bf16's rounding of the f32 logits; a `.gguf` output keeps
/// the base's tensors as stored and quantizes the adapted projections.
#[test]
fn merging_the_shipped_adapter_into_its_gguf_base_writes_hf_and_gguf_checkpoints() {
    use envace::train::model::TrainableModel;
    let _ = smollm2();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let adapter = root.join("models/smollm2-envace");
    let tmp = tempfile::tempdir().unwrap();
    // `envace merge` of the shipped adapter into `out`: its status and stderr, and its report.
    let merge_run = |out: &Path, extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_envace"))
            .arg("merge")
            .arg("--adapter")
            .arg(&adapter)
            .arg("--out")
            .arg(out)
            .args(extra)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
            o.stdout,
        )
    };
    let merge = |out: &Path, extra: &[&str]| {
        let (ok, stderr, stdout) = merge_run(out, extra);
        assert!(ok, "{stderr}");
        serde_json::from_slice::<serde_json::Value>(&stdout).unwrap()
    };
    // A refused merge: its error, and nothing written at `out` or beside it.
    let refused = |out: &Path, extra: &[&str]| {
        let (ok, stderr, _) = merge_run(out, extra);
        assert!(
            !ok,
            "merge {extra:?} into {} was not refused",
            out.display()
        );
        assert!(!out.exists() && !out.with_extension("gguf.tmp").exists());
        stderr
    };
    let f32_dir = tmp.path().join("merged");
    let report = merge(&f32_dir, &[]);
    assert_eq!(report["merged_projections"], 30 * 7, "{report}");
    assert_eq!(report["dtype"], "float32", "{report}");
    assert!(
        report["base"].as_str().unwrap().ends_with(".gguf"),
        "{report}"
    );
    for f in ["tokenizer.json", "tokenizer_config.json", "envace.json"] {
        assert_eq!(
            std::fs::read(adapter.join(f)).unwrap(),
            std::fs::read(f32_dir.join(f)).unwrap(),
            "{f} is not the adapter's"
        );
    }
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(f32_dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["torch_dtype"], "float32");
    assert!(f32_dir.join("generation_config.json").is_file());
    // The weights are the fold full fine-tuning starts from, bit for bit.
    let folded = TrainableModel::load_folded(&adapter, &Device::Cpu).unwrap();
    let want = folded.weights();
    let got =
        candle_core::safetensors::load(f32_dir.join("model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(want.len(), got.len());
    for (name, w) in &want {
        let g = got.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(g.dtype(), DType::F32, "{name}");
        assert_eq!(max_abs_diff(w, g), 0.0, "{name}");
    }
    // It loads as a model (a plain HF checkpoint: no adapter, no GGUF) with the folded logits.
    let ids: Vec<u32> = vec![1, 9690, 198, 504, 3575, 282, 4649, 314, 30];
    let t = Tensor::from_vec(ids.clone(), (1, ids.len()), &Device::Cpu).unwrap();
    let run = |d: &envace::runtime::decoder::Decoder| {
        d.forward(&t, &mut d.new_cache(), Pass::Infer, LogitsAt::All)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let reference = run(&folded.decoder);
    let merged = LocalModel::load_on(&f32_dir, &Device::Cpu, None).unwrap();
    let d = max_abs_diff(&reference, &run(&merged.decoder));
    assert!(d < 1e-4, "merged f32 checkpoint: max abs logit diff {d}");
    // bf16: half the bytes, every float stored as bf16, the logits within its rounding.
    let bf16_dir = tmp.path().join("merged-bf16");
    assert_eq!(merge(&bf16_dir, &["--dtype", "bf16"])["dtype"], "bfloat16");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bf16_dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    let got =
        candle_core::safetensors::load(bf16_dir.join("model.safetensors"), &Device::Cpu).unwrap();
    assert!(got.values().all(|t| t.dtype() == DType::BF16));
    let merged = LocalModel::load_on(&bf16_dir, &Device::Cpu, None).unwrap();
    let half = run(&merged.decoder);
    let d = max_abs_diff(&reference, &half);
    // Measured 0.30 (logits of magnitude ~20; bf16 keeps 8 bits of mantissa).
    assert!(d < 0.75, "merged bf16 checkpoint: max abs logit diff {d}");
    let last_argmax = |l: &Tensor| {
        l.squeeze(0)
            .unwrap()
            .get(ids.len() - 1)
            .unwrap()
            .argmax(0)
            .unwrap()
            .to_scalar::<u32>()
            .unwrap()
    };
    assert_eq!(last_argmax(&reference), last_argmax(&half));
    // A .gguf output: the adapted projections as Q8_0 (the default), every other tensor the
    // base's bytes, the adapter's chat template; envace decodes it on its quantized path with
    // the merged logits within Q8_0's rounding.
    let gguf = tmp.path().join("merged.gguf");
    let report = merge(&gguf, &[]);
    assert_eq!(report["dtype"], "q8_0", "{report}");
    assert_eq!(report["merged_projections"], 30 * 7, "{report}");
    let read = |p: &Path| {
        let mut f = std::fs::File::open(p).unwrap();
        let ct = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
        (f, ct)
    };
    let (mut fb, base_ct) = read(&smollm2());
    let (mut fm, merged_ct) = read(&gguf);
    assert_eq!(base_ct.tensor_infos.len(), merged_ct.tensor_infos.len());
    let mut adapted = 0;
    for (name, info) in &merged_ct.tensor_infos {
        let b = base_ct.tensor(&mut fb, name, &Device::Cpu).unwrap();
        let m = merged_ct.tensor(&mut fm, name, &Device::Cpu).unwrap();
        assert_eq!(b.shape(), m.shape(), "{name}");
        let projection = [
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ]
        .iter()
        .any(|p| name.ends_with(&format!("{p}.weight")));
        if projection {
            adapted += 1;
            assert_eq!(
                info.ggml_dtype,
                candle_core::quantized::GgmlDType::Q8_0,
                "{name}"
            );
        } else {
            assert_eq!(b.dtype(), m.dtype(), "{name}");
            assert_eq!(
                b.data().unwrap(),
                m.data().unwrap(),
                "{name} was not copied as stored"
            );
        }
    }
    assert_eq!(adapted, 30 * 7);
    let template: serde_json::Value =
        serde_json::from_slice(&std::fs::read(adapter.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        merged_ct.metadata["tokenizer.chat_template"]
            .to_string()
            .unwrap(),
        template["chat_template"].as_str().unwrap()
    );
    let quantized = LocalModel::load_on(&gguf, &Device::Cpu, None).unwrap();
    let q = run(&quantized.decoder);
    let d = max_abs_diff(&reference, &q);
    // Q8_0 weights rounded from the fold, activations rounded to 8 bits on the tiles: measured
    // 1.61 on logits of magnitude ~20 (the shipped adapter on its Q4_1 base, decoded the same
    // way: 1.09).
    assert!(d < 2.0, "merged GGUF: max abs logit diff {d}");
    assert_eq!(last_argmax(&reference), last_argmax(&q));
    // SmolLM2's rows of 576 do not split into the k-quants' blocks of 256: a clear refusal.
    let e = refused(&tmp.path().join("k.gguf"), &["--dtype", "q4_k"]);
    assert!(e.contains("576") && e.contains("q8_0"), "{e}");
    // An HF directory cannot hold a GGUF quantization.
    let e = refused(&tmp.path().join("never"), &["--dtype", "q8_0"]);
    assert!(e.contains("q8_0") && e.contains(".gguf"), "{e}");
    // A dtype the flag does not know is refused before anything is written.
    let e = refused(&tmp.path().join("never"), &["--dtype", "int8"]);
    assert!(e.contains("int8"), "{e}");
}
