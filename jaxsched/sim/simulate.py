"""Model-free trace replay: `jaxsched simulate TRACE.json` and `jaxsched.sim.simulate(...)`.

Each step adds the requests arriving at it, schedules at `now = step * step_time`, gives
every group whose prompt is complete one token per running sequence (never EOS), finishes
sequences (SPEC A9) and frees finished groups. Steps run on device in chunks of
`lax.scan`; the host only reads the packed per-step records back.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsched.core.config import PREEMPT_RECOMPUTE, PREEMPT_SWAP, Capacity, SchedulerConfig
from jaxsched.core.invariants import CHECKS, InvariantError, describe, invariant_violations
from jaxsched.core import batching
from jaxsched.core.requests import (RequestBatch, add_requests, free_finished, free_finished_impl,
                                    update, update_impl)
from jaxsched.core.scheduler import schedule_impl, schedule_step
from jaxsched.core.state import (EMPTY, FINISH_NAMES, FINISHED, IGNORE_REASONS, IGNORED, WAITING, empty_state,
                                  is_live, make_limits)
from jaxsched.core.xla_options import Options, replay_options
from jaxsched.sim import executable_store
from jaxsched.sim.capacity import pow2, replay_capacity, surely_alive, window_exact
from jaxsched.sim.trace import Trace, parse_trace

# Rows of a step's packed record, int32[NUM_ROWS, num_slots].
(R_INDEX, R_TOKENS, R_SEQS, R_PREEMPT, R_SWAP_IN, R_FINISHED, R_REASON, R_OUTPUTS, R_NPREEMPT,
 R_IGNORE_REASON, R_ORDER) = range(11)
NUM_ROWS = 11
CHUNK_STEPS = 64


def replay_step(state, batch: RequestBatch, now, cap: Capacity, record, check: bool = False,
                backlog=None, steady_path: bool = True):
    """The one model-free replay step, shared by `simulate` and `sweep`.

    add_requests, schedule, update (one token per running sequence, never EOS), then
    `record(state, out, overflow)` reads what the caller keeps of the step while finished
    groups are still in their slots, and free_finished empties them. `overflow` says a
    request arriving found no free slot (dropped: the replay needs more slots). With
    `check`, the invariants are evaluated after `schedule` and after `update`. Returns
    (state, record, flags).

    `backlog` (int32, or None): the requests arrived and not yet in a slot, `batch`'s valid
    rows (the oldest of them) included. Those left out of the slots wait behind the waiting
    queue, where the admission walk reaches them only after every waiting request in a slot:
    `overflow` then says the walk may have reached them (no request waiting in a slot before
    `schedule` still waits after it), so the step may differ from vLLM's. Else every row
    must find a slot.

    `steady_path`: `schedule_impl`'s (False: every step takes the general step).
    """
    # Traced for a batch of runs (`batching.runs_axis`, a sweep), the transitions are traced
    # inline, so that their skips are decided once for the batch.
    inline = batching.current_axis() is not None
    state, slots = add_requests(state, batch)
    unplaced = batch.valid & (slots >= state.status.shape[-1])
    if backlog is None:
        overflow = unplaced.any()
    else:
        left = backlog - (batch.valid & ~unplaced).sum(dtype=jnp.int32)
        waiting = state.status == WAITING
    state, out = (schedule_impl if inline else schedule_step)(state, cap, now, steady_path=steady_path)
    flags = invariant_violations(state, out) if check else jnp.zeros((len(CHECKS),), bool)
    state, _, _ = (update_impl if inline else update)(state, out.scheduled, out.num_scheduled_tokens,
                                                      out.is_prefill)
    if check:
        flags = flags | invariant_violations(state)
    if backlog is not None:
        overflow = (left > 0) & ~(waiting & (state.status == WAITING)).any()
    kept = record(state, out, overflow)
    state, _ = (free_finished_impl if inline else free_finished)(state)
    return state, kept, flags


def _slot_record(state, out, overflow):
    """simulate's record of a step: int32[NUM_ROWS, G] per slot, the free block counts, and
    `overflow` (`replay_step`)."""
    finished = state.status == FINISHED
    outputs = jnp.max(jnp.where(jnp.arange(state.num_tokens.shape[1]) < state.n[:, None],
                                state.num_tokens - state.prompt_len[:, None], 0), axis=1)
    rows = [state.request_index, out.num_scheduled_tokens, out.num_seqs, out.preempted,
            out.swapped_in, finished, state.finish_reason, outputs, state.num_preemptions,
            state.ignore_reason, out.preempt_order]
    record = jnp.stack([r.astype(jnp.int32) for r in rows])
    return record, jnp.stack([out.num_free_device_blocks, out.num_free_host_blocks]), overflow


def sim_step(state, batch: RequestBatch, now, cap: Capacity, check: bool = False, backlog=None):
    """`replay_step` with simulate's per-slot record: (state, (record, free, flags, overflow))."""
    state, (record, free, overflow), flags = replay_step(state, batch, now, cap, _slot_record, check, backlog)
    return state, (record, free, flags, overflow)


