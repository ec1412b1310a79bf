//! The decode step's graph path (`step_graph`, `decoder/graphed.rs`) on the CPU, through a
//! stand-in backend: capturing runs the work as it is queued (the CPU has no capture), so
//! the step that captures must give exactly the eager step's logits, part by part wired as
//! the eager walk and each part's outputs copied into buffers of their own (one row, and
//! three, whose q and k are strided views); a backend that refuses every capture must leave every step exactly as
//! eager and be asked once per row count (so must one whose captures cannot begin); a
//! replay launches every graph of the step; every capture begins with the backend's upload
//! cache on; a model loaded on a device the backend serves has it prepare that device once
//! (the CUDA backend compiles its greedy kernels there, not in the first step).
//! The GPU's replays are checked against eager steps by `tessera bench --graph-probe`.

use candle_core::{Device, Result};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use tessera_models::step_graph::{install, DeviceGraph, GraphBackend};

mod common;
use common::{greedy_steps, tiny, Dir};
use tessera_models::{LoadOptions, Model};

#[derive(Default)]
struct Counts {
    serving: AtomicBool,
    refuse: AtomicBool,
    refuse_begin: AtomicBool,
    begins: AtomicUsize,
    ends: AtomicUsize,
    /// Upload caches alive ([`GraphBackend::cache_uploads`]), and captures begun outside one.
    caching: Arc<AtomicUsize>,
    uncached_begins: AtomicUsize,
    launches: Arc<AtomicUsize>,
    prepares: AtomicUsize,
}

struct StandIn(Arc<Counts>);

struct Counted(Arc<AtomicUsize>);

/// The stand-in's upload cache: counted while alive.
struct Caching(Arc<AtomicUsize>);

