"""Transitions around `schedule`: add requests, apply a step's sampled tokens, finish, abort.

    add_requests ──> schedule ──> (model) ──> update ──> free_finished
                                   ^ abort at any point between steps

Each is a pure, jitted function of the state with a padded batch or a slot mask.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxsched.core import batching
from jaxsched.core import prefix_cache
from jaxsched.core.block_pool import add_refs, entry_valid, exclusive_cumsum
from jaxsched.core.state import (ABORTED, EMPTY, FINISHED, IGNORE_NEVER_FITS, IGNORE_TOO_MANY_SEQS,
                            IGNORED, LENGTH_CAPPED, RUNNING, STOPPED, SWAPPED, WAITING,
                            SchedulerState, is_live)


@struct.dataclass
class RequestBatch:
    """A padded batch of new requests (R rows; rows with valid=False are ignored).

    Attributes:
      valid: bool[R]
      request_index: int32[R]   the caller's id for the request
      prompt_len: int32[R]
      n: int32[R]
      max_tokens: int32[R]
      arrival_time: float32[R]
      prompt_tokens: int32[R, M * block_size] prompt token ids, zero-padded; only a state
        with prefix caching reads them (and needs them), None otherwise
    """
    valid: jax.Array
    request_index: jax.Array
    prompt_len: jax.Array
    n: jax.Array
    max_tokens: jax.Array
    arrival_time: jax.Array
    prompt_tokens: Optional[jax.Array] = None


def make_batch(rows: list[dict], size: int) -> RequestBatch:
    """Host helper: pad a list of {request_index, prompt_len, n, max_tokens, arrival_time}."""
    if len(rows) > size:
        raise ValueError(f"make_batch: {len(rows)} requests exceed the batch size {size}")
    pad = size - len(rows)
    col = lambda k, dt: jnp.asarray([r[k] for r in rows] + [0] * pad, dt)
    return RequestBatch(valid=jnp.asarray([True] * len(rows) + [False] * pad),
                        request_index=col("request_index", jnp.int32),
                        prompt_len=col("prompt_len", jnp.int32), n=col("n", jnp.int32),
                        max_tokens=col("max_tokens", jnp.int32),
                        arrival_time=col("arrival_time", jnp.float32))


@jax.jit
def add_requests(state: SchedulerState, batch: RequestBatch) -> tuple[SchedulerState, jax.Array]:
    """Put valid rows into empty slots, at the tail of `waiting`, in row order.

    Returns the new state and int32[R] slots (num_slots where a row was invalid or no slot
    was free: the caller must retry those later). A request whose `n` exceeds max_num_seqs
    or the slot's capacity, or whose prompt cannot fit a block table, is ignored at once
    (SPEC B6): it finishes in this step without reaching the scheduler.
    """
    g = state.status.shape[-1]
    # NOTE: most steps of a replay or a server admit nobody; they skip the ~40 kernels of
    # field scatters below.
    return lax.cond(batch.valid.any(), _add_requests, lambda state, batch: (
        state, jnp.full(batch.valid.shape, g, jnp.int32)), state, batch)


def _add_requests(state: SchedulerState, batch: RequestBatch) -> tuple[SchedulerState, jax.Array]:
    g, s, width = state.block_table.shape
    empty = state.status == EMPTY
    slot_of_rank = jnp.full((g,), g, jnp.int32).at[jnp.where(empty, exclusive_cumsum(empty), g)].set(
        jnp.arange(g, dtype=jnp.int32), mode="drop")
    rank = exclusive_cumsum(batch.valid)
    slot = jnp.where(batch.valid & (rank < g), slot_of_rank[jnp.clip(rank, 0, g - 1)], g)
    placed = slot < g
    too_many = (batch.n > state.limits.max_num_seqs) | (batch.n > s) | (batch.n < 1)
    too_big = batch.prompt_len > width * state.limits.block_size
    ignored = placed & (too_many | too_big)
    first_seq = jnp.arange(s)[None, :] == 0
    state = state.put_slots(
        slot,
        status=jnp.where(ignored, FINISHED, WAITING),
        finish_reason=jnp.where(ignored, IGNORED, 0),
        ignore_reason=jnp.where(too_many, IGNORE_TOO_MANY_SEQS, jnp.where(too_big, IGNORE_NEVER_FITS, 0)),
        arrival_time=batch.arrival_time, queue_key=state.tail_key + rank,
        request_index=batch.request_index, prompt_len=batch.prompt_len, n=batch.n,
        max_tokens=batch.max_tokens, forked=False, prefill_done=0, prefill_total=batch.prompt_len,
        num_preemptions=0,
        seq_alive=first_seq & ~ignored[:, None],
        seq_finish_reason=jnp.where(first_seq & ignored[:, None], IGNORED, 0),
        num_tokens=jnp.where(first_seq, batch.prompt_len[:, None], 0),
        num_blocks=0,
    ).replace(tail_key=state.tail_key + placed.sum(dtype=jnp.int32))
    if state.caching:
        if batch.prompt_tokens is None:
            raise ValueError("add_requests: a state with prefix caching needs the batch's "
                             "prompt_tokens")
        bs = batch.prompt_tokens.shape[-1] // width
        keys, _ = prefix_cache.block_keys(batch.prompt_tokens, batch.prompt_len, batch.prompt_len,
                                          bs, state.key_bits)                     # [R, 2, M]
        state = state.put_slots(slot, seq_key=jnp.where(first_seq[..., None, None], keys[:, None],
                                                        jnp.uint32(0)))
    return state, slot


def update_impl(state: SchedulerState, scheduled: jax.Array, num_scheduled_tokens: jax.Array,
           is_prefill: jax.Array, stopped: jax.Array | None = None,
           sampled_tokens: jax.Array | None = None):
    """Apply one step's results: prefill progress, sampled tokens, forks, finishing (SPEC A9).

    A group samples when its step was a decode or its chunk completed the prompt; one token
    per live sequence. The first sample of an `n > 1` group forks it: sequences 1..n-1 copy
    sequence 0's block table and the blocks' reference counts go up (nothing is copied).
    `stopped` (bool[G, S]) marks sequences whose new token is EOS or a stop token that
    counts (the engine applies ignore_eos and min_tokens); None means never.
    With prefix caching, `sampled_tokens` (int32[G, S]; None: token 1, as in trace replay)
    extend each sequence's block keys, and finished sequences' blocks enter the evictor.
    Returns (state, sampled bool[G, S], finished bool[G]).
    """
    g, s, width = state.block_table.shape
    done = state.prefill_done + jnp.where(scheduled & is_prefill, num_scheduled_tokens, 0)
    samples = scheduled & (~is_prefill | (done >= state.prefill_total))
    fork = samples & ~state.forked & (state.n > 1)
    new_seq = fork[:, None] & (jnp.arange(s)[None, :] < state.n[:, None]) & ~state.seq_alive
    # A new sequence starts as a copy of sequence 0 (its table is copied below).
    num_tokens = jnp.where(new_seq, state.num_tokens[:, :1], state.num_tokens)
    alive = state.seq_alive | new_seq
    sampled = samples[:, None] & alive
    num_tokens = num_tokens + sampled.astype(jnp.int32)

    lim = state.limits
    output_len = num_tokens - state.prompt_len[:, None]
    capped = (output_len >= state.max_tokens[:, None]) | (num_tokens > lim.max_model_len)
    stop = sampled & (stopped if stopped is not None else False)
    reason = jnp.where(stop, STOPPED, jnp.where(sampled & capped, LENGTH_CAPPED, 0))
    fin = reason > 0
    alive = alive & ~fin
    group_done = samples & ~alive.any(1)
    seq_reason = jnp.where(fin, reason, state.seq_finish_reason)

    def forked():
        """Tables with each new sequence's copied from sequence 0 (its blocks shared)."""
        return (jnp.where(new_seq[..., None], state.block_table[:, :1], state.block_table),
                jnp.where(new_seq, state.num_blocks[:, :1], state.num_blocks))

    def tables():
        """Block tables and reference counts of forked and finished sequences."""
        block_table, num_blocks = forked()
        # One scatter: +1 for a new sequence's entries, -1 for a finished one's (both: none).
        delta = (entry_valid(num_blocks, new_seq, width).astype(jnp.int32)
                 - entry_valid(num_blocks, fin, width).astype(jnp.int32))
        device_ref = add_refs(state.device_ref, block_table, delta != 0, delta,
                              groups=(new_seq | fin).any(1))
        return dict(num_blocks=jnp.where(fin, 0, num_blocks),
                    block_table=jnp.where(fin[..., None], 0, block_table), device_ref=device_ref)

    if state.caching:
        blocks = _cached_tables(state, forked, new_seq, fin, sampled, num_tokens, sampled_tokens,
                                is_prefill)
    else:
        # NOTE: most steps neither fork nor finish a sequence; they skip the [G, S, M] table work.
        blocks = batching.cond((new_seq | fin).any(), tables,
                               lambda: dict(num_blocks=state.num_blocks, block_table=state.block_table,
                                            device_ref=state.device_ref), same=True)
    state = state.replace(
        prefill_done=done, forked=state.forked | samples, seq_alive=alive,
        seq_finish_reason=seq_reason, num_tokens=num_tokens, **blocks,
        status=jnp.where(group_done, FINISHED, state.status),
        finish_reason=jnp.where(group_done, seq_reason.max(1), state.finish_reason),
    )
    return state, sampled, group_done


