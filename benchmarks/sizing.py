"""Preemptions and goodput against vLLM's memory knobs, with SmolLM2-135M on this backend.

    python benchmarks/sizing.py

1. A pretend device of DEVICE_GIB (SmolLM2's float32 weights take about half of it), so
   gpu_memory_utilization in UTILS leaves a KV cache of tens of blocks; swap_space in SWAPS.
2. Workload (seed 0): REQUESTS requests of random token ids arriving ~RATE per step,
   prompts 40-88 tokens, outputs 16-40 with `ignore_eos` (so even a recomputed prefill fits
   the 128-token step), greedy: memory-pressured.
3. Every (utilization, swap) runs for real through `LLM(..., gpu_memory_utilization=u,
   swap_space=s, device_memory_bytes=...)`: the engine sizes its cache at start-up from the
   measured weights and working memory. Requests join at their arrival step; each step is
   timed. One compiled capacity serves every run (pool capacities fixed at the largest).
4. A StepTimeModel (seconds = a + b * tokens run + d * blocks swapped) is fitted to every
   timed step of every run, the planner (`jaxsched.sim.sweep` in memory units, the same
   arithmetic) predicts each row with it, and its pick for `MIN_GOODPUT` under the
   objectives (1.5x the largest configuration's measured p90 TTFT and TPOT) is run once more
   for real. The table states the model's error: measured against predicted mean TTFT.

Results: benchmarks/results/sizing.{md,json}.
"""
import os

from jaxsched.entrypoints.xla_flags import use_xla_flags  # noqa: E402
use_xla_flags()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from _common import save_results  # noqa: E402

DEVICE_GIB = 1.0
UTILS = [0.53, 0.54, 0.55, 0.575]
SWAPS = [0.0, 0.05]
REQUESTS, RATE = 16, 2.0
ENGINE = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256,
              num_slots=16, max_seqs_per_group=1, preemption_mode="swap")
MIN_GOODPUT = 0.75


def workload():
    rng = np.random.default_rng(0)
    steps = np.floor(np.cumsum(rng.exponential(1 / RATE, REQUESTS))).astype(int)
    steps -= steps[0]
    return [dict(id=f"r{i}", arrival_step=int(steps[i]), prompt_len=int(rng.integers(40, 89)),
                 max_tokens=int(rng.integers(16, 41)), n=1) for i in range(REQUESTS)]


def run(model, tokenizer, reqs, util, swap, capacity):
    """One real run: (per-step [tokens, swapped, seconds], per-request first/finish step, stats)."""
    from jaxsched import LLM, SamplingParams
    llm = LLM(model, tokenizer=tokenizer, gpu_memory_utilization=util, swap_space=swap,
              device_memory_bytes=int(DEVICE_GIB * (1 << 30)), **ENGINE, **capacity)
    llm.warm_up()                                  # compiled once; later runs reuse it
    llm._stats.counts.clear()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 40000, r["prompt_len"]).tolist() for r in reqs]
    captured = []
    inner = llm._step

    def step(*args):
        state, out = inner(*args)
        captured.append(out)
        return state, out
    llm._step = step
    first, finish, steps, t, notes = {}, {}, [], 0, []
    while len(finish) < len(reqs):
        for i, r in enumerate(reqs):
            if r["arrival_step"] == t:
                llm.add_request(r["id"], prompts[i], SamplingParams(max_tokens=r["max_tokens"],
                                                                    temperature=0, ignore_eos=True))
        start = time.perf_counter()
        outs = llm.step()
        seconds = time.perf_counter() - start
        o = jax.device_get(captured[-1])
        steps.append((int(o.num_tokens), int(o.num_swap_out) + int(o.num_swap_in), seconds))
        for out in outs:
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, t)
            if out.finished:
                finish[out.request_id] = t
                if out.message or out.request_id not in first:
                    notes.append(f"{out.request_id} at step {t}: {out.message}, "
                                 f"{len(out.outputs[0].token_ids)} tokens")
        t += 1
    st = llm.stats()
    return dict(steps=steps, first=first, finish=finish, notes=notes, device_blocks=llm.config.num_device_blocks,
                host_blocks=llm.config.num_host_blocks,
                preemptions=st["preempted_recompute"] + st["preempted_swap"],
                preempted_recompute=st["preempted_recompute"], preempted_swap=st["preempted_swap"])


