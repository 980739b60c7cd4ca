//! The model runtime against candle-transformers' stock models, on seeded tiny checkpoints of
//! every family, and on the real SmolLM2-135M-Instruct GGUF fetched by scripts/fetch-fixtures.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;
use common::{max_abs_diff, smollm2_gguf as smollm2};

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use envace::message::{Message, MessageToolCall, ToolCall};
use envace::runtime::config::{DecoderConfig, Family};
use envace::runtime::decoder::{LogitsAt, Pass};
use envace::runtime::fixture::{random_weights, tiny_config, write_tiny_checkpoint};
use envace::runtime::generate::{Prefix, generate_batch};
use envace::runtime::loader::{
    CheckpointFiles, GgufOptions, PrefillOn, build_dense, load_gguf_with, load_hf,
};
use envace::runtime::{CancelToken, FinishReason, LanguageModel, LocalModel, SamplingParams};
use serde_json::json;

const FAMILIES: [Family; 3] = [Family::Llama, Family::Qwen2, Family::Qwen3];

fn tiny(family: Family, seed: u64) -> (tempfile::TempDir, LocalModel) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_checkpoint(dir.path(), family, seed).unwrap();
    let m = LocalModel::load_on(dir.path(), &Device::Cpu, None).unwrap();
    (dir, m)
}

fn weights_as_vb(cfg: &DecoderConfig, seed: u64) -> (HashMap<String, Tensor>, VarBuilder<'static>) {
    let w = random_weights(cfg, seed, 0.15).unwrap();
    let vb = VarBuilder::from_tensors(w.clone(), DType::F32, &Device::Cpu);
    (w, vb)
}

/// Last-position logits of the stock candle-transformers model on the same weights.
fn stock_last_logits(cfg: &DecoderConfig, vb: VarBuilder, ids: &Tensor) -> Tensor {
    use candle_transformers::models::{llama, qwen2, qwen3};
    match cfg.family {
        Family::Qwen2 => {
            let c = qwen2::Config {
                vocab_size: cfg.vocab_size,
                hidden_size: cfg.hidden_size,
                intermediate_size: cfg.intermediate_size,
                num_hidden_layers: cfg.num_hidden_layers,
                num_attention_heads: cfg.num_attention_heads,
                num_key_value_heads: cfg.num_key_value_heads,
                max_position_embeddings: cfg.max_position_embeddings,
                sliding_window: cfg.max_position_embeddings,
                max_window_layers: cfg.num_hidden_layers,
                tie_word_embeddings: cfg.tie_word_embeddings,
                rope_theta: cfg.rope_theta,
                rms_norm_eps: cfg.rms_norm_eps,
                use_sliding_window: false,
                hidden_act: candle_nn::Activation::Silu,
            };
            let mut m = qwen2::ModelForCausalLM::new(&c, vb).unwrap();
            m.forward(ids, 0).unwrap().squeeze(1).unwrap()
        }
        Family::Qwen3 => {
            let c = qwen3::Config {
                vocab_size: cfg.vocab_size,
                hidden_size: cfg.hidden_size,
                intermediate_size: cfg.intermediate_size,
                num_hidden_layers: cfg.num_hidden_layers,
                num_attention_heads: cfg.num_attention_heads,
                head_dim: cfg.head_dim,
                attention_bias: false,
                num_key_value_heads: cfg.num_key_value_heads,
                max_position_embeddings: cfg.max_position_embeddings,
                sliding_window: None,
                max_window_layers: cfg.num_hidden_layers,
                tie_word_embeddings: cfg.tie_word_embeddings,
                rope_theta: cfg.rope_theta,
                rms_norm_eps: cfg.rms_norm_eps,
                use_sliding_window: false,
                hidden_act: candle_nn::Activation::Silu,
            };
            let mut m = qwen3::ModelForCausalLM::new(&c, vb).unwrap();
            m.forward(ids, 0).unwrap().squeeze(1).unwrap()
        }
        Family::Llama => {
            let c = llama::LlamaConfig {
                hidden_size: cfg.hidden_size,
                intermediate_size: cfg.intermediate_size,
                vocab_size: cfg.vocab_size,
                num_hidden_layers: cfg.num_hidden_layers,
                num_attention_heads: cfg.num_attention_heads,
                num_key_value_heads: Some(cfg.num_key_value_heads),
                rms_norm_eps: cfg.rms_norm_eps,
                rope_theta: cfg.rope_theta as f32,
                bos_token_id: None,
                eos_token_id: None,
                rope_scaling: None,
                max_position_embeddings: cfg.max_position_embeddings,
                tie_word_embeddings: Some(cfg.tie_word_embeddings),
            }
            .into_config(false);
            let mut cache = llama::Cache::new(false, DType::F32, &c, &Device::Cpu).unwrap();
            let m = llama::Llama::load(vb, &c).unwrap();
            m.forward(ids, 0, &mut cache).unwrap()
        }
    }
}

