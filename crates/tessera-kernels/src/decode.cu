// Fused KV decode read: one query row per sequence, all G query heads of a KV head
// folded onto one pass over that head's stored rows, the sequence split across blocks
// (flash-decoding), partial softmax states merged by a second kernel.
//
// Compiled at run time (NVRTC) once per configuration, set by the host as #defines:
//   CODEC  0 = bf16 rows, 4 / 8 = affine codes (u32 words, element i at bit i*CODEC of
//          the row) with an f16 (scale, bias) pair per GROUP elements: x = scale*c + bias;
//          1 = TurboQuant rows (KBITS / VBITS-bit codes, element i at bit i*BITS, and one
//          word per row holding its f16 norm): x = norm * level[c], in the rotated space
//   D      head dim (64, 128 or 256); G query heads per KV head; GROUP affine group size
// No CUDA headers: bf16 and f16 are widened by hand, so NVRTC needs no include path.

typedef unsigned int u32;
typedef unsigned short u16;

#define LPR (D / 8)        // lanes per row: each lane holds 8 consecutive elements
#define RPW (32 / LPR)     // rows a warp reads per step
#define WARPS 4
// Warp steps per tile: their loads are all issued before any is used, and the softmax
// state is rescaled once per tile rather than once per row.
#define UNROLL (G > 4 ? 2 : 4)
#define NEG_BIG (-1.0e30f) // "no score yet": finite, so merging two empty states is no NaN

// The spans of up to SPAN_ROWS rows, passed by value: a read copies nothing from the host
// (a pageable copy per read cost an allocation, a copy and its tracking on every layer).
// With `live` set (a decode step captured in a graph), the spans are instead in device
// memory: the chunk, then (start, write slot) per row of the whole batch; the row reads
// [start, slot + 1), and the merge advances the slot (kv_decode_merge).
#define SPAN_ROWS 256
struct Spans {
    int row0;
    int nq; // launch rows per stored row: a chunk's queries read as decode rows (1: decode)
    int start[SPAN_ROWS];
    int end[SPAN_ROWS];
    int* live;
};

// Slot of position-space index p of a span: a span may run past the planes' end and on
// from slot 0 (a wrapped ring read in position order, deterministic mode).
__device__ __forceinline__ int slot_at(int p, int capacity) { return p < capacity ? p : p - capacity; }

// Positions [lo, hi) that split `split` of launch row z reads. Called after the wait for the
// launch before (a live span is written by the previous step's merge).
__device__ __forceinline__ void split_range(const Spans& spans, int z, int split, int splits,
                                            int chunk, int& lo, int& hi) {
    int start = spans.start[z], end = spans.end[z];
    if (spans.live) {
        const int b = spans.row0 + z;
        chunk = __ldcg(spans.live);
        start = __ldcg(spans.live + 1 + 2 * b);
        end = __ldcg(spans.live + 2 + 2 * b) + 1;
    }
    lo = start + split * chunk;
    hi = min(end, lo + chunk);
}

__device__ __forceinline__ float f16_to_f32(u32 h) {
    float f;
    unsigned short x = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

// Programmatic dependent launch (dependent.rs): the decode step's launches may start while
// the kernel before them finishes; each waits for it before touching anything (release
// first, so that the next kernel can be scheduled as early). No-ops for a plain launch.
__device__ __forceinline__ void release_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ void wait_for_prior() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

// 2^x by the special-function unit (-inf gives 0).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The raw bytes of 8 elements [e0, e0 + 8) of stored row `row` of plane P (0 keys,
// 1 values: only turbo rows differ between them).
struct Raw {
#if CODEC == 0
    uint4 w;
#elif CODEC == 1
    unsigned long long w;
    float n;
#elif CODEC == 4
    u32 w;
    u32 p;
#else
    uint2 w;
    u32 p;
#endif
};

#if CODEC == 1
// Each plane's codebook, copied into shared memory by every block that reads turbo rows.
__shared__ float turbo_levels[2][256];
#define PLANE_BITS(P) ((P) == 0 ? KBITS : VBITS)
#endif

template <int P>
__device__ __forceinline__ Raw load_raw(const u32* __restrict__ data,
                                        const u32* __restrict__ params, long row, int e0) {
    Raw r;
#if CODEC == 0
    r.w = __ldg((const uint4*)(data + row * (D / 2) + e0 / 2));
#elif CODEC == 1
    // A lane's 8 codes are BITS whole bytes at byte BITS * e0 / 8 of the row.
    constexpr int BITS = PLANE_BITS(P);
    const unsigned char* bytes =
        (const unsigned char*)(data + row * (D * BITS / 32)) + e0 / 8 * BITS;
    if (BITS == 2) {
        r.w = __ldg((const u16*)bytes);
    } else if (BITS == 4) {
        r.w = __ldg((const u32*)bytes);
    } else if (BITS == 8) {
        const uint2 t = __ldg((const uint2*)bytes);
        r.w = t.x | ((unsigned long long)t.y << 32);
    } else {
        r.w = 0;
#pragma unroll
        for (int i = 0; i < BITS; i++) r.w |= (unsigned long long)__ldg(bytes + i) << (8 * i);
    }
    r.n = f16_to_f32(__ldg(params + row) & 0xffff);
#elif CODEC == 4
    r.w = __ldg(data + row * (D / 8) + e0 / 8);
    r.p = __ldg(params + row * (D / GROUP) + e0 / GROUP);
#else
    r.w = __ldg((const uint2*)(data + row * (D / 4) + e0 / 4));
    r.p = __ldg(params + row * (D / GROUP) + e0 / GROUP);
#endif
    return r;
}

template <int P>
__device__ __forceinline__ void widen(const Raw& r, float x[8]) {
#if CODEC == 0
    const u32 w[4] = {r.w.x, r.w.y, r.w.z, r.w.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        x[2 * j] = __uint_as_float(w[j] << 16);
        x[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
#elif CODEC == 1
    constexpr int BITS = PLANE_BITS(P);
#pragma unroll
    for (int i = 0; i < 8; i++)
        x[i] = r.n * turbo_levels[P][(u32)(r.w >> (BITS * i)) & ((1u << BITS) - 1)];
#else
    const float scale = f16_to_f32(r.p & 0xffff), bias = f16_to_f32(r.p >> 16);
    // Codes become floats through the exponent of 2^23 (or-ing a code into the mantissa
    // of 8388608.0, then subtracting it): two plain ALU ops instead of a slow I2F.
#if CODEC == 4
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float c = __uint_as_float(0x4B000000u | ((r.w >> (4 * i)) & 15u)) - 8388608.f;
        x[i] = fmaf(scale, c, bias);
    }
#else
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float c0 = __uint_as_float(0x4B000000u | ((r.w.x >> (8 * i)) & 255u)) - 8388608.f;
        const float c1 = __uint_as_float(0x4B000000u | ((r.w.y >> (8 * i)) & 255u)) - 8388608.f;
        x[i] = fmaf(scale, c0, bias);
        x[4 + i] = fmaf(scale, c1, bias);
    }
#endif
#endif
}

// Folds softmax state (mo, lo, ao) into (m, l, a). Scores are in log2 units.
__device__ __forceinline__ void merge_state(float& m, float& l, float a[8], float mo, float lo,
                                            const float ao[8]) {
    const float mn = fmaxf(m, mo);
    const float c = fast_exp2(m - mn), co = fast_exp2(mo - mn);
    l = l * c + lo * co;
#pragma unroll
    for (int i = 0; i < 8; i++) a[i] = a[i] * c + ao[i] * co;
    m = mn;
}

// Folds the block's WARPS softmax states of column g, element e (ml[w][g] = running max
// and sum, acc[w][g][e] unnormalised output) into one: (mx, sum, a).
template <int H>
__device__ __forceinline__ void merge_warps(const float (&ml)[WARPS][H][2],
                                            const float (&acc)[WARPS][H][D], int g, int e,
                                            float& mx, float& sum, float& a) {
    mx = NEG_BIG;
#pragma unroll
    for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, ml[w][g][0]);
    sum = 0.f;
    a = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; w++) {
        const float c = fast_exp2(ml[w][g][0] - mx);
        sum += ml[w][g][1] * c;
        a += acc[w][g][e] * c;
    }
}