impl Drop for Caching {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl DeviceGraph for Counted {
    fn launch(&self) -> Result<()> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl GraphBackend for StandIn {
    fn serves(&self, device: &Device) -> bool {
        device.is_cpu() && self.0.serving.load(Ordering::SeqCst)
    }
    fn begin(&self, _: &Device) -> Result<()> {
        self.0.begins.fetch_add(1, Ordering::SeqCst);
        if self.0.caching.load(Ordering::SeqCst) == 0 {
            self.0.uncached_begins.fetch_add(1, Ordering::SeqCst);
        }
        if self.0.refuse_begin.load(Ordering::SeqCst) {
            candle_core::bail!("no capture begins in the stand-in");
        }
        Ok(())
    }
    fn cache_uploads(&self, _: &Device) -> Box<dyn std::any::Any> {
        self.0.caching.fetch_add(1, Ordering::SeqCst);
        Box::new(Caching(self.0.caching.clone()))
    }
    fn end(&self, _: &Device) -> Result<Box<dyn DeviceGraph>> {
        self.0.ends.fetch_add(1, Ordering::SeqCst);
        if self.0.refuse.load(Ordering::SeqCst) {
            candle_core::bail!("refused by the stand-in");
        }
        Ok(Box::new(Counted(self.0.launches.clone())))
    }
    fn prepare(&self, device: &Device) -> Result<()> {
        assert!(
            device.is_cpu(),
            "prepared a device the stand-in does not serve"
        );
        self.0.prepares.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// `steps` decode steps after a prefill of `prompt`, on a fresh cache: each step's logits.
fn decode(model: &Model, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    decode_rows(model, prompt, steps, 1)
}

/// The same for `rows` rows at once (row `r`'s prompt shifted by `r` in the vocabulary):
/// each step's logits, all rows'. Past one row, q and k are strided views of one
/// projection, so a graph's outputs are copied out of views.
fn decode_rows(model: &Model, prompt: &[u32], steps: usize, rows: usize) -> Vec<Vec<f32>> {
    greedy_steps(model, "bf16", prompt, steps, rows).0
}

#[test]
fn graph_path_computes_the_eager_step_and_falls_back_on_a_refused_capture() {
    let counts = Arc::new(Counts::default());
    install(Box::new(StandIn(counts.clone())));
    let dir = Dir::new("step-graph");
    // Llama: one RoPE table; Gemma 3: two (sliding and global layers) and post-norms.
    for arch in ["llama", "gemma3"] {
        let path = tiny(&dir.0, arch);
        // Prepared once a model loads on a device the backend serves, and only then.
        counts.serving.store(false, Ordering::SeqCst);
        let prepared = counts.prepares.load(Ordering::SeqCst);
        drop(Model::load(&path, &LoadOptions::default(), &Device::Cpu).unwrap());
        assert_eq!(
            counts.prepares.load(Ordering::SeqCst),
            prepared,
            "{arch}: not served"
        );
        counts.serving.store(true, Ordering::SeqCst);
        let (model, _) = Model::load(&path, &LoadOptions::default(), &Device::Cpu).unwrap();
        assert_eq!(
            counts.prepares.load(Ordering::SeqCst),
            prepared + 1,
            "{arch}: served"
        );
        let Model::Decoder(d) = &model;
        let parts = d.config().layers + 1;
        let prompt: Vec<u32> = (0..20).map(|i| 300 + 7 * i).collect();

        counts.serving.store(false, Ordering::SeqCst);
        let eager = decode(&model, &prompt, 4);
        assert_eq!(
            counts.begins.load(Ordering::SeqCst),
            0,
            "{arch}: no backend served"
        );

        // Every capture refused: the first step tries each part once and runs it eagerly;
        // the row count then stays eager.
        counts.serving.store(true, Ordering::SeqCst);
        counts.refuse.store(true, Ordering::SeqCst);
        model.set_step_graphs(true);
        let refused = decode(&model, &prompt, 4);
        assert_eq!(refused, eager, "{arch}: steps after refused captures");
        assert_eq!(
            counts.begins.load(Ordering::SeqCst),
            parts,
            "{arch}: captures tried"
        );
        assert_eq!(
            counts.ends.load(Ordering::SeqCst),
            parts,
            "{arch}: captures ended"
        );
        assert_eq!(counts.launches.load(Ordering::SeqCst), 0, "{arch}");

        // A capture that cannot begin: the same, with no capture to end.
        counts.refuse_begin.store(true, Ordering::SeqCst);
        model.set_step_graphs(true);
        assert_eq!(
            decode(&model, &prompt, 2),
            eager[..2],
            "{arch}: no capture begun"
        );
        assert_eq!(counts.begins.load(Ordering::SeqCst), 2 * parts, "{arch}");
        assert_eq!(counts.ends.load(Ordering::SeqCst), parts, "{arch}");
        counts.refuse_begin.store(false, Ordering::SeqCst);
        counts.begins.store(parts, Ordering::SeqCst);

        // Captures accepted: the capturing step is the eager step exactly, each part's
        // graph launched once; the next step replays every graph and captures nothing.
        counts.refuse.store(false, Ordering::SeqCst);
        model.set_step_graphs(true);
        let captured = decode(&model, &prompt, 1);
        assert_eq!(captured[0], eager[0], "{arch}: the capturing step");
        assert_eq!(counts.begins.load(Ordering::SeqCst), 2 * parts, "{arch}");
        assert_eq!(counts.launches.load(Ordering::SeqCst), parts, "{arch}");
        decode(&model, &prompt, 1);
        assert_eq!(
            counts.begins.load(Ordering::SeqCst),
            2 * parts,
            "{arch}: a replay"
        );
        assert_eq!(
            counts.launches.load(Ordering::SeqCst),
            2 * parts,
            "{arch}: a replay"
        );

        // Three rows: the capturing step is the eager step exactly, its outputs copied out
        // of strided views; one more row count's parts captured.
        model.set_step_graphs(false);
        let eager3 = decode_rows(&model, &prompt, 1, 3);
        model.set_step_graphs(true);
        assert_eq!(
            decode_rows(&model, &prompt, 1, 3),
            eager3,
            "{arch}: the capturing step of 3 rows"
        );
        assert_eq!(counts.begins.load(Ordering::SeqCst), 3 * parts, "{arch}");

        // Every capture began with the upload cache on, and none is left on.
        assert_eq!(counts.uncached_begins.load(Ordering::SeqCst), 0, "{arch}");
        assert_eq!(counts.caching.load(Ordering::SeqCst), 0, "{arch}");

        // Off, nothing is asked of the backend.
        model.set_step_graphs(false);
        assert_eq!(decode(&model, &prompt, 2), eager[..2], "{arch}: graphs off");
        assert_eq!(counts.begins.load(Ordering::SeqCst), 3 * parts, "{arch}");
        counts.begins.store(0, Ordering::SeqCst);
        counts.ends.store(0, Ordering::SeqCst);
        counts.launches.store(0, Ordering::SeqCst);
    }
}
