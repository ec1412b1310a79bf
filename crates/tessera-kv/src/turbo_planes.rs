//! TurboQuant storage planes: per position and head, the f16 norm of the vector and the
//! `bits`-bit Lloyd–Max codes of its normalized, rotated coordinates (codes packed in u32
//! words with the affine layout: element i at bit i·bits). Keys and values have their own
//! bit widths, rotations (fixed seeds) and codebooks. Inputs are rounded to bf16 first, so
//! quantizing on append and converting bf16 storage later store the same codes.

use crate::affine::{get_code, put_code};
use crate::turbo::{Codebook, Rotation};
use crate::turbo_prep::ChannelPrep;
use crate::{KvError, TurboPrep};
use candle_core::{DType, Device, Tensor};
use half::f16;

/// Rotation seeds: fixed, so a saved cache decodes anywhere.
const KEY_SEED: u64 = 0x7e55_e7a0_0000_0001;
const VALUE_SEED: u64 = 0x7e55_e7a0_0000_0002;

/// One plane (keys or values) of `rows × heads × capacity` vectors of `dim` elements.
#[derive(Debug, Clone)]
pub(crate) struct TurboPlane {
    dim: usize,
    bits: u8,
    words: usize,
    codes: Vec<u32>,
    norms: Vec<f16>,
    rotation: Rotation,
    book: Codebook,
}

impl TurboPlane {
    fn new(dim: usize, bits: u8, seed: u64) -> Self {
        TurboPlane {
            dim,
            bits,
            words: (dim * bits as usize).div_ceil(32),
            codes: Vec::new(),
            norms: Vec::new(),
            rotation: Rotation::new(dim, seed),
            book: Codebook::shared(dim, bits),
        }
    }

    fn grow(&mut self, blocks: usize, old_cap: usize, capacity: usize) {
        let mut codes = vec![0u32; blocks * capacity * self.words];
        let mut norms = vec![f16::ZERO; blocks * capacity];
        for b in 0..blocks {
            let w = old_cap * self.words;
            codes[b * capacity * self.words..][..w].copy_from_slice(&self.codes[b * w..][..w]);
            norms[b * capacity..][..old_cap].copy_from_slice(&self.norms[b * old_cap..][..old_cap]);
        }
        self.codes = codes;
        self.norms = norms;
    }

    /// Encodes `x` into slot `at` (absolute: block · capacity + slot).
    fn write(&mut self, at: usize, x: &[f32]) {
        let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
        let mut u: Vec<f32> = if norm > 0.0 {
            x.iter().map(|v| v / norm).collect()
        } else {
            vec![0.0; x.len()]
        };
        self.rotation.forward(&mut u);
        let words = &mut self.codes[at * self.words..(at + 1) * self.words];
        words.iter_mut().for_each(|w| *w = 0);
        for (i, &c) in u.iter().enumerate() {
            put_code(words, i, self.bits, self.book.encode(c) as u32);
        }
        self.norms[at] = f16::from_f32(norm);
    }

    /// The stored vector of slot `at` in the rotated space: norm × codebook levels.
    #[inline]
    pub fn rotated(&self, at: usize, out: &mut [f32]) {
        let words = &self.codes[at * self.words..(at + 1) * self.words];
        let norm = self.norms[at].to_f32();
        for (i, o) in out.iter_mut().enumerate() {
            *o = norm * self.book.decode(get_code(words, i, self.bits) as u8);
        }
    }

    /// The stored vector of slot `at` in the original space.
    fn read(&self, at: usize, out: &mut [f32]) {
        self.rotated(at, out);
        self.rotation.inverse(out);
    }

    pub fn rotation(&self) -> &Rotation {
        &self.rotation
    }