// After a __syncthreads: folds the block's WARPS softmax states per query head (H ≥ G
// heads held) and writes this split's partials.
template <int H>
__device__ __forceinline__ void store_partials(const float (&ml)[WARPS][H][2],
                                               const float (&acc)[WARPS][H][D], int b, int h,
                                               int kv_heads, int split, int splits,
                                               float* __restrict__ part_ml,
                                               float* __restrict__ part_acc) {
    const int qh = kv_heads * G;
    for (int idx = threadIdx.x; idx < G * D; idx += WARPS * 32) {
        const int g = idx / D, e = idx % D;
        float mx, sum, a;
        merge_warps(ml, acc, g, e, mx, sum, a);
        const long at = ((long)b * qh + h * G + g) * splits + split;
        part_acc[at * D + e] = a;
        if (e == 0) {
            part_ml[at * 2] = mx;
            part_ml[at * 2 + 1] = sum;
        }
    }
}

// grid (splits, kv_heads, rows of this launch), 128 threads. Row b = spans.row0 + z
// attends its stored positions [spans.start[z], spans.end[z]); split s takes `chunk` of
// them. Queries, laid out (batch, kv_heads * G, D), are multiplied by qscale (the softmax
// scale times log2(e): scores in log2 units, so exp2 is one instruction). Writes per
// (b, query head, split) the running max and sum (part_ml) and the unnormalised output
// (part_acc).
extern "C" __global__ void __launch_bounds__(WARPS * 32)
kv_decode_partial(const float* __restrict__ q, float qscale, const u32* __restrict__ kdata,
                  const u32* __restrict__ kparams, const u32* __restrict__ vdata,
                  const u32* __restrict__ vparams, const Spans spans, int kv_heads,
                  int capacity, int chunk, float* __restrict__ part_ml,
                  float* __restrict__ part_acc
#if CODEC == 1
                  , const float* __restrict__ levels // (2, 256): keys', values'
#endif
                  ) {
    release_dependents();
    wait_for_prior();
    // b: the launch row (its query, partials and output); its stored row b / nq.
    const int split = blockIdx.x, h = blockIdx.y, b = spans.row0 + blockIdx.z;
#if CODEC == 1
    for (int i = threadIdx.x; i < 2 * 256; i += WARPS * 32) turbo_levels[i / 256][i % 256] = levels[i];
    __syncthreads();
#endif
    const int splits = gridDim.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int sub = lane / LPR, e0 = (lane % LPR) * 8;
    const long block_rows = ((long)(b / spans.nq) * kv_heads + h) * capacity;
    int lo, hi;
    split_range(spans, blockIdx.z, split, splits, chunk, lo, hi);

    float qr[G][8], m[G], l[G], acc[G][8];
#pragma unroll
    for (int g = 0; g < G; g++) {
        const float* qg = q + (((long)b * kv_heads + h) * G + g) * D + e0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            qr[g][i] = qg[i] * qscale; // scores in log2 units: exp2 is one instruction
            acc[g][i] = 0.f;
        }
        m[g] = NEG_BIG;
        l[g] = 0.f;
    }

    const int step = WARPS * RPW;
    for (int base = lo + warp * RPW; base < hi; base += UNROLL * step) {
        Raw kr[UNROLL], vr[UNROLL];
        bool valid[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int pos = base + u * step + sub;
            valid[u] = pos < hi;
            const long row = block_rows + slot_at(valid[u] ? pos : lo, capacity);
            kr[u] = load_raw<0>(kdata, kparams, row, e0);
            vr[u] = load_raw<1>(vdata, vparams, row, e0);
        }
        float s[UNROLL][G];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            float k[8];
            widen<0>(kr[u], k);
#pragma unroll
            for (int g = 0; g < G; g++) {
                float t = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) t = fmaf(qr[g][i], k[i], t);
                s[u][g] = t;
            }
        }
        // Sum each row's score over its LPR lanes (xor offsets stay inside the row).
#pragma unroll
        for (int off = LPR / 2; off > 0; off >>= 1) {
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
#pragma unroll
                for (int g = 0; g < G; g++) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], off);
            }
        }
        // One rescale per tile: the new max over the tile's valid rows first.
        float c[G];
#pragma unroll
        for (int g = 0; g < G; g++) {
            float mn = m[g];
#pragma unroll
            for (int u = 0; u < UNROLL; u++) mn = valid[u] ? fmaxf(mn, s[u][g]) : mn;
            c[g] = fast_exp2(m[g] - mn);
            m[g] = mn;
            l[g] *= c[g];
#pragma unroll
            for (int i = 0; i < 8; i++) acc[g][i] *= c[g];
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (!valid[u]) continue;
            float v[8];
            widen<1>(vr[u], v);
#pragma unroll
            for (int g = 0; g < G; g++) {
                const float p = fast_exp2(s[u][g] - m[g]);
                l[g] += p;
#pragma unroll
                for (int i = 0; i < 8; i++) acc[g][i] = fmaf(p, v[i], acc[g][i]);
            }
        }
    }

    // Row slots of a warp hold the same elements of different rows: merge them.
#pragma unroll
    for (int off = LPR; off < 32; off <<= 1) {
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
            const float lo_ = __shfl_xor_sync(0xffffffffu, l[g], off);
            float ao[8];
#pragma unroll
            for (int i = 0; i < 8; i++) ao[i] = __shfl_xor_sync(0xffffffffu, acc[g][i], off);
            merge_state(m[g], l[g], acc[g], mo, lo_, ao);
        }
    }

    // Then the warps, through shared memory.
    __shared__ float sm_ml[WARPS][G][2];
    __shared__ float sm_acc[WARPS][G][D];
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < G; g++) {
#pragma unroll
            for (int i = 0; i < 8; i++) sm_acc[warp][g][e0 + i] = acc[g][i];
            if (e0 == 0) {
                sm_ml[warp][g][0] = m[g];
                sm_ml[warp][g][1] = l[g];
            }
        }
    }
    __syncthreads();
    store_partials(sm_ml, sm_acc, b, h, kv_heads, split, splits, part_ml, part_acc);
}

#if CODEC == 0 || CODEC == 4 || CODEC == 8 || (CODEC == 1 && KBITS == 4 && VBITS == 4)
// ---------------------------------------------------------------------------------------
// Tensor-core version of kv_decode_partial (same grid, same partials) for bf16 rows,
// 4- and 8-bit affine rows and 4-bit turbo rows (whose code bytes become f16 level pairs
// through a 256-entry table per plane in shared memory, times the row's norm). Per warp, tiles of 16 stored rows; mma.m16n8k16 with f32 accumulate
// (bf16 operands for bf16 rows; f16 for affine, whose codes become f16 exactly through
// the 1024 exponent and are scaled with one f16x2 fma), the G query heads as the M rows
// (padded to 16).
// Scores S = Q·Kᵀ: B = Kᵀ, whose k index (the head dim) may be permuted as long as Q's
// is permuted alike: lane (gid, tq) feeds, for k-step j, four of the elements
// D/4·tq .. D/4·(tq+1) of key row gid (contiguous per lane: 16-byte loads, one affine
// group). The C fragment of S (head gid, rows 2tq, 2tq+1 of each n8 block) is then the A
// fragment of P for P·V as it stands. Values: B = V (k = 16 rows × n8 dims); output dim
// n of block nd is element gid·D/8 + nd, so lane gid reads D/8 contiguous elements of
// rows 2tq, 2tq+1, 2tq+8, 2tq+9 and pairs rows with one byte permute.
#define DQ (D / 4)
#define DV (D / 8)
#define CBITS (CODEC == 1 ? 4 : CODEC) // bits of a code (0: bf16 rows)

