"""Bit packing of b-bit codes into int32 words, least-significant bits first.

Along a dimension of length K, code j occupies bits [j*b, (j+1)*b) of one continuous bit stream;
word w holds bits [32w, 32w + 32). For b in {2, 4, 8} codes never straddle words (32/b codes a
word); for b = 3, 32 codes fill exactly 3 words and some codes spill across a word boundary.
K is zero-padded to a whole number of such units (`padded_len`), so the number of words is
padded_len * b / 32. When K is already aligned this is exactly the GPTQ layout.
"""
import math

import torch


def codes_per_unit(bits: int) -> int:
    """Smallest number of codes that fill whole int32 words."""
    return math.lcm(bits, 32) // bits


def padded_len(k: int, bits: int) -> int:
    """K rounded up to whole units: the codes `pack` computes before it drops the all-zero tail words."""
    unit = codes_per_unit(bits)
    return -(-k // unit) * unit


def packed_len(k: int, bits: int) -> int:
    """Words that hold k codes of `bits` bits: ceil(k * bits / 32)."""
    return -(-k * bits // 32)


CHUNK = 1 << 20  # codes packed at a time: the int64 working copies stay ~25 MB whatever the layer's size


def pack(codes: torch.Tensor, bits: int, dim: int = 0) -> torch.Tensor:
    """Pack integer codes (any int dtype, values < 2^bits) along `dim` into int32 words."""
    c = codes.movedim(dim, 0)
    if c.dim() == 2 and c.numel() > CHUNK:  # column slices are packed independently: the same words
        step = max(1, CHUNK // c.shape[0])
        words = [_pack(c[:, j:j + step], bits) for j in range(0, c.shape[1], step)]
        return torch.cat(words, dim=1).movedim(0, dim).contiguous()
    return _pack(c, bits).movedim(0, dim).contiguous()


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """pack along dim 0."""
    c = codes.to(torch.int64)
    k = c.shape[0]
    kp = padded_len(k, bits)
    if kp != k:
        c = torch.cat([c, c.new_zeros((kp - k, *c.shape[1:]))])
    bitpos = torch.arange(kp, dtype=torch.int64, device=c.device) * bits
    offset = bitpos % 32
    view = (-1,) + (1,) * (c.dim() - 1)
    if 32 % bits == 0:  # no code straddles a word: a word is the sum of its codes shifted into place (3.5x faster)
        per = 32 // bits
        words = (c.view(kp // per, per, *c.shape[1:]) << offset[:per].view(view)).sum(dim=1)
    else:
        word = bitpos // 32
        words = c.new_zeros((kp * bits // 32, *c.shape[1:]))
        words.index_add_(0, word, (c << offset.view(view)) & 0xFFFFFFFF)
        spill = (offset + bits > 32).nonzero().flatten()
        words.index_add_(0, word[spill] + 1, c[spill] >> (32 - offset[spill]).view(view))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words[:packed_len(k, bits)]  # the dropped words hold only padding


def unpack(words: torch.Tensor, bits: int, k: int, dim: int = 0) -> torch.Tensor:
    """Inverse of `pack`: int32 words along `dim` -> int32 codes, the first `k` of them."""
    if 32 % bits == 0:
        return _unpack_aligned(words, bits, k, dim)
    return unpack_stream(words, bits, k, dim)


def _unpack_aligned(words: torch.Tensor, bits: int, k: int, dim: int) -> torch.Tensor:
    """2/4/8 bits: no code straddles a word, so one broadcast shift + mask over int32 does it,
    several times faster than the general int64 bit-stream path that 3-bit needs."""
    w = words.movedim(dim, 0)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=w.device)
    codes = (w.unsqueeze(1) >> shifts.view(1, -1, *([1] * (w.dim() - 1)))) & (2**bits - 1)
    return codes.reshape(-1, *w.shape[1:])[:k].movedim(0, dim).contiguous()


def unpack_stream(words: torch.Tensor, bits: int, k: int, dim: int = 0) -> torch.Tensor:
    """`unpack` for any bit width, reading the words as one continuous bit stream (int64 math)."""
    w = words.movedim(dim, 0).to(torch.int64) & 0xFFFFFFFF
    unit_words = codes_per_unit(bits) * bits // 32
    if w.shape[0] % unit_words:  # a stream of ceil(k*b/32) words: zero words so every unit is whole
        w = torch.cat([w, w.new_zeros((unit_words - w.shape[0] % unit_words, *w.shape[1:]))])
    kp = w.shape[0] * 32 // bits
    bitpos = torch.arange(kp, dtype=torch.int64, device=w.device) * bits
    word, offset = bitpos // 32, bitpos % 32
    view = (-1,) + (1,) * (w.dim() - 1)
    mask = 2**bits - 1
    codes = w[word] >> offset.view(view)
    spill = (offset + bits > 32).nonzero().flatten()
    if len(spill):
        high = w[word[spill] + 1] << (32 - offset[spill]).view(view)
        codes[spill] = codes[spill] | high
    codes = (codes & mask)[:k].to(torch.int32)
    return codes.movedim(0, dim).contiguous()
