//! Whole decode steps captured with the cache's work (`decoder/live.rs`, tessera-kv's
//! `live.rs`), on the CPU: an emulated device backend whose planes keep each row's write
//! slot and read span apart from the cache's host bookkeeping (as device memory would)
//! and run a live step from them alone (each row written at its slot, read over its span,
//! every slot advanced), and a stand-in graph backend whose captures run the work as it is
//! queued. A live step must give exactly the eager step's logits, also when it is run more
//! than once (the capture's warm-up, the capture itself, the run after a refused capture,
//! each after a rewind); the emulated positions must end where the cache's rows do; a layer
//! that cannot take live steps (Gemma 3's sliding rings) keeps every step off that path.
//! A replay is a launch the stand-in only counts: the GPU's replays are checked against
//! eager steps by `bench/device-run.sh graphcheck` (tokens digests) on the device.

use candle_core::{Device, Result, Tensor};
use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use tessera_kv::planes::{
    host_planes, ChunkGeometry, DeviceBackend, PlaneGeometry, Planes, PlanesState, RowSlots,
};
use tessera_kv::{Codec, Isa, KvCache, KvError, TurboPrep};
use tessera_models::step_graph::{install, DeviceGraph, GraphBackend};
use tessera_models::{LoadOptions, Model};

mod common;
use common::{greedy_steps, synthesized, Dir};

static LIVE_STEPS: AtomicUsize = AtomicUsize::new(0);
static BEGINS: AtomicUsize = AtomicUsize::new(0);
static LAUNCHES: AtomicUsize = AtomicUsize::new(0);
static REFUSE: AtomicBool = AtomicBool::new(true);
/// Captures refused first, even with `REFUSE` off.
static REFUSE_FIRST: AtomicUsize = AtomicUsize::new(0);
static GENERATION: AtomicU64 = AtomicU64::new(1);

/// Captures run the work as it is queued; ending one is refused while `REFUSE` is set, and
/// the first `REFUSE_FIRST` otherwise.
struct StandIn;

struct Counted;

