"""The scheduler state: one frozen pytree of one to three flat int32 arrays; the step output.

Shapes use G = num_slots, S = max_seqs_per_group, M = max_blocks_per_seq,
D = num_device_blocks + 1 and H = num_host_blocks + 1 (index 0 of each pool is the null
block, never handed out). A slot holds one sequence group (one request) from `add_requests`
to `free_finished`; its `status` says which queue holds it, so a request is in exactly one
state by construction. Queue order is a key per slot: `running` and `swapped` walk in
(arrival_time, queue_key) order, `waiting` in queue_key order (SPEC A2).

Storage is one flat int32 array (three for big states) because every array that crosses a
jitted call costs microseconds on XLA's CPU backend, and every buffer a step writes is one
more kernel: the state crosses as one to three arrays instead of thirty-eight, and a step
writes each with one concatenation. Each field is declared once, as a `Field` in
SchedulerState's body (shape, storage kind, meaning); its typed accessor (a static slice,
free inside jit), the storage layout, the encoders and the class docs all come from that
table, and `state.replace(field=...)` writes fields back:

    data: (int32[N],)  the fields of FIELDS in order, each flattened; or, when that is more
                       than ONE_LEAF_BYTES, (int32[N0], int32[N1], int32[N2]): the same
                       without the table and pools, block_table (and seq_key), then
                       device_ref and host_ref
    dims: (G, S, M, D, H), static (pytree aux data); with prefix caching (SPEC A10)
          (G, S, M, D, H, key bits) and the cache fields exist; (G, S, M, D, H, key bits
          or 0, 1) is the same state stored one leaf per field (`per_field`; the scalars
          share one, and so do the fields only an admission writes), the layout inside a
          compiled loop over steps, where no leaf crosses a jitted call

Floats are stored bit-cast (exact), bools as 0/1. Properties index from the end, so they
also work on states stacked along leading axes (vmap).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jaxsched.core.config import Capacity, SchedulerConfig
from jaxsched.core.costs import FIELDS as COST_FIELDS
from jaxsched.core.prefix_cache import NEVER_ACCESSED, PrefixPool

class Status(enum.IntEnum):
    """Which queue holds a slot."""
    EMPTY = 0
    WAITING = 1
    RUNNING = 2
    SWAPPED = 3
    FINISHED = 4


class FinishReason(enum.IntEnum):
    """Why a group or a sequence finished."""
    NOT_FINISHED = 0
    LENGTH_CAPPED = 1
    STOPPED = 2
    IGNORED = 3
    ABORTED = 4


class IgnoreReason(enum.IntEnum):
    """Why a request was ignored."""
    NONE = 0
    PROMPT_TOO_LONG = 1
    NEVER_FITS = 2
    TOO_MANY_SEQS = 3


# Short names for the jitted code, which compares against them everywhere.
EMPTY, WAITING, RUNNING, SWAPPED, FINISHED = Status
NOT_FINISHED, LENGTH_CAPPED, STOPPED, IGNORED, ABORTED = FinishReason
IGNORE_NONE, IGNORE_PROMPT_TOO_LONG, IGNORE_NEVER_FITS, IGNORE_TOO_MANY_SEQS = IgnoreReason
FINISH_NAMES = {r: f"finished_{r.name.lower()}" for r in FinishReason if r != NOT_FINISHED}
IGNORE_REASONS = {
    IgnoreReason.PROMPT_TOO_LONG: "prompt longer than the prompt limit",
    IgnoreReason.NEVER_FITS: "needs more KV blocks than the device cache can ever hold",
    IgnoreReason.TOO_MANY_SEQS: "n is larger than max_num_seqs",
}


def is_live(status: jax.Array) -> jax.Array:
    """Slots that a queue holds (waiting, running or swapped); bool, the shape of `status`."""
    return (status == WAITING) | (status == RUNNING) | (status == SWAPPED)


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
        swap_per_block: float32, the cost model of mode 3 (core.costs.PreemptionCosts),
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
        """The cost coefficients in core.costs.FIELDS order."""
        return tuple(getattr(self, name) for name in COST_FIELDS)


LIMIT_FIELDS = tuple(Limits.__dataclass_fields__)
_LIMIT_KINDS = {name: "float32" if name == "delay_factor" or name in COST_FIELDS else "int32"
                for name in LIMIT_FIELDS}


class _Declared:
    """A field declared in a class body: it takes its attribute's name, and reads as the
    instance's `get(name)` (the class itself gets the declaration, for the tables)."""
    name: str

    def __set_name__(self, owner, name):
        object.__setattr__(self, "name", name)      # the subclasses are frozen dataclasses

    def __get__(self, obj, owner=None) -> jax.Array:
        if obj is None:
            return self                 # type: ignore[return-value]
        return obj.get(self.name)