def arrival_table(trace: Trace, padded: int, tok_width: int):
    """The trace's requests in arrival order (stable: trace order within a step), as a replay
    takes them on device: (cols int32[5, padded]: arrival step, request index, prompt_len, n,
    max_tokens; arrival_time float32[padded]; tokens int32[padded, tok_width], the prompts
    a replay with prefix caching hashes, SPEC A10). Rows past the requests pad it: they
    arrive at a step no replay reaches."""
    reqs = trace.requests
    steps = np.array([r["arrival_step"] for r in reqs])
    order = np.argsort(steps, kind="stable")
    cols = np.array([[r[k] for r in reqs] for k in ("arrival_step", "prompt_len", "n", "max_tokens")])
    cols = np.stack([cols[0], np.arange(len(reqs)), *cols[1:]])[:, order].astype(np.int32)
    cols = np.pad(cols, ((0, 0), (0, padded - len(reqs))))
    cols[0, len(reqs):] = np.iinfo(np.int32).max
    arrival_time = np.array([s * trace.step_time for s in steps[order]] + [0.0] * (padded - len(reqs)),
                            np.float32)
    tokens = np.zeros((padded, tok_width), np.int32)
    for row, i in enumerate(order if tok_width else ()):
        tokens[row] = trace.prompt_token_ids(int(i), tok_width)
    return cols, arrival_time, tokens


def batch_at(cols: jax.Array, arrival_time: jax.Array, tokens: jax.Array, first: jax.Array,
             upto: jax.Array, width: int) -> RequestBatch:
    """Rows first .. upto - 1 of `arrival_table`'s (at most `width` of them), padded to
    width; with prefix caching `tokens` (int32[N, M * block_size], else [N, 0]) are their
    prompts."""
    n = cols.shape[1]
    idx = first + jnp.arange(width, dtype=jnp.int32)
    safe = jnp.minimum(idx, n - 1)
    valid = idx < jnp.minimum(upto, n)
    take = lambda row: jnp.where(valid, cols[row, safe], 0)
    prompts = jnp.where(valid[:, None], tokens[safe], 0) if tokens.shape[1] else None
    return RequestBatch(valid=valid, request_index=take(1), prompt_len=take(2), n=take(3),
                        max_tokens=take(4), arrival_time=jnp.where(valid, arrival_time[safe], 0.0),
                        prompt_tokens=prompts)


def window_batch(state, cols, arrival_time, tokens, t, finished, width: int):
    """The arrivals step `t` offers the slots when arrivals past them wait outside them
    (`replay_step`'s backlog): (batch, backlog). Requests take slots in arrival order, so
    those given one so far are the `finished` ones plus those in a slot; the batch offers
    the oldest of the rest, no more than the free slots take (a backlog that finds every
    slot full leaves the step's add skipped, as without one)."""
    arrived = jnp.searchsorted(cols[0], t, side="right").astype(jnp.int32)
    slotted = finished + (state.status != EMPTY).sum(dtype=jnp.int32)
    free = (state.status == EMPTY).sum(dtype=jnp.int32)
    batch = batch_at(cols, arrival_time, tokens, slotted, jnp.minimum(arrived, slotted + free), width)
    return batch, arrived - slotted


def burst_width(burst: int) -> int:
    """Rows of arrivals a step takes: the trace's largest burst rounded up to a power of two,
    at least 8, so that traces of nearby bursts share one compiled step."""
    return pow2(max(8, burst))


