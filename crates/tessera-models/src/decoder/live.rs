//! Decode steps captured whole, the KV cache's work included, as one device graph per row
//! count ([`crate::step_graph`]). The cache's host bookkeeping runs first
//! ([`KvCache::begin_live_step`]: rows advanced, each layer's write slot and read span set
//! in device memory); the graph then holds every launch of the step, the cache's writes and
//! reads among them, which take their positions from device memory and advance them there
//! ([`KvCache::live_step`]). So one launch replays a step, with no boundary between layers.
//!
//! A graph replays while the cache's identity (its buffers, the reads' split plan) is the
//! one it was captured with; a capture waits until that identity has held for
//! [`STABLE_STEPS`] steps, since a served batch whose rows join and leave changes it often
//! and a capture costs about as much as a dozen steps. Until then, and wherever the cache
//! cannot take live steps (sliding-window rings, a conversion still to come, an open
//! speculative round, turbo planes), steps run through the per-layer graphs
//! (`graphed.rs`).

use super::graphed::same_bits;
use super::{Decoder, Residual, Rope, StepInput};
use crate::step_graph::{copy_into, DeviceGraph, GraphBackend};
use crate::{LogitsMode, ModelError};
use candle_core::Tensor;
use tessera_kv::KvCache;

/// Consecutive steps a row count's cache identity must hold before its step is captured.
const STABLE_STEPS: usize = 8;

/// Live graphs by row count, most recently used last.
#[derive(Default)]
pub(super) struct LiveGraphs {
    by_rows: Vec<(usize, LiveSlot)>,
}

#[derive(Default)]
struct LiveSlot {
    /// The identity seen at the last step, and for how many steps in a row.
    seen: u64,
    steps: usize,
    /// An identity whose capture failed (not tried again while it holds).
    refused: Option<u64>,
    graph: Option<LiveGraph>,
}

/// One captured step: its input buffers (rewritten before each replay), its logits'
/// buffer, and the cache identity it holds.
struct LiveGraph {
    identity: u64,
    x: Tensor,
    ropes: [Option<Rope>; 2],
    logits: Tensor,
    graph: Box<dyn DeviceGraph>,
}

impl LiveGraphs {
    fn slot(&mut self, rows: usize, kept: usize) -> &mut LiveSlot {
        if let Some(at) = self.by_rows.iter().position(|(r, _)| *r == rows) {
            let entry = self.by_rows.remove(at);
            self.by_rows.push(entry);
        } else {
            if self.by_rows.len() >= kept {
                self.by_rows.remove(0);
            }
            self.by_rows.push((rows, LiveSlot::default()));
        }
        let last = self.by_rows.len() - 1;
        &mut self.by_rows[last].1
    }

    pub(super) fn clear(&mut self) {
        self.by_rows.clear();
    }
}

/// Own buffers holding `r`'s tables.
pub(super) fn copied_rope(r: &Option<Rope>) -> candle_core::Result<Option<Rope>> {
    r.as_ref()
        .map(|r| {
            Ok(Rope {
                cos: r.cos.copy()?,
                sin: r.sin.copy()?,
                interleaved: r.interleaved,
            })
        })
        .transpose()
}

impl Decoder {
    /// A decode step (`input` of one token a row) as one live graph, captured by this step
    /// where it is due; `None`, with nothing done, where this step should run otherwise.
    pub(super) fn forward_live(
        &self,
        backend: &dyn GraphBackend,
        input: &StepInput,
        cache: &mut KvCache,
        mode: LogitsMode,
    ) -> Result<Option<Tensor>, ModelError> {
        let rows = input.shape.0;
        let heads = self.config.heads;
        let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        if !graphs.live_enabled {
            return Ok(None);
        }
        let (kept, check) = (graphs.kept(), graphs.check);
        let slot = graphs.live.slot(rows, kept);
        let Some(identity) = cache.live_identity(heads) else {
            slot.steps = 0;
            return Ok(None);
        };
        let ready = slot.graph.as_ref().is_some_and(|g| g.identity == identity);
        if !ready {
            if slot.seen == identity {
                slot.steps += 1;
            } else {
                (slot.seen, slot.steps) = (identity, 1);
            }
            if slot.steps < STABLE_STEPS || slot.refused == Some(identity) {
                return Ok(None);
            }
        }
        // From here this step's cache work runs live (the host part is done).
        let Some(identity) = cache.begin_live_step(heads)? else {
            return Ok(None);
        };
        if let Some(g) = slot.graph.as_ref().filter(|g| g.identity == identity) {
            let replayed = g.replay(input)?;
            if !check {
                return Ok(Some(replayed));
            }
            // The check: the cache's positions set back, the step again as ordinary
            // launches (the same writes, the same reads), its logits against the replay's.
            cache.rewind_live_step()?;
            let eager = self.live_work(&input.x, &input.ropes, cache, mode)?;
            let differs = (!same_bits(&replayed, &eager)?)
                .then(|| "the whole-step graph: the logits".to_string());
            if differs.is_some() {
                slot.graph = None;
                slot.refused = Some(identity);
            }
            graphs.record_check(differs);
            return Ok(Some(eager));
        }
        slot.graph = None;
        let (graph, logits) = self.capture_live(backend, input, cache, mode, identity)?;
        if graph.is_none() {
            slot.refused = Some(identity);
        }
        slot.graph = graph;
        Ok(Some(logits))
    }

