//! An explicit, batched, forkable KV cache. Rows are sequences; all rows share one length
//! (left padding, recorded per row, keeps ragged prompts aligned). Forking a prefix into K
//! rehearsal branches does not recompute the prefill, and does not copy it K times either: the
//! forked positions become a prefix that every row shares (one copy), and each row appends its
//! own positions after it. Decode-step attention reads the shared prefix once for all rows
//! (`infer::attend_one`); the tensor path (multi-token steps, training, the fast path turned
//! off) first expands it into every row ([`KvCache::append`]).

use candle_core::{Device, Tensor};

type Result<T> = candle_core::Result<T>;

/// Capacity of a row set's own positions right after a fork.
const FORK_CAPACITY: usize = 16;

/// Keys and values of positions `0..P` shared by every row of a layer, (1, kv_heads, P,
/// head_dim). Never written in place (clones share the storage).
#[derive(Debug, Clone)]
struct SharedKv {
    k: Tensor,
    v: Tensor,
}

impl SharedKv {
    fn len(&self) -> Result<usize> {
        self.k.dim(2)
    }
}

/// One layer's keys and values: an optional shared prefix, then each row's own positions,
/// (batch, kv_heads, capacity, head_dim), of which the first `len` are valid. Inference appends
/// in place into spare capacity; training appends with `Tensor::cat` so that gradients flow.
#[derive(Debug)]
struct LayerKv {
    prefix: Option<SharedKv>,
    k: Tensor,
    v: Tensor,
    len: usize,
}

impl LayerKv {
    /// The rows' own valid positions (`None` when there are none yet).
    fn own(&self) -> Result<Option<(Tensor, Tensor)>> {
        if self.len == 0 {
            Ok(None)
        } else if self.len == self.k.dim(2)? {
            Ok(Some((self.k.clone(), self.v.clone())))
        } else {
            Ok(Some((
                self.k.narrow(2, 0, self.len)?,
                self.v.narrow(2, 0, self.len)?,
            )))
        }
    }

    /// Every valid position of every row, the shared prefix expanded into each row.
    fn view(&self) -> Result<(Tensor, Tensor)> {
        let own = self.own()?;
        let Some(p) = &self.prefix else {
            return own.ok_or_else(|| candle_core::Error::Msg("kv cache layer is empty".into()));
        };
        let b = self.k.dim(0)?;
        let (_, h, n, d) = p.k.dims4()?;
        let pk = p.k.expand((b, h, n, d))?.contiguous()?;
        let pv = p.v.expand((b, h, n, d))?.contiguous()?;
        match own {
            None => Ok((pk, pv)),
            Some((k, v)) => Ok((Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?)),
        }
    }

    /// Positions held per row.
    fn total(&self) -> Result<usize> {
        Ok(self
            .prefix
            .as_ref()
            .map(SharedKv::len)
            .transpose()?
            .unwrap_or(0)
            + self.len)
    }

    /// A private copy of the rows' own positions (clones never share writable storage:
    /// in-place appends into shared spare capacity would corrupt the other holder); the
    /// read-only prefix is shared.
    fn deep_copy(&self) -> Result<Self> {
        // `copy` keeps the source layout (a narrowed view stays strided) and `contiguous` is a
        // no-op on a full-length view: do both, so the copy is contiguous and owns its storage.
        match self.own()? {
            Some((k, v)) => Ok(Self {
                prefix: self.prefix.clone(),
                k: k.contiguous()?.copy()?,
                v: v.contiguous()?.copy()?,
                len: self.len,
            }),
            None => Ok(Self {
                prefix: self.prefix.clone(),
                k: self.k.zeros_like()?,
                v: self.v.zeros_like()?,
                len: 0,
            }),
        }
    }

    /// Fold the shared prefix into every row (for the tensor path).
    fn unshare(self) -> Result<Self> {
        if self.prefix.is_none() {
            return Ok(self);
        }
        let (k, v) = self.view()?;
        let len = k.dim(2)?;
        Ok(Self {
            prefix: None,
            k,
            v,
            len,
        })
    }

    /// Empty own positions for `b` rows shaped like this layer's.
    fn empty_own(&self, b: usize, prefix: Option<SharedKv>) -> Result<Self> {
        let (_, h, _, d) = self.k.dims4()?;
        Ok(Self {
            prefix,
            k: Tensor::zeros((b, h, FORK_CAPACITY, d), self.k.dtype(), self.k.device())?,
            v: Tensor::zeros((b, h, FORK_CAPACITY, d), self.v.dtype(), self.v.device())?,
            len: 0,
        })
    }

    /// Append in place into spare capacity (grown by doubling).
    fn push_in_place(self, k: &Tensor, v: &Tensor) -> Result<Self> {
        let l = k.dim(2)?;
        let cap = self.k.dim(2)?;
        let need = self.len + l;
        let prev = if need > cap {
            let new_cap = (cap * 2).max(need).max(64);
            let (b, h, _, d) = self.k.dims4()?;
            let nk = Tensor::zeros((b, h, new_cap, d), self.k.dtype(), self.k.device())?;
            let nv = Tensor::zeros((b, h, new_cap, d), self.v.dtype(), self.v.device())?;
            if let Some((pk, pv)) = self.own()? {
                nk.slice_set(&pk.contiguous()?, 2, 0)?;
                nv.slice_set(&pv.contiguous()?, 2, 0)?;
            }
            LayerKv {
                prefix: self.prefix,
                k: nk,
                v: nv,
                len: self.len,
            }
        } else {
            self
        };
        prev.k.slice_set(&k.contiguous()?, 2, prev.len)?;
        prev.v.slice_set(&v.contiguous()?, 2, prev.len)?;
        Ok(LayerKv { len: need, ..prev })
    }
}

