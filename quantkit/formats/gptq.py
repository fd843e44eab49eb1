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
import torch

from quantkit.formats import bitpack
from quantkit.methods.result import QuantResult

V1_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


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


def unpack_codes(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """qweight [packed K, N] -> int32 codes [K, N]."""
    return bitpack.unpack(qweight, bits, in_features, dim=0)


def unpack_zeros(qzeros: torch.Tensor, bits: int, out_features: int, checkpoint_format="gptq"):
    """qzeros [G, packed N] -> int32 true zeros [G, N]."""
    z = bitpack.unpack(qzeros, bits, out_features, dim=1)
    return (z + V1_ZERO_OFFSET[checkpoint_format]) & (2**bits - 1) if checkpoint_format == "gptq" else z


def dequantize(t: dict, bits: int, in_features: int, out_features: int, checkpoint_format="gptq"):
    """Full float32 weight [N, K] (nn.Linear orientation) from GPTQ-layout tensors."""
    q = unpack_codes(t["qweight"], bits, in_features).float()
    z = unpack_zeros(t["qzeros"], bits, out_features, checkpoint_format).float()
    g = t["g_idx"].long()
    w = t["scales"].float()[g] * (q - z[g])
    return w.t().contiguous()
