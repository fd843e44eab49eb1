"""One shape for every quantizer: a test-only 2-wide quantizer plugs in by registration alone and runs through
RTN, the GPTQ loop (block LDLQ), the writer, the loader and eval; rotated layers load and give the in-loop logits."""
import json

import pytest
import torch
from click.testing import CliRunner

from quantkit.api import quantize
from quantkit.cli import main
from quantkit.run.config import QuantConfig
from quantkit.core.errors import QuantkitError
from quantkit.algorithms.method import Method
from quantkit.run.load import load_quantized
from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.hessian import output_error
from quantkit.schemes.base import QUANTIZERS, register_quantizer
from quantkit.schemes.rotation import Rotation
from quantkit.algorithms.rtn import rtn
from quantkit.models.arch import set_weight
from quantkit.models.hub import load_fp_model
from quantkit.nn.decoded_linear import DecodedLinear
from quantkit.nn.kinds import INTEGER_GRID_LINEARS


class PairQuantizer:
    """Test-only, 2 columns at a time: rounds the half-sum and half-difference of each pair on a shared grid."""
    name = "test-pair"
    width = 2

    def __init__(self, bits=4, sym=True):
        self.bits = bits
        self.mid = 2 ** (bits - 1)

    @classmethod
    def from_spec(cls, bits, sym, group_size):
        return cls(bits)

    @property
    def code_bits(self):
        return self.bits

    @property
    def param_bits(self):
        return {"scale": 16}

    def settings(self):
        return {"bits": self.bits}

    def _uv(self, w):
        a, b = w.float().reshape(w.shape[0], -1, 2).unbind(-1)
        return (a + b) / 2, (a - b) / 2

    def fit(self, w, importance=None):
        u, v = self._uv(w)
        peak = torch.maximum(u.abs().amax(dim=1), v.abs().amax(dim=1))
        return {"scale": (peak / (self.mid - 1)).clamp(min=1e-8).half().float()}

    def round(self, w, params):
        u, v = self._uv(w)
        s = params["scale"][:, None]
        cu = torch.clamp(torch.round(u / s) + self.mid, 0, 2**self.bits - 1)
        cv = torch.clamp(torch.round(v / s) + self.mid, 0, 2**self.bits - 1)
        codes = torch.stack([cu, cv], dim=-1).reshape(w.shape)
        return codes, self.dequantize(codes, {"scale": s.expand_as(w)})

    def dequantize(self, codes, params):
        c = codes.float().reshape(codes.shape[0], -1, 2)
        s = params["scale"].reshape(codes.shape[0], -1, 2)[..., 0]
        u, v = s * (c[..., 0] - self.mid), s * (c[..., 1] - self.mid)
        return torch.stack([u + v, u - v], dim=-1).reshape(codes.shape)


@pytest.fixture(autouse=True, scope="module")
def registered():
    register_quantizer(PairQuantizer)
    yield
    QUANTIZERS.pop(PairQuantizer.name)


def calibration():
    return torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(5))


def test_pair_quantizer_through_rtn_and_the_gptq_loop():
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(24, 64, generator=gen, dtype=torch.float64)
    X = torch.randn(512, 64, generator=gen, dtype=torch.float64) @ torch.randn(64, 64, generator=gen, dtype=torch.float64)
    q = PairQuantizer(3)
    plain = rtn(W, q, 16)
    assert plain.codes.shape == W.shape and plain.params["scale"].shape == (24, 4)
    g = GPTQ(W)
    g.add_batch(X)
    fed_back = g.quantize(q, group_size=16, block_size=8, keep_dequant=True)
    assert torch.equal(fed_back.decoded(), g.dequant.float())  # what the loop used is what the result decodes to
    # the block LDLQ feedback must beat plain rounding on correlated inputs
    assert output_error(W, fed_back.dequantize(), g.H) < 0.8 * output_error(W, plain.dequantize(), g.H)
    with pytest.raises(QuantkitError, match="multiples of 2"):
        rtn(W[:, :63], q, -1)


def capture_results(monkeypatch):
    """{linear name: QuantResult} of every layer a quantize() call rounds, as the method hands it on (the
    streaming writer packs each block's results as they come, so they are caught where they are made)."""
    seen = {}
    original = Method.quantize

    def spy(self, full_name, observer, module):
        seen[full_name] = original(self, full_name, observer, module)
        return seen[full_name]

    monkeypatch.setattr(Method, "quantize", spy)
    return seen


def in_loop_logits(src, results, ids, others=None):
    """The fp model holding exactly the weights the quantization loop ended with (and `others`, {name: tensor},
    such as norms AWQ rescaled)."""
    model, _ = load_fp_model(str(src), "float32")
    for name, res in results.items():
        set_weight(model.get_submodule(name), res.dequantize())
    with torch.no_grad():
        for name, t in (others or {}).items():
            model.get_parameter(name).copy_(t)
    with torch.inference_mode():
        return model(ids).logits


def loads_as_in_loop(folder, src, results, ids):
    """The model load_quantized builds from `folder` (on the CPU), checked to give the logits of the fp model holding
    the weights the quantization loop ended with (in_loop_logits)."""
    model = load_quantized(folder, device="cpu")
    with torch.inference_mode():
        got = model(ids).logits
    torch.testing.assert_close(got, in_loop_logits(src, results, ids), rtol=1e-4, atol=1e-4)
    return model