    pub fn bits(&self) -> u8 {
        self.bits
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    pub fn levels(&self) -> &[f32] {
        &self.book.levels
    }

    /// Packed codes and norm of slot `at`.
    #[inline(always)]
    pub fn slot(&self, at: usize) -> (&[u32], f32) {
        (
            &self.codes[at * self.words..(at + 1) * self.words],
            self.norms[at].to_f32(),
        )
    }
}

/// What a device backend needs to encode and read turbo planes as these do: per plane the
/// rotation's signs and the codebook, and the keys' fitted preparation.
#[derive(Debug, Clone)]
pub struct TurboTables {
    /// Keys', then values': signs (`dim`), levels and thresholds (ascending).
    pub signs: [Vec<f32>; 2],
    pub levels: [Vec<f32>; 2],
    pub thresholds: [Vec<f32>; 2],
    /// The keys' mean and scales per KV head (`heads × head_dim`), where fitted.
    pub key_mean: Option<Vec<f32>>,
    pub key_scale: Option<Vec<f32>>,
}

/// TurboQuant keys and values of one layer.
#[derive(Debug, Clone)]
pub struct TurboPlanes {
    rows: usize,
    heads: usize,
    capacity: usize,
    /// What keys are centred on and scaled by before encoding (see [`ChannelPrep`]). Fused
    /// reads skip the mean: `q · m` is the same for every position of a head, and softmax
    /// ignores a constant added to all of a query's scores. (Values are encoded as they
    /// come: the same preparation did not pay for them; see BENCHMARKS.md.)
    key_prep: ChannelPrep,
    keys: TurboPlane,
    values: TurboPlane,
    device: Device,
}

fn bf16_values(x: &Tensor) -> Result<Vec<f32>, KvError> {
    Ok(x.to_dtype(DType::BF16)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?)
}

impl TurboPlanes {
    pub fn new(
        kbits: u8,
        vbits: u8,
        rows: usize,
        heads: usize,
        head_dim: usize,
        value_dim: usize,
    ) -> Self {
        TurboPlanes {
            rows,
            heads,
            capacity: 0,
            key_prep: ChannelPrep::default(),
            keys: TurboPlane::new(head_dim, kbits, KEY_SEED),
            values: TurboPlane::new(value_dim, vbits, VALUE_SEED),
            device: Device::Cpu,
        }
    }

