"""Decode attention over the paged cache vs contiguous per-sequence caches; swap kernels vs device_put.

    python benchmarks/paged_attention.py [--json] [--reps N] [--quick]

Attention shapes are SmolLM2-135M's (9 query heads, 3 kv heads, head_dim 64), float32,
block_size 16, each sequence's blocks a random scattered subset of a pool 25% larger than
the batch needs. Every variant is timed interleaved with the others (median of --reps rounds
of 3 calls each, after a warm-up), so load from other processes hits them alike; the ratio
of the per-variant minima is shown beside the ratio of medians as a check on that noise.

  contiguous: the same math over [B, ctx, H_kv, D] arrays, one fused multiply-reduce per pass
  paged:      jaxsched's default `chunked` impl (the decode fast path) through block tables
  reference:  the `reference` impl (gather whole contexts, then einsum), for scale

KV bytes/s counts the K and V bytes of the visible context (2 * B * ctx * H_kv * D * 4).
Swap rows move whole blocks (all layers, K and V) and compare against one raw `jax.device_put`
of an array of the same bytes between the same memory kinds. Results go to
benchmarks/results/paged_attention_<backend>.{json,md}; --json prints the JSON to stdout.
"""

import argparse
import json
import math
import os
import pathlib
import platform

import jax
import jax.numpy as jnp
import numpy as np

from _common import save_results, time_interleaved
from jaxsched.cache import kv_cache as kc
from jaxsched.cache.attention import AttentionMetadata, paged_attention

jax.config.update("jax_cpu_enable_async_dispatch", False)

SEED = 0
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SWAP_LAYERS = 30  # SmolLM2-135M: one block of every layer is 30 * 16 * 3 * 64 * 4 B * 2 = 737 KiB
RESULTS = pathlib.Path(__file__).parent / "results"


def contiguous_decode_attention(q, k, v, context_lens):
    """q: [B, H, D]; k, v: [B, ctx, H_kv, D] -> [B, H, D]. The paged kernel's math, unpaged."""
    b, ctx, kv_heads, d = k.shape
    qg = q.reshape(b, 1, kv_heads, -1, d).astype(jnp.float32) / math.sqrt(d)
    s = (qg * k[:, :, :, None, :]).sum(-1)  # [B, ctx, H_kv, G]
    s = jnp.where((jnp.arange(ctx)[None, :] < context_lens[:, None])[:, :, None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=1)
    return (p[..., None] * v[:, :, :, None, :]).sum(1).reshape(q.shape).astype(q.dtype)


def decode_metadata(block_tables: np.ndarray, ctx: int) -> AttentionMetadata:
    b = block_tables.shape[0]
    return AttentionMetadata(
        slot_mapping=jnp.full((b,), kc.PAD_ID, jnp.int32), positions=jnp.full((b,), ctx - 1, jnp.int32),
        seq_ids=jnp.arange(b, dtype=jnp.int32), block_tables=jnp.asarray(block_tables),
        context_lens=jnp.full((b,), ctx, jnp.int32), logits_indices=jnp.arange(b, dtype=jnp.int32),
        num_valid=jnp.int32(b))


def bench_attention(batch: int, ctx: int, reps: int, rng) -> dict:
    blocks_per_seq = ctx // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq * 5 // 4 + 1
    pool_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal(pool_shape, np.float32)) for _ in range(2))
    tables = (rng.permutation(num_blocks - 1)[: batch * blocks_per_seq] + 1).reshape(batch, blocks_per_seq)
    md = decode_metadata(tables.astype(np.int32), ctx)
    k_contig, v_contig = (pool[md.block_tables].reshape(batch, ctx, NUM_KV_HEADS, HEAD_DIM) for pool in (k_pool, v_pool))
    q = jnp.asarray(rng.standard_normal((batch, NUM_HEADS, HEAD_DIM), np.float32))
    contiguous = jax.jit(contiguous_decode_attention)
    paged = {impl: jax.jit(lambda q, k, v, md, impl=impl: paged_attention(q, k, v, md, impl=impl))
             for impl in ("chunked", "reference")}
    want = contiguous(q, k_contig, v_contig, md.context_lens)
    for fn in paged.values():
        np.testing.assert_allclose(fn(q, k_pool, v_pool, md), want, atol=1e-4)
    times, fastest = time_interleaved({
        "contiguous": lambda: contiguous(q, k_contig, v_contig, md.context_lens),
        "paged": lambda: paged["chunked"](q, k_pool, v_pool, md),
        "reference": lambda: paged["reference"](q, k_pool, v_pool, md),
    }, reps)
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * 4
    return {"batch": batch, "context": ctx, "kv_bytes": kv_bytes,
            **{f"{name}_s": t for name, t in times.items()},
            **{f"{name}_min_s": t for name, t in fastest.items()},
            **{f"{name}_bytes_per_s": kv_bytes / t for name, t in times.items()},
            "paged_over_contiguous": times["paged"] / times["contiguous"],
            "paged_over_contiguous_min": fastest["paged"] / fastest["contiguous"]}


