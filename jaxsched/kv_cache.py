"""Paged KV cache: device block pools, a host block pool, and the jitted kernels that move blocks.

Layout of one pool (K and V each have one, device and host alike)::

    pool[layer, block, offset, kv_head, :]      shape [L, num_blocks, block_size, H_kv, D]
          |      '------.------'
          |        flat slot = block * block_size + offset   (what `slot_mapping` holds)
          '- all layers stacked, so one gather `pool[:, ids]` moves a block for every layer

Block 0 is the null block: block tables are padded with it and it is never handed out, so
reading it is harmless and nobody's data lives there. Padding *writes* never touch it: they
use `PAD_ID`, an index past every pool, and every scatter runs with `mode="drop"`.
(`-1` would wrap to the last block and overwrite a real one.)

The host pool lives in pinned host memory where the backend has that memory kind (detected
once per device by `host_memory_kind`); elsewhere it is an ordinary device array and the same
code runs with the transfers as no-ops. Swaps gather on the side that holds the source, move
the staged [L, P, block_size, H_kv, D] chunk with one `jax.device_put`, and scatter on the
side that holds the destination. Every kernel donates the cache, so it updates in place.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental.compute_on import compute_on

PAD_ID = int(np.iinfo(np.int32).max)  # padding slot / block id: out of range for every pool
NULL_BLOCK = 0


@struct.dataclass
class KVCache:
    """Paged K/V pools for every layer.

    Attributes:
      k: [L, num_device_blocks, block_size, H_kv, D] keys, device memory.
      v: [L, num_device_blocks, block_size, H_kv, D] values, device memory.
      host_k: [L, num_host_blocks, block_size, H_kv, D] swapped-out keys, host memory.
      host_v: [L, num_host_blocks, block_size, H_kv, D] swapped-out values, host memory.
      host_memory_kind: static; "pinned_host", or None where the host pool is a device array.
    """

    k: jax.Array
    v: jax.Array
    host_k: jax.Array
    host_v: jax.Array
    host_memory_kind: str | None = struct.field(pytree_node=False, default=None)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_device_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def num_host_blocks(self) -> int:
        return self.host_k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1] * self.k.shape[2]


@functools.cache
def host_memory_kind(device: jax.Device | None = None) -> str | None:
    """"pinned_host" if `device` can address pinned host memory, else None. Computed once."""
    device = device or jax.devices()[0]
    kinds = {memory.kind for memory in device.addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else None


def init_kv_cache(
    num_layers: int,
    num_device_blocks: int,
    num_host_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.float32,
    device: jax.Device | None = None,
) -> KVCache:
    """Zeroed pools. `num_device_blocks` counts the null block; host block ids start at 0.

    At least one host block is allocated, so the swap kernels always have a pool to index.
    """
    device = device or jax.devices()[0]
    kind = host_memory_kind(device)
    on_device = jax.sharding.SingleDeviceSharding(device)
    on_host = jax.sharding.SingleDeviceSharding(device, memory_kind=kind) if kind else on_device
    dev_shape = (num_layers, num_device_blocks, block_size, num_kv_heads, head_dim)
    host_shape = (num_layers, max(num_host_blocks, 1), block_size, num_kv_heads, head_dim)
    zeros_dev = jax.jit(lambda: jnp.zeros(dev_shape, dtype), out_shardings=on_device)
    # Host pool: zeros made on the host and put straight there, never staged on the device.
    return KVCache(
        k=zeros_dev(),
        v=zeros_dev(),
        host_k=jax.device_put(np.zeros(host_shape, dtype), on_host),
        host_v=jax.device_put(np.zeros(host_shape, dtype), on_host),
        host_memory_kind=kind,
    )


# ----------------------------------------------------------------------------- placement


def _to_host(x: jax.Array, kind: str | None) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Host) if kind else x


def _to_device(x: jax.Array, kind: str | None) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device) if kind else x


def _on_host(kind: str | None):
    """Context in which ops on host-resident arrays run on the host, not after a copy."""
    return compute_on("device_host") if kind else contextlib.nullcontext()


# ----------------------------------------------------------------------------- kernels


def write_kv(
    cache: KVCache, layer: jax.Array | int, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> KVCache:
    """Scatter T new tokens' K/V ([T, H_kv, D]) of one layer into flat slots [T].

    Unjitted building block (the model calls it inside its own jit); `write` is the jitted,
    donating kernel. Slots >= num_slots (e.g. PAD_ID) are dropped.
    """
    num_layers, num_blocks, block_size = cache.k.shape[:3]
    flat_shape = (num_layers, num_blocks * block_size) + cache.k.shape[3:]
    new_k = cache.k.reshape(flat_shape).at[layer, slot_mapping].set(k.astype(cache.k.dtype), mode="drop")
    new_v = cache.v.reshape(flat_shape).at[layer, slot_mapping].set(v.astype(cache.v.dtype), mode="drop")
    return cache.replace(k=new_k.reshape(cache.k.shape), v=new_v.reshape(cache.v.shape))


write = jax.jit(write_kv, donate_argnums=0)


def _valid_pairs(pairs: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(src, dst) of [P, 2] pairs; pairs at index >= count get dst = PAD_ID (dropped)."""
    valid = jnp.arange(pairs.shape[0]) < count
    return pairs[:, 0], jnp.where(valid, pairs[:, 1], PAD_ID)


