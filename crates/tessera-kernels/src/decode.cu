// Fused KV decode read: one query row per sequence, all G query heads of a KV head
// folded onto one pass over that head's stored rows, the sequence split across blocks
// (flash-decoding), partial softmax states merged by a second kernel.
//
// Compiled at run time (NVRTC) once per configuration, set by the host as #defines:
//   CODEC  0 = bf16 rows, 4 / 8 = affine codes (u32 words, element i at bit i*CODEC of
//          the row) with an f16 (scale, bias) pair per GROUP elements: x = scale*c + bias
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
#define LOG2E 1.4426950408889634f
#define NEG_BIG (-1.0e30f) // "no score yet": finite, so merging two empty states is no NaN

__device__ __forceinline__ float f16_to_f32(u32 h) {
    float f;
    unsigned short x = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

// 2^x by the special-function unit (-inf gives 0).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The raw bytes of 8 elements [e0, e0 + 8) of stored row `row`.
struct Raw {
#if CODEC == 0
    uint4 w;
#elif CODEC == 4
    u32 w;
    u32 p;
#else
    uint2 w;
    u32 p;
#endif
};

__device__ __forceinline__ Raw load_raw(const u32* __restrict__ data,
                                        const u32* __restrict__ params, long row, int e0) {
    Raw r;
#if CODEC == 0
    r.w = __ldg((const uint4*)(data + row * (D / 2) + e0 / 2));
#elif CODEC == 4
    r.w = __ldg(data + row * (D / 8) + e0 / 8);
    r.p = __ldg(params + row * (D / GROUP) + e0 / GROUP);
#else
    r.w = __ldg((const uint2*)(data + row * (D / 4) + e0 / 4));
    r.p = __ldg(params + row * (D / GROUP) + e0 / GROUP);
#endif
    return r;
}

__device__ __forceinline__ void widen(const Raw& r, float x[8]) {
#if CODEC == 0
    const u32 w[4] = {r.w.x, r.w.y, r.w.z, r.w.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        x[2 * j] = __uint_as_float(w[j] << 16);
        x[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
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

// grid (splits, kv_heads, batch), 128 threads. Row b attends its stored positions
// [starts[b], ends[b]); split s takes `chunk` of them. Queries are pre-scaled (softmax
// scale folded in), laid out (batch, kv_heads * G, D). Writes per (b, query head, split)
// the running max and sum (part_ml) and the unnormalised output (part_acc).
extern "C" __global__ void __launch_bounds__(WARPS * 32)
kv_decode_partial(const float* __restrict__ q, const u32* __restrict__ kdata,
                  const u32* __restrict__ kparams, const u32* __restrict__ vdata,
                  const u32* __restrict__ vparams, const int* __restrict__ starts,
                  const int* __restrict__ ends, int kv_heads, int capacity, int chunk,
                  float* __restrict__ part_ml, float* __restrict__ part_acc) {
    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z, splits = gridDim.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int sub = lane / LPR, e0 = (lane % LPR) * 8;
    const long block_rows = ((long)b * kv_heads + h) * capacity;
    const int lo = starts[b] + split * chunk;
    const int hi = min(ends[b], lo + chunk);

    float qr[G][8], m[G], l[G], acc[G][8];
#pragma unroll
    for (int g = 0; g < G; g++) {
        const float* qg = q + (((long)b * kv_heads + h) * G + g) * D + e0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            qr[g][i] = qg[i] * LOG2E; // scores in log2 units: exp2 is one instruction
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
            const long row = block_rows + (valid[u] ? pos : lo);
            kr[u] = load_raw(kdata, kparams, row, e0);
            vr[u] = load_raw(vdata, vparams, row, e0);
        }
        float s[UNROLL][G];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            float k[8];
            widen(kr[u], k);
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
            widen(vr[u], v);
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
    const int qh = kv_heads * G;
    for (int idx = threadIdx.x; idx < G * D; idx += WARPS * 32) {
        const int g = idx / D, e = idx % D;
        float mx = NEG_BIG;
#pragma unroll
        for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, sm_ml[w][g][0]);
        float sum = 0.f, a = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            const float c = fast_exp2(sm_ml[w][g][0] - mx);
            sum += sm_ml[w][g][1] * c;
            a += sm_acc[w][g][e] * c;
        }
        const long at = ((long)b * qh + h * G + g) * splits + split;
        part_acc[at * D + e] = a;
        if (e == 0) {
            part_ml[at * 2] = mx;
            part_ml[at * 2 + 1] = sum;
        }
    }
}

// grid (query heads, batch), D threads: merges the splits of one output row.
extern "C" __global__ void kv_decode_merge(const float* __restrict__ part_ml,
                                           const float* __restrict__ part_acc,
                                           float* __restrict__ out, int splits) {
    const int hq = blockIdx.x, b = blockIdx.y, qh = gridDim.x, e = threadIdx.x;
    const long first = ((long)b * qh + hq) * splits;
    float mx = NEG_BIG;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, part_ml[(first + s) * 2]);
    float sum = 0.f, a = 0.f;
    for (int s = 0; s < splits; s++) {
        const float c = fast_exp2(part_ml[(first + s) * 2] - mx);
        sum += part_ml[(first + s) * 2 + 1] * c;
        a += part_acc[(first + s) * D + e] * c;
    }
    out[((long)b * qh + hq) * D + e] = sum > 0.f ? a / sum : 0.f;
}

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
