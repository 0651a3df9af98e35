"""`check_invariants(state, config)`: what must hold between any two transitions.

Runs on the host with numpy so a failure names the slot or block at fault. Every test
calls it after every step it drives.
"""
from __future__ import annotations

import numpy as np

from jaxsched.config import SchedulerConfig
from jaxsched.state import EMPTY, FINISHED, RUNNING, SWAPPED, WAITING, SchedulerState


class InvariantError(AssertionError):
    pass


def _fail(msg: str):
    raise InvariantError(msg)


def _refs_from_tables(table, valid, size):
    counts = np.zeros(size, np.int64)
    np.add.at(counts, table[valid], 1)
    return counts


def check_invariants(state: SchedulerState, config: SchedulerConfig, output=None) -> None:
    """Raise InvariantError if the state (and optionally a step's output) is inconsistent.

    - reference counts equal the block-table references, on device and on host;
    - free + used = total; the null block 0 and inactive blocks are never handed out;
    - prefill progress <= prefill work; sequences of a group have equal lengths;
    - each request is in exactly one state; waiting groups hold no blocks, running groups
      only device blocks, swapped groups only host blocks;
    - with `output`: the step's tokens and sequences respect the budgets.
    """
    s = {k: np.asarray(v) for k, v in vars(state).items() if k != "limits"}
    status, alive, nb = s["status"], s["seq_alive"], s["num_blocks"]
    width = s["block_table"].shape[2]
    if not np.isin(status, [EMPTY, WAITING, RUNNING, SWAPPED, FINISHED]).all():
        _fail(f"unknown status in slots {np.nonzero(~np.isin(status, [0, 1, 2, 3, 4]))[0]}")
    valid = alive[..., None] & (np.arange(width) < nb[..., None])
    on_device = valid & (status == RUNNING)[:, None, None]
    on_host = valid & (status == SWAPPED)[:, None, None]
    for name, table, mask, ref, active in (
            ("device", s["block_table"], on_device, s["device_ref"], config.num_device_blocks),
            ("host", s["host_table"], on_host, s["host_ref"], config.num_host_blocks)):
        if (table[mask] == 0).any():
            _fail(f"{name}: a block table hands out the null block 0")
        if (table[mask] > active).any():
            _fail(f"{name}: a block table uses a block above the active {active}")
        expect = _refs_from_tables(table, mask, ref.shape[0])
        bad = np.nonzero(expect != ref)[0]
        if bad.size:
            b = bad[0]
            _fail(f"{name}: block {b} has ref count {ref[b]} but {expect[b]} table references")
        used = int((ref[1:active + 1] > 0).sum())
        free = int((ref[1:active + 1] == 0).sum())
        if used + free != active or (ref[active + 1:] != 0).any() or ref[0] != 0:
            _fail(f"{name}: free {free} + used {used} != total {active}")
    stray = valid & ~(on_device | on_host)
    if stray.any():
        g = np.nonzero(stray.any(axis=(1, 2)))[0][0]
        _fail(f"slot {g}: status {status[g]} but holds block-table entries")
    if ((s["block_table"] != 0) & ~on_device).any():
        _fail("device block table has entries outside running sequences")
    if ((s["host_table"] != 0) & ~on_host).any():
        _fail("host block table has entries outside swapped sequences")
    live = (status == WAITING) | (status == RUNNING) | (status == SWAPPED)
    if (alive.any(1) != live).any():
        g = np.nonzero(alive.any(1) != live)[0][0]
        _fail(f"slot {g}: status {status[g]} disagrees with its live sequences")
    if (s["prefill_done"] > s["prefill_total"]).any():
        _fail("num_computed_tokens exceeds num_tokens (prefill_done > prefill_total)")
    tokens = np.where(alive, s["num_tokens"], -1)
    lead = tokens.max(1, keepdims=True)
    if (alive & (tokens != lead)).any():
        _fail("sequences of one group have different lengths")
    lens = np.where(alive, s["num_tokens"], 0).sum(1)
    if (live & (s["prefill_total"] > lens)).any():
        _fail("prefill work exceeds the tokens the group holds")
    bs = config.block_size
    need = -(-s["num_tokens"] // bs)
    running = alive & (status == RUNNING)[:, None]
    if (running & ((nb > need) | (nb < need - 1))).any():
        g = np.nonzero((running & ((nb > need) | (nb < need - 1))).any(1))[0][0]
        _fail(f"slot {g}: block table length disagrees with its tokens")
    if output is not None:
        tokens = int(np.asarray(output.num_scheduled_tokens)[np.asarray(output.is_prefill)].sum()
                     + np.asarray(output.num_seqs)[~np.asarray(output.is_prefill)].sum())
        if tokens > config.max_num_batched_tokens:
            _fail(f"step schedules {tokens} tokens > max_num_batched_tokens "
                  f"{config.max_num_batched_tokens}")
        seqs = int(np.asarray(output.num_seqs).sum())
        if seqs > config.max_num_seqs:
            _fail(f"step runs {seqs} sequences > max_num_seqs {config.max_num_seqs}")