#[test]
fn decoder_matches_stock_models_in_both_passes() {
    for family in FAMILIES {
        let cfg = tiny_config(family);
        let (w, vb) = weights_as_vb(&cfg, 11);
        let tensors = w
            .into_iter()
            .map(|(k, v)| (k, (v, PathBuf::from("mem"))))
            .collect();
        let dec = build_dense(&cfg, tensors, DType::F32, &Device::Cpu, None).unwrap();
        for len in [1usize, 7, 23] {
            let ids: Vec<u32> = (0..len as u32).map(|i| (i * 37 + 5) % 256).collect();
            let t = Tensor::from_vec(ids.clone(), (1, len), &Device::Cpu).unwrap();
            let stock = stock_last_logits(&cfg, vb.clone(), &t);
            for pass in [Pass::Infer, Pass::Train] {
                let mut cache = dec.new_cache();
                let ours = dec.forward(&t, &mut cache, pass, LogitsAt::Last).unwrap();
                let d = max_abs_diff(&ours, &stock);
                assert!(d < 1e-4, "{family:?} len {len} {pass:?}: max abs diff {d}");
            }
        }
    }
}

#[test]
fn all_position_logits_match_incremental_last_logits() {
    for family in FAMILIES {
        let (_d, m) = tiny(family, 3);
        let ids: Vec<u32> = (0..12u32).map(|i| (i * 13 + 1) % 256).collect();
        let t = Tensor::from_vec(ids.clone(), (1, 12), &Device::Cpu).unwrap();
        let mut cache = m.decoder.new_cache();
        let all = m
            .decoder
            .forward(&t, &mut cache, Pass::Train, LogitsAt::All)
            .unwrap();
        let mut inc = m.decoder.new_cache();
        for (i, id) in ids.iter().enumerate() {
            let one = Tensor::from_vec(vec![*id], (1, 1), &Device::Cpu).unwrap();
            let last = m
                .decoder
                .forward(&one, &mut inc, Pass::Infer, LogitsAt::Last)
                .unwrap();
            let row = all.narrow(1, i, 1).unwrap().squeeze(1).unwrap();
            let d = max_abs_diff(&row, &last);
            assert!(d < 1e-4, "{family:?} pos {i}: {d}");
        }
    }
}

#[test]
fn training_pass_gradient_reaches_every_weight() {
    for family in FAMILIES {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_checkpoint(dir.path(), family, 5).unwrap();
        let files = CheckpointFiles::locate(dir.path()).unwrap();
        let vm = candle_nn::VarMap::new();
        let dec = load_hf(&files, DType::F32, &Device::Cpu, Some(&vm)).unwrap();
        let ids: Vec<u32> = (0..10u32).map(|i| (i * 7 + 3) % 256).collect();
        let inp = Tensor::from_vec(ids[..9].to_vec(), (1, 9), &Device::Cpu).unwrap();
        let tgt = Tensor::from_vec(ids[1..].to_vec(), 9, &Device::Cpu).unwrap();
        let mut cache = dec.new_cache();
        let logits = dec
            .forward(&inp, &mut cache, Pass::Train, LogitsAt::All)
            .unwrap();
        let logits = logits.squeeze(0).unwrap();
        let loss = candle_nn::loss::cross_entropy(&logits, &tgt).unwrap();
        let grads = loss.backward().unwrap();
        let vars = vm.data().lock().unwrap();
        assert!(vars.len() > 10);
        for (name, var) in vars.iter() {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{family:?}: no gradient for {name}"));
            let n = g
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(n > 0.0, "{family:?}: zero gradient for {name}");
        }
    }
}

