"""AWQ: activation-aware weight quantization (Lin et al., 2023), as three pure steps and one driver.

    search_scales  per input channel s = mean|x|^alpha (normalised); pick alpha on a grid over [0, 1)
                   that minimises the output error of the group's linears quantized as Q(W s) (x / s)
    fold_scales    divide the output of the op that feeds the linears by s (a norm's weight and bias,
                   or a previous linear's output rows) and multiply the linears' input columns by s:
                   the floating-point model computes the same function, the checkpoint stays a plain
                   integer one (the later RTN/GPTQ step quantizes W s)
    clip_search    per (row, group) shrink the quantization range when that lowers the group's output
    apply_clip     error (AutoAWQ's auto_clip); never for q/k (attention logits are sensitive)
    awq_prepare_block  the sequential loop's hook: capture -> search -> fold per scale group -> clip

Which op feeds which linears is data (`Arch.scale_groups` in quantkit/model/arch.py). A group is
skipped, with a reason in the report, when its shapes do not allow folding (v_proj -> o_proj under
grouped-query attention), when config skips all its linears, or when a trial fold of random
power-of-two scales changes the block's output (the table does not match the model, e.g. post-LN OPT).

All search math is float32 on the device the block runs on.
"""
import math
from typing import Optional, Sequence

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.methods import grid as qgrid
from quantkit.methods.grid import Grid
from quantkit.model.arch import is_linear
from quantkit.model.sequential import first_tensor, get_weight

# Tokens used for the error of each alpha / clip ratio (mean|x| always uses every token). The search
# costs n_grid matmuls of [tokens, in] x [in, out] per group; 4096 tokens keep a 7B-sized group at a
# few seconds on a GPU and make tiny models / tests cheap on the 2-core CPU machines, while the error
# estimate (a mean over tokens x outputs) is already stable. Subsampling is deterministic (evenly
# spaced rows), so runs are reproducible.
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
# Trial fold: random power-of-two scales in [1/4, 4] (exact in any float format, so a correct fold of
# a plain norm or linear changes nothing; Gemma's (1 + w) norm loses up to ~2e-2 in bf16 through
# the offset's cancellation) must leave the block output for one sample unchanged up to this
# fraction of the block's update |y - x|. A table that does not match the model gives O(1) (0.85 and
# 1.85 for post-LN OPT).
FOLD_CHECK_TOL = 0.1


# ---------------------------------------------------------------- primitives

