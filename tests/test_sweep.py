"""Capacity sweeps: every run equals `simulate` of its configuration, one compile per shape.

One small trace, grid, static capacity and thread count serve the whole file, so the vmapped sweep, the
loop-over-runs sweep and `simulate` each compile once per batch shape. The trace's runs
drain between ~100 and ~400 steps, so the vmapped sweep compacts its batch on the way.
"""
from __future__ import annotations

import argparse
import csv
import functools
import itertools
import json
import os
import re
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

from jaxsched import simulate, summarize
from jaxsched.entrypoints.cli_sweep import register
from jaxsched.core import block_pool as bp
from jaxsched.core.costs import PreemptionCosts
from jaxsched.core.xla_options import LEAN_PASSES, LLVM_O2, replay_options
from jaxsched.sim import sweep as sw
from jaxsched.sim import sweep_workers
from jaxsched.sim.sweep import SweepError, sweep
from jaxsched.sim.workload import LogNormal, StepTimeModel, generate_trace

TRACE = generate_trace(24, rate=0.5, prompt=LogNormal(4.0, 0.6), output=LogNormal(3.0, 0.6),
                       seed=1, config=dict(num_device_blocks=32, num_host_blocks=16, max_num_seqs=8,
                                           max_num_batched_tokens=128, max_model_len=128))
GRID = dict(num_device_blocks=[8, 12, 20, 32], max_num_seqs=[4, 8], preemption_mode=["recompute", "swap"])
CAPACITY = dict(num_slots=32, max_seqs_per_group=4, max_blocks_per_seq=9,
                num_device_blocks_capacity=32, num_host_blocks_capacity=16)
# 40 configurations: on the map path's two shards, three blocks of sw.MAP_BLOCK runs each.
WIDE_GRID = dict(GRID, num_device_blocks=[8, 10, 12, 14, 16, 20, 24, 28, 32, 9])
METRICS = ("steps", "preempted_recompute", "preempted_swap", "num_preemptions", "swapped_in",
           "blocks_swapped_out", "blocks_swapped_in", "ignored", "latency_mean", "latency_p99",
           "peak_device_blocks_used", "peak_host_blocks_used")


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="jaxsched")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def vmapped():
    """The grid vmapped on two threads (each shard its own vmap, compacted as its runs drain),
    and its stats (compiles, batch shapes). The file's other vmapped sweeps use the same
    threads and capacity, so they reuse these batch shapes' compiles."""
    stats = {}
    rows = sweep(TRACE, **GRID, capacity=CAPACITY, vmap_runs=16, threads=2, progress=False, stats=stats)
    return rows, stats


def expected_row(row: dict, keys=tuple(GRID), trace=TRACE, capacity=CAPACITY) -> dict:
    """What `simulate` says about the row's configuration (its `keys`), in the sweep's terms."""
    config = dict(trace["config"], **{k: row[k] for k in keys})
    result = simulate(config, trace["requests"], capacity=capacity)
    summary = summarize(result, config)
    arrival = {r["id"]: r["arrival_step"] for r in trace["requests"]}
    latency = [v["finish_step"] - arrival[k] for k, v in result["requests"].items()
               if v["status"] != "finished_ignored"]
    used = [config["num_host_blocks"] - s["num_free_host_blocks"] for s in result["steps"]]
    delta = np.diff([0] + used)
    return dict(steps=summary["steps"], preempted_recompute=summary["preempted_recompute"],
                preempted_swap=summary["preempted_swap"], num_preemptions=result["num_preemptions"],
                swapped_in=summary["swapped_in"], ignored=summary["ignored"],
                latency_mean=float(np.mean(latency)) if latency else None,
                latency_p99=float(np.percentile(latency, 99)) if latency else None,
                peak_device_blocks_used=summary["peak_device_blocks_used"],
                peak_host_blocks_used=summary["peak_host_blocks_used"],
                # A step that swaps out swaps nothing in: host growth is the blocks swapped out.
                blocks_swapped_out=int(delta[delta > 0].sum()),
                host_blocks_returned=int(-delta[delta < 0].sum()))


def test_sweep__every_run_equals_simulate_of_its_configuration(vmapped):
    rows, _ = vmapped
    assert len(rows) == 16
    assert sum(r["preempted_recompute"] for r in rows) > 0 and sum(r["preempted_swap"] for r in rows) > 0
    assert sum(r["ignored"] for r in rows) > 0
    for row in rows:
        want = expected_row(row)
        returned = want.pop("host_blocks_returned")
        assert {k: row[k] for k in want} == want, row
        # Swapped-out blocks come back by swap-in, or are freed when a swapped group is ignored.
        assert row["blocks_swapped_in"] <= returned == row["blocks_swapped_out"]


def test_sweep__drained_runs_leave_the_vmapped_batch(vmapped):
    """Compaction: the runs left are gathered into a smaller batch; rows still equal simulate's
    (the test above), and the stats count what was stepped."""
    rows, stats = vmapped
    assert stats["path"] == "vmap" and stats["threads"] == 2
    assert stats["shard_sizes"][0] == 8 and stats["shard_sizes"][-1] < 8
    assert max(r["steps"] for r in rows) > 2 * min(r["steps"] for r in rows)
    assert stats["run_steps"] == sum(r["steps"] for r in rows)
    assert stats["stepped_run_steps"] < 16 * max(r["steps"] for r in rows)
    assert 0 < stats["compile_s"] < stats["wall_s"] and stats["run_s"] > 0
    assert min(stats["trace_s"], stats["lower_s"], stats["xla_s"]) > 0
    assert stats["trace_s"] + stats["lower_s"] + stats["xla_s"] == pytest.approx(stats["compile_s"])


# 22 short requests at once, then two later (one of n=2): a step admits 21 groups, preempts, swaps
# out or in 10 and finishes 10-15 at once, so `block_pool.on_rows` takes its rows in several
# trips of FEW_GROUPS (and a vmapped batch, as many as its runs' most).
BURST = dict(config=dict(TRACE["config"], max_num_seqs=24),
             requests=[dict(id=f"b{i:02d}", arrival_step=0, prompt_len=6, max_tokens=20, n=1) for i in range(22)]
             + [dict(id=f"b{i:02d}", arrival_step=30, prompt_len=20, max_tokens=12, n=1 + i % 2) for i in (22, 23)])
BURST_GRID = dict(num_device_blocks=[22, 24, 32], max_num_seqs=[12, 24], preemption_mode=["recompute", "swap"])


def test_sweep__steps_that_move_more_groups_than_one_trip_of_rows_equal_simulate(vmapped):
    """Vmapped (after the fixture's sweep, whose batch shapes it shares) and on the map path
    with every configuration run, each row is `simulate`'s of its configuration."""
    many = lambda result, key: max(len(s[key]) for s in result["steps"])           # noqa: E731
    config = dict(BURST["config"], num_device_blocks=22, preemption_mode="swap")
    result = simulate(config, BURST["requests"], capacity=CAPACITY)
    assert min(many(result, k) for k in ("scheduled", "preempted", "swapped_in", "finished")) > bp.FEW_GROUPS
    for kwargs in (dict(vmap_runs=16, threads=2), dict(prune=False)):
        rows = sweep(BURST, **BURST_GRID, capacity=CAPACITY, progress=False, **kwargs)
        assert len(rows) == 12
        for row in rows:
            want = expected_row(row, trace=BURST)
            want.pop("host_blocks_returned")
            assert {k: row[k] for k in want} == want, (kwargs, row)


