"""torch's CPU int4 GEMM (the kernel torchao's int4 weight-only CPU path calls), and decoding its packed layout.

The op: `aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)` computes x Wᵀ with
W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n] for 4-bit codes q that `aten._convert_weight_to_int4pack_for_cpu`
packed from an int32 [N, K] tensor into uint8 [N, K/2]; scales_and_zeros is [K/group, N, 2] in x's dtype. Its limits,
measured (torch 2.13): N % 16 == 0, K % group_size == 0, group_size in {32, 64, 128, 256}. The op's group needs not be
the checkpoint's: it is the largest of those sizes that divides both the checkpoint's group and K (`kernel_group`),
each stored group's scale spread over the op's groups it spans. So a layer whose last group is short (SmolLM2's 576
inputs at group 128) runs in groups of 64 and one group per row in groups of 256, unpadded. Only where K is no
multiple of 32 are the codes padded with zeros up to whole groups, and x with zeros to match, so the padding
multiplies nothing. Its precision is bf16's:
on a CPU with AVX512-BF16 the decoded weight is rounded to bf16 before the dot products, even for float32 x (which
also takes a slow fallback: 0.08x a dense float32 GEMM at M = 1), so it serves bf16 activations only.

The packed layout depends on the CPU the process dispatches to (ATen's CPU capability): the outputs go in blocks of
BLOCK_N (64 under AVX-512, 32 otherwise), each stored k-major as K rows of (block width)/2 bytes; inside a row, byte j
holds either outputs j and j + width/2 (low and high nibble: "halves", AVX-512 and AVX2) or 2j and 2j + 1 ("pairs",
other CPUs and the narrower last block under AVX-512). Both facts are read off the op on small probes (`_block_n`,
`_split`), not assumed, and `pack` checks that the decode inverts what it packed: a torch that changed the layout is
refused at load time (the layer then keeps the GPTQ layout) instead of decoding garbage.
"""
from functools import cache
from typing import Optional

import torch

from quantkit.core import strips
from quantkit.core.groups import row_groups

GROUP_SIZES = (32, 64, 128, 256)
N_MULTIPLE = 16
# bf16 rows up to which the op runs: at 128 rows it was 0.70-0.97x the strip decode's time on every SmolLM2 and
# Llama-3-8B shape (scripts/bench_cpu_int4.py, 2-core AMD EPYC with AVX-512), 0.92-1.25x at 192; and it holds no
# decoded strip, so a prefill of up to 128 tokens leaves no freed strips in the heap (SmolLM2's prefill
# grew the heap by 13 MB instead of 24 in a probe)
INT4_MM_MAX_M = 128
PLANE_BITS = 4
# float32 2^23 + c has the bits 0x4B000000 | c for 0 <= c < 2^23: writing a code into the low byte of that word gives
# the float of 2^23 + code with no int -> float conversion (which costs several times the other steps on the CPU)
MAGIC, MAGIC_FLOAT = 0x4B000000, 8388608.0


