"""preemption_mode="auto" against recompute and swap, with SmolLM2-135M on this backend.

    python benchmarks/preemption_auto.py [--quick]

1. Cost model: `LLM.measure_preemption_costs` times the model's paged forward prefilling
   16, 64, 128 and 256 tokens and the cache's swap_out + swap_in of 1, 4, 8 and 16 blocks
   (median of 3 after a warm-up each), fits `core.costs.PreemptionCosts` and saves it to
   benchmarks/results/preemption_costs_cpu.json.
2. Workload (seed 0): 16 requests of random token ids, prompts 32-128 tokens, outputs 16-48
   tokens with `ignore_eos` (every run does the same work), greedy, every fourth request
   n=2. 24 device blocks of 16 tokens hold two or three requests at once, so preemption
   happens many times; 96 host blocks leave room for every swap.
3. One compiled capacity for every run (the mode and the costs are runtime limits). Each of
   recompute, swap and auto (with the measured costs) runs three times, in the order
   recompute, swap, auto, auto, swap, recompute, recompute, swap, auto, so load on the
   shared machine hits them alike; each run is a fresh `LLM` (sharing the executable that
   `LLM.warm_up()` compiled and ran once per token bucket), a one-request warm-up, then
   `llm.generate` timed by wall clock. The table gives the mean of the runs and each wall time.

Results: benchmarks/results/preemption_auto.{md,json}. --quick: 6 requests, one run per
mode, nothing saved. --render: rewrite the .md from the saved .json (no runs).
"""
import os

from jaxsched.entrypoints.xla_flags import use_xla_flags  # noqa: E402
use_xla_flags()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from _common import save_results  # noqa: E402
from jaxsched.entrypoints.llm import LLM  # noqa: E402
from jaxsched.engine.params import SamplingParams  # noqa: E402
from models.loader import build_model, load_weights  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)

SEED = 0
NUM_REQUESTS = 16
PROMPT_LEN = (32, 128)
OUTPUT_LEN = (16, 48)
N2_EVERY = 4
DEVICE_BLOCKS = 24
HOST_BLOCKS = 96
CAPACITY = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                num_slots=24, max_seqs_per_group=2, num_device_blocks=DEVICE_BLOCKS,
                num_host_blocks=HOST_BLOCKS)
LENGTHS = (16, 64, 128, 256)
BLOCKS = (1, 4, 8, 16)
MODES = ("recompute", "swap", "auto")
RESULTS = pathlib.Path(__file__).parent / "results"


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def git_commit() -> str:
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                                        check=True).stdout.strip()
        return run("rev-parse", "--short", "HEAD") + ("+dirty" if run("status", "--porcelain",
                                                                     "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def workload(num: int, vocab: int):
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, vocab, size=int(rng.integers(PROMPT_LEN[0], PROMPT_LEN[1] + 1))).tolist()
               for _ in range(num)]
    params = [SamplingParams(n=2 if i % N2_EVERY == N2_EVERY - 1 else 1, temperature=0.0, ignore_eos=True,
                             max_tokens=int(rng.integers(OUTPUT_LEN[0], OUTPUT_LEN[1] + 1)))
              for i in range(num)]
    return prompts, params


