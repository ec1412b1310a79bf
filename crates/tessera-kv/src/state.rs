//! Cache state: everything a layer cache is, as plain data — codec, transition, rows, ring
//! slack, reuse floor, and the planes exactly as stored (a turbo layer's fitted key
//! preparations with them) — so a cache can be saved and rebuilt bit for bit. Device planes
//! give their state through the host and are rebuilt on the device asked for.

use crate::cache::KvCache;
use crate::layer::LayerCache;
use crate::planes::{planes_for, PlanesState};
use crate::retention::Slots;
use crate::rows::Rows;
use crate::{Codec, Isa, KvError, LayerSpec, PlainDType, QueryMoments};
use candle_core::Device;

/// The version of [`CacheState`]'s layout; a state of another version is refused, except
/// as [`readable_version`] allows.
///
/// Version 2: the turbo codebooks moved to their converged Lloyd–Max levels (the outer
/// levels by 1% at 4 bits, up to 40% at 8), so version 1's turbo codes decode otherwise.
pub const STATE_VERSION: u32 = 2;

/// Whether a state of `version` decodes as written: this version, or version 1 without
/// turbo layers (the one thing version 2 changed).
fn readable_version(state: &CacheState) -> bool {
    let turbo = |c: &Codec| matches!(c, Codec::Turbo { .. });
    state.version == STATE_VERSION
        || (state.version == 1
            && !state
                .layers
                .iter()
                .any(|l| turbo(&l.planes.codec) || l.target.as_ref().is_some_and(turbo)))
}

/// One layer cache as data.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerState {
    pub layer: usize,
    pub spec: LayerSpec,
    pub slack: usize,
    pub target: Option<Codec>,
    pub quantized_kv_start: usize,
    pub minimum_reusable_offset: Option<usize>,
    pub left_pad: Vec<usize>,
    pub ends: Vec<usize>,
    pub held_from: Vec<usize>,
    pub round: Option<Vec<usize>>,
    pub planes: PlanesState,
    /// The queries seen before the conversion (a layer awaiting one fits its TurboQuant key
    /// scales on them); empty otherwise.
    pub queries: QueryMoments,
}

/// A whole cache as data.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheState {
    pub version: u32,
    pub layers: Vec<LayerState>,
    pub left_pad: Vec<usize>,
    pub prefill: Option<Vec<usize>>,
}

impl LayerCache {
    pub fn state(&self) -> Result<LayerState, KvError> {
        Ok(LayerState {
            layer: self.layer,
            spec: self.spec,
            slack: self.slack,
            target: self.target,
            quantized_kv_start: self.start,
            minimum_reusable_offset: self.minimum_reusable_offset(),
            left_pad: self.rows.left_pad().to_vec(),
            ends: self.rows.ends(),
            held_from: self.rows.held_from().to_vec(),
            round: self.rows.round().map(<[usize]>::to_vec),
            planes: self.planes.state()?,
            queries: self.queries.clone(),
        })
    }

    /// The layer cache `state` describes, its planes where appends on `device` are stored.
    pub fn from_state(state: &LayerState, device: &Device) -> Result<LayerCache, KvError> {
        let rows = state.left_pad.len();
        let g = state.planes.geometry;
        let consistent = state.ends.len() == rows
            && state.held_from.len() == rows
            && state.round.as_ref().is_none_or(|r| r.len() == rows)
            && g.rows == rows
            && g.heads == state.spec.kv_heads
            && g.head_dim == state.spec.head_dim
            && g.value_dim == state.spec.value_dim;
        if !consistent {
            return Err(KvError::BadState(format!(
                "layer {}: rows, ends and planes disagree ({rows} rows, planes {g:?})",
                state.layer
            )));
        }
        check_rows(state)?;
        state
            .queries
            .check(rows, state.spec.kv_heads, state.spec.head_dim)
            .map_err(|e| KvError::BadState(format!("layer {}: {e}", state.layer)))?;
        if matches!(state.spec.retention, crate::Retention::Window { size: 0 })
            || state.spec.kv_heads == 0
            || state.spec.head_dim == 0
            || state.spec.value_dim == 0
        {
            return Err(KvError::BadState(format!(
                "layer {}: a layer of {:?}",
                state.layer, state.spec
            )));
        }
        let stage = state.planes.codec;
        for codec in [Some(stage), state.target].into_iter().flatten() {
            crate::layer::check_codec(state.layer, &state.spec, codec)?;
        }
        let staged = match state.target {
            None => !stage.is_quantized(),
            Some(t) => {
                t.is_quantized()
                    && (stage == t
                        || stage == Codec::Plain(PlainDType::Bf16)
                        || same_turbo(stage, t))
            }
        };
        if !staged {
            return Err(KvError::BadState(format!(
                "layer {}: planes of {stage} cannot be the storage of a layer converting to {}",
                state.layer,
                state
                    .target
                    .map_or("nothing".to_string(), |t| t.to_string())
            )));
        }
        let mut planes = planes_for(stage, g, device)?;
        planes.restore(&state.planes)?;
        // The state keeps one floor for the layer (every row's, in the one-row caches files
        // hold): each row gets it.
        let mut rows = Rows::from_parts(
            state.left_pad.clone(),
            state.ends.clone(),
            state.held_from.clone(),
            vec![state.minimum_reusable_offset; state.left_pad.len()],
        );
        rows.restore_round(state.round.clone());
        let slots = Slots::of(state.spec.retention, state.slack);
        if rows.width() > 0 && planes.capacity() < slots.capacity(rows.width()) {
            return Err(KvError::BadState(format!(
                "layer {}: {} slots cannot hold rows ending at {}",
                state.layer,
                planes.capacity(),
                rows.width()
            )));
        }
        Ok(LayerCache {
            layer: state.layer,
            spec: state.spec,
            slots,
            slack: state.slack,
            planes,
            rows,
            target: state.target,
            start: state.quantized_kv_start,
            bound: true,
            isa: Isa::detected(),
            queries: state.queries.clone(),
        })
    }
}

