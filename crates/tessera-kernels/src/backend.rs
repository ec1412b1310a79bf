//! tessera-kv's device backend on CUDA: a layer's planes as device words in the CPU
//! cache's layout, written by the encode kernel on every append (planes.cu), decoded to f32
//! for chunk reads, and read by the fused decode kernel (decode.cu). Everything runs on
//! candle's stream for the device, so the model's tensors and the cache's kernels are
//! ordered without host synchronization.
//!
//! Served: bf16 (plain), affine 4/8 bits with groups of 32, 64 or 128, and TurboQuant of
//! 2..=8 bits (scalar codebooks: `:pairs` is refused), for head dims of 64, 128 or 256 with
//! keys and values of one width. Other codecs get an error naming them when the cache is
//! first used on the device.

use crate::cuda::{DecodeRead, GpuCodec, GpuPlanes, Plan, Scratch, TurboDevice};
use crate::dependent::DependentLaunch;
use crate::PLANES_CU;
use anyhow::{anyhow, Context};
use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{
    result, CudaContext, CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtrMut, DeviceRepr,
    LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Storage, Tensor};
use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// (calls, nanoseconds) of bf16 writes, quantized (affine, turbo) writes, bf16 reads,
/// quantized reads.
static PROFILE: [(AtomicU64, AtomicU64); 4] = [
    (AtomicU64::new(0), AtomicU64::new(0)),
    (AtomicU64::new(0), AtomicU64::new(0)),
    (AtomicU64::new(0), AtomicU64::new(0)),
    (AtomicU64::new(0), AtomicU64::new(0)),
];

/// `f`, timed when the backend profiles ([`install_with`]): synchronized around, its mean
/// wall times per kind printed to stderr every 4096 calls.
fn timed<R>(kernels: &Kernels, op: usize, f: impl FnOnce() -> R) -> R {
    if !kernels.profile {
        return f();
    }
    // A failed synchronize surfaces again at the next launch; the timing just goes on.
    let sync = || {
        let _ = kernels.read.stream.synchronize();
    };
    sync();
    let t = Instant::now();
    let r = f();
    sync();
    let (calls, ns) = &PROFILE[op];
    ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    if calls.fetch_add(1, Ordering::Relaxed) % 4096 == 4095 {
        let mean = |i: usize| {
            PROFILE[i].1.load(Ordering::Relaxed) as f64
                / PROFILE[i].0.load(Ordering::Relaxed).max(1) as f64
                / 1e3
        };
        eprintln!(
            "kv profile (mean µs, synchronized): write bf16 {:.1} quantized {:.1}, decode read \
             bf16 {:.1} quantized {:.1}",
            mean(0),
            mean(1),
            mean(2),
            mean(3)
        );
    }
    r
}
use tessera_kv::planes::device::host_planes;
use tessera_kv::planes::{
    keeps_in_place, ChunkGeometry, DeviceBackend, PlaneGeometry, Planes, PlanesState, RowSlots,
    TurboPlanes, TurboTables,
};
use tessera_kv::{grown_capacity, Codec, Isa, KvError, PlainDType, TurboPrep};

/// The kernels of one device.
struct Kernels {
    device: CudaDevice,
    read: DecodeRead,
    encode: CudaFunction,
    decode: CudaFunction,
    turbo_encode: CudaFunction,
    turbo_decode: CudaFunction,
    copy: CudaFunction,
    /// The affine key means' fit ([`KeyMeans`]).
    fit_means: CudaFunction,
    /// The decode reads' partial states, shared by every layer (the reads run in stream
    /// order; the lock is held from a read's first launch to its last).
    scratch: Mutex<Option<Scratch>>,
    /// Changes whenever `scratch` is replaced (a captured live read holds its address).
    scratch_generation: AtomicU64,
    /// Whether writes and decode reads are timed ([`CudaBackend::profiled`]).
    profile: bool,
}

/// Installs the CUDA backend into tessera-kv (once per process).
pub fn install() {
    install_with(false);
}

/// [`install`], with `profile` timing every cache write and decode read (synchronized
/// around each, the mean times printed to stderr every 4096 calls: a diagnostic that slows
/// the run).
pub fn install_with(profile: bool) {
    tessera_kv::planes::install(Box::new(CudaBackend::new().profiled(profile)));
}

pub struct CudaBackend {
    /// Built on first use, for the first CUDA device seen.
    kernels: Mutex<Option<Arc<Kernels>>>,
    profile: bool,
}

impl Default for CudaBackend {
    fn default() -> Self {
        Self::new()
    }
}

fn device_error(e: impl std::fmt::Display) -> KvError {
    KvError::Device(format!("{e:#}"))
}

impl CudaBackend {
    pub fn new() -> Self {
        CudaBackend {
            kernels: Mutex::new(None),
            profile: false,
        }
    }

    /// The backend timing its writes and decode reads where `profile` ([`install_with`]).
    pub fn profiled(mut self, profile: bool) -> Self {
        self.profile = profile;
        self
    }

    fn kernels(&self, device: &CudaDevice) -> anyhow::Result<Arc<Kernels>> {
        let mut slot = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = slot.as_ref() {
            if k.device.same_device(device) {
                return Ok(k.clone());
            }
            return Err(anyhow!("the CUDA KV backend serves one device per process"));
        }
        let stream = device.cuda_stream();
        keep_pool_memory(stream.context()).context("configuring the memory pool")?;
        let module = crate::compile::load(stream.context(), PLANES_CU).context("planes.cu")?;
        let k = Arc::new(Kernels {
            device: device.clone(),
            read: DecodeRead::with_stream(stream)?,
            encode: module.load_function("encode_kv_rows")?,
            decode: module.load_function("decode_rows")?,
            turbo_encode: module.load_function("turbo_encode")?,
            turbo_decode: module.load_function("turbo_decode_rows")?,
            copy: module.load_function("copy_blocks")?,
            fit_means: module.load_function("fit_key_means")?,
            scratch: Mutex::new(None),
            scratch_generation: AtomicU64::new(next_generation()),
            profile: self.profile,
        });
        *slot = Some(k.clone());
        Ok(k)
    }
}

/// The device's default memory pool hands freed memory back to the driver at every
/// synchronization (release threshold 0), and a decode step synchronizes once (its logits
/// come back to the host): the next step's allocations, candle's and the read's scratch,
/// would map fresh pages again. Keeping freed memory in the pool makes them pool hits.
fn keep_pool_memory(ctx: &CudaContext) -> anyhow::Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    ctx.bind_to_thread()?;
    let mut threshold = u64::MAX;
    // SAFETY: plain driver calls on a live context's device, with valid out-pointers.
    unsafe {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .result()?;
    }
    Ok(())
}

/// The GPU layout for `codec`, or why there is none.
fn gpu_codec(codec: Codec, g: PlaneGeometry) -> Result<GpuCodec, String> {
    let gpu = match codec {
        Codec::Plain(PlainDType::Bf16) => GpuCodec::Bf16,
        Codec::Affine { bits, group } if bits == 4 || bits == 8 => GpuCodec::Affine {
            bits,
            group: group as usize,
        },
        Codec::Affine { .. } => return Err("the CUDA kernels cover affine 4 and 8 bits".into()),
        Codec::Plain(_) => return Err("the CUDA cache stores plain keys in bf16".into()),
        Codec::Turbo { prep, .. } if prep.pairs => {
            return Err("the CUDA kernels read scalar turbo codes, not pair codebooks".into())
        }
        Codec::Turbo { kbits, vbits, .. } => GpuCodec::Turbo { kbits, vbits },
    };
    if g.head_dim != g.value_dim || ![64, 128, 256].contains(&g.head_dim) {
        return Err(format!(
            "the CUDA kernels need equal key and value widths of 64, 128 or 256 (got {} and {})",
            g.head_dim, g.value_dim
        ));
    }
    Ok(gpu)
}

impl DeviceBackend for CudaBackend {
    fn planes(
        &self,
        codec: Codec,
        geometry: PlaneGeometry,
        device: &Device,
    ) -> Result<Option<Box<dyn Planes>>, KvError> {
        let Device::Cuda(dev) = device else {
            return Ok(None);
        };
        let gpu = gpu_codec(codec, geometry).map_err(|reason| KvError::DeviceCodec {
            codec: codec.to_string(),
            device: "cuda".into(),
            reason,
        })?;
        let kernels = self.kernels(dev).map_err(device_error)?;
        // Turbo: the host's own planes of the codec, for its tables and key preparation;
        // affine: for its key means.
        let host = match codec {
            Codec::Turbo { .. } | Codec::Affine { .. } => Some(host_planes(codec, geometry)),
            Codec::Plain(_) => None,
        };
        Ok(Some(Box::new(CudaPlanes::new(
            kernels, codec, gpu, geometry, host,
        )?)))
    }
}

