//! tessera-models' decode-step graphs ([`tessera_models::step_graph`]) on CUDA: stream
//! capture of candle's stream, which carries the model's kernels and the cache's alike.
//! Each graph frees what it allocates (tessera-models copies a graph's outputs into
//! ordinary buffers inside it); instantiated to free at each launch anything a previous
//! launch left allocated all the same, so that a stray allocation cannot fail a replay.

use crate::greedy::Greedy;
use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, CudaStream};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{Device, Result, Tensor};
use std::sync::{Arc, Mutex};
use tessera_models::step_graph::{DeviceGraph, GraphBackend, HostIds};

/// Installs the CUDA graph backend into tessera-models (once per process).
pub fn install() {
    tessera_models::step_graph::install(Box::new(CudaGraphs::default()));
}

#[derive(Default)]
struct CudaGraphs {
    /// The greedy-token kernels, built for the first CUDA device a model loads on (or, at
    /// the latest, on first use).
    greedy: Mutex<Option<Arc<Greedy>>>,
}

impl CudaGraphs {
    /// The greedy kernels for `device`, compiled on the first call; `None` for a second
    /// device (they serve one).
    fn greedy(&self, device: &CudaDevice) -> Result<Option<Arc<Greedy>>> {
        let mut slot = self.greedy.lock().unwrap_or_else(|e| e.into_inner());
        Ok(match slot.as_ref() {
            Some(g) if g.serves(device) => Some(g.clone()),
            Some(_) => None,
            None => Some(slot.insert(Greedy::new(device)?).clone()),
        })
    }
}

fn stream(device: &Device) -> Result<Arc<CudaStream>> {
    match device {
        Device::Cuda(d) => Ok(d.cuda_stream()),
        _ => candle_core::bail!("CUDA graphs of a {:?} device", device.location()),
    }
}

impl GraphBackend for CudaGraphs {
    fn serves(&self, device: &Device) -> bool {
        matches!(device, Device::Cuda(_))
    }

    fn begin(&self, device: &Device) -> Result<()> {
        // Thread-local: only this thread's unsafe calls (a synchronous allocation, a
        // synchronization) break the capture; the server's other threads touch no GPU.
        stream(device)?
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(candle_core::Error::wrap)
    }

    fn cache_uploads(&self, device: &Device) -> Box<dyn std::any::Any> {
        // candle's own cache: while enabled (on this thread), a kernel's dims-and-strides
        // upload is looked up by content, and one missing during a capture fails it
        // rather than recording a copy from host memory freed right after. Without it,
        // steps of more than one row (whose q, k and v are strided views of one
        // projection) replayed copies from freed memory: the illegal addresses of the
        // many-row-count runs.
        match device {
            Device::Cuda(d) => Box::new(d.enable_cuda_graph_htod_cache()),
            _ => Box::new(()),
        }
    }

    fn greedy_ids(&self, logits: &Tensor) -> Result<Option<(Tensor, Box<dyn HostIds>)>> {
        let Device::Cuda(device) = logits.device() else {
            return Ok(None);
        };
        let Some(greedy) = self.greedy(device)? else {
            return Ok(None);
        };
        greedy.ids(logits).map(Some)
    }

    fn prepare(&self, device: &Device) -> Result<()> {
        // NVRTC and the driver's JIT took tens of milliseconds here; on the first decode step
        // that stalled the step (and showed in `generate`'s decode rate).
        match device {
            Device::Cuda(d) => self.greedy(d).map(|_| ()),
            _ => Ok(()),
        }
    }

    fn end(&self, device: &Device) -> Result<Box<dyn DeviceGraph>> {
        let graph = stream(device)?
            .end_capture(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .map_err(candle_core::Error::wrap)?
            .ok_or_else(|| candle_core::Error::Msg("the capture recorded no graph".into()))?;
        Ok(Box::new(Graph(graph)))
    }
}

struct Graph(CudaGraph);

// SAFETY: a graph is used by one thread at a time (the decoder keeps its graphs behind a
// mutex); the driver's graph objects are not tied to the thread that made them.
unsafe impl Send for Graph {}

impl DeviceGraph for Graph {
    fn launch(&self) -> Result<()> {
        self.0.launch().map_err(candle_core::Error::wrap)
    }
}
