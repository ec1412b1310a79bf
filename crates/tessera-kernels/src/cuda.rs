//! Launching the decode read on a CUDA stream: NVRTC compilation per configuration, cached;
//! device planes in the CPU cache's layout (uploaded as they are); the two launches.

use crate::dependent::DependentLaunch;
use crate::{plan_splits, DECODE_CU};
use anyhow::{bail, Context, Result};
use candle_core::cuda_backend::cudarc;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtrMut, DeviceRepr,
    LaunchConfig, PushKernelArg,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// How a plane's rows are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuCodec {
    Bf16,
    /// Affine codes of 4 or 8 bits with an f16 (scale, bias) per `group` elements.
    Affine {
        bits: u8,
        group: usize,
    },
    /// TurboQuant codes (`kbits` for keys, `vbits` for values, 2..=8) of the rotated unit
    /// vector, with one word per row holding its f16 norm.
    Turbo {
        kbits: u8,
        vbits: u8,
    },
}

impl GpuCodec {
    /// The decode kernels' #defines for this codec (besides D and G).
    fn defines(&self) -> String {
        match *self {
            GpuCodec::Bf16 => "#define CODEC 0\n#define GROUP 64".into(),
            GpuCodec::Affine { bits, group } => {
                format!("#define CODEC {bits}\n#define GROUP {group}")
            }
            GpuCodec::Turbo { kbits, vbits } => {
                format!("#define CODEC 1\n#define GROUP 64\n#define KBITS {kbits}\n#define VBITS {vbits}")
            }
        }
    }

    /// u32 words of one stored row of `d` elements of plane `plane` (0 keys, 1 values),
    /// and of its parameters ((scale, bias) pairs; a turbo row's norm).
    pub fn plane_words(&self, d: usize, plane: usize) -> (usize, usize) {
        match *self {
            GpuCodec::Bf16 => (d / 2, 0),
            GpuCodec::Affine { bits, group } => (d * bits as usize / 32, d / group),
            GpuCodec::Turbo { kbits, vbits } => {
                let bits = if plane == 0 { kbits } else { vbits };
                (d * bits as usize / 32, 1)
            }
        }
    }

    pub fn name(&self) -> String {
        match *self {
            GpuCodec::Bf16 => "bf16".into(),
            GpuCodec::Affine { bits, group } => format!("affine:{bits}:{group}"),
            GpuCodec::Turbo { kbits, vbits } => format!("turbo:{kbits}:{vbits}"),
        }
    }
}

/// A turbo layer's tables on the device (tessera-kv's `TurboTables`): per plane the
/// rotation's signs and the codebook, and the keys' fitted preparation.
pub struct TurboDevice {
    /// (2, 256): keys' levels, then values' (padded).
    pub levels: CudaSlice<f32>,
    /// (2, 256): thresholds, as `levels`.
    pub thresholds: CudaSlice<f32>,
    /// (2, d): keys' signs, then values'.
    pub signs: CudaSlice<f32>,
    /// Levels per plane (2^bits).
    pub counts: [usize; 2],
    /// Bit 0: keys centred on `mean`; bit 1: keys divided by `scale` (both (blocks, d),
    /// block = row · kv_heads + head, as the planes' blocks; zeros and ones where not
    /// fitted, so the query side can always multiply by `scale`).
    pub prep: i32,
    pub mean: CudaSlice<f32>,
    pub scale: CudaSlice<f32>,
}

