"""Reading checkpoint tensors into the process's own memory, without mapping the file.

Why not safetensors' get_tensor: its tensors are views of a memory map of the whole file, and every page a
copy or a conversion touches stays resident (RssFile) until the last view of that file is gone. Loading a
model that way costs the file's size on top of the loaded model (on Llama-3-8B shapes, the fp16 embedding and
lm_head pages alone are 2 GB). Read with plain file reads, a tensor costs its own size plus one bounded chunk
when its dtype is converted, and the page cache it passes through is the kernel's to drop.
"""
import mmap
from pathlib import Path

import torch

from quantkit.checkpoint.shards import DTYPES, read_header
from quantkit.core.errors import QuantkitError

CHUNK_BYTES = 16 * 2**20  # a float16 SmolLM2 embedding (57 MB) loaded in bfloat16 was one 64 MB chunk: +57 MB of peak


class TensorReader:
    """Reads tensors by name from safetensors files (a checkpoint's shards; every header is read once, here)."""

    def __init__(self, paths):
        self.where = {}  # name -> (path, offset of its bytes, header entry)
        for path in map(Path, paths):
            try:
                base, header = read_header(path)
            except (OSError, ValueError, KeyError) as e:
                raise QuantkitError(f"{path} is truncated or corrupted ({e}): copy it again or quantize again") from e
            self.where.update({name: (path, base + info["data_offsets"][0], info) for name, info in header.items()})

    def map(self, name: str) -> torch.Tensor:
        """The tensor as stored, a private (copy-on-write) memory map of its own bytes alone: of its pages only those a
        use reads become resident, and none of another mapping's (safetensors' map of the whole file, which validation
        read through, keeps the pages around every tensor it touched resident while any view of it lives: 16 MB on
        SmolLM2). The map is unmapped with the last tensor that uses it."""
        path, offset, info, stored = self._entry(name)
        nbytes = info["data_offsets"][1] - info["data_offsets"][0]
        if nbytes == 0:
            return torch.empty(info["shape"], dtype=stored)
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        with open(path, "rb") as f:
            pages = mmap.mmap(f.fileno(), offset - start + nbytes, access=mmap.ACCESS_COPY, offset=start)
        data = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes, offset=offset - start)  # keeps `pages` alive
        return data.view(stored).view(info["shape"])

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor in `dtype` (default: as stored), in memory of its own."""
        path, offset, info, stored = self._entry(name)
        out = torch.empty(info["shape"], dtype=dtype or stored)
        step = max(1, CHUNK_BYTES // stored.itemsize)
        with open(path, "rb") as f:
            f.seek(offset)
            for start in range(0, out.numel(), step):
                part = out.view(-1)[start:start + step]
                scratch = part if part.dtype == stored else torch.empty(part.numel(), dtype=stored)
                wanted = scratch.numel() * stored.itemsize
                if f.readinto(memoryview(scratch.view(torch.uint8).numpy())) != wanted:
                    raise QuantkitError(f"{path} ends inside tensor {name}: the file is truncated, copy it again or "
                                        "quantize again")
                if scratch is not part:
                    part.copy_(scratch)
        return out

    def _entry(self, name: str):
        """(file, offset of its bytes, header entry, stored dtype) of a tensor quantkit reads."""
        path, offset, info = self.where[name]
        if info["dtype"] not in DTYPES:
            raise QuantkitError(f"{path}: tensor {name} is stored as {info['dtype']}, which quantkit does not read")
        return path, offset, info, DTYPES[info["dtype"]]