def bench_swap(num_pairs: int, reps: int, rng) -> dict:
    cache = kc.init_kv_cache(SWAP_LAYERS, 2 * num_pairs + 1, num_pairs, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache = cache.replace(k=cache.k + 1.0, v=cache.v + 2.0)
    device_ids = rng.permutation(2 * num_pairs)[:num_pairs] + 1
    host_ids = rng.permutation(num_pairs)
    out_pairs = jnp.asarray(np.stack([device_ids, host_ids], 1), jnp.int32)
    in_pairs = jnp.asarray(np.stack([host_ids, device_ids], 1), jnp.int32)
    count = jnp.int32(num_pairs)
    staged = (SWAP_LAYERS, num_pairs, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    on_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    on_host = cache.host_k.sharding
    raw_dev = [jnp.ones(staged, jnp.float32) for _ in range(2)]
    raw_host = [jax.device_put(x, on_host) for x in raw_dev]
    state = {"cache": cache}

    def swap(kernel, pairs):
        state["cache"] = kernel(state["cache"], pairs, count)
        return state["cache"].k

    times, _ = time_interleaved({
        "swap_out": lambda: swap(kc.swap_out, out_pairs),
        "raw_to_host": lambda: jax.device_put(raw_dev, on_host),
        "swap_in": lambda: swap(kc.swap_in, in_pairs),
        "raw_to_device": lambda: jax.device_put(raw_host, on_device),
    }, reps)
    nbytes = 2 * math.prod(staged) * 4
    bw = {name: nbytes / t for name, t in times.items()}
    return {"blocks": num_pairs, "bytes": nbytes, "host_memory_kind": cache.host_memory_kind,
            **{f"{name}_s": t for name, t in times.items()}, **{f"{name}_bytes_per_s": b for name, b in bw.items()},
            "swap_out_over_raw": bw["swap_out"] / bw["raw_to_host"], "swap_in_over_raw": bw["swap_in"] / bw["raw_to_device"]}


def gbps(x: float) -> str:
    return f"{x / 1e9:.2f}"


def to_markdown(result: dict) -> str:
    lines = [f"# Paged attention and swap kernels ({result['backend']}, {result['machine']})", "",
             f"Decode attention, {NUM_HEADS} heads / {NUM_KV_HEADS} kv heads / head_dim {HEAD_DIM}, "
             f"block_size {BLOCK_SIZE}, float32, median of {result['reps']} interleaved rounds; "
             f"1-minute load average {result['load_average'][0]:.1f} before, {result['load_average'][1]:.1f} after.", "",
             "| batch | context | contiguous ms | paged ms | paged/contig | (of minima) | reference ms | contiguous GB/s | paged GB/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["attention"]:
        lines.append(f"| {r['batch']} | {r['context']} | {r['contiguous_s'] * 1e3:.3f} | {r['paged_s'] * 1e3:.3f} | "
                     f"{r['paged_over_contiguous']:.2f}x | {r['paged_over_contiguous_min']:.2f}x | {r['reference_s'] * 1e3:.3f} | "
                     f"{gbps(r['contiguous_bytes_per_s'])} | {gbps(r['paged_bytes_per_s'])} |")
    lines += ["", f"Swaps: whole blocks of {SWAP_LAYERS} layers, K and V; host memory kind "
              f"{result['swap'][0]['host_memory_kind']}.", "",
              "| blocks | MiB | swap_out GB/s | raw to host GB/s | out/raw | swap_in GB/s | raw to device GB/s | in/raw |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["swap"]:
        lines.append(f"| {r['blocks']} | {r['bytes'] / 2**20:.1f} | {gbps(r['swap_out_bytes_per_s'])} | "
                     f"{gbps(r['raw_to_host_bytes_per_s'])} | {r['swap_out_over_raw']:.0%} | "
                     f"{gbps(r['swap_in_bytes_per_s'])} | {gbps(r['raw_to_device_bytes_per_s'])} | {r['swap_in_over_raw']:.0%} |")
    worst = max(r["paged_over_contiguous"] for r in result["attention"] if r["batch"] == 32)
    swap = min(min(r["swap_out_over_raw"], r["swap_in_over_raw"]) for r in result["swap"])
    lines += ["", f"Targets: paged within 1.3x of contiguous at batch 32 -- worst {worst:.2f}x; "
              f"swap >= 80% of raw device_put -- worst {swap:.0%}."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="smallest shapes only, 3 reps (smoke test)")
    args = parser.parse_args()
    rng = np.random.default_rng(SEED)
    reps = 3 if args.quick else args.reps
    shapes = [(1, 128), (32, 128)] if args.quick else [(b, c) for b in (1, 8, 32) for c in (128, 512, 2048)]
    load_before = os.getloadavg()[0]
    result = {"backend": jax.default_backend(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "jax": jax.__version__, "seed": SEED, "reps": reps,
              "attention": [bench_attention(b, c, reps, rng) for b, c in shapes],
              "swap": [bench_swap(n, reps, rng) for n in ((4,) if args.quick else (4, 32))]}
    result["load_average"] = [load_before, os.getloadavg()[0]]  # 1-min load, before and after
    markdown = to_markdown(result)
    if not args.quick:
        save_results(f"paged_attention_{result['backend']}", result, markdown)
    print(json.dumps(result, indent=2) if args.json else markdown)


if __name__ == "__main__":
    main()