/// One layer's planes on the device.
struct CudaPlanes {
    kernels: Arc<Kernels>,
    codec: Codec,
    gpu: GpuCodec,
    geometry: PlaneGeometry,
    /// Allocated on the first reserve.
    planes: Option<GpuPlanes>,
    turbo: Option<TurboState>,
    means: Option<KeyMeans>,
    /// Changes whenever a device buffer of these planes may have been replaced (a
    /// captured live step holds their addresses): from [`next_generation`], so no two
    /// planes share one.
    generation: u64,
    /// The spans of live decode steps ([`Planes::live_spans`]).
    live: Option<Live>,
}

/// Live decode steps' positions in device memory (decode.cu's `Spans::live`: the read's
/// chunk, then `(start, slot)` per row), and what they hold once the queued steps have run;
/// the plan their reads launch with.
struct Live {
    desc: CudaSlice<i32>,
    /// What the last `live_spans` set, and what the device holds after the step.
    sets: Vec<i32>,
    holds: Vec<i32>,
    plan: Plan,
    group: usize,
}

/// A number no earlier call returned.
fn next_generation() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// An affine layer's key means (tessera-kv's affine.rs centres keys): tessera-kv's host
/// planes of the codec, kept empty (resized and restored with the CPU's own code), and the
/// means on the device, `(rows, heads, head_dim)` f32, which the encode subtracts. The
/// device holds the current means: a fit runs there (planes.cu's `fit_key_means`, the
/// host's arithmetic), as does a row's adoption, and the host's copy follows only where it
/// is used (`stale` until then), so a prompt's first chunk does not wait on the host.
struct KeyMeans {
    host: Box<dyn Planes>,
    device: CudaSlice<f32>,
    /// The host's copy is behind the device's.
    stale: bool,
}

/// planes.cu's `FIT_ROWS`: rows one fit launch's spans cover (passed by value).
const FIT_ROWS: usize = 256;

/// planes.cu's `struct FitSpans`: the live positions `[lo, hi)` of each row's keys.
#[repr(C)]
#[derive(Clone, Copy)]
struct FitSpans {
    lo: [i32; FIT_ROWS],
    hi: [i32; FIT_ROWS],
}

// SAFETY: plain integers, laid out as the kernel's `struct FitSpans`.
unsafe impl DeviceRepr for FitSpans {}

impl KeyMeans {
    /// The device buffer's length for `host`'s means (one zero where there are none, so a
    /// launch still gets a buffer).
    fn zero_len(host: &dyn Planes) -> usize {
        host.as_any()
            .downcast_ref::<tessera_kv::planes::AffinePlanes>()
            .map_or(0, |p| p.key_means().len())
            .max(1)
    }

    /// The host's copy (current unless `stale`).
    fn host_values(&self) -> &[f32] {
        self.host
            .as_any()
            .downcast_ref::<tessera_kv::planes::AffinePlanes>()
            .map_or(&[], |p| p.key_means())
    }

    /// The current means: the host's copy, or the device's read back where it is behind.
    fn values(&self, kernels: &Kernels) -> Result<std::borrow::Cow<'_, [f32]>, KvError> {
        let host = self.host_values();
        if !self.stale {
            return Ok(std::borrow::Cow::Borrowed(host));
        }
        let s = &kernels.read.stream;
        let values = s
            .clone_dtoh(&self.device.slice(..host.len()))
            .map_err(device_error)?;
        s.synchronize().map_err(device_error)?;
        Ok(std::borrow::Cow::Owned(values))
    }

    /// Brings the host's copy level with the device's, for the host's own row operations.
    fn sync_host(&mut self, kernels: &Kernels) -> Result<(), KvError> {
        if !self.stale {
            return Ok(());
        }
        let values = self.values(kernels)?.into_owned();
        // The host planes hold no slots: a state of four empty buffers and the means.
        let mut buffers = vec![Vec::new(); 4];
        buffers.push(f32_bytes(&values));
        self.host.restore(&PlanesState {
            codec: self.host.codec(),
            geometry: self.host.geometry(),
            capacity: 0,
            buffers,
        })?;
        self.stale = false;
        Ok(())
    }
}

/// A turbo layer's tables: tessera-kv's host planes of the codec, kept empty (no slots:
/// its rotations and codebooks, and the per-row key preparation, fitted and adopted with
/// the CPU's own code), and their copy on the device.
struct TurboState {
    host: Box<dyn Planes>,
    device: Arc<TurboDevice>,
}

impl std::fmt::Debug for CudaPlanes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaPlanes({}, {:?}, capacity {})",
            self.gpu.name(),
            self.geometry,
            self.capacity()
        )
    }
}

/// A launch over `n` independent items (the kernels loop grid-stride).
/// Partial softmax states one deterministic chunk read's launch may write (each `d + 2`
/// floats: 270 MB at d = 128).
const DETERMINISTIC_STATES: usize = 1 << 19;

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems((n.clamp(1, 1 << 22)) as u32)
}

/// One block of `d` threads per vector, for `vectors` vectors (the kernels loop over the
/// rest when there are more than a launch holds).
fn per_vector(vectors: usize, d: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (vectors.clamp(1, 1 << 20) as u32, 1, 1),
        block_dim: (d as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `t` as f32 on the device, contiguous (its storage may still start at an offset).
fn f32_storage(t: &Tensor) -> Result<Tensor, KvError> {
    Ok(t.to_dtype(DType::F32)?.contiguous()?)
}

fn with_f32<R>(
    t: &Tensor,
    f: impl FnOnce(&CudaSlice<f32>, usize) -> anyhow::Result<R>,
) -> Result<R, KvError> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        return Err(KvError::Device("expected a CUDA tensor".into()));
    };
    let slice = s.as_cuda_slice::<f32>()?;
    f(slice, layout.start_offset()).map_err(device_error)
}

fn wrap(kernels: &Kernels, out: CudaSlice<f32>, shape: &[usize]) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(out, kernels.device.clone());
    Tensor::from_storage(
        Storage::Cuda(storage),
        shape.to_vec(),
        BackpropOp::none(),
        false,
    )
}

/// The host turbo planes' tables (rotations, codebooks, per-row key preparation).
fn host_tables(host: &dyn Planes) -> Result<TurboTables, KvError> {
    host.as_any()
        .downcast_ref::<TurboPlanes>()
        .map(TurboPlanes::tables)
        .ok_or_else(|| KvError::Device("CUDA turbo planes without host turbo planes".into()))
}

fn upload_tables(
    kernels: &Kernels,
    host: &dyn Planes,
    g: PlaneGeometry,
) -> Result<TurboDevice, KvError> {
    TurboDevice::upload(
        &kernels.read.stream,
        &host_tables(host)?,
        g.rows * g.heads,
        g.head_dim,
    )
    .map_err(device_error)
}

