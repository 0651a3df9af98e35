"""The scheduler state: one frozen pytree of fixed-shape arrays, indexed by slot and by block.

Shapes use G = num_slots, S = max_seqs_per_group, M = max_blocks_per_seq,
D = num_device_blocks + 1 and H = num_host_blocks + 1 (index 0 of each pool is the null
block, never handed out). A slot holds one sequence group (one request) from `add_requests`
to `free_finished`; its `status` says which queue holds it, so a request is in exactly one
state by construction. Queue order is a key per slot: `running` and `swapped` walk in
(arrival_time, queue_key) order, `waiting` in queue_key order (SPEC A2).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxsched.config import Capacity, SchedulerConfig

# Group status: which queue holds the slot.
EMPTY, WAITING, RUNNING, SWAPPED, FINISHED = 0, 1, 2, 3, 4
# Finish reasons (per group and per sequence).
NOT_FINISHED, LENGTH_CAPPED, STOPPED, IGNORED, ABORTED = 0, 1, 2, 3, 4
FINISH_NAMES = {LENGTH_CAPPED: "finished_length_capped", STOPPED: "finished_stopped",
                IGNORED: "finished_ignored", ABORTED: "finished_aborted"}
# Why a request was ignored.
IGNORE_NONE, IGNORE_PROMPT_TOO_LONG, IGNORE_NEVER_FITS, IGNORE_TOO_MANY_SEQS = 0, 1, 2, 3
IGNORE_REASONS = {
    IGNORE_PROMPT_TOO_LONG: "prompt longer than the prompt limit",
    IGNORE_NEVER_FITS: "needs more KV blocks than the device cache can ever hold",
    IGNORE_TOO_MANY_SEQS: "n is larger than max_num_seqs",
}


@struct.dataclass
class Limits:
    """Per-run limits: arrays, so changing them never recompiles (all shape=(), int32 unless noted).

    Attributes:
      num_device_blocks: active device blocks (ids 1..num_device_blocks), <= capacity.
      num_host_blocks: active host blocks, <= capacity.
      max_num_seqs, max_num_batched_tokens, max_model_len: vLLM's limits.
      watermark_blocks: int(watermark * num_device_blocks).
      preemption_mode: 0 auto, 1 recompute, 2 swap.
      delay_factor: float32.
      block_size: mirrors Capacity.block_size for transitions compiled without a capacity.
    """
    num_device_blocks: jax.Array
    num_host_blocks: jax.Array
    max_num_seqs: jax.Array
    max_num_batched_tokens: jax.Array
    max_model_len: jax.Array
    watermark_blocks: jax.Array
    preemption_mode: jax.Array
    delay_factor: jax.Array
    block_size: jax.Array


@struct.dataclass
class SchedulerState:
    """Everything the scheduler knows. No Python containers: the tree never changes shape.

    Attributes:
      status: int32[G]            EMPTY / WAITING / RUNNING / SWAPPED / FINISHED.
      finish_reason: int32[G]     reason once FINISHED (LENGTH_CAPPED, STOPPED, IGNORED, ABORTED).
      ignore_reason: int32[G]     why an IGNORED group was ignored.
      arrival_time: float32[G]    seconds, the FCFS priority.
      queue_key: int32[G]         position inside its queue (smaller is nearer the head).
      request_index: int32[G]     caller's id for the request (e.g. its index in a trace).
      prompt_len: int32[G]        prompt tokens.
      n: int32[G]                 parallel samples requested.
      max_tokens: int32[G]        output tokens after which a sequence is length-capped.
      forked: bool[G]             the group has sampled its first tokens and holds n sequences.
      prefill_done: int32[G]      prefill tokens computed so far (chunks add up here).
      prefill_total: int32[G]     prefill tokens to compute: the prompt, or after a recompute
                                  the prompt plus outputs (SPEC A5, B1).
      num_preemptions: int32[G]   times this group was preempted.
      seq_alive: bool[G, S]       sequence exists and is not finished.
      seq_finish_reason: int32[G, S]
      num_tokens: int32[G, S]     prompt + output tokens of each sequence.
      num_blocks: int32[G, S]     entries used in the block table (device or host).
      block_table: int32[G, S, M] device block ids; unused entries hold the null block 0.
      host_table: int32[G, S, M]  host block ids while SWAPPED, else 0.
      device_ref: int32[D]        references to each device block from block tables.
      host_ref: int32[H]          references to each host block from host tables.
      tail_key, front_key: int32[] next queue keys for the tail and the front of a queue.
      step: int32[]               schedule calls so far.
      prev_time, last_prompt_latency: float32[]  SPEC A7 state.
      prev_admitted: bool[]       the previous admission walk admitted from waiting.
      rng: uint32[2]              key for artificial preemption (SPEC A8).
      artificial_count: int32[]   forced failures left.
      limits: Limits
    """
    status: jax.Array
    finish_reason: jax.Array
    ignore_reason: jax.Array
    arrival_time: jax.Array
    queue_key: jax.Array
    request_index: jax.Array
    prompt_len: jax.Array
    n: jax.Array
    max_tokens: jax.Array
    forked: jax.Array
    prefill_done: jax.Array
    prefill_total: jax.Array
    num_preemptions: jax.Array
    seq_alive: jax.Array
    seq_finish_reason: jax.Array
    num_tokens: jax.Array
    num_blocks: jax.Array
    block_table: jax.Array
    host_table: jax.Array
    device_ref: jax.Array
    host_ref: jax.Array
    tail_key: jax.Array
    front_key: jax.Array
    step: jax.Array
    prev_time: jax.Array
    last_prompt_latency: jax.Array
    prev_admitted: jax.Array
    rng: jax.Array
    artificial_count: jax.Array
    limits: Limits

    @property
    def num_live_seqs(self) -> jax.Array:
        """int32[G]: sequences each group holds now (1 before the fork)."""
        return self.seq_alive.sum(axis=1, dtype=jnp.int32)

    @property
    def max_num_running_seqs(self) -> jax.Array:
        """int32[G]: vLLM's get_max_num_running_seqs: n before the fork, live sequences after."""
        return jnp.where(self.forked, self.num_live_seqs, self.n)


