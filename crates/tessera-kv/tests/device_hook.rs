//! The device-planes hook, exercised on the CPU: an emulated device backend (host memory,
//! the codecs' own rounding, a plain f64 attention for its decode and chunk reads) is
//! installed, so every layer cache of this test process stores its positions through
//! `DevicePlanes`, as a GPU backend's would. The same appends go to a cache that keeps its own host planes
//! (the host backend serves only the device it is told to) and every read must agree:
//! binding on first use, the bf16-first conversion (also inside a decode step, whose read
//! uses the retired bf16 planes), turbo planes' key preparation fitted at conversion,
//! rings that wrap, padded rows whose slots split in two (the dense fallback), byte
//! accounting and signatures. The GPU backend itself is tested
//! on the device (tessera-kernels' kv-cache-parity).

use candle_core::{DType, Device, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use tessera_kv::affine_planes::AffinePlanes;
use tessera_kv::device::{DeviceBackend, DevicePlanes, PlaneGeometry};
use tessera_kv::turbo_planes::TurboPlanes;
use tessera_kv::{
    grown_capacity, AttentionCache, Codec, KvCache, KvError, KvScheme, LayerSpec, PlainDType,
    Retention, TurboPrep,
};

/// Fused decode and chunk reads the emulated device served, and its writes.
static DECODES: AtomicUsize = AtomicUsize::new(0);
static CHUNKS: AtomicUsize = AtomicUsize::new(0);
static WRITES: AtomicUsize = AtomicUsize::new(0);

/// Serves `Device::Cpu` only when `EMULATE` is set for the calling thread's cache.
struct HostBackend;

thread_local! {
    static EMULATE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl DeviceBackend for HostBackend {
    fn planes(
        &self,
        codec: Codec,
        geometry: PlaneGeometry,
        _device: &Device,
    ) -> Result<Option<Box<dyn DevicePlanes>>, KvError> {
        if !EMULATE.with(|e| e.get()) {
            return Ok(None);
        }
        match codec {
            Codec::Plain(PlainDType::Bf16) | Codec::Affine { .. } | Codec::Turbo { .. } => {
                let g = geometry;
                let turbo = match codec {
                    Codec::Turbo { kbits, vbits, .. } => Some(TurboPlanes::new(
                        kbits,
                        vbits,
                        g.rows,
                        g.heads,
                        g.head_dim,
                        g.value_dim,
                    )),
                    _ => None,
                };
                Ok(Some(Box::new(HostPlanes {
                    codec,
                    g,
                    capacity: 0,
                    k: Vec::new(),
                    v: Vec::new(),
                    turbo,
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

/// Positions kept as the f32 values a read of the codec returns, `(rows·heads, cap, dim)`.
#[derive(Debug)]
struct HostPlanes {
    codec: Codec,
    g: PlaneGeometry,
    capacity: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Turbo: empty planes of the codec, where the key preparation is fitted (the cache
    /// must ask for it at conversion) and through which positions are rounded.
    turbo: Option<TurboPlanes>,
}

impl HostPlanes {
    /// Softmax attention in f64 of one query row (query head `h` of `qh`, row `r`) over
    /// `slots`, written to `out`.
    #[allow(clippy::too_many_arguments)]
    fn attend_slots(
        &self,
        qrow: &[f32],
        r: usize,
        h: usize,
        qh: usize,
        slots: std::ops::Range<usize>,
        scale: f32,
        out: &mut [f32],
    ) {
        let d = self.g.head_dim;
        let block = (r * self.g.heads + h / (qh / self.g.heads)) * self.capacity;
        let scores: Vec<f64> = slots
            .clone()
            .map(|s| {
                let key = &self.k[(block + s) * d..][..d];
                scale as f64
                    * qrow
                        .iter()
                        .zip(key)
                        .map(|(a, b)| (a * b) as f64)
                        .sum::<f64>()
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::MIN, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        for (w, s) in weights.iter().zip(slots) {
            let value = &self.v[(block + s) * d..][..d];
            for (o, x) in out.iter_mut().zip(value) {
                *o += (w / total * *x as f64) as f32;
            }
        }
    }

    fn round(&self, x: &Tensor, keys: bool) -> Result<Vec<f32>, KvError> {
        let (b, h, _, d) = x.dims4()?;
        let stored = match (self.codec, &self.turbo) {
            (Codec::Affine { bits, group }, _) => {
                AffinePlanes::new(bits, group as usize, b, h, d, d).as_stored(x)?
            }
            (_, Some(turbo)) => turbo.as_stored(x, keys)?,
            _ => x.to_dtype(DType::BF16)?.to_dtype(DType::F32)?,
        };
        Ok(stored.flatten_all()?.to_vec1()?)
    }
}

impl DevicePlanes for HostPlanes {
    fn codec(&self) -> Codec {
        self.codec
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn reserve(&mut self, slots: usize, limit: usize) -> Result<(), KvError> {
        if slots <= self.capacity {
            return Ok(());
        }
        let cap = grown_capacity(slots, limit);
        let (blocks, d) = (self.g.rows * self.g.heads, self.g.head_dim);
        for plane in [&mut self.k, &mut self.v] {
            let mut grown = vec![0f32; blocks * cap * d];
            for b in 0..blocks {
                let old = &plane[b * self.capacity * d..(b + 1) * self.capacity * d];
                grown[b * cap * d..][..old.len()].copy_from_slice(old);
            }
            *plane = grown;
        }
        self.capacity = cap;
        Ok(())
    }

    fn write(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<(), KvError> {
        WRITES.fetch_add(1, Ordering::Relaxed);
        let n = k.dims()[2];
        let (kx, vx) = (self.round(k, true)?, self.round(v, false)?);
        let (blocks, d, cap) = (self.g.rows * self.g.heads, self.g.head_dim, self.capacity);
        for (plane, x) in [(&mut self.k, kx), (&mut self.v, vx)] {
            for b in 0..blocks {
                for i in 0..n {
                    plane[(b * cap + slot + i) * d..][..d]
                        .copy_from_slice(&x[(b * n + i) * d..][..d]);
                }
            }
        }
        Ok(())
    }

    fn read(&self, slot: usize, len: usize) -> Result<(Tensor, Tensor), KvError> {
        let (blocks, d, cap) = (self.g.rows * self.g.heads, self.g.head_dim, self.capacity);
        let take = |plane: &Vec<f32>| -> Result<Tensor, KvError> {
            let mut out = Vec::with_capacity(blocks * len * d);
            for b in 0..blocks {
                out.extend_from_slice(&plane[(b * cap + slot) * d..][..len * d]);
            }
            Ok(Tensor::from_vec(
                out,
                (self.g.rows, self.g.heads, len, d),
                &Device::Cpu,
            )?)
        };
        Ok((take(&self.k)?, take(&self.v)?))
    }

    fn as_stored(&self, x: &Tensor, keys: bool) -> Result<Tensor, KvError> {
        Ok(Tensor::from_vec(
            self.round(x, keys)?,
            x.dims(),
            &Device::Cpu,
        )?)
    }

    fn fit_key_prep(&mut self, k: &Tensor, prep: TurboPrep) -> Result<(), KvError> {
        match &mut self.turbo {
            Some(turbo) => turbo.fit_key_prep(k, prep),
            None => Ok(()),
        }
    }

    fn decode(&self, q: &Tensor, spans: &[(usize, usize)], scale: f32) -> Result<Tensor, KvError> {
        DECODES.fetch_add(1, Ordering::Relaxed);
        let (b, qh, _, d) = q.dims4()?;
        let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
        let mut out = vec![0f32; b * qh * d];
        for (r, &(lo, hi)) in spans.iter().enumerate() {
            for h in 0..qh {
                let o = (r * qh + h) * d;
                self.attend_slots(&qv[o..][..d], r, h, qh, lo..hi, scale, &mut out[o..][..d]);
            }
        }
        Ok(Tensor::from_vec(out, (b, qh, 1, d), &Device::Cpu)?)
    }

    /// The chunk contract, spelled out: query i of row r (position start + i) sees slots
    /// pads[r] ..= start + i, or only its own slot while it is padding itself. Served for
    /// affine planes only (as the CUDA backend does), so bf16 planes take the dense
    /// fallback.
    fn chunk(
        &self,
        q: &Tensor,
        pads: &[usize],
        start: usize,
        scale: f32,
    ) -> Result<Option<Tensor>, KvError> {
        if !matches!(self.codec, Codec::Affine { .. }) {
            return Ok(None);
        }
        CHUNKS.fetch_add(1, Ordering::Relaxed);
        let (b, qh, n, d) = q.dims4()?;
        let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
        let mut out = vec![0f32; b * qh * n * d];
        for (r, &pad) in pads.iter().enumerate() {
            for h in 0..qh {
                for i in 0..n {
                    let pos = start + i;
                    let first = if pos < pad { pos } else { pad };
                    let o = ((r * qh + h) * n + i) * d;
                    self.attend_slots(
                        &qv[o..][..d],
                        r,
                        h,
                        qh,
                        first..pos + 1,
                        scale,
                        &mut out[o..][..d],
                    );
                }
            }
        }
        Ok(Some(Tensor::from_vec(out, (b, qh, n, d), &Device::Cpu)?))
    }

    fn allocated_bytes(&self) -> usize {
        4 * (self.k.len() + self.v.len())
    }

    fn bytes_per_position(&self) -> usize {
        if let Some(turbo) = &self.turbo {
            return turbo.bytes_per_position();
        }
        let d = self.g.head_dim;
        let per = match self.codec {
            Codec::Affine { bits, group } => d * bits as usize / 8 + 4 * d / group as usize,
            _ => 2 * d,
        };
        2 * self.g.heads * per
    }
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

#[test]
fn device_planes_read_as_the_host_cache_does() {
    tessera_kv::device::install(Box::new(HostBackend));
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
    ] {
        // 0: converts on the first append; 8: inside a decode step.
        for start in [0, 8] {
            let scheme = KvScheme {
                quantized_kv_start: start,
                ..KvScheme::uniform(codec)
            };
            let pads = vec![0, 3];
            let mut host = KvCache::new(&specs, &scheme, pads.clone()).unwrap();
            EMULATE.with(|e| e.set(true));
            let mut dev = KvCache::new(&specs, &scheme, pads).unwrap();
            let (decodes, chunks) = (
                DECODES.load(Ordering::Relaxed),
                CHUNKS.load(Ordering::Relaxed),
            );
            let mut seed = 0;
            for &n in &steps {
                for l in 0..specs.len() {
                    seed += 3;
                    let k = random(&[2, 2, n, 64], seed);
                    let v = random(&[2, 2, n, 64], seed + 1);
                    let q = random(&[2, 4, n, 64], seed + 2);
                    EMULATE.with(|e| e.set(false));
                    let want = host.layer_mut(l).append_window(&k, &v).unwrap();
                    let want = want.attend(&q, 0.125).unwrap();
                    EMULATE.with(|e| e.set(true));
                    let got = dev.layer_mut(l).append_window(&k, &v).unwrap();
                    let got = got.attend(&q, 0.125).unwrap();
                    let diff = max_diff(&got, &want);
                    assert!(
                        diff < 1e-4,
                        "{codec} start {start} layer {l} n {n}: differs by {diff}"
                    );
                }
            }
            EMULATE.with(|e| e.set(false));
            assert!(
                DECODES.load(Ordering::Relaxed) > decodes,
                "{codec}: decode steps went through the device's read"
            );
            // Affine: the full layer's chunks went through the device's chunk read; bf16:
            // through the dense fallback.
            assert_eq!(
                CHUNKS.load(Ordering::Relaxed) > chunks,
                matches!(codec, Codec::Affine { .. }),
                "{codec}: which chunk read served"
            );
            assert_eq!(host.signatures(), dev.signatures(), "{codec}");
            assert_eq!(host.bytes_per_token(), dev.bytes_per_token(), "{codec}");
            assert!(WRITES.load(Ordering::Relaxed) > 0);
        }
    }
    // A codec the device does not serve is refused on first use, naming it.
    EMULATE.with(|e| e.set(true));
    let mut dev = KvCache::new(&specs[..1], &KvScheme::parse("f16").unwrap(), vec![0]).unwrap();
    let k = random(&[1, 2, 2, 64], 1);
    let err = dev
        .layer_mut(0)
        .append_window(&k, &k)
        .unwrap_err()
        .to_string();
    assert!(err.contains("f16") && err.contains("emulated"), "{err}");
    EMULATE.with(|e| e.set(false));
}
