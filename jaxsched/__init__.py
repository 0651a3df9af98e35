"""jaxsched: vLLM's scheduler and paged KV-cache manager as pure JAX functions.

    state = jaxsched.init_state(config)
    state, slots = jaxsched.add_requests(state, batch)
    state, out = jaxsched.schedule(state, config, now)
    state, sampled, finished = jaxsched.update(state, out.scheduled, out.num_scheduled_tokens, out.is_prefill)
    state, freed = jaxsched.free_finished(state)
"""
from jaxsched.config import Capacity, SchedulerConfig
from jaxsched.invariants import InvariantError, check_invariants
from jaxsched.requests import RequestBatch, abort, add_requests, free_finished, make_batch, update
from jaxsched.scheduler import SchedulerOutput, schedule, schedule_step
from jaxsched.simulate import simulate, summarize
from jaxsched.state import Limits, SchedulerState, init_state, set_limits
from jaxsched.trace import TraceError, load_trace, parse_trace

__all__ = [
    "Capacity", "SchedulerConfig", "InvariantError", "check_invariants", "RequestBatch", "abort",
    "add_requests", "free_finished", "make_batch", "update", "SchedulerOutput", "schedule",
    "schedule_step", "simulate", "summarize", "Limits", "SchedulerState", "init_state",
    "set_limits", "TraceError", "load_trace", "parse_trace",
]