fn greedy(max: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: max,
        ..Default::default()
    }
}

#[test]
fn greedy_decoding_is_deterministic_and_seeded_sampling_repeats() {
    let (_d, mut m) = tiny(Family::Qwen2, 9);
    let ids = m.encode("hello world").unwrap();
    let c = CancelToken::new();
    let a = m.generate(&ids, 1, &greedy(20), None, &c).unwrap();
    let b = m.generate(&ids, 1, &greedy(20), None, &c).unwrap();
    assert_eq!(a[0].response_ids, b[0].response_ids);
    let p = SamplingParams {
        temperature: 1.0,
        top_p: Some(0.95),
        seed: 42,
        max_tokens: 20,
        ..Default::default()
    };
    let x = m.generate(&ids, 1, &p, None, &c).unwrap();
    let y = m.generate(&ids, 1, &p, None, &c).unwrap();
    assert_eq!(x[0].response_ids, y[0].response_ids);
    assert_eq!(x[0].logprobs, y[0].logprobs);
    assert_eq!(x[0].prompt_ids, ids);
    assert_eq!(x[0].logprobs.len(), x[0].response_ids.len());
    assert!(x[0].logprobs.iter().all(|l| *l <= 0.0 && l.is_finite()));
}

#[test]
fn batched_ragged_prompts_equal_single_runs() {
    for family in FAMILIES {
        let (_d, m) = tiny(family, 21);
        let prompts: Vec<Vec<u32>> = ["a", "the quick brown fox", "tool call: {\"x\": 1}"]
            .iter()
            .map(|s| m.tokenizer.encode(s).unwrap())
            .collect();
        let c = CancelToken::new();
        let batched = generate_batch(m.context(), &prompts, &greedy(16), None, &c).unwrap();
        for (p, (g, _)) in prompts.iter().zip(&batched) {
            let mut single = Prefix::new(&m.decoder, p).unwrap();
            let s = single
                .generate(m.context(), 1, &greedy(16), None, &c)
                .unwrap();
            assert_eq!(
                s[0].0.response_ids, g.response_ids,
                "{family:?} prompt {p:?}"
            );
        }
    }
}

#[test]
fn branches_share_the_prefill_and_equal_independent_runs() {
    for family in FAMILIES {
        let (_d, m) = tiny(family, 4);
        let ids = m.tokenizer.encode("rehearse this call").unwrap();
        let c = CancelToken::new();
        let mut p = Prefix::new(&m.decoder, &ids).unwrap();
        let branches = p.generate(m.context(), 4, &greedy(12), None, &c).unwrap();
        let mut alone = Prefix::new(&m.decoder, &ids).unwrap();
        let one = alone
            .generate(m.context(), 1, &greedy(12), None, &c)
            .unwrap();
        for (g, _) in &branches {
            assert_eq!(g.response_ids, one[0].0.response_ids, "{family:?}");
        }
        // Sampled branches differ from each other (seeds seed+i).
        let s = SamplingParams {
            temperature: 1.5,
            max_tokens: 12,
            seed: 1,
            ..Default::default()
        };
        let sampled = p.generate(m.context(), 4, &s, None, &c).unwrap();
        let distinct: std::collections::HashSet<_> = sampled
            .iter()
            .map(|(g, _)| g.response_ids.clone())
            .collect();
        assert!(
            distinct.len() > 1,
            "{family:?}: sampled branches all identical"
        );
    }
}