impl TurboDevice {
    /// The tables of planes of `blocks` (rows · kv_heads) vectors per slot, of width `d`.
    pub fn upload(
        stream: &Arc<CudaStream>,
        t: &tessera_kv::planes::TurboTables,
        blocks: usize,
        d: usize,
    ) -> Result<Self> {
        let padded = |x: &[Vec<f32>; 2]| -> Vec<f32> {
            let mut out = vec![0f32; 512];
            for (p, v) in x.iter().enumerate() {
                out[p * 256..][..v.len()].copy_from_slice(v);
            }
            out
        };
        if t.signs.iter().any(|s| s.len() != d) {
            bail!(
                "turbo tables for dim {} on planes of dim {d}",
                t.signs[0].len()
            );
        }
        let prep = i32::from(t.key_mean.is_some()) | (i32::from(t.key_scale.is_some()) << 1);
        // One element at least: a launch needs a valid pointer even for no rows.
        let table = |x: &Option<Vec<f32>>, fill: f32, what: &str| -> Result<Vec<f32>> {
            match x {
                None => Ok(vec![fill; (blocks * d).max(1)]),
                Some(x) if x.len() != blocks * d => {
                    bail!(
                        "turbo key {what} of {} values for {blocks} blocks of {d}",
                        x.len()
                    )
                }
                Some(x) if x.is_empty() => Ok(vec![fill]),
                Some(x) => Ok(x.clone()),
            }
        };
        let mean = table(&t.key_mean, 0.0, "mean")?;
        let scale = table(&t.key_scale, 1.0, "scale")?;
        Ok(TurboDevice {
            levels: stream.clone_htod(&padded(&t.levels))?,
            thresholds: stream.clone_htod(&padded(&t.thresholds))?,
            signs: stream.clone_htod(&t.signs.concat())?,
            counts: [t.levels[0].len(), t.levels[1].len()],
            prep,
            mean: stream.clone_htod(&mean)?,
            scale: stream.clone_htod(&scale)?,
        })
    }
}

/// Keys and values of one layer on the device: `(batch, kv_heads, capacity, ·)` words.
pub struct GpuPlanes {
    pub codec: GpuCodec,
    pub batch: usize,
    pub kv_heads: usize,
    pub capacity: usize,
    pub d: usize,
    pub k: CudaSlice<u32>,
    pub v: CudaSlice<u32>,
    /// (scale, bias) pairs as one u32 each (turbo: the f16 norm); a one-word dummy for bf16.
    pub kp: CudaSlice<u32>,
    pub vp: CudaSlice<u32>,
    /// Turbo planes' tables.
    pub turbo: Option<Arc<TurboDevice>>,
}

impl GpuPlanes {
    /// Bytes of keys and values (codes and group parameters) a read of `len` positions
    /// per (row, KV head) moves.
    pub fn bytes_for(
        codec: GpuCodec,
        batch: usize,
        kv_heads: usize,
        len: usize,
        d: usize,
    ) -> usize {
        let words = |p| {
            let (w, q) = codec.plane_words(d, p);
            w + q
        };
        4 * (words(0) + words(1)) * batch * kv_heads * len
    }
}

/// Which partial kernel a read runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Variant {
    /// CUDA cores: 8 elements per lane, scores reduced over a row's lanes.
    Simt,
    /// Tensor cores (mma.m16n8k16) for scores and values: bf16, 4/8-bit affine and 4-bit
    /// turbo rows.
    TensorCore,
    /// Tensor cores on raw affine codes, each row's scale and bias applied per group
    /// outside the mma, stored rows as the mma's M (4-bit rows with groups of 64 or more,
    /// 8-bit rows; d ≤ 128).
    Folded,
}

impl Variant {
    pub const ALL: [Variant; 3] = [Variant::Simt, Variant::TensorCore, Variant::Folded];
}

/// Rows one decode launch's spans cover (decode.cu's SPAN_ROWS); a larger batch launches
/// the partial kernel once per run of rows.
const SPAN_ROWS: usize = 256;

/// decode.cu's `struct Spans`: the positions each row of a launch attends, passed by value,
/// or (`live`, a device pointer) read from device memory.
#[repr(C)]
#[derive(Clone, Copy)]
struct Spans {
    row0: i32,
    /// Launch rows per stored row: a chunk read's queries as decode reads (1 for decode).
    nq: i32,
    start: [i32; SPAN_ROWS],
    end: [i32; SPAN_ROWS],
    live: u64,
}

