"""The scheduler state: one frozen pytree of a few packed, fixed-shape int32 arrays.

Shapes use G = num_slots, S = max_seqs_per_group, M = max_blocks_per_seq,
D = num_device_blocks + 1 and H = num_host_blocks + 1 (index 0 of each pool is the null
block, never handed out). A slot holds one sequence group (one request) from `add_requests`
to `free_finished`; its `status` says which queue holds it, so a request is in exactly one
state by construction. Queue order is a key per slot: `running` and `swapped` walk in
(arrival_time, queue_key) order, `waiting` in queue_key order (SPEC A2).

Storage is packed because every array that crosses a jitted call costs microseconds on
XLA's CPU backend (STYLE.md): five leaves instead of thirty-eight. Every field keeps its
name as a read-only property and `state.replace(field=...)` writes it back:

    groups:  int32[NUM_GROUP_FIELDS, G]      per-group fields, one row each (GROUP_FIELDS)
    seqs:    int32[NUM_SEQ_FIELDS, G, S]     per-sequence fields (SEQ_FIELDS)
    tables:  int32[2, G, S, M]               block_table, host_table
    pools:   int32[D + H]                    device_ref, then host_ref
    scalars: int32[NUM_SCALARS]              step-level scalars and the limits (SCALAR_FIELDS)

Floats are stored bit-cast (exact), bools as 0/1. Properties index from the end, so they
also work on states stacked along leading axes (vmap).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxsched.config import Capacity, SchedulerConfig

# Group status: which queue holds the slot.
EMPTY, WAITING, RUNNING, SWAPPED, FINISHED = 0, 1, 2, 3, 4
# Finish reasons (per group and per sequence).
NOT_FINISHED, LENGTH_CAPPED, STOPPED, IGNORED, ABORTED = 0, 1, 2, 3, 4
FINISH_NAMES = {LENGTH_CAPPED: "finished_length_capped", STOPPED: "finished_stopped",
                IGNORED: "finished_ignored", ABORTED: "finished_aborted"}
# Why a request was ignored.
IGNORE_NONE, IGNORE_PROMPT_TOO_LONG, IGNORE_NEVER_FITS, IGNORE_TOO_MANY_SEQS = 0, 1, 2, 3
IGNORE_REASONS = {
    IGNORE_PROMPT_TOO_LONG: "prompt longer than the prompt limit",
    IGNORE_NEVER_FITS: "needs more KV blocks than the device cache can ever hold",
    IGNORE_TOO_MANY_SEQS: "n is larger than max_num_seqs",
}


@struct.dataclass
class Limits:
    """Per-run limits: arrays, so changing them never recompiles (all shape=(), int32 unless noted).

    Attributes:
      num_device_blocks: active device blocks (ids 1..num_device_blocks), <= capacity.
      num_host_blocks: active host blocks, <= capacity.
      max_num_seqs, max_num_batched_tokens, max_model_len: vLLM's limits.
      watermark_blocks: int(watermark * num_device_blocks).
      preemption_mode: 0 auto, 1 recompute, 2 swap.
      delay_factor: float32.
      block_size: mirrors Capacity.block_size for transitions compiled without a capacity.
    """
    num_device_blocks: jax.Array
    num_host_blocks: jax.Array
    max_num_seqs: jax.Array
    max_num_batched_tokens: jax.Array
    max_model_len: jax.Array
    watermark_blocks: jax.Array
    preemption_mode: jax.Array
    delay_factor: jax.Array
    block_size: jax.Array


# Field layout. `walk_order` is the scheduler's cache of the last queue order (a permutation
# of slots); schedule checks it and re-sorts when it is stale, so nobody else maintains it.
GROUP_FIELDS = ("status", "finish_reason", "ignore_reason", "arrival_time", "queue_key",
                "request_index", "prompt_len", "n", "max_tokens", "forked", "prefill_done",
                "prefill_total", "num_preemptions", "walk_order")
SEQ_FIELDS = ("seq_alive", "seq_finish_reason", "num_tokens", "num_blocks")
TABLE_FIELDS = ("block_table", "host_table")
POOL_FIELDS = ("device_ref", "host_ref")
LIMIT_FIELDS = tuple(Limits.__dataclass_fields__)
# (name, width) in order; rng is a raw uint32[2] PRNG key.
SCALAR_LAYOUT = (("tail_key", 1), ("front_key", 1), ("step", 1), ("prev_time", 1),
                 ("last_prompt_latency", 1), ("prev_admitted", 1), ("rng", 2),
                 ("artificial_count", 1)) + tuple((f, 1) for f in LIMIT_FIELDS)
SCALAR_FIELDS = tuple(name for name, _ in SCALAR_LAYOUT)
_SCALAR_AT = {}
_offset = 0
for _name, _width in SCALAR_LAYOUT:
    _SCALAR_AT[_name] = (_offset, _width)
    _offset += _width
NUM_SCALARS = _offset
NUM_GROUP_FIELDS, NUM_SEQ_FIELDS = len(GROUP_FIELDS), len(SEQ_FIELDS)

_FLOATS = {"arrival_time", "prev_time", "last_prompt_latency", "delay_factor"}
_BOOLS = {"forked", "seq_alive", "prev_admitted"}
_UINTS = {"rng"}


def encode(name: str, value) -> jax.Array:
    """A field's value as the int32 it is stored as (floats bit-cast, bools 0/1)."""
    if name in _FLOATS:
        return lax.bitcast_convert_type(jnp.asarray(value, jnp.float32), jnp.int32)
    if name in _UINTS:
        return lax.bitcast_convert_type(jnp.asarray(value, jnp.uint32), jnp.int32)
    return jnp.asarray(value).astype(jnp.int32)