@pytest.mark.parametrize("method,quantizer,rotate", [
    ("rtn", "test-pair", "none"), ("gptq", "test-pair", "none"),
    ("rtn", "int", "hadamard"), ("gptq", "int", "hadamard"), ("gptq", "test-pair", "hadamard"),
])
def test_writes_loads_and_gives_the_in_loop_logits(model_factory, tmp_path, monkeypatch, method, quantizer, rotate):
    src = model_factory("llama-tied-bias")  # bias, tied embeddings, GQA
    results = capture_results(monkeypatch)
    config = QuantConfig(method=method, quantizer=quantizer, rotate=rotate, bits=4, group_size=32, nsamples=4,
                         seqlen=32)
    quantize(str(src), tmp_path / "q", config, device="cpu", calibration_ids=calibration())
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "quantkit"
    layer = qc["layers"]["model.layers.0.mlp.down_proj"]
    assert layer["quantizer"] == quantizer and (layer["rotation"] is not None) == (rotate == "hadamard")
    model = loads_as_in_loop(tmp_path / "q", src, results, calibration()[:2])
    module = model.model.layers[0].mlp.down_proj
    assert isinstance(module, DecodedLinear if quantizer == "test-pair" else INTEGER_GRID_LINEARS)


def test_rotation_is_orthogonal_and_moves_the_hessian():
    rot = Rotation.hadamard(96, seed=3)  # 96 = 3 x 32: block-diagonal, blocks of 32
    assert rot.block == 32
    dense = rot.rotate_weight(torch.eye(96, dtype=torch.float64))     # rows: Π e_i, i.e. I Πᵀ = Πᵀ
    torch.testing.assert_close(dense @ dense.t(), torch.eye(96, dtype=torch.float64))
    gen = torch.Generator().manual_seed(1)
    H = torch.randn(96, 96, generator=gen, dtype=torch.float64)
    H = H @ H.t()
    pi = dense.t()
    torch.testing.assert_close(rot.rotate_hessian(H), pi @ H @ pi.t())
    W = torch.randn(8, 96, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(rot.unrotate_weight(rot.rotate_weight(W)), W)


def test_rotated_gptq_error_is_basis_independent():
    gen = torch.Generator().manual_seed(2)
    W = torch.randn(16, 64, generator=gen, dtype=torch.float64)
    X = torch.randn(256, 64, generator=gen, dtype=torch.float64)
    g = GPTQ(W)
    g.add_batch(X)
    H = g.H.clone()
    from quantkit.schemes.grid import Grid

    rot = Rotation.hadamard(64, seed=0)
    g.rotate(rot)
    res = g.quantize(Grid(4), group_size=16)
    res.rotation = rot
    assert output_error(g.weight, res.decoded(), g.H) == pytest.approx(output_error(W, res.dequantize(), H), rel=1e-9)


def test_cli_rotate_writes_the_quantkit_format_and_inspect_shows_it(model_factory, tmp_path):
    out = tmp_path / "q"
    result = CliRunner().invoke(main, ["quantize", str(model_factory("llama")), "-o", str(out), "--rotate", "hadamard",
                                       "--group-size", "32"])
    assert result.exit_code == 0, result.output
    info = json.loads(CliRunner().invoke(main, ["inspect", str(out), "--json"]).output)
    layer = info["layers"]["model.layers.0.self_attn.q_proj"]
    assert layer["rotation"]["type"] == "hadamard" and layer["rotation"]["block"] == 64
    assert layer["bits_per_weight"] == pytest.approx(4 + 20 / 32, abs=0.01)  # rot_signs are not weight storage
    refused = CliRunner().invoke(main, ["quantize", str(model_factory("llama")), "-o", str(tmp_path / "a"),
                                        "--rotate", "hadamard", "--method", "awq"])
    assert refused.exit_code == 2 and "AWQ's scales are searched in the unrotated basis" in refused.output


@pytest.mark.parametrize("tamper,words", [
    (lambda qc, t: qc.update(format_version=2), "format_version"),
    (lambda qc, t: qc["layers"].pop("model.layers.1.mlp.up_proj"), "not listed"),
    (lambda qc, t: t.__setitem__("model.layers.0.mlp.up_proj.rot_signs", torch.zeros(64, dtype=torch.int8)),
     "rot_signs"),
    (lambda qc, t: qc["layers"]["model.layers.0.mlp.up_proj"]["rotation"].update(block=48), "rotation"),
])
def test_tampered_quantkit_checkpoint_is_refused(model_factory, tmp_path, tamper, words):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "q"
    quantize(str(model_factory("llama")), out, QuantConfig(rotate="hadamard", group_size=32), device="cpu")
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    tamper(config["quantization_config"], tensors)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantkitError, match=words):
        load_quantized(out, device="cpu")


@pytest.mark.parametrize("method,act_order,expected", [("rtn", True, False), ("awq", True, False),
                                                       ("gptq", True, True), ("gptq", False, False)])
def test_desc_act_says_what_was_done(model_factory, tmp_path, method, act_order, expected):
    """static_groups records GPTQ's act-order; desc_act tells readers g_idx is out of order, which static groups
    never leave it (issue 11: desc_act true sent readers down the slower act-order path for nothing)."""
    config = QuantConfig(method=method, act_order=act_order, group_size=32, nsamples=4, seqlen=32)
    quantize(str(model_factory("llama")), tmp_path / "q", config, device="cpu", calibration_ids=calibration())
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["static_groups"] is expected and qc["desc_act"] is False
