"""`check_invariants(state, config)`: what must hold between any two transitions.

The checks are one jittable function, `invariant_violations`, so trace replay can evaluate
them after every step inside its `lax.scan` and tests can call them on any state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxsched.core.block_pool import entry_valid
from jaxsched.core.config import SchedulerConfig
from jaxsched.core.state import EMPTY, FINISHED, RUNNING, SWAPPED, SchedulerState, is_live

CHECKS = (
    "device ref counts equal the block-table references of groups on the device",
    "host ref counts equal the block-table references of swapped groups",
    "free + used device blocks = total, null and inactive blocks never handed out",
    "free + used host blocks = total, null and inactive blocks never handed out",
    "every request is in exactly one state, holding blocks only where that state allows",
    "num_computed_tokens <= num_tokens (prefill progress within the prefill work)",
    "sequences of a group have equal lengths",
    "block tables cover each running sequence's tokens",
    "the step respects max_num_batched_tokens",
    "the step respects max_num_seqs",
    "every scheduled group gets at least one token (no chunk <= 0)",
    # SPEC A10, with prefix caching (always pass without):
    "prefix cache: a key maps to at most one device block (in use or in the evictor)",
    "prefix cache: a key maps to at most one host block (in use or in the evictor)",
    "prefix cache: device blocks handed out in id order, never-used ones unreferenced and "
    "uncached, free = never used + evictor",
    "prefix cache: host blocks handed out in id order, never-used ones unreferenced and "
    "uncached, free = never used + evictor",
)


class InvariantError(AssertionError):
    pass


def _pool_checks(ref, table, mask, active):
    size = ref.shape[0]
    expect = jnp.zeros_like(ref).at[jnp.where(mask, table, size).reshape(-1)].add(1, mode="drop")
    ids = jnp.arange(size)
    in_range = (ids >= 1) & (ids <= active)
    handed_out = (mask & ((table == 0) | (table > active))).any()
    bad_pool = (ref < 0).any() | ((ref != 0) & ~in_range).any() | handed_out
    return (expect != ref).any(), bad_pool


def _cache_checks(pool) -> tuple[jax.Array, jax.Array]:
    """(a key held by two findable blocks, bad bookkeeping) of a prefix_cache.PrefixPool.

    The evictor is the used blocks with ref count 0, so "evictor blocks have ref count 0"
    holds by construction; what can break is a block outside 1..num_used being referenced
    or cached, num_used past the active blocks, or the free count (all ref-0 active blocks)
    differing from never used + evictor."""
    size = pool.ref_count.shape[0]
    ids = jnp.arange(size)
    used = (ids >= 1) & (ids <= pool.num_used)
    findable = used & pool.cached
    # Sort the findable keys (others after them) and compare neighbours.
    rest, hi, lo = lax.sort(((~findable).astype(jnp.int32), pool.key[1], pool.key[0]), num_keys=3)
    dup = ((rest[1:] == 0) & (rest[:-1] == 0) & (hi[1:] == hi[:-1]) & (lo[1:] == lo[:-1])).any()
    active = (ids >= 1) & (ids <= pool.num_active)
    free = (active & (pool.ref_count == 0)).sum()
    evictor = (used & (pool.ref_count == 0)).sum()
    bad = ((pool.num_used < 0) | (pool.num_used > pool.num_active)
           | ((~used) & ((pool.ref_count != 0) | pool.cached)).any()
           | (free != pool.num_active - pool.num_used + evictor))
    return dup, bad


def invariant_violations(state: SchedulerState, output=None) -> jax.Array:
    """bool[len(CHECKS)]: True where a check fails."""
    lim = state.limits
    width = state.block_table.shape[2]
    alive, status = state.seq_alive, state.status
    valid = entry_valid(state.num_blocks, alive, width)
    on_device = valid & (status == RUNNING)[:, None, None]
    on_host = valid & (status == SWAPPED)[:, None, None]
    dev_refs, dev_pool = _pool_checks(state.device_ref, state.block_table, on_device, lim.num_device_blocks)
    host_refs, host_pool = _pool_checks(state.host_ref, state.block_table, on_host, lim.num_host_blocks)
    live = is_live(status)
    known = live | (status == EMPTY) | (status == FINISHED)
    one_state = (~known.all() | (alive.any(1) != live).any() | (valid & ~(on_device | on_host)).any()
                 | ((state.block_table != 0) & ~(on_device | on_host)).any())
    lens = jnp.where(alive, state.num_tokens, 0)
    computed = ((state.prefill_done > state.prefill_total) | (state.prefill_done < 0)
                | (live & (state.prefill_total > lens.sum(1)))).any()
    lead = jnp.max(jnp.where(alive, state.num_tokens, -1), axis=1, keepdims=True)
    equal = (alive & (state.num_tokens != lead)).any()
    need = (state.num_tokens + lim.block_size - 1) // lim.block_size
    running = alive & (status == RUNNING)[:, None]
    cover = (running & ((state.num_blocks > need) | (state.num_blocks < need - 1))).any()
    over_tokens = over_seqs = empty_chunk = jnp.asarray(False)
    if output is not None:
        charged = jnp.where(output.is_prefill, output.num_scheduled_tokens, output.num_seqs)
        over_tokens = charged.sum() > lim.max_num_batched_tokens
        over_seqs = output.num_seqs.sum() > lim.max_num_seqs
        # vLLM can hand out chunks of 0 or fewer tokens after an overdraw (SPEC A6, B3).
        empty_chunk = (output.scheduled & (output.num_scheduled_tokens <= 0)).any()
    no = jnp.asarray(False)
    dev_dup, dev_bad, host_dup, host_bad = no, no, no, no
    if state.caching:
        dev_dup, dev_bad = _cache_checks(state.pool("dev"))
        host_dup, host_bad = _cache_checks(state.pool("host"))
    return jnp.stack([dev_refs, host_refs, dev_pool, host_pool, one_state, computed, equal, cover,
                      over_tokens, over_seqs, empty_chunk, dev_dup, host_dup, dev_bad, host_bad])


_violations = jax.jit(invariant_violations)


def describe(flags) -> str:
    return "; ".join(name for name, bad in zip(CHECKS, list(flags)) if bad)


def check_invariants(state: SchedulerState, config: SchedulerConfig | None = None, output=None) -> None:
    """Raise InvariantError naming every failed check.

    `config` is accepted for symmetry with the other transitions; the limits that the
    checks need travel in the state.
    """
    del config
    flags = jax.device_get(_violations(state, output))
    if flags.any():
        raise InvariantError(describe(flags))