@dataclasses.dataclass(frozen=True)
class Field(_Declared):
    """One named field of the state: its shape over the dims (G, S, M, D, H; "2" a pair; ""
    a scalar), how it is stored in the int32 leaves, and what it means. Declared once in
    SchedulerState's body; storage, encoders, the typed accessor and the docs follow.
    `cache` fields exist only in a state with prefix caching (SPEC A10) compiled in."""
    shape: str
    kind: str                 # "int32", "float32" (bit-cast), "bool" (0/1), "uint32" (bit-cast)
    doc: str
    name: str = ""
    cache: bool = False


# Which leaf holds each field, when the state is big enough to take three: the tables and
# the pools get leaves of their own.
# NOTE: XLA:CPU splits a kernel that writes more than ~256 KiB across its thread pool, and
# on 2 shared cores waiting for the other thread costs far more than the copy; three leaves
# keep each one's rewrite under that at 1024 slots of 16-block tables. A small state stays
# one leaf: each leaf crossing a jitted call costs a few microseconds.
_LEAF_OF = {"block_table": 1, "seq_key": 1, "device_ref": 2, "host_ref": 2}
_POOL_FIELDS = ("key", "cached", "last_access", "hashed", "evict_seq", "num_used", "clock")
_LEAF_OF |= {f"{pool}_{f}": 2 for pool in ("dev", "host") for f in _POOL_FIELDS}
ONE_LEAF_BYTES = 128 * 1024


# Fields stored together in the per-field layout (`layout`): the scalars and the rng key;
# the slot fields that only an admission writes (requests.add_requests, or the scheduler
# ignoring a request).
SCALAR_SHAPES = ("", "2")
ADMISSION_FIELDS = ("ignore_reason", "arrival_time", "request_index", "prompt_len", "n", "max_tokens")


@functools.lru_cache(maxsize=None)
def layout(dims: tuple) -> dict:
    """name -> (leaf, offset, shape) for dims (G, S, M, D, H[, key bits]); plus "sizes" of
    the leaves. The cache fields are laid out only with key bits (dims[5]) > 0."""
    sizes = dict(zip("GSMDH", dims), **{"2": 2})
    caching = len(dims) > 5 and bool(dims[5])
    shapes = {f.name: tuple(sizes[c] for c in f.shape) for f in FIELDS if caching or not f.cache}
    if len(dims) > 6 and dims[6]:             # one leaf per field (`per_field`)
        # ... but the scalars share one, and so do the fields only an admission writes: a
        # sweep's visit of a run unpacks each leaf with a kernel of its own, and `put_slots`
        # writes each leaf with one scatter. The scalars are half the fields (the limits
        # among them) in a few dozen bytes (the sweep's chunk: 451 kernels -> 430; the
        # admission fields with `put_slots`, 426 -> 414).
        leaves = {}
        for f in FIELDS:
            if f.name in shapes:
                key = "" if f.shape in SCALAR_SHAPES else "admitted" if f.name in ADMISSION_FIELDS else f.name
                leaves.setdefault(key, []).append(f.name)
        out, sizes = {}, []
        for leaf, names in enumerate(leaves.values()):
            offset = 0
            for name in names:
                out[name] = (leaf, offset, shapes[name])
                offset += math.prod(shapes[name])
            sizes.append(offset)
        out["sizes"] = tuple(sizes)
        return out
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
    kind = _KIND[name]
    if kind == "float32":
        return lax.bitcast_convert_type(jnp.asarray(value, jnp.float32), jnp.int32)
    if kind == "uint32":
        return lax.bitcast_convert_type(jnp.asarray(value, jnp.uint32), jnp.int32)
    return jnp.asarray(value).astype(jnp.int32)


