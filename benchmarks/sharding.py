"""Tensor-parallel decode step on 1/2/4/8 simulated CPU devices: tokens/s and bytes per device.

    python benchmarks/sharding.py [--json] [--reps N] [--quick]

The devices are simulated: XLA's CPU backend split 8 ways (`--xla_force_host_platform_device_count`)
on one machine with few cores, so every "device" shares the same cores and the all-reduces
are memory copies. Tokens/s therefore measures the overhead of partitioning, not a speed-up;
the memory columns are real: bytes of the parameter and KV-cache shards each device holds.

Model: 4 layers, hidden 512, 8 heads = 8 kv heads (head_dim 64), ffn 1536, vocab 8192,
float32; a decode step of 8 sequences at context 256 through the paged cache (block_size 16),
cache donated, via `make_sharded_forward`. Each mesh size is timed interleaved with the others
(median of --reps rounds of 3 calls, after a warm-up). The Llama-3.1-8B column is computed
from shard shapes (`NamedSharding.shard_shape`), nothing allocated. Results go to
benchmarks/results/sharding.{json,md}.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from _common import save_results, time_interleaved  # noqa: E402
from jaxsched.engine import sharding as sh  # noqa: E402
from jaxsched.cache.attention import make_metadata  # noqa: E402
from models import llama  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)

SEED = 0
CONFIG = llama.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=8)
BATCH, CONTEXT, BLOCK_SIZE, NUM_HOST_BLOCKS = 8, 256, 16, 16
RESULTS = pathlib.Path(__file__).parent / "results"


def per_device_bytes(tree) -> dict[int, int]:
    """Bytes of the shards each device holds, summed over the arrays of `tree`."""
    out: dict[int, int] = {}
    for array in jax.tree.leaves(tree):
        for shard in array.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def setup(model: int, rng):
    """(zero-argument decode step, facts) for a (1, model) mesh."""
    mesh = sh.make_mesh(1, model)
    graphdef, state = nnx.split(llama.LlamaForCausalLM(CONFIG, nnx.Rngs(SEED)))
    params = sh.shard_params(state, CONFIG, mesh)
    blocks_per_seq = CONTEXT // BLOCK_SIZE
    cache = sh.init_sharded_kv_cache(mesh, CONFIG.num_hidden_layers, BATCH * blocks_per_seq + 1, NUM_HOST_BLOCKS,
                                     BLOCK_SIZE, CONFIG.num_key_value_heads, CONFIG.head_dim)
    tables = (1 + rng.permutation(BATCH * blocks_per_seq)).reshape(BATCH, blocks_per_seq).tolist()
    md = make_metadata(tables, [CONTEXT - 1] * BATCH, [1] * BATCH, BLOCK_SIZE, blocks_per_seq, BATCH, BATCH)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, BATCH), jnp.int32)
    forward = sh.make_sharded_forward(mesh, sh.param_shardings(state, CONFIG, mesh))
    box = {"cache": cache}

    def step():
        logits, box["cache"] = forward(graphdef, params, tokens, md.positions, md, box["cache"])
        return logits

    device_pools = (cache.k, cache.v)
    facts = {"devices": model, "param_bytes_per_device": max(per_device_bytes(params).values()),
             "cache_bytes_per_device": max(per_device_bytes(device_pools).values()),
             "host_cache_bytes_per_device": max(per_device_bytes((cache.host_k, cache.host_v)).values()),
             "llama3_8b_param_bytes_per_device": llama3_8b_param_bytes(mesh)}
    return step, facts


def llama3_8b_param_bytes(mesh) -> int:
    """Parameter bytes one device holds for Llama-3.1-8B in bfloat16, from shard shapes alone."""
    config = llama.llama3_8b(dtype="bfloat16")
    state = nnx.state(nnx.eval_shape(lambda: llama.LlamaForCausalLM(config, nnx.Rngs(0))), nnx.Param)
    shardings = sh.param_shardings(state, config, mesh)
    return sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)))


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def to_markdown(result: dict) -> str:
    lines = [f"# Tensor-parallel decode step on simulated CPU devices ({result['machine']})", "",
             f"{result['model']}; decode batch {BATCH} at context {CONTEXT}, median of {result['reps']} "
             f"interleaved rounds; 1-minute load average {result['load_average'][0]:.1f} before, "
             f"{result['load_average'][1]:.1f} after. Simulated CPU devices share the same "
             f"{os.cpu_count()} cores: tokens/s shows partitioning overhead, not a speed-up.", "",
             "| simulated CPU devices | step ms | (min) | tokens/s | params MiB/device | KV cache MiB/device "
             "| host KV MiB/device | Llama-3.1-8B bf16 params GiB/device |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['devices']} | {row['step_ms']:.2f} | {row['min_step_ms']:.2f} | {row['tokens_per_s']:.0f} "
                     f"| {mib(row['param_bytes_per_device'])} | {mib(row['cache_bytes_per_device'])} "
                     f"| {mib(row['host_cache_bytes_per_device'])} "
                     f"| {row['llama3_8b_param_bytes_per_device'] / 2**30:.2f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="1 and 2 devices, 3 reps, nothing saved")
    args = parser.parse_args()
    rng, reps = np.random.default_rng(SEED), 3 if args.quick else args.reps
    load_before = os.getloadavg()[0]
    setups = {m: setup(m, rng) for m in ((1, 2) if args.quick else (1, 2, 4, 8))}
    median, minimum = time_interleaved({m: step for m, (step, _) in setups.items()}, reps)
    rows = [{**facts, "step_ms": median[m] * 1e3, "min_step_ms": minimum[m] * 1e3, "tokens_per_s": BATCH / median[m]}
            for m, (_, facts) in setups.items()]
    result = {"backend": jax.default_backend(), "devices": "simulated CPU devices",
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "jax": jax.__version__, "seed": SEED,
              "reps": reps, "model": (f"{CONFIG.num_hidden_layers} layers, hidden {CONFIG.hidden_size}, "
                                      f"{CONFIG.num_attention_heads} heads, vocab {CONFIG.vocab_size}, float32"),
              "rows": rows, "load_average": [load_before, os.getloadavg()[0]]}
    markdown = to_markdown(result)
    if not args.quick:
        save_results("sharding", result, markdown)
    print(json.dumps(result, indent=2) if args.json else markdown)


if __name__ == "__main__":
    main()
