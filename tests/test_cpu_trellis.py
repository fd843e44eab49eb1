"""The CPU product of trellis layers for decode-time batches (kernels/cpu_trellis.py, trellis_gemv.c): the weights it
makes are the quantizer's dequantize rounded to x's dtype (only the order of the float32 sums differs), for every tile
shape and code the decode is tested on, plain and scattered groups, one and several rows (on an AVX-512 machine the
16-lane loop, but for QTIP's 16 x 16 tiles, which take the scalar one as other CPUs do); and DecodedLinear takes it for
the calls it accepts, the strips for the rest."""
import pytest
import torch

from quantkit.core import bitpack
from quantkit.kernels import cpu_trellis
from quantkit.kernels.codebook import decode_codebook
from quantkit.nn.decoded_linear import DecodedLinear
from quantkit.schemes.trellis import FAST_SETTING as FAST, Trellis

QUANTIZERS = [Trellis(2), Trellis(3), Trellis(4), Trellis(2, **FAST), Trellis(3, **FAST),
              Trellis(3, state_bits=16, length=256, tile_rows=16), Trellis(2, code="hyb"), Trellis(1, **FAST),
              Trellis(2, step=1, code="3inst", state_bits=12, length=192, tile_rows=64)]

needs_c = pytest.mark.skipif(cpu_trellis.native_gemv() is None, reason="no C compiler here: the strips run instead")


def packed_layer(quantizer, n, k, group_size, seed, scattered=False):
    """codes (packed as a checkpoint holds them), fp16 scales [G, n], g_idx [k] of a random [n, k] trellis layer."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << quantizer.bits, (n, k), dtype=torch.int32, generator=gen)
    scales = (torch.rand(-(-k // group_size), n, generator=gen) + 0.5).half()
    g_idx = (torch.arange(k) // group_size).int()
    if scattered:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return bitpack.pack(codes.t().contiguous(), quantizer.bits, dim=0), scales, g_idx


@needs_c
@pytest.mark.parametrize("quantizer", QUANTIZERS, ids=lambda q: f"{q.bits}b-L{q.state_bits}-V{q.step}-{q.code}-"
                                                               f"{q.tile_rows}x{q.width}")
def test_the_c_product_multiplies_by_the_quantizers_weight(quantizer):
    n, k = 2 * quantizer.tile_rows, 3 * quantizer.length
    most = cpu_trellis.max_rows(quantizer)  # 64 for the 16-lane loop, 8 for the scalar one
    for rows, dtype, scattered, threads in [(1, torch.float32, False, 1), (1, torch.bfloat16, True, 2),
                                            (3, torch.float32, True, 2), (8, torch.bfloat16, False, 1),
                                            (most, torch.bfloat16, True, 2)]:
        codes, scales, g_idx = packed_layer(quantizer, n, k, 64, seed=rows, scattered=scattered)
        x = torch.randn(1, rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype)
        torch.set_num_threads(threads)
        try:
            y = cpu_trellis.trellis_linear(x, codes, scales, g_idx, quantizer, bias)
        finally:
            torch.set_num_threads(2)
        w = decode_codebook(codes, scales, g_idx, quantizer, k).to(dtype)  # [k, n], the strips' weight
        want = x.double() @ w.double() + bias.double()
        assert y.dtype == dtype and y.shape == (1, rows, n)
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # float32: the order of the sums; bf16: y's rounding
        torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


@needs_c
def test_the_c_product_takes_few_rows_of_float32_or_bf16_on_the_cpu():
    q = Trellis(2)
    assert cpu_trellis.max_rows(q) in (8, 64)  # the scalar loop's, the 16-lane loop's (AVX-512)
    assert cpu_trellis.max_rows(Trellis(3, state_bits=16, length=256, tile_rows=16)) == 8  # 48-bit rows: scalar
    assert cpu_trellis.takes(torch.zeros(1, 128), q)
    assert cpu_trellis.takes(torch.zeros(2, 4, 128, dtype=torch.bfloat16), q)
    assert not cpu_trellis.takes(torch.zeros(cpu_trellis.max_rows(q) + 1, 128), q)  # longer: the strips' GEMM
    assert not cpu_trellis.takes(torch.zeros(1, 128, dtype=torch.float16), q)  # a rounding the C does not repeat
    assert not cpu_trellis.takes(torch.zeros(0, 128), q)
    from quantkit.schemes.turboquant import TurboQuant

    assert not cpu_trellis.takes(torch.zeros(1, 128), TurboQuant(4, 128))
    codes, scales, g_idx = packed_layer(q, 64, 128, 64, seed=0)
    with pytest.raises(ValueError, match=f"1 to {cpu_trellis.max_rows(q)} rows"):
        cpu_trellis.trellis_linear(torch.zeros(cpu_trellis.max_rows(q) + 1, 128), codes, scales, g_idx, q)


@pytest.mark.parametrize("native", [True, False], ids=["c", "no-compiler"])
def test_decoded_linear_takes_the_c_product_for_few_rows(native, monkeypatch):
    """One row goes to the C product where it is built, more than max_rows to the strips; without a compiler both
    take the strips. Either way the same weights: outputs agree to the order of the sums."""
    if native and cpu_trellis.native_gemv() is None:
        pytest.skip("no C compiler here")
    if not native:
        monkeypatch.setattr(cpu_trellis, "native_gemv", lambda: None)  # as where no C compiler works
        monkeypatch.setattr(cpu_trellis, "max_rows", lambda quantizer: 0)
    q = Trellis(3)
    codes, scales, g_idx = packed_layer(q, 128, 512, 128, seed=3)
    module = DecodedLinear(512, 128, q, 128, 4, bias=True, dtype=torch.float32)
    module.codes.copy_(codes), module.g_idx.copy_(g_idx), module.scale.copy_(scales)
    module.bias.copy_(torch.randn(128, generator=torch.Generator().manual_seed(1)))
    calls = []
    real = cpu_trellis.trellis_linear
    monkeypatch.setattr(cpu_trellis, "trellis_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(max(cpu_trellis.max_rows(q), 8) + 1, 512, generator=torch.Generator().manual_seed(0))
    strips = module(x)  # too many rows for the C product
    one = module(x[:1])
    assert calls == ([(1, 512)] if native else [])
    torch.testing.assert_close(one, strips[:1], rtol=1e-5, atol=1e-5 * float(strips.abs().max()))  # sums' order