def decode(name: str, stored: jax.Array) -> jax.Array:
    """Inverse of `encode`."""
    kind = _KIND[name]
    if kind == "float32":
        return lax.bitcast_convert_type(stored, jnp.float32)
    if kind == "uint32":
        return lax.bitcast_convert_type(stored, jnp.uint32)
    if kind == "bool":
        return stored != 0
    return stored


@jax.tree_util.register_pytree_node_class
class SchedulerState:
    """Everything the scheduler knows. No Python containers: the tree never changes shape.

    Leaves: `data`, one to three flat arrays (see the module doc); `dims` = (G, S, M, D, H)
    is static. `limits` (a Limits) is stored with the rest. Named fields, read-only
    (write with `replace`), in storage order (the list below is generated from them):
    """
    # Storage order: fields a steady decode step rewrites sit together, so `replace` copies
    # the rest in a few long slices. The limits are stored between artificial_count and
    # seq_alive.
    queue_key = Field("G", "int32", "position inside its queue (smaller is nearer the head)")
    walk_order = Field("G", "int32", "the scheduler's cached queue order, a permutation of slots "
                       "(a hint: schedule checks it and re-sorts when it is stale)")
    tail_key = Field("", "int32", "next queue key for the tail of a queue")
    step = Field("", "int32", "schedule calls so far")
    prev_time = Field("", "float32", "SPEC A7: time of the previous schedule call")
    last_prompt_latency = Field("", "float32", "SPEC A7: latency of the last prompt step")
    prev_admitted = Field("", "bool", "the previous admission walk admitted from waiting")
    status = Field("G", "int32", "a Status: which queue holds the slot")
    finish_reason = Field("G", "int32", "a FinishReason once FINISHED")
    ignore_reason = Field("G", "int32", "an IgnoreReason: why an IGNORED group was ignored")
    arrival_time = Field("G", "float32", "seconds, the FCFS priority")
    request_index = Field("G", "int32", "caller's id for the request (e.g. its index in a trace)")
    prompt_len = Field("G", "int32", "prompt tokens")
    n = Field("G", "int32", "parallel samples requested")
    max_tokens = Field("G", "int32", "output tokens after which a sequence is length-capped")
    forked = Field("G", "bool", "the group has sampled its first tokens and holds n sequences")
    prefill_done = Field("G", "int32", "prefill tokens computed so far (chunks add up here)")
    prefill_total = Field("G", "int32", "prefill tokens to compute: the prompt, or after a "
                          "recompute the prompt plus outputs (SPEC A5, B1)")
    num_preemptions = Field("G", "int32", "times this group was preempted")
    front_key = Field("", "int32", "next queue key for the front of a queue")
    rng = Field("2", "uint32", "key for artificial preemption (SPEC A8)")
    artificial_count = Field("", "int32", "forced failures left (SPEC A8)")
    seq_alive = Field("GS", "bool", "sequence exists and is not finished")
    seq_finish_reason = Field("GS", "int32", "a FinishReason per sequence")
    num_tokens = Field("GS", "int32", "prompt + output tokens of each sequence")
    num_blocks = Field("GS", "int32", "entries used in the block table (device or host)")
    # One table for both pools: a group's blocks are all on the device or all on the host,
    # and its status says which; so no step carries (and copies) a second [G, S, M] table.
    block_table = Field("GSM", "int32", "block ids of each sequence: device blocks, or host blocks "
                        "while SWAPPED; unused entries hold the null block 0")
    device_ref = Field("D", "int32", "references to each device block from the tables of groups "
                       "on the device")
    host_ref = Field("H", "int32", "references to each host block from the tables of SWAPPED groups")
    # SPEC A10 (prefix caching), only with Capacity.enable_prefix_caching: the pools are
    # prefix_cache.PrefixPools whose ref counts are device_ref and host_ref.
    seq_key = Field("GS2M", "uint32", "content key of each block of each sequence (two words of "
                    "the chained hash, prefix_cache.block_keys), kept up to date as tokens arrive",
                    cache=True)
    dev_key = Field("2D", "uint32", "key a device block was given (allocation, promotion)", cache=True)
    dev_cached = Field("D", "bool", "the device block holds a content key (findable)", cache=True)
    dev_last_access = Field("D", "float32", "`now` of the last step that scheduled the block; -1 "
                            "never", cache=True)
    dev_hashed = Field("D", "int32", "tokens the block's key covers (num_hashed_tokens)", cache=True)
    dev_evict_seq = Field("D", "int32", "when the block entered the evictor (its order there)",
                          cache=True)
    dev_num_used = Field("", "int32", "device blocks 1..dev_num_used have been handed out", cache=True)
    dev_clock = Field("", "int32", "the next dev_evict_seq", cache=True)
    host_key = Field("2H", "uint32", "as dev_key, for the host pool", cache=True)
    host_cached = Field("H", "bool", "as dev_cached, for the host pool", cache=True)
    host_last_access = Field("H", "float32", "as dev_last_access (host blocks are never accessed)",
                             cache=True)
    host_hashed = Field("H", "int32", "as dev_hashed, for the host pool", cache=True)
    host_evict_seq = Field("H", "int32", "as dev_evict_seq, for the host pool", cache=True)
    host_num_used = Field("", "int32", "as dev_num_used, for the host pool", cache=True)
    host_clock = Field("", "int32", "as dev_clock, for the host pool", cache=True)

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
    def from_fields(cls, key_bits: int = 64, **fields) -> SchedulerState:
        """Pack named fields (every field of the class doc, `walk_order` optional; the cache
        fields too, or none of them). `key_bits`: the width of the cache keys."""
        fields = dict(fields)
        limits = fields.pop("limits")
        fields.update({f: getattr(limits, f) for f in LIMIT_FIELDS})
        g = fields["status"].shape[-1]
        fields.setdefault("walk_order", jnp.arange(g, dtype=jnp.int32))
        dims = (g, fields["seq_alive"].shape[-1], fields["block_table"].shape[-1],
                fields["device_ref"].shape[-1], fields["host_ref"].shape[-1])
        if "seq_key" in fields:
            dims += (key_bits,)
        lay = layout(dims)
        data = tuple(jnp.concatenate([encode(n, fields[n]).reshape(-1) for n in FIELD_NAMES
                                      if n in lay and lay[n][0] == leaf])
                     for leaf in range(len(lay["sizes"])))
        return cls(data, dims)

    def stored(self, name: str) -> jax.Array:
        """A field as stored (int32), without decoding."""
        leaf, offset, shape = layout(self.dims)[name]
        data = self.data[leaf]
        return data[..., offset:offset + math.prod(shape)].reshape(data.shape[:-1] + shape)

    def get(self, name: str) -> jax.Array:
        return decode(name, self.stored(name))

    def per_field(self, on: bool = True) -> SchedulerState:
        """The same state stored one leaf per field (`on`; the scalars share one, and so do
        ADMISSION_FIELDS), or back in the packed leaves.

        Inside a compiled loop over steps (a sweep's chunk) nothing crosses a jitted call, and
        per-field leaves let `replace` write only the fields it changes instead of copying the
        whole packed leaf (under vmap, the state of every run of the batch)."""
        dims = self.dims[:5] + (self.key_bits,) + ((1,) if on else ())
        if not on and not self.caching:
            dims = dims[:5]
        if dims == self.dims:
            return self
        lay, lead = layout(dims), self.data[0].shape[:-1]
        data = tuple(jnp.concatenate([self.stored(n).reshape(lead + (-1,)) for n in FIELD_NAMES
                                      if n in lay and lay[n][0] == leaf], axis=-1)
                     for leaf in range(len(lay["sizes"])))
        return SchedulerState(data, dims)

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
        lay = layout(self.dims)
        unknown = set(fields) - set(lay)
        if unknown:
            raise TypeError(f"SchedulerState.replace: unknown fields {sorted(unknown)}")
        new = list(data)
        for leaf in {lay[n][0] for n in fields}:
            old, lead = data[leaf], data[leaf].shape[:-1]
            parts, keep = [], None        # keep: (start, end) of a run of unchanged fields
            for name in FIELD_NAMES:
                if name not in lay:
                    continue
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

    def put_slots(self, slot: jax.Array, **rows) -> SchedulerState:
        """A copy with rows `slot` (int32[R]; an out-of-range slot is dropped) of the named
        slot-indexed fields (leading axis G) set to `rows` (each [R, ...] or broadcast to
        it): one scatter per leaf written, not one per field (the packed layout: one in
        all; a request's admission writes seventeen fields)."""
        lay = layout(self.dims)
        g = self.dims[0]
        by_leaf: dict = {}
        for name, value in rows.items():
            if name not in lay:
                raise TypeError(f"SchedulerState.put_slots: unknown field {name}")
            if not _SHAPE[name].startswith("G"):
                raise TypeError(f"SchedulerState.put_slots: {name} is not indexed by slot")
            leaf, offset, shape = lay[name]
            size = math.prod(shape[1:])
            value = jnp.broadcast_to(encode(name, value), slot.shape + shape[1:]).reshape(-1)
            at = offset + slot[:, None] * size + jnp.arange(size, dtype=jnp.int32)
            at = jnp.where(slot[:, None] < g, at, self.data[leaf].shape[-1])
            by_leaf.setdefault(leaf, []).append((at.reshape(-1), value))
        data = list(self.data)
        for leaf, parts in by_leaf.items():
            at, value = (jnp.concatenate(p) for p in zip(*parts))
            data[leaf] = data[leaf].at[at].set(value, mode="drop")
        return SchedulerState(tuple(data), self.dims)

    def as_dict(self) -> dict:
        """Every named field, decoded (for debugging and tests)."""
        lay = layout(self.dims)
        names = [n for n in FIELD_NAMES if n not in LIMIT_FIELDS and n in lay]
        return {n: self.get(n) for n in names} | {"limits": self.limits}

    @property
    def caching(self) -> bool:
        """Prefix caching (SPEC A10) is compiled in: the cache fields exist (static)."""
        return len(self.dims) > 5 and bool(self.dims[5])

    @property
    def key_bits(self) -> int:
        """Width of the cache keys (static; 64 but in tests that force collisions)."""
        return self.dims[5] if self.caching else 0

    def pool(self, which: str) -> PrefixPool:
        """The device ("dev") or host ("host") pool as a prefix_cache.PrefixPool."""
        ref = self.device_ref if which == "dev" else self.host_ref
        active = self.limits.num_device_blocks if which == "dev" else self.limits.num_host_blocks
        f = lambda name: self.get(f"{which}_{name}")
        return PrefixPool(key=f("key"), ref_count=ref, last_access=f("last_access"),
                          num_hashed_tokens=f("hashed"), evict_seq=f("evict_seq"),
                          cached=f("cached"), num_used=f("num_used"), num_active=active,
                          clock=f("clock"))

    def __repr__(self):
        g, s, m, d, h = self.dims[:5]
        head = f"SchedulerState(slots={g}, seqs_per_group={s}, blocks_per_seq={m}, " \
               f"device_blocks={d - 1}, host_blocks={h - 1}"
        try:
            import numpy as np
            status = np.asarray(self.status)
            free = int((np.asarray(self.device_ref)[1:] == 0).sum())
        except Exception:                 # abstract (inside jit) or batched: shapes only
            return head + f", leaves={[x.shape for x in self.data]})"
        if status.ndim != 1:
            return head + f", leaves={[x.shape for x in self.data]})"
        queues = ", ".join(f"{st.name.lower()}={int((status == st).sum())}" for st in Status
                           if st != Status.EMPTY)
        return head + f"; {queues}; device_ref>0: {d - 1 - free} blocks)"

    @property
    def num_live_seqs(self) -> jax.Array:
        """int32[G]: sequences each group holds now (1 before the fork)."""
        return self.seq_alive.sum(axis=-1, dtype=jnp.int32)

    @property
    def max_num_running_seqs(self) -> jax.Array:
        """int32[G]: vLLM's get_max_num_running_seqs: n before the fork, live sequences after."""
        return jnp.where(self.forked, self.num_live_seqs, self.n)


