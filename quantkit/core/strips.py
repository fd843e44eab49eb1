"""A quantized linear's forward without a full-size decoded weight: decode a strip of outputs' weights, multiply, go on.

Decoding a whole layer to floats for every call would hold a dense copy of it (4 bytes per weight in float32, 8x the
int4 codes) at the moment of the product; decoding STRIP_ELEMENTS weights at a time bounds that to 2 MB per call
whatever the layer's size, while each strip is still wide enough for the GEMM to run at full speed (strips of 256K to
4M weights took the same time on 4096 x 4096 layers, M = 128 and 512; AMD EPYC, AVX-512), and small enough that the
allocator's slack from them stays small. The strips partition the outputs, so every output is the same dot product
over all inputs as in the whole-weight product.

The product is torch's (x @ Wᵀ strip), not quantkit.core.matmul's oneDNN one: every packed layout decodes to Wᵀ
([inputs, outputs], the order the codes are stored in), and oneDNN takes the weight as [outputs, inputs] rows only,
so it would first copy (transpose) each strip: measured on a 4096 x 4096 layer (2-core Xeon, AVX-512), that copy
and oneDNN's reorder cost 3-4x the decode itself, more than oneDNN's faster float32 product ever saves.
"""
from functools import cache

import torch

STRIP_ELEMENTS = 1 << 19  # decoded weights held at once: 2 MB in float32


def strip_rows(in_features: int, align: int) -> int:
    """Outputs per strip: about STRIP_ELEMENTS weights, a multiple of `align` (what the packing can slice at)."""
    return max(align, STRIP_ELEMENTS // max(in_features, 1) // align * align)


def spans(out_features: int, step: int):
    """(a, b) output ranges of `step` outputs (the last one shorter) covering all outputs."""
    return [(a, min(a + step, out_features)) for a in range(0, out_features, step)]


def ranges(out_features: int, in_features: int, align: int):
    return spans(out_features, strip_rows(in_features, align))


def strip_linear(x: torch.Tensor, decode_columns, row_ranges, bias=None) -> torch.Tensor:
    """x [..., K] Wᵀ (+ bias), with decode_columns(a, b) -> Wᵀ[:, a:b] as float32 [K, b - a], one range at a time.

    The decoded strip is rounded once to x's dtype, as the reference decode does, and multiplied in x's dtype, but
    for float16 and bfloat16 on a CPU whose torch has no oneDNN kernels for them (`_slow_on_cpu`): there the strip
    and x are multiplied in float32 and the result rounded back. Both sum in float32 (the same result up to the order
    of the sums); what differs is the speed."""
    compute = torch.float32 if x.device.type == "cpu" and _slow_on_cpu(x.dtype) else x.dtype
    x2 = x.reshape(-1, x.shape[-1]).to(compute)
    parts = [x2 @ _rounded(decode_columns(a, b), x.dtype, compute) for a, b in row_ranges]
    y = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).to(x.dtype)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y + bias.to(y.dtype) if bias is not None else y


def _rounded(w: torch.Tensor, dtype: torch.dtype, compute: torch.dtype) -> torch.Tensor:
    """w rounded to `dtype`'s precision, held in `compute`; in place where that is w's own dtype (a bf16 strip
    multiplied in float32 on the CPU), so no second full-size float32 copy of the strip is made."""
    if compute != w.dtype:
        return w.to(dtype).to(compute)
    return w if dtype == w.dtype else w.copy_(w.to(dtype))


@cache
def _slow_on_cpu(dtype: torch.dtype) -> bool:
    """Whether torch's CPU GEMM in a half-precision dtype takes its slow fallback: without oneDNN's kernels for it
    (bf16 wants AVX-512, fp16 AVX512-FP16 or AMX), x [128, 576] @ Wᵀ [576, 1536] in bfloat16 took 186 ms against
    2.2 ms in float32 on a 2-core AMD EPYC with AVX2; with them, bf16 runs 2.4x float32 (AMD EPYC with AVX-512 and
    AVX512-BF16: [512, 4096] @ [4096, 4096] in 46 ms against 108)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    supported = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    check = getattr(torch.ops.mkldnn, supported, None)
    return not (torch.backends.mkldnn.is_available() and check is not None and check())
