"""A new quantizer is one scheme file, a new checkpoint format one codec file and a new algorithm one algorithm file:
here all three live in this test module and nothing else in quantkit names them. The toy scheme is quantized (as a
quantizer, and as a method of its own behind a Hadamard rotation, inside GPTQ too), written, loaded and run; the toy
codec is written, loaded and converted to and from; the toy algorithm brings its own option to the config, recipes
and the CLI, and runs end to end.
"""
from dataclasses import dataclass

import pytest
import torch

import quantkit
from quantkit.algorithms.registry import ALGORITHMS, METHODS, MethodSpec, Rounding, register_algorithm, register_method
from quantkit.algorithms.rtn import rtn
from quantkit.checkpoint import repack
from quantkit.checkpoint.codecs import CODECS, Codec, register_codec
from quantkit.core.errors import QuantkitError
from quantkit.core.groups import group_index
from quantkit.core.options import Option
from quantkit.core.result import QuantResult
from quantkit.nn.decoded_linear import DecodedLinear
from quantkit.schemes.base import METHOD_QUANTIZERS, QUANTIZERS, KernelDecode, offer_method, register_quantizer
from quantkit.schemes.grid import Grid

LEVELS = (-1.0, 0.0, 1.0, 0.0)  # code 3 is never written: the table holds 2^bits entries


# ------------------------------------------------------------------ the scheme file: ternary weights, one scale
@dataclass(frozen=True)
class Ternary:
    """w_hat = scale * {-1, 0, +1} (codes 0, 1, 2 in 2 bits), scale = 1.5 * mean |w| per row and group."""
    bits: int = 2

    name = "test-ternary"
    summary = "ternary weights times one fp16 scale per group (a test quantizer)"
    width = 1
    code_bits = 2
    param_bits = {"scale": 16}
    kernel_decode = KernelDecode("table", table=LEVELS)

    @classmethod
    def from_spec(cls, bits, sym, group_size):
        return cls()

    def settings(self):
        return {"bits": self.bits}

    def fit(self, w, importance=None):
        scale = (1.5 * w.float().abs().mean(dim=1)).clamp(min=2**-14).half().float()
        return {"scale": scale}

    def round(self, w, params):
        s = params["scale"][:, None].to(w.dtype)
        codes = torch.clamp(torch.round(w / s), -1, 1) + 1
        return codes.to(torch.int32), (codes - 1) * s

    def dequantize(self, codes, params):
        return params["scale"].float() * torch.tensor(LEVELS, device=codes.device)[codes.long()]


# ------------------------------------------------------------------ the codec file: integer grids, unpacked
CODES, SCALE, ZERO = "wq", "wscale", "wzero"  # a toy layer's tensors


class ToyCodec(Codec):
    """Unrotated integer grids as unpacked int8 codes [N, K], fp16 scales [N, G] and int8 zeros [N, G]."""

    quant_method = "test-toy"
    checkpoint_formats = {"test-toy": "unpacked int8 codes (a test format)"}

    @staticmethod
    def accepts(res):
        return repack.int_refusal(res, "test-toy") is None

    @staticmethod
    def refusal(res):
        return repack.int_refusal(res, "test-toy")

    @staticmethod
    def quantization_config(config, results, all_linears, act_order, extra=None, fused=None):
        layers = {n: {"bits": r.quantizer.bits, "sym": r.quantizer.sym, "group_size": r.group_size}
                  for n, r in results.items()}
        return {"quant_method": "test-toy", "layers": layers, **(extra or {})}

    @staticmethod
    def layer_tensors(res, config, bias_dtype):
        out = {CODES: res.codes.to(torch.int8), SCALE: res.params["scale"].half(),
               ZERO: res.params["zero"].to(torch.int8)}
        if res.bias is not None:
            out["bias"] = res.bias.detach().to(bias_dtype or torch.float16)
        return out

    @staticmethod
    def check_config(qc, where):
        if not isinstance(qc.get("layers"), dict):
            raise QuantkitError(f"{where} needs 'layers'")

    @staticmethod
    def layer_result(tensors, name, settings, fmt):
        codes = tensors[f"{name}.{CODES}"].to(torch.int32)
        k = codes.shape[1]
        return QuantResult(codes=codes, params={"scale": tensors[f"{name}.{SCALE}"].float(),
                                                "zero": tensors[f"{name}.{ZERO}"].to(torch.int32)},
                           g_idx=group_index(k, settings["group_size"]),
                           quantizer=Grid(settings["bits"], settings["sym"]), group_size=settings["group_size"],
                           bias=tensors.get(f"{name}.bias"))

    @classmethod
    def read_layers(cls, qc, tensors, where):
        """Each layer decoded exactly and installed in the GPTQ layout that quantkit's kernels run."""
        layers = []
        for name, settings in qc["layers"].items():
            res = cls.layer_result(tensors, name, {**settings, "quantizer": "int"}, None)
            layers.append(repack.install(tensors, res, name, (CODES, SCALE, ZERO)))
        return layers

    @staticmethod
    def build_module(layer, qc, dtype):
        return repack.runtime_module(layer, dtype)