def pool_fields(which: str, pool: PrefixPool) -> dict:
    """`state.replace(**pool_fields(which, pool))` writes a pool back (its ref counts too)."""
    ref = "device_ref" if which == "dev" else "host_ref"
    return {ref: pool.ref_count, f"{which}_key": pool.key, f"{which}_cached": pool.cached,
            f"{which}_last_access": pool.last_access, f"{which}_hashed": pool.num_hashed_tokens,
            f"{which}_evict_seq": pool.evict_seq, f"{which}_num_used": pool.num_used,
            f"{which}_clock": pool.clock}


def _storage_order() -> tuple[Field, ...]:
    own = [v for v in vars(SchedulerState).values() if isinstance(v, Field)]
    at = [f.name for f in own].index("seq_alive")
    limits = [Field("", _LIMIT_KINDS[n], "a per-run limit (see Limits)", n) for n in LIMIT_FIELDS]
    return tuple(own[:at] + limits + own[at:])


FIELDS = _storage_order()
FIELD_NAMES = tuple(f.name for f in FIELDS)
_KIND = {f.name: f.kind for f in FIELDS}
_SHAPE = {f.name: f.shape for f in FIELDS}
SchedulerState.__doc__ += "\n".join(
    f"      {f.name}: {f.kind}[{', '.join(f.shape)}]  {f.doc}" + ("  (caching only)" if f.cache else "")
    for f in FIELDS if f.name not in LIMIT_FIELDS) + "\n      limits: Limits\n"


