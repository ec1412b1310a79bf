//! tessera-kv's device backend on CUDA: a layer's planes as device words in the CPU
//! cache's layout, written by the encode kernel on every append (planes.cu), decoded to f32
//! for chunk reads, and read by the fused decode kernel (decode.cu). Everything runs on
//! candle's stream for the device, so the model's tensors and the cache's kernels are
//! ordered without host synchronization.
//!
//! Served: bf16 (plain), affine 4/8 bits with groups of 32, 64 or 128, and TurboQuant of
//! 2..=8 bits, for head dims of 64, 128 or 256 with keys and values of one width. Other
//! codecs get an error naming them when the cache is first used on the device.

use crate::cuda::{compile_source, DecodeRead, GpuCodec, GpuPlanes, Scratch, TurboDevice};
use crate::PLANES_CU;
use anyhow::{anyhow, Context};
use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Storage, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// `TESSERA_KV_PROFILE=1`: synchronize around each cache write and decode read and print
/// their mean wall times to stderr every 4096 calls (a diagnostic; it slows the run).
fn profiling() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TESSERA_KV_PROFILE").is_ok_and(|v| v == "1"))
}

/// (calls, nanoseconds) of bf16 writes, quantized (affine, turbo) writes, bf16 reads,
/// quantized reads.
static PROFILE: [(AtomicU64, AtomicU64); 4] = [
    (AtomicU64::new(0), AtomicU64::new(0)),
    (AtomicU64::new(0), AtomicU64::new(0)),
    (AtomicU64::new(0), AtomicU64::new(0)),
    (AtomicU64::new(0), AtomicU64::new(0)),
];

