"""AWQ on one decoder block: the registered preparation (its options, awq_prepare_block) and its steps.

plan (which scale groups can be folded) -> one fp forward capturing the groups' inputs -> per group a
trial fold, the scale search and the fold -> the clip search of the linears that allow it. The math
of each step lives in quantkit.algorithms.awq.
"""
from typing import Optional, Sequence

import torch
from torch import nn

from quantkit.algorithms.awq import (CLIP_TOKENS, SEARCH_TOKENS, apply_clip, clip_search, fold_reason, fold_scales,
                                     group_bounds, in_features_of, no_clip, search_scales, subsample)
from quantkit.algorithms.registry import MethodSpec, Preparation, register_algorithm, register_method
from quantkit.core.options import Option, positive
from quantkit.models.arch import first_tensor, for_block, get_weight, require_scale_groups
from quantkit.schemes.grid import Grid

# Trial fold: random power-of-two scales in [1/4, 4] (exact in any float format, so a correct fold of
# a plain norm or linear changes nothing; Gemma's (1 + w) norm loses up to ~2e-2 in bf16 through
# the offset's cancellation) must leave the block output for one sample unchanged up to this
# fraction of the block's update |y - x|. A table that does not match the model gives O(1) (0.85 and
# 1.85 for post-LN OPT).
FOLD_CHECK_TOL = 0.1


