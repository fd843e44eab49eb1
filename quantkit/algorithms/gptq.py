"""GPTQ (Frantar et al., 2022) for one linear layer: pure math -> QuantResult.

Usage, one object per nn.Linear (weight [out, in]):

    g = GPTQ(linear.weight)
    for x in calibration_inputs_of_this_linear:   # x [..., in]
        g.add_batch(x)
    res = g.quantize(Grid(4, sym=True), group_size=128)   # any quantizer: quantkit.schemes.base
    err = output_error(linear.weight, res.dequantize(), g.H)
    g.free()

The algorithm (`GPTQ.quantize`):
  H = 2/N * sum x x^T over the N calibration tokens (float32).
  Dead inputs (H_ii = 0: the input is always zero) get H_ii = 1 and W[:, i] = 0.
  H += lambda * I with lambda = damp * mean(diag H); U = upper Cholesky factor of H^-1
  (retried with 10x the damping, up to MAX_DAMP, when a factorization fails).
  Columns are quantized one unit at a time (the quantizer's width: 1 column for a scalar grid), in
  blocks of `block_size`: column i gets codes q_i, err_i = (w_i - dequant(q_i)) / U_ii, and the
  rest of the block absorbs err_i * U[i, i+1:] (a wider unit u: E = (W_u - Q_u) U_uu^-1, QuIP#'s
  block LDLQ); after each block the remaining columns get one lazy update with all its errors.
  Group parameters (scale, zero) are fit when the group's first column is reached, from the
  error-updated weights (exactly those a column-by-column run would see, also when a group
  starts mid-block or spans several blocks).
  act_order quantizes columns (whole units) by descending diag(H). With static_groups (the default) the group
  parameters of every group are fit upfront from the original weights in original column order,
  so g_idx = i // group_size stays monotonic and each column uses its own group's parameters.
  Without static_groups the groups follow the permuted order (classic desc_act: g_idx is not
  monotonic). Without act_order `static_groups` has no effect.

The codes and parameters GPTQ used in its error feedback are exactly the ones returned:
QuantResult.decoded() reproduces GPTQ's quantized weights bit for bit (the integer grid rounds its
scales to fp16 before they are used).
"""
import math
from typing import Optional

import torch