@dataclasses.dataclass(frozen=True)
class OutputField(_Declared):
    """One named field of SchedulerOutput: its region of the flat array and meaning."""
    region: str               # "slots": [G] per slot; "pairs": [P, 2] block pairs; "counts": []
    kind: str                 # "int32" or "bool"
    doc: str
    name: str = ""


@jax.tree_util.register_pytree_node_class
class SchedulerOutput:
    """What one step decided, per slot, plus the block moves for the cache kernels.

    One flat int32 array, like the state: `data` = [slots | pairs | counts], with
    slots int32[len(SLOT_OUTPUTS), G], pairs int32[len(PAIR_OUTPUTS), P, 2] (P =
    placement.pair_rows(cap), the most pairs a step can make) and counts
    int32[len(COUNT_OUTPUTS)]; `dims` = (G, P) static. `_fields` and `_asdict()` work as on
    a NamedTuple. Pair lists are padded with out-of-range ids (the pool sizes), so the
    kernels can scatter with mode="drop"; `num_*` says how many pairs are real.
    Named fields (generated from the declarations below):
    """
    scheduled = OutputField("slots", "bool", "the group runs this step")
    num_scheduled_tokens = OutputField("slots", "int32", "prefill chunk, or 1 for a decode")
    is_prefill = OutputField("slots", "bool", "the chunk is part of the prompt")
    num_seqs = OutputField("slots", "int32", "sequences running in this step")
    preempted = OutputField("slots", "int32", "a PreemptionMode: 0 no, RECOMPUTE or SWAP")
    preempt_order = OutputField("slots", "int32", "order of preemption within the step")
    swapped_in = OutputField("slots", "bool", "swapped in this step")
    ignored = OutputField("slots", "bool", "ignored this step")
    blocks_to_swap_out = OutputField("pairs", "int32", "(device, host) block pairs")
    blocks_to_swap_in = OutputField("pairs", "int32", "(host, device) block pairs")
    blocks_to_copy = OutputField("pairs", "int32", "(src, dst) device block pairs (copy-on-write)")
    num_swap_out = OutputField("counts", "int32", "real pairs in blocks_to_swap_out")
    num_swap_in = OutputField("counts", "int32", "real pairs in blocks_to_swap_in")
    num_copy = OutputField("counts", "int32", "real pairs in blocks_to_copy")
    num_free_device_blocks = OutputField("counts", "int32", "free device blocks after the step")
    num_free_host_blocks = OutputField("counts", "int32", "free host blocks after the step")
    block_slack = OutputField("counts", "int32", "fewest device blocks a block test had to spare "
                              "(negative: one failed; 2**30: none ran; -1 where not tracked: prefix "
                              "caching, artificial preemption)")
    seq_slack = OutputField("counts", "int32", "fewest sequences a max_num_seqs test had to spare "
                            "(likewise)")

    __slots__ = ("data", "dims")

    def __init__(self, data, dims: tuple):
        self.data, self.dims = data, dims

    def tree_flatten(self):
        return (self.data,), self.dims

    @classmethod
    def tree_unflatten(cls, dims, leaves):
        return cls(leaves[0], dims)

    @classmethod
    def pack(cls, slots: jax.Array, pairs: jax.Array, counts: jax.Array) -> SchedulerOutput:
        """From slots int32[len(SLOT_OUTPUTS), G], pairs int32[len(PAIR_OUTPUTS), P, 2] and
        counts int32[len(COUNT_OUTPUTS)]."""
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
        pairs_at = len(SLOT_OUTPUTS) * g
        if name in PAIR_OUTPUTS:
            i = pairs_at + PAIR_OUTPUTS.index(name) * 2 * p
            return self.data[..., i:i + 2 * p].reshape(lead + (p, 2))
        i = pairs_at + len(PAIR_OUTPUTS) * 2 * p + COUNT_OUTPUTS.index(name)
        return self.data[..., i]

    def _asdict(self) -> dict:
        return {n: self.get(n) for n in OUTPUT_FIELDS}

    def __repr__(self):
        return f"SchedulerOutput(data={self.data.shape}, dims={self.dims})"


