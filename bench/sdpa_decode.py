"""torch's scaled_dot_product_attention on bf16, decode shapes (one query row per
sequence), timed the way kv-read-bench times our read: median of 30 CUDA-event-timed calls
after 3 warm-ups, rotating over copies of the cache while one is small enough to sit in L2.
Run in the same device call as `kv-read-bench time`; prints one line per case."""
import torch
import torch.nn.functional as F


def median_us(fn, reps=30):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    return times[reps // 2]


def main():
    torch.manual_seed(0)
    dev = "cuda"
    print(f"{'sdpa bf16':<14} {'shape':>12} {'batch':>5} {'tokens':>7} {'µs':>10} {'GB/s':>8}")
    for qh, kvh, d in [(4, 1, 256), (32, 8, 128), (64, 8, 128)]:
        for b in [1, 16]:
            for n in [4096, 32768, 131072]:
                one = 2 * b * kvh * n * d * 2
                copies = max(1, min(8, 256_000_000 // one))
                kv = [
                    (
                        torch.randn(b, kvh, n, d, device=dev, dtype=torch.bfloat16),
                        torch.randn(b, kvh, n, d, device=dev, dtype=torch.bfloat16),
                    )
                    for _ in range(copies)
                ]
                q = torch.randn(b, qh, 1, d, device=dev, dtype=torch.bfloat16)
                i = [0]

                def run():
                    i[0] += 1
                    k, v = kv[i[0] % copies]
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

                us = median_us(run)
                print(f"{'sdpa bf16':<14} {f'({qh},{kvh},{d})':>12} {b:>5} {n:>7} {us:>10.1f} {one / us / 1e3:>8.0f}")
                del kv
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