# ------------------------------------------------------------------ the algorithm file: RTN of a shrunk weight
class Shrunk(Rounding):
    """Round to nearest the weight times --test-shrink (a test algorithm with an option of its own)."""
    name = "test-shrink"
    options = (Option("test_shrink", float, 1.0, "test-shrink: the factor the weights are multiplied by first.",
                      check=lambda factor: None if 0 < factor <= 1 else "use a factor in (0, 1]"),)

    def round(self, weight, observer, quantizer, group_size, config, bias):
        return rtn(weight * config.test_shrink, quantizer, group_size, bias=bias)


# ------------------------------------------------------------------ the tests
@pytest.fixture(autouse=True)
def registered():
    register_quantizer(Ternary)
    offer_method(Ternary.name, "ternary weights")
    register_codec(ToyCodec)
    register_algorithm(Shrunk())
    register_method(MethodSpec(Shrunk.name, Shrunk.name, summary="the weights shrunk, then rounded (a test method)"))
    yield
    QUANTIZERS.pop(Ternary.name)
    METHOD_QUANTIZERS.pop(Ternary.name)
    CODECS.pop(ToyCodec.quant_method)
    ALGORITHMS.pop(Shrunk.name)
    METHODS.pop(Shrunk.name)


def calibration():
    return torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(3))


def logits(folder_or_model, ids):
    model = quantkit.load_quantized(folder_or_model, device="cpu") if not isinstance(folder_or_model, torch.nn.Module) \
        else folder_or_model
    with torch.no_grad():
        return model(ids).logits


