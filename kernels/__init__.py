"""Dequant-GEMM kernels (Triton on CUDA) and their pure-torch references: the GPTQ integer layout (dispatch.py,
reference.py, triton_*.py), codebook layers (codebook.py, triton_codebook.py) and the Hadamard rotation of a
layer's input (rotation.py)."""
from quantkit.kernels.dispatch import gptq_linear  # noqa: F401
