"""Prefix caching in the engine (SPEC A10): a prefill skips the prompt blocks whose K/V the
device pool already holds.

The scheduler shares a cached block between requests whose prefixes hash alike, and budgets
the whole prompt, as vLLM 0.5.3 does; the model runner is what saves the work. A block holds
usable K/V only once a step that wrote all of it has finished (vLLM's `computed` flag): a
block allocated by a request prefilling in this same step is shared but not yet written.
So the engine keeps, per device block, the content key of the K/V it holds (`kv_key`) and
whether that K/V is complete (`kv_ready`):

  * before the model, a prefill's leading table blocks that are ready and hold its own
    content key are skipped (`cached_prefix_tokens`); at least one token always runs, the
    one whose logits sample;
  * after the model, every block this step wrote to (tokens, swap-in, copy-on-write) is not
    ready, then the full blocks of every scheduled sequence up to its computed length are
    ready under their sequence's key (`mark_ready`).

Keying the K/V by content, not by "this block was computed once", is what makes a block that
was evicted and reused for other tokens stop matching, with no hook into the pool.

Unlike vLLM 0.5.3 (whose model runner raises "chunked prefill cannot be used with prefix
caching now"), a chunked prefill skips its cached blocks too: a chunk that falls wholly in
them runs no tokens.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxsched.cache.kv_cache import PAD_ID
from jaxsched.core.costs import reusable_blocks


class PrefixReuse(NamedTuple):
    """What `cached_prefix_tokens` found for one step.

    skip: int32[G] prefill work units (SPEC B1's counter) whose K/V is already in the pool.
    queried: int32[] full blocks the prefills starting this step could have found.
    hit: int32[] of those, the blocks they found ready.
    """
    skip: jax.Array
    queried: jax.Array
    hit: jax.Array


def empty_reuse(num_slots: int) -> PrefixReuse:
    z = jnp.zeros((), jnp.int32)
    return PrefixReuse(jnp.zeros((num_slots,), jnp.int32), z, z)


def _leader(sched):
    g = sched.seq_alive.shape[0]
    leader = jnp.argmax(sched.seq_alive, axis=1)
    return jnp.arange(g), leader


def cached_prefix_tokens(sched, out, kv_key: jax.Array, kv_ready: jax.Array,
                         block_size: int) -> PrefixReuse:
    """The leading prefill work each scheduled prefill can skip.

    sched: the scheduler state right after `schedule` (with prefix caching: `seq_key`).
    kv_key: uint32[2, D+1]; kv_ready: bool[D+1] (the engine's, block 0 never ready).

    The candidates are `core.costs.reusable_blocks` of the leader's table (the one rule the
    scheduler's `auto` counts by too).
    """
    rows, leader = _leader(sched)
    table = sched.block_table[rows, leader]                               # [G, M]
    want = sched.seq_key[rows, leader]                                    # [G, 2, M]
    have = jnp.moveaxis(kv_key[:, table], 0, 1)                           # [G, 2, M]
    multi = (sched.seq_alive.sum(1) > 1).astype(jnp.int32)
    limit = reusable_blocks(sched.prompt_len, sched.num_tokens[rows, leader], multi, block_size)
    m = table.shape[1]
    eligible = jnp.arange(m)[None, :] < limit[:, None]
    ok = eligible & kv_ready[table] & (have == want).all(1)
    blocks = jnp.cumprod(ok, axis=1).sum(1, dtype=jnp.int32)
    prefill = out.scheduled & out.is_prefill
    starting = prefill & (sched.prefill_done == 0)
    return PrefixReuse(skip=jnp.where(prefill, blocks * block_size, 0),
                       queried=jnp.where(starting, limit, 0).sum(dtype=jnp.int32),
                       hit=jnp.where(starting, blocks, 0).sum(dtype=jnp.int32))


def mark_ready(kv_key: jax.Array, kv_ready: jax.Array, sched, out, fb, completes: jax.Array,
               block_size: int) -> tuple[jax.Array, jax.Array]:
    """The blocks' K/V after the step (`sched`: the state the step was planned on, before
    `update`; `fb`: its flat batch; `completes`: bool[G] groups whose prefill is done or that
    decoded)."""
    d = kv_ready.shape[0]
    written = jnp.where(fb.slot_mapping != PAD_ID, fb.slot_mapping // block_size, d)
    moved_in = jnp.where(jnp.arange(out.blocks_to_swap_in.shape[0]) < out.num_swap_in,
                         out.blocks_to_swap_in[:, 1], d)
    copied = jnp.where(jnp.arange(out.blocks_to_copy.shape[0]) < out.num_copy,
                       out.blocks_to_copy[:, 1], d)
    kv_ready = kv_ready.at[jnp.concatenate([written, moved_in, copied])].set(False, mode="drop")

    g, s, m = sched.block_table.shape
    rows, leader = _leader(sched)
    multi = sched.seq_alive.sum(1) > 1
    # K/V is complete for positions < `computed` of each sequence.
    lead = jnp.arange(s)[None, :] == leader[:, None]
    shared = (sched.prompt_len // block_size) * block_size
    partial = jnp.where(multi, jnp.minimum(fb.done_after, shared), fb.done_after)
    computed = jnp.where(completes[:, None], sched.num_tokens, jnp.where(lead, partial[:, None], 0))
    full = (jnp.arange(m)[None, None, :] + 1) * block_size <= computed[..., None]    # [G, S, M]
    mark = full & (out.scheduled[:, None] & sched.seq_alive)[..., None] & (sched.block_table > 0)
    ids = jnp.where(mark, sched.block_table, d).reshape(-1)
    keys = jnp.moveaxis(sched.seq_key, 2, 0).reshape(2, -1)               # [2, G*S*M]
    kv_key = kv_key.at[:, ids].set(keys, mode="drop")
    kv_ready = kv_ready.at[ids].set(True, mode="drop")
    return kv_key, kv_ready
