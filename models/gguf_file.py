"""The layout of a GGUF file: its key/value metadata and where each tensor's bytes lie.

`open_gguf(path)` parses the header once, in bulk, and maps the file: ``(metadata, tensors)``,
the metadata as plain Python values and each `TensorInfo`'s ``data`` a read-only view of the
mapped bytes, shaped as `gguf.GGUFReader` shapes them (typed for float and integer tensors,
raw bytes per row for quantized ones), so `gguf.quants.dequantize` reads it unchanged.

Why not `gguf.GGUFReader`: it builds a numpy view for every element of every array field,
and a Llama vocabulary is ~100k strings (tokens and merges), so opening SmolLM2's file took
about 7 s of a 10 s model load, on every start. Here an array of numbers is one `frombuffer`
and an array of strings one pass of `struct` over the header: well under a second. The
gguf package still supplies the format's constants and the dequantization.
"""

from __future__ import annotations

import os
import pathlib
import struct
from typing import Any, NamedTuple

import gguf
import numpy as np

__all__ = ["TensorInfo", "open_gguf"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)

_V, _Q = gguf.GGUFValueType, gguf.GGMLQuantizationType
# The numpy dtype of each fixed-size GGUF value type.
_SCALARS = {_V.UINT8: "u1", _V.INT8: "i1", _V.UINT16: "u2", _V.INT16: "i2", _V.UINT32: "u4", _V.INT32: "i4",
            _V.FLOAT32: "f4", _V.BOOL: "?", _V.UINT64: "u8", _V.INT64: "i8", _V.FLOAT64: "f8"}
# Tensor types stored as plain numpy values (the others are quantized blocks of bytes).
_PLAIN = {_Q.F16: np.float16, _Q.F32: np.float32, _Q.F64: np.float64, _Q.I8: np.int8, _Q.I16: np.int16,
          _Q.I32: np.int32, _Q.I64: np.int64}


class TensorInfo(NamedTuple):
    """One tensor's entry: ``shape`` in GGUF's order (fastest-varying dimension first), its
    ggml type, and ``data``, a read-only view into the mapped file."""
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    """Reads little- or big-endian GGUF values from a buffer, front to back."""

    def __init__(self, buf: memoryview, order: str):
        self.buf, self.order, self.offset = buf, order, 0

    def unpack(self, fmt: str) -> int:
        values = struct.unpack_from(self.order + fmt, self.buf, self.offset)
        self.offset += struct.calcsize(self.order + fmt)
        return values[0]

    def dims(self, n: int) -> tuple[int, ...]:
        values = struct.unpack_from(f"{self.order}{n}Q", self.buf, self.offset)
        self.offset += 8 * n
        return values

    def string(self) -> str:
        n = self.unpack("Q")
        end = self.offset + n
        if end > len(self.buf):
            raise ValueError(f"a string of {n} bytes at offset {self.offset} runs past the end of the file")
        text = str(self.buf[self.offset:end], "utf-8")
        self.offset = end
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _V.STRING:
            return self.string()
        if vtype == _V.ARRAY:
            itype, count = self.unpack("I"), self.unpack("Q")
            if itype in _SCALARS:
                dtype = np.dtype(_SCALARS[itype]).newbyteorder(self.order)
                end = self.offset + count * dtype.itemsize
                if end > len(self.buf):
                    raise ValueError(f"an array of {count} values at offset {self.offset} runs past the end of the file")
                values = np.frombuffer(self.buf, dtype, count, self.offset).tolist()
                self.offset = end
                return values
            return [self.value(itype) for _ in range(count)]
        if vtype in _SCALARS:
            dtype = np.dtype(_SCALARS[vtype]).newbyteorder(self.order)
            value = np.frombuffer(self.buf, dtype, 1, self.offset)[0].item()
            self.offset += dtype.itemsize
            return value
        raise ValueError(f"unknown GGUF value type {vtype} at offset {self.offset}")


def _tensor_data(mapped: np.ndarray, qtype, shape: tuple[int, ...], offset: int, name: str,
                 order: str) -> np.ndarray:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_elements = int(np.prod(shape, dtype=np.int64))
    dims = tuple(reversed(shape))
    if qtype in _PLAIN:
        dtype, count = np.dtype(_PLAIN[qtype]).newbyteorder(order), n_elements
    else:
        if shape and shape[0] % block_size:
            raise ValueError(f"tensor {name!r}: row length {shape[0]} is not a multiple of "
                             f"{qtype.name}'s block of {block_size}")
        dtype, count = np.dtype(np.uint8), n_elements // block_size * type_size
        dims = (*dims[:-1], dims[-1] // block_size * type_size) if dims else dims
    if offset + count * dtype.itemsize > mapped.size:
        raise ValueError(f"tensor {name!r} ({count * dtype.itemsize} bytes at offset {offset}) runs past "
                         f"the end of the file ({mapped.size} bytes)")
    return mapped[offset:offset + count * dtype.itemsize].view(dtype).reshape(dims)


def open_gguf(path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """``(metadata, tensors)`` of the GGUF file at ``path``; the tensors' data stays mapped.

    ``FileNotFoundError`` when there is no such file, ``ValueError`` naming the file and what
    is wrong when it is not a GGUF file this reads (GGUF versions 2 and 3, either byte order).
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        # A plain ndarray over the map: views of a `np.memmap` each run its Python
        # `__array_finalize__`, and dequantizing makes a million of them (3 s of a load).
        mapped = np.memmap(os.fspath(path), mode="r").view(np.ndarray)
        buf = memoryview(mapped)
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError("it does not start with the GGUF magic")
        order = "<"
        if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF == 0:    # written on a big-endian host
            order = ">"
        cur = _Cursor(buf, order)
        cur.offset = 4
        version, tensor_count, kv_count = cur.unpack("I"), cur.unpack("Q"), cur.unpack("Q")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} (this reads versions {_VERSIONS})")
        # The header's own counts first, under the names gguf.GGUFReader gives them.
        metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count,
                                    "GGUF.kv_count": kv_count}
        for _ in range(kv_count):
            key = cur.string()
            if key in metadata:
                raise ValueError(f"the key {key!r} appears twice")
            metadata[key] = cur.value(cur.unpack("I"))
        entries = []
        for _ in range(tensor_count):
            name = cur.string()
            shape = cur.dims(cur.unpack("I"))
            entries.append((name, cur.unpack("I"), shape, cur.unpack("Q")))
        alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment={alignment!r} is not a power of two")
        start = -(-cur.offset // alignment) * alignment
        tensors, seen = [], set()
        for name, raw_type, shape, offset in entries:
            if name in seen:
                raise ValueError(f"the tensor {name!r} appears twice")
            seen.add(name)
            qtype = _Q(raw_type)
            data = _tensor_data(mapped, qtype, shape, start + offset, name, order)
            tensors.append(TensorInfo(name, qtype, shape, data))
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError, KeyError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    return metadata, tensors
