"""Paged attention over the KV cache for a flat, ragged batch of tokens.

A step's tokens are laid out flat, whatever phase their sequence is in (T and S are padded
to buckets, see `bucket`)::

    token t        0  1  2  3 | 4 | 5  6 | 7  (pad)
    seq_ids        0  0  0  0 | 1 | 2  2 | 0
    positions      0  1  2  3 | 9 | 4  5 | 0
                   prefill      decode  chunk of a prefill
    slot_mapping   where token t's K/V is written: block_tables[s][p // bs] * bs + p % bs,
                   PAD_ID for padding (dropped by the scatter)

Token t attends to keys 0..positions[t] of sequence seq_ids[t], read through that sequence's
row of `block_tables` (null-block padded).

Two ways to call it, with the same results:

* `paged_attention(q, k_pool, v_pool, metadata)`: the pools already hold every key the step
  needs, the step's own included (write first, then read).
* `paged_attention(..., new=StepKV(k, v, visibility))`: the pools hold only what earlier steps
  wrote, and the step's own K/V come beside them. This is how the model runs: the engine
  chooses the token bucket with a `lax.switch`, and a pool written inside a branch is copied
  whole into every branch by XLA; read-only, it is shared. The engine writes all layers'
  new K/V once, after the switch. `step_visibility` says, once per step, which pool slots
  each token may read (its context minus the slots this step writes) and which of the
  step's tokens it sees (those whose slot its block table maps at a position <= its own):
  by physical slot, so a forked group's sequences see the shared prompt blocks another row
  writes in the same step, exactly as if they were read through the pool.

The seam: implementations live in a registry (`register_attention_impl`), so a Pallas kernel
registers under a new name and callers pick it by `impl`. The model passes the whole
multi-layer pools ([num_blocks, L, block_size, H_kv, D]) and its layer index, and kernels
gather `pool[block_ids, layer]` directly: slicing one layer out first (`pool[:, layer]`) is a
strided copy of the whole pool per layer, which cost more than the attention itself at short
contexts.
"""

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxsched.cache.kv_cache import PAD_ID

_MASKED = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN
_CHUNK_BYTES = 1 << 20  # K bytes gathered per scan step in the chunked kernel
_TOKEN_GROUP = 32  # tokens that share one loop over cached chunks (and its trip count)


@struct.dataclass
class AttentionMetadata:
    """Where each token of the flat batch writes, and what it reads.

    Attributes:
      slot_mapping: int32[T]  flat cache slot of token t's K/V; PAD_ID for padding tokens.
      positions: int32[T]  position of token t in its sequence (0 for padding).
      seq_ids: int32[T]  row of `block_tables` for token t (any valid row for padding).
      block_tables: int32[S, max_blocks]  device block ids per sequence, null(0)-padded.
      context_lens: int32[S]  tokens of each sequence in the cache after this step's writes.
      logits_indices: int32[num_sample]  tokens whose logits are returned (last of each chunk).
      num_valid: int32[]  tokens [0, num_valid) are real; the rest are padding (their outputs
        are finite garbage).
    """

    slot_mapping: jax.Array
    positions: jax.Array
    seq_ids: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    logits_indices: jax.Array
    num_valid: jax.Array


class Visibility(NamedTuple):
    """Which keys each token of a step sees when its own K/V are not in the pools yet.

    cached: bool[T, max_blocks * block_size]  key c of token t's block-table row is in the
      pool and visible (c <= positions[t], and this step does not write its slot).
    new: bool[T, T]  token t sees token u's new key (u is real, and t's row maps
      positions[u] to the slot u writes, at a position <= positions[t]).
    """
    cached: jax.Array
    new: jax.Array


class StepKV(NamedTuple):
    """One layer's K/V of the step's own tokens ([T, H_kv, D] each) and their `Visibility`."""
    k: jax.Array
    v: jax.Array
    visible: Visibility


