"""vLLM's `benchmark_serving` against a `jaxsched serve` server: streaming clients, TTFT/TPOT/ITL.

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 64
    python benchmarks/serving.py --suite            # starts a server per cache size, saves results

N requests arrive as a Poisson process (`--request-rate` per second; `inf`: all at once, a
burst), each a streaming `/v1/completions` call with `ignore_eos` so it makes exactly its
output length. Prompts are token ids: random lengths (`--random-input-len`,
`--random-output-len`, `--random-range-ratio`, as vLLM's random dataset) or a jaxsched trace's
`prompt_len` / `max_tokens` (`--trace`). Measured as vLLM does:

  TTFT  arrival of the request to its first streamed token
  TPOT  (latency - TTFT) / (output tokens - 1), per request
  ITL   the gaps between a request's streamed chunks, all requests pooled
  goodput  completed requests per second meeting every `--goodput ttft:MS tpot:MS` limit

`--suite` starts `jaxsched serve` (SmolLM2-135M, loopback) three times: a roomy KV cache, and a
cache small enough to preempt, by recompute and by swap; preemptions come from the server's
`/metrics`. Results: benchmarks/results/serving.{json,md}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

from _common import save_results
from jaxsched.entrypoints.openai_server import wait_until_healthy

SUITE_ENGINE = ["--block-size", "16", "--max-num-seqs", "16", "--num-slots", "32",
                "--max-num-batched-tokens", "128", "--max-model-len", "512"]
SUITE = {
    "roomy": ["--num-device-blocks", "256", "--num-host-blocks", "256"],
    "small/recompute": ["--num-device-blocks", "24", "--num-host-blocks", "256",
                        "--preemption-mode", "recompute"],
    "small/swap": ["--num-device-blocks", "24", "--num-host-blocks", "256", "--preemption-mode", "swap"],
}


def make_requests(args, rng) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request."""
    if args.trace:
        reqs = json.load(open(args.trace))["requests"][:args.num_prompts]
        lens = [(r["prompt_len"], r["max_tokens"]) for r in reqs]
    else:
        lo = lambda n: max(1, int(n * args.random_range_ratio))
        lens = [(int(rng.integers(lo(args.random_input_len), args.random_input_len + 1)),
                 int(rng.integers(lo(args.random_output_len), args.random_output_len + 1)))
                for _ in range(args.num_prompts)]
    # Token ids from the middle of the vocabulary: ordinary text tokens, no specials.
    return [(rng.integers(1000, 20000, size=p).tolist(), o) for p, o in lens]


async def one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, last, itl, tokens = None, start, [], 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        return {"ok": False, "error": repr(e)}
    latency = time.perf_counter() - start
    return {"ok": ttft is not None, "ttft": ttft, "latency": latency, "itl": itl, "tokens": tokens,
            "prompt_len": len(prompt),
            "tpot": (latency - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None}


async def run(base_url: str, model: str, requests, rate: float, seed: int, api_key=None) -> tuple[list, float]:
    rng = np.random.default_rng(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(requests) + 8)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=1800, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for prompt, out_len in requests:
            tasks.append(asyncio.create_task(one(client, model, prompt, out_len)))
            if rate != float("inf"):
                await asyncio.sleep(float(rng.exponential(1.0 / rate)))      # Poisson arrivals
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results, duration: float, goodput: dict) -> dict:
    ok = [r for r in results if r["ok"]]
    ms = lambda xs: {"mean": round(1e3 * float(np.mean(xs)), 1), "median": round(1e3 * float(np.median(xs)), 1),
                     "p99": round(1e3 * float(np.percentile(xs, 99)), 1)} if len(xs) else None
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    good = [r for r in ok if ("ttft" not in goodput or r["ttft"] * 1e3 <= goodput["ttft"])
            and ("tpot" not in goodput or (r["tpot"] or 0) * 1e3 <= goodput["tpot"])]
    out_tokens = sum(r["tokens"] for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(duration, 2),
            "total_input_tokens": sum(r["prompt_len"] for r in ok), "total_output_tokens": out_tokens,
            "request_throughput": round(len(ok) / duration, 3),
            "output_throughput": round(out_tokens / duration, 1),
            "goodput": round(len(good) / duration, 3) if goodput else None,
            "ttft_ms": ms(ttft), "tpot_ms": ms(tpot), "itl_ms": ms(itl),
            "errors": sorted({r["error"] for r in results if not r["ok"] and "error" in r})[:3]}


