"""`jaxsched serve`: an OpenAI-compatible HTTP server over one engine loop (FastAPI + uvicorn).

    jaxsched serve --port 8000            # the embedded SmolLM2-135M-Instruct
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 16}'

Routes as `vllm serve`'s: POST /v1/completions, POST /v1/chat/completions (streaming as
server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics
(Prometheus, vLLM's metric names), POST /tokenize, POST /detokenize, GET /version. Every
request joins the running batch at the next engine step; a client that disconnects is
aborted and its blocks freed at once.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import signal
import sys
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from jaxsched.entrypoints.async_engine import AsyncEngine, QueueFull
from jaxsched.entrypoints.cli_serve import DEFAULT_MODEL_NAME, MAX_BODY_BYTES
from jaxsched.entrypoints.metrics import Metrics
from jaxsched.engine.params import truncate_prompt
from jaxsched.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                           TokenizeRequest, error_body)
from models.chat import ChatTemplateError, content_text



class ApiError(Exception):
    """Answered as OpenAI's error JSON with this status."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 kind: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def _field_of(message: str) -> Optional[str]:
    """The field a SamplingParams / LLM error names ("SamplingParams.top_p: ..." -> top_p)."""
    m = re.match(r"(?:SamplingParams\.)?([a-z_]+)[:\[ ]", message)
    return m.group(1) if m else None


