#!/usr/bin/env python3
"""Prompt caches side by side (BENCHMARKS.md "Prompt caches"): one ~4k-token document from
the corpus, cached once and reused with a short question after it.

- tessera: `tessera cache save` per KV scheme (file size, save time), then `tessera bench
  --prompt-cache` (time to first token: load + prefill of the question, against a cold
  prefill of all the same tokens, in one process; load GB/s from the warm page cache).
- tessera serve --prompt-cache-dir: the document plus a question in one process, then a
  restart and the document plus another question (time to first token of the new
  process's first request, which reuses the row the first process left on disk).
- llama-server (`--slot-save-path`, one slot): the document prefilled cold (time to first
  token measured by the client), the slot saved (file size, save_ms), erased and restored
  (restore_ms), then the document plus the question (time to first token, and how many
  prompt tokens it had to read), for f16 and q8_0 / q4_0 caches (flash attention on), with
  and without --swa-full.

Usage: python3 bench/prompt_cache.py [--chars 17300] [--suffix-tokens 16]
Env: TESSERA, LLAMA_SERVER, MODEL, CORPUS as in bench/serve-load.sh.
"""

import argparse
import json
import os
import subprocess
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESSERA = os.environ.get("TESSERA", os.path.join(ROOT, "target/release/tessera"))
LLAMA_SERVER = os.environ.get(
    "LLAMA_SERVER",
    "/root/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server",
)
MODEL = os.environ.get(
    "MODEL", os.path.expanduser("~/.cache/tessera/models/gemma-3-270m-q4_k_m.gguf")
)
CORPUS = os.environ.get(
    "CORPUS", os.path.join(ROOT, "../shared/corpus/sense-and-sensibility.txt")
)
PORT = int(os.environ.get("PORT", "18090"))
QUESTION = "\n\nQuestion: who is the eldest of the sisters, and what is her chief quality?\nAnswer:"


def run(args):
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{args[:3]} failed: {out.stderr.strip()}")
    return out


def post(path, body, timeout=600):
    req = urllib.request.Request(
        f"http://127.0.0.1:{PORT}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        v = json.loads(r.read())
    return v, time.perf_counter() - t


def wait_up():
    for _ in range(480):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1)
            return
        except Exception:
            time.sleep(0.25)
    raise SystemExit("llama-server did not come up")


def tessera(doc, tmp, suffix, schemes):
    rows = []
    for kv in schemes:
        out = os.path.join(tmp, kv.replace(":", "_") + ".tpc")
        t = time.perf_counter()
        run([TESSERA, "cache", "save", "--model", MODEL, "--prompt-file", doc, "--out", out, "--kv", kv])
        save_s = time.perf_counter() - t
        b = json.loads(
            run([TESSERA, "bench", "--model", MODEL, "--prompt-cache", out, "--suffix-tokens", str(suffix), "--repeat", "3", "--json"]).stdout
        )
        rows.append((kv, b, save_s))
        print(
            f"tessera {kv:<9} file {b['file_bytes'] / 2**20:7.2f} MiB | prompt {b['prompt_tokens']} tokens, "
            f"{b['reused_tokens']} cached | TTFT cached {b['ttft_cached_s'] * 1e3:7.1f} ms "
            f"(load {b['load_s'] * 1e3:.1f} ms, {b['load_gb_s']:.2f} GB/s) | cold {b['ttft_cold_s'] * 1e3:7.1f} ms "
            f"| {b['speedup']:.1f}x | first token agrees: {b['first_token_agrees']} "
            f"| save (whole command, with model load and prefill) {save_s:.1f} s",
            flush=True,
        )
    base = rows[0][1]["file_bytes"]
    for kv, b, _ in rows:
        print(f"tessera {kv:<9} file size {b['file_bytes'] / base:.3f}x of {rows[0][0]}")


