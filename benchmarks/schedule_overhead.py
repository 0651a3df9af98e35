"""Scheduler overhead: microseconds per `schedule` call in steady-state decode, jaxsched vs the
plain-Python reference scheduler.

    python benchmarks/schedule_overhead.py [--json] [--steps N] [--groups 16 64 256 1024]

Workload: G requests of a 128-token prompt (block_size 16, n=1) arrive at time 0; the first
step admits them all, then every step decodes one token per group. The device cache holds
16 blocks per group, so nothing is ever preempted, and max_num_batched_tokens fits every
prefill. After a warm-up of WARMUP steps, STEPS calls of each scheduler are timed one by
one, in alternating blocks of BLOCK_STEPS steps (jaxsched, reference, jaxsched, ...), so slow
drifts in the load of other processes hit both alike. The jaxsched call is the public
`schedule_step(state, cap, now)`, which returns the new state; the timing includes
`block_until_ready` on the state and the output. Between timed calls `update` (jaxsched)
and `process_outputs` (reference) apply one token per sequence, untimed, as a serving loop
would. Every 16th decode step hands each group a new block, so the median is a step
without allocation; the mean includes those steps.

Compile time (first call: trace + XLA compile) is reported apart. Results go to
benchmarks/results/schedule_overhead.{json,md}; --json prints {"jaxsched": {G: us}, "reference":
{G: us}} (medians) instead of the table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import sys
import time

from jaxsched.entrypoints.xla_flags import use_xla_flags  # noqa: E402
use_xla_flags()

import jax  # noqa: E402

# Before anything starts the backend: run each call in the calling thread (async dispatch
# hands every call to a worker thread, which costs a wake-up per step on 2 shared cores).
jax.config.update("jax_cpu_enable_async_dispatch", False)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))      # this checkout's jaxsched

from jaxsched.sim.reference import ReferenceScheduler  # noqa: E402
from jaxsched.sim.reference import SchedulerConfig as ReferenceConfig  # noqa: E402

from jaxsched import SchedulerConfig, add_requests, init_state, make_batch, schedule_step, update  # noqa: E402

PROMPT, BLOCK, WARMUP, STEPS, BATCH = 128, 16, 8, 100, 64
BLOCK_STEPS = 25
RESULTS = pathlib.Path(__file__).parent / "results"


def limits(groups: int) -> dict:
    return dict(block_size=BLOCK, num_device_blocks=16 * groups + 16, num_host_blocks=16,
                max_num_seqs=groups, max_num_batched_tokens=max(2048, groups * PROMPT),
                max_model_len=1024)


class Jaxsched:
    """jaxsched's public transitions, one step at a time."""

    def __init__(self, groups: int, steps: int):
        config = SchedulerConfig(**limits(groups), num_slots=groups, max_seqs_per_group=1,
                                 max_blocks_per_seq=16)
        self.cap = config.capacity()
        state = init_state(config)
        for start in range(0, groups, BATCH):
            rows = [dict(request_index=i, prompt_len=PROMPT, n=1, max_tokens=10**6, arrival_time=0.0)
                    for i in range(start, min(groups, start + BATCH))]
            state, _ = add_requests(state, make_batch(rows, BATCH))
        self.state = state
        self.nows = [jnp.float32(t) for t in range(steps + 1)]   # made outside the timing
        self.t = 0

    def step(self) -> float:
        """One timed `schedule_step`, then the untimed `update`; returns seconds."""
        now = self.nows[self.t]
        start = time.perf_counter()
        state, out = schedule_step(self.state, self.cap, now)
        jax.block_until_ready((state, out))
        elapsed = time.perf_counter() - start
        self.state, _, _ = update(state, out.scheduled, out.num_scheduled_tokens, out.is_prefill)
        self.last = out
        self.t += 1
        free = int(out.num_free_device_blocks)          # read after the timing
        self.allocated = free < getattr(self, "free", free)
        self.free = free
        return elapsed


class Reference:
    """jaxsched/reference.py: `schedule(now)` timed, `process_outputs` untimed."""

    def __init__(self, groups: int):
        self.sched = ReferenceScheduler(ReferenceConfig(**limits(groups)))
        for i in range(groups):
            self.sched.add_request(f"r{i}", prompt_len=PROMPT, max_tokens=10**6, n=1, arrival_time=0.0)
        self.t = 0

    def step(self) -> float:
        start = time.perf_counter()
        out = self.sched.schedule(float(self.t))
        elapsed = time.perf_counter() - start
        self.sched.process_outputs(out, self.t)
        self.last = out
        self.t += 1
        return elapsed


