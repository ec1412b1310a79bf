#!/usr/bin/env python3
"""A bounded soak of an OpenAI-compatible server with the official `openai` client: C
concurrent streaming completions for M minutes, fresh prompts of random lengths, random
output lengths, and a share of clients that disconnect mid-stream. Checks every finished
stream: usage.prompt_tokens equals the prompt's token count as sent (token-id prompts, so
the count is known), usage.completion_tokens equals the streamed tokens (logprobs give one
entry per token) and, where the finish reason is `length`, max_tokens; any other exception
is an error. Samples the server's RSS (from /proc) every 5 s. Prints one JSON summary.

    python3 bench/soak.py --base-url http://127.0.0.1:8080/v1 --pid PID --minutes 10 \
        --concurrency 64 --disconnect 0.2
"""
import argparse, asyncio, json, random, time

from openai import AsyncOpenAI


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


async def worker(client, args, rng, stats, deadline):
    while time.monotonic() < deadline:
        # Token ids 1000..20000: ordinary vocabulary entries of either model family.
        prompt = [rng.randrange(1000, 20000) for _ in range(rng.randrange(8, 300))]
        max_tokens = rng.randrange(4, 80)
        leave_after = rng.randrange(1, max_tokens + 1) if rng.random() < args.disconnect else None
        try:
            stream = await client.completions.create(
                model="default", prompt=prompt, max_tokens=max_tokens, temperature=0,
                stream=True, logprobs=0, stream_options={"include_usage": True})
            tokens, finish, usage = 0, None, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    if c.logprobs is not None and c.logprobs.tokens:
                        tokens += len(c.logprobs.tokens)
                    if c.finish_reason:
                        finish = c.finish_reason
                if leave_after is not None and tokens >= leave_after:
                    await stream.close()
                    break
            if leave_after is not None and tokens >= leave_after:
                stats["disconnected"] += 1
                continue
            problems = []
            if usage is None:
                problems.append("no usage chunk")
            else:
                if usage.prompt_tokens != len(prompt):
                    problems.append(f"prompt_tokens {usage.prompt_tokens} != {len(prompt)}")
                if usage.completion_tokens != tokens:
                    problems.append(f"completion_tokens {usage.completion_tokens} != streamed {tokens}")
            if finish == "length" and tokens != max_tokens:
                problems.append(f"finish length after {tokens} of {max_tokens}")
            if finish not in ("length", "stop"):
                problems.append(f"finish_reason {finish}")
            if problems:
                stats["mismatched"] += 1
                stats["examples"].append(problems)
            else:
                stats["completed"] += 1
                stats["tokens"] += tokens
        except Exception as e:  # noqa: BLE001 - any failure is what a soak counts
            stats["errors"] += 1
            stats["examples"].append(repr(e)[:200])


async def sample_rss(pid, rss, deadline):
    start = time.monotonic()
    while time.monotonic() < deadline:
        rss.append((round(time.monotonic() - start), rss_kib(pid)))
        await asyncio.sleep(5)


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--disconnect", type=float, default=0.2)
    ap.add_argument("--warmup-minutes", type=float, default=2)
    args = ap.parse_args()
    client = AsyncOpenAI(base_url=args.base_url, api_key="none", timeout=600, max_retries=0)
    deadline = time.monotonic() + args.minutes * 60
    stats = {"completed": 0, "disconnected": 0, "mismatched": 0, "errors": 0, "tokens": 0,
             "examples": []}
    rss = []
    t0 = time.monotonic()
    await asyncio.gather(sample_rss(args.pid, rss, deadline),
                         *(worker(client, args, random.Random(i), stats, deadline)
                           for i in range(args.concurrency)))
    after = [kib for t, kib in rss if t >= args.warmup_minutes * 60 and kib]
    stats["examples"] = stats["examples"][:10]
    stats.update({
        "wall_s": round(time.monotonic() - t0),
        "output_tok_s": stats["tokens"] / (time.monotonic() - t0),
        "rss_mib_after_warmup_min": min(after) / 1024 if after else None,
        "rss_mib_after_warmup_max": max(after) / 1024 if after else None,
        "rss_mib_samples": [(t, round(k / 1024)) for t, k in rss[::6]],
    })
    print(json.dumps(stats))


if __name__ == "__main__":
    asyncio.run(main())
