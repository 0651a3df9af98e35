"""How a replay sizes its request slots: every request alive in a slot, found by restarts or
from a bound; or arrivals past the slots waiting outside them (the window).

    python benchmarks/slot_bound.py [--requests 1000] [--simulate-requests 2000]

A replay's request slots are a static size, and every slot costs each step. Three ways:

  restarts:  slots for every request alive at once, found by restarting with twice as many
             while some run has more (`sweep` starting from 2 x max_num_seqs, at least 64;
             `simulate` from up to 1024): one more compile each time
  bound:     the same, starting no lower than `capacity.surely_alive` (pow2 of it), a lower
             bound on the requests alive at once in every run
  window:    the default: arrivals past the slots wait outside them, behind the waiting
             queue, from max_num_seqs slots (at least 64: `sweep` always, `simulate` past
             1024 requests); a step whose admission walk may reach past the slots restarts
             with twice as many

Traces, with the prompts and outputs of benchmarks/sweep.py's:

  offline batch:  --requests requests, all at step 0 (`LLM.generate` on a list)
  200 a step:     the same requests, 200 arriving a step
  overloaded:     benchmarks/sweep.py's 500-request trace at 2 requests a step, more than
                  the grid serves
  stream:         benchmarks/sweep.py's 500-request trace (0.5 a step): it fits the usual
                  slots, nothing changes (the control)

Each swept over max_num_seqs {32, 64} x num_device_blocks {256, 512} (the map path, pruned,
default threads), and `simulate` of one configuration (max_num_seqs 64, 512 blocks) on an
offline batch of --simulate-requests, all three ways; each in a fresh process without a compilation cache, so every compile is paid as
a first start pays it. Rows are checked equal across the ways. Results go to
benchmarks/results/slot_bound.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _common import machine, save_results

BENCH = os.path.dirname(os.path.abspath(__file__))
AXES = dict(max_num_seqs=[32, 64], num_device_blocks=[256, 512])
SIMULATED = dict(max_num_seqs=64, num_device_blocks=512)
WAYS = {"restarts": (False, False), "bound": (True, False), "window": (True, True)}   # (bound, window)

# A fresh process: one sweep or simulate, its numbers as JSON on the last line.
START = """
import hashlib, json, sys, time
sys.path.insert(0, {bench!r})
from jaxsched.entrypoints.xla_flags import use_xla_flags
use_xla_flags()
import jaxsched.sim.capacity, jaxsched.sim.simulate as sim
from jaxsched.sim import sweep as sw
from slot_bound import AXES, SIMULATED, make_trace
if not {bound}:
    jaxsched.sim.capacity.surely_alive = sim.surely_alive = lambda *a: 0
sw.WINDOW = sim.WINDOW = {window}
trace = make_trace({kind!r}, {requests})
t0 = time.perf_counter()
if {entry!r} == "sweep":
    stats = {{}}
    rows = sw.sweep(trace, **AXES, progress=False, stats=stats)
    out = dict(num_slots=stats["num_slots"], restarts=stats["restarts"], window=stats["window"],
               compile_s=stats["compile_s"], run_s=stats["run_s"])
else:
    starts, replay = [], sim._replay
    sim._replay = lambda tr, cfg, *a: starts.append(cfg.num_slots) or replay(tr, cfg, *a)
    result = sim.simulate(dict(trace["config"], **SIMULATED), trace["requests"])
    rows = [len(result["steps"]), result["num_preemptions"]]
    out = dict(num_slots=starts[-1], restarts=len(starts) - 1, window={window})
out["wall_s"] = time.perf_counter() - t0
out["rows"] = hashlib.sha1(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:12]
print(json.dumps(out))
"""


def make_trace(kind: str, requests: int) -> dict:
    """One of the docstring's traces."""
    from sweep import TRACE

    from jaxsched.sim.workload import generate_trace

    if kind == "stream":
        return generate_trace(**TRACE)
    if kind == "overloaded":
        return generate_trace(**dict(TRACE, rate=2.0))
    trace = generate_trace(**dict(TRACE, num_requests=requests))
    per_step = requests if kind == "offline batch" else 200
    for i, r in enumerate(trace["requests"]):
        r["arrival_step"] = i // per_step
    return trace


def fresh(kind: str, requests: int, entry: str, bound: bool, window: bool) -> dict:
    code = START.format(bench=BENCH, bound=bound, window=window, kind=kind, requests=requests, entry=entry)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from jaxsched.entrypoints.cli_sweep import markdown_table
    from jaxsched.sim.capacity import surely_alive
    from jaxsched.sim.sweep import make_grid, parse_values
    from jaxsched.sim.trace import parse_trace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--simulate-requests", type=int, default=2000)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows = []
    cases = [(kind, args.requests, "sweep") for kind in ("offline batch", "200 a step", "overloaded", "stream")]
    cases.append(("offline batch", args.simulate_requests, "simulate"))
    for kind, requests, entry in cases:
        trace = parse_trace(make_trace(kind, requests))
        axes = AXES if entry == "sweep" else {k: [v] for k, v in SIMULATED.items()}
        _, configs = make_grid(trace.scheduler_config,
                               {k: parse_values(k, ",".join(map(str, v))) for k, v in axes.items()})
        least = surely_alive(trace, configs)
        outs = []
        for way, (bound, window) in WAYS.items():
            out = fresh(kind, requests, entry, bound, window)
            outs.append(out)
            rows.append(dict(trace=kind, requests=len(trace.requests), entry=entry, surely_alive=least,
                             way=way, **{k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}))
            print(rows[-1], flush=True)
        if len({o["rows"] for o in outs}) != 1:
            raise SystemExit(f"{kind} {entry}: the rows differ between the ways: {outs}")
    cols = ["trace", "requests", "entry", "surely_alive", "way", "num_slots", "restarts",
            "compile_s", "run_s", "wall_s"]
    table = [{c: r.get(c, "-") for c in cols} for r in rows]
    md = "\n".join([
        f"# Sizing a replay's request slots {machine()}", "",
        f"`python benchmarks/slot_bound.py --requests {args.requests} --simulate-requests "
        f"{args.simulate_requests}`: each row a fresh process, no compilation cache; the ways "
        f"(the script's doc): `restarts` (every request alive in a slot, found by restarts: sweep "
        f"from 2 x max_num_seqs, at least 64; simulate from up to 1024), `bound` (the same, from "
        f"`capacity.surely_alive`), `window` (the default: arrivals past the slots wait outside "
        f"them). The sweep is max_num_seqs {{32, 64}} x num_device_blocks {{256, 512}}, simulate one "
        f"configuration (max_num_seqs 64, 512 blocks); num_slots is the last start's; rows equal "
        f"across the ways. 1-minute load average {load:.1f} before, {os.getloadavg()[0]:.1f} after; "
        f"{time.perf_counter() - t0:.0f} s in all.", "",
        markdown_table(table, cols), ""])
    print(md)
    save_results("slot_bound", dict(machine=machine(), args=vars(args), rows=rows), md)


if __name__ == "__main__":
    main()