def test_sweep__compiles_once_per_shape(vmapped, monkeypatch):
    _, stats = vmapped
    # Many chunks, one compile per shape, and one of the first batch's builder.
    assert stats["compiles"] == len(set(stats["shard_sizes"])) + 1
    again = {}
    other = sweep(TRACE, num_device_blocks=[10, 14, 24, 30], max_num_seqs=[5, 7],
                  preemption_mode=["auto", "swap"], capacity=CAPACITY, vmap_runs=16, threads=2,
                  progress=False, stats=again)
    # Other limits, same capacity: only batch shapes not seen before compile.
    assert again["compiles"] == len(set(again["shard_sizes"]) - set(stats["shard_sizes"]))
    assert [r["num_device_blocks"] for r in other[:4]] == [10, 14, 24, 30]
    # Each chunk compiled with the replays' XLA options (on the CPU, two passes left out).
    options = {key[3] for key in sw._EXECUTABLES if key[0] is sw.sweep_chunk}
    assert options == {tuple(sorted(replay_options()))}
    # LLVM at -O2, unless XLA_FLAGS sets a level (this suite's -O0, conftest.py).
    assert replay_options("cpu") == LEAN_PASSES and replay_options("gpu") == ()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_concurrency_optimized_scheduler=false")
    assert replay_options("cpu") == LEAN_PASSES + LLVM_O2


def test_sweep__a_batch_that_skips_nothing_gives_the_same_rows(vmapped):
    """vmap_skips=False: every branch computed for every run and masked, no conditional
    (the accelerator's straight-line step); rows equal the skipping batch's, which equal
    simulate's; compaction still happens, one compile per batch shape."""
    rows, skipping = vmapped
    stats = {}
    straight = sweep(TRACE, **GRID, capacity=CAPACITY, vmap_runs=16, threads=2, progress=False,
                     vmap_skips=False, stats=stats)
    assert stats["vmap_skips"] is False and skipping["vmap_skips"] is True
    assert stats["shard_sizes"] == skipping["shard_sizes"]
    # A chunk per batch shape (skips is static); the first batch's builder is the fixture's.
    assert stats["compiles"] == len(set(stats["shard_sizes"]))
    key = lambda rs: [{k: r[k] for k in (*GRID, *METRICS)} for r in rs]   # noqa: E731
    assert key(straight) == key(rows)
    with pytest.raises(SweepError, match="vmap_skips must be True or False"):
        sweep(TRACE, **GRID, capacity=CAPACITY, vmap_skips="no", progress=False)


