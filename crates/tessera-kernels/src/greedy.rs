//! A decode step's greedy tokens picked on the device (greedy.cu) and their copy to the
//! host queued at once into page-locked memory (tessera-models'
//! [`GraphBackend::greedy_ids`]): the ids stay on the device as the next step's input, so
//! the engine can queue that step before it waits for these tokens, and the GPU does not
//! idle while the host reads them, emits them and prepares the step.
//!
//! [`GraphBackend::greedy_ids`]: tessera_models::step_graph::GraphBackend::greedy_ids

use crate::GREEDY_CU;
use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaEvent, CudaFunction, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Result, Storage, Tensor};
use std::sync::{Arc, Mutex};
use tessera_models::step_graph::HostIds;

/// greedy.cu's CHUNKS and THREADS.
const CHUNKS: usize = 128;
const THREADS: u32 = 256;

fn error(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("greedy tokens on the device: {e}"))
}

/// The kernels for one device, and page-locked buffers for the copies, reused.
pub(crate) struct Greedy {
    device: CudaDevice,
    chunks: CudaFunction,
    rows: CudaFunction,
    buffers: Mutex<Vec<PinnedHostSlice<u32>>>,
}

impl Greedy {
    pub(crate) fn new(device: &CudaDevice) -> Result<Arc<Self>> {
        let module =
            crate::compile::load(device.cuda_stream().context(), GREEDY_CU).map_err(error)?;
        Ok(Arc::new(Greedy {
            device: device.clone(),
            chunks: module.load_function("greedy_chunks").map_err(error)?,
            rows: module.load_function("greedy_rows").map_err(error)?,
            buffers: Mutex::new(Vec::new()),
        }))
    }

    pub(crate) fn serves(&self, device: &CudaDevice) -> bool {
        self.device.same_device(device)
    }

    /// Each row's greedy token of `logits` ((rows, vocab) f32 on this device), as (rows, 1)
    /// u32 there, and the copy of them to the host, queued on candle's stream.
    pub(crate) fn ids(self: &Arc<Self>, logits: &Tensor) -> Result<(Tensor, Box<dyn HostIds>)> {
        let (rows, vocab) = logits.dims2()?;
        if logits.dtype() != DType::F32 || rows == 0 || vocab == 0 {
            candle_core::bail!(
                "greedy tokens of {:?} logits {rows}×{vocab}",
                logits.dtype()
            );
        }
        let logits = logits.contiguous()?;
        let stream = self.device.cuda_stream();
        let (storage, layout) = logits.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            candle_core::bail!(
                "greedy tokens of logits on {:?}",
                logits.device().location()
            );
        };
        let start = layout.start_offset();
        let all = s.as_cuda_slice::<f32>()?;
        let input = all.slice(start..start + rows * vocab);
        // SAFETY: greedy_chunks writes every (row, chunk) entry, greedy_rows every id.
        let (mut best, mut at, mut ids) = unsafe {
            (
                stream.alloc::<f32>(rows * CHUNKS).map_err(error)?,
                stream.alloc::<i32>(rows * CHUNKS).map_err(error)?,
                stream.alloc::<u32>(rows).map_err(error)?,
            )
        };
        let v = vocab as i32;
        let mut l = stream.launch_builder(&self.chunks);
        l.arg(&input).arg(&mut best).arg(&mut at).arg(&v);
        let cfg = LaunchConfig {
            grid_dim: (CHUNKS as u32, rows as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: input holds rows × vocab floats, best and at rows × CHUNKS entries.
        unsafe { l.launch(cfg) }.map_err(error)?;
        let mut l = stream.launch_builder(&self.rows);
        l.arg(&input).arg(&best).arg(&at).arg(&mut ids).arg(&v);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; ids holds rows entries.
        unsafe { l.launch(cfg) }.map_err(error)?;
        drop(storage);
        // The copy spans the whole buffer (cudarc copies the destination's length), so
        // buffers are exactly one id a row. Its completion is this event's: a page-locked
        // buffer's own event is recorded only where cudarc tracks synchronization, which
        // candle turns off.
        let mut host = self.buffer(rows)?;
        stream.memcpy_dtoh(&ids, &mut host).map_err(error)?;
        let copied = stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(error)?;
        let device_ids = Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(ids, self.device.clone())),
            (rows, 1),
            BackpropOp::none(),
            false,
        );
        Ok((
            device_ids,
            Box::new(Pending {
                host: Some(host),
                copied,
                owner: self.clone(),
            }),
        ))
    }

    /// A page-locked buffer of `rows` ids: a returned one, else a new one.
    fn buffer(&self, rows: usize) -> Result<PinnedHostSlice<u32>> {
        let mut free = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = free.iter().position(|b| b.len() == rows) {
            return Ok(free.swap_remove(at));
        }
        drop(free);
        let ctx = self.device.cuda_stream().context().clone();
        // SAFETY: read only after the copy into it (`Pending::copied`).
        unsafe { ctx.alloc_pinned_with_flags::<u32>(rows, 0) }.map_err(error)
    }
}

/// One step's ids on their way to the host.
struct Pending {
    host: Option<PinnedHostSlice<u32>>,
    /// Recorded behind the copy.
    copied: CudaEvent,
    owner: Arc<Greedy>,
}

impl HostIds for Pending {
    fn wait(self: Box<Self>) -> Result<Vec<u32>> {
        self.copied.synchronize().map_err(error)?;
        let host = self
            .host
            .as_ref()
            .ok_or_else(|| error("the ids were already read"))?;
        Ok(host.as_slice().map_err(error)?.to_vec())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(host) = self.host.take() {
            let mut free = self.owner.buffers.lock().unwrap_or_else(|e| e.into_inner());
            free.push(host);
        }
    }
}
