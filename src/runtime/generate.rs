//! Generation on the decoder: a prompt is prefilled once into a [`Prefix`]; any number of
//! branches decode from it in one batch (the prefix's KV cache is forked, not recomputed);
//! every branch comes back as a continuable [`Prefix`] too, so it can be extended or forked
//! again from any of its positions. Ragged prompts batch with left padding.

use candle_core::{Device, Tensor};

use super::backend::{
    CancelToken, FinishReason, Generation, RuntimeError, SamplingParams, StreamSink,
};
use super::decoder::{Decoder, LogitsAt, Pass};
use super::kv_cache::KvCache;
use super::sampler::Sampler;
use super::tokenizer::{IncrementalDecoder, Tokenizer};
use super::tool_guard::ToolNameGuard;

/// What generation needs besides the weights.
#[derive(Debug, Clone, Copy)]
pub struct GenContext<'a> {
    pub decoder: &'a Decoder,
    pub tokenizer: &'a Tokenizer,
    pub eos: &'a [u32],
}

/// A token sequence with its KV cache. Tokens past the cache's length are pending: they are fed
/// on the next call that needs logits.
#[derive(Debug, Clone)]
pub struct Prefix {
    ids: Vec<u32>,
    cache: KvCache,
    last_logits: Option<Vec<f32>>,
}

fn ids_tensor(ids: &[u32], rows: usize, device: &Device) -> candle_core::Result<Tensor> {
    let cols = ids.len() / rows.max(1);
    Tensor::from_vec(ids.to_vec(), (rows, cols), device)
}

impl Prefix {
    /// An empty prefix (nothing cached yet).
    pub fn empty(decoder: &Decoder) -> Self {
        Self {
            ids: Vec::new(),
            cache: decoder.new_cache(),
            last_logits: None,
        }
    }

    /// Prefill `ids`.
    pub fn new(decoder: &Decoder, ids: &[u32]) -> Result<Self, RuntimeError> {
        let mut p = Self::empty(decoder);
        p.extend(decoder, ids)?;
        Ok(p)
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Append tokens and feed them (one forward for all of them).
    pub fn extend(&mut self, decoder: &Decoder, ids: &[u32]) -> Result<(), RuntimeError> {
        self.ids.extend_from_slice(ids);
        self.last_logits = None;
        self.ready(decoder)
    }

    /// Keep the first `len` tokens (len ≥ 1); the cache is cut, not recomputed.
    pub fn truncate(&mut self, decoder: &Decoder, len: usize) -> Result<(), RuntimeError> {
        if len == 0 {
            return Err(RuntimeError::Generation(
                "cannot truncate a prefix to zero tokens".into(),
            ));
        }
        if len >= self.ids.len() {
            return Ok(());
        }
        self.ids.truncate(len);
        self.cache.truncate(len - 1)?;
        self.last_logits = None;
        self.ready(decoder)
    }

    /// Feed pending tokens so that `last_logits` holds the next-token distribution.
    fn ready(&mut self, decoder: &Decoder) -> Result<(), RuntimeError> {
        let cached = self.cache.seq_len();
        if self.ids.is_empty() {
            return Err(RuntimeError::Generation("empty prompt".into()));
        }
        if cached < self.ids.len() {
            let pending = &self.ids[cached..];
            let t = ids_tensor(pending, 1, &decoder.device)?;
            let logits = decoder.forward(&t, &mut self.cache, Pass::Infer, LogitsAt::Last)?;
            self.last_logits = Some(logits.squeeze(0)?.to_vec1::<f32>()?);
        } else if self.last_logits.is_none() {
            // Everything cached but no logits (after truncate to the cache length): re-feed the
            // last token.
            let n = self.ids.len();
            self.cache.truncate(n - 1)?;
            return self.ready(decoder);
        }
        Ok(())
    }

    /// Decode `n` branches from this prefix. Returns each branch's generation and its
    /// continuable prefix (prompt + response).
    pub fn generate(
        &mut self,
        ctx: GenContext<'_>,
        n: usize,
        params: &SamplingParams,
        stream: Option<StreamSink<'_>>,
        cancel: &CancelToken,
    ) -> Result<Vec<(Generation, Prefix)>, RuntimeError> {
        self.ready(ctx.decoder)?;
        let logits = self
            .last_logits
            .clone()
            .ok_or_else(|| RuntimeError::Generation("prefix has no logits".into()))?;
        let n = n.max(1);
        let cache = self.cache.fork(0, n, &ctx.decoder.device)?;
        let rows = (0..n)
            .map(|i| Row::new(self.ids.clone(), params, params.seed.wrapping_add(i as u64)))
            .collect();
        decode_loop(ctx, cache, vec![logits; n], rows, params, stream, cancel)
    }
}

/// One sequence being decoded.
struct Row {
    prompt: Vec<u32>,
    response: Vec<u32>,
    logprobs: Vec<f32>,
    sampler: Sampler,
    text: String,
    emitted: usize,
    /// Decodes the response a window at a time (linear in its length).
    detok: IncrementalDecoder,
    finish: Option<FinishReason>,
    /// Cache of this row at the moment it finished (without its last sampled token).
    cache: Option<KvCache>,
}

impl Row {
    fn new(prompt: Vec<u32>, params: &SamplingParams, seed: u64) -> Self {
        Self {
            prompt,
            response: Vec::new(),
            logprobs: Vec::new(),
            sampler: Sampler::new(params, seed),
            text: String::new(),
            emitted: 0,
            detok: IncrementalDecoder::default(),
            finish: None,
            cache: None,
        }
    }
}

/// Generate for ragged prompts in one left-padded batch (each row seeded `seed + i`).
pub fn generate_batch(
    ctx: GenContext<'_>,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    stream: Option<StreamSink<'_>>,
    cancel: &CancelToken,
) -> Result<Vec<(Generation, Prefix)>, RuntimeError> {
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    if prompts.iter().any(Vec::is_empty) {
        return Err(RuntimeError::Generation("empty prompt in batch".into()));
    }
    let dec = ctx.decoder;
    let max_len = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let pad: Vec<usize> = prompts.iter().map(|p| max_len - p.len()).collect();
    let mut flat = Vec::with_capacity(prompts.len() * max_len);
    for p in prompts {
        flat.extend(std::iter::repeat_n(0u32, max_len - p.len()));
        flat.extend_from_slice(p);
    }
    let mut cache = KvCache::with_padding(dec.layers.len(), pad);
    let t = ids_tensor(&flat, prompts.len(), &dec.device)?;
    let logits = dec.forward(&t, &mut cache, Pass::Infer, LogitsAt::Last)?;
    let logits = logits.to_vec2::<f32>()?;
    let rows = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Row::new(p.clone(), params, params.seed.wrapping_add(i as u64)))
        .collect();
    decode_loop(ctx, cache, logits, rows, params, stream, cancel)
}