#[test]
fn a_branch_can_be_continued_and_forked_again_from_any_position() {
    let (_d, m) = tiny(Family::Llama, 8);
    let c = CancelToken::new();
    let ids = m.tokenizer.encode("fork me").unwrap();
    let mut root = Prefix::new(&m.decoder, &ids).unwrap();
    let s = SamplingParams {
        temperature: 1.0,
        max_tokens: 10,
        seed: 3,
        ..Default::default()
    };
    let mut branches = root.generate(m.context(), 3, &s, None, &c).unwrap();
    let (_, mut branch) = branches.remove(1);
    let full = branch.ids().to_vec();
    // Continue the branch.
    let cont = branch
        .generate(m.context(), 2, &greedy(8), None, &c)
        .unwrap();
    let mut fresh = Prefix::new(&m.decoder, &full).unwrap();
    let want = fresh
        .generate(m.context(), 1, &greedy(8), None, &c)
        .unwrap();
    assert_eq!(cont[0].0.response_ids, want[0].0.response_ids);
    assert_eq!(cont[1].0.response_ids, want[0].0.response_ids);
    // Fork from an earlier position of the branch.
    let cut = ids.len() + 4;
    branch.truncate(&m.decoder, cut).unwrap();
    let forked = branch
        .generate(m.context(), 1, &greedy(8), None, &c)
        .unwrap();
    let mut fresh = Prefix::new(&m.decoder, &full[..cut]).unwrap();
    let want = fresh
        .generate(m.context(), 1, &greedy(8), None, &c)
        .unwrap();
    assert_eq!(forked[0].0.response_ids, want[0].0.response_ids);
}

#[test]
fn stop_strings_max_tokens_streaming_and_cancellation() {
    let (_d, mut m) = tiny(Family::Qwen3, 2);
    let ids = m.encode("x").unwrap();
    let c = CancelToken::new();
    let g = m.generate(&ids, 1, &greedy(7), None, &c).unwrap();
    if g[0].finish == FinishReason::Length {
        assert_eq!(g[0].response_ids.len(), 7);
    }
    // Streaming: the chunks concatenate to the final text.
    let mut chunks = String::new();
    let mut sink = |_b: usize, s: &str| chunks.push_str(s);
    let g = m
        .generate(&ids, 1, &greedy(30), Some(&mut sink), &c)
        .unwrap();
    assert_eq!(chunks, g[0].text);
    // A stop string taken from the greedy text ends generation right after it.
    let text = g[0].text.clone();
    if let Some(stop) = text.get(2..4).filter(|s| !s.trim().is_empty()) {
        let p = SamplingParams {
            max_tokens: 30,
            stop: vec![stop.to_string()],
            ..Default::default()
        };
        let s = m.generate(&ids, 1, &p, None, &c).unwrap();
        assert_eq!(s[0].finish, FinishReason::Stop(stop.to_string()));
        assert!(s[0].text.ends_with(stop));
    }
    let cancel = CancelToken::new();
    cancel.cancel();
    let g = m.generate(&ids, 2, &greedy(30), None, &cancel).unwrap();
    assert!(
        g.iter()
            .all(|g| g.finish == FinishReason::Cancelled && g.response_ids.is_empty())
    );
}