def fake_quant(w: torch.Tensor, grid: Grid, group_size: int, bounds: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-group round-to-nearest of `w` [out, in] in float32, equal to rtn(w, ...).dequantize().

    Vectorised: columns are zero-padded to a multiple of the group size, which leaves grid.fit
    unchanged (it already includes 0 in the range) and dequantizes back to exact zeros.
    bounds [out, n_groups, 2] (lo, hi), if given, clamps each group first (see clip_search).
    """
    w = w.float()
    rows, cols = w.shape
    size = cols if group_size == -1 else group_size
    ng = qgrid.n_groups(cols, group_size)
    pad = ng * size - cols
    wg = torch.nn.functional.pad(w, (0, pad)).view(rows, ng, size)
    if bounds is not None:
        wg = torch.clamp(wg, bounds[..., :1], bounds[..., 1:])
    flat = wg.reshape(rows * ng, size)
    scale, zero = qgrid.fit(flat, grid)
    q = qgrid.fake_quantize(flat, scale[:, None], zero[:, None], grid.maxq)
    return q.view(rows, ng * size)[:, :cols]


def _subsample(x: torch.Tensor, n: int) -> torch.Tensor:
    """At most n evenly spaced rows of x (deterministic)."""
    if x.shape[0] <= n:
        return x
    idx = torch.linspace(0, x.shape[0] - 1, n, device=x.device).round().long()
    return x[idx]


def _scales(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha, kept away from zero, normalised so that max(s) * min(s) = 1 (AutoAWQ)."""
    s = x_mean.pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def search_scales(weights: Sequence[torch.Tensor], x: torch.Tensor, grid: Grid, group_size: int,
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
    xs = _subsample(x, SEARCH_TOKENS).float()
    ws = [w.detach().float().to(x.device) for w in weights]
    for w in ws:
        if w.shape[1] != x.shape[1]:
            raise ValueError(f"weight {tuple(w.shape)} does not read inputs of width {x.shape[1]}")
    refs = [xs @ w.t() for w in ws]
    n_out = sum(w.shape[0] for w in ws) * xs.shape[0]
    errors = []
    for i in range(n_grid):
        s = _scales(x_mean, i / n_grid)
        err = 0.0
        for w, ref in zip(ws, refs):
            wq = fake_quant(w * s, grid, group_size) / s   # (x / s) Q(W s)ᵀ == x (Q(W s) / s)ᵀ
            err += (xs @ wq.t() - ref).pow(2).sum().item()
        errors.append(err / n_out)
    finite = [i for i, e in enumerate(errors) if math.isfinite(e)]
    best = min(finite, key=lambda i: (errors[i], i)) if finite else 0   # ties keep the smaller alpha
    n_weights = sum(w.numel() for w in ws)
    min_gain = MIN_GAIN_SIGMAS * math.sqrt(0.8 / n_weights)
    if best == 0 or not errors[best] < errors[0] * (1 - min_gain):
        return torch.ones_like(x_mean), 0.0, errors
    return _scales(x_mean, best / n_grid), best / n_grid, errors


def _in_features(m: nn.Module) -> int:
    return get_weight(m).shape[1]


def fold_reason(prev_op: nn.Module, linears: Sequence[nn.Module], n: Optional[int] = None) -> Optional[str]:
    """Why 1/s cannot be folded from prev_op into linears (None when it can); n = len(s)."""
    bad = [type(m).__name__ for m in linears if not is_linear(m)]
    if bad:
        return f"not linear layers: {bad}"
    widths = {_in_features(m) for m in linears}
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


def _group_bounds(w: torch.Tensor, grid: Grid, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unclipped range per (row, group), as grid.fit sees it: [min(w, 0), max(w, 0)], or ±absmax."""
    rows, cols = w.shape
    size = cols if group_size == -1 else group_size
    ng = qgrid.n_groups(cols, group_size)
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
    size = cols if group_size == -1 else group_size
    ng = qgrid.n_groups(cols, group_size)
    pad = ng * size - cols
    xs = torch.nn.functional.pad(_subsample(x, CLIP_TOKENS).float(), (0, pad))
    xg = xs.view(-1, ng, size).transpose(0, 1)                      # [ng, tokens, size]
    lo0, hi0 = _group_bounds(w, grid, group_size)
    best_lo, best_hi = lo0.clone(), hi0.clone()
    err0 = torch.empty(rows, ng, device=w.device)
    best_err = torch.empty(rows, ng, device=w.device)
    n_steps = max(1, int(max_shrink * n_grid))
    for r0 in range(0, rows, CLIP_ROW_BATCH):
        r1 = min(rows, r0 + CLIP_ROW_BATCH)
        wb = w[r0:r1]
        wg = torch.nn.functional.pad(wb, (0, pad)).view(r1 - r0, ng, size)
        ref = torch.bmm(xg, wg.permute(1, 2, 0))                     # [ng, tokens, rows]
        for i in range(n_steps):
            ratio = 1 - i / n_grid
            lo, hi = lo0[r0:r1] * ratio, hi0[r0:r1] * ratio
            wq = fake_quant(wb, grid, group_size, torch.stack([lo, hi], dim=-1))
            wqg = torch.nn.functional.pad(wq, (0, pad)).view(r1 - r0, ng, size)
            out = torch.bmm(xg, wqg.permute(1, 2, 0))
            err = (out - ref).pow(2).mean(dim=1).t()                 # [rows, ng]
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
    g = qgrid.group_index(cols, group_size).long().to(bounds.device)
    lo, hi = bounds[:, g, 0], bounds[:, g, 1]                       # [out, in]
    w.copy_(torch.clamp(w.float(), lo.to(w.device), hi.to(w.device)).to(w.dtype))


def no_clip(name: str) -> bool:
    """Whether the linear `name` (relative or full) is a query/key projection that AWQ never clips."""
    leaf = name.rsplit(".", 1)[-1]
    return any(k in leaf for k in NO_CLIP)


# ---------------------------------------------------------------- the block driver

def _forward_first(runner) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of the block for the first calibration sample, as float32."""
    x = runner.inputs[0].to(runner.device)
    with torch.inference_mode():
        y = first_tensor(runner.block(x, **runner.kwargs))
    return x.float(), y.float()


def _params(modules) -> list[torch.Tensor]:
    out = []
    for m in modules:
        for t in (getattr(m, "weight", None), getattr(m, "bias", None)):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def _trial_fold(runner, prev_op, linears, norm_offset, x0, y0) -> Optional[str]:
    """Fold random power-of-two scales, compare the block output on one sample, restore exactly."""
    params = _params([prev_op, *linears])
    saved = [p.data.clone() for p in params]
    gen = torch.Generator().manual_seed(0)
    s = 2.0 ** torch.randint(-2, 3, (_in_features(linears[0]),), generator=gen).float()
    try:
        fold_scales(prev_op, linears, s, norm_offset)
        _, y1 = _forward_first(runner)
    finally:
        for p, t in zip(params, saved):
            p.data.copy_(t)
    scale = (y0 - x0).norm() if y0.shape == x0.shape else y0.norm()
    rel = ((y1 - y0).norm() / scale.clamp(min=1e-12)).item()
    if not rel <= FOLD_CHECK_TOL:
        return (f"folding changes the block output (relative {rel:.2e}): this prev_op does not feed the "
                "linears as the arch table says (post-norm block? non-homogeneous activation?)")
    return None


def _label(prev: Optional[str], names: Sequence[str]) -> str:
    return f"{prev or '(no scale group)'}->{','.join(names)}"


@torch.no_grad()
def awq_prepare_block(runner, block: nn.Module, prefix: str, arch, config) -> dict:
    """Search and fold AWQ scales for every scale group of `block`, then clip; weights change in place.

    runner: quantkit.model.sequential.BlockRunner for this block (calibration inputs + kwargs).
    prefix: the block's full name ("model.layers.3"); config.spec_for(f"{prefix}.{name}") picks the
    grid (the group's first quantized linear decides for the group) and skips linears.
    Returns {group label: {"alpha", "error_rtn" (alpha = 0), "error_awq", "skipped": reason or None,
    "clip": {linear: {"error_noclip", "error_clip", "mean_ratio"}}}}. Linears that belong to no scale
    group are still clipped, under the label "(no scale group)->name".
    """
    if not arch.scale_groups:
        raise QuantkitError("AWQ has no scale-group table for this model family: add which norm or linear feeds "
                            "which linears to ARCHS in quantkit/model/arch.py, or use --method gptq/rtn")
    specs = {}
    for name in [n for stage in arch.sequential for n in stage] + [n for _, ls in arch.scale_groups for n in ls]:
        specs[name] = config.spec_for(f"{prefix}.{name}")

    report, plans = {}, []          # plans: (label, prev name, linears, active linears)
    for prev, names in arch.scale_groups:
        label = _label(prev, names)
        entry = {"alpha": None, "error_rtn": None, "error_awq": None, "skipped": None, "clip": {}}
        report[label] = entry
        active = [n for n in names if specs[n] is not None]
        if not active:
            entry["skipped"] = "all linears skipped by the config"
            continue
        reason = fold_reason(block.get_submodule(prev), [block.get_submodule(n) for n in names])
        if reason:
            entry["skipped"] = reason
            continue
        plans.append((label, prev, names, active))

    grouped = {n for _, ns in arch.scale_groups for n in ns}
    clip_names = []
    if config.awq_clip:
        clip_names = [n for stage in arch.sequential for n in stage
                      if specs.get(n) is not None and not no_clip(n)]
        for n in clip_names:
            if n not in grouped:
                report[_label(None, [n])] = {"alpha": None, "error_rtn": None, "error_awq": None,
                                             "skipped": "not in any scale group", "clip": {}}

    # one fp forward: the input of each planned group (its first linear) and of each clipped linear
    capture_of = {}                 # linear name -> name whose captured input it reads
    for _, _, names, _ in plans:
        for n in names:
            capture_of[n] = names[0]
    for n in clip_names:
        capture_of.setdefault(n, n)
    xs = runner.capture(sorted(set(capture_of.values()))) if capture_of else {}

    scales = {}                     # linear name -> s it was multiplied by
    if plans:
        x0, y0 = _forward_first(runner)
    for label, prev, names, active in plans:
        entry = report[label]
        prev_op, mods = block.get_submodule(prev), [block.get_submodule(n) for n in names]
        reason = _trial_fold(runner, prev_op, mods, arch.norm_offset, x0, y0)
        if reason:
            entry["skipped"] = reason
            continue
        spec = specs[active[0]]
        grid = Grid(spec.bits, spec.sym)
        x = xs[names[0]]
        s, alpha, errors = search_scales([get_weight(block.get_submodule(n)) for n in active], x, grid,
                                         spec.group_size, n_grid=config.awq_grid)
        entry.update(alpha=alpha, error_rtn=errors[0], error_awq=errors[round(alpha * config.awq_grid)])
        if alpha > 0:
            fold_scales(prev_op, mods, s.to(x.device), arch.norm_offset)
            for n in names:
                scales[n] = s
            x0, y0 = _forward_first(runner)     # the reference for the next trial: rounding moved it

    for n in clip_names:
        spec = specs[n]
        grid = Grid(spec.bits, spec.sym)
        x = _subsample(xs[capture_of[n]], CLIP_TOKENS).float()
        if n in scales:
            x = x / scales[n].to(x.device)      # the linear now reads x / s (and holds W s)
        module = block.get_submodule(n)
        lo0, hi0 = _group_bounds(get_weight(module), grid, spec.group_size)
        bounds, e0, e1 = clip_search(get_weight(module), x, grid, spec.group_size,
                                     n_grid=config.awq_grid, return_errors=True)
        apply_clip(module, bounds, spec.group_size)
        span0 = hi0 - lo0
        ratio = torch.where(span0 > 0, (bounds[..., 1] - bounds[..., 0]) / span0.clamp(min=1e-30),
                            torch.ones_like(span0))
        label = next((_label(p, ns) for p, ns in arch.scale_groups if n in ns), _label(None, [n]))
        report[label]["clip"][n] = {"error_noclip": e0.mean().item(), "error_clip": e1.mean().item(),
                                    "mean_ratio": ratio.mean().item()}
    return report
