"""`LLM`: vLLM's offline front end over the jitted engine.

    llm = LLM("smollm2-135m", num_device_blocks=64, preemption_mode="swap")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].outputs[0].text, llm.stats())

Requests are validated here, on the host, before anything reaches the jitted step: a bad
request raises `ValueError` naming the field and the limit and leaves the others untouched.
The host bookkeeping of accepted requests (queue, packing, outputs, stop strings) is the
engine's `OutputProcessor`, and the counters of `stats()` its `EngineStats`.
"""
from __future__ import annotations

import copy
import dataclasses
import pathlib
import time
from typing import Iterator, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxsched.core.config import SchedulerConfig
from jaxsched.core.costs import PreemptionCosts
from jaxsched.engine import sizing
from jaxsched.engine.cost_measure import measure_preemption_costs
from jaxsched.engine.sharding import place_model
from jaxsched.engine.output_processor import OutputProcessor
from jaxsched.engine.params import RequestOutput, SamplingParams, truncate_prompt
from jaxsched.engine.stats import EngineStats
from jaxsched.engine.step import EngineSpec, init_engine, token_buckets
from jaxsched.entrypoints.compilation_cache import enable_compilation_cache
from jaxsched.core.requests import abort as abort_slots
from jaxsched.core.state import Status, set_limits
from models.chat import ChatTemplateError, content_text, load_chat_template

ENGINE_ARGS = {f.name for f in dataclasses.fields(SchedulerConfig)}
Prompt = Union[str, Sequence[int]]


class _FrontEnd:
    """vLLM's offline calls over `_prepare` (check one request), `_enqueue` (queue it),
    `step` and `output`: shared by `LLM` and the data-parallel router."""

    def add_request(self, request_id: str, prompt: Prompt, params: Optional[SamplingParams] = None) -> None:
        """Validate and queue one request.

        A malformed request (bad type, empty or out-of-vocabulary prompt, bad or over-limit
        sampling parameters, duplicate id) raises ValueError and changes nothing. A prompt
        longer than `max_model_len` is accepted and finishes at once as "ignored", with a
        message, as in vLLM.
        """
        self._enqueue(request_id, *self._prepare(request_id, prompt, params))

    def _submit(self, prompts, sampling_params) -> list[str]:
        """Check every request of a batch, then queue them all: a bad one queues none."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                               and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts: must be a string, a list of token ids or a list of prompts, "
                             f"got {type(prompts).__name__}")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params: {len(sampling_params)} given for "
                                 f"{len(prompts)} prompts; the lengths must match")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        ids = [f"req-{self._next + k}" for k in range(len(prompts))]
        prepared = [self._prepare(rid, p, sp, f"prompts[{k}]")
                    for k, (rid, p, sp) in enumerate(zip(ids, prompts, params))]
        for rid, args in zip(ids, prepared):
            self._enqueue(rid, *args)
        return ids

    def get_tokenizer(self):
        """The tokenizer (vLLM's name): encode, decode, apply_chat_template, eos_token_id."""
        return self.tokenizer

    def generate(self, prompts=None, sampling_params: Optional[SamplingParams] = None,
                 prompt_token_ids: Optional[list[list[int]]] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order. `prompt_token_ids` is vLLM's
        older way to give prompts as ids (the prompts then must be left out)."""
        if prompt_token_ids is not None:
            if prompts is not None:
                raise ValueError("prompt_token_ids: give prompts or prompt_token_ids, not both")
            if not isinstance(prompt_token_ids, (list, tuple)) or not all(
                    isinstance(p, (list, tuple, np.ndarray)) for p in prompt_token_ids):
                raise ValueError("prompt_token_ids: must be a list of token-id lists")
            prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        if prompts is None:
            raise ValueError("prompts: must be given (a string, a list of token ids or a list of "
                             "prompts), or prompt_token_ids")
        ids = self._submit(prompts, sampling_params)
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req")
        pending = {i for i in ids if not self.output(i).finished}
        if bar:
            bar.update(len(ids) - len(pending))
        while pending:
            for out in self.step():
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [self.output(i) for i in ids]

    def generate_stream(self, prompts, sampling_params: Optional[SamplingParams] = None
                        ) -> Iterator[RequestOutput]:
        """Yield each request's output so far every time it gets tokens (text is whole UTF-8)."""
        ids = set(self._submit(prompts, sampling_params))
        for rid in sorted(ids):
            if self.output(rid).finished:             # ignored at submission: said once
                yield self.output(rid)
        while any(not self.output(i).finished for i in ids):
            for out in self.step():
                if out.request_id in ids:
                    yield out

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             chat_template: Optional[str] = None):
        """Render the model's own chat template (or `chat_template`: a template or its file)
        and generate the assistant's reply.

        `messages` is one conversation (a list of {"role", "content"} dicts), which returns
        one RequestOutput, or a list of conversations, which returns a list, as vLLM's does.
        """
        template = load_chat_template(chat_template) if chat_template is not None else None
        if self.tokenizer is None or not (template or self.tokenizer.chat_template):
            raise ValueError("chat: the model has no tokenizer with a chat template "
                             "(give one: chat_template=...)")
        batched = isinstance(messages, (list, tuple)) and bool(messages) and all(
            isinstance(m, (list, tuple)) for m in messages)
        conversations = list(messages) if batched else [messages]
        prompts = []
        for k, conv in enumerate(conversations):
            field = f"messages[{k}]" if batched else "messages"
            if not isinstance(conv, (list, tuple)) or not conv or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in conv):
                raise ValueError(f"{field}: must be a non-empty list of "
                                 "{'role': str, 'content': str or text parts} messages")
            conv = [{**m, "content": content_text(m.get("content"), f"{field}[{j}].content")}
                    for j, m in enumerate(conv)]
            try:
                text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                          chat_template=template)
            except ChatTemplateError as e:       # the template's raise_exception, about these messages
                raise ValueError(f"{field}: the chat template refused them: {e}") from None
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        return outs if batched else outs[0]


