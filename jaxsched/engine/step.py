"""The engine: `step(state, requests) -> (state, outputs)`, one jitted pure function.

    add requests ─> schedule ─> swap out / swap in / copy blocks ─> flat batch ─> model
        ─> sample ─> update (append, fork, finish) ─> free finished slots

The engine state (scheduler state, KV cache, token buffers, per-request sampling arrays)
is one pytree; the KV cache is donated. The model enters as a static graphdef plus params,
and runs on the smallest of a few token-count buckets that holds the step's tokens. Two ways
to drive it, with the same results:

* `step`: one jitted program; the model call is a `lax.switch` over every bucket, so the
  first step compiles them all, and no step ever waits on the host.
* `LazyStep`: the step as three jitted parts (`plan_impl`, `model_impl` per bucket,
  `finish_impl`) with the token count read on the host between the first two, so a bucket
  compiles when a step first needs it: the first request waits for one bucket, not all.
  (`LLM` uses it on one device; `LLM.warm_up` compiles every bucket ahead of serving.)
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxsched.cache import kv_cache as kvc
from jaxsched.cache.attention import AttentionMetadata
from jaxsched.engine import compile_options
from jaxsched.engine.batch import flat_batch
from jaxsched.core.config import Capacity, SchedulerConfig
from jaxsched.core.requests import RequestBatch, add_requests, free_finished, update
from jaxsched.engine.params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, NO_TOKEN
from jaxsched.engine.prefix_reuse import PrefixReuse, cached_prefix_tokens, empty_reuse, mark_ready
from jaxsched.engine.sampling import apply_penalties, sample, token_key, top_logprobs
from jaxsched.core.scheduler import schedule_step
from jaxsched.core.state import FINISHED, SWAPPED, SchedulerState, init_state


@struct.dataclass
class SamplingRows:
    """Per-request sampling parameters, one row per request (arrays: never recompile).

    Attributes:
      temperature, top_p, min_p: float32[R]; top_k: int32[R] (<= 0 disables).
      key: uint32[R, 2] the request's base PRNG key (from its seed, or the engine key and id).
      min_tokens: int32[R]; ignore_eos: bool[R]; stop_token_ids: int32[R, K] (-1 padded).
      presence_penalty, frequency_penalty: float32[R] (0 off); repetition_penalty: float32[R] (1 off).
      num_logprobs: int32[R] top log-probabilities wanted per token (0: none).
      bias_ids, bias: int32 / float32[R, MAX_LOGIT_BIAS] logit_bias's token ids (NO_TOKEN
        padded: dropped) and what they add to the logits.
    """
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    key: jax.Array
    min_tokens: jax.Array
    ignore_eos: jax.Array
    stop_token_ids: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    num_logprobs: jax.Array
    bias_ids: jax.Array
    bias: jax.Array


@struct.dataclass
class NewRequests:
    """A padded batch of requests for `step`.

    Attributes:
      batch: the scheduler's RequestBatch (valid, lengths, n, max_tokens, arrival_time).
      prompt_tokens: int32[R, P] prompt ids, zero padded.
      sampling: SamplingRows.
    """
    batch: RequestBatch
    prompt_tokens: jax.Array
    sampling: SamplingRows


@struct.dataclass
class EngineState:
    """Everything that changes from step to step.

    Attributes:
      sched: SchedulerState.
      kv: KVCache, donated by `step`.
      token_ids: int32[G, S, L] every sequence's prompt + outputs (L = table width * block).
      pending: int32[G, S] tokens a re-prefilled forked group sampled before its prefill ended.
      pending_logprob: float32[G, S] their log-probabilities.
      pending_top_id, pending_top_logprob: int32 / float32[G, S, MAX_LOGPROBS] their top tokens.
      sampling: SamplingRows with one row per slot.
      eos_token_id: int32[] (-1: none).
      kv_key: uint32[2, D+1] content key of the K/V each device block holds, and
      kv_ready: bool[D+1] whether that K/V is complete (prefix caching: prefix_reuse.py).
    """
    sched: SchedulerState
    kv: kvc.KVCache
    token_ids: jax.Array
    pending: jax.Array
    pending_logprob: jax.Array
    pending_top_id: jax.Array
    pending_top_logprob: jax.Array
    sampling: SamplingRows
    eos_token_id: jax.Array
    kv_key: jax.Array
    kv_ready: jax.Array


class StepOutput(NamedTuple):
    """Per slot (G) and per sequence (G, S) results of one step."""
    request_index: jax.Array   # int32[G] the caller's id of the request in each slot
    new_token: jax.Array       # int32[G, S]
    has_token: jax.Array       # bool[G, S]
    logprob: jax.Array         # float32[G, S]
    top_id: jax.Array          # int32[G, S, MAX_LOGPROBS] the most likely tokens, best first
    top_logprob: jax.Array     # float32[G, S, MAX_LOGPROBS] their log-probabilities
    seq_finish_reason: jax.Array  # int32[G, S]
    finished: jax.Array        # bool[G] reached a final status this step
    finish_reason: jax.Array   # int32[G]
    ignore_reason: jax.Array   # int32[G]
    scheduled: jax.Array       # bool[G]
    num_scheduled_tokens: jax.Array  # int32[G]
    preempted: jax.Array       # int32[G] 0, 1 recompute, 2 swap
    swapped_in: jax.Array      # bool[G]
    num_swap_out: jax.Array
    num_swap_in: jax.Array
    num_copy: jax.Array
    num_free_device_blocks: jax.Array
    num_free_host_blocks: jax.Array
    num_tokens: jax.Array      # int32[] tokens the model ran this step
    num_cached_tokens: jax.Array  # int32[] prefill tokens taken from the prefix cache, not run
    prefix_queried: jax.Array  # int32[] full prompt blocks the prefills starting now looked up
    prefix_hit: jax.Array      # int32[] of those, blocks found with their K/V ready


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Static description of a compiled engine (hashable: a jit static argument).

    Attributes:
      cap: the scheduler capacity.
      forward: the model family's unjitted `forward(graphdef, params, tokens, positions,
        metadata, kv_cache, impl) -> (logits at metadata.logits_indices, (k, v))`, k and v
        this step's keys and values [L, T, H_kv, D]: it reads the cache and the engine writes
        them (models/llama.py's `paged_forward_new_kv` is one); the engine never imports a model.
      graphdef: the model's nnx GraphDef.
      token_buckets: padded token counts the model is compiled for (ascending).
      num_sample_rows: most sequences sampled in one step (max_num_seqs).
      max_prompt_len: prompt columns of NewRequests.
      attention_impl: name in jaxsched.attention's registry.
    """
    cap: Capacity
    forward: Callable
    graphdef: Any
    token_buckets: tuple[int, ...]
    num_sample_rows: int
    max_prompt_len: int
    attention_impl: str = "chunked"

    def __post_init__(self):
        # jit hashes its static arguments on every call; the graphdef makes that slow.
        object.__setattr__(self, "_hash", hash((self.cap, self.forward, self.graphdef, self.token_buckets,
                                                self.num_sample_rows, self.max_prompt_len,
                                                self.attention_impl)))

    def __hash__(self) -> int:
        return self._hash


