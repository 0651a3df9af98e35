"""Where a sweep chunk's time goes (vmapped, or --map): one profiled chunk, its device ops summed.

    python benchmarks/sweep_profile.py [--configs 1024] [--skip-chunks 8] [--top 40] [--no-vmap-skips]
                                       [--map] [--num-slots N] [--results DIR]

The 500-request trace and grid of `benchmarks/sweep.py` (--configs configurations), all runs
in one `jax.vmap` on one thread (the accelerator default). The sweep's first --skip-chunks + 1
chunks run under `jax.profiler` (compiled before), and the ops of the last chunk are summed,
so the profile sees a busy middle of the trace, not its empty start. From the profile's
Perfetto trace (with --map, the map path instead, the CPU default: one block of --configs <=
MAP_BLOCK runs stepped one after another in one call, not pruned, so the window is that call
and costs are per run-step; --num-slots fixes the request slots, to see what they cost): each
chunk's run on the host, the last chunk's time per step from its
dispatch to its last op, the time the device was busy (overlaps merged), ops and copies to
the host per step, and the ops by total time, each with the jax source it came from (the
innermost stack frame of its HLO instruction). An op's time is its own: on XLA:CPU a
conditional's thunk spans the ops of its branch, which are counted apart. XLA_FLAGS: the
caller's, else `jaxsched sweep`'s. Writes sweep_profile_BACKEND.{md,json}, the compressed
trace and the optimized HLO beside them (named with _map after BACKEND with --map, then
_Nslots with --num-slots).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import re
import tempfile
import time
from collections import defaultdict

from _common import RESULTS
from sweep import TRACE, grid

import jax

from jaxsched.entrypoints.cli_sweep import markdown_table
from jaxsched.sim import sweep as sw
from jaxsched.sim.simulate import CHUNK_STEPS
from jaxsched.sim.workload import generate_trace


def run_chunks(trace, axes, runs: int, chunks: int, skips: bool, capacity: dict | None = None) -> float:
    """Sweep the grid for `chunks` chunks, `runs` in one vmap (1: the map path, unpruned, so
    the block's runs all step to the end; the sweep stops there, unfinished); its seconds."""
    limited = dict(trace, config=dict(trace["config"], max_steps=chunks * CHUNK_STEPS))
    t0 = time.perf_counter()
    try:
        sw.sweep(limited, **axes, vmap_runs=runs, threads=1, progress=False, vmap_skips=skips,
                 prune=False if runs == 1 else None, capacity=capacity)
    except RuntimeError:            # runs unfinished after max_steps: expected
        pass
    return time.perf_counter() - t0


def device_events(trace_json: dict):
    """(device op events, host op events) of a Chrome/Perfetto trace: complete events
    ('X') on the tracks of processes named after a device, and on the others."""
    names = {e["pid"]: e["args"].get("name", "") for e in trace_json["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    on_device = lambda pid: bool(re.search(r"/device:|GPU|TPU", names.get(pid, "")))   # noqa: E731
    ops = [e for e in trace_json["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    return [e for e in ops if on_device(e["pid"])], [e for e in ops if not on_device(e["pid"])]


def busy_us(events) -> float:
    """Microseconds covered by at least one event (overlapping streams merged)."""
    total, end = 0.0, -1.0
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _table(hlo_text: str, title: str) -> dict[int, str]:
    """A numbered table of the HLO text's trailer (FileNames, FunctionNames, FileLocations,
    StackFrames): id -> the rest of its line."""
    block = re.search(rf"^{title}\n((?:\d+ [^\n]*\n?)*)", hlo_text, re.M)
    rows = (line.split(" ", 1) for line in (block.group(1).splitlines() if block else []))
    return {int(k): v for k, v in rows}


def hlo_sources(hlo_text: str) -> dict[str, str]:
    """Each optimized HLO instruction's jax source: "file:line function" of the innermost
    stack frame of its metadata, else the last scopes of its op_name."""
    files = {k: pathlib.Path(v.strip('"')).name for k, v in _table(hlo_text, "FileNames").items()}
    funcs = {k: v.strip('"') for k, v in _table(hlo_text, "FunctionNames").items()}
    field = lambda text, name: int(re.search(rf"{name}=(\d+)", text).group(1))   # noqa: E731
    locs = {k: f"{files.get(field(v, 'file_name_id'), '?')}:{field(v, 'line')} "
               f"{funcs.get(field(v, 'function_name_id'), '?')}"
            for k, v in _table(hlo_text, "FileLocations").items()}
    frames = {k: locs.get(field(v, "file_location_id"), "?")
              for k, v in _table(hlo_text, "StackFrames").items()}
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?metadata=\{([^}\n]*)\}", hlo_text, re.M):
        meta = m.group(2)
        frame = re.search(r"stack_frame_id=(\d+)", meta)
        if frame and int(frame.group(1)) in frames:
            out[m.group(1)] = frames[int(frame.group(1))]
            continue
        op = re.search(r'op_name="([^"]*)"', meta)
        scopes = [p for p in (op.group(1) if op else "").split("/")
                  if p and not re.match(r"(jit|vmap|while|body|cond|branch|checkpoint|remat)\b", p)]
        out[m.group(1)] = "/".join(scopes[-2:])[:60]
    return out


def self_us(events) -> list[float]:
    """Each event's own microseconds: its length less that of the events nested in it on
    its thread (on XLA:CPU a conditional's thunk spans its branch's ops)."""
    out = [float(e["dur"]) for e in events]
    tracks = defaultdict(list)
    for i, e in enumerate(events):
        tracks[(e["pid"], e["tid"])].append(i)
    for ids in tracks.values():
        ids.sort(key=lambda i: (events[i]["ts"], -events[i]["dur"]))
        open_ = []
        for i in ids:
            while open_ and events[open_[-1]]["ts"] + events[open_[-1]]["dur"] <= events[i]["ts"]:
                open_.pop()
            if open_:
                out[open_[-1]] -= events[i]["dur"]
            open_.append(i)
    return out


def op_name(event) -> str:
    """The HLO instruction an op event ran (its hlo_op argument, else the event's name)."""
    return event.get("args", {}).get("hlo_op") or event["name"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=int, default=1024)
    ap.add_argument("--skip-chunks", type=int, default=8)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--no-vmap-skips", action="store_true", help="profile the batch that skips nothing")
    ap.add_argument("--map", action="store_true",
                    help=f"profile the map path instead (the CPU default): one block of --configs "
                         f"<= {sw.MAP_BLOCK} runs, one run after another in one call")
    ap.add_argument("--num-slots", type=int, help="request slots (default: the sweep's guess)")
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args()
    results = pathlib.Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    backend = jax.default_backend()
    trace, axes = generate_trace(**TRACE), grid(args.configs)
    skips = not args.no_vmap_skips
    if args.skip_chunks < 1:
        ap.error("--skip-chunks: at least 1 (the chunks run once to compile before the profile)")
    if args.map and args.configs > sw.MAP_BLOCK:
        raise SystemExit(f"--map profiles one block: --configs at most {sw.MAP_BLOCK}")
    runs = 1 if args.map else args.configs
    tag = f"{backend}_map" if args.map else backend
    cap = dict(num_slots=args.num_slots) if args.num_slots else None
    if args.num_slots:
        tag += f"_{args.num_slots}slots"
    run_chunks(trace, axes, runs, args.skip_chunks, skips, cap)                  # compiles
    plain = run_chunks(trace, axes, runs, args.skip_chunks + 1, skips, cap)
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        profiled = run_chunks(trace, axes, runs, args.skip_chunks + 1, skips, cap)
        jax.profiler.stop_trace()
        found = sorted(pathlib.Path(tmp).rglob("perfetto_trace.json.gz"))
        if not found:
            raise SystemExit(f"no perfetto_trace.json.gz in the profile: {list(pathlib.Path(tmp).rglob('*'))}")
        data = json.loads(gzip.open(found[0]).read())
    hlo = "\n".join(exe.as_text() for key, exe in sw._EXECUTABLES.items() if key[0] is sw.sweep_chunk)
    with gzip.open(results / f"sweep_profile_{tag}.hlo.txt.gz", "wt") as f:
        f.write(hlo)
    sources = hlo_sources(hlo)
    dev, host = device_events(data)
    # Each chunk's execution on the host (XLA's thunks run from there, waiting on the device
    # for every predicate of a conditional): their lengths show how the cost grows with the
    # trace; the last one is the window the ops are summed over.
    chunk_runs = sorted((e for e in host if e["name"].startswith("jit_sweep_chunk")
                         or (e["name"].startswith("ThunkExecutor::Execute")
                             and e.get("args", {}).get("hlo_module") == "jit_sweep_chunk")),
                        key=lambda e: e["ts"])
    dispatch = sorted(e["ts"] for e in host if e["name"] == "PjitFunction(jit(sweep_chunk))")
    begin = dispatch[-1] if dispatch else (chunk_runs[-1]["ts"] if chunk_runs else 0.0)
    # Host events are Python frames and XLA:CPU's thunks; on an accelerator, its ops.
    events = [e for e in (dev or [e for e in host if e.get("args", {}).get("hlo_module") == "jit_sweep_chunk"])
              if e["ts"] >= begin]
    finish = max(e["ts"] + e["dur"] for e in events)
    # The trace file keeps the last chunk's window, on every track (open it in Perfetto).
    kept = [e for e in data["traceEvents"] if e.get("ph") == "M" or begin <= e.get("ts", -1) <= finish]
    with gzip.open(results / f"sweep_profile_{tag}.trace.json.gz", "wt") as f:
        json.dump(dict(data, traceEvents=kept), f)
    by_op = defaultdict(lambda: [0.0, 0])
    for e, own in zip(events, self_us(events)):
        row = by_op[op_name(e)]
        row[0] += own
        row[1] += 1
    total = sum(r[0] for r in by_op.values())
    steps = CHUNK_STEPS * (args.configs if args.map else 1)     # run-steps in the window
    table = [dict(op=name[:50], source=sources.get(name, ""), total_ms=us / 1e3, share=us / total,
                  count=n, per_step=n / steps, mean_us=us / n)
             for name, (us, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])]
    by_source = defaultdict(float)
    for t in table:
        by_source[t["source"] or "?"] += t["total_ms"]
    lines_src = [dict(source=k, total_ms=v, share=v * 1e3 / total)
                 for k, v in sorted(by_source.items(), key=lambda kv: -kv[1])]
    summary = dict(backend=backend, device=jax.devices()[0].device_kind, jax=jax.__version__,
                   xla_flags=os.environ.get("XLA_FLAGS", ""), configs=args.configs,
                   map_path=args.map, vmap_skips=skips, chunks=args.skip_chunks + 1, wall_s_plain=plain,
                   wall_s_profiled=profiled,
                   chunk_host_ms=[round(e["dur"] / 1e3, 2) for e in chunk_runs],
                   window_us_per_step=(finish - begin) / steps, op_us_per_step=total / steps,
                   busy_us_per_step=busy_us(events) / steps, ops_per_step=len(events) / steps,
                   d2h_copies_per_step=sum(e["name"] == "MemcpyD2H" for e in events) / steps)
    flags = (f"{'' if skips else ' --no-vmap-skips'}{' --map' if args.map else ''}"
             f"{f' --num-slots {args.num_slots}' if args.num_slots else ''}")
    lines = [f"# A {'map-path' if args.map else 'vmapped'} sweep chunk profiled: {args.configs} configurations, "
             f"steps "
             f"{args.skip_chunks * CHUNK_STEPS}..{(args.skip_chunks + 1) * CHUNK_STEPS - 1} "
             f"({backend}: {summary['device']}, jax {summary['jax']}, XLA_FLAGS={summary['xla_flags']!r})", "",
             f"`python benchmarks/sweep_profile.py --configs {args.configs} --skip-chunks {args.skip_chunks}"
             f"{flags}`: "
             f"the sweep's first {args.skip_chunks + 1} chunks under the profiler (compiled before: "
             f"{plain:.2f} s without the profiler, {profiled:.2f} s with); ops summed over the last chunk. "
             f"Per {'run-' if args.map else ''}step: {summary['window_us_per_step']:.0f} us from its dispatch "
             f"to its last op, "
             f"ops {summary['op_us_per_step']:.0f} us, device busy {summary['busy_us_per_step']:.0f} us, "
             f"{summary['ops_per_step']:.0f} ops, {summary['d2h_copies_per_step']:.1f} copies to the host. "
             f"Each chunk's run on the host (ms): {summary['chunk_host_ms']}.", "",
             markdown_table(table[:args.top], list(table[0])), "",
             "## By source line", "", markdown_table(lines_src[:args.top], list(lines_src[0])), ""]
    (results / f"sweep_profile_{tag}.md").write_text("\n".join(lines))
    (results / f"sweep_profile_{tag}.json").write_text(
        json.dumps(dict(summary=summary, ops=table[:400], sources=lines_src), indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
