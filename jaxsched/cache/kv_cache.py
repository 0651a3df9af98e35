"""Paged KV cache: device block pools, a host block pool, and the jitted kernels that move blocks.

Layout of one pool (K and V each have one, device and host alike)::

    pool[block, layer, offset, kv_head, :]      shape [num_blocks, L, block_size, H_kv, D]
           |             flat slot = block * block_size + offset   (what `slot_mapping` holds)
           '- block-major: one block of every layer is one contiguous chunk

Block-major rather than layer-major ([L, num_blocks, ...]) because blocks are what moves:
a swap or copy-on-write moves one contiguous chunk per block instead of L strided pieces
(swaps measured about 2x faster on CPU), while attention reads one layer's blocks as
block_size * H_kv * D contiguous rows either way (`pool[:, layer]` fuses into the gather).

Block 0 is the null block: block tables are padded with it and it is never handed out, so
reading it is harmless and nobody's data lives there. Padding *writes* never touch it: they
use `PAD_ID`, an index past every pool, and scatters run with `mode="drop"`.
(`-1` would wrap to the last block and overwrite a real one.)

The host pool lives in pinned host memory where the backend has that memory kind (detected
once per device by `host_memory_kind`); elsewhere it is an ordinary device array and the same
code runs with the transfers as no-ops. A swap copies block by block: slice the source block
where it lives, `jax.device_put` it to the other memory space, and `dynamic_update_slice` it
into the destination pool there (the pattern XLA's host offloading turns into DMAs). Every
kernel donates the cache, so pools are updated in place.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

PAD_ID = int(np.iinfo(np.int32).max)  # padding slot / block id: out of range for every pool
NULL_BLOCK = 0


@struct.dataclass
class KVCache:
    """Paged K/V pools for every layer.

    Attributes:
      k: [num_device_blocks, L, block_size, H_kv, D] keys, device memory.
      v: [num_device_blocks, L, block_size, H_kv, D] values, device memory.
      host_k: [num_host_blocks, L, block_size, H_kv, D] swapped-out keys, host memory.
      host_v: [num_host_blocks, L, block_size, H_kv, D] swapped-out values, host memory.
      host_memory_kind: static; "pinned_host", or None where the host pool is a device array.
    """

    k: jax.Array
    v: jax.Array
    host_k: jax.Array
    host_v: jax.Array
    host_memory_kind: str | None = struct.field(pytree_node=False, default=None)

    @property
    def num_device_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def num_layers(self) -> int:
        return self.k.shape[1]

    @property
    def num_host_blocks(self) -> int:
        return self.host_k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def layer(self, layer: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        """One layer's device pools, each [num_device_blocks, block_size, H_kv, D]."""
        return self.k[:, layer], self.v[:, layer]


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
    dev_shape = (num_device_blocks, num_layers, block_size, num_kv_heads, head_dim)
    host_shape = (max(num_host_blocks, 1), num_layers, block_size, num_kv_heads, head_dim)
    zeros_dev = jax.jit(lambda: jnp.zeros(dev_shape, dtype), out_shardings=on_device)
    # Host pool: zeros made on the host and put straight there, never staged on the device.
    return KVCache(
        k=zeros_dev(),
        v=zeros_dev(),
        host_k=jax.device_put(np.zeros(host_shape, dtype), on_host),
        host_v=jax.device_put(np.zeros(host_shape, dtype), on_host),
        host_memory_kind=kind,
    )


# ----------------------------------------------------------------------------- kernels