def test_a_registered_quantizer_quantizes_writes_and_loads(model_factory, tmp_path):
    src, ids = model_factory("llama-gqa"), calibration()
    config = quantkit.QuantConfig(method="rtn", quantizer=Ternary.name, bits=2, group_size=32)
    report = quantkit.quantize(str(src), tmp_path / "q", config)
    layer = report["layers"]["model.layers.0.mlp.down_proj"]
    assert layer["quantizer"] == Ternary.name and layer["bits_per_weight"] == pytest.approx(2 + 16 / 32)
    model = quantkit.load_quantized(tmp_path / "q", device="cpu")
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(down, DecodedLinear) and down.quantizer == Ternary()
    # every decoded weight is -s, 0 or +s of its group's scale: the checkpoint holds ternary codes
    w, s = down.weight(), down.scale.float().t()[:, group_index(down.in_features, 32).long()]
    assert bool(((w == 0) | (w == s) | (w == -s)).all())
    # the kernel path (the table decode of KernelDecode) computes what the cached decode does
    x = torch.randn(3, down.in_features)
    down.cache_dequantized = False
    torch.testing.assert_close(down(x), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(logits(model, ids)).all()


@pytest.mark.parametrize("method", [Ternary.name, f"{Ternary.name}+gptq"])
def test_a_quantizer_offers_its_own_methods(model_factory, tmp_path, method):
    src = model_factory("llama-gqa")
    config = quantkit.QuantConfig(method=method, bits=2, group_size=32)
    assert config.quantizer == Ternary.name and config.rotate == "hadamard"
    report = quantkit.quantize(str(src), tmp_path / "q", config, calibration_ids=calibration())
    assert report["layers"]["model.layers.1.self_attn.o_proj"]["rotation"]["type"] == "hadamard"
    model = quantkit.load_quantized(tmp_path / "q", device="cpu")
    assert torch.isfinite(logits(model, calibration())).all()


def test_a_registered_codec_writes_loads_and_converts(model_factory, tmp_path):
    src, ids = model_factory("llama-tied-bias"), calibration()
    config = dict(method="rtn", bits=4, group_size=32, sym=False)
    quantkit.quantize(str(src), tmp_path / "gptq", quantkit.QuantConfig(**config, checkpoint_format="gptq_v2"))
    quantkit.quantize(str(src), tmp_path / "toy", quantkit.QuantConfig(**config, checkpoint_format="test-toy"))
    assert '"quant_method": "test-toy"' in (tmp_path / "toy" / "config.json").read_text()
    reference = logits(tmp_path / "gptq", ids)
    assert torch.equal(logits(tmp_path / "toy", ids), reference)  # the same codes, run by the same kernels
    quantkit.convert(tmp_path / "gptq", tmp_path / "to-toy", "test-toy")
    quantkit.convert(tmp_path / "toy", tmp_path / "from-toy", "gptq_v2")
    assert torch.equal(logits(tmp_path / "to-toy", ids), reference)
    assert torch.equal(logits(tmp_path / "from-toy", ids), reference)
    with pytest.raises(QuantkitError, match="cannot store"):  # its refusal names the layer
        quantkit.quantize(str(src), tmp_path / "rotated", quantkit.QuantConfig(
            method="turboquant", bits=4, group_size=32, checkpoint_format="test-toy"))


def test_unregistered_names_are_refused_with_the_choices():
    CODECS.pop(ToyCodec.quant_method)
    try:
        with pytest.raises(QuantkitError, match="unknown checkpoint format 'test-toy': use one of gptq"):
            quantkit.QuantConfig(checkpoint_format="test-toy")
    finally:
        register_codec(ToyCodec)
    with pytest.raises(QuantkitError, match="unknown method 'nope': choose one of rtn, "):
        quantkit.QuantConfig(method="nope")


def test_a_registered_algorithm_brings_its_option_to_the_config_recipes_and_cli(model_factory, tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from quantkit.cli import main

    assert "--test-shrink FLOAT" in CliRunner().invoke(main, ["quantize", "--help"]).output
    assert quantkit.QuantConfig().test_shrink == 1.0  # declared default
    refused = CliRunner().invoke(main, ["quantize", "m", "-o", str(tmp_path / "x"), "--test-shrink", "2"])
    assert refused.exit_code == 2 and "error: --test-shrink 2.0: use a factor in (0, 1]" in refused.output
    src = model_factory("llama-gqa")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("method: test-shrink\ntest_shrink: 0.5\nbits: 4\ngroup_size: 32\n")
    done = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "q"), "--recipe", str(recipe)])
    assert done.exit_code == 0, done.output
    original = load_file(next(src.glob("*.safetensors")))["model.layers.0.mlp.down_proj.weight"].float()
    layer = quantkit.load_quantized(tmp_path / "q", device="cpu", dtype=torch.float32).get_submodule(
        "model.layers.0.mlp.down_proj")
    x = torch.randn(5, original.shape[1])
    expected = x @ rtn(original * 0.5, Grid(4, sym=True), 32).decoded().t()  # what the toy algorithm rounded
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)
