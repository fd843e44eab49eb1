"""The Hessian observer: the second moment of a linear layer's calibration inputs, and what it measures.

    obs = HessianObserver(linear.weight)
    for x in calibration_inputs_of_this_linear:   # x [..., in]
        obs.add_batch(x)
    fidelity(linear.weight, w_hat, obs.H)        # output error, cosine, SQNR on those inputs

quantkit.algorithms.gptq.GPTQ is an observer that also solves GPTQ; the calibration loop
(quantkit.calibration.sequential) feeds one per linear and shares one Hessian between linears fed the same inputs.
"""
import math
from typing import Optional

import torch

from quantkit.core import matmul
from quantkit.core.errors import QuantkitError


class HessianObserver:
    """The Hessian H = 2/N Σ x xᵀ of one linear layer's inputs, beside its weight [out, in].

    Works on the weight's device. The internal dtype is float32 (float64 when the weight is
    float64, which tests use for exact comparisons). Every method's error report reads it (fidelity);
    GPTQ (quantkit.algorithms.gptq) solves with it.
    """

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2:
            raise QuantkitError(f"a Hessian observer expects a 2-D weight [out, in], got shape {tuple(weight.shape)}")
        dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        # No copy when the weight already has the working dtype: GPTQ never writes to it (quantize works on a
        # clone, rotate makes a new tensor), and on a wide layer a copy is 4 bytes per weight of peak memory.
        self.weight = weight.detach().to(dtype=dtype)
        self.rows, self.columns = self.weight.shape
        self.H = torch.zeros(self.columns, self.columns, dtype=dtype, device=self.weight.device)
        self.nsamples = 0
        self.dequant: Optional[torch.Tensor] = None  # set by quantize(keep_dequant=True)
        self.factor = SharedFactor()

    @property
    def H(self) -> Optional[torch.Tensor]:
        """The Hessian [in, in]; add_batch updates only its upper block triangle, mirrored here when read."""
        if self._lower_stale:
            for a, b in _tiles(self.columns):
                self._H[b:, a:b] = self._H[a:b, b:].t()
            self._lower_stale = False
        return self._H

    @H.setter
    def H(self, value: Optional[torch.Tensor]) -> None:
        self._H, self._lower_stale = value, False

    def add_batch(self, x: torch.Tensor) -> None:
        """Accumulate H = 2/N * sum x x^T over the tokens of x [..., in] (a running average)."""
        if self._H is None:
            raise RuntimeError("add_batch after free()")
        if x.shape[-1] != self.columns:
            raise ValueError(f"input has {x.shape[-1]} features, the layer expects {self.columns}")
        x = x.detach().reshape(-1, self.columns).to(device=self._H.device, dtype=self._H.dtype)
        m = x.shape[0]
        if m == 0:
            return
        n = self.nsamples + m
        # H <- H * old/new + 2/new * x^T x, one row band of tiles at a time from the diagonal on: H is symmetric,
        # so the products below the diagonal tiles are skipped (the Hessians were a quarter of GPTQ calibration's
        # time on CPU; this saves a third of them, measured on SmolLM2's 576 and 1536 inputs). xt's rows are the
        # inputs' features; for oneDNN (quantkit.core.matmul) copied once, so that every band's operands are contiguous
        # row slices (a GPU's BLAS reads the transposed view as it is)
        xt = x.t().contiguous() if matmul.uses_onednn(x) else x.t()
        for a, b in _tiles(self.columns):
            matmul.addmm_nt_(self._H[a:b, a:], xt[a:b], xt[a:], beta=self.nsamples / n, alpha=2.0 / n)
        self._lower_stale = True
        self.nsamples = n
        self.factor.forget()

    def share_statistics(self, other: "HessianObserver") -> None:
        """Use `other`'s Hessian (a linear fed the very same inputs, e.g. k_proj beside q_proj): accumulated
        once, read by both (quantize() restores every change it makes to H)."""
        if other.columns != self.columns:
            raise ValueError(f"cannot share a Hessian of {other.columns} inputs with a layer of {self.columns}")
        self.H, self.nsamples = other.H, other.nsamples
        self._use_factor(other.factor)

    def _use_factor(self, shared: Optional["SharedFactor"] = None) -> None:
        """From now on read `shared` (the factor of the layer whose Hessian this one reads), or one of its own."""
        self.factor.users -= 1
        if shared is None:
            self.factor = SharedFactor()
        else:
            shared.users += 1
            self.factor = shared

    def free(self) -> None:
        """Drop the Hessian and the weight copy; the object cannot quantize afterwards."""
        self.H = None
        self.weight = None
        self.dequant = None
        self._use_factor()

    def rotate(self, rotation) -> None:
        """Move to the rotated basis: W <- W Πᵀ, H <- Π H Πᵀ (the layer will compute Ŵ (Π x))."""
        self.weight = rotation.rotate_weight(self.weight)
        self.H = rotation.rotate_hessian(self.H)
        self._use_factor()  # a Hessian of its own now