fn timed<R>(kernels: &Kernels, op: usize, f: impl FnOnce() -> R) -> R {
    if !profiling() {
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
use tessera_kv::device::{DeviceBackend, DevicePlanes, PlaneGeometry};
use tessera_kv::turbo_planes::TurboPlanes;
use tessera_kv::{grown_capacity, Codec, KvError, PlainDType, TurboPrep};

/// The kernels of one device.
struct Kernels {
    device: CudaDevice,
    read: DecodeRead,
    encode: CudaFunction,
    decode: CudaFunction,
    turbo_encode: CudaFunction,
    turbo_decode: CudaFunction,
    copy: CudaFunction,
    /// The decode reads' partial states, shared by every layer (the reads run in stream
    /// order; the lock is held from a read's first launch to its last).
    scratch: Mutex<Option<Scratch>>,
}

/// Installs the CUDA backend into tessera-kv (once per process).
pub fn install() {
    tessera_kv::device::install(Box::new(CudaBackend::new()));
}

pub struct CudaBackend {
    /// Built on first use, for the first CUDA device seen.
    kernels: Mutex<Option<Arc<Kernels>>>,
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
        }
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
        let module = compile_source(stream.context(), PLANES_CU).context("planes.cu")?;
        let k = Arc::new(Kernels {
            device: device.clone(),
            read: DecodeRead::with_stream(stream)?,
            encode: module.load_function("encode_rows")?,
            decode: module.load_function("decode_rows")?,
            turbo_encode: module.load_function("turbo_encode")?,
            turbo_decode: module.load_function("turbo_decode_rows")?,
            copy: module.load_function("copy_blocks")?,
            scratch: Mutex::new(None),
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
    ) -> Result<Option<Box<dyn DevicePlanes>>, KvError> {
        let Device::Cuda(dev) = device else {
            return Ok(None);
        };
        let gpu = gpu_codec(codec, geometry).map_err(|reason| KvError::DeviceCodec {
            codec: codec.to_string(),
            device: "cuda".into(),
            reason,
        })?;
        let kernels = self.kernels(dev).map_err(device_error)?;
        let turbo = match codec {
            Codec::Turbo { kbits, vbits, .. } => {
                let g = geometry;
                let host = TurboPlanes::new(kbits, vbits, g.rows, g.heads, g.head_dim, g.value_dim);
                let device =
                    TurboDevice::upload(&kernels.read.stream, &host.tables(), g.heads, g.head_dim)
                        .map_err(device_error)?;
                Some(TurboState {
                    host,
                    device: Arc::new(device),
                })
            }
            _ => None,
        };
        Ok(Some(Box::new(CudaPlanes {
            kernels,
            codec,
            gpu,
            geometry,
            planes: None,
            turbo,
        })))
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
}

/// A turbo layer's tables: tessera-kv's empty planes of the codec (its rotations and
/// codebooks, and where the key preparation is fitted, with the CPU's own code) and their
/// copy on the device.
struct TurboState {
    host: TurboPlanes,
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

impl CudaPlanes {
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

    /// Encodes `x` `(blocks, n, d)` into slots `slot ..` of `codes`/`params` (`cap` slots)
    /// of `plane` (0 keys, 1 values).
    fn encode(
        &self,
        x: &Tensor,
        codes: &mut CudaSlice<u32>,
        params: &mut CudaSlice<u32>,
        cap: usize,
        slot: usize,
        plane: usize,
    ) -> Result<(), KvError> {
        let (b, h, n, d) = x.dims4()?;
        let x = f32_storage(x)?;
        let k = &self.kernels;
        if let Some(t) = &self.turbo {
            return self.turbo_encode(&x, (b * h, n, d), codes, params, cap, slot, plane, t);
        }
        let (bits, group) = self.bits_group();
        let per_row = if bits == 0 { d / 2 } else { d / group as usize };
        with_f32(&x, |xs, offset| {
            let xs = xs.slice(offset..);
            let (blocks, n, d, cap, slot) =
                ((b * h) as i64, n as i32, d as i32, cap as i32, slot as i32);
            let mut l = k.read.stream.launch_builder(&k.encode);
            l.arg(&xs)
                .arg(codes)
                .arg(params)
                .arg(&blocks)
                .arg(&n)
                .arg(&d)
                .arg(&cap)
                .arg(&slot)
                .arg(&bits)
                .arg(&group);
            // bf16: a thread per word; affine: a warp per group.
            let lanes = if bits == 0 { 1 } else { 32 };
            unsafe { l.launch(grid(b * h * n as usize * per_row * lanes))? };
            Ok(())
        })
    }

    /// Slots `slot .. slot + len` of `codes`/`params` (`cap` slots) of `plane` as f32
    /// `(blocks, len, d)`.
    #[allow(clippy::too_many_arguments)]
    fn decode_slots(
        &self,
        codes: &CudaSlice<u32>,
        params: &CudaSlice<u32>,
        blocks: usize,
        cap: usize,
        slot: usize,
        len: usize,
        plane: usize,
    ) -> Result<CudaSlice<f32>, KvError> {
        let k = &self.kernels;
        let d = self.geometry.head_dim;
        if let Some(t) = &self.turbo {
            return self.turbo_decode(codes, params, (blocks, cap, slot, len), plane, t);
        }
        let (bits, group) = self.bits_group();
        let run = || -> anyhow::Result<CudaSlice<f32>> {
            let mut out = k
                .read
                .stream
                .alloc_zeros::<f32>((blocks * len * d).max(1))?;
            let (nb, len_i, d_i, cap, slot) =
                (blocks as i64, len as i32, d as i32, cap as i32, slot as i32);
            let mut l = k.read.stream.launch_builder(&k.decode);
            l.arg(codes)
                .arg(params)
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

    /// The turbo encode of `x` (f32, contiguous, `(blocks, n, d)`), as [`Self::encode`].
    #[allow(clippy::too_many_arguments)]
    fn turbo_encode(
        &self,
        x: &Tensor,
        (blocks, n, d): (usize, usize, usize),
        codes: &mut CudaSlice<u32>,
        norms: &mut CudaSlice<u32>,
        cap: usize,
        slot: usize,
        plane: usize,
        t: &TurboState,
    ) -> Result<(), KvError> {
        let k = &self.kernels;
        let dev = &t.device;
        let bits = self.turbo_bits(plane);
        // Values carry no preparation.
        let prep = if plane == 0 { dev.prep } else { 0 };
        with_f32(x, |xs, offset| {
            let xs = xs.slice(offset..);
            let signs = dev.signs.slice(plane * d..(plane + 1) * d);
            let thresholds = dev.thresholds.slice(plane * 256..(plane + 1) * 256);
            let (nb, n_i, d_i, cap, slot) =
                (blocks as i64, n as i32, d as i32, cap as i32, slot as i32);
            let (levels, heads) = (dev.counts[plane] as i32, self.geometry.heads as i32);
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
                .arg(&heads)
                .arg(&prep)
                .arg(&dev.mean)
                .arg(&dev.scale);
            unsafe { l.launch(per_vector(blocks * n, d))? };
            Ok(())
        })
    }

    /// The turbo decode of slots, as [`Self::decode_slots`] (keys with their preparation
    /// undone).
    fn turbo_decode(
        &self,
        codes: &CudaSlice<u32>,
        norms: &CudaSlice<u32>,
        (blocks, cap, slot, len): (usize, usize, usize, usize),
        plane: usize,
        t: &TurboState,
    ) -> Result<CudaSlice<f32>, KvError> {
        let k = &self.kernels;
        let dev = &t.device;
        let d = self.geometry.head_dim;
        let bits = self.turbo_bits(plane);
        let prep = if plane == 0 { dev.prep } else { 0 };
        let run = || -> anyhow::Result<CudaSlice<f32>> {
            // SAFETY: the kernel writes every element (one block per row, d threads).
            let mut out = unsafe { k.read.stream.alloc::<f32>((blocks * len * d).max(1))? };
            let signs = dev.signs.slice(plane * d..(plane + 1) * d);
            let levels = dev.levels.slice(plane * 256..(plane + 1) * 256);
            let (nb, len_i, d_i, cap, slot) =
                (blocks as i64, len as i32, d as i32, cap as i32, slot as i32);
            let heads = self.geometry.heads as i32;
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
                .arg(&heads)
                .arg(&prep)
                .arg(&dev.mean)
                .arg(&dev.scale);
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
        let s = &self.kernels.read.stream;
        let rows = self.blocks() * capacity;
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

    fn planes(&self) -> Result<&GpuPlanes, KvError> {
        self.planes
            .as_ref()
            .ok_or_else(|| KvError::Device("read before any position was stored".into()))
    }
}

impl DevicePlanes for CudaPlanes {
    fn codec(&self) -> Codec {
        self.codec
    }

    fn capacity(&self) -> usize {
        self.planes.as_ref().map_or(0, |p| p.capacity)
    }

    fn reserve(&mut self, slots: usize, limit: usize) -> Result<(), KvError> {
        if slots <= self.capacity() {
            return Ok(());
        }
        let capacity = grown_capacity(slots, limit);
        let mut grown = self.alloc(capacity).map_err(device_error)?;
        if let Some(old) = &self.planes {
            self.copy_into(old, &mut grown).map_err(device_error)?;
        }
        self.planes = Some(grown);
        Ok(())
    }

    fn write(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<(), KvError> {
        let (kernels, op) = (self.kernels.clone(), self.profile_op(0));
        timed(&kernels, op, || self.write_now(slot, k, v))
    }

    fn read(&self, slot: usize, len: usize) -> Result<(Tensor, Tensor), KvError> {
        self.read_now(slot, len)
    }

    fn as_stored(&self, x: &Tensor, keys: bool) -> Result<Tensor, KvError> {
        self.as_stored_now(x, usize::from(!keys))
    }

    fn fit_key_prep(&mut self, k: &Tensor, prep: TurboPrep) -> Result<(), KvError> {
        let Some(t) = &mut self.turbo else {
            return Ok(());
        };
        t.host.fit_key_prep(k, prep)?;
        let g = self.geometry;
        let device = TurboDevice::upload(
            &self.kernels.read.stream,
            &t.host.tables(),
            g.heads,
            g.head_dim,
        )
        .map_err(device_error)?;
        t.device = Arc::new(device);
        if let Some(p) = &mut self.planes {
            p.turbo = Some(t.device.clone());
        }
        Ok(())
    }

    fn decode(&self, q: &Tensor, spans: &[(usize, usize)], scale: f32) -> Result<Tensor, KvError> {
        timed(&self.kernels, self.profile_op(2), || {
            self.decode_now(q, spans, scale)
        })
    }

    fn chunk(
        &self,
        q: &Tensor,
        pads: &[usize],
        start: usize,
        scale: f32,
    ) -> Result<Option<Tensor>, KvError> {
        self.chunk_now(q, pads, start, scale)
    }

    fn allocated_bytes(&self) -> usize {
        self.planes
            .as_ref()
            .map_or(0, |p| 4 * (p.k.len() + p.v.len() + p.kp.len() + p.vp.len()))
    }

    fn bytes_per_position(&self) -> usize {
        let ((wk, pk), (wv, pv)) = (self.words(0), self.words(1));
        self.geometry.heads * 4 * (wk + pk + wv + pv)
    }
}

impl CudaPlanes {
    fn profile_op(&self, base: usize) -> usize {
        base + usize::from(self.gpu != GpuCodec::Bf16)
    }

    fn write_now(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<(), KvError> {
        let mut planes = self
            .planes
            .take()
            .ok_or_else(|| KvError::Device("write before reserve".into()))?;
        let cap = planes.capacity;
        let done = self
            .encode(k, &mut planes.k, &mut planes.kp, cap, slot, 0)
            .and_then(|_| self.encode(v, &mut planes.v, &mut planes.vp, cap, slot, 1));
        self.planes = Some(planes);
        done
    }

    fn read_now(&self, slot: usize, len: usize) -> Result<(Tensor, Tensor), KvError> {
        let p = self.planes()?;
        let g = self.geometry;
        let shape = [g.rows, g.heads, len, g.head_dim];
        let k = self.decode_slots(&p.k, &p.kp, self.blocks(), p.capacity, slot, len, 0)?;
        let v = self.decode_slots(&p.v, &p.vp, self.blocks(), p.capacity, slot, len, 1)?;
        Ok((
            wrap(&self.kernels, k, &shape),
            wrap(&self.kernels, v, &shape),
        ))
    }

    /// `x` encoded into a scratch plane of `plane`'s codec and decoded back.
    fn as_stored_now(&self, x: &Tensor, plane: usize) -> Result<Tensor, KvError> {
        let (b, h, n, d) = x.dims4()?;
        let (w, p) = self.words(plane);
        let s = &self.kernels.read.stream;
        let scratch = || -> anyhow::Result<(CudaSlice<u32>, CudaSlice<u32>)> {
            Ok((
                s.alloc_zeros::<u32>((b * h * n * w).max(1))?,
                s.alloc_zeros::<u32>((b * h * n * p).max(1))?,
            ))
        };
        let (mut codes, mut params) = scratch().map_err(device_error)?;
        self.encode(x, &mut codes, &mut params, n, 0, plane)?;
        let out = self.decode_slots(&codes, &params, b * h, n, 0, n, plane)?;
        Ok(wrap(&self.kernels, out, &[b, h, n, d]))
    }

    /// The fused chunk read where this codec and shape have one (see `DevicePlanes::chunk`).
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
        if !served {
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
            }
            let scratch = scratch.as_mut().expect("just made");
            // SAFETY: the merge writes every element of `out` before anything reads it.
            let mut out = unsafe { read.stream.alloc::<f32>(b * qh * d)? };
            read.decode(&plan, planes, g, &qs, scale, spans, scratch, &mut out)?;
            Ok(out)
        })?;
        Ok(wrap(k, out, &[b, qh, 1, d]))
    }
}
