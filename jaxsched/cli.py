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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxsched", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="replay a trace through the jitted scheduler (no model)")
    sim.add_argument("trace", nargs="?", help=f"trace JSON (default: the bundled {DEFAULT_TRACE})")
    sim.add_argument("-o", "--output", help="write the step-by-step decisions as JSON here")
    sim.set_defaults(func=cmd_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
