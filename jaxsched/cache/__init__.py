"""The paged KV cache: device and host pools, their kernels, and paged attention."""