def step_visibility(metadata: AttentionMetadata, block_size: int, num_pool_blocks: int) -> Visibility:
    """The masks of `StepKV`, computed once per step (every layer shares them)."""
    t = metadata.positions.shape[0]
    rows = metadata.block_tables[metadata.seq_ids]                      # [T, max_blocks]
    valid = jnp.arange(t) < metadata.num_valid
    written = jnp.zeros((num_pool_blocks * block_size,), bool).at[metadata.slot_mapping].set(True, mode="drop")
    c = jnp.arange(rows.shape[1] * block_size)
    ctx_slot = rows[:, c // block_size] * block_size + c % block_size     # [T, C]
    cached = (c[None, :] <= metadata.positions[:, None]) & ~written[ctx_slot]
    key_pos = metadata.positions[None, :]                               # [1, T] position of key u
    key_block = jnp.take_along_axis(rows, jnp.clip(key_pos // block_size, 0, rows.shape[1] - 1), axis=1)
    maps_to_key = key_block * block_size + key_pos % block_size == metadata.slot_mapping[None, :]
    new = valid[None, :] & (key_pos <= metadata.positions[:, None]) & maps_to_key
    return Visibility(cached=cached, new=new)


AttentionImpl = Callable[..., jax.Array]
_IMPLS: dict[str, AttentionImpl] = {}


def register_attention_impl(name: str):
    """Decorator: make `fn(q, k_pool, v_pool, metadata, layer, new) -> out` selectable as `impl=name`.

    `layer` is None for one-layer pools; `new` is None (pools hold everything) or a StepKV.
    """

    def register(fn: AttentionImpl) -> AttentionImpl:
        _IMPLS[name] = fn
        return fn

    return register


def paged_attention(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, metadata: AttentionMetadata, impl: str = "chunked",
    layer: int | jax.Array | None = None, new: Optional[StepKV] = None,
) -> jax.Array:
    """Causal GQA attention of T query tokens over one layer of the paged cache.

    q: [T, H, D]. k_pool, v_pool: one layer, [num_blocks, block_size, H_kv, D], when `layer`
    is None; else the whole cache's pools [num_blocks, L, block_size, H_kv, D] and `layer`
    picks the layer. `new`: the step's own K/V when the pools do not hold them yet (see the
    module docstring). Returns [T, H, D] in q's dtype. H must be a multiple of H_kv; scale is
    1/sqrt(D); scores and softmax are float32. `impl` is static: "chunked" (default) or
    "reference".
    """
    num_kv_heads = k_pool.shape[-2]
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    return _IMPLS[impl](q, k_pool, v_pool, metadata, layer, new)


def take_blocks(pool: jax.Array, ids: jax.Array, layer: int | jax.Array | None) -> jax.Array:
    """pool[ids] of a one-layer pool, or pool[ids, layer] of a multi-layer one: [*ids.shape, bs, H_kv, D].

    One gather of contiguous block_size * H_kv * D rows either way.
    """
    # Gathered as rows of a 2-D [slots, H_kv * D] view: XLA:CPU copies [1, n] slices in
    # vectorised runs, [block_size, H_kv, D] ones element by element (measured 1.5-2x
    # slower). Heads stay the major part of a row, so a pool sharded by kv head stays sharded.
    block_size, num_kv_heads, head_dim = pool.shape[-3:]
    layers = 1 if layer is None else pool.shape[1]
    first = (ids * layers + (0 if layer is None else layer)) * block_size     # [*ids.shape]
    slots = first[..., None] + jnp.arange(block_size)                         # [*ids.shape, bs]
    rows = pool.reshape(-1, num_kv_heads * head_dim)[slots]
    return rows.reshape(ids.shape + (block_size, num_kv_heads, head_dim))


def _group_heads(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[T, H, D] -> [T, H_kv, G, D]: query head h uses kv head h // G (HF's repeat_kv)."""
    t, h, d = q.shape
    return q.reshape(t, num_kv_heads, h // num_kv_heads, d)


def _cached_mask(metadata: AttentionMetadata, new: Optional[StepKV], num_keys: int) -> jax.Array:
    """bool[T, num_keys]: which keys of each token's row it reads from the pool."""
    if new is not None:
        return new.visible.cached
    return jnp.arange(num_keys)[None, :] <= metadata.positions[:, None]


@register_attention_impl("reference")
def reference_attention(q, k_pool, v_pool, metadata: AttentionMetadata, layer=None, new=None) -> jax.Array:
    """Gather every token's whole context ([T, max_ctx, H_kv, D]) and attend with einsums.

    The plainest statement of the semantics; memory grows with T * max_ctx. The step's own
    keys, when given apart, join the context as T more columns.
    """
    t, h, d = q.shape
    num_kv_heads = k_pool.shape[-2]
    rows = metadata.block_tables[metadata.seq_ids]  # [T, max_blocks]
    k = take_blocks(k_pool, rows, layer).reshape(t, -1, num_kv_heads, d)  # [T, C, H_kv, D]
    v = take_blocks(v_pool, rows, layer).reshape(t, -1, num_kv_heads, d)
    visible = _cached_mask(metadata, new, k.shape[1])                     # [T, C]
    if new is not None:
        k = jnp.concatenate([k, jnp.broadcast_to(new.k[None], (t,) + new.k.shape).astype(k.dtype)], axis=1)
        v = jnp.concatenate([v, jnp.broadcast_to(new.v[None], (t,) + new.v.shape).astype(v.dtype)], axis=1)
        visible = jnp.concatenate([visible, new.visible.new], axis=1)
    qg = _group_heads(q, num_kv_heads)
    s = jnp.einsum("tkgd,tckd->tkgc", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    s = jnp.where(visible[:, None, None, :], s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("tkgc,tckd->tkgd", p, v.astype(jnp.float32))
    return out.reshape(t, h, d).astype(q.dtype)


@register_attention_impl("chunked")
def chunked_attention(q, k_pool, v_pool, metadata: AttentionMetadata, layer=None, new=None) -> jax.Array:
    """Per-token attention reading K/V a chunk of blocks at a time (the decode fast path).

    Never materialises the gathered [T, max_ctx, H_kv, D] context, only [T, C, H] scores.
    The step's own keys, when given apart, are a [T, T] block of scores merged in by their
    softmax statistics.
    """
    t, h, d = q.shape
    rows = metadata.block_tables[metadata.seq_ids]
    qg = _group_heads(q.astype(jnp.float32), k_pool.shape[-2]) / math.sqrt(d)   # [T, H_kv, G, D]
    visible = _cached_mask(metadata, new, rows.shape[1] * k_pool.shape[-3])
    parts = [_grouped_partial(qg, k_pool, v_pool, rows, visible, layer)]
    if new is not None:
        parts.append(_new_partial(qg, new))
    return _merge(parts).reshape(t, h, d).astype(q.dtype)


def paged_decode_attention(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, block_tables: jax.Array, context_lens: jax.Array,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """One query per sequence (q: [S, H, D]) at position context_lens - 1. Returns [S, H, D]."""
    s, h, d = q.shape
    qg = _group_heads(q.astype(jnp.float32), k_pool.shape[-2]) / math.sqrt(d)
    visible = jnp.arange(block_tables.shape[1] * k_pool.shape[-3])[None, :] < context_lens[:, None]
    out = _merge([_grouped_partial(qg, k_pool, v_pool, block_tables, visible, layer)])
    return out.reshape(s, h, d).astype(q.dtype)


class _Partial(NamedTuple):
    """Unnormalised attention over some keys: sum_k exp(s_k - m) v_k, the max m, sum_k exp(s_k - m)."""
    acc: jax.Array    # float32[T, H_kv, G, D]
    m: jax.Array      # float32[T, H_kv, G]
    denom: jax.Array  # float32[T, H_kv, G]


def _merge(parts: list[_Partial]) -> jax.Array:
    """Softmax-weighted values over the union of the parts' keys: float32[T, H_kv, G, D]."""
    m = parts[0].m
    for part in parts[1:]:
        m = jnp.maximum(m, part.m)
    scales = [jnp.exp(part.m - m) for part in parts]
    acc = sum(part.acc * scale[..., None] for part, scale in zip(parts, scales))
    denom = sum(part.denom * scale for part, scale in zip(parts, scales))
    return acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # 0: a padding row that sees nothing


def _new_partial(qg: jax.Array, new: StepKV) -> _Partial:
    """Attention of the step's tokens over the step's own keys (qg: [T, H_kv, G, D], scaled)."""
    s = jnp.einsum("tkgd,ukd->tkgu", qg, new.k.astype(jnp.float32))
    s = jnp.where(new.visible.new[:, None, None, :], s, _MASKED)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    return _Partial(jnp.einsum("tkgu,ukd->tkgd", p, new.v.astype(jnp.float32)), m, p.sum(-1))


def _grouped_partial(qg, k_pool, v_pool, rows, visible, layer) -> _Partial:
    """`_chunked_partial` over groups of _TOKEN_GROUP consecutive tokens, one after another.

    Each group loops only as far as its own longest cached context, so in a step that mixes
    decodes of long sequences with fresh prefill chunks the prefill tokens do not gather the
    decodes' contexts (the engine's flat batch puts decodes first, so they share groups).
    `lax.map` keeps one loop body for all groups: smaller programs, and XLA:CPU's first-run
    cost is paid once per layer, not per group. Tokens past T are padding that sees nothing.
    """
    t = qg.shape[0]
    if t <= _TOKEN_GROUP:
        return _chunked_partial(qg, k_pool, v_pool, rows, visible, layer)
    groups = -(-t // _TOKEN_GROUP)
    pad = groups * _TOKEN_GROUP - t

    def split(x):
        x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
        return x.reshape((groups, _TOKEN_GROUP) + x.shape[1:])

    out = jax.lax.map(lambda xs: _chunked_partial(xs[0], k_pool, v_pool, xs[1], xs[2], layer),
                      (split(qg), split(rows), split(visible)))
    return _Partial(*(x.reshape((groups * _TOKEN_GROUP,) + x.shape[2:])[:t] for x in out))


def _chunked_partial(qg, k_pool, v_pool, rows, visible, layer) -> _Partial:
    """One pass over chunks of `rows` [T, max_blocks] with a running softmax (flash style).

    qg: [T, H_kv, G, D] float32, scaled; visible: bool[T, max_blocks * block_size].
    Each iteration gathers a chunk of blocks of K and of V for every token (about
    _CHUNK_BYTES each), so the gathered copies stay in cache, and folds it into the running
    max, denominator and values. The loop stops after the last chunk that any token can see:
    its cost follows the longest context actually in the step, not the block-table width
    (max_model_len), and a step whose tokens have nothing cached (fresh prefills) gathers
    nothing. The score product is a fused multiply-reduce: with few query heads per kv head
    it beats a batched matmul.
    """
    t, num_kv_heads, g, d = qg.shape
    block_size = k_pool.shape[-3]
    block_bytes = t * block_size * num_kv_heads * d * k_pool.dtype.itemsize  # one block column
    num_chunks = -(-rows.shape[1] * block_bytes // _CHUNK_BYTES)
    chunk = -(-rows.shape[1] // num_chunks)  # balanced: pads fewer than num_chunks blocks
    num_chunks = -(-rows.shape[1] // chunk)
    pad = num_chunks * chunk - rows.shape[1]
    rows = jnp.pad(rows, ((0, 0), (0, pad)))  # null blocks
    rows = rows.reshape(t, num_chunks, chunk).transpose(1, 0, 2)  # [n, T, chunk]
    keys = chunk * block_size
    visible = jnp.pad(visible, ((0, 0), (0, pad * block_size)))
    last_key = jnp.max(jnp.where(visible, jnp.arange(visible.shape[1]), -1))
    needed = (last_key + keys) // keys  # chunks up to the last visible key (0 if none)
    visible = visible.reshape(t, num_chunks, keys).transpose(1, 0, 2)[..., None, None]  # [n, T, c, 1, 1]
    qg = qg[:, None]  # [T, 1, H_kv, G, D]

    def gather(pool, ids):  # [T, chunk] -> [T, chunk * block_size, H_kv, 1, D] float32
        return take_blocks(pool, ids, layer).reshape(t, -1, num_kv_heads, 1, d).astype(jnp.float32)

    def body(i, carry):
        acc, m, denom = carry
        ids = rows[i]
        s = (qg * gather(k_pool, ids)).sum(-1)                          # [T, c, H_kv, G]
        s = jnp.where(visible[i], s, _MASKED)
        m_new = jnp.maximum(m, s.max(1))
        scale = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        acc = acc * scale[..., None] + (p[..., None] * gather(v_pool, ids)).sum(1)
        return acc, m_new, denom * scale + p.sum(1)

    carry = (jnp.zeros((t, num_kv_heads, g, d), jnp.float32), jnp.full((t, num_kv_heads, g), _MASKED, jnp.float32),
             jnp.zeros((t, num_kv_heads, g), jnp.float32))
    return _Partial(*jax.lax.fori_loop(0, needed, body, carry))


# ----------------------------------------------------------------------------- static shapes


def bucket(n: int, max_n: int, min_n: int = 8) -> int:
    """Smallest power of two >= n (at least min_n), capped at max_n: the padded size of n."""
    if n > max_n:
        raise ValueError(f"{n} exceeds the largest bucket {max_n}")
    return min(max_n, max(min_n, 1 << max(0, n - 1).bit_length()))


def make_metadata(
    block_tables: list[list[int]],
    num_computed: list[int],
    num_new: list[int],
    block_size: int,
    max_blocks: int,
    num_tokens: int,
    num_seqs: int,
    pad_id: int = PAD_ID,
) -> AttentionMetadata:
    """Host-side builder: sequence i gets tokens num_computed[i] .. num_computed[i]+num_new[i]-1.

    Sequences with num_new == 0 are skipped. `num_tokens` / `num_seqs` are the padded T and S
    (see `bucket`); block tables must already cover the new tokens. Logits are taken at each
    scheduled sequence's last new token; padding rows point at token 0.
    """
    seq_ids, positions, slots, logits_indices = [], [], [], []
    for s, (table, start, count) in enumerate(zip(block_tables, num_computed, num_new)):
        for p in range(start, start + count):
            seq_ids.append(s)
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        if count:
            logits_indices.append(len(seq_ids) - 1)
    num_valid = len(seq_ids)
    if num_valid > num_tokens or len(block_tables) > num_seqs:
        raise ValueError(f"{num_valid} tokens / {len(block_tables)} seqs exceed {num_tokens} / {num_seqs}")
    pad = num_tokens - num_valid
    tables = np.zeros((num_seqs, max_blocks), np.int32)
    for s, table in enumerate(block_tables):
        tables[s, : len(table)] = table
    context_lens = np.zeros(num_seqs, np.int32)
    context_lens[: len(block_tables)] = np.add(num_computed, num_new)
    return AttentionMetadata(
        slot_mapping=jnp.asarray(slots + [pad_id] * pad, jnp.int32),
        positions=jnp.asarray(positions + [0] * pad, jnp.int32),
        seq_ids=jnp.asarray(seq_ids + [0] * pad, jnp.int32),
        block_tables=jnp.asarray(tables),
        context_lens=jnp.asarray(context_lens),
        logits_indices=jnp.asarray(logits_indices + [0] * (num_seqs - len(logits_indices)), jnp.int32),
        num_valid=jnp.asarray(num_valid, jnp.int32),
    )
