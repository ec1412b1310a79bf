//! The decoder's decode step as device graphs, one set per row count
//! ([`crate::step_graph`]): graph 0 is layer 0's norm, projections and RoPE; graph `i` the
//! output projection and MLP of layer `i - 1` and then layer `i`'s projections; the last
//! ends with the logits. Each layer's cache work runs eagerly between two graphs.

use super::live::{copied_rope, LiveGraphs};
use super::{Decoder, Projected, Residual, Rope, StepInput};
use crate::step_graph::{captured, copy_into, DeviceGraph, GraphBackend, GraphOutput};
use crate::{LogitsMode, ModelError, StepGraphChecks};
use candle_core::Tensor;
use tessera_kv::KvCache;

/// Row counts whose graphs are kept (the most recently used): as many as `max_rows`, since a
/// served batch's row count wanders and keeping fewer than it visits would recapture on
/// most joins, but at least [`KEPT`] and at most [`MOST_KEPT`]: each row count holds its own
/// buffers (an 8B's at 16 rows ≈ 30 MB).
const KEPT: usize = 4;
const MOST_KEPT: usize = 32;

/// A row count's graphs, or the record that capturing them failed (its steps then run
/// eagerly).
enum Captured {
    Ready(Box<StepGraph>),
    Refused,
}

/// The graphs of the decoder's decode steps, by row count.
pub(super) struct StepGraphs {
    pub(super) enabled: bool,
    /// The most rows a graphed step has ([`crate::LoadOptions::step_graph_rows`]).
    max_rows: usize,
    by_rows: Vec<(usize, Captured)>,
    /// Whole steps, the cache's work included, where the cache takes live steps
    /// ([`crate::LoadOptions::live_step_graphs`]; `live.rs`).
    pub(super) live_enabled: bool,
    pub(super) live: LiveGraphs,
    /// Each replay checked against an eager run ([`crate::LoadOptions::check_step_graphs`]),
    /// and what the checks found.
    pub(super) check: bool,
    pub(super) checks: StepGraphChecks,
}

impl StepGraphs {
    pub(super) fn new(enabled: bool, max_rows: usize, live_enabled: bool, check: bool) -> Self {
        StepGraphs {
            enabled,
            max_rows,
            by_rows: Vec::new(),
            live_enabled,
            live: LiveGraphs::default(),
            check,
            checks: StepGraphChecks::default(),
        }
    }

    /// One replayed step compared with its eager run: `differs` names the first output that
    /// differed, if one did.
    pub(super) fn record_check(&mut self, differs: Option<String>) {
        self.checks.compared += 1;
        if let Some(what) = differs {
            self.checks.differed += 1;
            self.checks.first_difference.get_or_insert(what);
        }
    }

    /// How many row counts' graphs are kept.
    pub(super) fn kept(&self) -> usize {
        self.max_rows.clamp(KEPT, MOST_KEPT)
    }

    /// Whether a decode step of `rows` rows runs through graphs.
    pub(super) fn serves(&self, rows: usize) -> bool {
        self.enabled && rows <= self.max_rows
    }

    /// Drops every captured graph (a later step captures again).
    pub(super) fn clear(&mut self) {
        self.by_rows.clear();
        self.live.clear();
    }
}

/// One row count's graphs and the tensors they read and write, all in ordinary memory
/// (graph memory never outlives a graph's launch: [`captured`]).
struct StepGraph {
    /// The step's inputs, rewritten before each replay: the ids' embeddings and the RoPE
    /// tables.
    x: Tensor,
    ropes: [Option<Rope>; 2],
    /// Layer `i`'s stream sum and projections, written by graph `i`. The sums are only
    /// read by the graphs; they are held here so that their buffers live as long as them.
    #[allow(dead_code)]
    sums: Vec<Tensor>,
    projected: Vec<Projected>,
    /// Layer `i`'s attention read, copied here for graph `i + 1`.
    attended: Vec<Tensor>,
    logits: Tensor,
    graphs: Vec<Box<dyn DeviceGraph>>,
}

