#!/usr/bin/env python3
"""Sums Nsight Compute's per-kernel durations (bench/device-run.sh ncustep's CSV) per forward
pass: a forward ends at its sampling kernel (`fast_argmax_f32`). Prints each forward's kernel
count and GPU time, then the decode forwards' median, and the kernels that take most of one.

    python3 bench/ncu_steps.py ncu-affine4.csv [--decode-from N] [--top-of N] [--split-at KERNEL]
"""
import csv, statistics, sys
from collections import defaultdict


def main():
    path = sys.argv[1]
    first_decode = int(sys.argv[sys.argv.index("--decode-from") + 1]) if "--decode-from" in sys.argv else 2
    lines = [l for l in open(path) if not l.startswith("==")]
    rows = list(csv.reader(lines))
    hdr = rows[0]
    name, metric, value = hdr.index("Kernel Name"), hdr.index("Metric Name"), hdr.index("Metric Value")
    kernels = [(r[name], float(r[value].replace(",", "")) / 1e6) for r in rows[1:]
               if len(r) == len(hdr) and r[metric] == "gpu__time_duration.sum"]
    # --split-at NAME: a forward starts at kernel NAME (the embedding lookup, say, for
    # prefill chunks, which end in no sampling kernel); by default it ends at the argmax.
    split_at = sys.argv[sys.argv.index("--split-at") + 1] if "--split-at" in sys.argv else None
    forwards, cur = [], []
    for k in kernels:
        if split_at is not None and k[0] == split_at and cur:
            forwards.append(cur)
            cur = []
        cur.append(k)
        if split_at is None and k[0] == "fast_argmax_f32":
            forwards.append(cur)
            cur = []
    for i, f in enumerate(forwards):
        print(f"forward {i}: {len(f)} kernels, {sum(v for _, v in f):.3f} ms on the GPU")
    decode = forwards[first_decode:]
    if not decode:
        return
    times = [sum(v for _, v in f) for f in decode]
    print(f"decode forwards {len(decode)}: median {statistics.median(times):.3f} ms, "
          f"{statistics.median(len(f) for f in decode):.0f} kernels")
    # --top-of N: the kernels of forward N (a prefill chunk, say) rather than the middle decode one.
    shown = forwards[int(sys.argv[sys.argv.index("--top-of") + 1])] if "--top-of" in sys.argv \
        else decode[len(decode) // 2]
    per = defaultdict(lambda: [0, 0.0])
    for name_, v in shown:
        per[name_][0] += 1
        per[name_][1] += v
    for name_, (n, t) in sorted(per.items(), key=lambda x: -x[1][1])[:16]:
        print(f"  {t:7.3f} ms  {n:4d}×  {name_}")


if __name__ == "__main__":
    main()
