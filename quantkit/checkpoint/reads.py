"""Reading checkpoint tensors into the process's own memory, without mapping the file.

Why not safetensors' get_tensor: its tensors are views of a memory map of the whole file, and every page a
copy or a conversion touches stays resident (RssFile) until the last view of that file is gone. Loading a
model that way costs the file's size on top of the loaded model (on Llama-3-8B shapes, the fp16 embedding and
lm_head pages alone are 2 GB). Read with plain file reads, a tensor costs its own size plus one bounded chunk
when its dtype is converted, and the page cache it passes through is the kernel's to drop.
"""
from pathlib import Path

import torch

from quantkit.checkpoint.shards import read_header
from quantkit.core.errors import QuantkitError

CHUNK_BYTES = 64 * 2**20
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
           "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
           "F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class TensorReader:
    """Reads tensors by name from a checkpoint's safetensors files ({name: file}, as files.tensor_files gives)."""

    def __init__(self, files: dict):
        self.files = files
        self.headers = {}

    def stored_dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[2]

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor in `dtype` (default: as stored), in memory of its own."""
        path, offset, stored, shape = self._entry(name)
        out = torch.empty(shape, dtype=dtype or stored)
        flat = out.view(-1)
        step = max(1, CHUNK_BYTES // stored.itemsize)
        with open(path, "rb") as f:
            f.seek(offset)
            for start in range(0, flat.numel(), step):
                part = flat[start:start + step]
                scratch = part if part.dtype == stored else torch.empty(part.numel(), dtype=stored)
                wanted = scratch.numel() * stored.itemsize
                if f.readinto(memoryview(scratch.view(torch.uint8).numpy())) != wanted:
                    raise QuantkitError(f"{path} ends inside tensor {name}: the file is truncated, copy it again or "
                                        "quantize again")
                if scratch is not part:
                    part.copy_(scratch)
        return out

    def _entry(self, name: str):
        path = Path(self.files[name])
        if path not in self.headers:
            try:
                self.headers[path] = read_header(path)
            except (OSError, ValueError, KeyError) as e:
                raise QuantkitError(f"{path} is truncated or corrupted ({e}): copy it again or quantize again") from e
        base, header = self.headers[path]
        info = header[name]
        if info["dtype"] not in _DTYPES:
            raise QuantkitError(f"{path}: tensor {name} is stored as {info['dtype']}, which quantkit does not read")
        return path, base + info["data_offsets"][0], _DTYPES[info["dtype"]], info["shape"]