async def _read_json(request: Request, model, limit: int):
    """The body as `model`: its size, UTF-8, JSON and fields checked, each with its own 400."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(f"request body: {declared} bytes, more than the limit of {limit} bytes", "body")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(f"request body: more than the limit of {limit} bytes", "body")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(f"request body: not valid UTF-8 (byte {e.start})", "body") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(f"request body: malformed JSON: {e}", "body") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        raise ApiError(f"{field}: {err['msg']} (got {err.get('input')!r:.80})", field) from None


class OpenAIServer:
    """The routes' logic over one AsyncEngine; `app` is the FastAPI application."""

    def __init__(self, engine: AsyncEngine, model_name: str, api_key: Optional[str] = None,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.engine, self.llm = engine, engine.llm
        self.model_name, self.api_key, self.max_body_bytes = model_name, api_key, max_body_bytes
        self.created = int(time.time())
        self.app = self._build()

    # ------------------------------------------------------------ app
    def _build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.engine.start()
            yield
            await asyncio.to_thread(self.engine.stop)

        app = FastAPI(title="jaxsched", lifespan=lifespan)

        @app.exception_handler(ApiError)
        async def api_error(request, exc: ApiError):
            return JSONResponse(error_body(exc.message, exc.param, exc.kind, exc.status), exc.status)

        @app.middleware("http")
        async def auth(request: Request, call_next):
            # As `vllm serve --api-key`: every /v1 route needs the bearer token.
            if self.api_key and request.url.path.startswith("/v1"):
                if request.headers.get("authorization") != f"Bearer {self.api_key}":
                    return JSONResponse(error_body("Unauthorized: a valid 'Authorization: Bearer' "
                                                   "API key is required", None,
                                                   "AuthenticationError", 401), 401)
            return await call_next(request)

        @app.get("/health")
        async def health():
            return Response(status_code=200 if self.engine.healthy else 503)

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{
                "id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "jaxsched", "root": self.model_name,
                "max_model_len": self.llm.config.max_model_len}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            req = await _read_json(request, CompletionRequest, self.max_body_bytes)
            self._check_request(req)
            prompts = _prompt_list(req.prompt)
            # Every prompt is checked before any is queued: one bad prompt fails the call alone.
            batch = []
            for k, prompt in enumerate(prompts):
                field = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
                ids = self._tokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)
                ids = truncate_prompt(ids, req.truncate_prompt_tokens)
                batch.append((ids, self._params(req, ids, field, req.max_tokens or 16, req.logprobs)))
            echo = [self._echo(prompt) for prompt in prompts] if req.echo else None
            return await self._serve(request, req, batch, chat=False, echo=echo)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            req = await _read_json(request, ChatCompletionRequest, self.max_body_bytes)
            self._check_request(req)
            ids = truncate_prompt(self._chat_ids(req.messages, req.add_generation_prompt),
                                  req.truncate_prompt_tokens)
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            max_tokens = (req.max_completion_tokens or req.max_tokens
                          or max(self.llm.config.max_model_len - len(ids), 1))
            params = self._params(req, ids, "messages", max_tokens, logprobs)
            return await self._serve(request, req, [(ids, params)], chat=True)

        @app.post("/tokenize")
        async def tokenize(request: Request):
            req = await _read_json(request, TokenizeRequest, self.max_body_bytes)
            self._check_model(req.model)
            if (req.prompt is None) == (req.messages is None):
                raise ApiError("prompt: send a prompt or messages, one of them", "prompt")
            if req.messages is not None:
                ids = self._chat_ids(req.messages, req.add_generation_prompt)
            else:
                ids = self._tokenizer().encode(req.prompt, add_special_tokens=req.add_special_tokens)
            return {"tokens": ids, "count": len(ids), "max_model_len": self.llm.config.max_model_len}

        @app.post("/detokenize")
        async def detokenize(request: Request):
            req = await _read_json(request, DetokenizeRequest, self.max_body_bytes)
            self._check_model(req.model)
            vocab = self.llm.model_config.vocab_size
            if any(t < 0 or t >= vocab for t in req.tokens):
                raise ApiError(f"tokens: token ids must be in [0, vocab_size={vocab})", "tokens")
            return {"prompt": self._tokenizer().decode(req.tokens)}

        @app.get("/version")
        async def version():
            return {"version": _version()}

        return app

    # ------------------------------------------------------------ checks
    def _tokenizer(self):
        if self.llm.tokenizer is None:
            raise ApiError("prompt: this model has no tokenizer; send token ids", "prompt")
        return self.llm.tokenizer

    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(f"model: the model `{model}` does not exist; this server serves "
                           f"`{self.model_name}`", "model", kind="NotFoundError")

    def _check_request(self, req) -> None:
        """What a request asks for that no engine limit decides: the model, the fields jaxsched
        does not implement, and best_of's stream."""
        self._check_model(req.model)
        if message := req.unsupported():
            raise ApiError(message, _field_of(message))
        if req.stream and req.best_of is not None and req.best_of != req.n:
            # vLLM answers such a request unstreamed, which a streaming client cannot read.
            raise ApiError(f"best_of: {req.best_of} != n={req.n} cannot be streamed (the best n "
                           f"are known at the end), as in OpenAI's API", "best_of")

    def _chat_ids(self, messages, add_generation_prompt: bool) -> list[int]:
        """Messages rendered with the model's chat template, as token ids."""
        tok = self._tokenizer()
        if not tok.chat_template:
            raise ApiError("messages: the model has no chat template", "messages")
        try:
            rendered = [{**m.model_dump(), "content": content_text(m.content, f"messages[{k}].content")}
                        for k, m in enumerate(messages)]
        except ValueError as e:
            raise ApiError(str(e), "messages") from None
        try:
            text = tok.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as e:           # the template's raise_exception: the client's to fix
            raise ApiError(f"messages: the chat template refused them: {e}", "messages") from None
        return tok.encode(text, add_special_tokens=False)

    def _echo(self, prompt) -> str:
        """A prompt's text, for echo (token ids decoded)."""
        return prompt if isinstance(prompt, str) else self._tokenizer().decode(prompt)

    def _params(self, req, ids: list[int], field: str, max_tokens: int, logprobs):
        """SamplingParams for a request, with the engine's limits (vLLM's messages)."""
        cfg = self.llm.config
        if not ids:
            raise ApiError(f"{field}: must have at least one token", field)
        vocab = self.llm.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ApiError(f"{field}: token ids must be in [0, vocab_size={vocab})", field)
        if len(ids) > cfg.max_model_len:
            raise ApiError(f"{field}: {len(ids)} tokens, more than this model's maximum context "
                           f"length max_model_len={cfg.max_model_len}", field)
        if max_tokens > cfg.max_model_len:
            raise ApiError(f"max_tokens: {max_tokens} exceeds max_model_len={cfg.max_model_len}",
                           "max_tokens")
        if len(ids) + max_tokens > cfg.max_model_len:
            raise ApiError(f"max_tokens: this model's maximum context length is {cfg.max_model_len} "
                           f"tokens; you requested {len(ids) + max_tokens} ({len(ids)} in the {field}, "
                           f"{max_tokens} in the completion)", "max_tokens")
        if req.n > cfg.max_num_seqs:
            raise ApiError(f"n: {req.n} exceeds max_num_seqs={cfg.max_num_seqs}", "n")
        try:
            params = req.sampling_params(max_tokens, logprobs)
            params.validate(cfg.max_num_seqs, cfg.max_seqs_per_group, vocab_size=vocab)
        except (ValueError, TypeError) as e:
            raise ApiError(str(e), _field_of(str(e))) from None
        return params

    # ------------------------------------------------------------ serving
    async def _serve(self, request: Request, req, batch, chat: bool, echo: Optional[list[str]] = None):
        """Queue every (ids, params) of `batch` as its own engine request and answer them as one
        response: prompt k's samples are choices k*n .. k*n+n-1, as in vLLM; with `echo`,
        each choice's text starts with its prompt's."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        rids = [rid] if len(batch) == 1 else [f"{rid}-{k}" for k in range(len(batch))]
        queues = []
        try:
            for sub, (ids, params) in zip(rids, batch):
                queues.append(await self.engine.add(sub, ids, params))
        except (QueueFull, ValueError) as e:
            for sub in rids[:len(queues)]:          # all or nothing
                self.engine.abort(sub)
            if isinstance(e, QueueFull):
                raise ApiError(str(e), None, 503, "ServiceUnavailableError") from None
            raise ApiError(str(e), _field_of(str(e))) from None
        shapes = [_Shape(self, rid, chat, len(ids), params, req, offset=k * params.n,
                         echo=echo[k] if echo else "")
                  for k, (ids, params) in enumerate(batch)]
        outputs = _Merged(queues)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(rids, outputs, shapes, usage),
                                     media_type="text/event-stream")
        last: dict[int, object] = {}
        try:
            while len(last) < len(batch):
                try:
                    k, out = await asyncio.wait_for(outputs.get(), 1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        for sub in rids:
                            self.engine.abort(sub)
                        return Response(status_code=499)
                    continue
                if isinstance(out, BaseException):
                    raise ApiError(f"the engine failed: {out}", None, 500, "InternalServerError")
                if out.finished:
                    last[k] = out
        finally:
            outputs.close()
        return _full(shapes, [last[k] for k in range(len(batch))])

    async def _stream(self, rids, outputs, shapes: list["_Shape"], usage: bool):
        finished = [False] * len(shapes)
        last = [None] * len(shapes)
        try:
            if shapes[0].chat:
                yield _sse(shapes[0].chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}
                                            for i in range(shapes[0].params.n)]))
            while not all(finished):
                k, out = await outputs.get()
                if isinstance(out, BaseException):
                    yield _sse(error_body(f"the engine failed: {out}", None, "InternalServerError", 500))
                    break
                finished[k], last[k] = out.finished, out
                choices = shapes[k].deltas(out)
                if choices:
                    yield _sse(shapes[0].chunk(choices))
            if usage and all(finished):
                yield _sse(shapes[0].chunk([], usage=_usage(shapes, last)))
            yield "data: [DONE]\n\n"
        finally:
            outputs.close()
            # The client went away mid-stream (the task is cancelled here): stop its requests now.
            for sub, done in zip(rids, finished):
                if not done:
                    self.engine.abort(sub)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("jaxsched")
    except PackageNotFoundError:
        return "unknown"


def _prompt_list(prompt) -> list:
    """OpenAI's prompt forms as a list of prompts: a string, a list of strings, a list of
    token ids, or a list of token-id lists."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


