"""Tensor and data parallelism for the Llama forward and the paged KV cache, with `jax.sharding`.

A mesh has two axes, ("data", "model")::

    make_mesh(data=2, model=4)     devices  [[d0 d1 d2 d3]     "model": one tensor-parallel group
                                             [d4 d5 d6 d7]]    "data": independent replicas

Tensor parallelism ("model") is Megatron's layout, written as PartitionSpecs on the weights
and the cache; XLA's SPMD partitioner inserts the collectives (we build none):

    q/k/v/gate/up_proj.kernel [in, out]   P(None, "model")  column-parallel: heads, ffn units
    o_proj/down_proj.kernel   [in, out]   P("model", None)  row-parallel: one all-reduce each
    embed_tokens.embedding    [V, hidden] P("model", None)  by vocabulary (lm_head [hidden, V]
                                                            likewise); replicated when V does
                                                            not divide (no padding: logits keep V)
    norms, o/down biases                  P()               replicated
    decoder layers' parameters            the same, after a leading None: they are stacked on a
                                          layer axis ([L, in, out] ...), which is never split
    KV pools [blocks, L, block_size, H_kv, D]  P(None, None, None, "model", None)  by kv head

so each device holds H/model query heads and the H_kv/model kv heads they read, and attention
never leaves the device. Tokens, positions, metadata and logits are replicated (small); the
scheduler state stays as it is, replicated on every host.

Data parallelism ("data") is replicas, not a batch axis: `replica_meshes(mesh)` gives one
(1, model) submesh per row, each with its own params, cache and engine, on disjoint devices.
(A cache sharded over "data" would split every sequence's blocks across replicas.)

Multi-host (not exercised here; one process only): every host runs
`jax.distributed.initialize()` first, then the same program: the same `make_mesh` over the
global `jax.devices()`, the same `place_hf_tensors` (each process builds only its addressable
shards), the same engine step in lock-step, since every step is one SPMD program over all
hosts' devices. Only the leader, process 0, takes requests and returns outputs: each step the
leader's new requests (a fixed-shape batch) go to every host with `share_from_leader`, so all
hosts' schedulers see identical inputs and make identical decisions; followers drop their
outputs. The test of this simulates the hosts inside one process.
"""

import dataclasses
import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsched.cache import kv_cache as kc
from models.llama import (LlamaConfig, LlamaForCausalLM, check_hf_tensors, paged_forward, paged_forward_new_kv,
                          stack_hf_tensors)

AXES = ("data", "model")
_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}  # output features split
_ROW = {"o_proj", "down_proj"}  # input features split
_KV_POOL_SPEC = P(None, None, None, "model", None)  # [blocks, L, block_size, H_kv, D]


def make_mesh(data: int, model: int, devices=None) -> Mesh:
    """A (data, model) mesh over the first data * model `devices` (default `jax.devices()`).

    "model" is the inner axis, so a tensor-parallel group is consecutive devices (on one host
    where there are several). Raises ValueError when there are too few devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1:
        raise ValueError(f"mesh axes must be positive, got data={data} model={model}")
    if data * model > len(devices):
        raise ValueError(f"a data={data} x model={model} mesh needs {data * model} devices, "
                         f"only {len(devices)} available ({devices[0].platform})")
    return Mesh(np.asarray(devices[: data * model]).reshape(data, model), AXES)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One (1, model) submesh per data row: the devices of each data-parallel replica."""
    return [Mesh(mesh.devices[i : i + 1], AXES) for i in range(mesh.shape["data"])]


def check_tensor_parallel(config: LlamaConfig, model: int) -> None:
    """Raise ValueError naming every head/feature count that `model` devices cannot split.

    A vocabulary that does not divide is no error: embeddings are then replicated (logged).
    """
    counts = {"num_attention_heads": config.num_attention_heads,
              "num_key_value_heads": config.num_key_value_heads,
              "intermediate_size": config.intermediate_size}
    bad = [f"{name}={n}" for name, n in counts.items() if n % model]
    if bad:
        sizes = [m for m in range(1, config.num_key_value_heads + 1) if not any(n % m for n in counts.values())]
        raise ValueError(f"tensor parallelism over a mesh 'model' axis of size {model} needs "
                         f"{', '.join(bad)} to be divisible by {model}; model sizes that divide "
                         f"this config: {sizes}")
    if not vocab_is_sharded(config, model):
        logging.getLogger(__name__).warning(
            "vocab_size=%d does not divide by the model axis size %d: embeddings and lm_head "
            "are replicated on every device", config.vocab_size, model)


