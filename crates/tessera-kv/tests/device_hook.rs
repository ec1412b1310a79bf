//! The device-planes hook, exercised on the CPU: an emulated device backend is installed
//! whose planes wrap host planes (`host_planes`) and count every call, so every layer cache
//! of this test process that asks for device planes stores its positions through the
//! backend's `Box<dyn Planes>`, as a GPU backend's would. The same appends go to a cache
//! that keeps its own host planes (the backend serves only threads that ask for it) and
//! every read must agree: binding on first use, the bf16-first conversion (also inside a
//! decode step, whose read uses the retired bf16 planes, still the device's), turbo planes'
//! key preparation fitted per row at conversion, rings that wrap (a ring's chunk read is
//! built in device planes from `empty`, `adopt_row` and `copy_from`), padded rows, the
//! device's fused decode, its chunk read declined for some codecs (the dense fallback),
//! row operations and state on device planes, byte accounting and signatures. The host
//! cache's reads are held to an independent f64 reference in `tests/reads.rs`; the GPU
//! backend itself is tested on the device (tessera-kernels' kv-cache-parity).

use candle_core::{Device, Tensor};
use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use tessera_kv::planes::{
    host_planes, ChunkGeometry, DeviceBackend, PlaneGeometry, Planes, PlanesState, RowSlots,
};
use tessera_kv::{
    AttentionCache, Codec, Isa, KvCache, KvError, KvScheme, LayerSpec, PlainDType, Retention,
    TurboPrep,
};

/// Calls the emulated device's planes served.
static DECODES: AtomicUsize = AtomicUsize::new(0);
static CHUNKS: AtomicUsize = AtomicUsize::new(0);
static DECLINED_CHUNKS: AtomicUsize = AtomicUsize::new(0);
static WRITES: AtomicUsize = AtomicUsize::new(0);
static FITS: AtomicUsize = AtomicUsize::new(0);
static ADOPTS: AtomicUsize = AtomicUsize::new(0);
static COPIES: AtomicUsize = AtomicUsize::new(0);
static RESTORES: AtomicUsize = AtomicUsize::new(0);

fn count(c: &AtomicUsize) -> usize {
    c.load(Ordering::Relaxed)
}

/// Serves `Device::Cpu` only when `EMULATE` is set for the calling thread.
struct EmulatedBackend;

