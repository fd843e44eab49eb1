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

from quantkit.core import bitpack
from quantkit.core.errors import QuantkitError
from quantkit.core.result import QuantResult
from quantkit.schemes.grid import Grid

V1_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}
CHECKPOINT_FORMATS = tuple(V1_ZERO_OFFSET)
WRITE_FORMATS = (*CHECKPOINT_FORMATS, "awq", "compressed-tensors")  # --checkpoint-format (checkpoint/codecs.py)


def to_tensors(res: QuantResult, checkpoint_format: str = "gptq", bias_dtype=None) -> dict:
    """Tensors (suffix -> tensor) for one Linear, in the GPTQ layout."""
    offset, bits = V1_ZERO_OFFSET[checkpoint_format], res.quantizer.bits
    zeros = res.params["zero"].to(torch.int32)
    if offset and bool((zeros < offset).any()):  # v1's zero - 1 would wrap to -1 and spill into its neighbours
        raise QuantkitError("a zero point of 0 cannot be stored in checkpoint format 'gptq' (v1 stores zero - 1): "
                            "use --checkpoint-format gptq_v2")
    out = {
        "qweight": bitpack.pack(res.codes.t(), bits, dim=0),
        "qzeros": bitpack.pack((zeros - offset).t(), bits, dim=1),
        "scales": res.params["scale"].t().to(torch.float16).contiguous(),
        "g_idx": res.g_idx.to(torch.int32).contiguous(),
    }
    if res.bias is not None:
        out["bias"] = res.bias.detach().to(bias_dtype or torch.float16).contiguous()
    return out


def decode(qweight, qzeros, scales, g_idx, bits: int, in_features: int, zero_offset: int = 1) -> torch.Tensor:
    """float32 W^T [in_features, out_features] from GPTQ-layout tensors (zero_offset 1 for v1, 0 for v2).

    w = scales[g] * (q - z[g]) in float32 is exact: an fp16 scale times an integer below 2^8 fits in
    fp32's mantissa; the mask undoes v1's wrap of a stored zero - 1."""
    q = bitpack.unpack(qweight, bits, in_features, dim=0)
    z = (bitpack.unpack(qzeros, bits, scales.shape[1], dim=1) + zero_offset) & (2**bits - 1)
    g = g_idx.long()
    return (q - z.index_select(0, g)).float().mul_(scales.float().index_select(0, g))


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


def dequantize(t: dict, bits, in_features, out_features, checkpoint_format="gptq"):
    """Full float32 weight [N, K] (nn.Linear orientation) from one layer's GPTQ-layout tensors."""
    w_t = decode(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, in_features,
                 V1_ZERO_OFFSET[checkpoint_format])
    if w_t.shape[1] != out_features:
        raise ValueError(f"scales hold {w_t.shape[1]} outputs, not {out_features}")
    return w_t.t().contiguous()


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
    k = res.g_idx.numel()
    plain = torch.zeros(k, dtype=torch.long) if res.group_size == -1 else torch.arange(k) // res.group_size
    return not torch.equal(res.g_idx.long().cpu(), plain)


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
    for key, override in (qc.get("dynamic") or {}).items():
        sign, pattern = parse_dynamic_key(key)
        if re.match(pattern, name):
            if sign == "+":
                settings.update({k: override[k] for k in settings if k in override})
            break
    return settings["bits"], settings["group_size"], settings["sym"]


class GPTQCodec:
    """Integer-grid results without rotation <-> the GPTQ layout (quant_method "gptq", v1 or v2)."""

    quant_method = "gptq"

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
        from quantkit.checkpoint.validate import check_gptq_config

        check_gptq_config(qc, where)

    @staticmethod
    def read_layers(qc: dict, tensors: dict, where: str) -> list:
        from quantkit.checkpoint.validate import check_packed_layers

        return check_packed_layers(tensors, qc, where)

    @staticmethod
    def build_module(layer, qc: dict, dtype):
        from quantkit.nn.quant_linear import QuantLinear

        return QuantLinear(layer.in_features, layer.out_features, layer.bits, layer.group_size, layer.bias,
                           checkpoint_format(qc), dtype=dtype, device="meta")
