"""What runs a quantized linear (`layer_backend`, the one place that decides it), and the GPTQ-layout entry point.

`layer_backend(facts, device, dtype)` names the backend of a layer for activations of `dtype` on `device`, with the
reason; the loader (which layers to repack for the CPU's int4 GEMM), every quantized module's forward, the entry
points below and `quantkit inspect` all ask it. The `backend` argument or the QUANTKIT_BACKEND env var can force
one ("auto" unless they say otherwise):
  auto   -> Triton when x is on CUDA, x is fp16/bf16, triton imports (and a GPTQ layer's scales are fp16);
            on the CPU torch's int4 GEMM where it takes the layer, else a strip-by-strip decode.
  triton -> always Triton; on CPU tensors this needs TRITON_INTERPRET=1 (how the tests check the
            kernels without a GPU). Unsupported inputs raise ValueError instead of falling back.
  torch  -> always the torch reference (on the CPU: the strip decode, no int4 GEMM).

Within the Triton backend, two paths (the `path` argument; "auto" picks by M = rows of x):
  fused   (M < PREFILL_MIN_M) -> triton_gptq_ops.gptq_matmul: the weight is decoded in registers
            inside the GEMM, never written out. This is what wins at decode / small batches, where
            the op is bound by reading the weights and INT4 reads 4x fewer bytes than fp16.
  prefill (M >= PREFILL_MIN_M) -> triton_dequant.dequantize_triton writes a *transient* fp16/bf16
            W^T [K, N] (a new allocation on every call, freed when the call returns: 2 bytes per
            weight, e.g. 470 MB for a 28672 x 8192 linear), then torch.matmul / addmm (cuBLAS) does
            the GEMM. At large M the GEMM is compute-bound and cuBLAS runs it at ~2x the fused
            kernel's speed (docs/BENCHMARKS.md: the fused kernel's decoded tile is shuffled through
            shared memory on the MMA critical path), while the decode is a bandwidth-bound pass
            costing ~2.5 bytes of traffic per weight: small against 2*M FLOPs per weight once M is
            in the hundreds. This is the trade production kernels make for prefill (exllama's
            large-M path); the extra memory is per call and only as big as one layer's weight.
torch.ops.quantkit.gptq_linear wraps the automatic choice as one opaque custom op with a fake
(shape-only) implementation: QuantLinear calls it, so torch.compile traces a quantized model without
graph breaks and CUDA graphs (torch.compile mode="reduce-overhead") capture it, which removes the
Python launch cost of each call from decode loops.
PREFILL_MIN_M is the measured crossover on an H100 (docs/BENCHMARKS.md): at M = 128 the two paths
tie on a 4096 x 4096 linear and the fused kernel is 1.27x-1.69x faster on larger ones; at M = 256
dequantize + cuBLAS is 5%-25% faster on every Llama-3 8B/70B shape. The weight is decoded in the
activation dtype with the reference's single rounding, so both paths see identical weights.
"""
import os
from typing import NamedTuple, Optional

import torch

from quantkit.kernels import cpu_int4
from quantkit.kernels.device import triton_available
from quantkit.kernels.reference import gptq_linear_torch, linear_dequantized

BACKENDS = ("auto", "triton", "torch")
PATHS = ("auto", "fused", "prefill")
PREFILL_MIN_M = 256   # Triton backend: M >= this decodes to a transient fp16/bf16 weight + cuBLAS
HALF = (torch.float16, torch.bfloat16)


class LayerFacts(NamedTuple):
    """What the backend choice reads of a quantized linear: a loaded module's (QuantLinear.facts(),
    DecodedLinear.facts()) or a checkpoint layer's (quantkit inspect)."""
    in_features: int
    out_features: int
    bits: int
    group_size: int = -1       # as stored: -1 is one group per row
    groups: str = "plain"      # g_idx: "plain" (k // group_size), "sorted" (act-order whose groups are whole once the
    #                            inputs are sorted by group) or "scattered" (groups of unequal sizes)
    scales: torch.dtype = torch.float16  # what the scales run in (another tool's bf16/fp32 ones are kept)
    codebook: str = ""         # "" for the integer grid; a codebook layer's CPU decode: "lookup", "trellis" (through
    #                            its quantizer, or the C product of kernels/cpu_trellis.py for a few rows) or "quantizer"
    kernel: bool = True        # a Triton kernel decodes it: every grid layer, a codebook one with a KernelDecode


