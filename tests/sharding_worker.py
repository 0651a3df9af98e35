"""Runs the sharded forward on 8 simulated CPU devices and prints facts as JSON for test_sharding.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_worker.py

A separate process because the device count is fixed when JAX starts, and the main pytest
process must keep its one device. It asserts nothing: it reports tokens, logit differences
against one device, shardings and per-device shard shapes, and the errors it was given.
"""

import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxsched.cache import kv_cache as kc  # noqa: E402
from jaxsched.engine import sharding as sh  # noqa: E402
from jaxsched.cache.attention import make_metadata  # noqa: E402
from models import llama  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)

BLOCK_SIZE, NUM_BLOCKS, NUM_HOST_BLOCKS, MAX_BLOCKS, NUM_TOKENS, NUM_SEQS = 4, 32, 8, 8, 32, 4
CONFIGS = {  # gqa: TP 2 and 4 divide (TP 8 does not: 4 kv heads); mha_tied: TP 8 divides the heads
    "gqa": llama.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, rope_theta=500.0),
    "mha_tied": llama.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=8, rope_theta=500.0,
                                  tie_word_embeddings=True),
}


class Runner:
    """Greedy paged generation driver: block tables from a shuffled free list, swaps by name."""

    def __init__(self, graphdef, params, cache, forward, seed: int):
        self.graphdef, self.params, self.cache, self.forward = graphdef, params, cache, forward
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS))]
        self.tables, self.host_tables, self.num_computed = {}, {}, {}
        self.logits: dict[str, list[np.ndarray]] = {}
        self.tokens: dict[str, list[int]] = {}

    def step(self, new_tokens: dict[str, list[int]]) -> None:
        names = list(new_tokens)
        for name in names:
            table, done = self.tables.setdefault(name, []), self.num_computed.setdefault(name, 0)
            while len(table) * BLOCK_SIZE < done + len(new_tokens[name]):
                table.append(self.free.pop())
        md = make_metadata([self.tables[n] for n in names], [self.num_computed[n] for n in names],
                           [len(new_tokens[n]) for n in names], BLOCK_SIZE, MAX_BLOCKS, NUM_TOKENS, NUM_SEQS)
        flat = sum((new_tokens[n] for n in names), [])
        tokens = jnp.asarray(flat + [0] * (NUM_TOKENS - len(flat)), jnp.int32)
        logits, self.cache = self.forward(self.graphdef, self.params, tokens, md.positions, md, self.cache)
        for i, name in enumerate(names):
            self.num_computed[name] += len(new_tokens[name])
            self.logits.setdefault(name, []).append(np.asarray(logits[i]))
            self.tokens.setdefault(name, []).append(int(np.argmax(logits[i])))

    def decode(self, names) -> None:
        self.step({n: [self.tokens[n][-1]] for n in names})

    def _pairs(self, pairs):
        return jnp.asarray(pairs + [(kc.PAD_ID, kc.PAD_ID)] * (MAX_BLOCKS - len(pairs)), jnp.int32)

    def swap_out(self, name: str) -> None:
        device = self.tables.pop(name)
        host = list(range(len(device)))
        self.cache = kc.swap_out(self.cache, self._pairs(list(zip(device, host))), jnp.int32(len(device)))
        self.host_tables[name] = host
        self.free.extend(device)  # the next allocation overwrites these blocks

    def swap_in(self, name: str) -> None:
        host = self.host_tables.pop(name)
        device = [self.free.pop(0) for _ in host]
        self.cache = kc.swap_in(self.cache, self._pairs(list(zip(host, device))), jnp.int32(len(host)))
        self.tables[name] = device


def scenario(runner: Runner, seed: int) -> Runner:
    """Ragged prefill, greedy decodes, swap-out, an intruder over the freed blocks, swap-in, decodes."""
    rng = np.random.default_rng(seed)
    prompt = lambda n: rng.integers(0, 100, n).tolist()  # noqa: E731
    runner.step({"a": prompt(11), "b": prompt(6)})
    for _ in range(3):
        runner.decode(["a", "b"])
    runner.swap_out("a")
    runner.step({"c": prompt(13), "b": [runner.tokens["b"][-1]]})
    runner.swap_in("a")
    for _ in range(4):
        runner.decode(["a", "b", "c"])
    return runner


@functools.cache
def single_device(config, seed: int) -> Runner:
    graphdef, params = nnx.split(llama.LlamaForCausalLM(config, nnx.Rngs(0)))
    cache = kc.init_kv_cache(config.num_hidden_layers, NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE,
                             config.num_key_value_heads, config.head_dim)
    return scenario(Runner(graphdef, params, cache, llama.forward, seed), seed)


def describe(array: jax.Array) -> dict:
    spec = tuple(array.sharding.spec) + (None,) * (array.ndim - len(array.sharding.spec))
    return {"spec": list(spec), "shape": list(array.shape), "memory_kind": array.sharding.memory_kind,
            "shards": sorted(list(s.data.shape) for s in array.addressable_shards),
            "devices": sorted(s.device.id for s in array.addressable_shards)}