/// Each unfinished active row's next token and its logprob (`None` for finished rows), the rows
/// sampled in parallel: a 50k-entry softmax per row is most of a many-branch step's serial time.
/// Every row draws from its own seeded sampler, so the result does not depend on the threads.
fn sample_rows(rows: &mut [Row], active: &[usize], logits: &[Vec<f32>]) -> Vec<Option<(u32, f32)>> {
    use rayon::prelude::*;
    let mut slots: Vec<Option<&mut Row>> = rows.iter_mut().map(Some).collect();
    let mut batch: Vec<(usize, &mut Row)> = Vec::with_capacity(active.len());
    for (j, &r) in active.iter().enumerate() {
        if let Some(row) = slots.get_mut(r).and_then(Option::take)
            && row.finish.is_none()
        {
            batch.push((j, row));
        }
    }
    let sampled: Vec<(usize, (u32, f32))> = if batch.len() > 1 {
        batch
            .into_par_iter()
            .map(|(j, row)| (j, row.sampler.sample(&logits[j])))
            .collect()
    } else {
        batch
            .into_iter()
            .map(|(j, row)| (j, row.sampler.sample(&logits[j])))
            .collect()
    };
    let mut picks = vec![None; active.len()];
    for (j, pick) in sampled {
        picks[j] = Some(pick);
    }
    picks
}

