"""Synthetic traces: reproducible, the requested length and arrival statistics, valid, CLI."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from jaxsched.entrypoints.cli_sweep import register
from jaxsched.sim.trace import parse_trace
from jaxsched.sim.workload import (LogNormal, arrival_steps, fit_lognormal, fit_step_time, generate_trace,
                               measure_step_time)

BIG = dict(max_model_len=100_000, max_num_batched_tokens=100_000)   # no clipping


def make_trace(num_requests=200, **overrides):
    kwargs = dict(rate=0.5, prompt=LogNormal(4.0, 0.6), output=LogNormal(3.0, 0.5), seed=7)
    kwargs.update(overrides)
    return generate_trace(num_requests, **kwargs)


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="jaxsched")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_generate_trace__same_seed_same_trace():
    assert make_trace(seed=3, arrival="bursty") == make_trace(seed=3, arrival="bursty")
    assert make_trace(seed=3) != make_trace(seed=4)


def test_generate_trace__lengths_match_the_lognormal():
    trace = make_trace(5000, prompt=LogNormal(5.0, 0.7), output=LogNormal(3.5, 0.4), config=BIG)
    for key, mu, sigma in (("prompt_len", 5.0, 0.7), ("max_tokens", 3.5, 0.4)):
        logs = np.log([r[key] for r in trace["requests"]])
        assert abs(logs.mean() - mu) < 0.05, key
        assert abs(logs.std() - sigma) < 0.05, key


def test_generate_trace__fits_the_prompt_distribution_to_observed_lengths():
    observed = np.random.default_rng(0).lognormal(4.2, 0.5, 3000).round().astype(int).tolist()
    mu, sigma = fit_lognormal(observed)
    assert abs(mu - 4.2) < 0.03 and abs(sigma - 0.5) < 0.03
    logs = np.log([r["prompt_len"] for r in make_trace(5000, prompt=observed, config=BIG)["requests"]])
    assert abs(logs.mean() - mu) < 0.05 and abs(logs.std() - sigma) < 0.05


def test_generate_trace__poisson_arrivals_keep_the_rate():
    steps = [r["arrival_step"] for r in make_trace(4000, rate=2.0)["requests"]]
    assert steps[0] == 0 and steps == sorted(steps)
    assert abs(steps[-1] / 4000 - 0.5) < 0.05           # 1 / rate steps per request


def test_generate_trace__bursty_arrivals_are_burstier_at_the_same_rate():
    def dispersion(arrival, **kw):
        steps = arrival_steps(np.random.default_rng(1), 20_000, 0.5, arrival, **kw)
        counts = np.bincount(steps // 50)
        return counts.var() / counts.mean(), steps[-1]
    poisson, end_p = dispersion("poisson", burstiness=4.0, burst_size=1)
    bursty, end_b = dispersion("bursty", burstiness=4.0, burst_size=1)
    assert 0.7 < poisson < 1.3 and bursty > 2.5
    assert abs(end_b / end_p - 1) < 0.1                  # same mean rate


def test_generate_trace__bursts_of_k_arrive_in_the_same_step():
    steps = [r["arrival_step"] for r in make_trace(300, arrival="bursty", burst_size=3)["requests"]]
    assert all(c % 3 == 0 for c in np.bincount(steps) if c)


def test_generate_trace__lengths_are_clipped_to_max_model_len():
    trace = make_trace(2000, prompt=LogNormal(4.5, 1.5), output=LogNormal(4.0, 1.5),
                       config=dict(max_model_len=64))
    for r in trace["requests"]:
        assert 1 <= r["prompt_len"] <= 63 and 1 <= r["max_tokens"] <= 64 - r["prompt_len"]


def test_generate_trace__share_of_parallel_samples():
    ns = np.array([r["n"] for r in make_trace(5000, n_share=0.3, max_n=3)["requests"]])
    assert abs((ns > 1).mean() - 0.3) < 0.03 and set(ns) == {1, 2, 3}
    assert {r["n"] for r in make_trace(500, n_share=0.0)["requests"]} == {1}


def test_generate_trace__is_a_valid_replay_trace_with_the_config_overrides():
    trace = make_trace(50, config=dict(num_device_blocks=77, preemption_mode="swap", step_time=0.5))
    parsed = parse_trace(trace)
    assert parsed.scheduler_config.num_device_blocks == 77 and parsed.step_time == 0.5
    assert len({r["id"] for r in trace["requests"]}) == 50
    json.dumps(trace)                                    # plain JSON types only


@pytest.mark.parametrize("kwargs, message", [
    (dict(rate=0.0), "rate must be > 0"),
    (dict(arrival="uniform"), "arrival must be one of"),
    (dict(n_share=1.5), "n_share"),
    (dict(prompt=LogNormal(4.0, 0.5), output="long"), "output must be a LogNormal"),
    (dict(arrival="bursty", burstiness=0.0), "burstiness"),
    (dict(config=dict(num_device_blocks=0)), "num_device_blocks"),
])
def test_generate_trace__bad_arguments_raise_clear_errors(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make_trace(10, **kwargs)


def test_fit_lognormal__rejects_too_few_or_non_positive_lengths():
    with pytest.raises(ValueError, match="at least 2"):
        fit_lognormal([5])
    with pytest.raises(ValueError, match=">= 1"):
        fit_lognormal([5, 0])


def test_cli_trace_generate__writes_a_reproducible_trace(tmp_path, capsys):
    lengths = tmp_path / "prompts.txt"
    lengths.write_text("\n".join(str(x) for x in (30, 60, 90, 120, 45, 80)))
    argv = ["trace", "generate", "--num-requests", "40", "--rate", "0.25", "--arrival", "bursty",
            "--prompt-lengths", str(lengths), "--output-mu", "3", "--output-sigma", "0.3",
            "--seed", "5", "--num-device-blocks", "96", "--preemption-mode", "swap"]
    assert run_cli(argv + ["-o", str(tmp_path / "a.json")]) == 0
    assert run_cli(argv + ["-o", str(tmp_path / "b.json")]) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    assert a == json.loads((tmp_path / "b.json").read_text())
    assert len(a["requests"]) == 40 and a["config"]["num_device_blocks"] == 96
    assert a["config"]["preemption_mode"] == "swap"
    assert "wrote" in capsys.readouterr().out


def test_cli_trace_generate__bad_input_is_one_error_line(tmp_path, capsys):
    rc = run_cli(["trace", "generate", "-o", str(tmp_path / "t.json"), "--num-requests", "5",
                  "--rate", "-1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("jaxsched trace generate:") and err.count("\n") == 1


def test_fit_step_time__recovers_a_linear_cost_model():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 512, (200, 3))
    seconds = 2e-3 + 3e-6 * x[:, 0] + 5e-5 * x[:, 1] + 1e-5 * x[:, 2] + rng.normal(0, 1e-6, 200)
    model = fit_step_time([(*row, s) for row, s in zip(x.tolist(), seconds)])
    assert model.base == pytest.approx(2e-3, rel=0.01)
    assert model.per_prefill_token == pytest.approx(3e-6, rel=0.01)
    assert model.per_decode_seq == pytest.approx(5e-5, rel=0.01)
    assert model.per_swapped_block == pytest.approx(1e-5, rel=0.01)
    dicts = [dict(prefill_tokens=p, decode_seqs=d, swapped_blocks=0, seconds=1.0 + p)
             for p, d in ((1, 2), (3, 1), (5, 5))]
    assert fit_step_time(dicts).per_prefill_token == pytest.approx(1.0)


def test_measure_step_time__times_a_step_function_at_each_point():
    calls = []
    rows = measure_step_time(lambda p, d, s: calls.append((p, d, s)), [(0, 1, 0), (64, 0, 2)], repeats=3)
    assert [r[:3] for r in rows] == [(0, 1, 0), (64, 0, 2)] and all(r[3] >= 0 for r in rows)
    assert len(calls) == 8                                # a warm-up and 3 timed calls per point
    fit_step_time(rows)
