"""Offline throughput of `LLM.generate`, in the shape of nano-vllm's bench.py.

    python benchmarks/throughput.py [--json] [--quick]

A tiny random-weight Llama (4 layers, hidden 256, 8 heads / 2 kv heads, vocab 4096, float32)
on the CPU. Fixed seed; token-id prompts of 16-256 tokens, outputs of 16-128 tokens (16-64 in
the 256-request runs, to stay near 8 minutes on 2 cores) with `ignore_eos=True`, so every
request produces exactly `n * max_tokens` tokens; every fourth request asks for n=2 (parallel
sampling), so that vLLM's default preemption mode (recompute for one sequence, swap for a
group) differs from plain recompute. temperature 0.6.

Every engine shares one compiled capacity: the runs change only runtime limits (device and
host blocks in use, preemption mode), so the engine compiles once, in the warm-up, and each
fresh `LLM` reuses that executable. Each run: a new `LLM`, `LLM.warm_up()` (every token bucket once),
then `time.perf_counter()` around `llm.generate(..., use_tqdm=False)`, the timed part.

  large:            256 device blocks, above these workloads' peak demand (~190): no preemption
  small/recompute:  SMALL_BLOCKS device blocks, preempted groups drop their KV and re-prefill
  small/swap:       the same, preempted groups move their blocks to host memory and back
  small/default:    the same, vLLM's default (preemption_mode=None): recompute for n=1, swap for n>1
  small/auto:       the same, preemption_mode="auto": each victim by cost, with the default
                    cost model (core.costs.DEFAULT_COSTS, measured for SmolLM2 on CPU)

Columns: output tokens/s and requests/s of the timed generate (wall clock), and output tokens
per CPU-second of this process (steadier than wall clock on a shared machine); preemptions and
blocks swapped out/in during it (from `LLM.stats()`); peak device blocks in use; host % =
wall time outside the jitted step (request packing, output processing, dispatch); "same" counts
requests whose tokens equal the large-cache run's (preemption should be invisible).
The machine is shared: the 1-minute load average and the process CPU time are recorded.

Sizing note: a step's cost grows with the device pool's capacity, not only with its tokens
(copy_blocks moves every padded pair row, each layer's pool is sliced out, the token-bucket
switch copies the pools), and falls off a cliff once the K and V pools outgrow the CPU's
last-level cache. 2 kv heads and a 256-block large cache keep the pools at 8 MiB; with 4 kv
heads and the worst-case 400 blocks a 16-sequence decode step was ~3x slower.

Results go to benchmarks/results/throughput.{json,md}; --json prints the JSON object on
stdout (the table then goes to stderr). --quick: 16/32 requests, nothing saved.
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
from flax import nnx  # noqa: E402

from _common import save_results  # noqa: E402
from jaxsched.entrypoints.llm import LLM  # noqa: E402
from jaxsched.engine.params import SamplingParams  # noqa: E402
from models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)

SEED = 0
MODEL = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
                    max_position_embeddings=512)
PROMPT_LEN = (16, 256)
OUTPUT_LEN = (16, 128)
OUTPUT_LEN_256 = (16, 64)        # the 256-request runs: outputs scaled down to fit ~8 minutes
N2_EVERY = 4                     # every fourth request samples n=2
TEMPERATURE = 0.6
BLOCK_SIZE = 16
MAX_NUM_SEQS = 16
MAX_MODEL_LEN = PROMPT_LEN[1] + OUTPUT_LEN[1]
# A decode step's cost grows with the device pool's *capacity* (see the note in the docstring),
# so the large cache is sized to these workloads (peak demand about 190 blocks), not to the
# worst case of 16 sequences * 25 blocks = 400; the table shows that it never preempts.
LARGE_BLOCKS = 256
SMALL_BLOCKS = 96                 # about 4 full-length sequences, 6-7 average ones: preempts often
HOST_BLOCKS = 256
# One static capacity for every engine below; only num_device_blocks, num_host_blocks and
# preemption_mode (runtime limits) change between runs.
CAPACITY = dict(block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=512,
                max_model_len=MAX_MODEL_LEN, num_slots=2 * MAX_NUM_SEQS + 16, max_seqs_per_group=2,
                num_device_blocks_capacity=LARGE_BLOCKS, num_host_blocks_capacity=HOST_BLOCKS)
RUNS = {
    "large": dict(num_device_blocks=LARGE_BLOCKS, num_host_blocks=HOST_BLOCKS, preemption_mode=None),
    "small/recompute": dict(num_device_blocks=SMALL_BLOCKS, num_host_blocks=HOST_BLOCKS,
                            preemption_mode="recompute"),
    "small/swap": dict(num_device_blocks=SMALL_BLOCKS, num_host_blocks=HOST_BLOCKS, preemption_mode="swap"),
    "small/default": dict(num_device_blocks=SMALL_BLOCKS, num_host_blocks=HOST_BLOCKS, preemption_mode=None),
    "small/auto": dict(num_device_blocks=SMALL_BLOCKS, num_host_blocks=HOST_BLOCKS, preemption_mode="auto"),
}
RESULTS = pathlib.Path(__file__).parent / "results"


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def workload(num: int, output_len: tuple[int, int], seed: int = SEED):
    """nano-vllm's bench: random token ids, random exact output lengths (ignore_eos)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, MODEL.vocab_size, size=int(rng.integers(PROMPT_LEN[0], PROMPT_LEN[1] + 1))).tolist()
               for _ in range(num)]
    params = [SamplingParams(n=2 if i % N2_EVERY == N2_EVERY - 1 else 1, temperature=TEMPERATURE,
                             ignore_eos=True, max_tokens=int(rng.integers(output_len[0], output_len[1] + 1)))
              for i in range(num)]
    return prompts, params


