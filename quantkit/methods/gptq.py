"""GPTQ (Frantar et al., 2022) for one linear layer: pure math -> QuantResult.

Usage, one object per nn.Linear (weight [out, in]):

    g = GPTQ(linear.weight)
    for x in calibration_inputs_of_this_linear:   # x [..., in]
        g.add_batch(x)
    res = g.quantize(Grid(4, sym=True), group_size=128)
    err = output_error(linear.weight, res.dequantize(), g.H)
    g.free()

The algorithm (`GPTQ.quantize`):
  H = 2/N * sum x x^T over the N calibration tokens (float32).
  Dead inputs (H_ii = 0: the input is always zero) get H_ii = 1 and W[:, i] = 0.
  H += lambda * I with lambda = damp * mean(diag H); U = upper Cholesky factor of H^-1
  (retried with 10x the damping, up to MAX_DAMP, when a factorization fails).
  Columns are quantized one at a time, in blocks of `block_size`: column i gets codes q_i,
  err_i = (w_i - dequant(q_i)) / U_ii, and the rest of the block absorbs err_i * U[i, i+1:];
  after each block the remaining columns get one lazy update with all the block's errors.
  Group parameters (scale, zero) are fit when the group's first column is reached, from the
  error-updated weights (exactly those a column-by-column run would see, also when a group
  starts mid-block or spans several blocks).
  act_order quantizes columns by descending diag(H). With static_groups (the default) the group
  parameters of every group are fit upfront from the original weights in original column order,
  so g_idx = i // group_size stays monotonic and each column uses its own group's parameters.
  Without static_groups the groups follow the permuted order (classic desc_act: g_idx is not
  monotonic). Without act_order `static_groups` has no effect.

The codes, scales and zeros GPTQ used in its error feedback are exactly the ones returned:
QuantResult.dequantize() reproduces GPTQ's quantized weights bit for bit (scales are rounded to
fp16 by the grid before they are used).
"""
import math
import time
from typing import Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.methods import grid as qgrid
from quantkit.methods.grid import Grid
from quantkit.methods.result import QuantResult
from quantkit.methods.rtn import check_args

MAX_DAMP = 1.0  # largest damping fraction tried before giving up


