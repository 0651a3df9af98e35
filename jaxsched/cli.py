"""The `jaxsched` console script."""
from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources
from pathlib import Path

DEFAULT_TRACE = "swap-pressure.json"
# Read when the backend starts (first computation), so setting it here still takes effect.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_enable_concurrency_optimized_scheduler=false")


def _bundled_trace(name: str) -> Path:
    return Path(str(resources.files("jaxsched") / "traces" / name))


def _table(rows: list[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|------:|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def cmd_simulate(args) -> int:
    from jaxsched.simulate import simulate, summarize
    from jaxsched.trace import TraceError, load_trace

    path = Path(args.trace) if args.trace else _bundled_trace(DEFAULT_TRACE)
    try:
        data = load_trace(path)
        if not isinstance(data, dict) or not isinstance(data.get("config", {}), dict):
            raise TraceError(f"{path}: must be a JSON object with 'config' and 'requests'")
        result = simulate(data.get("config", {}), data.get("requests"))
    except TraceError as e:
        print(f"jaxsched simulate: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"jaxsched simulate: {e}", file=sys.stderr)
        return 1
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    summary = summarize(result, data["config"])
    print(f"replayed {path.name}: {summary['requests']} requests")
    print(_table(list(summary.items())))
    if args.output:
        print(f"wrote {args.output}")
    return 0


DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook.",
    "Explain what a KV cache is in two sentences.",
    "Name three planets and one fact about each.",
    "Why is the sky blue?",
]
# The main job's engine: a KV cache of 16 blocks of 16 tokens is far too small for six chats
# at once, so the scheduler preempts (recompute for one sequence, swap for the n=2 request).
DEFAULT_ENGINE = dict(num_device_blocks=16, num_host_blocks=64, block_size=16, max_num_seqs=8,
                      max_num_batched_tokens=128, max_model_len=512, num_slots=8)
ENGINE_FLAGS = ("num_device_blocks", "num_host_blocks", "block_size", "max_num_seqs",
                "max_num_batched_tokens", "max_model_len", "preemption_mode", "preemption_costs",
                "delay_factor", "watermark", "num_slots")


def cmd_generate(args) -> int:
    from jaxsched.llm import LLM
    from jaxsched.params import SamplingParams

    engine = dict(DEFAULT_ENGINE)
    for name in ENGINE_FLAGS:
        value = getattr(args, name)
        if value is not None:
            engine[name] = value
    if args.enable_chunked_prefill:
        engine["enable_chunked_prefill"] = True
    try:
        mesh = None
        if args.tensor_parallel_size or args.data_parallel_size:
            mesh = (args.data_parallel_size or 1, args.tensor_parallel_size or 1)
        llm = LLM(args.model, seed=args.seed, dtype=args.dtype, mesh_shape=mesh, **engine)
        prompts = args.prompt or DEFAULT_PROMPTS
        params = []
        for i, text in enumerate(prompts):
            n = args.n if args.n is not None else (2 if not args.prompt and i == 1 else 1)
            params.append(SamplingParams(n=n, max_tokens=args.max_tokens, temperature=args.temperature,
                                         top_p=args.top_p, top_k=args.top_k, seed=args.seed + i))
        inputs = []
        for text in prompts:
            if args.token_ids:
                inputs.append([int(t) for t in text.replace(",", " ").split()])
            elif llm.tokenizer is not None and llm.tokenizer.chat_template and not args.raw:
                rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
                inputs.append(llm.tokenizer.encode(rendered, add_special_tokens=False))
            else:
                inputs.append(text)
        outputs = llm.generate(inputs, params, use_tqdm=not args.quiet)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"jaxsched generate: {e}", file=sys.stderr)
        return 2
    for text, out in zip(prompts, outputs):
        print(f"\n>>> {text}")
        for c in out.outputs:
            body = c.text if c.text is not None else " ".join(map(str, c.token_ids))
            tag = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{tag}{body.strip()}  ({len(c.token_ids)} tokens, {c.finish_reason})")
        if out.message:
            print(f"(ignored: {out.message})")
    print()
    print(_table(list(llm.stats().items())))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxsched", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="replay a trace through the jitted scheduler (no model)")
    sim.add_argument("trace", nargs="?", help=f"trace JSON (default: the bundled {DEFAULT_TRACE})")
    sim.add_argument("-o", "--output", help="write the step-by-step decisions as JSON here")
    sim.set_defaults(func=cmd_simulate)
    from jaxsched.cli_sweep import register
    register(sub)                                    # `trace generate` and `sweep`

    gen = sub.add_parser("generate", help="generate with a model on the paged engine "
                         "(default: SmolLM2-135M-Instruct, built-in prompts, a small KV cache)")
    gen.add_argument("--model", default=None, help="smollm2-135m (default), a .gguf file or an HF directory")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--token-ids", action="store_true", help="prompts are token ids: '1 2 3'")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--top-p", type=float, default=0.9)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--n", type=int, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--enable-chunked-prefill", action="store_true")
    gen.add_argument("--tensor-parallel-size", type=int, default=None,
                     help="shard the model and KV cache over N devices (jax.sharding)")
    gen.add_argument("--data-parallel-size", type=int, default=None,
                     help="independent engine replicas on disjoint device slices")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    for name in ENGINE_FLAGS:
        kind = str if name.startswith("preemption") else float if name in ("delay_factor", "watermark") else int
        gen.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                         help={"preemption_mode": "recompute, swap or auto (by cost)",
                               "preemption_costs": "cost model of auto: a JSON file, or 'measure'"}.get(name))
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