/// Words as their little-endian bytes (the host planes' buffers), and back.
fn word_bytes(w: &[u32]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `b` as `words` u32 words, or the error naming `what`.
fn bytes_words(b: &[u8], words: usize, what: &str) -> Result<Vec<u32>, KvError> {
    if b.len() != 4 * words {
        return Err(KvError::BadState(format!(
            "{what}: {} bytes, expected {}",
            b.len(),
            4 * words
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A turbo norm plane: the device's 32-bit words (f16 in the low half) as the host's f16s.
fn norms_to_f16_bytes(w: &[u32]) -> Vec<u8> {
    w.iter().flat_map(|x| (*x as u16).to_le_bytes()).collect()
}

fn f16_bytes_to_norms(b: &[u8], norms: usize, what: &str) -> Result<Vec<u32>, KvError> {
    if b.len() != 2 * norms {
        return Err(KvError::BadState(format!(
            "{what}: {} bytes, expected {}",
            b.len(),
            2 * norms
        )));
    }
    Ok(b.chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
        .collect())
}

impl CudaPlanes {
    fn new(
        kernels: Arc<Kernels>,
        codec: Codec,
        gpu: GpuCodec,
        geometry: PlaneGeometry,
        host: Option<Box<dyn Planes>>,
    ) -> Result<Self, KvError> {
        let (turbo, means) = match (gpu, host) {
            (GpuCodec::Turbo { .. }, Some(host)) => {
                let device = Arc::new(upload_tables(&kernels, host.as_ref(), geometry)?);
                (Some(TurboState { host, device }), None)
            }
            (GpuCodec::Affine { .. }, Some(host)) => {
                // Fresh host planes hold identity means, zeros: the device's are made so
                // there, with nothing uploaded.
                let len = KeyMeans::zero_len(host.as_ref());
                let device = kernels
                    .read
                    .stream
                    .alloc_zeros::<f32>(len)
                    .map_err(device_error)?;
                let stale = false;
                (
                    None,
                    Some(KeyMeans {
                        host,
                        device,
                        stale,
                    }),
                )
            }
            _ => (None, None),
        };
        let mut planes = CudaPlanes {
            kernels,
            codec,
            gpu,
            geometry,
            planes: None,
            turbo,
            means,
            generation: next_generation(),
            live: None,
        };
        if planes
            .means
            .as_ref()
            .is_some_and(|m| m.host_values().iter().any(|&x| x != 0.0))
        {
            planes.refresh_means()?;
        }
        Ok(planes)
    }

    /// Fits the affine key means of `k` `(rows, heads, n, head_dim)`, row r on its positions
    /// `live[r]`, on the device (planes.cu's `fit_key_means`: tessera-kv's fit, bit for
    /// bit). `false`, with nothing done, where the launch's spans cannot hold the rows (the
    /// host fits then).
    fn fit_means_on_device(&mut self, k: &Tensor, live: &[Range<usize>]) -> Result<bool, KvError> {
        let g = self.geometry;
        let Some(m) = &mut self.means else {
            return Ok(false);
        };
        let (rows, heads, n, d) = k.dims4()?;
        if live.len() != g.rows {
            return Err(KvError::RowCount {
                given: live.len(),
                rows: g.rows,
            });
        }
        if rows != g.rows || heads != g.heads || d != g.head_dim {
            return Err(KvError::Device(format!(
                "keys {:?} to fit means on, for {g:?}",
                k.dims()
            )));
        }
        if rows * heads == 0 {
            return Ok(true); // no blocks: nothing to fit
        }
        if rows > FIT_ROWS || live.iter().any(|r| r.start > r.end || r.end > n) {
            return Ok(false);
        }
        let mut spans = FitSpans {
            lo: [0; FIT_ROWS],
            hi: [0; FIT_ROWS],
        };
        for (r, span) in live.iter().enumerate() {
            (spans.lo[r], spans.hi[r]) = (span.start as i32, span.end as i32);
        }
        if m.device.len() < rows * heads * d {
            return Err(KvError::Device("key means smaller than the rows".into()));
        }
        let k = k.to_dtype(DType::F32)?.contiguous()?;
        let kernels = &self.kernels;
        with_f32(&k, |ks, offset| {
            let ks = ks.slice(offset..);
            let (heads_i, n_i, d_i) = (heads as i32, n as i32, d as i32);
            let mut l = kernels.read.stream.launch_builder(&kernels.fit_means);
            l.arg(&ks)
                .arg(&mut m.device)
                .arg(&spans)
                .arg(&heads_i)
                .arg(&n_i)
                .arg(&d_i);
            let cfg = LaunchConfig {
                grid_dim: ((rows * heads) as u32, 1, 1),
                block_dim: (d.min(1024) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: ks holds rows · heads · n · d floats from its offset, the means rows ·
            // heads · d (checked above), the spans lie within 0..n; the kernel touches no more.
            unsafe { l.launch(cfg)? };
            Ok(())
        })?;
        m.stale = true;
        Ok(true)
    }

    /// Uploads the host's affine key means again (after the host's fit, resize or restore;
    /// the host's copy must be current: [`KeyMeans::sync_host`] first).
    fn refresh_means(&mut self) -> Result<(), KvError> {
        let Some(m) = &mut self.means else {
            return Ok(());
        };
        m.stale = false;
        let values = m.host_values();
        // One zero where there are none yet: a launch still gets a buffer.
        let values = if values.is_empty() {
            &[0f32][..]
        } else {
            values
        };
        m.device = self
            .kernels
            .read
            .stream
            .clone_htod(values)
            .map_err(device_error)?;
        Ok(())
    }

    fn blocks(&self) -> usize {
        self.geometry.rows * self.geometry.heads
    }

    /// Words of a row of `plane` (0 keys, 1 values) and of its parameters.
    fn words(&self, plane: usize) -> (usize, usize) {
        self.gpu.plane_words(self.geometry.head_dim, plane)
    }

    /// planes.cu's `bits` and `group` for bf16 and affine rows.
    fn bits_group(&self) -> (i32, i32) {
        match self.gpu {
            GpuCodec::Bf16 => (0, 64),
            GpuCodec::Affine { bits, group } => (bits as i32, group as i32),
            GpuCodec::Turbo { .. } => unreachable!("turbo rows have their own kernels"),
        }
    }

    /// Uploads the host turbo planes' tables again (after a fit, adoption or restore).
    fn refresh_tables(&mut self) -> Result<(), KvError> {
        let Some(t) = &mut self.turbo else {
            return Ok(());
        };
        t.device = Arc::new(upload_tables(
            &self.kernels,
            t.host.as_ref(),
            self.geometry,
        )?);
        if let Some(p) = &mut self.planes {
            p.turbo = Some(t.device.clone());
        }
        Ok(())
    }

    /// `src` as CUDA planes of this codec on this device.
    fn same_kind<'a>(&self, src: &'a dyn Planes) -> Result<&'a CudaPlanes, KvError> {
        src.as_any()
            .downcast_ref::<CudaPlanes>()
            .filter(|s| {
                s.codec() == self.codec()
                    && Arc::ptr_eq(&s.kernels, &self.kernels)
                    && (s.geometry.heads, s.geometry.head_dim, s.geometry.value_dim)
                        == (
                            self.geometry.heads,
                            self.geometry.head_dim,
                            self.geometry.value_dim,
                        )
            })
            .ok_or_else(|| KvError::CodecMismatch {
                expected: format!("{} on cuda", self.codec()),
                got: src.codec().to_string(),
            })
    }

    fn check_rows(&self, rows: &Range<usize>, what: &str) -> Result<(), KvError> {
        if rows.start > rows.end || rows.end > self.geometry.rows {
            return Err(KvError::Rows(format!(
                "{what} rows {rows:?} of CUDA planes of {} rows",
                self.geometry.rows
            )));
        }
        Ok(())
    }

    fn check_slots(&self, slot: usize, len: usize, what: &str) -> Result<(), KvError> {
        if slot + len > self.capacity() {
            return Err(KvError::Device(format!(
                "{what} slots {slot}..{} of CUDA planes of capacity {}",
                slot + len,
                self.capacity()
            )));
        }
        Ok(())
    }

    /// Encodes keys and values `(rows, heads, n, d)` into rows `row0 ..`, slots `slot ..` of
    /// `planes`: bf16 and affine rows in one launch, turbo rows in one a plane.
    /// With `live` (a live step: `(start, slot)` per row in device memory), each row is
    /// written at its own slot there, and `slot` is not used.
    fn encode(
        &self,
        keys: &Tensor,
        values: &Tensor,
        planes: &mut GpuPlanes,
        slot: usize,
        row0: usize,
        live: Option<&CudaSlice<i32>>,
    ) -> Result<(), KvError> {
        let (b, h, n, d) = keys.dims4()?;
        if values.dims() != keys.dims() {
            return Err(KvError::Device(format!(
                "one encode launch for keys {:?} and values {:?}",
                keys.dims(),
                values.dims()
            )));
        }
        if b * h * n == 0 {
            return Ok(());
        }
        let (keys, values) = (f32_storage(keys)?, f32_storage(values)?);
        let k = &self.kernels;
        let cap = planes.capacity;
        // The launch's first block: the kernels index blocks from there.
        let first = row0 * self.geometry.heads * cap;
        let ((kw, kpw), (vw, vpw)) = (self.words(0), self.words(1));
        let mut ck = planes.k.slice_mut(first * kw..);
        let mut pk = planes.kp.slice_mut(first * kpw..);
        let mut cv = planes.v.slice_mut(first * vw..);
        let mut pv = planes.vp.slice_mut(first * vpw..);
        if let Some(t) = &self.turbo {
            if live.is_some() {
                return Err(KvError::Device("a live step on turbo planes".into()));
            }
            let geometry = (b * h, n, d);
            let at = (cap, slot, row0);
            self.turbo_encode(&keys, geometry, &mut ck, &mut pk, at, 0, t)?;
            return self.turbo_encode(&values, geometry, &mut cv, &mut pv, at, 1, t);
        }
        let (bits, group) = self.bits_group();
        let per_row = if bits == 0 { d / 2 } else { d / group as usize };
        let means = match &self.means {
            Some(m) if m.host_values().len() >= (row0 + b) * h * d => {
                Some(m.device.slice(row0 * h * d..(row0 + b) * h * d))
            }
            Some(_) => {
                return Err(KvError::Device(format!(
                    "key means for rows {row0}..{} missing",
                    row0 + b
                )))
            }
            None => None,
        };
        let live = live.map(|l| l.slice(2 * row0..));
        with_f32(&keys, |ks, k_offset| {
            with_f32(&values, |vs, v_offset| {
                let (ks, vs) = (ks.slice(k_offset..), vs.slice(v_offset..));
                let (blocks, n, d, cap, slot) =
                    ((b * h) as i64, n as i32, d as i32, cap as i32, slot as i32);
                // A dependent launch (dependent.rs): planes.cu's encode waits for the launch
                // before it first.
                let mut l = DependentLaunch::new(&k.read.stream);
                l.input(&ks).input(&vs).output(&mut ck).output(&mut cv);
                l.output(&mut pk).output(&mut pv).long(blocks).int(n).int(d);
                l.int(cap).int(slot).int(bits).int(group);
                // The launch's rows' key means (a null pointer where keys are not centred).
                match &means {
                    Some(m) => l.input(m),
                    None => l.long(0),
                };
                match &live {
                    Some(live) => l.input(live),
                    None => l.long(0),
                };
                l.int(h as i32);
                // bf16: a thread per word; affine: a warp per group; grid.y: the plane.
                let lanes = if bits == 0 { 1 } else { 32 };
                let mut cfg = grid(b * h * n as usize * per_row * lanes);
                cfg.grid_dim.1 = 2;
                // SAFETY: both planes hold rows row0.. of `cap` slots of this geometry, and
                // slot + n ≤ cap (checked by the caller); the kernel writes no more.
                unsafe { l.launch(&k.encode, cfg)? };
                Ok(())
            })
            .map_err(|e| anyhow::anyhow!("{e}"))
        })
    }

    /// Slots `slot .. slot + len` of rows `rows` of `codes`/`params` (`cap` slots) of
    /// `plane` as f32 `(rows.len() · heads, len, d)`.
    #[allow(clippy::too_many_arguments)]
    fn decode_slots(
        &self,
        codes: &CudaSlice<u32>,
        params: &CudaSlice<u32>,
        rows: Range<usize>,
        cap: usize,
        slot: usize,
        len: usize,
        plane: usize,
    ) -> Result<CudaSlice<f32>, KvError> {
        let k = &self.kernels;
        let d = self.geometry.head_dim;
        let blocks = rows.len() * self.geometry.heads;
        if blocks * len == 0 {
            return k.read.stream.alloc_zeros::<f32>(1).map_err(device_error);
        }
        let first = rows.start * self.geometry.heads * cap;
        let (w, p) = self.words(plane);
        let codes = codes.slice(first * w..);
        let params = params.slice(first * p..);
        if let Some(t) = &self.turbo {
            return self.turbo_decode(
                &codes,
                &params,
                (blocks, cap, slot, len, rows.start),
                plane,
                t,
            );
        }
        let (bits, group) = self.bits_group();
        let run = || -> anyhow::Result<CudaSlice<f32>> {
            let mut out = k.read.stream.alloc_zeros::<f32>(blocks * len * d)?;
            let (nb, len_i, d_i, cap, slot) =
                (blocks as i64, len as i32, d as i32, cap as i32, slot as i32);
            let mut l = k.read.stream.launch_builder(&k.decode);
            l.arg(&codes)
                .arg(&params)
                .arg(&mut out)
                .arg(&nb)
                .arg(&len_i)
                .arg(&d_i)
                .arg(&cap)
                .arg(&slot)
                .arg(&bits)
                .arg(&group);
            unsafe { l.launch(grid(blocks * len * d))? };
            Ok(out)
        };
        run().map_err(device_error)
    }

    /// The key preparation's tables from block `row0 · heads` on, for `plane` (values
    /// carry none: `prep` 0 and the tables unused).
    fn prep_tables<'a>(
        &self,
        t: &'a TurboState,
        plane: usize,
        row0: usize,
    ) -> (i32, CudaView<'a, f32>, CudaView<'a, f32>) {
        let dev = &t.device;
        let prep = if plane == 0 { dev.prep } else { 0 };
        let at = (row0 * self.geometry.heads * self.geometry.head_dim).min(dev.mean.len() - 1);
        (prep, dev.mean.slice(at..), dev.scale.slice(at..))
    }

    /// The turbo encode of `x` (f32, contiguous, `(blocks, n, d)`), as [`Self::encode`]
    /// (`codes`, `norms` from the launch's first block on).
    #[allow(clippy::too_many_arguments)]
    fn turbo_encode(
        &self,
        x: &Tensor,
        (blocks, n, d): (usize, usize, usize),
        codes: &mut CudaViewMut<u32>,
        norms: &mut CudaViewMut<u32>,
        (cap, slot, row0): (usize, usize, usize),
        plane: usize,
        t: &TurboState,
    ) -> Result<(), KvError> {
        let k = &self.kernels;
        let dev = &t.device;
        let bits = self.turbo_bits(plane);
        let (prep, mean, scale) = self.prep_tables(t, plane, row0);
        with_f32(x, |xs, offset| {
            let xs = xs.slice(offset..);
            let signs = dev.signs.slice(plane * d..(plane + 1) * d);
            let thresholds = dev.thresholds.slice(plane * 256..(plane + 1) * 256);
            let (nb, n_i, d_i, cap, slot) =
                (blocks as i64, n as i32, d as i32, cap as i32, slot as i32);
            let levels = dev.counts[plane] as i32;
            let mut l = k.read.stream.launch_builder(&k.turbo_encode);
            l.arg(&xs)
                .arg(codes)
                .arg(norms)
                .arg(&nb)
                .arg(&n_i)
                .arg(&d_i)
                .arg(&cap)
                .arg(&slot)
                .arg(&bits)
                .arg(&signs)
                .arg(&thresholds)
                .arg(&levels)
                .arg(&prep)
                .arg(&mean)
                .arg(&scale);
            unsafe { l.launch(per_vector(blocks * n, d))? };
            Ok(())
        })
    }

    /// The turbo decode of slots, as [`Self::decode_slots`] (keys with their preparation
    /// undone; `codes`, `norms` from the first block read on).
    fn turbo_decode(
        &self,
        codes: &CudaView<u32>,
        norms: &CudaView<u32>,
        (blocks, cap, slot, len, row0): (usize, usize, usize, usize, usize),
        plane: usize,
        t: &TurboState,
    ) -> Result<CudaSlice<f32>, KvError> {
        let k = &self.kernels;
        let dev = &t.device;
        let d = self.geometry.head_dim;
        let bits = self.turbo_bits(plane);
        let (prep, mean, scale) = self.prep_tables(t, plane, row0);
        let run = || -> anyhow::Result<CudaSlice<f32>> {
            // SAFETY: the kernel writes every element (one block per row, d threads).
            let mut out = unsafe { k.read.stream.alloc::<f32>((blocks * len * d).max(1))? };
            let signs = dev.signs.slice(plane * d..(plane + 1) * d);
            let levels = dev.levels.slice(plane * 256..(plane + 1) * 256);
            let (nb, len_i, d_i, cap, slot) =
                (blocks as i64, len as i32, d as i32, cap as i32, slot as i32);
            let mut l = k.read.stream.launch_builder(&k.turbo_decode);
            l.arg(codes)
                .arg(norms)
                .arg(&mut out)
                .arg(&nb)
                .arg(&len_i)
                .arg(&d_i)
                .arg(&cap)
                .arg(&slot)
                .arg(&bits)
                .arg(&signs)
                .arg(&levels)
                .arg(&prep)
                .arg(&mean)
                .arg(&scale);
            if blocks * len > 0 {
                unsafe { l.launch(per_vector(blocks * len, d))? };
            }
            Ok(out)
        };
        run().map_err(device_error)
    }

    fn turbo_bits(&self, plane: usize) -> i32 {
        match self.gpu {
            GpuCodec::Turbo { kbits, vbits } => i32::from(if plane == 0 { kbits } else { vbits }),
            _ => unreachable!("called for turbo planes only"),
        }
    }

    fn alloc(&self, capacity: usize) -> anyhow::Result<GpuPlanes> {
        self.alloc_rows(self.geometry.rows, capacity)
    }

    /// Zeroed planes with room for `rows` rows (the geometry's rows are the ones in use).
    fn alloc_rows(&self, rows: usize, capacity: usize) -> anyhow::Result<GpuPlanes> {
        let s = &self.kernels.read.stream;
        let rows = rows * self.geometry.heads * capacity;
        let ((wk, pk), (wv, pv)) = (self.words(0), self.words(1));
        Ok(GpuPlanes {
            codec: self.gpu,
            batch: self.geometry.rows,
            kv_heads: self.geometry.heads,
            capacity,
            d: self.geometry.head_dim,
            k: s.alloc_zeros::<u32>((rows * wk).max(1))?,
            v: s.alloc_zeros::<u32>((rows * wv).max(1))?,
            kp: s.alloc_zeros::<u32>((rows * pk).max(1))?,
            vp: s.alloc_zeros::<u32>((rows * pv).max(1))?,
            turbo: self.turbo.as_ref().map(|t| t.device.clone()),
        })
    }

    /// Copies every block's first `old` slots into `new` (a larger capacity).
    fn copy_into(&self, old: &GpuPlanes, new: &mut GpuPlanes) -> anyhow::Result<()> {
        let k = &self.kernels;
        let ((wk, pk), (wv, pv)) = (self.words(0), self.words(1));
        let blocks = self.blocks() as i64;
        if blocks == 0 {
            return Ok(());
        }
        for (src, dst, per) in [
            (&old.k, &mut new.k, wk),
            (&old.v, &mut new.v, wv),
            (&old.kp, &mut new.kp, pk),
            (&old.vp, &mut new.vp, pv),
        ] {
            if per == 0 {
                continue;
            }
            let (words, src_stride, dst_stride) = (
                (old.capacity * per) as i64,
                (old.capacity * per) as i64,
                (new.capacity * per) as i64,
            );
            let mut l = k.read.stream.launch_builder(&k.copy);
            l.arg(src)
                .arg(dst)
                .arg(&blocks)
                .arg(&words)
                .arg(&src_stride)
                .arg(&dst_stride);
            unsafe { l.launch(grid((blocks * words) as usize))? };
        }
        Ok(())
    }

    /// Words one row takes in each buffer of planes of `capacity` slots: keys, key
    /// parameters, values, value parameters (0 where the codec has no such buffer).
    fn row_words(&self, capacity: usize) -> [usize; 4] {
        let ((wk, pk), (wv, pv)) = (self.words(0), self.words(1));
        [wk, pk, wv, pv].map(|w| self.geometry.heads * capacity * w)
    }

    /// [`Planes::resize_rows`] on the device buffers: each moved row is one copy per buffer
    /// (rows lie whole, one after another), added rows are zeroed, and the buffers are
    /// reallocated only when the rows outgrow them, by half again, so that rows joining a
    /// batch one by one copy the others rarely.
    fn resize_rows_now(&mut self, keep: &[usize], rows: usize) -> anyhow::Result<()> {
        let Some(capacity) = self.planes.as_ref().map(|p| p.capacity) else {
            return Ok(());
        };
        let per_row = self.row_words(capacity);
        let room = self.planes.as_ref().map_or(0, |p| p.k.len()) / per_row[0].max(1);
        let grown = if rows > room {
            Some(self.alloc_rows(rows.max(room + room / 2), capacity)?)
        } else {
            None
        };
        let s = self.kernels.read.stream.clone();
        let p = self.planes.as_mut().context("planes checked above")?;
        let kept = keep.len();
        for (buf, per) in [&mut p.k, &mut p.kp, &mut p.v, &mut p.vp]
            .into_iter()
            .zip(per_row)
        {
            if per == 0 {
                continue;
            }
            {
                let (base, _guard) = buf.device_ptr_mut(&s);
                let at = |row: usize| base + (row * per * 4) as u64;
                for (to, &from) in keep.iter().enumerate().filter(|(to, from)| to != *from) {
                    // SAFETY: rows `from` and `to` are distinct whole rows of this buffer
                    // (`keeps_in_place` checked), so the ranges are in bounds and disjoint;
                    // the copy is ordered on the planes' stream like every kernel on them.
                    unsafe { result::memcpy_dtod_async(at(to), at(from), per * 4, s.cu_stream())? };
                }
            }
            if grown.is_none() && rows > kept {
                s.memset_zeros(&mut buf.slice_mut(kept * per..rows * per))?;
            }
        }
        if let Some(mut grown) = grown {
            for (old, new, per) in [
                (&p.k, &mut grown.k, per_row[0]),
                (&p.kp, &mut grown.kp, per_row[1]),
                (&p.v, &mut grown.v, per_row[2]),
                (&p.vp, &mut grown.vp, per_row[3]),
            ] {
                if per > 0 && kept > 0 {
                    s.memcpy_dtod(&old.slice(..kept * per), &mut new.slice_mut(..kept * per))?;
                }
            }
            grown.turbo = p.turbo.clone();
            *p = grown;
        }
        p.batch = rows;
        Ok(())
    }

    fn planes(&self) -> Result<&GpuPlanes, KvError> {
        self.planes
            .as_ref()
            .ok_or_else(|| KvError::Device("read before any position was stored".into()))
    }

    /// Buffers a state of these planes holds, and how many words (norms for turbo
    /// parameters) each plane has: `(keys, key params, values, value params)`.
    fn state_words(&self, capacity: usize) -> [usize; 4] {
        let vectors = self.blocks() * capacity;
        let ((wk, pk), (wv, pv)) = (self.words(0), self.words(1));
        [vectors * wk, vectors * pk, vectors * wv, vectors * pv]
    }
}

impl Planes for CudaPlanes {
    /// Turbo: the host planes' codec (its preparation as they hold it), as the CPU's give.
    fn codec(&self) -> Codec {
        self.turbo.as_ref().map_or(self.codec, |t| t.host.codec())
    }

    fn geometry(&self) -> PlaneGeometry {
        self.geometry
    }

    fn capacity(&self) -> usize {
        self.planes.as_ref().map_or(0, |p| p.capacity)
    }

    fn empty(&self, rows: usize) -> Result<Box<dyn Planes>, KvError> {
        let host = match (&self.turbo, &self.means) {
            (Some(t), _) => Some(t.host.empty(rows)?),
            (None, Some(m)) => Some(m.host.empty(rows)?),
            (None, None) => None,
        };
        let geometry = PlaneGeometry {
            rows,
            ..self.geometry
        };
        Ok(Box::new(CudaPlanes::new(
            self.kernels.clone(),
            self.codec,
            self.gpu,
            geometry,
            host,
        )?))
    }

    fn reserve(&mut self, slots: usize, limit: usize) -> Result<(), KvError> {
        if slots <= self.capacity() {
            return Ok(());
        }
        let capacity = grown_capacity(slots, limit);
        self.generation = next_generation();
        let mut grown = self.alloc(capacity).map_err(device_error)?;
        if let Some(old) = &self.planes {
            self.copy_into(old, &mut grown).map_err(device_error)?;
        }
        self.planes = Some(grown);
        Ok(())
    }

    fn write(
        &mut self,
        rows: Range<usize>,
        slot: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(), KvError> {
        let (kernels, op) = (self.kernels.clone(), self.profile_op(0));
        timed(&kernels, op, || self.write_now(rows, slot, k, v))
    }

    fn read(
        &self,
        rows: Range<usize>,
        slot: usize,
        len: usize,
    ) -> Result<(Tensor, Tensor), KvError> {
        self.read_now(rows, slot, len)
    }

    fn adopt_row(
        &mut self,
        src: &dyn Planes,
        src_row: usize,
        dst_row: usize,
    ) -> Result<(), KvError> {
        let src = self.same_kind(src)?;
        self.generation = next_generation();
        if let (Some(m), Some(from)) = (&mut self.means, &src.means) {
            // On the device, which holds the current means; the host's copy follows later.
            let span = self.geometry.heads * self.geometry.head_dim;
            let (from_at, to_at) = (src_row * span, dst_row * span);
            if from.device.len() < from_at + span || m.device.len() < to_at + span {
                return Err(KvError::Rows(format!(
                    "key means of row {src_row} into row {dst_row}: out of range"
                )));
            }
            let mut to = m.device.slice_mut(to_at..to_at + span);
            self.kernels
                .read
                .stream
                .memcpy_dtod(&from.device.slice(from_at..from_at + span), &mut to)
                .map_err(device_error)?;
            m.stale = true;
            return Ok(());
        }
        let (Some(t), Some(from)) = (&mut self.turbo, &src.turbo) else {
            return Ok(());
        };
        t.host.adopt_row(from.host.as_ref(), src_row, dst_row)?;
        self.refresh_tables()
    }

    fn resizes_rows_in_place(&self) -> bool {
        true
    }

    fn resize_rows(&mut self, keep: &[usize], added: usize) -> Result<(), KvError> {
        if !keeps_in_place(keep, self.geometry.rows) {
            return Err(KvError::Rows(format!(
                "rows {keep:?} of {} kept in place (distinct, each at or after its place)",
                self.geometry.rows
            )));
        }
        let rows = keep.len() + added;
        self.generation = next_generation();
        self.resize_rows_now(keep, rows).map_err(device_error)?;
        self.geometry.rows = rows;
        if let Some(t) = &mut self.turbo {
            t.host.resize_rows(keep, added)?;
        }
        if let Some(m) = &mut self.means {
            m.sync_host(&self.kernels)?;
            m.host.resize_rows(keep, added)?;
        }
        self.refresh_means()?;
        self.refresh_tables()
    }

    fn copy_from(
        &mut self,
        src: &dyn Planes,
        src_row: usize,
        src_slot: usize,
        dst_row: usize,
        dst_slot: usize,
        len: usize,
    ) -> Result<(), KvError> {
        let src = self.same_kind(src)?;
        if len == 0 {
            return Ok(());
        }
        src.check_rows(&(src_row..src_row + 1), "copy from")?;
        self.check_rows(&(dst_row..dst_row + 1), "copy into")?;
        src.check_slots(src_slot, len, "copy from")?;
        self.check_slots(dst_slot, len, "copy into")?;
        let heads = self.geometry.heads;
        let from = src.planes()?;
        let (s_cap, words) = (from.capacity, [self.words(0), self.words(1)]);
        let k = self.kernels.clone();
        let to = self
            .planes
            .as_mut()
            .ok_or_else(|| KvError::Device("copy before reserve".into()))?;
        let d_cap = to.capacity;
        let mut run = || -> anyhow::Result<()> {
            for (src, dst, per) in [
                (&from.k, &mut to.k, words[0].0),
                (&from.kp, &mut to.kp, words[0].1),
                (&from.v, &mut to.v, words[1].0),
                (&from.vp, &mut to.vp, words[1].1),
            ] {
                if per == 0 {
                    continue;
                }
                // One block per KV head of the row: `len` slots of `per` words each.
                let s0 = (src_row * heads * s_cap + src_slot) * per;
                let d0 = (dst_row * heads * d_cap + dst_slot) * per;
                let src = src.slice(s0..);
                let mut dst = dst.slice_mut(d0..);
                let (blocks, n, src_stride, dst_stride) = (
                    heads as i64,
                    (len * per) as i64,
                    (s_cap * per) as i64,
                    (d_cap * per) as i64,
                );
                let mut l = k.read.stream.launch_builder(&k.copy);
                l.arg(&src)
                    .arg(&mut dst)
                    .arg(&blocks)
                    .arg(&n)
                    .arg(&src_stride)
                    .arg(&dst_stride);
                unsafe { l.launch(grid(heads * len * per))? };
            }
            Ok(())
        };
        run().map_err(device_error)
    }

    fn fit_key_prep(
        &mut self,
        k: &Tensor,
        live: &[Range<usize>],
        prep: TurboPrep,
        queries: Option<&[f32]>,
    ) -> Result<(), KvError> {
        self.generation = next_generation();
        if self.means.is_some() {
            if self.fit_means_on_device(k, live)? {
                return Ok(());
            }
            if let Some(m) = &mut self.means {
                m.host.fit_key_prep(k, live, prep, queries)?;
            }
            return self.refresh_means();
        }
        let Some(t) = &mut self.turbo else {
            return Ok(());
        };
        t.host.fit_key_prep(k, live, prep, queries)?;
        self.refresh_tables()
    }

    fn decode(
        &self,
        q: &Tensor,
        rows: &[RowSlots],
        scale: f32,
        _isa: Isa,
    ) -> Result<Option<Tensor>, KvError> {
        let deterministic = tessera_models::device_weights::deterministic();
        let capacity = self.planes.as_ref().map_or(0, |p| p.capacity);
        let Some(spans) = rows
            .iter()
            .map(|r| {
                if deterministic {
                    r.position_run(capacity).map(|s| (s.start, s.end))
                } else {
                    r.single_span().map(|s| (s.start, s.end))
                }
            })
            .collect::<Option<Vec<_>>>()
        else {
            if deterministic {
                return Err(KvError::Device(format!(
                    "deterministic mode: rows {:?} are not one run of slots each",
                    rows.iter().map(|r| &r.ranges).collect::<Vec<_>>()
                )));
            }
            return Ok(None);
        };
        if self.planes.is_none() || spans.len() != self.geometry.rows {
            return Ok(None);
        }
        timed(&self.kernels, self.profile_op(2), || {
            self.decode_now(q, &spans, scale)
        })
        .map(Some)
    }

    fn chunk(
        &self,
        q: &Tensor,
        geometry: &ChunkGeometry,
        scale: f32,
        _isa: Isa,
    ) -> Result<Option<Tensor>, KvError> {
        if tessera_models::device_weights::deterministic() {
            return self.chunk_as_decodes(q, geometry, scale).map(Some);
        }
        let Some(start) = geometry.aligned() else {
            return Ok(None);
        };
        let fused = geometry.window.is_none()
            && geometry.slots == start + geometry.queries
            && geometry.rows.len() == self.geometry.rows
            && q.dims4()?.2 == geometry.queries
            && geometry.slots <= self.capacity();
        if !fused || self.planes.is_none() {
            return Ok(None);
        }
        let pads: Vec<usize> = geometry.rows.iter().map(|r| r.pad).collect();
        self.chunk_now(q, &pads, start, scale)
    }

    fn serves_live(&self) -> bool {
        // Turbo reads rotate the query in a launch of their own; not yet live.
        self.turbo.is_none() && self.planes.is_some()
    }

    fn live_identity(&self, spans: &[(usize, usize)], query_heads: usize) -> Option<u64> {
        let (plan, g) = self.live_plan(spans, query_heads).ok()?;
        Some(self.live_hash(&plan, g))
    }

    fn live_spans(&mut self, spans: &[(usize, usize)], query_heads: usize) -> Result<u64, KvError> {
        let (plan, g) = self.live_plan(spans, query_heads)?;
        let k = self.kernels.clone();
        {
            let planes = self.planes()?;
            let mut scratch = k.scratch.lock().unwrap_or_else(|e| e.into_inner());
            if !scratch.as_ref().is_some_and(|s| s.fits(&plan, planes, g)) {
                *scratch = Some(k.read.scratch(&plan, planes, g).map_err(device_error)?);
                k.scratch_generation
                    .store(next_generation(), Ordering::Relaxed);
            }
        }
        let want: Vec<i32> = std::iter::once(plan.chunk as i32)
            .chain(spans.iter().flat_map(|&(a, s)| [a as i32, s as i32]))
            .collect();
        let stream = &k.read.stream;
        match &mut self.live {
            Some(live) if live.holds == want => {}
            Some(live) if live.desc.len() == want.len() => {
                stream
                    .memcpy_htod(&want, &mut live.desc)
                    .map_err(device_error)?;
            }
            _ => {
                let desc = stream.clone_htod(&want).map_err(device_error)?;
                self.generation = next_generation();
                self.live = Some(Live {
                    desc,
                    sets: Vec::new(),
                    holds: Vec::new(),
                    plan,
                    group: g,
                });
            }
        }
        let live = self
            .live
            .as_mut()
            .ok_or_else(|| KvError::Device("live spans not kept".into()))?;
        // What the step leaves there: every slot advanced.
        live.holds = want
            .iter()
            .enumerate()
            .map(|(i, &x)| if i > 0 && i % 2 == 0 { x + 1 } else { x })
            .collect();
        live.sets = want;
        live.plan = plan;
        live.group = g;
        Ok(self.live_hash(&plan, g))
    }

    fn live_rewind(&mut self) -> Result<(), KvError> {
        let stream = &self.kernels.read.stream;
        let live = self
            .live
            .as_mut()
            .ok_or_else(|| KvError::Device("a live rewind before any live spans".into()))?;
        stream
            .memcpy_htod(&live.sets, &mut live.desc)
            .map_err(device_error)
    }

    fn live_step(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f32,
    ) -> Result<Tensor, KvError> {
        let geo = self.geometry;
        let (b, qh, n, d) = q.dims4()?;
        let (kb, kh, kn, _) = k.dims4()?;
        let Some(mut live) = self.live.take() else {
            return Err(KvError::Device("a live step before its spans".into()));
        };
        if b != geo.rows
            || n != 1
            || d != geo.head_dim
            || qh != geo.heads * live.group
            || (kb, kh, kn) != (b, geo.heads, 1)
        {
            self.live = Some(live);
            return Err(KvError::QueryShape {
                got: q.dims().to_vec(),
                detail: format!("a live CUDA step over {geo:?} given keys {:?}", k.dims()),
            });
        }
        let done = self.live_now(&mut live, q, k, v, scale);
        self.live = Some(live);
        done
    }

    fn allocated_bytes(&self) -> usize {
        let means = self.means.as_ref().map_or(0, |m| 4 * m.host_values().len());
        means
            + self
                .planes
                .as_ref()
                .map_or(0, |p| 4 * (p.k.len() + p.v.len() + p.kp.len() + p.vp.len()))
    }

    fn bytes_per_position(&self) -> usize {
        let ((wk, pk), (wv, pv)) = (self.words(0), self.words(1));
        self.geometry.heads * 4 * (wk + pk + wv + pv)
    }

    fn state(&self) -> Result<PlanesState, KvError> {
        let capacity = self.capacity();
        let sizes = self.state_words(capacity);
        let s = &self.kernels.read.stream;
        let mut planes = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        if let Some(p) = &self.planes {
            for (i, x) in [&p.k, &p.kp, &p.v, &p.vp].into_iter().enumerate() {
                if sizes[i] > 0 {
                    planes[i] = s.clone_dtoh(&x.slice(..sizes[i])).map_err(device_error)?;
                }
            }
            s.synchronize().map_err(device_error)?;
        }
        let [k, kp, v, vp] = planes;
        let buffers = match self.gpu {
            GpuCodec::Bf16 => vec![word_bytes(&k), word_bytes(&v)],
            GpuCodec::Affine { .. } => vec![
                word_bytes(&k),
                word_bytes(&kp),
                word_bytes(&v),
                word_bytes(&vp),
                f32_bytes(&match &self.means {
                    Some(m) => m.values(&self.kernels)?,
                    None => std::borrow::Cow::Borrowed(&[][..]),
                }),
            ],
            GpuCodec::Turbo { .. } => {
                let t = self.turbo.as_ref().expect("turbo planes keep their tables");
                let tables = host_tables(t.host.as_ref())?;
                vec![
                    word_bytes(&k),
                    norms_to_f16_bytes(&kp),
                    word_bytes(&v),
                    norms_to_f16_bytes(&vp),
                    tables
                        .key_mean
                        .as_deref()
                        .map(f32_bytes)
                        .unwrap_or_default(),
                    tables
                        .key_scale
                        .as_deref()
                        .map(f32_bytes)
                        .unwrap_or_default(),
                ]
            }
        };
        Ok(PlanesState {
            codec: self.codec(),
            geometry: self.geometry,
            capacity,
            buffers,
        })
    }

    fn restore(&mut self, state: &PlanesState) -> Result<(), KvError> {
        self.generation = next_generation();
        let count = match self.gpu {
            GpuCodec::Bf16 => 2,
            // Five with the key means; four from a state written before keys were centred.
            GpuCodec::Affine { .. } => state.buffers.len().clamp(4, 5),
            GpuCodec::Turbo { .. } => 6,
        };
        if state.codec != self.codec()
            || state.geometry != self.geometry
            || state.buffers.len() != count
        {
            return Err(KvError::BadState(format!(
                "CUDA planes of {} {:?} given a state of {} {:?} with {} buffers",
                self.codec(),
                self.geometry,
                state.codec,
                state.geometry,
                state.buffers.len()
            )));
        }
        let capacity = state.capacity;
        let [nk, nkp, nv, nvp] = self.state_words(capacity);
        let b = &state.buffers;
        let (k, kp, v, vp) = match self.gpu {
            GpuCodec::Bf16 => (
                bytes_words(&b[0], nk, "bf16 keys")?,
                Vec::new(),
                bytes_words(&b[1], nv, "bf16 values")?,
                Vec::new(),
            ),
            GpuCodec::Affine { .. } => (
                bytes_words(&b[0], nk, "affine key codes")?,
                bytes_words(&b[1], nkp, "affine key parameters")?,
                bytes_words(&b[2], nv, "affine value codes")?,
                bytes_words(&b[3], nvp, "affine value parameters")?,
            ),
            GpuCodec::Turbo { .. } => (
                bytes_words(&b[0], nk, "turbo key codes")?,
                f16_bytes_to_norms(&b[1], nkp, "turbo key norms")?,
                bytes_words(&b[2], nv, "turbo value codes")?,
                f16_bytes_to_norms(&b[3], nvp, "turbo value norms")?,
            ),
        };
        if let Some(m) = &mut self.means {
            // The host planes hold no slots: only the key means travel to them.
            let mut buffers = vec![Vec::new(); 4];
            buffers.extend(b.get(4).cloned());
            m.host.restore(&PlanesState {
                codec: state.codec,
                geometry: state.geometry,
                capacity: 0,
                buffers,
            })?;
            self.refresh_means()?;
        }
        if let Some(t) = &mut self.turbo {
            // The host planes hold no slots: only the key preparation travels to them.
            t.host.restore(&PlanesState {
                codec: state.codec,
                geometry: state.geometry,
                capacity: 0,
                buffers: vec![
                    Vec::new(),
                    Vec::new(),
                    Vec::new(),
                    Vec::new(),
                    b[4].clone(),
                    b[5].clone(),
                ],
            })?;
            t.device = Arc::new(upload_tables(
                &self.kernels,
                t.host.as_ref(),
                self.geometry,
            )?);
        }
        if capacity == 0 {
            self.planes = None;
            return Ok(());
        }
        let mut planes = self.alloc(capacity).map_err(device_error)?;
        let s = &self.kernels.read.stream;
        let mut upload = || -> anyhow::Result<()> {
            for (host, dev) in [
                (&k, &mut planes.k),
                (&kp, &mut planes.kp),
                (&v, &mut planes.v),
                (&vp, &mut planes.vp),
            ] {
                if !host.is_empty() {
                    s.memcpy_htod(host.as_slice(), dev)?;
                }
            }
            // The host vectors are freed on return: the copies must have been made.
            s.synchronize()?;
            Ok(())
        };
        upload().map_err(device_error)?;
        self.planes = Some(planes);
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl CudaPlanes {
    fn profile_op(&self, base: usize) -> usize {
        base + usize::from(self.gpu != GpuCodec::Bf16)
    }

    fn write_now(
        &mut self,
        rows: Range<usize>,
        slot: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(), KvError> {
        self.check_rows(&rows, "write")?;
        let (kr, kh, n, _) = k.dims4()?;
        let (vr, vh, vn, _) = v.dims4()?;
        if kr != rows.len() || vr != rows.len() || kh != self.geometry.heads || vh != kh || vn != n
        {
            return Err(KvError::Device(format!(
                "a CUDA write into rows {rows:?} of {:?} given keys {:?} and values {:?}",
                self.geometry,
                k.dims(),
                v.dims()
            )));
        }
        self.check_slots(slot, n, "write")?;
        if rows.is_empty() || n == 0 {
            return Ok(());
        }
        let mut planes = self
            .planes
            .take()
            .ok_or_else(|| KvError::Device("write before reserve".into()))?;
        let done = self.encode(k, v, &mut planes, slot, rows.start, None);
        self.planes = Some(planes);
        done
    }

    fn read_now(
        &self,
        rows: Range<usize>,
        slot: usize,
        len: usize,
    ) -> Result<(Tensor, Tensor), KvError> {
        self.check_rows(&rows, "read")?;
        let g = self.geometry;
        let shape = [rows.len(), g.heads, len, g.head_dim];
        if rows.is_empty() || len == 0 {
            let device = Device::Cuda(self.kernels.device.clone());
            let zeros = Tensor::zeros(shape.as_slice(), DType::F32, &device)?;
            let vshape = [rows.len(), g.heads, len, g.value_dim];
            return Ok((
                zeros,
                Tensor::zeros(vshape.as_slice(), DType::F32, &device)?,
            ));
        }
        self.check_slots(slot, len, "read")?;
        let p = self.planes()?;
        let k = self.decode_slots(&p.k, &p.kp, rows.clone(), p.capacity, slot, len, 0)?;
        let v = self.decode_slots(&p.v, &p.vp, rows.clone(), p.capacity, slot, len, 1)?;
        let mut keys = wrap(&self.kernels, k, &shape);
        if let Some(m) = &self.means {
            // The stored keys are centred: their means (the device's, always current) added
            // back.
            let per_row = g.heads * g.head_dim;
            let span = rows.start * per_row..rows.end * per_row;
            if m.device.len() < span.end {
                return Err(KvError::Device(format!(
                    "key means for rows {rows:?} missing"
                )));
            }
            let means = self
                .kernels
                .read
                .stream
                .clone_dtod(&m.device.slice(span))
                .map_err(device_error)?;
            let means = wrap(&self.kernels, means, &[rows.len(), g.heads, 1, g.head_dim]);
            keys = keys.broadcast_add(&means)?;
        }
        Ok((keys, wrap(&self.kernels, v, &shape)))
    }

    /// Deterministic mode's chunk read: each query read as a decode read of the slots it
    /// sees (one launch row a query, the same kernel and splits as a decode step's read),
    /// so a position's attention has the same bits however its prompt was chunked, padded
    /// or batched.
    fn chunk_as_decodes(
        &self,
        q: &Tensor,
        geometry: &ChunkGeometry,
        scale: f32,
    ) -> Result<Tensor, KvError> {
        let geo = self.geometry;
        let (b, qh, n, d) = q.dims4()?;
        if b != geo.rows
            || geometry.rows.len() != b
            || d != geo.head_dim
            || geo.value_dim != geo.head_dim
            || qh % geo.heads != 0
        {
            return Err(KvError::QueryShape {
                got: q.dims().to_vec(),
                detail: format!("a deterministic CUDA chunk read over {geo:?}"),
            });
        }
        let planes = self.planes()?;
        if geometry.slots > planes.capacity {
            return Err(KvError::Device(format!(
                "a chunk read of {} slots over planes of {}",
                geometry.slots, planes.capacity
            )));
        }
        // Positions [start, end) query i of row r sees, for queries `range` of every row,
        // row-major: the launch rows of one decode read.
        let spans_of = |range: Range<usize>| -> Vec<(usize, usize)> {
            (0..b)
                .flat_map(|r| range.clone().map(move |i| (r, i)))
                .map(|(r, i)| {
                    let v = geometry.visible(r, i);
                    (v.start, v.end)
                })
                .collect()
        };
        let max_len = spans_of(0..n).iter().map(|s| s.1 - s.0).max().unwrap_or(0);
        // One plan for every group (a row's splits past its end merge as exact zeros), and
        // groups of queries whose partial states stay under DETERMINISTIC_STATES: a long
        // chunk at a long context would otherwise ask for gigabytes of scratch.
        let plan = Plan::deterministic(max_len);
        let per_group = (DETERMINISTIC_STATES / (b * qh * plan.splits).max(1)).clamp(1, n.max(1));
        let g = qh / geo.heads;
        let k = &self.kernels;
        let read = &k.read;
        let mut scratch = read
            .scratch_rows(&plan, b * per_group, planes, g)
            .map_err(device_error)?;
        let mut outs = Vec::new();
        for first in (0..n).step_by(per_group) {
            let m = per_group.min(n - first);
            let spans = spans_of(first..first + m);
            // The group's queries as launch rows: (b, m, qh, d), row r's query i at r · m + i.
            let rows_q = f32_storage(&q.narrow(2, first, m)?.transpose(1, 2)?.contiguous()?)?;
            let out = with_f32(&rows_q, |qs, offset| {
                let qs = qs.slice(offset..);
                // SAFETY: the merge writes every element of `out` before anything reads it.
                let mut out = unsafe { read.stream.alloc::<f32>(b * m * qh * d)? };
                read.decode(
                    &plan,
                    planes,
                    g,
                    &qs,
                    scale,
                    &spans,
                    None,
                    &mut scratch,
                    &mut out,
                )?;
                Ok(out)
            })?;
            outs.push(wrap(k, out, &[b, m, qh, d]));
        }
        Ok(Tensor::cat(&outs, 1)?.transpose(1, 2)?.contiguous()?)
    }

    /// The fused chunk read where this codec and shape have one (see `Planes::chunk`).
    fn chunk_now(
        &self,
        q: &Tensor,
        pads: &[usize],
        start: usize,
        scale: f32,
    ) -> Result<Option<Tensor>, KvError> {
        let geo = self.geometry;
        let (b, qh, n, d) = q.dims4()?;
        if b != geo.rows || d != geo.head_dim || qh % geo.heads != 0 || pads.len() != b {
            return Err(KvError::QueryShape {
                got: q.dims().to_vec(),
                detail: format!("a CUDA chunk read over {geo:?}"),
            });
        }
        let g = qh / geo.heads;
        let k = &self.kernels;
        let served = geo.value_dim == geo.head_dim
            && g <= 8
            && k.read.has_chunk(self.gpu, d, g).map_err(device_error)?;
        if !served || b * qh * n == 0 {
            return Ok(None);
        }
        let planes = self.planes()?;
        let q = f32_storage(q)?;
        let pads: Vec<i32> = pads.iter().map(|&p| p as i32).collect();
        let out = with_f32(&q, |qs, offset| {
            let qs = qs.slice(offset..);
            let s = &k.read.stream;
            let pads = s.clone_htod(&pads)?;
            let mut out = s.alloc_zeros::<f32>(b * qh * n * d)?;
            k.read
                .chunk(planes, g, &qs, scale, &pads, start, n, 0, &mut out)?;
            Ok(out)
        })?;
        Ok(Some(wrap(k, out, &[b, qh, n, d])))
    }

    /// How a live step at `spans` reads: `(plan, query heads per KV head)`, the plan an
    /// ordinary read of the same spans has, so that both give the same bits. Its splits are
    /// a captured graph's (part of the identity); its chunk travels in device memory.
    fn live_plan(
        &self,
        spans: &[(usize, usize)],
        query_heads: usize,
    ) -> Result<(Plan, usize), KvError> {
        let geo = self.geometry;
        let planes = self.planes()?;
        if !self.serves_live()
            || spans.len() != geo.rows
            || query_heads % geo.heads.max(1) != 0
            || spans
                .iter()
                .any(|&(start, slot)| start > slot || slot >= planes.capacity)
        {
            return Err(KvError::Device(format!(
                "live spans {spans:?} for {query_heads} query heads over {geo:?} of {} slots",
                planes.capacity
            )));
        }
        let g = query_heads / geo.heads;
        let longest = spans.iter().map(|&(a, s)| s + 1 - a).max().unwrap_or(0);
        let plan = self
            .kernels
            .read
            .plan(None, planes, g, longest)
            .map_err(device_error)?;
        Ok((plan, g))
    }

    /// The identity [`Planes::live_spans`] returns: what a captured live step holds.
    fn live_hash(&self, plan: &Plan, g: usize) -> u64 {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let mut h = DefaultHasher::new();
        let scratch = self.kernels.scratch_generation.load(Ordering::Relaxed);
        (self.generation, scratch, plan.splits, plan.variant, g).hash(&mut h);
        h.finish()
    }

    /// A live step: the append at each row's slot, then the read, its merge advancing the
    /// slots (the spans and the plan as [`Planes::live_spans`] left them).
    fn live_now(
        &mut self,
        live: &mut Live,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f32,
    ) -> Result<Tensor, KvError> {
        let mut planes = self
            .planes
            .take()
            .ok_or_else(|| KvError::Device("a live step before reserve".into()))?;
        let written = self.encode(k, v, &mut planes, 0, 0, Some(&live.desc));
        self.planes = Some(planes);
        written?;
        let planes = self.planes()?;
        let (b, qh, _, d) = q.dims4()?;
        let q = f32_storage(q)?;
        let kernels = &self.kernels;
        let out = with_f32(&q, |qs, offset| {
            let qs = qs.slice(offset..);
            let read = &kernels.read;
            let mut scratch = kernels.scratch.lock().unwrap_or_else(|e| e.into_inner());
            let scratch = scratch
                .as_mut()
                .filter(|s| s.fits(&live.plan, planes, live.group))
                .context("the live read's scratch, sized by its spans, was replaced")?;
            // SAFETY: the merge writes every element of `out` before anything reads it.
            let mut out = unsafe { read.stream.alloc::<f32>(b * qh * d)? };
            read.decode(
                &live.plan,
                planes,
                live.group,
                &qs,
                scale,
                &[],
                Some(&mut live.desc),
                scratch,
                &mut out,
            )?;
            Ok(out)
        })?;
        Ok(wrap(kernels, out, &[b, qh, 1, d]))
    }

    fn decode_now(
        &self,
        q: &Tensor,
        spans: &[(usize, usize)],
        scale: f32,
    ) -> Result<Tensor, KvError> {
        let planes = self.planes()?;
        let geo = self.geometry;
        let (b, qh, n, d) = q.dims4()?;
        if b != geo.rows || n != 1 || d != geo.head_dim || qh % geo.heads != 0 {
            return Err(KvError::QueryShape {
                got: q.dims().to_vec(),
                detail: format!("a CUDA decode read over {geo:?}"),
            });
        }
        let g = qh / geo.heads;
        let q = f32_storage(q)?;
        let k = &self.kernels;
        let max_len = spans.iter().map(|s| s.1 - s.0).max().unwrap_or(0);
        let out = with_f32(&q, |qs, offset| {
            let qs = qs.slice(offset..);
            let read = &k.read;
            let plan = read.plan(None, planes, g, max_len)?;
            let mut scratch = k.scratch.lock().unwrap_or_else(|e| e.into_inner());
            if !scratch.as_ref().is_some_and(|s| s.fits(&plan, planes, g)) {
                *scratch = Some(read.scratch(&plan, planes, g)?);
                k.scratch_generation
                    .store(next_generation(), Ordering::Relaxed);
            }
            let scratch = scratch.as_mut().expect("just made");
            // SAFETY: the merge writes every element of `out` before anything reads it.
            let mut out = unsafe { read.stream.alloc::<f32>(b * qh * d)? };
            read.decode(&plan, planes, g, &qs, scale, spans, None, scratch, &mut out)?;
            Ok(out)
        })?;
        Ok(wrap(k, out, &[b, qh, 1, d]))
    }
}
