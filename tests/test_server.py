"""`jaxsched serve` as a real process on a loopback port, driven by the official `openai` client.

One server, started once per module (its start, SmolLM2's load and compile, is the slow
part): an API key (auth), a waiting queue of 56 (a burst past it gets 503s), prefix caching
on, and a cache so small that 48 concurrent streams of six prompts preempt by recompute
(single sequences) and by swap (n=2 groups), with a quarter of them hanging up mid-stream.
Greedy outputs are checked against the offline `LLM` (a roomy cache, prefix caching off) on
the same prompts: preemption and cached prefixes change no output.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from jaxsched.engine.params import SamplingParams

MODEL = "smollm2-135m"
KEY = "test-key"
# One engine shape for the server and the offline LLM; only the block counts differ, and the
# pools' capacity is the same, so both run the same model executables.
ENGINE = dict(block_size=16, max_num_seqs=8, num_slots=16, max_num_batched_tokens=64, max_model_len=256,
              num_device_blocks_capacity=64, num_host_blocks_capacity=64)
ROOMY = dict(ENGINE, num_device_blocks=64, num_host_blocks=64)
SMALL = dict(ENGINE, num_device_blocks=12, num_host_blocks=64)
MAX_WAITING = 56                # above the load test's 48 streams, below the 503 test's burst
START_TIMEOUT_S = 900          # a cold compile of SmolLM2 on a small CPU
PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):",
           "The three primary colors are", "In 1969, the first", "A KV cache stores"]


def _flags(engine: dict) -> list[str]:
    return [x for k, v in engine.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Looked up here, not in the child: between fork and exec the child may only call into C
# (dlopen there could wait forever on a lock another thread of the worker held at the fork).
_PRCTL = __import__("ctypes").CDLL(None).prctl if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the server's child process, before exec: if the test worker dies (a crash skips the
    fixture's stop), the kernel sends the server SIGTERM, its clean shutdown, instead of
    leaving it serving nobody. Linux only; elsewhere the fixture's stop is all there is."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def _start(engine: dict, *extra: str, env: dict | None = None):
    pytest.importorskip("fastapi")
    from models.gguf import find_smollm2_gguf
    try:
        find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    port = _free_port()
    cmd = [sys.executable, "-m", "jaxsched.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           *_flags(engine), *extra]
    # The server runs with the XLA flags a user's does (the CLI's default), not the suite's
    # compile-fast ones: 48 streams of SmolLM2 at LLVM -O0 take longer than the compile saves.
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, **(env or {})}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent)
    base = f"http://127.0.0.1:{port}"
    from jaxsched.entrypoints.openai_server import wait_until_healthy
    if wait_until_healthy(base, proc, START_TIMEOUT_S):
        return proc, base
    if proc.poll() is not None:
        pytest.fail(f"jaxsched serve exited with {proc.returncode}:\n{proc.stdout.read()}")
    proc.kill()
    pytest.fail(f"jaxsched serve not healthy after {START_TIMEOUT_S} s")


def _stop(proc, sig=signal.SIGINT) -> int:
    proc.send_signal(sig)                      # SIGINT or SIGTERM: the clean shutdown path
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@pytest.fixture(scope="module")
def server():
    proc, base = _start(SMALL, "--max-waiting-requests", str(MAX_WAITING), "--enable-prefix-caching",
                        env={"JAXSCHED_API_KEY": KEY})
    yield base
    # A service manager's stop is a clean exit (uvicorn takes SIGINT, Ctrl-C, the same way).
    assert _stop(proc, signal.SIGTERM) == 0


@pytest.fixture(scope="module")
def offline():
    from conftest import optimized_model_parts
    from jaxsched.entrypoints.llm import LLM
    with optimized_model_parts():            # the servers' model and finish programs, too
        return LLM(MODEL, **ROOMY)


def _client(base: str, key: str = KEY, cls=openai.OpenAI):
    return cls(base_url=base + "/v1", api_key=key, max_retries=0, timeout=600)


def _offline_greedy(llm, prompts, max_tokens, **kw) -> list[str]:
    ids = [llm.tokenizer.encode(p) for p in prompts]
    outs = llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        m = re.match(r'^([a-zA-Z0-9_:]+)(\{[^}]*\})? ([0-9.e+-]+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            key = m.group(1) + (f"[{labels['mode']}]" if "mode" in labels else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


# ----------------------------------------------------------------------------- basics
def test_models_health_metrics(server):
    assert httpx.get(server + "/health").status_code == 200
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    names = _metrics(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
                 "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:gpu_prefix_cache_hit_rate",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_prompt_tokens_count",
                 "vllm:request_generation_tokens_count", "vllm:request_params_n_count",
                 "vllm:request_params_best_of_count"):
        assert name in names, name


def test_completion_greedy_equals_offline(server, offline):
    client = _client(server)
    got = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
           for p in PROMPTS[:3]]
    assert got == _offline_greedy(offline, PROMPTS[:3], 12)
    res = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert res.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPTS[0]))
    assert res.usage.completion_tokens <= 12 and res.choices[0].finish_reason in ("length", "stop")


def test_several_prompts_in_one_completion(server, offline):
    """A list of prompts is one request with choices k*n+j, as in vLLM; streamed alike."""
    client = _client(server)
    prompts = PROMPTS[3:6]
    res = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert [c.text for c in res.choices] == _offline_greedy(offline, prompts, 8)
    assert res.usage.prompt_tokens == sum(len(offline.tokenizer.encode(p)) for p in prompts)
    ids = [offline.tokenizer.encode(p) for p in prompts[:2]]
    two = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3]
    assert [c.text for c in sorted(two.choices, key=lambda c: c.index)][::2] == [c.text for c in res.choices[:2]]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in res.choices]
    assert chunks[-1].usage.total_tokens == res.usage.total_tokens


def test_one_bad_prompt_in_a_list_queues_nothing(server):
    before = _metrics(server)["vllm:prompt_tokens_total"]
    r = httpx.post(server + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": ["fine", "hello " * 300], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]", r.text
    assert "max_model_len=256" in r.json()["error"]["message"]
    time.sleep(1.0)
    assert _metrics(server)["vllm:prompt_tokens_total"] == before        # "fine" never ran


def test_chat_greedy_equals_offline(server, offline):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    res = _client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    want = offline.chat(messages, SamplingParams(max_tokens=16, temperature=0.0))
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == want.outputs[0].text


def test_streaming_matches_whole_and_ends_with_done(server):
    client = _client(server)
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1      # token by token
    # The raw wire format: server-sent events ending in [DONE].
    with httpx.stream("POST", server + "/v1/chat/completions", timeout=300,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 4, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0].removeprefix("data: "))
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_n2_and_seeded_sampling(server):
    client = _client(server)
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=1.0, n=2)
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    c = client.completions.create(seed=8, **kw)
    assert [ch.index for ch in a.choices] == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert [ch.text for ch in a.choices] != [ch.text for ch in c.choices]
    assert 2 <= a.usage.completion_tokens <= 20


def test_logprobs(server):
    res = _client(server).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                             logprobs=0)
    lp = res.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) >= 1 and all(x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == res.choices[0].text
    res = _client(server).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                             logprobs=3)
    lp = res.choices[0].logprobs
    assert all(1 <= len(top) <= 3 and max(top.values()) == pytest.approx(x, abs=1e-4)
               for top, x in zip(lp.top_logprobs, lp.token_logprobs))
    chat = _client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-4)


def test_vllm_fields_best_of_echo_stop_reason_truncation(server, offline):
    client = _client(server)
    ids = offline.tokenizer.encode(PROMPTS[2])
    # best_of: the most likely of 3 seeded samples, as offline; choices numbered from 0.
    best = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=1.0, seed=5,
                                     n=1, best_of=3)
    want = offline.generate([ids], SamplingParams(max_tokens=6, seed=5, n=1, best_of=3), use_tqdm=False)[0]
    assert [c.index for c in best.choices] == [0] and best.choices[0].text == want.outputs[0].text
    assert best.usage.completion_tokens == len(want.outputs[0].token_ids)
    # The engine made best_of sequences: generation_tokens_total counts them all, and vLLM's
    # per-request histograms see the request.
    before = _metrics(server)
    client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=5, seed=5, n=1, best_of=3,
                              extra_body={"ignore_eos": True})
    after = _metrics(server)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 15
    assert after["vllm:request_params_best_of_sum"] - before["vllm:request_params_best_of_sum"] == 3
    assert after["vllm:request_params_n_count"] - before["vllm:request_params_n_count"] == 1
    assert after["vllm:request_generation_tokens_sum"] - before["vllm:request_generation_tokens_sum"] == 5
    # echo: the prompt's text, then the completion's, whole and streamed; token-id prompts decoded.
    kw = dict(model=MODEL, max_tokens=5, temperature=0)
    plain = client.completions.create(prompt=PROMPTS[0], **kw).choices[0].text
    assert client.completions.create(prompt=PROMPTS[0], echo=True, **kw).choices[0].text == PROMPTS[0] + plain
    chunks = client.completions.create(prompt=PROMPTS[0], echo=True, stream=True, **kw)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPTS[0] + plain
    echoed = client.completions.create(prompt=offline.tokenizer.encode(PROMPTS[0]), echo=True, **kw)
    assert echoed.choices[0].text == offline.tokenizer.decode(offline.tokenizer.encode(PROMPTS[0])) + plain
    # stop_reason (vLLM's extra field) and include_stop_str_in_output.
    full = client.completions.create(prompt=PROMPTS[3], max_tokens=24, model=MODEL, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    stop = _a_stop_string(full.text)
    for keep in (False, True):
        got = client.completions.create(prompt=PROMPTS[3], max_tokens=24, model=MODEL, temperature=0, stop=stop,
                                        extra_body={"ignore_eos": True, "include_stop_str_in_output": keep})
        c = got.choices[0].model_dump()
        assert c["text"] == full.text[:full.text.find(stop) + (len(stop) if keep else 0)]
        assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
    assert full.model_dump()["stop_reason"] is None
    # truncate_prompt_tokens keeps the prompt's last tokens (usage counts what ran).
    short = client.completions.create(prompt=PROMPTS[0], extra_body={"truncate_prompt_tokens": 2}, **kw)
    assert short.usage.prompt_tokens == 2
    # logit_bias on device: a token pushed by 100 is every token.
    forced = offline.tokenizer.encode(" banana", add_special_tokens=False)[0]
    biased = client.completions.create(prompt=PROMPTS[0], logit_bias={str(forced): 100}, **kw).choices[0]
    assert biased.text == offline.tokenizer.decode([forced] * 5)
    # logprobs' text offsets point at each token in the text.
    lp = client.completions.create(prompt=PROMPTS[0], logprobs=1, **kw).choices[0].logprobs
    assert lp.text_offset == [len("".join(lp.tokens[:j])) for j in range(len(lp.tokens))]


def test_tokenize_detokenize_version_content_parts_and_max_completion_tokens(server, offline):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server + "/tokenize", json={"model": MODEL, "prompt": PROMPTS[0]}, timeout=60).json()
    assert r["tokens"] == offline.tokenizer.encode(PROMPTS[0]) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    back = httpx.post(server + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}, timeout=60).json()
    assert back["prompt"] == offline.tokenizer.decode(r["tokens"])
    bad = httpx.post(server + "/detokenize", json={"tokens": [10**9]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(server + "/version", timeout=60).json()["version"]
    # OpenAI's content parts (text) are the same prompt as the string; /tokenize renders it too.
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    client = _client(server)
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=joined, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content == offline.chat(parts, SamplingParams(max_tokens=6, temperature=0.0)).outputs[0].text
    counted = httpx.post(server + "/tokenize", json={"messages": parts}, timeout=60).json()["count"]
    assert counted == a.usage.prompt_tokens
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    r = httpx.post(server + "/v1/chat/completions", headers=auth, timeout=60, json={"model": MODEL, "messages": image})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "messages[0].content[0]" in r.json()["error"]["message"]
    # max_completion_tokens, OpenAI's newer name for a chat's max_tokens.
    capped = client.chat.completions.create(model=MODEL, messages=joined, max_completion_tokens=3, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"


def _a_stop_string(text: str) -> str:
    """A word from the middle of a greedy output: generation must end right before it."""
    words = text.split()
    assert len(words) >= 4, text
    return " " + words[len(words) // 2]


def test_stop_strings_offline_and_served(server, offline):
    full = _offline_greedy(offline, [PROMPTS[3]], 24, ignore_eos=True)[0]
    stop = _a_stop_string(full)
    cut = full[:full.find(stop)]
    ids = offline.tokenizer.encode(PROMPTS[3])
    out = offline.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                 stop=[stop, "never-seen-stop"]), use_tqdm=False)[0]
    assert out.outputs[0].text == cut and out.outputs[0].finish_reason == "stop"
    assert len(out.outputs[0].token_ids) < 24                     # the engine stopped early
    client = _client(server)
    kw = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=stop,
              extra_body={"ignore_eos": True})
    res = client.completions.create(**kw)
    assert res.choices[0].text == cut and res.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut   # no part of it streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


# ----------------------------------------------------------------------------- bad input
BAD = [
    (b'{"model": "smollm2-135m", "prompt": ', "body"),                              # malformed JSON
    (b'{"model": "smollm2-135m", "prompt": "\xff\xfe"}', "body"),                    # not UTF-8
    ({"model": "gpt-4", "prompt": "x"}, "model"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ({"model": MODEL, "prompt": "hello " * 300, "max_tokens": 4}, "prompt"),
    ({"model": MODEL, "prompt": "x", "n": 9}, "n"),
    ({"model": MODEL, "prompt": "x", "top_p": 2}, "top_p"),
    ({"model": MODEL, "prompt": "x" * (2 << 20)}, "body"),                            # over the size limit
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "messages": []}, "messages"),
    # vLLM's fields and OpenAI's that jaxsched does not do: a 400 each, never ignored.
    ({"model": MODEL, "prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"model": MODEL, "prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    ({"model": MODEL, "prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ({"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"hello": -100}}, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"50": -101}}, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "suffix": "end"}, "suffix"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_request_is_400_naming_the_field(server, body, param):
    route = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + route, content=content, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["code"] == 400
    if param in ("max_tokens", "n", "prompt", "top_p") and "required" not in err["message"]:
        assert re.search(r"\d", err["message"]), err["message"]      # the limit is named


def test_bad_request_via_openai_client_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        _client(server).completions.create(model=MODEL, prompt="x", top_p=2)


# ----------------------------------------------------------------------------- auth, 503
def test_auth(server):
    body = dict(model=MODEL, prompt="x", max_tokens=1)
    assert httpx.post(server + "/v1/completions", json=body, timeout=60).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").completions.create(**body)
    assert _client(server).completions.create(**body).choices
    assert httpx.get(server + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(server + "/health").status_code == 200                 # not a /v1 route


def test_backpressure_503_past_the_queue_limit(server):
    """A burst of 128 at once: more than the waiting queue and the running batch hold."""
    async def one(client, i):
        try:
            res = await client.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)],
                                                  max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
            return res.usage.completion_tokens
        except openai.APIStatusError as e:
            return e

    async def burst():
        async with _client(server, cls=openai.AsyncOpenAI) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(128))), 600)

    results = asyncio.run(burst())
    refused = [r for r in results if not isinstance(r, int)]
    assert refused and all(r.status_code == 503 and "max-waiting-requests" in r.message for r in refused)
    assert all(r == 8 for r in results if isinstance(r, int))
    assert len(refused) < len(results)
    assert httpx.get(server + "/health").status_code == 200


# ----------------------------------------------------------------------------- load with faults
def test_load_with_disconnects_preemption_and_bad_requests(server, offline):
    """48 streams on 12 blocks with prefix caching: preempted by recompute and swap, a quarter
    hang up, some are bad; every finished stream is the offline engine's greedy text."""
    max_tokens = 20
    want = dict(zip(PROMPTS, _offline_greedy(offline, PROMPTS, max_tokens, ignore_eos=True)))

    async def stream(client, i):
        prompt = PROMPTS[i % len(PROMPTS)]
        n = 2 if i % 6 == 1 else 1                        # groups of two are preempted by swap
        hang_up = i % 4 == 3
        texts, chunks = [""] * n, 0
        s = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, n=n,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for c in s:
            for ch in c.choices:
                texts[ch.index] += ch.text
            chunks += 1
            if hang_up and chunks == 3:
                await s.close()                           # the client goes away mid-stream
                return None
        return prompt, texts

    async def bad(client, i):
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=MODEL, prompt="x", max_tokens=0 if i % 2 else 1,
                                            top_p=2 if i % 2 == 0 else 1)
        return "bad"

    async def load():
        async with _client(server, cls=openai.AsyncOpenAI) as client:
            jobs = [stream(client, i) for i in range(48)] + [bad(client, i) for i in range(6)]
            return await asyncio.wait_for(asyncio.gather(*jobs), 600)

    results = asyncio.run(load())
    done = [r for r in results if isinstance(r, tuple)]
    assert len(done) == 36 and results.count("bad") == 6
    for prompt, texts in done:
        assert texts == [want[prompt]] * len(texts), prompt
    assert httpx.get(server + "/health").status_code == 200

    deadline = time.monotonic() + 120            # aborted requests finish at the next step
    while (m := _metrics(server))["vllm:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert m["jaxsched:num_preemptions_by_mode_total[recompute]"] > 0
    assert m["jaxsched:num_preemptions_by_mode_total[swap]"] > 0
    assert m["vllm:num_preemptions_total"] == (m["jaxsched:num_preemptions_by_mode_total[recompute]"]
                                               + m["jaxsched:num_preemptions_by_mode_total[swap]"])
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert 0 < m["vllm:gpu_prefix_cache_hit_rate"] <= 1          # six prompts, each asked eight times
    assert m["vllm:num_requests_swapped"] == 0
    assert m["vllm:gpu_cache_usage_perc"] == 0 and m["vllm:cpu_cache_usage_perc"] == 0
    assert m["vllm:request_success_total"] >= 36
