"""The quantkit format (quant_method "quantkit"): what the GPTQ layout cannot express.

Used when any layer is rotated or rounded by a quantizer other than the integer grid. Layers are
listed one by one, no patterns:

    "quantization_config": {"quant_method": "quantkit", "format_version": 1, "desc_act": false,
        "layers": {"model.layers.0.mlp.down_proj": {"quantizer": "int", "bits": 4, "sym": true,
                   "group_size": 128, "rotation": {"type": "hadamard", "block": 64, "seed": 1234} | null}},
        ... (the run's options, as in the GPTQ config)}

Tensors of a layer <name> with K inputs, N outputs, G groups:
  quantizer "int":  the GPTQ layout exactly (qweight, qzeros, scales, g_idx; see quantkit.checkpoint.gptq)
                    with the true zero in qzeros (as gptq_v2), so the same kernels run it;
  any other:        codes int32 [packed_len(K, code_bits), N] (the quantizer's codes packed along the input
                    dim as one LSB-first bit stream, quantkit.core.bitpack), one [G, N] tensor per parameter
                    named by its key (float16 when the quantizer spends 16 bits on it, else float32),
                    g_idx int32 [K]; decoded by the quantizer registered under that name from the layer's
                    settings (turboquant: bits, dim, scale, codebook = the 2^bits float32 levels, so that
                    w = scale[g_idx[k], n] * codebook[code[k, n]]); docs/FORMAT.md has it byte by byte;
  bias              [N], when the layer has one;
  rot_signs         int8 [K] of ±1, when rotated: Π = blockdiag(H_block / sqrt(block)) · diag(rot_signs)
                    (Sylvester-ordered Walsh–Hadamard blocks over consecutive inputs); the stored weight is
                    W Πᵀ and the layer computes Ŵ (Π x). The seed that drew the signs is recorded, the
                    signs themselves are stored so no reader depends on a random generator.
"""
import torch

from quantkit.checkpoint import compat
from quantkit.checkpoint.codecs import Codec, register_codec
from quantkit.checkpoint.gptq import to_result, to_tensors
from quantkit.checkpoint.validate import LayerInfo, check_gptq_layer, check_settings
from quantkit.core import bitpack
from quantkit.core.errors import QuantkitError
from quantkit.core.groups import n_groups
from quantkit.core.options import is_int
from quantkit.core.result import QuantResult
from quantkit.nn.decoded_linear import DecodedLinear
from quantkit.nn.quant_linear import QuantLinear
from quantkit.schemes.base import make_quantizer, param_dtype
from quantkit.schemes.grid import check_group_size

FORMAT_VERSION = 1
INT_FORMAT = "gptq_v2"  # integer layers store true zeros


@register_codec
class QuantkitCodec(Codec):
    """Any quantizer, rotated or not <-> the quantkit format (written when --checkpoint-format gptq cannot hold a
    layer; no --checkpoint-format names it)."""

    quant_method = "quantkit"

    @staticmethod
    def accepts(res: QuantResult) -> bool:
        return True

    @staticmethod
    def quantization_config(config, results: dict, all_linears, act_order: bool, extra=None, fused=None) -> dict:
        layers = {name: layer_settings(results[name]) for name in all_linears if name in results}
        qc = {"quant_method": "quantkit", "format_version": FORMAT_VERSION, "desc_act": act_order, "layers": layers}
        qc.update(extra or {})
        return qc

    @staticmethod
    def layer_tensors(res: QuantResult, config, bias_dtype) -> dict:
        if res.quantizer.name == "int":
            out = to_tensors(res, INT_FORMAT, bias_dtype)
        else:
            out = {"codes": bitpack.pack(res.codes.t(), res.quantizer.code_bits, dim=0),
                   **{key: value.t().to(param_dtype(res.quantizer, key)).contiguous() for key, value in res.params.items()},
                   "g_idx": res.g_idx.to(torch.int32).contiguous()}
            if res.bias is not None:
                out["bias"] = res.bias.detach().to(bias_dtype or torch.float16).contiguous()
        if res.rotation is not None:
            out["rot_signs"] = res.rotation.signs.to(torch.int8).contiguous()
        return out

    @staticmethod
    def check_config(qc: dict, where: str) -> None:
        if qc.get("format_version") != FORMAT_VERSION:
            raise QuantkitError(f"{where} has quantkit format_version {qc.get('format_version')!r}; this version "
                                f"reads {FORMAT_VERSION}: upgrade quantkit or quantize again")
        layers = qc.get("layers")
        if not isinstance(layers, dict) or not layers:
            raise QuantkitError(f"{where} quantization_config 'layers' must list the quantized layers")
        for name, settings in layers.items():
            _check_layer_settings(settings, f"{where} layer {name}")

    @staticmethod
    def read_layers(qc: dict, tensors: dict, where: str) -> list:
        layers = [read_layer(name, settings, tensors, where) for name, settings in qc["layers"].items()]
        listed = set(qc["layers"])
        stray = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith((".qweight", ".codes"))} - listed)
        if stray:
            raise QuantkitError(f"{where}: layer {stray[0]} holds quantized tensors but is not listed in "
                                "quantization_config 'layers': the config is incomplete, quantize again")
        return layers

    @staticmethod
    def build_module(layer: LayerInfo, qc: dict, dtype):
        s = layer.settings
        block = s["rotation"]["block"] if s["rotation"] else None
        if s["quantizer"] == "int":
            return QuantLinear(layer.in_features, layer.out_features, s["bits"], s["group_size"], layer.bias,
                               INT_FORMAT, dtype=dtype, device="meta", rotation_block=block)
        return DecodedLinear(layer.in_features, layer.out_features, quantizer_of(s), s["group_size"],
                             n_groups(layer.in_features, s["group_size"]), layer.bias, dtype, "meta", block)


    @staticmethod
    def layer_result(tensors: dict, name: str, settings: dict, fmt: str) -> QuantResult:
        quantizer = quantizer_of(settings)
        if quantizer.name == "int":
            return to_result(tensors, name, settings, INT_FORMAT)
        g_idx = tensors[f"{name}.g_idx"]
        codes = bitpack.unpack(tensors[f"{name}.codes"], quantizer.code_bits, g_idx.numel(), dim=0)
        return QuantResult(codes=codes.t().contiguous(), g_idx=g_idx, quantizer=quantizer,
                           group_size=settings["group_size"],
                           params={k: tensors[f"{name}.{k}"].float().t().contiguous() for k in quantizer.param_bits})

    @staticmethod
    def compat_problems(config, specs: dict, shapes: dict, fused: dict, fused_experts=frozenset()) -> list:
        what = "rotated" if config.rotate != "none" else config.quantizer
        gptq = "; or --quantizer int --rotate none for a GPTQ checkpoint"
        return [compat.Problem("vllm", f"it reads quant_method 'quantkit' ({what} layers) only through quantkit's "
                                       "plugin", "pip install 'quantkit[vllm]' where vLLM runs" + gptq),
                compat.Problem("gptqmodel", f"it does not read quant_method 'quantkit' ({what} layers)",
                               "load it with quantkit.load_quantized, transformers after `import quantkit`, or vLLM "
                               "with quantkit's plugin" + gptq)]


