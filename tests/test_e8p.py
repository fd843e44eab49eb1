"""E8P (QuIP#'s 2^16-point ball in E8 + ¼) and its residual stages: the codebook's facts by enumeration, exact
nearest points against brute force over all 65,536 codewords, codes through packing, the quantizer and what
`--method e8` picks, and the checkpoint round trip."""
import itertools
import json

import pytest
import torch

from quantkit.api import quantize
from quantkit.run.config import QuantConfig
from quantkit.core import bitpack
from quantkit.schemes import e8p_codebook as e8p
from quantkit.schemes.e8 import E8Box
from quantkit.schemes.e8p import E8P
from quantkit.schemes.base import make_quantizer, quantizer_for
from quantkit.algorithms.rtn import rtn
from quantkit.nn.decoded_linear import DecodedLinear
from test_e8 import in_e8
from test_quantizers import calibration, capture_results, loads_as_in_loop


def all_points():
    return e8p.e8p_decode(torch.arange(1 << 16))


def test_abs_table_is_the_227_ball_patterns_and_29_of_norm_12():
    # Every point of D8 + ½ with squared norm ≤ 10 has |x_i| ≤ 5/2 (the other seven coordinates hold ≥ 7/4), so
    # enumerating (2x) ∈ {±1, ±3, ±5}⁸ finds them all; D8 + ½ = half-integer vectors with an even sum.
    twice = torch.tensor(list(itertools.product((-5, -3, -1, 1, 3, 5), repeat=8)), dtype=torch.int16)
    keep = ((twice.sum(-1) // 2) % 2 == 0) & ((twice.long() ** 2).sum(-1) <= 40)
    ball = {tuple(r) for r in twice[keep].abs().tolist()}
    assert len(ball) == 227
    table = [tuple(r) for r in e8p.unpack_nibbles(e8p.ABS_TABLE, torch.zeros(1)).tolist()]
    assert len(table) == len(set(table)) == 256 and set(table[:227]) == ball
    for t in table[227:]:
        assert sorted(t) == [1, 1, 1, 3, 3, 3, 3, 3] and sum(v * v for v in t) == 48   # norm² 12


def test_every_code_is_a_distinct_point_of_e8_plus_a_quarter():
    p = all_points()
    assert len(torch.unique(p, dim=0)) == 1 << 16
    assert bool(in_e8(p - 0.25).all())
    shift = torch.where(torch.arange(1 << 16) >> 15 == 1, -0.25, 0.25)
    unshifted = p - shift[:, None]
    assert bool(((unshifted.sum(-1) % 2) == 0).all())                   # S: even coordinate sums
    assert bool((unshifted * 2 % 2 == 1).all())                          # half-integers
    # Sign rule: bits 8–14 are the signs of coordinates 0–6, coordinate 7's follows from the parity.
    codes = torch.arange(1 << 16)
    assert torch.equal(unshifted[:, :7] < 0, ((codes[:, None] >> torch.arange(8, 15)) & 1) == 1)
    assert torch.equal(unshifted.abs(), e8p.unpack_nibbles(e8p.ABS_TABLE, codes)[codes & 255].double() / 2)
    # The codebook is symmetric under negation, as a sign-symmetric set shifted by ±¼ should be.
    assert len(torch.unique(torch.cat([p, -p]), dim=0)) == 1 << 16


def brute_force(y, points, chunk=256):
    best = []
    for c in y.split(chunk):
        best.append(torch.cdist(c, points).pow(2).min(dim=1).values)
    return torch.cat(best)


@pytest.mark.parametrize("kind", ["gaussian", "wide", "boundary", "zeros"])
def test_nearest_equals_brute_force(kind):
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(600, 8, generator=gen, dtype=torch.float64) * torch.tensor([0.3, 1.0, 2.0])[torch.arange(600) % 3, None]
    if kind == "wide":
        y = y * 3
    if kind == "boundary":   # quarter-grid coordinates: ties between cells and between the two shifts
        y = torch.round(y * 4) / 4
    if kind == "zeros":      # whole zero vectors and zero coordinates (padding, dead weights)
        y[::2] = 0
        y[1::2, ::3] = 0
    code, point, err = e8p.e8p_nearest(y)
    best = brute_force(y, all_points())
    torch.testing.assert_close(((y - point) ** 2).sum(-1), best, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(err, best, rtol=1e-12, atol=1e-12)
    assert torch.equal(e8p.e8p_decode(code), point)
    assert torch.equal(e8p.e8p_nearest(y, "err")[2], err) and torch.equal(e8p.e8p_nearest(y, "point")[1], point)


def test_residual_codebook_and_stages():
    pts = e8p.e8_1bit_decode(torch.arange(256))
    assert len(torch.unique(pts, dim=0)) == 256 and bool(in_e8(pts).all())
    norms, counts = (pts ** 2).sum(-1).unique(return_counts=True)
    assert norms.tolist() == [0, 2, 4] and counts.tolist() == [1, 240, 15]   # 0, the roots, ±2e_i but −2e_7
    y = torch.randn(800, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.8
    best = brute_force(y, pts)
    idx, point = e8p.e8_1bit_nearest(y)
    torch.testing.assert_close(((y - point) ** 2).sum(-1), best, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(e8p.e8_1bit_error(y), best, rtol=1e-12, atol=1e-12)
    for bits in (3, 4):   # stage 2 is the nearest point to the magnified stage-1 residual
        ratio = e8p.RATIO[bits]
        word, point = e8p.encode(y, bits, ratio)
        p1 = e8p.e8p_nearest(y)[1]
        assert torch.equal(word & 0xFFFF, e8p.e8p_nearest(y)[0])
        stage2 = (point - p1) * ratio
        r = (y - p1) * ratio
        target = e8p.e8_1bit_error(r) if bits == 3 else e8p.e8p_nearest(r, "err")[2]
        torch.testing.assert_close(((r - stage2) ** 2).sum(-1), target, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(e8p.decode(word, bits, ratio).double(), point, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codes_round_trip_through_packing(bits):
    gen = torch.Generator().manual_seed(bits)
    word = torch.randint(0, 1 << (8 * bits - 1), (40, 12), generator=gen, dtype=torch.int64) * 2 + torch.randint(
        0, 2, (40, 12), generator=gen)
    codes = e8p.split_word(word, bits).reshape(40, 96)
    assert int(codes.max()) < 1 << bits
    packed = bitpack.pack(codes.t().to(torch.int32), bits, dim=0)
    assert packed.shape == (96 * bits // 32, 40)            # exactly b bits per weight
    back = bitpack.unpack(packed, bits, 96, dim=0).t()
    assert torch.equal(e8p.join_word(back.reshape(40, 12, 8), bits), word)
    w = torch.randn(16, 80, generator=gen)
    q = E8P(bits)
    res = rtn(w, q, 32)                                       # groups 32, 32, 16
    _, wq = q.round(w[:, 32:64], {"scale": res.params["scale"][:, 1]})
    assert torch.equal(res.decoded()[:, 32:64], wq)
    assert res.bits_per_weight() == pytest.approx(bits + 16 * 3 / 80)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_distortion_on_unit_gaussians_beats_the_box(bits):
    x = torch.randn(400, 128, generator=torch.Generator().manual_seed(0))
    mse = {q.name: float((x - rtn(x, q, 128).decoded()).pow(2).sum() / x.pow(2).sum()) for q in (E8P(bits), E8Box(bits))}
    assert mse["e8p"] < mse["e8"]
    assert mse["e8p"] <= {2: 0.0900, 3: 0.0285, 4: 0.0079}[bits]     # QuIP# reports 0.089 at 2 bits


def test_settings_round_trip_and_e8_picks_the_winner():
    for bits in (2, 3, 4):
        q = E8P(bits)
        again = make_quantizer("e8p", **json.loads(json.dumps(q.settings())))
        assert again == q and again.kernel_decode == q.kernel_decode
        assert isinstance(quantizer_for("e8", bits, True, 128), E8P)
        assert isinstance(quantizer_for("e8box", bits, True, 128), E8Box)
    assert isinstance(quantizer_for("e8", 1, True, 128), E8Box)
    with pytest.raises(Exception, match="own table"):
        E8P(2, abs_table=list(reversed(e8p.ABS_TABLE)))
    with pytest.raises(Exception, match="no residual"):
        E8P(2, ratio=2.0)


@pytest.mark.parametrize("method,bits", [("e8", 2), ("e8+gptq", 3), ("e8+gptq", 4)])
def test_writes_loads_and_gives_the_in_loop_logits(model_factory, tmp_path, monkeypatch, method, bits):
    src = model_factory("llama-tied-bias")
    results = capture_results(monkeypatch)
    quantize(str(src), tmp_path / "q", QuantConfig(method=method, bits=bits, group_size=64, nsamples=4, seqlen=32),
             device="cpu", calibration_ids=calibration())
    layer = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["layers"][
        "model.layers.0.mlp.down_proj"]
    assert layer["quantizer"] == "e8p" and layer["bits"] == bits and layer["rotation"]["type"] == "hadamard"
    assert layer["abs_table"] == list(e8p.ABS_TABLE) and layer.get("ratio") == e8p.RATIO.get(bits)
    model = loads_as_in_loop(tmp_path / "q", src, results, calibration()[:2])
    assert isinstance(model.model.layers[0].mlp.down_proj, DecodedLinear)