    pub fn bits(&self) -> (u8, u8) {
        (self.keys.bits, self.values.bits)
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn key_prep(&self) -> &ChannelPrep {
        &self.key_prep
    }

    /// The preparation these planes were fitted with.
    pub fn prep(&self) -> TurboPrep {
        TurboPrep {
            key_mean: self.key_prep.centered(),
            key_scale: self.key_prep.scaled(),
        }
    }

    /// Fits the key preparation `prep` on `k` `(rows, heads, n, head_dim)`, per KV head over
    /// rows and positions. Set once, before anything is written.
    pub fn fit_key_prep(&mut self, k: &Tensor, prep: TurboPrep) -> Result<(), KvError> {
        let n = k.dims4()?.2;
        let x = bf16_values(k)?;
        let (h, d) = (self.heads, self.keys.dim);
        self.key_prep = ChannelPrep::fit(&x, h, n, d, prep.key_mean, prep.key_scale);
        Ok(())
    }

    /// The rotations, codebooks and key preparation, for a device backend.
    pub fn tables(&self) -> TurboTables {
        let (mean, scale) = self.key_prep.tables();
        let (k, v) = (&self.keys, &self.values);
        TurboTables {
            signs: [k.rotation.signs().to_vec(), v.rotation.signs().to_vec()],
            levels: [k.book.levels.clone(), v.book.levels.clone()],
            thresholds: [k.book.thresholds.clone(), v.book.thresholds.clone()],
            key_mean: mean.map(<[f32]>::to_vec),
            key_scale: scale.map(<[f32]>::to_vec),
        }
    }

    /// `(heads, head_dim, value_dim)`.
    pub fn geometry(&self) -> (usize, usize, usize) {
        (self.heads, self.keys.dim, self.values.dim)
    }

    pub(crate) fn planes(&self) -> (&TurboPlane, &TurboPlane) {
        (&self.keys, &self.values)
    }

    /// Encoded bytes of one position of one row: codes plus an f16 norm per vector.
    pub fn bytes_per_position(&self) -> usize {
        self.heads * ((self.keys.words + self.values.words) * 4 + 2 * 2)
    }

    pub fn allocated_bytes(&self) -> usize {
        (self.keys.codes.len() + self.values.codes.len()) * 4
            + (self.keys.norms.len() + self.values.norms.len()) * 2
            + self.key_prep.bytes()
    }

    /// Makes room for `slots` slots, growing in [`crate::GROWTH_STEP`] steps but never past `limit`.
    pub fn reserve(&mut self, slots: usize, limit: usize) {
        if slots <= self.capacity {
            return;
        }
        let capacity = crate::grown_capacity(slots, limit);
        let blocks = self.rows * self.heads;
        self.keys.grow(blocks, self.capacity, capacity);
        self.values.grow(blocks, self.capacity, capacity);
        self.capacity = capacity;
    }

    /// Empty planes of the same codec, geometry and key mean.
    pub fn empty_like(&self) -> Self {
        let empty = |p: &TurboPlane| TurboPlane {
            dim: p.dim,
            bits: p.bits,
            words: p.words,
            codes: Vec::new(),
            norms: Vec::new(),
            rotation: p.rotation.clone(),
            book: p.book.clone(),
        };
        TurboPlanes {
            rows: self.rows,
            heads: self.heads,
            capacity: 0,
            key_prep: self.key_prep.clone(),
            keys: empty(&self.keys),
            values: empty(&self.values),
            device: self.device.clone(),
        }
    }

    /// Copies `len` stored slots of `src` (same codec and geometry) from `src_slot` into
    /// `dst_slot ..`, codes and norms as they are.
    pub fn copy_slots(&mut self, src: &TurboPlanes, src_slot: usize, dst_slot: usize, len: usize) {
        for (dst, from) in [(&mut self.keys, &src.keys), (&mut self.values, &src.values)] {
            let w = dst.words;
            for block in 0..self.rows * self.heads {
                let (d0, s0) = (
                    block * self.capacity + dst_slot,
                    block * src.capacity + src_slot,
                );
                dst.codes[d0 * w..(d0 + len) * w]
                    .copy_from_slice(&from.codes[s0 * w..(s0 + len) * w]);
                dst.norms[d0..d0 + len].copy_from_slice(&from.norms[s0..s0 + len]);
            }
        }
    }

    /// Encodes `k`, `v` `(rows, heads, n, dim)` into slots `slot .. slot + n`.
    pub fn write(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<(), KvError> {
        self.device = k.device().clone();
        let n = k.dims()[2];
        let (kx, vx) = (bf16_values(k)?, bf16_values(v)?);
        let (dk, dv) = (self.keys.dim, self.values.dim);
        let mut pk = vec![0f32; dk];
        for block in 0..self.rows * self.heads {
            let head = block % self.heads;
            for i in 0..n {
                let (at, src) = (block * self.capacity + slot + i, block * n + i);
                self.key_prep.encode(head, &kx[src * dk..][..dk], &mut pk);
                self.keys.write(at, &pk);
                self.values.write(at, &vx[src * dv..][..dv]);
            }
        }
        Ok(())
    }

    /// Slots `slot .. slot + len` of both planes, decoded to f32 `(rows, heads, len, dim)`
    /// (keys with their mean added back).
    pub fn read(&self, slot: usize, len: usize) -> Result<(Tensor, Tensor), KvError> {
        let plane = |p: &TurboPlane, prep: Option<&ChannelPrep>| -> Result<Tensor, KvError> {
            let mut out = vec![0f32; self.rows * self.heads * len * p.dim];
            for block in 0..self.rows * self.heads {
                for i in 0..len {
                    let at = block * len + i;
                    let row = &mut out[at * p.dim..(at + 1) * p.dim];
                    p.read(block * self.capacity + slot + i, row);
                    if let Some(prep) = prep {
                        prep.decode(block % self.heads, row);
                    }
                }
            }
            Ok(Tensor::from_vec(
                out,
                (self.rows, self.heads, len, p.dim),
                &self.device,
            )?)
        };
        Ok((
            plane(&self.keys, Some(&self.key_prep))?,
            plane(&self.values, None)?,
        ))
    }

    /// What a later read of `x` returns once stored: encoded and decoded.
    pub fn as_stored(&self, x: &Tensor, keys: bool) -> Result<Tensor, KvError> {
        let (b, h, n, d) = x.dims4()?;
        let (src, prep) = if keys {
            (&self.keys, &self.key_prep)
        } else {
            (&self.values, &ChannelPrep::default())
        };
        let mut plane = TurboPlane {
            codes: vec![0; src.words],
            norms: vec![f16::ZERO],
            ..src.clone()
        };
        let values = bf16_values(x)?;
        let mut out = vec![0f32; values.len()];
        let mut prepared = vec![0f32; d];
        for (i, (s, o)) in values
            .chunks_exact(d)
            .zip(out.chunks_exact_mut(d))
            .enumerate()
        {
            prep.encode((i / n) % h, s, &mut prepared);
            plane.write(0, &prepared);
            plane.read(0, o);
            prep.decode((i / n) % h, o);
        }
        Ok(Tensor::from_vec(out, (b, h, n, d), x.device())?)
    }
}
