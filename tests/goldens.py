"""The golden workloads of tests/data/golden/ (its README.md gives the format).

`NAME.trace.json` is a workload; `NAME.vllm.json`, where present, is what the real vLLM 0.5.3
decided on it. Without one, vLLM raised, overdrew its budget or never finished, and jaxsched
must serve every request to the end within the budget (SPEC part B).
"""
from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).resolve().parent / "data" / "golden"
# Prefix caching (SPEC A10): workloads whose config turns it on (both schedulers replay them).
PREFIX = "prefix-"
PREFIX_REASON = "a prefix caching (SPEC A10) workload, left out of this test"
FINAL_STATUSES = {"finished_length_capped", "finished_stopped", "finished_ignored",
                  "finished_aborted"}


def _names() -> list[str]:
    return sorted(p.name.removesuffix(".trace.json") for p in GOLDEN_DIR.glob("*.trace.json"))


def golden_names(with_vllm: bool) -> list[str]:
    """Workloads with (or without) vLLM's decisions, prefix-caching ones left out."""
    return [n for n in _names() if not n.startswith(PREFIX)
            and (GOLDEN_DIR / f"{n}.vllm.json").exists() == with_vllm]


def prefix_names() -> list[str]:
    return [n for n in _names() if n.startswith(PREFIX)]


def golden_cases(prefix_caching: bool = False) -> list:
    """Every golden workload as a pytest parameter; the prefix-caching ones marked skip
    unless `prefix_caching` asks for them."""
    return [pytest.param(n, marks=pytest.mark.skip(reason=PREFIX_REASON))
            if n.startswith(PREFIX) and not prefix_caching else n for n in _names()]


def load(name: str, kind: str = "trace") -> dict:
    """`kind` is "trace" or "vllm"."""
    return json.loads((GOLDEN_DIR / f"{name}.{kind}.json").read_text())


@functools.cache
def _needs(name: str) -> tuple[tuple, dict]:
    """(the golden's group: block size, chunked prefill, prefix caching; the static sizes its
    replay alone needs)."""
    from jaxsched.sim.capacity import replay_capacity
    from jaxsched.sim.trace import parse_trace
    trace = parse_trace(load(name))
    cfg = trace.scheduler_config
    return ((cfg.block_size, cfg.enable_chunked_prefill, cfg.enable_prefix_caching),
            replay_capacity(trace, [cfg], restarts=False))


def golden_capacity(name: str) -> dict:
    """Static sizes for replaying golden `name`: the smallest that hold every golden of its
    group, whose replays then share one compiled step and step a state no larger than the
    group needs."""
    group = _needs(name)[0]
    needs = [_needs(other)[1] for other in _names() if _needs(other)[0] == group]
    return {k: max(need[k] for need in needs) for k in needs[0]}


def assert_replays_golden(name: str, got: dict, statuses=FINAL_STATUSES) -> None:
    """`got`, a replay of workload `name`, made vLLM's decisions where vLLM has a record;
    where it has none (vLLM raised, overdrew its budget or never finished: SPEC B1, B3, B5),
    every request reached one of `statuses` and no step ran a chunk <= 0."""
    if (GOLDEN_DIR / f"{name}.vllm.json").exists():
        assert_matches_vllm(got, load(name, "vllm"))
        return
    assert set(got["requests"]) == {r["id"] for r in load(name)["requests"]}
    for request_id, result in got["requests"].items():
        assert result["status"] in statuses, request_id
    assert all(s["num_tokens"] > 0 for step in got["steps"] for s in step["scheduled"])


def multiset(step: dict) -> dict:
    """The step with every list made order-insensitive."""
    return {k: Counter(json.dumps(x, sort_keys=True) for x in v) if isinstance(v, list) else v
            for k, v in step.items()}


def assert_same_steps(got: dict, want: dict) -> None:
    """Two replays made the same decisions at every step (lists in any order) and ended every
    request alike."""
    assert len(got["steps"]) == len(want["steps"])
    for mine, theirs in zip(got["steps"], want["steps"]):
        assert multiset(mine) == multiset(theirs), f"step {theirs['step']}"
    assert got["requests"] == want["requests"]
    assert got["num_preemptions"] == want["num_preemptions"]


def assert_matches_vllm(got: dict, want: dict) -> None:
    """`got` made vLLM's decisions `want` at every step, up to vLLM's leaked swap space.

    NOTE: where vLLM ignores a swapped group at swap-in (NEVER) it never frees the group's
    host blocks; jaxsched does (SPEC B2). So from that step on our `num_free_host_blocks` is
    higher by what vLLM leaked, and that is the only difference allowed: the leak grows only
    in such a step, by the host blocks the group took at its last swap-out where that step
    swapped out nothing else.
    """
    assert len(got["steps"]) == len(want["steps"])
    swapped_at: dict[str, int] = {}      # a swapped group's last swap-out step
    leaked = 0
    for mine, theirs in zip(got["steps"], want["steps"]):
        step = theirs["step"]
        for rid in theirs["swapped_in"]:
            swapped_at.pop(rid, None)
        new_leaks = [swapped_at.pop(rid) for rid in theirs["ignored"] if rid in swapped_at]
        for rid in theirs["swapped_out"]:
            swapped_at[rid] = step
        grown = mine["num_free_host_blocks"] - theirs["num_free_host_blocks"] - leaked
        if not new_leaks:
            assert grown == 0, f"step {step}: num_free_host_blocks"
        else:
            assert grown > 0, f"step {step}: the ignored group's host blocks were not freed"
            at = new_leaks[0]
            out = want["steps"][at]
            if len(new_leaks) == 1 and at > 0 and len(out["swapped_out"]) == 1 and not out["swapped_in"]:
                took = want["steps"][at - 1]["num_free_host_blocks"] - out["num_free_host_blocks"]
                assert grown == took, f"step {step}: num_free_host_blocks"
        leaked += grown
    strip = lambda r: dict(r, steps=[{k: v for k, v in s.items() if k != "num_free_host_blocks"}
                                     for s in r["steps"]])
    assert_same_steps(strip(got), strip(want))
