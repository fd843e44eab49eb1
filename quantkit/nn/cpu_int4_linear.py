"""CpuInt4Linear: a GPTQ-layout linear repacked, at load time, for torch's CPU int4 GEMM (quantkit.kernels.cpu_int4).

Why: on the CPU a decode step (a token at a time) is bound by reading the weights, and the int4 GEMM reads half a
byte per weight where a bf16 linear reads two. load_quantized swaps each QuantLinear the op can take for this module
as soon as its tensors are read (`repack_layer`), dropping the GPTQ tensors, so the layer costs about its packed
bytes and no dense copy.

What it holds, per layer of K inputs, N outputs and groups of g (the op's groups of g' = cpu_int4.kernel_group):
  planes  uint8 [P, N, K'/2] the codes in the op's layout (K' = K, or where K is no multiple of 32, K rounded up to
                             whole groups with zero codes), 4 bits per plane: one plane for 2-, 3- and 4-bit codes
                             (2- and 3-bit codes are held as 4-bit ones: faster, at 0.5 byte per weight), two for
                             8-bit codes (low and high nibble: W = W_low + 16 W_high, each plane an int4 GEMM);
  scales  [G, N] as stored (fp16), zeros uint8 [G, N] (the true zero point): the exact decode;
  kernel_scales  bf16 [P, K'/g', N, 2]: the op's per-plane (scale, offset) with w = (q - 8) scale + offset, derived,
                             and only for bf16 activations (the op's): built at the repack when the load is for bf16,
                             else at the first bf16 call (a 2 B-weight model loaded for float16 saves 58 MB);
  perm    int64 [K] or None: an act-order layer's inputs sorted by group, so each group is g consecutive inputs.
Forward: quantkit.kernels.cpu_int4.linear (under torch.compile, the custom op quantkit::cpu_int4_linear): bf16
activations of a few rows go through torch's op (its precision is bf16's); any other call (float32 activations,
prefill, evaluation windows) decodes strip by strip from the exact codes and scales (quantkit.core.strips), which
equals the reference decode.
The module runs on the CPU only: the layout is the CPU kernel's (load with device_map="cuda" for the GPU).
"""

import torch
from torch import nn

from quantkit.core import bitpack
from quantkit.core.errors import QuantkitError
from quantkit.core.memory import return_freed_memory
from quantkit.core.groups import group_order, group_width
from quantkit.kernels import cpu_int4
from quantkit.kernels.cpu_int4 import PLANE_BITS
from quantkit.kernels.dispatch import layer_backend
from quantkit.nn.quant_linear import QuantLinear, add_rotation, rotate_input

REPACK_CODES = 1 << 18  # codes unpacked at a time: 1 MB as int32, a few MB with their temporaries