def token_buckets(max_num_batched_tokens: int, smallest: int = 8) -> tuple[int, ...]:
    out, b = [], smallest
    while b < max_num_batched_tokens:
        out.append(b)
        b *= 2
    return tuple(out) + (max_num_batched_tokens,)


def init_engine(config: SchedulerConfig, kv_cache: kvc.KVCache, eos_token_id: int | None = None) -> EngineState:
    """An empty engine over a freshly made KV cache (device pool of num_device_blocks + 1)."""
    cap = config.capacity()
    g, s, m = cap.num_slots, cap.max_seqs_per_group, cap.max_blocks_per_seq
    z = lambda *shape, dt=jnp.int32: jnp.zeros(shape, dt)
    state = EngineState(
        sched=init_state(config), kv=kv_cache,
        token_ids=z(g, s, m * cap.block_size), pending=z(g, s), pending_logprob=z(g, s, dt=jnp.float32),
        pending_top_id=z(g, s, MAX_LOGPROBS), pending_top_logprob=z(g, s, MAX_LOGPROBS, dt=jnp.float32),
        sampling=SamplingRows(temperature=z(g, dt=jnp.float32), top_k=z(g), top_p=jnp.ones((g,), jnp.float32),
                              min_p=z(g, dt=jnp.float32), key=jnp.zeros((g, 2), jnp.uint32),
                              min_tokens=z(g), ignore_eos=z(g, dt=bool),
                              stop_token_ids=jnp.full((g, MAX_STOP_TOKEN_IDS), -1, jnp.int32),
                              presence_penalty=z(g, dt=jnp.float32), frequency_penalty=z(g, dt=jnp.float32),
                              repetition_penalty=jnp.ones((g,), jnp.float32), num_logprobs=z(g),
                              bias_ids=jnp.full((g, MAX_LOGIT_BIAS), NO_TOKEN, jnp.int32),
                              bias=z(g, MAX_LOGIT_BIAS, dt=jnp.float32)),
        eos_token_id=jnp.asarray(-1 if eos_token_id is None else eos_token_id, jnp.int32),
        kv_key=jnp.zeros((2, cap.num_device_blocks + 1), jnp.uint32),
        kv_ready=jnp.zeros((cap.num_device_blocks + 1,), bool),
    )
    # Commit every array to its device, as `step`'s outputs are: otherwise the second step
    # sees other input shardings and compiles the whole engine again. `devices()` is the
    # mesh's own cached set: read it, never pop it (that corrupts every sharding on the mesh).
    device = min(kv_cache.k.devices(), key=lambda d: d.id)
    return jax.tree.map(lambda x: x if getattr(x, "committed", True) else jax.device_put(x, device), state)