impl GraphOutput for Projected {
    fn tensors(&self) -> Vec<&Tensor> {
        match &self.qk {
            Some(qk) => vec![qk, &self.v],
            None => vec![&self.q, &self.k, &self.v],
        }
    }
    fn map(
        &self,
        f: &mut dyn FnMut(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Self> {
        match &self.qk {
            // q and k as the same views of the mapped q|k.
            Some(qk) => {
                let qk = f(qk)?;
                let (heads, kv_heads) = (self.q.dims()[1], self.k.dims()[1]);
                Ok(Projected {
                    q: qk.narrow(1, 0, heads)?,
                    k: qk.narrow(1, heads, kv_heads)?,
                    v: f(&self.v)?,
                    qk: Some(qk),
                })
            }
            None => Ok(Projected {
                q: f(&self.q)?,
                k: f(&self.k)?,
                v: f(&self.v)?,
                qk: None,
            }),
        }
    }
}

impl Decoder {
    /// A decode step (`input` of one token a row) through the row count's graphs, captured
    /// by this step where they are not yet.
    pub(super) fn forward_graphed(
        &self,
        backend: &dyn GraphBackend,
        input: &StepInput,
        cache: &mut KvCache,
        mode: LogitsMode,
    ) -> Result<Tensor, ModelError> {
        let rows = input.shape.0;
        let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let at = graphs.by_rows.iter().position(|(r, _)| *r == rows);
        if let Some(at) = at {
            // Most recently used last.
            let entry = graphs.by_rows.remove(at);
            graphs.by_rows.push(entry);
            let last = graphs.by_rows.len() - 1;
            let check = graphs.check;
            let (logits, differs) = match &graphs.by_rows[last].1 {
                Captured::Ready(g) => g.replay(self, input, cache, mode, check)?,
                Captured::Refused => return self.forward_eager(input, cache, mode),
            };
            if check {
                if differs.is_some() {
                    graphs.by_rows[last].1 = Captured::Refused;
                }
                graphs.record_check(differs);
            }
            return Ok(logits);
        }
        let (graph, logits) = self.capture_step(backend, input, cache, mode)?;
        if graphs.by_rows.len() >= graphs.kept() {
            graphs.by_rows.remove(0);
        }
        let entry = match graph {
            Some(g) => Captured::Ready(Box::new(g)),
            None => Captured::Refused,
        };
        graphs.by_rows.push((rows, entry));
        Ok(logits)
    }

    /// Runs one decode step while capturing its graphs. Returns them (`None` where some
    /// capture failed: that part then ran as ordinary launches) and the step's logits.
    fn capture_step(
        &self,
        backend: &dyn GraphBackend,
        input: &StepInput,
        cache: &mut KvCache,
        mode: LogitsMode,
    ) -> Result<(Option<StepGraph>, Tensor), ModelError> {
        let device = &self.device;
        // The inputs' own buffers, in ordinary memory: replays copy each step's into them.
        let x = input.x.copy()?;
        let ropes = [copied_rope(&input.ropes[0])?, copied_rope(&input.ropes[1])?];
        let mut graphs = Vec::with_capacity(self.blocks.len() + 1);
        let mut complete = true;
        let mut keep = |g: Option<Box<dyn DeviceGraph>>| match g {
            Some(g) => graphs.push(g),
            None => complete = false,
        };
        let first = &self.blocks[0];
        let ((sum, p), g) = captured(backend, device, || {
            let s = Residual {
                x: x.clone(),
                pending: None,
            };
            first.project(&s, first.rope(&ropes)?)
        })?;
        keep(g);
        let (mut sums, mut projected) = (vec![sum], vec![p]);
        let mut attended = Vec::with_capacity(self.blocks.len());
        let mut logits = None;
        for (i, block) in self.blocks.iter().enumerate() {
            let read = block.attn.read(&projected[i], cache.layer_mut(i))?;
            attended.push(read.copy()?);
            let (sum, read) = (&sums[i], &attended[i]);
            match self.blocks.get(i + 1) {
                Some(next) => {
                    let ((sum, p), g) = captured(backend, device, || {
                        let s = block.finish(sum.clone(), read)?;
                        next.project(&s, next.rope(&ropes)?)
                    })?;
                    keep(g);
                    sums.push(sum);
                    projected.push(p);
                }
                None => {
                    let (l, g) = captured(backend, device, || {
                        self.logits(&block.finish(sum.clone(), read)?, mode)
                    })?;
                    keep(g);
                    logits = Some(l);
                }
            }
        }
        let logits = logits.ok_or(ModelError::EmptyInput { rows: 0, tokens: 0 })?;
        // The caller's logits are a copy: the graph's are rewritten by the next replay.
        let out = logits.copy()?;
        let graph = complete.then_some(StepGraph {
            x,
            ropes,
            sums,
            projected,
            attended,
            logits,
            graphs,
        });
        Ok((graph, out))
    }
}

impl StepGraph {
    /// The step through the graphs; with `check`, each graph's outputs are compared with its
    /// part run eagerly from the same inputs, and the first that differs is named (the step
    /// goes on with the graphs' outputs).
    fn replay(
        &self,
        decoder: &Decoder,
        input: &StepInput,
        cache: &mut KvCache,
        mode: LogitsMode,
        check: bool,
    ) -> Result<(Tensor, Option<String>), ModelError> {
        copy_into(&self.x, &input.x)?;
        for (mine, given) in self.ropes.iter().zip(&input.ropes) {
            if let (Some(mine), Some(given)) = (mine, given) {
                copy_into(&mine.cos, &given.cos)?;
                copy_into(&mine.sin, &given.sin)?;
            }
        }
        let layers = decoder.blocks.len();
        let mut differs = None;
        for (i, block) in decoder.blocks.iter().enumerate() {
            self.graphs[i].launch()?;
            if check && differs.is_none() {
                differs = self.eager_difference(decoder, i, mode)?;
            }
            let read = block.attn.read(&self.projected[i], cache.layer_mut(i))?;
            copy_into(&self.attended[i], &read)?;
        }
        self.graphs[layers].launch()?;
        if check && differs.is_none() {
            differs = self.eager_difference(decoder, layers, mode)?;
        }
        Ok((self.logits.copy()?, differs))
    }

    /// Graph `i`'s outputs against its part run eagerly from the inputs it read (the last
    /// graph's: the logits); the first output that differs, named.
    fn eager_difference(
        &self,
        decoder: &Decoder,
        i: usize,
        mode: LogitsMode,
    ) -> Result<Option<String>, ModelError> {
        let blocks = &decoder.blocks;
        let finished = |l: usize| blocks[l].finish(self.sums[l].clone(), &self.attended[l]);
        if i == blocks.len() {
            let logits = decoder.logits(&finished(i - 1)?, mode)?;
            let same = same_bits(&logits, &self.logits)?;
            return Ok((!same).then(|| format!("graph {i} of {}: the logits", i + 1)));
        }
        let s = match i {
            0 => Residual {
                x: self.x.clone(),
                pending: None,
            },
            _ => finished(i - 1)?,
        };
        let (sum, p) = blocks[i].project(&s, blocks[i].rope(&self.ropes)?)?;
        let mine = std::iter::once(&self.sums[i]).chain(self.projected[i].tensors());
        let eager = std::iter::once(&sum).chain(p.tensors());
        for (k, (a, b)) in mine.zip(eager).enumerate() {
            if !same_bits(a, b)? {
                let what = [
                    "the stream's sum",
                    "projection output 1",
                    "projection output 2",
                ];
                let name = what.get(k).copied().unwrap_or("projection output 3");
                return Ok(Some(format!("graph {i} of {}: {name}", blocks.len() + 1)));
            }
        }
        Ok(None)
    }
}

/// Whether `a` and `b` hold the same values bit for bit (shape, dtype and every element).
pub(super) fn same_bits(a: &Tensor, b: &Tensor) -> candle_core::Result<bool> {
    if a.dims() != b.dims() || a.dtype() != b.dtype() {
        return Ok(false);
    }
    let bits = |t: &Tensor| -> candle_core::Result<Vec<u32>> {
        let v = t.flatten_all()?.to_dtype(candle_core::DType::F32)?;
        Ok(v.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
    };
    Ok(bits(a)? == bits(b)?)
}

#[cfg(test)]
mod tests {
    use super::same_bits;
    use candle_core::{DType, Device, Tensor};

    /// The check's comparison: equal only when shape, dtype and every bit agree (one ulp,
    /// a sign of zero or a shape apart is a difference).
    #[test]
    fn same_bits_tells_one_ulp_a_signed_zero_and_a_shape_apart() {
        let dev = Device::Cpu;
        let v = vec![1.0f32, -2.5, 0.0, 3.25e-3];
        let a = Tensor::from_vec(v.clone(), (2, 2), &dev).unwrap();
        assert!(same_bits(&a, &a.copy().unwrap()).unwrap());
        let mut ulp = v.clone();
        ulp[3] = f32::from_bits(ulp[3].to_bits() + 1);
        let b = Tensor::from_vec(ulp, (2, 2), &dev).unwrap();
        assert!(!same_bits(&a, &b).unwrap(), "one ulp apart passed");
        let mut neg = v.clone();
        neg[2] = -0.0;
        let c = Tensor::from_vec(neg, (2, 2), &dev).unwrap();
        assert!(!same_bits(&a, &c).unwrap(), "-0 passed for +0");
        let d = Tensor::from_vec(v, 4, &dev).unwrap();
        assert!(!same_bits(&a, &d).unwrap(), "another shape passed");
        let e = a.to_dtype(DType::BF16).unwrap();
        assert!(!same_bits(&a, &e).unwrap(), "another dtype passed");
    }
}
