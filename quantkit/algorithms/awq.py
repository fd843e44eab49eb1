"""AWQ: activation-aware weight quantization (Lin et al., 2023), as three pure steps and one driver.

    search_scales  per input channel s = mean|x|^alpha (normalised); pick alpha on a grid over [0, 1)
                   that minimises the output error of the group's linears quantized as Q(W s) (x / s)
    fold_scales    divide the output of the op that feeds the linears by s (a norm's weight and bias,
                   or a previous linear's output rows) and multiply the linears' input columns by s:
                   the floating-point model computes the same function, the checkpoint stays a plain
                   integer one (the later RTN/GPTQ step quantizes W s)
    clip_search    per (row, group) shrink the quantization range when that lowers the group's output
    apply_clip     error (AutoAWQ's auto_clip); never for q/k (attention logits are sensitive)
The sequential loop's hook that runs them on a block is quantkit.algorithms.awq_block.awq_prepare_block.

Which op feeds which linears is data (`Arch.scale_groups` in quantkit/models/families.py). A group is
skipped, with a reason in the report, when its shapes do not allow folding (v_proj -> o_proj under
grouped-query attention), when config skips all its linears, or when a trial fold of random
power-of-two scales changes the block's output (the table does not match the model, e.g. post-LN OPT).

All search math is float32 on the device the block runs on.
"""
import math
from typing import Optional, Sequence

import torch
from torch import nn

from quantkit.core import matmul
from quantkit.core.groups import group_index, group_width, n_groups
from quantkit.models.arch import get_weight, is_linear
from quantkit.schemes import base as qz
from quantkit.schemes import grid as qgrid
from quantkit.schemes.grid import Grid

# Tokens used for the error of each alpha / clip ratio (mean|x| uses every token it is given). The search
# costs n_grid matmuls of [tokens, in] x [in, out] per group; 4096 tokens keep a 7B-sized group at a
# few seconds on a GPU and make tiny models / tests cheap on the 2-core CPU machines, while the error
# estimate (a mean over tokens x outputs) is already stable. Subsampling is deterministic (evenly
# spaced rows), so runs are reproducible. The block driver captures only as many calibration samples as
# hold this many tokens (awq_block.search_samples).
SEARCH_TOKENS = 4096
# auto_clip works on per-group partial dot products [tokens, rows, groups]; AutoAWQ uses 512 tokens.
CLIP_TOKENS = 512
# rows per clip-search batch: bounds the [groups, tokens, rows] buffers (~ 32 x 512 x 1024 floats)
CLIP_ROW_BATCH = 1024
# Linears never clipped: query/key projections (their errors are amplified by the softmax).
# Matched as substrings of the linear's last name component.
NO_CLIP = ("q_proj", "k_proj", "query", "key", "qkv", "c_attn", "Wqkv")
# An alpha > 0 must beat plain RTN (alpha = 0) by more than this many standard deviations of the
# "rounding lottery": rescaling columns re-rounds every weight, and the mean of N squared rounding
# errors (uniform) fluctuates by sqrt(0.8 / N) relative, whatever the inputs. Smaller gains are ties
# (they are luck of the rounding, not activation awareness), so iid inputs keep s = 1. For a real
# layer (N ~ 1e7) the margin is ~0.1 %; for a 64 x 64 test matrix ~4 %.
MIN_GAIN_SIGMAS = 3.0


# ---------------------------------------------------------------- primitives

