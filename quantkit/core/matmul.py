"""Float32 matrix products on the CPU through oneDNN, where torch's default BLAS leaves the vector units half idle.

torch's CPU wheel multiplies float32 matrices with MKL, which runs its AVX2 kernels on AMD processors; oneDNN, also
inside the wheel, picks its kernels by the instruction set and uses AVX-512. On an AMD EPYC Zen 5 (2 cores,
torch 2.13) a calibration-sized product ([512, 576] x [576, 1536]) runs at 470-480 GFLOP/s through oneDNN against
200-220 through MKL, and the Hessian bands of GPTQ 1.6-1.9x faster (docs/notes/quality-log.md, "oneDNN for the calibration
products"). So calibration's float32 products on a CPU with AVX-512 go through oneDNN: the block linears
(`onednn_linears`), GPTQ's Hessian (`addmm_nt_`), the fidelity report and AWQ's search (`linear`); so do evaluation's
(the model's linears in `quantkit.eval.model_logits`) and a loaded quantized layer's kept decoded weight
(cache_dequantized=True; the default strip-wise decode takes torch's product, quantkit.core.strips says why).
Elsewhere (a GPU, other dtypes, autograd, a CPU without AVX-512 or a torch built without oneDNN) the same
calls are torch's own.

Both libraries compute in float32 with fused multiply-adds; they differ in the order of the sums, so the last bits
of a product differ (relative 1e-6), and with them GPTQ's codes: one flipped rounding moves the error feedback after
it (on SmolLM2 more than half of the packed words differ; the ppl over seeds: docs/QUALITY.md, "The oneDNN gap").
Within one run every product takes the same path, so replayed and recomputed outputs stay bit-identical.
"""
import os
from contextlib import contextmanager
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

# QUANTKIT_ONEDNN=0 keeps torch's own products everywhere (the codes of the MKL path, bit for bit); tests switch it
# off to compare the two
ENABLED = os.environ.get("QUANTKIT_ONEDNN", "1") != "0"


@cache
def onednn_available() -> bool:
    """Whether this machine's products can go through oneDNN at all: a torch built with it (and its linear op) on a
    CPU with AVX-512. ENABLED (QUANTKIT_ONEDNN) decides whether they do."""
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and capability.startswith("AVX512"))


def uses_onednn(*tensors: torch.Tensor) -> bool:
    """Whether a product of these tensors goes through oneDNN: float32 on the CPU, no gradient to track."""
    return (ENABLED and onednn_available()
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def _onednn_linear(x, weight, bias=None):
    # oneDNN runs a dense row-major operand at full speed and a strided one (a column slice) in a reference loop
    # hundreds of times slower: hand it contiguous memory (a no-op for the usual activations and weights)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.contiguous(), bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear(x, weight, bias) = x weightᵀ + bias."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return _onednn_linear(x, weight, bias) if uses_onednn(*tensors) else F.linear(x, weight, bias)


def addmm_nt_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1.0, alpha: float = 1.0):
    """out <- beta * out + alpha * a bᵀ, in place; a [m, k] and b [n, k] hold the summed-over dimension in rows."""
    if uses_onednn(out, a, b):
        return out.mul_(beta).add_(_onednn_linear(a, b), alpha=alpha)
    return out.addmm_(a, b.t(), beta=beta, alpha=alpha)


class _OneDNNLinear(nn.Linear):
    """An nn.Linear computing through `linear` (swapped in by onednn_linears, never constructed)."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


@contextmanager
def onednn_linears(module: nn.Module):
    """While active, the plain nn.Linear layers inside `module` compute through `linear`. Their class is swapped,
    not their forward: the calibration loop patches and restores instance forwards of its own (replay, skipped
    outputs), and hooks, weights and isinstance checks are untouched."""
    swapped = [m for m in module.modules() if type(m) is nn.Linear] if ENABLED and onednn_available() else []
    for m in swapped:
        m.__class__ = _OneDNNLinear
    try:
        yield
    finally:
        for m in swapped:
            m.__class__ = nn.Linear