_OUTPUTS = [v for v in vars(SchedulerOutput).values() if isinstance(v, OutputField)]
OUTPUT_FIELDS = tuple(f.name for f in _OUTPUTS)
SLOT_OUTPUTS = tuple(f.name for f in _OUTPUTS if f.region == "slots")
PAIR_OUTPUTS = tuple(f.name for f in _OUTPUTS if f.region == "pairs")
COUNT_OUTPUTS = tuple(f.name for f in _OUTPUTS if f.region == "counts")
_BOOL_OUTPUTS = {f.name for f in _OUTPUTS if f.kind == "bool"}
SchedulerOutput._fields = OUTPUT_FIELDS
SchedulerOutput.__doc__ += "\n".join(
    f"      {f.name}: {f.kind}[{dict(slots='G', pairs='P, 2', counts='')[f.region]}]  {f.doc}"
    for f in _OUTPUTS) + "\n"


def _limit_values(config: SchedulerConfig) -> dict:
    """The Limits field values of a config (Python numbers)."""
    return dict(num_device_blocks=config.num_device_blocks, num_host_blocks=config.num_host_blocks,
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len, watermark_blocks=config.watermark_blocks,
                preemption_mode=config.preemption_mode_id, delay_factor=config.delay_factor,
                block_size=config.block_size, **dict(zip(COST_FIELDS, config.costs.coefficients)))