def window_width(burst: int, num_slots: int) -> int:
    """Rows of arrivals a windowed step offers: the trace's largest burst, or an eighth of
    the slots when that is more (a restart with twice the slots takes twice as many a step),
    never more than the slots."""
    return min(num_slots, max(burst, num_slots // 8))


def run_chunk(state, batches: RequestBatch, times, arrivals_left, cap: Capacity, check: bool = False):
    """`sim_step` for every row of `batches` ([K, R] leaves) inside one lax.scan (unjitted:
    `chunk_program` is it compiled).

    `arrivals_left` (bool[K]) says whether any request arrives at or after each step. A step
    with none left and no group waiting, running or swapped is past the trace's last finish:
    it is skipped (its all-zero record is past what `_report` reads), so the last chunk's
    tail costs a `lax.cond` per step instead of a scheduler step.
    """
    def body(st, x):
        batch, now, left = x
        return lax.cond(left | is_live(st.status).any(), lambda s: sim_step(s, batch, now, cap, check),
                        lambda s: (s, _drained_record(s)), st)
    return lax.scan(body, state, (batches, times, arrivals_left))


def run_window_chunk(carry, cols, arrival_time, tokens, steps, times, last_arrival, cap: Capacity, width: int,
                     check: bool = False):
    """`sim_step` for steps `steps` (int32[K], at `times`), the arrivals taken from the
    trace's `arrival_table` on device (`window_batch`): arrived requests go into free slots
    oldest first and the rest wait outside them, behind the waiting queue. `carry` is
    (state, requests finished so far). A step with no arrival at or after it (`last_arrival`),
    none waiting outside and no group waiting, running or swapped is skipped, as in
    `run_chunk`."""
    def body(c, x):
        state, finished = c
        t, now = x
        batch, backlog = window_batch(state, cols, arrival_time, tokens, t, finished, width)
        state, out = lax.cond((t <= last_arrival) | (backlog > 0) | is_live(state.status).any(),
                              lambda s: sim_step(s, batch, now, cap, check, backlog),
                              lambda s: (s, _drained_record(s)), state)
        return (state, finished + out[0][R_FINISHED].sum(dtype=jnp.int32)), out
    return lax.scan(body, carry, (steps, times))


@functools.cache
def _jitted_chunk(options: Options, window: bool = False) -> Callable:
    if window:
        return jax.jit(run_window_chunk, static_argnames=("cap", "width", "check"), donate_argnums=(0,),
                       compiler_options=dict(options) or None)
    return jax.jit(run_chunk, static_argnames=("cap", "check"), donate_argnums=(0,),
                   compiler_options=dict(options) or None)


def chunk_program() -> Callable:
    """`run_chunk` jitted with the replays' compile options on the default backend
    (core/xla_options.py), the state donated."""
    return _jitted_chunk(replay_options())


def window_chunk_program() -> Callable:
    """`run_window_chunk` jitted likewise."""
    return _jitted_chunk(replay_options(), True)


@functools.partial(jax.jit, static_argnames="cap")
def _first_state(limits, rng, artificial_count, cap: Capacity):
    """`init_state` in one compiled call per capacity: built eagerly, the same is a few dozen
    small XLA compiles of its own (about 1.1 s of a warm `jaxsched simulate`). The key comes
    made, as `init_state` makes it: PRNGKey of a Python int takes seeds past int32."""
    return empty_state(cap, limits, 0, artificial_count).replace(rng=rng)


# Chunks from `executable_store` in this process: (capacity, check, the window's width or
# None, argument shapes, options) -> executable.
_STORED: dict = {}


def _chunk_runner(cap: Capacity, check: bool, width: int | None = None) -> Callable:
    """f(carry, *inputs) running one chunk: `chunk_program` (with `width`,
    `window_chunk_program`), or, while JAX's persistent cache is on, its executable through
    `executable_store`, so that a later process loads it without tracing or lowering it."""
    window = width is not None
    static = dict(cap=cap, check=check) | (dict(width=width) if window else {})
    program = window_chunk_program() if window else chunk_program()
    if executable_store.directory() is None:
        return functools.partial(program, **static)
    options = dict(replay_options()) or None

    def run(*args):
        shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args))
        key = (cap, check, width, shapes, tuple(sorted((options or {}).items())))
        if key not in _STORED:
            _STORED[key], _ = executable_store.compile_or_load(program, args, static, options, {})
        return _STORED[key](*args)
    return run


