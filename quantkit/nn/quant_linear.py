"""QuantLinear: an nn.Linear replacement that holds GPTQ-layout packed tensors.

Buffers mirror the checkpoint (see quantkit.checkpoint.gptq): qweight, qzeros, scales, g_idx, bias, and
rot_signs for a rotated layer of the quantkit format (its forward computes Ŵ (Π x)).
forward() asks kernels.dispatch.layer_backend what runs it (the one place that decides): on CUDA the custom op
torch.ops.quantkit.gptq_linear (the Triton kernels, or the torch reference); on the CPU a strip-by-strip decode
(quantkit.core.strips), or the decoded weight kept when asked to (see below). load_quantized repacks the layers torch's
CPU int4 GEMM can take into quantkit.nn.cpu_int4_linear on the CPU; this module's CPU forward serves the others and
streamed models.
"""
import torch
from torch import nn

from quantkit.core import bitpack, gptq_layout, strips
from quantkit.core.gptq_layout import V1_ZERO_OFFSET
from quantkit.core.groups import group_order, group_width, is_plain, n_groups
from quantkit.kernels.dispatch import LayerFacts, gptq_linear_op, layer_backend, reserve_workspace
from quantkit.kernels.reference import dequantize_weight, linear_dequantized
from quantkit.kernels.rotation import rotate_activations


def add_rotation(module: nn.Module, in_features: int, block, device) -> None:
    """A rotated layer (quantkit.schemes.rotation) holds the signs of Π; its forward rotates x first."""
    module.rotation_block = block
    if block is not None:
        module.register_buffer("rot_signs", torch.empty(in_features, dtype=torch.int8, device=device))


def rotate_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Π x for a rotated layer (the weight was stored as W Πᵀ), x unchanged otherwise."""
    if module.rotation_block is None:
        return x
    return rotate_activations(x, module.rot_signs, module.rotation_block)


def plain_group_size(module: nn.Module):
    """A quantized linear's group size when its g_idx is the plain k // group_size (no act-order), else None;
    checked once per g_idx (until the buffer is replaced or changed in place), not on every forward."""
    key = buffers_key((module.g_idx,))
    known = module.__dict__.get("_plain_groups")
    if known is None or known[0] != key:
        plain = is_plain(module.g_idx, module.in_features, module.group_size)
        size = group_width(module.in_features, module.group_size) if plain else None
        known = module.__dict__["_plain_groups"] = (key, size)
    return known[1]


def grid_facts(in_features, out_features, bits, group_size, g_idx, scales_dtype) -> LayerFacts:
    """A GPTQ-layout layer's LayerFacts (kernels.dispatch), its g_idx read for act-order groups."""
    order = group_order(g_idx, in_features, group_size)
    groups = "plain" if order is None else "scattered" if order is False else "sorted"
    return LayerFacts(in_features, out_features, bits, group_size, groups, scales_dtype)


def buffers_key(buffers) -> tuple:
    """What a decoded-weight cache is valid for: each buffer's storage and in-place version (tensors made under
    torch.inference_mode, e.g. a model loaded there, track no version: their storage alone)."""
    return tuple((t.data_ptr(), 0 if t.is_inference() else t._version) for t in buffers)


