"""torch's own INT4 kernel (tinygemm, `torch.ops.aten._weight_int4pack_mm`, the one gpt-fast and torchao use)
fed the same GPTQ tensors as quantkit's kernels: the baseline scripts/bench_kernels.py times beside them.

tinygemm decodes w = (q − 8)·scale + zero per group, with `scales_and_zeros` [groups, N, 2] (bf16) and the
4-bit codes q ∈ [0, 15] repacked by `_convert_weight_to_int4pack` (CUDA: two codes per byte, the even column
in the high nibble, [N, K/2] uint8; CPU: `_for_cpu` variants, [N, K] int32). A GPTQ group decodes
w = (q − z)·s, so the same weights are zero = (8 − z)·s. Activations must be bf16; K a multiple of
inner_k_tiles · 16, N of 8, and the groups contiguous (no act-order g_idx).
"""
import torch

from quantkit.core import bitpack

INNER_K_TILES = 8  # gpt-fast's default


def from_gptq(qweight, qzeros, scales, bits, k):
    """(packed weight, scales_and_zeros) for tinygemm on qweight's device, from GPTQ-layout tensors (v1 zeros:
    the stored zero is z − 1). The group size is matmul's argument: the scales already have one row per group."""
    if bits != 4:
        raise ValueError("tinygemm serves 4-bit codes only")
    n = scales.shape[1]
    codes = bitpack.unpack(qweight, bits, k, dim=0).t().contiguous().to(torch.int32)  # [N, K]
    zero = bitpack.unpack(qzeros, bits, n, dim=1).to(torch.float32) + 1                 # [groups, N]
    scale = scales.to(torch.float32)
    scales_and_zeros = torch.stack([scale, (8 - zero) * scale], dim=2).to(torch.bfloat16).contiguous()
    if codes.is_cuda:
        nibbles = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, INNER_K_TILES)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)
    return packed, scales_and_zeros


def matmul(x, packed, scales_and_zeros, group_size):
    """x [M, K] (bf16) @ Wᵀ -> [M, N] bf16."""
    mm = torch.ops.aten._weight_int4pack_mm if x.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
    return mm(x, packed, group_size, scales_and_zeros)
