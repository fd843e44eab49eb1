"""QuantResult <-> tensors of the GPTQ checkpoint layout.

Per quantized Linear `<name>` (K = in_features, N = out_features, G = number of groups):
  qweight int32 [packed_len(K, bits), N]   codes packed along the input dim (bitpack.pack, dim 0)
  qzeros  int32 [G, packed_len(N, bits)]   zero points packed along the output dim
  scales  fp16  [G, N]
  g_idx   int32 [K]                        group of each input column
  bias    (as the model's dtype, fp16 by default) [N], when the layer has one
Checkpoint format "gptq" (v1) stores zero - 1 in qzeros (4-bit sym: every word 0x77777777);
"gptq_v2" stores the true zero. We write v1 (what vLLM, TGI and transformers read); our grids keep
asymmetric zeros >= 1 so v1 never wraps. Packed dims take ceil(K * bits / 32) words, the last one
zero-filled (what GPTQModel, transformers/optimum and vLLM allocate, 3-bit included).
"""
import re

import torch
import yaml

from quantkit.checkpoint import compat
from quantkit.checkpoint.codecs import Codec, register_codec
from quantkit.checkpoint.files import RECIPE_NAME
from quantkit.checkpoint.validate import check_gptq_config, check_packed_layers, checkpoint_format
from quantkit.core import bitpack
from quantkit.core.errors import QuantkitError
from quantkit.core.gptq_layout import V1_ZERO_OFFSET
from quantkit.core.groups import is_plain, n_groups
from quantkit.core.result import QuantResult
from quantkit.nn.quant_linear import QuantLinear
from quantkit.schemes.grid import Grid


def to_tensors(res: QuantResult, checkpoint_format: str = "gptq", bias_dtype=None, scale_dtype=torch.float16) -> dict:
    """Tensors (suffix -> tensor) for one Linear, in the GPTQ layout (fp16 scales, as its readers take them;
    scale_dtype other for another tool's bf16/fp32 scales kept at load time, quantkit.checkpoint.repack)."""
    offset, bits = V1_ZERO_OFFSET[checkpoint_format], res.quantizer.bits
    zeros = res.params["zero"].to(torch.int32)
    if offset and bool((zeros < offset).any()):  # v1's zero - 1 would wrap to -1 and spill into its neighbours
        raise QuantkitError("a zero point of 0 cannot be stored in checkpoint format 'gptq' (v1 stores zero - 1): "
                            "use --checkpoint-format gptq_v2")
    out = {
        "qweight": bitpack.pack(res.codes.t(), bits, dim=0),
        "qzeros": bitpack.pack((zeros - offset).t(), bits, dim=1),
        "scales": res.params["scale"].t().to(scale_dtype).contiguous(),
        "g_idx": res.g_idx.to(torch.int32).contiguous(),
    }
    if res.bias is not None:
        out["bias"] = res.bias.detach().to(bias_dtype or torch.float16).contiguous()
    return out


def to_result(tensors: dict, name: str, settings: dict, fmt: str) -> QuantResult:
    """The integer codes, scales and zeros of one GPTQ-layout layer, exactly (the inverse of to_tensors):
    what `quantkit convert` re-encodes in another layout."""
    bits, k = settings["bits"], tensors[f"{name}.g_idx"].numel()
    scales = tensors[f"{name}.scales"]
    n = scales.shape[1]
    zeros = (bitpack.unpack(tensors[f"{name}.qzeros"], bits, n, dim=1) + V1_ZERO_OFFSET[fmt]) & (2**bits - 1)
    return QuantResult(codes=bitpack.unpack(tensors[f"{name}.qweight"], bits, k, dim=0).t().contiguous(),
                       params={"scale": scales.float().t().contiguous(), "zero": zeros.t().contiguous()},
                       g_idx=tensors[f"{name}.g_idx"].to(torch.int32), quantizer=Grid(bits, settings["sym"]),
                       group_size=settings["group_size"], bias=tensors.get(f"{name}.bias"))


def quantization_config(bits, group_size, sym, act_order, checkpoint_format, results: dict, all_linears,
                        extra=None, fused=None) -> dict:
    """config.json's "quantization_config" for GPTQ-aware readers.

    Per-module exceptions use GPTQModel's "dynamic" map (read the same way by vLLM): "+:<regex>" -> {bits,
    group_size, sym} for modules quantized differently from the defaults, "-:<regex>" -> {} for linears left in
    float. fused: {serving name: member linears} (quantkit.models.arch.fused_groups): a group whose members
    share one exception gets one key matching the members and vLLM's fused name (q/k/v and qkv_proj).
    desc_act says whether g_idx is out of order, which is what readers act on: quantkit's act-order uses
    static groups, so g_idx stays k // group_size and desc_act is false; static_groups records the act-order.
    """
    dynamic = _dynamic((bits, group_size, sym), results, all_linears, fused or {})
    qc = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "sym": sym,
        "desc_act": any(_reorders(r) for r in results.values()),
        "static_groups": act_order,
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
    }
    if dynamic:
        qc["dynamic"] = dynamic
    qc.update(extra or {})
    return qc


