"""Capacity sweeps: one trace under a grid of scheduler limits, all runs in one compiled call.

    rows = sweep(trace, num_device_blocks=range(64, 1025, 64), max_num_seqs=[8, 16, 32, 64],
                 preemption_mode=["recompute", "swap"])

Every run shares one static `Capacity` (the largest pool sizes of the grid); what differs is
a per-run `Limits` (`state.stacked_limits`), stacked along a leading run axis, so changing
limits never recompiles. One jitted call steps all runs `CHUNK_STEPS` steps; the host loops
over chunks only (a tqdm bar counts finished requests), until every run has finished every
request:

    host:    chunk 0 ──> chunk 1 ──> ... ──> all runs drained
    device:  over runs r (jax.vmap, or a loop over the live ones) ── lax.scan over steps t ──
                 add_requests, schedule, update, free_finished

A step is the same composition of public transitions as `simulate`'s, and each run's
metrics are read from per-step records of that step, so a row equals what `simulate`
reports for its configuration.

Two ways to step a batch of runs inside the compiled call (`vmap_runs`):

  the map path (vmap_runs=1): one live run after another; each run's `lax.cond` skips are
      its own, and a drained run (or padding) is not visited. The runs go in blocks of
      MAP_BLOCK, one call of the compiled chunk per block with a live run, stepped on one
      host thread per core (`threads`: each takes the next block, the fullest first), or, on
      request, one shard of blocks per worker process pinned to a CPU (`workers`,
      sim/sweep_workers.py).
  jax.vmap (vmap_runs > 1): groups of runs stepped together, with their run axis named and
      the step traced under `core.batching.runs_axis`: every skip of the scheduler is
      decided once for the group (the predicate an `any` over runs, so a `lax.cond` stays a
      cond; the work is done for all when some run needs it, and each run keeps its own
      branch's result, or the work's result where that is the same, e.g. the general step
      for a steady decode step). Between chunks, runs that have drained are dropped from
      the batch (compaction to a power of two per shard, at most log4(runs) + 1 shapes).

Default, by measurement (benchmarks/sweep.py, benchmarks/results/sweep.md): the map path
with one thread per core on CPU, where a step's cost is XLA's per-kernel overhead plus the
table-sized work of whichever branches run, so a batch that takes every branch any run
needs (some run of a grid admits, preempts or frees in almost every step) costs more per
run-step than each run taking only its own (about 2x at 16 and 64 runs on 2 cores); one
vmap over all runs on an accelerator, where the batch's kernels run in parallel and a step
costs about the same for 16 runs as for 1024 (3.3 us per run-step at 1024 on an H200,
0.06x the cost at 16: benchmarks/results/sweep_gpu.md). A vmapped batch skips what none of
its runs needs (`vmap_skips`, measured against masking every branch). Compile time is
reported apart (`stats`); one compiled chunk serves every batch of the same capacity and
shape within a process (on the map path every grid of a capacity, whatever its size: the
blocks are all MAP_BLOCK runs; and every trace of a nearby size: its request count and
longest sequence round up to `capacity.bucket`'s steps), and `jaxsched sweep` turns on the
persistent compilation cache across processes, where the chunk's executable is kept by
`executable_store`: a later start loads it without tracing or lowering it (about 1 s,
against 2.8 s through JAX's cache).

Not every configuration needs a run of its own (`prune`, sim/sweep_prune.py): each step
reports how much its block and max_num_seqs tests had to spare, so a run whose tests all
passed with room answers exactly for the configurations within that room, and a run whose
tests passed with room up to some step answers for the start of theirs. On the map path (the
CPU default) the runs go in up to three waves of the same batch shape: the largest
configuration of each group and mode, then each grid line's largest, then the
configurations no run made answers for; a run of a later wave resumes from the state of a
run made before, at the last chunk boundary up to which that run's decisions are its own
(`sweep_chunk` takes a first step per run), so it steps only the rest.

Request slots are a static size too, and every slot costs each step. Requests arriving while
they are full wait outside them, behind the waiting queue (`_step`'s window): the admission
walk reaches them only after every waiting request in a slot, so a step whose walk took all
of those may have reached past them, and voids the run. The slots then hold the running, the
swapped and the waiting the walk may reach, and a sweep starts with max_num_seqs of them (at
least 64). Where some request is ignored on arrival (SPEC B6: n above max_num_seqs, which
must finish at its arrival step), every request alive gets a slot instead, from 2 x
max_num_seqs (at least 64) or what the trace surely needs (`capacity.surely_alive`: a
burst). A run that needs more slots restarts the sweep with twice as many (one more
compile); results never depend on the slot count, only the speed does. With half slots a
run steps at half of them while that surely holds it (sim/sweep_slots.py; `half_slots`: by
default once their chunk is compiled).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsched.core import batching
from jaxsched.core.block_pool import true_indices
from jaxsched.core.config import PREEMPT_RECOMPUTE, PREEMPT_SWAP, SchedulerConfig
from jaxsched.core.costs import PreemptionCosts
from jaxsched.core.walks import BIG
from jaxsched.core.xla_options import replay_options
from jaxsched.sim import executable_store, sweep_prune, sweep_slots, sweep_workers
from jaxsched.sim.capacity import bucket, longest_sequence, needed_capacity, pow2, replay_capacity, window_exact
from jaxsched.sim.simulate import (CHUNK_STEPS, arrival_table, batch_at, burst_width, replay_step, window_batch,
                                   window_width)
from jaxsched.core.state import (EMPTY, FINISHED, IGNORED, LIMIT_FIELDS, empty_state, layout,
                                 stacked_limits)
from jaxsched.sim.trace import Trace, TraceError, parse_trace
# "auto" is the cost-based mode (the trace config's preemption_costs, else the default
# costs); vLLM's default (None: recompute one sequence, swap more) is "default" or "none".
MODES = {"auto": "auto", "default": None, "none": None, "recompute": "recompute", "swap": "swap"}
# Sweepable limits, in grid order (the first varies slowest), and how to read their values.
SWEEP_FIELDS = ("preemption_mode", "max_num_seqs", "num_device_blocks", "num_host_blocks",
                "max_num_batched_tokens", "max_model_len", "watermark", "delay_factor")
# vLLM's memory knobs: turned into block counts by jaxsched.sizing (memory_grid).
MEMORY_FIELDS = ("gpu_memory_utilization", "swap_space")
FLOAT_FIELDS = ("watermark", "delay_factor") + MEMORY_FIELDS
STATIC_FIELDS = ("block_size", "enable_chunked_prefill", "artificial_preemption", "seed")
# Static too, but an axis: one sweep per value (`_sweep_caching`).
CACHING_FIELD = "enable_prefix_caching"
# Per-step record of one run, int32[NUM_COLS] (a StepTimeModel reads prefill, decode, swaps).
# The slack columns are the scheduler's (SchedulerOutput.block_slack, seq_slack): sweep_prune.
(C_FINISHED, C_RECOMPUTE, C_SWAP, C_SWAP_OUT, C_SWAP_IN, C_SWAPPED_IN, C_FREE_DEVICE,
 C_FREE_HOST, C_PREFILL_TOKENS, C_DECODE_SEQS, C_OVERFLOW, C_BLOCK_SLACK, C_SEQ_SLACK) = range(13)
NUM_COLS = 13


class SweepError(ValueError):
    """A bad sweep specification; the message is one line naming the field."""


# ----------------------------------------------------------------------------- the grid

def parse_values(field: str, spec) -> list:
    """A sweep axis: a list, one value, or a spec string "a,b,c" or "start:stop:step" (inclusive)."""
    if field not in SWEEP_FIELDS + MEMORY_FIELDS:
        raise SweepError(_not_sweepable(field))
    if isinstance(spec, str):
        if field != "preemption_mode" and ":" in spec:
            values = _parse_range(field, spec)
        else:
            values = [v.strip() for v in spec.split(",")]
    elif isinstance(spec, (list, tuple, range, np.ndarray)):
        values = list(spec)
    else:
        values = [spec]
    if not values:
        raise SweepError(f"sweep: {field}: no values")
    return [_parse_one(field, v) for v in values]


def _not_sweepable(field: str) -> str:
    if field in STATIC_FIELDS:
        return (f"sweep: {field} is static (it fixes the compiled shapes or program), not a "
                f"per-run limit; run one sweep per value")
    return f"sweep: unknown field {field!r} (sweepable: {', '.join(SWEEP_FIELDS)})"


def _static_values(spec) -> list:
    """The values of a static field's spec: "a,b", a list or tuple, or one value."""
    if isinstance(spec, str):
        return spec.split(",")
    return list(spec) if isinstance(spec, (list, tuple)) else [spec]


def _static_value(field: str, spec):
    """One value of a static field (it overrides the trace's config); a list of several is an error."""
    values = _static_values(spec)
    if len(values) != 1:
        raise SweepError(_not_sweepable(field))
    value = values[0]
    if isinstance(value, str):
        text = value.strip().lower()
        if field in ("enable_chunked_prefill", "artificial_preemption", CACHING_FIELD):
            if text not in ("true", "false", "1", "0"):
                raise SweepError(f"sweep: {field}: expected true or false, got {value!r}")
            return text in ("true", "1")
        if not text.isdigit():
            raise SweepError(f"sweep: {field}: {value!r} is not an integer")
        return int(text)
    return value


def _costs(value) -> PreemptionCosts:
    """A cost model from an object, a dict or a JSON file (a path)."""
    try:
        if isinstance(value, (str, Path)):
            return PreemptionCosts.from_json(value)
        return PreemptionCosts.coerce(value)
    except (TypeError, ValueError) as e:
        raise SweepError(f"sweep: preemption_costs: {e}") from None


def _parse_range(field: str, spec: str) -> list:
    if spec.count(":") != 2:
        raise SweepError(f"sweep: {field}: bad range {spec!r}: expected start:stop:step with "
                         f"all three parts (inclusive), e.g. 64:1024:64, or a list like 64,128")
    try:
        start, stop, step = (float(x) if field in FLOAT_FIELDS else int(x) for x in spec.split(":"))
    except ValueError:
        raise SweepError(f"sweep: {field}: bad range {spec!r} (expected start:stop:step)") from None
    if step <= 0:
        raise SweepError(f"sweep: {field}: step must be > 0 in {spec!r}")
    if start > stop:
        raise SweepError(f"sweep: {field}: empty range {spec!r} (start > stop)")
    count = int(math.floor((stop - start) / step + 1e-9)) + 1
    if field in FLOAT_FIELDS:                 # 0.5:0.9:0.1 gives 0.6, not 0.6000000000000001
        return [round(start + i * step, 9) for i in range(count)]
    return [start + i * step for i in range(count)]