#if CODEC == 0
#define MMA_TYPE "bf16"
#define KWORDS (DQ / 2) // u32 words of a lane's part of a key row
#define VWORDS (DV / 2)
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#else
#define MMA_TYPE "f16"
#define KWORDS (DQ * CBITS / 32)
#define VWORDS ((DV * CBITS + 31) / 32)
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#define MAGIC 0x64006400u // 1024.0 in both f16 halves: 1024 + c (c < 1024) is exact
// `c` holds 1024 + code in each f16 half: the codes times the pair's scales plus biases.
__device__ __forceinline__ u32 scale_pair(u32 c, u32 scale2, u32 bias2) {
    u32 r;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(c) : "r"(c), "r"(MAGIC));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(c), "r"(scale2), "r"(bias2));
    return r;
}
// Two f16 products at once.
__device__ __forceinline__ u32 mul_pair(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
// The codes at bits 0.. and 16.. of x (one per f16 half), as 1024 + code.
__device__ __forceinline__ u32 low_codes(u32 x) {
    return (x & (CODEC == 4 ? 0x000F000Fu : 0x00FF00FFu)) | MAGIC;
}
#endif

// c[0..1] += A·B for the m16n8k16 tile whose A rows 8..15 are zero (only c0, c1 kept).
__device__ __forceinline__ void mma_top(float& c0, float& c1, u32 a0, u32 a2, u32 b0, u32 b1) {
    float d2, d3; // rows 8..15 of the product: zero, unused
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
        : "=f"(c0), "=f"(c1), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(0.f),
          "f"(0.f));
}

// The whole m16n8k16 tile: rows 8..15 of A carry the low halves of split operands.
__device__ __forceinline__ void mma_full(float& c0, float& c1, float& c2, float& c3, u32 a0,
                                         u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
        : "=f"(c0), "=f"(c1), "=f"(c2), "=f"(c3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(c2),
          "f"(c3));
}

// bf16 operands keep 8 bits: a bf16 read splits Q and P into a high and a low bf16 part
// (x − hi), the low one in A rows 8..15, which are otherwise zero (G ≤ 8 heads), and adds
// the two row blocks of the product, so q and p enter at ~16 bits for no extra mma. f16
// operands (affine) keep 11 bits, enough: they skip it.
#define SPLIT_OPERANDS (CODEC == 0)
#if SPLIT_OPERANDS
// x − (the bf16 pair `hi` packs), as a bf16 pair.
__device__ __forceinline__ u32 residual2(float lo, float hi, u32 packed) {
    return pack2(lo - __uint_as_float(packed << 16), hi - __uint_as_float(packed & 0xffff0000u));
}
#endif

// Lane-local element order of k-step j: the A fragment's (reg0, reg2) hold q at these
// offsets into the lane's DQ elements, matching what key_frag feeds.
__device__ __forceinline__ void k_offsets(int j, int o[4]) {
#if CODEC != 4
    // bf16: words 2j, 2j+1 hold elements 4j .. 4j+3; 8-bit: word j does.
    o[0] = 4 * j; o[1] = 4 * j + 1; o[2] = 4 * j + 2; o[3] = 4 * j + 3;
#else
    // Word j/2 holds elements 8(j/2) .. +7; a shift by s pairs elements s/4 and s/4 + 4.
    const int w = 8 * (j / 2), s = 2 * (j % 2);
    o[0] = w + s; o[1] = w + s + 4; o[2] = w + s + 1; o[3] = w + s + 5;
#endif
}

// u32 words of a stored row: bf16 pairs, or codes of CBITS bits.
#define ROW_WORDS (CODEC == 0 ? D / 2 : D * CBITS / 32)
// The parameter word of element e of stored row `at`: its group's (scale, bias), or a
// turbo row's norm.
#define PARAM_AT(at, e) (CODEC == 1 ? (at) : (at) * (D / GROUP) + (e) / GROUP)

// N consecutive words from `src` (aligned to the widest load N allows) into registers.
template <int N>
__device__ __forceinline__ void load_words(u32 (&dst)[N], const u32* __restrict__ src) {
    if (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 4) {
            const uint4 w = __ldg((const uint4*)(src + i));
            dst[i] = w.x; dst[(i + 1) % N] = w.y; dst[(i + 2) % N] = w.z; dst[(i + 3) % N] = w.w;
        }
    } else if (N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 2) {
            const uint2 w = __ldg((const uint2*)(src + i));
            dst[i] = w.x; dst[(i + 1) % N] = w.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; i++) dst[i] = __ldg(src + i);
    }
}

// What one lane reads of a tile of 16 rows starting at r0.
struct Tile {
    u32 kw[2][KWORDS];
    u32 vw[4][VWORDS];
#if CODEC != 0
    u32 kp[2], vp[4];
#endif
};

__device__ __forceinline__ void load_tile(Tile& t, const u32* __restrict__ kdata,
                                          const u32* __restrict__ kparams,
                                          const u32* __restrict__ vdata,
                                          const u32* __restrict__ vparams, long block_rows,
                                          int r0, int lo, int hi, int gid, int tq) {
    // Loads first: key rows gid and 8 + gid (DQ elements each), value rows 2tq, 2tq+1,
    // 2tq+8, 2tq+9 (DV elements each); rows past the split read row `lo` instead.
#pragma unroll
    for (int nb = 0; nb < 2; nb++) {
        const int row = r0 + 8 * nb + gid;
        const long at = block_rows + (row < hi ? row : lo);
        load_words(t.kw[nb], kdata + at * ROW_WORDS + KWORDS * tq);
#if CODEC != 0
        t.kp[nb] = __ldg(kparams + PARAM_AT(at, DQ * tq));
#endif
    }
    const int vrow[4] = {r0 + 2 * tq, r0 + 2 * tq + 1, r0 + 2 * tq + 8, r0 + 2 * tq + 9};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const long at = block_rows + (vrow[i] < hi ? vrow[i] : lo);
        load_words(t.vw[i], vdata + at * ROW_WORDS + VWORDS * gid);
#if CODEC != 0
        t.vp[i] = __ldg(vparams + PARAM_AT(at, DV * gid));
#endif
    }
}