def fake_quant(w: torch.Tensor, quantizer, group_size: int, bounds: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-group round-to-nearest of `w` [out, in] in float32, equal to rtn(w, ...).dequantize()."""
    return qz.fake_quantize(w, quantizer, group_size, bounds)


def subsample(x: torch.Tensor, n: int) -> torch.Tensor:
    """At most n evenly spaced rows of x (deterministic)."""
    if x.shape[0] <= n:
        return x
    idx = torch.linspace(0, x.shape[0] - 1, n, device=x.device).round().long()
    return x[idx]


def _scales(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha, kept away from zero, normalised so that max(s) * min(s) = 1 (AutoAWQ)."""
    s = x_mean.pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def search_scales(weights: Sequence[torch.Tensor], x: torch.Tensor, quantizer, group_size: int,
                  n_grid: int = 20) -> tuple[torch.Tensor, float, list[float]]:
    """Best per-input-channel scales for linears that all read `x` [tokens, in].

    weights: [out_i, in] each. For alpha = i / n_grid (i < n_grid; alpha 0 is plain RTN) the error is
    the mean squared difference between x Wᵀ and (x / s) Q(W s)ᵀ over a token subsample and over the
    concatenated outputs of all the linears. Returns (s [in] float32, alpha, errors per alpha). Ties
    go to the smaller alpha, and the best alpha > 0 must beat alpha = 0 by more than the rounding
    noise floor (MIN_GAIN_SIGMAS), so alpha = 0 (s = 1) when no scaling really helps.
    """
    if not weights:
        raise ValueError("search_scales needs at least one weight")
    x_mean = x.abs().mean(dim=0, dtype=torch.float32)
    xs = subsample(x, SEARCH_TOKENS).float()
    ws = [w.detach().float().to(x.device) for w in weights]
    for w in ws:
        if w.shape[1] != x.shape[1]:
            raise ValueError(f"weight {tuple(w.shape)} does not read inputs of width {x.shape[1]}")
    # ||x (Wq - W)ᵀ||² summed over the tokens is tr(D G Dᵀ) with D = Wq - W and G = xᵀx: one [in, in]
    # product instead of [tokens, out] outputs per alpha (7x fewer flops for an MLP's gate/up). G is symmetric:
    # D G = D Gᵀ, a linear, and with it both products run through oneDNN on the CPU (quantkit.core.matmul)
    xt = xs.t().contiguous()
    gram = matmul.linear(xt, xt)
    n_out = sum(w.shape[0] for w in ws) * xs.shape[0]
    errors = []
    for i in range(n_grid):
        s = _scales(x_mean, i / n_grid)
        err = 0.0
        for w in ws:
            d = fake_quant(w * s, quantizer, group_size) / s - w   # (x / s) Q(W s)ᵀ == x (Q(W s) / s)ᵀ
            err += (matmul.linear(d, gram) * d).sum().item()
        errors.append(err / n_out)
    finite = [i for i, e in enumerate(errors) if math.isfinite(e)]
    best = min(finite, key=lambda i: (errors[i], i)) if finite else 0   # ties keep the smaller alpha
    n_weights = sum(w.numel() for w in ws)
    min_gain = MIN_GAIN_SIGMAS * math.sqrt(0.8 / n_weights)
    if best == 0 or not errors[best] < errors[0] * (1 - min_gain):
        return torch.ones_like(x_mean), 0.0, errors
    return _scales(x_mean, best / n_grid), best / n_grid, errors


def in_features_of(m: nn.Module) -> int:
    return get_weight(m).shape[1]


def fold_reason(prev_op: nn.Module, linears: Sequence[nn.Module], n: Optional[int] = None) -> Optional[str]:
    """Why 1/s cannot be folded from prev_op into linears (None when it can); n = len(s)."""
    bad = [type(m).__name__ for m in linears if not is_linear(m)]
    if bad:
        return f"not linear layers: {bad}"
    widths = {in_features_of(m) for m in linears}
    if len(widths) != 1:
        return f"linears read inputs of different widths {sorted(widths)}"
    width = widths.pop()
    if n is not None and n != width:
        return f"scales have {n} entries but the linears read {width} inputs"
    if is_linear(prev_op):
        out = get_weight(prev_op).shape[0]
        if out != width:
            return (f"{type(prev_op).__name__} output dim {out} != linears' input dim {width} "
                    "(e.g. v_proj -> o_proj under grouped-query attention)")
        return None
    w = getattr(prev_op, "weight", None)
    if not isinstance(w, torch.Tensor):
        return f"{type(prev_op).__name__} has no weight to fold the scales into"
    if w.dim() != 1 or w.numel() != width:
        return f"{type(prev_op).__name__} weight shape {tuple(w.shape)} does not match the linears' input dim {width}"
    b = getattr(prev_op, "bias", None)
    if isinstance(b, torch.Tensor) and b.shape != w.shape:
        return f"{type(prev_op).__name__} bias shape {tuple(b.shape)} != weight shape {tuple(w.shape)}"
    return None


@torch.no_grad()
def fold_scales(prev_op: nn.Module, linears: Sequence[nn.Module], s: torch.Tensor,
                norm_offset: float = 0.0) -> Optional[str]:
    """Divide prev_op's outputs by s and multiply the linears' input columns by s, in place.

    prev_op is a norm (weight, optional bias; Gemma-style norms compute x * (norm_offset + w), so
    w becomes (norm_offset + w) / s - norm_offset) or a linear (nn.Linear / Conv1D: output rows and
    bias divided by s; valid when only a positively homogeneous op sits in between). Math in float32,
    stored back in each parameter's dtype. Returns None, or the reason nothing was changed.
    """
    reason = fold_reason(prev_op, linears, s.numel())
    if reason:
        return reason
    s = s.detach().float()
    if is_linear(prev_op):
        w = get_weight(prev_op)
        w.copy_((w.float() / s.to(w.device)[:, None]).to(w.dtype))
    else:
        w = prev_op.weight.data
        w.copy_(((norm_offset + w.float()) / s.to(w.device) - norm_offset).to(w.dtype))
    b = getattr(prev_op, "bias", None)
    if isinstance(b, torch.Tensor):
        b.data.copy_((b.data.float() / s.to(b.device)).to(b.dtype))
    for m in linears:
        w = get_weight(m)
        w.copy_((w.float() * s.to(w.device)[None, :]).to(w.dtype))
    return None


def group_bounds(w: torch.Tensor, grid: Grid, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unclipped range per (row, group), as grid.fit sees it: [min(w, 0), max(w, 0)], or ±absmax."""
    rows, cols = w.shape
    size, ng = group_width(cols, group_size), n_groups(cols, group_size)
    wg = torch.nn.functional.pad(w.float(), (0, ng * size - cols)).view(rows, ng, size)
    return qgrid.value_range(wg, grid)  # zero padding changes nothing: the range always holds 0


@torch.no_grad()
def clip_search(weight: torch.Tensor, x: torch.Tensor, grid: Grid, group_size: int, n_grid: int = 20,
                max_shrink: float = 0.5, return_errors: bool = False):
    """Per-(row, group) clipping range that minimises that group's partial-output error.

    For ratio r = 1 - i / n_grid, i < max_shrink * n_grid (r = 1 is no clipping), the range of each
    group shrinks to [r * lo, r * hi] (sym: lo = -absmax, hi = absmax; asym: lo = min(w, 0),
    hi = max(w, 0), the range grid.fit uses); the error of a (row, group) is the mean over a token
    subsample of (x_g · Q(w_g) - x_g · w_g)². Since r = 1 is a candidate and only strict improvements
    are taken, clipping never increases any group's error on those tokens.

    Returns bounds [rows, n_groups, 2] float32 = (lo, hi) per group, for apply_clip / fake_quant; with
    return_errors also (error without clipping, error with) per (row, group).
    """
    w = weight.detach().float().to(x.device)
    rows, cols = w.shape
    size, ng = group_width(cols, group_size), n_groups(cols, group_size)
    pad = ng * size - cols
    xs = torch.nn.functional.pad(subsample(x, CLIP_TOKENS).float(), (0, pad))
    xg = xs.view(-1, ng, size).transpose(0, 1)                      # [ng, tokens, size]
    # mean over tokens of (x_g · d_g)² = d_g G_g d_gᵀ with G_g = x_gᵀ x_g / tokens: size² instead of
    # tokens work per (row, group) and step
    gram = torch.bmm(xg.transpose(1, 2), xg) / xg.shape[1]         # [ng, size, size]
    lo0, hi0 = group_bounds(w, grid, group_size)
    best_lo, best_hi = lo0.clone(), hi0.clone()
    err0 = torch.empty(rows, ng, device=w.device)
    best_err = torch.empty(rows, ng, device=w.device)
    n_steps = max(1, int(max_shrink * n_grid))
    for r0 in range(0, rows, CLIP_ROW_BATCH):
        r1 = min(rows, r0 + CLIP_ROW_BATCH)
        wb = w[r0:r1]
        for i in range(n_steps):
            ratio = 1 - i / n_grid
            lo, hi = lo0[r0:r1] * ratio, hi0[r0:r1] * ratio
            wq = fake_quant(wb, grid, group_size, torch.stack([lo, hi], dim=-1))
            d = torch.nn.functional.pad(wq - wb, (0, pad)).view(r1 - r0, ng, size).transpose(0, 1)  # [ng, rows, size]
            err = (torch.bmm(d, gram) * d).sum(dim=-1).t()           # [rows, ng]
            if i == 0:
                err0[r0:r1] = err
                best_err[r0:r1] = err
                continue
            better = err < best_err[r0:r1]
            best_err[r0:r1] = torch.where(better, err, best_err[r0:r1])
            best_lo[r0:r1] = torch.where(better, lo, best_lo[r0:r1])
            best_hi[r0:r1] = torch.where(better, hi, best_hi[r0:r1])
    bounds = torch.stack([best_lo, best_hi], dim=-1)
    return (bounds, err0, best_err) if return_errors else bounds


@torch.no_grad()
def apply_clip(module: nn.Module, bounds: torch.Tensor, group_size: int) -> None:
    """Clamp module's weight [out, in] group by group into bounds [out, n_groups, 2] = (lo, hi)."""
    w = get_weight(module)
    rows, cols = w.shape
    g = group_index(cols, group_size).long().to(bounds.device)
    lo, hi = bounds[:, g, 0], bounds[:, g, 1]                       # [out, in]
    w.copy_(torch.clamp(w.float(), lo.to(w.device), hi.to(w.device)).to(w.dtype))


def no_clip(name: str) -> bool:
    """Whether the linear `name` (relative or full) is a query/key projection that AWQ never clips."""
    leaf = name.rsplit(".", 1)[-1]
    return any(k in leaf for k in NO_CLIP)
