"""Tensor/data parallelism: sharded forward vs one device, shard layouts, HF placement, errors.

The multi-device checks run in one subprocess (`sharding_worker.py`) with 8 simulated CPU
devices, so this process keeps its single device; the tests here assert on its JSON report.
The multi-host test is a simulation inside this process (fake process indices, fake wire).
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsched.cache import kv_cache as kc
from jaxsched.engine import sharding as sh
from jaxsched.cache.attention import make_metadata
from models import llama

WORKER = pathlib.Path(__file__).with_name("sharding_worker.py")
TP_CASES = ["tp2_gqa", "tp4_gqa", "tp2_mha_tied", "tp8_mha_tied"]  # worker's tensor-parallel runs
LOGIT_ATOL = 1e-4  # sharded matmuls sum in another order; measured differences are ~3e-6


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, str(WORKER)], env=env, capture_output=True, text=True, timeout=300,
                          cwd=WORKER.parent.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def assert_split(desc: dict, axis: int | None, model: int, devices: list[int]) -> None:
    """desc (the worker's `describe`) is split `model` ways along `axis` (None: replicated)."""
    want_spec = [None] * len(desc["shape"])
    shard = list(desc["shape"])
    if axis is not None:
        want_spec[axis] = "model"
        shard[axis] //= model
    assert desc["spec"] == want_spec, desc
    assert desc["shards"] == [shard] * model and desc["devices"] == devices, desc


@pytest.mark.parametrize("case", TP_CASES)
def test_sharded_forward__tensor_parallel_matches_one_device_across_swaps(report, case):
    got = report[case]
    assert got["tokens"] == got["want_tokens"]  # greedy: each step fed its own argmax back
    assert len(got["tokens"]["a"]) == 8 and len(got["tokens"]["c"]) == 5
    assert got["max_logit_diff"] < LOGIT_ATOL
    assert got["donated"]


@pytest.mark.parametrize("case", TP_CASES)
def test_shard_params__megatron_layout_with_one_shard_per_device(report, case):
    model, params = report[case]["model"], report[case]["params"]
    devices = list(range(model))
    # Layer kernels are stacked [L, in, out]: column-parallel splits axis 2, row-parallel axis 1.
    for name, axis in [("q_proj", 2), ("k_proj", 2), ("up_proj", 2), ("o_proj", 1), ("down_proj", 1), ("norm", None)]:
        assert_split(params[name], axis, model, devices)
    assert_split(params["embedding"], 0 if report[case]["vocab_size"] % model == 0 else None, model, devices)


@pytest.mark.parametrize("case", TP_CASES)
def test_shard_kv_cache__pools_split_by_kv_head_host_pools_stay_on_host(report, case):
    model = report[case]["model"]
    for pool, desc in report[case]["cache"].items():
        assert_split(desc, 3, model, list(range(model)))
        want_kind = (kc.host_memory_kind() or "device") if pool.startswith("host") else "device"
        assert desc["memory_kind"] == want_kind, pool


def test_data_parallel__two_tensor_parallel_replicas_on_disjoint_devices_match_one_device(report):
    dp = report["dp2_tp4"]
    assert dp["replica_devices"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for i, devices in enumerate(dp["replica_devices"]):
        replica = dp[f"replica{i}"]
        assert replica["tokens"] == replica["want_tokens"] and replica["max_logit_diff"] < LOGIT_ATOL
        assert replica["cache"]["k"]["devices"] == devices and replica["params"]["q_proj"]["devices"] == devices
    assert dp["replica0"]["tokens"] != dp["replica1"]["tokens"]  # each served its own trace


@pytest.mark.parametrize("case, model, vocab_axis", [("hf_tp4_gqa", 4, 0), ("hf_tp8_mha_tied", 8, None)])
def test_place_hf_tensors__builds_each_shard_on_its_device(report, case, model, vocab_axis):
    got = report[case]
    assert got["all_equal_with_same_sharding"] and got["from_config_equal"] and got["num_params"] >= 11
    assert_split(got["embedding"], vocab_axis, model, list(range(model)))


def test_shard_params__mesh_that_does_not_divide_the_heads_is_refused(report):
    errors = report["errors"]
    assert "num_key_value_heads=4" in errors["kv_heads_8"] and "size 8" in errors["kv_heads_8"]
    assert "num_attention_heads=8" in errors["heads_3"] and "size 3" in errors["heads_3"]
    assert "[1, 2, 4]" in errors["heads_3"]
    assert "needs 12 devices, only 8" in errors["too_many_devices"]


# ----------------------------------------------------------------------------- in this process


def make_config(**overrides) -> llama.LlamaConfig:
    return llama.LlamaConfig(**{**dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2), **overrides})


def test_make_mesh__names_its_axes_and_refuses_too_few_devices():
    mesh = sh.make_mesh(1, 1)
    assert mesh.axis_names == ("data", "model") and mesh.devices.shape == (1, 1)
    with pytest.raises(ValueError, match=r"data=2 x model=1 mesh needs 2 devices"):
        sh.make_mesh(2, 1, devices=jax.devices()[:1])


def test_check_tensor_parallel__names_each_count_and_the_sizes_that_work(caplog):
    with pytest.raises(ValueError) as err:
        sh.check_tensor_parallel(make_config(), 4)
    assert "num_key_value_heads=2" in str(err.value) and "num_attention_heads" not in str(err.value)
    assert "[1, 2]" in str(err.value)
    sh.check_tensor_parallel(make_config(vocab_size=97), 2)  # odd vocabulary: replicated, logged
    assert "replicated" in caplog.text


@pytest.mark.parametrize("names, spec", [
    (("model", "layers", "self_attn", "q_proj", "kernel"), (None, None, "model")),   # [L, in, out]
    (("model", "layers", "self_attn", "q_proj", "bias"), (None, "model")),
    (("model", "layers", "mlp", "down_proj", "kernel"), (None, "model", None)),
    (("model", "layers", "mlp", "down_proj", "bias"), (None,)),
    (("model", "layers", "post_attention_layernorm", "weight"), (None,)),
    (("model", "embed_tokens", "embedding"), ("model", None)),
    (("lm_head", "kernel"), (None, "model")),
])
def test_param_spec__megatron_rules(names, spec):
    assert tuple(sh.param_spec(names, make_config(), 2)) == spec


def test_param_spec__unknown_parameter_is_an_error():
    with pytest.raises(ValueError, match="rotary.scale"):
        sh.param_spec(("rotary", "scale"), make_config(), 2)


def test_multihost__simulated_leader_shares_requests_every_host_steps_only_leader_answers():
    """SIMULATED: two "hosts" are two loops in this one process, told fake process indices;
    the broadcast is a dict standing in for `broadcast_one_to_all`. Real multi-host is untested."""
    config = make_config()
    graphdef, state = nnx.split(llama.LlamaForCausalLM(config, nnx.Rngs(0)))
    mesh = sh.make_mesh(1, 1)
    params = sh.shard_params(state, config, mesh)
    forward = sh.make_sharded_forward(mesh, sh.param_shardings(state, config, mesh))
    wire = {}

    def fake_broadcast(tree, is_source):
        if is_source:
            wire["tree"] = jax.tree.map(np.array, tree)
        return wire["tree"]

    def host_step(process_index: int, incoming: np.ndarray):
        """What every host runs per step: sync the leader's batch, run the model, answer if leader."""
        batch = sh.share_from_leader(incoming, process_index=process_index, broadcast=fake_broadcast)
        md = make_metadata([[1, 2]], [0], [len(batch)], 4, 2, 8, 1)
        cache = sh.shard_kv_cache(kc.init_kv_cache(1, 4, 1, 4, 2, config.head_dim), mesh)
        logits, _ = forward(graphdef, params, jnp.asarray(batch), md.positions, md, cache)
        return np.asarray(logits) if sh.is_leader(process_index) else None, np.asarray(logits)

    requests = np.arange(3, 11, dtype=np.int32)  # only the leader receives requests
    leader_answer, leader_logits = host_step(0, requests)
    follower_answer, follower_logits = host_step(1, np.zeros_like(requests))
    assert follower_answer is None and leader_answer is not None
    np.testing.assert_array_equal(follower_logits, leader_logits)  # same inputs, same step
    assert sh.is_leader()  # one real process: it is process 0
    np.testing.assert_array_equal(sh.share_from_leader({"x": requests})["x"], requests)  # real broadcast: identity


# ----------------------------------------------------------------------------- the LLM on a mesh


@pytest.fixture(scope="module")
def llm_report() -> dict:
    worker = pathlib.Path(__file__).with_name("llm_sharding_worker.py")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, str(worker)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=worker.parent.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_llm__tensor_and_data_parallel_match_one_device_with_preemption(llm_report):
    runs = llm_report["runs"]
    assert llm_report["devices"] == 8
    for name, run in runs.items():
        mode = name.split("-")[1]
        assert run["tokens"] == runs[f"single-{mode}"]["tokens"], name
        assert run["preempted"] > 0, f"{name}: the small cache should have preempted"


def test_llm__cache_and_weights_really_are_sharded(llm_report):
    runs = llm_report["runs"]
    assert runs["single-swap"]["kv_shard_shapes"] == [[15, 2, 4, 4, 8]]
    assert runs["tp2-recompute"]["kv_shard_shapes"] == [[15, 2, 4, 2, 8]]      # kv heads 4 / 2
    assert runs["dp2_tp4-swap"]["kv_shard_shapes"] == [[15, 2, 4, 1, 8]]      # each replica TP 4
    assert "model" in runs["dp2_tp4-swap"]["kv_spec"]
    assert runs["tp2-recompute"]["q_shard_shapes"] == [[2, 64, 32]]            # q_proj column-parallel,
    assert runs["dp2_tp4-swap"]["q_shard_shapes"] == [[2, 64, 16]]             # layers stacked whole
    devices = runs["dp2_tp4-swap"]["replica_devices"]
    # Starting an engine must not shrink the mesh's cached device set (popping from
    # `Array.devices()` once did, and a later engine on the same devices failed to place).
    assert runs["tp2-recompute"]["kv_device_set"] == [0, 1]
    assert runs["dp2_tp4-swap"]["kv_device_set"] == [0, 1, 2, 3]
    assert devices == [[0, 1, 2, 3], [4, 5, 6, 7]]                            # disjoint replicas


def test_llm__mesh_that_does_not_divide_the_heads_is_rejected(llm_report):
    message = llm_report["bad_mesh_error"]
    assert "num_attention_heads=8" in message and "3" in message


def test_llm__mesh_compiles_each_token_bucket_once_when_first_needed(llm_report):
    lazy = llm_report["lazy"]
    assert lazy["buckets"] == [8, 16, 32]
    assert lazy["before"] == []                     # nothing compiled before a step needs it
    assert lazy["after_short"] == [8]               # a short request: its own bucket only
    assert lazy["after_same_bucket"] == [8]
    assert lazy["traces_before_warm_up"] == {"plan": 1, "finish": 1, "model_8": 1}
    assert lazy["after_warm_up"] == [8, 16, 32]     # warm_up compiles the rest
    assert lazy["traces"] == {"plan": 1, "finish": 1, "model_8": 1, "model_16": 1, "model_32": 1}
