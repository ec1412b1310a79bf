//! Decode steps replayed as device graphs. A decode step's launches are the host's cost at
//! small batches (≈ 390 for an 8B model, 5–7 µs each); everything in the step but the KV
//! cache's work depends only on the batch's row count, so it is captured once per row
//! count and replayed. The cache's appends and reads stay eager between the graphs: the
//! step is one graph per layer boundary (the previous layer's output projection and MLP,
//! then this layer's norm, projections and RoPE), with the layer's cache work between.
//!
//! Inputs a step changes (the ids' embeddings, the RoPE tables) are copied into buffers
//! the graphs captured, and so is each layer's attention read. What a graph hands on (to
//! the cache's work, to the next graph) is copied, inside the graph, into ordinary buffers
//! made before the capture ([`GraphOutput`]), so every allocation a graph makes is freed in
//! that same graph: the driver may then share the graphs' memory among them, and nothing of
//! a graph's memory outlives its launch (compute-sanitizer's memcheck reported writes past
//! the allocations it knew when graph outputs stayed in graph memory between launches).
//! tessera-models defines the interface and stays CPU-only; tessera-kernels (feature
//! `cuda`) implements it ([`install`]).

use candle_core::{Device, Result, Tensor};
use std::sync::OnceLock;

/// Captures the work queued on a device's stream by this thread into graphs.
pub trait GraphBackend: Send + Sync {
    /// Whether this backend captures `device`'s work.
    fn serves(&self, device: &Device) -> bool;
    /// Starts capturing `device`'s stream: its work is recorded, not run.
    fn begin(&self, device: &Device) -> Result<()>;
    /// Ends the capture begun on `device` and instantiates what it recorded. Called after
    /// every [`Self::begin`], also when the work in between failed.
    fn end(&self, device: &Device) -> Result<Box<dyn DeviceGraph>>;
    /// While the returned guard lives, the small host-to-device uploads of kernel
    /// parameters that this thread's work on `device` makes (a strided tensor's dims and
    /// strides) come from a cache of device buffers that outlive the graphs, filled
    /// outside a capture: a captured upload would read its host buffer again at every
    /// replay, long after it was freed. Nothing to do where work uploads nothing.
    fn cache_uploads(&self, device: &Device) -> Box<dyn std::any::Any> {
        let _ = device;
        Box::new(())
    }
    /// Each row's greedy token of `logits` ((rows, vocab) f32 on a device this backend
    /// serves), picked on the device by the engine's greedy rule (the first index of the
    /// largest value; a NaN never wins, a row that starts with one gives 0), as (rows, 1)
    /// u32 there, with their copy to the host queued behind them: a caller can queue the
    /// next step on the device ids before it waits for the host's. `None` where the backend
    /// does not pick tokens (the caller picks them from the logits).
    fn greedy_ids(&self, logits: &Tensor) -> Result<Option<(Tensor, Box<dyn HostIds>)>> {
        let _ = logits;
        Ok(None)
    }
    /// Builds ahead what the first decode step on `device` would otherwise build (kernels
    /// compiled at run time), so that no step waits on a compiler. Called once a model is
    /// loaded there.
    fn prepare(&self, device: &Device) -> Result<()> {
        let _ = device;
        Ok(())
    }
}

/// Token ids on their way from the device to the host ([`GraphBackend::greedy_ids`]).
pub trait HostIds: Send {
    /// Waits for the copy; the ids, one a row.
    fn wait(self: Box<Self>) -> Result<Vec<u32>>;
}

/// An instantiated graph.
pub trait DeviceGraph: Send {
    /// Queues the graph on the stream it was captured on.
    fn launch(&self) -> Result<()>;
}

static BACKEND: OnceLock<Box<dyn GraphBackend>> = OnceLock::new();

/// Installs the process's graph backend; a second call keeps the first.
pub fn install(backend: Box<dyn GraphBackend>) {
    let _ = BACKEND.set(backend);
}

/// The installed backend, where it serves `device`.
pub(crate) fn backend(device: &Device) -> Option<&'static dyn GraphBackend> {
    BACKEND
        .get()
        .map(|b| b.as_ref())
        .filter(|b| b.serves(device))
}

/// [`GraphBackend::prepare`] of the installed backend, where it serves `device`.
pub(crate) fn prepare(device: &Device) -> Result<()> {
    backend(device).map_or(Ok(()), |b| b.prepare(device))
}

/// What a captured part hands on: tensors that must outlive the graph's own memory.
pub(crate) trait GraphOutput: Sized {
    /// Every tensor, in a fixed order.
    fn tensors(&self) -> Vec<&Tensor>;
    /// The same structure, each tensor replaced by `f` of it (in [`Self::tensors`]' order).
    fn map(&self, f: &mut dyn FnMut(&Tensor) -> Result<Tensor>) -> Result<Self>;
}

impl GraphOutput for Tensor {
    fn tensors(&self) -> Vec<&Tensor> {
        vec![self]
    }
    fn map(&self, f: &mut dyn FnMut(&Tensor) -> Result<Tensor>) -> Result<Self> {
        f(self)
    }
}

impl<A: GraphOutput, B: GraphOutput> GraphOutput for (A, B) {
    fn tensors(&self) -> Vec<&Tensor> {
        let mut all = self.0.tensors();
        all.extend(self.1.tensors());
        all
    }
    fn map(&self, f: &mut dyn FnMut(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok((self.0.map(f)?, self.1.map(f)?))
    }
}

/// `f`'s work captured as a graph and launched once (so its outputs hold values); where the
/// capture cannot begin or fails, `f` runs (again) as ordinary launches and no graph is
/// returned. `f` runs once before the capture too, with uploads cached
/// ([`GraphBackend::cache_uploads`]), so that the captured work finds every parameter it
/// uploads already on the device; its outputs' shapes size the buffers, in ordinary memory,
/// that the graph copies its outputs into before freeing all it allocated. `f` must only
/// queue device work (no cache state, nothing read back), so running it twice is only time.
pub(crate) fn captured<T: GraphOutput>(
    backend: &dyn GraphBackend,
    device: &Device,
    f: impl Fn() -> Result<T>,
) -> Result<(T, Option<Box<dyn DeviceGraph>>)> {
    let _uploads = backend.cache_uploads(device);
    // The warm-up, whose outputs are freed before the capture begins (a free recorded in a
    // graph must be of the graph's own memory).
    let copy_out = |homes: &T, out: &T| -> Result<()> {
        for (home, t) in homes.tensors().into_iter().zip(out.tensors()) {
            copy_into(home, t)?;
        }
        Ok(())
    };
    let homes = {
        let warm = f()?;
        let homes = warm.map(&mut |t| Tensor::zeros(t.dims(), t.dtype(), t.device()))?;
        // The copies upload their strided sources' parameters too.
        copy_out(&homes, &warm)?;
        homes
    };
    if backend.begin(device).is_err() {
        return Ok((f()?, None));
    }
    let out = f().and_then(|out| copy_out(&homes, &out));
    let graph = backend.end(device);
    match (out, graph) {
        (Ok(()), Ok(graph)) => {
            graph.launch()?;
            Ok((homes, Some(graph)))
        }
        _ => Ok((f()?, None)),
    }
}

/// An in-place copy of `src` into `dst` (same shape and type, both contiguous).
pub(crate) fn copy_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.dims() != src.dims() {
        candle_core::bail!(
            "a step graph's input {:?} given {:?}",
            dst.dims(),
            src.dims()
        );
    }
    dst.slice_set(&src.contiguous()?, 0, 0)
}