def decode(name: str, stored: jax.Array) -> jax.Array:
    """Inverse of `encode`."""
    if name in _FLOATS:
        return lax.bitcast_convert_type(stored, jnp.float32)
    if name in _UINTS:
        return lax.bitcast_convert_type(stored, jnp.uint32)
    if name in _BOOLS:
        return stored != 0
    return stored


def _row(leaf: jax.Array, i: int, trailing: int) -> jax.Array:
    """Row i of a field-major leaf whose rows have `trailing` axes (leading axes kept)."""
    return leaf[(..., i) + (slice(None),) * trailing]


@jax.tree_util.register_pytree_node_class
class SchedulerState:
    """Everything the scheduler knows. No Python containers: the tree never changes shape.

    Packed leaves: `groups`, `seqs`, `tables`, `pools`, `scalars` (see the module doc).
    Named fields, all read-only properties (write with `replace`):
      status: int32[G]            EMPTY / WAITING / RUNNING / SWAPPED / FINISHED.
      finish_reason: int32[G]     reason once FINISHED (LENGTH_CAPPED, STOPPED, IGNORED, ABORTED).
      ignore_reason: int32[G]     why an IGNORED group was ignored.
      arrival_time: float32[G]    seconds, the FCFS priority.
      queue_key: int32[G]         position inside its queue (smaller is nearer the head).
      request_index: int32[G]     caller's id for the request (e.g. its index in a trace).
      prompt_len: int32[G]        prompt tokens.
      n: int32[G]                 parallel samples requested.
      max_tokens: int32[G]        output tokens after which a sequence is length-capped.
      forked: bool[G]             the group has sampled its first tokens and holds n sequences.
      prefill_done: int32[G]      prefill tokens computed so far (chunks add up here).
      prefill_total: int32[G]     prefill tokens to compute: the prompt, or after a recompute
                                  the prompt plus outputs (SPEC A5, B1).
      num_preemptions: int32[G]   times this group was preempted.
      walk_order: int32[G]        the scheduler's cached queue order (a hint, checked each step).
      seq_alive: bool[G, S]       sequence exists and is not finished.
      seq_finish_reason: int32[G, S]
      num_tokens: int32[G, S]     prompt + output tokens of each sequence.
      num_blocks: int32[G, S]     entries used in the block table (device or host).
      block_table: int32[G, S, M] device block ids; unused entries hold the null block 0.
      host_table: int32[G, S, M]  host block ids while SWAPPED, else 0.
      device_ref: int32[D]        references to each device block from block tables.
      host_ref: int32[H]          references to each host block from host tables.
      tail_key, front_key: int32[] next queue keys for the tail and the front of a queue.
      step: int32[]               schedule calls so far.
      prev_time, last_prompt_latency: float32[]  SPEC A7 state.
      prev_admitted: bool[]       the previous admission walk admitted from waiting.
      rng: uint32[2]              key for artificial preemption (SPEC A8).
      artificial_count: int32[]   forced failures left.
      limits: Limits
    """
    __slots__ = ("groups", "seqs", "tables", "pools", "scalars", "pool_split")

    def __init__(self, groups, seqs, tables, pools, scalars, pool_split: int):
        # No checks here: jax rebuilds pytrees with placeholder leaves.
        self.groups, self.seqs, self.tables, self.pools, self.scalars = groups, seqs, tables, pools, scalars
        self.pool_split = pool_split          # D, the device pool's length (static)

    def tree_flatten(self):
        return (self.groups, self.seqs, self.tables, self.pools, self.scalars), self.pool_split

    @classmethod
    def tree_unflatten(cls, pool_split, leaves):
        return cls(*leaves, pool_split)

    @classmethod
    def from_fields(cls, **fields) -> SchedulerState:
        """Pack named fields (every field of the class doc, `walk_order` optional)."""
        fields = dict(fields)
        limits = fields.pop("limits")
        fields.update({f: getattr(limits, f) for f in LIMIT_FIELDS})
        g = fields["status"].shape[-1]
        fields.setdefault("walk_order", jnp.arange(g, dtype=jnp.int32))
        rows = lambda names: [encode(n, fields[n]) for n in names]
        scalars = [encode(n, fields[n]).reshape(-1) for n in SCALAR_FIELDS]
        return cls(groups=jnp.stack(rows(GROUP_FIELDS)), seqs=jnp.stack(rows(SEQ_FIELDS)),
                   tables=jnp.stack(rows(TABLE_FIELDS)),
                   pools=jnp.concatenate(rows(POOL_FIELDS)), scalars=jnp.concatenate(scalars),
                   pool_split=int(fields["device_ref"].shape[-1]))

    def stored(self, name: str) -> jax.Array:
        """A field as stored (int32), without decoding."""
        if name in _GROUP_AT:
            return _row(self.groups, _GROUP_AT[name], 1)
        if name in _SEQ_AT:
            return _row(self.seqs, _SEQ_AT[name], 2)
        if name in _TABLE_AT:
            return _row(self.tables, _TABLE_AT[name], 3)
        if name == "device_ref":
            return self.pools[..., :self.pool_split]
        if name == "host_ref":
            return self.pools[..., self.pool_split:]
        offset, width = _SCALAR_AT[name]
        if width == 1:
            return self.scalars[..., offset]
        return self.scalars[..., offset:offset + width]

    def get(self, name: str) -> jax.Array:
        return decode(name, self.stored(name))

    @property
    def limits(self) -> Limits:
        return Limits(**{f: self.get(f) for f in LIMIT_FIELDS})

    def replace(self, **fields) -> SchedulerState:
        """A copy with the named fields (or whole packed leaves) replaced."""
        if "limits" in fields:
            limits = fields.pop("limits")
            fields.update({f: getattr(limits, f) for f in LIMIT_FIELDS})
        leaves = {k: fields.pop(k) for k in ("groups", "seqs", "tables", "pools", "scalars")
                  if k in fields}
        unknown = set(fields) - _ALL_FIELDS
        if unknown:
            raise TypeError(f"SchedulerState.replace: unknown fields {sorted(unknown)}")
        new = SchedulerState(leaves.get("groups", self.groups), leaves.get("seqs", self.seqs),
                             leaves.get("tables", self.tables), leaves.get("pools", self.pools),
                             leaves.get("scalars", self.scalars), self.pool_split)
        if not fields:
            return new

        def value(name):
            cur = new.stored(name)
            return jnp.broadcast_to(encode(name, fields[name]), cur.shape) if name in fields else cur

        for leaf, names, axis in (("groups", GROUP_FIELDS, -2), ("seqs", SEQ_FIELDS, -3),
                                  ("tables", TABLE_FIELDS, -4)):
            if any(n in fields for n in names):
                setattr(new, leaf, jnp.stack([value(n) for n in names], axis=axis))
        if any(n in fields for n in POOL_FIELDS):
            new.pools = jnp.concatenate([value(n) for n in POOL_FIELDS], axis=-1)
        if any(n in fields for n in SCALAR_FIELDS):
            parts = [value(n) if _SCALAR_AT[n][1] > 1 else value(n)[..., None] for n in SCALAR_FIELDS]
            new.scalars = jnp.concatenate(parts, axis=-1)
        return new

    def as_dict(self) -> dict:
        """Every named field, decoded (for debugging and tests)."""
        return {n: self.get(n) for n in _ALL_FIELDS - set(LIMIT_FIELDS)} | {"limits": self.limits}

    def __repr__(self):
        shapes = ", ".join(f"{k}={getattr(self, k).shape}" for k in ("groups", "seqs", "tables", "pools", "scalars"))
        return f"SchedulerState({shapes})"

    @property
    def num_live_seqs(self) -> jax.Array:
        """int32[G]: sequences each group holds now (1 before the fork)."""
        return self.seq_alive.sum(axis=-1, dtype=jnp.int32)

    @property
    def max_num_running_seqs(self) -> jax.Array:
        """int32[G]: vLLM's get_max_num_running_seqs: n before the fork, live sequences after."""
        return jnp.where(self.forked, self.num_live_seqs, self.n)