class SharedFactor:
    """The inverse Hessian's factor (with its damping and retries) of the layers sharing one Hessian (q/k/v): the
    first to quantize computes it, the others reuse it (the same H, damping, and act-order permutation give the same
    matrix, bit for bit). Kept only while another user remains, so a layer alone never holds it past its GPTQ."""

    def __init__(self):
        self.users = 1          # GPTQ objects reading this Hessian that have not been freed
        self.hessian = None     # the tensor the value was computed from (compared by identity)
        self.settings = None    # (damp, act_order, unit width) it was computed with
        self.value = None

    def get(self, hessian, settings, compute):
        value = self.value if (self.hessian is hessian and self.settings == settings) else compute()
        keep = self.users > 1
        self.hessian, self.settings, self.value = (hessian, settings, value) if keep else (None, None, None)
        return value

    def forget(self) -> None:
        """The Hessian changed in place (more samples)."""
        self.hessian = self.settings = self.value = None


# Rows per band of add_batch's products. Of the widths tried (128 to 768, 512-token batches, two CPU threads,
# AMD Zen 4), 192 was the best or within 3 % of it on 1536, 2048 and 4096 inputs (0.59-0.66x the full product's
# time) and 8 % off on 576 (0.78x against 128's 0.72x).
HESSIAN_TILE = 192


def _tiles(columns: int) -> list[tuple[int, int]]:
    """[start, end) of add_batch's row bands."""
    edges = list(range(0, columns, HESSIAN_TILE)) + [columns]
    return list(zip(edges[:-1], edges[1:]))


def output_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """Relative output error ||(W - W_hat) X||^2 / ||W X||^2, from H = 2/N X X^T.

    = trace((W - W_hat) H (W - W_hat)^T) / trace(W H W^T); 0.0 when both are zero.
    """
    return fidelity(W, W_hat, H)["error"]


def fidelity(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> dict:
    """How well W_hat x reproduces W x over the calibration inputs, from H = 2/N X Xᵀ alone.

    error:   ||(W - W_hat) X||² / ||W X||² (output_error)
    cosine:  <W X, W_hat X> / (||W X|| ||W_hat X||) over all tokens and outputs, = tr(W H Ŵᵀ) / sqrt(tr(W H Wᵀ) tr(Ŵ H Ŵᵀ))
    sqnr_db: 10 log10(||W X||² / ||(W - W_hat) X||²) = -10 log10(error), None when either is zero
    (the layer's bias, which quantization leaves alone, is not part of these outputs).

    Two products with H (W H and Ŵ H), each [out, in]: every trace above is an elementwise sum over them,
    and (W - Ŵ) H is their difference (on a wide layer these products cost more than GPTQ itself)."""
    W = W.detach().to(device=H.device, dtype=H.dtype)
    W_hat = W_hat.detach().to(device=H.device, dtype=H.dtype)
    WH = matmul.linear(W, H)  # W Hᵀ = W H: H is symmetric
    signal = float((WH * W).sum())
    cross = float((WH * W_hat).sum())
    What_H = matmul.linear(W_hat, H)
    quantized = float((What_H * W_hat).sum())
    WH -= What_H  # (W - Ŵ) H, in place
    del What_H
    noise = float((WH * (W - W_hat)).sum())
    if signal <= 0:
        error = 0.0 if noise == 0 else math.inf
    else:
        error = noise / signal
    norms = signal * quantized
    cosine = cross / math.sqrt(norms) if norms > 0 else (1.0 if error == 0 else 0.0)
    sqnr = -10 * math.log10(error) if 0 < error < math.inf else None  # None: no noise at all, or no signal
    return {"error": error, "cosine": cosine, "sqnr_db": sqnr}