def _parse_one(field: str, value):
    if field == "preemption_mode":
        key = "none" if value is None else str(value).lower()
        if key not in MODES:
            raise SweepError(f"sweep: unknown preemption_mode {value!r} "
                             f"(expected recompute, swap, auto or default)")
        return MODES[key]
    kind = float if field in FLOAT_FIELDS else int
    try:
        number = kind(value) if isinstance(value, str) else value
    except ValueError:
        what = "a number" if kind is float else "an integer"
        raise SweepError(f"sweep: {field}: {value!r} is not {what}") from None
    if kind is int and (isinstance(number, bool) or not isinstance(number, (int, np.integer))):
        raise SweepError(f"sweep: {field}: {value!r} is not an integer")
    return kind(number)


def make_grid(base: SchedulerConfig, axes: dict) -> tuple[list[dict], list[SchedulerConfig]]:
    """Every combination of the axes (in SWEEP_FIELDS order), validated as SchedulerConfigs."""
    names = [f for f in SWEEP_FIELDS if f in axes]
    points, configs = [], []
    for combo in itertools.product(*(axes[f] for f in names)):
        point = dict(zip(names, combo))
        try:
            configs.append(dataclasses.replace(base, **point))
        except ValueError as e:
            where = ", ".join(f"{k}={v}" for k, v in point.items())
            raise SweepError(f"sweep: {where}: {e}") from None
        points.append(point)
    return points, configs


def sweep_capacity(trace: Trace, configs: list[SchedulerConfig], capacity: dict | None = None,
                   window: bool = False) -> dict:
    """Static sizes for a grid (SchedulerConfig capacity fields); explicit ones must hold it.
    With `window`, the slots need not hold a backlog of arrived requests (`_step`).

    Pass the same dict to `simulate(..., capacity=...)` to share its compiled step.
    """
    least = needed_capacity(trace, configs)
    why = {  # field: why not, given a value below the least
        "num_device_blocks_capacity": f"num_device_blocks={least['num_device_blocks_capacity']} is above "
                                      f"the static capacity",
        "num_host_blocks_capacity": f"num_host_blocks={least['num_host_blocks_capacity']} is above the "
                                    f"static capacity",
        "max_seqs_per_group": f"a request has n={least['max_seqs_per_group']}, above the static capacity",
        "max_blocks_per_seq": f"sequences of up to {longest_sequence(trace, configs)} tokens need "
                              f"{least['max_blocks_per_seq']} blocks, above the static capacity",
        "num_slots": "capacity needs a positive",
    }
    # num_slots is a guess (without the window, at least what the trace surely needs): a run
    # that needs more restarts the sweep with twice as many.
    cap = replay_capacity(trace, configs, restarts=True, backlog=window)
    # Pools rounded up to powers of two, so grids of nearby sizes share one compiled chunk
    # (in this process and in the persistent cache); a run never hands out blocks past its own.
    for key in ("num_device_blocks_capacity", "num_host_blocks_capacity"):
        cap[key] = pow2(cap[key])
    for key, value in (capacity or {}).items():
        if key not in least:
            raise SweepError(f"sweep: unknown capacity field {key!r} (expected one of {', '.join(least)})")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least[key]:
            raise SweepError(f"sweep: {why[key]} {key}={value!r}")
        cap[key] = int(value)
    return cap


# ----------------------------------------------------------------------------- the device loop

def _run_record(state, out, overflow):
    """A sweep run's record of a step, int32[NUM_COLS] (counts only: rows need no slots),
    and what `_step` stamps per request for the groups that finished."""
    finished = state.status == FINISHED
    count = lambda mask: mask.sum(dtype=jnp.int32)
    record = jnp.stack([
        count(finished), count(out.preempted == PREEMPT_RECOMPUTE), count(out.preempted == PREEMPT_SWAP),
        out.num_swap_out, out.num_swap_in, count(out.swapped_in),
        out.num_free_device_blocks, out.num_free_host_blocks,
        jnp.where(out.is_prefill, out.num_scheduled_tokens, 0).sum(dtype=jnp.int32),
        jnp.where(out.scheduled & ~out.is_prefill, out.num_seqs, 0).sum(dtype=jnp.int32),
        overflow, out.block_slack, out.seq_slack]).astype(jnp.int32)
    # Output tokens so far of each group's longest sequence: its first token is when this
    # turns positive, its count at the finish is what TPOT divides by.
    output_len = jnp.where(state.status != EMPTY, state.num_tokens.max(-1) - state.prompt_len, 0)
    return record, finished, state.request_index, state.finish_reason, output_len


def _step(carry, x, cols, arrival_time, tokens, cap, width, window, padding):
    """One replay step of one run (simulate's `replay_step`) and its int32[NUM_COLS] record.

    Every step takes the scheduler's general step (no steady path): its decode-only
    branches cost the 64-configuration chunk 26 of 409 kernels and 1556 of 12329 HLO
    instructions, and bought nothing here, where arrivals keep the queues busy. Without
    them, interleaved A/Bs (`benchmarks/sweep_ab.py --before 83c0be1`) gave 0.99-1.03x
    (best) and 1.01-1.03x (median) the cost per run-step at 64 configurations, 1.01x
    (median) pruned and at 1024 pruned, and a compile 0.5-1.1 s shorter (medians of fresh
    processes). `simulate` keeps the steady path: there its runs cost 0.9x what they cost
    without it.

    Without `window`, the requests arriving at step t go into slots; one that finds none
    voids the run (`overflow` in the record: more slots). With it, arrived requests go into
    free slots oldest first, up to `width` a step, and the rest wait outside them, behind
    the waiting queue (`replay_step`'s backlog): the slots need not hold a backlog the
    admission walk never reaches, and a step whose walk may have reached it voids the run.
    `padding`: the trace's padding requests (finished from the start, never slotted)."""
    # per_request: int32[4, N] finish step, reason, first-token step, output tokens at finish
    state, per_request = carry
    t, now = x
    if window:
        # Finished requests: those with a finish step, less the padding.
        batch, backlog = window_batch(state, cols, arrival_time, tokens, t,
                                      (per_request[0] >= 0).sum(dtype=jnp.int32) - padding, width)
    else:
        arrived = jnp.searchsorted(cols[0], t, side="right").astype(jnp.int32)
        batch = batch_at(cols, arrival_time, tokens, jnp.searchsorted(cols[0], t, side="left"), arrived, width)
        backlog = None
    state, (record, finished, index, reason, output_len), _ = replay_step(
        state, batch, now, cap, _run_record, backlog=backlog, steady_path=False)
    n = cols.shape[1]
    at = jnp.where(finished, index, n)
    # Rows 0, 1 and 3 in one scatter (a kernel each otherwise).
    per_request = per_request.at[np.array([[0], [1], [3]]), at].set(
        jnp.stack([jnp.broadcast_to(t, at.shape), reason, output_len]), mode="drop")
    first = (output_len > 0) & (per_request[2, jnp.minimum(index, n - 1)] < 0)
    per_request = per_request.at[2, jnp.where(first, index, n)].set(t, mode="drop")
    return (state, per_request), record


RUNS = "runs"       # the vmap axis name of a batch of runs (core.batching decides skips over it)
# Runs per call of the map path's compiled chunk (`_layout`). A fixed block makes the chunk
# one executable per capacity for every grid size; a block's call is 64 steps of up to 8
# runs (about 25 ms at 50 us a run-step), so its dispatch is noise, and a shard with few
# runs left calls only the blocks that hold them.
MAP_BLOCK = 8
# Grids from this many configurations (None: none by their size) step their runs at half
# the slots by default (on the map path on the CPU; `sweep(half_slots=None)`), and so does
# any grid whose half-slot chunk is compiled already. The half-slot chunk is a second
# compile as long as the first. With every request alive in a slot (slots 2 x
# max_num_seqs) most run-steps fit half of them and a cold start of 1024 configurations
# was about even with it; since arrivals past the slots wait outside them (max_num_seqs
# slots) only 5-6% do, and the runs gain nothing (1.01x at 1024: 27.0 s against 19.4 cold,
# benchmarks/results/sweep_half_slots.md).
HALF_SLOTS_FROM: int | None = None
# Arrivals past the slots may wait outside them (`_step`'s window); False gives every
# request alive a slot, restarting with twice as many until they fit (the sweep before the
# window: benchmarks/slot_bound.py compares the two).
WINDOW = True
# What a progress bar says while the chunk is loaded or compiled (`_chunk_found`; nothing
# when it is compiled in this process).
CHUNK_NOTES = {"store": "loading the compiled replay step",
               None: "compiling the replay step (once per capacity)"}
# Compiled programs of a sweep (`_compiled`): (function, static arguments, argument shapes,
# XLA options) -> executable: the chunk step per batch shape, and `first_batch`.
_EXECUTABLES: dict = {}
# id(executable) -> its serialized bytes (`serialized`); the executables live in _EXECUTABLES.
_SERIALIZED: dict = {}


