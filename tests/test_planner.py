"""The capacity planner in memory units: gpu_memory_utilization / swap_space axes, goodput
under latency objectives, and the smallest configuration that meets a target."""
from __future__ import annotations

import numpy as np
import pytest

from jaxsched.engine.sizing import GiB, MemoryProfile
from jaxsched.sim.sweep import good_requests, pick_smallest, sweep
from jaxsched.sim.workload import LogNormal, StepTimeModel, generate_trace

TRACE = generate_trace(24, rate=0.5, prompt=LogNormal(4.0, 0.6), output=LogNormal(3.0, 0.6),
                       seed=1, config=dict(num_device_blocks=32, num_host_blocks=16, max_num_seqs=8,
                                           max_num_batched_tokens=128, max_model_len=128))
# A made-up device: 100 KiB, 10 KiB of weights and 10 KiB of working memory, 2 KiB blocks:
# int(u x 102400) - 20480 over 2048, less the null block: 14 blocks at 0.5, 24 at 0.7, 34 at 0.9.
PROFILE = MemoryProfile(total_bytes=100 * 1024, source="injected", weights_bytes=10 * 1024,
                        peak_bytes=10 * 1024, block_bytes=2048, host_total_bytes=64 * GiB)
GRID = dict(gpu_memory_utilization="0.5:0.9:0.2", swap_space=[0, 2 ** -16], max_num_seqs=[4, 8],
            preemption_mode=["swap"])
CAPACITY = dict(num_slots=32, max_seqs_per_group=4, max_blocks_per_seq=9,
                num_device_blocks_capacity=34, num_host_blocks_capacity=16)
SLO = dict(slo_ttft=40.0, slo_tpot=1.5)
MODEL = StepTimeModel(0.02, 0.0005, 0.001, 0.0001)


@pytest.fixture(scope="module")
def memory_rows():
    return sweep(TRACE, **GRID, memory=PROFILE, capacity=CAPACITY, progress=False, per_request=True, **SLO)


def test_memory_axes_become_the_hand_computed_block_counts(memory_rows):
    got = {(r["gpu_memory_utilization"], r["swap_space"]): (r["num_device_blocks"], r["num_host_blocks"])
           for r in memory_rows if r["max_num_seqs"] == 8}
    # 2^-16 GiB = 16 KiB = 8 blocks of 2 KiB, less the null block.
    assert got == {(0.5, 0): (14, 0), (0.5, 2 ** -16): (14, 7), (0.7, 0): (24, 0),
                   (0.7, 2 ** -16): (24, 7), (0.9, 0): (34, 0), (0.9, 2 ** -16): (34, 7)}


def test_rows_in_memory_units_equal_rows_of_the_same_block_counts(memory_rows):
    for mns in (4, 8):
        rows = [r for r in memory_rows if r["max_num_seqs"] == mns]
        blocks = sweep(TRACE, num_device_blocks=sorted({r["num_device_blocks"] for r in rows}),
                       num_host_blocks=[0, 7], max_num_seqs=[mns], preemption_mode=["swap"],
                       capacity=CAPACITY, progress=False, per_request=True, **SLO)
        by_count = {(b["num_device_blocks"], b["num_host_blocks"]): b for b in blocks}
        for r in rows:
            b = by_count[(r["num_device_blocks"], r["num_host_blocks"])]
            for key in b:
                assert r[key] == b[key], key


def test_goodput_equals_a_direct_count_of_per_request_latencies(memory_rows):
    slo_ttft, slo_tpot = SLO["slo_ttft"], SLO["slo_tpot"]
    seen = set()
    for r in memory_rows:
        good = sum(1 for a, b in zip(r["ttft"], r["tpot"])
                   if a is not None and a <= slo_ttft and b <= slo_tpot)
        assert r["goodput"] == good / len(TRACE["requests"])
        assert r["good_per_step"] == pytest.approx(good / r["steps"])
        seen.add(good)
    assert len(seen) > 2                       # the objectives separate the configurations


