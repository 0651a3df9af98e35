"""What the benchmark scripts share: interleaved timing and writing a result's JSON and table.

Imported as `_common` by scripts run as `python benchmarks/NAME.py` (their folder is first on
sys.path then). Nothing here imports jax at import time.
"""
import json
import pathlib
import time

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results"


def time_interleaved(calls: dict, reps: int, inner: int = 3) -> tuple[dict[str, float], dict[str, float]]:
    """(median, min) seconds per call of each zero-argument callable, rounds interleaved.

    Each callable runs once first (compile, first-run costs); then every round times `inner`
    calls of each in turn, so load from other processes hits them alike.
    """
    import jax  # here, not at the top: the transformers worker must not load XLA

    for call in calls.values():
        jax.block_until_ready(call())
    samples = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(inner):
                jax.block_until_ready(call())
            samples[name].append((time.perf_counter() - start) / inner)
    return ({name: float(np.median(s)) for name, s in samples.items()},
            {name: float(np.min(s)) for name, s in samples.items()})


def machine() -> str:
    """Where a result was measured, for its table's title: "(backend; arch, N CPUs; jax V)"."""
    import os
    import platform

    import jax

    return f"({jax.default_backend()}; {platform.machine()}, {os.cpu_count()} CPUs; jax {jax.__version__})"


def save_results(stem: str, result: dict, markdown: str) -> None:
    """Write results/STEM.json (indented) and results/STEM.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown)
