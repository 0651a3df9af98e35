"""KV cache sizing from memory: the arithmetic by hand, the start-up errors, a real start-up.

The arithmetic tests inject every figure (memory, weights, working memory); the start-ups use
a tiny random model so each compiles in seconds.
"""
from __future__ import annotations

import logging

import pytest
from flax import nnx

from jaxsched.engine import sizing
from jaxsched.entrypoints.cli import build_parser, engine_kwargs
from jaxsched.engine.sizing import GiB, MemoryProfile, SizingError, bytes_per_block, plan_cache
from models.llama import LlamaConfig, LlamaForCausalLM

# (model shape, dtype, block size, tensor-parallel size) -> bytes per block, by hand:
# 2 (K and V) x layers x block_size x (kv heads / tp) x head_dim x bytes per element.
SHAPES = [
    (dict(num_layers=30, num_kv_heads=3, head_dim=64), "float32", 16, 1, 737_280),    # SmolLM2-135M
    (dict(num_layers=32, num_kv_heads=8, head_dim=128), "bfloat16", 16, 1, 2 << 20),  # Llama-3-8B
    (dict(num_layers=32, num_kv_heads=8, head_dim=128), "bfloat16", 16, 2, 1 << 20),  # ... over 2
    (dict(num_layers=24, num_kv_heads=2, head_dim=64), "float16", 32, 1, 393_216),
    (dict(num_layers=2, num_kv_heads=2, head_dim=8), "float32", 4, 2, 512),
]


@pytest.mark.parametrize("shape, dtype, block_size, tp, expected", SHAPES)
def test_bytes_per_block_by_hand(shape, dtype, block_size, tp, expected):
    assert bytes_per_block(**shape, dtype=dtype, block_size=block_size, tensor_parallel_size=tp) == expected


def profile(total, weights, peak, block, host=64 * GiB, tp=1):
    return MemoryProfile(total_bytes=total, source="injected", weights_bytes=weights, peak_bytes=peak,
                         block_bytes=block, host_total_bytes=host, tensor_parallel_size=tp)


# (profile, utilization, swap GiB) -> (device blocks, host blocks), by hand:
# (int(total x utilization) - weights - peak) // block - 1, and swap x GiB // block - 1.
BUDGETS = [
    # SmolLM2 on 8 GiB: int(0.9 x 8 GiB) = 7730941132; - 538060032 - 69076328 = 7123804772;
    # // 737280 = 9662, less the null block.
    (profile(8 * GiB, 538_060_032, 69_076_328, 737_280), 0.9, 4, 9661, 5824),
    # Llama-3-8B bf16 on 80 GiB: 72 GiB - 16 GiB weights - 1 GiB = 55 GiB = 28160 blocks of 2 MiB.
    (profile(80 * GiB, 16 * GiB, GiB, 2 << 20), 0.9, 4, 28159, 2047),
    # ... over tp=2: 8 GiB of weights and 1 MiB blocks per device: 63 GiB = 64512 blocks.
    (profile(80 * GiB, 8 * GiB, GiB, 1 << 20, tp=2), 0.9, 4, 64511, 4095),
    # 16 GiB at 0.5: 8 GiB - 1 GiB = 7 GiB // 393216 = 19114; 1 GiB of swap = 2730.
    (profile(16 * GiB, 0, GiB, 393_216), 0.5, 1, 19113, 2729),
]


@pytest.mark.parametrize("prof, util, swap, device, host", BUDGETS)
def test_block_counts_from_a_fixed_budget(prof, util, swap, device, host):
    # max_num_seqs and max_model_len large enough that the usable-blocks cap does not bite.
    plan = plan_cache(prof, gpu_memory_utilization=util, swap_space=swap, block_size=16,
                      max_num_seqs=1024, context_len=4096)
    assert (plan.fit_device_blocks, plan.fit_host_blocks) == (device, host)
    assert (plan.num_device_blocks, plan.num_host_blocks) == (device, host)
    assert plan.max_model_len == 4096
    assert plan.max_concurrency == pytest.approx(device / 256)