#[test]
fn chat_template_renders_tools_and_tool_calls_like_hf() {
    let (_d, m) = tiny(Family::Qwen2, 1);
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_balance", "description": "Balance <of> an account & more", "parameters": {"type": "object", "properties": {"account": {"type": "string"}}, "required": ["account"]}}}),
    ];
    let mut asst = Message::assistant("");
    asst.tool_calls.push(MessageToolCall {
        id: "c1".into(),
        kind: "function".into(),
        function: ToolCall {
            name: "get_balance".into(),
            arguments: json!({"account": "acc_1"}),
        },
    });
    let msgs = vec![
        Message::system("You are a bank agent."),
        Message::user("What is my balance?"),
        asst,
        Message::tool("c1", "get_balance", "{\"balance\": 40}"),
    ];
    let out = m.render_chat(&msgs, &tools, true, false).unwrap();
    assert!(out.starts_with("<|im_start|>system\nYou are a bank agent.\n\n# Tools"));
    // HF tojson: no HTML escaping, insertion order, python separators.
    assert!(out.contains(r#"{"type": "function", "function": {"name": "get_balance", "description": "Balance <of> an account & more""#));
    assert!(out.contains("<tool_call>\n{\"name\": \"get_balance\", \"arguments\": {\"account\": \"acc_1\"}}\n</tool_call><|im_end|>"));
    assert!(out.contains(
        "<|im_start|>user\n<tool_response>\n{\"balance\": 40}\n</tool_response><|im_end|>\n"
    ));
    assert!(out.ends_with("<|im_start|>assistant\n"));
}

/// The Q4_1 135M model is weak: asked "What is the capital of France?" it answers
/// "L'Étoile, la Marseillaise, …" greedily, as llama.cpp's llama-server does on the same ids
/// (it answered Paris only while candle's tokenizer put prefix spaces in the prompt). With
/// "Answer in one word." both answer "The capital of France is Paris." (llama.cpp's first
/// token by 1.5 nats over the next).
#[test]
fn smollm2_gguf_answers_paris_and_its_template_renders() {
    let mut m = LocalModel::load_on(&smollm2(), &Device::Cpu, None).unwrap();
    let question = "What is the capital of France? Answer in one word.";
    let prompt = m
        .render_chat(&[Message::user(question)], &[], true, false)
        .unwrap();
    assert!(
        prompt.contains(&format!("<|im_start|>user\n{question}<|im_end|>")),
        "{prompt}"
    );
    assert!(prompt.ends_with("<|im_start|>assistant\n"));
    let ids = m.encode(&prompt).unwrap();
    let g = m
        .generate(&ids, 1, &greedy(24), None, &CancelToken::new())
        .unwrap();
    assert!(g[0].text.contains("Paris"), "{}", g[0].text);
    assert_eq!(g[0].finish, FinishReason::Eos);
}

#[test]
fn smollm2_decoder_matches_stock_quantized_llama() {
    use candle_transformers::models::quantized_llama::ModelWeights;
    let path = smollm2();
    let (dec, _) = load_gguf_with(
        &path,
        &Device::Cpu,
        GgufOptions {
            requantize: false,
            prefill: PrefillOn::Tiles,
            tiles: false,
        },
    )
    .unwrap();
    let mut f = std::fs::File::open(&path).unwrap();
    let ct = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    let mut stock = ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap();
    let ids: Vec<u32> = vec![1, 504, 3575, 282, 4649, 314, 30];
    let t = Tensor::from_vec(ids.clone(), (1, ids.len()), &Device::Cpu).unwrap();
    let want = stock.forward(&t, 0).unwrap();
    let mut cache = dec.new_cache();
    let got = dec
        .forward(&t, &mut cache, Pass::Infer, LogitsAt::Last)
        .unwrap();
    // Both run candle's Q4_1 x Q8_1 kernels, which round every projection's input to 8 bits:
    // where the two implementations' f32 ops (attention, norms) differ in the last bit, a
    // rounding flips and moves logits by tenths. On an AVX2 host they agreed to < 1e-2; on an
    // AVX-512 host (presumably gemm's x86-v4 f32 kernels in the stock attention) max 0.55, mean
    // 0.15, the same order as either path's distance from an f32 reference (tests/infer.rs).
    // A wrong architecture (RoPE layout, norm, bias, GQA) moves them by whole logits and
    // reorders the top tokens.
    let d = max_abs_diff(&got, &want);
    let mean = (&got - &want)
        .unwrap()
        .abs()
        .unwrap()
        .mean_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let top = |t: &Tensor, k: usize| {
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
        idx.truncate(k);
        idx
    };
    let (tg, tw) = (top(&got, 10), top(&want, 10));
    let shared = tg.iter().filter(|i| tw.contains(i)).count();
    assert!(
        d < 1.5 && mean < 0.3 && tg[0] == tw[0] && shared >= 8,
        "max abs diff {d}, mean {mean}, top-10 {tg:?} vs {tw:?}"
    );
    // The fast path (as this CPU loads it: tiles or f32 copies for prefill) keeps the same top
    // token.
    let (fast, _) = load_gguf_with(&path, &Device::Cpu, GgufOptions::default()).unwrap();
    let mut cache = fast.new_cache();
    let f = fast
        .forward(&t, &mut cache, Pass::Infer, LogitsAt::Last)
        .unwrap();
    assert_eq!(
        f.argmax(1).unwrap().to_vec1::<u32>().unwrap(),
        want.argmax(1).unwrap().to_vec1::<u32>().unwrap()
    );
}

#[test]
fn compact_template_lists_tools_by_name_and_renders_calls_on_one_line() {
    use envace::runtime::chat_template::{COMPACT_TOOLS_TEMPLATE, ChatTemplate};
    let t = ChatTemplate::new(COMPACT_TOOLS_TEMPLATE, "", "<|im_end|>").unwrap();
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_balance", "description": "d", "parameters": {"type": "object", "properties": {"acc": {"type": "string"}}}}}),
        json!({"type": "function", "function": {"name": "transfer", "description": "d", "parameters": {"type": "object", "properties": {"src": {}, "dst": {}, "amount": {}}}}}),
    ];
    let mut asst = Message::assistant("");
    asst.tool_calls.push(MessageToolCall {
        id: "c1".into(),
        kind: "function".into(),
        function: ToolCall {
            name: "get_balance".into(),
            arguments: json!({"acc": "acc_1"}),
        },
    });
    let msgs = vec![
        Message::system("Bank agent."),
        Message::user("Balance of acc_1?"),
        asst,
        Message::tool("c1", "get_balance", "{\"balance\": 40}"),
    ];
    let out = t.render(&msgs, &tools, true, false).unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nBank agent.\ntools: get_balance(acc) transfer(src,dst,amount)<|im_end|>\n<|im_start|>user\nBalance of acc_1?<|im_end|>\n<|im_start|>assistant\n<tool_call>{\"name\": \"get_balance\", \"arguments\": {\"acc\": \"acc_1\"}}</tool_call><|im_end|>\n<|im_start|>tool\n{\"balance\": 40}<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn prefix_reuse_across_calls_equals_fresh_generation() {
    // A conversation grows and branches off earlier points: the cached prefixes are truncated,
    // extended and forked; every answer must equal a fresh prefill of the same prompt.
    let (_d, mut m) = tiny(Family::Llama, 12);
    let c = CancelToken::new();
    let prompts = [
        "system: bank. user: pay 40",
        "system: bank. user: pay 40 now",
        "system: bank. user: refund",
        "system: bank. user: pay 40 now please",
    ];
    for p in prompts {
        let ids = m.encode(p).unwrap();
        let got = m.generate(&ids, 2, &greedy(10), None, &c).unwrap();
        let mut fresh = Prefix::new(&m.decoder, &ids).unwrap();
        let want = fresh
            .generate(m.context(), 1, &greedy(10), None, &c)
            .unwrap();
        assert_eq!(got[0].response_ids, want[0].0.response_ids, "{p}");
        assert_eq!(got[1].response_ids, want[0].0.response_ids, "{p}");
    }
}

/// Top-`k` token ids of a logits row, best first.
fn top_ids(t: &Tensor, k: usize) -> Vec<usize> {
    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
    idx.truncate(k);
    idx
}

#[test]
fn smollm2_gguf_dequantized_for_training_matches_the_inference_path() {
    use envace::runtime::loader::{load_gguf_dense, permute_rope_rows};
    use envace::train::model::TrainableModel;
    let path = smollm2();
    // The trainable form: every weight dequantized to f32, q/k rows back in HF order, RoPE in
    // HF's half layout, weights as Vars.
    let train = TrainableModel::load(&path, &Device::Cpu).unwrap();
    assert!(!train.decoder.cfg.rope_interleaved);
    assert!(train.decoder.cfg.tie_word_embeddings);
    assert_eq!(
        train.trainable_parameters(),
        train.decoder.cfg.parameter_count()
    );
    // The inference form as `envace run` loads it (quantized, the file's permuted q/k with
    // interleaved RoPE), with f32 prefill copies: the tiles, which prefill with them on
    // AVX-512 CPUs, round every activation to 8 bits (logits then move by up to ~1), and this test is
    // about the weights' layout.
    let gemm = GgufOptions {
        prefill: PrefillOn::Gemm,
        ..GgufOptions::default()
    };
    let (fast, _) = load_gguf_with(&path, &Device::Cpu, gemm).unwrap();
    // Both forms describe the same (tied) model: 134.5M parameters, the head not counted twice.
    assert!(fast.cfg.tie_word_embeddings);
    assert_eq!(
        fast.cfg.parameter_count(),
        train.decoder.cfg.parameter_count()
    );
    let ids: Vec<u32> = vec![
        1, 9690, 198, 504, 3575, 282, 4649, 314, 30, 2, 198, 1, 520, 9531,
    ];
    let t = Tensor::from_vec(ids.clone(), (1, ids.len()), &Device::Cpu).unwrap();
    let mut cache = fast.new_cache();
    let want = fast
        .forward(&t, &mut cache, Pass::Infer, LogitsAt::All)
        .unwrap()
        .squeeze(0)
        .unwrap();
    // Training pass (hand-written backward path) over the whole sequence: (1, T, V).
    let got = train.decoder.forward_train(&t).unwrap().squeeze(0).unwrap();
    let d = max_abs_diff(&got, &want);
    // Same f32 weights, other summation orders and RoPE layout: differences stay at f32
    // rounding of logits of magnitude ~20 (a wrong permutation moves them by whole logits).
    assert!(d < 2e-3, "max abs logit diff {d}");
    for pos in 0..ids.len() {
        let (g, w) = (got.get(pos).unwrap(), want.get(pos).unwrap());
        assert_eq!(top_ids(&g, 5), top_ids(&w, 5), "position {pos}");
    }
    // The same dense decoder frozen (LoRA base) is the same function.
    let (frozen, _) = load_gguf_dense(&path, DType::F32, &Device::Cpu, None).unwrap();
    let mut c2 = frozen.new_cache();
    let f = frozen
        .forward(&t, &mut c2, Pass::Infer, LogitsAt::All)
        .unwrap()
        .squeeze(0)
        .unwrap();
    assert!(max_abs_diff(&f, &want) < 2e-3);
    // Permutation round trip.
    let x = Tensor::arange(0f32, 576.0 * 3.0, &Device::Cpu)
        .unwrap()
        .reshape((576, 3))
        .unwrap();
    let back = permute_rope_rows(&permute_rope_rows(&x, 9, false).unwrap(), 9, true).unwrap();
    assert_eq!(max_abs_diff(&back, &x), 0.0);
}

#[test]
fn an_hf_layout_adapter_on_the_smollm2_gguf_equals_it_on_the_dequantized_model() {
    use envace::runtime::loader::{AdapterConfig, attach_adapter, load_gguf_dense, peft_names};
    let path = smollm2();
    let (mut dense, _) = load_gguf_dense(&path, DType::F32, &Device::Cpu, None).unwrap();
    // f32 prefill copies (the tiles round activations to 8 bits; this test is about the
    // adapter's rows).
    let gemm = GgufOptions {
        prefill: PrefillOn::Gemm,
        ..GgufOptions::default()
    };
    let (mut quant, _) = load_gguf_with(&path, &Device::Cpu, gemm).unwrap();
    // A random adapter on q and k of every layer (the projections whose rows GGUF permutes),
    // large enough to move the logits by whole units.
    let cfg = AdapterConfig {
        r: 4,
        lora_alpha: 8.0,
        target_modules: vec!["q_proj".into(), "k_proj".into()],
        base_model_name_or_path: None,
        base_sha256: None,
    };
    let mut tensors = HashMap::new();
    for (name, lin) in dense.named_linears() {
        let module = name.rsplit('.').next().unwrap();
        if module != "q_proj" && module != "k_proj" {
            continue;
        }
        let (out, inp) = lin.dims().unwrap();
        let (a, b) = peft_names(&name);
        tensors.insert(
            a,
            Tensor::randn(0f32, 0.05, (4, inp), &Device::Cpu).unwrap(),
        );
        tensors.insert(
            b,
            Tensor::randn(0f32, 0.05, (out, 4), &Device::Cpu).unwrap(),
        );
    }
    let src = Path::new("adapter");
    attach_adapter(&mut dense, &cfg, &tensors, src, true).unwrap();
    attach_adapter(&mut quant, &cfg, &tensors, src, false).unwrap();
    let ids: Vec<u32> = vec![1, 9690, 198, 504, 3575, 282, 4649, 314, 30];
    let t = Tensor::from_vec(ids.clone(), (1, ids.len()), &Device::Cpu).unwrap();
    let (mut c1, mut c2) = (dense.new_cache(), quant.new_cache());
    let a = dense
        .forward(&t, &mut c1, Pass::Infer, LogitsAt::All)
        .unwrap();
    let b = quant
        .forward(&t, &mut c2, Pass::Infer, LogitsAt::All)
        .unwrap();
    let d = max_abs_diff(&a, &b);
    assert!(d < 5e-3, "max abs logit diff {d}");
    // Without the permutation the adapter's q/k rows would land on other heads' rotary pairs.
    let (plain, _) = load_gguf_dense(&path, DType::F32, &Device::Cpu, None).unwrap();
    let mut c3 = plain.new_cache();
    let base = plain
        .forward(&t, &mut c3, Pass::Infer, LogitsAt::All)
        .unwrap();
    assert!(
        max_abs_diff(&a, &base) > 0.1,
        "the adapter must change the logits"
    );
}

/// `pretrain --full` from the shipped SmolLM2 adapter: the adapter folded into the dequantized
/// GGUF base (q/k rows in HF order) gives the logits of the trainer's unmerged LoRA model.
#[test]
fn the_shipped_adapter_folded_for_full_fine_tuning_equals_it_unmerged() {
    use envace::train::model::TrainableModel;
    let _ = smollm2();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/smollm2-envace");
    let lora = TrainableModel::load_adapter(&dir, &Device::Cpu).unwrap();
    let full = TrainableModel::load_folded(&dir, &Device::Cpu).unwrap();
    assert!(lora.lora.is_some() && full.lora.is_none());
    assert!(full.trainable_parameters() > 100_000_000);
    let ids: Vec<u32> = vec![1, 9690, 198, 504, 3575, 282, 4649, 314, 30];
    let t = Tensor::from_vec(ids.clone(), (1, ids.len()), &Device::Cpu).unwrap();
    let run = |m: &TrainableModel| {
        m.decoder
            .forward(&t, &mut m.decoder.new_cache(), Pass::Infer, LogitsAt::All)
            .unwrap()
    };
    let d = max_abs_diff(&run(&lora), &run(&full));
    assert!(d < 2e-3, "max abs logit diff {d}");
}

#[test]
fn a_chat_template_jinja_file_beside_the_config_is_the_models_template() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_checkpoint(dir.path(), Family::Qwen2, 3).unwrap();
    let src = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/templates/smollm2-135m-instruct/chat_template.jinja"),
    )
    .unwrap();
    std::fs::write(dir.path().join("chat_template.jinja"), &src).unwrap();
    let m = LocalModel::load_on(dir.path(), &Device::Cpu, None).unwrap();
    assert_eq!(m.template.source, src);
    let p = m
        .render_chat(&[Message::user("hi")], &[], true, false)
        .unwrap();
    assert!(p.contains("named SmolLM"), "{p}");
    // A broken one is an error naming that file.
    std::fs::write(dir.path().join("chat_template.jinja"), "{% if %}").unwrap();
    let e = LocalModel::load_on(dir.path(), &Device::Cpu, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("chat_template.jinja"), "{e}");
}

