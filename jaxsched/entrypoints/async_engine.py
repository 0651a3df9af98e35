"""One engine loop, many clients: a thread that owns the `LLM` and steps it.

HTTP handlers never touch the `LLM`. They send commands (add, abort) through a thread-safe
inbox; the loop drains the inbox between steps, so a request that arrives while a step runs
joins the running batch at the next one (continuous batching, exactly as `LLM.step`). Each
step's outputs go back to the handlers' asyncio queues with `call_soon_threadsafe`, so tokens
reach each client as they are sampled.

The loop is the only writer of the engine's state, so no lock guards it; counts a handler
reads (the waiting queue, for 503s) are taken in the loop when a request is added.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Optional

import jax
import numpy as np

from jaxsched.entrypoints.metrics import Metrics
from jaxsched.engine.params import RequestOutput, SamplingParams
from jaxsched.core.state import Status

log = logging.getLogger("jaxsched.serve")


class QueueFull(Exception):
    """The waiting queue is at --max-waiting-requests: the server answers 503."""


@dataclasses.dataclass
class _Stream:
    """A request's way back to its handler, and its timestamps for the latency histograms."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    params: SamplingParams
    first_token: Optional[float] = None


class AsyncEngine:
    """Runs `llm.step()` on its own thread while any request is unfinished."""

    def __init__(self, llm, metrics: Metrics, max_waiting_requests: int = 256):
        self.llm = llm
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jaxsched-engine", daemon=True)
        self._waiting = 0
        self._stats = dict(llm.stats())
        self.error: Optional[BaseException] = None

    # ------------------------------------------------------------ handler side
    def start(self) -> None:
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """Queue a request; returns the asyncio queue its RequestOutputs arrive on.

        Raises ValueError (a bad request: 400) or QueueFull (503), decided in the loop."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic(), params)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("add", request_id, prompt_ids, params, stream, done))
        await asyncio.wrap_future(done)
        return stream.queue

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away); its blocks are freed before the next step."""
        self._inbox.put(("abort", request_id))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, tell every client, and end the loop."""
        self._stopping.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    # ------------------------------------------------------------ loop side
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self.llm.has_unfinished()
                self._drain(block=not busy)
                if self.llm.has_unfinished():
                    outs = self.llm.step()
                    self._update_gauges()            # before publishing: a client that saw its
                    self._publish(outs)              # last token sees its blocks freed
            for rid in list(self._streams):          # shutdown: abort cleanly, say so
                self.llm.abort(rid)
            while self.llm.has_unfinished():
                self._publish(self.llm.step())
            self._publish_rest()
        except BaseException as e:                  # a dead loop must fail every client
            log.exception("engine loop failed")
            self.error = e
            self._fail_all(e)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self, cmd) -> None:
        if cmd[0] == "add":
            _, rid, ids, params, stream, done = cmd
            if self._stopping.is_set():
                done.set_exception(QueueFull("the server is shutting down"))
                return
            if self._waiting >= self.max_waiting_requests:
                done.set_exception(QueueFull(
                    f"the waiting queue is full ({self._waiting} requests waiting, "
                    f"--max-waiting-requests={self.max_waiting_requests}); retry later"))
                return
            try:
                self.llm.add_request(rid, ids, params)
            except ValueError as e:
                done.set_exception(e)
                return
            self._waiting += 1
            self._streams[rid] = stream
            done.set_result(None)
            out = self.llm.output(rid)
            if out.finished:                         # ignored at submission (too long)
                self._publish([out])
        elif cmd[0] == "abort":
            if cmd[1] in self._streams:
                self.llm.abort(cmd[1])
                self._publish([self.llm.output(cmd[1])] if self.llm.output(cmd[1]).finished else [])

    def _publish(self, outs: list[RequestOutput]) -> None:
        now = time.monotonic()
        m = self.metrics
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:                       # the warm-up's requests
                continue
            tokens = sum(len(c.token_ids) for c in out.outputs)
            if tokens and stream.first_token is None:
                stream.first_token = now
                m.time_to_first_token.observe(now - stream.arrival)
                m.prompt_tokens.inc(len(out.prompt_token_ids))
            if out.finished:
                del self._streams[out.request_id]
                m.e2e_request_latency.observe(now - stream.arrival)
                m.request_prompt_tokens.observe(len(out.prompt_token_ids))
                m.request_generation_tokens.observe(tokens)        # the returned sequences'
                m.request_params_n.observe(stream.params.n)
                m.request_params_best_of.observe(stream.params.best_of)
                longest = max(len(c.token_ids) for c in out.outputs)
                if stream.first_token is not None and longest > 1:
                    m.time_per_output_token.observe((now - stream.first_token) / (longest - 1))
                for c in out.outputs:
                    m.request_success.labels(m.model_name, c.finish_reason or "abort").inc()
                self.llm.release(out.request_id)     # the server's memory stays bounded
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _publish_rest(self) -> None:
        for rid in list(self._streams):
            self._publish([self.llm.output(rid)])

    def _fail_all(self, error: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        self._streams.clear()

    def _update_gauges(self) -> None:
        llm, m = self.llm, self.metrics
        sched = llm.state.sched
        status, device_ref, host_ref = jax.device_get((sched.status, sched.device_ref, sched.host_ref))
        running = int((status == Status.RUNNING).sum())
        swapped = int((status == Status.SWAPPED).sum())
        self._waiting = int((status == Status.WAITING).sum()) + llm.num_queued()
        m.num_requests_running.set(running)
        m.num_requests_waiting.set(self._waiting)
        m.num_requests_swapped.set(swapped)
        cfg = llm.config
        # Block 0 of each pool is the null block; the rest up to the active size are usable.
        m.gpu_cache_usage.set(int((np.asarray(device_ref)[1:] > 0).sum()) / max(cfg.num_device_blocks, 1))
        m.cpu_cache_usage.set(int((np.asarray(host_ref)[1:] > 0).sum()) / max(cfg.num_host_blocks, 1))
        stats = llm.stats()
        m.gpu_prefix_cache_hit_rate.set(stats["prefix_cache_hit_rate"])
        preempted = (stats["preempted_recompute"] + stats["preempted_swap"]
                     - self._stats["preempted_recompute"] - self._stats["preempted_swap"])
        if preempted:
            m.num_preemptions.inc(preempted)
        for mode in ("recompute", "swap"):
            delta = stats[f"preempted_{mode}"] - self._stats[f"preempted_{mode}"]
            if delta:
                m.preemptions_by_mode.labels(m.model_name, mode).inc(delta)
        # Every sequence's tokens, best_of's unreturned ones too (the engine's own count).
        if stats["output_tokens"] > self._stats["output_tokens"]:
            m.generation_tokens.inc(stats["output_tokens"] - self._stats["output_tokens"])
        self._stats = stats
