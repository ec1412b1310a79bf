//! GPU kernels for Tessera's KV reads. The CUDA C source ships in the crate and is compiled
//! at run time with NVRTC (through the cudarc that candle exposes), one module per
//! configuration (codec, head dim, query heads per KV head): no nvcc at build time, and the
//! CPU build needs no CUDA at all. The launch code is behind the `cuda` feature.

/// The fused decode read (see the comments in the file).
pub const DECODE_CU: &str = include_str!("decode.cu");

/// Encoding, decoding and growing KV planes on the device (see the comments in the file).
pub const PLANES_CU: &str = include_str!("planes.cu");

/// Positions a decode block covers per step of its loop: 4 warps × 16 rows for the
/// tensor-core kernel, and a multiple of the CUDA-core kernel's step (4 warps × 256/d rows,
/// × its unroll) for every head dim. Splits are whole steps.
pub const BLOCK_STEP: usize = 64;

/// Fewest positions worth a split of their own: below this, merging costs more than the
/// parallelism gains.
pub const MIN_SPLIT: usize = 128;

/// How a decode read splits each sequence across blocks: `(splits, chunk)` with
/// `splits · chunk ≥ max_len`, `chunk` a multiple of [`BLOCK_STEP`], and at most
/// `resident_blocks` blocks over `batch · kv_heads` (one wave: a second, partial wave
/// would leave most of the chip idle at its end), fewer where sequences are short.
pub fn plan_splits(
    batch: usize,
    kv_heads: usize,
    max_len: usize,
    resident_blocks: usize,
) -> (usize, usize) {
    let by_occupancy = (resident_blocks / (batch * kv_heads).max(1)).max(1);
    let by_length = max_len.div_ceil(MIN_SPLIT).max(1);
    let splits = by_occupancy.min(by_length);
    let chunk = max_len.div_ceil(splits).div_ceil(BLOCK_STEP) * BLOCK_STEP;
    (max_len.div_ceil(chunk.max(1)).max(1), chunk.max(BLOCK_STEP))
}

#[cfg(feature = "cuda")]
pub mod backend;
#[cfg(feature = "cuda")]
pub mod cuda;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_every_position_once_in_whole_steps() {
        for (b, h, len) in [
            (1, 1, 1),
            (1, 1, 32768),
            (16, 8, 131072),
            (16, 8, 4096),
            (3, 2, 1000),
            (1, 8, 255),
            (64, 64, 70000),
        ] {
            let (splits, chunk) = plan_splits(b, h, len, 528);
            assert_eq!(chunk % BLOCK_STEP, 0, "{b} {h} {len}");
            assert!(splits * chunk >= len, "covers: {b} {h} {len}");
            assert!(
                (splits - 1) * chunk < len.max(1),
                "no empty split: {b} {h} {len}"
            );
            assert!(
                splits == 1 || chunk >= MIN_SPLIT - BLOCK_STEP,
                "splits not too small"
            );
            assert!(
                splits == 1 || b * h * splits <= 528,
                "one wave: {b} {h} {len}"
            );
        }
        // A long single sequence spreads over the chip; a big batch needs few splits.
        assert!((500..=528).contains(&plan_splits(1, 1, 131072, 528).0));
        assert_eq!(plan_splits(16, 8, 131072, 528).0, 4);
        assert_eq!(plan_splits(1, 1, 32768, 528).0, 256);
    }
}