def _metrics(base_url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base_url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r'^([a-zA-Z0-9_:]+)(?:\{([^}]*)\})? ([0-9.e+-]+)$', line)
        if m:
            mode = re.search(r'mode="(\w+)"', m.group(2) or "")
            key = m.group(1) + (f"[{mode.group(1)}]" if mode else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def _start_server(flags: list[str]):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "jaxsched.entrypoints.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    if wait_until_healthy(base, proc, 1200):
        return proc, base
    proc.kill()
    raise RuntimeError("jaxsched serve did not become healthy")


def bench(base_url: str, args, requests, goodput) -> dict:
    before = _metrics(base_url)
    results, duration = asyncio.run(run(base_url, args.model, requests, args.request_rate, args.seed,
                                        args.api_key))
    after = _metrics(base_url)
    summary = summarize(results, duration, goodput)
    for key in ("vllm:num_preemptions_total", "jaxsched:num_preemptions_by_mode_total[recompute]",
                "jaxsched:num_preemptions_by_mode_total[swap]"):
        summary[key.split(":")[1]] = int(after.get(key, 0) - before.get(key, 0))
    return summary


def table(rows: dict) -> str:
    head = ("| cache | done | req/s | out tok/s | goodput req/s | TTFT mean / med / p99 ms | "
            "TPOT mean / med / p99 ms | ITL mean / med / p99 ms | preempted (recompute, swap) |")
    lines = [head, "|" + "---|" * 9]
    f = lambda d: f"{d['mean']} / {d['median']} / {d['p99']}" if d else "-"
    for name, r in rows.items():
        lines.append(f"| {name} | {r['completed']} | {r['request_throughput']} | {r['output_throughput']} | "
                     f"{r['goodput']} | {f(r['ttft_ms'])} | {f(r['tpot_ms'])} | {f(r['itl_ms'])} | "
                     f"{r['num_preemptions_total']} ({r['num_preemptions_by_mode_total[recompute]']}, "
                     f"{r['num_preemptions_by_mode_total[swap]']}) |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8000")
    a("--model", default="smollm2-135m")
    a("--api-key", default=os.environ.get("JAXSCHED_API_KEY"))
    a("--num-prompts", type=int, default=64)
    a("--request-rate", type=float, default=float("inf"), help="requests/s of the Poisson arrivals (inf: burst)")
    a("--random-input-len", type=int, default=64)
    a("--random-output-len", type=int, default=32)
    a("--random-range-ratio", type=float, default=0.5)
    a("--trace", default=None, help="a jaxsched trace JSON: its prompt_len / max_tokens")
    a("--goodput", nargs="*", default=["ttft:5000", "tpot:500"], help="limits in ms, e.g. ttft:500 tpot:50")
    a("--seed", type=int, default=0)
    a("--suite", action="store_true", help="start a server per cache size (roomy, small/recompute, "
      "small/swap) and save the table")
    args = p.parse_args()
    goodput = {k: float(v) for k, v in (g.split(":") for g in args.goodput)}
    requests = make_requests(args, np.random.default_rng(args.seed))
    if not args.suite:
        print(json.dumps(bench(args.base_url, args, requests, goodput), indent=2))
        return 0
    rows = {}
    for name, flags in SUITE.items():
        proc, base = _start_server(SUITE_ENGINE + flags)
        try:
            bench(base, args, requests[:8], goodput)                 # first-use costs, not timed
            rows[name] = bench(base, args, requests, goodput)
        finally:
            proc.send_signal(2)
            proc.wait(120)
        print(name, json.dumps(rows[name]), flush=True)
    config = {k: getattr(args, k) for k in ("num_prompts", "request_rate", "random_input_len",
                                            "random_output_len", "random_range_ratio", "trace", "seed")}
    config["request_rate"] = str(args.request_rate)          # "inf" stays valid JSON
    config.update(goodput_ms=goodput, engine=" ".join(SUITE_ENGINE), caches={k: " ".join(v) for k, v in SUITE.items()},
                  load_average=os.getloadavg()[0], cpus=os.cpu_count())
    md = (f"Serving benchmark (SmolLM2-135M, {args.num_prompts} requests, rate {args.request_rate}, "
          f"prompts {args.random_input_len} / outputs {args.random_output_len} tokens max, "
          f"goodput limits {goodput} ms, {os.cpu_count()} CPUs)\n\n" + table(rows))
    save_results("serving", {"config": config, "results": rows}, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