// The host plans one wave of as many blocks as the driver says fit per SM (3 for affine
// rows of 128 at 146 registers; holding it to 4 blocks spilled and ran 1.2x slower).
extern "C" __global__ void __launch_bounds__(WARPS * 32)
kv_decode_partial_tc(const float* __restrict__ q, float qscale,
                     const u32* __restrict__ kdata,
                     const u32* __restrict__ kparams, const u32* __restrict__ vdata,
                     const u32* __restrict__ vparams, const Spans spans, int kv_heads,
                     int capacity, int chunk,
                     float* __restrict__ part_ml, float* __restrict__ part_acc
#if CODEC == 1
                     , const float* __restrict__ levels // (2, 256): keys', values'
#endif
                     ) {
    release_dependents();
    wait_for_prior();
    const int split = blockIdx.x, h = blockIdx.y, b = spans.row0 + blockIdx.z;
    const int splits = gridDim.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane >> 2, tq = lane & 3;
#if CODEC == 1
    // Per plane and code byte (elements 2i, 2i + 1 in its low and high nibble): the two
    // levels as an f16 pair.
    __shared__ u32 level_pairs[2][256];
    for (int i = threadIdx.x; i < 2 * 256; i += WARPS * 32) {
        const float* book = levels + (i / 256) * 256;
        level_pairs[i / 256][i % 256] = pack2(book[i & 15], book[(i >> 4) & 15]);
    }
    __syncthreads();
#endif
    const long block_rows = ((long)b * kv_heads + h) * capacity;
    int lo, hi;
    split_range(spans, blockIdx.z, split, splits, chunk, lo, hi);

    // Q as A fragments (rows = heads), log2(e) folded in, heads past G zero.
    u32 qa[D / 16][2];
#if SPLIT_OPERANDS
    u32 qr[D / 16][2]; // the residuals
#endif
    {
        const bool real = gid < G;
        const float* qg = q + (((long)b * kv_heads + h) * G + (real ? gid : 0)) * D + DQ * tq;
#pragma unroll
        for (int j = 0; j < D / 16; j++) {
            int o[4];
            k_offsets(j, o);
            float x[4];
#pragma unroll
            for (int i = 0; i < 4; i++) x[i] = real ? qg[o[i]] * qscale : 0.f;
            qa[j][0] = pack2(x[0], x[1]);
            qa[j][1] = pack2(x[2], x[3]);
#if SPLIT_OPERANDS
            qr[j][0] = residual2(x[0], x[1], qa[j][0]);
            qr[j][1] = residual2(x[2], x[3], qa[j][1]);
#endif
        }
    }
    float m = NEG_BIG, l = 0.f;
    float acc[DV][2];
#pragma unroll
    for (int n = 0; n < DV; n++) acc[n][0] = acc[n][1] = 0.f;

    // Software pipelined: the next tile's loads are in flight while this one computes.
#ifndef TC_PREFETCH
#define TC_PREFETCH 1
#endif
    Tile cur, next;
    int r0 = lo + warp * 16;
    if (TC_PREFETCH && r0 < hi)
        load_tile(cur, kdata, kparams, vdata, vparams, block_rows, r0, lo, hi, gid, tq);
    for (; r0 < hi; r0 += WARPS * 16) {
        if (!TC_PREFETCH)
            load_tile(cur, kdata, kparams, vdata, vparams, block_rows, r0, lo, hi, gid, tq);
        else if (r0 + WARPS * 16 < hi)
            load_tile(next, kdata, kparams, vdata, vparams, block_rows, r0 + WARPS * 16, lo, hi,
                      gid, tq);
        const u32(&kw)[2][KWORDS] = cur.kw;
        const u32(&vw)[4][VWORDS] = cur.vw;
#if CODEC != 0
        const u32(&kp)[2] = cur.kp;
        const u32(&vp)[4] = cur.vp;
#endif
        // Scores: s[nb][0..1] for rows r0 + 8nb + 2tq, + 1.
        float s[2][2];
#pragma unroll
        for (int nb = 0; nb < 2; nb++) {
            s[nb][0] = s[nb][1] = 0.f;
#if SPLIT_OPERANDS
            float sr0 = 0.f, sr1 = 0.f;
#endif
#if CODEC != 0
            const u32 scale2 = __byte_perm(kp[nb], kp[nb], 0x1010);
            const u32 bias2 = __byte_perm(kp[nb], kp[nb], 0x3232);
#endif
#pragma unroll
            for (int j = 0; j < D / 16; j++) {
#if CODEC == 0
                const u32 b0 = kw[nb][2 * j], b1 = kw[nb][2 * j + 1];
#elif CODEC == 4
                const u32 w = kw[nb][j / 2], sh = 8 * (j % 2);
                const u32 b0 = scale_pair(low_codes(w >> sh), scale2, bias2);
                const u32 b1 = scale_pair(low_codes(w >> (sh + 4)), scale2, bias2);
#elif CODEC == 1
                // Elements 4j .. 4j + 3: bytes 2j, 2j + 1 of the lane's codes (scale2: the
                // row's norm in both halves).
                const u32 w = kw[nb][j / 2], sh = 16 * (j % 2);
                const u32 b0 = mul_pair(level_pairs[0][(w >> sh) & 255], scale2);
                const u32 b1 = mul_pair(level_pairs[0][(w >> (sh + 8)) & 255], scale2);
#else
                // Bytes 0,1 and 2,3 of word j, each under a 0x64 high byte: 1024 + code.
                const u32 w = kw[nb][j];
                const u32 b0 = scale_pair(__byte_perm(w, 0x64646464u, 0x4140), scale2, bias2);
                const u32 b1 = scale_pair(__byte_perm(w, 0x64646464u, 0x4342), scale2, bias2);
#endif
#if SPLIT_OPERANDS
                mma_full(s[nb][0], s[nb][1], sr0, sr1, qa[j][0], qr[j][0], qa[j][1], qr[j][1], b0,
                         b1);
#else
                mma_top(s[nb][0], s[nb][1], qa[j][0], qa[j][1], b0, b1);
#endif
            }
#if SPLIT_OPERANDS
            s[nb][0] += sr0;
            s[nb][1] += sr1;
#endif
        }
        // Online softmax over the tile (the 4 lanes of a group hold one head's 16 rows).
        float mx = NEG_BIG;
#pragma unroll
        for (int nb = 0; nb < 2; nb++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                // -inf for rows past the split (NVRTC has no math.h for INFINITY).
                if (r0 + 8 * nb + 2 * tq + c >= hi) s[nb][c] = __int_as_float(0xff800000);
                mx = fmaxf(mx, s[nb][c]);
            }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m, mx), corr = fast_exp2(m - mn);
        m = mn;
        float p[2][2];
#pragma unroll
        for (int nb = 0; nb < 2; nb++)
#pragma unroll
            for (int c = 0; c < 2; c++) p[nb][c] = fast_exp2(s[nb][c] - mn);
        l = l * corr + p[0][0] + p[0][1] + p[1][0] + p[1][1];
        const u32 pa0 = pack2(p[0][0], p[0][1]), pa2 = pack2(p[1][0], p[1][1]);
#if SPLIT_OPERANDS
        const u32 pr0 = residual2(p[0][0], p[0][1], pa0), pr2 = residual2(p[1][0], p[1][1], pa2);
#endif
        // Once the running max settles, tiles leave it unchanged: skip the rescale then.
        const bool rescale = __any_sync(0xffffffffu, corr != 1.f);
#if CODEC != 0
        const u32 vs01 = __byte_perm(vp[0], vp[1], 0x5410), vb01 = __byte_perm(vp[0], vp[1], 0x7632);
        const u32 vs23 = __byte_perm(vp[2], vp[3], 0x5410), vb23 = __byte_perm(vp[2], vp[3], 0x7632);
#endif
        // Values: block nd's column gid is element gid·DV + nd of each row.
#pragma unroll
        for (int nd = 0; nd < DV; nd++) {
#if CODEC == 0
            const u32 sel = (nd & 1) ? 0x7632u : 0x5410u;
            const int w = nd / 2;
            const u32 b0 = __byte_perm(vw[0][w], vw[1][w], sel);
            const u32 b1 = __byte_perm(vw[2][w], vw[3][w], sel);
#elif CODEC == 4
            // Byte nd%8/2 of each row's word into bytes 0 and 2, then the nibble down.
            const int w = nd / 8, byte = (nd % 8) / 2, sh = 4 * (nd % 2);
            const u32 x01 = __byte_perm(vw[0][w], vw[1][w], byte | ((4 + byte) << 8));
            const u32 x23 = __byte_perm(vw[2][w], vw[3][w], byte | ((4 + byte) << 8));
            const u32 b0 = scale_pair(low_codes(x01 >> sh), vs01, vb01);
            const u32 b1 = scale_pair(low_codes(x23 >> sh), vs23, vb23);
#elif CODEC == 1
            // Element gid·DV + nd of each row is in byte (nd % 8) / 2 of word nd / 8: its
            // level pair, the even or odd level of each of two rows, times their norms.
            const int w = nd / 8, sh = 8 * ((nd % 8) / 2);
            const u32 sel = (nd & 1) ? 0x7632u : 0x5410u;
            u32 lv[4];
#pragma unroll
            for (int i = 0; i < 4; i++) lv[i] = level_pairs[1][(vw[i][w] >> sh) & 255];
            const u32 b0 = mul_pair(__byte_perm(lv[0], lv[1], sel), vs01);
            const u32 b1 = mul_pair(__byte_perm(lv[2], lv[3], sel), vs23);
#else
            // Byte nd%4 of each row's word into bytes 0 and 2.
            const int w = nd / 4, byte = nd % 4;
            const u32 x01 = __byte_perm(vw[0][w], vw[1][w], byte | ((4 + byte) << 8));
            const u32 x23 = __byte_perm(vw[2][w], vw[3][w], byte | ((4 + byte) << 8));
            const u32 b0 = scale_pair(low_codes(x01), vs01, vb01);
            const u32 b1 = scale_pair(low_codes(x23), vs23, vb23);
#endif
            if (rescale) {
                acc[nd][0] *= corr;
                acc[nd][1] *= corr;
            }
#if SPLIT_OPERANDS
            float e0 = 0.f, e1 = 0.f;
            mma_full(acc[nd][0], acc[nd][1], e0, e1, pa0, pr0, pa2, pr2, b0, b1);
            acc[nd][0] += e0;
            acc[nd][1] += e1;
#else
            mma_top(acc[nd][0], acc[nd][1], pa0, pa2, b0, b1);
#endif
        }
        if (TC_PREFETCH) cur = next;
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);

    // acc[nd][c] is head gid's output element (2tq + c)·DV + nd. Merge the warps.
    __shared__ float sm_ml[WARPS][8][2];
    __shared__ float sm_acc[WARPS][8][D];
#pragma unroll
    for (int nd = 0; nd < DV; nd++) {
        sm_acc[warp][gid][(2 * tq) * DV + nd] = acc[nd][0];
        sm_acc[warp][gid][(2 * tq + 1) * DV + nd] = acc[nd][1];
    }
    if (tq == 0) {
        sm_ml[warp][gid][0] = m;
        sm_ml[warp][gid][1] = l;
    }
    __syncthreads();
    store_partials(sm_ml, sm_acc, b, h, kv_heads, split, splits, part_ml, part_acc);
}
#endif

