"""The Triton decode of trellis layers (kernels/triton_trellis.py) against the torch reference, the quantizer's own
dequantize (quantkit.schemes.trellis): bit for bit, for every code (1mad, 3inst, hyb), 1 to 4 bits, one and two
weights per step, QTIP's 16 x 16 tiles at L = 16, fp32/fp16/bf16 outputs, and scattered (act-order) groups; the fused
kernel of decode-time batches against the same weight; then the layer's product through kernels.codebook (fused up to
16 rows, decoded then multiplied above) and DecodedLinear. CPU cases run under TRITON_INTERPRET=1, as in
test_codebook_kernels.py."""
import os
import sys

import pytest
import torch

PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available() and not PREIMPORTED:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

from quantkit.core import bitpack  # noqa: E402
from quantkit.kernels.codebook import codebook_linear, decode_codebook, decode_table, lookup_of  # noqa: E402
from quantkit.kernels.device import triton_available  # noqa: E402
from quantkit.nn.decoded_linear import DecodedLinear  # noqa: E402
from quantkit.schemes.trellis import FAST_SETTING as FAST, Trellis  # noqa: E402
from triton_cases import device_params, rerun_with_interpreter  # noqa: E402

DEVICES = device_params(None if triton_available() else "not importable", INTERPRET, PREIMPORTED)
# --quantizer trellis-l12's setting (FAST) for most: small layers, a short interpreter run
QUANTIZERS = [Trellis(3, **FAST), Trellis(2, **FAST), Trellis(2, code="hyb", **FAST), Trellis(4, **FAST),
              Trellis(1, **FAST), Trellis(2, step=1, code="1mad", **FAST), Trellis(3, state_bits=16, length=256,
              tile_rows=16), Trellis(2), Trellis(4, step=2, code="3inst", state_bits=14, length=64, tile_rows=32),
              Trellis(3), Trellis(4), Trellis(3, length=64, tile_rows=64), Trellis(2, step=1, code="3inst", state_bits=12,
                                                                            length=192, tile_rows=64)]


def layer(quantizer, n, k, group_size, seed, scattered=False):
    """Random codes (any bit stream is a trellis path) and scales of an [n, k] layer, packed as the checkpoint holds
    them; g_idx in group order, or shuffled (act-order's scattered groups)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << quantizer.bits, (n, k), dtype=torch.int32, generator=gen)
    scales = (torch.rand(k // group_size, n, generator=gen) + 0.5).half()
    g_idx = (torch.arange(k) // group_size).int()
    if scattered:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return {"codes": bitpack.pack(codes.t().contiguous(), quantizer.bits, dim=0), "scales": scales, "g_idx": g_idx,
            "table": decode_table(quantizer.kernel_decode)}


def test_a_trellis_has_a_kernel_decode_but_no_unit_lookup():
    """Its state spans a tile of rows: no per-unit table (the CPU decodes through the quantizer), no fused tiles."""
    decode = Trellis(2, code="hyb").kernel_decode
    assert decode.variant == "trellis" and not decode.unit_local and len(decode.table) == 2 * 512
    assert decode.trellis == (16, 2, "hyb", 64, 256)
    assert lookup_of(Trellis(2), 128) is None and lookup_of(Trellis(3), 128) is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quantizer", QUANTIZERS, ids=lambda q: f"{q.bits}b-L{q.state_bits}-V{q.step}-{q.code}")
def test_the_triton_decode_is_the_quantizers_bit_for_bit(device, quantizer):
    from quantkit.kernels.triton_trellis import trellis_dequantize

    n, k = 2 * quantizer.tile_rows, 2 * quantizer.length
    t = layer(quantizer, n, k, quantizer.length, seed=quantizer.bits, scattered=quantizer.bits == 3)
    want = decode_codebook(t["codes"], t["scales"], t["g_idx"], quantizer, k)  # the quantizer's dequantize, fp32
    shape = (quantizer.bits, *quantizer.kernel_decode.trellis)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = trellis_dequantize(*[t[key].to(device) for key in ("codes", "scales", "g_idx", "table")], *shape, k,
                                 dtype).cpu()
        assert got.dtype == dtype and torch.equal(got, want.to(dtype)), dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quantizer", QUANTIZERS, ids=lambda q: f"{q.bits}b-L{q.state_bits}-V{q.step}-{q.code}")
def test_the_fused_kernel_multiplies_by_the_quantizers_weight(device, quantizer):
    """M <= 16 (decode-time batches): the weights made in registers, never stored, multiplied as made. The weight is
    the reference's, rounded once to x's dtype; only the order of the sums differs. M = 1 (its own accumulation),
    M = 5 and 16 (tl.dot), plain and scattered groups, split-K (these shapes are split on the interpreter's SMs)."""
    from quantkit.kernels.triton_trellis import trellis_matmul

    n, k = 2 * quantizer.tile_rows, 2 * quantizer.length
    shape = (quantizer.bits, *quantizer.kernel_decode.trellis)
    for m, dtype, scattered in [(1, torch.float32, False), (5, torch.float16, True), (16, torch.bfloat16, False),
                                (1, torch.float16, True)]:
        t = layer(quantizer, n, k, quantizer.length, seed=m, scattered=scattered)
        w = decode_codebook(t["codes"], t["scales"], t["g_idx"], quantizer, k).to(dtype)  # [k, n]
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
        y = trellis_matmul(x.to(device), *[t[key].to(device) for key in ("codes", "scales", "g_idx", "table")],
                           *shape, bias=bias.to(device)).cpu()
        want = (x.double() @ w.double() + bias.double()).to(dtype)
        assert y.dtype == dtype and y.shape == (m, n)
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # fp32: the sums' order; else one rounding of y
        torch.testing.assert_close(y, want, rtol=tol, atol=tol * float(want.abs().max()))


def test_the_fused_kernel_takes_decode_time_batches_only():
    from quantkit.kernels.triton_trellis import FUSED_MAX_M, trellis_matmul

    quantizer = Trellis(2)
    t = layer(quantizer, 64, 256, 128, seed=0)
    with pytest.raises(ValueError, match=f"at most {FUSED_MAX_M} rows"):
        trellis_matmul(torch.zeros(FUSED_MAX_M + 1, 256), *[t[key] for key in ("codes", "scales", "g_idx", "table")],
                       quantizer.bits, *quantizer.kernel_decode.trellis)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 16, 17])