// SAFETY: plain integers, laid out as the kernels' `struct Spans`.
unsafe impl DeviceRepr for Spans {}

/// A partial kernel and the blocks of it the driver fits on one SM (asked once).
#[derive(Clone)]
struct Partial {
    f: CudaFunction,
    per_sm: usize,
}

impl Partial {
    fn load(module: &Arc<cudarc::driver::CudaModule>, name: &str) -> Result<Self> {
        let f = module.load_function(name)?;
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(128, 0, None)?
            .max(1) as usize;
        Ok(Partial { f, per_sm })
    }
}

/// The partial kernels of one configuration (those the codec has) and the merge.
#[derive(Clone)]
struct Kernels {
    simt: Partial,
    tc: Option<Partial>,
    folded: Option<Partial>,
    /// The folded read for a chunk of queries (same codecs as `folded`).
    chunk: Option<Partial>,
    merge: CudaFunction,
    /// Turbo: the query's rotation before the read and the output's after it.
    turbo: Option<(CudaFunction, CudaFunction)>,
}

impl Kernels {
    fn partial(&self, variant: Variant) -> Option<&Partial> {
        match variant {
            Variant::Simt => Some(&self.simt),
            Variant::TensorCore => self.tc.as_ref(),
            Variant::Folded => self.folded.as_ref(),
        }
    }
}

/// The decode read's kernels on one stream, compiled on first use per configuration.
pub struct DecodeRead {
    pub stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    compiled: Mutex<HashMap<(GpuCodec, usize, usize), Kernels>>,
    /// The benchmarks' plane filler, compiled on first use: a whole decode.cu build that the
    /// engine never needs (1.25 s of NVRTC on a fresh machine).
    fill: OnceLock<CudaFunction>,
    sms: usize,
    /// `#define` lines added to every configuration ([`DecodeRead::with_defines`]).
    extra_defines: String,
}

fn compile(ctx: &Arc<CudaContext>, defines: &str) -> Result<Arc<cudarc::driver::CudaModule>> {
    crate::compile::load(ctx, &format!("{defines}\n{DECODE_CU}"))
}

/// decode.cu as compiled for reads of `codec` rows of `d` elements by `g` query heads per
/// KV head, with `extra` (`#define` lines) ahead of it.
pub fn decode_source(codec: GpuCodec, d: usize, g: usize, extra: &str) -> String {
    format!(
        "{}\n#define D {d}\n#define G {g}\n{extra}\n{DECODE_CU}",
        codec.defines()
    )
}

