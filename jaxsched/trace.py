"""Trace files: parsing and validation with one clear error line per problem."""
from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

from jaxsched.config import SchedulerConfig

CONFIG_KEYS = {"block_size", "num_device_blocks", "num_host_blocks", "max_num_seqs",
               "max_num_batched_tokens", "max_model_len", "enable_chunked_prefill",
               "preemption_mode", "preemption_costs", "delay_factor", "watermark", "step_time", "max_steps",
               "artificial_preemption", "seed"}
REQUEST_KEYS = {"id", "arrival_step", "prompt_len", "max_tokens", "n"}
REQUEST_DEFAULTS = {"arrival_step": 0, "n": 1}


class TraceError(ValueError):
    """A malformed trace; the message names the request and the field."""


@dataclasses.dataclass
class Trace:
    scheduler_config: SchedulerConfig
    requests: list[dict]
    step_time: float
    max_steps: int

    def arrivals_by_step(self) -> dict[int, list[int]]:
        out = defaultdict(list)
        for i, r in enumerate(self.requests):
            out[r["arrival_step"]].append(i)
        return dict(out)


def _int_field(where: str, key: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: field '{key}' must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(f"{where}: field '{key}' must be >= {minimum}, got {value}")
    return value


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
    else:
        if not isinstance(config, dict):
            raise TraceError("trace: 'config' must be an object")
        unknown = set(config) - CONFIG_KEYS
        if unknown:
            raise TraceError(f"config: unknown key {sorted(unknown)[0]!r}")
        config = dict(config)
        step_time = float(config.pop("step_time", step_time))
        max_steps = int(config.pop("max_steps", max_steps))
        try:
            cfg = SchedulerConfig(**config)
        except (TypeError, ValueError) as e:
            raise TraceError(f"config: {e}") from None
    if not step_time > 0:
        raise TraceError(f"config: field 'step_time' must be > 0, got {step_time}")
    requests = data.get("requests")
    if not isinstance(requests, list):
        raise TraceError("trace: 'requests' must be a list")
    seen, out = set(), []
    for i, r in enumerate(requests):
        where = f"request #{i}"
        if not isinstance(r, dict):
            raise TraceError(f"{where}: must be an object")
        if "id" in r:
            where = f"request {r['id']!r}"
        unknown = set(r) - REQUEST_KEYS
        if unknown:
            raise TraceError(f"{where}: unknown field {sorted(unknown)[0]!r}")
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
        _int_field(where, "arrival_step", row["arrival_step"], 0)
        _int_field(where, "prompt_len", row["prompt_len"], 1)
        _int_field(where, "max_tokens", row["max_tokens"], 1)
        _int_field(where, "n", row["n"], 1)
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