def _forward_first(runner) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of the block for the first calibration sample, as float32."""
    x = runner.inputs[0].to(runner.device)
    with torch.inference_mode():
        y = first_tensor(runner.call(0, x))
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
    s = 2.0 ** torch.randint(-2, 3, (in_features_of(linears[0]),), generator=gen).float()
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
def awq_prepare_block(runner, block: nn.Module, prefix: str, arch, config, spec_of=None) -> dict:
    """Search and fold AWQ scales for every scale group of `block`, then clip; weights change in place.

    runner: quantkit.calibration.runner.BlockRunner for this block (calibration inputs + kwargs).
    prefix: the block's full name ("model.layers.3"); spec_of(f"{prefix}.{name}") (its LayerSpec; by default
    config.spec_for) picks the
    quantizer (the group's first quantized linear decides for the group) and skips linears.
    Returns {group label: {"alpha", "error_rtn" (alpha = 0), "error_awq", "skipped": reason or None,
    "clip": {linear: {"error_noclip", "error_clip", "mean_ratio"}}}}. Linears that belong to no scale
    group are still clipped, under the label "(no scale group)->name".
    """
    require_scale_groups(arch)
    arch = for_block(arch, block)  # the groups this block has (DeepSeek's dense and MoE blocks differ)
    spec_of = spec_of or config.spec_for
    specs = {name: spec_of(f"{prefix}.{name}")
             for name in [n for stage in arch.sequential for n in stage] + [n for _, ls in arch.scale_groups for n in ls]}
    report, plans = _plan(block, arch, specs)
    clip_names = _clip_targets(arch, specs, report) if config.awq_clip else []
    # one fp forward of the samples the searches read: the input of each planned group (its first linear) and of
    # each clipped linear
    capture_of = {n: names[0] for _, _, names, _ in plans for n in names}
    for n in clip_names:
        capture_of.setdefault(n, n)
    xs = runner.capture(sorted(set(capture_of.values())), search_samples(runner.inputs)) if capture_of else {}
    scales = _search_and_fold(runner, block, arch, config, specs, plans, xs, report)
    for n in [n for n in clip_names if capture_of[n] in xs]:  # a routed expert may have seen no token
        x = subsample(xs[capture_of[n]], CLIP_TOKENS).float()
        if n in scales:
            x = x / scales[n].to(x.device)      # the linear now reads x / s (and holds W s)
        label = next((_label(p, ns) for p, ns in arch.scale_groups if n in ns), _label(None, [n]))
        report[label]["clip"][n] = _clip(block.get_submodule(n), x, specs[n], config.awq_grid)
    return report


def search_samples(inputs) -> list[int]:
    """Indices of the calibration samples AWQ's searches read: evenly spaced, as few as hold SEARCH_TOKENS tokens.

    The searches' errors always came from SEARCH_TOKENS tokens; mean|x| now comes from the same samples instead of
    all of them, so the fp forward that captures their inputs (a third of AWQ's time with 64 x 512 samples) runs on
    those samples only. On SmolLM2 the change is within what the calibration draw itself moves (docs/notes/quality-log.md,
    "Calibration speed: the MLP's tail replayed, the transposed GPTQ loop, AWQ staged")."""
    n = len(inputs)
    k = min(n, -(-SEARCH_TOKENS // max(1, inputs[0].shape[:-1].numel())))
    return torch.linspace(0, n - 1, k).round().long().tolist()


def _entry(skipped=None) -> dict:
    return {"alpha": None, "error_rtn": None, "error_awq": None, "skipped": skipped, "clip": {}}


def _plan(block, arch, specs):
    """(report with an entry per scale group, [(label, prev name, linears, quantized linears)] to search)."""
    report, plans = {}, []
    for prev, names in arch.scale_groups:
        label = _label(prev, names)
        report[label] = _entry()
        active = [n for n in names if specs[n] is not None]
        reason = ("all linears skipped by the config" if not active else
                  fold_reason(block.get_submodule(prev), [block.get_submodule(n) for n in names]))
        if reason:
            report[label]["skipped"] = reason
            continue
        plans.append((label, prev, names, active))
    return report, plans


def _clip_targets(arch, specs, report) -> list:
    """Linears whose integer-grid range is clipped (never q/k); those outside every group get an entry."""
    names = [n for stage in arch.sequential for n in stage
             if specs.get(n) is not None and not no_clip(n) and isinstance(specs[n].quantizer(), Grid)]
    grouped = {n for _, ns in arch.scale_groups for n in ns}
    for n in names:
        if n not in grouped:
            report[_label(None, [n])] = _entry("not in any scale group")
    return names


def _search_and_fold(runner, block, arch, config, specs, plans, xs, report) -> dict:
    """Per planned group: trial fold, scale search, fold. Returns {linear name: s it was multiplied by}."""
    scales = {}
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
        x = xs[names[0]]
        s, alpha, errors = search_scales([get_weight(block.get_submodule(n)) for n in active], x, spec.quantizer(),
                                         spec.group_size, n_grid=config.awq_grid)
        entry.update(alpha=alpha, error_rtn=errors[0], error_awq=errors[round(alpha * config.awq_grid)])
        if alpha > 0:
            fold_scales(prev_op, mods, s.to(x.device), arch.norm_offset)
            scales.update({n: s for n in names})
            x0, y0 = _forward_first(runner)     # the reference for the next trial: rounding moved it
    return scales


def _clip(module, x, spec, n_grid) -> dict:
    grid = spec.quantizer()
    lo0, hi0 = group_bounds(get_weight(module), grid, spec.group_size)
    bounds, e0, e1 = clip_search(get_weight(module), x, grid, spec.group_size, n_grid=n_grid, return_errors=True)
    apply_clip(module, bounds, spec.group_size)
    span0 = hi0 - lo0
    ratio = torch.where(span0 > 0, (bounds[..., 1] - bounds[..., 0]) / span0.clamp(min=1e-30),
                        torch.ones_like(span0))
    return {"error_noclip": e0.mean().item(), "error_clip": e1.mean().item(), "mean_ratio": ratio.mean().item()}


class AWQPreparation(Preparation):
    """AWQ's scale search (folded into the block's norms and linears) and clip search, before the rounding."""
    name = "awq"
    distributes = False  # the search needs every sample's activations in one place
    unrotated_only = "AWQ's scales are searched in the unrotated basis"
    options = (
        Option("awq_grid", int, 20, "AWQ: number of alpha values tried on [0, 1).", check=positive),
        Option("awq_clip", bool, True, "AWQ: search a per-group clipping range too."),
    )

    def check_model(self, arch, model_type: str) -> None:
        require_scale_groups(arch, model_type)

    def prepare_block(self, runner, block, prefix, arch, config, spec_of) -> dict:
        return awq_prepare_block(runner, block, prefix, arch, config, spec_of)


register_algorithm(AWQPreparation())
register_method(MethodSpec("awq", "rtn", prepare=("awq",),
                           summary="activation-aware scales folded into the model, then RTN"))
register_method(MethodSpec("awq+gptq", "gptq", prepare=("awq",), summary="AWQ scales, then GPTQ"))