def test_sized_pools_are_capped_at_what_running_sequences_can_hold():
    plan = plan_cache(profile(8 * GiB, 0, 0, 737_280), block_size=16, max_num_seqs=4,
                      context_len=8192, default_max_model_len=1024)
    # 4 sequences x ceil(1025 / 16) = 65 blocks each.
    assert (plan.num_device_blocks, plan.num_host_blocks, plan.max_model_len) == (260, 260, 1024)
    assert plan.fit_device_blocks > 260
    lines = plan.log_lines()
    assert "# device blocks: 260 (4160 tokens; sized;" in lines[1] and "capped" in lines[1]
    assert lines[3] == "maximum concurrency for 1024 tokens per request: 4.06x"


def test_explicit_counts_win_and_need_no_profile():
    plan = plan_cache(None, block_size=16, max_num_seqs=8, context_len=512,
                      num_device_blocks=16, num_host_blocks=64, max_model_len=512)
    assert (plan.num_device_blocks, plan.num_host_blocks) == (16, 64)
    # A deliberately small explicit cache is allowed (the scheduler ignores what never fits).
    assert any("needs 32 blocks, more than the explicit num_device_blocks=16" in w for w in plan.warnings)
    # One explicit, one sized.
    plan = plan_cache(profile(GiB, 0, 0, 1 << 20), block_size=16, max_num_seqs=1024, context_len=512,
                      num_device_blocks=16, swap_space=1)
    assert (plan.num_device_blocks, plan.num_host_blocks) == (16, 1023)


def test_start_up_errors_have_the_numbers():
    smol = dict(block_size=16, max_num_seqs=16, context_len=8192)
    with pytest.raises(SizingError, match=r"the weights alone \(2.00 GiB on each device\) exceed "
                                          r"gpu_memory_utilization 0.9 x 1.00 GiB"):
        plan_cache(profile(GiB, 2 * GiB, 0, 737_280), **smol)
    with pytest.raises(SizingError, match="no room for the KV cache"):
        plan_cache(profile(GiB, int(0.9 * GiB) - 1000, 0, 737_280), **smol)
    # 0.5 GiB of KV room = 728 blocks of 16 tokens; 8192 tokens need 512: fits, 16384 would not.
    room = profile(GiB, int(0.4 * GiB), 0, 737_280)
    assert plan_cache(room, max_model_len=8192, **smol).max_model_len == 8192
    tight = profile(GiB, int(0.8 * GiB), 0, 737_280)          # 145 blocks
    with pytest.raises(SizingError, match="max_model_len 8192: one sequence needs 512 blocks, the cache "
                                          "has 144: raise gpu_memory_utilization or lower max_model_len"):
        plan_cache(tight, max_model_len=8192, **smol)
    # The default max_model_len is shortened to fit, with a warning.
    plan = plan_cache(tight, **smol)
    assert plan.max_model_len == 144 * 16
    assert any("max_model_len lowered from 8192 to 2304" in w for w in plan.warnings)
    with pytest.raises(SizingError, match=r"swap_space: 48 GiB x 1 worker\(s\) = 48.00 GiB is 75% of the "
                                          r"host's 64.00 GiB, more than 70%: lower swap_space"):
        plan_cache(profile(8 * GiB, 0, 0, 737_280), swap_space=48, **smol)
    plan = plan_cache(profile(8 * GiB, 0, 0, 737_280), swap_space=16, **smol, )
    assert not plan.warnings
    plan = plan_cache(profile(8 * GiB, 0, 0, 737_280, tp=2), swap_space=16, **smol)
    assert any("32.00 GiB is 50% of the host's 64.00 GiB, more than 40%" in w for w in plan.warnings)
    with pytest.raises(SizingError, match="gpu_memory_utilization: must be in"):
        plan_cache(profile(8 * GiB, 0, 0, 737_280), gpu_memory_utilization=1.5, **smol)


def test_process_memory_takes_the_smaller_and_names_it(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    cgroup = tmp_path / "memory.max"
    cgroup.write_text("4096000000\n")
    got = sizing.process_memory(meminfo_path=str(meminfo), cgroup_paths=(str(cgroup),))
    assert (got.bytes, got.source) == (4_096_000_000, f"cgroup limit {cgroup}")
    cgroup.write_text("max\n")
    got = sizing.process_memory(meminfo_path=str(meminfo), cgroup_paths=(str(cgroup),))
    assert (got.bytes, got.source) == (8_000_000 * 1024, f"MemAvailable of {meminfo}")
    got = sizing.process_memory("MemTotal", meminfo_path=str(meminfo), cgroup_paths=())
    assert got.bytes == 16_000_000 * 1024


# ----------------------------------------------------------------------------- real start-ups

TINY = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                   max_position_embeddings=256)
ENGINE = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=32, num_slots=8,
              attention_impl="reference")


