//! An explicit, batched, forkable KV cache. Rows are sequences; all rows share one length
//! (left padding, recorded per row, keeps ragged prompts aligned). Forking a prefix into K
//! rehearsal branches copies the cache rows instead of recomputing the prefill.

use candle_core::{Device, Tensor};

type Result<T> = candle_core::Result<T>;

/// One layer's keys and values, (batch, kv_heads, capacity, head_dim), of which the first
/// `len` positions are valid. Inference appends in place into spare capacity; training appends
/// with `Tensor::cat` so that gradients flow.
#[derive(Debug)]
struct LayerKv {
    k: Tensor,
    v: Tensor,
    len: usize,
}

impl LayerKv {
    fn view(&self) -> Result<(Tensor, Tensor)> {
        if self.len == self.k.dim(2)? {
            Ok((self.k.clone(), self.v.clone()))
        } else {
            Ok((
                self.k.narrow(2, 0, self.len)?,
                self.v.narrow(2, 0, self.len)?,
            ))
        }
    }

    /// A private copy of the valid positions (clones never share storage: in-place appends
    /// into shared spare capacity would corrupt the other holder).
    fn deep_copy(&self) -> Result<Self> {
        // `copy` keeps the source layout (a narrowed view stays strided) and `contiguous` is a
        // no-op on a full-length view: do both, so the copy is contiguous and owns its storage.
        let (k, v) = self.view()?;
        Ok(Self {
            k: k.contiguous()?.copy()?,
            v: v.contiguous()?.copy()?,
            len: self.len,
        })
    }
}

/// Per-layer keys and values, each (batch, kv_heads, seq, head_dim).
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    seq_len: usize,
    /// Left padding per row (masked keys).
    pad: Vec<usize>,
}

impl Clone for KvCache {
    fn clone(&self) -> Self {
        let layers = self
            .layers
            .iter()
            .map(|l| l.as_ref().and_then(|l| l.deep_copy().ok()))
            .collect();
        Self {
            layers,
            seq_len: self.seq_len,
            pad: self.pad.clone(),
        }
    }
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: (0..num_layers).map(|_| None).collect(),
            seq_len: 0,
            pad: Vec::new(),
        }
    }

    /// A cache for a left-padded batch: row `r` starts with `pad[r]` padding tokens.
    pub fn with_padding(num_layers: usize, pad: Vec<usize>) -> Self {
        Self {
            layers: (0..num_layers).map(|_| None).collect(),
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
            Some(Some(l)) => l.k.dim(0).unwrap_or(0),
            _ => self.pad.len(),
        }
    }

    /// Padding of each of `b` rows (zeros when none was recorded).
    pub(crate) fn pad(&self, b: usize) -> &[usize] {
        if self.pad.len() == b { &self.pad } else { &[] }
    }

    /// Append new keys/values for `layer`; returns the full keys/values. With `in_place`
    /// (inference) the new positions are written into spare capacity (grown by doubling);
    /// otherwise `Tensor::cat` is used, which is differentiable (candle's `KvCache::append` is
    /// not).
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        in_place: bool,
    ) -> Result<(Tensor, Tensor)> {
        let slot = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| candle_core::Error::Msg(format!("kv cache has no layer {layer}")))?;
        let l = k.dim(2)?;
        let next = match slot.take() {
            None => LayerKv {
                k: k.contiguous()?,
                v: v.contiguous()?,
                len: l,
            },
            Some(prev) if !in_place => {
                let (pk, pv) = prev.view()?;
                LayerKv {
                    k: Tensor::cat(&[&pk, k], 2)?,
                    v: Tensor::cat(&[&pv, v], 2)?,
                    len: prev.len + l,
                }
            }
            Some(prev) => {
                let cap = prev.k.dim(2)?;
                let need = prev.len + l;
                let prev = if need > cap {
                    let new_cap = (cap * 2).max(need).max(64);
                    let (b, h, _, d) = prev.k.dims4()?;
                    let nk = Tensor::zeros((b, h, new_cap, d), prev.k.dtype(), prev.k.device())?;
                    let nv = Tensor::zeros((b, h, new_cap, d), prev.v.dtype(), prev.v.device())?;
                    let (pk, pv) = prev.view()?;
                    nk.slice_set(&pk.contiguous()?, 2, 0)?;
                    nv.slice_set(&pv.contiguous()?, 2, 0)?;
                    LayerKv {
                        k: nk,
                        v: nv,
                        len: prev.len,
                    }
                } else {
                    prev
                };
                prev.k.slice_set(&k.contiguous()?, 2, prev.len)?;
                prev.v.slice_set(&v.contiguous()?, 2, prev.len)?;
                LayerKv { len: need, ..prev }
            }
        };
        let out = next.view()?;
        *slot = Some(next);
        Ok(out)
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
                Some(l) => {
                    let (k, v) = l.view()?;
                    Ok(Some(LayerKv {
                        k: k.contiguous()?.index_select(&idx, 0)?,
                        v: v.contiguous()?.index_select(&idx, 0)?,
                        len: l.len,
                    }))
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let pad = if self.pad.is_empty() {
            Vec::new()
        } else {
            rows.iter()
                .map(|&r| self.pad.get(r).copied().unwrap_or(0))
                .collect()
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
            if len == 0 {
                *l = None;
            } else if let Some(kv) = l.as_mut() {
                kv.len = len;
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
            .map(|l| (l.k.elem_count() + l.v.elem_count()) * l.k.dtype().size_in_bytes())
            .sum()
    }
}
