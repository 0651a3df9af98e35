"""A sweep run's state moved between request-slot counts, on the host.

A step costs about 0.35-0.42 us per slot on the CPU backend (benchmarks/results/sweep_slots.md),
and most runs of a grid never hold half the slots its busiest run needs. So with
half slots (`sweep(..., half_slots=...)`: by default from 1024 configurations, or once
their chunk is compiled) the map path steps each run at half the slots while that is
sure to hold it for the next chunk (the requests alive at the chunk's start plus those
arriving in it), moves it to the full count at a chunk boundary before it could need more,
and back down once its highest slots are empty again (`sweep._replay`). A state is moved
between slot counts exactly: the slots past the smaller count are empty (zeros, as
`empty_state` makes them), and the cached queue order (`walk_order`) keeps its slots' order
with the empty slots after them, in slot order, as a sort would put them; results never
depend on the slot count, only the speed does.
"""
from __future__ import annotations

import math

import numpy as np

from jaxsched.core.state import EMPTY, FIELDS, SchedulerState, layout

# Fields over the slots (their first axis), by their declarations.
_PER_SLOT = frozenset(f.name for f in FIELDS if f.shape.startswith("G"))


def fits(leaves, dims: tuple, slots: int) -> np.ndarray:
    """bool[runs]: every request of the run is in a slot below `slots`."""
    return (SchedulerState(tuple(leaves), dims).stored("status")[:, slots:] == EMPTY).all(1)


def resize(leaves, dims: tuple, slots: int) -> tuple[tuple, tuple]:
    """(packed leaves, dims) of the same runs at `slots` request slots. Down-sizing needs
    `fits`: the slots dropped must be empty."""
    new_dims = (slots,) + tuple(dims[1:])
    lay, runs = layout(new_dims), leaves[0].shape[0]
    out = [np.zeros((runs, size), np.int32) for size in lay["sizes"]]
    keep, state = min(slots, dims[0]), SchedulerState(tuple(leaves), dims)
    for name, (leaf, offset, shape) in ((k, v) for k, v in lay.items() if k != "sizes"):
        old = state.stored(name)
        if name == "walk_order":
            # The cached order with the slots past the smaller count left out or put last,
            # in slot order (empty slots sort by their index, after every queue). It is only
            # a cache (`walks.order_is_cached` checks it): where it is not a permutation,
            # slot order, which the next step sorts again.
            order = [np.concatenate([row[row < slots], np.arange(dims[0], slots, dtype=np.int32)])
                     for row in old]
            new = np.stack([row if len(row) == slots else np.arange(slots, dtype=np.int32) for row in order])
        elif name in _PER_SLOT:
            new = np.zeros((runs,) + shape, np.int32)
            new[:, :keep] = old[:, :keep]
        else:
            new = old
        out[leaf][:, offset:offset + math.prod(shape)] = new.reshape(runs, -1)
    return tuple(out), new_dims