@functools.partial(jax.jit, static_argnames=("cap", "width", "vmap_runs", "skips", "window"), donate_argnums=(0,))
def sweep_chunk(carry, cols, arrival_time, tokens, start, times, cap, width, vmap_runs, skips=True, window=False):
    """Steps start[r] .. start[r]+K-1 of every run r of the batch (K = times.shape[1]).

    `carry` is (state, per_request) with a leading run axis; returns it and the records
    int32[runs, K, NUM_COLS]. The trace (`cols`, `arrival_time`, `tokens`) is shared; each
    run has its own first step (int32[runs]) and times (float32[runs, K]), since a run may
    start from another's state (sweep_prune.Resumes).
    `vmap_runs` = 1: a loop over the live runs (the map path), each run's skips its own; a
    drained run (or padding) is not visited, not even copied. Else `jax.vmap` over groups
    of `vmap_runs` runs (a `lax.map` over the groups when that is fewer than all), traced
    under `batching.runs_axis`: every skip is decided once for the group, so the work is
    done when some run of the group needs it; with `skips` False, never skipped (masks
    only: `batching.runs_axis`). `window`: `_step`'s.
    """
    k = times.shape[1]
    runs = carry[1].shape[0]
    padding = (cols[0] == np.iinfo(np.int32).max).sum(dtype=jnp.int32)

    def chunk(c, first, when):
        steps = first + jnp.arange(k, dtype=jnp.int32)
        return lax.scan(lambda c, x: _step(c, x, cols, arrival_time, tokens, cap, width, window, padding), c,
                        (steps, when))

    # Records of a drained run are not read past its end: skipping its chunk changes nothing.
    drained = lambda c: (c[1][..., 0, :] >= 0).all(-1)                      # noqa: E731
    if vmap_runs == 1:
        # Only the live runs are visited, each unpacked to one leaf per field for its chunk
        # (a step's writes then touch only the fields they change, not a copy of the packed
        # state); a drained run or padding costs nothing, not even a copy of its state.
        live = ~drained(carry)
        order = true_indices(live)     # not a sort: worker processes are shipped this executable

        def visit(i, c):
            batch, rec = c
            r = order[i]
            row = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, r, keepdims=False), batch)
            (state, per_request), mine = chunk((row[0].per_field(), row[1]), start[r], times[r])
            row = (state.per_field(False), per_request)
            batch = jax.tree.map(lambda x, y: lax.dynamic_update_index_in_dim(x, y, r, 0), batch, row)
            return batch, lax.dynamic_update_index_in_dim(rec, mine, r, 0)
        return lax.fori_loop(0, live.sum(dtype=jnp.int32), visit,
                             (carry, jnp.zeros((runs, k, NUM_COLS), jnp.int32)))

    # Under vmap the state is stored one leaf per field inside the chunk, as above: a
    # step's writes copy the fields they change of every run of the batch, not all of them.
    carry = (carry[0].per_field(), carry[1])
    idle = lambda c, first, when: (c, jnp.zeros((k, NUM_COLS), jnp.int32))   # noqa: E731
    repack = lambda c, rec: ((c[0].per_field(False), c[1]), rec)             # noqa: E731

    def one(c, first, when):
        with batching.runs_axis(RUNS, skips):
            return batching.cond(~drained(c), chunk, idle, c, first, when, same=True)
    many = jax.vmap(one, axis_name=RUNS)
    if vmap_runs >= runs:
        return repack(*many(carry, start, times))
    args = jax.tree.map(lambda x: x.reshape(runs // vmap_runs, vmap_runs, *x.shape[1:]), (carry, start, times))
    groups, rec = lax.map(lambda a: many(*a), args)
    flat = lambda x: x.reshape(runs, *x.shape[2:])                           # noqa: E731
    return repack(jax.tree.map(flat, groups), flat(rec))


def _chunk_static(cap, width, vmap_runs, skips, compiler_options, window=False) -> tuple[dict, dict | None]:
    """`sweep_chunk`'s static arguments and XLA options (by default the replays':
    core/xla_options.py). One run per group is the map path, whose skips are each run's
    own: one executable."""
    if compiler_options is None:
        compiler_options = dict(replay_options()) or None
    return (dict(cap=cap, width=width, vmap_runs=vmap_runs, skips=skips or vmap_runs == 1, window=window),
            compiler_options)


def _executable(args, cap, width, vmap_runs, stats, compiler_options=None, skips=True, window=False):
    """The compiled `sweep_chunk` for these shapes (compiled once per process, and kept in
    `executable_store` while JAX's persistent cache is on; the time of a compile goes to
    stats['compile_s'], split into trace_s, lower_s, xla_s and save_s, or load_s for a stored
    one).
    `compiler_options` are XLA's for this executable (benchmarks/sweep_compile.py)."""
    static, options = _chunk_static(cap, width, vmap_runs, skips, compiler_options, window)
    return _compiled(sweep_chunk, args, static, stats, options, store=True)


def _chunk_ready(args, cap, width, window=False) -> bool:
    """Is the map path's chunk for these shapes (or jax.ShapeDtypeStructs) compiled in this
    process already, or kept in `executable_store`: free to use?"""
    return _chunk_found(args, cap, width, 1, True, window) is not None


def _chunk_found(args, cap, width, vmap_runs, skips, window) -> str | None:
    """Where `sweep_chunk` for these shapes already is: "process" (compiled in this one),
    "store" (kept in `executable_store`), or None (it must be compiled)."""
    static, options = _chunk_static(cap, width, vmap_runs, skips, None, window)
    if _key(sweep_chunk, args, static, options) in _EXECUTABLES:
        return "process"
    return "store" if executable_store.stored(sweep_chunk.__name__, static, args, options) else None


def _key(fn, args, static: dict, compiler_options) -> tuple:
    shapes = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(args))
    return fn, tuple(static.items()), shapes, tuple(sorted((compiler_options or {}).items()))


def _compiled(fn, args, static: dict, stats, compiler_options=None, store: bool = False):
    """`fn` (a jitted function) compiled for these arguments' shapes and its static
    arguments, once per process, its compile time counted in `stats`. With `store`, through
    `executable_store` (looked up before anything is traced, saved once compiled)."""
    key = _key(fn, args, static, compiler_options)
    exe = _EXECUTABLES.get(key)
    if exe is None:
        exe, blob = executable_store.compile_or_load(fn, args, static, compiler_options, stats, store)
        _EXECUTABLES[key] = exe
        if blob is not None:
            _SERIALIZED[id(exe)] = blob
    return exe


def serialized(exe) -> bytes:
    """A compiled chunk's bytes, for a worker process: what the store gave, or the
    executable serialized once (the chunks are compiled by XLA, never taken from JAX's
    cache: `executable_store.compile_fresh`)."""
    blob = _SERIALIZED.get(id(exe))
    if blob is None:
        blob = _SERIALIZED[id(exe)] = executable_store.serialized(exe)
    return blob


@functools.partial(jax.jit, static_argnames=("capacity",))
def first_batch(limits, per_request, seed, artificial_count, capacity):
    """The starting carry (state, per_request) of a block or shard of runs: an empty state
    of `capacity` for each run, with that run's `limits` (stacked), and its per_request
    rows. One compiled call per capacity and block shape: built eagerly, the same takes a
    few dozen small XLA compiles and dispatches of its own (about 2 s of a first sweep)."""
    runs = per_request.shape[0]
    one = empty_state(capacity, jax.tree.map(lambda x: x[0], limits), seed, artificial_count)
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (runs,) + x.shape), one).replace(limits=limits)
    return state, per_request


def default_threads() -> int:
    """Host threads a sweep uses by default: the usable CPU cores on the CPU backend, where
    the threads step the runs (on the map path, block after block); 1 on an accelerator
    (one vmap steps them all)."""
    if jax.default_backend() != "cpu":
        return 1
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # not on Linux
        return os.cpu_count() or 1


def default_vmap_skips() -> bool:
    """Whether a vmapped sweep skips the work no run of its batch needs, by default: yes on
    every backend measured. On the CPU a step costs the work of the branches it runs (no
    skips: 6.8x the cost at 16 runs, 8.0x at 64; benchmarks/results/sweep_skips_cpu.md); on
    an H200, where each conditional also copies its predicate to the host, the branches no
    run needed still cost more (no skips: 0.94x as fast at 1024 runs, 0.25x at 16;
    benchmarks/results/sweep_gpu.md)."""
    return True