def run_once(model, name: str, limits: dict, prompts, params) -> tuple[dict, list]:
    llm = LLM(model, seed=SEED, **CAPACITY, **limits)
    warm = llm.warm_up()
    before = llm.stats()
    cpu0, start = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    after = llm.stats()
    delta = {k: after[k] - before[k] for k in ("steps", "output_tokens", "preempted_recompute", "preempted_swap",
                                               "blocks_swapped_out", "blocks_swapped_in", "engine_seconds")}
    tokens = [[c.token_ids for c in o.outputs] for o in outs]
    out_tokens = sum(len(t) for seqs in tokens for t in seqs)
    expected = sum(p.n * p.max_tokens for p in params)
    if out_tokens != expected:
        raise AssertionError(f"{name}: {out_tokens} output tokens, expected {expected} (ignore_eos)")
    row = {
        "run": name, "requests": len(prompts), "preemption_mode": limits["preemption_mode"] or "default",
        "num_device_blocks": limits["num_device_blocks"], "num_host_blocks": limits["num_host_blocks"],
        "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": out_tokens,
        "seconds": wall, "cpu_seconds": cpu,
        "output_tokens_per_s": out_tokens / wall, "requests_per_s": len(prompts) / wall,
        "output_tokens_per_cpu_s": out_tokens / cpu,
        "steps": delta["steps"], "ms_per_step": wall / max(delta["steps"], 1) * 1e3,
        "host_fraction": max(0.0, 1 - delta["engine_seconds"] / wall),
        "preempted_recompute": delta["preempted_recompute"], "preempted_swap": delta["preempted_swap"],
        "blocks_swapped_out": delta["blocks_swapped_out"], "blocks_swapped_in": delta["blocks_swapped_in"],
        "peak_device_blocks": after["peak_device_blocks"], "peak_host_blocks": after["peak_host_blocks"],
        "warm_up_seconds": warm, "load_average": os.getloadavg()[0],
    }
    del llm
    return row, tokens


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def to_markdown(result: dict) -> str:
    c = result["config"]
    scaled = ("" if c["output_len_256"] == c["output_len"] else
              f"; the 256-request runs have outputs scaled down to {c['output_len_256'][0]}-"
              f"{c['output_len_256'][1]} tokens to fit the time budget")
    lines = [
        f"# Offline throughput, `LLM.generate` ({result['machine']}, {result['backend']})", "",
        (f"Random-weight Llama: {result['model']}. block_size {c['block_size']}, max_num_seqs "
         f"{c['max_num_seqs']}, max_num_batched_tokens {c['max_num_batched_tokens']}, max_model_len "
         f"{c['max_model_len']}; one compiled capacity of {c['num_device_blocks_capacity']} device / "
         f"{c['num_host_blocks_capacity']} host blocks for all runs (compile {result['compile_seconds']:.1f} s, "
         f"once). Seed {result['seed']}: prompts {c['prompt_len'][0]}-{c['prompt_len'][1]} token ids, "
         f"outputs {c['output_len'][0]}-{c['output_len'][1]} tokens (ignore_eos, exact){scaled}. "
         f"Every {c['n2_every']}th request has n=2; temperature {c['temperature']}. "
         f"large = {c['large_blocks']} device blocks (no preemption), small = {c['small_blocks']}. "
         f"Wall clock of the timed generate after a warm-up; 1-minute load average "
         f"{result['load_average'][0]:.1f} before, {result['load_average'][1]:.1f} after: a shared machine, so "
         f"wall-clock rates move with other processes' load; output tokens per CPU-second of this process "
         f"(XLA uses up to 2 threads) is the steadier column for comparing rows. "
         f"Total runtime {result['total_seconds']:.0f} s."),
        "",
        "| requests | run | output tok/s | req/s | seconds | output tok / CPU-s | steps | ms/step | host % "
        "| preempted recompute | preempted swap | blocks swapped out / in | peak device blocks "
        "| same tokens as large |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['requests']} | {r['run']} | {r['output_tokens_per_s']:.0f} | {r['requests_per_s']:.2f} | "
            f"{r['seconds']:.1f} | {r['output_tokens_per_cpu_s']:.0f} | {r['steps']} | {r['ms_per_step']:.1f} | "
            f"{100 * r['host_fraction']:.0f} | "
            f"{r['preempted_recompute']} | {r['preempted_swap']} | {r['blocks_swapped_out']} / "
            f"{r['blocks_swapped_in']} | {r['peak_device_blocks']} | {r['same_as_large']}/{r['requests']} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the JSON object on stdout, the table on stderr")
    parser.add_argument("--quick", action="store_true", help="16 and 32 requests, nothing saved")
    args = parser.parse_args()
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    sizes = (16, 32) if args.quick else (64, 256)
    model = LlamaForCausalLM(MODEL, nnx.Rngs(SEED))

    # Warm-up: the first engine compiles the step (every token bucket) for the shared capacity.
    compile_seconds = LLM(model, seed=SEED, **CAPACITY, **RUNS["large"]).warm_up()  # compiles once
    log(f"compiled in {compile_seconds:.1f} s")

    runs = []
    for num in sizes:
        prompts, params = workload(num, OUTPUT_LEN if num <= 64 else OUTPUT_LEN_256)
        reference = None
        for name, limits in RUNS.items():
            row, tokens = run_once(model, name, limits, prompts, params)
            reference = reference or tokens
            row["same_as_large"] = sum(a == b for a, b in zip(tokens, reference))
            runs.append(row)
            log(f"{num:4d} {name:16s} {row['output_tokens_per_s']:7.1f} tok/s {row['seconds']:6.1f} s "
                f"preempt {row['preempted_recompute']}/{row['preempted_swap']} "
                f"swap {row['blocks_swapped_out']}/{row['blocks_swapped_in']} "
                f"same {row['same_as_large']}/{num} load {row['load_average']:.1f}")

    result = {
        "backend": jax.default_backend(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "jax": jax.__version__, "commit": git_commit(), "seed": SEED,
        "model": (f"{MODEL.num_hidden_layers} layers, hidden {MODEL.hidden_size}, {MODEL.num_attention_heads} heads / "
                  f"{MODEL.num_key_value_heads} kv heads, ffn {MODEL.intermediate_size}, vocab {MODEL.vocab_size}, "
                  f"{MODEL.dtype}"),
        "config": {**CAPACITY, "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN, "output_len_256": OUTPUT_LEN_256,
                   "n2_every": N2_EVERY, "temperature": TEMPERATURE, "large_blocks": LARGE_BLOCKS,
                   "small_blocks": SMALL_BLOCKS},
        "compile_seconds": compile_seconds, "runs": runs,
        "load_average": [load_before, os.getloadavg()[0]], "total_seconds": time.perf_counter() - t0,
    }
    markdown = to_markdown(result)
    if not args.quick:
        save_results("throughput", result, markdown)
    if args.json:
        print(json.dumps(result))
        log(markdown)
    else:
        print(markdown)


if __name__ == "__main__":
    main()