def test_cli_sweep__no_vmap_skips_gives_the_same_rows(vmapped, tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    capacity = ",".join(f"{k}={v}" for k, v in CAPACITY.items())
    assert run_cli(["sweep", str(path), "--num-device-blocks", "8,12,20,32", "--max-num-seqs", "4,8",
                    "--preemption-mode", "recompute,swap", "--capacity", capacity, "--vmap-runs", "16",
                    "--threads", "2", "--no-vmap-skips", "--no-progress", "-o", str(tmp_path / "out")]) == 0
    got = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [{k: r[k] for k in (*GRID, *METRICS)} for r in got] == \
        [{k: r[k] for k in (*GRID, *METRICS)} for r in vmapped[0]]
    assert "| preemption_mode | max_num_seqs | num_device_blocks | steps |" in capsys.readouterr().out


def test_sweep__auto_with_costs_that_always_favour_swap_equals_swap(vmapped, tmp_path):
    """Mode "auto" sweeps like any mode; its costs are limits (no compile) and come from a file."""
    rows, _ = vmapped
    path = tmp_path / "costs.json"
    PreemptionCosts(recompute_fixed=1e6, recompute_per_token=1.0, swap_per_block=1.0).to_json(path)
    stats = {}
    auto = sweep(TRACE, **dict(GRID, preemption_mode=["auto", "swap"]), capacity=CAPACITY, vmap_runs=16,
                 threads=2, progress=False, preemption_costs=str(path), stats=stats)
    assert stats["compiles"] == len(set(stats["shard_sizes"]) - set(vmapped[1]["shard_sizes"]))
    swap = [r for r in rows if r["preemption_mode"] == "swap"]
    assert [r["preemption_mode"] for r in auto[:8]] == ["auto"] * 8
    for a, b in zip(auto[:8], swap):
        assert {k: a[k] for k in METRICS} == {k: b[k] for k in METRICS}
    assert sum(r["preempted_swap"] for r in swap) > 0
    with pytest.raises(SweepError, match="sweep: preemption_costs: no such file"):
        sweep(TRACE, progress=False, preemption_costs=str(tmp_path / "missing.json"))


def test_sweep__runs_not_drained_within_max_steps_raise_like_simulate(vmapped):
    trace = dict(TRACE, config=dict(TRACE["config"], max_steps=150))
    with pytest.raises(RuntimeError, match=r"sweep: 14 of 16 runs unfinished after max_steps=150"):
        sweep(trace, **GRID, capacity=CAPACITY, vmap_runs=16, threads=2, progress=False)
    drained = [r for r in vmapped[0] if r["steps"] <= 150]
    assert len(drained) == 2                     # simulate finishes exactly these two in time
    config = dict(trace["config"], **{k: drained[0][k] for k in GRID})
    assert len(simulate(config, TRACE["requests"], capacity=CAPACITY)["steps"]) == drained[0]["steps"]


def test_sweep__loop_over_runs_equals_vmap_and_unit_step_cost_counts_steps(vmapped):
    rows, _ = vmapped
    looped = sweep(TRACE, **GRID, capacity=CAPACITY, vmap_runs=1, progress=False,
                   step_time_model=StepTimeModel(base=1.0))
    for a, b in zip(rows, looped):
        assert {k: a[k] for k in (*GRID, *METRICS)} == {k: b[k] for k in (*GRID, *METRICS)}
        assert b["seconds"] == b["steps"]
        assert b["latency_mean_s"] == pytest.approx(b["latency_mean"])
        assert b["latency_p99_s"] == pytest.approx(b["latency_p99"])


def test_sweep__runs_split_over_threads_give_the_same_rows_in_grid_order(vmapped):
    """3 shards on the looped path, each stepped in blocks of MAP_BLOCK runs (dealt out
    round-robin, padded with drained runs): the rows equal the vmapped path's on two
    threads (the fixture, checked against simulate). A grid of another size, one run or
    five blocks' worth, and on other thread counts, compiles nothing again: one map-path
    executable per capacity."""
    rows, _ = vmapped
    key = lambda rs: [{k: r[k] for k in (*GRID, *METRICS)} for r in rs]   # noqa: E731
    stats = {}
    threaded = sweep(TRACE, **GRID, capacity=CAPACITY, vmap_runs=1, threads=3, progress=False, stats=stats)
    assert stats["threads"] == 3 and set(stats["shard_sizes"]) == {sw.MAP_BLOCK} == {8}
    assert stats["blocks"] == 3          # 16 runs: 6, 5 and 5 a shard, one block each
    assert stats["workers"] == 0         # worker processes only when asked for (workers=True)
    assert key(threaded) == key(rows)
    for grid, threads, many in ((WIDE_GRID, 2, 6),
                                (dict(num_device_blocks=[12], max_num_seqs=[8], preemption_mode=["swap"]), 1, 1)):
        again = {}
        more = sweep(TRACE, **grid, capacity=CAPACITY, vmap_runs=1, threads=threads, progress=False,
                     stats=again, prune=False)
        assert again["blocks"] == many and set(again["shard_sizes"]) == {8} and again["compiles"] == 0, again
        assert key([r for r in more if r["num_device_blocks"] in GRID["num_device_blocks"]]) == \
            key([r for r in rows if r["num_device_blocks"] in grid["num_device_blocks"]
                 and r["max_num_seqs"] in grid["max_num_seqs"] and r["preemption_mode"] in grid["preemption_mode"]])
    with pytest.raises(SweepError, match="threads must be a positive integer"):
        sweep(TRACE, **GRID, capacity=CAPACITY, threads=0, progress=False)


def test_sweep_chunk__the_map_path_steps_the_live_runs_and_leaves_the_drained_as_they_were(monkeypatch):
    """Each chunk of the map path: a drained run (or padding) keeps its state bit for bit
    and records nothing; every live run steps (its clock moves)."""
    seen = []
    compiled = sw._executable

    def spy(*args, **kwargs):
        exe = compiled(*args, **kwargs)

        def call(carry, *rest):
            before = jax.tree.map(lambda x: np.array(x, copy=True), carry)   # the call donates it
            out = exe(carry, *rest)
            seen.append((before, jax.tree.map(np.asarray, out)))
            return out
        return call
    monkeypatch.setattr(sw, "_executable", spy)
    sweep(TRACE, **GRID, capacity=CAPACITY, vmap_runs=1, threads=3, prune=False, progress=False)
    mixed = 0
    for (state, per), ((state_after, per_after), rec) in seen:
        drained = (per[:, 0] >= 0).all(-1)
        mixed += drained.any() and not drained.all()
        for leaf, leaf_after in zip(state.data, state_after.data):
            assert (leaf[drained] == leaf_after[drained]).all()
        assert (per[drained] == per_after[drained]).all() and not rec[drained].any()
        assert (state_after.step[~drained] == state.step[~drained] + rec.shape[1]).all()
    assert mixed > 3


def test_sweep__pruned_rows_equal_the_rows_of_every_run_made():
    """Pruning (sim/sweep_prune.py) gives each configuration the row of a run that passed
    every test against its limits with room to spare: the rows of random grids equal those
    of every run made. The grids vary device and host blocks, max_num_seqs down to 2 (the
    trace has n up to 4: requests ignored at some values), modes, watermarks and chunked
    prefill; some configurations are answered for, some runs made in later waves, and some
    started from another run's state at a chunk boundary (a resumed run)."""
    rng = np.random.default_rng(7)
    pick = lambda values, k: sorted(int(v) for v in rng.choice(values, k, replace=False))  # noqa: E731
    assert max(r["n"] for r in TRACE["requests"]) > 2
    pruned = waves = resumed = 0
    for trial in range(4):
        grid = dict(num_device_blocks=pick(range(8, 33), 4), max_num_seqs=pick(range(2, 9), 2))
        grid.update([dict(preemption_mode=["recompute", "swap"]), dict(num_host_blocks=pick(range(0, 17), 2)),
                     dict(watermark=[0.0, 0.1]), dict(preemption_mode=["swap", "default"])][trial])
        static = dict(enable_chunked_prefill=True) if trial == 3 else {}
        stats, full = {}, {}
        rows = sweep(TRACE, **grid, **static, capacity=CAPACITY, vmap_runs=1, threads=2, progress=False,
                     prune=True, stats=stats)
        every = sweep(TRACE, **grid, **static, capacity=CAPACITY, vmap_runs=1, threads=2, progress=False,
                      prune=False, stats=full)
        assert rows == every, grid
        assert stats["prune"] and not full["prune"] and full["pruned"] == 0
        assert stats["stepped_run_steps"] <= full["stepped_run_steps"] * stats["waves"]
        assert 1 <= stats["waves"] <= 3 and (stats["resumed"] > 0) == (stats["skipped_steps"] > 0)
        pruned += stats["pruned"]
        waves += stats["waves"] >= 2
        resumed += stats["resumed"]
    assert pruned >= 8 and waves >= 3 and resumed >= 4
    with pytest.raises(SweepError, match="prune must be True, False or None"):
        sweep(TRACE, **GRID, capacity=CAPACITY, prune="yes", progress=False)


workers_only = pytest.mark.skipif(not sweep_workers.available(),
                                  reason="worker processes need two CPUs and os.sched_setaffinity")


@workers_only
def test_sweep__half_slots_move_runs_between_slot_counts_with_the_same_rows(vmapped, monkeypatch):
    """With `half_slots` a run steps at half the slots (16 of 32) while the requests alive
    at a chunk's start plus those arriving in it fit there: every run starts there, moves
    up before the trace's burst of arrivals and back down once it drains from its highest
    slots. Rows equal the vmapped sweep's (which equal `simulate`'s), pruned (waves whose
    runs resume from states read at either slot count) or not, on worker processes (which
    hold both carries of their blocks and move runs between them) as on threads, and after
    a slot doubling; bad values get one error."""
    seen = {}
    for prune, workers in ((False, False), (True, False), (True, True)):
        stats = {}
        rows = sweep(TRACE, **GRID, capacity=CAPACITY, vmap_runs=1, threads=2, progress=False, prune=prune,
                     half_slots=True, stats=stats, workers=workers)
        assert rows == vmapped[0], (prune, workers)
        assert stats["half_slots"] == 16 and stats["half_slot_run_steps"] > 0
        assert stats["moved_up"] > 0 and stats["moved_down"] > 0
        assert stats["workers"] == (2 if workers else 0)
        assert stats["resumed"] > 0 or not prune
        seen[workers] = {k: stats[k] for k in ("half_slot_run_steps", "moved_up", "moved_down", "live_run_steps")}
    # Worker processes hold both slot counts' carries and move runs between them as threads do.
    assert seen[True] == seen[False]
    # From 16 slots, with every request alive in a slot (no window), the sweep restarts at
    # 32: the counts are the last attempt's alone.
    monkeypatch.setattr(sw, "sweep_capacity", lambda *a, **k: dict(CAPACITY, num_slots=16))
    monkeypatch.setattr(sw, "WINDOW", False)
    doubled = {}
    assert sweep(TRACE, **GRID, vmap_runs=1, threads=2, progress=False, prune=True, half_slots=True,
                 stats=doubled) == rows
    assert (doubled["num_slots"], doubled["restarts"], doubled["window"]) == (32, 1, False)
    counts = ("half_slot_run_steps", "live_run_steps", "moved_up", "moved_down", "stepped_run_steps")
    assert {k: doubled[k] for k in counts} == {k: stats[k] for k in counts}
    # With the window (the default) 16 slots (8 at half) hold it from the start, the
    # arrivals past them waiting outside the slots: the same rows.
    monkeypatch.setattr(sw, "WINDOW", True)
    windowed = {}
    assert sweep(TRACE, **GRID, vmap_runs=1, threads=2, progress=False, prune=True, half_slots=True,
                 stats=windowed) == rows
    assert tuple(windowed[k] for k in ("num_slots", "restarts", "window", "backlog")) == (16, 0, True, True)
    with pytest.raises(SweepError, match="half_slots must be True, False or None"):
        sweep(TRACE, **GRID, capacity=CAPACITY, half_slots="yes", progress=False)
    with pytest.raises(SweepError, match="half_slots=True needs the map path"):
        sweep(TRACE, **GRID, capacity=CAPACITY, half_slots=True, vmap_runs=16, progress=False)


def test_sweep__half_slots_by_default_from_large_grids_or_once_their_chunk_is_compiled(vmapped, monkeypatch):
    """half_slots=None (the default): off while no half-slot chunk of its capacity is
    compiled (HALF_SLOTS_FROM None: whatever the grid's size); on from HALF_SLOTS_FROM
    configurations where that is set; and then on for the grid without it too, its chunk
    being compiled in this process (the executable store does the same across processes:
    the test above). The rows never change."""
    monkeypatch.setattr(sw, "_EXECUTABLES", {})
    run = functools.partial(sweep, TRACE, **GRID, capacity=CAPACITY, vmap_runs=1, threads=2, progress=False)
    half = []
    assert sw.HALF_SLOTS_FROM is None
    for at_least in (None, 16, None):
        monkeypatch.setattr(sw, "HALF_SLOTS_FROM", at_least)
        stats = {}
        assert run(stats=stats) == vmapped[0]
        half.append(stats["half_slots"])
    assert half == [0, 16, 16]
    stats = {}
    assert run(stats=stats, half_slots=False) == vmapped[0] and stats["half_slots"] == 0


def test_sweep__worker_processes_give_the_threads_rows_and_a_dead_one_is_replaced(vmapped):
    """Shards stepped by worker processes, one pinned to each CPU: the rows of the threads,
    every run made or pruned in waves (resumed runs read their start states from a worker).
    A worker that dies fails the sweep with one clear error; the next sweep starts anew."""
    rows, _ = vmapped
    stats, pruned = {}, {}
    every = sweep(TRACE, **GRID, capacity=CAPACITY, vmap_runs=1, threads=2, progress=False, prune=False,
                  workers=True, stats=stats)
    assert stats["workers"] == 2 and every == rows
    waved = sweep(TRACE, **GRID, capacity=CAPACITY, vmap_runs=1, threads=2, progress=False, prune=True,
                  workers=True, stats=pruned)
    assert pruned["workers"] == 2 and pruned["waves"] == 3 and pruned["resumed"] > 0 and waved == rows
    # Several blocks a worker, pruned: start states read from any block of either worker.
    wide, on_threads = {}, {}
    assert sweep(TRACE, **WIDE_GRID, capacity=CAPACITY, vmap_runs=1, threads=2, progress=False,
                 workers=True, prune=True, stats=wide) == \
        sweep(TRACE, **WIDE_GRID, capacity=CAPACITY, vmap_runs=1, threads=2, progress=False,
              prune=True, stats=on_threads)
    assert wide["workers"] == 2 and wide["blocks"] == 6 and wide["resumed"] > 0 and wide["waves"] == 3
    dead = sweep_workers.pool(2)[0]
    dead.proc.kill()
    dead.proc.wait()
    with pytest.raises(sweep_workers.WorkerError, match="sweep worker on CPU .* exited .* during advance"):
        dead.call("advance", None, None)
    assert sweep(TRACE, **GRID, capacity=CAPACITY, vmap_runs=1, threads=2, progress=False,
                 workers=True) == rows
    assert dead not in sweep_workers.pool(2)
    assert sorted(w.cpu for w in sweep_workers.pool(2)) == sorted(os.sched_getaffinity(0))[:2]
    with pytest.raises(SweepError, match="workers must be True, False or None"):
        sweep(TRACE, **GRID, capacity=CAPACITY, workers="yes", progress=False)
    with pytest.raises(SweepError, match=r"workers=True needs the map path \(vmap_runs=1\), threads >= 2"):
        sweep(TRACE, **GRID, capacity=CAPACITY, vmap_runs=16, workers=True, progress=False)


@workers_only
def test_sweep__a_second_start_loads_the_chunk_from_the_store_and_ships_it_to_workers(tmp_path):
    """With JAX's persistent cache on, the compiled chunks are also kept in the executable
    store (sim/executable_store.py). Two fresh processes with one cache directory: the first
    asks for half slots, so it compiles and stores the chunks at both slot counts; the
    second, by default, finds the half-slot chunk stored, so it steps at half the slots
    too, and loads both without tracing them. Both ship them to their worker processes,
    and give the rows of threads."""
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    script = (
        "import json, sys\n"
        "from jaxsched.entrypoints.compilation_cache import enable_compilation_cache\n"
        "enable_compilation_cache(sys.argv[2])\n"
        "from jaxsched.sim.sweep import sweep\n"
        f"kw = dict(capacity={CAPACITY!r}, vmap_runs=1, threads=2, progress=False, prune=False)\n"
        f"grid = {GRID!r}\n"
        "trace = json.load(open(sys.argv[1]))\n"
        "stats = {}\n"
        "rows = sweep(trace, **grid, **kw, workers=True, stats=stats, half_slots=eval(sys.argv[3]))\n"
        "assert stats['workers'] == 2\n"
        "assert rows == sweep(trace, **grid, **kw, workers=False)\n"
        "print(json.dumps(stats))\n")
    env = {k: v for k, v in os.environ.items() if k != "JAXSCHED_COMPILATION_CACHE_DIR"}
    stats = []
    for half in ("True", "None"):
        got = subprocess.run([sys.executable, "-c", script, str(path), str(tmp_path / "cache"), half],
                             capture_output=True, text=True, env=env, timeout=300)
        assert got.returncode == 0, got.stderr[-3000:]
        stats.append(json.loads(got.stdout.strip().splitlines()[-1]))
        assert len(list((tmp_path / "cache" / "jaxsched-executables").glob("*.exe"))) == 2
    assert "loaded" not in stats[0] and stats[1]["loaded"] == 2
    assert stats[0]["half_slots"] == stats[1]["half_slots"] == 16
    assert stats[1]["compiles"] < stats[0]["compiles"], stats


def test_sweep__resumed_states_move_on_the_host_on_cpu_and_on_the_device_elsewhere(monkeypatch):
    """A resumed run's start state is read and put in place with numpy on the CPU backend (no
    gather or scatter compiled per index shape), with jitted ones elsewhere: same rows."""
    real = sw._compiled

    def no_row_programs(fn, *args, **kwargs):
        assert fn not in (sw._take_rows, sw._put_rows), "a row gather or scatter compiled on the CPU backend"
        return real(fn, *args, **kwargs)
    kw = dict(capacity=CAPACITY, vmap_runs=1, threads=2, progress=False, prune=True)
    with monkeypatch.context() as m:
        m.setattr(sw, "_compiled", no_row_programs)
        host_stats = {}
        on_host = sweep(TRACE, **GRID, **kw, stats=host_stats)
    monkeypatch.setattr(sw, "_on_cpu", lambda carry: False)
    device_stats = {}
    on_device = sweep(TRACE, **GRID, **kw, stats=device_stats)
    assert host_stats["resumed"] > 0 and device_stats["resumed"] == host_stats["resumed"]
    assert on_host == on_device


def test_sweep__vmapped_runs_resume_from_another_runs_state_too(vmapped):
    """prune=True on the vmap path: runs that start late share a batch with runs that start
    at step 0 (per-run first steps and clocks under jax.vmap); rows equal every run's."""
    rows, _ = vmapped
    stats = {}
    pruned = sweep(TRACE, **GRID, capacity=CAPACITY, vmap_runs=16, threads=2, progress=False,
                   prune=True, stats=stats)
    assert stats["path"] == "vmap" and stats["waves"] == 3 and stats["resumed"] > 0
    assert pruned == rows


def test_cli_sweep__prints_a_table_and_writes_csv_json_and_plots(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    capacity = ",".join(f"{k}={v}" for k, v in CAPACITY.items())
    rc = run_cli(["sweep", str(path), "--num-device-blocks", "8,12,20,32", "--max-num-seqs", "4:8:4",
                  "--preemption-mode", "recompute,swap", "--capacity", capacity,
                  "--step-cost", "0.5,0,0,0", "--no-progress", "-o", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    # Apart from the results (half slots: by default once their chunk is compiled in the process).
    assert re.search(r"^sweep: compile \d+\.\d s, runs \d+\.\d s(, \d+% of the run-steps at half the slots)?$",
                     err, re.M), err
    assert rc == 0 and "| preemption_mode | max_num_seqs | num_device_blocks | steps |" in out
    rows = list(csv.DictReader(open(tmp_path / "out" / "sweep.csv")))
    assert len(rows) == 16 and float(rows[0]["seconds"]) == 0.5 * int(rows[0]["steps"])
    assert len(json.loads((tmp_path / "out" / "sweep.json").read_text())) == 16
    for name in ("sweep_latency.png", "sweep_preemptions.png"):
        assert (tmp_path / "out" / name).stat().st_size > 10_000


def test_first_wave__the_largest_of_each_line_of_more_than_one():
    from jaxsched.core.config import SchedulerConfig
    from jaxsched.sim import sweep_prune

    def configs(**axes):
        names = list(axes)
        return [SchedulerConfig(**dict(zip(names, combo)))
                for combo in itertools.product(*axes.values())]
    by_blocks = configs(num_device_blocks=[16, 32, 64, 128], max_num_seqs=[8])
    assert sweep_prune.first_wave(by_blocks) == [3]                     # one line: its largest
    grid = configs(max_num_seqs=[4, 8], num_device_blocks=[16, 32, 64])
    assert sweep_prune.first_wave(grid) == [2, 3, 4, 5]                  # S=4 and every B's S=8
    assert sweep_prune.worth_it(by_blocks, [3]) and not sweep_prune.worth_it(grid, [2, 3, 4, 5])
    assert sweep_prune.first_wave(configs(watermark=[0.0, 0.01, 0.1])) == []   # no shared line


def test_cli_sweep__prune_or_not_or_half_slots_give_the_same_rows(tmp_path, capsys, monkeypatch):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    capacity = ",".join(f"{k}={v}" for k, v in CAPACITY.items())
    argv = ["sweep", str(path), "--num-device-blocks", "20,24,28,32", "--max-num-seqs", "4,8",
            "--preemption-mode", "recompute,swap", "--capacity", capacity, "--threads", "2", "--no-progress"]
    outputs = []
    for i, extra in enumerate((["--prune"], ["--no-prune"], [])):
        assert run_cli(argv + extra + ["-o", str(tmp_path / str(i))]) == 0
        outputs.append(capsys.readouterr().out)
    assert "swept " in outputs[0] and ": 16 runs (2 answered by another run)" in outputs[0]
    # By default a first wave of 10 of the 16 is not worth it (sweep_prune.worth_it).
    assert ": 16 runs\n" in outputs[1] and ": 16 runs\n" in outputs[2]
    assert len({(tmp_path / str(i) / "sweep.json").read_text() for i in range(3)}) == 1
    # Smaller pools: none answered for, two runs start from another's state; the same rows.
    argv[argv.index("--num-device-blocks") + 1] = "8,12,20,32"
    for i, extra in enumerate((["--prune"], ["--no-prune"]), start=3):
        assert run_cli(argv + extra + ["-o", str(tmp_path / str(i))]) == 0
        outputs.append(capsys.readouterr().out)
    assert ": 16 runs (2 resumed from another run's state)\n" in outputs[3] and ": 16 runs\n" in outputs[4]
    assert (tmp_path / "3" / "sweep.json").read_text() == (tmp_path / "4" / "sweep.json").read_text()
    # --half-slots: runs at half the slots where that holds them, the same rows.
    assert run_cli(argv + ["--prune", "--half-slots", "-o", str(tmp_path / "6")]) == 0
    assert re.search(r", \d+% of the run-steps at half the slots$", capsys.readouterr().err, re.M)
    assert (tmp_path / "6" / "sweep.json").read_text() == (tmp_path / "3" / "sweep.json").read_text()
    assert run_cli(argv + ["--prune", "--no-half-slots", "-o", str(tmp_path / "7")]) == 0
    assert "half the slots" not in capsys.readouterr().err
    assert (tmp_path / "7" / "sweep.json").read_text() == (tmp_path / "3" / "sweep.json").read_text()
    if sweep_workers.available():           # --workers: the shards on worker processes, the same rows
        assert run_cli(argv + ["--prune", "--workers", "-o", str(tmp_path / "5")]) == 0
        assert (tmp_path / "5" / "sweep.json").read_text() == (tmp_path / "3" / "sweep.json").read_text()
    # With both slot counts' chunks from the executable store (the tests keep it off), it says so.
    real = sw.sweep

    def from_store(*args, stats=None, **kwargs):
        rows = real(*args, stats=stats, **kwargs)
        stats["loaded"] = 2
        return rows
    monkeypatch.setattr(sw, "sweep", from_store)
    assert run_cli(argv + ["--prune", "--half-slots", "-o", str(tmp_path / "8")]) == 0
    assert re.search(r"^sweep: compile \d+\.\d s \(2 chunks loaded from the compilation cache\), runs ",
                     capsys.readouterr().err, re.M)


def test_sweep__the_progress_bar_says_when_the_step_compiles_or_loads(monkeypatch, capsys):
    # Nothing compiled in this process: the bar says why it stands still.
    monkeypatch.setattr(sw, "_EXECUTABLES", {})
    one = dict(max_num_seqs=[4], num_device_blocks=[32], capacity=CAPACITY)
    rows = sweep(TRACE, **one, progress=True)
    assert "compiling the replay step (once per capacity)" in capsys.readouterr().err
    # Compiled in the process: nothing to say, the same rows.
    assert sweep(TRACE, **one, progress=True) == rows
    err = capsys.readouterr().err
    assert "compiling the replay step" not in err and "loading the compiled" not in err
    # Kept in the store, not in the process: loading. (The key of an executable names its
    # static arguments and its arguments' leaves: their shapes are all a lookup needs.)
    key = next(k for k in sw._EXECUTABLES if k[0] is sw.sweep_chunk)
    static = dict(key[1])
    leaves = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in key[2])
    found = lambda: sw._chunk_found(leaves, static["cap"], static["width"], 1, True,   # noqa: E731
                                    static["window"])
    assert found() == "process"
    monkeypatch.setattr(sw.executable_store, "stored", lambda *a: True)
    monkeypatch.setattr(sw, "_EXECUTABLES", {})
    assert found() == "store" and sw.CHUNK_NOTES["store"] == "loading the compiled replay step"


def test_sweep__more_requests_alive_than_slots_doubles_them_or_says_so(monkeypatch, capsys):
    import importlib
    sweep_module = importlib.import_module("jaxsched.sim.sweep")   # jaxsched.sweep is the function

    calls = []

    def replay(trace, configs, cap, vmap_runs, progress, threads, stats=None, skips=True, **_):
        calls.append(cap["num_slots"])        # overflow until 64 slots
        if cap["num_slots"] < 64:
            return None
        return np.zeros((len(configs), 1, sweep_module.NUM_COLS), np.int32) + 1, \
            np.zeros((len(configs), 4, len(trace.requests)), np.int32)
    monkeypatch.setattr(sweep_module, "_replay", replay)
    stats = {}
    sweep(TRACE, max_num_seqs=[4], progress=True, stats=stats)
    # min(pow2(24 requests), 64), the arrivals past the slots waiting outside them (the
    # window), then doubled; the runs' requests (all finishing at step 0 here) never
    # outnumbered the slots, so none waited outside.
    assert calls == [32, 64]
    assert (stats["restarts"], stats["window"], stats["backlog"]) == (1, True, False)
    assert re.search(r"^sweep: some run needs more than 32 requests in its slots at once .*; restarting "
                     r"with 64 slots", capsys.readouterr().err, re.M)
    with pytest.raises(SweepError, match="more than num_slots=16 requests in its slots at once"):
        sweep(TRACE, capacity=dict(num_slots=16), progress=False)
    monkeypatch.setattr(sweep_module, "WINDOW", False)
    calls.clear()
    sweep(TRACE, max_num_seqs=[4], progress=False)
    assert calls == [32, 64]            # without the window, from the same guess
    with pytest.raises(SweepError, match="more than num_slots=16 requests alive at once"):
        sweep(TRACE, capacity=dict(num_slots=16), progress=False)


@pytest.mark.parametrize("axes, message", [
    (dict(num_device_blocks="64:8:8"), "empty range"),
    (dict(num_device_blocks="8:64:0"), "step must be > 0"),
    (dict(num_device_blocks="8:x:8"), "bad range"),
    (dict(num_device_blocks=[8, 64], capacity=dict(num_device_blocks_capacity=32)),
     "num_device_blocks=64 is above the static capacity num_device_blocks_capacity=32"),
    (dict(capacity=dict(max_blocks_per_seq=4)),
     "need 9 blocks, above the static capacity max_blocks_per_seq=4"),
    (dict(capacity=dict(num_slots=0)), "capacity needs a positive num_slots=0"),
    (dict(preemption_mode=["recompute", "lru"]), "unknown preemption_mode 'lru'"),
    (dict(preemption_costs=dict(recompute_fixed=0.1, recompute_per_token=1e-3, swap_per_block=-1)),
     "sweep: preemption_costs: PreemptionCosts.swap_per_block: must be a finite number >= 0"),
    (dict(block_size=[16, 32]), "block_size is static"),
    (dict(block_size="16,32"), "block_size is static"),
    (dict(enable_chunked_prefill="maybe"), "expected true or false"),
    (dict(enable_chunked_prefill=[True, False]), "enable_chunked_prefill is static"),
    (dict(max_num_seqs=[4, 256]), "max_num_seqs=256: SchedulerConfig.max_num_batched_tokens"),
    (dict(max_num_seqs=[]), "no values"),
    (dict(max_num_seqs=[4.5]), "not an integer"),
    (dict(num_slots=[16]), "unknown field 'num_slots'"),
    (dict(capacity=dict(num_pages=8)), "unknown capacity field 'num_pages'"),
])
def test_sweep__bad_specs_get_one_clear_error_line(axes, message):
    with pytest.raises(SweepError, match=message) as info:
        sweep(TRACE, progress=False, **axes)
    assert "\n" not in str(info.value)


def test_cli_sweep__bad_spec_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    assert run_cli(["sweep", str(path), "--num-device-blocks", "1024:64:64"]) == 2
    err = capsys.readouterr().err
    assert err == "jaxsched sweep: num_device_blocks: empty range '1024:64:64' (start > stop)\n"


def test_sweep__slot_doublings_restart_with_the_same_rows(vmapped, monkeypatch):
    """Starting from 8 slots, the vmapped sweep restarts with twice as many until every
    request alive has one; with the arrivals past the slots waiting outside them (the
    window, under vmap too), from 2 slots until the admission walk never reaches past them.
    Rows are unchanged."""
    rows, _ = vmapped
    for window, slots in ((False, 8), (True, 2)):
        monkeypatch.setattr(sw, "sweep_capacity", lambda *a, slots=slots, **k: dict(CAPACITY, num_slots=slots))
        monkeypatch.setattr(sw, "WINDOW", window)
        stats = {}
        again = sweep(TRACE, **GRID, vmap_runs=16, threads=2, progress=False, stats=stats)
        assert stats["window"] == window and stats["restarts"] >= 1
        assert stats["num_slots"] > slots and stats["num_slots"] == slots << stats["restarts"]
        assert [{k: r[k] for k in (*GRID, *METRICS)} for r in again] == \
            [{k: r[k] for k in (*GRID, *METRICS)} for r in rows]


def test_sweep__a_burst_waits_outside_the_slots_from_the_start(monkeypatch, capsys, tmp_path):
    """100 requests arriving at once are all alive in the first step (`capacity.surely_alive`),
    more than the grid's 64 slots (max_num_seqs, at least 64): the sweep keeps 64 and lets
    the arrivals past them wait outside the slots, behind the waiting queue (`_step`'s
    window), from the start: no restart, one compile. With a request that
    max_num_seqs 1 ignores on arrival (SPEC B6), which must finish at its arrival step, it
    starts with slots for all instead (128). Rows equal `simulate`'s."""
    monkeypatch.setattr(sw, "_EXECUTABLES", {})
    burst = dict(config=dict(block_size=8, num_device_blocks=12, num_host_blocks=16, max_num_seqs=8),
                 requests=[dict(id=f"b{i}", arrival_step=0, prompt_len=8 + i % 24, max_tokens=1 + i % 13)
                           for i in range(100)])
    for grid, n, want in (([4, 8], 1, (64, 0, True, 2, True)), ([1, 8], 2, (128, 0, False, 2, False))):
        trace = dict(burst, requests=[dict(r, n=n if i == 50 else 1) for i, r in enumerate(burst["requests"])])
        stats = {}
        rows = sweep(trace, max_num_seqs=grid, preemption_mode=["recompute", "swap"], threads=1,
                     progress=True, stats=stats)
        assert tuple(stats[k] for k in ("num_slots", "restarts", "window", "compiles", "backlog")) == want, stats
        assert "restarting" not in capsys.readouterr().err
        assert sum(r["preempted_recompute"] + r["preempted_swap"] for r in rows) > 0
        if want[2]:         # and the CLI says so, beside its times
            path = tmp_path / "burst.json"
            path.write_text(json.dumps(trace))
            assert run_cli(["sweep", str(path), "--max-num-seqs", "4,8", "--no-progress"]) == 0
            assert re.search(r"^sweep: compile \d+\.\d s, runs \d+\.\d s, arrivals past the 64 slots waiting "
                             r"outside them$", capsys.readouterr().err, re.M)
        for row in rows:
            want_row = expected_row(row, keys=("max_num_seqs", "preemption_mode"), trace=trace, capacity=None)
            assert {k: row[k] for k in want_row if k != "host_blocks_returned"} == \
                {k: v for k, v in want_row.items() if k != "host_blocks_returned"}, row


def test_sweep__the_window_restarts_with_more_slots_when_the_walk_may_reach_past_them(monkeypatch):
    """Random workloads (test_differential's: tiny pools, forks, ignored prompts, chunked
    prefill, preemption by either mode; prefix caching on or off, the prompts 0 ..
    prompt_len - 1 sharing their prefixes), swept with arrivals past 4 slots waiting outside
    them: a step whose admission walk took every waiting request in a slot may have reached
    past them, so the sweep restarts with twice the slots until none does. Every row equals
    `simulate`'s."""
    from hypothesis import assume, given, settings
    from hypothesis import strategies as st
    from test_differential import SETTINGS, traces
    from jaxsched.sim.capacity import replay_capacity

    # The traces' bounds (test_differential): one compiled shape for every example.
    shared = dict(num_slots=32, max_seqs_per_group=4, max_blocks_per_seq=33, num_device_blocks_capacity=64,
                  num_host_blocks_capacity=128)

    def tight(trace, configs, *, restarts, backlog=False):
        """4 slots with the window (else all)."""
        return dict(replay_capacity(trace, configs, restarts=restarts, backlog=backlog),
                    **dict(shared, num_slots=4 if backlog else 32))
    monkeypatch.setattr(sw, "replay_capacity", tight)
    monkeypatch.setattr(sw, "bucket", lambda x: 32)
    seen = []

    @settings(max_examples=80, **SETTINGS)
    @given(st.booleans().flatmap(lambda chunked: traces(chunked=chunked)), st.booleans())
    def check(trace, caching):
        # Not where a request is ignored on arrival (n above max_num_seqs): all slots then
        # (the burst test above).
        assume(all(r["n"] <= trace["config"]["max_num_seqs"] for r in trace["requests"]))
        trace = dict(trace, config=dict(trace["config"], enable_prefix_caching=caching))
        stats = {}
        [row] = sweep(trace, threads=1, progress=False, stats=stats)
        assert stats["window"]
        seen.append(stats["num_slots"])
        want = expected_row(row, keys=(), trace=trace, capacity=shared)
        assert {k: row[k] for k in want if k != "host_blocks_returned"} == \
            {k: v for k, v in want.items() if k != "host_blocks_returned"}, (row, want)
    check()
    assert min(seen) == 4 and max(seen) > 4         # some fit 4 slots, some needed more


def test_sweep__prefix_caching_is_an_axis_and_every_run_equals_simulate():
    """[False, True]: one sweep (and compile) per value, rows in that order carrying it; each
    row is `simulate` of its configuration with caching off or on. TRACE gives no prompt ids,
    so every prompt is 0 .. prompt_len - 1 (SPEC A10) and they share prefixes: caching
    changes the runs."""
    stats = {}
    rows = sweep(TRACE, num_device_blocks=[12, 32], preemption_mode=["recompute"],
                 enable_prefix_caching=[False, True], capacity=CAPACITY, vmap_runs=1, threads=2,
                 progress=False, stats=stats)
    assert [(r["enable_prefix_caching"], r["num_device_blocks"]) for r in rows] == [
        (False, 12), (False, 32), (True, 12), (True, 32)]
    assert stats["runs"] == 4 and stats["compiles"] >= 2
    keys = ("num_device_blocks", "preemption_mode", "enable_prefix_caching")
    for row in rows:
        want = expected_row(row, keys)
        want.pop("host_blocks_returned")
        assert {k: row[k] for k in want} == want, row
    assert [r["peak_device_blocks_used"] for r in rows[2:]] != [r["peak_device_blocks_used"] for r in rows[:2]] \
        or [r["steps"] for r in rows[2:]] != [r["steps"] for r in rows[:2]]


def test_sweep__a_trace_of_a_nearby_size_shares_the_compiled_chunk():
    """The request axis is padded to capacity.bucket (24 for 21 to 24 requests): after
    TRACE's sweep on the map path, a sweep of another trace of 21 requests compiles nothing,
    and its rows, pruned, are `simulate`'s of each configuration (padding requests never
    arrive and hold up no run)."""
    other = generate_trace(21, rate=0.6, prompt=LogNormal(4.2, 0.5), output=LogNormal(2.8, 0.7),
                           seed=5, config=TRACE["config"])
    sweep(TRACE, **GRID, capacity=CAPACITY, vmap_runs=1, threads=2, progress=False)
    stats = {}
    rows = sweep(other, **GRID, capacity=CAPACITY, vmap_runs=1, threads=2, progress=False, stats=stats,
                 prune=True)
    assert stats["compiles"] == 0 and stats["waves"] > 1 and stats["resumed"] > 0, stats
    for row in rows[::3]:
        want = expected_row(row, trace=other)
        want.pop("host_blocks_returned")
        assert {k: row[k] for k in want} == want, row
    assert [r["steps"] for r in rows] != [r["steps"] for r in sweep(TRACE, **GRID, capacity=CAPACITY, vmap_runs=1,
                                                                      threads=2, progress=False)]


def test_sweep_capacity__grids_of_nearby_pool_sizes_share_one_capacity():
    """Pools round up to powers of two, so these grids reuse one compiled chunk (in memory and
    in the persistent cache) and every run still hands out only its own blocks."""
    from jaxsched.sim.sweep import make_grid, parse_values, sweep_capacity
    from jaxsched.sim.trace import parse_trace

    parsed = parse_trace(TRACE)

    def capacity(blocks, host):
        axes = dict(num_device_blocks=blocks, num_host_blocks=host)
        _, configs = make_grid(parsed.scheduler_config, {k: parse_values(k, v) for k, v in axes.items()})
        return sweep_capacity(parsed, configs)

    caps = [capacity("8,20", "16"), capacity("8,24", "12"), capacity("17,32", "9")]
    assert caps[0] == caps[1] == caps[2]
    assert (caps[0]["num_device_blocks_capacity"], caps[0]["num_host_blocks_capacity"]) == (32, 16)
    assert capacity("8,33", "16")["num_device_blocks_capacity"] == 64


def test_sweep_chunk__the_map_path_traces_once_for_every_grid_size_thread_count_and_nearby_trace(monkeypatch):
    """One trace of the map path's chunk per capacity (`chex.assert_max_traces`, with no
    executable kept from the file's other tests): grids of 16, 40 and 1 configurations on
    3, 2 and 1 threads, pruned or not, and a trace of another size, all call the one
    compiled chunk (a second trace would raise)."""
    guarded = jax.jit(chex.assert_max_traces(sw.sweep_chunk.__wrapped__, n=1),
                      static_argnames=("cap", "width", "vmap_runs", "skips", "window"), donate_argnums=(0,))
    monkeypatch.setattr(sw, "sweep_chunk", guarded)
    monkeypatch.setattr(sw, "_EXECUTABLES", {})
    other = generate_trace(21, rate=0.6, prompt=LogNormal(4.2, 0.5), output=LogNormal(2.8, 0.7),
                           seed=5, config=TRACE["config"])
    run = functools.partial(sweep, capacity=CAPACITY, vmap_runs=1, progress=False)
    compiles = []
    for trace, grid, threads, prune in ((TRACE, GRID, 3, None), (TRACE, WIDE_GRID, 2, True),
                                        (TRACE, dict(GRID, num_device_blocks=[20], max_num_seqs=[8]), 1, False),
                                        (other, GRID, 2, True)):
        stats = {}
        run(trace, **grid, threads=threads, prune=prune, stats=stats)
        compiles.append(stats["compiles"])
    assert compiles == [2, 0, 0, 0]      # the chunk and `first_batch`, once


def test_replay_capacity__block_tables_round_up_by_at_most_a_quarter():
    """max_blocks_per_seq rounds up to capacity.bucket's steps (16, 20, 24, 28, 32, 40, ...):
    traces whose longest sequences need 21 and 23 blocks share a compiled step, and no
    table is more than a quarter wider than it must be."""
    from jaxsched.sim.capacity import bucket
    from jaxsched.sim.sweep import make_grid, parse_values, sweep_capacity
    from jaxsched.sim.trace import parse_trace

    assert [bucket(x) for x in (1, 8, 9, 17, 20, 21, 33, 500)] == [1, 8, 10, 20, 20, 24, 40, 512]
    assert all(x <= bucket(x) <= 1.25 * x for x in range(1, 5000))

    def capacity(longest):
        trace = parse_trace(dict(config=dict(block_size=16, num_device_blocks=64, max_model_len=512),
                                 requests=[dict(id="a", prompt_len=longest - 40, max_tokens=40),
                                           dict(id="b", prompt_len=20, max_tokens=20, arrival_step=3)]))
        _, configs = make_grid(trace.scheduler_config, {"max_num_seqs": parse_values("max_num_seqs", "4,8")})
        return sweep_capacity(trace, configs)

    assert capacity(330) == capacity(360)           # 331 and 361 tokens: 21 and 23 blocks
    assert capacity(330)["max_blocks_per_seq"] == 24
    assert capacity(400)["max_blocks_per_seq"] == 28          # 401 tokens: 26 blocks


def test_roots_and_resumes__a_run_answers_for_a_start_while_its_slack_lasts():
    """The first runs are each group's largest per mode; a smaller configuration starts from
    such a run's state at the last chunk boundary its slack covers, and never past the arrival
    of a request one of the two ignores (n between their max_num_seqs)."""
    from jaxsched.core.config import SchedulerConfig
    from jaxsched.sim import sweep_prune

    grid = [SchedulerConfig(num_device_blocks=b, max_num_seqs=s, preemption_mode=m)
            for m in ("recompute", "swap") for s in (2, 8) for b in (16, 32)]
    assert sweep_prune.roots(grid) == [3, 7]          # B=32, S=8 of each mode
    assert sweep_prune.roots(grid[:1]) == []
    # Requests of n=1 but one of n=4 arriving at step 20: S=2 ignores it, S=8 does not.
    resumes = sweep_prune.Resumes(grid, request_n=[1, 1, 4], arrival_step=[0, 3, 20], chunk=8)
    resumes.begin(runs=[3, 7], targets=[0, 1, 2, 4])
    # Chunk 0: block slack 20 covers B=16 (32 - 20 <= 16), seq slack 6 covers S=2.
    assert resumes.feed([0, 1], [0, 0], block=[20, 20], seq=[6, 6]) == [(0, 1)]
    resumes.store(0, 1, "state of run 3 after chunk 0")
    # Chunk 1: slack 10 no longer covers B=16; B=32, S=2 goes on to the arrival's boundary.
    assert resumes.feed([0], [1], block=[10], seq=[6]) == [(0, 2)]
    resumes.store(0, 2, "after chunk 1")
    assert resumes.feed([0], [2], block=[10], seq=[6]) == []     # boundary 3 > 20 // 8
    assert resumes.start(0) == (8, 3, "state of run 3 after chunk 0")
    assert resumes.start(1) == (16, 3, "after chunk 1")
    assert resumes.start(2) == (8, 3, "state of run 3 after chunk 0")         # S=8, B=16
    # The modes share decisions while nothing is preempted (slack >= 0): swap, S=2, B=16 too.
    assert resumes.start(4) == (8, 3, "state of run 3 after chunk 0")
    # A preemption (slack < 0) parts runs of other limits or mode: no later start.
    assert resumes.feed([1], [0], block=[-1], seq=[6]) == []
    resumes.drop([0, 1, 2, 4])
    assert resumes.start(0) is None and resumes.snaps == {}