def latencies(result, reqs, clock):
    """(TTFT, TPOT, served) per request; an ignored request (a note) is never good."""
    ttft, tpot = [], []
    ignored = {n.split(" ")[0] for n in result["notes"]}
    for r in reqs:
        e = result["finish"][r["id"]]
        f = result["first"].get(r["id"], e)          # see the run's notes
        ttft.append(clock[f + 1] - clock[r["arrival_step"]])
        tpot.append((clock[e + 1] - clock[f + 1]) / max(r["max_tokens"] - 1, 1))
    served = np.array([r["id"] not in ignored for r in reqs])
    return np.array(ttft), np.array(tpot), served


def main():
    from jaxsched.engine.sizing import profile_model
    from jaxsched.sim.sweep import good_requests, pick_smallest, sweep
    from jaxsched.sim.workload import StepTimeModel
    from models.loader import build_model, load_weights

    t0 = time.perf_counter()
    reqs = workload()
    trace = {"config": dict(ENGINE, num_device_blocks=16, num_host_blocks=0, step_time=1.0,
                            max_steps=100000), "requests": reqs}
    trace["config"].pop("num_slots")
    trace["config"].pop("max_seqs_per_group")
    memory = profile_model(None, device_memory_bytes=int(DEVICE_GIB * (1 << 30)))
    planned = sweep(trace, gpu_memory_utilization=UTILS, swap_space=SWAPS, memory=memory, progress=False,
                    per_request=True)
    capacity = dict(num_device_blocks_capacity=max(r["num_device_blocks"] for r in planned),
                    num_host_blocks_capacity=max(max(r["num_host_blocks"] for r in planned), 1))
    config, tensors, tokenizer = load_weights(None)
    model = build_model(config, tensors)
    real = {}
    for util in UTILS:
        for swap in SWAPS:
            real[(util, swap)] = run(model, tokenizer, reqs, util, swap, capacity)
    # The step-time model, fitted to every timed step (tokens run stand for both prefill
    # tokens and decode sequences: one decode is one token).
    rows = np.array([s for r in real.values() for s in r["steps"]], np.float64)
    design = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
    a, b, d = np.linalg.lstsq(design, rows[:, 2], rcond=None)[0]
    model_t = StepTimeModel(float(a), float(b), float(b), float(d))
    step_err = float(np.median(np.abs(design @ [a, b, d] - rows[:, 2]) / rows[:, 2]))
    big = real[(UTILS[-1], SWAPS[-1])]
    clock_big = np.concatenate([[0.0], np.cumsum([s[2] for s in big["steps"]])])
    ttft_big, tpot_big, _ = latencies(big, reqs, clock_big)
    slo_ttft, slo_tpot = float(1.5 * np.percentile(ttft_big, 90)), float(1.5 * np.percentile(tpot_big, 90))
    predicted = sweep(trace, gpu_memory_utilization=UTILS, swap_space=SWAPS, memory=memory, progress=False,
                      per_request=True, step_time_model=model_t, slo_ttft=slo_ttft, slo_tpot=slo_tpot)
    pick = pick_smallest(predicted, MIN_GOODPUT)
    table = []
    for p in predicted:
        r = real[(p["gpu_memory_utilization"], p["swap_space"])]
        clock = np.concatenate([[0.0], np.cumsum([s[2] for s in r["steps"]])])
        ttft, tpot, served = latencies(r, reqs, clock)
        good = good_requests(ttft, tpot, slo_ttft, slo_tpot, served=served)
        table.append(dict(gpu_memory_utilization=p["gpu_memory_utilization"], swap_space=p["swap_space"],
                          device_blocks=r["device_blocks"], planned_device_blocks=p["num_device_blocks"],
                          host_blocks=r["host_blocks"], planned_host_blocks=p["num_host_blocks"],
                          preemptions=r["preemptions"], planned_preemptions=p["num_preemptions"],
                          steps=len(r["steps"]), planned_steps=p["steps"],
                          goodput=float(good.mean()), planned_goodput=p["goodput"],
                          ttft_mean=float(ttft.mean()), planned_ttft_mean=p["ttft_mean"],
                          good_per_s=float(good.sum() / clock[-1]), planned_good_per_s=p["good_per_s"]))
    pick_run = None
    if pick is not None:
        again = run(model, tokenizer, reqs, pick["gpu_memory_utilization"], pick["swap_space"], capacity)
        clock = np.concatenate([[0.0], np.cumsum([s[2] for s in again["steps"]])])
        ttft, tpot, served = latencies(again, reqs, clock)
        pick_run = dict(gpu_memory_utilization=pick["gpu_memory_utilization"], swap_space=pick["swap_space"],
                        planned_goodput=pick["goodput"],
                        goodput=float(good_requests(ttft, tpot, slo_ttft, slo_tpot, served=served).mean()),
                        device_blocks=again["device_blocks"], host_blocks=again["host_blocks"])
    ttft_err = [abs(t["ttft_mean"] - t["planned_ttft_mean"]) / t["ttft_mean"] for t in table]
    result = dict(device_gib=DEVICE_GIB, engine=ENGINE, requests=reqs, slo_ttft_s=slo_ttft,
                  slo_tpot_s=slo_tpot, min_goodput=MIN_GOODPUT,
                  step_time_model=dict(base=a, per_token=b, per_swapped_block=d,
                                       median_step_error=step_err),
                  ttft_mean_error_max=float(max(ttft_err)), rows=table, pick=pick_run,
                  notes={f"{u},{s}": r["notes"] for (u, s), r in real.items() if r["notes"]},
                  profile=dict(weights_bytes=memory(_cfg(ENGINE)).weights_bytes,
                               peak_bytes=memory(_cfg(ENGINE)).peak_bytes,
                               block_bytes=memory(_cfg(ENGINE)).block_bytes),
                  load_average=os.getloadavg(), seconds=time.perf_counter() - t0)
    md = render(result)
    print(md)
    save_results("sizing", result, md)


