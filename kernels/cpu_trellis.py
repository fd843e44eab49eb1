"""A trellis layer's product on the CPU for decode-time batches: trellis_gemv.c, straight from the packed codes.

The CPU runs a trellis layer through strips (quantkit.core.strips): its weight decoded to float32 a strip at a time
(the C walk of quantkit/schemes/trellis_decode.c, then torch's unpack and scales), rounded to x's dtype, multiplied.
At one row of x, generation's case, the decode and its passes over 4-byte weights are nearly all of the time. The
C product here makes each weight from the packed codes and uses it at once (the same walk, table, scale and
rounding: the strips' weights bit for bit, y up to the order of the float32 sums), for float32 or bf16 x of up to
`max_rows` rows: 64 where its 16-lane AVX-512 loop takes the layer (3-8x the strips at 32 rows, a tie to 2x at 128),
8 for its scalar loop (other CPUs, QTIP's 16 x 16 tiles). Other calls (longer prefills, fp16 x, no C compiler) keep
the strips. Measured in docs/BENCHMARKS.md (scripts/bench_cpu_codebook.py's product table,
scripts/bench_cpu_generate.py's trellis row): a layer 10-30x the strips at 1-8 rows, SmolLM2's generation 7-10x.
"""
import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from quantkit.core import native

DTYPES = (torch.float32, torch.bfloat16)  # x's dtypes whose rounding the C repeats (float32: none; bf16)
SOURCE = Path(__file__).with_name("trellis_gemv.c")


def native_gemv():
    """The C product (trellis_gemv.c, built on first use by quantkit.core.native, with OpenMP where the compiler has
    it), or None where it cannot be built."""
    return native.function(SOURCE, "trellis_gemv", [ctypes.c_int64] * 12 + [ctypes.c_void_p] * 6, openmp=True)


@lru_cache(maxsize=1)
def shares_tiles_itself() -> bool:
    """Whether the C product was built with OpenMP: one call then shares the tiles among torch's own threads (torch's
    OpenMP runtime, which the library is given: quantkit.core.native), which in a generation loop measured 2x the
    product run on threads of quantkit's own beside torch's spinning ones (docs/BENCHMARKS.md)."""
    openmp = native.function(SOURCE, "trellis_gemv_openmp", [], ctypes.c_int64, openmp=True)
    return openmp is not None and bool(openmp())


def max_rows(quantizer) -> int:
    """The most rows of x the C product takes for a trellis quantizer's layers (its loop for them decides), 0 where
    the C cannot be built."""
    return _max_rows(quantizer.state_bits, quantizer.bits, quantizer.step, quantizer.tile_rows, quantizer.width)


@lru_cache(maxsize=64)
def _max_rows(L: int, k: int, V: int, tile_rows: int, width: int) -> int:
    rows = native.function(SOURCE, "trellis_gemv_rows", [ctypes.c_int64] * 5, ctypes.c_int64, openmp=True)
    return 0 if rows is None else int(rows(L, k, V, tile_rows, width))


def takes(x: torch.Tensor, quantizer) -> bool:
    """Whether trellis_linear runs this call: a trellis layer's, on the CPU, float32 or bf16 x of at most max_rows
    rows."""
    if getattr(quantizer, "name", None) != "trellis":  # (its kernel_decode would build a KernelDecode every call)
        return False
    rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
    return x.device.type == "cpu" and x.dtype in DTYPES and 0 < rows <= max_rows(quantizer)


def trellis_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, quantizer,
                   bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """x [..., K] Ŵᵀ (+ bias) in x's dtype for a call `takes` accepts (codes int32 [packed K, N], scales [G, N],
    g_idx [K]: the layer's buffers), or None where the C cannot be built (the caller takes the strips)."""
    gemv = native_gemv()
    if gemv is None:
        return None
    k, n = x.shape[-1], scales.shape[-1]
    quantizer.check_tiles((n, k))
    x2 = x.reshape(-1, k).float().contiguous()
    if not 0 < x2.shape[0] <= max_rows(quantizer):  # the C keeps that many sums a row of outputs
        raise ValueError(f"the C trellis product takes 1 to {max_rows(quantizer)} rows of x for this layer, got "
                         f"{x2.shape[0]}")
    y = torch.empty(x2.shape[0], n)
    codes, g_idx = codes.contiguous(), g_idx.to(torch.int32).contiguous()
    scales = scales.float().contiguous()
    table = quantizer.values("cpu").contiguous()
    tiles = n // quantizer.tile_rows
    workers = 1 if shares_tiles_itself() else max(1, min(torch.get_num_threads(), tiles))
    bounds = [tiles * i // workers for i in range(workers + 1)]

    def run(i):
        gemv(x2.shape[0], n, k, codes.shape[0], quantizer.state_bits, quantizer.bits, quantizer.step,
             quantizer.tile_rows, quantizer.width, x.dtype == torch.bfloat16, bounds[i], bounds[i + 1],
             *(t.data_ptr() for t in (codes, scales, g_idx, table, x2, y)))

    native.side_by_side(run, workers, workers)
    y = y.to(x.dtype).reshape(*x.shape[:-1], n)
    return y + bias.to(y.dtype) if bias is not None else y
