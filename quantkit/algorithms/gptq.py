"""GPTQ (Frantar et al., 2022) for one linear layer: pure math -> QuantResult.

Usage, one object per nn.Linear (weight [out, in]):

    g = GPTQ(linear.weight)
    for x in calibration_inputs_of_this_linear:   # x [..., in]
        g.add_batch(x)
    res = g.quantize(Grid(4, sym=True), group_size=128)   # any quantizer: quantkit.schemes.base
    err = output_error(linear.weight, res.dequantize(), g.H)   # quantkit.algorithms.hessian
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

from quantkit.algorithms.hessian import HessianObserver
from quantkit.algorithms.registry import MethodSpec, Rounding, register_algorithm, register_method
from quantkit.algorithms.rtn import check_args, rtn
from quantkit.core.errors import QuantkitError
from quantkit.core.finite import all_finite
from quantkit.core.options import Option, positive
from quantkit.core.groups import group_index, group_width, n_groups
from quantkit.core.result import QuantResult
from quantkit.schemes.base import fit_all, fit_groups

MAX_DAMP = 1.0  # largest damping fraction tried before giving up


class GPTQ(HessianObserver):
    """The Hessian of one linear layer's inputs (add_batch), and GPTQ's rounding of its weight against it."""

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
        # The working copy, one row per column (see _FeedbackLoop); always a copy, also of a transposed weight
        Wt = self.weight.t().clone(memory_format=torch.contiguous_format)
        Wt[dead] = 0

        static = act_order and static_groups
        params = _fit_static(Wt, quantizer, group_size, diag_fixed) if static else {}
        perm = _unit_order(diag_fixed, width) if act_order else None
        if perm is not None:
            Wt = Wt[perm]
        col_group = ((perm // size).tolist() if static and perm is not None else [c // size for c in range(cols)])
        Hinv, damp_used, retries = self.factor.get(self.H, (damp, act_order, width),
                                                    lambda: self._inverse(diag, diag_fixed, perm, damp))
        refit_importance = None if static else (diag_fixed if perm is None else diag_fixed[perm])
        loop = _FeedbackLoop(Wt, Hinv, quantizer, params, col_group, size, refit_importance, n_groups(cols, group_size),
                             keep_dequant)
        Qt, Wqt = loop.run(-(-block_size // width) * width)
        del Hinv, Wt

        g_idx = group_index(cols, group_size).to(Qt.device)
        if perm is not None:
            Qt, Wqt, g_idx = _original_order(perm, Qt, Wqt, g_idx if static else None, size)
        Q = Qt.t().contiguous()
        self.dequant = Wqt.t().contiguous() if Wqt is not None else None
        if Q.is_cuda:
            torch.cuda.synchronize(Q.device)
        message = _damping_message(damp, damp_used, retries)
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


def _fit_static(Wt, quantizer, group_size, importance) -> dict:
    """Every group's parameters from the original weights (Wt transposed, [cols, rows]), in original column order
    (static groups), each column's rounding error weighted by its `importance` (H's diagonal) where the quantizer
    chooses between fits. Each group is fitted on a row-major copy: the quantizers' reductions (E8's rms and scale
    search) then sum in the same order as on the weight itself."""
    return fit_all(quantizer, Wt.t(), group_size, importance)


def _damping_message(damp, damp_used, retries):
    """A line for the user when the damping had to be raised, else None."""
    if not retries:
        return None
    return (f"GPTQ: Hessian not positive definite with damp={damp:g}; "
            f"used damp={damp_used:g} after {retries} retr{'y' if retries == 1 else 'ies'}")


def _original_order(perm, Qt, Wqt, g_idx, size):
    """Codes and dequantized weights (transposed) back in the original column order; g_idx kept when given (static
    groups), else each column's group in quantization order (act-order without static groups)."""
    invperm = torch.argsort(perm)
    Wqt = Wqt[invperm] if Wqt is not None else None
    return Qt[invperm], Wqt, g_idx if g_idx is not None else (invperm // size).to(torch.int32)


def _unit_order(diag: torch.Tensor, width: int) -> torch.Tensor:
    """Act-order: columns by descending Hessian diagonal, whole units kept together (summed diagonal)."""
    units = torch.argsort(diag.view(-1, width).sum(dim=1), descending=True, stable=True)
    return (units[:, None] * width + torch.arange(width, device=diag.device)).reshape(-1)


class _FeedbackLoop:
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
    group's already. run() returns (codes, dequantized weights or None), transposed like Wt.
    """

    def __init__(self, Wt, Hinv, quantizer, params, col_group, size, refit_importance, n_groups, keep_dequant):
        self.Wt, self.Hinv, self.quantizer, self.params = Wt, Hinv, quantizer, params
        self.col_group, self.size, self.refit_importance, self.n_groups = col_group, size, refit_importance, n_groups
        cols, rows = Wt.shape
        on_host = Wt.device.type == "cpu" and getattr(quantizer, "rounds_numpy", False)
        self.view = torch.Tensor.numpy if on_host else (lambda t: t)  # what the per-column steps index and compute on
        self.Qt = torch.zeros(cols, rows, dtype=torch.int32, device=Wt.device)  # codes are integers (exact in int32)
        self.Wqt = torch.zeros_like(Wt) if keep_dequant else None
        self.Q_, self.Wq_ = self.view(self.Qt), (self.view(self.Wqt) if self.Wqt is not None else None)
        self.unit_params = {}  # group -> its parameters as the quantizer takes them, sliced once (act-order revisits)
        self.fit_width = size * getattr(quantizer, "span", 1)  # columns fitted at once (a k-quant's super-block)

    def run(self, block_size: int):
        """Every block in turn, then one lazy update of the columns after it; returns (codes, dequantized or None)."""
        cols = self.Wt.shape[0]
        for i1 in range(0, cols, block_size):
            i2 = min(i1 + block_size, cols)
            Err1 = self._block(i1, i2)
            self.Wt[i2:].addmm_(self.Hinv[i1:i2, i2:].t(), Err1, alpha=-1)  # in place: no [rest, rows] temporary
        return self.Qt, self.Wqt

    def _block(self, i1: int, i2: int):
        """Columns i1..i2, each unit's error fed to the block's later columns; returns the block's errors."""
        Wt, Hinv, width = self.Wt, self.Hinv, self.quantizer.width
        W1 = Wt[i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        W1_, Err1_ = self.view(W1), self.view(Err1)
        pivots = Hinv1.diagonal().tolist()  # U_ii as Python floats: the same division, one read per block
        for i in range(0, i2 - i1, width):
            c = i1 + i
            g = self.col_group[c]
            if self.refit_importance is not None and c % self.fit_width == 0:
                end = min(c + self.fit_width, Wt.shape[0])
                cur = W1[i:min(end, i2) - i1]
                if end > i2:  # the group's columns past this block still miss its pending lazy update
                    cur = torch.cat([cur, Wt[i2:end] - Hinv[i1:c, i2:end].t() @ Err1[:i]])
                self._refit(g, cur, self.refit_importance[c:end])
            if g not in self.unit_params:
                self.unit_params[g] = {k: self.view(v[:, g].contiguous()) for k, v in self.params.items()}
            if width == 1:
                w = W1_[i]
                q, wq = self.quantizer.round(w[:, None], self.unit_params[g])
                self.Q_[c] = q[:, 0]
                if self.Wq_ is not None:
                    self.Wq_[c] = wq[:, 0]
                Err1_[i] = (w - wq[:, 0]) / pivots[i]
                W1[i:] -= torch.outer(Hinv1[i, i:], Err1[i])  # torch's kernels beat NumPy's on this large product
            else:
                self._round_unit(g, c, i, W1, Hinv1, Err1)
        return Err1

    def _refit(self, g: int, cur, importance) -> None:
        """The parameters of group g (and the rest of its span) fitted on its error-updated columns cur [size, rows]
        (transposed)."""
        rows = cur.shape[1]
        for key, value in fit_groups(self.quantizer, cur.t().contiguous(), importance).items():
            self.params.setdefault(key, torch.zeros(rows, self.n_groups, dtype=torch.float32,
                                                    device=cur.device))[:, g:g + value.shape[1]] = value
        for k in range(g, g + getattr(self.quantizer, "span", 1)):
            self.unit_params.pop(k, None)

    def _round_unit(self, g: int, c: int, i: int, W1, Hinv1, Err1) -> None:
        """The unit of width > 1 columns at column c (block offset i): its codes, and its error
        E = (W_u - Q_u) U_uu⁻¹ fed to the block's later columns and kept in Err1 for the lazy update."""
        width = self.quantizer.width
        u = slice(i, i + width)
        w = W1[u].t().contiguous()  # [rows, width], laid out as the quantizers' reductions expect
        if getattr(self.quantizer, "weighted_round", False):
            # the unit's error costs ||e U_uu^-1||^2: its columns weigh by the diagonal of U_uu^-1 U_uu^-T
            inverse = torch.linalg.solve_triangular(Hinv1[u, u], torch.eye(width, device=w.device), upper=True)
            q, wq = self.quantizer.round(w, self.unit_params[g], importance=inverse.square().sum(dim=1))
        else:
            q, wq = self.quantizer.round(w, self.unit_params[g])
        self.Qt[c:c + width] = q.t()
        if self.Wqt is not None:
            self.Wqt[c:c + width] = wq.t()
        err = torch.linalg.solve_triangular(Hinv1[u, u], w - wq, upper=True, left=False)
        W1[i:] -= (err @ Hinv1[u, i:]).t()
        Err1[u] = err.t()


def feedback_gains(H: torch.Tensor, damp: float = 0.01, act_order: bool = True) -> torch.Tensor:
    """[in]: for each input column, the share of its rounding error's cost that GPTQ's error feedback leaves. Rounding
    alone costs a column's squared error times H_ii in the output; GPTQ's loss weighs it by the pivot 1 / U_ii² (U the
    upper Cholesky factor of the damped H⁻¹ in quantization order), the part of the column the later ones cannot
    express. --target-bits' estimate of what GPTQ makes of a setting (quantkit.run.allocate). Scalar units."""
    diag = H.diagonal().clone()
    diag_fixed = torch.where(diag == 0, torch.ones_like(diag), diag)
    perm = _unit_order(diag_fixed, 1) if act_order else None
    U, damp_used, _ = _inverse_cholesky(H.clone(), diag_fixed, perm, damp)
    damped = diag_fixed + damp_used * diag_fixed.mean()
    gains = U.diagonal().square().reciprocal() / (damped if perm is None else damped[perm])
    return gains if perm is None else gains[torch.argsort(perm)]


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


def _damp_problem(damp: float):
    return None if 0 < damp <= 1 else "out of range: use a fraction in (0, 1], e.g. 0.01"


class GPTQRounding(Rounding):
    """GPTQ's rounding of each linear against the Hessian of its calibration inputs."""
    name = "gptq"
    needs_data = True
    options = (
        Option("damp", float, 0.01, "GPTQ damping, as a fraction of the mean Hessian diagonal (raised automatically "
               "if the Cholesky fails).", check=_damp_problem),
        Option("block_size", int, 128, "GPTQ columns per lazy-update block.", check=positive),
        Option("act_order", bool, True,
               "GPTQ: quantize columns by descending Hessian diagonal, with static groups so g_idx stays "
               "i // group_size (no reordering cost at inference). Much better on models with outlier channels "
               "(SmolLM2-135M, WikiText-2 ppl, fp 29.8: w4 g128 38.2 vs 44.0 without, w3 g128 77.7 vs 106.3)."),
    )

    def observer(self, weight) -> GPTQ:
        return GPTQ(weight)

    def round(self, weight, observer, quantizer, group_size, config, bias):
        if observer is None:  # no data (a routed expert no token reached): nothing to feed the error back with
            return rtn(weight, quantizer, group_size, bias=bias)
        return observer.quantize(quantizer, group_size, block_size=config.block_size, damp=config.damp,
                                 act_order=config.act_order, bias=bias)

    def act_order(self, config) -> bool:
        return config.act_order


register_algorithm(GPTQRounding())
register_method(MethodSpec("gptq", "gptq", summary="Hessian-aware error feedback"))