/// What a decode step's attention reads for one layer: the shared prefix (if any) and every
/// row's own positions, the new one included.
pub(crate) struct DecodeKv {
    pub prefix: Option<(Tensor, Tensor)>,
    pub k: Tensor,
    pub v: Tensor,
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

    /// Append new keys/values for `layer`; returns the full keys/values (a shared prefix is
    /// first expanded into every row). With `in_place` (inference) the new positions are
    /// written into spare capacity (grown by doubling); otherwise `Tensor::cat` is used, which
    /// is differentiable (candle's `KvCache::append` is not).
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
                prefix: None,
                k: k.contiguous()?,
                v: v.contiguous()?,
                len: l,
            },
            Some(prev) if !in_place => {
                let (pk, pv) = prev.view()?;
                LayerKv {
                    prefix: None,
                    k: Tensor::cat(&[&pk, k], 2)?,
                    v: Tensor::cat(&[&pv, v], 2)?,
                    len: prev.total()? + l,
                }
            }
            Some(prev) => prev.unshare()?.push_in_place(k, v)?,
        };
        let out = next.view()?;
        *slot = Some(next);
        Ok(out)
    }

    /// Append one decode step's keys/values for `layer` in place, keeping a shared prefix
    /// shared; returns what the step's attention reads.
    pub(crate) fn append_decode(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<DecodeKv> {
        let slot = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| candle_core::Error::Msg(format!("kv cache has no layer {layer}")))?;
        let next = match slot.take() {
            None => LayerKv {
                prefix: None,
                k: k.contiguous()?,
                v: v.contiguous()?,
                len: k.dim(2)?,
            },
            Some(prev) => prev.push_in_place(k, v)?,
        };
        let (ok, ov) = next
            .own()?
            .ok_or_else(|| candle_core::Error::Msg("kv cache: nothing appended".into()))?;
        let out = DecodeKv {
            prefix: next.prefix.as_ref().map(|p| (p.k.clone(), p.v.clone())),
            k: ok,
            v: ov,
        };
        *slot = Some(next);
        Ok(out)
    }

    pub(crate) fn advance(&mut self, l: usize) {
        self.seq_len += l;
    }

    /// A new cache holding the given rows (in order; a row may repeat). A shared prefix stays
    /// shared; the rows' own positions are copied.
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
                Some(l) => match l.own()? {
                    Some((k, v)) => Ok(Some(LayerKv {
                        prefix: l.prefix.clone(),
                        k: k.contiguous()?.index_select(&idx, 0)?,
                        v: v.contiguous()?.index_select(&idx, 0)?,
                        len: l.len,
                    })),
                    None => l.empty_own(rows.len(), l.prefix.clone()).map(Some),
                },
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            seq_len: self.seq_len,
            pad: self.pad_of(rows),
        })
    }

    fn pad_of(&self, rows: &[usize]) -> Vec<usize> {
        if self.pad.is_empty() {
            Vec::new()
        } else {
            rows.iter()
                .map(|&r| self.pad.get(r).copied().unwrap_or(0))
                .collect()
        }
    }

    /// `n` branches continuing row `row` (rehearsal branches from one prefix): every position
    /// of that row becomes one prefix the branches share; each branch appends its own.
    pub fn fork(&self, row: usize, n: usize, device: &Device) -> Result<Self> {
        let idx = Tensor::from_vec(vec![row as u32], 1, device)?;
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                None => Ok(None),
                Some(l) => {
                    let prefix = match (l.own()?, &l.prefix) {
                        // Only the shared prefix so far: share it as it is.
                        (None, Some(p)) => p.clone(),
                        _ => {
                            let (k, v) = l.view()?;
                            SharedKv {
                                k: k.contiguous()?.index_select(&idx, 0)?.copy()?,
                                v: v.contiguous()?.index_select(&idx, 0)?.copy()?,
                            }
                        }
                    };
                    l.empty_own(n, Some(prefix)).map(Some)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            seq_len: self.seq_len,
            pad: self.pad_of(&vec![row; n]),
        })
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
                let np = kv
                    .prefix
                    .as_ref()
                    .map(SharedKv::len)
                    .transpose()?
                    .unwrap_or(0);
                if len >= np {
                    kv.len = len - np;
                } else if let Some(p) = kv.prefix.as_mut() {
                    // A narrowed view of read-only storage: still never written.
                    p.k = p.k.narrow(2, 0, len)?;
                    p.v = p.v.narrow(2, 0, len)?;
                    kv.len = 0;
                }
            }
        }
        self.seq_len = len;
        Ok(())
    }

    /// Positions shared by every row (0 when none are).
    pub fn shared_len(&self) -> usize {
        match self.layers.first() {
            Some(Some(l)) => l.prefix.as_ref().and_then(|p| p.len().ok()).unwrap_or(0),
            _ => 0,
        }
    }

    /// Bytes held by keys and values.
    pub fn size_in_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|l| {
                let shared = l
                    .prefix
                    .as_ref()
                    .map_or(0, |p| p.k.elem_count() + p.v.elem_count());
                (shared + l.k.elem_count() + l.v.elem_count()) * l.k.dtype().size_in_bytes()
            })
            .sum()
    }
}