def make_limits(config: SchedulerConfig) -> Limits:
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    return Limits(
        num_device_blocks=i32(config.num_device_blocks),
        num_host_blocks=i32(config.num_host_blocks),
        max_num_seqs=i32(config.max_num_seqs),
        max_num_batched_tokens=i32(config.max_num_batched_tokens),
        max_model_len=i32(config.max_model_len),
        watermark_blocks=i32(config.watermark_blocks),
        preemption_mode=i32(config.preemption_mode_id),
        delay_factor=jnp.asarray(config.delay_factor, jnp.float32),
        block_size=i32(config.block_size),
    )


def init_state(config: SchedulerConfig) -> SchedulerState:
    """An empty scheduler: no requests, every active block free."""
    cap: Capacity = config.capacity()
    g, s, m = cap.num_slots, cap.max_seqs_per_group, cap.max_blocks_per_seq
    zi = lambda *shape: jnp.zeros(shape, jnp.int32)
    return SchedulerState(
        status=zi(g), finish_reason=zi(g), ignore_reason=zi(g),
        arrival_time=jnp.zeros((g,), jnp.float32), queue_key=zi(g), request_index=zi(g),
        prompt_len=zi(g), n=zi(g), max_tokens=zi(g), forked=jnp.zeros((g,), bool),
        prefill_done=zi(g), prefill_total=zi(g), num_preemptions=zi(g),
        seq_alive=jnp.zeros((g, s), bool), seq_finish_reason=zi(g, s), num_tokens=zi(g, s),
        num_blocks=zi(g, s), block_table=zi(g, s, m), host_table=zi(g, s, m),
        device_ref=zi(cap.num_device_blocks + 1), host_ref=zi(cap.num_host_blocks + 1),
        tail_key=jnp.asarray(0, jnp.int32), front_key=jnp.asarray(-1, jnp.int32),
        step=jnp.asarray(0, jnp.int32),
        prev_time=jnp.asarray(0.0, jnp.float32), last_prompt_latency=jnp.asarray(0.0, jnp.float32),
        prev_admitted=jnp.asarray(False), rng=jax.random.PRNGKey(config.seed),
        artificial_count=jnp.asarray(config.artificial_preemption_count, jnp.int32),
        limits=make_limits(config),
    )


def set_limits(state: SchedulerState, config: SchedulerConfig) -> SchedulerState:
    """Run the same compiled scheduler under another config of the same capacity."""
    return state.replace(limits=make_limits(config))