def _admit(state: EngineState, new: NewRequests) -> EngineState:
    width = state.token_ids.shape[2]
    prompt = jnp.zeros((new.prompt_tokens.shape[0], width), jnp.int32).at[:, :new.prompt_tokens.shape[1]].set(
        new.prompt_tokens[:, :width])
    batch = new.batch.replace(prompt_tokens=prompt) if state.sched.caching else new.batch
    sched, slots = add_requests(state.sched, batch)
    token_ids = state.token_ids.at[slots, 0].set(prompt, mode="drop")
    rows = jax.tree.map(lambda cur, add: cur.at[slots].set(add.astype(cur.dtype), mode="drop"),
                        state.sampling, new.sampling)
    return state.replace(sched=sched, token_ids=token_ids, sampling=rows)


@struct.dataclass
class StepPlan:
    """What `plan_impl` decided, for the model and `finish_impl`: the scheduler's state and
    output, the flat batch, and which sequence each sampled row is (rows: num_sample_rows)."""
    sched: SchedulerState
    out: Any
    fb: Any
    row_g: jax.Array
    row_s: jax.Array
    gs: jax.Array
    live_row: jax.Array
    logits_index: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    reuse: PrefixReuse


def _bucket_forward(spec: EngineSpec, params, kv, plan: StepPlan, size: int):
    """The model on the first `size` tokens of the flat batch; the cache is only read.
    Returns (logits, (k, v)), this step's K/V [L, size, H_kv, D]."""
    fb = plan.fb
    meta = AttentionMetadata(slot_mapping=fb.slot_mapping[:size], positions=fb.positions[:size],
                             seq_ids=fb.seq_rows[:size], block_tables=plan.block_tables,
                             context_lens=plan.context_lens, logits_indices=plan.logits_index,
                             num_valid=fb.num_valid)
    return spec.forward(spec.graphdef, params, fb.tokens[:size], fb.positions[:size], meta, kv, spec.attention_impl)


def _run_model(spec: EngineSpec, params, kv, plan: StepPlan):
    """The model on the smallest token bucket that holds this step's tokens; writes its K/V.

    Inside the switch the cache is only read (a pool written in a branch is copied whole into
    it); each branch returns its tokens' new K/V padded to the largest bucket, and one scatter
    after the switch writes them (padding tokens' slots are PAD_ID: dropped).
    """
    largest = spec.token_buckets[-1]

    def branch(size):
        def run(kv):
            logits, new_kv = _bucket_forward(spec, params, kv, plan, size)
            pad = ((0, 0), (0, largest - size), (0, 0), (0, 0))
            return logits, tuple(jnp.pad(x, pad) for x in new_kv)
        return run

    index = jnp.searchsorted(jnp.asarray(spec.token_buckets), plan.fb.num_valid, side="left")
    index = jnp.clip(index, 0, len(spec.token_buckets) - 1)
    logits, (k, v) = lax.switch(index, [branch(b) for b in spec.token_buckets], kv)
    return logits, kvc.write_layers(kv, k, v, plan.fb.slot_mapping)


