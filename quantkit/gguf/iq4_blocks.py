"""llama.cpp's IQ4_NL and IQ4_XS blocks, byte for byte (ggml-common.h): codes and parameters <-> GGUF bytes.

    IQ4_NL  d, qs[16]                                 per 32 weights: 18 bytes
    IQ4_XS  d, scales_h (u16), scales_l[4], qs[128]   per 256 weights: 136 bytes
qs: per block of 32, weight j in the low nibble of byte j and weight j + 16 in its high nibble (as Q4_0). IQ4_XS's
6-bit sub-block scales ls = sc + 32: the low nibble of sub-block j in scales_l[j / 2] (low nibble for even j), its
top two bits at bits 2j of the little-endian scales_h. Parameters as quantkit.gguf.iq4 keeps them: {"d"}
per block (IQ4_NL), {"d" repeated over the super-block, "sc"} per sub-block (IQ4_XS).
"""
import torch

from quantkit.core.errors import QuantkitError
from quantkit.gguf.iq4 import BLOCK, LEVELS
from quantkit.gguf.legacy_blocks import fp16_bytes

BYTES = {"IQ4_NL": 18, "IQ4_XS": 136}
WEIGHTS = {"IQ4_NL": 32, "IQ4_XS": 256}


def encode(name: str, codes: torch.Tensor, params: dict) -> torch.Tensor:
    rows, k = codes.shape
    per = WEIGHTS[name]
    if k % per:
        raise QuantkitError(f"{name} takes rows of whole blocks of {per} weights; this one has {k}")
    q = codes.to(torch.int32)
    if int(q.min()) < 0 or int(q.max()) > 15:
        raise QuantkitError(f"{name} codes must lie in 0..15")
    blocks = q.reshape(rows, k // per, per // BLOCK, BLOCK)
    qs = (blocks[..., :16] | blocks[..., 16:] << 4).reshape(rows, k // per, per // 2)
    d = params["d"].reshape(rows, k // per, -1)[..., 0]
    head = [fp16_bytes(d)]
    if name == "IQ4_XS":
        ls = (params["sc"].round().to(torch.int32) + 32).reshape(rows, k // per, 8)
        high = ((ls >> 4) << (2 * torch.arange(8))).sum(dim=-1)
        low = ls[..., 0::2] & 15 | (ls[..., 1::2] & 15) << 4
        head += [torch.stack([high & 255, high >> 8], dim=-1), low]
    return torch.cat([h.to(torch.uint8) for h in head] + [qs.to(torch.uint8)], dim=-1).reshape(rows, -1)


def decode(name: str, data: torch.Tensor) -> tuple[torch.Tensor, dict]:
    rows = data.shape[0]
    b = data.reshape(rows, -1, BYTES[name])
    d = b[..., :2].contiguous().view(torch.float16).squeeze(-1).float()
    qs = b[..., -WEIGHTS[name] // 2:].to(torch.int32).reshape(rows, b.shape[1], -1, 16)
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(rows, -1)
    if name == "IQ4_NL":
        return codes, {"d": d}
    high = b[..., 2].to(torch.int32) | b[..., 3].to(torch.int32) << 8
    low = b[..., 4:8].to(torch.int32)
    ls = torch.stack([low & 15, low >> 4], dim=-1).reshape(rows, -1, 8)
    ls = ls | ((high[..., None] >> (2 * torch.arange(8))) & 3) << 4
    return codes, {"d": d[..., None].expand(rows, -1, 8).reshape(rows, -1), "sc": (ls - 32).float().reshape(rows, -1)}


def dequantize(name: str, data: torch.Tensor) -> torch.Tensor:
    """float32 [rows, K] as llama.cpp decodes: (d (ls - 32)) kvalue[q], or d kvalue[q]."""
    codes, p = decode(name, data)
    step = p["d"] * p["sc"] if "sc" in p else p["d"]
    return step[:, torch.arange(codes.shape[1]) // BLOCK] * torch.tensor(LEVELS, dtype=torch.float32)[codes]
