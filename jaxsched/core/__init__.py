"""The scheduler core: config, the state pytree, block pool, queue walks, preemption,
placement, schedule, requests and invariants. Imports only jax and numpy (and flax.struct)."""