def model_impl(params, kv: kvc.KVCache, plan: StepPlan, spec: EngineSpec, size: int):
    """`LazyStep`'s model part: bucket `size` (static: one compile per bucket), then its K/V
    written into the donated cache. Returns (logits, kv)."""
    logits, (k, v) = _bucket_forward(spec, params, kv, plan, size)
    return logits, kvc.write_layers(kv, k, v, plan.fb.slot_mapping[:size])


def _logit_bias(logits, rows: SamplingRows, row_g):
    """logit_bias, first (vLLM applies it as a logits processor, before min_tokens and the
    penalties); the [R, V] update is skipped when no row has one."""
    ids = rows.bias_ids[row_g]

    def add(logits):
        r = jnp.arange(logits.shape[0])[:, None]
        return logits.at[r, ids].add(rows.bias[row_g], mode="drop")
    return lax.cond(jnp.any(ids != NO_TOKEN), add, lambda x: x, logits)


def _suppress_stops(logits, rows: SamplingRows, row_g, outputs_before, eos):
    """vLLM's min_tokens: EOS (unless ignore_eos) and stop tokens cannot be sampled early."""
    early = outputs_before < rows.min_tokens[row_g]                      # [R]

    def suppress(logits):
        r = jnp.arange(logits.shape[0])[:, None]
        stops = jnp.where(early[:, None], rows.stop_token_ids[row_g], -1)   # -1 pads: dropped below
        eos_col = jnp.where(early & ~rows.ignore_eos[row_g], eos, -1)[:, None]
        ids = jnp.concatenate([stops, eos_col], axis=1)
        ids = jnp.where(ids >= 0, ids, logits.shape[1])                   # out of range: dropped
        return logits.at[r, ids].set(-jnp.inf, mode="drop")

    # Most steps have no row under its min_tokens: skip the [R, V] rewrite then.
    return lax.cond(jnp.any(early), suppress, lambda x: x, logits)


def plan_impl(state: EngineState, new: NewRequests, now, spec: EngineSpec) -> tuple[EngineState, StepPlan]:
    """Admit, schedule, swap and copy blocks, lay out the flat batch: everything before the model."""
    cap = spec.cap
    g, s, _ = state.token_ids.shape
    state = _admit(state, new)
    sched, out = schedule_step(state.sched, cap, now)
    kv = kvc.swap_out(state.kv, out.blocks_to_swap_out, out.num_swap_out)
    kv = kvc.swap_in(kv, out.blocks_to_swap_in, out.num_swap_in)
    kv = kvc.copy_blocks(kv, out.blocks_to_copy, out.num_copy)

    reuse = (cached_prefix_tokens(sched, out, state.kv_key, state.kv_ready, cap.block_size)
             if cap.enable_prefix_caching else empty_reuse(g))
    fb = flat_batch(sched, out, state.token_ids, spec.token_buckets[-1], cap.block_size, reuse.skip)
    rows = spec.num_sample_rows
    flat_mask = fb.sample_mask.reshape(-1)
    rank = jnp.cumsum(flat_mask) - 1
    row_of = jnp.where(flat_mask, rank, rows)                       # [G*S] -> sample row
    gs_of_row = jnp.full((rows,), g * s, jnp.int32).at[row_of].set(jnp.arange(g * s, dtype=jnp.int32), mode="drop")
    live_row = gs_of_row < g * s
    gs = jnp.clip(gs_of_row, 0, g * s - 1)
    row_g, row_s = gs // s, gs % s
    logits_index = jnp.where(live_row, fb.sample_index.reshape(-1)[gs], 0)
    # A swapped group's row holds host blocks: the null block for the attention kernels.
    swapped = (sched.status == SWAPPED)[:, None, None]
    block_tables = jnp.where(swapped, 0, sched.block_table).reshape(g * s, -1)
    context_lens = sched.num_tokens.reshape(-1)
    plan = StepPlan(sched=sched, out=out, fb=fb, row_g=row_g, row_s=row_s, gs=gs, live_row=live_row,
                    logits_index=logits_index, block_tables=block_tables, context_lens=context_lens,
                    reuse=reuse)
    return state.replace(kv=kv), plan


