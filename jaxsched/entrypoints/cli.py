"""jaxsched: vLLM's V0 scheduler and paged KV cache as pure JAX functions, with a model.

Subcommands: `generate` runs SmolLM2-135M (or your model) on the paged engine, `serve` puts
it behind an OpenAI-compatible HTTP API, `simulate` replays a trace through the scheduler
alone with vLLM 0.5.3's decisions, `trace generate` makes workloads and `sweep` replays one
under a grid of limits in one compiled call. `jaxsched SUBCOMMAND --help` for the flags.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from importlib import resources
from pathlib import Path

from jaxsched.entrypoints.xla_flags import SWEEP_GPU_FLAGS, use_xla_flags

DEFAULT_TRACE = "swap-pressure.json"
use_xla_flags()


def _bundled_trace(name: str) -> Path:
    return Path(str(resources.files("jaxsched.sim") / "traces" / name))


def _table(rows: list[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|------:|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def cmd_simulate(args) -> int:
    from jaxsched.entrypoints.compilation_cache import enable_compilation_cache
    from jaxsched.sim.simulate import simulate, summarize
    from jaxsched.sim.trace import TraceError, load_trace, parse_trace

    path = Path(args.trace) if args.trace else _bundled_trace(DEFAULT_TRACE)
    try:
        data = load_trace(path)
        trace = parse_trace(data)                 # every field checked before the replay starts
    except TraceError as e:
        print(f"jaxsched simulate: {e}", file=sys.stderr)
        return 2
    enable_compilation_cache(args.compilation_cache_dir)
    try:
        # A trace with enable_prefix_caching replays on the jitted cached pools (SPEC A10).
        result = simulate(trace.scheduler_config, data["requests"], step_time=trace.step_time,
                          max_steps=trace.max_steps)
    except TraceError as e:
        print(f"jaxsched simulate: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"jaxsched simulate: {e}", file=sys.stderr)
        return 1
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    summary = summarize(result, trace.scheduler_config)
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
# Engine flags: SchedulerConfig fields a user sets, with their help text.
ENGINE_FLAGS = {
    "num_device_blocks": (int, "KV blocks on the device (vLLM's num_gpu_blocks)"),
    "num_host_blocks": (int, "KV blocks of swap space in host memory (num_cpu_blocks)"),
    "block_size": (int, "tokens per KV block"),
    "max_num_seqs": (int, "most sequences running in one step"),
    "max_num_batched_tokens": (int, "most tokens in one step"),
    "max_model_len": (int, "longest sequence, prompt and output (at most the model's context)"),
    "max_seqs_per_group": (int, "largest n a request may ask for (a compiled shape)"),
    "preemption_mode": (str, "default (vLLM's: recompute one sequence, swap more), recompute, "
                             "swap, or auto (the cheaper per victim, by cost)"),
    "preemption_costs": (str, "cost model of auto: a JSON file, or 'measure' at start-up"),
    "delay_factor": (float, "wait this share of the last prompt's latency before the next "
                            "prefill (vLLM's delay_factor)"),
    "watermark": (float, "share of device blocks kept free at admission"),
    "num_slots": (int, "request slots alive at once (a compiled shape)"),
    "num_device_blocks_capacity": (int, "device KV pool size compiled in (default: "
                                        "--num-device-blocks); engines with equal capacities "
                                        "and other block counts share compiled steps"),
    "num_host_blocks_capacity": (int, "host KV pool size compiled in (default: --num-host-blocks)"),
}


SIZED_FLAGS = ("num_device_blocks", "num_host_blocks")
SIZING_FLAGS = ("gpu_memory_utilization", "swap_space")


def add_engine_args(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """The model and engine flags shared by `generate` and `serve`."""
    defaults = dict(defaults or {})
    a = parser.add_argument
    # Block counts from `defaults` apply only when neither sizing flag is given: then a flag
    # sizes the caches the user did not count (engine_kwargs).
    counted = {k: defaults.pop(k) for k in SIZED_FLAGS if k in defaults}
    for name in SIZED_FLAGS:
        if name in counted:
            parser.set_defaults(**{f"_default_{name}": counted[name]})
    a("--model", default=None, help="smollm2-135m (the embedded default), a .gguf file, an HF directory, "
      "or a Hugging Face Hub id (org/name: the local HF cache, else a download)")
    a("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights' dtype")
    a("--chat-template", default=None, help="a Jinja chat template, or its file, to use instead "
      "of the tokenizer's (as vLLM's)")
    for name, (kind, text) in ENGINE_FLAGS.items():
        if name in counted:
            text += f"; without --gpu-memory-utilization / --swap-space: {counted[name]}"
        a("--" + name.replace("_", "-"), type=kind, default=defaults.get(name), help=text)
    a("--enable-chunked-prefill", action="store_true", help="split long prompts over steps (SPEC A6)")
    a("--enable-prefix-caching", action="store_true",
      help="share the KV blocks of common prompt prefixes and skip their prefill (SPEC A10)")
    a("--tensor-parallel-size", type=int, default=None,
      help="shard the model and KV cache over N devices (jax.sharding)")
    a("--data-parallel-size", type=int, default=None,
      help="independent engine replicas on disjoint device slices")
    a("--seed", type=int, default=0, help="engine seed (and the first prompt's seed)")
    a("--gpu-memory-utilization", type=float, default=None,
      help="size the device KV cache from memory: this share of the device's memory, less the "
           "weights and the largest step's working memory (vLLM's; None means 0.9 when sizing)")
    a("--swap-space", type=float, default=None,
      help="size the host KV cache (swap) from this many GiB per device (vLLM's; None means 4 "
           "when sizing)")
    add_cache_arg(parser)


def add_cache_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compilation-cache-dir", default=None,
                        help="JAX's persistent compilation cache ('off' disables; default: "
                             "$JAXSCHED_COMPILATION_CACHE_DIR, else ~/.cache/jaxsched/xla)")


def engine_kwargs(args) -> dict:
    """`LLM(...)` keyword arguments from the flags of `add_engine_args`."""
    engine = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    sizing = {k: getattr(args, k) for k in SIZING_FLAGS if getattr(args, k, None) is not None}
    if sizing:
        engine.update(sizing)
    else:
        for name in SIZED_FLAGS:
            default = getattr(args, f"_default_{name}", None)
            if name not in engine and default is not None:
                engine[name] = default
    if args.enable_chunked_prefill:
        engine["enable_chunked_prefill"] = True
    if args.enable_prefix_caching:
        engine["enable_prefix_caching"] = True
    if args.chat_template is not None:
        engine["chat_template"] = args.chat_template
    if args.tensor_parallel_size or args.data_parallel_size:
        engine["mesh_shape"] = (args.data_parallel_size or 1, args.tensor_parallel_size or 1)
    for flag in ("tensor_parallel_size", "data_parallel_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1, got {value}")
    return engine


def check_engine_kwargs(engine: dict):
    """The SchedulerConfig these flags make, checked before any model loads (ValueError)."""
    from jaxsched.entrypoints.llm import _check_engine_args
    from jaxsched.engine.sizing import check_args
    check_args(engine.get("gpu_memory_utilization", 0.9), engine.get("swap_space", 4))
    if "chat_template" in engine:
        from models.chat import load_chat_template
        load_chat_template(engine["chat_template"], "--chat-template")
    return _check_engine_args({k: v for k, v in engine.items()
                               if k not in ("mesh_shape", "chat_template") and k not in SIZING_FLAGS})


def _say(text: str) -> None:
    print(text, flush=True)


def cmd_generate(args) -> int:
    from jaxsched.entrypoints.compilation_cache import enable_compilation_cache
    from jaxsched.engine.params import SamplingParams

    t0 = time.perf_counter()
    prompts = args.prompt or DEFAULT_PROMPTS
    try:
        engine = engine_kwargs(args)
        config = check_engine_kwargs(engine)
        params = []
        for i, text in enumerate(prompts):
            n = args.n if args.n is not None else (2 if not args.prompt and i == 1 else 1)
            sp = SamplingParams(n=n, max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed + i)
            sp.validate(config.max_num_seqs, config.max_seqs_per_group)
            params.append(sp)
        if args.token_ids:
            inputs = [[int(t) for t in text.replace(",", " ").split()] for text in prompts]
    except (ValueError, TypeError) as e:
        print(f"jaxsched generate: {e}", file=sys.stderr)
        return 2
    cache = enable_compilation_cache(args.compilation_cache_dir)
    from jaxsched.entrypoints.llm import LLM
    try:
        llm = LLM(args.model, seed=args.seed, dtype=args.dtype, **engine)
        loaded = time.perf_counter() - t0
        if not args.token_ids:
            inputs = []
            for text in prompts:
                if llm.tokenizer is not None and llm.tokenizer.chat_template and not args.raw:
                    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
                    inputs.append(llm.tokenizer.encode(rendered, add_special_tokens=False))
                else:
                    inputs.append(text)
        _say(f"model loaded in {loaded:.1f} s; compilation cache: {cache or 'off'}")
        outputs, first = _stream(llm, prompts, inputs, params, t0, quiet=args.quiet)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"jaxsched generate: {e}", file=sys.stderr)
        return 2
    total = time.perf_counter() - t0
    for text, out in zip(prompts, outputs):
        _say(f"\n>>> {text}")
        for c in out.outputs:
            body = c.text if llm.tokenizer is not None else " ".join(map(str, c.token_ids))
            tag = f"[{c.index}] " if len(out.outputs) > 1 else ""
            _say(f"{tag}{body.strip()}  ({len(c.token_ids)} tokens, {c.finish_reason})")
        if out.message:
            _say(f"(ignored: {out.message})")
    stats = llm.stats()
    timing = {"load_s": round(loaded, 2), "first_token_s": round(first, 2) if first else None,
              "total_s": round(total, 2), "compile_s": stats["compile_seconds"],
              "generate_s": round(total - loaded, 2)}
    _say(f"\nload {timing['load_s']} s, first token at {timing['first_token_s']} s, "
         f"compile {timing['compile_s']} s, generation {timing['generate_s']} s, total {timing['total_s']} s")
    _say(_table(list(stats.items())))
    if args.timing_json:
        Path(args.timing_json).write_text(json.dumps(timing))
    return 0


def _stream(llm, prompts, inputs, params, t0, quiet=False):
    """generate_stream, printing each sequence's new text as it arrives, a line at a time.

    Returns (the outputs in prompt order, seconds from start to the first token)."""
    first, shown, pending, outs = None, {}, {}, {}
    for out in llm.generate_stream(inputs, params):
        outs[out.request_id] = out
        for c in out.outputs:
            if first is None and c.token_ids:
                first = time.perf_counter() - t0
            key = (out.request_id, c.index)
            text = c.text if llm.tokenizer is not None else " ".join(map(str, c.token_ids))
            new = text[len(shown.get(key, "")):]
            shown[key] = text
            pending[key] = pending.get(key, "") + new
            done = c.finish_reason is not None
            if not quiet and pending[key] and ("\n" in pending[key] or len(pending[key]) >= 48 or done):
                k = out.request_id.rsplit("-", 1)[-1]
                tag = f"[{k}.{c.index}]" if len(out.outputs) > 1 else f"[{k}]"
                for line in pending[key].splitlines() or [""]:
                    if line.strip():
                        _say(f"{tag} {line}")
                pending[key] = ""
    order = sorted(outs, key=lambda rid: int(rid.rsplit("-", 1)[-1]))
    return [outs[rid] for rid in order], first


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxsched", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    sim = sub.add_parser("simulate", help="replay a trace through the jitted scheduler (no model)",
                         description="Replay a trace through the jitted scheduler, step by step, "
                                     "with vLLM 0.5.3's decisions; prints a summary table.")
    sim.add_argument("trace", nargs="?", help=f"trace JSON (default: the bundled {DEFAULT_TRACE})")
    sim.add_argument("-o", "--output", help="write the step-by-step decisions as JSON here")
    add_cache_arg(sim)
    sim.set_defaults(func=cmd_simulate)
    from jaxsched.entrypoints.cli_sweep import register
    register(sub)                                    # `trace generate` and `sweep`

    gen = sub.add_parser("generate", help="generate with a model on the paged engine "
                         "(default: SmolLM2-135M-Instruct, built-in prompts, a small KV cache)",
                         description="Generate completions on the paged engine. With no flags: "
                         "SmolLM2-135M-Instruct, six built-in chat prompts, a KV cache of 16 "
                         "blocks (small enough that the scheduler preempts), tokens streamed "
                         "as they are generated, then the engine's stats.")
    g = gen.add_argument
    g("--prompt", action="append", help="a prompt (repeatable; default: six built-in prompts)")
    g("--token-ids", action="store_true", help="prompts are token ids: '1 2 3'")
    g("--raw", action="store_true", help="do not apply the chat template")
    g("--max-tokens", type=int, default=64, help="tokens to generate per sequence")
    g("--temperature", type=float, default=0.7, help="0 is greedy")
    g("--top-p", type=float, default=0.9, help="nucleus sampling mass")
    g("--top-k", type=int, default=-1, help="sample from the k most likely tokens (-1: off)")
    g("--n", type=int, default=None, help="sequences per prompt (default: 1, 2 for the second built-in prompt)")
    g("--quiet", action="store_true", help="do not stream tokens as they arrive")
    g("--timing-json", metavar="PATH", default=None,
      help="write load, first-token, compile and total seconds here")
    add_engine_args(gen, DEFAULT_ENGINE)
    gen.set_defaults(func=cmd_generate)
    from jaxsched.entrypoints.cli_serve import register as register_serve
    register_serve(sub)                              # `serve`
    _show_defaults(parser)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every subcommand's --help shows each flag's default."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.formatter_class = argparse.ArgumentDefaultsHelpFormatter
                _show_defaults(child)


def _log_to_stderr() -> None:
    """jaxsched's own INFO lines (the cache sizing, as vLLM logs it) go to stderr."""
    logger = logging.getLogger("jaxsched")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "sweep":         # before the backend starts (a sweep's first computation)
        use_xla_flags(*SWEEP_GPU_FLAGS)
    _log_to_stderr()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