_GROUP_AT = {n: i for i, n in enumerate(GROUP_FIELDS)}
_SEQ_AT = {n: i for i, n in enumerate(SEQ_FIELDS)}
_TABLE_AT = {n: i for i, n in enumerate(TABLE_FIELDS)}
_ALL_FIELDS = set(GROUP_FIELDS + SEQ_FIELDS + TABLE_FIELDS + POOL_FIELDS + SCALAR_FIELDS)
for _name in _ALL_FIELDS - set(LIMIT_FIELDS):
    setattr(SchedulerState, _name, property(lambda self, _n=_name: self.get(_n),
                                            doc=f"The `{_name}` field (see the class doc)."))


def make_limits(config: SchedulerConfig) -> Limits:
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    return Limits(
        num_device_blocks=i32(config.num_device_blocks),
        num_host_blocks=i32(config.num_host_blocks),
        max_num_seqs=i32(config.max_num_seqs),
        max_num_batched_tokens=i32(config.max_num_batched_tokens),
        max_model_len=i32(config.max_model_len),
        watermark_blocks=i32(config.watermark_blocks),
        preemption_mode=i32(config.preemption_mode_id),
        delay_factor=jnp.asarray(config.delay_factor, jnp.float32),
        block_size=i32(config.block_size),
    )


