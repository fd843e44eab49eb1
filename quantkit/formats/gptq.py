"""QuantResult <-> tensors of the GPTQ checkpoint layout.

Per quantized Linear `<name>` (K = in_features, N = out_features, G = number of groups):
  qweight int32 [packed_len(K, bits), N]   codes packed along the input dim (bitpack.pack, dim 0)
  qzeros  int32 [G, packed_len(N, bits)]   zero points packed along the output dim
  scales  fp16  [G, N]
  g_idx   int32 [K]                        group of each input column
  bias    (as the model's dtype, fp16 by default) [N], when the layer has one
Checkpoint format "gptq" (v1) stores zero - 1 in qzeros (4-bit sym: every word 0x77777777);
"gptq_v2" stores the true zero. We write v1 (what vLLM, TGI and transformers read); our grids keep
asymmetric zeros >= 1 so v1 never wraps. K or N not aligned to the packing unit are zero-padded.
"""
import re

import torch

from quantkit.formats import bitpack
from quantkit.methods.result import QuantResult

V1_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}
CHECKPOINT_FORMATS = tuple(V1_ZERO_OFFSET)


def to_tensors(res: QuantResult, checkpoint_format: str = "gptq", bias_dtype=torch.float16) -> dict:
    """Tensors (suffix -> tensor) for one Linear, in the GPTQ layout."""
    offset = V1_ZERO_OFFSET[checkpoint_format]
    out = {
        "qweight": bitpack.pack(res.qweight.t(), res.bits, dim=0),
        "qzeros": bitpack.pack((res.zeros - offset).t(), res.bits, dim=1),
        "scales": res.scales.t().to(torch.float16).contiguous(),
        "g_idx": res.g_idx.to(torch.int32).contiguous(),
    }
    if res.bias is not None:
        out["bias"] = res.bias.detach().to(bias_dtype).contiguous()
    return out


def decode(qweight, qzeros, scales, g_idx, bits: int, in_features: int, zero_offset: int = 1) -> torch.Tensor:
    """float32 W^T [in_features, out_features] from GPTQ-layout tensors (zero_offset 1 for v1, 0 for v2).

    w = scales[g] * (q - z[g]) in float32 is exact: an fp16 scale times an integer below 2^8 fits in
    fp32's mantissa; the mask undoes v1's wrap of a stored zero - 1."""
    q = bitpack.unpack(qweight, bits, in_features, dim=0)
    z = (bitpack.unpack(qzeros, bits, scales.shape[1], dim=1) + zero_offset) & (2**bits - 1)
    g = g_idx.long()
    return (q - z.index_select(0, g)).float().mul_(scales.float().index_select(0, g))


def dequantize(t: dict, bits, in_features, out_features, checkpoint_format="gptq"):
    """Full float32 weight [N, K] (nn.Linear orientation) from one layer's GPTQ-layout tensors."""
    w_t = decode(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, in_features,
                 V1_ZERO_OFFSET[checkpoint_format])
    if w_t.shape[1] != out_features:
        raise ValueError(f"scales hold {w_t.shape[1]} outputs, not {out_features}")
    return w_t.t().contiguous()


def model_tensors(state_dict: dict, results: dict, checkpoint_format="gptq") -> dict:
    """The checkpoint's tensors: packed ones for quantized modules, everything else as it is."""
    out = {}
    for name, t in state_dict.items():
        module, _, leaf = name.rpartition(".")
        if module in results and leaf in ("weight", "bias"):
            continue
        out[name] = t
    for module, res in results.items():
        bias_dtype = state_dict.get(f"{module}.bias", torch.empty(0, dtype=torch.float16)).dtype
        for suffix, t in to_tensors(res, checkpoint_format, bias_dtype).items():
            out[f"{module}.{suffix}"] = t
    return out


def quantization_config(bits, group_size, sym, act_order, checkpoint_format, results: dict, all_linears,
                        extra=None) -> dict:
    """config.json's "quantization_config" for GPTQ-aware readers.

    Per-module exceptions use GPTQModel's "dynamic" map: "+:^name$" -> {bits, group_size, sym} for a
    module quantized differently from the defaults, "-:^name$" -> {} for a linear left in float.
    """
    dynamic = {}
    for name in all_linears:
        res = results.get(name)
        if res is None:
            dynamic[f"-:^{re.escape(name)}$"] = {}
        elif (res.bits, res.group_size, res.sym) != (bits, group_size, sym):
            dynamic[f"+:^{re.escape(name)}$"] = {"bits": res.bits, "group_size": res.group_size, "sym": res.sym}
    qc = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "sym": sym,
        "desc_act": act_order,
        "static_groups": act_order,  # act-order here always uses static groups: g_idx stays i // group_size
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
    }
    if dynamic:
        qc["dynamic"] = dynamic
    qc.update(extra or {})
    return qc


def parse_dynamic_key(key: str) -> tuple[str, str]:
    """("+" or "-", regex) of a "dynamic" key; GPTQModel reads a key without a sign as "+"."""
    if key[:2] in ("+:", "-:"):
        return key[0], key[2:]
    return "+", key


def module_settings(qc: dict, name: str) -> tuple[int, int, bool]:
    """(bits, group_size, sym) of module `name` under a quantization_config (with "dynamic")."""
    settings = {"bits": qc["bits"], "group_size": qc["group_size"], "sym": qc.get("sym", True)}
    for key, override in (qc.get("dynamic") or {}).items():
        sign, pattern = parse_dynamic_key(key)
        if sign == "+" and re.match(pattern, name):
            settings.update({k: override[k] for k in settings if k in override})
    return settings["bits"], settings["group_size"], settings["sym"]
