"""Lay a step's scheduled groups out as one flat, ragged batch of tokens, on device.

The scheduler says, per group, how many tokens it runs (a prefill chunk, or one per live
sequence for a decode). Groups take consecutive ranges of the flat batch in slot order::

    group        g0 (prefill chunk 5)   g1 (decode, 2 seqs)   g2 (decode)   pad ...
    flat index   0  1  2  3  4          5      6              7             8 ...
    (seq, pos)   (0,10) ... (0,14)      (0,31) (1,31)         (0,7)

A prefill is one counter over the group's work (SPEC B1): for a re-admitted forked group
the prompt's full blocks come first (through the leader's table, shared by all), then each
live sequence's own tokens in sequence order. A sequence samples when the flat batch holds
its last prefill token, or its decode token; a fresh group with n > 1 samples n times from
its last prompt token (the fork).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxsched.core.block_pool import exclusive_cumsum
from jaxsched.cache.kv_cache import PAD_ID


class FlatBatch(NamedTuple):
    tokens: jax.Array          # int32[T]
    positions: jax.Array       # int32[T]
    slot_mapping: jax.Array    # int32[T] PAD_ID for padding
    seq_rows: jax.Array        # int32[T] g * S + s
    num_valid: jax.Array       # int32[]
    sample_mask: jax.Array     # bool[G, S] sequences that sample this step
    sample_index: jax.Array    # int32[G, S] flat index of the token whose logits they sample from
    sample_position: jax.Array  # int32[G, S] position the sampled token will take
    done_after: jax.Array      # int32[G] each group's prefill progress after this step


def flat_batch(sched, out, token_ids, max_tokens: int, block_size: int,
               skip: jax.Array | None = None) -> FlatBatch:
    """Build the flat batch from the state right after `schedule` and its output.

    token_ids: int32[G, S, L] every sequence's prompt + outputs so far.
    skip: int32[G] leading prefill work whose K/V the cache already holds (prefix caching,
      engine/prefix_reuse.py): the part of a chunk below it is not run; None: nothing.
    """
    g, s, _ = token_ids.shape
    alive = sched.seq_alive
    n_live = alive.sum(1, dtype=jnp.int32)
    is_prefill = out.is_prefill
    done_after = sched.prefill_done + jnp.where(is_prefill, out.num_scheduled_tokens, 0)
    begin = sched.prefill_done if skip is None else jnp.maximum(sched.prefill_done, skip)
    run = jnp.maximum(done_after - begin, 0)                            # prefill work run now
    count = jnp.where(out.scheduled, jnp.where(is_prefill, run, n_live), 0)
    # Decodes first, then prefill chunks (each part in slot order): attention loops over
    # cached context per group of consecutive tokens (jaxsched.attention), so prefill tokens
    # should not share a group with a long decode.
    order = jnp.argsort(is_prefill, stable=True).astype(jnp.int32)    # position -> slot
    ends_sorted = jnp.cumsum(count[order])
    start = jnp.zeros((g,), jnp.int32).at[order].set(ends_sorted - count[order])
    total = count.sum(dtype=jnp.int32)
    t = jnp.arange(max_tokens, dtype=jnp.int32)
    valid = t < total
    rank = jnp.clip(jnp.searchsorted(ends_sorted, t, side="right", method="compare_all"), 0, g - 1)
    grp = order[rank]
    j = t - start[grp]

    # Decode: the j-th live sequence; prefill: the j-th token of the group's remaining work.
    alive_rank = exclusive_cumsum(alive, axis=1)                       # [G, S]
    dec_seq = jnp.argmax(alive[grp] & (alive_rank[grp] == j[:, None]), axis=1)
    leader = jnp.argmax(alive, axis=1)
    multi = n_live > 1
    shared = jnp.where(multi, (sched.prompt_len // block_size) * block_size, 0)   # [G]
    own = jnp.where(alive, sched.num_tokens - shared[:, None], 0)       # [G, S]
    own_start = exclusive_cumsum(own, axis=1)
    q = begin[grp] + j
    r = q - shared[grp]
    in_own = alive[grp] & (own_start[grp] <= r[:, None]) & (r[:, None] < own_start[grp] + own[grp])
    pre_seq = jnp.where(r < 0, leader[grp], jnp.argmax(in_own, axis=1))
    pre_pos = jnp.where(r < 0, q, shared[grp] + r - jnp.take_along_axis(own_start[grp], pre_seq[:, None], 1)[:, 0])
    seq = jnp.where(is_prefill[grp], pre_seq, dec_seq).astype(jnp.int32)
    length = sched.num_tokens[grp, seq]
    pos = jnp.where(is_prefill[grp], pre_pos, length - 1).astype(jnp.int32)
    blk = sched.block_table[grp, seq, jnp.clip(pos // block_size, 0, sched.block_table.shape[2] - 1)]
    slot = jnp.where(valid, blk * block_size + pos % block_size, PAD_ID)
    tokens = jnp.where(valid, token_ids[grp, seq, jnp.clip(pos, 0, token_ids.shape[2] - 1)], 0)

    # Who samples, from which flat index, for which position.
    seq_ids = jnp.arange(s)[None, :]
    decode = (out.scheduled & ~is_prefill)[:, None] & alive
    dec_index = start[:, None] + alive_rank
    last_q = shared[:, None] + own_start + own - 1                       # [G, S] prefill index
    in_chunk = (last_q >= sched.prefill_done[:, None]) & (last_q < done_after[:, None])
    pre_sample = (out.scheduled & is_prefill)[:, None] & alive & in_chunk
    pre_index = start[:, None] + last_q - begin[:, None]
    # A fresh n > 1 group forks at its last prompt token: every child samples there.
    fork = (out.scheduled & is_prefill & ~sched.forked & (sched.n > 1)
            & (done_after >= sched.prefill_total))[:, None] & (seq_ids < sched.n[:, None])
    fork_index = jnp.broadcast_to((start + count - 1)[:, None], (g, s))
    lead_len = jnp.take_along_axis(sched.num_tokens, leader[:, None], 1)
    sample_mask = decode | pre_sample | fork
    sample_index = jnp.where(decode, dec_index, jnp.where(fork, fork_index, pre_index))
    sample_position = jnp.where(fork, lead_len, sched.num_tokens)
    return FlatBatch(tokens=tokens.astype(jnp.int32), positions=jnp.where(valid, pos, 0),
                     slot_mapping=slot.astype(jnp.int32),
                     seq_rows=jnp.where(valid, grp * s + seq, 0).astype(jnp.int32),
                     num_valid=total, sample_mask=sample_mask,
                     sample_index=sample_index.astype(jnp.int32),
                     sample_position=sample_position.astype(jnp.int32),
                     done_after=done_after.astype(jnp.int32))
