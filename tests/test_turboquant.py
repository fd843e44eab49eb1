"""TurboQuant: the Lloyd–Max codebooks, the quantizer, its GPTQ (Hessian-aware) variant, the checkpoint round trip.

Tolerances: codebook centroids are checked by an independent quadrature (trapezoid rule on 20,001 points per
cell) to 1e-4, the grid iteration's resolution being 2.4e-5 in the variance-1 scale; a codebook of the wrong
density (the Gaussian instead of the d = 16 sphere) is off by more than 1e-2. Loaded logits match the in-loop
model to 1e-4 (both decode the same float32 weights; only summation order differs).
"""
import json
import math

import pytest
import torch
from click.testing import CliRunner

from quantkit.api import quantize
from quantkit.cli import main
from quantkit.run.config import QuantConfig
from quantkit.core.errors import QuantkitError
from quantkit.core import bitpack
from quantkit.run.load import load_quantized
from quantkit.schemes.lloyd_max import codebook_mse, lloyd_max, sphere_density
from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.hessian import output_error
from quantkit.algorithms.rtn import rtn
from quantkit.schemes.turboquant import TurboQuant
from quantkit.nn.decoded_linear import DecodedLinear
from test_quantizers import calibration, capture_results, loads_as_in_loop

GAUSSIAN_LLOYD_MAX = {1: 0.3634, 2: 0.1175, 3: 0.03455, 4: 0.009501, 5: 0.0025}  # published unit-Gaussian MSEs


def centroid(a, b, dim):
    u = torch.linspace(a, b, 20_001, dtype=torch.float64)
    f = sphere_density(dim, u)
    return float(torch.trapezoid(u * f, u) / torch.trapezoid(f, u))


@pytest.mark.parametrize("bits,dim", [(2, 128), (3, 64), (4, None), (3, 16), (5, 128)])
def test_codebook_meets_the_lloyd_conditions(bits, dim):
    levels = lloyd_max(bits, dim)
    assert len(levels) == 2**bits and list(levels) == sorted(levels)
    assert all(abs(a + b) < 1e-9 for a, b in zip(levels, reversed(levels)))  # symmetric, like the density
    edge = 12.0 if dim is None else math.sqrt(dim)
    bounds = [-edge] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [edge]  # nearest-level cells
    for i, level in enumerate(levels):
        assert level == pytest.approx(centroid(bounds[i], bounds[i + 1], dim), abs=1e-4)


def test_codebook_mse_matches_the_published_gaussian_values_and_the_sphere_is_lighter_tailed():
    for bits, expected in GAUSSIAN_LLOYD_MAX.items():
        assert codebook_mse(lloyd_max(bits)) == pytest.approx(expected, rel=2e-3)
        assert codebook_mse(lloyd_max(bits, 128), 128) < codebook_mse(lloyd_max(bits))
    # d = 16 is visibly not Gaussian: its own codebook differs from the Gaussian one
    assert max(abs(a - b) for a, b in zip(lloyd_max(3, 16), lloyd_max(3))) > 1e-2


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_codes_round_trip_through_packing(bits):
    codes = torch.randint(0, 2**bits, (100, 7), generator=torch.Generator().manual_seed(bits), dtype=torch.int32)
    packed = bitpack.pack(codes, bits, dim=0)
    assert packed.shape == (bitpack.packed_len(100, bits), 7)
    assert torch.equal(bitpack.unpack(packed, bits, 100, dim=0), codes)


