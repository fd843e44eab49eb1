"""Codebook dequant-GEMM (TurboQuant, E8 and trellis layers): y = x Ŵᵀ + bias with Ŵ[n, k] = scales[g, n] * value.

How codes become values is the quantizer's KernelDecode (quantkit.schemes.base): a lookup in a table of
levels (turboquant), the coordinate of a box-truncated E8 point (e8: 8 codes along K per point) or of an E8P point
(e8p: the 8 codes of a point are one 8b-bit word, decoded through int32 tables), or a trellis state's value
(trellis: the state walked along its sequence's codes; not unit_local, so no CPU lookup and its own kernels,
kernels/triton_trellis.py: fused up to 16 rows, above the weight decoded, then multiplied). This module never names
a scheme.

Layout (quantkit.checkpoint.quantkit_format, generic layers): codes int32 [packed_len(K, bits), N], the
b-bit codes of each output column packed along K as one LSB-first bit stream (quantkit.core.bitpack:
5-bit codes straddle words, as 3-bit ones do in the GPTQ layout); scales fp16 [G, N]; g_idx int32 [K].
The decode step is the GPTQ kernels' code extraction (triton_decode.packed_codes) followed by the variant's
decode where the integer grid does scale * (q - zero).

Backends as in dispatch.py: Triton on CUDA fp16/bf16 (kernels/triton_codebook.py: in-register decode
feeding tl.dot, fp32 accumulation; from M = 256, dispatch.py's prefill path: the weight decoded once to a transient
matrix, then cuBLAS), the torch reference elsewhere (the quantizer's own dequantize in float32,
rounded once to x's dtype, one GEMM), "triton" on CPU under TRITON_INTERPRET=1 for the tests.
"""
from dataclasses import dataclass
from functools import cache
from typing import Optional

import torch

from quantkit.core import bitpack
from quantkit.core.groups import per_column, row_groups
from quantkit.kernels.dispatch import LayerFacts, choose_path, layer_backend, prefill_gemm
from quantkit.kernels.reference import linear_dequantized
from quantkit.schemes.base import KernelDecode


def decode_table(decode, device=None) -> torch.Tensor:
    """The tensor the kernel reads for a KernelDecode: float32 levels ("table"), int32 words ("e8p"), or one
    unused zero ("lattice", whose points need no table)."""
    if decode.variant == "e8p":
        return torch.tensor(decode.table, dtype=torch.int32, device=device)
    return torch.tensor(decode.table or (0.0,), dtype=torch.float32, device=device)


def decode_weight(codes, params: dict, g_idx, quantizer, in_features) -> torch.Tensor:
    """Ŵ [out_features, in_features], float32, exactly as the checkpoint says: the packed codes and the per-group
    parameters {key: [G, N]} decoded by the quantizer's own dequantize."""
    q = bitpack.unpack(codes, quantizer.code_bits, in_features, dim=0)
    return quantizer.dequantize(q.t(), per_column({k: v.t().float() for k, v in params.items()}, g_idx))


LOOKUP_BITS = 16  # a lookup reads at most this many code bits (a table of 2^16 rows of 8 floats: 2 MB)


@dataclass(frozen=True)
class Lookup:
    """How a strip decodes by table lookups: every `per_row` codes along K (whole units) are one field of the packed
    stream, and their values at scale 1 are Σ table[(field >> shift) & (len(table) - 1)] over `stages`, summed in
    this order in float32: one stage for most quantizers, two for E8P's residual stage at 3 and 4 bits."""
    per_row: int
    stages: tuple  # ((shift, float32 table [2^bits, per_row]), ...)


