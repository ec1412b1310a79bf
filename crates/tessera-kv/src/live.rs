//! Live decode steps: a decode step split into its host bookkeeping and its device work,
//! the shape a step captured once in a device graph and replayed needs (the seeds'
//! `prepareDecodeStep` / `commitDecodeStep`). [`KvCache::begin_live_step`] does the host
//! part of every layer's one-position append (rows advanced, each layer's positions set in
//! device memory); [`KvCache::live_step`] queues one layer's device part (the write at each
//! row's slot, the read, the slots advanced on the device), which reads nothing from the
//! host, so the same launches replay correctly at every later step.

use crate::{KvCache, KvError, LayerCache};
use candle_core::Tensor;
use std::hash::{DefaultHasher, Hasher};

impl LayerCache {
    /// Where the next one-position append of every row would write and read, `(start,
    /// slot)` per row (reading slots `start ..= slot`), if it can run as a live step:
    /// full retention (a ring's read spans two ranges once it wraps), no conversion still
    /// to come, no open round, room for the position, and planes that take live steps.
    fn live_spans(&self) -> Option<Vec<(usize, usize)>> {
        let ready = self.bound
            && self.slots.window.is_none()
            && !self.awaiting_conversion()
            && self.rows.round().is_none()
            && self.planes.serves_live();
        if !ready {
            return None;
        }
        let ends = self.rows.ends();
        let width = ends.iter().max()? + 1;
        if self.planes.capacity() < self.slots.capacity(width) {
            return None;
        }
        ends.iter()
            .zip(self.rows.left_pad())
            .map(|(&end, &pad)| {
                let span = self.slots.visible(end, pad).single_span()?;
                (span.end == end + 1).then_some((span.start, end))
            })
            .collect()
    }
}

impl KvCache {
    /// What [`KvCache::begin_live_step`] would return now, changing nothing: a caller
    /// decides from it whether a live step is worth beginning.
    pub fn live_identity(&self, query_heads: usize) -> Option<u64> {
        if self.layers.is_empty() {
            return None;
        }
        let mut identity = DefaultHasher::new();
        for layer in &self.layers {
            let spans = layer.live_spans()?;
            identity.write_u64(layer.planes.live_identity(&spans, query_heads)?);
        }
        Some(identity.finish())
    }

    /// The host part of a decode step of one position a row, on every layer or on none:
    /// each layer's positions set on its planes ([`crate::planes::Planes::live_spans`])
    /// and its rows advanced, as [`crate::AttentionCache::append_decode`] would. Returns
    /// the identity of every buffer the step's device work touches (a graph that captured
    /// [`KvCache::live_step`]s replays correctly while it is unchanged), or `None`, with
    /// nothing changed, where some layer cannot take a live step: the step then appends
    /// as usual. `query_heads`: the model's query heads (every layer's).
    pub fn begin_live_step(&mut self, query_heads: usize) -> Result<Option<u64>, KvError> {
        if self.layers.is_empty() {
            return Ok(None);
        }
        let Some(spans) = self
            .layers
            .iter()
            .map(LayerCache::live_spans)
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(None);
        };
        let mut identity = DefaultHasher::new();
        for (layer, spans) in self.layers.iter_mut().zip(&spans) {
            identity.write_u64(layer.planes.live_spans(spans, query_heads)?);
        }
        for layer in &mut self.layers {
            layer.rows.advance(1, layer.slots.ring);
        }
        Ok(Some(identity.finish()))
    }

    /// Sets every layer's device positions back to where [`KvCache::begin_live_step`] set
    /// them, so that the step's device work can run again (each write lands where it did
    /// and each read reads the same): a graph captured by running the step, or a capture
    /// that failed, then runs it once more.
    pub fn rewind_live_step(&mut self) -> Result<(), KvError> {
        for layer in &mut self.layers {
            layer.planes.live_rewind()?;
        }
        Ok(())
    }

    /// Layer `layer`'s device work of the step [`KvCache::begin_live_step`] began: `k`,
    /// `v` `(rows, kv_heads, 1, dim)` stored, `q` `(rows, q_heads, 1, head_dim)` read with
    /// `scale`, on the device only. Called once per layer per begun step.
    pub fn live_step(
        &mut self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f32,
    ) -> Result<Tensor, KvError> {
        let layers = self.layers.len();
        let l = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| KvError::Rows(format!("layer {layer} of {layers}")))?;
        l.planes.live_step(q, k, v, scale)
    }
}
