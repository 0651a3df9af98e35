"""Prefix caching on and off with SmolLM2-135M on this backend: a chat workload whose requests
mostly share one system prompt.

    python benchmarks/prefix_caching.py [--quick]

Workload (seed 0): 20 requests arriving one every 1.0 s (wall clock); 90% start with the same
system prompt of about 300 tokens (a chat template's system turn), the rest with one of their
own of the same length; each then asks its own short question. Outputs are 16 tokens
(greedy, ignore_eos), so every run does the same output work.

Engine: blocks of 16 tokens, max_num_seqs 8, max_num_batched_tokens 512, max_model_len 512;
a roomy cache (256 device blocks) and a small one (40 device blocks, about two requests at
once, so preemption happens), 128 host blocks. One compiled capacity per caching setting
(`num_device_blocks_capacity`=256), every token bucket compiled and run before the timed runs
(`LLM.warm_up`). Rows: caching off and on on both caches, then on the small cache with
caching on `auto` (the measured cost model of benchmarks/results/preemption_costs_cpu.json)
against recompute and swap. TTFT is from a request's arrival to the end of the step that
gave its first token; output tok/s is output tokens over the run's wall time; hit rate is
the engine's (`LLM.stats()["prefix_cache_hit_rate"]`). Every row's greedy outputs are
compared with the roomy, caching-off run.

Results: benchmarks/results/prefix_caching.{md,json}. --quick: 8 requests, nothing saved.
"""
import os

from jaxsched.entrypoints.xla_flags import use_xla_flags  # noqa: E402
use_xla_flags()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from _common import save_results  # noqa: E402
from jaxsched.engine.params import SamplingParams  # noqa: E402
from jaxsched.entrypoints.llm import LLM  # noqa: E402
from models.loader import build_model, load_weights  # noqa: E402

SEED = 0
NUM_REQUESTS = 20
SHARED = 0.9
GAP_S = 1.0
MAX_TOKENS = 16
ENGINE = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
              num_slots=32, max_seqs_per_group=1, num_host_blocks=128,
              num_device_blocks_capacity=256, num_host_blocks_capacity=128)
CACHES = {"roomy": 256, "small": 40}
COSTS = ROOT / "benchmarks" / "results" / "preemption_costs_cpu.json"
# (cache, caching, mode): default is vLLM's (recompute a single sequence).
RUNS = [("roomy", False, None), ("roomy", True, None), ("small", False, None), ("small", True, None),
        ("small", True, "recompute"), ("small", True, "swap"), ("small", True, "auto")]
SYSTEM = ("You are a careful, friendly assistant for a public library. Answer questions about "
          "opening hours, borrowing rules, events, the catalogue and digital services. Keep "
          "answers short and concrete, say when you are not sure, and never invent a policy. "
          "Borrowing: adults may borrow up to twenty items for three weeks; children up to ten; "
          "renewals twice online unless someone has reserved the item. Fines were abolished. "
          "Events: story time on Tuesdays at ten, a chess club on Thursdays at six, a repair "
          "cafe on the first Saturday of each month. Digital: e-books and audiobooks through the "
          "lending app, newspapers through the press reader, free wifi without a password. Rooms "
          "can be booked for study groups of up to eight people for two hours a day. Opening "
          "hours: Monday to Friday from nine to eight, Saturday from ten to five, closed on "
          "Sundays and public holidays; the returns box outside is open at all times. Cards: a "
          "library card is free for anyone who lives, works or studies in the city; bring an "
          "identity document and a proof of address. Lost cards are replaced for free once a "
          "year. Printing costs ten cents a page in black and white and fifty in colour; "
          "scanning is free. Accessibility: every floor is reachable by lift, large-print books "
          "are on the ground floor, and staff can fetch items from the upper floors on request. "
          "If a question is not about the library, politely say that you can only help with "
          "library matters and suggest where the person might ask instead. ")
QUESTIONS = ["When does story time start?", "How many books can my son borrow?",
             "Is there a fine for late returns?", "Can I book a room tomorrow?",
             "Do you have a chess club?", "How do I read newspapers online?",
             "What is the wifi password?", "Can I renew a reserved book?"]


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def workload(tokenizer, num: int) -> list[list[int]]:
    """Token ids of `num` chat prompts: system turn + user turn, rendered by the chat template."""
    rng = np.random.default_rng(SEED)
    words = SYSTEM.split()
    prompts = []
    for i in range(num):
        if rng.random() < SHARED:
            system = SYSTEM
        else:                                  # a system prompt of its own, as long
            system = " ".join(rng.permutation(words))
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})"}]
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template(messages)))
    return prompts