class GPTQ:
    """Hessian accumulator and quantizer for one linear layer's weight [out, in].

    Works on the weight's device. The internal dtype is float32 (float64 when the weight is
    float64, which tests use for exact comparisons).
    """

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2:
            raise QuantkitError(f"GPTQ expects a 2-D weight [out, in], got shape {tuple(weight.shape)}")
        dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        self.weight = weight.detach().to(dtype=dtype, copy=True)
        self.rows, self.columns = self.weight.shape
        self.H = torch.zeros(self.columns, self.columns, dtype=dtype, device=self.weight.device)
        self.nsamples = 0
        self.dequant: Optional[torch.Tensor] = None  # set by quantize(keep_dequant=True)

    def add_batch(self, x: torch.Tensor) -> None:
        """Accumulate H = 2/N * sum x x^T over the tokens of x [..., in] (a running average)."""
        if self.H is None:
            raise RuntimeError("GPTQ.add_batch after free()")
        if x.shape[-1] != self.columns:
            raise ValueError(f"input has {x.shape[-1]} features, the layer expects {self.columns}")
        x = x.detach().reshape(-1, self.columns).to(device=self.H.device, dtype=self.H.dtype)
        m = x.shape[0]
        if m == 0:
            return
        n = self.nsamples + m
        # H <- H * old/new + 2/new * x^T x, in one fused call
        self.H.addmm_(x.t(), x, beta=self.nsamples / n, alpha=2.0 / n)
        self.nsamples = n

    def free(self) -> None:
        """Drop the Hessian and the weight copy; the object cannot quantize afterwards."""
        self.H = None
        self.weight = None
        self.dequant = None

    def quantize(self, grid: Grid, group_size: int = 128, block_size: int = 128, damp: float = 0.01,
                 act_order: bool = False, static_groups: bool = True,
                 bias: Optional[torch.Tensor] = None, keep_dequant: bool = False) -> QuantResult:
        """Run GPTQ; returns codes/scales/zeros on the weight's device.

        stats: damp (damping fraction actually used), retries, seconds, dead (dead inputs),
        message (a line for the user when the damping had to be raised, else None).
        keep_dequant=True also stores the dequantized weight GPTQ used internally in
        `self.dequant` [out, in] (original column order) for checking.
        Does not modify self.H (the diagonal is restored afterwards).
        """
        check_args(grid, group_size)
        if self.H is None:
            raise RuntimeError("GPTQ.quantize after free()")
        if self.nsamples == 0:
            raise QuantkitError("GPTQ needs calibration inputs: add_batch() was never called for this layer")
        if block_size < 1:
            raise QuantkitError(f"block_size={block_size} is invalid; use a positive size")
        if not (damp >= 0 and math.isfinite(damp)):
            raise QuantkitError(f"damp={damp} is invalid; use a fraction >= 0 such as 0.01")
        if not torch.isfinite(self.H).all():
            raise QuantkitError("the calibration activations of this layer are NaN/Inf (its GPTQ Hessian is not "
                                "finite): the model overflows on this data; try --dtype float32")
        t0 = time.perf_counter()
        H, W = self.H, self.weight.clone()
        rows, cols = W.shape
        maxq = grid.maxq
        size = cols if group_size == -1 else group_size
        ng = qgrid.n_groups(cols, group_size)
        scales = torch.zeros(rows, ng, dtype=torch.float32, device=W.device)
        zeros = torch.zeros(rows, ng, dtype=torch.float32, device=W.device)

        diag = H.diagonal().clone()
        dead = diag == 0
        n_dead = int(dead.sum())
        diag_fixed = torch.where(dead, torch.ones_like(diag), diag)
        W[:, dead] = 0

        static = act_order and static_groups
        if static:  # every group's parameters from the original weights, original column order
            for g in range(ng):
                c0, c1 = g * size, min((g + 1) * size, cols)
                scales[:, g], zeros[:, g] = qgrid.fit(W[:, c0:c1], grid)

        if act_order:
            perm = torch.argsort(diag_fixed, descending=True, stable=True)
            W = W[:, perm]
            col_group = (perm // size).tolist() if static else [c // size for c in range(cols)]
        else:
            perm = None
            col_group = [c // size for c in range(cols)]

        try:
            Hinv, damp_used, retries = _inverse_cholesky(H, diag_fixed, perm, damp)
        finally:
            H.diagonal().copy_(diag)  # leave self.H as accumulated
        message = None
        if retries:
            message = (f"GPTQ: Hessian not positive definite with damp={damp:g}; "
                       f"used damp={damp_used:g} after {retries} retr{'y' if retries == 1 else 'ies'}")

        Q = torch.zeros(rows, cols, dtype=W.dtype, device=W.device)  # codes, permuted column order
        Wq = torch.zeros_like(W) if keep_dequant else None
        for i1 in range(0, cols, block_size):
            i2 = min(i1 + block_size, cols)
            count = i2 - i1
            W1 = W[:, i1:i2].clone()
            Err1 = torch.zeros_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2]
            for i in range(count):
                c = i1 + i
                g = col_group[c]
                if not static and c % size == 0:
                    # fit the group on its current (error-updated) columns c .. c+size-1: those in this
                    # block are in W1; those past it still miss this block's pending lazy update.
                    end = min(c + size, cols)
                    cur = W1[:, i:min(end, i2) - i1]
                    if end > i2:
                        rest = W[:, i2:end] - Err1[:, :i] @ Hinv[i1:c, i2:end]
                        cur = torch.cat([cur, rest], dim=1)
                    scales[:, g], zeros[:, g] = qgrid.fit(cur, grid)
                scale, zero = scales[:, g], zeros[:, g]
                w = W1[:, i]
                q = qgrid.quantize(w, scale, zero, maxq)
                wq = qgrid.dequantize(q, scale, zero)
                Q[:, c] = q
                if Wq is not None:
                    Wq[:, c] = wq
                err = (w - wq) / Hinv1[i, i]
                W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
                Err1[:, i] = err
            W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
        del Hinv, W

        if act_order:
            invperm = torch.argsort(perm)
            Q = Q[:, invperm]
            if Wq is not None:
                Wq = Wq[:, invperm]
            g_idx = (invperm // size).to(torch.int32) if not static else None
        else:
            g_idx = None
        if g_idx is None:
            g_idx = qgrid.group_index(cols, group_size).to(Q.device)
        self.dequant = Wq
        if Q.is_cuda:
            torch.cuda.synchronize(Q.device)
        return QuantResult(
            qweight=Q.to(torch.int32), scales=scales, zeros=zeros.to(torch.int32), g_idx=g_idx,
            bits=grid.bits, group_size=group_size, sym=grid.sym, bias=bias,
            stats={"damp": damp_used, "retries": retries, "seconds": time.perf_counter() - t0,
                   "dead": n_dead, "message": message},
        )


def _inverse_cholesky(H: torch.Tensor, diag: torch.Tensor, perm: Optional[torch.Tensor], damp: float):
    """Upper Cholesky factor of (H + lambda I)^-1, H's diagonal replaced by `diag` (then permuted).

    Writes H's diagonal in place (the caller restores it). Retries with 10x the damping up to
    MAX_DAMP; returns (U, damp used, retries) or raises QuantkitError.
    """
    mean = diag.mean()
    tries = [damp]
    while tries[-1] < MAX_DAMP:
        tries.append(min(max(tries[-1] * 10, 1e-3), MAX_DAMP))
    for retries, d in enumerate(tries):
        H.diagonal().copy_(diag + d * mean)
        Hd = H if perm is None else H[perm[:, None], perm]
        L, info = torch.linalg.cholesky_ex(Hd)
        del Hd
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            del L
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            del Hinv
            if int(info) == 0 and bool(torch.isfinite(U).all()):
                return U, d, retries
        else:
            del L
    raise QuantkitError(
        f"GPTQ: the layer's Hessian is not positive definite even with damp={tries[-1]:g} "
        f"(tried {', '.join(f'{t:g}' for t in tries)}); check the calibration data "
        f"(more samples, no degenerate inputs) or use --method rtn for this layer")


def output_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """Relative output error ||(W - W_hat) X||^2 / ||W X||^2, from H = 2/N X X^T.

    = trace((W - W_hat) H (W - W_hat)^T) / trace(W H W^T); 0.0 when both are zero.
    """
    W = W.detach().to(device=H.device, dtype=H.dtype)
    D = W - W_hat.detach().to(device=H.device, dtype=H.dtype)
    num = float(((D @ H) * D).sum())
    den = float(((W @ H) * W).sum())
    if den <= 0:
        return 0.0 if num == 0 else float("inf")
    return num / den