def layer_settings(res: QuantResult) -> dict:
    """A layer's entry in quantization_config "layers": its quantizer, group size and rotation."""
    return {"quantizer": res.quantizer.name, **res.quantizer.settings(), "group_size": res.group_size,
            "rotation": res.rotation.settings() if res.rotation is not None else None}


def quantizer_of(settings: dict):
    """The quantizer a layer's entry describes."""
    own = {k: v for k, v in settings.items() if k not in ("quantizer", "group_size", "rotation")}
    return make_quantizer(settings["quantizer"], **own)


def _check_layer_settings(settings, where: str) -> None:
    if not isinstance(settings, dict) or "quantizer" not in settings or "group_size" not in settings:
        raise QuantkitError(f"{where} needs 'quantizer' and 'group_size': the checkpoint is damaged")
    check_settings(settings, where)
    check_group_size(settings["group_size"], f"{where} group_size")
    try:
        quantizer_of(settings)
    except TypeError as e:
        raise QuantkitError(f"{where} has settings its quantizer does not take ({e})") from e
    rotation = settings.get("rotation")
    if rotation is None:
        return
    block = rotation.get("block") if isinstance(rotation, dict) else None
    if rotation.get("type") != "hadamard" or not is_int(block) or block < 1 or block & (block - 1):
        raise QuantkitError(f"{where} rotation {rotation!r} is not understood: expected "
                            "{\"type\": \"hadamard\", \"block\": a power of two, \"seed\": ...}")


def read_layer(name, settings, tensors, where) -> LayerInfo:
    """The LayerInfo of layer `name` (its entry in "layers") from its tensors, checked (quantkit.integrations.vllm
    reads a layer vLLM loaded this way too)."""
    settings = {"rotation": None, **settings}
    if settings["quantizer"] == "int":
        layer = check_gptq_layer(name, tensors, settings, INT_FORMAT, where)
    else:
        layer = _check_generic_layer(name, tensors, settings, where)
    if settings["rotation"] is not None:
        _check_rotation(name, tensors.get(f"{name}.rot_signs"), layer.in_features, settings["rotation"]["block"], where)
    return layer


def _check_generic_layer(name, tensors, settings, where) -> LayerInfo:
    quantizer = quantizer_of(settings)
    keys = ("codes", "g_idx", *quantizer.param_bits)
    missing = [s for s in keys if f"{name}.{s}" not in tensors]
    if missing:
        raise QuantkitError(f"{where}: layer {name} lacks {', '.join(missing)}: the checkpoint is incomplete")
    g_idx = tensors[f"{name}.g_idx"]
    k = g_idx.numel()
    n = tensors[f"{name}.codes"].shape[-1]
    groups = n_groups(k, settings["group_size"])
    expected = {"codes": (bitpack.packed_len(k, quantizer.code_bits), n),
                **{key: (groups, n) for key in quantizer.param_bits}}
    dtypes = {"codes": torch.int32, "g_idx": torch.int32, **{key: param_dtype(quantizer, key) for key in quantizer.param_bits}}
    for suffix, shape in expected.items():
        t = tensors[f"{name}.{suffix}"]
        if tuple(t.shape) != shape or t.dtype != dtypes[suffix]:
            raise QuantkitError(f"{where}: {name}.{suffix} is {t.dtype} {tuple(t.shape)}, not {dtypes[suffix]} {shape}: "
                                "the tensors and the config disagree")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise QuantkitError(f"{where}: {name}.{suffix} holds NaN/Inf: the checkpoint is damaged, quantize again")
    if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise QuantkitError(f"{where}: {name}.g_idx holds groups outside 0..{groups - 1}")
    return LayerInfo(name, k, n, dict(settings), f"{name}.bias" in tensors,
                     storage=("codes", *quantizer.param_bits))


def _check_rotation(name, signs, k, block, where) -> None:
    if signs is None:
        raise QuantkitError(f"{where}: rotated layer {name} lacks rot_signs: the checkpoint is incomplete")
    if signs.dtype != torch.int8 or tuple(signs.shape) != (k,) or not bool((signs.abs() == 1).all()):
        raise QuantkitError(f"{where}: {name}.rot_signs must be int8 [{k}] of ±1")
    if k % block:
        raise QuantkitError(f"{where}: {name} rotation block {block} does not divide its {k} inputs")