/// `GgufOptions::prefill` picks what multiplies a prompt's rows: the f32 copies and the tiles
/// give different logits (the tiles round activations to 8 bits), close enough to agree on the
/// top tokens, and `Auto` is exactly one of the two, the one `prefill_beats_gemm_here` names.
#[test]
fn prefill_option_picks_the_f32_copy_or_the_tiles() {
    use envace::runtime::quant_tiles::prefill_beats_gemm_here;
    let path = smollm2();
    let logits = |prefill| {
        let opts = GgufOptions {
            prefill,
            ..GgufOptions::default()
        };
        let (dec, _) = load_gguf_with(&path, &Device::Cpu, opts).unwrap();
        // 40 tokens: more rows than a decode step, so the prefill path runs.
        let ids: Vec<u32> = (0..40u32).map(|i| 200 + i * 131).collect();
        let t = Tensor::from_vec(ids, (1, 40), &Device::Cpu).unwrap();
        let mut cache = dec.new_cache();
        dec.forward(&t, &mut cache, Pass::Infer, LogitsAt::All)
            .unwrap()
            .squeeze(0)
            .unwrap()
    };
    let (gemm, tiles, auto) = (
        logits(PrefillOn::Gemm),
        logits(PrefillOn::Tiles),
        logits(PrefillOn::Auto),
    );
    let d = max_abs_diff(&gemm, &tiles);
    assert!(
        d > 0.0 && d < 3.0,
        "f32 copy vs tiles: max abs logit diff {d}"
    );
    let last = |t: &Tensor| top_ids(&t.get(39).unwrap(), 1);
    assert_eq!(last(&gemm), last(&tiles));
    let want = if prefill_beats_gemm_here() {
        &tiles
    } else {
        &gemm
    };
    assert_eq!(max_abs_diff(&auto, want), 0.0, "auto is neither path");
}
