//! GPU kernels for Tessera's KV reads. The CUDA C source ships in the crate and is compiled
//! at run time with NVRTC (through the cudarc that candle exposes), one module per
//! configuration (codec, head dim, query heads per KV head): no nvcc at build time, and the
//! CPU build needs no CUDA at all. The launch code is behind the `cuda` feature.

/// The fused decode read (see the comments in the file).
pub const DECODE_CU: &str = include_str!("decode.cu");

/// Rows a decode block's four warps read per step, for head dim `d` (each lane holds 8
/// elements, so a warp covers `256 / d` rows at a time).
pub fn rows_per_block_step(d: usize) -> usize {
    4 * (256 / d).max(1)
}

/// How a decode read splits each sequence across blocks: `(splits, chunk)` with
/// `splits · chunk ≥ max_len`, `chunk` a multiple of two block steps (the kernel's unroll),
/// and about `target_blocks` blocks over `batch · kv_heads` (fewer where sequences are
/// short: a split of fewer than 256 positions costs more in merging than it gains).
pub fn plan_splits(
    batch: usize,
    kv_heads: usize,
    max_len: usize,
    d: usize,
    target_blocks: usize,
) -> (usize, usize) {
    let step = 2 * rows_per_block_step(d);
    let by_occupancy = target_blocks.div_ceil((batch * kv_heads).max(1));
    let by_length = max_len.div_ceil(256).max(1);
    let splits = by_occupancy.clamp(1, by_length);
    let chunk = max_len.div_ceil(splits).div_ceil(step) * step;
    (max_len.div_ceil(chunk.max(1)).max(1), chunk.max(step))
}

#[cfg(feature = "cuda")]
pub mod cuda;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_every_position_once_in_whole_steps() {
        for (b, h, len, d) in [
            (1, 1, 1, 256),
            (1, 1, 32768, 256),
            (16, 8, 131072, 128),
            (16, 8, 4096, 64),
            (3, 2, 1000, 128),
            (1, 8, 255, 128),
        ] {
            let (splits, chunk) = plan_splits(b, h, len, d, 1056);
            let step = 2 * rows_per_block_step(d);
            assert_eq!(chunk % step, 0, "{b} {h} {len} {d}");
            assert!(splits * chunk >= len, "covers: {b} {h} {len} {d}");
            assert!(
                (splits - 1) * chunk < len.max(1),
                "no empty split: {b} {h} {len} {d}"
            );
            assert!(splits == 1 || chunk >= 256 - step, "splits not too small");
        }
        // Long single sequences spread over many blocks; big batches need few splits.
        assert!(plan_splits(1, 1, 131072, 256, 1056).0 >= 256);
        assert!(plan_splits(16, 8, 131072, 128, 1056).0 <= 16);
    }
}
