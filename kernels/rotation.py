"""Randomized Hadamard rotation along the last dim: Pi = blockdiag(H_b) . diag(signs).

Rotating activations (and, offline, the weights by the same Pi) spreads outliers over a whole block
before quantization; Pi is orthogonal, so W x = (W Pi^T)(Pi x) is unchanged in exact arithmetic.
H_b is the Sylvester Hadamard matrix (H_1 = [1], H_2k = [[H, H], [H, -H]]) scaled by 1/sqrt(b):
orthonormal and its own inverse. b is the largest power of two dividing the width, so
any width works (576 = 9 x 64 -> blocks of 64). Both implementations use the fast Walsh-Hadamard
transform (log2(b) butterfly stages, O(n log b)), never a dense matrix:
  torch  -> fwht / rotate / unrotate (quantkit.schemes.hadamard): the reference, any device and shape.
  triton -> triton_rotation.rotate_triton: one program per (row tile, block), the butterflies in registers.
rotate_activations is what a quantized layer calls; its backend choice mirrors dispatch.py, and the Triton call is
the custom op torch.ops.quantkit.hadamard_rotate.
"""
import os

import torch

from quantkit.kernels.device import triton_available
from quantkit.schemes.hadamard import rotate

BACKENDS = ("auto", "triton", "torch")


def rotate_activations(x: torch.Tensor, signs: torch.Tensor, block: int, backend: str = "auto") -> torch.Tensor:
    """Pi x for a quantized layer's forward. backend: "auto" (Triton for CUDA fp16/bf16/fp32 x when
    triton imports, else torch), "triton" (always; CPU needs TRITON_INTERPRET=1), "torch"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton backend on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    if backend == "auto":
        fits = x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        backend = "triton" if fits and triton_available() else "torch"
    if backend == "triton":
        return rotate_triton_op(x, signs, block)
    return rotate(x, signs, block)


# One opaque custom op, as the quantized GEMMs are (dispatch.py): torch.compile traces a rotated layer without the
# launch code, and CUDA graphs capture it.
@torch.library.custom_op("quantkit::hadamard_rotate", mutates_args=())
def rotate_triton_op(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """triton_rotation.rotate_triton(x, signs, block)."""
    from quantkit.kernels.triton_rotation import rotate_triton  # triton imports only where it runs

    return rotate_triton(x, signs, block)


@rotate_triton_op.register_fake
def _rotate_triton_fake(x, signs, block):
    return torch.empty_like(x)