def lookup_of(quantizer, in_features: int) -> Optional[Lookup]:
    """The Lookup of a kernel quantizer (w = scale * value(codes), KernelDecode), or None where it has none.
    A unit (`width` codes: one TurboQuant level, one 8-weight E8 or E8P point) that fits LOOKUP_BITS decodes through
    one table built from the quantizer's own dequantize at scale 1, each row m whole units (m a power of two dividing
    K's units: TurboQuant 4-bit reads 4 levels a lookup), row i the units whose codes are i's bit fields, low first,
    as the packing lays them along K. A wider unit decodes through the quantizer's `lookup_stages` where it has
    them (E8P at 3 and 4 bits: the point of the low 16 bits, then the residual's)."""
    if not has_lookup(quantizer):
        return None
    bits, width = quantizer.code_bits, quantizer.width
    if bits * width > LOOKUP_BITS:
        return Lookup(width, _staged_tables(quantizer))
    m = 1
    while 2 * m * bits * width <= LOOKUP_BITS and (in_features // width) % (2 * m) == 0:
        m *= 2
    return Lookup(m * width, ((0, _dequantized_table(quantizer, m * width)),))


def has_lookup(quantizer) -> bool:
    """Whether lookup_of gives `quantizer` a Lookup, without building its tables: what a module's backend facts
    read in every forward, also under torch.compile, which cannot trace the tables' functools caches."""
    decode = getattr(quantizer, "kernel_decode", None)
    if decode is None or not decode.unit_local:
        return False
    return quantizer.code_bits * quantizer.width <= LOOKUP_BITS or hasattr(quantizer, "lookup_stages")


@cache
def _staged_tables(quantizer) -> tuple:
    return quantizer.lookup_stages()


@cache
def _dequantized_table(quantizer, codes_per_row: int) -> torch.Tensor:
    bits = quantizer.code_bits
    rows = torch.arange(1 << (bits * codes_per_row)).unsqueeze(1)
    codes = (rows >> (bits * torch.arange(codes_per_row))) & ((1 << bits) - 1)
    return quantizer.dequantize(codes, {"scale": torch.ones(codes.shape)}).float().contiguous()


def lookup_columns(codes, scales, lookup: Lookup, bits: int, in_features: int, group_size: int,
                   g_idx=None) -> torch.Tensor:
    """Ŵᵀ [in_features, cols] float32 of a codebook layer's columns (codes int32 [packed, cols], scales [G, cols])
    through its Lookup, times each weight's scale (groups of `group_size` consecutive inputs, the last one maybe
    shorter; or, given g_idx, the groups it names): bit for bit the quantizer's dequantize. This is how a CPU strip
    decodes: 4x (TurboQuant 4-bit) to 29x (E8P 2-bit) faster than the dequantize, whose int64 codes and per-weight
    copy of the scales it does without (scripts/bench_cpu_codebook.py)."""
    per_row = lookup.per_row
    fields = bitpack.unpack(codes, bits * per_row, in_features // per_row, dim=0)  # int32 [K / per_row, cols]
    cols, flat = fields.shape[1], fields.t().flatten()  # the [cols, K] order: a column's units in K order
    w = None
    for shift, table in lookup.stages:
        index = flat if len(lookup.stages) == 1 else (flat >> shift) & (table.shape[0] - 1)
        part = table.to(codes.device).index_select(0, index)
        w = part if w is None else w.add_(part)
    w_t = w.view(cols, in_features).t()
    if g_idx is not None:
        return w_t.mul_(scales.float().index_select(0, g_idx.int()))
    for grouped, groups in row_groups(w_t, group_size):
        grouped.mul_(scales[groups].float().unsqueeze(1))
    return w_t


def decode_codebook(codes, scales, g_idx, quantizer, in_features) -> torch.Tensor:
    """Ŵᵀ [in_features, out_features] of a layer whose only parameter is its scale (what the kernel decodes)."""
    return decode_weight(codes, {"scale": scales}, g_idx, quantizer, in_features).t()


def codebook_linear_torch(x, codes, scales, g_idx, quantizer, in_features, bias=None):
    w = decode_codebook(codes, scales, g_idx, quantizer, in_features).to(x.dtype)
    return linear_dequantized(x, w, bias)


def codebook_linear(x, codes, scales, g_idx, table, quantizer, in_features, bias=None, *, backend=None):
    """y = x @ Ŵᵀ (+ bias), x [..., in_features]; table: decode_table(quantizer.kernel_decode) on x's device;
    backend "auto" | "triton" | "torch" (see dispatch.py)."""
    facts = LayerFacts(in_features, scales.shape[-1], quantizer.code_bits, codebook="lookup")
    if layer_backend(facts, x.device.type, x.dtype, backend=backend).name != "triton":
        return codebook_linear_torch(x, codes, scales, g_idx, quantizer, in_features, bias)
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"x must be [..., in_features={in_features}], got {tuple(x.shape)}")
    decode = quantizer.kernel_decode
    if not decode.unit_local:  # a trellis: its own kernels (a state spans a tile of rows, not a unit of codes)
        y = trellis_matmul_op(x.reshape(-1, in_features).contiguous(), codes, scales, g_idx, table,
                              quantizer.code_bits, *decode.trellis, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    y = codebook_matmul_op(x.reshape(-1, in_features).contiguous(), codes, scales, g_idx, table, quantizer.code_bits,
                           decode.variant, float(decode.offset), float(decode.ratio), bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# The Triton call as one opaque custom op, as torch.ops.quantkit.gptq_linear is (dispatch.py): torch.compile then
# traces a codebook model without breaking its graph at the launch code (the g_idx check, the split-K workspace),
# and CUDA graphs capture it.
@torch.library.custom_op("quantkit::codebook_matmul", mutates_args=())
def codebook_matmul_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                       table: torch.Tensor, bits: int, variant: str, offset: float, ratio: float,
                       bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ Ŵᵀ by Triton, the KernelDecode given by its fields: the fused kernel (triton_codebook), or from
    dispatch.py's PREFILL_MIN_M rows (or where triton_codebook.fused_pays says the fused kernel loses), the weight
    decoded once to a transient matrix and one cuBLAS GEMM."""
    from quantkit.kernels import triton_codebook  # triton imports only where it runs

    decode = KernelDecode(variant, offset=offset, ratio=ratio)
    if choose_path(x.shape[0]) == "fused" and triton_codebook.fused_pays(x.shape[0], decode, bits):
        return triton_codebook.codebook_matmul(x, codes, scales, g_idx, table, bits, decode, bias)
    triton_codebook.check_layer(x, codes, scales, g_idx, table, bits, decode, bias)
    w = triton_codebook.codebook_dequantize(codes, scales, g_idx, table, bits, decode, x.shape[1], x.dtype)
    return prefill_gemm(x, w, bias)


@codebook_matmul_op.register_fake
def _codebook_matmul_fake(x, codes, scales, g_idx, table, bits, variant, offset, ratio, bias):
    return x.new_empty((x.shape[0], scales.shape[1]))


@torch.library.custom_op("quantkit::trellis_matmul", mutates_args=())
def trellis_matmul_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                      table: torch.Tensor, bits: int, state_bits: int, step: int, code: str, tile_rows: int,
                      length: int, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ Ŵᵀ of a trellis layer (KernelDecode.trellis's fields) by Triton (kernels/triton_trellis.py): up to
    FUSED_MAX_M rows the fused kernel, the weights made in registers; from there Ŵᵀ decoded to a transient matrix in
    x's dtype, then one cuBLAS GEMM."""
    from quantkit.kernels import triton_trellis  # triton imports only where it runs

    shape = (bits, state_bits, step, code, tile_rows, length)
    if x.shape[0] <= triton_trellis.FUSED_MAX_M and choose_path(x.shape[0]) == "fused":
        return triton_trellis.trellis_matmul(x, codes, scales, g_idx, table, *shape, bias)
    triton_trellis.check_layer(x, codes, scales, g_idx, table, *shape, bias)
    w = triton_trellis.trellis_dequantize(codes, scales, g_idx, table, *shape, x.shape[1], x.dtype)
    return prefill_gemm(x, w, bias)


@trellis_matmul_op.register_fake
def _trellis_matmul_fake(x, codes, scales, g_idx, table, bits, state_bits, step, code, tile_rows, length, bias):
    return x.new_empty((x.shape[0], scales.shape[1]))
