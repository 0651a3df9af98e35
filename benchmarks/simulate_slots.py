"""simulate on a long trace: slots for every request, or as it sizes them now.

    python benchmarks/simulate_slots.py [--requests 1000,4000]

The trace of `benchmarks/sweep.py` (Poisson arrivals at 0.5 per step) with --requests
requests, replayed by `simulate` as it sizes its slots now (up to START_SLOTS requests one
each; past them arrivals past the slots wait outside them, from max_num_seqs slots, doubled
and restarted while a step's admission may reach past them) and with num_slots fixed at the
power of two holding every request, in one process; the two replays must make the same
decisions (each step's lists compared in any order: they name requests in slot order). `first` is the first call
(tracing, compiles, every restart), `again` a second call of the same (run only: every
executable is compiled by then). Results: benchmarks/results/simulate_slots.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from _common import machine, save_results
from sweep import TRACE

from jaxsched.entrypoints.xla_flags import use_xla_flags

use_xla_flags()

import jax  # noqa: E402

from jaxsched.entrypoints.cli_sweep import markdown_table  # noqa: E402
from jaxsched.sim import simulate as sim  # noqa: E402
from jaxsched.sim.capacity import pow2  # noqa: E402
from jaxsched.sim.workload import generate_trace  # noqa: E402


def timed(trace, capacity, sizes: list) -> tuple[float, float, dict]:
    """(first call s, second call s, result) of simulate with `capacity`; `sizes` gets the
    num_slots of every replay the first call made."""
    jax.clear_caches()                  # the first call compiles what it uses
    replay = sim._replay
    sim._replay = lambda tr, cfg, *a: sizes.append(cfg.num_slots) or replay(tr, cfg, *a)
    try:
        t0 = time.perf_counter()
        result = sim.simulate(trace["config"], trace["requests"], capacity=capacity)
        t1 = time.perf_counter()
    finally:
        sim._replay = replay
    sim.simulate(trace["config"], trace["requests"], capacity=capacity)
    return t1 - t0, time.perf_counter() - t1, result


def decisions(result: dict) -> list:
    """Each step's decisions, its lists in any order."""
    return [{k: sorted(map(json.dumps, v)) if isinstance(v, list) else v for k, v in step.items()}
            for step in result["steps"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="1000,4000")
    args = ap.parse_args()
    load, t_start, rows = [os.getloadavg()[0]], time.perf_counter(), []
    for n in map(int, args.requests.split(",")):
        trace = generate_trace(**dict(TRACE, num_requests=n))
        every = pow2(n)
        for name, capacity in ((f"num_slots={every} (every request)", dict(num_slots=every)),
                               ("as it sizes them now", None)):
            sizes = []
            first, again, result = timed(trace, capacity, sizes)
            if capacity is not None:
                want = decisions(result)
            elif decisions(result) != want:
                raise AssertionError(f"{n} requests: the replays disagree")
            rows.append(dict(requests=n, steps=len(result["steps"]), slots=name,
                             replays=" -> ".join(map(str, sizes)), first_s=round(first, 1),
                             again_s=round(again, 1),
                             us_per_step=round(1e6 * again / len(result["steps"]))))
            print(rows[-1], flush=True)
    load.append(os.getloadavg()[0])
    md = "\n".join([
        f"# simulate on long traces: slots for every request, or as it sizes them now {machine()}", "",
        f"`python benchmarks/simulate_slots.py --requests {args.requests}`: the trace of "
        f"benchmarks/sweep.py at each length; both replays make the same decisions. `replays`: the "
        f"slot counts the first call replayed with; `first`: that call, compiles and restarts "
        f"included; `again`: the same call again (compiled). 1-minute load average {load[0]:.1f} "
        f"before, {load[1]:.1f} after; {time.perf_counter() - t_start:.0f} s in all.", "",
        markdown_table(rows, list(rows[0])), ""])
    save_results("simulate_slots", dict(trace=str(TRACE), rows=rows), md)
    print(md)


if __name__ == "__main__":
    main()
