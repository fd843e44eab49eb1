"""The GGUF codec (quant_method "gguf", --checkpoint-format gguf): llama.cpp's file, its block types, its names.

The folder holds model.gguf, which llama.cpp (llama-cli, llama-perplexity, ollama, LM Studio) runs as it is, beside
config.json, the tokenizer files and quantkit's report, with which quantkit reads the checkpoint back:

    "quantization_config": {"quant_method": "gguf", "gguf_file": "model.gguf", "group_size": 32,
                            "types": {"model.layers.0.mlp.down_proj": "Q4_0", ...}, ... (the run's options)}

A layer is stored as one of llama.cpp's block types (quantkit.gguf.types) when its codes are that
type's codes exactly: an unrotated integer grid of groups of 32, symmetric 4- or 8-bit (Q4_0, Q8_0; GPTQ's
groups, act-order with static groups included), the ggml quantizer (quantkit.gguf.legacy: Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0), the kquant quantizer (quantkit.gguf.kquants: Q2_K .. Q6_K) or one of the IQ quantizers
(quantkit.gguf.iq4: IQ4_NL, IQ4_XS; quantkit.gguf.iq_lattice: IQ2_XXS, IQ3_XXS). While the run lasts each
layer's part holds its blocks as uint8 rows ([out, in / block * block bytes], under `<layer>.weight`); at the end
quantkit.gguf.export writes model.gguf from the parts.
"""
import torch

from quantkit.checkpoint.codecs import Codec, register_codec
from quantkit.checkpoint.quantkit_format import quantizer_of
from quantkit.checkpoint.shards import dtype_name
from quantkit.core.errors import QuantkitError
from quantkit.core.groups import group_index
from quantkit.core.result import QuantResult
from quantkit.gguf import export
from quantkit.gguf.read import read_tensors
from quantkit.gguf.types import TYPES, params_of_type, quantizer_params, type_of_settings

GGUF_FILE = "model.gguf"
FIX = ("use --group-size 32 with --bits 4 or 8 (Q4_0, Q8_0), --quantizer ggml for Q4_1 / Q5_0 / Q5_1, --quantizer "
       "kquant for Q2_K .. Q6_K, iq4nl / iq4xs / iq2xxs / iq3xxs, or --gguf-type (Q4_K_M, ...), without --rotate")


def block_type(res: QuantResult) -> str | None:
    q = res.quantizer
    return type_of_settings(q.name, getattr(q, "bits", None), getattr(q, "sym", None))


def misfit(quantizer: str, bits: int, sym: bool, group_size: int, cols: int) -> str | None:
    """Why a layer of these settings and `cols` inputs has no llama.cpp block type (None when it has one)."""
    name = type_of_settings(quantizer, bits, sym)
    if name is None or group_size != TYPES[name].group_size:
        return f"llama.cpp has no block type for a {bits}-bit {quantizer} layer in groups of {group_size}: {FIX}"
    if cols % TYPES[name].block:
        return (f"its {cols} inputs are not whole {name} blocks of {TYPES[name].block}: keep it in float with a recipe "
                "skip, or use a type of blocks of 32 (--gguf-type falls back to one, as llama.cpp does)")
    return None


def _source(written) -> export.GGUFSource:
    qc = written.config["quantization_config"]
    return export.GGUFSource(written.config, written.tokenizer, written.name, qc["types"], qc.get("gguf_type"))


