"""Compile time against step time of the engine's three parts (plan, model, finish) under each
choice of per-part XLA compile options (`jaxsched/engine/compile_options.py`).

    python benchmarks/engine_compile_options.py [--rounds 2] [--tokens 32]

Each choice runs in its own Python process with the persistent compilation cache off and the
CLI's XLA flags: SmolLM2-135M (the embedded default) with 8 sequences and 64-token buckets,
`warm_up` (which compiles every part), then 24 prompts of 10-29 tokens, greedy, `--tokens`
new tokens each. A part's compile is its first call's time less its median step; its step
time is the median over the generation, each part waited for on its own (so finish does not
include the model). Rounds alternate the order of the choices, so a drift of the machine's
load lands on all of them. Every choice must produce the same tokens.
Results go to benchmarks/results/engine_compile_options.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(pathlib.Path(__file__).parent))

from _common import save_results  # noqa: E402

CHOICES = {
    "all XLA defaults": {"plan": "default", "model": "default", "finish": "default"},
    "plan fast (jaxsched's)": {"plan": "fast", "model": "default", "finish": "default"},
    "plan + finish fast": {"plan": "fast", "model": "default", "finish": "fast"},
    "all fast": {"plan": "fast", "model": "fast", "finish": "fast"},
}

DRIVER = r"""
import json, statistics, sys, time
from jaxsched.entrypoints.xla_flags import use_xla_flags
use_xla_flags()
import jax
from jaxsched.engine import compile_options as co
from jaxsched.engine import step as st
choice, tokens = json.loads(sys.argv[1]), int(sys.argv[2])
pick = {"fast": co.FAST_COMPILE, "default": ()}
times = {"plan": [], "model": [], "finish": []}

def timed(fn, part):
    def call(*args, **kwargs):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        times[part].append(time.perf_counter() - start)
        return out
    return call

parts = {part: timed(st.jitted_part(part, pick[choice[part]]), part) for part in times}
from jaxsched.entrypoints.llm import LLM
from jaxsched.engine.params import SamplingParams
llm = LLM("smollm2-135m", block_size=16, max_num_seqs=8, num_slots=16, max_num_batched_tokens=64,
          max_model_len=256, num_device_blocks=64, num_host_blocks=64)
llm._step = st.LazyStep(llm.spec, **parts)
start = time.perf_counter()
llm.warm_up()
warm = time.perf_counter() - start
first = {part: list(ts) for part, ts in times.items()}
for ts in times.values():
    ts.clear()
prompts = [[1 + (i * 7 + j) % 1000 for j in range(10 + i % 20)] for i in range(24)]
start = time.perf_counter()
outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
gen = time.perf_counter() - start
step = {part: statistics.median(ts) for part, ts in times.items()}
# Compile: the warm-up's calls that compiled (the plan and finish once, the model once per
# bucket), each less a step's run time.
buckets = len(llm.spec.token_buckets)
compile_s = {part: sum(sorted(first[part], reverse=True)[:buckets if part == "model" else 1])
                   - step[part] * (buckets if part == "model" else 1) for part in times}
print(json.dumps(dict(warm_up_s=warm, generate_s=gen, steps=len(times["plan"]),
                      compile_s=compile_s, step_ms={p: v * 1e3 for p, v in step.items()},
                      tokens=[o.outputs[0].token_ids for o in outs])))
"""


def run(choice: dict, tokens: int) -> dict:
    env = {**os.environ, "JAXSCHED_COMPILATION_CACHE_DIR": "off"}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(choice), str(tokens)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    samples: dict[str, list[dict]] = {name: [] for name in CHOICES}
    names = list(CHOICES)
    for round_ in range(args.rounds):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            samples[name].append(run(CHOICES[name], args.tokens))
            print(f"round {round_ + 1}: {name}: warm-up {samples[name][-1]['warm_up_s']:.1f} s", flush=True)
    tokens = {json.dumps(s["tokens"]) for runs in samples.values() for s in runs}
    assert len(tokens) == 1, "the choices generated different tokens"

    def med(name, *keys):
        values = []
        for s in samples[name]:
            v = s
            for k in keys:
                v = v[k]
            values.append(v)
        return statistics.median(values)

    rows = []
    for name, choice in CHOICES.items():
        rows.append(dict(choice=name, **{f"{p}_options": choice[p] for p in ("plan", "model", "finish")},
                         **{f"{p}_compile_s": round(med(name, "compile_s", p), 2) for p in ("plan", "model", "finish")},
                         **{f"{p}_step_ms": round(med(name, "step_ms", p), 2) for p in ("plan", "model", "finish")},
                         warm_up_s=round(med(name, "warm_up_s"), 2), generate_s=round(med(name, "generate_s"), 2)))
    head = ("| choice | plan compile s | model compile s (all buckets) | finish compile s | plan ms/step "
            "| model ms/step | finish ms/step | warm-up s | generate s |\n|---|---|---|---|---|---|---|---|---|\n")
    table = head + "".join(
        f"| {r['choice']} | {r['plan_compile_s']} | {r['model_compile_s']} | {r['finish_compile_s']} | "
        f"{r['plan_step_ms']} | {r['model_step_ms']} | {r['finish_step_ms']} | {r['warm_up_s']} | {r['generate_s']} |\n"
        for r in rows)
    steps = samples[names[0]][0]["steps"]
    md = (f"# Per-part compile options of the engine step\n\n`python benchmarks/engine_compile_options.py "
          f"--rounds {args.rounds} --tokens {args.tokens}` on {platform.machine()}, {os.cpu_count()} CPUs; "
          f"SmolLM2-135M, 8 sequences, 64-token buckets, {steps} steps of 24 prompts; medians of "
          f"{args.rounds} rounds, order alternating. \"fast\" is `compile_options.FAST_COMPILE` (LLVM -O0, "
          "classic emitters); every choice generated the same tokens.\n\n" + table)
    print(md)
    save_results("engine_compile_options", dict(rounds=args.rounds, tokens=args.tokens, steps=steps, rows=rows), md)


if __name__ == "__main__":
    main()
