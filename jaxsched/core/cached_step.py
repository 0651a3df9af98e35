"""One scheduler step with prefix caching (SPEC A10; docs/prefix-caching-notes.md).

With caching, what a group costs in free blocks depends on the groups served before it in
the same walk: a prompt block whose key an earlier group just allocated is shared (free),
a decode that fills a block whose key is in use gives its own block back (promotion), a
swap dedups against the destination pool. So the three walks visit their queues one group
at a time (`lax.while_loop`) and apply a group's block work (core/cached_pool.py:
allocation by key, appends with promotion and copy-on-write, preemption, swaps), each
vectorized over the group's blocks and the pool, as they go, as vLLM does. Everything that
does not touch blocks (budgets, skips, the delay gate, queue keys, the output) is the
uncached scheduler's own code. Compiled only when `Capacity.enable_prefix_caching`.

    running walk   check free >= k; preempt the tail (recompute: blocks to the evictor;
                   swap: to host blocks by key); append (new / promote / copy-on-write)
    swapped walk   swap in by key (shares in-use blocks, takes evicted ones back); append
    admission      allocate every block of the prompt by key (counted in full, A10)
    end            stamp every block of every scheduled sequence with `now`
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsched.core import prefix_cache as pc
from jaxsched.core.block_pool import entry_valid, exclusive_cumsum
from jaxsched.core.cached_pool import Ctx, Step, admit, append, cond, drop_host, preempt, swap_in
from jaxsched.core.config import Capacity
from jaxsched.core.costs import reusable_blocks
from jaxsched.core.placement import Blocks, no_pairs
from jaxsched.core.preemption import Victims, preempted_fields, recompute_tokens, wants_swap
from jaxsched.core.state import SchedulerOutput, SchedulerState, pool_fields
from jaxsched.core.walks import UNTRACKED, PrefixWalk, RunningInputs, _visited, _walk_tokens


def _prefix_loop(ctx: Ctx, order, m, skip, test_need, tokens, chunkable, seqs, watermark,
                 token_left, seq_left, serve, on_skip):
    """The waiting or swapped walk one group at a time: walks.prefix_walk's tests, with the
    block test against the pool as the groups before left it. Returns (PrefixWalk in walk
    order, ctx)."""
    g = skip.shape[0]
    pos = jnp.arange(g, dtype=jnp.int32)
    cand = (pos < m) & ~skip
    used_tokens, used_seqs = exclusive_cumsum(jnp.where(cand, jnp.stack([tokens, seqs]), 0), axis=1)
    left = token_left - used_tokens
    chunk = jnp.where(chunkable, jnp.minimum(tokens, left), tokens)
    fits = (chunk > 0) & (chunk <= left) & (used_seqs + seqs <= seq_left)

    def body(c):
        i, _, ctx, served, skipped = c
        ok = fits[i] & (pc.num_free(ctx.dev) - test_need[i] >= watermark)
        do_serve, do_skip = ~skip[i] & ok, skip[i]
        ctx = cond(do_serve, lambda c: serve(c, order[i]), ctx)
        ctx = cond(do_skip, lambda c: on_skip(c, order[i]), ctx)
        return (i + 1, ~skip[i] & ~ok, ctx, served.at[i].set(do_serve), skipped.at[i].set(do_skip))

    zb = jnp.zeros((g,), bool)
    _, _, ctx, served, skipped = lax.while_loop(lambda c: (c[0] < m) & ~c[1], body,
                                                (jnp.int32(0), jnp.asarray(False), ctx, zb, zb))
    return PrefixWalk(served, skipped, chunk, jnp.int32(UNTRACKED), jnp.int32(UNTRACKED)), ctx


def _wants_swap(state, cap: Capacity, d, ctx: Ctx, g) -> jax.Array:
    """The mode vLLM's _preemption_mode picks for group g now: by the mode, and a swap only
    if its distinct blocks fit the host pool's free count (SPEC A5, B1)."""
    lim = state.limits
    tokens = recompute_tokens(state.prompt_len[g], state.seq_alive[g], state.num_tokens[g],
                              cap.block_size) - cached_tokens(state, g, cap.block_size)
    want = wants_swap(jnp.ones((1,), bool), d.nmax[g][None], d.held[g][None], tokens[None],
                      lim.preemption_mode, lim.costs)[0]
    return want & (d.held[g] <= pc.num_free(ctx.host))


