"""The CUDA device a Triton launch runs on.

Triton launches on the *current* CUDA device (and its current stream), whatever device the tensors are on: a
layer loaded on cuda:1 while cuda:0 is current fails ("cannot be accessed from Triton") or reads the wrong GPU's
memory. Every launch in quantkit.kernels runs under on_device(x) of its activations.
"""
import contextlib
import importlib.util

import torch


def on_device(t: torch.Tensor):
    """A guard that makes t's GPU the current device for the launch; nothing to do for CPU tensors (the
    interpreter) or when it already is."""
    if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def triton_available() -> bool:
    """Whether triton is installed, without importing it (the interpreter must be chosen before the first import)."""
    return importlib.util.find_spec("triton") is not None