class LLM(_FrontEnd):
    """An offline engine: a model, a tokenizer, a scheduler config and a KV cache.

    `model` is a built-in name ("smollm2-135m", the default), a .gguf path, an HF checkpoint
    directory, or a ready `models.llama.LlamaForCausalLM`. Engine arguments are the
    `SchedulerConfig` fields by the same names.

    `preemption_mode="auto"` preempts each victim by whichever of recompute and swap its cost
    model says is cheaper. `preemption_costs` is that model: a `core.costs.PreemptionCosts`
    (or its dict), a JSON file written by `PreemptionCosts.to_json`, or "measure" to time this
    model's prefill and this cache's swaps once at start-up (`measure_preemption_costs`;
    seconds to a minute on CPU, one compile per measured prefill length; single-device
    engines only). Left out, "auto" uses `core.costs.DEFAULT_COSTS`, measured for SmolLM2-135M
    on a 2-core CPU: cheap swaps, so it swaps whenever the host pool has room.

    `dtype` takes vLLM's names: "float32" (or "float", or "auto": jaxsched's default) and
    "bfloat16". `enforce_eager` and `trust_remote_code` are vLLM's, taken so vLLM code runs
    unchanged, and change nothing: jaxsched has no CUDA graphs to leave out (every step is
    one compiled XLA program, as vLLM's graphs are) and never runs a model's own code.
    `chat_template` (a Jinja template or its file, as `vllm serve --chat-template`) replaces
    the tokenizer's for `chat` and the server.
    """

    def __new__(cls, *args, mesh_shape=None, **kwargs):
        # `LLM(..., mesh_shape=(D, T))` with D > 1 gives D independent engines behind a router
        # with the same methods (DataParallelLLM is not an LLM subclass, so this object's
        # __init__ does not run again).
        if cls is LLM and mesh_shape is not None and mesh_shape[0] > 1:
            from jaxsched.entrypoints.router import DataParallelLLM
            return DataParallelLLM(*args, mesh_shape=mesh_shape, **kwargs)
        return super().__new__(cls)

    def __init__(self, model=None, *, tokenizer=None, seed: int = 0, dtype: str = "float32",
                 attention_impl: str = "chunked", max_requests_per_step: int = 8,
                 mesh_shape: Optional[tuple[int, int]] = None, tensor_parallel_size: Optional[int] = None,
                 devices=None, gpu_memory_utilization: float = 0.9, swap_space: float = 4,
                 device_memory_bytes: Optional[int] = None, enforce_eager: bool = False,
                 trust_remote_code: bool = False, chat_template: Optional[str] = None, **engine_args):
        unknown = sorted(set(engine_args) - ENGINE_ARGS)
        if unknown:
            raise TypeError(f"LLM: unknown engine argument {unknown[0]!r}; "
                            f"expected SchedulerConfig fields")
        dtype = model_dtype(dtype)
        template = load_chat_template(chat_template) if chat_template is not None else None
        _check_engine_args(engine_args)                  # bad flags fail before any loading
        sizing.check_args(gpu_memory_utilization, swap_space)
        enable_compilation_cache()                       # a second start loads, not compiles
        if tensor_parallel_size is not None:
            mesh_shape = (1, tensor_parallel_size)
        data, tp = mesh_shape or (1, 1)
        if data > 1:
            raise ValueError("LLM: mesh_shape with data > 1 is DataParallelLLM's; LLM(...) returns one")
        model_config, tensors, instance, tokenizer = load_model_parts(model, tokenizer, dtype)
        self.model_config, self.tokenizer = model_config, with_chat_template(tokenizer, template)
        measure = _resolve_costs(engine_args, data * tp > 1 or bool(devices))
        context = model_config.max_position_embeddings
        if engine_args.get("max_model_len", 0) > context:
            raise ValueError(f"max_model_len: {engine_args['max_model_len']} is longer than the "
                             f"model's context length {context} (max_position_embeddings)")
        engine_args.setdefault("seed", seed)
        # Block counts not given are sized from memory (gpu_memory_utilization, swap_space),
        # measured with the model placed: jaxsched.sizing; self.cache_plan says what it chose.
        self.config, self.cache_plan, placed = sizing.size_engine(
            engine_args, model_config,
            lambda cap: place_model(model_config, tensors, instance, cap, tp, devices, attention_impl),
            gpu_memory_utilization=gpu_memory_utilization, swap_space=swap_space,
            device_memory_bytes=device_memory_bytes, tensor_parallel_size=tp, attention_impl=attention_impl)
        cap = self.config.capacity()
        graphdef, self.params, forward, kv, place = placed
        self.spec = EngineSpec(cap=cap, forward=forward, graphdef=graphdef,
                               token_buckets=token_buckets(self.config.max_num_batched_tokens),
                               num_sample_rows=self.config.max_num_seqs,
                               max_prompt_len=self.config.max_model_len, attention_impl=attention_impl)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.state = place(init_engine(self.config, kv, eos))
        from jaxsched.engine.step import LazyStep
        # Each token bucket compiles when a step first needs it: the first request waits for
        # its own bucket only (`warm_up` compiles them all ahead of serving).
        self._step = LazyStep(self.spec)
        if tp > 1 or devices:
            # Over a mesh, lazily too, with explicit shardings (sharding.MeshStepParts).
            from jaxsched.engine.sharding import mesh_step
            self._step = mesh_step(self.spec, self.state, self.params)
        self.cost_measurements = None
        if measure:
            costs, self.cost_measurements = self.measure_preemption_costs()
            self.config = dataclasses.replace(self.config, preemption_costs=costs)
            self.state = self.state.replace(sched=set_limits(self.state.sched, self.config))
        self._t0 = time.monotonic()
        self._stats = EngineStats(self.config.num_device_blocks, self.config.num_host_blocks)
        self._processor = OutputProcessor(
            tokenizer=self.tokenizer, max_model_len=self.config.max_model_len, num_slots=self.spec.cap.num_slots,
            rows=max_requests_per_step, max_prompt_len=self.spec.max_prompt_len, seed=seed,
            stats=self._stats)

    def measure_preemption_costs(self, **kw):
        """Time this model's prefill and this cache's swaps on the running backend.

        Returns (core.costs.PreemptionCosts, the measurements); the engine is left as it
        is. Keyword arguments go to `engine.cost_measure.measure_preemption_costs` (lengths, blocks,
        reps, quadratic).
        """
        mc = self.model_config
        return measure_preemption_costs(
            self.spec.forward, self.spec.graphdef, self.params, num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
            block_size=self.config.block_size, dtype=mc.dtype, impl=self.spec.attention_impl, **kw)

    # -------------------------------------------------------------- requests
    def _encode(self, prompt: Prompt, field: str = "prompt") -> tuple[Optional[str], list[int]]:
        """(text, token ids) of a prompt; a malformed one raises ValueError naming `field`."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{field}: text needs a tokenizer; pass token ids instead")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, dict) and set(prompt) <= {"prompt", "prompt_token_ids"} and prompt:
            # vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": [...]}.
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"], field)
            return self._encode(prompt["prompt"], field)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            text, ids = None, self._check_ids(prompt, field)
        else:
            raise ValueError(f"{field}: must be a string, a list of token ids or a dict with "
                             f"'prompt' or 'prompt_token_ids', got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"{field}: must have at least one token")
        return text, ids

    def _check_ids(self, prompt, field: str) -> list[int]:
        vocab = self.model_config.vocab_size
        ids = list(prompt)
        if any(isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) for t in ids):
            raise ValueError(f"{field}: token ids must be integers")
        ids = [int(t) for t in ids]
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"{field}: token ids must be in [0, vocab_size={vocab})")
        if not ids:
            raise ValueError(f"{field}: must have at least one token")
        return ids

    def _prepare(self, request_id: str, prompt: Prompt, params: Optional[SamplingParams],
                 field: str = "prompt") -> tuple[Optional[str], list[int], SamplingParams]:
        """Every check of one request, changing nothing: raises ValueError naming the field."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        if request_id in self._processor:
            raise ValueError(f"request_id {request_id!r}: duplicate id")
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.config.max_num_seqs, self.config.max_seqs_per_group,
                        vocab_size=self.model_config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop: stop strings need a tokenizer; use stop_token_ids")
        text, ids = self._encode(prompt, field)
        return text, truncate_prompt(ids, params.truncate_prompt_tokens), params

    def _enqueue(self, request_id: str, text: Optional[str], ids: list[int], params: SamplingParams) -> None:
        self._processor.add_request(request_id, text, ids, params)

    @property
    def _next(self) -> int:
        """The next request's engine index (generate's ids are "req-<index>")."""
        return self._processor.next_index

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks are freed at once."""
        idx = self._processor.abort_request(request_id)
        if idx is not None:
            self._abort_in_engine(idx)

    def _abort_in_engine(self, idx: int) -> None:
        sched = self.state.sched
        mask = (sched.request_index == idx) & (sched.status != Status.EMPTY)
        self.state = self.state.replace(sched=abort_slots(sched, mask))

    def has_unfinished(self) -> bool:
        return self._processor.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self._processor.num_unfinished()

    def num_queued(self) -> int:
        """Requests added but not yet handed to the engine (the host-side waiting queue)."""
        return self._processor.num_queued()

    def release(self, request_id: str) -> None:
        """Forget a finished request, so a long-running server's memory stays bounded."""
        self._processor.release(request_id)

    def output(self, request_id: str) -> RequestOutput:
        """The request's output so far."""
        return self._processor.output(request_id)

    # -------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that advanced or finished."""
        new = self._processor.new_requests(time.monotonic() - self._t0)
        started = time.time()                # RequestMetrics' clock, as vLLM's
        start = time.perf_counter()
        self.state, out = self._step(self.state, self.params, new, jnp.float32(time.monotonic() - self._t0))
        out = jax.device_get(out)
        compiled = getattr(self._step, "compile_seconds", None)
        self._stats.record_time(time.perf_counter() - start, compiled)
        self._stats.record_step(out, compiles_lazily=compiled is not None)
        changed, stopped = self._processor.process_outputs(out, started)
        for idx in stopped:                 # finished at stop strings: free their blocks now
            self._abort_in_engine(idx)
        return changed

    # -------------------------------------------------------------- front ends
    def warm_up(self) -> float:
        """Compile and run every token bucket once before serving; returns the seconds it took.

        Without it each bucket compiles when a step first needs it (on one device and over a
        mesh alike), so a later request can wait for a compile.
        XLA:CPU also pays a one-time cost the first time each part of a compiled step runs
        (a few hundred ms per token bucket for SmolLM2), including the attention loop over
        cached blocks, which fresh prefills skip.
        So each round here is one step of a bucket's size that holds a decode: a short
        greedy request is prefilled first, then prompts of token id 0 filling the rest of
        the bucket join its next step. Buckets the cache cannot hold are left to warm on
        first use. The warm-up's requests (ids "_warm_up-...") all finish before it returns;
        `stats` counts their steps and tokens like any others.
        """
        start = time.perf_counter()
        cfg = self.config
        longest = min(cfg.max_model_len - 1, cfg.max_num_batched_tokens)
        greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for round_, size in enumerate(self.spec.token_buckets):
            rest = size - 1
            count = -(-rest // longest)
            lengths = [rest // count + (i < rest % count) for i in range(count)]
            blocks = sum(-(-(n + 1) // cfg.block_size) for n in lengths) + 1
            if count + 1 > cfg.max_num_seqs or blocks > cfg.num_device_blocks:
                continue
            ids = [f"_warm_up-{round_}-{i}" for i in range(count + 1)]
            self.add_request(ids[0], [0] * min(8, longest), SamplingParams(max_tokens=3, temperature=0.0,
                                                                          ignore_eos=True))
            self.step()                                   # prefill: the short request now decodes
            for rid, n in zip(ids[1:], lengths):
                self.add_request(rid, [0] * n, greedy)
            while any(not self.output(rid).finished for rid in ids):
                self.step()
        return time.perf_counter() - start

    def stats(self) -> dict:
        """Steps, tokens, throughput of the steps that compiled nothing, preemptions, block
        moves, ignored requests, peak blocks in use, engine and compile seconds."""
        return self._stats.as_dict()


# vLLM's dtype names and the weights' dtype each gives here.
DTYPES = {"auto": "float32", "float": "float32", "float32": "float32", "bfloat16": "bfloat16"}


def model_dtype(dtype: str) -> str:
    """The weights' dtype for a `dtype` argument (vLLM's names), or ValueError naming it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: must be one of {sorted(DTYPES)}, got {dtype!r}"
                         + (" (float16 is not supported: use bfloat16)" if dtype in ("half", "float16") else ""))
    return DTYPES[dtype]


def with_chat_template(tokenizer, template: Optional[str]):
    """`tokenizer`, or a copy of it whose chat template is `template` (the caller's keeps its
    own)."""
    if template is None or tokenizer is None:
        return tokenizer
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def load_model_parts(model, tokenizer, dtype):
    """(model config, HF-named host tensors or None, a ready model or None, tokenizer) for a
    name, a path, a ready `LlamaForCausalLM`, or weights handed down as that tuple's first three."""
    from models.llama import LlamaForCausalLM
    if isinstance(model, tuple):
        model_config, tensors, instance = model
    elif isinstance(model, LlamaForCausalLM):
        model_config, tensors, instance = model.config, None, model
    else:
        from models.loader import load_weights
        model_config, tensors, loaded = load_weights(model, dtype=dtype)
        instance, tokenizer = None, tokenizer or loaded
    return model_config, tensors, instance, tokenizer


def _check_engine_args(engine_args: dict) -> SchedulerConfig:
    """The config these arguments make (its own error if bad), before any model loads.

    Where the model sets a default (max_model_len), a stand-in is used: the real config is
    built once the model's context length is known."""
    args = dict(engine_args)
    if isinstance(args.get("preemption_costs"), (str, pathlib.Path)):
        args.pop("preemption_costs")                  # a file or "measure": resolved later
    args.setdefault("max_num_batched_tokens", max(512, args.get("max_num_seqs", 16)))
    args.setdefault("max_model_len", min(512, args["max_num_batched_tokens"]))
    for key in ("num_device_blocks", "num_host_blocks"):   # sized at start-up: a stand-in
        args.setdefault(key, args.get(f"{key}_capacity") or 1)
    return SchedulerConfig(**args)


def _resolve_costs(engine_args: dict, sharded: bool) -> bool:
    """Read a `preemption_costs` file in place; True when it says "measure" (then cleared)."""
    costs = engine_args.get("preemption_costs")
    if isinstance(costs, str) and costs == "measure":
        if sharded:
            raise ValueError('preemption_costs="measure": only for single-device engines; '
                             'measure on one device and pass the costs')
        engine_args["preemption_costs"] = None
        return True
    if isinstance(costs, (str, pathlib.Path)):
        try:
            engine_args["preemption_costs"] = PreemptionCosts.from_json(costs)
        except ValueError as e:
            raise ValueError(f"preemption_costs: {e}") from None
    return False
