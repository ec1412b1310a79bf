//! Decode and chunk reads at depth, per codec, on Gemma 3 270M's global-layer geometry
//! (1 KV head, 4 query heads, head_dim 256). `cargo bench -p tessera-kv --bench reads
//! [-- DEPTH]` prints microseconds per read; the codec's cost at depth is what decode speed
//! at long context comes down to.

use candle_core::{Device, Tensor};
use std::time::Instant;
use tessera_kv::{AttentionCache, KvCache, KvScheme, LayerSpec, Retention};

fn random(shape: (usize, usize, usize, usize), seed: u64) -> Tensor {
    let mut s = seed;
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let data: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

fn main() {
    let depth: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(16384);
    let spec = LayerSpec {
        kv_heads: 1,
        head_dim: 256,
        value_dim: 256,
        retention: Retention::Full,
    };
    println!("depth {depth}: µs per read of one layer (1 KV head, 4 query heads, head_dim 256)");
    println!("{:<14} {:>12} {:>14}", "kv", "decode", "chunk of 512");
    let only = std::env::var("READS_KV").ok();
    for kv in [
        "bf16",
        "f16",
        "affine:8",
        "affine:4",
        "affine:4:32",
        "affine:2",
        "turbo:4",
        "turbo:6:3",
        "turbo:6:4",
        "turbo:4:3",
        "turbo:3",
        "turbo:8",
        "turbo:4:pairs",
        "turbo:4:3:pairs",
        "turbo:3:pairs",
    ] {
        if only.as_deref().is_some_and(|o| o != kv) {
            continue;
        }
        let scheme = KvScheme::parse(kv).unwrap();
        let mut cache = KvCache::new(&[spec], &scheme, vec![0]).unwrap();
        let layer = cache.layer_mut(0);
        for (i, start) in (0..depth).step_by(512).enumerate() {
            let n = 512.min(depth - start);
            let k = random((1, 1, n, 256), 2 * i as u64);
            let v = random((1, 1, n, 256), 2 * i as u64 + 1);
            layer.append_window(&k, &v).unwrap();
        }
        let (k1, q1) = (random((1, 1, 1, 256), 7), random((1, 4, 1, 256), 8));
        let steps: usize = std::env::var("READS_STEPS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(50);
        let t = Instant::now();
        for _ in 0..steps {
            let read = layer.append_decode(&k1, &k1).unwrap();
            std::hint::black_box(read.attend(&q1, 0.0625).unwrap());
        }
        let decode = t.elapsed().as_secs_f64() * 1e6 / steps as f64;
        layer.trim(steps).unwrap();
        let (k, q) = (random((1, 1, 512, 256), 9), random((1, 4, 512, 256), 10));
        let t = Instant::now();
        let read = layer.append_window(&k, &k).unwrap();
        std::hint::black_box(read.attend(&q, 0.0625).unwrap());
        let chunk = t.elapsed().as_secs_f64() * 1e6;
        println!("{kv:<14} {decode:>12.0} {chunk:>14.0}");
    }
}