#if ((CODEC == 4 || CODEC == 8) && (GROUP * CODEC / 8) % 32 == 0 && GROUP <= D) ||         \
    CODEC == 0
#if D <= 128
// ---------------------------------------------------------------------------------------
// The folded read (affine rows): the affine transform taken out of the unpack, and the
// products transposed so every mma is whole.
// - Folded: the tensor cores multiply raw codes; each row's (scale, bias) is applied per
//   group outside the mma:
//     scores  q·k = Σ_group scale·(q·c) + bias·Σq   (one accumulator per group),
//     values  p·v = Σ_row (p·scale)·c + Σ_row p·bias (the bias sum kept per lane and head).
//   A code then needs only a mask: under a zero exponent a 4- or 8-bit code c at the
//   bottom of an f16 half is the subnormal c·2^-24 (the unit); a nibble at bits 4..7 is
//   16 units, which the matching q elements (keys) or output dims (values) undo.
//   DENORMAL_CODES 0 puts the codes under the exponent of 1024 instead and subtracts it
//   (one more instruction each), should subnormal operands ever misbehave.
// - Transposed: stored rows (and, for P·V, head dims) are the mma's M = 16 and the query
//   heads its N = 8, so one m16n8k16 covers a tile of 16 rows. (With heads as M, G ≤ 8
//   of 16 rows were used: twice the mma count, and the unused half's zero accumulators
//   re-materialized before each one; measured 1.3x slower.)
//     Sᵀ = K·Qᵀ: A = key codes (rows gid, gid+8; k = head dims), B = Qᵀ, C = rows × heads
//       (gid | gid+8, 2tq + c).
//     outᵀ = Vᵀ·(P∘scale)ᵀ: A = value codes (M = 16 head dims, k = 16 rows), B = the
//       tile's scaled P, moved from C's rows × heads layout to B's by one movmatrix.trans
//       per 8×8 half.
// Lane layout: within every group, key lane tq holds GROUP/4 contiguous elements (a k-step
// never leaves a group, so its accumulator has one scale per row); value lane gid holds
// BPG = GROUP/8 contiguous codes of each group, and value block (group gr, jb) takes dims
// gr·GROUP + gid·BPG + 2jb (m = gid) and the next one (m = gid + 8): one byte per row pair.
// bf16 rows (used for chunk reads) take the same layout as one group of D 16-bit "codes"
// with no parameters: bf16 operands, q and P each split into two bf16 parts (≈ 16 bits,
// as the tensor-core decode read does), values paired across rows by byte permutes.
#define FGROUP (CODEC == 0 ? D : GROUP)
#define EBITS (CODEC == 0 ? 16 : CODEC)
#define NG (D / FGROUP)
#define KE (FGROUP / 4)
#define KGW (KE * EBITS / 32)
#define BPG (FGROUP / 8)
#define VGW (BPG * EBITS / 32)
#define GROUP_WORDS (FGROUP * EBITS / 32)
#ifndef DENORMAL_CODES
#define DENORMAL_CODES 1
#endif
#if DENORMAL_CODES && CODEC != 0
#define UNIT_INV 16777216.f // 2^24
#else
#define UNIT_INV 1.f
#endif
// Blocks per SM the registers are held to: 4 for 4-bit rows (128 registers; 1.07x faster
// than 3 at 142); 8-bit tiles spill at 4 and ran 1.5x slower than at 2.
#ifndef FOLD_MIN_BLOCKS
#define FOLD_MIN_BLOCKS (CODEC == 4 ? 4 : 2)
#endif

// Codes under `mask` (one per f16 half) as f16 values c (times the unit).
__device__ __forceinline__ u32 code_pair(u32 x, u32 mask) {
#if DENORMAL_CODES
    return x & mask;
#else
    u32 r = (x & mask) | MAGIC;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(MAGIC));
    return r;
#endif
}

__device__ __forceinline__ float lo_f16(u32 x) { return f16_to_f32(x & 0xffff); }
__device__ __forceinline__ float hi_f16(u32 x) { return f16_to_f32(x >> 16); }

struct FoldTile {
    u32 kw[2][NG][KGW]; // key rows gid, gid+8
    u32 vw[4][NG][VGW]; // value rows 2tq, 2tq+1, 2tq+8, 2tq+9
    u32 kp[2][NG];      // (scale, bias) of key rows gid, gid+8
    u32 vp[2][NG];      // and of value rows gid, gid+8
};

struct FoldBase {
    const u32* k;  // key row gid, this lane's key words
    const u32* v;  // value row 2tq, this lane's value words
    const u32* kp; // params of row gid
    const u32* vp;
};

// A tile wholly before the split's end: base pointers plus immediate offsets.
__device__ __forceinline__ void load_fold_full(FoldTile& t, const FoldBase& base, int r0) {
    const u32* k = base.k + (long)r0 * ROW_WORDS;
    const u32* v = base.v + (long)r0 * ROW_WORDS;
    const u32* kp = base.kp + (long)r0 * NG;
    const u32* vp = base.vp + (long)r0 * NG;
    const int vrow[4] = {0, 1, 8, 9};
#pragma unroll
    for (int r = 0; r < 2; r++) {
#pragma unroll
        for (int gr = 0; gr < NG; gr++)
            load_words(t.kw[r][gr], k + 8 * r * ROW_WORDS + gr * GROUP_WORDS);
#if CODEC != 0
        load_words(t.kp[r], kp + 8 * r * NG);
        load_words(t.vp[r], vp + 8 * r * NG);
#endif
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int gr = 0; gr < NG; gr++)
            load_words(t.vw[i][gr], v + vrow[i] * ROW_WORDS + gr * GROUP_WORDS);
}

// The split's last, partial tile: rows past `hi` read row `lo` (finite codes and
// parameters; their scores are masked).
__device__ __forceinline__ void load_fold_tail(FoldTile& t, const u32* __restrict__ kdata,
                                                const u32* __restrict__ kparams,
                                                const u32* __restrict__ vdata,
                                                const u32* __restrict__ vparams,
                                                long block_rows, int r0, int lo, int hi,
                                                int gid, int tq) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = r0 + 8 * r + gid;
        const long at = block_rows + (row < hi ? row : lo);
#pragma unroll
        for (int gr = 0; gr < NG; gr++)
            load_words(t.kw[r][gr], kdata + at * ROW_WORDS + gr * GROUP_WORDS + tq * KGW);
#if CODEC != 0
        load_words(t.kp[r], kparams + at * NG);
        load_words(t.vp[r], vparams + at * NG);
#endif
    }
    const int rows[4] = {r0 + 2 * tq, r0 + 2 * tq + 1, r0 + 2 * tq + 8, r0 + 2 * tq + 9};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const long at = block_rows + (rows[i] < hi ? rows[i] : lo);
#pragma unroll
        for (int gr = 0; gr < NG; gr++)
            load_words(t.vw[i][gr], vdata + at * ROW_WORDS + gr * GROUP_WORDS + gid * VGW);
    }
}

