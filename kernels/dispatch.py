"""Entry point used by QuantLinear: Triton on CUDA, pure torch on CPU.

Backend choice ("auto" unless the `backend` argument or the QUANTKIT_BACKEND env var says otherwise):
  auto   -> Triton when x is on CUDA, bits in {2, 4, 8}, x is fp16/bf16 and triton imports;
            the torch reference otherwise (CPU, 3-bit, fp32 activations).
  triton -> always Triton; on CPU tensors this needs TRITON_INTERPRET=1 (how the tests check the
            kernels without a GPU). Unsupported inputs raise ValueError instead of falling back.
  torch  -> always the torch reference.
"""
import os

import torch

from quantkit.kernels.reference import gptq_linear_torch

BACKENDS = ("auto", "triton", "torch")


def _triton_available():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _choose_backend(x, bits, backend):
    backend = backend or os.environ.get("QUANTKIT_BACKEND", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton backend on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    if backend != "auto":
        return backend
    fits = x.is_cuda and bits in (2, 4, 8) and x.dtype in (torch.float16, torch.bfloat16)
    return "triton" if fits and _triton_available() else "torch"


def gptq_linear(x, qweight, qzeros, scales, g_idx, bits, in_features, bias=None, zero_offset=1, *,
                backend=None):
    """y = x @ W^T + bias where W is decoded from GPTQ-layout tensors. x: [..., in_features]."""
    if _choose_backend(x, bits, backend) == "torch":
        return gptq_linear_torch(x, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)
    from quantkit.kernels.triton_gptq_ops import gptq_matmul

    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = gptq_matmul(x2, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)
    return y.reshape(*x.shape[:-1], y.shape[-1])
