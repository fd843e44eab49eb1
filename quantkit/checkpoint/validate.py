"""A quantized checkpoint checked as a whole before any model is built: its config, then its tensors.

The checks of the GPTQ layout live here; each codec (quantkit.checkpoint.codecs) calls them for its config.

A checkpoint edited by hand, written by another tool or damaged on the way must fail with one line
that names the file, the field or the tensor, never decode to garbage: every value read from
`quantization_config` is type- and range-checked, every quantized layer's tensors are checked
against each other and against that config (dtypes, shapes, g_idx range, finite scales), and the
zero points of a symmetric checkpoint must be the symmetric zero, which catches a
`checkpoint_format` that says v1 for a v2 checkpoint or the other way round.
"""
import re
from dataclasses import dataclass

import torch

from quantkit.core import bitpack
from quantkit.core.errors import QuantkitError
from quantkit.core.gptq_layout import CHECKPOINT_FORMATS, V1_ZERO_OFFSET
from quantkit.core.groups import n_groups
from quantkit.schemes.grid import check_bits, check_group_size

PACKED = ("qweight", "qzeros", "scales", "g_idx")
DTYPES = {"qweight": torch.int32, "qzeros": torch.int32, "scales": torch.float16, "g_idx": torch.int32}


def checkpoint_format(qc: dict) -> str:
    """The zero-point convention of a GPTQ config: "checkpoint_format" (GPTQModel, quantkit), else "format"
    (transformers' GPTQConfig.to_dict), else "gptq" (AutoGPTQ wrote neither). Checked by validate."""
    return qc.get("checkpoint_format") or qc.get("format") or "gptq"


def parse_dynamic_key(key: str) -> tuple[str, str]:
    """("+" or "-", regex) of a "dynamic" key; GPTQModel reads a key without a sign as "+"."""
    if key[:2] in ("+:", "-:"):
        return key[0], key[2:]
    return "+", key


def module_settings(qc: dict, name: str) -> tuple[int, int, bool]:
    """(bits, group_size, sym) of module `name` under a quantization_config (with "dynamic").

    The first key that matches decides, as in GPTQModel (quantization/config.py _resolve_dynamic_override) and
    vLLM (quantization/utils/gptq_utils.py get_dynamic_override); re.match, i.e. anchored at the start only."""
    settings = {"bits": qc["bits"], "group_size": qc["group_size"], "sym": qc.get("sym", True)}
    key, override = _dynamic_rule(qc, name)
    if key is not None and parse_dynamic_key(key)[0] == "+":
        settings.update({k: override[k] for k in settings if k in override})
    return settings["bits"], settings["group_size"], settings["sym"]


def _dynamic_rule(qc: dict, name: str) -> tuple:
    """(key, override) of the first "dynamic" rule matching `name`, or (None, None)."""
    for key, override in (qc.get("dynamic") or {}).items():
        if re.match(parse_dynamic_key(key)[1], name):
            return key, override
    return None, None


@dataclass(frozen=True)
class LayerInfo:
    """One quantized linear as a checkpoint describes it (its tensors already checked).

    settings: quantizer name and settings, group_size, rotation (None or its settings);
    storage: the tensor suffixes that hold the weight (what bits per weight counts)."""
    name: str
    in_features: int
    out_features: int
    settings: dict
    bias: bool
    storage: tuple = ("qweight", "qzeros", "scales")
    scale_dtype: torch.dtype = torch.float16  # what its scales run in (another tool's bf16/fp32 ones are kept)

    @property
    def bits(self) -> int:
        return self.settings["bits"]

    @property
    def group_size(self) -> int:
        return self.settings["group_size"]


def check_gptq_config(qc: dict, where: str) -> None:
    """Every field quantkit reads from a GPTQ quantization_config: present, of the right type, in range."""
    fmt = checkpoint_format(qc)
    declared = {qc[k] for k in ("checkpoint_format", "format") if qc.get(k)}
    if len(declared) > 1:
        raise QuantkitError(f"{where} says checkpoint_format {qc['checkpoint_format']!r} but format {qc['format']!r}: "
                            "keep the one the checkpoint was written in")
    if fmt not in CHECKPOINT_FORMATS:  # e.g. GPTQModel's "gptq_p" (planar bits) would decode to garbage as v2
        raise QuantkitError(f"{where} has checkpoint_format {fmt!r}, which quantkit cannot decode: "
                            f"it reads {' and '.join(CHECKPOINT_FORMATS)} only")
    if qc.get("pack_dtype", "int32") != "int32":
        raise QuantkitError(f"{where} has pack_dtype {qc['pack_dtype']!r}: quantkit reads int32-packed GPTQ "
                            "checkpoints only (repack with GPTQModel's default pack_dtype int32)")
    if qc.get("is_marlin_format"):
        raise QuantkitError(f"{where} has is_marlin_format: true (AutoGPTQ's Marlin-repacked tensors): quantkit "
                            "reads the plain GPTQ layout; use the checkpoint from before the Marlin repack")
    for key in ("bits", "group_size"):
        if key not in qc:
            raise QuantkitError(f"{where} quantization_config has no {key!r}: the checkpoint is damaged, quantize again")
    check_settings(qc, f"{where} quantization_config")
    dynamic = qc.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise QuantkitError(f"{where} quantization_config 'dynamic' must be an object of pattern -> settings")
    for key, override in dynamic.items():
        _, pattern = parse_dynamic_key(key)
        try:
            re.compile(pattern)
        except re.error as e:
            raise QuantkitError(f"{where} dynamic pattern {key!r} is not a valid regex ({e}): fix or remove it") from e
        if not isinstance(override, dict):
            raise QuantkitError(f"{where} dynamic {key!r} must map to an object such as {{\"bits\": 8}}")
        check_settings(override, f"{where} dynamic {key!r}")