def make_limits(config: SchedulerConfig) -> Limits:
    return Limits(**{k: jnp.asarray(v, _LIMIT_KINDS[k]) for k, v in _limit_values(config).items()})


def stacked_limits(configs) -> Limits:
    """The Limits of many configs of one capacity, stacked along a leading run axis (numpy
    arrays: one transfer for the batch instead of one per field per run)."""
    values = [_limit_values(c) for c in configs]
    return Limits(**{k: np.asarray([v[k] for v in values], _LIMIT_KINDS[k]) for k in LIMIT_FIELDS})


def init_state(config: SchedulerConfig) -> SchedulerState:
    """An empty scheduler: no requests, every active block free."""
    return empty_state(config.capacity(), make_limits(config), config.seed,
                       config.artificial_preemption_count)


def empty_state(cap: Capacity, limits: Limits, seed, artificial_count) -> SchedulerState:
    """`init_state` from its parts: only the capacity is static, so under `jax.jit` the
    limits, seed and artificial preemption count may be traced (a sweep builds the states
    of all its runs in one compiled call)."""
    g, s, m = cap.num_slots, cap.max_seqs_per_group, cap.max_blocks_per_seq
    zi = lambda *shape: jnp.zeros(shape, jnp.int32)
    return SchedulerState.from_fields(
        status=zi(g), finish_reason=zi(g), ignore_reason=zi(g),
        arrival_time=jnp.zeros((g,), jnp.float32), queue_key=zi(g), request_index=zi(g),
        prompt_len=zi(g), n=zi(g), max_tokens=zi(g), forked=jnp.zeros((g,), bool),
        prefill_done=zi(g), prefill_total=zi(g), num_preemptions=zi(g),
        seq_alive=jnp.zeros((g, s), bool), seq_finish_reason=zi(g, s), num_tokens=zi(g, s),
        num_blocks=zi(g, s), block_table=zi(g, s, m),
        device_ref=zi(cap.num_device_blocks + 1), host_ref=zi(cap.num_host_blocks + 1),
        tail_key=jnp.asarray(0, jnp.int32), front_key=jnp.asarray(-1, jnp.int32),
        step=jnp.asarray(0, jnp.int32),
        prev_time=jnp.asarray(0.0, jnp.float32), last_prompt_latency=jnp.asarray(0.0, jnp.float32),
        prev_admitted=jnp.asarray(False), rng=jax.random.PRNGKey(seed),
        artificial_count=jnp.asarray(artificial_count, jnp.int32),
        limits=limits,
        **(_cache_fields(cap) if cap.enable_prefix_caching else {}),
        key_bits=cap.prefix_key_bits,
    )


def _cache_fields(cap: Capacity) -> dict:
    """Empty cached pools (SPEC A10): nothing used, nothing cached, never accessed."""
    out = {"seq_key": jnp.zeros((cap.num_slots, cap.max_seqs_per_group, 2, cap.max_blocks_per_seq),
                                jnp.uint32)}
    for which, size in (("dev", cap.num_device_blocks + 1), ("host", cap.num_host_blocks + 1)):
        zeros = jnp.zeros((size,), jnp.int32)
        out |= {f"{which}_key": jnp.zeros((2, size), jnp.uint32),
                f"{which}_cached": jnp.zeros((size,), bool),
                f"{which}_last_access": jnp.full((size,), NEVER_ACCESSED, jnp.float32),
                f"{which}_hashed": zeros, f"{which}_evict_seq": zeros,
                f"{which}_num_used": jnp.int32(0), f"{which}_clock": jnp.int32(0)}
    return out


def set_limits(state: SchedulerState, config: SchedulerConfig) -> SchedulerState:
    """Run the same compiled scheduler under another config of the same capacity."""
    return state.replace(limits=make_limits(config))
