"""How far pruning is from its floor: the run-steps a pruned sweep makes against what a
chunk-by-chunk "follow a run in the same state" scheme would make.

    python benchmarks/sweep_prune_floor.py [--sizes 64,1024]

The 500-request trace and grids of `benchmarks/sweep.py`. For each size:
  pruned:  the default sweep (sim/sweep_prune.py: answered configurations not run, the others
           resumed from an earlier run's state while its decisions are theirs); the steps
           each wave's runs make, from their start to their last step (and rounded up to
           whole chunks, what the compiled call steps)
  floor:   every configuration run to the end, its state hashed at every chunk boundary
           (limits and the queue-order hint left out: neither changes a decision). Then,
           chunk by chunk, configurations in the order of the roots (largest device pool,
           then max_num_seqs, first): a configuration's chunk need not be made when some
           configuration made in that chunk is in the same state at its start and that
           chunk's least slack proves every test of the two would come out the same
           (`sweep_prune._tests_agree`, the proof pruning uses). The sum of the chunks
           made, in steps: about what pruning could reach if any run could follow any
           other, join and leave it at every chunk, for free (leaders picked greedily in
           that order, so an estimate of the floor, not a proven minimum).
  oracle:  the same, with "proves" replaced by "the two are in the same state at the chunk's
           end too" (no proof: what an exact comparison of futures would allow).
Results go to benchmarks/results/sweep_prune_floor.{json,md}.
"""
from __future__ import annotations

import argparse
import hashlib
import platform
import time

import numpy as np
from _common import save_results
from sweep import SWEPT, TRACE, grid

from jaxsched.entrypoints.xla_flags import use_xla_flags

use_xla_flags()

from jaxsched.core import state as state_mod  # noqa: E402
from jaxsched.entrypoints.cli_sweep import markdown_table  # noqa: E402
from jaxsched.sim import sweep as sw  # noqa: E402
from jaxsched.sim import sweep_prune  # noqa: E402
from jaxsched.sim.simulate import CHUNK_STEPS  # noqa: E402
from jaxsched.sim.workload import generate_trace  # noqa: E402

# Fields left out of a state's hash: the limits (they differ by design) and the cached queue
# order, a hint the scheduler checks before it uses it.
UNHASHED = tuple(state_mod.LIMIT_FIELDS) + ("walk_order",)


def _hooked(on_replay, on_rows):
    """Wrap the sweep's `_replay` and `_rows` (internals: this is a measurement)."""
    replay, rows = sw._replay, sw._rows

    def replay_(trace, configs, *args, **kwargs):
        return replay(trace, configs, *args, **on_replay(configs, kwargs))

    def rows_(carry, index, stats):
        on_rows(carry)
        return rows(carry, index, stats)
    sw._replay, sw._rows = replay_, rows_
    return lambda: setattr(sw, "_replay", replay) or setattr(sw, "_rows", rows)


def states_by_chunk(trace, axes):
    """Every configuration run to the end: (configs, steps, hashes {(config, boundary): digest},
    slack {(config, chunk): (block, seq)})."""
    hashes, slack, seen = {}, {}, {}

    def on_replay(configs, kwargs):
        seen["configs"] = configs

        def watch(ran, chunks, rec, read):
            states = read(list(ran))        # (reading also gives the states' dims)
            lay = state_mod.layout(seen["dims"])
            blank = [(lay[n][0], lay[n][1], int(np.prod(lay[n][2]))) for n in UNHASHED]
            for run, chunk, r, (leaves, per) in zip(ran, chunks, rec, states):
                slack[(int(run), int(chunk))] = (int(r[:, sw.C_BLOCK_SLACK].min()), int(r[:, sw.C_SEQ_SLACK].min()))
                leaves = [np.array(x) for x in leaves]
                for leaf, offset, size in blank:
                    leaves[leaf][offset:offset + size] = 0
                digest = hashlib.sha1(b"".join(x.tobytes() for x in leaves) + np.asarray(per).tobytes())
                hashes[(int(run), int(chunk) + 1)] = digest.digest()
        return dict(kwargs, watch=watch)

    undo = _hooked(on_replay, lambda carry: seen.setdefault("dims", carry[0].dims))
    try:
        rows = sw.sweep(trace, **axes, progress=False, prune=False)
    finally:
        undo()
    return seen["configs"], np.array([r["steps"] for r in rows]), hashes, slack