def write_kv(
    cache: KVCache, layer: jax.Array | int, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> KVCache:
    """Scatter T new tokens' K/V ([T, H_kv, D]) of one layer into flat slots [T].

    Unjitted building block (the model calls it inside its own jit); `write` is the jitted,
    donating kernel. Slots past the pool (e.g. PAD_ID) are dropped.
    """
    block, offset = slot_mapping // cache.block_size, slot_mapping % cache.block_size
    new_k = cache.k.at[block, layer, offset].set(k.astype(cache.k.dtype), mode="drop")
    new_v = cache.v.at[block, layer, offset].set(v.astype(cache.v.dtype), mode="drop")
    return cache.replace(k=new_k, v=new_v)


write = jax.jit(write_kv, donate_argnums=0)


def write_layers(cache: KVCache, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVCache:
    """Scatter T tokens' K/V of every layer ([L, T, H_kv, D]) into flat slots [T] at once.

    What the engine does after the model, which only reads the pools (see
    jaxsched.attention's StepKV). Unjitted building block; slots past the pool are dropped.
    """
    block, offset = slot_mapping // cache.block_size, slot_mapping % cache.block_size
    layer = jnp.arange(k.shape[0])[:, None]
    new_k = cache.k.at[block[None, :], layer, offset[None, :]].set(k.astype(cache.k.dtype), mode="drop")
    new_v = cache.v.at[block[None, :], layer, offset[None, :]].set(v.astype(cache.v.dtype), mode="drop")
    return cache.replace(k=new_k, v=new_v)


@functools.partial(jax.jit, donate_argnums=0)
def copy_blocks(cache: KVCache, pairs: jax.Array, count: jax.Array) -> KVCache:
    """Copy-on-write: device block pairs[i, 0] -> pairs[i, 1] for i < count, every layer.

    pairs: int32[P, 2] (src, dst), padded (with PAD_ID or anything: rows >= count are dropped).
    All sources are read before any destination is written.
    """
    valid = jnp.arange(pairs.shape[0]) < count
    src, dst = pairs[:, 0], jnp.where(valid, pairs[:, 1], PAD_ID)

    def copy(pools):
        # Out-of-range sources only occur in padding rows, whose writes are dropped: clip is safe.
        return tuple(p.at[dst].set(jnp.take(p, src, axis=0, mode="clip"), mode="drop") for p in pools)

    # Most steps copy nothing: skip gathering the padded pair list then.
    k, v = jax.lax.cond(count > 0, copy, lambda pools: pools, (cache.k, cache.v))
    return cache.replace(k=k, v=v)


def _num_leading_valid(pairs: jax.Array, count: jax.Array, num_src: int, num_dst: int) -> jax.Array:
    """Rows before the first padding row (an id out of range) or `count`, whichever is first."""
    src, dst = pairs[:, 0], pairs[:, 1]
    valid = (jnp.arange(pairs.shape[0]) < count) & (src >= 0) & (src < num_src) & (dst >= 0) & (dst < num_dst)
    return jnp.sum(jnp.cumprod(valid))


def _copy_across(src_pools, dst_pools, src, dst, n, move):
    """For i < n: dst_pools[*][dst[i]] = move(src_pools[*][src[i]]), one block at a time.

    Block by block with dynamic slices (never a clamping index: n stops before padding rows),
    so each step moves one contiguous [1, L, block_size, H_kv, D] chunk between memories.
    """

    def body(i, pools):
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(pool, move(jax.lax.dynamic_slice_in_dim(s, src[i], 1, 0)), dst[i], 0)
            for s, pool in zip(src_pools, pools)
        )

    return jax.lax.fori_loop(0, n, body, dst_pools)


def _to_host(x: jax.Array, kind: str | None) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Host) if kind else x


def _to_device(x: jax.Array, kind: str | None) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device) if kind else x


@functools.partial(jax.jit, donate_argnums=0)
def swap_out(cache: KVCache, pairs: jax.Array, count: jax.Array) -> KVCache:
    """Copy device block pairs[i, 0] to host block pairs[i, 1] for i < count, every layer.

    pairs: int32[P, 2], padded after the first `count` rows (e.g. with PAD_ID). The device
    pool is left as it was; the caller frees those blocks.
    """
    kind = cache.host_memory_kind
    n = _num_leading_valid(pairs, count, cache.num_device_blocks, cache.num_host_blocks)
    host_k, host_v = _copy_across((cache.k, cache.v), (cache.host_k, cache.host_v), pairs[:, 0],
                                  pairs[:, 1], n, lambda x: _to_host(x, kind))
    return cache.replace(host_k=host_k, host_v=host_v)


@functools.partial(jax.jit, donate_argnums=0)
def swap_in(cache: KVCache, pairs: jax.Array, count: jax.Array) -> KVCache:
    """Copy host block pairs[i, 0] to device block pairs[i, 1] for i < count, every layer.

    pairs: int32[P, 2], padded after the first `count` rows (e.g. with PAD_ID).
    """
    kind = cache.host_memory_kind
    n = _num_leading_valid(pairs, count, cache.num_host_blocks, cache.num_device_blocks)
    k, v = _copy_across((cache.host_k, cache.host_v), (cache.k, cache.v), pairs[:, 0],
                        pairs[:, 1], n, lambda x: _to_device(x, kind))
    return cache.replace(k=k, v=v)
