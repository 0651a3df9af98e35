"""The queue order of a general step: sorted again, or its stale order repaired.

    python benchmarks/queue_order.py [--slots 128,256,512,1024] [--every 4] [--rounds 7]

Each general step starts from the order the previous step cached in the state; when that is
stale (admissions, finishes, preemptions, arrivals moved slots between queues), `walks.queues`
sorts the slots again, or from REPAIR_FROM_SLOTS slots up re-ranks the few that moved
(`walks._repair_or_sort`). The 500-request trace of `benchmarks/sweep.py` is replayed by
`simulate` (swap, max_num_seqs 48, 144 device blocks: preemptions and arrivals throughout)
at each slot count, and the states every --every'th general step starts from are kept. On
those states, in one process, rounds interleaved: `queues` as it is, and `queues` traced
with the repair off (always sorting); both orders must be equal on every state. Also the
share of the kept states whose order was stale, had at most REPAIR_UP_TO slots out of place,
and was repaired without falling back to the sort; and `simulate`'s whole replay per step
both ways (compile apart, best of 3; its run-to-run noise on a shared machine is 10-30%).
Results: benchmarks/results/queue_order.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import time

from _common import machine, save_results
from sweep import TRACE

from jaxsched.entrypoints.xla_flags import use_xla_flags

use_xla_flags()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxsched.core import scheduler, walks  # noqa: E402
from jaxsched.core.state import SchedulerState  # noqa: E402
from jaxsched.entrypoints.cli_sweep import markdown_table  # noqa: E402
from jaxsched.sim.simulate import simulate  # noqa: E402
from jaxsched.sim.workload import generate_trace  # noqa: E402

CONFIG = dict(preemption_mode="swap", max_num_seqs=48, num_device_blocks=144)


def replay(trace, slots: int, keep=None, every: int = 1) -> float:
    """simulate at `slots` slots; its seconds. `keep` gets (dims, data, counts) of the state
    every `every`'th general step's `queues` starts from."""
    original = scheduler.queues
    seen = [0]

    def capture(dims, data, counts):
        seen[0] += 1
        if seen[0] % every == 1 % every:
            keep((dims, tuple(np.array(x) for x in data), np.array(counts)))

    def capturing(state, counts, cached=None):
        if cached is None:
            jax.debug.callback(lambda data, c, dims=state.dims: capture(dims, data, c), state.data, counts)
        return original(state, counts, cached)
    scheduler.queues = capturing if keep else original
    try:
        t0 = time.perf_counter()
        simulate(trace["config"], trace["requests"], capacity=dict(num_slots=slots))
        return time.perf_counter() - t0
    finally:
        scheduler.queues = original


def without_repair(fn):
    """`fn` run (and so traced) with the repair off."""
    def run(*args):
        saved, walks.REPAIR_FROM_SLOTS = walks.REPAIR_FROM_SLOTS, 1 << 30
        try:
            return fn(*args)
        finally:
            walks.REPAIR_FROM_SLOTS = saved
    return run


def shares(state: SchedulerState, counts) -> tuple[bool, bool, bool]:
    """(stale, at most REPAIR_UP_TO out of place, repaired without the sort) for one state."""
    cached, fresh = walks.order_is_cached(state)
    keys = walks._sort_keys(state, cached)
    moved = walks._out_of_place(keys[0], walks._ascending(state, cached), counts)
    few = moved.sum() <= walks.REPAIR_UP_TO
    return ~fresh, few, few & walks._ascending(state, walks._repaired(keys, moved)).all()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", default="128,256,512,1024")
    ap.add_argument("--every", type=int, default=4, help="keep every N-th general step's state")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    trace = generate_trace(**TRACE)
    trace["config"].update(CONFIG)
    load = [os.getloadavg()[0]]
    t_start = time.perf_counter()
    rows, raw = [], []
    for slots in map(int, args.slots.split(",")):
        kept = []
        replay(trace, slots, keep=kept.append, every=args.every)
        states = [(SchedulerState(tuple(jnp.asarray(x) for x in data), dims), jnp.asarray(c))
                  for dims, data, c in kept]
        del kept
        as_is = jax.jit(lambda s, c: walks.queues(s, c).order)
        sorting = jax.jit(lambda s, c: walks.queues(s, c).order)
        sorting = without_repair(sorting)
        for s, c in states:
            np.testing.assert_array_equal(as_is(s, c), sorting(s, c), err_msg=f"{slots} slots")
        share_of = jax.jit(shares)
        flags = np.array([[bool(x) for x in share_of(s, c)] for s, c in states])
        samples = {"sort": [], "as is": []}
        for r in range(args.rounds):
            pairs = [("sort", sorting), ("as is", as_is)]
            for name, fn in (pairs if r % 2 else pairs[::-1]):
                t0 = time.perf_counter()
                for s, c in states:
                    out = fn(s, c)
                out.block_until_ready()
                samples[name].append((time.perf_counter() - t0) / len(states) * 1e6)
        # The whole replay, compile apart: each setting traced afresh, best of 3.
        whole = {}
        for name, run in (("sort", without_repair(replay)), ("as is", replay)):
            jax.clear_caches()
            run(trace, slots)
            whole[name] = min(run(trace, slots) for _ in range(3))
        steps = len(simulate(trace["config"], trace["requests"], capacity=dict(num_slots=slots))["steps"])
        repairs = slots >= walks.REPAIR_FROM_SLOTS
        row = dict(slots=slots, states=len(states), stale=flags[:, 0].mean(),
                   few_moved=flags[flags[:, 0], 1].mean(), repaired=flags[flags[:, 0], 2].mean(),
                   sort_us=min(samples["sort"]), as_is_us=min(samples["as is"]),
                   sort_median_us=float(np.median(samples["sort"])),
                   as_is_median_us=float(np.median(samples["as is"])),
                   replay_sort_us_per_step=1e6 * whole["sort"] / steps,
                   replay_as_is_us_per_step=1e6 * whole["as is"] / steps,
                   repair_on=repairs)
        rows.append(row)
        raw.append(dict(row, samples=samples))
        print(row, flush=True)
    load.append(os.getloadavg()[0])
    title = f"# The queue order of a general step: sorted, or repaired {machine()}"
    fmt = [dict(slots=r["slots"], states=r["states"], stale=f"{r['stale']:.2f}",
                few_moved=f"{r['few_moved']:.2f}", repaired=f"{r['repaired']:.2f}",
                sort_us=f"{r['sort_us']:.1f}", as_is_us=f"{r['as_is_us']:.1f}",
                ratio=f"{r['as_is_us'] / r['sort_us']:.2f}",
                repair_on="yes" if r["repair_on"] else "no",
                replay_sort_us_per_step=f"{r['replay_sort_us_per_step']:.0f}",
                replay_as_is_us_per_step=f"{r['replay_as_is_us_per_step']:.0f}") for r in rows]
    md = "\n".join([
        title, "",
        f"`python benchmarks/queue_order.py --slots {args.slots} --every {args.every} "
        f"--rounds {args.rounds}`: "
        f"the 500-request trace of benchmarks/sweep.py under {CONFIG}. `states`: general steps kept; "
        f"`stale`: share whose cached order was stale; `few_moved` and `repaired`: of the stale ones, "
        f"the share with at most {walks.REPAIR_UP_TO} slots out of place, and repaired without the "
        f"sort. `sort_us` / `as_is_us`: one jitted `queues` call (dispatch included), best of "
        f"{args.rounds} interleaved rounds, with the repair off / as the package runs it (on from "
        f"{walks.REPAIR_FROM_SLOTS} slots). `replay_*`: simulate's whole replay per step, compile "
        f"apart, best of 3. 1-minute load average {load[0]:.1f} before, {load[1]:.1f} after; "
        f"{time.perf_counter() - t_start:.0f} s in all.", "",
        markdown_table(fmt, list(fmt[0])), ""])
    save_results("queue_order", dict(config=CONFIG, trace=str(TRACE), rows=raw), md)
    print(md)


if __name__ == "__main__":
    main()
