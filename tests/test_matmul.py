"""quantkit.core.matmul: calibration's and evaluation's float32 CPU products through oneDNN give torch's results (to
float32 rounding), and the calibration loop and the evaluation really use them where oneDNN is available."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantkit.core import matmul
from quantkit.run.config import QuantConfig
from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.method import Method
from quantkit.models.arch import arch_for
from tiny_models import run_sequential
from test_awq import ids, tiny_model

needs_onednn = pytest.mark.skipif(not matmul.onednn_available(), reason="oneDNN is used on CPUs with AVX-512 only")


@pytest.fixture(params=[True, False], ids=["onednn", "torch"])
def enabled(request, monkeypatch):
    monkeypatch.setattr(matmul, "ENABLED", request.param)
    return request.param


@pytest.fixture
def onednn_calls(monkeypatch):
    """Counts the products that went through oneDNN."""
    calls = []
    real = matmul._onednn_linear
    monkeypatch.setattr(matmul, "_onednn_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    return calls


def _close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("x_shape", [(7, 96), (2, 5, 96), (0, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_is_f_linear(enabled, x_shape, with_bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*x_shape, generator=g), torch.randn(40, 96, generator=g)
    b = torch.randn(40, generator=g) if with_bias else None
    _close(matmul.linear(x, w, b), F.linear(x.double(), w.double(), None if b is None else b.double()).float())


def test_strided_operands_are_multiplied_as_they_read(enabled):
    """A column slice and a transposed view (oneDNN wants dense rows: they are made contiguous first)."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(64, 300, generator=g)
    x, w = big[:, 10:106], torch.randn(96, 40, generator=g).t()
    _close(matmul.linear(x, w), (x.double() @ w.double().t()).float())


def test_addmm_nt_accumulates_in_place(enabled):
    g = torch.Generator().manual_seed(2)
    out, a, b = torch.randn(24, 40, generator=g), torch.randn(24, 64, generator=g), torch.randn(40, 64, generator=g)
    want = (0.25 * out.double() + 0.5 * a.double() @ b.double().t()).float()
    got = matmul.addmm_nt_(out, a, b, beta=0.25, alpha=0.5)
    assert got is out
    _close(out, want)


def test_hessian_bands_match_torchs_product(monkeypatch):
    """GPTQ's H through oneDNN (where available) equals the BLAS path's to float32 rounding, over inputs wider than one
    band (HESSIAN_TILE) in batches of several sizes; the lower triangle mirrors the upper one."""
    g = torch.Generator().manual_seed(3)
    w, xs = torch.randn(8, 450), [torch.randn(n, 450, generator=g) for n in (64, 1, 200)]
    hessians = {}
    for on in (True, False):
        monkeypatch.setattr(matmul, "ENABLED", on)
        gptq = GPTQ(w)
        for x in xs:
            gptq.add_batch(x)
        hessians[on] = gptq.H
    want = 2 * sum(x.double().t() @ x.double() for x in xs) / sum(len(x) for x in xs)
    for H in hessians.values():
        _close(H, want.float())
        assert torch.equal(H[200:, :192], H[:192, 200:].t())  # below the diagonal tiles: copied, not computed


@needs_onednn
def test_only_float32_products_without_gradients_go_through_onednn(onednn_calls):
    w = torch.randn(4, 8)
    matmul.linear(torch.randn(2, 8), w)
    matmul.linear(torch.randn(2, 8, dtype=torch.float64), w.double())
    matmul.linear(torch.randn(2, 8, requires_grad=True), w).sum().backward()  # autograd: torch's own
    with torch.no_grad():
        matmul.linear(torch.randn(2, 8, requires_grad=True), w)
    assert len(onednn_calls) == 2


@needs_onednn
def test_onednn_linears_swaps_the_class_of_plain_linears_only_and_restores_it(onednn_calls):
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Custom(8, 8), nn.Linear(8, 4))
    seen = []
    model[3].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    x = torch.randn(3, 8)
    want = model(x).detach()
    with pytest.raises(RuntimeError, match="inside"):
        with matmul.onednn_linears(model):
            assert [type(m).__name__ for m in model] == ["_OneDNNLinear", "ReLU", "Custom", "_OneDNNLinear"]
            assert isinstance(model[0], nn.Linear)
            with torch.no_grad():  # parameters that track gradients keep torch's own product
                _close(model(x), want)
            raise RuntimeError("inside")
    assert len(onednn_calls) == 2 and len(seen) == 2  # the two plain linears, once; the hook fired both times
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, Custom, nn.Linear]
    with torch.no_grad():
        model(x)
    assert len(onednn_calls) == 2


@needs_onednn
def test_calibration_multiplies_through_onednn_and_quantizes_as_torch_would(onednn_calls, monkeypatch):
    """The calibration loop's block linears and Hessians take the oneDNN path, and quantize as the torch path does
    (the same fidelity to float32 rounding; a code may differ where a product's last bit moved a rounding)."""
    config = QuantConfig(method="gptq", bits=4, group_size=32, nsamples=4, seqlen=32)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(matmul, "ENABLED", on)
        onednn_calls.clear()
        model = tiny_model("llama-gqa")
        arch = arch_for(model)
        results[on] = run_sequential(model, arch, ids(), Method(config, arch), "cpu")
        assert bool(onednn_calls) == on
    ours, theirs = results[True], results[False]
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].stats["error"] == pytest.approx(theirs[name].stats["error"], rel=1e-3, abs=1e-7)
        assert (ours[name].codes != theirs[name].codes).float().mean() < 0.01


def test_quantkit_onednn_0_keeps_torchs_products(monkeypatch):
    import importlib

    monkeypatch.setenv("QUANTKIT_ONEDNN", "0")
    try:
        assert importlib.reload(matmul).ENABLED is False
        assert not matmul.uses_onednn(torch.randn(2, 2))
    finally:
        monkeypatch.delenv("QUANTKIT_ONEDNN")
        assert importlib.reload(matmul).ENABLED is True


@needs_onednn
@pytest.mark.parametrize("method, bits", [("rtn", 4), ("turboquant", 2)])
def test_evaluation_multiplies_through_onednn_as_torch_would(method, bits, model_factory, tmp_path, onednn_calls,
                                                           monkeypatch):
    """perplexity() of a floating-point model and of a quantized one: every nn.Linear takes oneDNN once per window,
    and the perplexity is torch's to float32 rounding. The quantized layers' decoded strips are Wᵀ, which torch's
    product takes as they are (quantkit.core.strips): they never reach oneDNN, whose weight would need a copy."""
    from quantkit.api import quantize
    from quantkit.eval import perplexity
    from quantkit.run.load import load_quantized
    from quantkit.models.hub import load_fp_model

    src = model_factory("llama-tied-bias")
    quantize(str(src), tmp_path / "q", QuantConfig(method=method, bits=bits, group_size=32), device="cpu")
    stream = torch.randint(0, 512, (1, 3 * 16), generator=torch.Generator().manual_seed(4))
    for model in (load_fp_model(str(src), "float32")[0], load_quantized(tmp_path / "q", device_map="cpu")):
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        ppl = {}
        for on in (True, False):
            monkeypatch.setattr(matmul, "ENABLED", on)
            onednn_calls.clear()
            ppl[on] = perplexity(model, stream, 16, progress=False)["ppl"]
            assert len(onednn_calls) == (3 * len(linears) if on else 0)
        assert ppl[True] == pytest.approx(ppl[False], rel=1e-5)
