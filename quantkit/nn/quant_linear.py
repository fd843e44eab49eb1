"""QuantLinear: an nn.Linear replacement that holds GPTQ-layout packed tensors.

Buffers mirror the checkpoint (see quantkit.formats.gptq): qweight, qzeros, scales, g_idx, bias.
forward() calls quantkit.kernels.gptq_linear, which picks the Triton fused kernel on CUDA and a
pure-torch path on CPU.
"""
import torch
from torch import nn

from quantkit.formats import bitpack


class QuantLinear(nn.Module):
    def __init__(self, in_features, out_features, bits, group_size, bias, checkpoint_format="gptq",
                 dtype=torch.float16, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        self.checkpoint_format = checkpoint_format
        groups = 1 if group_size == -1 else -(-in_features // group_size)
        kw = dict(device=device)
        self.register_buffer("qweight", torch.empty(bitpack.packed_len(in_features, bits), out_features,
                                                    dtype=torch.int32, **kw))
        self.register_buffer("qzeros", torch.empty(groups, bitpack.packed_len(out_features, bits),
                                                   dtype=torch.int32, **kw))
        self.register_buffer("scales", torch.empty(groups, out_features, dtype=torch.float16, **kw))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32, **kw))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, **kw) if bias else None)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from quantkit.kernels import gptq_linear

        return gptq_linear(x, self.qweight, self.qzeros, self.scales, self.g_idx, self.bits,
                           self.in_features, self.bias, zero_offset=1 if self.checkpoint_format == "gptq" else 0)
