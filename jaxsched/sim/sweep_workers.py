"""Worker processes for the CPU sweep: one per core, each stepping its shard of runs.

Why processes: each has XLA:CPU's thread pool to itself. Two processes limited to one CPU
each step the 64-configuration grid at 75 us per run-step each at once, as fast as one alone:
a run-step every 37.6 us per pair, 1.18x the two threads of one process (44.2 us; 1.42x
before the threads waited for their own chunks: benchmarks/sweep_partitions.py,
results/sweep_partitions.md). A pruned sweep reads and ships run states between its waves,
which costs processes more than threads: so they are used only when asked for
(`sweep(workers=True)`), threads being as fast or faster end to end at every size measured.

The parent compiles the chunk first (or loads it: sim/executable_store.py) and ships it,
serialized (`jax.experimental.serialize_executable`); a worker loads it in about 0.9 s,
where compiling it again, even through JAX's persistent cache, traces and lowers it first
(about 2 s more). A worker keeps its shard's carries (one per block of runs), steps them
chunk by chunk on request and hands rows of them back, so the parent's bookkeeping (records,
waves, resumed runs) is the threaded path's. Workers start once per process, on first use,
and stay until it exits.

Protocol: pickled (command, args) frames on the worker's stdin; pickled ("ok", value) or
("error", traceback) frames on a pipe that was its stdout. Only the parent talks to it.
"""
from __future__ import annotations

import atexit
import os
import pickle
import struct
import subprocess
import sys
import threading

_HEADER = struct.Struct("<Q")


def _write(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(data)))
    f.write(data)
    f.flush()


def _read(f):
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(head)
    data = f.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def available() -> bool:
    """Worker processes can be pinned to one CPU each here (Linux) and there are two CPUs."""
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


class WorkerError(RuntimeError):
    """A sweep worker failed or exited; the pool is started afresh on the next sweep."""


