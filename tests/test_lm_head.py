"""--lm-head (issue 40): lm_head quantized after the last block, calibrated on what it reads in the quantized model
(the final norm of the quantized blocks' outputs), written packed beside the float embedding (a tied head untied),
loaded whole or streamed."""
import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import dequantize_gptq
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit.algorithms.hessian import fidelity
from quantkit.algorithms.rtn import rtn
from quantkit.api import quantize
from quantkit.calibration.data import calibration_ids
from quantkit.run.config import QuantConfig
from quantkit.run.convert import convert
from quantkit.run.load import load_quantized
from quantkit.schemes.grid import Grid

IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 41, 3, 8, 60, 12]])
NSAMPLES, SEQLEN = 4, 32


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    text = tmp_path_factory.mktemp("calib") / "calib.txt"
    text.write_text("\n".join(f"Once upon a time a little fox number {i} found a red ball and played with it all "
                              "day long in the sun." for i in range(60)))
    return text


def quantize_with_head(src, out, calib, method="rtn", **options):
    config = QuantConfig(method=method, group_size=32, lm_head=True, dataset=str(calib), nsamples=NSAMPLES,
                         seqlen=SEQLEN, **options)
    return quantize(str(src), out, config, device="cpu")


def checkpoint_tensors(folder) -> dict:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def decoded_reference(src, tensors: dict):
    """The fp model untied, every quantized linear's weight replaced by its decode from the checkpoint's tensors."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    for name in {k.rpartition(".")[0] for k in tensors if k.endswith(".qweight")}:
        module = model.get_submodule(name)
        layer = {leaf: tensors[f"{name}.{leaf}"] for leaf in ("qweight", "qzeros", "scales", "g_idx")}
        module.weight.data = dequantize_gptq(layer, 4, module.in_features)
    return model


@pytest.mark.parametrize("kind", ["llama-tied-bias", "llama-gqa"])
def test_lm_head_is_written_packed_beside_the_float_embedding(model_factory, tmp_path, calib, kind):
    src = model_factory(kind)
    report = quantize_with_head(src, tmp_path / "q", calib)
    tensors = checkpoint_tensors(tmp_path / "q")
    assert "lm_head.qweight" in tensors and "lm_head.weight" not in tensors
    fp = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    assert torch.equal(tensors["model.embed_tokens.weight"], fp.model.embed_tokens.weight)  # untouched
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["lm_head"] is True
    assert report["coverage"]["quantized_share"] == 1.0 and "lm_head" in report["layers"]
    assert "lm_head" not in report["coverage"]["summary"]  # nothing named lm_head is left in float

    loaded, reference = load_quantized(tmp_path / "q", device="cpu"), decoded_reference(src, tensors)
    assert type(loaded.lm_head).__name__ != "Linear"
    with torch.inference_mode():
        torch.testing.assert_close(loaded(IDS).logits, reference(IDS).logits, rtol=1e-5, atol=1e-5)
        streamed = load_quantized(tmp_path / "q", device="cpu", stream=True)
        torch.testing.assert_close(streamed(IDS).logits, loaded(IDS).logits)


def test_gptq_calibrates_lm_head_on_the_final_norm_of_the_quantized_blocks(model_factory, tmp_path, calib):
    src = model_factory("llama-tied-bias")
    report = quantize_with_head(src, tmp_path / "q", calib, method="gptq")
    layer = report["layers"]["lm_head"]
    assert layer["tokens"] == NSAMPLES * SEQLEN

    # lm_head's inputs in the quantized model on the run's own calibration windows: its Hessian must be theirs
    ids = calibration_ids(AutoTokenizer.from_pretrained(src), str(calib), NSAMPLES, SEQLEN, 0)
    loaded, inputs = load_quantized(tmp_path / "q", device="cpu"), []
    loaded.lm_head.register_forward_pre_hook(lambda m, args: inputs.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.inference_mode():
        for row in ids:
            loaded(row[None])
    x = torch.cat(inputs).double()
    H = 2 * x.T @ x / len(x)
    W = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).lm_head.weight.detach().double()
    W_gptq = decoded_reference(src, checkpoint_tensors(tmp_path / "q")).lm_head.weight.detach().double()
    assert fidelity(W, W_gptq, H)["error"] == pytest.approx(layer["error"], rel=1e-3)
    W_rtn = rtn(W.float(), Grid(4, True), 32).decoded().double()  # what rounding alone gives on the same inputs
    assert layer["error"] < 0.9 * fidelity(W, W_rtn, H)["error"]


def test_a_recipe_can_skip_lm_head_or_give_it_more_bits(model_factory, tmp_path, calib):
    src = model_factory("llama-tied-bias")
    quantize_with_head(src, tmp_path / "skip", calib, modules=[{"pattern": "^lm_head$", "skip": True}])
    assert not any(k.startswith("lm_head") for k in checkpoint_tensors(tmp_path / "skip"))
    assert json.loads((tmp_path / "skip" / "config.json").read_text())["tie_word_embeddings"] is True
    report = quantize_with_head(src, tmp_path / "eight", calib, modules=[{"pattern": "^lm_head$", "bits": 8}])
    assert report["layers"]["lm_head"]["bits"] == 8
    assert load_quantized(tmp_path / "eight", device="cpu")(IDS).logits.isfinite().all()


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq_v2", "awq"])
def test_convert_keeps_lm_head_quantized_and_declared(model_factory, tmp_path, calib, fmt):
    quantize_with_head(model_factory("llama-tied-bias"), tmp_path / "q", calib)
    convert(tmp_path / "q", tmp_path / fmt, fmt)
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["lm_head"] is True
    with torch.inference_mode():
        assert torch.equal(load_quantized(tmp_path / fmt, device="cpu")(IDS).logits,
                           load_quantized(tmp_path / "q", device="cpu")(IDS).logits)
