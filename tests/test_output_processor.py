"""The engine's host bookkeeping without a model: packing requests into the step's arrays,
and turning a step's outputs into RequestOutputs (tokens, text, stop strings, finishes)."""
from __future__ import annotations

import numpy as np

from jaxsched.core.state import FinishReason
from jaxsched.engine.input_processor import pack_new_requests
from jaxsched.engine.output_processor import OutputProcessor
from jaxsched.engine.params import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, NO_TOKEN, SamplingParams
from jaxsched.engine.stats import EngineStats
from jaxsched.engine.step import StepOutput

SLOTS, SEQS = 4, 2


class _Detok:
    """Each token id is one letter: 1 -> "a", 2 -> "b", ..."""

    def step(self, tok):
        return chr(ord("a") + tok - 1)

    def flush(self):
        return ""


class _Tokenizer:
    eos_token_id = None

    def detokenizer(self, ids, skip_special_tokens=True):
        return _Detok()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t - 1) for t in ids)


def make_processor(tokenizer=None, num_slots=SLOTS, rows=2, max_model_len=16):
    return OutputProcessor(tokenizer=tokenizer, max_model_len=max_model_len, num_slots=num_slots, rows=rows,
                           max_prompt_len=8, seed=7, stats=EngineStats(32, 8))


def step_output(**given) -> StepOutput:
    """A host-side StepOutput with nothing happening except what `given` sets."""
    z = lambda *shape, dt=np.int32: np.zeros(shape, dt)
    fields = dict(request_index=np.full(SLOTS, -1, np.int32), new_token=z(SLOTS, SEQS),
                  has_token=z(SLOTS, SEQS, dt=bool), logprob=z(SLOTS, SEQS, dt=np.float32),
                  top_id=z(SLOTS, SEQS, MAX_LOGPROBS), top_logprob=z(SLOTS, SEQS, MAX_LOGPROBS, dt=np.float32),
                  seq_finish_reason=z(SLOTS, SEQS), finished=z(SLOTS, dt=bool), finish_reason=z(SLOTS),
                  ignore_reason=z(SLOTS), scheduled=z(SLOTS, dt=bool), num_scheduled_tokens=z(SLOTS),
                  preempted=z(SLOTS), swapped_in=z(SLOTS, dt=bool), num_swap_out=0, num_swap_in=0,
                  num_copy=0, num_free_device_blocks=32, num_free_host_blocks=8, num_tokens=0,
                  num_cached_tokens=0, prefix_queried=0, prefix_hit=0)
    return StepOutput(**(fields | given))


def test_pack__rows_carry_each_request_and_the_rest_are_invalid():
    proc = make_processor()
    proc.add_request("a", None, [5, 6, 7], SamplingParams(n=2, max_tokens=9, top_k=-1, seed=3,
                                                           stop_token_ids=(11,), logprobs=4))
    proc.add_request("b", None, [8], SamplingParams(temperature=0.5, ignore_eos=True, logit_bias={3: -1.5, 9: 2}))
    new = proc.new_requests(now=1.5)
    b, s = new.batch, new.sampling
    assert np.asarray(b.valid).tolist() == [True, True]
    assert np.asarray(b.request_index).tolist() == [0, 1]
    assert np.asarray(b.prompt_len).tolist() == [3, 1] and np.asarray(b.n).tolist() == [2, 1]
    assert np.asarray(b.max_tokens).tolist() == [9, 16]
    assert np.asarray(b.arrival_time).tolist() == [1.5, 1.5]
    assert np.asarray(new.prompt_tokens).tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [8, 0, 0, 0, 0, 0, 0, 0]]
    assert np.asarray(s.top_k).tolist() == [0, 0] and np.asarray(s.num_logprobs).tolist() == [4, 0]
    assert np.asarray(s.ignore_eos).tolist() == [False, True]
    assert np.asarray(s.temperature).tolist() == [1.0, 0.5]
    assert np.asarray(s.stop_token_ids).tolist() == [[11] + [-1] * (MAX_STOP_TOKEN_IDS - 1),
                                                     [-1] * MAX_STOP_TOKEN_IDS]
    assert np.asarray(s.bias_ids)[:, :3].tolist() == [[NO_TOKEN] * 3, [3, 9, NO_TOKEN]]
    assert np.asarray(s.bias)[:, :3].tolist() == [[0, 0, 0], [-1.5, 2, 0]]
    # A request's own seed, else the engine seed and its index (engine/sampling.py).
    assert np.asarray(s.key).tolist() == [[0, 3], [0x9E3779B9 ^ 7, 1]]
    assert proc.num_queued() == 0 and proc.active == 2


def test_pack__an_empty_queue_packs_no_valid_row_in_the_same_shapes():
    new = pack_new_requests([], rows=3, max_prompt_len=5, now=0.0, seed=0)
    assert not np.asarray(new.batch.valid).any() and new.prompt_tokens.shape == (3, 5)


