"""Start-up cost of the main job: `jaxsched generate` from process start to its first token and
to the end, with an empty compilation cache (cold) and again with the cache it filled (warm).

    python benchmarks/startup.py [--json] [--runs N] [--quick] [-- extra generate flags]

Each run is a fresh `python -m jaxsched.entrypoints.cli generate --quiet --timing-json ...` subprocess
with the default model (SmolLM2-135M) and the built-in prompts. Cold runs get a new empty
directory as `JAXSCHED_COMPILATION_CACHE_DIR`; the warm run after each reuses it. Reported
per run: load_s (weights read and placed), first_token_s and total_s (from process start, as
the CLI measures them), compile_s (the engine's own count of compile seconds), wall_s (the
subprocess from the outside, interpreter start-up included) and peak_rss_mb (the child's peak
resident memory, `ru_maxrss`). With --runs N, the table shows the median of N cold/warm pairs.
Results go to benchmarks/results/startup.{json,md}; --json prints the JSON to stdout;
--quick runs one pair with 8 tokens and saves nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(pathlib.Path(__file__).parent))

from _common import save_results  # noqa: E402

FIELDS = ("load_s", "first_token_s", "total_s", "compile_s", "wall_s", "peak_rss_mb")


def run_once(cache_dir: str, extra: list[str]) -> dict:
    """One `jaxsched generate` subprocess; its timing JSON plus wall time and peak memory."""
    with tempfile.TemporaryDirectory() as tmp:
        timing = pathlib.Path(tmp) / "timing.json"
        env = {**os.environ, "JAXSCHED_COMPILATION_CACHE_DIR": cache_dir}
        cmd = [sys.executable, "-m", "jaxsched.entrypoints.cli", "generate", "--quiet", "--timing-json", str(timing), *extra]
        start = time.perf_counter()
        # RUSAGE_CHILDREN keeps the largest child this process ever had, so each run's peak is
        # read in a throwaway parent of its own.
        done = subprocess.run([sys.executable, "-c", _PEAK, *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"generate failed ({done.returncode}):\n{done.stderr[-4000:]}")
        out = json.loads(timing.read_text())
        out.update(wall_s=round(wall, 2), peak_rss_mb=round(json.loads(done.stdout.splitlines()[-1])["peak_rss_mb"]))
        return {k: out.get(k) for k in FIELDS}


# Runs the command as its only child and prints that child's peak RSS (Linux ru_maxrss: KiB).
_PEAK = """
import json, resource, subprocess, sys
done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL)
if done.returncode:
    sys.exit(done.returncode)
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def median_row(runs: list[dict]) -> dict:
    return {k: (float(np.median([r[k] for r in runs])) if all(r[k] is not None for r in runs) else None)
            for k in FIELDS}


def markdown(result: dict) -> str:
    lines = [f"`jaxsched generate {' '.join(result['generate_args'])}` (default model, built-in prompts), "
             f"{result['machine']}, load average {result['load_average'][0]:.2f} before, "
             f"{result['load_average'][1]:.2f} after; median of {result['runs']} run(s).", "",
             "| start | load (s) | first token (s) | total (s) | compile (s) | wall (s) | peak RSS (MB) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in ("cold", "warm"):
        row = result[name]
        cells = ["-" if row[k] is None else f"{row[k]:.0f}" if k == "peak_rss_mb" else f"{row[k]:.1f}"
                 for k in FIELDS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "cold: empty compilation cache; warm: the cache the cold run filled. Times from "
              "process start (wall: from outside, interpreter start-up included)."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("extra", nargs="*", help="extra `jaxsched generate` flags (after --)")
    args = parser.parse_args()
    extra = list(args.extra) + (["--max-tokens", "8"] if args.quick else [])
    load_before = os.getloadavg()[0]
    cold, warm = [], []
    for _ in range(1 if args.quick else args.runs):
        with tempfile.TemporaryDirectory(prefix="jaxsched-startup-") as cache:
            cold.append(run_once(cache, extra))
            warm.append(run_once(cache, extra))
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "generate_args": extra,
              "runs": len(cold), "cold": median_row(cold), "warm": median_row(warm),
              "cold_runs": cold, "warm_runs": warm, "load_average": [load_before, os.getloadavg()[0]]}
    if args.json:
        print(json.dumps(result, indent=2))
    print(markdown(result))
    if not args.quick:
        save_results("startup", result, markdown(result))


if __name__ == "__main__":
    main()
