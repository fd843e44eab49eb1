"""Reading checkpoints other GPTQ tools wrote (issue 11): AutoGPTQ folders whose only quantization config is
quantize_config.json (and whose shard is named after model_file_base_name), GPTQModel `dynamic` keys with and
without the "+:" sign, and formats quantkit cannot decode refused by name (AWQ and compressed-tensors folders:
tests/test_formats_foreign.py). The folders are laid out as those
tools document them, starting from a quantkit checkpoint whose tensors are already the GPTQ layout."""
import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from quantkit.api import load_quantized, quantize
from quantkit.cli import main
from quantkit.run.config import QuantConfig
from quantkit.core.errors import QuantkitError

IDS = torch.tensor([[1, 5, 9, 200, 31, 7, 64, 3]])


def _logits(folder):
    with torch.no_grad():
        return load_quantized(folder, device="cpu")(IDS).logits


@pytest.fixture(scope="module")
def gptq_folder(model_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("interop") / "q"
    modules = [{"pattern": r"layers\.1\.mlp\.down_proj", "bits": 8}, {"pattern": r"layers\.0\.mlp\.down_proj",
                                                                      "skip": True}]
    quantize(str(model_factory("llama")), out, QuantConfig(bits=4, group_size=32, modules=modules), device="cpu")
    return out


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_json(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def test_autogptq_folder_with_quantize_config_only(gptq_folder, tmp_path):
    folder = _copy(gptq_folder, tmp_path / "autogptq")
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    _edit_json(folder / "config.json", lambda c: c.pop("quantization_config"))
    # AutoGPTQ 0.6's quantize_config.json: no quant_method, no checkpoint_format (v1 zeros)
    autogptq = {"bits": 4, "group_size": 32, "damp_percent": 0.01, "desc_act": False, "static_groups": False,
                "sym": True, "true_sequential": True, "model_name_or_path": None,
                "model_file_base_name": "gptq_model-4bit-32g", "dynamic": qc["dynamic"]}
    (folder / "quantize_config.json").write_text(json.dumps(autogptq))
    (folder / "model.safetensors").rename(folder / "gptq_model-4bit-32g.safetensors")
    for name in ("quantkit_recipe.yaml", "quantkit_report.json"):
        (folder / name).unlink()
    assert torch.equal(_logits(folder), _logits(gptq_folder))
    result = CliRunner().invoke(main, ["inspect", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["layers"]["model.layers.1.mlp.down_proj"]["bits"] == 8


def test_dynamic_keys_without_sign_are_positive_matches(gptq_folder, tmp_path):
    folder = _copy(gptq_folder, tmp_path / "unsigned")

    def strip_plus(config):
        dyn = config["quantization_config"]["dynamic"]
        config["quantization_config"]["dynamic"] = {k.removeprefix("+:"): v for k, v in dyn.items()}

    _edit_json(folder / "config.json", strip_plus)
    keys = json.loads((folder / "config.json").read_text())["quantization_config"]["dynamic"]
    assert any(not k.startswith(("+:", "-:")) for k in keys)
    model = load_quantized(folder, device="cpu")
    assert model.get_submodule("model.layers.1.mlp.down_proj").bits == 8
    assert isinstance(model.get_submodule("model.layers.0.mlp.down_proj"), torch.nn.Linear)
    assert torch.equal(_logits(folder), _logits(gptq_folder))


@pytest.mark.parametrize("edit,words", [
    ({"checkpoint_format": "gptq_p"}, ["checkpoint_format 'gptq_p'", "cannot decode"]),
    ({"checkpoint_format": None, "format": "marlin"}, ["checkpoint_format 'marlin'"]),
    ({"is_marlin_format": True}, ["is_marlin_format"]),
    ({"quant_method": "bitsandbytes"}, ["quant_method 'bitsandbytes'", "'awq', 'compressed-tensors', 'gguf', 'gptq', 'quantkit'"]),
    # a GPTQ config relabelled: each codec refuses what is not its own layout, by name
    ({"quant_method": "compressed-tensors"}, ["compressed-tensors checkpoint of format None", "'pack-quantized'"]),
    ({"quant_method": "awq", "version": "exllama"}, ["AWQ checkpoint of version 'exllama'"]),
])
def test_foreign_formats_are_refused_by_name(gptq_folder, tmp_path, edit, words):
    folder = _copy(gptq_folder, tmp_path / "foreign")
    (folder / "quantkit_recipe.yaml").unlink()

    def apply(config):
        qc = config["quantization_config"]
        for key, value in edit.items():
            qc.pop(key, None) if value is None else qc.__setitem__(key, value)

    _edit_json(folder / "config.json", apply)
    with pytest.raises(QuantkitError) as err:
        load_quantized(folder, device="cpu")
    for w in words:
        assert w in str(err.value), str(err.value)
