"""The layers scripts/bench_kernels.py times: one builder per format, random codes of a linear in each layout quantkit
runs on the GPU, with the op a loaded model calls for it.

Each `Layer` holds that op (x [M, K] -> [M, N]), the weight it computes with as a dense fp16 [N, K] (what the check
compares against, in the rotated basis for a rotated layer, and the fp16 baseline's weight), the bytes of weight
data one call reads (codes, scales, zeros, g_idx, rotation signs: for % of peak bandwidth at M = 1), and torch's own
INT4 kernel (tinygemm, scripts/tinygemm.py) on the same codes where it takes them.
  int2, int3, int4, int8  the GPTQ layout, symmetric (every zero 2^(b-1)); kernels.gptq_linear
  int4-asym            the same with a random zero per group
  int4-rotated         int4 behind the input's randomized Hadamard rotation (a rotated layer's whole forward:
                       kernels.rotation.rotate_activations, then gptq_linear)
  turboquant4/3, e8p2  codebook layers (the quantkit format): kernels.codebook.codebook_linear with TurboQuant's
                       Lloyd-Max levels (block = the group size) or QuIP#'s E8P ball at 2 bits
  trellis2/3           trellis layers (QTIP's bitshift trellis, the default L = 16 on 64 x 4 tiles): the same call, the
                       weight decoded by kernels/triton_trellis.py, then cuBLAS; trellis2-l12 / trellis3-l12 the fast
                       setting (--quantizer trellis-l12: L = 12 on 32 x 2 tiles)
Codes are random words: every code of these layouts decodes to a valid weight (any bit stream is a trellis path),
and the kernels' speed does not depend on the values.
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import tinygemm  # scripts/tinygemm.py, beside this file

FORMATS = ("int4", "int4-asym", "int2", "int3", "int8", "int4-rotated", "turboquant4", "turboquant3", "e8p2",
           "trellis2", "trellis3", "trellis2-l12", "trellis3-l12")


@dataclass
class Layer:
    op: Callable
    weight: torch.Tensor
    nbytes: int
    rotate: Optional[Callable] = None
    tinygemm: Optional[Callable] = None
    dequantize: Optional[Callable] = None  # (dtype) -> (the prefill path's decoded Wᵀ, the reference's): GPTQ only

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ in float64 (after the layer's rotation of x, rounded to x's dtype as the op rounds it)."""
        x = self.rotate(x) if self.rotate is not None else x
        return x.double() @ self.weight.to(x.dtype).double().t()


def build(fmt: str, n: int, k: int, group_size: int, device, path: str = "auto") -> Layer:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt.startswith("int"):
        bits = int(fmt[3])
        return _gptq(n, k, bits, group_size, device, path, sym=not fmt.endswith("asym"),
                     rotated=fmt.endswith("rotated"))
    from quantkit.schemes.e8p import E8P
    from quantkit.schemes.trellis import FAST_SETTING, Trellis
    from quantkit.schemes.turboquant import TurboQuant

    if fmt.startswith("trellis"):  # "trellisB": the default; "trellisB-l12": the fast setting
        bits = int(fmt[len("trellis")])
        return _codebook(n, k, Trellis(bits, **(FAST_SETTING if fmt.endswith("-l12") else {})), group_size, device)
    bits = int(fmt[-1])
    quantizer = E8P(2) if fmt == "e8p2" else TurboQuant(bits, group_size)
    return _codebook(n, k, quantizer, group_size, device)


def _scales(groups: int, n: int, gen, device) -> torch.Tensor:
    return (torch.rand(groups, n, generator=gen) * 0.01 + 0.001).half().to(device)


def _random_words(rows: int, n: int, gen, device) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, (rows, n), dtype=torch.int32, generator=gen).to(device)


def _gptq(n, k, bits, group_size, device, path, sym: bool, rotated: bool) -> Layer:
    from quantkit.core import bitpack
    from quantkit.kernels import gptq_linear
    from quantkit.kernels.reference import dequantize_weight

    gen = torch.Generator().manual_seed(0)
    groups = -(-k // group_size)
    zeros = (torch.full((groups, n), 2 ** (bits - 1)) if sym  # v1 stores zero - 1: a zero of 0 cannot be written
             else torch.randint(1, 2**bits, (groups, n), generator=gen))
    tensors = (_random_words(bitpack.packed_len(k, bits), n, gen, device),
               bitpack.pack((zeros - 1).to(torch.int32), bits, dim=1).to(device), _scales(groups, n, gen, device),
               (torch.arange(k, device=device) // group_size).to(torch.int32))

    def op(x):
        return gptq_linear(x, *tensors, bits, k, path=path)

    def dequantize(dtype):
        from quantkit.kernels.triton_dequant import dequantize_triton

        return (dequantize_triton(*tensors, bits, k, 1, dtype), dequantize_weight(*tensors, bits, k, 1, dtype=dtype))

    weight = dequantize_weight(*tensors, bits, k, 1, dtype=torch.float16).t().contiguous()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    layer = Layer(op, weight, nbytes, dequantize=dequantize)
    if bits == 4 and not rotated and k % (tinygemm.INNER_K_TILES * 16) == 0 and n % 8 == 0 and k % group_size == 0:
        packed = tinygemm.from_gptq(tensors[0], tensors[1], tensors[2], bits, k)
        layer.tinygemm = lambda x: tinygemm.matmul(x, *packed, group_size)  # noqa: E731
    if rotated:
        layer = _rotated(layer, k, device)
    return layer


def _rotated(layer: Layer, k: int, device) -> Layer:
    """The layer behind Π x: one randomized Hadamard transform of blocks of the largest power of two dividing K."""
    from quantkit.kernels.rotation import rotate_activations
    from quantkit.schemes.hadamard import hadamard_block, random_signs, rotate

    signs, block = random_signs(k, 0).to(device), hadamard_block(k)
    inner = layer.op
    layer.op = lambda x: inner(rotate_activations(x, signs, block))  # noqa: E731
    layer.rotate = lambda x: rotate(x, signs, block)  # noqa: E731
    layer.nbytes += k
    layer.dequantize = None
    return layer


def _codebook(n, k, quantizer, group_size, device) -> Layer:
    from quantkit.core import bitpack
    from quantkit.kernels.codebook import codebook_linear, decode_codebook, decode_table

    gen = torch.Generator().manual_seed(0)
    groups = -(-k // group_size)
    codes = _random_words(bitpack.packed_len(k, quantizer.code_bits), n, gen, device)
    scales = _scales(groups, n, gen, device)
    g_idx = (torch.arange(k, device=device) // group_size).to(torch.int32)
    table = decode_table(quantizer.kernel_decode, device)

    def op(x):
        return codebook_linear(x, codes, scales, g_idx, table, quantizer, k)

    weight = decode_codebook(codes, scales, g_idx, quantizer, k).t().half().contiguous()
    nbytes = codes.numel() * 4 + scales.numel() * 2 + g_idx.numel() * 4 + table.numel() * table.element_size()
    return Layer(op, weight, nbytes)