def _drained_record(state):
    """sim_step's outputs, all zero, for a skipped step."""
    g = state.status.shape[0]
    return (jnp.zeros((NUM_ROWS, g), jnp.int32), jnp.zeros((2,), jnp.int32),
            jnp.zeros((len(CHECKS),), bool), jnp.asarray(False))


def _capacity_for(trace: Trace, overrides: dict | None) -> SchedulerConfig:
    """The trace's config with the replay's static sizes (`capacity.replay_capacity`), any
    given in `overrides` taking their place."""
    cfg = trace.scheduler_config
    fields = replay_capacity(trace, [cfg], restarts=False) | (overrides or {})
    return dataclasses.replace(cfg, **fields)


# A replay's slots hold every request alive at once: as many as the trace has requests, up
# to this many. A longer trace lets arrivals past its slots wait outside them, behind the
# waiting queue (as `sweep`'s window: vLLM's admission walk reaches them only after every
# waiting request in a slot), from the sweep's guess (`capacity.replay_capacity`:
# max_num_seqs slots, at least 64), and restarts with twice as many slots (one more compile)
# whenever a step's walk may have reached past them; where some request is ignored on
# arrival (SPEC B6: n above max_num_seqs, which must finish at its arrival step) every
# request alive gets a slot instead, from here or what the trace surely needs when that is
# more (`capacity.surely_alive`, a burst). Every slot costs each step: the trace of
# benchmarks/sweep.py at 4000 requests takes 26.6 s at 4096 slots (one each), 6.5 s at 64
# with the window (benchmarks/results/simulate_slots.md). Up to this many requests nothing
# changes: there a restart's compile would cost more than the slots it saves.
START_SLOTS = 1024
# Past START_SLOTS requests, arrivals past the slots may wait outside them; False gives every
# request alive a slot (simulate before the window: benchmarks/slot_bound.py compares them).
WINDOW = True


class SlotsExceeded(RuntimeError):
    """More requests alive at once than the capacity's num_slots, which the caller fixed."""


def simulate(config: dict | SchedulerConfig, requests: list[dict], *, step_time: float = 1.0,
             max_steps: int = 100_000, capacity: dict | None = None,
             arrival_width: int | None = None, check_invariants: bool = False) -> dict:
    """Replay requests through the jitted scheduler; returns the `simulate` output dict.

    `config` is a trace's config dict (it may carry step_time and max_steps) or a
    SchedulerConfig. `capacity` overrides static sizes (num_slots, max_seqs_per_group,
    max_blocks_per_seq, ...) and `arrival_width` the rows of arrivals a step takes (default:
    the trace's largest burst rounded up to a power of two, at least 8), so that many traces
    share one compiled step. Without a num_slots there, a trace of more than START_SLOTS
    requests lets arrivals past its slots wait outside them, from max_num_seqs slots (at
    least 64), and restarts with twice as many while a step's admission may reach past them
    (see START_SLOTS); with one, every request alive needs a slot, and more raises
    SlotsExceeded. With `check_invariants`, every step is checked on device and the first
    violation raises.
    """
    trace = parse_trace({"config": config, "requests": requests}, step_time=step_time,
                        max_steps=max_steps)
    cfg = _capacity_for(trace, capacity)
    fixed = capacity is not None and "num_slots" in capacity
    window = False
    if not fixed and cfg.num_slots > START_SLOTS:
        if WINDOW and window_exact(trace, [cfg]):
            window = True
            guess = replay_capacity(trace, [cfg], restarts=True, backlog=True)["num_slots"]
            cfg = dataclasses.replace(cfg, num_slots=guess)
        else:
            # Every request alive needs a slot: a burst what it surely has alive, with no
            # restart to find out.
            least = pow2(surely_alive(trace, [cfg]))
            cfg = dataclasses.replace(cfg, num_slots=min(cfg.num_slots, max(START_SLOTS, least)))
    arrivals = trace.arrivals_by_step()
    burst = max((len(v) for v in arrivals.values()), default=1)
    if arrival_width is None:
        arrival_width = burst_width(burst)
    elif arrival_width < burst:
        raise ValueError(f"simulate: arrival_width={arrival_width} is below the trace's {burst} "
                         f"arrivals at one step")
    while True:
        try:
            return _replay(trace, cfg, arrivals, arrival_width, check_invariants, window)
        except SlotsExceeded:
            if fixed:
                raise
            cfg = dataclasses.replace(cfg, num_slots=2 * cfg.num_slots)