def made_by_pruning(trace, axes) -> tuple[int, int, int]:
    """(steps the default pruned sweep makes, the same in whole chunks, runs made)."""
    waves = []

    def on_replay(configs, kwargs):
        waves.append((configs, {i: s.step for i, s in (kwargs.get("starts") or {}).items()}))
        return kwargs

    undo = _hooked(on_replay, lambda carry: None)
    try:
        rows = sw.sweep(trace, **axes, progress=False)
    finally:
        undo()
    steps = {tuple(r[k] for k in SWEPT): r["steps"] for r in rows}
    left = [steps[tuple(getattr(c, k) for k in SWEPT)] - starts.get(i, 0)
            for configs, starts in waves for i, c in enumerate(configs)]
    return sum(left), sum(-(-n // CHUNK_STEPS) * CHUNK_STEPS for n in left), len(left)


def floor_chunks(configs, steps, hashes, slack, oracle: bool) -> int:
    """Chunks that must be made when any configuration may follow any made in the same chunk
    (see the module doc)."""
    field = lambda name: np.array([getattr(c, name) for c in configs])   # noqa: E731
    blocks, seqs, host = field("num_device_blocks"), field("max_num_seqs"), field("num_host_blocks")
    mode = [c.preemption_mode for c in configs]
    order = sorted(range(len(configs)), key=lambda i: (-blocks[i], -seqs[i], str(mode[i])))
    chunks = -(-steps // CHUNK_STEPS)
    state = lambda i, b: hashes.get((i, b)) if b else b"start"   # noqa: E731
    made = 0
    for c in range(int(chunks.max())):
        ran: list[int] = []
        for x in order:
            if c >= chunks[x]:
                continue
            for r in ran:
                if state(x, c) is None or state(x, c) != state(r, c):
                    continue
                if oracle:
                    ok = state(x, c + 1) is not None and state(x, c + 1) == state(r, c + 1)
                else:
                    ok = bool(sweep_prune._tests_agree(blocks[x], seqs[x], blocks[r], seqs[r],
                                                       mode[x] == mode[r] and host[x] == host[r], *slack[(r, c)]))
                if ok:
                    break
            else:
                ran.append(x)
        made += len(ran)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,1024")
    args = ap.parse_args()
    trace = generate_trace(**TRACE)
    began = time.perf_counter()
    table = []
    for size in (int(s) for s in args.sizes.split(",")):
        axes = grid(size)
        configs, steps, hashes, slack = states_by_chunk(trace, axes)
        made, made_chunked, runs = made_by_pruning(trace, axes)
        floor = floor_chunks(configs, steps, hashes, slack, oracle=False) * CHUNK_STEPS
        oracle = floor_chunks(configs, steps, hashes, slack, oracle=True) * CHUNK_STEPS
        total = int(steps.sum())
        table.append(dict(configs=size, grid_run_steps=total, pruned_made=made, pruned_made_chunks=made_chunked,
                          runs_made=runs, floor=floor, oracle=oracle,
                          pruned_share=round(made_chunked / total, 3), floor_share=round(floor / total, 3),
                          pruned_over_floor=round(made_chunked / floor, 2)))
        print(table[-1], flush=True)
    lines = [f"# How far pruning is from its floor ({platform.machine()})", "",
             f"`python benchmarks/sweep_prune_floor.py --sizes {args.sizes}`: the 500-request trace and "
             f"grids of `benchmarks/sweep.py`. Steps made by the default pruned sweep (from each run's "
             f"start; in whole chunks of {CHUNK_STEPS}), against the (greedy) floor of a scheme in which a "
             f"configuration follows another in the same state while pruning's slack proof holds, and "
             f"the oracle floor (same state at the chunk's end, no proof); see the script's doc. "
             f"{time.perf_counter() - began:.0f} s in all.", "", markdown_table(table, list(table[0]))]
    save_results("sweep_prune_floor", dict(sizes=args.sizes, table=table), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
