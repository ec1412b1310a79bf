// Quantized weight matrices on the device: the decode step's matmuls on the tensor cores and
// the dequantization that feeds prefill's bf16 GEMMs (see weights.rs).
//
// The products are m16n8k16 f16 mma with f32 accumulation: 16 weight rows as M, input rows
// as N, and per 32-weight block two mma whose sum is scaled by the block's scale in f32.
// A dot product sums over k, so k may be permuted as long as weights and inputs agree:
// lane (g = lane / 4, t = lane % 4) takes, of each block, the weights at positions
// 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3, which are exactly the file's code word t (bytes
// 4t .. 4t + 3, low nibbles the first four, high nibbles the second). With the 1024
// exponent trick a masked word becomes two f16 codes (1024 + c, or 1024 + 16c for the
// nibbles at bits 4–7), one f16x2 subtract (or fma of 1/16) gives c − 8 exactly: two
// instructions a pair of codes, which at one input row is what bounds the kernel. Slot
// pairs (2t, 2t+1) and (2t+8, 2t+9) of mma 0 hold positions (4t, 4t+2) and (4t+1, 4t+3);
// mma 1's slots hold 16 + those positions (the high nibbles).
//
// Q4_0 planes, for n rows (a multiple of 16) × k columns (a multiple of 256):
//   codes  per 16-row tile T, per block pair P (k / 64), per lane: one 16-byte load of
//          code word t of [block 2P row g, block 2P row g + 8, block 2P+1 row g,
//          block 2P+1 row g + 8] (rows counted from 16T);
//   scales per tile T, per block octet O (k / 256), per g: 16 f16, block 8O + i's scales of
//          rows g and g + 8 at 2i and 2i + 1 (two 16-byte loads a lane per octet).
// lib.rs's `q4_0_planes` writes this layout from the file's blocks.
//
// Inputs: `q4_0_inputs` turns f32 rows into B fragments once per matmul. Up to SPLIT_UP_TO
// rows (weights.rs; 8, a decode step), each input row is split into an f16 high part and an
// f16 residual (x − hi) in two adjacent columns, so the product carries ~22 bits of x
// (f32-like) rather than f16's 11; the output adds the two columns. Above, rows enter as
// f16, 32 a launch (NT = 4 n8 tiles). `q4_0_normed_inputs` RMS-normalizes the rows first,
// folding the norm that precedes a model's matmul into the same launch, and
// `q4_0_add_normed_inputs` the residual add before that norm too (it writes the sum, the
// residual stream, as it reads it); `q4_0_silu_gated_inputs` does the same for a gated MLP's
// silu(gate) · up.
// No CUDA headers: f16 and bf16 are converted by hand, so NVRTC needs no include path.

