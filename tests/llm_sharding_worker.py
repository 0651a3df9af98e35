"""Run in a subprocess with 8 simulated CPU devices: the LLM front end over a mesh.

Prints one JSON object: greedy tokens per configuration (with preemption forced) and the
shardings the engine really used. `test_sharding.py::test_llm__*` asserts on it.
"""
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxsched.entrypoints.llm import LLM  # noqa: E402
from jaxsched.engine.params import SamplingParams  # noqa: E402
from models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
ENGINE = dict(block_size=4, num_slots=8, max_seqs_per_group=2, max_num_seqs=8, max_num_batched_tokens=32,
              max_model_len=64, num_device_blocks=14, num_host_blocks=32, attention_impl="reference")


def main():
    model = LlamaForCausalLM(CONFIG, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, size=int(n)).tolist() for n in rng.integers(4, 14, size=6)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, n=1 + i % 2) for i in range(6)]
    report = {"devices": len(jax.devices()), "runs": {}}
    runs = [("single", {}, "swap"), ("single", {}, "recompute"), ("tp2", dict(tensor_parallel_size=2), "recompute"),
            ("dp2_tp4", dict(mesh_shape=(2, 4)), "swap")]
    for name, kw, mode in runs:
        llm = LLM(model, preemption_mode=mode, **ENGINE, **kw)
        if name == "tp2":             # a fresh tensor-parallel engine: what compiles when
            report["lazy"] = lazy_buckets(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        run = {"tokens": [[c.token_ids for c in o.outputs] for o in outs],
               "preempted": stats["preempted_recompute"] + stats["preempted_swap"]}
        replicas = getattr(llm, "replicas", [])       # a DataParallelLLM's engines
        engine = replicas[0] if replicas else llm
        run["kv_spec"] = str(engine.state.kv.k.sharding.spec) if hasattr(engine.state.kv.k.sharding, "spec") else None
        # The sharding's own device set, which JAX caches on the mesh: an engine must leave it whole.
        run["kv_device_set"] = sorted(d.id for d in engine.state.kv.k.sharding.device_set)
        run["kv_shard_shapes"] = sorted({tuple(s.data.shape) for s in engine.state.kv.k.addressable_shards})
        q = engine.params["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
        q = q.get_value() if hasattr(q, "get_value") else q.value
        run["q_shard_shapes"] = sorted({tuple(s.data.shape) for s in q.addressable_shards})
        run["replica_devices"] = [sorted({s.device.id for s in r.state.kv.k.addressable_shards})
                                  for r in replicas]
        report["runs"][f"{name}-{mode}"] = run
    try:
        LLM(model, tensor_parallel_size=3, **ENGINE)
    except ValueError as e:
        report["bad_mesh_error"] = str(e)
    print(json.dumps(report))


def lazy_buckets(llm) -> dict:
    """A fresh tensor-parallel LLM compiles a token bucket only when a step first needs it,
    each once; `warm_up` compiles the rest."""
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    out = {"buckets": list(llm.spec.token_buckets), "before": list(llm._step.compiled)}
    llm.generate([[1] * 5], greedy, use_tqdm=False)       # prefill of 5, decodes: bucket 8
    out["after_short"] = list(llm._step.compiled)
    for prompt in ([2] * 3, [3] * 7):                      # other lengths, the same bucket
        llm.generate([prompt], greedy, use_tqdm=False)
    out["after_same_bucket"] = list(llm._step.compiled)
    out["traces_before_warm_up"] = llm._step.parts.cache_sizes()
    llm.warm_up()
    out["after_warm_up"] = sorted(llm._step.compiled)
    llm.generate([[4] * 20], greedy, use_tqdm=False)
    out["traces"] = llm._step.parts.cache_sizes()
    return out


if __name__ == "__main__":
    main()