// d (A rows 0..15 × B columns) += A·B, all four C registers live.
__device__ __forceinline__ void mma16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                      u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The 8×8 16-bit matrix whose row gid, columns 2tq and 2tq+1 this lane holds, transposed
// (the lane then holds row gid, columns 2tq, 2tq+1 of the transpose).
__device__ __forceinline__ u32 transpose8(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

#define VBLOCKS (D / 16) // value blocks of 16 dims

// One block's pass of the folded read over stored rows [lo, hi): B column gid is the query
// row at `qg` (zeros unless `real`); with CHUNK, C column 2tq + c also masks rows outside
// [clo[c], chi[c]]. Leaves each warp's state per column in sm_ml / sm_acc and synchronizes.
template <bool CHUNK>
__device__ __forceinline__ void fold_pass(const float* __restrict__ qg, float qscale, bool real,
                                          const u32* __restrict__ kdata,
                                          const u32* __restrict__ kparams,
                                          const u32* __restrict__ vdata,
                                          const u32* __restrict__ vparams, long block_rows,
                                          int lo, int hi, const int (&clo)[2],
                                          const int (&chi)[2], float (&sm_ml)[WARPS][8][2],
                                          float (&sm_acc)[WARPS][8][D]) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane >> 2, tq = lane & 3;
    const FoldBase base = {kdata + (block_rows + gid) * ROW_WORDS + tq * KGW,
                            vdata + (block_rows + 2 * tq) * ROW_WORDS + gid * VGW,
                            kparams + (block_rows + gid) * NG, vparams + (block_rows + gid) * NG};
    auto load = [&](FoldTile& t, int r0) {
        if (r0 + 16 <= hi)
            load_fold_full(t, base, r0);
        else if (r0 < hi)
            load_fold_tail(t, kdata, kparams, vdata, vparams, block_rows, r0, lo, hi, gid, tq);
    };
    // Two tiles in registers, alternating (no copy of the next into the current). The first
    // two are on their way before the query is read and converted. (A per-warp cp.async
    // ring of 2–4 shared-memory stages lost to this at batch 16: NOTES.md, 2026-12-06.)
    FoldTile ta, tb;
    int r0 = lo + warp * 16;
    load(ta, r0);
    load(tb, r0 + WARPS * 16);
    u32 qb[D / 16][2];
#if CODEC == 0
    u32 ql[D / 16][2]; // q's residual parts
#endif
    float qsum[NG][2];
    {
#pragma unroll
        for (int gr = 0; gr < NG; gr++) {
            const float* qe = qg + gr * FGROUP + tq * KE;
            float sum = 0.f;
#pragma unroll
            for (int jj = 0; jj < FGROUP / 16; jj++) {
                float x[4];
#if CODEC == 4
                const int e = 8 * (jj / 2) + 2 * (jj % 2);
                const int o[4] = {e, e + 4, e + 1, e + 5};
                const float f[4] = {1.f, 1.f, 1.f / 16, 1.f / 16};
#else
                const int o[4] = {4 * jj, 4 * jj + 1, 4 * jj + 2, 4 * jj + 3};
                const float f[4] = {1.f, 1.f, 1.f, 1.f};
#endif
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float v = real ? qe[o[i]] * qscale : 0.f;
                    sum += v;
                    x[i] = v * f[i];
                }
                const int j = gr * (FGROUP / 16) + jj;
                qb[j][0] = pack2(x[0], x[1]);
                qb[j][1] = pack2(x[2], x[3]);
#if CODEC == 0
                ql[j][0] = residual2(x[0], x[1], qb[j][0]);
                ql[j][1] = residual2(x[2], x[3], qb[j][1]);
#endif
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            // Head gid's sum sits in lanes 4gid..4gid+3: fetch heads 2tq and 2tq+1.
            qsum[gr][0] = __shfl_sync(0xffffffffu, sum, 8 * tq);
            qsum[gr][1] = __shfl_sync(0xffffffffu, sum, 8 * tq + 4);
        }
    }
    float m[2] = {NEG_BIG, NEG_BIG}, l[2] = {0.f, 0.f}; // columns 2tq, 2tq+1
    float acc[VBLOCKS][4], bacc[NG][2];
#pragma unroll
    for (int n = 0; n < VBLOCKS; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
    for (int gr = 0; gr < NG; gr++) bacc[gr][0] = bacc[gr][1] = 0.f;

    auto step = [&](const FoldTile& t, int r0) {
        // Scores s[r][c]: row r0 + gid + 8r, head 2tq + c.
        float s[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
        for (int gr = 0; gr < NG; gr++) {
            float sg[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int jj = 0; jj < FGROUP / 16; jj++) {
                const int j = gr * (FGROUP / 16) + jj;
#if CODEC == 0
                // Words 2jj, 2jj + 1 of rows gid, gid + 8: k = 2tq.., 2tq + 8.. (q alike).
                const u32 *w0 = t.kw[0][gr], *w1 = t.kw[1][gr];
                mma16(sg, w0[2 * jj], w1[2 * jj], w0[2 * jj + 1], w1[2 * jj + 1], qb[j][0],
                      qb[j][1]);
                mma16(sg, w0[2 * jj], w1[2 * jj], w0[2 * jj + 1], w1[2 * jj + 1], ql[j][0],
                      ql[j][1]);
#elif CODEC == 4
                const u32 w0 = t.kw[0][gr][jj / 2] >> (8 * (jj % 2));
                const u32 w1 = t.kw[1][gr][jj / 2] >> (8 * (jj % 2));
                mma16(sg, code_pair(w0, 0x000F000Fu), code_pair(w1, 0x000F000Fu),
                      code_pair(w0, 0x00F000F0u), code_pair(w1, 0x00F000F0u), qb[j][0], qb[j][1]);
#else
                const u32 w0 = t.kw[0][gr][jj], w1 = t.kw[1][gr][jj];
#if DENORMAL_CODES
                mma16(sg, __byte_perm(w0, 0, 0x4140), __byte_perm(w1, 0, 0x4140),
                      __byte_perm(w0, 0, 0x4342), __byte_perm(w1, 0, 0x4342), qb[j][0], qb[j][1]);
#else
                mma16(sg, code_pair(__byte_perm(w0, 0, 0x4140), 0x00FF00FFu),
                      code_pair(__byte_perm(w1, 0, 0x4140), 0x00FF00FFu),
                      code_pair(__byte_perm(w0, 0, 0x4342), 0x00FF00FFu),
                      code_pair(__byte_perm(w1, 0, 0x4342), 0x00FF00FFu), qb[j][0], qb[j][1]);
#endif
#endif
            }
#pragma unroll
            for (int r = 0; r < 2; r++) {
#if CODEC == 0
#pragma unroll
                for (int c = 0; c < 2; c++) s[r][c] += sg[2 * r + c];
#else
                const float scale = lo_f16(t.kp[r][gr]), bias = hi_f16(t.kp[r][gr]);
#pragma unroll
                for (int c = 0; c < 2; c++)
                    s[r][c] = fmaf(scale * UNIT_INV, sg[2 * r + c], fmaf(bias, qsum[gr][c], s[r][c]));
#endif
            }
        }
        // Online softmax per head over the tile's 16 rows (spread over the 8 gid lanes).
        float corr[2], p[2][2];
#pragma unroll
        for (int c = 0; c < 2; c++) {
#pragma unroll
            for (int r = 0; r < 2; r++)
                if (r0 + gid + 8 * r >= hi ||
                    (CHUNK && (r0 + gid + 8 * r < clo[c] || r0 + gid + 8 * r > chi[c])))
                    s[r][c] = __int_as_float(0xff800000);
            float mx = fmaxf(s[0][c], s[1][c]);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
            const float mn = fmaxf(m[c], mx);
            corr[c] = fast_exp2(m[c] - mn);
            m[c] = mn;
            p[0][c] = fast_exp2(s[0][c] - mn);
            p[1][c] = fast_exp2(s[1][c] - mn);
            l[c] = l[c] * corr[c] + p[0][c] + p[1][c];
        }
        const bool rescale = __any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f);
        if (rescale) {
#pragma unroll
            for (int n = 0; n < VBLOCKS; n++) {
                acc[n][0] *= corr[0];
                acc[n][1] *= corr[1];
                acc[n][2] *= corr[0];
                acc[n][3] *= corr[1];
            }
        }
#pragma unroll
        for (int gr = 0; gr < NG; gr++) {
            // (P∘scale)ᵀ as B: rows gid, gid+8 scaled here, then transposed.
            float ps[2][2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
#if CODEC == 0
                ps[r][0] = p[r][0];
                ps[r][1] = p[r][1];
#else
                const float scale = lo_f16(t.vp[r][gr]), bias = hi_f16(t.vp[r][gr]);
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    ps[r][c] = p[r][c] * scale;
                    bacc[gr][c] = fmaf(p[r][c], bias, r == 0 ? bacc[gr][c] * corr[c] : bacc[gr][c]);
                }
#endif
            }
#if CODEC == 0
            const u32 pb0 = pack2(ps[0][0], ps[0][1]), pb1 = pack2(ps[1][0], ps[1][1]);
            const u32 b0 = transpose8(pb0), b1 = transpose8(pb1);
            const u32 r0b = transpose8(residual2(ps[0][0], ps[0][1], pb0));
            const u32 r1b = transpose8(residual2(ps[1][0], ps[1][1], pb1));
#else
            const u32 b0 = transpose8(pack2(ps[0][0], ps[0][1]));
            const u32 b1 = transpose8(pack2(ps[1][0], ps[1][1]));
#endif
#pragma unroll
            for (int jb = 0; jb < FGROUP / 16; jb++) {
                // Dims 2jb (m = gid) and 2jb + 1 (m = gid + 8) of lane gid's codes.
#if CODEC == 0
                // Word jb of rows 2tq, 2tq+1 (and +8, +9): low halves pair as m = gid,
                // high halves as m = gid + 8.
                const u32 x0 = t.vw[0][gr][jb], x1 = t.vw[1][gr][jb];
                const u32 x2 = t.vw[2][gr][jb], x3 = t.vw[3][gr][jb];
                const u32 a0 = __byte_perm(x0, x1, 0x5410), a1 = __byte_perm(x0, x1, 0x7632);
                const u32 a2 = __byte_perm(x2, x3, 0x5410), a3 = __byte_perm(x2, x3, 0x7632);
                mma16(acc[jb], a0, a1, a2, a3, b0, b1);
                mma16(acc[jb], a0, a1, a2, a3, r0b, r1b);
#elif CODEC == 4
                const int w = jb / 4, byte = jb % 4;
                const u32 sel = byte | ((4 + byte) << 8);
                const u32 x01 = __byte_perm(t.vw[0][gr][w], t.vw[1][gr][w], sel);
                const u32 x89 = __byte_perm(t.vw[2][gr][w], t.vw[3][gr][w], sel);
                mma16(acc[gr * (GROUP / 16) + jb], code_pair(x01, 0x000F000Fu),
                      code_pair(x01, 0x00F000F0u), code_pair(x89, 0x000F000Fu),
                      code_pair(x89, 0x00F000F0u), b0, b1);
#else
                const int w = jb / 2, byte = 2 * (jb % 2);
                const u32 sel0 = byte | ((4 + byte) << 8), sel1 = sel0 + 0x101;
                mma16(acc[gr * (GROUP / 16) + jb],
                      code_pair(__byte_perm(t.vw[0][gr][w], t.vw[1][gr][w], sel0), 0x00FF00FFu),
                      code_pair(__byte_perm(t.vw[0][gr][w], t.vw[1][gr][w], sel1), 0x00FF00FFu),
                      code_pair(__byte_perm(t.vw[2][gr][w], t.vw[3][gr][w], sel0), 0x00FF00FFu),
                      code_pair(__byte_perm(t.vw[2][gr][w], t.vw[3][gr][w], sel1), 0x00FF00FFu),
                      b0, b1);
#endif
            }
        }
    };

    while (r0 < hi) {
        step(ta, r0);
        r0 += WARPS * 16;
        if (r0 >= hi) break;
        load(ta, r0 + WARPS * 16);
        step(tb, r0);
        r0 += WARPS * 16;
        load(tb, r0 + WARPS * 16);
    }

    // Sums over the 8 gid lanes (rows) of each head's l and bias term.
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
#pragma unroll
        for (int c = 0; c < 2; c++) {
            l[c] += __shfl_xor_sync(0xffffffffu, l[c], off);
#pragma unroll
            for (int gr = 0; gr < NG; gr++)
                bacc[gr][c] += __shfl_xor_sync(0xffffffffu, bacc[gr][c], off);
        }
    }
    // acc[blk][2i + c]: head 2tq + c, dim gr·GROUP + gid·BPG + 2jb + i (i = 1: 16 units
    // for 4-bit codes). Merge the warps.