// Build choices (weights-bench's `variants` compiles others and times them; NOTES.md keeps
// the ones that lost: an L2 prefetch of the block's tiles, one register set instead of two, a
// shared-memory ring of up to 5 octets in flight a warp by cp.async, an octet's B fragments
// all loaded before its first mma):
//   B_AHEAD    1: with one n8 tile, an octet's B fragments are loaded with its codes (one
//              octet ahead, 32 registers a set); 0: at their use, like wider launches'.
//   MIN_WARPS  the launch bounds ask for MIN_WARPS / W blocks an SM: at 12 the compiler
//              hoists loads further (more registers where the bound allows) and 8–32-row
//              launches ran 10–20% faster on the H200; 0 leaves it free.
//   PRIOR_L1   how a kernel loads what the kernel before it wrote (ld_prior): 0 from L2,
//              1 through L1. 1 took an 8B forward's matmuls 4–9% faster at 8–32 input rows
//              on the H100 (the 4-row output matrix 187 → 117 µs), the same digests.
#ifndef B_AHEAD
#define B_AHEAD 1
#endif
#ifndef MIN_WARPS
#define MIN_WARPS 12
#endif
#ifndef PRIOR_L1
#define PRIOR_L1 1
#endif
//   WIDE_8_BLOCKS  blocks an SM for the 8-warp, one-tile kernels of 2 or 4 n8 tiles (5+ input
//              rows; weights.rs launches o and down so there): 2 caps them at 128 registers
//              without spills, and o and down ran 1.1–2.4 µs faster each at 8–32 input rows
//              on the H100 than as 2 tiles × 8 warps at one block; 0: MIN_WARPS / 8. The
//              4-warp kernels at 4 blocks (MIN_WARPS 16 for them alone) lost at 16 rows.
#ifndef WIDE_8_BLOCKS
#define WIDE_8_BLOCKS 2
#endif
#define MIN_BLOCKS(NT, RT, W) \
    (NT > 1 && RT == 1 && W == 8 && WIDE_8_BLOCKS > 0 ? WIDE_8_BLOCKS : MIN_WARPS / (W))

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Programmatic dependent launch (dependent.rs; weights.rs launches the decode matmuls and
// their input launches so): `release_dependents` lets the next kernel on the stream be
// scheduled once every block of this one has started; `wait_for_prior` holds until the
// kernel before this one has finished and its writes are visible. A kernel touches nothing
// an earlier one writes or reads before its wait; a matmul loads its first weights (never
// written) ahead of it, so that their latency overlaps the previous kernel's tail. Without
// the launch attribute both return at once.
__device__ __forceinline__ void release_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ void wait_for_prior() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

// A load of what an earlier kernel wrote, after wait_for_prior. PRIOR_L1 1: an ordinary
// load, which may hit L1, so the blocks on one SM share the B fragments they all read (each
// warp's own otherwise: at 4–32 input rows the fragments are more bytes from L2 than the
// weights). griddepcontrol.wait makes the earlier grids' writes visible to this grid, and an
// ordinary load is not moved above it (its asm clobbers memory). 0: from L2 (.cg), where a
// dependent launch's writes meet, never from a line this SM's L1 may hold.
#if PRIOR_L1
__device__ __forceinline__ float4 ld_prior(const float4* p) { return *p; }
__device__ __forceinline__ uint4 ld_prior(const uint4* p) { return *p; }
#else
__device__ __forceinline__ float4 ld_prior(const float4* p) { return __ldcg(p); }
__device__ __forceinline__ uint4 ld_prior(const uint4* p) { return __ldcg(p); }
#endif

__device__ __forceinline__ u32 word_of(const uint4& c, int t) {
    return t == 0 ? c.x : t == 1 ? c.y : t == 2 ? c.z : c.w;
}

// (a & b) | c in one LOP3 (the compiler's own code spends two on two constants).
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// The codes at bits 0–3 and 16–19 of `w` as f16 (c − 8): one LOP3 makes 1024 + c under
// the 0x6400 exponent, one f16x2 subtract of 1032. Exact.
__device__ __forceinline__ u32 low_codes(u32 w) {
    const u32 v = and_or(w, 0x000F000Fu, 0x64006400u);
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(0x64086408u));
    return r;
}

// The codes at bits 4–7 and 20–23 of `w`, unshifted: one LOP3 makes 1024 + 16c, one f16x2
// fma of 1/16 and −72 gives c − 8 (64 + c is exact, so is the sum).
__device__ __forceinline__ u32 high_codes(u32 w) {
    const u32 v = and_or(w, 0x00F000F0u, 0x64006400u);
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x2C002C00u), "r"(0xD480D480u));
    return r;
}

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
                 : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]),
                   "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// RoPE of one adjacent pair (llama.cpp's "normal" RoPE, candle's rope_i) at angle (c, s):
// (e, o) → (e·c − o·s, e·s + o·c), each product rounded before the fused add, so the matmul's
// epilogue and the GEMM path's `rope_pairs` give the same bits.
__device__ __forceinline__ float rotated(float e, float o, float c, float s, bool odd) {
    return odd ? fmaf(e, s, __fmul_rn(o, c)) : fmaf(e, c, -__fmul_rn(o, s));
}

// B fragments for the input rows of `x` (row-major, k floats each): per n8 tile j, per block
// b, per lane: [b0, b1] of mma 0, then of mma 1. With `split`, column 8j + g is input row
// (8j + g) / 2, its high part for even columns and its residual for odd ones (4 rows a
// tile); without, column c is input row c in f16 (8 rows a tile). Zero past m. One thread a
// lane's 16 bytes. Grid: NT · k/32 · 32 threads.
// Where a fragment's values come from: rows of x as they are; RMS-normalized (times the
// norm weights); the same of x + add, the sum written out; or silu(x) · y, gate and up
// rows of a gated MLP (candle's silu, x / (1 + e^−x), then the product, as two launches of
// their own would).
#define PLAIN 0
#define NORMED 1
#define SILU_GATED 2
#define ADD_NORMED 3

