"""`quantkit convert` (issue 11): exact repacks between gptq, gptq_v2, awq and compressed-tensors (codes, scales
and zeros equal after a round trip), floats skipped by a recipe carried over, and the refusals."""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from quantkit.api import load_quantized, quantize
from quantkit.cli import main
from quantkit.run.config import QuantConfig
from quantkit.core.errors import QuantkitError
from quantkit.checkpoint import files as checkpoint
from quantkit.run.convert import convert

IDS = torch.tensor([[1, 5, 9, 200, 31, 7, 64, 3]])
SKIP = [{"pattern": r"layers\.0\.mlp\.down_proj", "skip": True}]


def _tensors(folder):
    return checkpoint.read_tensors(folder)


def _logits(folder):
    with torch.no_grad():
        return load_quantized(folder, device="cpu")(IDS).logits


@pytest.fixture(scope="module")
def sources(model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    model = str(model_factory("llama-tied-bias"))
    made = {}
    for name, cfg in {"sym_v1": dict(sym=True, checkpoint_format="gptq"),
                      "asym_v2": dict(sym=False, checkpoint_format="gptq_v2"),
                      "bits3": dict(bits=3, checkpoint_format="gptq_v2")}.items():
        made[name] = root / name
        quantize(model, made[name], QuantConfig(**{"bits": 4, "group_size": 32, "modules": SKIP, **cfg}), device="cpu")
    return made


@pytest.mark.parametrize("src,chain", [
    ("sym_v1", ["awq", "compressed-tensors", "gptq"]),
    ("asym_v2", ["compressed-tensors", "awq", "gptq_v2"]),
    ("bits3", ["compressed-tensors", "gptq_v2"]),
])
def test_round_trip_is_exact(sources, tmp_path, src, chain):
    folder = sources[src]
    for i, fmt in enumerate(chain):
        folder_next = tmp_path / f"{i}-{fmt}"
        convert(folder, folder_next, fmt)
        assert torch.equal(_logits(folder_next), _logits(sources[src])), fmt
        folder = folder_next
    before, after = _tensors(sources[src]), _tensors(folder)
    assert before.keys() == after.keys()
    for key in before:  # qweight, qzeros, scales, g_idx, biases and float tensors: bit for bit
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key


def test_skipped_linears_are_declared(sources, tmp_path):
    convert(sources["asym_v2"], tmp_path / "awq", "awq")
    convert(sources["asym_v2"], tmp_path / "ct", "compressed-tensors")
    skip = "model.layers.0.mlp.down_proj"
    assert json.loads((tmp_path / "awq/config.json").read_text())["quantization_config"]["modules_to_not_convert"] == [skip]
    assert json.loads((tmp_path / "ct/config.json").read_text())["quantization_config"]["ignore"] == [skip]
    assert isinstance(load_quantized(tmp_path / "ct", device="cpu").get_submodule(skip), torch.nn.Linear)


def test_refusals(sources, model_factory, tmp_path):
    with pytest.raises(QuantkitError, match="awq cannot store .*4-bit codes only"):
        convert(sources["bits3"], tmp_path / "a", "awq")
    # g64 does not divide down_proj's 96 inputs: the fix is a new quantization, not a group size the folder lacks
    g64 = tmp_path / "g64"
    quantize(str(model_factory("llama")), g64, QuantConfig(bits=4, group_size=64), device="cpu")
    with pytest.raises(QuantkitError, match=r"\(96 here, group size 64\): quantize again with a --group-size"):
        convert(g64, tmp_path / "a", "awq")
    # a zero of 0 (all-positive group of an asymmetric grid written by another tool) has no v1 encoding
    folder = tmp_path / "zero0"
    convert(sources["asym_v2"], folder, "gptq_v2")
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.1.mlp.up_proj.qzeros"
    tensors[key][0, 0] = tensors[key][0, 0] & ~0xF  # zero of output 0, group 0 -> 0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantkitError, match="zero point of 0 cannot be stored in checkpoint format 'gptq'"):
        convert(folder, tmp_path / "b", "gptq")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_rotated_layers_are_refused(model_factory, tmp_path):
    src = tmp_path / "rot"
    quantize(str(model_factory("llama")), src, QuantConfig(bits=4, group_size=32, rotate="hadamard"), device="cpu")
    with pytest.raises(QuantkitError, match="rotated int layer, which only the quantkit format holds"):
        convert(src, tmp_path / "out", "gptq")


def test_cli_convert_and_overwrite(sources, tmp_path):
    out = tmp_path / "out"
    args = ["convert", str(sources["sym_v1"]), "-o", str(out), "--checkpoint-format", "compressed-tensors"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "gptq -> compressed-tensors" in result.output
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2 and "already exists" in again.output
    assert CliRunner().invoke(main, [*args, "--overwrite"]).exit_code == 0
    # the source's layout is named, not its quant_method ("gptq" for both GPTQ versions)
    v2 = CliRunner().invoke(main, ["convert", str(sources["asym_v2"]), "-o", str(tmp_path / "v2"),
                                   "--checkpoint-format", "compressed-tensors"])
    assert v2.exit_code == 0 and "gptq_v2 -> compressed-tensors" in v2.output, v2.output
    refused = CliRunner().invoke(main, ["convert", str(sources["bits3"]), "-o", str(tmp_path / "x"),
                                        "--checkpoint-format", "awq"])
    assert refused.exit_code == 2 and "error: --checkpoint-format awq cannot store" in refused.output
