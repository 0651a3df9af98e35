"""Preemption by RECOMPUTE and by SWAP, as transitions over a mask of victims.

The running walk picks victims; this module decides each victim's mode (SPEC A5, B1; mode
"auto" compares core/costs.py's two costs per victim) and applies it: recompute frees the device blocks and sends the group to the front of
`waiting`; swap moves its unique blocks to host blocks and sends it to the tail of
`swapped`. Arrays named `_w` are in walk order, the rest in slot space. The scheduler calls
`preempt` under a `lax.cond`: most steps preempt nobody.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsched.core import batching
from jaxsched.core.block_pool import (add_refs, cumsum, free_list, mask_rank, on_rows, put_rows,
                                      take_ranked, write_pairs)
from jaxsched.core.config import PREEMPT_COST, PREEMPT_DEFAULT, PREEMPT_RECOMPUTE, PREEMPT_SWAP
from jaxsched.core.costs import recompute_seconds, swap_seconds
from jaxsched.core.placement import SWAP_OUT, Blocks
from jaxsched.core.state import SWAPPED, WAITING


def reverse_exclusive_cumsum(x: jax.Array) -> jax.Array:
    """out[p] = number of True x[q] for q > p (x a mask)."""
    x = x.astype(jnp.int32)
    return cumsum(x[::-1], bound=x.shape[0])[::-1] - x


def recompute_tokens(prompt_len: jax.Array, seq_alive: jax.Array, num_tokens: jax.Array,
                     block_size: int) -> jax.Array:
    """int32[G]: tokens a recompute prefills again (SPEC B1): the prompt's full blocks once,
    plus every live sequence's own tokens past them (for one sequence: all its tokens)."""
    full_prompt = (prompt_len // block_size) * block_size
    lens = jnp.where(seq_alive, num_tokens, 0).sum(-1)
    return lens - (seq_alive.sum(-1, dtype=jnp.int32) - 1) * full_prompt


def wants_swap(victims_w, nmax_w, held_w, tokens_w, mode, costs) -> jax.Array:
    """bool[G]: the victims the mode would swap, were the host pool big enough.

    Default mode swaps groups of more than one sequence; "auto" (PREEMPT_COST) swaps a victim
    iff moving its `held_w` unique blocks out and back costs less than prefilling its
    `tokens_w` tokens again (`costs`: the five cost_model coefficients, float32 scalars).
    """
    by_seqs = jnp.where(nmax_w > 1, PREEMPT_SWAP, PREEMPT_RECOMPUTE)
    cheaper = swap_seconds(costs, held_w.astype(jnp.float32)) < recompute_seconds(
        costs, tokens_w.astype(jnp.float32))
    by_cost = jnp.where(cheaper, PREEMPT_SWAP, PREEMPT_RECOMPUTE)
    chosen = jnp.where(mode == PREEMPT_DEFAULT, by_seqs, jnp.where(mode == PREEMPT_COST, by_cost, mode))
    return victims_w & (chosen == PREEMPT_SWAP)


def choose_modes(victims_w: jax.Array, nmax_w: jax.Array, held_w: jax.Array, tokens_w: jax.Array,
                 mode: jax.Array, costs, host_free: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Split walk-ordered victims into (swap, recompute) masks.

    `wants_swap` picks by the mode. Victims are preempted tail first (decreasing walk
    position). A victim that should swap but whose unique blocks no longer fit in the host
    pool is recomputed instead (SPEC B1); later victims still swap when they fit, so the
    short-host case is a sequential scan.
    """
    want = wants_swap(victims_w, nmax_w, held_w, tokens_w, mode, costs)
    need = jnp.where(want, held_w, 0)

    def greedy(_):
        def body(left, x):
            want, blocks = x
            fits = want & (blocks <= left)
            return left - jnp.where(fits, blocks, 0), fits
        _, fits = lax.scan(body, host_free, (want, need), reverse=True)
        return fits

    # When every wanted swap fits, the greedy scan swaps them all.
    swap = batching.cond(need.sum() > host_free, greedy, lambda _: want, None, same=True)
    return swap, victims_w & ~swap


class Victims(NamedTuple):
    """Who is preempted how, in slot space."""
    recompute: jax.Array         # bool[G]
    swap: jax.Array              # bool[G]
    rank_recompute: jax.Array    # int32[G] victims of the same mode preempted before this one
    rank_swap: jax.Array         # int32[G]


def no_victims(g: int) -> Victims:
    zb, zi = jnp.zeros((g,), bool), jnp.zeros((g,), jnp.int32)
    return Victims(zb, zb, zi, zi)


def pick_modes(victims_w, nmax_w, held_w, tokens_w, mode, costs, host_free,
               to_slots: Callable[..., list]) -> Victims:
    """Modes and preemption ranks of the running walk's victims, mapped to slots."""
    swap_w, rec_w = choose_modes(victims_w, nmax_w, held_w, tokens_w, mode, costs, host_free)
    # Preemption order is decreasing walk position: ranks among each mode's victims.
    rec, swap, r_rec, r_swap = to_slots(rec_w, swap_w, reverse_exclusive_cumsum(rec_w),
                                        reverse_exclusive_cumsum(swap_w))
    return Victims(rec, swap, r_rec, r_swap)


def free_victims(blk: Blocks, pairs, v: Victims, share, num_host_active):
    """Free victims' device blocks; give swap victims host blocks (shared blocks once),
    which their table rows then hold (a recompute victim's row is cleared).

    `share` is (valid, holder, is_first) of the step-start tables. Returns the new blocks
    (the caller zeroes recompute victims' num_blocks), the pair lists with the (device,
    host) swap-out row written, and the number of swap-out pairs. The pass works on the
    victims' rows alone (`on_rows`): a step preempts a few groups.
    """
    valid, holder, is_first = share
    # Host blocks for the unique device blocks of swap victims, lowest free first: ranks in
    # flat order over the rows taken are ranks over the table (untaken rows hold none).
    free_host = free_list(blk.host_ref, num_host_active)

    def victims_rows(at, carry, table, valid, holder, is_first, victim, swap):
        block_table, device_ref, host_ref, pairs, count = carry
        device_ref = add_refs(device_ref, table, valid & victim[:, None, None], -1)
        entries = valid & swap[:, None, None]
        fresh = entries & is_first
        # The `count` fresh entries of the rows before these took the lowest free host blocks.
        host_new = jnp.take_along_axis(take_ranked(free_host, count + mask_rank(fresh), fresh), holder, axis=1)
        rows = jnp.where(victim[:, None, None], jnp.where(entries, host_new, 0), table)
        host_ref = add_refs(host_ref, rows, entries, 1)
        pairs, count = write_pairs(pairs, SWAP_OUT, table, host_new, fresh, count=count)
        return put_rows(block_table, at, rows), device_ref, host_ref, pairs, count

    victims = v.recompute | v.swap
    block_table, device_ref, host_ref, pairs, count = on_rows(
        victims, victims_rows, (blk.block_table, blk.device_ref, blk.host_ref, pairs, jnp.int32(0)),
        blk.block_table, valid, holder, is_first, victims, v.swap)
    return blk._replace(block_table=block_table, device_ref=device_ref, host_ref=host_ref), pairs, count


def preempted_fields(f: dict, v: Victims, block_size: int) -> dict:
    """Group fields after preemption: recompute victims go to the front of `waiting` with
    every token still to compute, swap victims to the tail of `swapped`.

    A forked group keeps all its sequences; the prompt's full blocks are prefilled once (B1).
    `f` holds the current fields (decoded); returns only the changed ones.
    """
    victims = v.recompute | v.swap
    total = recompute_tokens(f["prompt_len"], f["seq_alive"], f["num_tokens"], block_size)
    return dict(
        status=jnp.where(v.recompute, WAITING, jnp.where(v.swap, SWAPPED, f["status"])),
        queue_key=jnp.where(v.recompute, f["front_key"] - v.rank_recompute,
                            jnp.where(v.swap, f["tail_key"] + v.rank_swap, f["queue_key"])),
        prefill_done=jnp.where(v.recompute, 0, f["prefill_done"]),
        prefill_total=jnp.where(v.recompute, total, f["prefill_total"]),
        num_preemptions=f["num_preemptions"] + victims.astype(jnp.int32),
        front_key=f["front_key"] - v.recompute.sum(dtype=jnp.int32),
        tail_key=f["tail_key"] + v.swap.sum(dtype=jnp.int32),
    )