def cached_tokens(state, g, block_size: int) -> jax.Array:
    """Of the tokens a recompute of group g would prefill, those still in the prefix cache
    after the preemption frees its blocks into the evictor: its reusable blocks (core/costs)
    whose K/V it has computed. `auto` compares a swap with prefilling only the rest."""
    alive = state.seq_alive[g]
    lead_len = state.num_tokens[g, jnp.argmax(alive)]
    computed = jnp.where(state.prefill_done[g] < state.prefill_total[g], state.prefill_done[g], lead_len)
    multi = (alive.sum() > 1).astype(jnp.int32)
    blocks = reusable_blocks(state.prompt_len[g], lead_len, multi, block_size)
    return jnp.minimum(blocks, computed // block_size) * block_size


class RunningOut(NamedTuple):
    served: jax.Array          # bool[G] walk order
    preempted: jax.Array       # bool[G]
    order: jax.Array           # int32[G] preemption order
    swapped: jax.Array         # bool[G] preempted by swap
    chunk: jax.Array
    charged: jax.Array


def _running_loop(state, cap: Capacity, d, st: Step, ctx: Ctx, inp: RunningInputs, order, m,
                  budget, key, count):
    """walks.running_walk_loop against the pool: each append check reads the free count
    the walk has left, each victim is preempted (its mode chosen) and each served group
    appended as it is reached. Returns (RunningOut, ctx, artificial failures left)."""
    g = inp.num_seqs.shape[0]
    pos = jnp.arange(g, dtype=jnp.int32)
    chunk, charged, stop, over = _walk_tokens(inp, pos < m, budget)
    s, over_hit = _visited(stop, over, m)

    def body(c):
        i, tail, ctx, attempt, cnt, served, preempted, porder, swapped, n_pre, _ = c
        at_stop = (i >= tail) | (i >= s)
        over_here = over_hit & (i == s - 1)
        if cap.artificial_preemption:
            u = jax.random.uniform(jax.random.fold_in(key, attempt))
            forced = (u < 0.5) & (cnt > 0)
        else:
            forced = jnp.asarray(False)
        passes = ~forced & (pc.num_free(ctx.dev) >= inp.num_seqs[i])
        victim_left = tail - 1 > i
        lone = (~passes & ~victim_left & ~served.any() & inp.is_prefill[i]
                & ~_wants_swap(state, cap, d, ctx, order[i]))                     # SPEC B5
        serve = ~at_stop & (passes | lone) & ~over_here
        take_tail = ~at_stop & ~passes & victim_left
        self_preempt = ~at_stop & ~passes & ~victim_left & ~lone
        v = jnp.where(take_tail, tail - 1, i)
        is_victim = take_tail | self_preempt
        swap = _wants_swap(state, cap, d, ctx, order[v])
        ctx = cond(is_victim, lambda c: preempt(c, order[v], swap), ctx)
        ctx = cond(serve, lambda c: append(c, st, order[i]), ctx)
        served = served.at[i].set(served[i] | serve)
        preempted = preempted.at[v].set(preempted[v] | is_victim)
        porder = porder.at[v].set(jnp.where(is_victim, n_pre, porder[v]))
        swapped = swapped.at[v].set(jnp.where(is_victim, swap, swapped[v]))
        done = at_stop | self_preempt | (lone & serve) | (~at_stop & passes & over_here)
        return (i + serve.astype(jnp.int32), tail - take_tail.astype(jnp.int32), ctx,
                attempt + (~at_stop).astype(jnp.int32), cnt - (~at_stop & forced).astype(jnp.int32),
                served, preempted, porder, swapped, n_pre + is_victim.astype(jnp.int32), done)

    zb, zi = jnp.zeros((g,), bool), jnp.zeros((g,), jnp.int32)
    init = (jnp.int32(0), m, ctx, jnp.int32(0), count, zb, zb, zi, zb, jnp.int32(0), m == 0)
    out = lax.while_loop(lambda c: ~c[-1], body, init)
    _, _, ctx, _, cnt, served, preempted, porder, swapped, _, _ = out
    return RunningOut(served, preempted, porder, swapped, chunk, charged), ctx, cnt


def _running(state, cap: Capacity, d, q, st: Step, ctx: Ctx, enabled):
    """The running walk (skipped when disabled or `running` is empty), in slot space."""
    from jaxsched.core.scheduler import Running
    g = d.is_run.shape[0]
    order, m = q.walk(1), q.count[1]
    t = lambda x: jnp.take(x, order, axis=0)
    full = jnp.where(d.in_prefill, d.rest, d.n_live)
    inp = RunningInputs(num_seqs=t(d.n_live), need=t(d.appends), held=t(d.held), full=t(full),
                        is_prefill=t(d.in_prefill))
    key = jax.random.fold_in(state.rng, state.step)

    def walk(ctx):
        out, ctx, cnt = _running_loop(state, cap, d, st, ctx, inp, order, m,
                                      state.limits.max_num_batched_tokens, key, state.artificial_count)
        return out, ctx, cnt

    def skip(ctx):
        zb, zi = jnp.zeros((g,), bool), jnp.zeros((g,), jnp.int32)
        return RunningOut(zb, zb, zi, zb, zi, zi), ctx, state.artificial_count

    out, ctx, cnt = lax.cond(enabled & (m > 0), walk, skip, ctx)
    served, preempted, porder, swapped, chunk, charged = q.to_slots(1, d.is_run, *out)
    return (Running(served, preempted, porder, chunk, charged, out.preempted, cnt, jnp.int32(UNTRACKED)),
            swapped, ctx)


def _victims(run, swapped) -> Victims:
    """Victims by mode, each ranked among its mode's victims by preemption order."""
    rec, swap = run.preempted & ~swapped, run.preempted & swapped
    earlier = run.preempt_order[None, :] < run.preempt_order[:, None]       # [victim, other]
    rank = lambda mask: (earlier & mask[None, :]).sum(1, dtype=jnp.int32)
    return Victims(rec, swap, jnp.where(rec, rank(rec), 0), jnp.where(swap, rank(swap), 0))


def _walks(state, cap: Capacity, d, q, st: Step, ctx: Ctx, admission_runs, gate):
    """scheduler._walks, each walk applying its block work to `ctx` as it goes."""
    from jaxsched.core.scheduler import _admission, _no_walk, _swapped
    lim = state.limits
    g = d.is_run.shape[0]
    budget, max_seqs = lim.max_num_batched_tokens, lim.max_num_seqs
    sum_if = lambda mask, x: jnp.where(mask, x, 0).sum(dtype=jnp.int32)

    def loop(serve, on_skip):
        def walk(ctx):
            def run_walk(order, skip, test_need, consume, tokens, chunkable, seqs, m, free,
                         watermark, token_left, seq_left):
                del consume, free                   # read from the pool as the walk goes
                return _prefix_loop(ctx, order, m, skip, test_need, tokens, chunkable, seqs,
                                    watermark, token_left, seq_left, serve, on_skip)
            return run_walk
        return walk

    def admission(ctx, token_left, seq_left, enabled):
        walk = loop(lambda c, slot: admit(c, st, slot), lambda c, slot: c)(ctx)
        return lax.cond(enabled & (q.count[0] > 0),
                        lambda ctx: _admission(state, cap, d, q, None, token_left, seq_left, walk),
                        lambda ctx: (_no_walk(g), jnp.zeros((g,), jnp.int32), ctx), ctx)

    def swapped(ctx, token_left, seq_left, enabled):
        walk = loop(lambda c, slot: swap_in(c, st, slot), drop_host)(ctx)
        return lax.cond(enabled & (q.count[2] > 0),
                        lambda ctx: _swapped(state, cap, d, q, None, token_left, seq_left, walk),
                        lambda ctx: (_no_walk(g), ctx), ctx)

    nmax = d.nmax
    if cap.enable_chunked_prefill:
        run, swap_mode, ctx = _running(state, cap, d, q, st, ctx, jnp.asarray(True))
        tok1, seq1 = sum_if(run.served, run.charged), sum_if(run.served, nmax)
        swp, ctx = swapped(ctx, budget - tok1, max_seqs - seq1, ~run.preempted.any())
        tok2 = tok1 + sum_if(swp.served, swp.chunk)
        seq2 = seq1 + sum_if(swp.served, nmax)
        adm, reason, ctx = admission(ctx, budget - tok2, max_seqs - seq2, gate)
    else:
        seq0 = sum_if(d.is_run, nmax)
        adm, reason, ctx = admission(ctx, budget, max_seqs - seq0, admission_runs & gate)
        run_enabled = ~adm.served.any()
        run, swap_mode, ctx = _running(state, cap, d, q, st, ctx, run_enabled)
        tok1 = sum_if(run.served, run.charged)
        swp, ctx = swapped(ctx, budget - tok1, max_seqs - seq0, run_enabled & ~run.preempted.any())
    return adm, reason, swp, run, _victims(run, swap_mode), ctx


def general_cached(state: SchedulerState, now, cap: Capacity):
    """scheduler._general with prefix caching: derive, walk (placing as it goes), commit,
    stamp the scheduled groups' blocks with `now`."""
    from jaxsched.core.scheduler import _basics, _commit, _delay_gate, _derived, _output
    from jaxsched.core.walks import queues
    d = _derived(state, cap, _basics(state, cap))
    q = queues(state, d.counts)
    any_wait, any_run, any_swap = (c > 0 for c in d.counts)
    admission_runs = jnp.asarray(True) if cap.enable_chunked_prefill else ~any_swap
    gate, latency, prev_time = _delay_gate(state, now, admission_runs, any_wait, any_run, d.is_wait)
    st = Step(state.seq_key, state.seq_alive, state.num_tokens, cap.block_size)
    ctx = Ctx(state.pool("dev"), state.pool("host"), state.block_table, state.num_blocks,
              no_pairs(cap), jnp.zeros((3,), jnp.int32))
    adm, reason, swp, run, v, ctx = _walks(state, cap, d, q, st, ctx, admission_runs, gate)
    fields = {n: getattr(state, n) for n in ("status", "queue_key", "prefill_done", "prefill_total",
                                             "num_preemptions", "front_key", "tail_key",
                                             "prompt_len", "seq_alive", "num_tokens")}
    fields.update(preempted_fields(fields, v, cap.block_size))
    blk = Blocks(ctx.table, ctx.num_blocks, ctx.dev.ref_count, ctx.host.ref_count)
    new_state = _commit(state, d, q, adm, reason, swp, run, fields, blk, admission_runs, prev_time,
                        latency)
    scheduled = adm.served | swp.served | run.served
    stamped = entry_valid(ctx.num_blocks, state.seq_alive & scheduled[:, None], ctx.table.shape[2])
    dev = pc.access(ctx.dev, ctx.table.reshape(-1), stamped.reshape(-1), now)
    new_state = new_state.replace(**{k: v for k, v in (pool_fields("dev", dev)
                                                       | pool_fields("host", ctx.host)).items()
                                     if k not in ("device_ref", "host_ref")})
    counts = jnp.concatenate([ctx.counts, jnp.stack([pc.num_free(dev), pc.num_free(ctx.host),
                                                     jnp.int32(UNTRACKED), jnp.int32(UNTRACKED)])])
    return new_state, SchedulerOutput.pack(*_output(d, adm, swp, run, v, ctx.pairs, counts))