def _cached_tables(state: SchedulerState, forked, new_seq, fin, sampled, num_tokens,
                   sampled_tokens, is_prefill) -> dict:
    """`update_impl`'s block fields with prefix caching (SPEC A10): a fork copies sequence 0's
    keys too, the sampled token extends the key of the block it lands in, and finished
    sequences' blocks are freed into the evictor in vLLM's output order (the evictor's order).

    NOTE: vLLM processes outputs as new prefills, running prefills, swapped-in prefills,
    running decodes, swapped-in decodes, each in walk order. `schedule` requeued the scheduled
    groups as admitted, running decodes, running prefills, swapped-in decodes, swapped-in
    prefills (SPEC B8), each in walk order; so prefills by queue key, then decodes by queue
    key, is vLLM's order. Within a group: sequence by sequence, in block-table order."""
    g, s, width = state.block_table.shape
    bs = state.limits.block_size
    seq_key = jnp.where(new_seq[..., None, None], state.seq_key[:, :1], state.seq_key)
    pos = num_tokens - sampled.astype(jnp.int32)             # where the sampled token lands
    blk = pos // bs
    starts_block = pos % bs == 0
    base_at = jnp.clip(jnp.where(starts_block, blk - 1, blk), 0, width - 1)
    base = jnp.take_along_axis(seq_key, base_at[..., None, None], axis=3)[..., 0]    # [G, S, 2]
    token = jnp.ones((g, s), jnp.int32) if sampled_tokens is None else sampled_tokens
    prompt_end = starts_block & (pos == state.prompt_len[:, None])
    new_key = prefix_cache.extend_key(base, token, prompt_end, state.key_bits)
    at = sampled[..., None, None] & (jnp.arange(width) == blk[..., None, None])
    seq_key = jnp.where(at, new_key[..., None], seq_key)

    def tables():
        block_table, num_blocks = forked()
        pool = state.pool("dev")
        pool = pool._replace(ref_count=add_refs(pool.ref_count, block_table,
                                                entry_valid(num_blocks, new_seq, width), 1))
        order = jnp.lexsort((state.queue_key, jnp.where(is_prefill, 0, 1)))
        freed = entry_valid(num_blocks, fin, width)
        pool = prefix_cache.free(pool, block_table[order].reshape(-1), freed[order].reshape(-1))
        return dict(num_blocks=jnp.where(fin, 0, num_blocks),
                    block_table=jnp.where(fin[..., None], 0, block_table), device_ref=pool.ref_count,
                    dev_evict_seq=pool.evict_seq, dev_clock=pool.clock)

    blocks = batching.cond(
        (new_seq | fin).any(), tables,
        lambda: dict(num_blocks=state.num_blocks, block_table=state.block_table,
                     device_ref=state.device_ref, dev_evict_seq=state.dev_evict_seq,
                     dev_clock=state.dev_clock), same=True)
    return dict(blocks, seq_key=seq_key)