def finish_impl(state: EngineState, plan: StepPlan, logits, spec: EngineSpec):
    """Sample from the model's logits, append, fork and finish sequences: everything after it."""
    g, s, _ = state.token_ids.shape
    sched, out, fb, kv = plan.sched, plan.out, plan.fb, state.kv
    row_g, row_s, gs, live_row = plan.row_g, plan.row_s, plan.gs, plan.live_row
    sp = state.sampling
    position = fb.sample_position.reshape(-1)[gs]
    keys = jax.vmap(token_key)(sp.key[row_g], row_s, position)
    logits = _logit_bias(logits.astype(jnp.float32), sp, row_g)
    logits = _suppress_stops(logits, sp, row_g, position - sched.prompt_len[row_g], state.eos_token_id)
    # Penalties count tokens from the buffers: the prompt from sequence 0 (a group's other
    # sequences get it at the fork), the output from the row's own sequence.
    logits = apply_penalties(logits, state.token_ids[row_g, 0], state.token_ids[row_g, row_s],
                             sched.prompt_len[row_g], position, sp.presence_penalty[row_g],
                             sp.frequency_penalty[row_g], sp.repetition_penalty[row_g])
    tok, logprob = sample(logits, sp.temperature[row_g], sp.top_k[row_g], sp.top_p[row_g],
                          sp.min_p[row_g], keys)
    drop = jnp.where(live_row, gs, g * s)
    new_tok = jnp.zeros((g * s,), jnp.int32).at[drop].set(tok, mode="drop").reshape(g, s)
    new_lp = jnp.zeros((g * s,), jnp.float32).at[drop].set(logprob, mode="drop").reshape(g, s)
    top_id, top_lp = top_logprobs(logits, sp.num_logprobs[row_g], MAX_LOGPROBS)
    new_top_id = jnp.zeros((g * s, MAX_LOGPROBS), jnp.int32).at[drop].set(top_id, mode="drop").reshape(g, s, -1)
    new_top_lp = jnp.zeros((g * s, MAX_LOGPROBS), jnp.float32).at[drop].set(top_lp, mode="drop").reshape(g, s, -1)

    # A re-prefilled forked group samples each sequence when its last token runs; the tokens
    # wait in `pending` until the whole prefill is done (SPEC B1).
    pending = jnp.where(fb.sample_mask, new_tok, state.pending)
    pending_lp = jnp.where(fb.sample_mask, new_lp, state.pending_logprob)
    pending_top_id = jnp.where(fb.sample_mask[..., None], new_top_id, state.pending_top_id)
    pending_top_lp = jnp.where(fb.sample_mask[..., None], new_top_lp, state.pending_top_logprob)
    completes = out.scheduled & (~out.is_prefill | (fb.done_after >= sched.prefill_total))
    final_tok = jnp.where(completes[:, None], pending, 0)

    fork = completes & ~sched.forked & (sched.n > 1)
    token_ids = jnp.where(fork[:, None, None] & (jnp.arange(s) > 0)[None, :, None],
                          state.token_ids[:, :1], state.token_ids)
    seq_len = jnp.where(fork[:, None], sched.num_tokens[:, :1], sched.num_tokens)
    out_len = seq_len - sched.prompt_len[:, None] + 1
    stop_hit = ((final_tok == state.eos_token_id) & ~sp.ignore_eos[:, None]) | (
        final_tok[:, :, None] == sp.stop_token_ids[:, None, :]).any(-1)
    stopped = stop_hit & (out_len >= sp.min_tokens[:, None])
    sched, sampled, _ = update(sched, out.scheduled, out.num_scheduled_tokens, out.is_prefill, stopped,
                               final_tok if sched.caching else None)
    width = token_ids.shape[2]
    write_at = jnp.where(sampled, jnp.clip(seq_len, 0, width - 1), width)
    token_ids = token_ids.at[jnp.arange(g)[:, None], jnp.arange(s)[None, :], write_at].set(final_tok, mode="drop")

    finished = sched.status == FINISHED
    result = StepOutput(
        request_index=sched.request_index, new_token=jnp.where(sampled, final_tok, 0), has_token=sampled,
        logprob=jnp.where(sampled, pending_lp, 0.0),
        top_id=jnp.where(sampled[..., None], pending_top_id, 0),
        top_logprob=jnp.where(sampled[..., None], pending_top_lp, 0.0),
        seq_finish_reason=sched.seq_finish_reason, finished=finished,
        finish_reason=sched.finish_reason, ignore_reason=sched.ignore_reason,
        scheduled=out.scheduled, num_scheduled_tokens=out.num_scheduled_tokens,
        preempted=out.preempted, swapped_in=out.swapped_in, num_swap_out=out.num_swap_out,
        num_swap_in=out.num_swap_in, num_copy=out.num_copy,
        num_free_device_blocks=out.num_free_device_blocks,
        num_free_host_blocks=out.num_free_host_blocks, num_tokens=fb.num_valid,
        num_cached_tokens=_cached_run(plan), prefix_queried=plan.reuse.queried,
        prefix_hit=plan.reuse.hit,
    )
    kv_key, kv_ready = state.kv_key, state.kv_ready
    if spec.cap.enable_prefix_caching:
        kv_key, kv_ready = mark_ready(kv_key, kv_ready, plan.sched, out, fb, completes, spec.cap.block_size)
    sched, _ = free_finished(sched)      # results of finished slots travel in `result`
    state = state.replace(sched=sched, kv=kv, token_ids=token_ids, pending=pending,
                          pending_logprob=pending_lp, pending_top_id=pending_top_id,
                          pending_top_logprob=pending_top_lp, kv_key=kv_key, kv_ready=kv_ready)
    return state, result