#pragma unroll
    for (int blk = 0; blk < VBLOCKS; blk++) {
        const int gr = blk / (FGROUP / 16), jb = blk % (FGROUP / 16);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float unit = (CODEC == 4 && i == 1) ? UNIT_INV / 16 : UNIT_INV;
#pragma unroll
            for (int c = 0; c < 2; c++)
                sm_acc[warp][2 * tq + c][gr * FGROUP + gid * BPG + 2 * jb + i] =
                    fmaf(acc[blk][2 * i + c], unit, bacc[gr][c]);
        }
    }
    if (gid == 0) {
#pragma unroll
        for (int c = 0; c < 2; c++) {
            sm_ml[warp][2 * tq + c][0] = m[c];
            sm_ml[warp][2 * tq + c][1] = l[c];
        }
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, FOLD_MIN_BLOCKS)
kv_decode_partial_fold(const float* __restrict__ q, float qscale,
                        const u32* __restrict__ kdata,
                        const u32* __restrict__ kparams, const u32* __restrict__ vdata,
                        const u32* __restrict__ vparams, const Spans spans, int kv_heads,
                        int capacity, int chunk,
                        float* __restrict__ part_ml, float* __restrict__ part_acc) {
    release_dependents();
    wait_for_prior();
    const int split = blockIdx.x, h = blockIdx.y, b = spans.row0 + blockIdx.z;
    const int splits = gridDim.x;
    const int gid = (threadIdx.x % 32) >> 2;
    const long block_rows = ((long)b * kv_heads + h) * capacity;
    int lo, hi;
    split_range(spans, blockIdx.z, split, splits, chunk, lo, hi);
    // Column gid is head gid (heads past G zero).
    const bool real = gid < G;
    const float* qg = q + (((long)b * kv_heads + h) * G + (real ? gid : 0)) * D;
    const int none[2] = {0, 0};
    __shared__ float sm_ml[WARPS][8][2];
    __shared__ float sm_acc[WARPS][8][D];
    fold_pass<false>(qg, qscale, real, kdata, kparams, vdata, vparams, block_rows, lo, hi, none, none,
                     sm_ml, sm_acc);
    store_partials(sm_ml, sm_acc, b, h, kv_heads, split, splits, part_ml, part_acc);
}

// ---------------------------------------------------------------------------------------
// The folded read for a chunk of queries (prefill): causal, left padding, optional window,
// over slots that hold positions (slot = position: full-retention layers). The B columns
// are (query, head) pairs instead of heads: column c is head c % G of query
// grp·PPB + c / G, so a block serves PPB = 8 / G queries of one KV head in one pass over
// the rows they see, and C column c masks rows outside its own causal span. Blocks: (split
// of the rows, KV head, row × query group). With one split the block writes the
// normalized output; with more, partials in the decode layout with (head, query) as the
// output row, merged by kv_decode_merge over (query heads × queries, rows).
// Its pass is the decode read's, fold_pass.
#define PPB (8 / G)
extern "C" __global__ void __launch_bounds__(WARPS * 32, FOLD_MIN_BLOCKS)
kv_chunk_partial_fold(const float* __restrict__ q, float qscale,
                      const u32* __restrict__ kdata,
                      const u32* __restrict__ kparams, const u32* __restrict__ vdata,
                      const u32* __restrict__ vparams, const int* __restrict__ pads, int start,
                      int n, int window, int kv_heads, int capacity, int chunk,
                      float* __restrict__ part_ml, float* __restrict__ part_acc,
                      float* __restrict__ out) {
    const int split = blockIdx.x, h = blockIdx.y, splits = gridDim.x;
    const int groups = (n + PPB - 1) / PPB;
    const int b = blockIdx.z / groups, grp = blockIdx.z % groups;
    const int lane = threadIdx.x % 32, gid = lane >> 2, tq = lane & 3;
    const long block_rows = ((long)b * kv_heads + h) * capacity;
    const int pad = pads[b], qh = kv_heads * G;
    // Column c: query i = grp·PPB + c / G (position start + i), head c % G.
    auto col_query = [&](int c) { return grp * PPB + c / G; };
    auto col_valid = [&](int c) { return c < PPB * G && col_query(c) < n; };
    auto col_row = [&](int c) { // its output row in (rows, q heads, queries)
        return ((long)b * qh + h * G + c % G) * n + col_query(c);
    };
    // The first slot column c sees: causal, past the padding, inside the window; a
    // padding query sees only itself (as the dense mask has it).
    auto first_slot = [&](int c) {
        const int pos = start + col_query(c);
        if (pos < pad) return pos;
        return max(pad, window > 0 ? pos - window + 1 : 0);
    };
    int lo_all = 0x7fffffff, hi_all = 0;
#pragma unroll
    for (int c = 0; c < 8; c++) {
        if (col_valid(c)) {
            lo_all = min(lo_all, first_slot(c));
            hi_all = max(hi_all, start + col_query(c) + 1);
        }
    }
    const int lo = lo_all + split * chunk;
    const int hi = min(hi_all, lo + chunk);
    // This lane's C columns: slots [clo[c], chi[c]] (none for an unused column).
    int clo[2], chi[2];
#pragma unroll
    for (int c = 0; c < 2; c++) {
        const bool valid = col_valid(2 * tq + c);
        clo[c] = valid ? first_slot(2 * tq + c) : 0x7fffffff;
        chi[c] = valid ? start + col_query(2 * tq + c) : -1;
    }

    const bool real = col_valid(gid);
    const float* qg = q + (real ? col_row(gid) * D : 0);
    __shared__ float sm_ml[WARPS][8][2];
    __shared__ float sm_acc[WARPS][8][D];
    fold_pass<true>(qg, qscale, real, kdata, kparams, vdata, vparams, block_rows, lo, hi, clo, chi,
                    sm_ml, sm_acc);
    // Merge the warps per (column, element): the normalized output, or this split's
    // partial state.
    for (int idx = threadIdx.x; idx < PPB * G * D; idx += WARPS * 32) {
        const int c = idx / D, e = idx % D;
        if (!col_valid(c)) continue;
        float mx, sum, a;
        merge_warps(sm_ml, sm_acc, c, e, mx, sum, a);
        const long row = col_row(c);
        if (splits == 1) {
            out[row * D + e] = sum > 0.f ? a / sum : 0.f;
        } else {
            const long at = row * splits + split;
            part_acc[at * D + e] = a;
            if (e == 0) {
                part_ml[at * 2] = mx;
                part_ml[at * 2 + 1] = sum;
            }
        }
    }
}
#endif // D <= 128
#endif // foldable codec

