"""Triton kernel of the randomized Hadamard rotation (kernels/rotation.py): y = Pi x along the last dim, one program
per (row tile, block), the butterflies in registers. Imported only where triton runs (quantkit.kernels.rotation)."""
import math

import torch
import triton
import triton.language as tl

from quantkit.kernels.device import on_device
from quantkit.schemes.hadamard import check_block, signs_like

# BLOCK_M * B elements per program: the tile lives in registers. With the warps below, sm_90 builds
# (ptxas -v) of 4096- to 16384-element fp32 tiles use <= 143 registers a thread and never spill.
MAX_TILE = 8192


@triton.jit
def rotate_kernel(x_ptr, s_ptr, y_ptr, M, N, scale, B: tl.constexpr, LOG_B: tl.constexpr, BLOCK_M: tl.constexpr):
    """y[rows, block] = H_B diag(s[block]) x[rows, block] / sqrt(B), math in fp32."""
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_b * B + tl.arange(0, B)
    mask = (rows < M)[:, None]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]  # int64: M * N may pass 2^31
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = v * tl.load(s_ptr + cols)[None, :]
    for i in tl.static_range(LOG_B):
        # stage h = 2^i: split each group of 2h columns into halves a, b (the size-2 axis last,
        # as tl.split needs), replace them by a + b, a - b, and restore the [BLOCK_M, B] order
        v = tl.permute(tl.reshape(v, [BLOCK_M, B // (2 << i), 2, 1 << i]), [0, 1, 3, 2])
        a, b = tl.split(v)
        v = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [BLOCK_M, B])
    v = v * scale  # 1 / sqrt(B), an fp32 argument
    tl.store(y_ptr + offs, v.to(y_ptr.dtype.element_ty), mask=mask)


def rotate_triton(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """rotate(x, signs, block) with the Triton kernel; x fp16 / bf16 / fp32, any leading dims.

    CPU tensors need TRITON_INTERPRET=1 set before triton is imported."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dim")
    n = x.shape[-1]
    check_block(n, block)
    s = signs_like(signs, x).to(torch.float32).contiguous()  # fp32: multiplied into the fp32 tile
    x2 = x.reshape(-1, n).contiguous()
    m = x2.shape[0]
    y = torch.empty_like(x2)
    if m and n:
        block_m, warps = tile_for(block, m)
        grid = (triton.cdiv(m, block_m), n // block)
        with on_device(x2):
            rotate_kernel[grid](x2, s, y, m, n, 1.0 / math.sqrt(block), B=block, LOG_B=block.bit_length() - 1,
                                BLOCK_M=block_m, num_warps=warps)
    return y.reshape(x.shape)


def tile_for(block: int, m: int):
    """(BLOCK_M, warps) of a launch of Hadamard blocks of `block` over m rows: as many rows per program as fit
    MAX_TILE (fewer programs), no more than the rows there are."""
    block_m = max(1, min(MAX_TILE // block, triton.next_power_of_2(m), 64))
    tile = block_m * block
    return block_m, 4 if tile <= 4096 else 8 if tile <= 16384 else 16
