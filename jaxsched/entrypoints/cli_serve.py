"""`jaxsched serve`'s flags, apart from the server: building the CLI's parser imports no
web framework (FastAPI and its dependencies took about 1.3 s of every `jaxsched` command)."""
from __future__ import annotations

import argparse

DEFAULT_MODEL_NAME = "smollm2-135m"
# A serving engine's defaults: room for 16 running sequences and a 1024-token context.
SERVE_ENGINE = dict(num_device_blocks=512, num_host_blocks=512, block_size=16, max_num_seqs=16,
                    max_num_batched_tokens=256, max_model_len=1024)
MAX_BODY_BYTES = 1 << 20


def register(subparsers) -> None:
    """`jaxsched serve`: the engine flags of `jaxsched generate`, plus the server's own."""
    from jaxsched.entrypoints.cli import add_engine_args
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description="An OpenAI-compatible server (as `vllm serve`): "
                              "/v1/completions, /v1/chat/completions, /v1/models, /health, "
                              "/metrics, /tokenize, /detokenize, /version. With no model: the "
                              "embedded SmolLM2-135M-Instruct.")
    a = p.add_argument
    a("model_tag", nargs="?", default=None, metavar="MODEL",
      help="the model, as `vllm serve MODEL`: the same as --model")
    a("--host", default="127.0.0.1", help="address to listen on")
    a("--port", type=int, default=8000, help="port to listen on")
    a("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes "
      "(default: $JAXSCHED_API_KEY)")
    a("--served-model-name", default=None, help="the model name clients send (default: --model, "
      f"else {DEFAULT_MODEL_NAME})")
    a("--max-waiting-requests", type=int, default=256,
      help="answer 503 once this many requests wait for the engine")
    a("--max-request-bytes", type=int, default=MAX_BODY_BYTES, help="largest request body accepted")
    a("--no-warm-up", action="store_true", help="skip compiling every token bucket before serving")
    a("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
      help="uvicorn's log level")
    add_engine_args(p, SERVE_ENGINE)
    p.set_defaults(func=_run_server)


def _run_server(args: argparse.Namespace) -> int:
    import sys
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            print(f"jaxsched serve: the model is given twice: {args.model_tag!r} and --model "
                  f"{args.model!r}", file=sys.stderr)
            return 2
        args.model = args.model_tag
    from jaxsched.entrypoints.openai_server import run_server
    return run_server(args)
