//! An explicit, batched, forkable KV cache. Rows are sequences; all rows share one length
//! (left padding, recorded per row, keeps ragged prompts aligned). Forking a prefix into K
//! rehearsal branches copies the cache rows instead of recomputing the prefill.

use candle_core::{Device, Tensor};

type Result<T> = candle_core::Result<T>;

/// Per-layer keys and values, each (batch, kv_heads, seq, head_dim).
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    seq_len: usize,
    /// Left padding per row (masked keys).
    pad: Vec<usize>,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            seq_len: 0,
            pad: Vec::new(),
        }
    }

    /// A cache for a left-padded batch: row `r` starts with `pad[r]` padding tokens.
    pub fn with_padding(num_layers: usize, pad: Vec<usize>) -> Self {
        Self {
            layers: vec![None; num_layers],
            seq_len: 0,
            pad,
        }
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Positions held (including padding).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    pub fn batch_size(&self) -> usize {
        match self.layers.first() {
            Some(Some((k, _))) => k.dim(0).unwrap_or(0),
            _ => self.pad.len(),
        }
    }

    /// Padding of each of `b` rows (zeros when none was recorded).
    pub(crate) fn pad(&self, b: usize) -> &[usize] {
        if self.pad.len() == b { &self.pad } else { &[] }
    }

    /// Append new keys/values for `layer`; returns the full keys/values. Uses `Tensor::cat`,
    /// which is differentiable (candle's `KvCache::append` is not).
    pub(crate) fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let slot = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| candle_core::Error::Msg(format!("kv cache has no layer {layer}")))?;
        let (k, v) = match slot.take() {
            None => (k.clone(), v.clone()),
            Some((pk, pv)) => (Tensor::cat(&[&pk, k], 2)?, Tensor::cat(&[&pv, v], 2)?),
        };
        *slot = Some((k.clone(), v.clone()));
        Ok((k, v))
    }

    pub(crate) fn advance(&mut self, l: usize) {
        self.seq_len += l;
    }

    /// A new cache holding the given rows (in order; a row may repeat: that is a fork).
    pub fn select_rows(&self, rows: &[usize], device: &Device) -> Result<Self> {
        let idx = Tensor::from_vec(
            rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            rows.len(),
            device,
        )?;
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                None => Ok(None),
                Some((k, v)) => Ok(Some((
                    k.index_select(&idx, 0)?.contiguous()?,
                    v.index_select(&idx, 0)?.contiguous()?,
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        let pad = if self.pad.is_empty() {
            Vec::new()
        } else {
            rows.iter().map(|&r| self.pad.get(r).copied().unwrap_or(0)).collect()
        };
        Ok(Self {
            layers,
            seq_len: self.seq_len,
            pad,
        })
    }

    /// `n` copies of row `row` (rehearsal branches from one prefix).
    pub fn fork(&self, row: usize, n: usize, device: &Device) -> Result<Self> {
        self.select_rows(&vec![row; n], device)
    }

    /// Keep the first `len` positions.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.seq_len {
            return Ok(());
        }
        for l in self.layers.iter_mut() {
            if let Some((k, v)) = l.take() {
                *l = if len == 0 {
                    None
                } else {
                    Some((k.narrow(2, 0, len)?, v.narrow(2, 0, len)?))
                };
            }
        }
        self.seq_len = len;
        Ok(())
    }

    /// Bytes held by keys and values.
    pub fn size_in_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum()
    }
}
