"""The codebook dequant-GEMM (kernels/codebook.py) of TurboQuant, E8 and E8P layers: the Triton kernel against the
torch reference on awkward shapes (M = 1, 3, 17, and 300 for the prefill path; K not a multiple of the block d or of
the kernel's K tile; codes straddling words at 3 and 5 bits), and DecodedLinear's kernel path against its
cached-weight path.

As in test_rotation_kernels.py, the CPU cases run the kernel under TRITON_INTERPRET=1 (in a fresh process
when triton was imported without it first). Tolerance: both round the same float32 weight once to x's
dtype and accumulate in float32, so they differ by summation order only: |Δy| <= 2^-11 * sum|x w| in fp16,
2^-8 in bf16 (the output rounding) and 1e-5 * sum|x w| in fp32. A wrong code, scale or group moves an output by about
one weight times x, ~1/sqrt(K) of that sum or more, far above these bounds.
"""
import os
import sys

import pytest
import torch

PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available() and not PREIMPORTED:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

from quantkit.core import bitpack, strips  # noqa: E402
from quantkit.kernels.codebook import (codebook_linear, decode_codebook, decode_table,  # noqa: E402
                                      has_lookup, lookup_columns, lookup_of)
from quantkit.kernels.device import triton_available  # noqa: E402
from quantkit.schemes.e8 import E8Box  # noqa: E402
from quantkit.schemes.e8p import E8P  # noqa: E402
from quantkit.algorithms.rtn import rtn  # noqa: E402
from quantkit.schemes.turboquant import TurboQuant  # noqa: E402
from quantkit.schemes.trellis import Trellis  # noqa: E402
from quantkit.nn.decoded_linear import DecodedLinear  # noqa: E402
from triton_cases import device_params, rerun_with_interpreter  # noqa: E402

DEVICES = device_params(None if triton_available() else "not importable", INTERPRET, PREIMPORTED)


def layer(n, k, quantizer, d, seed):
    """Packed tensors of a TurboQuant, E8 or E8P layer [n, k] quantized from random weights."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    res = rtn(w, quantizer, d)
    return {"codes": bitpack.pack(res.codes.t(), quantizer.code_bits, dim=0),
            "scales": res.params["scale"].t().half().contiguous(), "g_idx": res.g_idx.to(torch.int32),
            "table": decode_table(quantizer.kernel_decode), "decoded": res.decoded()}


def decoded_linear(t: dict, quantizer) -> DecodedLinear:
    """A 96 -> 48 DecodedLinear (groups of 32) holding `layer`'s tensors."""
    module = DecodedLinear(96, 48, quantizer, 32, 3, bias=False, dtype=torch.float32)
    for key in ("codes", "g_idx"):
        getattr(module, key).copy_(t[key])
    module.scale.copy_(t["scales"])
    return module


@pytest.mark.parametrize("quantizer", [TurboQuant(5, 32), E8Box(3), E8P(2), E8P(3), E8P(4)])
def test_reference_decodes_the_quantizer_result(quantizer):
    t = layer(24, 104, quantizer, 32, 0)
    w = decode_codebook(t["codes"], t["scales"], t["g_idx"], quantizer, 104)
    assert torch.equal(w, t["decoded"].t())


LOOKUPS = [(72, 96, TurboQuant(3, 64), 64), (40, 80, TurboQuant(5, 32), 32), (64, 128, TurboQuant(4, 128), 128),
           (33, 160, TurboQuant(2, 64), 64), (16, 96, TurboQuant(1, 32), 32), (40, 104, E8P(2), 64),
           (24, 96, E8Box(2), 32), (20, 40, E8P(2), -1), (24, 96, E8P(3), 32), (33, 80, E8P(4), 64)]


@pytest.mark.parametrize("n,k,quantizer,d", LOOKUPS)
@pytest.mark.parametrize("act_order", [False, True])
def test_the_lookup_decode_equals_the_quantizers(n, k, quantizer, d, act_order):
    """The CPU strip decode (table lookups, grouped scales) against the quantizer's dequantize, bit for bit:
    TurboQuant's levels with codes that straddle words (3, 5 bits), E8P's and E8's 16-bit points, E8P's 24- and 32-bit
    words in two stages, a short last group (160 = 2.5 blocks, 104 = 1.6), one group per row, and g_idx not in group
    order."""
    t = layer(n, k, quantizer, d, seed=k + quantizer.code_bits)
    g_idx = t["g_idx"][torch.randperm(k, generator=torch.Generator().manual_seed(1))] if act_order else t["g_idx"]
    want = decode_codebook(t["codes"], t["scales"], g_idx, quantizer, k)
    groups = dict(g_idx=g_idx) if act_order else {}  # plain groups go by the group size
    got = lookup_columns(t["codes"], t["scales"], lookup_of(quantizer, k), quantizer.code_bits, k,
                         k if d == -1 else d, **groups)
    assert torch.equal(got, want)


@pytest.mark.parametrize("quantizer", [E8Box(3), E8Box(4)])
def test_units_of_more_than_16_bits_without_stages_have_no_lookup(quantizer):
    assert lookup_of(quantizer, 64) is None  # 2^24 or 2^32 rows: they decode through the quantizer


