"""Triton dequantize kernel for the GPTQ layout: W^T [K, N] in fp16 / bf16 from the packed tensors.

Used by the prefill path of kernels.dispatch.gptq_linear (large M): decode the weight once per call
into a transient matrix and let cuBLAS do the compute-bound GEMM. The kernel is bandwidth-bound
(INT4: 0.5 byte read, 2 bytes written per weight). One program per BLOCK_K x BLOCK_N tile of W^T;
one int32 load per packed word (vectorised along N, the contiguous dimension of qweight and of
W^T), then for each code j of the words one [BLOCK_K / (32 / bits), BLOCK_N] slab of output rows
k = word * (32 / bits) + j is decoded in registers and stored (16-byte stores along N). No reshape,
so the slabs never pass through shared memory. Scales/zeros: one row per tile, loaded as 1-D vectors
(a [1, BLOCK_N] tile made Triton re-lay-out every slab) when g_idx is `k // group_size` and BLOCK_K
divides the group size ("uniform"), else gathered per row (act-order, odd group sizes).
3-bit words do not hold whole codes (32 codes fill 3 words): there each row of the tile gathers its
word, and the next one where its code spills over, and the tile is decoded and stored at once.
Decoding is the fused kernel's (triton_gptq._decode): bit-identical to reference.dequantize_weight
(fp32 product of an fp16 scale and an integer is exact, then one rounding to the dtype).
"""
import torch
import triton
import triton.language as tl

from quantkit.kernels.device import on_device
from quantkit.kernels.triton_decode import dequant, group_params, group_row, in_range, packed_codes
from quantkit.kernels.triton_gptq import fits_groups
from quantkit.kernels.triton_gptq_ops import check_packed, group_layout


@triton.jit
def gptq_dequant_kernel(qw_ptr, qz_ptr, s_ptr, g_ptr, w_ptr, N, K, KW, NW, GS,
                        BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, UNIFORM: tl.constexpr, IS_FP16: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                        INTERPRETER: tl.constexpr = False):
    """W^T [K, N] in w's dtype, one [BLOCK_K, BLOCK_N] tile a program; launched through dequant_kernel (autotuned)
    or, with a fixed config, its heuristics wrapper."""
    pid_n = tl.program_id(0)   # fastest: neighbouring programs write neighbouring columns of the same rows
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = in_range(offs_n, N, EVEN_N)
    if UNIFORM:  # the whole tile lies in one group
        s, z = group_row(s_ptr, qz_ptr, (pid_k * BLOCK_K) // GS, offs_n, n_mask, N, NW, BITS, ZERO_OFFSET)
    else:
        s, z = 0.0, 0
    if BITS == 3:  # codes straddle words: the whole tile at once, each row gathering its word(s)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        q = packed_codes(qw_ptr + offs_n[None, :], offs_k[:, None], N, n_mask[None, :], KW, BITS)
        _store_rows(w_ptr, q, offs_k, offs_n, n_mask, s, z, s_ptr, qz_ptr, g_ptr, N, K, NW,
                    BITS, ZERO_OFFSET, UNIFORM, IS_FP16, EVEN_K, INTERPRETER)
    else:          # one load per word, then one slab of rows per code position j
        PW: tl.constexpr = 32 // BITS
        offs_kw = pid_k * (BLOCK_K // PW) + tl.arange(0, BLOCK_K // PW)
        words = tl.load(qw_ptr + offs_kw[:, None] * N + offs_n[None, :],
                        mask=in_range(offs_kw, KW, EVEN_K)[:, None] & n_mask[None, :], other=0)
        for j in tl.static_range(PW):
            _store_rows(w_ptr, (words >> (j * BITS)) & ((1 << BITS) - 1), offs_kw * PW + j, offs_n, n_mask, s, z,
                        s_ptr, qz_ptr, g_ptr, N, K, NW, BITS, ZERO_OFFSET, UNIFORM, IS_FP16, EVEN_K, INTERPRETER)


@triton.jit
def _store_rows(w_ptr, q, offs_k, offs_n, n_mask, s, z, s_ptr, qz_ptr, g_ptr, N, K, NW, BITS: tl.constexpr,
                ZERO_OFFSET: tl.constexpr, UNIFORM: tl.constexpr, IS_FP16: tl.constexpr, EVEN_K: tl.constexpr,
                INTERPRETER: tl.constexpr):
    """Decode codes q [len(offs_k), BLOCK_N] of rows offs_k and store them as rows of W^T."""
    k_mask = in_range(offs_k, K, EVEN_K)
    if not UNIFORM:
        g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)[:, None]
        s, z = group_params(s_ptr, qz_ptr, g, offs_n, n_mask, N, NW, BITS, ZERO_OFFSET)
    w = dequant(q, z, s, IS_FP16, INTERPRETER)
    tl.store(w_ptr + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :], w, mask=k_mask[:, None] & n_mask[None, :])