def _gather_blocks(pool: jax.Array, ids: jax.Array) -> jax.Array:
    # Out-of-range source ids only occur in padding pairs, whose dst is dropped: clip is safe.
    return jnp.take(pool, ids, axis=1, mode="clip")


def _scatter_blocks(pool: jax.Array, ids: jax.Array, blocks: jax.Array) -> jax.Array:
    return pool.at[:, ids].set(blocks, mode="drop")


@functools.partial(jax.jit, donate_argnums=0)
def copy_blocks(cache: KVCache, pairs: jax.Array, count: jax.Array) -> KVCache:
    """Copy-on-write: device block pairs[i, 0] -> pairs[i, 1] for i < count, every layer.

    pairs: int32[P, 2] (src, dst), padded (with PAD_ID or anything: rows >= count are dropped).
    All sources are read before any destination is written.
    """
    src, dst = _valid_pairs(pairs, count)
    k = _scatter_blocks(cache.k, dst, _gather_blocks(cache.k, src))
    v = _scatter_blocks(cache.v, dst, _gather_blocks(cache.v, src))
    return cache.replace(k=k, v=v)


@functools.partial(jax.jit, donate_argnums=0)
def swap_out(cache: KVCache, pairs: jax.Array, count: jax.Array) -> KVCache:
    """Copy device blocks pairs[i, 0] to host blocks pairs[i, 1] for i < count, every layer.

    Gathers on device, moves the staged chunk to host memory, scatters into the host pool there.
    """
    src, dst = _valid_pairs(pairs, count)
    kind = cache.host_memory_kind
    staged_k = _to_host(_gather_blocks(cache.k, src), kind)
    staged_v = _to_host(_gather_blocks(cache.v, src), kind)
    dst = _to_host(dst, kind)
    with _on_host(kind):
        host_k = _scatter_blocks(cache.host_k, dst, staged_k)
        host_v = _scatter_blocks(cache.host_v, dst, staged_v)
    return cache.replace(host_k=host_k, host_v=host_v)


@functools.partial(jax.jit, donate_argnums=0)
def swap_in(cache: KVCache, pairs: jax.Array, count: jax.Array) -> KVCache:
    """Copy host blocks pairs[i, 0] to device blocks pairs[i, 1] for i < count, every layer.

    Gathers on the host, moves the staged chunk to the device, scatters into the device pool.
    """
    src, dst = _valid_pairs(pairs, count)
    kind = cache.host_memory_kind
    src = _to_host(src, kind)
    with _on_host(kind):
        staged_k = _gather_blocks(cache.host_k, src)
        staged_v = _gather_blocks(cache.host_v, src)
    k = _scatter_blocks(cache.k, dst, _to_device(staged_k, kind))
    v = _scatter_blocks(cache.v, dst, _to_device(staged_v, kind))
    return cache.replace(k=k, v=v)
