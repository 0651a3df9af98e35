"""Trace files: parsing and validation with one clear error line per problem."""
from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from jaxsched.core.config import SchedulerConfig

# The config keys a generated trace writes: the scheduler limits vLLM's own replay of a
# trace reads too (the golden traces' format), with SchedulerConfig's defaults.
TRACE_CONFIG_KEYS = ("block_size", "num_device_blocks", "num_host_blocks", "max_num_seqs",
                     "max_num_batched_tokens", "max_model_len", "enable_chunked_prefill",
                     "preemption_mode", "delay_factor", "watermark")
# A trace's config: SchedulerConfig's fields (SPEC A10's enable_prefix_caching among them),
# plus how the replay runs.
REPLAY_KEYS = ("step_time", "max_steps")
CONFIG_KEYS = {f.name for f in dataclasses.fields(SchedulerConfig)} | set(REPLAY_KEYS)
# `prompt_token_ids` is optional: without it a prompt is the ids 0 .. prompt_len - 1 (A10).
REQUEST_KEYS = {"id", "arrival_step", "prompt_len", "max_tokens", "n", "prompt_token_ids"}
MAX_TOKEN_ID = 2**31 - 1
REQUEST_DEFAULTS = {"arrival_step": 0, "n": 1}
# Bounds that keep a replay's arrays to a size this machine can hold: a trace past them is
# a typo far more often than a workload.
INT_LIMITS = {"arrival_step": 10**7, "prompt_len": 2**20, "max_tokens": 2**20, "n": 256}
CONFIG_INT_LIMITS = {"block_size": 4096, "num_device_blocks": 2**20, "num_host_blocks": 2**20,
                     "max_num_seqs": 2**16, "max_num_batched_tokens": 2**24, "max_model_len": 2**20,
                     "artificial_preemption_count": 10**7, "seed": 2**31 - 1, "num_slots": 2**16,
                     "max_seqs_per_group": 256, "max_blocks_per_seq": 2**16,
                     "num_device_blocks_capacity": 2**20, "num_host_blocks_capacity": 2**20}
MAX_STEPS_LIMIT = 10**8


class TraceError(ValueError):
    """A malformed trace; the message names the request and the field."""


@dataclasses.dataclass
class Trace:
    scheduler_config: SchedulerConfig
    requests: list[dict]
    step_time: float
    max_steps: int

    @property
    def enable_prefix_caching(self) -> bool:
        """SPEC A10 (the config's switch)."""
        return self.scheduler_config.enable_prefix_caching

    def prompt_token_ids(self, i: int, width: int) -> np.ndarray:
        """Request i's prompt ids (SPEC A10: 0 .. prompt_len - 1 where it gives none), int32,
        zero-padded or cut to `width`: what a replay with prefix caching hashes."""
        r = self.requests[i]
        ids = np.asarray(r.get("prompt_token_ids", range(r["prompt_len"])), np.int32)[:width]
        return np.pad(ids, (0, width - len(ids)))

    def arrivals_by_step(self) -> dict[int, list[int]]:
        out = defaultdict(list)
        for i, r in enumerate(self.requests):
            out[r["arrival_step"]].append(i)
        return dict(out)