def free_finished_impl(state: SchedulerState) -> tuple[SchedulerState, jax.Array]:
    """Release the slots of finished groups (their blocks were freed as they finished)."""
    fin = state.status == FINISHED
    # Most steps finish nobody: they skip rewriting the state.
    return batching.cond(fin.any(), lambda: state.replace(status=jnp.where(fin, EMPTY, state.status),
                                                          seq_alive=state.seq_alive & ~fin[:, None]),
                         lambda: state, same=True), fin


# Jitted for callers stepping one state; the `_impl`s are for tracing inside a larger step
# (a sweep's batch of runs traces them under `batching.runs_axis`).
update = jax.jit(update_impl)
free_finished = jax.jit(free_finished_impl)


@jax.jit
def abort(state: SchedulerState, mask: jax.Array) -> SchedulerState:
    """Finish the masked groups (aborted) from whichever queue holds them; free their blocks."""
    width = state.block_table.shape[2]
    live = mask & is_live(state.status)
    entries = entry_valid(state.num_blocks, state.seq_alive & live[:, None], width)
    on_device = entries & (state.status == RUNNING)[:, None, None]
    on_host = entries & (state.status == SWAPPED)[:, None, None]
    if state.caching:          # SPEC A10: the blocks enter the evictors, keys kept
        dev = prefix_cache.free(state.pool("dev"), state.block_table.reshape(-1), on_device.reshape(-1))
        host = prefix_cache.free(state.pool("host"), state.block_table.reshape(-1), on_host.reshape(-1))
        state = state.replace(dev_evict_seq=dev.evict_seq, dev_clock=dev.clock,
                              host_evict_seq=host.evict_seq, host_clock=host.clock)
    return state.replace(
        device_ref=add_refs(state.device_ref, state.block_table, on_device, -1),
        host_ref=add_refs(state.host_ref, state.block_table, on_host, -1),
        block_table=jnp.where(live[:, None, None], 0, state.block_table),
        num_blocks=jnp.where(live[:, None], 0, state.num_blocks),
        seq_finish_reason=jnp.where(live[:, None] & state.seq_alive, ABORTED, state.seq_finish_reason),
        seq_alive=state.seq_alive & ~live[:, None],
        status=jnp.where(live, FINISHED, state.status),
        finish_reason=jnp.where(live, ABORTED, state.finish_reason),
    )
