"""What a preemption costs: recompute (re-prefill) against swap (out and back in).

    costs = PreemptionCosts(recompute_fixed=0.02, recompute_per_token=2e-3, swap_fixed=1e-4,
                            swap_per_block=4e-4)
    config = SchedulerConfig(preemption_mode="auto", preemption_costs=costs)

With `preemption_mode="auto"` each victim of the running walk is swapped iff

    swap_fixed + swap_per_block * B  <  recompute_fixed + T * (recompute_per_token
                                                             + recompute_per_token_sq * T)

where B is the victim's unique device blocks (what a swap moves out and later back in) and
T the tokens a recompute would prefill again (SPEC B1: the prompt's full blocks once, plus
every live sequence's own tokens). Ties recompute. A swap that no longer fits the host pool
recomputes, as in every mode.

The coefficients are seconds on some backend: `engine.cost_measure.measure_preemption_costs` times the model's
paged forward on prefills of several lengths and the cache's `swap_out` + `swap_in` on
several block counts, and `fit` turns the timings into coefficients (non-negative least
squares). `to_json` / `from_json` keep a measured model in a file. The formulas are module
functions over plain arithmetic so the jitted scheduler (float32 arrays) and the Python
reference (numpy float32) evaluate them in the same order and agree bit for bit.

This module imports only numpy at load time (config.py, a leaf, imports it); the
measurement imports jax and the cache kernels when it runs.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np

FIELDS = ("recompute_fixed", "recompute_per_token", "recompute_per_token_sq", "swap_fixed",
          "swap_per_block")


@dataclasses.dataclass(frozen=True)
class PreemptionCosts:
    """A fitted cost model, in seconds (hashable: it may sit in a SchedulerConfig).

    Attributes:
      recompute_fixed: seconds of a prefill beyond its tokens (one more model call).
      recompute_per_token: seconds per prefilled token.
      recompute_per_token_sq: seconds per token squared (attention over the prefix).
      swap_fixed: seconds of a swap-out plus swap-in beyond its blocks.
      swap_per_block: seconds to move one block (every layer's K and V) out and back in.
    """
    recompute_fixed: float
    recompute_per_token: float
    recompute_per_token_sq: float = 0.0
    swap_fixed: float = 0.0
    swap_per_block: float = 0.0

    def __post_init__(self):
        for name in FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"PreemptionCosts.{name}: must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))

    @property
    def coefficients(self) -> tuple[float, ...]:
        """The five coefficients in FIELDS order (what the scheduler's limits store)."""
        return tuple(getattr(self, name) for name in FIELDS)

    def recompute_seconds(self, tokens):
        return recompute_seconds(self.coefficients, tokens)

    def swap_seconds(self, blocks):
        return swap_seconds(self.coefficients, blocks)

    def to_json(self, path: str | Path | None = None, **extra) -> str:
        """The coefficients (plus `extra` keys, e.g. the measurements) as JSON; written to
        `path` when given."""
        text = json.dumps({**{name: getattr(self, name) for name in FIELDS}, **extra}, indent=1)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> PreemptionCosts:
        """From a file written by `to_json`, or from its text; keys besides FIELDS are ignored."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            path = Path(source)
            if not path.exists():
                raise ValueError(f"no such file {str(path)!r}")
            text = path.read_text()
        data = json.loads(text)
        missing = [n for n in ("recompute_fixed", "recompute_per_token") if n not in data]
        if missing:
            raise ValueError(f"the JSON lacks {missing[0]!r}")
        return cls(**{n: data[n] for n in FIELDS if n in data})

    @classmethod
    def coerce(cls, value) -> PreemptionCosts:
        """A PreemptionCosts from itself, a dict of FIELDS, or a sequence in FIELDS order."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(FIELDS))
            if unknown:
                raise ValueError(f"unknown key {unknown[0]!r} (expected {', '.join(FIELDS)})")
            missing = [n for n in FIELDS[:2] if n not in value]
            if missing:
                raise ValueError(f"missing key {missing[0]!r}")
            return cls(**value)
        if isinstance(value, (list, tuple)) and len(value) == len(FIELDS):
            return cls(*value)
        raise ValueError(f"expected a PreemptionCosts, a dict of {', '.join(FIELDS)} or a "
                         f"sequence of {len(FIELDS)} numbers, got {value!r}")


# NOTE: the default is a measurement of SmolLM2-135M, float32, block_size 16, on the 2-core
# CPU the benchmarks run on, rounded (prefill 40 ms + 3.8 ms per token; a block out and back
# in 0.095 ms). The engine's prefill has since become about 2x faster: the latest
# measurement, benchmarks/results/preemption_costs_cpu.json, fits 29 ms + 1.6 ms/token (+ a
# small quadratic term), and load on that shared machine moves prefill numbers by up to 2x
# between runs. None of it changes the verdict: one block's 16 tokens cost tens of ms to
# prefill again and ~0.1 ms to swap, so with these costs `auto` swaps whenever the host pool
# has room. An accelerator with a slow host link can turn that around (fast prefill, slow
# copies): measure there (`engine.cost_measure.measure_preemption_costs`) and pass the result.
DEFAULT_COSTS = PreemptionCosts(recompute_fixed=4e-2, recompute_per_token=3.8e-3,
                                recompute_per_token_sq=0.0, swap_fixed=0.0, swap_per_block=9.5e-5)


def recompute_seconds(c, tokens):
    """Seconds to prefill `tokens` again; `c` the FIELDS coefficients (floats or arrays)."""
    return c[0] + tokens * (c[1] + c[2] * tokens)


def swap_seconds(c, blocks):
    """Seconds to swap `blocks` out and back in."""
    return c[3] + c[4] * blocks


def reusable_blocks(prompt_len, lead_len, multi, block_size: int):
    """Full blocks at the head of a (re-)prefill that the prefix cache (SPEC A10) can give
    back: for one sequence every block before the one holding its last token (that token
    runs, its logits sample), for a re-prefilled forked group (`multi` 1: SPEC B1) the
    prompt's full blocks, which come first and are shared. Plain arithmetic (`multi` 0 or
    1), so the jitted scheduler, the reference and the engine count alike."""
    return multi * (prompt_len // block_size) + (1 - multi) * ((lead_len - 1) // block_size)


# ----------------------------------------------------------------------------- fitting

def _nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |a x - y| over x >= 0, for a handful of columns: the best of every subset's
    unconstrained fit whose coefficients are all >= 0 (exact; 2**columns small solves)."""
    best, best_err = np.zeros(a.shape[1]), float(np.sum(y ** 2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (x < 0).any():
                continue
            err = float(np.sum((a[:, cols] @ x - y) ** 2))
            if err < best_err:
                best, best_err = np.zeros(a.shape[1]), err
                best[list(cols)] = x
    return best


def fit(tokens, recompute_s, blocks, swap_s, quadratic: bool = True) -> PreemptionCosts:
    """Least-squares coefficients (all >= 0) from measured points.

    tokens, recompute_s: prefill lengths and their seconds; blocks, swap_s: block counts and
    the seconds of swap_out + swap_in. `quadratic=False` leaves recompute_per_token_sq at 0.
    """
    t, r = np.asarray(tokens, np.float64), np.asarray(recompute_s, np.float64)
    b, s = np.asarray(blocks, np.float64), np.asarray(swap_s, np.float64)
    cols = [np.ones_like(t), t] + ([t * t] if quadratic else [])
    rec = _nonneg_lstsq(np.stack(cols, 1), r)
    swp = _nonneg_lstsq(np.stack([np.ones_like(b), b], 1), s)
    return PreemptionCosts(rec[0], rec[1], rec[2] if quadratic else 0.0, swp[0], swp[1])


# ----------------------------------------------------------------------------- measuring