def llama(doc_text, tmp, kinds):
    for kind in kinds:
        ctk, _, flag = kind.partition("+")
        slots = os.path.join(tmp, "slots-" + kind)
        os.makedirs(slots, exist_ok=True)
        args = [LLAMA_SERVER, "-m", MODEL, "-t", "2", "-np", "1", "-c", "8192", "--port", str(PORT),
                "--slot-save-path", slots, "-ctk", ctk, "-ctv", ctk, "-fa", "on"]
        if flag:
            args.append("--" + flag)
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_up()
            body = {"prompt": doc_text, "n_predict": 1, "cache_prompt": True, "temperature": 0}
            cold, cold_s = post("/completion", body)
            saved, _ = post("/slots/0?action=save", {"filename": "doc.bin"})
            size = os.path.getsize(os.path.join(slots, "doc.bin"))
            post("/slots/0?action=erase", {})
            restored, restore_wall = post("/slots/0?action=restore", {"filename": "doc.bin"})
            warm, warm_s = post("/completion", {**body, "prompt": doc_text + QUESTION})
            print(
                f"llama-server {kind:<14} file {size / 2**20:7.2f} MiB | prompt {cold['timings']['prompt_n']} tokens cold "
                f"TTFT {cold_s * 1e3:7.1f} ms | save {saved['timings']['save_ms']:.1f} ms | restore "
                f"{restored['timings']['restore_ms']:.1f} ms ({size / (restored['timings']['restore_ms'] / 1e3) / 1e9:.2f} GB/s) "
                f"| doc + question: {warm['timings']['prompt_n']} tokens read, TTFT (after restore) {warm_s * 1e3:7.1f} ms, "
                f"restore + TTFT {(restore_wall + warm_s) * 1e3:7.1f} ms",
                flush=True,
            )
        finally:
            proc.terminate()
            proc.wait()


def serve_restart(doc_text, tmp, kv):
    """tessera serve --prompt-cache-dir: the document plus one question (cold), a restart,
    then the document plus another question: the first request of the new process."""
    store = os.path.join(tmp, "store-" + kv.replace(":", "_"))
    os.makedirs(store, exist_ok=True)
    out = []
    for q in ["\n\nQuestion: who is the eldest sister?\nAnswer:", "\n\nQuestion: where do they live?\nAnswer:"]:
        proc = subprocess.Popen(
            [TESSERA, "serve", "--model", MODEL, "--port", str(PORT), "--kv", kv,
             "--prefix-cache", "256", "--prompt-cache-dir", store],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_up()
            v, secs = post("/v1/completions", {"prompt": doc_text + q, "max_tokens": 1, "temperature": 0})
            out.append((secs, v["usage"]["prompt_tokens"], v["usage"]["prompt_tokens_details"]["cached_tokens"]))
        finally:
            proc.terminate()
            proc.wait()
    files = [f for f in os.listdir(store) if f.endswith(".tpc")]
    size = sum(os.path.getsize(os.path.join(store, f)) for f in files)
    (cold, n0, c0), (warm, n1, c1) = out
    print(
        f"tessera serve {kv:<9} --prompt-cache-dir: first process {n0} prompt tokens, {c0} cached, "
        f"TTFT {cold * 1e3:7.1f} ms | after a restart {n1} prompt tokens, {c1} cached, TTFT {warm * 1e3:7.1f} ms "
        f"| {len(files)} file(s), {size / 2**20:.2f} MiB on disk",
        flush=True,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--chars", type=int, default=17300)
    p.add_argument("--at", type=int, default=20000)
    p.add_argument("--suffix-tokens", type=int, default=16)
    p.add_argument("--schemes", default="bf16,affine:4,turbo:4")
    p.add_argument("--serve-schemes", default="bf16,affine:4")
    # `+swa-full`: a full-size cache for the sliding layers too, which llama.cpp needs to
    # reuse a prefix on Gemma 3 (without it the restored slot is read again in full).
    p.add_argument("--llama-kinds", default="f16,f16+swa-full,q8_0+swa-full,q4_0+swa-full")
    a = p.parse_args()
    text = open(CORPUS, encoding="utf-8").read()[a.at : a.at + a.chars]
    with tempfile.TemporaryDirectory() as tmp:
        doc = os.path.join(tmp, "doc.txt")
        with open(doc, "w", encoding="utf-8") as f:
            f.write(text)
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
        print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {name} nproc={os.cpu_count()} model={os.path.basename(MODEL)}")
        tessera(doc, tmp, a.suffix_tokens, a.schemes.split(","))
        for kv in a.serve_schemes.split(",") if a.serve_schemes else []:
            serve_restart(text, tmp, kv)
        if a.llama_kinds:
            llama(text, tmp, a.llama_kinds.split(","))


if __name__ == "__main__":
    main()