def run_once(model, tokenizer, mode: str, costs, prompts, params) -> tuple[dict, list]:
    llm = LLM(model, tokenizer=tokenizer, seed=SEED, preemption_mode=mode, preemption_costs=costs, **CAPACITY)
    llm.generate([list(range(1, 17))], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    before, run_before = llm.stats(), llm._stats.counts["tokens_run"]
    cpu0, start = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    after = llm.stats()
    tokens = [[c.token_ids for c in o.outputs] for o in outs]
    out_tokens = sum(len(t) for seqs in tokens for t in seqs)
    if out_tokens != sum(p.n * p.max_tokens for p in params):
        raise AssertionError(f"{mode}: {out_tokens} output tokens, not what ignore_eos asks for")
    keys = ("steps", "preempted_recompute", "preempted_swap", "blocks_swapped_out", "blocks_swapped_in")
    row = {"mode": mode, "seconds": wall, "cpu_seconds": cpu, "output_tokens": out_tokens,
           "output_tokens_per_s": out_tokens / wall, "tokens_run": llm._stats.counts["tokens_run"] - run_before,
           **{k: after[k] - before[k] for k in keys}, "load_average": os.getloadavg()[0]}
    return row, tokens


def summarize(runs: list[dict], reference: dict) -> list[dict]:
    """Per mode: mean wall time and throughput over its runs; counts from its first run
    (the scheduler is deterministic: every run of a mode makes the same decisions)."""
    rows = []
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        seconds = [r["seconds"] for r in mine]
        rows.append({**mine[0], "seconds": float(np.mean(seconds)), "seconds_each": seconds,
                     "output_tokens_per_s": mine[0]["output_tokens"] / float(np.mean(seconds)),
                     "cpu_seconds": float(np.mean([r["cpu_seconds"] for r in mine])),
                     "same_as_recompute": reference[mode]})
    return rows


def _schedule(row: dict) -> tuple:
    """What the scheduler did in a run, as counts (equal counts: the same decisions here)."""
    return tuple(row[k] for k in ("steps", "tokens_run", "preempted_recompute", "preempted_swap",
                                  "blocks_swapped_out", "blocks_swapped_in"))


def to_markdown(result: dict) -> str:
    c, costs = result["config"], result["costs"]
    best_fixed = max((r for r in result["rows"] if r["mode"] != "auto"), key=lambda r: r["output_tokens_per_s"])
    auto = next(r for r in result["rows"] if r["mode"] == "auto")
    ratio = auto["output_tokens_per_s"] / best_fixed["output_tokens_per_s"]
    cpu_ratio = best_fixed["cpu_seconds"] / auto["cpu_seconds"]
    lines = [
        f"# preemption_mode=\"auto\" vs recompute and swap ({result['machine']}, {result['backend']})", "",
        (f"SmolLM2-135M-Instruct (float32). {c['num_requests']} requests, seed {result['seed']}: prompts "
         f"{c['prompt_len'][0]}-{c['prompt_len'][1]} random token ids, outputs {c['output_len'][0]}-"
         f"{c['output_len'][1]} tokens (ignore_eos, greedy), every {c['n2_every']}th request n=2. "
         f"{c['num_device_blocks']} device blocks of {c['block_size']} tokens, {c['num_host_blocks']} host "
         f"blocks, max_num_seqs {c['max_num_seqs']}, max_num_batched_tokens {c['max_num_batched_tokens']}. "
         f"One compile and a run of every token bucket for all runs ({result['compile_seconds']:.0f} s, excluded). Each mode ran "
         f"{result['repeats']} times, interleaved ({', '.join(result['order'])}); wall seconds are the "
         f"mean (each run in brackets). 1-minute load average {result['load_average'][0]:.1f} before, "
         f"{result['load_average'][1]:.1f} after: the 2 cores are shared, so wall times are noisy."),
        "",
        (f"Measured cost model ({result['measure_seconds']:.0f} s to measure, "
         f"`benchmarks/results/preemption_costs_cpu.json`): recompute = {costs['recompute_fixed'] * 1e3:.2f} ms "
         f"+ {costs['recompute_per_token'] * 1e3:.3f} ms/token + {costs['recompute_per_token_sq'] * 1e6:.4f} "
         f"us/token^2; swap out + in = {costs['swap_fixed'] * 1e3:.3f} ms + {costs['swap_per_block'] * 1e3:.3f} "
         f"ms/block. Prefill {result['measured']['lengths']} tokens: "
         f"{', '.join(f'{t * 1e3:.0f}' for t in result['measured']['recompute_seconds'])} ms; swap "
         f"{result['measured']['blocks']} blocks: "
         f"{', '.join(f'{t * 1e3:.2f}' for t in result['measured']['swap_seconds'])} ms."),
        "",
        "| mode | output tok/s | wall s (runs) | CPU s | output tok / CPU-s | steps | tokens run "
        "| preempted recompute | preempted swap | blocks swapped out / in | greedy outputs = recompute's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        each = ", ".join(f"{s:.1f}" for s in r["seconds_each"])
        lines.append(
            f"| {r['mode']} | {r['output_tokens_per_s']:.1f} | {r['seconds']:.1f} ({each}) | {r['cpu_seconds']:.1f} "
            f"| {r['output_tokens'] / r['cpu_seconds']:.1f} "
            f"| {r['steps']} | {r['tokens_run']} | {r['preempted_recompute']} | {r['preempted_swap']} "
            f"| {r['blocks_swapped_out']} / {r['blocks_swapped_in']} | {r['same_as_recompute']}/{c['num_requests']} |")
    same = [r["mode"] for r in result["rows"] if r["mode"] != "auto" and _schedule(r) == _schedule(auto)]
    spread = max(max(r["seconds_each"]) / min(r["seconds_each"]) - 1 for r in result["rows"])
    if best_fixed["mode"] in same:
        # The same decisions are the same work: only machine noise can tell the runs apart.
        verdict = (f"auto scheduled exactly as {best_fixed['mode']}, the better fixed mode, did (same steps, "
                   f"tokens run, preemptions and blocks moved), so its throughput is that mode's: "
                   f"{ratio:.3f}x by wall clock and {cpu_ratio:.3f}x by output tokens per CPU-second in this "
                   f"run, while the runs of one mode differ by up to {100 * spread:.0f}%.")
    else:
        verdict = (f"{ratio:.3f}x by wall clock, {'at least' if ratio >= 1 else 'NOT at least'} the better "
                   f"fixed mode's throughput in this run; {cpu_ratio:.3f}x by output tokens per CPU-second "
                   f"of this process (runs of one mode differ by up to {100 * spread:.0f}%).")
    lines += ["", f"auto / best fixed mode ({best_fixed['mode']}): {verdict} "
              f"Total runtime {result['total_seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 requests, one run per mode, nothing saved")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite preemption_auto.md from the saved preemption_auto.json")
    args = parser.parse_args()
    if args.render:
        markdown = to_markdown(json.loads((RESULTS / "preemption_auto.json").read_text()))
        (RESULTS / "preemption_auto.md").write_text(markdown)
        print(markdown)
        return
    t0, load_before = time.perf_counter(), os.getloadavg()[0]
    model_config, tensors, tokenizer = load_weights()
    model = build_model(model_config, tensors)
    num = 6 if args.quick else NUM_REQUESTS
    prompts, params = workload(num, model_config.vocab_size)

    start = time.perf_counter()
    probe = LLM(model, tokenizer=tokenizer, seed=SEED, **CAPACITY)
    costs, measured = probe.measure_preemption_costs(lengths=LENGTHS, blocks=BLOCKS, reps=3)
    measure_seconds = time.perf_counter() - start
    log(f"measured in {measure_seconds:.0f} s: {costs}")
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        costs.to_json(RESULTS / "preemption_costs_cpu.json", model="SmolLM2-135M-Instruct float32",
                      block_size=CAPACITY["block_size"], **measured)
    start = time.perf_counter()
    probe.warm_up()   # compiles, and runs every token bucket once: later LLMs share the executable
    compile_seconds = time.perf_counter() - start
    del probe
    log(f"compiled in {compile_seconds:.0f} s")

    order = list(MODES) if args.quick else list(MODES) + list(MODES[::-1]) + list(MODES)
    runs, tokens = [], {}
    for mode in order:
        row, toks = run_once(model, tokenizer, mode, costs, prompts, params)
        runs.append(row)
        tokens.setdefault(mode, toks)
        log(f"{mode:9s} {row['output_tokens_per_s']:6.1f} tok/s {row['seconds']:6.1f} s "
            f"preempt {row['preempted_recompute']}/{row['preempted_swap']} "
            f"swapped {row['blocks_swapped_out']}/{row['blocks_swapped_in']} load {row['load_average']:.1f}")
    same = {m: sum(a == b for a, b in zip(tokens[m], tokens["recompute"])) for m in MODES}
    result = {
        "backend": jax.default_backend(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "jax": jax.__version__, "commit": git_commit(), "seed": SEED,
        "config": {**CAPACITY, "num_requests": num, "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                   "n2_every": N2_EVERY},
        "costs": dict(zip(("recompute_fixed", "recompute_per_token", "recompute_per_token_sq", "swap_fixed",
                           "swap_per_block"), costs.coefficients)),
        "measured": measured, "measure_seconds": measure_seconds, "compile_seconds": compile_seconds,
        "repeats": len(order) // len(MODES), "order": order, "runs": runs, "rows": summarize(runs, same),
        "load_average": [load_before, os.getloadavg()[0]], "total_seconds": time.perf_counter() - t0,
    }
    markdown = to_markdown(result)
    if not args.quick:
        save_results("preemption_auto", result, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
