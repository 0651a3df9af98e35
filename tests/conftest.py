"""Shared factories: configs, request traces, and a step-by-step driver that checks invariants."""
from __future__ import annotations

import os

# No persistent compilation cache in the tests (the servers and CLIs they start inherit this):
# each process compiles for itself and nothing lands in ~/.cache. XLA:CPU's executable
# serialization, which every cache write runs, has crashed a test worker (abort once,
# segfault once) in full runs with a cache shared across the run; a crashed worker loses its
# file's results. The front ends keep the cache on by default.
os.environ.setdefault("JAXSCHED_COMPILATION_CACHE_DIR", "off")
# The suite is compile-bound (hundreds of small programs, each run for a few steps), so the
# tests trade XLA:CPU's run-time optimization for compile time: the classic elemental fusion
# emitters and LLVM at -O0 compile the scheduler's step about 2.5x faster, and engine/parity
# files run about 35% faster end to end, though each step runs slower. Semantics do not change
# (the same HLO: the scheduler's integer decisions are exact, and the parity checks against
# torch hold at the same tolerances); they come after the front ends' own
# (`xla_flags.CPU_FLAGS`). The sharding workers the tests start inherit these flags; the servers do
# not (test_server.py: they run long enough that -O0 costs more than it saves).
from jaxsched.entrypoints.xla_flags import use_xla_flags  # noqa: E402

use_xla_flags("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0")

import contextlib  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxsched.core.state import Status  # noqa: E402
from jaxsched.engine import compile_options  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)

from jaxsched.entrypoints.compilation_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache()

from jaxsched import (SchedulerConfig, add_requests, check_invariants, free_finished,  # noqa: E402
                      init_state, make_batch, schedule_step, update)

# The files that take longest (summed test time, slowest first), collected first: with
# `--dist loadfile` pytest-xdist deals files to its workers in collection order, so these
# start at once and the short files fill in at the end. By test count (xdist's default
# order) the two workers' tests filled 93.1% of a full run (893 s); longest first, 94.4%
# (878 s, the same hour): a small gain, one run each.
LONGEST_FIRST = ("test_sweep.py", "test_scheduler.py", "test_server.py", "test_parity.py",
                 "test_differential.py", "test_engine.py", "test_sharding.py", "test_prefix_scheduler.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # stable: a file stays in order


# One static capacity for the scheduler tests: every example reuses one compiled step.
TEST_CAPACITY = dict(num_slots=32, max_seqs_per_group=4, max_blocks_per_seq=64,
                     num_device_blocks_capacity=128, num_host_blocks_capacity=128)


def make_config(**overrides) -> SchedulerConfig:
    base = dict(block_size=16, num_device_blocks=64, num_host_blocks=64, max_num_seqs=16,
                max_num_batched_tokens=512, max_model_len=512, **TEST_CAPACITY)
    base.update(overrides)
    for cap_key, key in (("num_device_blocks_capacity", "num_device_blocks"),
                         ("num_host_blocks_capacity", "num_host_blocks")):
        base[cap_key] = max(base[cap_key], base[key])
    return SchedulerConfig(**base)


def make_requests(n: int, *, seed: int = 0, prompt=(1, 200), max_tokens=(1, 100), max_n=1,
                  arrival_gap=(0, 2)) -> list[dict]:
    rnd = np.random.default_rng(seed)
    step, out = 0, []
    for i in range(n):
        step += int(rnd.integers(arrival_gap[0], arrival_gap[1] + 1))
        out.append({"id": f"r{i}", "arrival_step": step,
                    "prompt_len": int(rnd.integers(prompt[0], prompt[1] + 1)),
                    "max_tokens": int(rnd.integers(max_tokens[0], max_tokens[1] + 1)),
                    "n": int(rnd.integers(1, max_n + 1))})
    return out


def drive(config: SchedulerConfig, requests: list[dict], *, step_time: float = 1.0,
          max_steps: int = 5000, batch_size: int = 8, check: bool = True):
    """Run requests step by step through the public transitions, checking invariants.

    Returns (per-step outputs as numpy dicts, final state, per-request final status).
    """
    cap = config.capacity()
    state = jax.device_put(init_state(config), jax.devices()[0])
    by_step: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        by_step.setdefault(r["arrival_step"], []).append(i)
    done: dict[int, int] = {}
    steps = []
    for step in range(max_steps):
        rows = [dict(request_index=i, prompt_len=requests[i]["prompt_len"], n=requests[i]["n"],
                     max_tokens=requests[i]["max_tokens"], arrival_time=step * step_time)
                for i in by_step.get(step, [])]
        for k in range(0, len(rows), batch_size):
            state, _ = add_requests(state, make_batch(rows[k:k + batch_size], batch_size))
        state, out = schedule_step(state, cap, step * step_time)
        if check:
            check_invariants(state, config, out)
        state, _, _ = update(state, out.scheduled, out.num_scheduled_tokens, out.is_prefill)
        if check:
            check_invariants(state, config)
        status = np.asarray(state.status)
        for slot in np.nonzero(status == Status.FINISHED)[0]:
            done[int(state.request_index[slot])] = int(state.finish_reason[slot])
        steps.append(jax.device_get(out._asdict()))
        state, _ = free_finished(state)
        if len(done) == len(requests):
            return steps, state, done
    raise AssertionError(f"{len(requests) - len(done)} requests unfinished after {max_steps} steps")


@contextlib.contextmanager
def optimized_model_parts():
    """Engines built inside compile their model and finish parts with XLA's own optimization
    (`compile_options.OPTIMIZED`), not the suite's -O0: SmolLM2's steps run about 4x slower
    at -O0, and a test that generates a few hundred of its tokens spent more time there than
    the compile saves. (The tiny models elsewhere are the other way round.)"""
    saved = dict(compile_options.CPU_PART_OPTIONS)
    compile_options.CPU_PART_OPTIONS.update(model=compile_options.OPTIMIZED, finish=compile_options.OPTIMIZED)
    try:
        yield
    finally:
        compile_options.CPU_PART_OPTIONS.update(saved)


@pytest.fixture
def ci_strict():
    return os.environ.get("CI", "").lower() == "true"