@register_codec
class GGUFCodec(Codec):
    quant_method = "gguf"
    needs_tokenizer = True
    safetensors = False
    checkpoint_formats = {"gguf": "one llama.cpp file, model.gguf (Q4_0 / Q8_0 from groups of 32; Q4_1 / Q5_0 / "
                                  "Q5_1 with --quantizer ggml; Q2_K .. Q6_K with --quantizer kquant; IQ4_NL, IQ4_XS, "
                                  "IQ2_XXS, IQ3_XXS with --quantizer iq4nl, iq4xs, iq2xxs, iq3xxs; llama.cpp's "
                                  "mixes with --gguf-type), beside config.json and the tokenizer"}

    @staticmethod
    def refusal(res: QuantResult) -> str | None:
        q, cols = res.quantizer, res.shape[1]
        if res.rotation is not None:
            return f"it is rotated, and llama.cpp applies no rotation: {FIX}"
        why = misfit(q.name, getattr(q, "bits", None), getattr(q, "sym", None), res.group_size, cols)
        if why:
            return why
        if not torch.equal(res.g_idx.cpu().long(), torch.arange(cols) // res.group_size):
            return f"its groups are not consecutive blocks of {res.group_size} (act-order needs --static-groups)"
        return None

    @classmethod
    def accepts(cls, res: QuantResult) -> bool:
        return cls.refusal(res) is None

    @staticmethod
    def precheck(config, specs: dict, shapes: dict) -> None:
        if config.rotate != "none":
            raise QuantkitError(f"--checkpoint-format gguf cannot store rotated layers (--rotate {config.rotate}): "
                                f"llama.cpp applies no rotation; {FIX}")
        for name, spec in specs.items():
            why = spec and misfit(spec.quantizer().name, spec.bits, spec.sym, spec.group_size, shapes[name][0])
            if why:
                raise QuantkitError(f"--checkpoint-format gguf cannot store {name}: {why}")

    @staticmethod
    def check_source(model_config: dict, tokenizer, names: list) -> None:
        export.check_source(model_config, tokenizer, names)

    @staticmethod
    def quantization_config(config, results: dict, all_linears, act_order: bool, extra=None, fused=None) -> dict:
        types = {name: block_type(results[name]) for name in all_linears if name in results}
        sizes = [results[name].group_size for name in types]
        return {"quant_method": "gguf", "gguf_file": GGUF_FILE, "group_size": max(set(sizes), key=sizes.count),
                "desc_act": act_order, "types": types,
                **({"gguf_type": config.gguf_type} if getattr(config, "gguf_type", None) else {}), **(extra or {})}

    @staticmethod
    def layer_tensors(res: QuantResult, config, bias_dtype) -> dict:
        params = quantizer_params(res.quantizer, res.params)
        out = {"weight": TYPES[block_type(res)].encode(res.codes, params)}
        if res.bias is not None:
            out["bias"] = res.bias.detach().to(bias_dtype or torch.float16).contiguous()
        return out

    @staticmethod
    def layer_result(tensors: dict, name: str, settings: dict, fmt: str) -> QuantResult:
        """A layer back from its blocks, exactly: codes and parameters as they were rounded with."""
        quantizer = quantizer_of(settings)
        kind = TYPES[type_of_settings(quantizer.name, settings.get("bits"), settings.get("sym"))]
        codes, params = kind.decode(tensors[f"{name}.weight"])
        return QuantResult(codes=codes, params=params_of_type(quantizer, params),
                           g_idx=group_index(codes.shape[1], kind.group_size), quantizer=quantizer,
                           group_size=kind.group_size, bias=tensors.get(f"{name}.bias"))

    @staticmethod
    def write_files(folder, order, max_shard_bytes, rename, written) -> None:
        export.write_from_parts(folder / GGUF_FILE, folder, order, rename, _source(written))

    @staticmethod
    def write_tensors(folder, tensors: dict, written) -> None:
        """model.gguf from tensors in memory, named as in the files (convert)."""
        entries = {n: (dtype_name(t.dtype), list(t.shape)) for n, t in tensors.items()}
        export.write_gguf(folder / GGUF_FILE, list(tensors), entries, tensors.__getitem__, _source(written))

    @staticmethod
    def check_config(qc: dict, where: str) -> None:
        types = qc.get("types")
        if not isinstance(types, dict) or any(t not in TYPES for t in types.values()):
            raise QuantkitError(f"{where}: the gguf quantization_config's 'types' must map layers to "
                                f"{', '.join(TYPES)}: the checkpoint is damaged")
        if qc.get("gguf_file") != GGUF_FILE:
            raise QuantkitError(f"{where}: the gguf quantization_config names file {qc.get('gguf_file')!r}, not "
                                f"{GGUF_FILE}: the checkpoint is damaged")

    @staticmethod
    def read_dequantized(folder, config: dict, dtype) -> dict:
        """{transformers name: float tensor} of model.gguf, decoded as llama.cpp decodes it."""
        return read_tensors(folder / GGUF_FILE, config, dtype)
