"""E8: Conway–Sloane nearest points against brute force, the box-truncated codebook at exactly b bits per weight,
its codes, the data-free and block-LDLQ methods, and the checkpoint round trip.

Brute force: the nearest D8 point has every coordinate equal to the nearest or the second-nearest integer, so
it lies in floor(y) + {0, 1}⁸; the D8 + ½ coset likewise around y − ½. Distances are compared, not points,
because ties (points on cell boundaries) may legitimately resolve either way.
"""
import itertools
import json
import math

import pytest
import torch

from quantkit.api import quantize
from quantkit.run.config import QuantConfig
from quantkit.schemes.e8 import E8Box, box_point, nearest_box, pack_codes, unpack_codes
from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.hessian import output_error
from quantkit.algorithms.rtn import rtn
from quantkit.nn.decoded_linear import DecodedLinear
from test_quantizers import calibration, capture_results, loads_as_in_loop

CORNERS = torch.tensor(list(itertools.product((0.0, 1.0), repeat=8)), dtype=torch.float64)  # [256, 8]


def brute_force_e8(y):
    """Squared distance from each y [n, 8] to the nearest E8 point, by enumerating both cosets' neighbourhoods."""
    best = torch.full((y.shape[0],), math.inf, dtype=torch.float64)
    for shift in (0.0, 0.5):
        cand = torch.floor(y - shift)[:, None, :] + CORNERS[None] + shift        # [n, 256, 8]
        even = ((cand - shift).sum(-1) % 2) == 0
        d = ((y[:, None, :] - cand) ** 2).sum(-1).masked_fill(~even, math.inf)
        best = torch.minimum(best, d.min(dim=1).values)
    return best


def in_e8(p):
    frac = p - torch.floor(p)
    integer = (frac == 0).all(-1)
    half = (frac == 0.5).all(-1)
    return (integer | half) & ((p - torch.where(half, 0.5, 0.0)[:, None]).sum(-1) % 2 == 0)


@pytest.mark.parametrize("kind", ["random", "boundary"])
def test_nearest_box_point_inside_the_box_is_the_nearest_e8_point(kind):
    """At 4 bits with offset ¼ the box holds E8 + ¼ over [-8, 8)⁸: inside it the box's nearest point is E8's."""
    y = (torch.randn(3000, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2).clamp(-6, 6)
    if kind == "boundary":   # half-integer and quarter coordinates: ties between cells
        y = torch.round(y * 4) / 4
    k, coset, err = nearest_box(y, 4, 0.25)
    p = box_point(k, coset, 4, 0.25)
    assert bool(in_e8(p - 0.25).all())
    torch.testing.assert_close(((y - p) ** 2).sum(-1), brute_force_e8(y - 0.25), rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(err, brute_force_e8(y - 0.25), rtol=1e-12, atol=1e-9)


def box_codebook(bits, offset):
    """Every point of the box-truncated E8 at `bits` (2^(8 bits) of them), by enumeration."""
    ks = torch.tensor(list(itertools.product(range(1 << bits), repeat=8)))
    ks = ks[ks.sum(-1) % 2 == 0]
    return torch.cat([box_point(ks, torch.full((len(ks),), c), bits, offset) for c in (0, 1)])


@pytest.mark.parametrize("bits", [1, 2])
def test_nearest_box_equals_brute_force_over_the_whole_codebook(bits):
    points = box_codebook(bits, 0.25)
    assert len(points) == 2 ** (8 * bits)  # exactly b bits per weight
    y = torch.randn(400, 8, generator=torch.Generator().manual_seed(bits), dtype=torch.float64) * (1.5 * bits)
    k, coset, err = nearest_box(y, bits, 0.25)
    got = box_point(k, coset, bits, 0.25)
    best = torch.cdist(y, points).pow(2).min(dim=1).values
    torch.testing.assert_close(((y - got) ** 2).sum(-1), best, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(err, best, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codes_round_trip_and_decode_what_was_rounded(bits):
    k = torch.randint(0, 1 << bits, (500, 8), generator=torch.Generator().manual_seed(bits))
    k[:, 7] ^= k.sum(-1) % 2                       # make Σk even
    coset = torch.randint(0, 2, (500,), generator=torch.Generator().manual_seed(9))
    codes = pack_codes(k, coset)
    assert int(codes.max()) < 1 << bits
    back_k, back_coset = unpack_codes(codes)
    assert torch.equal(back_k, k) and torch.equal(back_coset, coset)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    q = E8Box(bits)
    res = rtn(w, q, 32)
    _, wq = q.round(w[:, :32], {"scale": res.params["scale"][:, 0]})
    assert torch.equal(res.decoded()[:, :32], wq)
    assert res.bits_per_weight() == bits + 16 / 32


@pytest.mark.parametrize("bits,ceiling", [(2, 0.100), (3, 0.03455), (4, 0.009501)])
def test_distortion_on_unit_gaussians_beats_the_scalar_lloyd_max(bits, ceiling):
    x = torch.randn(1000, 128, generator=torch.Generator().manual_seed(0))  # 128,000 weights: MSE within ~0.5 %
    res = rtn(x, E8Box(bits), 128)
    assert float((x - res.decoded()).pow(2).sum() / x.pow(2).sum()) <= ceiling


def test_block_ldlq_beats_data_free_on_correlated_inputs():
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(48, 128, generator=gen, dtype=torch.float64)
    X = torch.randn(1024, 128, generator=gen, dtype=torch.float64) @ torch.randn(128, 128, generator=gen, dtype=torch.float64)
    g = GPTQ(W)
    g.add_batch(X)
    fed_back = g.quantize(E8Box(2), group_size=64, keep_dequant=True)
    assert torch.equal(fed_back.decoded(), g.dequant.float())
    assert output_error(W, fed_back.dequantize(), g.H) < 0.7 * output_error(W, rtn(W, E8Box(2), 64).dequantize(), g.H)


@pytest.mark.parametrize("method,quantizer,bits", [("e8", None, 1), ("gptq", "e8box", 2)])
def test_writes_loads_and_gives_the_in_loop_logits(model_factory, tmp_path, monkeypatch, method, quantizer, bits):
    """The box through a checkpoint: what --method e8 uses at 1 bit, and --quantizer e8box at any width (--method
    e8 picks E8P at 2-4 bits: tests/test_e8p.py)."""
    src = model_factory("llama-tied-bias")
    results = capture_results(monkeypatch)
    quantize(str(src), tmp_path / "q", QuantConfig(method=method, quantizer=quantizer, rotate="hadamard", bits=bits,
                                                   group_size=64, nsamples=4, seqlen=32),
             device="cpu", calibration_ids=calibration())
    layer = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["layers"][
        "model.layers.0.mlp.down_proj"]
    assert layer["quantizer"] == "e8" and layer["bits"] == bits and layer["rotation"]["type"] == "hadamard"
    model = loads_as_in_loop(tmp_path / "q", src, results, calibration()[:2])
    assert isinstance(model.model.layers[0].mlp.down_proj, DecodedLinear)
