"""Measure what recompute and swap cost on the running backend (mode "auto"'s cost model).

`measure_preemption_costs` times the model's paged prefill at a few lengths and the cache's
swap kernels at a few block counts, then fits `core.costs.PreemptionCosts`.
"""
from __future__ import annotations

import math
import time

import numpy as np

from jaxsched.core.costs import PreemptionCosts, fit


def _median_seconds(fn, reps: int) -> float:
    fn()                                     # warm-up: compiles
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure_preemption_costs(forward, graphdef, params, *, num_layers: int, num_kv_heads: int,
                             head_dim: int, block_size: int, dtype="float32",
                             lengths=(16, 64, 128, 256), blocks=(1, 4, 8, 16), reps: int = 3,
                             impl: str = "chunked", quadratic: bool = True
                             ) -> tuple[PreemptionCosts, dict]:
    """Time recompute and swap on the running backend; returns (fitted costs, measurements).

    Recompute: the engine's forward, `forward(graphdef, params, tokens, positions, metadata,
    kv_cache, impl) -> (logits, (k, v))` (e.g. models.llama.paged_forward_new_kv, what
    `EngineSpec.forward` holds), with the step's K/V then written as the engine writes them,
    on one sequence prefilling L tokens, for each L of `lengths` (one compile each). Swap: `kv_cache.swap_out`
    then `swap_in` of k blocks on a cache of the model's block shape, for each k of `blocks`
    (one compile). Each point is the median of `reps` timed calls after a warm-up call.
    """
    import jax
    import jax.numpy as jnp

    from jaxsched.cache import kv_cache as kvc
    from jaxsched.cache.attention import AttentionMetadata

    shape = dict(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, dtype=jnp.dtype(dtype))
    longest = max(lengths)
    width = math.ceil(longest / block_size)
    cache = [kvc.init_kv_cache(num_device_blocks=width + 1, num_host_blocks=1, **shape)]
    def prefill_step(graphdef, params, tokens, positions, metadata, kv_cache, impl):
        logits, (k, v) = forward(graphdef, params, tokens, positions, metadata, kv_cache, impl)
        return logits, kvc.write_layers(kv_cache, k, v, metadata.slot_mapping)

    run = jax.jit(prefill_step, static_argnums=(0, 6), donate_argnums=(5,))

    def prefill(length: int):
        table = jnp.arange(1, width + 1, dtype=jnp.int32)[None]      # block 0 is the null block
        pos = jnp.arange(length, dtype=jnp.int32)
        meta = AttentionMetadata(slot_mapping=table[0, pos // block_size] * block_size + pos % block_size,
                                 positions=pos, seq_ids=jnp.zeros((length,), jnp.int32),
                                 block_tables=table, context_lens=jnp.array([length], jnp.int32),
                                 logits_indices=jnp.array([length - 1], jnp.int32),
                                 num_valid=jnp.int32(length))
        tokens = (pos * 7919 + 1) % 97                               # any valid ids

        def once():
            logits, cache[0] = run(graphdef, params, tokens, pos, meta, cache[0], impl)
            jax.block_until_ready(logits)
        return once

    rec = [_median_seconds(prefill(n), reps) for n in lengths]
    del cache[0]

    most = max(blocks)
    swap_cache = [kvc.init_kv_cache(num_device_blocks=most + 1, num_host_blocks=most + 1, **shape)]
    ids = jnp.arange(1, most + 1, dtype=jnp.int32)

    def swap(k: int):
        out_pairs = jnp.stack([ids, ids], 1)                         # device i -> host i
        count = jnp.int32(k)

        def once():
            c = kvc.swap_out(swap_cache[0], out_pairs, count)
            swap_cache[0] = jax.block_until_ready(kvc.swap_in(c, out_pairs, count))
        return once

    swp = [_median_seconds(swap(k), reps) for k in blocks]
    costs = fit(lengths, rec, blocks, swp, quadratic=quadratic)
    measured = {"backend": jax.default_backend(), "lengths": list(lengths), "recompute_seconds": rec,
                "blocks": list(blocks), "swap_seconds": swp, "reps": reps}
    return costs, measured