def test_new_requests__take_no_more_than_the_free_slots():
    proc = make_processor(num_slots=1, rows=2)
    for rid in "abc":
        proc.add_request(rid, None, [1], SamplingParams())
    proc.new_requests(0.0)
    assert proc.num_queued() == 2 and proc.active == 1
    proc.new_requests(0.0)                      # no slot free: nothing moves
    assert proc.num_queued() == 2


def test_overlong_prompt__finishes_ignored_at_once_and_is_counted():
    proc = make_processor(max_model_len=4)
    proc.add_request("long", None, [1] * 5, SamplingParams(n=2))
    out = proc.output("long")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["ignored", "ignored"]
    assert "max_model_len=4" in out.message
    assert proc.num_queued() == 0 and proc.stats.counts["ignored"] == 1


def test_process_outputs__tokens_then_the_finish_free_the_slot():
    proc = make_processor()
    proc.add_request("a", None, [1], SamplingParams(max_tokens=2))
    proc.new_requests(0.0)
    slot = 2                                   # any slot: the request index names the request
    got, stopped = proc.process_outputs(step_output(
        request_index=np.array([-1, -1, 0, -1], np.int32),
        has_token=np.eye(SLOTS, SEQS, -slot, dtype=bool), new_token=np.full((SLOTS, SEQS), 4, np.int32)))
    assert [o.outputs[0].token_ids for o in got] == [[4]] and not got[0].finished and not stopped
    reason = np.zeros((SLOTS, SEQS), np.int32)
    reason[slot, 0] = FinishReason.LENGTH_CAPPED
    got, _ = proc.process_outputs(step_output(
        request_index=np.array([-1, -1, 0, -1], np.int32), has_token=np.eye(SLOTS, SEQS, -slot, dtype=bool),
        new_token=np.full((SLOTS, SEQS), 5, np.int32), seq_finish_reason=reason,
        finished=np.arange(SLOTS) == slot, finish_reason=np.where(np.arange(SLOTS) == slot, FinishReason.LENGTH_CAPPED, 0)))
    out = got[0].outputs[0]
    assert got[0].finished and out.token_ids == [4, 5] and out.finish_reason == "length"
    assert proc.active == 0 and not proc.has_unfinished() and proc.stats.counts["output_tokens"] == 2
    proc.release("a")
    assert "a" not in proc


def test_stop_string__cuts_the_text_and_asks_the_engine_to_abort():
    proc = make_processor(tokenizer=_Tokenizer())
    proc.add_request("s", "x", [1], SamplingParams(stop=["c"], max_tokens=10))
    proc.new_requests(0.0)
    index = np.array([0, -1, -1, -1], np.int32)
    first = np.eye(SLOTS, SEQS, dtype=bool)
    for tok in (1, 2):
        got, stopped = proc.process_outputs(step_output(request_index=index, has_token=first,
                                                        new_token=np.full((SLOTS, SEQS), tok, np.int32)))
        assert not stopped
    got, stopped = proc.process_outputs(step_output(request_index=index, has_token=first,
                                                    new_token=np.full((SLOTS, SEQS), 3, np.int32)))
    out = got[0].outputs[0]
    assert got[0].finished and out.text == "ab" and out.finish_reason == "stop" and stopped == [0]
    # The engine reports the aborted slot once more: freed, no output.
    got, _ = proc.process_outputs(step_output(request_index=index, finished=np.arange(SLOTS) == 0))
    assert got == [] and proc.active == 0


def test_abort__a_queued_request_finishes_here_a_running_one_is_the_engines():
    proc = make_processor(num_slots=1)
    proc.add_request("run", None, [1], SamplingParams())
    proc.add_request("wait", None, [1], SamplingParams())
    proc.new_requests(0.0)
    assert proc.abort_request("wait") is None
    assert proc.output("wait").finished and proc.output("wait").outputs[0].finish_reason == "abort"
    assert proc.abort_request("run") == 0 and not proc.output("run").finished
    assert proc.abort_request("nobody") is None


def test_stats__counts_a_step_and_its_peaks():
    stats = EngineStats(num_device_blocks=32, num_host_blocks=8)
    stats.record_time(2.0, compiled=None)       # a first whole-step compile
    stats.record_step(step_output(preempted=np.array([1, 2, 2, 0], np.int32), num_swap_out=3,
                                  num_free_device_blocks=20, num_free_host_blocks=5, num_tokens=7),
                      compiles_lazily=False)
    stats.record_time(0.5, compiled=None)
    d = stats.as_dict()
    assert (d["steps"], d["preempted_recompute"], d["preempted_swap"], d["blocks_swapped_out"]) == (1, 1, 2, 3)
    assert (d["peak_device_blocks"], d["peak_host_blocks"]) == (12, 3)
    assert (d["compile_seconds"], d["engine_seconds"]) == (2.0, 0.5)
    assert stats.counts["tokens_run"] == 7


