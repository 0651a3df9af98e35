"""The store of compiled sweep chunks: keys, whole entries, eviction, and executables that
load in another process even when JAX's cache had the program first."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsched.sim import executable_store as store


def _f(x, scale):
    return jnp.sort(x * scale + 1)[::-1].cumsum()


def _compiled(x, scale=3):
    return store.compile_fresh(jax.jit(_f, static_argnames="scale").trace(x, scale=scale).lower(), None)


def test_key__changes_with_every_input_of_the_compile(monkeypatch):
    x = jnp.arange(8.0)
    base = store.key("f", {"scale": 3}, (x,), None)
    assert base == store.key("f", {"scale": 3}, (x,), None)
    others = [store.key("g", {"scale": 3}, (x,), None),
              store.key("f", {"scale": 4}, (x,), None),
              store.key("f", {"scale": 3}, (jnp.arange(9.0),), None),
              store.key("f", {"scale": 3}, (jnp.arange(8),), None),
              store.key("f", {"scale": 3}, ((x, x),), None),
              store.key("f", {"scale": 3}, (x,), {"xla_disable_hlo_passes": "tree_reduction_rewriter"})]
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")
    others.append(store.key("f", {"scale": 3}, (x,), None))
    assert len({base, *others}) == len(others) + 1


def test_save_then_load__runs_as_compiled_and_a_bad_entry_is_dropped(tmp_path):
    x = jnp.arange(8.0)
    exe = _compiled(x)
    name = store.key("f", {"scale": 3}, (x,), None)
    assert store.load(tmp_path, name) is None
    store.save(tmp_path, name, store.serialized(exe))
    loaded, blob = store.load(tmp_path, name)
    np.testing.assert_array_equal(loaded(x), exe(x))
    assert blob == (tmp_path / (name + store.SUFFIX)).read_bytes()
    assert not list(tmp_path.glob(".partial-*"))
    (tmp_path / (name + store.SUFFIX)).write_bytes(blob[: len(blob) // 2])      # cut short
    assert store.load(tmp_path, name) is None
    assert not (tmp_path / (name + store.SUFFIX)).exists()


def test_save__keeps_the_most_recently_used(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "MAX_ENTRIES", 2)
    blob = store.serialized(_compiled(jnp.arange(4.0)))
    for i, name in enumerate("abc"):
        store.save(tmp_path, name, blob)
        os.utime(tmp_path / (name + store.SUFFIX), (1000 + i, 1000 + i))
    assert sorted(p.stem for p in tmp_path.glob("*" + store.SUFFIX)) == ["b", "c"]
    assert store.load(tmp_path, "b") is not None          # used: now newer than c
    store.save(tmp_path, "d", blob)
    assert sorted(p.stem for p in tmp_path.glob("*" + store.SUFFIX)) == ["b", "d"]


def test_save__an_unwritable_store_is_no_error(tmp_path):
    (tmp_path / "file").write_text("")
    store.save(tmp_path / "file", "a", b"bytes")        # a file where the folder would go


def test_directory__on_exactly_when_jax_persistent_cache_is(tmp_path):
    was = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert store.directory() is None
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        assert store.directory() == tmp_path / store.SUBDIR
    finally:
        jax.config.update("jax_compilation_cache_dir", was)


SCRIPT = """
import pickle, sys
import jax, jax.numpy as jnp
from jaxsched.entrypoints.compilation_cache import enable_compilation_cache
enable_compilation_cache(sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from jaxsched.sim import executable_store as store
f = lambda x: jnp.sort(x * 3 + 1)[::-1].cumsum()
x = jnp.arange(8.0)
if sys.argv[1] == "jax-cache":
    jax.jit(f).lower(x).compile()
elif sys.argv[1] in ("plain", "fresh"):
    lowered = jax.jit(f).trace(x).lower()
    exe = lowered.compile() if sys.argv[1] == "plain" else store.compile_fresh(lowered, None)
    open(sys.argv[3], "wb").write(store.serialized(exe))
else:
    from jax.experimental.serialize_executable import deserialize_and_load
    print(deserialize_and_load(*pickle.loads(open(sys.argv[3], "rb").read()))(x).tolist())
"""


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's code-less executables")
def test_compile_fresh__serializes_with_its_code_though_jax_cache_had_it(tmp_path):
    """JAX's cache holds the program; compiled through it, the executable serializes without
    its code and fails to load in another process (what the store must never save), while
    `compile_fresh` compiles it again, whole."""
    env = {k: v for k, v in os.environ.items() if k != "JAXSCHED_COMPILATION_CACHE_DIR"}
    run = lambda *args: subprocess.run([sys.executable, "-c", SCRIPT, *args], env=env,   # noqa: E731
                                       capture_output=True, text=True, timeout=120)
    cache = str(tmp_path / "cache")
    assert run("jax-cache", cache).returncode == 0
    for how in ("plain", "fresh"):
        got = run(how, cache, str(tmp_path / how))
        assert got.returncode == 0, got.stderr[-2000:]
    assert "not found" in run("load", cache, str(tmp_path / "plain")).stderr
    loaded = run("load", cache, str(tmp_path / "fresh"))
    assert loaded.returncode == 0 and loaded.stdout.split("\n")[0] == "[22.0, 41.0, 57.0, 70.0, 80.0, 87.0, 91.0, 92.0]"


SIMULATE = """
import json, sys
from jaxsched.entrypoints.compilation_cache import enable_compilation_cache
enable_compilation_cache(sys.argv[2])
from jaxsched.sim import simulate as sm
if sys.argv[1] == "load":           # the chunk must come from the store: tracing it fails
    def run_chunk(*args, **kwargs):
        raise AssertionError("simulate traced its chunk")
    sm.run_chunk = run_chunk
trace = json.load(open(sys.argv[3]))
print(json.dumps(sm.simulate(trace["config"], trace["requests"])))
"""


def test_simulate__a_second_process_loads_its_chunk_without_tracing_it(tmp_path):
    from conftest import make_requests
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"config": dict(block_size=16, num_device_blocks=12, num_host_blocks=16,
                                                max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256),
                                 "requests": make_requests(12, seed=3, prompt=(1, 120), max_tokens=(1, 30))}))
    env = {k: v for k, v in os.environ.items() if k != "JAXSCHED_COMPILATION_CACHE_DIR"}
    cache = tmp_path / "cache"
    results = []
    for mode in ("fill", "load"):
        got = subprocess.run([sys.executable, "-c", SIMULATE, mode, str(cache), str(trace)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert got.returncode == 0, got.stderr[-3000:]
        results.append(json.loads(got.stdout.strip().splitlines()[-1]))
    assert len(list((cache / store.SUBDIR).glob("*" + store.SUFFIX))) == 1
    assert results[0] == results[1] and results[0]["num_preemptions"] > 0
