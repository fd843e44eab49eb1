"""Sources their publisher already quantized to block-scaled FP8 (DeepSeek-V3, Qwen3-FP8): the streamed reader
dequantizes each weight by its block scales, and quantize then treats it as any floating-point weight."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import quantkit
from quantkit.models.hub import dequantize_fp8
from tiny_models import make_model_folder

BLOCK = (32, 32)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}


def fp8_release(src, root):
    """(an FP8 release of the model in `src`: its blocks' linear weights in e4m3 with a float32 scale per 32 x 32
    block, as DeepSeek publishes them; the floating-point model those weights decode to)."""
    tensors = load_file(src / "model.safetensors")
    fp8, decoded = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            blocks = torch.nn.functional.pad(w, (0, -w.shape[1] % BLOCK[1], 0, -w.shape[0] % BLOCK[0]))
            amax = blocks.unflatten(0, (-1, BLOCK[0])).unflatten(2, (-1, BLOCK[1])).abs().amax(dim=(1, 3))
            scale = (amax / 448).clamp(min=1e-12)
            q = (w / scale.repeat_interleave(BLOCK[0], 0)[:w.shape[0]].repeat_interleave(BLOCK[1], 1)[:, :w.shape[1]])
            fp8[name], fp8[f"{name}_scale_inv"] = q.to(torch.float8_e4m3fn), scale
            decoded[name] = dequantize_fp8(fp8[name], scale, BLOCK)
    folders = {}
    for kind, state in (("fp8", fp8), ("decoded", decoded)):
        folder = root / kind
        folder.mkdir()
        for f in src.iterdir():
            if f.name != "model.safetensors":
                (folder / f.name).write_bytes(f.read_bytes())
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        folders[kind] = folder
    config = json.loads((src / "config.json").read_text())
    (folders["fp8"] / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_CONFIG}))
    return folders["fp8"], folders["decoded"]


def test_an_fp8_release_quantizes_as_the_weights_it_decodes_to(tmp_path, capsys):
    fp8, decoded = fp8_release(make_model_folder("llama-gqa", tmp_path), tmp_path)
    config = quantkit.QuantConfig(method="rtn", group_size=32)
    quantkit.quantize(str(fp8), tmp_path / "q-fp8", config)
    assert "holds block-scaled FP8 weights (32 x 32 blocks): they are dequantized" in capsys.readouterr().err
    quantkit.quantize(str(decoded), tmp_path / "q-decoded", config)
    assert (tmp_path / "q-fp8" / "model.safetensors").read_bytes() == \
        (tmp_path / "q-decoded" / "model.safetensors").read_bytes()
    written = json.loads((tmp_path / "q-fp8" / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "gptq"  # the source's fp8 config is not carried over


def test_other_quantized_sources_stay_refused(tmp_path):
    src = make_model_folder("llama-gqa", tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": {**FP8_CONFIG, "fmt": "e5m2"}}))
    with pytest.raises(quantkit.QuantkitError, match="is already quantized"):
        quantkit.quantize(str(src), tmp_path / "q", quantkit.QuantConfig(method="rtn", group_size=32))