class CpuInt4Linear(nn.Module):
    def __init__(self, in_features, out_features, bits, group_size, planes, scales, zeros, perm, bias,
                 rotation_block=None, for_bf16=True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_width(in_features, group_size)
        self.register_buffer("planes", planes)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("perm", perm)
        self.register_buffer("bias", bias)
        self.register_buffer("kernel_scales", None, persistent=False)
        if for_bf16:
            self.kernel_scales = self._built_kernel_scales()
        add_rotation(self, in_features, rotation_block, planes.device)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, planes={len(self.planes)}, act_order={self.perm is not None}, "
                f"bias={self.bias is not None}, rotation_block={self.rotation_block}")

    @classmethod
    def from_quant_linear(cls, m: QuantLinear, dtype: torch.dtype = torch.bfloat16):
        """The repacked layer for `dtype` activations, or None where the op does not take it
        (kernels.dispatch.layer_backend says why: N % 16, group size, scattered groups)."""
        k, n, bits = m.in_features, m.out_features, m.bits
        g = group_width(k, m.group_size)
        if layer_backend(m.facts(), m.qweight.device, torch.bfloat16).name != "cpu_int4":
            return None
        perm = group_order(m.g_idx, k, g)
        zeros = (bitpack.unpack(m.qzeros, bits, n, dim=1) + m.zero_offset()) & (2**bits - 1)
        try:
            planes = _repack(m.qweight, bits, k, g, n, perm)
        except RuntimeError:
            return None  # a torch whose layout quantkit cannot read back: the layer stays a QuantLinear
        new = cls(k, n, bits, m.group_size, planes, m.scales, zeros.to(torch.uint8), perm, m.bias, m.rotation_block,
                  for_bf16=dtype == torch.bfloat16)
        if m.rotation_block is not None:
            new.rot_signs = m.rot_signs
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = rotate_input(self, x)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        op = cpu_int4.int4_linear if torch.compiler.is_compiling() else cpu_int4.linear
        return op(x, self.planes, self.scales, self.zeros, self._kernel_scales(x), self.group_size, self.bias)

    def _kernel_scales(self, x: torch.Tensor) -> torch.Tensor:
        """The op's scales for x: built at the first bf16 call where the repack did not build them; other dtypes never
        run the op (an empty tensor stands in)."""
        if self.kernel_scales is None and x.dtype == torch.bfloat16:
            if torch.compiler.is_compiling():  # no module state is set inside a traced graph
                return self._built_kernel_scales()
            self.kernel_scales = self._built_kernel_scales()
        return self.kernel_scales if self.kernel_scales is not None else self.planes.new_empty(0, dtype=torch.bfloat16)

    def _built_kernel_scales(self) -> torch.Tensor:
        return cpu_int4.kernel_scales(self.scales, self.zeros, self.planes, self.in_features, self.group_size)

    def _apply(self, fn, *args, **kwargs):
        if fn(torch.empty(0)).device.type != "cpu":
            raise QuantkitError("this layer was repacked for the CPU's int4 kernel and cannot move to another device: "
                                "load the checkpoint onto the GPU with load_quantized(path, device_map='cuda')")
        return super()._apply(fn, *args, **kwargs)


def _repack(qweight: torch.Tensor, bits: int, k: int, g: int, n: int, perm) -> torch.Tensor:
    """The op's planes [P, N, K'/2] from GPTQ's qweight, REPACK_CODES codes at a time, each strip packed into its rows
    of the planes (strips on block edges, so the strips' packings are the whole layer's). The unpacked int32 codes and
    their shifted copies, 4 bytes and more per weight, never exist for more than a strip: whole, SmolLM2's lm_head
    (49152 x 576) took 230 MB of them at once, and glibc kept much of it as slack for the rest of the process."""
    padded = k + -k % cpu_int4.kernel_group(k, g)
    planes = torch.empty(-(-bits // PLANE_BITS), n, padded // 2, dtype=torch.uint8)
    for a, b in cpu_int4.blocks(n, REPACK_CODES // padded):
        codes = bitpack.unpack(qweight[:, a:b], bits, k, dim=0).t()  # [b - a, K]
        if perm is not None:
            codes = codes.index_select(1, perm)
        codes = torch.nn.functional.pad(codes, (0, padded - k))  # K no multiple of 32: zero codes to whole groups
        for p, plane in enumerate(planes):
            plane[a:b] = cpu_int4.pack(codes >> (PLANE_BITS * p) & 15)
    return planes


def repack_layer(model: nn.Module, name: str, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Swap the QuantLinear `name` for a CpuInt4Linear (for `dtype` activations) where the op takes it (its GPTQ
    tensors are then freed); load_quantized calls it where kernels.dispatch.layer_backend says "cpu_int4"."""
    module = model.get_submodule(name)
    if type(module) is not QuantLinear or (new := CpuInt4Linear.from_quant_linear(module, dtype)) is None:
        return False
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, new)
    return_freed_memory()  # its temporaries, 4 bytes per weight and more (quantkit.core.memory)
    return True
