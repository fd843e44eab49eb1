"""llama.cpp's IQ2_XXS and IQ3_XXS blocks, byte for byte (ggml-common.h): codes and parameters <-> GGUF bytes.

    IQ2_XXS  d, then per sub-block of 32: 4 point indices (one byte per 8 weights), then its word    66 bytes / 256
    IQ3_XXS  d, 64 point indices (one byte per 4 weights), then the 8 sub-blocks' words             98 bytes / 256
A sub-block's word is a little-endian uint32: the 7 sign bits of its k-th 8 weights at bit 7 k (bit j: weight j is
negative; weight 7's sign makes the count even), its 4-bit scale l at bits 28..31. Codes and parameters as
quantkit.gguf.iq_lattice keeps them: per weight its level | sign << level bits; {"d" repeated over the
super-block, "sc" = l} per sub-block.
"""
from functools import cache

import torch

from quantkit.core.errors import QuantkitError
from quantkit.gguf.iq_grids import DIMS, WORDS
from quantkit.gguf.iq_lattice import BLOCK, IQ2XXS, IQ3XXS, UNIT, level_bits, step_of, tables, values
from quantkit.gguf.kquants import SUPER
from quantkit.gguf.legacy_blocks import fp16_bytes, le_bytes, le_words

BYTES = {q.ggml_type: q.block_bytes for q in (IQ2XXS, IQ3XXS)}
SUBS = SUPER // BLOCK


@cache
def _index_of_word(kind: str) -> torch.Tensor:
    """Point index of each word of level indices (-1 off the list)."""
    table = torch.full((1 << (level_bits(kind) * DIMS[kind]),), -1, dtype=torch.int64)
    table[torch.tensor(WORDS[kind])] = torch.arange(len(WORDS[kind]))
    return table


def encode(name: str, codes: torch.Tensor, params: dict) -> torch.Tensor:
    rows, k = codes.shape
    if k % SUPER:
        raise QuantkitError(f"{name} takes rows of whole super-blocks of {SUPER} weights; this one has {k}")
    bits, dims = level_bits(name), DIMS[name]
    q = codes.to(torch.int64).reshape(rows, k // SUPER, SUBS, BLOCK // UNIT, UNIT // dims, dims)
    level, negative = q & ((1 << bits) - 1), (q >> bits) & 1
    index = _index_of_word(name)[(level << (bits * torch.arange(dims))).sum(dim=-1)]
    if int(index.min()) < 0 or int(q.max()) >= 2 << bits:
        raise QuantkitError(f"{name} codes must be levels of a point of its list, with a sign bit")
    negative = negative.reshape(rows, k // SUPER, SUBS, BLOCK // UNIT, UNIT)
    if (negative.sum(dim=-1) % 2).any():
        raise QuantkitError(f"{name} stores an even number of minus signs per 8 weights; these codes have an odd one")
    signs = (negative[..., :7] << torch.arange(7)).sum(dim=-1)                     # [rows, supers, 8, 4]
    sc = params["sc"].round().to(torch.int64).reshape(rows, k // SUPER, SUBS)
    word = (signs << (7 * torch.arange(4))).sum(dim=-1) | sc << 28
    d = fp16_bytes(params["d"].reshape(rows, k // SUPER, SUBS)[..., 0])
    index = index.reshape(rows, k // SUPER, SUBS, -1).to(torch.uint8)
    if name == "IQ2_XXS":
        body = torch.cat([index, le_bytes(word)], dim=-1).reshape(rows, k // SUPER, -1)
    else:
        body = torch.cat([index.reshape(rows, k // SUPER, -1), le_bytes(word).reshape(rows, k // SUPER, -1)], dim=-1)
    return torch.cat([d, body], dim=-1).reshape(rows, -1)


def decode(name: str, data: torch.Tensor) -> tuple[torch.Tensor, dict]:
    rows = data.shape[0]
    b = data.reshape(rows, -1, BYTES[name])
    supers = b.shape[1]
    d = b[..., :2].contiguous().view(torch.float16).squeeze(-1).float()
    if name == "IQ2_XXS":
        body = b[..., 2:].reshape(rows, supers, SUBS, 8)
        index, word = body[..., :4].to(torch.int64), le_words(body[..., 4:])[..., 0]
    else:
        index = b[..., 2:66].to(torch.int64).reshape(rows, supers, SUBS, 8)
        word = le_words(b[..., 66:])
    bits = level_bits(name)
    _, _, levels = tables(name)
    level = levels[index].reshape(rows, supers, SUBS, 4, UNIT)
    signs = (word[..., None] >> (7 * torch.arange(4))) & 127                       # [rows, supers, 8, 4]
    negative = (signs[..., None] >> torch.arange(7)) & 1
    negative = torch.cat([negative, negative.sum(dim=-1, keepdim=True) % 2], dim=-1)
    codes = (level | negative << bits).reshape(rows, -1).to(torch.int32)
    sc = (word >> 28).float().reshape(rows, -1)
    return codes, {"d": d[..., None].expand(rows, supers, SUBS).reshape(rows, -1), "sc": sc}


def dequantize(name: str, data: torch.Tensor) -> torch.Tensor:
    """float32 [rows, K] as llama.cpp decodes: d (0.5 + l) / 4 (IQ2_XXS; / 2 for IQ3_XXS) x sign x magnitude."""
    codes, p = decode(name, data)
    return step_of(p, name)[:, torch.arange(codes.shape[1]) // BLOCK] * values(codes, name)