def compare(got: Runner, want: Runner) -> dict:
    diff = max(float(np.abs(g - w).max()) for n in want.logits for g, w in zip(got.logits[n], want.logits[n]))
    return {"tokens": got.tokens, "want_tokens": want.tokens, "max_logit_diff": diff}


def tensor_parallel(name: str, mesh, seed: int, fresh_cache: bool = False) -> dict:
    config = CONFIGS[name]
    graphdef, state = nnx.split(llama.LlamaForCausalLM(config, nnx.Rngs(0)))
    params = sh.shard_params(state, config, mesh)
    shape = (config.num_hidden_layers, NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE, config.num_key_value_heads,
             config.head_dim)
    cache = sh.init_sharded_kv_cache(mesh, *shape) if fresh_cache else sh.shard_kv_cache(kc.init_kv_cache(*shape), mesh)
    old_k = cache.k
    forward = sh.make_sharded_forward(mesh, sh.param_shardings(state, config, mesh))
    runner = Runner(graphdef, params, cache, forward, seed)
    runner.step({"warm": [1, 2]})  # one step alone, to see the donated cache
    donated = old_k.is_deleted()
    runner.tables.pop("warm")  # its blocks stay allocated; harmless
    runner.logits.clear(), runner.tokens.clear(), runner.num_computed.clear()
    scenario(runner, seed)
    layer = params["model"]["layers"]  # stacked: [L, ...] per parameter
    params_desc = {"q_proj": layer["self_attn"]["q_proj"]["kernel"], "k_proj": layer["self_attn"]["k_proj"]["kernel"],
                   "o_proj": layer["self_attn"]["o_proj"]["kernel"], "up_proj": layer["mlp"]["up_proj"]["kernel"],
                   "down_proj": layer["mlp"]["down_proj"]["kernel"], "norm": params["model"]["norm"]["weight"],
                   "embedding": params["model"]["embed_tokens"]["embedding"]}
    return {"model": mesh.shape["model"], "vocab_size": config.vocab_size, "donated": donated,
            "params": {k: describe(v[...]) for k, v in params_desc.items()},
            "cache": {k: describe(getattr(runner.cache, k)) for k in ("k", "v", "host_k", "host_v")},
            **compare(runner, single_device(config, seed))}


def hf_loading(name: str, mesh) -> dict:
    """place_hf_tensors from HF-layout numpy tensors vs shard_params of the same model."""
    config = CONFIGS[name]
    model = llama.LlamaForCausalLM(config, nnx.Rngs(0))
    tensors = llama.to_hf_state_dict(model)
    abstract = nnx.eval_shape(lambda: llama.LlamaForCausalLM(config, nnx.Rngs(0)))
    placed = sh.place_hf_tensors(abstract, tensors, mesh)
    want = sh.shard_params(nnx.state(model, nnx.Param), config, mesh)
    same = jax.tree.leaves(jax.tree.map(
        lambda a, b: bool(np.array_equal(a, b)) and a.sharding.is_equivalent_to(b.sharding, a.ndim), placed, want))
    from_config = sh.place_hf_tensors(config, tensors, mesh)
    return {"all_equal_with_same_sharding": all(same), "num_params": len(same),
            "embedding": describe(placed["model"]["embed_tokens"]["embedding"][...]),
            "from_config_equal": all(jax.tree.leaves(jax.tree.map(np.array_equal, from_config, want)))}


def data_parallel() -> dict:
    mesh = sh.make_mesh(2, 4)
    replicas = sh.replica_meshes(mesh)
    out = {"replica_devices": [sorted(d.id for d in r.devices.flat) for r in replicas]}
    for i, replica in enumerate(replicas):  # a different trace per replica
        out[f"replica{i}"] = tensor_parallel("gqa", replica, seed=10 + i)
    return out


def errors() -> dict:
    out = {}
    for label, (name, data, model) in {"kv_heads_8": ("gqa", 1, 8), "heads_3": ("gqa", 1, 3),
                                        "too_many_devices": ("gqa", 3, 4)}.items():
        config = CONFIGS[name]
        try:
            state = nnx.state(llama.LlamaForCausalLM(config, nnx.Rngs(0)))
            sh.shard_params(state, config, sh.make_mesh(data, model))
            out[label] = None
        except ValueError as err:
            out[label] = str(err)
    return out


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    result = {
        "tp2_gqa": tensor_parallel("gqa", sh.make_mesh(1, 2), seed=0),
        "tp4_gqa": tensor_parallel("gqa", sh.make_mesh(1, 4), seed=0, fresh_cache=True),
        "tp2_mha_tied": tensor_parallel("mha_tied", sh.make_mesh(1, 2), seed=1),
        "tp8_mha_tied": tensor_parallel("mha_tied", sh.make_mesh(1, 8), seed=1, fresh_cache=True),
        "dp2_tp4": data_parallel(),
        "hf_tp4_gqa": hf_loading("gqa", sh.make_mesh(1, 4)),
        "hf_tp8_mha_tied": hf_loading("mha_tied", sh.make_mesh(1, 8)),
        "errors": errors(),
    }
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
