"""Data parallelism: independent `LLM` engines on disjoint slices of a device mesh, one router.

    llm = LLM(model, mesh_shape=(2, 1))        # a DataParallelLLM: two replicas, one device each
    llm.generate(prompts, params)              # every `LLM` call works the same way

The weights are loaded once and placed by each replica on its own devices. A new request
goes to the replica with the fewest unfinished requests; afterwards its id names its owner.
The replicas step one after another in this process.
"""
from __future__ import annotations

import time
from jaxsched.entrypoints.llm import LLM, _FrontEnd, load_model_parts, model_dtype, with_chat_template
from models.chat import load_chat_template
from jaxsched.engine.params import RequestOutput, SamplingParams


class DataParallelLLM(_FrontEnd):
    """The `LLM` methods over `mesh_shape[0]` replicas of `mesh_shape[1]` devices each."""

    def __init__(self, model=None, *, mesh_shape: tuple[int, int], tokenizer=None, dtype: str = "float32",
                 devices=None, **kwargs):
        from jaxsched.engine.sharding import make_mesh
        data, tp = mesh_shape
        dtype = model_dtype(dtype)
        template = kwargs.pop("chat_template", None)
        template = load_chat_template(template) if template is not None else None
        model_config, tensors, instance, tokenizer = load_model_parts(model, tokenizer, dtype)
        tokenizer = with_chat_template(tokenizer, template)   # one for the router and replicas
        mesh = make_mesh(data, tp, devices)
        self.replicas = [LLM((model_config, tensors, instance), mesh_shape=(1, tp), tokenizer=tokenizer,
                             dtype=dtype, devices=list(mesh.devices[i].flat), **kwargs)
                         for i in range(data)]
        self.model_config, self.tokenizer = model_config, tokenizer
        self.config = self.replicas[0].config
        self._owner: dict[str, LLM] = {}
        self._next = 0

    # Requests: checked by one replica (they share a config), queued on the least loaded.
    def _prepare(self, request_id, prompt, params, field="prompt"):
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r}: duplicate id")
        return self.replicas[0]._prepare(request_id, prompt, params, field)

    def _enqueue(self, request_id: str, text, ids, params: SamplingParams) -> None:
        target = min(self.replicas, key=LLM.get_num_unfinished_requests)
        target._enqueue(request_id, text, ids, params)
        self._owner[request_id] = target
        self._next += 1

    def abort(self, request_id: str) -> None:
        if request_id in self._owner:
            self._owner[request_id].abort(request_id)

    def release(self, request_id: str) -> None:
        owner = self._owner.pop(request_id, None)
        if owner is not None:
            owner.release(request_id)

    def output(self, request_id: str) -> RequestOutput:
        return self._owner[request_id].output(request_id)

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return sum(r.get_num_unfinished_requests() for r in self.replicas)

    def num_queued(self) -> int:
        return sum(r.num_queued() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        return [o for r in self.replicas if r.has_unfinished() for o in r.step()]

    def warm_up(self) -> float:
        start = time.perf_counter()
        for replica in self.replicas:
            replica.warm_up()
        return time.perf_counter() - start

    def stats(self) -> dict:
        # Replicas step one after another in this process: rates add up over summed time.
        parts = [r.stats() for r in self.replicas]
        total = {k: sum(p[k] for p in parts) for k in parts[0]}
        for k in ("peak_device_blocks", "peak_host_blocks", "steps", "compile_seconds"):
            total[k] = max(p[k] for p in parts)
        total["tokens_per_s"] = round(sum(p["tokens_per_s"] * p["engine_seconds"] for p in parts)
                                      / max(total["engine_seconds"], 1e-9), 1)
        total["replicas"] = len(parts)
        return total

    @property
    def state(self):
        """The first replica's engine state (each replica has its own)."""
        return self.replicas[0].state

    def __repr__(self) -> str:
        return f"DataParallelLLM(replicas={len(self.replicas)}, config={self.config})"


__all__ = ["DataParallelLLM"]
