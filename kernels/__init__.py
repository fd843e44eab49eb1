"""Fused dequant-GEMM kernels for the GPTQ layout (Triton on CUDA) and their pure-torch references."""
from quantkit.kernels.dispatch import gptq_linear  # noqa: F401
