// A decode step's greedy tokens on the device (greedy.rs): each row's argmax of its logits,
// the rule of tessera-engine's `sampler::argmax` (the first index of the largest value, as a
// scan that keeps the first strictly greater value finds it: a NaN never wins, and a row
// that starts with one gives 0). One block a row would take ~0.1 ms at a 128k vocabulary,
// so the rows are cut into CHUNKS chunks reduced in parallel, then one block a row reduces
// the chunks' winners. No CUDA headers (NVRTC needs no include path).

#define CHUNKS 128
#define THREADS 256

typedef unsigned int u32;

// Of two candidates (value, index), the one the scan keeps: the greater value, on a tie the
// lower index. An index of -1 is no candidate (an empty range, or only NaNs).
__device__ __forceinline__ void keep_better(float& v, int& i, float ov, int oi) {
    if (oi < 0) return;
    if (i < 0 || ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// Reduces the block's candidates into thread 0's.
__device__ __forceinline__ void block_best(float& v, int& i) {
    __shared__ float vs[THREADS / 32];
    __shared__ int is[THREADS / 32];
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, v, off);
        const int oi = __shfl_down_sync(0xffffffffu, i, off);
        keep_better(v, i, ov, oi);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        vs[warp] = v;
        is[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < THREADS / 32 ? vs[lane] : 0.0f;
        i = lane < THREADS / 32 ? is[lane] : -1;
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_down_sync(0xffffffffu, v, off);
            const int oi = __shfl_down_sync(0xffffffffu, i, off);
            keep_better(v, i, ov, oi);
        }
    }
}

// Grid (CHUNKS, rows): chunk c of row r (vocab / CHUNKS rounded up) into best[r][c], at[r][c].
extern "C" __global__ void __launch_bounds__(THREADS)
    greedy_chunks(const float* __restrict__ logits, float* __restrict__ best,
                  int* __restrict__ at, int vocab) {
    const int r = blockIdx.y, c = blockIdx.x;
    const int width = (vocab + CHUNKS - 1) / CHUNKS;
    const int from = c * width, to = min(vocab, from + width);
    const float* row = logits + (size_t)r * vocab;
    float v = 0.0f;
    int i = -1;
    for (int j = from + threadIdx.x; j < to; j += THREADS) {
        const float x = row[j];
        if (x == x) keep_better(v, i, x, j); // NaN never a candidate
    }
    block_best(v, i);
    if (threadIdx.x == 0) {
        best[r * CHUNKS + c] = v;
        at[r * CHUNKS + c] = i;
    }
}

// Grid (rows): row r's chunks into its token (0 where the row starts with a NaN or holds
// nothing but NaNs, as the scan gives).
extern "C" __global__ void __launch_bounds__(THREADS)
    greedy_rows(const float* __restrict__ logits, const float* __restrict__ best,
                const int* __restrict__ at, u32* __restrict__ ids, int vocab) {
    const int r = blockIdx.x;
    float v = 0.0f;
    int i = -1;
    for (int c = threadIdx.x; c < CHUNKS; c += THREADS)
        keep_better(v, i, best[r * CHUNKS + c], at[r * CHUNKS + c]);
    block_best(v, i);
    if (threadIdx.x == 0) {
        const float first = logits[(size_t)r * vocab];
        ids[r] = (first != first || i < 0) ? 0u : (u32)i;
    }
}