class Backend(NamedTuple):
    name: str    # "triton", "cpu_int4", "strips", "reference" or "dense"
    reason: str  # one line: why this one, for `quantkit inspect`


def layer_backend(layer: LayerFacts, device, dtype: torch.dtype, cache_dequantized: bool = False,
                  backend: Optional[str] = None) -> Backend:
    """What runs `layer` for `dtype` activations on `device` ("cpu", "cuda:1", a torch.device):
      triton    the Triton dequant-GEMM (GPTQ layout: fused below PREFILL_MIN_M rows, decode + cuBLAS from there;
                codebook layers: kernels/codebook.py), decoding in registers;
      cpu_int4  the layer repacked at load time for torch's CPU int4 GEMM (quantkit.nn.cpu_int4_linear), which runs
                bf16 calls of up to INT4_MM_MAX_M rows; every other call decodes exact strips from the same bytes;
      strips    a strip of the weight decoded per product (quantkit.core.strips): the CPU's exact path, a codebook
                layer's path wherever no kernel runs it;
      reference the whole weight decoded per call (kernels/reference.py): a GPTQ layer off the Triton path on a GPU;
      dense     cache_dequantized: the weight decoded once and kept (the unquantized model's speed and size).
    Raises ValueError for a forced backend that cannot run (see the module docstring)."""
    device = getattr(device, "type", device).partition(":")[0]
    no_triton = _why_not_triton(layer, device, dtype, _forced(backend, device))
    if no_triton is None:
        where = "the Triton interpreter" if device == "cpu" else f"CUDA, {_name(dtype)} activations"
        kind = "codebook dequant-GEMM" if layer.codebook else "dequant-GEMM (fused; decode + cuBLAS from 256 rows)"
        return Backend("triton", f"{where}: Triton {kind}")
    if cache_dequantized:
        return Backend("dense", "cache_dequantized: the weight is decoded once and kept")
    if layer.codebook:
        how = {"lookup": "by table lookup", "trellis": "through its quantizer (calls of a few rows of float32 or "
               "bf16 x, cpu_trellis.max_rows: multiplied in C straight from the packed codes)"}.get(
                   layer.codebook, "through its quantizer")
        return Backend("strips", f"{no_triton}: decoded a strip at a time, {how}")
    if device != "cpu":
        return Backend("reference", f"{no_triton}: the whole weight decoded at each call")
    return _cpu_grid(layer, dtype, no_triton if no_triton.startswith("QUANTKIT_BACKEND") else None)


