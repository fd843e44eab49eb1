"""llama.cpp's legacy block types, byte for byte (ggml-common.h): codes and per-block parameters <-> GGUF bytes.

Each block covers 32 consecutive weights of a row and starts with its fp16 scale d (and, for the "_1" types, its
fp16 minimum m); the codes follow:
    Q4_0  d, qs[16]            w = d (q - 8)     q in 0..15
    Q4_1  d, m, qs[16]         w = d q + m       q in 0..15
    Q5_0  d, qh[4], qs[16]     w = d (q - 16)    q in 0..31
    Q5_1  d, m, qh[4], qs[16]  w = d q + m       q in 0..31
    Q8_0  d, qs[32] (int8)     w = d (q - 128)   q in 0..255, stored as the signed q - 128
qs packs two 4-bit codes a byte: weight j in the low nibble of byte j, weight j + 16 in its high nibble. qh is a
little-endian uint32 whose bit j is bit 4 of weight j's code.

Codes here are unsigned (0 .. 2^bits - 1) with the type's `offset` as zero point, as quantkit's symmetric integer
grid holds them: a symmetric 4-bit group of 32 with an fp16 scale is a Q4_0 block as it is, an 8-bit one a Q8_0
block. Which codes and scales to choose is the quantizer's business; this module only lays them out.
"""
from dataclasses import dataclass

import torch

from quantkit.core.errors import QuantkitError

BLOCK = 32


@dataclass(frozen=True)
class BlockType:
    name: str
    ggml_type: int     # GGMLQuantizationType's value, as GGUF files store it
    bits: int
    offset: int        # the code of zero (0 for the types with a minimum)
    has_min: bool

    @property
    def block_bytes(self) -> int:
        codes = BLOCK if self.bits == 8 else BLOCK // 2  # a byte a code, or two 4-bit codes a byte
        return 2 * (1 + self.has_min) + (4 if self.bits == 5 else 0) + codes


TYPES = {t.name: t for t in (BlockType("Q4_0", 2, 4, 8, False), BlockType("Q4_1", 3, 4, 0, True),
                             BlockType("Q5_0", 6, 5, 16, False), BlockType("Q5_1", 7, 5, 0, True),
                             BlockType("Q8_0", 8, 8, 128, False))}


def encode(kind: BlockType, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [rows, K / 32 * block_bytes] from codes [rows, K] (0 .. 2^bits - 1), d and m [rows, K / 32]."""
    rows, k = codes.shape
    if k % BLOCK:
        raise QuantkitError(f"{kind.name} takes rows of whole blocks of {BLOCK} weights; this one has {k}")
    if (m is not None) != kind.has_min:
        raise QuantkitError(f"{kind.name} {'needs' if kind.has_min else 'has no'} per-block minimum")
    q = codes.to(torch.int32).reshape(rows, k // BLOCK, BLOCK)
    if int(q.min()) < 0 or int(q.max()) >= 2**kind.bits:
        raise QuantkitError(f"{kind.name} codes must lie in 0..{2**kind.bits - 1}")
    parts = [fp16_bytes(d)] + ([fp16_bytes(m)] if kind.has_min else [])
    if kind.bits == 8:
        parts.append((q - 128).to(torch.int8).view(torch.uint8))
    else:
        if kind.bits == 5:
            high = ((q >> 4) & 1) << torch.arange(BLOCK, dtype=torch.int32)
            word = high.sum(dim=-1, dtype=torch.int64)  # bit j: bit 4 of code j
            parts.append(le_bytes(word))
        low = q & 15
        parts.append((low[..., :BLOCK // 2] | low[..., BLOCK // 2:] << 4).to(torch.uint8))
    return torch.cat(parts, dim=-1).reshape(rows, -1)


def decode(kind: BlockType, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes [rows, K] int32, d [rows, K / 32] fp16, m or None) from the bytes encode writes."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, kind.block_bytes)
    d = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1)
    at = 2
    m = None
    if kind.has_min:
        m, at = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1), 4
    if kind.bits == 8:
        codes = blocks[..., at:].contiguous().view(torch.int8).to(torch.int32) + 128
        return codes.reshape(rows, -1), d, m
    high = None
    if kind.bits == 5:
        word = le_words(blocks[..., at:at + 4])[..., 0]
        high = ((word.unsqueeze(-1) >> torch.arange(BLOCK)) & 1).to(torch.int32) << 4
        at += 4
    qs = blocks[..., at:].to(torch.int32)
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)
    if high is not None:
        codes = codes | high
    return codes.reshape(rows, -1), d, m


def dequantize(kind: BlockType, data: torch.Tensor) -> torch.Tensor:
    """float32 [rows, K]: w = d (q - offset) (+ m), as llama.cpp decodes."""
    codes, d, m = decode(kind, data)
    rows = codes.shape[0]
    w = (codes.reshape(rows, -1, BLOCK) - kind.offset).float() * d.float().unsqueeze(-1)
    if m is not None:
        w = w + m.float().unsqueeze(-1)
    return w.reshape(rows, -1)


def le_bytes(word: torch.Tensor) -> torch.Tensor:
    """int64 [...] -> uint8 [..., 4]: each value's low 32 bits, little-endian (a uint32 field of a block)."""
    return torch.stack([(word >> (8 * i)) & 255 for i in range(4)], dim=-1).to(torch.uint8)


def le_words(data: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4 n] -> int64 [..., n]: the little-endian uint32s le_bytes writes."""
    b = data.to(torch.int64).reshape(*data.shape[:-1], -1, 4)
    return b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24


def fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[rows, blocks] -> uint8 [rows, blocks, 2]: each value's fp16 bytes, little-endian as GGUF stores them."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)
