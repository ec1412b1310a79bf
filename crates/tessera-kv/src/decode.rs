//! The fused decode read of plain storage: one query position per row, attended straight
//! from the stored planes. Nothing is gathered or converted into a second copy of the
//! cache; query heads that share a KV head (GQA) are folded so each stored key and value is
//! read once per KV head. Work is split over positions across the CPU pool and the partial
//! softmax states are merged (the flash-decoding scheme).

use candle_core::{CpuStorage, Storage, Tensor};

/// Element types plain planes hold.
pub(crate) trait Element: Copy + Send + Sync {
    fn f32(self) -> f32;
}

impl Element for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

impl Element for half::bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl Element for half::f16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

/// The visible slots of one row: up to two ranges (a ring that wrapped).
#[derive(Debug, Clone)]
pub(crate) struct RowSlots {
    pub ranges: Vec<std::ops::Range<usize>>,
}

/// Geometry of one fused decode.
pub(crate) struct DecodeShape {
    pub rows: usize,
    pub kv_heads: usize,
    pub group: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    /// Slots per (row, head) in the planes.
    pub capacity: usize,
}

const LANES: usize = 16;

/// Partial softmax state over a span of positions for the `group` query heads of one KV head.
pub(crate) struct Partial {
    pub max: Vec<f32>,
    pub sum: Vec<f32>,
    pub acc: Vec<f32>, // (group, value_dim)
}

#[inline(always)]
pub(crate) fn dot<E: Element>(q: &[f32], k: &[E]) -> f32 {
    let mut lanes = [0f32; LANES];
    let (qc, kc) = (q.chunks_exact(LANES), k.chunks_exact(LANES));
    let (qr, kr) = (qc.remainder(), kc.remainder());
    for (qa, ka) in qc.zip(kc) {
        for l in 0..LANES {
            lanes[l] += qa[l] * ka[l].f32();
        }
    }
    let mut total: f32 = lanes.iter().sum();
    for (a, b) in qr.iter().zip(kr) {
        total += a * b.f32();
    }
    total
}

/// Turns `g` rows of `n` scores into `exp(score − row max)` in place; returns each row's max
/// and sum (the partial softmax state).
#[inline(always)]
pub(crate) fn exponentiate(scores: &mut [f32], g: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut max = vec![f32::NEG_INFINITY; g];
    let mut sum = vec![0f32; g];
    for h in 0..g {
        let row = &mut scores[h * n..(h + 1) * n];
        max[h] = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        for v in row.iter_mut() {
            *v = (*v - max[h]).exp();
            sum[h] += *v;
        }
    }
    (max, sum)
}

#[inline(always)]
fn span<E: Element>(
    q: &[f32],
    keys: &[E],
    values: &[E],
    slots: std::ops::Range<usize>,
    s: &DecodeShape,
    scale: f32,
) -> Partial {
    let (g, d, dv) = (s.group, s.head_dim, s.value_dim);
    let n = slots.len();
    let mut scores = vec![0f32; g * n];
    for (i, slot) in slots.clone().enumerate() {
        let k = &keys[slot * d..(slot + 1) * d];
        for h in 0..g {
            scores[h * n + i] = dot(&q[h * d..(h + 1) * d], k) * scale;
        }
    }
    let (max, sum) = exponentiate(&mut scores, g, n);
    let mut acc = vec![0f32; g * dv];
    for (i, slot) in slots.enumerate() {
        let v = &values[slot * dv..(slot + 1) * dv];
        for h in 0..g {
            let p = scores[h * n + i];
            let out = &mut acc[h * dv..(h + 1) * dv];
            for (o, x) in out.iter_mut().zip(v) {
                *o += p * x.f32();
            }
        }
    }
    Partial { max, sum, acc }
}

fn merge(parts: Vec<Partial>, group: usize, dv: usize) -> Vec<f32> {
    let mut out = vec![0f32; group * dv];
    for h in 0..group {
        let max = parts
            .iter()
            .map(|p| p.max[h])
            .fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0f32;
        for p in &parts {
            let w = (p.max[h] - max).exp();
            total += p.sum[h] * w;
            for (o, a) in out[h * dv..(h + 1) * dv]
                .iter_mut()
                .zip(&p.acc[h * dv..(h + 1) * dv])
            {
                *o += a * w;
            }
        }
        for o in &mut out[h * dv..(h + 1) * dv] {
            *o /= total;
        }
    }
    out
}

/// Positions per work item: small enough to use both cores at moderate depth, large
/// enough that the merge stays negligible.
const CHUNK: usize = 256;