def test_a_trellis_layer_multiplies_through_the_kernel(device, m):
    quantizer = Trellis(3)
    t = layer(quantizer, 64, 192, 64, seed=m)
    x = torch.randn(m, 192, generator=torch.Generator().manual_seed(m)).half()
    bias = torch.randn(64).half()
    args = [t[key] for key in ("codes", "scales", "g_idx", "table")] + [quantizer, 192]
    y = codebook_linear(x.to(device), *[a.to(device) if torch.is_tensor(a) else a for a in args],
                        bias=bias.to(device), backend="triton").cpu()
    ref = codebook_linear(x, *args, bias=bias, backend="torch")
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, ref, rtol=2e-3, atol=2e-3)  # the same fp16 weight; sums in another order


@pytest.mark.parametrize("device", DEVICES)
def test_decoded_linear_runs_a_trellis_layer_on_the_kernel_path(device, monkeypatch):
    quantizer = Trellis(2)
    t = layer(quantizer, 64, 128, 64, seed=5)
    module = DecodedLinear(128, 64, quantizer, 64, 2, bias=False, dtype=torch.float32)
    module.codes.copy_(t["codes"]), module.g_idx.copy_(t["g_idx"]), module.scale.copy_(t["scales"])
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(1))
    strips = module(x)  # the CPU's path: strips decoded through the quantizer
    module.to(device)
    monkeypatch.setenv("QUANTKIT_BACKEND", "triton")  # off CUDA this is what sends the call to the kernel
    torch.testing.assert_close(module(x.to(device)).cpu(), strips, rtol=1e-5, atol=1e-5)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)  # one custom op: no graph break
    torch.testing.assert_close(compiled(x.to(device)), module(x.to(device)), rtol=0, atol=0)


def test_the_kernel_refuses_a_layer_that_is_not_whole_tiles():
    from quantkit.kernels.triton_trellis import check_layer

    t = layer(Trellis(2), 32, 128, 64, seed=0)
    with pytest.raises(ValueError, match="tiles of 32 outputs x 2 inputs"):
        check_layer(torch.zeros(1, 120), bitpack.pack(torch.zeros(120, 12, dtype=torch.int32), 2, dim=0),
                    t["scales"][:, :12], t["g_idx"][:120], t["table"], 2, 12, 2, "3inst", 32, 64)


@pytest.mark.skipif(not PREIMPORTED or torch.cuda.is_available(),
                    reason="the interpreter cases already ran in this process (or a GPU runs the real ones)")
def test_interpreter_cases_in_fresh_process():
    """Triton was imported before this module could turn the interpreter on: rerun it in a new one."""
    rerun_with_interpreter(__file__, timeout=600)