def init_state(config: SchedulerConfig) -> SchedulerState:
    """An empty scheduler: no requests, every active block free."""
    cap: Capacity = config.capacity()
    g, s, m = cap.num_slots, cap.max_seqs_per_group, cap.max_blocks_per_seq
    zi = lambda *shape: jnp.zeros(shape, jnp.int32)
    return SchedulerState.from_fields(
        status=zi(g), finish_reason=zi(g), ignore_reason=zi(g),
        arrival_time=jnp.zeros((g,), jnp.float32), queue_key=zi(g), request_index=zi(g),
        prompt_len=zi(g), n=zi(g), max_tokens=zi(g), forked=jnp.zeros((g,), bool),
        prefill_done=zi(g), prefill_total=zi(g), num_preemptions=zi(g),
        seq_alive=jnp.zeros((g, s), bool), seq_finish_reason=zi(g, s), num_tokens=zi(g, s),
        num_blocks=zi(g, s), block_table=zi(g, s, m), host_table=zi(g, s, m),
        device_ref=zi(cap.num_device_blocks + 1), host_ref=zi(cap.num_host_blocks + 1),
        tail_key=jnp.asarray(0, jnp.int32), front_key=jnp.asarray(-1, jnp.int32),
        step=jnp.asarray(0, jnp.int32),
        prev_time=jnp.asarray(0.0, jnp.float32), last_prompt_latency=jnp.asarray(0.0, jnp.float32),
        prev_admitted=jnp.asarray(False), rng=jax.random.PRNGKey(config.seed),
        artificial_count=jnp.asarray(config.artificial_preemption_count, jnp.int32),
        limits=make_limits(config),
    )


def set_limits(state: SchedulerState, config: SchedulerConfig) -> SchedulerState:
    """Run the same compiled scheduler under another config of the same capacity."""
    return state.replace(limits=make_limits(config))