def vocab_is_sharded(config: LlamaConfig, model: int) -> bool:
    """Whether embeddings (and lm_head) are split by vocabulary; else they are replicated."""
    return config.vocab_size % model == 0


def param_spec(names: tuple, config: LlamaConfig, model: int) -> P:
    """PartitionSpec of the parameter at NNX path `names`, e.g. ("model", "layers", "mlp", ...)."""
    if tuple(names[:2]) == ("model", "layers"):
        # Stacked decoder layers: each layer's slice is split as an unstacked one would be.
        return P(None, *_unstacked_spec(names, config, model))
    return _unstacked_spec(names, config, model)


def _unstacked_spec(names: tuple, config: LlamaConfig, model: int) -> P:
    module, leaf = names[-2], names[-1]
    vocab = "model" if vocab_is_sharded(config, model) else None
    if module in _COLUMN:
        return P(None, "model") if leaf == "kernel" else P("model")
    if module in _ROW:
        return P("model", None) if leaf == "kernel" else P()
    if module == "embed_tokens":
        return P(vocab, None)
    if module == "lm_head":
        return P(None, vocab) if leaf == "kernel" else P(vocab)
    if module.endswith("norm"):
        return P()
    raise ValueError(f"no sharding rule for parameter {'.'.join(map(str, names))}")


def _names(path) -> tuple:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def param_shardings(params_state, config: LlamaConfig, mesh: Mesh):
    """The NamedSharding of every parameter, as a pytree shaped like `params_state`."""
    model = mesh.shape["model"]
    check_tensor_parallel(config, model)
    return jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, param_spec(_names(path), config, model)), params_state)


def shard_params(params_state, config: LlamaConfig, mesh: Mesh):
    """`params_state` (e.g. `nnx.split(model)[1]`) placed with `param_shardings`."""
    return jax.device_put(params_state, param_shardings(params_state, config, mesh))


# ----------------------------------------------------------------------------- KV cache