def test_special_tokens__out_of_the_text_unless_asked_and_a_stop_tokens_text_as_vllm():
    """With the real tokenizer: EOS (a special token) ends a sequence with stop_reason None and
    no text of its own; skip_special_tokens=False with include_stop_str_in_output shows it."""
    import pytest
    from models.gguf import find_smollm2_gguf
    from models.tokenizer import Tokenizer
    try:
        tok = Tokenizer.from_gguf_file(find_smollm2_gguf())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    hello, eos = tok.encode("Hello", add_special_tokens=False), tok.eos_token_id
    texts = {}
    for skip, keep in ((True, False), (True, True), (False, True), (False, False)):
        proc = make_processor(tokenizer=tok)
        proc.add_request("r", None, [1], SamplingParams(max_tokens=8, skip_special_tokens=skip,
                                                        include_stop_str_in_output=keep))
        proc.new_requests(0.0)
        index, first = np.array([0, -1, -1, -1], np.int32), np.eye(SLOTS, SEQS, dtype=bool)
        for t in hello:
            proc.process_outputs(step_output(request_index=index, has_token=first,
                                             new_token=np.full((SLOTS, SEQS), t, np.int32)))
        reason = np.zeros((SLOTS, SEQS), np.int32)
        reason[0, 0] = FinishReason.STOPPED
        got, _ = proc.process_outputs(step_output(
            request_index=index, has_token=first, new_token=np.full((SLOTS, SEQS), eos, np.int32),
            seq_finish_reason=reason, finished=np.arange(SLOTS) == 0,
            finish_reason=np.where(np.arange(SLOTS) == 0, FinishReason.STOPPED, 0)))
        out = got[0].outputs[0]
        assert out.token_ids == hello + [eos] and out.finish_reason == "stop" and out.stop_reason is None
        texts[skip, keep] = out.text
    assert texts[True, False] == texts[True, True] == texts[False, False] == "Hello"
    assert texts[False, True] == "Hello" + tok.eos_token


def test_stop_token_id__reason_is_the_id_and_its_text_is_left_out():
    proc = make_processor(tokenizer=_Tokenizer())
    proc.add_request("s", "x", [1], SamplingParams(stop_token_ids=[3], max_tokens=10))
    proc.add_request("k", "x", [1], SamplingParams(stop_token_ids=[3], max_tokens=10,
                                                   include_stop_str_in_output=True))
    proc.new_requests(0.0)
    index, has = np.array([0, 1, -1, -1], np.int32), np.eye(SLOTS, SEQS, dtype=bool) | np.eye(SLOTS, SEQS, -1, dtype=bool)
    proc.process_outputs(step_output(request_index=index, has_token=has, new_token=np.full((SLOTS, SEQS), 1, np.int32)))
    reason = np.zeros((SLOTS, SEQS), np.int32)
    reason[:2, 0] = FinishReason.STOPPED
    got, _ = proc.process_outputs(step_output(
        request_index=index, has_token=has, new_token=np.full((SLOTS, SEQS), 3, np.int32),
        seq_finish_reason=reason, finished=np.arange(SLOTS) < 2,
        finish_reason=np.where(np.arange(SLOTS) < 2, FinishReason.STOPPED, 0)))
    left_out, kept = (o.outputs[0] for o in got)
    assert left_out.token_ids == kept.token_ids == [1, 3]
    assert (left_out.text, kept.text) == ("a", "ac") and left_out.stop_reason == kept.stop_reason == 3


def test_metrics__arrival_then_scheduled_then_tokens_then_finish():
    proc = make_processor()
    proc.add_request("a", None, [1], SamplingParams(max_tokens=2))
    proc.add_request("never", None, [1], SamplingParams(max_tokens=2))
    first = proc.output("a").metrics
    assert first.first_scheduled_time is None and first.first_token_time is None and first.finished_time is None
    proc.new_requests(0.0)
    index = np.array([0, 1, -1, -1], np.int32)
    # A step that batches "a" only: "a" is scheduled at the step's start, "never" still waits.
    proc.process_outputs(step_output(request_index=index, scheduled=np.arange(SLOTS) == 0), started=first.arrival_time + 0.5)
    a = proc.output("a").metrics
    assert a.first_scheduled_time == first.arrival_time + 0.5 and a.time_in_queue == 0.5
    assert proc.output("never").metrics.first_scheduled_time is None
    reason = np.zeros((SLOTS, SEQS), np.int32)
    reason[0, 0] = FinishReason.LENGTH_CAPPED
    got, _ = proc.process_outputs(step_output(
        request_index=index, scheduled=np.arange(SLOTS) == 0, has_token=np.eye(SLOTS, SEQS, dtype=bool),
        new_token=np.full((SLOTS, SEQS), 4, np.int32), seq_finish_reason=reason, finished=np.arange(SLOTS) == 0,
        finish_reason=np.where(np.arange(SLOTS) == 0, FinishReason.LENGTH_CAPPED, 0)), started=a.arrival_time + 1)
    m = got[0].metrics
    assert m.first_scheduled_time == a.first_scheduled_time                    # the first, kept
    assert m.arrival_time <= m.first_token_time == m.last_token_time <= m.finished_time
    proc.release("a")
    assert proc.unscheduled == {1}