impl DecodeRead {
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx = CudaContext::new(ordinal).context("opening the CUDA device")?;
        Self::with_stream(ctx.default_stream())
    }

    /// The read on an existing stream (candle's, when the engine runs on the device).
    pub fn with_stream(stream: Arc<CudaStream>) -> Result<Self> {
        let ctx = stream.context().clone();
        let sms = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as usize;
        Ok(DecodeRead {
            stream,
            ctx,
            compiled: Mutex::new(HashMap::new()),
            fill: OnceLock::new(),
            sms,
            extra_defines: String::new(),
        })
    }

    /// The read with `defines` (`#define` lines) added to every configuration it compiles:
    /// the kernels' build choices, for experiments (kv-read-bench's variants).
    pub fn with_defines(mut self, defines: impl Into<String>) -> Self {
        self.extra_defines = defines.into();
        self
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn kernels(&self, codec: GpuCodec, d: usize, g: usize) -> Result<Kernels> {
        if ![64, 128, 256].contains(&d) || !(1..=8).contains(&g) {
            bail!("decode read: head dim {d} / {g} query heads per KV head not supported");
        }
        let mut map = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = map.get(&(codec, d, g)) {
            return Ok(k.clone());
        }
        let module =
            crate::compile::load(&self.ctx, &decode_source(codec, d, g, &self.extra_defines))?;
        // The tensor-core kernel gives each lane d/4 elements of a key row and d/8 of a
        // value row, which must lie in one affine group.
        // For bf16 rows of 256 the tensor-core kernel's registers (two tiles of 16 rows
        // in flight) cost more occupancy than it gains: measured slower there.
        let tc = match codec {
            GpuCodec::Bf16 if d <= 128 => Some(Partial::load(&module, "kv_decode_partial_tc")?),
            GpuCodec::Bf16 => None,
            GpuCodec::Affine { bits: 4, group } if d / 4 <= group => {
                Some(Partial::load(&module, "kv_decode_partial_tc")?)
            }
            // 8-bit rows of 256 spill (a lane holds 64 key bytes per row, two tiles deep).
            GpuCodec::Affine { bits: 8, group } if d / 4 <= group && d <= 128 => {
                Some(Partial::load(&module, "kv_decode_partial_tc")?)
            }
            // 4-bit turbo rows: code bytes through a table of f16 level pairs.
            GpuCodec::Turbo { kbits: 4, vbits: 4 } => {
                Some(Partial::load(&module, "kv_decode_partial_tc")?)
            }
            GpuCodec::Affine { .. } | GpuCodec::Turbo { .. } => None,
        };
        // A folded lane reads (group · bits / 8) / 8 bytes of a value row per group: whole
        // words. Rows of 256 would hold too many registers (two tiles in flight).
        let foldable = matches!(codec, GpuCodec::Affine { bits, group }
            if (group * bits as usize / 8) % 32 == 0 && group <= d && d <= 128);
        let (folded, chunk) = if foldable {
            (
                Some(Partial::load(&module, "kv_decode_partial_fold")?),
                Some(Partial::load(&module, "kv_chunk_partial_fold")?),
            )
        } else if codec == GpuCodec::Bf16 && d <= 128 {
            // bf16 rows fold too (one group of 16-bit codes, split operands), for chunks;
            // their decode read stays on the tensor-core kernel (at the copy floor).
            (None, Some(Partial::load(&module, "kv_chunk_partial_fold")?))
        } else {
            (None, None)
        };
        let k = Kernels {
            simt: Partial::load(&module, "kv_decode_partial")?,
            tc,
            folded,
            chunk,
            merge: module.load_function("kv_decode_merge")?,
            turbo: match codec {
                GpuCodec::Turbo { .. } => Some((
                    module.load_function("turbo_rotate_queries")?,
                    module.load_function("turbo_unrotate")?,
                )),
                _ => None,
            },
        };
        map.insert((codec, d, g), k.clone());
        Ok(k)
    }

    /// Fills `p` with pseudo-random words: `kind` 0 codes, 1 bf16 pairs, 2 (scale, bias).
    pub fn fill(&self, p: &mut CudaSlice<u32>, seed: u32, kind: i32) -> Result<()> {
        let fill = match self.fill.get() {
            Some(f) => f,
            None => {
                let f = compile(
                    &self.ctx,
                    "#define CODEC 0\n#define D 128\n#define G 1\n#define GROUP 64",
                )?
                .load_function("fill_random")?;
                self.fill.get_or_init(|| f)
            }
        };
        let n = p.len() as i64;
        let mut b = self.stream.launch_builder(fill);
        b.arg(p).arg(&n).arg(&seed).arg(&kind);
        unsafe { b.launch(LaunchConfig::for_num_elems((n as u32).min(1 << 20)))? };
        Ok(())
    }

    /// Random planes of `codec` for a benchmark (uploads nothing).
    pub fn random_planes(
        &self,
        codec: GpuCodec,
        batch: usize,
        kv_heads: usize,
        capacity: usize,
        d: usize,
        seed: u32,
    ) -> Result<GpuPlanes> {
        let rows = batch * kv_heads * capacity;
        let ((wk, pk), (wv, pv)) = (codec.plane_words(d, 0), codec.plane_words(d, 1));
        let mut k = self.stream.alloc_zeros::<u32>(rows * wk)?;
        let mut v = self.stream.alloc_zeros::<u32>(rows * wv)?;
        let mut kp = self.stream.alloc_zeros::<u32>((rows * pk).max(1))?;
        let mut vp = self.stream.alloc_zeros::<u32>((rows * pv).max(1))?;
        let kind = if codec == GpuCodec::Bf16 { 1 } else { 0 };
        self.fill(&mut k, seed, kind)?;
        self.fill(&mut v, seed ^ 0x5555, kind)?;
        // (scale, bias) pairs; for turbo rows the low half, a small f16, is the norm.
        self.fill(&mut kp, seed ^ 0xaaaa, 2)?;
        self.fill(&mut vp, seed ^ 0x3333, 2)?;
        let turbo = match codec {
            GpuCodec::Turbo { kbits, vbits } => {
                let host = tessera_kv::planes::TurboPlanes::new(kbits, vbits, 1, kv_heads, d, d);
                Some(Arc::new(TurboDevice::upload(
                    &self.stream,
                    &host.tables(),
                    batch * kv_heads,
                    d,
                )?))
            }
            _ => None,
        };
        Ok(GpuPlanes {
            codec,
            batch,
            kv_heads,
            capacity,
            d,
            k,
            v,
            kp,
            vp,
            turbo,
        })
    }

    /// Uploads planes stored on the host in the CPU cache's layout.
    pub fn upload(
        &self,
        codec: GpuCodec,
        (batch, kv_heads, capacity, d): (usize, usize, usize, usize),
        k: &[u32],
        v: &[u32],
        kp: &[u32],
        vp: &[u32],
    ) -> Result<GpuPlanes> {
        let dummy = [0u32];
        let or_dummy = |x: &'_ [u32]| -> Vec<u32> {
            if x.is_empty() {
                dummy.to_vec()
            } else {
                x.to_vec()
            }
        };
        Ok(GpuPlanes {
            codec,
            batch,
            kv_heads,
            capacity,
            d,
            k: self.stream.clone_htod(k)?,
            v: self.stream.clone_htod(v)?,
            kp: self.stream.clone_htod(&or_dummy(kp))?,
            vp: self.stream.clone_htod(&or_dummy(vp))?,
            turbo: None,
        })
    }

    /// The kernel a read runs by default: the folded one where the codec has it, else
    /// tensor cores, else CUDA cores.
    pub fn default_variant(&self, codec: GpuCodec, d: usize, g: usize) -> Result<Variant> {
        let kernels = self.kernels(codec, d, g)?;
        Ok([Variant::Folded, Variant::TensorCore]
            .into_iter()
            .find(|&v| kernels.partial(v).is_some())
            .unwrap_or(Variant::Simt))
    }

    /// How a read of up to `max_len` positions per row runs with `variant` (the default
    /// kernel when `None`): one wave of the blocks the driver fits per SM.
    pub fn plan(
        &self,
        variant: Option<Variant>,
        planes: &GpuPlanes,
        g: usize,
        max_len: usize,
    ) -> Result<Plan> {
        if variant.is_none() && tessera_models::device_weights::deterministic() {
            return Ok(Plan::deterministic(max_len));
        }
        let variant = match variant {
            Some(v) => v,
            None => self.default_variant(planes.codec, planes.d, g)?,
        };
        let kernels = self.kernels(planes.codec, planes.d, g)?;
        let partial = kernels
            .partial(variant)
            .with_context(|| format!("no {variant:?} kernel for {}", planes.codec.name()))?;
        let (splits, chunk) = plan_splits(
            planes.batch,
            planes.kv_heads,
            max_len.max(1),
            partial.per_sm * self.sms,
        );
        Ok(Plan {
            variant,
            splits,
            chunk,
        })
    }

    /// Scratch for the partial softmax states of `plan` (reusable by any smaller plan).
    pub fn scratch(&self, plan: &Plan, planes: &GpuPlanes, g: usize) -> Result<Scratch> {
        self.scratch_rows(plan, planes.batch, planes, g)
    }

    /// Scratch for the states of `plan` over `rows` launch rows (a chunk read's queries).
    pub fn scratch_rows(
        &self,
        plan: &Plan,
        rows: usize,
        planes: &GpuPlanes,
        g: usize,
    ) -> Result<Scratch> {
        let states = rows * planes.kv_heads * g * plan.splits;
        Ok(Scratch {
            ml: self.stream.alloc_zeros::<f32>(states * 2)?,
            acc: self.stream.alloc_zeros::<f32>(states * planes.d)?,
        })
    }

    /// Whether `variant` exists for this codec.
    pub fn has(&self, codec: GpuCodec, d: usize, g: usize, variant: Variant) -> Result<bool> {
        Ok(self.kernels(codec, d, g)?.partial(variant).is_some())
    }

    /// `out (batch, kv_heads·g, d) = softmax(scale · q·Kᵀ)·V`, row b over its stored
    /// positions `spans[b] = (start, end)`, for `q (batch, kv_heads·g, d)`. Nothing is
    /// copied from the host: the spans travel as kernel parameters.
    ///
    /// With `live`, the spans are in device memory instead: the chunk (`plan.chunk` is not
    /// used), then `(start, slot)` per row; row b reads `[start, slot + 1)`, and the merge
    /// then advances each slot by one. A step captured in a graph replays so.
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        plan: &Plan,
        planes: &GpuPlanes,
        g: usize,
        q: &CudaView<f32>,
        scale: f32,
        spans: &[(usize, usize)],
        live: Option<&mut CudaSlice<i32>>,
        scratch: &mut Scratch,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let kernels = self.kernels(planes.codec, planes.d, g)?;
        let Some(partial) = kernels.partial(plan.variant) else {
            bail!("no {:?} decode for {}", plan.variant, planes.codec.name())
        };
        let live = live.map(|l| l.device_ptr_mut(&self.stream));
        let live_ptr = live.as_ref().map_or(0, |l| l.0);
        // Queries per stored row: several where a chunk read runs as decode reads (each
        // query its own launch row, `spans` row-major), which only the CUDA-core kernel
        // indexes so.
        let rows = if live.is_some() {
            planes.batch
        } else {
            spans.len()
        };
        let nq = rows / planes.batch.max(1);
        if planes.batch == 0 || nq == 0 || rows != nq * planes.batch {
            bail!("{} spans for {} rows", spans.len(), planes.batch);
        }
        if nq > 1 && plan.variant != Variant::Simt {
            bail!("{nq} queries a row read by the {:?} kernel", plan.variant);
        }
        if !scratch.fits_rows(plan, rows, planes, g) {
            bail!("decode scratch smaller than its plan");
        }
        let qscale = scale * std::f32::consts::LOG2_E;
        let (kv_heads, capacity, chunk) = (
            planes.kv_heads as i32,
            planes.capacity as i32,
            plan.chunk as i32,
        );
        let vectors = rows * planes.kv_heads * g;
        let per_vector = |n: usize| LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (planes.d as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // Turbo keys are stored rotated (and scaled): the query follows them first.
        let turbo = match (&kernels.turbo, &planes.turbo) {
            (Some(f), Some(t)) => Some((f, t)),
            (None, _) => None,
            (Some(_), None) => bail!("turbo planes without their tables"),
        };
        let rotated = match turbo {
            Some(((rotate, _), t)) => {
                // SAFETY: the rotation writes every element before the read uses it.
                let mut qr = unsafe { self.stream.alloc::<f32>(vectors * planes.d)? };
                let (kv_heads_, nq_) = (planes.kv_heads as i32, nq as i32);
                let mut b = self.stream.launch_builder(rotate);
                b.arg(q)
                    .arg(&mut qr)
                    .arg(&t.scale)
                    .arg(&t.signs)
                    .arg(&kv_heads_)
                    .arg(&nq_);
                unsafe { b.launch(per_vector(vectors))? };
                Some(qr)
            }
            None => None,
        };
        let q_read = rotated.as_ref().map(|r| r.slice(..));
        let q = q_read.as_ref().unwrap_or(q);
        let runs: Vec<(usize, usize)> = (0..rows)
            .step_by(SPAN_ROWS)
            .map(|row0| (row0, SPAN_ROWS.min(rows - row0)))
            .collect();
        for (row0, rows) in runs {
            let mut arg = Spans {
                row0: row0 as i32,
                nq: nq as i32,
                start: [0; SPAN_ROWS],
                end: [0; SPAN_ROWS],
                live: live_ptr,
            };
            if live.is_none() {
                for (i, &(a, b)) in spans[row0..row0 + rows].iter().enumerate() {
                    (arg.start[i], arg.end[i]) = (a as i32, b as i32);
                }
            }
            // The step's reads are dependent launches (dependent.rs): decode.cu's kernels
            // wait for the launch before them first.
            let mut b = DependentLaunch::new(&self.stream);
            b.input(q)
                .float(qscale)
                .input(&planes.k)
                .input(&planes.kp)
                .input(&planes.v)
                .input(&planes.vp)
                .value(&arg)
                .int(kv_heads)
                .int(capacity)
                .int(chunk)
                .output(&mut scratch.ml)
                .output(&mut scratch.acc);
            if let Some((_, t)) = turbo {
                b.input(&t.levels);
            }
            let cfg = LaunchConfig {
                grid_dim: (plan.splits as u32, planes.kv_heads as u32, rows as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            unsafe { b.launch(&partial.f, cfg)? };
        }
        let mut b = DependentLaunch::new(&self.stream);
        b.input(&scratch.ml)
            .input(&scratch.acc)
            .output(&mut *out)
            .int(plan.splits as i32)
            .long(live_ptr as i64);
        let cfg = LaunchConfig {
            grid_dim: ((planes.kv_heads * g) as u32, rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { b.launch(&kernels.merge, cfg)? };
        if let Some(((_, unrotate), t)) = turbo {
            // Values were accumulated in their rotated space.
            let values_signs = t.signs.slice(planes.d..);
            let mut b = self.stream.launch_builder(unrotate);
            b.arg(out).arg(&values_signs);
            unsafe { b.launch(per_vector(vectors))? };
        }
        Ok(())
    }
}

impl DecodeRead {
    /// Whether [`Self::chunk`] serves this configuration.
    pub fn has_chunk(&self, codec: GpuCodec, d: usize, g: usize) -> Result<bool> {
        Ok(self.kernels(codec, d, g)?.chunk.is_some())
    }

    /// The chunk (prefill) read: `out (batch, kv_heads·g, n, d)` for queries `q` (same
    /// layout; scores scaled by `scale`) at positions `start .. start + n` of every row,
    /// over slots `0 .. start + n` (slot = position): causal, slots before `pads[b]`
    /// hidden from row b, a padding query seeing only itself, and with `window > 0` only
    /// the last `window` positions.
    #[allow(clippy::too_many_arguments)]
    pub fn chunk(
        &self,
        planes: &GpuPlanes,
        g: usize,
        q: &CudaView<f32>,
        scale: f32,
        pads: &CudaSlice<i32>,
        start: usize,
        n: usize,
        window: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let kernels = self.kernels(planes.codec, planes.d, g)?;
        let Some(f) = kernels.chunk.as_ref() else {
            bail!("no chunk read for {}", planes.codec.name())
        };
        // Queries per block (8 / g of them share the mma's columns), blocks per split.
        let groups = n.div_ceil(8 / g);
        let (splits, chunk) = plan_splits(
            planes.batch * groups,
            planes.kv_heads,
            start + n,
            f.per_sm * self.sms,
        );
        let rows = planes.batch * planes.kv_heads * g * n;
        let s = &self.stream;
        // One split writes the output itself; more leave partials for the merge.
        let parts = if splits > 1 { rows * splits } else { 1 };
        let mut ml = s.alloc_zeros::<f32>(parts * 2)?;
        let mut acc = s.alloc_zeros::<f32>(parts * planes.d)?;
        let (start_, n_, window_) = (start as i32, n as i32, window as i32);
        let (kv_heads, capacity, chunk_) =
            (planes.kv_heads as i32, planes.capacity as i32, chunk as i32);
        let qscale = scale * std::f32::consts::LOG2_E;
        let mut b = s.launch_builder(&f.f);
        b.arg(q)
            .arg(&qscale)
            .arg(&planes.k)
            .arg(&planes.kp)
            .arg(&planes.v)
            .arg(&planes.vp)
            .arg(pads)
            .arg(&start_)
            .arg(&n_)
            .arg(&window_)
            .arg(&kv_heads)
            .arg(&capacity)
            .arg(&chunk_)
            .arg(&mut ml)
            .arg(&mut acc)
            .arg(&mut *out);
        let cfg = LaunchConfig {
            grid_dim: (
                splits as u32,
                planes.kv_heads as u32,
                (planes.batch * groups) as u32,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { b.launch(cfg)? };
        if splits > 1 {
            let splits = splits as i32;
            let mut b = s.launch_builder(&kernels.merge);
            let no_live = 0u64;
            b.arg(&ml).arg(&acc).arg(out).arg(&splits).arg(&no_live);
            let cfg = LaunchConfig {
                grid_dim: ((planes.kv_heads * g * n) as u32, planes.batch as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            unsafe { b.launch(cfg)? };
        }
        Ok(())
    }
}

/// How one decode read launches: its kernel and the sequence split over blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub variant: Variant,
    pub splits: usize,
    /// Positions per split (a multiple of the kernels' block step).
    pub chunk: usize,
}

impl Plan {
    /// Deterministic mode's plan for reads of up to `max_len` positions: the CUDA-core
    /// kernel (every codec has it) over splits of [`DETERMINISTIC_SPLIT`] positions from
    /// each row's first, so that a query's sums depend on its own span alone, never on the
    /// longest row beside it or the batch's size (a row's splits past its end are empty and
    /// merge as exact zeros).
    pub fn deterministic(max_len: usize) -> Plan {
        Plan {
            variant: Variant::Simt,
            splits: max_len.div_ceil(DETERMINISTIC_SPLIT).max(1),
            chunk: DETERMINISTIC_SPLIT,
        }
    }
}

/// Positions a split of a deterministic-mode read takes (a multiple of the kernels' block
/// step).
pub const DETERMINISTIC_SPLIT: usize = 256;

/// Partial softmax states of decode reads (kept across reads on one stream: each read's
/// kernels run in stream order, so the next read reuses it safely).
pub struct Scratch {
    ml: CudaSlice<f32>,
    acc: CudaSlice<f32>,
}

impl Scratch {
    pub fn fits(&self, plan: &Plan, planes: &GpuPlanes, g: usize) -> bool {
        self.fits_rows(plan, planes.batch, planes, g)
    }

    /// Whether it holds the states of `plan` over `rows` launch rows.
    fn fits_rows(&self, plan: &Plan, rows: usize, planes: &GpuPlanes, g: usize) -> bool {
        let states = rows * planes.kv_heads * g * plan.splits;
        self.ml.len() >= states * 2 && self.acc.len() >= states * planes.d
    }
}
