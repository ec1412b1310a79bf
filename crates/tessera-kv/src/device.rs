//! Device-resident planes: the hook through which a GPU backend keeps a layer's keys and
//! values on its device and runs the fused reads there. tessera-kv defines the interface
//! and stays CPU-only; tessera-kernels (feature `cuda`) implements it and is installed once
//! per process with [`install`]. A layer cache whose appends arrive on a non-CPU device
//! stores them in the installed backend's planes; the retention policy, the bf16-first
//! transition and the named reads stay the cache's own.

use crate::{Codec, KvError, TurboPrep};
use candle_core::{Device, Tensor};
use std::sync::OnceLock;

/// One layer's keys and values on a device, in one codec, `(rows, heads, capacity, dim)`.
pub trait DevicePlanes: std::fmt::Debug + Send + Sync {
    fn codec(&self) -> Codec;
    fn capacity(&self) -> usize;
    /// Makes room for `slots` slots (growing in [`crate::GROWTH_STEP`] steps, never past
    /// `limit`), keeping the contents.
    fn reserve(&mut self, slots: usize, limit: usize) -> Result<(), KvError>;
    /// Encodes `k`, `v` `(rows, heads, n, dim)` into slots `slot .. slot + n`.
    fn write(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<(), KvError>;
    /// Slots `slot .. slot + len` decoded to f32 `(rows, heads, len, dim)` on the device.
    fn read(&self, slot: usize, len: usize) -> Result<(Tensor, Tensor), KvError>;
    /// What a later read of `x` returns once stored (`keys` says which plane's codec).
    fn as_stored(&self, x: &Tensor, keys: bool) -> Result<Tensor, KvError>;
    /// The fused decode read: `q` `(rows, q_heads, 1, head_dim)` over slots
    /// `spans[r].0 .. spans[r].1` of each row r. Returns `(rows, q_heads, 1, value_dim)` f32.
    fn decode(&self, q: &Tensor, spans: &[(usize, usize)], scale: f32) -> Result<Tensor, KvError>;
    /// The fused chunk read, where the backend has one: `q` `(rows, q_heads, n, head_dim)`
    /// at positions `start .. start + n` over slots `0 .. start + n`, which hold those
    /// positions (full retention): causal, the first `pads[r]` slots hidden from row r (a
    /// padding query sees only itself). Returns `(rows, q_heads, n, value_dim)` f32, or
    /// `Ok(None)` where there is no fused read: the caller then reads the slots densely.
    fn chunk(
        &self,
        q: &Tensor,
        pads: &[usize],
        start: usize,
        scale: f32,
    ) -> Result<Option<Tensor>, KvError> {
        let _ = (q, pads, start, scale);
        Ok(None)
    }
    /// Turbo planes: fits the key preparation `prep` on `k` `(rows, heads, n, head_dim)`
    /// (what the bf16 stage holds at conversion), before anything is written. Other codecs
    /// ignore it.
    fn fit_key_prep(&mut self, k: &Tensor, prep: TurboPrep) -> Result<(), KvError> {
        let _ = (k, prep);
        Ok(())
    }
    fn allocated_bytes(&self) -> usize;
    /// Encoded bytes of one position of one row, keys and values.
    fn bytes_per_position(&self) -> usize;
}

/// Makes device planes.
pub trait DeviceBackend: Send + Sync {
    /// Empty planes of `codec` on `device`: `Ok(None)` when this backend does not serve
    /// `device`, an error naming the codec when it serves the device but not the codec.
    fn planes(
        &self,
        codec: Codec,
        geometry: PlaneGeometry,
        device: &Device,
    ) -> Result<Option<Box<dyn DevicePlanes>>, KvError>;
}

/// `(rows, heads, head_dim, value_dim)` of a layer's planes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaneGeometry {
    pub rows: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub value_dim: usize,
}

static BACKEND: OnceLock<Box<dyn DeviceBackend>> = OnceLock::new();

/// Installs the process's device backend; a second call keeps the first.
pub fn install(backend: Box<dyn DeviceBackend>) {
    let _ = BACKEND.set(backend);
}

/// Planes of `codec` on `device` from the installed backend. `Ok(None)` where the cache
/// keeps its own host planes: on the CPU, unless a backend claims it (the tests' emulated
/// device does); an error for any other device no backend serves.
pub(crate) fn planes_on(
    codec: Codec,
    geometry: PlaneGeometry,
    device: &Device,
) -> Result<Option<Box<dyn DevicePlanes>>, KvError> {
    let served = match BACKEND.get() {
        Some(backend) => backend.planes(codec, geometry, device)?,
        None => None,
    };
    if served.is_none() && !device.is_cpu() {
        return Err(KvError::NoDeviceBackend {
            device: format!("{:?}", device.location()),
        });
    }
    Ok(served)
}