/// `span` compiled for AVX2 + FMA, where the CPU has them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn span_avx2<E: Element>(
    q: &[f32],
    keys: &[E],
    values: &[E],
    slots: std::ops::Range<usize>,
    s: &DecodeShape,
    scale: f32,
) -> Partial {
    span(q, keys, values, slots, s, scale)
}

fn span_best<E: Element>(
    q: &[f32],
    keys: &[E],
    values: &[E],
    slots: std::ops::Range<usize>,
    s: &DecodeShape,
    scale: f32,
) -> Partial {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were just detected.
        return unsafe { span_avx2(q, keys, values, slots, s, scale) };
    }
    span(q, keys, values, slots, s, scale)
}

/// Splits every (row, KV head) over its visible slots into pieces of at most [`CHUNK`]
/// positions, runs `kernel` on each piece across the CPU pool and merges the partial softmax
/// states. Returns `(rows, kv_heads, group, value_dim)` row-major.
pub(crate) fn run_pieces<K>(rows: &[RowSlots], s: &DecodeShape, kernel: K) -> Vec<f32>
where
    K: Fn(usize, usize, std::ops::Range<usize>) -> Partial + Sync,
{
    let (g, dv) = (s.group, s.value_dim);
    let mut items = Vec::new();
    for (r, slots) in rows.iter().enumerate() {
        for h in 0..s.kv_heads {
            for range in &slots.ranges {
                let mut start = range.start;
                while start < range.end {
                    let end = (start + CHUNK).min(range.end);
                    items.push((r, h, start..end));
                    start = end;
                }
            }
        }
    }
    let parts: Vec<std::sync::Mutex<Option<Partial>>> =
        items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    candle_core::utils::barrier_pool().execute_chunked(items.len(), |range| {
        for i in range {
            let (r, h, ref slots) = items[i];
            *parts[i].lock().unwrap() = Some(kernel(r, h, slots.clone()));
        }
    });
    let mut out = vec![0f32; s.rows * s.kv_heads * g * dv];
    let mut parts = parts.into_iter().map(|p| p.into_inner().unwrap().unwrap());
    let mut items = items.into_iter().peekable();
    while let Some((r, h, _)) = items.next() {
        let mut group_parts = vec![parts.next().unwrap()];
        while items.peek().is_some_and(|(r2, h2, _)| (*r2, *h2) == (r, h)) {
            items.next();
            group_parts.push(parts.next().unwrap());
        }
        let merged = merge(group_parts, g, dv);
        out[(r * s.kv_heads + h) * g * dv..][..g * dv].copy_from_slice(&merged);
    }
    out
}

fn attend_typed<E: Element>(
    q: &[f32],
    keys: &[E],
    values: &[E],
    rows: &[RowSlots],
    s: &DecodeShape,
    scale: f32,
) -> Vec<f32> {
    let (g, d, dv) = (s.group, s.head_dim, s.value_dim);
    run_pieces(rows, s, |r, h, slots| {
        let base = (r * s.kv_heads + h) * s.capacity;
        span_best(
            &q[(r * s.kv_heads + h) * g * d..][..g * d],
            &keys[base * d..(base + s.capacity) * d],
            &values[base * dv..(base + s.capacity) * dv],
            slots,
            s,
            scale,
        )
    })
}

/// Attends `q` `(rows, kv_heads * group, 1, head_dim)` over `keys`/`values` planes
/// `(rows, kv_heads, capacity, dim)`, each row over its visible slots.
pub(crate) fn attend(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    rows: &[RowSlots],
    s: &DecodeShape,
    scale: f32,
) -> candle_core::Result<Tensor> {
    let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
    let (ks, kl) = keys.storage_and_layout();
    let (vs, vl) = values.storage_and_layout();
    let (ko, vo) = (kl.start_offset(), vl.start_offset());
    let out = match (&*ks, &*vs) {
        (Storage::Cpu(CpuStorage::BF16(k)), Storage::Cpu(CpuStorage::BF16(v))) => {
            attend_typed(&qv, &k[ko..], &v[vo..], rows, s, scale)
        }
        (Storage::Cpu(CpuStorage::F16(k)), Storage::Cpu(CpuStorage::F16(v))) => {
            attend_typed(&qv, &k[ko..], &v[vo..], rows, s, scale)
        }
        (Storage::Cpu(CpuStorage::F32(k)), Storage::Cpu(CpuStorage::F32(v))) => {
            attend_typed(&qv, &k[ko..], &v[vo..], rows, s, scale)
        }
        _ => candle_core::bail!("fused decode read needs CPU planes of one float type"),
    };
    Tensor::from_vec(
        out,
        (s.rows, s.kv_heads * s.group, 1, s.value_dim),
        q.device(),
    )
}
