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
// snaps exactly; codes round half away from zero. Geometry is passed at run time: these
// kernels run once per append, far from the decode read's cost.

typedef unsigned int u32;
typedef unsigned short u16;

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

// x (blocks, n, d) f32 into slots [slot, slot + n) of a plane of `cap` slots. bits == 0:
// bf16, one thread per word; otherwise affine, one thread per group.
extern "C" __global__ void encode_rows(const float* __restrict__ x, u32* __restrict__ codes,
                                       u32* __restrict__ params, long blocks, int n, int d,
                                       int cap, int slot, int bits, int group) {
    const int per_row = bits == 0 ? d / 2 : d / group;
    const long total = blocks * n * per_row;
    for (long t = blockIdx.x * (long)blockDim.x + threadIdx.x; t < total;
         t += (long)gridDim.x * blockDim.x) {
        const long row = t / per_row;            // block * n + i
        const int j = (int)(t % per_row);        // word (bf16) or group (affine)
        const long block = row / n, i = row % n;
        const long dst = block * cap + slot + i; // stored row
        const float* src = x + row * d;
        if (bits == 0) {
            codes[dst * (d / 2) + j] =
                (u32)f32_to_bf16(src[2 * j]) | ((u32)f32_to_bf16(src[2 * j + 1]) << 16);
            continue;
        }
        const float n_bins = (float)((1u << bits) - 1);
        const float* w = src + j * group;
        float w_min = 3.402823466e38f, w_max = 0.f;
        for (int e = 0; e < group; e++) {
            const float v = bf16_to_f32(f32_to_bf16(w[e]));
            w_min = fminf(w_min, v);
            w_max = fmaxf(w_max, v);
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
        params[dst * (d / group) + j] = (u32)f32_to_f16(scale) | ((u32)f32_to_f16(bias) << 16);
        // The group's words: group * bits / 32 of them, whole.
        u32* out = codes + dst * (d * bits / 32) + j * (group * bits / 32);
        u32 word = 0;
        int filled = 0, k = 0;
        for (int e = 0; e < group; e++) {
            const float v = bf16_to_f32(f32_to_bf16(w[e]));
            const u32 c = (u32)fminf(fmaxf(roundf((v - bias) / scale), 0.f), n_bins);
            word |= c << filled;
            filled += bits;
            if (filled >= 32) {
                out[k++] = word;
                filled -= 32;
                word = filled > 0 ? c >> (bits - filled) : 0;
            }
        }
    }
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
