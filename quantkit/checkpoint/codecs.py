"""Codecs: QuantResults <-> checkpoint tensors + quantization_config, one file per quant_method, registered.

A codec is a class decorated with `@register_codec` in its own module of this package (quantkit.checkpoint
imports them all). It subclasses Codec and declares:
  quant_method                       the name in quantization_config (how a folder is read back)
  checkpoint_formats                 {--checkpoint-format name: one line of help} that write with it
  accepts(result) / refusal(result)  whether it can store a layer; why not (None when it can)
  quantization_config(config, results, linears, act_order, extra, fused) -> dict
  layer_tensors(result, config, bias_dtype) -> {suffix: tensor}
  check_config(qc, where)            every field it reads, before tensors are read
  read_layers(qc, tensors, where)    -> [LayerInfo], each layer's tensors checked against the config
  build_module(layer, qc, dtype)     -> nn.Module on the meta device, buffers named as the tensors
  layer_result(tensors, name, settings, checkpoint_format) -> QuantResult   a written layer back, exactly (resume)
and may override the hooks below (precheck, check_source, compat_problems, check_folder, int_zero_format,
write_files).

A format either writes its layout or refuses (`fallback` None), or hands the layers it cannot hold to the codec
its `fallback` names: --checkpoint-format gptq writes the GPTQ layout whenever every layer fits it (what serving
stacks read) and the quantkit format otherwise.
"""
from quantkit.checkpoint import shards
from quantkit.core.errors import QuantkitError
from quantkit.core.registry import Registry

CODECS = Registry("checkpoint codec")


def register_codec(cls):
    """Class decorator: `cls` writes its checkpoint_formats and reads folders of its quant_method."""
    return CODECS.add(cls.quant_method, cls)


class Codec:
    """Defaults of the codec protocol (see the module docstring)."""

    quant_method = None
    checkpoint_formats = {}
    fallback = None                # quant_method of the codec that takes layers this one does not accept
    writes_quantize_config = False  # also write quantize_config.json (the AutoGPTQ / GPTQModel convention)
    needs_tokenizer = False         # write_files puts the tokenizer in the weights file (GGUF)
    safetensors = True              # the weights are safetensors files that read_layers reads; else one file of
                                    # another tool's (GGUF), which read_dequantized(folder, config, dtype) decodes
                                    # and write_tensors(folder, tensors, written) writes from memory (convert)

    @classmethod
    def refusal(cls, res) -> str | None:
        return None if cls.accepts(res) else f"the {cls.quant_method} layout cannot hold it"

    @staticmethod
    def precheck(config, specs: dict, shapes: dict) -> None:
        """Refuse, before any calibration, what the settings alone say this format cannot store."""

    @staticmethod
    def check_source(model_config: dict, tokenizer, names: list) -> None:
        """Refuse, before any calibration, a model (config.json as a dict, its tokenizer or None, its tensors' names
        as the checkpoint stores them) the format cannot describe."""

    @staticmethod
    def write_files(folder, order: list, max_shard_bytes: int, rename, written) -> None:
        """The checkpoint's weight files from the run's part files (quantkit.checkpoint.shards), tensors in `order`
        (model names; rename gives the names in the files). written: .config (config.json as it is written, with
        its quantization_config), .tokenizer and .name. Default: safetensors shards."""
        shards.assemble(folder, order, max_shard_bytes, rename)

    layer_bits = None  # (bits, group_size, sym, in_features, out_features) -> the bits the format stores for one
                       # integer layer's weight (codes, scales, zeros, g_idx; not its bias): what --target-bits counts

    @staticmethod
    def compat_problems(config, specs: dict, shapes: dict, fused: dict, fused_experts=frozenset()) -> list:
        """The readers that would refuse the checkpoint (quantkit.checkpoint.compat.Problem list); `fused_experts`
        names the linears of experts the model holds fused (quantkit.run.precheck.fused_expert_linears)."""
        return []

    @staticmethod
    def check_folder(folder, qc: dict) -> None:
        """Checks that need the folder's other files (quantkit's recipe), after check_config."""

    @staticmethod
    def int_zero_format(qc: dict) -> str:
        """The zero convention of its integer layers once read_layers has them in the GPTQ layout."""
        return "gptq_v2"


def write_formats() -> list[str]:
    """Every --checkpoint-format name, "gptq" first (the default)."""
    names = [f for codec in CODECS.values() for f in codec.checkpoint_formats]
    return sorted(names, key=lambda f: (f != "gptq", f))


def format_help() -> str:
    return "; ".join(f"{f}: {codec.checkpoint_formats[f]}" for f in write_formats()
                     for codec in CODECS.values() if f in codec.checkpoint_formats)


def codec_of_format(checkpoint_format: str):
    for codec in CODECS.values():
        if checkpoint_format in codec.checkpoint_formats:
            return codec
    raise QuantkitError(f"unknown checkpoint format '{checkpoint_format}': use one of {', '.join(write_formats())}")


def codec_for(results, checkpoint_format: str = "gptq", names=None):
    """The codec that writes `results` (a dict or values) in `checkpoint_format`; a QuantkitError naming the
    first layer a format without fallback cannot hold, with the fix."""
    items = list(results.items()) if isinstance(results, dict) else [(None, r) for r in results]
    codec = codec_of_format(checkpoint_format)
    if codec.fallback is not None:
        return codec if all(codec.accepts(r) for _, r in items) else CODECS[codec.fallback]
    for name, res in items:
        why = codec.refusal(res)
        if why:
            raise QuantkitError(f"--checkpoint-format {checkpoint_format} cannot store {name or 'a layer'}: {why}")
    return codec


def codec_for_settings(checkpoint_format: str, quantizer_names, rotated: bool):
    """The codec codec_for would pick, from the settings alone: a streamed run packs each block as it finishes,
    before the other layers exist. A format with a fallback keeps unrotated integer grids only."""
    codec = codec_of_format(checkpoint_format)
    if codec.fallback is None or (not rotated and all(q == "int" for q in quantizer_names)):
        return codec
    return CODECS[codec.fallback]


def codec_named(qc: dict, where: str):
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in CODECS:
        raise QuantkitError(f"{where} uses quant_method {method!r}, which this version cannot load: "
                            f"it reads {', '.join(repr(m) for m in sorted(CODECS))} checkpoints")
    return CODECS[method]
