"""Llama-family models that run on jaxsched's paged KV cache."""