class _Merged:
    """The outputs of several requests' queues as (k, output) on one queue, in arrival order;
    a forwarder per queue ends after its request's last output. `get` may be cancelled
    (a timeout) without losing anything."""

    def __init__(self, queues: list[asyncio.Queue]):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.ensure_future(self._forward(k, q)) for k, q in enumerate(queues)]

    async def _forward(self, k: int, source: asyncio.Queue) -> None:
        while True:
            out = await source.get()
            self.queue.put_nowait((k, out))
            if isinstance(out, BaseException) or out.finished:
                return

    async def get(self):
        return await self.queue.get()

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()


def _usage(shapes: list["_Shape"], outs) -> dict:
    prompt = sum(s.prompt_len for s in shapes)
    completion = sum(len(c.token_ids) for out in outs for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _full(shapes: list["_Shape"], outs) -> dict:
    first = shapes[0]
    return {"id": first.rid, "object": "chat.completion" if first.chat else "text_completion",
            "created": first.created, "model": first.server.model_name,
            "choices": [c for shape, out in zip(shapes, outs) for c in shape.choices(out)],
            "usage": _usage(shapes, outs)}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Shape:
    """One request's responses in OpenAI's formats, whole or as stream chunks."""

    def __init__(self, server: OpenAIServer, rid: str, chat: bool, prompt_len: int, params, req,
                 offset: int = 0, echo: str = ""):
        self.server, self.rid, self.chat, self.prompt_len, self.params = server, rid, chat, prompt_len, params
        self.offset = offset                     # this prompt's first choice index
        self.echo = echo                         # the prompt's text, when echoed
        self.created = int(time.time())
        self.tok = server.llm.tokenizer
        # A stop string may arrive over several tokens: hold back that many characters of
        # text until the sequence finishes, so no part of a stop string is ever streamed.
        self.hold = max((len(s) for s in req.stop_strings()), default=1) - 1
        self.sent_text = [""] * params.n
        self.sent_tokens = [0] * params.n
        self.done = [False] * params.n

    def chunk(self, choices, usage=None) -> dict:
        body = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.server.model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def _token(self, t: int) -> str:
        return self.tok.decode([t]) if self.tok else str(t)

    def _logprobs(self, c, start: int, text_start: int = 0):
        """OpenAI's logprobs of c's tokens from `start` (completions: text offsets from
        `text_start`), from vLLM's per-token {token id: Logprob} dicts."""
        if self.params.logprobs is None or c.logprobs is None:
            return None
        ids, dicts = c.token_ids[start:], c.logprobs[start:]
        text = [self._token(t) for t in ids]
        lps = [d[t].logprob for t, d in zip(ids, dicts)]
        # The k most likely tokens are the ranked entries (the sampled one may be unranked).
        tops = [[(self._token(t), lp.logprob) for t, lp in sorted(d.items(), key=lambda e: e[1].rank or 0)
                 if lp.rank is not None] for d in dicts]
        if self.chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()),
                                 "top_logprobs": [{"token": ts, "logprob": tl, "bytes": list(ts.encode())}
                                                  for ts, tl in top]}
                                for s, lp, top in zip(text, lps, tops)]}
        offsets = list(itertools.accumulate((len(s) for s in text[:-1]), initial=text_start)) if text else []
        return {"tokens": text, "token_logprobs": lps,
                "top_logprobs": [dict(top) or None for top in tops], "text_offset": offsets}

    def _text(self, c) -> str:
        return c.text if self.tok else " ".join(map(str, c.token_ids))

    def deltas(self, out) -> list[dict]:
        choices = []
        for c in out.outputs:
            i = c.index                          # best_of == n when streamed: c is sequence i
            if self.done[i]:
                continue
            text = self._text(c)
            finished = c.finish_reason is not None or out.finished
            visible = text if finished or not self.hold else text[:max(len(text) - self.hold, len(self.sent_text[i]))]
            delta = visible[len(self.sent_text[i]):]
            lp = self._logprobs(c, self.sent_tokens[i], len(self.echo) + len(self.sent_text[i]))
            if not delta and not finished and len(c.token_ids) == self.sent_tokens[i]:
                continue
            first = not self.sent_tokens[i] and not self.sent_text[i]
            self.sent_text[i], self.sent_tokens[i] = visible, len(c.token_ids)
            reason = (c.finish_reason or "abort") if finished else None
            self.done[i] = finished
            extra = {"stop_reason": c.stop_reason} if finished else {}
            if self.chat:
                choices.append({"index": self.offset + i, "delta": {"content": delta} if delta or not finished else {},
                                "logprobs": lp, "finish_reason": reason, **extra})
            else:
                echo = self.echo if first else ""
                choices.append({"index": self.offset + i, "text": echo + delta, "logprobs": lp,
                                "finish_reason": reason, **extra})
        return choices

    def choices(self, out) -> list[dict]:
        """The finished `out` as whole choices, numbered in order (with best_of > n, `out`
        has the best n sequences, best first)."""
        choices = []
        for position, c in enumerate(out.outputs):
            index = self.offset + position
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": self._text(c)},
                                "logprobs": self._logprobs(c, 0), "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
            else:
                choices.append({"index": index, "text": self.echo + self._text(c),
                                "logprobs": self._logprobs(c, 0, len(self.echo)),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return choices


# ---------------------------------------------------------------- CLI
def wait_until_healthy(base_url: str, proc, timeout_s: float) -> bool:
    """Poll `base_url`/health until it answers 200 (True), or `proc` (the server's Popen)
    exits or `timeout_s` passes (False): for scripts and tests that start a server."""
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return False


def run_server(args: argparse.Namespace) -> int:
    from jaxsched.entrypoints.cli import check_engine_kwargs, engine_kwargs
    from jaxsched.entrypoints.compilation_cache import enable_compilation_cache

    try:
        engine = engine_kwargs(args)
        check_engine_kwargs(engine)                  # bad flags fail before the model loads
        if args.max_waiting_requests < 1:
            raise ValueError(f"--max-waiting-requests: must be >= 1, got {args.max_waiting_requests}")
        if not 0 < args.port < 65536:
            raise ValueError(f"--port: must be in 1..65535, got {args.port}")
    except (ValueError, TypeError) as e:
        print(f"jaxsched serve: {e}", file=sys.stderr)
        return 2
    import uvicorn
    from jaxsched.entrypoints.llm import LLM

    enable_compilation_cache(args.compilation_cache_dir)
    t0 = time.perf_counter()
    try:
        llm = LLM(args.model, seed=args.seed, dtype=args.dtype, **engine)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"jaxsched serve: {e}", file=sys.stderr)
        return 2
    if not args.no_warm_up:
        llm.warm_up()
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    api_key = args.api_key or os.environ.get("JAXSCHED_API_KEY") or None
    engine_loop = AsyncEngine(llm, Metrics(name, llm.config.max_model_len), args.max_waiting_requests)
    server = OpenAIServer(engine_loop, name, api_key, args.max_request_bytes)
    logging.basicConfig(level=args.log_level.upper())
    print(f"jaxsched serve: {name} ready in {time.perf_counter() - t0:.1f} s on "
          f"http://{args.host}:{args.port}", flush=True)
    # uvicorn handles SIGINT/SIGTERM: it stops accepting, lets open requests finish for a
    # few seconds, cancels the rest (their requests are aborted), then stops the engine loop.
    # Afterwards it raises the signal again under the handlers it found; ours only note it, so
    # a shutdown asked for is a clean exit (status 0), not a death by signal.
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _frame: received.append(s))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(server.app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        print(f"jaxsched serve: stopped by {signal.Signals(received[0]).name}", flush=True)
    return 0
