"""jaxsched: vLLM's scheduler and paged KV-cache manager as pure JAX functions."""