// A lane's fragment words of positions 4t .. 4t + 3 (v[0..4]) and 16 + 4t .. (v[4..8]) of a
// block: the values in f16, or with `residual` what f16 left of them, in f16.
__device__ __forceinline__ uint4 fragment_words(const float (&v)[8], bool residual) {
    u32 h[8];
#pragma unroll
    for (int e = 0; e < 8; e++) {
        h[e] = f32_to_f16(v[e]);
        if (residual) h[e] = f32_to_f16(v[e] - f16_to_f32((u16)h[e]));
    }
    // Slots (2t, 2t+1) ← positions (4t, 4t+2); (2t+8, 2t+9) ← (4t+1, 4t+3).
    return make_uint4(h[0] | (h[2] << 16), h[1] | (h[3] << 16), h[4] | (h[6] << 16),
                      h[5] | (h[7] << 16));
}

// Fragment word set i (n8 tile j, block b, lane) of rows `x` (`ld` floats apart) from
// SOURCE (PLAIN or SILU_GATED; the normed sources have their own launch, normed_inputs).
template <int SOURCE>
__device__ __forceinline__ void inputs_body(int i, const float* __restrict__ x,
                                            const float* __restrict__ y,
                                            uint4* __restrict__ frag, int m, int k, int ld,
                                            int nt, int split) {
    const int kb = k >> 5;
    if (i >= nt * kb * 32) return;
    const int lane = i & 31, b = (i >> 5) % kb, j = (i >> 5) / kb;
    const int col = 8 * j + (lane >> 2), t = lane & 3, row = split ? col >> 1 : col;
    const bool residual = split && (col & 1);
    uint4 out = make_uint4(0u, 0u, 0u, 0u);
    if (row < m) {
        const size_t at = (size_t)row * ld + 32 * b + 4 * t;
        const float4 lo = ld_prior((const float4*)(x + at)), hi = ld_prior((const float4*)(x + at + 16));
        float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        if (SOURCE == SILU_GATED) {
            const float4 ul = ld_prior((const float4*)(y + at)), uh = ld_prior((const float4*)(y + at + 16));
            const float u[8] = {ul.x, ul.y, ul.z, ul.w, uh.x, uh.y, uh.z, uh.w};
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = v[e] / (1.f + expf(-v[e])) * u[e];
        }
        out = fragment_words(v, residual);
    }
    frag[i] = out;
}

extern "C" __global__ void q4_0_inputs(const float* __restrict__ x, uint4* __restrict__ frag,
                                       int m, int k, int nt, int split) {
    release_dependents();
    wait_for_prior();
    inputs_body<PLAIN>(blockIdx.x * blockDim.x + threadIdx.x, x, nullptr, frag, m, k, k, nt,
                       split);
}

// q4_0_inputs of silu(gate) · up, rows `ld` floats apart (views into one gate|up output).
extern "C" __global__ void q4_0_silu_gated_inputs(const float* __restrict__ gate,
                                                  const float* __restrict__ up,
                                                  uint4* __restrict__ frag, int m, int k,
                                                  int ld, int nt, int split) {
    release_dependents();
    wait_for_prior();
    inputs_body<SILU_GATED>(blockIdx.x * blockDim.x + threadIdx.x, gate, up, frag, m, k, ld,
                            nt, split);
}

