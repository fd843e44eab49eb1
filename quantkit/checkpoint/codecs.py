"""Codecs: QuantResults <-> checkpoint tensors + quantization_config, one per quant_method, by name.

A codec offers (duck-typed; see GPTQCodec and QuantkitCodec):
  quant_method                                         the name in quantization_config
  accepts(result) -> bool                              whether it can store this layer
  quantization_config(config, results, linears, act_order, extra) -> dict
  layer_tensors(result, config, bias_dtype) -> {suffix: tensor}
  check_config(qc, where)                              every field it reads, before tensors are read
  read_layers(qc, tensors, where) -> [LayerInfo]       each layer's tensors checked against the config
  build_module(layer, qc, dtype) -> nn.Module          on the meta device, buffers named as the tensors
  refusal(result) -> str | None                        (awq, compressed-tensors) why it cannot store a layer
Writing with --checkpoint-format gptq/gptq_v2 picks the GPTQ layout whenever every layer fits it (what serving
stacks read), the quantkit format otherwise; awq and compressed-tensors write their layout or refuse. Reading
picks by quant_method. Loading, inspect and validation ask the codec.
"""
from quantkit.checkpoint.awq import AWQCodec
from quantkit.checkpoint.compressed_tensors import CompressedTensorsCodec
from quantkit.checkpoint.gptq import GPTQCodec
from quantkit.checkpoint.quantkit_format import QuantkitCodec
from quantkit.core.errors import QuantkitError

CODECS = {codec.quant_method: codec for codec in (GPTQCodec, QuantkitCodec, AWQCodec, CompressedTensorsCodec)}
WRITE_PREFERENCE = (GPTQCodec, QuantkitCodec)
STRICT = {"awq": AWQCodec, "compressed-tensors": CompressedTensorsCodec}  # their layout, or an error


def codec_for(results, checkpoint_format: str = "gptq", names=None) -> type:
    """The codec that writes `results` (a dict or values) in `checkpoint_format`; a QuantkitError naming the
    first layer a strict format cannot hold, with the fix."""
    items = list(results.items()) if isinstance(results, dict) else [(None, r) for r in results]
    codec = STRICT.get(checkpoint_format)
    if codec is None:
        return next(c for c in WRITE_PREFERENCE if all(c.accepts(r) for _, r in items))
    for name, res in items:
        why = codec.refusal(res)
        if why:
            raise QuantkitError(f"--checkpoint-format {checkpoint_format} cannot store {name or 'a layer'}: {why}")
    return codec


def codec_for_settings(checkpoint_format: str, quantizer_names, rotated: bool) -> type:
    """The codec codec_for would pick, from the settings alone: a streamed run packs each block as it finishes,
    before the other layers exist. GPTQCodec.accepts reads only the quantizer's name and the rotation."""
    if checkpoint_format in STRICT:
        return STRICT[checkpoint_format]
    fits = not rotated and all(q == "int" for q in quantizer_names)
    return GPTQCodec if fits else QuantkitCodec


def precheck(config, specs: dict, shapes: dict) -> None:
    """The refusals of a strict format that the settings alone decide, before any calibration."""
    fmt = config.checkpoint_format
    if fmt not in STRICT:
        return
    if config.quantizer != "int" or config.rotate != "none":
        raise QuantkitError(f"--checkpoint-format {fmt} stores unrotated integer grids only: use --quantizer int "
                            "--rotate none, or --checkpoint-format gptq (written in the quantkit format)")
    kinds = sorted({(s.bits, s.group_size) for s in specs.values() if s is not None})
    if fmt == "awq" and len(kinds) > 1:
        raise QuantkitError(f"--checkpoint-format awq has one bits/group_size for every layer, and the recipe gives "
                            f"{kinds}: drop its bits/group_size overrides, or use --checkpoint-format compressed-tensors")
    for name, spec in specs.items():
        k, n = shapes[name]
        if spec is None:
            continue
        if fmt == "awq" and spec.bits != 4:
            raise QuantkitError(f"--checkpoint-format awq stores 4-bit codes only ({name} has {spec.bits}): "
                                "use --bits 4, or --checkpoint-format compressed-tensors")
        if fmt == "awq" and (spec.group_size == -1 or k % spec.group_size or n % 8):
            raise QuantkitError(f"--checkpoint-format awq needs a group size dividing every layer's inputs and outputs "
                                f"in multiples of 8 ({name}: {k} inputs, {n} outputs, group size {spec.group_size}): "
                                "pick such a --group-size, or use --checkpoint-format compressed-tensors")


def codec_named(qc: dict, where: str):
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in CODECS:
        raise QuantkitError(f"{where} uses quant_method {method!r}, which this version cannot load: "
                            f"it reads {', '.join(repr(m) for m in CODECS)} checkpoints")
    return CODECS[method]


def model_tensors(state_dict: dict, results: dict, codec, config) -> dict:
    """The checkpoint's tensors: the codec's for quantized modules, everything else as it is."""
    out = {}
    for name, t in state_dict.items():
        module, _, leaf = name.rpartition(".")
        if module in results and leaf in ("weight", "bias"):
            continue
        out[name] = t
    for module, res in results.items():
        bias = state_dict.get(f"{module}.bias")
        for suffix, t in codec.layer_tensors(res, config, bias.dtype if bias is not None else None).items():
            out[f"{module}.{suffix}"] = t
    return out


def layer_result(codec, tensors: dict, name: str, settings: dict, checkpoint_format: str):
    """One layer back from the tensors `codec.layer_tensors` wrote for it (settings: its quantizer, group size
    and rotation, as the quantkit format lists them): what --resume decodes to replay a finished block. Exact:
    codes, fp16 scales, integer zeros and rotation signs round-trip unchanged, so res.dequantize() equals the
    weight the run computed with, bit for bit, on the same device."""
    import dataclasses

    import torch

    from quantkit.checkpoint import awq, compressed_tensors, gptq, quantkit_format
    from quantkit.core import bitpack
    from quantkit.core.result import QuantResult
    from quantkit.schemes.rotation import Rotation

    quantizer = quantkit_format._quantizer(settings)
    where = "the run being resumed"
    if codec is AWQCodec:
        res = awq.from_tensors(tensors, name, settings["group_size"], where)
    elif codec is CompressedTensorsCodec:
        args = compressed_tensors.weights_args(settings["bits"], settings["group_size"], settings["sym"])
        res = compressed_tensors.from_tensors(tensors, name, args, where)
    elif quantizer.name == "int":
        fmt = checkpoint_format if codec is GPTQCodec else quantkit_format.INT_FORMAT
        res = gptq.to_result(tensors, name, settings, fmt)
    else:
        g_idx = tensors[f"{name}.g_idx"]
        codes = bitpack.unpack(tensors[f"{name}.codes"], quantizer.code_bits, g_idx.numel(), dim=0)
        res = QuantResult(codes=codes.t().contiguous(), g_idx=g_idx, quantizer=quantizer,
                          group_size=settings["group_size"],
                          params={k: tensors[f"{name}.{k}"].float().t().contiguous() for k in quantizer.param_bits})
    rotation = settings.get("rotation")
    if rotation is not None:
        signs = tensors[f"{name}.rot_signs"]
        rotation = Rotation(signs.to(torch.int8), rotation["block"], rotation["seed"])
    return dataclasses.replace(res, quantizer=quantizer, rotation=rotation, bias=None)
