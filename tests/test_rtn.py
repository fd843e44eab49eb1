import pytest
import torch

from quantkit.core.errors import QuantkitError
from quantkit.schemes import grid as qgrid
from quantkit.schemes.grid import Grid
from quantkit.algorithms.rtn import rtn


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("in_features,group_size", [(128, 32), (72, 32), (96, -1), (40, 128)])
def test_rtn_shapes_and_grid_bound(bits, sym, in_features, group_size):
    torch.manual_seed(bits * 100 + in_features)
    out = 48
    w = torch.randn(out, in_features) * torch.linspace(0.1, 3.0, in_features)
    res = rtn(w, Grid(bits, sym), group_size)
    size = in_features if group_size == -1 else group_size
    ng = -(-in_features // size)

    assert res.codes.shape == (out, in_features) and res.codes.dtype == torch.int32
    assert res.params["scale"].shape == (out, ng) and res.params["scale"].dtype == torch.float32
    assert res.params["zero"].shape == (out, ng) and torch.equal(res.params["zero"], res.params["zero"].round())
    assert res.g_idx.dtype == torch.int32
    assert torch.equal(res.g_idx, (torch.arange(in_features) // size).to(torch.int32))
    assert (res.quantizer.bits, res.group_size, res.quantizer.sym) == (bits, group_size, sym)
    assert res.codes.min() >= 0 and res.codes.max() <= 2**bits - 1
    assert torch.equal(res.params["scale"], res.params["scale"].half().float())  # fp16-representable
    if sym:
        assert (res.params["zero"] == 2 ** (bits - 1)).all()
    else:
        assert res.params["zero"].min() >= 1 and res.params["zero"].max() <= 2**bits - 1

    w_hat = res.dequantize()
    assert w_hat.shape == w.shape
    scale = res.params["scale"][:, res.g_idx.long()]
    err = (w - w_hat).abs()
    # round-to-nearest: |w - w_hat| <= scale / 2; the only excess comes from the clamp at the top
    # code when the fp16 rounding of the scale shrank the grid (<= 2^-11 of the group's span).
    absmax = torch.stack([w[:, g * size:(g + 1) * size].abs().amax(1) for g in range(ng)], 1)
    slack = absmax[:, res.g_idx.long()] * 2.0**-10 + 1e-7
    assert (err <= scale / 2 + slack).all()
    assert (err <= scale / 2 * (1 + 1e-6)).float().mean() > 0.85  # sym: each group's absmax sits on a half step
    # every column of a group decodes with that group's scale and zero, groups independent
    for g in range(ng):
        c0, c1 = g * size, min((g + 1) * size, in_features)
        part = rtn(w[:, c0:c1], Grid(bits, sym), -1)
        assert torch.equal(part.codes, res.codes[:, c0:c1])
        assert torch.equal(part.params["scale"][:, 0], res.params["scale"][:, g])


def test_rtn_error_shrinks_with_bits():
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    errs = [((w - rtn(w, Grid(b, False), 32).dequantize()) ** 2).mean().item() for b in (2, 3, 4, 8)]
    assert errs[0] > errs[1] > errs[2] > errs[3]
    assert errs[2] / errs[1] < 0.35 and errs[3] < 1e-3 * errs[0]


def test_rtn_special_rows():
    w = torch.zeros(3, 16)
    w[1] = torch.rand(16) + 0.5   # all positive: asym zero is clamped to 1 (GPTQ v1 layout)
    w[2, 5] = -2.0                # single nonzero
    for sym in (True, False):
        res = rtn(w, Grid(4, sym), -1)
        w_hat = res.dequantize()
        assert torch.isfinite(w_hat).all()
        assert (w_hat[0] == 0).all()
        assert (w_hat[2, 5] + 2.0).abs() <= res.params["scale"][2, 0] / 2 * (1 + 2e-3)
        assert (w_hat[2, torch.arange(16) != 5] == 0).all()
        scale = res.params["scale"][1, 0]
        assert ((w[1] - w_hat[1]).abs() <= scale * 1.01).all()
    assert rtn(w, Grid(4, False), -1).params["zero"][1, 0] == 1


def test_rtn_bias_and_dtype_passthrough():
    w = torch.randn(8, 32, dtype=torch.float16)
    b = torch.randn(8)
    res = rtn(w, Grid(4), 16, bias=b)
    assert res.bias is b
    assert res.dequantize().dtype == torch.float32


@pytest.mark.parametrize("bits,group_size", [(5, 32), (4, 0), (4, -2)])
def test_rtn_rejects_bad_args(bits, group_size):
    with pytest.raises(QuantkitError):
        rtn(torch.randn(4, 32), Grid(bits), group_size)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_sym_negative_extreme_keeps_the_full_code(bits):
    """A symmetric group's negative extreme sits exactly on the tie -(2^(bits-1) - 1/2) steps. With the scale
    rounded to the nearest fp16 it went to code 1 whenever fp16 rounded up (about half the rows), shrinking the
    group's largest weight by half a step; the scale rounded down gives it code 0 (-2^(bits-1) steps) in every row."""
    torch.manual_seed(bits)
    absmax = torch.rand(4096) * 2 + 0.01
    w = torch.rand(4096, 32) * absmax[:, None] * 1.8 - 0.9 * absmax[:, None]
    w[:, 5] = -absmax  # the negative extreme of every row
    scale, zero = qgrid.fit(w, Grid(bits, True))  # the max-abs scale (Grid.fit's first candidate)
    assert (scale <= 2 * absmax / (2**bits - 1)).all()  # rounded down, never up
    assert (qgrid.quantize(w[:, 5], scale, zero, 2**bits - 1) == 0).all()


def squared_errors(w, scale, bits, importance=torch.tensor(1.0)):
    zero = torch.full_like(scale, 2.0 ** (bits - 1))
    decoded = qgrid.dequantize(qgrid.quantize(w, scale[:, None], zero[:, None], 2**bits - 1), scale[:, None], zero[:, None])
    return ((w.double() - decoded.double()) ** 2 * importance.double()).sum(dim=1)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_sym_scale_is_the_better_of_max_abs_and_range_fit(bits):
    """Each row takes whichever of the two symmetric scales rounds it with the smaller squared error, weighted by the
    columns' importance when given. A row whose positive extreme dominates loses half a step on it with the max-abs
    scale, which is what the range fit avoids."""
    torch.manual_seed(bits)
    w = torch.randn(2048, 32)
    w[:1024, 3] = w[:1024].abs().amax(dim=1) * 1.3  # half the rows: a dominant positive extreme
    grid = Grid(bits, True)
    max_abs, range_fit = qgrid.fit(w, grid)[0], qgrid.range_fit_scale(w, grid)
    for importance in (None, torch.rand(32) ** 4 * 100):
        weight = torch.tensor(1.0) if importance is None else importance
        chosen = grid.fit(w, importance=importance)["scale"]
        assert ((chosen == max_abs) | (chosen == range_fit)).all()
        errors = [squared_errors(w, s, bits, weight) for s in (chosen, max_abs, range_fit)]
        assert torch.equal(errors[0], torch.minimum(errors[1], errors[2]))
        assert (chosen == range_fit).any() and (chosen != range_fit).any()  # both are taken somewhere
    half = 2 ** (bits - 1)
    assert (grid.round(w[:1024], {"scale": range_fit[:1024], "zero": torch.full((1024,), half * 1.0)})[0][:, 3]
            == 2 * half - 1).all()  # the range fit puts the dominant positive extreme on the last code