def start(**kw):
    from jaxsched import LLM
    return LLM(LlamaForCausalLM(TINY, nnx.Rngs(0)), **ENGINE, **kw)


def test_real_start_up_sizes_from_measured_numbers_logs_and_serves(caplog):
    from jaxsched import SamplingParams
    with caplog.at_level(logging.INFO, logger="jaxsched.engine.sizing"):
        llm = start(max_model_len=64)
    plan = llm.cache_plan
    p = plan.profile
    assert p.peak_source.startswith("memory analysis") and p.peak_bytes > 0
    assert p.weights_bytes == sum(x.nbytes for x in __import__("jax").tree.leaves(llm.params))
    assert p.block_bytes == 2 * 2 * 4 * 2 * 8 * 4
    assert "no device memory of its own" in p.source          # CPU: the process's memory, named
    # This machine's memory is large: the cap (4 sequences x ceil(65 / 4) blocks) decides.
    assert (llm.config.num_device_blocks, llm.config.num_host_blocks) == (68, 68)
    text = caplog.text
    assert "# device blocks: 68 (272 tokens; sized;" in text and "# host blocks: 68" in text
    assert "maximum concurrency for 64 tokens per request: 4.25x" in text
    out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]

    # A fixed device budget: the counts follow from the measured weights and working memory.
    total = p.weights_bytes + p.peak_bytes + 40 * p.block_bytes
    llm = start(max_model_len=64, device_memory_bytes=total, gpu_memory_utilization=1.0, swap_space=0.00005)
    assert llm.config.num_device_blocks == (total - p.weights_bytes - p.peak_bytes) // p.block_bytes - 1 == 39
    assert llm.config.num_host_blocks == int(0.00005 * GiB) // p.block_bytes - 1 == 51
    assert llm.cache_plan.profile.source == "injected device_memory_bytes"
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_start_up_errors_and_explicit_counts(monkeypatch):
    import jax
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(LlamaForCausalLM(TINY, nnx.Rngs(0)))))
    with pytest.raises(SizingError, match="the weights alone"):
        start(device_memory_bytes=1000)
    # A working memory injected, so the budget leaves exactly 30 blocks of 1024 bytes (29 usable).
    monkeypatch.setattr(sizing, "measure_peak_bytes", lambda *a, **k: 100_000)
    with pytest.raises(SizingError, match=r"max_model_len 256: one sequence needs 64 blocks, the cache "
                                          r"has 29: raise gpu_memory_utilization or lower max_model_len"):
        start(max_model_len=256, device_memory_bytes=weights + 100_000 + 30 * 1024, gpu_memory_utilization=1.0)
    with pytest.raises(SizingError, match=r"swap_space: 100000 GiB .* more than 70%: lower swap_space"):
        start(swap_space=100000)
    with pytest.raises(SizingError, match="gpu_memory_utilization: must be in"):
        start(gpu_memory_utilization=0)
    llm = start(num_device_blocks=20, num_host_blocks=10, max_model_len=64)
    assert (llm.config.num_device_blocks, llm.config.num_host_blocks) == (20, 10)
    assert llm.cache_plan.profile is None and not llm.cache_plan.device_sized


def test_cli_sizing_flags():
    args = build_parser().parse_args(["generate"])
    engine = engine_kwargs(args)
    # The main job's deliberately tiny explicit cache stays the default.
    assert (engine["num_device_blocks"], engine["num_host_blocks"]) == (16, 64)
    engine = engine_kwargs(build_parser().parse_args(["generate", "--gpu-memory-utilization", "0.5"]))
    assert "num_device_blocks" not in engine and "num_host_blocks" not in engine
    assert engine["gpu_memory_utilization"] == 0.5
    engine = engine_kwargs(build_parser().parse_args(["generate", "--swap-space", "2",
                                                      "--num-device-blocks", "32"]))
    assert engine["num_device_blocks"] == 32 and engine["swap_space"] == 2 and "num_host_blocks" not in engine