// q4_0_inputs of RMS-normalized rows, x / sqrt(mean(x²) + eps) · w, as a separate norm
// launch would give them (f32 throughout); with ADD, of the rows of x + add (the sum as a
// separate add launch would give it, written to `sum`). One block a fragment column (input
// row, or its high part or residual; 8 · nt blocks), a thread one fragment word set (a
// lane's 8 elements of a k block) of up to NORM_ITEMS: it loads its elements once, the
// block sums their squares, and the thread writes its words from the same registers. The
// norm's weights (never written) are loaded before the wait for the launch before. No
// second launch, no grid sync, one pass over the row from L2. (Blocks over the flat word
// index, each summing every row, took 13 µs a launch at 16 rows on the H200: 8 blocks each
// reading all 256 KB.)
#define NORM_ITEMS 4 // k ≤ 32 · 1024 (weights.rs checks)
template <bool ADD>
__device__ __forceinline__ void normed_inputs(const float* __restrict__ x,
                                              const float* __restrict__ add,
                                              float* __restrict__ sum,
                                              const float* __restrict__ w,
                                              uint4* __restrict__ frag, int m, int k, int nt,
                                              int split, float eps) {
    __shared__ float partial[32];
    __shared__ float inv;
    release_dependents();
    const int c = blockIdx.x, row = split ? c >> 1 : c; // row ≥ m: a zero column
    const bool residual = split && (c & 1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int kb = k >> 5, words = kb * 4, j = c >> 3, g = c & 7;
    // Word set idx: k block idx / 4, lane t = idx % 4: elements 32b + 4t .. + 3, + 16 .. + 19.
    float wv[NORM_ITEMS][8], v[NORM_ITEMS][8];
#pragma unroll
    for (int it = 0; it < NORM_ITEMS; it++) {
        const int idx = threadIdx.x + it * blockDim.x;
        if (idx < words && row < m) {
            const float* wr = w + 32 * (idx >> 2) + 4 * (idx & 3);
            const float4 wl = __ldg((const float4*)wr), wh = __ldg((const float4*)(wr + 16));
            const float gw[8] = {wl.x, wl.y, wl.z, wl.w, wh.x, wh.y, wh.z, wh.w};
#pragma unroll
            for (int e = 0; e < 8; e++) wv[it][e] = gw[e];
        }
    }
    wait_for_prior();
    if (row < m) { // the same for the whole block
        float s = 0.f;
#pragma unroll
        for (int it = 0; it < NORM_ITEMS; it++) {
            const int idx = threadIdx.x + it * blockDim.x;
            if (idx >= words) continue;
            const size_t at = (size_t)row * k + 32 * (idx >> 2) + 4 * (idx & 3);
            const float4 lo = ld_prior((const float4*)(x + at)), hi = ld_prior((const float4*)(x + at + 16));
            float r[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
            if (ADD) {
                const float4 al = ld_prior((const float4*)(add + at)), ah = ld_prior((const float4*)(add + at + 16));
                const float a[8] = {al.x, al.y, al.z, al.w, ah.x, ah.y, ah.z, ah.w};
#pragma unroll
                for (int e = 0; e < 8; e++) r[e] += a[e];
                // Each row has one high-part column: its block writes the sum.
                if (!residual) {
                    *(float4*)(sum + at) = make_float4(r[0], r[1], r[2], r[3]);
                    *(float4*)(sum + at + 16) = make_float4(r[4], r[5], r[6], r[7]);
                }
            }
#pragma unroll
            for (int e = 0; e < 8; e++) {
                v[it][e] = r[e];
                s += r[e] * r[e];
            }
        }
#pragma unroll
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) partial[warp] = s;
        __syncthreads();
        if (threadIdx.x == 0) {
            float total = 0.f;
            for (int q = 0; q < warps; q++) total += partial[q];
            inv = rsqrtf(total / (float)k + eps);
        }
        __syncthreads();
    }
#pragma unroll
    for (int it = 0; it < NORM_ITEMS; it++) {
        const int idx = threadIdx.x + it * blockDim.x;
        if (idx >= words) continue;
        uint4 out = make_uint4(0u, 0u, 0u, 0u);
        if (row < m) {
            float n[8];
#pragma unroll
            for (int e = 0; e < 8; e++) n[e] = v[it][e] * inv * wv[it][e];
            out = fragment_words(n, residual);
        }
        frag[((j * kb + (idx >> 2)) << 5) + (g << 2) + (idx & 3)] = out;
    }
}

extern "C" __global__ void q4_0_normed_inputs(const float* __restrict__ x,
                                              const float* __restrict__ w,
                                              uint4* __restrict__ frag, int m, int k, int nt,
                                              int split, float eps) {
    normed_inputs<false>(x, nullptr, nullptr, w, frag, m, k, nt, split, eps);
}

extern "C" __global__ void q4_0_add_normed_inputs(const float* __restrict__ x,
                                                  const float* __restrict__ add,
                                                  float* __restrict__ sum,
                                                  const float* __restrict__ w,
                                                  uint4* __restrict__ frag, int m, int k,
                                                  int nt, int split, float eps) {
    normed_inputs<true>(x, add, sum, w, frag, m, k, nt, split, eps);
}

// One octet's loads for RT tiles: a lane's 4 code loads and 2 scale loads per tile, and
// with one n8 tile (up to 4 input rows) the octet's 8 B fragments too.
template <int NT, int RT>
struct Octet {
    uint4 c[RT][4], s[RT][2], bf[NT == 1 && B_AHEAD ? 8 : 1];
};

// CODES_L1   how the matmuls load their weights' codes: 0 through L1 (__ldg), 1 past it
//            (L1::no_allocate), 2 first out of it (L1::evict_first), so that they do not
//            push out the B fragments every block of an SM reads. 2 took one 8B forward's
//            matmuls 1% faster at one row and 3–4% at 8–16 rows on the H100 (NOTES.md).
//            Not volatile: the codes never change, so the compiler may move these loads
//            as it moves __ldg.
#ifndef CODES_L1
#define CODES_L1 2
#endif
#if CODES_L1 == 1
#define CODES_EVICTION "L1::no_allocate"
#elif CODES_L1 == 2
#define CODES_EVICTION "L1::evict_first"
#endif
__device__ __forceinline__ uint4 ld_codes(const uint4* p) {
#ifdef CODES_EVICTION
    uint4 v;
    asm("ld.global.nc." CODES_EVICTION ".v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
#else
    return __ldg(p);
#endif
}

template <int NT, int RT>
__device__ __forceinline__ void load_weights(Octet<NT, RT>& q, const uint4* const (&cbase)[RT],
                                             const uint4* const (&sbase)[RT], int o) {
#pragma unroll
    for (int r = 0; r < RT; r++) {
        const uint4* c = cbase[r] + (size_t)o * 128; // the octet's 4 loads, 512 bytes apart
#pragma unroll
        for (int p = 0; p < 4; p++) q.c[r][p] = ld_codes(c + p * 32);
        const uint4* sc = sbase[r] + (size_t)o * 16;
        q.s[r][0] = __ldg(sc);
        q.s[r][1] = __ldg(sc + 1);
    }
}

// The fragments are written by the launch before: loaded after the wait.
template <int NT, int RT>
__device__ __forceinline__ void load_fragments(Octet<NT, RT>& q, const uint4* __restrict__ frag,
                                               int o, int src) {
    if (NT == 1 && B_AHEAD) {
        const uint4* f = frag + (size_t)o * 256 + src; // the octet's 8 blocks, 512 bytes apart
#pragma unroll
        for (int i = 0; i < 8; i++) q.bf[i] = ld_prior(f + i * 32);
    }
}

template <int NT, int RT>
__device__ __forceinline__ void load_octet(Octet<NT, RT>& q, const uint4* const (&cbase)[RT],
                                           const uint4* const (&sbase)[RT],
                                           const uint4* __restrict__ frag, int o, int src) {
    load_weights<NT, RT>(q, cbase, sbase, o);
    load_fragments<NT, RT>(q, frag, o, src);
}

// One octet's products: per block, the B fragments, then per tile two mma whose sum is
// scaled by the block's scale of each row.
template <int NT, int RT>
__device__ __forceinline__ void mma_octet(float (&acc)[RT][NT][4], const Octet<NT, RT>& q,
                                          const uint4* __restrict__ frag, int o, int kb,
                                          int lane) {
    const uint4* f = frag + (size_t)o * 256 + lane; // block 8o's fragment of n8 tile 0
#pragma unroll
    for (int i = 0; i < 8; i++) { // the octet's blocks
        uint4 bf[NT];
#pragma unroll
        for (int j = 0; j < NT; j++)
            bf[j] = NT == 1 && B_AHEAD ? q.bf[B_AHEAD ? i : 0]
                                       : ld_prior(f + (size_t)j * kb * 32 + i * 32);
#pragma unroll
        for (int r = 0; r < RT; r++) {
            const uint4& cw = q.c[r][i >> 1];
            const u32 w0 = (i & 1) ? cw.z : cw.x, w8 = (i & 1) ? cw.w : cw.y; // rows g, g+8
            const u32 a0 = low_codes(w0), a2 = low_codes(w0 >> 8);
            const u32 a1 = low_codes(w8), a3 = low_codes(w8 >> 8);
            const u32 h0 = high_codes(w0), h2 = high_codes(w0 >> 8);
            const u32 h1 = high_codes(w8), h3 = high_codes(w8 >> 8);
            const u32 dw = word_of(q.s[r][i >> 2], i & 3);
            const float d0 = f16_to_f32((u16)(dw & 0xFFFF)), d8 = f16_to_f32((u16)(dw >> 16));
#pragma unroll
            for (int j = 0; j < NT; j++) {
                float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma(p, a0, a1, a2, a3, bf[j].x, bf[j].y);
                mma(p, h0, h1, h2, h3, bf[j].z, bf[j].w);
                acc[r][j][0] = fmaf(p[0], d0, acc[r][j][0]);
                acc[r][j][1] = fmaf(p[1], d0, acc[r][j][1]);
                acc[r][j][2] = fmaf(p[2], d8, acc[r][j][2]);
                acc[r][j][3] = fmaf(p[3], d8, acc[r][j][3]);
            }
        }
    }
}

// y[r][row] = Σ_e W[row][e] · x[r][e] for the m input rows whose fragments `frag` holds
// (`split` as `q4_0_inputs` wrote them: m ≤ 4·NT, else m ≤ 8·NT). A block of W warps takes
// RT tiles of 16 rows; its warps split the octets (warp w: octets w, w + W, …), the next
// octet's loads in flight while one computes (two register sets, alternated by an unrolled
// pair of steps so that neither is indexed at run time); partial sums meet in shared
// memory. With rope_cols > 0 the output rows below it (whole heads of 2·half) leave RoPE'd
// over adjacent pairs (`rotated`), at the angles of tables `cos` and `sin` (half entries an
// input row): a decoder's q|k needs no launch of its own. Grid: n / (16·RT) blocks of 32·W
// threads.
template <int NT, int RT, int W>
__device__ void q4_0_mma(const uint4* __restrict__ codes, const uint4* __restrict__ scales,
                         const uint4* __restrict__ frag, float* __restrict__ y, int m, int n,
                         int k, int split, const float* __restrict__ cos,
                         const float* __restrict__ sin, int rope_cols, int half) {
    release_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // With one n8 tile, lanes whose column holds no input all read lane 31's zero fragment
    // (column 7 is empty whenever any is), so a load costs the live lanes' bytes and one
    // sector.
    const int src = (lane >> 2) < (split ? 2 * m : m) ? lane : 31;
    const int g = lane >> 2, t = lane & 3;
    const int octets = k >> 8, kb = k >> 5;
    const int tile0 = blockIdx.x * RT;
    const uint4* cbase[RT];
    const uint4* sbase[RT];
#pragma unroll
    for (int r = 0; r < RT; r++) {
        const int tile = min(tile0 + r, n / 16 - 1); // a ragged grid reads its last tile again
        cbase[r] = codes + (size_t)tile * (k >> 6) * 32 + lane;
        sbase[r] = scales + ((size_t)tile * octets * 8 + g) * 2;
    }
    float acc[RT][NT][4];
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[r][j][e] = 0.0f;

    Octet<NT, RT> qa, qb;
    int o = warp;
    // The first octet's weights in flight before the wait; its fragments after.
    if (o < octets) load_weights<NT, RT>(qa, cbase, sbase, o);
    wait_for_prior();
    if (o < octets) load_fragments<NT, RT>(qa, frag, o, src);
    while (o < octets) {
        if (o + W < octets) load_octet<NT, RT>(qb, cbase, sbase, frag, o + W, src);
        mma_octet<NT, RT>(acc, qa, frag, o, kb, lane);
        o += W;
        if (o >= octets) break;
        if (o + W < octets) load_octet<NT, RT>(qa, cbase, sbase, frag, o + W, src);
        mma_octet<NT, RT>(acc, qb, frag, o, kb, lane);
        o += W;
    }
    // C holds columns 8j + 2t, 8j + 2t + 1 of rows g and g + 8; warps meet per column, then a
    // split input row adds its two columns.
    __shared__ float part[W][RT * 16][8 * NT];
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int j = 0; j < NT; j++) {
            part[warp][r * 16 + g][8 * j + 2 * t] = acc[r][j][0];
            part[warp][r * 16 + g][8 * j + 2 * t + 1] = acc[r][j][1];
            part[warp][r * 16 + g + 8][8 * j + 2 * t] = acc[r][j][2];
            part[warp][r * 16 + g + 8][8 * j + 2 * t + 1] = acc[r][j][3];
        }
    __syncthreads();
    const int inputs = split ? 4 * NT : 8 * NT;
    for (int i = threadIdx.x; i < RT * 16 * inputs; i += blockDim.x) {
        const int in = i / (RT * 16), rr = i % (RT * 16); // consecutive threads, consecutive rows
        const int row = tile0 * 16 + rr;
        if (in >= m || row >= n) continue;
        // Output rr's total over the warps, with a split input's two columns added.
        auto total = [&](int r) {
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < W; w++)
                v += split ? part[w][r][2 * in] + part[w][r][2 * in + 1] : part[w][r][in];
            return v;
        };
        float v = total(rr);
        if (row < rope_cols) {
            // Output row `row` of input row `in` is element row % head of a head: its pair's
            // other row is rr ^ 1 (same tile), its angle table entry (row / 2) % half of the
            // input row's. The tables are the step's, written before it (from L2, like any
            // earlier kernel's output).
            const float other = total(rr ^ 1);
            const size_t at = (size_t)in * half + ((row >> 1) % half);
            const bool odd = row & 1;
            v = odd ? rotated(other, v, __ldcg(cos + at), __ldcg(sin + at), true)
                    : rotated(v, other, __ldcg(cos + at), __ldcg(sin + at), false);
        }
        y[(size_t)in * n + row] = v;
    }
}