class QuantLinear(nn.Module):
    def __init__(self, in_features, out_features, bits, group_size, bias, checkpoint_format="gptq",
                 dtype=torch.float16, device=None, rotation_block=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        self.checkpoint_format = checkpoint_format
        groups = n_groups(in_features, group_size)
        kw = dict(device=device)
        self.register_buffer("qweight", torch.empty(bitpack.packed_len(in_features, bits), out_features,
                                                    dtype=torch.int32, **kw))
        self.register_buffer("qzeros", torch.empty(groups, bitpack.packed_len(out_features, bits),
                                                   dtype=torch.int32, **kw))
        self.register_buffer("scales", torch.empty(groups, out_features, dtype=torch.float16, **kw))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32, **kw))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, **kw) if bias else None)
        add_rotation(self, in_features, rotation_block, device)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, rotation_block={self.rotation_block}")

    # CPU forward: by default the weight is decoded a strip of outputs at a time for each call (quantkit.core.strips),
    # so the layer costs its packed bytes and never a dense copy. `cache_dequantized = True` (class or instance;
    # load_quantized(cache_dequantized=True)) keeps the decoded W^T after the first call instead: a forward as fast as
    # nn.Linear's for one dense copy per layer (fp32 for fp16/fp32 activations, 8x the int4 bytes; bf16 4x). That
    # copy lives outside state_dict, is rebuilt when a buffer is replaced or changed in place (data_ptr / _version),
    # and dropped when the module moves (_apply). On CUDA nothing is cached: the Triton kernel decodes in registers.
    # Under torch.compile the op is called as is (the graph cannot hold eager Python state).
    cache_dequantized = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = rotate_input(self, x)
        if not torch.compiler.is_compiling():
            backend = layer_backend(self.facts(), x.device.type, x.dtype, self.cache_dequantized).name
            if backend == "dense":
                return linear_dequantized(x, self._cached_weight(x.dtype), self.bias)
            if backend in ("strips", "cpu_int4"):  # cpu_int4: a layer load_quantized did not repack (streamed)
                row_ranges = strips.ranges(self.out_features, self.in_features, align=32)
                return strips.strip_linear(x, self._decode_columns, row_ranges, self.bias)
        return gptq_linear_op(x, self.qweight, self.qzeros, self.scales, self.g_idx, self.bits,
                              self.in_features, self.bias, self.zero_offset())

    def facts(self) -> LayerFacts:
        """What kernels.dispatch.layer_backend reads of this layer; settled once per g_idx, as plain_group_size is."""
        key = buffers_key((self.g_idx,)) + (self.scales.dtype,)
        known = self.__dict__.get("_facts")
        if known is None or known[0] != key:
            known = self.__dict__["_facts"] = (key, grid_facts(self.in_features, self.out_features, self.bits,
                                                               self.group_size, self.g_idx, self.scales.dtype))
        return known[1]

    def _decode_columns(self, a: int, b: int) -> torch.Tensor:
        """W^T[:, a:b] [in_features, b - a] in float32; a and b - a multiples of 32 (or b the last output), the unit
        the zeros are packed in."""
        words = slice(bitpack.packed_len(a, self.bits), bitpack.packed_len(b, self.bits))
        return gptq_layout.decode(self.qweight[:, a:b], self.qzeros[:, words], self.scales[:, a:b], self.g_idx,
                                  self.bits, self.in_features, self.zero_offset(), plain_group_size(self))

    def zero_offset(self) -> int:
        """What the stored zeros are off by: a gptq (v1) checkpoint stores zero - 1, gptq_v2 the zero itself, so
        the true zero is (stored + zero_offset()) mod 2^bits."""
        return V1_ZERO_OFFSET[self.checkpoint_format]

    def _cached_weight(self, dtype):
        """Decoded W^T rounded to `dtype` exactly as the reference does (kept as fp32 for fp16)."""
        bufs = (self.qweight, self.qzeros, self.scales, self.g_idx)
        key = (dtype,) + buffers_key(bufs)
        cache = self.__dict__.get("_weight_cache")
        if cache is None or cache[0] != key:
            w = dequantize_weight(*bufs, self.bits, self.in_features, self.zero_offset(), dtype=dtype)
            w = w.float() if dtype == torch.float16 else w
            # kept as W^T over [out, in] rows, the layout oneDNN multiplies by (kernels/reference.linear_dequantized)
            cache = self.__dict__["_weight_cache"] = (key, w.t().contiguous().t())
        return cache[1]

    def clear_cache(self):
        self.__dict__.pop("_weight_cache", None)

    def _apply(self, fn, *args, **kwargs):
        self.clear_cache()
        moved = super()._apply(fn, *args, **kwargs)
        reserve_workspace(self.qweight.device, self.out_features, self.in_features)
        return moved
