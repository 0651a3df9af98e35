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

With `runs_axis(name, skips=False)` nothing is skipped: every helper computes its work
for every run and masks it (`cond` and `switch` trace no conditional at all). A large batch
needs almost every branch in almost every step anyway, and on a GPU each conditional costs
a copy of its predicate to the host; but the branches no run needed cost more than that:
on an H200 the straight-line step is slower at every grid size, 0.94x at 1024 runs and
0.25x at 16 (benchmarks/results/sweep_gpu.md), so skips are the default everywhere.

Outside `runs_axis` (the engine, `simulate`, a `lax.map` over runs) every helper is the
plain `lax.cond` / `lax.switch`.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax import lax

# (axis name, skips) while tracing for a batch of runs; None outside.
_AXIS: contextvars.ContextVar = contextvars.ContextVar("jaxsched_runs_axis", default=None)


@contextlib.contextmanager
def runs_axis(name: str | None, skips: bool = True):
    """Trace the enclosed code with `name` as the (vmapped) axis of runs; None: unbatched.

    `skips`: a skip is taken when no run of the batch needs the work; False: no skip at all
    (every branch computed and masked, no conditional traced)."""
    token = _AXIS.set(None if name is None else (name, skips))
    try:
        yield
    finally:
        _AXIS.reset(token)


def current_axis() -> str | None:
    ctx = _AXIS.get()
    return None if ctx is None else ctx[0]


def any_run(pred) -> jax.Array:
    """`pred` of some run of the batch (the same, unbatched, for every run); `pred` outside."""
    axis = current_axis()
    if axis is None:
        return jnp.asarray(pred)
    return lax.pmax(jnp.asarray(pred).astype(jnp.int32), axis) > 0


def skipping() -> bool:
    """Whether work no run needs is skipped: always outside `runs_axis`."""
    ctx = _AXIS.get()
    return ctx is None or ctx[1]


def _select(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def cond(pred, work, skip, *operands, same: bool = False):
    """`lax.cond(pred, work, skip, *operands)`, decided once for a batch of runs.

    `same`: `work` gives `skip`'s result wherever `pred` is false, so no select is needed.
    """
    if _AXIS.get() is None:
        return lax.cond(pred, work, skip, *operands)

    def both(*ops):
        return work(*ops) if same else _select(pred, work(*ops), skip(*ops))
    if not skipping():
        return both(*operands)
    return lax.cond(any_run(pred), both, skip, *operands)


def fori_loop(trips, body, carry):
    """`lax.fori_loop(0, trips, body, carry)`, the trips (int32) decided once for a batch of
    runs: the most any run needs. `body` must leave a run's carry as it is on the trips that
    run did not need."""
    axis = current_axis()
    if axis is not None:
        trips = lax.pmax(jnp.asarray(trips, jnp.int32), axis)
    return lax.fori_loop(0, trips, body, carry)


def switch(index, branches, *operands, covers: bool = False):
    """`lax.switch(index, branches, *operands)`, decided once for a batch of runs.

    Branches are ordered by cost. In a batch the branch taken is the highest any run needs;
    with `covers`, a branch gives the result of every lower one for runs that asked for it
    (e.g. the general step for a steady one), else the lower branches run too and each run
    keeps the result of its own (a select of the branches' outputs).
    """
    if _AXIS.get() is None:
        return lax.switch(index, branches, *operands)

    def upto(k):
        if covers:
            return branches[k]

        def branch(*ops):
            out = branches[0](*ops)
            for j in range(1, k + 1):
                out = _select(index == j, branches[j](*ops), out)
            return out
        return branch
    if not skipping():            # the costliest branch, which covers (or selects) the others
        return upto(len(branches) - 1)(*operands)
    top = lax.pmax(jnp.asarray(index, jnp.int32), current_axis())
    return lax.switch(top, [upto(k) for k in range(len(branches))], *operands)