// Kernels by n8 tiles (4, 8 or 16 input rows), 16-row tiles a block and warps a block
// (weights.rs picks).
#define MMA_KERNEL(NT, RT, W)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * W, MIN_BLOCKS(NT, RT, W))             \
        q4_0_mma_##NT##_##RT##_##W(                                                          \
        const uint4* codes, const uint4* scales, const uint4* frag, float* y, int m, int n,  \
        int k, int split, const float* cos, const float* sin, int rope_cols, int half) {     \
        q4_0_mma<NT, RT, W>(codes, scales, frag, y, m, n, k, split, cos, sin, rope_cols,     \
                            half);                                                           \
    }
#define MMA_KERNELS(RT, W) MMA_KERNEL(1, RT, W) MMA_KERNEL(2, RT, W) MMA_KERNEL(4, RT, W)
MMA_KERNELS(1, 4)
MMA_KERNELS(2, 4)
MMA_KERNELS(1, 8)
MMA_KERNELS(2, 8)

// The mma epilogue's RoPE for outputs the GEMM path made: y (m rows of n), its first
// rope_cols columns of each row rotated in place. One thread a pair.
extern "C" __global__ void rope_pairs(float* __restrict__ y, const float* __restrict__ cos,
                                      const float* __restrict__ sin, int m, int n,
                                      int rope_cols, int half) {
    const int pairs = rope_cols >> 1;
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)m * pairs) return;
    const int in = (int)(i / pairs), p = (int)(i % pairs);
    float* at = y + (size_t)in * n + 2 * p;
    const size_t t = (size_t)in * half + (p % half);
    const float e = at[0], o = at[1], c = cos[t], s = sin[t];
    at[0] = rotated(e, o, c, s, false);
    at[1] = rotated(e, o, c, s, true);
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// W as bf16 (n × k, row-major) for a prefill GEMM: one thread per 16-byte code load of the
// planes (tile T, block pair P, lane): rows g and g + 8 of blocks 2P and 2P + 1, positions
// 4t .. 4t+3 and 16 + 4t .. 16 + 4t + 3 of each. (c − 8) · scale is exact in f32 and rounds
// once to bf16.
extern "C" __global__ void q4_0_to_bf16(const uint4* __restrict__ codes,
                                        const u16* __restrict__ scales, u16* __restrict__ w,
                                        int k, long long loads) {
    const int pairs = k >> 6, octets = k >> 8;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < loads;
         i += (long long)gridDim.x * blockDim.x) {
        const int lane = (int)(i & 31), g = lane >> 2, t = lane & 3;
        const long long tp = i >> 5; // tile · pairs + pair
        const long long tile = tp / pairs;
        const int pair = (int)(tp % pairs);
        const uint4 c = __ldg(codes + i);
#pragma unroll
        for (int e = 0; e < 4; e++) { // [block 2P row g, 2P row g+8, 2P+1 row g, 2P+1 row g+8]
            const int blk = 2 * pair + (e >> 1), dr = (e & 1) * 8;
            const long long row = tile * 16 + g + dr;
            const u16 dh = scales[((tile * octets + (blk >> 3)) * 8 + g) * 16 + 2 * (blk & 7) +
                                  (e & 1)];
            const float d = f16_to_f32(dh);
            const u32 word = word_of(c, e);
            u16* out = w + row * k + blk * 32 + 4 * t;
#pragma unroll
            for (int half = 0; half < 2; half++) { // low nibbles, then high
                u32 lo = 0, hi = 0;
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int code = (word >> (8 * q + 4 * half)) & 15;
                    const u32 v = f32_to_bf16((float)(code - 8) * d);
                    if (q < 2) lo |= v << (16 * q);
                    else hi |= v << (16 * (q - 2));
                }
                *(uint2*)(out + 16 * half) = make_uint2(lo, hi);
            }
        }
    }
}