def _replay(trace: Trace, cfg: SchedulerConfig, arrivals, width: int, check_invariants: bool,
            window: bool = False) -> dict:
    """`simulate` at the capacity of `cfg`; SlotsExceeded when a request found no free slot
    (with the `window`, when a step's admission walk may have reached past the slots)."""
    cap = cfg.capacity()
    last_arrival = max(arrivals, default=-1)
    # Committed like the scan's outputs, so the second chunk reuses the first one's executable.
    state = jax.device_put(_first_state(make_limits(cfg), jax.random.PRNGKey(cfg.seed),
                                        cfg.artificial_preemption_count, cap=cap), jax.devices()[0])
    if window:
        width = window_width(width, cap.num_slots)
        run = _chunk_runner(cap, check_invariants, width)
        table = jax.device_put(arrival_table(trace, len(trace.requests),
                                             cap.max_blocks_per_seq * cap.block_size if cap.enable_prefix_caching
                                             else 0))
        carry = (state, jax.device_put(np.int32(0), jax.devices()[0]))     # committed, as above
    else:
        run = _chunk_runner(cap, check_invariants)
    records, frees = [], []
    num_requests, finished = len(trace.requests), 0
    step = 0
    while finished < num_requests:
        if step >= trace.max_steps:
            raise RuntimeError(f"simulate: {num_requests - finished} of {num_requests} requests "
                               f"unfinished after max_steps={trace.max_steps}")
        k = min(CHUNK_STEPS, trace.max_steps - step)
        if window:
            steps = np.arange(step, step + k, dtype=np.int32)
            carry, (rec, free, flags, overflow) = run(carry, *table, jnp.asarray(steps),
                                                      jnp.asarray(steps.astype(np.float32) * trace.step_time),
                                                      jnp.int32(last_arrival))
        else:
            batches, times = _chunk_inputs(trace, arrivals, step, k, width, cap)
            left = jnp.asarray(np.arange(step, step + k) <= last_arrival)
            state, (rec, free, flags, overflow) = run(state, batches, times, left)
        rec, free, flags, overflow = (np.asarray(x) for x in (rec, free, flags, overflow))
        if overflow.any():
            at = step + int(np.argmax(overflow))
            raise SlotsExceeded(
                f"simulate: more than num_slots={cap.num_slots} requests in its slots at step {at} (running, "
                f"swapped, and waiting as far as its admission reaches)" if window else
                f"simulate: more than num_slots={cap.num_slots} requests alive at step {at}; raise the "
                f"capacity's num_slots, or leave it out to let simulate size it")
        if flags.any():
            bad = int(np.nonzero(flags.any(1))[0][0])
            raise InvariantError(f"step {step + bad}: {describe(flags[bad])}")
        records.append(rec)
        frees.append(free)
        finished += int(rec[:, R_FINISHED].sum())
        step += k
    return _report(trace, np.concatenate(records), np.concatenate(frees))


def _chunk_inputs(trace: Trace, arrivals, start, k, width, cap: Capacity | None = None):
    cols = {f: np.zeros((k, width), np.int32) for f in ("request_index", "prompt_len", "n", "max_tokens")}
    valid = np.zeros((k, width), bool)
    arrival = np.zeros((k, width), np.float32)
    # SPEC A10: prompt token ids, only read by a replay with prefix caching.
    caching = cap is not None and cap.enable_prefix_caching
    tokens = np.zeros((k, width, cap.max_blocks_per_seq * cap.block_size) if caching else (0,), np.int32)
    for i in range(k):
        for j, idx in enumerate(arrivals.get(start + i, [])):
            r = trace.requests[idx]
            if caching:
                tokens[i, j] = trace.prompt_token_ids(idx, tokens.shape[-1])
            valid[i, j] = True
            cols["request_index"][i, j] = idx
            cols["prompt_len"][i, j] = r["prompt_len"]
            cols["n"][i, j] = r["n"]
            cols["max_tokens"][i, j] = r["max_tokens"]
            arrival[i, j] = (start + i) * trace.step_time
    batch = RequestBatch(valid=jnp.asarray(valid), arrival_time=jnp.asarray(arrival),
                         prompt_tokens=jnp.asarray(tokens) if caching else None,
                         **{f: jnp.asarray(v) for f, v in cols.items()})
    times = jnp.asarray(np.arange(start, start + k, dtype=np.float32) * trace.step_time)
    return batch, times