def _cached_run(plan: StepPlan) -> jax.Array:
    """Prefill tokens of this step's chunks that the prefix cache spared."""
    # `skip` is 0 outside scheduled prefills, so their (unmasked) done_after counts nothing.
    start = plan.sched.prefill_done
    return jnp.clip(jnp.minimum(plan.reuse.skip, plan.fb.done_after) - start, 0).sum(dtype=jnp.int32)


def step_impl(state: EngineState, params, new: NewRequests, now, spec: EngineSpec):
    state, plan = plan_impl(state, new, now, spec)
    logits, kv = _run_model(spec, params, state.kv, plan)
    return finish_impl(state.replace(kv=kv), plan, logits, spec)


step = jax.jit(step_impl, static_argnames=("spec",), donate_argnums=(0,))


@functools.cache
def jitted_part(part: str, options: compile_options.Options = ()) -> Callable:
    """`LazyStep`'s `part` ("plan", "model" or "finish") jitted with XLA compile `options`
    (`compile_options.part_options`); one per (part, options), so engines share programs."""
    impl, static, donate = {"plan": (plan_impl, ("spec",), 0), "model": (model_impl, ("spec", "size"), 1),
                            "finish": (finish_impl, ("spec",), 0)}[part]
    return jax.jit(impl, static_argnames=static, donate_argnums=(donate,), compiler_options=dict(options) or None)


def bucket_for(buckets: tuple[int, ...], num_tokens: int) -> int:
    """The smallest bucket that holds num_tokens (the largest if none does)."""
    return next((b for b in buckets if b >= num_tokens), buckets[-1])


class LazyStep:
    """`step(state, params, new, now)` with each token bucket compiled when first needed.

    The step runs as three jitted parts; between the first two the step's token count comes
    to the host (one scalar) to pick the bucket. Each part compiles once per spec, the model
    part once per bucket (and never for a new request length inside a known bucket).
    `compiled` lists the buckets compiled so far, in order; `compile_seconds` is the time of
    the calls that compiled something.
    """

    def __init__(self, spec: EngineSpec, plan=None, model=None, finish=None):
        # Each part by default with its own compile options (engine/compile_options.py).
        plan, model, finish = (fn or jitted_part(name, compile_options.part_options(name))
                               for name, fn in (("plan", plan), ("model", model), ("finish", finish)))
        self.spec, self._plan, self._model, self._finish = spec, plan, model, finish
        self.compiled: list[int] = []
        self.compile_seconds = 0.0
        self._planned = False

    def __call__(self, state: EngineState, params, new: NewRequests, now):
        start = time.perf_counter()
        first = not self._planned
        state, plan = self._plan(state, new, now, spec=self.spec)
        size = bucket_for(self.spec.token_buckets, int(plan.fb.num_valid))
        fresh = size not in self.compiled
        logits, kv = self._model(params, state.kv, plan, spec=self.spec, size=size)
        state, out = self._finish(state.replace(kv=kv), plan, logits, spec=self.spec)
        if first or fresh:
            jax.block_until_ready(out)
            self.compile_seconds += time.perf_counter() - start
            self._planned = True
            if fresh:
                self.compiled.append(size)
        return state, out