def _reorders(res: QuantResult) -> bool:
    """Whether a layer's g_idx differs from k // group_size (act-order without static groups)."""
    return not is_plain(res.g_idx, res.g_idx.numel(), res.group_size)


def _exception(base: tuple, res) -> tuple | None:
    """("-", {}) for a linear left in float, ("+", settings) for other settings, None for the defaults."""
    if res is None:
        return ("-", {})
    q = res.quantizer
    if (q.bits, res.group_size, q.sym) == base:
        return None
    return ("+", {"bits": q.bits, "group_size": res.group_size, "sym": q.sym})


def _dynamic(base: tuple, results: dict, all_linears, fused: dict) -> dict:
    group_of = {m: (serving, members) for serving, members in fused.items() for m in members}
    dynamic, done = {}, set()
    for name in all_linears:
        if name in done:
            continue
        exc = _exception(base, results.get(name))
        serving, members = group_of.get(name, (None, ()))
        if members and all(_exception(base, results.get(m)) == exc for m in members):
            done.update(members)
            if exc:
                dynamic[f"{exc[0]}:{_group_pattern(serving, members)}"] = exc[1]
        elif exc:  # a group split by the recipe keeps per-linear keys (vLLM refuses it; the compat report says so)
            dynamic[f"{exc[0]}:^{re.escape(name)}$"] = exc[1]
    return dynamic


def _group_pattern(serving: str, members) -> str:
    """One anchored regex for a fused group: "^model\\.layers\\.0\\.self_attn\\.(?:q_proj|k_proj|v_proj|qkv_proj)$"."""
    parent = serving.rpartition(".")[0]
    names = [*members, serving]
    if all(n.rpartition(".")[0] == parent for n in names):
        return f"^{re.escape(parent)}\\.(?:{'|'.join(re.escape(n.rpartition('.')[2]) for n in names)})$"
    return f"^(?:{'|'.join(re.escape(n) for n in names)})$"


@register_codec
class GPTQCodec(Codec):
    """Integer-grid results without rotation <-> the GPTQ layout (quant_method "gptq", v1 or v2)."""

    quant_method = "gptq"
    checkpoint_formats = {"gptq": "v1, zero-1 stored; what vLLM/TGI/transformers read",
                          "gptq_v2": "true zeros (GPTQModel's v2)"}
    fallback = "quantkit"  # rotated and codebook layers
    writes_quantize_config = True

    @staticmethod
    def accepts(res: QuantResult) -> bool:
        return res.quantizer.name == "int" and res.rotation is None

    @staticmethod
    def quantization_config(config, results: dict, all_linears, act_order: bool, extra=None, fused=None) -> dict:
        return quantization_config(config.bits, config.group_size, config.sym, act_order, config.checkpoint_format,
                                   results, all_linears, extra, fused)

    @staticmethod
    def layer_tensors(res: QuantResult, config, bias_dtype) -> dict:
        return to_tensors(res, config.checkpoint_format, bias_dtype)

    @staticmethod
    def check_config(qc: dict, where: str) -> None:
        check_gptq_config(qc, where)

    @staticmethod
    def read_layers(qc: dict, tensors: dict, where: str) -> list:
        return check_packed_layers(tensors, qc, where)

    @staticmethod
    def build_module(layer, qc: dict, dtype):
        return QuantLinear(layer.in_features, layer.out_features, layer.bits, layer.group_size, layer.bias,
                           checkpoint_format(qc), dtype=dtype, device="meta")

    @staticmethod
    def layer_result(tensors: dict, name: str, settings: dict, fmt: str) -> QuantResult:
        return to_result(tensors, name, settings, fmt)

    @staticmethod
    def layer_bits(bits: int, group_size: int, sym: bool, in_features: int, out_features: int) -> int:
        """qweight, qzeros (stored for symmetric layers too) and g_idx as int32 words, scales in float16."""
        groups = n_groups(in_features, group_size)
        words = (bitpack.packed_len(in_features, bits) * out_features + groups * bitpack.packed_len(out_features, bits)
                 + in_features)
        return 32 * words + 16 * groups * out_features

    @staticmethod
    def compat_problems(config, specs: dict, shapes: dict, fused: dict, fused_experts=frozenset()) -> list:
        return compat.gptq_problems(config, specs, shapes, fused, fused_experts)

    @staticmethod
    def check_folder(folder, qc: dict) -> None:
        """The zero-point convention cannot be read off asymmetric tensors; quantkit's own recipe records it."""
        recipe = folder / RECIPE_NAME
        try:
            written = yaml.safe_load(recipe.read_text()).get("checkpoint_format") if recipe.is_file() else None
        except (yaml.YAMLError, AttributeError, UnicodeDecodeError):
            written = None
        declared = checkpoint_format(qc)
        if written is not None and written != declared:
            raise QuantkitError(f"{folder}/config.json says checkpoint_format {declared!r} but the checkpoint was "
                                f"written as {written!r} ({RECIPE_NAME}): restore checkpoint_format {written!r} in "
                                "config.json")

    int_zero_format = staticmethod(checkpoint_format)
