"""The scheduler state: one frozen pytree of one to three flat int32 arrays; the step output.

Shapes use G = num_slots, S = max_seqs_per_group, M = max_blocks_per_seq,
D = num_device_blocks + 1 and H = num_host_blocks + 1 (index 0 of each pool is the null
block, never handed out). A slot holds one sequence group (one request) from `add_requests`
to `free_finished`; its `status` says which queue holds it, so a request is in exactly one
state by construction. Queue order is a key per slot: `running` and `swapped` walk in
(arrival_time, queue_key) order, `waiting` in queue_key order (SPEC A2).

Storage is one flat int32 array (three for big states) because every array that crosses a
jitted call costs microseconds on XLA's CPU backend (STYLE.md), and every buffer a step
writes is one more kernel: the state crosses as one to three arrays instead of thirty-eight,
and a step writes each with one concatenation. Every field keeps its name as a read-only property (a static slice,
free inside jit) and `state.replace(field=...)` writes fields back:

    data: (int32[N],)  the fields of FIELDS in order, each flattened; or, when that is more
                       than ONE_LEAF_BYTES, (int32[N0], int32[N1], int32[N2]): the same
                       without the tables and pools, block_table and host_table, then
                       device_ref and host_ref
    dims: (G, S, M, D, H), static (pytree aux data)

Floats are stored bit-cast (exact), bools as 0/1. Properties index from the end, so they
also work on states stacked along leading axes (vmap).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxsched.config import Capacity, SchedulerConfig
from jaxsched.cost_model import FIELDS as COST_FIELDS

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
      preemption_mode: config.PREEMPTION_MODES: 0 vLLM's default, 1 recompute, 2 swap,
        3 "auto" (by cost).
      delay_factor: float32.
      block_size: mirrors Capacity.block_size for transitions compiled without a capacity.
      recompute_fixed, recompute_per_token, recompute_per_token_sq, swap_fixed,
        swap_per_block: float32, the cost model of mode 3 (cost_model.PreemptionCosts),
        in seconds; read only by mode 3.
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
    recompute_fixed: jax.Array
    recompute_per_token: jax.Array
    recompute_per_token_sq: jax.Array
    swap_fixed: jax.Array
    swap_per_block: jax.Array

    @property
    def costs(self) -> tuple[jax.Array, ...]:
        """The cost coefficients in cost_model.FIELDS order."""
        return tuple(getattr(self, name) for name in COST_FIELDS)


# The layout: (name, shape in terms of the dims) in storage order. Fields a steady decode
# step rewrites sit together, so `replace` copies the rest in a few long slices.
# `walk_order` is the scheduler's cache of the last queue order (a permutation of slots);
# schedule checks it and re-sorts when it is stale, so nobody else maintains it.
LIMIT_FIELDS = tuple(Limits.__dataclass_fields__)
FIELDS = (
    ("queue_key", "G"), ("walk_order", "G"), ("tail_key", ""), ("step", ""), ("prev_time", ""),
    ("last_prompt_latency", ""), ("prev_admitted", ""),
    ("status", "G"), ("finish_reason", "G"), ("ignore_reason", "G"), ("arrival_time", "G"),
    ("request_index", "G"), ("prompt_len", "G"), ("n", "G"), ("max_tokens", "G"),
    ("forked", "G"), ("prefill_done", "G"), ("prefill_total", "G"), ("num_preemptions", "G"),
    ("front_key", ""), ("rng", "2"), ("artificial_count", ""),
) + tuple((f, "") for f in LIMIT_FIELDS) + (
    ("seq_alive", "GS"), ("seq_finish_reason", "GS"), ("num_tokens", "GS"), ("num_blocks", "GS"),
    ("block_table", "GSM"), ("host_table", "GSM"), ("device_ref", "D"), ("host_ref", "H"),
)
# Which leaf holds each field, when the state is big enough to take three: the tables and
# the pools get leaves of their own.
# NOTE: XLA:CPU splits a kernel that writes more than ~256 KiB across its thread pool, and
# on 2 shared cores waiting for the other thread costs far more than the copy; three leaves
# keep each one's rewrite under that at 1024 slots of 16-block tables. A small state stays
# one leaf: each leaf crossing a jitted call costs a few microseconds.
_LEAF_OF = {"block_table": 1, "host_table": 1, "device_ref": 2, "host_ref": 2}
ONE_LEAF_BYTES = 128 * 1024
FIELD_NAMES = tuple(name for name, _ in FIELDS)

_FLOATS = {"arrival_time", "prev_time", "last_prompt_latency", "delay_factor", *COST_FIELDS}
_BOOLS = {"forked", "seq_alive", "prev_admitted"}
_UINTS = {"rng"}


@functools.lru_cache(maxsize=None)
def layout(dims: tuple) -> dict:
    """name -> (leaf, offset, shape) for dims (G, S, M, D, H); plus "sizes" of the leaves."""
    sizes = dict(zip("GSMDH", dims), **{"2": 2})
    shapes = {name: tuple(sizes[c] for c in spec) for name, spec in FIELDS}
    split = 4 * sum(math.prod(shape) for shape in shapes.values()) > ONE_LEAF_BYTES
    out, offsets = {}, [0] * (3 if split else 1)
    for name, shape in shapes.items():
        leaf = _LEAF_OF.get(name, 0) if split else 0
        out[name] = (leaf, offsets[leaf], shape)
        offsets[leaf] += math.prod(shape)
    out["sizes"] = tuple(offsets)
    return out


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


@jax.tree_util.register_pytree_node_class
class SchedulerState:
    """Everything the scheduler knows. No Python containers: the tree never changes shape.

    Leaves: `data`, one to three flat arrays (see the module doc); `dims` = (G, S, M, D, H)
    is static.
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
    __slots__ = ("data", "dims")

    def __init__(self, data, dims: tuple):
        # No checks here: jax rebuilds pytrees with placeholder leaves.
        self.data, self.dims = data, dims

    def tree_flatten(self):
        return tuple(self.data), self.dims

    @classmethod
    def tree_unflatten(cls, dims, leaves):
        return cls(tuple(leaves), dims)

    @classmethod
    def from_fields(cls, **fields) -> SchedulerState:
        """Pack named fields (every field of the class doc, `walk_order` optional)."""
        fields = dict(fields)
        limits = fields.pop("limits")
        fields.update({f: getattr(limits, f) for f in LIMIT_FIELDS})
        g = fields["status"].shape[-1]
        fields.setdefault("walk_order", jnp.arange(g, dtype=jnp.int32))
        dims = (g, fields["seq_alive"].shape[-1], fields["block_table"].shape[-1],
                fields["device_ref"].shape[-1], fields["host_ref"].shape[-1])
        lay = layout(dims)
        data = tuple(jnp.concatenate([encode(n, fields[n]).reshape(-1) for n in FIELD_NAMES
                                      if lay[n][0] == leaf]) for leaf in range(len(lay["sizes"])))
        return cls(data, dims)

    def stored(self, name: str) -> jax.Array:
        """A field as stored (int32), without decoding."""
        leaf, offset, shape = layout(self.dims)[name]
        data = self.data[leaf]
        return data[..., offset:offset + math.prod(shape)].reshape(data.shape[:-1] + shape)

    def get(self, name: str) -> jax.Array:
        return decode(name, self.stored(name))

    @property
    def limits(self) -> Limits:
        return Limits(**{f: self.get(f) for f in LIMIT_FIELDS})

    def replace(self, **fields) -> SchedulerState:
        """A copy with the named fields (or the leaves, `data`) replaced: one concatenation
        per leaf that changes."""
        if "limits" in fields:
            limits = fields.pop("limits")
            fields.update({f: getattr(limits, f) for f in LIMIT_FIELDS})
        data = tuple(fields.pop("data", self.data))
        unknown = set(fields) - set(FIELD_NAMES)
        if unknown:
            raise TypeError(f"SchedulerState.replace: unknown fields {sorted(unknown)}")
        lay = layout(self.dims)
        new = list(data)
        for leaf in {lay[n][0] for n in fields}:
            old, lead = data[leaf], data[leaf].shape[:-1]
            parts, keep = [], None        # keep: (start, end) of a run of unchanged fields
            for name in FIELD_NAMES:
                at, offset, shape = lay[name]
                if at != leaf:
                    continue
                size = math.prod(shape)
                if name not in fields:
                    keep = (keep[0], offset + size) if keep else (offset, offset + size)
                    continue
                if keep:
                    parts.append(old[..., keep[0]:keep[1]])
                    keep = None
                value = jnp.broadcast_to(encode(name, fields[name]), lead + shape)
                parts.append(value.reshape(lead + (size,)))
            if keep:
                parts.append(old[..., keep[0]:keep[1]])
            new[leaf] = jnp.concatenate(parts, axis=-1)
        return SchedulerState(tuple(new), self.dims)

    def as_dict(self) -> dict:
        """Every named field, decoded (for debugging and tests)."""
        names = [n for n in FIELD_NAMES if n not in LIMIT_FIELDS]
        return {n: self.get(n) for n in names} | {"limits": self.limits}

    def __repr__(self):
        return f"SchedulerState(data={[x.shape for x in self.data]}, dims={self.dims})"

    @property
    def num_live_seqs(self) -> jax.Array:
        """int32[G]: sequences each group holds now (1 before the fork)."""
        return self.seq_alive.sum(axis=-1, dtype=jnp.int32)

    @property
    def max_num_running_seqs(self) -> jax.Array:
        """int32[G]: vLLM's get_max_num_running_seqs: n before the fork, live sequences after."""
        return jnp.where(self.forked, self.num_live_seqs, self.n)


