"""Model-free replay: trace files, synthetic workloads, simulate, capacity sweeps, and the
plain-Python reference scheduler (a readable statement of the semantics)."""