def _forced(backend, device: str) -> str:
    backend = backend or os.environ.get("QUANTKIT_BACKEND", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton backend on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    return backend


def _why_not_triton(layer: LayerFacts, device: str, dtype, forced: str) -> Optional[str]:
    """None where Triton runs the layer, else why not."""
    if forced == "torch":
        return "QUANTKIT_BACKEND=torch"
    if not layer.kernel:
        return "no Triton kernel decodes this codebook"
    if not layer.codebook and layer.scales != torch.float16:  # the GPTQ tiles are written for fp16 scales
        return f"{_name(layer.scales)} scales (the Triton kernel reads float16 ones)"
    if forced == "triton":
        return None
    if device != "cuda":
        return "on the CPU"
    if dtype not in HALF:
        return f"{_name(dtype)} activations (the Triton kernels take float16 and bfloat16)"
    return None if triton_available() else "triton is not installed"


def _cpu_grid(layer: LayerFacts, dtype, forced: Optional[str]) -> Backend:
    """A GPTQ-layout layer on the CPU: torch's int4 GEMM where it takes the layer, else the strip decode."""
    k, n = layer.in_features, layer.out_features
    g = k if layer.group_size == -1 else layer.group_size
    refusal = (forced or (f"{layer.bits}-bit codes" if layer.bits > 2 * cpu_int4.PLANE_BITS else None)
               or (f"{n} outputs, not a multiple of {cpu_int4.N_MULTIPLE}" if n % cpu_int4.N_MULTIPLE else None)
               or (f"groups of {g} inputs (the int4 GEMM takes {', '.join(map(str, cpu_int4.GROUP_SIZES))})"
                   if cpu_int4.kernel_group(k, g) is None else None)
               or ("act-order groups of unequal sizes" if layer.groups == "scattered" else None))
    if refusal:
        return Backend("strips", f"{refusal}: decoded a strip at a time, exactly")
    if dtype == torch.bfloat16:
        return Backend("cpu_int4", f"torch's int4 GEMM for bfloat16 calls of up to {cpu_int4.INT4_MM_MAX_M} rows, "
                                   "exact strips for longer ones")
    return Backend("cpu_int4", f"held for torch's int4 GEMM, which takes bfloat16: {_name(dtype)} activations "
                               "decode exact strips at every call")


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def reserve_workspace(device: torch.device, out_features: int, in_features: int, codebook: bool = False) -> None:
    """A GPTQ (or, with `codebook`, a codebook) layer of this shape now lives on `device`: on a GPU, the most split-K
    scratch its kernel can ask for is allocated at once, outside any CUDA-graph memory pool (triton_gptq_ops.workspace
    says why)."""
    if device.type == "cuda" and triton_available():
        from quantkit.kernels import triton_codebook, triton_gptq_ops

        bound = (triton_codebook if codebook else triton_gptq_ops).workspace_bound
        triton_gptq_ops.workspace(device, *bound(out_features, in_features, triton_gptq_ops.num_sms(device)))


def choose_path(m, path=None):
    """'fused' or 'prefill' for a Triton call with m rows of activations."""
    path = path or "auto"
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path != "auto":
        return path
    return "prefill" if m >= PREFILL_MIN_M else "fused"


def gptq_linear(x, qweight, qzeros, scales, g_idx, bits, in_features, bias=None, zero_offset=1, *,
                backend=None, path=None):
    """y = x @ W^T + bias where W is decoded from GPTQ-layout tensors. x: [..., in_features].

    `path` ("auto", "fused", "prefill") applies to the Triton backend only; see the module docstring."""
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    # off the Triton path this op is the reference decode (on the CPU QuantLinear calls it under torch.compile only)
    facts = LayerFacts(in_features, scales.shape[-1], bits, scales=scales.dtype)
    if layer_backend(facts, x.device.type, x.dtype, backend=backend).name != "triton":
        return gptq_linear_torch(x, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)
    from quantkit.kernels.triton_gptq_ops import check_layer, gptq_matmul

    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"x must be [..., in_features={in_features}], got {tuple(x.shape)}")
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if choose_path(x2.shape[0], path) == "fused":
        y = gptq_matmul(x2, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)
    else:
        check_layer(x2, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)
        y = _prefill(x2, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)
    return y.reshape(*x.shape[:-1], y.shape[-1])


@torch.library.custom_op("quantkit::gptq_linear", mutates_args=())
def gptq_linear_op(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: torch.Tensor, bits: int, in_features: int, bias: Optional[torch.Tensor],
                   zero_offset: int) -> torch.Tensor:
    """gptq_linear with the automatic backend and path (Triton on CUDA, torch elsewhere)."""
    return gptq_linear(x, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)


@gptq_linear_op.register_fake
def _gptq_linear_fake(x, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset):
    return x.new_empty((*x.shape[:-1], scales.shape[1]))


def _prefill(x2, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset):
    """Decode W^T to a transient x.dtype matrix, then one cuBLAS GEMM (bias in its epilogue)."""
    from quantkit.kernels.triton_dequant import dequantize_checked

    return prefill_gemm(x2, dequantize_checked(qweight, qzeros, scales, g_idx, bits, in_features, zero_offset,
                                               x2.dtype), bias)


def prefill_gemm(x2, w, bias):
    """x2 [M, K] @ w [K, N] (+ bias) by cuBLAS, bias in its epilogue: the prefill path's GEMM on a decoded weight."""
    if not x2.is_cuda:  # interpreter runs (tests): CPU fp16 GEMMs go through fp32
        return linear_dequantized(x2, w, bias)
    if bias is None:
        return torch.matmul(x2, w)
    return torch.addmm(bias.to(x2.dtype), x2, w)
