#!/usr/bin/env python3
"""A load run against any OpenAI-compatible server, with the official `openai` client under
asyncio: N concurrent streaming completions of fresh prompts (distinct text per request, so
no server can reuse another's prefix), greedy unless --temperature, fixed output length. Prints output tokens/s,
time to first token and inter-token latency (p50/p99) as one JSON line per concurrency.

    python3 bench/load.py --base-url http://127.0.0.1:8080/v1 --corpus TEXT --concurrency 1 4 16 \
        --requests 16 --prompt-words 300 --max-tokens 64
"""
import argparse, asyncio, json, random, statistics, time, urllib.request

from openai import AsyncOpenAI


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def one(client, model, prompt, max_tokens, temperature):
    t0 = time.perf_counter()
    first, stamps, n = None, [], 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, stream=True,
        stream_options={"include_usage": True})
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].text:
            now = time.perf_counter()
            if first is None:
                first = now - t0
            stamps.append(now)
    tokens = usage.completion_tokens if usage else len(stamps)
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return first, itl, tokens, time.perf_counter() - t0


def scrape(metrics_url):
    """Every unlabelled sample of a Prometheus /metrics page ({} if unreadable)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as r:
            samples = {}
            for line in r.read().decode().splitlines():
                name, _, value = line.partition(" ")
                if line and not line.startswith("#") and "{" not in name:
                    samples[name] = float(value)
            return samples
    except (OSError, ValueError):
        return {}


def running_rows(metrics_url):
    """tessera_requests_running from a Prometheus /metrics page (None if unreadable)."""
    return scrape(metrics_url).get("tessera_requests_running")


def engine_figures(before, after, wall):
    """What tessera's own counters say of the run: its mean decode step and rows a step, its
    mean inter-token latency, and the share of the wall time the engine spent in prefill,
    decode and row moves (the rest: its bookkeeping, HTTP and idle). Empty for another
    server."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    steps = d.get("tessera_decode_steps_total", 0)
    itl = d.get("tessera_inter_token_latency_seconds_count", 0)
    if not steps:
        return {}
    busy = sum(d.get(k, 0.0) for k in ("tessera_decode_seconds_total",
               "tessera_prefill_seconds_total", "tessera_row_moves_seconds_total"))
    return {"engine_step_ms": 1e3 * d["tessera_decode_seconds_total"] / steps,
            "engine_rows_mean": d.get("tessera_decode_row_steps_total", 0) / steps,
            "engine_itl_mean_ms": 1e3 * d["tessera_inter_token_latency_seconds_sum"] / itl
            if itl else None,
            "engine_busy": busy / wall}


async def sample_rows(metrics_url, seen, stop):
    """Polls the running-row gauge every 0.25 s until `stop` is set."""
    while not stop.is_set():
        n = await asyncio.to_thread(running_rows, metrics_url)
        if n is not None:
            seen.append(n)
        await asyncio.sleep(0.25)


async def run(args, concurrency, words):
    client = AsyncOpenAI(base_url=args.base_url, api_key="none", timeout=3600)
    rng = random.Random(concurrency)
    prompts = []
    for _ in range(args.requests):
        at = rng.randrange(0, len(words) - args.prompt_words)
        prompts.append(" ".join(words[at:at + args.prompt_words]))
    sem = asyncio.Semaphore(concurrency)

    async def guarded(p):
        async with sem:
            return await one(client, args.model, p, args.max_tokens, args.temperature)

    rows, stop = [], asyncio.Event()
    before = scrape(args.metrics_url) if args.metrics_url else {}
    sampler = args.metrics_url and asyncio.create_task(sample_rows(args.metrics_url, rows, stop))
    t0 = time.perf_counter()
    results = await asyncio.gather(*(guarded(p) for p in prompts))
    wall = time.perf_counter() - t0
    if sampler:
        stop.set()
        await sampler
    engine = engine_figures(before, scrape(args.metrics_url), wall) if args.metrics_url else {}
    ttft = [r[0] for r in results if r[0] is not None]
    itl = [x for r in results for x in r[1]]
    out = sum(r[2] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "temperature": args.temperature,
            "output_tok_s": out / wall,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "wall_s": wall,
            # Per request: its stream's speed, tokens after the first over first to last.
            "per_request_tok_s": statistics.mean(
                (r[2] - 1) / (r[3] - r[0]) for r in results if r[0] is not None and r[3] > r[0]),
            "rows_max": max(rows) if rows else None, **engine}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default="default")
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; above it the sampler runs (as most clients' default of 1)")
    ap.add_argument("--label", default="")
    ap.add_argument("--metrics-url", default="",
                    help="tessera's /metrics: sample how many rows decode together")
    args = ap.parse_args()
    words = open(args.corpus, encoding="utf-8").read().split()
    for c in args.concurrency:
        r = asyncio.run(run(args, c, words))
        r["label"] = args.label
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
