// Quantized weight matrices on the device: the decode step's matvecs and the dequantization
// that feeds prefill's bf16 GEMMs (see weights.rs).
//
// Q4_0 layout, for a matrix of n rows × k columns, k a multiple of 1024: each row is split
// into tiles of 1024 weights (32 of the file's 32-weight blocks), and a tile into 32 lanes'
// 16 bytes. At step q (0..7) lane L holds the four weights at columns q·128 + 4L .. +3 of
// the tile: block 4q + L/8 of the tile, positions 4(L%8) .. +3. So a warp reading step q's
// inputs reads 128 consecutive floats (one coalesced 512-byte load), and a lane's 32 weights
// come from 8 blocks. Lane L's 16 bytes: word t holds steps 2t (low nibbles) and 2t + 1
// (high nibbles), byte e of the word the step's weight e.
//   codes  n × k/2 bytes, row-major, tile by tile, lane by lane;
//   scales n × k/32 f16, row-major; within a tile, scale a·8 + q is block 4q + a, so a
//          lane's eight scales (a = L/8) are one 16-byte load shared by eight lanes.
// weights.rs's `q4_0_planes` writes this layout from the file's blocks.
// No CUDA headers: f16 and bf16 are converted by hand, so NVRTC needs no include path.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define WARPS 4
#define TILE 1024

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Byte `i` of `w` (a nibble, 0..15) minus 8, as a float: the byte goes into the mantissa of
// 2^23 (one byte permute), and one subtraction takes 2^23 + 8 off, exactly.
#define NIB(w, i) (__int_as_float(__byte_perm((w), 0x4B000000, 0x7440 + (i))) - 8388616.0f)

__device__ __forceinline__ u32 word_of(const uint4& c, int t) {
    return t == 0 ? c.x : t == 1 ? c.y : t == 2 ? c.z : c.w;
}

// y[m][j] = Σ_e W[j][e] · x[m][e] for M input rows. A block computes R output rows; its
// warps split the rows' tiles (warp w takes tiles w, w + WARPS, …), each lane keeps f32
// partial sums, reduced across the warp and then across warps through shared memory.
// Grid: ceil(n / R) blocks of 32 · WARPS threads.
template <int M, int R>
__device__ void q4_0_matvec(const u8* __restrict__ codes, const u16* __restrict__ scales,
                            const float* __restrict__ x, float* __restrict__ y, int n, int k) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = blockIdx.x * R;
    const int tiles = k / TILE;
    const uint4* rows[R];
    const uint4* row_scales[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int row = min(row0 + r, n - 1); // a ragged last block reads its last row again
        rows[r] = (const uint4*)(codes + (size_t)row * (k >> 1)) + lane;
        row_scales[r] = (const uint4*)(scales + (size_t)row * (k >> 5)) + (lane >> 3);
    }
    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[m][r] = 0.0f;
    for (int t = warp; t < tiles; t += WARPS) {
        uint4 c[R], d16[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            c[r] = __ldg(rows[r] + t * 32);
            d16[r] = __ldg(row_scales[r] + t * 4);
        }
        const float* xt = x + t * TILE + 4 * lane;
#pragma unroll
        for (int q = 0; q < 8; q++) {
            float4 xv[M];
#pragma unroll
            for (int m = 0; m < M; m++) xv[m] = __ldg((const float4*)(xt + (size_t)m * k + q * 128));
#pragma unroll
            for (int r = 0; r < R; r++) {
                const u32 cw = word_of(c[r], q >> 1);
                const u32 w = (q & 1) ? (cw >> 4) & 0x0F0F0F0Fu : cw & 0x0F0F0F0Fu;
                const u32 dw = word_of(d16[r], q >> 1);
                const float d = f16_to_f32((u16)((q & 1) ? dw >> 16 : dw & 0xFFFF));
                const float w0 = NIB(w, 0), w1 = NIB(w, 1), w2 = NIB(w, 2), w3 = NIB(w, 3);
#pragma unroll
                for (int m = 0; m < M; m++) {
                    float s = w0 * xv[m].x;
                    s = fmaf(w1, xv[m].y, s);
                    s = fmaf(w2, xv[m].z, s);
                    s = fmaf(w3, xv[m].w, s);
                    acc[m][r] = fmaf(s, d, acc[m][r]);
                }
            }
        }
    }
    __shared__ float part[WARPS][M * R];
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int r = 0; r < R; r++) {
            float v = acc[m][r];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) part[warp][m * R + r] = v;
        }
    __syncthreads();
    for (int i = threadIdx.x; i < M * R; i += blockDim.x) {
        const int m = i / R, row = row0 + i % R;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) v += part[w][i];
        if (row < n) y[(size_t)m * n + row] = v;
    }
}

// Rows per block for M inputs (weights.rs's `rows_per_block` repeats it).
#define ROWS_PER_BLOCK(M) ((M) <= 2 ? 4 : 2)
#define MATVEC(M)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) q4_0_matvec_##M(               \
        const u8* codes, const u16* scales, const float* x, float* y, int n, int k) {      \
        q4_0_matvec<M, ROWS_PER_BLOCK(M)>(codes, scales, x, y, n, k);                      \
    }
MATVEC(1)
MATVEC(2)
MATVEC(3)
MATVEC(4)
MATVEC(5)
MATVEC(6)
MATVEC(7)
MATVEC(8)

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// W as bf16 (n × k, row-major) for a prefill GEMM: one thread per lane of a tile (32
// weights: eight steps of four). (code − 8) · scale is exact in f32 and rounds once to bf16.
extern "C" __global__ void q4_0_to_bf16(const u8* __restrict__ codes,
                                        const u16* __restrict__ scales, u16* __restrict__ w,
                                        long long lanes) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < lanes;
         i += (long long)gridDim.x * blockDim.x) {
        // Lane i is lane L = i % 32 of tile i / 32 (tiles of all rows in order).
        const long long tile = i >> 5;
        const int lane = (int)(i & 31);
        const uint4 c = __ldg((const uint4*)codes + i);
        const uint4 d16 = __ldg((const uint4*)scales + tile * 4 + (lane >> 3));
        u16* out = w + tile * TILE + 4 * lane;
#pragma unroll
        for (int q = 0; q < 8; q++) {
            const u32 cw = word_of(c, q >> 1);
            const u32 v = (q & 1) ? (cw >> 4) & 0x0F0F0F0Fu : cw & 0x0F0F0F0Fu;
            const u32 dw = word_of(d16, q >> 1);
            const float d = f16_to_f32((u16)((q & 1) ? dw >> 16 : dw & 0xFFFF));
            const u32 lo = f32_to_bf16(NIB(v, 0) * d) | ((u32)f32_to_bf16(NIB(v, 1) * d) << 16);
            const u32 hi = f32_to_bf16(NIB(v, 2) * d) | ((u32)f32_to_bf16(NIB(v, 3) * d) << 16);
            *(uint2*)(out + q * 128) = make_uint2(lo, hi);
        }
    }
}