impl KvCache {
    pub fn state(&self) -> Result<CacheState, KvError> {
        Ok(CacheState {
            version: STATE_VERSION,
            layers: self
                .layers()
                .iter()
                .map(|l| l.state())
                .collect::<Result<_, _>>()?,
            left_pad: self.left_pad().to_vec(),
            prefill: self.prefill().map(<[usize]>::to_vec),
        })
    }

    /// The cache `state` describes, on `device`.
    pub fn from_state(state: &CacheState, device: &Device) -> Result<KvCache, KvError> {
        if !readable_version(state) {
            return Err(KvError::BadState(format!(
                "cache state version {} (this build reads version {STATE_VERSION}, and version 1 \
                 without turbo layers, whose codebooks have changed since)",
                state.version
            )));
        }
        let rows = state.left_pad.len();
        if let Some(l) = state.layers.iter().find(|l| l.left_pad != state.left_pad) {
            return Err(KvError::BadState(format!(
                "layer {}: left padding {:?}, the cache's {:?}",
                l.layer, l.left_pad, state.left_pad
            )));
        }
        if let Some((i, l)) = state.layers.iter().enumerate().find(|(i, l)| l.layer != *i) {
            return Err(KvError::BadState(format!(
                "the cache's layer {i} says it is layer {}",
                l.layer
            )));
        }
        if state.prefill.as_ref().is_some_and(|p| p.len() != rows) {
            return Err(KvError::BadState(format!(
                "a prefill of {:?} for {rows} rows",
                state.prefill
            )));
        }
        // Host layers are rebuilt in parallel (each copies its buffers into its planes);
        // device layers one after another, on the device's one stream, and so is every
        // layer where a backend is installed (it decides on the calling thread whether it
        // serves the CPU).
        let layers = if device.is_cpu() && !crate::planes::device::backend_installed() {
            use rayon::prelude::*;
            state
                .layers
                .par_iter()
                .map(|l| LayerCache::from_state(l, device))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            state
                .layers
                .iter()
                .map(|l| LayerCache::from_state(l, device))
                .collect::<Result<Vec<_>, _>>()?
        };
        let mut cache = KvCache::of_layers(layers, state.left_pad.clone());
        cache.set_prefill(state.prefill.clone());
        Ok(cache)
    }
}

/// Positions and slack past this are no cache a process holds (and would overflow the
/// slot arithmetic): a state claiming them is corrupt.
const MAX_POSITION: usize = 1 << 40;

/// Each row's padding, oldest held position, end and round start in order
/// (`left_pad, held_from ≤ end`, `left_pad ≤ round ≤ end`), a ring holding no more than
/// its slots, and sizes a cache can have.
fn check_rows(state: &LayerState) -> Result<(), KvError> {
    let window = match state.spec.retention {
        crate::Retention::Full => None,
        crate::Retention::Window { size } => Some(size),
    };
    if state.slack > MAX_POSITION || window.is_some_and(|w| w > MAX_POSITION) {
        return Err(KvError::BadState(format!(
            "layer {}: a window of {window:?} with slack {}",
            state.layer, state.slack
        )));
    }
    for r in 0..state.left_pad.len() {
        let (pad, held, end) = (state.left_pad[r], state.held_from[r], state.ends[r]);
        let round = state.round.as_ref().map(|round| round[r]);
        let ordered = pad <= end
            && held <= end
            && end <= MAX_POSITION
            && round.is_none_or(|s| pad <= s && s <= end)
            && window.is_none_or(|w| end - held.max(pad) <= w + state.slack);
        if !ordered {
            return Err(KvError::BadState(format!(
                "layer {}: row {r} has left padding {pad}, oldest position {held}, end {end}, round start {round:?}",
                state.layer
            )));
        }
    }
    Ok(())
}

/// Whether `stage` is turbo storage of `target`'s bit widths (its preparation is what was
/// fitted, which the target names too).
fn same_turbo(stage: Codec, target: Codec) -> bool {
    matches!(
        (stage, target),
        (Codec::Turbo { kbits: a, vbits: b, prep: p }, Codec::Turbo { kbits: c, vbits: d, prep: q })
            if a == c && b == d && p.pairs == q.pairs
    )
}
