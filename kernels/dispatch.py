"""Entry point used by QuantLinear: Triton on CUDA, pure torch on CPU.

Backend choice ("auto" unless the `backend` argument or the QUANTKIT_BACKEND env var says otherwise):
  auto   -> Triton when x is on CUDA, x is fp16/bf16 and triton imports;
            the torch reference otherwise (CPU, fp32 activations).
  triton -> always Triton; on CPU tensors this needs TRITON_INTERPRET=1 (how the tests check the
            kernels without a GPU). Unsupported inputs raise ValueError instead of falling back.
  torch  -> always the torch reference.

Within the Triton backend, two paths (the `path` argument; "auto" picks by M = rows of x):
  fused   (M < PREFILL_MIN_M) -> triton_gptq_ops.gptq_matmul: the weight is decoded in registers
            inside the GEMM, never written out. This is what wins at decode / small batches, where
            the op is bound by reading the weights and INT4 reads 4x fewer bytes than fp16.
  prefill (M >= PREFILL_MIN_M) -> triton_dequant.dequantize_triton writes a *transient* fp16/bf16
            W^T [K, N] (a new allocation on every call, freed when the call returns: 2 bytes per
            weight, e.g. 470 MB for a 28672 x 8192 linear), then torch.matmul / addmm (cuBLAS) does
            the GEMM. At large M the GEMM is compute-bound and cuBLAS runs it at ~2x the fused
            kernel's speed (docs/BENCHMARKS.md: the fused kernel's decoded tile is shuffled through
            shared memory on the MMA critical path), while the decode is a bandwidth-bound pass
            costing ~2.5 bytes of traffic per weight: small against 2*M FLOPs per weight once M is
            in the hundreds. This is the trade production kernels make for prefill (exllama's
            large-M path); the extra memory is per call and only as big as one layer's weight.
torch.ops.quantkit.gptq_linear wraps the automatic choice as one opaque custom op with a fake
(shape-only) implementation: QuantLinear calls it, so torch.compile traces a quantized model without
graph breaks and CUDA graphs (torch.compile mode="reduce-overhead") capture it, which removes the
Python launch cost of each call from decode loops.
PREFILL_MIN_M is the measured crossover on an H100 (docs/BENCHMARKS.md): at M = 128 the two paths
tie on a 4096 x 4096 linear and the fused kernel is 1.27x-1.69x faster on larger ones; at M = 256
dequantize + cuBLAS is 5%-25% faster on every Llama-3 8B/70B shape. The weight is decoded in the
activation dtype with the reference's single rounding, so both paths see identical weights.
"""
import os
from typing import Optional

import torch

from quantkit.kernels.device import triton_available
from quantkit.kernels.reference import gptq_linear_torch, linear_dequantized

BACKENDS = ("auto", "triton", "torch")
PATHS = ("auto", "fused", "prefill")
PREFILL_MIN_M = 256   # Triton backend: M >= this decodes to a transient fp16/bf16 weight + cuBLAS


def choose_backend(x, bits, backend):
    backend = backend or os.environ.get("QUANTKIT_BACKEND", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton backend on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    if backend != "auto":
        return backend
    fits = x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
    return "triton" if fits and triton_available() else "torch"


def reserve_workspace(device: torch.device, out_features: int, in_features: int, codebook: bool = False) -> None:
    """A GPTQ (or, with `codebook`, a codebook) layer of this shape now lives on `device`: on a GPU, the most split-K
    scratch its kernel can ask for is allocated at once, outside any CUDA-graph memory pool (triton_gptq_ops.workspace
    says why)."""
    if device.type == "cuda" and triton_available():
        from quantkit.kernels import triton_codebook, triton_gptq_ops

        bound = (triton_codebook if codebook else triton_gptq_ops).workspace_bound
        triton_gptq_ops.workspace(device, *bound(out_features, in_features, triton_gptq_ops.num_sms(device)))


def choose_path(m, path=None):
    """'fused' or 'prefill' for a Triton call with m rows of activations."""
    path = path or "auto"
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path != "auto":
        return path
    return "prefill" if m >= PREFILL_MIN_M else "fused"


def gptq_linear(x, qweight, qzeros, scales, g_idx, bits, in_features, bias=None, zero_offset=1, *,
                backend=None, path=None):
    """y = x @ W^T + bias where W is decoded from GPTQ-layout tensors. x: [..., in_features].

    `path` ("auto", "fused", "prefill") applies to the Triton backend only; see the module docstring."""
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    # another tool's bf16/fp32 scales that fp16 cannot hold (kept as stored at load time) take the reference
    # decode: the Triton tiles are written for fp16 scales
    if choose_backend(x, bits, backend) == "torch" or scales.dtype != torch.float16:
        return gptq_linear_torch(x, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)
    from quantkit.kernels.triton_gptq_ops import check_layer, gptq_matmul

    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"x must be [..., in_features={in_features}], got {tuple(x.shape)}")
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if choose_path(x2.shape[0], path) == "fused":
        y = gptq_matmul(x2, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)
    else:
        check_layer(x2, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)
        y = _prefill(x2, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)
    return y.reshape(*x.shape[:-1], y.shape[-1])


@torch.library.custom_op("quantkit::gptq_linear", mutates_args=())
def gptq_linear_op(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: torch.Tensor, bits: int, in_features: int, bias: Optional[torch.Tensor],
                   zero_offset: int) -> torch.Tensor:
    """gptq_linear with the automatic backend and path (Triton on CUDA, torch elsewhere)."""
    return gptq_linear(x, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)


@gptq_linear_op.register_fake
def _gptq_linear_fake(x, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset):
    return x.new_empty((*x.shape[:-1], scales.shape[1]))


def _prefill(x2, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset):
    """Decode W^T to a transient x.dtype matrix, then one cuBLAS GEMM (bias in its epilogue)."""
    from quantkit.kernels.triton_dequant import dequantize_checked

    return prefill_gemm(x2, dequantize_checked(qweight, qzeros, scales, g_idx, bits, in_features, zero_offset,
                                               x2.dtype), bias)


def prefill_gemm(x2, w, bias):
    """x2 [M, K] @ w [K, N] (+ bias) by cuBLAS, bias in its epilogue: the prefill path's GEMM on a decoded weight."""
    if not x2.is_cuda:  # interpreter runs (tests): CPU fp16 GEMMs go through fp32
        return linear_dequantized(x2, w, bias)
    if bias is None:
        return torch.matmul(x2, w)
    return torch.addmm(bias.to(x2.dtype), x2, w)