def gaussian_blocks(n=4000, d=128, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_norm_scale_reaches_the_codebook_mse_and_the_searched_scale_beats_it(bits):
    x = gaussian_blocks()
    err = {}
    for scale in ("norm", "ratio", "mse"):
        res = rtn(x, TurboQuant(bits, 128, scale), 128)
        assert int(res.codes.min()) >= 0 and int(res.codes.max()) < 2**bits
        err[scale] = float((x - res.decoded()).pow(2).sum() / x.pow(2).sum())
    # with the paper's norm, a Gaussian block sees the sphere density: the codebook's own MSE (sampling error ~2 %)
    assert err["norm"] == pytest.approx(codebook_mse(lloyd_max(bits, 128), 128), rel=0.03)
    assert err["mse"] < err["norm"]


def test_quantizer_decodes_what_it_rounded_and_rejects_bad_settings():
    x = gaussian_blocks(64, 64)
    q = TurboQuant(3, 64)
    res = rtn(x, q, 64)
    codes, wq = q.round(x, {"scale": res.params["scale"][:, 0]})
    assert torch.equal(codes.to(torch.int32), res.codes) and torch.equal(wq, res.decoded())
    assert res.params["scale"].half().float().equal(res.params["scale"])  # what the fp16 checkpoint holds
    assert res.bits_per_weight() == 3 + 16 / 64
    for bad, match in [(dict(bits=8, dim=64), "bits 8"), (dict(bits=3, dim=96), "power of two"),
                       (dict(bits=3, dim=64, scale="absmax"), "scale"), (dict(bits=2, dim=64, codebook=[1, 2]), "4 numbers"),
                       (dict(bits=1, dim=64, codebook=[1.0, 0.5]), "ascending")]:
        with pytest.raises(QuantkitError, match=match):
            TurboQuant(**bad)


def test_hessian_aware_variant_has_lower_output_error_on_correlated_inputs():
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(48, 128, generator=gen, dtype=torch.float64)
    X = torch.randn(1024, 128, generator=gen, dtype=torch.float64) @ torch.randn(128, 128, generator=gen, dtype=torch.float64)
    q = TurboQuant(3, 64)
    g = GPTQ(W)
    g.add_batch(X)
    fed_back = g.quantize(q, group_size=64, keep_dequant=True)
    assert torch.equal(fed_back.decoded(), g.dequant.float())  # the loop used exactly what the result decodes to
    data_free = rtn(W, q, 64)
    assert output_error(W, fed_back.dequantize(), g.H) < 0.7 * output_error(W, data_free.dequantize(), g.H)


@pytest.mark.parametrize("method", ["turboquant", "turboquant+gptq"])
def test_writes_loads_and_gives_the_in_loop_logits(model_factory, tmp_path, monkeypatch, method):
    src = model_factory("llama-tied-bias")  # bias, tied embeddings, GQA; down_proj has 96 inputs: a short last block
    results = capture_results(monkeypatch)
    config = QuantConfig(method=method, bits=3, group_size=64, nsamples=4, seqlen=32)
    report = quantize(str(src), tmp_path / "q", config, device="cpu", calibration_ids=calibration())
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    layer = qc["layers"]["model.layers.0.mlp.down_proj"]
    assert qc["quant_method"] == "quantkit" and layer["quantizer"] == "turboquant"
    assert layer["rotation"]["type"] == "hadamard" and layer["dim"] == 64
    assert layer["codebook"] == list(TurboQuant(3, 64).codebook)
    assert report["layers"]["model.layers.0.mlp.down_proj"]["bits_per_weight"] == pytest.approx(3 + 2 * 16 / 96, abs=1e-4)  # 2 blocks per row
    module = loads_as_in_loop(tmp_path / "q", src, results, calibration()[:2]).model.layers[0].mlp.down_proj
    assert isinstance(module, DecodedLinear) and module.scale.dtype == torch.float16


def test_a_damaged_codebook_is_refused(model_factory, tmp_path):
    src = model_factory("llama")
    quantize(str(src), tmp_path / "q", QuantConfig(method="turboquant", bits=2, group_size=32), device="cpu")
    path = tmp_path / "q" / "config.json"
    config = json.loads(path.read_text())
    layer = next(iter(config["quantization_config"]["layers"].values()))
    layer["codebook"] = layer["codebook"][:3]
    path.write_text(json.dumps(config))
    with pytest.raises(QuantkitError, match="codebook needs 4 numbers"):
        load_quantized(tmp_path / "q", device="cpu")


@pytest.mark.parametrize("options,match", [
    (["--method", "turboquant", "--bits", "8"], "turboquant bits 8 is not supported"),
    (["--method", "turboquant", "--group-size", "-1"], "power of two such as 128, not -1"),
    (["--method", "turboquant+gptq", "--quantizer", "int"], "rounds with the turboquant quantizer"),
    (["--method", "awq", "--quantizer", "turboquant", "--rotate", "hadamard"], "AWQ's scales"),
])
def test_cli_refuses_bad_turboquant_settings(model_factory, tmp_path, options, match):
    result = CliRunner().invoke(main, ["quantize", str(model_factory("llama")), "-o", str(tmp_path / "q"), *options])
    assert result.exit_code != 0 and match in result.output
    assert "Traceback" not in result.output and not (tmp_path / "q").exists()