def kv_cache_sharding(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
    """Sharding of one pool, device or host: split along the kv-head axis (axis 3)."""
    return NamedSharding(mesh, _KV_POOL_SPEC, memory_kind=memory_kind)


def kv_cache_shardings(mesh: Mesh, host_memory_kind: str | None) -> kc.KVCache:
    """A KVCache whose leaves are the shardings of its pools (a jit in/out_shardings tree)."""
    device, host = kv_cache_sharding(mesh), kv_cache_sharding(mesh, host_memory_kind)
    return kc.KVCache(k=device, v=device, host_k=host, host_v=host, host_memory_kind=host_memory_kind)


def shard_kv_cache(cache: kc.KVCache, mesh: Mesh) -> kc.KVCache:
    """`cache` resharded by kv head; host pools stay in their memory kind."""
    return jax.device_put(cache, kv_cache_shardings(mesh, cache.host_memory_kind))


def init_sharded_kv_cache(mesh: Mesh, num_layers: int, num_device_blocks: int, num_host_blocks: int,
                          block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> kc.KVCache:
    """`init_kv_cache`'s zeroed pools, created already sharded (no whole pool on one device)."""
    if num_kv_heads % mesh.shape["model"]:
        raise ValueError(f"num_key_value_heads={num_kv_heads} is not divisible by the mesh's "
                         f"model axis size {mesh.shape['model']}")
    kind = kc.host_memory_kind(mesh.devices.flat[0])
    shardings = kv_cache_shardings(mesh, kind)
    dev_shape = (num_device_blocks, num_layers, block_size, num_kv_heads, head_dim)
    host_shape = (max(num_host_blocks, 1),) + dev_shape[1:]
    zeros = jax.jit(lambda: jnp.zeros(dev_shape, dtype), out_shardings=shardings.k)
    host_zeros = lambda: jax.make_array_from_callback(  # noqa: E731  built on the host, per shard
        host_shape, shardings.host_k, lambda index: np.zeros(_slice_shape(host_shape, index), dtype))
    return kc.KVCache(k=zeros(), v=zeros(), host_k=host_zeros(), host_v=host_zeros(), host_memory_kind=kind)


def _slice_shape(shape: tuple, index: tuple) -> tuple:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


# ----------------------------------------------------------------------------- forward


def make_sharded_forward(mesh: Mesh, param_shardings_tree, host_memory_kind: str | None = None,
                         impl: str = "chunked", write_cache: bool = True) -> Callable:
    """`paged_forward` jitted for `mesh`: `(graphdef, params, tokens, positions, metadata,
    kv_cache) -> (logits, kv_cache)`, all positional. With `write_cache=False` it is
    `paged_forward_new_kv` instead: `-> (logits, (k, v))`, the step's K/V [L, T, H_kv, D]
    sharded by kv head like the cache, which is then only read (the engine writes them).

    in/out_shardings are explicit: params as `param_shardings_tree`, tokens, positions,
    metadata and logits replicated, the cache by kv head (its host pools in
    `host_memory_kind`, default: what `init_kv_cache` picks for the mesh's devices). The cache
    is donated. Single-device inputs (e.g. `make_metadata`'s) are moved onto the mesh; the
    params and cache must already carry these shardings (`shard_params`, `shard_kv_cache`).
    """
    if host_memory_kind is None:
        host_memory_kind = kc.host_memory_kind(mesh.devices.flat[0])
    replicated = NamedSharding(mesh, P())
    cache = kv_cache_shardings(mesh, host_memory_kind)
    in_shardings = (param_shardings_tree, replicated, replicated, replicated, cache)
    if not write_cache:
        new_kv = NamedSharding(mesh, P(None, None, "model", None))
        return jax.jit(functools.partial(paged_forward_new_kv, impl=impl), static_argnums=0,
                       in_shardings=in_shardings, out_shardings=(replicated, (new_kv, new_kv)))
    return jax.jit(functools.partial(paged_forward, impl=impl), static_argnums=0,
                   in_shardings=in_shardings, out_shardings=(replicated, cache), donate_argnums=5)


# ----------------------------------------------------------------------------- weight loading


def place_hf_tensors(model_abstract_or_config, tensors: dict[str, np.ndarray], mesh: Mesh):
    """Params (an nnx.State) holding HF-named host `tensors`, each device given only its slice.

    `model_abstract_or_config`: a LlamaConfig, or a model (e.g. `nnx.eval_shape(...)`) whose
    `nnx.graphdef` the caller merges these params into. Every array is built with
    `jax.make_array_from_callback`: the callback slices the host arrays (transposed as views
    for kernels), stacks the layers' slices and casts only them, so no device ever holds more
    than its shard.
    Raises ValueError naming missing, unexpected and mis-shaped tensors.
    """
    model = model_abstract_or_config
    if isinstance(model, LlamaConfig):
        model = nnx.eval_shape(lambda: LlamaForCausalLM(model_abstract_or_config, nnx.Rngs(0)))
    config, size = model.config, mesh.shape["model"]
    check_tensor_parallel(config, size)
    expected = check_hf_tensors(model, tensors)
    dtype = jnp.dtype(config.dtype)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    by_path = dict(flat)
    for path, (shape, fill, _) in stack_hf_tensors(expected, tensors, dtype).items():
        sharding = NamedSharding(mesh, param_spec(path, config, size))
        by_path[path].set_value(jax.make_array_from_callback(shape, sharding, fill))
    return nnx.from_flat_state(flat)


# ----------------------------------------------------------------------------- multi-host


def is_leader(process_index: int | None = None) -> bool:
    """Whether this process (or the given index) is process 0: the one serving requests."""
    return (jax.process_index() if process_index is None else process_index) == 0


def share_from_leader(tree, process_index: int | None = None, broadcast=None):
    """Every host calls this with a same-shaped pytree; all get the leader's values back.

    Followers pass placeholders of the same shapes (e.g. an empty request batch). `broadcast`
    defaults to `multihost_utils.broadcast_one_to_all` (the identity in one process); tests
    inject a fake to simulate several hosts.
    """
    broadcast = broadcast or multihost_utils.broadcast_one_to_all
    return broadcast(tree, is_source=is_leader(process_index))


def place_model(model_config, tensors, instance, cap, tp, devices, attention_impl):
    """(graphdef, params, forward, kv cache, place-state fn) on one device or a TP mesh."""
    from models.llama import LlamaForCausalLM, paged_forward_new_kv
    mc = model_config
    dtype = jnp.dtype(mc.dtype)
    shape = (mc.num_hidden_layers, cap.num_device_blocks + 1, cap.num_host_blocks + 1, cap.block_size,
             mc.num_key_value_heads, mc.head_dim)
    if tp == 1 and not devices:
        if instance is None:
            from models.loader import build_model
            # The host tensors are not needed again: freed as they are placed, for a lower peak.
            instance = build_model(mc, tensors, consume=True)
        graphdef, params = nnx.split(instance)
        return graphdef, params, paged_forward_new_kv, kc.init_kv_cache(*shape, dtype=dtype), lambda st: st
    from jax.sharding import NamedSharding, PartitionSpec
    check_tensor_parallel(mc, tp)
    mesh = make_mesh(1, tp, devices)
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(mc, nnx.Rngs(0)))
    graphdef = nnx.graphdef(abstract)
    # Each device receives only its own slice of every weight.
    params = (place_hf_tensors(abstract, tensors, mesh) if tensors is not None
              else shard_params(nnx.state(instance, nnx.Param), mc, mesh))
    kv = init_sharded_kv_cache(mesh, *shape, dtype=dtype)
    fwd = make_sharded_forward(mesh, param_shardings(nnx.state(abstract, nnx.Param), mc, mesh),
                               impl=attention_impl, write_cache=False)
    forward = MeshForward(fwd)
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(state):
        # The scheduler state and token buffers are small: replicated over the mesh.
        rest = jax.device_put(state.replace(kv=None), replicated)
        return rest.replace(kv=state.kv)
    return graphdef, params, forward, kv, place


@dataclasses.dataclass(frozen=True, eq=False)
class MeshForward:
    """The engine's forward signature over a mesh-jitted forward (it takes no `impl`)."""
    fn: object

    def __call__(self, graphdef, params, tokens, positions, metadata, kv_cache, impl):
        del impl
        return self.fn(graphdef, params, tokens, positions, metadata, kv_cache)


# ----------------------------------------------------------------------------- the engine step


class MeshStepParts:
    """`LazyStep`'s three parts jitted for a mesh, each bucket of the model part on first use.

    The shardings are explicit and fixed from the placed `state` and `params`: the state keeps
    its placement (KV pools by kv head, the rest replicated), requests, the step's plan and
    the logits are replicated. So each part compiles once (the model part once per token
    bucket) and an output never comes back with a sharding that would compile it again.
    Called as `LazyStep` calls its parts (`spec=`, and `size=` for the model).
    """

    def __init__(self, spec, state, params):
        from jaxsched.engine.compile_options import part_options
        from jaxsched.engine.step import finish_impl, plan_impl
        self.spec = spec
        self._options = {part: dict(part_options(part)) or None for part in ("plan", "model", "finish")}
        replicated = NamedSharding(state.kv.k.sharding.mesh, P())
        state_sh = jax.tree.map(lambda x: x.sharding, state)
        self._params_sh = jax.tree.map(lambda x: x.sharding, params)
        self._kv_sh, self._replicated = state_sh.kv, replicated
        self._plan = jax.jit(functools.partial(plan_impl, spec=spec), donate_argnums=(0,),
                             compiler_options=self._options["plan"],
                             in_shardings=(state_sh, replicated, replicated), out_shardings=(state_sh, replicated))
        self._finish = jax.jit(functools.partial(finish_impl, spec=spec), donate_argnums=(0,),
                               compiler_options=self._options["finish"],
                               in_shardings=(state_sh, replicated, replicated),
                               out_shardings=(state_sh, replicated))
        self.models: dict[int, Callable] = {}           # token bucket -> its jitted model part

    def _same(self, spec) -> None:
        if spec is not self.spec and spec != self.spec:
            raise ValueError("MeshStepParts: called with another EngineSpec than it was built for")

    def plan(self, state, new, now, *, spec):
        self._same(spec)
        return self._plan(state, new, now)

    def model(self, params, kv, plan, *, spec, size: int):
        self._same(spec)
        if size not in self.models:
            from jaxsched.engine.step import model_impl
            self.models[size] = jax.jit(
                functools.partial(model_impl, spec=spec, size=size), donate_argnums=(1,),
                compiler_options=self._options["model"],
                in_shardings=(self._params_sh, self._kv_sh, self._replicated),
                out_shardings=(self._replicated, self._kv_sh))
        return self.models[size](params, kv, plan)

    def finish(self, state, plan, logits, *, spec):
        self._same(spec)
        return self._finish(state, plan, logits)

    def cache_sizes(self) -> dict:
        """Compiled programs per part (the model's per bucket): each should stay at 1."""
        return {"plan": self._plan._cache_size(), "finish": self._finish._cache_size(),
                **{f"model_{size}": fn._cache_size() for size, fn in self.models.items()}}


def mesh_step(spec, state, params):
    """The engine step over a mesh as a `LazyStep`: a token bucket compiles when a step first
    needs it, as on one device (`LLM.warm_up` compiles them all ahead of serving)."""
    from jaxsched.engine.step import LazyStep
    parts = MeshStepParts(spec, state, params)
    step = LazyStep(spec, plan=parts.plan, model=parts.model, finish=parts.finish)
    step.parts = parts
    return step