def _cfg(engine):
    from jaxsched.core.config import SchedulerConfig
    return SchedulerConfig(**{k: v for k, v in engine.items() if k not in ("num_slots",)})


def render(r) -> str:
    m = r["step_time_model"]
    lines = [f"SmolLM2-135M float32 on a pretend {r['device_gib']:g} GiB device (weights "
             f"{r['profile']['weights_bytes'] / 2**20:.0f} MiB, working memory "
             f"{r['profile']['peak_bytes'] / 2**20:.1f} MiB measured, {r['profile']['block_bytes']} bytes per "
             f"16-token block); {len(r['requests'])} requests, preemption_mode swap. Objectives: "
             f"TTFT <= {r['slo_ttft_s']:.2f} s, TPOT <= {r['slo_tpot_s']:.3f} s. Planned = the sweep "
             f"with the fitted step-time model ({m['base'] * 1e3:.1f} ms + {m['per_token'] * 1e3:.2f} ms "
             f"per token + {m['per_swapped_block'] * 1e3:.2f} ms per swapped block; median error per "
             f"step {m['median_step_error']:.0%}, mean TTFT off by at most {r['ttft_mean_error_max']:.0%}).",
             "",
             "| gpu_memory_utilization | swap_space GiB | device / host blocks (planned) | preemptions (planned) "
             "| steps (planned) | goodput (planned) | good req/s (planned) | mean TTFT s (planned) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in r["rows"]:
        lines.append(f"| {t['gpu_memory_utilization']:g} | {t['swap_space']:g} | {t['device_blocks']} / "
                     f"{t['host_blocks']} ({t['planned_device_blocks']} / {t['planned_host_blocks']}) | "
                     f"{t['preemptions']} ({t['planned_preemptions']}) | {t['steps']} ({t['planned_steps']}) | "
                     f"{t['goodput']:.2f} ({t['planned_goodput']:.2f}) | {t['good_per_s']:.2f} "
                     f"({t['planned_good_per_s']:.2f}) | {t['ttft_mean']:.2f} ({t['planned_ttft_mean']:.2f}) |")
    p = r["pick"]
    lines.append("")
    if p:
        lines.append(f"Planner's pick for goodput >= {r['min_goodput']:g}: gpu_memory_utilization "
                     f"{p['gpu_memory_utilization']:g}, swap_space {p['swap_space']:g} GiB ({p['device_blocks']} / "
                     f"{p['host_blocks']} blocks), promised {p['planned_goodput']:.2f}; run again for real "
                     f"through LLM: {p['goodput']:.2f}.")
    else:
        lines.append(f"No configuration in the grid is planned to reach goodput {r['min_goodput']:g}.")
    lines.append(f"\nLoad average {', '.join(f'{x:.1f}' for x in r['load_average'])}; "
                 f"{r['seconds']:.0f} s in all.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
