"""The quantized share of a checkpoint counted again from its safetensors headers alone, independently of the
share quantkit prints."""
import json
import math
import re
from pathlib import Path

from sweep.common import TOWER

BLOCK = re.compile(r"^(.*?)\.(\d+)\.(.+)$")
PACKED = ("qweight", "weight_packed", "codes")
BLOCK_LISTS = ("layers", "h", "layer", "blocks", "block")
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def safetensors_headers(folder: Path) -> dict:
    """{tensor name: (dtype, shape)} of every *.safetensors file (headers only: no tensor is read)."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        tensors.update({k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return tensors


def quantized_share(out: Path, bits: int) -> tuple:
    """(share, what stayed in float) of a checkpoint, from its files alone: elements of the packed layers (a
    prefix holding qweight/weight_packed/codes: its input features from g_idx, else int32 words x 32 / bits)
    over those plus every floating weight of two or more dims that stayed float, both inside the decoder blocks
    (_decoder_block_lists): embeddings, lm_head and vision/audio towers aside."""
    tensors = safetensors_headers(out)
    blocks = _decoder_block_lists(tensors)
    inside = {name: match.group(3) for name in tensors if (match := BLOCK.match(name)) and match.group(1) in blocks}
    packed, floats = 0, {}
    prefixes = {name.rsplit(".", 1)[0] for name in inside if name.rsplit(".", 1)[-1] in PACKED}
    for prefix in prefixes:
        word = next(f"{prefix}.{s}" for s in PACKED if f"{prefix}.{s}" in tensors)
        shape = tensors[word][1]
        g_idx = tensors.get(f"{prefix}.g_idx") or tensors.get(f"{prefix}.weight_g_idx")
        packed += g_idx[1][0] * shape[-1] if g_idx and word.endswith("qweight") else math.prod(shape) * 32 // bits
    for name, rest in inside.items():
        dtype, shape = tensors[name]
        if (dtype in FLOAT_DTYPES and len(shape) >= 2 and not name.endswith("bias")
                and name.rsplit(".", 1)[0] not in prefixes):
            kind = re.sub(r"\.\d+\.", ".N.", rest)
            floats[kind] = floats.get(kind, 0) + math.prod(shape)
    total = packed + sum(floats.values())
    kept = sorted(floats, key=floats.get, reverse=True)
    what = ", ".join(kept[:3]) + (f" (+{len(kept) - 3} more)" if len(kept) > 3 else "")
    return (packed / total if total else 0.0), (what or "nothing")


def _decoder_block_lists(tensors: dict) -> set:
    """The prefixes of the text decoder's blocks in a checkpoint's names (model.layers, transformer.h, ...): lists
    named as BLOCK_LISTS names them, outside the vision/audio towers, of the first of those names present (a
    vision tower saved as top-level `blocks.N` beside the text's `layers.N`)."""
    lists = {m.group(1) for name in tensors if (m := BLOCK.match(name)) and not TOWER.search(m.group(1))}
    for kind in BLOCK_LISTS:
        found = {p for p in lists if p.rsplit(".", 1)[-1] == kind}
        if found:
            return found
    return set()