from quantkit.algorithms.rtn import check_args
from quantkit.core import matmul
from quantkit.core.errors import QuantkitError
from quantkit.core.finite import all_finite
from quantkit.core.groups import group_index, group_width, n_groups
from quantkit.core.result import QuantResult

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
        # No copy when the weight already has the working dtype: GPTQ never writes to it (quantize works on a
        # clone, rotate makes a new tensor), and on a wide layer a copy is 4 bytes per weight of peak memory.
        self.weight = weight.detach().to(dtype=dtype)
        self.rows, self.columns = self.weight.shape
        self.H = torch.zeros(self.columns, self.columns, dtype=dtype, device=self.weight.device)
        self.nsamples = 0
        self.dequant: Optional[torch.Tensor] = None  # set by quantize(keep_dequant=True)
        self._factor = _SharedFactor()

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
            raise RuntimeError("GPTQ.add_batch after free()")
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
        self._factor.forget()

    def share_statistics(self, other: "GPTQ") -> None:
        """Use `other`'s Hessian (a linear fed the very same inputs, e.g. k_proj beside q_proj): accumulated
        once, read by both (quantize() restores every change it makes to H)."""
        if other.columns != self.columns:
            raise ValueError(f"cannot share a Hessian of {other.columns} inputs with a layer of {self.columns}")
        self.H, self.nsamples = other.H, other.nsamples
        self._use_factor(other._factor)

    def _use_factor(self, shared: Optional["_SharedFactor"] = None) -> None:
        """From now on read `shared` (the factor of the layer whose Hessian this one reads), or one of its own."""
        self._factor.users -= 1
        if shared is None:
            self._factor = _SharedFactor()
        else:
            shared.users += 1
            self._factor = shared

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

    def quantize(self, quantizer, group_size: int = 128, block_size: int = 128, damp: float = 0.01,
                 act_order: bool = False, static_groups: bool = True,
                 bias: Optional[torch.Tensor] = None, keep_dequant: bool = False) -> QuantResult:
        """Run GPTQ with any quantizer (see quantkit.schemes.base); returns the result on the weight's device.

        stats: damp (damping fraction actually used), retries, dead (dead inputs),
        message (a line for the user when the damping had to be raised, else None).
        keep_dequant=True also stores the dequantized weight GPTQ used internally in
        `self.dequant` [out, in] (original column order) for checking.
        Does not modify self.H (the diagonal is restored afterwards).
        """
        self._check(quantizer, group_size, block_size, damp, act_order, static_groups)
        rows, cols = self.weight.shape
        width = quantizer.width
        size = group_width(cols, group_size)
        diag = self.H.diagonal().clone()
        dead = diag == 0
        diag_fixed = torch.where(dead, torch.ones_like(diag), diag)
        # The working copy, one row per column (see _feedback_loop); always a copy, also of a transposed weight
        Wt = self.weight.t().clone(memory_format=torch.contiguous_format)
        Wt[dead] = 0

        static = act_order and static_groups
        params = _fit_static(Wt, quantizer, group_size, diag_fixed) if static else {}
        perm = _unit_order(diag_fixed, width) if act_order else None
        if perm is not None:
            Wt = Wt[perm]
        col_group = ((perm // size).tolist() if static and perm is not None else [c // size for c in range(cols)])
        Hinv, damp_used, retries = self._factor.get(self.H, (damp, act_order, width),
                                                    lambda: self._inverse(diag, diag_fixed, perm, damp))
        refit_importance = None if static else (diag_fixed if perm is None else diag_fixed[perm])
        Qt, Wqt = _feedback_loop(Wt, Hinv, quantizer, params, col_group, size, -(-block_size // width) * width,
                                 refit_importance, n_groups=n_groups(cols, group_size), keep_dequant=keep_dequant)
        del Hinv, Wt

        g_idx = group_index(cols, group_size).to(Qt.device)
        if perm is not None:
            invperm = torch.argsort(perm)
            Qt = Qt[invperm]
            Wqt = Wqt[invperm] if Wqt is not None else None
            if not static:
                g_idx = (invperm // size).to(torch.int32)
        Q = Qt.t().contiguous()
        Wq = Wqt.t().contiguous() if Wqt is not None else None
        self.dequant = Wq
        if Q.is_cuda:
            torch.cuda.synchronize(Q.device)
        message = None
        if retries:
            message = (f"GPTQ: Hessian not positive definite with damp={damp:g}; "
                       f"used damp={damp_used:g} after {retries} retr{'y' if retries == 1 else 'ies'}")
        return QuantResult(
            codes=Q.to(torch.int32), params=params, g_idx=g_idx, quantizer=quantizer, group_size=group_size,
            bias=bias, stats={"damp": damp_used, "retries": retries, "dead": int(dead.sum()), "message": message},
        )

    def _inverse(self, diag, diag_fixed, perm, damp):
        try:
            return _inverse_cholesky(self.H, diag_fixed, perm, damp)
        finally:
            self.H.diagonal().copy_(diag)  # leave self.H as accumulated

    def _check(self, quantizer, group_size, block_size, damp, act_order, static_groups):
        if self.H is None:
            raise RuntimeError("GPTQ.quantize after free()")
        check_args(quantizer, group_size, self.weight)
        if self.nsamples == 0:
            raise QuantkitError("GPTQ needs calibration inputs: add_batch() was never called for this layer")
        if block_size < 1:
            raise QuantkitError(f"block_size={block_size} is invalid; use a positive size")
        if not (damp >= 0 and math.isfinite(damp)):
            raise QuantkitError(f"damp={damp} is invalid; use a fraction >= 0 such as 0.01")
        if act_order and not static_groups and quantizer.width > 1:
            raise QuantkitError("act-order without static groups needs a one-column quantizer")
        if not torch.isfinite(self.H).all():
            raise QuantkitError("the calibration activations of this layer are NaN/Inf (its GPTQ Hessian is not "
                                "finite): the model overflows on this data; try --dtype float32")


class _SharedFactor:
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


def _fit_static(Wt, quantizer, group_size, importance) -> dict:
    """Every group's parameters from the original weights (Wt transposed, [cols, rows]), in original column order
    (static groups), each column's rounding error weighted by its `importance` (H's diagonal) where the quantizer
    chooses between fits. Each group is fitted on a row-major copy: the quantizers' reductions (E8's rms and scale
    search) then sum in the same order as on the weight itself."""
    cols, rows = Wt.shape
    size = group_width(cols, group_size)
    params = {}
    for g, c0 in enumerate(range(0, cols, size)):
        group = Wt[c0:c0 + size].t().contiguous()
        for key, value in quantizer.fit(group, importance=importance[c0:c0 + size]).items():
            params.setdefault(key, torch.zeros(rows, n_groups(cols, group_size), dtype=torch.float32,
                                               device=Wt.device))[:, g] = value
    return params


def _unit_order(diag: torch.Tensor, width: int) -> torch.Tensor:
    """Act-order: columns by descending Hessian diagonal, whole units kept together (summed diagonal)."""
    units = torch.argsort(diag.view(-1, width).sum(dim=1), descending=True, stable=True)
    return (units[:, None] * width + torch.arange(width, device=diag.device)).reshape(-1)


def _feedback_loop(Wt, Hinv, quantizer, params, col_group, size, block_size, refit_importance, n_groups, keep_dequant):
    """Round the weights unit by unit in (permuted) column order, each unit's error fed to the columns after it.

    Wt is the weight transposed, [cols, rows] (in the order to quantize): each column is a contiguous row, and the
    loop runs about twice as fast as on W's strided columns (it is per-operator overhead; SmolLM2's shapes). On CPU
    a one-column quantizer whose round() takes NumPy arrays (`rounds_numpy`) gets NumPy views of the same memory
    for the per-column steps: the same float32 operations, bit for bit, at a fraction of torch's per-call cost.
    The error update is a product then a subtraction, as on W (a fused addr_ rounds once, not twice, and its
    different last bits flip codes that GPTQ's feedback then spreads), so the codes are W's loop's bit for bit. For
    a unit of columns u with E = (W_u - Q_u) U_uu⁻¹ (U = upper Cholesky factor of H⁻¹), the rest of the block gets
    W -= E U[u, rest] at once, later blocks one lazy update per block: for width 1 this is GPTQ exactly, for wider
    units it is the block LDLQ of QuIP#. With `refit_importance` (H's diagonal in Wt's order) groups are refitted: a
    group's parameters are fitted when its first column is reached, on the error-updated columns (those in this
    block are in W1; those past it still miss this block's pending lazy update); otherwise `params` holds every
    group's already. Returns (codes, dequantized weights or None), transposed like Wt.
    """
    cols, rows = Wt.shape
    width = quantizer.width
    on_host = Wt.device.type == "cpu" and getattr(quantizer, "rounds_numpy", False)
    view = torch.Tensor.numpy if on_host else (lambda t: t)  # what the per-column steps index and compute on
    Qt = torch.zeros(cols, rows, dtype=torch.int32, device=Wt.device)  # codes are integers (exact in int32)
    Wqt = torch.zeros_like(Wt) if keep_dequant else None
    Q_, Wq_ = view(Qt), (view(Wqt) if Wqt is not None else None)
    unit_params = {}  # group -> its parameters as the quantizer takes them, sliced once (act-order revisits groups)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1 = Wt[i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        W1_, Err1_ = view(W1), view(Err1)
        pivots = Hinv1.diagonal().tolist()  # U_ii as Python floats: the same division, one read per block
        for i in range(0, i2 - i1, width):
            c, u = i1 + i, slice(i, i + width)
            g = col_group[c]
            if refit_importance is not None and c % size == 0:
                end = min(c + size, cols)
                cur = W1[i:min(end, i2) - i1]
                if end > i2:
                    cur = torch.cat([cur, Wt[i2:end] - Hinv[i1:c, i2:end].t() @ Err1[:i]])
                for key, value in quantizer.fit(cur.t().contiguous(), importance=refit_importance[c:end]).items():
                    params.setdefault(key, torch.zeros(rows, n_groups, dtype=torch.float32, device=Wt.device))[:, g] = value
                unit_params.pop(g, None)
            if g not in unit_params:
                unit_params[g] = {k: view(v[:, g].contiguous()) for k, v in params.items()}
            if width == 1:
                w = W1_[i]
                q, wq = quantizer.round(w[:, None], unit_params[g])
                Q_[c] = q[:, 0]
                if Wq_ is not None:
                    Wq_[c] = wq[:, 0]
                Err1_[i] = (w - wq[:, 0]) / pivots[i]
                W1[i:] -= torch.outer(Hinv1[i, i:], Err1[i])  # torch's kernels beat NumPy's on this large product
            else:
                w = W1[u].t().contiguous()  # [rows, width], laid out as the quantizers' reductions expect
                q, wq = quantizer.round(w, unit_params[g])
                Qt[c:c + width] = q.t()
                if Wqt is not None:
                    Wqt[c:c + width] = wq.t()
                err = torch.linalg.solve_triangular(Hinv1[u, u], w - wq, upper=True, left=False)
                W1[i:] -= (err @ Hinv1[u, i:]).t()
                Err1[u] = err.t()
        Wt[i2:].addmm_(Hinv[i1:i2, i2:].t(), Err1, alpha=-1)  # in place: no [rest, rows] temporary
    return Qt, Wqt


def _inverse_cholesky(H: torch.Tensor, diag: torch.Tensor, perm: Optional[torch.Tensor], damp: float):
    """Upper Cholesky factor of (H + lambda I)^-1, H's diagonal replaced by `diag` (then permuted).

    Writes H's diagonal in place (the caller restores it). Retries with 10x the damping up to
    MAX_DAMP; returns (U, damp used, retries) or raises QuantkitError.
    """
    mean = diag.mean()
    tries = [damp]
    while tries[-1] < MAX_DAMP:
        tries.append(min(max(tries[-1] * 10, 1e-3), MAX_DAMP))
    info = torch.zeros((), dtype=torch.int32, device=H.device)
    for retries, d in enumerate(tries):
        H.diagonal().copy_(diag + d * mean)
        # One working matrix, factored, inverted and factored again in place: H plus one copy at the peak
        # instead of H plus three (on a 5632-input down_proj each is 127 MB). LAPACK works on column-major
        # storage, so the steps run on the transposed view V = Uᵀ (else each would copy): V = L (H = L Lᵀ),
        # V = H⁻¹ (symmetric), V = L₂ (H⁻¹ = L₂ L₂ᵀ), and U = L₂ᵀ is the upper factor of H⁻¹.
        U = H.clone() if perm is None else H[perm[:, None], perm]
        V = U.mT
        torch.linalg.cholesky_ex(V, out=(V, info))
        if int(info) == 0:
            torch.cholesky_inverse(V, out=V)
            torch.linalg.cholesky_ex(V, out=(V, info))
            if int(info) == 0 and all_finite(U):
                return U, d, retries
        del U, V
    raise QuantkitError(
        f"GPTQ: the layer's Hessian is not positive definite even with damp={tries[-1]:g} "
        f"(tried {', '.join(f'{t:g}' for t in tries)}); check the calibration data "
        f"(more samples, no degenerate inputs) or use --method rtn for this layer")


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