/// Decode all rows in lockstep; finished rows leave the batch.
fn decode_loop(
    ctx: GenContext<'_>,
    mut cache: KvCache,
    mut logits: Vec<Vec<f32>>,
    mut rows: Vec<Row>,
    params: &SamplingParams,
    mut stream: Option<StreamSink<'_>>,
    cancel: &CancelToken,
) -> Result<Vec<(Generation, Prefix)>, RuntimeError> {
    let dec = ctx.decoder;
    let max_stop = params.stop.iter().map(String::len).max().unwrap_or(0);
    // `active[j]` = index into `rows` of batch row j.
    let mut active: Vec<usize> = (0..rows.len()).collect();
    let mut last_tokens: Vec<u32> = Vec::new();
    let guard = (!params.tool_names.is_empty())
        .then(|| ToolNameGuard::new(&params.tool_names, ctx.tokenizer.pieces()));
    while !active.is_empty() {
        if params.max_tokens == 0 {
            for &r in &active {
                rows[r].finish = Some(FinishReason::Length);
            }
        }
        last_tokens.clear();
        if cancel.is_cancelled() {
            for &r in &active {
                rows[r].finish.get_or_insert(FinishReason::Cancelled);
            }
        }
        if let Some(g) = &guard {
            for (j, &r) in active.iter().enumerate() {
                if rows[r].finish.is_none() {
                    g.mask(&rows[r].text, &mut logits[j]);
                }
            }
        }
        let picks = sample_rows(&mut rows, &active, &logits);
        for (j, &r) in active.iter().enumerate() {
            let row = &mut rows[r];
            let Some((tok, lp)) = picks[j] else {
                continue;
            };
            row.response.push(tok);
            row.logprobs.push(lp);
            last_tokens.push(tok);
            if ctx.eos.contains(&tok) {
                row.finish = Some(FinishReason::Eos);
                continue;
            }
            // Only new, complete text can end a stop string or be streamed.
            if !row.detok.push(ctx.tokenizer, &row.response)?.is_empty() {
                let mut full = row.detok.text().to_string();
                let from = row.text.len().saturating_sub(max_stop);
                let from = (0..=from)
                    .rev()
                    .find(|&i| full.is_char_boundary(i))
                    .unwrap_or(0);
                let hit = params
                    .stop
                    .iter()
                    .filter(|s| !s.is_empty())
                    .filter_map(|s| {
                        full[from..]
                            .find(s.as_str())
                            .map(|p| (from + p + s.len(), s))
                    })
                    .min_by_key(|(end, _)| *end);
                if let Some((end, s)) = hit {
                    full.truncate(end);
                    row.finish = Some(FinishReason::Stop(s.clone()));
                }
                if let Some(sink) = stream.as_mut()
                    && full.len() > row.emitted
                    && full.is_char_boundary(row.emitted)
                {
                    sink(r, &full[row.emitted..]);
                }
                row.emitted = full.len();
                row.text = full;
            }
            if row.finish.is_none() && row.response.len() >= params.max_tokens {
                row.finish = Some(FinishReason::Length);
            }
        }
        // Rows that finished this step keep a copy of their cache for continuation.
        let keep: Vec<usize> = (0..active.len())
            .filter(|&j| rows[active[j]].finish.is_none())
            .collect();
        for (j, &r) in active.iter().enumerate() {
            if rows[r].finish.is_some() && rows[r].cache.is_none() {
                rows[r].cache = Some(cache.select_rows(&[j], &dec.device)?);
            }
        }
        if keep.is_empty() {
            break;
        }
        if keep.len() != active.len() {
            cache = cache.select_rows(&keep, &dec.device)?;
        }
        let next: Vec<u32> = keep
            .iter()
            .map(|&j| rows[active[j]].response.last().copied().unwrap_or(0))
            .collect();
        active = keep.iter().map(|&j| active[j]).collect();
        let t = ids_tensor(&next, next.len(), &dec.device)?;
        let out = dec.forward(&t, &mut cache, Pass::Infer, LogitsAt::Last)?;
        logits = out.to_vec2::<f32>()?;
    }
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let mut ids = row.prompt.clone();
        ids.extend_from_slice(&row.response);
        let cache = match row.cache {
            Some(c) => c,
            None => KvCache::new(dec.layers.len()),
        };
        let mut cache = cache;
        // Left padding (batched prompts) is dropped from a continuable prefix by recomputing.
        let padded = cache.seq_len() + 1 != ids.len() && !row.response.is_empty();
        if padded {
            cache = KvCache::new(dec.layers.len());
        }
        let generation = Generation {
            prompt_ids: row.prompt,
            response_ids: row.response,
            logprobs: row.logprobs,
            text: row.text,
            finish: row.finish.unwrap_or(FinishReason::Length),
        };
        out.push((
            generation,
            Prefix {
                ids,
                cache,
                last_logits: None,
            },
        ));
    }
    Ok(out)
}
