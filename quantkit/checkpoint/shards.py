"""Streaming checkpoint writer: finished blocks go to small part files, shards are assembled by copying bytes.

Why parts first and shards at the end: a safetensors file starts with a header listing every tensor's offset,
and the shard names carry the shard count ("-of-00004"), so neither can be written before the last block is
known. Each finished block is saved at once as `part-NNNNN.safetensors` in the staging folder (that is also
what --resume reads back); `assemble` then plans the shards over the tensors in checkpoint order (non-quantized
tensors in state-dict order, then the packed layers in block order: quantkit.run.block_writer), so a streamed
checkpoint is byte-identical to one written from a full state dict, and copies each tensor's bytes from its
part file in chunks: memory stays at one chunk whatever the model size.

The header is written here, not by safetensors, because the file is written piecewise; `header_bytes`
reproduces safetensors' own serialization (tested byte for byte against save_file for every dtype).
"""
import json
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from quantkit.core.folders import INDEX_NAME, SINGLE_NAME

PART_PREFIX = "part-"
RESUME_PREFIX = "resume::"  # tensors kept in a part only to rebuild the block on --resume, never in the checkpoint
CHUNK = 64 * 2**20

# safetensors' Dtype enum order (safetensors/src/tensor.rs); files list tensors by this order descending, then name.
_DTYPE_ORDER = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16",
                "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"]
_NAMES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}
# What a header's dtype reads as (quantkit.checkpoint.reads): the names above, and those other writers use.
DTYPES = {name: dtype for dtype, name in _NAMES.items()} | {
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2}


def part_name(key: str) -> str:
    return f"{PART_PREFIX}{key}.safetensors"


def save_part(folder: Path, key: str, tensors: dict, info: dict | None = None) -> None:
    """One finished piece (a block: key "block-00007"), written under a temporary name and renamed, so a part
    that exists is whole. info (JSON) goes into the file's metadata: the packed layers' order and report."""
    path = folder / part_name(key)
    tmp = path.with_suffix(".partial")
    write_file(tmp, {k: v.detach().cpu() for k, v in tensors.items()},
               {"format": "pt", "quantkit": json.dumps(info or {})})
    os.replace(tmp, path)


def write_file(path: Path, tensors: dict, metadata: dict) -> None:
    """A safetensors file, as safetensors' save_file writes it (header_bytes), each tensor's bytes written straight
    from its memory: save_file would first build the whole file in memory (an embedding's size, again)."""
    entries = [(n, dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size()) for n, t in tensors.items()]
    head, order = header_bytes(entries, metadata)
    with open(path, "wb") as out:
        out.write(head)
        for name, *_ in order:
            t = tensors[name].contiguous()
            if t.numel():
                out.write(memoryview(t.view(-1).view(torch.uint8).numpy()))


def part_info(folder: Path, key: str) -> dict:
    with safe_open(folder / part_name(key), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("quantkit", "{}"))


def damaged_part(path: Path) -> str | None:
    """Why a part file is not whole (None when it is): a header that does not parse, or a size other than the one
    its header declares (a crash or a full disk between writing and the rename leaves no part, but a copy or a
    failing disk can)."""
    try:
        base, header = read_header(path)
        end = max((int(info["data_offsets"][1]) for info in header.values()), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        return f"its header cannot be read: {e}"
    size = path.stat().st_size
    return None if size == base + end else f"it holds {size} bytes where its header declares {base + end}"


def part_keys(folder: Path) -> list[str]:
    return sorted(p.name[len(PART_PREFIX):-len(".safetensors")] for p in folder.glob(f"{PART_PREFIX}*.safetensors"))


def read_header(path: Path) -> tuple[int, dict]:
    """(offset of the data, {name: {"dtype", "shape", "data_offsets"}}) of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def header_bytes(entries: list[tuple[str, str, list]], metadata: dict) -> tuple[bytes, list]:
    """(8-byte length + JSON header padded to 8 bytes, entries in file order) as safetensors writes them."""
    order = sorted(entries, key=lambda e: (-_DTYPE_ORDER.index(e[1]), e[0]))
    head, offset = {"__metadata__": metadata}, 0
    for name, dtype, shape, nbytes in order:
        head[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


class Parts:
    """Where each checkpoint tensor sits in the part files: name -> (file, data offset, dtype, shape, nbytes)."""

    def __init__(self, folder: Path):
        self.where = {}
        for key in part_keys(folder):
            path = folder / part_name(key)
            base, header = read_header(path)
            for name, info in header.items():
                if name.startswith(RESUME_PREFIX):
                    continue
                start, end = info["data_offsets"]
                self.where[name] = (path, base + start, info["dtype"], info["shape"], end - start)

    def nbytes(self, name: str) -> int:
        return self.where[name][4]


def plan(order: list[str], nbytes, max_shard_bytes: int) -> list[list[str]]:
    """The tensors in `order` cut into consecutive shards of at most max_shard_bytes (nbytes(name) -> size; a tensor
    larger than that gets a shard of its own): the one plan of assemble and quantkit.checkpoint.files.write_tensors,
    so a streamed checkpoint and one written from memory are cut the same way."""
    shards, current, size = [], [], 0
    for name in order:
        n = nbytes(name)
        if current and size + n > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """model.safetensors alone, else model-0000i-of-0000N.safetensors (what transformers writes and reads)."""
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_index(folder: Path, planned: list[list[str]], nbytes, rename=str) -> None:
    """model.safetensors.index.json of a sharded checkpoint (nothing for one shard): each tensor under
    rename(name), in the plan's order, and their total size."""
    if len(planned) == 1:
        return
    weight_map, total = {}, 0
    for fname, shard in zip(shard_names(len(planned)), planned):
        for tensor in shard:
            weight_map[rename(tensor)] = fname
            total += nbytes(tensor)
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2))


def assemble(folder: Path, order: list[str], max_shard_bytes: int, rename=str) -> None:
    """The checkpoint's shards (and index) from the part files, tensors planned in `order` and written under
    rename(tensor) (quantkit.models.names: the parts hold the model's names). The parts stay (a run killed while
    copying can be resumed): delete them with delete_parts."""
    parts = Parts(folder)
    missing = [n for n in order if n not in parts.where]
    if missing:
        raise RuntimeError(f"part files lack {missing[:3]}: the streamed run is inconsistent")
    planned = plan(order, parts.nbytes, max_shard_bytes)
    for fname, shard in zip(shard_names(len(planned)), planned):
        _copy_shard(folder / fname, shard, parts, rename)
    write_index(folder, planned, parts.nbytes, rename)


def delete_parts(folder: Path) -> None:
    for key in part_keys(folder):
        (folder / part_name(key)).unlink()


def _copy_shard(path: Path, names: list[str], parts: Parts, rename) -> None:
    entries = [(rename(n), *parts.where[n][2:5]) for n in names]
    head, order = header_bytes(entries, {"format": "pt"})
    in_parts = {rename(n): n for n in names}
    with open(path, "wb") as out:
        out.write(head)
        for stored, *_ in order:
            src, offset, _, _, nbytes = parts.where[in_parts[stored]]
            with open(src, "rb") as f:
                f.seek(offset)
                while nbytes:
                    chunk = f.read(min(CHUNK, nbytes))
                    out.write(chunk)
                    nbytes -= len(chunk)


def read_part(folder: Path, key: str, prefix: str = "") -> dict:
    """The tensors of one part whose names start with `prefix` (all: checkpoint and resume tensors)."""
    with safe_open(folder / part_name(key), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES[dtype]

