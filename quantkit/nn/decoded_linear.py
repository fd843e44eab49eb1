"""DecodedLinear: the generic runtime of a quantkit-format layer whose quantizer has no kernel of its own.

Buffers mirror the checkpoint (quantkit.formats.quantkit_format): `codes` (the quantizer's codes packed
along the input dim at its code_bits), one float32 [n_groups, out] tensor per parameter, g_idx, bias,
and rot_signs when rotated. forward decodes the weight once through the quantizer and keeps it (a
dense copy per layer, like QuantLinear's CPU path); a quantizer that needs speed brings its own module.
"""
import torch
from torch import nn

from quantkit.formats import bitpack
from quantkit.methods.quantizer import per_column
from quantkit.nn.quant_linear import add_rotation, rotate_input


class DecodedLinear(nn.Module):
    def __init__(self, in_features, out_features, quantizer, group_size, n_groups, bias, dtype,
                 device=None, rotation_block=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantizer, self.group_size = quantizer, group_size
        self.register_buffer("codes", torch.empty(bitpack.packed_len(in_features, quantizer.code_bits), out_features,
                                                  dtype=torch.int32, device=device))
        for key in quantizer.param_bits:
            self.register_buffer(key, torch.empty(n_groups, out_features, dtype=torch.float32, device=device))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)
        add_rotation(self, in_features, rotation_block, device)

    def weight(self) -> torch.Tensor:
        """The decoded (rotated-basis) weight [out, in], float32; cached until a buffer changes."""
        bufs = [self.codes, self.g_idx] + [getattr(self, k) for k in self.quantizer.param_bits]
        key = tuple((t.data_ptr(), t._version) for t in bufs)
        cache = self.__dict__.get("_weight_cache")
        if cache is None or cache[0] != key:
            codes = bitpack.unpack(self.codes, self.quantizer.code_bits, self.in_features, dim=0).t()
            params = {k: getattr(self, k).t() for k in self.quantizer.param_bits}
            cache = self.__dict__["_weight_cache"] = (key, self.quantizer.dequantize(codes, per_column(params, self.g_idx)))
        return cache[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = rotate_input(self, x)
        return nn.functional.linear(x, self.weight().to(x.dtype), self.bias.to(x.dtype) if self.bias is not None else None)

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_weight_cache", None)
        return super()._apply(fn, *args, **kwargs)
