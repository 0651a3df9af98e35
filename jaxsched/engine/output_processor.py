"""The engine's host bookkeeping of requests, as vLLM's `OutputProcessor`.

Each request has a `RequestState` (prompt, parameters, tokens and text so far, finish
reasons, detokenizers). Requests wait in a host queue until the engine has a free slot;
`new_requests` hands the next ones over, packed (`input_processor`), and `process_outputs`
turns a step's `StepOutput` into `RequestOutput`s: tokens, log-probabilities, incremental
text, stop strings (vLLM's `StopChecker`: the text ends before the first one, and a request
whose every sequence stopped is given back for the engine to abort) and finish reasons.

The engine state itself is not touched here: the caller owns it and aborts what it is told.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Callable, Optional

import numpy as np

from jaxsched.core.state import IGNORE_REASONS, FinishReason
from jaxsched.engine.input_processor import pack_new_requests
from jaxsched.engine.params import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SamplingParams
from jaxsched.engine.stats import EngineStats
from jaxsched.engine.step import NewRequests

# vLLM's finish_reason strings.
FINISH = {FinishReason.LENGTH_CAPPED: "length", FinishReason.STOPPED: "stop",
          FinishReason.IGNORED: "ignored", FinishReason.ABORTED: "abort"}


def _arrived(now: float) -> RequestMetrics:
    return RequestMetrics(arrival_time=now, last_token_time=now)


@dataclasses.dataclass
class RequestState:
    """One request on the host. The engine samples `params.best_of` sequences; `output` gives
    the `params.n` with the highest cumulative log-probability (every one when best_of == n)."""
    index: int                 # the engine's id of the request (StepOutput.request_index)
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
    logprob_dicts: list = dataclasses.field(default_factory=list)  # per sequence, with logprobs
    stop_reasons: list = dataclasses.field(default_factory=list)  # per sequence: str, int or None
    decode: Optional[Callable[[int], str]] = None                 # a token's text, for Logprob
    eos: Optional[int] = None                                     # the model's EOS token id
    metrics: RequestMetrics = dataclasses.field(default_factory=lambda: _arrived(time.time()))

    def output(self) -> RequestOutput:
        outs = [self._sequence(i) for i in range(self.params.best_of)]
        if self.params.best_of > self.params.n:
            # vLLM's order: by cumulative log-probability, best first (a stable sort).
            outs = sorted(outs, key=lambda c: -c.cumulative_logprob)[:self.params.n]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), outs,
                             self.finished, self.message, metrics=dataclasses.replace(self.metrics))

    def _sequence(self, i: int) -> CompletionOutput:
        return CompletionOutput(
            index=i, token_ids=list(self.tokens[i]), text=self.text[i],
            finish_reason=self.reasons[i], cumulative_logprob=float(sum(self.logprobs[i])),
            logprobs=(list(self.logprob_dicts[i]) if self.logprob_dicts else [])
            if self.params.logprobs is not None else None,
            stop_reason=self.stop_reasons[i] if self.stop_reasons else None)


def finish(req: RequestState, reasons, message: Optional[str] = None) -> None:
    """Mark `req` finished with per-sequence `reasons` (a stop string's "stop" kept)."""
    req.finished = True
    req.metrics.finished_time = time.time()
    req.reasons = [req.reasons[i] or reasons[i] for i in range(req.params.best_of)]
    req.message = message
    for i, d in enumerate(req.detok):
        if i not in req.text_stopped:            # cut at a stop string: nothing follows
            req.text[i] += d.flush()


def _stop_reason(req: RequestState, i: int, stop: str | int | None) -> None:
    if not req.stop_reasons:
        req.stop_reasons = [None] * req.params.best_of
    req.stop_reasons[i] = stop


def cut_at_stop(req: RequestState, i: int, before: int) -> None:
    """vLLM's stop strings: the text ends before the first one (searched from the new text),
    or after it with `include_stop_str_in_output`."""
    text = req.text[i]
    hits = [(k, n, s) for n, s in enumerate(req.params.stop)
            if (k := text.find(s, max(0, before - len(s) + 1))) != -1]
    if hits:
        k, _, s = min(hits)
        req.text[i] = text[:k + len(s)] if req.params.include_stop_str_in_output else text[:k]
        req.reasons[i] = "stop"
        req.text_stopped.add(i)
        _stop_reason(req, i, s)


def _stop_token(req: RequestState, out, slot: int, i: int, tok: int):
    """The stop token `tok` ends sequence i at (its id, or None for EOS), or False if it does
    not: the engine finished it as stopped (EOS unless ignore_eos, or a stop token id; both
    masked before min_tokens), and vLLM checks EOS first."""
    if int(out.seq_finish_reason[slot, i]) != FinishReason.STOPPED:
        return False
    at_eos = tok == req.eos and not req.params.ignore_eos
    return tok if tok in req.params.stop_token_ids and not at_eos else None


def _append_token(req: RequestState, out, slot: int, i: int) -> None:
    """Sequence i of `req` got its next token from `out` at `slot`: ids, log-probs, text."""
    tok = int(out.new_token[slot, i])
    req.tokens[i].append(tok)
    req.metrics.last_token_time = time.time()
    if req.metrics.first_token_time is None:
        req.metrics.first_token_time = req.metrics.last_token_time
    req.logprobs[i].append(float(out.logprob[slot, i]))
    if req.params.logprobs is not None:
        if not req.logprob_dicts:
            req.logprob_dicts = [[] for _ in range(req.params.best_of)]
        k = req.params.logprobs
        top = out.top_id[slot, i, :k].tolist()
        text = req.decode or (lambda t: None)
        # vLLM's dict: the sampled token first, then the k most likely (ranked 1..k).
        entry = {tok: Logprob(float(out.logprob[slot, i]), top.index(tok) + 1 if tok in top else None, text(tok))}
        for rank, (t, v) in enumerate(zip(top, out.top_logprob[slot, i, :k].tolist()), 1):
            entry.setdefault(t, Logprob(v, rank, text(t)))
        req.logprob_dicts[i].append(entry)
    stop = _stop_token(req, out, slot, i, tok)
    if req.detok and (stop is False or req.params.include_stop_str_in_output):
        # As vLLM, the text of the token a sequence stops at (EOS or a stop token id) is
        # left out, unless include_stop_str_in_output.
        before = len(req.text[i])
        req.text[i] += req.detok[i].step(tok)
        if req.params.stop and len(req.tokens[i]) >= req.params.min_tokens:
            cut_at_stop(req, i, before)
    if stop is not False and i not in req.text_stopped:
        _stop_reason(req, i, stop)
    reason = FINISH.get(int(out.seq_finish_reason[slot, i]))
    if reason and i not in req.text_stopped:
        req.reasons[i] = reason


def _token_text(tokenizer, skip_special_tokens: bool, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)


class OutputProcessor:
    """The requests of one engine by engine index and by id, its host waiting queue, and
    how many of its slots hold a request."""

    def __init__(self, *, tokenizer, max_model_len: int, num_slots: int, rows: int,
                 max_prompt_len: int, seed: int, stats: EngineStats):
        self.tokenizer, self.max_model_len, self.num_slots = tokenizer, max_model_len, num_slots
        self.rows, self.max_prompt_len, self.seed, self.stats = rows, max_prompt_len, seed, stats
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None   # the engine's
        self.requests: dict[int, RequestState] = {}
        self.by_id: dict[str, int] = {}
        self.queue: collections.deque[int] = collections.deque()
        self.unscheduled: set[int] = set()   # handed to the engine, not yet in a step's batch
        self.active = 0            # requests handed to the engine and not yet freed there
        self.next_index = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def add_request(self, request_id: str, text: Optional[str], ids: list[int],
                    params: SamplingParams) -> None:
        """Queue a checked request (the front end validated it)."""
        idx = self.next_index
        self.next_index += 1
        n = params.best_of
        detok = ([self.tokenizer.detokenizer(ids, skip_special_tokens=params.skip_special_tokens)
                  for _ in range(n)] if self.tokenizer and params.detokenize else [])
        decode = None
        if self.tokenizer and params.detokenize:
            decode = functools.partial(_token_text, self.tokenizer, params.skip_special_tokens)
        req = RequestState(idx, request_id, text, ids, params, [[] for _ in range(n)],
                           [[] for _ in range(n)], [None] * n, detok, [""] * n, decode=decode,
                           eos=self.eos_token_id)
        self.requests[idx] = req
        self.by_id[request_id] = idx
        if len(ids) > self.max_model_len:
            # As vLLM 0.5.3: an over-long prompt costs only itself. It finishes as ignored at
            # once, with the numbers, and the engine never sees it.
            self.stats.counts["ignored"] += 1
            finish(req, ["ignored"] * n,
                   f"prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
            return
        self.queue.append(idx)

    def abort_request(self, request_id: str) -> Optional[int]:
        """Abort a request still on the host; for one in the engine, return its index for the
        caller to abort there (its outputs then finish it). None where nothing is left to do."""
        idx = self.by_id.get(request_id)
        if idx is None or self.requests[idx].finished:
            return None
        if idx in self.queue:
            self.queue.remove(idx)
            req = self.requests[idx]
            finish(req, ["abort"] * req.params.best_of)
            return None
        return idx

    def release(self, request_id: str) -> None:
        idx = self.by_id.get(request_id)
        if idx is not None and self.requests[idx].finished:
            del self.by_id[request_id], self.requests[idx]
            self.unscheduled.discard(idx)

    def output(self, request_id: str) -> RequestOutput:
        return self.requests[self.by_id[request_id]].output()

    def num_unfinished(self) -> int:
        return sum(not r.finished for r in self.requests.values())

    def has_unfinished(self) -> bool:
        return any(not r.finished for r in self.requests.values())

    def num_queued(self) -> int:
        return len(self.queue)

    def new_requests(self, now: float) -> NewRequests:
        """Hand the queue's next requests, as many as there are free slots and rows, to the
        engine, packed, arriving at `now`."""
        take = []
        while self.queue and len(take) < min(self.rows, self.num_slots - self.active):
            take.append(self.requests[self.queue.popleft()])
        self.active += len(take)
        self.unscheduled.update(req.index for req in take)
        return pack_new_requests(take, self.rows, self.max_prompt_len, now, self.seed)

    def process_outputs(self, out, started: Optional[float] = None) -> tuple[list[RequestOutput], list[int]]:
        """A step's host-side `StepOutput`, of a step that began at `started` (`time.time()`;
        now if None): (the outputs of the requests that advanced or finished, the indices of
        requests every sequence of which met a stop string: finished here, to be aborted in
        the engine to free their blocks)."""
        changed, to_abort = [], []
        if self.unscheduled:
            started = time.time() if started is None else started
            for slot in np.nonzero(out.scheduled)[0]:
                req = self.requests.get(int(out.request_index[slot]))
                if req is not None and req.index in self.unscheduled:
                    self.unscheduled.discard(req.index)
                    req.metrics.first_scheduled_time = started
                    req.metrics.time_in_queue = started - req.metrics.arrival_time
        for slot in np.nonzero(out.has_token.any(1) | out.finished)[0]:
            req = self.requests.get(int(out.request_index[slot]))
            if req is None or req.finished:
                # Finished on the host at a stop string (and maybe released): the engine
                # reports its aborted slot once, freed now.
                self.active -= bool(out.finished[slot])
                continue
            for i in np.nonzero(out.has_token[slot])[0]:
                if i >= req.params.best_of or i in req.text_stopped:
                    continue
                self.stats.counts["output_tokens"] += 1
                _append_token(req, out, slot, i)
            if not out.finished[slot] and req.text_stopped and all(req.reasons):
                finish(req, req.reasons)             # every sequence met a stop string
                to_abort.append(req.index)
            elif out.finished[slot]:
                self.active -= 1
                self.unscheduled.discard(req.index)      # e.g. aborted before it ran
                reasons = [FINISH.get(int(out.seq_finish_reason[slot, i]), FINISH.get(int(out.finish_reason[slot])))
                           for i in range(req.params.best_of)]
                message = None
                if int(out.finish_reason[slot]) == FinishReason.IGNORED:
                    message = IGNORE_REASONS.get(int(out.ignore_reason[slot]), "ignored")
                    self.stats.counts["ignored"] += 1
                finish(req, reasons, message)
            changed.append(req.output())
        return changed, to_abort
