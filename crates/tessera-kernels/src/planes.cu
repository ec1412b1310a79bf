// Writing and reading KV plane rows on the device: encode-on-append (f32 rows into bf16
// pairs or affine codes with their (scale, bias) pairs), decode back to f32 (the chunk
// read and conversion use it), and the strided copy that grows a plane's capacity.
//
// Layouts are the CPU cache's (tessera-kv): a plane is (blocks = rows * heads, capacity,
// words) u32 words. bf16: element 2i in the low half of word i. Affine of BITS bits:
// element i at bit i * BITS of the row's little-endian word stream; per GROUP elements one
// u32 holding f16 scale (low half) and f16 bias (high half). The affine arithmetic is
// mlx's, as tessera-kv's affine.rs states it, step for step, so codes match the CPU's bit
// for bit: inputs rounded to bf16 first; the maximum starts at 0; the larger-magnitude edge
// snaps exactly; codes round half away from zero. TurboQuant rows (tessera-kv's
// turbo_planes.rs): BITS-bit codes in the same bit stream, and per row one word holding the
// vector's f16 norm (low half); encoded and decoded with the CPU's operations in the CPU's
// order (correctly rounded, never fused), so the codes match bit for bit too. Geometry is
// passed at run time: these kernels run once per append, far from the decode read's cost.

typedef unsigned int u32;
typedef unsigned short u16;

// Programmatic dependent launch (dependent.rs): the append's launch may start while
// the kernel before them finishes; each waits for it before touching anything (release
// first, so that the next kernel can be scheduled as early). No-ops for a plain launch.
__device__ __forceinline__ void release_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ void wait_for_prior() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

__device__ __forceinline__ u16 f32_to_bf16(float x) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u32 h) { return __uint_as_float(h << 16); }