def _report(trace: Trace, rec: np.ndarray, free: np.ndarray) -> dict:
    ids = [r["id"] for r in trace.requests]
    last = int(np.nonzero(rec[:, R_FINISHED].any(axis=1))[0].max()) if len(rec) else -1
    steps, per_request, reasons, total = [], {}, {}, 0
    for step in range(last + 1):
        r = rec[step]
        name = lambda slot: ids[r[R_INDEX, slot]]
        sched = np.nonzero(r[R_TOKENS] > 0)[0]
        pre = sorted(np.nonzero(r[R_PREEMPT] > 0)[0], key=lambda sl: r[R_ORDER, sl])
        fin = np.nonzero(r[R_FINISHED] > 0)[0]
        ignored = [sl for sl in fin if r[R_REASON, sl] == IGNORED]
        total += len(pre)
        steps.append({
            "step": step,
            "scheduled": [{"id": name(sl), "num_tokens": int(r[R_TOKENS, sl]),
                           "num_seqs": int(r[R_SEQS, sl])} for sl in sched],
            "preempted": [{"id": name(sl), "mode": "recompute" if r[R_PREEMPT, sl] == PREEMPT_RECOMPUTE else "swap"}
                          for sl in pre],
            "swapped_out": [name(sl) for sl in pre if r[R_PREEMPT, sl] == PREEMPT_SWAP],
            "swapped_in": [name(sl) for sl in np.nonzero(r[R_SWAP_IN])[0]],
            "ignored": [name(sl) for sl in ignored],
            "finished": [name(sl) for sl in fin],
            "num_free_device_blocks": int(free[step, 0]),
            "num_free_host_blocks": int(free[step, 1]),
        })
        for sl in fin:
            entry = {"status": FINISH_NAMES[int(r[R_REASON, sl])], "finish_step": step,
                     "num_output_tokens": int(r[R_OUTPUTS, sl]),
                     "num_preemptions": int(r[R_NPREEMPT, sl])}
            if r[R_REASON, sl] == IGNORED:
                reasons[name(sl)] = IGNORE_REASONS.get(int(r[R_IGNORE_REASON, sl]), "ignored")
            per_request[name(sl)] = entry
    ordered = {i: per_request[i] for i in ids if i in per_request}
    # Why each ignored request was ignored, beside (not inside) the vLLM-format records.
    return {"steps": steps, "requests": ordered, "num_preemptions": total,
            "ignored_reasons": reasons}


def summarize(result: dict, trace_config: dict | SchedulerConfig | None = None) -> dict[str, Any]:
    """Headline numbers of a replay (for the CLI's table).

    `trace_config` (the trace's config dict, or its SchedulerConfig) adds the peak blocks
    used; fields the dict leaves out take SchedulerConfig's defaults, as the replay did.
    """
    steps = result["steps"]
    modes = {"recompute": 0, "swap": 0}
    for s in steps:
        for p in s["preempted"]:
            modes[p["mode"]] += 1
    statuses = [v["status"] for v in result["requests"].values()]
    out = {
        "steps": len(steps),
        "requests": len(result["requests"]),
        "preempted_recompute": modes["recompute"],
        "preempted_swap": modes["swap"],
        "swapped_in": sum(len(s["swapped_in"]) for s in steps),
        "ignored": statuses.count("finished_ignored"),
        "output_tokens": sum(v["num_output_tokens"] for v in result["requests"].values()),
    }
    if trace_config is not None and steps:
        get = (trace_config.get if isinstance(trace_config, dict)
               else lambda k, d: getattr(trace_config, k))
        for pool in ("device", "host"):
            total = get(f"num_{pool}_blocks", getattr(SchedulerConfig, f"num_{pool}_blocks"))
            out[f"peak_{pool}_blocks_used"] = total - min(s[f"num_free_{pool}_blocks"] for s in steps)
    return out
