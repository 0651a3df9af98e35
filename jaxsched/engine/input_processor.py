"""Pack host requests into the step's fixed-shape `NewRequests` arrays.

Every step takes the same shapes (`rows` requests of up to `max_prompt_len` tokens, unused
rows invalid), so adding requests never recompiles the step.
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from jaxsched.core.requests import RequestBatch
from jaxsched.engine.params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, NO_TOKEN
from jaxsched.engine.step import NewRequests, SamplingRows

# The per-request scalar columns: name, dtype, and how a request gives it. Each column
# becomes one field of RequestBatch or SamplingRows by the same name.
_BATCH_COLUMNS = {
    "request_index": (np.int32, lambda req: req.index),
    "prompt_len": (np.int32, lambda req: len(req.prompt_ids)),
    "n": (np.int32, lambda req: req.params.best_of),     # sampled; the best n returned
    "max_tokens": (np.int32, lambda req: req.params.max_tokens),
}
_SAMPLING_COLUMNS = {
    "temperature": (np.float32, lambda req: req.params.temperature),
    "top_k": (np.int32, lambda req: max(req.params.top_k, 0)),
    "top_p": (np.float32, lambda req: req.params.top_p),
    "min_p": (np.float32, lambda req: req.params.min_p),
    "min_tokens": (np.int32, lambda req: req.params.min_tokens),
    "ignore_eos": (bool, lambda req: req.params.ignore_eos),
    "presence_penalty": (np.float32, lambda req: req.params.presence_penalty),
    "frequency_penalty": (np.float32, lambda req: req.params.frequency_penalty),
    "repetition_penalty": (np.float32, lambda req: req.params.repetition_penalty),
    "num_logprobs": (np.int32, lambda req: req.params.logprobs or 0),
}


def request_key(req, seed: int) -> tuple[int, int]:
    """The base PRNG key of a request: its own seed, else the engine seed and the request index."""
    p = req.params
    return (0, p.seed) if p.seed is not None else (0x9E3779B9 ^ seed, req.index)


def _column(reqs: Sequence, rows: int, dtype, get) -> jnp.ndarray:
    col = np.zeros(rows, dtype)
    col[:len(reqs)] = [get(req) for req in reqs]
    return jnp.asarray(col)


def pack_new_requests(reqs: Sequence, rows: int, max_prompt_len: int, now: float,
                      seed: int) -> NewRequests:
    """`reqs` (at most `rows` host requests with .index, .prompt_ids, .params) as one
    NewRequests of `rows` rows arriving at `now` (seconds since the engine started)."""
    assert len(reqs) <= rows, (len(reqs), rows)
    valid = np.zeros(rows, bool)
    valid[:len(reqs)] = True
    arrival = np.zeros(rows, np.float32)
    arrival[:len(reqs)] = now
    prompts = np.zeros((rows, max_prompt_len), np.int32)
    keys = np.zeros((rows, 2), np.uint32)
    stops = np.full((rows, MAX_STOP_TOKEN_IDS), -1, np.int32)
    bias_ids = np.full((rows, MAX_LOGIT_BIAS), NO_TOKEN, np.int32)
    bias = np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
    for r, req in enumerate(reqs):
        prompts[r, :len(req.prompt_ids)] = req.prompt_ids
        keys[r] = request_key(req, seed)
        stops[r, :len(req.params.stop_token_ids)] = req.params.stop_token_ids
        if req.params.logit_bias:
            bias_ids[r, :len(req.params.logit_bias)] = list(req.params.logit_bias)
            bias[r, :len(req.params.logit_bias)] = list(req.params.logit_bias.values())
    batch = RequestBatch(valid=jnp.asarray(valid), arrival_time=jnp.asarray(arrival),
                         **{k: _column(reqs, rows, dt, get) for k, (dt, get) in _BATCH_COLUMNS.items()})
    sampling = SamplingRows(key=jnp.asarray(keys), stop_token_ids=jnp.asarray(stops),
                            bias_ids=jnp.asarray(bias_ids), bias=jnp.asarray(bias),
                            **{k: _column(reqs, rows, dt, get) for k, (dt, get) in _SAMPLING_COLUMNS.items()})
    return NewRequests(batch=batch, prompt_tokens=jnp.asarray(prompts), sampling=sampling)
