"""Skip decisions taken once for a whole batch of runs (a sweep's `jax.vmap` over runs).

Under `jax.vmap` a `lax.cond` whose predicate differs between runs becomes a select that
computes both branches for every run, and a select over whatever the branches return
(often the whole state). A sweep instead names its run axis (`jax.vmap(..., axis_name=)`)
and traces the step inside `runs_axis(name)`; then the helpers here reduce the predicate
over the runs first (`any_run`: a `lax.pmax` over the named axis, unbatched), so the cond
stays a cond: the work is done when any run needs it and skipped when none does.

Where the work branch gives some run a different result than its skip branch would have,
`cond` selects per run between the two branches' outputs (only those, not the state).
Where the work branch gives the skip branch's result for every run that could have skipped
(`same=True`, e.g. freeing no finished group, sorting an order that is already sorted), no
select is needed at all: the tests compare every run with the unbatched replay.

Outside `runs_axis` (the engine, `simulate`, a `lax.map` over runs) every helper is the
plain `lax.cond` / `lax.switch`.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax import lax

_AXIS: contextvars.ContextVar = contextvars.ContextVar("jaxsched_runs_axis", default=None)


@contextlib.contextmanager
def runs_axis(name: str | None):
    """Trace the enclosed code with `name` as the (vmapped) axis of runs; None: unbatched."""
    token = _AXIS.set(name)
    try:
        yield
    finally:
        _AXIS.reset(token)


def current_axis() -> str | None:
    return _AXIS.get()


def any_run(pred) -> jax.Array:
    """`pred` of some run of the batch (the same, unbatched, for every run); `pred` outside."""
    axis = _AXIS.get()
    if axis is None:
        return jnp.asarray(pred)
    return lax.pmax(jnp.asarray(pred).astype(jnp.int32), axis) > 0


def _select(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def cond(pred, work, skip, *operands, same: bool = False):
    """`lax.cond(pred, work, skip, *operands)`, decided once for a batch of runs.

    `same`: `work` gives `skip`'s result wherever `pred` is false, so no select is needed.
    """
    if _AXIS.get() is None:
        return lax.cond(pred, work, skip, *operands)
    if same:
        return lax.cond(any_run(pred), work, skip, *operands)

    def both(*ops):
        return _select(pred, work(*ops), skip(*ops))
    return lax.cond(any_run(pred), both, skip, *operands)


def switch(index, branches, *operands, covers: bool = False):
    """`lax.switch(index, branches, *operands)`, decided once for a batch of runs.

    Branches are ordered by cost. In a batch the branch taken is the highest any run needs;
    with `covers`, a branch gives the result of every lower one for runs that asked for it
    (e.g. the general step for a steady one), else the lower branches run too and each run
    keeps the result of its own (a select of the branches' outputs).
    """
    if _AXIS.get() is None:
        return lax.switch(index, branches, *operands)
    top = lax.pmax(jnp.asarray(index, jnp.int32), _AXIS.get())
    if covers:
        return lax.switch(top, branches, *operands)

    def upto(k):
        def branch(*ops):
            out = branches[0](*ops)
            for j in range(1, k + 1):
                out = _select(index == j, branches[j](*ops), out)
            return out
        return branch
    return lax.switch(top, [upto(k) for k in range(len(branches))], *operands)