@pytest.mark.parametrize("quantizer", [TurboQuant(2, 32), TurboQuant(3, 32), TurboQuant(4, 32), E8P(2), E8P(4),
                                       E8Box(2), E8Box(3), Trellis(2)])
def test_has_lookup_says_what_lookup_of_builds(quantizer):
    # A module's backend facts ask has_lookup in every forward: under torch.compile on a GPU (torch 2.11), building
    # the table through its functools cache crashed dynamo (NVIDIA H200 run, 2026-11-28).
    assert has_lookup(quantizer) == (lookup_of(quantizer, 64) is not None)


@pytest.mark.parametrize("quantizer", [TurboQuant(4, 32), E8P(2), E8P(3)])
def test_a_codebook_layer_decodes_strip_by_strip_on_the_cpu(monkeypatch, quantizer):
    t = layer(48, 96, quantizer, 32, seed=3)
    module = decoded_linear(t, quantizer)
    monkeypatch.setattr(strips, "STRIP_ELEMENTS", 16 * 96)  # three strips of 16 outputs
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(module(x), x @ t["decoded"].t(), rtol=1e-5, atol=1e-5)


CASES = [(72, 96, TurboQuant(3, 64), 64), (40, 80, TurboQuant(5, 32), 32), (64, 128, TurboQuant(4, 128), 128),
         (48, 384, TurboQuant(4, 128), 128),  # M <= 16: by code position, three K tiles split
         (40, 256, E8P(2), 128), (24, 384, E8P(4), 128),  # M <= 16: by coordinate of the points
         (33, 160, TurboQuant(2, 64), 64), (40, 104, E8Box(2), 64), (24, 96, E8Box(3), 32), (33, 64, E8Box(4), 64),
         (40, 104, E8P(2), 64), (24, 96, E8P(3), 32), (33, 80, E8P(4), 64), (20, 40, E8P(3), -1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 17, 300])  # 300: the prefill path (decode to a weight, then a GEMM)
@pytest.mark.parametrize("n,k,quantizer,d", CASES)
def test_triton_matches_reference(device, dtype, m, n, k, quantizer, d):
    t = layer(n, k, quantizer, d, seed=m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    bias = torch.randn(n).to(dtype)
    args = [t[key].to(device) for key in ("codes", "scales", "g_idx", "table")] + [quantizer, k]
    y = codebook_linear(x.to(device), *args, bias=bias.to(device), backend="triton").cpu()
    ref = codebook_linear(x, *[a.cpu() if torch.is_tensor(a) else a for a in args], bias=bias, backend="torch")
    scale = (x.float().abs() @ t["decoded"].t().abs()).max().item() + bias.abs().max().item()
    tol = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 1e-5}[dtype] * scale
    assert y.dtype == dtype and (y.float() - ref.float()).abs().max().item() <= tol


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_few_rows_take_the_fused_kernel_only_where_its_tiles_by_code_apply():
    """The H100 timed TurboQuant 3-bit's generic 16-row tile 4-15x slower than decode + cuBLAS: such calls go there."""
    from quantkit.kernels.triton_codebook import fused_pays

    assert not fused_pays(1, TurboQuant(3, 128).kernel_decode, 3)
    assert not fused_pays(16, E8P(3).kernel_decode, 3)
    assert fused_pays(17, TurboQuant(3, 128).kernel_decode, 3)
    assert fused_pays(1, TurboQuant(4, 128).kernel_decode, 4) and fused_pays(1, E8P(2).kernel_decode, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quantizer", [TurboQuant(3, 32), E8Box(2), E8P(3), E8P(4)])
def test_decoded_linear_kernel_path_matches_its_cached_weight(device, quantizer):
    t = layer(48, 96, quantizer, 32, seed=7)
    module = decoded_linear(t, quantizer)
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(1))
    cached = module(x)
    module.to(device)
    module.cache_dequantized = False  # off CUDA this is what sends the call to the kernel
    os.environ["QUANTKIT_BACKEND"] = "triton"
    try:
        y = module(x.to(device)).cpu()
    finally:
        del os.environ["QUANTKIT_BACKEND"]
    torch.testing.assert_close(y, cached, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not PREIMPORTED or torch.cuda.is_available(),
                    reason="the interpreter cases already ran in this process (or a GPU runs the real ones)")
def test_interpreter_cases_in_fresh_process():
    """Triton was imported before this module could turn the interpreter on: rerun it in a new one."""
    rerun_with_interpreter(__file__, timeout=600)


@pytest.mark.parametrize("device", DEVICES)
def test_a_codebook_layer_compiles_in_one_graph(device, monkeypatch):
    """The Triton call is one custom op (torch.ops.quantkit.codebook_matmul): fullgraph=True fails on any graph break,
    which the launch code (the g_idx check, the split-K workspace) would cause if traced."""
    quantizer = TurboQuant(4, 32)
    module = decoded_linear(layer(48, 96, quantizer, 32, seed=3), quantizer).to(device)
    monkeypatch.setenv("QUANTKIT_BACKEND", "triton")  # off CUDA this is what sends the call to the kernel
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=True)
    for m in (1, 5):
        x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(device, torch.float16)
        torch.testing.assert_close(compiled(x), module(x), rtol=0, atol=0)