__device__ __forceinline__ u16 f32_to_f16(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ float f16_to_f32(u32 h) {
    float f;
    u16 x = (u16)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

// x (blocks, n, d) f32 into slots [slot, slot + n) of a plane of `cap` slots; affine rows
// first have `mean` (blocks, d) subtracted where it is given (keys: tessera-kv's affine.rs
// centres them), after the bf16 rounding, as the CPU does. bits == 0:
// bf16, one thread per word; otherwise affine, one warp per group (the host launches 32
// threads per group): lanes load the group together, reduce its range by shuffles, and
// each writes whole words of the group's code stream. (One thread walking a group alone,
// load after load, took ~25 µs a row: more than the decode read it feeds.)
// The slot a block's positions start at: `slot`, or with `live` (a decode step captured in a
// graph; see decode.cu's Spans) the write slot its row holds in device memory: after the
// read's chunk, (start, slot) per row from the launch's first row on.
__device__ __forceinline__ int slot_of(int slot, const int* __restrict__ live, long block,
                                       int heads) {
    return live ? __ldcg(live + 2 + 2 * (block / heads)) : slot;
}

__device__ __forceinline__ void encode_rows(const float* __restrict__ x,
                                            u32* __restrict__ codes, u32* __restrict__ params,
                                            long blocks, int n, int d, int cap, int slot,
                                            int bits, int group,
                                            const float* __restrict__ mean,
                                            const int* __restrict__ live, int heads) {
    const int per_row = bits == 0 ? d / 2 : d / group;
    const long total = blocks * n * per_row;
    if (bits == 0) {
        for (long t = blockIdx.x * (long)blockDim.x + threadIdx.x; t < total;
             t += (long)gridDim.x * blockDim.x) {
            const long row = t / per_row;
            const int j = (int)(t % per_row);
            const long dst = (row / n) * cap + slot_of(slot, live, row / n, heads) + row % n;
            const float* src = x + row * d;
            codes[dst * (d / 2) + j] =
                (u32)f32_to_bf16(src[2 * j]) | ((u32)f32_to_bf16(src[2 * j + 1]) << 16);
        }
        return;
    }
    __shared__ unsigned char group_codes[32][128]; // per warp: one group's codes (≤ 128)
    unsigned char* gc = group_codes[threadIdx.x / 32];
    const int lane = threadIdx.x % 32, per_lane = group / 32; // groups of 32, 64 or 128
    const float n_bins = (float)((1u << bits) - 1);
    const long warps = (long)gridDim.x * blockDim.x / 32;
    for (long t = (blockIdx.x * (long)blockDim.x + threadIdx.x) / 32; t < total; t += warps) {
        const long row = t / per_row;        // block * n + i
        const int j = (int)(t % per_row);    // group
        const long dst = (row / n) * cap + slot_of(slot, live, row / n, heads) + row % n;
        const float* w = x + row * d + j * group + lane * per_lane;
        const float* m = mean ? mean + (row / n) * d + j * group + lane * per_lane : nullptr;
        float v[4], w_min = 3.402823466e38f, w_max = 0.f;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            if (e < per_lane) {
                v[e] = bf16_to_f32(f32_to_bf16(w[e])) - (m ? m[e] : 0.f);
                w_min = fminf(w_min, v[e]);
                w_max = fmaxf(w_max, v[e]);
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            w_min = fminf(w_min, __shfl_xor_sync(0xffffffffu, w_min, off));
            w_max = fmaxf(w_max, __shfl_xor_sync(0xffffffffu, w_max, off));
        }
        float scale = fmaxf((w_max - w_min) / n_bins, 1e-7f);
        const bool side = fabsf(w_min) > fabsf(w_max);
        if (!side) scale = -scale;
        const float edge = side ? w_min : w_max;
        const float q0 = roundf(edge / scale);
        float bias = 0.f;
        if (q0 != 0.f) {
            scale = edge / q0;
            bias = edge;
        }
        if (lane == 0)
            params[dst * (d / group) + j] = (u32)f32_to_f16(scale) | ((u32)f32_to_f16(bias) << 16);
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (e < per_lane)
                gc[lane * per_lane + e] =
                    (unsigned char)fminf(fmaxf(roundf((v[e] - bias) / scale), 0.f), n_bins);
        __syncwarp();
        // Word k of the group's stream holds bits [32k, 32k + 32): the codes overlapping it.
        u32* out = codes + dst * (d * bits / 32) + j * (group * bits / 32);
        for (int k = lane; k < group * bits / 32; k += 32) {
            u32 word = 0;
            for (int e = 32 * k / bits; e <= (32 * k + 31) / bits; e++) {
                const int shift = e * bits - 32 * k; // negative: the code began in word k - 1
                word |= shift >= 0 ? (u32)gc[e] << shift : (u32)gc[e] >> -shift;
            }
            out[k] = word;
        }
        __syncwarp();
    }
}

// Keys and values of one append in one launch: blockIdx.y picks the plane (0 keys, 1
// values), both of the same geometry and codec; `mean_k` (null for none) centres the keys.
extern "C" __global__ void encode_kv_rows(const float* __restrict__ xk,
                                          const float* __restrict__ xv,
                                          u32* __restrict__ codes_k, u32* __restrict__ codes_v,
                                          u32* __restrict__ params_k, u32* __restrict__ params_v,
                                          long blocks, int n, int d, int cap, int slot, int bits,
                                          int group, const float* __restrict__ mean_k,
                                          const int* __restrict__ live, int heads) {
    release_dependents();
    wait_for_prior();
    const bool values = blockIdx.y == 1;
    encode_rows(values ? xv : xk, values ? codes_v : codes_k, values ? params_v : params_k,
                blocks, n, d, cap, slot, bits, group, values ? nullptr : mean_k, live, heads);
}

// Slots [slot, slot + len) of a plane into out (blocks, len, d) f32, one thread per element.
extern "C" __global__ void decode_rows(const u32* __restrict__ codes,
                                       const u32* __restrict__ params, float* __restrict__ out,
                                       long blocks, int len, int d, int cap, int slot, int bits,
                                       int group) {
    const long total = blocks * len * d;
    for (long t = blockIdx.x * (long)blockDim.x + threadIdx.x; t < total;
         t += (long)gridDim.x * blockDim.x) {
        const long row = t / d;
        const int e = (int)(t % d);
        const long block = row / len, i = row % len;
        const long src = block * cap + slot + i;
        if (bits == 0) {
            const u32 w = codes[src * (d / 2) + e / 2];
            out[t] = bf16_to_f32((e & 1) ? (w >> 16) : (w & 0xffff));
            continue;
        }
        const u32* words = codes + src * (d * bits / 32);
        const long bit = (long)e * bits;
        unsigned long long v = words[bit / 32] >> (bit % 32);
        if (bit % 32 + bits > 32) v |= (unsigned long long)words[bit / 32 + 1] << (32 - bit % 32);
        const u32 c = (u32)v & ((1u << bits) - 1);
        const u32 p = params[src * (d / group) + e / group];
        // scale * c + bias, rounded twice as the CPU does (no fused multiply-add).
        out[t] = __fadd_rn(__fmul_rn(f16_to_f32(p & 0xffff), (float)c), f16_to_f32(p >> 16));
    }
}

// The key means tessera-kv's `ChannelPrep::fit` gives an affine layer (centre only), fitted
// where the keys are rather than on the host (which cost a synchronization and a host pass
// over every key of each layer's first chunk). Block b = (row, head) of x, contiguous
// (rows, heads, n, d) f32; thread per channel: its keys at positions [lo[row], hi[row]),
// each rounded to bf16, summed in position order in f32, divided by the count (at least 1).
// The host's operations in the host's order, so the same bits.
#define FIT_ROWS 256
struct FitSpans {
    int lo[FIT_ROWS];
    int hi[FIT_ROWS];
};

extern "C" __global__ void fit_key_means(const float* __restrict__ x, float* __restrict__ means,
                                         FitSpans spans, int heads, int n, int d) {
    const int b = blockIdx.x, row = b / heads;
    const int lo = spans.lo[row], hi = spans.hi[row];
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float sum = 0.f;
        for (int i = lo; i < hi; i++)
            sum = __fadd_rn(sum, bf16_to_f32(f32_to_bf16(x[((long)b * n + i) * d + c])));
        means[(long)b * d + c] = __fdiv_rn(sum, (float)max(hi - lo, 1));
    }
}

// The first `words` words of each of `blocks` blocks, from a stride of `src_stride` to one
// of `dst_stride` (growing a plane's capacity keeps each block's slots in place).
extern "C" __global__ void copy_blocks(const u32* __restrict__ src, u32* __restrict__ dst,
                                       long blocks, long words, long src_stride,
                                       long dst_stride) {
    const long total = blocks * words;
    for (long t = blockIdx.x * (long)blockDim.x + threadIdx.x; t < total;
         t += (long)gridDim.x * blockDim.x) {
        const long b = t / words, w = t % words;
        dst[b * dst_stride + w] = src[b * src_stride + w];
    }
}

// In-place unnormalised Walsh–Hadamard transform of x[0..d), thread i owning element i,
// with the CPU's butterflies (a + b, a - b).
__device__ __forceinline__ void fwht_block(float* x, int d) {
    const int i = threadIdx.x;
    for (int h = 1; h < d; h <<= 1) {
        __syncthreads();
        const float y = (i & h) ? __fsub_rn(x[i - h], x[i]) : __fadd_rn(x[i], x[i + h]);
        __syncthreads();
        x[i] = y;
    }
    __syncthreads();
}

// 1 / √d as the CPU computes it.
__device__ __forceinline__ float inv_sqrt(int d) { return __fdiv_rn(1.f, __fsqrt_rn((float)d)); }

// Turbo planes' keys carry a fitted preparation, per row and KV head (`prep` bit 0: a
// mean subtracted, bit 1: per-channel scales divided out; `mean` and `scale` (blocks, d),
// block-major like the codes: the host passes them from the launch's first block on).

// x (blocks, n, d) f32 into slots [slot, slot + n) of a turbo plane of `cap` slots: per
// vector (a block of d threads, d a power of two ≤ 256) the bf16-rounded input, prepared,
// its norm (summed in order by one thread, as the CPU does), the unit vector rotated
// (signs, transform, 1/√d) and coded against the codebook's ascending `thresholds`
// (`levels - 1` of them): the code is the number of thresholds below the coordinate.
extern "C" __global__ void turbo_encode(const float* __restrict__ x, u32* __restrict__ codes,
                                        u32* __restrict__ norms, long blocks, int n, int d,
                                        int cap, int slot, int bits,
                                        const float* __restrict__ signs,
                                        const float* __restrict__ thresholds, int levels,
                                        int prep, const float* __restrict__ mean,
                                        const float* __restrict__ scale) {
    __shared__ float u[256];
    __shared__ unsigned char c[256];
    __shared__ float norm_sh;
    const int i = threadIdx.x;
    for (long row = blockIdx.x; row < blocks * n; row += gridDim.x) {
        const long block = row / n;
        const long dst = block * cap + slot + row % n;
        float v = bf16_to_f32(f32_to_bf16(x[row * d + i]));
        if (prep & 1) v = __fsub_rn(v, mean[block * d + i]);
        if (prep & 2) v = __fdiv_rn(v, scale[block * d + i]);
        u[i] = v;
        __syncthreads();
        if (i == 0) {
            float sum = 0.f;
            for (int e = 0; e < d; e++) sum = __fadd_rn(sum, __fmul_rn(u[e], u[e]));
            norm_sh = __fsqrt_rn(sum);
        }
        __syncthreads();
        const float norm = norm_sh;
        u[i] = norm > 0.f ? __fdiv_rn(v, norm) * signs[i] : 0.f;
        fwht_block(u, d);
        const float t = __fmul_rn(u[i], inv_sqrt(d));
        int code = 0;
        for (int j = 0; j < levels - 1; j++) code += thresholds[j] < t;
        c[i] = (unsigned char)code;
        if (i == 0) norms[dst] = (u32)f32_to_f16(norm);
        __syncthreads();
        // Word k of the row's stream holds bits [32k, 32k + 32): the codes overlapping it.
        u32* out = codes + dst * (d * bits / 32);
        for (int k = i; k < d * bits / 32; k += blockDim.x) {
            u32 word = 0;
            for (int e = 32 * k / bits; e <= (32 * k + 31) / bits && e < d; e++) {
                const int shift = e * bits - 32 * k; // negative: the code began in word k - 1
                word |= shift >= 0 ? (u32)c[e] << shift : (u32)c[e] >> -shift;
            }
            out[k] = word;
        }
        __syncthreads();
    }
}

// Slots [slot, slot + len) of a turbo plane into out (blocks, len, d) f32, in the original
// space: norm × level per coordinate, rotated back (transform, then signs × 1/√d), and for
// keys (`prep` as for turbo_encode) the scales and mean put back.
extern "C" __global__ void turbo_decode_rows(const u32* __restrict__ codes,
                                             const u32* __restrict__ norms,
                                             float* __restrict__ out, long blocks, int len,
                                             int d, int cap, int slot, int bits,
                                             const float* __restrict__ signs,
                                             const float* __restrict__ levels,
                                             int prep, const float* __restrict__ mean,
                                             const float* __restrict__ scale) {
    __shared__ float x[256];
    const int i = threadIdx.x;
    for (long row = blockIdx.x; row < blocks * len; row += gridDim.x) {
        const long block = row / len;
        const long src = block * cap + slot + row % len;
        const u32* words = codes + src * (d * bits / 32);
        const long bit = (long)i * bits;
        unsigned long long w = words[bit / 32] >> (bit % 32);
        if (bit % 32 + bits > 32) w |= (unsigned long long)words[bit / 32 + 1] << (32 - bit % 32);
        const u32 code = (u32)w & ((1u << bits) - 1);
        x[i] = __fmul_rn(f16_to_f32(norms[src] & 0xffff), levels[code]);
        fwht_block(x, d);
        float v = __fmul_rn(x[i], __fmul_rn(signs[i], inv_sqrt(d)));
        if (prep & 2) v = __fmul_rn(v, scale[block * d + i]);
        if (prep & 1) v = __fadd_rn(v, mean[block * d + i]);
        out[row * d + i] = v;
        __syncthreads();
    }
}
