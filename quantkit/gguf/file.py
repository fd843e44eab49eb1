"""The GGUF container (version 3), as llama.cpp's ggml/gguf.h lays it out: written piecewise, read header-only.

    magic "GGUF", version u32 = 3, tensor count u64, metadata count u64
    metadata: key (string), value type u32, value         string = u64 length + UTF-8 bytes, no terminator
                                                           array  = element type u32, count u64, elements
    tensor infos: name (string), n_dims u32, dims u64 each (innermost first: a [rows, cols] weight is [cols, rows]),
                  ggml type u32, offset u64 (from the start of the data section, a multiple of the alignment)
    padding to the alignment (general.alignment, 32 by default), then the tensors' bytes, each padded to it
All numbers are little-endian. The tensors' bytes are written from a callback one tensor at a time, so a file far
larger than memory is written with one tensor's bytes in hand.
"""
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantkit.core.errors import QuantkitError

MAGIC = b"GGUF"
VERSION = 3
ALIGNMENT = 32

# GGUF metadata value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALARS = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f", BOOL: "?",
            UINT64: "Q", INT64: "q", FLOAT64: "d"}

# ggml tensor types quantkit writes or reads besides the block types (quantkit.gguf.legacy_blocks)
F32, F16, BF16 = 0, 1, 30


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple          # as torch sees it: [rows, cols] for a weight
    ggml_type: int
    nbytes: int
    offset: int = 0       # from the start of the data section


def _string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _value(kind: int, value) -> bytes:
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        element, items = value
        if element == STRING:
            return struct.pack("<IQ", STRING, len(items)) + b"".join(map(_string, items))
        return struct.pack("<IQ", element, len(items)) + np.asarray(items, dtype="<" + _SCALARS[element]).tobytes()
    return struct.pack("<" + _SCALARS[kind], value)


def _padding(size: int) -> bytes:
    return b"\0" * (-size % ALIGNMENT)


def header(metadata: list, tensors: list) -> bytes:
    """The bytes before the data section, unpadded: magic, counts, metadata, each tensor's entry and offset."""
    head = [MAGIC, struct.pack("<IQQ", VERSION, len(tensors), len(metadata))]
    head += [_string(key) + struct.pack("<I", kind) + _value(kind, value) for key, kind, value in metadata]
    offset = 0
    for t in tensors:
        dims = tuple(reversed(t.shape))
        head.append(_string(t.name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, t.ggml_type, offset))
        offset += padded(t.nbytes)
    return b"".join(head)


def padded(size: int) -> int:
    """A section or tensor of `size` bytes with the padding after it."""
    return size + len(_padding(size))


def write_gguf(path: Path, metadata: list, tensors: list, write_tensor) -> None:
    """A GGUF file at `path`. metadata: [(key, value type, value)], an ARRAY's value being (element type, items);
    tensors: [TensorInfo] in file order; write_tensor(info, out) writes exactly info.nbytes bytes of that tensor."""
    header_bytes = header(metadata, tensors)
    with open(path, "wb") as out:
        out.write(header_bytes + _padding(len(header_bytes)))
        for t in tensors:
            start = out.tell()
            write_tensor(t, out)
            if out.tell() - start != t.nbytes:
                raise RuntimeError(f"{t.name}: wrote {out.tell() - start} bytes where its type and shape need {t.nbytes}")
            out.write(_padding(t.nbytes))


class _Cursor:
    def __init__(self, f, path):
        self.f, self.path = f, path

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise QuantkitError(f"{self.path} ends inside its GGUF header: the file is truncated, copy it again")
        values = struct.unpack("<" + fmt, data)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        return self.f.read(self.take("Q")).decode("utf-8")

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            element, count = self.take("IQ")
            if element == STRING:
                return [self.string() for _ in range(count)]
            dtype = np.dtype("<" + _SCALARS[element])
            return np.frombuffer(self.f.read(count * dtype.itemsize), dtype=dtype).tolist()
        if kind not in _SCALARS:
            raise QuantkitError(f"{self.path}: metadata value type {kind} is not GGUF's: the file is damaged")
        return self.take(_SCALARS[kind])


def read_gguf(path: Path, nbytes_of) -> tuple[dict, list, int]:
    """(metadata {key: value}, [TensorInfo], offset of the data section) of a GGUF file; nbytes_of(ggml type, shape)
    gives a tensor's size (None for a type the caller does not read, which is refused by name)."""
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise QuantkitError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        cursor = _Cursor(f, path)
        version, n_tensors, n_meta = cursor.take("IQQ")
        if version not in (2, 3):
            raise QuantkitError(f"{path} is GGUF version {version}; this version of quantkit reads versions 2 and 3")
        metadata = {}
        for _ in range(n_meta):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.take("I"))
        tensors = []
        for _ in range(n_tensors):
            name = cursor.string()
            n_dims = cursor.take("I")
            dims = cursor.take(f"{n_dims}Q") if n_dims > 1 else (cursor.take("Q"),)
            kind, offset = cursor.take("IQ")
            shape = tuple(reversed(dims))
            nbytes = nbytes_of(kind, shape)
            if nbytes is None:
                raise QuantkitError(f"{path}: tensor {name} has ggml type {kind}, which quantkit does not read")
            tensors.append(TensorInfo(name, shape, kind, nbytes, offset))
        alignment = metadata.get("general.alignment", ALIGNMENT)
        data_start = f.tell() + (-f.tell() % alignment)
    return metadata, tensors, data_start