def check_settings(settings: dict, where: str) -> None:
    """GPTQ-style fields of a config, a layer or a dynamic entry. A quantkit-format layer of another quantizer
    (its "quantizer" a name other than "int"; a GPTQ config's "quantizer" is a list of tool names) checks its
    own bits when it is built."""
    own_quantizer = isinstance(settings.get("quantizer"), str) and settings["quantizer"] != "int"
    if "bits" in settings and not own_quantizer:
        check_bits(settings["bits"], f"{where} bits")
    if "group_size" in settings:
        check_group_size(settings["group_size"], f"{where} group_size")
    for flag in ("sym", "desc_act"):
        if flag in settings and not isinstance(settings[flag], bool):
            raise QuantkitError(f"{where} {flag} must be true or false, got {settings[flag]!r}")


def packed_prefixes(tensors: dict) -> list[str]:
    """Names of the layers that hold GPTQ-layout tensors (any of them: a partial set is an error later)."""
    return sorted({k.rsplit(".", 1)[0] for k in tensors if k.rsplit(".", 1)[-1] in PACKED})


def check_packed_layers(tensors: dict, qc: dict, where: str) -> list[LayerInfo]:
    """Each quantized layer's tensors consistent with each other and with a GPTQ quantization_config."""
    prefixes = packed_prefixes(tensors)
    if not prefixes:
        raise QuantkitError(f"{where} holds no quantized layers (.qweight tensors): quantize the model again")
    fmt = checkpoint_format(qc)
    layers = []
    for name in prefixes:
        key, _ = _dynamic_rule(qc, name)
        if key is not None and parse_dynamic_key(key)[0] == "-":
            raise QuantkitError(f"{where}: layer {name} is packed in the files, but the config's dynamic rule {key!r} "
                                "keeps it in floating point: the config and the tensors contradict each other; "
                                "quantize again (or fix the dynamic map)")
        bits, group_size, sym = module_settings(qc, name)
        settings = {"quantizer": "int", "bits": bits, "sym": sym, "group_size": group_size, "rotation": None}
        layers.append(check_gptq_layer(name, tensors, settings, fmt, where))
    return layers


def check_gptq_layer(name, tensors, settings: dict, fmt: str, where: str) -> LayerInfo:
    """One layer's GPTQ-layout tensors (qweight, qzeros, scales, g_idx, bias) against its settings."""
    bits, group_size, sym = settings["bits"], settings["group_size"], settings["sym"]
    missing = [s for s in PACKED if f"{name}.{s}" not in tensors]
    if missing:
        raise QuantkitError(f"{where}: layer {name} lacks {', '.join(missing)}: the checkpoint is incomplete, "
                            "quantize again")
    t = {s: tensors[f"{name}.{s}"] for s in PACKED}
    for s, dtype in DTYPES.items():
        if t[s].dtype != dtype:
            raise QuantkitError(f"{where}: {name}.{s} is {t[s].dtype}, the GPTQ layout stores {dtype}")
    if t["scales"].dim() != 2 or t["g_idx"].dim() != 1:
        raise QuantkitError(f"{where}: {name}.scales must be 2-D and .g_idx 1-D: the checkpoint is damaged")
    k, n = t["g_idx"].numel(), t["scales"].shape[1]
    groups = n_groups(k, group_size)
    expected = {"qweight": (bitpack.packed_len(k, bits), n), "qzeros": (groups, bitpack.packed_len(n, bits)),
                "scales": (groups, n)}
    for s, shape in expected.items():
        if tuple(t[s].shape) != shape:
            raise QuantkitError(f"{where}: {name}.{s} has shape {tuple(t[s].shape)}, not {shape} as {bits}-bit, "
                                f"group size {group_size} and {k} inputs imply: the tensors and the config disagree")
    bias = tensors.get(f"{name}.bias")
    if bias is not None and tuple(bias.shape) != (n,):
        raise QuantkitError(f"{where}: {name}.bias has shape {tuple(bias.shape)}, not ({n},)")
    g = t["g_idx"]
    if k and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise QuantkitError(f"{where}: {name}.g_idx holds groups {int(g.min())}..{int(g.max())}, outside 0..{groups - 1}")
    if not torch.isfinite(t["scales"]).all():
        raise QuantkitError(f"{where}: {name}.scales holds NaN/Inf: the checkpoint is damaged, quantize again")
    if sym:
        _check_symmetric_zeros(name, t["qzeros"], bits, n, fmt, where)
    return LayerInfo(name, k, n, dict(settings), bias is not None)


def _check_symmetric_zeros(name, qzeros, bits, n, fmt, where):
    zeros = (bitpack.unpack(qzeros, bits, n, dim=1) + V1_ZERO_OFFSET[fmt]) & (2**bits - 1)
    wrong = zeros != 2 ** (bits - 1)
    if wrong.any():
        found = int(zeros[wrong][0])
        raise QuantkitError(
            f"{where}: {name} is declared symmetric, but its zero points decode to {found}, not {2 ** (bits - 1)}, "
            f"under checkpoint_format {fmt!r}: the format (v1 'gptq' stores zero - 1, "
            "'gptq_v2' the zero itself) or 'sym' in quantization_config is wrong; restore them")