for _name in FIELD_NAMES:
    if _name not in LIMIT_FIELDS:
        setattr(SchedulerState, _name, property(lambda self, _n=_name: self.get(_n),
                                                doc=f"The `{_name}` field (see the class doc)."))


OUTPUT_FIELDS = ("scheduled", "num_scheduled_tokens", "is_prefill", "num_seqs", "preempted",
                 "preempt_order", "swapped_in", "ignored", "blocks_to_swap_out", "num_swap_out",
                 "blocks_to_swap_in", "num_swap_in", "blocks_to_copy", "num_copy",
                 "num_free_device_blocks", "num_free_host_blocks")
SLOT_OUTPUTS = OUTPUT_FIELDS[:8]
PAIR_OUTPUTS = ("blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy")
COUNT_OUTPUTS = ("num_swap_out", "num_swap_in", "num_copy", "num_free_device_blocks",
                 "num_free_host_blocks")
_BOOL_OUTPUTS = {"scheduled", "is_prefill", "swapped_in", "ignored"}


@jax.tree_util.register_pytree_node_class
class SchedulerOutput:
    """What one step decided, per slot, plus the block moves for the cache kernels.

    One flat int32 array, like the state: `data` = [slots | pairs | counts] with
      slots:  int32[8, G]     one row per field of SLOT_OUTPUTS
      pairs:  int32[3, P, 2]  blocks_to_swap_out, blocks_to_swap_in, blocks_to_copy;
                              P = placement.pair_rows(cap), the most pairs a step can make
      counts: int32[5]        COUNT_OUTPUTS
    and `dims` = (G, P) static. Named fields (properties; `_fields` and `_asdict()` as on a
    NamedTuple): scheduled: bool[G]; num_scheduled_tokens: int32[G] prefill chunk, or 1 for
    a decode; is_prefill: bool[G] the chunk is part of the prompt; num_seqs: int32[G]
    sequences running in this step; preempted: int32[G] 0 no, 1 recompute, 2 swap;
    preempt_order: int32[G] order of preemption within the step; swapped_in, ignored:
    bool[G]; blocks_to_swap_out (device, host), blocks_to_swap_in (host, device),
    blocks_to_copy (src, dst): int32[P, 2]; num_swap_out, num_swap_in, num_copy,
    num_free_device_blocks, num_free_host_blocks: int32[]. Pair lists are padded with
    out-of-range ids (the pool sizes), so the kernels can scatter with mode="drop";
    `num_*` says how many pairs are real.
    """
    __slots__ = ("data", "dims")
    _fields = OUTPUT_FIELDS

    def __init__(self, data, dims: tuple):
        self.data, self.dims = data, dims

    def tree_flatten(self):
        return (self.data,), self.dims

    @classmethod
    def tree_unflatten(cls, dims, leaves):
        return cls(leaves[0], dims)

    @classmethod
    def pack(cls, slots: jax.Array, pairs: jax.Array, counts: jax.Array) -> SchedulerOutput:
        """From slots int32[8, G], pairs int32[3, P, 2] and counts int32[5]."""
        g, p = slots.shape[-1], pairs.shape[-2]
        parts = [slots.astype(jnp.int32), pairs.astype(jnp.int32), counts.astype(jnp.int32)]
        return cls(jnp.concatenate([x.reshape(-1) for x in parts]), (g, p))

    @classmethod
    def from_fields(cls, **f) -> SchedulerOutput:
        return cls.pack(jnp.stack([jnp.asarray(f[n]).astype(jnp.int32) for n in SLOT_OUTPUTS]),
                        jnp.stack([f[n] for n in PAIR_OUTPUTS]),
                        jnp.stack([jnp.asarray(f[n], jnp.int32) for n in COUNT_OUTPUTS]))

    def get(self, name: str) -> jax.Array:
        g, p = self.dims
        lead = self.data.shape[:-1]
        if name in SLOT_OUTPUTS:
            i = SLOT_OUTPUTS.index(name) * g
            row = self.data[..., i:i + g]
            return row != 0 if name in _BOOL_OUTPUTS else row
        if name in PAIR_OUTPUTS:
            i = 8 * g + PAIR_OUTPUTS.index(name) * 2 * p
            return self.data[..., i:i + 2 * p].reshape(lead + (p, 2))
        i = 8 * g + 6 * p + COUNT_OUTPUTS.index(name)
        return self.data[..., i]

    def _asdict(self) -> dict:
        return {n: self.get(n) for n in OUTPUT_FIELDS}

    def __repr__(self):
        return f"SchedulerOutput(data={self.data.shape}, dims={self.dims})"


for _name in OUTPUT_FIELDS:
    setattr(SchedulerOutput, _name, property(lambda self, _n=_name: self.get(_n)))


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
        **{name: jnp.asarray(value, jnp.float32)
           for name, value in zip(COST_FIELDS, config.costs.coefficients)},
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