def run_once(model, tokenizer, cache: str, caching: bool, mode, prompts) -> tuple[dict, list]:
    llm = LLM(model, tokenizer=tokenizer, seed=SEED, enable_prefix_caching=caching,
              num_device_blocks=CACHES[cache], preemption_mode=mode,
              preemption_costs=str(COSTS) if mode == "auto" else None, **ENGINE)
    llm.warm_up()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    before = dict(llm.stats())
    arrival, first, ids = {}, {}, [f"q{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    nxt = 0
    while nxt < len(prompts) or llm.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(prompts) and now >= nxt * GAP_S:
            llm.add_request(ids[nxt], prompts[nxt], params)
            arrival[ids[nxt]] = nxt * GAP_S
            nxt += 1
        if not llm.has_unfinished():
            time.sleep(max(0.0, nxt * GAP_S - now))
            continue
        for out in llm.step():
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - start
    wall = time.perf_counter() - start
    after = llm.stats()
    ttft = np.array([first[r] - arrival[r] for r in ids])
    tokens = [llm.output(r).outputs[0].token_ids for r in ids]
    row = {"cache": cache, "num_device_blocks": CACHES[cache], "caching": caching,
           "mode": mode or "default", "wall_s": wall, "ttft_mean_s": float(ttft.mean()),
           "ttft_p90_s": float(np.percentile(ttft, 90)),
           "output_tokens_per_s": sum(len(t) for t in tokens) / wall,
           "hit_rate": after["prefix_cache_hit_rate"],
           "cached_prompt_tokens": after["cached_prompt_tokens"] - before["cached_prompt_tokens"],
           **{k: after[k] - before[k] for k in ("preempted_recompute", "preempted_swap", "steps")}}
    return row, tokens


def to_markdown(result: dict) -> str:
    rows = result["rows"]
    find = lambda cache, caching, mode="default": next(  # noqa: E731
        r for r in rows if r["cache"] == cache and r["caching"] == caching and r["mode"] == mode)
    lines = [
        f"# Prefix caching on and off ({result['machine']}, {result['backend']})", "",
        (f"SmolLM2-135M-Instruct (float32). {result['num_requests']} chat requests, one every "
         f"{GAP_S} s, {int(SHARED * 100)}% sharing a system prompt (prompts {result['prompt_len'][0]}-"
         f"{result['prompt_len'][1]} tokens with the chat template), {MAX_TOKENS} output tokens each "
         f"(greedy, ignore_eos). Blocks of {ENGINE['block_size']} tokens; roomy cache "
         f"{CACHES['roomy']} device blocks, small {CACHES['small']}; {ENGINE['num_host_blocks']} host "
         f"blocks; every token bucket compiled and run before timing. Command: "
         f"`python benchmarks/prefix_caching.py`."), "",
        "| cache | caching | mode | mean TTFT s | p90 TTFT s | output tok/s | hit rate | cached prompt tokens "
        "| preempted recompute | preempted swap | steps | greedy = roomy off |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['cache']} | {'on' if r['caching'] else 'off'} | {r['mode']} | {r['ttft_mean_s']:.3f} "
                     f"| {r['ttft_p90_s']:.3f} | {r['output_tokens_per_s']:.1f} | {r['hit_rate']:.2f} "
                     f"| {r['cached_prompt_tokens']} | {r['preempted_recompute']} | {r['preempted_swap']} "
                     f"| {r['steps']} | {r['same']}/{result['num_requests']} |")
    ratios = {c: find(c, False)["ttft_mean_s"] / find(c, True)["ttft_mean_s"] for c in CACHES}
    lines += ["", "Mean TTFT, caching off / on: " + ", ".join(
        f"{c} cache {v:.2f}x" for c, v in ratios.items()) + " (target: at least 2x at 90% shared)."]
    small = [r for r in rows if r["cache"] == "small" and r["caching"] and r["mode"] in ("recompute", "swap", "auto")]
    if small:
        best = min(small, key=lambda r: r["ttft_mean_s"])
        auto = next(r for r in small if r["mode"] == "auto")
        lines.append(f"Small cache with caching: auto preempted {auto['preempted_recompute']} by recompute and "
                     f"{auto['preempted_swap']} by swap; mean TTFT auto {auto['ttft_mean_s']:.3f} s, best "
                     f"fixed mode {best['mode']} {best['ttft_mean_s']:.3f} s. Wall times on 2 shared cores "
                     f"are noisy. Total runtime {result['total_seconds']:.0f} s.")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests, nothing saved")
    args = parser.parse_args()
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    t0 = time.perf_counter()
    model_config, tensors, tokenizer = load_weights()
    model = build_model(model_config, tensors)
    prompts = workload(tokenizer, 8 if args.quick else NUM_REQUESTS)
    log(f"prompts: {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    rows, reference = [], None
    for cache, caching, mode in RUNS:
        row, tokens = run_once(model, tokenizer, cache, caching, mode, prompts)
        reference = reference or tokens
        row["same"] = sum(a == b for a, b in zip(tokens, reference))
        rows.append(row)
        log({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "backend": jax.default_backend(),
              "num_requests": len(prompts), "prompt_len": [min(map(len, prompts)), max(map(len, prompts))],
              "rows": rows, "total_seconds": time.perf_counter() - t0}
    markdown = to_markdown(result)
    print(markdown)
    if not args.quick:
        save_results("prefix_caching", result, markdown)


if __name__ == "__main__":
    main()