impl DeviceGraph for Counted {
    fn launch(&self) -> Result<()> {
        LAUNCHES.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl GraphBackend for StandIn {
    fn serves(&self, device: &Device) -> bool {
        device.is_cpu()
    }
    fn begin(&self, _: &Device) -> Result<()> {
        BEGINS.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn end(&self, _: &Device) -> Result<Box<dyn DeviceGraph>> {
        let first = REFUSE_FIRST
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if first || REFUSE.load(Ordering::SeqCst) {
            candle_core::bail!("refused by the stand-in");
        }
        Ok(Box::new(Counted))
    }
}

struct Emulated;

impl DeviceBackend for Emulated {
    fn planes(
        &self,
        codec: Codec,
        geometry: PlaneGeometry,
        _: &Device,
    ) -> std::result::Result<Option<Box<dyn Planes>>, KvError> {
        Ok(Some(Box::new(LivePlanes::new(host_planes(
            codec, geometry,
        )))))
    }
}

/// Host planes behind the trait, with a live step's positions kept apart: `device` is what
/// device memory would hold, `sets` what the last `live_spans` set.
#[derive(Debug)]
struct LivePlanes {
    inner: Box<dyn Planes>,
    device: Vec<(usize, usize)>,
    sets: Vec<(usize, usize)>,
    generation: u64,
}

impl LivePlanes {
    fn new(inner: Box<dyn Planes>) -> Self {
        LivePlanes {
            inner,
            device: Vec::new(),
            sets: Vec::new(),
            generation: GENERATION.fetch_add(1, Ordering::SeqCst),
        }
    }
}

fn unwrap(src: &dyn Planes) -> &dyn Planes {
    match src.as_any().downcast_ref::<LivePlanes>() {
        Some(p) => p.inner.as_ref(),
        None => src,
    }
}

type Kv<T> = std::result::Result<T, KvError>;

impl Planes for LivePlanes {
    fn codec(&self) -> Codec {
        self.inner.codec()
    }
    fn geometry(&self) -> PlaneGeometry {
        self.inner.geometry()
    }
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }
    fn empty(&self, rows: usize) -> Kv<Box<dyn Planes>> {
        Ok(Box::new(LivePlanes::new(self.inner.empty(rows)?)))
    }
    fn reserve(&mut self, slots: usize, limit: usize) -> Kv<()> {
        if slots > self.inner.capacity() {
            self.generation = GENERATION.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.reserve(slots, limit)
    }
    fn write(&mut self, rows: Range<usize>, slot: usize, k: &Tensor, v: &Tensor) -> Kv<()> {
        self.inner.write(rows, slot, k, v)
    }
    fn read(&self, rows: Range<usize>, slot: usize, len: usize) -> Kv<(Tensor, Tensor)> {
        self.inner.read(rows, slot, len)
    }
    fn adopt_row(&mut self, src: &dyn Planes, src_row: usize, dst_row: usize) -> Kv<()> {
        self.inner.adopt_row(unwrap(src), src_row, dst_row)
    }
    fn copy_from(
        &mut self,
        src: &dyn Planes,
        src_row: usize,
        src_slot: usize,
        dst_row: usize,
        dst_slot: usize,
        len: usize,
    ) -> Kv<()> {
        self.inner
            .copy_from(unwrap(src), src_row, src_slot, dst_row, dst_slot, len)
    }
    fn fit_key_prep(
        &mut self,
        k: &Tensor,
        live: &[Range<usize>],
        prep: TurboPrep,
        queries: Option<&[f32]>,
    ) -> Kv<()> {
        self.inner.fit_key_prep(k, live, prep, queries)
    }
    fn decode(&self, q: &Tensor, rows: &[RowSlots], scale: f32, isa: Isa) -> Kv<Option<Tensor>> {
        self.inner.decode(q, rows, scale, isa)
    }
    fn chunk(
        &self,
        q: &Tensor,
        geometry: &ChunkGeometry,
        scale: f32,
        isa: Isa,
    ) -> Kv<Option<Tensor>> {
        self.inner.chunk(q, geometry, scale, isa)
    }
    fn serves_live(&self) -> bool {
        true
    }
    fn live_identity(&self, spans: &[(usize, usize)], _: usize) -> Option<u64> {
        spans
            .iter()
            .all(|&(a, s)| a <= s && s < self.capacity())
            .then_some(self.generation)
    }
    fn live_spans(&mut self, spans: &[(usize, usize)], heads: usize) -> Kv<u64> {
        let identity = self
            .live_identity(spans, heads)
            .ok_or_else(|| KvError::Device(format!("live spans {spans:?}")))?;
        if self.device != spans {
            self.device = spans.to_vec();
        }
        self.sets = spans.to_vec();
        Ok(identity)
    }
    fn live_rewind(&mut self) -> Kv<()> {
        self.device = self.sets.clone();
        Ok(())
    }
    fn live_step(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Kv<Tensor> {
        LIVE_STEPS.fetch_add(1, Ordering::SeqCst);
        for (r, &(_, slot)) in self.device.iter().enumerate() {
            let (kr, vr) = (k.narrow(0, r, 1)?, v.narrow(0, r, 1)?);
            self.inner.write(r..r + 1, slot, &kr, &vr)?;
        }
        let rows: Vec<RowSlots> = self
            .device
            .iter()
            .map(|&(a, s)| RowSlots {
                ranges: vec![a..s + 1],
                // Live steps serve full-attention layers: every row sees its positions from 0.
                first_position: 0,
            })
            .collect();
        let out = self
            .inner
            .decode(q, &rows, scale, Isa::detected())?
            .ok_or_else(|| KvError::Device("no fused decode on the host".into()))?;
        for span in &mut self.device {
            span.1 += 1;
        }
        Ok(out)
    }
    fn allocated_bytes(&self) -> usize {
        self.inner.allocated_bytes()
    }
    fn bytes_per_position(&self) -> usize {
        self.inner.bytes_per_position()
    }
    fn state(&self) -> Kv<PlanesState> {
        self.inner.state()
    }
    fn restore(&mut self, state: &PlanesState) -> Kv<()> {
        self.generation = GENERATION.fetch_add(1, Ordering::SeqCst);
        self.inner.restore(state)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Where every layer's emulated device positions stand against its rows' ends.
fn device_positions_follow_rows(cache: &KvCache) -> bool {
    cache.layers().iter().all(|layer| {
        let planes = layer.planes().as_any().downcast_ref::<LivePlanes>();
        let ends = layer.rows().ends();
        planes.is_some_and(|p| p.device.iter().map(|s| s.1).eq(ends.iter().copied()))
    })
}

#[test]
fn live_steps_compute_the_eager_step_wherever_they_run() {
    install(Box::new(StandIn));
    tessera_kv::planes::install(Box::new(Emulated));
    let dir = Dir::new("live-step");
    let prompt: Vec<u32> = (0..20).map(|i| 300 + 7 * i).collect();
    let steps = 12;
    // tiny-256: head_dim 64, room for affine's groups.
    for (arch, preset, scheme, rows) in [
        ("llama", "tiny", "bf16", 1),
        ("llama", "tiny-256", "affine:4", 3),
        ("qwen2", "tiny-256", "bf16", 2),
        ("gemma3", "tiny", "bf16", 1),
    ] {
        let what = format!("{arch} {preset} {scheme} ×{rows}");
        let path = synthesized(&dir.0, arch, preset);
        let (model, _) = Model::load(&path, &LoadOptions::default(), &Device::Cpu).unwrap();
        model.set_step_graphs(false);
        let (eager, _) = greedy_steps(&model, scheme, &prompt, steps, rows);
        assert_eq!(LIVE_STEPS.load(Ordering::SeqCst), 0, "{what}: graphs off");

        // Every capture refused: per-layer graphs refused on the first step (their row
        // count then runs eagerly); on the 8th step of one cache identity a live step is
        // captured: run, rewound, run by the capture, refused, rewound and run again.
        REFUSE.store(true, Ordering::SeqCst);
        model.set_step_graphs(true);
        let (refused, cache) = greedy_steps(&model, scheme, &prompt, 8, rows);
        assert_eq!(
            refused,
            eager[..8],
            "{what}: steps with live work run three times"
        );
        let layers = model.layer_specs().len();
        let live = LIVE_STEPS.swap(0, Ordering::SeqCst);
        if arch == "gemma3" {
            assert_eq!(live, 0, "{what}: sliding layers take no live step");
            continue;
        }
        assert_eq!(live, 3 * layers, "{what}: one live step, run three times");
        assert!(
            device_positions_follow_rows(&cache),
            "{what}: the device's positions end where the rows do"
        );
        // A refused identity is not captured again: a new cache's (its own buffers) is
        // tried once, on its 8th step, and steps 9 to 12 run eagerly.
        let (again, _) = greedy_steps(&model, scheme, &prompt, steps, rows);
        assert_eq!(again, eager, "{what}: after a refused live capture");
        assert_eq!(
            LIVE_STEPS.swap(0, Ordering::SeqCst),
            3 * layers,
            "{what}: refused once"
        );

        // The per-layer graphs refused, the live capture accepted: the capturing step (run,
        // rewound, run by the capture, launched) gives the eager step's logits, from the
        // run the graph recorded.
        REFUSE.store(false, Ordering::SeqCst);
        REFUSE_FIRST.store(layers + 1, Ordering::SeqCst);
        model.set_step_graphs(true);
        let launches = LAUNCHES.load(Ordering::SeqCst);
        let (accepted, cache) = greedy_steps(&model, scheme, &prompt, 8, rows);
        assert_eq!(accepted, eager[..8], "{what}: the capturing step");
        assert_eq!(
            LAUNCHES.load(Ordering::SeqCst) - launches,
            1,
            "{what}: launched"
        );
        assert_eq!(LIVE_STEPS.swap(0, Ordering::SeqCst), 2 * layers, "{what}");
        assert!(
            device_positions_follow_rows(&cache),
            "{what}: after a capture"
        );
        // A new cache: captured again on its 8th step, replayed on its 9th (the stand-in's
        // replay runs nothing, so only counts).
        let launches = LAUNCHES.load(Ordering::SeqCst);
        greedy_steps(&model, scheme, &prompt, 9, rows);
        assert_eq!(
            LAUNCHES.load(Ordering::SeqCst) - launches,
            2,
            "{what}: a replay"
        );
        assert_eq!(LIVE_STEPS.swap(0, Ordering::SeqCst), 2 * layers, "{what}");
        model.set_step_graphs(false);
    }
    assert!(BEGINS.load(Ordering::SeqCst) > 0);
}
