"""model.gguf back to transformers tensors, dequantized: what load_quantized and eval read of a GGUF checkpoint.

The inverse of quantkit.gguf.export, tensor by tensor: GGUF name -> transformers name, block types
decoded as llama.cpp decodes them (quantkit.gguf.types), F16 / BF16 / F32 as stored, q/k rows put back
in transformers' order.
"""
import math
from pathlib import Path

import torch

from quantkit.core.errors import QuantkitError
from quantkit.gguf.arch import hf_name, rotary_heads, rotary_rows
from quantkit.gguf.export import TORCH_TYPES
from quantkit.gguf.file import read_gguf
from quantkit.gguf.types import BY_GGML_TYPE


def _nbytes(ggml_type: int, shape: tuple) -> int | None:
    numel = math.prod(shape)
    if ggml_type in TORCH_TYPES:
        return numel * TORCH_TYPES[ggml_type].itemsize
    if ggml_type in BY_GGML_TYPE:
        return numel // BY_GGML_TYPE[ggml_type].block * BY_GGML_TYPE[ggml_type].block_bytes
    return None


def read_tensors(path: Path, config: dict, dtype: torch.dtype) -> dict:
    """{transformers name: tensor in `dtype`} of every tensor of a GGUF file written for `config` (config.json)."""
    _, infos, data_start = read_gguf(path, _nbytes)
    tensors = {}
    with open(path, "rb") as f:
        for info in infos:
            f.seek(data_start + info.offset)
            data = bytearray(f.read(info.nbytes))
            if len(data) != info.nbytes:
                raise QuantkitError(f"{path} ends inside tensor {info.name}: the file is truncated, copy it again")
            raw = torch.frombuffer(data, dtype=torch.uint8)
            if info.ggml_type in TORCH_TYPES:
                t = raw.view(TORCH_TYPES[info.ggml_type]).reshape(info.shape)
            else:
                t = BY_GGML_TYPE[info.ggml_type].dequantize(raw.reshape(info.shape[0], -1))
            name = hf_name(info.name)
            heads = rotary_heads(name, config)
            if heads is not None:
                t = t[rotary_rows(t.shape[0], heads, inverse=True)]
            tensors[name] = t.to(dtype)
    return tensors
