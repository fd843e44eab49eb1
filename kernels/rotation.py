"""Randomized Hadamard rotation along the last dim: Pi = blockdiag(H_b) . diag(signs).

Rotating activations (and, offline, the weights by the same Pi) spreads outliers over a whole block
before quantization; Pi is orthogonal, so W x = (W Pi^T)(Pi x) is unchanged in exact arithmetic.
H_b is the Sylvester Hadamard matrix (H_1 = [1], H_2k = [[H, H], [H, -H]]) scaled by 1/sqrt(b):
orthonormal and its own inverse. b is the largest power of two dividing the width, so
any width works (576 = 9 x 64 -> blocks of 64). Both implementations use the fast Walsh-Hadamard
transform (log2(b) butterfly stages, O(n log b)), never a dense matrix:
  torch  -> fwht / rotate / unrotate (quantkit.schemes.hadamard): the reference, any device and shape.
  triton -> rotate_triton: one program per (row tile, block), the butterflies in registers.
rotate_activations is what a quantized layer calls; its backend choice mirrors dispatch.py.
"""
import math
import os

import torch

from quantkit.kernels.device import on_device
from quantkit.schemes.hadamard import check_block, rotate, signs_like

try:  # the module must import where triton does not (CPU-only installs)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - platform without triton
    triton = None

BACKENDS = ("auto", "triton", "torch")
# BLOCK_M * B elements per program: the tile lives in registers. With the warps below, sm_90 builds
# (ptxas -v) of 4096- to 16384-element fp32 tiles use <= 143 registers a thread and never spill.
MAX_TILE = 8192


if triton is not None:
    @triton.jit
    def _rotate_kernel(x_ptr, s_ptr, y_ptr, M, N, scale, B: tl.constexpr, LOG_B: tl.constexpr, BLOCK_M: tl.constexpr):
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
    if triton is None:
        raise RuntimeError("rotate_triton needs triton")
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
        # rows per program: as many as fit MAX_TILE (fewer programs), no more than the rows there are
        block_m = max(1, min(MAX_TILE // block, triton.next_power_of_2(m), 64))
        tile = block_m * block
        warps = 4 if tile <= 4096 else 8 if tile <= 16384 else 16
        grid = (triton.cdiv(m, block_m), n // block)
        with on_device(x2):
            _rotate_kernel[grid](x2, s, y, m, n, 1.0 / math.sqrt(block), B=block, LOG_B=block.bit_length() - 1,
                                 BLOCK_M=block_m, num_warps=warps)
    return y.reshape(x.shape)


def rotate_activations(x: torch.Tensor, signs: torch.Tensor, block: int, backend: str = "auto") -> torch.Tensor:
    """Pi x for a quantized layer's forward. backend: "auto" (Triton for CUDA fp16/bf16/fp32 x when
    triton imports, else torch), "triton" (always; CPU needs TRITON_INTERPRET=1), "torch"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton backend on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    if backend == "auto":
        fits = x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        backend = "triton" if fits and triton is not None else "torch"
    if backend == "triton":
        return rotate_triton(x, signs, block)
    return rotate(x, signs, block)
