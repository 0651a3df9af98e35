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
row of `block_tables` (null-block padded). The model writes the step's K/V first, so a
prefill chunk sees itself through the cache like any older token.

`paged_attention(q, k_pool, v_pool, metadata, impl=...)` is the seam: implementations live in
a registry, so a Pallas kernel registers under a new name and callers pick it by `impl`.
"""

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxsched.kv_cache import PAD_ID

_MASKED = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN
_CHUNK_BYTES = 1 << 20  # K bytes gathered per scan step in the chunked kernel


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
        are finite garbage: they attend to key 0 of row seq_ids[t]).
    """

    slot_mapping: jax.Array
    positions: jax.Array
    seq_ids: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    logits_indices: jax.Array
    num_valid: jax.Array


AttentionImpl = Callable[[jax.Array, jax.Array, jax.Array, AttentionMetadata], jax.Array]
_IMPLS: dict[str, AttentionImpl] = {}


def register_attention_impl(name: str):
    """Decorator: make `fn(q, k_pool, v_pool, metadata) -> out` selectable as `impl=name`."""

    def register(fn: AttentionImpl) -> AttentionImpl:
        _IMPLS[name] = fn
        return fn

    return register


def paged_attention(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, metadata: AttentionMetadata, impl: str = "chunked"
) -> jax.Array:
    """Causal GQA attention of T query tokens over one layer of the paged cache.

    q: [T, H, D]; k_pool, v_pool: [num_blocks, block_size, H_kv, D], one layer (`KVCache.layer`).
    Returns [T, H, D] in q's dtype. H must be a multiple of H_kv; scale is 1/sqrt(D);
    scores and softmax are float32. `impl` is static: "chunked" (default) or "reference".
    """
    if q.shape[1] % k_pool.shape[2]:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_pool.shape[2]}")
    return _IMPLS[impl](q, k_pool, v_pool, metadata)


def _group_heads(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[T, H, D] -> [T, H_kv, G, D]: query head h uses kv head h // G (HF's repeat_kv)."""
    t, h, d = q.shape
    return q.reshape(t, num_kv_heads, h // num_kv_heads, d)


@register_attention_impl("reference")
def reference_attention(q, k_pool, v_pool, metadata: AttentionMetadata) -> jax.Array:
    """Gather every token's whole context ([T, max_ctx, H_kv, D]) and attend with einsums.

    The plainest statement of the semantics; memory grows with T * max_ctx.
    """
    t, h, d = q.shape
    _, block_size, num_kv_heads, _ = k_pool.shape
    rows = metadata.block_tables[metadata.seq_ids]  # [T, max_blocks]
    k = k_pool[rows].reshape(t, -1, num_kv_heads, d)  # [T, C, H_kv, D]
    v = v_pool[rows].reshape(t, -1, num_kv_heads, d)
    qg = _group_heads(q, num_kv_heads)
    s = jnp.einsum("tkgd,tckd->tkgc", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    visible = jnp.arange(k.shape[1])[None, :] <= metadata.positions[:, None]  # [T, C]
    s = jnp.where(visible[:, None, None, :], s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("tkgc,tckd->tkgd", p, v.astype(jnp.float32))
    return out.reshape(t, h, d).astype(q.dtype)


@register_attention_impl("chunked")
def chunked_attention(q, k_pool, v_pool, metadata: AttentionMetadata) -> jax.Array:
    """Per-token attention reading K/V a chunk of blocks at a time (the decode fast path).

    Never materialises the gathered [T, max_ctx, H_kv, D] context, only [T, C, H] scores.
    """
    rows = metadata.block_tables[metadata.seq_ids]
    return _chunked(q, k_pool, v_pool, rows, metadata.positions + 1)


def paged_decode_attention(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, block_tables: jax.Array, context_lens: jax.Array
) -> jax.Array:
    """One query per sequence (q: [S, H, D]) at position context_lens - 1. Returns [S, H, D]."""
    return _chunked(q, k_pool, v_pool, block_tables, context_lens)


def _chunked(q, k_pool, v_pool, rows, num_visible):
    """Two passes over chunks of `rows` [T, max_blocks]: scores, then softmax-weighted values.

    Each step gathers [T, chunk, H_kv, D] (about _CHUNK_BYTES) and reduces it at once, so the
    pools are read once from memory and the gathered copy stays in cache. The score product
    is a fused multiply-reduce: with few query heads per kv head it beats a batched matmul.
    """
    t, h, d = q.shape
    _, block_size, num_kv_heads, _ = k_pool.shape
    block_bytes = t * block_size * num_kv_heads * d * k_pool.dtype.itemsize  # one block column
    num_chunks = -(-rows.shape[1] * block_bytes // _CHUNK_BYTES)
    chunk = -(-rows.shape[1] // num_chunks)  # balanced: pads fewer than num_chunks blocks
    num_chunks = -(-rows.shape[1] // chunk)
    rows = jnp.pad(rows, ((0, 0), (0, num_chunks * chunk - rows.shape[1])))  # null blocks
    rows = rows.reshape(t, num_chunks, chunk).transpose(1, 0, 2)  # [n, T, chunk]
    qg = _group_heads(q.astype(jnp.float32), num_kv_heads)[:, None] / math.sqrt(d)  # [T,1,Hkv,G,D]

    def gather(pool, ids):  # [T, chunk] -> [T, chunk * block_size, H_kv, 1, D] float32
        return pool[ids].reshape(t, -1, num_kv_heads, 1, d).astype(jnp.float32)

    def scores(_, ids):
        return None, (qg * gather(k_pool, ids)).sum(-1)  # [T, c, H_kv, G]

    _, s = jax.lax.scan(scores, None, rows)  # [n, T, c, H_kv, G]
    key_pos = jnp.arange(num_chunks * chunk * block_size).reshape(num_chunks, 1, -1, 1, 1)
    s = jnp.where(key_pos < num_visible[None, :, None, None, None], s, _MASKED)
    m = s.max(axis=(0, 2), keepdims=True)
    p = jnp.exp(s - m)
    denom = p.sum(axis=(0, 2))  # [T, H_kv, G]

    def weighted_values(acc, xs):
        ids, p_chunk = xs
        return acc + (p_chunk[..., None] * gather(v_pool, ids)).sum(1), None

    acc0 = jnp.zeros((t, num_kv_heads, h // num_kv_heads, d), jnp.float32)
    acc, _ = jax.lax.scan(weighted_values, acc0, (rows, p))
    return (acc / denom[..., None]).reshape(t, h, d).astype(q.dtype)


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
