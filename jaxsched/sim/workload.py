"""Synthetic request traces for `jaxsched simulate` and sweeps: arrivals and lengths.

    trace = generate_trace(500, rate=0.5, arrival="bursty", prompt=LogNormal(5.0, 0.8),
                           output=LogNormal(4.5, 0.6), seed=0, config={"num_device_blocks": 512})

Arrivals are counted in steps (`rate` = requests per step). Poisson arrivals have exponential
gaps; bursty ones have gamma gaps with the same mean and a squared coefficient of variation
of `burstiness` (1 is Poisson, larger is burstier), optionally in bursts of `burst_size`
requests that arrive in the same step. Lengths are log-normal, rounded and clipped so that
prompt + output never exceeds `max_model_len` (the block tables stay small). Everything comes
from one `numpy.random.default_rng(seed)`: the same arguments give the same trace.

What a step costs: `StepTimeModel` (seconds = a + b*prefill_tokens + c*decode_seqs +
d*swapped_blocks), fitted by least squares (`fit_step_time`) to timings, for example of a
model's forward pass (`measure_step_time`); `sweep` then reports seconds as well as steps.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxsched.core.config import SchedulerConfig
from jaxsched.sim.trace import TRACE_CONFIG_KEYS, parse_trace

ARRIVALS = ("poisson", "bursty")


@dataclasses.dataclass(frozen=True)
class LogNormal:
    """Lengths exp(N(mu, sigma)): `mu` and `sigma` are the mean and std of log(length)."""
    mu: float
    sigma: float

    def __post_init__(self):
        if not (np.isfinite(self.mu) and np.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"LogNormal: need finite mu and sigma >= 0, got ({self.mu}, {self.sigma})")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return rng.lognormal(self.mu, self.sigma, size)


def fit_lognormal(lengths: Sequence[int]) -> tuple[float, float]:
    """Maximum-likelihood (mu, sigma) of positive lengths: mean and std of their logs."""
    x = np.asarray(lengths, dtype=np.float64).ravel()
    if x.size < 2:
        raise ValueError(f"fit_lognormal: need at least 2 lengths, got {x.size}")
    if not (np.all(np.isfinite(x)) and np.all(x >= 1)):
        raise ValueError("fit_lognormal: lengths must be finite and >= 1")
    logs = np.log(x)
    return float(logs.mean()), float(logs.std())


def _as_dist(spec, name: str) -> LogNormal:
    if isinstance(spec, LogNormal):
        return spec
    if isinstance(spec, (list, tuple, np.ndarray)):
        return LogNormal(*fit_lognormal(spec))
    raise TypeError(f"generate_trace: {name} must be a LogNormal or a list of lengths, "
                    f"got {type(spec).__name__}")


def arrival_steps(rng: np.random.Generator, num_requests: int, rate: float, arrival: str,
                  burstiness: float, burst_size: int) -> np.ndarray:
    """Arrival step of each request, non-decreasing, the first at step 0."""
    if arrival not in ARRIVALS:
        raise ValueError(f"generate_trace: arrival must be one of {ARRIVALS}, got {arrival!r}")
    if not rate > 0:
        raise ValueError(f"generate_trace: rate must be > 0 requests per step, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"generate_trace: burstiness must be > 0, got {burstiness}")
    if burst_size < 1:
        raise ValueError(f"generate_trace: burst_size must be >= 1, got {burst_size}")
    k = burst_size if arrival == "bursty" else 1
    num_bursts = -(-num_requests // k)
    mean_gap = k / rate                       # keeps `rate` requests per step on average
    if arrival == "poisson":
        gaps = rng.exponential(mean_gap, num_bursts)
    else:                                     # gamma(shape, scale): mean shape*scale, CV^2 1/shape
        shape = 1.0 / burstiness
        gaps = rng.gamma(shape, mean_gap / shape, num_bursts)
    gaps[0] = 0.0
    starts = np.floor(np.cumsum(gaps)).astype(np.int64)
    return np.repeat(starts, k)[:num_requests]


def generate_trace(num_requests: int, rate: float, *, arrival: str = "poisson",
                   prompt: LogNormal | Sequence[int] = LogNormal(5.0, 0.8),
                   output: LogNormal | Sequence[int] = LogNormal(4.5, 0.6),
                   n_share: float = 0.2, max_n: int = 4, burstiness: float = 4.0,
                   burst_size: int = 1, seed: int = 0, config: dict | None = None) -> dict:
    """A replay trace {"config", "requests"} with `num_requests` synthetic requests.

    `prompt` and `output` are LogNormal length distributions, or lists of observed lengths
    to fit one to (`fit_lognormal`). A share `n_share` of requests ask for n in [2, max_n]
    parallel samples, the rest for 1. `config` overrides the defaults of the trace config
    (SchedulerConfig's, plus step_time 1.0 and max_steps 100000). Prompts are clipped to
    [1, max_model_len - 1] and outputs (max_tokens) to [1, max_model_len - prompt_len].
    """
    if isinstance(num_requests, bool) or not isinstance(num_requests, (int, np.integer)) or num_requests < 1:
        raise ValueError(f"generate_trace: num_requests must be a positive integer, got {num_requests!r}")
    if not 0 <= n_share <= 1:
        raise ValueError(f"generate_trace: n_share must be in [0, 1], got {n_share}")
    if max_n < 1 or (n_share > 0 and max_n < 2):
        raise ValueError(f"generate_trace: max_n must be >= 2 when n_share > 0, got {max_n}")
    prompt, output = _as_dist(prompt, "prompt"), _as_dist(output, "output")
    defaults = SchedulerConfig()
    cfg = {k: getattr(defaults, k) for k in TRACE_CONFIG_KEYS} | {"step_time": 1.0, "max_steps": 100_000}
    cfg.update(config or {})
    max_len = int(cfg["max_model_len"])
    if max_len < 2:
        raise ValueError(f"generate_trace: max_model_len must be >= 2, got {max_len}")

    rng = np.random.default_rng(seed)
    steps = arrival_steps(rng, int(num_requests), rate, arrival, burstiness, burst_size)
    prompt_len = np.clip(np.rint(prompt.sample(rng, num_requests)), 1, max_len - 1).astype(np.int64)
    max_tokens = np.clip(np.rint(output.sample(rng, num_requests)), 1, max_len - prompt_len).astype(np.int64)
    multi = rng.random(num_requests) < n_share
    n = np.where(multi, rng.integers(2, max(max_n, 2) + 1, num_requests), 1)
    width = len(str(num_requests - 1))
    requests = [{"id": f"r{i:0{width}d}", "arrival_step": int(steps[i]), "prompt_len": int(prompt_len[i]),
                 "max_tokens": int(max_tokens[i]), "n": int(n[i])} for i in range(num_requests)]
    trace = {"config": cfg, "requests": requests}
    parse_trace(trace)                        # one clear TraceError for a bad config override
    return trace


# ----------------------------------------------------------------------------- step costs

@dataclasses.dataclass(frozen=True)
class StepTimeModel:
    """Seconds of one engine step: base + per_prefill_token * prefill_tokens
    + per_decode_seq * decode_seqs + per_swapped_block * swapped_blocks (out + in)."""
    base: float
    per_prefill_token: float = 0.0
    per_decode_seq: float = 0.0
    per_swapped_block: float = 0.0

    def __call__(self, prefill_tokens, decode_seqs, swapped_blocks):
        return (self.base + self.per_prefill_token * np.asarray(prefill_tokens, np.float64)
                + self.per_decode_seq * np.asarray(decode_seqs, np.float64)
                + self.per_swapped_block * np.asarray(swapped_blocks, np.float64))


def fit_step_time(measurements) -> StepTimeModel:
    """Least-squares StepTimeModel from rows (prefill_tokens, decode_seqs, swapped_blocks, seconds).

    Rows may be tuples or dicts with those keys. A column that never varies from zero (say,
    no swaps measured) gets a zero coefficient (the minimum-norm solution).
    """
    keys = ("prefill_tokens", "decode_seqs", "swapped_blocks", "seconds")
    rows = [[m[k] for k in keys] if isinstance(m, dict) else list(m) for m in measurements]
    data = np.asarray(rows, np.float64)
    if data.ndim != 2 or data.shape[1] != 4 or len(data) < 1:
        raise ValueError("fit_step_time: need rows of (prefill_tokens, decode_seqs, swapped_blocks, seconds)")
    design = np.column_stack([np.ones(len(data)), data[:, :3]])
    coef = np.linalg.lstsq(design, data[:, 3], rcond=None)[0]
    return StepTimeModel(*(float(c) for c in coef))


def measure_step_time(step_fn, points, repeats: int = 5) -> list[tuple]:
    """Time `step_fn(prefill_tokens, decode_seqs, swapped_blocks)` (median of `repeats`, after
    one warm-up call) at each point; rows for `fit_step_time`."""
    import time

    from jax import block_until_ready as block

    out = []
    for p, d, sw in points:
        block(step_fn(p, d, sw))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            block(step_fn(p, d, sw))
            times.append(time.perf_counter() - t0)
        out.append((p, d, sw, float(np.median(times))))
    return out