thread_local! {
    static EMULATE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn emulate(on: bool) {
    EMULATE.with(|e| e.set(on));
}

impl DeviceBackend for EmulatedBackend {
    fn planes(
        &self,
        codec: Codec,
        geometry: PlaneGeometry,
        _device: &Device,
    ) -> Result<Option<Box<dyn Planes>>, KvError> {
        if !EMULATE.with(|e| e.get()) {
            return Ok(None);
        }
        match codec {
            Codec::Plain(PlainDType::Bf16) | Codec::Affine { .. } | Codec::Turbo { .. } => {
                Ok(Some(Box::new(Emulated {
                    inner: host_planes(codec, geometry),
                })))
            }
            _ => Err(KvError::DeviceCodec {
                codec: codec.to_string(),
                device: "emulated".into(),
                reason: "not emulated".into(),
            }),
        }
    }
}

/// The emulated device's planes: host planes behind the trait, every call counted.
#[derive(Debug)]
struct Emulated {
    inner: Box<dyn Planes>,
}

/// The host planes behind `src` when it is the emulated device's (what a device backend
/// does with its own planes), else `src`.
fn unwrap(src: &dyn Planes) -> &dyn Planes {
    match src.as_any().downcast_ref::<Emulated>() {
        Some(e) => e.inner.as_ref(),
        None => src,
    }
}

impl Planes for Emulated {
    fn codec(&self) -> Codec {
        self.inner.codec()
    }

    fn geometry(&self) -> PlaneGeometry {
        self.inner.geometry()
    }

    fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    fn empty(&self, rows: usize) -> Result<Box<dyn Planes>, KvError> {
        Ok(Box::new(Emulated {
            inner: self.inner.empty(rows)?,
        }))
    }

    fn reserve(&mut self, slots: usize, limit: usize) -> Result<(), KvError> {
        self.inner.reserve(slots, limit)
    }

    fn write(
        &mut self,
        rows: Range<usize>,
        slot: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(), KvError> {
        WRITES.fetch_add(1, Ordering::Relaxed);
        self.inner.write(rows, slot, k, v)
    }

    fn read(
        &self,
        rows: Range<usize>,
        slot: usize,
        len: usize,
    ) -> Result<(Tensor, Tensor), KvError> {
        self.inner.read(rows, slot, len)
    }

    fn adopt_row(
        &mut self,
        src: &dyn Planes,
        src_row: usize,
        dst_row: usize,
    ) -> Result<(), KvError> {
        ADOPTS.fetch_add(1, Ordering::Relaxed);
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
    ) -> Result<(), KvError> {
        COPIES.fetch_add(1, Ordering::Relaxed);
        self.inner
            .copy_from(unwrap(src), src_row, src_slot, dst_row, dst_slot, len)
    }

    fn fit_key_prep(
        &mut self,
        k: &Tensor,
        live: &[Range<usize>],
        prep: TurboPrep,
        queries: Option<&[f32]>,
    ) -> Result<(), KvError> {
        FITS.fetch_add(1, Ordering::Relaxed);
        self.inner.fit_key_prep(k, live, prep, queries)
    }

    fn decode(
        &self,
        q: &Tensor,
        rows: &[RowSlots],
        scale: f32,
        isa: Isa,
    ) -> Result<Option<Tensor>, KvError> {
        DECODES.fetch_add(1, Ordering::Relaxed);
        let out = self.inner.decode(q, rows, scale, isa)?;
        assert!(out.is_some(), "host planes have a fused decode");
        Ok(out)
    }

    /// Served for affine planes only (as the CUDA backend does); bf16 and turbo planes
    /// decline, so their chunks take the dense fallback.
    fn chunk(
        &self,
        q: &Tensor,
        geometry: &ChunkGeometry,
        scale: f32,
        isa: Isa,
    ) -> Result<Option<Tensor>, KvError> {
        if !matches!(self.codec(), Codec::Affine { .. }) {
            DECLINED_CHUNKS.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        CHUNKS.fetch_add(1, Ordering::Relaxed);
        let out = self.inner.chunk(q, geometry, scale, isa)?;
        assert!(out.is_some(), "host affine planes have a fused chunk");
        Ok(out)
    }

    fn allocated_bytes(&self) -> usize {
        self.inner.allocated_bytes()
    }

    fn bytes_per_position(&self) -> usize {
        self.inner.bytes_per_position()
    }

    fn state(&self) -> Result<PlanesState, KvError> {
        self.inner.state()
    }

    fn restore(&mut self, state: &PlanesState) -> Result<(), KvError> {
        RESTORES.fetch_add(1, Ordering::Relaxed);
        self.inner.restore(state)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Whether layer `l` of `cache` stores its positions in the emulated device's planes.
fn on_device(cache: &KvCache, l: usize) -> bool {
    cache.layers()[l].planes().as_any().is::<Emulated>()
}

fn random(shape: &[usize], seed: u64) -> Tensor {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
    a.iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Appends `k`, `v` to layer `l` of `cache` as a decode step (`n` = 1) or a chunk and
/// attends `q`; also says whether the read was fused over the emulated device's planes and
/// the codec of the planes it read.
fn append_attend(
    cache: &mut KvCache,
    l: usize,
    k: &Tensor,
    v: &Tensor,
    q: &Tensor,
) -> (Tensor, Option<(bool, Codec)>) {
    let layer = cache.layer_mut(l);
    let read = if k.dims()[2] == 1 {
        layer.append_decode(k, v).unwrap()
    } else {
        layer.append_window(k, v).unwrap()
    };
    let planes = read
        .planes()
        .map(|p| (p.as_any().is::<Emulated>(), p.codec()));
    (read.attend(q, 0.125).unwrap(), planes)
}

/// One more append of `n` positions to every layer of `host` and of `dev` (the device's),
/// whose reads must agree bit for bit, except within the dense fallback's rounding where the
/// device declined a chunk the host may read fused.
fn both_append(host: &mut KvCache, dev: &mut KvCache, n: usize, seed: &mut u64, what: &str) {
    let rows = host.batch();
    for l in 0..host.layers().len() {
        *seed += 3;
        let k = random(&[rows, 2, n, 64], *seed);
        let v = random(&[rows, 2, n, 64], *seed + 1);
        let q = random(&[rows, 4, n, 64], *seed + 2);
        emulate(false);
        let (want, _) = append_attend(host, l, &k, &v, &q);
        emulate(true);
        let (got, planes) = append_attend(dev, l, &k, &v, &q);
        emulate(false);
        if let Some((device, _)) = planes {
            assert!(
                device,
                "{what} layer {l}: a fused read over the device's planes"
            );
        }
        let declined = n > 1 && !matches!(dev.layers()[l].planes().codec(), Codec::Affine { .. });
        let diff = max_diff(&got, &want);
        assert!(
            diff <= if declined { 1e-4 } else { 0.0 },
            "{what} layer {l} n {n}: differs by {diff}"
        );
        assert!(on_device(dev, l), "{what} layer {l}");
    }
}

#[test]
fn device_planes_read_as_the_host_cache_does() {
    tessera_kv::planes::install(Box::new(EmulatedBackend));
    let specs = [
        LayerSpec {
            kv_heads: 2,
            head_dim: 64,
            value_dim: 64,
            retention: Retention::Full,
        },
        LayerSpec {
            kv_heads: 2,
            head_dim: 64,
            value_dim: 64,
            retention: Retention::Window { size: 8 },
        },
    ];
    // Prefill 6, decode 10 (the ring wraps), a chunk of 4, decode 8.
    let steps: Vec<usize> = [vec![6], vec![1; 10], vec![4], vec![1; 8]].concat();
    for codec in [
        Codec::Plain(PlainDType::Bf16),
        Codec::Affine { bits: 4, group: 32 },
        Codec::Affine { bits: 8, group: 64 },
        Codec::Turbo {
            kbits: 4,
            vbits: 3,
            prep: TurboPrep::ALL,
        },
        Codec::Turbo {
            kbits: 3,
            vbits: 4,
            prep: TurboPrep {
                key_mean: false,
                key_scale: true,
                pairs: false,
            },
        },
    ] {
        let turbo = matches!(codec, Codec::Turbo { .. });
        let affine = matches!(codec, Codec::Affine { .. });
        // 0: converts on the first append; 8: inside a decode step.
        for start in [0, 8] {
            let what = format!("{codec} start {start}");
            let scheme = KvScheme {
                quantized_kv_start: start,
                ..KvScheme::uniform(codec)
            };
            let pads = vec![0, 3];
            let mut host = KvCache::new(&specs, &scheme, pads.clone()).unwrap();
            emulate(true);
            let mut dev = KvCache::new(&specs, &scheme, pads).unwrap();
            emulate(false);
            for l in 0..specs.len() {
                assert!(
                    !on_device(&dev, l),
                    "{what}: bound on first use, not before"
                );
            }
            let before = [
                &DECODES,
                &CHUNKS,
                &DECLINED_CHUNKS,
                &WRITES,
                &FITS,
                &ADOPTS,
                &COPIES,
            ]
            .map(count);
            let mut seed = 0;
            let mut converted_in_decode = false;
            for &n in &steps {
                for l in 0..specs.len() {
                    seed += 3;
                    let k = random(&[2, 2, n, 64], seed);
                    let v = random(&[2, 2, n, 64], seed + 1);
                    let q = random(&[2, 4, n, 64], seed + 2);
                    let awaiting = dev.layers()[l].awaiting_conversion();
                    emulate(false);
                    let (want, host_planes) = append_attend(&mut host, l, &k, &v, &q);
                    emulate(true);
                    let (got, planes) = append_attend(&mut dev, l, &k, &v, &q);
                    emulate(false);
                    assert!(on_device(&dev, l), "{what} layer {l}: bound on first use");
                    assert_eq!(
                        dev.layers()[l].awaiting_conversion(),
                        host.layers()[l].awaiting_conversion(),
                        "{what} layer {l}: converts with the host"
                    );
                    let read_affine = planes.is_some_and(|p| matches!(p.1, Codec::Affine { .. }));
                    if let Some((device, read_codec)) = planes {
                        assert!(device, "{what} layer {l}: fused over the device's planes");
                        assert_eq!(Some(read_codec), host_planes.map(|p| p.1), "{what}");
                        if n == 1 && awaiting && !dev.layers()[l].awaiting_conversion() {
                            // The converting decode step reads the retired bf16 planes,
                            // still the device's.
                            assert_eq!(read_codec, Codec::Plain(PlainDType::Bf16), "{what}");
                            assert!(dev.layers()[l].planes().codec().is_quantized());
                            converted_in_decode = true;
                        }
                    }
                    // The device's fused reads are the host's kernels on the same codes:
                    // bit for bit, except a chunk the device declined (dense fallback: every
                    // codec but affine) that the host reads fused.
                    let tolerance = if n > 1 && !read_affine { 1e-4 } else { 0.0 };
                    let diff = max_diff(&got, &want);
                    assert!(
                        diff <= tolerance,
                        "{what} layer {l} n {n}: differs by {diff}"
                    );
                }
            }
            assert_eq!(
                converted_in_decode,
                codec.is_quantized() && start == 8,
                "{what}: the transition at 8 is a decode step"
            );
            let grew = |i: usize, c: &AtomicUsize| count(c) > before[i];
            assert!(
                grew(0, &DECODES),
                "{what}: decode steps went through the device's read"
            );
            // Affine: chunks went through the device's chunk read; bf16 and turbo, and
            // every codec's bf16 stage (the prefill, read before or while converting): the
            // device declined and the dense fallback served.
            assert_eq!(grew(1, &CHUNKS), affine, "{what}: which chunk read served");
            assert!(grew(2, &DECLINED_CHUNKS), "{what}: declined chunks");
            assert!(grew(3, &WRITES), "{what}");
            assert_eq!(
                grew(4, &FITS),
                turbo || affine,
                "{what}: turbo fits its prep, affine its key means, on the device"
            );
            // The ring's chunk reads are built in device planes from the ring's own.
            assert!(grew(5, &ADOPTS) && grew(6, &COPIES), "{what}: ring spans");
            assert_eq!(host.signatures(), dev.signatures(), "{what}");
            assert_eq!(host.bytes_per_token(), dev.bytes_per_token(), "{what}");
            assert_eq!(host.allocated_bytes(), dev.allocated_bytes(), "{what}");
            // The device's planes hold what the host's do, code for code.
            assert_eq!(host.state().unwrap(), dev.state().unwrap(), "{what}");

            // Row operations on device planes: codes (and turbo rows' fitted preparations)
            // copied from the device's planes into the device's planes.
            let copies = count(&COPIES);
            emulate(true);
            let mut dev_row = dev.extract(1).unwrap();
            dev.filter(&[1, 0]).unwrap();
            emulate(false);
            let mut host_row = host.extract(1).unwrap();
            host.filter(&[1, 0]).unwrap();
            assert!(count(&COPIES) > copies, "{what}: rows copied on the device");
            for l in 0..specs.len() {
                assert!(
                    on_device(&dev_row, l) && on_device(&dev, l),
                    "{what} layer {l}"
                );
            }
            both_append(&mut host_row, &mut dev_row, 1, &mut seed, &what);
            both_append(&mut host_row, &mut dev_row, 3, &mut seed, &what);
            both_append(&mut host, &mut dev, 1, &mut seed, &what);
            both_append(&mut host, &mut dev, 5, &mut seed, &what);

            // A saved cache rebuilt on the device.
            let restores = count(&RESTORES);
            let state = dev.state().unwrap();
            assert_eq!(state, host.state().unwrap(), "{what}");
            emulate(true);
            let mut restored = KvCache::from_state(&state, &Device::Cpu).unwrap();
            emulate(false);
            assert_eq!(count(&RESTORES), restores + specs.len(), "{what}");
            for l in 0..specs.len() {
                assert!(on_device(&restored, l), "{what} layer {l}");
            }
            both_append(&mut host, &mut restored, 1, &mut seed, &what);
            both_append(&mut host, &mut restored, 2, &mut seed, &what);
        }
    }
    // A codec the device does not serve is refused on first use, naming it.
    emulate(true);
    let mut dev = KvCache::new(&specs[..1], &KvScheme::parse("f16").unwrap(), vec![0]).unwrap();
    let k = random(&[1, 2, 2, 64], 1);
    let err = dev
        .layer_mut(0)
        .append_window(&k, &k)
        .unwrap_err()
        .to_string();
    assert!(err.contains("f16") && err.contains("emulated"), "{err}");
    emulate(false);
}
