#!/usr/bin/env python3
"""Golden vectors for tessera's affine codec, made by mlx itself (`mx.quantize`).

Writes `mlx_affine.json` next to this script; `tests/mlx_affine.rs` reads it. Run with
mlx's Linux CPU wheel and numpy:

    python -m venv /tmp/mlxenv && /tmp/mlxenv/bin/pip install "mlx[cpu]" numpy
    /tmp/mlxenv/bin/python crates/tessera-kv/tests/data/make_mlx_affine.py

Every input is an f32 that bf16 represents exactly (the cache rounds keys and values to
bf16 before quantizing), so mlx quantizes exactly what tessera's planes do. mlx is fed f32
(not bf16) so that its scales and biases come back unrounded (mlx stores them in the input
dtype; tessera stores f16, which the test applies itself).

For each bit width the input is `ROWS × DIM`, the same for every group size:
  row 0  random values, a different magnitude per 32-element block;
  row 1  blocks all positive, all negative, max-dominated, min-dominated;
  row 2  constant blocks (0, 0.75, -0.75) and a block below the 1e-7 scale floor;
  row 3  half-step grids: codes that round from an exact tie (x.5);
  row 4  blocks whose first code q0 = edge / scale is an exact tie (bits <= 6: at 8 bits
         this construction needs odd integers above 256, which bf16 cannot hold), otherwise
         random;
  row 5  large and tiny magnitudes.
For every group whose maximum is negative the group is also quantized with its largest
element replaced by 0 (`zero_max`), which makes mlx's CPU maximum (started at -inf) equal to
its Metal kernel's (started at 0); see tests/mlx_affine.rs.

Arrays are stored as hex strings, 8 hex digits per 32-bit value in little-endian byte
order (f32 bit patterns for floats, the packed words for codes).
"""

import json
import os

import mlx.core as mx
import numpy as np

SEED = 20240614
ROWS, DIM = 6, 128
BITS = [2, 3, 4, 5, 6, 8]
GROUPS = [32, 64, 128]
BLOCK = 32


def bf16(x):
    """Rounds f32 values to the nearest bf16 (ties to even), kept as f32."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
    return b.astype(np.uint32).view(np.float32)


def hexs(a):
    return np.ascontiguousarray(a).astype(np.dtype(a.dtype).newbyteorder("<")).tobytes().hex()


def inputs(bits, rng):
    n = (1 << bits) - 1
    w = np.zeros((ROWS, DIM), np.float32)
    blocks = DIM // BLOCK
    for b in range(blocks):
        sl = slice(b * BLOCK, (b + 1) * BLOCK)
        w[0, sl] = rng.uniform(-1, 1, BLOCK) * 10.0 ** rng.uniform(-2, 1)
        lo, hi = [(0.5, 2.0), (-2.0, -0.5), (-0.2, 3.0), (-3.0, 0.2)][b % 4]
        w[1, sl] = rng.uniform(lo, hi, BLOCK)
        w[2, sl] = [0.0, 0.75, -0.75, 0.0][b % 4]
        if b % 4 == 3:
            w[2, sl] = rng.uniform(-3e-8, 3e-8, BLOCK)
        # Half-step grid u * (j/2 - n): min -n·u, max 0, scale u, bias -n·u exactly.
        u = 2.0 ** -rng.integers(0, 6)
        j = rng.integers(0, 2 * n + 1, BLOCK)
        if bits == 8:
            j = rng.integers(2 * n - 250, 2 * n + 1, BLOCK)  # bf16 keeps these exact
        j[0], j[1] = 0, 2 * n
        w[3, sl] = u * (j / 2.0 - n)
        if bits <= 6:
            # min -(n+2)·u, max (n-2)·u: scale 2u exactly, q0 = -(n+2)/2, a tie.
            lo, hi = -(n + 2) * u, (n - 2) * u
            w[4, sl] = rng.uniform(lo, hi, BLOCK)
            w[4, b * BLOCK], w[4, b * BLOCK + 1] = lo, hi
        else:
            w[4, sl] = rng.uniform(-1, 1, BLOCK)
        w[5, sl] = rng.uniform(-1, 1, BLOCK) * [100.0, 1e-3, 3e4, 1e-5][b % 4]
    return bf16(w)


def quantize(w, group, bits):
    q, s, b = mx.quantize(mx.array(w), group_size=group, bits=bits)
    deq = mx.dequantize(q, s, b, group_size=group, bits=bits)
    return [np.array(a) for a in (q, s, b, deq)]


def main():
    rng = np.random.default_rng(SEED)
    data = {
        "generator": "make_mlx_affine.py",
        "mlx_version": mx.__version__,
        "device": str(mx.default_device()),
        "seed": SEED,
        "rows": ROWS,
        "dim": DIM,
        "inputs": {},
        "cases": [],
    }
    for bits in BITS:
        w = inputs(bits, rng)
        data["inputs"][str(bits)] = hexs(w)
        for group in GROUPS:
            q, s, b, deq = quantize(w, group, bits)
            assert q.dtype == np.uint32 and q.shape == (ROWS, DIM * bits // 32)
            assert s.dtype == np.float32 and s.shape == (ROWS, DIM // group)
            zero_max = []
            for r in range(ROWS):
                for g in range(DIM // group):
                    seg = w[r, g * group:(g + 1) * group].copy()
                    if seg.max() < 0:
                        e = int(seg.argmax())
                        seg[e] = 0.0
                        zq, zs, zb, _ = quantize(seg[None, :], group, bits)
                        zero_max.append({
                            "row": r, "group": g, "element": e, "codes": hexs(zq),
                            "scale": hexs(zs), "bias": hexs(zb),
                        })
            data["cases"].append({
                "bits": bits, "group": group, "codes": hexs(q), "scales": hexs(s),
                "biases": hexs(b), "dequantized": hexs(deq), "zero_max": zero_max,
            })
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlx_affine.json")
    with open(out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {out}: {os.path.getsize(out)} bytes")


if __name__ == "__main__":
    main()
