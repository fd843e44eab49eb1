"""DecodedLinear: the runtime of a quantkit-format layer whose quantizer is not the integer grid.

Buffers mirror the checkpoint (quantkit.checkpoint.quantkit_format): `codes` (the quantizer's codes packed
along the input dim at its code_bits), one [n_groups, out] tensor per parameter (fp16 when the
quantizer stores it in 16 bits, else float32), g_idx, bias, and rot_signs when rotated.

Quantizers that describe a kernel decode (`kernel_decode`, quantkit.schemes.base.KernelDecode: TurboQuant's
table, w = scale * codebook[code], E8's lattice offset, E8P's int32 tables and residual ratio, or a trellis's
settings) run the codebook dequant-GEMM (quantkit.kernels.codebook) on CUDA: a Triton kernel that decodes in registers
(a trellis: its own, fused up to 16 rows, above decoding the weight for cuBLAS). Everywhere else, forward
decodes the weight a strip of outputs at a time (quantkit.core.strips), so the layer never holds a dense copy: by
table lookups where the quantizer has them (`lookup_of`: TurboQuant, E8P, and E8 at 2 bits; 4x to 29x faster
than its dequantize), through the quantizer for the others (E8 at 3 bits and more, trellises); `cache_dequantized =
True` (as for QuantLinear) decodes it once and keeps it instead (a dense fp32 copy per layer, for speed). A trellis
layer's calls of a few rows (generation; `cpu_trellis.max_rows`: 64 with AVX-512, else 8) skip the strips:
kernels/cpu_trellis.py makes each weight from the packed codes in C and multiplies it at once.
"""
import torch
from torch import nn

from quantkit.core import bitpack, strips
from quantkit.core.matmul import linear
from quantkit.kernels import cpu_trellis
from quantkit.kernels.codebook import (codebook_linear, decode_table, decode_weight, has_lookup, lookup_columns,
                                       lookup_of)
from quantkit.kernels.dispatch import LayerFacts, layer_backend, reserve_workspace
from quantkit.nn.quant_linear import add_rotation, buffers_key, plain_group_size, rotate_input
from quantkit.schemes.base import param_dtype


class DecodedLinear(nn.Module):
    cache_dequantized = False

    def __init__(self, in_features, out_features, quantizer, group_size, n_groups, bias, dtype,
                 device=None, rotation_block=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantizer, self.group_size = quantizer, group_size
        self.register_buffer("codes", torch.empty(bitpack.packed_len(in_features, quantizer.code_bits), out_features,
                                                  dtype=torch.int32, device=device))
        for key in quantizer.param_bits:
            self.register_buffer(key, torch.empty(n_groups, out_features, dtype=param_dtype(quantizer, key),
                                                  device=device))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)
        # How the kernel decodes (None: no kernel, decode through the quantizer). The table is part of the quantizer's
        # settings, not of the state dict.
        self.kernel = getattr(quantizer, "kernel_decode", None)
        table = decode_table(self.kernel, None if device == "meta" else device) if self.kernel is not None else None
        self.register_buffer("codebook", table, persistent=False)
        add_rotation(self, in_features, rotation_block, device)

    def build_codebook(self, device) -> None:
        """The kernel's decode table (the quantizer's settings make it; no checkpoint stores it) on `device`: for
        loaders that fill a module built on the meta device with tensors of their own (transformers, vLLM)."""
        if self.kernel is not None:
            self.codebook = decode_table(self.kernel, device)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, quantizer={self.quantizer.name}, "
                f"bits={self.quantizer.code_bits}, group_size={self.group_size}, rotation_block={self.rotation_block}")

    def weight(self) -> torch.Tensor:
        """The decoded (rotated-basis) weight [out, in], float32; cached until a buffer changes."""
        bufs = [self.codes, self.g_idx] + [getattr(self, k) for k in self.quantizer.param_bits]
        key = buffers_key(bufs)
        cache = self.__dict__.get("_weight_cache")
        if cache is None or cache[0] != key:
            params = {k: getattr(self, k) for k in self.quantizer.param_bits}
            w = decode_weight(self.codes, params, self.g_idx, self.quantizer, self.in_features)
            if not self.cache_dequantized:
                return w
            cache = self.__dict__["_weight_cache"] = (key, w)
        return cache[1]

    def facts(self) -> LayerFacts:
        """What kernels.dispatch.layer_backend reads of this layer."""
        trellis = getattr(self.kernel, "variant", None) == "trellis"
        codebook = "lookup" if has_lookup(self.quantizer) else "trellis" if trellis else "quantizer"
        return LayerFacts(self.in_features, self.out_features, self.quantizer.code_bits, self.group_size,
                          codebook=codebook, kernel=self.kernel is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = rotate_input(self, x)
        backend = layer_backend(self.facts(), x.device.type, x.dtype, self.cache_dequantized).name
        if backend == "triton":
            return codebook_linear(x, self.codes, self.scale, self.g_idx, self.codebook, self.quantizer,
                                   self.in_features, self.bias, backend="triton")  # decided above: not again
        if backend == "dense":
            return linear(x, self.weight().to(x.dtype), self.bias.to(x.dtype) if self.bias is not None else None)
        if cpu_trellis.takes(x, self.quantizer):  # a trellis at decode-time batches: the C product from the codes
            y = cpu_trellis.trellis_linear(x, self.codes, self.scale, self.g_idx, self.quantizer, self.bias)
            if y is not None:
                return y
        # strips of whole tiles of rows (a trellis decodes a tile's rows together)
        row_ranges = strips.ranges(self.out_features, self.in_features, align=getattr(self.quantizer, "row_multiple", 1))
        return strips.strip_linear(x, self._strip_decoder(), row_ranges, self.bias)

    def _strip_decoder(self):
        """decode_columns(a, b) -> Ŵᵀ[:, a:b] for the strips: through the quantizer's Lookup where it has one (what
        the lookups need is settled once per call, not per strip), else through its dequantize."""
        lookup = lookup_of(self.quantizer, self.in_features)
        if lookup is None:
            def through_quantizer(a, b):
                params = {k: getattr(self, k)[:, a:b] for k in self.quantizer.param_bits}
                return decode_weight(self.codes[:, a:b], params, self.g_idx, self.quantizer, self.in_features).t()
            return through_quantizer
        size = plain_group_size(self)
        g_idx = None if size is not None else self.g_idx
        return lambda a, b: lookup_columns(self.codes[:, a:b], self.scale[:, a:b], lookup, self.quantizer.code_bits,
                                           self.in_features, size, g_idx)

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_weight_cache", None)
        moved = super()._apply(fn, *args, **kwargs)
        if self.kernel is not None:  # the fused kernel's split-K scratch (a trellis's: within the codebook bound)
            reserve_workspace(self.codes.device, self.out_features, self.in_features, codebook=True)
        return moved
