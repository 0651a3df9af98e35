"""jaxsched: vLLM's scheduler and paged KV-cache manager as pure JAX functions, with a model.

    from jaxsched import LLM, SamplingParams
    outputs = LLM().generate(["Hello, my name is"], SamplingParams(max_tokens=16))

    state = jaxsched.init_state(config)
    state, slots = jaxsched.add_requests(state, batch)
    state, out = jaxsched.schedule(state, config, now)
    state, sampled, finished = jaxsched.update(state, out.scheduled, out.num_scheduled_tokens, out.is_prefill)
    state, freed = jaxsched.free_finished(state)
    rows = jaxsched.sweep(trace, num_device_blocks="64:1024:64", max_num_seqs=[8, 16])

The front end (`LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`, `Logprob`) is imported on
first use, so the scheduler alone does not load Flax or the model code.
"""
from jaxsched.core.config import Capacity, SchedulerConfig
from jaxsched.core.invariants import InvariantError, check_invariants
from jaxsched.core.requests import RequestBatch, abort, add_requests, free_finished, make_batch, update
from jaxsched.core.scheduler import SchedulerOutput, schedule, schedule_step
from jaxsched.sim.simulate import simulate, summarize
from jaxsched.core.state import Limits, SchedulerState, init_state, set_limits
from jaxsched.sim.trace import TraceError, load_trace, parse_trace
from jaxsched.sim.sweep import sweep  # noqa: E402  (the function; the module stays importable by path)

_FRONT_END = {"LLM": "jaxsched.entrypoints.llm", "SamplingParams": "jaxsched.engine.params",
              "RequestOutput": "jaxsched.engine.params", "CompletionOutput": "jaxsched.engine.params",
              "Logprob": "jaxsched.engine.params"}


def __getattr__(name: str):
    if name in _FRONT_END:
        import importlib
        value = getattr(importlib.import_module(_FRONT_END[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxsched' has no attribute {name!r}")


__all__ = [
    "Capacity", "SchedulerConfig", "InvariantError", "check_invariants", "RequestBatch", "abort",
    "add_requests", "free_finished", "make_batch", "update", "SchedulerOutput", "schedule",
    "schedule_step", "simulate", "summarize", "Limits", "SchedulerState", "init_state",
    "set_limits", "TraceError", "load_trace", "parse_trace", "sweep",
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
]
