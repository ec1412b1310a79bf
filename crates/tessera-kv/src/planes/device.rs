//! Device-resident planes: the hook through which a GPU backend keeps a layer's keys and
//! values on its device and runs the fused reads there. tessera-kv defines the interface
//! and stays CPU-only; tessera-kernels (feature `cuda`) implements it and is installed once
//! per process with [`install`]. A device's planes are [`Planes`] like any other: a layer
//! cache whose appends arrive on a non-CPU device stores them in the installed backend's
//! planes, and retention, rows, the bf16-first transition and the named reads stay the
//! cache's own.

use super::{AffinePlanes, PlainPlanes, PlaneGeometry, Planes, TurboPlanes};
use crate::{Codec, KvError};
use candle_core::Device;
use std::sync::OnceLock;

/// Makes device planes.
pub trait DeviceBackend: Send + Sync {
    /// Empty planes of `codec` on `device`: `Ok(None)` when this backend does not serve
    /// `device`, an error naming the codec when it serves the device but not the codec.
    fn planes(
        &self,
        codec: Codec,
        geometry: PlaneGeometry,
        device: &Device,
    ) -> Result<Option<Box<dyn Planes>>, KvError>;
}

static BACKEND: OnceLock<Box<dyn DeviceBackend>> = OnceLock::new();

/// Installs the process's device backend; a second call keeps the first.
pub fn install(backend: Box<dyn DeviceBackend>) {
    let _ = BACKEND.set(backend);
}

/// Whether a device backend is installed (it may claim the CPU too, as the tests'
/// emulated device does, and decide per calling thread).
pub(crate) fn backend_installed() -> bool {
    BACKEND.get().is_some()
}

/// Planes of `codec` on `device` from the installed backend. `Ok(None)` where the cache
/// keeps its own host planes: on the CPU, unless a backend claims it (the tests' emulated
/// device does); an error for any other device no backend serves.
pub(crate) fn planes_on(
    codec: Codec,
    geometry: PlaneGeometry,
    device: &Device,
) -> Result<Option<Box<dyn Planes>>, KvError> {
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

/// Empty host planes of `codec`.
pub fn host_planes(codec: Codec, geometry: PlaneGeometry) -> Box<dyn Planes> {
    let PlaneGeometry {
        rows,
        heads,
        head_dim,
        value_dim,
    } = geometry;
    match codec {
        Codec::Plain(dtype) => Box::new(PlainPlanes::new(dtype, geometry)),
        Codec::Affine { bits, group } => Box::new(AffinePlanes::new(
            bits,
            group as usize,
            rows,
            heads,
            head_dim,
            value_dim,
        )),
        Codec::Turbo { kbits, vbits, prep } => Box::new(
            TurboPlanes::new(kbits, vbits, rows, heads, head_dim, value_dim).with_prep(prep),
        ),
    }
}

/// Empty planes of `codec` where appends on `device` are stored: the backend's when it
/// serves the device, else the host's.
pub fn planes_for(
    codec: Codec,
    geometry: PlaneGeometry,
    device: &Device,
) -> Result<Box<dyn Planes>, KvError> {
    Ok(planes_on(codec, geometry, device)?.unwrap_or_else(|| host_planes(codec, geometry)))
}
