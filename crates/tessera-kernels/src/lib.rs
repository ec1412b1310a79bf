//! GPU kernels for Tessera's KV reads. The CUDA C source ships in the crate and is compiled
//! at run time with NVRTC (through the cudarc that candle exposes), one module per
//! configuration (codec, head dim, query heads per KV head): no nvcc at build time, and the
//! CPU build needs no CUDA at all. The launch code is behind the `cuda` feature.

/// The fused decode read (see the comments in the file).
pub const DECODE_CU: &str = include_str!("decode.cu");

/// Encoding, decoding and growing KV planes on the device (see the comments in the file).
pub const PLANES_CU: &str = include_str!("planes.cu");

/// Quantized weight matrices: the tensor-core matmul for decode steps and the dequantization
/// for prefill GEMMs.
pub const WEIGHTS_CU: &str = include_str!("weights.cu");

/// A decode step's greedy tokens picked on the device (greedy.rs).
pub const GREEDY_CU: &str = include_str!("greedy.cu");

/// Columns of an octet of blocks in the device's Q4_0 layout (weights.cu): matrices whose
/// width is not a multiple stay with candle's matmul.
pub const Q4_0_OCTET: usize = 256;

/// Rows of a tile in the device's Q4_0 layout (weights.cu, one mma's M): matrices whose height
/// is not a multiple stay with candle's matmul.
pub const Q4_0_ROWS: usize = 16;

/// A Q4_0 matrix of `n × k` (`n` a multiple of [`Q4_0_ROWS`], `k` of [`Q4_0_OCTET`]) from
/// the file's blocks (an f16 scale, then 16 code bytes: byte i holds weight i in its low
/// nibble and weight i + 16 in its high one) into weights.cu's code and scale planes. The
/// code words are the file's own four-byte words, regrouped so that a lane's 16-byte load
/// holds its word of two blocks for two rows.
pub fn q4_0_planes(blocks: &[u8], n: usize, k: usize) -> anyhow::Result<(Vec<u8>, Vec<u16>)> {
    if !k.is_multiple_of(Q4_0_OCTET) || !n.is_multiple_of(Q4_0_ROWS) {
        anyhow::bail!(
            "Q4_0 matrix {n}×{k}: the device layout takes rows in multiples of {Q4_0_ROWS} \
             and widths in multiples of {Q4_0_OCTET}"
        );
    }
    let kb = k / 32;
    if blocks.len() < n * kb * 18 {
        anyhow::bail!(
            "Q4_0 matrix {n}×{k}: {} bytes, expected {}",
            blocks.len(),
            n * kb * 18
        );
    }
    let block = |row: usize, b: usize| &blocks[(row * kb + b) * 18..][..18];
    let mut codes = Vec::with_capacity(n * k / 2);
    let mut scales = Vec::with_capacity(n * kb);
    for tile in 0..n / Q4_0_ROWS {
        let row0 = tile * Q4_0_ROWS;
        for pair in 0..kb / 2 {
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                for (b, dr) in [
                    (2 * pair, 0),
                    (2 * pair, 8),
                    (2 * pair + 1, 0),
                    (2 * pair + 1, 8),
                ] {
                    codes.extend_from_slice(&block(row0 + g + dr, b)[2 + 4 * t..][..4]);
                }
            }
        }
        for octet in 0..kb / 8 {
            for g in 0..8 {
                for i in 0..8 {
                    for dr in [0, 8] {
                        let d = block(row0 + g + dr, octet * 8 + i);
                        scales.push(u16::from_le_bytes([d[0], d[1]]));
                    }
                }
            }
        }
    }
    Ok((codes, scales))
}

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
pub mod compile;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
mod dependent;
#[cfg(feature = "cuda")]
pub mod graphs;
#[cfg(feature = "cuda")]
mod greedy;
pub mod tally;
#[cfg(feature = "cuda")]
pub mod weights;

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads weight (row, col) back from the planes as weights.cu's comment lays them out,
    /// and compares it with the file block's value: every weight lands once, in its place.
    #[test]
    fn q4_0_planes_hold_every_weight_where_the_kernel_reads_it() {
        let (n, k) = (32, 512);
        let kb = k / 32;
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let blocks: Vec<u8> = (0..n * kb * 18)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        let (codes, scales) = q4_0_planes(&blocks, n, k).unwrap();
        assert_eq!((codes.len(), scales.len()), (n * k / 2, n * kb));
        for row in 0..n {
            for col in 0..k {
                // The file: block col / 32, position col % 32.
                let block = &blocks[(row * kb + col / 32) * 18..][..18];
                let p = col % 32;
                let want = if p < 16 {
                    block[2 + p] & 15
                } else {
                    block[2 + p - 16] >> 4
                };
                let want_scale = u16::from_le_bytes([block[0], block[1]]);
                // The planes: tile, block pair, lane (g, t), word e of the lane's load.
                let (tile, g, upper) = (row / 16, row % 8, row % 16 >= 8);
                let (b, pos) = (col / 32, col % 32);
                let (t, byte, nibble) = ((pos % 16) / 4, pos % 4, pos / 16);
                let e = 2 * (b % 2) + usize::from(upper);
                let load = (tile * (kb / 2) + b / 2) * 32 + 4 * g + t;
                let got = (codes[load * 16 + 4 * e + byte] >> (4 * nibble)) & 15;
                assert_eq!(got, want, "row {row} col {col}");
                let s = ((tile * (kb / 8) + b / 8) * 8 + g) * 16 + 2 * (b % 8) + usize::from(upper);
                assert_eq!(scales[s], want_scale, "row {row} col {col} scale");
            }
        }
        assert!(q4_0_planes(&blocks, n, 1000).is_err());
        assert!(q4_0_planes(&blocks, 24, k).is_err());
        assert!(q4_0_planes(&blocks[..100], n, k).is_err());
    }

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