class Worker:
    """One worker process pinned to `cpu`."""

    def __init__(self, cpu: int):
        self.cpu = cpu
        self.loaded: set = set()         # ids of the executables shipped to it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxsched.sim.sweep_workers", str(cpu)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # Its stderr is drained on a thread (a full pipe would block it) and kept for errors.
        self.errors: list[bytes] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.errors = (self.errors + [line])[-40:]

    def send(self, command: str, *args) -> None:
        try:
            _write(self.proc.stdin, (command, args))
        except (BrokenPipeError, OSError):
            raise self._failed(command) from None

    def receive(self, command: str = "?"):
        try:
            status, value = _read(self.proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            raise self._failed(command) from None
        if status != "ok":
            raise WorkerError(f"sweep worker on CPU {self.cpu} failed in {command}:\n{value}")
        return value

    def call(self, command: str, *args):
        self.send(command, *args)
        return self.receive(command)

    def _failed(self, command: str) -> WorkerError:
        self.proc.poll()
        tail = b"".join(self.errors).decode(errors="replace")[-2000:]
        return WorkerError(f"sweep worker on CPU {self.cpu} exited (code {self.proc.returncode}) "
                           f"during {command}; its last output:\n{tail}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


_POOL: list[Worker] = []


def pool(count: int) -> list[Worker]:
    """`count` workers, one per usable CPU (started on first use, then kept; one that has
    exited is replaced)."""
    _POOL[:] = [w for w in _POOL if w.proc.poll() is None]
    cpus = sorted(os.sched_getaffinity(0))
    while len(_POOL) < count:
        # The least used CPU: a replacement goes where the worker it replaces was.
        _POOL.append(Worker(min(cpus, key=lambda c: sum(w.cpu == c for w in _POOL))))
    return _POOL[:count]


def start_pool(count: int) -> None:
    """Start `count` workers and wait until they are ready (JAX imported)."""
    for worker in pool(count):
        worker.send("ping")
    for worker in pool(count):
        worker.receive("ping")


def close_pool() -> None:
    while _POOL:
        _POOL.pop().close()


atexit.register(close_pool)


def _whole(method):
    """A Shards method that, if it fails or is interrupted part way, closes the pool: a
    worker may have a reply not yet read, and the next sweep starts new workers instead."""
    def wrapped(self, *args):
        try:
            return method(self, *args)
        except BaseException:
            close_pool()
            raise
    wrapped.__doc__ = method.__doc__
    return wrapped


class Shards:
    """The shards of a sweep batch, each held and stepped by a worker: worker i holds the
    i-th run of `len(carries) // count` blocks (the parent's threads' shards)."""

    def __init__(self, count: int):
        self.workers = pool(count)
        self.per = 1                     # blocks per worker, set by `start`

    def _mine(self, items: list) -> list:
        """Per block -> per worker: each worker's run of blocks."""
        return [items[i * self.per:(i + 1) * self.per] for i in range(len(self.workers))]

    @_whole
    def start(self, exe, blob: bytes, consts, carries, small=None) -> None:
        """Give each worker the chunk and its blocks' carries. `exe` is the parent's compiled
        chunk, `blob` its bytes (`sweep.serialized`), shipped to a worker that lacks it.
        `small`: (exe, blob, carries) of the blocks at half the slots (`sweep(half_slots=...)`),
        else None."""
        import jax
        import numpy as np

        def how(worker, exe, blob):
            if id(exe) in worker.loaded:
                return "loaded", id(exe)
            worker.loaded.add(id(exe))
            return "ship", id(exe), blob

        self.per = len(carries) // len(self.workers)
        host = [np.asarray(x) for x in consts]
        smalls = self._mine(small[2]) if small else [None] * len(self.workers)
        for worker, mine, little in zip(self.workers, self._mine(carries), smalls):
            worker.send("start", how(worker, exe, blob), host, jax.tree.map(np.asarray, mine),
                        small and (how(worker, *small[:2]), jax.tree.map(np.asarray, little)))
        for worker in self.workers:
            worker.receive("start")

    @_whole
    def advance(self, firsts, times, busy, busy_small=None, at_small=None) -> dict:
        """One chunk on every block that is `busy` (has a live run; per block, as are the
        first steps and times), every worker at once: {block: its records}. With half slots,
        `busy_small` says which blocks have a live run at half the slots, `at_small` (bool
        per position, per block) which positions' records come from there."""
        busy = [bool(x) for x in busy]
        busy_small = [False] * len(busy) if busy_small is None else [bool(x) for x in busy_small]
        at_small = [None] * len(busy) if at_small is None else at_small
        for worker, *args in zip(self.workers, *map(self._mine, (firsts, times, busy, busy_small, at_small))):
            worker.send("advance", *args)
        recs = [rec for worker in self.workers for rec in worker.receive("advance")]
        return dict(zip((b for b, (x, y) in enumerate(zip(busy, busy_small)) if x or y), recs))

    @_whole
    def move(self, block: int, local, to_small: bool, slots: int) -> None:
        """Move a block's runs at positions `local` to its carry at half the slots
        (`to_small`) or back, at `slots` request slots (`sweep.move_rows`)."""
        self.workers[block // self.per].call("move", block % self.per, local, to_small, slots)

    @_whole
    def fit(self, slots: int):
        """bool per position of the full-slot carries: the run there holds no request in a
        slot at or past `slots` (`sweep._fit`)."""
        import numpy as np

        for worker in self.workers:
            worker.send("fit", slots)
        return np.concatenate([worker.receive("fit") for worker in self.workers])

    @_whole
    def rows(self, block: int, index, small: bool = False):
        """Rows `index` of a block's carry (state, per_request), host arrays (of its carry at
        half the slots where `small`)."""
        return self.workers[block // self.per].call("rows", block % self.per, index, small)

    @_whole
    def per_request(self, small: bool = False) -> list:
        for worker in self.workers:
            worker.send("per_request", small)
        return [worker.receive("per_request") for worker in self.workers]


def _serve() -> None:
    """The worker's loop: answer frames on stdin until it closes."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                       # stray prints go to stderr, not into the frames
    inp = sys.stdin.buffer
    import traceback

    import jax
    import numpy as np
    from jax.experimental.serialize_executable import deserialize_and_load

    from jaxsched.sim import sweep as sw

    executables, exe, consts, carry = {}, None, None, None
    exe_small, small = None, None       # with half slots: the chunk and carries at half

    def load(how):
        if how[0] == "ship":
            executables[how[1]] = deserialize_and_load(*pickle.loads(how[2]))
        return executables[how[1]]

    while True:
        try:
            command, args = _read(inp)
        except EOFError:
            return
        try:
            if command == "start":      # carry: its blocks' carries
                how, host_consts, host_carry, half = args
                consts, carry = [jax.device_put(x) for x in host_consts], jax.device_put(host_carry)
                exe = load(how)
                exe_small, small = (load(half[0]), jax.device_put(half[1])) if half else (None, None)
                value = None
            elif command == "advance":  # the records of its busy blocks, in order
                value = []
                for b, (first, when, busy, busy_small, at) in enumerate(zip(*args)):
                    if busy or busy_small:
                        value.append(sw.step_block((carry, small), (exe, exe_small), b, consts, first, when,
                                                   np.zeros(len(first), bool) if at is None else at,
                                                   (busy, busy_small)))
            elif command == "move":     # runs of a block between its two slot counts
                b, local, to_small, slots = args
                if to_small:
                    carry[b], small[b] = sw.move_rows(carry[b], small[b], local, slots, {})
                else:
                    small[b], carry[b] = sw.move_rows(small[b], carry[b], local, slots, {})
                value = None
            elif command == "fit":
                value = sw._fit(carry, args[0])
            elif command == "rows":     # a worker's carry is on the CPU: read on the host
                value = sw._rows((small if args[2] else carry)[args[0]], args[1], {})
            elif command == "per_request":
                value = np.concatenate([np.asarray(c[1]) for c in (small if args[0] else carry)])
            elif command == "ping":         # answered once JAX and jaxsched are imported
                value = None
            else:
                raise ValueError(f"unknown command {command!r}")
            _write(out, ("ok", value))
        except Exception:   # the parent raises it as a WorkerError
            _write(out, ("error", traceback.format_exc()))


if __name__ == "__main__":
    # Pinned before XLA's CPU client starts: its thread pool is sized from the CPUs it may use.
    os.sched_setaffinity(0, {int(sys.argv[1])})
    _serve()