// A prefill GEMM's bf16 input rows (m × k, row-major) from SOURCE, as the tensor-core
// launches take theirs: rows of x (`ld` floats apart) as they are; RMS-normalized by the
// weights y (of x + add, the sum written to `sum`); or silu(x) · y. One block a row, each
// thread 4 floats at a time; a normed source sums the row's squares first (a second pass
// reads the row again from L1/L2). This replaces the add, norm, activation and f32 → bf16
// launches that fed candle's cast before each GEMM.
#define GEMM_INPUT_THREADS 256
template <int SOURCE>
__device__ __forceinline__ void gemm_inputs(const float* __restrict__ x,
                                            const float* __restrict__ y,
                                            const float* __restrict__ add,
                                            float* __restrict__ sum, u16* __restrict__ out,
                                            int k, int ld, float eps) {
    const size_t r = blockIdx.x;
    const float4* xr = (const float4*)(x + r * ld);
    const float4* ar = (const float4*)(add + r * k);
    const float4* ur = (const float4*)(y + r * ld); // silu's up row
    const float4* wr = (const float4*)y;           // the norm's weights
    const int quads = k >> 2;
    float inv = 1.f;
    if (SOURCE == NORMED || SOURCE == ADD_NORMED) {
        __shared__ float partial[GEMM_INPUT_THREADS / 32];
        float s = 0.f;
        for (int q = threadIdx.x; q < quads; q += blockDim.x) {
            float4 v = __ldg(xr + q);
            if (SOURCE == ADD_NORMED) {
                const float4 a = __ldg(ar + q);
                v = make_float4(v.x + a.x, v.y + a.y, v.z + a.z, v.w + a.w);
                ((float4*)(sum + r * k))[q] = v;
            }
            s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
#pragma unroll
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = s;
        __syncthreads();
        s = 0.f;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += partial[w];
        inv = rsqrtf(s / (float)k + eps);
    }
    for (int q = threadIdx.x; q < quads; q += blockDim.x) {
        float4 v = __ldg(xr + q);
        if (SOURCE == ADD_NORMED) {
            const float4 a = __ldg(ar + q);
            v = make_float4(v.x + a.x, v.y + a.y, v.z + a.z, v.w + a.w);
        }
        float e[4] = {v.x, v.y, v.z, v.w};
        if (SOURCE == NORMED || SOURCE == ADD_NORMED) {
            const float4 g = __ldg(wr + q);
            const float gs[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
            for (int i = 0; i < 4; i++) e[i] = e[i] * inv * gs[i];
        }
        if (SOURCE == SILU_GATED) {
            const float4 u = __ldg(ur + q);
            const float us[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int i = 0; i < 4; i++) e[i] = e[i] / (1.f + expf(-e[i])) * us[i];
        }
        const u32 lo = f32_to_bf16(e[0]) | ((u32)f32_to_bf16(e[1]) << 16);
        const u32 hi = f32_to_bf16(e[2]) | ((u32)f32_to_bf16(e[3]) << 16);
        ((uint2*)(out + r * k))[q] = make_uint2(lo, hi);
    }
}

extern "C" __global__ void __launch_bounds__(GEMM_INPUT_THREADS)
gemm_inputs_plain(const float* __restrict__ x, u16* __restrict__ out, int k, int ld) {
    gemm_inputs<PLAIN>(x, nullptr, nullptr, nullptr, out, k, ld, 0.f);
}

extern "C" __global__ void __launch_bounds__(GEMM_INPUT_THREADS)
gemm_inputs_normed(const float* __restrict__ x, const float* __restrict__ w,
                   u16* __restrict__ out, int k, float eps) {
    gemm_inputs<NORMED>(x, w, nullptr, nullptr, out, k, k, eps);
}

extern "C" __global__ void __launch_bounds__(GEMM_INPUT_THREADS)
gemm_inputs_add_normed(const float* __restrict__ x, const float* __restrict__ add,
                       float* __restrict__ sum, const float* __restrict__ w,
                       u16* __restrict__ out, int k, float eps) {
    gemm_inputs<ADD_NORMED>(x, w, add, sum, out, k, k, eps);
}

extern "C" __global__ void __launch_bounds__(GEMM_INPUT_THREADS)
gemm_inputs_silu_gated(const float* __restrict__ gate, const float* __restrict__ up,
                       u16* __restrict__ out, int k, int ld) {
    gemm_inputs<SILU_GATED>(gate, up, nullptr, nullptr, out, k, ld, 0.f);
}
