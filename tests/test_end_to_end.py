"""Tiny random models: quantize -> write -> load_quantized -> logits match a fake-quant reference."""
import json

import pytest
import torch
from safetensors import safe_open

from quantkit.api import quantize
from quantkit.run.config import QuantConfig
from quantkit.checkpoint import files as checkpoint, gptq, shards
from quantkit.run.load import load_quantized
from quantkit.schemes.grid import Grid
from quantkit.algorithms.rtn import rtn
from quantkit.models.hub import load_fp_model
from quantkit.calibration.sequential import get_weight, set_weight
from quantkit.nn.kinds import INTEGER_GRID_LINEARS
from tiny_models import dequantize_gptq

IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))


def fake_quant_reference(folder, config):
    """The fp model with every quantized linear replaced by RTN's dequantized weight."""
    model, _ = load_fp_model(str(folder), "float32")
    for name, module in model.named_modules():
        if ".layers." in name or ".h." in name:
            spec = config.spec_for(name)
            if spec and (isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"):
                set_weight(module, rtn(get_weight(module), Grid(spec.bits, spec.sym), spec.group_size).dequantize())
    return model


def logits(model):
    with torch.inference_mode():
        return model(IDS).logits.float()


@pytest.mark.parametrize("kind", ["llama", "llama-gqa", "llama-tied-bias", "opt", "gpt2"])
@pytest.mark.parametrize("bits,group_size,sym", [(4, 32, True), (3, 48, False), (2, -1, False), (8, 128, True)])
def test_rtn_checkpoint_matches_fake_quant(model_factory, tmp_path, kind, bits, group_size, sym):
    src = model_factory(kind)
    config = QuantConfig(method="rtn", bits=bits, group_size=group_size, sym=sym)
    out = tmp_path / "q"
    quantize(str(src), out, config, device="cpu")
    model = load_quantized(out, device="cpu")
    n_quant = sum(isinstance(m, INTEGER_GRID_LINEARS) for m in model.modules())
    assert n_quant == len(json.loads((out / "quantkit_report.json").read_text())["layers"]) > 0
    ref = fake_quant_reference(src, config)
    torch.testing.assert_close(logits(model), logits(ref), rtol=1e-4, atol=1e-4)


def test_loaded_model_holds_no_fp_weights_of_quantized_layers(model_factory, tmp_path):
    out = tmp_path / "q"
    quantize(str(model_factory("llama-gqa")), out, QuantConfig(bits=4, group_size=32), device="cpu")
    model = load_quantized(out, device="cpu")
    q = model.model.layers[0].self_attn.k_proj
    assert isinstance(q, INTEGER_GRID_LINEARS) and q.out_features == 32  # GQA: 2 kv heads x 16
    assert not any(n.endswith("k_proj.weight") for n, _ in model.named_parameters())
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert "model.layers.0.self_attn.k_proj.weight" not in f.keys()
        assert "lm_head.weight" in f.keys()


def test_tied_embeddings_and_bias_survive(model_factory, tmp_path):
    out = tmp_path / "q"
    quantize(str(model_factory("llama-tied-bias")), out, QuantConfig(bits=4, group_size=32), device="cpu")
    model = load_quantized(out, device="cpu")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_gptq_checkpoint_reproduces_in_loop_weights(model_factory, tmp_path):
    """The weights GPTQ used while calibrating the next blocks are exactly what the checkpoint decodes to."""
    src = model_factory("llama-gqa")
    out = tmp_path / "q"
    config = QuantConfig(method="gptq", bits=3, group_size=32, nsamples=4, seqlen=32)
    calib = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))
    quantize(str(src), out, config, device="cpu", calibration_ids=calib)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["bits"] == 3 and qc["checkpoint_format"] == "gptq"
    tensors = checkpoint.read_tensors(out)
    ref, _ = load_fp_model(str(src), "float32")
    for name, module in ref.named_modules():
        if f"{name}.qweight" in tensors:
            t = {s: tensors[f"{name}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}
            set_weight(module, dequantize_gptq(t, 3, module.in_features))
    torch.testing.assert_close(logits(load_quantized(out, device="cpu")), logits(ref), rtol=1e-4, atol=1e-4)
    report = json.loads((out / "quantkit_report.json").read_text())
    assert all(0 <= r["error"] < 1 for r in report["layers"].values())


def test_per_module_overrides(model_factory, tmp_path):
    out = tmp_path / "q"
    config = QuantConfig(bits=4, group_size=32, modules=[
        {"pattern": r"layers\.0\.mlp\.down_proj", "bits": 8},
        {"pattern": r"o_proj", "skip": True}])
    quantize(str(model_factory("llama")), out, config, device="cpu")
    model = load_quantized(out, device="cpu")
    assert model.model.layers[0].mlp.down_proj.bits == 8
    assert model.model.layers[1].mlp.down_proj.bits == 4
    assert isinstance(model.model.layers[0].self_attn.o_proj, torch.nn.Linear)
    torch.testing.assert_close(logits(model), logits(fake_quant_reference(model_factory("llama"), config)),
                               rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_has_index(model_factory, tmp_path):
    out = tmp_path / "q"
    quantize(str(model_factory("llama")), out, QuantConfig(max_shard_size="40KB"), device="cpu")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (out / "model.safetensors").exists()
    load_quantized(out, device="cpu")


def test_failed_run_leaves_nothing(model_factory, tmp_path, monkeypatch):
    out = tmp_path / "q"

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(shards, "write_file", boom)  # what a streamed run writes its part files with
    with pytest.raises(RuntimeError):
        quantize(str(model_factory("llama")), out, QuantConfig(), device="cpu")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_replaces_only_when_complete(model_factory, tmp_path):
    out = tmp_path / "q"
    quantize(str(model_factory("llama")), out, QuantConfig(bits=4), device="cpu")
    quantize(str(model_factory("llama")), out, QuantConfig(bits=8), device="cpu", overwrite=True)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_bf16_model(model_factory, tmp_path):
    src = model_factory("llama-gqa")
    out = tmp_path / "q"
    quantize(str(src), out, QuantConfig(bits=4, group_size=32), device="cpu", dtype="bfloat16")
    model = load_quantized(out, dtype="bfloat16", device="cpu")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.isfinite(logits(model)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["gptq", "awq+gptq"])
def test_calibrated_quantization_on_cuda_matches_cpu_quality(model_factory, tmp_path, method):
    src = model_factory("llama-gqa")
    calib = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))
    errors = {}
    for device in ("cpu", "cuda"):
        config = QuantConfig(method=method, bits=4, group_size=32, nsamples=4, seqlen=32)
        report = quantize(str(src), tmp_path / device, config, device=device, calibration_ids=calib)
        errors[device] = sum(r["error"] for r in report["layers"].values())
    assert errors["cuda"] == pytest.approx(errors["cpu"], rel=0.05)
    model = load_quantized(tmp_path / "cuda", device_map="auto")
    assert torch.isfinite(model(IDS.cuda()).logits).all()
