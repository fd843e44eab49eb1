"""Codecs: QuantResults <-> checkpoint tensors + quantization_config, one per quant_method, by name.

A codec offers (duck-typed; see GPTQCodec and QuantkitCodec):
  quant_method                                         the name in quantization_config
  accepts(result) -> bool                              whether it can store this layer
  quantization_config(config, results, linears, act_order, extra) -> dict
  layer_tensors(result, config, bias_dtype) -> {suffix: tensor}
  check_config(qc, where)                              every field it reads, before tensors are read
  read_layers(qc, tensors, where) -> [LayerInfo]       each layer's tensors checked against the config
  build_module(layer, qc, dtype) -> nn.Module          on the meta device, buffers named as the tensors
Writing picks the GPTQ layout whenever every layer fits it (what serving stacks read), the quantkit
format otherwise; reading picks by quant_method. Loading, inspect and validation ask the codec.
"""
from quantkit.errors import QuantkitError
from quantkit.formats.gptq import GPTQCodec
from quantkit.formats.quantkit_format import QuantkitCodec

CODECS = {codec.quant_method: codec for codec in (GPTQCodec, QuantkitCodec)}
WRITE_PREFERENCE = (GPTQCodec, QuantkitCodec)


def codec_for(results) -> type:
    """The first codec (in WRITE_PREFERENCE) that can store every result."""
    results = list(results)
    return next(c for c in WRITE_PREFERENCE if all(c.accepts(r) for r in results))


def codec_named(qc: dict, where: str):
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in CODECS:
        raise QuantkitError(f"{where} uses quant_method {method!r}, which this version cannot load: "
                            f"it reads {' and '.join(repr(m) for m in CODECS)} checkpoints")
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