def bench(groups: int, steps: int) -> dict:
    mine, ref = Jaxsched(groups, WARMUP + steps), Reference(groups)
    compile_s = mine.step()          # the admission step; the first call compiles
    ref.step()
    for _ in range(WARMUP - 1):
        mine.step(), ref.step()
    gc.collect()
    ours, theirs, allocating = [], [], []
    while len(ours) < steps:
        block = min(BLOCK_STEPS, steps - len(ours))
        for _ in range(block):
            ours.append(mine.step())
            allocating.append(mine.allocated)
        theirs += [ref.step() for _ in range(block)]
    scheduled = int(mine.last.scheduled.sum())
    if scheduled != groups or len(ref.last.scheduled) != groups or int(mine.last.preempted.sum()):
        raise RuntimeError(f"G={groups}: not a steady decode step ({scheduled} scheduled)")
    alloc = np.asarray(allocating)

    def us(xs):
        xs = np.asarray(xs) * 1e6
        return {"median": float(np.median(xs)), "mean": float(xs.mean()), "min": float(xs.min()),
                "median_allocating": float(np.median(xs[alloc])) if alloc.any() else None}
    return {"groups": groups, "compile_s": compile_s, "allocating_steps": int(alloc.sum()),
            "jaxsched": us(ours), "reference": us(theirs)}


def to_markdown(result: dict) -> str:
    lines = ["# Scheduler overhead per `schedule` call, steady-state decode "
             f"({result['machine']}, jax {result['jax']})", "",
             f"Prompt {PROMPT} tokens, block {BLOCK}, n=1, nothing preempted; {result['steps']} timed "
             f"steps after {WARMUP} warm-up steps, in alternating blocks of {BLOCK_STEPS}; "
             f"1-minute load average {result['load_average'][0]:.1f} before, "
             f"{result['load_average'][1]:.1f} after.", "",
             "| running groups | jaxsched us (median) | reference us (median) | speedup | "
             "jaxsched mean / min us | reference mean / min us | allocating steps: jaxsched / "
             "reference us (median) | jaxsched compile s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda x: "-" if x is None else f"{x:.0f}"
    for r in result["runs"]:
        a, b = r["jaxsched"], r["reference"]
        lines.append(f"| {r['groups']} | {a['median']:.0f} | {b['median']:.0f} | "
                     f"{b['median'] / a['median']:.1f}x | {a['mean']:.0f} / {a['min']:.0f} | "
                     f"{b['mean']:.0f} / {b['min']:.0f} | {fmt(a['median_allocating'])} / "
                     f"{fmt(b['median_allocating'])} | {r['compile_s']:.1f} |")
    big = result["runs"][-1]
    speedup = big["reference"]["median"] / big["jaxsched"]["median"]
    lines += ["", "Every 16th decode step hands each group a new block (all prompts have the same "
              "length); with staggered lengths nearly every step does, so the allocating-steps "
              "column is the cost of a typical step there.", "",
              f"Target: at least 20x less time per step than the reference at "
              f"{big['groups']} running groups -- {speedup:.1f}x."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the JSON medians instead of the table")
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per size (<= 110)")
    parser.add_argument("--groups", type=int, nargs="+", default=[16, 64, 256, 1024])
    args = parser.parse_args()
    if not 1 <= args.steps <= 110:        # 128 + warm-up + steps tokens must fit 16 blocks
        parser.error("--steps must be in 1..110")
    load_before = os.getloadavg()[0]
    runs = [bench(g, args.steps) for g in args.groups]
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "jax": jax.__version__,
              "steps": args.steps, "load_average": [load_before, os.getloadavg()[0]], "runs": runs}
    medians = {who: {str(r["groups"]): round(r[who]["median"], 1) for r in runs}
               for who in ("jaxsched", "reference")}
    markdown = to_markdown(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / "schedule_overhead"
    stem.with_suffix(".json").write_text(json.dumps({**medians, "details": result}, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown)
    print(json.dumps(medians) if args.json else markdown)


if __name__ == "__main__":
    main()
