"""quantkit-format folders load through transformers' own AutoModelForCausalLM once quantkit is imported
(quantkit.integrations.transformers, issue 58): the same modules and logits as load_quantized, generate, and a
save_pretrained that loads again."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.core.errors import QuantkitError
from quantkit.nn.cpu_int4_linear import CpuInt4Linear
from quantkit.nn.decoded_linear import DecodedLinear
from quantkit.nn.quant_linear import QuantLinear

FORMATS = {
    "turboquant": dict(method="turboquant", bits=4, group_size=32),
    "e8p": dict(method="e8", bits=2, group_size=32),
    "rotated int": dict(method="gptq", bits=4, group_size=32, rotate="hadamard"),
    "trellis": dict(method="trellis", quantizer="trellis-l12", bits=2, group_size=32),  # k, v: 32 rows
    "mixed": dict(method="turboquant", bits=4, group_size=32,  # 3-bit down_proj, o_proj left in float
                  modules=[{"pattern": r"mlp\.down_proj", "bits": 3}, {"pattern": r"self_attn\.o_proj", "skip": True}]),
}
IDS = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
PROMPT = torch.tensor([[1, 17, 42, 99, 7]])
QUANTKIT_MODULES = (QuantLinear, DecodedLinear, CpuInt4Linear)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tiny_models import make_model_folder

    root = tmp_path_factory.mktemp("hf")
    src = make_model_folder("llama-tied-bias", root)  # GQA, tied embeddings, biases
    out = {}
    for name, settings in FORMATS.items():
        out[name] = root / name.replace(" ", "-")
        quantkit.quantize(str(src), out[name], quantkit.QuantConfig(**settings), calibration_ids=IDS)
    return out


@pytest.mark.parametrize("name", list(FORMATS))
def test_transformers_loads_the_quantkit_format_as_load_quantized_does(folders, name, tmp_path):
    ours = quantkit.load_quantized(folders[name], device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(folders[name])
    quantized = {n for n, m in theirs.named_modules() if isinstance(m, (QuantLinear, DecodedLinear))}
    # load_quantized repacks integer layers for torch's CPU int4 GEMM (CpuInt4Linear); transformers keeps QuantLinear
    assert quantized and quantized == {n for n, m in ours.named_modules() if isinstance(m, QUANTKIT_MODULES)}
    if name == "mixed":
        assert type(theirs.model.layers[0].self_attn.o_proj) is torch.nn.Linear
        assert theirs.model.layers[0].mlp.down_proj.quantizer.bits == 3
    with torch.no_grad():
        expected = ours(PROMPT).logits
        assert (theirs(PROMPT).logits - expected).abs().max().item() <= 1e-5
    tokens = ours.generate(PROMPT, max_new_tokens=6, do_sample=False)
    assert torch.equal(theirs.generate(PROMPT, max_new_tokens=6, do_sample=False), tokens)
    theirs.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert again.config.quantization_config.to_dict()["layers"] == theirs.config.quantization_config.layers
    with torch.no_grad():
        assert (again(PROMPT).logits - expected).abs().max().item() <= 1e-5


def test_bf16_through_transformers_matches_load_quantized_in_bf16(folders):
    ours = quantkit.load_quantized(folders["turboquant"], dtype=torch.bfloat16, device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(folders["turboquant"], dtype=torch.bfloat16)
    assert theirs.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(theirs(PROMPT).logits, ours(PROMPT).logits, rtol=0, atol=0)


def test_experts_that_transformers_holds_fused_are_refused_with_the_loader_that_reads_them(model_factory, tmp_path):
    out = tmp_path / "q"
    quantkit.quantize(str(model_factory("mixtral")), out, quantkit.QuantConfig(method="turboquant", group_size=32),
                      calibration_ids=IDS)
    with pytest.raises(QuantkitError, match="experts.*quantkit.load_quantized"):
        AutoModelForCausalLM.from_pretrained(out)
