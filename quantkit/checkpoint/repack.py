"""What the AWQ and compressed-tensors codecs share: checks of foreign tensors, and the repack into the GPTQ
layout (true zeros, "gptq_v2") that quantkit's QuantLinear and kernels run.

Reading another layout decodes its integer codes, scales and zeros exactly into a QuantResult and re-encodes
them with quantkit.checkpoint.gptq.to_tensors: nothing is rounded on the way, so the loaded model computes
exactly what the foreign checkpoint says, and `quantkit convert` can reuse the same two steps.
"""
import sys

import torch

from quantkit.checkpoint.gptq import to_result, to_tensors
from quantkit.checkpoint.validate import LayerInfo
from quantkit.core.errors import QuantkitError
from quantkit.core.result import QuantResult
from quantkit.nn.quant_linear import QuantLinear

RUNTIME_FORMAT = "gptq_v2"
GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def tensor(tensors: dict, name: str, suffix: str, dtypes, shape, where: str) -> torch.Tensor:
    """tensors[name.suffix], checked: present, one of `dtypes`, of `shape` (None: any 1-D/2-D shape)."""
    key = f"{name}.{suffix}"
    if key not in tensors:
        raise QuantkitError(f"{where}: layer {name} lacks {suffix}: the checkpoint is incomplete")
    t = tensors[key]
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.dtype not in dtypes or (shape is not None and tuple(t.shape) != tuple(shape)):
        want = " or ".join(str(d) for d in dtypes)
        raise QuantkitError(f"{where}: {key} is {t.dtype} {tuple(t.shape)}, not {want} {tuple(shape or ())}: "
                            "the tensors and the config disagree")
    return t


def checked_scales(scales: torch.Tensor, name: str, where: str) -> torch.Tensor:
    """A layer's scales (fp16, bf16 or fp32 as stored) as float32, which holds each of them exactly."""
    if not bool(torch.isfinite(scales).all()):
        raise QuantkitError(f"{where}: {name} scales hold NaN/Inf: the checkpoint is damaged")
    return scales.float()


def scale_dtype(scales: torch.Tensor) -> torch.dtype:
    """The dtype a layer's scales run in: float16 when it holds them exactly (every fp16 checkpoint, and the bf16 or
    fp32 scales of most), else their own (llm-compressor run on an fp32 model writes fp32 scales): kept, never
    rounded."""
    return torch.float16 if torch.equal(scales.to(torch.float16).to(scales.dtype), scales) else scales.dtype


def note_wide_scales(layers: list, where: str) -> None:
    """Say once which layers keep bf16/fp32 scales (they run as exactly, a little slower on the GPU)."""
    wide = [layer for layer in layers if layer.scale_dtype != torch.float16]
    if wide:
        dtypes = sorted({str(layer.scale_dtype).removeprefix("torch.") for layer in wide})
        print(f"note: {where}: {len(wide)} of {len(layers)} layers have {'/'.join(dtypes)} scales that float16 cannot "
              f"hold exactly ({wide[0].name}, ...): kept as stored", file=sys.stderr)


def install(tensors: dict, res: QuantResult, name: str, foreign: tuple, scales=torch.float16) -> LayerInfo:
    """Replace a layer's foreign tensors by the GPTQ-layout ones (true zeros) in `tensors`; its LayerInfo.
    scales: the dtype its scales run in (scale_dtype of the stored ones)."""
    for suffix in foreign:
        tensors.pop(f"{name}.{suffix}", None)
    for suffix, t in to_tensors(res, RUNTIME_FORMAT, scale_dtype=scales).items():
        if suffix != "bias":  # the bias stays as the checkpoint stores it
            tensors[f"{name}.{suffix}"] = t
    q = res.quantizer
    out_features, in_features = res.codes.shape
    settings = {"quantizer": "int", "bits": q.bits, "sym": q.sym, "group_size": res.group_size, "rotation": None}
    return LayerInfo(name, in_features, out_features, settings, f"{name}.bias" in tensors, scale_dtype=scales)


def runtime_module(layer: LayerInfo, dtype):
    """The QuantLinear (on the meta device) that runs a layer installed by `install`."""
    return QuantLinear(layer.in_features, layer.out_features, layer.bits, layer.group_size, layer.bias,
                       RUNTIME_FORMAT, dtype=dtype, device="meta")


def result_of(tensors: dict, layer: LayerInfo, fmt: str) -> QuantResult:
    """The QuantResult of a layer already in the GPTQ layout (`fmt` its zero convention)."""
    return to_result(tensors, layer.name, layer.settings, fmt)


def plain_g_idx(res: QuantResult) -> bool:
    """g_idx is k // group_size: no act-order reordering that a layout without g_idx would lose."""
    k = res.g_idx.numel()
    plain = torch.zeros(k, dtype=torch.long) if res.group_size == -1 else torch.arange(k) // res.group_size
    return torch.equal(res.g_idx.long().cpu(), plain)


def int_refusal(res: QuantResult, fmt: str) -> str | None:
    """Why an unrotated integer layout cannot hold this layer (None when it can)."""
    if res.quantizer.name != "int":
        return f"{fmt} stores integer grids only, not {res.quantizer.name} codes: use --checkpoint-format gptq"
    if res.rotation is not None:
        return f"{fmt} has no rotation: use --rotate none, or --checkpoint-format gptq (quantkit format)"
    if not plain_g_idx(res):
        return (f"{fmt} cannot store an act-order g_idx (it must be k // group_size): keep gptq, or quantize "
                "again with quantkit (its act-order uses static groups)")
    return None


def check_integer_settings(config, fmt: str) -> None:
    """The settings of an unrotated integer layout (awq, compressed-tensors): its precheck's shared part."""
    if config.quantizer != "int" or config.rotate != "none":
        raise QuantkitError(f"--checkpoint-format {fmt} stores unrotated integer grids only: use --quantizer int "
                            "--rotate none, or --checkpoint-format gptq (written in the quantkit format)")