// grid (query heads, batch), 256 threads: merges the splits of one output row. Warp w
// sums splits w, w + 8, ... against their maximum (lane: elements lane, lane + 32, ...),
// so a long split list is walked by eight warps at once; the warps' states are then
// merged per element.
#define MERGE_WARPS 8
extern "C" __global__ void __launch_bounds__(MERGE_WARPS * 32)
kv_decode_merge(const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                float* __restrict__ out, int splits, int* __restrict__ live) {
    release_dependents();
    wait_for_prior();
    const int hq = blockIdx.x, b = blockIdx.y, qh = gridDim.x;
    // A live read's row has read its span (the partials are done): its next write slot.
    if (live && hq == 0 && threadIdx.x == 0) live[2 + 2 * b] += 1;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long first = ((long)b * qh + hq) * splits;
    // The warp's maximum first (lane j reads split warp + 8j's), so that the sums need no
    // rescaling and their loads do not wait on one another: two round trips to L2 a warp
    // instead of one a split (a batch-1 read at 32k has 64 splits).
    float m = NEG_BIG, l = 0.f, a[(D + 31) / 32];
    for (int s = warp + MERGE_WARPS * lane; s < splits; s += MERGE_WARPS * 32)
        m = fmaxf(m, part_ml[(first + s) * 2]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
#pragma unroll
    for (int i = 0; i < (D + 31) / 32; i++) a[i] = 0.f;
#pragma unroll 8
    for (int s = warp; s < splits; s += MERGE_WARPS) {
        const float cs = fast_exp2(part_ml[(first + s) * 2] - m);
        l = fmaf(part_ml[(first + s) * 2 + 1], cs, l);
#pragma unroll
        for (int i = 0; i < (D + 31) / 32; i++) {
            const int e = lane + 32 * i;
            if (e < D) a[i] = fmaf(part_acc[(first + s) * D + e], cs, a[i]);
        }
    }
    __shared__ float sm_ml[MERGE_WARPS][2];
    __shared__ float sm_a[MERGE_WARPS][D];
#pragma unroll
    for (int i = 0; i < (D + 31) / 32; i++) {
        const int e = lane + 32 * i;
        if (e < D) sm_a[warp][e] = a[i];
    }
    if (lane == 0) {
        sm_ml[warp][0] = m;
        sm_ml[warp][1] = l;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < D; e += MERGE_WARPS * 32) {
        float mx = NEG_BIG;
#pragma unroll
        for (int w = 0; w < MERGE_WARPS; w++) mx = fmaxf(mx, sm_ml[w][0]);
        float sum = 0.f, acc = 0.f;
#pragma unroll
        for (int w = 0; w < MERGE_WARPS; w++) {
            const float c = fast_exp2(sm_ml[w][0] - mx);
            sum += sm_ml[w][1] * c;
            acc += sm_a[w][e] * c;
        }
        out[((long)b * qh + hq) * D + e] = sum > 0.f ? acc / sum : 0.f;
    }
}

#if CODEC == 1
// ---------------------------------------------------------------------------------------
// The turbo read's two ends (blocks of D threads, one vector each). Keys are stored
// rotated, R(k / s) with s the fitted per-channel key scales, so the query enters as
// R(q ∘ s): the dot products are the original ones. Values are accumulated in the
// rotated space and rotated back once per output row (R is orthonormal).

// In-place unnormalised Walsh–Hadamard transform of x[0..D), thread i owning element i:
// the CPU's butterflies (a + b, a - b), so the same floats come out.
__device__ __forceinline__ void fwht_block(float* x) {
    const int i = threadIdx.x;
    for (int h = 1; h < D; h <<= 1) {
        __syncthreads();
        const float y = (i & h) ? x[i - h] - x[i] : x[i] + x[i + h];
        __syncthreads();
        x[i] = y;
    }
    __syncthreads();
}

// q (vectors, D) of a layout (row, kv_heads * G, D) into qr = R(q ∘ s), s the key scales
// of the vector's row and KV head (`scale` (rows * kv_heads, D), block row * kv_heads +
// head = vec / G), R = H · diag(signs) / √D.
extern "C" __global__ void __launch_bounds__(D)
turbo_rotate_queries(const float* __restrict__ q, float* __restrict__ qr,
                     const float* __restrict__ scale, const float* __restrict__ signs,
                     int kv_heads, int nq) {
    __shared__ float x[D];
    const long vec = blockIdx.x;
    const int i = threadIdx.x;
    // The stored block (row · kv_heads + head) of launch row vec / G / kv_heads.
    const long head = vec / G % kv_heads, block = vec / G / kv_heads / nq * kv_heads + head;
    x[i] = q[vec * D + i] * scale[block * D + i] * signs[i];
    fwht_block(x);
    qr[vec * D + i] = x[i] * (1.f / sqrtf((float)D));
}

// out (vectors, D), in the values' rotated space, rotated back in place: diag(signs) · H / √D.
extern "C" __global__ void __launch_bounds__(D)
turbo_unrotate(float* __restrict__ out, const float* __restrict__ signs) {
    __shared__ float x[D];
    const long vec = blockIdx.x;
    const int i = threadIdx.x;
    x[i] = out[vec * D + i];
    fwht_block(x);
    out[vec * D + i] = x[i] * (signs[i] * (1.f / sqrtf((float)D)));
}
#endif

// Benchmark fill: deterministic pseudo-random words (never zeros: see the device notes).
__device__ __forceinline__ u32 mix(u32 x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

// kind 0: any bits (codes); 1: two bf16 in [-1, 1); 2: an f16 (scale, bias) pair, scale in
// [0.01, 0.03), bias in [-0.3, -0.1).
extern "C" __global__ void fill_random(u32* __restrict__ p, long n, u32 seed, int kind) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        const u32 r = mix((u32)i * 0x9e3779b9u ^ seed), r2 = mix(r ^ 0x85ebca6bu);
        if (kind == 0) {
            p[i] = r;
        } else if (kind == 1) {
            const float a = (r & 0xffffff) / 8388608.f - 1.f, c = (r2 & 0xffffff) / 8388608.f - 1.f;
            p[i] = (__float_as_uint(a) >> 16) | (__float_as_uint(c) & 0xffff0000u);
        } else {
            const float scale = 0.01f + (r & 0xffff) / 3276800.f;
            const float bias = -0.1f - (r2 & 0xffff) / 327680.f;
            unsigned short hs, hb;
            asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hs) : "f"(scale));
            asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hb) : "f"(bias));
            p[i] = (u32)hs | ((u32)hb << 16);
        }
    }
}
