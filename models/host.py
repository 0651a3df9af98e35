"""Host arrays the loaders fill and hand to JAX."""
from __future__ import annotations

import numpy as np


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """``np.empty`` whose data starts on an `align`-byte boundary.

    JAX on CPU adopts such a C-contiguous host array as a device buffer without copying it
    (``jax.device_put``), so weights built in one need no second host copy. (``np.empty``
    of a large array starts 16 bytes into its mapping: JAX would copy it.)
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)