def _shard_size(live: int, first: int, shards: int, vmap_runs: int) -> tuple[int, int]:
    """(runs per shard, runs per vmap group) of a vmapped batch for `live` runs left of
    `first`. The first batch holds every run; a compacted one a power of two per shard, so
    a sweep compiles for at most log2(runs) + 1 batch shapes. (The map path steps blocks of
    MAP_BLOCK runs instead: `_layout`.)"""
    size = -(-live // shards)
    if live < first:
        size = min(pow2(size), -(-first // shards))
    group = min(vmap_runs, size)
    if 1 < group < size:
        size = -(-size // group) * group
    return size, group


def _layout(positions: int, threads: int, vmap_runs: int) -> tuple[int, int, int, int]:
    """(shards, runs per block, runs per vmap group, blocks per shard) for a batch of
    `positions` runs on `threads` host threads (or worker processes).

    Each block is stepped by one call of the compiled chunk (by whichever host thread is
    free, or by the worker process holding its shard). On the map path a block is
    MAP_BLOCK runs whatever the grid, padded with drained runs that are never visited (nor
    is a block with no live run called), so one executable per capacity serves grids of
    every size; a vmapped batch is one block per shard (`_shard_size`)."""
    shards = max(1, min(threads, positions))
    if vmap_runs == 1:
        return shards, MAP_BLOCK, 1, -(-positions // (shards * MAP_BLOCK))
    size, group = _shard_size(positions, positions, shards, vmap_runs)
    return shards, size, group, 1


def _deal(count: int, total: int, shards: int, work=None) -> np.ndarray:
    """The item at each of `total` positions (-1: padding) for `count` items: shard i (the
    i-th run of `total // shards` positions) gets items i, i + shards, ...: neighbours in the
    grid cost alike, so dealing them out evens the shards' work (a chunk waits for the
    slowest shard). With `work` (an estimate per item), the most work first, each to the
    shard with the least so far (runs that start late cost less)."""
    if work is None or shards == 1:
        deal = np.argsort(np.arange(total) % shards, kind="stable")
        return np.where(deal < count, deal, -1)
    per = total // shards
    load, filled = np.zeros(shards), [[] for _ in range(shards)]
    for item in np.argsort(-np.asarray(work, float), kind="stable"):
        shard = min((k for k in range(shards) if len(filled[k]) < per), key=lambda k: load[k])
        filled[shard].append(item)
        load[shard] += work[item]
    return np.concatenate([np.array(f + [-1] * (per - len(f)), np.int64) for f in filled])


@dataclasses.dataclass
class Start:
    """Where a run starts other than empty: at `step` (a chunk boundary), from `state` (the
    packed state's leaves and per_request rows, host arrays, of a run whose decisions are
    this run's up to there; its limits are replaced), with `finished` requests done, the last
    at step `last`."""
    step: int
    state: tuple
    finished: int
    last: int


def _limit_columns(dims: tuple) -> dict[int, np.ndarray]:
    """{leaf: the columns of a packed state's leaf that hold the limits}."""
    lay, out = layout(dims), {}
    for name in LIMIT_FIELDS:
        leaf, offset, shape = lay[name]
        out.setdefault(leaf, []).append(np.arange(offset, offset + math.prod(shape)))
    return {leaf: np.concatenate(cols) for leaf, cols in out.items()}


def _replay(trace: Trace, configs: list[SchedulerConfig], cap: dict, vmap_runs: int, progress: bool,
            threads: int = 1, stats: dict | None = None, skips: bool = True, batch: int | None = None,
            label: str = "sweep", starts: dict | None = None, watch=None, work=None, workers: bool = False,
            half_slots: bool | None = False, window: bool = False):
    """Run every config to the end; (records [runs, T, NUM_COLS], per_request [runs, 4, N]) or
    None when some run had more requests alive than slots. `batch` (at least the runs):
    the batch is shaped as for that many runs, the rest padding (so a wave of a pruned
    sweep shares the whole grid's compiled chunk). `label` names the progress bar.
    `starts` ({run: Start}): runs that start from another's state; their records before
    the start are left zero. `watch(runs, chunks, records, read)` is called after each chunk
    with the runs that stepped, the global index of the chunk each made, their records, and
    `read(runs)`, which returns their states now (host arrays, as Start.state). `work`:
    each run's steps to make, estimated, to even the shards' work (`_deal`). `workers`: on
    the map path with two shards or more, each shard is held and stepped by a worker
    process pinned to its own CPU (`sweep_workers`) instead of a host thread.

    The runs are stacked in a batch, split into `threads` equal shards (dealt to even their
    work), each of blocks of runs, a block per call of the same compiled chunk (`_layout`:
    on the map path MAP_BLOCK runs). On host threads (XLA releases the GIL while it runs)
    each thread steps the next block with live runs, the fullest first; a worker process
    steps its own shard's. Between
    chunks, runs that have drained are dropped from the batch (compaction): when the runs
    left fit a quarter of the batch (a power of two per shard) they are gathered into it, so a long
    tail of slow runs does not carry the whole grid (vmapped runs only: the map path does
    not visit a drained run). Padding positions hold a copy of a run
    (drained, or the grid's last at the start); their records are never read.
    """
    from tqdm.auto import tqdm

    stats = {} if stats is None else stats
    starts = starts or {}
    cap_config = dataclasses.replace(configs[0], **cap)
    reqs, runs = trace.requests, len(configs)
    positions = max(runs, batch or 0)
    shards, size, group, per_shard = _layout(positions, threads, vmap_runs)
    blocks = shards * per_shard     # carries of `size` runs; shard i steps blocks i*per_shard..
    # Workers start now, so that they load while the parent compiles.
    remote = sweep_workers.Shards(shards) if workers and group == 1 and shards > 1 else None
    ids = _deal(runs, size * blocks, shards, work)  # the run at each position (-1: padding)
    limits = stacked_limits([configs[r if r >= 0 else runs - 1] for r in ids])
    # The request axis is padded (capacity.bucket), so that traces of nearby sizes share the
    # compiled chunk. A padding request never arrives and has a finish step from the start.
    padded = bucket(len(reqs))
    # A padding run starts drained (every request has a finish step): never stepped.
    per_request = np.full((len(ids), 4, padded), -1, np.int32)
    per_request[:, :, len(reqs):] = 0
    per_request[ids < 0] = 0
    seed = (np.int32(cap_config.seed), np.int32(cap_config.artificial_preemption_count))
    steps = np.array([r["arrival_step"] for r in reqs])
    arrivals = np.sort(steps)
    # SPEC A10: the prompts, in arrival order, only where the runs cache prefixes.
    tok_width = cap["max_blocks_per_seq"] * configs[0].block_size if configs[0].enable_prefix_caching else 0
    cols, arrival_time, tokens = arrival_table(trace, padded, tok_width)
    cols, arrival_time = jax.device_put(cols), jax.device_put(arrival_time)
    tokens = jax.device_put(tokens)
    width = burst_width(int(np.bincount(steps).max()))
    if window:
        width = window_width(width, cap["num_slots"])
    K = CHUNK_STEPS
    if half_slots is None:          # by measurement (sweep's docstring)
        half_slots = group == 1 and cap["num_slots"] >= 2 and jax.default_backend() == "cpu"
        if half_slots and (HALF_SLOTS_FROM is None or positions < HALF_SLOTS_FROM):   # if compiled
            small = dataclasses.replace(cap_config, num_slots=cap["num_slots"] // 2).capacity()
            shapes = jax.eval_shape(functools.partial(first_batch, capacity=small),
                                    jax.tree.map(lambda x: x[:size], limits), per_request[:size], *seed)
            half_slots = _chunk_ready((shapes, cols, arrival_time, tokens, jax.ShapeDtypeStruct((size,), np.int32),
                                       jax.ShapeDtypeStruct((size, K), np.float32)), small, width, window)
    # Half the slots for the runs they surely hold (sweep_slots: `half_slots`), on the map
    # path on the CPU (host threads, or worker processes, which hold both carries of their
    # blocks and move runs between them on request). A run that starts from another's state
    # starts at the full count; every run moves down and up between chunks.
    half = cap["num_slots"] // 2 if half_slots else 0
    small_at = (ids >= 0) & bool(half) & ~np.isin(ids, list(starts))   # positions at half the slots
    # A position is stepped in the batch that holds its run; in the other it is drained.
    def first_carries(capacity, rows):
        """Every block's starting carry, one call of one compiled `first_batch` each."""
        out = []
        for b in range(blocks):
            part = lambda x: x[b * size:(b + 1) * size]             # noqa: E731
            args = (jax.tree.map(part, limits), part(rows)) + seed
            out.append(_compiled(first_batch, args, dict(capacity=capacity), stats)(*args))
        return out

    carries = first_carries(cap_config.capacity(), np.where(small_at[:, None, None], 0, per_request))
    smalls = small_cap = None
    if half:
        small_cap = dataclasses.replace(cap_config, num_slots=half).capacity()
        smalls = first_carries(small_cap, np.where(small_at[:, None, None], per_request, 0))
    done, last = np.zeros(runs, np.int64), np.zeros(runs, np.int64)
    # The step each position's next chunk starts at, less the chunks made since the start.
    offset = np.zeros(len(ids), np.int64)
    if starts:
        carries = _started(carries, ids, size, starts, stats)
        for pos in np.nonzero(ids >= 0)[0]:
            if (s := starts.get(int(ids[pos]))) is not None:
                offset[pos], done[ids[pos]], last[ids[pos]] = s.step, s.finished, s.last
    chunks: list[np.ndarray] = []                  # global chunk index -> records of every run
    final = np.zeros((runs, 4, len(reqs)), np.int32)
    capacity = cap_config.capacity()
    sizes, stepped, made, half_steps, live_steps, moves = [size], 0, 0, 0, 0, [0, 0]

    def split(batch):
        return [jax.tree.map(lambda x: x[i * size:(i + 1) * size], batch) for i in range(blocks)]

    def join(carries):
        return carries[0] if len(carries) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *carries)

    def read(which):
        """The states of runs `which` now: (packed leaves, per_request), host arrays, one per run."""
        where = {int(r): p for p, r in enumerate(ids) if r >= 0}
        pos = np.array([where[int(r)] for r in which])
        out = [None] * len(pos)
        for shard, small in itertools.product(np.unique(pos // size), (False, True)):
            mine = np.nonzero((pos // size == shard) & (small_at[pos] == small))[0]
            if not mine.size:
                continue
            state, per = (remote.rows(shard, pos[mine] % size, small) if carries is None
                          else _rows((smalls if small else carries)[shard], pos[mine] % size, stats))
            data = state.data
            if small:       # at the full slot count, as every Start is
                data, _ = sweep_slots.resize(tuple(np.asarray(x) for x in data), state.dims, cap["num_slots"])
            for k, i in enumerate(mine):
                out[i] = (tuple(leaf[k] for leaf in data), per[k])
        return out

    def move(which, to_small: bool, slots: int):
        """Move the runs at positions `which` to the carries at half the slots or back."""
        nonlocal carries, smalls
        if carries is None:         # on the workers
            for b in range(blocks):
                if (local := np.nonzero(which[b * size:(b + 1) * size])[0]).size:
                    remote.move(b, local, to_small, slots)
        elif to_small:
            carries, smalls = _moved(carries, smalls, which, size, slots, stats)
        else:
            smalls, carries = _moved(smalls, carries, which, size, slots, stats)

    with tqdm(total=runs * len(reqs), disable=not progress, desc=label, unit="req") as bar, \
            concurrent.futures.ThreadPoolExecutor(shards) as pool:
        bar.update(int(done.sum()))

        def chunk_exe(state, cap_):
            """The chunk for this chunk's inputs (`first`, `times`). A fresh start stands
            still for seconds here: the bar says why."""
            args = (state, cols, arrival_time, tokens, first[:size], times[:size])
            note = CHUNK_NOTES.get(_chunk_found(args, cap_, width, group, skips, window)) if progress else None
            if note:
                bar.set_postfix_str(note)
            exe = _executable(args, cap_, width, group, stats, skips=skips, window=window)
            if note:
                bar.set_postfix_str("")
            return exe
        while (done < len(reqs)).any():
            real = ids >= 0
            live = real & (done[np.maximum(ids, 0)] < len(reqs))
            first_steps = offset + made * K
            if (first_steps[live] >= trace.max_steps).all():
                break
            times = ((first_steps[:, None] + np.arange(K)).astype(np.float32) * trace.step_time)
            first = first_steps.astype(np.int32)
            if half:
                # Requests alive at the chunk's start plus those arriving in it: the most the
                # chunk can hold. A run that could hold more than half the slots moves up.
                most = np.searchsorted(arrivals, first_steps + K) - done[np.maximum(ids, 0)]
                up = small_at & live & (most > half)
                if up.any():
                    move(up, False, cap["num_slots"])
                    small_at &= ~up
                    moves[0] += int(up.sum())
                # A run drains from the highest slots last: it moves down once they are empty.
                down = ~small_at & live & (most <= half)
                if down.any() and (down := down & (remote.fit(half) if carries is None
                                                   else _fit(carries, half))).any():
                    move(down, True, half)
                    small_at |= down
                    moves[1] += int(down.sum())
                half_steps += K * int((live & small_at).sum())
            live_steps += K * int(live.sum())
            exe = exe_small = None
            if remote is not None or (live & ~small_at).any():
                exe = chunk_exe(carries[0] if carries is not None else held, capacity)
            if half and (remote is not None or (live & small_at).any()):
                exe_small = chunk_exe(smalls[0] if smalls is not None else held_small, small_cap)
            count = live.reshape(blocks, size).sum(1)      # live runs per block
            if remote is not None:
                if carries is not None:     # from here on the workers hold the carries
                    remote.start(exe, serialized(exe), (cols, arrival_time, tokens), carries,
                                 (exe_small, serialized(exe_small), smalls) if half else None)
                    held, carries = carries[0], None       # None: the workers hold them
                    if half:
                        held_small, smalls = smalls[0], None
                per_block = lambda mask: (live & mask).reshape(blocks, size).any(1)     # noqa: E731
                made_by = remote.advance(split(first), split(times), per_block(~small_at),
                                         per_block(small_at) if half else None,
                                         [small_at[b * size:(b + 1) * size] for b in range(blocks)] if half
                                         else None)
            else:
                # NOTE: each thread waits for the chunk it called. Left to JAX's async
                # dispatch (the main thread waiting on the records), the same sweeps ran
                # 1.15-1.5x slower on the 2-core CPU, interleaved in one process: 64
                # configurations 1.98-3.14 s against 1.64-1.69, 16 configurations
                # 1.06-1.5 s against 0.87-1.05.
                def advance(b):
                    mine = slice(b * size, (b + 1) * size)
                    busy = [run is not None and (live[mine] & at).any()
                            for run, at in ((exe, ~small_at[mine]), (exe_small, small_at[mine]))]
                    return step_block((carries, smalls), (exe, exe_small), b, (cols, arrival_time, tokens),
                                      first[mine], times[mine], small_at[mine], busy)
                # On threads any thread may step any block (the carries are this process's):
                # the blocks with live runs go to whichever thread is free, the most live runs
                # first, so the threads finish a chunk within about one small block of each
                # other, however unevenly the runs' costs turn out.
                todo = sorted(np.nonzero(count)[0].tolist(), key=lambda b: -count[b])
                made_by = dict(zip(todo, map(advance, todo) if shards == 1 else pool.map(advance, todo)))
            # A block with no live run was not called: its records are zeros.
            none = np.zeros((size, K, NUM_COLS), np.int32)
            rec = np.concatenate([made_by.get(b, none) for b in range(blocks)])
            stepped += rec.shape[0] * K
            if rec[real][:, :, C_OVERFLOW].any():
                return None
            at = first_steps // K                  # each position's global chunk index
            while len(chunks) <= at[real].max():
                chunks.append(np.zeros((runs, K, NUM_COLS), np.int32))
            for g in np.unique(at[real]):
                here = real & (at == g)
                chunks[g][ids[here]] = rec[here]
            new = np.zeros(runs, np.int64)
            new[ids[real]] = rec[real][:, :, C_FINISHED].sum(1)
            from_end = np.zeros(runs, np.int64)
            from_end[ids[real]] = np.argmax(rec[real][:, ::-1, C_FINISHED] > 0, axis=1)
            run_first = np.zeros(runs, np.int64)
            run_first[ids[real]] = first_steps[real]
            done += new
            last = np.where(new > 0, run_first + K - 1 - from_end, last)
            bar.update(int(new.sum()))
            if watch is not None and live.any():
                watch(ids[live], at[live], rec[live], read)
            made += 1
            live = np.nonzero(real & (done[np.maximum(ids, 0)] < len(reqs)))[0]
            # Compaction (vmap only: the map path does not visit a drained run), once the
            # live runs fit a quarter of the batch: fewer shapes, fewer compiles.
            new_size, new_group = _shard_size(len(live), positions, shards, vmap_runs)
            if live.size and group > 1 and new_size * 4 <= size:
                batch = join(carries)
                kept = np.asarray(batch[1])
                final[ids[real]] = kept[real][..., :len(reqs)]
                pad = int(np.nonzero(~np.isin(np.arange(len(ids)), live))[0][0])   # a drained run
                items = _deal(len(live), new_size * shards, shards)
                src = np.where(items >= 0, live[np.maximum(items, 0)], pad)
                take = jnp.asarray(src)
                batch = jax.tree.map(lambda x: jnp.take(x, take, axis=0), batch)
                ids, offset, small_at = np.where(items >= 0, ids[src], -1), offset[src], small_at[src]
                size, group = new_size, new_group
                sizes.append(size)
                carries = split(batch)
    stats.update(shard_sizes=sizes, threads=shards, blocks=blocks, vmap_group=group, stepped_run_steps=stepped,
                 workers=shards if carries is None else 0, half_slots=half,
                 half_slot_run_steps=stats.get("half_slot_run_steps", 0) + half_steps,
                 live_run_steps=stats.get("live_run_steps", 0) + live_steps,
                 moved_up=stats.get("moved_up", 0) + moves[0], moved_down=stats.get("moved_down", 0) + moves[1])
    bad = np.nonzero((done < len(reqs)) | (last >= trace.max_steps))[0]
    if bad.size:
        _unfinished(trace, configs, bad)
    kept = np.concatenate(remote.per_request() if carries is None     # on the host: no device op
                          else [np.asarray(c[1]) for c in carries])
    if half:
        kept = np.where(small_at[:, None, None], np.concatenate(remote.per_request(True) if smalls is None
                                                                else [np.asarray(c[1]) for c in smalls]), kept)
    real = ids >= 0
    final[ids[real]] = kept[real][..., :len(reqs)]
    return np.concatenate(chunks, axis=1), final


def _write_rows(carry, index: np.ndarray, data=None, per=None):
    """The carry (state, per_request) with rows `index` of the state's packed leaves
    (`data`) and of per_request (`per`) replaced, where given: rewritten on the host (the
    CPU backend)."""
    state, per_request = carry
    if data is not None:
        host = [np.array(x) for x in state.data]
        for leaf, rows in zip(host, data):
            leaf[index] = rows
        state = state.replace(data=tuple(jax.device_put(x) for x in host))
    if per is not None:
        host = np.array(per_request)
        host[index] = per
        per_request = jax.device_put(host)
    return state, per_request


def step_block(carries, exes, b, consts, first, times, at_small, busy) -> np.ndarray:
    """Block b's chunk, on host threads or in a worker process: `carries` (the blocks'
    carries at the full slot count and at half, or None) and `exes` (their compiled
    chunks) are stepped where `busy` says that carry of the block has a live run. Returns
    the block's records, each position's from the carry that holds it (`at_small`: the
    half-slot one), zeros where neither ran."""
    rec = np.zeros((len(first), times.shape[1], NUM_COLS), np.int32)
    for blocks, exe, at, go in zip(carries, exes, (~at_small, at_small), busy):
        if go:
            blocks[b], got = jax.block_until_ready(exe(blocks[b], *consts, first, times))
            rec = np.where(at[:, None, None], np.asarray(got), rec)
    return rec


def move_rows(src, dst, local: np.ndarray, slots: int, stats: dict):
    """(src, dst), two carries of one block (CPU), with the runs at positions `local` moved
    from `src` to `dst` (at `slots` request slots: sweep_slots.resize), at the same
    positions, and drained in `src` (per_request all zeros, so that its chunk does not
    visit them). A worker process moves its own blocks' runs with it."""
    state, per = _rows(src, local, stats)
    data, _ = sweep_slots.resize(tuple(state.data), state.dims, slots)
    return _write_rows(src, local, per=np.zeros_like(per)), _write_rows(dst, local, data, per)


def _moved(src, dst, which: np.ndarray, size: int, slots: int, stats: dict):
    """(src, dst), block carries, with the runs at positions `which` moved from `src` to
    `dst` (`move_rows`)."""
    src, dst = list(src), list(dst)
    for block in range(len(src)):
        local = np.nonzero(which[block * size:(block + 1) * size])[0]
        if local.size:
            src[block], dst[block] = move_rows(src[block], dst[block], local, slots, stats)
    return src, dst


def _fit(carries, slots: int) -> np.ndarray:
    """bool[positions]: the run at each position of the shard carries (CPU) holds no
    request in a slot at or past `slots` (sweep_slots.fits), read from the buffers."""
    return np.concatenate([sweep_slots.fits(tuple(np.asarray(x) for x in c[0].data), c[0].dims, slots)
                           for c in carries])


@jax.jit
def _take_rows(carry, index):
    return jax.tree.map(lambda x: jnp.take(x, index, axis=0, mode="clip"), carry)


@functools.partial(jax.jit, donate_argnums=(0,))
def _put_rows(carry, index, rows):
    return jax.tree.map(lambda x, r: x.at[index].set(r, mode="drop"), carry, rows)


def _bucket(index: np.ndarray, pad: int) -> np.ndarray:
    """`index` padded with `pad` to a power of two (at least 8): a few shapes, a few compiles."""
    return np.concatenate([index, np.full(pow2(max(8, len(index))) - len(index), pad)]).astype(np.int32)


def _on_cpu(carry) -> bool:
    """Does the carry live on the CPU backend (where np.asarray of a buffer is a view)?"""
    return all(d.platform == "cpu" for d in jax.tree.leaves(carry)[0].devices())


def _rows(carry, index: np.ndarray, stats: dict):
    """Rows `index` of a carry (state, per_request), on the host. On the CPU backend they
    are read from the buffers themselves, as in the worker processes: no gather compiled
    per index shape (0.1-0.2 s each, two or more in a pruned sweep's compile time);
    elsewhere gathered on the device, so that only the rows cross to the host."""
    if _on_cpu(carry):
        return jax.tree.map(lambda x: np.asarray(x)[index], carry)
    args = (carry, _bucket(index, 0))
    got = _compiled(_take_rows, args, {}, stats)(*args)
    return jax.tree.map(lambda x: np.asarray(x)[:len(index)], got)


def _started(carries, ids, size, starts: dict, stats: dict):
    """The first carries with the runs of `starts` put at their start states, each run's own
    limits kept (the packed columns `_limit_columns`). On the CPU backend the shard's carry
    is copied and rewritten on the host (about 70 KB a run at 128 slots, once per wave; no
    scatter to compile), elsewhere on the device."""
    out = []
    for shard, carry in enumerate(carries):
        mine = [(p, starts[int(ids[shard * size + p])]) for p in range(size)
                if ids[shard * size + p] >= 0 and int(ids[shard * size + p]) in starts]
        if not mine:
            out.append(carry)
            continue
        local = np.array([p for p, _ in mine])
        fresh, _ = _rows(carry, local, stats)
        keep = _limit_columns(carry[0].dims)
        data = []
        for k, leaf in enumerate(fresh.data):
            rows = np.stack([s.state[0][k] for _, s in mine])
            if k in keep:
                rows[:, keep[k]] = leaf[:, keep[k]]
            data.append(rows)
        rows = (carry[0].replace(data=data), np.stack([s.state[1] for _, s in mine]))
        if _on_cpu(carry):
            out.append(_write_rows(carry, local, rows[0].data, rows[1]))
            continue
        index = _bucket(local, size)
        pad = lambda x: np.concatenate([x, np.zeros((len(index) - len(x),) + x.shape[1:], x.dtype)])  # noqa: E731
        args = (carry, index, jax.tree.map(pad, rows))
        out.append(_compiled(_put_rows, args, {}, stats)(*args))
    return out


def _unfinished(trace, configs, bad):
    """Raise (as `simulate` does) for the runs `bad` that did not drain within max_steps."""
    c = configs[bad[0]]
    raise RuntimeError(f"sweep: {len(bad)} of {len(configs)} runs unfinished after max_steps="
                       f"{trace.max_steps} (e.g. num_device_blocks={c.num_device_blocks}, "
                       f"max_num_seqs={c.max_num_seqs}, preemption_mode={c.preemption_mode})")


# ----------------------------------------------------------------------------- the front end

def sweep(trace: dict, *, capacity: dict | None = None, step_time_model=None,
          vmap_runs: int | None = None, threads: int | None = None, progress: bool = True,
          preemption_costs=None, memory=None, slo_ttft: float | None = None,
          slo_tpot: float | None = None, per_request: bool = False, stats: dict | None = None,
          vmap_skips: bool | None = None, prune: bool | None = None, workers: bool | None = None,
          half_slots: bool | None = None, **axes) -> list[dict]:
    """Replay `trace` under every combination of the given limit lists; one row per run.

    Memory axes, vLLM's knobs: `gpu_memory_utilization` and `swap_space` (GiB), each a list
    or spec like the others, with `memory` the model's `sizing.MemoryProfile` (or a function
    of a run's SchedulerConfig returning one), become num_device_blocks and num_host_blocks
    by `sizing.plan_cache`, the arithmetic `LLM` starts with; rows give both.
    Latency objectives `slo_ttft`, `slo_tpot` (seconds with a step-time model, else steps)
    add goodput to each row: the share of requests meeting both (an ignored request meets
    none) and good requests per second (per step without a model). TTFT runs from the
    arrival step to the end of the step that samples the first token; TPOT is the time
    from that token to the last, over the tokens after the first. `per_request` adds the
    lists ttft and tpot (None for ignored requests) to each row.

    Axes are any of SWEEP_FIELDS (preemption_mode, max_num_seqs, num_device_blocks,
    num_host_blocks, max_num_batched_tokens, max_model_len, watermark, delay_factor), each a
    list, one value or a spec string ("8,16,32" or "64:1024:64", inclusive). Fields not swept
    come from the trace's config; a static field (block_size, enable_chunked_prefill) may be
    given one value, never a list. `enable_prefix_caching` (SPEC A10) is static too but may
    be a list ([False, True]): one sweep per value, rows in that order with the value (the
    prompts hashed are the trace's `prompt_token_ids`, else 0 .. prompt_len - 1, as in
    `simulate`; rows count the tokens the scheduler budgets, cached ones included, as vLLM's
    scheduler does). `capacity` fixes static sizes (see `sweep_capacity`).
    `preemption_costs` (a core.costs.PreemptionCosts, its dict, or a JSON file written by
    `to_json`) replaces the trace's cost model of preemption_mode "auto" in every run.
    With a `workload.StepTimeModel` (any f(prefill_tokens, decode_seqs, swapped_blocks) ->
    seconds per step), rows also give seconds: the summed per-step costs. `vmap_runs`
    is how many runs one jax.vmap steps together (default: all on an accelerator, 1 on CPU,
    where looping over runs inside the compiled call is faster; see `sweep_chunk`).
    `vmap_skips`: whether a vmapped batch skips the work no run of it needs (a `lax.cond`
    per skip, decided once for the batch) or computes every branch and masks it
    (`core.batching`); default by measurement per backend (`default_vmap_skips`). On a GPU,
    XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE before JAX starts (what
    `jaxsched sweep` sets) runs a sweep about 13% faster (`xla_flags.SWEEP_GPU_FLAGS`).
    `threads` steps the runs on that many host threads in parallel, on the map path each
    taking the next block of MAP_BLOCK runs, vmapped each its own shard (default: one per
    CPU core on the CPU backend, else 1); results do not depend on it.
    `workers`: step the runs in worker processes, one pinned to each CPU and holding a
    shard of blocks, instead of host threads (`sweep_workers`: the map path only, Linux);
    rows do not depend on it. None (default) is False: with each thread waiting for its
    own chunk, two
    threads step a grid about as fast as two pinned processes (1.18x slower per run-step
    with every configuration run, benchmarks/results/sweep_partitions.md), and pruned
    sweeps, whose waves read and ship run states, are faster on threads at every size
    measured (1024 configurations: 21.7-22.0 s against 23.5-25.0 s with the workers up).
    A failed worker raises `sweep_workers.WorkerError` (a RuntimeError); the next sweep
    starts a new one.
    `half_slots`: on the map path on the CPU, on threads or worker processes (True
    elsewhere is an error), step each run at half the request slots while that surely
    holds it (the requests alive at a chunk's start plus those arriving in it fit there),
    moving it up before it could need more and back down once its highest slots are empty
    (sim/sweep_slots.py); rows do not depend on it. None (default): on for any grid whose
    half-slot chunk is compiled in this process or kept in the executable store (a sweep
    of that capacity made it before), else off (and from HALF_SLOTS_FROM configurations,
    when that is set). The half-slot chunk is one more compile, as long as the first, and
    since arrivals past the slots wait outside them, few run-steps fit half the slots: on
    benchmarks/sweep.py's grids 5-6%, and the runs take 0.91-1.03x as long
    (benchmarks/results/sweep_half_slots.md; 0.69-0.80x when every request alive had a
    slot, at twice the slots).
    `prune`: run each grid line's largest configuration first, not run the configurations
    whose rows one of those runs gives exactly (sim/sweep_prune.py: every test against their
    limits would come out the same), and start the others from the state of a run made
    before, as late as its decisions are theirs; rows do not depend on it. None
    (default): where it saves time, by measurement (benchmarks/results/sweep.md): on the
    map path, where a run not made is time saved, when the first wave is at most half
    the grid (`sweep_prune.worth_it`); not vmapped, where a batch costs about the same with
    fewer runs and a second wave doubles the steps. Never under prefix caching or
    artificial preemption.

    Row fields: the swept values; steps (to drain, as `simulate`); preempted_recompute,
    preempted_swap, num_preemptions; swapped_in (groups), blocks_swapped_out,
    blocks_swapped_in; ignored; latency_mean, latency_p99 (steps from arrival to the
    finishing step, over requests not ignored); peak_device_blocks_used,
    peak_host_blocks_used; with a model, seconds, latency_mean_s, latency_p99_s.

    `stats`, a dict, is filled with how the sweep went: wall_s, compile_s (tracing and XLA
    compiles, apart; 0 when every batch shape was compiled before in this process; split
    into trace_s, lower_s and xla_s, and save_s, load_s while JAX's persistent cache is on:
    the chunk's executable saved to or loaded from `executable_store`), loaded (chunks
    loaded from it), run_s (the rest), compiles (the chunk's, one per batch shape, and the first batch's,
    one per capacity and batch shape), run_steps (the steps of all runs to drain), path ("vmap" or
    "map"), threads (shards), blocks (calls of the chunk per chunk of steps, at most: the
    shards' blocks), workers (worker processes used, 0 for threads), vmap_group,
    shard_sizes (runs per block: MAP_BLOCK on the map path; vmapped, runs per shard,
    shrinking as runs drain),
    stepped_run_steps (run-steps computed, padding included), num_slots (the last start's),
    restarts (starts over: some run needed more slots), window (could arrivals past the
    slots wait outside them: `_step`), backlog (did some: a run had more requests alive
    than slots), prune (did it run
    in waves), waves (1 to 3), pruned (configurations answered for without a run of their
    own), resumed (runs started from another run's state) and skipped_steps (the steps
    those runs did not make), live_run_steps (run-steps made, K per run per chunk it
    stepped), half_slots (the half slot count, 0 when off), half_slot_run_steps (those made
    at it), moved_up and moved_down (runs moved between the two).
    """
    if not isinstance(trace, dict) or "config" not in trace:
        raise SweepError("sweep: the trace must be a dict with 'config' and 'requests'")
    try:
        parsed = parse_trace(trace)
    except TraceError as e:
        raise SweepError(f"sweep: {e}") from None
    if not parsed.requests:
        raise SweepError("sweep: the trace has no requests")
    if CACHING_FIELD in axes:
        return _sweep_caching(trace, axes.pop(CACHING_FIELD), stats, axes,
                              dict(capacity=capacity, step_time_model=step_time_model,
                                   vmap_runs=vmap_runs, threads=threads, progress=progress,
                                   vmap_skips=vmap_skips, prune=prune, workers=workers,
                                   half_slots=half_slots, preemption_costs=preemption_costs,
                                   memory=memory,
                                   slo_ttft=slo_ttft, slo_tpot=slo_tpot, per_request=per_request))
    static = {f: _static_value(f, axes.pop(f)) for f in list(axes) if f in STATIC_FIELDS}
    if preemption_costs is not None:
        static["preemption_costs"] = _costs(preemption_costs)
    memory_axes = {f: parse_values(f, axes.pop(f)) for f in MEMORY_FIELDS if f in axes}
    values = {f: parse_values(f, v) for f, v in axes.items()}
    points, configs = make_grid(dataclasses.replace(parsed.scheduler_config, **static), values)
    if memory_axes:
        points, configs = memory_grid(points, configs, memory_axes, memory)
    # Arrivals past the slots wait outside them (`_step`'s window) where that is exact: the
    # slots then need not hold a backlog, and half as many serve (the 64-configuration grid
    # of benchmarks/sweep.py: 64 slots instead of 128, 0.66x the run time).
    window = WINDOW and window_exact(parsed, configs)
    cap = sweep_capacity(parsed, configs, capacity, window=window)
    if vmap_runs is None:
        vmap_runs = len(configs) if jax.default_backend() != "cpu" else 1
    if isinstance(vmap_runs, bool) or not isinstance(vmap_runs, int) or vmap_runs < 1:
        raise SweepError(f"sweep: vmap_runs must be a positive integer, got {vmap_runs!r}")
    vmap_runs = min(vmap_runs, len(configs))
    if threads is None:
        threads = default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SweepError(f"sweep: threads must be a positive integer, got {threads!r}")
    if vmap_skips is None:
        vmap_skips = default_vmap_skips()
    if not isinstance(vmap_skips, (bool, np.bool_)):
        raise SweepError(f"sweep: vmap_skips must be True or False, got {vmap_skips!r}")
    if prune is not None and not isinstance(prune, (bool, np.bool_)):
        raise SweepError(f"sweep: prune must be True, False or None, got {prune!r}")
    if workers is not None and not isinstance(workers, (bool, np.bool_)):
        raise SweepError(f"sweep: workers must be True, False or None, got {workers!r}")
    if workers and (vmap_runs > 1 or threads < 2 or not sweep_workers.available()):
        raise SweepError("sweep: workers=True needs the map path (vmap_runs=1), threads >= 2 and "
                         "a system that pins processes to CPUs (Linux, two CPUs or more)")
    workers = bool(workers)
    if half_slots is not None and not isinstance(half_slots, (bool, np.bool_)):
        raise SweepError(f"sweep: half_slots must be True, False or None, got {half_slots!r}")
    if half_slots and (vmap_runs > 1 or jax.default_backend() != "cpu"):
        raise SweepError("sweep: half_slots=True needs the map path (vmap_runs=1) on the CPU backend")
    # The first wave, when there is one (by measurement by default: see the docstring).
    first = None
    if sweep_prune.prunable(configs[0]) and (prune or (prune is None and vmap_runs == 1)):
        first = sweep_prune.first_wave(configs)
        if prune is None and not sweep_prune.worth_it(configs, first):
            first = None
    info = {"compile_s": 0.0, "trace_s": 0.0, "lower_s": 0.0, "xla_s": 0.0, "compiles": 0, "restarts": 0,
            "runs": len(configs),
            "path": "vmap" if vmap_runs > 1 else "map", "vmap_skips": bool(vmap_skips)}
    t0 = time.perf_counter()
    try:
        out = _sweep_replay(parsed, configs, cap, capacity, vmap_runs, progress, threads, info,
                            bool(vmap_skips), first, workers, None if half_slots is None else bool(half_slots),
                            window)
    finally:                    # also when runs did not drain (a benchmark times a few chunks)
        if stats is not None:
            wall = time.perf_counter() - t0
            stats.update(info, wall_s=wall, run_s=wall - info["compile_s"], num_slots=cap["num_slots"])
    records, per_request_ = out
    arrival = np.array([r["arrival_step"] for r in parsed.requests])
    if stats is not None:
        stats["run_steps"] = int(sum(int(np.nonzero(r[:, C_FINISHED])[0].max()) + 1 for r in records))
        stats["backlog"] = bool(window and peak_alive(arrival, per_request_[:, 0, :arrival.size]) > cap["num_slots"])
    slo = (slo_ttft, slo_tpot) if slo_ttft is not None or slo_tpot is not None else None
    return [_row(p, c, records[i], per_request_[i], arrival, step_time_model, slo, per_request)
            for i, (p, c) in enumerate(zip(points, configs))]


def peak_alive(arrival: np.ndarray, finish: np.ndarray) -> int:
    """The most requests alive at once in any run: arrived at or before a step, finishing at
    or after it. `arrival` int[N] steps, `finish` int[runs, N] each run's finish steps."""
    span = int(max(arrival.max(), finish.max())) + 2
    arrived = np.cumsum(np.bincount(arrival, minlength=span))
    runs = finish.shape[0]
    gone = np.bincount((finish + 1 + span * np.arange(runs)[:, None]).ravel(), minlength=runs * span)
    return int((arrived - np.cumsum(gone.reshape(runs, span), axis=1)).max())


def _sweep_caching(trace: dict, spec, stats: dict | None, axes: dict, kwargs: dict) -> list[dict]:
    """The `enable_prefix_caching` axis: the cached pools are compiled in or not (static), so
    one sweep per value, rows in that order, each with the value; `stats` sums the times."""
    rows, total = [], {}
    for value in _static_values(spec):
        on = _static_value(CACHING_FIELD, value)
        part: dict = {}
        # A trace without caching in its config gets it here: the field overrides the config.
        cfg = dict(trace, config=dict(trace["config"], **{CACHING_FIELD: on}))
        rows += [dict(r, enable_prefix_caching=on) for r in sweep(cfg, stats=part, **kwargs, **axes)]
        for k, v in part.items():
            summed = k in ("wall_s", "compile_s", "trace_s", "lower_s", "xla_s", "save_s", "load_s", "run_s",
                           "compiles", "restarts", "loaded", "runs", "run_steps", "stepped_run_steps", "pruned")
            if summed:
                total[k] = total.get(k, 0) + v
            elif k == "backlog":        # in either sweep
                total[k] = total.get(k, False) or v
            else:
                total[k] = v
    if stats is not None:
        stats.update(total)
    return rows


def _sweep_replay(parsed, configs, cap, capacity, vmap_runs, progress, threads, info, skips=True,
                  first=None, workers=False, half_slots=False, window=False):
    """`_waves`, restarted with twice the slots while some run needs more: more requests
    alive than slots, or with the `window`, a step whose admission walk may have reached
    past them."""
    while (out := _waves(parsed, configs, cap, vmap_runs, progress, threads, info, skips, first,
                         workers, half_slots, window)) is None:
        need = ("requests in its slots at once (running, swapped, and waiting as far as a step's "
                "admission reaches)" if window else "requests alive at once")
        if capacity and "num_slots" in capacity:
            raise SweepError(f"sweep: some run needs more than num_slots={cap['num_slots']} {need}; "
                             f"raise the capacity's num_slots")
        cap["num_slots"] *= 2
        info["restarts"] += 1
        if progress:
            print(f"sweep: some run needs more than {cap['num_slots'] // 2} {need}; restarting with "
                  f"{cap['num_slots']} slots (one more compile; capacity num_slots skips this)", file=sys.stderr)
    info["window"] = window
    return out


def _waves(parsed, configs, cap, vmap_runs, progress, threads, info, skips, first=None, workers=False,
           half_slots=False, window=False):
    """`_replay` of every config, or with `first` (indices, sweep_prune.first_wave) in waves
    (sweep_prune): the roots, the rest of `first`, then the configurations no run made
    answers for; each run of a wave starts from the state of a run made before, as late as
    that run's decisions are its own (sweep_prune.Resumes). The records of an answered
    configuration are its answering run's, and a run's records before its start those of
    the run it started from, shifted (`_shifted`). None as `_replay`."""
    run = lambda which, label, **kw: _replay(  # noqa: E731
        parsed, [configs[i] for i in which], cap, vmap_runs, progress, threads, stats=info, skips=skips,
        batch=len(configs), label=label, workers=workers, half_slots=half_slots, window=window, **kw)
    # Counted afresh by each attempt: a slot-doubling restart's counts are the last attempt's.
    info.update(pruned=0, waves=1, prune=bool(first) and len(first) < len(configs), resumed=0, skipped_steps=0,
                half_slot_run_steps=0, live_run_steps=0, moved_up=0, moved_down=0)
    if not info["prune"]:
        return run(list(range(len(configs))), "sweep")
    request_n = [r["n"] for r in parsed.requests]
    resumes = sweep_prune.Resumes(configs, request_n, [r["arrival_step"] for r in parsed.requests], CHUNK_STEPS)
    roots = sweep_prune.roots(configs)
    records: dict[int, np.ndarray] = {}
    per_request: dict[int, np.ndarray] = {}
    answered: dict[int, int] = {}
    stepped, sizes, waves = 0, [], 0
    for wave in (roots, first, range(len(configs))):
        which = [i for i in wave if i not in records and i not in answered]
        if not which:
            continue
        waves += 1
        starts, prefix, slack = {}, {}, {}
        for k, i in enumerate(which):
            if (begin := resumes.start(i)) is None:
                continue
            step, j, state = begin
            prefix[i] = _shifted(records[j][:step], configs[i], configs[j])
            finished = prefix[i][:, C_FINISHED]
            starts[k] = Start(step, state, int(finished.sum()),
                              int(np.nonzero(finished)[0].max()) if finished.any() else 0)
            slack[i] = tuple(prefix[i][:, [C_BLOCK_SLACK, C_SEQ_SLACK]].min(0))
        targets = [i for i in range(len(configs)) if i not in records and i not in answered and i not in which]
        resumes.begin(which, targets, slack)

        def watch(ran, chunks, rec, read):
            wanted = resumes.feed(ran, chunks, rec[:, :, C_BLOCK_SLACK].min(1), rec[:, :, C_SEQ_SLACK].min(1))
            for (col, boundary), state in zip(wanted, read([col for col, _ in wanted])):
                resumes.store(col, boundary, state)
        label = "sweep" + (f", wave {waves}" + (f" ({len(answered)} answered)" if answered else ""))
        # A run's steps to make, estimated: those of the run it starts from after its start.
        longest = max((_length(r) for r in records.values()), default=parsed.max_steps)
        work = [_length(records[resumes.best[i][1]]) - starts[k].step if k in starts else longest
                for k, i in enumerate(which)]
        if (out := run(which, label, starts=starts, watch=watch, work=work)) is None:
            return None
        stepped, sizes = stepped + info["stepped_run_steps"], sizes + info["shard_sizes"]
        for k, i in enumerate(which):
            rec = out[0][k]
            if i in prefix:
                rec = rec.copy()
                rec[:len(prefix[i])] = prefix[i]
                info["skipped_steps"] += len(prefix[i])
            records[i], per_request[i] = rec, out[1][k]
        info["resumed"] += len(starts)
        resumes.drop(which)
        ran = sorted(records)
        slack_all, seq_all = np.stack([_least(records[i], [C_BLOCK_SLACK, C_SEQ_SLACK]) for i in ran]).T
        new = {i: ran[j] for i, j in sweep_prune.answers(configs, ran, slack_all, seq_all, request_n).items()
               if i not in answered}
        answered.update(new)
        resumes.drop(new)
    info.update(stepped_run_steps=stepped, shard_sizes=sizes, waves=waves, pruned=len(answered))
    steps = max(rec.shape[0] for rec in records.values())
    all_rec = np.zeros((len(configs), steps, NUM_COLS), np.int32)
    all_per = np.zeros((len(configs),) + next(iter(per_request.values())).shape, np.int32)
    for i, rec in records.items():
        all_rec[i, :len(rec)], all_per[i] = rec, per_request[i]
    for i, j in answered.items():
        all_rec[i], all_per[i] = _shifted(all_rec[j], configs[i], configs[j]), per_request[j]
    return all_rec, all_per


def _shifted(rec: np.ndarray, mine: SchedulerConfig, theirs: SchedulerConfig) -> np.ndarray:
    """Records of a run with limits `theirs` as the records of `mine` where the decisions are
    the same: free blocks shifted by the pool sizes, slack by the limits (the block slack by
    at most the least change of any test's threshold: a lower bound, as slack may be)."""
    out = rec.copy()
    db = mine.num_device_blocks - theirs.num_device_blocks
    out[:, C_FREE_DEVICE] += db
    out[:, C_FREE_HOST] += mine.num_host_blocks - theirs.num_host_blocks
    block_shift = db - max(0, mine.watermark_blocks - theirs.watermark_blocks)
    for col, shift in ((C_BLOCK_SLACK, block_shift), (C_SEQ_SLACK, mine.max_num_seqs - theirs.max_num_seqs)):
        out[:, col] = np.where(rec[:, col] >= BIG, rec[:, col], rec[:, col] + shift)
    return out


def _length(rec: np.ndarray) -> int:
    """A run's steps: up to its last finish."""
    return int(np.nonzero(rec[:, C_FINISHED])[0].max()) + 1


def _least(rec: np.ndarray, cols: list[int]) -> np.ndarray:
    """The least value of each of these slack columns over a run's steps."""
    return rec[:_length(rec), cols].min(0)


def _row(point, config, rec, per_request, arrival, model, slo=None, keep=False) -> dict:
    last = int(np.nonzero(rec[:, C_FINISHED])[0].max())
    rec = rec[:last + 1]
    finish, reason, first, output_len = per_request
    served = reason != IGNORED
    latency = (finish - arrival)[served]
    total = lambda col: int(rec[:, col].sum())
    row = {k: ("default" if k == "preemption_mode" and v is None else v) for k, v in point.items()}
    row.update(steps=last + 1, preempted_recompute=total(C_RECOMPUTE), preempted_swap=total(C_SWAP),
               num_preemptions=total(C_RECOMPUTE) + total(C_SWAP), swapped_in=total(C_SWAPPED_IN),
               blocks_swapped_out=total(C_SWAP_OUT), blocks_swapped_in=total(C_SWAP_IN),
               ignored=int((~served).sum()), **_stats(latency, ""),
               peak_device_blocks_used=int(config.num_device_blocks - rec[:, C_FREE_DEVICE].min()),
               peak_host_blocks_used=int(config.num_host_blocks - rec[:, C_FREE_HOST].min()))
    if model is not None:
        cost = model(rec[:, C_PREFILL_TOKENS], rec[:, C_DECODE_SEQS], rec[:, C_SWAP_OUT] + rec[:, C_SWAP_IN])
        clock = np.concatenate([[0.0], np.cumsum(cost)])    # clock[t]: when step t starts
        row.update(seconds=float(clock[-1]), **_stats((clock[finish] - clock[arrival])[served], "_s"))
    else:
        clock = np.arange(last + 2, dtype=np.float64)     # a step is one unit
    ttft, tpot = request_latencies(clock, arrival, first, finish, output_len, served)
    if slo is not None:
        good = good_requests(ttft, tpot, *slo, served=served)
        span = row["seconds"] if model is not None else row["steps"]
        row.update(goodput=float(good.mean()),
                   **{"good_per_s" if model is not None else "good_per_step": float(good.sum() / span)})
    kept = ttft[served], tpot[served]
    row.update(ttft_mean=float(kept[0].mean()) if served.any() else None,
               tpot_mean=float(kept[1].mean()) if served.any() else None)
    if keep:
        row.update(ttft=[float(x) if ok else None for x, ok in zip(ttft, served)],
                   tpot=[float(x) if ok else None for x, ok in zip(tpot, served)])
    return row


def request_latencies(clock, arrival, first, finish, output_len, served):
    """(TTFT, TPOT) of every request from the step clock (clock[t]: when step t starts).

    TTFT: arrival to the end of the first token's step; TPOT: from that token to the last,
    divided by the tokens after the first (0 for a one-token output). Entries of requests not
    `served` are 0 (use the mask).
    """
    at = lambda steps: clock[np.clip(np.where(served, steps, 0), 0, len(clock) - 1)]   # noqa: E731
    first, finish, arrival = at(first + 1), at(finish + 1), at(arrival)
    ttft = np.where(served, first - arrival, 0.0)
    after = np.maximum(output_len - 1, 1)
    tpot = np.where(served & (output_len > 1), (finish - first) / after, 0.0)
    return ttft, tpot


def good_requests(ttft, tpot, slo_ttft=None, slo_tpot=None, served=None):
    """bool per request: served and within both objectives (None: no bound)."""
    ok = np.ones(len(ttft), bool) if served is None else np.asarray(served, bool).copy()
    ttft = np.asarray([np.inf if x is None else x for x in ttft], np.float64)
    tpot = np.asarray([np.inf if x is None else x for x in tpot], np.float64)
    if slo_ttft is not None:
        ok &= ttft <= slo_ttft
    if slo_tpot is not None:
        ok &= tpot <= slo_tpot
    return ok


def memory_grid(points, configs, memory_axes: dict, memory):
    """Each point under every (gpu_memory_utilization, swap_space): the block counts
    sizing.plan_cache gives the model's memory profile, as `LLM` would start with."""
    from jaxsched.engine import sizing

    if memory is None:
        raise SweepError("sweep: gpu_memory_utilization / swap_space need the model's memory "
                         "profile (memory=sizing.MemoryProfile, or --model on the command line)")
    clash = [f for f in ("num_device_blocks", "num_host_blocks") if f in points[0]]
    if clash:
        raise SweepError(f"sweep: {clash[0]} and gpu_memory_utilization / swap_space both set the "
                         f"cache; sweep one of them")
    utils = memory_axes.get("gpu_memory_utilization", [None])
    swaps = memory_axes.get("swap_space", [None])
    out_points, out_configs = [], []
    for point, config in zip(points, configs):
        profile = memory(config) if callable(memory) else memory
        for util, swap in itertools.product(utils, swaps):
            try:
                plan = sizing.plan_cache(
                    profile, gpu_memory_utilization=0.9 if util is None else util,
                    swap_space=4 if swap is None else swap, block_size=config.block_size,
                    max_num_seqs=config.max_num_seqs, context_len=config.max_model_len,
                    max_model_len=config.max_model_len,
                    num_device_blocks=config.num_device_blocks if util is None else None,
                    num_host_blocks=config.num_host_blocks if swap is None else None)
            except sizing.SizingError as e:
                where = ", ".join(f"{k}={v}" for k, v in
                                  [*point.items(), ("gpu_memory_utilization", util), ("swap_space", swap)]
                                  if v is not None)
                raise SweepError(f"sweep: {where}: {e}") from None
            p = dict(point)
            p.update({k: v for k, v in (("gpu_memory_utilization", util), ("swap_space", swap))
                      if v is not None})
            p.update(num_device_blocks=plan.num_device_blocks, num_host_blocks=plan.num_host_blocks)
            out_points.append(p)
            out_configs.append(dataclasses.replace(config, num_device_blocks=plan.num_device_blocks,
                                                   num_host_blocks=plan.num_host_blocks))
    return out_points, out_configs


def pick_smallest(rows: list[dict], min_goodput: float) -> dict | None:
    """The smallest row whose goodput is at least `min_goodput`, or None.

    Smallest by device memory (gpu_memory_utilization, else num_device_blocks), then host
    memory (swap_space, else num_host_blocks), then max_num_seqs; the first in grid order
    among equals."""
    def size(row):
        return (row.get("gpu_memory_utilization", row.get("num_device_blocks", 0)),
                row.get("swap_space", row.get("num_host_blocks", 0)), row.get("max_num_seqs", 0))
    meets = [r for r in rows if r.get("goodput") is not None and r["goodput"] >= min_goodput]
    return min(meets, key=size) if meets else None


def _stats(latency: np.ndarray, suffix: str) -> dict:
    if latency.size == 0:
        return {f"latency_mean{suffix}": None, f"latency_p99{suffix}": None}
    return {f"latency_mean{suffix}": float(latency.mean()),
            f"latency_p99{suffix}": float(np.percentile(latency, 99))}
