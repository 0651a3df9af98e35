"""`LLM`: vLLM's offline front end over the jitted engine.

    llm = LLM("smollm2-135m", num_device_blocks=64, preemption_mode="swap")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].outputs[0].text, llm.stats())

Requests are validated here, on the host, before anything reaches the jitted step: a bad
request raises `ValueError` naming the field and the limit and leaves the others untouched.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import pathlib
import time
from typing import Iterator, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxsched.core.config import PreemptionMode, SchedulerConfig
from jaxsched.core.costs import PreemptionCosts
from jaxsched.engine import sizing
from jaxsched.engine.cost_measure import measure_preemption_costs
from jaxsched.engine.sharding import place_model
from jaxsched.engine.step import (EngineSpec, NewRequests, SamplingRows, init_engine, step_impl,
                                  token_buckets)
from jaxsched.entrypoints.compilation_cache import enable_compilation_cache
from jaxsched.engine.params import MAX_STOP_TOKEN_IDS, CompletionOutput, RequestOutput, SamplingParams
from jaxsched.core.requests import RequestBatch, abort as abort_slots
from jaxsched.core.state import IGNORE_REASONS, FinishReason, Status, set_limits

# vLLM's finish_reason strings.
FINISH = {FinishReason.LENGTH_CAPPED: "length", FinishReason.STOPPED: "stop",
          FinishReason.IGNORED: "ignored", FinishReason.ABORTED: "abort"}
ENGINE_ARGS = {f.name for f in dataclasses.fields(SchedulerConfig)}
Prompt = Union[str, Sequence[int]]


@dataclasses.dataclass
class _Request:
    index: int
    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: SamplingParams
    tokens: list[list[int]]
    logprobs: list[list[float]]
    reasons: list[Optional[str]]
    detok: list
    text: list[str]
    finished: bool = False
    message: Optional[str] = None
    text_stopped: set = dataclasses.field(default_factory=set)   # sequences cut at a stop string
    top_logprobs: list = dataclasses.field(default_factory=list)  # per sequence, when logprobs > 0

    def output(self) -> RequestOutput:
        outs = []
        for i in range(self.params.n):
            lp = self.logprobs[i] if self.params.logprobs is not None else None
            outs.append(CompletionOutput(
                index=i, token_ids=list(self.tokens[i]), text=self.text[i] if self.detok else None,
                finish_reason=self.reasons[i], logprobs=list(lp) if lp is not None else None,
                cumulative_logprob=float(sum(lp)) if lp is not None else None,
                top_logprobs=list(self.top_logprobs[i]) if self.top_logprobs else None))
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), outs,
                             self.finished, self.message)


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

    def generate(self, prompts, sampling_params: Optional[SamplingParams] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order."""
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
             use_tqdm: bool = False, add_generation_prompt: bool = True):
        """Render the model's own chat template and generate the assistant's reply.

        `messages` is one conversation (a list of {"role", "content"} dicts), which returns
        one RequestOutput, or a list of conversations, which returns a list, as vLLM's does.
        """
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("chat: the model has no tokenizer with a chat template")
        batched = isinstance(messages, (list, tuple)) and bool(messages) and all(
            isinstance(m, (list, tuple)) for m in messages)
        conversations = list(messages) if batched else [messages]
        prompts = []
        for k, conv in enumerate(conversations):
            field = f"messages[{k}]" if batched else "messages"
            if not isinstance(conv, (list, tuple)) or not conv or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in conv):
                raise ValueError(f"{field}: must be a non-empty list of "
                                 "{'role': str, 'content': str} messages")
            text = self.tokenizer.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt)
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
                 device_memory_bytes: Optional[int] = None, **engine_args):
        unknown = sorted(set(engine_args) - ENGINE_ARGS)
        if unknown:
            raise TypeError(f"LLM: unknown engine argument {unknown[0]!r}; "
                            f"expected SchedulerConfig fields")
        _check_engine_args(engine_args)                  # bad flags fail before any loading
        sizing.check_args(gpu_memory_utilization, swap_space)
        enable_compilation_cache()                       # a second start loads, not compiles
        if tensor_parallel_size is not None:
            mesh_shape = (1, tensor_parallel_size)
        data, tp = mesh_shape or (1, 1)
        if data > 1:
            raise ValueError("LLM: mesh_shape with data > 1 is DataParallelLLM's; LLM(...) returns one")
        model_config, tensors, instance, tokenizer = load_model_parts(model, tokenizer, dtype)
        self.model_config, self.tokenizer = model_config, tokenizer
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
            # Over a mesh the step is jitted with explicit shardings: the state keeps its
            # placement (cache by kv head, the rest replicated), requests come in replicated.
            from jax.sharding import NamedSharding, PartitionSpec
            replicated = NamedSharding(self.state.kv.k.sharding.mesh, PartitionSpec())
            state_sh = jax.tree.map(lambda x: x.sharding, self.state)
            params_sh = jax.tree.map(lambda x: x.sharding, self.params)
            self._step = jax.jit(functools.partial(step_impl, spec=self.spec), donate_argnums=(0,),
                                 in_shardings=(state_sh, params_sh, replicated, replicated),
                                 out_shardings=(state_sh, replicated))
        self.cost_measurements = None
        if measure:
            costs, self.cost_measurements = self.measure_preemption_costs()
            self.config = dataclasses.replace(self.config, preemption_costs=costs)
            self.state = self.state.replace(sched=set_limits(self.state.sched, self.config))
        self._seed = seed
        self._rows = max_requests_per_step
        self._requests: dict[int, _Request] = {}
        self._by_id: dict[str, int] = {}
        self._queue: collections.deque[int] = collections.deque()
        self._active = 0
        self._next = 0
        self._t0 = time.monotonic()
        self._stats = collections.Counter()
        self._peak = [0, 0]
        self._busy = 0.0
        self._compile = 0.0
        self._first_tokens = 0

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
        if request_id in self._by_id:
            raise ValueError(f"request_id {request_id!r}: duplicate id")
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.config.max_num_seqs, self.config.max_seqs_per_group)
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop: stop strings need a tokenizer; use stop_token_ids")
        text, ids = self._encode(prompt, field)
        return text, ids, params

    def _enqueue(self, request_id: str, text: Optional[str], ids: list[int], params: SamplingParams) -> None:
        idx = self._next
        self._next += 1
        n = params.n
        detok = ([self.tokenizer.detokenizer(ids, skip_special_tokens=True) for _ in range(n)]
                 if self.tokenizer else [])
        req = _Request(idx, request_id, text, ids, params, [[] for _ in range(n)],
                       [[] for _ in range(n)], [None] * n, detok, [""] * n)
        self._requests[idx] = req
        self._by_id[request_id] = idx
        if len(ids) > self.config.max_model_len:
            # As vLLM 0.5.3: an over-long prompt costs only itself. It finishes as ignored at
            # once, with the numbers, and the engine never sees it.
            self._stats["ignored"] += 1
            self._finish(req, ["ignored"] * n,
                         f"prompt has {len(ids)} tokens, more than max_model_len={self.config.max_model_len}")
            return
        self._queue.append(idx)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks are freed at once."""
        idx = self._by_id.get(request_id)
        if idx is None or self._requests[idx].finished:
            return
        req = self._requests[idx]
        if idx in self._queue:
            self._queue.remove(idx)
            self._finish(req, ["abort"] * req.params.n)
            return
        sched = self.state.sched
        mask = (sched.request_index == idx) & (sched.status != Status.EMPTY)
        self.state = self.state.replace(sched=abort_slots(sched, mask))

    def has_unfinished(self) -> bool:
        return any(not r.finished for r in self._requests.values())

    def num_queued(self) -> int:
        """Requests added but not yet handed to the engine (the host-side waiting queue)."""
        return len(self._queue)

    def release(self, request_id: str) -> None:
        """Forget a finished request, so a long-running server's memory stays bounded."""
        idx = self._by_id.get(request_id)
        if idx is not None and self._requests[idx].finished:
            del self._by_id[request_id], self._requests[idx]

    def output(self, request_id: str) -> RequestOutput:
        """The request's output so far."""
        return self._requests[self._by_id[request_id]].output()

    def _finish(self, req: _Request, reasons, message=None):
        req.finished = True
        req.reasons = [req.reasons[i] or reasons[i] for i in range(req.params.n)]
        req.message = message
        for i, d in enumerate(req.detok):
            if i not in req.text_stopped:            # cut at a stop string: nothing follows
                req.text[i] += d.flush()

    # -------------------------------------------------------------- stepping
    def _new_requests(self) -> tuple[NewRequests, list[int]]:
        rows, plen = self._rows, self.spec.max_prompt_len
        take = []
        while self._queue and len(take) < min(rows, self.spec.cap.num_slots - self._active):
            take.append(self._queue.popleft())
        now = time.monotonic() - self._t0
        arr = {k: np.zeros(rows, dt) for k, dt in (("prompt_len", np.int32), ("n", np.int32),
               ("max_tokens", np.int32), ("request_index", np.int32), ("top_k", np.int32),
               ("min_tokens", np.int32), ("temperature", np.float32), ("top_p", np.float32),
               ("min_p", np.float32), ("arrival_time", np.float32), ("presence_penalty", np.float32),
               ("frequency_penalty", np.float32), ("repetition_penalty", np.float32),
               ("num_logprobs", np.int32))}
        valid = np.zeros(rows, bool)
        ignore_eos = np.zeros(rows, bool)
        prompts = np.zeros((rows, plen), np.int32)
        keys = np.zeros((rows, 2), np.uint32)
        stops = np.full((rows, MAX_STOP_TOKEN_IDS), -1, np.int32)
        for r, idx in enumerate(take):
            req = self._requests[idx]
            p = req.params
            valid[r] = True
            prompts[r, :len(req.prompt_ids)] = req.prompt_ids
            for k, v in (("prompt_len", len(req.prompt_ids)), ("n", p.n), ("max_tokens", p.max_tokens),
                         ("request_index", idx), ("top_k", max(p.top_k, 0)), ("min_tokens", p.min_tokens),
                         ("temperature", p.temperature), ("top_p", p.top_p), ("min_p", p.min_p),
                         ("arrival_time", now), ("presence_penalty", p.presence_penalty),
                         ("frequency_penalty", p.frequency_penalty),
                         ("repetition_penalty", p.repetition_penalty), ("num_logprobs", p.logprobs or 0)):
                arr[k][r] = v
            ignore_eos[r] = p.ignore_eos
            stops[r, :len(p.stop_token_ids)] = p.stop_token_ids
            # The base key of a request: its seed, else the engine seed and the request index.
            keys[r] = (0, p.seed) if p.seed is not None else (0x9E3779B9 ^ self._seed, idx)
        batch = RequestBatch(valid=jnp.asarray(valid), request_index=jnp.asarray(arr["request_index"]),
                             prompt_len=jnp.asarray(arr["prompt_len"]), n=jnp.asarray(arr["n"]),
                             max_tokens=jnp.asarray(arr["max_tokens"]),
                             arrival_time=jnp.asarray(arr["arrival_time"]))
        sampling = SamplingRows(temperature=jnp.asarray(arr["temperature"]), top_k=jnp.asarray(arr["top_k"]),
                                top_p=jnp.asarray(arr["top_p"]), min_p=jnp.asarray(arr["min_p"]),
                                key=jnp.asarray(keys), min_tokens=jnp.asarray(arr["min_tokens"]),
                                ignore_eos=jnp.asarray(ignore_eos), stop_token_ids=jnp.asarray(stops),
                                presence_penalty=jnp.asarray(arr["presence_penalty"]),
                                frequency_penalty=jnp.asarray(arr["frequency_penalty"]),
                                repetition_penalty=jnp.asarray(arr["repetition_penalty"]),
                                num_logprobs=jnp.asarray(arr["num_logprobs"]))
        self._active += len(take)
        return NewRequests(batch=batch, prompt_tokens=jnp.asarray(prompts), sampling=sampling), take

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that advanced or finished."""
        new, _ = self._new_requests()
        start = time.perf_counter()
        self.state, out = self._step(self.state, self.params, new, jnp.float32(time.monotonic() - self._t0))
        out = jax.device_get(out)
        elapsed = time.perf_counter() - start
        compiled = getattr(self._step, "compile_seconds", None)
        if compiled is not None:
            # A LazyStep times its compiling calls (each bucket's first); the rest is busy time.
            self._busy += max(elapsed - (compiled - self._compile), 0.0)
            self._compile = compiled
        elif self._stats["steps"] == 0:
            self._compile = elapsed          # the first step compiles the whole switch step
        else:
            self._busy += elapsed
        return self._absorb(out)

    def _absorb(self, out) -> list[RequestOutput]:
        st = self._stats
        st["steps"] += 1
        st["preempted_recompute"] += int((out.preempted == PreemptionMode.RECOMPUTE).sum())
        st["preempted_swap"] += int((out.preempted == PreemptionMode.SWAP).sum())
        st["blocks_swapped_out"] += int(out.num_swap_out)
        st["blocks_swapped_in"] += int(out.num_swap_in)
        st["blocks_copied"] += int(out.num_copy)
        st["tokens_run"] += int(out.num_tokens)
        self._peak[0] = max(self._peak[0], self.config.num_device_blocks - int(out.num_free_device_blocks))
        self._peak[1] = max(self._peak[1], self.config.num_host_blocks - int(out.num_free_host_blocks))
        changed = []
        if st["steps"] == 1 and not hasattr(self._step, "compile_seconds"):
            self._first_tokens = int(out.has_token.sum())   # their step's time was the compile
        for slot in np.nonzero(out.has_token.any(1) | out.finished)[0]:
            req = self._requests.get(int(out.request_index[slot]))
            if req is None or req.finished:
                # Finished on the host at a stop string (and maybe released): the engine
                # reports its aborted slot once, freed now.
                self._active -= bool(out.finished[slot])
                continue
            for i in np.nonzero(out.has_token[slot])[0]:
                if i >= req.params.n or i in req.text_stopped:
                    continue
                tok = int(out.new_token[slot, i])
                req.tokens[i].append(tok)
                req.logprobs[i].append(float(out.logprob[slot, i]))
                if req.params.logprobs:
                    if not req.top_logprobs:
                        req.top_logprobs = [[] for _ in range(req.params.n)]
                    k = req.params.logprobs
                    req.top_logprobs[i].append(dict(zip(out.top_id[slot, i, :k].tolist(),
                                                        out.top_logprob[slot, i, :k].tolist())))
                st["output_tokens"] += 1
                if req.detok:
                    before = len(req.text[i])
                    req.text[i] += req.detok[i].step(tok)
                    if req.params.stop and len(req.tokens[i]) >= req.params.min_tokens:
                        self._cut_at_stop(req, i, before)
                reason = FINISH.get(int(out.seq_finish_reason[slot, i]))
                if reason and i not in req.text_stopped:
                    req.reasons[i] = reason
            if not out.finished[slot] and req.text_stopped and all(req.reasons):
                # Every sequence met a stop string: finish now, free the slot's blocks.
                self._finish(req, req.reasons)
                sched = self.state.sched
                self.state = self.state.replace(sched=abort_slots(
                    sched, (sched.request_index == req.index) & (sched.status != Status.EMPTY)))
            elif out.finished[slot]:
                self._active -= 1
                reasons = [FINISH.get(int(out.seq_finish_reason[slot, i]), FINISH.get(int(out.finish_reason[slot])))
                           for i in range(req.params.n)]
                message = None
                if int(out.finish_reason[slot]) == FinishReason.IGNORED:
                    message = IGNORE_REASONS.get(int(out.ignore_reason[slot]), "ignored")
                    st["ignored"] += 1
                self._finish(req, reasons, message)
            changed.append(req.output())
        return changed

    @staticmethod
    def _cut_at_stop(req: _Request, i: int, before: int) -> None:
        """vLLM's stop strings: the text ends before the first one (searched from the new text)."""
        text = req.text[i]
        hits = [k for s in req.params.stop
                if (k := text.find(s, max(0, before - len(s) + 1))) != -1]
        if hits:
            req.text[i] = text[:min(hits)]
            req.reasons[i] = "stop"
            req.text_stopped.add(i)

    # -------------------------------------------------------------- front ends
    def warm_up(self) -> float:
        """Compile and run every token bucket once before serving; returns the seconds it took.

        Without it each bucket compiles when a step first needs it (on one device; over a
        mesh the first step compiles them all), so a later request can wait for a compile.
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
        st = self._stats
        elapsed = max(self._busy, 1e-9)
        return {
            "steps": st["steps"], "output_tokens": st["output_tokens"],
            # Throughput of the steps that compiled nothing.
            "tokens_per_s": round((st["output_tokens"] - self._first_tokens) / elapsed, 1),
            "preempted_recompute": st["preempted_recompute"], "preempted_swap": st["preempted_swap"],
            "blocks_swapped_out": st["blocks_swapped_out"], "blocks_swapped_in": st["blocks_swapped_in"],
            "blocks_copied": st["blocks_copied"], "ignored": st["ignored"],
            "peak_device_blocks": self._peak[0], "peak_host_blocks": self._peak[1],
            "engine_seconds": round(elapsed, 2), "compile_seconds": round(self._compile, 1),
        }


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