def _prune(configs, named_args, **kwargs):
    keep = [c for c in configs if fits_groups(c, {**named_args, **kwargs})]
    return keep or configs[:1]


DEQUANT_CONFIGS = [triton.Config(dict(BLOCK_K=bk, BLOCK_N=bn), num_warps=w, num_stages=1)
                   for bk, bn, w in [(32, 256, 4), (64, 256, 4), (128, 256, 8), (64, 128, 4), (128, 128, 4)]]
_heuristic_kernel = triton.heuristics({
    "EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0,
    "EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0,
})(gptq_dequant_kernel)
dequant_kernel = triton.autotune(DEQUANT_CONFIGS, key=["N", "K", "GS", "BITS", "UNIFORM", "IS_FP16"],
                                 prune_configs_by={"early_config_prune": _prune})(_heuristic_kernel)
_INTERPRETER_CONFIG = dict(BLOCK_K=32, BLOCK_N=32)  # small tiles: the interpreter runs numpy per program


def dequantize_triton(qweight, qzeros, scales, g_idx, bits, in_features, zero_offset=1, dtype=torch.float16, *,
                      config=None):
    """W^T [in_features, out_features] in `dtype`, equal to reference.dequantize_weight(..., dtype=dtype).

    `config` pins BLOCK_K / BLOCK_N (and optionally num_warps) instead of autotuning; CPU tensors
    (TRITON_INTERPRET=1) always use a pinned config."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    check_packed(qweight, qzeros, scales, g_idx, bits, in_features, zero_offset)
    return dequantize_checked(qweight, qzeros, scales, g_idx, bits, in_features, zero_offset, dtype, config)


def dequantize_checked(qweight, qzeros, scales, g_idx, bits, in_features, zero_offset, dtype, config=None):
    """dequantize_triton without the argument checks, for callers that made them (the prefill path)."""
    k = in_features
    groups, n = scales.shape
    w = torch.empty((k, n), dtype=dtype, device=qweight.device)
    if k == 0 or n == 0:
        return w
    uniform, gs = group_layout(g_idx, groups)   # also range-checks g_idx (ValueError)
    meta = dict(BITS=bits, ZERO_OFFSET=zero_offset, IS_FP16=dtype == torch.float16)
    if qweight.device.type != "cuda":
        config, meta["INTERPRETER"] = config or _INTERPRETER_CONFIG, True
    kernel = dequant_kernel
    if config is not None:
        kernel, config = _heuristic_kernel, dict(config)
        uniform = uniform and gs % config["BLOCK_K"] == 0
    grid = lambda a: (triton.cdiv(n, a["BLOCK_N"]), triton.cdiv(k, a["BLOCK_K"]))  # noqa: E731
    with on_device(w):
        kernel[grid](qw_ptr=qweight, qz_ptr=qzeros, s_ptr=scales, g_ptr=g_idx, w_ptr=w, N=n, K=k,
                     KW=qweight.shape[0], NW=qzeros.shape[1], GS=gs if uniform else 1, UNIFORM=uniform,
                     **meta, **(config or {}))
    return w