def _int_field(where: str, key: str, value, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: field '{key}' must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(f"{where}: field '{key}' must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise TraceError(f"{where}: field '{key}' must be <= {maximum}, got {value}")
    return value


def _parse_config(config: dict, step_time: float,
                  max_steps: int) -> tuple[SchedulerConfig, float, int]:
    unknown = set(config) - CONFIG_KEYS
    if unknown:
        raise TraceError(f"config: unknown key {sorted(unknown, key=str)[0]!r}")
    config = dict(config)
    caching = config.get("enable_prefix_caching", False)
    if not isinstance(caching, bool):
        raise TraceError(f"config: field 'enable_prefix_caching' must be true or false, "
                         f"got {caching!r}")
    step_time = config.pop("step_time", step_time)
    if isinstance(step_time, bool) or not isinstance(step_time, (int, float)) \
            or not math.isfinite(step_time) or step_time <= 0:
        raise TraceError(f"config: field 'step_time' must be a number > 0, got {step_time!r}")
    max_steps = _int_field("config", "max_steps", config.pop("max_steps", max_steps), 1, MAX_STEPS_LIMIT)
    for key, limit in CONFIG_INT_LIMITS.items():
        if key in config:
            _int_field("config", key, config[key], 0, limit)
    for key in ("enable_chunked_prefill", "artificial_preemption"):
        if key in config and not isinstance(config[key], bool):
            raise TraceError(f"config: field '{key}' must be true or false, got {config[key]!r}")
    for key in ("delay_factor", "watermark"):
        value = config.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TraceError(f"config: field '{key}' must be a number, got {value!r}")
    mode = config.get("preemption_mode")
    if mode is not None and not isinstance(mode, str):
        raise TraceError(f"config: field 'preemption_mode' must be null or one of "
                         f"'default', 'recompute', 'swap', 'auto', got {mode!r}")
    try:
        cfg = SchedulerConfig(**config)
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
        raise TraceError(f"config: {e}") from None
    return cfg, float(step_time), max_steps


def _prompt_token_ids(where: str, ids, prompt_len: int) -> list[int]:
    if not isinstance(ids, list):
        raise TraceError(f"{where}: field 'prompt_token_ids' must be a list of integers, "
                         f"got {type(ids).__name__}")
    if len(ids) != prompt_len:
        raise TraceError(f"{where}: field 'prompt_token_ids' has {len(ids)} ids, "
                         f"prompt_len is {prompt_len}")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN_ID:
            raise TraceError(f"{where}: field 'prompt_token_ids' must hold integers in "
                             f"[0, {MAX_TOKEN_ID}], got {token!r}")
    return ids


def parse_trace(data: dict, *, step_time: float = 1.0, max_steps: int = 100_000) -> Trace:
    """Validate a trace dict ({"config": ..., "requests": [...]}) into a Trace."""
    if not isinstance(data, dict):
        raise TraceError("trace: must be a JSON object with 'config' and 'requests'")
    unknown = set(data) - {"config", "requests"}
    if unknown:
        raise TraceError(f"trace: unknown key {sorted(unknown)[0]!r} (expected 'config', 'requests')")
    config = data.get("config", {})
    if isinstance(config, SchedulerConfig):
        cfg = config
        if isinstance(step_time, bool) or not isinstance(step_time, (int, float)) or not step_time > 0:
            raise TraceError(f"config: field 'step_time' must be a number > 0, got {step_time!r}")
    else:
        if not isinstance(config, dict):
            raise TraceError("trace: 'config' must be an object")
        cfg, step_time, max_steps = _parse_config(config, step_time, max_steps)
    requests = data.get("requests")
    if not isinstance(requests, list):
        raise TraceError("trace: 'requests' must be a list")
    if not requests:
        raise TraceError("trace: 'requests' is empty: nothing to replay")
    seen, out = set(), []
    for i, r in enumerate(requests):
        where = f"request #{i}"
        if not isinstance(r, dict):
            raise TraceError(f"{where}: must be an object")
        if isinstance(r.get("id"), str) and r["id"]:
            where = f"request {r['id']!r}"
        unknown = set(r) - REQUEST_KEYS
        if unknown:
            raise TraceError(f"{where}: unknown field {sorted(unknown, key=str)[0]!r}")
        for key in ("id", "prompt_len", "max_tokens"):
            if key not in r:
                raise TraceError(f"{where}: missing field '{key}'")
        rid = r["id"]
        if not isinstance(rid, str) or not rid:
            raise TraceError(f"{where}: field 'id' must be a non-empty string")
        if rid in seen:
            raise TraceError(f"{where}: duplicate id")
        seen.add(rid)
        row = {**REQUEST_DEFAULTS, **r}
        for key, minimum in (("arrival_step", 0), ("prompt_len", 1), ("max_tokens", 1), ("n", 1)):
            _int_field(where, key, row[key], minimum, INT_LIMITS[key])
        if "prompt_token_ids" in row:
            _prompt_token_ids(where, row["prompt_token_ids"], row["prompt_len"])
        out.append(row)
    return Trace(cfg, out, step_time, max_steps)


def load_trace(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such trace file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror})") from None