    /// The device work of a begun live step, from the given inputs.
    fn live_work(
        &self,
        x: &Tensor,
        ropes: &[Option<Rope>; 2],
        cache: &mut KvCache,
        mode: LogitsMode,
    ) -> Result<Tensor, ModelError> {
        let mut s = Residual {
            x: x.clone(),
            pending: None,
        };
        for (i, block) in self.blocks.iter().enumerate() {
            let rope = block.rope(ropes)?;
            s = block.forward(&s, rope, |p| {
                Ok(cache.live_step(i, &p.q, &p.k, &p.v, block.attn.scale)?)
            })?;
        }
        Ok(self.logits(&s, mode)?)
    }

    /// Runs a begun live step while capturing it. First the step runs as ordinary launches
    /// (with the backend's upload cache on, so the capture finds every parameter upload on
    /// the device, and so its logits size their buffer); the cache's positions are set back
    /// and the step captured and launched, running it again where it ran before (the same
    /// writes, the same reads). Where the capture fails, the step runs once more as ordinary
    /// launches and no graph is returned.
    fn capture_live(
        &self,
        backend: &dyn GraphBackend,
        input: &StepInput,
        cache: &mut KvCache,
        mode: LogitsMode,
        identity: u64,
    ) -> Result<(Option<LiveGraph>, Tensor), ModelError> {
        let device = &self.device;
        let _uploads = backend.cache_uploads(device);
        let x = input.x.copy()?;
        let ropes = [copied_rope(&input.ropes[0])?, copied_rope(&input.ropes[1])?];
        let logits = {
            let warm = self.live_work(&x, &ropes, cache, mode)?;
            let home = Tensor::zeros(warm.dims(), warm.dtype(), warm.device())?;
            copy_into(&home, &warm)?;
            home
        };
        cache.rewind_live_step()?;
        let captured = match backend.begin(device) {
            Ok(()) => {
                let recorded = self
                    .live_work(&x, &ropes, cache, mode)
                    .and_then(|l| Ok(copy_into(&logits, &l)?));
                let graph = backend.end(device);
                match (recorded, graph) {
                    (Ok(()), Ok(graph)) => Some(graph),
                    _ => None,
                }
            }
            Err(_) => None,
        };
        let Some(graph) = captured else {
            // Whatever the failed capture ran (nothing, on a GPU), the step runs once more.
            cache.rewind_live_step()?;
            let out = self.live_work(&x, &ropes, cache, mode)?;
            return Ok((None, out));
        };
        graph.launch()?;
        let out = logits.copy()?;
        let graph = LiveGraph {
            identity,
            x,
            ropes,
            logits,
            graph,
        };
        Ok((Some(graph), out))
    }
}

impl LiveGraph {
    fn replay(&self, input: &StepInput) -> Result<Tensor, ModelError> {
        copy_into(&self.x, &input.x)?;
        for (mine, given) in self.ropes.iter().zip(&input.ropes) {
            if let (Some(mine), Some(given)) = (mine, given) {
                copy_into(&mine.cos, &given.cos)?;
                copy_into(&mine.sin, &given.sin)?;
            }
        }
        self.graph.launch()?;
        Ok(self.logits.copy()?)
    }
}