def _convert(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 bytes -> their nibbles, low first: [..., B] -> [..., 2B]."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


@cache
def _block_n() -> int:
    """Outputs per block: the position of the first nibble of k = 1 in a probe whose codes are k."""
    probe = torch.arange(2).repeat(256, 1)  # [256, 2]: code k
    return int(_nibbles(_convert(probe).flatten()).nonzero()[0])


@cache
def _split(width: int) -> str:
    """How one k-row of a block of `width` outputs splits into nibbles: 'halves', 'pairs' or '' (unknown: decoded as
    pairs, which the check in `pack` then refuses)."""
    n = torch.arange(width).unsqueeze(1).expand(width, 2)  # codes that name their output, 4 bits at a time
    low, high = (_nibbles(_convert(part).flatten())[:width] for part in (n % 16, n // 16))
    holds = (low + 16 * high).view(-1, 2)  # [byte, nibble] -> the output it holds
    byte = torch.arange(width // 2)
    if torch.equal(holds, torch.stack([byte, byte + width // 2], dim=1)):
        return "halves"
    return "pairs" if torch.equal(holds, torch.stack([2 * byte, 2 * byte + 1], dim=1)) else ""


def kernel_group(in_features: int, group_size: int) -> Optional[int]:
    """The op's group size for a layer of `group_size`-wide groups: the largest it takes that divides both (every op
    group then lies in one stored group, and no input is padded); else the group size itself (the inputs padded up
    to whole groups); None when the op takes neither."""
    whole = [size for size in GROUP_SIZES if group_size % size == 0 and in_features % size == 0]
    return max(whole) if whole else (group_size if group_size in GROUP_SIZES else None)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """int [N, K] codes in 0..15 -> the op's uint8 [N, K/2]; RuntimeError when the decode would not give them back."""
    packed = _convert(codes)
    if not torch.equal(stored_codes(packed.unsqueeze(0), 0, codes.shape[0]), codes.t().to(torch.uint8)):
        raise RuntimeError("this torch packs int4 weights in a layout quantkit does not know")
    return packed


def blocks(out_features: int, strip: int):
    """(a, b) output ranges covering all outputs, edges on block edges, about `strip` outputs each."""
    block = _block_n()
    return strips.spans(out_features, max(block, strip // block * block))


def _runs(out_features: int, a: int, b: int):
    """(start, stop, width): the outputs a..b as runs of whole blocks of one width (the last block may be narrower)."""
    block = _block_n()
    if a % block or (b % block and b != out_features):
        raise ValueError(f"outputs {a}..{b} do not start and end on blocks of {block}")
    full = min(b, out_features // block * block)
    runs = [(a, full, block)] if full > a else []
    return runs + ([(full, b, b - full)] if b > full else [])


def stored_codes(planes, a: int, b: int) -> torch.Tensor:
    """The codes of outputs a..b as uint8 [K, b - a] (q = Σ 16^p plane_p; a, b on block edges)."""
    codes = torch.empty(2 * planes.shape[2], b - a, dtype=torch.uint8)
    _fill_codes(codes, planes, a, b)
    return codes


def decode_columns(planes, scales, zeros, group_size: int, a: int, b: int) -> torch.Tensor:
    """Wᵀ[:, a:b] as float32 [K, b - a], exactly scale * (q - zero) with q = Σ 16^p plane_p (a, b on block edges;
    the last of the groups of `group_size` rows may be shorter)."""
    k = 2 * planes.shape[2]
    words = torch.full((k, b - a), MAGIC, dtype=torch.int32)
    _fill_codes(words.view(torch.uint8).view(k, b - a, 4)[..., 0], planes, a, b)
    w_t = words.view(torch.float32)
    for grouped, groups in row_groups(w_t, group_size):
        grouped.sub_(zeros[groups, a:b].float().add_(MAGIC_FLOAT).unsqueeze(1))
        grouped.mul_(scales[groups, a:b].float().unsqueeze(1))
    return w_t


def _fill_codes(dst, planes, a: int, b: int) -> None:
    """The codes of outputs a..b into dst [K, b - a] (uint8, or a strided view of one byte per word)."""
    n_all, k = planes.shape[1], 2 * planes.shape[2]
    for start, stop, width in _runs(n_all, a, b):
        blocks_dst = dst[:, start - a:stop - a].unflatten(1, ((stop - start) // width, width)).transpose(0, 1)
        src = [plane.view(-1)[start * k // 2:stop * k // 2].view(-1, k, width // 2) for plane in planes]
        _write_codes(blocks_dst, src, _split(width))


def _write_codes(dst, src, split: str) -> None:
    """Each output's code (low plane | high plane << 4) into dst [blocks, K, width] from the planes' bytes."""
    halves = dst.unflatten(-1, (2, -1) if split == "halves" else (-1, 2))
    first, second = (halves[..., 0, :], halves[..., 1, :]) if split == "halves" else (halves[..., 0], halves[..., 1])
    torch.bitwise_and(src[0], 15, out=first)
    torch.bitwise_right_shift(src[0], 4, out=second)
    if len(src) > 1:  # 8-bit codes: the high plane's nibbles go to bits 4..7
        first.bitwise_or_(src[1] << 4)
        second.bitwise_or_(src[1] & 0xF0)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16) @ Wᵀ -> [M, N] in x's dtype."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


def kernel_scales(scales, zeros, planes, in_features: int, group_size: int) -> torch.Tensor:
    """The op's [P, K'/g', N, 2] bf16 (scale, offset) per plane and op group (g' = kernel_group: each stored group's
    row repeated for the op groups it spans): plane p weighs 16^p, and with z = Σ 16^p z_p,
    scale_p (q_p - z_p) = (q_p - 8) scale_p + offset_p."""
    op_group = kernel_group(in_features, group_size)
    rows = torch.arange(2 * planes.shape[2] // op_group) * op_group // group_size  # each op group's stored group
    s, z = scales.float()[rows], zeros.to(torch.int32)[rows]
    parts = []
    for p in range(len(planes)):
        scale = s * 16**p
        parts.append(torch.stack([scale, scale * (8 - (z >> (PLANE_BITS * p) & 15))], dim=-1))
    return torch.stack(parts).to(torch.bfloat16)


def linear(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           kernel_scales: torch.Tensor, group_size: int, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., K] Wᵀ (+ bias): the op for bf16 x of at most INT4_MM_MAX_M rows, else the exact strip-wise decode.
    The planes may hold more inputs than x (zero codes up to whole groups); kernel_scales are per op group, scales
    and zeros per stored group of `group_size` inputs. A decode step calls this ~200 times per
    token on a small model, so its Python is kept to the few calls the op needs."""
    k, n, padded = x.shape[-1], planes.shape[1], 2 * planes.shape[2]
    x2 = x.reshape(-1, k)
    if x.dtype == torch.bfloat16 and 0 < x2.shape[0] <= INT4_MM_MAX_M:
        if padded > k:
            x2 = torch.nn.functional.pad(x2, (0, padded - k))
        x2, op_group = x2.contiguous(), padded // kernel_scales.shape[1]
        y = int4_mm(x2, planes[0], op_group, kernel_scales[0])
        if planes.shape[0] > 1:  # 8-bit codes: the high plane's product too, summed in float32
            y = (y.float() + int4_mm(x2, planes[1], op_group, kernel_scales[1]).float()).to(x.dtype)
        y = y.view(*x.shape[:-1], n)
        return y + bias.to(y.dtype) if bias is not None else y

    def decode(a, b):
        return decode_columns(planes, scales, zeros, group_size, a, b)[:k]  # a prefix of rows: still contiguous
    return strips.strip_linear(x, decode, blocks(n, strips.strip_rows(k, align=1)), bias)


@torch.library.custom_op("quantkit::cpu_int4_linear", mutates_args=())
def int4_linear(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                kernel_scales: torch.Tensor, group_size: int, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """`linear` as one opaque custom op, so torch.compile traces a model of these layers in one graph (eager code
    calls `linear` itself: the custom op's dispatch costs ~10 us a call, a fifth of a small layer's)."""
    return linear(x, planes, scales, zeros, kernel_scales, group_size, bias)


@int4_linear.register_fake
def _int4_linear_fake(x, planes, scales, zeros, kernel_scales, group_size, bias):
    return x.new_empty((*x.shape[:-1], planes.shape[1]))
