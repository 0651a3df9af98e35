"""The state's packing: every field round-trips through storage, in one leaf, in three, and in
one leaf per field (a sweep chunk's layout)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsched import SchedulerConfig, init_state
from jaxsched.core.state import (ADMISSION_FIELDS, FIELDS, LIMIT_FIELDS, ONE_LEAF_BYTES, SCALAR_SHAPES,
                                 SchedulerOutput, SchedulerState, Status, layout, make_limits,
                                 stacked_limits)


def _random_value(field, shape, rng):
    if field.kind == "float32":
        return jnp.asarray(rng.normal(size=shape).astype(np.float32))
    if field.kind == "bool":
        return jnp.asarray(rng.random(shape) < 0.5)
    if field.kind == "uint32":
        return jnp.asarray(rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32))
    return jnp.asarray(rng.integers(-2**31, 2**31, size=shape, dtype=np.int64).astype(np.int32))


@pytest.mark.parametrize("slots, caching", [(4, False), (1024, False), (4, True), (1024, True)])
def test_state__every_field_round_trips_and_replace_touches_only_its_fields(slots, caching):
    config = SchedulerConfig(num_slots=slots, max_model_len=256, num_device_blocks=64,
                             enable_prefix_caching=caching)
    state = init_state(config)
    lay = layout(state.dims)
    assert len(state.data) == (3 if 4 * sum(lay["sizes"]) > ONE_LEAF_BYTES else 1) == len(lay["sizes"])
    # The cache fields (SPEC A10) exist exactly when caching is compiled in.
    assert state.caching == caching == all(f.name in lay for f in FIELDS)
    FIELDS_HERE = [f for f in FIELDS if f.name in lay]
    rng = np.random.default_rng(slots)
    values = {f.name: _random_value(f, lay[f.name][2], rng) for f in FIELDS_HERE}
    new = state.replace(**values)
    for f in FIELDS_HERE:
        np.testing.assert_array_equal(new.get(f.name), values[f.name], err_msg=f.name)
    # Typed accessors read the same; limits come back as a Limits.
    np.testing.assert_array_equal(new.status, values["status"])
    assert set(new.limits.__dataclass_fields__) == set(LIMIT_FIELDS)
    one = new.replace(n=jnp.zeros_like(values["n"]))
    for f in FIELDS_HERE:
        expect = np.zeros_like(values["n"]) if f.name == "n" else values[f.name]
        np.testing.assert_array_equal(one.get(f.name), expect, err_msg=f.name)
    # Packing from fields gives the same storage.
    fields = {k: v for k, v in values.items() if k not in LIMIT_FIELDS}
    packed = SchedulerState.from_fields(**fields, limits=new.limits, key_bits=state.key_bits or 64)
    for a, b in zip(packed.data, new.data):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="unknown fields"):
        state.replace(bogus=1)


@pytest.mark.parametrize("slots, caching", [(4, False), (1024, False), (4, True)])
def test_state__per_field_layout_holds_the_same_fields_and_packs_back_exactly(slots, caching):
    config = SchedulerConfig(num_slots=slots, max_model_len=256, num_device_blocks=64,
                             enable_prefix_caching=caching)
    state = init_state(config)
    lay = layout(state.dims)
    names = [f.name for f in FIELDS if f.name in lay]
    rng = np.random.default_rng(slots + 1)
    state = state.replace(**{n: _random_value(f, lay[n][2], rng) for f in FIELDS if (n := f.name) in lay})
    # Stacked along a run axis, as a sweep holds it.
    runs = jax.tree.map(lambda x: jnp.stack([x, x[::-1] if x.ndim else x]), state)
    split = runs.per_field()
    shared = [f.name for f in FIELDS
              if f.name in lay and (f.shape in SCALAR_SHAPES or f.name in ADMISSION_FIELDS)]
    assert len(split.data) == len(names) - len(shared) + 2 and split.caching == caching
    assert split.per_field() is split and split.key_bits == state.key_bits
    for n in names:
        np.testing.assert_array_equal(split.get(n), runs.get(n), err_msg=n)
    # A write touches only its own leaf; packing back gives the packed storage bit for bit.
    zero = split.replace(n=jnp.zeros((2, slots), jnp.int32))
    assert sum(a is not b for a, b in zip(zero.data, split.data)) == 1
    # The scalars share one leaf, which a write of one of them rewrites alone.
    stepped = split.replace(step=split.step + 1)
    assert sum(a is not b for a, b in zip(stepped.data, split.data)) == 1
    for n in names:
        np.testing.assert_array_equal(stepped.get(n), runs.get(n) + 1 if n == "step" else runs.get(n),
                                      err_msg=n)
    back = zero.per_field(False)
    assert back.dims == state.dims
    for a, b in zip(back.data, runs.replace(n=jnp.zeros((2, slots), jnp.int32)).data):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("per_field", [False, True])
def test_state__put_slots_writes_the_rows_of_its_slots_and_drops_out_of_range_ones(per_field):
    config = SchedulerConfig(num_slots=8, max_model_len=64, num_device_blocks=32, max_seqs_per_group=2)
    state = init_state(config)
    lay = layout(state.dims)
    rng = np.random.default_rng(3)
    state = state.replace(**{n: _random_value(f, lay[n][2], rng) for f in FIELDS if (n := f.name) in lay})
    state = state.per_field(per_field)
    slot = jnp.array([5, 8, 1], jnp.int32)          # 8: no such slot, dropped
    rows = dict(status=jnp.array([1, 2, 3]), arrival_time=jnp.array([0.5, 1.5, 2.5], jnp.float32),
                n=jnp.array([2, 2, 1]), forked=True, num_tokens=jnp.array([[7, 0], [8, 0], [9, 9]]),
                block_table=0)
    got = state.put_slots(slot, **rows)
    for name in [f.name for f in FIELDS if f.name in lay]:
        want = np.array(state.get(name))
        if name in rows:
            value = np.broadcast_to(np.asarray(rows[name]), (3,) + want.shape[1:])
            want[[5, 1]] = value[[0, 2]]
        np.testing.assert_array_equal(got.get(name), want, err_msg=name)
    with pytest.raises(TypeError, match="device_ref is not indexed by slot"):
        state.put_slots(slot, device_ref=0)
    with pytest.raises(TypeError, match="unknown field seq_key"):      # no prefix caching here
        state.put_slots(slot, seq_key=0)


def test_state__stacked_limits_are_each_configs_limits():
    configs = [SchedulerConfig(num_device_blocks=b, max_num_seqs=s, preemption_mode=m, watermark=0.05)
               for b in (64, 96) for s in (8, 16) for m in ("recompute", "swap", "auto")]
    stacked = stacked_limits(configs)
    for i, c in enumerate(configs):
        one = make_limits(c)
        for f in LIMIT_FIELDS:
            got, want = getattr(stacked, f)[i], getattr(one, f)
            assert got.dtype == want.dtype and got == want, (f, c)


def test_state__is_a_pytree_whose_dims_are_static_and_docs_name_every_field():
    state = init_state(SchedulerConfig(num_device_blocks=8))
    leaves, tree = jax.tree.flatten(state)
    assert jax.tree.unflatten(tree, leaves).dims == state.dims
    assert all(f.name in SchedulerState.__doc__ for f in FIELDS if f.name not in LIMIT_FIELDS)
    text = repr(state)
    assert "device_blocks=8" in text and "waiting=0" in text
    assert int((np.asarray(state.status) == Status.EMPTY).sum()) == state.dims[0]
    assert set(state.as_dict()) >= {"status", "block_table", "limits"}


def test_output__fields_round_trip():
    g, p = 5, 3
    rng = np.random.default_rng(0)
    fields = {}
    for name in SchedulerOutput._fields:
        f = getattr(SchedulerOutput, name)
        shape = {"slots": (g,), "pairs": (p, 2), "counts": ()}[f.region]
        fields[name] = jnp.asarray(rng.random(shape) < 0.5) if f.kind == "bool" else \
            jnp.asarray(rng.integers(0, 100, shape).astype(np.int32))
    out = SchedulerOutput.from_fields(**fields)
    assert out.dims == (g, p)
    for name, value in fields.items():
        np.testing.assert_array_equal(getattr(out, name), value, err_msg=name)