def test_latencies_by_hand():
    # One request, prompt 10, 5 tokens, room to spare: the prefill step samples the first token
    # (TTFT one step), then one token a step: TPOT 1, finishing at step 4.
    trace = generate_trace(1, rate=1.0, prompt=[10, 10], output=[5, 5], n_share=0, seed=0,
                           config=dict(num_device_blocks=16, max_model_len=64))
    trace["requests"][0].update(prompt_len=10, max_tokens=5)
    (row,) = sweep(trace, progress=False, per_request=True, slo_ttft=1, slo_tpot=1)
    assert (row["ttft"], row["tpot"], row["steps"], row["goodput"]) == ([1.0], [1.0], 5, 1.0)
    (row,) = sweep(trace, progress=False, per_request=True, slo_ttft=0.5)
    assert row["goodput"] == 0.0
    # Seconds: the step-time model's clock. Step 0 prefills 10 tokens; steps 1-4 decode one.
    (row,) = sweep(trace, progress=False, per_request=True, step_time_model=MODEL, slo_ttft=1)
    prefill, decode = 0.02 + 10 * 0.0005, 0.02 + 0.001
    assert row["ttft"][0] == pytest.approx(prefill)
    assert row["tpot"][0] == pytest.approx(decode)
    assert row["good_per_s"] == pytest.approx(1 / (prefill + 4 * decode))


def test_pick_is_the_smallest_in_the_grid_that_meets_the_target(memory_rows):
    size = lambda r: (r["gpu_memory_utilization"], r["swap_space"], r["max_num_seqs"])
    for target in sorted({r["goodput"] for r in memory_rows}):
        pick = pick_smallest(memory_rows, target)
        assert pick["goodput"] >= target
        assert all(size(pick) <= size(r) for r in memory_rows if r["goodput"] >= target)
    assert pick_smallest(memory_rows, 1.01) is None
    rows = [dict(gpu_memory_utilization=0.9, swap_space=1, max_num_seqs=8, goodput=1.0),
            dict(gpu_memory_utilization=0.6, swap_space=16, max_num_seqs=8, goodput=0.99),
            dict(gpu_memory_utilization=0.6, swap_space=4, max_num_seqs=16, goodput=0.98),
            dict(gpu_memory_utilization=0.5, swap_space=4, max_num_seqs=8, goodput=0.5)]
    assert pick_smallest(rows, 0.99) is rows[1]
    assert pick_smallest(rows, 0.98) is rows[2]


def test_good_requests_counts_only_served_requests_within_both():
    ok = good_requests([1.0, 2.0, None, 0.5], [0.1, 0.1, None, 0.3], 1.5, 0.2,
                       served=[True, True, False, True])
    assert ok.tolist() == [True, False, False, False]
    assert np.array_equal(good_requests([1.0, 2.0], [0.1, 0.1]), [True, True])


def test_cli_prints_the_smallest_configuration_and_plots_goodput(tmp_path, capsys):
    import argparse
    import json

    from jaxsched.entrypoints.cli_sweep import register
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    parser = argparse.ArgumentParser(prog="jaxsched")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sweep", str(path), "--num-device-blocks", "14,24,34", "--max-num-seqs", "4,8",
                              "--slo-ttft", "40", "--slo-tpot", "1.5", "--min-goodput", "0.5",
                              "--no-progress", "-o", str(tmp_path / "out")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "out" / "sweep.json").read_text())
    pick = pick_smallest(rows, 0.5)
    assert (f"smallest configuration with goodput >= 0.5: max_num_seqs={pick['max_num_seqs']}, "
            f"num_device_blocks={pick['num_device_blocks']}") in out
    assert (tmp_path / "out" / "sweep_goodput.png").stat().st_size > 0
    args = parser.parse_args(["sweep", str(path), "--gpu-memory-utilization", "0.5", "--no-progress"])
    assert args.func(args) == 2
    assert "need the model's memory profile" in capsys.readouterr().err
